// What a worker reports about itself across the engine's boundary: its engine statistics (the gateway's /metrics,
// the routed engines), its load as the router sees it, and the summary of the steps a request took part in (on
// every output, read by telemetry). Plain data that survives structured clone and JSON; one definition here, used
// by the engine that produces it and the router, runtime, sim and telemetry that consume it.

import type { KvLowerTier } from './kv-events.ts';

// ---------------------------------------------------------------------------------------------------------------
// Engine statistics

export interface EngineStats {
  numRunning: number;
  numWaiting: number;
  kvBlocksUsed: number;
  kvBlocksTotal: number;
  prefixCacheQueries: number;
  prefixCacheHits: number;
  preemptions: number;
  /** Cached KV blocks evicted to make room (cumulative); every Conduit engine counts them. */
  kvEvictions?: number;
  /** Requests this worker took over from a lost worker (cumulative); set by the routed and disaggregated engines. */
  requestMigrations?: number;
  /** The KV tiers below the primary pool, when the worker has any (--kv-offload-memory, --kv-offload-disk). */
  kvTiers?: KvTiersStats;
  /**
   * A decode worker process: handed-off requests whose KV it could not import over a link (tcp, shm) and prefilled
   * itself instead, by link (cumulative). Set once the first has happened.
   */
  kvTransferLinks?: Record<string, KvLinkStats>;
  /** What the worker holds in memory now, by category (CPU workers: measured; simulated ones: the modelled GPU memory). */
  memory?: WorkerMemory;
  /** Allocations that failed, by kind (cumulative). */
  allocationFailures?: AllocationFailures;
  /**
   * Set by a worker process on each report it sends, increasing: orders its reports across the request plane and
   * the NATS load snapshots, which travel apart (remote-engine.ts keeps the newest).
   */
  reportSeq?: number;
}

/** One link's failed KV imports on a decode worker (cumulative). */
export interface KvLinkStats {
  /** By reason: checksum, length, truncated, refused, unexpected-run, connect, timeout, no-source, no-staging-space, import. */
  failures: Record<string, number>;
  /** Requests prefilled on the decode worker instead (every failure leads to one). */
  fallbacks: number;
}

/** A worker's memory by category, bytes, each measured from the allocations themselves. */
export interface WorkerMemory {
  /** The weight tensors the compute backend reads (views of the loaded file, packed or dequantized copies). */
  weightsBytes: number;
  /** The primary KV pool. */
  kvCacheBytes: number;
  /**
   * Per-step buffers: the backend's activations and kernel scratch, the step's logits and batch arrays. Absent on
   * simulated workers (the performance model keeps no activation memory: HBM after the weights is all KV).
   */
  activationsBytes?: number;
  /** LoRA adapters loaded (CPU: the backend's packed copies; simulated: their parameters in BF16). Absent: none can be. */
  loraAdaptersBytes?: number;
}

/** Allocation failures of one worker since it started. */
export interface AllocationFailures {
  /** A running sequence needed KV blocks the pool did not have (it or another sequence was preempted). */
  kvBlocks: number;
  /** A step's scratch memory could not be allocated (the step's requests failed; the worker goes on). */
  scratch?: number;
}

/** Per-tier figures for stats and metrics (cumulative counters and current sizes). */
export interface KvTierStats {
  capacityBlocks: number;
  usedBlocks: number;
  blockBytes: number;
  /** Blocks copied into this tier and the time the copies took (disk: writes completed). */
  offloadBlocks: number;
  offloadBytes: number;
  offloadMs: number;
  /** Blocks copied from this tier into the primary pool, and the time it took. */
  onboardBlocks: number;
  onboardBytes: number;
  onboardMs: number;
  /** Blocks dropped as unreadable (disk: a torn or corrupted file). */
  corruptBlocks: number;
  /** Blocks pushed out by the tier's LRU bound. */
  evictedBlocks: number;
  /** Blocks whose copy into this tier failed (disk: a write error, as on a full disk or a removed folder). */
  failedOffloadBlocks: number;
}

