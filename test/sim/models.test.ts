import { test } from 'node:test';
import assert from 'node:assert/strict';
import type { ModelConfig } from '../../src/model/config.ts';
import {
  LLAMA_3_1_8B, LLAMA_3_1_70B, LLAMA_3_1_405B, QWEN_2_5_7B, QWEN_2_5_72B, attentionFlopsPerToken, flopsPerToken,
  getModelProfile, kvBytesPerToken, matmulFlopsPerToken, modelProfileFromConfig, paramCount, streamedWeightBytes,
  weightBytes, withDtypes,
} from '../../src/sim/models.ts';

const close = (actual: number, expected: number, relTol = 1e-12) =>
  assert.ok(Math.abs(actual - expected) <= relTol * Math.abs(expected), `${actual} != ${expected}`);

test('Llama 3.1 8B parameter count, written out matrix by matrix, matches the published 8.03B', () => {
  const embedding = 128256 * 4096;
  const attention = 4096 * 4096 + 2 * 4096 * (8 * 128) + 4096 * 4096; // Q, K, V (8 KV heads of 128), O
  const ffn = 3 * 4096 * 14336;
  const norms = 2 * 4096;
  const expected = 32 * (attention + ffn + norms) + 4096 + 2 * embedding; // final norm; untied LM head
  assert.equal(paramCount(LLAMA_3_1_8B), expected);
  assert.equal(expected, 8_030_261_248);
  assert.equal(weightBytes(LLAMA_3_1_8B), 2 * expected); // 16.06 GB in BF16
  // A decode step streams every matrix but the embedding table (a lookup reads only the batch's rows).
  assert.equal(streamedWeightBytes(LLAMA_3_1_8B), 2 * (expected - embedding));
});

test('published sizes: 70B, 405B, Qwen2.5 7B (with QKV biases) and 72B', () => {
  // Model cards: Llama 3.1 70.6B and 405.9B; Qwen2.5 7.61B and 72.7B.
  for (const [profile, published] of [[LLAMA_3_1_70B, 70.6e9], [LLAMA_3_1_405B, 405.9e9], [QWEN_2_5_7B, 7.61e9],
    [QWEN_2_5_72B, 72.7e9]] as const) {
    const params = paramCount(profile);
    assert.ok(Math.abs(params - published) / published < 0.001, `${profile.name}: ${params} vs ${published}`);
  }
  // Qwen2.5 7B exactly: 28 layers of hidden 3584, 28 heads / 4 KV heads of 128, FFN 18944, vocab 152064.
  const qkvWeights = 3584 * 3584 + 2 * 3584 * 512;
  const qkvBiases = 3584 + 2 * 512;
  const layer = qkvWeights + qkvBiases + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584;
  assert.equal(paramCount(QWEN_2_5_7B), 28 * layer + 3584 + 2 * 152064 * 3584);
});

test('KV bytes per token: 2 x layers x KV heads x head dim x bytes', () => {
  assert.equal(kvBytesPerToken(LLAMA_3_1_70B), 2 * 80 * 8 * 128 * 2);
  assert.equal(kvBytesPerToken(LLAMA_3_1_70B), 327_680);
  // 1024 tokens of 70B KV are 320 MiB.
  assert.equal(1024 * kvBytesPerToken(LLAMA_3_1_70B), 320 * 2 ** 20);
  assert.equal(kvBytesPerToken(withDtypes(LLAMA_3_1_70B, { kvBytesPerElement: 1 })), 163_840);
  assert.equal(kvBytesPerToken(QWEN_2_5_7B), 2 * 28 * 4 * 128 * 2);
});

test('FLOPs per token: 2 per matmul weight (layers and LM head) plus 4 x layers x heads x headDim per key', () => {
  const layerMatmul = 8192 * 8192 + 2 * 8192 * 1024 + 8192 * 8192 + 3 * 8192 * 28672;
  const lmHead = 128256 * 8192;
  assert.equal(matmulFlopsPerToken(LLAMA_3_1_70B), 2 * (80 * layerMatmul + lmHead));
  assert.equal(attentionFlopsPerToken(LLAMA_3_1_70B, 1024), 4 * 80 * 64 * 128 * 1024);
  assert.equal(flopsPerToken(LLAMA_3_1_70B, 1024), 2 * (80 * layerMatmul + lmHead) + 4 * 80 * 64 * 128 * 1024);
  // Close to the "2 x parameters" rule of thumb: the gap is the embedding table, which does no matmul.
  close(matmulFlopsPerToken(LLAMA_3_1_70B), 2 * (paramCount(LLAMA_3_1_70B) - 128256 * 8192 - 80 * 2 * 8192 - 8192));
});

test('a ModelConfig converts to the same shapes as the built-in profile', () => {
  const config: ModelConfig = {
    architecture: 'llama', name: 'Llama 3.1 70B', vocabSize: 128256, dim: 8192, numLayers: 80, numHeads: 64,
    numKvHeads: 8, headDim: 128, ffnDim: 28672, contextLength: 131072, rmsNormEps: 1e-5, ropeTheta: 500000,
    ropeDim: 128, ropeStyle: 'neox', qkvBias: false, tiedEmbeddings: false,
  };
  const fromConfig = modelProfileFromConfig(config);
  assert.equal(paramCount(fromConfig), paramCount(LLAMA_3_1_70B));
  assert.equal(kvBytesPerToken(fromConfig), kvBytesPerToken(LLAMA_3_1_70B));
  const fp8 = modelProfileFromConfig(config, { weightBytesPerParam: 1, kvBytesPerElement: 1 });
  assert.equal(weightBytes(fp8), paramCount(LLAMA_3_1_70B));
  // Tied embeddings: the table is the LM head, counted once and streamed in full.
  const tied = modelProfileFromConfig({ ...config, tiedEmbeddings: true });
  assert.equal(paramCount(tied), paramCount(LLAMA_3_1_70B) - 128256 * 8192);
  assert.equal(streamedWeightBytes(tied), weightBytes(tied));
});

test('profiles are found by id and alias; unknown ids and bad dtypes are refused', () => {
  assert.deepEqual(getModelProfile('llama-3.1-70b'), LLAMA_3_1_70B);
  assert.equal(getModelProfile('Llama3.1-8B').id, 'llama-3.1-8b');
  assert.equal(getModelProfile('qwen2.5-72b', { weightBytesPerParam: 1 }).weightBytesPerParam, 1);
  assert.throws(() => getModelProfile('gpt-5'), RangeError);
  assert.throws(() => withDtypes(LLAMA_3_1_8B, { kvBytesPerElement: 0 }), RangeError);
});
