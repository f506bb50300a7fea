// Lower KV tiers on simulated GPU workers: the same tiers as the cpu engine (real scheduler, cache, events), an
// onboard priced by the tier profile (host RAM over each GPU's PCIe, one NVMe per worker) and added to the step.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { getHardwareProfile, HOST_RAM_PCIE5, NVME_GEN4 } from '../../src/sim/hardware.ts';
import { simulateKvTierTtft } from '../../src/sim/kv-tier-ttft.ts';
import { getModelProfile, kvBytesPerToken } from '../../src/sim/models.ts';
import { SimWorker } from '../../src/sim/sim-worker.ts';
import { DEFAULT_SAMPLING } from '../../src/engine/types.ts';

describe('simulated KV tiers', () => {
  it('70B on 4 x H100, 8192 tokens: HBM < host RAM < NVMe < recompute, the onboard priced by the profiles', () => {
    const model = getModelProfile('llama-3.1-70b');
    const report = simulateKvTierTtft({ model, hw: getHardwareProfile('h100'), tp: 4, promptTokens: 8192 });
    const [cold, primary, ram, disk] = report.rows;
    assert.deepEqual(report.rows.map((r) => r.source), ['cold', 'primary', 'ram', 'disk']);
    assert.ok(primary!.ttftMs < ram!.ttftMs && ram!.ttftMs < disk!.ttftMs && disk!.ttftMs < cold!.ttftMs,
      report.rows.map((r) => `${r.source} ${r.ttftMs}`).join(', '));
    // 511 whole blocks before the last token: the evictor left the first 2 in the pool, the other 509 come from RAM.
    assert.equal(ram!.cachedTokens, 511 * 16);
    assert.equal(ram!.onboardedBlocks, 509);
    const blockBytes = 16 * kvBytesPerToken(model);
    const ramMs = HOST_RAM_PCIE5.latencyUs / 1000 + (509 * blockBytes / 4 / HOST_RAM_PCIE5.bytesPerSec) * 1000;
    assert.ok(Math.abs(ram!.onboardMs - ramMs) < 1e-6, `${ram!.onboardMs} vs ${ramMs}`);
    const diskMs = NVME_GEN4.latencyUs / 1000 + (509 * blockBytes / NVME_GEN4.bytesPerSec) * 1000;
    assert.ok(Math.abs(disk!.onboardMs - diskMs) < 1e-6);
  });

  it('8B on one H100: NVMe is slower than the prefill, so the prefix is recomputed (the cost model)', () => {
    const report = simulateKvTierTtft({ model: getModelProfile('llama-3.1-8b'), hw: getHardwareProfile('h100'), tp: 1, promptTokens: 4096 });
    const disk = report.rows.find((r) => r.source === 'disk')!;
    const ram = report.rows.find((r) => r.source === 'ram')!;
    assert.equal(disk.onboardedBlocks, 0);
    assert.ok(ram.onboardedBlocks > 0);
  });

  it('a simulated worker reports its tiers in stats and tier events', () => {
    const worker = new SimWorker({
      model: getModelProfile('llama-3.1-8b'), hw: getHardwareProfile('h100'), tp: 1, numKvBlocks: 8, blockSize: 16,
      maxModelLen: 128, enableKvEvents: true, kvTiers: { ramBytes: 1 << 30 },
    });
    worker.add({ id: 'a', promptTokenIds: Array.from({ length: 40 }, (_, i) => i + 5), priority: 0, arrivalMs: 0,
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 1, ignoreEos: true } }, 0);
    for (let clock = 0; worker.hasWork;) {
      const step = worker.beginStep(clock)!;
      clock = step.endMs;
      worker.finishStep(step);
    }
    const stats = worker.stats().kvTiers!;
    assert.equal(stats.tiers.ram!.usedBlocks, 2);
    assert.deepEqual(worker.takeKvEvents().filter((e) => e.tier === 'ram').map((e) => e.type), ['stored', 'stored']);
  });
});
