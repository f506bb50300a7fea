// One simulated worker, synchronous and clockless: Conduit's real scheduler and paged KV cache (the step core
// shared with the real engine, src/engine/step-core.ts) with no model behind them. beginStep(nowMs) plans a step
// and the performance model prices it (prefill chunks and decodes on the chosen GPUs); finishStep(step) applies it
// at its end time with synthetic tokens (synthetic-tokens.ts). Everything that depends on the token ids (prefix-cache
// hits, block hashes, KV events) is real. SimCluster (cluster.ts) drives many of these on one virtual clock;
// SimEngine (sim-engine.ts) puts one behind the Engine interface.

import type { AdoptedResult, KvHandoff, KvTransferStats } from '../engine/handoff.ts';
import type { BlockTable } from '../engine/kv-cache/manager.ts';
import { promptLogprobTargets, type StepPlan } from '../engine/scheduler.ts';
import type { EngineStats } from '../protocols/worker.ts';
import { DEFAULT_BLOCK_SIZE } from '../protocols/block-hash.ts';
import { rowKey, StepCore, type KvImport } from '../engine/step-core.ts';
import type {
  EngineInfo, EngineOutput, EngineRequest, FinishReason, SchedulingPolicy, TokenLogprob, WorkerRole,
} from '../engine/types.ts';
import { getHardwareProfile, hostTierFor, INFINIBAND_NDR, NVME_GEN4, type HardwareProfile, type KvTierProfile, type LinkProfile } from './hardware.ts';
import { KvTiers, RamKvTier, type KvBlockIo } from '../engine/kv-cache/tiers.ts';
import { getModelProfile, kvBytesPerToken, paramCount, type ModelProfile } from './models.ts';
import {
  DEFAULT_EFFICIENCY, checkTensorParallel, kvBytesPerTokenPerGpu, kvCapacityBlocks, kvTransferTimeMs, loraParamCount, stepTimeMs,
  type Efficiency, type SimLoraTarget,
  type PrefillChunk, type StepLora, type StepShape,
} from './perf-model.ts';
import { SYNTHETIC_TEXT, SYNTHETIC_TOKENS, syntheticToken } from './synthetic-tokens.ts';
import { IncrementalDetokenizer } from '../engine/detokenizer.ts';
import { InvalidRequestError, LoraLoadError } from '../engine/errors.ts';
import { GREEDY_TEMPERATURE } from '../engine/sampler.ts';
import { GrammarError, type GrammarLoader, type GuidedSequence } from '../engine/grammar/runtime.ts';
import type { TextSource, TokenSource } from '../engine/step-core.ts';
import type { Tokenizer } from '../model/tokenizer/types.ts';
import { mix32, mixInto } from '../util/random.ts';

// ---------------------------------------------------------------------------------------------------------------
// Configuration

