// Why was a request slow? The analyzer splits a request's time into its phases and names the bottleneck with a
// recommendation; over a window of requests it reports where time goes on average and which bottleneck is most
// common among the slow ones (GET /v1/analysis).
//
// The rules, in order:
//   1. decode_latency_spike when decode dominates the request and a step took over `spikeFactor` times the median;
//   2. queue_saturation     when the scheduler queue is over `queueShare` of TTFT;
//   3. prefill_no_cache / prefill_compute_bound when prefill is over `prefillShare` of TTFT (split by the prefix
//      cache hit rate);
//   4. kv_transfer_bound    when the KV transfer is over `kvTransferShare` of TTFT;
//   5. decode_latency_spike when a step spiked, even though decode did not dominate;
//   6. balanced.
// Shares of TTFT are of the measured TTFT (arrival to first streamed token), so what is not attributed to a phase
// (dispatch, thread hand-off, the first write) still counts in the denominator.

import type { PhaseName } from './lifecycle.ts';
import { quantile, round3 } from '../util/stats.ts';
import { phaseBreakdown, type RequestTrace } from './trace.ts';

export type BottleneckCategory =
  | 'queue_saturation' | 'prefill_no_cache' | 'prefill_compute_bound' | 'kv_transfer_bound' | 'decode_latency_spike' | 'balanced';

export const BOTTLENECK_CATEGORIES: readonly BottleneckCategory[] = [
  'queue_saturation', 'prefill_no_cache', 'prefill_compute_bound', 'kv_transfer_bound', 'decode_latency_spike', 'balanced',
];

export interface AnalyzerThresholds {
  queueShare: number;
  prefillShare: number;
  kvTransferShare: number;
  /** Below this prefix-cache hit rate a prefill-bound request is "no cache". */
  noCacheHitRate: number;
  /** A decode step over this multiple of the median step is a spike. */
  spikeFactor: number;
  /** Steps over this multiple of the median are counted as spikes in the recommendation. */
  spikeCountFactor: number;
  /** Fewer decode steps than this are too few for a median. */
  minDecodeSteps: number;
}

export const DEFAULT_THRESHOLDS: Readonly<AnalyzerThresholds> = Object.freeze({
  queueShare: 0.6,
  prefillShare: 0.7,
  kvTransferShare: 0.4,
  noCacheHitRate: 0.1,
  spikeFactor: 3,
  spikeCountFactor: 2,
  minDecodeSteps: 4,
});

/** Milliseconds per part of the request (keys as in the JSON report). */
export interface BreakdownMs {
  gateway: number;
  routing: number;
  queue: number;
  prefill: number;
  kv_transfer: number;
  /** Time to first token not in any phase above. */
  other_before_first_token: number;
  decode: number;
}

export interface Diagnosis {
  request_id: string;
  category: BottleneckCategory;
  /** The phase the category points at ('none' for balanced). */
  dominant_phase: PhaseName | 'none';
  /** Its share (0..1) of TTFT for the TTFT categories, of decode time for a decode spike, 0 for balanced. */
  dominant_share: number;
  dominant_ms: number;
  recommendation: string;
  ttft_ms: number | null;
  total_ms: number;
  breakdown_ms: BreakdownMs;
}

function pct(share: number): string {
  return `${(share * 100).toFixed(0)}%`;
}

function ms(x: number): string {
  return x >= 100 ? `${x.toFixed(0)} ms` : `${x.toFixed(1)} ms`;
}

function bytes(n: number): string {
  if (n >= 1 << 30) return `${(n / (1 << 30)).toFixed(2)} GiB`;
  if (n >= 1 << 20) return `${(n / (1 << 20)).toFixed(1)} MiB`;
  if (n >= 1 << 10) return `${(n / (1 << 10)).toFixed(1)} KiB`;
  return `${n} B`;
}

export class TraceAnalyzer {
  readonly thresholds: Readonly<AnalyzerThresholds>;

  constructor(thresholds: Partial<AnalyzerThresholds> = {}) {
    this.thresholds = { ...DEFAULT_THRESHOLDS, ...thresholds };
  }

