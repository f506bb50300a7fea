// The native batched LoRA kernel (native/lora.cc) against the TypeScript reference (src/model/lora.ts): one forward
// step of three sequences (base, adapter a, adapter b) gives the reference's logits, every row of a mixed batch is
// bit-identical to the same row computed alone (batch invariance), and slots that name no adapter are refused.
// Op level (ops.lora), every variant and storage type over odd shapes: within the storage type's stated error bound
// of the exact product (native/lora.h), rows without an adapter untouched, each row bit-identical alone and batched
// and with one thread or two.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { nativeBackend } from '../../src/kernels/native.ts';
import { referenceBackend } from '../../src/kernels/reference-backend.ts';
import type { BackendFactory, ForwardBatch, ModelRunnerBackend } from '../../src/kernels/types.ts';
import { loadModel } from '../../src/model/loader.ts';
import { loadLoraAdapter } from '../../src/model/lora.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../../src/model/lora-writer.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import type { LoraDtype } from '../../src/model/lora.ts';
import { assertClose, native, randomArray, seeded, skipNative, variants } from './native-harness.ts';

const BLOCK = 16;

/** A prefill step of the given sequences, sequence s in blocks s*4 .. s*4+3, rows tagged with their LoRA slot. */
function prefillBatch(prompts: number[][], slots: number[]): ForwardBatch {
  const numTokens = prompts.reduce((n, p) => n + p.length, 0);
  const tokenIds = new Int32Array(numTokens), positions = new Int32Array(numTokens), slotMapping = new Int32Array(numTokens);
  const loraSlots = new Int32Array(numTokens);
  const queryStartLoc = new Int32Array(prompts.length + 1), seqLens = new Int32Array(prompts.length);
  const blockTables = new Int32Array(prompts.length * 4), logitsIndices = new Int32Array(prompts.length);
  let row = 0;
  prompts.forEach((prompt, s) => {
    for (let b = 0; b < 4; b++) blockTables[s * 4 + b] = s * 4 + b;
    prompt.forEach((token, p) => {
      tokenIds[row] = token; positions[row] = p; slotMapping[row] = (s * 4 + Math.floor(p / BLOCK)) * BLOCK + (p % BLOCK);
      loraSlots[row] = slots[s]!; row++;
    });
    queryStartLoc[s + 1] = row; seqLens[s] = prompt.length; logitsIndices[s] = row - 1;
  });
  return { numTokens, tokenIds, positions, slotMapping, numSeqs: prompts.length, queryStartLoc, seqLens, blockTables,
    maxBlocksPerSeq: 4, logitsIndices, loraSlots };
}

