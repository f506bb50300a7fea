// Handing a request from a prefill worker to a decode worker, inside one thread: the scheduler's half (which blocks
// are pinned, reused, filled and registered) on tiny pools with exact block ids, the copy of block runs between
// pools, and two real engine cores on real models whose handed-over output equals the output of one core alone.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { EngineCore, type KvSourceView } from '../../src/engine/engine-core.ts';
import { GrammarRuntime } from '../../src/engine/grammar/runtime.ts';
import { NARROW_CANDIDATES } from '../../src/engine/grammar/sampling.ts';
import {
  copyKvBlocks, KV_IN_PLACE_SOURCE, kvBlockBytes, readKvBlocks, validateHandoff, writeKvBlocks, type KvHandoff, type KvPoolView,
} from '../../src/engine/handoff.ts';
import type { KvStoredEvent } from '../../src/protocols/kv-events.ts';
import { Xoshiro128 } from '../../src/util/random.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest, type GuidedDecoding, type SamplingParams } from '../../src/engine/types.ts';
import { kvPoolBytes, type BackendFactory, type KvPoolLayout } from '../../src/kernels/types.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';
import type { Tokenizer } from '../../src/model/tokenizer/types.ts';
import { engineBackends } from '../helpers/backends.ts';
import { sharedModel } from '../helpers/shared-models.ts';
import { FILLER, makeRequest, makeScheduler, prompt, step, summary } from './scheduler-fixtures.ts';

// ---------------------------------------------------------------------------------------------------------------
// Scheduler side

