// Helpers of the KV tier suites that run real models: a small pool with tiers, greedy runs, prompts, and a flush of
// the primary pool with unrelated prompts.
import assert from 'node:assert/strict';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { kvBlockBytes } from '../../src/engine/handoff.ts';
import type { KvTiers } from '../../src/engine/kv-cache/tiers.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import type { BackendFactory } from '../../src/kernels/types.ts';
import type { LoadedModel } from '../../src/model/loader.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';

/**
 * A prefill rate for the tiers' cost model in tests: the test clock advances 1 ms per reading, which would make any
 * prefill look fast; this slow rate makes every tier worth onboarding from (the model's choice is tested apart).
 */
export const SLOW_PREFILL = { prefillTokensPerMs: 0.001 };

export const TIER_TEST_BLOCK_SIZE = 16;
const NUM_BLOCKS = 12;

/**
 * A small pool with the tiers `tiers` makes. The engine's clock advances 1 ms per reading; with `stepMs`, it advances
 * only in the forward pass instead, by stepMs(tokens in the batch): steps that take a known time.
 */
export function makeTieredCore(backend: BackendFactory, loaded: LoadedModel, tiers: (blockBytes: number) => KvTiers | undefined,
  stepMs?: (tokens: number) => number): EngineCore {
  const runner = backend.load(loaded.config, loaded.weights, { numBlocks: NUM_BLOCKS, blockSize: TIER_TEST_BLOCK_SIZE, dtype: 'f32' }, { threads: 1 });
  const kvTiers = tiers(kvBlockBytes(runner.kvLayout));
  let clock = 0;
  if (stepMs !== undefined) {
    const forward = runner.forward.bind(runner);
    runner.forward = (batch, logits) => {
      clock += stepMs(batch.numTokens);
      return forward(batch, logits);
    };
  }
  return new EngineCore({
    backend: runner, tokenizer: createTokenizer(loaded.tokenizerSource), maxNumSeqs: 4, maxNumBatchedTokens: 256,
    maxModelLen: Math.min(loaded.config.contextLength, NUM_BLOCKS * TIER_TEST_BLOCK_SIZE), now: stepMs !== undefined ? () => clock : () => clock++,
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

