// The lifecycle bus, the trace builder (timeline from gateway events plus engine timestamps) and the collector that
// assembles traces from the bus.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { LifecycleBus, PHASES, type LifecycleEvent } from '../../src/telemetry/lifecycle.ts';
import { buildRequestTrace, phaseBreakdown, prefillSkipped } from '../../src/telemetry/trace.ts';
import { Telemetry } from '../../src/telemetry/telemetry.ts';
import { T0, abortedInQueueTimeline, coldTimeline, erroredInPrefillTimeline, rateLimitedTimeline, requestTimeline, warmTimeline } from './fixtures.ts';

// Engine-clock stamps are epoch ms in doubles: about 0.24 µs apart at today's dates, so compare to 1 µs.
function close(actual: number | undefined, expected: number, eps = 1e-3): void {
  assert.ok(actual !== undefined && Math.abs(actual - expected) <= eps, `expected ${expected}, got ${actual}`);
}

describe('LifecycleBus', () => {
  it('is inactive without listeners and delivers events in emit order to each listener', () => {
    const bus = new LifecycleBus();
    assert.equal(bus.active, false);
    const a: string[] = [];
    const b: string[] = [];
    const offA = bus.subscribe((e) => a.push(e.phase));
    bus.subscribe((e) => b.push(`${e.requestId}:${e.phase}`));
    assert.equal(bus.active, true);
    for (const e of coldTimeline().events.slice(0, 3)) bus.emit(e);
    assert.deepEqual(a, ['http_receive', 'auth', 'rate_limit']);
    assert.deepEqual(b, ['req-cold:http_receive', 'req-cold:auth', 'req-cold:rate_limit']);
    offA();
    bus.emit({ phase: 'tokenize', requestId: 'x', start: 1, time: 2, promptTokens: 3 });
    assert.equal(a.length, 3);
    assert.equal(b.length, 4);
    assert.equal(bus.listenerCount, 1);
  });

  it('keeps delivering when a listener throws, and reports the failure', () => {
    const failures: string[] = [];
    const bus = new LifecycleBus((err, event) => failures.push(`${event.phase}: ${(err as Error).message}`));
    const seen: string[] = [];
    bus.subscribe(() => {
      throw new Error('boom');
    });
    bus.subscribe((e) => seen.push(e.phase));
    bus.emit({ phase: 'auth', requestId: 'r', start: 0, time: 1, ok: true });
    assert.deepEqual(seen, ['auth']);
    assert.deepEqual(failures, ['auth: boom']);
  });

  it('lets a listener unsubscribe itself during emit without skipping the others', () => {
    const bus = new LifecycleBus();
    const seen: string[] = [];
    const off = bus.subscribe(() => {
      seen.push('first');
      off();
    });
    bus.subscribe(() => seen.push('second'));
    bus.emit({ phase: 'auth', requestId: 'r', start: 0, time: 1, ok: true });
    bus.emit({ phase: 'auth', requestId: 'r', start: 1, time: 2, ok: true });
    assert.deepEqual(seen, ['first', 'second', 'second']);
  });

  it('names the phases of docs/architecture.md in path order', () => {
    assert.deepEqual([...PHASES], [
      'http_receive', 'auth', 'rate_limit', 'validate', 'tokenize', 'router_lookup', 'scheduler_queue', 'prefill_dispatch',
      'prefill_execution', 'decode_dispatch', 'kv_transfer', 'decode_execution', 'streaming_response',
    ]);
  });
});

