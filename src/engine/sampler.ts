// Token sampling over the logits rows the backend returns ([rows x vocabSize] float32).
//
// Order of operations per row (vLLM V1's order, so the same request behaves the same here and there):
//   1. min_tokens: stop/EOS ids get -inf until the sequence has min_tokens outputs (the EOS ids even under ignore_eos)
//   2. logit_bias: added to the logit
//   3. repetition penalty over prompt + output ids (positive logits divided, negative multiplied), then
//      frequency (count x penalty) and presence (penalty once) subtracted for output ids
//   4. temperature < GREEDY_TEMPERATURE: argmax, ties to the lowest id; else logits / temperature, then
//   5. min_p, top_k, top_p truncation, and one draw from the sequence's own RNG over what is left.
//
// Where the time goes: a few passes over the vocabulary per row (max, exp; the exponentials dominate whenever the
// whole vocabulary's mass is needed, so that pass, weighCandidates, runs in the compute backend where it has one:
// native/sample_weigh.h, the same arithmetic bit for bit, several times faster). The row is read in place unless
// something must change it (min_tokens masking, logit_bias, penalties, temperature, processed logprobs); then it is
// copied once into scratch (a plain or min_p draw at a temperature leaves 1/T to the backend's weighing pass). The
// argmax keeps four independent running maxima so the loop is not one long dependency chain. Truncation never
// sorts: top_k keeps a k-sized heap while scanning the logits (most tokens cost one comparison, and only the k kept
// get an exp); top_p bins the probability mass by distance below the max during the exp pass, keeps whole bins, and
// ranks only the bin where the mass is reached, with a quickselect steered by mass; only the logprobs alternatives
// get sorted.
// Scratch buffers belong to the Sampler and are reused for every row: sampling a row allocates nothing but its
// result.

import type { GuidedSequence } from './grammar/runtime.ts';
import type { SamplingParams, TokenLogprob } from './types.ts';
import { drawRandomSeed, Xoshiro128 } from '../util/random.ts';

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
  /** -1 for a row sampleBatch could not sample (see `failure`). */
  tokenId: number;
  /** Present when the request asked for logprobs (params.logprobs !== null). */
  logprobs?: TokenLogprob;
  /** Why this row could not be sampled (sampleBatch only): its request fails, the batch's other rows do not. */
  failure?: UnsampleableRowError;
}

/**
 * A row of logits no token can be drawn from: it holds a NaN (the model overflowed, or its weights are broken), or
 * every token is masked (-Infinity), or (a guided row) the grammar engine holding its state failed. The fault is the
 * row's own, so only its request fails.
 */
export class UnsampleableRowError extends RangeError {
  override name = 'UnsampleableRowError';
  constructor(readonly reason: 'nan' | 'masked' | 'grammar', message: string) {
    super(message);
  }
}

function everyTokenMasked(): never {
  throw new UnsampleableRowError('masked', 'every token is masked (-Infinity logits): nothing to sample');
}

export interface SequenceSamplerOptions {
  params: SamplingParams;
  promptTokenIds: readonly number[];
  vocabSize: number;
  /**
   * The model's end-of-generation ids (Tokenizer.stopTokenIds); ignore_eos leaves them out of the stop set, not out of
   * min_tokens' hold.
   */
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
  const { promptLogprobs } = params;
  if (promptLogprobs !== undefined && (!Number.isInteger(promptLogprobs) || promptLogprobs < 0 || promptLogprobs > vocabSize)) {
    invalid(`promptLogprobs must be absent or an integer in [0, ${vocabSize}], got ${promptLogprobs}`);
  }
  if (params.seed !== undefined && !Number.isSafeInteger(params.seed)) invalid(`seed must be a safe integer, got ${params.seed}`);
  checkTokenIds('stopTokenIds', params.stopTokenIds, vocabSize);
  if (params.ignoredEosTokenIds) checkTokenIds('ignoredEosTokenIds', params.ignoredEosTokenIds, vocabSize);
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
  /**
   * Ids min_tokens holds back (-Infinity until the sequence has min_tokens outputs): its stop_token_ids and the
   * model's EOS ids (the tokenizer's, and generation_config.json's), with ignore_eos too. As in vLLM, whose min_tokens
   * processor masks every stop and EOS id whatever ignore_eos says, so the first min_tokens outputs never hold an EOS,
   * ignored or not.
   */
  readonly minTokensHeldIds: ReadonlySet<number>;
  private rng: Xoshiro128;
  /** Distinct prompt ids, kept only when a repetition penalty applies. */
  private readonly promptTokenSet: ReadonlySet<number>;
  private readonly outputCounts = new Map<number, number>();
  private numOutputTokens = 0;
  /** The grammar state of a guided request (params.guided), set by the engine that owns the grammars. */
  guided: GuidedSequence | undefined;

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
    this.minTokensHeldIds = new Set([...params.stopTokenIds, ...options.eosTokenIds, ...params.ignoredEosTokenIds ?? []]);
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

  /**
   * Counts, for the frequency and presence penalties only, an output token from before a migration (it now ends the
   * prompt; min_tokens was already reduced by it), so the penalties go on as on the lost worker.
   */
  recordPriorOutputToken(tokenId: number): void {
    this.outputCounts.set(tokenId, (this.outputCounts.get(tokenId) ?? 0) + 1);
  }

  /** Takes back the last recordOutputToken(tokenId) (a token the engine drew but then refused). */
  unrecordOutputToken(tokenId: number): void {
    const count = this.outputCounts.get(tokenId) ?? 0;
    if (count <= 1) this.outputCounts.delete(tokenId);
    else this.outputCounts.set(tokenId, count - 1);
    this.numOutputTokens--;
  }

  /** Uniform draw in [0, 1) from this sequence's own stream. */
  nextUniform(): number {
    return this.rng.nextFloat();
  }

  /** Continues the stream from a state rngState() gave (a guided request's draws per token vary: it cannot be replayed). */
  restoreRngState(state: readonly [number, number, number, number]): void {
    this.rng = new Xoshiro128(state);
  }

  /** The RNG state, to resume the same stream elsewhere (preemption by swap, migration). */
  rngState(): [number, number, number, number] {
    return this.rng.state();
  }

  /** Whether applyLogitProcessors would change a row now: without it, the sampler reads the row in place. */
  get hasLogitProcessors(): boolean {
    const { params } = this;
    return (this.numOutputTokens < params.minTokens && this.minTokensHeldIds.size > 0)
      || (params.logitBias !== undefined && params.logitBias.size > 0)
      || params.repetitionPenalty !== 1 || params.frequencyPenalty !== 0 || params.presencePenalty !== 0;
  }

