// Spans built from finished requests: the tree's shape and attributes for cold, warm, aborted and failed requests,
// per-token detail, trace continuity through traceparent, the sampler's say over which traces exist, OTEL_*
// configuration, and OTLP/HTTP export to a local receiver.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { SpanKind, SpanStatusCode } from '@opentelemetry/api';
import { hrTimeToMilliseconds, parseTraceParent as oracleParse } from '@opentelemetry/core';
import { InMemorySpanExporter, type ReadableSpan } from '@opentelemetry/sdk-trace-node';
import type { EngineReport, LifecycleEvent } from '../../src/telemetry/lifecycle.ts';
import { TracingConfigError, tracingConfigFromEnv } from '../../src/telemetry/otel-env.ts';
import { Telemetry, type TelemetryOptions } from '../../src/telemetry/telemetry.ts';
import { formatTraceparent, parseTraceparent } from '../../src/telemetry/traceparent.ts';
import { T0, abortedInQueueTimeline, coldTimeline, erroredInPrefillTimeline, rateLimitedTimeline, requestTimeline, warmTimeline } from './fixtures.ts';

function traced(options: Partial<TelemetryOptions> = {}): { telemetry: Telemetry; exporter: InMemorySpanExporter } {
  const exporter = new InMemorySpanExporter();
  const telemetry = new Telemetry({ env: {}, exporters: [exporter], processor: 'simple', sampling: { baseRate: 1 }, ...options });
  return { telemetry, exporter };
}

function run(telemetry: Telemetry, events: readonly LifecycleEvent[]): void {
  for (const e of events) telemetry.lifecycle.emit(e);
}

/** The tree as text: name(children...) with children ordered by start time, e.g. request(gateway(auth),decode). */
function shape(spans: readonly ReadableSpan[]): string {
  const byParent = new Map<string | undefined, ReadableSpan[]>();
  const ids = new Set(spans.map((s) => s.spanContext().spanId));
  for (const s of spans) {
    const parent = s.parentSpanContext?.spanId;
    const key = parent && ids.has(parent) ? parent : undefined;
    const list = byParent.get(key) ?? [];
    list.push(s);
    byParent.set(key, list);
  }
  const render = (s: ReadableSpan): string => {
    const children = (byParent.get(s.spanContext().spanId) ?? [])
      .sort((a, b) => hrTimeToMilliseconds(a.startTime) - hrTimeToMilliseconds(b.startTime) || a.name.localeCompare(b.name));
    return children.length === 0 ? s.name : `${s.name}(${children.map(render).join(',')})`;
  };
  return (byParent.get(undefined) ?? []).map(render).join(' ');
}

function one(spans: readonly ReadableSpan[], name: string): ReadableSpan {
  const found = spans.filter((s) => s.name === name);
  assert.equal(found.length, 1, `one ${name} span, found ${found.length}`);
  return found[0]!;
}

function durationMs(s: ReadableSpan): number {
  return hrTimeToMilliseconds(s.endTime) - hrTimeToMilliseconds(s.startTime);
}

function near(actual: unknown, expected: number, eps = 1e-3): void {
  assert.equal(typeof actual, 'number');
  assert.ok(Math.abs((actual as number) - expected) <= eps, `expected ${expected}, got ${String(actual)}`);
}

const GATEWAY = 'gateway(http_receive,auth,rate_limit,validate,tokenize)';
const ROUTING = 'routing(kv_cache_lookup,load_balance)';

