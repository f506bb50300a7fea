// What observability costs per request and per token, at five levels:
//
//   none                      the lifecycle bus with no subscriber (publishers skip building events)
//   metrics only              the collector, Prometheus metrics, SLO tracker, trace store (no spans)
//   metrics + request spans   ...plus a summarised span tree for every request, batch-processed, exporter discards
//   full tracing              ...plus the engine's per-step events and a span per decode step and per streamed write
//   full tracing + OTLP       ...exported as OTLP/HTTP JSON to a local receiver (another process) that discards
//
//   node --import tsx benchmarks/telemetry.ts [--requests 300] [--reps 5]
//
// Each level drives `requests` synthetic requests through the same event sequence a gateway, router and engine
// emit (5 gateway phases, routing, one streamed write per token, the finish with engine timestamps), once with 16
// and once with 256 output tokens, and measures process CPU time (all threads: the OTLP exporter's serialisation
// counts; the receiver's work does not). Per-token cost is the slope between the two lengths, per-request cost the
// intercept, both less the "none" level's. Levels run interleaved, `reps` times, and the median is reported: this
// VM stalls in bursts, so only figures from one run are compared. Every request is traced (rate 1): the worst case;
// at a 1% head rate the span rows cost about 1% of their difference from "metrics only" (plus the tail's keepers).
//
// TTFT impact is the wall time of the telemetry work done before the first token is written (the events up to and
// including that write); everything else happens after the response or off the request path.

import { fork, type ChildProcess } from 'node:child_process';
import { ExportResultCode } from '@opentelemetry/core';
import type { ReadableSpan, SpanExporter } from '@opentelemetry/sdk-trace-node';
import { LifecycleBus, type EngineTimestamps } from '../src/telemetry/lifecycle.ts';
import { Telemetry } from '../src/telemetry/telemetry.ts';

function argument(name: string, fallback: number): number {
  const at = process.argv.indexOf(`--${name}`);
  const value = at >= 0 ? Number(process.argv[at + 1]) : fallback;
  if (!Number.isSafeInteger(value) || value < 1) throw new RangeError(`--${name} must be a positive integer`);
  return value;
}

const REQUESTS = argument('requests', 300);
const REPS = argument('reps', 5);
const SHORT = 16;
const LONG = 256;
/** Per-token time budgets the overhead is compared with. */
const BUDGETS = [
  // llama.cpp's C API on this machine's class of VM, 110M Q8_0, 16 streams: 732 tokens/s (peer-baseline.md).
  { label: 'CPU peer, 732 tok/s', usPerToken: 1e6 / 732 },
  // The observability design's reference: Llama 70B, TP=4, batch 128, ~34 ms per decode step.
  { label: '70B b=128, 34 ms/step', usPerToken: 34_000 / 128 },
];

// ---------------------------------------------------------------------------------------------------------------
// Levels

class DiscardingExporter implements SpanExporter {
  spans = 0;
  export(spans: ReadableSpan[], done: (result: { code: ExportResultCode }) => void): void {
    this.spans += spans.length;
    done({ code: ExportResultCode.SUCCESS });
  }
  shutdown(): Promise<void> {
    return Promise.resolve();
  }
}

interface Level {
  name: string;
  bus: LifecycleBus;
  engineSteps: boolean;
  /** Exports what is queued; resolves with an export error, if any. */
  flush(): Promise<Error | undefined>;
  close(): Promise<unknown>;
  /** Spans handed to the in-process exporter (the OTLP receiver counts its own). */
  spans(): number;
}

type LevelName = 'none' | 'metrics' | 'spans' | 'full' | 'otlp';
const LEVEL_NAMES: LevelName[] = ['none', 'metrics', 'spans', 'full', 'otlp'];
const TITLES: Record<LevelName, string> = {
  none: 'None (baseline)',
  metrics: 'Metrics only (Prometheus, SLO window, trace store)',
  spans: 'Metrics + request spans',
  full: 'Full tracing (per-step and per-write spans)',
  otlp: 'Full tracing + OTLP/HTTP export',
};

