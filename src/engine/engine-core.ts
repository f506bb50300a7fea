// One worker's engine, synchronous: each `step()` is schedule -> build the batch -> one forward -> sample every row
// -> update the scheduler -> detokenize and check stop strings. No threads, no I/O, time comes from the clock given
// at construction; src/engine/worker-main.ts runs it in a worker thread and src/engine/local-engine.ts is the
// async face the gateway sees.

import { NATIVE_ALLOCATION_FAILED, type ModelRunnerBackend } from '../kernels/types.ts';
import type { EngineStats } from '../protocols/worker.ts';
import { uniformWindow } from '../model/config.ts';
import type { Tokenizer } from '../model/tokenizer/types.ts';
import { BatchBuilder } from './batch-builder.ts';
import { IncrementalDetokenizer } from './detokenizer.ts';
import {
  checkKvLayoutsMatch, copyKvBlocks, KV_IN_PLACE_SOURCE, kvBlockBytes, readKvBlocks, transferStats, writeKvBlocks,
  type AdoptedResult, type KvHandoff, type KvPoolView, type KvTransferPlan,
} from './handoff.ts';
import type { BlockTable } from './kv-cache/manager.ts';
import type { KvBlockIo, KvTiers } from './kv-cache/tiers.ts';
import { drawRandomSeed } from '../util/random.ts';
import { GrammarError, type GrammarRuntime, type GuidedSequence } from './grammar/runtime.ts';
import { sampleGuidedRow } from './grammar/sampling.ts';
import { createRequestSamplers, GREEDY_TEMPERATURE, Sampler, UnsampleableRowError, type SequenceSampler } from './sampler.ts';
import { promptLogprobTargets, type StepPlan } from './scheduler.ts';
import { rowKey, StepCore, type KvImport, type TokenSource } from './step-core.ts';
import type { EngineOutput, EngineRequest, FinishReason, SchedulingPolicy, TokenLogprob } from './types.ts';
import type { LoraWeights } from '../model/lora.ts';
import { InvalidRequestError, LoraLoadError } from './errors.ts';

export interface EngineCoreOptions {
  backend: ModelRunnerBackend;
  tokenizer: Tokenizer;
  maxNumSeqs: number;
  maxNumBatchedTokens: number;
  /** Longest prompt + output; at most the model's context length. */
  maxModelLen: number;
  policy?: SchedulingPolicy;
  enablePrefixCaching?: boolean;
  enableKvEvents?: boolean;
  /** Longest prompt chunk one sequence gets per step (0 = no cap). */
  longPrefillTokenThreshold?: number;
  /** Prompt-logprob logits rows per step (default promptLogprobRowsFor the model's vocabulary). */
  maxPromptLogprobRows?: number;
  /** Lower KV tiers under the pool (kv-cache/tiers.ts), sized for this backend's blocks (kvBlockBytes). */
  kvTiers?: KvTiers;
  /** Engine clock in ms. */
  now: () => number;
  /**
   * The worker's grammars for guided requests (sampling.guided), once loaded; undefined before (a guided request is
   * then refused). worker-main.ts loads them before it adds the first guided request.
   */
  grammar?: () => GrammarRuntime | undefined;
  /**
   * Jump-forward decoding for guided requests without logprobs (--guided-jump-forward; default off): text the grammar
   * forces after a sampled token is appended as tokens without sampling and computed in the next step with it (see
   * GuidedSequence.forcedTokens). Those tokens are a greedy cut of the text, not what the model would pick token by
   * token, so the output then differs from token-by-token decoding (and from the same request with logprobs, which
   * it skips). Off, a guided row's token is the masked argmax or a masked draw at every position.
   */
  jumpForward?: boolean;
}

/** A prefill worker's pool as a decode worker reads it: shared memory, named for the stats. */
export interface KvSourceView extends KvPoolView {
  id: string;
  /** 'shared-memory' for a pool in this process. */
  channel: string;
}

export class EngineCore extends StepCore<SequenceSampler> {
  private readonly backend: ModelRunnerBackend;
  private readonly builder: BatchBuilder;
  private readonly sampler: Sampler;
  private readonly vocabSize: number;
  private readonly now: () => number;
  private numStepsFailed = 0;
  /** Steps whose scratch memory could not be allocated (the backend's, or the logits buffer). */
  private numScratchAllocationFailures = 0;
  private readonly eosTokenIds: readonly number[];
  /** Every step's logits, reused (the sampler is done with them before the step returns). */
  private logits = new Float32Array(0);
  /** Loaded LoRA adapters: name -> backend slot. */
  private readonly loraSlots = new Map<string, number>();