  /**
   * Steps 1-3 of the pipeline, in place on a copy of the row. Every id used as an index was checked against
   * vocabSize in the constructor (stop, bias and prompt ids) or was sampled from a row (output ids). `holdStops` false
   * leaves out min_tokens' hold on the stop ids (the row a guided output that ends despite it reports its end from).
   */
  applyLogitProcessors(logits: Float32Array, holdStops = true): void {
    const { params } = this;
    if (holdStops && this.numOutputTokens < params.minTokens) {
      for (const id of this.minTokensHeldIds) logits[id] = -Infinity;
    }
    if (params.logitBias) {
      for (const [id, bias] of params.logitBias) logits[id]! += bias;
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
      for (const [id, count] of this.outputCounts) logits[id]! -= frequencyPenalty * count + presencePenalty;
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
  /**
   * A faster pass for the argmax of a row (the compute backend's, ModelRunnerBackend.argmax): the same index, or -1
   * for a row with a NaN or nothing above -Infinity, which argmax() then reports.
   */
  argmax?: (row: Float32Array) => number;
  /** A faster weighCandidates with the same results bit for bit (the compute backend's, ModelRunnerBackend.sampleWeigh). */
  weigh?: WeighCandidates;
  /**
   * A faster scaled copy of a row with the same values bit for bit (the compute backend's,
   * ModelRunnerBackend.scaleRow): out[i] = row[i] * factor as a Float32Array stores it; out may be row.
   */
  scale?: ScaleRow;
  /** The prompt-logprob pass over many rows at once (the compute backend's, ModelRunnerBackend.promptLogprobRows). */
  promptRows?: PromptLogprobRowsPass;
  /** Random draws of many rows at once (the compute backend's, ModelRunnerBackend.sampleRows); see sampleBatch. */
  drawRows?: DrawRows;
}

/** See ModelRunnerBackend.sampleRows. */
export type DrawRows = (logits: Float32Array, rows: Int32Array, specs: Float64Array, out: Int32Array) => void;

/**
 * Numbers per row of a DrawRows spec: the factor values are read at (0: a greedy row), ln(min_p) (-Infinity: none),
 * top_p, the uniform, top_k (0: none).
 */
export const DRAW_SPEC_WORDS = 5;

/** A greedy row's DrawRows spec (the factor 0; the other words any valid ones). */
const GREEDY_DRAW_SPEC = Float64Array.of(0, -Infinity, 1, 0, 0);

/** See ModelRunnerBackend.promptLogprobRows. */
export type PromptLogprobRowsPass = (logits: Float32Array, rows: number, targets: Int32Array, out: Float64Array,
  best: Int32Array, numBest: number, rowIds?: Int32Array) => void;

/** The most best ids per row the backend's prompt-logprob pass is asked for; beyond it, bestIds here. */
const PROMPT_ROWS_MAX_BEST = 64;

/** out[i] = row[i] * factor over row.length elements, as a Float32Array stores the product; out may be row. */
export type ScaleRow = (row: Float32Array, out: Float32Array, factor: number) => void;

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
  /** logprobsRow's buffer (allocated on first use). */
  private logprobsValues: Float32Array | undefined;
  /** The weighing pass's running totals after each block of WEIGH_BLOCK ids, and the last id with a weight above 0. */
  private readonly blockTotals: Float64Array;
  private lastWeighed = 0;
  /**
   * The values this row's draw weighed whole, unscaled and without a floor (a plain draw over values at their own
   * scale), and that weighing's max and total: the logprobs' normaliser over the same values is then already known.
   * Null otherwise.
   */
  private plainWeighed: Float32Array | null = null;
  private plainWeighedMax = 0;
  private plainWeighedTotal = 0;
  /** top_p's weight and token count per distance below the max (see selectTopP). */
  private readonly binMass = new Float64Array(MASS_BINS);
  private readonly binCount = new Int32Array(MASS_BINS);
  /** The weighing pass (weighCandidates, or the backend's) and where it leaves the last id it weighed. */
  private readonly weigh: WeighCandidates;
  private readonly lastOut = new Int32Array(1);
  /** The scaled copy of a row (scaleRow, or the backend's). */
  private readonly scaleRow: ScaleRow;
  /** The backend's prompt-logprob pass over many rows, its targets and results (3 per row), grown to the largest use. */
  private readonly promptRows: PromptLogprobRowsPass | undefined;
  private promptRowTargets = new Int32Array(0);
  private promptRowResults = new Float64Array(0);
  private promptRowBest = new Int32Array(0);
  /** sampleBatch's rows whose logprobs that pass gives: their logits rows and how many alternatives each asked. */
  private passRowIds = new Int32Array(0);
  private passNumTops = new Int32Array(0);
  /**
   * Whether a draw over the whole row leaves the scaling by 1/T to the weighing pass: the backend's reads each value
   * scaled at no cost, while weighCandidates is faster over a scaled copy (a Math.fround per value there costs more
   * than the copy). The same weights either way.
   */
  private readonly scaleInPass: boolean;
  /**
   * The greedy pick and the max of a row: the backend's pass where there is one, argmax() for the rows it declines
   * (which argmax() then reports: a NaN, nothing above -Infinity).
   */
  readonly argmax: (row: Float32Array) => number;
  private readonly drawRows: DrawRows | undefined;
  /** drawBatch's scratch, grown to the largest batch. */
  private drawnTokens = new Int32Array(0);
  private drawRowIds = new Int32Array(0);
  private drawSpecs = new Float64Array(0);
  private drawOut = new Int32Array(0);

  constructor(vocabSize: number, options: SamplerOptions = {}) {
    if (!Number.isInteger(vocabSize) || vocabSize < 1) throw new RangeError(`vocabSize must be a positive integer, got ${vocabSize}`);
    this.vocabSize = vocabSize;
    this.logprobsMode = options.logprobsMode ?? 'raw';
    this.logits = new Float32Array(vocabSize);
    this.weights = new Float64Array(vocabSize);
    this.order = new Int32Array(vocabSize);
    this.blockTotals = new Float64Array(Math.ceil(vocabSize / WEIGH_BLOCK));
    this.weigh = options.weigh ?? weighCandidates;
    this.scaleRow = options.scale ?? scaleRow;
    this.promptRows = options.promptRows;
    this.drawRows = options.drawRows;
    this.scaleInPass = options.weigh !== undefined;
    const fast = options.argmax;
    this.argmax = fast === undefined ? argmax : (row) => {
      const id = fast(row);
      return id >= 0 ? id : argmax(row);
    };
  }

  /**
   * Samples one token per row; row i of `logits` ([sequences.length x vocabSize]) belongs to sequences[i]. Throws the
   * UnsampleableRowError of the first row that cannot be sampled.
   */
  sample(logits: Float32Array, sequences: readonly SequenceSampler[]): SampledToken[] {
    if (logits.length !== sequences.length * this.vocabSize) {
      throw new RangeError(`logits hold ${logits.length} values; expected ${sequences.length} rows x vocabSize ${this.vocabSize}`);
    }
    const results = this.sampleBatch(logits, sequences) as SampledToken[];
    for (const result of results) if (result.failure !== undefined) throw result.failure;
    return results;
  }

  /**
   * Samples row i of `logits` (at least sequences.length rows of vocabSize) for sequences[i], or leaves it to the
   * caller where that is undefined; the same tokens as sampleRow row by row. With the backend's drawRows, the rows
   * that need nothing but a random draw or their argmax (no logit processors; no logprobs, or logprobs the pass below
   * gives) are drawn by it all at once, each from the uniform its own sequence gives, as sampleRow's draw takes it,
   * greedy ones without one (the backend's threads share them, where here they would be drawn one after another on
   * one thread); the rest go through sampleRow here. Logprobs of the raw logits (logprobsMode 'raw'), with the
   * backend's prompt-logprob pass, are then that pass over all such rows at once with each row's chosen token as its
   * target: the same entries as sampleRow's, bit for bit, the rows again shared by the backend's threads.
   * A row that cannot be sampled (UnsampleableRowError) gets tokenId -1 and the error as `failure`; the others are
   * sampled as if it were not there.
   */
  sampleBatch(logits: Float32Array, sequences: readonly (SequenceSampler | undefined)[]): (SampledToken | undefined)[] {
    const v = this.vocabSize;
    if (logits.length < sequences.length * v) {
      throw new RangeError(`logits hold ${logits.length} values; expected ${sequences.length} rows x vocabSize ${v}`);
    }
    const results: (SampledToken | undefined)[] = new Array(sequences.length).fill(undefined);
    const rowOf = (row: number) => logits.subarray(row * v, (row + 1) * v);
    const drawn = this.drawRows === undefined ? 0 : this.drawBatch(logits, sequences);
    if (this.passRowIds.length < sequences.length) {
      this.passRowIds = new Int32Array(sequences.length);
      this.passNumTops = new Int32Array(sequences.length);
    }
    let passRows = 0;
    for (let row = 0; row < sequences.length; row++) {
      const sequence = sequences[row];
      if (sequence === undefined) continue;
      const tokenId = drawn > 0 ? this.drawnTokens[row]! : -1;
      const inPass = this.logprobsInPass(sequence);
      if (tokenId >= 0) {
        sequence.recordOutputToken(tokenId);
        results[row] = { tokenId };
      } else {
        try {
          results[row] = this.sampleRowWith(rowOf(row), sequence, !inPass);
        } catch (error) {
          if (!(error instanceof UnsampleableRowError)) throw error;
          results[row] = { tokenId: -1, failure: error };
          continue;
        }
      }
      if (inPass) {
        this.passRowIds[passRows] = row;
        this.passNumTops[passRows] = sequence.params.logprobs!;
        passRows++;
      }
    }
    if (passRows > 0) this.logprobsOfRows(logits, results, passRows);
    return results;
  }

  /** Whether sampleBatch leaves this sequence's row to the backend's drawRows (greedy rows too: their argmax). */
  private drawsInBatch(sequence: SequenceSampler): boolean {
    return (sequence.params.logprobs === null || this.logprobsInPass(sequence)) && !sequence.hasLogitProcessors;
  }

  /** Whether sampleBatch takes this sequence's logprobs from the backend's prompt-logprob pass. */
  private logprobsInPass(sequence: SequenceSampler): boolean {
    return sequence.params.logprobs !== null && this.logprobsMode === 'raw' && this.promptRows !== undefined;
  }

  /**
   * The logprobs entries of sampleBatch's first `count` pass rows (passRowIds, passNumTops) for the tokens already in
   * results: one call of the backend's pass, each row's chosen token its target, as promptLogprobRows without the
   * rank (sampleRow gives none). A row the pass declines (a NaN, nothing above -Infinity) goes to logprobsOf.
   */
  private logprobsOfRows(logits: Float32Array, results: (SampledToken | undefined)[], count: number): void {
    const v = this.vocabSize;
    let numBest = 0;
    for (let i = 0; i < count; i++) {
      const numTop = Math.min(v, this.passNumTops[i]!);
      if (numTop <= PROMPT_ROWS_MAX_BEST) numBest = Math.max(numBest, numTop);
    }
    if (this.promptRowTargets.length < count) {
      this.promptRowTargets = new Int32Array(count);
      this.promptRowResults = new Float64Array(3 * count);
    }
    if (this.promptRowBest.length < count * numBest) this.promptRowBest = new Int32Array(count * numBest);
    const targets = this.promptRowTargets;
    for (let i = 0; i < count; i++) targets[i] = results[this.passRowIds[i]!]!.tokenId;
    const out = this.promptRowResults;
    const best = this.promptRowBest;
    this.promptRows!(logits, count, targets, out, best, numBest, this.passRowIds.subarray(0, count));
    this.plainWeighed = null;
    for (let i = 0; i < count; i++) {
      const rowId = this.passRowIds[i]!;
      const row = logits.subarray(rowId * v, (rowId + 1) * v);
      const result = results[rowId]!;
      const numTop = this.passNumTops[i]!;
      const maxId = out[3 * i]!;
      if (maxId < 0) {
        result.logprobs = this.logprobsOf(row, result.tokenId, numTop);
        continue;
      }
      // Each row takes the first of the most asked (the pass's best ids), unless it asked more than the pass gives.
      const ids = Math.min(v, numTop) <= numBest ? Array.from(best.subarray(i * numBest, i * numBest + Math.min(v, numTop))) : undefined;
      result.logprobs = this.logprobEntry(row, result.tokenId, numTop, maxId, row[maxId]! + Math.log(out[3 * i + 1]!), ids);
    }
  }

  /**
   * The backend's draws for sampleBatch: drawnTokens[row] = the token, or -1 for a row it did not draw (not eligible,
   * or a NaN / nothing above -Infinity, which sampleRow then reports). Returns how many rows were eligible.
   */
  private drawBatch(logits: Float32Array, sequences: readonly (SequenceSampler | undefined)[]): number {
    if (this.drawnTokens.length < sequences.length) {
      this.drawnTokens = new Int32Array(sequences.length);
      this.drawRowIds = new Int32Array(sequences.length);
      this.drawSpecs = new Float64Array(sequences.length * DRAW_SPEC_WORDS);
      this.drawOut = new Int32Array(sequences.length);
    }
    this.drawnTokens.fill(-1);
    let count = 0;
    for (let row = 0; row < sequences.length; row++) {
      const sequence = sequences[row];
      if (sequence === undefined || !this.drawsInBatch(sequence)) continue;
      if (sequence.vocabSize !== this.vocabSize) {
        throw new RangeError(`sequence was set up for vocabSize ${sequence.vocabSize}; this sampler has ${this.vocabSize}`);
      }
      const { temperature, minP, topP, topK } = sequence.params;
      const spec = count * DRAW_SPEC_WORDS;
      this.drawRowIds[count] = row;
      if (temperature < GREEDY_TEMPERATURE) {
        // The argmax, as sampleRow takes it: no uniform drawn, truncation irrelevant.
        this.drawSpecs.set(GREEDY_DRAW_SPEC, spec);
      } else {
        this.drawSpecs[spec] = temperature !== 1 ? 1 / temperature : 1;
        this.drawSpecs[spec + 1] = minP > 0 ? Math.log(minP) : -Infinity;
        this.drawSpecs[spec + 2] = topP;
        this.drawSpecs[spec + 3] = sequence.nextUniform();
        this.drawSpecs[spec + 4] = topK > 0 && topK < this.vocabSize ? topK : 0;
      }
      count++;
    }
    if (count === 0) return 0;
    const out = this.drawOut.subarray(0, count);
    this.drawRows!(logits.subarray(0, sequences.length * this.vocabSize), this.drawRowIds.subarray(0, count),
      this.drawSpecs.subarray(0, count * DRAW_SPEC_WORDS), out);
    for (let i = 0; i < count; i++) this.drawnTokens[this.drawRowIds[i]!] = out[i]!;
    return count;
  }

  /**
   * Samples one token from one row of raw logits, records it in the sequence and returns it, with the logprobs the
   * request asked for unless `withLogprobs` is false (the token is the same either way). The row is not modified.
   */
  sampleRow(row: Float32Array, sequence: SequenceSampler, withLogprobs = true): SampledToken {
    return this.sampleRowWith(row, sequence, withLogprobs);
  }

  /** sampleRow, with the logprobs the request asked for or (withLogprobs false: sampleBatch's pass gives them) none. */
  private sampleRowWith(row: Float32Array, sequence: SequenceSampler, withLogprobs: boolean): SampledToken {
    if (row.length !== this.vocabSize) throw new RangeError(`logits row has ${row.length} values; vocabSize is ${this.vocabSize}`);
    if (sequence.vocabSize !== this.vocabSize) {
      throw new RangeError(`sequence was set up for vocabSize ${sequence.vocabSize}; this sampler has ${this.vocabSize}`);
    }
    this.plainWeighed = null;
    const { temperature, topK, minP } = sequence.params;
    const numTop = withLogprobs ? sequence.params.logprobs : null;
    const greedy = temperature < GREEDY_TEMPERATURE;
    const scale = !greedy && temperature !== 1;
    // top_k alone ranks the raw values (scaling by 1/T keeps the order) and scales only the k it keeps; a draw over
    // the whole row (min_p at most) leaves the scaling to the backend's weighing pass, where there is one.
    const topKOnly = !greedy && topK > 0 && topK < this.vocabSize && minP === 0;
    const untruncated = !greedy && !(topK > 0 && topK < this.vocabSize) && sequence.params.topP >= 1;
    const scaleLater = topKOnly || (untruncated && this.scaleInPass);
    // The row itself when nothing changes it; else one copy, processed and scaled in scratch.
    let values = row;
    let pendingScale = 1;
    if (sequence.hasLogitProcessors || (numTop !== null && this.logprobsMode === 'processed') || (scale && !scaleLater)) {
      values = this.logits;
      if (sequence.hasLogitProcessors) {
        values.set(row);
        sequence.applyLogitProcessors(values);
        if (scale) this.scaleRow(values, values, 1 / temperature);
      } else if (scale) {
        this.scaleRow(row, values, 1 / temperature);
      } else {
        values.set(row);
      }
    } else if (scale) {
      pendingScale = 1 / temperature;
    }
    const tokenId = greedy ? this.argmax(values)
      : topKOnly ? this.drawTopK(values, pendingScale, sequence)
        : untruncated ? this.drawPlain(values, pendingScale, sequence) : this.drawTruncated(values, sequence);
    sequence.recordOutputToken(tokenId);
    if (numTop === null) return { tokenId };
    const source = this.logprobsMode === 'raw' ? row : values;
    return { tokenId, logprobs: this.logprobsOf(source, tokenId, numTop) };
  }

  // ---- an untruncated row drawn from more than once (guided rows)

  /**
   * Weighs a row for plain sampling (temperature > 0, no top-k/top-p/min-p) as sampleRow draws from it: processed,
   * scaled by 1/T, each token's weight exp(value - max) into `weights` and the running totals of its blocks (see
   * weighCandidates). Returns the total weight. drawWeighed then gives, for a uniform, the token sampleRow's draw
   * gives for it; so the first draw from a weighed row is sampleRow's, and further draws cost a binary search each.
   * Nothing is recorded in the sequence. The weights stay valid until the next call on this Sampler.
   */
  weighRow(row: Float32Array, sequence: SequenceSampler): number {
    if (row.length !== this.vocabSize) throw new RangeError(`logits row has ${row.length} values; vocabSize is ${this.vocabSize}`);
    const { params } = sequence;
    if (params.temperature < GREEDY_TEMPERATURE || (params.topK > 0 && params.topK < this.vocabSize) || params.topP < 1 || params.minP !== 0) {
      throw new RangeError('weighRow is for plain sampling (temperature > 0, no top-k, top-p or min-p)');
    }
    let values = row;
    let scale = params.temperature !== 1 ? 1 / params.temperature : 1;
    if (sequence.hasLogitProcessors) {
      values = this.logits;
      values.set(row);
      sequence.applyLogitProcessors(values);
      if (scale !== 1) this.scaleRow(values, values, scale);
      scale = 1;
    } else if (scale !== 1 && !this.scaleInPass) {
      values = this.logits;
      this.scaleRow(row, values, scale);
      scale = 1;
    }
    // Throws as sampleRow does on a NaN or a row of -Infinity only. (Scaling keeps the order: the scaled max is the
    // max scaled.)
    const max = Math.fround(values[this.argmax(values)]! * scale);
    const total = this.weigh(values, scale, max, -Infinity, this.weights, this.blockTotals, null, null, this.lastOut);
    this.lastWeighed = this.lastOut[0]!;
    return total;
  }

  /**
   * The token of weighRow's row for a uniform draw in [0, 1): the first block whose running total exceeds
   * uniform x total (a binary search), then in it the first id whose running sum from the blocks before exceeds it
   * (its last weighed id if rounding leaves none there); the last weighed id of the row when none does.
   */
  drawWeighed(total: number, uniform: number): number {
    const { blockTotals, weights } = this;
    const target = uniform * total;
    const last = this.lastWeighed;
    let lo = 0;
    let hi = Math.floor(last / WEIGH_BLOCK);
    if (!(blockTotals[hi]! > target)) return last;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (blockTotals[mid]! > target) hi = mid;
      else lo = mid + 1;
    }
    let running = lo > 0 ? blockTotals[lo - 1]! : 0;
    const start = lo * WEIGH_BLOCK;
    let lastInBlock = start;
    for (let i = start; i < Math.min(start + WEIGH_BLOCK, weights.length); i++) {
      const weight = weights[i]!;
      if (weight === 0) continue;
      running += weight;
      lastInBlock = i;
      if (running > target) return i;
    }
    return lastInBlock;
  }