describe('request spans', () => {
  it('give the root span the GenAI semantic conventions\' operation, request parameters and finish reasons', () => {
    const { telemetry, exporter } = traced();
    run(telemetry, coldTimeline().events);
    run(telemetry, requestTimeline({ id: 'text', at: T0 + 1000 }).events.map((e) => (e.phase === 'http_receive' ? { ...e, route: '/v1/completions' } : e)));
    const [chat, text] = exporter.getFinishedSpans().filter((s) => s.name === 'request');
    // gen_ai.operation.name is required by the conventions: backends group GenAI spans by it.
    assert.equal(chat!.attributes['gen_ai.operation.name'], 'chat');
    assert.equal(text!.attributes['gen_ai.operation.name'], 'text_completion');
    assert.equal(chat!.attributes['gen_ai.request.model'], 'llama-70b');
    assert.equal(chat!.attributes['gen_ai.request.max_tokens'], 64);
    assert.equal(chat!.attributes['gen_ai.request.temperature'], 0.7);
    assert.deepEqual(chat!.attributes['gen_ai.response.finish_reasons'], ['length']);
    assert.equal(chat!.attributes['gen_ai.usage.input_tokens'], 1024);
    assert.equal(chat!.attributes['gen_ai.usage.output_tokens'], 8);
  });

  it('leave the GenAI finish reasons off a request that failed', () => {
    const { telemetry, exporter } = traced();
    run(telemetry, erroredInPrefillTimeline());
    const root = one(exporter.getFinishedSpans(), 'request');
    assert.equal(root.attributes['gen_ai.operation.name'], 'chat');
    assert.equal(root.attributes['gen_ai.response.finish_reasons'], undefined);
  });

  it('give a cold request the full hierarchy with its attributes and times', () => {
    const { telemetry, exporter } = traced();
    const cold = coldTimeline({ queueDepth: 12 });
    run(telemetry, cold.events);
    const spans = exporter.getFinishedSpans();
    assert.equal(shape(spans), `request(${GATEWAY},${ROUTING},prefill_dispatch,scheduling(queue_wait),prefill(model_forward_prefill,model_forward_prefill),decode,token_emit)`);

    const root = one(spans, 'request');
    assert.equal(root.attributes['request.id'], 'req-cold');
    assert.equal(root.attributes['request.model'], 'llama-70b');
    assert.equal(root.attributes['request.prompt_tokens'], 1024);
    assert.equal(root.attributes['request.output_tokens'], 8);
    assert.equal(root.attributes['request.cached_tokens'], 0);
    near(root.attributes['request.ttft_ms'], 38.6);
    near(root.attributes['request.tokens_per_sec'], 8 / ((cold.at.end - T0) / 1000), 1e-2);
    assert.equal(root.attributes['request.prefill_skipped'], false);
    assert.equal(root.kind, SpanKind.SERVER);
    for (const s of spans) assert.equal(s.status.code, SpanStatusCode.UNSET, `${s.name}: success is not marked OK (HTTP semantic conventions)`);
    near(hrTimeToMilliseconds(root.startTime), T0, 1e-3);
    near(durationMs(root), cold.at.end - T0);

    const routing = one(spans, 'routing');
    assert.equal(routing.attributes['routing.strategy'], 'kv_aware');
    assert.equal(routing.attributes['routing.kv_cache_hit'], false);
    assert.equal(routing.attributes['routing.selected_worker'], 'worker-1');
    assert.equal(routing.attributes['routing.candidates'], 4);
    near(durationMs(one(spans, 'kv_cache_lookup')), 0.5);
    near(durationMs(one(spans, 'load_balance')), 0.3);

    const scheduling = one(spans, 'scheduling');
    assert.equal(scheduling.attributes['scheduling.queue_depth_at_entry'], 12);
    near(scheduling.attributes['scheduling.queue_time_ms'], 1.2);
    near(durationMs(one(spans, 'queue_wait')), 1.2);

    const prefill = one(spans, 'prefill');
    assert.equal(prefill.attributes['prefill.prompt_tokens'], 1024);
    assert.equal(prefill.attributes['prefill.new_tokens'], 1024);
    assert.equal(prefill.attributes['prefill.cache_hit_rate'], 0);
    assert.equal(prefill.attributes['prefill.chunks'], 2);
    near(durationMs(prefill), 35);
    near(prefill.attributes['prefill.tokens_per_sec'], 1024 / 0.035, 1);
    const chunks = spans.filter((s) => s.name === 'model_forward_prefill').map((s) => s.attributes['prefill.chunk_tokens']);
    assert.deepEqual(chunks, [512, 512]);

    const decode = one(spans, 'decode');
    assert.equal(decode.attributes['decode.total_steps'], 7);
    near(decode.attributes['decode.avg_tbt_ms'], 12.5);
    near(decode.attributes['decode.step_max_ms'], 12.5);
    near(durationMs(decode), 7 * 12.5);

    const emit = one(spans, 'token_emit');
    assert.equal(emit.attributes['emit.content_writes'], 8);
    near(emit.attributes['emit.first_token_handoff_ms'], 0.4);
    for (const s of spans) assert.equal(s.spanContext().traceId, root.spanContext().traceId);
    for (const s of spans) assert.ok(typeof s.attributes['conduit.phase'] === 'string', `${s.name} carries conduit.phase`);
  });

  it('show a warm request\'s prefix hit on routing and prefill', () => {
    const { telemetry, exporter } = traced();
    run(telemetry, warmTimeline().events);
    const spans = exporter.getFinishedSpans();
    assert.equal(shape(spans), `request(${GATEWAY},${ROUTING},prefill_dispatch,scheduling(queue_wait),prefill(model_forward_prefill),decode,token_emit)`);
    assert.equal(one(spans, 'routing').attributes['routing.kv_cache_hit'], true);
    assert.equal(one(spans, 'routing').attributes['routing.selection_reason'], 'prefix_match_1008_tokens');
    const prefill = one(spans, 'prefill');
    assert.equal(prefill.attributes['prefill.cached_tokens'], 1008);
    assert.equal(prefill.attributes['prefill.new_tokens'], 16);
    near(prefill.attributes['prefill.cache_hit_rate'], 0.984);
    assert.equal(one(spans, 'request').attributes['request.prefill_skipped'], true);
    near(one(spans, 'request').attributes['request.ttft_ms'], 4.9);
  });

  it('end an aborted request at the abort, in the phase it was in, without an error status', () => {
    const { telemetry, exporter } = traced();
    run(telemetry, abortedInQueueTimeline('gone'));
    const spans = exporter.getFinishedSpans();
    assert.equal(shape(spans), `request(${GATEWAY},${ROUTING},prefill_dispatch,scheduling(queue_wait))`);
    const root = one(spans, 'request');
    assert.equal(root.attributes['request.aborted'], true);
    assert.equal(root.attributes['request.abort_reason'], 'client_disconnect');
    assert.equal(root.attributes['request.finish_reason'], 'abort');
    assert.equal(root.status.code, SpanStatusCode.UNSET);
    const abort = root.events.find((e) => e.name === 'abort');
    assert.ok(abort);
    assert.equal(abort.attributes?.phase, 'scheduler_queue');
    near(hrTimeToMilliseconds(abort.time), T0 + 40);
    assert.equal(one(spans, 'scheduling').attributes['scheduling.completed'], false);
    near(hrTimeToMilliseconds(one(spans, 'queue_wait').endTime), T0 + 40);
  });

  it('close the gateway phase a client left inside, though the gateway never stamped its end', () => {
    const { telemetry, exporter } = traced();
    // Left while its prompt was tokenized: there is no tokenize event, the gateway stamps it once it is done.
    const gateway = coldTimeline({ id: 'left' }).events.filter((e) => ['http_receive', 'auth', 'rate_limit', 'validate'].includes(e.phase));
    run(telemetry, [...gateway, { phase: 'abort', requestId: 'left', time: T0 + 150, reason: 'client_disconnect', promptTokens: 0, outputTokens: 0 }]);
    const spans = exporter.getFinishedSpans();
    const tokenize = one(spans, 'tokenize');
    assert.equal(tokenize.attributes['tokenize.completed'], false);
    near(hrTimeToMilliseconds(tokenize.startTime), gateway.find((e) => e.phase === 'validate')!.time);
    near(hrTimeToMilliseconds(tokenize.endTime), T0 + 150);
    near(hrTimeToMilliseconds(one(spans, 'gateway').endTime), T0 + 150);
    assert.equal(one(spans, 'request').attributes['request.ended_in_phase'], 'tokenize');
  });

  it('give a stream that failed after it began the 200 its status line said, with the failure as the error', () => {
    const { telemetry, exporter } = traced();
    const timeline = requestTimeline({ id: 'cut', outputTokens: 4 });
    // The stream went out under a 200; the request timed out in decode and the client got an SSE error event.
    const cutAt = timeline.at.lastToken + 1;
    run(telemetry, timeline.events.map((e) => (e.phase === 'finish'
      ? { phase: 'error', requestId: 'cut', time: cutAt, errorType: 'request_timeout', message: 'The request did not finish in time.', status: 504,
        promptTokens: 1024, outputTokens: 4, engine: timeline.engine } as LifecycleEvent
      : e)));
    const root = one(exporter.getFinishedSpans(), 'request');
    assert.equal(root.attributes['http.response.status_code'], 200, 'the status the response was sent with');
    assert.equal(root.status.code, SpanStatusCode.ERROR);
    assert.equal(root.attributes['error.type'], 'request_timeout');
    assert.equal(root.attributes['request.error_status'], 504);
  });

  it('mark a failed request\'s root as an error with the exception recorded', () => {
    const { telemetry, exporter } = traced({ sampling: { baseRate: 0 } });
    run(telemetry, erroredInPrefillTimeline('boom'));
    const spans = exporter.getFinishedSpans();
    assert.equal(shape(spans), `request(${GATEWAY},${ROUTING},prefill_dispatch,scheduling(queue_wait),prefill(model_forward_prefill))`);
    const root = one(spans, 'request');
    assert.equal(root.status.code, SpanStatusCode.ERROR);
    assert.equal(root.status.message, 'forward pass failed: out of memory');
    assert.equal(root.attributes['error.type'], 'engine_error');
    assert.equal(root.attributes['http.response.status_code'], 500);
    assert.equal(root.attributes['conduit.sampling.kept_because'], 'error', 'kept by the tail although the head rate is 0');
    const exception = root.events.find((e) => e.name === 'exception');
    assert.equal(exception?.attributes?.['exception.message'], 'forward pass failed: out of memory');
    // The phase it failed in is an error too; the phases it went through before are not.
    assert.equal(one(spans, 'prefill').status.code, SpanStatusCode.ERROR);
    assert.equal(one(spans, 'prefill').status.message, 'forward pass failed: out of memory');
    for (const s of spans.filter((x) => x.name !== 'request' && x.name !== 'prefill')) assert.equal(s.status.code, SpanStatusCode.UNSET, s.name);
  });

  it('leave a refused request\'s (4xx) status unset, as HTTP semantic conventions ask of a SERVER span', () => {
    const { telemetry, exporter } = traced();
    run(telemetry, rateLimitedTimeline('limited'));
    const events: LifecycleEvent[] = [
      { phase: 'http_receive', requestId: 'bad', start: T0, time: T0 + 0.3 },
      { phase: 'auth', requestId: 'bad', start: T0 + 0.3, time: T0 + 0.32, ok: true, tenant: 'acme' },
      { phase: 'rate_limit', requestId: 'bad', start: T0 + 0.32, time: T0 + 0.35, allowed: true, tenant: 'acme' },
      { phase: 'validate', requestId: 'bad', start: T0 + 0.35, time: T0 + 0.4, ok: false },
      { phase: 'error', requestId: 'bad', time: T0 + 0.5, errorType: 'invalid_request_error', status: 400, message: 'max_tokens must be at least 1' },
    ];
    run(telemetry, events);
    const spans = exporter.getFinishedSpans();
    const roots = spans.filter((s) => s.name === 'request');
    assert.deepEqual(roots.map((r) => r.attributes['http.response.status_code']), [429, 400]);
    for (const root of roots) {
      assert.equal(root.kind, SpanKind.SERVER);
      assert.equal(root.attributes['request.outcome'], 'error');
      assert.equal(root.attributes['error.type'], undefined, 'error.type is for server errors');
      assert.equal(root.events.some((e) => e.name === 'exception'), false);
    }
    assert.equal(roots[1]!.attributes['request.error_type'], 'invalid_request_error');
    assert.equal(roots[1]!.attributes['request.error_message'], 'max_tokens must be at least 1');
    for (const s of spans) assert.equal(s.status.code, SpanStatusCode.UNSET, `${s.name} of ${String(s.attributes['request.id'] ?? '')}`);
  });

  it('put an n > 1 request\'s chunks after the first token under decode, where they ran: every span within its parent', () => {
    const { telemetry, exporter } = traced();
    const cold = coldTimeline({ id: 'forked' });
    // The second completion computes its own prompt position in the step after the first token, as the scheduler's
    // fork does: a prefill chunk that runs within decode.
    const fork = { start: cold.at.firstToken + 0.05, end: cold.at.firstToken + 12.5, tokens: 2, batchSeqs: 2, batchTokens: 3 };
    const events = cold.events.map((e): LifecycleEvent => {
      if (e.phase === 'validate') return { ...e, n: 2 };
      if (e.phase === 'finish') {
        const engine = e.engine as EngineReport;
        return { ...e, engine: { ...engine, timestamps: { ...engine.timestamps, prefillChunks: [...engine.timestamps.prefillChunks, fork] } } };
      }
      return e;
    });
    run(telemetry, events);
    const spans = exporter.getFinishedSpans();
    assert.equal(shape(spans), `request(${GATEWAY},${ROUTING},prefill_dispatch,scheduling(queue_wait),prefill(model_forward_prefill,model_forward_prefill),decode(model_forward_prefill),token_emit)`);
    const byId = new Map(spans.map((s) => [s.spanContext().spanId, s]));
    for (const s of spans) {
      const parent = s.parentSpanContext ? byId.get(s.parentSpanContext.spanId) : undefined;
      if (!parent) continue;
      assert.ok(hrTimeToMilliseconds(s.startTime) >= hrTimeToMilliseconds(parent.startTime) - 1e-6
        && hrTimeToMilliseconds(s.endTime) <= hrTimeToMilliseconds(parent.endTime) + 1e-6, `${s.name} lies within ${parent.name}`);
    }
    const prefill = one(spans, 'prefill');
    assert.equal(prefill.attributes['prefill.chunks'], 2, 'the prompt\'s chunks');
    assert.equal(prefill.attributes['prefill.computed_tokens'], 1024);
    near(hrTimeToMilliseconds(prefill.endTime), cold.at.firstToken);
    const decode = one(spans, 'decode');
    assert.equal(decode.attributes['decode.prefill_chunks'], 1);
    assert.equal(decode.attributes['decode.prefill_tokens'], 2);
    const late = spans.find((s) => s.name === 'model_forward_prefill' && s.parentSpanContext?.spanId === decode.spanContext().spanId);
    assert.equal(late?.attributes['prefill.after_first_token'], true);
    assert.equal(late?.attributes['prefill.chunk'], 2);
    // The documented sums hold: the chunk is decode's time, not prefill's.
    const view = telemetry.traceView('forked')!;
    const t = view.timings;
    near(t.gateway_ms + t.routing_ms + t.queue_ms + t.prefill_ms, t.ttft_ms!, 2e-3);
    near(t.ttft_ms! + t.decode_ms, t.total_ms, 2e-3);
    near(t.prefill_ms, cold.at.firstWrite! - cold.at.firstScheduled, 2e-3);
    assert.equal(view.phases.filter((p) => p.attributes?.after_first_token === true).length, 1, 'the trace view marks it');
    assert.match(telemetry.waterfall('forked')!, /prefill_execution \(in decode\)/);
  });

  it('add a span per decode step and per write when per-token spans are asked for', () => {
    const { telemetry, exporter } = traced({ perTokenSpans: true });
    const cold = coldTimeline({ engineSteps: true, stepMs: [10, 10, 40, 10, 10, 10, 10] });
    run(telemetry, cold.events);
    const spans = exporter.getFinishedSpans();
    const steps = spans.filter((s) => s.name === 'decode_step');
    assert.equal(steps.length, 7);
    assert.deepEqual(steps.map((s) => s.attributes['decode.step']), [1, 2, 3, 4, 5, 6, 7]);
    assert.deepEqual(steps.map((s) => Math.round(durationMs(s))), [10, 10, 40, 10, 10, 10, 10]);
    assert.equal(steps[0]!.attributes['decode.batch_size'], 4);
    const decode = one(spans, 'decode');
    for (const s of steps) assert.equal(s.parentSpanContext?.spanId, decode.spanContext().spanId);
    assert.equal(spans.filter((s) => s.name === 'token_emit').length, 8);
    near(decode.attributes['decode.step_max_ms'], 40);
    near(decode.attributes['decode.step_p50_ms'], 10);
  });
});

