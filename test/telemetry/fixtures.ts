// Constructed request timelines for the telemetry tests: the events a gateway, router and engine would emit for a
// cold request (no cache), a warm one (prefix hit), an aborted one and a failed one, with round numbers so that
// expected TTFT, TBT and phase durations can be worked out by hand.

import type { EngineReport, EngineTimestamps, LifecycleEvent } from '../../src/telemetry/lifecycle.ts';
import { seededRandom } from '../../src/util/random.ts';

export { seededRandom };

/** An engine-clock instant (epoch ms) all fixtures count from. */
export const T0 = 1_760_000_000_000;

export interface TimelineOptions {
  id?: string;
  /** Arrival, engine-clock ms. */
  at?: number;
  model?: string;
  tenant?: string;
  worker?: string;
  promptTokens?: number;
  cachedTokens?: number;
  /** Prefill chunks: [duration ms, tokens]. */
  chunks?: [number, number][];
  queueMs?: number;
  /** The router's decision (router_lookup), from the end of tokenize. */
  routerMs?: number;
  outputTokens?: number;
  /** Gap between decode steps, or one gap per step. */
  stepMs?: number | number[];
  traceparent?: string;
  stream?: boolean;
  /** Emit one decode_execution event per step (the engine's own step stamps). */
  engineSteps?: boolean;
  /** Requests the worker's scheduler had waiting when this one entered its queue. */
  queueDepth?: number;
  kvTransfer?: { ms: number; bytes: number; from: string; to: string; blocks?: number; link?: string };
}

export interface Timeline {
  events: LifecycleEvent[];
  /** Times worked out while building, for assertions. */
  at: {
    arrival: number; queued: number; firstScheduled: number; firstToken: number; lastToken: number;
    firstWrite?: number; end: number; routerStart: number; routerEnd: number;
  };
  engine: EngineReport;
}

/** A complete request: gateway phases, routing, queue, prefill chunks, decode, streamed writes, finish. */
export function requestTimeline(o: TimelineOptions = {}): Timeline {
  const id = o.id ?? 'req-1';
  const a = o.at ?? T0;
  const model = o.model ?? 'llama-70b';
  const tenant = o.tenant ?? 'acme';
  const worker = o.worker ?? 'worker-1';
  const promptTokens = o.promptTokens ?? 1024;
  const cachedTokens = o.cachedTokens ?? 0;
  const chunks = o.chunks ?? [[17.8, 512], [17.2, 512]];
  const queueMs = o.queueMs ?? 1.2;
  const routerMs = o.routerMs ?? 0.8;
  const outputTokens = o.outputTokens ?? 8;
  const stream = o.stream ?? true;
  const steps = Array.isArray(o.stepMs) ? o.stepMs : Array.from({ length: outputTokens - 1 }, () => (o.stepMs as number | undefined) ?? 12.5);

  const events: LifecycleEvent[] = [
    { phase: 'http_receive', requestId: id, start: a, time: a + 0.5, route: '/v1/chat/completions', ...(o.traceparent ? { traceparent: o.traceparent } : {}) },
    { phase: 'auth', requestId: id, start: a + 0.5, time: a + 0.52, ok: true, tenant },
    { phase: 'rate_limit', requestId: id, start: a + 0.52, time: a + 0.54, allowed: true, tenant },
    { phase: 'validate', requestId: id, start: a + 0.54, time: a + 0.6, ok: true, model, stream, maxTokens: 64, temperature: 0.7 },
    { phase: 'tokenize', requestId: id, start: a + 0.6, time: a + 1.0, promptTokens },
    {
      phase: 'router_lookup', requestId: id, start: a + 1.0, time: a + 1.0 + routerMs, worker, strategy: 'kv_aware', candidates: 4,
      kvCacheHit: cachedTokens > 0, overlapTokens: cachedTokens, reason: cachedTokens > 0 ? `prefix_match_${cachedTokens}_tokens` : 'least_loaded',
      subPhasesMs: { hashing: 0.2, indexLookup: 0.3, selection: 0.3 },
    },
  ];
  let t = a + 1.2 + routerMs;
  const queued = t;
  const firstScheduled = t + queueMs;
  t = firstScheduled;
  const prefillChunks: { start: number; end: number; tokens: number }[] = [];
  for (const [ms, tokens] of chunks) {
    prefillChunks.push({ start: t, end: t + ms, tokens });
    t += ms;
  }
  if (o.kvTransfer) {
    events.push({
      phase: 'kv_transfer', requestId: id, start: t, time: t + o.kvTransfer.ms, bytes: o.kvTransfer.bytes, fromWorker: o.kvTransfer.from, toWorker: o.kvTransfer.to,
      ...(o.kvTransfer.blocks !== undefined ? { blocks: o.kvTransfer.blocks } : {}), ...(o.kvTransfer.link !== undefined ? { link: o.kvTransfer.link } : {}),
    });
    t += o.kvTransfer.ms;
  }
  const firstToken = t;
  const tokenTimes = [firstToken];
  for (const s of steps) {
    t += s;
    tokenTimes.push(t);
    if (o.engineSteps) events.push({ phase: 'decode_execution', requestId: id, start: t - s, time: t, step: tokenTimes.length - 1, batchSize: 4 });
  }
  const lastToken = t;
  // The gateway writes each token 0.4 ms after the engine sampled it; a role-only chunk precedes the first.
  let firstWrite: number | undefined;
  if (stream) {
    events.push({ phase: 'streaming_response', requestId: id, time: firstToken + 0.3, tokens: 0, bytes: 80 });
    for (const tt of tokenTimes) {
      firstWrite ??= tt + 0.4;
      events.push({ phase: 'streaming_response', requestId: id, time: tt + 0.4, tokens: 1, bytes: 120 });
    }
  }
  const end = lastToken + 0.9;
  const timestamps: EngineTimestamps = {
    arrival: a, queued, firstScheduled, prefillChunks, firstToken, lastToken, finished: lastToken,
    ...(o.queueDepth !== undefined ? { queueDepthAtEntry: o.queueDepth } : {}),
  };
  const engine: EngineReport = { worker, timestamps, cachedTokens };
  events.push({ phase: 'finish', requestId: id, time: end, finishReason: 'length', promptTokens, outputTokens, cachedTokens, status: 200, engine });
  return {
    events,
    at: { arrival: a, queued, firstScheduled, firstToken, lastToken, ...(firstWrite !== undefined ? { firstWrite } : {}), end, routerStart: a + 1.0, routerEnd: a + 1.0 + routerMs },
    engine,
  };
}

