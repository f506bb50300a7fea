// The disaggregation policy's throughput estimates on a simulated prefill/decode split: where they start (the link
// and the performance model, not a CPU worker's priors), and how a transfer estimate that says "slower" is tested
// by a transfer now and then (transfer-probe) instead of keeping every prompt on the decode worker for good.

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { DEFAULT_SAMPLING, type DisaggregationReason, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import type { DisaggregatedEngine } from '../../src/runtime/disaggregated.ts';
import { createWorkerPool, type WorkerPool, type WorkerPoolOptions } from '../../src/runtime/worker-pool.ts';
import { INFINIBAND_NDR } from '../../src/sim/hardware.ts';

/** Transfer-slower decisions in a row before the policy tests one with a transfer (the default probe interval). */
const PROBE_INTERVAL = 8;

const SIM = { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity };

async function simSplit(options: Partial<WorkerPoolOptions> = {}): Promise<WorkerPool & { disaggregated: DisaggregatedEngine }> {
  const pool = await createWorkerPool({ engine: 'sim', workers: 1, prefillWorkers: 1, decodeWorkers: 1, sim: SIM, routerSeed: 3, ...options });
  assert.ok(pool.disaggregated);
  return pool as WorkerPool & { disaggregated: DisaggregatedEngine };
}

/** A prompt of `length` tokens sharing no block with another `seed`'s. */
function prompt(length: number, seed: number): number[] {
  return Array.from({ length }, (_, i) => 500 + ((i * 7919 + seed * 104_729) % 31_000));
}

let nextId = 0;
async function run(pool: WorkerPool, promptTokenIds: number[]): Promise<EngineOutput[]> {
  const request: EngineRequest = {
    id: `r${nextId++}`, promptTokenIds, priority: 0, arrivalMs: 0,
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 4, temperature: 0, ignoreEos: true },
  };
  const outputs: EngineOutput[] = [];
  for await (const output of pool.engine.generate(request)) outputs.push(output);
  return outputs;
}

const decisionOf = (outputs: EngineOutput[]) => outputs.at(-1)!.routing!.disaggregation!;

describe('a simulated split\'s estimates', () => {
  test('start from the link and the performance model: after short local prompts, a long one still goes remote', async () => {
    const pool = await simSplit();
    try {
      const start = pool.disaggregated.estimates();
      // InfiniBand NDR, one link per GPU at the default 0.8 comm efficiency: 40 GB/s (a CPU memcpy's prior is 2).
      const link = INFINIBAND_NDR.bytesPerSecPerDirection * 0.8;
      assert.ok(Math.abs(start.transferBytesPerSec - link) / link < 0.01, `transfer estimate ${start.transferBytesPerSec}`);
      // An 8B model on one H100 prefills tens of thousands of tokens a second, not 2,000.
      assert.ok(start.prefillTokensPerSec > 20_000 && start.prefillTokensPerSec < 60_000, `prefill estimate ${start.prefillTokensPerSec}`);

      // Short prompts are prefilled locally and teach the policy the decode worker's real prefill speed...
      for (let i = 0; i < 5; i++) assert.equal(decisionOf(await run(pool, prompt(390, i))).reason, 'short-prompt');
      // ...which leaves moving a long prompt's KV the cheaper way, as it is on this link.
      const long = await run(pool, prompt(1955, 99));
      const decision = decisionOf(long);
      assert.equal(decision.reason, 'remote-prefill', decision.detail);
      const transfer = long.at(-1)!.timestamps.kvTransfer!;
      assert.ok(transfer.blocks > 0);
      const transferMs = transfer.end - transfer.start;
      assert.ok(transferMs < decision.estimatedPrefillMs, `moved in ${transferMs} ms vs ~${decision.estimatedPrefillMs} ms to prefill`);
      assert.ok(Math.abs(decision.estimatedTransferMs - transferMs) / transferMs < 0.2,
        `estimated ${decision.estimatedTransferMs} ms for a transfer that took ${transferMs} ms`);
    } finally {
      await pool.engine.close();
    }
  });

  test('given ones (disaggregationEstimates) win over the model\'s', async () => {
    const pool = await simSplit({ disaggregationEstimates: { prefillTokensPerSec: 1234 } });
    try {
      const { transferBytesPerSec, prefillTokensPerSec } = pool.disaggregated.estimates();
      assert.equal(prefillTokensPerSec, 1234);
      assert.ok(transferBytesPerSec > 30e9, 'the transfer estimate still comes from the link');
    } finally {
      await pool.engine.close();
    }
  });
});

describe('a transfer estimate that keeps prompts local is tested by a transfer', () => {
  test('too low for the link: the probe measures it, and long prompts go remote from then on', async () => {
    const pool = await simSplit({ disaggregationEstimates: { transferBytesPerSec: 1e8 } });
    try {
      const reasons: DisaggregationReason[] = [];
      let probe: EngineOutput[] | undefined;
      for (let i = 0; i < PROBE_INTERVAL + 3; i++) {
        const outputs = await run(pool, prompt(1955, i));
        reasons.push(decisionOf(outputs).reason);
        if (decisionOf(outputs).reason === 'transfer-probe') probe = outputs;
      }
      assert.deepEqual(reasons, [
        ...Array<DisaggregationReason>(PROBE_INTERVAL).fill('transfer-slower'), 'transfer-probe', 'remote-prefill', 'remote-prefill',
      ]);
      const decision = decisionOf(probe!);
      assert.equal(decision.mode, 'disaggregated');
      assert.equal(decision.prefillWorkerId, 'sim-prefill-0');
      assert.match(decision.detail, /^1955 uncached tokens on sim-prefill-0 to measure the link: /);
      assert.ok(probe!.at(-1)!.timestamps.kvTransfer!.blocks > 0, 'the probe moved the KV');
      assert.ok(pool.disaggregated.estimates().transferBytesPerSec > 5e9, `learned ${pool.disaggregated.estimates().transferBytesPerSec} B/s`);
      assert.equal(pool.disaggregated.channel.log.summary().transfers, 3);
    } finally {
      await pool.engine.close();
    }
  });

  test('slower in truth (a transfer overhead no link beats): probes back off; fixed estimates are never probed', async () => {
    const slow = await simSplit({ disaggregationPolicy: { transferOverheadMs: 1e6 } });
    const fixed = await simSplit({ disaggregationEstimates: { transferBytesPerSec: 1e8, fixed: true } });
    try {
      const probes: number[] = [];
      for (let i = 0; i < 27; i++) {
        const decision = decisionOf(await run(slow, prompt(600, i)));
        if (decision.reason === 'transfer-probe') probes.push(i);
        else assert.equal(decision.reason, 'transfer-slower', decision.detail);
      }
      // 8 transfer-slower decisions, a probe; 16 more, a probe.
      assert.deepEqual(probes, [8, 25]);
      assert.equal(slow.disaggregated.channel.log.summary().transfers, 2);
      for (let i = 0; i < 12; i++) assert.equal(decisionOf(await run(fixed, prompt(1955, i))).reason, 'transfer-slower');
      assert.equal(fixed.disaggregated.channel.log.summary().transfers, 0);
    } finally {
      await slow.engine.close();
      await fixed.engine.close();
    }
  });
});