describe('native LoRA kernel', { skip: skipNative }, () => {
  it('matches the reference on a mixed batch and is batch invariant', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-lora-kernel-'));
    try {
      const path = join(dir, 'model.gguf');
      writeSyntheticModel({ name: 'k', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 128,
        dtype: 'F32', seed: 9, tokenizer: LLAMA_SPM_TOKENIZER_PATH }, path);
      const { config, weights } = await loadModel(path);
      const adapters = [0, 1].map((i) => {
        const file = join(dir, `${i}.gguf`);
        writeGgufLoraAdapter(file, config, randomLoraAdapter(config, { rank: 4 + i * 3, seed: 40 + i, bScale: 1 }));
        return loadLoraAdapter(file, config).weights;
      });
      const load = (factory: BackendFactory, threads: number, loraDtype: LoraDtype = 'f32'): ModelRunnerBackend => {
        const backend = factory.load(config, weights, { numBlocks: 16, blockSize: BLOCK, dtype: 'f32' }, { threads, loraDtype });
        adapters.forEach((a, slot) => backend.setLora!(slot, a));
        return backend;
      };
      const prompts = [[1, 450, 4996, 17354, 1701], [1, 9038, 2501, 263, 931, 727, 471], [1, 29871, 13, 450]];
      const slots = [-1, 0, 1];
      const batch = prefillBatch(prompts, slots);
      const native = load(nativeBackend, 2);
      const mixed = native.forward(batch).slice();
      const reference = load(referenceBackend, 1).forward(batch);
      assertClose(mixed, reference, 1e-6, 'native vs reference logits with LoRA');
      // The compact storage types stay near the f32 reference and keep batch invariance.
      for (const [dtype, bound] of [['bf16', 1e-4], ['q8', 1e-3]] as const) {
        const compact = load(nativeBackend, 2, dtype).forward(batch).slice();
        assertClose(compact, reference, bound, `native ${dtype} vs reference logits with LoRA`);
        assert.notDeepEqual(compact, mixed, `${dtype} storage changed nothing`);
        const row = load(nativeBackend, 1, dtype).forward(prefillBatch([prompts[2]!], [slots[2]!]));
        assert.deepEqual(row, compact.subarray(2 * config.vocabSize, 3 * config.vocabSize), `${dtype}: row changed with its neighbours`);
      }
      const vocab = config.vocabSize;
      for (let s = 0; s < prompts.length; s++) {
        const alone = load(nativeBackend, 1).forward(prefillBatch([prompts[s]!], [slots[s]!]));
        assert.deepEqual(alone, mixed.subarray(s * vocab, (s + 1) * vocab), `row of sequence ${s} changed with its neighbours`);
      }
      const base = load(nativeBackend, 1).forward({ ...prefillBatch([prompts[1]!], [-1]), loraSlots: undefined });
      assert.notDeepEqual(base, mixed.subarray(vocab, 2 * vocab), 'the adapter changed nothing');
      assert.throws(() => native.forward(prefillBatch([prompts[0]!], [5])), /loraSlots\[0\] = 5 names no loaded LoRA adapter/);
      native.setLora!(1, null);
      assert.throws(() => native.forward(batch), /names no loaded LoRA adapter/);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

/** Per row of a [rows x cols] matrix, the largest change its storage as `dtype` may make to one element. */
function storageError(m: Float32Array, rows: number, cols: number, dtype: LoraDtype): Float64Array {
  const out = new Float64Array(rows * cols);
  for (let r = 0; r < rows; r++) {
    let absmax = 0;
    for (let c = 0; c < cols; c++) absmax = Math.max(absmax, Math.abs(m[r * cols + c]!));
    for (let c = 0; c < cols; c++) {
      const v = Math.abs(m[r * cols + c]!);
      // q8: half a step of absmax / 127 (the scale itself rounded to f32); bf16: half an ulp of 8 significant bits.
      out[r * cols + c] = dtype === 'q8' ? Math.fround(absmax / 127) / 2 * (1 + 1e-6) : dtype === 'bf16' ? v * 2 ** -8 : 0;
    }
  }
  return out;
}

describe('ops.lora: the batched LoRA kernels over variants, storage types and odd shapes', { skip: skipNative }, () => {
  const shapes = [
    { inDim: 37, outDim: 301, ranks: [3, 1, 8] },   // in below a vector, out past one up-chunk (256) with a tail
    { inDim: 64, outDim: 16, ranks: [16, 5] },
    { inDim: 129, outDim: 257, ranks: [7], rows: 70 },  // 60 rows of one adapter: its down-projection split over items
  ];
  for (const variant of variants) {
    for (const dtype of ['f32', 'bf16', 'q8'] as const) {
      it(`${variant} ${dtype}`, () => {
        const ops = native().ops;
        for (const { inDim, outDim, ranks, rows: manyRows } of shapes) {
          const rand = seeded(inDim * 1000 + outDim);
          const adapters = ranks.map((rank, i) => ({
            rank, a: randomArray(rank * inDim, rand), b: randomArray(outDim * rank, rand, 0.5), scale: 0.75 + i,
          }));
          // Rows: base rows, several rows of one adapter, adapters interleaved.
          const slots = manyRows !== undefined
            ? Int32Array.from({ length: manyRows }, (_, r) => (r % 7 === 3 ? -1 : 0))
            : Int32Array.from([0, -1, 1 % ranks.length, 0, ranks.length - 1, -1, 0, 2 % ranks.length, 1 % ranks.length]);
          const rows = slots.length;
          const x = randomArray(rows * inDim, rand);
          const y0 = randomArray(rows * outDim, rand);
          const run = (s: Int32Array, xs: Float32Array, ys: Float32Array, threads: number) => {
            const y = ys.slice();
            ops.lora(variant, dtype, adapters, inDim, outDim, xs, s, y, threads);
            return y;
          };
          const y = run(slots, x, y0, 2);
          assert.deepEqual(run(slots, x, y0, 1), y, 'one thread and two differ');
          for (let r = 0; r < rows; r++) {
            const row = (m: Float32Array, n: number) => m.slice(r * n, (r + 1) * n);
            const alone = run(Int32Array.of(slots[r]!), row(x, inDim), row(y0, outDim), 1);
            assert.deepEqual(alone, row(y, outDim), `row ${r} changed with its neighbours`);
            const slot = slots[r]!;
            if (slot < 0) {
              assert.deepEqual(row(y, outDim), row(y0, outDim), `row ${r} has no adapter but changed`);
              continue;
            }
            // Exact product in f64 and the bound of native/lora.h for the storage type, plus f32 rounding.
            const { rank, a, b, scale } = adapters[slot]!;
            const bt = new Float32Array(rank * outDim);
            for (let o = 0; o < outDim; o++) for (let k = 0; k < rank; k++) bt[k * outDim + o] = b[o * rank + k]!;
            const da = storageError(a, rank, inDim, dtype);
            const db = storageError(bt, rank, outDim, dtype);
            const u = new Float64Array(rank), du = new Float64Array(rank), mag = new Float64Array(rank);
            for (let k = 0; k < rank; k++) {
              for (let i = 0; i < inDim; i++) {
                const xi = x[r * inDim + i]!;
                u[k] = u[k]! + a[k * inDim + i]! * xi;
                du[k] = du[k]! + da[k * inDim + i]! * Math.abs(xi);
                mag[k] = mag[k]! + (Math.abs(a[k * inDim + i]!) + da[k * inDim + i]!) * Math.abs(xi);
              }
            }
            for (let o = 0; o < outDim; o++) {
              let exact = 0, bound = 0, magnitude = 0;
              for (let k = 0; k < rank; k++) {
                const bko = bt[k * outDim + o]!;
                exact += bko * u[k]!;
                bound += Math.abs(bko) * du[k]! + db[k * outDim + o]! * (Math.abs(u[k]!) + du[k]!);
                magnitude += (Math.abs(bko) + db[k * outDim + o]!) * mag[k]!;
              }
              const expected = y0[r * outDim + o]! + scale * exact;
              const rounding = (inDim + rank + 4) * 2 ** -23 * Math.abs(scale) * magnitude + 2 ** -23 * Math.abs(expected);
              const limit = Math.abs(scale) * bound + rounding;
              const actual = y[r * outDim + o]!;
              assert.ok(Math.abs(actual - expected) <= limit,
                `${inDim}x${outDim} rank ${rank}, row ${r} output ${o}: ${actual} vs exact ${expected}, error ${Math.abs(actual - expected).toExponential(2)} > bound ${limit.toExponential(2)}`);
            }
          }
        }
      });
    }
  }
});