describe('buildRequestTrace', () => {
  it('assembles a cold request: TTFT to the first content write, TBT between writes, phases from engine stamps', () => {
    const cold = coldTimeline();
    const trace = buildRequestTrace(cold.events);
    assert.equal(trace.requestId, 'req-cold');
    assert.equal(trace.model, 'llama-70b');
    assert.equal(trace.tenant, 'acme');
    assert.equal(trace.worker, 'worker-1');
    assert.equal(trace.outcome, 'ok');
    assert.equal(trace.finishReason, 'length');
    close(trace.arrivalMs, T0);
    // Arrival T0; prefill ends at T0 + 2 + 1.2 + 35 = T0 + 38.2; the first content write 0.4 ms later.
    close(trace.ttftMs, cold.at.firstWrite! - T0);
    close(trace.ttftMs, 38.6);
    assert.equal(trace.ttftSource, 'stream');
    assert.equal(trace.tbtMs.length, 7);
    for (const gap of trace.tbtMs) close(gap, 12.5);
    assert.equal(trace.emits.writes, 9, 'the role-only chunk counts as a write');
    assert.equal(trace.emits.contentWrites, 8);
    assert.equal(trace.promptTokens, 1024);
    assert.equal(trace.outputTokens, 8);
    assert.equal(trace.cachedTokens, 0);

    const b = phaseBreakdown(trace);
    close(b.gatewayMs, 1.0);
    // Routing holds the hand-off to the worker (0.2 ms), prefill the first token's way to its write (0.4 ms), and
    // decode runs from that write to the end: the parts add up to TTFT and TTFT + decode to the total.
    close(b.routingMs, 0.8 + 0.2);
    close(b.queueMs, 1.2);
    close(b.prefillMs, 35.0 + 0.4);
    close(b.decodeMs, b.totalMs - b.ttftMs);
    close(b.gatewayMs + b.routingMs + b.queueMs + b.prefillMs, b.ttftMs);
    close(b.totalMs, cold.at.end - T0);
    assert.equal(trace.prefill?.chunks, 2);
    assert.equal(trace.prefill?.computedTokens, 1024);
    assert.equal(prefillSkipped(trace), false);
    assert.equal(trace.decode?.source, 'stream');
    assert.equal(trace.decode?.steps, 7);

    const names = trace.phases.map((p) => p.phase);
    assert.deepEqual(names, [
      'http_receive', 'auth', 'rate_limit', 'validate', 'tokenize', 'router_lookup', 'prefill_dispatch', 'scheduler_queue',
      'prefill_execution', 'prefill_execution', 'decode_execution', 'streaming_response',
    ]);
    for (let i = 1; i < trace.phases.length; i++) assert.ok(trace.phases[i]!.startMs >= trace.phases[i - 1]!.startMs, 'phases sorted by start');
  });

  it('marks a warm request as prefill skipped and takes its cached tokens from the engine', () => {
    const trace = buildRequestTrace(warmTimeline().events);
    assert.equal(trace.cachedTokens, 1008);
    assert.equal(trace.prefill?.computedTokens, 16);
    assert.equal(prefillSkipped(trace), true);
    assert.equal(trace.routing?.kvCacheHit, true);
    close(phaseBreakdown(trace).prefillMs, 2.0 + 0.4, 1e-3);
    close(trace.ttftMs, 2.0 + 0.5 + 2.0 + 0.4);
  });

  it('falls back to engine timestamps and step events for a non-streaming response', () => {
    const t = requestTimeline({ id: 'plain', stream: false, engineSteps: true, stepMs: [10, 11, 30, 12] });
    const trace = buildRequestTrace(t.events);
    assert.equal(trace.ttftSource, 'engine');
    close(trace.ttftMs, t.at.firstToken - T0);
    assert.deepEqual(trace.tbtMs.map((x) => Math.round(x * 1000) / 1000), [10, 11, 30, 12]);
    assert.equal(trace.decode?.source, 'engine_steps');
    assert.deepEqual(trace.decode?.batchSizes, [4, 4, 4, 4]);
    assert.equal(trace.emits.writes, 0);
  });

  it('records where an aborted request was and closes its open queue phase at the abort', () => {
    const trace = buildRequestTrace(abortedInQueueTimeline('a1'));
    assert.equal(trace.outcome, 'abort');
    assert.equal(trace.finishReason, 'abort');
    assert.equal(trace.abortReason, 'client_disconnect');
    assert.equal(trace.endedInPhase, 'scheduler_queue');
    const queue = trace.phases.find((p) => p.phase === 'scheduler_queue')!;
    assert.equal(queue.incomplete, true);
    close(queue.endMs, T0 + 40);
    assert.equal(trace.ttftMs, undefined);
    assert.equal(trace.decode, undefined);
  });

  it('records an error with its type, status and the phase it happened in', () => {
    const trace = buildRequestTrace(erroredInPrefillTimeline('e1'));
    assert.equal(trace.outcome, 'error');
    assert.equal(trace.errorType, 'engine_error');
    assert.equal(trace.status, 500);
    assert.equal(trace.endedInPhase, 'prefill_execution');
    assert.equal(trace.prefill?.chunks, 1);
  });

  it('names the gateway phase that refused a request', () => {
    const trace = buildRequestTrace(rateLimitedTimeline('r1'));
    assert.equal(trace.endedInPhase, 'rate_limit');
    assert.equal(trace.rateLimited, true);
    assert.equal(trace.rateLimitReason, 'tokens');
    assert.equal(trace.tenant, 'acme');
    assert.equal(trace.model, 'unknown');
  });

  it('takes a disaggregated request\'s transfer and prefill from the event and the prefill worker', () => {
    const t = requestTimeline({ id: 'dis', kvTransfer: { ms: 6.5, bytes: 320 << 20, from: 'prefill-0', to: 'decode-1' } });
    const trace = buildRequestTrace(t.events);
    assert.equal(trace.kvTransfer?.bytes, 320 << 20);
    close(phaseBreakdown(trace).kvTransferMs, 6.5);
    assert.ok(trace.phases.some((p) => p.phase === 'kv_transfer' && p.worker === 'decode-1'));
  });
});

