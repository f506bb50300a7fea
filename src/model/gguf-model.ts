// A GGUF file as a Conduit model: ModelConfig from the `<arch>.*` metadata keys and ModelWeights from the
// llama.cpp tensor names. Also the checks every loaded model passes (tensor types and shapes against the config),
// shared with the Hugging Face loader.
//
// Llama 3.1-style RoPE scaling: llama.cpp stores it as a tensor `rope_freqs.weight` of per-frequency divisors
// instead of metadata. We derive the llama3 parameters (factor, low/high frequency factors) from that tensor, then
// recompute the divisors from them and require a match, so ModelConfig.ropeScaling describes it exactly and no
// backend needs the tensor.

import { basename } from 'node:path';
import type { Architecture, Llama3RopeScaling, ModelConfig, MoeConfig, RopeScaling } from './config.ts';
import { ggmlTypeName, SUPPORTED_TYPES } from './ggml-types.ts';
import { metaNumber, metaString } from './gguf.ts';
import type { GgufFile, GgufValue } from './gguf.ts';
import { dequantizeTensor } from './quant.ts';
import type { LayerWeights, ModelWeights, Tensor } from './weights.ts';

export class ModelFormatError extends Error {
  override name = 'ModelFormatError';
}

export const SUPPORTED_ARCHITECTURES: readonly Architecture[] = ['llama', 'qwen2', 'qwen3', 'qwen3moe', 'phi3', 'gemma3'];

/** Gemma 3's layer pattern when the file does not say: five sliding-window layers, then a global one. */
export const GEMMA3_DEFAULT_WINDOW_PATTERN = 6;

/** The RoPE base of Gemma 3's sliding-window layers when the file does not say (llama.cpp's default too). */
export const GEMMA3_DEFAULT_LOCAL_ROPE_THETA = 10000;

/**
 * Gemma 3's sliding-window layers for a pattern of n: every n-th layer (n - 1, 2n - 1 ...) is global, the others
 * windowed; n = 0 makes every layer windowed (llama.cpp's reading of the key).
 */
export function gemma3WindowLayers(numLayers: number, pattern: number): boolean[] {
  return Array.from({ length: numLayers }, (_, l) => pattern === 0 || l % pattern < pattern - 1);
}

/** The default RoPE base of llama.cpp when `<arch>.rope.freq_base` is absent. */
export const DEFAULT_ROPE_THETA = 10000;

/** Llama 3.1 and 3.2 were trained at 8192 tokens before scaling; used when the file does not say. */
const LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192;

// ---------------------------------------------------------------------------------------------------------------
// Config

