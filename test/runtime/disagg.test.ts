// Disaggregated prefill/decode over real CPU workers (worker threads, real models, KV copied between their pools
// through shared memory): the stream equals an aggregated engine's token for token, only missing blocks move,
// every block on every worker is free afterwards, each conditional decision shows with its reason, and aborts and
// failures at every stage free both sides.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { engineNow } from '../../src/engine/clock.ts';
import { WorkerLostError } from '../../src/engine/errors.ts';
import type { PrefillEvent } from '../../src/engine/handoff.ts';
import { LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest, type SamplingParams } from '../../src/engine/types.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { BitsetKvIndex } from '../../src/router/kv-index.ts';
import { seededRandom } from '../../src/util/random.ts';
import { Router } from '../../src/router/router.ts';
import { DisaggregatedEngine, type DisaggregatedStage } from '../../src/runtime/disaggregated.ts';
import { decideDisaggregation, type DisaggregationInputs } from '../../src/runtime/disaggregation-policy.ts';
import { SharedMemoryKvChannel } from '../../src/runtime/kv-transfer.ts';
import { createWorkerPool, type WorkerPool } from '../../src/runtime/worker-pool.ts';
import { cpuTestModel } from '../helpers/cpu-model.ts';
import { sharedModel } from '../helpers/shared-models.ts';
import { collect, text, tokens } from '../helpers/outputs.ts';

const BLOCK = 16;
let nextId = 0;

function request(promptTokenIds: number[], sampling: Partial<SamplingParams> = {}): EngineRequest {
  return {
    id: `d${nextId++}`, promptTokenIds, priority: 0, arrivalMs: engineNow(),
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 12, ignoreEos: true, temperature: 0, ...sampling },
  };
}

/** A prompt of `length` token ids sharing its first `shared` with every prompt of the same group. */
function prompt(group: number, length: number, variant = 0, shared = length): number[] {
  const token = (a: number, b: number) => 10 + ((Math.imul(a + 1, 0x9e3779b1) ^ Math.imul(b + 1, 0x85ebca6b)) >>> 0) % 250;
  return Array.from({ length }, (_, i) => (i < shared ? token(group, i) : token(100_000 + variant, i)));
}

/** Settles every worker (all messages posted so far handled), then checks that no block is in use anywhere. */
async function assertAllFree(pool: WorkerPool): Promise<void> {
  for (const { id, engine } of pool.workers) {
    const stats = await (engine as LocalEngine).sync();
    assert.equal(stats.kvBlocksUsed, 0, `worker ${id} holds no block`);
    assert.equal(stats.numRunning + stats.numWaiting, 0, `worker ${id} runs nothing`);
  }
}

async function untilStage(engine: DisaggregatedEngine, id: string, stage: DisaggregatedStage): Promise<void> {
  for (let turn = 0; engine.requestStage(id) !== stage; turn++) {
    if (turn > 100_000) assert.fail(`request ${id} never reached ${stage} (at ${engine.requestStage(id)})`);
    await new Promise<void>((resolve) => setImmediate(resolve));
  }
}

let tempDir: string;
before(() => { tempDir = mkdtempSync(join(tmpdir(), 'conduit-disagg-')); });
after(() => rmSync(tempDir, { recursive: true, force: true }));

function syntheticPath(): string {
  const path = join(tempDir, 'synthetic.gguf');
  writeSyntheticModel({
    name: 'disagg-synthetic', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 512,
    dtype: 'Q8_0', seed: 13, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
  }, path);
  return path;
}

/** The synthetic model always; stories260K too when ../shared/models has it. */
const MODELS: { name: string; path: () => string | undefined }[] = [
  ...(sharedModel('stories260K.gguf') ? [{ name: 'stories260K', path: () => sharedModel('stories260K.gguf') }] : []),
  { name: 'synthetic', path: syntheticPath },
];

/** One prefill and two decode workers, every prompt of 32+ uncached tokens prefilled remotely. */
async function disaggregatedPool(modelPath: string, extra: Parameters<typeof createWorkerPool>[0] extends infer O ? Partial<O> : never = {}) {
  return createWorkerPool({
    engine: 'cpu', workers: 1, prefillWorkers: 1, decodeWorkers: 2, modelPath, kvCacheMemoryBytes: 4 << 20, threads: 1,
    blockSize: BLOCK, routerSeed: 7, disaggregationPolicy: { minRemotePrefillTokens: 32 },
    // Fixed estimates: a transfer always beats a local prefill here, so the decision is not left to timing.
    disaggregationEstimates: { transferBytesPerSec: 1e12, prefillTokensPerSec: 1e3, fixed: true },
    ...extra,
  });
}

