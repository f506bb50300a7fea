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

import type { KvEvent } from '../engine/kv-cache/events.ts';
import type { BlockTable } from '../engine/kv-cache/manager.ts';
import { engineNow } from '../engine/clock.ts';
import { followQueue, OutputStream } from '../engine/streams.ts';
import {
  PrefillStream, type AdoptedResult, type KvHandoff, type KvPoolLayout, type KvTransferStats, type PrefillEvent,
} from '../engine/handoff.ts';
import { EngineClosedError, InvalidRequestError } from '../engine/errors.ts';
import type { StepPlan } from '../engine/scheduler.ts';
import {
  rowKey, StepCore, type KvImport, type TextSource, type TokenSource, type WorkerLoadReport,
} from '../engine/step-core.ts';
import { StopStringMatcher } from '../engine/stop-strings.ts';
import type {
  Engine, EngineInfo, EngineOutput, EngineRequest, EngineStats, FinishReason,
  SchedulingPolicy, TokenLogprob, WorkerRole,
} from '../engine/types.ts';
import { hashString, mix32, mixInto } from '../util/random.ts';
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

/** What a worker would report to the router's load view. */
export type SimWorkerLoad = WorkerLoadReport;

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
  let h = mixInto(mixInto(mixInto(mix32(seed >>> 0), seedHigh), index), position);
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

/** How long a handed-off request's missing blocks take to reach this worker, priced when the transfer starts. */
export interface SimTransferPlan {
  requestId: string;
  blocks: number;
  reusedBlocks: number;
  bytes: number;
  ms: number;
}

export class SimWorker extends StepCore<number> {
  readonly model: ModelProfile;
  readonly hw: HardwareProfile;
  readonly tp: number;
  readonly efficiency: Efficiency;
  readonly info: EngineInfo;
  private readonly eosTokenId: number;
  private readonly eosProbability: number;
  private inFlight: SimStep | null = null;
  private numStepsRun = 0;
  private busyTimeMs = 0;
  readonly role: WorkerRole;
  readonly kvLink: LinkProfile;
  readonly kvParallelLinks: number;

  constructor(config: SimWorkerConfig) {
    const { model, hw, tp } = config;
    checkTensorParallel(model, hw, tp);
    const eosTokenId = config.eosTokenId ?? model.vocabSize - 1;
    if (!Number.isInteger(eosTokenId) || eosTokenId < 0 || eosTokenId >= model.vocabSize) {
      throw new RangeError(`eosTokenId must be a token id below ${model.vocabSize}, got ${config.eosTokenId}`);
    }
    const eosProbability = config.eosProbability ?? 0;
    if (!(eosProbability >= 0 && eosProbability <= 1)) {
      throw new RangeError(`eosProbability must be in [0, 1], got ${config.eosProbability}`);
    }
    const blockSize = config.blockSize ?? SIM_DEFAULTS.blockSize;
    super({
      // The pool's shape as a transfer sees it (the sim has no bytes; the real engine's layout names the same
      // sizes). KV elements count as 2 bytes ('f16'): BF16, the profiles' usual kvBytesPerElement.
      kvLayout: {
        numLayers: model.numLayers, numBlocks: simKvBlocks(config), blockSize,
        numKvHeads: model.numKvHeads, headDim: model.headDim, dtype: 'f16',
      },
      enablePrefixCaching: config.enablePrefixCaching, enableKvEvents: config.enableKvEvents,
      policy: config.policy, maxNumSeqs: config.maxNumSeqs ?? SIM_DEFAULTS.maxNumSeqs,
      maxNumBatchedTokens: config.maxNumBatchedTokens ?? SIM_DEFAULTS.maxNumBatchedTokens,
      maxModelLen: config.maxModelLen ?? SIM_DEFAULTS.maxModelLen, eosTokenIds: [eosTokenId],
      longPrefillTokenThreshold: config.longPrefillTokenThreshold,
      tokens: SYNTHETIC_TOKENS, text: SYNTHETIC_TEXT,
    });
    this.model = model;
    this.hw = hw;
    this.tp = tp;
    this.efficiency = config.efficiency ?? DEFAULT_EFFICIENCY;
    this.eosTokenId = eosTokenId;
    this.eosProbability = eosProbability;
    this.info = {
      modelName: model.name, maxModelLen: this.scheduler.maxModelLen, vocabSize: model.vocabSize,
      kvCapacityTokens: this.kv.numBlocks * blockSize, blockSize, backend: 'sim',
      kernelVariants: { gpu: `${hw.id} x${tp}` }, threads: 1,
    };
    this.role = config.role ?? 'both';
    this.kvLink = config.kvLink?.link ?? INFINIBAND_NDR;
    this.kvParallelLinks = config.kvLink?.parallelLinks ?? tp;
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
    this.addRequest(engineRequest, nowMs, options);
  }

