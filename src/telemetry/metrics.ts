// Prometheus metrics for every request, in a prom-client Registry of their own (prefix conduit_). Latency
// histograms are observed once per request, when it ends, from its RequestTrace: the same numbers the trace, the
// timings object and the SLO tracker show, and no per-request state in this module. Load gauges and the engine's
// cumulative counters come from EngineStats snapshots (updateFromEngineStats).
//
// Units are in the names (_milliseconds, _bytes, _tokens, _ratio). Buckets follow LLM latencies: TTFT from 5 ms
// to 60 s, TBT finer from 1 ms, each including the SLO thresholds (TTFT 200/500 ms, TBT 50/100 ms) as bucket
// bounds so histogram_quantile is exact at the thresholds the alerts compare with.
//
// Labels: model and worker on latency histograms and load gauges; tenant only on counters (a histogram multiplies
// its series by its bucket count). Missing values are 'none', but for the tenant: a request without an authenticated
// tenant is ANONYMOUS_TENANT's, in these counters as in the gateway's (src/api/gateway-metrics.ts).

import { Counter, Gauge, Histogram, Registry } from 'prom-client';
import type { EngineStats, KvLinkStats, KvTierStats } from '../protocols/worker.ts';
import { GATEWAY_PHASES } from './lifecycle.ts';
import type { SloReport } from './slo.ts';
import type { RequestTrace } from './trace.ts';

/**
 * The tenant of a request without an authenticated one: every request of a server with no API keys, and a request
 * refused for its key (401) or before its key was read. One label for them in every metric that has a tenant.
 */
export const ANONYMOUS_TENANT = 'anonymous';

export const TTFT_BUCKETS_MS = [5, 10, 20, 50, 100, 200, 300, 500, 750, 1000, 2000, 5000, 10_000, 30_000, 60_000];
export const TBT_BUCKETS_MS = [1, 2.5, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000, 2500];
export const E2E_BUCKETS_MS = [50, 100, 250, 500, 1000, 2000, 5000, 10_000, 20_000, 30_000, 60_000, 120_000, 300_000];
export const QUEUE_BUCKETS_MS = [0.1, 0.5, 1, 5, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000];
export const PREFILL_BUCKETS_MS = [1, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 30_000];
export const ROUTING_BUCKETS_MS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25];
export const GATEWAY_BUCKETS_MS = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250];
export const KV_TRANSFER_BUCKETS_MS = [0.1, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000];
export const RATIO_BUCKETS = [0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1];
export const OUTPUT_TOKENS_BUCKETS = [1, 10, 50, 100, 200, 500, 1000, 2000, 4000, 8000, 16_000];


export interface WorkerStatsSnapshot {
  worker: string;
  model?: string;
  stats: EngineStats;
  /** KV blocks evicted from the prefix cache since start (cumulative); default: stats.kvEvictions. */
  kvEvictions?: number;
  /** Utilisation of KV tiers besides the primary pool ('host', 'disk'), 0..1. */
  kvUtilizationByTier?: Readonly<Record<string, number>>;
}

/** The primary KV pool: where attention reads blocks from (device memory on a GPU, RAM on the CPU engine). */
export const PRIMARY_KV_TIER = 'primary';

const STATUS_VALUE = { ok: 0, warning: 1, violated: 2 } as const;

/**
 * Refusals of a request that could never fit the memory it needs: the gateway's check against the KV pool's
 * capacity, and the worker's own (a prompt larger than its pool).
 */
const KV_CAPACITY_ERRORS: ReadonlySet<string> = new Set(['kv_capacity_exceeded', 'prompt_exceeds_kv_pool']);

export interface MetricsOptions {
  registry?: Registry;
  /** For the SLO gauges: the tracker's report at scrape time. */
  sloReport?: () => SloReport;
  /** For the span export counter: spans exporters accepted and refused since start. */
  spanExports?: () => { succeeded: number; failed: number };
}

export class ConduitMetrics {
  readonly registry: Registry;

