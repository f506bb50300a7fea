// Per-request views: the `timings` object a response carries, the JSON of GET /v1/requests/{id}/trace, a bounded
// store of recent traces behind it, and the text waterfall `conduit trace <id>` prints.

import { max, percentileOf, round3 } from '../util/stats.ts';
import { phaseBreakdown, prefillSkipped, type RequestTrace } from './trace.ts';
import { formatTraceparent } from './traceparent.ts';

// ---------------------------------------------------------------------------------------------------------------
// Response timings

/** Milliseconds per phase of one request, as a response body carries them (snake_case like the rest of the API). */
export interface ResponseTimings {
  /** Arrival to the first streamed token (or to the engine's first token for a non-streaming response). */
  ttft_ms: number | null;
  /** Arrival to the end of the response (or to now, for a response still being written). */
  total_ms: number;
  gateway_ms: number;
  routing_ms: number;
  queue_ms: number;
  prefill_ms: number;
  /**
   * Only for a disaggregated request: the prompt's KV moving to the decode worker. After the first token (the prefill
   * worker streams it), so within decode_ms; a transfer before the first token would be within ttft_ms.
   */
  kv_transfer_ms?: number;
  /**
   * Only for a disaggregated request: what moved, over which link (shm, tcp), and the rate (bytes / transfer time;
   * 0 when nothing moved because the decode worker held every block).
   */
  kv_transfer?: { bytes: number; blocks: number; link: string | null; ms: number; bytes_per_sec: number };
  /**
   * Only for a transfer streamed while the prefill ran (worker processes): its time hidden behind the prefill, not
   * in kv_transfer_ms.
   */
  kv_transfer_overlap_ms?: number;
  /** Only when prompt blocks were copied back from the worker's lower KV tiers: blocks per tier and the copy's ms. */
  kv_onboard?: { ram_blocks: number; disk_blocks: number; bytes: number; ms: number };
  decode_ms: number;
  /** Median gap between streamed tokens. */
  tbt_p50_ms: number | null;
  cached_tokens: number;
  /** The worker computed no prompt token beyond the one always recomputed (prefix-cache hit or KV transfer). */
  prefill_skipped: boolean;
  /** The LoRA adapter the request ran with, when it named one. */
  lora_adapter?: string;
}

function kvTransferTimings(kv: NonNullable<RequestTrace['kvTransfer']>): NonNullable<ResponseTimings['kv_transfer']> {
  const ms = Math.max(0, kv.endMs - kv.startMs);
  return {
    bytes: kv.bytes, blocks: kv.blocks ?? 0, link: kv.link ?? null, ms: round3(ms),
    bytes_per_sec: ms > 0 ? Math.round(kv.bytes / (ms / 1000)) : 0,
  };
}

export function responseTimings(trace: RequestTrace): ResponseTimings {
  const b = phaseBreakdown(trace);
  return {
    ttft_ms: trace.ttftMs === undefined ? null : round3(trace.ttftMs),
    total_ms: round3(b.totalMs),
    gateway_ms: round3(b.gatewayMs),
    routing_ms: round3(b.routingMs),
    queue_ms: round3(b.queueMs),
    prefill_ms: round3(b.prefillMs),
    ...(trace.kvTransfer ? { kv_transfer_ms: round3(b.kvTransferMs + b.decodeKvTransferMs), kv_transfer: kvTransferTimings(trace.kvTransfer) } : {}),
    ...(trace.kvTransfer?.overlapMs !== undefined ? { kv_transfer_overlap_ms: round3(trace.kvTransfer.overlapMs) } : {}),
    ...(trace.kvOnboard ? {
      kv_onboard: { ram_blocks: trace.kvOnboard.ram, disk_blocks: trace.kvOnboard.disk, bytes: trace.kvOnboard.bytes, ms: round3(trace.kvOnboard.ms) },
    } : {}),
    decode_ms: round3(b.decodeMs),
    tbt_p50_ms: trace.tbtMs.length > 0 ? round3(percentileOf(trace.tbtMs, 0.5)) : null,
    cached_tokens: trace.cachedTokens,
    prefill_skipped: prefillSkipped(trace),
    ...(trace.adapter !== undefined ? { lora_adapter: trace.adapter } : {}),
  };
}