  /** Stops a request in any state and frees its blocks; returns the closing output of each unfinished completion. */
  abort(requestId: string, nowMs: number, reason: FinishReason = 'abort', error?: string): EngineOutput[] {
    return this.abortRequest(requestId, nowMs, reason, error);
  }

  /**
   * Plans the next step at nowMs and prices it. Null when nothing can run (no requests). Until finishStep, the
   * plan is outstanding: aborts may still arrive (their rows are then ignored), new requests wait for the next step.
   */
  beginStep(nowMs: number): SimStep | null {
    if (this.inFlight) throw new Error(`step ${this.inFlight.plan.stepId} is still in flight`);
    const plan = this.planStep(nowMs);
    if (plan === null) return null;
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
    const { plan } = step;
    const logprobs = new Map<string, TokenLogprob>();
    const tokenIds = plan.sampleTargets.map((target) => {
      const { request, completionIndex } = target;
      // The position the new token takes; a sample about to fork starts right after the prompt.
      const position = request.sequences[completionIndex]?.numTokens ?? request.promptTokenIds.length;
      const tokenId = syntheticToken(this.tokenState(request.id, completionIndex) ?? 0, completionIndex, position, {
        vocabSize: this.model.vocabSize, eosTokenId: this.eosTokenId, eosProbability: this.eosProbability,
        avoid: request.sampling.stopTokenIds,
      });
      // The sim chooses each token with certainty, so its logprob is 0 and it has no alternatives.
      if (request.sampling.logprobs !== null) logprobs.set(rowKey(request.id, completionIndex), { tokenId, logprob: 0, top: [] });
      return tokenId;
    });
    // Planning takes no simulated time: the forward pass starts when the step does.
    return this.applyStep(plan, tokenIds, logprobs, step.startMs, step.endMs);
  }

  // -------------------------------------------------------------------------------------------------------------
  // Disaggregated serving: the same core as the real engine, with transfer time instead of bytes

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
    return this.adoptHandoff(handoff, nowMs, new SimulatedTransfer(this.model, this.kv.blockSize, transferStartMs, sourceId));
  }

  /** Prompt tokens this worker's prefix cache would give the request now (what a KV-aware router estimates). */
  cachedPrefixTokens(promptTokenIds: readonly number[], cacheSalt?: string): number {
    return this.kv.findCachedPrefix(this.kv.createTable({ cacheSalt }), promptTokenIds).numTokens;
  }
}

/** Synthetic tokens are a function of (seed, completion, position): the seed is the whole token state. */
const SYNTHETIC_TOKENS: TokenSource<number> = {
  open: (request) => new Array<number>(request.sampling.n).fill(request.sampling.seed ?? hashString(request.id)),
  resume: (handoff) => handoff.sampler.seed,
  handoffSeed: (request) => hashString(request.id),
  handoffState: (_request, seed) => ({ seed, rngState: [seed >>> 0, Math.floor(seed / 0x1_0000_0000) >>> 0, 0, 0] }),
};

