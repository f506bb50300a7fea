// What happens when every worker is busy: requests wait in a bounded queue at the router (cheap: no KV, no slot on
// a worker) and past the bound are shed with a Retry-After hint. Sending them on anyway would only move the queue
// into a worker, where it holds KV blocks and delays everyone's decode steps.
//
// Both pieces are pure: the queue is drained by its owner when load drops, and the retry hint is computed from
// finish times the owner reports.

export interface QueuedEntry<T> {
  id: string;
  item: T;
  enqueuedAtMs: number;
}

export class AdmissionQueue<T> {
  readonly maxQueued: number;
  readonly maxWaitMs: number;
  private readonly entries = new Map<string, QueuedEntry<T>>();

  /** maxWaitMs: a request queued longer than this is handed back as expired (the client has likely given up). */
  constructor(options: { maxQueued: number; maxWaitMs: number }) {
    if (!Number.isSafeInteger(options.maxQueued) || options.maxQueued < 0) {
      throw new RangeError(`maxQueued must be an integer >= 0, got ${options.maxQueued}`);
    }
    if (!(options.maxWaitMs > 0)) throw new RangeError(`maxWaitMs must be > 0, got ${options.maxWaitMs}`);
    this.maxQueued = options.maxQueued;
    this.maxWaitMs = options.maxWaitMs;
  }

  get size(): number {
    return this.entries.size;
  }

  get isFull(): boolean {
    return this.entries.size >= this.maxQueued;
  }

  has(id: string): boolean {
    return this.entries.has(id);
  }

  /** False when full (the caller sheds the request). */
  offer(id: string, item: T, nowMs: number): boolean {
    if (this.isFull) return false;
    if (this.entries.has(id)) throw new Error(`request ${id} is already queued`);
    this.entries.set(id, { id, item, enqueuedAtMs: nowMs });
    return true;
  }

  /** The entries, oldest first (a snapshot: removing while iterating it is safe). */
  inOrder(): QueuedEntry<T>[] {
    return [...this.entries.values()];
  }

  /** Takes the oldest entry (a Map iterates in insertion order, which is FIFO here). */
  shift(): QueuedEntry<T> | undefined {
    const entry: QueuedEntry<T> | undefined = this.entries.values().next().value;
    if (entry !== undefined) this.entries.delete(entry.id);
    return entry;
  }

  remove(id: string): QueuedEntry<T> | undefined {
    const entry = this.entries.get(id);
    if (entry !== undefined) this.entries.delete(id);
    return entry;
  }

  /** Removes and returns entries queued for maxWaitMs or longer. */
  takeExpired(nowMs: number): QueuedEntry<T>[] {
    const expired: QueuedEntry<T>[] = [];
    for (const entry of this.entries.values()) {
      if (nowMs - entry.enqueuedAtMs < this.maxWaitMs) break; // FIFO: the rest were queued later
      expired.push(entry);
    }
    for (const entry of expired) this.entries.delete(entry.id);
    return expired;
  }
}

export interface RetryAfterOptions {
  /** Finish times remembered to estimate the drain rate. */
  windowSize?: number;
  minRetryAfterMs?: number;
  maxRetryAfterMs?: number;
  /** When no recent finishes give a rate (nothing finished yet, or nothing for maxRetryAfterMs). */
  defaultRetryAfterMs?: number;
}

/**
 * How long a shed client should wait: the requests ahead of it divided by the rate at which requests finish
 * (each finish frees room for one more), clamped. A hint, not a promise; it only has to keep retries from arriving
 * before there is room for them.
 */
export class RetryAfterEstimator {
  private readonly finishTimesMs: number[] = [];
  private readonly windowSize: number;
  readonly minRetryAfterMs: number;
  readonly maxRetryAfterMs: number;
  readonly defaultRetryAfterMs: number;

  constructor(options: RetryAfterOptions = {}) {
    this.windowSize = options.windowSize ?? 64;
    this.minRetryAfterMs = options.minRetryAfterMs ?? 1000;
    this.maxRetryAfterMs = options.maxRetryAfterMs ?? 30_000;
    this.defaultRetryAfterMs = options.defaultRetryAfterMs ?? 2000;
    if (this.windowSize < 2) throw new RangeError('windowSize must be >= 2');
    if (!(this.minRetryAfterMs <= this.maxRetryAfterMs)) throw new RangeError('minRetryAfterMs must be <= maxRetryAfterMs');
  }

  recordFinish(nowMs: number): void {
    this.finishTimesMs.push(nowMs);
    if (this.finishTimesMs.length > this.windowSize) this.finishTimesMs.shift();
  }

  /** Hint for a request with numAhead requests to be admitted before it (itself included). */
  retryAfterMs(numAhead: number, nowMs: number): number {
    const times = this.finishTimesMs;
    const clamp = (ms: number) => Math.min(this.maxRetryAfterMs, Math.max(this.minRetryAfterMs, Math.ceil(ms)));
    if (times.length < 2 || nowMs - times[times.length - 1]! > this.maxRetryAfterMs) return clamp(this.defaultRetryAfterMs);
    const spanMs = times[times.length - 1]! - times[0]!;
    if (spanMs <= 0) return clamp(this.minRetryAfterMs);
    const finishesPerMs = (times.length - 1) / spanMs;
    return clamp(numAhead / finishesPerMs);
  }
}
