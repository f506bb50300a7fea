// OpenTelemetry adapter: a finished RequestTrace becomes a span tree, built after the fact with explicit start and
// end times, so the request path itself only stamps times. The tree:
//
//   request
//   ├─ gateway { http_receive, auth, rate_limit, validate, tokenize }
//   ├─ routing { kv_cache_lookup, load_balance }
//   ├─ prefill_dispatch
//   ├─ scheduling { queue_wait, budget_allocation }
//   ├─ prefill { kv_cache_alloc, model_forward_prefill (one per chunk), sampling_prefill }
//   ├─ kv_transfer                    (disaggregated only)
//   ├─ decode_dispatch
//   ├─ decode { decode_step ... }     (steps only with per-token spans; otherwise summarised on decode)
//   └─ token_emit                     (one span over the streamed writes; one per write with per-token spans)
//
// The engine's part (scheduling, prefill, kv_transfer, decode) goes under the span named by the traceparent the
// engine handed back with its outputs: the root span when the gateway passed its own context, another span of the
// same trace when something between them (a remote worker) put its own there.
//
// Span names follow the request/routing/scheduling/prefill/decode hierarchy of the observability design; each span
// also carries `conduit.phase` with the phase name used by events, metrics and timings, so the two join.
//
// Export is configured by the standard OTEL_* environment variables and is off unless they ask for it.

import {
  ROOT_CONTEXT, SpanKind, SpanStatusCode, TraceFlags, trace as otelTrace,
  type Attributes, type Context, type Span, type SpanContext, type Tracer,
} from '@opentelemetry/api';
import { ExportResultCode, millisToHrTime } from '@opentelemetry/core';
import { OTLPTraceExporter } from '@opentelemetry/exporter-trace-otlp-http';
import { resourceFromAttributes } from '@opentelemetry/resources';
import {
  AlwaysOnSampler, BatchSpanProcessor, ConsoleSpanExporter, NodeTracerProvider, SimpleSpanProcessor,
  type IdGenerator, type SpanExporter, type SpanProcessor,
} from '@opentelemetry/sdk-trace-node';
import { ATTR_SERVICE_NAME, ATTR_SERVICE_VERSION } from '@opentelemetry/semantic-conventions';
import { GATEWAY_PHASES } from './lifecycle.ts';
import { mean, quantileOfSorted } from '../util/stats.ts';
import { prefillSkipped, type RequestTrace } from './trace.ts';
import { parseTraceparent, randomSpanId, randomTraceId } from './traceparent.ts';

// ---------------------------------------------------------------------------------------------------------------
// Configuration from the environment

export type Env = Readonly<Record<string, string | undefined>>;

export interface TracingEnvConfig {
  exporters: ('otlp' | 'console')[];
  /** Full URL spans are POSTed to (OTLP/HTTP with JSON bodies). */
  otlpTracesUrl: string;
  headers: Record<string, string>;
  timeoutMs: number;
  serviceName: string;
  resourceAttributes: Record<string, string>;
  batch: { maxQueueSize: number; maxExportBatchSize: number; scheduledDelayMs: number; exportTimeoutMs: number };
  /** The head sampling rate, when OTEL_TRACES_SAMPLER asks for one. */
  sampleRate?: number;
  /** Things the environment asked for that this exporter does not do; reported once at start-up. */
  warnings: string[];
}

/** Parses "k1=v1,k2=v2" with percent-encoded values (OTEL_EXPORTER_OTLP_HEADERS, OTEL_RESOURCE_ATTRIBUTES). */
export function parseKeyValueList(value: string | undefined): Record<string, string> {
  const out: Record<string, string> = {};
  if (!value) return out;
  for (const part of value.split(',')) {
    const eq = part.indexOf('=');
    if (eq <= 0) continue;
    const key = part.slice(0, eq).trim();
    const raw = part.slice(eq + 1).trim();
    try {
      out[key] = decodeURIComponent(raw);
    } catch {
      out[key] = raw;
    }
  }
  return out;
}

