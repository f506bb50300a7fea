// The simulated engine: Conduit's real scheduler and paged KV cache, with no model behind them. Each engine step is
// planned by the same Scheduler the local engine uses; the plan becomes a StepShape (prefill chunks and decodes) and
// the performance model says how long that forward pass takes on the chosen GPUs. Tokens are synthetic but
// deterministic, so everything that depends on the token ids (prefix-cache hits, block hashes, KV events) is real.
//
// Two layers:
//   SimWorker  synchronous and clockless: beginStep(nowMs) plans a step and prices it, finishStep(step) applies it
//              at its end time. SimCluster (cluster.ts) drives many of these on one virtual clock, with no wall clock.
//   SimEngine  the async `Engine` face over one SimWorker: a step loop on a virtual clock that runs `speedUp` times
//              faster than real time (Infinity: as fast as the host can, and fully deterministic given arrivals).

import { KvCacheManager } from '../engine/kv-cache/manager.ts';
import type { KvEvent } from '../engine/kv-cache/events.ts';
import { engineNow } from '../engine/clock.ts';
import { followQueue, OutputStream } from '../engine/streams.ts';
import {
  HandoffOutbox, PrefillStream, type AdoptedResult, type KvHandoff, type KvPoolLayout, type KvTransferStats, type PrefillEvent,
} from '../engine/handoff.ts';
import { copyTimestamps, InvalidRequestError, type Request } from '../engine/request.ts';
import { Scheduler, type AdoptedState, type StepPlan } from '../engine/scheduler.ts';
import { StopStringMatcher } from '../engine/stop-strings.ts';
import type {
  Engine, EngineInfo, EngineOutput, EngineRequest, EngineStats, EngineStepFacts, FinishReason,
  SchedulingPolicy, TokenLogprob, WorkerRole,
} from '../engine/types.ts';
import { INFINIBAND_NDR, type HardwareProfile, type LinkProfile } from './hardware.ts';
import { kvBytesPerToken, type ModelProfile } from './models.ts';
import {
  DEFAULT_EFFICIENCY, checkTensorParallel, kvCapacityTokens, kvTransferTimeMs, stepTimeMs, type Efficiency, type StepShape,
} from './perf-model.ts';

// ---------------------------------------------------------------------------------------------------------------
// Configuration

/** Defaults follow vLLM's online-serving settings on a data-centre GPU. */
export const SIM_DEFAULTS = Object.freeze({
  blockSize: 16,
  maxNumSeqs: 256,
  /** The step token budget; simulateLifecycle uses the same default, so the two agree on chunking. */
  maxNumBatchedTokens: 8192,
  /** Llama 3.1's context length; the scheduler lowers it further when one sequence of it would not fit the pool. */
  maxModelLen: 131_072,
  /** vLLM's gpu_memory_utilization. */
  memoryUtilization: 0.9,
});

export interface SimWorkerConfig {
  model: ModelProfile;
  hw: HardwareProfile;
  /** Tensor-parallel degree: GPUs of one worker. */
  tp: number;
  efficiency?: Efficiency;
  /**
   * KV pool in blocks. Default: what HBM holds after the weights, per GPU (kvCapacityTokens at memoryUtilization),
   * divided into blocks.
   */
  numKvBlocks?: number;
  memoryUtilization?: number;
  blockSize?: number;
  maxNumSeqs?: number;
  maxNumBatchedTokens?: number;
  maxModelLen?: number;
  longPrefillTokenThreshold?: number;
  policy?: SchedulingPolicy;
  enablePrefixCaching?: boolean;
  enableKvEvents?: boolean;
  /**
   * Synthetic token ids are below this: the vocabulary of the tokenizer that decodes them (default the model
   * profile's). The performance model keeps the profile's vocabulary for the LM head's cost.
   */
  vocabSize?: number;
  /** The token that ends a sequence (default vocabSize - 1). Synthetic tokens avoid it unless eosProbability > 0. */
  eosTokenId?: number;
  /** Chance that a generated token is EOS (default 0: max_tokens alone decides the length). */
  eosProbability?: number;
  /** What the worker does in a disaggregated deployment (default 'both'); informational, like the real engine's. */
  role?: WorkerRole;
  /**
   * The link KV blocks cross to reach this worker when it adopts a handed-off request, and how many of them carry
   * the transfer side by side (default InfiniBand NDR, one per GPU of the worker).
   */
  kvLink?: { link: LinkProfile; parallelLinks?: number };
}

/** What a worker would report to the router's load view (the same fields as router/protocols.ts WorkerLoad). */
export interface SimWorkerLoad {
  numRunning: number;
  numWaiting: number;
  activePrefillTokens: number;
  activeDecodeBlocks: number;
  kvUsage: number;
}

/** One planned step, priced by the performance model. */
export interface SimStep {
  readonly plan: StepPlan;
  readonly shape: StepShape;
  readonly startMs: number;
  readonly durationMs: number;
  readonly endMs: number;
}

// ---------------------------------------------------------------------------------------------------------------
// Synthetic tokens and text

/** murmur3's 32-bit finaliser: a bijection with good avalanche, so neighbouring positions give unrelated tokens. */
function mix32(word: number): number {
  let h = word >>> 0;
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  return h >>> 0;
}

function combine(hash: number, word: number): number {
  return mix32((hash ^ Math.imul(word >>> 0, 0x9e3779b1)) + 0x7f4a7c15);
}

/** FNV-1a of a string: the seed of a request that gave none, so its tokens still depend only on the request. */
function hashString(text: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) h = Math.imul(h ^ text.charCodeAt(i), 0x01000193);
  return h >>> 0;
}

