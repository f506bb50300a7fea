// Lower KV tiers on simulated GPU workers: the same tiers as the cpu engine (real scheduler, cache, events), an
// onboard priced by the tier profile (host RAM over each GPU's PCIe, one NVMe per worker) and added to the step.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { getHardwareProfile, HOST_RAM_PCIE5, NVME_GEN4 } from '../../src/sim/hardware.ts';
import * as kvTierTtft from '../../src/sim/kv-tier-ttft.ts';
import { getModelProfile, kvBytesPerToken } from '../../src/sim/models.ts';
import { SimConfigError, SimWorker } from '../../src/sim/sim-worker.ts';
import { DEFAULT_SAMPLING } from '../../src/engine/types.ts';

describe('simulated KV tiers', () => {
  it('70B on 4 x H100, 8192 tokens: HBM < host RAM < NVMe < recompute, the onboard priced by the profiles', () => {
    const model = getModelProfile('llama-3.1-70b');
    const report = kvTierTtft.simulateKvTierTtft({ model, hw: getHardwareProfile('h100'), tp: 4, promptTokens: 8192 });
    const [cold, primary, ram, disk] = report.rows;
    assert.deepEqual(report.rows.map((r) => r.source), ['cold', 'primary', 'ram', 'disk']);
    assert.ok(primary!.ttftMs < ram!.ttftMs && ram!.ttftMs < disk!.ttftMs && disk!.ttftMs < cold!.ttftMs,
      report.rows.map((r) => `${r.source} ${r.ttftMs}`).join(', '));
    // The lower tiers serve whole blocks before the last token: (8192 - 1) / 16 rounded down = 511 (the evictor took
    // the whole pool, none stayed in HBM). RAM onboards every one. NVMe reads a block in about 1 ms, and a few tokens
    // more in the step that computes the last one anyway add less: the cost model recomputes a short tail.
    assert.deepEqual([ram!.onboardedBlocks, ram!.cachedTokens, ram!.recomputedBlocks], [511, 511 * 16, 0]);
    assert.equal(disk!.onboardedBlocks + disk!.recomputedBlocks, 511);
    assert.ok(disk!.recomputedBlocks >= 1 && disk!.recomputedBlocks <= 8, `${disk!.recomputedBlocks} recomputed`);
    assert.equal(disk!.cachedTokens, disk!.onboardedBlocks * 16);
    // 80 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes = 327,680 B per token: a block of 16 is 5 MiB.
    const blockBytes = 16 * 80 * 8 * 128 * 2 * 2;
    assert.equal(blockBytes, 16 * kvBytesPerToken(model));
    // Host RAM: 10 us, then each of the 4 GPUs moves its quarter over its own PCIe 5.0 x16 at 80% of its 63 GB/s each
    // way (32 GT/s x 16 lanes, 128b/130b encoding).
    const pcie5 = 0.8 * (32e9 * 16 * 128 / 130 / 8);
    assert.deepEqual([HOST_RAM_PCIE5.latencyUs, HOST_RAM_PCIE5.bytesPerSec], [10, pcie5]);
    const ramMs = 10 / 1000 + (511 * blockBytes / 4 / pcie5) * 1000;
    assert.ok(Math.abs(ram!.onboardMs - ramMs) < 1e-6, `${ram!.onboardMs} vs ${ramMs}`);
    // NVMe: 80 us, then the whole blocks through one 5 GB/s drive.
    assert.deepEqual([NVME_GEN4.latencyUs, NVME_GEN4.bytesPerSec], [80, 5e9]);
    const diskMs = (blocks: number) => 80 / 1000 + (blocks * blockBytes / 5e9) * 1000;
    assert.ok(Math.abs(disk!.onboardMs - diskMs(disk!.onboardedBlocks)) < 1e-6, `${disk!.onboardMs} vs ${diskMs(disk!.onboardedBlocks)}`);
    // And it pays: faster than reading all 511 and computing the last token alone (the HBM row's step).
    assert.ok(disk!.ttftMs < diskMs(511) + primary!.ttftMs, `${disk!.ttftMs} vs ${diskMs(511) + primary!.ttftMs}`);
    // HBM: every whole block hit, the last copied (8192 is a block boundary), one token computed.
    assert.equal(primary!.cachedTokens, 8191);
    assert.equal(primary!.onboardedBlocks, 0);
  });

  it('the footer gives each tier\'s bandwidth per GPU or per worker as its profile moves it, whichever flag names it', () => {
    const base = { model: getModelProfile('llama-3.1-70b'), hw: getHardwareProfile('h100'), tp: 4, promptTokens: 64 };
    const usual = kvTierTtft.formatKvTierTtft(kvTierTtft.simulateKvTierTtft(base));
    assert.match(usual, /host DRAM over PCIe 5\.0 x16 50\.4 GB\/s per GPU, NVMe Gen4 x4 SSD 5\.0 GB\/s per worker\)$/);
    // An NVMe drive named as the host tier is still one per worker, host DRAM as the disk tier still per GPU.
    const swapped = kvTierTtft.formatKvTierTtft(kvTierTtft.simulateKvTierTtft({ ...base, ram: NVME_GEN4, disk: HOST_RAM_PCIE5 }));
    assert.match(swapped, /NVMe Gen4 x4 SSD 5\.0 GB\/s per worker, host DRAM over PCIe 5\.0 x16 50\.4 GB\/s per GPU\)$/);
  });

  it('8B on one H100: NVMe is slower than the prefill, so the prefix is recomputed (the cost model)', () => {
    const report = kvTierTtft.simulateKvTierTtft({ model: getModelProfile('llama-3.1-8b'), hw: getHardwareProfile('h100'), tp: 1, promptTokens: 4096 });
    const [cold, , ram, disk] = report.rows;
    // (4096 - 1) / 16 rounded down = 255 blocks in each tier: RAM onboards them all; NVMe's are all recomputed, so
    // nothing is cached and its TTFT is the cold one (it had 2 blocks from HBM before).
    assert.deepEqual([ram!.onboardedBlocks, ram!.cachedTokens, ram!.recomputedBlocks], [255, 255 * 16, 0]);
    assert.deepEqual([disk!.onboardedBlocks, disk!.cachedTokens, disk!.recomputedBlocks], [0, 0, 255]);
    assert.ok(Math.abs(disk!.ttftMs - cold!.ttftMs) < 1e-9, `${disk!.ttftMs} vs ${cold!.ttftMs}`);
    assert.match(kvTierTtft.formatKvTierTtft(report), /^\(NVMe Gen4 x4 SSD: 255 blocks held there were recomputed instead/m);
  });

  it('short prompts too: every whole block before the last token comes from the lower tier, none from HBM', () => {
    const model = getModelProfile('llama-3.1-70b');
    const hw = getHardwareProfile('h100');
    // The evictor used to leave the first 2 blocks in HBM: 0 of 2 onboarded at 48 tokens (32 cached from HBM), 13 of
    // 15 at 256.
    for (const [promptTokens, blocks] of [[17, 1], [48, 2], [256, 15], [1000, 62]] as const) {
      const report = kvTierTtft.simulateKvTierTtft({ model, hw, tp: 4, promptTokens });
      const [cold, primary, ram, disk] = report.rows;
      assert.equal(ram!.onboardedBlocks, blocks, `${promptTokens}: ram`);
      assert.equal(ram!.cachedTokens, blocks * 16, `${promptTokens}: ram`);
      // NVMe is slower than computing these blocks' tokens in the step that runs anyway: all recomputed, none from HBM.
      assert.deepEqual([disk!.onboardedBlocks, disk!.recomputedBlocks, disk!.cachedTokens], [0, blocks, 0], `${promptTokens}: disk`);
      assert.ok(Math.abs(disk!.ttftMs - cold!.ttftMs) < 1e-9, `${promptTokens}: disk ${disk!.ttftMs} vs ${cold!.ttftMs}`);
      // The RAM tier's read is priced on top of computing the rest, so its row does not have the HBM row's TTFT.
      assert.ok(primary!.ttftMs < ram!.ttftMs && ram!.ttftMs < cold!.ttftMs, `${promptTokens}: ${report.rows.map((r) => r.ttftMs).join(', ')}`);
    }
  });

  it('no tier makes a prompt\'s first token later than computing it, short or long; long prompts still read the tiers', () => {
    const model = getModelProfile('llama-3.1-70b');
    const hw = getHardwareProfile('h100');
    // A block is 5 MiB: about 0.03 ms over each GPU's PCIe, 1.1 ms from NVMe. Computing its 16 tokens costs about
    // 0.01 ms inside a short prompt's step (which streams the weights once whatever it computes) and about 1.2 ms in a
    // long, compute-bound one. Priced at the average rate (a whole step per 17 tokens) NVMe looked faster at every length.
    for (const promptTokens of [17, 33, 100, 1000, 8000]) {
      const report = kvTierTtft.simulateKvTierTtft({ model, hw, tp: 4, promptTokens });
      const [cold, , ram, disk] = report.rows;
      for (const row of [ram!, disk!]) {
        assert.ok(row.ttftMs <= cold!.ttftMs + 1e-9, `${promptTokens} tokens: ${row.source} ${row.ttftMs} ms, cold ${cold!.ttftMs} ms`);
      }
      const blocks = Math.floor((promptTokens - 1) / 16);
      assert.equal(ram!.onboardedBlocks, blocks, `${promptTokens}: host RAM is worth reading at every length`);
      if (promptTokens >= 8000) {
        assert.equal(disk!.onboardedBlocks, blocks, `${promptTokens}: NVMe is worth reading for a long prompt`);
        assert.ok(disk!.ttftMs < cold!.ttftMs - 50, `${disk!.ttftMs} vs ${cold!.ttftMs}`);
      }
    }
  });

  it('a prompt of one block or less has nothing for a lower tier to serve: refused, not a table of HBM rows', () => {
    const model = getModelProfile('llama-3.1-70b');
    const hw = getHardwareProfile('h100');
    for (const promptTokens of [1, 15, 16]) {
      assert.throws(() => kvTierTtft.simulateKvTierTtft({ model, hw, tp: 4, promptTokens }),
        (error: unknown) => error instanceof SimConfigError && /no whole KV block of 16 tokens before its last token/.test(error.message));
    }
  });

  it('a lower tier\'s row that did not read every block it should from that tier is an error', () => {
    // What the 8192-token run measured before the evictor took the whole pool: 2 of 511 blocks from HBM.
    assert.throws(() => kvTierTtft.checkLowerTierRow({ cachedTokens: 8176, onboardedBlocks: 509, recomputedBlocks: 0 }, 8192, 16, 'RAM'),
      /onboarded 509 and recomputed 0 of the 511 blocks it should serve, with 8176 prompt tokens cached/);
    // The 48-token run: nothing onboarded, 32 tokens cached from HBM.
    assert.throws(() => kvTierTtft.checkLowerTierRow({ cachedTokens: 32, onboardedBlocks: 0, recomputedBlocks: 0 }, 48, 16, 'RAM'));
    // Recomputing with some blocks still in HBM is no tier's TTFT either.
    assert.throws(() => kvTierTtft.checkLowerTierRow({ cachedTokens: 32, onboardedBlocks: 0, recomputedBlocks: 253 }, 4096, 16, 'NVMe'));
    const whole = { cachedTokens: 8176, onboardedBlocks: 511, recomputedBlocks: 0 };
    assert.equal(kvTierTtft.checkLowerTierRow(whole, 8192, 16, 'RAM'), whole);
    assert.doesNotThrow(() => kvTierTtft.checkLowerTierRow({ cachedTokens: 0, onboardedBlocks: 0, recomputedBlocks: 255 }, 4096, 16, 'NVMe'));
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