  constructor(options: EngineCoreOptions) {
    const { backend, tokenizer } = options;
    const vocabSize = backend.config.vocabSize;
    super({
      kvLayout: backend.kvLayout, enablePrefixCaching: options.enablePrefixCaching, enableKvEvents: options.enableKvEvents,
      policy: options.policy, maxNumBatchedTokens: options.maxNumBatchedTokens, maxNumSeqs: options.maxNumSeqs,
      maxModelLen: options.maxModelLen, eosTokenIds: tokenizer.stopTokenIds,
      longPrefillTokenThreshold: options.longPrefillTokenThreshold,
      maxPromptLogprobRows: options.maxPromptLogprobRows ?? promptLogprobRowsFor(vocabSize, options.maxNumBatchedTokens),
      ...(options.kvTiers !== undefined ? { kvTiers: options.kvTiers, kvBlockIo: poolBlockIo(backend.kvPool, backend.kvLayout) } : {}),
      ...(uniformWindow(backend.config) !== undefined ? { slidingWindow: uniformWindow(backend.config)! } : {}),
      tokens: samplerTokens(vocabSize, tokenizer.stopTokenIds, options.grammar ?? (() => undefined), options.jumpForward ?? false),
      text: { open: (sampling, prompt) => IncrementalDetokenizer.forRequest(tokenizer, sampling, prompt) },
    });
    this.backend = backend;
    this.now = options.now;
    this.vocabSize = vocabSize;
    this.builder = BatchBuilder.forScheduler(this.scheduler);
    // The backend's argmax, weighing pass and scaled copy where it has them (native: SIMD; the argmax 2 µs against the
    // JavaScript loop's 44 on a 32k row, the weighing of a temperature draw's whole row several times faster).
    const backendArgmax = options.backend.argmax?.bind(options.backend);
    const backendWeigh = options.backend.sampleWeigh?.bind(options.backend);
    const backendScale = options.backend.scaleRow?.bind(options.backend);
    const backendPromptRows = options.backend.promptLogprobRows?.bind(options.backend);
    // And its draws of a step's rows at once (native: each row's whole draw in C++, a quarter faster than here for a
    // 32k top_p row, and the rows shared by the pool's threads).
    const backendDrawRows = options.backend.sampleRows?.bind(options.backend);
    this.sampler = new Sampler(vocabSize, {
      ...(backendArgmax !== undefined ? { argmax: backendArgmax } : {}),
      ...(backendWeigh !== undefined ? { weigh: backendWeigh } : {}),
      ...(backendScale !== undefined ? { scale: backendScale } : {}),
      ...(backendPromptRows !== undefined ? { promptRows: backendPromptRows } : {}),
      ...(backendDrawRows !== undefined ? { drawRows: backendDrawRows } : {}),
    });
    this.eosTokenIds = tokenizer.stopTokenIds;
  }

  /**
   * Queues a request. Throws (InvalidRequestError, RangeError) with a client-fit message if it can never run.
   * With handoff (a prefill worker's request), the request stops after its first token: its KV blocks stay pinned
   * and takeHandoffs() returns what a decode worker needs to continue it (a seed is drawn when the client gave none).
   * queuedMs: when the request reached this worker's inbox, if earlier than now (it waited there behind a step).
   */
  add(engineRequest: EngineRequest, options: { handoff?: boolean; queuedMs?: number } = {}): void {
    this.checkLora(engineRequest);
    this.addRequest(engineRequest, this.now(), options);
  }

  /**
   * Loads a LoRA adapter into the backend under `name` (replacing one of that name when no request uses it). Its
   * requests (EngineRequest.lora) then run in the same steps as the base model's and other adapters'.
   */
  loadLora(name: string, weights: LoraWeights): void {
    if (!this.backend.setLora) throw new LoraLoadError('invalid_adapter', `the ${this.backend.info.name} backend runs no LoRA adapters`);
    let slot = this.loraSlots.get(name);
    if (slot !== undefined && this.usesLora(name)) throw new LoraLoadError('lora_in_use', `LoRA adapter '${name}' is in use`);
    if (slot === undefined) {
      const used = new Set(this.loraSlots.values());
      slot = 0;
      while (used.has(slot)) slot++;
    }
    this.backend.setLora(slot, weights);
    this.loraSlots.set(name, slot);
  }