  // Latency, per request.
  readonly ttft: Histogram<'model' | 'worker'>;
  readonly tbt: Histogram<'model' | 'worker'>;
  readonly e2e: Histogram<'model' | 'outcome'>;
  readonly queueWait: Histogram<'model' | 'worker'>;
  readonly prefill: Histogram<'model' | 'worker' | 'quantization'>;
  readonly decode: Histogram<'model' | 'worker'>;
  readonly gatewayPhase: Histogram<'phase'>;
  readonly routing: Histogram<'model' | 'strategy'>;
  readonly routingSubPhase: Histogram<'model' | 'sub_phase'>;
  readonly kvTransfer: Histogram<'worker' | 'link'>;
  readonly kvOnboard: Histogram<'worker'>;
  readonly prefixHitRatio: Histogram<'model' | 'worker'>;
  readonly outputTokens: Histogram<'model'>;

  // Counts.
  readonly requests: Counter<'model' | 'tenant' | 'finish_reason'>;
  readonly errors: Counter<'model' | 'error_type' | 'origin'>;
  readonly cancellations: Counter<'model' | 'tenant' | 'phase'>;
  readonly rateLimitRejections: Counter<'tenant' | 'reason'>;
  readonly promptTokens: Counter<'model' | 'worker' | 'tenant'>;
  readonly generationTokens: Counter<'model' | 'worker' | 'tenant'>;
  readonly cachedPromptTokens: Counter<'model' | 'worker' | 'tenant'>;
  readonly kvTransferBytes: Counter<'worker' | 'link'>;
  readonly kvTransferBlocks: Counter<'worker' | 'link'>;
  readonly kvTransferFailures: Counter<'worker' | 'link' | 'reason'>;
  readonly kvTransferFallbacks: Counter<'worker' | 'link'>;

  // Engine load, from stats snapshots.
  readonly queueDepth: Gauge<'model' | 'worker'>;
  readonly batchSize: Gauge<'model' | 'worker'>;
  readonly kvUtilization: Gauge<'worker' | 'tier'>;
  readonly kvTierUsed: Gauge<'worker' | 'tier'>;
  readonly kvTierCapacity: Gauge<'worker' | 'tier'>;
  readonly kvOffloadBytes: Counter<'worker' | 'tier'>;
  readonly kvOffloadMs: Counter<'worker' | 'tier'>;
  readonly kvOnboardBytes: Counter<'worker' | 'tier'>;
  readonly kvOnboardMs: Counter<'worker' | 'tier'>;
  readonly kvTierHits: Counter<'worker' | 'tier'>;
  readonly kvTierCorrupt: Counter<'worker' | 'tier'>;
  readonly kvOffloadFailed: Counter<'worker' | 'tier'>;
  readonly prefixQueries: Counter<'worker'>;
  readonly prefixHits: Counter<'worker'>;
  readonly preemptions: Counter<'model' | 'worker'>;
  readonly evictions: Counter<'worker'>;
  readonly migrations: Counter<'worker'>;
  readonly memory: Gauge<'worker' | 'category'>;
  readonly oomEvents: Counter<'worker' | 'kind'>;
  readonly kvBlockShortfalls: Counter<'worker'>;

  // Telemetry about telemetry.
  readonly samplingDecisions: Counter<'kept' | 'reason'>;
  readonly bottlenecks: Counter<'category'>;
  readonly droppedRecords: Counter<'reason'>;

  /** How each served model's weights are stored (EngineInfo.quantization), for the prefill histogram's label. */
  private readonly quantization = new Map<string, string>();
  private readonly lastStats = new Map<string, {
    queries: number; hits: number; preemptions: number; evictions: number; migrations: number; model: string; tiers: string[];
    /** Memory categories reported so far, and the allocation-failure counters at the previous snapshot. */
    memoryCategories: string[];
    kvBlockFailures: number;
    scratchFailures: number;
    /** The lower tiers' cumulative counters at the previous snapshot, by tier. */
    tierCounters: Record<string, KvTierStats>;
    /** The decode worker's failed KV imports per link at the previous snapshot. */
    kvLinks: Record<string, KvLinkStats>;
  }>();