  /** weighRow's weights (read-only to callers). */
  get rowWeights(): Float64Array {
    return this.weights;
  }

  // ---- random sampling with min_p / top_k / top_p

  /**
   * A draw over the whole row, min_p at most: no ranking, drawWeighed's search over the running totals. `scale` as
   * drawTopK's: the weighing pass reads each value scaled.
   */
  private drawPlain(values: Float32Array, scale: number, sequence: SequenceSampler): number {
    // Scaling keeps the order: the scaled max is the max scaled.
    const max = Math.fround(values[this.argmax(values)]! * scale);
    const { minP } = sequence.params;
    // min_p keeps p >= minP * pMax, i.e. logit >= max + ln(minP) on the temperature-scaled logits.
    const floor = minP > 0 ? max + Math.log(minP) : -Infinity;
    const total = this.weigh(values, scale, max, floor, this.weights, this.blockTotals, null, null, this.lastOut);
    this.lastWeighed = this.lastOut[0]!;
    if (scale === 1 && floor === -Infinity) {
      this.plainWeighed = values;
      this.plainWeighedMax = max;
      this.plainWeighedTotal = total;
    }
    return this.drawWeighed(total, sequence.nextUniform());
  }

  /** top_p (and top_k with min_p) over the scaled values. */
  private drawTruncated(logits: Float32Array, sequence: SequenceSampler): number {
    const { weights, order } = this;
    const v = logits.length;
    const maxId = this.argmax(logits);
    const max = logits[maxId]!;
    const { minP, topP } = sequence.params;
    // min_p keeps p >= minP * pMax, i.e. logit >= max + ln(minP) on the temperature-scaled logits.
    const floor = minP > 0 ? max + Math.log(minP) : -Infinity;
    const topK = sequence.params.topK > 0 ? Math.min(sequence.params.topK, v) : v;

    if (topK === v) {
      // top_p (after min_p) over the whole vocabulary.
      const numKept = selectTopP(logits, max, floor, topP, weights, order, this.binMass, this.binCount, this.weigh);
      if (numKept === 0) {
        // Only when the weights are NaN, from a +Infinity logit: its first +Infinity token, where the softmax's mass
        // goes. The uniform is used up as a draw would (native/sample_draw.cc draws the same).
        sequence.nextUniform();
        return maxId;
      }
      return this.drawFromKept(numKept, this.keptMass(numKept), sequence);
    }
    // top_k with min_p (top_k alone goes to drawTopK): only the k best can be drawn, so rank first, weigh just them.
    const numKept = heapSelectTop(logits, order, topK, floor);
    for (let j = 0; j < numKept; j++) {
      const id = order[j]!;
      weights[id] = expGap(logits[id]! - max);
    }
    return this.drawTopP(logits, numKept, sequence);
  }

