// The synchronous cluster driver: event-by-event virtual time, routing, continuous batching across arrivals,
// determinism, and the summary statistics. Step times are the toy deployment's (sim-fixtures.ts), worked by hand.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { hashTokenBlocks } from '../../src/protocols/block-hash.ts';
import type { BlockHash } from '../../src/protocols/kv-events.ts';
import type { EngineRequest } from '../../src/engine/types.ts';
import { SimCluster, leastLoaded, roundRobin, summarizeRequests, type RouteFunction } from '../../src/sim/cluster.ts';
import { distribution, percentile } from '../../src/util/stats.ts';
import { poissonArrivalTimesMs, poissonWorkload } from '../../src/sim/workload.ts';
import { close, prompt, req, toyDecodeMs, toyPrefillMs, toyWorker } from './sim-fixtures.ts';

const cluster = (workers: number, route: RouteFunction = leastLoaded, extra = {}) =>
  new SimCluster({ workers: Array.from({ length: workers }, () => ({ ...toyWorker, ...extra })), route });

test('one request on one worker: TTFT is the prefill step, ITL the decode steps, e2e their sum', () => {
  const { requests } = cluster(1).run([req('a', prompt(64), 100, { maxTokens: 3 })]);
  const a = requests[0]!;
  assert.equal(a.workerIndex, 0);
  close(a.ttftMs!, 44.82896); // toyPrefillMs(64, 0): 44,328,960 FLOPs at 1 GFLOP/s + 0.5 ms
  close(a.firstTokenMs!, 144.82896);
  assert.equal(a.itlMs.length, 2);
  close(a.itlMs[0]!, 1.47792); // decode after 64 tokens: 977,920 FLOPs + 0.5 ms
  close(a.itlMs[1]!, 1.478944); // after 65: 978,944 FLOPs
  close(a.e2eMs!, 44.82896 + 1.47792 + 1.478944);
  assert.equal(a.tokenTimesMs.length, 3);
  [144.82896, 144.82896 + 1.47792, 144.82896 + 1.47792 + 1.478944].forEach((t, i) => close(a.tokenTimesMs[i]!, t));
  assert.equal(a.completionTokens, 3);
  assert.equal(a.finishReason, 'length');
});

test('two simultaneous requests on one worker with a 64-token budget: the second is chunked around the first', () => {
  const c = new SimCluster({ workers: [{ ...toyWorker, maxNumBatchedTokens: 64 }], route: leastLoaded });
  const { requests } = c.run([req('a', prompt(64, 1), 0, { maxTokens: 2 }), req('b', prompt(64, 2), 0, { maxTokens: 1 })]);
  const [a, b] = requests;
  close(a!.ttftMs!, 44.82896);
  // Step 2: a's decode after 64 tokens takes 1 token of the budget, b gets the other 63 (no logits): 64 tokens
  // through the layers, 1 row sampled, keys 65 + 63 x 64 / 2 = 2,081: 44,329,984 FLOPs + 0.5 = 44.829984 ms.
  close(a!.itlMs[0]!, 44.829984);
  // Step 3: b's last prompt token after 63: 655,360 + 256,000 + 1,024 x 64 FLOPs + 0.5 = 1.476896 ms.
  close(b!.ttftMs!, 44.82896 + 44.829984 + 1.476896);
});

test('least-loaded routing spreads simultaneous requests; round-robin ignores load', () => {
  const spread = cluster(2).run([req('a', prompt(64, 1)), req('b', prompt(64, 2))]).requests;
  assert.deepEqual(spread.map((r) => r.workerIndex), [0, 1]);
  for (const r of spread) close(r.ttftMs!, toyPrefillMs(64, 0));

  // a is still running on worker 0 when c arrives; least-loaded picks the idle worker 1, round-robin worker 0.
  const arrivals = () => [req('a', prompt(64, 1), 0, { maxTokens: 50 }), req('b', prompt(8, 2), 0, { maxTokens: 1 }),
    req('c', prompt(8, 3), 60, { maxTokens: 1 })];
  assert.deepEqual(cluster(2).run(arrivals()).requests.map((r) => r.workerIndex), [0, 1, 1]);
  assert.deepEqual(cluster(2, roundRobin()).run(arrivals()).requests.map((r) => r.workerIndex), [0, 1, 0]);
});