  /** Unloads an adapter; refused while a request here runs with it. */
  unloadLora(name: string): void {
    const slot = this.loraSlots.get(name);
    if (slot === undefined) throw new LoraLoadError('lora_not_loaded', `no LoRA adapter '${name}' is loaded`);
    if (this.usesLora(name)) throw new LoraLoadError('lora_in_use', `LoRA adapter '${name}' is in use by running requests`);
    this.backend.setLora!(slot, null);
    this.loraSlots.delete(name);
  }

  /** Names of the loaded adapters. */
  get loras(): string[] {
    return [...this.loraSlots.keys()];
  }

  private checkLora(request: EngineRequest): void {
    if (request.lora !== undefined && !this.loraSlots.has(request.lora)) {
      throw new InvalidRequestError('lora_not_loaded', request.id, `LoRA adapter '${request.lora}' is not loaded on this worker`);
    }
  }

  /** Stops a request in any state and frees its blocks; returns the closing output of each unfinished completion. */
  abort(requestId: string, reason: FinishReason = 'abort', error?: string): EngineOutput[] {
    return this.abortRequest(requestId, this.now(), reason, error);
  }

  /** Runs one engine step; returns the outputs it produced (none when there was nothing to run). */
  step(): EngineOutput[] {
    const plan = this.planStep(this.now());
    if (plan === null) return [];
    const batch = this.builder.build(plan, this.loraSlots.size > 0 ? (name) => this.loraSlots.get(name) ?? -1 : undefined);
    const forwardStart = this.now();
    let logits: Float32Array;
    try {
      if (plan.blockCopies.length > 0) this.copyBlocks(plan);
      logits = this.backend.forward(batch, this.logitsBuffer(plan.sampleTargets.length + plan.numPromptLogprobRows));
    } catch (error) {
      this.numStepsFailed++;
      const message = error instanceof Error ? error.message : String(error);
      if (isAllocationFailure(error)) {
        // Counted (EngineStats.allocationFailures.scratch, conduit_oom_events_total); the step's requests fail with
        // their blocks given back, and the worker runs the next step with the buffers it has.
        this.numScratchAllocationFailures++;
        return this.failStep(plan, `out of memory: the step's ${plan.numScheduledTokens} tokens needed buffers that could not be allocated (${message})`,
          this.now(), 'out_of_memory');
      }
      return this.failStep(plan, `forward pass failed: ${message}`, this.now());
    }
    const sampled = this.sampleRows(plan, logits);
    const promptLogprobs = plan.numPromptLogprobRows > 0 ? this.promptLogprobRows(plan, logits, sampled.failed) : undefined;
    const end = this.now();
    // The step times the tiers' cost model prices recomputing against onboarding with: every step, decode steps too
    // (they pin down the fixed part each step pays whatever its size).
    this.kv.tiers?.observeStep(plan.numScheduledTokens, end - forwardStart, plan.stats.numPrefillTokens);
    // A request whose logits could not be sampled fails alone; the step's other requests go on (the scheduler skips a
    // finished sequence's row, whose placeholder token is never used).
    const failedOutputs: EngineOutput[] = [];
    for (const [requestId, error] of sampled.failed) {
      failedOutputs.push(...this.abortRequest(requestId, end, 'error',
        `the model's output could not be sampled: ${error.message}${error.reason === 'nan' ? ' (the forward pass overflowed, or the weights are broken)' : ''}`));
    }
    const outputs = this.applyStep(plan, sampled.tokenIds, sampled.logprobs, forwardStart, end, promptLogprobs);
    return failedOutputs.length > 0 ? [...failedOutputs, ...outputs] : outputs;
  }

  /** This worker's pool, for a decode worker to read from (shared memory). */
  get kvPoolView(): KvPoolView {
    return { pool: this.backend.kvPool, layout: this.backend.kvLayout };
  }

