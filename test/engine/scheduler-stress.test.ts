// A seeded random workload: 1,000 requests per policy with shared prefixes, n > 1, random stops, aborts, stop
// strings and failed steps, over a pool small enough to preempt and evict all the time. Every step checks the
// budgets, the batch layout and every invariant; at the end every block is free and every token accounted for.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { BatchBuilder } from '../../src/engine/batch-builder.ts';
import type { BlockHash } from '../../src/protocols/kv-events.ts';
import type { Request } from '../../src/engine/request.ts';
import type { Scheduler, StepPlan } from '../../src/engine/scheduler.ts';
import type { SchedulingPolicy } from '../../src/engine/types.ts';
import { EOS, makeRequest, makeScheduler } from './scheduler-fixtures.ts';
import { seededRandom } from '../../src/util/random.ts';

const NUM_REQUESTS = 1000;
const STOP_TOKEN = 150;

/** mulberry32: a tiny seeded PRNG, so a failure replays exactly. */
function makeRandom(seed: number): { next: () => number; int: (below: number) => number; chance: (p: number) => boolean } {
  const next = seededRandom(seed);
  return { next, int: (below) => Math.floor(next() * below), chance: (p) => next() < p };
}

/** Writes go only to blocks this sequence alone holds and nobody can hit: never to a shared or cached block. */
function checkBatch(scheduler: Scheduler, builder: BatchBuilder, plan: StepPlan): void {
  assert.ok(plan.numScheduledTokens <= scheduler.maxNumBatchedTokens);
  assert.ok(plan.scheduled.length <= scheduler.maxNumSeqs);
  assert.ok(plan.sampleTargets.length <= scheduler.maxNumSeqs);
  const batch = builder.build(plan);
  assert.equal(batch.numTokens, plan.numScheduledTokens);
  const slots = new Set<number>();
  for (const slot of batch.slotMapping) {
    assert.ok(!slots.has(slot), `slot ${slot} written twice in one step`);
    slots.add(slot);
    const block = scheduler.kv.pool.blocks[Math.floor(slot / scheduler.kv.blockSize)]!;
    assert.equal(block.refCount, 1, `block ${block.id} is written while shared`);
    assert.equal(block.hash, null, `block ${block.id} is written while cached`);
  }
  assert.equal(batch.logitsIndices.length, plan.sampleTargets.length);
  // A copy reads a cached block nobody may write, pinned for the step, into the fresh block its sequence writes.
  for (const { source, destination } of plan.blockCopies) {
    assert.notEqual(source.hash, null, `copy source ${source.id} is cached`);
    assert.ok(source.refCount >= 1, `copy source ${source.id} is pinned`);
    assert.equal(destination.hash, null);
    assert.equal(destination.refCount, 1, `copy destination ${destination.id} belongs to one sequence`);
    const planned = plan.scheduled.find((entry) => entry.sequence.blockTable.blocks.includes(destination));
    assert.ok(planned !== undefined && planned.numNewTokens === 1, 'the copy serves a sequence computing its last token only');
  }
}

