// The one typed contract for the native addon (build/Release/conduit_native.node, sources in native/) and the
// `nativeBackend` factory that runs a model on it. The addon is loaded lazily on first use; when it is missing
// (no compiler at install time) `nativeBackend.available()` is false and `unavailableReason()` says why, so the
// engine can fall back to the TypeScript reference backend.
import { type LoraDtype, type LoraWeights, resolveLoraDtype } from '../model/lora.ts';
import { existsSync, readFileSync } from 'node:fs';
import { freemem } from 'node:os';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';

import { layerWindow, type ModelConfig } from '../model/config.ts';
import type { GgmlType } from '../model/ggml-types.ts';
import { weightBytes, type Tensor, type ModelWeights } from '../model/weights.ts';
import { kvPoolBytes } from './types.ts';
export { NATIVE_ALLOCATION_FAILED } from './types.ts';
import type { BackendFactory, BackendInfo, BackendMemory, ForwardBatch, KvPoolLayout, ModelRunnerBackend } from './types.ts';

// ---------------------------------------------------------------------------------------------------------------
// What the addon exports

/** Kernel variants, lowest to highest; a CPU that runs one runs every lower one, and the highest is chosen. */
export const KERNEL_VARIANTS = ['generic', 'avx2', 'avx512', 'amx'] as const;
/**
 * Builds that exist to check other kernels, outside that order and never chosen unless named: `amx-model` is the
 * amx matmuls over a software model of the tile instructions, run wherever avx512 runs (slow; a test aid for
 * machines without AMX).
 */
export const VERIFICATION_VARIANTS = ['amx-model'] as const;
export type KernelVariant = (typeof KERNEL_VARIANTS)[number] | (typeof VERIFICATION_VARIANTS)[number];

export interface CpuInfo {
  avx2: boolean;
  fma: boolean;
  f16c: boolean;
  avx512f: boolean;
  avx512bw: boolean;
  avx512vl: boolean;
  avx512dq: boolean;
  avx512vnni: boolean;
  avx512bf16: boolean;
  /** AMX-TILE and AMX-INT8 with Linux's tile-data permission select the amx variant (Q8_0/Q4_0 prefill matmuls). */
  amxTile: boolean;
  amxInt8: boolean;
  amxBf16: boolean;
  /** Linux granted this process AMX tile data (requested with arch_prctl at load when the CPU has AMX). */
  amxPermitted: boolean;
  /** 'no AMX on this CPU', 'granted', or why the kernel did not grant it. */
  amxStatus: string;
  /** amx needs avx512's features plus AMX-TILE, AMX-INT8 and amxPermitted; avx512 F+BW+VL+VNNI; avx2 AVX2+FMA+F16C. */
  bestVariant: (typeof KERNEL_VARIANTS)[number];
  /** The verification builds this CPU runs (['amx-model'] wherever avx512 runs). */
  verificationVariants: KernelVariant[];
  /** CPUs this process may run on (its affinity mask). */
  defaultThreads: number;
}

/** A weight as the addon takes it: ggml type, ggml shape ([cols] or [cols, rows]) and the file's bytes. */
export interface NativeTensor {
  type: GgmlType;
  shape: number[];
  data: Uint8Array;
}

export interface NativeLayerSpec {
  attnNorm: NativeTensor;
  wq: NativeTensor;
  wk: NativeTensor;
  wv: NativeTensor;
  wo: NativeTensor;
  bq?: NativeTensor;
  bk?: NativeTensor;
  bv?: NativeTensor;
  qNorm?: NativeTensor;
  kNorm?: NativeTensor;
  ffnNorm: NativeTensor;
  /** With experts: every expert's matrix stacked, as 2-D [cols, rows * numExperts]. */
  wGate: NativeTensor;
  wUp: NativeTensor;
  wDown: NativeTensor;
  /** The router [dim, numExperts] (with experts). */
  ffnGateInp?: NativeTensor;
  /** Norms of the attention and feed-forward outputs [dim] (postNorms). */
  attnPostNorm?: NativeTensor;
  ffnPostNorm?: NativeTensor;
}

/**
 * Everything `new NativeModel` needs. Tensor bytes and the pool are referenced, never copied or modified (the model
 * keeps its own packed copies of the matrices its kernels repack at load; see NativeModelInfo.packedWeightBytes).
 */