for (const model of MODELS) {
  describe(`disaggregated CPU workers on ${model.name}`, () => {
    let path: string | undefined;
    let pool: WorkerPool | undefined;
    let aggregated: LocalEngine | undefined;
    before(async () => {
      path = model.path();
      if (!path) return;
      pool = await disaggregatedPool(path);
      aggregated = await LocalEngine.start({ modelPath: path, kvCacheMemoryBytes: 4 << 20, threads: 1, blockSize: BLOCK });
    });
    after(async () => {
      await pool?.engine.close();
      await aggregated?.close();
    });

    for (const [variant, [label, sampling]] of ([
      ['greedy', { temperature: 0 }],
      ['temperature 0.8, seeded', { temperature: 0.8, topK: 40, seed: 77 }],
      ['temperature 1.1, stop string and penalties', { temperature: 1.1, seed: 5, frequencyPenalty: 0.4, maxTokens: 20 }],
    ] as [string, Partial<SamplingParams>][]).entries()) {
      test(`token-identical to one aggregated worker: ${label}`, async (t) => {
        if (!pool) return t.skip(`${model.name} is absent (../shared/models)`);
        // Every worker left at --kv-cache-dtype auto resolves it alike (f16 on both CPU backends): the transfer's
        // layout check passes and the aggregated worker stores what the pair does.
        assert.deepEqual([...pool.workers.map((w) => w.engine.info.kvDtype), aggregated!.info.kvDtype],
          new Array(pool.workers.length + 1).fill('f16'));
        for (const length of [40, 75, 130]) {
          // A prompt no worker has seen: a decode worker holding it would rightly prefill it itself.
          const ids = prompt(100 * variant + length, length);
          const expected = await collect(aggregated!.generate(request(ids, sampling)));
          const outputs = await collect(pool.engine.generate(request(ids, sampling)));
          assert.deepEqual(tokens(outputs), tokens(expected), `prompt of ${length}`);
          assert.equal(text(outputs), text(expected));
          const routing = outputs.at(-1)!.routing!;
          assert.equal(routing.disaggregation?.mode, 'disaggregated', routing.disaggregation?.detail);
          assert.equal(routing.disaggregation?.reason, 'remote-prefill');
          assert.equal(routing.disaggregation?.prefillWorkerId, 'prefill-0');
          assert.equal(routing.workerId, routing.disaggregation?.decodeWorkerId);
          const transfer = outputs.at(-1)!.timestamps.kvTransfer!;
          assert.ok(transfer, 'the kv_transfer phase is stamped');
          assert.ok(transfer.start >= outputs[0]!.timestamps.firstToken!, 'the transfer follows the first token');
          assert.ok(transfer.bytes > 0);
        }
        await assertAllFree(pool);
      });
    }

    test('a partial prefix on the decode worker: only its missing blocks move', async (t) => {
      if (!pool) return t.skip(`${model.name} is absent`);
      const log = pool.disaggregated!.channel.log;
      // 100 tokens: 6 full blocks and a partial one; the second prompt shares the first 64 tokens (4 blocks).
      const first = await collect(pool.engine.generate(request(prompt(900, 100))));
      const firstTransfer = log.recent().at(-1)!;
      assert.equal(firstTransfer.blocks, 7, 'the first time, every block moves');
      assert.equal(firstTransfer.reusedBlocks, 0);
      const second = await collect(pool.engine.generate(request(prompt(900, 100, 1, 64))));
      assert.equal(second.at(-1)!.routing!.workerId, first.at(-1)!.routing!.workerId, 'the decode router follows the prefix');
      assert.equal(second.at(-1)!.routing!.overlapBlocks, 4);
      const secondTransfer = log.recent().at(-1)!;
      assert.equal(secondTransfer.requestId, second[0]!.requestId);
      assert.equal(secondTransfer.reusedBlocks, 4, 'the shared blocks stay where they are');
      assert.equal(secondTransfer.blocks, 3, 'blocks 4, 5 and the partial 6 move');
      assert.equal(second.at(-1)!.timestamps.kvTransfer!.blocks, 3);
      const expected = await collect(aggregated!.generate(request(prompt(900, 100, 1, 64))));
      assert.deepEqual(tokens(second), tokens(expected));
      await assertAllFree(pool);
    });
  });
}

