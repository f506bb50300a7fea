// The SLO tracker: two tiers per objective, a sliding window per model, per-model objectives, bounded memory, and
// percentiles within the stated relative accuracy.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { SloTracker } from '../../src/telemetry/slo.ts';
import { percentile, percentileOf } from '../../src/util/stats.ts';
import { buildRequestTrace } from '../../src/telemetry/trace.ts';
import { T0, coldTimeline, rateLimitedTimeline, seededRandom } from './fixtures.ts';

function within(actual: number | null, expected: number, relative = 0.0101): void {
  assert.ok(actual !== null && Math.abs(actual - expected) <= Math.abs(expected) * relative, `expected ${expected} within ${relative * 100}%, got ${actual}`);
}

/** n requests of one model ending 1 ms apart from `at`, with the given TTFTs and no errors. */
function recordTtfts(tracker: SloTracker, ttfts: readonly number[], at = T0, model = 'm'): void {
  ttfts.forEach((ttftMs, i) => tracker.record({ model, atMs: at + i, ttftMs, tbtMs: [], serverError: false }));
}

describe('SloTracker', () => {
  it('p99 is the nearest rank ceil(0.99 n): two slow samples among 167 show, as in `conduit bench` and the simulator', () => {
    const tracker = new SloTracker();
    const ttfts = [...Array.from({ length: 165 }, (_, i) => 40 + (i % 20)), 391, 981];
    recordTtfts(tracker, ttfts);
    const m = tracker.report(T0 + 1000).models[0]!;
    assert.equal(m.ttft.samples, 167);
    // ceil(0.99 * 167) = 166: the 166th smallest is 391 (rank round(0.99 * 166) = 164, 0-based, hid both).
    within(m.ttft.p99_ms, 391);
    assert.equal(percentile(Float64Array.from(ttfts).sort(), 0.99), 391);
    assert.equal(m.ttft.target_met, false, 'the tail breaks the 200 ms target');
  });

  it('meets the TTFT target when p99 is under 200 ms', () => {
    const tracker = new SloTracker();
    recordTtfts(tracker, Array.from({ length: 100 }, () => 100));
    const m = tracker.report(T0 + 1000).models[0]!;
    within(m.ttft.p99_ms, 100);
    assert.equal(m.ttft.status, 'ok');
    assert.equal(m.ttft.target_met, true);
    assert.equal(m.ttft.samples, 100);
  });

  it('warns between target and warning level, and is violated past the warning level', () => {
    const warn = new SloTracker();
    recordTtfts(warn, [...Array.from({ length: 98 }, () => 100), 300, 300]);
    const w = warn.report(T0 + 1000).models[0]!.ttft;
    within(w.p99_ms, 300);
    assert.deepEqual([w.target_met, w.warning_met, w.status], [false, true, 'warning']);

    const bad = new SloTracker();
    recordTtfts(bad, [...Array.from({ length: 97 }, () => 100), 900, 900, 900]);
    const b = bad.report(T0 + 1000);
    assert.deepEqual([b.models[0]!.ttft.warning_met, b.models[0]!.ttft.status, b.status], [false, 'violated', 'violated']);
  });

  it('takes TBT from every gap of every request', () => {
    const tracker = new SloTracker();
    tracker.recordTrace(buildRequestTrace(coldTimeline({ stepMs: [20, 20, 20, 20, 20, 20, 80] }).events));
    const tbt = tracker.report(T0 + 1000).models[0]!.tbt;
    assert.equal(tbt.samples, 7);
    within(tbt.p50_ms, 20);
    within(tbt.p99_ms, 80);
    assert.equal(tbt.status, 'warning');
  });

  it('counts server errors against the error rate and leaves client refusals out of it', () => {
    const tracker = new SloTracker();
    for (let i = 0; i < 999; i++) tracker.record({ model: 'm', atMs: T0 + i, serverError: false });
    tracker.record({ model: 'm', atMs: T0 + 999, serverError: true });
    for (let i = 0; i < 50; i++) tracker.recordTrace(buildRequestTrace(rateLimitedTimeline(`r${i}`, T0 + i)));
    const m = tracker.report(T0 + 2000).models.find((x) => x.model === 'm')!;
    assert.equal(m.error_rate.requests, 1000);
    assert.equal(m.error_rate.errors, 1);
    assert.equal(m.error_rate.rate, 0.001);
    assert.deepEqual([m.error_rate.target_met, m.error_rate.warning_met, m.error_rate.status], [false, true, 'warning']);
    const refused = tracker.report(T0 + 2000).models.find((x) => x.model === 'unknown')!;
    assert.equal(refused.error_rate.requests, 0, '429s are not in the denominator');
    assert.equal(refused.error_rate.status, 'no_data');
  });

  it('slides: old slots leave the window, and a model with nothing left in it leaves the report', () => {
    const tracker = new SloTracker({ windowMs: 60_000, slotMs: 10_000 });
    recordTtfts(tracker, Array.from({ length: 10 }, () => 900), T0);
    recordTtfts(tracker, Array.from({ length: 10 }, () => 100), T0 + 45_000);
    assert.equal(tracker.report(T0 + 50_000).models[0]!.ttft.samples, 20);
    const later = tracker.report(T0 + 75_000).models[0]!.ttft;
    assert.equal(later.samples, 10);
    within(later.p99_ms, 100);
    assert.equal(later.status, 'ok');
    assert.deepEqual(tracker.report(T0 + 200_000).models, []);
  });

  it('applies per-model objectives', () => {
    const tracker = new SloTracker({ perModel: { small: { ttft: { targetMs: 50, warningMs: 80 } } } });
    recordTtfts(tracker, Array.from({ length: 10 }, () => 100), T0, 'small');
    recordTtfts(tracker, Array.from({ length: 10 }, () => 100), T0, 'large');
    const report = tracker.report(T0 + 1000);
    assert.deepEqual(report.models.map((m) => [m.model, m.ttft.target_ms, m.ttft.status]), [['large', 200, 'ok'], ['small', 50, 'violated']]);
  });

  it('keeps a bounded number of models, dropping the least recently seen', () => {
    const tracker = new SloTracker({ maxModels: 2 });
    recordTtfts(tracker, [10], T0, 'a');
    recordTtfts(tracker, [10], T0 + 1, 'b');
    recordTtfts(tracker, [10], T0 + 2, 'a');
    recordTtfts(tracker, [10], T0 + 3, 'c');
    assert.deepEqual(tracker.report(T0 + 10).models.map((m) => m.model), ['a', 'c']);
  });

  it('reports percentiles within 1% of the exact ones over a spread of latencies', () => {
    const random = seededRandom(7);
    // Log-normal-ish latencies from 1 ms to a few seconds.
    const values = Array.from({ length: 5000 }, () => Math.exp(random() * 8));
    const tracker = new SloTracker();
    recordTtfts(tracker, values);
    const m = tracker.report(T0 + 6000).models[0]!;
    // The tracker takes the sample at rank round(q (n - 1)); compare with the same rank of the sorted values.
    const sorted = [...values].sort((a, b) => a - b);
    within(m.ttft.p99_ms, sorted[Math.round(0.99 * (values.length - 1))]!);
    within(m.ttft.p50_ms, sorted[Math.round(0.5 * (values.length - 1))]!);
    assert.ok(Math.abs(m.ttft.p50_ms! - percentileOf(values, 0.5)) / percentileOf(values, 0.5) < 0.02);
  });
});
