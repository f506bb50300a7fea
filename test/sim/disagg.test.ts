// Disaggregated serving in the simulator: simulated prefill and decode workers hand requests over with the real
// scheduler halves, the KV takes the modelled link's time, and the timings come out exactly as worked out by hand
// on the toy deployment (test/sim/sim-fixtures.ts). Also the lifecycle table's disaggregated path and a sim pool
// behind the DisaggregatedEngine.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import type { EngineOutput } from '../../src/engine/types.ts';
import { DisaggregatedEngine } from '../../src/runtime/disaggregated.ts';
import { SimulatedKvChannel } from '../../src/runtime/kv-transfer.ts';
import { createWorkerPool, simDisaggregationEstimates } from '../../src/runtime/worker-pool.ts';
import { Router } from '../../src/router/router.ts';
import { seededRandom } from '../../src/util/random.ts';
import { SimCluster, type DisaggregatedRoute } from '../../src/sim/cluster.ts';
import { checkDisaggregatedPathWithEngine } from '../../src/sim/disagg-cold-path.ts';
import { H100_SXM, INFINIBAND_NDR, type LinkProfile } from '../../src/sim/hardware.ts';
import { simulateDisaggregatedPath, simulateLifecycle } from '../../src/sim/latency-model.ts';
import { getModelProfile, kvBytesPerToken } from '../../src/sim/models.ts';
import { SimEngine } from '../../src/sim/sim-engine.ts';
import { SimWorker } from '../../src/sim/sim-worker.ts';
import { close, prompt, req, TOY_MODEL, toyDecodeMs, toyPrefillMs, toyWorker } from './sim-fixtures.ts';

/** 1 MB/s and no hop latency: a toy token's KV (1,024 bytes) takes 1.024 ms, a 16-token block 16.384 ms. */
const SLOW_LINK: LinkProfile = {
  id: 'slow', name: 'Slow test link', bytesPerSecPerDirection: 1e6, bidirectionalBytesPerSec: 2e6, hopLatencyUs: 0,
};
const MS_PER_BLOCK = 16 * 1.024;
const prefillWorker = { ...toyWorker, role: 'prefill' as const, kvLink: { link: SLOW_LINK } };
const decodeWorker = { ...toyWorker, role: 'decode' as const, kvLink: { link: SLOW_LINK } };

function tokensOf(outputs: EngineOutput[]): number[] {
  return outputs.flatMap((o) => o.newTokenIds);
}

