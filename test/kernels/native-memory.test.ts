// What a backend reports about its memory (the worker's conduit_memory_used_bytes gauge), checked against sizes computed
// here from the file and the config alone; and a native allocation failure (made to happen by the test-only scratch
// limit) surfacing as an Error with a code, the model still usable afterwards.
import assert from 'node:assert/strict';
import { before, describe, it } from 'node:test';
import { NATIVE_ALLOCATION_FAILED, nativeBackend, nativeModelSpec, resolveKernelVariant } from '../../src/kernels/native.ts';
import { referenceBackend } from '../../src/kernels/reference-backend.ts';
import type { ForwardBatch, KvPoolLayout } from '../../src/kernels/types.ts';
import { byteSize } from '../../src/model/ggml-types.ts';
import type { LoraWeights } from '../../src/model/lora.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { tinySyntheticModel } from '../helpers/cpu-model.ts';
import { native, skipNative } from './native-harness.ts';

const elements = (shape: readonly number[]) => shape.reduce((a, b) => a * b, 1);

/** The tensors' bytes as the file lays them out: its tensor table, each tensor's type and shape. */
function fileTensorBytes(path: string): number {
  return readGguf(path).tensorInfos.reduce((sum, t) => sum + byteSize(t.type, elements(t.shape)), 0);
}

/** K and V of every layer for every slot of the pool. */
function poolBytes(model: LoadedModel, numBlocks: number, blockSize: number, dtypeBytes: number): number {
  const { numLayers, numKvHeads, headDim } = model.config;
  return 2 * numLayers * numBlocks * blockSize * numKvHeads * headDim * dtypeBytes;
}

/** The per-row layer activations the native model keeps (native/model.h): x, xn, tmp, q, attn, k, v, gate, up. */
function activationBytesPerRow(model: LoadedModel): number {
  const { dim, numHeads, numKvHeads, headDim, ffnDim } = model.config;
  return 4 * (3 * dim + 2 * numHeads * headDim + 2 * numKvHeads * headDim + 2 * ffnDim);
}

/** One sequence prefilling `rows` tokens from position 0 into blocks 0, 1, ... (slot i = position i). */
function prefillBatch(rows: number, maxBlocks: number): ForwardBatch {
  const blockTables = new Int32Array(maxBlocks);
  for (let i = 0; i < maxBlocks; i++) blockTables[i] = i;
  return {
    numTokens: rows, tokenIds: Int32Array.from({ length: rows }, (_, i) => 1 + (i % 50)),
    positions: Int32Array.from({ length: rows }, (_, i) => i), slotMapping: Int32Array.from({ length: rows }, (_, i) => i),
    numSeqs: 1, queryStartLoc: Int32Array.from([0, rows]), seqLens: Int32Array.from([rows]), blockTables,
    maxBlocksPerSeq: maxBlocks, logitsIndices: Int32Array.from([rows - 1]),
  };
}

/** A rank-4 adapter of the first layer's Q and down projections, random values. */
function loraAdapter(model: LoadedModel): { weights: LoraWeights; bytes: number } {
  const { dim, numHeads, headDim, ffnDim } = model.config;
  const rank = 4;
  const matrix = (inDim: number, outDim: number) => ({
    rank, a: Float32Array.from({ length: rank * inDim }, (_, i) => Math.sin(i) / 8), b: Float32Array.from({ length: outDim * rank }, (_, i) => Math.cos(i) / 8),
  });
  const weights: LoraWeights = { scale: 2, layers: [{ wq: matrix(dim, numHeads * headDim), wDown: matrix(ffnDim, dim) }] };
  return { weights, bytes: 4 * rank * (dim + numHeads * headDim + ffnDim + dim) };
}

