// The trace sampler's head and tail decisions, with seeded randomness and explicit times.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { ROOT_CONTEXT, SpanKind, TraceFlags, trace as otelTrace } from '@opentelemetry/api';
import {
  AlwaysOffSampler, AlwaysOnSampler, ParentBasedSampler, SamplingDecision, TraceIdRatioBasedSampler, type Sampler,
} from '@opentelemetry/sdk-trace-node';
import { RecentQuantile, TraceSampler, traceIdRatioSampled, type OtelSamplerSpec, type TailInput } from '../../src/telemetry/sampling.ts';
import { randomTraceId } from '../../src/telemetry/traceparent.ts';
import { T0, seededRandom } from './fixtures.ts';

function rateOf(sampler: TraceSampler, input: Parameters<TraceSampler['head']>[0], nowMs: number, n: number): number {
  let sampled = 0;
  for (let i = 0; i < n; i++) if (sampler.head(input, nowMs).sampled) sampled++;
  return sampled / n;
}

const ok = (ttftMs: number, e2eMs = ttftMs + 100): TailInput => ({ outcome: 'ok', ttftMs, e2eMs });

describe('TraceSampler.head', () => {
  it('samples at the base rate', () => {
    const sampler = new TraceSampler({ baseRate: 0.01 }, seededRandom(1));
    const rate = rateOf(sampler, { model: 'm', promptTokens: 100 }, T0, 40_000);
    assert.ok(Math.abs(rate - 0.01) < 0.002, `rate ${rate}`);
    assert.deepEqual(new TraceSampler({ baseRate: 0.5 }, () => 0.49).head({}, T0), { sampled: true, reason: 'base_rate' });
    assert.deepEqual(new TraceSampler({ baseRate: 0.5 }, () => 0.5).head({}, T0), { sampled: false, reason: 'not_sampled' });
  });

  it('always samples what the client sampled and requests predicted slow', () => {
    const sampler = new TraceSampler({ baseRate: 0 }, () => 0.99);
    assert.deepEqual(sampler.head({ parentSampled: true }, T0), { sampled: true, reason: 'parent' });
    assert.deepEqual(sampler.head({ parentSampled: false }, T0), { sampled: false, reason: 'not_sampled' });
    assert.deepEqual(sampler.head({ promptTokens: 8192 }, T0), { sampled: true, reason: 'predicted_slow' });
    assert.deepEqual(sampler.head({ promptTokens: 8191 }, T0), { sampled: false, reason: 'not_sampled' });
    assert.equal(new TraceSampler({ baseRate: 0, honourParentSampled: false }).head({ parentSampled: true }, T0).sampled, false);
  });

  it('samples a newly loaded model at the elevated rate until its window ends', () => {
    const sampler = new TraceSampler({ baseRate: 0.01, newModelRate: 0.1, newModelWindowMs: 3_600_000 }, seededRandom(2));
    sampler.registerNewModel('fresh', T0);
    const during = rateOf(sampler, { model: 'fresh' }, T0 + 1_000_000, 20_000);
    assert.ok(Math.abs(during - 0.1) < 0.01, `rate during the window ${during}`);
    assert.equal(sampler.head({ model: 'fresh' }, T0 + 1).reason === 'base_rate', false);
    const other = rateOf(sampler, { model: 'old' }, T0 + 1_000_000, 20_000);
    assert.ok(Math.abs(other - 0.01) < 0.003, `other models stay at the base rate: ${other}`);
    assert.equal(sampler.isNewModel('fresh', T0 + 3_600_000), false);
    const after = rateOf(sampler, { model: 'fresh' }, T0 + 3_600_001, 20_000);
    assert.ok(Math.abs(after - 0.01) < 0.003, `rate after the window ${after}`);
  });

  it('keeps the new-model table bounded, dropping the registration that ends first', () => {
    const sampler = new TraceSampler({ maxNewModels: 3 });
    sampler.registerNewModel('a', T0, 1000);
    sampler.registerNewModel('b', T0, 5000);
    sampler.registerNewModel('c', T0, 3000);
    sampler.registerNewModel('d', T0, 4000);
    assert.deepEqual(['a', 'b', 'c', 'd'].map((m) => sampler.isNewModel(m, T0 + 1)), [false, true, true, true]);
  });

  it('rejects rates outside [0, 1]', () => {
    assert.throws(() => new TraceSampler({ baseRate: 1.5 }), RangeError);
  });
});

