// The tracer provider: span processors and exporters (those the environment asks for, and any the caller adds),
// the resource, and trace and span ids chosen before the spans exist. The OTLP exporter and the resource's
// environment detector read their own OTEL_* variables from process.env; otel-env.ts reads the rest.

import type { Tracer } from '@opentelemetry/api';
import { ExportResultCode } from '@opentelemetry/core';
import { OTLPTraceExporter } from '@opentelemetry/exporter-trace-otlp-http';
import { OTLPTraceExporter as OTLPProtoTraceExporter } from '@opentelemetry/exporter-trace-otlp-proto';
import { detectResources, envDetector, resourceFromAttributes } from '@opentelemetry/resources';
import {
  AlwaysOnSampler, BatchSpanProcessor, ConsoleSpanExporter, NodeTracerProvider, SimpleSpanProcessor,
  type IdGenerator, type SpanExporter, type SpanProcessor,
} from '@opentelemetry/sdk-trace-node';
import { ATTR_SERVICE_NAME, ATTR_SERVICE_VERSION } from '@opentelemetry/semantic-conventions';
import { DEFAULT_BATCH, type TracingEnvConfig } from './otel-env.ts';
import { randomSpanId, randomTraceId } from './traceparent.ts';

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
 * The service's resource: OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME (which wins over a service.name among the
 * attributes) over the default name "conduit"; a name the caller gives wins over both, and the version is Conduit's.
 */
function resource(options: TracingOptions) {
  return resourceFromAttributes({ [ATTR_SERVICE_NAME]: 'conduit' })
    .merge(detectResources({ detectors: [envDetector] }))
    .merge(resourceFromAttributes({
      ...(options.serviceName !== undefined ? { [ATTR_SERVICE_NAME]: options.serviceName } : {}),
      [ATTR_SERVICE_VERSION]: options.serviceVersion ?? '0.1.0',
    }));
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
    } : { maxQueueSize: DEFAULT_BATCH.maxQueueSize, maxExportBatchSize: DEFAULT_BATCH.maxExportBatchSize }) : new SimpleSpanProcessor(exporter);
  };
  for (const exporter of exporters) processors.push(wrap(exporter));
  if (env?.exporters.includes('otlp')) {
    // A flush sends every queued batch at once; the exporter refuses (and the flush fails) beyond its concurrency
    // limit, 30 by default, fewer than a full queue holds. Allow one request per batch a full queue makes.
    const concurrencyLimit = Math.ceil(env.batch.maxQueueSize / env.batch.maxExportBatchSize) + 2;
    // Endpoint, headers, timeout, compression and TLS files: the exporter reads them from the environment.
    const Exporter = env.protocol === 'http/protobuf' ? OTLPProtoTraceExporter : OTLPTraceExporter;
    processors.push(wrap(new Exporter({ concurrencyLimit })));
  }
  if (env?.exporters.includes('console')) processors.push(new SimpleSpanProcessor(new CountingExporter(new ConsoleSpanExporter(), exported)));
  if (processors.length === 0) return undefined;

  const ids = new ReservedIdGenerator();
  const provider = new NodeTracerProvider({
    resource: resource(options),
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
