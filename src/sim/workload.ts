// Seeded synthetic workloads for the simulator: Poisson arrivals of fixed-length requests, optionally sharing a
// prompt prefix (a common system prompt). Deterministic from the seed, with the arrival process and the prompt
// contents drawn from separate streams, so changing the rate moves the arrivals but not the prompts.

import { Xoshiro128 } from '../util/random.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../engine/types.ts';

export interface PoissonWorkloadOptions {
  /** Mean arrivals per second. */
  ratePerSec: number;
  numRequests: number;
  /** Prompt tokens per request (input sequence length). */
  inputTokens: number;
  /** Output tokens per request (max_tokens; the simulated engine never stops earlier unless asked). */
  outputTokens: number;
  vocabSize: number;
  seed?: number;
  /** Leading prompt tokens every request shares (default 0). */
  sharedPrefixTokens?: number;
  /** Time of the first possible arrival (default 0). */
  startMs?: number;
  /** Request ids are `${idPrefix}${i}` (default "req-"). */
  idPrefix?: string;
}

/** Exponential gaps of mean 1 / rate: the arrivals of a Poisson process, in ms. */
export function poissonArrivalTimesMs(ratePerSec: number, count: number, seed = 1, startMs = 0): number[] {
  if (!(ratePerSec > 0) || !Number.isFinite(ratePerSec)) throw new RangeError(`ratePerSec must be finite and > 0, got ${ratePerSec}`);
  if (!Number.isSafeInteger(count) || count < 0) throw new RangeError(`count must be an integer >= 0, got ${count}`);
  const rng = Xoshiro128.fromSeed(seed, 0);
  const times: number[] = [];
  let t = startMs;
  for (let i = 0; i < count; i++) {
    // 1 - u is in (0, 1], so the logarithm is finite.
    t += (-Math.log(1 - rng.nextFloat()) / ratePerSec) * 1000;
    times.push(t);
  }
  return times;
}

export function poissonWorkload(opts: PoissonWorkloadOptions): EngineRequest[] {
  const { inputTokens, outputTokens, vocabSize } = opts;
  const shared = opts.sharedPrefixTokens ?? 0;
  for (const [name, value, min] of [['inputTokens', inputTokens, 1], ['outputTokens', outputTokens, 1],
    ['vocabSize', vocabSize, 2], ['sharedPrefixTokens', shared, 0]] as const) {
    if (!Number.isSafeInteger(value) || value < min) throw new RangeError(`${name} must be an integer >= ${min}, got ${value}`);
  }
  if (shared > inputTokens) throw new RangeError(`sharedPrefixTokens ${shared} exceeds inputTokens ${inputTokens}`);
  const seed = opts.seed ?? 1;
  const times = poissonArrivalTimesMs(opts.ratePerSec, opts.numRequests, seed, opts.startMs ?? 0);
  const promptRng = Xoshiro128.fromSeed(seed, 1);
  const draw = () => promptRng.nextUint32() % vocabSize;
  const prefix = Array.from({ length: shared }, draw);
  const idPrefix = opts.idPrefix ?? 'req-';
  return times.map((arrivalMs, i) => ({
    id: `${idPrefix}${i}`,
    promptTokenIds: [...prefix, ...Array.from({ length: inputTokens - shared }, draw)],
    sampling: { ...DEFAULT_SAMPLING, maxTokens: outputTokens, seed: i },
    priority: 0,
    arrivalMs,
  }));
}
