// The console's waterfall layout (assets/console/waterfall-layout.js, the module the page runs): bars on a time
// axis that tile the request as its phases do, no two bars of a row overlapping, on traces made by hand and on a
// real trace built from lifecycle events.

import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import {
  layoutWaterfall, timeTicks, type WaterfallLayout, type WaterfallPhase, type WaterfallView,
} from '../../assets/console/waterfall-layout.js';
import { buildRequestTrace, traceView } from '../../src/telemetry/index.ts';
import { requestTimeline } from '../telemetry/fixtures.ts';

const GEOMETRY = { width: 1000, labelWidth: 200, rowHeight: 20, top: 20, rightPad: 0 };

function phase(name: string, start: number, duration: number, attributes?: WaterfallPhase['attributes']): WaterfallPhase {
  return { phase: name, start_ms: start, duration_ms: duration, ...(attributes ? { attributes } : {}) };
}

/** A request whose phases follow one another with no gap: 0 .. 100 ms. */
function tiledView(): WaterfallView {
  return {
    total_ms: 100,
    phases: [
      phase('http_receive', 0, 2), phase('tokenize', 2, 3), phase('router_lookup', 5, 1), phase('scheduler_queue', 6, 10),
      phase('prefill_execution', 16, 8, { chunk: 0, tokens: 64, batch_size: 3 }), phase('scheduler_queue', 24, 4),
      phase('prefill_execution', 28, 6, { chunk: 1, tokens: 32, batch_size: 2 }), phase('decode_execution', 34, 66, { steps: 10 }),
    ],
    timings: { ttft_ms: 34 },
    token_times_ms: [34, 40, 46, 52, 58, 64, 70, 76, 82, 88, 100],
  };
}

const allBars = (layout: WaterfallLayout) => layout.rows.flatMap((r) => r.bars.map((b) => ({ ...b, row: r.key })));

/** The union of [x, x + w) intervals, as sorted disjoint pieces. */
function union(intervals: { x: number; w: number }[]): [number, number][] {
  const sorted = intervals.map((b) => [b.x, b.x + b.w] as [number, number]).sort((a, b) => a[0] - b[0]);
  const out: [number, number][] = [];
  for (const [a, b] of sorted) {
    const last = out[out.length - 1];
    if (last && a <= last[1] + 1e-9) last[1] = Math.max(last[1], b);
    else out.push([a, b]);
  }
  return out;
}

function assertNoOverlapWithinRows(layout: WaterfallLayout): void {
  for (const row of layout.rows) {
    const bars = [...row.bars].sort((a, b) => a.x - b.x);
    for (let i = 1; i < bars.length; i++) {
      assert.ok(bars[i]!.x >= bars[i - 1]!.x + bars[i - 1]!.w - 1e-9, `${row.key}: bar ${i} overlaps the one before`);
    }
  }
}

