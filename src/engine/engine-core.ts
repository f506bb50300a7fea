// One worker's engine, synchronous: each `step()` is schedule -> build the batch -> one forward -> sample every row
// -> update the scheduler -> detokenize and check stop strings. No threads, no I/O, time comes from the clock given
// at construction; src/engine/worker-main.ts runs it in a worker thread and src/engine/local-engine.ts is the
// async face the gateway sees.

import type { ModelRunnerBackend } from '../kernels/types.ts';
import type { Tokenizer } from '../model/tokenizer/types.ts';
import { BatchBuilder } from './batch-builder.ts';
import { IncrementalDetokenizer } from './detokenizer.ts';
import {
  checkKvLayoutsMatch, copyKvBlocks, HandoffOutbox, kvBlockBytes, transferStats,
  type AdoptedResult, type KvHandoff, type KvPoolView, type KvTransferPlan,
} from './handoff.ts';
import { KvCacheManager } from './kv-cache/manager.ts';
import type { KvEvent } from './kv-cache/events.ts';
import { InvalidRequestError } from './errors.ts';
import { copyTimestamps, type Request } from './request.ts';
import { drawRandomSeed } from './rng.ts';
import { createRequestSamplers, GREEDY_TEMPERATURE, Sampler, type SampledToken, type SequenceSampler } from './sampler.ts';
import { Scheduler, type AdoptedState, type StepPlan } from './scheduler.ts';
import type {
  EngineOutput, EngineRequest, EngineStats, EngineStepFacts, FinishReason, SchedulingPolicy, TokenLogprob,
} from './types.ts';

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
  /** Engine clock in ms. */
  now: () => number;
}

/** What the engine keeps per request beside the scheduler's state: one sampler and detokenizer per completion. */
interface RequestState {
  request: Request;
  samplers: SequenceSampler[];
  detokenizers: IncrementalDetokenizer[];
  /** Prefill only: hand the request over once its first token is sampled (disaggregated serving). */
  handoff?: boolean;
}

/** A prefill worker's pool as a decode worker reads it: shared memory, named for the stats. */
export interface KvSourceView extends KvPoolView {
  id: string;
  /** 'shared-memory' for a pool in this process. */
  channel: string;
}

/** A handed-off request waiting for room in this pool; its source blocks stay pinned meanwhile. */
interface PendingAdoption {
  handoff: KvHandoff;
  source: KvSourceView;
  samplers: SequenceSampler[];
  detokenizers: IncrementalDetokenizer[];
}

export class EngineCore {
  readonly scheduler: Scheduler;
  readonly kv: KvCacheManager;
  private readonly backend: ModelRunnerBackend;
  private readonly tokenizer: Tokenizer;
  private readonly builder: BatchBuilder;
  private readonly sampler: Sampler;
  private readonly vocabSize: number;
  private readonly now: () => number;
  private readonly states = new Map<string, RequestState>();
  private numStepsFailed = 0;
  /** Prefill side: blocks of handed-off requests, kept until the decode worker has copied them. */
  private readonly handoffs: HandoffOutbox;
  /** Decode side: handoffs waiting for room, oldest first, and adoptions not yet reported. */
  private pendingAdoptions: PendingAdoption[] = [];
  private adoptedOut: AdoptedResult[] = [];
  /** Every step's logits, reused (the sampler is done with them before the step returns). */
  private logits = new Float32Array(0);

  constructor(options: EngineCoreOptions) {
    this.backend = options.backend;
    this.tokenizer = options.tokenizer;
    this.now = options.now;
    this.vocabSize = options.backend.config.vocabSize;
    const layout = options.backend.kvLayout;
    this.kv = new KvCacheManager({
      numBlocks: layout.numBlocks, blockSize: layout.blockSize,
      enablePrefixCaching: options.enablePrefixCaching ?? true, enableEvents: options.enableKvEvents ?? false,
    });
    this.handoffs = new HandoffOutbox(this.kv);
    this.scheduler = new Scheduler({
      policy: options.policy, maxNumBatchedTokens: options.maxNumBatchedTokens, maxNumSeqs: options.maxNumSeqs,
      maxModelLen: options.maxModelLen, eosTokenIds: this.tokenizer.stopTokenIds,
      longPrefillTokenThreshold: options.longPrefillTokenThreshold,
    }, this.kv);
    this.builder = BatchBuilder.forScheduler(this.scheduler);
    this.sampler = new Sampler(this.vocabSize);
  }