  constructor(options: MetricsOptions = {}) {
    const registers = [this.registry = options.registry ?? new Registry()];
    const h = <L extends string>(name: string, help: string, labelNames: L[], buckets: number[]) =>
      new Histogram<L>({ name, help, labelNames, buckets, registers });
    const c = <L extends string>(name: string, help: string, labelNames: L[]) => new Counter<L>({ name, help, labelNames, registers });
    const g = <L extends string>(name: string, help: string, labelNames: L[]) => new Gauge<L>({ name, help, labelNames, registers });

    this.ttft = h('conduit_time_to_first_token_milliseconds', 'Arrival to the first streamed token (to the engine\'s first token when not streaming).', ['model', 'worker'], TTFT_BUCKETS_MS);
    this.tbt = h('conduit_time_between_tokens_milliseconds', 'Gap between consecutive streamed tokens of a request.', ['model', 'worker'], TBT_BUCKETS_MS);
    this.e2e = h('conduit_request_duration_milliseconds', 'Arrival to the last byte of the response.', ['model', 'outcome'], E2E_BUCKETS_MS);
    this.queueWait = h('conduit_queue_wait_milliseconds', 'Time in the worker scheduler\'s waiting queue before first scheduled.', ['model', 'worker'], QUEUE_BUCKETS_MS);
    this.prefill = h('conduit_prefill_duration_milliseconds', 'First prefill chunk start to the end of the last chunk up to the first token, waits between chunks left out, by how the weights are stored.', ['model', 'worker', 'quantization'], PREFILL_BUCKETS_MS);
    this.decode = h('conduit_decode_duration_milliseconds', 'First to last sampled token of a request.', ['model', 'worker'], E2E_BUCKETS_MS);
    this.gatewayPhase = h('conduit_gateway_phase_duration_milliseconds', 'Gateway phases: http_receive, auth, rate_limit, validate, tokenize.', ['phase'], GATEWAY_BUCKETS_MS);
    this.routing = h('conduit_routing_duration_milliseconds', 'Router decision time (router_lookup), by strategy.', ['model', 'strategy'], ROUTING_BUCKETS_MS);
    this.routingSubPhase = h('conduit_routing_sub_phase_duration_milliseconds', 'Router decision time by part: hashing, index_lookup, selection.', ['model', 'sub_phase'], ROUTING_BUCKETS_MS);
    this.kvTransfer = h('conduit_kv_transfer_duration_milliseconds', 'KV cache transfer from prefill to decode worker, by decode worker and link (shm, tcp).', ['worker', 'link'], KV_TRANSFER_BUCKETS_MS);
    this.kvOnboard = h('conduit_kv_onboard_duration_milliseconds', 'Copying a request\'s prompt blocks back from the worker\'s lower KV tiers (RAM, disk) into its pool, by worker.', ['worker'], KV_TRANSFER_BUCKETS_MS);
    this.prefixHitRatio = h('conduit_request_prefix_cache_hit_ratio', 'Share of a request\'s prompt tokens found in the prefix cache.', ['model', 'worker'], RATIO_BUCKETS);
    this.outputTokens = h('conduit_output_tokens_per_request', 'Output tokens of each completed request (all its completions).', ['model'], OUTPUT_TOKENS_BUCKETS);

    this.requests = c('conduit_requests_total', 'Finished requests by finish reason (stop, length, abort, error).', ['model', 'tenant', 'finish_reason']);
    this.errors = c('conduit_request_errors_total', 'Failed requests by error type; origin=client for 4xx refusals, server otherwise.', ['model', 'error_type', 'origin']);
    this.cancellations = c('conduit_request_cancellations_total', 'Requests aborted before finishing, by the phase they were in.', ['model', 'tenant', 'phase']);
    this.rateLimitRejections = c('conduit_rate_limit_rejections_total', 'Requests refused by the tenant rate limiter.', ['tenant', 'reason']);
    this.promptTokens = c('conduit_request_prompt_tokens_total', 'Prompt tokens of finished requests.', ['model', 'worker', 'tenant']);
    this.generationTokens = c('conduit_request_generation_tokens_total', 'Output tokens of finished requests.', ['model', 'worker', 'tenant']);
    this.cachedPromptTokens = c('conduit_request_cached_tokens_total', 'Prompt tokens of finished requests served from the prefix cache.', ['model', 'worker', 'tenant']);
    this.kvTransferBytes = c('conduit_kv_transfer_bytes_total', 'KV cache bytes moved to decode workers, by link.', ['worker', 'link']);
    this.kvTransferBlocks = c('conduit_kv_transfer_blocks_total', 'KV cache blocks moved to decode workers, by link (blocks the decode worker held already do not move).', ['worker', 'link']);
    this.kvTransferFailures = c('conduit_kv_transfer_failures_total', 'KV transfers to a decode worker that failed or could not start, by link and reason (checksum, truncated, connect, ...).', ['worker', 'link', 'reason']);
    this.kvTransferFallbacks = c('conduit_kv_transfer_fallbacks_total', 'Handed-off requests the decode worker prefilled itself because their KV could not be imported, by link.', ['worker', 'link']);

    this.queueDepth = g('conduit_scheduler_queue_depth', 'Requests waiting in the worker scheduler.', ['model', 'worker']);
    this.batchSize = g('conduit_running_batch_size', 'Requests in the worker\'s running batch.', ['model', 'worker']);
    this.kvUtilization = g('conduit_kv_cache_utilization_ratio', 'Fraction of KV cache blocks in use, by tier.', ['worker', 'tier']);
    this.kvTierUsed = g('conduit_kv_tier_used_blocks', 'KV blocks held, by tier (primary: in use; ram, disk: stored).', ['worker', 'tier']);
    this.kvTierCapacity = g('conduit_kv_tier_capacity_blocks', 'KV blocks a tier can hold.', ['worker', 'tier']);
    this.kvOffloadBytes = c('conduit_kv_offload_bytes_total', 'KV bytes copied down from the primary pool into a lower tier.', ['worker', 'tier']);
    this.kvOffloadMs = c('conduit_kv_offload_milliseconds_total', 'Time spent copying KV blocks into a lower tier (disk: the asynchronous writes).', ['worker', 'tier']);
    this.kvOnboardBytes = c('conduit_kv_onboard_bytes_total', 'KV bytes copied back from a lower tier into the primary pool.', ['worker', 'tier']);
    this.kvOnboardMs = c('conduit_kv_onboard_milliseconds_total', 'Time spent copying KV blocks back from a lower tier.', ['worker', 'tier']);
    this.kvTierHits = c('conduit_kv_tier_hit_blocks_total', 'Prompt blocks found in a lower tier and onboarded instead of computed.', ['worker', 'tier']);
    this.kvTierCorrupt = c('conduit_kv_tier_corrupt_blocks_total', 'Blocks a lower tier found unreadable (torn or corrupted) and dropped.', ['worker', 'tier']);
    this.kvOffloadFailed = c('conduit_kv_offload_failed_blocks_total', 'Blocks whose copy into a lower tier failed (disk: a write error, as on a full disk or a removed folder).', ['worker', 'tier']);
    this.prefixQueries = c('conduit_prefix_cache_query_tokens_total', 'Prompt tokens looked up in the worker\'s prefix cache.', ['worker']);
    this.prefixHits = c('conduit_prefix_cache_hit_tokens_total', 'Prompt tokens found in the worker\'s prefix cache.', ['worker']);
    this.preemptions = c('conduit_scheduler_preemptions_total', 'Requests preempted for lack of KV blocks (they recompute later).', ['model', 'worker']);
    this.evictions = c('conduit_kv_cache_evictions_total', 'Cached KV blocks evicted to make room.', ['worker']);
    this.memory = g('conduit_memory_used_bytes', 'Memory a worker holds, by category: weights, lora_adapters, kv_cache (the primary pool), activations (per-step buffers), kv_offload_ram (blocks in the RAM tier). Simulated workers: the modelled GPU memory of the worker.', ['worker', 'category']);
    this.oomEvents = c('conduit_oom_events_total', 'Out-of-memory events: scratch (a step\'s buffers could not be allocated; its requests failed with out_of_memory), kv_capacity (a request refused because it could never fit the KV pool).', ['worker', 'kind']);
    this.kvBlockShortfalls = c('conduit_kv_block_shortfalls_total', 'Times a running sequence found no free KV block and the scheduler preempted (normal under load; see conduit_scheduler_preemptions_total).', ['worker']);
    this.migrations = c('conduit_request_migrations_total', 'Requests the worker took over after the worker running them was lost (mid-stream, or a prefill lost before its hand-over).', ['worker']);

    this.samplingDecisions = c('conduit_trace_sampling_decisions_total', 'Requests whose spans were kept or dropped, by reason.', ['kept', 'reason']);
    this.bottlenecks = c('conduit_slow_request_bottlenecks_total', 'Slow requests by the bottleneck the trace analyzer named.', ['category']);
    this.droppedRecords = c('conduit_telemetry_dropped_records_total', 'In-flight request records dropped unfinished (never ended, or too many).', ['reason']);
    // Counters an alert takes increase() of exist at 0 from the start: a series born at 1 shows no increase.
    for (const reason of ['expired', 'overflow'] as const) this.droppedRecords.inc({ reason }, 0);
    this.oomEvents.inc({ worker: 'none', kind: 'kv_capacity' }, 0);

    const spanExports = options.spanExports;
    if (spanExports) {
      // Kept by the exporter wrapper; copied in at scrape time.
      new Counter<'result'>({
        name: 'conduit_trace_spans_exported_total', help: 'Spans handed to trace exporters, by result (failure = lost).',
        labelNames: ['result'], registers,
        collect() {
          const counts = spanExports();
          this.reset();
          this.inc({ result: 'success' }, counts.succeeded);
          this.inc({ result: 'failure' }, counts.failed);
        },
      });
    }

    const slo = options.sloReport;
    if (slo) {
      // Gauges computed at scrape time from the tracker's sliding window.
      const sloGauge = (name: string, help: string, labelNames: string[], fill: (gauge: Gauge<string>, report: SloReport) => void) =>
        new Gauge<string>({
          name, help, labelNames, registers,
          collect() {
            this.reset();
            fill(this, slo());
          },
        });
      // The latency objectives' percentile is configured (SloConfig.percentile, 0.99 by default): its value is the
      // `percentile` label (as in /v1/slo; promtool reserves `quantile` for summaries) rather than part of the name,
      // so that a p95 objective is not exported as a "p99" series and a dashboard reads it whatever the percentile.
      const percentile = (report: SloReport): string => String(report.percentile);
      sloGauge('conduit_slo_ttft_milliseconds', 'TTFT at the SLO percentile (the percentile label, 0.99 by default) over the SLO window.',
        ['model', 'percentile'], (gauge, report) => {
          for (const m of report.models) if (m.ttft.p99_ms !== null) gauge.set({ model: m.model, percentile: percentile(report) }, m.ttft.p99_ms);
        });
      sloGauge('conduit_slo_tbt_milliseconds', 'Time between tokens at the SLO percentile (the percentile label, 0.99 by default) over the SLO window.',
        ['model', 'percentile'], (gauge, report) => {
          for (const m of report.models) if (m.tbt.p99_ms !== null) gauge.set({ model: m.model, percentile: percentile(report) }, m.tbt.p99_ms);
        });
      sloGauge('conduit_slo_error_ratio', 'Server error ratio over the SLO window.', ['model'], (gauge, report) => {
        for (const m of report.models) if (m.error_rate.rate !== null) gauge.set({ model: m.model }, m.error_rate.rate);
      });
      sloGauge('conduit_slo_status', 'SLO status: 0 target met, 1 warning, 2 violated.', ['model', 'objective'], (gauge, report) => {
        for (const m of report.models) {
          for (const [objective, status] of [['ttft', m.ttft.status], ['tbt', m.tbt.status], ['error_rate', m.error_rate.status]] as const) {
            if (status !== 'no_data') gauge.set({ model: m.model, objective }, STATUS_VALUE[status]);
          }
        }
      });
    }
  }

