// Lower KV tiers end to end on real models: a prompt's greedy tokens are the same whether its prefix comes from the
// primary pool, from the RAM tier (evicted, then onboarded) or is recomputed, on stories260K (every backend) and on
// the built-in model (native backend).
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { kvBlockBytes } from '../../src/engine/handoff.ts';
import { KvTiers, type KvTiersOptions } from '../../src/engine/kv-cache/tiers.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import type { BackendFactory } from '../../src/kernels/types.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { ensureBuiltinModel } from '../../src/model/synthetic.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';
import { nativeBackend } from '../../src/kernels/native.ts';
import { engineBackends } from '../helpers/backends.ts';
import { loadSharedModel, skipUnlessShared } from '../helpers/shared-models.ts';

export const TIER_TEST_BLOCK_SIZE = 16;
const NUM_BLOCKS = 12;

export function makeTieredCore(backend: BackendFactory, loaded: LoadedModel, tiers: (blockBytes: number) => KvTiers | undefined): EngineCore {
  const runner = backend.load(loaded.config, loaded.weights, { numBlocks: NUM_BLOCKS, blockSize: TIER_TEST_BLOCK_SIZE, dtype: 'f32' }, { threads: 1 });
  const kvTiers = tiers(kvBlockBytes(runner.kvLayout));
  let clock = 0;
  return new EngineCore({
    backend: runner, tokenizer: createTokenizer(loaded.tokenizerSource), maxNumSeqs: 4, maxNumBatchedTokens: 256,
    maxModelLen: Math.min(loaded.config.contextLength, NUM_BLOCKS * TIER_TEST_BLOCK_SIZE), now: () => clock++,
    ...(kvTiers !== undefined ? { kvTiers } : {}),
  });
}

export interface TierRun {
  tokens: number[];
  cachedTokens: number;
  onboard: EngineOutput['timestamps']['kvOnboard'];
}

let requestCounter = 0;

export function runGreedy(core: EngineCore, promptTokenIds: number[], maxTokens = 10): TierRun {
  const request: EngineRequest = {
    id: `r${requestCounter++}`, promptTokenIds, priority: 0, arrivalMs: 0,
    sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens, ignoreEos: true },
  };
  core.add(request);
  const run: TierRun = { tokens: [], cachedTokens: -1, onboard: undefined };
  for (let steps = 0; core.hasWork; steps++) {
    for (const output of core.step()) {
      run.tokens.push(...output.newTokenIds);
      run.cachedTokens = output.usage.cachedTokens;
      run.onboard = output.timestamps.kvOnboard;
    }
    assert.ok(steps < 1000, 'engine did not finish');
  }
  return run;
}

/** Token ids every vocabulary of the test models has, distinct per seed. */
export function tierPrompt(seed: number, length: number, vocabSize: number): number[] {
  return Array.from({ length }, (_, i) => 3 + ((seed * 7919 + i * 31) % (Math.min(vocabSize, 500) - 3)));
}

/** Evicts every cached block of the pool with unrelated prompts (each fills most of it). */
export function flushPrimary(core: EngineCore, vocabSize: number, seed: number): void {
  for (let k = 0; k < 2; k++) runGreedy(core, tierPrompt(seed + k, 8 * TIER_TEST_BLOCK_SIZE + 3, vocabSize), 1);
}

function tierSuite(name: string, load: () => Promise<LoadedModel>, backends: () => BackendFactory[], skip: string | false): void {
  for (const backend of backends()) {
    describe(`KV tiers on ${name} (${backend.name})`, { skip }, () => {
      test('greedy tokens are the same from the primary pool, the RAM tier and recompute', async () => {
        const loaded = await load();
        const vocab = loaded.config.vocabSize;
        const ramOptions = (blockBytes: number): KvTiersOptions => ({ blockBytes, ramBytes: 64 * blockBytes });
        const prompt = tierPrompt(1, 3 * TIER_TEST_BLOCK_SIZE + 5, vocab);

        const plain = makeTieredCore(backend, loaded, () => undefined);
        const cold = runGreedy(plain, prompt);
        assert.equal(cold.cachedTokens, 0);
        const primary = runGreedy(plain, prompt);
        assert.equal(primary.cachedTokens, 3 * TIER_TEST_BLOCK_SIZE);
        assert.deepEqual(primary.tokens, cold.tokens, 'primary pool hit');
        flushPrimary(plain, vocab, 10);
        const recomputed = runGreedy(plain, prompt);
        assert.equal(recomputed.cachedTokens, 0, 'evicted without tiers: recomputed');
        assert.deepEqual(recomputed.tokens, cold.tokens);

        const tiered = makeTieredCore(backend, loaded, (blockBytes) => new KvTiers(ramOptions(blockBytes)));
        assert.deepEqual(runGreedy(tiered, prompt).tokens, cold.tokens);
        tiered.offloadKv(undefined, Infinity);
        flushPrimary(tiered, vocab, 10);
        const hashes = tiered.kv.fullBlockHashes(tiered.kv.createTable(), prompt, prompt.length);
        assert.ok(hashes.every((hash) => tiered.kv.pool.getCachedBlock(hash) === undefined), 'the prompt left the primary pool');
        const fromRam = runGreedy(tiered, prompt);
        assert.deepEqual(fromRam.onboard && { ram: fromRam.onboard.ram, disk: fromRam.onboard.disk }, { ram: 3, disk: 0 });
        assert.equal(fromRam.cachedTokens, 3 * TIER_TEST_BLOCK_SIZE);
        assert.deepEqual(fromRam.tokens, cold.tokens, 'onboarded from RAM');
        const stats = tiered.stats().kvTiers!;
        assert.equal(stats.tiers.ram!.onboardBlocks, 3);
        assert.equal(tiered.stats().kvBlocksUsed, 0);
        tiered.scheduler.checkInvariants();
      });
    });
  }
}

let builtin: Promise<LoadedModel> | undefined;
const loadBuiltin = () => (builtin ??= ensureBuiltinModel().then((path) => loadModel(path)));

tierSuite('stories260K', async () => (await loadSharedModel('stories260K.gguf')).loaded, engineBackends, skipUnlessShared('stories260K.gguf'));
tierSuite('the built-in model', loadBuiltin, () => [nativeBackend],
  nativeBackend.available() ? false : 'needs the native addon (npm run build:native) to run the built-in model at test speed');