export function ggufModelConfig(file: GgufFile, source = 'GGUF'): ModelConfig {
  const architecture = metaString(file, 'general.architecture');
  if (architecture === undefined) throw new ModelFormatError(`${source}: metadata general.architecture is missing`);
  if (!(SUPPORTED_ARCHITECTURES as readonly string[]).includes(architecture)) {
    throw new ModelFormatError(`${source}: architecture "${architecture}" is not supported ` +
      `(supported: ${SUPPORTED_ARCHITECTURES.join(', ')})`);
  }
  const arch = architecture as Architecture;
  const key = (suffix: string): string => `${arch}.${suffix}`;
  const required = (suffix: string): number => {
    const v = uniformNumber(file, key(suffix), source);
    if (v === undefined) throw new ModelFormatError(`${source}: metadata ${key(suffix)} is missing`);
    return v;
  };
  const optional = (suffix: string): number | undefined => uniformNumber(file, key(suffix), source);

  /** A key that counts something (layers, heads, tokens): a positive whole number. */
  const requiredCount = (suffix: string): number => {
    const v = required(suffix);
    requireCount(source, `metadata ${key(suffix)}`, v);
    return v;
  };
  const optionalCount = (suffix: string): number | undefined => {
    const v = optional(suffix);
    if (v !== undefined) requireCount(source, `metadata ${key(suffix)}`, v);
    return v;
  };

  const dim = requiredCount('embedding_length');
  const numLayers = requiredCount('block_count');
  requireAtMost(source, `metadata ${key('block_count')}`, numLayers, MAX_LAYERS);
  const numHeads = requiredCount('attention.head_count');
  const numKvHeads = optionalCount('attention.head_count_kv') ?? numHeads;
  const headDim = optionalCount('attention.key_length') ?? dim / numHeads;
  const valueDim = optionalCount('attention.value_length') ?? headDim;
  if (valueDim !== headDim) {
    throw new ModelFormatError(`${source}: key length ${headDim} and value length ${valueDim} differ, which is not supported`);
  }
  if (!Number.isInteger(headDim)) {
    throw new ModelFormatError(`${source}: embedding_length ${dim} is not divisible by head_count ${numHeads} ` +
      `(and ${key('attention.key_length')} is absent)`);
  }
  if (numHeads % numKvHeads !== 0) {
    throw new ModelFormatError(`${source}: head_count ${numHeads} is not a multiple of head_count_kv ${numKvHeads}`);
  }
  const ropeTheta = shortestF32Decimal(optional('rope.freq_base') ?? DEFAULT_ROPE_THETA);
  requirePositive(source, `metadata ${key('rope.freq_base')}`, ropeTheta);
  const ropeDim = optional('rope.dimension_count') ?? headDim;
  // A llama ropeDim below headDim (partial rotary, which llama.cpp refuses for llama) is computed as ggml would: the
  // first ropeDim elements of each head rotate in adjacent pairs, the rest pass through.
  requireRopeDim(source, `metadata ${key('rope.dimension_count')}`, ropeDim, headDim);
  const config: ModelConfig = {
    architecture: arch,
    name: metaString(file, 'general.name') ?? basename(source),
    vocabSize: ggufVocabSize(file, arch, source),
    dim,
    numLayers,
    numHeads,
    numKvHeads,
    headDim,
    // Qwen3-MoE files may carry only the experts' size.
    ffnDim: optional('feed_forward_length') ?? optional('expert_feed_forward_length') ?? required('feed_forward_length'),
    contextLength: required('context_length'),
    rmsNormEps: shortestF32Decimal(required('attention.layer_norm_rms_epsilon')),
    ropeTheta,
    ropeDim,
    // llama.cpp's converter permutes llama Q/K rows so that adjacent pairs rotate together; the Qwens keep HF order.
    ropeStyle: arch === 'llama' ? 'interleaved' : 'neox',
    // Qwen2 always has them (llama.cpp requires them of a qwen2 file); a llama file may, as its first layer says.
    qkvBias: arch === 'qwen2' || file.hasTensor('blk.0.attn_q.bias'),
    tiedEmbeddings: !file.hasTensor('output.weight'),
  };
  requireCount(source, `metadata ${key('context_length')}`, config.contextLength);
  requirePositive(source, `metadata ${key('attention.layer_norm_rms_epsilon')}`, config.rmsNormEps);
  requireCount(source, 'the vocabulary size', config.vocabSize);
  if (arch === 'qwen3' || arch === 'qwen3moe' || arch === 'gemma3') config.qkNorm = true;
  ggufSlidingWindow(file, arch, config, source);
  if (arch === 'gemma3') ggufGemma3(file, config, source);
  const moe = ggufMoeConfig(file, arch, config.ffnDim, source);
  if (moe) config.moe = moe;
  if (arch === 'qwen3moe' && !moe) throw new ModelFormatError(`${source}: qwen3moe without ${key('expert_count')}`);
  // Qwen3-MoE's dense feed_forward_length is unused (every layer has experts).
  if (!moe) requireCount(source, `metadata ${key('feed_forward_length')}`, config.ffnDim);
  const ropeScaling = ggufLongRope(file, arch, ropeDim, config.contextLength, source) ??
    ggufRopeScaling(file, arch, ropeTheta, ropeDim, source);
  if (ropeScaling) config.ropeScaling = ropeScaling;
  return config;
}

/**
 * `<arch>.attention.sliding_window`: Mistral-style (llama: every layer) or Gemma 3's interleaved layers
 * (`attention.sliding_window_pattern`, a number or one flag per layer). Only for those two: Phi-3 files carry the key
 * too, but llama.cpp ignores it for Phi-3 (its 4k models' window is the whole context), so do we.
 */
function ggufSlidingWindow(file: GgufFile, arch: Architecture, config: ModelConfig, source: string): void {
  if (arch !== 'llama' && arch !== 'gemma3') return;
  const window = uniformNumber(file, `${arch}.attention.sliding_window`, source) ?? 0;
  if (window === 0) return;
  if (!Number.isInteger(window) || window < 0) {
    throw new ModelFormatError(`${source}: ${arch}.attention.sliding_window ${window} is not a token count`);
  }
  if (arch !== 'gemma3') {
    config.slidingWindow = window;
    return;
  }
  const pattern = file.metadata.get(`${arch}.attention.sliding_window_pattern`);
  let layers: boolean[];
  if (Array.isArray(pattern) || (ArrayBuffer.isView(pattern) && !(pattern instanceof DataView))) {
    layers = Array.from(pattern as ArrayLike<unknown>, (v) => Boolean(v));
    if (layers.length !== config.numLayers) {
      throw new ModelFormatError(`${source}: ${arch}.attention.sliding_window_pattern has ${layers.length} entries ` +
        `for ${config.numLayers} layers`);
    }
  } else {
    const n = pattern === undefined ? GEMMA3_DEFAULT_WINDOW_PATTERN : Number(pattern);
    if (!Number.isInteger(n) || n < 0) {
      throw new ModelFormatError(`${source}: ${arch}.attention.sliding_window_pattern ${String(pattern)} is not a count`);
    }
    layers = gemma3WindowLayers(config.numLayers, n);
  }
  if (!layers.some((w) => w)) return;
  config.slidingWindow = window;
  if (!layers.every((w) => w)) config.slidingWindowLayers = layers;
}