function makeLevel(name: LevelName, otlpUrl: string): Level {
  if (name === 'none') return { name, bus: new LifecycleBus(), engineSteps: false, flush: async () => undefined, close: async () => undefined, spans: () => 0 };
  const common = { now: () => 1_760_000_000_000, traceStoreCapacity: 1000 };
  if (name === 'metrics') {
    const t = new Telemetry({ ...common, tracing: false });
    return { name, bus: t.lifecycle, engineSteps: false, flush: () => t.flush(), close: () => t.shutdown(), spans: () => 0 };
  }
  if (name === 'otlp') {
    // The OTLP exporter reads its endpoint from process.env itself (Conduit hands it nothing that would override it).
    process.env.OTEL_EXPORTER_OTLP_ENDPOINT = otlpUrl;
    const t = new Telemetry({ ...common, env: { OTEL_EXPORTER_OTLP_ENDPOINT: otlpUrl }, sampling: { baseRate: 1 }, perTokenSpans: true });
    return { name, bus: t.lifecycle, engineSteps: true, flush: () => t.flush(), close: () => t.shutdown(), spans: () => 0 };
  }
  const exporter = new DiscardingExporter();
  const t = new Telemetry({ ...common, env: {}, exporters: [exporter], sampling: { baseRate: 1 }, perTokenSpans: name === 'full' });
  return { name, bus: t.lifecycle, engineSteps: name === 'full', flush: () => t.flush(), close: () => t.shutdown(), spans: () => exporter.spans };
}

// ---------------------------------------------------------------------------------------------------------------
// One request's events

let nextRequest = 0;

/** Emits one request's events as the shells would; returns the wall ms spent before the first token write. */
function driveRequest(bus: LifecycleBus, tokens: number, engineSteps: boolean): number {
  const id = `bench-${nextRequest++}`;
  const t0 = 1_760_000_000_000 + nextRequest * 1000;
  const before = performance.now();
  if (bus.active) {
    bus.emit({ phase: 'http_receive', requestId: id, start: t0, time: t0 + 0.1, route: '/v1/chat/completions', bodyBytes: 2048 });
    bus.emit({ phase: 'auth', requestId: id, start: t0 + 0.1, time: t0 + 0.11, ok: true, tenant: 'acme' });
    bus.emit({ phase: 'rate_limit', requestId: id, start: t0 + 0.11, time: t0 + 0.12, allowed: true, tenant: 'acme' });
    bus.emit({ phase: 'validate', requestId: id, start: t0 + 0.12, time: t0 + 0.14, ok: true, model: 'conduit-synthetic-22m', stream: true, maxTokens: tokens });
    bus.emit({ phase: 'tokenize', requestId: id, start: t0 + 0.14, time: t0 + 0.5, promptTokens: 512 });
    bus.emit({
      phase: 'router_lookup', requestId: id, start: t0 + 0.5, time: t0 + 0.6, worker: 'worker-0', strategy: 'kv_aware',
      kvCacheHit: true, overlapTokens: 256, candidates: 2, subPhasesMs: { hashing: 0.03, indexLookup: 0.04, selection: 0.03 },
    });
  }
  // The engine's own stamps exist whatever the telemetry level: they are part of every EngineOutput.
  const firstToken = t0 + 20;
  let t = firstToken;
  let preFirstToken = 0;
  for (let i = 0; i < tokens; i++) {
    if (i > 0) {
      t += 10;
      if (engineSteps && bus.active) {
        bus.emit({ phase: 'decode_execution', requestId: id, start: t - 9, time: t, step: i, batchSize: 8, batchTokens: 8, worker: 'worker-0' });
      }
    }
    if (bus.active) bus.emit({ phase: 'streaming_response', requestId: id, time: t + 0.2, tokens: 1, bytes: 140 });
    if (i === 0) preFirstToken = performance.now() - before;
  }
  // As the engine reports them on every output: its step batches, queue depth, budget and decode-step summary.
  const timestamps: EngineTimestamps = {
    arrival: t0, queued: t0 + 1, firstScheduled: t0 + 2,
    prefillChunks: [{ start: t0 + 2.1, end: firstToken, tokens: 256, batchSeqs: 8, batchTokens: 263 }],
    firstToken, lastToken: t, finished: t, queueDepthAtEntry: 0, budget: { tokens: 256, forwardStart: t0 + 2.1 },
    ...(tokens > 1 ? {
      decodeSteps: {
        steps: tokens - 1, forwardMs: 9 * (tokens - 1), batchSeqsSum: 8 * (tokens - 1), batchSeqsMin: 8, batchSeqsMax: 8,
        batchTokensSum: 8 * (tokens - 1), batchTokensMin: 8, batchTokensMax: 8,
      },
    } : {}),
  };
  if (bus.active) {
    bus.emit({
      phase: 'finish', requestId: id, time: t + 1, finishReason: 'length', promptTokens: 512, outputTokens: tokens, cachedTokens: 256, status: 200,
      engine: { worker: 'worker-0', timestamps, cachedTokens: 256, traceparent: `00-${'0'.repeat(31)}1-${'0'.repeat(15)}1-01` },
    });
  }
  return preFirstToken;
}