  get hasWork(): boolean {
    return this.scheduler.numRequests > 0 || this.pendingAdoptions.length > 0;
  }

  /**
   * Queues a request. Throws (InvalidRequestError, RangeError) with a client-fit message if it can never run.
   * With handoff (a prefill worker's request), the request stops after its first token: its KV blocks stay pinned
   * and takeHandoffs() returns what a decode worker needs to continue it. It then needs a seed, drawn here when the
   * client gave none, so that the decode worker continues the same random stream.
   */
  add(engineRequest: EngineRequest, options: { handoff?: boolean } = {}): void {
    if (this.pendingAdoptions.some((p) => p.handoff.requestId === engineRequest.id)) {
      // Else the adoption, retried later, would find the id taken: validation must not fail after it was accepted.
      throw new InvalidRequestError('duplicate_request_id', engineRequest.id, 'a request with this id is already here');
    }
    let accepted = engineRequest;
    if (options.handoff) {
      if (engineRequest.sampling.n !== 1) {
        throw new InvalidRequestError('invalid_request', engineRequest.id, 'only a request with n = 1 can be prefilled for another worker');
      }
      if (engineRequest.sampling.seed === undefined) accepted = { ...engineRequest, sampling: { ...engineRequest.sampling, seed: drawRandomSeed() } };
    }
    const samplers = createRequestSamplers({
      params: accepted.sampling, promptTokenIds: accepted.promptTokenIds, vocabSize: this.vocabSize,
      eosTokenIds: this.tokenizer.stopTokenIds,
    });
    const request = this.scheduler.addRequest(accepted, this.now());
    const detokenizers = samplers.map(() => IncrementalDetokenizer.forRequest(this.tokenizer, accepted.sampling));
    this.states.set(request.id, { request, samplers, detokenizers, handoff: options.handoff });
  }

  /**
   * Stops a request in any state and frees its blocks; returns the closing output of each unfinished completion.
   * A request handed off from here only has its pinned blocks freed (its stream continues on the decode worker);
   * one waiting here for room to adopt is dropped with a closing output.
   */
  abort(requestId: string, reason: FinishReason = 'abort', error?: string): EngineOutput[] {
    this.releaseHandoff(requestId);
    const pendingAt = this.pendingAdoptions.findIndex((p) => p.handoff.requestId === requestId);
    if (pendingAt >= 0) {
      const [pending] = this.pendingAdoptions.splice(pendingAt, 1);
      return [notAdoptedOutput(pending!.handoff, this.now(), reason, error)];
    }
    const state = this.states.get(requestId);
    if (!state) return [];
    const unfinished = state.request.sequences.filter((s) => !s.isFinished).map((s) => s.index);
    // Completions not yet forked (n > 1 before the prompt is done) end too.
    for (let index = state.request.sequences.length; index < state.samplers.length; index++) unfinished.push(index);
    this.scheduler.finish(requestId, reason, { nowMs: this.now() });
    this.states.delete(requestId);
    state.request.timestamps.finished = this.now();
    return unfinished.map((index) => this.output(state, index, [], '', reason, undefined, undefined, error));
  }