/**
 * Gemma 3 as llama.cpp runs it: embeddings times sqrt(dim), post-norms, GeGLU, the local layers' RoPE base
 * (`rope.freq_base_swa`, 10000 by default), scores scaled by 1 / sqrt(headDim) except for the 27B model (62
 * layers: 1 / sqrt(dim / heads)), and the optional final logit softcap. Its norm weights are stored with the 1 that
 * Hugging Face's Gemma3RMSNorm adds at run time already added (llama.cpp's converter does it), so they are used as
 * they are.
 */
function ggufGemma3(file: GgufFile, config: ModelConfig, source: string): void {
  config.embeddingScale = Math.sqrt(config.dim);
  config.postNorms = true;
  config.ffnActivation = 'gelu_tanh';
  if (config.slidingWindow) {
    const local = uniformNumber(file, 'gemma3.rope.freq_base_swa', source);
    config.ropeLocalTheta = local === undefined ? GEMMA3_DEFAULT_LOCAL_ROPE_THETA : shortestF32Decimal(local);
    requirePositive(source, 'metadata gemma3.rope.freq_base_swa', config.ropeLocalTheta);
  }
  if (config.numLayers === 62) config.attentionScale = 1 / Math.sqrt(config.dim / config.numHeads);
  const softcap = uniformNumber(file, 'gemma3.final_logit_softcapping', source);
  if (softcap !== undefined && softcap > 0) config.finalLogitSoftcap = shortestF32Decimal(softcap);
}

/**
 * Experts from `<arch>.expert_count` / `expert_used_count` / `expert_feed_forward_length` (Mixtral: the dense
 * feed_forward_length is the expert's). llama.cpp renormalizes the top-k router weights for Mixtral and Qwen3-MoE
 * whatever the file says, so a GGUF model does too.
 */
function ggufMoeConfig(file: GgufFile, arch: Architecture, ffnDim: number, source: string): MoeConfig | undefined {
  const numExperts = uniformNumber(file, `${arch}.expert_count`, source) ?? 0;
  if (numExperts === 0) return undefined;
  requireCount(source, `metadata ${arch}.expert_count`, numExperts);
  requireAtMost(source, `metadata ${arch}.expert_count`, numExperts, MAX_EXPERTS);
  const numExpertsUsed = uniformNumber(file, `${arch}.expert_used_count`, source);
  if (numExpertsUsed === undefined || !(numExpertsUsed > 0 && numExpertsUsed <= numExperts)) {
    throw new ModelFormatError(`${source}: ${arch}.expert_used_count must be between 1 and expert_count ${numExperts}`);
  }
  const expertFfnDim = uniformNumber(file, `${arch}.expert_feed_forward_length`, source) ??
    (arch === 'llama' ? ffnDim : 0);
  if (!(expertFfnDim > 0)) throw new ModelFormatError(`${source}: ${arch}.expert_feed_forward_length is missing`);
  requireCount(source, `metadata ${arch}.expert_used_count`, numExpertsUsed);
  requireCount(source, `metadata ${arch}.expert_feed_forward_length`, expertFfnDim);
  return { numExperts, numExpertsUsed, expertFfnDim, normalizeTopK: true };
}

/** A numeric key that may also be stored per layer (an array); per-layer values must all be equal. */
function uniformNumber(file: GgufFile, key: string, source: string): number | undefined {
  const value: GgufValue | undefined = file.metadata.get(key);
  if (value === undefined) return undefined;
  if (typeof value === 'number' || typeof value === 'bigint') return Number(value);
  if (ArrayBuffer.isView(value) && !(value instanceof DataView)) {
    const values = Array.from(value as ArrayLike<number | bigint>, Number);
    // An empty array gives no value at all: "differs between layers" would send the reader looking for two values.
    if (values.length === 0) throw new ModelFormatError(`${source}: metadata ${key} is an empty array, not a number`);
    if (values.every((v) => v === values[0])) return values[0];
    throw new ModelFormatError(`${source}: metadata ${key} differs between layers, which is not supported`);
  }
  throw new ModelFormatError(`${source}: metadata ${key} is not a number`);
}

/**
 * GGUF stores epsilons and bases as f32, so 1e-5 arrives as 9.99999974e-6. The shortest decimal with the same f32
 * is what the model was defined with (and what a config.json of the same model says).
 */
export function shortestF32Decimal(value: number): number {
  if (!Number.isFinite(value) || Math.fround(value) !== value) return value;
  for (let digits = 1; digits <= 9; digits++) {
    const candidate = Number(value.toPrecision(digits));
    if (Math.fround(candidate) === value) return candidate;
  }
  return value;
}

/** Refuses a value that counts something (layers, heads, tokens) unless it is a positive whole number. */
export function requireCount(source: string, what: string, value: number): void {
  if (!(Number.isSafeInteger(value) && value > 0)) {
    throw new ModelFormatError(`${source}: ${what} is ${value}, not a positive whole number`);
  }
}

