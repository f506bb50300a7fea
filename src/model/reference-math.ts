// Plain TypeScript math kernels: the reference that every faster kernel is compared with.
//
// Activations are f32 rows in flat Float32Arrays, addressed by offsets so that a batch of rows needs no views.
// Sums are accumulated in JavaScript numbers (doubles) and rounded to f32 when stored, so these kernels are at
// least as accurate as any f32 implementation they check. Weight matrices are f32, already dequantized, in ggml
// order: the matrix of a linear layer with `inDim` inputs is `outDim` rows of `inDim` contiguous elements.
//
// Where the time goes: `matmul` (every projection and the logits) is nearly all of it; attention grows with the
// context length. Both keep their innermost loop over contiguous memory.

import type { RopeScaling, RopeStyle } from './config.ts';

// ---------------------------------------------------------------------------------------------------------------
// Vectors

/** Dot product of a[aOffset ..] and b[bOffset ..] over `length` elements. */
export function dot(a: Float32Array, aOffset: number, b: Float32Array, bOffset: number, length: number): number {
  // Four independent partial sums let the CPU overlap the multiply-adds instead of waiting on one accumulator.
  let s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  let i = 0;
  for (; i + 4 <= length; i += 4) {
    s0 += a[aOffset + i]! * b[bOffset + i]!;
    s1 += a[aOffset + i + 1]! * b[bOffset + i + 1]!;
    s2 += a[aOffset + i + 2]! * b[bOffset + i + 2]!;
    s3 += a[aOffset + i + 3]! * b[bOffset + i + 3]!;
  }
  for (; i < length; i++) s0 += a[aOffset + i]! * b[bOffset + i]!;
  return (s0 + s1) + (s2 + s3);
}

/** out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for each of `numRows` rows of `dim` elements. */
export function rmsnorm(out: Float32Array, x: Float32Array, weight: Float32Array, numRows: number, dim: number,
  eps: number): void {
  for (let r = 0; r < numRows; r++) {
    const base = r * dim;
    const meanSquare = dot(x, base, x, base, dim) / dim;
    const scale = 1 / Math.sqrt(meanSquare + eps);
    for (let i = 0; i < dim; i++) out[base + i] = x[base + i]! * scale * weight[i]!;
  }
}

/**
 * out[r][o] = sum_i w[o][i] * x[r][i] for `numRows` input rows: y = W x of a linear layer, row by row.
 * The loop over output rows is outermost so that one weight row, once in cache, serves every input row.
 */
export function matmul(out: Float32Array, x: Float32Array, w: Float32Array, numRows: number, inDim: number,
  outDim: number): void {
  for (let o = 0; o < outDim; o++) {
    const wRow = o * inDim;
    for (let r = 0; r < numRows; r++) out[r * outDim + o] = dot(w, wRow, x, r * inDim, inDim);
  }
}

/** Adds `bias` (length `dim`) to each of `numRows` rows. */
export function addBias(rows: Float32Array, bias: Float32Array, numRows: number, dim: number): void {
  for (let r = 0; r < numRows; r++) {
    const base = r * dim;
    for (let i = 0; i < dim; i++) rows[base + i] = rows[base + i]! + bias[i]!;
  }
}

/** x += y elementwise over the first `length` elements (residual connections). */
export function addInPlace(x: Float32Array, y: Float32Array, length: number): void {
  for (let i = 0; i < length; i++) x[i] = x[i]! + y[i]!;
}

/** In place: x[offset .. offset+length) becomes softmax of itself (max subtracted first for stability). */
export function softmax(x: Float32Array | Float64Array, offset: number, length: number): void {
  let max = -Infinity;
  for (let i = 0; i < length; i++) if (x[offset + i]! > max) max = x[offset + i]!;
  let sum = 0;
  for (let i = 0; i < length; i++) {
    const e = Math.exp(x[offset + i]! - max);
    x[offset + i] = e;
    sum += e;
  }
  for (let i = 0; i < length; i++) x[offset + i] = x[offset + i]! / sum;
}

export function silu(v: number): number {
  return v / (1 + Math.exp(-v));
}

/** In place: gate[i] = silu(gate[i]) * up[i], the gated activation of a SwiGLU feed-forward block. */
export function swiglu(gate: Float32Array, up: Float32Array, length: number): void {
  for (let i = 0; i < length; i++) gate[i] = silu(gate[i]!) * up[i]!;
}

