// Backend-ops harness: every kernel x every variant this CPU runs x random and odd shapes, checked against the
// plain C++ `generic` variant and against an independent TypeScript computation here (weights decoded by
// src/model/quant.ts), by normalised error, with guard values around every output.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import { GgmlType, ggmlTypeName } from '../../src/model/ggml-types.ts';
import { dequantize, quantize } from '../../src/model/quant.ts';
import { geluTanh } from '../../src/model/reference-math.ts';
import {
  argmax, createRequestSamplers, DRAW_SPEC_WORDS, MASS_BINS, Sampler, scaleRow, weighCandidates, type ScaleRow, type WeighCandidates,
} from '../../src/engine/sampler.ts';
import { DEFAULT_SAMPLING } from '../../src/engine/types.ts';
import type { KernelVariant, RopeScalingArg } from '../../src/kernels/native.ts';
import {
  assertClose, bf16ActivationBound, combinedBound, guarded, native, randomArray, referenceMatmul, roundsBf16Activations,
  seeded, skipNative, variants,
} from './native-harness.ts';

// ---------------------------------------------------------------------------------------------------------------
// Independent TypeScript computations (double accumulation)


function referenceRope(x: Float32Array, positions: Int32Array, numHeads: number, headDim: number, ropeDim: number,
  neox: boolean, theta: number, scaling?: RopeScalingArg): Float64Array {
  const out = Float64Array.from(x);
  const half = ropeDim / 2;
  const invFreq = Array.from({ length: half }, (_, i) => {
    const freq = theta ** (-(2 * i) / ropeDim);
    if (!scaling) return freq;
    if (scaling.type === 'linear') return freq / scaling.factor!;
    if (scaling.type === 'longrope') return freq / scaling.factors![i]!;
    // Llama 3.1 (Hugging Face `_compute_llama3_parameters`).
    const lowWavelen = scaling.originalContextLength! / scaling.lowFreqFactor!;
    const highWavelen = scaling.originalContextLength! / scaling.highFreqFactor!;
    const wavelen = (2 * Math.PI) / freq;
    if (wavelen < highWavelen) return freq;
    if (wavelen > lowWavelen) return freq / scaling.factor!;
    const smooth = (scaling.originalContextLength! / wavelen - scaling.lowFreqFactor!) /
      (scaling.highFreqFactor! - scaling.lowFreqFactor!);
    return ((1 - smooth) * freq) / scaling.factor! + smooth * freq;
  });
  // LongRoPE scales the rotated dimensions (cos and sin).
  const mscale = scaling?.type === 'longrope' ? scaling.attentionFactor! : 1;
  for (let r = 0; r < positions.length; r++) {
    for (let h = 0; h < numHeads; h++) {
      const base = (r * numHeads + h) * headDim;
      for (let i = 0; i < half; i++) {
        const angle = positions[r]! * invFreq[i]!;
        const [a, b] = neox ? [i, i + half] : [2 * i, 2 * i + 1];
        const x0 = x[base + a]!, x1 = x[base + b]!;
        out[base + a] = (x0 * Math.cos(angle) - x1 * Math.sin(angle)) * mscale;
        out[base + b] = (x0 * Math.sin(angle) + x1 * Math.cos(angle)) * mscale;
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// matmul

const FLOAT_TYPES = [GgmlType.F32, GgmlType.F16, GgmlType.BF16];
const INT8_TYPES = [GgmlType.Q8_0, GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0, GgmlType.Q5_1];
const K_QUANT_TYPES = [GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K];

// [m, k, n]: single rows (decode GEMV), a few rows, many rows (prefill GEMM); n not a multiple of any tile width.
const SHAPES: Record<string, [number, number, number][]> = {
  float: [[1, 7, 1], [1, 33, 65], [3, 4097, 5], [7, 64, 33], [17, 96, 130], [65, 48, 97]],
  int8: [[1, 32, 1], [1, 64, 33], [2, 4096, 7], [5, 96, 65], [16, 128, 130], [67, 256, 97]],
  kquant: [[1, 256, 1], [4, 512, 33], [33, 256, 70]],
};

function shapesFor(type: GgmlType): [number, number, number][] {
  if (FLOAT_TYPES.includes(type)) return SHAPES.float!;
  if (INT8_TYPES.includes(type)) return SHAPES.int8!;
  return SHAPES.kquant!;
}

// Against the exact product of the decoded weights: float kernels only reorder sums; the 8-bit kernels also
// round the activations to 8 bits per block of 32 (relative error ~1/254 per element); BF16 on VDPBF16PS rounds
// them to bf16, whose bound depends on the values (bf16ActivationBound in the harness).
function referenceBound(type: GgmlType): number {
  return INT8_TYPES.includes(type) ? 5e-4 : 1e-9;
}

/** Whether `variant` multiplies K-quant `type` weights with 8-bit activations (kernels avx2_int8, avx512_vnni). */
function kQuantIntDot(variant: KernelVariant, type: GgmlType): boolean {
  return ['avx2_int8', 'avx512_vnni'].includes(native().kernelVariants(variant)[`matmul_${ggmlTypeName(type).toLowerCase()}`] ?? '');
}

/** referenceBound for `variant`, given the case's decoded weights, activations and exact product. */
function variantBound(type: GgmlType, variant: KernelVariant, x: Float32Array, w: Float32Array, m: number, k: number,
  n: number, exact: ArrayLike<number>): number {
  // K-quants on 8-bit activations, one scale per 256: native-kquant.test.ts bounds them tightly; this is a loose net.
  if (K_QUANT_TYPES.includes(type) && kQuantIntDot(variant, type)) return 1e-3;
  if (type !== GgmlType.BF16 || !roundsBf16Activations(variant)) return referenceBound(type);
  return combinedBound(bf16ActivationBound(x, w, m, k, n, exact), referenceBound(type));
}

describe('native ops: matmul', { skip: skipNative }, () => {
  for (const type of [...FLOAT_TYPES, ...INT8_TYPES, ...K_QUANT_TYPES]) {
    it(`${ggmlTypeName(type)}: every variant matches generic C++ and a TypeScript reference`, () => {
      const rand = seeded(type + 1);
      for (const [m, k, n] of shapesFor(type)) {
        const weightsF32 = randomArray(n * k, rand);
        const w = quantize(type, weightsF32);
        const decoded = new Float32Array(n * k);
        dequantize(type, w, n * k, decoded);
        const x = randomArray(m * k, rand);
        const expected = referenceMatmul(x, decoded, m, k, n);
        const shape = `${ggmlTypeName(type)} m=${m} k=${k} n=${n}`;

        const generic = guarded(m * n, NaN);
        native().ops.matmul('generic', type, w, x, m, k, n, generic.view, 1);
        generic.checkGuards(`${shape} generic`);
        assertClose(generic.view, expected, referenceBound(type), `${shape} generic vs TypeScript`);

        for (const variant of variants.slice(1)) {
          const bound = variantBound(type, variant, x, decoded, m, k, n, expected);
          for (const threads of [1, 2]) {
            const y = guarded(m * n, NaN);
            native().ops.matmul(variant, type, w, x, m, k, n, y.view, threads);
            y.checkGuards(`${shape} ${variant}`);
            // K-quants on 8-bit activations: each output is checked against a bound derived from the quantization
            // in native-kquant.test.ts (an NMSE over a few outputs says little).
            if (K_QUANT_TYPES.includes(type) && kQuantIntDot(variant, type)) continue;
            assertClose(y.view, expected, bound, `${shape} ${variant} vs TypeScript`);
            assertClose(y.view, generic.view, bound === referenceBound(type) ? 1e-9 : combinedBound(bound, 1e-9),
              `${shape} ${variant} vs generic`);
          }
        }
      }
    });
  }

  // A sequence decoded alone and in a batch must sample the same tokens: a row's outputs may not depend on how
  // many rows share the matmul (decode GEMV vs prefill GEMM paths, register-block tails).
  it('each row gives the same bits whatever the number of rows', () => {
    for (const type of [...FLOAT_TYPES, ...INT8_TYPES, ...K_QUANT_TYPES]) {
      const rand = seeded(50 + type);
      const k = K_QUANT_TYPES.includes(type) ? 512 : 320, n = 70, m = 37;
      const w = quantize(type, randomArray(n * k, rand));
      const x = randomArray(m * k, rand);
      for (const variant of variants) {
        const all = new Float32Array(m * n);
        native().ops.matmul(variant, type, w, x, m, k, n, all, 2);
        for (const [first, count] of [[0, 1], [5, 1], [36, 1], [3, 2], [10, 3], [20, 4], [1, 16]] as const) {
          const part = new Float32Array(count * n);
          native().ops.matmul(variant, type, w, x.subarray(first * k, (first + count) * k), count, k, n, part, 1);
          assert.deepEqual(part, all.subarray(first * n, (first + count) * n),
            `${ggmlTypeName(type)} ${variant}: rows ${first}..${first + count - 1} alone differ from the batch`);
        }
      }
    }
  });

  it('rejects a row length that is not a whole number of blocks', () => {
    const y = new Float32Array(1);
    assert.throws(() => native().ops.matmul('generic', GgmlType.Q8_0, new Uint8Array(34), new Float32Array(31), 1,
      31, 1, y, 1), /not a multiple of the block size/);
  });
});

// ---------------------------------------------------------------------------------------------------------------
// Load-time packed weights: a variant may repack a matrix once (as a model does at load) into panels it streams
// instead of the ggml rows. The packed path must give exactly the bits of the ggml path (a model packs all its
// matrices, the ops entry points and other backends of a deployment may not), for odd shapes too.

// [m, k, n]: one row; rows not a multiple of the 16-row panel (1, 7, 33, 97: last panel partial, panel count odd
// so a padding panel follows); k not a multiple of 256 (one block, three blocks, eleven); decode and GEMM row counts.
const PACKED_SHAPES: [number, number, number][] = [
  [1, 32, 1], [1, 96, 7], [3, 352, 33], [2, 4096, 16], [4, 64, 97], [5, 96, 65], [16, 128, 130], [67, 256, 48],
];
// K-quants (rows of whole 256-column super-blocks): one, two, three and eight super-blocks, the same row counts.
const PACKED_KQUANT_SHAPES: [number, number, number][] = [
  [1, 256, 1], [1, 512, 7], [3, 768, 33], [2, 2048, 16], [4, 256, 97], [5, 512, 65], [16, 256, 130], [67, 256, 48],
];

describe('native ops: packed weights', { skip: skipNative }, () => {
  const packing = variants.flatMap((variant) => [...INT8_TYPES, GgmlType.BF16, ...K_QUANT_TYPES].filter((type) =>
    native().ops.packedBytes(variant, type, 256, 1) > 0).map((type) => ({ variant, type })));

  for (const { variant, type } of packing) {
    it(`${variant} ${ggmlTypeName(type)}: packed weights give the ggml path's bits, every shape and row count`, () => {
      const rand = seeded(70 + type);
      for (const [m, k, n] of K_QUANT_TYPES.includes(type) ? PACKED_KQUANT_SHAPES : PACKED_SHAPES) {
        const w = quantize(type, randomArray(n * k, rand));
        const decoded = new Float32Array(n * k);
        dequantize(type, w, n * k, decoded);
        const x = randomArray(m * k, rand);
        const shape = `${variant} ${ggmlTypeName(type)} m=${m} k=${k} n=${n}`;
        const packed = native().ops.pack(variant, type, w, k, n);
        assert.equal(packed.byteLength, native().ops.packedBytes(variant, type, k, n), `${shape}: packed size`);
        const rows = new Float32Array(m * n);
        native().ops.matmul(variant, type, w, x, m, k, n, rows, 1);
        for (const threads of [1, 2]) {
          const y = guarded(m * n, NaN);
          native().ops.matmul(variant, type, packed, x, m, k, n, y.view, threads, true);
          y.checkGuards(`${shape} packed, ${threads} threads`);
          assert.deepEqual(y.view, rows, `${shape} packed, ${threads} threads: differs from the ggml rows`);
        }
        const exact = referenceMatmul(x, decoded, m, k, n);
        assertClose(rows, exact, variantBound(type, variant, x, decoded, m, k, n, exact), `${shape} vs TypeScript`);
        // Each row alone (decode) gives the bits it gets in the batch.
        for (let r = 0; r < m; r += Math.max(1, m >> 1)) {
          const one = new Float32Array(n);
          native().ops.matmul(variant, type, packed, x.subarray(r * k, (r + 1) * k), 1, k, n, one, 2, true);
          assert.deepEqual(one, rows.subarray(r * n, (r + 1) * n), `${shape}: row ${r} alone`);
        }
      }
    });
  }

  it('packing is refused where a variant has none, and packed weights must be the packed size', () => {
    const w = quantize(GgmlType.F32, randomArray(64, seeded(80)));
    assert.equal(native().ops.packedBytes('generic', GgmlType.Q8_0, 32, 2), 0);
    assert.throws(() => native().ops.pack('generic', GgmlType.Q8_0, new Uint8Array(68), 32, 2), /no packed layout/);
    assert.throws(() => native().ops.matmul('generic', GgmlType.F32, w, new Float32Array(32), 1, 32, 2,
      new Float32Array(2), 1, true), /no packed layout/);
    for (const { variant, type } of packing) {
      const k = K_QUANT_TYPES.includes(type) ? 256 : 32;
      const packed = native().ops.pack(variant, type, quantize(type, randomArray(2 * k, seeded(81))), k, 2);
      assert.throws(() => native().ops.matmul(variant, type, packed.subarray(0, packed.length - 1),
        new Float32Array(k), 1, k, 2, new Float32Array(2), 1, true), /needs \d+/);
    }
  });
});

// ---------------------------------------------------------------------------------------------------------------
// embedding (row dequantization)

describe('native ops: embedding', { skip: skipNative }, () => {
  for (const type of [...FLOAT_TYPES, ...INT8_TYPES, ...K_QUANT_TYPES]) {
    it(`${ggmlTypeName(type)}: rows decode as quant.ts decodes them`, () => {
      const rand = seeded(100 + type);
      const dim = K_QUANT_TYPES.includes(type) ? 512 : type === GgmlType.F32 ? 33 : 96;
      const rows = 9;
      const table = quantize(type, randomArray(rows * dim, rand));
      const decoded = new Float32Array(rows * dim);
      dequantize(type, table, rows * dim, decoded);
      const ids = Int32Array.from([8, 0, 3, 3, 7]);
      const expected = new Float32Array(ids.length * dim);
      ids.forEach((id, i) => expected.set(decoded.subarray(id * dim, (id + 1) * dim), i * dim));
      for (const variant of variants) {
        const out = guarded(ids.length * dim, NaN);
        native().ops.embedding(variant, type, table, dim, ids, out.view);
        out.checkGuards(`${ggmlTypeName(type)} ${variant}`);
        assertClose(out.view, expected, 1e-12, `${ggmlTypeName(type)} ${variant}`);
      }
      assert.throws(() => native().ops.embedding('generic', type, table, dim, Int32Array.of(rows),
        new Float32Array(dim)), /outside the table/);
    });
  }
});

// ---------------------------------------------------------------------------------------------------------------
// row ops

const ROW_LENGTHS = [1, 7, 16, 33, 4097];

describe('native ops: row kernels', { skip: skipNative }, () => {
  it('rmsnorm', () => {
    const rand = seeded(7);
    for (const dim of ROW_LENGTHS) {
      const rows = 3;
      const x = randomArray(rows * dim, rand, 4);
      const weight = randomArray(dim, rand);
      const eps = 1e-5;
      const expected = new Float64Array(rows * dim);
      for (let r = 0; r < rows; r++) {
        let ss = 0;
        for (let i = 0; i < dim; i++) ss += x[r * dim + i]! ** 2;
        const scale = 1 / Math.sqrt(ss / dim + eps);
        for (let i = 0; i < dim; i++) expected[r * dim + i] = x[r * dim + i]! * scale * weight[i]!;
      }
      for (const variant of variants) {
        const out = guarded(rows * dim, NaN);
        native().ops.rmsnorm(variant, x, weight, rows, dim, eps, out.view);
        out.checkGuards(`rmsnorm dim=${dim} ${variant}`);
        assertClose(out.view, expected, 1e-11, `rmsnorm dim=${dim} ${variant}`);
      }
    }
  });

  it("argmax: the first largest value as the sampler's argmax finds it; -1 for a NaN or nothing above -Infinity", () => {
    const rand = seeded(81);
    const rows: [string, Float32Array][] = [];
    for (const n of [...ROW_LENGTHS, 32000]) {
      rows.push([`random n=${n}`, randomArray(n, rand, 8)]);
      // Few distinct values: the largest comes many times, the first must win.
      rows.push([`ties n=${n}`, Float32Array.from({ length: n }, () => Math.floor(rand() * 3))]);
      // The largest only in the last element (the tail of the vector loop), and only in the first.
      const last = randomArray(n, rand);
      last[n - 1] = 5;
      rows.push([`last n=${n}`, last]);
      const first = randomArray(n, rand);
      first[0] = 5;
      rows.push([`first n=${n}`, first]);
      // Masked tokens: -Infinity everywhere but one id, then everywhere (-1); +Infinity wins.
      const masked = new Float32Array(n).fill(-Infinity);
      masked[Math.floor(rand() * n)] = -1e30;
      rows.push([`masked n=${n}`, masked]);
      rows.push([`all masked n=${n}`, new Float32Array(n).fill(-Infinity)]);
      const inf = randomArray(n, rand);
      inf[Math.floor(n / 2)] = Infinity;
      inf[n - 1] = Infinity;
      rows.push([`+Infinity n=${n}`, inf]);
      // -0 before +0: equal, so the first.
      const zeros = new Float32Array(n).fill(-1);
      zeros[Math.floor(n / 3)] = -0;
      zeros[n - 1] = 0;
      rows.push([`signed zeros n=${n}`, zeros]);
      // A NaN anywhere (first, inside the 4-vector loop, in the tail) makes the row -1.
      for (const at of new Set([0, Math.floor(n / 2), n - 1])) {
        const nan = randomArray(n, rand);
        nan[at] = NaN;
        rows.push([`NaN at ${at} n=${n}`, nan]);
      }
    }
    rows.push(['empty', new Float32Array(0)]);
    for (const [name, row] of rows) {
      let expected: number;
      try {
        expected = argmax(row);
      } catch {
        expected = -1; // the sampler throws on these rows; the kernels leave them to it
      }
      for (const variant of variants) assert.equal(native().ops.argmax(variant, row), expected, `${name} ${variant}`);
    }
  });

  it("sampleWeigh: the sampler's weighing pass bit for bit (weights, blocks' running totals, last id, top_p bins)", () => {
    const rand = seeded(83);
    const rows: [string, Float32Array][] = [];
    for (const n of [...ROW_LENGTHS, 32000]) {
      rows.push([`random n=${n}`, randomArray(n, rand, 8)]);
      // Logits as a model gives them: a few tall peaks over a wide spread (most weights tiny, some 0 below -708).
      const peaked = randomArray(n, rand, 30);
      for (let p = 0; p < 3; p++) peaked[Math.floor(rand() * n)] = 700 + 20 * rand();
      rows.push([`peaked n=${n}`, peaked]);
      rows.push([`ties n=${n}`, Float32Array.from({ length: n }, () => Math.floor(rand() * 3))]);
      // Masked tokens (-Infinity, and -1e30: a candidate whose weight is 0), the last one in the vector tail.
      const masked = randomArray(n, rand, 4);
      for (let i = 0; i < n; i += 3) masked[i] = i % 2 === 0 ? -Infinity : -1e30;
      masked[n - 1] = -Infinity;
      rows.push([`masked n=${n}`, masked]);
      // +Infinity: its gap from the max (+Infinity) is NaN, which the pass carries as the scalar code does.
      const inf = randomArray(n, rand);
      inf[n - 1] = Infinity;
      rows.push([`+Infinity n=${n}`, inf]);
    }
    const same = (a: number, b: number) => Object.is(a, b);
    for (const [name, row] of rows) {
      let rawMax = -Infinity;
      for (const value of row) if (value > rawMax) rawMax = value;
      // Read as they are, and at 1 / temperature 0.7 (each value rounded to float32 as a scaled copy holds it).
      for (const scale of [1, 1 / 0.7]) {
        const max = Math.fround(rawMax * scale);
        // No floor, a min_p floor, and a floor above every value (no candidate).
        for (const floor of [-Infinity, max - 3, max + 1]) {
          for (const withTotals of [false, true]) {
            for (const withBins of [false, true]) {
              const n = row.length;
              const expected = { weights: new Float64Array(n), blockTotals: new Float64Array(n), binMass: new Float64Array(MASS_BINS),
                binCount: new Int32Array(MASS_BINS), last: new Int32Array(1) };
              const total = weighCandidates(row, scale, max, floor, expected.weights, withTotals ? expected.blockTotals : null,
                withBins ? expected.binMass : null, withBins ? expected.binCount : null, expected.last);
              for (const variant of variants) {
                const what = `${name} scale ${scale} floor ${floor} block totals ${withTotals} bins ${withBins} ${variant}`;
                // Stale values everywhere (the bins too: the pass zeroes them), so a slot the kernel should write and
                // does not is seen.
                const got = { weights: new Float64Array(n).fill(-7), blockTotals: new Float64Array(n).fill(-7),
                  binMass: new Float64Array(MASS_BINS).fill(-7), binCount: new Int32Array(MASS_BINS).fill(-7), last: Int32Array.of(-7) };
                const gotTotal = native().ops.sampleWeigh(variant, row, scale, max, floor, got.weights,
                  withTotals ? got.blockTotals : null, withBins ? got.binMass : null, withBins ? got.binCount : null, got.last);
                assert.ok(same(gotTotal, total), `${what}: total ${gotTotal} against ${total}`);
                assert.equal(got.last[0], expected.last[0], `${what}: last id`);
                for (let i = 0; i < n; i++) {
                  if (!same(got.weights[i]!, expected.weights[i]!)) assert.fail(`${what}: weight ${i} ${got.weights[i]} against ${expected.weights[i]}`);
                }
                // The running total after each block of 8 ids, and nothing past the last block.
                const blocks = withTotals ? Math.ceil(n / 8) : 0;
                for (let b = 0; b < blocks; b++) {
                  if (!same(got.blockTotals[b]!, expected.blockTotals[b]!)) assert.fail(`${what}: block total ${b}`);
                }
                assert.ok(got.blockTotals.subarray(blocks).every((v) => v === -7), `${what}: block totals written past the blocks or not asked for`);
                for (let b = 0; b < MASS_BINS; b++) {
                  if (withBins ? !same(got.binMass[b]!, expected.binMass[b]!) || got.binCount[b] !== expected.binCount[b]
                    : got.binMass[b] !== -7 || got.binCount[b] !== -7) assert.fail(`${what}: bin ${b}`);
                }
              }
            }
          }
        }
      }
    }
  });

  it("scaleRow: the sampler's scaled copy of a row bit for bit, in place or into another array", () => {
    const rand = seeded(97);
    for (const n of [...ROW_LENGTHS, 32000]) {
      const row = randomArray(n, rand, 20);
      // The edges: infinities, NaN, zeros of both signs, subnormals, the largest floats (to infinity when scaled
      // up), values whose product lands halfway between two floats more often than chance.
      const edges = [Infinity, -Infinity, NaN, 0, -0, 1e-45, -1.4e-45, 1.1754942e-38, 3.4028235e38, -3.4028235e38, 1 + 2 ** -23, 3 * 2 ** -24];
      for (let i = 0; i < edges.length && i < n; i++) row[Math.floor(rand() * n)] = edges[i]!;
      for (const factor of [1 / 0.7, 1 / 1.3, 1.25, 1e-30, 1e30, -2, 1]) {
        const expected = new Float32Array(n);
        scaleRow(row, expected, factor);
        for (const variant of variants) {
          const what = `n=${n} factor ${factor} ${variant}`;
          const out = new Float32Array(n + 3).fill(-7);
          native().ops.scaleRow(variant, row, out, factor);
          for (let i = 0; i < n; i++) if (!Object.is(out[i], expected[i])) assert.fail(`${what}: ${i} ${out[i]} against ${expected[i]}`);
          assert.deepEqual([...out.subarray(n)], [-7, -7, -7], `${what}: nothing written past the row`);
          const inPlace = Float32Array.from(row);
          native().ops.scaleRow(variant, inPlace, inPlace, factor);
          for (let i = 0; i < n; i++) if (!Object.is(inPlace[i], expected[i])) assert.fail(`${what} in place: ${i}`);
        }
      }
    }
    assert.throws(() => native().ops.scaleRow(variants[0]!, new Float32Array(8), new Float32Array(7), 2), /out has 7 elements, needs 8/);
    assert.throws(() => native().ops.scaleRow(variants[0]!, new Float32Array(8), new Float64Array(8) as unknown as Float32Array, 2), /out must be a Float32Array/);
  });

  it("a Sampler given the native argmax, weighing pass and scaled copy draws and reports logprobs as the JavaScript one, bit for bit", () => {
    const rand = seeded(89);
    const n = 32000;
    const rows = Array.from({ length: 6 }, (_, r) => {
      const row = randomArray(n, rand, 6);
      for (let p = 0; p < 3; p++) row[Math.floor(rand() * n)] = 14 + 2 * rand();
      if (r % 2 === 1) for (let i = 0; i < n; i += 5) row[i] = -Infinity;
      return row;
    });
    for (const variant of variants) {
      const passes = { argmax: (row: Float32Array) => native().ops.argmax(variant, row),
        weigh: (...args: Parameters<WeighCandidates>) => native().ops.sampleWeigh(variant, ...args),
        scale: (...args: Parameters<ScaleRow>) => native().ops.scaleRow(variant, ...args) };
      const fast = new Sampler(n, passes);
      const fastProcessed = new Sampler(n, { logprobsMode: 'processed', ...passes });
      for (const [mode, overrides] of [['raw', { temperature: 0.8, logprobs: 5 }], ['raw', { temperature: 0, logprobs: 1 }],
        // A plain draw at temperature 1 (its weighing gives the logprobs' normaliser), then other draws over the same
        // scratch row, which must not take that normaliser.
        ['processed', { temperature: 1, logprobs: 3 }], ['processed', { temperature: 1.3, topP: 0.9, logprobs: 20 }], ['processed', { temperature: 0.6, minP: 0.05, logprobs: 0 }],
        // Logit processors, then the scaling in place.
        ['processed', { temperature: 0.7, topP: 0.95, repetitionPenalty: 1.2, presencePenalty: 0.4, logprobs: 2 }]] as const) {
        const make = () => createRequestSamplers({ params: { ...DEFAULT_SAMPLING, ...overrides, seed: 3 }, promptTokenIds: [5, 9, 31999], vocabSize: n,
          eosTokenIds: [] })[0]!;
        const alone = new Sampler(n, { logprobsMode: mode });
        const given = mode === 'raw' ? fast : fastProcessed;
        const [a, b] = [make(), make()];
        for (const row of rows) {
          const expected = alone.sampleRow(row, a);
          assert.deepEqual(given.sampleRow(row, b), expected, `${variant} ${mode} ${JSON.stringify(overrides)}`);
          assert.ok(expected.logprobs!.logprob < 0 && expected.logprobs!.top.length === overrides.logprobs, 'a logprob and its alternatives');
        }
      }
    }
  });

  /** A row's DrawRows spec as the sampler writes it (its 1 / temperature, ln(min_p), top_p, uniform, top_k). */
  const drawSpec = (p: { temperature: number; minP: number; topP: number; topK: number }, uniform: number) => p.temperature === 0
    ? [0, -Infinity, 1, 0, 0]
    : [p.temperature !== 1 ? 1 / p.temperature : 1, p.minP > 0 ? Math.log(p.minP) : -Infinity, p.topP, uniform, p.topK];

  it("sampleRows: the sampler's random draw of each row, token for token, for the uniform its sequence gives", () => {
    const rand = seeded(101);
    for (const n of [...ROW_LENGTHS, 32000]) {
      const rows: Float32Array[] = [];
      rows.push(randomArray(n, rand, 6));
      // Peaks as a model gives them; huge gaps (weights of 0 below -708).
      const peaked = randomArray(n, rand, 30);
      for (let p = 0; p < 3; p++) peaked[Math.floor(rand() * n)] = 700 + 20 * rand();
      rows.push(peaked);
      rows.push(Float32Array.from({ length: n }, () => Math.floor(rand() * 3))); // ties everywhere
      const masked = randomArray(n, rand, 4);
      for (let i = 0; i < n; i += 3) masked[i] = i % 2 === 0 ? -Infinity : -1e30;
      masked[n - 1] = -Infinity;
      if (n > 2) rows.push(masked); // (at n = 1 nothing is left to draw)
      const single = new Float32Array(n).fill(-Infinity); // one candidate
      single[Math.floor(rand() * n)] = 2;
      rows.push(single);
      const inf = randomArray(n, rand);
      inf[Math.floor(rand() * n)] = Infinity;
      rows.push(inf);
      const logits = new Float32Array(rows.length * n);
      rows.forEach((row, r) => logits.set(row, r * n));
      // Greedy rows too (the argmax; truncation and the uniform unused).
      const grid = [{ temperature: 0, topP: 1, minP: 0, topK: 0 }, { temperature: 0, topP: 0.5, minP: 0.05, topK: Math.min(7, n - 1) }];
      for (const temperature of [1, 0.7, 1.6]) {
        for (const topP of [1, 0.999, 0.9, 0.3]) {
          for (const minP of [0, 0.05]) for (const topK of [0, 1, 7, 50].filter((k) => k < n)) grid.push({ temperature, topP, minP, topK });
        }
      }
      for (const params of grid) {
        // Each row twice, in another order the second time, each entry its own seeded sequence.
        const entries = [...rows.keys(), ...[...rows.keys()].reverse()];
        const make = () => entries.map((_, e) => createRequestSamplers({ params: { ...DEFAULT_SAMPLING, ...params, seed: 500 + e },
          promptTokenIds: [], vocabSize: n, eosTokenIds: [] })[0]!);
        const alone = new Sampler(n);
        const expected = make().map((sequence, e) => alone.sampleRow(logits.subarray(entries[e]! * n, (entries[e]! + 1) * n), sequence).tokenId);
        const sequences = make();
        const specs = new Float64Array(entries.length * DRAW_SPEC_WORDS);
        sequences.forEach((sequence, e) => specs.set(drawSpec(params, params.temperature === 0 ? 0 : sequence.nextUniform()), e * DRAW_SPEC_WORDS));
        for (const variant of variants) {
          const out = new Int32Array(entries.length).fill(-7);
          native().ops.sampleRows(variant, n, logits, Int32Array.from(entries), specs, out);
          assert.deepEqual([...out], expected, `${variant} n=${n} ${JSON.stringify(params)}`);
        }
      }
      // The uniform's ends: the first candidate, and the last one drawn.
      for (const variant of variants) {
        const out = new Int32Array(2);
        native().ops.sampleRows(variant, n, rows[0]!, Int32Array.of(0, 0), Float64Array.of(1, -Infinity, 1, 0, 0, 1, -Infinity, 0.5, 1 - 2 ** -53, 0), out);
        const uniformSequence = (uniform: number) => Object.assign(createRequestSamplers({ params: { ...DEFAULT_SAMPLING, temperature: 1, topP: 1, seed: 1 },
          promptTokenIds: [], vocabSize: n, eosTokenIds: [] })[0]!, { nextUniform: () => uniform });
        assert.equal(out[0], new Sampler(n).sampleRow(rows[0]!, uniformSequence(0)).tokenId, `${variant} n=${n}: uniform 0`);
        const top = Object.assign(uniformSequence(1 - 2 ** -53), { params: { ...DEFAULT_SAMPLING, temperature: 1, topP: 0.5, seed: 1 } });
        assert.equal(out[1], new Sampler(n).sampleRow(rows[0]!, top).tokenId, `${variant} n=${n}: uniform just below 1`);
      }
    }
    // Rows it cannot draw (a NaN; nothing above -Infinity) come back as -1 for the sampler to report.
    const n = 40;
    const bad = new Float32Array(2 * n).fill(-Infinity);
    bad[3] = NaN;
    for (const variant of variants) {
      const out = new Int32Array(6).fill(-7);
      native().ops.sampleRows(variant, n, bad, Int32Array.of(0, 1, 0, 1, 0, 1), Float64Array.of(1, -Infinity, 1, 0.5, 0, 1, -Infinity, 1, 0.5, 0,
        2, -Infinity, 0.9, 0.5, 0, 2, -Infinity, 0.9, 0.5, 0, 2, -Infinity, 0.9, 0.5, 5, 2, -3, 0.9, 0.5, 5), out);
      assert.deepEqual([...out], [-1, -1, -1, -1, -1, -1], variant);
      // A Sampler given the pass reports them as its own draw does: the row's failure, for its request alone.
      const sampler = new Sampler(n, { drawRows: (...args) => native().ops.sampleRows(variant, n, ...args) });
      const make = () => createRequestSamplers({ params: { ...DEFAULT_SAMPLING, temperature: 0.9 }, promptTokenIds: [], vocabSize: n, eosTokenIds: [] })[0]!;
      const nan = sampler.sampleBatch(bad, [make(), undefined])[0]!;
      assert.equal(nan.tokenId, -1);
      assert.match(nan.failure?.message ?? '', /NaN at token id 3/);
      assert.match(sampler.sampleBatch(bad, [undefined, make()])[1]?.failure?.message ?? '', /every token is masked/);
      assert.throws(() => sampler.sample(bad.subarray(0, n), [make()]), /NaN at token id 3/, 'sample() throws it');
    }
    // Arguments it refuses, naming what is wrong.
    const ok = { logits: new Float32Array(2 * n), rows: Int32Array.of(1), specs: Float64Array.of(1, -Infinity, 1, 0.5, 0), out: new Int32Array(1) };
    const call = (o: Partial<typeof ok>, vocab = n) => () => native().ops.sampleRows(variants[0]!, vocab, o.logits ?? ok.logits,
      o.rows ?? ok.rows, o.specs ?? ok.specs, o.out ?? ok.out);
    assert.throws(call({ rows: Int32Array.of(2) }), /rows\[0\] = 2 is not a row of the 2 given/);
    assert.throws(call({ rows: Int32Array.of(-1) }), /is not a row/);
    assert.throws(call({}, 30), /whole rows of 30 values/);
    for (const spec of [[-1, -Infinity, 1, 0.5, 0], [NaN, -Infinity, 1, 0.5, 0], [1, 0.1, 1, 0.5, 0], [1, -Infinity, 0, 0.5, 0], [1, -Infinity, 1, 1, 0],
      [1, -Infinity, 1, NaN, 0], [1, -Infinity, 1, 0.5, -1], [1, -Infinity, 1, 0.5, 2.5], [1, -Infinity, 1, 0.5, n]]) {
      assert.throws(call({ specs: Float64Array.from(spec) }), /specs\[0\] must be/, JSON.stringify(spec));
    }
    assert.throws(call({ out: new Int32Array(0) }), /out/);
  });

  it('add is exact', () => {
    const rand = seeded(8);
    for (const n of ROW_LENGTHS) {
      const a = randomArray(n, rand);
      const b = randomArray(n, rand);
      const expected = a.map((v, i) => Math.fround(v + b[i]!));
      for (const variant of variants) {
        const acc = guarded(n);
        acc.view.set(a);
        native().ops.add(variant, acc.view, b);
        acc.checkGuards(`add n=${n} ${variant}`);
        assert.deepEqual(acc.view, expected, `add n=${n} ${variant}`);
      }
    }
  });

  it('swiglu', () => {
    const rand = seeded(9);
    for (const n of ROW_LENGTHS) {
      const gate = randomArray(n, rand, 12);
      const up = randomArray(n, rand, 3);
      const expected = Float64Array.from(gate, (g, i) => (g / (1 + Math.exp(-g))) * up[i]!);
      for (const variant of variants) {
        const out = guarded(n, NaN);
        native().ops.swiglu(variant, gate, up, out.view);
        out.checkGuards(`swiglu n=${n} ${variant}`);
        assertClose(out.view, expected, 1e-11, `swiglu n=${n} ${variant}`);
      }
    }
  });

  it('geglu against the reference GELU-tanh, far into both tails', () => {
    const rand = seeded(19);
    for (const n of ROW_LENGTHS) {
      const gate = randomArray(n, rand, 12);
      const up = randomArray(n, rand, 3);
      // Where tanh saturates (both ways), where the exp clamps, and around zero.
      [0, -1e-3, 1e-3, -6, 6, -20, 20, -100, 100].slice(0, n).forEach((g, i) => { gate[i] = g; });
      const expected = Float64Array.from(gate, (g, i) => geluTanh(g) * up[i]!);
      for (const variant of variants) {
        const out = guarded(n, NaN);
        native().ops.geglu(variant, gate, up, out.view);
        out.checkGuards(`geglu n=${n} ${variant}`);
        assertClose(out.view, expected, 1e-11, `geglu n=${n} ${variant}`);
        // Per element: a few float roundings of the value, or of g * up where 1 + tanh cancels (the plain C++ form).
        out.view.forEach((v, i) => {
          const e = expected[i]!;
          assert.ok(Math.abs(v - e) <= 1e-6 * Math.abs(e) + 1e-7 * Math.abs(gate[i]! * up[i]!),
            `geglu n=${n} ${variant} [${i}]: gate ${gate[i]}, got ${v}, expected ${e}`);
        });
      }
    }
  });

  it('softmax, including large logits', () => {
    const rand = seeded(10);
    for (const n of ROW_LENGTHS) {
      const rows = 2;
      const x = randomArray(rows * n, rand, 30);
      x[0] = 90; // exp(90) overflows f32: the max must be subtracted first
      const expected = new Float64Array(rows * n);
      for (let r = 0; r < rows; r++) {
        const row = x.subarray(r * n, (r + 1) * n);
        const max = Math.max(...row);
        const sum = row.reduce((s, v) => s + Math.exp(v - max), 0);
        row.forEach((v, i) => { expected[r * n + i] = Math.exp(v - max) / sum; });
      }
      for (const variant of variants) {
        const out = guarded(rows * n);
        out.view.set(x);
        native().ops.softmax(variant, out.view, rows, n);
        out.checkGuards(`softmax n=${n} ${variant}`);
        assertClose(out.view, expected, 1e-11, `softmax n=${n} ${variant}`);
      }
    }
  });

  const ropeCases: { name: string; heads: number; headDim: number; ropeDim: number; neox: boolean;
    scaling?: RopeScalingArg }[] = [
    { name: 'interleaved', heads: 3, headDim: 64, ropeDim: 64, neox: false },
    { name: 'neox', heads: 2, headDim: 128, ropeDim: 128, neox: true },
    { name: 'partial neox', heads: 2, headDim: 80, ropeDim: 32, neox: true },
    { name: 'partial interleaved', heads: 1, headDim: 16, ropeDim: 6, neox: false },
    { name: 'head 8', heads: 4, headDim: 8, ropeDim: 8, neox: false },
    { name: 'linear scaling', heads: 2, headDim: 64, ropeDim: 64, neox: true, scaling: { type: 'linear', factor: 4 } },
    {
      name: 'llama3 scaling', heads: 2, headDim: 128, ropeDim: 128, neox: false,
      scaling: { type: 'llama3', factor: 8, lowFreqFactor: 1, highFreqFactor: 4, originalContextLength: 8192 },
    },
    {
      name: 'LongRoPE (partial, as Phi-4-mini)', heads: 2, headDim: 24, ropeDim: 16, neox: true,
      scaling: { type: 'longrope', factors: [1, 1.25, 1.5, 2, 3, 5.5, 9, 16], attentionFactor: 1.19 },
    },
  ];
  for (const c of ropeCases) {
    it(`rope: ${c.name}`, () => {
      const rand = seeded(11);
      const positions = Int32Array.from([0, 1, 2, 17, 511, 4096, 70000]);
      const width = c.heads * c.headDim;
      const x = randomArray(positions.length * width, rand);
      const theta = c.scaling?.type === 'llama3' ? 500000 : 10000;
      const expected = referenceRope(x, positions, c.heads, c.headDim, c.ropeDim, c.neox, theta, c.scaling);
      for (const variant of variants) {
        const out = guarded(x.length);
        out.view.set(x);
        native().ops.rope(variant, out.view, positions, c.heads, c.headDim, c.ropeDim, c.neox, theta, c.scaling);
        out.checkGuards(`rope ${c.name} ${variant}`);
        assertClose(out.view, expected, 1e-12, `rope ${c.name} ${variant}`);
      }
    });
  }
});
