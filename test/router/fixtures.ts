// Shared builders for the router tests: token prompts, their block hashes (the engine's own hash function) and
// KV events shaped exactly as a worker's block pool emits them.
import assert from 'node:assert/strict';
import { hashTokenBlocks } from '../../src/protocols/block-hash.ts';
import type { BlockHash, KvEvent } from '../../src/protocols/kv-events.ts';
import { KvCacheManager } from '../../src/engine/kv-cache/manager.ts';
import type { BlockTable } from '../../src/engine/kv-cache/manager.ts';
import { Router } from '../../src/router/router.ts';
import type { RouterOptions } from '../../src/router/router.ts';
import type { RoutingRequest } from '../../src/router/protocols.ts';
import type { WorkerLoad } from '../../src/protocols/worker.ts';
import { seededRandom } from '../../src/util/random.ts';

export const BLOCK_SIZE = 4;

/** Deterministic pseudo-random token ids in [100, 30100), different per seed. */
export function tokens(seed: number, count: number): number[] {
  let state = (seed * 2654435761) >>> 0 || 1;
  const out: number[] = [];
  for (let i = 0; i < count; i++) {
    state ^= state << 13;
    state ^= state >>> 17;
    state ^= state << 5;
    out.push(100 + ((state >>> 0) % 30_000));
  }
  return out;
}

export function hashes(tokenIds: readonly number[], cacheSalt?: string): BlockHash[] {
  return hashTokenBlocks(tokenIds, BLOCK_SIZE, { cacheSalt });
}

export function stored(eventId: number, blockHashes: BlockHash[], parentHash: BlockHash | null = null): KvEvent {
  return { type: 'stored', eventId, blockHashes, parentHash, tokenCount: blockHashes.length * BLOCK_SIZE, blockSize: BLOCK_SIZE };
}

export function removed(eventId: number, blockHashes: BlockHash[]): KvEvent {
  return { type: 'removed', eventId, blockHashes };
}

export function cleared(eventId: number): KvEvent {
  return { type: 'cleared', eventId };
}

export function load(partial: Partial<WorkerLoad> = {}): WorkerLoad {
  return { numRunning: 0, numWaiting: 0, activePrefillTokens: 0, activeDecodeBlocks: 0, kvUsage: 0, ...partial };
}

export function makeRouter(options: Partial<RouterOptions> = {}, workerIds: string[] = ['w0', 'w1', 'w2', 'w3']): Router {
  const router = new Router({ blockSize: BLOCK_SIZE, random: seededRandom(7), ...options });
  for (const workerId of workerIds) router.addWorker(workerId);
  return router;
}

let nextRequest = 0;
export function request(tokenIds: readonly number[], extra: Partial<RoutingRequest> = {}): RoutingRequest {
  return { requestId: `r${nextRequest++}`, tokenIds, ...extra };
}

/** A real worker's KV cache (events on): computes prompts as the engine does and hands out its events. */
export class CacheOfWorker {
  readonly kv: KvCacheManager;
  private readonly tables: BlockTable[] = [];

  constructor(numBlocks: number) {
    this.kv = new KvCacheManager({ numBlocks, blockSize: BLOCK_SIZE, enableEvents: true });
  }

  /** Admits and computes a prompt (prefix hit first); keepRunning: the sequence holds its blocks until release. */
  compute(tokenIds: number[], options: { cacheSalt?: string; keepRunning?: boolean } = {}): number {
    const table = this.kv.createTable({ cacheSalt: options.cacheSalt });
    const prefix = this.kv.findCachedPrefix(table, tokenIds);
    const allocated = this.kv.allocateSlots(table, prefix.numTokens, tokenIds.length - prefix.numTokens, prefix);
    assert.notEqual(allocated, null, 'the test pool should have room');
    this.kv.cacheComputedBlocks(table, tokenIds, tokenIds.length);
    if (options.keepRunning) this.tables.push(table);
    else this.kv.free(table);
    return prefix.numTokens;
  }

  releaseAll(): void {
    for (const table of this.tables.splice(0)) this.kv.free(table);
  }

  takeEvents(): KvEvent[] {
    return this.kv.takeEvents();
  }

  /** Leading blocks of the prompt the worker holds right now (ignoring the engine's last-token rule). */
  heldBlocks(tokenIds: readonly number[], cacheSalt?: string): number {
    let depth = 0;
    for (const hash of hashes(tokenIds, cacheSalt)) {
      if (this.kv.pool.getCachedBlock(hash) === undefined) break;
      depth++;
    }
    return depth;
  }
}

/** Counts of each value in a list. */
export function histogram<T>(values: readonly T[]): Map<T, number> {
  const counts = new Map<T, number>();
  for (const value of values) counts.set(value, (counts.get(value) ?? 0) + 1);
  return counts;
}

/**
 * Asserts that `count` draws out of `total` are consistent with probability p: within 5 standard deviations of a
 * binomial (a correct draw fails this about once in 1.7 million runs; a biased one fails it reliably at these
 * sample sizes).
 */
export function assertBinomial(count: number, total: number, p: number, what: string): void {
  const mean = total * p;
  const sd = Math.sqrt(total * p * (1 - p));
  assert.ok(Math.abs(count - mean) <= 5 * sd + 1e-9, `${what}: ${count} of ${total}, expected ${mean.toFixed(1)} +- ${(5 * sd).toFixed(1)}`);
}