describe('scheduler handoff: the prefill side pins, the decode side reuses, fills and registers', () => {
  test('handOff pins exactly the prompt blocks; unpinning frees them and leaves the full ones cached', () => {
    const s = makeScheduler({ numBlocks: 8, blockSize: 4 });
    s.addRequest(makeRequest('r', prompt(0, 10)), 0);
    assert.deepEqual(summary(step(s).plan), ['r/0+10*1']);
    const given = s.handOff('r');
    assert.equal(given.numComputedTokens, 10);
    assert.deepEqual(given.blockIds, [0, 1, 2]);
    assert.equal(given.blockHashes.length, 2, 'two full blocks of four among ten tokens');
    assert.deepEqual(given.outputTokenIds, [FILLER]);
    assert.equal(s.numRequests, 0, 'the scheduler forgot the request');
    assert.equal(s.kv.pool.numUsedBlocks, 3, 'the pin holds the blocks');
    s.checkInvariants();
    assert.equal(s.schedule(1).scheduled.length, 0, 'a handed-off request is never scheduled again');
    assert.equal(s.kv.unpin(given.pin), true);
    assert.equal(s.kv.unpin(given.pin), false, 'a second unpin is a no-op');
    assert.equal(s.kv.pool.numUsedBlocks, 0);
    const again = s.kv.findCachedPrefix(s.kv.createTable(), prompt(0, 10));
    assert.deepEqual(again.blocks.map((b) => b.id), [0, 1]);
    s.checkInvariants();
  });

  test('handOff after tokens appended unsampled (jump-forward) gives them all, uncomputed; adopted, they go in one step', () => {
    const s = makeScheduler({ numBlocks: 8, blockSize: 4 });
    s.addRequest(makeRequest('r', prompt(0, 10)), 0);
    step(s);
    s.appendTokens('r', 0, [7, 8], 1);
    const given = s.handOff('r');
    assert.deepEqual(given.outputTokenIds, [FILLER, 7, 8]);
    assert.equal(given.numComputedTokens, 10, 'the prompt');
    assert.deepEqual(given.blockIds, [0, 1, 2]);
    assert.equal(s.kv.unpin(given.pin), true);
    s.checkInvariants();
    const d = makeScheduler({ numBlocks: 8, blockSize: 4 });
    const request = d.adoptRequest(makeRequest('r', prompt(0, 10)), 2, { outputTokenIds: given.outputTokenIds, numCachedTokens: 0 },
      { numTokens: 10, fill: () => {} })!;
    assert.deepEqual(summary(step(d, 3).plan), ['r/0+3*1'], 'the three output tokens, then the next one sampled');
    assert.deepEqual(request.outputTokenIds, [FILLER, 7, 8, FILLER]);
    d.checkInvariants();
  });

  test('handOff refuses a request mid-prompt and one with n > 1', () => {
    const s = makeScheduler({ numBlocks: 16, blockSize: 4, longPrefillTokenThreshold: 4 });
    s.addRequest(makeRequest('chunked', prompt(0, 10)), 0);
    step(s);
    assert.throws(() => s.handOff('chunked'), /once its prompt is computed/);
    s.addRequest(makeRequest('multi', prompt(1, 3), { sampling: { n: 2 } }), 0);
    assert.throws(() => s.handOff('multi'), /only n = 1/);
    assert.throws(() => s.handOff('nobody'), /unknown request/);
  });

  test('adoptRequest reuses its own prefix hits, fills only the missing blocks and registers them', () => {
    const s = makeScheduler({ numBlocks: 16, blockSize: 4, enableEvents: true });
    // Another request leaves the first two blocks of the prompt in the prefix cache.
    const shared = prompt(0, 13);
    s.addRequest(makeRequest('earlier', [...shared.slice(0, 8), 99, 98], { sampling: { maxTokens: 1 } }), 0);
    step(s);
    s.kv.takeEvents();
    const fills: [number, number, number[]][] = [];
    const request = s.adoptRequest(makeRequest('r', shared), 5, { outputTokenIds: [FILLER], numCachedTokens: 4 }, {
      numTokens: 13,
      fill: (table, from, to) => fills.push([from, to, table.blockIds.slice(from, to)]),
    });
    assert.ok(request);
    assert.deepEqual(fills.map(([from, to]) => [from, to]), [[2, 4]], 'blocks 2 and 3 of the prompt move; 0 and 1 were here');
    assert.equal(request.numComputedTokens, 13);
    assert.equal(request.numCachedTokens, 4, 'usage keeps the prefill worker\'s hit');
    const events = s.kv.takeEvents();
    assert.equal(events.length, 1);
    const stored = events[0] as KvStoredEvent;
    assert.equal(stored.type, 'stored');
    assert.equal(stored.blockHashes.length, 1, 'the one full block that moved is now cached here');
    assert.equal(stored.parentHash, request.blockTable.blockHashes[1]);
    // Next step: only the first token is fed.
    assert.deepEqual(summary(step(s, 6).plan), ['r/0+1*1']);
    assert.deepEqual(request.outputTokenIds, [FILLER, FILLER]);
    s.checkInvariants();
  });

  test('adoptRequest changes nothing and returns null when the pool or the seats lack room', () => {
    const fill = () => assert.fail('nothing may be copied without room');
    const adopted = { outputTokenIds: [5], numCachedTokens: 0 };
    const pool = makeScheduler({ numBlocks: 4, blockSize: 4 });
    pool.addRequest(makeRequest('busy', prompt(1, 5)), 0);
    step(pool);
    assert.equal(pool.adoptRequest(makeRequest('big', prompt(0, 13)), 0, adopted, { numTokens: 13, fill }), null,
      'four blocks needed, two free');
    assert.equal(pool.kv.pool.numUsedBlocks, 2);
    assert.equal(pool.numRequests, 1);
    pool.checkInvariants();
    const seats = makeScheduler({ numBlocks: 8, blockSize: 4, maxNumSeqs: 1 });
    seats.addRequest(makeRequest('busy', prompt(1, 3)), 0);
    step(seats);
    assert.equal(seats.adoptRequest(makeRequest('small', prompt(2, 3)), 0, adopted, { numTokens: 3, fill }), null,
      'the one seat is taken');
    seats.checkInvariants();
  });

  test('a failed fill or mismatching hashes leave nothing allocated', () => {
    const s = makeScheduler({ numBlocks: 8, blockSize: 4 });
    assert.throws(() => s.adoptRequest(makeRequest('r', prompt(0, 9)), 0, { outputTokenIds: [5], numCachedTokens: 0 }, {
      numTokens: 9, fill: () => { throw new Error('link down'); },
    }), /link down/);
    assert.equal(s.kv.pool.numUsedBlocks, 0);
    const wrong = s.kv.fullBlockHashes(s.kv.createTable({ cacheSalt: 'other' }), prompt(0, 9), 9);
    assert.throws(() => s.adoptRequest(makeRequest('r', prompt(0, 9)), 0, { outputTokenIds: [5], numCachedTokens: 0 }, {
      numTokens: 9, blockHashes: wrong, fill: () => {},
    }), /block hashes differ/);
    assert.equal(s.kv.pool.numUsedBlocks, 0);
    assert.equal(s.numRequests, 0);
    s.checkInvariants();
  });

  test('without imported KV the adopted request recomputes prompt and first token, then samples the second', () => {
    const s = makeScheduler({ numBlocks: 8, blockSize: 4 });
    const request = s.adoptRequest(makeRequest('r', prompt(0, 6)), 0, { outputTokenIds: [5], numCachedTokens: 0 })!;
    assert.equal(request.status, 'waiting');
    assert.deepEqual(summary(step(s).plan), ['r/0+7*1'], 'six prompt tokens and the first output token');
    assert.deepEqual(request.outputTokenIds, [5, FILLER]);
    s.checkInvariants();
  });
});

// ---------------------------------------------------------------------------------------------------------------
// Worker side: copying block runs

