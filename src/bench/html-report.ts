// `conduit bench --html report.html`: one self-contained HTML file (uPlot's script and stylesheet inlined, the run's
// data as JSON, no request to anywhere when opened) with the run's summary and its plots: TTFT and inter-token
// latency CDFs, output throughput over time, and where the time of a request went by phase (from the server's
// per-request `timings`, which Conduit sends; other servers' runs show the client-side plots only).

import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import type { RequestOutcome } from './client.ts';
import type { BenchResult } from './load-generator.ts';

/** Points a CDF is drawn with at most: enough for a smooth curve, few enough for a small file. */
const CDF_POINTS = 400;

/** Sorted values as a CDF: x = value, y = fraction of values at or below it (downsampled evenly by rank). */
export function cdf(values: readonly number[], maxPoints = CDF_POINTS): { x: number[]; y: number[] } {
  const sorted = Float64Array.from(values).sort();
  const n = sorted.length;
  const x: number[] = [];
  const y: number[] = [];
  if (n === 0) return { x, y };
  const step = Math.max(1, Math.ceil(n / maxPoints));
  for (let i = step - 1; i < n; i += step) {
    x.push(sorted[i]!);
    y.push((i + 1) / n);
  }
  if (x[x.length - 1] !== sorted[n - 1]) {
    x.push(sorted[n - 1]!);
    y.push(1);
  }
  return { x, y };
}

/**
 * Output tokens per second over the run, in `bucketSec` buckets from the first request's start: each streamed
 * request's tokens at the times they arrived (a request's tokens spread evenly over its content chunks), a
 * non-streamed request's at its end.
 */
export function throughputOverTime(requests: readonly RequestOutcome[], bucketSec = 1): { t: number[]; tokensPerSec: number[]; inFlight: number[] } {
  const ok = requests.filter((r) => r.ok);
  if (requests.length === 0) return { t: [], tokensPerSec: [], inFlight: [] };
  // A loop, not Math.min(...starts): spread as arguments, a run of some 125 000 requests overflows the stack.
  let start = Infinity;
  let end = -Infinity;
  for (const r of requests) {
    start = Math.min(start, r.startMs);
    end = Math.max(end, r.endMs);
  }
  const buckets = Math.max(1, Math.ceil((end - start) / (bucketSec * 1000)));
  const tokens = new Array<number>(buckets).fill(0);
  const inFlight = new Array<number>(buckets).fill(0);
  const bucketOf = (ms: number) => Math.min(buckets - 1, Math.max(0, Math.floor((ms - start) / (bucketSec * 1000))));
  for (const r of ok) {
    if (r.ttftMs === undefined) {
      tokens[bucketOf(r.endMs)]! += r.completionTokens;
      continue;
    }
    const chunks = 1 + r.itlMs.length;
    const perChunk = r.completionTokens / chunks;
    let at = r.startMs + r.ttftMs;
    tokens[bucketOf(at)]! += perChunk;
    for (const gap of r.itlMs) {
      at += gap;
      tokens[bucketOf(at)]! += perChunk;
    }
  }
  // Requests in flight at each bucket's middle.
  for (const r of requests) {
    for (let b = bucketOf(r.startMs); b <= bucketOf(r.endMs); b++) {
      const mid = start + (b + 0.5) * bucketSec * 1000;
      if (r.startMs <= mid && r.endMs > mid) inFlight[b]!++;
    }
  }
  return {
    t: tokens.map((_, i) => i * bucketSec),
    tokensPerSec: tokens.map((v) => Math.round((v / bucketSec) * 10) / 10),
    inFlight,
  };
}

/** The phases of the server's timings, in request order, with the label each gets. */
export const PHASES: readonly [key: string, label: string][] = [
  ['gateway_ms', 'gateway'], ['routing_ms', 'routing'], ['queue_ms', 'queue'], ['prefill_ms', 'prefill'],
  ['kv_transfer_ms', 'KV transfer'], ['decode_ms', 'decode'],
];