// ---------------------------------------------------------------------------------------------------------------
// JSON view of a trace

export interface TraceView {
  request_id: string;
  trace_id: string | null;
  /** traceparent of the request's root span: paste into a tracing backend's search, or continue the trace. */
  traceparent: string | null;
  /** The traceparent the engine handed back with the request's outputs (the context it ran under). */
  engine_traceparent: string | null;
  /** The client's tracestate, passed on unchanged. */
  tracestate: string | null;
  model: string;
  /** The LoRA adapter the request ran with (model is then its base model). */
  lora_adapter?: string;
  tenant: string | null;
  worker: string | null;
  outcome: RequestTrace['outcome'];
  finish_reason: string;
  error_type: string | null;
  status: number | null;
  ended_in_phase: string | null;
  arrival_unix_ms: number;
  usage: { prompt_tokens: number; completion_tokens: number; cached_tokens: number };
  timings: ResponseTimings;
  /** Offsets from arrival, in ms. */
  phases: { phase: string; start_ms: number; duration_ms: number; worker?: string; incomplete?: boolean; attributes?: Record<string, string | number | boolean> }[];
  decode: { steps: number; source: string; step_p50_ms: number | null; step_max_ms: number | null } | null;
  tbt: { count: number; p50_ms: number | null; p99_ms: number | null; max_ms: number | null };
  sampling: string | null;
  /** Request migrations: the worker lost mid-stream, the one that took over, and after how many tokens. */
  migrations: { from_worker: string; to_worker: string | null; after_tokens: number; reason: string }[];
}

