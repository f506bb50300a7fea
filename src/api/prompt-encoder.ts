// Tokenizing prompts without stalling the event loop. A short prompt is tokenized inline (a few milliseconds at
// most); a long one goes to a tokenizer thread, so /live, streams and other requests carry on while it is split.
// Tokenizing a few MiB takes seconds: done inline it would hold up every client of the process for that long.

import type { Worker } from 'node:worker_threads';
import type { EncodeOptions, Tokenizer } from '../model/tokenizer/types.ts';
import { startTsWorker } from '../util/worker-thread.ts';
import type { EncodeAnswer, EncodeJob } from './tokenize-thread.ts';

/** Prompts of this many UTF-16 code units or more are tokenized on the tokenizer thread. */
export const DEFAULT_OFF_THREAD_CHARS = 4 * 1024;

const THREAD = new URL('./tokenize-thread.ts', import.meta.url);

interface Pending {
  resolve: (ids: number[]) => void;
  reject: (err: Error) => void;
}

export class PromptEncoder {
  private worker: Worker | undefined;
  private readonly pending = new Map<number, Pending>();
  private nextId = 0;
  /** Prompts tokenized on the thread so far. */
  offThreadCount = 0;

  constructor(readonly tokenizer: Tokenizer, private readonly offThreadChars = DEFAULT_OFF_THREAD_CHARS) {}

  async encode(text: string, options: EncodeOptions): Promise<number[]> {
    const source = text.length >= this.offThreadChars ? this.tokenizer.workerSource?.() : undefined;
    if (!source) return this.tokenizer.encode(text, options);
    const worker = this.worker ?? this.start(source);
    const id = this.nextId++;
    this.offThreadCount++;
    return new Promise<number[]>((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      if (this.pending.size === 1) worker.ref();
      worker.postMessage({ id, text, options } satisfies EncodeJob);
    });
  }

  /** Stops the thread; prompts still on it are refused. */
  async close(): Promise<void> {
    const worker = this.worker;
    this.worker = undefined;
    this.failAll(new Error('the tokenizer thread was stopped'));
    await worker?.terminate();
  }

  private start(source: NonNullable<ReturnType<NonNullable<Tokenizer['workerSource']>>>): Worker {
    const worker = startTsWorker(THREAD, source);
    worker.on('message', (answer: EncodeAnswer) => {
      const waiter = this.pending.get(answer.id);
      if (!waiter) return;
      this.pending.delete(answer.id);
      if (this.pending.size === 0) worker.unref();
      if ('ids' in answer) {
        waiter.resolve(Array.from(answer.ids));
      } else {
        const error = new Error(answer.error.message);
        error.name = answer.error.name;
        waiter.reject(error);
      }
    });
    // A thread that fails is dropped; the next long prompt starts a new one.
    const lost = (why: string): void => {
      if (this.worker === worker) this.worker = undefined;
      this.failAll(new Error(`the tokenizer thread stopped: ${why}`));
    };
    worker.on('error', (err) => lost(err.message));
    worker.on('exit', (code) => lost(`exit code ${code}`));
    worker.unref();
    this.worker = worker;
    return worker;
  }

  private failAll(error: Error): void {
    for (const waiter of this.pending.values()) waiter.reject(error);
    this.pending.clear();
  }
}