/** Mean milliseconds per phase over the successful requests that carried server timings, and how many did. */
export function phaseBreakdown(requests: readonly RequestOutcome[]): { requests: number; meanMs: Record<string, number> } | undefined {
  const timed = requests.filter((r) => r.ok && r.serverTimings !== undefined);
  if (timed.length === 0) return undefined;
  const meanMs: Record<string, number> = {};
  for (const [key] of PHASES) {
    const sum = timed.reduce((s, r) => s + (r.serverTimings![key] ?? 0), 0);
    meanMs[key] = Math.round((sum / timed.length) * 1000) / 1000;
  }
  return { requests: timed.length, meanMs };
}

/** JSON safe to put inside a <script> element: no "<" (so no "</script>"), and no line separators. */
function scriptJson(value: unknown): string {
  return JSON.stringify(value, (_k, v: unknown) => (typeof v === 'number' && !Number.isFinite(v) ? null : v))
    .replace(/</g, '\\u003c').replace(/\u2028/g, '\\u2028').replace(/\u2029/g, '\\u2029');
}

function escapeHtml(text: string): string {
  return text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

const requireFromHere = createRequire(import.meta.url);

/** The report as one HTML document. */
export function renderHtmlReport(result: BenchResult, text: string): string {
  const uplotJs = readFileSync(requireFromHere.resolve('uplot/dist/uPlot.iife.min.js'), 'utf8');
  const uplotCss = readFileSync(requireFromHere.resolve('uplot/dist/uPlot.min.css'), 'utf8');
  const ok = result.requests.filter((r) => r.ok);
  const data = {
    ttftCdf: cdf(ok.flatMap((r) => (r.ttftMs !== undefined ? [r.ttftMs] : []))),
    itlCdf: cdf(ok.flatMap((r) => r.itlMs)),
    tpotCdf: cdf(ok.flatMap((r) => {
      if (r.ttftMs === undefined || r.completionTokens < 2) return [];
      return [(r.e2eMs - r.ttftMs) / (r.completionTokens - 1)];
    })),
    throughput: throughputOverTime(result.requests),
    phases: phaseBreakdown(result.requests) ?? null,
    phaseLabels: PHASES,
  };
  if (uplotJs.includes('</script')) throw new Error('uPlot\'s script cannot be inlined as is');
  return `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>conduit bench: ${escapeHtml(result.model ?? result.url)} ${escapeHtml(result.startedAt)}</title>
<link rel="icon" href="data:,">
<style>${uplotCss}</style>
<style>
body { margin: 16px 24px 40px; font: 13px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; color: #1d232b; background: #fbfbfc; }
h1 { font-size: 18px; } h2 { font-size: 14px; margin: 22px 0 6px; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(440px, 1fr)); gap: 14px; }
.panel { background: #fff; border: 1px solid #e1e4e8; border-radius: 6px; padding: 10px 12px; overflow-x: auto; }
pre { font-size: 12px; margin: 0; }
.muted { color: #66707c; }
</style>
</head>
<body>
<h1>conduit bench</h1>
<div class="panel"><pre id="summary">${escapeHtml(text)}</pre></div>
<div class="grid">
  <div><h2>TTFT (CDF)</h2><div class="panel plot" id="plot-ttft"></div></div>
  <div><h2>Inter-token latency (CDF)</h2><div class="panel plot" id="plot-itl"></div></div>
  <div><h2>Output throughput over time</h2><div class="panel plot" id="plot-throughput"></div></div>
  <div><h2>Where a request's time went (server phases, mean)</h2><div class="panel" id="plot-phases"></div></div>
</div>
<script>${uplotJs}</script>
<script type="application/json" id="bench-data">${scriptJson(data)}</script>
<script>
"use strict";
(function () {
  var data = JSON.parse(document.getElementById('bench-data').textContent);
  function note(el, text) { var p = document.createElement('p'); p.className = 'muted'; p.textContent = text; el.appendChild(p); }
  function cdfPlot(id, series, unit) {
    var el = document.getElementById(id);
    var usable = series.filter(function (s) { return s.data.x.length > 0; });
    if (usable.length === 0) { note(el, 'No samples (streamed requests give TTFT and inter-token latency: run with --stream).'); return; }
    usable.forEach(function (s) {
      var opts = {
        width: Math.max(360, el.clientWidth - 26), height: 240,
        scales: { x: { time: false }, y: { range: [0, 1] } },
        axes: [{ label: unit }, { label: 'fraction of ' + s.what, size: 50 }],
        series: [{ label: unit, value: function (u, v) { return v == null ? '-' : v.toFixed(2); } },
          { label: s.label, stroke: s.color, width: 2, value: function (u, v) { return v == null ? '-' : (v * 100).toFixed(1) + '%'; } }],
      };
      new uPlot(opts, [s.data.x, s.data.y], el);
    });
  }
  cdfPlot('plot-ttft', [{ label: 'TTFT', what: 'requests', data: data.ttftCdf, color: '#2f6feb' }], 'ms');
  cdfPlot('plot-itl', [{ label: 'ITL', what: 'token gaps', data: data.itlCdf, color: '#2da44e' },
    { label: 'TPOT', what: 'requests', data: data.tpotCdf, color: '#8250df' }], 'ms');
  (function () {
    var el = document.getElementById('plot-throughput');
    var t = data.throughput;
    if (t.t.length === 0) { note(el, 'No requests.'); return; }
    new uPlot({
      width: Math.max(360, el.clientWidth - 26), height: 240,
      scales: { x: { time: false }, n: { auto: true } },
      axes: [{ label: 'seconds into the run' }, { label: 'output tokens/s', size: 60 }, { scale: 'n', side: 1, grid: { show: false }, label: 'requests in flight', size: 50 }],
      series: [{ label: 's' }, { label: 'output tokens/s', stroke: '#8250df', width: 2 }, { label: 'in flight', stroke: '#e5883b', width: 1.5, scale: 'n' }],
    }, [t.t, t.tokensPerSec, t.inFlight], el);
  })();
  (function () {
    var el = document.getElementById('plot-phases');
    var p = data.phases;
    if (!p) { note(el, 'The server sent no per-request timings (Conduit does), so there is no phase breakdown.'); return; }
    var colors = ['#8c96a5', '#8250df', '#e5883b', '#2f6feb', '#1b9aaa', '#2da44e'];
    var total = 0;
    data.phaseLabels.forEach(function (pl) { total += p.meanMs[pl[0]] || 0; });
    var ns = 'http://www.w3.org/2000/svg';
    var width = Math.max(360, el.clientWidth - 26);
    var svg = document.createElementNS(ns, 'svg');
    svg.setAttribute('id', 'phase-breakdown');
    svg.setAttribute('width', width);
    svg.setAttribute('height', 40 + data.phaseLabels.length * 20);
    var x = 0;
    data.phaseLabels.forEach(function (pl, i) {
      var ms = p.meanMs[pl[0]] || 0;
      var w = total > 0 ? (ms / total) * width : 0;
      var rect = document.createElementNS(ns, 'rect');
      rect.setAttribute('x', x); rect.setAttribute('y', 4); rect.setAttribute('width', Math.max(0, w)); rect.setAttribute('height', 22);
      rect.setAttribute('fill', colors[i % colors.length]);
      var title = document.createElementNS(ns, 'title');
      title.textContent = pl[1] + ': ' + ms.toFixed(2) + ' ms (' + (total > 0 ? (100 * ms / total).toFixed(1) : '0') + '%)';
      rect.appendChild(title);
      svg.appendChild(rect);
      x += w;
      var key = document.createElementNS(ns, 'rect');
      key.setAttribute('x', 0); key.setAttribute('y', 36 + i * 20); key.setAttribute('width', 12); key.setAttribute('height', 12);
      key.setAttribute('fill', colors[i % colors.length]);
      svg.appendChild(key);
      var label = document.createElementNS(ns, 'text');
      label.setAttribute('x', 18); label.setAttribute('y', 46 + i * 20); label.setAttribute('font-size', '12');
      label.textContent = pl[1] + ': ' + ms.toFixed(2) + ' ms' + (total > 0 ? ' (' + (100 * ms / total).toFixed(1) + '%)' : '');
      svg.appendChild(label);
    });
    el.appendChild(svg);
    note(el, 'Mean over ' + p.requests + ' requests, from the timings the server returned with each.');
  })();
  document.body.setAttribute('data-ready', 'true');
})();
</script>
</body>
</html>
`;
}
