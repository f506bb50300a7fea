// The trace analyzer: one constructed timeline per bottleneck category, and the window report.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { TraceAnalyzer, type BottleneckCategory } from '../../src/telemetry/analyzer.ts';
import { buildRequestTrace, type RequestTrace } from '../../src/telemetry/trace.ts';
import type { EngineReport, LifecycleEvent } from '../../src/telemetry/lifecycle.ts';
import { T0, abortedInQueueTimeline, erroredInPrefillTimeline, rateLimitedTimeline, requestTimeline, type TimelineOptions } from './fixtures.ts';

const analyzer = new TraceAnalyzer();

function trace(o: TimelineOptions): RequestTrace {
  return buildRequestTrace(requestTimeline(o).events);
}

/** One timeline per category (shares are of TTFT = arrival .. first streamed token). */
// decode_batch_bound and decode_preempted are constructed on the engines (test/telemetry/decode-bottleneck.test.ts).
const CASES: Partial<Record<BottleneckCategory, TimelineOptions>> = {
  // 400 ms of a 437 ms TTFT in the queue.
  queue_saturation: { id: 'queue', queueMs: 400, queueDepth: 57 },
  // 600 ms prefill of 604 ms TTFT, nothing cached.
  prefill_no_cache: { id: 'nocache', chunks: [[300, 512], [300, 512]] },
  // Half the prompt cached, the other half still takes 400 ms.
  prefill_compute_bound: { id: 'compute', cachedTokens: 512, chunks: [[400, 512]] },
  // 100 ms to move the KV, 20 ms prefill.
  kv_transfer_bound: { id: 'transfer', chunks: [[20, 1024]], kvTransfer: { ms: 100, bytes: 320 << 20, from: 'p0', to: 'd1' } },
  // One 300 ms step among 10 ms ones; decode dominates the request.
  decode_latency_spike: { id: 'spike', engineSteps: true, stepMs: [10, 10, 10, 300, 10, 10, 10, 10, 10] },
  // 400 tokens at 1.4 ms after a 21.5 ms prefill of nothing cached (86% of TTFT, 4% of the request).
  decode_output_length: { id: 'long-output', promptTokens: 295, chunks: [[21.5, 295]], outputTokens: 400, stepMs: 1.4 },
  // Queue and prefill about even, a short steady decode.
  balanced: { id: 'even', queueMs: 10, chunks: [[10, 1024]], outputTokens: 2 },
};

/** A timeline's events with the request's max_tokens, finish reason and streaming changed. */
function variant(o: TimelineOptions, change: { maxTokens?: number; finishReason?: string }): RequestTrace {
  return buildRequestTrace(requestTimeline(o).events.map((e) => {
    if (e.phase === 'validate' && change.maxTokens !== undefined) return { ...e, maxTokens: change.maxTokens };
    if (e.phase === 'finish' && change.finishReason !== undefined) return { ...e, finishReason: change.finishReason };
    return e;
  }));
}