describe('backend memory by category', () => {
  let model: LoadedModel;
  let path: string;
  before(async () => {
    path = tinySyntheticModel();
    model = await loadModel(path);
  });

  it('reference backend: weights are its f32 copies (every parameter, 4 bytes), KV the pool', () => {
    const params = readGguf(path).tensorInfos.reduce((sum, t) => sum + elements(t.shape), 0);
    // A tied output matrix is the embedding's array (one copy); the synthetic model stores both only when untied.
    const runner = referenceBackend.load(model.config, model.weights, { numBlocks: 7, blockSize: 16, dtype: 'f32' });
    const memory = runner.memory!();
    assert.equal(memory.weightsBytes, 4 * params);
    assert.equal(memory.kvCacheBytes, poolBytes(model, 7, 16, 4));
    assert.equal(memory.scratchBytes, undefined, 'it keeps no buffers between steps');
  });

  it('LoRA adapters: their own category, from loading to unloading (reference: as given; native: its packed copies)', { skip: skipNative }, () => {
    const { weights, bytes } = loraAdapter(model);
    const reference = referenceBackend.load(model.config, model.weights, { numBlocks: 4, blockSize: 16, dtype: 'f32' });
    assert.equal(reference.memory!().loraAdaptersBytes, 0);
    reference.setLora!(0, weights);
    assert.equal(reference.memory!().loraAdaptersBytes, bytes);
    reference.setLora!(0, null);
    assert.equal(reference.memory!().loraAdaptersBytes, 0);
    for (const [loraDtype, elementBytes] of [['f32', 4], ['bf16', 2], ['q8', 1]] as const) {
      const runner = nativeBackend.load(model.config, model.weights, { numBlocks: 4, blockSize: 16, dtype: 'f32' }, { threads: 1, packWeights: false, loraDtype });
      try {
        const before = runner.memory!();
        assert.equal(before.loraAdaptersBytes, 0);
        runner.setLora!(0, weights);
        runner.setLora!(3, weights);
        const held = runner.memory!().loraAdaptersBytes!;
        // Two copies, each its matrices in the adapter dtype (B's columns padded to whole blocks) plus a scale per row.
        const elements = 2 * (bytes / 4);
        assert.ok(held >= elements * elementBytes && held <= 2 * elements * elementBytes + 64 * 1024, `${loraDtype}: ${held} bytes for ${elements} elements`);
        assert.equal(runner.memory!().weightsBytes, before.weightsBytes, 'adapters are not weights');
        runner.setLora!(3, null);
        assert.equal(runner.memory!().loraAdaptersBytes, held / 2, `${loraDtype}: one adapter unloaded`);
        runner.setLora!(0, null);
        assert.equal(runner.memory!().loraAdaptersBytes, 0);
      } finally {
        runner.dispose();
      }
    }
  });

  it('native backend: weights are the file\'s tensor bytes (not packed), KV the pool (f32 and f16)', { skip: skipNative }, () => {
    for (const [dtype, bytes] of [['f32', 4], ['f16', 2]] as const) {
      const runner = nativeBackend.load(model.config, model.weights, { numBlocks: 5, blockSize: 16, dtype }, { threads: 1, packWeights: false });
      try {
        const memory = runner.memory!();
        assert.equal(memory.weightsBytes, fileTensorBytes(path));
        assert.equal(memory.kvCacheBytes, poolBytes(model, 5, 16, bytes));
        assert.equal(memory.scratchBytes, 0, 'nothing allocated before the first step');
      } finally {
        runner.dispose();
      }
    }
  });

  it('native backend with packed weights: the packed copy is counted on top of the file\'s bytes', { skip: skipNative }, () => {
    const runner = nativeBackend.load(model.config, model.weights, { numBlocks: 5, blockSize: 16, dtype: 'f32' }, { threads: 1, packWeights: true });
    try {
      const extra = runner.memory!().weightsBytes - fileTensorBytes(path);
      // Packing copies the matrices whose kernel has a load-time layout (none on avx2) into one allocation of whole
      // 2 MiB pages: at most every tensor again, rounded up to the page (and the matrices' own alignment).
      const page = 2 * 1024 * 1024;
      assert.ok(extra >= 0 && extra % page === 0 && extra <= Math.ceil(fileTensorBytes(path) / page) * page + page, `${extra} bytes beyond the file's tensors`);
    } finally {
      runner.dispose();
    }
  });

  it('native scratch: the layer activations of the largest step, kept for smaller ones, grown for larger ones', { skip: skipNative }, () => {
    const addon = native();
    const layout: KvPoolLayout = { numLayers: model.config.numLayers, numBlocks: 8, blockSize: 16, numKvHeads: model.config.numKvHeads, headDim: model.config.headDim, dtype: 'f32' };
    const pool = new Uint8Array(poolBytes(model, 8, 16, 4));
    const m = new addon.NativeModel({
      ...nativeModelSpec(model.config, model.weights, { layout, bytes: pool }, resolveKernelVariant(undefined, addon.cpuInfo()), 1), packWeights: false,
    });
    try {
      assert.deepEqual(m.memoryInfo(), { activationBytes: 0, workspaceBytes: 0, loraBytes: 0 });
      m.forward(prefillBatch(40, 8));
      const after40 = m.memoryInfo();
      assert.equal(after40.activationBytes, 40 * activationBytesPerRow(model));
      assert.ok(after40.workspaceBytes > 0, 'matmul inputs, kernel scratch and RoPE tables were allocated');
      m.forward(prefillBatch(8, 8));
      assert.deepEqual(m.memoryInfo(), after40, 'a smaller step reuses the buffers');
      m.forward(prefillBatch(100, 8));
      assert.ok(m.memoryInfo().activationBytes >= 100 * activationBytesPerRow(model));
    } finally {
      m.dispose();
    }
  });

  it('a scratch allocation that fails is an Error with a code, and the model still runs steps it has room for', { skip: skipNative }, () => {
    const addon = native();
    const layout: KvPoolLayout = { numLayers: model.config.numLayers, numBlocks: 8, blockSize: 16, numKvHeads: model.config.numKvHeads, headDim: model.config.headDim, dtype: 'f32' };
    const pool = new Uint8Array(poolBytes(model, 8, 16, 4));
    // Room for the activations of four rows and nothing more.
    const m = new addon.NativeModel({
      ...nativeModelSpec(model.config, model.weights, { layout, bytes: pool }, resolveKernelVariant(undefined, addon.cpuInfo()), 1),
      packWeights: false, scratchLimitBytes: 4 * activationBytesPerRow(model),
    });
    try {
      const small = m.forward(prefillBatch(4, 8)).slice();
      assert.throws(() => m.forward(prefillBatch(64, 8)), (error: Error & { code?: string }) => {
        assert.equal(error.code, NATIVE_ALLOCATION_FAILED);
        assert.match(error.message, /out of memory .* 64 rows/);
        return true;
      });
      assert.equal(m.memoryInfo().activationBytes, 4 * activationBytesPerRow(model), 'the failed growth left the buffers as they were');
      assert.deepEqual(m.forward(prefillBatch(4, 8)), small, 'the same step again gives the same logits');
    } finally {
      m.dispose();
    }
  });
});