  classify(trace: RequestTrace): Diagnosis {
    const t = this.thresholds;
    const b = phaseBreakdown(trace);
    const ttft = trace.ttftMs;
    const beforeFirst = b.gatewayMs + b.routingMs + b.queueMs + b.prefillMs + b.kvTransferMs;
    const ttftBase = Math.max(ttft ?? beforeFirst, beforeFirst, 1e-9);
    const breakdown: BreakdownMs = {
      gateway: round3(b.gatewayMs), routing: round3(b.routingMs), queue: round3(b.queueMs), prefill: round3(b.prefillMs), kv_transfer: round3(b.kvTransferMs),
      other_before_first_token: round3(Math.max(0, (ttft ?? beforeFirst) - beforeFirst)), decode: round3(b.decodeMs),
    };
    const base = { request_id: trace.requestId, ttft_ms: ttft === undefined ? null : round3(ttft), total_ms: round3(trace.e2eMs), breakdown_ms: breakdown };
    const make = (category: BottleneckCategory, phase: PhaseName | 'none', share: number, dominantMs: number, recommendation: string): Diagnosis => (
      { ...base, category, dominant_phase: phase, dominant_share: round3(share), dominant_ms: round3(dominantMs), recommendation });

    const spike = this.spike(trace);
    const decodeDominates = b.decodeMs > ttftBase;
    if (spike && decodeDominates) return make('decode_latency_spike', 'decode_execution', spike.share, spike.spikeMs, spike.recommendation);

    const queueShare = b.queueMs / ttftBase;
    if (queueShare > t.queueShare) {
      const depth = trace.queueDepthAtEntry !== undefined ? ` with ${trace.queueDepthAtEntry} requests ahead` : '';
      const where = trace.worker ? ` on ${trace.worker}` : '';
      return make('queue_saturation', 'scheduler_queue', queueShare, b.queueMs,
        `Queue wait ${ms(b.queueMs)} is ${pct(queueShare)} of the ${ms(ttftBase)} TTFT${depth}: the worker${where} is saturated. ` +
        'Add workers or batch capacity, shed or rate-limit load, or let the router weigh queue depth more.');
    }

    const prefillShare = b.prefillMs / ttftBase;
    if (prefillShare > t.prefillShare) {
      const hitRate = trace.cachedTokens / Math.max(1, trace.promptTokens);
      const computed = trace.prefill?.computedTokens ?? Math.max(0, trace.promptTokens - trace.cachedTokens);
      if (hitRate < t.noCacheHitRate) {
        return make('prefill_no_cache', 'prefill_execution', prefillShare, b.prefillMs,
          `Prefill ${ms(b.prefillMs)} is ${pct(prefillShare)} of TTFT and ${pct(hitRate)} of the ${trace.promptTokens}-token prompt came from ` +
          'the prefix cache. Keep shared content (system prompt, documents) at the start of prompts, route by KV overlap, ' +
          'or give the KV cache more blocks so prefixes survive.');
      }
      return make('prefill_compute_bound', 'prefill_execution', prefillShare, b.prefillMs,
        `Prefill ${ms(b.prefillMs)} is ${pct(prefillShare)} of TTFT despite a ${pct(hitRate)} prefix-cache hit: computing ${computed} tokens ` +
        'is the cost. Use chunked prefill so it shares steps with decodes, a faster backend, or disaggregated prefill workers.');
    }

    const kvShare = b.kvTransferMs / ttftBase;
    if (kvShare > t.kvTransferShare && trace.kvTransfer) {
      const kv = trace.kvTransfer;
      const rate = b.kvTransferMs > 0 ? `${bytes(kv.bytes / (b.kvTransferMs / 1000))}/s` : 'n/a';
      const link = kv.fromWorker && kv.toWorker ? ` from ${kv.fromWorker} to ${kv.toWorker}` : '';
      return make('kv_transfer_bound', 'kv_transfer', kvShare, b.kvTransferMs,
        `KV transfer${link} took ${ms(b.kvTransferMs)} (${bytes(kv.bytes)} at ${rate}), ${pct(kvShare)} of TTFT. ` +
        'Pair prefill and decode workers on the same host, use a faster transfer channel, or serve short prompts without disaggregation.');
    }

    if (spike) return make('decode_latency_spike', 'decode_execution', spike.share, spike.spikeMs, spike.recommendation);

    const total = Math.max(trace.e2eMs, 1e-9);
    return make('balanced', 'none', 0, 0,
      `No single phase dominates: queue ${pct(b.queueMs / total)}, prefill ${pct(b.prefillMs / total)}, decode ${pct(b.decodeMs / total)} ` +
      'of the request.');
  }

