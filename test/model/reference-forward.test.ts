import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { describe, it } from 'node:test';
import type { ModelConfig } from '../../src/model/config.ts';
import { generateReference } from '../../src/model/generate.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { ggufModelConfig, ggufModelWeights } from '../../src/model/gguf-model.ts';
import { ModelShapeError, ReferenceModel } from '../../src/model/reference-forward.ts';
import type { ModelWeights, Tensor } from '../../src/model/weights.ts';
import { sharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { f32Tensor, tensorValues, tinyConfig, tinyWeights } from './reference-tiny-model.ts';

// ---------------------------------------------------------------------------------------------------------------
// An independent forward pass: nested number arrays, one token at a time, every step spelled out in doubles.

type Matrix = number[][]; // [outputs][inputs]

function matrixOf(t: Tensor): Matrix {
  const [inputs, outputs] = t.shape as [number, number];
  const values = tensorValues(t);
  return Array.from({ length: outputs }, (_, o) => Array.from(values.subarray(o * inputs, (o + 1) * inputs)));
}

function vectorOf(t: Tensor | undefined, length: number): number[] {
  return t ? Array.from(tensorValues(t)) : new Array<number>(length).fill(0);
}

function times(m: Matrix, x: number[]): number[] {
  return m.map((row) => row.reduce((sum, w, i) => sum + w * x[i]!, 0));
}

function plus(a: number[], b: number[]): number[] {
  return a.map((v, i) => v + b[i]!);
}

function normalized(x: number[], weight: number[], eps: number): number[] {
  const meanSquare = x.reduce((s, v) => s + v * v, 0) / x.length;
  return x.map((v, i) => (v / Math.sqrt(meanSquare + eps)) * weight[i]!);
}

/** Rotation angle of pair j at `position`, from the definitions of each scaling scheme. */
function ropeAngle(config: ModelConfig, position: number, j: number): number {
  const frequency = config.ropeTheta ** (-(2 * j) / config.ropeDim);
  const scaling = config.ropeScaling;
  if (!scaling) return position * frequency;
  if (scaling.type === 'linear') return (position / scaling.factor) * frequency;
  if (scaling.type === 'longrope') return (position * frequency) / scaling.factors[j]!;
  const wavelength = (2 * Math.PI) / frequency;
  const { factor, lowFreqFactor: low, highFreqFactor: high, originalContextLength: original } = scaling;
  let scaled: number;
  if (wavelength < original / high) scaled = frequency;
  else if (wavelength > original / low) scaled = frequency / factor;
  else {
    const smooth = (original / wavelength - low) / (high - low);
    scaled = (1 - smooth) * (frequency / factor) + smooth * frequency;
  }
  return position * scaled;
}

function rotated(config: ModelConfig, x: number[], numHeads: number, position: number): number[] {
  const y = [...x];
  const half = config.ropeDim / 2;
  for (let head = 0; head < numHeads; head++) {
    for (let j = 0; j < half; j++) {
      const [a, b] = config.ropeStyle === 'interleaved'
        ? [head * config.headDim + 2 * j, head * config.headDim + 2 * j + 1]
        : [head * config.headDim + j, head * config.headDim + j + half];
      const angle = ropeAngle(config, position, j);
      y[a] = x[a]! * Math.cos(angle) - x[b]! * Math.sin(angle);
      y[b] = x[a]! * Math.sin(angle) + x[b]! * Math.cos(angle);
    }
  }
  return y;
}

/** Logits after each token of `tokens` (positions 0, 1, ...). */
function handLogits(config: ModelConfig, weights: ModelWeights, tokens: number[]): number[][] {
  const { dim, numHeads, numKvHeads, headDim, rmsNormEps: eps } = config;
  const embedding = matrixOf(weights.tokenEmbedding);
  const output = matrixOf(weights.output);
  const outputNorm = vectorOf(weights.outputNorm, dim);
  const layers = weights.layers.map((l) => ({
    attnNorm: vectorOf(l.attnNorm, dim), ffnNorm: vectorOf(l.ffnNorm, dim),
    wq: matrixOf(l.wq), wk: matrixOf(l.wk), wv: matrixOf(l.wv), wo: matrixOf(l.wo),
    bq: vectorOf(l.bq, numHeads * headDim), bk: vectorOf(l.bk, numKvHeads * headDim),
    bv: vectorOf(l.bv, numKvHeads * headDim),
    wGate: matrixOf(l.wGate), wUp: matrixOf(l.wUp), wDown: matrixOf(l.wDown),
    keys: [] as number[][], values: [] as number[][],
  }));

  return tokens.map((token, position) => {
    let x = [...embedding[token]!];
    for (const layer of layers) {
      const h = normalized(x, layer.attnNorm, eps);
      const q = rotated(config, plus(times(layer.wq, h), layer.bq), numHeads, position);
      layer.keys.push(rotated(config, plus(times(layer.wk, h), layer.bk), numKvHeads, position));
      layer.values.push(plus(times(layer.wv, h), layer.bv));
      const attention: number[] = [];
      for (let head = 0; head < numHeads; head++) {
        const kvHead = Math.floor((head * numKvHeads) / numHeads);
        const slice = (v: number[], hd: number): number[] => v.slice(hd * headDim, (hd + 1) * headDim);
        const qHead = slice(q, head);
        const scores = layer.keys.map((k) =>
          slice(k, kvHead).reduce((s, kv, d) => s + kv * qHead[d]!, 0) / Math.sqrt(headDim));
        const top = Math.max(...scores);
        const exps = scores.map((s) => Math.exp(s - top));
        const total = exps.reduce((a, b) => a + b, 0);
        for (let d = 0; d < headDim; d++) {
          attention.push(layer.values.reduce((s, v, t) => s + (exps[t]! / total) * slice(v, kvHead)[d]!, 0));
        }
      }
      x = plus(x, times(layer.wo, attention));
      const h2 = normalized(x, layer.ffnNorm, eps);
      const gate = times(layer.wGate, h2);
      const up = times(layer.wUp, h2);
      const hidden = gate.map((g, i) => (g / (1 + Math.exp(-g))) * up[i]!);
      x = plus(x, times(layer.wDown, hidden));
    }
    return times(output, normalized(x, outputNorm, eps));
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Helpers

const TOKENS = [3, 7, 1, 12, 5, 0, 9, 4];

/** The model's logits for TOKENS fed in chunks of the given sizes, one row per token. */
function chunkedLogits(model: ReferenceModel, chunkSizes: number[]): number[][] {
  const rows: number[][] = [];
  let position = 0;
  for (const size of chunkSizes) {
    const logits = model.forward(TOKENS.slice(position, position + size), position, { allLogits: true });
    const vocab = model.config.vocabSize;
    for (let i = 0; i < size; i++) rows.push(Array.from(logits.subarray(i * vocab, (i + 1) * vocab)));
    position += size;
  }
  return rows;
}

function maxAbsDifference(a: number[][], b: number[][]): number {
  assert.equal(a.length, b.length);
  let worst = 0;
  a.forEach((row, r) => row.forEach((v, i) => { worst = Math.max(worst, Math.abs(v - b[r]![i]!)); }));
  return worst;
}

function assertClose(actual: number[][], expected: number[][], what: string): void {
  const scale = Math.max(1, ...expected.flat().map(Math.abs));
  const error = maxAbsDifference(actual, expected);
  assert.ok(error <= 2e-5 * scale, `${what}: largest difference ${error} (logit scale ${scale})`);
}

// ---------------------------------------------------------------------------------------------------------------
// Tests

describe('ReferenceModel on tiny one-layer models, against an independent double-precision forward', () => {
  const variants: Array<[string, Partial<ModelConfig>]> = [
    ['llama, interleaved RoPE, GQA 4 query heads over 2 KV heads', {}],
    ['neox RoPE over part of each head (ropeDim 4 of headDim 8)', { ropeStyle: 'neox', numHeads: 2, numKvHeads: 1, headDim: 8 }],
    ['qwen2 with Q/K/V biases, neox, heads wider than dim (4 x 6 on dim 16)',
      { architecture: 'qwen2', qkvBias: true, ropeStyle: 'neox', headDim: 6, ropeDim: 6 }],
    ['llama3 frequency scaling (all three wavelength bands)', {
      headDim: 8, ropeDim: 8, numHeads: 2, numKvHeads: 2, ropeTheta: 100,
      ropeScaling: { type: 'llama3', factor: 8, lowFreqFactor: 1, highFreqFactor: 4, originalContextLength: 32 },
    }],
    ['linear position scaling', { ropeScaling: { type: 'linear', factor: 4 } }],
    ['tied embeddings, two layers, no GQA', { tiedEmbeddings: true, numLayers: 2, numKvHeads: 4 }],
  ];

  for (const [name, overrides] of variants) {
    it(name, () => {
      const config = tinyConfig(overrides);
      const weights = tinyWeights(config, 42);
      const expected = handLogits(config, weights, TOKENS);
      // Prefill in chunks, then single-token decode steps: the KV cache must carry every earlier position.
      assertClose(chunkedLogits(new ReferenceModel(config, weights), [3, 2, 1, 1, 1]), expected, name);
      assertClose(chunkedLogits(new ReferenceModel(config, weights), [8]), expected, `${name}, one prefill`);
    });
  }

  it('RoPE style and scaling each change the logits (the variants above test something)', () => {
    const base = tinyConfig({ headDim: 8, ropeDim: 8, numHeads: 2, numKvHeads: 2, ropeTheta: 100 });
    const weights = tinyWeights(base, 7);
    const logitsOf = (overrides: Partial<ModelConfig>): number[][] =>
      chunkedLogits(new ReferenceModel({ ...base, ...overrides }, weights), [8]);
    const plain = logitsOf({});
    assert.ok(maxAbsDifference(plain, logitsOf({ ropeStyle: 'neox' })) > 1e-3);
    assert.ok(maxAbsDifference(plain, logitsOf({ ropeScaling: { type: 'linear', factor: 2 } })) > 1e-3);
    assert.ok(maxAbsDifference(plain, logitsOf({
      ropeScaling: { type: 'llama3', factor: 8, lowFreqFactor: 1, highFreqFactor: 4, originalContextLength: 32 },
    })) > 1e-3);
  });

  it('returns only the last token\'s logits by default', () => {
    const config = tinyConfig();
    const model = new ReferenceModel(config, tinyWeights(config, 1));
    const all = model.forward(TOKENS, 0, { allLogits: true });
    model.reset();
    const last = model.forward(TOKENS, 0);
    assert.equal(last.length, config.vocabSize);
    assert.deepEqual(last, all.subarray((TOKENS.length - 1) * config.vocabSize));
  });

  it('rewinding to an earlier position recomputes the same logits', () => {
    const config = tinyConfig();
    const model = new ReferenceModel(config, tinyWeights(config, 2));
    const first = model.forward(TOKENS, 0);
    assert.equal(model.cachedLength, TOKENS.length);
    model.forward([11, 11], 3); // overwrite positions 3 and 4 with other tokens
    const again = model.forward(TOKENS.slice(3), 3);
    assert.deepEqual(again, first);
  });

  it('grows its cache past the first allocation', () => {
    const config = tinyConfig({ contextLength: 200 });
    const weights = tinyWeights(config, 3);
    const tokens = Array.from({ length: 150 }, (_, i) => (i * 5) % config.vocabSize);
    const oneShot = new ReferenceModel(config, weights).forward(tokens, 0);
    const model = new ReferenceModel(config, weights);
    model.forward(tokens.slice(0, 40), 0);
    model.forward(tokens.slice(40, 100), 40);
    assert.deepEqual(model.forward(tokens.slice(100), 100), oneShot);
  });

  it('rejects bad input with errors that name the problem', () => {
    const config = tinyConfig();
    const weights = tinyWeights(config, 4);
    const model = new ReferenceModel(config, weights);
    assert.throws(() => model.forward([13], 0), /token id 13 is outside the vocabulary/);
    assert.throws(() => model.forward([1], 1), /startPos 1 must be between 0 and the cached length 0/);
    assert.throws(() => model.forward([], 0), /no tokens/);
    assert.throws(() => model.forward(new Array(65).fill(1), 0), /exceed the model's context length 64/);
    const badLayer = { ...weights.layers[0]!, wk: f32Tensor('blk.0.attn_k.weight', [16, 16], new Float32Array(256)) };
    assert.throws(() => new ReferenceModel(config, { ...weights, layers: [badLayer] }),
      (e: unknown) => e instanceof ModelShapeError && /blk\.0\.attn_k\.weight .* shape \[16,16\], expected \[16,8\]/.test(e.message));
    assert.throws(() => new ReferenceModel({ ...config, numKvHeads: 3 }, weights), /not a multiple of numKvHeads 3/);
    assert.throws(() => new ReferenceModel({ ...config, qkvBias: true }, weights), /query bias.* is missing/);
  });
});

// ---------------------------------------------------------------------------------------------------------------
// stories260K against llama.cpp's greedy output

interface ExpectedCase { bos: boolean; prompt_tokens: number[]; greedy_tokens: number[] }

describe('stories260K greedy continuation equals llama.cpp', { skip: skipUnlessShared('stories260K.gguf') }, () => {
  const load = (): { model: ReferenceModel; cases: ExpectedCase[] } => {
    const file = readGguf(sharedModel('stories260K.gguf')!);
    const config = ggufModelConfig(file, 'stories260K.gguf');
    const model = new ReferenceModel(config, ggufModelWeights(file, config, 'stories260K.gguf'));
    const expected = JSON.parse(readFileSync(sharedModel('stories260K.expected.json')!, 'utf8')) as { cases: ExpectedCase[] };
    return { model, cases: expected.cases };
  };

  for (const bos of [true, false]) {
    it(bos ? 'with BOS: [1, 403, 407, 261, 378]' : 'without BOS: [403, 407, 261, 378]', async (t) => {
      const { model, cases } = load();
      const golden = cases.find((c) => c.bos === bos)!;
      assert.deepEqual(golden.prompt_tokens, bos ? [1, 403, 407, 261, 378] : [403, 407, 261, 378]);
      const result = await generateReference(model, golden.prompt_tokens,
        { maxTokens: golden.greedy_tokens.length, temperature: 0 });
      assert.deepEqual(result.tokenIds, golden.greedy_tokens);
      assert.equal(result.finishReason, 'length');
      t.diagnostic(`stories260K reference: prefill ${result.timing.prefillTokensPerSecond.toFixed(0)} tok/s, ` +
        `decode ${result.timing.decodeTokensPerSecond.toFixed(0)} tok/s`);
    });
  }
});
