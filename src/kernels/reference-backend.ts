// The reference compute backend: the reference transformer over the paged KV pool the engine manages. It is slow
// and simple on purpose; the native backend must produce the same logits for the same ForwardBatch.
//
// Per layer of a step: every new token's K and V go to its pool slot (slotMapping), then each sequence gathers
// its whole context, positions 0 .. seqLen-1, through its block table into contiguous scratch and runs causal
// attention for its new rows. Gathering costs a copy of the context per layer, about what attention itself reads,
// and keeps one attention kernel for the contiguous and the paged cache.

import type { ModelConfig } from '../model/config.ts';
import { f16BitsToF32, f32ToF16Bits } from '../model/quant.ts';
import { ReferenceTransformer } from '../model/reference-forward.ts';
import type { ModelWeights } from '../model/weights.ts';
import type { LoraWeights } from '../model/lora.ts';
import { causalAttention } from '../model/reference-math.ts';
import {
  type BackendFactory, type BackendInfo, type BackendMemory, type ForwardBatch, type KvPoolLayout, kvPoolBytes, type ModelRunnerBackend,
} from './types.ts';

export class DisposedBackendError extends Error {
  override name = 'DisposedBackendError';
}

export class InvalidBatchError extends Error {
  override name = 'InvalidBatchError';
}

// ---------------------------------------------------------------------------------------------------------------
// The paged pool

/** Typed views of the pool with the layout's addressing: a token's K (or V) row holds all its KV heads. */
class PagedKvPool {
  readonly bytes: SharedArrayBuffer;
  private readonly f32?: Float32Array;
  private readonly f16?: Uint16Array;
  private readonly rowLength: number;
  private readonly slotsPerLayer: number;

  constructor(readonly layout: KvPoolLayout) {
    this.bytes = new SharedArrayBuffer(kvPoolBytes(layout));
    if (layout.dtype === 'f32') this.f32 = new Float32Array(this.bytes);
    else this.f16 = new Uint16Array(this.bytes);
    this.rowLength = layout.numKvHeads * layout.headDim;
    this.slotsPerLayer = layout.numBlocks * layout.blockSize;
  }

  /** Element offset of the row of `slot` (block * blockSize + offset); kv 0 = K, 1 = V. */
  private rowOffset(layer: number, kv: 0 | 1, slot: number): number {
    return ((layer * 2 + kv) * this.slotsPerLayer + slot) * this.rowLength;
  }

  /** Stores row `row` of `rows` ([*, rowLength]) at `slot`. */
  write(layer: number, kv: 0 | 1, slot: number, rows: Float32Array, row: number): void {
    const at = this.rowOffset(layer, kv, slot);
    const from = row * this.rowLength;
    if (this.f32) {
      this.f32.set(rows.subarray(from, from + this.rowLength), at);
    } else {
      for (let i = 0; i < this.rowLength; i++) this.f16![at + i] = f32ToF16Bits(rows[from + i]!);
    }
  }

