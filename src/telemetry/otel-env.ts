// Trace export settings from the standard OTEL_* environment variables: whether to export at all, to which
// exporters, with which batching, and the head sampling rate. Export is off unless the variables ask for it.
//
// Only what the installed OpenTelemetry packages do not read themselves is read here. The OTLP exporter reads its
// endpoint (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as is, else OTEL_EXPORTER_OTLP_ENDPOINT with /v1/traces appended),
// headers, timeout, compression and TLS files (OTEL_EXPORTER_OTLP[_TRACES]_{HEADERS,TIMEOUT,COMPRESSION,
// CERTIFICATE,CLIENT_KEY,CLIENT_CERTIFICATE}), and the resource's environment detector reads OTEL_SERVICE_NAME and
// OTEL_RESOURCE_ATTRIBUTES, all from process.env (otel-provider.ts). The batch processor would read OTEL_BSP_* too,
// but only where it is given no value, and Conduit's defaults differ from the SDK's (a larger queue), so those are
// read here with them.
//
// OTEL_TRACES_SAMPLER is read here too: the SDK's own sampler is left always-on (Conduit decides which requests
// become spans before building them), so a standard sampler named there is applied by Conduit's (sampling.ts).

import type { OtelSamplerSpec } from './sampling.ts';

export type Env = Readonly<Record<string, string | undefined>>;

/** The OTLP encodings Conduit sends: OTLP/HTTP with protobuf or JSON bodies. */
export type OtlpProtocol = 'http/protobuf' | 'http/json';

/** The environment asked for something Conduit cannot do and must not silently do otherwise (start-up fails). */
export class TracingConfigError extends Error {
  override readonly name = 'TracingConfigError';
}

export interface TracingEnvConfig {
  exporters: ('otlp' | 'console')[];
  /**
   * OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL: http/protobuf or http/json. Unset:
   * http/json (what Conduit sent before the variable was read; every OTLP/HTTP receiver takes both).
   */
  protocol: OtlpProtocol;
  batch: { maxQueueSize: number; maxExportBatchSize: number; scheduledDelayMs: number; exportTimeoutMs: number };
  /**
   * The standard sampler OTEL_TRACES_SAMPLER names, which then alone decides which requests are exported; unset (or
   * a sampler Conduit does not implement): Conduit's adaptive sampler.
   */
  sampler?: OtelSamplerSpec;
  /** Things the environment asked for that this exporter does not do; reported once at start-up. */
  warnings: string[];
}

/** Batching when OTEL_BSP_* says nothing. The SDK's default queue of 2048 spans drops silently under load (a
 *  request is 10-20 spans); Conduit starts larger. */
export const DEFAULT_BATCH: TracingEnvConfig['batch'] = {
  maxQueueSize: 65_536, maxExportBatchSize: 2048, scheduledDelayMs: 1000, exportTimeoutMs: 30_000,
};

function positiveNumber(value: string | undefined, fallback: number): number {
  if (value === undefined || value.trim() === '') return fallback;
  const n = Number(value);
  return Number.isFinite(n) && n > 0 ? n : fallback;
}

/** The exporters OTEL_TRACES_EXPORTER names, or OTLP when only an endpoint is set. */
function exportersFromEnv(env: Env, warnings: string[]): ('otlp' | 'console')[] {
  const names = (env.OTEL_TRACES_EXPORTER ?? '').split(',').map((s) => s.trim().toLowerCase()).filter(Boolean);
  if (names.length === 0) return env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT?.trim() || env.OTEL_EXPORTER_OTLP_ENDPOINT?.trim() ? ['otlp'] : [];
  if (names.includes('none')) return [];
  const exporters: ('otlp' | 'console')[] = [];
  for (const name of names) {
    if (name === 'otlp' || name === 'console') exporters.push(name);
    else warnings.push(`OTEL_TRACES_EXPORTER=${name} is not supported (otlp, console, none are)`);
  }
  return exporters;
}

