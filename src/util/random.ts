// Every seeded random source of the code base, in one place. None is cryptographic; each is chosen for being
// small, fast in 32-bit integer arithmetic (Math.imul, >>>) and reproducible from a seed:
//   Xoshiro128        xoshiro128** (Blackman & Vigna), 128 bits of state, period 2^128 - 1: the sampler's streams
//                     (fromSeed: one per request seed and completion), the synthetic models' weights (fromSplitMix32)
//   seededRandom      mulberry32, 32 bits of state: the router's tie-breaking and policies, load generators, tests
//   mix32 / mixInto / hashString   stateless hashing: synthetic token ids, per-name seeds

import { randomInt } from 'node:crypto';

/** Uniform draw in [0, 1). */
export type RandomSource = () => number;

const TWO_POW_32 = 0x1_0000_0000;
const TWO_POW_26 = 0x400_0000;
const TWO_POW_53 = 2 ** 53;
/** Distinct nonzero word for the fourth state word, so the seeded state can never be all zero. */
const STATE_SALT = 0x5851f42d;
/** Outputs discarded after seeding: mixes seed words across the whole state before the first real draw. */
const WARM_UP_DRAWS = 8;

/** murmur3's 32-bit finaliser: a bijection on 32-bit words with good avalanche. */
export function mix32(word: number): number {
  let h = word >>> 0;
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  return h >>> 0;
}

/** Folds a word into a running 32-bit hash (then mix32), so neighbouring inputs give unrelated results. */
export function mixInto(hash: number, word: number): number {
  return mix32((hash ^ Math.imul(word >>> 0, 0x9e3779b1)) + 0x7f4a7c15);
}

/** FNV-1a of a string's UTF-16 code units, as an unsigned 32-bit integer. */
export function hashString(text: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) h = Math.imul(h ^ text.charCodeAt(i), 0x01000193);
  return h >>> 0;
}

function rotl(x: number, k: number): number {
  return (x << k) | (x >>> (32 - k));
}

/** The four state words splitmix32 gives from a 32-bit seed (never all zero). */
function splitMix32State(seed: number): [number, number, number, number] {
  let x = seed >>> 0;
  const next = (): number => {
    x = (x + 0x9e3779b9) >>> 0;
    let z = x;
    z = Math.imul(z ^ (z >>> 16), 0x85ebca6b);
    z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
    return (z ^ (z >>> 16)) >>> 0;
  };
  const state: [number, number, number, number] = [next(), next(), next(), next()];
  if ((state[0] | state[1] | state[2] | state[3]) === 0) state[0] = 1; // the all-zero state never leaves zero
  return state;
}

export class Xoshiro128 {
  private s0: number;
  private s1: number;
  private s2: number;
  private s3: number;

  /** Starts from an explicit state (e.g. one saved with `state()`); at least one word must be nonzero. */
  constructor(state: readonly [number, number, number, number]) {
    if (state.every((word) => (word >>> 0) === 0)) throw new RangeError('xoshiro128** state must not be all zero');
    this.s0 = state[0] | 0;
    this.s1 = state[1] | 0;
    this.s2 = state[2] | 0;
    this.s3 = state[3] | 0;
  }

  /**
   * Generator for one sequence. Each seed word goes through a bijection into its own state word, so distinct
   * (seed, stream) pairs always start from distinct states; the warm-up draws then spread them over all 128 bits.
   */
  static fromSeed(seed: number, stream = 0): Xoshiro128 {
    if (!Number.isSafeInteger(seed)) throw new RangeError(`seed must be a safe integer, got ${seed}`);
    if (!Number.isSafeInteger(stream) || stream < 0 || stream >= TWO_POW_32) {
      throw new RangeError(`stream must be an integer in [0, 2^32), got ${stream}`);
    }
    const seedLow = seed >>> 0;
    const seedHigh = Math.floor(seed / TWO_POW_32) >>> 0; // two's complement high word, also for negative seeds
    const rng = new Xoshiro128([mix32(seedLow), mix32(seedHigh), mix32(stream), mix32(STATE_SALT)]);
    for (let i = 0; i < WARM_UP_DRAWS; i++) rng.nextUint32();
    return rng;
  }

  /** xoshiro128** seeded through splitmix32, as the synthetic models' weights are drawn (no warm-up draws). */
  static fromSplitMix32(seed: number): Xoshiro128 {
    return new Xoshiro128(splitMix32State(seed));
  }

  /** Next 32-bit output as an unsigned integer. */
  nextUint32(): number {
    const result = Math.imul(rotl(Math.imul(this.s1, 5), 7), 9);
    const t = this.s1 << 9;
    this.s2 ^= this.s0;
    this.s3 ^= this.s1;
    this.s1 ^= this.s2;
    this.s0 ^= this.s3;
    this.s2 ^= t;
    this.s3 = rotl(this.s3, 11);
    return result >>> 0;
  }

  /** Uniform double in [0, 1) with 53 random bits (two draws), so no representable probability is skipped. */
  nextFloat(): number {
    const high27 = this.nextUint32() >>> 5;
    const low26 = this.nextUint32() >>> 6;
    return (high27 * TWO_POW_26 + low26) / TWO_POW_53;
  }

  /** Uniform double in [0, 1) from one draw (32 random bits). */
  nextFloat32Bits(): number {
    return this.nextUint32() / TWO_POW_32;
  }

  /** The current state, to save a sequence's stream (preemption, migration) and resume it with the constructor. */
  state(): [number, number, number, number] {
    return [this.s0 >>> 0, this.s1 >>> 0, this.s2 >>> 0, this.s3 >>> 0];
  }
}

/**
 * A fresh seed for a request that gave none. Drawn once per request (not per completion) so its n completions
 * still get distinct, reproducible-within-the-request streams from (seed, completion index).
 */
export function drawRandomSeed(): number {
  return randomInt(0, 2 ** 48 - 1);
}

/**
 * mulberry32: 32 bits of state, one multiply-xorshift round per draw. Routing and load generation need
 * independent-looking draws, not cryptographic ones, and this is small enough to read at a glance. A seed's bits
 * above 32 are hashed into the state (`seed >>> 0` alone made seeds 2^32 apart one stream); a seed below 2^32
 * starts from itself, as it always did (mix32(0) is 0).
 */
export function seededRandom(seed: number): RandomSource {
  if (!Number.isSafeInteger(seed)) throw new RangeError(`seed must be a safe integer, got ${seed}`);
  let state = ((seed >>> 0) ^ mix32(Math.floor(seed / TWO_POW_32))) >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / TWO_POW_32;
  };
}

/** Uniform integer in [0, n). */
export function randomIndex(random: RandomSource, n: number): number {
  const index = Math.floor(random() * n);
  // A source returning exactly 1 (not allowed, but cheap to tolerate) must not index past the end.
  return index < n ? index : n - 1;
}
