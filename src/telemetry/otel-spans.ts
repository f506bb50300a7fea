// A finished RequestTrace becomes an OpenTelemetry span tree, built after the fact with explicit start and end
// times, so the request path itself only stamps times. The tree:
//
//   request
//   ├─ gateway { http_receive, auth, rate_limit, validate, tokenize }
//   ├─ routing { kv_cache_lookup, load_balance }
//   ├─ prefill_dispatch
//   ├─ scheduling { queue_wait, budget_allocation }
//   ├─ prefill { model_forward_prefill (one per chunk up to the first token) }
//   ├─ decode_dispatch                (disaggregated only: the hand-over after the first token)
//   ├─ kv_transfer                    (disaggregated only)
//   ├─ decode { model_forward_prefill (chunks after the first token), decode_step ... }
//                                     (steps only with per-token spans; otherwise summarised on decode)
//   └─ token_emit                     (one span over the streamed writes; one per write with per-token spans)
//
// The engine's part (scheduling, prefill, kv_transfer, decode) goes under the span named by the traceparent the
// engine handed back with its outputs: the root span when the gateway passed its own context, another span of the
// same trace when something between them (a remote worker) put its own there.
//
// Span names follow the request/routing/scheduling/prefill/decode hierarchy of the observability design; each span
// also carries `conduit.phase` with the phase name used by events, metrics and timings, so the two join.

import {
  ROOT_CONTEXT, SpanKind, SpanStatusCode, TraceFlags, trace as otelTrace,
  type Attributes, type Context, type Span, type SpanContext, type Tracer,
} from '@opentelemetry/api';
import { millisToHrTime, TraceState } from '@opentelemetry/core';
import { GATEWAY_PHASES } from './lifecycle.ts';
import type { ReservedIdGenerator } from './otel-provider.ts';
import { mean, percentile, round3 } from '../util/stats.ts';
import { formatWorkerCosts, prefillSkipped, type RequestTrace } from './trace.ts';
import { parseTraceparent } from './traceparent.ts';

/**
 * Where the engine's spans go: under the span the engine's traceparent names when that is a span of this trace
 * (the root, or one outside this tree), else under the root (no traceparent came back, or one of another trace).
 */
function engineParentContext(header: string | undefined, root: SpanContext, rootContext: Context): Context {
  const engine = parseTraceparent(header);
  if (!engine || engine.traceId !== root.traceId || engine.parentSpanId === root.spanId) return rootContext;
  return otelTrace.setSpanContext(ROOT_CONTEXT, {
    traceId: engine.traceId, spanId: engine.parentSpanId, isRemote: true,
    traceFlags: engine.sampled ? TraceFlags.SAMPLED : TraceFlags.NONE,
  });
}

export interface SpanOptions {
  /** One span per decode step and per streamed write instead of a summary on decode and token_emit. */
  perTokenSpans?: boolean;
  /** Why the request was kept (the tail sampling reason), recorded on the root span. */
  keptBecause?: string;
}

function hr(ms: number): [number, number] {
  return millisToHrTime(ms);
}

function clean(attrs: Record<string, string | number | boolean | undefined>): Attributes {
  const out: Attributes = {};
  for (const k in attrs) {
    const v = attrs[k];
    if (v === undefined || (typeof v === 'number' && !Number.isFinite(v))) continue;
    out[k] = v;
  }
  return out;
}

/**
 * The GenAI semantic conventions' `gen_ai.operation.name` (a required attribute) of each generation endpoint: the
 * Responses API generates a chat turn as Chat Completions does.
 */
const GEN_AI_OPERATIONS: Readonly<Record<string, string>> = {
  '/v1/chat/completions': 'chat',
  '/v1/responses': 'chat',
  '/v1/completions': 'text_completion',
};

/** Sorted copy, for several percentiles of one array at the price of one sort. */
function sortedOf(values: readonly number[]): Float64Array {
  return Float64Array.from(values).sort();
}