describe('trace context', () => {
  const clientTrace = '4bf92f3577b34da6a3ce929d0e0e4736';
  const clientSpan = '00f067aa0ba902b7';

  it('continues the client\'s trace: same trace id, root parented to the client\'s span', () => {
    const { telemetry, exporter } = traced({ sampling: { baseRate: 0 } });
    const events = coldTimeline({ id: 'tp', traceparent: `00-${clientTrace}-${clientSpan}-01` }).events;
    const upToRouter = events.findIndex((e) => e.phase === 'router_lookup') + 1;
    run(telemetry, events.slice(0, upToRouter));
    const handedOn = telemetry.traceContext('tp');
    const parsed = parseTraceparent(handedOn);
    assert.ok(parsed);
    assert.equal(parsed.traceId, clientTrace);
    assert.equal(parsed.sampled, true, 'the client sampled it, so the head decision follows');
    run(telemetry, events.slice(upToRouter));

    const spans = exporter.getFinishedSpans();
    const root = one(spans, 'request');
    assert.equal(root.spanContext().traceId, clientTrace);
    assert.equal(root.parentSpanContext?.spanId, clientSpan);
    assert.equal(root.spanContext().spanId, parsed.parentSpanId, 'the root span has the id handed on before it existed');
    assert.equal(root.attributes['conduit.sampling.head'], 'parent');
    for (const s of spans) assert.equal(s.spanContext().traceId, clientTrace);
    assert.equal(telemetry.traceView('tp')?.traceparent, handedOn);
  });

  it('starts a new trace without a traceparent, or with a malformed one, and hands out its ids up front', () => {
    for (const header of [undefined, '00-zzzz-not-a-trace-01', `00-${'0'.repeat(32)}-${clientSpan}-01`]) {
      const { telemetry, exporter } = traced();
      const events = coldTimeline({ id: 'n', ...(header ? { traceparent: header } : {}) }).events;
      run(telemetry, events.slice(0, 5));
      const handedOn = parseTraceparent(telemetry.traceContext('n'));
      assert.ok(handedOn);
      assert.notEqual(handedOn.traceId, clientTrace);
      run(telemetry, events.slice(5));
      const root = one(exporter.getFinishedSpans(), 'request');
      assert.equal(root.parentSpanContext, undefined, `no parent for ${String(header)}`);
      assert.equal(root.spanContext().traceId, handedOn.traceId);
      assert.equal(root.spanContext().spanId, handedOn.parentSpanId);
    }
  });

  it('passes the client\'s header through unchanged when not tracing', () => {
    const telemetry = new Telemetry({ tracing: false });
    const header = `00-${clientTrace}-${clientSpan}-00`;
    telemetry.lifecycle.emit({ phase: 'http_receive', requestId: 'p', start: T0, time: T0 + 1, traceparent: header });
    assert.equal(telemetry.traceContext('p'), header);
  });

  it('parses traceparent as OpenTelemetry\'s own propagator does', () => {
    const cases = [
      `00-${clientTrace}-${clientSpan}-01`,
      `00-${clientTrace}-${clientSpan}-00`,
      `00-${clientTrace}-${clientSpan}-09`,
      `01-${clientTrace}-${clientSpan}-01-extra-field`,
      `00-${clientTrace}-${clientSpan}-01-extra`,
      `ff-${clientTrace}-${clientSpan}-01`,
      `00-${'0'.repeat(32)}-${clientSpan}-01`,
      `00-${clientTrace}-${'0'.repeat(16)}-01`,
      `00-${clientTrace.toUpperCase()}-${clientSpan}-01`,
      `00-${clientTrace.slice(1)}-${clientSpan}-01`,
      `00_${clientTrace}_${clientSpan}_01`,
      '',
    ];
    for (const header of cases) {
      const ours = parseTraceparent(header);
      const theirs = oracleParse(header);
      assert.equal(ours === undefined, theirs === null, `validity of ${header}`);
      if (ours && theirs) {
        assert.equal(ours.traceId, theirs.traceId);
        assert.equal(ours.parentSpanId, theirs.spanId);
        assert.equal(ours.flags, theirs.traceFlags);
      }
    }
    assert.equal(parseTraceparent(`00-${clientTrace}-${clientSpan}-09`)?.sampled, true);
    assert.equal(formatTraceparent(clientTrace, clientSpan, true), `00-${clientTrace}-${clientSpan}-01`);
    assert.throws(() => formatTraceparent('abc', clientSpan, true), RangeError);
  });
});