/** The cold request of the fixtures: 1024-token prompt, nothing cached, two 512-token prefill chunks. */
export function coldTimeline(o: TimelineOptions = {}): Timeline {
  return requestTimeline({ id: 'req-cold', ...o });
}

/** The warm one: 1008 of 1024 prompt tokens cached, one 16-token chunk. */
export function warmTimeline(o: TimelineOptions = {}): Timeline {
  return requestTimeline({ id: 'req-warm', cachedTokens: 1008, chunks: [[2.0, 16]], queueMs: 0.5, ...o });
}

/** A request aborted by its client while it waited in the queue: the engine never scheduled it. */
export function abortedInQueueTimeline(id = 'req-abort', at = T0): LifecycleEvent[] {
  const cold = requestTimeline({ id, at });
  const gatewayAndRouter = cold.events.filter((e) => !['streaming_response', 'finish', 'decode_execution', 'kv_transfer'].includes(e.phase));
  const abortAt = at + 40;
  return [
    ...gatewayAndRouter,
    {
      phase: 'abort', requestId: id, time: abortAt, reason: 'client_disconnect', promptTokens: 1024, outputTokens: 0,
      engine: { worker: 'worker-1', timestamps: { arrival: at, queued: at + 2, prefillChunks: [], finished: abortAt } },
    },
  ];
}

/** A request the engine failed during prefill (status 500). */
export function erroredInPrefillTimeline(id = 'req-error', at = T0): LifecycleEvent[] {
  const cold = requestTimeline({ id, at });
  const before = cold.events.filter((e) => !['streaming_response', 'finish', 'decode_execution'].includes(e.phase));
  const failAt = at + 15;
  return [
    ...before,
    {
      phase: 'error', requestId: id, time: failAt, errorType: 'engine_error', message: 'forward pass failed: out of memory', status: 500,
      promptTokens: 1024,
      engine: {
        worker: 'worker-1',
        timestamps: { arrival: at, queued: at + 2, firstScheduled: at + 3.2, prefillChunks: [{ start: at + 3.2, end: at + 14, tokens: 512 }], finished: failAt },
      },
    },
  ];
}

/** A request refused by the rate limiter (429): gateway phases only. */
export function rateLimitedTimeline(id = 'req-429', at = T0, tenant = 'acme'): LifecycleEvent[] {
  return [
    { phase: 'http_receive', requestId: id, start: at, time: at + 0.3 },
    { phase: 'auth', requestId: id, start: at + 0.3, time: at + 0.32, ok: true, tenant },
    { phase: 'rate_limit', requestId: id, start: at + 0.32, time: at + 0.35, allowed: false, tenant, reason: 'tokens' },
    { phase: 'error', requestId: id, time: at + 0.5, errorType: 'rate_limited', status: 429, message: 'tenant token budget exhausted' },
  ];
}