  /** The exposition's content type. */
  get contentType(): string {
    return this.registry.contentType;
  }

  /** The whole registry in Prometheus text format. */
  render(): Promise<string> {
    return this.registry.metrics();
  }

  /** Every metric family name this module registers, with its type. */
  families(): { name: string; type: string }[] {
    return this.registry.getMetricsAsArray().map((m) => ({ name: m.name, type: String(m.type) }));
  }

  /** Records one finished request. */
  observeTrace(trace: RequestTrace): void {
    const model = trace.model;
    const worker = trace.worker ?? 'none';
    const tenant = trace.tenant ?? ANONYMOUS_TENANT;
    const mw = { model, worker };
    // The prompt's side of a disaggregated request ran on its prefill worker: its queue wait, prefill, first token
    // and prefix-cache hit ratio are that worker's (trace.worker is the decode worker the router placed it on).
    const prefillWorker = trace.prefillWorker ?? worker;
    const pw = { model, worker: prefillWorker };

    this.requests.inc({ model, tenant, finish_reason: trace.finishReason });
    this.e2e.observe({ model, outcome: trace.outcome }, trace.e2eMs);
    if (trace.ttftMs !== undefined) this.ttft.observe(pw, trace.ttftMs);
    if (trace.tbtMs.length > 0) {
      // One child lookup for all of the request's gaps instead of a label hash per token.
      const child = this.tbt.labels(mw);
      for (const gap of trace.tbtMs) child.observe(gap);
    }

    for (const p of trace.phases) {
      if (p.incomplete) continue;
      if ((GATEWAY_PHASES as readonly string[]).includes(p.phase)) this.gatewayPhase.observe({ phase: p.phase }, p.endMs - p.startMs);
      // The wait before the first forward pass, once a request: not the waits again between its chunks.
      else if (p.phase === 'scheduler_queue' && p.attributes?.requeued !== true) {
        this.queueWait.observe({ model, worker: p.worker ?? prefillWorker }, p.endMs - p.startMs);
      }
    }
    if (trace.routing) {
      this.routing.observe({ model, strategy: trace.routing.strategy }, trace.routing.endMs - trace.routing.startMs);
      const sub = trace.routing.subPhasesMs;
      if (sub?.hashing !== undefined) this.routingSubPhase.observe({ model, sub_phase: 'hashing' }, sub.hashing);
      if (sub?.indexLookup !== undefined) this.routingSubPhase.observe({ model, sub_phase: 'index_lookup' }, sub.indexLookup);
      if (sub?.selection !== undefined) this.routingSubPhase.observe({ model, sub_phase: 'selection' }, sub.selection);
    }
    if (trace.prefill) {
      // As the response's timings count it: up to the first token, the waits between chunks left out (they are queue).
      this.prefill.observe({ model, worker: trace.prefill.worker ?? prefillWorker, quantization: this.quantization.get(model) ?? 'none' },
        Math.max(0, trace.prefill.endMs - trace.prefill.startMs - trace.prefill.requeuedMs));
    }
    if (trace.outcome === 'ok') this.outputTokens.observe({ model }, trace.outputTokens);
    if (trace.decode && !trace.decode.incomplete) this.decode.observe(mw, trace.decode.endMs - trace.decode.startMs);
    if (trace.kvOnboard) this.kvOnboard.observe({ worker }, trace.kvOnboard.ms);
    if (trace.kvTransfer) {
      const labels = { worker: trace.kvTransfer.toWorker ?? worker, link: trace.kvTransfer.link ?? 'none' };
      this.kvTransfer.observe(labels, trace.kvTransfer.endMs - trace.kvTransfer.startMs);
      this.kvTransferBytes.inc(labels, trace.kvTransfer.bytes);
      this.kvTransferBlocks.inc(labels, trace.kvTransfer.blocks ?? 0);
    }

    const reachedEngine = trace.prefill !== undefined || trace.engineFirstTokenMs !== undefined;
    if (reachedEngine && trace.promptTokens > 0) this.prefixHitRatio.observe(pw, Math.min(1, trace.cachedTokens / trace.promptTokens));
    const labels = { model, worker, tenant };
    if (trace.promptTokens > 0 && reachedEngine) this.promptTokens.inc(labels, trace.promptTokens);
    if (trace.outputTokens > 0) this.generationTokens.inc(labels, trace.outputTokens);
    if (trace.cachedTokens > 0) this.cachedPromptTokens.inc(labels, trace.cachedTokens);

    if (trace.outcome === 'error') {
      const origin = trace.status !== undefined && trace.status < 500 ? 'client' : 'server';
      this.errors.inc({ model, error_type: trace.errorType ?? 'unknown', origin });
      if (trace.errorType !== undefined && KV_CAPACITY_ERRORS.has(trace.errorType)) this.oomEvents.inc({ worker, kind: 'kv_capacity' });
    } else if (trace.outcome === 'abort') {
      this.cancellations.inc({ model, tenant, phase: trace.endedInPhase ?? 'unknown' });
    }
    if (trace.rateLimited) this.rateLimitRejections.inc({ tenant, reason: trace.rateLimitReason ?? 'limit' });
  }

