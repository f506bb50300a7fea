// The reference forward pass of the Llama family (Llama 2/3, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3,
// Gemma 3): readable f32 math, the oracle that the native kernels and the paged reference backend are tested against.
//
// Per token x (one row of `dim` floats), x = embedding (* embeddingScale, Gemma), for each layer:
//   h   = rmsnorm(x) * attnNorm
//   q,k,v = Wq h (+bq), Wk h (+bk), Wv h (+bv)      Qwen2 has the biases
//   q,k = rmsnorm(each head of q) * qNorm, ... kNorm  Qwen3, Gemma 3
//   q,k = rope(q, k, position)                       Gemma 3's sliding-window layers with a RoPE base of their own
//   a   = Wo attention(q, cached k and v of positions 0..position, or of the layer's sliding window)
//   x  += a                                          Gemma 3: x += rmsnorm(a) * attnPostNorm
//   h   = rmsnorm(x) * ffnNorm
//   f   = Wdown( silu(Wgate h) * (Wup h) )           Gemma: gelu_tanh instead of silu
//         or, with experts: sum over the router's top-k experts e of weight_e * Wdown_e( silu(Wgate_e h) * (Wup_e h) )
//   x  += f                                          Gemma 3: x += rmsnorm(f) * ffnPostNorm
// logits = Wout (rmsnorm(x) * outputNorm)            then cap * tanh(logits / cap) with a final softcap
//
// `ReferenceTransformer` runs that over a flat batch of token rows and leaves the KV cache to its caller, so the
// contiguous `ReferenceModel` below and the paged reference backend (src/kernels/reference-backend.ts) share one
// implementation of the math and differ only in where K and V live.

import { applyLoraRows, type LoraWeights } from './lora.ts';
import {
  addBias, addInPlace, applyRope, type AttentionShape, causalAttention, geglu, matmul, rmsnorm, ropeAngles,
  ropeFrequencies, routeExperts, swiglu,
} from './reference-math.ts';
import { layerWindow, type ModelConfig } from './config.ts';
import { dequantizeTensor } from './quant.ts';
import type { ModelWeights, Tensor } from './weights.ts';

// ---------------------------------------------------------------------------------------------------------------
// Weights, dequantized to f32 once

export interface DenseLayerWeights {
  attnNorm: Float32Array;
  wq: Float32Array;
  wk: Float32Array;
  wv: Float32Array;
  wo: Float32Array;
  bq?: Float32Array;
  bk?: Float32Array;
  bv?: Float32Array;
  qNorm?: Float32Array;
  kNorm?: Float32Array;
  ffnNorm: Float32Array;
  attnPostNorm?: Float32Array;
  ffnPostNorm?: Float32Array;
  /** With experts, every expert's matrix back to back (expert e at e * rows * cols). */
  wGate: Float32Array;
  wUp: Float32Array;
  wDown: Float32Array;
  /** The router, [numExperts rows of dim]. */
  ffnGateInp?: Float32Array;
}

export interface DenseModelWeights {
  /** [vocabSize rows of dim]. */
  tokenEmbedding: Float32Array;
  layers: DenseLayerWeights[];
  outputNorm: Float32Array;
  /** [vocabSize rows of dim]; the same array as tokenEmbedding when the model ties them. */
  output: Float32Array;
}

export class ModelShapeError extends Error {
  override name = 'ModelShapeError';
}

function checkConfig(config: ModelConfig): void {
  const positive = ['vocabSize', 'dim', 'numLayers', 'numHeads', 'numKvHeads', 'headDim', 'ffnDim',
    'contextLength', 'ropeDim'] as const;
  for (const key of positive) {
    if (!Number.isInteger(config[key]) || config[key] <= 0) {
      throw new ModelShapeError(`model config: ${key} must be a positive integer, got ${config[key]}`);
    }
  }
  if (config.numHeads % config.numKvHeads !== 0) {
    throw new ModelShapeError(`model config: numHeads ${config.numHeads} is not a multiple of numKvHeads ` +
      `${config.numKvHeads}`);
  }
  if (config.ropeDim > config.headDim || config.ropeDim % 2 !== 0) {
    throw new ModelShapeError(`model config: ropeDim ${config.ropeDim} must be even and at most headDim ` +
      `${config.headDim}`);
  }
  if (!(config.rmsNormEps > 0)) throw new ModelShapeError(`model config: rmsNormEps must be positive`);
}

