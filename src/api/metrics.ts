// GET /metrics in Prometheus text exposition format (version 0.0.4). The gateway exposes what only it knows (HTTP
// responses by route and status, refusals before the engine, requests in flight per tenant) and the KV pool's size;
// everything per request or per worker (latency histograms, token counters, load gauges, prefix-cache and
// preemption counters, SLO figures) is the telemetry layer's registry, whose text the server appends (prom-client
// renders asynchronously); other synchronous sources can plug in as a MetricsSource. The sets of names are
// disjoint, so the exposition has each family once.

import type { EngineStats } from '../protocols/worker.ts';

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
      family('conduit_gateway_rejections_total', 'counter', 'Requests refused before the engine, by tenant and error code.',
        this.rejections.samples()),
      family('conduit_gateway_requests_in_flight', 'gauge', 'Generation requests in flight, by tenant.',
        [...this.inFlightByTenant].map(([tenant, value]) => [{ tenant }, value])),
    ];
    if (stats) parts.push(kvPoolFamilies(stats, modelName ?? ''));
    for (const source of this.sources) parts.push(source());
    return parts.join('');
  }
}

/**
 * The KV pool in blocks, over all workers. Queue depth, batch size, utilisation and the prefix-cache and preemption
 * counters are the telemetry's, per worker (conduit_scheduler_queue_depth, conduit_running_batch_size,
 * conduit_kv_cache_utilization_ratio, conduit_prefix_cache_*_tokens_total, conduit_scheduler_preemptions_total).
 */
function kvPoolFamilies(stats: EngineStats, model: string): string {
  const labels = { model };
  return [
    family('conduit_kv_cache_used_blocks', 'gauge', 'KV cache blocks in use, over all workers.', [[labels, stats.kvBlocksUsed]]),
    family('conduit_kv_cache_capacity_blocks', 'gauge', 'KV cache blocks in the pool, over all workers.', [[labels, stats.kvBlocksTotal]]),
  ].join('');
}