  /**
   * Continues a request another worker prefilled (decode side); see StepCore.adoptHandoff. With a source, the KV
   * blocks this pool lacks are copied from it; without one, or when its layout differs or the copy fails, the
   * prompt is recomputed here ('recompute').
   */
  adopt(handoff: KvHandoff, source: KvSourceView | typeof KV_IN_PLACE_SOURCE | null): AdoptedResult | null {
    try {
      this.checkLora(handoff.request);
    } catch (error) {
      this.refuseAdoption(handoff.requestId);
      throw error;
    }
    if (source === null) return this.adoptHandoff(handoff, this.now(), { recompute: 'no KV source for this prefill worker' });
    if (source === KV_IN_PLACE_SOURCE) {
      try {
        checkKvLayoutsMatch(handoff.sourceLayout, this.backend.kvLayout);
      } catch (error) {
        return this.adoptHandoff(handoff, this.now(), { recompute: (error as Error).message });
      }
      return this.adoptHandoff(handoff, this.now(), new InPlaceImport(handoff, this.kvPoolView.layout, this.now));
    }
    try {
      checkKvLayoutsMatch(source.layout, this.backend.kvLayout);
    } catch (error) {
      return this.adoptHandoff(handoff, this.now(), { recompute: (error as Error).message });
    }
    return this.adoptHandoff(handoff, this.now(), new PoolCopy(handoff, source, this.kvPoolView, this.now));
  }

  /**
   * Forgets every cached prefix and, with no block holding K/V any step reads, gives the pool's pages back to the
   * system where the backend can (the next forward writes each slot before a step reads it). False, and nothing
   * done, while any block is in use.
   */
  override resetPrefixCache(): boolean {
    if (!super.resetPrefixCache()) return false;
    this.backend.releaseKvPool?.();
    return true;
  }

  get stepsFailed(): number {
    return this.numStepsFailed;
  }

  /** The step core's stats plus this worker's memory by category and its scratch allocation failures. */
  override stats(): EngineStats {
    const stats = super.stats();
    const memory = this.backend.memory?.();
    if (memory !== undefined) {
      stats.memory = {
        weightsBytes: memory.weightsBytes, kvCacheBytes: memory.kvCacheBytes,
        activationsBytes: (memory.scratchBytes ?? 0) + this.logits.byteLength + this.builder.bytes,
        ...(memory.loraAdaptersBytes !== undefined ? { loraAdaptersBytes: memory.loraAdaptersBytes } : {}),
      };
    }
    stats.allocationFailures = { kvBlocks: stats.allocationFailures?.kvBlocks ?? 0, scratch: this.numScratchAllocationFailures };
    return stats;
  }

  // -------------------------------------------------------------------------------------------------------------

  /**
   * Copy-on-write of fully cached prompts' last blocks, within this pool: the fresh block gets the cached one's
   * KV for every layer, and the forward pass then writes only the last token's slot into it. Counted as part of
   * the forward time, which it precedes.
   */
  private copyBlocks(plan: StepPlan): void {
    const pool = this.kvPoolView;
    const sourceIds = plan.blockCopies.map((copy) => copy.source.id);
    const destinationIds = plan.blockCopies.map((copy) => copy.destination.id);
    copyKvBlocks(pool, pool, sourceIds, destinationIds);
  }

  /** The step's logits buffer, grown to the largest step seen (the native backend writes into it, no allocation). */
  private logitsBuffer(rows: number): Float32Array {
    if (this.logits.length < rows * this.vocabSize) this.logits = new Float32Array(rows * this.vocabSize);
    return this.logits;
  }

