// Q4_K / Q5_K / Q6_K integer-dot matmuls (kernels avx2_int8, avx512_vnni): every variant this CPU runs, odd shapes, 1 and 2
// threads, guard values around the outputs, against the exact product of the decoded weights within a bound derived
// from the activation quantization and the kernel's float operations (not fitted to observed errors), bit for bit
// across batch sizes, and bit for bit between the SIMD variants.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { describe, it } from 'node:test';

import { GgmlType, ggmlTypeName } from '../../src/model/ggml-types.ts';
import { dequantize, f16BitsToF32, quantize } from '../../src/model/quant.ts';
import type { KernelVariant } from '../../src/kernels/native.ts';
import {
  assertClose, guarded, native, randomArray, referenceMatmul, seeded, skipNative, variants,
} from './native-harness.ts';

const TYPES = [GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K];
const U = 2 ** -24; // unit roundoff of f32

/** Variants whose matmul for `type` takes 8-bit activations (the generic one decodes to f32: the oracle). */
function intDotVariants(type: GgmlType): KernelVariant[] {
  const kind = `matmul_${ggmlTypeName(type).toLowerCase()}`;
  return variants.filter((v) => ['avx2_int8', 'avx512_vnni'].includes(native().kernelVariants(v)[kind] ?? ''));
}

/**
 * Per weight element, an upper bound of the magnitudes of the integer terms the kernel multiplies and adds before
 * scaling (Q4_K: d * scale * q and dmin * min, q <= 15; Q5_K the same with q <= 31; Q6_K: d * |scale| * (q + 32) and d * |scale| * 32, q + 32 being the
 * stored 0..63).
 */
function termMagnitudes(type: GgmlType, w: Uint8Array, elements: number): Float64Array {
  const out = new Float64Array(elements);
  const blocks = elements / 256;
  for (let b = 0; b < blocks; b++) {
    if (type === GgmlType.Q4_K || type === GgmlType.Q5_K) {
      const o = b * (type === GgmlType.Q4_K ? 144 : 176);
      const top = type === GgmlType.Q4_K ? 15 : 31;
      const d = f16BitsToF32(w[o]! | (w[o + 1]! << 8)), dmin = f16BitsToF32(w[o + 2]! | (w[o + 3]! << 8));
      const s = o + 4;
      for (let j = 0; j < 8; j++) {
        const sc = j < 4 ? w[s + j]! & 63 : (w[s + j + 4]! & 15) | ((w[s + j - 4]! >>> 6) << 4);
        const mn = j < 4 ? w[s + j + 4]! & 63 : (w[s + j + 4]! >>> 4) | ((w[s + j]! >>> 6) << 4);
        for (let i = 0; i < 32; i++) out[b * 256 + 32 * j + i] = Math.abs(d) * sc * top + Math.abs(dmin) * mn;
      }
    } else {
      const o = b * 210;
      const d = f16BitsToF32(w[o + 208]! | (w[o + 209]! << 8));
      for (let g = 0; g < 16; g++) {
        const sc = (w[o + 192 + g]! << 24) >> 24;
        for (let i = 0; i < 16; i++) out[b * 256 + 16 * g + i] = Math.abs(d * sc) * (63 + 32);
      }
    }
  }
  return out;
}

/**
 * |kernel - exact product of the decoded weights and the f32 activations| for each output is at most
 *   sum_k |w_k| delta_k + (2 * blocks + 9) u sum_k T_k (|x_k| + delta_k)
 * delta_k: the activation's rounding to its super-block's 8-bit grid, d (1/2 + 255 u) with d = fl(amax / 127) (the
 *   quantized value is round(fl(x * fl(1/d))), |x / d| <= 127, so two roundings add at most 254 u to x / d);
 * T_k: termMagnitudes. Float error: per super-block and lane a conversion of the exact integer sum, one product of
 *   scales and one or two FMA (the chain over `blocks` super-blocks), then 3 additions across lanes, and the decoded
 *   reference weights themselves are rounded once to f32 (each <= u relative): at most (2 * blocks + 9) roundings on
 *   any term's path.
 */
function bounds(type: GgmlType, w: Uint8Array, decoded: Float32Array, x: Float32Array, m: number, k: number,
  n: number): Float64Array {
  const terms = termMagnitudes(type, w, n * k);
  const blocks = k / 256;
  const delta = new Float64Array(m * k);
  for (let r = 0; r < m; r++) {
    for (let b = 0; b < blocks; b++) {
      let amax = 0;
      for (let i = 0; i < 256; i++) amax = Math.max(amax, Math.abs(x[r * k + 256 * b + i]!));
      const d = Math.fround(amax / 127) * (0.5 + 255 * U);
      delta.fill(d, r * k + 256 * b, r * k + 256 * (b + 1));
    }
  }
  const out = new Float64Array(m * n);
  const c = (2 * blocks + 9) * U;
  for (let r = 0; r < m; r++) {
    for (let j = 0; j < n; j++) {
      let q = 0, f = 0;
      for (let i = 0; i < k; i++) {
        const dl = delta[r * k + i]!;
        q += Math.abs(decoded[j * k + i]!) * (1 + 2 * U) * dl;
        f += terms[j * k + i]! * (Math.abs(x[r * k + i]!) + dl);
      }
      out[r * n + j] = (q + c * f) * (1 + 1e-12);
    }
  }
  return out;
}