  /** Runs one engine step; returns the outputs it produced (none when there was nothing to run). */
  step(): EngineOutput[] {
    if (this.pendingAdoptions.length > 0) this.retryAdoptions();
    const plan = this.scheduler.schedule(this.now());
    if (plan.scheduled.length === 0) {
      this.scheduler.discardPlan(plan);
      return [];
    }
    const batch = this.builder.build(plan);
    const forwardStart = this.now();
    let logits: Float32Array;
    try {
      if (plan.blockCopies.length > 0) this.copyBlocks(plan);
      logits = this.backend.forward(batch, this.logitsBuffer(plan.sampleTargets.length));
    } catch (error) {
      return this.failStep(plan, error);
    }
    const sampled = this.sampleRows(plan, logits);
    const end = this.now();
    const result = this.scheduler.updateFromOutput(plan, sampled.tokenIds, end, forwardStart);
    // One object for every output of the step: structured clone keeps it one object in the message too.
    const step: EngineStepFacts = {
      id: plan.stepId, start: forwardStart, end, batchSeqs: plan.stats.numScheduledSeqs, batchTokens: plan.numScheduledTokens,
    };

    const outputs: EngineOutput[] = [];
    let handOffs: RequestState[] | undefined;
    for (const out of result.outputs) {
      const state = this.states.get(out.requestId);
      if (!state) continue;
      const output = this.emitToken(state, out.index, out.newTokenIds[0]!, out.finishReason, out.stopReason,
        sampled.logprobs.get(rowKey(out.requestId, out.index)));
      output.step = step;
      outputs.push(output);
      if (state.handoff) (handOffs ??= []).push(state);
    }
    // Only after the loop: one step can finish several completions of a request, and each needs its state.
    for (const out of result.outputs) {
      const state = this.states.get(out.requestId);
      if (state?.request.isFinished) {
        state.request.timestamps.finished ??= this.now();
        this.states.delete(out.requestId);
      }
    }
    // A prefill-only request that sampled its first token and did not finish on it leaves now, before the next
    // step would feed that token.
    if (handOffs) for (const state of handOffs) if (this.states.get(state.request.id) === state) this.handOff(state);
    return outputs;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Disaggregated serving

  /** Handoffs made since the last call (prefill side), in order. */
  takeHandoffs(): KvHandoff[] {
    return this.handoffs.take();
  }

  /** The decode worker has the blocks (or gave up on them): unpin them. False if nothing was pinned for the request. */
  releaseHandoff(requestId: string): boolean {
    return this.handoffs.release(requestId);
  }

  /** Handed-off requests whose blocks are still pinned here. */
  get numParkedHandoffs(): number {
    return this.handoffs.numParked;
  }

  /** This worker's pool, for a decode worker to read from (shared memory). */
  get kvPoolView(): KvPoolView {
    return { pool: this.backend.kvPool, layout: this.backend.kvLayout };
  }

  /**
   * Continues a request another worker prefilled (decode side). The sampler resumes the prefill worker's random
   * stream and the detokenizer its text state, so the stream goes on exactly as if the request had never moved.
   * With a source, the KV blocks this pool lacks are copied from it; returns null when the pool or the batch has
   * no room yet: the adoption is retried before each step, and reported by takeAdopted() once done. Without a
   * source, or when the copy fails, the prompt is recomputed here ('recompute'). Throws InvalidRequestError for a
   * request that could never run on this worker, and an Error for a handoff that contradicts itself.
   */
  adopt(handoff: KvHandoff, source: KvSourceView | null): AdoptedResult | null {
    const id = handoff.requestId;
    if (this.states.has(id) || this.pendingAdoptions.some((p) => p.handoff.requestId === id)) {
      throw new InvalidRequestError('duplicate_request_id', id, 'a request with this id is already here');
    }
    const resumed = this.resumeRequestState(handoff);
    if (source === null) return this.adoptByRecompute(handoff, resumed, 'no KV source for this prefill worker');
    try {
      checkKvLayoutsMatch(source.layout, this.backend.kvLayout);
    } catch (error) {
      return this.adoptByRecompute(handoff, resumed, (error as Error).message);
    }
    const pending: PendingAdoption = { handoff, source, ...resumed };
    const result = this.tryImport(pending);
    if (result === null) this.pendingAdoptions.push(pending);
    return result;
  }

  /** Adoptions completed since the last call (decode side): the source blocks they name can be released. */
  takeAdopted(): AdoptedResult[] {
    const adopted = this.adoptedOut;
    this.adoptedOut = [];
    return adopted;
  }

  get numPendingAdoptions(): number {
    return this.pendingAdoptions.length;
  }

  private handOff(state: RequestState): void {
    const { request } = state;
    const given = this.scheduler.handOff(request.id);
    this.states.delete(request.id);
    const seed = request.sampling.seed!;
    this.handoffs.add({
      requestId: request.id, request: request.engineRequest, outputTokenIds: given.outputTokenIds.slice(),
      numComputedTokens: given.numComputedTokens, blockSize: this.kv.blockSize, sourceBlockIds: given.blockIds.slice(),
      blockHashes: given.blockHashes.slice(), sampler: { seed, rngState: state.samplers[0]!.rngState() },
      numCachedTokens: request.numCachedTokens, timestamps: copyTimestamps(request.timestamps),
      sourceLayout: this.backend.kvLayout, createdMs: this.now(),
    }, given.pin);
  }

  /**
   * The sampler and detokenizer as the prefill worker left them: the seeded stream replayed over the tokens it
   * sampled (one uniform draw per token unless greedy), then checked against the state it sent.
   */
  private resumeRequestState(handoff: KvHandoff): { samplers: SequenceSampler[]; detokenizers: IncrementalDetokenizer[] } {
    const params = handoff.request.sampling;
    const samplers = createRequestSamplers({
      params, promptTokenIds: handoff.request.promptTokenIds, vocabSize: this.vocabSize, eosTokenIds: this.tokenizer.stopTokenIds,
    });
    const sampler = samplers[0]!;
    const drawsPerToken = params.temperature < GREEDY_TEMPERATURE ? 0 : 1;
    for (const tokenId of handoff.outputTokenIds) {
      for (let k = 0; k < drawsPerToken; k++) sampler.nextUniform();
      sampler.recordOutputToken(tokenId);
    }
    const resumed = sampler.rngState();
    if (resumed.some((word, i) => word !== handoff.sampler.rngState[i])) {
      throw new Error(`request ${handoff.requestId}: the sampler's random stream cannot be resumed where the prefill worker left it`);
    }
    const detokenizer = IncrementalDetokenizer.forRequest(this.tokenizer, params);
    for (const tokenId of handoff.outputTokenIds) detokenizer.push(tokenId); // its text went out from the prefill worker
    return { samplers, detokenizers: [detokenizer] };
  }

  private tryImport(pending: PendingAdoption): AdoptedResult | null {
    const { handoff, source } = pending;
    const destination = this.kvPoolView;
    let plan: KvTransferPlan | undefined;
    let runs = 0;
    let startMs = 0;
    let endMs = 0;
    let request: Request | null;
    try {
      request = this.scheduler.adoptRequest(handoff.request, this.now(), adoptedState(handoff), {
        numTokens: handoff.numComputedTokens, blockHashes: handoff.blockHashes,
        fill: (table, fromBlock, toBlock) => {
          plan = {
            requestId: handoff.requestId, numReusedBlocks: fromBlock,
            sourceBlockIds: handoff.sourceBlockIds.slice(fromBlock, toBlock),
            destinationBlockIds: table.blockIds.slice(fromBlock, toBlock),
            bytes: (toBlock - fromBlock) * kvBlockBytes(destination.layout),
          };
          startMs = this.now();
          runs = copyKvBlocks(source, destination, plan.sourceBlockIds, plan.destinationBlockIds).runs;
          endMs = this.now();
        },
      });
    } catch (error) {
      if (error instanceof InvalidRequestError) throw error;
      return this.adoptByRecompute(handoff, pending, `KV import failed: ${(error as Error).message}`);
    }
    if (request === null) return null;
    const transfer = transferStats(plan!, source.id, source.channel, runs, startMs, endMs);
    request.timestamps.kvTransfer = { start: startMs, end: endMs, bytes: transfer.bytes, blocks: transfer.blocks };
    this.states.set(request.id, { request, samplers: pending.samplers, detokenizers: pending.detokenizers });
    const result: AdoptedResult = { requestId: request.id, status: 'imported', transfer };
    this.adoptedOut.push(result);
    return result;
  }

  private adoptByRecompute(handoff: KvHandoff, resumed: Pick<PendingAdoption, 'samplers' | 'detokenizers'>, error: string): AdoptedResult {
    const request = this.scheduler.adoptRequest(handoff.request, this.now(), adoptedState(handoff))!;
    this.states.set(request.id, { request, samplers: resumed.samplers, detokenizers: resumed.detokenizers });
    const result: AdoptedResult = { requestId: request.id, status: 'recompute', error };
    this.adoptedOut.push(result);
    return result;
  }

  /** Oldest first; the first that still does not fit keeps its place and everything behind it waits too. */
  private retryAdoptions(): void {
    while (this.pendingAdoptions.length > 0) {
      if (this.tryImport(this.pendingAdoptions[0]!) === null) return;
      this.pendingAdoptions.shift();
    }
  }

  stats(): EngineStats {
    const kv = this.kv.stats();
    const scheduler = this.scheduler.stats();
    return {
      numRunning: scheduler.numRunning, numWaiting: scheduler.numWaiting,
      kvBlocksUsed: kv.numUsedBlocks, kvBlocksTotal: kv.numBlocks,
      prefixCacheQueries: kv.prefixQueryTokens, prefixCacheHits: kv.prefixHitTokens,
      preemptions: scheduler.numPreemptions, kvEvictions: kv.evictions,
    };
  }

  takeKvEvents(): KvEvent[] {
    return this.kv.takeEvents();
  }

  get stepsFailed(): number {
    return this.numStepsFailed;
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

  private sampleRows(plan: StepPlan, logits: Float32Array): { tokenIds: number[]; logprobs: Map<string, TokenLogprob> } {
    const v = this.vocabSize;
    const tokenIds: number[] = new Array(plan.sampleTargets.length);
    const logprobs = new Map<string, TokenLogprob>();
    plan.sampleTargets.forEach((target, row) => {
      const state = this.states.get(target.request.id)!;
      const sampled: SampledToken = this.sampler.sampleRow(logits.subarray(row * v, (row + 1) * v),
        state.samplers[target.completionIndex]!);
      tokenIds[row] = sampled.tokenId;
      if (sampled.logprobs) logprobs.set(rowKey(target.request.id, target.completionIndex), sampled.logprobs);
    });
    return { tokenIds, logprobs };
  }

  /** Detokenizes one sampled token, applies stop strings, and shapes the output. */
  private emitToken(state: RequestState, index: number, tokenId: number, finish: FinishReason | null,
    stopTokenId: number | null, logprob: TokenLogprob | undefined): EngineOutput {
    const { request } = state;
    const detokenizer = state.detokenizers[index]!;
    let text = '';
    let reason: FinishReason | undefined = finish ?? undefined;
    let stopReason: string | number | undefined = stopTokenId ?? undefined;
    // A stop token's own text is left out unless asked for, as vLLM does.
    const endsOnStopToken = finish === 'stop' && stopTokenId === tokenId;
    if (!endsOnStopToken || request.sampling.includeStopStrInOutput) {
      const piece = detokenizer.push(tokenId);
      text += piece.delta;
      if (piece.stopped !== undefined) {
        reason = 'stop';
        stopReason = piece.stopped;
        this.scheduler.finish(request.id, 'stop', { index, nowMs: this.now() });
      }
    }
    if (reason !== undefined && !detokenizer.done) {
      const tail = detokenizer.finish();
      text += tail.delta;
      if (tail.stopped !== undefined) stopReason = tail.stopped;
    }
    return this.output(state, index, [tokenId], text, reason, stopReason, logprob ? [logprob] : undefined);
  }

  private output(state: RequestState, index: number, newTokenIds: number[], textDelta: string,
    finishReason: FinishReason | undefined, stopReason: string | number | undefined,
    logprobs: TokenLogprob[] | undefined, error?: string): EngineOutput {
    const { request } = state;
    const sequence = request.sequences[index];
    const output: EngineOutput = {
      requestId: request.id, index, newTokenIds, textDelta, logprobs, finishReason, stopReason, error,
      usage: {
        promptTokens: request.promptTokenIds.length,
        completionTokens: sequence ? sequence.outputTokenIds.length : 0,
        cachedTokens: request.numCachedTokens,
      },
      timestamps: request.timestamps,
    };
    const { traceparent } = request.engineRequest;
    if (traceparent !== undefined) output.traceparent = traceparent;
    return output;
  }

  /** A forward pass threw: that is a bug or a broken model, so every request in the step fails with the reason. */
  private failStep(plan: StepPlan, error: unknown): EngineOutput[] {
    this.numStepsFailed++;
    this.scheduler.discardPlan(plan);
    const message = `forward pass failed: ${error instanceof Error ? error.message : String(error)}`;
    const ids = new Set(plan.scheduled.map((s) => s.sequence.request.id));
    return [...ids].flatMap((id) => this.abort(id, 'error', message));
  }
}

function adoptedState(handoff: KvHandoff): AdoptedState {
  return { outputTokenIds: handoff.outputTokenIds, numCachedTokens: handoff.numCachedTokens, timestamps: handoff.timestamps };
}

/** The closing output of a handed-off request stopped before this worker took it in. */
function notAdoptedOutput(handoff: KvHandoff, nowMs: number, reason: FinishReason, error?: string): EngineOutput {
  const { traceparent } = handoff.request;
  return {
    requestId: handoff.requestId, index: 0, newTokenIds: [], textDelta: '', finishReason: reason, error,
    ...(traceparent !== undefined ? { traceparent } : {}),
    usage: {
      promptTokens: handoff.request.promptTokenIds.length, completionTokens: handoff.outputTokenIds.length,
      cachedTokens: handoff.numCachedTokens,
    },
    timestamps: { ...copyTimestamps(handoff.timestamps), finished: nowMs },
  };
}

function rowKey(requestId: string, index: number): string {
  return `${index}:${requestId}`;
}