/** Each token's synthetic word through the request's stop strings. */
const SYNTHETIC_TEXT: TextSource = {
  open: (sampling) => {
    const matcher = new StopStringMatcher(sampling.stop, sampling.includeStopStrInOutput);
    let finished = false;
    return {
      push: (tokenId) => {
        const piece = matcher.push(syntheticWord(tokenId));
        return piece.stopped !== undefined ? { delta: piece.text, stopped: piece.stopped } : { delta: piece.text };
      },
      finish: () => {
        const delta = finished || matcher.stopped !== undefined ? '' : matcher.flush();
        finished = true;
        return { delta };
      },
      get done() {
        return finished || matcher.stopped !== undefined;
      },
    };
  },
};

/** A handed-off request's missing blocks as a transfer over the link, which took from its start until adoption. */
class SimulatedTransfer implements KvImport {
  private moved = 0;
  private reused = 0;

  constructor(private readonly model: ModelProfile, private readonly blockSize: number,
    private readonly startMs: number, private readonly sourceId: string) {}

  fill(_table: BlockTable, fromBlock: number, toBlock: number): void {
    this.reused = fromBlock;
    this.moved = toBlock - fromBlock;
  }

  stats(requestId: string, nowMs: number): KvTransferStats {
    const bytes = this.moved * this.blockSize * kvBytesPerToken(this.model);
    const ms = nowMs - this.startMs;
    return {
      requestId, sourceId: this.sourceId, channel: 'simulated', blocks: this.moved, reusedBlocks: this.reused, bytes,
      runs: this.moved * 2 * this.model.numLayers, startMs: this.startMs, endMs: nowMs, ms, gbPerSec: ms > 0 ? bytes / ms / 1e6 : 0,
    };
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

/**
 * A simulated worker behind the `Engine` interface. A request arrives at max(arrivalMs, now at submission) on the
 * virtual clock and joins the first step that starts at or after its arrival (an arrival in the future waits for
 * it); each step lasts what the performance model says, and outputs are stamped with virtual times. With a finite speedUp the virtual clock never runs behind real time x speedUp, and a step
 * never ends earlier in real time than its simulated duration / speedUp.
 */
export class SimEngine implements Engine {
  readonly worker: SimWorker;
  readonly info: EngineInfo;
  readonly role: WorkerRole;
  /** The link handed-off KV crosses to reach this worker. */
  readonly kvLink: LinkProfile;
  /** The pool's shape (there are no bytes: a simulated pool is not shared). */
  readonly kvLayout: KvPoolLayout;
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
    this.info = this.worker.info;
    this.role = this.worker.role;
    this.kvLink = this.worker.kvLink;
    this.kvLayout = this.worker.kvLayout;
    this.speedUp = options.speedUp ?? 1;
    if (!(this.speedUp > 0)) throw new RangeError(`speedUp must be > 0 (Infinity: as fast as possible), got ${options.speedUp}`);
    this.virtualStartMs = options.startMs ?? (Number.isFinite(this.speedUp) ? engineNow() : 0);
    this.virtualMs = this.virtualStartMs;
    this.realStartMs = performance.now();
  }

  /** The engine clock: virtual milliseconds. Stamp EngineRequest.arrivalMs with it. */
  now(): number {
    if (!Number.isFinite(this.speedUp)) return this.virtualMs;
    return Math.max(this.virtualMs, this.virtualStartMs + (performance.now() - this.realStartMs) * this.speedUp);
  }

  generate(request: EngineRequest): AsyncIterable<EngineOutput> {
    if (this.closed) throw new EngineClosedError('engine is closed');
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
    if (this.closed) throw new EngineClosedError('engine is closed');
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
    if (this.closed) throw new EngineClosedError('engine is closed');
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
    for (const [id, stream] of this.streams) stream.fail(new EngineClosedError(`engine closed while request ${id} was running`));
    this.streams.clear();
    for (const [id, stream] of this.prefills) stream.fail(new EngineClosedError(`engine closed while request ${id} was prefilling`));
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
