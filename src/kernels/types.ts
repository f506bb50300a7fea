// The contract between the engine (TypeScript control plane) and a compute backend (native addon or the
// TypeScript reference). One `forward` call per engine step, flat typed arrays in, logits out: no per-token or
// per-layer crossings. The KV cache is a paged pool the backend owns the bytes of and the engine owns the
// bookkeeping of (which block holds which tokens).

import type { ModelConfig } from '../model/config.ts';
import type { LoraDtype, LoraWeights } from '../model/lora.ts';
import type { ModelWeights } from '../model/weights.ts';

export type KvDtype = 'f32' | 'f16';

/**
 * Shape of the paged KV pool. Element (layer, kv, block, slot, kvHead, d) — kv 0 = K, 1 = V — lives at
 *   ((((layer * 2 + kv) * numBlocks + block) * blockSize + slot) * numKvHeads + kvHead) * headDim + d
 * so one block of one layer's K (or V) is a contiguous run of blockSize * numKvHeads * headDim elements, which is
 * what a KV transfer copies (2 * numLayers runs per block).
 */
export interface KvPoolLayout {
  numLayers: number;
  numBlocks: number;
  blockSize: number;
  numKvHeads: number;
  headDim: number;
  dtype: KvDtype;
}

/**
 * The KV dtype a worker on `factory` stores: the one asked for, or with none (`--kv-cache-dtype auto`) the backend's
 * first choice. The one place auto is decided: serve, worker processes, prefill and decode workers and the disk tier's
 * fingerprint all take the dtype the worker resolved here. A dtype the backend cannot store is an error.
 */
export function resolveKvDtype(factory: Pick<BackendFactory, 'name' | 'kvDtypes'>, requested: KvDtype | undefined): KvDtype {
  if (requested === undefined) return factory.kvDtypes[0] ?? 'f32';
  if (!factory.kvDtypes.includes(requested)) {
    throw new RangeError(`the ${factory.name} backend cannot store the KV cache as ${requested} (it stores ${factory.kvDtypes.join(', ')})`);
  }
  return requested;
}

export function kvElementsPerBlockRun(layout: KvPoolLayout): number {
  return layout.blockSize * layout.numKvHeads * layout.headDim;
}

export function kvPoolBytes(layout: KvPoolLayout): number {
  const bytesPerElement = layout.dtype === 'f32' ? 4 : 2;
  return 2 * layout.numLayers * layout.numBlocks * kvElementsPerBlockRun(layout) * bytesPerElement;
}

/**
 * One engine step, flattened as in vLLM: the new tokens of every scheduled sequence back to back.
 * Sequence s owns batch rows queryStartLoc[s] .. queryStartLoc[s+1]-1; those rows are its last
 * (queryStartLoc[s+1] - queryStartLoc[s]) positions, so row r of sequence s has position
 * seqLens[s] - (queryStartLoc[s+1] - r). Each new token attends causally to every earlier position of its
 * sequence (cached in the pool or new in this step) and to itself.
 */
export interface ForwardBatch {
  numTokens: number;
  /** [numTokens] token ids. */
  tokenIds: Int32Array;
  /** [numTokens] absolute position of each token in its sequence (RoPE). */
  positions: Int32Array;
  /** [numTokens] pool slot (block * blockSize + offset) where each token's K and V are written. */
  slotMapping: Int32Array;
  numSeqs: number;
  /** [numSeqs + 1] prefix sums of the new-token counts. */
  queryStartLoc: Int32Array;
  /** [numSeqs] context length of each sequence after this step (cached + new tokens). */
  seqLens: Int32Array;
  /** [numSeqs * maxBlocksPerSeq] block ids of each sequence in order; unused entries are ignored. */
  blockTables: Int32Array;
  maxBlocksPerSeq: number;
  /** Batch rows whose logits are wanted, in output order (typically each sequence's last row). */
  logitsIndices: Int32Array;
  /**
   * [numTokens] the LoRA adapter slot of each row (ModelRunnerBackend.setLora), -1 for the base model; absent when
   * no row has one. Rows of different adapters and of the base model run in the same step.
   */
  loraSlots?: Int32Array;
}

export interface BackendInfo {
  /** 'native' or 'reference'. */
  name: string;
  /** The kernel variant in use per kernel kind, e.g. { matmul_q8_0: 'avx512_vnni', attention: 'avx512' }. */
  variants: Record<string, string>;
  threads: number;
  /** What the backend decided at load that an operator should know (logged once at start). */
  notices?: readonly string[];
  /** How the backend stores LoRA adapters (BackendLoadOptions.loraDtype); absent where it keeps them as given. */
  loraDtype?: LoraDtype;
}