test('the same arrivals and routing give identical results', () => {
  const run = () => {
    const arrivals = poissonWorkload({ ratePerSec: 40, numRequests: 60, inputTokens: 48, outputTokens: 8, vocabSize: 1000, seed: 7, sharedPrefixTokens: 32 });
    return cluster(3).run(arrivals);
  };
  const first = run();
  assert.deepEqual(run(), first);
  assert.equal(first.requests.length, 60);
  assert.ok(first.requests.every((r) => r.finishReason === 'length' && r.completionTokens === 8));
  // Every request after the first on each worker finds the shared 32-token prefix (two whole blocks).
  assert.ok(first.requests.filter((r) => r.cachedTokens === 32).length >= 60 - 3);
});

test('a held request is dispatched later; KV events arrive tagged with their worker', () => {
  const held: EngineRequest[] = [];
  const stored = new Map<number, BlockHash[]>();
  const c = new SimCluster({
    workers: [{ ...toyWorker, enableKvEvents: true }, { ...toyWorker, enableKvEvents: true }],
    route: (request) => (request.id === 'late' ? (held.push(request), null) : 0),
    onOutput: (_worker, output) => {
      // When 'first' finishes, the held request goes to worker 1.
      if (output.requestId === 'first' && output.finishReason) c.dispatch(1, held.shift()!);
    },
    onKvEvents: (worker, events) => {
      for (const ev of events) if (ev.type === 'stored') stored.set(worker, [...(stored.get(worker) ?? []), ...ev.blockHashes]);
    },
  });
  const { requests } = c.run([req('first', prompt(32, 1), 0, { maxTokens: 1 }), req('late', prompt(16, 2), 0, { maxTokens: 1 })]);
  const late = requests.find((r) => r.id === 'late')!;
  assert.equal(late.workerIndex, 1);
  close(late.dispatchMs!, toyPrefillMs(32, 0));
  close(late.ttftMs!, toyPrefillMs(32, 0) + toyPrefillMs(16, 0));
  assert.deepEqual(stored.get(0), hashTokenBlocks(prompt(32, 1), 16));
  assert.deepEqual(stored.get(1), hashTokenBlocks(prompt(16, 2), 16));
});

test('runUntil stops the clock where asked; abort frees the worker', () => {
  const c = cluster(1);
  c.submit(req('long', prompt(64), 0, { maxTokens: 1000 }));
  c.runUntil(50);
  assert.equal(c.nowMs, 50);
  // Four steps done (64 prompt tokens and 3 decodes computed), the fifth in flight holds slots for 68: 5 blocks.
  assert.equal(c.workers[0]!.stats().kvBlocksUsed, 5);
  c.abort('long');
  c.runToCompletion();
  const { requests, workers } = c.result();
  assert.equal(requests[0]!.finishReason, 'abort');
  assert.equal(workers[0]!.stats.kvBlocksUsed, 0);
  assert.equal(requests[0]!.finishMs, 50);
  // Steps end at 44.82896 (prefill), then + 1.47792, 1.478944, 1.479968 (decodes after 64, 65, 66 tokens) =
  // 49.265792; the fifth, in flight at 50 ms, still runs to its end (its row is ignored): 5 steps.
  close(toyPrefillMs(64, 0) + toyDecodeMs(64) + toyDecodeMs(65) + toyDecodeMs(66), 49.265792);
  assert.equal(workers[0]!.steps, 5);
  assert.equal(requests[0]!.completionTokens, 4);
});

