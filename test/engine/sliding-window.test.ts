// Sliding-window attention in the paged KV cache: a sequence's blocks that fall before every layer's window are given
// back while it runs, so a long generation holds a bounded number of blocks; a released block keeps its hash and KV
// until the pool reuses it, so prefix hits stay correct (they stop at the first reused block). Checked on the
// scheduler with exact block counts (a long prompt computed in chunks gives blocks back as it goes, unless it forks or
// is handed off), then end to end on a Mistral-layout model (a window in every layer) on every backend: the engine,
// which releases blocks, also while it computes the prompt, gives the greedy tokens of a run that keeps every block,
// and the window changes the text (so the comparison can fail).
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { KvCacheManager } from '../../src/engine/kv-cache/manager.ts';
import { Scheduler } from '../../src/engine/scheduler.ts';
import { DEFAULT_SAMPLING } from '../../src/engine/types.ts';
import type { BackendFactory } from '../../src/kernels/types.ts';
import { uniformWindow } from '../../src/model/config.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';
import { greedyOnBackend } from '../helpers/backend-greedy.ts';
import { engineBackends } from '../helpers/backends.ts';
import { MISTRAL_SWA_MODEL, writeArchGguf, writeArchHf } from '../model/arch-models.ts';
import { EOS, makeRequest, prompt, step } from './scheduler-fixtures.ts';

const BLOCK = 4;
const WINDOW = 8;

function makeScheduler(numBlocks: number, slidingWindow: number | null = WINDOW): Scheduler {
  const kv = new KvCacheManager({ numBlocks, blockSize: BLOCK, ...(slidingWindow !== null ? { slidingWindow } : {}) });
  return new Scheduler({ maxNumBatchedTokens: 64, maxNumSeqs: 8, maxModelLen: 1024, eosTokenIds: [EOS] }, kv);
}

/** Blocks a decoding sequence can hold: its window's positions (at most ceil((W - 1) / B) + 1 blocks) and the next one. */
const HELD_BOUND = Math.ceil((WINDOW - 1) / BLOCK) + 2;

