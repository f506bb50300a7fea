// Token sampling over the logits rows the backend returns ([rows x vocabSize] float32).
//
// Order of operations per row (vLLM V1's order, so the same request behaves the same here and there):
//   1. min_tokens: stop/EOS ids get -inf until the sequence has min_tokens outputs
//   2. logit_bias: added to the logit
//   3. repetition penalty over prompt + output ids (positive logits divided, negative multiplied), then
//      frequency (count x penalty) and presence (penalty once) subtracted for output ids
//   4. temperature < GREEDY_TEMPERATURE: argmax, ties to the lowest id; else logits / temperature, then
//   5. min_p, top_k, top_p truncation, and one draw from the sequence's own RNG over what is left.
//
// Where the time goes: a few passes over the vocabulary per row (copy, max, exp; Math.exp dominates). Truncation
// never sorts: top_k is a quickselect, top_p a quickselect steered by probability mass, and only the logprobs
// alternatives get sorted. Scratch buffers belong to the Sampler and are reused for every row.

import type { SamplingParams, TokenLogprob } from './types.ts';
import { drawRandomSeed, Xoshiro128 } from './rng.ts';

/** Temperatures below this sample greedily: dividing logits by them would overflow float32 (vLLM uses 1e-5). */
export const GREEDY_TEMPERATURE = 1e-5;

/**
 * Which distribution logprobs describe:
 * - 'raw': log-softmax of the model's logits before any processing (vLLM's default; what evaluation harnesses
 *   expect, and independent of temperature and penalties);
 * - 'processed': log-softmax of the logits after min_tokens, logit_bias, penalties and temperature (unscaled when
 *   greedy), before min_p/top_k/top_p truncation. Masked ids (min_tokens) get -Infinity.
 */
export type LogprobsMode = 'raw' | 'processed';

export interface SampledToken {
  tokenId: number;
  /** Present when the request asked for logprobs (params.logprobs !== null). */
  logprobs?: TokenLogprob;
}

export interface SequenceSamplerOptions {
  params: SamplingParams;
  promptTokenIds: readonly number[];
  vocabSize: number;
  /** The model's end-of-generation ids (Tokenizer.stopTokenIds); ignore_eos leaves them out of the stop set. */
  eosTokenIds: readonly number[];
  /** params.seed, or one drawn once per request (drawRandomSeed) and shared by its n completions. */
  requestSeed: number;
  /** Which of the n completions this sequence is; with the seed it picks the sequence's random stream. */
  completionIndex: number;
}

function invalid(what: string): never {
  throw new RangeError(`invalid sampling params: ${what}`);
}

function checkTokenIds(name: string, ids: Iterable<number>, vocabSize: number): void {
  for (const id of ids) {
    if (!Number.isInteger(id) || id < 0 || id >= vocabSize) invalid(`${name} has token id ${id} outside [0, ${vocabSize})`);
  }
}