export interface NativeModelSpec {
  vocabSize: number;
  dim: number;
  numHeads: number;
  numKvHeads: number;
  headDim: number;
  ffnDim: number;
  rmsNormEps: number;
  ropeTheta: number;
  ropeDim: number;
  ropeNeox: boolean;
  ropeScaling?: ModelConfig['ropeScaling'];
  qkvBias: boolean;
  /** Per-head RMS norm of Q and K (layers carry qNorm and kNorm). */
  qkNorm?: boolean;
  /** Mixture of experts in every layer (layers carry ffnGateInp and stacked expert matrices). */
  moe?: ModelConfig['moe'];
  /** The sliding window of each layer (0: full causal attention); absent: none anywhere. */
  layerWindows?: number[];
  /** RoPE base of the sliding-window layers, which rotate without ropeScaling (Gemma 3's local layers). */
  ropeLocalTheta?: number;
  /** Gemma: embeddings times this. */
  embeddingScale?: number;
  /** Gemma 3: layers carry attnPostNorm and ffnPostNorm, applied to each block's output before its residual add. */
  postNorms?: boolean;
  /** GELU-tanh instead of SiLU in the gated feed-forward. */
  geluFfn?: boolean;
  /** Score scale; absent: 1 / sqrt(headDim). */
  attentionScale?: number;
  /** Final logits become cap * tanh(logits / cap). */
  finalLogitSoftcap?: number;
  tokenEmbedding: NativeTensor;
  outputNorm: NativeTensor;
  output: NativeTensor;
  layers: NativeLayerSpec[];
  /** A byte view of the whole pool (may be over a SharedArrayBuffer), kvPoolBytes(layout) long. */
  kvPool: Uint8Array;
  numBlocks: number;
  blockSize: number;
  kvDtype: KvPoolLayout['dtype'];
  variant: KernelVariant;
  threads: number;
  /**
   * Repack matrices into the kernel's load-time layout where it has one (default true; false streams the ggml
   * rows, for comparisons). Results are the same bits either way.
   */
  packWeights?: boolean;
  /**
   * Once packed, give the ggml bytes of the packed matrices back to the system: they then read as zeros, so only for
   * a caller that never reads those tensors again (an engine worker owns its loaded model). The embedding table is
   * kept. Default false.
   */
  releaseUnpackedWeights?: boolean;
  /**
   * For tests only: growing the per-step buffers past this many bytes fails as running out of memory does (forward
   * throws an Error with code 'native_allocation_failed'). Default: no limit.
   */
  scratchLimitBytes?: number;
}

/** The per-step buffers a native model holds now (they grow to the largest step so far and are kept). */
export interface NativeMemoryInfo {
  /** Layer activations of every row of the largest step: residual stream, normed copy, Q, K, V, attention output, FFN gate and up. */
  activationBytes: number;
  /** The rest of the scratch: quantized matmul inputs, per-thread kernel scratch, RoPE tables, selected rows, MoE buffers. */
  workspaceBytes: number;
  /** The LoRA adapters in the model's slots: packed matrices and scales. */
  loraBytes: number;
}


export interface NativeModelInfo {
  variant: KernelVariant;
  threads: number;
  /** Kernel kind -> variant serving it (a SIMD table falls back to a lower variant for kernels it lacks). */
  variants: Record<string, string>;
  /** Weight bytes moved onto 2 MiB pages at load (in place: streaming them costs far fewer TLB misses). */
  hugePageBytes: number;
  /** Memory held by load-time packed copies of the weights, on top of the ggml bytes (0 when nothing is packed). */
  packedWeightBytes: number;
  /** ggml bytes of packed matrices given back to the system at load (releaseUnpackedWeights). */
  releasedWeightBytes: number;
}

/** Wall time of one named section of forward passes, summed since the last takeProfile(). */
export interface NativeProfileSection {
  seconds: number;
  calls: number;
  /**
   * CPU time of the thread that called forward() in the section: with one thread, the section's own CPU cost,
   * which other processes taking the cores do not inflate; with more, the caller's share only.
   */
  cpuSeconds: number;
}

