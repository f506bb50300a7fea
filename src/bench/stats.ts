// Latency distributions for load-test reports. Percentiles are nearest-rank (the smallest value with at least q of
// the data at or below it), the definition the simulator's summaries use, so a percentile is always a value that
// was measured, never an interpolation between two.

export interface Distribution {
  count: number;
  mean: number;
  min: number;
  p50: number;
  p90: number;
  p99: number;
  max: number;
}

/** Nearest-rank percentile of ascending values; NaN for no data. */
export function percentile(sortedValues: ArrayLike<number>, q: number): number {
  const n = sortedValues.length;
  if (n === 0) return NaN;
  const rank = Math.min(n, Math.max(1, Math.ceil(q * n)));
  return sortedValues[rank - 1]!;
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

/**
 * A fixed-width text table with a dashed rule under the header: the first `leftColumns` columns (labels, default 1)
 * left-aligned, the rest (numbers) right-aligned.
 */
export function formatTable(header: readonly string[], rows: readonly (readonly string[])[], leftColumns = 1): string {
  const widths = header.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? '').length)));
  const line = (cells: readonly string[]) => cells
    .map((cell, i) => (i < leftColumns ? cell.padEnd(widths[i]!) : cell.padStart(widths[i]!)))
    .join('  ').trimEnd();
  return [line(header), line(widths.map((w) => '-'.repeat(w))), ...rows.map(line)].join('\n');
}

/** A number for a table cell: fixed decimals, '-' when there is no value. */
export function cell(value: number | undefined, decimals = 2): string {
  return value === undefined || Number.isNaN(value) ? '-' : value.toFixed(decimals);
}
