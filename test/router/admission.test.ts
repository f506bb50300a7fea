// Admission when every worker is busy: a bounded FIFO at the router, shedding past it with a Retry-After hint,
// draining when load drops, and expiry of requests that waited too long.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { AdmissionQueue, RetryAfterEstimator } from '../../src/router/admission.ts';
import type { RouteOutcome } from '../../src/router/protocols.ts';
import { load, makeRouter, request, tokens } from './fixtures.ts';

describe('AdmissionQueue', () => {
  it('is FIFO, bounded, removable, and expires the oldest first', () => {
    const queue = new AdmissionQueue<string>({ maxQueued: 3, maxWaitMs: 100 });
    assert.equal(queue.offer('a', 'A', 0), true);
    assert.equal(queue.offer('b', 'B', 10), true);
    assert.equal(queue.offer('c', 'C', 20), true);
    assert.equal(queue.offer('d', 'D', 30), false, 'full');
    assert.throws(() => new AdmissionQueue({ maxQueued: 1, maxWaitMs: 0 }), RangeError);
    assert.equal(queue.remove('b')?.item, 'B');
    assert.equal(queue.offer('d', 'D', 30), true);
    assert.deepEqual(queue.takeExpired(109).map((entry) => entry.id), ['a']);
    assert.deepEqual(queue.takeExpired(120).map((entry) => entry.id), ['c']);
    assert.equal(queue.shift()?.id, 'd');
    assert.equal(queue.size, 0);
  });
});

describe('RetryAfterEstimator', () => {
  it('divides the requests ahead by the finish rate, clamped', () => {
    const estimator = new RetryAfterEstimator({ minRetryAfterMs: 100, maxRetryAfterMs: 20_000, defaultRetryAfterMs: 3000 });
    assert.equal(estimator.retryAfterMs(10, 0), 3000, 'no finishes yet');
    for (let i = 0; i <= 10; i++) estimator.recordFinish(1000 + 50 * i); // one finish per 50 ms
    assert.equal(estimator.retryAfterMs(10, 1500), 500);
    assert.equal(estimator.retryAfterMs(1, 1500), 100, 'clamped to the minimum');
    assert.equal(estimator.retryAfterMs(1000, 1500), 20_000, 'clamped to the maximum');
    assert.equal(estimator.retryAfterMs(10, 1500 + 20_001), 3000, 'a stale rate is not trusted');
    const faster = new RetryAfterEstimator({ minRetryAfterMs: 1 });
    for (let i = 0; i <= 10; i++) faster.recordFinish(1000 + 5 * i);
    assert.ok(faster.retryAfterMs(10, 1050) < estimator.retryAfterMs(10, 1500), 'faster draining, sooner retry');
  });
});

