// BF16 weights on VDPBF16PS (kernel avx512_bf16, on CPUs with AVX512-BF16): the activations are rounded to bf16
// exactly as specified, the results stay within the error that rounding allows on odd shapes, the packed copy a
// model streams gives the ggml rows' bits, a row's outputs do not depend on the rows it shares the matmul with, and
// CONDUIT_BF16_DOT=0 keeps the f32 kernel.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { describe, it } from 'node:test';

import { GgmlType } from '../../src/model/ggml-types.ts';
import { bf16BitsToF32, dequantize, f32ToBf16Bits, quantize } from '../../src/model/quant.ts';
import {
  addon, assertClose, bf16ActivationBound, combinedBound, guarded, native, randomArray, referenceMatmul, roundsBf16Activations,
  seeded, skipNative, variants,
} from './native-harness.ts';

const bf16Variants = addon ? variants.filter(roundsBf16Activations) : [];
const skip = skipNative || (bf16Variants.length === 0 && 'no variant multiplies BF16 with VDPBF16PS on this CPU');

/** The activation VCVTNE2PS2BF16 makes of x: round to nearest even, denormals to (signed) zero. */
function bf16Activation(x: number): number {
  if (Math.abs(x) < 2 ** -126) return 0;
  return bf16BitsToF32(f32ToBf16Bits(x));
}

/** -0 and +0 compare equal; NaN equals NaN. */
const plain = (v: ArrayLike<number>) => Array.from(v, (x) => x + 0);

