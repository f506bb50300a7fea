// The stats of several workers as one engine's: the routed and disaggregated engines report their workers' sums.
import type { EngineStats } from '../protocols/worker.ts';

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
  }
  return total;
}