export interface KvTiersStats {
  tiers: Partial<Record<KvLowerTier, KvTierStats>>;
  /** Cached primary blocks evicted before they had been copied below. */
  missedOffloads: number;
  /** Lookups that found lower-tier blocks but recomputed them because the cost model said it was faster. */
  recomputedBlocks: number;
}

// ---------------------------------------------------------------------------------------------------------------
// Step summaries

/**
 * Steps summarised from one request's seat: how many, how long their forward passes took, and how big their
 * batches were. Fixed size whatever the output length, so it can ride on every output.
 */
export interface StepBatchSummary {
  steps: number;
  /** Worker-local id of the latest step counted (a step is counted once however many completions it advanced). */
  lastStepId: number;
  /** Forward passes (forward start to sampled) summed, ms. */
  forwardMs: number;
  /** Sequences in each step's batch: sum (the mean is sum / steps), least, most. */
  batchSeqsSum: number;
  batchSeqsMin: number;
  batchSeqsMax: number;
  /** Tokens each step computed, all sequences together: sum, least, most. */
  batchTokensSum: number;
  batchTokensMin: number;
  batchTokensMax: number;
}

// ---------------------------------------------------------------------------------------------------------------
// Load view (the router's)

/** What a worker last reported about its own load. Missing reports count as an idle worker. */
export interface WorkerLoad {
  /** Requests in the running batch. */
  numRunning: number;
  /** Requests admitted but not yet scheduled. */
  numWaiting: number;
  /** Prompt tokens still to be computed across its requests (queued and partially prefilled). */
  activePrefillTokens: number;
  /** Distinct KV blocks held by its running requests (a prefix block several of them share counts once). */
  activeDecodeBlocks: number;
  /** Fraction of its KV pool in use, 0..1. */
  kvUsage: number;
}

export const IDLE_LOAD: Readonly<WorkerLoad> = Object.freeze({
  numRunning: 0, numWaiting: 0, activePrefillTokens: 0, activeDecodeBlocks: 0, kvUsage: 0,
});

export function parseWorkerLoad(value: unknown): WorkerLoad {
  if (typeof value !== 'object' || value === null) throw new TypeError('worker load must be an object');
  const record = value as Record<string, unknown>;
  const count = (field: string): number => {
    const n = record[field];
    if (!Number.isSafeInteger(n) || (n as number) < 0) throw new TypeError(`worker load ${field} must be an integer >= 0, got ${JSON.stringify(n)}`);
    return n as number;
  };
  const kvUsage = record.kvUsage;
  if (typeof kvUsage !== 'number' || !(kvUsage >= 0 && kvUsage <= 1)) {
    throw new TypeError(`worker load kvUsage must be a number in [0, 1], got ${JSON.stringify(kvUsage)}`);
  }
  return {
    numRunning: count('numRunning'), numWaiting: count('numWaiting'), activePrefillTokens: count('activePrefillTokens'),
    activeDecodeBlocks: count('activeDecodeBlocks'), kvUsage,
  };
}

/**
 * A load view from an engine's stats. EngineStats does not report pending prefill tokens, so that term is left at
 * 0 and the router's own accounting of what it sent stands in for it.
 */
export function workerLoadFromStats(stats: EngineStats): WorkerLoad {
  return {
    numRunning: stats.numRunning, numWaiting: stats.numWaiting, activePrefillTokens: 0, activeDecodeBlocks: stats.kvBlocksUsed,
    kvUsage: stats.kvBlocksTotal > 0 ? Math.min(1, stats.kvBlocksUsed / stats.kvBlocksTotal) : 0,
  };
}

/** One worker's terms in the router's cost (router/cost.ts), as a trace shows them. */
export interface WorkerCostSummary {
  workerId: string;
  /** Leading prompt blocks it holds and would reuse. */
  overlapBlocks: number;
  /** Prompt tokens it would compute plus the prefill already queued on it. */
  prefillTokens: number;
  /** Blocks its running requests hold plus those this request adds. */
  decodeBlocks: number;
  cost: number;
  /** Over the busy threshold: weighed only when no worker was below it. */
  busy: boolean;
}