describe('KV block copies between pools', () => {
  const layout = (numBlocks: number, dtype: 'f32' | 'f16' = 'f32'): KvPoolLayout =>
    ({ numLayers: 3, numBlocks, blockSize: 4, numKvHeads: 2, headDim: 8, dtype });
  const randomPool = (l: KvPoolLayout, seed: number): KvPoolView => {
    const pool = new SharedArrayBuffer(kvPoolBytes(l));
    const words = new Uint32Array(pool);
    const rng = Xoshiro128.fromSeed(seed);
    for (let i = 0; i < words.length; i++) words[i] = rng.nextUint32();
    return { pool, layout: l };
  };

  for (const dtype of ['f32', 'f16'] as const) {
    test(`copies exactly the named blocks of every layer's K and V (${dtype}), merging adjacent ones`, () => {
      const source = randomPool(layout(10, dtype), 1);
      const destination = randomPool(layout(7, dtype), 2);
      const before = new Uint8Array(destination.pool).slice();
      const sourceIds = [2, 3, 4, 9];
      const destinationIds = [0, 1, 2, 5];
      const { bytes, runs } = copyKvBlocks(source, destination, sourceIds, destinationIds);
      assert.equal(bytes, 4 * kvBlockBytes(source.layout));
      assert.equal(runs, 2 * 6, 'blocks 2-4 -> 0-2 are one run per plane, 9 -> 5 another');
      const runBytes = 4 * 2 * 8 * (dtype === 'f32' ? 4 : 2);
      const src = new Uint8Array(source.pool);
      const dst = new Uint8Array(destination.pool);
      for (let plane = 0; plane < 6; plane++) {
        for (let block = 0; block < 7; block++) {
          const at = (plane * 7 + block) * runBytes;
          const got = dst.subarray(at, at + runBytes);
          const k = destinationIds.indexOf(block);
          const expected = k < 0 ? before.subarray(at, at + runBytes)
            : src.subarray((plane * 10 + sourceIds[k]!) * runBytes, (plane * 10 + sourceIds[k]! + 1) * runBytes);
          assert.deepEqual(got, expected, `plane ${plane} block ${block}`);
        }
      }
      // Copy out then copy in gives the same pool as the direct copy.
      const viaBytes = randomPool(layout(7, dtype), 2);
      writeKvBlocks(viaBytes, destinationIds, readKvBlocks(source, sourceIds));
      assert.deepEqual(new Uint8Array(viaBytes.pool), dst);
    });
  }

  test('refuses pools of different shapes and block ids outside a pool', () => {
    const a = randomPool(layout(4), 1);
    assert.throws(() => copyKvBlocks(a, randomPool({ ...layout(4), headDim: 16 }, 2), [0], [0]), /differ in headDim/);
    assert.throws(() => copyKvBlocks(a, randomPool(layout(4, 'f16'), 2), [0], [0]), /differ in dtype/);
    assert.throws(() => copyKvBlocks(a, randomPool(layout(4), 2), [4], [0]), /outside the pool/);
    assert.throws(() => writeKvBlocks(a, [0], new Uint8Array(3)), /3 bytes for 1 blocks/);
  });
});

// ---------------------------------------------------------------------------------------------------------------
// Two engine cores on real models

interface Fixture { name: string; loaded: LoadedModel; tokenizer: Tokenizer }

let tempDir: string;
before(() => { tempDir = mkdtempSync(join(tmpdir(), 'conduit-handoff-')); });
after(() => rmSync(tempDir, { recursive: true, force: true }));

async function fixture(name: string, path: () => string | undefined): Promise<Fixture | undefined> {
  const file = path();
  if (!file) return undefined;
  const loaded = await loadModel(file);
  return { name, loaded, tokenizer: createTokenizer(loaded.tokenizerSource) };
}

const SYNTHETIC = {
  name: 'handoff-synthetic', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 256,
  dtype: 'Q8_0' as const, seed: 11, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
};
const models: { name: string; load: () => Promise<Fixture | undefined> }[] = [
  { name: 'stories260K', load: () => fixture('stories260K', () => sharedModel('stories260K.gguf')) },
  {
    name: 'synthetic', load: () => fixture('synthetic', () => {
      const path = join(tempDir, 'synthetic.gguf');
      writeSyntheticModel(SYNTHETIC, path);
      return path;
    }),
  },
];

// The bookkeeping under test is the same on every backend: the fastest one here runs it.
const backend: BackendFactory = engineBackends().at(-1)!;

interface CoreOptions {
  numBlocks?: number; blockSize?: number; maxNumBatchedTokens?: number; maxNumSeqs?: number; enableKvEvents?: boolean; grammar?: GrammarRuntime;
  jumpForward?: boolean;
}

function makeCore(f: Fixture, options: CoreOptions = {}): EngineCore {
  const runner = backend.load(f.loaded.config, f.loaded.weights,
    { numBlocks: options.numBlocks ?? 64, blockSize: options.blockSize ?? 8, dtype: 'f32' }, { threads: 1 });
  let clock = 0;
  return new EngineCore({
    backend: runner, tokenizer: f.tokenizer, maxNumSeqs: options.maxNumSeqs ?? 16,
    maxNumBatchedTokens: options.maxNumBatchedTokens ?? 256, maxModelLen: f.loaded.config.contextLength,
    enableKvEvents: options.enableKvEvents, now: () => clock++, ...(options.grammar ? { grammar: () => options.grammar } : {}),
    ...(options.jumpForward !== undefined ? { jumpForward: options.jumpForward } : {}),
  });
}

function request(id: string, promptTokenIds: number[], sampling: Partial<SamplingParams> = {}): EngineRequest {
  return { id, promptTokenIds, sampling: { ...DEFAULT_SAMPLING, maxTokens: 20, ignoreEos: true, ...sampling }, priority: 0, arrivalMs: 0 };
}

function drain(core: EngineCore, sink: EngineOutput[] = []): EngineOutput[] {
  for (let i = 0; core.hasWork; i++) {
    sink.push(...core.step());
    assert.ok(i < 10_000, 'engine did not finish');
  }
  return sink;
}

const tokensOf = (outputs: EngineOutput[], id: string) => outputs.filter((o) => o.requestId === id).flatMap((o) => o.newTokenIds);
const textOf = (outputs: EngineOutput[], id: string) => outputs.filter((o) => o.requestId === id).map((o) => o.textDelta).join('');

function source(core: EngineCore, id = 'prefill-0'): KvSourceView {
  return { id, channel: 'shared-memory', ...core.kvPoolView };
}