describe('simulated workers hand requests over', () => {
  test('prefill worker -> decode worker by hand: same tokens as one worker, blocks pinned until adopted', () => {
    assert.equal(kvBytesPerToken(TOY_MODEL), 1024);
    const alone = new SimWorker(toyWorker);
    alone.add(req('r', prompt(40), 0, { maxTokens: 6 }), 0);
    const expected: EngineOutput[] = [];
    for (let step = alone.beginStep(0); step; step = alone.beginStep(step.endMs)) expected.push(...alone.finishStep(step));

    const prefill = new SimWorker(prefillWorker);
    const decode = new SimWorker(decodeWorker);
    prefill.add(req('r', prompt(40), 0, { maxTokens: 6 }), 0, { handoff: true });
    const step = prefill.beginStep(0)!;
    close(step.durationMs, toyPrefillMs(40, 0));
    const outputs = prefill.finishStep(step);
    const [handoff] = prefill.takeHandoffs();
    assert.ok(handoff);
    assert.equal(handoff.numComputedTokens, 40);
    assert.deepEqual(handoff.sourceBlockIds, [0, 1, 2]);
    assert.equal(handoff.blockHashes.length, 2);
    assert.equal(prefill.stats().kvBlocksUsed, 3, 'pinned');
    assert.equal(prefill.hasWork, false);

    const plan = decode.planTransfer(handoff);
    assert.deepEqual([plan.blocks, plan.reusedBlocks, plan.bytes], [3, 0, 3 * 16 * 1024]);
    close(plan.ms, 3 * MS_PER_BLOCK);
    const adopted = decode.adopt(handoff, step.endMs + plan.ms, step.endMs, 'p0')!;
    assert.equal(adopted.status, 'imported');
    assert.equal(adopted.transfer!.sourceId, 'p0');
    assert.equal(prefill.releaseHandoff('r'), true);
    assert.equal(prefill.stats().kvBlocksUsed, 0);
    for (let s = decode.beginStep(step.endMs + plan.ms); s; s = decode.beginStep(s.endMs)) {
      // Decode steps from the first one: the adopted request feeds its first token at position 40.
      close(s.durationMs, toyDecodeMs(39 + tokensOf(outputs).length));
      outputs.push(...decode.finishStep(s));
    }
    assert.deepEqual(tokensOf(outputs), tokensOf(expected));
    assert.equal(outputs.at(-1)!.timestamps.kvTransfer!.blocks, 3);
    assert.equal(decode.stats().kvBlocksUsed, 0);
    decode.scheduler.checkInvariants();
    prefill.scheduler.checkInvariants();
  });

  test('SimCluster: TTFT is the prefill; the second token waits for the transfer and one decode step', () => {
    const pair: DisaggregatedRoute = { prefill: 0, decode: 1 };
    const cluster = new SimCluster({ workers: [prefillWorker, decodeWorker], route: () => pair });
    const { requests, workers } = cluster.run([req('a', prompt(40), 0, { maxTokens: 3 })]);
    const a = requests[0]!;
    const ttft = toyPrefillMs(40, 0);
    close(a.ttftMs!, ttft);
    const transferMs = 3 * MS_PER_BLOCK;
    close(a.kvTransferMs!, transferMs);
    assert.equal(a.kvTransferBlocks, 3);
    assert.equal(a.prefillWorkerIndex, 0);
    assert.equal(a.workerIndex, 1);
    close(a.itlMs[0]!, transferMs + toyDecodeMs(40));
    close(a.itlMs[1]!, toyDecodeMs(41));
    assert.equal(a.completionTokens, 3);
    assert.deepEqual(workers.map((w) => [w.role, w.stats.kvBlocksUsed]), [['prefill', 0], ['decode', 0]]);
  });

  test('only the blocks the decode worker lacks cross the link', () => {
    const cluster = new SimCluster({
      workers: [prefillWorker, decodeWorker],
      // The warm-up runs on the decode worker alone; the next request shares its first 32 tokens.
      route: (request) => (request.id === 'warm' ? 1 : { prefill: 0, decode: 1 }),
    });
    const shared = prompt(80);
    const { requests } = cluster.run([
      req('warm', shared.slice(0, 40), 0, { maxTokens: 1 }),
      req('b', [...shared.slice(0, 32), ...prompt(48, 3)], 1000, { maxTokens: 2 }),
    ]);
    const b = requests.find((r) => r.id === 'b')!;
    assert.equal(b.kvTransferBlocks, 3, '5 blocks, 2 already on the decode worker');
    close(b.kvTransferMs!, 3 * MS_PER_BLOCK);
  });

  test('a LoRA request\'s transfer is planned as its adoption takes it: the base model\'s cached blocks are not its own', () => {
    const prefill = new SimWorker(prefillWorker);
    const decode = new SimWorker(decodeWorker);
    for (const worker of [prefill, decode]) worker.loadLora('ad', { rank: 8 });
    const shared = prompt(48);
    // The decode worker holds the prompt's blocks for the base model only.
    decode.add(req('base', shared, 0, { maxTokens: 1 }), 0);
    for (let s = decode.beginStep(0); s; s = decode.beginStep(s.endMs)) decode.finishStep(s);
    prefill.add({ ...req('r', shared, 0, { maxTokens: 3 }), lora: 'ad' }, 0, { handoff: true });
    let now = 0;
    for (let s = prefill.beginStep(0); s; s = prefill.beginStep(s.endMs)) {
      prefill.finishStep(s);
      now = s.endMs;
    }
    const [handoff] = prefill.takeHandoffs();
    const plan = decode.planTransfer(handoff!);
    const adopted = decode.adopt(handoff!, now + plan.ms, now)!;
    assert.equal(adopted.status, 'imported');
    assert.deepEqual([plan.blocks, plan.reusedBlocks], [adopted.transfer!.blocks, adopted.transfer!.reusedBlocks]);
    assert.equal(plan.reusedBlocks, 0, 'nothing cached under the adapter');
  });

  test('an abort while the KV crosses the link frees both workers', () => {
    const cluster = new SimCluster({ workers: [prefillWorker, decodeWorker], route: () => ({ prefill: 0, decode: 1 }) });
    cluster.submit(req('x', prompt(40), 0, { maxTokens: 50 }));
    cluster.runUntil(toyPrefillMs(40, 0) + 1);
    assert.equal(cluster.workers[0]!.numParkedHandoffs, 1, 'in transfer: pinned on the prefill worker');
    cluster.abort('x');
    cluster.runToCompletion();
    const x = cluster.result().requests[0]!;
    assert.equal(x.finishReason, 'abort');
    assert.equal(x.completionTokens, 1);
    for (const worker of cluster.workers) {
      assert.equal(worker.stats().kvBlocksUsed, 0);
      assert.equal(worker.numParkedHandoffs + worker.numPendingAdoptions, 0);
    }
  });

  test('a full decode pool delays the adoption; the prefill worker keeps the blocks until then', () => {
    const small = { ...decodeWorker, numKvBlocks: 6 };
    const cluster = new SimCluster({
      workers: [prefillWorker, small],
      route: (request) => (request.id === 'hog' ? 1 : { prefill: 0, decode: 1 }),
    });
    cluster.submit(req('hog', prompt(60, 9), 0, { maxTokens: 30 }));
    cluster.submit(req('late', prompt(40), 0, { maxTokens: 2 }));
    cluster.runUntil(toyPrefillMs(40, 0) + 3 * MS_PER_BLOCK + 0.001);
    assert.equal(cluster.workers[1]!.numPendingAdoptions, 1, 'arrived, no room');
    assert.equal(cluster.workers[0]!.numParkedHandoffs, 1);
    cluster.runToCompletion();
    const late = cluster.result().requests.find((r) => r.id === 'late')!;
    assert.equal(late.finishReason, 'length');
    assert.equal(late.completionTokens, 2);
    assert.ok(late.kvTransferMs! > 3 * MS_PER_BLOCK, 'the transfer ended when the room came');
    for (const worker of cluster.workers) assert.equal(worker.stats().kvBlocksUsed, 0);
  });
});