describe('native BF16 matmul on VDPBF16PS', { skip }, () => {
  it('rounds each activation to the nearest bf16, ties to even, denormals to zero', () => {
    // Identity weights make each output one activation as the kernel rounded it. k = n = 100: a partial last chunk.
    const k = 100, rand = seeded(1);
    const identity = new Float32Array(k * k);
    for (let i = 0; i < k; i++) identity[i * k + i] = 1;
    const w = quantize(GgmlType.BF16, identity);
    const ulp = 2 ** -7;  // of values in [1, 2)
    const special = [
      1 + ulp / 2,        // tie, even neighbour below: 1
      1 + (3 * ulp) / 2,  // tie, even neighbour above: 1 + 2 ulp
      -(1 + ulp / 2), 1 + ulp / 2 + 2 ** -20, 1 + ulp / 2 - 2 ** -20, 3.3e38, -7.5e-30,
      2 ** -126,          // the smallest normal float: kept
      2 ** -127, -(2 ** -130), 1e-45,  // denormals: zero
    ];
    const rows = [
      Float32Array.from({ length: k }, (_, i) => special[i] ?? (rand() * 2 - 1) * 4),
      randomArray(k, rand, 1000),
      randomArray(k, rand, 1e-3),
    ];
    const m = rows.length;
    const x = new Float32Array(m * k);
    rows.forEach((row, r) => x.set(row, r * k));
    const expected = plain(Array.from(x, bf16Activation));
    for (const variant of bf16Variants) {
      const packed = native().ops.pack(variant, GgmlType.BF16, w, k, k);
      for (const threads of [1, 2]) {
        for (const [layout, weights] of [['ggml rows', w], ['packed', packed]] as const) {
          const y = guarded(m * k, NaN);
          native().ops.matmul(variant, GgmlType.BF16, weights, x, m, k, k, y.view, threads, layout === 'packed');
          y.checkGuards(`${variant} ${layout}`);
          assert.deepEqual(plain(y.view), expected, `${variant} ${layout}, ${threads} threads`);
        }
      }
    }
  });

  it('carries infinities and NaN as f32 products do, each row on its own', () => {
    // A value past the largest finite bf16 rounds to infinity, and infinity x 0 is NaN: only that row is affected.
    const k = 40, n = 3;
    const w = quantize(GgmlType.BF16, Float32Array.from({ length: n * k }, (_, i) => (i % (k + 1) === 0 ? 1 : 0)));
    const x = new Float32Array(3 * k).fill(0.5);
    x[0] = 3.4e38;       // row 0, column 0: rounds up to infinity
    x[k + 1] = NaN;      // row 1, column 1
    for (const variant of bf16Variants) {
      const y = new Float32Array(3 * n);
      native().ops.matmul(variant, GgmlType.BF16, w, x, 3, k, n, y, 1);
      assert.deepEqual(Array.from(y), [Infinity, NaN, NaN, NaN, NaN, NaN, 0.5, 0.5, 0.5], variant);
    }
  });

  // [m, k, n]: every row count a register block can leave (1-3 alone, 4, 7 = 4 + 3, 16, 33 = 8 x 4 + 1); k below,
  // at and past a 32-column chunk, odd, and long; n not a multiple of the 4-row groups or the 32-row slabs.
  const SHAPES: [number, number, number][] = [
    [1, 1, 1], [1, 7, 7], [2, 31, 33], [3, 32, 100], [4, 33, 1], [7, 63, 33], [16, 100, 7], [33, 768, 100],
    [2, 2049, 33], [3, 4095, 7], [16, 4096, 33], [33, 96, 130], [1, 4096, 100],
  ];

  it('matches the exact product within the rounding bound, ggml rows and packed give the same bits', () => {
    const rand = seeded(2);
    for (const [m, k, n] of SHAPES) {
      const w = quantize(GgmlType.BF16, randomArray(n * k, rand));
      const decoded = new Float32Array(n * k);
      dequantize(GgmlType.BF16, w, n * k, decoded);
      const x = randomArray(m * k, rand);
      const exact = referenceMatmul(x, decoded, m, k, n);
      const bound = bf16ActivationBound(x, decoded, m, k, n, exact);
      const shape = `m=${m} k=${k} n=${n}`;
      const generic = new Float32Array(m * n);
      native().ops.matmul('generic', GgmlType.BF16, w, x, m, k, n, generic, 1);
      for (const variant of bf16Variants) {
        const packed = native().ops.pack(variant, GgmlType.BF16, w, k, n);
        assert.equal(packed.byteLength, native().ops.packedBytes(variant, GgmlType.BF16, k, n), `${shape}: packed size`);
        const rows = guarded(m * n, NaN);
        native().ops.matmul(variant, GgmlType.BF16, w, x, m, k, n, rows.view, 1);
        rows.checkGuards(`${shape} ${variant}`);
        assertClose(rows.view, exact, bound, `${shape} ${variant} vs the exact product`);
        assertClose(rows.view, generic, combinedBound(bound, 1e-9), `${shape} ${variant} vs generic`);
        for (const threads of [1, 2]) {
          const y = guarded(m * n, NaN);
          native().ops.matmul(variant, GgmlType.BF16, packed, x, m, k, n, y.view, threads, true);
          y.checkGuards(`${shape} ${variant} packed, ${threads} threads`);
          assert.deepEqual(y.view, rows.view, `${shape} ${variant} packed, ${threads} threads: differs from the rows`);
          const two = new Float32Array(m * n);
          native().ops.matmul(variant, GgmlType.BF16, w, x, m, k, n, two, threads);
          assert.deepEqual(two, rows.view, `${shape} ${variant} ggml rows, ${threads} threads`);
        }
      }
    }
  });

  // A sequence decoded alone and in a batch must sample the same tokens.
  it('gives each row the same bits whatever the number of rows, on both layouts', () => {
    const rand = seeded(3);
    const m = 37, k = 200, n = 70;
    const w = quantize(GgmlType.BF16, randomArray(n * k, rand));
    const x = randomArray(m * k, rand);
    for (const variant of bf16Variants) {
      const packed = native().ops.pack(variant, GgmlType.BF16, w, k, n);
      for (const [layout, weights] of [['ggml rows', w], ['packed', packed]] as const) {
        const isPacked = layout === 'packed';
        const all = new Float32Array(m * n);
        native().ops.matmul(variant, GgmlType.BF16, weights, x, m, k, n, all, 2, isPacked);
        for (const [first, count] of [[0, 1], [36, 1], [3, 2], [10, 3], [20, 4], [30, 7], [1, 16], [0, 33]] as const) {
          for (const threads of [1, 2]) {
            const part = new Float32Array(count * n);
            native().ops.matmul(variant, GgmlType.BF16, weights, x.subarray(first * k, (first + count) * k), count, k,
              n, part, threads, isPacked);
            assert.deepEqual(part, all.subarray(first * n, (first + count) * n),
              `${variant} ${layout}: rows ${first}..${first + count - 1} on ${threads} threads differ from the batch`);
          }
        }
      }
    }
  });

  it('packs 32-row slabs at two bytes a weight, zero-padding a partial slab and chunk', () => {
    for (const variant of bf16Variants) {
      assert.equal(native().ops.packedBytes(variant, GgmlType.BF16, 768, 2048), 768 * 2048 * 2);
      assert.equal(native().ops.packedBytes(variant, GgmlType.BF16, 33, 1), 64 * 32 * 2);
      const w = quantize(GgmlType.BF16, randomArray(4 * 64, seeded(4)));
      assert.throws(() => native().ops.matmul(variant, GgmlType.BF16, native().ops.pack(variant, GgmlType.BF16, w, 64, 4)
        .subarray(64), new Float32Array(64), 1, 64, 4, new Float32Array(4), 1, true), /needs \d+/);
    }
  });

  it('keeps the f32 kernel with CONDUIT_BF16_DOT=0', () => {
    // The kernel table is built once per process: ask a fresh one. Its BF16 results must then be the f32 kernel's,
    // as close to the exact product as the generic loop (far closer than bf16 activations allow).
    const script = `
      import { loadNativeAddon } from './src/kernels/native.ts';
      import { GgmlType } from './src/model/ggml-types.ts';
      const addon = loadNativeAddon();
      const [k, n] = [96, 5];
      const w = new Uint8Array(new Uint16Array(k * n).map((_, i) => 0x3f80 + (i % 89)).buffer);
      const x = Float32Array.from({ length: k }, (_, i) => Math.sin(i) * 1.2345);
      const out = (variant) => { const y = new Float32Array(n); addon.ops.matmul(variant, GgmlType.BF16, w, x, 1, k, n, y, 1); return Array.from(y); };
      const variants = ${JSON.stringify(bf16Variants)};
      console.log(JSON.stringify({ names: variants.map((v) => addon.kernelVariants(v).matmul_bf16),
        generic: out('generic'), results: variants.map(out) }));`;
    const run = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script], {
      env: { ...process.env, CONDUIT_BF16_DOT: '0' }, encoding: 'utf8',
    });
    assert.equal(run.status, 0, run.stderr);
    const { names, generic, results } = JSON.parse(run.stdout) as { names: string[]; generic: number[]; results: number[][] };
    names.forEach((name, i) => assert.notEqual(name, 'avx512_bf16', `${bf16Variants[i]} still reports VDPBF16PS`));
    results.forEach((y, i) => assertClose(y, generic, 1e-12, `${bf16Variants[i]} with CONDUIT_BF16_DOT=0`));
  });
});