  /**
   * top_k (then top_p) without min_p: one heap pass ranks the values as given, the max is the best kept one, and
   * only the k kept are scaled by `scale` (1/T when `values` is not yet scaled, else 1) and weighed. Each scaled
   * value is rounded to float32 exactly as a scaled copy of the row would hold it. (Two raw values that round to one
   * scaled value rank by value here rather than by id: the same weights, the finer order.)
   */
  private drawTopK(values: Float32Array, scale: number, sequence: SequenceSampler): number {
    const { weights, order } = this;
    const numKept = heapSelectTop(values, order, sequence.params.topK, -Infinity);
    if (numKept === 0) everyTokenMasked();
    let best = -Infinity;
    for (let j = 0; j < numKept; j++) best = Math.max(best, values[order[j]!]!);
    const max = Math.fround(best * scale);
    for (let j = 0; j < numKept; j++) {
      const id = order[j]!;
      weights[id] = expGap(Math.fround(values[id]! * scale) - max);
    }
    return this.drawTopP(values, numKept, sequence);
  }

  /**
   * top_p over the weighed order[0, numKept) (its share of their mass, after top_k / min_p cut them), then one draw.
   * `values` ranks ties as selectTopByMass expects.
   */
  private drawTopP(values: Float32Array, numKept: number, sequence: SequenceSampler): number {
    let kept = numKept;
    let keptMass = this.keptMass(kept);
    const { topP } = sequence.params;
    if (topP < 1) {
      kept = selectTopByMass(values, this.weights, this.order, kept, topP * keptMass);
      keptMass = this.keptMass(kept);
    }
    return this.drawFromKept(kept, keptMass, sequence);
  }

