// The telemetry layer assembled: a lifecycle bus, the collector that subscribes to it and keeps one RequestRecord
// per request in flight, and what a finished request's RequestTrace feeds: Prometheus metrics, the SLO tracker,
// the store of recent traces, the bottleneck counter, and (when sampled) OpenTelemetry spans.
//
//   gateway / router / engine shells --emit--> LifecycleBus --> collector --(request ends)--> RequestTrace
//                                                                  |-> metrics, SLO tracker, trace store, analyzer
//                                                                  '-> tail sampler --(kept)--> spans --> exporter
//
// Memory is bounded: in-flight records are capped in number and age (a request whose end event never comes is
// dropped and counted), the trace store is a ring, the SLO windows and the sampler's quantile are fixed-size.

import type { Registry } from 'prom-client';
import type { SpanExporter } from '@opentelemetry/sdk-trace-node';
import { TraceAnalyzer, type AnalyzerThresholds, type WindowAnalysis } from './analyzer.ts';
import { LifecycleBus, type EngineReport, type LifecycleEvent } from './lifecycle.ts';
import { ConduitMetrics, type WorkerStatsSnapshot } from './metrics.ts';
import { samplerFromEnv, tracingConfigFromEnv, type Env } from './otel-env.ts';
import { createTracing, type Tracing } from './otel-provider.ts';
import { emitRequestSpans } from './otel-spans.ts';
import { TraceSampler, type TraceSamplingConfig } from './sampling.ts';
import { SloTracker, type SloConfig, type SloReport } from './slo.ts';
import { formatWaterfall, responseTimings, TraceStore, traceView, type ResponseTimings, type TraceView, type WaterfallOptions } from './timings.ts';
import { buildRequestTrace, RequestRecord, type RequestTrace, type SamplingDecision } from './trace.ts';
import { formatTraceparent, parseTraceparent, randomSpanId, randomTraceId } from './traceparent.ts';

export interface TelemetryOptions {
  /** The engine clock (epoch ms with fractions). Default: performance.timeOrigin + performance.now(). */
  now?: () => number;
  /**
   * Where the OTEL_* settings otel-env.ts reads come from (whether to export, batching, sampling). Default:
   * process.env. The OTLP exporter and the resource read theirs from process.env.
   */
  env?: Env;
  /** false: never build spans, whatever the environment says. */
  tracing?: boolean;
  /** Span exporters besides those the environment configures (an InMemorySpanExporter in tests). */
  exporters?: SpanExporter[];
  /** How spans reach exporters: 'batch' (default) or 'simple' (each span as it ends). */
  processor?: 'simple' | 'batch';
  /** A span per decode step and per streamed write instead of summaries. */
  perTokenSpans?: boolean;
  serviceName?: string;
  sampling?: Partial<TraceSamplingConfig>;
  /** The sampler's randomness, uniform on [0, 1). Default: Math.random. */
  random?: () => number;
  slo?: Partial<SloConfig>;
  analyzer?: Partial<AnalyzerThresholds>;
  /** Finished traces kept for GET /v1/requests/{id}/trace. Default 1000. */
  traceStoreCapacity?: number;
  /** Requests tracked in flight at once. Default 10 000. */
  maxInFlight?: number;
  /** A request with no end event after this long is dropped. Default 10 minutes. */
  inFlightTtlMs?: number;
  registry?: Registry;
}

export type TraceListener = (trace: RequestTrace, kept: SamplingDecision | undefined) => void;

function defaultNow(): number {
  return performance.timeOrigin + performance.now();
}

export class Telemetry {
  readonly lifecycle = new LifecycleBus();
  readonly metrics: ConduitMetrics;
  readonly traces: TraceStore;
  readonly slo: SloTracker;
  readonly analyzer: TraceAnalyzer;
  readonly sampler: TraceSampler;
  readonly tracing: Tracing | undefined;
  /** Configuration problems found at start-up (unsupported OTEL_* values), for the start-up log. */
  readonly warnings: readonly string[];
  readonly now: () => number;