/**
 * Builds and ends the span tree of one finished request. With `ids`, the root span takes the trace and span ids
 * reserved for the request at arrival. Returns the root span's context.
 */
export function emitRequestSpans(tracer: Tracer, trace: RequestTrace, options: SpanOptions = {}, ids?: ReservedIdGenerator): SpanContext {
  let parentContext: Context = ROOT_CONTEXT;
  if (trace.parent) {
    parentContext = otelTrace.setSpanContext(ROOT_CONTEXT, {
      traceId: trace.parent.traceId, spanId: trace.parent.parentSpanId, isRemote: true,
      traceFlags: trace.parent.sampled ? TraceFlags.SAMPLED : TraceFlags.NONE,
      ...(trace.tracestate !== undefined ? { traceState: new TraceState(trace.tracestate) } : {}),
    });
  }
  const tbt = trace.tbtMs;
  const tbtSorted = sortedOf(tbt);
  const tbtP50 = percentile(tbtSorted, 0.5);
  const tbtP99 = percentile(tbtSorted, 0.99);
  const e2eSec = trace.e2eMs / 1000;
  const streamBegan = trace.emits.writes > 0;
  const rootAttributes = clean({
    'conduit.phase': 'request',
    'request.id': trace.requestId,
    'request.model': trace.model,
    'request.lora_adapter': trace.adapter,
    'request.tenant': trace.tenant,
    'request.worker': trace.worker,
    'request.prompt_tokens': trace.promptTokens,
    'request.output_tokens': trace.outputTokens,
    'request.cached_tokens': trace.cachedTokens,
    'request.max_output_tokens': trace.maxTokens,
    'request.temperature': trace.temperature,
    'request.stream': trace.stream,
    'request.n': trace.n,
    'request.ttft_ms': trace.ttftMs !== undefined ? round3(trace.ttftMs) : undefined,
    'request.ttft_source': trace.ttftSource,
    'request.total_time_ms': round3(trace.e2eMs),
    'request.tokens_per_sec': e2eSec > 0 ? round3(trace.outputTokens / e2eSec) : undefined,
    'request.tbt_p50_ms': round3(tbtP50),
    'request.tbt_p99_ms': round3(tbtP99),
    'request.finish_reason': trace.finishReason,
    'request.outcome': trace.outcome,
    'request.prefill_skipped': prefillSkipped(trace),
    'request.ended_in_phase': trace.endedInPhase,
    'request.rate_limited': trace.rateLimited,
    'conduit.sampling.head': trace.headSampling?.reason,
    'conduit.sampling.kept_because': options.keptBecause,
    'conduit.engine.traceparent': trace.engineTraceparent,
    // GenAI semantic conventions, for backends that build LLM views from them.
    'gen_ai.operation.name': GEN_AI_OPERATIONS[String(trace.phases.find((p) => p.phase === 'http_receive')?.attributes?.route)],
    'gen_ai.request.model': trace.model,
    'gen_ai.request.max_tokens': trace.maxTokens,
    'gen_ai.request.temperature': trace.temperature,
    'gen_ai.usage.input_tokens': trace.promptTokens,
    'gen_ai.usage.output_tokens': trace.outputTokens,
    // The status line the client got: a stream that failed after it began went out under a 200, its failure as an SSE
    // error event; the status that failure stands for (a timeout's 504) is request.error_status.
    'http.response.status_code': streamBegan ? 200 : trace.status,
    'request.error_status': streamBegan && trace.outcome === 'error' ? trace.status : undefined,
  });

  // The conventions list one finish reason per completion; the trace records the request's one.
  if (trace.outcome === 'ok') rootAttributes['gen_ai.response.finish_reasons'] = [trace.finishReason];

  if (ids && trace.rootSpanId) ids.reserve(trace.parent ? undefined : trace.traceId, trace.rootSpanId);
  let root: Span;
  try {
    root = tracer.startSpan('request', { kind: SpanKind.SERVER, startTime: hr(trace.arrivalMs), attributes: rootAttributes }, parentContext);
  } finally {
    ids?.clear();
  }
  const rootContext = otelTrace.setSpan(ROOT_CONTEXT, root);
  const engineContext = engineParentContext(trace.engineTraceparent, root.spanContext(), rootContext);

  // HTTP semantic conventions for a SERVER span: a 5xx (or a failure with no status) is an error, a 4xx is the
  // client's and leaves the status unset, and success is not marked OK. The phase a server error ended in failed too.
  const errorMessage = trace.outcome === 'error' ? trace.errorMessage ?? trace.errorType ?? 'error' : undefined;
  const refusal = trace.status !== undefined && trace.status >= 400 && trace.status < 500;
  const serverError = errorMessage !== undefined && !refusal;
  /** The error message when `phase` is the phase a server error ended in (its span is then an error too). */
  const failedIn = (phase: string): string | undefined => (serverError && trace.endedInPhase === phase ? errorMessage : undefined);

  /** A finished span; `error`: its status is ERROR with this message. */
  const span = (parentCtx: Context, name: string, startMs: number, endMs: number, attrs: Record<string, string | number | boolean | undefined>,
    error?: string): Span => {
    const s = tracer.startSpan(name, { startTime: hr(startMs), attributes: clean(attrs) }, parentCtx);
    if (error !== undefined) s.setStatus({ code: SpanStatusCode.ERROR, message: error });
    s.end(hr(Math.max(startMs, endMs)));
    return s;
  };
  /** A parent span whose children are added by `fill` before it ends; `error` as for span(). */
  const group = (parentCtx: Context, name: string, startMs: number, endMs: number, attrs: Record<string, string | number | boolean | undefined>,
    fill: (ctx: Context) => void, error?: string): void => {
    const s = tracer.startSpan(name, { startTime: hr(startMs), attributes: clean(attrs) }, parentCtx);
    fill(otelTrace.setSpan(ROOT_CONTEXT, s));
    if (error !== undefined) s.setStatus({ code: SpanStatusCode.ERROR, message: error });
    s.end(hr(Math.max(startMs, endMs)));
  };

  // Gateway.
  const gatewayPhases = trace.phases.filter((p) => (GATEWAY_PHASES as readonly string[]).includes(p.phase));
  if (gatewayPhases.length > 0) {
    const start = Math.min(...gatewayPhases.map((p) => p.startMs));
    const end = Math.max(...gatewayPhases.map((p) => p.endMs));
    group(rootContext, 'gateway', start, end, { 'conduit.phase': 'gateway', 'gateway.time_ms': round3(end - start) }, (ctx) => {
      for (const p of gatewayPhases) {
        const attrs: Record<string, string | number | boolean | undefined> = { 'conduit.phase': p.phase };
        for (const [k, v] of Object.entries(p.attributes ?? {})) attrs[`${p.phase}.${k}`] = v;
        if (p.incomplete) attrs[`${p.phase}.completed`] = false;
        span(ctx, p.phase, p.startMs, p.endMs, attrs, failedIn(p.phase));
      }
    });
  }

  // Routing.
  const routing = trace.routing;
  if (routing) {
    const sub = routing.subPhasesMs;
    group(rootContext, 'routing', routing.startMs, routing.endMs, {
      'conduit.phase': 'router_lookup',
      'routing.strategy': routing.strategy,
      'routing.candidates': routing.candidates,
      'routing.kv_cache_hit': routing.kvCacheHit,
      'routing.overlap_tokens': routing.overlapTokens,
      'routing.selected_worker': routing.worker,
      'routing.prefill_worker': routing.prefillWorker,
      'routing.selection_reason': routing.reason,
      'routing.worker_costs': formatWorkerCosts(routing.costs),
      'routing.latency_ms': round3(routing.endMs - routing.startMs),
      // Request migration: how often the request lost its worker mid-stream, and where it went each time.
      'routing.migrations': routing.migrations?.length,
      'routing.migration_path': routing.migrations
        ?.map((m) => `${m.fromWorker} -> ${m.toWorker ?? 'none'} after ${m.afterTokens} tokens`).join('; '),
    }, (ctx) => {
      if (!sub) return;
      let t = routing.startMs;
      const lookupMs = (sub.hashing ?? 0) + (sub.indexLookup ?? 0);
      if (sub.hashing !== undefined || sub.indexLookup !== undefined) {
        span(ctx, 'kv_cache_lookup', t, t + lookupMs, {
          'conduit.phase': 'router_lookup', 'routing.hashing_ms': sub.hashing, 'routing.index_lookup_ms': sub.indexLookup,
          'routing.overlap_tokens': routing.overlapTokens, 'routing.kv_cache_hit': routing.kvCacheHit,
        });
        t += lookupMs;
      }
      if (sub.selection !== undefined) {
        span(ctx, 'load_balance', t, t + sub.selection, {
          'conduit.phase': 'router_lookup', 'routing.selection_ms': sub.selection, 'routing.selected_worker': routing.worker,
          'routing.candidates': routing.candidates,
        });
      }
    }, failedIn('router_lookup'));
  }

  for (const p of trace.phases) {
    if (p.phase === 'prefill_dispatch' || p.phase === 'decode_dispatch') {
      span(rootContext, p.phase, p.startMs, p.endMs, { 'conduit.phase': p.phase, 'dispatch.worker': p.worker }, failedIn(p.phase));
    }
  }

  // Scheduling.
  const queue = trace.phases.find((p) => p.phase === 'scheduler_queue');
  if (queue) {
    const budgetMs = trace.budgetMs;
    const end = queue.endMs + (budgetMs ?? 0);
    group(engineContext, 'scheduling', queue.startMs, end, {
      'conduit.phase': 'scheduler_queue',
      'scheduling.request_id': trace.requestId,
      'scheduling.queue_depth_at_entry': trace.queueDepthAtEntry,
      'scheduling.queue_time_ms': round3(queue.endMs - queue.startMs),
      'scheduling.budget_ms': budgetMs !== undefined ? round3(budgetMs) : undefined,
      'scheduling.budget_tokens': trace.budgetTokens,
      'scheduling.worker': queue.worker,
      'scheduling.completed': queue.incomplete ? false : undefined,
    }, (ctx) => {
      span(ctx, 'queue_wait', queue.startMs, queue.endMs, {
        'conduit.phase': 'scheduler_queue', 'scheduling.queue_depth_at_entry': trace.queueDepthAtEntry,
      });
      if (budgetMs !== undefined) {
        span(ctx, 'budget_allocation', queue.endMs, end, {
          'conduit.phase': 'scheduler_queue', 'scheduling.budget_ms': round3(budgetMs), 'scheduling.budget_tokens': trace.budgetTokens,
        });
      }
    }, failedIn('scheduler_queue'));
  }

  // Prefill chunks: those up to the first token are the prompt's prefill; those after it (an n > 1 request's further
  // completions computing their prompt positions, forced text, a recompute after a preemption) ran within decode
  // and go under it.
  const chunkSpan = (ctx: Context, c: (typeof trace.phases)[number]): void => {
    span(ctx, 'model_forward_prefill', c.startMs, c.endMs, {
      'conduit.phase': 'prefill_execution', 'prefill.chunk': c.attributes?.chunk as number | undefined,
      'prefill.chunk_tokens': c.attributes?.tokens as number | undefined,
      'prefill.batch_size': c.attributes?.batch_size as number | undefined,
      'prefill.batch_tokens': c.attributes?.batch_tokens as number | undefined, 'prefill.worker': c.worker,
      'prefill.recompute': c.attributes?.recompute as boolean | undefined,
      'prefill.after_first_token': c.attributes?.after_first_token as boolean | undefined,
    });
  };
  const allChunks = trace.phases.filter((p) => p.phase === 'prefill_execution');
  const laterChunks = allChunks.filter((c) => c.attributes?.after_first_token === true);
  const decodeSpan = trace.decode;
  const inDecode = (c: (typeof trace.phases)[number]) => decodeSpan !== undefined && c.startMs >= decodeSpan.startMs && c.endMs <= decodeSpan.endMs;

  // Prefill.
  const prefill = trace.prefill;
  if (prefill) {
    const timeMs = prefill.endMs - prefill.startMs;
    group(engineContext, 'prefill', prefill.startMs, prefill.endMs, {
      'conduit.phase': 'prefill_execution',
      'prefill.prompt_tokens': trace.promptTokens,
      'prefill.cached_tokens': trace.cachedTokens,
      'prefill.new_tokens': Math.max(0, trace.promptTokens - trace.cachedTokens),
      'prefill.computed_tokens': prefill.computedTokens,
      'prefill.cache_hit_rate': round3(trace.cachedTokens / Math.max(1, trace.promptTokens)),
      'prefill.time_ms': round3(timeMs),
      'prefill.tokens_per_sec': timeMs > 0 ? round3(prefill.computedTokens / (timeMs / 1000)) : undefined,
      'prefill.chunks': prefill.chunks,
      'prefill.batch_size_max': prefill.batchSizeMax,
      'prefill.worker': prefill.worker,
    }, (ctx) => {
      for (const c of allChunks) if (c.attributes?.after_first_token !== true) chunkSpan(ctx, c);
    }, failedIn('prefill_execution'));
  }
  // Chunks after the first token outside the decode span (none decoded after it): under the engine's parent.
  for (const c of laterChunks) if (!inDecode(c)) chunkSpan(engineContext, c);

  // KV transfer.
  const kv = trace.kvTransfer;
  if (kv) {
    const ms = kv.endMs - kv.startMs;
    span(engineContext, 'kv_transfer', kv.startMs, kv.endMs, {
      'conduit.phase': 'kv_transfer', 'kv_transfer.bytes': kv.bytes, 'kv_transfer.blocks': kv.blocks, 'kv_transfer.link': kv.link,
      'kv_transfer.from_worker': kv.fromWorker, 'kv_transfer.to_worker': kv.toWorker, 'kv_transfer.time_ms': round3(ms),
      'kv_transfer.bytes_per_sec': ms > 0 ? Math.round(kv.bytes / (ms / 1000)) : undefined,
      'kv_transfer.overlap_ms': kv.overlapMs !== undefined ? round3(kv.overlapMs) : undefined,
    });
  }

  // A transfer that failed (the decode worker prefilled the prompt itself): an error span where it was learned.
  for (const failed of trace.phases.filter((p) => p.phase === 'kv_transfer' && p.attributes?.failed !== undefined)) {
    span(engineContext, 'kv_transfer', failed.startMs, failed.endMs, {
      'conduit.phase': 'kv_transfer', 'kv_transfer.from_worker': failed.attributes?.from_worker as string | undefined,
      'kv_transfer.to_worker': failed.attributes?.to_worker as string | undefined,
      'kv_transfer.failed': failed.attributes?.failed as string,
    }, `KV transfer failed: ${String(failed.attributes?.failed)}`);
  }

  // Decode.
  const decode = trace.decode;
  if (decode) {
    const decodeSec = (decode.endMs - decode.startMs) / 1000;
    // In stream mode the steps are the TBT gaps themselves: reuse their sort.
    const stepSorted = decode.stepMs === tbt ? tbtSorted : sortedOf(decode.stepMs);
    const batch = decode.batch;
    group(engineContext, 'decode', decode.startMs, decode.endMs, {
      'conduit.phase': 'decode_execution',
      'decode.total_steps': decode.steps,
      'decode.step_source': decode.source,
      'decode.step_p50_ms': stepSorted.length > 0 ? round3(percentile(stepSorted, 0.5)) : undefined,
      'decode.step_max_ms': stepSorted.length > 0 ? round3(stepSorted[stepSorted.length - 1]!) : undefined,
      'decode.avg_tbt_ms': tbt.length > 0 ? round3(mean(tbt)) : (decode.steps > 0 ? round3((decode.endMs - decode.startMs) / decode.steps) : undefined),
      'decode.p99_tbt_ms': tbt.length > 0 ? round3(tbtP99) : undefined,
      'decode.tokens_per_sec': decodeSec > 0 ? round3(decode.steps / decodeSec) : undefined,
      'decode.batch_size_min': batch?.seqsMin,
      'decode.batch_size_max': batch?.seqsMax,
      'decode.batch_size_mean': batch ? round3(batch.seqsMean) : undefined,
      'decode.batch_tokens_mean': batch ? round3(batch.tokensMean) : undefined,
      'decode.batch_tokens_max': batch?.tokensMax,
      'decode.forward_ms': batch ? round3(batch.forwardMs) : undefined,
      'decode.worker': decode.worker,
      'decode.completed': decode.incomplete ? false : undefined,
      'decode.prefill_chunks': trace.prefill?.afterFirstToken?.chunks,
      'decode.prefill_tokens': trace.prefill?.afterFirstToken?.tokens,
    }, (ctx) => {
      for (const c of laterChunks) if (inDecode(c)) chunkSpan(ctx, c);
      if (!options.perTokenSpans) return;
      for (let i = 0; i < decode.stepMs.length; i++) {
        const start = decode.stepStartsMs[i]!;
        // clean() drops the NaN of a step that reported no batch.
        span(ctx, 'decode_step', start, start + decode.stepMs[i]!, {
          'conduit.phase': 'decode_execution', 'decode.step': i + 1, 'decode.batch_size': decode.batchSizes[i],
          'decode.batch_tokens': decode.batchTokens[i],
        });
      }
    }, failedIn('decode_execution'));
  }

  // Streamed writes.
  const emits = trace.emits;
  const times = emits.contentTimesMs;
  if (times.length > 0) {
    const first = times[0]!;
    const startMs = Math.min(first, emits.firstContentStartMs ?? first);
    if (options.perTokenSpans) {
      times.forEach((t, i) => {
        span(rootContext, 'token_emit', i === 0 ? startMs : t, t, { 'conduit.phase': 'streaming_response', 'emit.index': i });
      });
    } else {
      span(rootContext, 'token_emit', startMs, times[times.length - 1]!, {
        'conduit.phase': 'streaming_response', 'emit.writes': emits.writes, 'emit.content_writes': emits.contentWrites,
        'emit.bytes': emits.bytes > 0 ? emits.bytes : undefined, 'emit.first_write_ms': round3(first - trace.arrivalMs),
        'emit.first_token_handoff_ms': trace.engineFirstTokenMs !== undefined ? round3(first - trace.engineFirstTokenMs) : undefined,
      });
    }
  }

  // How it ended. Success and refusals leave the status unset (see serverError above).
  if (errorMessage !== undefined) {
    const errorType = trace.errorType ?? 'error';
    root.setAttribute('request.error_type', errorType);
    if (serverError) {
      root.setStatus({ code: SpanStatusCode.ERROR, message: errorMessage });
      root.setAttribute('error.type', errorType);
      root.recordException({ name: errorType, message: errorMessage }, hr(trace.endMs));
    } else {
      root.setAttribute('request.error_message', errorMessage);
    }
  } else if (trace.outcome === 'abort') {
    root.setAttribute('request.aborted', true);
    if (trace.abortReason) root.setAttribute('request.abort_reason', trace.abortReason);
    root.addEvent('abort', clean({ reason: trace.abortReason, phase: trace.endedInPhase }), hr(trace.endMs));
  }
  root.end(hr(trace.endMs));
  return root.spanContext();
}
