// Each policy's distribution, session affinity and the load guard that every policy goes through.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { POLICY_NAMES } from '../../src/router/protocols.ts';
import type { PolicyName, RouteOutcome, RoutingDecision } from '../../src/router/protocols.ts';
import type { Router } from '../../src/router/router.ts';
import { assertBinomial, hashes, histogram, load, makeRouter, request, stored, tokens } from './fixtures.ts';

function workerOf(outcome: RouteOutcome): string {
  assert.equal(outcome.kind, 'routed', `expected a decision, got ${JSON.stringify(outcome)}`);
  return (outcome as { decision: RoutingDecision }).decision.workerId;
}

function decisionOf(outcome: RouteOutcome): RoutingDecision {
  assert.equal(outcome.kind, 'routed');
  return (outcome as { decision: RoutingDecision }).decision;
}

/** Routes n fresh prompts; dry runs leave the router's state as it was. */
function routeMany(router: Router, n: number, options: { commit?: boolean } = {}): string[] {
  return Array.from({ length: n }, (_, i) => workerOf(router.route(request(tokens(1000 + i, 9)), 0, options)));
}

describe('routing policies', () => {
  it('round-robin cycles in registration order, skipping busy workers, across removals', () => {
    const router = makeRouter({ policy: 'round-robin' });
    assert.deepEqual(routeMany(router, 9), ['w0', 'w1', 'w2', 'w3', 'w0', 'w1', 'w2', 'w3', 'w0']);
    router.updateLoad('w2', load({ kvUsage: 0.99 }));
    assert.deepEqual(routeMany(router, 4), ['w1', 'w3', 'w0', 'w1']);
    router.updateLoad('w2', load());
    router.removeWorker('w3');
    assert.deepEqual(routeMany(router, 4), ['w2', 'w0', 'w1', 'w2']);
    assert.equal(decisionOf(router.route(request(tokens(1, 9)), 0)).strategy, 'round-robin');
    // Removing a worker the cycle already passed keeps the turn where it was.
    const cycle = makeRouter({ policy: 'round-robin' });
    assert.deepEqual(routeMany(cycle, 3), ['w0', 'w1', 'w2']);
    cycle.removeWorker('w0');
    assert.deepEqual(routeMany(cycle, 4), ['w3', 'w1', 'w2', 'w3']);
  });

  it('round-robin takes turns among the workers serving the request\'s model (LoRA adapters), through the queue too', () => {
    const router = makeRouter({ policy: 'round-robin' }, []);
    router.addWorker('a', load(), []);
    router.addWorker('b', load(), ['sql#1']);
    router.addWorker('c', load(), ['sql#1']);
    let seed = 500;
    const routeFor = (model?: string) => workerOf(router.route(request(tokens(seed++, 9), model ? { model } : {}), 0));
    // A request naming no model may go to any worker; an adapter's only to its holders, in turn.
    assert.deepEqual([routeFor(), routeFor('sql#1'), routeFor('sql#1'), routeFor('sql#1'), routeFor()], ['a', 'b', 'c', 'b', 'c']);
    // Every holder busy: the adapter request waits in the admission queue, and draining it later routes it to a holder.
    router.updateLoad('b', load({ kvUsage: 0.99 }));
    router.updateLoad('c', load({ kvUsage: 0.99 }));
    assert.equal(router.route(request(tokens(7, 9), { requestId: 'q', model: 'sql#1' }), 0).kind, 'queued');
    router.updateLoad('c', load());
    assert.deepEqual(router.drainQueue(0).routed.map((r) => r.decision.workerId), ['c']);
  });

  it('random is uniform over non-busy workers', () => {
    const router = makeRouter({ policy: 'random' }, ['a', 'b', 'c', 'd', 'e']);
    router.updateLoad('e', load({ kvUsage: 0.96 }));
    const numDraws = 2000;
    const counts = histogram(routeMany(router, numDraws, { commit: false }));
    assert.equal(counts.get('e'), undefined);
    for (const workerId of ['a', 'b', 'c', 'd']) assertBinomial(counts.get(workerId) ?? 0, numDraws, 1 / 4, workerId);
  });

  it('least-loaded takes the fewest requests in flight, and with its own count spreads a burst exactly', () => {
    const router = makeRouter({ policy: 'least-loaded' });
    router.updateLoad('w0', load({ numRunning: 3 }));
    router.updateLoad('w1', load({ numRunning: 1, numWaiting: 1 }));
    router.updateLoad('w2', load({ numRunning: 1 }));
    router.updateLoad('w3', load({ numRunning: 5 }));
    assert.deepEqual(new Set(routeMany(router, 50, { commit: false })), new Set(['w2']));
    // Committing one there leaves w2 at 1 in flight: the larger of its report (1) and the router's count (1).
    assert.equal(workerOf(router.route(request(tokens(1, 9)), 0)), 'w2');
    // A second makes the router's count (2) exceed the report: w2 now ties with w1 and loses on held blocks.
    assert.equal(workerOf(router.route(request(tokens(2, 9)), 0)), 'w2');
    assert.equal(workerOf(router.route(request(tokens(3, 9)), 0)), 'w1');
    const fresh = makeRouter({ policy: 'least-loaded' });
    const counts = histogram(routeMany(fresh, 20));
    assert.deepEqual([...counts.values()], [5, 5, 5, 5]);
  });

  it('power-of-two picks the less loaded of two random workers', () => {
    const router = makeRouter({ policy: 'power-of-two' });
    ['w0', 'w1', 'w2', 'w3'].forEach((workerId, numRunning) => router.updateLoad(workerId, load({ numRunning })));
    const numDraws = 3000;
    const counts = histogram(routeMany(router, numDraws, { commit: false }));
    // Of the 6 pairs, w0 is in 3 and wins them all, w1 wins 2, w2 wins 1, w3 none.
    assert.equal(counts.get('w3'), undefined);
    assertBinomial(counts.get('w0') ?? 0, numDraws, 3 / 6, 'w0');
    assertBinomial(counts.get('w1') ?? 0, numDraws, 2 / 6, 'w1');
    assertBinomial(counts.get('w2') ?? 0, numDraws, 1 / 6, 'w2');
  });

  describe('session', () => {
    it('keeps a conversation on its worker even when the cost would move it', () => {
      const router = makeRouter({ policy: 'session' });
      const first = decisionOf(router.route(request(tokens(1, 9), { sessionId: 'chat-1' }), 0));
      assert.equal(first.strategy, 'kv');
      router.updateLoad(first.workerId, load({ numRunning: 6, activeDecodeBlocks: 300 }));
      for (let turn = 1; turn <= 5; turn++) {
        const next = decisionOf(router.route(request(tokens(turn + 1, 9), { sessionId: 'chat-1' }), turn));
        assert.equal(next.workerId, first.workerId);
        assert.equal(next.strategy, 'session');
      }
      // Another session, or none, is placed by cost: away from the loaded worker.
      assert.notEqual(workerOf(router.route(request(tokens(20, 9), { sessionId: 'chat-2' }), 6)), first.workerId);
      assert.notEqual(workerOf(router.route(request(tokens(21, 9)), 6)), first.workerId);
    });

    it('falls back to kv when its worker is busy or gone, and follows the new worker', () => {
      const router = makeRouter({ policy: 'session' }, ['a', 'b', 'c']);
      const home = workerOf(router.route(request(tokens(1, 9), { sessionId: 's' }), 0));
      router.updateLoad(home, load({ kvUsage: 0.99 }));
      const moved = decisionOf(router.route(request(tokens(2, 9), { sessionId: 's' }), 1));
      assert.notEqual(moved.workerId, home);
      assert.equal(moved.strategy, 'kv');
      assert.match(moved.reason, new RegExp(`session worker ${home} busy`));
      router.updateLoad(home, load());
      assert.equal(workerOf(router.route(request(tokens(3, 9), { sessionId: 's' }), 2)), moved.workerId, 'affinity moved');
      router.removeWorker(moved.workerId);
      const after = decisionOf(router.route(request(tokens(4, 9), { sessionId: 's' }), 3));
      assert.notEqual(after.workerId, moved.workerId);
      assert.match(after.reason, /new session/, 'the removed worker\'s sessions are forgotten');
    });

    it('keeps at most maxSessions, dropping the least recently used', () => {
      const router = makeRouter({ policy: 'session', maxSessions: 2 });
      const reasonFor = (sessionId: string, nowMs: number) => decisionOf(router.route(request(tokens(nowMs, 9), { sessionId }), nowMs)).reason;
      reasonFor('s1', 1);
      reasonFor('s2', 2);
      assert.match(reasonFor('s1', 3), /stays on/);
      reasonFor('s3', 4); // s2 is the least recently used
      assert.match(reasonFor('s1', 5), /stays on/);
      assert.match(reasonFor('s2', 6), /new session/);
    });

    it('forgets idle sessions after their ttl', () => {
      const router = makeRouter({ policy: 'session', sessionTtlMs: 100 });
      const home = workerOf(router.route(request(tokens(1, 9), { sessionId: 's' }), 0));
      router.updateLoad(home, load({ numRunning: 10 }));
      assert.equal(workerOf(router.route(request(tokens(2, 9), { sessionId: 's' }), 99)), home);
      assert.notEqual(workerOf(router.route(request(tokens(3, 9), { sessionId: 's' }), 199)), home);
    });
  });

  describe('load guard', () => {
    for (const policy of POLICY_NAMES) {
      it(`${policy}: never picks a worker over the KV usage threshold while another is free`, () => {
        const router = makeRouter({ policy: policy as PolicyName, busyKvUsage: 0.9 }, ['hot', 'x', 'y']);
        const prompt = tokens(5, 41);
        router.applyKvEvents('hot', [stored(1, hashes(prompt))]); // the best cache hit, and least loaded otherwise
        router.updateLoad('hot', load({ kvUsage: 0.9 }));
        router.updateLoad('x', load({ numRunning: 4, kvUsage: 0.5 }));
        router.updateLoad('y', load({ numRunning: 4, kvUsage: 0.89 }));
        for (let i = 0; i < 40; i++) {
          const decision = decisionOf(router.route(request(prompt, { sessionId: 'one' }), i));
          assert.notEqual(decision.workerId, 'hot');
          assert.equal(decision.costTerms.find((terms) => terms.workerId === 'hot')!.busy, true);
          assert.match(decision.reason, /skipped busy hot/);
        }
      });
    }

    it('counts the requests it sent as waiting, so a burst stops piling on at the queue threshold', () => {
      const router = makeRouter({ busyNumWaiting: 3 });
      const prompt = tokens(6, 41);
      const workers = Array.from({ length: 6 }, () => workerOf(router.route(request(prompt), 0)));
      assert.equal(new Set(workers.slice(0, 3)).size, 1, 'the first three share the prefix on one worker');
      assert.ok(!workers.slice(3).includes(workers[0]!), 'then that worker is busy');
    });
  });
});