  /**
   * One token per sampled row, and the requests with a row that could not be sampled (a NaN, every token masked:
   * `failed`, by request id; their rows get the placeholder token 0).
   */
  private sampleRows(plan: StepPlan, logits: Float32Array): {
    tokenIds: number[]; logprobs: Map<string, TokenLogprob>; failed: Map<string, UnsampleableRowError>;
  } {
    const v = this.vocabSize;
    const tokenIds: number[] = new Array(plan.sampleTargets.length);
    const logprobs = new Map<string, TokenLogprob>();
    const failed = new Map<string, UnsampleableRowError>();
    const sequences = plan.sampleTargets.map((target) => this.tokenState(target.request.id, target.completionIndex)!);
    // Guided rows are the grammar's to sample; the others the sampler's, its batched draws first.
    const sampledRows = this.sampler.sampleBatch(logits, sequences.map((sequence) => {
      const guided = sequence.guided;
      return guided === undefined || guided.isTerminated ? sequence : undefined;
    }));
    plan.sampleTargets.forEach((target, row) => {
      const sequence = sequences[row]!;
      let sampled = sampledRows[row];
      if (sampled === undefined) {
        try {
          sampled = sampleGuidedRow(this.sampler, logits.subarray(row * v, (row + 1) * v), sequence, sequence.guided!, this.eosTokenIds);
        } catch (error) {
          if (!(error instanceof UnsampleableRowError)) throw error;
          sampled = { tokenId: -1, failure: error };
        }
      }
      if (sampled.failure !== undefined) {
        if (!failed.has(target.request.id)) failed.set(target.request.id, sampled.failure);
        tokenIds[row] = 0;
        return;
      }
      tokenIds[row] = sampled.tokenId;
      if (sampled.logprobs) logprobs.set(rowKey(target.request.id, target.completionIndex), sampled.logprobs);
    });
    return { tokenIds, logprobs, failed };
  }

  /**
   * The prompt-logprob rows after the sampled ones: each the logprob of the prompt token after its position (the
   * backend's pass over all of them at once where it has one).
   */
  private promptLogprobRows(plan: StepPlan, logits: Float32Array, failed: Map<string, UnsampleableRowError>): TokenLogprob[] {
    const { tokenIds, numTops } = promptLogprobTargets(plan);
    const v = this.vocabSize;
    const first = plan.sampleTargets.length * v;
    try {
      return this.sampler.promptLogprobRows(logits.subarray(first, first + tokenIds.length * v), tokenIds, numTops);
    } catch (error) {
      if (!(error instanceof UnsampleableRowError)) throw error;
    }
    // A row the pass could not take: request by request, so that only the requests with such a row fail (their
    // entries are placeholders, never read: the request ends with this step).
    const rows: TokenLogprob[] = [];
    let at = 0;
    for (const { sequence, numPromptLogprobRows: count } of plan.scheduled) {
      if (count === 0) continue;
      const start = first + at * v;
      try {
        rows.push(...this.sampler.promptLogprobRows(logits.subarray(start, start + count * v),
          tokenIds.slice(at, at + count), numTops.slice(at, at + count)));
      } catch (error) {
        if (!(error instanceof UnsampleableRowError)) throw error;
        if (!failed.has(sequence.request.id)) failed.set(sequence.request.id, error);
        for (let k = 0; k < count; k++) rows.push({ tokenId: tokenIds[at + k]!, logprob: NaN, top: [] });
      }
      at += count;
    }
    return rows;
  }
}

/** Logits bytes a step may spend on prompt-logprob rows (beyond its sampled rows). */
const PROMPT_LOGPROB_LOGITS_BYTES = 32 * 1024 * 1024;

/**
 * Prompt-logprob rows per step: as many vocabulary-wide float rows as PROMPT_LOGPROB_LOGITS_BYTES hold (262 for a
 * 32000-token vocabulary, 65 for Llama 3's 128256), at least 16 and at most a step's tokens.
 */
export function promptLogprobRowsFor(vocabSize: number, maxNumBatchedTokens: number): number {
  const rows = Math.floor(PROMPT_LOGPROB_LOGITS_BYTES / (vocabSize * Float32Array.BYTES_PER_ELEMENT));
  return Math.max(1, Math.min(maxNumBatchedTokens, Math.max(16, rows)));
}

const NO_TOKENS: readonly number[] = [];