export interface NativeModel {
  /**
   * One engine step; throws a RangeError naming the bad field when the batch is inconsistent. The logits go into
   * `out` (the returned array is then a view of its start) when it holds enough floats, else into a new array.
   */
  forward(batch: ForwardBatch, out?: Float32Array): Float32Array;
  info(): NativeModelInfo;
  /**
   * Times named sections of every forward pass while on (matmuls per weight, attention, the small ops; nested:
   * "quantize activations" inside the matmuls, "pool hand-over wait" inside every parallel section).
   */
  setProfiling(on: boolean): void;
  /** The sections timed since the last call, then starts over. */
  takeProfile(): Record<string, NativeProfileSection>;
  /**
   * Gives the KV pool's pages back to the system (madvise MADV_DONTNEED on its page-aligned interior; they read as
   * zeros afterwards) and returns the bytes released. Only when no block holds K/V a later step reads.
   */
  releaseKvPool(): number;
  /** The index of the row's first largest value with the model's kernels; -1 for a NaN or nothing above -Infinity. */
  argmax(row: Float32Array): number;
  /** The sampler's weighing pass (ModelRunnerBackend.sampleWeigh) with the model's kernels. */
  sampleWeigh(values: Float32Array, scale: number, max: number, floor: number, weights: Float64Array,
    blockTotals: Float64Array | null, binMass: Float64Array | null, binCount: Int32Array | null, last: Int32Array): number;
  /** The sampler's scaled copy of a row (ModelRunnerBackend.scaleRow) with the model's kernels. */
  scaleRow(row: Float32Array, out: Float32Array, factor: number): void;
  /** The sampler's prompt-logprob pass over rows at once (ModelRunnerBackend.promptLogprobRows) on the model's threads. */
  promptLogprobRows(logits: Float32Array, rows: number, targets: Int32Array, out: Float64Array, best: Int32Array, numBest: number,
    rowIds?: Int32Array): void;
  /** The sampler's random draws of many rows at once (ModelRunnerBackend.sampleRows) on the model's threads. */
  sampleRows(logits: Float32Array, rows: Int32Array, specs: Float64Array, out: Int32Array): void;
  /** Bytes of the KV pool resident in memory now (mincore), for tests and measurements. */
  kvPoolResidentBytes(): number;
  /** The per-step buffers held now. */
  memoryInfo(): NativeMemoryInfo;
  /**
   * Puts a LoRA adapter (its matrices copied) into a slot that ForwardBatch.loraSlots rows name, or empties the
   * slot (null); native/lora.cc applies it. Throws a RangeError when a matrix does not fit the model.
   */
  setLora(slot: number, adapter: (LoraWeights & { dtype?: LoraDtype }) | null): void;
  dispose(): void;
}

export interface RopeScalingArg {
  type: 'linear' | 'llama3' | 'longrope';
  /** linear and llama3. */
  factor?: number;
  lowFreqFactor?: number;
  highFreqFactor?: number;
  originalContextLength?: number;
  /** longrope: one divisor per frequency, and the scale of the rotated dimensions. */
  factors?: number[];
  attentionFactor?: number;
}

/** Pool layout as the ops entry points take it (the same fields as KvPoolLayout). */
export type NativePoolLayout = KvPoolLayout;

/**
 * One entry per kernel with an explicit variant, for the test harness and the kernel benchmark. Outputs are
 * written into the arrays passed in (so a test can put guard values around them).
 */
