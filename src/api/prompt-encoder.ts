// Tokenizing prompts without stalling the event loop. A short prompt is tokenized inline (a few milliseconds at
// most); a long one goes to a tokenizer thread, so /live, streams and other requests carry on while it is split.
// Tokenizing a few MiB takes seconds: done inline it would hold up every client of the process for that long.
//
// The thread is shared by every request of the model, so it is handed one job at a time from a queue kept here:
// jobs are taken from their owners (tenants) in turn, the owner served least recently first, so one tenant's pile of
// long prompts delays another tenant's prompt by at most the job running and one job of each other tenant with work
// queued; a job whose caller gave up (its signal aborted: the client left) leaves the queue without being tokenized,
// and a long one already running is abandoned by stopping the thread (the next job starts a new one).

import type { Worker } from 'node:worker_threads';
import type { EncodeOptions, Tokenizer } from '../model/tokenizer/types.ts';
import { startTsWorker } from '../util/worker-thread.ts';
import type { EncodeAnswer, EncodeJob } from './tokenize-thread.ts';

/** Prompts of this many UTF-16 code units or more are tokenized on the tokenizer thread. */
export const DEFAULT_OFF_THREAD_CHARS = 4 * 1024;

/**
 * A running job whose caller gave up is abandoned by stopping the thread when its text is at least this long
 * (UTF-16 units): starting a new thread takes about as long as tokenizing this much, so a shorter job is left to
 * finish and its answer dropped.
 */
export const DEFAULT_ABANDON_CHARS = 512 * 1024;

const THREAD = new URL('./tokenize-thread.ts', import.meta.url);

/** Whose a job is and when its caller gives up. */
export interface EncodeControl {
  /** Aborted when the caller no longer wants the ids: the job is dropped, and the promise rejects with the reason. */
  signal?: AbortSignal;
  /** The queue the job waits in (a tenant's name): owners are served in turn. Default: one shared queue. */
  owner?: string;
}

interface Job {
  id: number;
  text: string;
  options: EncodeOptions;
  owner: string;
  signal: AbortSignal | undefined;
  resolve: (ids: number[]) => void;
  reject: (err: unknown) => void;
  /** Stops listening to the signal. */
  detach: () => void;
}

export class PromptEncoder {
  private worker: Worker | undefined;
  /** The job on the thread now (one at a time). */
  private running: Job | undefined;
  /**
   * A job whose caller gave up, left to finish on the thread (too short to be worth a new one): the thread is not
   * free until its answer comes. The next job waits here meanwhile, where it can still be dropped; handed on at once,
   * it would queue on the thread and be tokenized whether its caller stayed or not.
   */
  private finishing: number | undefined;
  /** Waiting jobs by owner, owners in the order their first waiting job came. */
  private readonly queues = new Map<string, Job[]>();
  /** When each owner last had a job handed to the thread (a count of jobs handed): owners are few (tenants). */
  private readonly lastServed = new Map<string, number>();
  private served = 0;
  private nextId = 0;
  private closed = false;
  /** Prompts handed to the thread so far (a job dropped before its turn is not counted). */
  offThreadCount = 0;
  /** Jobs that left the queue, or the thread, because their caller gave up. */
  droppedCount = 0;
  /** Threads stopped to abandon a job whose caller gave up. */
  abandonedThreads = 0;

  constructor(readonly tokenizer: Tokenizer, private readonly offThreadChars = DEFAULT_OFF_THREAD_CHARS,
    private readonly abandonChars = DEFAULT_ABANDON_CHARS) {}

  /** Jobs waiting for the thread (not the one on it). */
  get queued(): number {
    let count = 0;
    for (const jobs of this.queues.values()) count += jobs.length;
    return count;
  }

  /** Whether a job is on the thread now. */
  get busy(): boolean {
    return this.running !== undefined;
  }

  async encode(text: string, options: EncodeOptions, control: EncodeControl = {}): Promise<number[]> {
    const { signal } = control;
    if (signal?.aborted) throw signal.reason;
    const source = text.length >= this.offThreadChars ? this.tokenizer.workerSource?.() : undefined;
    if (!source) return this.tokenizer.encode(text, options);
    if (this.closed) throw new Error('the tokenizer thread was stopped');
    return new Promise<number[]>((resolve, reject) => {
      const job: Job = {
        id: this.nextId++, text, options, owner: control.owner ?? '', signal, resolve, reject, detach: () => {},
      };
      if (signal) {
        const onAbort = (): void => this.giveUp(job);
        signal.addEventListener('abort', onAbort, { once: true });
        job.detach = () => signal.removeEventListener('abort', onAbort);
      }
      const queue = this.queues.get(job.owner);
      if (queue) queue.push(job);
      else this.queues.set(job.owner, [job]);
      this.pump(source);
    });
  }