const CONSONANTS = 'bdfgklmnprstvz';
const VOWELS = 'aeiou';

/** A pronounceable four-letter word per token id: distinct ids mostly give distinct words, and stop strings can hit. */
export function syntheticWord(tokenId: number): string {
  let x = tokenId >>> 0;
  let word = '';
  for (let i = 0; i < 2; i++) {
    word += CONSONANTS[x % CONSONANTS.length]!;
    x = Math.floor(x / CONSONANTS.length);
    word += VOWELS[x % VOWELS.length]!;
    x = Math.floor(x / VOWELS.length);
  }
  return ` ${word}`;
}

export interface SyntheticTokenOptions {
  vocabSize: number;
  eosTokenId: number;
  eosProbability: number;
  /** Token ids the request stops on: a synthetic token never hits them by accident. */
  avoid: readonly number[];
}

/**
 * The token generated at `position` of completion `index` of a request with `seed`: a pure function of those, so a
 * request gets the same tokens whatever else is batched with it, and after preemption and recompute.
 */
export function syntheticToken(seed: number, index: number, position: number, opts: SyntheticTokenOptions): number {
  const seedHigh = Math.floor(seed / 0x1_0000_0000);
  let h = combine(combine(combine(mix32(seed >>> 0), seedHigh), index), position);
  if (opts.eosProbability > 0 && mix32(h ^ 0x2545f491) / 0x1_0000_0000 < opts.eosProbability) return opts.eosTokenId;
  for (;;) {
    // Uniform over the vocabulary without EOS: draw from vocabSize - 1 ids and step over EOS.
    let tokenId = h % (opts.vocabSize - 1);
    if (tokenId >= opts.eosTokenId) tokenId++;
    if (!opts.avoid.includes(tokenId)) return tokenId;
    h = mix32(h + 1);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Plan -> step shape

/**
 * What the performance model needs from a plan. A decode feeds one token after startPosition cached ones; anything
 * else (a prompt chunk, the recompute after preemption, a forked sample's partial block) is a prefill chunk whose
 * context is the tokens already in the KV cache, sampled only when it reaches the end of the sequence.
 */
export function planToStepShape(plan: StepPlan): StepShape {
  const prefillTokens: { newTokens: number; contextLen: number; sampled: boolean }[] = [];
  const decodeSeqs: { contextLen: number }[] = [];
  for (const entry of plan.scheduled) {
    if (entry.isDecode) decodeSeqs.push({ contextLen: entry.startPosition });
    else prefillTokens.push({ newTokens: entry.numNewTokens, contextLen: entry.startPosition, sampled: entry.numSamples > 0 });
  }
  return { prefillTokens, decodeSeqs };
}

/** KV blocks a worker of this configuration gets: HBM left after its weight shard, per GPU, in whole blocks. */
export function simKvBlocks(config: SimWorkerConfig): number {
  if (config.numKvBlocks !== undefined) return config.numKvBlocks;
  const blockSize = config.blockSize ?? SIM_DEFAULTS.blockSize;
  const tokens = kvCapacityTokens(config.model, config.hw, config.tp,
    config.memoryUtilization ?? SIM_DEFAULTS.memoryUtilization);
  const blocks = Math.floor(tokens / blockSize);
  if (blocks < 1) {
    throw new RangeError(`${config.model.name} on ${config.tp} x ${config.hw.name}: the weights leave no HBM for the KV `
      + 'cache; use a larger tp or a GPU with more memory');
  }
  return blocks;
}

// ---------------------------------------------------------------------------------------------------------------
// SimWorker: one worker, synchronous

interface RequestState {
  request: Request;
  seed: number;
  matchers: StopStringMatcher[];
  /** Prefill only: hand the request over once its first token is out. */
  handoff?: boolean;
}

/** How long a handed-off request's missing blocks take to reach this worker, priced when the transfer starts. */
export interface SimTransferPlan {
  requestId: string;
  blocks: number;
  reusedBlocks: number;
  bytes: number;
  ms: number;
}

/** A handoff that arrived (its transfer time elapsed) and waits for room in this worker's pool. */
interface SimPendingAdoption {
  handoff: KvHandoff;
  transferStartMs: number;
  /** The prefill worker it came from, for the transfer stats. */
  sourceId: string;
}

export class SimWorker {
  readonly model: ModelProfile;
  readonly hw: HardwareProfile;
  readonly tp: number;
  readonly efficiency: Efficiency;
  readonly kv: KvCacheManager;
  readonly scheduler: Scheduler;
  readonly info: EngineInfo;
  private readonly vocabSize: number;
  private readonly eosTokenId: number;
  private readonly eosProbability: number;
  private readonly states = new Map<string, RequestState>();
  private inFlight: SimStep | null = null;
  private numStepsRun = 0;
  private busyTimeMs = 0;
  readonly role: WorkerRole;
  readonly kvLink: LinkProfile;
  readonly kvParallelLinks: number;
  /** Prefill side: pinned blocks of handed-off requests; decode side: adoptions waiting for room. */
  private readonly handoffs: HandoffOutbox;
  private pendingAdoptions: SimPendingAdoption[] = [];
  private adoptedOut: AdoptedResult[] = [];

  constructor(config: SimWorkerConfig) {
    const { model, hw, tp } = config;
    checkTensorParallel(model, hw, tp);
    this.model = model;
    this.hw = hw;
    this.tp = tp;
    this.efficiency = config.efficiency ?? DEFAULT_EFFICIENCY;
    this.vocabSize = config.vocabSize ?? model.vocabSize;
    if (!Number.isInteger(this.vocabSize) || this.vocabSize < 2) {
      throw new RangeError(`vocabSize must be a whole number >= 2, got ${config.vocabSize}`);
    }
    this.eosTokenId = config.eosTokenId ?? this.vocabSize - 1;
    if (!Number.isInteger(this.eosTokenId) || this.eosTokenId < 0 || this.eosTokenId >= this.vocabSize) {
      throw new RangeError(`eosTokenId must be a token id below ${this.vocabSize}, got ${config.eosTokenId}`);
    }
    this.eosProbability = config.eosProbability ?? 0;
    if (!(this.eosProbability >= 0 && this.eosProbability <= 1)) {
      throw new RangeError(`eosProbability must be in [0, 1], got ${config.eosProbability}`);
    }
    const blockSize = config.blockSize ?? SIM_DEFAULTS.blockSize;
    this.kv = new KvCacheManager({
      numBlocks: simKvBlocks(config), blockSize,
      enablePrefixCaching: config.enablePrefixCaching ?? true, enableEvents: config.enableKvEvents ?? false,
    });
    this.handoffs = new HandoffOutbox(this.kv);
    this.scheduler = new Scheduler({
      policy: config.policy, maxNumSeqs: config.maxNumSeqs ?? SIM_DEFAULTS.maxNumSeqs,
      maxNumBatchedTokens: config.maxNumBatchedTokens ?? SIM_DEFAULTS.maxNumBatchedTokens,
      maxModelLen: config.maxModelLen ?? SIM_DEFAULTS.maxModelLen, eosTokenIds: [this.eosTokenId],
      longPrefillTokenThreshold: config.longPrefillTokenThreshold,
    }, this.kv);
    this.info = {
      modelName: model.name, maxModelLen: this.scheduler.maxModelLen, vocabSize: this.vocabSize,
      kvCapacityTokens: this.kv.numBlocks * blockSize, blockSize, backend: 'sim',
      kernelVariants: { gpu: `${hw.id} x${tp}` }, threads: 1,
    };
    this.role = config.role ?? 'both';
    this.kvLink = config.kvLink?.link ?? INFINIBAND_NDR;
    this.kvParallelLinks = config.kvLink?.parallelLinks ?? tp;
  }

  /** Requests not yet finished (waiting, running or preempted), or handed-off ones waiting for room. */
  get hasWork(): boolean {
    return this.scheduler.numRequests > 0 || this.pendingAdoptions.length > 0;
  }

  /**
   * The pool's shape as a transfer sees it (the sim has no bytes; the real engine's layout names the same sizes).
   * KV elements count as 2 bytes ('f16'): BF16, the profiles' usual kvBytesPerElement.
   */
  get kvLayout(): KvPoolLayout {
    return {
      numLayers: this.model.numLayers, numBlocks: this.kv.numBlocks, blockSize: this.kv.blockSize,
      numKvHeads: this.model.numKvHeads, headDim: this.model.headDim, dtype: 'f16',
    };
  }

  hasRequest(requestId: string): boolean {
    return this.states.has(requestId);
  }

  /** The step planned by beginStep and not yet finished. */
  get currentStep(): SimStep | null {
    return this.inFlight;
  }

  get numSteps(): number {
    return this.numStepsRun;
  }

  /** Simulated time spent in steps: busyMs / elapsed is the worker's utilisation. */
  get busyMs(): number {
    return this.busyTimeMs;
  }

  /**
   * Queues a request; throws InvalidRequestError (with a code the gateway maps) if it can never run. With handoff
   * (a prefill worker's request), it stops after its first token and takeHandoffs() returns it for a decode worker.
   */
  add(engineRequest: EngineRequest, nowMs: number, options: { handoff?: boolean } = {}): void {
    if (this.pendingAdoptions.some((p) => p.handoff.requestId === engineRequest.id)) {
      throw new InvalidRequestError('duplicate_request_id', engineRequest.id, 'a request with this id is already here');
    }
    if (options.handoff && engineRequest.sampling.n !== 1) {
      throw new InvalidRequestError('invalid_request', engineRequest.id, 'only a request with n = 1 can be prefilled for another worker');
    }
    const { sampling } = engineRequest;
    const seed = sampling.seed ?? hashString(engineRequest.id);
    // A handed-off request carries its seed, so the decode worker continues the same synthetic tokens.
    const accepted = options.handoff && sampling.seed === undefined ? { ...engineRequest, sampling: { ...sampling, seed } } : engineRequest;
    const request = this.scheduler.addRequest(accepted, nowMs);
    const matchers = Array.from({ length: sampling.n }, () => new StopStringMatcher(sampling.stop, sampling.includeStopStrInOutput, sampling.minTokens));
    this.states.set(request.id, { request, seed, matchers, handoff: options.handoff });
  }

  /**
   * Stops a request in any state and frees its blocks; returns the closing output of each unfinished completion.
   * A handed-off request only has its pinned blocks freed; one waiting here for room to adopt gets a closing output.
   */
  abort(requestId: string, nowMs: number, reason: FinishReason = 'abort', error?: string): EngineOutput[] {
    this.releaseHandoff(requestId);
    const pendingAt = this.pendingAdoptions.findIndex((p) => p.handoff.requestId === requestId);
    if (pendingAt >= 0) {
      const [pending] = this.pendingAdoptions.splice(pendingAt, 1);
      const { handoff } = pending!;
      const { traceparent } = handoff.request;
      return [{
        requestId, index: 0, newTokenIds: [], textDelta: '', finishReason: reason, error,
        ...(traceparent !== undefined ? { traceparent } : {}),
        usage: { promptTokens: handoff.request.promptTokenIds.length, completionTokens: handoff.outputTokenIds.length, cachedTokens: handoff.numCachedTokens },
        timestamps: { ...copyTimestamps(handoff.timestamps), finished: nowMs },
      }];
    }
    const state = this.states.get(requestId);
    if (!state) return [];
    const { request } = state;
    const unfinished = request.sequences.filter((s) => !s.isFinished).map((s) => s.index);
    // Completions not yet forked (n > 1 before the prompt is done) end too.
    for (let index = request.sequences.length; index < request.sampling.n; index++) unfinished.push(index);
    this.scheduler.finish(requestId, reason, { nowMs });
    this.states.delete(requestId);
    request.timestamps.finished = nowMs;
    return unfinished.map((index) => {
      const tail = state.matchers[index]?.stopped === undefined ? state.matchers[index]?.flush() ?? '' : '';
      return this.output(state, index, [], tail, reason, undefined, error);
    });
  }

  /**
   * Plans the next step at nowMs and prices it. Null when nothing can run (no requests). Until finishStep, the
   * plan is outstanding: aborts may still arrive (their rows are then ignored), new requests wait for the next step.
   */
  beginStep(nowMs: number): SimStep | null {
    if (this.inFlight) throw new Error(`step ${this.inFlight.plan.stepId} is still in flight`);
    if (this.pendingAdoptions.length > 0) this.retryAdoptions(nowMs);
    const plan = this.scheduler.schedule(nowMs);
    if (plan.scheduled.length === 0) {
      this.scheduler.discardPlan(plan);
      return null;
    }
    const shape = planToStepShape(plan);
    const durationMs = stepTimeMs(shape, this.model, this.hw, this.tp, this.efficiency) + this.blockCopyMs(plan);
    this.inFlight = { plan, shape, startMs: nowMs, durationMs, endMs: nowMs + durationMs };
    return this.inFlight;
  }

  /**
   * A fully cached prompt computes one token (the plan says so) after its last block is copied on the GPU: one read
   * and one write of the block's KV shard per copy, at HBM bandwidth.
   */
  private blockCopyMs(plan: StepPlan): number {
    if (plan.blockCopies.length === 0) return 0;
    const bytes = 2 * plan.blockCopies.length * this.kv.blockSize * (kvBytesPerToken(this.model) / this.tp);
    return (bytes / (this.hw.hbmBytesPerSec * this.efficiency.bandwidthUtilization)) * 1000;
  }

  /** Applies the step at its end time: one synthetic token per logits row, stop checks, outputs. */
  finishStep(step: SimStep): EngineOutput[] {
    if (step !== this.inFlight) throw new Error(`step ${step.plan.stepId} is not the step in flight`);
    this.inFlight = null;
    this.numStepsRun++;
    this.busyTimeMs += step.durationMs;
    const { plan, endMs } = step;
    const tokenIds = plan.sampleTargets.map((target) => {
      const { request, completionIndex } = target;
      const state = this.states.get(request.id);
      // The position the new token takes; a sample about to fork starts right after the prompt.
      const position = request.sequences[completionIndex]?.numTokens ?? request.promptTokenIds.length;
      return syntheticToken(state?.seed ?? 0, completionIndex, position, {
        vocabSize: this.vocabSize, eosTokenId: this.eosTokenId, eosProbability: this.eosProbability,
        avoid: request.sampling.stopTokenIds,
      });
    });
    // Planning takes no simulated time: the forward pass starts when the step does.
    const result = this.scheduler.updateFromOutput(plan, tokenIds, endMs, step.startMs);
    const facts: EngineStepFacts = {
      id: plan.stepId, start: step.startMs, end: endMs, batchSeqs: plan.stats.numScheduledSeqs, batchTokens: plan.numScheduledTokens,
    };
    const outputs: EngineOutput[] = [];
    let handOffs: RequestState[] | undefined;
    for (const out of result.outputs) {
      const state = this.states.get(out.requestId);
      if (!state) continue;
      const output = this.emitToken(state, out.index, out.newTokenIds[0]!, out.finishReason, out.stopReason, endMs);
      output.step = facts;
      outputs.push(output);
      if (state.handoff) (handOffs ??= []).push(state);
    }
    // Only after the loop: one step can finish several completions of a request, and each needs its state.
    for (const out of result.outputs) {
      const state = this.states.get(out.requestId);
      if (state?.request.isFinished) {
        state.request.timestamps.finished ??= endMs;
        this.states.delete(out.requestId);
      }
    }
    if (handOffs) for (const state of handOffs) if (this.states.get(state.request.id) === state) this.handOff(state, endMs);
    return outputs;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Disaggregated serving: the same scheduler halves as the real engine, with transfer time instead of bytes

  /** Handoffs made since the last call (prefill side). */
  takeHandoffs(): KvHandoff[] {
    return this.handoffs.take();
  }

  /** The decode worker has the blocks: unpin them here. False if nothing was pinned for the request. */
  releaseHandoff(requestId: string): boolean {
    return this.handoffs.release(requestId);
  }

  get numParkedHandoffs(): number {
    return this.handoffs.numParked;
  }

  get numPendingAdoptions(): number {
    return this.pendingAdoptions.length;
  }

  /**
   * What moving the handoff's blocks to this worker would take now (decode side): the blocks its prefix cache
   * lacks, their bytes, and their time over kvLink (kvTransferTimeMs). The caller adopts after that time.
   */
  planTransfer(handoff: KvHandoff): SimTransferPlan {
    const tokenIds = [...handoff.request.promptTokenIds, ...handoff.outputTokenIds];
    const hit = this.kv.findCachedPrefix(this.kv.createTable({ cacheSalt: handoff.request.cacheSalt }), tokenIds, { copyOnWrite: false });
    const reusedBlocks = Math.min(hit.blocks.length, Math.floor(handoff.numComputedTokens / this.kv.blockSize));
    const blocks = this.kv.blocksFor(handoff.numComputedTokens) - reusedBlocks;
    const tokens = blocks * this.kv.blockSize;
    return {
      requestId: handoff.requestId, blocks, reusedBlocks, bytes: tokens * kvBytesPerToken(this.model),
      ms: kvTransferTimeMs(tokens, this.model, this.kvLink, { parallelLinks: this.kvParallelLinks, efficiency: this.efficiency.commEfficiency }),
    };
  }

  /**
   * Continues a handed-off request (decode side) whose transfer, started at transferStartMs, ends at nowMs: its
   * blocks are allocated (own prefix hits reused) and registered, and it joins the batch with its next token to
   * compute. Null when there is no room yet: retried before each step, reported by takeAdopted() once done.
   */
  adopt(handoff: KvHandoff, nowMs: number, transferStartMs = nowMs, sourceId = ''): AdoptedResult | null {
    const id = handoff.requestId;
    if (this.states.has(id) || this.pendingAdoptions.some((p) => p.handoff.requestId === id)) {
      throw new InvalidRequestError('duplicate_request_id', id, 'a request with this id is already here');
    }
    const pending = { handoff, transferStartMs, sourceId };
    const result = this.tryAdopt(pending, nowMs);
    if (result === null) this.pendingAdoptions.push(pending);
    return result;
  }

  /** Adoptions completed since the last call (decode side). */
  takeAdopted(): AdoptedResult[] {
    const adopted = this.adoptedOut;
    this.adoptedOut = [];
    return adopted;
  }

  private handOff(state: RequestState, nowMs: number): void {
    const { request } = state;
    const given = this.scheduler.handOff(request.id);
    this.states.delete(request.id);
    this.handoffs.add({
      requestId: request.id, request: request.engineRequest, outputTokenIds: given.outputTokenIds.slice(),
      numComputedTokens: given.numComputedTokens, blockSize: this.kv.blockSize, sourceBlockIds: given.blockIds.slice(),
      blockHashes: given.blockHashes.slice(),
      // Synthetic tokens are a function of (seed, completion, position): the seed is the whole sampler state.
      sampler: { seed: state.seed, rngState: [state.seed >>> 0, Math.floor(state.seed / 0x1_0000_0000) >>> 0, 0, 0] },
      numCachedTokens: request.numCachedTokens, timestamps: copyTimestamps(request.timestamps), sourceLayout: this.kvLayout,
      createdMs: nowMs,
    }, given.pin);
  }

  private tryAdopt(pending: SimPendingAdoption, nowMs: number): AdoptedResult | null {
    const { handoff } = pending;
    let moved = 0;
    let reused = 0;
    const adopted: AdoptedState = {
      outputTokenIds: handoff.outputTokenIds, numCachedTokens: handoff.numCachedTokens, timestamps: handoff.timestamps,
    };
    const request = this.scheduler.adoptRequest(handoff.request, nowMs, adopted, {
      numTokens: handoff.numComputedTokens, blockHashes: handoff.blockHashes,
      fill: (_table, fromBlock, toBlock) => {
        reused = fromBlock;
        moved = toBlock - fromBlock;
      },
    });
    if (request === null) return null;
    const { sampling } = handoff.request;
    const matchers = [new StopStringMatcher(sampling.stop, sampling.includeStopStrInOutput, sampling.minTokens)];
    for (const tokenId of handoff.outputTokenIds) matchers[0]!.push(syntheticWord(tokenId)); // its text went out from the prefill worker
    this.states.set(request.id, { request, seed: handoff.sampler.seed, matchers });
    const bytes = moved * this.kv.blockSize * kvBytesPerToken(this.model);
    const startMs = pending.transferStartMs;
    const ms = nowMs - startMs;
    request.timestamps.kvTransfer = { start: startMs, end: nowMs, bytes, blocks: moved };
    const transfer: KvTransferStats = {
      requestId: request.id, sourceId: pending.sourceId, channel: 'simulated', blocks: moved, reusedBlocks: reused, bytes,
      runs: moved * 2 * this.model.numLayers, startMs, endMs: nowMs, ms, gbPerSec: ms > 0 ? bytes / ms / 1e6 : 0,
    };
    const result: AdoptedResult = { requestId: request.id, status: 'imported', transfer };
    this.adoptedOut.push(result);
    return result;
  }

  private retryAdoptions(nowMs: number): void {
    while (this.pendingAdoptions.length > 0) {
      if (this.tryAdopt(this.pendingAdoptions[0]!, nowMs) === null) return;
      this.pendingAdoptions.shift();
    }
  }

  /** Prompt tokens this worker's prefix cache would give the request now (what a KV-aware router estimates). */
  cachedPrefixTokens(promptTokenIds: readonly number[], cacheSalt?: string): number {
    return this.kv.findCachedPrefix(this.kv.createTable({ cacheSalt }), promptTokenIds).numTokens;
  }

  takeKvEvents(): KvEvent[] {
    return this.kv.takeEvents();
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

  load(): SimWorkerLoad {
    const { running, waiting } = this.scheduler.sequences();
    let activePrefillTokens = 0;
    let activeDecodeBlocks = 0;
    for (const sequence of waiting) activePrefillTokens += sequence.numTokens;
    for (const sequence of running) {
      const remaining = sequence.numTokens - sequence.numComputedTokens;
      if (remaining > 1) activePrefillTokens += remaining;
      activeDecodeBlocks += sequence.blockTable.blocks.length;
    }
    return {
      numRunning: running.length, numWaiting: waiting.length, activePrefillTokens, activeDecodeBlocks,
      kvUsage: this.kv.pool.numUsedBlocks / this.kv.numBlocks,
    };
  }

  // -------------------------------------------------------------------------------------------------------------

  /** The synthetic word of one token through the stop-string matcher, shaped as the local engine shapes it. */
  private emitToken(state: RequestState, index: number, tokenId: number, finish: FinishReason | null,
    stopTokenId: number | null, nowMs: number): EngineOutput {
    const { request } = state;
    const matcher = state.matchers[index]!;
    let text = '';
    let reason: FinishReason | undefined = finish ?? undefined;
    let stopReason: string | number | undefined = stopTokenId ?? undefined;
    // A stop token's own text is left out unless asked for, as in the local engine.
    const endsOnStopToken = finish === 'stop' && stopTokenId === tokenId;
    if (!endsOnStopToken || request.sampling.includeStopStrInOutput) {
      const piece = matcher.push(syntheticWord(tokenId));
      text += piece.text;
      if (piece.stopped !== undefined) {
        reason = 'stop';
        stopReason = piece.stopped;
        this.scheduler.finish(request.id, 'stop', { index, nowMs });
      }
    }
    if (reason !== undefined && matcher.stopped === undefined) text += matcher.flush();
    // The sim chooses each token with certainty, so the chosen token's logprob is 0 and it has no alternatives.
    const logprobs: TokenLogprob[] | undefined = request.sampling.logprobs !== null ? [{ tokenId, logprob: 0, top: [] }] : undefined;
    return this.output(state, index, [tokenId], text, reason, stopReason, undefined, logprobs);
  }

  private output(state: RequestState, index: number, newTokenIds: number[], textDelta: string,
    finishReason: FinishReason | undefined, stopReason: string | number | undefined, error?: string,
    logprobs?: TokenLogprob[]): EngineOutput {
    const { request } = state;
    const sequence = request.sequences[index];
    const output: EngineOutput = {
      requestId: request.id, index, newTokenIds, textDelta, logprobs, finishReason, stopReason, error,
      usage: {
        promptTokens: request.promptTokenIds.length,
        completionTokens: sequence ? sequence.outputTokenIds.length : 0,
        cachedTokens: request.numCachedTokens,
      },
      // A snapshot: the request's own timestamps keep changing after this output is handed out.
      timestamps: copyTimestamps(request.timestamps),
    };
    const { traceparent } = request.engineRequest;
    if (traceparent !== undefined) output.traceparent = traceparent;
    return output;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// SimEngine: the async Engine face

export interface SimEngineOptions extends SimWorkerConfig {
  /**
   * Simulated milliseconds per real millisecond (default 1). Infinity runs steps back to back as fast as the host
   * can; then the timings depend only on the arrivals (arrivalMs) and not on the host.
   */
  speedUp?: number;
  /** The virtual clock at construction. Default: the engine clock (engineNow) for a finite speedUp, else 0. */
  startMs?: number;
}

export class SimEngineClosedError extends Error {
  override name = 'SimEngineClosedError';
}

/**
 * A simulated worker behind the `Engine` interface. A request arrives at max(arrivalMs, now at submission) on the
 * virtual clock and joins the first step that starts at or after its arrival (an arrival in the future waits for
 * it); each step lasts what the performance model says, and outputs are stamped with virtual times. With a finite speedUp the virtual clock never runs behind real time x speedUp, and a step
 * never ends earlier in real time than its simulated duration / speedUp.
 */
export class SimEngine implements Engine {
  readonly worker: SimWorker;
  readonly speedUp: number;
  private virtualMs: number;
  private readonly realStartMs: number;
  private readonly virtualStartMs: number;
  /** Requests whose arrival time has not come yet, by arrival time then submission order. */
  private pending: EngineRequest[] = [];
  private readonly streams = new Map<string, OutputStream>();
  private readonly kvEventListeners = new Set<(events: KvEvent[]) => void>();
  private loop: Promise<void> | null = null;
  /** Ends the loop's current wait early; idleWait says whether it is an idle wait (a new arrival may end it). */
  private cancelWait: (() => void) | undefined;
  private idleWait = false;
  private closed = false;
  /** Disaggregated serving: prefill streams, requests to add as handoffs, KV transfers in flight (by end time). */
  private readonly prefills = new Map<string, PrefillStream>();
  private readonly handoffIds = new Set<string>();
  private transfers: { handoff: KvHandoff; sourceId: string | null; startMs: number; endMs: number }[] = [];
  private readonly adoptedListeners = new Set<(result: AdoptedResult) => void>();

  constructor(options: SimEngineOptions) {
    this.worker = new SimWorker(options);
    this.speedUp = options.speedUp ?? 1;
    if (!(this.speedUp > 0)) throw new RangeError(`speedUp must be > 0 (Infinity: as fast as possible), got ${options.speedUp}`);
    this.virtualStartMs = options.startMs ?? (Number.isFinite(this.speedUp) ? engineNow() : 0);
    this.virtualMs = this.virtualStartMs;
    this.realStartMs = performance.now();
  }

  get info(): EngineInfo {
    return this.worker.info;
  }

  get role(): WorkerRole {
    return this.worker.role;
  }

  /** The link handed-off KV crosses to reach this worker. */
  get kvLink(): LinkProfile {
    return this.worker.kvLink;
  }

  /** The pool's shape (there are no bytes: a simulated pool is not shared). */
  get kvLayout(): KvPoolLayout {
    return this.worker.kvLayout;
  }

  /** The engine clock: virtual milliseconds. Stamp EngineRequest.arrivalMs with it. */
  now(): number {
    if (!Number.isFinite(this.speedUp)) return this.virtualMs;
    return Math.max(this.virtualMs, this.virtualStartMs + (performance.now() - this.realStartMs) * this.speedUp);
  }

  generate(request: EngineRequest): AsyncIterable<EngineOutput> {
    if (this.closed) throw new SimEngineClosedError('engine is closed');
    if (this.streams.has(request.id) || this.prefills.has(request.id)) {
      throw new InvalidRequestError('duplicate_request_id', request.id, 'a request with this id is already running');
    }
    const stream = new OutputStream(request.sampling.n);
    this.streams.set(request.id, stream);
    this.enqueue(request);
    return followQueue(this.streams, request.id, stream, (id) => this.abort(id));
  }

  abort(requestId: string): void {
    if (this.closed) return;
    const at = this.pending.findIndex((r) => r.id === requestId);
    if (at >= 0) {
      const [request] = this.pending.splice(at, 1);
      const stream = this.streams.get(requestId);
      for (let index = 0; index < request!.sampling.n; index++) {
        const output = notStartedOutput(request!, index, this.now());
        stream?.push(output);
        this.prefills.get(requestId)?.pushOutput(output);
      }
      this.streams.delete(requestId);
      this.prefills.delete(requestId);
      this.handoffIds.delete(requestId);
      return;
    }
    const inTransfer = this.transfers.findIndex((t) => t.handoff.requestId === requestId);
    if (inTransfer >= 0) {
      const { handoff } = this.transfers.splice(inTransfer, 1)[0]!;
      this.streams.get(requestId)?.push({
        ...notStartedOutput(handoff.request, 0, this.now()),
        usage: { promptTokens: handoff.request.promptTokenIds.length, completionTokens: handoff.outputTokenIds.length, cachedTokens: handoff.numCachedTokens },
      });
      this.streams.delete(requestId);
      return;
    }
    this.deliver(this.worker.abort(requestId, this.now()));
  }

  // -------------------------------------------------------------------------------------------------------------
  // Disaggregated serving (same faces as LocalEngine's)

  /** Prefill worker: the prompt and the first token, then the handoff (blocks pinned until releaseHandoff). */
  prefill(request: EngineRequest): AsyncIterable<PrefillEvent> {
    if (this.closed) throw new SimEngineClosedError('engine is closed');
    if (this.streams.has(request.id) || this.prefills.has(request.id)) {
      throw new InvalidRequestError('duplicate_request_id', request.id, 'a request with this id is already running');
    }
    const stream = new PrefillStream();
    this.prefills.set(request.id, stream);
    this.handoffIds.add(request.id);
    this.enqueue(request);
    return followQueue(this.prefills, request.id, stream, (id) => this.abort(id));
  }

  releaseHandoff(requestId: string): void {
    this.worker.releaseHandoff(requestId);
  }

  /**
   * Decode worker: continues a handed-off request once its missing blocks have crossed kvLink (the time
   * SimWorker.planTransfer prices now, on this engine's virtual clock).
   */
  adopt(handoff: KvHandoff, sourceId: string | null): AsyncIterable<EngineOutput> {
    const requestId = handoff.requestId;
    if (this.closed) throw new SimEngineClosedError('engine is closed');
    if (this.streams.has(requestId) || this.prefills.has(requestId)) {
      throw new InvalidRequestError('duplicate_request_id', requestId, 'a request with this id is already running');
    }
    const stream = new OutputStream(1);
    this.streams.set(requestId, stream);
    const startMs = this.now();
    const endMs = startMs + this.worker.planTransfer(handoff).ms;
    let at = this.transfers.length;
    while (at > 0 && this.transfers[at - 1]!.endMs > endMs) at--;
    this.transfers.splice(at, 0, { handoff, sourceId, startMs, endMs });
    this.wake();
    return followQueue(this.streams, requestId, stream, (id) => this.abort(id));
  }

  onAdopted(listener: (result: AdoptedResult) => void): () => void {
    this.adoptedListeners.add(listener);
    return () => this.adoptedListeners.delete(listener);
  }

  stats(): EngineStats {
    return this.worker.stats();
  }

  load(): SimWorkerLoad {
    return this.worker.load();
  }

  /** Subscribes to the KV cache's events (sent only with enableKvEvents); returns the unsubscribe function. */
  onKvEvents(listener: (events: KvEvent[]) => void): () => void {
    this.kvEventListeners.add(listener);
    return () => this.kvEventListeners.delete(listener);
  }

  /** Resolves when no request is pending or running (the step loop has stopped). */
  async idle(): Promise<void> {
    while (this.loop) await this.loop;
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    for (const [id, stream] of this.streams) stream.fail(new SimEngineClosedError(`engine closed while request ${id} was running`));
    this.streams.clear();
    for (const [id, stream] of this.prefills) stream.fail(new SimEngineClosedError(`engine closed while request ${id} was prefilling`));
    this.prefills.clear();
    this.transfers = [];
    this.pending = [];
    this.cancelWait?.();
    await this.loop;
  }

  // -------------------------------------------------------------------------------------------------------------

  private enqueue(submitted: EngineRequest): void {
    // An arrival stamped before now on this clock comes from another clock or was submitted late: it arrives now,
    // so its timings count only what the simulated worker did. (One that waits for a step in flight keeps its time.)
    const nowMs = this.now();
    const request = submitted.arrivalMs < nowMs ? { ...submitted, arrivalMs: nowMs } : submitted;
    // Stable insertion by arrival: equal arrivals keep submission order, which the scheduler then keeps too.
    let at = this.pending.length;
    while (at > 0 && this.pending[at - 1]!.arrivalMs > request.arrivalMs) at--;
    this.pending.splice(at, 0, request);
    this.wake();
  }

  /** Starts the loop, or cuts its idle wait short: something new may be due before what it waits for. */
  private wake(): void {
    if (this.loop) {
      if (this.idleWait) this.cancelWait?.();
    } else this.loop = this.run().finally(() => { this.loop = null; });
  }

  /** The next arrival or transfer end, whichever comes first (undefined when neither is pending). */
  private nextArrivalMs(): number | undefined {
    const arrival = this.pending[0]?.arrivalMs;
    const transfer = this.transfers[0]?.endMs;
    if (arrival === undefined) return transfer;
    return transfer === undefined ? arrival : Math.min(arrival, transfer);
  }

  /** Moves every request whose arrival has come into the worker; one that can never run fails its stream. */
  private admitArrivals(nowMs: number): void {
    while (this.pending.length > 0 && this.pending[0]!.arrivalMs <= nowMs) {
      this.add(this.pending.shift()!, nowMs);
    }
    let adopted = false;
    while (this.transfers.length > 0 && this.transfers[0]!.endMs <= nowMs) {
      const { handoff, sourceId, startMs } = this.transfers.shift()!;
      try {
        this.worker.adopt(handoff, nowMs, startMs, sourceId ?? '');
        adopted = true;
      } catch (error) {
        this.streams.get(handoff.requestId)?.fail(error instanceof Error ? error : new Error(String(error)));
        this.streams.delete(handoff.requestId);
      }
    }
    if (adopted) this.deliver([]);
  }

  private add(request: EngineRequest, nowMs: number): void {
    const handoff = this.handoffIds.delete(request.id);
    try {
      this.worker.add(request, nowMs, { handoff });
    } catch (error) {
      const failure = error instanceof Error ? error : new Error(String(error));
      this.streams.get(request.id)?.fail(failure);
      this.streams.delete(request.id);
      this.prefills.get(request.id)?.fail(failure);
      this.prefills.delete(request.id);
    }
  }

  private async run(): Promise<void> {
    // Starting on a later macrotask lets every request submitted in the same tick join the first step.
    await new Promise<void>((resolve) => setImmediate(resolve));
    while (!this.closed) {
      this.admitArrivals(this.now());
      if (!this.worker.hasWork) {
        const nextMs = this.nextArrivalMs();
        if (nextMs === undefined) return;
        await this.advanceTo(nextMs);
        continue;
      }
      const startMs = this.now();
      this.virtualMs = startMs;
      const step = this.worker.beginStep(startMs);
      if (step === null) {
        // Requests exist but none can be scheduled (cannot happen with a consistent scheduler); do not spin.
        await new Promise<void>((resolve) => setImmediate(resolve));
        continue;
      }
      await this.advanceTo(step.endMs);
      if (this.closed) return;
      this.virtualMs = step.endMs;
      this.deliver(this.worker.finishStep(step));
    }
  }

  /**
   * Lets virtual time reach targetMs. Infinity: jump, yielding to the event loop once so consumers and aborts run.
   * Finite: sleep until real time catches up with it (a new request may wake an idle wait early).
   */
  private async advanceTo(targetMs: number): Promise<void> {
    if (!Number.isFinite(this.speedUp)) {
      await new Promise<void>((resolve) => setImmediate(resolve));
      const nextMs = this.nextArrivalMs();
      if (this.worker.currentStep === null && nextMs !== undefined && nextMs < targetMs) return;
      this.virtualMs = Math.max(this.virtualMs, targetMs);
      return;
    }
    const realDeadlineMs = this.realStartMs + (targetMs - this.virtualStartMs) / this.speedUp;
    const waitMs = realDeadlineMs - performance.now();
    if (waitMs <= 0) {
      await new Promise<void>((resolve) => setImmediate(resolve));
      return;
    }
    // Only an idle wait is cut short by a new arrival; a step's duration is not. close() cuts either.
    this.idleWait = this.worker.currentStep === null;
    await new Promise<void>((resolve) => {
      const done = () => {
        clearTimeout(timer);
        this.cancelWait = undefined;
        this.idleWait = false;
        resolve();
      };
      const timer = setTimeout(done, waitMs);
      this.cancelWait = done;
    });
  }

  private deliver(outputs: EngineOutput[]): void {
    for (const output of outputs) {
      const stream = this.streams.get(output.requestId);
      if (!stream) {
        const prefill = this.prefills.get(output.requestId);
        prefill?.pushOutput(output);
        if (prefill?.done) this.prefills.delete(output.requestId);
        continue;
      }
      stream.push(output);
      if (stream.done) this.streams.delete(output.requestId);
    }
    for (const handoff of this.worker.takeHandoffs()) {
      const prefill = this.prefills.get(handoff.requestId);
      this.prefills.delete(handoff.requestId);
      // Nobody waits for it any more: its blocks must not stay pinned.
      if (prefill) prefill.pushHandoff(handoff);
      else this.worker.releaseHandoff(handoff.requestId);
    }
    for (const result of this.worker.takeAdopted()) for (const listener of this.adoptedListeners) listener(result);
    const events = this.worker.takeKvEvents();
    if (events.length > 0) for (const listener of this.kvEventListeners) listener(events);
  }
}

/** The closing output of a request aborted before it arrived at the worker. */
function notStartedOutput(request: EngineRequest, index: number, nowMs: number): EngineOutput {
  return {
    requestId: request.id, index, newTokenIds: [], textDelta: '', finishReason: 'abort',
    usage: { promptTokens: request.promptTokenIds.length, completionTokens: 0, cachedTokens: 0 },
    timestamps: { arrival: request.arrivalMs, prefillChunks: [], finished: nowMs },
    ...(request.traceparent !== undefined ? { traceparent: request.traceparent } : {}),
  };
}