export interface NativeOps {
  /**
   * y[m x n] = x[m x k] . W[n x k]^T with W in ggml `type`, split over `threads` threads. With `packed`, W is the
   * variant's load-time layout of the matrix (from `pack`) instead of ggml rows.
   */
  matmul(variant: KernelVariant, type: GgmlType, w: Uint8Array, x: Float32Array, m: number, k: number, n: number,
    y: Float32Array, threads: number, packed?: boolean): void;
  /**
   * y[r] += scale * B (A x[r]) for every row r whose slot names an adapter (slots[r] = -1: none), through the
   * batched LoRA driver with the adapters' matrices stored as `dtype` (native/lora.h); x [rows x inDim], y [rows x
   * outDim], each adapter's a [rank x inDim] and b [outDim x rank] row-major.
   */
  lora(variant: KernelVariant, dtype: LoraDtype, adapters: { rank: number; a: Float32Array; b: Float32Array; scale: number }[],
    inDim: number, outDim: number, x: Float32Array, slots: Int32Array, y: Float32Array, threads: number): void;
  /** Bytes of the load-time packed layout of an [n x k] matrix of `type` in `variant`; 0 when it has none. */
  packedBytes(variant: KernelVariant, type: GgmlType, k: number, n: number): number;
  /**
   * The [n x k] ggml matrix `w` repacked into the variant's load-time layout, as a model packs it (64-byte aligned
   * memory owned by the addon); a RangeError when the variant has no such layout for `type`.
   */
  pack(variant: KernelVariant, type: GgmlType, w: Uint8Array, k: number, n: number): Uint8Array;
  /** out[i] = the dequantized row tokenIds[i] of a [rows x dim] table. */
  embedding(variant: KernelVariant, type: GgmlType, table: Uint8Array, dim: number, tokenIds: Int32Array,
    out: Float32Array): void;
  rmsnorm(variant: KernelVariant, x: Float32Array, weight: Float32Array, rows: number, dim: number, eps: number,
    out: Float32Array): void;
  /** acc += x over acc.length elements. */
  add(variant: KernelVariant, acc: Float32Array, x: Float32Array): void;
  /** The index of the row's first largest value; -1 for a NaN or nothing above -Infinity. */
  argmax(variant: KernelVariant, row: Float32Array): number;
  /** The sampler's weighing pass with one variant's kernels (ModelRunnerBackend.sampleWeigh's arguments after it). */
  sampleWeigh(variant: KernelVariant, values: Float32Array, scale: number, max: number, floor: number, weights: Float64Array,
    blockTotals: Float64Array | null, binMass: Float64Array | null, binCount: Int32Array | null, last: Int32Array): number;
  /** out[i] = row[i] * factor as a Float32Array stores it, over row.length elements (out at least as long; may be row). */
  scaleRow(variant: KernelVariant, row: Float32Array, out: Float32Array, factor: number): void;
  /** ModelRunnerBackend.sampleRows with one variant's kernels, on this thread, over rows of `vocab` values. */
  sampleRows(variant: KernelVariant, vocab: number, logits: Float32Array, rows: Int32Array, specs: Float64Array, out: Int32Array): void;
  /** out = silu(gate) * up over gate.length elements. */
  swiglu(variant: KernelVariant, gate: Float32Array, up: Float32Array, out: Float32Array): void;
  /** out = gelu_tanh(gate) * up (Gemma's gated feed-forward). */
  geglu(variant: KernelVariant, gate: Float32Array, up: Float32Array, out: Float32Array): void;
  /** Softmax of each of `rows` rows of n, in place. */
  softmax(variant: KernelVariant, x: Float32Array, rows: number, n: number): void;
  /** Rotates x [positions.length x numHeads*headDim] in place. */
  rope(variant: KernelVariant, x: Float32Array, positions: Int32Array, numHeads: number, headDim: number,
    ropeDim: number, neox: boolean, theta: number, scaling?: RopeScalingArg): void;
  /** Writes K and V rows [slots.length x numKvHeads*headDim] into the pool at the given slots of `layer`. */
  kvWrite(variant: KernelVariant, k: Float32Array, v: Float32Array, slots: Int32Array, pool: Uint8Array,
    layout: NativePoolLayout, layer: number): void;
  /**
   * Paged attention of q [tokens x numHeads*headDim] over the pool, as in ForwardBatch; with a sliding window (> 0)
   * a row at position p attends to positions p - window + 1 .. p only.
   */
  attention(variant: KernelVariant, q: Float32Array, out: Float32Array, pool: Uint8Array, layout: NativePoolLayout,
    layer: number, queryStartLoc: Int32Array, seqLens: Int32Array, blockTables: Int32Array,
    maxBlocksPerSeq: number, numHeads: number, threads: number, window?: number): void;
  /**
   * Runs tile instructions on a fresh instance of the software AMX model the amx-model kernels use (a test aid). A
   * fault the hardware would raise throws an Error "<INSTRUCTION>: #GP|#UD (<why>)".
   */
  amxModel(program: AmxModelInstruction[]): void;
}

/** One instruction for NativeOps.amxModel; tiles are numbered 0-7, memory operands are byte arrays. */
export type AmxModelInstruction =
  | { op: 'ldtilecfg'; config: Uint8Array }
  | { op: 'tilezero'; tile: number }
  | { op: 'tileloadd' | 'tilestored'; tile: number; memory: Uint8Array; offset: number; stride: number }
  | { op: 'tdpbsud'; dst: number; src1: number; src2: number }
  | { op: 'tilerelease' };

export interface NativeBench {
  /** STREAM-like bandwidth, best of `repetitions`, in GB/s (bytes counted as STREAM does). */
  memoryBandwidth(kind: 'read' | 'copy' | 'triad', bytesPerArray: number, repetitions: number,
    threads: number): number;
  /**
   * Peak multiply-add rate (f32 FMA, int8 VNNI / maddubs, or bf16 VDPBF16PS) with the instructions of `variant`
   * (default: the best), in G ops/s; 0 for generic, and for bf16 where the CPU lacks AVX512-BF16.
   */
  peakFlops(kind: 'f32' | 'int8' | 'bf16', threads: number, variant?: KernelVariant): number;
  /** The calling thread's CPU time in seconds, exact (CLOCK_THREAD_CPUTIME_ID; /proc's schedstat lags to the last tick). */
  threadCpuSeconds(): number;
}

export type Crc32cPathName = 'clmul' | 'clmul256' | 'sse42' | 'table';

