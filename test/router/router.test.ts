// The router end to end with the kv policy: overlap from real KV events, cost terms, speculative inserts and their
// expiry, gaps and resync, worker removal, its own load accounting and the overhead it reports.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import type { KvEvent } from '../../src/protocols/kv-events.ts';
import { HashSetKvIndex } from '../../src/router/kv-index.ts';
import type { RouteOutcome, RoutingDecision } from '../../src/router/protocols.ts';
import { workerLoadFromStats } from '../../src/protocols/worker.ts';
import { CacheOfWorker, hashes, load, makeRouter, removed, request, stored, tokens } from './fixtures.ts';

function routed(outcome: RouteOutcome): RoutingDecision {
  assert.equal(outcome.kind, 'routed', `expected a decision, got ${JSON.stringify(outcome)}`);
  return (outcome as { decision: RoutingDecision }).decision;
}

describe('Router (kv policy)', () => {
  const prompt = tokens(1, 41); // 10 full blocks of 4 and one partial

  it('sends a request to the worker holding its longest prefix and reports every worker\'s cost terms', () => {
    const router = makeRouter();
    router.applyKvEvents('w2', [stored(1, hashes(prompt).slice(0, 6))]);
    router.applyKvEvents('w1', [stored(1, hashes(prompt).slice(0, 2))]);
    const decision = routed(router.route(request(prompt), 0));
    assert.equal(decision.workerId, 'w2');
    assert.equal(decision.overlapBlocks, 6);
    assert.equal(decision.newPrefillTokens, 41 - 24);
    assert.equal(decision.strategy, 'kv');
    assert.deepEqual(decision.costTerms.map((terms) => [terms.workerId, terms.overlapBlocks]), [['w0', 0], ['w1', 2], ['w2', 6], ['w3', 0]]);
    const cheapest = Math.min(...decision.costTerms.map((terms) => terms.cost));
    assert.equal(decision.costTerms.find((terms) => terms.workerId === 'w2')!.cost, cheapest);
    assert.match(decision.reason, /overlap 6 blocks/);
  });

  it('a prompt computed whole (prompt logprobs) counts no overlap anywhere, and its worker gets the whole prompt as prefill', () => {
    const router = makeRouter();
    router.applyKvEvents('w2', [stored(1, hashes(prompt).slice(0, 6))]);
    const whole = routed(router.route(request(prompt, { computesWholePrompt: true }), 0));
    assert.ok(whole.costTerms.every((terms) => terms.overlapBlocks === 0), JSON.stringify(whole.costTerms));
    assert.equal(whole.overlapBlocks, 0);
    assert.equal(whole.newPrefillTokens, 41);
    // Its blocks are on its worker once computed: the next plain request with the prompt goes there (its speculative
    // prefix), not to w2 with 6 of the 10 blocks.
    const next = routed(router.route(request(prompt), 0));
    assert.equal(next.workerId, whole.workerId);
    assert.equal(next.overlapBlocks, 10);
  });

  it('sends a request only to workers that hold its model', () => {
    const router = makeRouter({}, []);
    router.addWorker('a', load(), ['llama', 'llama:sql-lora']);
    router.addWorker('b', load(), ['qwen']);
    router.addWorker('any', load());
    // Even holding the prompt's blocks, a worker without the model is no candidate.
    router.applyKvEvents('b', [stored(1, hashes(prompt))]);
    for (let i = 0; i < 5; i++) {
      const decision = routed(router.route(request(prompt, { requestId: `r${i}`, model: 'llama' }), 0, { commit: false }));
      assert.notEqual(decision.workerId, 'b');
      assert.deepEqual(decision.costTerms.map((terms) => terms.workerId).sort(), ['a', 'any']);
    }
    assert.equal(routed(router.route(request(prompt, { model: 'qwen' }), 0, { commit: false })).workerId, 'b');
    assert.deepEqual(routed(router.route(request(prompt, { model: 'other' }), 0, { commit: false })).costTerms
      .map((terms) => terms.workerId), ['any']);
  });

  it('rejects at once a request for a model no worker holds (no queue wait), and follows a worker\'s changed models', () => {
    const router = makeRouter({}, []);
    router.addWorker('a', load(), ['sql#1']);
    router.addWorker('b', load(), []);
    const outcome = router.route(request(prompt, { requestId: 'x', model: 'chat#1' }), 0);
    assert.equal(outcome.kind, 'rejected');
    assert.equal(outcome.kind === 'rejected' && outcome.reason, 'no-model-workers');
    assert.equal(router.stats().numQueued, 0);
    router.setWorkerModels('b', ['chat#1']);
    assert.equal(routed(router.route(request(prompt, { requestId: 'y', model: 'chat#1' }), 0, { commit: false })).workerId, 'b');
    router.setWorkerModels('a', []);
    assert.equal(router.route(request(prompt, { requestId: 'z', model: 'sql#1' }), 0).kind, 'rejected');
    // A request naming no model goes to any of them.
    assert.equal(router.route(request(prompt, { requestId: 'w' }), 0, { commit: false }).kind, 'routed');
  });

  it('matches only under the same cache salt', () => {
    const router = makeRouter({}, ['a', 'b']);
    router.applyKvEvents('a', [stored(1, hashes(prompt, 'tenant-1'))]);
    assert.equal(routed(router.route(request(prompt, { cacheSalt: 'tenant-1' }), 0)).workerId, 'a');
    const other = routed(router.route(request(prompt, { cacheSalt: 'tenant-2' }), 0, { commit: false }));
    assert.equal(other.costTerms.every((terms) => terms.overlapBlocks === 0), true);
  });

  it('trades the cache hit for load by overlapWeight, per request too', () => {
    const router = makeRouter({}, ['cached', 'idle']);
    router.applyKvEvents('cached', [stored(1, hashes(prompt).slice(0, 6))]);
    router.updateLoad('cached', load({ activeDecodeBlocks: 20 }));
    // Weight 1: cached = 17/4 + 20 + 11 = 35.25, idle = 41/4 + 11 = 21.25.
    assert.equal(routed(router.route(request(prompt), 0, { commit: false })).workerId, 'idle');
    // Weight 10: cached = 42.5 + 31 = 73.5, idle = 102.5 + 11 = 113.5.
    assert.equal(routed(router.route(request(prompt, { override: { overlapWeight: 10 } }), 0, { commit: false })).workerId, 'cached');
    assert.throws(() => router.route(request(prompt, { override: { overlapWeight: -1 } }), 0), RangeError);
  });

  it('counts what it sent until the worker reports it: a burst of distinct prompts spreads evenly', () => {
    const router = makeRouter();
    const decisions = Array.from({ length: 12 }, (_, i) => routed(router.route(request(tokens(50 + i, 41)), 0)));
    const perWorker = new Map<string, number>();
    for (const decision of decisions) perWorker.set(decision.workerId, (perWorker.get(decision.workerId) ?? 0) + 1);
    assert.deepEqual([...perWorker.values()].sort(), [3, 3, 3, 3]);
    // Finishing releases the accounting: the next request goes to the worker that just emptied.
    const last = decisions[11]!;
    const mates = decisions.filter((decision) => decision.workerId === last.workerId);
    for (const decision of mates) router.onFinished(decision.requestId, 1);
    assert.equal(routed(router.route(request(tokens(99, 41)), 1)).workerId, last.workerId);
    assert.equal(router.stats().numActiveRequests, 10);
  });

  it('stops counting a request\'s prompt as queued prefill once its first token is out, and its blocks once it ends', () => {
    const router = makeRouter({ speculativeTtlMs: 0, busyNumWaiting: 2 }, ['a']);
    const first = routed(router.route(request(prompt), 0));
    const terms = () => routed(router.route(request(tokens(2, 41)), 0, { commit: false })).costTerms[0]!;
    assert.deepEqual([terms().prefillTokens, terms().decodeBlocks], [41 + 41, 11 + 11]);
    routed(router.route(request(tokens(3, 41)), 0));
    assert.equal(router.route(request(tokens(4, 41)), 0).kind, 'queued', 'two requests waiting for prefill: busy');
    router.onPrefillDone(first.requestId);
    assert.deepEqual([terms().prefillTokens, terms().decodeBlocks], [41 + 41, 11 + 22], 'one prompt still queued');
    router.onFinished(first.requestId, 1);
    assert.deepEqual([terms().prefillTokens, terms().decodeBlocks], [41 + 41, 11 + 11]);
    assert.equal(router.drainQueue(1).routed.length, 1, 'no longer busy');
  });

  describe('speculative insert', () => {
    it('keeps a burst of identical prompts on one worker until events arrive', () => {
      const router = makeRouter();
      const decisions = Array.from({ length: 8 }, () => routed(router.route(request(prompt), 0)));
      assert.equal(new Set(decisions.map((decision) => decision.workerId)).size, 1);
      for (const decision of decisions.slice(1)) {
        assert.equal(decision.overlapBlocks, 10);
        const chosen = decision.costTerms.find((terms) => terms.workerId === decision.workerId)!;
        assert.equal(chosen.speculativeBlocks, 10, 'all of the overlap is a guess: no event has arrived');
      }
    });

    it('discounts only prefill still computing the shared prefix', () => {
      const router = makeRouter({}, ['a']);
      const leader = routed(router.route(request(prompt), 0));
      routed(router.route(request(tokens(9, 41)), 0)); // another prompt, still prefilling
      const follower = () => routed(router.route(request(prompt), 0, { commit: false })).costTerms[0]!;
      // Queued: 41 (leader) + 41 (other); the leader's 40 block tokens are this prompt's own prefix.
      assert.equal(follower().prefillTokens, 1 + (82 - 40));
      router.onPrefillDone(leader.requestId);
      assert.equal(follower().prefillTokens, 1 + 41, 'the leader is done: the other prompt is all that is queued');
    });

    it('without it the same burst is spread over every worker, each computing the prompt', () => {
      const router = makeRouter({ speculativeTtlMs: 0 });
      const decisions = Array.from({ length: 8 }, () => routed(router.route(request(prompt), 0)));
      assert.equal(new Set(decisions.map((decision) => decision.workerId)).size, 4);
      assert.ok(decisions.every((decision) => decision.overlapBlocks === 0));
    });

    it('expires when no event confirms it, and lasts when one does', () => {
      const router = makeRouter({ speculativeTtlMs: 1000 });
      const first = routed(router.route(request(prompt), 0));
      router.onFinished(first.requestId, 10);
      const probe = (nowMs: number) => routed(router.route(request(prompt), nowMs, { commit: false }));
      assert.equal(probe(999).overlapBlocks, 10);
      assert.equal(probe(1000).overlapBlocks, 0, 'expired at 0 + ttl');
      assert.equal(router.stats().numSpeculativeEntries, 0, 'pruned');

      const second = routed(router.route(request(prompt), 2000));
      assert.equal(router.stats().numSpeculativeEntries, 10);
      // The worker computes the first 6 blocks and says so; the rest stay guesses.
      router.applyKvEvents(second.workerId, [stored(1, hashes(prompt).slice(0, 6))]);
      assert.equal(router.stats().numSpeculativeEntries, 4);
      const mixed = probe(2500).costTerms.find((terms) => terms.workerId === second.workerId)!;
      assert.deepEqual([mixed.overlapBlocks, mixed.speculativeBlocks], [10, 4]);
      const later = probe(3000).costTerms.find((terms) => terms.workerId === second.workerId)!;
      assert.deepEqual([later.overlapBlocks, later.speculativeBlocks], [6, 0], 'the confirmed blocks outlive the guess');
    });

    it('gives way to a removal event', () => {
      const router = makeRouter();
      const decision = routed(router.route(request(prompt), 0));
      router.applyKvEvents(decision.workerId, [removed(1, hashes(prompt).slice(3, 4))]);
      const probe = routed(router.route(request(prompt), 1, { commit: false }));
      assert.equal(probe.costTerms.find((terms) => terms.workerId === decision.workerId)!.overlapBlocks, 3);
    });

    it('stands through events about the worker\'s RAM or disk tier: only its primary pool confirms or denies it', () => {
      const router = makeRouter();
      const decision = routed(router.route(request(prompt), 0));
      const blocks = hashes(prompt);
      // The worker offloads an older copy of the prefix to RAM, evicts part of it from disk and clears its RAM tier:
      // none of it says anything about what its primary pool is computing for this request.
      router.applyKvEvents(decision.workerId, [
        { ...stored(1, blocks.slice(0, 4)), tier: 'ram' } as KvEvent,
        { type: 'removed', eventId: 2, blockHashes: blocks.slice(4, 6), tier: 'disk' },
        { type: 'cleared', eventId: 3, tier: 'ram' },
      ]);
      assert.equal(router.stats().numSpeculativeEntries, 10);
      const probe = routed(router.route(request(prompt), 1, { commit: false }));
      const chosen = probe.costTerms.find((terms) => terms.workerId === decision.workerId)!;
      assert.deepEqual([chosen.overlapBlocks, chosen.speculativeBlocks], [10, 10]);
    });
  });

  it('reports lost events, and resyncs from a real worker\'s dump', () => {
    const router = makeRouter({}, ['a', 'b']);
    const worker = new CacheOfWorker(64);
    worker.compute(tokens(7, 20));
    assert.equal(router.applyKvEvents('a', worker.takeEvents()).needsResync, false);
    worker.compute(prompt);
    worker.takeEvents(); // lost in transit
    worker.compute(tokens(8, 20));
    const afterLoss = worker.takeEvents();
    const result = router.applyKvEvents('a', afterLoss);
    assert.equal(result.needsResync, true);
    assert.deepEqual(router.workersNeedingResync(), ['a']);
    assert.equal(routed(router.route(request(prompt), 0, { commit: false })).costTerms[0]!.overlapBlocks, 0);
    // The dump is taken after the last event the worker emitted, so it reflects that event id.
    router.resyncWorker('a', worker.kv.cachedBlockHashes(), afterLoss.at(-1)!.eventId);
    assert.deepEqual(router.workersNeedingResync(), []);
    const decision = routed(router.route(request(prompt), 0));
    assert.deepEqual([decision.workerId, decision.overlapBlocks], ['a', worker.heldBlocks(prompt)]);
    // Redelivered events are counted, not applied.
    assert.deepEqual(router.applyKvEvents('a', [stored(1, hashes(prompt))]), { needsResync: false, numApplied: 0, numDuplicates: 1 });
  });

  it('refuses events with another block size', () => {
    const router = makeRouter();
    const blockHashes = hashes(prompt);
    const event: KvEvent = { type: 'stored', eventId: 1, blockHashes, parentHash: null, blockSize: 16, tokenCount: 16 * blockHashes.length };
    assert.throws(() => router.applyKvEvents('w0', [event]), RangeError);
    assert.equal(router.stats().numIndexedBlocks, 0);
  });

  it('forgets a removed worker and hands back the requests it had', () => {
    const router = makeRouter({}, ['a', 'b', 'c']);
    router.applyKvEvents('b', [stored(1, hashes(prompt))]);
    const onB = routed(router.route(request(prompt), 0));
    assert.equal(onB.workerId, 'b');
    assert.deepEqual(router.removeWorker('b'), [onB.requestId]);
    assert.deepEqual(router.workers(), ['a', 'c']);
    for (let i = 0; i < 20; i++) {
      const decision = routed(router.route(request(prompt), 1));
      assert.notEqual(decision.workerId, 'b');
      assert.equal(decision.costTerms.length, 2);
    }
    assert.equal(router.index.workers().includes('b'), false);
    router.removeWorker('a');
    router.removeWorker('c');
    const outcome = router.route(request(prompt), 2);
    assert.equal(outcome.kind, 'rejected');
    assert.equal(outcome.kind === 'rejected' && outcome.reason, 'no-workers');
  });

  it('takes any KvIndex implementation', () => {
    const router = makeRouter({ index: new HashSetKvIndex() }, ['a', 'b']);
    router.applyKvEvents('b', [stored(1, hashes(prompt).slice(0, 5))]);
    assert.deepEqual(pick(routed(router.route(request(prompt), 0))), ['b', 5]);
  });

  it('times hashing, lookup and selection with the injected clock', () => {
    // Each clock reading advances by the next step: 0 -> 3 µs -> 8 µs -> 9 µs.
    const readingsMs = [0, 0.003, 0.008, 0.009];
    let at = 0;
    const router = makeRouter({ clock: () => readingsMs[at++]! }, ['a', 'b']);
    const { overhead } = routed(router.route(request(prompt), 0));
    assert.equal(at, 4, 'four readings per routing call');
    assert.deepEqual(
      [overhead.hashingUs, overhead.lookupUs, overhead.selectionUs, overhead.totalUs].map((us) => Math.round(us * 1000) / 1000),
      [3, 5, 1, 9],
    );
  });

  it('turns engine stats into a load view', () => {
    const view = workerLoadFromStats({
      numRunning: 3, numWaiting: 2, kvBlocksUsed: 30, kvBlocksTotal: 120, prefixCacheQueries: 0, prefixCacheHits: 0, preemptions: 0,
    });
    assert.deepEqual(view, { numRunning: 3, numWaiting: 2, activePrefillTokens: 0, activeDecodeBlocks: 30, kvUsage: 0.25 });
  });

  it('refuses a request id it is already tracking', () => {
    const router = makeRouter();
    const first = request(prompt);
    router.route(first, 0);
    assert.throws(() => router.route(first, 1), /already routed/);
    router.onFinished(first.requestId, 2);
    assert.equal(router.route(first, 3).kind, 'routed');
  });
});

function pick(decision: RoutingDecision): [string, number] {
  return [decision.workerId, decision.overlapBlocks];
}
