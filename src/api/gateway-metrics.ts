// GET /metrics in Prometheus text exposition format (version 0.0.4). The gateway counts what only it knows (HTTP
// responses by route and status, refusals before the engine, requests in flight per tenant) and the KV pool's size;
// everything per request or per worker (latency histograms, token counters, load gauges, prefix-cache and
// preemption counters, SLO figures) is the telemetry layer's (src/telemetry/metrics.ts). Both live in one prom-client
// registry, the telemetry's, so /metrics is that registry rendered once and each family appears once.

import { Counter, Gauge, Registry } from 'prom-client';
import type { EngineStats } from '../protocols/worker.ts';

export const PROMETHEUS_CONTENT_TYPE = 'text/plain; version=0.0.4; charset=utf-8';

/** One served model's engine stats, for its KV pool gauges. */
export interface KvPoolStats {
  model: string;
  stats: EngineStats;
}

/**
 * The family of that name in the registry, or a new one. Servers that share a telemetry (and so its registry) share
 * these families too, instead of failing on a name registered twice.
 */
function family<M extends Counter<string> | Gauge<string>>(registry: Registry, name: string, create: (registers: Registry[]) => M): M {
  return (registry.getSingleMetric(name) as M | undefined) ?? create([registry]);
}

export class GatewayMetrics {
  readonly registry: Registry;
  private readonly responses: Counter<'route' | 'status' | 'tenant'>;
  private readonly rejections: Counter<'tenant' | 'code'>;
  private readonly inFlight: Gauge<'tenant'>;
  private readonly kvUsed: Gauge<'model'>;
  private readonly kvCapacity: Gauge<'model'>;
  private readonly inFlightByTenant = new Map<string, number>();
  private readonly loraActive: Gauge<'model'>;
  private readonly loraRegistered: Gauge<'model'>;
  private readonly loraLoads: Counter<'model'>;
  private readonly loraEvictions: Counter<'model'>;
  private readonly loraWaiting: Gauge<'model'>;
  /** The adapter managers' cumulative counts at the last scrape, per model (the counters advance by the difference). */
  private readonly loraSeen = new Map<string, { loads: number; evictions: number }>();

  /** Registers the gateway's families in `registry` (the telemetry's, in the server). */
  constructor(registry: Registry = new Registry()) {
    this.registry = registry;
    this.responses = family(registry, 'conduit_http_responses_total', (registers) => new Counter({
      name: 'conduit_http_responses_total', help: 'HTTP responses by route, status and tenant.',
      labelNames: ['route', 'status', 'tenant'], registers,
    }));
    this.rejections = family(registry, 'conduit_gateway_rejections_total', (registers) => new Counter({
      name: 'conduit_gateway_rejections_total', help: 'Requests refused before the engine, by tenant and error code.',
      labelNames: ['tenant', 'code'], registers,
    }));
    this.inFlight = family(registry, 'conduit_gateway_requests_in_flight', (registers) => new Gauge({
      name: 'conduit_gateway_requests_in_flight', help: 'Generation requests in flight, by tenant.', labelNames: ['tenant'], registers,
    }));
    // The KV pool in blocks, over all workers. Queue depth, batch size, utilisation and the prefix-cache and
    // preemption counters are the telemetry's, per worker (conduit_scheduler_queue_depth, conduit_running_batch_size,
    // conduit_kv_cache_utilization_ratio, conduit_prefix_cache_*_tokens_total, conduit_scheduler_preemptions_total).
    this.kvUsed = family(registry, 'conduit_kv_cache_used_blocks', (registers) => new Gauge({
      name: 'conduit_kv_cache_used_blocks', help: 'KV cache blocks in use, over all workers.', labelNames: ['model'], registers,
    }));
    this.kvCapacity = family(registry, 'conduit_kv_cache_capacity_blocks', (registers) => new Gauge({
      name: 'conduit_kv_cache_capacity_blocks', help: 'KV cache blocks in the pool, over all workers.', labelNames: ['model'], registers,
    }));
    this.loraActive = family(registry, 'conduit_lora_adapters_active', (registers) => new Gauge({
      name: 'conduit_lora_adapters_active', help: 'LoRA adapters resident on the workers of a base model (at most --max-loras).', labelNames: ['model'], registers,
    }));
    this.loraRegistered = family(registry, 'conduit_lora_adapters_registered', (registers) => new Gauge({
      name: 'conduit_lora_adapters_registered', help: 'LoRA adapters a base model serves (resident or loaded on demand).', labelNames: ['model'], registers,
    }));
    this.loraLoads = family(registry, 'conduit_lora_adapter_loads_total', (registers) => new Counter({
      name: 'conduit_lora_adapter_loads_total', help: 'LoRA adapter loads onto the workers (at registration and on demand after an eviction).', labelNames: ['model'], registers,
    }));
    this.loraEvictions = family(registry, 'conduit_lora_adapter_evictions_total', (registers) => new Counter({
      name: 'conduit_lora_adapter_evictions_total', help: 'LoRA adapters unloaded to make room for another (least recently used first).', labelNames: ['model'], registers,
    }));
    this.loraWaiting = family(registry, 'conduit_lora_requests_waiting', (registers) => new Gauge({
      name: 'conduit_lora_requests_waiting', help: 'Requests waiting for their LoRA adapter to get a slot (every one of --max-loras busy).', labelNames: ['model'], registers,
    }));
  }