describe('sampling decides which requests get spans', () => {
  it('drops fast requests outside the head rate and keeps slow and failed ones', () => {
    const { telemetry, exporter } = traced({ sampling: { baseRate: 0, slowTtftMs: 500 }, random: () => 0.5 });
    run(telemetry, coldTimeline({ id: 'fast' }).events);
    assert.equal(exporter.getFinishedSpans().length, 0);
    run(telemetry, coldTimeline({ id: 'slow', at: T0 + 1000, queueMs: 600 }).events);
    run(telemetry, erroredInPrefillTimeline('err', T0 + 2000));
    const roots = exporter.getFinishedSpans().filter((s) => s.name === 'request');
    assert.deepEqual(roots.map((s) => [s.attributes['request.id'], s.attributes['conduit.sampling.kept_because']]), [['slow', 'slow_ttft'], ['err', 'error']]);
  });

  it('counts kept and dropped requests by reason', async () => {
    const { telemetry } = traced({ sampling: { baseRate: 0 }, random: () => 0.5 });
    run(telemetry, coldTimeline({ id: 'a' }).events);
    run(telemetry, erroredInPrefillTimeline('b', T0 + 10));
    const text = await telemetry.renderMetrics();
    assert.match(text, /conduit_trace_sampling_decisions_total\{kept="false",reason="dropped"\} 1/);
    assert.match(text, /conduit_trace_sampling_decisions_total\{kept="true",reason="error"\} 1/);
  });
});