  /** Stops the thread; prompts on it or waiting for it are refused. */
  async close(): Promise<void> {
    this.closed = true;
    const worker = this.worker;
    this.worker = undefined;
    const error = new Error('the tokenizer thread was stopped');
    const running = this.running;
    this.running = undefined;
    if (running) this.settle(running, () => running.reject(error));
    for (const jobs of this.queues.values()) for (const job of jobs) this.settle(job, () => job.reject(error));
    this.queues.clear();
    await worker?.terminate();
  }

  /** The caller of `job` gave up: out of the queue, or off the thread when it is long enough to be worth it. */
  private giveUp(job: Job): void {
    const reason = job.signal?.reason;
    if (this.running === job) {
      this.running = undefined;
      this.droppedCount++;
      this.settle(job, () => job.reject(reason));
      if (job.text.length >= this.abandonChars && this.worker) {
        const worker = this.worker;
        this.worker = undefined;
        this.abandonedThreads++;
        void worker.terminate();
      } else if (this.worker) {
        this.finishing = job.id;
      }
      this.pump();
      return;
    }
    const queue = this.queues.get(job.owner);
    const at = queue?.indexOf(job) ?? -1;
    if (at < 0) return;
    queue!.splice(at, 1);
    if (queue!.length === 0) this.queues.delete(job.owner);
    this.droppedCount++;
    this.settle(job, () => job.reject(reason));
  }

  private settle(job: Job, finish: () => void): void {
    job.detach();
    finish();
  }

  /**
   * Hands the next job to the thread when it is free: the oldest job of the owner served least recently (one never
   * served first; ties in the order the owners' jobs came).
   */
  private pump(source = this.tokenizer.workerSource?.()): void {
    if (this.running || this.finishing !== undefined || this.closed) return;
    let owner: string | undefined;
    let oldest = Infinity;
    for (const candidate of this.queues.keys()) {
      const last = this.lastServed.get(candidate) ?? -1;
      if (last < oldest) {
        oldest = last;
        owner = candidate;
      }
    }
    if (owner === undefined) return;
    const jobs = this.queues.get(owner)!;
    const job = jobs.shift()!;
    if (jobs.length === 0) this.queues.delete(owner);
    this.lastServed.set(owner, this.served++);
    if (!source) {
      // The tokenizer can no longer be rebuilt on a thread: tokenized here.
      this.settle(job, () => {
        try {
          job.resolve(this.tokenizer.encode(job.text, job.options));
        } catch (err) {
          job.reject(err);
        }
      });
      this.pump();
      return;
    }
    const worker = this.worker ?? this.start(source);
    this.running = job;
    this.offThreadCount++;
    worker.ref();
    worker.postMessage({ id: job.id, text: job.text, options: job.options } satisfies EncodeJob);
  }

  private start(source: NonNullable<ReturnType<NonNullable<Tokenizer['workerSource']>>>): Worker {
    const worker = startTsWorker(THREAD, source);
    worker.on('message', (answer: EncodeAnswer) => {
      if (this.worker !== worker) return;
      const job = this.running;
      // An answer for a job whose caller gave up while it ran: dropped.
      if (job?.id === answer.id) {
        this.running = undefined;
        worker.unref();
        this.settle(job, () => {
          if ('ids' in answer) {
            job.resolve(Array.from(answer.ids));
          } else {
            const error = new Error(answer.error.message);
            error.name = answer.error.name;
            job.reject(error);
          }
        });
      } else if (answer.id === this.finishing) {
        this.finishing = undefined;
        worker.unref();
      }
      this.pump();
    });
    // A thread that fails is dropped, and the job on it refused; the next job starts a new one.
    const lost = (why: string): void => {
      if (this.worker !== worker) return;
      this.worker = undefined;
      this.finishing = undefined;
      const job = this.running;
      this.running = undefined;
      if (job) this.settle(job, () => job.reject(new Error(`the tokenizer thread stopped: ${why}`)));
      this.pump();
    };
    worker.on('error', (err) => lost(err.message));
    worker.on('exit', (code) => lost(`exit code ${code}`));
    worker.unref();
    this.worker = worker;
    return worker;
  }
}