describe('TraceAnalyzer.classify', () => {
  for (const [category, options] of Object.entries(CASES) as [BottleneckCategory, TimelineOptions][]) {
    it(`names ${category}`, () => {
      const d = analyzer.classify(trace(options));
      assert.equal(d.category, category, d.recommendation);
      assert.equal(d.request_id, options.id);
      assert.ok(d.recommendation.length > 20);
    });
  }

  it('gives the dominant phase, its share of TTFT and numbers in the recommendation', () => {
    const d = analyzer.classify(trace(CASES.queue_saturation!));
    assert.equal(d.dominant_phase, 'scheduler_queue');
    // TTFT = 2 (gateway + routing with the hand-off) + 400 queue + 35.4 prefill (with the first token's write).
    assert.ok(Math.abs(d.dominant_share - 400 / 437.4) < 1e-3, String(d.dominant_share));
    assert.equal(d.dominant_ms, 400);
    assert.match(d.recommendation, /400 ms/);
    assert.match(d.recommendation, /57 requests ahead/);
    assert.equal(d.breakdown_ms.queue, 400);
    assert.equal(d.breakdown_ms.prefill, 35.4);

    const nocache = analyzer.classify(trace(CASES.prefill_no_cache!));
    assert.equal(nocache.dominant_phase, 'prefill_execution');
    assert.match(nocache.recommendation, /0% of the 1024-token prompt/);
    const compute = analyzer.classify(trace(CASES.prefill_compute_bound!));
    assert.match(compute.recommendation, /50% prefix-cache hit/);
    const kv = analyzer.classify(trace(CASES.kv_transfer_bound!));
    assert.equal(kv.dominant_phase, 'kv_transfer');
    assert.match(kv.recommendation, /from p0 to d1/);
  });

  it('says what each share is of: TTFT, the request, or the decode steps\' time', () => {
    assert.equal(analyzer.classify(trace(CASES.queue_saturation!)).dominant_share_of, 'ttft');
    assert.equal(analyzer.classify(trace(CASES.prefill_no_cache!)).dominant_share_of, 'ttft');
    assert.equal(analyzer.classify(trace(CASES.decode_output_length!)).dominant_share_of, 'request');
    assert.equal(analyzer.classify(trace(CASES.decode_latency_spike!)).dominant_share_of, 'decode_steps');
    assert.equal(analyzer.classify(trace(CASES.balanced!)).dominant_share_of, null);
    assert.equal(analyzer.classify(buildRequestTrace(rateLimitedTimeline('limited'))).dominant_share_of, null);
  });

  it('names a long output at a healthy time per token decode_output_length, with its numbers, not a TTFT category', () => {
    // The prefill was 86% of TTFT, but TTFT 4% of the request: the time went to 400 tokens at 1.4 ms.
    const d = analyzer.classify(trace(CASES.decode_output_length!));
    assert.equal(d.category, 'decode_output_length', d.recommendation);
    assert.equal(d.dominant_phase, 'decode_execution');
    assert.equal(d.dominant_ms, d.breakdown_ms.decode);
    assert.ok(d.dominant_ms > 399 * 1.4, String(d.dominant_ms));
    assert.ok(Math.abs(d.dominant_share - d.dominant_ms / d.total_ms) < 1e-3, String(d.dominant_share));
    assert.ok(d.dominant_share > 0.95);
    assert.match(d.recommendation, /^Decode took 559 ms, 96% of the request: 400 output tokens in 399 steps at 1\.4 ms per token \(under the 50\.0 ms TBT target\), with no step spiking\. /);
    assert.match(d.recommendation, /the length of the output/);
    assert.match(d.recommendation, /ran until its token limit, max_tokens \(64\)/);
    assert.match(d.recommendation, /A lower max_tokens, stop sequences, or a prompt that asks for a shorter answer/);
    assert.doesNotMatch(d.recommendation, /prefix|No single phase/);
    assert.match(d.recommendation, /The first token came after 25\.\d ms, 8\d% of it prefill\.$/);

    // A 2-token prompt, 300 tokens out: nothing before the first token to speak of, and decode 99% of the request.
    const tiny = analyzer.classify(variant({ id: 'tiny', promptTokens: 2, queueMs: 0.7, chunks: [[2.3, 2]], outputTokens: 300, stepMs: 1.16 }, { maxTokens: 300 }));
    assert.equal(tiny.category, 'decode_output_length', tiny.recommendation);
    assert.match(tiny.recommendation, /300 output tokens in 299 steps at 1\.2 ms per token/);
    assert.match(tiny.recommendation, /max_tokens \(300\)/);

    // Queue wait 66% of TTFT is not the bottleneck when TTFT is a third of the request and the rest is 400 steady tokens.
    const queued = analyzer.classify(trace({ id: 'queued-long', queueMs: 300, queueDepth: 3, chunks: [[150, 1024]], outputTokens: 400, stepMs: 2.5 }));
    assert.equal(queued.category, 'decode_output_length', queued.recommendation);
    assert.match(queued.recommendation, /The first token came after 452 ms, 66% of it waiting in the queue\.$/);

    // The model ended it, and the client did not stream: said so, with what streaming would change.
    const ended = analyzer.classify(variant({ id: 'ended', stream: false, outputTokens: 200, stepMs: 3 }, { finishReason: 'stop' }));
    assert.equal(ended.category, 'decode_output_length', ended.recommendation);
    assert.match(ended.recommendation, /the model ended the answer itself/);
    assert.match(ended.recommendation, /streaming \(stream: true\) would show it then/);
  });

  it('keeps the decode categories that explain a slow decode ahead of decode_output_length', () => {
    // Steps at the TBT target: decode_batch_bound; one step spiking: decode_latency_spike.
    const slow = analyzer.classify(trace({ id: 'slow-steps', engineSteps: true, outputTokens: 20, stepMs: 60 }));
    assert.equal(slow.category, 'decode_batch_bound', slow.recommendation);
    assert.equal(analyzer.classify(trace(CASES.decode_latency_spike!)).category, 'decode_latency_spike');
  });

  it('names every part of the request in a balanced one\'s split, routing and the KV transfer included', () => {
    // 20 ms of routing, 10 ms of queue and 10 ms of prefill: none over its line (routing has none), so balanced.
    const routed = analyzer.classify(trace({ id: 'routed', routerMs: 20, queueMs: 10, chunks: [[10, 1024]], outputTokens: 2 }));
    assert.equal(routed.category, 'balanced', routed.recommendation);
    const total = routed.total_ms;
    assert.ok(routed.breakdown_ms.routing >= 20, JSON.stringify(routed.breakdown_ms));
    assert.match(routed.recommendation, new RegExp(`routing ${((routed.breakdown_ms.routing / total) * 100).toFixed(0)}%`));
    assert.doesNotMatch(routed.recommendation, /KV transfer/, 'no transfer, none named');
    // A transfer under its line (40% of TTFT) is named too.
    const moved = analyzer.classify(trace({ id: 'moved', queueMs: 10, chunks: [[10, 1024]], outputTokens: 2, kvTransfer: { ms: 8, bytes: 1 << 20, from: 'p0', to: 'd1' } }));
    assert.equal(moved.category, 'balanced', moved.recommendation);
    assert.match(moved.recommendation, /KV transfer \d+%/);
  });

  it('reports a decode spike even when TTFT is balanced, counting the spiking steps', () => {
    const d = analyzer.classify(trace({ id: 's2', queueMs: 10, chunks: [[10, 1024]], engineSteps: true, outputTokens: 3, stepMs: [1, 1, 1, 1, 40] }));
    assert.equal(d.category, 'decode_latency_spike');
    assert.match(d.recommendation, /1 of 5 steps over 2x the median and 25\.0 ms or more above it/);
    assert.ok(Math.abs(d.dominant_share - 40 / 44) < 1e-3);
  });

  it('does not call a steady decode a spike', () => {
    // Decode (93 ms) dominates the 23 ms TTFT, steadily: the time is the output's length.
    const d = analyzer.classify(trace({ id: 'steady', queueMs: 10, chunks: [[10, 1024]], engineSteps: true, stepMs: [10, 12, 11, 13, 10, 12, 25] }));
    assert.equal(d.category, 'decode_output_length', d.recommendation);
  });

  it('does not call a short stream\'s few-ms gap on a loaded machine a spike, but does a real stall of one', () => {
    // Six streamed tokens at about 1.5 ms, one gap of 5 ms (a scheduling delay): over 3x the median, a few ms long.
    const short = { promptTokens: 20, chunks: [[3, 20]] as [number, number][], queueMs: 0.3, outputTokens: 6 };
    for (const gap of [5, 12, 24]) {
      const noisy = analyzer.classify(trace({ id: `noisy-${gap}`, ...short, stepMs: [1.5, 1.4, gap, 1.6, 1.5] }));
      assert.notEqual(noisy.category, 'decode_latency_spike', `a ${gap} ms gap: ${noisy.recommendation}`);
      assert.equal(noisy.category, 'decode_output_length', noisy.recommendation);
    }
    // The same stream with a 40 ms stall: a spike the client saw.
    const stalled = analyzer.classify(trace({ id: 'stalled', ...short, stepMs: [1.5, 1.4, 40, 1.6, 1.5] }));
    assert.equal(stalled.category, 'decode_latency_spike', stalled.recommendation);
    assert.match(stalled.recommendation, /max 40\.0 ms against a median of 1\.5 ms, 1 of 5 steps/);
    // Even when decode does not dominate (40 ms in the queue and 40 ms of prefill before it, neither dominating TTFT).
    const late = analyzer.classify(trace({ id: 'stalled-late', ...short, queueMs: 40, chunks: [[40, 20]], stepMs: [1.5, 1.4, 40, 1.6, 1.5] }));
    assert.equal(late.category, 'decode_latency_spike', late.recommendation);
    // Slow steps keep the relative rule: 3x a 20 ms median is a spike at 61 ms, not at 59 ms.
    const slow = { engineSteps: true, queueMs: 1, chunks: [[5, 1024]] as [number, number][], outputTokens: 8 };
    assert.equal(analyzer.classify(trace({ id: 'slow-61', ...slow, stepMs: [20, 20, 20, 61, 20, 20, 20] })).category, 'decode_latency_spike');
    assert.notEqual(analyzer.classify(trace({ id: 'slow-59', ...slow, stepMs: [20, 20, 20, 59, 20, 20, 20] })).category, 'decode_latency_spike');
    // Noise gaps are not counted beside a real spike either.
    const mixed = analyzer.classify(trace({ id: 'mixed', ...short, outputTokens: 9, stepMs: [1.5, 4, 1.4, 300, 1.6, 5, 1.5, 1.5] }));
    assert.equal(mixed.category, 'decode_latency_spike', mixed.recommendation);
    assert.match(mixed.recommendation, /1 of 8 steps/);
  });

  it('does not suggest prefix caching for a prompt shorter than one KV block', () => {
    /** A prompt's timeline with the engine's KV block size reported (as the gateway reports it). */
    const withBlocks = (o: TimelineOptions, blockSize: number) => buildRequestTrace(requestTimeline(o).events.map((e) =>
      e.phase === 'finish' ? { ...e, engine: { ...(e.engine as EngineReport), blockSize } } : e));
    // A 9-token prompt, nothing cached, its prefill 94% of TTFT: the cache could not have held any of it.
    const tiny = analyzer.classify(withBlocks({ id: 'tiny', promptTokens: 9, chunks: [[40, 9]], queueMs: 0.5, outputTokens: 2 }, 16));
    assert.equal(tiny.category, 'prefill_compute_bound', tiny.recommendation);
    assert.equal(tiny.dominant_phase, 'prefill_execution');
    assert.match(tiny.recommendation, /9-token prompt, shorter than one 16-token KV block/);
    assert.doesNotMatch(tiny.recommendation, /Keep shared content|route by KV overlap|more blocks/);
    // One block's worth and more can be cached: no cache hit is then prefill_no_cache, as before.
    for (const promptTokens of [16, 17, 1024]) {
      const d = analyzer.classify(withBlocks({ id: `p${promptTokens}`, promptTokens, chunks: [[40, promptTokens]], queueMs: 0.5, outputTokens: 2 }, 16));
      assert.equal(d.category, 'prefill_no_cache', `${promptTokens} tokens: ${d.recommendation}`);
    }
    // With larger blocks, a 20-token prompt is the short one.
    assert.equal(analyzer.classify(withBlocks({ id: 'p20', promptTokens: 20, chunks: [[40, 20]], queueMs: 0.5, outputTokens: 2 }, 32)).category,
      'prefill_compute_bound');
  });
});