describe('OTEL_TRACES_SAMPLER decides alone', () => {
  const clientTrace = '4bf92f3577b34da6a3ce929d0e0e4736';
  const parent = (sampled: boolean) => `00-${clientTrace}-00f067aa0ba902b7-0${sampled ? 1 : 0}`;
  /** Requests every adaptive rule would keep: a new model's, a long prompt, slow, a server error, the client's sampled trace. */
  function keepers(telemetry: Telemetry): string[] {
    telemetry.registerNewModel('llama-70b');
    run(telemetry, coldTimeline({ id: 'new-model' }).events);
    run(telemetry, coldTimeline({ id: 'long-prompt', at: T0 + 100, promptTokens: 100_000 }).events);
    run(telemetry, coldTimeline({ id: 'slow', at: T0 + 200, queueMs: 900 }).events);
    run(telemetry, erroredInPrefillTimeline('failed', T0 + 300));
    run(telemetry, coldTimeline({ id: 'client-sampled', at: T0 + 400, traceparent: parent(true) }).events);
    run(telemetry, coldTimeline({ id: 'client-unsampled', at: T0 + 500, traceparent: parent(false) }).events);
    return ['new-model', 'long-prompt', 'slow', 'failed', 'client-sampled', 'client-unsampled'];
  }
  const kept = (exporter: InMemorySpanExporter) => exporter.getFinishedSpans().filter((s) => s.name === 'request').map((s) => s.attributes['request.id']);

  it('always_off exports nothing; the trace store and metrics still have every request', async () => {
    const { telemetry, exporter } = traced({ env: { OTEL_TRACES_SAMPLER: 'always_off' }, sampling: { slowTtftMs: 500 }, random: () => 0 });
    const ids = keepers(telemetry);
    assert.deepEqual(kept(exporter), []);
    for (const id of ids) {
      assert.equal(telemetry.traceView(id)?.sampling, 'not_sampled', id);
      assert.equal(parseTraceparent(telemetry.traceView(id)?.traceparent)?.sampled, false, `${id}: handed on as not sampled`);
    }
    assert.match(await telemetry.renderMetrics(), /conduit_trace_sampling_decisions_total\{kept="false",reason="dropped"\} 6\n/);
    assert.deepEqual(kept(traced({ env: { OTEL_TRACES_SAMPLER: 'parentbased_always_off' } }).exporter), []);
  });

  it('parentbased_* follow the client\'s sampled flag; always_on and traceidratio ignore it', () => {
    const keptWith = (sampler: string, arg?: string) => {
      const { telemetry, exporter } = traced({ env: { OTEL_TRACES_SAMPLER: sampler, ...(arg ? { OTEL_TRACES_SAMPLER_ARG: arg } : {}) } });
      keepers(telemetry);
      return kept(exporter);
    };
    assert.deepEqual(keptWith('parentbased_always_off'), ['client-sampled']);
    assert.deepEqual(keptWith('parentbased_always_on'), ['new-model', 'long-prompt', 'slow', 'failed', 'client-sampled']);
    assert.deepEqual(keptWith('always_on'), ['new-model', 'long-prompt', 'slow', 'failed', 'client-sampled', 'client-unsampled']);
    assert.deepEqual(keptWith('traceidratio', '0'), []);
    assert.deepEqual(keptWith('parentbased_traceidratio', '0'), ['client-sampled']);
  });
});

