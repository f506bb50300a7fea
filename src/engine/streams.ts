// The async side of an engine face: results pushed as messages or simulated steps arrive, pulled by the caller's
// `for await`. One queue implementation serves the local engine, the simulated engine and prefill handoffs.

import type { EngineOutput } from './types.ts';

/** A push/pull queue: items in order, then the end, or a failure thrown to the reader after the items before it. */
export class AsyncQueue<T> {
  private readonly buffer: T[] = [];
  private wake: (() => void) | undefined;
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

  private notify(): void {
    const wake = this.wake;
    this.wake = undefined;
    wake?.();
  }

  async *drain(): AsyncGenerator<T> {
    for (;;) {
      while (this.buffer.length > 0) yield this.buffer.shift()!;
      if (this.failure) throw this.failure;
      if (this.ended) return;
      await new Promise<void>((resolve) => { this.wake = resolve; });
    }
  }
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
  abort: (requestId: string) => void): AsyncIterable<T> {
  return (async function* () {
    try {
      yield* queue.drain();
    } finally {
      if (registry.get(requestId) === queue) {
        if (!queue.done) abort(requestId);
        registry.delete(requestId);
      }
    }
  })();
}