/** Rejects params the sampler cannot apply, naming the field and the allowed range. */
export function validateSamplingParams(params: SamplingParams, vocabSize: number): void {
  const { temperature, topP, topK, minP, repetitionPenalty, presencePenalty, frequencyPenalty } = params;
  if (!Number.isFinite(temperature) || temperature < 0) invalid(`temperature must be finite and >= 0, got ${temperature}`);
  if (!(topP > 0 && topP <= 1)) invalid(`topP must be in (0, 1], got ${topP}`);
  if (!Number.isInteger(topK) || topK < -1) invalid(`topK must be an integer >= -1 (0 or -1 = off), got ${topK}`);
  if (!(minP >= 0 && minP <= 1)) invalid(`minP must be in [0, 1], got ${minP}`);
  if (!Number.isFinite(repetitionPenalty) || repetitionPenalty <= 0) {
    invalid(`repetitionPenalty must be finite and > 0, got ${repetitionPenalty}`);
  }
  if (!(presencePenalty >= -2 && presencePenalty <= 2)) invalid(`presencePenalty must be in [-2, 2], got ${presencePenalty}`);
  if (!(frequencyPenalty >= -2 && frequencyPenalty <= 2)) invalid(`frequencyPenalty must be in [-2, 2], got ${frequencyPenalty}`);
  if (!Number.isInteger(params.n) || params.n < 1) invalid(`n must be an integer >= 1, got ${params.n}`);
  if (!Number.isInteger(params.minTokens) || params.minTokens < 0) invalid(`minTokens must be an integer >= 0, got ${params.minTokens}`);
  if (params.logprobs !== null && (!Number.isInteger(params.logprobs) || params.logprobs < 0 || params.logprobs > vocabSize)) {
    invalid(`logprobs must be null or an integer in [0, ${vocabSize}], got ${params.logprobs}`);
  }
  if (params.seed !== undefined && !Number.isSafeInteger(params.seed)) invalid(`seed must be a safe integer, got ${params.seed}`);
  checkTokenIds('stopTokenIds', params.stopTokenIds, vocabSize);
  if (params.logitBias) {
    checkTokenIds('logitBias', params.logitBias.keys(), vocabSize);
    for (const [id, bias] of params.logitBias) {
      if (Number.isNaN(bias) || bias === Infinity) invalid(`logitBias for token ${id} must be a number below +Infinity, got ${bias}`);
    }
  }
}

/** One sequence's sampling state: its params, its output token counts (for penalties) and its RNG. */
export class SequenceSampler {
  readonly params: SamplingParams;
  readonly vocabSize: number;
  /** Ids that end this sequence: its stop_token_ids plus the model's EOS ids unless ignore_eos. */
  readonly stopTokenIds: ReadonlySet<number>;
  private readonly rng: Xoshiro128;
  /** Distinct prompt ids, kept only when a repetition penalty applies. */
  private readonly promptTokenSet: ReadonlySet<number>;
  private readonly outputCounts = new Map<number, number>();
  private numOutputTokens = 0;

  constructor(options: SequenceSamplerOptions) {
    const { params, vocabSize } = options;
    if (!Number.isInteger(vocabSize) || vocabSize < 1) throw new RangeError(`vocabSize must be a positive integer, got ${vocabSize}`);
    validateSamplingParams(params, vocabSize);
    if (!Number.isInteger(options.completionIndex) || options.completionIndex < 0 || options.completionIndex >= params.n) {
      invalid(`completionIndex must be an integer in [0, n=${params.n}), got ${options.completionIndex}`);
    }
    checkTokenIds('eosTokenIds', options.eosTokenIds, vocabSize);
    this.params = params;
    this.vocabSize = vocabSize;
    this.stopTokenIds = new Set(params.ignoreEos ? params.stopTokenIds : [...params.stopTokenIds, ...options.eosTokenIds]);
    this.rng = Xoshiro128.fromSeed(options.requestSeed, options.completionIndex);
    if (params.repetitionPenalty !== 1) {
      checkTokenIds('promptTokenIds', options.promptTokenIds, vocabSize);
      this.promptTokenSet = new Set(options.promptTokenIds);
    } else {
      this.promptTokenSet = new Set();
    }
  }

  get outputTokenCount(): number {
    return this.numOutputTokens;
  }

  /** Counts an output token for the penalties and min_tokens. The Sampler calls this for each token it picks. */
  recordOutputToken(tokenId: number): void {
    this.outputCounts.set(tokenId, (this.outputCounts.get(tokenId) ?? 0) + 1);
    this.numOutputTokens++;
  }

  /** Uniform draw in [0, 1) from this sequence's own stream. */
  nextUniform(): number {
    return this.rng.nextFloat();
  }

  /** The RNG state, to resume the same stream elsewhere (preemption by swap, migration). */
  rngState(): [number, number, number, number] {
    return this.rng.state();
  }

