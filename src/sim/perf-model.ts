// The performance model behind the simulated engine: how long one engine step takes on a given GPU, model and
// tensor-parallel degree. A step is what the scheduler plans: chunks of prompts being prefilled and sequences
// decoding one token each, mixed in one forward pass (chunked prefill).
//
// Each kind of work is a roofline: it takes the longer of its compute time (FLOPs / achievable FLOP/s) and its memory
// time (bytes / achievable bandwidth), because a kernel overlaps the two and waits for the slower.
//   - weight matmuls: every token's FLOPs; the weights are streamed once per step whatever the token count, which
//     is why decode is memory-bound until the batch is large;
//   - prefill attention and decode attention: FLOPs over the attended keys; bytes of the KV cache read and written.
//     They are separate kernels with opposite bounds (prefill compute, decode memory), so each gets its own max;
//   - tensor-parallel communication, after the matmuls and not overlapped with them: 2 ring all-reduces of the
//     hidden states per layer, and an all-gather of the vocab-sharded logits;
//   - a fixed per-step overhead (scheduling, input preparation, launch, sampling) the GPU waits on.
// Each term has an efficiency factor (matmul MFU, attention MFU, bandwidth utilisation, communication efficiency)
// with documented defaults that calibrateEfficiency fits to measured step times. Nothing here has a clock.

import type { HardwareProfile, LinkProfile } from './hardware.ts';
import { matmulPeakFlopsPerSec } from './hardware.ts';
import type { ModelProfile } from './models.ts';
import {
  activeMatmulParamCount, kvBytesPerToken, lmHeadParamCount, paramCount, streamedParamCount,
} from './models.ts';

// ---------------------------------------------------------------------------------------------------------------
// Step shape and efficiency

/** A chunk of one prompt prefilled in this step. */
export interface PrefillChunk {
  /** Tokens of the prompt computed in this step. */
  newTokens: number;
  /** Tokens already in the KV cache before the chunk (a prefix-cache hit plus earlier chunks). */
  contextLen: number;
  /** The chunk ends its prompt, so the step computes logits and samples a token for it (default true). */
  sampled?: boolean;
  /** Further positions of the chunk whose logits the step computes (prompt logprobs; default 0). */
  promptLogitsRows?: number;
}

/** A sequence decoding one token in this step. */
export interface DecodeSeq {
  /** Tokens already in the KV cache; the new token attends to these and to itself. */
  contextLen: number;
}

/** The projections of a layer a LoRA adapter can adapt (src/model/lora.ts LORA_TARGETS). */
export type SimLoraTarget = 'wq' | 'wk' | 'wv' | 'wo' | 'wGate' | 'wUp' | 'wDown';
export const SIM_LORA_TARGETS: readonly SimLoraTarget[] = ['wq', 'wk', 'wv', 'wo', 'wGate', 'wUp', 'wDown'];

/**
 * A LoRA adapter whose tokens run in a step. Batched LoRA kernels (S-LoRA / Punica's SGMV) read each adapter's A
 * and B once per step whatever the number of its tokens, and multiply every token of it: 2 x rank x (in + out)
 * FLOPs per token per adapted projection.
 */
export interface StepLora {
  /** Tokens of the step computed with this adapter. */
  tokens: number;
  rank: number;
  /** The projections it adapts in every layer. Default: all seven (q, k, v, o only for a mixture-of-experts model). */
  targets?: readonly SimLoraTarget[];
}

/** What one engine step computes, as the performance model sees it. */
export interface StepShape {
  prefillTokens: readonly PrefillChunk[];
  decodeSeqs: readonly DecodeSeq[];
  /** The distinct LoRA adapters of the step's tokens (none: the base model only). */
  loras?: readonly StepLora[];
}

/** in + out of one projection of one layer, the width a rank-r adapter of it multiplies by r (0: not adaptable). */
export function loraProjectionWidth(model: ModelProfile, target: SimLoraTarget): number {
  const q = model.numHeads * model.headDim;
  const kv = model.numKvHeads * model.headDim;
  switch (target) {
    case 'wq': case 'wo': return model.hiddenDim + q;
    case 'wk': case 'wv': return model.hiddenDim + kv;
    // Adapters of experts are not modelled (as the native engine refuses them).
    default: return model.moe ? 0 : model.hiddenDim + model.ffnDim;
  }
}

/** Elements of a rank-`rank` adapter of these projections over all layers (A and B together). */
export function loraParamCount(model: ModelProfile, rank: number, targets: readonly SimLoraTarget[] = SIM_LORA_TARGETS): number {
  let width = 0;
  for (const target of targets) width += loraProjectionWidth(model, target);
  return rank * width * model.numLayers;
}