  private readonly records = new Map<string, RequestRecord>();
  private readonly traceListeners: TraceListener[] = [];
  /** One decode_step span per engine step (else decode steps are summarised on the decode span). */
  readonly perTokenSpans: boolean;
  private readonly maxInFlight: number;
  private readonly inFlightTtlMs: number;
  private readonly unsubscribe: () => void;

  constructor(options: TelemetryOptions = {}) {
    this.now = options.now ?? defaultNow;
    const env = options.env ?? process.env;
    const envConfig = options.tracing === false ? undefined : tracingConfigFromEnv(env);
    const warnings = envConfig?.warnings ?? [];
    // OTEL_TRACES_SAMPLER, when it names a standard sampler, replaces the adaptive rules (sampling.ts); it applies to
    // exporters passed in code too when the environment configures none.
    const envSampler = options.tracing === false ? undefined : envConfig ? envConfig.sampler : samplerFromEnv(env, warnings);
    this.warnings = warnings;
    this.tracing = options.tracing === false ? undefined : createTracing({
      ...(options.exporters ? { exporters: options.exporters } : {}),
      ...(options.processor ? { processor: options.processor } : {}),
      ...(envConfig ? { env: envConfig } : {}),
      ...(options.serviceName ? { serviceName: options.serviceName } : {}),
    });
    const sampling: Partial<TraceSamplingConfig> = { ...options.sampling };
    if (sampling.otel === undefined && envSampler !== undefined) sampling.otel = envSampler;
    this.sampler = new TraceSampler(sampling, options.random);
    this.slo = new SloTracker(options.slo);
    this.analyzer = new TraceAnalyzer(options.analyzer);
    this.traces = new TraceStore(options.traceStoreCapacity ?? 1000);
    this.metrics = new ConduitMetrics({
      ...(options.registry ? { registry: options.registry } : {}),
      sloReport: () => this.slo.report(this.now()),
      // Registered with tracing off too (at 0), so dashboards and alerts on it find the series.
      spanExports: () => this.tracing?.exported ?? { succeeded: 0, failed: 0 },
    });
    this.perTokenSpans = options.perTokenSpans ?? false;
    this.maxInFlight = options.maxInFlight ?? 10_000;
    this.inFlightTtlMs = options.inFlightTtlMs ?? 10 * 60 * 1000;
    this.unsubscribe = this.lifecycle.subscribe((event) => this.onEvent(event));
  }

  /** Requests currently tracked. */
  get inFlight(): number {
    return this.records.size;
  }

  /**
   * Whether shells should put the engine's decode steps on the bus one by one (decode_execution events): only when
   * spans are built per step. Otherwise the engine's per-request step summary, on its timestamps, is enough.
   */
  get wantsEngineSteps(): boolean {
    return this.tracing !== undefined && this.perTokenSpans;
  }

  /** Called with every finished request's trace (and the tail decision when tracing is on). */
  onTrace(listener: TraceListener): () => void {
    this.traceListeners.push(listener);
    return () => {
      const i = this.traceListeners.indexOf(listener);
      if (i >= 0) this.traceListeners.splice(i, 1);
    };
  }

  // -------------------------------------------------------------------------------------------------------------
  // Per-request calls from the shells

  /**
   * The traceparent to carry with the request (EngineRequest.traceparent, an outgoing call, a response header):
   * the request's own root span as parent, so everything downstream joins its trace. Makes the head sampling
   * decision if it is not made yet (so call it after tokenize, when the prompt length is known). Without tracing,
   * the client's traceparent passes through unchanged.
   */
  traceContext(requestId: string): string | undefined {
    const record = this.records.get(requestId);
    if (!record) {
      const done = this.traces.get(requestId);
      return done?.traceId && done.rootSpanId ? formatTraceparent(done.traceId, done.rootSpanId, done.headSampling?.sampled ?? false) : undefined;
    }
    if (!record.traceId || !record.rootSpanId) return record.parentHeader;
    const head = this.decideHead(record);
    return formatTraceparent(record.traceId, record.rootSpanId, head?.sampled ?? false);
  }