export interface NativeAddon {
  cpuInfo(): CpuInfo;
  /** CRC-32C of bytes, continuing crc (default 0); portable: the table version whatever the path in use. */
  crc32c(bytes: Uint8Array, crc?: number, portable?: boolean): number;
  /**
   * The path every CRC-32C call of the process takes (native/checksum.h): 'clmul' (AVX-512 carry-less multiply
   * folding), 'clmul256' (the same on 256-bit registers, AVX2), 'sse42' (the crc32 instruction) or 'table'; the best
   * this CPU runs unless CONDUIT_CRC32C names one.
   * Given a path, switches to it first (RangeError for one the CPU does not run). For tests and benchmarks.
   */
  crc32cPath?(path?: Crc32cPathName): { path: Crc32cPathName; supported: Crc32cPathName[] };
  /**
   * Copies src into dst at dstOffset and returns CRC-32C of src continuing crc, in one pass over the bytes; uncached:
   * with stores that bypass the cache (x86).
   */
  crc32cCopy?(src: Uint8Array, dst: Uint8Array, dstOffset: number, crc?: number, uncached?: boolean): number;
  /**
   * crc32cCopy of many ranges in one call: each of plan's first `count` entries [srcOffset, dstOffset, length, crc]
   * copies src[srcOffset, +length) to dst at dstOffset, and its crc becomes CRC-32C of those bytes continuing it.
   * Every entry is checked (RangeError) before any is copied.
   */
  crc32cCopyRuns?(src: Uint8Array, dst: Uint8Array, plan: Float64Array, count: number, uncached?: boolean): void;
  /**
   * A file of the shared-memory file system mapped (MAP_SHARED) as an ArrayBuffer: create makes it (mode 0600, must
   * not exist) and sizes it to bytes; otherwise it must exist with exactly bytes. POSIX only (throws elsewhere).
   */
  shmMap?(path: string, bytes: number, create: boolean): ArrayBuffer;
  /** Detaches a shmMap buffer and unmaps its region. */
  shmUnmap?(buffer: ArrayBuffer): void;
  kernelVariants(variant: KernelVariant): Record<string, string>;
  NativeModel: new (spec: NativeModelSpec) => NativeModel;
  ops: NativeOps;
  bench: NativeBench;
}

// ---------------------------------------------------------------------------------------------------------------
// Loading

/** Where the addon is loaded from: CONDUIT_NATIVE_ADDON (e.g. a debug build elsewhere) or the npm build output. */
export const NATIVE_ADDON_PATH = process.env.CONDUIT_NATIVE_ADDON
  || fileURLToPath(new URL('../../build/Release/conduit_native.node', import.meta.url));

let loaded: { addon?: NativeAddon; reason?: string } | undefined;

function load(): { addon?: NativeAddon; reason?: string } {
  if (loaded) return loaded;
  if (!existsSync(NATIVE_ADDON_PATH)) {
    loaded = { reason: `${NATIVE_ADDON_PATH} is missing (build it with \`npm run build:native\`)` };
  } else {
    try {
      loaded = { addon: createRequire(import.meta.url)(NATIVE_ADDON_PATH) as NativeAddon };
    } catch (error) {
      loaded = { reason: `loading ${NATIVE_ADDON_PATH} failed: ${(error as Error).message}` };
    }
  }
  return loaded;
}

/** The addon, or undefined when it is not built or does not load (see nativeUnavailableReason). */
export function tryLoadNativeAddon(): NativeAddon | undefined {
  return load().addon;
}

/** The addon; throws with the reason when it is unavailable. */
export function loadNativeAddon(): NativeAddon {
  const { addon, reason } = load();
  if (!addon) throw new Error(`native kernels unavailable: ${reason}`);
  return addon;
}

export function nativeUnavailableReason(): string | undefined {
  return load().reason;
}

/**
 * The variant to run: the best this CPU supports, or CONDUIT_KERNEL_VARIANT when set (it may only ask for a
 * lower one, e.g. to compare against or to work around a suspected SIMD bug, or for a verification build such as
 * amx-model).
 */
export function resolveKernelVariant(
  requested: string | undefined = process.env.CONDUIT_KERNEL_VARIANT,
  cpu: CpuInfo = loadNativeAddon().cpuInfo(),
): KernelVariant {
  if (requested === undefined || requested === '') return cpu.bestVariant;
  if ((VERIFICATION_VARIANTS as readonly string[]).includes(requested)) {
    if (!cpu.verificationVariants.includes(requested as KernelVariant)) {
      throw new Error(`CONDUIT_KERNEL_VARIANT=${requested}: this CPU cannot run it (it needs avx512)`);
    }
    return requested as KernelVariant;
  }
  const ordered = KERNEL_VARIANTS as readonly string[];
  if (!ordered.includes(requested)) {
    throw new Error(`CONDUIT_KERNEL_VARIANT=${requested}: expected one of ${KERNEL_VARIANTS.join(', ')} ` +
      `(or the verification build ${VERIFICATION_VARIANTS.join(', ')})`);
  }
  if (ordered.indexOf(requested) > ordered.indexOf(cpu.bestVariant)) {
    throw new Error(`CONDUIT_KERNEL_VARIANT=${requested}: this CPU supports at most ${cpu.bestVariant}`);
  }
  return requested as KernelVariant;
}