// [m, k, n]: decode rows, the 4-row blocking's tails, a row block of 16 and its tail, prefill-like; n odd and across
// tile boundaries (64 rows).
const SHAPES: [number, number, number][] = [
  [1, 256, 1], [1, 768, 129], [2, 512, 65], [3, 256, 33], [4, 256, 7], [5, 768, 63], [7, 1024, 31], [16, 256, 67],
  [17, 512, 65], [33, 256, 33], [70, 768, 129],
];

describe('native ops: K-quant integer-dot matmul', { skip: skipNative }, () => {
  for (const type of TYPES) {
    const name = ggmlTypeName(type);
    it(`${name}: every int8 variant within the derived bound of the exact product, 1 and 2 threads`, (t) => {
      const simd = intDotVariants(type);
      if (simd.length === 0) return t.skip(`no variant on this CPU multiplies ${name} with 8-bit activations`);
      const rand = seeded(700 + type);
      for (const [m, k, n] of SHAPES) {
        // Activations with outliers (a few large values per row), as real ones have, so super-blocks differ in scale.
        const x = randomArray(m * k, rand);
        for (let i = 0; i < x.length; i += 97) x[i] = x[i]! * 20;
        const w = quantize(type, randomArray(n * k, rand));
        const decoded = new Float32Array(n * k);
        dequantize(type, w, n * k, decoded);
        const exact = referenceMatmul(x, decoded, m, k, n);
        const bound = bounds(type, w, decoded, x, m, k, n);
        let first: Float32Array | undefined;
        for (const variant of simd) {
          for (const threads of [1, 2]) {
            const what = `${name} m=${m} k=${k} n=${n} ${variant} ${threads} thread(s)`;
            const y = guarded(m * n, NaN);
            native().ops.matmul(variant, type, w, x, m, k, n, y.view, threads);
            y.checkGuards(what);
            for (let i = 0; i < m * n; i++) {
              const err = Math.abs(y.view[i]! - exact[i]!);
              assert.ok(err <= bound[i]!, `${what}: output ${i} is ${y.view[i]}, exact ${exact[i]}, error ${err} > ${bound[i]}`);
            }
            // The SIMD variants do the same integer and float operations in the same order.
            if (first) assert.deepEqual(y.view, first, `${what}: differs from ${simd[0]}`);
            first ??= Float32Array.from(y.view);
          }
        }
      }
    });

    it(`${name}: CONDUIT_KQUANT_DOT=0 keeps the f32 kernel on decoded weights`, (t) => {
      const simd = intDotVariants(type);
      if (simd.length === 0) return t.skip(`no variant on this CPU multiplies ${name} with 8-bit activations`);
      // The kernel table is built once per process: ask a fresh one. Its results must then be as close to the
      // generic (f32) kernel's as the float kernels are to each other (native-ops' 1e-9), four orders of magnitude
      // below what 8-bit activations give (~1e-5).
      const script = `
        import { loadNativeAddon } from './src/kernels/native.ts';
        import { quantize } from './src/model/quant.ts';
        const addon = loadNativeAddon();
        const [k, n] = [512, 5];
        const w = quantize(${type}, Float32Array.from({ length: k * n }, (_, i) => Math.sin(i * 0.37)));
        const x = Float32Array.from({ length: k }, (_, i) => Math.cos(i) * 1.2345);
        const out = (variant) => { const y = new Float32Array(n); addon.ops.matmul(variant, ${type}, w, x, 1, k, n, y, 1); return Array.from(y); };
        const variants = ${JSON.stringify(simd)};
        console.log(JSON.stringify({ names: variants.map((v) => addon.kernelVariants(v).matmul_${name.toLowerCase()}),
          generic: out('generic'), results: variants.map(out) }));`;
      const run = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script], {
        env: { ...process.env, CONDUIT_KQUANT_DOT: '0' }, encoding: 'utf8',
      });
      assert.equal(run.status, 0, run.stderr);
      const { names, generic, results } = JSON.parse(run.stdout) as { names: string[]; generic: number[]; results: number[][] };
      names.forEach((kernel, i) => assert.ok(!['avx2_int8', 'avx512_vnni'].includes(kernel),
        `${simd[i]} still reports ${kernel}`));
      results.forEach((y, i) => assertClose(y, generic, 1e-9, `${simd[i]} with CONDUIT_KQUANT_DOT=0`));
    });

    it(`${name}: a row's outputs are the same bits alone or in any batch`, (t) => {
      const simd = intDotVariants(type);
      if (simd.length === 0) return t.skip(`no variant on this CPU multiplies ${name} with 8-bit activations`);
      const rand = seeded(800 + type);
      const m = 70, k = 512, n = 67;
      const w = quantize(type, randomArray(n * k, rand));
      const x = randomArray(m * k, rand);
      for (const variant of simd) {
        const all = new Float32Array(m * n);
        native().ops.matmul(variant, type, w, x, m, k, n, all, 2);
        for (const [first, count] of [[0, 1], [69, 1], [3, 2], [10, 3], [20, 4], [30, 5], [1, 16], [2, 17], [50, 20]]) {
          const part = new Float32Array(count! * n);
          native().ops.matmul(variant, type, w, x.subarray(first! * k, (first! + count!) * k), count!, k, n, part, 1);
          assert.deepEqual(part, all.subarray(first! * n, (first! + count!) * n),
            `${name} ${variant}: rows ${first}..${first! + count! - 1} alone differ from the batch of ${m}`);
        }
      }
    });
  }
});