  /** The weight of order[0, numKept). */
  private keptMass(numKept: number): number {
    const { weights, order } = this;
    let mass = 0;
    for (let j = 0; j < numKept; j++) mass += weights[order[j]!]!;
    return mass;
  }

  /** One draw over order[0, numKept) by weight. The kept ids are in no particular order; any fixed order gives the same distribution. */
  private drawFromKept(numKept: number, keptMass: number, sequence: SequenceSampler): number {
    const { weights, order } = this;
    const target = sequence.nextUniform() * keptMass;
    let cumulative = 0;
    for (let j = 0; j < numKept; j++) {
      cumulative += weights[order[j]!]!;
      if (cumulative > target) return order[j]!;
    }
    return order[numKept - 1]!;
  }

  // ---- logprobs

  /**
   * For a row whose token another path chooses (a guided row, sampleGuidedRow): the row sampleRow would take its
   * logprobs from had it been given `row` with `mask` applied (the grammar's mask), in a buffer of the Sampler's own
   * that no draw writes. For raw logprobs the masked row itself; for processed ones that row processed as sampleRow
   * processes it (logit processors, then 1/T unless greedy). Call it before the token is recorded (the processors read
   * the sequence's output so far); tokenLogprobs then gives the chosen token's entry. Nothing is recorded and no
   * uniform drawn, so the token chosen does not depend on whether logprobs are asked for. `holdStops` false: processed
   * without min_tokens' hold on the stop ids (SequenceSampler.applyLogitProcessors).
   */
  logprobsRow(row: Float32Array, sequence: SequenceSampler, mask: (values: Float32Array) => void, holdStops = true): Float32Array {
    if (row.length !== this.vocabSize) throw new RangeError(`logits row has ${row.length} values; vocabSize is ${this.vocabSize}`);
    const values = this.logprobsValues ??= new Float32Array(this.vocabSize);
    // A weighing kept for reuse may be of this buffer's former values.
    this.plainWeighed = null;
    values.set(row);
    mask(values);
    if (this.logprobsMode === 'processed') {
      if (sequence.hasLogitProcessors) sequence.applyLogitProcessors(values, holdStops);
      const { temperature } = sequence.params;
      if (temperature >= GREEDY_TEMPERATURE && temperature !== 1) this.scaleRow(values, values, 1 / temperature);
    }
    return values;
  }

  /**
   * The logprobs entry of `tokenId` under `source` (a row logprobsRow gave) with its numTop best: what sampleRow gives
   * for the token it drew from that row. Nothing is recorded.
   */
  tokenLogprobs(source: Float32Array, tokenId: number, numTop: number): TokenLogprob {
    if (source.length !== this.vocabSize) throw new RangeError(`logits row has ${source.length} values; vocabSize is ${this.vocabSize}`);
    return this.logprobsOf(source, tokenId, numTop);
  }

