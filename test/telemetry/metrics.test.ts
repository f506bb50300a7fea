// Prometheus metrics after known requests, read back from the registry's text exposition as a scraper would.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { GatewayMetrics } from '../../src/api/gateway-metrics.ts';
import type { LifecycleEvent } from '../../src/telemetry/lifecycle.ts';
import { ConduitMetrics, TBT_BUCKETS_MS, TTFT_BUCKETS_MS } from '../../src/telemetry/metrics.ts';
import type { EngineStats } from '../../src/protocols/worker.ts';
import { Telemetry } from '../../src/telemetry/telemetry.ts';
import { buildRequestTrace } from '../../src/telemetry/trace.ts';
import { parseExposition, total, value } from './exposition.ts';
import { PROMTOOL_MISSING, havePromtool, promtool } from './promtool.ts';
import { T0, abortedInQueueTimeline, coldTimeline, erroredInPrefillTimeline, rateLimitedTimeline, warmTimeline } from './fixtures.ts';

function near(actual: number | undefined, expected: number, eps = 1e-3): void {
  assert.ok(actual !== undefined && Math.abs(actual - expected) <= eps, `expected ${expected}, got ${actual}`);
}

/** Telemetry at T0 + 1 s, metrics only. */
function telemetryAtT0(): Telemetry {
  return new Telemetry({ tracing: false, now: () => T0 + 1000 });
}

function feed(telemetry: Telemetry, ...timelines: readonly LifecycleEvent[][]): void {
  for (const events of timelines) for (const e of events) telemetry.lifecycle.emit(e);
}

const M = { model: 'llama-70b', worker: 'worker-1' };