describe('the disaggregated cold path in the lifecycle table', () => {
  const model = getModelProfile('llama-3.1-70b');
  test('same TTFT; the second token later by the transfer and a dispatch; only missing blocks counted', () => {
    const path = simulateDisaggregatedPath({ model, hw: H100_SXM, tp: 4, promptTokens: 1024, link: INFINIBAND_NDR });
    const lifecycle = simulateLifecycle({ model, hw: H100_SXM, tp: 4, promptTokens: 1024 });
    close(path.aggregated.ttftMs, lifecycle.cold.ttftMs);
    close(path.disaggregated.ttftMs, path.aggregated.ttftMs);
    const transfer = path.disaggregated.phases.find((p) => p.phase === 'kv_transfer')!.ms;
    close(transfer, 0.003 + ((1024 * 327_680) / 4 / (50e9 * 0.8)) * 1000, 1e-6);
    close(path.disaggregated.secondTokenMs - path.aggregated.secondTokenMs, transfer + 0.05);
    assert.equal(path.transferBlocks, 64);
    assert.equal(path.transferBytes, 1024 * 327_680);
    const warmDecode = simulateDisaggregatedPath({ model, hw: H100_SXM, tp: 4, promptTokens: 1024, link: INFINIBAND_NDR, decodeCachedTokens: 1000 });
    assert.equal(warmDecode.transferBlocks, 2, '62 of 64 blocks already on the decode worker');
  });

  test('the lifecycle table\'s disaggregated cold TTFT is the path the engine runs: the prefill worker\'s first token', () => {
    const lifecycle = simulateLifecycle({ model, hw: H100_SXM, tp: 4, promptTokens: 1000, disaggregated: { link: INFINIBAND_NDR } });
    const ms = (phase: string) => lifecycle.cold.phases.find((p) => p.phase === phase)!.ms;
    const check = checkDisaggregatedPathWithEngine({ model, hw: H100_SXM, tp: 4, promptTokens: 1000, link: INFINIBAND_NDR });
    // The simulated prefill and decode workers: first token when the prefill worker's prefill ends.
    close(ms('prefill_execution'), check.engineTtftMs);
    for (const after of ['kv_transfer', 'decode_dispatch', 'decode_execution']) assert.equal(ms(after), 0, `${after} comes after the first token`);
    close(lifecycle.cold.ttftMs, simulateLifecycle({ model, hw: H100_SXM, tp: 4, promptTokens: 1000 }).cold.ttftMs);
  });

  test('the simulated engine agrees with the table phase for phase', () => {
    const check = checkDisaggregatedPathWithEngine({ model, hw: H100_SXM, tp: 4, promptTokens: 1000, link: INFINIBAND_NDR });
    close(check.engineTtftMs, check.modelPrefillMs);
    close(check.engineSecondTokenGapMs, check.modelSecondTokenGapMs);
    assert.equal(check.engineTransferBlocks, 63);
    assert.equal(check.modelTransferBlocks, 63);
  });
});