/** Fractions of the datasheet peaks that real kernels reach, and the fixed cost of a step. */
export interface Efficiency {
  /** Fraction of peak tensor FLOP/s the weight matmuls (GEMMs) reach. */
  matmulMfu: number;
  /** Fraction of peak BF16 FLOP/s the attention kernels reach. */
  attentionMfu: number;
  /** Fraction of HBM bandwidth memory-bound kernels reach (weight streaming, KV reads). */
  bandwidthUtilization: number;
  /** Fraction of the link's per-direction bandwidth collectives and transfers reach. */
  commEfficiency: number;
  /** CPU-side work per step the GPU waits on: scheduling, input preparation, launch, sampling. */
  stepOverheadMs: number;
  /**
   * Times each token's hidden state (BF16, per layer) crosses HBM in the kernels not fused into a GEMM or attention:
   * RMSNorms (with their FP32 intermediates) and residual adds. A memory-bound term at bandwidthUtilization. Absent
   * or 0: not modelled (the roofline calibration).
   */
  hiddenPasses?: number;
  /** Likewise for this GPU's share of the FFN intermediate (SiLU, the gate product, the split of gate and up). */
  ffnPasses?: number;
  /**
   * GPU time per layer per step that does not shrink with the batch: the launch floor of a layer's dozen small
   * kernels, even replayed from a CUDA graph. Microseconds; absent or 0: not modelled.
   */
  layerOverheadUs?: number;
}

/**
 * Defaults, to be replaced by calibrateEfficiency against measurements (docs/simulator.md gives the reasoning):
 * GEMMs at inference shapes reach roughly 60% of dense peak; attention at 1-8K tokens less; memory-bound kernels
 * about 80% of HBM bandwidth; NCCL's protocol overhead leaves about 80% of NVLink's line rate; and the engine spends
 * a few hundred microseconds of CPU per step that is not hidden behind the GPU.
 */
export const DEFAULT_EFFICIENCY: Readonly<Efficiency> = Object.freeze({
  matmulMfu: 0.6,
  attentionMfu: 0.4,
  bandwidthUtilization: 0.8,
  commEfficiency: 0.8,
  stepOverheadMs: 0.4,
});

// ---------------------------------------------------------------------------------------------------------------
// Work: what one GPU of the tensor-parallel group does in a step (no hardware speeds yet)

export interface StepWork {
  /** Tokens computed in the step (prefill chunk tokens plus one per decode). */
  newTokens: number;
  /** Positions whose logits are computed (one per decode, one per prompt-ending chunk, and prompt-logprob rows). */
  sampledTokens: number;
  matmulFlops: number;
  /** Weight bytes streamed from HBM. */
  weightBytes: number;
  prefillAttentionFlops: number;
  /** KV bytes prefill attention reads (the cached prefix) and writes (the chunk). */
  prefillKvBytes: number;
  decodeAttentionFlops: number;
  /** KV bytes decode attention reads (the context) and writes (the new token). */
  decodeKvBytes: number;
  /** All-reduces in the step (2 per layer when tp > 1, else 0). */
  allReduceCount: number;
  /** Bytes of one all-reduce's input: the step's hidden states. */
  allReducePayloadBytes: number;
  /** Bytes of the full logits tensor the all-gather assembles (0 when tp = 1). */
  logitsGatherPayloadBytes: number;
  /** Bytes of one pass over every new token's hidden state, all layers. */
  hiddenPassBytes: number;
  /** Bytes of one pass over every new token's share of the FFN intermediate, all layers. */
  ffnPassBytes: number;
  /** FLOPs of the step's LoRA products (StepShape.loras). */
  loraFlops: number;
  /** Bytes of LoRA weights the step streams: each adapter present once, in activationBytesPerElement (BF16). */
  loraBytes: number;
}

/**
 * Checks that the model can be split tp ways the way tensor-parallel engines split it: whole query heads per GPU,
 * and KV heads either divided evenly or replicated (tp a multiple of the KV head count).
 */
export function checkTensorParallel(model: ModelProfile, hw: HardwareProfile, tp: number): void {
  if (!Number.isInteger(tp) || tp < 1) {
    throw new RangeError(`tensor-parallel degree must be an integer >= 1, got ${tp}`);
  }
  if (tp > hw.gpusPerNode) {
    throw new RangeError(`tp ${tp} exceeds the ${hw.gpusPerNode} GPUs of one ${hw.name} node; ` +
      'tensor parallelism across nodes is not modelled');
  }
  if (model.numHeads % tp !== 0) {
    throw new RangeError(`${model.name}: ${model.numHeads} attention heads do not divide over tp ${tp}`);
  }
  const kv = model.numKvHeads;
  if (kv % tp !== 0 && tp % kv !== 0) {
    throw new RangeError(`${model.name}: ${kv} KV heads neither divide over nor replicate across tp ${tp}`);
  }
}

/** KV heads each GPU stores: a share of them, or one replicated head when there are fewer KV heads than GPUs. */
export function kvHeadsPerGpu(model: ModelProfile, tp: number): number {
  return Math.max(1, model.numKvHeads / tp);
}