/**
 * The most layers and experts a model may declare. Tables of one entry per layer or expert are built from these counts
 * before any tensor is looked up (a damaged block_count of 10^9 ran the process out of heap); no model comes near.
 */
export const MAX_LAYERS = 1 << 16;
export const MAX_EXPERTS = 1 << 16;

/** Refuses a count above `max`, which no real model reaches. */
export function requireAtMost(source: string, what: string, value: number, max: number): void {
  if (value > max) {
    throw new ModelFormatError(`${source}: ${what} is ${value}, more than the ${max} any model has (a damaged file?)`);
  }
}

/** Refuses a NaN, infinite, zero or negative value where only a positive number makes sense (an epsilon, a base). */
export function requirePositive(source: string, what: string, value: number): void {
  if (!(Number.isFinite(value) && value > 0)) {
    throw new ModelFormatError(`${source}: ${what} is ${value}, not a positive finite number`);
  }
}

/**
 * RoPE frequency divisors (rope_freqs.weight, LongRoPE's factors): each a positive finite number, else a frequency
 * becomes infinite or NaN and so does every score.
 */
export function requireDivisors(what: string, factors: ArrayLike<number>): void {
  for (let i = 0; i < factors.length; i++) {
    const f = factors[i]!;
    if (!(Number.isFinite(f) && f > 0)) {
      throw new ModelFormatError(`${what}: entry ${i} is ${f}; RoPE frequency factors must be positive finite numbers`);
    }
  }
}

/** The rotated dimensions of a head: a positive even number, at most the head size. */
export function requireRopeDim(source: string, what: string, ropeDim: number, headDim: number): void {
  if (!(Number.isSafeInteger(ropeDim) && ropeDim > 0 && ropeDim % 2 === 0 && ropeDim <= headDim)) {
    throw new ModelFormatError(`${source}: ${what} is ${ropeDim}; the rotated dimensions must be a positive even ` +
      `number, at most the head size ${headDim}`);
  }
}

function ggufVocabSize(file: GgufFile, arch: Architecture, source: string): number {
  const tokens = file.metadata.get('tokenizer.ggml.tokens');
  if (Array.isArray(tokens)) return tokens.length;
  const fromKey = metaNumber(file, `${arch}.vocab_size`);
  if (fromKey !== undefined) return fromKey;
  const embedding = file.tensorInfos.find((t) => t.name === 'token_embd.weight');
  if (embedding && embedding.shape.length === 2) return embedding.shape[1]!;
  throw new ModelFormatError(`${source}: cannot tell the vocabulary size (no tokenizer.ggml.tokens, ` +
    `${arch}.vocab_size or token_embd.weight)`);
}

// ---------------------------------------------------------------------------------------------------------------
// RoPE scaling

/**
 * LongRoPE as llama.cpp's converter writes it (Phi-3 128k, Phi-4-mini): rope_factors_long.weight and
 * rope_factors_short.weight (ropeDim / 2 divisors each), `rope.scaling.attn_factor`, and the context the short set is
 * for, `rope.scaling.original_context_length`. The long set is used when the context length is longer than that (what
 * llama.cpp does for a context of the model's length).
 */
function ggufLongRope(file: GgufFile, arch: Architecture, ropeDim: number, contextLength: number,
  source: string): RopeScaling | undefined {
  const name = (kind: string): string | undefined =>
    [`rope_factors_${kind}.weight`, `blk.0.rope_factors_${kind}.weight`].find((n) => file.hasTensor(n));
  const longName = name('long');
  if (longName === undefined) return undefined;
  const shortName = name('short');
  const originalContextLength = uniformNumber(file, `${arch}.rope.scaling.original_context_length`, source);
  if (shortName === undefined || originalContextLength === undefined) {
    throw new ModelFormatError(`${source}: LongRoPE needs rope_factors_short.weight and ` +
      `${arch}.rope.scaling.original_context_length besides ${longName}`);
  }
  requireCount(source, `metadata ${arch}.rope.scaling.original_context_length`, originalContextLength);
  // Both sets are checked, though one is used: either is a divisor of every frequency.
  const sets = new Map([longName, shortName].map((tensorName) => {
    const factors = Array.from(dequantizeTensor(file.tensor(tensorName)));
    if (factors.length !== ropeDim / 2) {
      throw new ModelFormatError(`${source}: ${tensorName} has ${factors.length} entries, expected ropeDim / 2 = ${ropeDim / 2}`);
    }
    requireDivisors(`${source}: ${tensorName}`, factors);
    return [tensorName, factors];
  }));
  const chosen = contextLength > originalContextLength ? longName : shortName;
  const attentionFactor = uniformNumber(file, `${arch}.rope.scaling.attn_factor`, source) ?? 1;
  requirePositive(source, `metadata ${arch}.rope.scaling.attn_factor`, attentionFactor);
  return { type: 'longrope', factors: sets.get(chosen)!, attentionFactor, originalContextLength };
}

