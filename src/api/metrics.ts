// GET /metrics in Prometheus text exposition format (version 0.0.4). The gateway exposes its own counters and the
// engine's load gauges; anything else (latency histograms, SLO figures) plugs in as a MetricsSource whose text is
// appended, so the telemetry layer can register its own registry without the gateway knowing its contents.

import type { EngineStats } from '../engine/types.ts';

/** Returns complete exposition text (HELP/TYPE lines and samples) for some family of metrics. */
export type MetricsSource = () => string;

export const PROMETHEUS_CONTENT_TYPE = 'text/plain; version=0.0.4; charset=utf-8';

type Labels = Record<string, string>;

export function escapeLabelValue(value: string): string {
  return value.replace(/\\/g, '\\\\').replace(/\n/g, '\\n').replace(/"/g, '\\"');
}

function formatLabels(labels: Labels): string {
  const entries = Object.entries(labels);
  if (entries.length === 0) return '';
  return `{${entries.map(([k, v]) => `${k}="${escapeLabelValue(v)}"`).join(',')}}`;
}

function formatValue(value: number): string {
  if (Number.isNaN(value)) return 'NaN';
  if (value === Infinity) return '+Inf';
  if (value === -Infinity) return '-Inf';
  return String(value);
}

/** One metric family: HELP and TYPE, then a sample per label set. */
export function family(name: string, type: 'counter' | 'gauge', help: string, samples: [Labels, number][]): string {
  const lines = [`# HELP ${name} ${help.replace(/\\/g, '\\\\').replace(/\n/g, '\\n')}`, `# TYPE ${name} ${type}`];
  for (const [labels, value] of samples) lines.push(`${name}${formatLabels(labels)} ${formatValue(value)}`);
  return `${lines.join('\n')}\n`;
}

/** A counter keyed by a label set. */
class LabelledCounter {
  private readonly values = new Map<string, { labels: Labels; value: number }>();

  add(labels: Labels, amount = 1): void {
    const key = JSON.stringify(labels);
    const entry = this.values.get(key);
    if (entry) entry.value += amount;
    else this.values.set(key, { labels, value: amount });
  }

  samples(): [Labels, number][] {
    return [...this.values.values()].map(({ labels, value }) => [labels, value]);
  }
}

export class GatewayMetrics {
  private readonly responses = new LabelledCounter();
  private readonly promptTokens = new LabelledCounter();
  private readonly generationTokens = new LabelledCounter();
  private readonly rejections = new LabelledCounter();
  private readonly inFlightByTenant = new Map<string, number>();
  private readonly sources: MetricsSource[] = [];

  /** Adds a family provider to the exposition (the telemetry layer's registry, for one). */
  register(source: MetricsSource): void {
    this.sources.push(source);
  }

  countResponse(route: string, status: number, tenant: string): void {
    this.responses.add({ route, status: String(status), tenant });
  }

  countTokens(tenant: string, prompt: number, generated: number): void {
    this.promptTokens.add({ tenant }, prompt);
    this.generationTokens.add({ tenant }, generated);
  }

  countRejection(tenant: string, code: string): void {
    this.rejections.add({ tenant, code });
  }

  requestStarted(tenant: string): void {
    this.inFlightByTenant.set(tenant, (this.inFlightByTenant.get(tenant) ?? 0) + 1);
  }

  requestEnded(tenant: string): void {
    this.inFlightByTenant.set(tenant, Math.max(0, (this.inFlightByTenant.get(tenant) ?? 0) - 1));
  }

  render(stats: EngineStats | undefined, modelName: string | undefined): string {
    const parts = [
      family('conduit_http_responses_total', 'counter', 'HTTP responses by route, status and tenant.', this.responses.samples()),
      family('conduit_prompt_tokens_total', 'counter', 'Prompt tokens admitted, by tenant.', this.promptTokens.samples()),
      family('conduit_generation_tokens_total', 'counter', 'Completion tokens produced, by tenant.', this.generationTokens.samples()),
      family('conduit_gateway_rejections_total', 'counter', 'Requests refused before the engine, by tenant and error code.',
        this.rejections.samples()),
      family('conduit_gateway_requests_in_flight', 'gauge', 'Generation requests in flight, by tenant.',
        [...this.inFlightByTenant].map(([tenant, value]) => [{ tenant }, value])),
    ];
    if (stats) parts.push(engineFamilies(stats, modelName ?? ''));
    for (const source of this.sources) parts.push(source());
    return parts.join('');
  }
}

function engineFamilies(stats: EngineStats, model: string): string {
  const labels = { model };
  const usage = stats.kvBlocksTotal > 0 ? stats.kvBlocksUsed / stats.kvBlocksTotal : 0;
  return [
    family('conduit_engine_requests_running', 'gauge', 'Requests in the running batch.', [[labels, stats.numRunning]]),
    family('conduit_engine_requests_waiting', 'gauge', 'Requests waiting to be scheduled.', [[labels, stats.numWaiting]]),
    family('conduit_kv_cache_blocks_used', 'gauge', 'KV cache blocks in use.', [[labels, stats.kvBlocksUsed]]),
    family('conduit_kv_cache_blocks_total', 'gauge', 'KV cache blocks in the pool.', [[labels, stats.kvBlocksTotal]]),
    family('conduit_kv_cache_usage_ratio', 'gauge', 'Fraction of KV cache blocks in use.', [[labels, usage]]),
    family('conduit_prefix_cache_queries_total', 'counter', 'Prompt blocks looked up in the prefix cache.',
      [[labels, stats.prefixCacheQueries]]),
    family('conduit_prefix_cache_hits_total', 'counter', 'Prompt blocks found in the prefix cache.', [[labels, stats.prefixCacheHits]]),
    family('conduit_preemptions_total', 'counter', 'Requests preempted for lack of KV blocks.', [[labels, stats.preemptions]]),
  ].join('');
}