describe('Telemetry collector', () => {
  it('builds one trace per request from interleaved events and forgets finished requests', () => {
    const telemetry = new Telemetry({ tracing: false });
    const got: string[] = [];
    telemetry.onTrace((trace) => got.push(`${trace.requestId}:${trace.outcome}`));
    const a = coldTimeline({ id: 'a' }).events;
    const b = warmTimeline({ id: 'b', at: T0 + 5 }).events;
    const merged: LifecycleEvent[] = [...a, ...b].sort((x, y) => x.time - y.time);
    for (const e of merged) telemetry.lifecycle.emit(e);
    assert.deepEqual(got.sort(), ['a:ok', 'b:ok']);
    assert.equal(telemetry.inFlight, 0);
    close(telemetry.trace('a')?.ttftMs, 38.6);
    close(telemetry.trace('b')?.ttftMs, 4.9);
  });

  it('ignores events after a request ended instead of opening a new record', () => {
    const telemetry = new Telemetry({ tracing: false });
    for (const e of coldTimeline({ id: 'x' }).events) telemetry.lifecycle.emit(e);
    assert.equal(telemetry.inFlight, 0);
    telemetry.lifecycle.emit({ phase: 'streaming_response', requestId: 'x', time: T0 + 500, tokens: 1 });
    assert.equal(telemetry.inFlight, 0);
    assert.equal(telemetry.trace('x')?.emits.writes, 9);
  });

  it('previews timings for a request still writing its response', () => {
    const telemetry = new Telemetry({ tracing: false });
    const cold = coldTimeline({ id: 'p' });
    const withoutFinish = cold.events.filter((e) => e.phase !== 'finish');
    for (const e of withoutFinish) telemetry.lifecycle.emit(e);
    const timings = telemetry.timings('p', cold.engine, cold.at.lastToken + 0.5);
    assert.ok(timings);
    close(timings.ttft_ms ?? undefined, 38.6);
    close(timings.queue_ms, 1.2);
    close(timings.prefill_ms, 35.4, 1e-3);
    close(timings.total_ms, cold.at.lastToken + 0.5 - T0, 1e-3);
    assert.equal(telemetry.inFlight, 1);
  });

  it('bounds the records in flight: the oldest are dropped and counted', async () => {
    const telemetry = new Telemetry({ tracing: false, maxInFlight: 3, inFlightTtlMs: 1000 });
    for (let i = 0; i < 5; i++) telemetry.lifecycle.emit({ phase: 'http_receive', requestId: `r${i}`, start: T0 + i, time: T0 + i });
    assert.equal(telemetry.inFlight, 3);
    // One more, 2 s later: every older record has outlived the 1 s limit.
    telemetry.lifecycle.emit({ phase: 'http_receive', requestId: 'late', start: T0 + 2000, time: T0 + 2000 });
    assert.equal(telemetry.inFlight, 1);
    const text = await telemetry.renderMetrics();
    assert.match(text, /conduit_telemetry_dropped_records_total\{reason="overflow"\} 2/);
    assert.match(text, /conduit_telemetry_dropped_records_total\{reason="expired"\} 3/);
  });
});