  private spike(trace: RequestTrace): { share: number; spikeMs: number; recommendation: string } | undefined {
    const t = this.thresholds;
    const steps = trace.decode?.stepMs ?? [];
    if (steps.length < t.minDecodeSteps) return undefined;
    const median = quantile(steps, 0.5);
    let maxStep = 0;
    for (const s of steps) if (s > maxStep) maxStep = s;
    if (!(median > 0) || maxStep <= t.spikeFactor * median) return undefined;
    let spikeMs = 0;
    let spikes = 0;
    let total = 0;
    for (const s of steps) {
      total += s;
      if (s > t.spikeCountFactor * median) {
        spikes++;
        spikeMs += s;
      }
    }
    return {
      share: total > 0 ? spikeMs / total : 0,
      spikeMs,
      recommendation: `Decode steps spiked: max ${ms(maxStep)} against a median of ${ms(median)}, ${spikes} of ${steps.length} steps over ` +
        `${t.spikeCountFactor}x the median. Look for preemptions (KV cache pressure), long prefill chunks sharing the batch ` +
        '(lower the chunk size), or event-loop and GC pauses.',
    };
  }

  /** Where time goes over a set of requests, and the commonest bottleneck among the slow ones. */
  analyze(traces: Iterable<RequestTrace>, options: WindowOptions = {}): WindowAnalysis {
    const slowTtftMs = options.slowTtftMs ?? 200;
    const slowTbtMs = options.slowTbtMs ?? 50;
    const shareSums = { gateway: 0, routing: 0, queue: 0, prefill: 0, kv_transfer: 0, decode: 0, other: 0 };
    const categories = Object.fromEntries(BOTTLENECK_CATEGORIES.map((c) => [c, 0])) as Record<BottleneckCategory, number>;
    const examples: Partial<Record<BottleneckCategory, string[]>> = {};
    const slowDiagnoses: Diagnosis[] = [];
    let requests = 0;
    for (const trace of traces) {
      if (trace.outcome !== 'ok') continue;
      requests++;
      const b = phaseBreakdown(trace);
      const total = Math.max(trace.e2eMs, 1e-9);
      const parts = { gateway: b.gatewayMs, routing: b.routingMs, queue: b.queueMs, prefill: b.prefillMs, kv_transfer: b.kvTransferMs, decode: b.decodeMs };
      let attributed = 0;
      for (const [k, v] of Object.entries(parts)) {
        shareSums[k as keyof typeof parts] += v / total;
        attributed += v;
      }
      shareSums.other += Math.max(0, total - attributed) / total;
      const worstTbt = trace.tbtMs.length > 0 ? Math.max(...trace.tbtMs) : 0;
      const slow = (trace.ttftMs ?? 0) >= slowTtftMs || worstTbt >= slowTbtMs;
      if (!slow) continue;
      const d = this.classify(trace);
      slowDiagnoses.push(d);
      categories[d.category]++;
      const list = (examples[d.category] ??= []);
      if (list.length < 3) list.push(trace.requestId);
    }
    const phase_share = Object.fromEntries(
      Object.entries(shareSums).map(([k, v]) => [k, requests > 0 ? round3(v / requests) : 0]),
    ) as WindowAnalysis['phase_share'];
    let primary: BottleneckCategory = 'balanced';
    let best = 0;
    for (const c of BOTTLENECK_CATEGORIES) {
      // The commonest named bottleneck; 'balanced' only when it outnumbers every named one.
      if (c !== 'balanced' && categories[c] > best) [primary, best] = [c, categories[c]];
    }
    if (categories.balanced > best) primary = 'balanced';
    const representative = slowDiagnoses.find((d) => d.category === primary);
    const recommendation = slowDiagnoses.length === 0
      ? 'No slow requests in the window.'
      : representative?.recommendation ?? 'No single bottleneck dominates the slow requests.';
    return {
      requests, slow_requests: slowDiagnoses.length, slow_ttft_ms: slowTtftMs, slow_tbt_ms: slowTbtMs,
      phase_share, categories, primary_bottleneck: primary, recommendation, examples,
    };
  }
}

export interface WindowOptions {
  /** A request is slow when its TTFT reaches this (default 200 ms, the TTFT target)... */
  slowTtftMs?: number;
  /** ...or when one of its token gaps reaches this (default 50 ms, the TBT target). */
  slowTbtMs?: number;
}

export interface WindowAnalysis {
  requests: number;
  slow_requests: number;
  slow_ttft_ms: number;
  slow_tbt_ms: number;
  /** Mean share of end-to-end time per part, over all finished requests in the window. */
  phase_share: { gateway: number; routing: number; queue: number; prefill: number; kv_transfer: number; decode: number; other: number };
  /** Slow requests per bottleneck. */
  categories: Record<BottleneckCategory, number>;
  primary_bottleneck: BottleneckCategory;
  recommendation: string;
  /** Up to three request ids per category, for GET /v1/requests/{id}/trace. */
  examples: Partial<Record<BottleneckCategory, string[]>>;
}

