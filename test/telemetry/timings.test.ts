// Per-request views: the timings object, the trace JSON, the ring of recent traces and the text waterfall.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { formatWaterfall, responseTimings, TraceStore } from '../../src/telemetry/timings.ts';
import { buildRequestTrace, type RequestTrace } from '../../src/telemetry/trace.ts';
import { Telemetry } from '../../src/telemetry/telemetry.ts';
import { T0, abortedInQueueTimeline, coldTimeline, requestTimeline, warmTimeline } from './fixtures.ts';

describe('responseTimings', () => {
  it('gives ms per phase, cached tokens and whether prefill was skipped', () => {
    assert.deepEqual(responseTimings(buildRequestTrace(coldTimeline().events)), {
      ttft_ms: 38.6, total_ms: 126.6, gateway_ms: 1, routing_ms: 1, queue_ms: 1.2, prefill_ms: 35.4, decode_ms: 88,
      tbt_p50_ms: 12.5, cached_tokens: 0, prefill_skipped: false,
    });
    const warm = responseTimings(buildRequestTrace(warmTimeline().events));
    assert.equal(warm.cached_tokens, 1008);
    assert.equal(warm.prefill_skipped, true);
    assert.equal(warm.prefill_ms, 2.4, 'up to the first token\'s write');
    assert.equal(warm.ttft_ms, 4.9);
  });

  it('treats a partial prefix hit as a real prefill, and uses the engine\'s block size when it reports one', () => {
    const partial = buildRequestTrace(requestTimeline({ cachedTokens: 512, chunks: [[20, 512]] }).events);
    assert.equal(responseTimings(partial).prefill_skipped, false);
    const bigBlocks = requestTimeline({ cachedTokens: 960, chunks: [[5, 64]] });
    const events = bigBlocks.events.map((e) => (e.phase === 'finish' ? { ...e, engine: { ...bigBlocks.engine, blockSize: 64 } } : e));
    assert.equal(responseTimings(buildRequestTrace(bigBlocks.events)).prefill_skipped, false, '64 tokens computed > 16-token default block');
    assert.equal(responseTimings(buildRequestTrace(events)).prefill_skipped, true, 'one 64-token block is a full hit');
  });

  it('carries the KV transfer only for a disaggregated request', () => {
    const t = responseTimings(buildRequestTrace(requestTimeline({ kvTransfer: { ms: 6.5, bytes: 1, from: 'a', to: 'b' } }).events));
    assert.equal(t.kv_transfer_ms, 6.5);
    assert.equal('kv_transfer_ms' in responseTimings(buildRequestTrace(coldTimeline().events)), false);
    assert.equal('kv_transfer' in responseTimings(buildRequestTrace(coldTimeline().events)), false);
    // What moved, over which link, and how fast.
    const tcp = responseTimings(buildRequestTrace(requestTimeline({ kvTransfer: { ms: 4, bytes: 8_000_000, blocks: 5, link: 'tcp', from: 'a', to: 'b' } }).events));
    assert.deepEqual(tcp.kv_transfer, { bytes: 8_000_000, blocks: 5, link: 'tcp', ms: 4, bytes_per_sec: 2_000_000_000 });
  });
});

describe('Telemetry.timings preview', () => {
  it('counts the tokens of the write the timings go out with as written then (a one-token stream\'s TTFT)', () => {
    const telemetry = new Telemetry({ tracing: false });
    const one = requestTimeline({ id: 'one-token', outputTokens: 1 });
    // The stream's only content chunk is its last: it carries the first token and the timings, taken just before it
    // goes out, 0.4 ms after the engine sampled the token.
    for (const e of one.events) if (e.phase !== 'finish' && !(e.phase === 'streaming_response' && e.tokens > 0)) telemetry.lifecycle.emit(e);
    const takenAt = one.at.firstToken + 0.4;
    const preview = telemetry.timings('one-token', one.engine, takenAt, 1, 1)!;
    assert.equal(preview.ttft_ms, Number((takenAt - T0).toFixed(3)), 'TTFT is the write, not the engine\'s first token');
    assert.equal(preview.decode_ms, 0);

    // The finished request (the trace behind the metrics and the SLO report) says the same.
    for (const e of one.events) if (e.phase === 'finish' || (e.phase === 'streaming_response' && e.tokens > 0)) telemetry.lifecycle.emit(e);
    const done = telemetry.timings('one-token')!;
    assert.equal(done.ttft_ms, preview.ttft_ms);
    assert.equal(done.prefill_ms, preview.prefill_ms);
  });
});

describe('traceView', () => {
  it('gives phase offsets from arrival and the request\'s traceparent', () => {
    const telemetry = new Telemetry({ env: { OTEL_TRACES_EXPORTER: 'console' }, sampling: { baseRate: 0 }, random: () => 0.5 });
    // The console exporter would print kept spans; this request is fast and unsampled, so nothing is printed.
    for (const e of coldTimeline({ id: 'v' }).events) telemetry.lifecycle.emit(e);
    const view = telemetry.traceView('v')!;
    assert.match(view.traceparent!, new RegExp(`^00-${view.trace_id}-[0-9a-f]{16}-00$`));
    const queue = view.phases.find((p) => p.phase === 'scheduler_queue')!;
    assert.deepEqual([queue.start_ms, queue.duration_ms], [2, 1.2]);
    assert.deepEqual(view.usage, { prompt_tokens: 1024, completion_tokens: 8, cached_tokens: 0 });
    assert.deepEqual(view.tbt, { count: 7, p50_ms: 12.5, p99_ms: 12.5, max_ms: 12.5 });
    assert.equal(view.decode?.steps, 7);
    assert.equal(view.sampling, 'not_sampled');
    assert.doesNotThrow(() => JSON.stringify(view));
  });
});