/** The tensor as f32 after checking it has the expected ggml shape ([inputs, outputs] for a matrix). */
function dense(tensor: Tensor | undefined, expected: number[], what: string): Float32Array {
  if (!tensor) throw new ModelShapeError(`model weights: ${what} is missing`);
  const shape = tensor.shape.length > expected.length && tensor.shape.slice(expected.length).every((d) => d === 1)
    ? tensor.shape.slice(0, expected.length) : tensor.shape;
  if (shape.length !== expected.length || shape.some((d, i) => d !== expected[i])) {
    throw new ModelShapeError(`model weights: tensor ${tensor.name} (${what}) has shape [${tensor.shape}], ` +
      `expected [${expected}]`);
  }
  return dequantizeTensor(tensor);
}

export function dequantizeModelWeights(config: ModelConfig, weights: ModelWeights): DenseModelWeights {
  checkConfig(config);
  const { dim, vocabSize, headDim, moe } = config;
  const ffnDim = moe ? moe.expertFfnDim : config.ffnDim;
  const experts = moe ? [moe.numExperts] : [];
  const qDim = config.numHeads * config.headDim;
  const kvDim = config.numKvHeads * config.headDim;
  if (weights.layers.length !== config.numLayers) {
    throw new ModelShapeError(`model weights: ${weights.layers.length} layers, the config says ${config.numLayers}`);
  }
  const layers = weights.layers.map((layer, l): DenseLayerWeights => {
    const bias = (tensor: Tensor | undefined, size: number, what: string): Float32Array | undefined => {
      if (!config.qkvBias) return undefined;
      return dense(tensor, [size], `layer ${l} ${what} (the config says Q/K/V have biases)`);
    };
    return {
      attnNorm: dense(layer.attnNorm, [dim], `layer ${l} attention norm`),
      wq: dense(layer.wq, [dim, qDim], `layer ${l} query projection`),
      wk: dense(layer.wk, [dim, kvDim], `layer ${l} key projection`),
      wv: dense(layer.wv, [dim, kvDim], `layer ${l} value projection`),
      wo: dense(layer.wo, [qDim, dim], `layer ${l} attention output projection`),
      bq: bias(layer.bq, qDim, 'query bias'),
      bk: bias(layer.bk, kvDim, 'key bias'),
      bv: bias(layer.bv, kvDim, 'value bias'),
      qNorm: config.qkNorm ? dense(layer.qNorm, [headDim], `layer ${l} query norm`) : undefined,
      kNorm: config.qkNorm ? dense(layer.kNorm, [headDim], `layer ${l} key norm`) : undefined,
      ffnNorm: dense(layer.ffnNorm, [dim], `layer ${l} feed-forward norm`),
      attnPostNorm: config.postNorms ? dense(layer.attnPostNorm, [dim], `layer ${l} attention post-norm`) : undefined,
      ffnPostNorm: config.postNorms ? dense(layer.ffnPostNorm, [dim], `layer ${l} feed-forward post-norm`) : undefined,
      wGate: dense(layer.wGate, [dim, ffnDim, ...experts], `layer ${l} feed-forward gate`),
      wUp: dense(layer.wUp, [dim, ffnDim, ...experts], `layer ${l} feed-forward up projection`),
      wDown: dense(layer.wDown, [ffnDim, dim, ...experts], `layer ${l} feed-forward down projection`),
      ffnGateInp: moe ? dense(layer.ffnGateInp, [dim, moe.numExperts], `layer ${l} expert router`) : undefined,
    };
  });
  const tokenEmbedding = dense(weights.tokenEmbedding, [dim, vocabSize], 'token embedding');
  const output = weights.output === weights.tokenEmbedding
    ? tokenEmbedding
    : dense(weights.output, [dim, vocabSize], 'output projection');
  return { tokenEmbedding, layers, outputNorm: dense(weights.outputNorm, [dim], 'output norm'), output };
}

// ---------------------------------------------------------------------------------------------------------------
// The forward pass over a flat batch of rows

/**
 * Called once per layer with the new rows' q ([rows, numHeads * headDim]) and k, v ([rows, numKvHeads *
 * headDim]), RoPE already applied. It must store k and v in its cache, then write each row's attention result
 * (same shape as q) to `out`.
 */
export type AttendFn = (layer: number, q: Float32Array, k: Float32Array, v: Float32Array, out: Float32Array) => void;

export class ReferenceTransformer {
  readonly config: ModelConfig;
  readonly weights: DenseModelWeights;
  readonly attentionShape: AttentionShape;
  private readonly frequencies: Float64Array;
  /** RoPE frequencies of the sliding-window layers when they have a base of their own (Gemma 3), else undefined. */
  private readonly localFrequencies: Float64Array | undefined;
  /** The sliding window of each layer (0: full causal attention). */
  readonly layerWindows: readonly number[];
  /** LongRoPE's scale of the rotated dimensions (1 otherwise). */
  private readonly ropeAttentionFactor: number;