interface Measurement {
  spans: number;
  cpuUsPerRequest: number;
  wallUsPerRequest: number;
  preFirstTokenUs: number;
}

async function measure(level: Level, tokens: number, requests = REQUESTS): Promise<Measurement> {
  const spans0 = level.spans();
  const cpu0 = process.cpuUsage();
  const wall0 = performance.now();
  let pre = 0;
  for (let r = 0; r < requests; r++) {
    pre += driveRequest(level.bus, tokens, level.engineSteps);
    // Let the batch span processor run its export timers, as a server's event loop would between requests.
    if (r % 16 === 15) await new Promise<void>((resolve) => setImmediate(resolve));
    // Requests here arrive back to back, far faster than a server's; without a pause for the exports to drain, the
    // span queue overflows and the OTLP exporter refuses batches beyond its concurrency limit, and dropped spans
    // would make the export look cheaper than it is. Exported span counts are compared at the end.
    if (r % 64 === 63) {
      const error = await level.flush();
      if (error) throw new Error(`${level.name}: span export failed: ${error.message}`);
    }
  }
  const error = await level.flush();
  if (error) throw new Error(`${level.name}: span export failed: ${error.message}`);
  const cpu = process.cpuUsage(cpu0);
  return {
    spans: level.spans() - spans0,
    cpuUsPerRequest: (cpu.user + cpu.system) / requests,
    wallUsPerRequest: ((performance.now() - wall0) * 1000) / requests,
    preFirstTokenUs: (pre * 1000) / requests,
  };
}

// ---------------------------------------------------------------------------------------------------------------
// The OTLP receiver runs in its own process so its work is not counted.

