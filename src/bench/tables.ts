// Text tables for load-test reports; their latency distributions are src/util/stats.ts's (nearest-rank percentiles).

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