/** The ordered variants this CPU runs, lowest first (verification builds are in cpuInfo().verificationVariants). */
export function supportedVariants(cpu: CpuInfo = loadNativeAddon().cpuInfo()): KernelVariant[] {
  return KERNEL_VARIANTS.slice(0, KERNEL_VARIANTS.indexOf(cpu.bestVariant) + 1);
}

// ---------------------------------------------------------------------------------------------------------------
// The backend

function nativeTensor(t: Tensor): NativeTensor {
  return { type: t.type, shape: t.shape, data: t.data };
}

/** A stacked expert tensor [cols, rows, experts] as the 2-D [cols, rows * experts] the addon takes. */
function stackedTensor(t: Tensor): NativeTensor {
  return { type: t.type, shape: [t.shape[0]!, (t.shape[1] ?? 1) * (t.shape[2] ?? 1)], data: t.data };
}

export function nativeModelSpec(
  config: ModelConfig,
  weights: ModelWeights,
  pool: { layout: KvPoolLayout; bytes: Uint8Array },
  variant: KernelVariant,
  threads: number,
): NativeModelSpec {
  if (weights.layers.length !== config.numLayers) {
    throw new Error(`weights have ${weights.layers.length} layers, the config says ${config.numLayers}`);
  }
  return {
    vocabSize: config.vocabSize,
    dim: config.dim,
    numHeads: config.numHeads,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    ffnDim: config.ffnDim,
    rmsNormEps: config.rmsNormEps,
    ropeTheta: config.ropeTheta,
    ropeDim: config.ropeDim,
    ropeNeox: config.ropeStyle === 'neox',
    ropeScaling: config.ropeScaling,
    qkvBias: config.qkvBias,
    ...(config.qkNorm ? { qkNorm: true } : {}),
    ...(config.moe ? { moe: config.moe } : {}),
    ...(config.slidingWindow ? { layerWindows: Array.from({ length: config.numLayers }, (_, l) => layerWindow(config, l)) } : {}),
    ...(config.ropeLocalTheta !== undefined ? { ropeLocalTheta: config.ropeLocalTheta } : {}),
    ...(config.embeddingScale !== undefined ? { embeddingScale: config.embeddingScale } : {}),
    ...(config.postNorms ? { postNorms: true } : {}),
    ...(config.ffnActivation === 'gelu_tanh' ? { geluFfn: true } : {}),
    ...(config.attentionScale !== undefined ? { attentionScale: config.attentionScale } : {}),
    ...(config.finalLogitSoftcap !== undefined ? { finalLogitSoftcap: config.finalLogitSoftcap } : {}),
    tokenEmbedding: nativeTensor(weights.tokenEmbedding),
    outputNorm: nativeTensor(weights.outputNorm),
    output: nativeTensor(weights.output),
    layers: weights.layers.map((l, i) => {
      if (config.qkvBias && !(l.bq && l.bk && l.bv)) throw new Error(`layer ${i}: qkvBias is set but a bias is missing`);
      if (config.qkNorm && !(l.qNorm && l.kNorm)) throw new Error(`layer ${i}: qkNorm is set but a norm is missing`);
      if (config.moe && !l.ffnGateInp) throw new Error(`layer ${i}: the config has experts but the router is missing`);
      const ffn = config.moe ? stackedTensor : nativeTensor;
      return {
        attnNorm: nativeTensor(l.attnNorm),
        wq: nativeTensor(l.wq),
        wk: nativeTensor(l.wk),
        wv: nativeTensor(l.wv),
        wo: nativeTensor(l.wo),
        ...(config.qkvBias ? { bq: nativeTensor(l.bq!), bk: nativeTensor(l.bk!), bv: nativeTensor(l.bv!) } : {}),
        ...(config.qkNorm ? { qNorm: nativeTensor(l.qNorm!), kNorm: nativeTensor(l.kNorm!) } : {}),
        ...(config.moe ? { ffnGateInp: nativeTensor(l.ffnGateInp!) } : {}),
        ...(config.postNorms ? { attnPostNorm: nativeTensor(l.attnPostNorm!), ffnPostNorm: nativeTensor(l.ffnPostNorm!) } : {}),
        ffnNorm: nativeTensor(l.ffnNorm),
        wGate: ffn(l.wGate),
        wUp: ffn(l.wUp),
        wDown: ffn(l.wDown),
      };
    }),
    kvPool: pool.bytes,
    numBlocks: pool.layout.numBlocks,
    blockSize: pool.layout.blockSize,
    kvDtype: pool.layout.dtype,
    variant,
    threads,
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Packed weights: the avx512 matmuls (and amx, which reads the same layout) read a copy of each quantized matrix in
// their own order. The copy costs as much memory as those matrices again, so it is made only when it fits: a model
// that barely fits the machine still loads and runs on the ggml rows (slower decode) rather than pushing the machine
// into swap.

/** Memory left free after the packed copy, besides what it takes. */
const PACK_HEADROOM_BYTES = 1024 ** 3;

/** Bytes the packed copies of `weights` would take with `variant` (0 when it packs nothing). */
export function packedWeightBytes(ops: NativeOps, variant: KernelVariant, weights: ModelWeights): number {
  const matrices = [weights.output, ...weights.layers.flatMap((l) => [l.wq, l.wk, l.wv, l.wo, l.wGate, l.wUp, l.wDown])];
  let total = 0;
  // A stacked expert tensor is packed expert by expert.
  for (const t of matrices) total += ops.packedBytes(variant, t.type, t.shape[0]!, t.shape[1] ?? 1) * (t.shape[2] ?? 1);
  return total;
}

/** MemAvailable from /proc/meminfo (what can be allocated without swapping), else the OS's free memory. */
function availableMemoryBytes(): number {
  try {
    const match = /^MemAvailable:\s+(\d+) kB$/m.exec(readFileSync('/proc/meminfo', 'utf8'));
    if (match) return Number(match[1]) * 1024;
  } catch { /* not Linux */ }
  return freemem();
}

function gib(bytes: number): string {
  return `${(bytes / 1024 ** 3).toFixed(2)} GiB`;
}

/**
 * Whether to pack, and what to tell the operator. An explicit choice (option, then CONDUIT_PACK_WEIGHTS=0|1) is
 * obeyed; otherwise the copy is made when it and the headroom fit in the memory available now.
 */
export function decidePacking(
  packedBytes: number, explicit: boolean | undefined, env: NodeJS.ProcessEnv = process.env,
  availableBytes: () => number = availableMemoryBytes,
): { pack: boolean; notice?: string } {
  if (packedBytes === 0) return { pack: false };
  if (explicit !== undefined) return { pack: explicit };
  const fromEnv = env.CONDUIT_PACK_WEIGHTS?.trim().toLowerCase();
  if (fromEnv !== undefined && fromEnv !== '') {
    if (['1', 'true', 'on', 'yes'].includes(fromEnv)) return { pack: true };
    if (['0', 'false', 'off', 'no'].includes(fromEnv)) return { pack: false };
    throw new RangeError(`CONDUIT_PACK_WEIGHTS must be 0 or 1, got "${env.CONDUIT_PACK_WEIGHTS}"`);
  }
  const available = availableBytes();
  if (packedBytes + PACK_HEADROOM_BYTES <= available) return { pack: true };
  return {
    pack: false,
    notice: `weights not repacked for the native kernels: the copy needs ${gib(packedBytes)} and ${gib(available)} ` +
      `is available (${gib(PACK_HEADROOM_BYTES)} kept free); decode runs on the ggml rows, slower ` +
      '(CONDUIT_PACK_WEIGHTS=1 packs anyway)',
  };
}

/**
 * What an operator of an AMX machine should know at start: whether Linux granted AMX, and what the AMX kernels (Q8_0
 * and Q4_0 matmuls of 16 rows or more: prefill) do on this machine, or why they are not used.
 */
export function amxNotice(cpu: CpuInfo, variant: KernelVariant): string | undefined {
  if (!cpu.amxTile) return undefined;
  const detected = `AMX detected (tile data permission: ${cpu.amxStatus})`;
  if (variant === 'amx') {
    return `${detected}; Q8_0 and Q4_0 matmuls of 16 rows or more (prefill) run on the AMX-INT8 kernels, fewer rows ` +
      '(decode) and other weight types on the avx512 kernels';
  }
  const reason = !cpu.amxInt8 ? 'the CPU has no AMX-INT8'
    : !cpu.amxPermitted ? 'Linux did not grant tile data'
      : cpu.bestVariant === 'amx' ? `CONDUIT_KERNEL_VARIANT chose ${variant}`
        : 'the CPU lacks the AVX-512 features they build on';
  return `${detected}; the AMX kernels (Q8_0/Q4_0 prefill) are not used because ${reason}, so matmuls use the ` +
    `${variant} kernels`;
}

function checkPositiveInteger(name: string, value: number): void {
  if (!Number.isInteger(value) || value <= 0) throw new RangeError(`${name} must be a positive integer, got ${value}`);
}

export const nativeBackend: BackendFactory & { unavailableReason(): string | undefined } = {
  name: 'native',
  // f16 as llama.cpp stores it: half the memory of f32, and half the bytes decode attention reads.
  kvDtypes: ['f16', 'f32'],
  available: () => tryLoadNativeAddon() !== undefined,
  unavailableReason: nativeUnavailableReason,
  load(config, weights, kv, options = {}): ModelRunnerBackend {
    const addon = loadNativeAddon();
    const cpu = addon.cpuInfo();
    checkPositiveInteger('numBlocks', kv.numBlocks);
    checkPositiveInteger('blockSize', kv.blockSize);
    if (kv.dtype !== 'f32' && kv.dtype !== 'f16') throw new RangeError(`KV dtype must be f32 or f16, got ${kv.dtype}`);
    const threads = options.threads ?? cpu.defaultThreads;
    checkPositiveInteger('threads', threads);
    const loraDtype = resolveLoraDtype(options.loraDtype);
    const kvLayout: KvPoolLayout = {
      numLayers: config.numLayers, numBlocks: kv.numBlocks, blockSize: kv.blockSize,
      numKvHeads: config.numKvHeads, headDim: config.headDim, dtype: kv.dtype,
    };
    const kvPool = new SharedArrayBuffer(kvPoolBytes(kvLayout));
    const variant = resolveKernelVariant(undefined, cpu);
    const packing = decidePacking(packedWeightBytes(addon.ops, variant, weights), options.packWeights);
    const model = new addon.NativeModel({
      ...nativeModelSpec(config, weights, { layout: kvLayout, bytes: new Uint8Array(kvPool) }, variant, threads),
      packWeights: packing.pack,
      releaseUnpackedWeights: packing.pack && (options.releaseUnpackedWeights ?? false),
      ...(options.scratchLimitBytes !== undefined ? { scratchLimitBytes: options.scratchLimitBytes } : {}),
    });
    const modelInfo = model.info();
    // The ggml bytes the model reads (views of the loaded file), plus the packed copies, less the pages given back.
    const weightsBytes = weightBytes(weights) + modelInfo.packedWeightBytes - modelInfo.releasedWeightBytes;
    const notices = [packing.notice, amxNotice(cpu, variant)].filter((n): n is string => n !== undefined);
    const info: BackendInfo = {
      name: 'native', variants: modelInfo.variants, threads: modelInfo.threads, loraDtype,
      ...(notices.length > 0 ? { notices } : {}),
    };
    let disposed = false;
    return {
      info,
      config,
      kvLayout,
      kvPool,
      forward(batch: ForwardBatch, out?: Float32Array): Float32Array {
        if (disposed) throw new Error('native backend is disposed');
        return model.forward(batch, out);
      },
      argmax(row: Float32Array): number {
        if (disposed) throw new Error('native backend is disposed');
        return model.argmax(row);
      },
      sampleWeigh(values, scale, max, floor, weights, blockTotals, binMass, binCount, last): number {
        if (disposed) throw new Error('native backend is disposed');
        return model.sampleWeigh(values, scale, max, floor, weights, blockTotals, binMass, binCount, last);
      },
      scaleRow(row: Float32Array, out: Float32Array, factor: number): void {
        if (disposed) throw new Error('native backend is disposed');
        model.scaleRow(row, out, factor);
      },
      promptLogprobRows(logits: Float32Array, rows: number, targets: Int32Array, out: Float64Array, best: Int32Array, numBest: number,
        rowIds?: Int32Array): void {
        if (disposed) throw new Error('native backend is disposed');
        model.promptLogprobRows(logits, rows, targets, out, best, numBest, rowIds);
      },
      sampleRows(logits: Float32Array, rows: Int32Array, specs: Float64Array, out: Int32Array): void {
        if (disposed) throw new Error('native backend is disposed');
        model.sampleRows(logits, rows, specs, out);
      },
      releaseKvPool(): number {
        if (disposed) return 0;
        return model.releaseKvPool();
      },
      memory(): BackendMemory {
        const now = disposed ? { activationBytes: 0, workspaceBytes: 0, loraBytes: 0 } : model.memoryInfo();
        return {
          weightsBytes, kvCacheBytes: kvPool.byteLength, scratchBytes: now.activationBytes + now.workspaceBytes,
          loraAdaptersBytes: now.loraBytes,
        };
      },
      setLora(slot: number, adapter: LoraWeights | null): void {
        if (disposed) throw new Error('native backend is disposed');
        model.setLora(slot, adapter ? { ...adapter, dtype: loraDtype } : null);
      },
      dispose(): void {
        if (disposed) return;
        disposed = true;
        model.dispose();
      },
    };
  },
};