/** Tokens from the model: one seeded sampler per completion (see sampler.ts), resumable from a handoff. */
function samplerTokens(vocabSize: number, eosTokenIds: readonly number[], grammar: () => GrammarRuntime | undefined,
  jumpForward: boolean): TokenSource<SequenceSampler> {
  /** A guided request's completions each get a matcher at the start of the output. */
  const attachGrammar = (request: EngineRequest, samplers: SequenceSampler[]): void => {
    const spec = request.sampling.guided;
    if (spec === undefined) return;
    const runtime = grammar();
    if (runtime === undefined) throw new InvalidRequestError('invalid_request', request.id, 'guided decoding is not available on this worker');
    try {
      for (const sampler of samplers) sampler.guided = runtime.open(spec);
    } catch (error) {
      for (const sampler of samplers) sampler.guided?.dispose();
      if (error instanceof GrammarError) throw new InvalidRequestError('invalid_request', request.id, error.message);
      throw error;
    }
  };
  return {
    open: (request) => {
      const samplers = createRequestSamplers({
        params: request.sampling, promptTokenIds: request.promptTokenIds, vocabSize, eosTokenIds,
      });
      attachGrammar(request, samplers);
      // A migrated request: the penalties and the grammar resume after the output its lost worker produced.
      for (const tokenId of request.priorOutputTokenIds ?? []) {
        for (const sampler of samplers) {
          sampler.recordPriorOutputToken(tokenId);
          if (sampler.guided !== undefined && !sampler.guided.accept(tokenId)) {
            for (const s of samplers) s.guided?.dispose();
            throw new InvalidRequestError('invalid_request', request.id, 'the output so far does not follow the request\'s grammar');
          }
        }
      }
      return samplers;
    },
    /**
     * The sampler as the prefill worker left it: the output from before a migration (priorOutputTokenIds: a request
     * prefilled again after its prefill worker was lost) counted for the penalties, then the seeded stream replayed
     * over the tokens the prefill worker produced (one uniform draw per token unless greedy) and checked against the
     * state it sent; a grammar advanced over both, its next row to be tried as the prefill worker would have tried it.
     * A token the grammar refuses here throws: the request cannot go on under its grammar.
     */
    resume: (handoff) => {
      const params = handoff.request.sampling;
      const prior = handoff.request.priorOutputTokenIds ?? NO_TOKENS;
      const sampler = createRequestSamplers({ params, promptTokenIds: handoff.request.promptTokenIds, vocabSize, eosTokenIds })[0]!;
      // As open() counts them on the prefill worker: the penalties only (min_tokens was reduced by them).
      for (const tokenId of prior) sampler.recordPriorOutputToken(tokenId);
      const drawsPerToken = params.temperature < GREEDY_TEMPERATURE ? 0 : 1;
      for (const tokenId of handoff.outputTokenIds) {
        for (let k = 0; k < drawsPerToken; k++) sampler.nextUniform();
        sampler.recordOutputToken(tokenId);
      }
      // A guided request draws a varying number of uniforms for a token (draws the grammar refused, then one from the
      // mask; none for logprobs or for a token appended by jump-forward): its stream continues from the state the
      // prefill worker sent instead of a replay.
      if (params.guided !== undefined) sampler.restoreRngState(handoff.sampler.rngState);
      const resumed = sampler.rngState();
      if (resumed.some((word, i) => word !== handoff.sampler.rngState[i])) {
        throw new Error(`request ${handoff.requestId}: the sampler's random stream cannot be resumed where the prefill worker left it`);
      }
      attachGrammar(handoff.request, [sampler]);
      const guided = sampler.guided;
      if (guided !== undefined) {
        let refused: string | undefined;
        try {
          refused = firstRefused(guided, prior, handoff.outputTokenIds);
        } catch (error) {
          guided.dispose();
          throw error;
        }
        if (refused !== undefined) {
          guided.dispose();
          throw new Error(`request ${handoff.requestId}: the request's grammar refuses ${refused}; it cannot go on under its grammar`);
        }
        // And its next row tried as the prefill worker would have tried it (a sampled row's width decides its draws).
        const tries = handoff.sampler.guided;
        if (tries !== undefined) {
          guided.candidateWidth = tries.candidateWidth;
          guided.argmaxTaken = tries.argmaxTaken;
        }
      }
      return sampler;
    },
    handoffSeed: () => drawRandomSeed(),
    handoffState: (request, sampler) => ({
      seed: request.sampling.seed!, rngState: sampler.rngState(),
      ...(sampler.guided !== undefined ? { guided: { candidateWidth: sampler.guided.candidateWidth, argmaxTaken: sampler.guided.argmaxTaken } } : {}),
    }),
    close: (sampler) => sampler.guided?.dispose(),
    // Jump-forward, when the worker has it on (EngineCoreOptions.jumpForward). Not with logprobs: a forced token has
    // no distribution to report.
    ...(jumpForward ? {
      forced: (sampler: SequenceSampler): readonly number[] => {
        const guided = sampler.guided;
        if (guided === undefined || sampler.params.logprobs !== null || guided.isTerminated) return NO_TOKENS;
        const tokens = guided.forcedTokens();
        for (const tokenId of tokens) sampler.recordOutputToken(tokenId);
        return tokens;
      },
    } : {}),
  };
}