  /**
   * A prompt token's logprob from the raw logits row of the position before it, the numTop best, and its rank (1 +
   * the tokens with a greater logit, as vLLM counts it). Nothing is recorded anywhere.
   */
  promptLogprob(row: Float32Array, tokenId: number, numTop: number): TokenLogprob {
    if (row.length !== this.vocabSize) throw new RangeError(`logits row has ${row.length} values; vocabSize is ${this.vocabSize}`);
    this.plainWeighed = null;
    const entry = this.logprobsOf(row, tokenId, numTop);
    entry.rank = countAbove(row, row[tokenId]!) + 1;
    return entry;
  }

  /**
   * promptLogprob for rows [0, targets.length) of `logits` (row r's prompt token targets[r], numTops[r] best), the
   * same entries bit for bit: with the backend's pass the rows' max, normaliser, rank and best ids (up to
   * PROMPT_ROWS_MAX_BEST; each row takes the first numTops[r] of the most asked) come from one call that may spread
   * them over the backend's threads; a row it declines (a NaN, nothing above -Infinity) goes to promptLogprob, which
   * reports it.
   */
  promptLogprobRows(logits: Float32Array, targets: readonly number[], numTops: readonly number[]): TokenLogprob[] {
    const v = this.vocabSize;
    const rows = targets.length;
    if (logits.length < rows * v) throw new RangeError(`logits hold ${logits.length} values; ${rows} rows of ${v} need ${rows * v}`);
    const rowAt = (r: number): Float32Array => logits.subarray(r * v, (r + 1) * v);
    const pass = this.promptRows;
    if (pass === undefined) return targets.map((tokenId, r) => this.promptLogprob(rowAt(r), tokenId, numTops[r]!));
    const mostAsked = Math.min(v, numTops.reduce((most, n) => Math.max(most, n), 0));
    const numBest = mostAsked <= PROMPT_ROWS_MAX_BEST ? mostAsked : 0;
    if (this.promptRowTargets.length < rows) {
      this.promptRowTargets = new Int32Array(rows);
      this.promptRowResults = new Float64Array(3 * rows);
    }
    if (this.promptRowBest.length < rows * numBest) this.promptRowBest = new Int32Array(rows * numBest);
    const results = this.promptRowResults;
    const best = this.promptRowBest;
    this.promptRowTargets.set(targets);
    pass(logits, rows, this.promptRowTargets, results, best, numBest);
    this.plainWeighed = null;
    return targets.map((tokenId, r) => {
      const row = rowAt(r);
      const maxId = results[3 * r]!;
      if (maxId < 0) return this.promptLogprob(row, tokenId, numTops[r]!);
      const ids = numBest > 0 ? Array.from(best.subarray(r * numBest, r * numBest + Math.min(numTops[r]!, v))) : undefined;
      const entry = this.logprobEntry(row, tokenId, numTops[r]!, maxId, row[maxId]! + Math.log(results[3 * r + 1]!), ids);
      entry.rank = results[3 * r + 2]! + 1;
      return entry;
    });
  }

  /**
   * The chosen token's log-probability under `source` and the numTop best. The normaliser, log sum exp(value), is the
   * max plus the log of the weighing pass's total (the backend's where there is one: a row's exp is most of the cost),
   * taken from the draw when it weighed this same row so (plainWeighed: the same pass on the same values, so the same
   * bits). After the draw, so the weights a new pass overwrites are spent.
   */
  private logprobsOf(source: Float32Array, tokenId: number, numTop: number): TokenLogprob {
    const reuse = this.plainWeighed === source;
    const maxId = reuse ? -1 : this.argmax(source);
    const max = reuse ? this.plainWeighedMax : source[maxId]!;
    const total = reuse ? this.plainWeighedTotal : this.weigh(source, 1, max, -Infinity, this.weights, null, null, null, this.lastOut);
    return this.logprobEntry(source, tokenId, numTop, maxId, max + Math.log(total));
  }

  /**
   * A logprobs entry from the row's normaliser; maxId, the row's argmax, or -1 when it is not at hand; bestAtHand,
   * the numTop best ids when the backend gave them.
   */
  private logprobEntry(source: Float32Array, tokenId: number, numTop: number, maxId: number, logNormaliser: number,
    bestAtHand?: number[]): TokenLogprob {
    // The one best is the argmax (bestIds' tie rule too: the lowest id), at hand or one pass of the backend's.
    const ids = bestAtHand ?? (numTop === 1 ? [maxId >= 0 ? maxId : this.argmax(source)] : bestIds(source, numTop, this.order));
    const top = ids.map((id) => ({ tokenId: id, logprob: source[id]! - logNormaliser }));
    return { tokenId, logprob: source[tokenId]! - logNormaliser, top };
  }
}

// ---- row passes

/**
 * The weighing pass over a row, given its max and a floor. Each value is read at `scale`: as Math.fround(value *
 * scale), what a scaled copy of the row holds (1 / temperature, without making the copy; at 1, the value itself);
 * max and floor are on that scale. weights[i] = expGap(value - max) for the candidates (value >= floor, above
 * -Infinity) and 0 for the others. The total sums them by blocks of WEIGH_BLOCK ids: each block's eight weights in
 * a fixed tree, ((w0 + w1) + (w2 + w3)) + ((w4 + w5) + (w6 + w7)) (ids past the row's end as 0), the blocks in id
 * order; blockTotals, when given, gets the running total after each block (what a draw searches). Returns the total
 * and puts the last id with a weight other than 0 (0 when none) into last[0]. binMass and binCount, when given, are
 * zeroed, then get each candidate's weight and count added into its top_p bin (massBin), in id order.
 * native/sample_weigh.h is the same pass, bit for bit. (The tree lets SIMD code sum a block in its registers: a
 * running total in id order is one long chain of additions, which cost the native pass half its time.)
 */
export type WeighCandidates = (values: Float32Array, scale: number, max: number, floor: number, weights: Float64Array,
  blockTotals: Float64Array | null, binMass: Float64Array | null, binCount: Int32Array | null, last: Int32Array) => number;

/** Ids per block of weighCandidates' running total. */
export const WEIGH_BLOCK = 8;

export const weighCandidates: WeighCandidates = (values, scale, max, floor, weights, blockTotals, binMass, binCount, last) => {
  if (binMass !== null) {
    binMass.fill(0);
    binCount!.fill(0);
  }
  const n = values.length;
  let lastId = 0;
  for (let i = 0; i < n; i++) {
    const value = scale === 1 ? values[i]! : Math.fround(values[i]! * scale);
    const candidate = value >= floor && value > -Infinity;
    const weight = candidate ? expGap(value - max) : 0;
    weights[i] = weight;
    if (weight !== 0) lastId = i;
    if (binMass !== null && candidate) {
      const bin = massBin(max - value);
      binMass[bin]! += weight; // massBin returns an index in [0, MASS_BINS)
      binCount![bin]!++;
    }
  }
  let total = 0;
  const whole = n - (n % WEIGH_BLOCK);
  for (let b = 0; b < whole; b += WEIGH_BLOCK) {
    total += ((weights[b]! + weights[b + 1]!) + (weights[b + 2]! + weights[b + 3]!))
      + ((weights[b + 4]! + weights[b + 5]!) + (weights[b + 6]! + weights[b + 7]!));
    if (blockTotals !== null) blockTotals[b / WEIGH_BLOCK] = total;
  }
  if (whole < n) {
    const w = (i: number) => (whole + i < n ? weights[whole + i]! : 0);
    total += ((w(0) + w(1)) + (w(2) + w(3))) + ((w(4) + w(5)) + (w(6) + w(7)));
    if (blockTotals !== null) blockTotals[whole / WEIGH_BLOCK] = total;
  }
  last[0] = lastId;
  return total;
};