/** GELU, tanh approximation: 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))). */
export function geluTanh(v: number): number {
  return 0.5 * v * (1 + Math.tanh(Math.sqrt(2 / Math.PI) * (v + 0.044715 * v * v * v)));
}

/** In place: gate[i] = geluTanh(gate[i]) * up[i], the gated activation of a GeGLU feed-forward block (Gemma). */
export function geglu(gate: Float32Array, up: Float32Array, length: number): void {
  for (let i = 0; i < length; i++) gate[i] = geluTanh(gate[i]!) * up[i]!;
}

/**
 * Mixture-of-experts routing of one token: softmax over the router's `numExperts` scores at scores[offset ..], the
 * `numUsed` most probable experts (the lower index first on ties) in descending order, and their weights: the
 * probabilities, divided by their sum when `normalize`.
 */
export function routeExperts(scores: Float32Array, offset: number, numExperts: number, numUsed: number,
  normalize: boolean): { experts: number[]; weights: number[] } {
  const probabilities = Float64Array.from(scores.subarray(offset, offset + numExperts));
  softmax(probabilities, 0, numExperts);
  const order = Array.from({ length: numExperts }, (_, e) => e)
    .sort((a, b) => probabilities[b]! - probabilities[a]! || a - b)
    .slice(0, numUsed);
  const weights = order.map((e) => probabilities[e]!);
  if (normalize) {
    const sum = weights.reduce((a, b) => a + b, 0);
    for (let i = 0; i < weights.length; i++) weights[i] = weights[i]! / sum;
  }
  return { experts: order, weights };
}

/** Index of the largest of x[offset .. offset+length); the first one on ties. */
export function argmax(x: Float32Array, offset: number, length: number): number {
  let best = 0;
  for (let i = 1; i < length; i++) if (x[offset + i]! > x[offset + best]!) best = i;
  return best;
}

// ---------------------------------------------------------------------------------------------------------------
// RoPE

/**
 * Rotation frequency of each of the ropeDim/2 dimension pairs: theta_i = base^(-2i/ropeDim), then rescaled for
 * a context longer than the model was trained on.
 * - linear: every position is divided by `factor`, which is the same as dividing every frequency by it.
 * - llama3: frequencies whose wavelength is longer than originalContextLength / lowFreqFactor are divided by
 *   `factor`; those shorter than originalContextLength / highFreqFactor are kept; in between, a linear blend of
 *   the two in originalContextLength / wavelength.
 */
export function ropeFrequencies(ropeDim: number, base: number, scaling?: RopeScaling): Float64Array {
  if (!Number.isInteger(ropeDim) || ropeDim <= 0 || ropeDim % 2 !== 0) {
    throw new RangeError(`RoPE dimension must be a positive even integer, got ${ropeDim}`);
  }
  if (!(base > 0)) throw new RangeError(`RoPE base must be positive, got ${base}`);
  const frequencies = new Float64Array(ropeDim / 2);
  for (let i = 0; i < ropeDim / 2; i++) frequencies[i] = Math.pow(base, (-2 * i) / ropeDim);
  if (!scaling) return frequencies;
  if (scaling.type === 'longrope') {
    if (scaling.factors.length !== frequencies.length || !scaling.factors.every((f) => f > 0)) {
      throw new RangeError(`LongRoPE needs ${frequencies.length} positive factors, got ${scaling.factors.length}`);
    }
    for (let i = 0; i < frequencies.length; i++) frequencies[i] = frequencies[i]! / scaling.factors[i]!;
    return frequencies;
  }
  if (!(scaling.factor > 0)) throw new RangeError(`RoPE scaling factor must be positive, got ${scaling.factor}`);

  if (scaling.type === 'linear') {
    for (let i = 0; i < frequencies.length; i++) frequencies[i] = frequencies[i]! / scaling.factor;
    return frequencies;
  }
  const { factor, lowFreqFactor, highFreqFactor, originalContextLength } = scaling;
  if (!(highFreqFactor > lowFreqFactor)) {
    throw new RangeError(`llama3 RoPE scaling needs highFreqFactor > lowFreqFactor, got ${highFreqFactor} and ` +
      `${lowFreqFactor}`);
  }
  const longestKeptWavelength = originalContextLength / highFreqFactor;
  const shortestScaledWavelength = originalContextLength / lowFreqFactor;
  for (let i = 0; i < frequencies.length; i++) {
    const frequency = frequencies[i]!;
    const wavelength = (2 * Math.PI) / frequency;
    if (wavelength < longestKeptWavelength) continue;
    if (wavelength > shortestScaledWavelength) {
      frequencies[i] = frequency / factor;
      continue;
    }
    const smooth = (originalContextLength / wavelength - lowFreqFactor) / (highFreqFactor - lowFreqFactor);
    frequencies[i] = (1 - smooth) * (frequency / factor) + smooth * frequency;
  }
  return frequencies;
}