  /** The client's tracestate, to pass on with traceContext()'s traceparent (W3C: the two travel together). */
  traceState(requestId: string): string | undefined {
    return this.records.get(requestId)?.tracestate ?? this.traces.get(requestId)?.tracestate;
  }

  /**
   * The timings object for a response: of the finished request if it has ended, else a preview up to `nowMs` with
   * the engine's latest timestamps (the final non-streaming body or the last SSE chunk is written before the
   * request's finish event) and, for a preview, the output tokens so far. `pendingWriteTokens`: the output tokens
   * the write carrying these timings shows first (a stream's last chunk), counted as written now.
   */
  timings(requestId: string, engine?: EngineReport | readonly EngineReport[], nowMs = this.now(), outputTokens?: number,
    pendingWriteTokens?: number): ResponseTimings | undefined {
    const record = this.records.get(requestId);
    if (record) {
      return responseTimings(buildRequestTrace(record, {
        nowMs, ...(engine ? { engine } : {}), ...(outputTokens !== undefined ? { outputTokens } : {}),
        ...(pendingWriteTokens !== undefined ? { pendingWriteTokens } : {}),
      }));
    }
    const done = this.traces.get(requestId);
    return done ? responseTimings(done) : undefined;
  }

  /**
   * What is known of a served model when it is loaded: how its weights are stored (the prefill metrics'
   * `quantization` label; 'none' until described).
   */
  describeModel(model: string, facts: { quantization?: string }): void {
    if (facts.quantization !== undefined) this.metrics.setQuantization(model, facts.quantization);
  }

  /** Raises trace sampling for a model just loaded (for the sampler's new-model window). */
  registerNewModel(model: string): void {
    this.sampler.registerNewModel(model, this.now());
  }

  /** Feeds a worker's EngineStats snapshot to the load gauges and counters. */
  updateEngineStats(snapshot: WorkerStatsSnapshot): void {
    this.metrics.updateFromEngineStats(snapshot);
  }

  // -------------------------------------------------------------------------------------------------------------
  // Reads for the HTTP endpoints and the CLI

  trace(requestId: string): RequestTrace | undefined {
    return this.traces.get(requestId);
  }

  /** GET /v1/requests/{id}/trace */
  traceView(requestId: string): TraceView | undefined {
    const trace = this.traces.get(requestId);
    return trace ? traceView(trace) : undefined;
  }

  /** `conduit trace <id>` */
  waterfall(requestId: string, options?: WaterfallOptions): string | undefined {
    const trace = this.traces.get(requestId);
    return trace ? formatWaterfall(trace, options) : undefined;
  }

  /** GET /v1/slo */
  sloReport(nowMs = this.now()): SloReport {
    return this.slo.report(nowMs);
  }

  /** GET /v1/analysis: the stored traces that ended within the last `windowMs` (default: the SLO window). */
  analysis(windowMs = this.slo.config.windowMs, nowMs = this.now()): WindowAnalysis & { window_ms: number } {
    const analysis = this.analyzer.analyze(this.traces.endedSince(nowMs - windowMs), {
      slowTtftMs: this.slo.config.ttft.targetMs, slowTbtMs: this.slo.config.tbt.targetMs,
      targetsFor: (model) => {
        const objectives = this.slo.objectivesFor(model);
        return { ttftMs: objectives.ttft.targetMs, tbtMs: objectives.tbt.targetMs };
      },
    });
    return { window_ms: windowMs, ...analysis };
  }

  /** GET /metrics (prom-client renders asynchronously). */
  renderMetrics(): Promise<string> {
    return this.metrics.render();
  }

  /**
   * Exports spans still queued. Resolves with the export error, if any, instead of rejecting: a collector that is
   * down must not fail the caller (a server shutting down, most often).
   */
  async flush(): Promise<Error | undefined> {
    try {
      await this.tracing?.forceFlush();
      return undefined;
    } catch (err) {
      return err instanceof Error ? err : new Error(String(err));
    }
  }

  /** Stops listening, exports what is queued and closes the exporters; resolves with the export error, if any. */
  async shutdown(): Promise<Error | undefined> {
    this.unsubscribe();
    this.records.clear();
    try {
      await this.tracing?.shutdown();
      return undefined;
    } catch (err) {
      return err instanceof Error ? err : new Error(String(err));
    }
  }