describe('TraceAnalyzer.analyze', () => {
  it('averages where the time goes and names the commonest bottleneck among slow requests', () => {
    const traces = [
      trace({ ...CASES.queue_saturation!, id: 'q1' }),
      trace({ ...CASES.queue_saturation!, id: 'q2', at: T0 + 1 }),
      trace({ ...CASES.prefill_no_cache!, at: T0 + 2 }),
      trace({ id: 'fast', at: T0 + 3, chunks: [[5, 1024]], stepMs: 10 }),
    ];
    const w = analyzer.analyze(traces);
    assert.equal(w.requests, 4);
    assert.equal(w.slow_requests, 3, 'the fast request is under both targets');
    assert.equal(w.categories.queue_saturation, 2);
    assert.equal(w.categories.prefill_no_cache, 1);
    assert.equal(w.primary_bottleneck, 'queue_saturation');
    assert.deepEqual(w.examples.queue_saturation, ['q1', 'q2']);
    const shares = Object.values(w.phase_share).reduce((a, b) => a + b, 0);
    assert.ok(Math.abs(shares - 1) < 0.01, `shares sum to ${shares}`);
    assert.ok(w.phase_share.queue > w.phase_share.routing);
  });

  it('counts slow long outputs under decode_output_length', () => {
    // TTFT over the 200 ms target, and 400 steady tokens after it: slow, and the time went to the output.
    const traces = [0, 1, 2].map((i) => trace({ id: `long-${i}`, at: T0 + i, queueMs: 250, chunks: [[20, 1024]], outputTokens: 400, stepMs: 2 }));
    traces.push(trace({ ...CASES.queue_saturation!, id: 'q1', at: T0 + 3 }));
    const w = analyzer.analyze(traces);
    assert.equal(w.slow_requests, 4);
    assert.equal(w.categories.decode_output_length, 3);
    assert.equal(w.primary_bottleneck, 'decode_output_length');
    assert.deepEqual(w.examples.decode_output_length, ['long-0', 'long-1', 'long-2']);
    assert.match(w.recommendation, /the length of the output/);
  });

  it('gives a request that did not complete no bottleneck, but how it ended', () => {
    // A response not streamed, its client gone mid-decode: decode is 99% of it, which is no bottleneck.
    const full = requestTimeline({ id: 'gone', stream: false, stepMs: 12.5, outputTokens: 40 });
    const abortAt = full.at.firstToken + 200;
    const aborted: LifecycleEvent[] = [
      ...full.events.filter((e) => e.phase !== 'finish'),
      {
        phase: 'abort', requestId: 'gone', time: abortAt, reason: 'client_disconnect', promptTokens: 1024, outputTokens: 16,
        engine: { ...full.engine, timestamps: { ...full.engine.timestamps, lastToken: full.at.firstToken + 187.5, finished: abortAt } },
      },
    ];
    const refused = (id: string, status: number, errorType: string, failing: 'validate' | 'http_receive'): LifecycleEvent[] => [
      { phase: 'http_receive', requestId: id, start: T0, time: T0 + 0.3, ...(failing === 'http_receive' ? { ok: false } : {}) },
      ...(failing === 'validate' ? [
        { phase: 'auth', requestId: id, start: T0 + 0.05, time: T0 + 0.06, ok: true, tenant: 'acme' },
        { phase: 'rate_limit', requestId: id, start: T0 + 0.06, time: T0 + 0.07, allowed: true, tenant: 'acme' },
        { phase: 'validate', requestId: id, start: T0 + 0.3, time: T0 + 0.4, ok: false },
      ] as LifecycleEvent[] : []),
      { phase: 'error', requestId: id, time: T0 + 0.5, errorType, status, message: `refused with ${status}` },
    ];
    const cases: [LifecycleEvent[], string, RegExp][] = [
      [aborted, 'aborted', /^aborted \(client_disconnect\) in decode_execution after 2\d\d ms\. /],
      [abortedInQueueTimeline('queued'), 'aborted', /^aborted \(client_disconnect\) in scheduler_queue after 40\.0 ms\. /],
      [erroredInPrefillTimeline('boom'), 'failed', /^failed: 500 engine_error in prefill_execution after 15\.0 ms: forward pass failed: out of memory\. /],
      [refused('bad', 400, 'invalid_value', 'validate'), 'failed', /^failed: 400 invalid_value in validate after 0\.5 ms: refused with 400\. /],
      [refused('big', 413, 'body_too_large', 'http_receive'), 'failed', /^failed: 413 body_too_large in http_receive after 0\.5 ms: refused with 413\. /],
      [rateLimitedTimeline('limited'), 'failed', /^failed: 429 rate_limited in rate_limit /],
    ];
    for (const [events, category, why] of cases) {
      const d = analyzer.classify(buildRequestTrace(events));
      assert.equal(d.category, category, `${d.request_id}: ${d.recommendation}`);
      assert.equal(d.dominant_phase, 'none');
      assert.equal(d.dominant_share, 0);
      assert.match(d.recommendation, why);
      assert.match(d.recommendation, /no bottleneck diagnosis/);
    }
    // Nor do they count in the window: neither among the slow requests (balanced or otherwise) nor in the shares.
    const w = analyzer.analyze([...cases.map(([events]) => buildRequestTrace(events)), trace({ ...CASES.queue_saturation!, id: 'q1' })]);
    assert.equal(w.requests, 1);
    assert.equal(w.slow_requests, 1);
    assert.equal(Object.values(w.categories).reduce((a, b) => a + b, 0), 1);
    assert.equal(w.categories.balanced, 0);
    assert.deepEqual(w.examples, { queue_saturation: ['q1'] });
  });

  it('says so when nothing in the window is slow', () => {
    const w = analyzer.analyze([trace({ id: 'ok', chunks: [[5, 1024]], stepMs: 10 })]);
    assert.equal(w.slow_requests, 0);
    assert.equal(w.primary_bottleneck, 'balanced');
    assert.match(w.recommendation, /No slow requests/);
  });
});
