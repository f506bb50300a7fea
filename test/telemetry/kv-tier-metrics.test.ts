// Lower KV tiers on /metrics: utilisation, used and capacity blocks per tier (primary included), and the tiers'
// cumulative offload / onboard counters advanced by what moved between two stats snapshots.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { ConduitMetrics } from '../../src/telemetry/metrics.ts';
import type { EngineStats, KvTierStats } from '../../src/protocols/worker.ts';

function tier(partial: Partial<KvTierStats>): KvTierStats {
  return {
    capacityBlocks: 100, usedBlocks: 0, blockBytes: 1000, offloadBlocks: 0, offloadBytes: 0, offloadMs: 0, onboardBlocks: 0,
    onboardBytes: 0, onboardMs: 0, corruptBlocks: 0, evictedBlocks: 0, failedOffloadBlocks: 0, ...partial,
  };
}

function stats(ram: Partial<KvTierStats>, disk: Partial<KvTierStats>): EngineStats {
  return {
    numRunning: 0, numWaiting: 0, kvBlocksUsed: 5, kvBlocksTotal: 20, prefixCacheQueries: 0, prefixCacheHits: 0, preemptions: 0,
    kvTiers: { tiers: { ram: tier(ram), disk: tier(disk) }, missedOffloads: 0, recomputedBlocks: 0 },
  };
}

function value(text: string, series: string): number | undefined {
  const line = text.split('\n').find((l) => l.startsWith(series + ' '));
  return line === undefined ? undefined : Number(line.slice(series.length + 1));
}

describe('KV tier metrics', () => {
  it('gauges per tier and counters advanced by deltas', async () => {
    const metrics = new ConduitMetrics();
    metrics.updateFromEngineStats({ worker: 'w0', stats: stats({ usedBlocks: 40, offloadBytes: 4000, onboardBlocks: 2, onboardBytes: 2000 }, { usedBlocks: 10, capacityBlocks: 50, corruptBlocks: 1, failedOffloadBlocks: 2 }) });
    metrics.updateFromEngineStats({ worker: 'w0', stats: stats({ usedBlocks: 50, offloadBytes: 9000, onboardBlocks: 5, onboardBytes: 5000, onboardMs: 3 }, { usedBlocks: 25, capacityBlocks: 50, corruptBlocks: 1, failedOffloadBlocks: 7 }) });
    const text = await metrics.registry.metrics();
    assert.equal(value(text, 'conduit_kv_cache_utilization_ratio{worker="w0",tier="primary"}'), 0.25);
    assert.equal(value(text, 'conduit_kv_cache_utilization_ratio{worker="w0",tier="ram"}'), 0.5);
    assert.equal(value(text, 'conduit_kv_cache_utilization_ratio{worker="w0",tier="disk"}'), 0.5);
    assert.equal(value(text, 'conduit_kv_tier_used_blocks{worker="w0",tier="primary"}'), 5);
    assert.equal(value(text, 'conduit_kv_tier_capacity_blocks{worker="w0",tier="disk"}'), 50);
    assert.equal(value(text, 'conduit_kv_offload_bytes_total{worker="w0",tier="ram"}'), 9000);
    assert.equal(value(text, 'conduit_kv_onboard_bytes_total{worker="w0",tier="ram"}'), 5000);
    assert.equal(value(text, 'conduit_kv_onboard_milliseconds_total{worker="w0",tier="ram"}'), 3);
    assert.equal(value(text, 'conduit_kv_tier_hit_blocks_total{worker="w0",tier="ram"}'), 5);
    assert.equal(value(text, 'conduit_kv_tier_corrupt_blocks_total{worker="w0",tier="disk"}'), 1);
    assert.equal(value(text, 'conduit_kv_offload_failed_blocks_total{worker="w0",tier="disk"}'), 7);
    assert.equal(value(text, 'conduit_kv_offload_failed_blocks_total{worker="w0",tier="ram"}'), 0);
    metrics.forgetWorker('w0');
    const after = await metrics.registry.metrics();
    assert.equal(value(after, 'conduit_kv_tier_used_blocks{worker="w0",tier="ram"}'), undefined);
    assert.equal(value(after, 'conduit_kv_cache_utilization_ratio{worker="w0",tier="disk"}'), undefined);
  });
});
