// The policies that do not read the KV index, and session affinity. Each picks among candidates the load guard
// has already filtered (non-busy workers when there are any), so none of them piles onto a saturated worker.

import type { WorkerView } from './cost.ts';
import type { WorkerId } from './protocols.ts';
import { randomIndex } from '../util/random.ts';
import type { RandomSource } from '../util/random.ts';

/**
 * Requests in flight on a worker: its report, or this router's own count when that is larger (the report lags a
 * burst). Ties are broken on the blocks it holds, then by the caller.
 */
export function requestsInFlight(view: WorkerView): number {
  return Math.max(view.reported.numRunning + view.reported.numWaiting, view.own.numRequests);
}

function heldBlocks(view: WorkerView): number {
  return Math.max(view.reported.activeDecodeBlocks, view.own.numBlocks);
}

/** Negative when a is less loaded than b. */
export function compareLoad(a: WorkerView, b: WorkerView): number {
  return requestsInFlight(a) - requestsInFlight(b) || heldBlocks(a) - heldBlocks(b);
}

export function pickRandom(candidates: readonly WorkerView[], random: RandomSource): number {
  return randomIndex(random, candidates.length);
}

/** The least loaded candidate; equally loaded ones are drawn uniformly, so idle workers share a burst evenly. */
export function pickLeastLoaded(candidates: readonly WorkerView[], random: RandomSource): number {
  let best: number[] = [];
  for (let i = 0; i < candidates.length; i++) {
    const order = best.length === 0 ? -1 : compareLoad(candidates[i]!, candidates[best[0]!]!);
    if (order < 0) best = [i];
    else if (order === 0) best.push(i);
  }
  return best[randomIndex(random, best.length)]!;
}

/**
 * Two distinct candidates drawn at random, the less loaded wins (the first drawn on a tie). Nearly as even as
 * least-loaded, but stale load views do not make every router send to the same worker.
 */
export function pickPowerOfTwo(candidates: readonly WorkerView[], random: RandomSource): number {
  if (candidates.length === 1) return 0;
  const first = randomIndex(random, candidates.length);
  let second = randomIndex(random, candidates.length - 1);
  if (second >= first) second++;
  return compareLoad(candidates[second]!, candidates[first]!) < 0 ? second : first;
}

// ---------------------------------------------------------------------------------------------------------------
// Session affinity

interface Session {
  workerId: WorkerId;
  lastUsedMs: number;
}

/**
 * Session id -> worker, so the turns of a conversation land where its history is cached even when KV events are
 * off or late. Entries expire after ttlMs without use; past maxSessions the least recently used is dropped.
 */
export class SessionAffinity {
  readonly ttlMs: number;
  readonly maxSessions: number;
  /** Insertion order is recency order: each use deletes and re-inserts. */
  private readonly sessions = new Map<string, Session>();

  constructor(options: { ttlMs: number; maxSessions: number }) {
    if (!(options.ttlMs > 0)) throw new RangeError(`session ttlMs must be > 0, got ${options.ttlMs}`);
    if (!Number.isSafeInteger(options.maxSessions) || options.maxSessions < 1) {
      throw new RangeError(`maxSessions must be a positive integer, got ${options.maxSessions}`);
    }
    this.ttlMs = options.ttlMs;
    this.maxSessions = options.maxSessions;
  }

  get size(): number {
    return this.sessions.size;
  }

  /** The session's worker, unless the session is unknown or expired. */
  get(sessionId: string, nowMs: number): WorkerId | undefined {
    const session = this.sessions.get(sessionId);
    if (session === undefined) return undefined;
    if (nowMs - session.lastUsedMs >= this.ttlMs) {
      this.sessions.delete(sessionId);
      return undefined;
    }
    return session.workerId;
  }

  set(sessionId: string, workerId: WorkerId, nowMs: number): void {
    this.sessions.delete(sessionId);
    this.sessions.set(sessionId, { workerId, lastUsedMs: nowMs });
    this.prune(nowMs);
  }

  removeWorker(workerId: WorkerId): void {
    for (const [sessionId, session] of this.sessions) if (session.workerId === workerId) this.sessions.delete(sessionId);
  }

  private prune(nowMs: number): void {
    for (const [sessionId, session] of this.sessions) {
      if (this.sessions.size <= this.maxSessions && nowMs - session.lastUsedMs < this.ttlMs) break;
      this.sessions.delete(sessionId);
    }
  }
}