  // -------------------------------------------------------------------------------------------------------------
  // Collector

  private onEvent(event: LifecycleEvent): void {
    let record = this.records.get(event.requestId);
    if (!record) {
      // A late event of a request that already ended (a worker's stamp crossing threads after the response was
      // done) would otherwise open a record that never ends.
      if (this.traces.get(event.requestId)) return;
      record = this.open(event);
    }
    if (record.add(event)) this.finish(record);
  }

  private open(event: LifecycleEvent): RequestRecord {
    const nowMs = event.time;
    // The Map iterates in insertion order, so the oldest records are at its front.
    for (const [id, r] of this.records) {
      if (r.firstSeenMs < nowMs - this.inFlightTtlMs) this.drop(id, 'expired');
      else if (this.records.size >= this.maxInFlight) this.drop(id, 'overflow');
      else break;
    }
    const record = new RequestRecord(event.requestId, nowMs);
    if (event.phase === 'http_receive' && event.traceparent) {
      record.parentHeader = event.traceparent;
      const parent = parseTraceparent(event.traceparent);
      if (parent) record.parent = parent;
      if (parent && event.tracestate !== undefined) record.tracestate = event.tracestate;
    }
    if (this.tracing) {
      record.traceId = record.parent?.traceId ?? randomTraceId();
      record.rootSpanId = randomSpanId();
    } else if (record.parent) {
      // No spans of Conduit's own: the request belongs to the client's trace, under the client's id.
      record.traceId = record.parent.traceId;
    }
    this.records.set(event.requestId, record);
    return record;
  }

  private drop(requestId: string, reason: 'expired' | 'overflow'): void {
    this.records.delete(requestId);
    this.metrics.recordDroppedRecord(reason);
  }

  private decideHead(record: RequestRecord): SamplingDecision | undefined {
    if (!this.tracing) return undefined;
    record.headSampling ??= this.sampler.head({
      ...(record.model !== undefined ? { model: record.model } : {}),
      ...(record.promptTokens !== undefined ? { promptTokens: record.promptTokens } : {}),
      ...(record.parent ? { parentSampled: record.parent.sampled } : {}),
      ...(record.traceId !== undefined ? { traceId: record.traceId } : {}),
    }, this.now());
    return record.headSampling;
  }

  private finish(record: RequestRecord): void {
    this.records.delete(record.requestId);
    this.decideHead(record);
    const trace = buildRequestTrace(record);
    this.metrics.observeTrace(trace);
    this.slo.recordTrace(trace);
    // Refused for its key (none, or unknown): anyone can send these, so beyond the counts above (invalid_api_key /
    // missing_api_key errors) and the request log they leave nothing: in the trace store a flood of them would evict
    // the tenants' traces, and exported they would drown the failed requests worth reading.
    if (trace.phases.some((p) => p.phase === 'auth' && p.attributes?.ok === false)) return;
    this.traces.add(trace);

    if (trace.outcome === 'ok') {
      const objectives = this.slo.objectivesFor(trace.model);
      let worstGap = 0;
      for (const gap of trace.tbtMs) if (gap > worstGap) worstGap = gap;
      if ((trace.ttftMs ?? 0) >= objectives.ttft.targetMs || worstGap >= objectives.tbt.targetMs) {
        this.metrics.recordBottleneck(this.analyzer.bottleneck(trace).category);
      }
    }

    let kept: SamplingDecision | undefined;
    if (this.tracing) {
      kept = this.sampler.tail(trace);
      this.metrics.recordSampling(kept.sampled, kept.reason);
      if (kept.sampled) {
        emitRequestSpans(this.tracing.tracer, trace, { perTokenSpans: this.perTokenSpans, keptBecause: kept.reason }, this.tracing.ids);
      }
    }
    for (const listener of this.traceListeners) listener(trace, kept);
  }
}

export function createTelemetry(options: TelemetryOptions = {}): Telemetry {
  return new Telemetry(options);
}