describe('request metrics', () => {
  it('count output tokens per completed request, and label prefill with how the weights are stored', async () => {
    const telemetry = telemetryAtT0();
    telemetry.describeModel('llama-70b', { quantization: 'Q8_0' });
    feed(telemetry, coldTimeline().events, warmTimeline({ at: T0 + 10 }).events, abortedInQueueTimeline('ab', T0 + 20));
    const x = parseExposition(await telemetry.renderMetrics());
    // Two completed requests of 8 tokens; the aborted one is not a completed request.
    assert.equal(value(x, 'conduit_output_tokens_per_request_count', { model: 'llama-70b' }), 2);
    near(value(x, 'conduit_output_tokens_per_request_sum', { model: 'llama-70b' }), 16);
    assert.equal(value(x, 'conduit_output_tokens_per_request_bucket', { model: 'llama-70b', le: '1' }), 0);
    assert.equal(value(x, 'conduit_output_tokens_per_request_bucket', { model: 'llama-70b', le: '10' }), 2);
    assert.equal(value(x, 'conduit_prefill_duration_milliseconds_count', { ...M, quantization: 'Q8_0' }), 2);
    // A model nobody described: 'none'.
    const other = telemetryAtT0();
    feed(other, coldTimeline().events);
    const y = parseExposition(await other.renderMetrics());
    assert.equal(value(y, 'conduit_prefill_duration_milliseconds_count', { ...M, quantization: 'none' }), 1);
  });

  it('move by the right amounts after known requests', async () => {
    const telemetry = telemetryAtT0();
    feed(telemetry, coldTimeline().events, warmTimeline({ at: T0 + 10 }).events, abortedInQueueTimeline('ab', T0 + 20),
      erroredInPrefillTimeline('er', T0 + 30), rateLimitedTimeline('rl', T0 + 40));
    const x = parseExposition(await telemetry.renderMetrics());

    // Requests by finish reason.
    assert.equal(value(x, 'conduit_requests_total', { model: 'llama-70b', tenant: 'acme', finish_reason: 'length' }), 2);
    assert.equal(value(x, 'conduit_requests_total', { model: 'llama-70b', finish_reason: 'abort' }), 1);
    assert.equal(value(x, 'conduit_requests_total', { model: 'llama-70b', finish_reason: 'error' }), 1);
    assert.equal(value(x, 'conduit_requests_total', { model: 'unknown', finish_reason: 'error' }), 1);

    // TTFT: 38.6 (cold) and 4.9 (warm); aborted and failed requests never produced a token.
    assert.equal(value(x, 'conduit_time_to_first_token_milliseconds_count', M), 2);
    near(value(x, 'conduit_time_to_first_token_milliseconds_sum', M), 38.6 + 4.9);
    assert.equal(value(x, 'conduit_time_to_first_token_milliseconds_bucket', { ...M, le: '5' }), 1);
    assert.equal(value(x, 'conduit_time_to_first_token_milliseconds_bucket', { ...M, le: '20' }), 1);
    assert.equal(value(x, 'conduit_time_to_first_token_milliseconds_bucket', { ...M, le: '50' }), 2);
    assert.equal(value(x, 'conduit_time_to_first_token_milliseconds_bucket', { ...M, le: '+Inf' }), 2);

    // TBT: 7 gaps of 12.5 ms per finished request.
    assert.equal(value(x, 'conduit_time_between_tokens_milliseconds_count', M), 14);
    near(value(x, 'conduit_time_between_tokens_milliseconds_sum', M), 14 * 12.5);
    assert.equal(value(x, 'conduit_time_between_tokens_milliseconds_bucket', { ...M, le: '10' }), 0);
    assert.equal(value(x, 'conduit_time_between_tokens_milliseconds_bucket', { ...M, le: '20' }), 14);

    // Queue wait of every request that left the queue (the aborted one never did); prefill of every one with chunks.
    assert.equal(value(x, 'conduit_queue_wait_milliseconds_count', M), 3);
    near(value(x, 'conduit_queue_wait_milliseconds_sum', M), 1.2 + 0.5 + 1.2);
    assert.equal(value(x, 'conduit_prefill_duration_milliseconds_count', M), 3);
    near(value(x, 'conduit_prefill_duration_milliseconds_sum', M), 35 + 2 + 10.8);
    assert.equal(value(x, 'conduit_decode_duration_milliseconds_count', M), 2);
    near(value(x, 'conduit_decode_duration_milliseconds_sum', M), 2 * 87.5);
    assert.equal(value(x, 'conduit_request_duration_milliseconds_count', { model: 'llama-70b', outcome: 'ok' }), 2);
    assert.equal(value(x, 'conduit_request_duration_milliseconds_count', { model: 'llama-70b', outcome: 'abort' }), 1);

    // Routing and gateway phases.
    assert.equal(value(x, 'conduit_routing_duration_milliseconds_count', { model: 'llama-70b', strategy: 'kv_aware' }), 4);
    near(value(x, 'conduit_routing_duration_milliseconds_sum', { model: 'llama-70b', strategy: 'kv_aware' }), 4 * 0.8);
    near(value(x, 'conduit_routing_sub_phase_duration_milliseconds_sum', { sub_phase: 'index_lookup' }), 4 * 0.3);
    assert.equal(value(x, 'conduit_gateway_phase_duration_milliseconds_count', { phase: 'auth' }), 5);
    assert.equal(value(x, 'conduit_gateway_phase_duration_milliseconds_count', { phase: 'tokenize' }), 4);

    // Tokens: prompts of requests that reached the engine, outputs, cache hits.
    const labels = { model: 'llama-70b', worker: 'worker-1', tenant: 'acme' };
    assert.equal(value(x, 'conduit_request_prompt_tokens_total', labels), 3 * 1024);
    assert.equal(value(x, 'conduit_request_generation_tokens_total', labels), 16);
    assert.equal(value(x, 'conduit_request_cached_tokens_total', labels), 1008);
    assert.equal(value(x, 'conduit_request_prefix_cache_hit_ratio_count', M), 3);
    assert.equal(value(x, 'conduit_request_prefix_cache_hit_ratio_bucket', { ...M, le: '0' }), 2);

    // Failures, cancellations, rate limiting.
    assert.equal(value(x, 'conduit_request_errors_total', { model: 'llama-70b', error_type: 'engine_error', origin: 'server' }), 1);
    assert.equal(value(x, 'conduit_request_errors_total', { model: 'unknown', error_type: 'rate_limited', origin: 'client' }), 1);
    assert.equal(value(x, 'conduit_request_cancellations_total', { model: 'llama-70b', tenant: 'acme', phase: 'scheduler_queue' }), 1);
    assert.equal(value(x, 'conduit_rate_limit_rejections_total', { tenant: 'acme', reason: 'tokens' }), 1);
  });

  it('count KV transfers of disaggregated requests under the decode worker', async () => {
    const metrics = new ConduitMetrics();
    const events = coldTimeline({ kvTransfer: { ms: 6.5, bytes: 335_544_320, from: 'prefill-0', to: 'decode-1' } }).events;
    metrics.observeTrace(buildRequestTrace(events));
    metrics.observeTrace(buildRequestTrace(coldTimeline({ id: 'again', kvTransfer: { ms: 3.5, bytes: 1000, from: 'prefill-0', to: 'decode-1' } }).events));
    const x = parseExposition(await metrics.render());
    assert.equal(value(x, 'conduit_kv_transfer_bytes_total', { worker: 'decode-1' }), 335_545_320);
    assert.equal(value(x, 'conduit_kv_transfer_duration_milliseconds_count', { worker: 'decode-1' }), 2);
    near(value(x, 'conduit_kv_transfer_duration_milliseconds_sum', { worker: 'decode-1' }), 10);
  });

  it('count KV transfers per link, and a decode worker\'s failed imports by reason from its stats', async () => {
    const metrics = new ConduitMetrics();
    metrics.observeTrace(buildRequestTrace(coldTimeline({ kvTransfer: { ms: 2, bytes: 4096, blocks: 4, link: 'tcp', from: 'p', to: 'd' } }).events));
    metrics.observeTrace(buildRequestTrace(coldTimeline({ id: 'shm', kvTransfer: { ms: 1, bytes: 2048, blocks: 2, link: 'shm', from: 'p', to: 'd' } }).events));
    const base = { numRunning: 0, numWaiting: 0, kvBlocksUsed: 0, kvBlocksTotal: 8, prefixCacheQueries: 0, prefixCacheHits: 0, preemptions: 0 };
    metrics.updateFromEngineStats({ worker: 'd', stats: { ...base, kvTransferLinks: { tcp: { failures: { checksum: 1 }, fallbacks: 1 } } } });
    metrics.updateFromEngineStats({ worker: 'd', stats: { ...base, kvTransferLinks: { tcp: { failures: { checksum: 2, connect: 1 }, fallbacks: 3 } } } });
    const x = parseExposition(await metrics.render());
    assert.equal(value(x, 'conduit_kv_transfer_bytes_total', { worker: 'd', link: 'tcp' }), 4096);
    assert.equal(value(x, 'conduit_kv_transfer_blocks_total', { worker: 'd', link: 'tcp' }), 4);
    assert.equal(value(x, 'conduit_kv_transfer_blocks_total', { worker: 'd', link: 'shm' }), 2);
    assert.equal(value(x, 'conduit_kv_transfer_duration_milliseconds_count', { worker: 'd', link: 'shm' }), 1);
    assert.equal(value(x, 'conduit_kv_transfer_failures_total', { worker: 'd', link: 'tcp', reason: 'checksum' }), 2);
    assert.equal(value(x, 'conduit_kv_transfer_failures_total', { worker: 'd', link: 'tcp', reason: 'connect' }), 1);
    assert.equal(value(x, 'conduit_kv_transfer_fallbacks_total', { worker: 'd', link: 'tcp' }), 3);
  });

  it('judge a request slow by its own model\'s SLO targets, in /v1/analysis as in the counter', async () => {
    // llama-70b's TTFT target is 1 s here: a 400 ms queue wait is within it, though over the 200 ms default.
    const telemetry = new Telemetry({
      tracing: false, now: () => T0 + 1000,
      slo: { perModel: { 'llama-70b': { ttft: { targetMs: 1000, warningMs: 2000 } } } },
    });
    feed(telemetry, coldTimeline({ id: 'q', queueMs: 400 }).events);
    const x = parseExposition(await telemetry.renderMetrics());
    assert.equal(total(x, 'conduit_slow_request_bottlenecks_total'), 0, 'within its model\'s target');
    const analysis = telemetry.analysis();
    assert.equal(analysis.requests, 1);
    assert.equal(analysis.slow_requests, 0, JSON.stringify(analysis.categories));
    assert.equal(analysis.categories.queue_saturation, 0);
  });

  it('classify requests over the SLO target by bottleneck', async () => {
    const telemetry = telemetryAtT0();
    feed(telemetry, coldTimeline({ id: 'q', queueMs: 400 }).events, coldTimeline({ id: 'fine', at: T0 + 1 }).events);
    const x = parseExposition(await telemetry.renderMetrics());
    assert.equal(value(x, 'conduit_slow_request_bottlenecks_total', { category: 'queue_saturation' }), 1);
    assert.equal(total(x, 'conduit_slow_request_bottlenecks_total'), 1, 'the fast request is not classified');
  });

  it('export the SLO window as gauges at scrape time', async () => {
    let now = T0 + 1000;
    const telemetry = new Telemetry({ tracing: false, now: () => now });
    feed(telemetry, coldTimeline().events, erroredInPrefillTimeline('e', T0 + 5));
    let x = parseExposition(await telemetry.renderMetrics());
    near(value(x, 'conduit_slo_ttft_milliseconds', { model: 'llama-70b', percentile: '0.99' }), 38.6, 38.6 * 0.01);
    near(value(x, 'conduit_slo_tbt_milliseconds', { model: 'llama-70b', percentile: '0.99' }), 12.5, 12.5 * 0.01);
    near(value(x, 'conduit_slo_error_ratio', { model: 'llama-70b' }), 0.5);
    assert.equal(value(x, 'conduit_slo_status', { model: 'llama-70b', objective: 'ttft' }), 0);
    assert.equal(value(x, 'conduit_slo_status', { model: 'llama-70b', objective: 'error_rate' }), 2);
    now = T0 + 10 * 60 * 1000;
    x = parseExposition(await telemetry.renderMetrics());
    assert.equal(value(x, 'conduit_slo_ttft_milliseconds', { model: 'llama-70b', percentile: '0.99' }), undefined, 'gone once the window has passed');
  });

  it('label the SLO latency gauges with the configured percentile, not a p99 the objective is not', async () => {
    const telemetry = new Telemetry({ tracing: false, now: () => T0 + 1000, slo: { percentile: 0.95 } });
    feed(telemetry, coldTimeline().events);
    const x = parseExposition(await telemetry.renderMetrics());
    const ttft = telemetry.sloReport().models[0]!.ttft.p99_ms!;
    assert.equal(value(x, 'conduit_slo_ttft_milliseconds', { model: 'llama-70b', percentile: '0.95' }), ttft);
    assert.ok(value(x, 'conduit_slo_tbt_milliseconds', { model: 'llama-70b', percentile: '0.95' }) !== undefined);
    assert.deepEqual([...x.types.keys()].filter((name) => /^conduit_slo_.*p99/.test(name)), [], 'no family named p99');
    assert.equal(total(x, 'conduit_slo_ttft_milliseconds'), ttft, 'one series per model: the configured percentile\'s');
  });

  it('take no time between tokens from an n > 1 stream, whose completions\' writes interleave', async () => {
    /** A stream of n completions: each step writes one chunk per completion. */
    const forked = (id: string, at: number, engineSteps = false): LifecycleEvent[] => coldTimeline({ id, at, engineSteps }).events.flatMap((e): LifecycleEvent[] => {
      if (e.phase === 'validate') return [{ ...e, n: 2 }];
      if (e.phase === 'streaming_response' && e.tokens > 0) return [e, { ...e, time: e.time + 0.05 }];
      return [e];
    });
    const telemetry = telemetryAtT0();
    feed(telemetry, forked('n2', T0));
    const trace = telemetry.trace('n2')!;
    assert.deepEqual(trace.tbtMs, [], 'gaps between writes of different completions are no completion\'s');
    assert.equal(telemetry.timings('n2')!.tbt_p50_ms, null);
    assert.equal(telemetry.sloReport(T0 + 1000).models[0]!.tbt.samples, 0);
    const x = parseExposition(await telemetry.renderMetrics());
    assert.equal(value(x, 'conduit_time_between_tokens_milliseconds_count', M) ?? 0, 0);
    assert.equal(value(x, 'conduit_time_to_first_token_milliseconds_count', M), 1, 'TTFT still counts: the first write of any completion');
    // With decode steps traced one by one, the gaps between the engine's steps: each step gives every completion a token.
    const stepped = telemetryAtT0();
    feed(stepped, forked('n2s', T0, true));
    assert.deepEqual(stepped.trace('n2s')!.tbtMs.map((g) => Math.round(g * 10) / 10), Array.from({ length: 7 }, () => 12.5));
  });

  it('use buckets that include the SLO thresholds, so alerts compare at bucket bounds', () => {
    for (const threshold of [200, 500, 2000]) assert.ok(TTFT_BUCKETS_MS.includes(threshold));
    for (const threshold of [50, 100]) assert.ok(TBT_BUCKETS_MS.includes(threshold));
    assert.ok(TTFT_BUCKETS_MS[0]! <= 10 && TTFT_BUCKETS_MS.at(-1)! >= 30_000);
  });
});

