// Paged attention and the KV store: K/V written through a slot mapping into shuffled pool blocks must give the
// attention a plain causal computation over contiguous K/V gives, for prefill chunks over a cached prefix and for
// batched decode of sequences of different lengths, in every variant, f32 and f16 KV, with GQA.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import { f32ToF16Bits, f16Round } from '../../src/model/quant.ts';
import type { KernelVariant } from '../../src/kernels/native.ts';
import { kvPoolBytes, type KvDtype, type KvPoolLayout } from '../../src/kernels/types.ts';
import { assertClose, guarded, native, randomArray, seeded, skipNative, variants } from './native-harness.ts';

interface Sequence {
  seqLen: number;
  newTokens: number;
}

interface Scenario {
  layout: KvPoolLayout;
  numHeads: number;
  seqs: Sequence[];
  /** Per sequence, K and V of every position: [seqLen x numKvHeads*headDim]. */
  keys: Float32Array[];
  values: Float32Array[];
  q: Float32Array;
  queryStartLoc: Int32Array;
  seqLens: Int32Array;
  maxBlocksPerSeq: number;
  /** Sliding window (0: none). */
  window: number;
}

function makeScenario(seed: number, dtype: KvDtype, seqs: Sequence[], blockSize: number, numHeads: number,
  numKvHeads: number, headDim: number, qScale = 1, window = 0): Scenario {
  const rand = seeded(seed);
  const width = numKvHeads * headDim;
  const maxBlocksPerSeq = Math.max(...seqs.map((s) => Math.ceil(s.seqLen / blockSize)));
  const layout: KvPoolLayout = {
    numLayers: 2, numBlocks: seqs.reduce((n, s) => n + Math.ceil(s.seqLen / blockSize), 0) + 3, blockSize,
    numKvHeads, headDim, dtype,
  };
  const keys = seqs.map((s) => randomArray(s.seqLen * width, rand));
  const values = seqs.map((s) => randomArray(s.seqLen * width, rand));
  const queryStartLoc = new Int32Array(seqs.length + 1);
  seqs.forEach((s, i) => { queryStartLoc[i + 1] = queryStartLoc[i]! + s.newTokens; });
  const q = randomArray(queryStartLoc[seqs.length]! * numHeads * headDim, rand, qScale);
  return {
    layout, numHeads, seqs, keys, values, q, queryStartLoc, maxBlocksPerSeq, window,
    seqLens: Int32Array.from(seqs, (s) => s.seqLen),
  };
}

/** Block tables: `order` lists pool blocks in the order they are handed out. */
function blockTables(sc: Scenario, order: number[]): Int32Array {
  const tables = new Int32Array(sc.seqs.length * sc.maxBlocksPerSeq).fill(-1);
  let next = 0;
  sc.seqs.forEach((s, i) => {
    for (let b = 0; b < Math.ceil(s.seqLen / sc.layout.blockSize); b++) tables[i * sc.maxBlocksPerSeq + b] = order[next++]!;
  });
  return tables;
}

/** Writes every position of every sequence into layer 1 of a new pool through the block tables. */
function fillPool(sc: Scenario, tables: Int32Array, variant: KernelVariant): Uint8Array {
  const pool = new Uint8Array(new SharedArrayBuffer(kvPoolBytes(sc.layout)));
  sc.seqs.forEach((s, i) => {
    const slots = Int32Array.from({ length: s.seqLen }, (_, t) =>
      tables[i * sc.maxBlocksPerSeq + Math.floor(t / sc.layout.blockSize)]! * sc.layout.blockSize + (t % sc.layout.blockSize));
    native().ops.kvWrite(variant, sc.keys[i]!, sc.values[i]!, slots, pool, sc.layout, 1);
  });
  return pool;
}