/** cos and sin of position * frequency for each pair, shared by every head of the token. */
export function ropeAngles(position: number, frequencies: Float64Array, cos: Float64Array, sin: Float64Array): void {
  for (let i = 0; i < frequencies.length; i++) {
    const angle = position * frequencies[i]!;
    cos[i] = Math.cos(angle);
    sin[i] = Math.sin(angle);
  }
}

/**
 * Rotates the first 2 * cos.length dimensions of each of `numHeads` heads stored at x[offset ..]; the rest of
 * each head passes through. 'interleaved' rotates pairs (2i, 2i+1), 'neox' pairs (i, i + ropeDim/2).
 */
export function applyRope(x: Float32Array, offset: number, numHeads: number, headDim: number, style: RopeStyle,
  cos: Float64Array, sin: Float64Array): void {
  const numPairs = cos.length;
  for (let h = 0; h < numHeads; h++) {
    const head = offset + h * headDim;
    for (let i = 0; i < numPairs; i++) {
      const a = style === 'interleaved' ? head + 2 * i : head + i;
      const b = style === 'interleaved' ? a + 1 : a + numPairs;
      const x0 = x[a]!;
      const x1 = x[b]!;
      x[a] = x0 * cos[i]! - x1 * sin[i]!;
      x[b] = x0 * sin[i]! + x1 * cos[i]!;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Attention

export interface AttentionShape {
  numHeads: number;
  numKvHeads: number;
  headDim: number;
  /** Scale of the scores; absent = 1 / sqrt(headDim). */
  scale?: number;
}

/**
 * Causal multi-head attention of `numQueries` consecutive tokens of one sequence.
 *
 * Query row i is batch row firstRow + i of `queries` ([rows, numHeads * headDim]) and sits at position
 * firstPosition + i; it attends to key positions 0 .. firstPosition + i of `keys` and `values`
 * ([positions, numKvHeads * headDim], position-major). Its result goes to the same row of `out`.
 * Grouped-query attention: query head h reads KV head floor(h / (numHeads / numKvHeads)).
 * With a sliding window (window > 0) the query at position p attends to positions max(0, p - window + 1) .. p only.
 */
export function causalAttention(out: Float32Array, queries: Float32Array, firstRow: number, numQueries: number,
  firstPosition: number, keys: Float32Array, values: Float32Array, shape: AttentionShape, window = 0): void {
  const { numHeads, numKvHeads, headDim } = shape;
  if (numHeads % numKvHeads !== 0) {
    throw new RangeError(`attention: ${numHeads} query heads do not divide into ${numKvHeads} KV heads`);
  }
  const headsPerKvHead = numHeads / numKvHeads;
  const qDim = numHeads * headDim;
  const kvDim = numKvHeads * headDim;
  const scale = shape.scale ?? 1 / Math.sqrt(headDim);
  const scores = new Float64Array(firstPosition + numQueries);
  const accumulator = new Float64Array(headDim);

  for (let i = 0; i < numQueries; i++) {
    const row = firstRow + i;
    const numKeys = firstPosition + i + 1;
    const firstKey = window > 0 ? Math.max(0, numKeys - window) : 0;
    const numVisible = numKeys - firstKey;
    for (let h = 0; h < numHeads; h++) {
      const q = row * qDim + h * headDim;
      const kvHead = Math.floor(h / headsPerKvHead) * headDim;
      for (let p = firstKey; p < numKeys; p++) {
        scores[p - firstKey] = dot(queries, q, keys, p * kvDim + kvHead, headDim) * scale;
      }
      softmax(scores, 0, numVisible);
      accumulator.fill(0);
      for (let p = firstKey; p < numKeys; p++) {
        const weight = scores[p - firstKey]!;
        const v = p * kvDim + kvHead;
        for (let d = 0; d < headDim; d++) accumulator[d] = accumulator[d]! + weight * values[v + d]!;
      }
      const o = row * qDim + h * headDim;
      for (let d = 0; d < headDim; d++) out[o + d] = accumulator[d]!;
    }
  }
}