  /** Steps 1-3 of the pipeline, in place on a copy of the row. */
  applyLogitProcessors(logits: Float32Array): void {
    const { params } = this;
    if (this.numOutputTokens < params.minTokens) {
      for (const id of this.stopTokenIds) logits[id] = -Infinity;
    }
    if (params.logitBias) {
      for (const [id, bias] of params.logitBias) logits[id] += bias;
    }
    const penalty = params.repetitionPenalty;
    if (penalty !== 1) {
      const penalise = (id: number): void => {
        const logit = logits[id]!;
        logits[id] = logit > 0 ? logit / penalty : logit * penalty;
      };
      for (const id of this.promptTokenSet) penalise(id);
      for (const id of this.outputCounts.keys()) if (!this.promptTokenSet.has(id)) penalise(id);
    }
    const { frequencyPenalty, presencePenalty } = params;
    if (frequencyPenalty !== 0 || presencePenalty !== 0) {
      for (const [id, count] of this.outputCounts) logits[id] -= frequencyPenalty * count + presencePenalty;
    }
  }
}

/**
 * The n sequences of one request. They share one seed (the request's, or one drawn here once) and each takes its
 * own stream from it by completion index, so a seeded request replays exactly and unseeded completions differ.
 */
export function createRequestSamplers(options: Omit<SequenceSamplerOptions, 'requestSeed' | 'completionIndex'>): SequenceSampler[] {
  validateSamplingParams(options.params, options.vocabSize);
  const requestSeed = options.params.seed ?? drawRandomSeed();
  return Array.from({ length: options.params.n }, (_, completionIndex) => new SequenceSampler({ ...options, requestSeed, completionIndex }));
}

export interface SamplerOptions {
  logprobsMode?: LogprobsMode;
}

/** Samples rows of logits; owns the scratch buffers, so one Sampler serves one thread's batches. */
export class Sampler {
  readonly vocabSize: number;
  readonly logprobsMode: LogprobsMode;
  /** The row being sampled, after processing. */
  private readonly logits: Float32Array;
  /** exp(logit - max) per token id for the candidates of the current row. */
  private readonly weights: Float64Array;
  /** Candidate token ids, rearranged by the selections. */
  private readonly order: Int32Array;

  constructor(vocabSize: number, options: SamplerOptions = {}) {
    if (!Number.isInteger(vocabSize) || vocabSize < 1) throw new RangeError(`vocabSize must be a positive integer, got ${vocabSize}`);
    this.vocabSize = vocabSize;
    this.logprobsMode = options.logprobsMode ?? 'raw';
    this.logits = new Float32Array(vocabSize);
    this.weights = new Float64Array(vocabSize);
    this.order = new Int32Array(vocabSize);
  }

  /** Samples one token per row; row i of `logits` ([sequences.length x vocabSize]) belongs to sequences[i]. */
  sample(logits: Float32Array, sequences: readonly SequenceSampler[]): SampledToken[] {
    const v = this.vocabSize;
    if (logits.length !== sequences.length * v) {
      throw new RangeError(`logits hold ${logits.length} values; expected ${sequences.length} rows x vocabSize ${v}`);
    }
    return sequences.map((sequence, row) => this.sampleRow(logits.subarray(row * v, (row + 1) * v), sequence));
  }

  /** Samples one token from one row of raw logits, records it in the sequence and returns it. The row is not modified. */
  sampleRow(row: Float32Array, sequence: SequenceSampler): SampledToken {
    if (row.length !== this.vocabSize) throw new RangeError(`logits row has ${row.length} values; vocabSize is ${this.vocabSize}`);
    if (sequence.vocabSize !== this.vocabSize) {
      throw new RangeError(`sequence was set up for vocabSize ${sequence.vocabSize}; this sampler has ${this.vocabSize}`);
    }
    const logits = this.logits;
    logits.set(row);
    sequence.applyLogitProcessors(logits);
    const { temperature } = sequence.params;
    let tokenId: number;
    if (temperature < GREEDY_TEMPERATURE) {
      tokenId = this.argmax();
    } else {
      if (temperature !== 1) {
        const inverse = 1 / temperature;
        for (let i = 0; i < logits.length; i++) logits[i]! *= inverse;
      }
      tokenId = this.drawTruncated(sequence);
    }
    sequence.recordOutputToken(tokenId);
    const numTop = sequence.params.logprobs;
    if (numTop === null) return { tokenId };
    const source = this.logprobsMode === 'raw' ? row : logits;
    return { tokenId, logprobs: this.logprobsOf(source, tokenId, numTop) };
  }