/**
 * `<arch>.rope.scaling.*` read as llama.cpp reads them: a missing type means linear, and the factor comes from
 * `rope.scaling.factor` or else the older `rope.scale_linear`; type "none" never scales. Llama 3.1-style scaling
 * has no metadata, only the rope_freqs.weight tensor.
 */
function ggufRopeScaling(
  file: GgufFile, arch: Architecture, ropeTheta: number, ropeDim: number, source: string,
): RopeScaling | undefined {
  // Read as absent, a type or a context stored as another type (a number, a string "8192") would scale linearly or
  // by a default context instead of failing, as llama.cpp's reader fails on a key of the wrong type.
  const type = metaString(file, `${arch}.rope.scaling.type`);
  if (type === undefined && file.metadata.has(`${arch}.rope.scaling.type`)) {
    throw new ModelFormatError(`${source}: metadata ${arch}.rope.scaling.type is not a string`);
  }
  const factorKey = [`${arch}.rope.scaling.factor`, `${arch}.rope.scale_linear`].find((k) => file.metadata.has(k));
  const originalContext = uniformNumber(file, `${arch}.rope.scaling.original_context_length`, source);
  const freqFactors = file.hasTensor('rope_freqs.weight');
  if (type === undefined || type === 'linear') {
    if (factorKey === undefined && type === 'linear') {
      throw new ModelFormatError(`${source}: linear RoPE scaling needs a positive ${arch}.rope.scaling.factor`);
    }
    const factor = factorKey === undefined ? undefined : uniformNumber(file, factorKey, source);
    if (factor !== undefined && !(Number.isFinite(factor) && factor > 0)) {
      throw new ModelFormatError(`${source}: metadata ${factorKey} is ${factor}; a RoPE scaling factor must be a ` +
        'positive number');
    }
    if (factor !== undefined && factor !== 1) {
      if (freqFactors) {
        throw new ModelFormatError(`${source}: linear RoPE scaling (${factorKey} ${factor}) together with ` +
          'rope_freqs.weight is not supported');
      }
      return { type: 'linear', factor: shortestF32Decimal(factor) };
    }
  } else if (type !== 'none') {
    throw new ModelFormatError(`${source}: RoPE scaling type "${type}" is not supported (supported: linear, ` +
      `and llama3 given as rope_freqs.weight)`);
  }
  if (!freqFactors) return undefined;
  const factors = dequantizeTensor(file.tensor('rope_freqs.weight'));
  return llama3ScalingFromFreqFactors(factors, ropeTheta, ropeDim,
    originalContext ?? LLAMA3_DEFAULT_ORIGINAL_CONTEXT, `${source}: rope_freqs.weight`);
}

/**
 * The divisor of each RoPE frequency under llama3 scaling (what llama.cpp stores as rope_freqs.weight):
 * 1 for wavelengths shorter than originalContextLength / highFreqFactor, `factor` for those longer than
 * originalContextLength / lowFreqFactor, and a smooth blend of the two in between.
 */
export function llama3FreqFactors(scaling: Llama3RopeScaling, ropeTheta: number, ropeDim: number): Float32Array {
  const { factor, lowFreqFactor, highFreqFactor, originalContextLength } = scaling;
  const out = new Float32Array(ropeDim / 2);
  for (let i = 0; i < out.length; i++) {
    const wavelength = (2 * Math.PI) / ropeTheta ** (-(2 * i) / ropeDim);
    if (wavelength < originalContextLength / highFreqFactor) out[i] = 1;
    else if (wavelength > originalContextLength / lowFreqFactor) out[i] = factor;
    else {
      const smooth = (originalContextLength / wavelength - lowFreqFactor) / (highFreqFactor - lowFreqFactor);
      out[i] = 1 / ((1 - smooth) / factor + smooth);
    }
  }
  return out;
}

/**
 * Inverse of llama3FreqFactors. In the blended band smooth = (C / wavelength - low) / (high - low) is linear in
 * 1 / wavelength, so a least-squares line through the band's points gives low and high; with fewer than two points
 * in the band they are not determined and Llama 3.1's values (1 and 4) are tried. Either way the result must
 * reproduce every stored factor, else this is not llama3 scaling and we refuse it.
 */