// expGap's constants (native/sample_weigh.h has the same): ln 2 split so that k * LN2_HI is exact for |k| < 2^11,
// the Taylor coefficients 1/n!, and 2^k for k in [-1022, 1023] built from their bits.
const INV_LN2 = 1.4426950408889634;
const LN2_HI = 6.93147180369123816490e-01;
const LN2_LO = 1.90821492927058770002e-10;
const EXP_LOWEST = -708;
const EXP_HIGHEST = 709;
const C13 = 1 / 6227020800, C12 = 1 / 479001600, C11 = 1 / 39916800, C10 = 1 / 3628800, C9 = 1 / 362880;
const C8 = 1 / 40320, C7 = 1 / 5040, C6 = 1 / 720, C5 = 1 / 120, C4 = 1 / 24, C3 = 1 / 6, C2 = 1 / 2;
const POW2 = (() => {
  const table = new Float64Array(2046);
  const bits = new DataView(new ArrayBuffer(8));
  for (let k = -1022; k <= 1023; k++) {
    bits.setUint32(0, (k + 1023) << 20);
    bits.setUint32(4, 0);
    table[k + 1022] = bits.getFloat64(0);
  }
  return table;
})();

/**
 * exp(d) for a token's distance d (<= 0) below the row's max, in arithmetic that native code repeats exactly (see
 * native/sample_weigh.h): reduction d = k ln 2 + r, exp(r) by its Taylor series to r^13 (Estrin's scheme; within
 * 2 units in the last place of exp), times 2^k. 0 at or below -708 (where exp is subnormal: such a token cannot be
 * drawn beside the max's weight of 1), NaN for NaN, Infinity above 709.
 */
export function expGap(d: number): number {
  if (!(d > EXP_LOWEST)) return d !== d ? d : 0;
  if (d > EXP_HIGHEST) return Infinity;
  const k = Math.floor(d * INV_LN2 + 0.5);
  const r = (d - k * LN2_HI) - k * LN2_LO;
  const r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
  const low = ((1 + r) + (C2 + C3 * r) * r2) + ((C4 + C5 * r) + (C6 + C7 * r) * r2) * r4;
  const high = ((C8 + C9 * r) + (C10 + C11 * r) * r2) + (C12 + C13 * r) * r4;
  return (low + high * r8) * POW2[k + 1022]!;
}

/** top_p's bins: 1/8 logit wide, 64 logits deep (below that, weights are under e^-64 and share the last bin). */
const MASS_BINS_PER_LOGIT = 8;
export const MASS_BINS = 64 * MASS_BINS_PER_LOGIT;

/** The bin of a token `gap` (>= 0) below the max: monotonic, so a nearer bin never holds a lower-ranked token. */
function massBin(gap: number): number {
  const scaled = gap * MASS_BINS_PER_LOGIT;
  return scaled < MASS_BINS - 1 ? scaled | 0 : MASS_BINS - 1;
}

/** The sampler's scaled copy of a row: out[i] = row[i] * factor, rounded to float32 as the scaled logits are stored. */
export const scaleRow: ScaleRow = (row, out, factor) => {
  for (let i = 0; i < row.length; i++) out[i] = row[i]! * factor;
};

/**
 * How many values are greater than `value` (NaN never is). Four counters adding comparisons as numbers: a branch per
 * value mispredicts on a logits row (three times slower here).
 */
export function countAbove(values: Float32Array, value: number): number {
  const n = values.length;
  const whole = n - (n % 4);
  let a = 0, b = 0, c = 0, d = 0;
  let i = 0;
  for (; i < whole; i += 4) {
    a += +(values[i]! > value);
    b += +(values[i + 1]! > value);
    c += +(values[i + 2]! > value);
    d += +(values[i + 3]! > value);
  }
  for (; i < n; i++) a += +(values[i]! > value);
  return a + b + c + d;
}

/**
 * The id of the largest value, ties to the lowest id. Four lanes (ids i, i+1, i+2, i+3) each keep their own first
 * maximum, so consecutive comparisons do not wait on each other; the lanes are merged by value, then by id. A NaN
 * fails every `<=`, so it always takes the rarely taken branch that moves a lane's maximum, and is caught there.
 */
export function argmax(values: Float32Array): number {
  const n = values.length;
  let best0 = -Infinity, best1 = -Infinity, best2 = -Infinity, best3 = -Infinity;
  let id0 = -1, id1 = -1, id2 = -1, id3 = -1;
  let i = 0;
  for (; i + 3 < n; i += 4) {
    const v0 = values[i]!, v1 = values[i + 1]!, v2 = values[i + 2]!, v3 = values[i + 3]!;
    if (!(v0 <= best0)) { if (v0 !== v0) nanAt(i); best0 = v0; id0 = i; }
    if (!(v1 <= best1)) { if (v1 !== v1) nanAt(i + 1); best1 = v1; id1 = i + 1; }
    if (!(v2 <= best2)) { if (v2 !== v2) nanAt(i + 2); best2 = v2; id2 = i + 2; }
    if (!(v3 <= best3)) { if (v3 !== v3) nanAt(i + 3); best3 = v3; id3 = i + 3; }
  }
  for (; i < n; i++) {
    const value = values[i]!;
    if (!(value <= best0)) { if (value !== value) nanAt(i); best0 = value; id0 = i; }
  }
  let best = id0;
  let bestValue = best0;
  if (best1 > bestValue || (best1 === bestValue && id1 >= 0 && (best < 0 || id1 < best))) { best = id1; bestValue = best1; }
  if (best2 > bestValue || (best2 === bestValue && id2 >= 0 && (best < 0 || id2 < best))) { best = id2; bestValue = best2; }
  if (best3 > bestValue || (best3 === bestValue && id3 >= 0 && (best < 0 || id3 < best))) { best = id3; bestValue = best3; }
  if (bestValue === -Infinity || best < 0) everyTokenMasked();
  return best;
}

function nanAt(id: number): never {
  throw new UnsampleableRowError('nan', `logits row holds NaN at token id ${id}`);
}