describe('TraceSampler.tail', () => {
  it('keeps head-sampled, failed and slow requests and drops the rest', () => {
    const sampler = new TraceSampler({ slowTtftMs: 500, slowE2eMs: 20_000 });
    assert.deepEqual(sampler.tail({ ...ok(20), headSampling: { sampled: true, reason: 'base_rate' } }), { sampled: true, reason: 'head' });
    assert.deepEqual(sampler.tail({ outcome: 'error', e2eMs: 5 }), { sampled: true, reason: 'error' });
    assert.deepEqual(sampler.tail({ outcome: 'error', e2eMs: 5, status: 503 }), { sampled: true, reason: 'error' });
    assert.deepEqual(sampler.tail({ outcome: 'error', e2eMs: 5, status: 429 }), { sampled: false, reason: 'dropped' }, 'client refusals are not kept');
    assert.deepEqual(sampler.tail({ outcome: 'abort', e2eMs: 5 }), { sampled: false, reason: 'dropped' });
    assert.deepEqual(new TraceSampler({ keepAborts: true }).tail({ outcome: 'abort', e2eMs: 5 }), { sampled: true, reason: 'abort' });
    assert.deepEqual(sampler.tail(ok(500)), { sampled: true, reason: 'slow_ttft' });
    assert.deepEqual(sampler.tail(ok(20, 25_000)), { sampled: true, reason: 'slow_e2e' });
    // Slow only between tokens: a gap the client saw of the threshold or more.
    assert.deepEqual(sampler.tail({ ...ok(20), tbtMs: [12, 99.9, 30] }), { sampled: false, reason: 'dropped' });
    assert.deepEqual(sampler.tail({ ...ok(20), tbtMs: [12, 100, 30] }), { sampled: true, reason: 'slow_tbt' });
    assert.deepEqual(sampler.tail(ok(20)), { sampled: false, reason: 'dropped' });
  });

  it('keeps requests over the running p95 of TTFT once it has enough samples', () => {
    const sampler = new TraceSampler({ slowTtftMs: 1e9, quantileMinSamples: 50, quantileWindow: 100 });
    for (let i = 1; i <= 49; i++) assert.equal(sampler.tail(ok(i)).sampled, false, 'no quantile before 50 samples');
    assert.ok(Number.isNaN(sampler.runningTtftQuantile()));
    for (let i = 50; i <= 100; i++) sampler.tail(ok(i));
    // TTFTs 1..100 ms: p95 by interpolation is 95.05 ms; the sorted copy may lag by up to 16 values (p95 of 1..84
    // is 79.85 ms), so it lies between.
    const p95 = sampler.runningTtftQuantile();
    assert.ok(p95 >= 79.85 && p95 <= 95.05, `p95 ${p95}`);
    assert.deepEqual(sampler.tail(ok(99)), { sampled: true, reason: 'slow_quantile' });
    assert.deepEqual(sampler.tail(ok(60)), { sampled: false, reason: 'dropped' });
  });

  it('follows a shifting load: the quantile is over recent requests only', () => {
    const sampler = new TraceSampler({ slowTtftMs: 1e9, quantileMinSamples: 10, quantileWindow: 64 });
    for (let i = 0; i < 200; i++) sampler.tail(ok(10));
    assert.equal(sampler.tail(ok(30)).reason, 'slow_quantile');
    for (let i = 0; i < 200; i++) sampler.tail(ok(100));
    assert.equal(sampler.tail(ok(30)).sampled, false, 'after the load got slower, 30 ms is fast');
  });
});