  /** Copies `count` consecutive slots starting at `slot` into out[outRow ..] as f32 rows. */
  read(layer: number, kv: 0 | 1, slot: number, count: number, out: Float32Array, outRow: number): void {
    const at = this.rowOffset(layer, kv, slot);
    const length = count * this.rowLength;
    const to = outRow * this.rowLength;
    if (this.f32) {
      out.set(this.f32.subarray(at, at + length), to);
    } else {
      for (let i = 0; i < length; i++) out[to + i] = f16BitsToF32(this.f16![at + i]!);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Batch checks: a malformed batch from the engine must fail loudly, not attend to the wrong tokens.

function checkBatch(batch: ForwardBatch, layout: KvPoolLayout): void {
  const { numTokens, numSeqs, queryStartLoc, seqLens, blockTables, maxBlocksPerSeq } = batch;
  const fail = (message: string): never => { throw new InvalidBatchError(`forward batch: ${message}`); };
  if (!Number.isInteger(numTokens) || numTokens < 0) fail(`numTokens ${numTokens} is not a count`);
  if (!Number.isInteger(numSeqs) || numSeqs < 0) fail(`numSeqs ${numSeqs} is not a count`);
  for (const [name, array] of [['tokenIds', batch.tokenIds], ['positions', batch.positions],
    ['slotMapping', batch.slotMapping]] as const) {
    if (array.length < numTokens) fail(`${name} has ${array.length} entries for ${numTokens} tokens`);
  }
  if (queryStartLoc.length < numSeqs + 1) fail(`queryStartLoc has ${queryStartLoc.length} entries, needs ${numSeqs + 1}`);
  if (seqLens.length < numSeqs) fail(`seqLens has ${seqLens.length} entries for ${numSeqs} sequences`);
  if (blockTables.length < numSeqs * maxBlocksPerSeq) {
    fail(`blockTables has ${blockTables.length} entries, needs numSeqs * maxBlocksPerSeq = ` +
      `${numSeqs * maxBlocksPerSeq}`);
  }
  if (queryStartLoc[0] !== 0) fail(`queryStartLoc[0] is ${queryStartLoc[0]}, must be 0`);
  if (queryStartLoc[numSeqs] !== numTokens) {
    fail(`queryStartLoc[${numSeqs}] is ${queryStartLoc[numSeqs]}, must equal numTokens ${numTokens}`);
  }
  const totalSlots = layout.numBlocks * layout.blockSize;
  for (let s = 0; s < numSeqs; s++) {
    const first = queryStartLoc[s]!;
    const numNew = queryStartLoc[s + 1]! - first;
    const seqLen = seqLens[s]!;
    if (numNew < 0) fail(`queryStartLoc decreases at sequence ${s}`);
    if (seqLen < numNew) fail(`sequence ${s} has ${numNew} new tokens but seqLen ${seqLen}`);
    const blocksNeeded = Math.ceil(seqLen / layout.blockSize);
    if (blocksNeeded > maxBlocksPerSeq) {
      fail(`sequence ${s} (seqLen ${seqLen}) needs ${blocksNeeded} blocks, maxBlocksPerSeq is ${maxBlocksPerSeq}`);
    }
    for (let b = 0; b < blocksNeeded; b++) {
      const block = blockTables[s * maxBlocksPerSeq + b]!;
      if (!(block >= 0 && block < layout.numBlocks)) {
        fail(`sequence ${s} block table entry ${b} is ${block}, the pool has blocks 0..${layout.numBlocks - 1}`);
      }
    }
    for (let r = first; r < first + numNew; r++) {
      const position = seqLen - (first + numNew - r);
      if (batch.positions[r] !== position) {
        fail(`row ${r} (sequence ${s}) has position ${batch.positions[r]}, its place in the sequence is ${position}`);
      }
      const block = blockTables[s * maxBlocksPerSeq + Math.floor(position / layout.blockSize)]!;
      const slot = block * layout.blockSize + (position % layout.blockSize);
      const mapped = batch.slotMapping[r]!;
      if (!(mapped >= 0 && mapped < totalSlots)) fail(`row ${r} slot ${mapped} is outside the pool (0..${totalSlots - 1})`);
      if (mapped !== slot) {
        fail(`row ${r} (sequence ${s}, position ${position}) maps to slot ${mapped}, its block table says ${slot}`);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The backend

class ReferenceRunnerBackend implements ModelRunnerBackend {
  readonly info: BackendInfo = {
    name: 'reference',
    variants: { matmul: 'typescript', attention: 'typescript' },
    threads: 1,
  };
  readonly config: ModelConfig;
  readonly kvLayout: KvPoolLayout;
  private readonly transformer: ReferenceTransformer;
  private readonly pool: PagedKvPool;
  private readonly loras: (LoraWeights | undefined)[] = [];
  private disposed = false;

  constructor(config: ModelConfig, weights: ModelWeights, kv: Omit<KvPoolLayout, 'numLayers' | 'numKvHeads' | 'headDim'>) {
    for (const key of ['numBlocks', 'blockSize'] as const) {
      if (!Number.isInteger(kv[key]) || kv[key] <= 0) {
        throw new RangeError(`KV pool: ${key} must be a positive integer, got ${kv[key]}`);
      }
    }
    if (kv.dtype !== 'f32' && kv.dtype !== 'f16') throw new RangeError(`KV pool: dtype ${String(kv.dtype)} is not f32 or f16`);
    this.config = config;
    this.transformer = new ReferenceTransformer(config, weights);
    this.kvLayout = {
      numLayers: config.numLayers, numBlocks: kv.numBlocks, blockSize: kv.blockSize,
      numKvHeads: config.numKvHeads, headDim: config.headDim, dtype: kv.dtype,
    };
    this.pool = new PagedKvPool(this.kvLayout);
  }

  /**
   * The dequantized f32 copies it computes with, the adapters in its slots (held as given) and the pool; its
   * per-step arrays are allocated per step, not kept.
   */
  memory(): BackendMemory {
    const { tokenEmbedding, outputNorm, output, layers } = this.transformer.weights;
    const arrays = new Set<Float32Array>([tokenEmbedding, outputNorm, output]);
    for (const layer of layers) for (const array of Object.values(layer)) if (array instanceof Float32Array) arrays.add(array);
    let weightsBytes = 0;
    for (const array of arrays) weightsBytes += array.byteLength;
    let loraAdaptersBytes = 0;
    for (const adapter of this.loras) {
      for (const layer of adapter?.layers ?? []) for (const m of Object.values(layer)) loraAdaptersBytes += m.a.byteLength + m.b.byteLength;
    }
    return { weightsBytes, kvCacheBytes: this.pool.bytes.byteLength, loraAdaptersBytes };
  }

  get kvPool(): SharedArrayBuffer {
    return this.pool.bytes;
  }

  forward(batch: ForwardBatch): Float32Array {
    if (this.disposed) throw new DisposedBackendError('reference backend: forward called after dispose');
    checkBatch(batch, this.kvLayout);
    const rows = batch.numTokens;
    const attend = (layer: number, q: Float32Array, k: Float32Array, v: Float32Array, out: Float32Array): void => {
      for (let r = 0; r < rows; r++) {
        this.pool.write(layer, 0, batch.slotMapping[r]!, k, r);
        this.pool.write(layer, 1, batch.slotMapping[r]!, v, r);
      }
      for (let s = 0; s < batch.numSeqs; s++) this.attendSequence(layer, batch, s, q, out);
    };
    let rowAdapters: (LoraWeights | undefined)[] | undefined;
    if (batch.loraSlots) {
      rowAdapters = [];
      for (let r = 0; r < rows; r++) {
        const slot = batch.loraSlots[r]!;
        if (slot < 0) { rowAdapters.push(undefined); continue; }
        const adapter = this.loras[slot];
        if (!adapter) throw new InvalidBatchError(`forward batch: row ${r} names LoRA slot ${slot}, which holds no adapter`);
        rowAdapters.push(adapter);
      }
    }
    return this.transformer.run(batch.tokenIds.subarray(0, rows), batch.positions.subarray(0, rows), attend,
      batch.logitsIndices, rowAdapters);
  }

  setLora(slot: number, weights: LoraWeights | null): void {
    if (!Number.isInteger(slot) || slot < 0) throw new RangeError(`LoRA slot ${slot} is not a slot number`);
    this.loras[slot] = weights ?? undefined;
  }

  /**
   * Causal attention of sequence s's new rows over its context, read block by block from the pool. With a sliding
   * window only the blocks from the first row's window on are read: the engine may have given earlier ones back
   * (their block table entries then name no block of this sequence).
   */
  private attendSequence(layer: number, batch: ForwardBatch, s: number, q: Float32Array, out: Float32Array): void {
    const firstRow = batch.queryStartLoc[s]!;
    const numNew = batch.queryStartLoc[s + 1]! - firstRow;
    if (numNew === 0) return;
    const seqLen = batch.seqLens[s]!;
    const { blockSize, numKvHeads, headDim } = this.kvLayout;
    const window = this.transformer.layerWindows[layer]!;
    const firstNeeded = window > 0 ? Math.max(0, seqLen - numNew + 1 - window) : 0;
    const keys = new Float32Array(seqLen * numKvHeads * headDim);
    const values = new Float32Array(seqLen * numKvHeads * headDim);
    for (let start = firstNeeded - (firstNeeded % blockSize); start < seqLen; start += blockSize) {
      const block = batch.blockTables[s * batch.maxBlocksPerSeq + start / blockSize]!;
      const count = Math.min(blockSize, seqLen - start);
      this.pool.read(layer, 0, block * blockSize, count, keys, start);
      this.pool.read(layer, 1, block * blockSize, count, values, start);
    }
    causalAttention(out, q, firstRow, numNew, seqLen - numNew, keys, values, this.transformer.attentionShape, window);
  }

  dispose(): void {
    this.disposed = true;
  }
}

export const referenceBackend: BackendFactory = {
  name: 'reference',
  // f16 rounds K and V as the native backend's f16 pool does, so the two agree on what auto stores.
  kvDtypes: ['f16', 'f32'],
  available: () => true,
  load(config, weights, kv, _options) {
    return new ReferenceRunnerBackend(config, weights, kv);
  },
};