describe('Router admission', () => {
  function allBusy(outcome: RouteOutcome): asserts outcome is Extract<RouteOutcome, { kind: 'queued' }> {
    assert.equal(outcome.kind, 'queued');
  }

  it('queues when every worker is busy, sheds past the bound, and drains in order when load drops', () => {
    const router = makeRouter({ maxQueued: 2, busyKvUsage: 0.9 }, ['a', 'b']);
    router.updateLoad('a', load({ kvUsage: 0.95 }));
    router.updateLoad('b', load({ kvUsage: 0.91 }));
    const first = request(tokens(1, 9));
    const second = request(tokens(2, 9));
    const outcome1 = router.route(first, 0);
    allBusy(outcome1);
    assert.equal(outcome1.numQueued, 1);
    allBusy(router.route(second, 1));
    const shed = router.route(request(tokens(3, 9)), 2);
    assert.equal(shed.kind, 'rejected');
    assert.ok(shed.kind === 'rejected' && shed.reason === 'overloaded' && shed.retryAfterMs >= 1000);

    assert.deepEqual(router.drainQueue(3), { routed: [], expired: [] }, 'still busy');
    router.updateLoad('b', load({ kvUsage: 0.5 }));
    const drained = router.drainQueue(4);
    assert.deepEqual(drained.routed.map(({ request: r, decision }) => [r.requestId, decision.workerId]),
      [[first.requestId, 'b'], [second.requestId, 'b']]);
    assert.deepEqual(router.stats().numQueued, 0);
    assert.deepEqual([router.stats().numEnqueued, router.stats().numRejected, router.stats().numRouted], [2, 1, 2]);
  });

  it('a queued request whose model\'s workers are busy or gone holds up only requests for that model', () => {
    const router = makeRouter({ maxQueueWaitMs: 30_000 }, []);
    router.addWorker('wa', load({ numWaiting: 100 }), ['a#1']);
    router.addWorker('wb', load({ numWaiting: 100 }), ['b#1']);
    allBusy(router.route(request(tokens(1, 9), { requestId: 'a1', model: 'a#1' }), 0));
    allBusy(router.route(request(tokens(2, 9), { requestId: 'a2', model: 'a#1' }), 0));
    allBusy(router.route(request(tokens(3, 9), { requestId: 'b1', model: 'b#1' }), 1));
    router.updateLoad('wb', load());
    assert.deepEqual(router.drainQueue(100).routed.map((r) => r.request.requestId), ['b1'], 'b1 goes past the a requests');
    assert.equal(router.stats().numQueued, 2);
    // The a worker leaves: its requests wait (and expire) without holding up others.
    router.removeWorker('wa');
    router.updateLoad('wb', load({ numWaiting: 100 }));
    allBusy(router.route(request(tokens(4, 9), { requestId: 'b2', model: 'b#1' }), 100));
    router.updateLoad('wb', load());
    assert.deepEqual(router.drainQueue(200).routed.map((r) => r.request.requestId), ['b2']);
    // Order is kept among one model's requests.
    router.addWorker('wa2', load(), ['a#1']);
    assert.deepEqual(router.drainQueue(300).routed.map((r) => r.request.requestId).slice(0, 1), ['a1']);
  });

  it('drains only while a worker stays free, counting what it sends', () => {
    const router = makeRouter({ busyNumWaiting: 2 }, ['a']);
    router.updateLoad('a', load({ numWaiting: 2 }));
    for (let i = 0; i < 5; i++) allBusy(router.route(request(tokens(10 + i, 9)), 0));
    router.updateLoad('a', load({ numWaiting: 0 }));
    // Two fit under the threshold; the router's own count then marks the worker busy again.
    assert.equal(router.drainQueue(1).routed.length, 2);
    assert.equal(router.stats().numQueued, 3);
    const [sent] = router.drainQueue(1).routed;
    assert.equal(sent, undefined);
    const active = router.stats().numActiveRequests;
    assert.equal(active, 2);
  });

  it('hands back requests that waited too long, and drops cancelled ones', () => {
    const router = makeRouter({ maxQueueWaitMs: 500 }, ['a']);
    router.updateLoad('a', load({ kvUsage: 1 }));
    const old = request(tokens(1, 9));
    const cancelled = request(tokens(2, 9));
    const young = request(tokens(3, 9));
    router.route(old, 0);
    router.route(cancelled, 100);
    router.route(young, 400);
    assert.equal(router.cancelQueued(cancelled.requestId), true);
    router.updateLoad('a', load());
    const result = router.drainQueue(500);
    assert.deepEqual(result.expired.map((r) => r.requestId), [old.requestId]);
    assert.deepEqual(result.routed.map(({ request: r }) => r.requestId), [young.requestId]);
    assert.equal(router.stats().numExpired, 1);
  });

  it('sheds immediately with a zero-length queue, with a hint that follows the finish rate', () => {
    const router = makeRouter({ maxQueued: 0, busyNumWaiting: 1, retryAfter: { minRetryAfterMs: 10 } }, ['a']);
    const ids: string[] = [];
    for (let i = 0; i < 12; i++) {
      const outcome = router.route(request(tokens(i, 9)), 10 * i);
      assert.equal(outcome.kind, 'routed');
      if (outcome.kind === 'routed') ids.push(outcome.decision.requestId);
      router.onFinished(ids.at(-1)!, 10 * i + 10); // one finish per 10 ms
    }
    router.updateLoad('a', load({ numWaiting: 1 }));
    const shed = router.route(request(tokens(99, 9)), 125);
    assert.deepEqual(shed.kind === 'rejected' && [shed.reason, shed.retryAfterMs], ['overloaded', 10]);
  });
});
