// Blocks the router assumes a worker holds because it just sent the worker a prompt, before the worker's KV events
// say so. Without this, a burst of requests sharing a prefix is routed before the first one's `stored` event
// arrives, each sees no overlap anywhere, and the prefix gets computed on every worker.
//
// An assumption ends when the real event confirms it (the KV index vouches from then on), when the worker reports
// the block removed, or when it expires: a request that is aborted or queued for long never stores its blocks, and
// a worker without KV events never confirms anything, so every assumption carries a deadline.

import type { BlockHash } from '../protocols/kv-events.ts';
import { prefixDepths } from './kv-index.ts';
import type { WorkerId } from './protocols.ts';

interface Expiry {
  hash: BlockHash;
  workerId: WorkerId;
  expiresAtMs: number;
}

export class SpeculativePrefixes {
  readonly ttlMs: number;
  /** hash -> worker -> expiry time. */
  private readonly holders = new Map<BlockHash, Map<WorkerId, number>>();
  /**
   * Assumptions in insertion order. With one ttl, that is also expiry order, so pruning pops from the front. An
   * entry refreshed or dropped since stays here and is skipped when its time comes (its expiry no longer matches).
   */
  private expiries: Expiry[] = [];
  private expiriesHead = 0;
  private entries = 0;

  constructor(ttlMs: number) {
    if (!(ttlMs >= 0)) throw new RangeError(`speculative ttlMs must be >= 0, got ${ttlMs}`);
    this.ttlMs = ttlMs;
  }

  /** (worker, block) assumptions currently held, expired ones not yet pruned included. */
  get size(): number {
    return this.entries;
  }

  /** Entries the expiry queue's array holds, consumed ones awaiting compaction included: what it costs in memory. */
  get expiryQueueLength(): number {
    return this.expiries.length;
  }

  insert(workerId: WorkerId, hashes: readonly BlockHash[], nowMs: number): void {
    if (this.ttlMs === 0) return;
    const expiresAtMs = nowMs + this.ttlMs;
    for (const hash of hashes) {
      let workers = this.holders.get(hash);
      if (workers === undefined) this.holders.set(hash, workers = new Map());
      if (!workers.has(workerId)) this.entries++;
      workers.set(workerId, expiresAtMs);
      this.expiries.push({ hash, workerId, expiresAtMs });
    }
  }

  /** The worker's own events now speak for these blocks (stored) or against them (removed). */
  drop(workerId: WorkerId, hashes: readonly BlockHash[]): void {
    for (const hash of hashes) {
      const workers = this.holders.get(hash);
      if (workers === undefined || !workers.delete(workerId)) continue;
      this.entries--;
      if (workers.size === 0) this.holders.delete(hash);
    }
  }

  removeWorker(workerId: WorkerId): void {
    for (const [hash, workers] of this.holders) {
      if (!workers.delete(workerId)) continue;
      this.entries--;
      if (workers.size === 0) this.holders.delete(hash);
    }
  }

  /** Forgets assumptions whose deadline is at or before nowMs. */
  prune(nowMs: number): void {
    const queue = this.expiries;
    let head = this.expiriesHead;
    while (head < queue.length && queue[head]!.expiresAtMs <= nowMs) {
      const { hash, workerId, expiresAtMs } = queue[head++]!;
      const workers = this.holders.get(hash);
      if (workers?.get(workerId) !== expiresAtMs) continue;
      workers.delete(workerId);
      this.entries--;
      if (workers.size === 0) this.holders.delete(hash);
    }
    // Compact once the consumed front dominates, so the array does not grow without bound.
    if (head > 1024 && head * 2 > queue.length) {
      this.expiries = queue.slice(head);
      head = 0;
    }
    this.expiriesHead = head;
  }

  holds(workerId: WorkerId, hash: BlockHash, nowMs: number): boolean {
    const expiresAtMs = this.holders.get(hash)?.get(workerId);
    return expiresAtMs !== undefined && expiresAtMs > nowMs;
  }

  /** Like KvIndex.findMatches, over unexpired assumptions only. */
  findMatches(hashes: readonly BlockHash[], nowMs: number): Map<WorkerId, number> {
    const first = hashes.length > 0 ? this.holders.get(hashes[0]!) : undefined;
    const active: WorkerId[] = [];
    for (const [workerId, expiresAtMs] of first ?? []) if (expiresAtMs > nowMs) active.push(workerId);
    return prefixDepths(hashes, active, (workerId, hash) => this.holds(workerId, hash, nowMs));
  }
}
