// Lower KV tiers end to end on real models: a prompt's greedy tokens are the same whether its prefix comes from the
// primary pool, from the RAM tier (evicted, then onboarded) or is recomputed, on stories260K (every backend) and on
// the built-in model (native backend).
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { KvTiers, type KvTiersOptions } from '../../src/engine/kv-cache/tiers.ts';
import type { BackendFactory } from '../../src/kernels/types.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { ensureBuiltinModel } from '../../src/model/synthetic.ts';
import { nativeBackend } from '../../src/kernels/native.ts';
import { engineBackends } from '../helpers/backends.ts';
import { loadSharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { flushPrimary, makeTieredCore, runGreedy, SLOW_PREFILL, TIER_TEST_BLOCK_SIZE, tierPrompt } from './kv-tiers-fixtures.ts';

function tierSuite(name: string, load: () => Promise<LoadedModel>, backends: () => BackendFactory[], skip: string | false): void {
  for (const backend of backends()) {
    describe(`KV tiers on ${name} (${backend.name})`, { skip }, () => {
      test('greedy tokens are the same from the primary pool, the RAM tier and recompute', async () => {
        const loaded = await load();
        const vocab = loaded.config.vocabSize;
        const ramOptions = (blockBytes: number): KvTiersOptions => ({ blockBytes, ramBytes: 64 * blockBytes, ...SLOW_PREFILL });
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

      test('the cost model follows the engine\'s step times, and a short prompt recomputes blocks slower to read than their tokens', async () => {
        const loaded = await load();
        const vocab = loaded.config.vocabSize;
        const prompt = tierPrompt(3, 2 * TIER_TEST_BLOCK_SIZE + 1, vocab);
        // A block takes 1 ms to read from RAM. Computing its 16 tokens adds 16 x 0.01 ms to a step of 10 ms that runs
        // anyway (the last token is computed); the average rate of such steps (33 tokens in 10.33 ms) would say 5 ms.
        const run = (msPerToken: number) => {
          const tiered = makeTieredCore(backend, loaded, (blockBytes) => new KvTiers({ blockBytes, ramBytes: 64 * blockBytes, bandwidth: { ram: blockBytes / 0.999 } }),
            (tokens) => 10 + msPerToken * tokens);
          const tiers = tiered.kv.tiers!;
          const cold = runGreedy(tiered, prompt);
          const stepMs = tiers.stepMs()!;
          for (const tokens of [1, 16, 33]) assert.ok(Math.abs(stepMs(tokens) - (10 + msPerToken * tokens)) < 1e-9, `${tokens} tokens: ${stepMs(tokens)} ms`);
          assert.equal(tiers.onboardMs('ram', 1), 1);
          tiered.offloadKv(undefined, Infinity);
          flushPrimary(tiered, vocab, 20);
          const again = runGreedy(tiered, prompt);
          assert.deepEqual(again.tokens, cold.tokens);
          return { again, recomputed: tiers.stats().recomputedBlocks };
        };
        const cheap = run(0.01);
        assert.deepEqual([cheap.again.cachedTokens, cheap.again.onboard, cheap.recomputed], [0, undefined, 2], 'recomputed: 0.32 ms < 2 ms');
        // At 1 ms per token the same blocks are worth reading: 2 ms against 32.
        const dear = run(1);
        assert.deepEqual([dear.again.cachedTokens, dear.again.onboard?.ram, dear.recomputed], [2 * TIER_TEST_BLOCK_SIZE, 2, 0]);
      });

      test('a RAM tier smaller than the cached blocks: the idle sweep ends, and what it kept onboards to the cold tokens', async () => {
        const loaded = await load();
        const vocab = loaded.config.vocabSize;
        const prompt = tierPrompt(2, 3 * TIER_TEST_BLOCK_SIZE + 5, vocab);
        const cold = runGreedy(makeTieredCore(backend, loaded, () => undefined), prompt);
        // Two blocks of RAM, one copy per call, under a pool that caches the prompt's 3 blocks and more.
        const tiered = makeTieredCore(backend, loaded, (blockBytes) => new KvTiers({ blockBytes, ramBytes: 2 * blockBytes, maxBlocksPerCall: 1, ...SLOW_PREFILL }));
        runGreedy(tiered, tierPrompt(9, 2 * TIER_TEST_BLOCK_SIZE + 1, vocab), 1);
        assert.deepEqual(runGreedy(tiered, prompt).tokens, cold.tokens);
        let calls = 0;
        while (tiered.offloadKv(undefined, Infinity) > 0) assert.ok(++calls <= 10, 'the idle sweep ends');
        assert.equal(calls, 2, 'one block per call, as many as the tier holds');
        const ram = tiered.stats().kvTiers!.tiers.ram!;
        assert.deepEqual({ offloaded: ram.offloadBlocks, evicted: ram.evictedBlocks, used: ram.usedBlocks }, { offloaded: 2, evicted: 0, used: 2 });
        flushPrimary(tiered, vocab, 30);
        // The prompt's blocks were the most recently used: its first two are below (freed last), the third is recomputed.
        const restored = runGreedy(tiered, prompt);
        assert.deepEqual(restored.onboard && { ram: restored.onboard.ram, disk: restored.onboard.disk }, { ram: 2, disk: 0 });
        assert.equal(restored.cachedTokens, 2 * TIER_TEST_BLOCK_SIZE);
        assert.deepEqual(restored.tokens, cold.tokens, 'onboarded from RAM, the rest computed');
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