/** KV cache bytes one token occupies on each GPU of the group. */
export function kvBytesPerTokenPerGpu(model: ModelProfile, tp: number): number {
  return (kvBytesPerToken(model) / model.numKvHeads) * kvHeadsPerGpu(model, tp);
}

function checkShape(step: StepShape): void {
  const bad = (v: number) => !Number.isFinite(v) || v < 0;
  for (const c of step.prefillTokens) {
    if (bad(c.newTokens) || bad(c.contextLen)) {
      throw new RangeError(`prefill chunk needs finite newTokens >= 0 and contextLen >= 0, got ${JSON.stringify(c)}`);
    }
  }
  for (const d of step.decodeSeqs) {
    if (bad(d.contextLen)) throw new RangeError(`decode sequence needs finite contextLen >= 0, got ${d.contextLen}`);
  }
  for (const l of step.loras ?? []) {
    if (bad(l.tokens) || !Number.isInteger(l.rank) || l.rank < 1) {
      throw new RangeError(`LoRA adapter needs finite tokens >= 0 and a whole rank >= 1, got ${JSON.stringify(l)}`);
    }
  }
}

/** Intermediate width one token's FFN pass goes through (its experts' together with experts). */
function activeFfnDim(model: ModelProfile): number {
  if (!model.moe) return model.ffnDim;
  return (model.moe.numExpertsUsed + model.moe.numSharedExperts) * model.moe.expertFfnDim;
}