describe('console waterfall layout', () => {
  it('tiles the request: the bars cover the axis from arrival to the end, with no gap and nothing outside', () => {
    const layout = layoutWaterfall(tiledView(), GEOMETRY);
    assert.equal(layout.totalMs, 100);
    assert.equal(layout.plotX0, 200);
    assert.equal(layout.plotX1, 1000);
    const covered = union(allBars(layout));
    assert.equal(covered.length, 1, 'one piece: the phases leave no gap');
    assert.ok(Math.abs(covered[0]![0] - 200) < 1e-9 && Math.abs(covered[0]![1] - 1000) < 1e-9, `covers ${covered[0]}`);
    // Each bar is its phase scaled: 8 px per ms.
    for (const bar of allBars(layout)) {
      assert.ok(Math.abs(bar.x - (200 + bar.startMs * 8)) < 1e-9);
      assert.ok(Math.abs(bar.w - (bar.endMs - bar.startMs) * 8) < 1e-9);
    }
    // Widths add up to the axis: no two bars overlap anywhere, as no two phases do.
    const sum = allBars(layout).reduce((s, b) => s + b.w, 0);
    assert.ok(Math.abs(sum - 800) < 1e-9, `bar widths sum to ${sum}`);
  });

  it('puts repeated phases that follow one another in one row, in order, and names the chunks', () => {
    const layout = layoutWaterfall(tiledView(), GEOMETRY);
    assert.deepEqual(layout.rows.map((r) => r.key),
      ['http_receive', 'tokenize', 'router_lookup', 'scheduler_queue', 'prefill_execution', 'decode_execution']);
    const prefill = layout.rows.find((r) => r.phase === 'prefill_execution')!;
    assert.equal(prefill.label, 'prefill_execution x2');
    assert.equal(prefill.bars.length, 2);
    assert.ok(prefill.bars[0]!.detail.includes('batch: 3 sequences'));
    assert.ok(prefill.bars[1]!.detail.includes('32 prompt tokens computed'));
    assertNoOverlapWithinRows(layout);
    // Rows stack downwards, one row height apart.
    layout.rows.forEach((row, i) => assert.equal(row.y, 20 + i * 20));
    assert.equal(layout.height, 20 + layout.rows.length * 20 + 8);
  });

  it('gives overlapping intervals of one phase rows of their own, and keeps them where they are', () => {
    const view: WaterfallView = {
      total_ms: 50,
      phases: [phase('prefill_execution', 0, 30), phase('prefill_execution', 10, 30), phase('prefill_execution', 30, 10)],
    };
    const layout = layoutWaterfall(view, GEOMETRY);
    assert.deepEqual(layout.rows.map((r) => r.key), ['prefill_execution', 'prefill_execution#1']);
    assert.deepEqual(layout.rows.map((r) => r.bars.length), [2, 1], 'the chunk after the first fits back in its row');
    assertNoOverlapWithinRows(layout);
  });

  it('marks the first token and each token write on the decode row, and a migration at the token it followed', () => {
    const view = { ...tiledView(), migrations: [{ from_worker: 'worker-0', to_worker: 'worker-1', after_tokens: 4, reason: 'worker-lost' }] };
    const layout = layoutWaterfall(view, GEOMETRY);
    const decode = layout.rows.find((r) => r.phase === 'decode_execution')!;
    assert.equal(layout.tokens.length, 11);
    assert.ok(layout.tokens.every((t) => t.y === decode.y));
    assert.deepEqual(layout.tokens.map((t) => t.x), view.token_times_ms!.map((ms) => 200 + ms * 8));
    const first = layout.marks.find((m) => m.kind === 'first_token')!;
    assert.equal(first.x, 200 + 34 * 8);
    const migration = layout.marks.find((m) => m.kind === 'migration')!;
    assert.equal(migration.ms, 52);
    assert.match(migration.label, /worker-0 -> worker-1 after 4 tokens/);
  });

  it('lays out a real trace (built from lifecycle events) inside the axis, bars of a row apart', () => {
    const trace = buildRequestTrace(requestTimeline({ kvTransfer: { ms: 3, bytes: 1 << 20, from: 'prefill-0', to: 'decode-0' } }).events);
    const view = { ...traceView(trace), total_ms: trace.e2eMs };
    const layout = layoutWaterfall(view, GEOMETRY);
    assert.ok(layout.rows.length >= 5, `rows: ${layout.rows.map((r) => r.key).join(', ')}`);
    for (const bar of allBars(layout)) {
      assert.ok(bar.x >= 200 - 1e-9 && bar.x + bar.w <= 1000 + 1e-9, `${bar.phase} inside the axis`);
      assert.ok(bar.w >= 0);
    }
    assertNoOverlapWithinRows(layout);
    // Every phase of the trace is drawn, once.
    assert.equal(allBars(layout).length, view.phases.length);
    const kv = layout.rows.find((r) => r.phase === 'kv_transfer')!;
    assert.equal(kv.label, 'kv_transfer 1.0 MiB');
    assert.ok(kv.bars[0]!.detail.some((line) => line.startsWith('1.0 MiB')), kv.bars[0]!.detail.join(' | '));
  });

  it('ticks the axis at round steps from 0 to the end', () => {
    assert.deepEqual(timeTicks(100), [0, 20, 40, 60, 80, 100]);
    assert.deepEqual(timeTicks(7), [0, 2, 4, 6]);
    assert.deepEqual(timeTicks(0), [0]);
  });
});
