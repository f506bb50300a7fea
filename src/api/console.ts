// The web console: GET /console (the cluster, live) and GET /console/requests/<id> (one request's waterfall), served
// by the gateway itself from files bundled with the package (assets/console/, and uPlot from its npm package), so it
// works offline with no other service. The pages are static; their data comes from two JSON routes the page polls:
//
//   GET /console/api/overview        workers, charts, SLO, the analyzer's finding, recent requests
//   GET /console/api/requests/<id>   one request's trace view (the /v1/requests/{id}/trace builders), its routing,
//                                    token times and decode steps, and the analyzer's diagnosis
//
// Polling rather than server-sent events: a browser's EventSource cannot send an Authorization header, and a poll
// every couple of seconds costs one small JSON answer. Access follows the trace rule: the pages and assets hold no
// data and need no key; with keys configured the JSON needs one, an admin key sees everything, and a tenant's key
// sees only its own requests (no workers, charts, SLO or analysis: those are server-wide, as /v1/slo is).

import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import type { IncomingMessage, ServerResponse } from 'node:http';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';
import { gzipSync } from 'node:zlib';
import type { EngineInfo } from '../engine/types.ts';
import type { EngineStats, WorkerMemory } from '../protocols/worker.ts';
import type { Diagnosis, RequestTrace, Telemetry, WindowAnalysis } from '../telemetry/index.ts';
import { round3 } from '../util/stats.ts';
import type { KeyStore, Tenant } from './auth.ts';
import { ConsoleSeries, type SeriesOptions } from './console-series.ts';
import { TraceNotFoundError } from './errors.ts';
import type { JsonReply } from './gateway.ts';

/** One worker as the console lists it: what the engine's workerStats() (or its stats(), unrouted) reports. */
export interface ConsoleWorkerSource {
  workerId: string;
  /** 'prefill' or 'decode' for a disaggregated engine's workers. */
  role?: string;
  stats: EngineStats;
  info?: EngineInfo;
}

export interface WebConsoleOptions {
  telemetry: Telemetry;
  keyStore: KeyStore;
  /** The workers serving now. */
  workers: () => ConsoleWorkerSource[];
  /** The body of GET /health: the server's state and readiness. */
  health: () => object;
  /** Recent requests listed on the overview. Default 50. */
  recentRequests?: number;
  series?: SeriesOptions;
}

/** Step batch sizes kept per worker for the overview's sparkline. */
const RECENT_BATCHES = 32;
/** Token write times sent per request page; a longer request's are thinned evenly. */
const MAX_TOKEN_TIMES = 4096;
/**
 * The window analysis (it classifies every slow trace in the SLO window) is reused for this long, on the engine clock
 * and on the real one both: a simulated clock at speed-up inf stands still between requests (a finding kept until it
 * moved 5 s would stay stale while it idles), one at a high speed-up moves a whole window in a few real seconds.
 */
const ANALYSIS_TTL_MS = 5000;

interface Asset {
  type: string;
  body: Buffer;
  gzip: Buffer;
  /** Validators for revalidation (a page loaded again costs a 304 per file, not the file), one per encoding. */
  etag: string;
  gzipEtag: string;
}

