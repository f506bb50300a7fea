// The telemetry layer's public surface. Shells import from here; docs/observability.md describes the wiring.

export * from './lifecycle.ts';
export * from './trace.ts';
export * from './traceparent.ts';
export * from './sampling.ts';
export * from './otel-env.ts';
export * from './otel-provider.ts';
export * from './otel-spans.ts';
export * from './metrics.ts';
export * from './slo.ts';
export * from './analyzer.ts';
export * from './timings.ts';
export * from './telemetry.ts';
export { percentile, percentileOf } from '../util/stats.ts';