export function llama3ScalingFromFreqFactors(
  factors: Float32Array, ropeTheta: number, ropeDim: number, originalContextLength: number, what = 'rope_freqs',
): Llama3RopeScaling | undefined {
  if (factors.length !== ropeDim / 2) {
    throw new ModelFormatError(`${what} has ${factors.length} entries, expected ropeDim / 2 = ${ropeDim / 2}`);
  }
  requireDivisors(what, factors);
  const factor = Math.max(...factors);
  if (factor <= 1 + 1e-6) {
    // No scaling only when every divisor is 1: llama.cpp divides by whatever is stored.
    const other = factors.findIndex((f) => Math.abs(f - 1) > 1e-6);
    if (other >= 0) {
      throw new ModelFormatError(`${what}: entry ${other} is ${factors[other]}, which llama3 RoPE scaling does not ` +
        'give (its divisors are 1 or more); other frequency factor schemes are not supported');
    }
    return undefined;
  }
  const tolerance = 1e-4 * factor;
  const xs: number[] = [];
  const smooths: number[] = [];
  for (let i = 0; i < factors.length; i++) {
    const f = factors[i]!;
    if (f > 1 + tolerance && f < factor - tolerance) {
      xs.push(ropeTheta ** (-(2 * i) / ropeDim) / (2 * Math.PI));
      smooths.push((1 / f - 1 / factor) / (1 - 1 / factor));
    }
  }
  let lowFreqFactor = 1;
  let highFreqFactor = 4;
  if (xs.length >= 2) {
    const { slope, intercept } = leastSquares(xs, smooths);
    const band = originalContextLength / slope; // high - low
    lowFreqFactor = snap(-intercept * band);
    highFreqFactor = snap(lowFreqFactor + band);
  }
  const scaling: Llama3RopeScaling = { type: 'llama3', factor: snap(factor), lowFreqFactor, highFreqFactor, originalContextLength };
  const recomputed = llama3FreqFactors(scaling, ropeTheta, ropeDim);
  for (let i = 0; i < factors.length; i++) {
    if (Math.abs(recomputed[i]! - factors[i]!) > 1e-3 * factors[i]!) {
      throw new ModelFormatError(`${what}: entry ${i} is ${factors[i]}, which llama3 RoPE scaling (factor ${factor}, ` +
        `low ${lowFreqFactor}, high ${highFreqFactor}, original context ${originalContextLength}) does not give ` +
        `(${recomputed[i]}); other frequency factor schemes are not supported`);
    }
  }
  return scaling;
}

function leastSquares(xs: number[], ys: number[]): { slope: number; intercept: number } {
  const n = xs.length;
  const meanX = xs.reduce((a, b) => a + b, 0) / n;
  const meanY = ys.reduce((a, b) => a + b, 0) / n;
  let sxy = 0, sxx = 0;
  for (let i = 0; i < n; i++) {
    sxy += (xs[i]! - meanX) * (ys[i]! - meanY);
    sxx += (xs[i]! - meanX) ** 2;
  }
  const slope = sxy / sxx;
  return { slope, intercept: meanY - slope * meanX };
}

/** Published factors are short decimals; undo the f32 noise of a fit (8.000001 -> 8). */
function snap(x: number): number {
  const rounded = Math.round(x * 1000) / 1000;
  return Math.abs(rounded - x) < 1e-3 * Math.max(1, Math.abs(x)) ? rounded : x;
}

// ---------------------------------------------------------------------------------------------------------------
// Weights

