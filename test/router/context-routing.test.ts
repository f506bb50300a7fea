// Workers with different context lengths behind one router (Router.setWorkerMaxTokens): a request goes only to
// workers whose context holds its prompt and max_tokens (RoutingRequest.contextTokens); when no registered worker
// does, to one that holds its prompt; when none holds the prompt, it is rejected at once. Queued requests too long
// for the worker that has room keep their place without holding up shorter ones.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import type { RouteOutcome, RoutingDecision } from '../../src/router/protocols.ts';
import { load, makeRouter, request, tokens } from './fixtures.ts';

function routed(outcome: RouteOutcome): RoutingDecision {
  assert.equal(outcome.kind, 'routed', `expected a decision, got ${JSON.stringify(outcome)}`);
  return (outcome as { decision: RoutingDecision }).decision;
}

describe('Router: workers of different context lengths', () => {
  it('sends a request only to workers whose context holds its prompt and max_tokens', () => {
    const router = makeRouter({ policy: 'round-robin' }, ['big', 'small']);
    router.setWorkerMaxTokens('big', 2048);
    router.setWorkerMaxTokens('small', 512);
    const long = tokens(1, 900);
    for (let i = 0; i < 6; i++) {
      const decision = routed(router.route(request(long, { contextTokens: 908 }), 0));
      assert.equal(decision.workerId, 'big', `request ${i}`);
      assert.match(decision.reason, /skipped small \(context under 908 tokens\)/);
    }
    // A prompt that fits the small worker but whose max_tokens does not.
    assert.equal(routed(router.route(request(tokens(2, 300), { contextTokens: 600 }), 0, { commit: false })).workerId, 'big');
    // Short requests go to both.
    const seen = new Set<string>();
    for (let i = 0; i < 4; i++) seen.add(routed(router.route(request(tokens(3 + i, 40), { contextTokens: 100 }), 0)).workerId);
    assert.deepEqual([...seen].sort(), ['big', 'small']);
  });

  it('falls back to the prompt alone when no worker holds max_tokens too, and rejects a prompt no worker takes', () => {
    const router = makeRouter({}, ['big', 'small']);
    router.setWorkerMaxTokens('big', 2048);
    router.setWorkerMaxTokens('small', 512);
    // 3000 tokens fit nowhere: the workers whose context takes the prompt are its candidates (it ends at "length").
    assert.equal(routed(router.route(request(tokens(1, 600), { contextTokens: 3000 }), 0, { commit: false })).workerId, 'big');
    const both = routed(router.route(request(tokens(2, 100), { contextTokens: 3000 }), 0, { commit: false }));
    assert.deepEqual(both.costTerms.map((t) => t.workerId).sort(), ['big', 'small']);
    // A prompt must leave room for one token: 2048 tokens fit no worker.
    const outcome = router.route(request(tokens(3, 2048), { requestId: 'too-long', contextTokens: 2056 }), 0);
    assert.equal(outcome.kind === 'rejected' && outcome.reason, 'no-context-workers');
    assert.equal(router.stats().numQueued, 0, 'not queued: waiting would not help');
    // The limit goes with the worker.
    router.removeWorker('big');
    assert.equal(router.route(request(tokens(4, 600), { contextTokens: 608 }), 0).kind, 'rejected');
    router.addWorker('big');
    assert.equal(routed(router.route(request(tokens(5, 600), { contextTokens: 608 }), 0, { commit: false })).workerId, 'big');
  });

  it('a worker that declared no limit takes any request', () => {
    const router = makeRouter({}, ['known', 'unknown']);
    router.setWorkerMaxTokens('known', 512);
    assert.equal(routed(router.route(request(tokens(1, 900), { contextTokens: 908 }), 0, { commit: false })).workerId, 'unknown');
    router.setWorkerMaxTokens('known', undefined);
    const decision = routed(router.route(request(tokens(2, 900), { contextTokens: 908 }), 0, { commit: false }));
    assert.deepEqual(decision.costTerms.map((t) => t.workerId).sort(), ['known', 'unknown']);
  });

  it('a queued request too long for the worker with room waits for its own, without holding up shorter ones', () => {
    const router = makeRouter({ busyNumWaiting: 1 }, ['big', 'small']);
    router.setWorkerMaxTokens('big', 2048);
    router.setWorkerMaxTokens('small', 512);
    router.updateLoad('big', load({ numWaiting: 5 }));
    router.updateLoad('small', load({ numWaiting: 5 }));
    const long = request(tokens(1, 900), { requestId: 'long', contextTokens: 908 });
    const short = request(tokens(2, 100), { requestId: 'short', contextTokens: 108 });
    assert.equal(router.route(long, 0).kind, 'queued');
    assert.equal(router.route(short, 0).kind, 'queued');
    // The small worker has room: the short request goes, the long one keeps waiting for the big worker.
    router.updateLoad('small', load());
    const first = router.drainQueue(1);
    assert.deepEqual(first.routed.map((r) => [r.request.requestId, r.decision.workerId]), [['short', 'small']]);
    assert.equal(router.stats().numQueued, 1);
    router.updateLoad('big', load());
    const second = router.drainQueue(2);
    assert.deepEqual(second.routed.map((r) => [r.request.requestId, r.decision.workerId]), [['long', 'big']]);
  });
});
