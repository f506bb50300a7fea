// Mixture-of-experts profiles in the performance model: total parameters (memory) and active parameters (FLOPs per
// token) agree with the published figures of each model, and a step streams only the experts its tokens chose.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import {
  activeParamCount, DEEPSEEK_V3, expectedActiveExperts, getModelProfile, kvBytesPerToken, LLAMA_3_1_8B,
  matmulFlopsPerToken, MIXTRAL_8X7B, modelProfileFromConfig, paramCount, QWEN_3_30B_A3B, streamedWeightBytes,
  weightBytes,
} from '../../src/sim/models.ts';
import { stepWork } from '../../src/sim/perf-model.ts';
import type { ModelConfig } from '../../src/model/config.ts';

const within = (actual: number, expected: number, relative: number, what: string): void =>
  assert.ok(Math.abs(actual - expected) <= relative * expected, `${what}: ${actual} vs ${expected}`);

describe('mixture-of-experts model profiles', () => {
  it('count total and active parameters as published (Qwen3-30B-A3B, Mixtral 8x7B, DeepSeek-V3)', () => {
    for (const [profile, total, active] of [[QWEN_3_30B_A3B, 30.5e9, 3.3e9], [MIXTRAL_8X7B, 46.7e9, 12.9e9],
      [DEEPSEEK_V3, 671e9, 37e9]] as const) {
      within(paramCount(profile), total, 0.01, `${profile.id} total`);
      within(activeParamCount(profile), active, 0.02, `${profile.id} active`);
      // FLOPs per token follow the active parameters (the embedding lookup does no matmul).
      assert.ok(matmulFlopsPerToken(profile) < 2 * activeParamCount(profile));
      assert.ok(matmulFlopsPerToken(profile) > 1.8 * (activeParamCount(profile) - 2 * profile.vocabSize * profile.hiddenDim));
      assert.deepEqual(getModelProfile(profile.id), profile);
    }
    // MLA caches a 576-element latent per layer (bf16): 70 KB per token, not 2 x 128 heads x 128.
    assert.equal(kvBytesPerToken(DEEPSEEK_V3), 61 * 576 * 2);
  });

  it('streams the experts a step chose: top-k for one token, all of them for a large batch', () => {
    const m = QWEN_3_30B_A3B;
    assert.equal(expectedActiveExperts(m, 1), 8);
    within(expectedActiveExperts(m, 16), 128 * (1 - (120 / 128) ** 16), 1e-12, '16 tokens');
    const oneToken = streamedWeightBytes(m, 1);
    const batch = streamedWeightBytes(m, 4096);
    const all = streamedWeightBytes(m);
    assert.ok(oneToken < 0.25 * all, `one token streams ${oneToken} of ${all}`);
    within(batch, all, 1e-6, 'a large batch reads every expert');
    const decode = stepWork({ prefillTokens: [], decodeSeqs: [{ contextLen: 10 }] }, m, 1);
    assert.equal(decode.weightBytes, oneToken);
    const decode16 = stepWork({ prefillTokens: [], decodeSeqs: Array.from({ length: 16 }, () => ({ contextLen: 10 })) }, m, 1);
    assert.ok(decode16.weightBytes > 5 * oneToken && decode16.weightBytes < all);
    // A dense model streams everything whatever the step.
    assert.equal(streamedWeightBytes(LLAMA_3_1_8B, 1), streamedWeightBytes(LLAMA_3_1_8B));
    // Memory counts every expert.
    assert.equal(weightBytes(m), 2 * paramCount(m));
  });

  it('converts a loaded MoE config', () => {
    const config: ModelConfig = {
      architecture: 'qwen3moe', name: 'Tiny MoE', vocabSize: 1000, dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2,
      headDim: 32, ffnDim: 96, contextLength: 512, rmsNormEps: 1e-6, ropeTheta: 1e6, ropeDim: 32, ropeStyle: 'neox',
      qkvBias: false, tiedEmbeddings: true, qkNorm: true,
      moe: { numExperts: 8, numExpertsUsed: 2, expertFfnDim: 32, normalizeTopK: true },
    };
    const profile = modelProfileFromConfig(config);
    assert.deepEqual(profile.moe, { numExperts: 8, numExpertsUsed: 2, expertFfnDim: 32, numSharedExperts: 0, numDenseLayers: 0 });
    const attention = 64 * 128 * 2 + 2 * 64 * 64;
    const layer = attention + 64 * 8 + 8 * 3 * 64 * 32;
    assert.equal(paramCount(profile), 2 * (layer + 2 * 64) + 64 + 1000 * 64);
  });
});