describe('TraceSampler with a standard sampler (OTEL_TRACES_SAMPLER)', () => {
  /** The SDK's own sampler of the same name: the oracle. */
  function sdkSampler(spec: OtelSamplerSpec): Sampler {
    const root = spec.root === 'always_on' ? new AlwaysOnSampler() : spec.root === 'always_off' ? new AlwaysOffSampler()
      : new TraceIdRatioBasedSampler(spec.ratio);
    return spec.parentBased ? new ParentBasedSampler({ root }) : root;
  }
  const specs: OtelSamplerSpec[] = [
    { root: 'always_on', parentBased: false }, { root: 'always_off', parentBased: false },
    { root: 'always_on', parentBased: true }, { root: 'always_off', parentBased: true },
    { root: 'traceidratio', parentBased: false, ratio: 0.25 }, { root: 'traceidratio', parentBased: true, ratio: 0.25 },
    { root: 'traceidratio', parentBased: false, ratio: 0 }, { root: 'traceidratio', parentBased: false, ratio: 1 },
  ];

  it('samples at the head exactly as the SDK\'s sampler of that name, with and without the client\'s parent', () => {
    for (const spec of specs) {
      const ours = new TraceSampler({ otel: spec }, () => 0);
      const theirs = sdkSampler(spec);
      for (let i = 0; i < 400; i++) {
        const traceId = randomTraceId();
        for (const parentSampled of [undefined, true, false]) {
          const context = parentSampled === undefined ? ROOT_CONTEXT : otelTrace.setSpanContext(ROOT_CONTEXT, {
            traceId, spanId: '00f067aa0ba902b7', isRemote: true, traceFlags: parentSampled ? TraceFlags.SAMPLED : TraceFlags.NONE,
          });
          const expected = theirs.shouldSample(context, traceId, 'request', SpanKind.SERVER, {}, []).decision === SamplingDecision.RECORD_AND_SAMPLED;
          // A new model, a long prompt: the adaptive rules must not take part.
          const got = ours.head({ traceId, model: 'm', promptTokens: 100_000, ...(parentSampled !== undefined ? { parentSampled } : {}) }, T0);
          assert.equal(got.sampled, expected, `${JSON.stringify(spec)}, parent ${String(parentSampled)}, trace ${traceId}`);
        }
      }
    }
    assert.equal(traceIdRatioSampled(undefined, 1), false, 'no trace id, nothing to sample on');
    assert.equal(traceIdRatioSampled('0'.repeat(32), 1), false, 'the invalid trace id, as the SDK');
  });

  it('keeps at the tail exactly what the head sampled: no new-model, slow, error or quantile rules', () => {
    const sampler = new TraceSampler({ otel: { root: 'always_off', parentBased: false }, slowTtftMs: 500, quantileMinSamples: 1 });
    sampler.registerNewModel('fresh', T0);
    const head = sampler.head({ model: 'fresh', promptTokens: 100_000, parentSampled: true, traceId: randomTraceId() }, T0 + 1);
    assert.deepEqual(head, { sampled: false, reason: 'not_sampled' });
    for (let i = 0; i < 5; i++) sampler.tail({ ...ok(10), headSampling: head });
    for (const input of [ok(10_000, 100_000), { ...ok(20), tbtMs: [1000] }, { outcome: 'error', e2eMs: 5, status: 500 }] as TailInput[]) {
      assert.deepEqual(sampler.tail({ ...input, headSampling: head }), { sampled: false, reason: 'dropped' });
    }
    const on = new TraceSampler({ otel: { root: 'always_on', parentBased: false } });
    assert.deepEqual(on.tail({ ...ok(10), headSampling: on.head({}, T0) }), { sampled: true, reason: 'head' });
  });
});

describe('RecentQuantile', () => {
  it('holds only the last `capacity` values', () => {
    const q = new RecentQuantile(10, 1);
    for (let i = 1; i <= 20; i++) q.add(i);
    assert.equal(q.size, 10);
    assert.equal(q.quantile(0), 11);
    assert.equal(q.quantile(1), 20);
    assert.equal(q.quantile(0.5), 15, 'nearest rank: a value that was seen');
  });
});