describe(`guided decoding with jump-forward on real workers (${cpuTestModel().name})`, () => {
  test('token-identical to one aggregated worker, greedy and seeded: the text forced after the first token goes out with it', async () => {
    const path = cpuTestModel().path;
    const pool = await disaggregatedPool(path, { decodeWorkers: 1, guidedJumpForward: true });
    const aggregated = await LocalEngine.start({ modelPath: path, kvCacheMemoryBytes: 4 << 20, threads: 1, blockSize: BLOCK, guidedJumpForward: true });
    try {
      const choice: SamplingParams['guided'] = { kind: 'choice', choices: ['the big dog', 'the little cat', 'a bird'] };
      const cases: Partial<SamplingParams>[] = [
        { guided: choice }, { guided: choice, temperature: 1, seed: 4 }, { guided: choice, temperature: 1, seed: 9 },
        { guided: { kind: 'regex', pattern: '(red|blue|green) [a-z]{2,6}, [0-9]{2}' }, temperature: 1, seed: 4 },
        { guided: { kind: 'regex', pattern: '(red|blue|green) [a-z]{2,6}, [0-9]{2}' } },
        {
          guided: { kind: 'json_schema', compact: true, schema: JSON.stringify({
            type: 'object', properties: { name: { type: 'string', maxLength: 10 }, age: { type: 'integer' } }, required: ['name', 'age'],
          }) }, temperature: 0.8, seed: 3,
        },
      ];
      let carried = 0;
      for (const [i, sampling] of cases.entries()) {
        const ids = prompt(3000 + i, 40);
        const sent = { ...sampling, maxTokens: 30, ignoreEos: false };
        const expected = await collect(aggregated.generate(request(ids, sent)));
        const outputs = await collect(pool.engine.generate(request(ids, sent)));
        const label = JSON.stringify(sampling).slice(0, 80);
        assert.equal(outputs.at(-1)!.routing!.disaggregation!.reason, 'remote-prefill', label);
        assert.deepEqual(tokens(outputs), tokens(expected), label);
        assert.equal(text(outputs), text(expected), label);
        assert.deepEqual([outputs.at(-1)!.finishReason, outputs.at(-1)!.usage.completionTokens],
          [expected.at(-1)!.finishReason, expected.at(-1)!.usage.completionTokens], label);
        assert.deepEqual(outputs[0]!.newTokenIds, expected[0]!.newTokenIds, `${label}: the first output is the first step's`);
        if (outputs[0]!.newTokenIds.length > 1) carried++;
      }
      assert.ok(carried > 0, 'some first output carried forced tokens');
      await assertAllFree(pool);
    } finally {
      await pool.engine.close();
      await aggregated.close();
    }
  });
});