export function ggufModelWeights(file: GgufFile, config: ModelConfig, source = 'GGUF'): ModelWeights {
  if (file.tensorInfos.length === 0) {
    throw new ModelFormatError(`${source} has no tensors (a vocabulary-only GGUF?), so it cannot be run as a model`);
  }
  // Every tensor read here, plus those the config was derived from; any other tensor in the file makes the load fail.
  const used = new Set<string>(ggufRopeTensors(file, config));
  const get = (name: string): Tensor => {
    if (!file.hasTensor(name)) throw new ModelFormatError(`${source}: tensor ${name} is missing`);
    used.add(name);
    return file.tensor(name);
  };
  const optional = (name: string): Tensor | undefined => (file.hasTensor(name) ? get(name) : undefined);

  const tokenEmbedding = get('token_embd.weight');
  // Before checkWeights, whose "expected shape from the model config" would hide which of the two is off: the
  // config's vocabulary size is the token list's length.
  const tokens = file.metadata.get('tokenizer.ggml.tokens');
  if (Array.isArray(tokens) && tokenEmbedding.shape.length === 2) {
    checkTokenizerFitsEmbedding(source,
      { says: `tokenizer.ggml.tokens lists ${tokens.length} tokens`, ids: tokens.length },
      { name: 'token_embd.weight', rows: tokenEmbedding.shape[1]! }, true);
  }
  const layers: LayerWeights[] = [];
  for (let i = 0; i < config.numLayers; i++) {
    const p = `blk.${i}.`;
    // Experts: every expert's matrix in one tensor with a third dimension (llama.cpp's ffn_*_exps).
    const ffn = config.moe ? '_exps' : '';
    if (config.moe && file.hasTensor(`${p}ffn_gate.0.weight`)) {
      throw new ModelFormatError(`${source}: experts stored one tensor each (${p}ffn_gate.0.weight, an old ` +
        'Mixtral conversion) are not supported; convert the model again with llama.cpp for merged ffn_*_exps tensors');
    }
    // Phi-3 fuses Q, K, V into attn_qkv and gate and up into ffn_up (gate first): split into row ranges, no copy.
    const qkDim = config.numHeads * config.headDim;
    const kvDim = config.numKvHeads * config.headDim;
    const phi3 = config.architecture === 'phi3';
    const fusedQkv = phi3 && file.hasTensor(`${p}attn_qkv.weight`)
      ? splitRows(get(`${p}attn_qkv.weight`), [qkDim, kvDim, kvDim], source) : undefined;
    const fusedUp = phi3 && !file.hasTensor(`${p}ffn_gate.weight`)
      ? splitRows(get(`${p}ffn_up.weight`), [config.ffnDim, config.ffnDim], source) : undefined;
    const layer: LayerWeights = {
      attnNorm: get(`${p}attn_norm.weight`),
      wq: fusedQkv?.[0] ?? get(`${p}attn_q.weight`),
      wk: fusedQkv?.[1] ?? get(`${p}attn_k.weight`),
      wv: fusedQkv?.[2] ?? get(`${p}attn_v.weight`),
      wo: get(`${p}attn_output.weight`),
      ffnNorm: get(`${p}ffn_norm.weight`),
      wGate: fusedUp?.[0] ?? get(`${p}ffn_gate${ffn}.weight`),
      wUp: fusedUp?.[1] ?? get(`${p}ffn_up${ffn}.weight`),
      wDown: get(`${p}ffn_down${ffn}.weight`),
    };
    if (config.qkvBias) {
      layer.bq = get(`${p}attn_q.bias`);
      layer.bk = get(`${p}attn_k.bias`);
      layer.bv = get(`${p}attn_v.bias`);
    }
    if (config.qkNorm) {
      layer.qNorm = get(`${p}attn_q_norm.weight`);
      layer.kNorm = get(`${p}attn_k_norm.weight`);
    }
    if (config.moe) layer.ffnGateInp = get(`${p}ffn_gate_inp.weight`);
    if (config.postNorms) {
      layer.attnPostNorm = get(`${p}post_attention_norm.weight`);
      layer.ffnPostNorm = get(`${p}post_ffw_norm.weight`);
    }
    layers.push(layer);
  }
  const weights: ModelWeights = {
    tokenEmbedding,
    layers,
    outputNorm: get('output_norm.weight'),
    output: optional('output.weight') ?? tokenEmbedding,
  };
  refuseUnusedTensors(file.tensorInfos.map((t) => t.name), used, config, source);
  checkWeights(config, weights, source);
  return weights;
}

/**
 * The RoPE tensors ggufModelConfig turned into config.ropeScaling: LongRoPE's two factor sets (both were checked,
 * one is in the config), and rope_freqs.weight, which ggufRopeScaling reads whenever the scaling is not LongRoPE
 * and refuses unless it is exactly llama3 scaling (or all ones); the backends compute the same divisors from the
 * config, so the tensor itself is not needed.
 */
function ggufRopeTensors(file: GgufFile, config: ModelConfig): string[] {
  if (config.ropeScaling?.type === 'longrope') {
    return ['long', 'short'].flatMap((kind) => [`rope_factors_${kind}.weight`, `blk.0.rope_factors_${kind}.weight`])
      .filter((name) => file.hasTensor(name));
  }
  return file.hasTensor('rope_freqs.weight') ? ['rope_freqs.weight'] : [];
}

/**
 * A tensor the model does not read is a part of the model Conduit would leave out: an output-projection or
 * feed-forward bias, say, which llama.cpp and transformers add and Conduit's forward passes do not. Running without
 * it gives wrong output with no sign of it, so the load fails, naming the first such tensor in file order.
 */
export function refuseUnusedTensors(names: Iterable<string>, used: ReadonlySet<string>, config: ModelConfig,
  source: string): void {
  const unused = [...names].filter((name) => !used.has(name));
  if (unused.length === 0) return;
  const first = unused[0]!;
  const more = unused.length > 1 ? ` (and ${unused.length - 1} more unused tensors)` : '';
  const what = /(^|[._])bias$/.test(first)
    ? 'is a bias Conduit does not apply; running without it would give wrong output'
    : `is not one that Conduit's ${config.architecture} model reads; running without it could give wrong output`;
  throw new ModelFormatError(`${source}: tensor ${first} ${what}, so the model is refused${more}`);
}

/**
 * A fused matrix (rows of several projections one after the other) as one tensor per projection: views of its
 * bytes, `rows[i]` rows each. Throws when the fused tensor does not have exactly that many rows.
 */