  constructor(config: ModelConfig, weights: ModelWeights) {
    this.config = config;
    this.weights = dequantizeModelWeights(config, weights);
    this.attentionShape = {
      numHeads: config.numHeads, numKvHeads: config.numKvHeads, headDim: config.headDim,
      ...(config.attentionScale !== undefined ? { scale: config.attentionScale } : {}),
    };
    this.frequencies = ropeFrequencies(config.ropeDim, config.ropeTheta, config.ropeScaling);
    this.localFrequencies = config.ropeLocalTheta !== undefined
      ? ropeFrequencies(config.ropeDim, config.ropeLocalTheta) : undefined;
    this.layerWindows = Array.from({ length: config.numLayers }, (_, l) => layerWindow(config, l));
    this.ropeAttentionFactor = config.ropeScaling?.type === 'longrope' ? config.ropeScaling.attentionFactor : 1;
  }

  /**
   * Runs every layer over the rows (token tokenIds[r] at position positions[r]) and returns the logits of the
   * rows listed in `logitRows`, [logitRows.length * vocabSize] in that order.
   */
  run(tokenIds: ArrayLike<number>, positions: ArrayLike<number>, attend: AttendFn,
    logitRows: ArrayLike<number>, rowAdapters?: readonly (LoraWeights | undefined)[]): Float32Array {
    const { dim, vocabSize, headDim, numHeads, numKvHeads, rmsNormEps: eps, moe } = this.config;
    const ffnDim = moe ? moe.expertFfnDim : this.config.ffnDim;
    const numRows = tokenIds.length;
    if (positions.length !== numRows) {
      throw new RangeError(`forward: ${numRows} tokens but ${positions.length} positions`);
    }
    const qDim = numHeads * headDim;
    const kvDim = numKvHeads * headDim;
    const w = this.weights;

    // Embedding lookup.
    const x = new Float32Array(numRows * dim);
    for (let r = 0; r < numRows; r++) {
      const token = tokenIds[r]!;
      if (!Number.isInteger(token) || token < 0 || token >= vocabSize) {
        throw new RangeError(`forward: token id ${token} is outside the vocabulary (0..${vocabSize - 1})`);
      }
      x.set(w.tokenEmbedding.subarray(token * dim, (token + 1) * dim), r * dim);
      const embeddingScale = this.config.embeddingScale;
      if (embeddingScale !== undefined) {
        for (let i = r * dim; i < (r + 1) * dim; i++) x[i] = x[i]! * embeddingScale;
      }
      const position = positions[r]!;
      if (!Number.isInteger(position) || position < 0 || position >= this.config.contextLength) {
        throw new RangeError(`forward: position ${position} is outside the model's context ` +
          `(0..${this.config.contextLength - 1})`);
      }
    }

    const h = new Float32Array(numRows * dim);
    const q = new Float32Array(numRows * qDim);
    const k = new Float32Array(numRows * kvDim);
    const v = new Float32Array(numRows * kvDim);
    const attention = new Float32Array(numRows * qDim);
    const projected = new Float32Array(numRows * dim);
    const gate = new Float32Array(numRows * ffnDim);
    const up = new Float32Array(numRows * ffnDim);
    const cos = new Float64Array(this.frequencies.length);
    const sin = new Float64Array(this.frequencies.length);

    for (let l = 0; l < this.config.numLayers; l++) {
      const layer = w.layers[l]!;

      // Attention block.
      rmsnorm(h, x, layer.attnNorm, numRows, dim, eps);
      matmul(q, h, layer.wq, numRows, dim, qDim);
      matmul(k, h, layer.wk, numRows, dim, kvDim);
      matmul(v, h, layer.wv, numRows, dim, kvDim);
      if (rowAdapters) {
        applyLoraRows(q, h, numRows, dim, qDim, rowAdapters, l, 'wq');
        applyLoraRows(k, h, numRows, dim, kvDim, rowAdapters, l, 'wk');
        applyLoraRows(v, h, numRows, dim, kvDim, rowAdapters, l, 'wv');
      }
      if (layer.bq) addBias(q, layer.bq, numRows, qDim);
      if (layer.bk) addBias(k, layer.bk, numRows, kvDim);
      if (layer.bv) addBias(v, layer.bv, numRows, kvDim);
      if (layer.qNorm) rmsnorm(q, q, layer.qNorm, numRows * numHeads, headDim, eps);
      if (layer.kNorm) rmsnorm(k, k, layer.kNorm, numRows * numKvHeads, headDim, eps);
      const frequencies = this.localFrequencies !== undefined && this.layerWindows[l]! > 0
        ? this.localFrequencies : this.frequencies;
      for (let r = 0; r < numRows; r++) {
        ropeAngles(positions[r]!, frequencies, cos, sin);
        if (frequencies === this.frequencies && this.ropeAttentionFactor !== 1) {
          // LongRoPE: the rotated dimensions of Q and K are scaled (cos and sin both).
          for (let i = 0; i < cos.length; i++) {
            cos[i] = cos[i]! * this.ropeAttentionFactor;
            sin[i] = sin[i]! * this.ropeAttentionFactor;
          }
        }
        applyRope(q, r * qDim, numHeads, headDim, this.config.ropeStyle, cos, sin);
        applyRope(k, r * kvDim, numKvHeads, headDim, this.config.ropeStyle, cos, sin);
      }
      attend(l, q, k, v, attention);
      matmul(projected, attention, layer.wo, numRows, qDim, dim);
      if (rowAdapters) applyLoraRows(projected, attention, numRows, qDim, dim, rowAdapters, l, 'wo');
      if (layer.attnPostNorm) rmsnorm(projected, projected, layer.attnPostNorm, numRows, dim, eps);
      addInPlace(x, projected, numRows * dim);

      // Feed-forward block (SwiGLU).
      rmsnorm(h, x, layer.ffnNorm, numRows, dim, eps);
      if (moe) {
        this.experts(layer, h, x, numRows);
        continue;
      }
      matmul(gate, h, layer.wGate, numRows, dim, ffnDim);
      matmul(up, h, layer.wUp, numRows, dim, ffnDim);
      if (rowAdapters) {
        applyLoraRows(gate, h, numRows, dim, ffnDim, rowAdapters, l, 'wGate');
        applyLoraRows(up, h, numRows, dim, ffnDim, rowAdapters, l, 'wUp');
      }
      if (this.config.ffnActivation === 'gelu_tanh') geglu(gate, up, numRows * ffnDim);
      else swiglu(gate, up, numRows * ffnDim);
      matmul(projected, gate, layer.wDown, numRows, ffnDim, dim);
      if (rowAdapters) applyLoraRows(projected, gate, numRows, ffnDim, dim, rowAdapters, l, 'wDown');
      if (layer.ffnPostNorm) rmsnorm(projected, projected, layer.ffnPostNorm, numRows, dim, eps);
      addInPlace(x, projected, numRows * dim);
    }

    // Logits of the requested rows only: the vocabulary projection is the largest matmul of a decode step.
    const numLogitRows = logitRows.length;
    const finalRows = new Float32Array(numLogitRows * dim);
    for (let i = 0; i < numLogitRows; i++) {
      const row = logitRows[i]!;
      if (!Number.isInteger(row) || row < 0 || row >= numRows) {
        throw new RangeError(`forward: logits wanted for row ${row}, the batch has rows 0..${numRows - 1}`);
      }
      finalRows.set(x.subarray(row * dim, (row + 1) * dim), i * dim);
    }
    rmsnorm(finalRows, finalRows, w.outputNorm, numLogitRows, dim, eps);
    const logits = new Float32Array(numLogitRows * vocabSize);
    matmul(logits, finalRows, w.output, numLogitRows, dim, vocabSize);
    const softcap = this.config.finalLogitSoftcap;
    if (softcap !== undefined) for (let i = 0; i < logits.length; i++) logits[i] = softcap * Math.tanh(logits[i]! / softcap);
    return logits;
  }