describe('conditional disaggregation', () => {
  const base: DisaggregationInputs = {
    numPromptTokens: 1000, blockSize: 16, decodeWorkerId: 'decode-0', decodeOverlapBlocks: 0,
    prefill: { workerId: 'prefill-0', queuedPrefillTokens: 0 }, kvBytesPerToken: 1000, transferBytesPerSec: 1e9,
    prefillTokensPerSec: 1e4,
  };
  const policy = { minRemotePrefillTokens: 256, maxPrefillQueueTokens: 4096, transferOverheadMs: 0.5, compareTransfer: true };

  test('each reason, from the numbers that decide it', () => {
    const remote = decideDisaggregation(base, policy);
    assert.equal(remote.reason, 'remote-prefill');
    assert.equal(remote.transferBlocks, 63);
    assert.equal(remote.estimatedTransferMs, 0.5 + (63 * 16 * 1000 / 1e9) * 1000);
    assert.equal(remote.estimatedPrefillMs, 100);
    // The decode worker holds 50 of the 63 blocks: 208 tokens left, below the bound.
    const short = decideDisaggregation({ ...base, decodeOverlapBlocks: 50 }, policy);
    assert.deepEqual([short.mode, short.reason, short.uncachedTokens, short.transferBlocks], ['local', 'short-prompt', 200, 13]);
    assert.equal(decideDisaggregation({ ...base, numPromptTokens: 255 }, policy).reason, 'short-prompt');
    assert.equal(decideDisaggregation({ ...base, prefill: { workerId: 'prefill-0', queuedPrefillTokens: 4097 } }, policy).reason, 'prefill-queue-full');
    assert.equal(decideDisaggregation({ ...base, prefill: null }, policy).reason, 'prefill-queue-full');
    const slow = decideDisaggregation({ ...base, transferBytesPerSec: 1e7 }, policy);
    assert.deepEqual([slow.mode, slow.reason], ['local', 'transfer-slower']);
    assert.ok(slow.estimatedTransferMs > slow.estimatedPrefillMs);
    // Without the comparison the same numbers go remote, probe due or not; the other reasons still hold.
    const unweighed = { ...policy, compareTransfer: false };
    for (const probeTransfer of [false, true]) {
      const remoteAnyway = decideDisaggregation({ ...base, transferBytesPerSec: 1e7, probeTransfer }, unweighed);
      assert.deepEqual([remoteAnyway.mode, remoteAnyway.reason, remoteAnyway.prefillWorkerId], ['disaggregated', 'remote-prefill', 'prefill-0']);
    }
    assert.equal(decideDisaggregation({ ...base, transferBytesPerSec: 1e7, numPromptTokens: 255 }, unweighed).reason, 'short-prompt');
    assert.equal(decideDisaggregation({ ...base, transferBytesPerSec: 1e7, prefill: null }, unweighed).reason, 'prefill-queue-full');
    assert.equal(decideDisaggregation({ ...base, ineligible: 'n = 2' }, policy).reason, 'not-eligible');
    // A prompt of 4 whole blocks, all held on the decode worker: its last block is computed locally, moved by no transfer.
    const held = decideDisaggregation({ ...base, numPromptTokens: 64, decodeOverlapBlocks: 3, decodeHeldBlocks: 4 }, { ...policy, minRemotePrefillTokens: 16 });
    assert.deepEqual([held.reason, held.uncachedTokens, held.transferBlocks, held.estimatedTransferMs], ['remote-prefill', 16, 0, 0.5]);
  });

  test('blocks the decode worker holds in its RAM or disk tier make a local prefill cheaper, not the transfer shorter', () => {
    // 50 of the 62 reusable blocks in its RAM tier: 200 tokens to compute and 800 to copy back, the work of 200 more.
    const inRam = decideDisaggregation({ ...base, transferBytesPerSec: 2e7, decodeLowerTierBlocks: { blocks: 50, disk: 0 } }, policy);
    assert.deepEqual([inRam.mode, inRam.reason, inRam.uncachedTokens, inRam.transferBlocks], ['local', 'transfer-slower', 1000, 63]);
    assert.equal(inRam.estimatedPrefillMs, 40);
    assert.equal(inRam.estimatedTransferMs, 0.5 + (63 * 16 * 1000 / 2e7) * 1000, 'an adoption imports them all the same');
    // Without them, computing all 1000 tokens (100 ms) is slower than moving the KV (~51 ms).
    assert.equal(decideDisaggregation({ ...base, transferBytesPerSec: 2e7 }, policy).reason, 'remote-prefill');
    // On disk they cost twice as much to copy back: 10 of the 50 there, 40 more tokens' worth.
    assert.equal(decideDisaggregation({ ...base, decodeLowerTierBlocks: { blocks: 50, disk: 10 } }, policy).estimatedPrefillMs, 44);
    // A prompt the worker holds whole in RAM but for its last block is a short one: 4 tokens to compute, 496 to copy.
    const held = decideDisaggregation({ ...base, numPromptTokens: 500, decodeLowerTierBlocks: { blocks: 40, disk: 0 } }, policy);
    assert.deepEqual([held.reason, held.uncachedTokens], ['short-prompt', 500]);
    assert.match(held.detail, /500 uncached prompt tokens on decode-0, 496 of them in its RAM or disk tier \(the work of ~128 to compute\) < 256/);
  });

  test(`on real workers (${cpuTestModel().name}): remote, short prompt, prefill queue over its bound, n > 1, transfer slower`, async () => {
    const path = cpuTestModel().path;
    const pool = await disaggregatedPool(path, { decodeWorkers: 1, disaggregationPolicy: { minRemotePrefillTokens: 32, maxPrefillQueueTokens: 0 } });
    try {
      const reasonOf = (outputs: EngineOutput[]) => outputs.at(-1)!.routing!.disaggregation!;
      assert.equal(reasonOf(await collect(pool.engine.generate(request(prompt(1, 64))))).reason, 'remote-prefill');
      const short = reasonOf(await collect(pool.engine.generate(request(prompt(2, 20)))));
      assert.deepEqual([short.mode, short.reason], ['local', 'short-prompt']);
      // Two at once: the second sees the first's prompt queued on the only prefill worker (bound 0).
      const [a, b] = await Promise.all([
        collect(pool.engine.generate(request(prompt(3, 64)))), collect(pool.engine.generate(request(prompt(4, 64)))),
      ]);
      assert.equal(reasonOf(a).reason, 'remote-prefill');
      assert.equal(reasonOf(b).reason, 'prefill-queue-full');
      assert.match(reasonOf(b).detail, /64 prefill tokens queued on prefill-0 > 0/);
      const multi = await collect(pool.engine.generate(request(prompt(5, 64), { n: 2, temperature: 1, seed: 3 })));
      assert.equal(reasonOf(multi).reason, 'not-eligible');
      assert.equal(multi.filter((o) => o.finishReason).length, 2, 'both samples finish on the decode worker');
      const scored = await collect(pool.engine.generate(request(prompt(7, 64), { promptLogprobs: 1 })));
      assert.deepEqual([reasonOf(scored).mode, reasonOf(scored).reason], ['local', 'not-eligible']);
      assert.equal(scored[0]!.promptLogprobs?.length, 64, 'the decode worker computed the prompt and its logprobs');
      assert.deepEqual(pool.disaggregated!.decisionCounts(), { disaggregated: 2, local: 4, fallbacks: 0 });
      await assertAllFree(pool);
    } finally {
      await pool.engine.close();
    }
    const slow = await disaggregatedPool(path, { decodeWorkers: 1, disaggregationEstimates: { transferBytesPerSec: 1, prefillTokensPerSec: 1e6, fixed: true } });
    try {
      const outputs = await collect(slow.engine.generate(request(prompt(6, 64))));
      const why = outputs.at(-1)!.routing!.disaggregation!;
      assert.deepEqual([why.mode, why.reason], ['local', 'transfer-slower']);
      assert.equal(outputs.at(-1)!.timestamps.kvTransfer, undefined, 'nothing moved');
      await assertAllFree(slow);
    } finally {
      await slow.engine.close();
    }
  });

  test(`on real workers (${cpuTestModel().name}): a prompt of whole blocks the decode worker holds entirely is estimated to move what the transfer moves, none`, async () => {
    // A bound of one block: the block the decode worker would recompute locally is enough to go remote.
    const pool = await disaggregatedPool(cpuTestModel().path, { decodeWorkers: 1, disaggregationPolicy: { minRemotePrefillTokens: BLOCK } });
    try {
      const ids = prompt(8, 4 * BLOCK);
      await collect(pool.engine.generate(request(ids)));
      const outputs = await collect(pool.engine.generate(request(ids)));
      const why = outputs.at(-1)!.routing!.disaggregation!;
      assert.deepEqual([why.mode, why.reason, why.uncachedTokens], ['disaggregated', 'remote-prefill', BLOCK], why.detail);
      const moved = outputs.find((o) => o.timestamps.kvTransfer)!.timestamps.kvTransfer!;
      assert.equal(moved.blocks, 0, 'the decode worker held all 4 blocks: nothing moved');
      assert.equal(why.transferBlocks, moved.blocks, 'the estimate counts the blocks a transfer moves');
      assert.match(why.detail, / 0 blocks ~/);
      await assertAllFree(pool);
    } finally {
      await pool.engine.close();
    }
  });
});