describe('engine stats', () => {
  const stats = (over: Partial<EngineStats> = {}): EngineStats => ({
    numRunning: 3, numWaiting: 7, kvBlocksUsed: 90, kvBlocksTotal: 120, prefixCacheQueries: 1000, prefixCacheHits: 600, preemptions: 2, ...over,
  });

  it('set the load gauges and advance counters by the change between snapshots', async () => {
    const metrics = new ConduitMetrics();
    metrics.updateFromEngineStats({ worker: 'w0', model: 'm', stats: stats(), kvEvictions: 5, kvUtilizationByTier: { host: 0.25 } });
    metrics.updateFromEngineStats({ worker: 'w0', model: 'm', stats: stats({ numWaiting: 4, prefixCacheQueries: 1500, prefixCacheHits: 800, preemptions: 3 }), kvEvictions: 9 });
    metrics.updateFromEngineStats({ worker: 'w1', model: 'm', stats: stats({ kvBlocksUsed: 0 }) });
    let x = parseExposition(await metrics.render());
    assert.equal(value(x, 'conduit_scheduler_queue_depth', { model: 'm', worker: 'w0' }), 4);
    assert.equal(value(x, 'conduit_running_batch_size', { model: 'm', worker: 'w0' }), 3);
    near(value(x, 'conduit_kv_cache_utilization_ratio', { worker: 'w0', tier: 'primary' }), 0.75);
    near(value(x, 'conduit_kv_cache_utilization_ratio', { worker: 'w0', tier: 'host' }), 0.25);
    assert.equal(value(x, 'conduit_kv_cache_utilization_ratio', { worker: 'w1', tier: 'primary' }), 0);
    assert.equal(value(x, 'conduit_prefix_cache_query_tokens_total', { worker: 'w0' }), 1500);
    assert.equal(value(x, 'conduit_prefix_cache_hit_tokens_total', { worker: 'w0' }), 800);
    assert.equal(value(x, 'conduit_scheduler_preemptions_total', { model: 'm', worker: 'w0' }), 3);
    assert.equal(value(x, 'conduit_kv_cache_evictions_total', { worker: 'w0' }), 9);

    // The engine restarted: its counters fell back, and everything it now reports is new.
    metrics.updateFromEngineStats({ worker: 'w0', model: 'm', stats: stats({ prefixCacheQueries: 100, prefixCacheHits: 10, preemptions: 0 }) });
    x = parseExposition(await metrics.render());
    assert.equal(value(x, 'conduit_prefix_cache_query_tokens_total', { worker: 'w0' }), 1600);
    assert.equal(value(x, 'conduit_prefix_cache_hit_tokens_total', { worker: 'w0' }), 810);
    assert.equal(value(x, 'conduit_scheduler_preemptions_total', { model: 'm', worker: 'w0' }), 3);

    metrics.forgetWorker('w0');
    x = parseExposition(await metrics.render());
    assert.equal(value(x, 'conduit_scheduler_queue_depth', { worker: 'w0' }), undefined);
    assert.equal(value(x, 'conduit_kv_cache_utilization_ratio', { worker: 'w0', tier: 'host' }), undefined);
    assert.equal(value(x, 'conduit_scheduler_queue_depth', { worker: 'w1' }), 7);
  });
});