describe('simulated workers behind the DisaggregatedEngine', () => {
  test('createWorkerPool with prefill and decode sim workers: the aggregated tokens, the transfer stamped', async () => {
    const sim = { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity };
    const pool = await createWorkerPool({
      engine: 'sim', workers: 1, prefillWorkers: 1, decodeWorkers: 2, sim, routerSeed: 1,
      disaggregationPolicy: { minRemotePrefillTokens: 64 },
    });
    const aggregated = await createWorkerPool({ engine: 'sim', workers: 1, sim });
    try {
      const ids = Array.from({ length: 700 }, (_, i) => (i * 7919 + 13) % 32000);
      const request = (id: string) => ({
        id, promptTokenIds: ids, priority: 0, arrivalMs: 0,
        sampling: { ...req('', []).sampling, maxTokens: 5, seed: 11 },
      });
      const collect = async (stream: AsyncIterable<EngineOutput>) => {
        const outputs: EngineOutput[] = [];
        for await (const o of stream) outputs.push(o);
        return outputs;
      };
      const outputs = await collect(pool.engine.generate(request('s1')));
      const expected = await collect(aggregated.engine.generate(request('s1')));
      assert.deepEqual(tokensOf(outputs), tokensOf(expected));
      const last = outputs.at(-1)!;
      assert.equal(last.routing!.disaggregation!.reason, 'remote-prefill', last.routing!.disaggregation!.detail);
      assert.equal(last.timestamps.kvTransfer!.blocks, Math.ceil(700 / 16));
      assert.ok(last.timestamps.kvTransfer!.end > last.timestamps.kvTransfer!.start, 'the link takes time');
      const short = await collect(pool.engine.generate({ ...request('s2'), promptTokenIds: ids.slice(0, 40) }));
      assert.equal(short.at(-1)!.routing!.disaggregation!.reason, 'short-prompt');
      assert.equal(pool.disaggregated!.channel.log.summary().transfers, 1);
      for (const { engine } of pool.workers) assert.equal(engine.stats().kvBlocksUsed, 0);
    } finally {
      await pool.engine.close();
      await aggregated.engine.close();
    }
  });
});

describe('the disaggregation policy prices a simulated transfer as the link moves it', () => {
  // The policy's estimate is bytes / estimated bytes per second; the starting rate is priced over one step budget of
  // tokens (simDisaggregationEstimates), so a prompt of that many tokens is estimated at exactly its transfer time.
  // A frontend's first decode worker may join before any prefill worker: the engine then starts with none.
  for (const [kvBytes, lateJoin] of [[2, false], [1, false], [2, true]] as const) {
    test(`${kvBytes === 2 ? 'BF16' : 'FP8'} KV${lateJoin ? ', the prefill worker joining after the engine was built' : ''}: `
      + 'estimated transfer ms = the simulated transfer\'s', async () => {
      const model = getModelProfile('llama-3.1-8b', { kvBytesPerElement: kvBytes });
      const stepTokens = 1024;
      const make = (role: 'prefill' | 'decode') => new SimEngine({
        model, hw: H100_SXM, tp: 1, speedUp: Infinity, role, enableKvEvents: true, maxNumBatchedTokens: stepTokens,
      });
      const prefill = make('prefill');
      const decode = make('decode');
      const engine = new DisaggregatedEngine({
        prefill: lateJoin ? [] : [{ id: 'p0', engine: prefill }], decode: [{ id: 'd0', engine: decode }],
        prefillRouter: new Router({ blockSize: 16, random: seededRandom(1) }),
        decodeRouter: new Router({ blockSize: 16, random: seededRandom(2) }),
        channel: new SimulatedKvChannel(), policy: { transferOverheadMs: 0, minRemotePrefillTokens: 64 },
        estimates: simDisaggregationEstimates(decode, stepTokens), now: () => decode.now(),
      });
      if (lateJoin) engine.addPrefillWorker('p0', prefill);
      try {
        const ids = Array.from({ length: stepTokens }, (_, i) => (i * 7919 + 13) % 32000);
        let last: EngineOutput | undefined;
        for await (const output of engine.generate(req('r', ids, 0, { maxTokens: 3 }))) last = output;
        const choice = last!.routing!.disaggregation!;
        const transfer = last!.timestamps.kvTransfer!;
        assert.equal(choice.reason, 'remote-prefill', choice.detail);
        assert.equal(transfer.bytes, stepTokens * kvBytesPerToken(model), 'the link moves the profile\'s bytes');
        close(choice.estimatedTransferMs, transfer.end - transfer.start);
      } finally {
        await engine.close();
      }
    });
  }
});