describe(`cancellation and failure on real workers (${cpuTestModel().name})`, () => {
  const path = cpuTestModel().path;
  let pool: WorkerPool;
  before(async () => {
    // Small steps (8 tokens) make a 400-token prompt take 50 prefill steps: time to abort it mid-prefill.
    pool = await disaggregatedPool(path, { decodeWorkers: 1, maxNumBatchedTokens: 8 });
  });
  after(async () => { await pool?.engine.close(); });

  for (const [variant, stage] of (['prefill', 'transfer', 'decode'] as const).entries()) {
    test(`an abort during ${stage} reaches both workers and frees every block`, async () => {
      const req = request(prompt(50 + variant, 400), { maxTokens: 100_000 });
      const engine = pool.disaggregated!;
      const iterator = pool.engine.generate(req)[Symbol.asyncIterator]();
      const outputs: EngineOutput[] = [];
      const pump = (async () => {
        for (let r = await iterator.next(); !r.done; r = await iterator.next()) {
          outputs.push(r.value);
          // At 'transfer' the first token is out and the handoff on its way; abort before the decode worker is heard from.
          if (stage === 'transfer' && outputs.length === 1) engine.abort(req.id);
        }
      })();
      if (stage === 'prefill') {
        await untilStage(engine, req.id, 'prefill');
        engine.abort(req.id);
      } else if (stage === 'decode') {
        await untilStage(engine, req.id, 'decode');
        engine.abort(req.id);
      }
      await pump;
      assert.equal(outputs.at(-1)!.finishReason, 'abort');
      if (stage === 'decode') assert.ok(outputs.length >= 2);
      await assertAllFree(pool);
    });
  }

  test('a client that stops reading mid-decode frees both sides too', async () => {
    const req = request(prompt(41, 100), { maxTokens: 100_000 });
    let seen = 0;
    for await (const _ of pool.engine.generate(req)) if (++seen === 3) break;
    await assertAllFree(pool);
  });

  test('different KV dtypes on the two sides: the decode worker recomputes (transfer-failed) and frees both', async () => {
    // f32 asked for on the prefill side, auto (f16) on the decode side.
    const prefill = await LocalEngine.start({ modelPath: path, kvCacheMemoryBytes: 2 << 20, threads: 1, blockSize: BLOCK, kvDtype: 'f32', enableKvEvents: true, role: 'prefill' });
    const decode = await LocalEngine.start({ modelPath: path, kvCacheMemoryBytes: 4 << 20, threads: 1, blockSize: BLOCK, enableKvEvents: true, role: 'decode' });
    const router = () => new Router({ blockSize: BLOCK, random: seededRandom(1), index: new BitsetKvIndex() });
    const engine = new DisaggregatedEngine({
      prefill: [{ id: 'p', engine: prefill }], decode: [{ id: 'd', engine: decode }], prefillRouter: router(),
      decodeRouter: router(), channel: new SharedMemoryKvChannel(), policy: { minRemotePrefillTokens: 16 },
      estimates: { transferBytesPerSec: 1e12, prefillTokensPerSec: 1e3, fixed: true }, now: engineNow,
    });
    try {
      const outputs = await collect(engine.generate(request(prompt(42, 64))));
      assert.equal(tokens(outputs).length, 12, 'the stream still completes');
      const why = outputs.at(-1)!.routing!.disaggregation!;
      assert.deepEqual([why.mode, why.reason], ['local', 'transfer-failed']);
      assert.match(why.detail, /differ in dtype/);
      for (const worker of [prefill, decode]) assert.equal((await worker.sync()).kvBlocksUsed, 0);
    } finally {
      await engine.close();
    }
  });

  test('an aborted handoff frees its pinned blocks and the prefill worker reports it at once (no output says so)', async () => {
    const prefill = await LocalEngine.start({ modelPath: path, kvCacheMemoryBytes: 2 << 20, threads: 1, blockSize: BLOCK, enableKvEvents: true, role: 'prefill' });
    try {
      const req = request(prompt(43, 64));
      let pinned = 0;
      for await (const event of prefill.prefill(req)) if (event.type === 'handoff') pinned = event.handoff.sourceBlockIds.length;
      assert.ok(pinned > 0);
      await prefill.sync();
      assert.ok(prefill.stats().kvBlocksUsed >= pinned, 'the pinned blocks count as used');
      prefill.abort(req.id);
      // The stats the router reads (the last the worker reported), not a sync(): they must follow without a new output.
      for (let turn = 0; prefill.stats().kvBlocksUsed > 0; turn++) {
        if (turn > 200) assert.fail(`the reported stats still count ${prefill.stats().kvBlocksUsed} blocks in use`);
        await new Promise((resolve) => setTimeout(resolve, 10));
      }
    } finally {
      await prefill.close();
    }
  });

  test('a prefill worker that fails before the first token: the decode worker prefills, and the prefill router lets go at once', async () => {
    const prefill = await LocalEngine.start({ modelPath: path, kvCacheMemoryBytes: 2 << 20, threads: 1, blockSize: BLOCK, enableKvEvents: true, role: 'prefill' });
    const decode = await LocalEngine.start({ modelPath: path, kvCacheMemoryBytes: 4 << 20, threads: 1, blockSize: BLOCK, enableKvEvents: true, role: 'decode' });
    // The worker stays up and refuses the prompt (as one that hit an internal error would).
    prefill.prefill = () => (async function* (): AsyncGenerator<PrefillEvent> { throw new Error('internal error'); })();
    const prefillRouter = new Router({ blockSize: BLOCK, random: seededRandom(1), index: new BitsetKvIndex() });
    const engine = new DisaggregatedEngine({
      prefill: [{ id: 'p', engine: prefill }], decode: [{ id: 'd', engine: decode }], prefillRouter,
      decodeRouter: new Router({ blockSize: BLOCK, random: seededRandom(2), index: new BitsetKvIndex() }),
      channel: new SharedMemoryKvChannel(), policy: { minRemotePrefillTokens: 16 },
      estimates: { transferBytesPerSec: 1e12, prefillTokensPerSec: 1e3, fixed: true }, now: engineNow,
    });
    try {
      const outputs: EngineOutput[] = [];
      for await (const output of engine.generate(request(prompt(45, 64), { maxTokens: 30 }))) {
        // Decoding on the decode worker: the prefill worker's part is over, its router no longer counts the request.
        if (outputs.push(output) === 2) assert.equal(prefillRouter.stats().numActiveRequests, 0);
      }
      const why = outputs.at(-1)!.routing!.disaggregation!;
      assert.deepEqual([why.mode, why.reason], ['local', 'prefill-failed']);
      assert.equal(tokens(outputs).length, 30);
    } finally {
      await engine.close();
    }
  });

  test('a prefill worker lost before the first token: the decode worker prefills, identically', async () => {
    const failing = await disaggregatedPool(path, { decodeWorkers: 1, maxNumBatchedTokens: 8 });
    try {
      const req = request(prompt(43, 400), { maxTokens: 8 });
      const stream = collect(failing.engine.generate(req));
      await untilStage(failing.disaggregated!, req.id, 'prefill');
      await (failing.workers.find((w) => w.role === 'prefill')!.engine as LocalEngine).kill();
      const outputs = await stream;
      const why = outputs.at(-1)!.routing!.disaggregation!;
      assert.deepEqual([why.mode, why.reason], ['local', 'prefill-failed']);
      const expected = await collect((failing.workers.find((w) => w.role === 'decode')!.engine as LocalEngine)
        .generate(request(prompt(43, 400), { maxTokens: 8 })));
      assert.deepEqual(tokens(outputs), tokens(expected));
      assert.deepEqual(failing.disaggregated!.prefillWorkerIds, [], 'the lost worker left the prefill tier');
      const next = await collect(failing.engine.generate(request(prompt(44, 64))));
      assert.equal(next.at(-1)!.routing!.disaggregation!.reason, 'prefill-queue-full', 'no prefill worker left');
      const decodeStats = await (failing.workers.find((w) => w.role === 'decode')!.engine as LocalEngine).sync();
      assert.equal(decodeStats.kvBlocksUsed, 0);
    } finally {
      await failing.engine.close();
    }
  });

  test('a decode worker lost mid-decode: the request fails with WorkerLostError, the prefill worker is free', async () => {
    const failing = await disaggregatedPool(path, { decodeWorkers: 1 });
    try {
      const req = request(prompt(45, 64), { maxTokens: 100_000 });
      const outputs: EngineOutput[] = [];
      const pump = (async () => { for await (const output of failing.engine.generate(req)) outputs.push(output); })();
      await untilStage(failing.disaggregated!, req.id, 'decode');
      await (failing.workers.find((w) => w.role === 'decode')!.engine as LocalEngine).kill();
      await assert.rejects(pump, WorkerLostError);
      assert.ok(outputs.length >= 2, 'tokens came from both workers before the loss');
      const prefillStats = await (failing.workers.find((w) => w.role === 'prefill')!.engine as LocalEngine).sync();
      assert.equal(prefillStats.kvBlocksUsed, 0, 'the handed-off blocks were released');
    } finally {
      await failing.engine.close();
    }
  });
});
