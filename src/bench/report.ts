// The bench report: a run's summary as text tables (p50/p90/p99 of TTFT, ITL and end-to-end latency, throughput,
// errors) or as JSON for scripts and for comparing runs.

import { ENDPOINT_PATHS, type BenchResult } from './load-generator.ts';
import { endpointUrl } from './client.ts';
import { cell, formatTable } from './tables.ts';
import { type Distribution } from '../util/stats.ts';

function modeText(result: BenchResult): string {
  const { mode, bounds } = result;
  const load = mode.kind === 'open'
    ? `${mode.burstiness === 1 ? 'Poisson arrivals' : `gamma arrivals (burstiness ${mode.burstiness})`} at ${mode.rate} req/s`
      + `${mode.maxInFlight !== undefined ? `, at most ${mode.maxInFlight} in flight` : ''}`
    : `${mode.concurrency} concurrent client${mode.concurrency === 1 ? '' : 's'}`;
  const limits = [
    ...(bounds.requests !== undefined ? [`${bounds.requests} requests`] : []),
    ...(bounds.durationSec !== undefined ? [`${bounds.durationSec} s`] : []),
  ].join(' or ');
  return `${load}, up to ${limits}`;
}

function latencyRow(name: string, d: Distribution): string[] {
  return [name, String(d.count), cell(d.mean), cell(d.p50), cell(d.p90), cell(d.p99), cell(d.max)];
}

export function formatReport(result: BenchResult): string {
  const s = result.summary;
  const lines = [
    // The URL the requests went to: --url with a last /v1 (an OpenAI client's base URL) gives it once, not twice.
    `conduit bench: ${endpointUrl(result.url, ENDPOINT_PATHS[result.endpoint])}`
      + `${result.stream ? ' (stream)' : ''}, model ${result.model ?? '(server default)'}`,
    `  load      ${modeText(result)}`,
    `  workload  ${result.workload}, max_tokens ${result.outputTokens}${result.seed !== undefined ? `, seed ${result.seed}` : ''}`,
    `  started   ${result.startedAt}`,
    '',
    formatTable(
      ['requests', 'ok', 'errors', 'duration s', 'req/s', 'output tok/s', 'input tok/s', 'prompt tok', 'cached prompt'],
      [[
        String(s.numRequests), String(s.numOk), String(s.numErrors), cell(s.durationSec), cell(s.requestsPerSec),
        cell(s.outputTokensPerSec, 1), cell(s.inputTokensPerSec, 1), cell(s.meanPromptTokens, 0),
        s.cachedPromptFraction === undefined ? '-' : `${(s.cachedPromptFraction * 100).toFixed(1)}%`,
      ]],
      0,
    ),
    '',
    formatTable(['latency ms', 'count', 'mean', 'p50', 'p90', 'p99', 'max'], [
      ...(result.stream ? [latencyRow('TTFT', s.ttftMs), latencyRow('TPOT', s.tpotMs), latencyRow('ITL', s.itlMs)] : []),
      latencyRow('end-to-end', s.e2eMs),
    ]),
  ];
  if (!result.stream) lines.push('(not streamed: no TTFT, TPOT or ITL; run with --stream for them)');
  if (s.goodput) {
    const t = s.goodput.targets;
    const targets = [
      ...(t.ttftMs !== undefined ? [`TTFT <= ${t.ttftMs} ms`] : []), ...(t.tpotMs !== undefined ? [`TPOT <= ${t.tpotMs} ms`] : []),
      ...(t.e2elMs !== undefined ? [`end-to-end <= ${t.e2elMs} ms`] : []),
    ].join(', ');
    lines.push('', `goodput   ${cell(s.goodput.requestsPerSec)} req/s: ${s.goodput.numGood} of ${s.numRequests} requests met ${targets}`);
  }
  if (s.numDelayedArrivals > 0) {
    lines.push(`${s.numDelayedArrivals} arrivals waited for a free slot (in-flight cap reached): the offered rate was not fully applied`);
  }
  const errors = Object.entries(s.errors).sort((a, b) => b[1] - a[1]);
  if (errors.length > 0) {
    lines.push('', formatTable(['error', 'count'], errors.map(([kind, count]) => [kind, String(count)])));
  }
  return lines.join('\n');
}

/** The report as JSON; per-request outcomes only when asked (they are large). */
export function reportJson(result: BenchResult, options: { includeRequests?: boolean } = {}): string {
  const { requests, ...rest } = result;
  return JSON.stringify(options.includeRequests ? { ...rest, requests } : rest, (_key, value: unknown) =>
    // NaN (an empty distribution) is not JSON; null says "no value" the same way.
    (typeof value === 'number' && Number.isNaN(value) ? null : value), 2);
}