export function traceView(trace: RequestTrace): TraceView {
  const at = (x: number) => round3(x - trace.arrivalMs);
  const tbt = trace.tbtMs;
  const steps = trace.decode?.stepMs ?? [];
  return {
    request_id: trace.requestId,
    trace_id: trace.traceId ?? null,
    traceparent: trace.traceId && trace.rootSpanId ? formatTraceparent(trace.traceId, trace.rootSpanId, trace.headSampling?.sampled ?? false) : null,
    engine_traceparent: trace.engineTraceparent ?? null,
    tracestate: trace.tracestate ?? null,
    model: trace.model,
    ...(trace.adapter !== undefined ? { lora_adapter: trace.adapter } : {}),
    tenant: trace.tenant ?? null,
    worker: trace.worker ?? null,
    outcome: trace.outcome,
    finish_reason: trace.finishReason,
    error_type: trace.errorType ?? null,
    status: trace.status ?? null,
    ended_in_phase: trace.endedInPhase ?? null,
    arrival_unix_ms: round3(trace.arrivalMs),
    usage: { prompt_tokens: trace.promptTokens, completion_tokens: trace.outputTokens, cached_tokens: trace.cachedTokens },
    timings: responseTimings(trace),
    phases: trace.phases.map((p) => ({
      phase: p.phase, start_ms: at(p.startMs), duration_ms: round3(p.endMs - p.startMs),
      ...(p.worker !== undefined ? { worker: p.worker } : {}),
      ...(p.incomplete ? { incomplete: true } : {}),
      ...(p.attributes ? { attributes: { ...p.attributes } } : {}),
    })),
    decode: trace.decode ? {
      steps: trace.decode.steps, source: trace.decode.source,
      step_p50_ms: steps.length > 0 ? round3(percentileOf(steps, 0.5)) : null,
      step_max_ms: steps.length > 0 ? round3(max(steps)) : null,
    } : null,
    tbt: {
      count: tbt.length,
      p50_ms: tbt.length > 0 ? round3(percentileOf(tbt, 0.5)) : null,
      p99_ms: tbt.length > 0 ? round3(percentileOf(tbt, 0.99)) : null,
      max_ms: tbt.length > 0 ? round3(max(tbt)) : null,
    },
    sampling: trace.headSampling?.reason ?? null,
    migrations: (trace.routing?.migrations ?? []).map((m) => ({
      from_worker: m.fromWorker, to_worker: m.toWorker ?? null, after_tokens: m.afterTokens, reason: m.reason,
    })),
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Recent traces

/**
 * The last `capacity` finished requests, by id. A fixed ring: adding the (capacity+1)-th trace forgets the oldest,
 * so memory stays bounded whatever the traffic.
 */
export class TraceStore {
  private readonly ring: (RequestTrace | undefined)[];
  private readonly byId = new Map<string, number>();
  private next = 0;
  private count = 0;

  constructor(readonly capacity = 1000) {
    if (!(capacity > 0)) throw new RangeError('capacity must be positive');
    this.ring = new Array<RequestTrace | undefined>(capacity);
  }

  get size(): number {
    return this.count;
  }

  add(trace: RequestTrace): void {
    const old = this.ring[this.next];
    if (old && this.byId.get(old.requestId) === this.next) this.byId.delete(old.requestId);
    this.ring[this.next] = trace;
    this.byId.set(trace.requestId, this.next);
    this.next = (this.next + 1) % this.capacity;
    if (this.count < this.capacity) this.count++;
  }

  get(requestId: string): RequestTrace | undefined {
    const i = this.byId.get(requestId);
    return i === undefined ? undefined : this.ring[i];
  }

  /** Newest first. */
  recent(limit = this.capacity): RequestTrace[] {
    const out: RequestTrace[] = [];
    for (let k = 1; k <= this.count && out.length < limit; k++) {
      out.push(this.ring[(this.next - k + this.capacity) % this.capacity]!);
    }
    return out;
  }

  /** Traces that ended at or after `sinceMs`, newest first. */
  endedSince(sinceMs: number): RequestTrace[] {
    return this.recent().filter((t) => t.endMs >= sinceMs);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Text waterfall

export interface WaterfallOptions {
  /** Columns of the bar area. */
  width?: number;
  /** Rows of one phase beyond which they are drawn as one (prefill chunks). */
  maxRowsPerPhase?: number;
}

function fmt(ms: number): string {
  if (ms >= 1000) return ms.toFixed(0);
  if (ms >= 10) return ms.toFixed(1);
  return ms.toFixed(2);
}

/**
 * One row per phase, a bar placed on a time axis from arrival to the end:
 *
 *   phase                start ms   dur ms  |0 ms                                       1842 ms|
 *   http_receive             0.00     0.50  |
 *   scheduler_queue          1.90     5.20  ##
 *   ...
 *   first token             42.30           ^
 *
 * Phases shorter than one column show as '|'. Ends with decode and TBT summaries.
 */
export function formatWaterfall(trace: RequestTrace, options: WaterfallOptions = {}): string {
  const width = Math.max(10, options.width ?? 60);
  const maxRows = options.maxRowsPerPhase ?? 8;
  const total = Math.max(trace.e2eMs, 1e-9);
  const col = (ms: number) => Math.min(width - 1, Math.max(0, Math.floor(((ms - trace.arrivalMs) / total) * width)));
  const lines: string[] = [];

  const status = trace.outcome === 'ok' ? `ok (${trace.finishReason})`
    : trace.outcome === 'error' ? `error ${trace.errorType ?? ''}${trace.status ? ` ${trace.status}` : ''} in ${trace.endedInPhase ?? '?'}`
      : `aborted${trace.abortReason ? ` (${trace.abortReason})` : ''} in ${trace.endedInPhase ?? '?'}`;
  lines.push(`request ${trace.requestId}  model ${trace.model}${trace.worker ? `  worker ${trace.worker}` : ''}  ${status}`);
  lines.push(
    `total ${fmt(trace.e2eMs)} ms  TTFT ${trace.ttftMs === undefined ? '-' : `${fmt(trace.ttftMs)} ms`}  ` +
    `prompt ${trace.promptTokens} tokens (${trace.cachedTokens} cached)  output ${trace.outputTokens} tokens` +
    `${trace.traceId ? `  trace ${trace.traceId}` : ''}`,
  );
  lines.push('');

  // Rows are collected first so the name column fits the longest name.
  const rows: { name: string; startMs: number; endMs: number; glyph: string }[] = [];
  const right = `${fmt(trace.e2eMs)} ms|`;
  const ruler = `|0 ms${' '.repeat(Math.max(1, width - 5 - right.length + 1))}${right}`;

  const bar = (startMs: number, endMs: number, glyph = '#'): string => {
    const a = col(startMs);
    const span = ((endMs - startMs) / total) * width;
    if (span < 1) return `${' '.repeat(a)}|`;
    const len = Math.max(1, Math.min(width - a, Math.round(span)));
    return `${' '.repeat(a)}${glyph.repeat(len)}`;
  };
  const row = (name: string, startMs: number, endMs: number, glyph = '#') => {
    rows.push({ name, startMs, endMs, glyph });
  };

  // Group rows of the same phase that follow one another (prefill chunks) when there are many. Prefill chunks after
  // the first token (an n > 1 request's further completions, forced text, a recompute) ran within decode: named so.
  const phases = trace.phases;
  const nameOf = (x: (typeof phases)[number]) => (x.attributes?.after_first_token === true ? `${x.phase} (in decode)` : x.phase);
  for (let i = 0; i < phases.length;) {
    const p = phases[i]!;
    let j = i;
    while (j < phases.length && nameOf(phases[j]!) === nameOf(p)) j++;
    const run = phases.slice(i, j);
    if (run.length > maxRows) {
      const start = Math.min(...run.map((x) => x.startMs));
      const end = Math.max(...run.map((x) => x.endMs));
      row(`${nameOf(p)} x${run.length}`, start, end);
    } else {
      for (const x of run) {
        const suffix = x.phase === 'decode_execution' ? ` (${trace.decode?.steps ?? 0} steps)`
          : x.phase === 'streaming_response' ? (trace.emits.writes > 0 ? ` (${trace.emits.writes} writes)` : ' (body)') : x.incomplete ? ' (cut short)' : '';
        row(`${nameOf(x)}${suffix}`, x.startMs, x.endMs, x.incomplete ? '~' : '#');
      }
    }
    i = j;
  }
  const label = Math.max(18, ...rows.map((r) => r.name.length)) + 2;
  lines.push(`${'phase'.padEnd(label)}${'start ms'.padStart(10)}${'dur ms'.padStart(10)}  ${ruler}`);
  for (const r of rows) {
    lines.push(`${r.name.padEnd(label)}${fmt(r.startMs - trace.arrivalMs).padStart(10)}${fmt(r.endMs - r.startMs).padStart(10)}  ${bar(r.startMs, r.endMs, r.glyph)}`);
  }
  if (trace.ttftMs !== undefined) {
    lines.push(`${'first token'.padEnd(label)}${fmt(trace.ttftMs).padStart(10)}${''.padStart(10)}  ${' '.repeat(col(trace.arrivalMs + trace.ttftMs))}^`);
  }

  lines.push('');
  const d = trace.decode;
  if (d) {
    const steps = d.stepMs;
    const stepText = steps.length > 0 ? `, step p50 ${fmt(percentileOf(steps, 0.5))} ms, max ${fmt(max(steps))} ms` : '';
    lines.push(`decode: ${d.steps} steps${stepText} (from ${d.source.replace('_', ' ')})`);
  }
  if (trace.tbtMs.length > 0) {
    lines.push(`time between tokens: p50 ${fmt(percentileOf(trace.tbtMs, 0.5))} ms, p99 ${fmt(percentileOf(trace.tbtMs, 0.99))} ms, max ${fmt(max(trace.tbtMs))} ms over ${trace.tbtMs.length} gaps`);
  }
  if (trace.outcome === 'error' && trace.errorMessage) lines.push(`error: ${trace.errorMessage}`);
  return `${lines.join('\n')}\n`;
}
