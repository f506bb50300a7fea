// The trace analyzer names the gateway (http_receive .. tokenize) when it dominates TTFT, as it names the queue,
// prefill and the KV transfer, by the gateway phase that took longest.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { TraceAnalyzer } from '../../src/telemetry/analyzer.ts';
import { buildRequestTrace, type RequestTrace } from '../../src/telemetry/trace.ts';
import type { LifecycleEvent } from '../../src/telemetry/lifecycle.ts';
import { requestTimeline, type TimelineOptions } from './fixtures.ts';

const analyzer = new TraceAnalyzer();

/**
 * The fixture's request with `phase` (a gateway phase) made `extraMs` longer: it and the gateway phases before it
 * start that much earlier, so the request arrives earlier and everything after the gateway is as before.
 */
function slowGateway(phase: 'http_receive' | 'tokenize', extraMs: number, o: TimelineOptions = {}): RequestTrace {
  const order = ['http_receive', 'auth', 'rate_limit', 'validate', 'tokenize'];
  const events = requestTimeline(o).events.map((e): LifecycleEvent => {
    const at = order.indexOf(e.phase);
    if (at < 0 || !('start' in e) || e.start === undefined) return e;
    if (phase === 'tokenize') {
      // Every phase before tokenize moves back; tokenize keeps its end.
      return e.phase === 'tokenize' ? { ...e, start: e.start - extraMs } : { ...e, start: e.start - extraMs, time: e.time - extraMs };
    }
    // http_receive starts earlier (the body's upload); auth and rate_limit run inside it, at its start.
    return e.phase === 'http_receive' ? { ...e, start: e.start - extraMs }
      : e.phase === 'auth' || e.phase === 'rate_limit' ? { ...e, start: e.start - extraMs, time: e.time - extraMs } : e;
  });
  return buildRequestTrace(events);
}

describe('TraceAnalyzer: the gateway as the bottleneck', () => {
  it('names gateway_bound (tokenize) when tokenizing is 86% of TTFT', () => {
    const trace = slowGateway('tokenize', 240, { id: 'slow-tokenize' });
    const d = analyzer.classify(trace);
    assert.equal(d.category, 'gateway_bound', d.recommendation);
    assert.equal(d.dominant_phase, 'tokenize');
    assert.equal(d.dominant_share_of, 'ttft');
    assert.equal(d.dominant_ms, 240.4);
    assert.ok(Math.abs(d.dominant_share - 240.4 / d.ttft_ms!) < 1e-3, String(d.dominant_share));
    assert.ok(d.dominant_share > 0.85 && d.dominant_share < 0.9, String(d.dominant_share));
    assert.equal(d.breakdown_ms.gateway, 241);
    assert.match(d.recommendation, /^The gateway took 241 ms, 8\d% of the 2\d\d ms TTFT, 240 ms of it in tokenize: /);
    assert.match(d.recommendation, /1024-token prompt/);
    assert.doesNotMatch(d.recommendation, /No single phase dominates/);
  });

  it('names the upload (http_receive) when the body was slow to arrive, not the checks that ran inside it', () => {
    const d = analyzer.classify(slowGateway('http_receive', 300, { id: 'slow-upload' }));
    assert.equal(d.category, 'gateway_bound', d.recommendation);
    assert.equal(d.dominant_phase, 'http_receive');
    // http_receive's own 300.46 ms: the 0.04 ms of auth and rate_limit inside it are theirs.
    assert.ok(Math.abs(d.dominant_ms - 300.46) < 1e-3, String(d.dominant_ms));
    assert.match(d.recommendation, /in http_receive: receiving the request/);
  });

  it('leaves a gateway under the line to the other rules', () => {
    // 31 ms of gateway in a 69 ms TTFT (45%), prefill about half: nothing dominates.
    assert.equal(analyzer.classify(slowGateway('tokenize', 30, { id: 'even', outputTokens: 2 })).category, 'balanced');
    // A queue that dominates is still named, with a slower gateway before it.
    const queued = analyzer.classify(slowGateway('tokenize', 30, { id: 'queued', queueMs: 400 }));
    assert.equal(queued.category, 'queue_saturation', queued.recommendation);
  });

  it('makes gateway_bound the window\'s primary bottleneck when the slow requests are gateway-bound', () => {
    const w = analyzer.analyze([
      slowGateway('tokenize', 240, { id: 'g1' }), slowGateway('tokenize', 300, { id: 'g2', at: 2_000_000 }),
      requestTimeline({ id: 'fast', at: 3_000_000 }).events,
    ].map((x) => Array.isArray(x) ? buildRequestTrace(x) : x));
    assert.equal(w.slow_requests, 2);
    assert.equal(w.categories.gateway_bound, 2);
    assert.equal(w.primary_bottleneck, 'gateway_bound');
    assert.deepEqual(w.examples.gateway_bound, ['g1', 'g2']);
    assert.match(w.recommendation, /in tokenize/);
  });
});