/**
 * OTEL_TRACES_SAMPLER as the SDK reads it: always_on, always_off, traceidratio and their parentbased_* forms; the
 * ratio from OTEL_TRACES_SAMPLER_ARG, 1 when it is unset, and 1 with a warning when it is not a number within [0, 1]
 * (the SDK's default). Another value is reported and leaves Conduit's adaptive sampler in charge.
 */
export function samplerFromEnv(env: Env, warnings: string[]): OtelSamplerSpec | undefined {
  const value = (env.OTEL_TRACES_SAMPLER ?? '').trim().toLowerCase();
  if (value === '') return undefined;
  const parentBased = value.startsWith('parentbased_');
  const root = parentBased ? value.slice('parentbased_'.length) : value;
  if (root === 'always_on' || root === 'always_off') return { root, parentBased };
  if (root === 'traceidratio') {
    const arg = (env.OTEL_TRACES_SAMPLER_ARG ?? '').trim();
    let ratio = arg === '' ? 1 : Number(arg);
    if (!(ratio >= 0 && ratio <= 1)) {
      warnings.push(`OTEL_TRACES_SAMPLER_ARG=${arg} is not a ratio within [0, 1]; ${value} samples with 1 (every trace)`);
      ratio = 1;
    }
    return { root, parentBased, ratio };
  }
  warnings.push(`OTEL_TRACES_SAMPLER=${value} is not supported (always_on, always_off, traceidratio and their parentbased_ forms are); `
    + 'Conduit\'s adaptive sampler decides');
  return undefined;
}

/**
 * The OTLP encoding asked for. Another protocol (grpc) is refused with a TracingConfigError: sending something else
 * than was asked would look like a working export to a receiver that never gets it.
 */
function otlpProtocolFromEnv(env: Env, otlp: boolean): OtlpProtocol {
  const name = env.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL !== undefined ? 'OTEL_EXPORTER_OTLP_TRACES_PROTOCOL' : 'OTEL_EXPORTER_OTLP_PROTOCOL';
  const value = (env[name] ?? '').trim().toLowerCase();
  if (value === '' || value === 'http/json') return 'http/json';
  if (value === 'http/protobuf') return 'http/protobuf';
  if (!otlp) return 'http/json';
  throw new TracingConfigError(`${name}=${value} is not supported: Conduit exports OTLP over HTTP only; set it to `
    + 'http/protobuf or http/json (and point OTEL_EXPORTER_OTLP_ENDPOINT at the receiver\'s HTTP port, usually 4318)');
}

/**
 * Returns undefined (no export) unless OTEL_TRACES_EXPORTER names an exporter or an OTLP endpoint is set, and always
 * when OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none.
 */
export function tracingConfigFromEnv(env: Env): TracingEnvConfig | undefined {
  if ((env.OTEL_SDK_DISABLED ?? '').trim().toLowerCase() === 'true') return undefined;
  const warnings: string[] = [];
  const exporters = exportersFromEnv(env, warnings);
  if (exporters.length === 0) return undefined;

  const protocol = otlpProtocolFromEnv(env, exporters.includes('otlp'));

  const sampler = samplerFromEnv(env, warnings);
  return {
    exporters,
    protocol,
    batch: {
      maxQueueSize: positiveNumber(env.OTEL_BSP_MAX_QUEUE_SIZE, DEFAULT_BATCH.maxQueueSize),
      maxExportBatchSize: positiveNumber(env.OTEL_BSP_MAX_EXPORT_BATCH_SIZE, DEFAULT_BATCH.maxExportBatchSize),
      scheduledDelayMs: positiveNumber(env.OTEL_BSP_SCHEDULE_DELAY, DEFAULT_BATCH.scheduledDelayMs),
      exportTimeoutMs: positiveNumber(env.OTEL_BSP_EXPORT_TIMEOUT, DEFAULT_BATCH.exportTimeoutMs),
    },
    ...(sampler !== undefined ? { sampler } : {}),
    warnings,
  };
}