test('percentiles are nearest-rank; summaries leave the warm-up out', () => {
  const values = Array.from({ length: 100 }, (_, i) => 100 - i); // 100 .. 1
  const d = distribution(values);
  assert.deepEqual([d.p50, d.p90, d.p99, d.max, d.count], [50, 90, 99, 100, 100]);
  assert.equal(d.mean, 50.5);
  assert.equal(percentile([7], 0.99), 7);
  assert.ok(Number.isNaN(percentile([], 0.5)));
  const mk = (id: string, arrivalMs: number, ttftMs: number) => ({
    id, workerIndex: 0, arrivalMs, firstTokenMs: arrivalMs + ttftMs, finishMs: arrivalMs + ttftMs + 10, ttftMs, e2eMs: ttftMs + 10,
    itlMs: [10], tokenTimesMs: [arrivalMs + ttftMs, arrivalMs + ttftMs + 10], promptTokens: 10, cachedTokens: 5, completionTokens: 2,
  });
  const s = summarizeRequests([mk('b', 10, 3), mk('a', 0, 1000), mk('c', 20, 5), mk('d', 30, 4)], 0.25);
  assert.equal(s.numRequests, 3); // 'a' arrived first and is the 25% warm-up
  assert.equal(s.ttftMs.max, 5);
  assert.equal(s.prefixHitRate, 0.5);
  // From the first measured finish (b's, at 23) to the last arrival (30) is 7 ms, shorter than the measured
  // requests' median latency (14 ms): no steady state to measure.
  assert.ok(Number.isNaN(s.outputTokensPerSec));
});

test('output tokens per second: every request\'s tokens from the first measured finish to the last arrival', () => {
  // Six requests 10 ms apart, three tokens each 5 ms apart (the last at +15, the finish); the first, the warm-up,
  // emits six tokens (5 .. 30) instead.
  const mk = (arrivalMs: number, tokens: number) => {
    const tokenTimesMs = Array.from({ length: tokens }, (_, i) => arrivalMs + 5 * (i + 1));
    return {
      id: `r${arrivalMs}`, workerIndex: 0, arrivalMs, firstTokenMs: arrivalMs + 5, finishMs: tokenTimesMs.at(-1)!, ttftMs: 5,
      e2eMs: 5 * tokens, itlMs: Array.from({ length: tokens - 1 }, () => 5), tokenTimesMs, promptTokens: 8, cachedTokens: 0,
      completionTokens: tokens,
    };
  };
  const s = summarizeRequests([mk(0, 6), mk(10, 3), mk(20, 3), mk(30, 3), mk(40, 3), mk(50, 3)], 1 / 6);
  assert.equal(s.numRequests, 5);
  // The window (25, 50]: the first measured finish is r10's at 25, the last arrival r50's at 50, and 25 ms is no
  // shorter than the 15 ms latency. In it: r0's token at 30, r20's at 30 and 35, r30's at 35, 40 and 45, r40's at 45
  // and 50; none of r10's (25 is the window's open end) or r50's (55 on). 1 + 2 + 3 + 2 = 8 tokens in 25 ms.
  close(s.outputTokensPerSec, 8 / 25 * 1000);
});

test('Poisson arrivals: seeded, mean gap 1 / rate, and a higher rate compresses the same draws', () => {
  const slow = poissonArrivalTimesMs(10, 4000, 3);
  assert.deepEqual(poissonArrivalTimesMs(10, 4000, 3), slow);
  const meanGapMs = slow[slow.length - 1]! / slow.length;
  assert.ok(Math.abs(meanGapMs - 100) < 5, `mean gap ${meanGapMs} ms`); // 100 ms +- 3.2 standard errors
  const fast = poissonArrivalTimesMs(20, 4000, 3);
  for (let i = 0; i < fast.length; i++) close(fast[i]!, slow[i]! / 2);
});