/** Whether an If-None-Match header names `etag` (a list, weak validators compared weakly, or `*`). */
export function etagMatches(header: string | undefined, etag: string): boolean {
  if (header === undefined) return false;
  const opaque = (tag: string) => tag.trim().replace(/^W\//, '');
  return header.split(',').some((tag) => tag.trim() === '*' || opaque(tag) === etag);
}

/** Whether an Accept-Encoding header accepts gzip: named (or `*`) with a quality above 0. */
export function acceptsGzip(header: string | undefined): boolean {
  if (header === undefined) return false;
  let gzip: number | undefined;
  let any: number | undefined;
  for (const part of header.split(',')) {
    const [name, ...params] = part.split(';').map((s) => s.trim().toLowerCase());
    const q = params.find((p) => p.startsWith('q='));
    const quality = q === undefined ? 1 : Number(q.slice(2));
    const value = Number.isFinite(quality) ? quality : 0;
    if (name === 'gzip' || name === 'x-gzip') gzip = value;
    else if (name === '*') any = value;
  }
  return (gzip ?? any ?? 0) > 0;
}

const ASSETS_DIR = fileURLToPath(new URL('../../assets/console/', import.meta.url));
const requireFromHere = createRequire(import.meta.url);

/** The files the console serves, by the name in its URL (/console/assets/<name>); nothing else is readable. */
const ASSET_FILES: Readonly<Record<string, { path: () => string; type: string }>> = {
  'index.html': { path: () => `${ASSETS_DIR}index.html`, type: 'text/html; charset=utf-8' },
  'console.css': { path: () => `${ASSETS_DIR}console.css`, type: 'text/css; charset=utf-8' },
  'console.js': { path: () => `${ASSETS_DIR}console.js`, type: 'text/javascript; charset=utf-8' },
  'waterfall-layout.js': { path: () => `${ASSETS_DIR}waterfall-layout.js`, type: 'text/javascript; charset=utf-8' },
  'uPlot.iife.min.js': { path: () => requireFromHere.resolve('uplot/dist/uPlot.iife.min.js'), type: 'text/javascript; charset=utf-8' },
  'uPlot.min.css': { path: () => requireFromHere.resolve('uplot/dist/uPlot.min.css'), type: 'text/css; charset=utf-8' },
};

/** Nothing the pages load may come from anywhere but this server (no CDN, no fonts, no beacons). */
const CONTENT_SECURITY_POLICY = "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
  + "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

export class WebConsole {
  private readonly series: ConsoleSeries;
  private readonly batches = new Map<string, number[]>();
  private readonly diagnoses = new WeakMap<RequestTrace, Diagnosis>();
  private readonly assets = new Map<string, Asset>();
  private analysisCache: { atMs: number; realAtMs: number; value: WindowAnalysis & { window_ms: number } } | undefined;
  private readonly unsubscribe: () => void;
  private readonly recentLimit: number;

  constructor(private readonly options: WebConsoleOptions) {
    this.series = new ConsoleSeries(options.series);
    this.recentLimit = options.recentRequests ?? 50;
    this.unsubscribe = options.telemetry.onTrace((trace) => this.onTrace(trace));
  }

  close(): void {
    this.unsubscribe();
  }

  private onTrace(trace: RequestTrace): void {
    this.series.record(trace);
    const decode = trace.decode;
    if (!decode?.worker) return;
    // Per step when the engine's steps were traced one by one, else the request's mean batch.
    const perStep = decode.batchSizes.filter((b) => !Number.isNaN(b));
    const sizes = perStep.length > 0 ? perStep.slice(-RECENT_BATCHES)
      : decode.batch ? [round3(decode.batch.seqsMean)] : [];
    if (sizes.length === 0) return;
    const ring = this.batches.get(decode.worker) ?? [];
    ring.push(...sizes);
    if (ring.length > RECENT_BATCHES) ring.splice(0, ring.length - RECENT_BATCHES);
    this.batches.set(decode.worker, ring);
  }

  private diagnosis(trace: RequestTrace): Diagnosis {
    let d = this.diagnoses.get(trace);
    if (!d) {
      d = this.options.telemetry.analyzer.classify(trace);
      this.diagnoses.set(trace, d);
    }
    return d;
  }

  private visible(trace: RequestTrace, caller: Tenant): boolean {
    return this.options.keyStore.isAdmin(caller) || trace.tenant === caller.name;
  }

  // ---- pages and assets ----

  /** GET /console, /console/requests/<id>: the one page shell; its script reads the path. */
  sendPage(req: IncomingMessage, res: ServerResponse): void {
    this.sendAsset(req, res, 'index.html');
  }

  /**
   * GET /console/assets/<name>: false when no such asset (the caller answers 404). Every answer carries the page's
   * Content-Security-Policy: the shell is an asset too (index.html), and must not be framed under that URL either.
   */
  sendAsset(req: IncomingMessage, res: ServerResponse, name: string): boolean {
    const asset = this.asset(name);
    if (!asset) return false;
    const gzip = acceptsGzip(req.headers['accept-encoding']);
    const etag = gzip ? asset.gzipEtag : asset.etag;
    const headers = {
      'Cache-Control': 'no-cache', Vary: 'Accept-Encoding', ETag: etag, 'Content-Security-Policy': CONTENT_SECURITY_POLICY,
    };
    if (etagMatches(req.headers['if-none-match'], etag)) {
      res.writeHead(304, headers);
      res.end();
      return true;
    }
    const body = gzip ? asset.gzip : asset.body;
    res.writeHead(200, {
      ...headers, 'Content-Type': asset.type, 'Content-Length': body.length, 'X-Content-Type-Options': 'nosniff',
      ...(gzip ? { 'Content-Encoding': 'gzip' } : {}),
    });
    res.end(body);
    return true;
  }

  /** An asset's bytes, read and compressed once. */
  asset(name: string): Asset | undefined {
    const file = Object.hasOwn(ASSET_FILES, name) ? ASSET_FILES[name] : undefined;
    if (!file) return undefined;
    let asset = this.assets.get(name);
    if (!asset) {
      const body = readFileSync(file.path());
      const tag = createHash('sha256').update(body).digest('base64url').slice(0, 22);
      asset = { type: file.type, body, gzip: gzipSync(body, { level: 9 }), etag: `"${tag}"`, gzipEtag: `"${tag}-gz"` };
      this.assets.set(name, asset);
    }
    return asset;
  }

  /** Bytes a browser loads for the overview page, raw and gzip-compressed (what the docs quote as its weight). */
  pageWeight(): { bytes: number; gzipBytes: number; files: Record<string, number> } {
    const files: Record<string, number> = {};
    let bytes = 0;
    let gzipBytes = 0;
    for (const name of Object.keys(ASSET_FILES)) {
      const asset = this.asset(name)!;
      files[name] = asset.body.length;
      bytes += asset.body.length;
      gzipBytes += asset.gzip.length;
    }
    return { bytes, gzipBytes, files };
  }

  // ---- JSON ----

  /** GET /console/api/overview */
  overview(caller: Tenant, nowMs = this.options.telemetry.now()): JsonReply {
    const telemetry = this.options.telemetry;
    const admin = this.options.keyStore.isAdmin(caller);
    const requests: object[] = [];
    for (const trace of telemetry.traces.recent()) {
      if (requests.length >= this.recentLimit) break;
      if (!this.visible(trace, caller)) continue;
      requests.push(this.requestRow(trace));
    }
    const body = {
      generated_at_ms: round3(nowMs),
      scope: admin ? 'all' : 'tenant',
      tenant: caller.name,
      requests,
      ...(admin ? {
        health: this.options.health(),
        in_flight: telemetry.inFlight,
        workers: this.workers(),
        series: this.series.view(nowMs),
        slo: telemetry.sloReport(nowMs),
        analysis: this.analysis(nowMs),
      } : {}),
    };
    return { status: 200, body };
  }

  private analysis(nowMs: number): WindowAnalysis & { window_ms: number } {
    const cached = this.analysisCache;
    const realNowMs = performance.now();
    if (cached && nowMs - cached.atMs < ANALYSIS_TTL_MS && nowMs >= cached.atMs && realNowMs - cached.realAtMs < ANALYSIS_TTL_MS) {
      return cached.value;
    }
    const value = this.options.telemetry.analysis(undefined, nowMs);
    this.analysisCache = { atMs: nowMs, realAtMs: realNowMs, value };
    return value;
  }

  private workers(): object[] {
    const listed = this.options.workers();
    const present = new Set(listed.map((w) => w.workerId));
    for (const id of this.batches.keys()) if (!present.has(id)) this.batches.delete(id);
    return listed.map(({ workerId, role, stats, info }) => {
      const blockSize = info?.blockSize;
      return {
        id: workerId,
        role: role ?? 'worker',
        state: stats.numRunning > 0 ? 'running' : stats.numWaiting > 0 ? 'waiting' : 'idle',
        running: stats.numRunning,
        waiting: stats.numWaiting,
        kv_used_blocks: stats.kvBlocksUsed,
        kv_total_blocks: stats.kvBlocksTotal,
        ...(blockSize !== undefined ? { block_size: blockSize } : {}),
        prefix_cache_queries: stats.prefixCacheQueries,
        prefix_cache_hit_rate: stats.prefixCacheQueries > 0 ? round3(stats.prefixCacheHits / stats.prefixCacheQueries) : null,
        preemptions: stats.preemptions,
        ...(stats.requestMigrations !== undefined ? { migrations_in: stats.requestMigrations } : {}),
        // The worker's memory by category (conduit_memory_used_bytes): measured on CPU workers, modelled on simulated ones.
        ...(stats.memory !== undefined ? { memory_bytes: memoryByCategory(stats.memory, stats) } : {}),
        recent_batch_sizes: this.batches.get(workerId) ?? [],
      };
    });
  }

  private requestRow(trace: RequestTrace): object {
    return {
      id: trace.requestId,
      tenant: trace.tenant ?? null,
      model: trace.model,
      // A request that named a LoRA adapter: the trace's model is the adapter's base model.
      lora_adapter: trace.adapter ?? null,
      worker: trace.worker ?? null,
      prompt_tokens: trace.promptTokens,
      cached_tokens: trace.cachedTokens,
      output_tokens: trace.outputTokens,
      ttft_ms: trace.ttftMs === undefined ? null : round3(trace.ttftMs),
      total_ms: round3(trace.e2eMs),
      outcome: trace.outcome,
      finish_reason: trace.finishReason,
      status: trace.status ?? null,
      ended_unix_ms: round3(trace.endMs),
      bottleneck: trace.outcome === 'ok' ? this.diagnosis(trace).category : null,
    };
  }

  /**
   * GET /console/api/requests/<id>: the trace view of GET /v1/requests/{id}/trace, plus what the waterfall draws
   * that the view summarises (the router's decision, each token's write time, each traced decode step). Another
   * tenant's request is a 404, as for an unknown id.
   */
  request(requestId: string, caller: Tenant): JsonReply {
    const telemetry = this.options.telemetry;
    const trace = telemetry.trace(requestId);
    const view = telemetry.traceView(requestId);
    if (!trace || !view || !this.visible(trace, caller)) throw new TraceNotFoundError(requestId, telemetry.traces.capacity);
    const at = (ms: number): number => round3(ms - trace.arrivalMs);
    const routing = trace.routing;
    const writes = trace.emits.contentTimesMs;
    const stride = Math.max(1, Math.ceil(writes.length / MAX_TOKEN_TIMES));
    const tokenTimes: number[] = [];
    for (let i = 0; i < writes.length; i += stride) tokenTimes.push(at(writes[i]!));
    const decode = trace.decode;
    const steps = decode && decode.source === 'engine_steps' && decode.stepStartsMs.length > 0 ? decode : undefined;
    return {
      status: 200,
      body: {
        ...view,
        total_ms: round3(trace.e2eMs),
        analysis: this.diagnosis(trace),
        routing: routing ? {
          start_ms: at(routing.startMs), duration_ms: round3(routing.endMs - routing.startMs),
          strategy: routing.strategy, worker: routing.worker, prefill_worker: routing.prefillWorker ?? null,
          candidates: routing.candidates ?? null, overlap_tokens: routing.overlapTokens ?? null,
          kv_cache_hit: routing.kvCacheHit ?? null, reason: routing.reason ?? null,
        } : null,
        token_times_ms: tokenTimes,
        token_times_stride: stride,
        decode_steps: steps ? {
          start_ms: steps.stepStartsMs.map(at),
          duration_ms: steps.stepMs.map(round3),
          batch_size: steps.batchSizes.map((b) => (Number.isNaN(b) ? null : b)),
        } : null,
      },
    };
  }
}

/** EngineStats.memory under the categories of conduit_memory_used_bytes (those the worker reports). */
function memoryByCategory(memory: WorkerMemory, stats: EngineStats): Record<string, number> {
  const ram = stats.kvTiers?.tiers.ram;
  return {
    weights: memory.weightsBytes,
    ...(memory.loraAdaptersBytes !== undefined ? { lora_adapters: memory.loraAdaptersBytes } : {}),
    kv_cache: memory.kvCacheBytes,
    ...(memory.activationsBytes !== undefined ? { activations: memory.activationsBytes } : {}),
    ...(ram !== undefined ? { kv_offload_ram: ram.usedBlocks * ram.blockBytes } : {}),
  };
}