  /** A base model's adapter figures at scrape time. */
  setLora(model: string, stats: { registered: number; resident: number; loads: number; evictions: number; waiting?: number }): void {
    this.loraActive.set({ model }, stats.resident);
    this.loraWaiting.set({ model }, stats.waiting ?? 0);
    this.loraRegistered.set({ model }, stats.registered);
    const seen = this.loraSeen.get(model) ?? { loads: 0, evictions: 0 };
    if (stats.loads > seen.loads) this.loraLoads.inc({ model }, stats.loads - seen.loads);
    else this.loraLoads.inc({ model }, 0);
    if (stats.evictions > seen.evictions) this.loraEvictions.inc({ model }, stats.evictions - seen.evictions);
    else this.loraEvictions.inc({ model }, 0);
    this.loraSeen.set(model, { loads: stats.loads, evictions: stats.evictions });
  }

  countResponse(route: string, status: number, tenant: string): void {
    this.responses.inc({ route, status: String(status), tenant });
  }

  countRejection(tenant: string, code: string): void {
    this.rejections.inc({ tenant, code });
  }

  // The gauge moves by steps, not by this server's count: servers sharing a registry share the family, and the
  // series then holds the sum of their requests. This server's own count keeps an unmatched end from taking one of
  // another server's requests off.
  requestStarted(tenant: string): void {
    this.inFlightByTenant.set(tenant, (this.inFlightByTenant.get(tenant) ?? 0) + 1);
    this.inFlight.inc({ tenant });
  }

  requestEnded(tenant: string): void {
    const count = this.inFlightByTenant.get(tenant) ?? 0;
    if (count === 0) return;
    this.inFlightByTenant.set(tenant, count - 1);
    this.inFlight.dec({ tenant });
  }

  /**
   * The KV pool gauges from each served model's engine stats at scrape time, one series per model (each model has
   * an engine, its workers' pools together); no model served yet (a frontend before its first worker): no series.
   */
  setKvPools(pools: readonly KvPoolStats[]): void {
    this.kvUsed.reset();
    this.kvCapacity.reset();
    for (const { model, stats } of pools) {
      this.kvUsed.set({ model }, stats.kvBlocksUsed);
      this.kvCapacity.set({ model }, stats.kvBlocksTotal);
    }
  }

  /** The whole registry (the telemetry's families too, when it is the telemetry's), the KV pools as of `pools`. */
  render(pools: readonly KvPoolStats[]): Promise<string> {
    this.setKvPools(pools);
    return this.registry.metrics();
  }
}