async function startReceiver(): Promise<{ url: string; child: ChildProcess }> {
  const source = `
    const http = require('node:http');
    let bytes = 0, requests = 0, spans = 0;
    const server = http.createServer((req, res) => {
      const parts = [];
      req.on('data', (c) => { bytes += c.length; parts.push(c); });
      req.on('end', () => {
        requests++;
        for (const r of JSON.parse(Buffer.concat(parts).toString()).resourceSpans) for (const s of r.scopeSpans) spans += s.spans.length;
        res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
      });
    });
    server.listen(0, '127.0.0.1', () => process.send({ port: server.address().port }));
    process.on('message', (m) => { if (m === 'stats') process.send({ bytes, requests, spans }); if (m === 'stop') server.close(() => process.exit(0)); });
  `;
  const child = fork('-e', [source], { execArgv: [], stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
  // fork('-e') runs the script text through node's -e flag.
  const port = await new Promise<number>((resolve, reject) => {
    child.once('message', (m: { port: number }) => resolve(m.port));
    child.once('error', reject);
  });
  return { url: `http://127.0.0.1:${port}`, child };
}

async function receiverStats(child: ChildProcess): Promise<{ bytes: number; requests: number; spans: number }> {
  return new Promise((resolve) => {
    child.once('message', (m: { bytes: number; requests: number; spans: number }) => resolve(m));
    child.send('stats');
  });
}

// ---------------------------------------------------------------------------------------------------------------

function median(values: number[]): number {
  const s = [...values].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2]! : (s[s.length / 2 - 1]! + s[s.length / 2]!) / 2;
}

function noSubscriberEmitCost(): { guardedNs: number; unguardedNs: number } {
  const bus = new LifecycleBus();
  const n = 5_000_000;
  let sink = 0;
  let t0 = performance.now();
  for (let i = 0; i < n; i++) {
    if (bus.active) bus.emit({ phase: 'streaming_response', requestId: 'r', time: i, tokens: 1 });
    sink += i;
  }
  const guarded = performance.now() - t0;
  t0 = performance.now();
  for (let i = 0; i < n; i++) {
    bus.emit({ phase: 'streaming_response', requestId: 'r', time: i, tokens: 1 });
    sink += i;
  }
  const unguarded = performance.now() - t0;
  t0 = performance.now();
  for (let i = 0; i < n; i++) sink += i;
  const empty = performance.now() - t0;
  if (sink === -1) console.log(sink);
  return { guardedNs: (Math.max(0, guarded - empty) * 1e6) / n, unguardedNs: (Math.max(0, unguarded - empty) * 1e6) / n };
}

async function main(): Promise<void> {
  const receiver = await startReceiver();
  try {
    await run(receiver);
  } finally {
    receiver.child.send('stop');
  }
}

async function run(receiver: { url: string; child: ChildProcess }): Promise<void> {
  console.log(`telemetry overhead: ${REQUESTS} requests x {${SHORT}, ${LONG}} output tokens per level, ${REPS} interleaved reps, median`);
  console.log(`node ${process.version}, OTLP receiver at ${receiver.url} (separate process)\n`);

  // One telemetry instance per level for the whole run, as a server has one for its lifetime. Warm-up: every level
  // at both lengths, so JIT compilation and first-seen label sets are not measured.
  const levels = new Map(LEVEL_NAMES.map((name) => [name, makeLevel(name, receiver.url)] as const));
  for (const level of levels.values()) {
    for (const tokens of [SHORT, LONG]) await measure(level, tokens, 300);
  }

  const before = await receiverStats(receiver.child);
  const results = new Map<LevelName, { short: Measurement[]; long: Measurement[] }>();
  for (const name of LEVEL_NAMES) results.set(name, { short: [], long: [] });
  for (let rep = 0; rep < REPS; rep++) {
    for (const name of LEVEL_NAMES) {
      results.get(name)!.short.push(await measure(levels.get(name)!, SHORT));
      results.get(name)!.long.push(await measure(levels.get(name)!, LONG));
    }
  }
  const after = await receiverStats(receiver.child);
  for (const level of levels.values()) await level.close();

  const fit = (name: LevelName) => {
    const r = results.get(name)!;
    const short = median(r.short.map((m) => m.cpuUsPerRequest));
    const long = median(r.long.map((m) => m.cpuUsPerRequest));
    const perToken = (long - short) / (LONG - SHORT);
    return { perToken, perRequest: short - perToken * SHORT, pre: median(r.short.map((m) => m.preFirstTokenUs)) };
  };
  const base = fit('none');

  const header = ['Observability level', 'Per-token overhead (us)', 'Per-request overhead (us)', 'TTFT impact (ms)',
    ...BUDGETS.map((b) => `Throughput impact (${b.label})`)];
  console.log(`| ${header.join(' | ')} |`);
  console.log(`|${header.map(() => '---').join('|')}|`);
  for (const name of LEVEL_NAMES) {
    const f = fit(name);
    const perToken = name === 'none' ? 0 : f.perToken - base.perToken;
    const perRequest = name === 'none' ? 0 : f.perRequest - base.perRequest;
    const ttft = name === 'none' ? 0 : (f.pre - base.pre) / 1000;
    const row = [
      TITLES[name], perToken.toFixed(2), perRequest.toFixed(1), ttft.toFixed(4),
      ...BUDGETS.map((b) => `${((Math.max(0, perToken) / b.usPerToken) * 100).toFixed(2)}%`),
    ];
    console.log(`| ${row.join(' | ')} |`);
  }

  console.log(`\nCPU us per request (median of reps; min-max in brackets): ${SHORT} tokens | ${LONG} tokens`);
  for (const name of LEVEL_NAMES) {
    const r = results.get(name)!;
    const cell = (ms: Measurement[]) => {
      const v = ms.map((m) => m.cpuUsPerRequest);
      return `${median(v).toFixed(1)} [${Math.min(...v).toFixed(1)}-${Math.max(...v).toFixed(1)}]`;
    };
    console.log(`  ${name.padEnd(8)} ${cell(r.short).padStart(24)} | ${cell(r.long).padStart(26)}`);
  }
  const fullSpans = [...results.get('full')!.short, ...results.get('full')!.long].reduce((s, m) => s + m.spans, 0);
  console.log(`\nspans exported: full tracing ${fullSpans} in process; with OTLP the receiver parsed ${after.spans - before.spans} ` +
    `(${after.requests - before.requests} POSTs, ${((after.bytes - before.bytes) / 1e6).toFixed(1)} MB) for the same requests`);

  const emit = noSubscriberEmitCost();
  console.log(`no subscriber: ${emit.guardedNs.toFixed(2)} ns per guarded emit (if (bus.active) bus.emit(...)), ` +
    `${emit.unguardedNs.toFixed(2)} ns per unguarded emit (builds the event, calls emit)`);
  const reads = 1_000_000;
  const clock0 = performance.now();
  let acc = 0;
  for (let i = 0; i < reads; i++) acc += performance.timeOrigin + performance.now();
  if (acc === 0) console.log(acc);
  console.log(`engine clock read (timeOrigin + performance.now()): ${(((performance.now() - clock0) * 1e6) / reads).toFixed(1)} ns`);
}

await main();