describe('TraceStore', () => {
  const t = (id: string, endMs: number): RequestTrace => ({ ...buildRequestTrace(coldTimeline({ id }).events), endMs });

  it('keeps the last `capacity` traces by id, newest first', () => {
    const store = new TraceStore(3);
    for (let i = 0; i < 5; i++) store.add(t(`r${i}`, T0 + i));
    assert.equal(store.size, 3);
    assert.equal(store.get('r0'), undefined);
    assert.equal(store.get('r1'), undefined);
    assert.equal(store.get('r4')?.requestId, 'r4');
    assert.deepEqual(store.recent().map((x) => x.requestId), ['r4', 'r3', 'r2']);
    assert.deepEqual(store.recent(2).map((x) => x.requestId), ['r4', 'r3']);
    assert.deepEqual(store.endedSince(T0 + 3).map((x) => x.requestId), ['r4', 'r3']);
  });

  it('finds the newest trace when an id comes back, and survives the old slot being overwritten', () => {
    const store = new TraceStore(2);
    store.add(t('dup', T0));
    store.add(t('dup', T0 + 1));
    store.add(t('x', T0 + 2));
    assert.equal(store.get('dup')?.endMs, T0 + 1);
  });
});

describe('formatWaterfall', () => {
  it('draws one row per phase in order on an axis from arrival to end, with the first token marked', () => {
    const text = formatWaterfall(buildRequestTrace(coldTimeline().events), { width: 60 });
    const lines = text.split('\n');
    assert.match(lines[0]!, /^request req-cold {2}model llama-70b {2}worker worker-1 {2}ok \(length\)$/);
    assert.match(lines[1]!, /total 126\.6 ms {2}TTFT 38\.6 ms {2}prompt 1024 tokens \(0 cached\) {2}output 8 tokens/);
    const rows = lines.filter((l) => /^[a-z_]+( \(|\s{2})/.test(l) && !l.startsWith('phase') && !l.startsWith('first token'));
    assert.deepEqual(rows.map((l) => l.split(/\s{2,}/)[0]), [
      'http_receive', 'auth', 'rate_limit', 'validate', 'tokenize', 'router_lookup', 'prefill_dispatch', 'scheduler_queue',
      'prefill_execution', 'prefill_execution', 'decode_execution (7 steps)', 'streaming_response (9 writes)',
    ]);
    // The bar area starts two columns after the duration column; a 35 ms prefill of a 126.6 ms request spans
    // 35/126.6 of 60 columns, split over its two chunks.
    const header = lines.find((l) => l.startsWith('phase'))!;
    const barStart = header.indexOf('|0 ms');
    const chunkBars = rows.filter((l) => l.startsWith('prefill_execution')).map((l) => l.slice(barStart));
    const hashes = chunkBars.map((b) => (b.match(/#/g) ?? []).length);
    assert.ok(Math.abs(hashes[0]! + hashes[1]! - (35 / 126.6) * 60) <= 2, `prefill bars ${hashes}`);
    assert.equal(chunkBars[0]!.indexOf('#'), Math.floor((3.2 / 126.6) * 60));
    const caret = lines.find((l) => l.startsWith('first token'))!;
    assert.equal(caret.indexOf('^') - barStart, Math.floor((38.6 / 126.6) * 60));
    assert.match(text, /decode: 7 steps, step p50 12\.5 ms, max 12\.5 ms/);
    assert.match(text, /time between tokens: p50 12\.5 ms, p99 12\.5 ms/);
  });

  it('marks a phase the request ended inside', () => {
    const text = formatWaterfall(buildRequestTrace(abortedInQueueTimeline('q')));
    assert.match(text, /aborted \(client_disconnect\) in scheduler_queue/);
    assert.match(text, /scheduler_queue \(cut short\)\s+2\.00\s+38\.0\s+~+/);
  });

  it('shows the gateway phase a client left inside, though the gateway never stamped its end', () => {
    // Left while its prompt was tokenized: the gateway stamps tokenize only once it is done, so the request ended
    // inside a phase it has no event for.
    const gateway = coldTimeline({ id: 'left' }).events.filter((e) => ['http_receive', 'auth', 'rate_limit', 'validate'].includes(e.phase));
    const validatedAt = gateway.find((e) => e.phase === 'validate')!.time;
    const leftAt = T0 + 150;
    const trace = buildRequestTrace([...gateway,
      { phase: 'abort', requestId: 'left', time: leftAt, reason: 'client_disconnect', promptTokens: 0, outputTokens: 0 }]);
    assert.equal(trace.endedInPhase, 'tokenize');
    const tokenize = trace.phases.find((p) => p.phase === 'tokenize');
    assert.deepEqual(tokenize && { startMs: tokenize.startMs, endMs: tokenize.endMs, incomplete: tokenize.incomplete },
      { startMs: validatedAt, endMs: leftAt, incomplete: true });
    assert.match(formatWaterfall(trace), /tokenize \(cut short\)\s+[\d.]+\s+[\d.]+\s+~+/);
  });

  it('folds many chunks of one phase into one row', () => {
    const chunks = Array.from({ length: 12 }, (): [number, number] => [5, 256]);
    const text = formatWaterfall(buildRequestTrace(requestTimeline({ promptTokens: 3072, chunks }).events), { maxRowsPerPhase: 8 });
    assert.match(text, /prefill_execution x12\s+3\.20\s+60\.0/);
  });
});
