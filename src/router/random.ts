// The router's only source of randomness (tie-breaking, softmax sampling, random and power-of-two policies) is
// injected, so a test or a replayed trace with the same seed makes the same decisions.

/** Uniform draw in [0, 1). */
export type RandomSource = () => number;

/**
 * mulberry32: 32 bits of state, one multiply-xorshift round per draw. Routing needs independent-looking draws,
 * not cryptographic ones, and this is small enough to read at a glance.
 */
export function seededRandom(seed: number): RandomSource {
  if (!Number.isSafeInteger(seed)) throw new RangeError(`seed must be a safe integer, got ${seed}`);
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 0x1_0000_0000;
  };
}

/** Uniform integer in [0, n). */
export function randomIndex(random: RandomSource, n: number): number {
  const index = Math.floor(random() * n);
  // A source returning exactly 1 (not allowed, but cheap to tolerate) must not index past the end.
  return index < n ? index : n - 1;
}