describe('exposition', () => {
  it('passes promtool\'s metric lint apart from the deliberate millisecond units', async (t) => {
    if (!havePromtool()) return t.skip(PROMTOOL_MISSING);
    const telemetry = telemetryAtT0();
    feed(telemetry, coldTimeline().events, erroredInPrefillTimeline('e', T0 + 5), rateLimitedTimeline('r', T0 + 6));
    telemetry.updateEngineStats({ worker: 'w0', model: 'llama-70b', stats: { numRunning: 1, numWaiting: 0, kvBlocksUsed: 1, kvBlocksTotal: 2, prefixCacheQueries: 0, prefixCacheHits: 0, preemptions: 0 } });
    const { output } = promtool(['check', 'metrics'], await telemetry.renderMetrics());
    const problems = output.split('\n').filter((line) => line.trim() !== '' && !/use base unit "seconds" instead of "milliseconds"/.test(line));
    assert.deepEqual(problems, []);
  });

  it('shares one registry with the gateway\'s families, each family once', async () => {
    // The server registers the gateway's families in the telemetry's registry and renders that registry alone.
    const metrics = new ConduitMetrics();
    const gateway = new GatewayMetrics(metrics.registry);
    gateway.countResponse('completions', 200, 'main');
    gateway.requestStarted('main');
    const stats = { numRunning: 0, numWaiting: 0, kvBlocksUsed: 3, kvBlocksTotal: 8, prefixCacheQueries: 0, prefixCacheHits: 0, preemptions: 0 };
    const text = await gateway.render([{ model: 'm', stats: stats as EngineStats }]);
    assert.equal(text, await metrics.render(), 'one exposition, the registry\'s');
    const typeLines = text.split('\n').filter((l) => l.startsWith('# TYPE ')).map((l) => l.split(' ')[2]!);
    assert.deepEqual(typeLines.filter((name, i) => typeLines.indexOf(name) !== i), []);
    const x = parseExposition(text);
    assert.equal(x.types.get('conduit_http_responses_total'), 'counter');
    assert.equal(x.types.get('conduit_gateway_requests_in_flight'), 'gauge');
    assert.equal(value(x, 'conduit_http_responses_total', { route: 'completions', status: '200', tenant: 'main' }), 1);
    assert.equal(value(x, 'conduit_gateway_requests_in_flight', { tenant: 'main' }), 1);
    assert.equal(value(x, 'conduit_kv_cache_used_blocks', { model: 'm' }), 3);
    assert.equal(value(x, 'conduit_kv_cache_capacity_blocks', { model: 'm' }), 8);
    // A second server on the same telemetry shares the families rather than failing to register them again.
    const second = new GatewayMetrics(metrics.registry);
    second.countResponse('completions', 200, 'main');
    assert.equal(value(parseExposition(await metrics.render()), 'conduit_http_responses_total', { route: 'completions', status: '200', tenant: 'main' }), 2);
    // Their requests in flight add up: each server counts its own, the gauge holds the sum.
    second.requestStarted('main');
    assert.equal(value(parseExposition(await metrics.render()), 'conduit_gateway_requests_in_flight', { tenant: 'main' }), 2);
    gateway.requestEnded('main');
    gateway.requestEnded('main'); // one more end than starts on this server: it takes nothing from the other's
    assert.equal(value(parseExposition(await metrics.render()), 'conduit_gateway_requests_in_flight', { tenant: 'main' }), 1);
  });
});