describe('KV cache with a sliding window in every layer', () => {
  test('a long generation holds a bounded number of blocks', () => {
    // 6 + 200 tokens would hold 52 blocks.
    const scheduler = makeScheduler(64);
    scheduler.addRequest(makeRequest('a', prompt(0, 6), { sampling: { maxTokens: 200, ignoreEos: true } }), 0);
    let maxUsed = 0;
    for (let i = 0; scheduler.numRequests > 0; i++) {
      assert.ok(i < 1000, 'bounded');
      step(scheduler, i);
      scheduler.checkInvariants();
      maxUsed = Math.max(maxUsed, scheduler.kv.pool.numUsedBlocks);
      const sequence = scheduler.getRequest('a')?.sequences[0];
      if (sequence) {
        assert.ok(sequence.blockTable.heldBlocks.length <= HELD_BOUND, `step ${i}: ${sequence.blockTable.heldBlocks.length} blocks held`);
        assert.equal(sequence.numPreemptions, 0);
      }
    }
    assert.ok(maxUsed <= HELD_BOUND, `at most ${HELD_BOUND} blocks in use, saw ${maxUsed}`);
    assert.equal(scheduler.kv.pool.numUsedBlocks, 0, 'every block is back');
  });

  test('the released blocks are exactly those before the next token\'s window, and stay cached', () => {
    const scheduler = makeScheduler(64);
    scheduler.addRequest(makeRequest('a', prompt(0, 6), { sampling: { maxTokens: 30, ignoreEos: true } }), 0);
    for (let i = 0; i < 20; i++) step(scheduler, i);
    const sequence = scheduler.getRequest('a')!.sequences[0]!;
    // The next token's position is numComputedTokens; its window starts WINDOW - 1 positions before it. Blocks are
    // released when the sequence is scheduled, so the last step released up to the window of the token it computed.
    const lastComputed = sequence.numComputedTokens - 1;
    const expectedReleased = Math.floor((lastComputed - WINDOW + 1) / BLOCK);
    assert.equal(sequence.blockTable.numReleasedBlocks, expectedReleased);
    const released = sequence.blockTable.blocks.slice(0, expectedReleased);
    for (const block of released) {
      assert.equal(block.refCount, 0, `block ${block.id} is free`);
      assert.notEqual(block.hash, null, `block ${block.id} keeps its hash`);
    }
    scheduler.checkInvariants();
  });

  test('a prefix hit on a finished sequence takes its released blocks while they are cached', () => {
    const scheduler = makeScheduler(64);
    scheduler.addRequest(makeRequest('a', prompt(0, 6), { sampling: { maxTokens: 40, ignoreEos: true } }), 0);
    let tokens: number[] = [];
    let aBlocks: number[] = [];
    for (let i = 0; scheduler.numRequests > 0; i++) {
      const sequence = scheduler.getRequest('a')?.sequences[0];
      if (sequence) { tokens = sequence.tokenIds.slice(); aBlocks = sequence.blockTable.blockIds; }
      step(scheduler, i);
    }
    // Nothing reused the blocks (64 of them): the whole computed run of 'a' is found, in a's own blocks.
    scheduler.addRequest(makeRequest('b', tokens, { sampling: { maxTokens: 1 } }), 100);
    scheduler.schedule(100);
    const b = scheduler.getRequest('b')!;
    const numFull = Math.floor((tokens.length - 1) / BLOCK);
    assert.equal(b.numCachedTokens, numFull * BLOCK);
    assert.deepEqual(b.sequences[0]!.blockTable.blockIds.slice(0, numFull), aBlocks.slice(0, numFull));
    scheduler.checkInvariants();
  });

  test('a prefix hit stops at the first released block the pool has reused', () => {
    // 20 blocks: a (66 tokens) takes 17 fresh ones and gives its early ones back as it goes; c then takes the 3 never
    // used and 2 of a's released ones (the first released first), so a lookup of a's tokens must stop at a's first
    // block, although most of a's later blocks are still cached.
    const scheduler = makeScheduler(20);
    scheduler.addRequest(makeRequest('a', prompt(0, 6), { sampling: { maxTokens: 60, ignoreEos: true } }), 0);
    let tokens: number[] = [];
    for (let i = 0; scheduler.numRequests > 0; i++) {
      const sequence = scheduler.getRequest('a')?.sequences[0];
      if (sequence) tokens = sequence.tokenIds.slice();
      step(scheduler, i);
    }
    scheduler.addRequest(makeRequest('c', prompt(1, 20), { sampling: { maxTokens: 1 } }), 50);
    step(scheduler, 50);
    assert.equal(scheduler.numRequests, 0);
    const hashes = scheduler.kv.fullBlockHashes(scheduler.kv.createTable(), tokens, tokens.length);
    const cached = hashes.map((hash) => scheduler.kv.pool.getCachedBlock(hash) !== undefined);
    const firstMissing = cached.indexOf(false);
    assert.ok(firstMissing >= 0 && cached.slice(firstMissing).some((c) => c), 'some early block reused, a later one cached');
    scheduler.addRequest(makeRequest('b', tokens, { sampling: { maxTokens: 1 } }), 100);
    scheduler.schedule(100);
    assert.equal(scheduler.getRequest('b')!.numCachedTokens, firstMissing * BLOCK);
    scheduler.checkInvariants();
  });

  test('n = 2: the samples share the prompt and each releases its own blocks; preemption gives back the rest', () => {
    const scheduler = makeScheduler(12);
    scheduler.addRequest(makeRequest('a', prompt(0, 10), { sampling: { n: 2, maxTokens: 30, ignoreEos: true } }), 0);
    for (let i = 0; i < 15; i++) {
      step(scheduler, i, (target) => 10 + target.completionIndex);
      scheduler.checkInvariants();
    }
    const [s0, s1] = scheduler.getRequest('a')!.sequences;
    assert.ok(s0!.blockTable.numReleasedBlocks > 0 && s1!.blockTable.numReleasedBlocks > 0);
    assert.ok(scheduler.abort('a', 20));
    assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
    scheduler.checkInvariants();
  });

  /** A scheduler whose steps take at most `chunk` tokens: a longer prompt is computed in chunks of that size. */
  function chunkedScheduler(chunk: number): Scheduler {
    const kv = new KvCacheManager({ numBlocks: 64, blockSize: BLOCK, slidingWindow: WINDOW });
    return new Scheduler({ maxNumBatchedTokens: chunk, maxNumSeqs: 8, maxModelLen: 1024, eosTokenIds: [EOS] }, kv);
  }

  test('a long prompt computed in chunks gives back the blocks before each chunk\'s window as it goes', () => {
    // 64 prompt tokens in chunks of 8: kept whole until the prefill ends, they would take 16 blocks.
    const CHUNK = 8;
    const PROMPT = 64;
    const scheduler = chunkedScheduler(CHUNK);
    scheduler.addRequest(makeRequest('a', prompt(0, PROMPT), { sampling: { maxTokens: 4, ignoreEos: true } }), 0);
    // The window before a chunk's first token (at most ceil((W - 1) / B) + 1 blocks) and the chunk's own blocks.
    const bound = Math.ceil((WINDOW - 1) / BLOCK) + 1 + CHUNK / BLOCK;
    let maxUsed = 0;
    let chunks = 0;
    for (let i = 0; scheduler.numRequests > 0; i++) {
      assert.ok(i < 100, 'bounded');
      const { plan } = step(scheduler, i);
      scheduler.checkInvariants();
      maxUsed = Math.max(maxUsed, scheduler.kv.pool.numUsedBlocks);
      const sequence = scheduler.getRequest('a')?.sequences[0];
      if (!sequence) continue;
      const first = plan.scheduled[0]!.startPosition;
      if (first < PROMPT) {
        chunks++;
        assert.equal(plan.scheduled[0]!.numNewTokens, CHUNK);
      }
      // Released when the step was planned: every block wholly before the window of its first token.
      assert.equal(sequence.blockTable.numReleasedBlocks, Math.max(0, Math.floor((first - WINDOW + 1) / BLOCK)),
        `step ${i} from position ${first}`);
      assert.ok(sequence.blockTable.heldBlocks.length <= bound, `step ${i}: ${sequence.blockTable.heldBlocks.length} blocks held`);
    }
    assert.equal(chunks, PROMPT / CHUNK);
    assert.ok(maxUsed <= bound, `at most ${bound} blocks in use, saw ${maxUsed}`);
    assert.equal(scheduler.kv.pool.numUsedBlocks, 0, 'every block is back');
  });

  test('a prompt that forks into samples or is prefilled for a handoff keeps its blocks until it is computed', () => {
    const PROMPT = 40;
    for (const handOff of [false, true]) {
      const label = handOff ? 'handoff' : 'n = 2';
      const scheduler = chunkedScheduler(8);
      scheduler.addRequest(makeRequest('a', prompt(0, PROMPT),
        { sampling: { n: handOff ? 1 : 2, maxTokens: 8, ignoreEos: true } }), 0, { handOff });
      const sequence = scheduler.getRequest('a')!.sequences[0]!;
      for (let i = 0; sequence.numComputedTokens < PROMPT; i++) {
        assert.ok(i < 20, 'bounded');
        step(scheduler, i, (target) => 10 + target.completionIndex);
        assert.equal(sequence.blockTable.numReleasedBlocks, 0, `${label}: after ${sequence.numComputedTokens} tokens`);
        scheduler.checkInvariants();
      }
      if (handOff) {
        // The handoff pins every block of the prompt for the copy (it could not, had any been given back).
        const given = scheduler.handOff('a');
        assert.equal(given.blockIds.length, PROMPT / BLOCK);
        scheduler.kv.unpin(given.pin);
      } else {
        // Forked: the samples give back what falls out of their windows from their next step on.
        const samples = scheduler.getRequest('a')!.sequences;
        assert.equal(samples.length, 2);
        step(scheduler, 30, (target) => 10 + target.completionIndex);
        for (const sample of samples) assert.ok(sample.blockTable.numReleasedBlocks > 0, `${label}: sample ${sample.index}`);
        assert.ok(scheduler.abort('a', 40));
      }
      assert.equal(scheduler.kv.pool.numUsedBlocks, 0, `${label}: every block is back`);
      scheduler.checkInvariants();
    }
  });

  test('priority: a running sequence is preempted for a waiting one only if the blocks it still holds make the room', () => {
    // Two long generations, each holding the blocks of its window while most of its table is given back (free and
    // cached in the pool). A request ranked between them needs more fresh blocks than the free ones and those the one
    // ranked last holds: preempting that one would not make the room, so nobody is preempted and it waits.
    const kv = new KvCacheManager({ numBlocks: 10, blockSize: BLOCK, slidingWindow: WINDOW });
    const scheduler = new Scheduler({ policy: 'priority', maxNumBatchedTokens: 64, maxNumSeqs: 8, maxModelLen: 64, eosTokenIds: [EOS] }, kv);
    scheduler.addRequest(makeRequest('low', prompt(0, 4), { priority: 9, sampling: { ignoreEos: true } }), 0);
    scheduler.addRequest(makeRequest('high', prompt(1, 4), { priority: 0, sampling: { ignoreEos: true } }), 0);
    for (let i = 0; i < 21; i++) step(scheduler, i);
    const low = scheduler.getRequest('low')!.sequences[0]!.blockTable;
    assert.ok(low.numReleasedBlocks >= 4, `low released ${low.numReleasedBlocks} blocks`);
    const lowHeld = low.heldBlocks.length;

    scheduler.addRequest(makeRequest('mid', prompt(2, 32), { priority: 5 }), 30);
    const plan = scheduler.schedule(30);
    assert.deepEqual(plan.preempted.map((sequence) => sequence.request.id), []);
    assert.equal(scheduler.getRequest('low')!.status, 'running');
    // The 8 blocks of its prompt are more than the free ones (the decode of 'high' took one) and those of 'low'.
    assert.ok(kv.numFreeBlocks + lowHeld < kv.blocksFor(32), `${kv.numFreeBlocks} free + ${lowHeld} held by low`);
    assert.equal(scheduler.getRequest('mid')!.status, 'waiting');
    scheduler.checkInvariants();
  });

  test('without a window nothing is released', () => {
    const scheduler = makeScheduler(64, null);
    scheduler.addRequest(makeRequest('a', prompt(0, 6), { sampling: { maxTokens: 30, ignoreEos: true } }), 0);
    for (let i = 0; i < 20; i++) step(scheduler, i);
    assert.equal(scheduler.getRequest('a')!.sequences[0]!.blockTable.numReleasedBlocks, 0);
  });
});