/** Prefill on one core, hand over, decode on the other; returns the outputs in stream order and the handoff. */
function disaggregate(prefill: EngineCore, decode: EngineCore, req: EngineRequest) {
  prefill.add(req, { handoff: true });
  const outputs = drain(prefill);
  const [handoff] = prefill.takeHandoffs();
  assert.ok(handoff, 'the prefill core handed the request over');
  validateHandoff(structuredClone(handoff));
  const adopted = decode.adopt(structuredClone(handoff), source(prefill));
  assert.ok(adopted);
  assert.equal(prefill.releaseHandoff(req.id), true);
  drain(decode, outputs);
  return { outputs, handoff, adopted };
}

function assertAllFree(...cores: EngineCore[]): void {
  for (const core of cores) {
    assert.equal(core.stats().kvBlocksUsed, 0, 'every block is free');
    assert.equal(core.numParkedHandoffs, 0);
    assert.equal(core.numPendingAdoptions, 0);
    core.scheduler.checkInvariants();
  }
}

for (const model of models) {
  describe(`prefill core -> decode core on ${model.name} (${backend.name})`, () => {
    let f: Fixture | undefined;
    before(async () => { f = await model.load(); });
    const prompts = () => {
      const text = 'Once upon a time there was a little girl named Lily who loved to play in the park with her dog';
      const ids = f!.tokenizer.encode(text);
      return [ids, ids.slice(0, 9), [...ids, ...ids].slice(0, 45)];
    };

    for (const [label, sampling] of [
      ['greedy', { temperature: 0 }],
      ['temperature 0.9 with a seed', { temperature: 0.9, topP: 0.9, seed: 1234 }],
      ['temperature 1 and penalties, min tokens', { temperature: 1, presencePenalty: 0.5, repetitionPenalty: 1.2, minTokens: 5, ignoreEos: false, seed: 9 }],
    ] as [string, Partial<SamplingParams>][]) {
      test(`token-identical to one core alone: ${label}`, (t) => {
        if (!f) return t.skip('model absent (needs ../shared/models/stories260K.gguf)');
        for (const [i, ids] of prompts().entries()) {
          const alone = makeCore(f);
          alone.add(request(`r${i}`, ids, sampling));
          const expected = drain(alone);
          const prefill = makeCore(f);
          const decode = makeCore(f);
          const { outputs, handoff, adopted } = disaggregate(prefill, decode, request(`r${i}`, ids, sampling));
          assert.deepEqual(tokensOf(outputs, `r${i}`), tokensOf(expected, `r${i}`), `prompt ${i}`);
          assert.equal(textOf(outputs, `r${i}`), textOf(expected, `r${i}`));
          assert.equal(outputs[0]!.newTokenIds.length, 1, 'the first output, from the prefill core, carries the first token');
          assert.equal(adopted.status, 'imported');
          assert.equal(adopted.transfer!.blocks, Math.ceil(ids.length / 8), 'every prompt block moved to the empty decode pool');
          assert.equal(handoff.numComputedTokens, ids.length);
          const last = outputs.at(-1)!;
          assert.deepEqual(last.timestamps.kvTransfer?.blocks, adopted.transfer!.blocks);
          assert.equal(last.timestamps.prefillChunks.length, 1, 'prefill timestamps travel with the request');
          assertAllFree(alone, prefill, decode);
        }
      });
    }

    test('an unseeded sampled request continues the seed the prefill core drew', (t) => {
      if (!f) return t.skip('model absent');
      const ids = prompts()[0]!;
      const prefill = makeCore(f);
      const decode = makeCore(f);
      const { outputs, handoff } = disaggregate(prefill, decode, request('u', ids, { temperature: 1 }));
      const alone = makeCore(f);
      alone.add(request('u', ids, { temperature: 1, seed: handoff.sampler.seed }));
      assert.deepEqual(tokensOf(outputs, 'u'), tokensOf(drain(alone), 'u'));
    });

    test('a guided request, greedy and seeded: token-identical to one core alone (its next row is tried as the prefill core would)', async (t) => {
      if (!f) return t.skip('model absent');
      const grammar = await GrammarRuntime.create(f.tokenizer, f.loaded.config.vocabSize);
      const grammars: GuidedDecoding[] = [
        { kind: 'regex', pattern: '[a-z ]{5,40}\\.' }, { kind: 'grammar', ebnf: 'root ::= [a-z ]+ "."' },
        { kind: 'json_schema', schema: JSON.stringify({ type: 'object', properties: { name: { type: 'string', maxLength: 20 } }, required: ['name'] }) },
      ];
      let wideAtHandoff = 0;
      for (const [g, guided] of grammars.entries()) {
        for (const sampling of [{ temperature: 0 }, ...[1, 2, 3, 4].map((seed) => ({ temperature: 1, seed })), { temperature: 0.8, seed: 5, logprobs: 2 }]) {
          const id = `g${g}-${JSON.stringify(sampling)}`;
          const req = () => request(id, f!.tokenizer.encode('Hello there'), { ...sampling, maxTokens: 30, ignoreEos: false, guided });
          const alone = makeCore(f, { grammar });
          alone.add(req());
          const expected = drain(alone);
          const { outputs, handoff } = disaggregate(makeCore(f, { grammar }), makeCore(f, { grammar }), req());
          assert.deepEqual(tokensOf(outputs, id), tokensOf(expected, id), id);
          if ((handoff.sampler.guided?.candidateWidth ?? 0) > NARROW_CANDIDATES) wideAtHandoff++;
        }
      }
      // Cases where the decode core, starting afresh, would have tried the next row otherwise.
      assert.ok(wideAtHandoff > 0, 'some handoff carried a wide candidate width');
    });

    test('jump-forward on: the tokens a grammar forces after the first token go along with it; token-identical to one core alone', async (t) => {
      if (!f) return t.skip('model absent');
      const grammar = await GrammarRuntime.create(f.tokenizer, f.loaded.config.vocabSize);
      const grammars: GuidedDecoding[] = [
        { kind: 'choice', choices: ['the big dog', 'the little cat', 'a bird'] },
        { kind: 'regex', pattern: '(red|blue|green) [a-z]{2,6}, [0-9]{2}' },
        { kind: 'json_schema', compact: true, schema: JSON.stringify({
          type: 'object', properties: { name: { type: 'string', maxLength: 12 }, age: { type: 'integer' } }, required: ['name', 'age'],
        }) },
      ];
      const jumping = { grammar, jumpForward: true };
      let carried = 0;
      for (const [g, guided] of grammars.entries()) {
        // Greedy, seeded, and with logprobs (which jump-forward skips: nothing forced on either side).
        for (const sampling of [{ temperature: 0 }, ...[1, 2, 3].map((seed) => ({ temperature: 1, seed })), { temperature: 0.8, seed: 5, logprobs: 2 }]) {
          const id = `jf${g}-${JSON.stringify(sampling)}`;
          const req = () => request(id, f!.tokenizer.encode('Hello there'), { ...sampling, maxTokens: 30, ignoreEos: false, guided });
          const alone = makeCore(f, jumping);
          alone.add(req());
          const expected = drain(alone);
          const prefill = makeCore(f, jumping);
          const decode = makeCore(f, jumping);
          const { outputs, handoff } = disaggregate(prefill, decode, req());
          assert.deepEqual(tokensOf(outputs, id), tokensOf(expected, id), id);
          assert.equal(textOf(outputs, id), textOf(expected, id), id);
          assert.deepEqual([outputs.at(-1)!.finishReason, outputs.at(-1)!.usage.completionTokens],
            [expected.at(-1)!.finishReason, expected.at(-1)!.usage.completionTokens], id);
          assert.deepEqual(outputs[0]!.newTokenIds, expected[0]!.newTokenIds, `${id}: the prefill core's output is the first step's`);
          assert.equal(prefill.forcedTokens + decode.forcedTokens, alone.forcedTokens, id);
          assert.deepEqual(handoff.outputTokenIds, outputs[0]!.newTokenIds, `${id}: the handoff carries what went out`);
          if (handoff.outputTokenIds.length > 1) carried++;
          assertAllFree(prefill, decode);
        }
      }
      assert.ok(carried > 0, 'some handoff carried forced tokens');
      // A forced run that reaches max_tokens ends the request on the prefill core, as it ends on one core alone.
      const short = () => request('jf-short', f!.tokenizer.encode('Hello there'), {
        temperature: 0, maxTokens: 3, ignoreEos: false, guided: { kind: 'choice', choices: ['the quick brown fox jumps over the lazy dog'] },
      });
      const alone = makeCore(f, jumping);
      alone.add(short());
      const expected = drain(alone);
      const prefill = makeCore(f, jumping);
      prefill.add(short(), { handoff: true });
      const outputs = drain(prefill);
      assert.deepEqual(prefill.takeHandoffs(), [], 'nothing left to hand off');
      assert.deepEqual(outputs.map((o) => [o.newTokenIds, o.textDelta, o.finishReason]), expected.map((o) => [o.newTokenIds, o.textDelta, o.finishReason]));
      assert.equal(outputs.at(-1)!.finishReason, 'length');
      assertAllFree(prefill);
    });

    test('a request prefilled again after output went out (priorOutputTokenIds): the decode core counts that output for the penalties and advances the grammar over it', async (t) => {
      if (!f) return t.skip('model absent');
      const grammar = await GrammarRuntime.create(f.tokenizer, f.loaded.config.vocabSize);
      const guided: GuidedDecoding = { kind: 'regex', pattern: '(Once|Lily|The) [a-z]+ [a-z]+ [a-z]+ [a-z]+\\.' };
      const penalties = { frequencyPenalty: 2, presencePenalty: 2 };
      const maxTokens = 24;
      // Every case, prompt and point of the move whose continuation differs from one core's: none.
      const differing: string[] = [];
      for (const [label, sampling] of [
        ['penalties, greedy', { temperature: 0, ...penalties }],
        ['penalties, seeded', { temperature: 1, seed: 8, ...penalties }],
        ['guided, greedy', { temperature: 0, guided }],
        ['guided, seeded', { temperature: 1, seed: 6, guided }],
        ['guided with penalties, seeded', { temperature: 0.8, seed: 4, guided, ...penalties }],
      ] as [string, Partial<SamplingParams>][]) {
        for (const [p, ids] of prompts().entries()) {
          const original = request('m', ids, { ...sampling, maxTokens, ignoreEos: sampling.guided === undefined });
          const undisturbed = makeCore(f, { grammar });
          undisturbed.add(original);
          const whole = tokensOf(drain(undisturbed), 'm');
          for (const done of [1, 2, 5].filter((n) => n < whole.length)) {
            // What a request whose prefill worker was lost after `done` tokens went out is sent again as.
            const prior = whole.slice(0, done);
            const again = (): EngineRequest => ({
              ...original, promptTokenIds: [...ids, ...prior], priorOutputTokenIds: prior,
              sampling: { ...original.sampling, maxTokens: maxTokens - done },
            });
            const alone = makeCore(f, { grammar });
            alone.add(again());
            const expected = drain(alone);
            const { outputs } = disaggregate(makeCore(f, { grammar }), makeCore(f, { grammar }), again());
            const what = `${label}, prompt ${p}, after ${done}`;
            const same = tokensOf(outputs, 'm').join() === tokensOf(expected, 'm').join() && textOf(outputs, 'm') === textOf(expected, 'm')
              && outputs.at(-1)!.finishReason === expected.at(-1)!.finishReason;
            if (!same) differing.push(what);
            // Greedy, the continuation is the rest of the undisturbed output.
            if (sampling.temperature === 0) assert.deepEqual([...prior, ...tokensOf(expected, 'm')], whole, what);
          }
        }
      }
      assert.deepEqual(differing, []);
    });

    test('a token the grammar refuses on resume fails the adoption, saying which, and leaves nothing behind', async (t) => {
      if (!f) return t.skip('model absent');
      const grammar = await GrammarRuntime.create(f.tokenizer, f.loaded.config.vocabSize);
      const guided: GuidedDecoding = { kind: 'regex', pattern: '(Once|Lily|The) [a-z ]+\\.' };
      const probe = grammar.open(guided);
      let refused = 3;
      while (probe.accept(refused)) refused++;
      probe.dispose();
      const req = () => request('bad', prompts()[0]!, { temperature: 0, maxTokens: 12, ignoreEos: false, guided });
      const prefill = makeCore(f, { grammar });
      prefill.add(req(), { handoff: true });
      const outputs = drain(prefill);
      const [handoff] = prefill.takeHandoffs();
      const decode = makeCore(f, { grammar });
      const handedOff = structuredClone(handoff!);
      handedOff.outputTokenIds = [refused];
      assert.throws(() => decode.adopt(handedOff, source(prefill)),
        new RegExp(`request bad: the request's grammar refuses token ${refused}, token 1 of the 1 the prefill worker produced; it cannot go on under its grammar`));
      const migrated = structuredClone(handoff!);
      migrated.request = { ...migrated.request, priorOutputTokenIds: [refused] };
      assert.throws(() => decode.adopt(migrated, null),
        new RegExp(`the request's grammar refuses token ${refused}, output token 1 of the 1 produced before the request was prefilled again`));
      assert.equal(decode.hasRequest('bad'), false);
      assertAllFree(decode);
      // The handoff as it was goes on as on one core alone.
      assert.ok(decode.adopt(structuredClone(handoff!), source(prefill)));
      prefill.releaseHandoff('bad');
      drain(decode, outputs);
      const alone = makeCore(f, { grammar });
      alone.add(req());
      assert.deepEqual(tokensOf(outputs, 'bad'), tokensOf(drain(alone), 'bad'));
      assertAllFree(prefill, decode);
    });

    test('a partial prefix on the decode core: only the missing blocks move, and they become cached there', (t) => {
      if (!f) return t.skip('model absent');
      const ids = prompts()[2]!; // 45 tokens: 5 full blocks of 8 and a partial one
      const prefill = makeCore(f);
      const decode = makeCore(f, { enableKvEvents: true });
      decode.add(request('warm', [...ids.slice(0, 24), 1, 2, 3], { maxTokens: 1 }));
      drain(decode);
      decode.takeKvEvents();
      const { outputs, adopted } = disaggregate(prefill, decode, request('p', ids, { temperature: 0.8, seed: 3 }));
      assert.equal(adopted.transfer!.reusedBlocks, 3, 'the first 24 tokens were cached on the decode core');
      assert.equal(adopted.transfer!.blocks, 3, 'blocks 3, 4 (full) and 5 (partial) moved');
      const stored = decode.takeKvEvents().filter((e): e is KvStoredEvent => e.type === 'stored');
      assert.equal(stored[0]!.blockHashes.length, 2, 'the two moved full blocks are registered on the decode core');
      const alone = makeCore(f);
      alone.add(request('p', ids, { temperature: 0.8, seed: 3 }));
      assert.deepEqual(tokensOf(outputs, 'p'), tokensOf(drain(alone), 'p'));
      // The next request with this prompt finds all five full blocks on the decode core.
      decode.add(request('again', ids, { maxTokens: 1 }));
      const again = drain(decode);
      assert.equal(again[0]!.usage.cachedTokens, 40);
      assertAllFree(prefill, decode);
    });

    test('a decode core without room waits, keeps the source pinned, and adopts once a request finishes', (t) => {
      if (!f) return t.skip('model absent');
      const ids = prompts()[0]!;
      const prefill = makeCore(f);
      // Room for the whole request once alone, but while the hog runs one block short of the prompt.
      const need = Math.ceil(ids.length / 8);
      const numBlocks = Math.ceil((ids.length + 20) / 8) + 1;
      const decode = makeCore(f, { numBlocks });
      decode.add(request('hog', prompt(0, (numBlocks - need + 1) * 8 - 4).map((t) => t % 200 + 3), { maxTokens: 3 }));
      decode.step();
      prefill.add(request('w', ids, { seed: 5, temperature: 0.7 }), { handoff: true });
      const outputs = drain(prefill);
      const [handoff] = prefill.takeHandoffs();
      assert.equal(decode.adopt(handoff!, source(prefill)), null, 'no room yet');
      assert.equal(decode.numPendingAdoptions, 1);
      assert.equal(prefill.numParkedHandoffs, 1);
      drain(decode, outputs);
      const [adopted] = decode.takeAdopted();
      assert.equal(adopted?.status, 'imported');
      prefill.releaseHandoff('w');
      const alone = makeCore(f);
      alone.add(request('w', ids, { seed: 5, temperature: 0.7 }));
      assert.deepEqual(tokensOf(outputs, 'w'), tokensOf(drain(alone), 'w'));
      assertAllFree(prefill, decode);
    });

    test('without a source, or with an incompatible pool, the decode core recomputes and still matches', (t) => {
      if (!f) return t.skip('model absent');
      const ids = prompts()[0]!;
      const alone = makeCore(f);
      alone.add(request('x', ids, { temperature: 0.8, seed: 21 }));
      const expected = tokensOf(drain(alone), 'x');
      for (const decode of [makeCore(f), makeCore(f, { blockSize: 4 })]) {
        const prefill = makeCore(f);
        prefill.add(request('x', ids, { temperature: 0.8, seed: 21 }), { handoff: true });
        const outputs = drain(prefill);
        const [handoff] = prefill.takeHandoffs();
        const sameShape = decode.kv.blockSize === 8;
        const adopted = decode.adopt(handoff!, sameShape ? null : source(prefill))!;
        assert.equal(adopted.status, 'recompute');
        assert.match(adopted.error!, sameShape ? /no KV source/ : /differ in blockSize/);
        prefill.releaseHandoff('x');
        drain(decode, outputs);
        assert.deepEqual(tokensOf(outputs, 'x'), expected);
        assertAllFree(prefill, decode);
      }
    });

    test('a request that ends on its first token is not handed off', (t) => {
      if (!f) return t.skip('model absent');
      const prefill = makeCore(f);
      prefill.add(request('one', prompts()[1]!, { maxTokens: 1 }), { handoff: true });
      const outputs = drain(prefill);
      assert.equal(outputs.at(-1)!.finishReason, 'length');
      assert.deepEqual(prefill.takeHandoffs(), []);
      assertAllFree(prefill);
    });

    test('KV written in place into blocks reserved for it: the table takes them (nothing copied), same tokens; release and abort free them', (t) => {
      if (!f) return t.skip('model absent');
      const ids = prompts()[2]!; // 45 tokens: 5 full blocks of 8 and a partial one
      const prefill = makeCore(f);
      const decode = makeCore(f);
      // The first 3 blocks cached on the decode core: held there, not reserved.
      decode.add(request('warm', [...ids.slice(0, 24), 1, 2, 3], { maxTokens: 1 }));
      drain(decode);
      prefill.add(request('p', ids, { temperature: 0 }), { handoff: true });
      const outputs = drain(prefill);
      const [handoff] = prefill.takeHandoffs();
      const prepared = decode.prepareKvImport('p', handoff!.blockHashes, handoff!.sourceBlockIds.length);
      assert.equal(prepared.held, 3);
      assert.equal(prepared.blockIds!.length, 3);
      assert.equal(decode.stats().kvBlocksUsed, 6, '3 held and 3 reserved');
      // The transfer (over the network, between processes) writes the missing blocks straight into the reserved ones.
      copyKvBlocks(prefill.kvPoolView, decode.kvPoolView, handoff!.sourceBlockIds.slice(3), prepared.blockIds!);
      const adopted = decode.adopt(structuredClone(handoff!), KV_IN_PLACE_SOURCE)!;
      assert.equal(adopted.status, 'imported', adopted.error);
      assert.deepEqual({ blocks: adopted.transfer!.blocks, reused: adopted.transfer!.reusedBlocks, runs: adopted.transfer!.runs }, { blocks: 3, reused: 3, runs: 0 });
      assert.equal(decode.numImportReservations, 0, 'the request\'s table took the reserved blocks');
      assert.equal(decode.stats().kvBlocksUsed, 6, 'no block was allocated to copy into');
      assert.equal(prefill.releaseHandoff('p'), true);
      drain(decode, outputs);
      const alone = makeCore(f);
      alone.add(request('p', ids, { temperature: 0 }));
      assert.deepEqual(tokensOf(outputs, 'p'), tokensOf(drain(alone), 'p'));
      assertAllFree(prefill, decode);
      // Not adopted after all: a release (of the current preparation only) or an abort gives everything back.
      const first = decode.prepareKvImport('q', handoff!.blockHashes, 6);
      const second = decode.prepareKvImport('q', handoff!.blockHashes, 6);
      assert.equal(second.held, 5, 'the adopted prompt\'s full blocks are cached now');
      assert.equal(decode.releaseKvImport('q', first.ticket), false, 'a replaced preparation is not released');
      assert.ok(decode.stats().kvBlocksUsed > 0);
      assert.equal(decode.releaseKvImport('q', second.ticket), true);
      assertAllFree(decode);
      decode.prepareKvImport('r', [], 6);
      assert.equal(decode.stats().kvBlocksUsed, 6);
      decode.abort('r');
      assertAllFree(decode);
      // No reservation that would leave a running request without a free block for its next one: the hold only.
      const small = makeCore(f, { numBlocks: 8 });
      small.add(request('running', ids.slice(0, 20), { maxTokens: 8 }));
      small.step();
      const used = small.stats().kvBlocksUsed;
      assert.equal(small.prepareKvImport('t', [], 8 - used).blockIds, null, 'all the free blocks would leave none for the running request');
      assert.equal(small.stats().kvBlocksUsed, used);
      assert.equal(small.prepareKvImport('t', [], 8 - used - 1).blockIds!.length, 8 - used - 1);
      small.abort('t');
      drain(small);
      assertAllFree(small);
      // An in-place adopt without a reservation, or one that does not cover the prompt, recomputes.
      prefill.add(request('s', ids, { temperature: 0 }), { handoff: true });
      drain(prefill);
      const [handoffS] = prefill.takeHandoffs();
      decode.prepareKvImport('s', [], 2);
      assert.equal(decode.adopt(structuredClone(handoffS!), KV_IN_PLACE_SOURCE)!.status, 'recompute');
      assert.equal(decode.numImportReservations, 0);
      prefill.releaseHandoff('s');
      drain(decode);
      assertAllFree(prefill, decode);
      // An adopt refused (an adapter this worker does not hold): what was prepared for its import is given back,
      // since no abort follows for a request this worker never took.
      decode.prepareKvImport('s', handoffS!.blockHashes, 6);
      assert.ok(decode.stats().kvBlocksUsed > 0);
      const withAdapter = structuredClone(handoffS!);
      withAdapter.request = { ...withAdapter.request, lora: 'absent' };
      assert.throws(() => decode.adopt(withAdapter, KV_IN_PLACE_SOURCE), /absent/);
      assert.equal(decode.numImportReservations, 0);
      assertAllFree(decode);
    });

    test('aborts free blocks at every stage on both cores', (t) => {
      if (!f) return t.skip('model absent');
      const ids = prompts()[2]!;
      // Mid-prefill (chunked over several steps).
      const prefill = makeCore(f, { maxNumBatchedTokens: 8 });
      prefill.add(request('a', ids), { handoff: true });
      prefill.step();
      assert.ok(prefill.stats().kvBlocksUsed > 0);
      assert.equal(prefill.abort('a')[0]!.finishReason, 'abort');
      assertAllFree(prefill);
      // Handed off, not yet adopted: the abort unpins.
      prefill.add(request('b', ids), { handoff: true });
      drain(prefill);
      const [handoff] = prefill.takeHandoffs();
      assert.equal(prefill.stats().kvBlocksUsed, Math.ceil(ids.length / 8));
      assert.deepEqual(prefill.abort('b'), [], 'the stream is no longer the prefill core\'s to close');
      assertAllFree(prefill);
      // Waiting on the decode core for room.
      const decode = makeCore(f, { numBlocks: Math.ceil(ids.length / 8) + 1 });
      decode.add(request('hog', ids.map((t) => t + 1), { maxTokens: 4 }));
      decode.step();
      assert.equal(decode.adopt(handoff!, source(prefill)), null);
      const [closing] = decode.abort('b');
      assert.equal(closing!.finishReason, 'abort');
      assert.equal(closing!.usage.completionTokens, 1);
      drain(decode);
      assertAllFree(decode);
      // Mid-decode.
      prefill.add(request('c', ids), { handoff: true });
      drain(prefill);
      const [handoffC] = prefill.takeHandoffs();
      decode.adopt(handoffC!, source(prefill));
      prefill.releaseHandoff('c');
      decode.step();
      assert.equal(decode.abort('c')[0]!.finishReason, 'abort');
      assertAllFree(prefill, decode);
    });
  });
}