function positiveNumber(value: string | undefined, fallback: number): number {
  if (value === undefined || value.trim() === '') return fallback;
  const n = Number(value);
  return Number.isFinite(n) && n > 0 ? n : fallback;
}

/**
 * Reads the OTEL_* variables the OpenTelemetry specification defines for trace export. Returns undefined (no
 * export) unless OTEL_TRACES_EXPORTER names an exporter or an OTLP endpoint is set, and always when
 * OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none.
 */
export function tracingConfigFromEnv(env: Env): TracingEnvConfig | undefined {
  if ((env.OTEL_SDK_DISABLED ?? '').trim().toLowerCase() === 'true') return undefined;
  const warnings: string[] = [];
  const tracesEndpoint = env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT?.trim();
  const baseEndpoint = env.OTEL_EXPORTER_OTLP_ENDPOINT?.trim();
  const names = (env.OTEL_TRACES_EXPORTER ?? '').split(',').map((s) => s.trim().toLowerCase()).filter(Boolean);
  let exporters: ('otlp' | 'console')[];
  if (names.length === 0) exporters = tracesEndpoint || baseEndpoint ? ['otlp'] : [];
  else if (names.includes('none')) exporters = [];
  else {
    exporters = [];
    for (const name of names) {
      if (name === 'otlp' || name === 'console') exporters.push(name);
      else warnings.push(`OTEL_TRACES_EXPORTER=${name} is not supported (otlp, console, none are)`);
    }
  }
  if (exporters.length === 0) return undefined;

  // Per the specification, the signal-specific endpoint is used as is; the base endpoint gets /v1/traces appended.
  const otlpTracesUrl = tracesEndpoint || (baseEndpoint ? `${baseEndpoint.replace(/\/+$/, '')}/v1/traces` : 'http://localhost:4318/v1/traces');
  const protocol = (env.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL ?? env.OTEL_EXPORTER_OTLP_PROTOCOL ?? '').trim();
  if (protocol === 'grpc') warnings.push('OTEL_EXPORTER_OTLP_PROTOCOL=grpc is not supported; exporting OTLP/HTTP with JSON bodies to the same endpoint');
  else if (protocol === 'http/protobuf') warnings.push('OTLP spans are sent as http/json (OTLP/HTTP receivers accept both encodings)');

  const resourceAttributes = parseKeyValueList(env.OTEL_RESOURCE_ATTRIBUTES);
  const serviceName = env.OTEL_SERVICE_NAME?.trim() || resourceAttributes[ATTR_SERVICE_NAME] || 'conduit';

  let sampleRate: number | undefined;
  const sampler = (env.OTEL_TRACES_SAMPLER ?? '').trim().toLowerCase();
  if (sampler === 'always_on' || sampler === 'parentbased_always_on') sampleRate = 1;
  else if (sampler === 'always_off' || sampler === 'parentbased_always_off') sampleRate = 0;
  else if (sampler === 'traceidratio' || sampler === 'parentbased_traceidratio') {
    const arg = Number(env.OTEL_TRACES_SAMPLER_ARG ?? '1');
    sampleRate = Number.isFinite(arg) && arg >= 0 && arg <= 1 ? arg : 1;
  } else if (sampler !== '') warnings.push(`OTEL_TRACES_SAMPLER=${sampler} is not supported; Conduit's adaptive sampler decides`);

  return {
    exporters,
    otlpTracesUrl,
    headers: parseKeyValueList(env.OTEL_EXPORTER_OTLP_TRACES_HEADERS ?? env.OTEL_EXPORTER_OTLP_HEADERS),
    timeoutMs: positiveNumber(env.OTEL_EXPORTER_OTLP_TRACES_TIMEOUT ?? env.OTEL_EXPORTER_OTLP_TIMEOUT, 10_000),
    serviceName,
    resourceAttributes,
    batch: {
      // The SDK's default queue of 2048 spans drops silently under load (a request is 10-20 spans); start larger.
      maxQueueSize: positiveNumber(env.OTEL_BSP_MAX_QUEUE_SIZE, 65_536),
      maxExportBatchSize: positiveNumber(env.OTEL_BSP_MAX_EXPORT_BATCH_SIZE, 2048),
      scheduledDelayMs: positiveNumber(env.OTEL_BSP_SCHEDULE_DELAY, 1000),
      exportTimeoutMs: positiveNumber(env.OTEL_BSP_EXPORT_TIMEOUT, 30_000),
    },
    ...(sampleRate !== undefined ? { sampleRate } : {}),
    warnings,
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Provider

/**
 * Trace and span ids chosen before the spans exist. A request's trace id and root span id are fixed at arrival
 * (so the gateway can hand out a traceparent and engines can log it), but its spans are created at the end; this
 * generator gives the SDK the reserved ids for the next root span and random ones otherwise.
 */
export class ReservedIdGenerator implements IdGenerator {
  private nextTraceId: string | undefined;
  private nextSpanId: string | undefined;

  /** The next span created takes these ids (traceId only matters when it has no parent). */
  reserve(traceId: string | undefined, spanId: string | undefined): void {
    this.nextTraceId = traceId;
    this.nextSpanId = spanId;
  }

  clear(): void {
    this.nextTraceId = undefined;
    this.nextSpanId = undefined;
  }

  generateTraceId(): string {
    const id = this.nextTraceId;
    this.nextTraceId = undefined;
    return id ?? randomTraceId();
  }

  generateSpanId(): string {
    const id = this.nextSpanId;
    this.nextSpanId = undefined;
    return id ?? randomSpanId();
  }
}

export interface TracingOptions {
  /** Exporters besides those the environment configures (tests pass an InMemorySpanExporter). */
  exporters?: SpanExporter[];
  /** 'simple' exports each span as it ends (tests); 'batch' queues them (production). Default: batch. */
  processor?: 'simple' | 'batch';
  env?: TracingEnvConfig;
  serviceName?: string;
  serviceVersion?: string;
}

export interface Tracing {
  readonly tracer: Tracer;
  readonly ids: ReservedIdGenerator;
  readonly provider: NodeTracerProvider;
  /** Spans handed to exporters, by outcome, since start. */
  readonly exported: ExportCounts;
  forceFlush(): Promise<void>;
  shutdown(): Promise<void>;
}

export interface ExportCounts {
  succeeded: number;
  failed: number;
}

/**
 * Counts what an exporter accepted and refused. A collector that is down, or more batches in flight than the
 * exporter allows, loses spans; the SDK only logs that, so the count is kept here for the metrics.
 */
class CountingExporter implements SpanExporter {
  constructor(private readonly inner: SpanExporter, private readonly counts: ExportCounts) {}

  export(spans: Parameters<SpanExporter['export']>[0], done: Parameters<SpanExporter['export']>[1]): void {
    this.inner.export(spans, (result) => {
      if (result.code === ExportResultCode.SUCCESS) this.counts.succeeded += spans.length;
      else this.counts.failed += spans.length;
      done(result);
    });
  }

  shutdown(): Promise<void> {
    return this.inner.shutdown();
  }

  forceFlush(): Promise<void> {
    return this.inner.forceFlush?.() ?? Promise.resolve();
  }
}

/**
 * A tracer provider of its own (not registered globally, so it neither depends on nor disturbs whatever else in
 * the process uses OpenTelemetry). Undefined when there is nowhere to send spans.
 */
export function createTracing(options: TracingOptions): Tracing | undefined {
  const env = options.env;
  const exporters: SpanExporter[] = [...(options.exporters ?? [])];
  const processors: SpanProcessor[] = [];
  const batched = options.processor !== 'simple';
  const exported: ExportCounts = { succeeded: 0, failed: 0 };
  const wrap = (inner: SpanExporter): SpanProcessor => {
    const exporter = new CountingExporter(inner, exported);
    return batched ? new BatchSpanProcessor(exporter, env ? {
      maxQueueSize: env.batch.maxQueueSize, maxExportBatchSize: env.batch.maxExportBatchSize,
      scheduledDelayMillis: env.batch.scheduledDelayMs, exportTimeoutMillis: env.batch.exportTimeoutMs,
    } : { maxQueueSize: 65_536, maxExportBatchSize: 2048 }) : new SimpleSpanProcessor(exporter);
  };
  for (const exporter of exporters) processors.push(wrap(exporter));
  if (env?.exporters.includes('otlp')) {
    // A flush sends every queued batch at once; the exporter refuses (and the flush fails) beyond its concurrency
    // limit, 30 by default, fewer than a full queue holds. Allow one request per batch a full queue makes.
    const concurrencyLimit = Math.ceil(env.batch.maxQueueSize / env.batch.maxExportBatchSize) + 2;
    processors.push(wrap(new OTLPTraceExporter({ url: env.otlpTracesUrl, headers: env.headers, timeoutMillis: env.timeoutMs, concurrencyLimit })));
  }
  if (env?.exporters.includes('console')) processors.push(new SimpleSpanProcessor(new CountingExporter(new ConsoleSpanExporter(), exported)));
  if (processors.length === 0) return undefined;

  const ids = new ReservedIdGenerator();
  const provider = new NodeTracerProvider({
    resource: resourceFromAttributes({
      ...(env?.resourceAttributes ?? {}),
      [ATTR_SERVICE_NAME]: options.serviceName ?? env?.serviceName ?? 'conduit',
      [ATTR_SERVICE_VERSION]: options.serviceVersion ?? '0.1.0',
    }),
    // Conduit's sampler has already decided by the time spans are built; the SDK must record what it is given.
    sampler: new AlwaysOnSampler(),
    idGenerator: ids,
    spanProcessors: processors,
  });
  return {
    tracer: provider.getTracer('conduit', options.serviceVersion ?? '0.1.0'),
    ids,
    provider,
    exported,
    forceFlush: () => provider.forceFlush(),
    shutdown: () => provider.shutdown(),
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Spans from a trace

/**
 * Where the engine's spans go: under the span the engine's traceparent names when that is a span of this trace
 * (the root, or one outside this tree), else under the root (no traceparent came back, or one of another trace).
 */
function engineParentContext(header: string | undefined, root: SpanContext, rootContext: Context): Context {
  const engine = parseTraceparent(header);
  if (!engine || engine.traceId !== root.traceId || engine.parentSpanId === root.spanId) return rootContext;
  return otelTrace.setSpanContext(ROOT_CONTEXT, {
    traceId: engine.traceId, spanId: engine.parentSpanId, isRemote: true,
    traceFlags: engine.sampled ? TraceFlags.SAMPLED : TraceFlags.NONE,
  });
}

export interface SpanOptions {
  /** One span per decode step and per streamed write instead of a summary on decode and token_emit. */
  perTokenSpans?: boolean;
  /** Why the request was kept (the tail sampling reason), recorded on the root span. */
  keptBecause?: string;
}

function hr(ms: number): [number, number] {
  return millisToHrTime(ms);
}

function clean(attrs: Record<string, string | number | boolean | undefined>): Attributes {
  const out: Attributes = {};
  for (const k in attrs) {
    const v = attrs[k];
    if (v === undefined || (typeof v === 'number' && !Number.isFinite(v))) continue;
    out[k] = v;
  }
  return out;
}

/** Sorted copy, for several quantiles of one array at the price of one sort. */
function sortedOf(values: readonly number[]): Float64Array {
  return Float64Array.from(values).sort();
}

function r3(ms: number): number {
  return Math.round(ms * 1000) / 1000;
}

/**
 * Builds and ends the span tree of one finished request. With `ids`, the root span takes the trace and span ids
 * reserved for the request at arrival. Returns the root span's context.
 */
export function emitRequestSpans(tracer: Tracer, trace: RequestTrace, options: SpanOptions = {}, ids?: ReservedIdGenerator): SpanContext {
  let parentContext: Context = ROOT_CONTEXT;
  if (trace.parent) {
    parentContext = otelTrace.setSpanContext(ROOT_CONTEXT, {
      traceId: trace.parent.traceId, spanId: trace.parent.parentSpanId, isRemote: true,
      traceFlags: trace.parent.sampled ? TraceFlags.SAMPLED : TraceFlags.NONE,
    });
  }
  const tbt = trace.tbtMs;
  const tbtSorted = sortedOf(tbt);
  const tbtP50 = quantileOfSorted(tbtSorted, 0.5);
  const tbtP99 = quantileOfSorted(tbtSorted, 0.99);
  const e2eSec = trace.e2eMs / 1000;
  const rootAttributes = clean({
    'conduit.phase': 'request',
    'request.id': trace.requestId,
    'request.model': trace.model,
    'request.tenant': trace.tenant,
    'request.worker': trace.worker,
    'request.prompt_tokens': trace.promptTokens,
    'request.output_tokens': trace.outputTokens,
    'request.cached_tokens': trace.cachedTokens,
    'request.max_output_tokens': trace.maxTokens,
    'request.temperature': trace.temperature,
    'request.stream': trace.stream,
    'request.n': trace.n,
    'request.ttft_ms': trace.ttftMs !== undefined ? r3(trace.ttftMs) : undefined,
    'request.ttft_source': trace.ttftSource,
    'request.total_time_ms': r3(trace.e2eMs),
    'request.tokens_per_sec': e2eSec > 0 ? r3(trace.outputTokens / e2eSec) : undefined,
    'request.tbt_p50_ms': r3(tbtP50),
    'request.tbt_p99_ms': r3(tbtP99),
    'request.finish_reason': trace.finishReason,
    'request.outcome': trace.outcome,
    'request.prefill_skipped': prefillSkipped(trace),
    'request.ended_in_phase': trace.endedInPhase,
    'request.rate_limited': trace.rateLimited,
    'conduit.sampling.head': trace.headSampling?.reason,
    'conduit.sampling.kept_because': options.keptBecause,
    'conduit.engine.traceparent': trace.engineTraceparent,
    // GenAI semantic conventions, for backends that build LLM views from them.
    'gen_ai.request.model': trace.model,
    'gen_ai.usage.input_tokens': trace.promptTokens,
    'gen_ai.usage.output_tokens': trace.outputTokens,
    'http.response.status_code': trace.status,
  });

  if (ids && trace.rootSpanId) ids.reserve(trace.parent ? undefined : trace.traceId, trace.rootSpanId);
  let root: Span;
  try {
    root = tracer.startSpan('request', { kind: SpanKind.SERVER, startTime: hr(trace.arrivalMs), attributes: rootAttributes }, parentContext);
  } finally {
    ids?.clear();
  }
  const rootContext = otelTrace.setSpan(ROOT_CONTEXT, root);
  const engineContext = engineParentContext(trace.engineTraceparent, root.spanContext(), rootContext);

  const span = (parentCtx: Context, name: string, startMs: number, endMs: number, attrs: Record<string, string | number | boolean | undefined>): Span => {
    const s = tracer.startSpan(name, { startTime: hr(startMs), attributes: clean(attrs) }, parentCtx);
    s.end(hr(Math.max(startMs, endMs)));
    return s;
  };
  /** A parent span whose children are added by `fill` before it ends. */
  const group = (parentCtx: Context, name: string, startMs: number, endMs: number, attrs: Record<string, string | number | boolean | undefined>,
    fill: (ctx: Context) => void): void => {
    const s = tracer.startSpan(name, { startTime: hr(startMs), attributes: clean(attrs) }, parentCtx);
    fill(otelTrace.setSpan(ROOT_CONTEXT, s));
    s.end(hr(Math.max(startMs, endMs)));
  };

  // Gateway.
  const gatewayPhases = trace.phases.filter((p) => (GATEWAY_PHASES as readonly string[]).includes(p.phase));
  if (gatewayPhases.length > 0) {
    const start = Math.min(...gatewayPhases.map((p) => p.startMs));
    const end = Math.max(...gatewayPhases.map((p) => p.endMs));
    group(rootContext, 'gateway', start, end, { 'conduit.phase': 'gateway', 'gateway.time_ms': r3(end - start) }, (ctx) => {
      for (const p of gatewayPhases) {
        const attrs: Record<string, string | number | boolean | undefined> = { 'conduit.phase': p.phase };
        for (const [k, v] of Object.entries(p.attributes ?? {})) attrs[`${p.phase}.${k}`] = v;
        span(ctx, p.phase, p.startMs, p.endMs, attrs);
      }
    });
  }

  // Routing.
  const routing = trace.routing;
  if (routing) {
    const sub = routing.subPhasesMs;
    group(rootContext, 'routing', routing.startMs, routing.endMs, {
      'conduit.phase': 'router_lookup',
      'routing.strategy': routing.strategy,
      'routing.candidates': routing.candidates,
      'routing.kv_cache_hit': routing.kvCacheHit,
      'routing.overlap_tokens': routing.overlapTokens,
      'routing.selected_worker': routing.worker,
      'routing.prefill_worker': routing.prefillWorker,
      'routing.selection_reason': routing.reason,
      'routing.worker_queue_depth': routing.workerQueueDepth,
      'routing.predicted_ttft_ms': routing.predictedTtftMs,
      'routing.latency_ms': r3(routing.endMs - routing.startMs),
      // Request migration: how often the request lost its worker mid-stream, and where it went each time.
      'routing.migrations': routing.migrations?.length,
      'routing.migration_path': routing.migrations
        ?.map((m) => `${m.fromWorker} -> ${m.toWorker ?? 'none'} after ${m.afterTokens} tokens`).join('; '),
    }, (ctx) => {
      if (!sub) return;
      let t = routing.startMs;
      const lookupMs = (sub.hashing ?? 0) + (sub.indexLookup ?? 0);
      if (sub.hashing !== undefined || sub.indexLookup !== undefined) {
        span(ctx, 'kv_cache_lookup', t, t + lookupMs, {
          'conduit.phase': 'router_lookup', 'routing.hashing_ms': sub.hashing, 'routing.index_lookup_ms': sub.indexLookup,
          'routing.overlap_tokens': routing.overlapTokens, 'routing.kv_cache_hit': routing.kvCacheHit,
        });
        t += lookupMs;
      }
      if (sub.selection !== undefined) {
        span(ctx, 'load_balance', t, t + sub.selection, {
          'conduit.phase': 'router_lookup', 'routing.selection_ms': sub.selection, 'routing.selected_worker': routing.worker,
          'routing.candidates': routing.candidates,
        });
      }
    });
  }

  for (const p of trace.phases) {
    if (p.phase === 'prefill_dispatch' || p.phase === 'decode_dispatch') {
      span(rootContext, p.phase, p.startMs, p.endMs, { 'conduit.phase': p.phase, 'dispatch.worker': p.worker });
    }
  }

  // Scheduling.
  const queue = trace.phases.find((p) => p.phase === 'scheduler_queue');
  if (queue) {
    const budgetMs = trace.budgetMs;
    const end = queue.endMs + (budgetMs ?? 0);
    group(engineContext, 'scheduling', queue.startMs, end, {
      'conduit.phase': 'scheduler_queue',
      'scheduling.request_id': trace.requestId,
      'scheduling.queue_depth_at_entry': trace.queueDepthAtEntry,
      'scheduling.queue_time_ms': r3(queue.endMs - queue.startMs),
      'scheduling.budget_ms': budgetMs !== undefined ? r3(budgetMs) : undefined,
      'scheduling.budget_tokens': trace.budgetTokens,
      'scheduling.worker': queue.worker,
      'scheduling.completed': queue.incomplete ? false : undefined,
    }, (ctx) => {
      span(ctx, 'queue_wait', queue.startMs, queue.endMs, {
        'conduit.phase': 'scheduler_queue', 'scheduling.queue_depth_at_entry': trace.queueDepthAtEntry,
      });
      if (budgetMs !== undefined) {
        span(ctx, 'budget_allocation', queue.endMs, end, {
          'conduit.phase': 'scheduler_queue', 'scheduling.budget_ms': r3(budgetMs), 'scheduling.budget_tokens': trace.budgetTokens,
        });
      }
    });
  }

  // Prefill.
  const prefill = trace.prefill;
  if (prefill) {
    const timeMs = prefill.endMs - prefill.startMs;
    group(engineContext, 'prefill', prefill.startMs, prefill.endMs, {
      'conduit.phase': 'prefill_execution',
      'prefill.prompt_tokens': trace.promptTokens,
      'prefill.cached_tokens': trace.cachedTokens,
      'prefill.new_tokens': Math.max(0, trace.promptTokens - trace.cachedTokens),
      'prefill.computed_tokens': prefill.computedTokens,
      'prefill.cache_hit_rate': r3(trace.cachedTokens / Math.max(1, trace.promptTokens)),
      'prefill.time_ms': r3(timeMs),
      'prefill.tokens_per_sec': timeMs > 0 ? r3(prefill.computedTokens / (timeMs / 1000)) : undefined,
      'prefill.chunks': prefill.chunks,
      'prefill.batch_size_max': prefill.batchSizeMax,
      'prefill.worker': prefill.worker,
    }, (ctx) => {
      if (prefill.kvAllocMs !== undefined) {
        span(ctx, 'kv_cache_alloc', prefill.startMs, prefill.startMs + prefill.kvAllocMs, { 'conduit.phase': 'prefill_execution' });
      }
      const chunks = trace.phases.filter((p) => p.phase === 'prefill_execution');
      chunks.forEach((c, i) => {
        const last = i === chunks.length - 1;
        const end = last && prefill.samplingMs !== undefined ? c.endMs - prefill.samplingMs : c.endMs;
        span(ctx, 'model_forward_prefill', c.startMs, end, {
          'conduit.phase': 'prefill_execution', 'prefill.chunk': i, 'prefill.chunk_tokens': c.attributes?.tokens as number | undefined,
          'prefill.batch_size': c.attributes?.batch_size as number | undefined,
          'prefill.batch_tokens': c.attributes?.batch_tokens as number | undefined, 'prefill.worker': c.worker,
        });
      });
      if (prefill.samplingMs !== undefined) {
        span(ctx, 'sampling_prefill', prefill.endMs - prefill.samplingMs, prefill.endMs, { 'conduit.phase': 'sampling' });
      }
    });
  }

  // KV transfer.
  const kv = trace.kvTransfer;
  if (kv) {
    const ms = kv.endMs - kv.startMs;
    span(engineContext, 'kv_transfer', kv.startMs, kv.endMs, {
      'conduit.phase': 'kv_transfer', 'kv_transfer.bytes': kv.bytes, 'kv_transfer.blocks': kv.blocks,
      'kv_transfer.from_worker': kv.fromWorker, 'kv_transfer.to_worker': kv.toWorker, 'kv_transfer.time_ms': r3(ms),
      'kv_transfer.bytes_per_sec': ms > 0 ? Math.round(kv.bytes / (ms / 1000)) : undefined,
    });
  }

  // Decode.
  const decode = trace.decode;
  if (decode) {
    const decodeSec = (decode.endMs - decode.startMs) / 1000;
    // In stream mode the steps are the TBT gaps themselves: reuse their sort.
    const stepSorted = decode.stepMs === tbt ? tbtSorted : sortedOf(decode.stepMs);
    const batch = decode.batch;
    group(engineContext, 'decode', decode.startMs, decode.endMs, {
      'conduit.phase': 'decode_execution',
      'decode.total_steps': decode.steps,
      'decode.step_source': decode.source,
      'decode.step_p50_ms': stepSorted.length > 0 ? r3(quantileOfSorted(stepSorted, 0.5)) : undefined,
      'decode.step_max_ms': stepSorted.length > 0 ? r3(stepSorted[stepSorted.length - 1]!) : undefined,
      'decode.avg_tbt_ms': tbt.length > 0 ? r3(mean(tbt)) : (decode.steps > 0 ? r3((decode.endMs - decode.startMs) / decode.steps) : undefined),
      'decode.p99_tbt_ms': tbt.length > 0 ? r3(tbtP99) : undefined,
      'decode.tokens_per_sec': decodeSec > 0 ? r3(decode.steps / decodeSec) : undefined,
      'decode.batch_size_min': batch?.seqsMin,
      'decode.batch_size_max': batch?.seqsMax,
      'decode.batch_size_mean': batch ? r3(batch.seqsMean) : undefined,
      'decode.batch_tokens_mean': batch ? r3(batch.tokensMean) : undefined,
      'decode.batch_tokens_max': batch?.tokensMax,
      'decode.forward_ms': batch ? r3(batch.forwardMs) : undefined,
      'decode.worker': decode.worker,
      'decode.completed': decode.incomplete ? false : undefined,
    }, (ctx) => {
      if (!options.perTokenSpans) return;
      for (let i = 0; i < decode.stepMs.length; i++) {
        const start = decode.stepStartsMs[i]!;
        // clean() drops the NaN of a step that reported no batch.
        span(ctx, 'decode_step', start, start + decode.stepMs[i]!, {
          'conduit.phase': 'decode_execution', 'decode.step': i + 1, 'decode.batch_size': decode.batchSizes[i],
          'decode.batch_tokens': decode.batchTokens[i],
        });
      }
    });
  }

  // Streamed writes.
  const emits = trace.emits;
  const times = emits.contentTimesMs;
  if (times.length > 0) {
    const first = times[0]!;
    const startMs = Math.min(first, emits.firstContentStartMs ?? first);
    if (options.perTokenSpans) {
      times.forEach((t, i) => {
        span(rootContext, 'token_emit', i === 0 ? startMs : t, t, { 'conduit.phase': 'streaming_response', 'emit.index': i });
      });
    } else {
      span(rootContext, 'token_emit', startMs, times[times.length - 1]!, {
        'conduit.phase': 'streaming_response', 'emit.writes': emits.writes, 'emit.content_writes': emits.contentWrites,
        'emit.bytes': emits.bytes > 0 ? emits.bytes : undefined, 'emit.first_write_ms': r3(first - trace.arrivalMs),
        'emit.first_token_handoff_ms': trace.engineFirstTokenMs !== undefined ? r3(first - trace.engineFirstTokenMs) : undefined,
      });
    }
  }

  // How it ended.
  if (trace.outcome === 'error') {
    const message = trace.errorMessage ?? trace.errorType ?? 'error';
    root.setStatus({ code: SpanStatusCode.ERROR, message });
    root.setAttribute('error.type', trace.errorType ?? 'error');
    root.recordException({ name: trace.errorType ?? 'error', message }, hr(trace.endMs));
  } else if (trace.outcome === 'abort') {
    root.setAttribute('request.aborted', true);
    if (trace.abortReason) root.setAttribute('request.abort_reason', trace.abortReason);
    root.addEvent('abort', clean({ reason: trace.abortReason, phase: trace.endedInPhase }), hr(trace.endMs));
  } else {
    root.setStatus({ code: SpanStatusCode.OK });
  }
  root.end(hr(trace.endMs));
  return root.spanContext();
}