describe('a request refused for its key', () => {
  it('is counted, but neither stored nor exported, whatever the sampler', async () => {
    const { telemetry, exporter } = traced({ env: { OTEL_TRACES_SAMPLER: 'always_on' } });
    run(telemetry, [
      { phase: 'http_receive', requestId: 'nokey', start: T0, time: T0 + 0.3, route: '/v1/completions' },
      { phase: 'auth', requestId: 'nokey', start: T0 + 0.05, time: T0 + 0.06, ok: false },
      { phase: 'error', requestId: 'nokey', time: T0 + 0.5, errorType: 'invalid_api_key', status: 401, message: 'Incorrect API key provided' },
    ]);
    assert.equal(telemetry.traceView('nokey'), undefined, 'GET /v1/requests/{id}/trace answers 404');
    assert.deepEqual(exporter.getFinishedSpans(), []);
    assert.match(await telemetry.renderMetrics(), /conduit_request_errors_total\{[^}]*error_type="invalid_api_key"[^}]*\} 1\n/);
  });
});

describe('span export accounting', () => {
  it('counts spans the exporter accepted and those it refused', async () => {
    const { telemetry, exporter } = traced();
    run(telemetry, coldTimeline({ id: 'ok' }).events);
    assert.equal(await telemetry.flush(), undefined);
    const accepted = exporter.getFinishedSpans().length;
    assert.ok(accepted > 10);
    // A shut-down in-memory exporter refuses every export, as a collector that went away would.
    await exporter.shutdown();
    run(telemetry, coldTimeline({ id: 'lost', at: T0 + 1000 }).events);
    await telemetry.flush();
    const text = await telemetry.renderMetrics();
    assert.match(text, new RegExp(`conduit_trace_spans_exported_total\\{result="success"\\} ${accepted}\\n`));
    assert.match(text, new RegExp(`conduit_trace_spans_exported_total\\{result="failure"\\} ${accepted}\\n`), 'the same tree, lost');
  });
});

