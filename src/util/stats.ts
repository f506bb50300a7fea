// Small numeric helpers: percentiles, means, rounding to microseconds, latency distributions. One percentile
// definition everywhere: nearest rank (the smallest value with at least q of the data at or below it), for load
// tests, the simulator, the SLO tracker, the analyzer, the trace sampler and each request's own timings alike, so a
// percentile is always a value that was measured and a tail cannot fall between ranks.

export function mean(values: readonly number[]): number {
  if (values.length === 0) return Number.NaN;
  let sum = 0;
  for (const v of values) sum += v;
  return sum / values.length;
}

export function max(values: readonly number[]): number {
  let m = Number.NEGATIVE_INFINITY;
  for (const v of values) if (v > m) m = v;
  return values.length === 0 ? Number.NaN : m;
}

/**
 * Rounds to three decimals: microseconds of a millisecond figure, enough for any latency, and it keeps JSON free of
 * float noise (also used for shares and ratios reported next to them).
 */
export function round3(x: number): number {
  return Math.round(x * 1000) / 1000;
}

/**
 * The nearest rank (1-based) of the q-quantile among n values: ceil(q * n), at least 1 and at most n. The one
 * definition of a latency percentile (load tests, the simulator, the SLO tracker, the analyzer): the smallest value
 * with at least q of the data at or below it, so a tail of fewer than (1 - q) * n samples can never be skipped.
 */
export function nearestRank(n: number, q: number): number {
  return Math.min(n, Math.max(1, Math.ceil(Math.min(1, Math.max(0, q)) * n)));
}

/** Nearest-rank percentile of ascending values; NaN for no data. */
export function percentile(sortedValues: ArrayLike<number>, q: number): number {
  const n = sortedValues.length;
  if (n === 0) return NaN;
  return sortedValues[nearestRank(n, q) - 1]!;
}

/** Nearest-rank percentile of values in any order (sorts a copy); NaN for no data. */
export function percentileOf(values: readonly number[], q: number): number {
  return percentile(Float64Array.from(values).sort(), q);
}

/** Count, mean, least, nearest-rank p50 / p90 / p99 and most of a sample. */
export interface Distribution {
  count: number;
  mean: number;
  min: number;
  p50: number;
  p90: number;
  p99: number;
  max: number;
}

export function distribution(values: readonly number[]): Distribution {
  // A typed array sorts numerically (Array.prototype.sort would compare the values as strings).
  const sorted = Float64Array.from(values).sort();
  let sum = 0;
  for (const value of sorted) sum += value;
  const n = sorted.length;
  return {
    count: n,
    mean: n > 0 ? sum / n : NaN,
    min: n > 0 ? sorted[0]! : NaN,
    p50: percentile(sorted, 0.5),
    p90: percentile(sorted, 0.9),
    p99: percentile(sorted, 0.99),
    max: n > 0 ? sorted[n - 1]! : NaN,
  };
}
