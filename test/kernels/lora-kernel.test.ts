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
import { loadNativeAddon, nativeBackend, nativeModelSpec } from '../../src/kernels/native.ts';
import { referenceBackend } from '../../src/kernels/reference-backend.ts';
import { kvPoolBytes, type BackendFactory, type ForwardBatch, type KvPoolLayout, type ModelRunnerBackend } from '../../src/kernels/types.ts';
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

describe('LoRA products inside the base matmuls\' jobs', { skip: skipNative }, () => {
  it('give the bits of the products run in jobs of their own (CONDUIT_LORA_FUSE=0), on 1 and 2 threads', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-lora-fuse-'));
    /** Loads with CONDUIT_LORA_FUSE set as given (the native model reads it when it is made). */
    const withFuse = <T>(fuse: string, make: () => T): T => {
      const previous = process.env.CONDUIT_LORA_FUSE;
      process.env.CONDUIT_LORA_FUSE = fuse;
      try {
        return make();
      } finally {
        if (previous === undefined) delete process.env.CONDUIT_LORA_FUSE;
        else process.env.CONDUIT_LORA_FUSE = previous;
      }
    };
    try {
      // Q8_0 weights quantize the activations (the down-projections then share that job when they are many); F32
      // weights have no quantization job.
      for (const dtype of ['Q8_0', 'F32'] as const) {
        const path = join(dir, `model-${dtype}.gguf`);
        writeSyntheticModel({ name: 'f', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 128,
          dtype, seed: 10, tokenizer: LLAMA_SPM_TOKENIZER_PATH }, path);
        const { config, weights } = await loadModel(path);
        // Rank 64 on two 60-row prompts: 2 x 60 x 64 x 64 x 3 multiply-adds for Q, K and V, past the 2^20 the
        // calling thread takes alone; rank 3 on a few projections; and a row of the base model.
        const adapters = [{ rank: 64, seed: 50 }, { rank: 3, seed: 51, targets: ['wq', 'wv', 'wDown'] as const }].map((spec, i) => {
          const file = join(dir, `${dtype}-${i}.gguf`);
          writeGgufLoraAdapter(file, config, randomLoraAdapter(config, { ...spec, bScale: 1 }));
          return loadLoraAdapter(file, config).weights;
        });
        const random = seeded(7);
        const prompt = (n: number) => Array.from({ length: n }, () => 1 + Math.floor(random() * 31000));
        const batches = [
          prefillBatch([prompt(60), prompt(60), prompt(40), prompt(30)], [0, 0, 1, -1]),
          prefillBatch([prompt(2), prompt(1), prompt(2), prompt(1)], [1, 0, -1, 0]),
        ];
        for (const loraDtype of ['q8', 'f32'] as const) {
          const logits = (fuse: string, threads: number) => withFuse(fuse, () => {
            const backend = nativeBackend.load(config, weights, { numBlocks: 16, blockSize: BLOCK, dtype: 'f32' }, { threads, loraDtype });
            try {
              adapters.forEach((a, slot) => backend.setLora!(slot, a));
              return batches.map((batch) => backend.forward(batch).slice());
            } finally {
              backend.dispose();
            }
          });
          const separate = logits('0', 2);
          for (const threads of [1, 2]) {
            const fused = logits('1', threads);
            for (let b = 0; b < batches.length; b++) {
              assert.deepEqual(fused[b], separate[b], `${dtype} weights, ${loraDtype} adapters, ${threads} thread(s), batch ${b}`);
            }
          }
          const base = withFuse('1', () => {
            const backend = nativeBackend.load(config, weights, { numBlocks: 16, blockSize: BLOCK, dtype: 'f32' }, { threads: 2, loraDtype });
            try {
              return backend.forward({ ...batches[0]!, loraSlots: undefined }).slice();
            } finally {
              backend.dispose();
            }
          });
          assert.notDeepEqual(base.subarray(0, config.vocabSize), separate[0]!.subarray(0, config.vocabSize), 'the adapter changed nothing');
        }
        // The switch takes effect: only CONDUIT_LORA_FUSE=0 has profile sections of LoRA jobs of their own.
        const sections = (fuse: string) => withFuse(fuse, () => {
          const addon = loadNativeAddon();
          const layout: KvPoolLayout = { numLayers: config.numLayers, numBlocks: 16, blockSize: BLOCK, numKvHeads: config.numKvHeads, headDim: config.headDim, dtype: 'f32' };
          const model = new addon.NativeModel(nativeModelSpec(config, weights, { layout, bytes: new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout))) }, variants.at(-1)!, 2));
          try {
            adapters.forEach((a, slot) => model.setLora(slot, a));
            model.setProfiling(true);
            model.forward(batches[1]!);
            return Object.keys(model.takeProfile());
          } finally {
            model.dispose();
          }
        });
        assert.ok(sections('0').includes('lora attn_qkv'), 'CONDUIT_LORA_FUSE=0 ran no LoRA job of its own');
        assert.deepEqual(sections('1').filter((name) => name.startsWith('lora ')), [], 'the fused path ran LoRA jobs of their own');
      }
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

/** Per element of an activation row, the largest change q8's quantization (blocks of 32) may make to it. */
function activationError(x: Float32Array): Float64Array {
  const out = new Float64Array(x.length);
  for (let b = 0; b < x.length; b += 32) {
    let absmax = 0;
    for (let i = b; i < Math.min(x.length, b + 32); i++) absmax = Math.max(absmax, Math.abs(x[i]!));
    for (let i = b; i < Math.min(x.length, b + 32); i++) out[i] = (absmax / 127 / 2) * (1 + 1e-6);
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
            // q8 also quantizes the activations (native/kernels.h kLoraQ8Block): x per block of 32, each element
            // within half a step (block absmax / 127) of its value; then, per block of 32 k, bt_scale[k] * u[k].
            const dx = dtype === 'q8' ? activationError(x.subarray(r * inDim, (r + 1) * inDim)) : new Float64Array(inDim);
            const u = new Float64Array(rank), du = new Float64Array(rank), mag = new Float64Array(rank);
            for (let k = 0; k < rank; k++) {
              for (let i = 0; i < inDim; i++) {
                const xi = x[r * inDim + i]!, aki = Math.abs(a[k * inDim + i]!), dak = da[k * inDim + i]!;
                u[k] = u[k]! + a[k * inDim + i]! * xi;
                du[k] = du[k]! + dak * Math.abs(xi) + (aki + dak) * dx[i]!;
                mag[k] = mag[k]! + (aki + dak) * (Math.abs(xi) + dx[i]!);
              }
            }
            // q8: |Bt_q[k][o]| = |Bt'[k][o]| / bt_scale[k] times half a step of the block of bt_scale[k] * u[k].
            const btScale = Array.from({ length: rank }, (_, k) => {
              let absmax = 0;
              for (let o = 0; o < outDim; o++) absmax = Math.max(absmax, Math.abs(bt[k * outDim + o]!));
              return Math.fround(absmax / 127);
            });
            const df = new Float64Array(rank);
            if (dtype === 'q8') {
              for (let k0 = 0; k0 < rank; k0 += 32) {
                let fmax = 0;
                for (let k = k0; k < Math.min(rank, k0 + 32); k++) fmax = Math.max(fmax, btScale[k]! * (Math.abs(u[k]!) + du[k]!));
                for (let k = k0; k < Math.min(rank, k0 + 32); k++) df[k] = (fmax / 127 / 2) * (1 + 1e-6);
              }
            }
            for (let o = 0; o < outDim; o++) {
              let exact = 0, bound = 0, magnitude = 0;
              for (let k = 0; k < rank; k++) {
                const bko = bt[k * outDim + o]!;
                exact += bko * u[k]!;
                bound += Math.abs(bko) * du[k]! + db[k * outDim + o]! * (Math.abs(u[k]!) + du[k]!);
                if (btScale[k]! > 0) bound += (Math.abs(bko) + db[k * outDim + o]!) / btScale[k]! * df[k]!;
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