  // ---- greedy

  private argmax(): number {
    const logits = this.logits;
    let best = 0;
    let bestValue = -Infinity;
    for (let i = 0; i < logits.length; i++) {
      const value = logits[i]!;
      if (value > bestValue) {
        bestValue = value;
        best = i;
      } else if (value !== value) {
        throw new RangeError(`logits row holds NaN at token id ${i}`);
      }
    }
    if (bestValue === -Infinity) throw new RangeError('every token is masked (-Infinity logits): nothing to sample');
    return best;
  }

  // ---- random sampling with min_p / top_k / top_p

  private drawTruncated(sequence: SequenceSampler): number {
    const { logits, weights, order } = this;
    const v = logits.length;
    const max = logits[this.argmax()]!;
    const { minP, topP } = sequence.params;
    // min_p keeps p >= minP * pMax, i.e. logit >= max + ln(minP) on the temperature-scaled logits.
    const floor = minP > 0 ? max + Math.log(minP) : -Infinity;
    const topK = sequence.params.topK > 0 ? Math.min(sequence.params.topK, v) : v;

    if (topK === v && topP >= 1) {
      // No ranking needed: draw over the ids in id order.
      let total = 0;
      for (let i = 0; i < v; i++) {
        const value = logits[i]!;
        const weight = value >= floor ? Math.exp(value - max) : 0;
        weights[i] = weight;
        total += weight;
      }
      const target = sequence.nextUniform() * total;
      let cumulative = 0;
      let last = 0;
      for (let i = 0; i < v; i++) {
        const weight = weights[i]!;
        if (weight === 0) continue;
        cumulative += weight;
        last = i;
        if (cumulative > target) return i;
      }
      return last; // rounding left the target at the very top of the mass
    }

    let numKept = 0;
    for (let i = 0; i < v; i++) {
      const value = logits[i]!;
      if (value >= floor && value > -Infinity) {
        order[numKept++] = i;
        weights[i] = Math.exp(value - max);
      }
    }
    if (topK < numKept) {
      selectTop(logits, order, numKept, topK, false);
      numKept = topK;
    }
    let keptMass = 0;
    for (let j = 0; j < numKept; j++) keptMass += weights[order[j]!]!;
    if (topP < 1) {
      numKept = selectTopByMass(logits, weights, order, numKept, topP * keptMass);
      keptMass = 0;
      for (let j = 0; j < numKept; j++) keptMass += weights[order[j]!]!;
    }
    // The kept ids are in no particular order; any fixed order gives the same distribution.
    const target = sequence.nextUniform() * keptMass;
    let cumulative = 0;
    for (let j = 0; j < numKept; j++) {
      cumulative += weights[order[j]!]!;
      if (cumulative > target) return order[j]!;
    }
    return order[numKept - 1]!;
  }

  // ---- logprobs

  private logprobsOf(source: Float32Array, tokenId: number, numTop: number): TokenLogprob {
    let max = -Infinity;
    for (let i = 0; i < source.length; i++) if (source[i]! > max) max = source[i]!;
    let sum = 0;
    for (let i = 0; i < source.length; i++) sum += Math.exp(source[i]! - max);
    const logNormaliser = max + Math.log(sum);
    const top = bestIds(source, numTop, this.order).map((id) => ({ tokenId: id, logprob: source[id]! - logNormaliser }));
    return { tokenId, logprob: source[tokenId]! - logNormaliser, top };
  }
}

// ---- selection: rank only as much as the filters need

/** True when token a ranks before token b: higher value first, lower id on ties. */
function ranksBefore(values: Float32Array, a: number, b: number): boolean {
  const va = values[a]!;
  const vb = values[b]!;
  return va > vb || (va === vb && a < b);
}