/**
 * Advances a resumed request's grammar over its output from before a migration and then over the handed-off tokens;
 * the first token it refuses, described, or undefined when it takes them all.
 */
function firstRefused(guided: GuidedSequence, prior: readonly number[], handedOff: readonly number[]): string | undefined {
  for (const [i, tokenId] of prior.entries()) {
    if (!guided.accept(tokenId)) return `token ${tokenId}, output token ${i + 1} of the ${prior.length} produced before the request was prefilled again`;
  }
  for (const [i, tokenId] of handedOff.entries()) {
    if (!guided.accept(tokenId)) return `token ${tokenId}, token ${i + 1} of the ${handedOff.length} the prefill worker produced`;
  }
  return undefined;
}

/** One block at a time of this worker's pool, for the lower KV tiers to copy out of and into. */
function poolBlockIo(pool: SharedArrayBuffer, layout: KvPoolView['layout']): KvBlockIo {
  const view: KvPoolView = { pool, layout };
  return {
    blockBytes: kvBlockBytes(layout),
    read: (blockId) => readKvBlocks(view, [blockId]),
    write: (blockId, bytes) => writeKvBlocks(view, [blockId], bytes),
  };
}

/** A handed-off request's missing blocks copied from the prefill worker's pool (shared memory). */
class PoolCopy implements KvImport {
  private plan: KvTransferPlan | undefined;
  private runs = 0;
  private startMs = 0;
  private endMs = 0;

  constructor(private readonly handoff: KvHandoff, private readonly source: KvSourceView,
    private readonly destination: KvPoolView, private readonly now: () => number) {}

  fill(table: BlockTable, fromBlock: number, toBlock: number): void {
    const plan: KvTransferPlan = {
      requestId: this.handoff.requestId, numReusedBlocks: fromBlock,
      sourceBlockIds: this.handoff.sourceBlockIds.slice(fromBlock, toBlock),
      destinationBlockIds: table.blockIds.slice(fromBlock, toBlock),
      bytes: (toBlock - fromBlock) * kvBlockBytes(this.destination.layout),
    };
    this.plan = plan;
    this.startMs = this.now();
    this.runs = copyKvBlocks(this.source, this.destination, plan.sourceBlockIds, plan.destinationBlockIds).runs;
    this.endMs = this.now();
  }

  stats(): ReturnType<KvImport['stats']> {
    return transferStats(this.plan!, this.source.id, this.source.channel, this.runs, this.startMs, this.endMs);
  }
}

/**
 * A handed-off request's missing blocks already written into the blocks this pool reserved for them (by a transfer
 * from another process, prepareKvImport): the table takes those blocks, nothing is copied.
 */
class InPlaceImport implements KvImport {
  readonly inPlace = true;
  private plan: KvTransferPlan | undefined;
  private at = 0;

  constructor(private readonly handoff: KvHandoff, private readonly layout: KvPoolView['layout'], private readonly now: () => number) {}

  fill(table: BlockTable, fromBlock: number, toBlock: number): void {
    this.plan = {
      requestId: this.handoff.requestId, numReusedBlocks: fromBlock,
      sourceBlockIds: this.handoff.sourceBlockIds.slice(fromBlock, toBlock),
      destinationBlockIds: table.blockIds.slice(fromBlock, toBlock),
      bytes: (toBlock - fromBlock) * kvBlockBytes(this.layout),
    };
    this.at = this.now();
  }

  stats(): ReturnType<KvImport['stats']> {
    return transferStats(this.plan!, KV_IN_PLACE_SOURCE, KV_IN_PLACE_SOURCE, 0, this.at, this.at);
  }
}

/**
 * Whether a forward pass failed for lack of memory: the native addon's allocation failure, or V8 refusing an array
 * buffer (the logits buffer grows with the step).
 */
function isAllocationFailure(error: unknown): boolean {
  if (!(error instanceof Error)) return false;
  if ((error as { code?: unknown }).code === NATIVE_ALLOCATION_FAILED) return true;
  return error instanceof RangeError && /Array buffer allocation failed/.test(error.message);
}