/** The work one GPU does in a step, before any hardware speed is applied. */
export function stepWork(step: StepShape, model: ModelProfile, tp: number): StepWork {
  checkShape(step);
  const chunks = step.prefillTokens.filter((c) => c.newTokens > 0);
  const decodes = step.decodeSeqs;
  const newTokens = chunks.reduce((s, c) => s + c.newTokens, 0) + decodes.length;
  const sampledTokens = chunks.reduce((s, c) => s + (c.sampled !== false ? 1 : 0) + (c.promptLogitsRows ?? 0), 0) + decodes.length;
  if (newTokens === 0) {
    return {
      newTokens: 0, sampledTokens: 0, matmulFlops: 0, weightBytes: 0, prefillAttentionFlops: 0, prefillKvBytes: 0,
      decodeAttentionFlops: 0, decodeKvBytes: 0, allReduceCount: 0, allReducePayloadBytes: 0,
      logitsGatherPayloadBytes: 0, hiddenPassBytes: 0, ffnPassBytes: 0, loraFlops: 0, loraBytes: 0,
    };
  }
  // LoRA weights shard with the projections they adapt (A row-parallel, B column-parallel): divide by tp.
  let loraFlops = 0;
  let loraBytes = 0;
  for (const lora of step.loras ?? []) {
    if (lora.tokens <= 0) continue;
    const params = loraParamCount(model, lora.rank, lora.targets);
    loraFlops += (2 * params * lora.tokens) / tp;
    loraBytes += (params * model.activationBytesPerElement) / tp;
  }
  // Every token goes through every layer; only sampled positions go through the LM head (engines slice the hidden
  // states to those rows before it).
  // With experts a token multiplies by its top-k only, and the step streams the experts its tokens chose.
  const matmulFlops = (2 * (activeMatmulParamCount(model) * newTokens
    + lmHeadParamCount(model) * sampledTokens)) / tp;
  // Norm scales are replicated rather than sharded, but they are under 0.01% of the bytes: divide everything by tp.
  const weightBytes = (streamedParamCount(model, newTokens) * model.weightBytesPerParam) / tp;

  // Attention FLOPs per attended key: 4 x headDim per query head per layer; query heads split evenly over the group.
  const attnFlopsPerKey = (4 * model.numLayers * model.numHeads * model.headDim) / tp;
  const kvPerToken = kvBytesPerTokenPerGpu(model, tp);
  let prefillKeys = 0; // sum over the chunk's tokens of the keys each attends to (causal)
  let prefillKvTokens = 0;
  for (const c of chunks) {
    prefillKeys += c.newTokens * c.contextLen + (c.newTokens * (c.newTokens + 1)) / 2;
    prefillKvTokens += c.contextLen + c.newTokens; // read the cached prefix once, write the chunk
  }
  let decodeKeys = 0;
  for (const d of decodes) decodeKeys += d.contextLen + 1; // the context plus the new token itself
  const tpComm = tp > 1;
  return {
    newTokens,
    sampledTokens,
    matmulFlops,
    weightBytes,
    prefillAttentionFlops: attnFlopsPerKey * prefillKeys,
    prefillKvBytes: kvPerToken * prefillKvTokens,
    decodeAttentionFlops: attnFlopsPerKey * decodeKeys,
    decodeKvBytes: kvPerToken * decodeKeys, // read contextLen tokens, write one
    allReduceCount: tpComm ? 2 * model.numLayers : 0,
    allReducePayloadBytes: tpComm ? newTokens * model.hiddenDim * model.activationBytesPerElement : 0,
    logitsGatherPayloadBytes: tpComm ? sampledTokens * model.vocabSize * model.activationBytesPerElement : 0,
    // Norms and residuals run on the whole hidden state on every GPU; the FFN intermediate is split tp ways.
    hiddenPassBytes: newTokens * model.numLayers * model.hiddenDim * model.activationBytesPerElement,
    ffnPassBytes: newTokens * model.numLayers * (activeFfnDim(model) / tp) * model.activationBytesPerElement,
    loraFlops,
    loraBytes,
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Communication

/**
 * One ring all-reduce over tp GPUs: 2(tp-1) steps (reduce-scatter then all-gather), each GPU sending and receiving
 * 2(tp-1)/tp of the payload, every step paying the link's hop latency.
 */
export function ringAllReduceTimeMs(payloadBytes: number, tp: number, link: LinkProfile,
  commEfficiency: number = DEFAULT_EFFICIENCY.commEfficiency): number {
  if (tp <= 1 || payloadBytes <= 0) return 0;
  const bytesPerGpu = (2 * (tp - 1) / tp) * payloadBytes;
  return 2 * (tp - 1) * (link.hopLatencyUs / 1000)
    + (bytesPerGpu / (link.bytesPerSecPerDirection * commEfficiency)) * 1000;
}

/** One ring all-gather assembling a payload of which each GPU holds 1/tp: tp-1 steps, (tp-1)/tp received. */
export function ringAllGatherTimeMs(payloadBytes: number, tp: number, link: LinkProfile,
  commEfficiency: number = DEFAULT_EFFICIENCY.commEfficiency): number {
  if (tp <= 1 || payloadBytes <= 0) return 0;
  const bytesPerGpu = ((tp - 1) / tp) * payloadBytes;
  return (tp - 1) * (link.hopLatencyUs / 1000)
    + (bytesPerGpu / (link.bytesPerSecPerDirection * commEfficiency)) * 1000;
}

export interface KvTransferOptions {
  /**
   * Links used side by side. A tensor-parallel prefill worker holds its KV sharded over its GPUs and each GPU can
   * send its shard through its own NIC (a DGX H100 has one 400 Gb/s port per GPU): pass tp then. Default 1.
   */
  parallelLinks?: number;
  /** Fraction of the link's per-direction bandwidth reached (default DEFAULT_EFFICIENCY.commEfficiency). */
  efficiency?: number;
}

/** Time to move the KV cache of `tokens` tokens from a prefill worker to a decode worker over `link`. */
export function kvTransferTimeMs(tokens: number, model: ModelProfile, link: LinkProfile,
  options: KvTransferOptions = {}): number {
  if (!Number.isFinite(tokens) || tokens < 0) throw new RangeError(`tokens must be finite and >= 0, got ${tokens}`);
  const parallelLinks = options.parallelLinks ?? 1;
  const efficiency = options.efficiency ?? DEFAULT_EFFICIENCY.commEfficiency;
  if (!Number.isInteger(parallelLinks) || parallelLinks < 1) {
    throw new RangeError(`parallelLinks must be an integer >= 1, got ${parallelLinks}`);
  }
  if (tokens === 0) return 0;
  const bytesPerLink = (tokens * kvBytesPerToken(model)) / parallelLinks;
  return link.hopLatencyUs / 1000 + (bytesPerLink / (link.bytesPerSecPerDirection * efficiency)) * 1000;
}

// ---------------------------------------------------------------------------------------------------------------
// Step time

export type Bound = 'compute' | 'memory' | 'idle';

/** One roofline term: the kernel takes the longer of its compute and memory times. */
export interface RooflineTerm {
  computeMs: number;
  memoryMs: number;
  timeMs: number;
  bound: Bound;
}

export interface StepBreakdown {
  work: StepWork;
  matmul: RooflineTerm;
  prefillAttention: RooflineTerm;
  decodeAttention: RooflineTerm;
  /** The batched LoRA kernels (compute at the GEMMs' MFU, the adapters' weights at HBM speed); idle without adapters. */
  lora: RooflineTerm;
  allReduceMs: number;
  logitsGatherMs: number;
  /** allReduceMs + logitsGatherMs. */
  commMs: number;
  /** Unfused norm / residual / activation kernels: the passes over hidden and FFN activations at HBM speed. */
  elementwiseMs: number;
  /** layerOverheadUs x layers. */
  layerOverheadMs: number;
  overheadMs: number;
  totalMs: number;
}

function roofline(computeMs: number, memoryMs: number): RooflineTerm {
  const timeMs = Math.max(computeMs, memoryMs);
  const bound: Bound = timeMs === 0 ? 'idle' : computeMs >= memoryMs ? 'compute' : 'memory';
  return { computeMs, memoryMs, timeMs, bound };
}

function checkEfficiency(e: Efficiency): void {
  for (const key of ['matmulMfu', 'attentionMfu', 'bandwidthUtilization', 'commEfficiency'] as const) {
    if (!(e[key] > 0)) throw new RangeError(`efficiency.${key} must be > 0, got ${e[key]}`);
  }
  if (!(e.stepOverheadMs >= 0)) throw new RangeError(`efficiency.stepOverheadMs must be >= 0, got ${e.stepOverheadMs}`);
  for (const key of ['hiddenPasses', 'ffnPasses', 'layerOverheadUs'] as const) {
    const v = e[key];
    if (v !== undefined && !(v >= 0 && Number.isFinite(v))) throw new RangeError(`efficiency.${key} must be >= 0, got ${v}`);
  }
}

/** Where the time of one step goes. An empty step takes no time (the engine is idle, no step runs). */
export function stepBreakdown(step: StepShape, model: ModelProfile, hw: HardwareProfile, tp: number,
  efficiency: Efficiency = DEFAULT_EFFICIENCY): StepBreakdown {
  checkTensorParallel(model, hw, tp);
  checkEfficiency(efficiency);
  const work = stepWork(step, model, tp);
  const matmulFlopsPerSec = matmulPeakFlopsPerSec(hw, model.weightBytesPerParam) * efficiency.matmulMfu;
  const attentionFlopsPerSec = hw.bf16FlopsPerSec * efficiency.attentionMfu;
  const bytesPerSec = hw.hbmBytesPerSec * efficiency.bandwidthUtilization;
  const ms = (amount: number, perSec: number) => (amount / perSec) * 1000;

  const matmul = roofline(ms(work.matmulFlops, matmulFlopsPerSec), ms(work.weightBytes, bytesPerSec));
  const prefillAttention = roofline(ms(work.prefillAttentionFlops, attentionFlopsPerSec),
    ms(work.prefillKvBytes, bytesPerSec));
  const decodeAttention = roofline(ms(work.decodeAttentionFlops, attentionFlopsPerSec),
    ms(work.decodeKvBytes, bytesPerSec));
  // Rank-r GEMMs are thin: they run at the BF16 tensor peak's matmul fraction, usually bound by reading the weights.
  const lora = roofline(ms(work.loraFlops, hw.bf16FlopsPerSec * efficiency.matmulMfu), ms(work.loraBytes, bytesPerSec));
  const allReduceMs = work.allReduceCount
    * ringAllReduceTimeMs(work.allReducePayloadBytes, tp, hw.tpLink, efficiency.commEfficiency);
  const logitsGatherMs = ringAllGatherTimeMs(work.logitsGatherPayloadBytes, tp, hw.tpLink, efficiency.commEfficiency);
  const commMs = allReduceMs + logitsGatherMs;
  const elementwiseMs = ms((efficiency.hiddenPasses ?? 0) * work.hiddenPassBytes
    + (efficiency.ffnPasses ?? 0) * work.ffnPassBytes, bytesPerSec);
  const layerOverheadMs = work.newTokens > 0 ? (model.numLayers * (efficiency.layerOverheadUs ?? 0)) / 1000 : 0;
  const overheadMs = work.newTokens > 0 ? efficiency.stepOverheadMs : 0;
  const totalMs = matmul.timeMs + prefillAttention.timeMs + decodeAttention.timeMs + lora.timeMs + elementwiseMs
    + layerOverheadMs + commMs + overheadMs;
  return {
    work, matmul, prefillAttention, decodeAttention, lora, allReduceMs, logitsGatherMs, commMs, elementwiseMs,
    layerOverheadMs, overheadMs, totalMs,
  };
}

/** Duration of one engine step in milliseconds. Non-decreasing in every token count, context length and batch size. */
export function stepTimeMs(step: StepShape, model: ModelProfile, hw: HardwareProfile, tp: number,
  efficiency: Efficiency = DEFAULT_EFFICIENCY): number {
  return stepBreakdown(step, model, hw, tp, efficiency).totalMs;
}

// ---------------------------------------------------------------------------------------------------------------
// Capacity

/**
 * Tokens of KV cache that fit on each GPU of the group once its weight shard is loaded, given the fraction of HBM
 * the engine may use (vLLM's gpu_memory_utilization, default 0.9). 0 when the weights alone do not fit.
 */
export function kvCapacityTokens(model: ModelProfile, hw: HardwareProfile, tp: number,
  memoryUtilization = 0.9): number {
  checkTensorParallel(model, hw, tp);
  const freeBytes = hw.hbmBytes * memoryUtilization - (paramCount(model) * model.weightBytesPerParam) / tp;
  return freeBytes > 0 ? Math.floor(freeBytes / kvBytesPerTokenPerGpu(model, tp)) : 0;
}

/**
 * The KV pool a worker allocates: kvCapacityTokens in whole blocks of `blockSize` tokens (a partial block holds
 * nothing). What `conduit serve --engine sim` and every `conduit sim` table count as the worker's KV capacity.
 */
export function kvCapacityBlocks(model: ModelProfile, hw: HardwareProfile, tp: number, blockSize: number,
  memoryUtilization = 0.9): number {
  return Math.floor(kvCapacityTokens(model, hw, tp, memoryUtilization) / blockSize);
}

// ---------------------------------------------------------------------------------------------------------------
// Calibration
//
// With the efficiency factors written as inverses (u = 1/factor) and the overhead as is, a step's time is linear in
// the unknowns once it is known which side of each roofline max is active:
//   t = [C_mm u_mm | M_w u_bw] + [C_pa u_at | M_pa u_bw] + [C_da u_at | M_da u_bw] + B_comm u_comm + L_comm + overhead
// where C and M are the times at 100% efficiency. calibrateEfficiency alternates between choosing the active sides
// with the current estimate and solving that linear least-squares problem, until the sides stop changing, from a
// few starting points, and keeps the best fit.

export type EfficiencyKey = keyof Efficiency;

const UNKNOWNS: readonly EfficiencyKey[] = [
  'matmulMfu', 'attentionMfu', 'bandwidthUtilization', 'commEfficiency', 'stepOverheadMs',
];

export interface CalibrationPoint {
  step: StepShape;
  /** Measured duration of that step. */
  timeMs: number;
}

export interface CalibrationOptions {
  /** Factors to fit (default all five); the others stay at `initial`. */
  fit?: readonly EfficiencyKey[];
  /** Starting point and values of the factors not fitted (default DEFAULT_EFFICIENCY). */
  initial?: Efficiency;
  maxIterations?: number;
}

export interface CalibrationResult {
  efficiency: Efficiency;
  /** Factors the points determined. */
  fitted: EfficiencyKey[];
  /** Factors asked for that the points could not determine (their term never active, or collinear): left as given. */
  unidentified: EfficiencyKey[];
  /** Root-mean-square of (model - measured) over the points. */
  rmsErrorMs: number;
  iterations: number;
}

/** A step's times at 100% efficiency, split the way the linear form above needs them. */
interface PointTerms {
  mmC: number; mmM: number; paC: number; paM: number; daC: number; daM: number;
  commBwMs: number; commLatencyMs: number; hasWork: boolean;
  /** Elementwise kernels' time at full bandwidth (scales with u_bw) and the per-layer floor (fixed). */
  ewM: number; layerMs: number;
}

function pointTerms(step: StepShape, model: ModelProfile, hw: HardwareProfile, tp: number,
  fixed: Efficiency): PointTerms {
  const w = stepWork(step, model, tp);
  const ms = (amount: number, perSec: number) => (amount / perSec) * 1000;
  const matmulPeak = matmulPeakFlopsPerSec(hw, model.weightBytesPerParam);
  const unitLink = { ...hw.tpLink, hopLatencyUs: 0 };
  const noBandwidth = { ...hw.tpLink, bytesPerSecPerDirection: Infinity };
  const commBwMs = w.allReduceCount * ringAllReduceTimeMs(w.allReducePayloadBytes, tp, unitLink, 1)
    + ringAllGatherTimeMs(w.logitsGatherPayloadBytes, tp, unitLink, 1);
  const commLatencyMs = w.allReduceCount * ringAllReduceTimeMs(w.allReducePayloadBytes, tp, noBandwidth, 1)
    + ringAllGatherTimeMs(w.logitsGatherPayloadBytes, tp, noBandwidth, 1);
  return {
    mmC: ms(w.matmulFlops, matmulPeak), mmM: ms(w.weightBytes, hw.hbmBytesPerSec),
    paC: ms(w.prefillAttentionFlops, hw.bf16FlopsPerSec), paM: ms(w.prefillKvBytes, hw.hbmBytesPerSec),
    daC: ms(w.decodeAttentionFlops, hw.bf16FlopsPerSec), daM: ms(w.decodeKvBytes, hw.hbmBytesPerSec),
    commBwMs, commLatencyMs, hasWork: w.newTokens > 0,
    ewM: ms((fixed.hiddenPasses ?? 0) * w.hiddenPassBytes + (fixed.ffnPasses ?? 0) * w.ffnPassBytes,
      hw.hbmBytesPerSec),
    layerMs: w.newTokens > 0 ? (model.numLayers * (fixed.layerOverheadUs ?? 0)) / 1000 : 0,
  };
}

/** Unknown vector [u_mm, u_at, u_bw, u_comm, overhead] from factors, and back. */
function toUnknowns(e: Efficiency): number[] {
  return [1 / e.matmulMfu, 1 / e.attentionMfu, 1 / e.bandwidthUtilization, 1 / e.commEfficiency, e.stepOverheadMs];
}
function fromUnknowns(u: readonly number[], fixed: Efficiency): Efficiency {
  return {
    ...(fixed.hiddenPasses !== undefined ? { hiddenPasses: fixed.hiddenPasses } : {}),
    ...(fixed.ffnPasses !== undefined ? { ffnPasses: fixed.ffnPasses } : {}),
    ...(fixed.layerOverheadUs !== undefined ? { layerOverheadUs: fixed.layerOverheadUs } : {}),
    matmulMfu: 1 / u[0]!, attentionMfu: 1 / u[1]!, bandwidthUtilization: 1 / u[2]!, commEfficiency: 1 / u[3]!,
    stepOverheadMs: u[4]!,
  };
}

/** Coefficients of the unknowns for one point, given which side of each max the current estimate makes active. */
function rowFor(t: PointTerms, u: readonly number[]): number[] {
  const row = [0, 0, t.ewM, t.commBwMs, t.hasWork ? 1 : 0];
  const pick = (c: number, m: number, computeCol: number) => {
    if (c === 0 && m === 0) return;
    if (c * u[computeCol]! >= m * u[2]!) row[computeCol]! += c;
    else row[2]! += m;
  };
  pick(t.mmC, t.mmM, 0);
  pick(t.paC, t.paM, 1);
  pick(t.daC, t.daM, 1);
  return row;
}

function modelTimeMs(t: PointTerms, u: readonly number[]): number {
  if (!t.hasWork) return 0;
  return Math.max(t.mmC * u[0]!, t.mmM * u[2]!) + Math.max(t.paC * u[1]!, t.paM * u[2]!)
    + Math.max(t.daC * u[1]!, t.daM * u[2]!) + t.ewM * u[2]! + t.commBwMs * u[3]! + t.commLatencyMs + t.layerMs + u[4]!;
}

/**
 * Least squares by Householder QR on unit-norm columns. Returns null for columns that are zero or (numerically)
 * combinations of earlier ones, so the caller can hold those unknowns fixed and solve again without them.
 */
export function leastSquares(a: readonly number[][], b: readonly number[]): (number | null)[] {
  const m = a.length;
  const n = a[0]?.length ?? 0;
  const scale = Array.from({ length: n }, (_, j) => Math.hypot(...a.map((row) => row[j]!)));
  const r = a.map((row) => row.map((v, j) => (scale[j]! > 0 ? v / scale[j]! : 0)));
  const y = b.slice();
  // pivotRow[k]: the row of R holding column k's diagonal, or -1 when column k adds nothing new.
  const pivotRow: number[] = new Array(n).fill(-1);
  let p = 0;
  for (let k = 0; k < n && p < m; k++) {
    let norm = 0;
    for (let i = p; i < m; i++) norm += r[i]![k]! ** 2;
    norm = Math.sqrt(norm);
    if (norm < 1e-9) continue; // nothing left of this column once the earlier ones are taken out
    const alpha = r[p]![k]! > 0 ? -norm : norm;
    const v: number[] = [];
    for (let i = p; i < m; i++) v.push(r[i]![k]!);
    v[0]! -= alpha;
    const vNorm2 = v.reduce((s, x) => s + x * x, 0);
    if (vNorm2 > 0) {
      for (let j = k; j < n; j++) {
        let s = 0;
        for (let i = 0; i < v.length; i++) s += v[i]! * r[p + i]![j]!;
        const f = (2 * s) / vNorm2;
        for (let i = 0; i < v.length; i++) r[p + i]![j]! -= f * v[i]!;
      }
      let s = 0;
      for (let i = 0; i < v.length; i++) s += v[i]! * y[p + i]!;
      const f = (2 * s) / vNorm2;
      for (let i = 0; i < v.length; i++) y[p + i]! -= f * v[i]!;
    }
    pivotRow[k] = p++;
  }
  // Back substitution in scaled unknowns z (x = z / scale).
  const z: (number | null)[] = new Array(n).fill(null);
  for (let k = n - 1; k >= 0; k--) {
    const row = pivotRow[k]!;
    if (row < 0) continue;
    let s = y[row]!;
    for (let j = k + 1; j < n; j++) if (z[j] !== null) s -= r[row]![j]! * z[j]!;
    z[k] = s / r[row]![k]!;
  }
  return z.map((v, j) => (v === null ? null : v / scale[j]!));
}

/**
 * Fits efficiency factors to measured step times by least squares. Points should span the regimes whose factors are
 * wanted: small decode batches (bandwidth), long prefill chunks (matmul MFU), long contexts in prefill (attention
 * MFU), varying token counts with tp > 1 (communication), and anything (overhead). hiddenPasses, ffnPasses and
 * layerOverheadUs are not fitted here: they stay at `initial`'s values (src/sim/calibration.ts fits them).
 */
export function calibrateEfficiency(points: readonly CalibrationPoint[], model: ModelProfile, hw: HardwareProfile,
  tp: number, options: CalibrationOptions = {}): CalibrationResult {
  checkTensorParallel(model, hw, tp);
  const initial = options.initial ?? DEFAULT_EFFICIENCY;
  checkEfficiency(initial);
  const fitKeys = options.fit ?? UNKNOWNS;
  const maxIterations = options.maxIterations ?? 50;
  const usable = points.filter((p) => Number.isFinite(p.timeMs));
  const terms = usable.map((p) => pointTerms(p.step, model, hw, tp, initial));
  const fitCols = UNKNOWNS.map((k, i) => (fitKeys.includes(k) ? i : -1)).filter((i) => i >= 0);
  if (usable.length < fitCols.length) {
    throw new RangeError(`calibration needs at least ${fitCols.length} points for ${fitCols.length} factors, ` +
      `got ${usable.length}`);
  }

  const residualMs = (u: readonly number[]) => Math.sqrt(
    terms.reduce((s, t, i) => s + (modelTimeMs(t, u) - usable[i]!.timeMs) ** 2, 0) / Math.max(1, terms.length));

  const solveFrom = (start: number[]) => {
    let u = start.slice();
    let identified = new Set<number>();
    let iterations = 0;
    let previousSides = '';
    for (; iterations < maxIterations; iterations++) {
      const rows = terms.map((t) => rowFor(t, u));
      const sides = rows.map((r) => r.map((v) => (v > 0 ? 1 : 0)).join('')).join('|');
      if (sides === previousSides) break;
      previousSides = sides;
      // Unknowns solved for this round; any that comes out non-positive (unphysical) is held at its current value
      // and the rest re-solved.
      let cols = fitCols.slice();
      let solution: (number | null)[] = [];
      for (;;) {
        const a = rows.map((r) => cols.map((c) => r[c]!));
        const b = rows.map((r, i) => {
          let rhs = usable[i]!.timeMs - (terms[i]!.hasWork ? terms[i]!.commLatencyMs + terms[i]!.layerMs : 0);
          for (let c = 0; c < UNKNOWNS.length; c++) if (!cols.includes(c)) rhs -= r[c]! * u[c]!;
          return rhs;
        });
        solution = cols.length > 0 ? leastSquares(a, b) : [];
        // Drop (hold fixed) a column the points cannot determine, else one whose value is unphysical: an inverse
        // efficiency must be > 0 and the overhead >= 0.
        let drop = solution.findIndex((v) => v === null);
        if (drop < 0) drop = cols.findIndex((c, j) => (c === 4 ? solution[j]! < 0 : solution[j]! <= 0));
        if (drop < 0) break;
        cols = cols.filter((_, j) => j !== drop);
      }
      identified = new Set(cols);
      const next = u.slice();
      cols.forEach((c, j) => { if (solution[j] !== null) next[c] = solution[j]!; });
      u = next;
    }
    return { u, identified, iterations };
  };

  // Starting points: the initial guess and variants with the compute and bandwidth factors moved apart, so a fit
  // that settles on the wrong side of a roofline from one start is beaten by another.
  // Only fitted factors move; the others stay exactly as given.
  const base = toUnknowns(initial);
  const scaled = (col: number, factor: number) => (fitCols.includes(col) ? base[col]! * factor : base[col]!);
  const starts: number[][] = [];
  for (const computeScale of [1, 0.5, 2]) {
    for (const bandwidthScale of [1, 0.5, 2]) {
      starts.push([scaled(0, computeScale), scaled(1, computeScale), scaled(2, bandwidthScale), base[3]!, base[4]!]);
    }
  }
  type Run = { u: number[]; identified: Set<number>; iterations: number; rms: number };
  let best: Run | undefined;
  let totalIterations = 0;
  for (const start of starts) {
    const run = solveFrom(start);
    totalIterations += run.iterations;
    const rms = residualMs(run.u);
    if (!best || rms < best.rms - 1e-12) best = { ...run, rms };
  }
  let chosen = best!;
  // A factor the points did not determine may have kept a scaled starting value: put it back to the given one and
  // refit, keeping that unless the fit gets worse.
  const unsettled = fitCols.filter((c) => !chosen.identified.has(c) && chosen.u[c] !== base[c]);
  if (unsettled.length > 0) {
    const start = chosen.u.map((v, c) => (unsettled.includes(c) ? base[c]! : v));
    const run = solveFrom(start);
    totalIterations += run.iterations;
    const rms = residualMs(run.u);
    if (rms <= chosen.rms * (1 + 1e-9) + 1e-12) chosen = { ...run, rms };
  }
  return {
    efficiency: fromUnknowns(chosen.u, initial),
    fitted: fitCols.filter((c) => chosen.identified.has(c)).map((c) => UNKNOWNS[c]!),
    unidentified: fitCols.filter((c) => !chosen.identified.has(c)).map((c) => UNKNOWNS[c]!),
    rmsErrorMs: chosen.rms,
    iterations: totalIterations,
  };
}