function medianOfThree(values: Float32Array, a: number, b: number, c: number): number {
  if (ranksBefore(values, a, b)) {
    if (ranksBefore(values, b, c)) return b;
    return ranksBefore(values, a, c) ? c : a;
  }
  if (ranksBefore(values, a, c)) return a;
  return ranksBefore(values, b, c) ? c : b;
}

/**
 * Hoare partition of order[lo, hi] around a median-of-three pivot. Returns [j, i] with j < i: order[lo, j] ranks
 * before order[j+1, i-1] (the pivot, or nothing), which ranks before order[i, hi].
 */
function partition(values: Float32Array, order: Int32Array, lo: number, hi: number): [number, number] {
  const pivot = medianOfThree(values, order[lo]!, order[(lo + hi) >>> 1]!, order[hi]!);
  let i = lo;
  let j = hi;
  while (i <= j) {
    while (ranksBefore(values, order[i]!, pivot)) i++;
    while (ranksBefore(values, pivot, order[j]!)) j--;
    if (i <= j) {
      const swap = order[i]!;
      order[i++] = order[j]!;
      order[j--] = swap;
    }
  }
  return [j, i];
}

/**
 * Rearranges order[0, count) so that order[0, m) holds the m best ids (by ranksBefore), sorted best first unless
 * `sortWinners` is false. Quickselect then a sort of the m winners: O(count + m log m), never a full sort.
 */
export function selectTop(values: Float32Array, order: Int32Array, count: number, m: number, sortWinners = true): void {
  if (m <= 0) return;
  let lo = 0;
  let hi = count - 1;
  const kth = m - 1;
  while (m < count && lo < hi) {
    const [j, i] = partition(values, order, lo, hi);
    if (kth <= j) hi = j;
    else if (kth >= i) lo = i;
    else break; // order[kth] is the pivot itself, already in place
  }
  if (sortWinners) order.subarray(0, Math.min(m, count)).sort((a, b) => (ranksBefore(values, a, b) ? -1 : ranksBefore(values, b, a) ? 1 : 0));
}

/**
 * top_p's cut without sorting: rearranges order[0, count) so that its first k ids are the best ones, for the
 * smallest k whose weights sum to at least `mass` (each kept id has less than `mass` ranked before it), and
 * returns k. A quickselect that descends by accumulated weight instead of by position: O(count) expected.
 */
export function selectTopByMass(values: Float32Array, weights: Float64Array, order: Int32Array, count: number, mass: number): number {
  let lo = 0;
  let hi = count - 1;
  let massBefore = 0; // weight of order[0, lo), all of it ranked before order[lo, hi]
  while (lo < hi) {
    const [j, i] = partition(values, order, lo, hi);
    let leftMass = 0;
    for (let k = lo; k <= j; k++) leftMass += weights[order[k]!]!;
    if (massBefore + leftMass >= mass) {
      hi = j;
      continue;
    }
    massBefore += leftMass;
    for (let k = j + 1; k < i; k++) {
      massBefore += weights[order[k]!]!;
      if (massBefore >= mass) return k + 1;
    }
    lo = i;
  }
  return Math.min(lo, hi) + 1; // lo passes hi only when rounding left the mass a hair short: keep all up to hi
}

/** The n best ids of `values`, best first. Small n (OpenAI allows up to 20) keeps a sorted insertion buffer. */
function bestIds(values: Float32Array, n: number, scratch: Int32Array): number[] {
  if (n === 0) return [];
  if (n > 64) {
    for (let i = 0; i < values.length; i++) scratch[i] = i;
    selectTop(values, scratch, values.length, n);
    return Array.from(scratch.subarray(0, n));
  }
  const best: number[] = [];
  for (let id = 0; id < values.length; id++) {
    if (best.length === n && !ranksBefore(values, id, best[n - 1]!)) continue;
    let at = best.length === n ? n - 1 : best.length;
    while (at > 0 && ranksBefore(values, id, best[at - 1]!)) {
      best[at] = best[at - 1]!;
      at--;
    }
    best[at] = id;
  }
  return best;
}