/** Causal attention (within the window, if any) over contiguous K/V, in double; f16 pools see K/V rounded to f16. */
function referenceAttention(sc: Scenario): Float64Array {
  const { headDim, numKvHeads, dtype } = sc.layout;
  const group = sc.numHeads / numKvHeads;
  const width = sc.numHeads * headDim;
  const round = dtype === 'f16' ? f16Round : (v: number) => v;
  const out = new Float64Array(sc.q.length);
  sc.seqs.forEach((s, i) => {
    const k = sc.keys[i]!.map(round);
    const v = sc.values[i]!.map(round);
    for (let r = 0; r < s.newTokens; r++) {
      const token = sc.queryStartLoc[i]! + r;
      const context = s.seqLen - s.newTokens + r + 1;
      const first = sc.window > 0 ? Math.max(0, context - sc.window) : 0;
      for (let h = 0; h < sc.numHeads; h++) {
        const g = Math.floor(h / group);
        const scores = new Float64Array(context).fill(-Infinity);
        for (let t = first; t < context; t++) {
          let dot = 0;
          for (let d = 0; d < headDim; d++) dot += sc.q[token * width + h * headDim + d]! * k[(t * numKvHeads + g) * headDim + d]!;
          scores[t] = dot / Math.sqrt(headDim);
        }
        const max = Math.max(...scores);
        let sum = 0;
        for (let t = first; t < context; t++) sum += (scores[t] = Math.exp(scores[t]! - max));
        for (let t = first; t < context; t++) {
          for (let d = 0; d < headDim; d++) {
            out[token * width + h * headDim + d]! += (scores[t]! / sum) * v[(t * numKvHeads + g) * headDim + d]!;
          }
        }
      }
    }
  });
  return out;
}

function runAttention(sc: Scenario, pool: Uint8Array, tables: Int32Array, variant: KernelVariant, threads: number) {
  const out = guarded(sc.q.length, NaN);
  native().ops.attention(variant, sc.q, out.view, pool, sc.layout, 1, sc.queryStartLoc, sc.seqLens,
    tables, sc.maxBlocksPerSeq, sc.numHeads, threads, sc.window);
  out.checkGuards(`attention ${variant}`);
  return out.view;
}

function shuffled(n: number, rand: () => number): number[] {
  const a = Array.from({ length: n }, (_, i) => i);
  for (let i = n - 1; i > 0; i--) {
    const j = Math.floor(rand() * (i + 1));
    [a[i], a[j]] = [a[j]!, a[i]!];
  }
  return a;
}

// Contexts past 128 positions span several of the SIMD kernels' split-K chunks (kAttentionChunk in
// native/kernels.h); a larger query scale spreads the scores, so chunks with different maxima must be rescaled
// correctly when folded.
const SCENARIOS: {
  name: string; seqs: Sequence[]; blockSize: number; heads: number; kvHeads: number; headDim: number; qScale?: number;
  window?: number;
}[] = [
  { name: 'prefill from empty', seqs: [{ seqLen: 37, newTokens: 37 }], blockSize: 16, heads: 4, kvHeads: 2, headDim: 64 },
  { name: 'prefill chunk over a cached prefix', seqs: [{ seqLen: 50, newTokens: 13 }], blockSize: 8, heads: 6, kvHeads: 2, headDim: 32 },
  {
    name: 'batched decode of different lengths',
    seqs: [{ seqLen: 1, newTokens: 1 }, { seqLen: 16, newTokens: 1 }, { seqLen: 33, newTokens: 1 }, { seqLen: 70, newTokens: 1 }],
    blockSize: 16, heads: 8, kvHeads: 4, headDim: 8,
  },
  {
    name: 'mixed prefill and decode, odd head size',
    seqs: [{ seqLen: 9, newTokens: 1 }, { seqLen: 21, newTokens: 21 }, { seqLen: 5, newTokens: 2 }],
    blockSize: 4, heads: 3, kvHeads: 1, headDim: 20,
  },
  {
    name: 'prefill chunk across context chunks over a long cached prefix', seqs: [{ seqLen: 300, newTokens: 50 }],
    blockSize: 16, heads: 6, kvHeads: 2, headDim: 64, qScale: 3,
  },
  {
    name: 'decode of a few long sequences (split over threads by chunk)',
    seqs: [{ seqLen: 128, newTokens: 1 }, { seqLen: 129, newTokens: 1 }, { seqLen: 257, newTokens: 1 }, { seqLen: 400, newTokens: 2 }],
    blockSize: 16, heads: 4, kvHeads: 2, headDim: 32, qScale: 3,
  },
  {
    name: 'long decode and prefill, blocks not dividing the chunk, odd head size',
    seqs: [{ seqLen: 200, newTokens: 1 }, { seqLen: 150, newTokens: 30 }],
    blockSize: 12, heads: 3, kvHeads: 1, headDim: 20, qScale: 3,
  },
  {
    // Windows starting inside a chunk, spanning a chunk boundary, and a prefill chunk whose rows start in different
    // chunks; the lone long decode rows are split over threads from their window's first chunk.
    name: 'sliding window (prefill over a cached prefix and decode, across chunks)',
    seqs: [{ seqLen: 300, newTokens: 40 }, { seqLen: 260, newTokens: 1 }, { seqLen: 20, newTokens: 20 }],
    blockSize: 16, heads: 4, kvHeads: 2, headDim: 32, qScale: 3, window: 100,
  },
  {
    name: 'sliding window of a few positions, decode split over threads',
    seqs: [{ seqLen: 400, newTokens: 1 }, { seqLen: 131, newTokens: 2 }],
    blockSize: 8, heads: 6, kvHeads: 2, headDim: 20, qScale: 3, window: 7,
  },
];

