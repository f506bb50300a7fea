// The async side of an engine face: results pushed as messages or simulated steps arrive, pulled by the caller's
// `for await`. One queue implementation serves the local engine, the simulated engine and prefill handoffs.

import type { EngineOutput } from './types.ts';

const DONE: IteratorReturnResult<undefined> = Object.freeze({ value: undefined, done: true });

/** A reader of a queue: finished once it was given the end or the failure, or left (return). */
interface Reader {
  finished: boolean;
  onFinish: (() => void) | undefined;
}

interface Waiter<T> {
  reader: Reader;
  resolve(result: IteratorResult<T, undefined>): void;
  reject(error: Error): void;
}

/**
 * A push/pull queue: items in order, then the end, or a failure thrown to the reader after the items before it.
 * Its readers are plain iterators rather than async generators: an item pushed to a reader that waits settles that
 * reader's promise directly, one promise per item, which is what a stream of one output per decode step costs.
 */
export class AsyncQueue<T> {
  private readonly buffer: T[] = [];
  private readonly waiters: Waiter<T>[] = [];
  private failure: Error | undefined;
  private ended = false;

  push(item: T): void {
    this.buffer.push(item);
    this.notify();
  }

  end(): void {
    this.ended = true;
    this.notify();
  }

  fail(error: Error): void {
    this.failure = error;
    this.notify();
  }

  get done(): boolean {
    return this.ended;
  }

  /**
   * The queue's items as an iterator. `onFinish` runs once, when the reader has been given the end or the failure
   * or leaves early (return); given them while it waited, it runs a microtask later, after whatever pushed them.
   */
  drain(onFinish?: () => void): AsyncIterableIterator<T> {
    const reader: Reader = { finished: false, onFinish };
    return {
      next: () => this.take(reader),
      return: () => {
        this.leave(reader);
        return Promise.resolve(DONE);
      },
      [Symbol.asyncIterator]() {
        return this;
      },
    };
  }

  private take(reader: Reader): Promise<IteratorResult<T, undefined>> {
    if (reader.finished) return Promise.resolve(DONE);
    if (this.buffer.length > 0) return Promise.resolve({ value: this.buffer.shift()!, done: false });
    if (this.failure) {
      finish(reader);
      return Promise.reject(this.failure);
    }
    if (this.ended) {
      finish(reader);
      return Promise.resolve(DONE);
    }
    return new Promise((resolve, reject) => this.waiters.push({ reader, resolve, reject }));
  }

  /** Settles the readers that wait, in the order they asked, for as long as there is something to give them. */
  private notify(): void {
    while (this.waiters.length > 0) {
      if (this.buffer.length > 0) {
        this.waiters.shift()!.resolve({ value: this.buffer.shift()!, done: false });
        continue;
      }
      if (!this.failure && !this.ended) return;
      const waiter = this.waiters.shift()!;
      if (waiter.reader.finished) {
        waiter.resolve(DONE);
        continue;
      }
      if (this.failure) waiter.reject(this.failure);
      else waiter.resolve(DONE);
      queueMicrotask(() => finish(waiter.reader));
      waiter.reader.finished = true;
    }
  }

  /** A reader leaves: what it still waits for ends, its finish runs now. */
  private leave(reader: Reader): void {
    for (let i = this.waiters.length - 1; i >= 0; i--) {
      const waiter = this.waiters[i]!;
      if (waiter.reader !== reader) continue;
      this.waiters.splice(i, 1);
      waiter.resolve(DONE);
    }
    finish(reader);
  }
}

function finish(reader: Reader): void {
  const onFinish = reader.onFinish;
  reader.finished = true;
  reader.onFinish = undefined;
  onFinish?.();
}

/** One request's outputs; it ends once each of its n completions has output a finish reason. */
export class OutputStream extends AsyncQueue<EngineOutput> {
  private readonly unfinished: Set<number>;

  constructor(numCompletions: number) {
    super();
    this.unfinished = new Set(Array.from({ length: numCompletions }, (_, i) => i));
  }

  override push(output: EngineOutput): void {
    super.push(output);
    if (output.finishReason !== undefined) this.unfinished.delete(output.index);
    if (this.unfinished.size === 0) this.end();
  }
}

/**
 * A request's queue as the caller's iterable. A caller that stops before the end (client gone) aborts the request;
 * either way the queue leaves `registry`, if it is still the one registered under the id (a new request may reuse
 * the id once this one ended).
 */
export function followQueue<T>(registry: Map<string, AsyncQueue<T>>, requestId: string, queue: AsyncQueue<T>,
  abort: (requestId: string) => void): AsyncIterableIterator<T> {
  return queue.drain(() => {
    if (registry.get(requestId) === queue) {
      if (!queue.done) abort(requestId);
      registry.delete(requestId);
    }
  });
}