export function splitRows(t: Tensor, rows: number[], source: string): Tensor[] {
  const total = rows.reduce((a, b) => a + b, 0);
  if (t.shape.length !== 2 || t.shape[1] !== total) {
    throw new ModelFormatError(`${source}: fused tensor ${t.name} has shape [${t.shape.join(', ')}], expected ` +
      `[${t.shape[0]}, ${total}] from the model config`);
  }
  const rowBytes = t.data.byteLength / total;
  let first = 0;
  return rows.map((n, i) => {
    const part: Tensor = { name: `${t.name}[${i}]`, type: t.type, shape: [t.shape[0]!, n],
      data: t.data.subarray(first * rowBytes, (first + n) * rowBytes) };
    first += n;
    return part;
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Checks shared by every format

/** Expected ggml shapes (shape[0] contiguous) of every weight of a model with this config. */
export function expectedShapes(config: ModelConfig): {
  tokenEmbedding: number[]; outputNorm: number[]; output: number[]; layer: Record<keyof LayerWeights, number[]>;
} {
  const { dim, vocabSize, numHeads, numKvHeads, headDim, moe } = config;
  const qDim = numHeads * headDim;
  const kvDim = numKvHeads * headDim;
  const ffnDim = moe ? moe.expertFfnDim : config.ffnDim;
  const experts = moe ? [moe.numExperts] : [];
  return {
    tokenEmbedding: [dim, vocabSize],
    outputNorm: [dim],
    output: [dim, vocabSize],
    layer: {
      attnNorm: [dim], wq: [dim, qDim], wk: [dim, kvDim], wv: [dim, kvDim], wo: [qDim, dim],
      bq: [qDim], bk: [kvDim], bv: [kvDim], qNorm: [headDim], kNorm: [headDim],
      ffnNorm: [dim], attnPostNorm: [dim], ffnPostNorm: [dim], wGate: [dim, ffnDim, ...experts], wUp: [dim, ffnDim, ...experts],
      wDown: [ffnDim, dim, ...experts], ffnGateInp: [dim, moe?.numExperts ?? 0],
    },
  };
}

/**
 * The tokenizer's ids (`ids`: its largest + 1; `says`: how the message words it) against the token embedding's rows
 * (its second ggml dimension). Every id the tokenizer produces indexes a row, so more ids than rows would read past
 * the embedding's end. Fewer is normal in a Hugging Face folder: vocab_size is often padded (Qwen2.5's 151936 rows
 * for 151665 tokens, Phi-3's 32064 for 32011), and the rows past the tokenizer are never an input. A GGUF lists one
 * token per row (llama.cpp's converter pads the list with [PAD] tokens), and llama.cpp refuses a file whose list and
 * embedding differ either way (it builds the embedding as n_embd x the token count), so `exact` asks for the same.
 */
export function checkTokenizerFitsEmbedding(source: string, tokenizer: { says: string; ids: number },
  embedding: { name: string; rows: number }, exact: boolean): void {
  const { name, rows } = embedding;
  if (tokenizer.ids > rows) {
    throw new ModelFormatError(`${source}: ${tokenizer.says}, more than the ${rows} rows of the token embedding ` +
      `${name}: ids ${rows} to ${tokenizer.ids - 1} would be read past its end`);
  }
  if (exact && tokenizer.ids < rows) {
    throw new ModelFormatError(`${source}: ${tokenizer.says}, fewer than the ${rows} rows of the token embedding ` +
      `${name}; a GGUF lists one token per row (converters pad the list), as llama.cpp requires`);
  }
}

/** Throws naming the first tensor whose type Conduit cannot compute with or whose shape disagrees with the config. */
export function checkWeights(config: ModelConfig, weights: ModelWeights, source: string): void {
  const shapes = expectedShapes(config);
  const check = (t: Tensor, expected: number[]): void => {
    if (!SUPPORTED_TYPES.includes(t.type)) {
      throw new ModelFormatError(`${source}: tensor ${t.name} has type ${ggmlTypeName(t.type)}, which Conduit cannot ` +
        `compute with (supported: ${SUPPORTED_TYPES.map(ggmlTypeName).join(', ')})`);
    }
    const actual = t.shape.length === expected.length ? t.shape : trimTrailingOnes(t.shape);
    if (actual.length !== expected.length || actual.some((d, i) => d !== expected[i])) {
      throw new ModelFormatError(`${source}: tensor ${t.name} has shape [${t.shape.join(', ')}], expected ` +
        `[${expected.join(', ')}] from the model config`);
    }
  };
  check(weights.tokenEmbedding, shapes.tokenEmbedding);
  check(weights.outputNorm, shapes.outputNorm);
  if (weights.output !== weights.tokenEmbedding) check(weights.output, shapes.output);
  if (weights.layers.length !== config.numLayers) {
    throw new ModelFormatError(`${source}: ${weights.layers.length} layers of weights for ${config.numLayers} layers`);
  }
  for (const layer of weights.layers) {
    for (const [field, tensor] of Object.entries(layer) as [keyof LayerWeights, Tensor | undefined][]) {
      if (tensor) check(tensor, shapes.layer[field]);
    }
  }
  const sizeOk = (config.ropeDim <= config.headDim && config.ropeDim % 2 === 0);
  if (!sizeOk) {
    throw new ModelFormatError(`${source}: rope dimension ${config.ropeDim} must be even and at most head_dim ${config.headDim}`);
  }
}

function trimTrailingOnes(shape: number[]): number[] {
  const out = [...shape];
  while (out.length > 1 && out[out.length - 1] === 1) out.pop();
  return out;
}