  /**
   * Sets the load gauges from a worker's stats and advances the counters by what the engine's cumulative counters
   * moved since the previous snapshot of that worker (a drop means the engine restarted: its whole value is new).
   */
  updateFromEngineStats(snapshot: WorkerStatsSnapshot): void {
    const { worker, stats } = snapshot;
    const model = snapshot.model ?? 'none';
    this.queueDepth.set({ model, worker }, stats.numWaiting);
    this.batchSize.set({ model, worker }, stats.numRunning);
    this.kvUtilization.set({ worker, tier: PRIMARY_KV_TIER }, stats.kvBlocksTotal > 0 ? stats.kvBlocksUsed / stats.kvBlocksTotal : 0);
    this.kvTierUsed.set({ worker, tier: PRIMARY_KV_TIER }, stats.kvBlocksUsed);
    this.kvTierCapacity.set({ worker, tier: PRIMARY_KV_TIER }, stats.kvBlocksTotal);
    const lowerTiers = stats.kvTiers?.tiers ?? {};
    const byTier: Record<string, number> = { ...snapshot.kvUtilizationByTier };
    for (const [tier, t] of Object.entries(lowerTiers)) byTier[tier] = t.capacityBlocks > 0 ? t.usedBlocks / t.capacityBlocks : 0;
    const reportedTiers = Object.keys(byTier);
    for (const tier of reportedTiers) this.kvUtilization.set({ worker, tier }, byTier[tier]!);

    const prev = this.lastStats.get(worker);
    if (prev === undefined) this.oomEvents.inc({ worker, kind: 'kv_capacity' }, 0);
    const delta = (now: number, before: number | undefined) => (before === undefined || now < before ? now : now - before);
    const tierCounters: Record<string, KvTierStats> = {};
    for (const [tier, t] of Object.entries(lowerTiers)) {
      const before = prev?.tierCounters[tier];
      const labels = { worker, tier };
      this.kvTierUsed.set(labels, t.usedBlocks);
      this.kvTierCapacity.set(labels, t.capacityBlocks);
      this.kvOffloadBytes.inc(labels, delta(t.offloadBytes, before?.offloadBytes));
      this.kvOffloadMs.inc(labels, delta(t.offloadMs, before?.offloadMs));
      this.kvOnboardBytes.inc(labels, delta(t.onboardBytes, before?.onboardBytes));
      this.kvOnboardMs.inc(labels, delta(t.onboardMs, before?.onboardMs));
      this.kvTierHits.inc(labels, delta(t.onboardBlocks, before?.onboardBlocks));
      this.kvTierCorrupt.inc(labels, delta(t.corruptBlocks, before?.corruptBlocks));
      this.kvOffloadFailed.inc(labels, delta(t.failedOffloadBlocks, before?.failedOffloadBlocks));
      tierCounters[tier] = { ...t };
    }
    // Every tier ever reported, so forgetWorker removes series a later snapshot no longer mentions.
    const tiers = [...new Set([...(prev?.tiers ?? []), ...reportedTiers])];
    const dq = delta(stats.prefixCacheQueries, prev?.queries);
    const dh = delta(stats.prefixCacheHits, prev?.hits);
    const dp = delta(stats.preemptions, prev?.preemptions);
    const evictions = snapshot.kvEvictions ?? stats.kvEvictions;
    const de = evictions === undefined ? 0 : delta(evictions, prev?.evictions);
    // Touching each series once makes it appear (at 0) from the first snapshot on, so rate() has a starting point.
    this.prefixQueries.inc({ worker }, dq);
    this.prefixHits.inc({ worker }, dh);
    this.preemptions.inc({ model, worker }, dp);
    if (evictions !== undefined) this.evictions.inc({ worker }, de);
    if (stats.requestMigrations !== undefined) this.migrations.inc({ worker }, delta(stats.requestMigrations, prev?.migrations));
    for (const [link, now] of Object.entries(stats.kvTransferLinks ?? {})) {
      const before = prev?.kvLinks[link];
      this.kvTransferFallbacks.inc({ worker, link }, delta(now.fallbacks, before?.fallbacks));
      for (const [reason, count] of Object.entries(now.failures)) {
        this.kvTransferFailures.inc({ worker, link, reason }, delta(count, before?.failures[reason]));
      }
    }

    const memory: Record<string, number> = {};
    if (stats.memory !== undefined) {
      memory.weights = stats.memory.weightsBytes;
      memory.kv_cache = stats.memory.kvCacheBytes;
      if (stats.memory.activationsBytes !== undefined) memory.activations = stats.memory.activationsBytes;
      if (stats.memory.loraAdaptersBytes !== undefined) memory.lora_adapters = stats.memory.loraAdaptersBytes;
    }
    const ram = stats.kvTiers?.tiers.ram;
    if (ram !== undefined) memory.kv_offload_ram = ram.usedBlocks * ram.blockBytes;
    for (const [category, bytes] of Object.entries(memory)) this.memory.set({ worker, category }, bytes);
    const failures = stats.allocationFailures;
    if (failures !== undefined) {
      this.kvBlockShortfalls.inc({ worker }, delta(failures.kvBlocks, prev?.kvBlockFailures));
      if (failures.scratch !== undefined) this.oomEvents.inc({ worker, kind: 'scratch' }, delta(failures.scratch, prev?.scratchFailures));
    }
    this.lastStats.set(worker, {
      queries: stats.prefixCacheQueries, hits: stats.prefixCacheHits, preemptions: stats.preemptions,
      evictions: evictions ?? prev?.evictions ?? 0, migrations: stats.requestMigrations ?? prev?.migrations ?? 0, model, tiers,
      tierCounters: { ...prev?.tierCounters, ...tierCounters },
      kvLinks: { ...prev?.kvLinks, ...stats.kvTransferLinks },
      memoryCategories: [...new Set([...(prev?.memoryCategories ?? []), ...Object.keys(memory)])],
      kvBlockFailures: failures?.kvBlocks ?? prev?.kvBlockFailures ?? 0,
      scratchFailures: failures?.scratch ?? prev?.scratchFailures ?? 0,
    });
  }

  /** How a served model's weights are stored (EngineInfo.quantization): the prefill histogram's label for it. */
  setQuantization(model: string, quantization: string): void {
    this.quantization.set(model, quantization);
  }

  /** Drops a worker's load series (it left the pool), so its last values do not linger. */
  forgetWorker(worker: string): void {
    const prev = this.lastStats.get(worker);
    if (!prev) return;
    this.lastStats.delete(worker);
    this.queueDepth.remove({ model: prev.model, worker });
    this.batchSize.remove({ model: prev.model, worker });
    for (const tier of [PRIMARY_KV_TIER, ...prev.tiers]) {
      this.kvUtilization.remove({ worker, tier });
      this.kvTierUsed.remove({ worker, tier });
      this.kvTierCapacity.remove({ worker, tier });
    }
    for (const category of prev.memoryCategories) this.memory.remove({ worker, category });
  }

  recordSampling(kept: boolean, reason: string): void {
    this.samplingDecisions.inc({ kept: kept ? 'true' : 'false', reason });
  }

  recordBottleneck(category: string): void {
    this.bottlenecks.inc({ category });
  }

  recordDroppedRecord(reason: 'expired' | 'overflow'): void {
    this.droppedRecords.inc({ reason });
  }
}
