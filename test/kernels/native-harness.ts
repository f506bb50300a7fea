// Shared pieces of the native kernel tests: the addon (or why it is missing), the variants this CPU runs, a seeded
// generator, the normalised error and the bounds of kernels that round their inputs, and outputs with guard values
// around them to catch overruns.
import assert from 'node:assert/strict';

import {
  nativeUnavailableReason, supportedVariants, tryLoadNativeAddon, type KernelVariant, type NativeAddon,
} from '../../src/kernels/native.ts';
import { seededRandom } from '../../src/util/random.ts';

export const addon: NativeAddon | undefined = tryLoadNativeAddon();

/** node:test `skip` option: a message when the addon is not built. */
export const skipNative: string | false = addon ? false : `native addon not built: ${nativeUnavailableReason()}`;

export function native(): NativeAddon {
  assert.ok(addon, 'native addon not built');
  return addon;
}

/** Every variant this CPU supports, lowest (generic) first. */
export const variants: KernelVariant[] = addon ? supportedVariants(addon.cpuInfo()) : [];

/** Deterministic uniform [0, 1) generator (mulberry32). */
export const seeded = seededRandom;

/** n values uniform in [-scale, scale). */
export function randomArray(n: number, rand: () => number, scale = 1): Float32Array {
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) out[i] = (rand() * 2 - 1) * scale;
  return out;
}

/** Normalised mean squared error: sum (a - e)^2 / sum e^2 (0 when both are all zero). */
export function nmse(actual: ArrayLike<number>, expected: ArrayLike<number>): number {
  assert.equal(actual.length, expected.length, 'length mismatch');
  let err = 0;
  let ref = 0;
  for (let i = 0; i < expected.length; i++) {
    const d = actual[i]! - expected[i]!;
    err += d * d;
    ref += expected[i]! * expected[i]!;
  }
  if (!Number.isFinite(err)) return Infinity;
  return ref === 0 ? err : err / ref;
}

export function assertClose(actual: ArrayLike<number>, expected: ArrayLike<number>, bound: number, what: string): void {
  const e = nmse(actual, expected);
  assert.ok(e <= bound, `${what}: NMSE ${e.toExponential(2)} exceeds ${bound.toExponential(0)}`);
}

/** y = x . w^T (x [m x k], w [n x k]) in double precision: the exact product the kernels are measured against. */
export function referenceMatmul(x: Float32Array, w: Float32Array, m: number, k: number, n: number): Float64Array {
  const y = new Float64Array(m * n);
  for (let r = 0; r < m; r++) {
    for (let j = 0; j < n; j++) {
      let s = 0;
      for (let i = 0; i < k; i++) s += x[r * k + i]! * w[j * k + i]!;
      y[r * n + j] = s;
    }
  }
  return y;
}

// ---------------------------------------------------------------------------------------------------------------
// Error bounds of kernels that round their inputs

/** Whether `variant` multiplies BF16 weights with VDPBF16PS, rounding the activations to bf16 (kernel avx512_bf16). */
export function roundsBf16Activations(variant: KernelVariant): boolean {
  return native().kernelVariants(variant).matmul_bf16 === 'avx512_bf16';
}

/**
 * NMSE bound of y = x . w^T (x [m x k], w [n x k]) against the exact product `exact` when x is rounded to bf16
 * before multiplying, as VDPBF16PS kernels do; the rest (exact products, f32 sums) is as accurate as the f32
 * kernels. Derivation: rounding to nearest with 8 significant bits moves each x_k by x_k d_k with |d_k| <= 2^-8, so
 * an output's error is sum_k w_k x_k d_k. With the d_k independent and of mean 0 (round to nearest on values
 * unrelated to the bf16 grid), its expected square is sum_k (w_k x_k)^2 E[d_k^2] <= 2^-16 sum_k (w_k x_k)^2. The
 * bound is that expectation over all outputs divided by sum y^2, times 4: E[d^2] <= 2^-16 is itself the worst case
 * (an error spread evenly over half an ulp gives about a seventh of it), and the factor leaves room for a single
 * output's error to exceed its expectation (a shape with one output has no others to average with).
 */
export function bf16ActivationBound(x: Float32Array, w: Float32Array, m: number, k: number, n: number,
  exact: ArrayLike<number>): number {
  let expectedError = 0;
  let energy = 0;
  for (let r = 0; r < m; r++) {
    for (let j = 0; j < n; j++) {
      for (let i = 0; i < k; i++) expectedError += (x[r * k + i]! * w[j * k + i]!) ** 2;
      energy += exact[r * n + j]! ** 2;
    }
  }
  return energy === 0 ? 0 : (4 * 2 ** -16 * expectedError) / energy;
}

/**
 * The NMSE bound between two results, each within its own bound of the same exact values (triangle inequality; to
 * first order, which is all there is when one bound is as small as a float kernel's).
 */
export function combinedBound(a: number, b: number): number {
  return (Math.sqrt(a) + Math.sqrt(b)) ** 2;
}

const GUARD = 64;
const GUARD_VALUE = Math.fround(-7.25e31); // stored exactly in a Float32Array

/** A Float32Array of n elements inside a larger buffer whose surrounding guard values must stay untouched. */
export function guarded(n: number, fill = 0): { view: Float32Array; checkGuards(what: string): void } {
  const backing = new Float32Array(n + 2 * GUARD).fill(GUARD_VALUE);
  const view = backing.subarray(GUARD, GUARD + n);
  view.fill(fill);
  return {
    view,
    checkGuards(what: string) {
      for (let i = 0; i < GUARD; i++) {
        assert.equal(backing[i], GUARD_VALUE, `${what}: wrote before the output (guard ${GUARD - i})`);
        assert.equal(backing[GUARD + n + i], GUARD_VALUE, `${what}: wrote past the output (guard ${i})`);
      }
    },
  };
}