describe('native paged attention', { skip: skipNative }, () => {
  for (const dtype of ['f32', 'f16'] as const) {
    for (const s of SCENARIOS) {
      it(`${s.name} (${dtype} KV)`, () => {
        const sc = makeScenario(s.seqs.length * 31 + s.headDim, dtype, s.seqs, s.blockSize, s.heads, s.kvHeads, s.headDim,
          s.qScale, s.window);
        const rand = seeded(5);
        const used = sc.seqs.reduce((n, q) => n + Math.ceil(q.seqLen / s.blockSize), 0);
        const inOrder = blockTables(sc, Array.from({ length: used }, (_, i) => i));
        const scattered = blockTables(sc, shuffled(sc.layout.numBlocks, rand));
        const expected = referenceAttention(sc);
        for (const variant of variants) {
          const contiguousPool = fillPool(sc, inOrder, variant);
          const scatteredPool = fillPool(sc, scattered, variant);
          const contiguous = runAttention(sc, contiguousPool, inOrder, variant, 1);
          const paged = runAttention(sc, scatteredPool, scattered, variant, 2);
          assert.deepEqual(paged, contiguous, `${variant}: scattered blocks differ from contiguous ones`);
          assertClose(paged, expected, 1e-10, `${variant} vs TypeScript`);
          if (sc.window > 0) {
            // Blocks before every row's window are not read: the engine gives them back, and their table entries
            // then name a block another sequence may be writing (here: the pool's spare blocks, filled with NaN).
            const freed = scattered.slice();
            const spare = Array.from({ length: sc.layout.numBlocks }, (_, id) => id).find((id) => !scattered.includes(id))!;
            sc.seqs.forEach((q, i) => {
              const firstNeeded = Math.max(0, q.seqLen - q.newTokens + 1 - sc.window);
              for (let b = 0; b < Math.floor(firstNeeded / s.blockSize); b++) freed[i * sc.maxBlocksPerSeq + b] = spare;
            });
            const nanPool = scatteredPool.slice();
            const layerBytes = kvPoolBytes(sc.layout) / (2 * sc.layout.numLayers);
            const blockBytes = layerBytes / sc.layout.numBlocks;
            for (const kv of [2, 3]) {
              const at = kv * layerBytes + spare * blockBytes;
              if (dtype === 'f32') new Float32Array(nanPool.buffer, at, blockBytes / 4).fill(NaN);
              else new Uint16Array(nanPool.buffer, at, blockBytes / 2).fill(0x7e00);
            }
            assert.ok(freed.some((id, i) => id !== scattered[i]), 'the scenario frees blocks');
            assert.deepEqual(runAttention(sc, nanPool, freed, variant, 2), paged, `${variant}: read a block before the window`);
          }
        }
      });
    }
  }

  it('a row gives the same bits whether it is prefilled in a chunk, decoded alone or batched with others', () => {
    for (const dtype of ['f32', 'f16'] as const) {
      const sc = makeScenario(77, dtype, [{ seqLen: 40, newTokens: 40 }, { seqLen: 23, newTokens: 23 }], 8, 6, 2, 64);
      const used = sc.seqs.reduce((n, q) => n + Math.ceil(q.seqLen / 8), 0);
      const tables = blockTables(sc, Array.from({ length: used }, (_, i) => i));
      const width = sc.numHeads * sc.layout.headDim;
      for (const variant of variants) {
        const pool = fillPool(sc, tables, variant);
        const whole = runAttention(sc, pool, tables, variant, 2);
        // Sequence 0's rows recomputed as decode steps (one row, context = its position + 1), one at a time.
        for (const row of [0, 7, 16, 39]) {
          const q = sc.q.slice(row * width, (row + 1) * width);
          const out = new Float32Array(width);
          native().ops.attention(variant, q, out, pool, sc.layout, 1, Int32Array.of(0, 1), Int32Array.of(row + 1),
            tables.subarray(0, sc.maxBlocksPerSeq), sc.maxBlocksPerSeq, sc.numHeads, 1);
          assert.deepEqual(out, whole.slice(row * width, (row + 1) * width), `${variant} ${dtype} row ${row}`);
        }
      }
    }
  });

  it('a long row gives the same bits prefilled, decoded alone on 1 or 2 threads, or batched with other sequences', () => {
    // Past one split-K chunk, a lone decode row on 2 threads has its chunks computed on both threads and merged,
    // on 1 thread or in a prefill chunk one unit folds them, in a busy batch one unit per sequence does.
    for (const dtype of ['f32', 'f16'] as const) {
      const sc = makeScenario(91, dtype, [{ seqLen: 300, newTokens: 300 }, { seqLen: 70, newTokens: 70 }], 16, 6, 2, 64, 3);
      const used = sc.seqs.reduce((n, q) => n + Math.ceil(q.seqLen / 16), 0);
      const tables = blockTables(sc, Array.from({ length: used }, (_, i) => i));
      const width = sc.numHeads * sc.layout.headDim;
      const mbs = sc.maxBlocksPerSeq;
      for (const variant of variants) {
        const pool = fillPool(sc, tables, variant);
        const whole = runAttention(sc, pool, tables, variant, 2);
        for (const row of [0, 127, 128, 129, 255, 256, 299]) {
          const expected = whole.slice(row * width, (row + 1) * width);
          const q = sc.q.slice(row * width, (row + 1) * width);
          for (const threads of [1, 2]) {
            const out = new Float32Array(width);
            native().ops.attention(variant, q, out, pool, sc.layout, 1, Int32Array.of(0, 1), Int32Array.of(row + 1),
              tables.subarray(0, mbs), mbs, sc.numHeads, threads);
            assert.deepEqual(out, expected, `${variant} ${dtype} row ${row} alone on ${threads} threads`);
          }
          // Batched with eight decode rows of sequence 1 (as separate sequences sharing its blocks): enough
          // sequences that no row is split.
          const others = 8;
          const batchQ = new Float32Array((others + 1) * width);
          batchQ.set(q, others * width);
          const batchTables = new Int32Array((others + 1) * mbs);
          const seqLens = new Int32Array(others + 1);
          for (let i = 0; i < others; i++) {
            batchQ.set(sc.q.slice((300 + 60 + i) * width, (301 + 60 + i) * width), i * width);
            batchTables.set(tables.subarray(mbs, 2 * mbs), i * mbs);
            seqLens[i] = 61 + i;
          }
          batchTables.set(tables.subarray(0, mbs), others * mbs);
          seqLens[others] = row + 1;
          const out = new Float32Array(batchQ.length);
          native().ops.attention(variant, batchQ, out, pool, sc.layout, 1,
            Int32Array.from({ length: others + 2 }, (_, i) => i), seqLens, batchTables, mbs, sc.numHeads, 2);
          assert.deepEqual(out.slice(others * width), expected, `${variant} ${dtype} row ${row} batched`);
          for (let i = 0; i < others; i++) {
            const r = 300 + 60 + i;
            assert.deepEqual(out.slice(i * width, (i + 1) * width), whole.slice(r * width, (r + 1) * width),
              `${variant} ${dtype} batched row ${i}`);
          }
        }
      }
    }
  });

  it('the KV store writes exactly the slots of one layer (f16 rounded to nearest even)', () => {
    const layout: KvPoolLayout = { numLayers: 3, numBlocks: 4, blockSize: 2, numKvHeads: 2, headDim: 3, dtype: 'f16' };
    const rand = seeded(3);
    const k = randomArray(3 * 6, rand, 70000); // beyond the f16 range too: overflow must give infinity
    const v = randomArray(3 * 6, rand);
    // Exact ties between two halves round to the even one; the largest half, the overflow threshold, subnormals.
    const ulp = 2 ** -10;
    k.set([1 + ulp / 2, 1 + 1.5 * ulp, -(1 + ulp / 2), 65504, 65519, 65520]);
    v.set([2 ** -25, 3 * 2 ** -25, 2 ** -24, -0, 6.097555e-5, Infinity]);
    const slots = Int32Array.from([5, 0, 6]);
    for (const variant of variants) {
      const pool = new Uint8Array(kvPoolBytes(layout));
      native().ops.kvWrite(variant, k, v, slots, pool, layout, 1);
      const halves = new Uint16Array(pool.buffer);
      const region = layout.numBlocks * layout.blockSize * 6; // elements per K or V region
      const expected = new Uint16Array(halves.length);
      slots.forEach((slot, r) => {
        for (let e = 0; e < 6; e++) {
          expected[2 * region + slot * 6 + e] = f32ToF16Bits(k[r * 6 + e]!);
          expected[3 * region + slot * 6 + e] = f32ToF16Bits(v[r * 6 + e]!);
        }
      });
      assert.deepEqual(halves, expected, `${variant}`);
    }
  });
});