  /** x += the mixture-of-experts block of h, token by token (the plain way; the native backend groups by expert). */
  private experts(layer: DenseLayerWeights, h: Float32Array, x: Float32Array, numRows: number): void {
    const { dim } = this.config;
    const { numExperts, numExpertsUsed, expertFfnDim: ffnDim, normalizeTopK } = this.config.moe!;
    const scores = new Float32Array(numExperts);
    const row = new Float32Array(dim);
    const gate = new Float32Array(ffnDim);
    const up = new Float32Array(ffnDim);
    const out = new Float32Array(dim);
    const gateUpSize = ffnDim * dim;
    for (let r = 0; r < numRows; r++) {
      row.set(h.subarray(r * dim, (r + 1) * dim));
      matmul(scores, row, layer.ffnGateInp!, 1, dim, numExperts);
      const { experts, weights } = routeExperts(scores, 0, numExperts, numExpertsUsed, normalizeTopK);
      const sum = new Float64Array(dim);
      experts.forEach((e, i) => {
        matmul(gate, row, layer.wGate.subarray(e * gateUpSize, (e + 1) * gateUpSize), 1, dim, ffnDim);
        matmul(up, row, layer.wUp.subarray(e * gateUpSize, (e + 1) * gateUpSize), 1, dim, ffnDim);
        swiglu(gate, up, ffnDim);
        matmul(out, gate, layer.wDown.subarray(e * gateUpSize, (e + 1) * gateUpSize), 1, ffnDim, dim);
        for (let d = 0; d < dim; d++) sum[d] = sum[d]! + weights[i]! * out[d]!;
      });
      for (let d = 0; d < dim; d++) x[r * dim + d] = x[r * dim + d]! + sum[d]!;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// One sequence with a contiguous KV cache

export interface ReferenceForwardOptions {
  /** Return the logits of every new token ([tokenIds.length * vocabSize]) instead of only the last one's. */
  allLogits?: boolean;
}

/** A single sequence over the reference transformer; K and V of position p live at row p of a per-layer array. */
export class ReferenceModel {
  readonly config: ModelConfig;
  private readonly transformer: ReferenceTransformer;
  private keys: Float32Array[] = [];
  private values: Float32Array[] = [];
  /** Positions whose K and V are in the cache. */
  private numCached = 0;

  constructor(config: ModelConfig, weights: ModelWeights) {
    this.config = config;
    this.transformer = new ReferenceTransformer(config, weights);
  }

  /** Number of positions currently cached (the next token's position unless the caller rewinds). */
  get cachedLength(): number {
    return this.numCached;
  }

  /**
   * Feeds tokens at positions startPos, startPos + 1, ... and returns the logits of the last one (or of all of
   * them, see options). startPos may rewind into the cache (what follows it is discarded) but not skip ahead.
   */
  forward(tokenIds: ArrayLike<number>, startPos: number, options: ReferenceForwardOptions = {}): Float32Array {
    const numTokens = tokenIds.length;
    if (numTokens === 0) throw new RangeError('forward: no tokens given');
    if (!Number.isInteger(startPos) || startPos < 0 || startPos > this.numCached) {
      throw new RangeError(`forward: startPos ${startPos} must be between 0 and the cached length ${this.numCached}`);
    }
    const endPos = startPos + numTokens;
    if (endPos > this.config.contextLength) {
      throw new RangeError(`forward: positions up to ${endPos - 1} exceed the model's context length ` +
        `${this.config.contextLength}`);
    }
    this.reserve(endPos);

    const positions = new Int32Array(numTokens);
    for (let i = 0; i < numTokens; i++) positions[i] = startPos + i;
    const kvDim = this.config.numKvHeads * this.config.headDim;
    const attend: AttendFn = (layer, q, k, v, out) => {
      this.keys[layer]!.set(k, startPos * kvDim);
      this.values[layer]!.set(v, startPos * kvDim);
      causalAttention(out, q, 0, numTokens, startPos, this.keys[layer]!, this.values[layer]!,
        this.transformer.attentionShape, this.transformer.layerWindows[layer]);
    };
    const logitRows = options.allLogits ? positions.map((_, i) => i) : [numTokens - 1];
    const logits = this.transformer.run(tokenIds, positions, attend, logitRows);
    this.numCached = endPos;
    return logits;
  }

  /** Forgets every cached position; the next forward must start at 0. */
  reset(): void {
    this.numCached = 0;
  }

  /** Grows the cache (doubling) so it holds `positions` positions, keeping what is cached. */
  private reserve(positions: number): void {
    const kvDim = this.config.numKvHeads * this.config.headDim;
    const capacity = this.keys.length > 0 ? this.keys[0]!.length / kvDim : 0;
    if (positions <= capacity) return;
    const newCapacity = Math.min(this.config.contextLength, Math.max(positions, 2 * capacity, 64));
    const grow = (old: Float32Array | undefined): Float32Array => {
      const grown = new Float32Array(newCapacity * kvDim);
      if (old) grown.set(old.subarray(0, this.numCached * kvDim));
      return grown;
    };
    this.keys = Array.from({ length: this.config.numLayers }, (_, l) => grow(this.keys[l]));
    this.values = Array.from({ length: this.config.numLayers }, (_, l) => grow(this.values[l]));
  }
}