test('validateHandoff names what is wrong', () => {
  const good: KvHandoff = {
    requestId: 'r', request: { ...request('r', [1, 2, 3]), sampling: { ...DEFAULT_SAMPLING, seed: 4 } }, outputTokenIds: [9],
    numComputedTokens: 3, blockSize: 2, sourceBlockIds: [0, 1], blockHashes: ['0123456789abcdef' as never],
    sampler: { seed: 4, rngState: [1, 2, 3, 4] }, numCachedTokens: 0, timestamps: { arrival: 0, prefillChunks: [] },
    sourceLayout: { numLayers: 1, numBlocks: 4, blockSize: 2, numKvHeads: 1, headDim: 2, dtype: 'f32' }, createdMs: 0,
  };
  assert.equal(validateHandoff(good), good);
  assert.throws(() => validateHandoff({ ...good, sourceBlockIds: [0] }), /sourceBlockIds must be 2 block ids/);
  assert.throws(() => validateHandoff({ ...good, numComputedTokens: 4 }), /numComputedTokens must be in \[0, 4\)/);
  assert.throws(() => validateHandoff({ ...good, sampler: { seed: 5, rngState: [1, 2, 3, 4] } }), /sampler.seed/);
  assert.throws(() => validateHandoff({ ...good, outputTokenIds: [] }), /first token/);
  const guided = { ...good, sampler: { ...good.sampler, guided: { candidateWidth: 16, argmaxTaken: true } } };
  assert.equal(validateHandoff(guided), guided);
  for (const bad of [{ candidateWidth: 0, argmaxTaken: false }, { candidateWidth: 17, argmaxTaken: false }, { candidateWidth: 2, argmaxTaken: 'no' }, null]) {
    assert.throws(() => validateHandoff({ ...good, sampler: { ...good.sampler, guided: bad as never } }), /sampler.guided must be/);
  }
});