/** A model loaded into a backend, with its KV pool. */
export interface ModelRunnerBackend {
  readonly info: BackendInfo;
  readonly config: ModelConfig;
  readonly kvLayout: KvPoolLayout;
  /**
   * Runs the model on the batch, writes its K/V into the pool, returns logits [logitsIndices.length * vocabSize].
   * With `out` (a buffer the caller reuses across steps) a backend may write the logits there and return a view of
   * its start instead of allocating: the result is then valid until `out` is written again.
   */
  forward(batch: ForwardBatch, out?: Float32Array): Float32Array;
  /** The pool's bytes (shared so that KV transfer can copy blocks between workers without serialising). */
  readonly kvPool: SharedArrayBuffer;
  /**
   * Gives the pool's memory back to the system, returning the bytes released; called only when no block holds K/V
   * a later step reads (after a prefix-cache reset with no block in use). Optional: a backend without it keeps its pages.
   */
  releaseKvPool?(): number;
  /**
   * The index of the first largest value of a logits row (the greedy token), or -1 when the row holds a NaN or
   * nothing above -Infinity (the sampler then reports the row as its own argmax does). Optional: a faster pass than
   * the sampler's JavaScript one, with the same answer.
   */
  argmax?(row: Float32Array): number;
  /**
   * The sampler's weighing pass over a logits row (src/engine/sampler.ts, weighCandidates: the same arguments and
   * results, bit for bit). Optional: a faster pass than the sampler's JavaScript one.
   */
  sampleWeigh?(values: Float32Array, scale: number, max: number, floor: number, weights: Float64Array,
    blockTotals: Float64Array | null, binMass: Float64Array | null, binCount: Int32Array | null, last: Int32Array): number;
  /**
   * The sampler's scaled copy of a row: out[i] = row[i] * factor as a Float32Array stores it (the product in double,
   * then the float nearest it), over row.length elements; out may be row. The same values as the JavaScript loop,
   * bit for bit. Optional: a faster loop than the sampler's own.
   */
  scaleRow?(row: Float32Array, out: Float32Array, factor: number): void;
  /**
   * The sampler's prompt-logprob pass over `rows` logits rows at once (the backend's threads may share them): for
   * row r, out[3r] = its argmax id (as argmax: -1 for a NaN or nothing above -Infinity, the other two then
   * 0), out[3r + 1] = sampleWeigh's total at scale 1 from that max with no floor, out[3r + 2] = how many values are
   * greater than row[targets[r]], and best[r * numBest ..] its numBest (at most the vocabulary) best ids, best first,
   * the lower id first among equal values. Bit for bit what those passes give one row at a time. With rowIds, entry r
   * is of logits row rowIds[r] instead of row r (the sampled tokens' logprobs, for some of a step's rows). Optional.
   */
  promptLogprobRows?(logits: Float32Array, rows: number, targets: Int32Array, out: Float64Array, best: Int32Array, numBest: number,
    rowIds?: Int32Array): void;
  /**
   * The sampler's random draws of many logits rows at once (the backend's threads may share them): entry i draws
   * row rows[i] of `logits` (whole rows of the vocabulary) into out[i] by specs[5i ..] = the factor values are read
   * at (1 / temperature; 0: a greedy row, its argmax as the argmax member gives it, the other words unused), ln(min_p)
   * (-Infinity: none), top_p (1: no cut by mass), the uniform in [0, 1), top_k (0: none, else below the vocabulary);
   * -1 for a row with a NaN or nothing above -Infinity. The token the sampler's own draw (Sampler.sampleRow, with no
   * logit processors) gives for that uniform, bit for bit. Optional.
   */
  sampleRows?(logits: Float32Array, rows: Int32Array, specs: Float64Array, out: Int32Array): void;
  /**
   * Puts a LoRA adapter in a slot (0 .. maxLoraSlots - 1), or empties the slot (null). Rows of a ForwardBatch name
   * their slot in loraSlots: each row's projections get scale * B (A x) added to the base matmul's output.
   */
  setLora?(slot: number, weights: LoraWeights | null): void;
  /** What the backend holds in memory now, measured from its own allocations (the worker's memory gauge). */
  memory?(): BackendMemory;
  dispose(): void;
}

/**
 * The code of the Error a backend throws when memory for a step cannot be allocated (the native addon's std::bad_alloc
 * surfaces as this instead of aborting the process).
 */
export const NATIVE_ALLOCATION_FAILED = 'native_allocation_failed';

/** A backend's memory by category, bytes. */
export interface BackendMemory {
  /** The weight tensors it reads: views of the loaded file and any copies it made (packed, dequantized). */
  weightsBytes: number;
  /** The paged KV pool. */
  kvCacheBytes: number;
  /** Per-step buffers (activations and kernel scratch), when the backend keeps any between steps. */
  scratchBytes?: number;
  /** LoRA adapters loaded into the backend (setLora), as it holds them. */
  loraAdaptersBytes?: number;
}

export interface BackendFactory {
  readonly name: string;
  /**
   * The KV dtypes the backend can store, the one `--kv-cache-dtype auto` means first (resolveKvDtype). Both CPU
   * backends store f16 and f32; a backend that cannot store f16 lists only f32, so that auto stays f32 for it.
   */
  readonly kvDtypes: readonly KvDtype[];
  available(): boolean;
  load(config: ModelConfig, weights: ModelWeights, kv: Omit<KvPoolLayout, 'numLayers' | 'numKvHeads' | 'headDim'>,
    options?: BackendLoadOptions): ModelRunnerBackend;
}

export interface BackendLoadOptions {
  threads?: number;
  /**
   * Native backend: how LoRA adapters' matrices are stored for the batched kernel ('q8': int8 with a scale per row,
   * 'bf16', or 'f32', exact; native/lora.h). Default: CONDUIT_LORA_DTYPE if set, else DEFAULT_LORA_DTYPE.
   */
  loraDtype?: LoraDtype;
  /**
   * Native backend: keep a copy of the quantized matrices repacked for its kernels (faster decode, about the
   * matrices' size again in memory). Default: CONDUIT_PACK_WEIGHTS if set, else only when the copy fits in the
   * memory available at load with room to spare.
   */
  packWeights?: boolean;
  /**
   * Native backend, with the packed copy: give the memory of the packed matrices' original bytes back to the system
   * (they read as zeros afterwards). Only for a caller that never reads those tensors again, such as an engine
   * worker that loaded the model for this backend alone. Default false.
   */
  releaseUnpackedWeights?: boolean;
  /** Native backend, for tests only: per-step buffers past this many bytes fail as out of memory (NativeModelSpec). */
  scratchLimitBytes?: number;
}