/**
 * Puts the k best ids whose value is at least `floor` and above -Infinity into order[0, count), and every other id
 * whose value equals the k-th best's after them (top_k keeps all the ids tied with its k-th, as vLLM and Hugging
 * Face mask only the values below it), and returns count (k or more; fewer when fewer ids qualify). One pass with a
 * k-sized min-heap (worst kept id at the root): a token below the root costs one comparison, which after the first
 * few thousand tokens is nearly all of them. Ranking as ranksBefore: higher value first, lower id on ties (ids
 * arrive in increasing order, so an equal value never displaces a kept one), so the heap holds the k first by that
 * order and the ties left out are the ids after its root (the last kept of the k-th value). order[0, k) is the heap's layout and
 * the ties follow in id order: the native draw (native/sample_draw.cc) lays them out the same, so a draw over them
 * picks the same id.
 */
export function heapSelectTop(values: Float32Array, order: Int32Array, k: number, floor: number): number {
  const n = values.length;
  let size = 0;
  let id = 0;
  // Filling: every candidate goes in, rising above the kept ids that rank before it so the worst stays at the root.
  for (; id < n && size < k; id++) {
    const value = values[id]!;
    if (!(value >= floor) || value === -Infinity) {
      if (value !== value) nanAt(id);
      continue;
    }
    let at = size++;
    while (at > 0) {
      const parent = (at - 1) >> 1;
      if (!ranksBefore(values, order[parent]!, id)) break;
      order[at] = order[parent]!;
      at = parent;
    }
    order[at] = id;
  }
  if (size < k) return size;
  // Full: only a value above the root's gets in (it is then >= floor too), replacing the root. A NaN fails `<`
  // and is caught on that same rarely taken branch, and so is a value equal to the root's. The best value left
  // out (a tie with the root, or a root replaced) is never above the root, which only rises: the two are equal at
  // the end exactly when an id tied with the k-th was left out.
  let rootValue = values[order[0]!]!;
  let bestLeftOut = -Infinity;
  for (; id < n; id++) {
    const value = values[id]!;
    if (!(value < rootValue)) {
      if (value !== value) nanAt(id);
      if (value === rootValue) {
        bestLeftOut = value;
        continue;
      }
      siftDown(values, order, size, id);
      if (rootValue > bestLeftOut) bestLeftOut = rootValue;
      rootValue = values[order[0]!]!;
    }
  }
  if (bestLeftOut !== rootValue) return size;
  // The ties left out: every id of the k-th value after the root, the last kept of that value.
  for (let tie = order[0]! + 1; tie < n; tie++) if (values[tie] === rootValue) order[size++] = tie;
  return size;
}

/** Replaces the heap's root (its worst id) with `id` and restores the heap order over order[0, size). */
function siftDown(values: Float32Array, order: Int32Array, size: number, id: number): void {
  let at = 0;
  for (;;) {
    const left = 2 * at + 1;
    if (left >= size) break;
    const right = left + 1;
    // The worse-ranked child moves up.
    const worse = right < size && ranksBefore(values, order[left]!, order[right]!) ? right : left;
    if (!ranksBefore(values, id, order[worse]!)) break;
    order[at] = order[worse]!;
    at = worse;
  }
  order[at] = id;
}

// ---- selection: rank only as much as the filters need

/**
 * top_p over a whole row: weighs every candidate (value >= floor, above -Infinity) into weights[id] =
 * exp(value - max), and puts into order[0, count) the smallest best-first set whose weight reaches topP of the
 * total, returning count. The weighing pass also adds each weight into a bin by the token's distance below the max
 * (MASS_BINS_PER_LOGIT bins per logit): every token of a nearer bin ranks before every token of a farther one, so
 * whole bins are kept until the one where the mass is reached, and only that bin's tokens are ranked
 * (selectTopByMass), not the whole row. binMass and binCount are scratch of MASS_BINS entries.
 */
export function selectTopP(values: Float32Array, max: number, floor: number, topP: number, weights: Float64Array,
  order: Int32Array, binMass: Float64Array, binCount: Int32Array, weigh: WeighCandidates = weighCandidates): number {
  const v = values.length;
  const total = weigh(values, 1, max, floor, weights, null, binMass, binCount, lastScratch);
  const target = topP * total;
  let boundary = 0;
  let massBefore = 0;
  let countBefore = 0;
  // Bins summed in another order than `total` may fall an ulp short of the target: then the last bin is the boundary.
  while (boundary < MASS_BINS - 1 && massBefore + binMass[boundary]! < target) {
    massBefore += binMass[boundary]!;
    countBefore += binCount[boundary]!;
    boundary++;
  }
  // The boundary bin's ids first (to be ranked), then those of the nearer bins, kept whole. Most tokens lie beyond
  // the boundary: a comparison with a value half a bin below it rules them out before their bin is computed.
  const boundaryCount = binCount[boundary]!;
  const lowest = Math.max(floor, boundary === MASS_BINS - 1 ? -Infinity : max - (boundary + 1.5) / MASS_BINS_PER_LOGIT);
  let atBoundary = 0;
  let atBefore = boundaryCount;
  for (let i = 0; i < v; i++) {
    const value = values[i]!;
    if (value >= lowest && value > -Infinity) {
      const bin = massBin(max - value);
      if (bin < boundary) order[atBefore++] = i;
      else if (bin === boundary) order[atBoundary++] = i;
    }
  }
  const keptAtBoundary = boundaryCount === 0 ? 0 : selectTopByMass(values, weights, order, boundaryCount, target - massBefore);
  order.copyWithin(keptAtBoundary, boundaryCount, boundaryCount + countBefore);
  return keptAtBoundary + countBefore;
}

/** weighCandidates' last id where a caller has no use for it. */
const lastScratch = new Int32Array(1);

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
 * Hoare partition of order[lo, hi] around a median-of-three pivot. Leaves [j, i] in `partitionBounds` (a tuple
 * per call would be an allocation per partition) with j < i: order[lo, j] ranks before order[j+1, i-1] (the pivot,
 * or nothing), which ranks before order[i, hi].
 */
const partitionBounds = new Int32Array(2);

function partition(values: Float32Array, order: Int32Array, lo: number, hi: number): void {
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
  partitionBounds[0] = j;
  partitionBounds[1] = i;
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
    partition(values, order, lo, hi);
    const j = partitionBounds[0]!;
    const i = partitionBounds[1]!;
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
    partition(values, order, lo, hi);
    const j = partitionBounds[0]!;
    const i = partitionBounds[1]!;
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
  const length = values.length;
  let id = 0;
  for (; id < length && best.length < n; id++) {
    let at = best.length;
    while (at > 0 && ranksBefore(values, id, best[at - 1]!)) {
      best[at] = best[at - 1]!;
      at--;
    }
    best[at] = id;
  }
  if (best.length < n) return best;
  // Full: every kept id is below `id`, so `id` ranks before one only with a higher value. Nearly every token fails
  // that one comparison against the worst kept value.
  let worst = values[best[n - 1]!]!;
  for (; id < length; id++) {
    const value = values[id]!;
    if (!(value > worst)) continue;
    let at = n - 1;
    while (at > 0 && value > values[best[at - 1]!]!) {
      best[at] = best[at - 1]!;
      at--;
    }
    best[at] = id;
    worst = values[best[n - 1]!]!;
  }
  return best;
}