// ---------------------------------------------------------------------------------------------------------------
// End to end: Mistral's layout with a window of 5 positions in every layer

describe('a Mistral-layout model (sliding window in every layer) end to end', () => {
  const spec = MISTRAL_SWA_MODEL;
  const NEW_TOKENS = 40;
  let dir: string;
  let model: LoadedModel;
  let promptIds: number[];

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-swa-'));
    writeArchGguf(spec, join(dir, 'model.gguf'));
    model = await loadModel(join(dir, 'model.gguf'));
    promptIds = createTokenizer(model.tokenizerSource).encode(
      'Once upon a time, in a land far away, there lived a king who had three daughters, and the youngest of them');
  });
  after(() => rmSync(dir, { recursive: true, force: true }));

  test('the GGUF and the Hugging Face folder give the same config, with the window in every layer', async () => {
    assert.equal(model.config.slidingWindow, spec.slidingWindow);
    assert.equal(uniformWindow(model.config), spec.slidingWindow);
    writeArchHf(spec, join(dir, 'hf'));
    const hf = await loadModel(join(dir, 'hf'));
    assert.deepEqual({ ...hf.config, name: '', ropeStyle: '' }, { ...model.config, name: '', ropeStyle: '' });
  });

  function keepAllBlocks(factory: BackendFactory, config = model.config): number[] {
    const backend = factory.load(config, model.weights, { numBlocks: 32, blockSize: BLOCK, dtype: 'f32' }, { threads: 2 });
    try {
      return greedyOnBackend(backend, [promptIds], NEW_TOKENS)[0]!;
    } finally {
      backend.dispose();
    }
  }

  const results = new Map<string, number[]>();
  for (const factory of engineBackends()) {
    test(`${factory.name}: the engine, giving blocks back, generates the tokens of a run that keeps them all`, () => {
      const expected = keepAllBlocks(factory);
      const numBlocks = 20;
      const backend = factory.load(model.config, model.weights, { numBlocks, blockSize: BLOCK, dtype: 'f32' }, { threads: 2 });
      try {
        let clock = 0;
        const core = new EngineCore({
          backend, tokenizer: createTokenizer(model.tokenizerSource), maxNumSeqs: 4, maxNumBatchedTokens: 8,
          maxModelLen: model.config.contextLength, now: () => clock++,
        });
        core.add({
          id: 'a', promptTokenIds: promptIds, priority: 0, arrivalMs: 0,
          sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens: NEW_TOKENS, ignoreEos: true },
        });
        const tokens: number[] = [];
        let maxUsed = 0;
        for (let steps = 0; core.hasWork; steps++) {
          assert.ok(steps < 1000, 'bounded');
          for (const output of core.step()) tokens.push(...output.newTokenIds);
          maxUsed = Math.max(maxUsed, core.kv.pool.numUsedBlocks);
        }
        assert.deepEqual(tokens, expected);
        // While the prompt is computed in chunks of 8, the window before a chunk and the chunk's blocks; then the
        // window's and the next token's: fewer than the prompt alone fills, far fewer than the whole sequence's.
        const bound = Math.ceil((spec.slidingWindow! - 1 + 8) / BLOCK) + 1;
        assert.ok(Math.ceil(promptIds.length / BLOCK) > bound, 'the prompt is longer than the bound');
        assert.ok(maxUsed <= bound, `used ${maxUsed} blocks, at most ${bound} expected`);
        core.scheduler.checkInvariants();
        results.set(factory.name, tokens);
      } finally {
        backend.dispose();
      }
    });
  }

  test('the backends agree, and the window changes the text', () => {
    const runs = [...results.values()];
    for (const run of runs.slice(1)) assert.deepEqual(run, runs[0]);
    const { slidingWindow: _, ...full } = model.config;
    const factory = engineBackends()[0]!;
    assert.notDeepEqual(keepAllBlocks(factory, full), runs[0] ?? keepAllBlocks(factory));
  });
});
