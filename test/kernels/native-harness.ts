// Shared pieces of the native kernel tests: the addon (or why it is missing), the variants this CPU runs, a seeded
// generator, the normalised error, and outputs with guard values around them to catch overruns.
import assert from 'node:assert/strict';

import {
  nativeUnavailableReason, supportedVariants, tryLoadNativeAddon, type KernelVariant, type NativeAddon,
} from '../../src/kernels/native.ts';
import { seededRandom } from '../../src/router/random.ts';

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