/** Defaults follow vLLM's online-serving settings on a data-centre GPU. */
export const SIM_DEFAULTS = Object.freeze({
  blockSize: DEFAULT_BLOCK_SIZE,
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
   * KV pool in blocks. Default: what HBM holds after the weights, per GPU (kvCapacityBlocks at memoryUtilization).
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
  /**
   * Lower KV tiers under the pool, as the cpu engine has them (--kv-offload-memory, --kv-offload-disk): bytes of
   * host RAM and of local disk (NVMe) for this worker, and their profiles (default: host DRAM over the GPU's PCIe,
   * NVMe Gen4). The scheduler, cache and events are the real ones; an onboard lengthens the step that does it by
   * the bytes over the tier's bandwidth, and offloads cost nothing on the step (DMA beside compute).
   */
  kvTiers?: { ramBytes?: number; diskBytes?: number; ram?: KvTierProfile; disk?: KvTierProfile };
  /**
   * The vocabulary's tokenizer and its grammars, for guided requests (sampling.guided): their tokens are drawn
   * among those the grammar allows and their text is the tokenizer's, not synthetic words. Without them a guided
   * request is refused.
   */
  tokenizer?: Tokenizer;
  grammar?: GrammarLoader;
}

/** No bytes in a simulated pool: the tiers keep hashes and count blocks. */
const NO_BYTES = new Uint8Array(0);

/** A simulated worker's lower tiers, or undefined when it has none. */
function simKvTiers(config: SimWorkerConfig, blockSize: number): { tiers: KvTiers; io: KvBlockIo } | undefined {
  const spec = config.kvTiers;
  if (spec === undefined || ((spec.ramBytes ?? 0) <= 0 && (spec.diskBytes ?? 0) <= 0)) return undefined;
  const blockBytes = blockSize * kvBytesPerToken(config.model);
  const ram = spec.ram ?? hostTierFor(config.hw);
  const disk = spec.disk ?? NVME_GEN4;
  const shards = (profile: KvTierProfile) => (profile.perGpu ? config.tp : 1);
  const msPerBlock = (profile: KvTierProfile) => (blockBytes / shards(profile) / profile.bytesPerSec) * 1000;
  const diskBlocks = Math.floor((spec.diskBytes ?? 0) / blockBytes);
  const tiers = new KvTiers({
    blockBytes, ramBytes: spec.ramBytes ?? 0,
    ...(diskBlocks > 0 ? { disk: new RamKvTier(diskBlocks, undefined, 'disk') } : {}),
    // One transfer latency per tier touched, then the bytes: the onboard's price, and the cost model's estimate of it.
    bandwidth: { ram: (ram.bytesPerSec * shards(ram)) / 1000, disk: (disk.bytesPerSec * shards(disk)) / 1000 },
    latencyMs: { ram: ram.latencyUs / 1000, disk: disk.latencyUs / 1000 },
    priceOnboard: ({ ram: r, disk: d }) => (r > 0 ? ram.latencyUs / 1000 + r * msPerBlock(ram) : 0)
      + (d > 0 ? disk.latencyUs / 1000 + d * msPerBlock(disk) : 0),
    windowBlocks: 2 * Math.ceil((config.maxNumBatchedTokens ?? SIM_DEFAULTS.maxNumBatchedTokens) / blockSize),
  });
  return { tiers, io: { blockBytes, read: () => NO_BYTES, write: () => {} } };
}

/** A completion's synthetic-token state: its seed, and the grammar's state for a guided request. */
interface SimTokenState {
  seed: number;
  guided?: GuidedSequence;
}

function simTokens(grammar: GrammarLoader | undefined): TokenSource<SimTokenState> {
  const attach = (request: EngineRequest, states: SimTokenState[]): SimTokenState[] => {
    const spec = request.sampling.guided;
    if (spec === undefined) return states;
    const runtime = grammar?.current;
    if (runtime === undefined) throw new InvalidRequestError('invalid_request', request.id, 'guided decoding is not available on this worker');
    try {
      for (const state of states) state.guided = runtime.open(spec);
    } catch (error) {
      for (const state of states) state.guided?.dispose();
      if (error instanceof GrammarError) throw new InvalidRequestError('invalid_request', request.id, error.message);
      throw error;
    }
    return states;
  };
  return {
    open: (request) => {
      const states = attach(request, SYNTHETIC_TOKENS.open(request).map((seed) => ({ seed })));
      // A migrated request: the grammar goes on after the output its lost worker produced (as a cpu worker's does).
      for (const tokenId of request.priorOutputTokenIds ?? []) {
        if (states.every((state) => state.guided?.accept(tokenId) ?? true)) continue;
        for (const state of states) state.guided?.dispose();
        throw new InvalidRequestError('invalid_request', request.id, 'the output so far does not follow the request\'s grammar');
      }
      return states;
    },
    // The grammar goes on after the output from before a migration, then the prefill worker's tokens; one it refuses
    // means the request cannot go on under its grammar.
    resume: (handoff) => {
      const [state] = attach(handoff.request, [{ seed: SYNTHETIC_TOKENS.resume(handoff) }]);
      const guided = state!.guided;
      if (guided === undefined) return state!;
      const tokens = [...handoff.request.priorOutputTokenIds ?? [], ...handoff.outputTokenIds];
      let refused: number | undefined;
      try {
        refused = tokens.find((tokenId) => !guided.accept(tokenId));
      } catch (error) {
        guided.dispose();
        throw error;
      }
      if (refused !== undefined) {
        guided.dispose();
        throw new Error(`request ${handoff.requestId}: the request's grammar refuses token ${refused} of its output so far; it cannot go on under its grammar`);
      }
      return state!;
    },
    handoffSeed: (request) => SYNTHETIC_TOKENS.handoffSeed(request),
    handoffState: (request, state) => SYNTHETIC_TOKENS.handoffState(request, state.seed),
    close: (state) => state.guided?.dispose(),
  };
}

/** Synthetic words, except for guided requests: their tokens are real text under a grammar, so the tokenizer's. */
function simText(tokenizer: Tokenizer | undefined): TextSource {
  return {
    open: (sampling, prompt) => (sampling.guided !== undefined && tokenizer !== undefined
      ? IncrementalDetokenizer.forRequest(tokenizer, sampling, prompt) : SYNTHETIC_TEXT.open(sampling, prompt)),
  };
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
// Plan -> step shape

/**
 * What the performance model needs from a plan. A decode feeds one token after startPosition cached ones; anything
 * else (a prompt chunk, the recompute after preemption, a forked sample's partial block) is a prefill chunk whose
 * context is the tokens already in the KV cache, sampled only when it reaches the end of the sequence.
 */
export function planToStepShape(plan: StepPlan, adapters?: ReadonlyMap<string, SimLoraAdapter>): StepShape {
  const prefillTokens: PrefillChunk[] = [];
  const decodeSeqs: { contextLen: number }[] = [];
  // Tokens per distinct adapter of the step (the batched LoRA kernels read each adapter once).
  const loraTokens = new Map<string, number>();
  for (const entry of plan.scheduled) {
    if (entry.isDecode) decodeSeqs.push({ contextLen: entry.startPosition });
    else {
      prefillTokens.push({
        newTokens: entry.numNewTokens, contextLen: entry.startPosition, sampled: entry.numSamples > 0,
        ...(entry.numPromptLogprobRows > 0 ? { promptLogitsRows: entry.numPromptLogprobRows } : {}),
      });
    }
    const adapterId = entry.sequence.request.adapterId;
    if (adapterId !== undefined && adapters?.has(adapterId)) loraTokens.set(adapterId, (loraTokens.get(adapterId) ?? 0) + entry.numNewTokens);
  }
  if (loraTokens.size === 0) return { prefillTokens, decodeSeqs };
  const loras: StepLora[] = [...loraTokens].map(([id, tokens]) => {
    const { rank, targets } = adapters!.get(id)!;
    return { tokens, rank, ...(targets !== undefined ? { targets } : {}) };
  });
  return { prefillTokens, decodeSeqs, loras };
}

/** A LoRA adapter as a simulated worker holds it: only its shape, for the cost of its tokens. */
export interface SimLoraAdapter {
  rank: number;
  /** The projections it adapts (default: all). */
  targets?: readonly SimLoraTarget[];
}

/** A simulated worker that cannot exist as configured (a model too large for the GPUs given it). */
export class SimConfigError extends RangeError {
  override name = 'SimConfigError';
}

/**
 * How a command names the options that set a simulated deployment, in its refusals: `--sim-tp` (serve, worker) or
 * `--tp` (sim, plan), or `CONDUIT_SIM_TP (--sim-tp)` when the environment gave the value (the CLI's flagLabel).
 * Without them a refusal names no option: which options set the deployment is the caller's to say.
 */
export interface SimDeploymentFlags {
  model: string;
  gpu: string;
  tp: string;
}

/** SimDeploymentFlags, and the options a request's length came from (`--prompt`; `--isl with --osl`). */
export interface SimRequestFlags extends SimDeploymentFlags {
  request: string;
}

/** A lookup's or check's RangeError as SimConfigError, led by the option that set what it refuses. */
function byOption<R>(flag: string | undefined, check: () => R): R {
  try {
    return check();
  } catch (error) {
    if (error instanceof RangeError && !(error instanceof SimConfigError)) {
      throw new SimConfigError(flag === undefined ? error.message : `${flag}: ${error.message}`);
    }
    throw error;
  }
}

/**
 * The profiles a simulated deployment names (`--sim-model`, `--sim-gpu`, `--sim-tp` and their CONDUIT_SIM_ twins),
 * checked before any worker starts. The lookups and the tensor-parallel check throw RangeError, which the CLI would
 * print as a stack trace; as SimConfigError it prints as one line with exit code 2, led by the option (`flags`)
 * whose value is refused.
 */
export function resolveSimDeployment(modelId: string, gpuId: string, tp: number, flags?: SimDeploymentFlags): { model: ModelProfile; hw: HardwareProfile } {
  const model = byOption(flags?.model, () => getModelProfile(modelId));
  const hw = byOption(flags?.gpu, () => getHardwareProfile(gpuId));
  byOption(flags?.tp, () => checkTensorParallel(model, hw, tp));
  return { model, hw };
}

/**
 * A simulated deployment that can exist, as a command checks its options before anything starts: the profiles
 * (resolveSimDeployment) and a KV pool of at least one block (simKvBlocks), each refusal naming the options (`flags`).
 */
export function checkSimDeployment(spec: { model: string; gpu: string; tp: number }, flags: SimDeploymentFlags): void {
  const { model, hw } = resolveSimDeployment(spec.model, spec.gpu, spec.tp, flags);
  simKvBlocks({ model, hw, tp: spec.tp }, flags);
}

/**
 * KV blocks a worker of this configuration gets: HBM left after its weight shard, per GPU, in whole blocks. None is
 * refused, naming the options (`flags`) that would give it some.
 */
export function simKvBlocks(config: SimWorkerConfig, flags?: SimDeploymentFlags): number {
  if (config.numKvBlocks !== undefined) return config.numKvBlocks;
  const blockSize = config.blockSize ?? SIM_DEFAULTS.blockSize;
  const blocks = kvCapacityBlocks(config.model, config.hw, config.tp, blockSize,
    config.memoryUtilization ?? SIM_DEFAULTS.memoryUtilization);
  if (blocks < 1) {
    const what = `${config.model.name} on ${config.tp} x ${config.hw.name}: the weights leave no HBM for the KV cache`;
    throw new SimConfigError(flags === undefined ? `${what}; use a larger tp or a GPU with more memory`
      : `${flags.model}: ${what}; use a larger ${flags.tp} or a ${flags.gpu} with more memory`);
  }
  return blocks;
}

/**
 * The longest sequence (prompt plus output) a worker of this configuration holds, as its scheduler computes it: the
 * context length, lowered to one more than the KV pool's tokens (a sequence's last token is fed to a next step, which
 * never runs, so it needs no slot). A longer prompt is refused; a longer output is cut short with finish 'length'.
 */
export function simSequenceLimit(config: SimWorkerConfig, flags?: SimDeploymentFlags): number {
  const blockSize = config.blockSize ?? SIM_DEFAULTS.blockSize;
  return Math.min(config.maxModelLen ?? SIM_DEFAULTS.maxModelLen, simKvBlocks(config, flags) * blockSize + 1);
}

/**
 * Refuses, as SimConfigError, a request of `promptTokens` + `outputTokens` that a worker of this configuration cannot
 * hold, naming the options (`flags`) that set the request and the deployment.
 */
export function checkSimSequenceFits(config: SimWorkerConfig, promptTokens: number, outputTokens: number, flags?: SimRequestFlags): void {
  const limit = simSequenceLimit(config, flags);
  if (promptTokens + outputTokens > limit) {
    const blockSize = config.blockSize ?? SIM_DEFAULTS.blockSize;
    throw new SimConfigError(`${flags ? `${flags.request}: ` : ''}${promptTokens} prompt + ${outputTokens} output tokens do not fit one `
      + `worker of ${config.model.name} on ${config.tp} x ${config.hw.name}: it holds sequences of at most ${limit} tokens (KV pool `
      + `${simKvBlocks(config)} blocks x ${blockSize} tokens, context ${config.maxModelLen ?? SIM_DEFAULTS.maxModelLen}); use a larger `
      + `${flags ? flags.tp : 'tp'} or a shorter request`);
  }
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

export class SimWorker extends StepCore<SimTokenState> {
  readonly model: ModelProfile;
  readonly hw: HardwareProfile;
  readonly tp: number;
  readonly efficiency: Efficiency;
  readonly info: EngineInfo;
  private readonly vocabSize: number;
  private readonly eosTokenId: number;
  private readonly eosProbability: number;
  private inFlight: SimStep | null = null;
  private numStepsRun = 0;
  /** Scratch for the tokens a guided completion's grammar allows. */
  private allowed = new Int32Array(0);
  private busyTimeMs = 0;
  /** LoRA adapters held, by the name requests give (EngineRequest.lora). */
  private readonly loras = new Map<string, SimLoraAdapter>();
  readonly role: WorkerRole;
  readonly kvLink: LinkProfile;
  readonly kvParallelLinks: number;

  constructor(config: SimWorkerConfig) {
    const { model, hw, tp } = config;
    checkTensorParallel(model, hw, tp);
    const vocabSize = config.vocabSize ?? model.vocabSize;
    if (!Number.isInteger(vocabSize) || vocabSize < 2) {
      throw new RangeError(`vocabSize must be a whole number >= 2, got ${config.vocabSize}`);
    }
    const eosTokenId = config.eosTokenId ?? vocabSize - 1;
    if (!Number.isInteger(eosTokenId) || eosTokenId < 0 || eosTokenId >= vocabSize) {
      throw new RangeError(`eosTokenId must be a token id below ${vocabSize}, got ${config.eosTokenId}`);
    }
    const eosProbability = config.eosProbability ?? 0;
    if (!(eosProbability >= 0 && eosProbability <= 1)) {
      throw new RangeError(`eosProbability must be in [0, 1], got ${config.eosProbability}`);
    }
    const blockSize = config.blockSize ?? SIM_DEFAULTS.blockSize;
    const tiers = simKvTiers(config, blockSize);
    super({
      ...(tiers !== undefined ? { kvTiers: tiers.tiers, kvBlockIo: tiers.io } : {}),
      // The pool's shape as a transfer sees it (the sim has no bytes; the real engine's layout names the same
      // sizes). Its dtype reads 'f16' (2 bytes, BF16) whatever the profile's kvBytesPerElement, since no KvDtype
      // names FP8: what a transfer moves per token is SimEngine.kvTransferBytesPerToken (the profile's).
      kvLayout: {
        numLayers: model.numLayers, numBlocks: simKvBlocks(config), blockSize,
        numKvHeads: model.numKvHeads, headDim: model.headDim, dtype: 'f16',
      },
      enablePrefixCaching: config.enablePrefixCaching, enableKvEvents: config.enableKvEvents,
      policy: config.policy, maxNumSeqs: config.maxNumSeqs ?? SIM_DEFAULTS.maxNumSeqs,
      maxNumBatchedTokens: config.maxNumBatchedTokens ?? SIM_DEFAULTS.maxNumBatchedTokens,
      maxModelLen: config.maxModelLen ?? SIM_DEFAULTS.maxModelLen, eosTokenIds: [eosTokenId],
      longPrefillTokenThreshold: config.longPrefillTokenThreshold,
      tokens: simTokens(config.grammar), text: simText(config.tokenizer),
    });
    this.model = model;
    this.hw = hw;
    this.tp = tp;
    this.efficiency = config.efficiency ?? DEFAULT_EFFICIENCY;
    this.vocabSize = vocabSize;
    this.eosTokenId = eosTokenId;
    this.eosProbability = eosProbability;
    this.info = {
      modelName: model.name, maxModelLen: this.scheduler.maxModelLen, vocabSize,
      kvCapacityTokens: this.kv.numBlocks * blockSize, blockSize, backend: 'sim',
      kernelVariants: { gpu: `${hw.id} x${tp}` }, threads: 1, quantization: simWeightDtype(model.weightBytesPerParam),
      // KvDtype names the CPU engine's two storage types; a profile's 2-byte KV is reported as 'f16' (as its transfer
      // layout above says), an FP8 one is left unnamed rather than misnamed.
      ...(model.kvBytesPerElement === 2 ? { kvDtype: 'f16' as const } : {}),
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
  add(engineRequest: EngineRequest, nowMs: number, options: { handoff?: boolean; queuedMs?: number } = {}): void {
    if (engineRequest.lora !== undefined && !this.loras.has(engineRequest.lora)) {
      throw new InvalidRequestError('lora_not_loaded', engineRequest.id, `LoRA adapter '${engineRequest.lora}' is not loaded on this worker`);
    }
    this.addRequest(engineRequest, nowMs, options);
  }

  /** Holds an adapter (its shape) under `name`, as EngineCore.loadLora holds its weights. */
  loadLora(name: string, adapter: SimLoraAdapter): void {
    if (!Number.isInteger(adapter.rank) || adapter.rank < 1) throw new RangeError(`LoRA rank must be a whole number >= 1, got ${adapter.rank}`);
    if (this.loras.has(name) && this.usesLora(name)) throw new LoraLoadError('lora_in_use', `LoRA adapter '${name}' is in use`);
    this.loras.set(name, adapter);
  }

  /** Drops an adapter; refused while a request here runs with it. */
  unloadLora(name: string): void {
    if (!this.loras.has(name)) throw new LoraLoadError('lora_not_loaded', `no LoRA adapter '${name}' is loaded`);
    if (this.usesLora(name)) throw new LoraLoadError('lora_in_use', `LoRA adapter '${name}' is in use by running requests`);
    this.loras.delete(name);
  }

  /**
   * The step core's stats plus the modelled GPU memory of the worker's tp GPUs together: the weights
   * (paramCount x weightBytesPerParam), the KV pool (its blocks x the bytes a token takes on each GPU x tp, KV heads
   * replicated where tp exceeds them) and the adapters held (their parameters in BF16, as the perf model streams
   * them). No activations: the perf model reserves none (the HBM the weights leave, at memoryUtilization, is all KV).
   */
  override stats(): EngineStats {
    const stats = super.stats();
    let loraParams = 0;
    for (const adapter of this.loras.values()) loraParams += loraParamCount(this.model, adapter.rank, adapter.targets);
    stats.memory = {
      weightsBytes: paramCount(this.model) * this.model.weightBytesPerParam,
      kvCacheBytes: this.kv.numBlocks * this.kv.blockSize * kvBytesPerTokenPerGpu(this.model, this.tp) * this.tp,
      loraAdaptersBytes: loraParams * this.model.activationBytesPerElement,
    };
    return stats;
  }

  /** Names of the adapters held. */
  get loraNames(): string[] {
    return [...this.loras.keys()];
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
    const shape = planToStepShape(plan, this.loras);
    const computeMs = stepTimeMs(shape, this.model, this.hw, this.tp, this.efficiency);
    // Blocks onboarded from lower tiers while the step was planned arrive before its forward pass.
    const onboardMs = this.kv.tiers?.takeOnboardMs() ?? 0;
    // Every step's compute time, as the cpu engine measures its steps, for the tiers' cost model (step-time-curve.ts).
    if (this.kv.tiers !== undefined) {
      let prefillTokens = 0;
      for (const chunk of shape.prefillTokens) prefillTokens += chunk.newTokens;
      this.kv.tiers.observeStep(prefillTokens + shape.decodeSeqs.length, computeMs, prefillTokens);
    }
    const durationMs = computeMs + this.blockCopyMs(plan) + onboardMs;
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

  /**
   * A guided completion's token: the synthetic one if the grammar takes it, else one of the tokens it allows, drawn
   * as a pure function of (seed, completion, position) like the synthetic tokens themselves.
   */
  private guidedToken(guided: GuidedSequence, synthetic: number, seed: number, index: number, position: number): number {
    if (guided.accept(synthetic)) return synthetic;
    if (this.allowed.length < guided.vocabSize) this.allowed = new Int32Array(guided.vocabSize);
    const count = guided.allowedTokens(this.allowed);
    const tokenId = count > 0 ? this.allowed[mix32(mixInto(mixInto(seed >>> 0, index), position) ^ 0x5bd1e995) % count]! : this.eosTokenId;
    guided.accept(tokenId);
    return tokenId;
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
      const state = this.tokenState(request.id, completionIndex);
      const seed = state?.seed ?? 0;
      // Greedy sampling has one answer: every completion of the request gets the tokens of the first, as on the cpu
      // engine, where each row takes the same argmax.
      const sampleIndex = request.sampling.temperature < GREEDY_TEMPERATURE ? 0 : completionIndex;
      let tokenId = syntheticToken(seed, sampleIndex, position, {
        vocabSize: this.vocabSize, eosTokenId: this.eosTokenId, eosProbability: this.eosProbability,
        avoid: request.sampling.stopTokenIds,
      });
      if (state?.guided !== undefined && !state.guided.isTerminated) tokenId = this.guidedToken(state.guided, tokenId, seed, sampleIndex, position);
      // The sim chooses each token with certainty, so its logprob is 0 and it has no alternatives.
      if (request.sampling.logprobs !== null) logprobs.set(rowKey(request.id, completionIndex), { tokenId, logprob: 0, top: [] });
      return tokenId;
    });
    // Prompt logprobs in the same terms: each prompt token has logprob 0 and rank 1.
    const promptLogprobs = plan.numPromptLogprobRows > 0
      ? promptLogprobTargets(plan).tokenIds.map((tokenId) => ({ tokenId, logprob: 0, top: [], rank: 1 })) : undefined;
    // Planning takes no simulated time: the forward pass starts when the step does.
    const outputs = this.applyStep(plan, tokenIds, logprobs, step.startMs, step.endMs, promptLogprobs);
    // Lower tiers: copied down between steps as the cpu worker does, at no step time (DMA beside compute); an idle
    // worker copies everything down.
    if (this.kv.tiers !== undefined) {
      if (this.hasWork) this.offloadKv();
      else while (this.offloadKv(undefined, Infinity) > 0) { /* every cached free block, chunk by chunk */ }
    }
    return outputs;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Disaggregated serving: the same core as the real engine, with transfer time instead of bytes

  /**
   * What moving the handoff's blocks to this worker would take now (decode side): the blocks its prefix cache
   * lacks, their bytes, and their time over kvLink (kvTransferTimeMs). The caller adopts after that time.
   */
  planTransfer(handoff: KvHandoff): SimTransferPlan {
    const tokenIds = [...handoff.request.promptTokenIds, ...handoff.outputTokenIds];
    // Hashed as the adoption will hash them (scheduler.adoptRequest): the tenant's salt and the request's adapter.
    const table = this.kv.createTable({ cacheSalt: handoff.request.cacheSalt, adapterId: handoff.request.lora });
    const hit = this.kv.findCachedPrefix(table, tokenIds, { copyOnWrite: false });
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

/** The simulated weights' dtype, by bytes per parameter (the prefill metrics' quantization label). */
function simWeightDtype(bytesPerParam: number): string {
  if (bytesPerParam === 2) return 'BF16';
  if (bytesPerParam === 1) return 'FP8';
  if (bytesPerParam === 0.5) return 'INT4';
  return `${bytesPerParam * 8}bit`;
}
