// The stats of several workers as one engine's: the routed and disaggregated engines report their workers' sums.
import type { EngineStats, KvTierStats, KvTiersStats } from '../protocols/worker.ts';

/** Field-by-field sum; the counters a worker may not keep (evictions) count as 0. */
export function sumEngineStats(all: Iterable<EngineStats>): EngineStats {
  const total: EngineStats = {
    numRunning: 0, numWaiting: 0, kvBlocksUsed: 0, kvBlocksTotal: 0, prefixCacheQueries: 0, prefixCacheHits: 0,
    preemptions: 0, kvEvictions: 0,
  };
  for (const s of all) {
    total.numRunning += s.numRunning;
    total.numWaiting += s.numWaiting;
    total.kvBlocksUsed += s.kvBlocksUsed;
    total.kvBlocksTotal += s.kvBlocksTotal;
    total.prefixCacheQueries += s.prefixCacheQueries;
    total.prefixCacheHits += s.prefixCacheHits;
    total.preemptions += s.preemptions;
    total.kvEvictions! += s.kvEvictions ?? 0;
    if (s.kvTiers !== undefined) total.kvTiers = addKvTiers(total.kvTiers, s.kvTiers);
    if (s.memory !== undefined) {
      const before = total.memory;
      total.memory = {
        weightsBytes: (before?.weightsBytes ?? 0) + s.memory.weightsBytes,
        kvCacheBytes: (before?.kvCacheBytes ?? 0) + s.memory.kvCacheBytes,
      };
      const activations = (before?.activationsBytes ?? 0) + (s.memory.activationsBytes ?? 0);
      if (before?.activationsBytes !== undefined || s.memory.activationsBytes !== undefined) total.memory.activationsBytes = activations;
      const lora = (before?.loraAdaptersBytes ?? 0) + (s.memory.loraAdaptersBytes ?? 0);
      if (before?.loraAdaptersBytes !== undefined || s.memory.loraAdaptersBytes !== undefined) total.memory.loraAdaptersBytes = lora;
    }
    if (s.allocationFailures !== undefined) {
      const before = total.allocationFailures;
      total.allocationFailures = { kvBlocks: (before?.kvBlocks ?? 0) + s.allocationFailures.kvBlocks };
      if (before?.scratch !== undefined || s.allocationFailures.scratch !== undefined) {
        total.allocationFailures.scratch = (before?.scratch ?? 0) + (s.allocationFailures.scratch ?? 0);
      }
    }
  }
  return total;
}

/** Lower KV tiers summed tier by tier, every figure (sizes and counters alike). */
function addKvTiers(sum: KvTiersStats | undefined, add: KvTiersStats): KvTiersStats {
  const out: KvTiersStats = {
    tiers: { ...sum?.tiers }, missedOffloads: (sum?.missedOffloads ?? 0) + add.missedOffloads,
    recomputedBlocks: (sum?.recomputedBlocks ?? 0) + add.recomputedBlocks,
  };
  for (const [tier, stats] of Object.entries(add.tiers) as [keyof KvTiersStats['tiers'], KvTierStats][]) {
    const before = out.tiers[tier];
    if (before === undefined) {
      out.tiers[tier] = { ...stats };
      continue;
    }
    const merged = { ...before };
    for (const key of Object.keys(stats) as (keyof KvTierStats)[]) merged[key] = key === 'blockBytes' ? stats[key] : before[key] + stats[key];
    out.tiers[tier] = merged;
  }
  return out;
}