function runWorkload(policy: SchedulingPolicy, seed: number) {
  const random = makeRandom(seed);
  const scheduler = makeScheduler({
    policy, numBlocks: 40, blockSize: 4, maxNumBatchedTokens: 48, maxNumSeqs: 12, maxModelLen: 96, enableEvents: true,
    longPrefillTokenThreshold: policy === 'deadline' ? 16 : 0,
  });
  const builder = BatchBuilder.forScheduler(scheduler);
  const families = Array.from({ length: 6 }, () => Array.from({ length: 4 + random.int(37) }, () => 100 + random.int(100)));
  const requests: Request[] = [];
  const live = new Set<string>();
  const streams = new Map<string, number[]>();
  const externallyFinished = new Set<string>();
  const replayedCache = new Set<BlockHash>();
  let lastEventId = 0;
  let numForks = 0;
  let numBlockCopies = 0;
  const sentPrompts: number[][] = [];

  const pickLive = (): string | undefined => {
    if (live.size === 0) return undefined;
    const index = random.int(live.size);
    let i = 0;
    for (const id of live) if (i++ === index) return id;
    return undefined;
  };

  let now = 0;
  for (let steps = 0; requests.length < NUM_REQUESTS || live.size > 0; steps++) {
    assert.ok(steps < 50_000, 'the workload must drain (no livelock)');
    now += 1 + random.int(3);
    for (let k = random.int(4); k > 0 && requests.length < NUM_REQUESTS; k--) {
      const family = families[random.int(families.length)]!;
      const prefix = family.slice(0, 1 + random.int(family.length));
      // Some recent prompts come again word for word, so whole prompts hit the cache (and those ending on a block
      // boundary copy their last block).
      const promptTokenIds = sentPrompts.length > 0 && random.chance(0.15)
        ? sentPrompts[sentPrompts.length - 1 - random.int(Math.min(8, sentPrompts.length))]!
        : [...prefix, ...Array.from({ length: 1 + random.int(30) }, () => 100 + random.int(100))];
      sentPrompts.push(promptTokenIds);
      const n = [1, 1, 1, 2, 3][random.int(5)]!;
      numForks += n > 1 ? 1 : 0;
      const id = `q${requests.length}`;
      requests.push(scheduler.addRequest(makeRequest(id, promptTokenIds, {
        arrivalMs: now, priority: random.int(4), deadlineMs: random.chance(0.5) ? now + random.int(200) : undefined,
        cacheSalt: random.chance(0.2) ? 'tenant-b' : undefined,
        sampling: { n, maxTokens: 1 + random.int(24), minTokens: random.int(3), ignoreEos: random.chance(0.1),
          stopTokenIds: random.chance(0.3) ? [STOP_TOKEN] : [] },
      }), now));
      live.add(id);
    }
    if (random.chance(0.03)) {
      const id = pickLive();
      if (id !== undefined && scheduler.abort(id, now)) { live.delete(id); externallyFinished.add(id); }
    }
    if (random.chance(0.03)) {
      const id = pickLive();
      if (id !== undefined) {
        const index = random.int(scheduler.getRequest(id)!.sequences.length);
        externallyFinished.add(id);
        if (scheduler.finish(id, 'stop', { index, nowMs: now })) live.delete(id);
      }
    }

    const plan = scheduler.schedule(now);
    if (plan.scheduled.length > 0) {
      checkBatch(scheduler, builder, plan);
      numBlockCopies += plan.blockCopies.length;
      if (random.chance(0.01)) {
        scheduler.discardPlan(plan); // the forward pass failed; the same work is planned again
      } else {
        if (random.chance(0.03)) {
          const target = plan.sampleTargets[random.int(plan.sampleTargets.length)];
          if (target !== undefined && scheduler.abort(target.request.id, now)) { live.delete(target.request.id); externallyFinished.add(target.request.id); }
        }
        const sampled = plan.sampleTargets.map(() => (random.chance(0.06) ? EOS : random.chance(0.03) ? STOP_TOKEN : 100 + random.int(100)));
        const result = scheduler.updateFromOutput(plan, sampled, now + 1);
        for (const output of result.outputs) {
          const key = `${output.requestId}/${output.index}`;
          streams.set(key, [...(streams.get(key) ?? []), ...output.newTokenIds]);
        }
        for (const request of result.finishedRequests) live.delete(request.id);
      }
    }
    for (const event of scheduler.kv.takeEvents()) {
      assert.equal(event.eventId, lastEventId + 1);
      lastEventId = event.eventId;
      if (event.type === 'stored') for (const hash of event.blockHashes) replayedCache.add(hash);
      else if (event.type === 'removed') for (const hash of event.blockHashes) replayedCache.delete(hash);
      else replayedCache.clear();
    }
    scheduler.checkInvariants();
  }
  assert.deepEqual([...replayedCache].sort(), scheduler.kv.cachedBlockHashes().sort(), 'events replay to the cached set');
  return { scheduler, requests, streams, externallyFinished, numForks, numBlockCopies };
}

describe('Scheduler stress', () => {
  for (const [policy, seed] of [['fcfs', 1], ['priority', 2], ['deadline', 3]] as const) {
    it(`drains ${NUM_REQUESTS} random requests under ${policy} with every block freed and every token accounted for`, () => {
      const { scheduler, requests, streams, externallyFinished, numForks, numBlockCopies } = runWorkload(policy, seed);
      assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
      assert.equal(scheduler.kv.numPins, 0, 'every copy source was released');
      assert.equal(scheduler.numRequests, 0);
      assert.equal(scheduler.numRunning + scheduler.numWaiting, 0);

      for (const request of requests) {
        assert.ok(request.isFinished, `${request.id} finished`);
        for (const sequence of request.sequences) {
          const { outputTokenIds, finishReason } = sequence;
          assert.deepEqual(streams.get(`${request.id}/${sequence.index}`) ?? [], outputTokenIds, 'streamed tokens = kept tokens');
          assert.equal(sequence.blockTable.blocks.length, 0);
          assert.ok(outputTokenIds.length <= request.sampling.maxTokens);
          if (externallyFinished.has(request.id) && (finishReason === 'abort' || sequence.stopReason === null)) continue;
          const last = outputTokenIds[outputTokenIds.length - 1]!;
          if (finishReason === 'stop') {
            assert.ok(outputTokenIds.length > request.sampling.minTokens);
            assert.ok(last === STOP_TOKEN ? request.sampling.stopTokenIds.includes(STOP_TOKEN) : last === EOS && !request.sampling.ignoreEos);
          } else {
            assert.equal(finishReason, 'length');
            assert.ok(outputTokenIds.length === request.sampling.maxTokens || sequence.numTokens >= scheduler.maxModelLen);
          }
        }
        if (!externallyFinished.has(request.id)) assert.equal(request.sequences.length, request.sampling.n);
      }

      const stats = scheduler.stats();
      const kvStats = scheduler.kv.stats();
      assert.ok(stats.numPreemptions > 0, 'the pool is small enough to preempt');
      assert.ok(kvStats.prefixHitTokens > 0 && kvStats.evictions > 0, 'prefixes are shared and evicted');
      assert.ok(numForks > 0);
      assert.ok(numBlockCopies > 0, 'fully cached prompts copied their last block');
    });
  }
});