describe('a worker\'s RAM tier and the disaggregation policy', () => {
  test('a prompt the prefill worker holds in RAM does not shrink the prefill queued ahead of it there', async () => {
    // 16 blocks of 16 tokens in the prefill worker's pool, 64 in RAM below it.
    const prefill = new SimEngine({ ...toyWorker, numKvBlocks: 16, speedUp: Infinity, role: 'prefill', enableKvEvents: true, kvTiers: { ramBytes: 1 << 20 } });
    const decode = new SimEngine({ ...toyWorker, speedUp: Infinity, role: 'decode', enableKvEvents: true });
    const engine = new DisaggregatedEngine({
      prefill: [{ id: 'p0', engine: prefill }], decode: [{ id: 'd0', engine: decode }],
      prefillRouter: new Router({ blockSize: 16, random: seededRandom(1) }), decodeRouter: new Router({ blockSize: 16, random: seededRandom(2) }),
      channel: new SimulatedKvChannel(),
      policy: { transferOverheadMs: 0, minRemotePrefillTokens: 64, maxPrefillQueueTokens: 100, compareTransfer: false },
      estimates: { transferBytesPerSec: 1e9, prefillTokensPerSec: 1e4, fixed: true }, now: () => decode.now(),
    });
    try {
      const onPrefillWorker = async (id: string, ids: number[]) => {
        for await (const output of prefill.generate(req(id, ids, 0, { maxTokens: 2 }))) void output;
      };
      // The prompt's 8 whole blocks end up in the prefill worker's RAM only (a longer prompt took the whole pool).
      const ids = prompt(130, 3);
      await onPrefillWorker('first', ids);
      await onPrefillWorker('other', prompt(250, 5));
      const run = async (id: string, tokenIds: number[]) => {
        let last: EngineOutput | undefined;
        for await (const output of engine.generate(req(id, tokenIds, 0, { maxTokens: 2 }))) last = output;
        return last!.routing!.disaggregation!;
      };
      // Both at once: the second finds the first's 150 tokens queued on the prefill worker, over the bound of 100,
      // however little its own prompt would cost there.
      const [ahead, behind] = await Promise.all([run('ahead', prompt(150, 7)), run('behind', ids)]);
      assert.equal(ahead.reason, 'remote-prefill', ahead.detail);
      assert.deepEqual([behind.mode, behind.reason], ['local', 'prefill-queue-full'], behind.detail);
      assert.match(behind.detail, /^150 prefill tokens queued on p0 > 100$/);
    } finally {
      await engine.close();
    }
  });

  test('a prompt the decode worker holds in RAM is prefilled there, copied back rather than computed, not sent out', async () => {
    const prefill = new SimEngine({ ...toyWorker, speedUp: Infinity, role: 'prefill', enableKvEvents: true });
    // 16 blocks of 16 tokens in the pool, 64 in RAM below it.
    const decode = new SimEngine({ ...toyWorker, numKvBlocks: 16, speedUp: Infinity, role: 'decode', enableKvEvents: true, kvTiers: { ramBytes: 1 << 20 } });
    const engine = new DisaggregatedEngine({
      prefill: [{ id: 'p0', engine: prefill }], decode: [{ id: 'd0', engine: decode }],
      prefillRouter: new Router({ blockSize: 16, random: seededRandom(1) }), decodeRouter: new Router({ blockSize: 16, random: seededRandom(2) }),
      // Decided by the prompt's length alone: 64 tokens or more to compute locally, and it goes out.
      channel: new SimulatedKvChannel(), policy: { transferOverheadMs: 0, minRemotePrefillTokens: 64, compareTransfer: false },
      estimates: { transferBytesPerSec: 1e9, prefillTokensPerSec: 1e4, fixed: true }, now: () => decode.now(),
    });
    try {
      const onDecode = async (id: string, ids: number[]) => {
        for await (const output of decode.generate(req(id, ids, 0, { maxTokens: 2 }))) void output;
      };
      // The prompt runs on the decode worker, its blocks go down to RAM when it idles, and a longer prompt then takes
      // the whole pool: the prompt's 8 whole blocks (before its last token) are in RAM only.
      const ids = prompt(130, 3);
      await onDecode('first', ids);
      await onDecode('other', prompt(250, 5));
      let last: EngineOutput | undefined;
      for await (const output of engine.generate(req('again', ids, 0, { maxTokens: 2 }))) last = output;
      const choice = last!.routing!.disaggregation!;
      // 2 tokens to compute and 128 to copy back at a quarter of the price: the work of 34 tokens.
      assert.deepEqual([choice.mode, choice.reason, choice.uncachedTokens], ['local', 'short-prompt', 130], choice.detail);
      close(choice.estimatedPrefillMs, 34 / 1e4 * 1000);
      assert.equal(last!.usage.cachedTokens, 128, 'the local prefill took them from RAM');
    } finally {
      await engine.close();
    }
  });
});
