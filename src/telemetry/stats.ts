// Small numeric helpers shared by the trace builder, the analyzer and the benchmarks.

/**
 * The q-quantile (0..1) of values by linear interpolation between closest ranks (numpy's default), so p50 of
 * [1, 2, 3, 4] is 2.5. NaN for no values. Sorts a copy.
 */
export function quantile(values: readonly number[], q: number): number {
  if (values.length === 0) return Number.NaN;
  const sorted = Float64Array.from(values).sort();
  return quantileOfSorted(sorted, q);
}

export function quantileOfSorted(sorted: ArrayLike<number>, q: number): number {
  const n = sorted.length;
  if (n === 0) return Number.NaN;
  const clamped = Math.min(1, Math.max(0, q));
  const rank = clamped * (n - 1);
  const lo = Math.floor(rank);
  const hi = Math.min(n - 1, lo + 1);
  return sorted[lo]! + (sorted[hi]! - sorted[lo]!) * (rank - lo);
}

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

/** Rounds to microseconds: enough for a millisecond figure, and it keeps JSON free of float noise. */
export function roundMs(ms: number): number {
  return Math.round(ms * 1000) / 1000;
}