describe('OTEL_* configuration', () => {
  it('is off unless an exporter or endpoint is configured', () => {
    assert.equal(tracingConfigFromEnv({}), undefined);
    assert.equal(tracingConfigFromEnv({ OTEL_SERVICE_NAME: 'x' }), undefined);
    assert.equal(tracingConfigFromEnv({ OTEL_EXPORTER_OTLP_ENDPOINT: 'http://c:4318', OTEL_TRACES_EXPORTER: 'none' }), undefined);
    assert.equal(tracingConfigFromEnv({ OTEL_EXPORTER_OTLP_ENDPOINT: 'http://c:4318', OTEL_SDK_DISABLED: 'true' }), undefined);
    assert.equal(new Telemetry({ env: {} }).tracing, undefined);
  });

  it('derives the exporters, batch sizes and sample rate per the specification', () => {
    const base = tracingConfigFromEnv({
      OTEL_EXPORTER_OTLP_ENDPOINT: 'http://collector:4318/',
      OTEL_BSP_MAX_QUEUE_SIZE: '4096',
      OTEL_TRACES_SAMPLER: 'parentbased_traceidratio',
      OTEL_TRACES_SAMPLER_ARG: '0.05',
    });
    assert.ok(base);
    assert.deepEqual(base.exporters, ['otlp']);
    assert.equal(base.batch.maxQueueSize, 4096);
    assert.equal(base.batch.maxExportBatchSize, 2048, 'Conduit\'s default where the environment says nothing');
    assert.deepEqual(base.sampler, { root: 'traceidratio', parentBased: true, ratio: 0.05 });
    const specific = tracingConfigFromEnv({ OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: 'http://c:9999/custom' });
    assert.deepEqual(specific?.exporters, ['otlp'], 'the traces endpoint alone turns export on');
    assert.equal(specific?.protocol, 'http/json', 'JSON bodies unless the protocol says otherwise');
    assert.deepEqual(specific?.warnings, []);
    assert.equal(tracingConfigFromEnv({ OTEL_EXPORTER_OTLP_ENDPOINT: 'http://c:4318', OTEL_EXPORTER_OTLP_PROTOCOL: 'http/protobuf' })?.protocol, 'http/protobuf');
    assert.equal(tracingConfigFromEnv({
      OTEL_EXPORTER_OTLP_ENDPOINT: 'http://c:4318', OTEL_EXPORTER_OTLP_PROTOCOL: 'grpc', OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: 'http/json',
    })?.protocol, 'http/json', 'the traces variable wins');
    // grpc is refused, not quietly replaced: start-up fails with a message that says what to set instead.
    const grpc = { OTEL_EXPORTER_OTLP_ENDPOINT: 'http://c:4317', OTEL_EXPORTER_OTLP_PROTOCOL: 'grpc' };
    assert.throws(() => tracingConfigFromEnv(grpc), (err: Error) => err instanceof TracingConfigError
      && /OTEL_EXPORTER_OTLP_PROTOCOL=grpc is not supported.*http\/protobuf or http\/json/.test(err.message));
    assert.throws(() => new Telemetry({ env: grpc }), TracingConfigError);
    assert.equal(tracingConfigFromEnv({ OTEL_EXPORTER_OTLP_PROTOCOL: 'grpc' }), undefined, 'no export asked for: nothing to refuse');
    assert.deepEqual(tracingConfigFromEnv({ OTEL_TRACES_EXPORTER: 'otlp,console,zipkin' })?.exporters, ['otlp', 'console']);
    assert.deepEqual(new Telemetry({ env: { OTEL_TRACES_EXPORTER: 'otlp', OTEL_TRACES_SAMPLER: 'always_on' } }).sampler.config.otel,
      { root: 'always_on', parentBased: false });
  });

  it('reads OTEL_TRACES_SAMPLER as the SDK does', () => {
    const sampler = (vars: Record<string, string>) => tracingConfigFromEnv({ OTEL_TRACES_EXPORTER: 'otlp', ...vars });
    assert.equal(sampler({})?.sampler, undefined, 'unset: Conduit\'s adaptive sampler');
    assert.deepEqual(sampler({ OTEL_TRACES_SAMPLER: 'always_off' })?.sampler, { root: 'always_off', parentBased: false });
    assert.deepEqual(sampler({ OTEL_TRACES_SAMPLER: 'parentbased_always_off' })?.sampler, { root: 'always_off', parentBased: true });
    assert.deepEqual(sampler({ OTEL_TRACES_SAMPLER: 'parentbased_always_on' })?.sampler, { root: 'always_on', parentBased: true });
    assert.deepEqual(sampler({ OTEL_TRACES_SAMPLER: 'traceidratio' })?.sampler, { root: 'traceidratio', parentBased: false, ratio: 1 },
      'the ratio defaults to 1');
    for (const arg of ['1.5', '-0.1', 'half']) {
      const config = sampler({ OTEL_TRACES_SAMPLER: 'traceidratio', OTEL_TRACES_SAMPLER_ARG: arg });
      assert.equal(config?.sampler?.ratio, 1, `${arg}: the SDK's default`);
      assert.match(config?.warnings.join('\n') ?? '', /OTEL_TRACES_SAMPLER_ARG=.* is not a ratio/);
    }
    const jaeger = sampler({ OTEL_TRACES_SAMPLER: 'jaeger_remote' });
    assert.equal(jaeger?.sampler, undefined);
    assert.match(jaeger?.warnings.join('\n') ?? '', /OTEL_TRACES_SAMPLER=jaeger_remote is not supported/);
  });

  it('exports protobuf bodies when OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf', async () => {
    const bodies: { url: string; contentType: string; body: Buffer }[] = [];
    const server = createServer((req, res) => {
      const parts: Buffer[] = [];
      req.on('data', (c: Buffer) => parts.push(c));
      req.on('end', () => {
        bodies.push({ url: req.url ?? '', contentType: String(req.headers['content-type']), body: Buffer.concat(parts) });
        res.writeHead(200, { 'content-type': 'application/x-protobuf' }).end();
      });
    });
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const { port } = server.address() as AddressInfo;
    const vars: Record<string, string> = { OTEL_EXPORTER_OTLP_ENDPOINT: `http://127.0.0.1:${port}`, OTEL_EXPORTER_OTLP_PROTOCOL: 'http/protobuf' };
    const saved = Object.fromEntries(Object.keys(vars).map((k) => [k, process.env[k]]));
    Object.assign(process.env, vars);
    try {
      const telemetry = new Telemetry({ env: vars, sampling: { baseRate: 1 } });
      run(telemetry, coldTimeline({ id: 'exported-proto' }).events);
      await telemetry.shutdown();
      assert.ok(bodies.length >= 1);
      assert.equal(bodies[0]!.url, '/v1/traces');
      for (const b of bodies) assert.equal(b.contentType, 'application/x-protobuf');
      const all = Buffer.concat(bodies.map((b) => b.body));
      assert.notEqual(all[0], '{'.charCodeAt(0), 'not a JSON body');
      // Protobuf keeps strings as UTF-8 bytes: the span names are in the payload.
      for (const name of ['request', 'scheduling', 'token_emit']) assert.ok(all.includes(Buffer.from(name)), `${name} exported`);
    } finally {
      for (const [k, v] of Object.entries(saved)) {
        if (v === undefined) delete process.env[k];
        else process.env[k] = v;
      }
      server.close();
    }
  });

  it('exports spans over OTLP/HTTP to the endpoint, with the headers and resource, the environment names', async () => {
    const bodies: { url: string; contentType: string; key: string; body: string }[] = [];
    const server = createServer((req, res) => {
      const parts: Buffer[] = [];
      req.on('data', (c: Buffer) => parts.push(c));
      req.on('end', () => {
        bodies.push({ url: req.url ?? '', contentType: String(req.headers['content-type']), key: String(req.headers['x-key']), body: Buffer.concat(parts).toString() });
        res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
      });
    });
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const { port } = server.address() as AddressInfo;
    // The exporter and the resource detector read their variables from process.env itself.
    const vars: Record<string, string> = {
      OTEL_EXPORTER_OTLP_ENDPOINT: `http://127.0.0.1:${port}`, OTEL_EXPORTER_OTLP_HEADERS: 'x-key=a%20b',
      OTEL_SERVICE_NAME: 'conduit-test', OTEL_RESOURCE_ATTRIBUTES: 'deployment.environment=prod,service.name=from-attrs',
    };
    const saved = Object.fromEntries(Object.keys(vars).map((k) => [k, process.env[k]]));
    Object.assign(process.env, vars);
    try {
      const telemetry = new Telemetry({ env: vars, sampling: { baseRate: 1 } });
      run(telemetry, coldTimeline({ id: 'exported' }).events);
      await telemetry.shutdown();
      assert.ok(bodies.length >= 1);
      assert.equal(bodies[0]!.url, '/v1/traces', 'the base endpoint with the traces path appended');
      assert.match(bodies[0]!.contentType, /application\/json/);
      assert.equal(bodies[0]!.key, 'a b');
      const payload = JSON.parse(bodies.map((b) => b.body).join('').replace(/\}\{/g, '},{').replace(/^/, '[').replace(/$/, ']')) as {
        resourceSpans: { resource: { attributes: { key: string; value: { stringValue?: string } }[] }; scopeSpans: { spans: { name: string }[] }[] }[];
      }[];
      const resourceSpans = payload.flatMap((p) => p.resourceSpans);
      const attribute = (key: string) => resourceSpans[0]!.resource.attributes.find((a) => a.key === key)?.value.stringValue;
      assert.equal(attribute('service.name'), 'conduit-test', 'OTEL_SERVICE_NAME over the attributes\' service.name');
      assert.equal(attribute('deployment.environment'), 'prod');
      const names = resourceSpans.flatMap((r) => r.scopeSpans.flatMap((s) => s.spans.map((sp) => sp.name)));
      for (const name of ['request', 'routing', 'scheduling', 'prefill', 'decode', 'token_emit']) assert.ok(names.includes(name), `${name} exported`);
    } finally {
      for (const [k, v] of Object.entries(saved)) {
        if (v === undefined) delete process.env[k];
        else process.env[k] = v;
      }
      server.close();
    }
  });

});
