// abort() and finish() in every state a request can be in: each must free every block and leave no trace.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import type { Scheduler } from '../../src/engine/scheduler.ts';
import { FILLER, addAll, makeRequest, makeRequests, makeScheduler, prompt, step, summary } from './scheduler-fixtures.ts';

function assertNothingHeld(scheduler: Scheduler): void {
  scheduler.checkInvariants();
  assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
  assert.equal(scheduler.numRunning + scheduler.numWaiting, 0);
  assert.equal(scheduler.numRequests, 0);
}

describe('Scheduler abort', () => {
  it('frees a waiting request', () => {
    const scheduler = makeScheduler();
    const request = scheduler.addRequest(makeRequest('r0', prompt(0, 5)), 0);
    assert.equal(scheduler.abort('r0', 3), true);
    assert.equal(request.sequences[0]!.status, 'finished_aborted');
    assert.equal(request.timestamps.finished, 3);
    assertNothingHeld(scheduler);
    assert.equal(scheduler.abort('r0'), false, 'an unknown (or already finished) request is not an error');
  });

  it('frees a request in the middle of a chunked prefill', () => {
    const scheduler = makeScheduler({ maxNumBatchedTokens: 4 });
    scheduler.addRequest(makeRequest('r0', prompt(0, 10)), 0);
    assert.deepEqual(summary(step(scheduler).plan), ['r0/0+4']);
    assert.equal(scheduler.kv.pool.numUsedBlocks, 1);
    scheduler.abort('r0');
    assertNothingHeld(scheduler);
  });

  it('frees a decoding request and leaves the others running', () => {
    const scheduler = makeScheduler();
    addAll(scheduler, makeRequests(2, 6));
    step(scheduler);
    step(scheduler);
    scheduler.abort('r1');
    assert.deepEqual(summary(step(scheduler).plan), ['r0/0+1*1']);
    scheduler.checkInvariants();
    scheduler.abort('r0');
    assertNothingHeld(scheduler);
  });

  it('frees a preempted request', () => {
    const scheduler = makeScheduler({ numBlocks: 4 });
    addAll(scheduler, [makeRequest('r0', prompt(0, 6)), makeRequest('r1', prompt(1, 7), { arrivalMs: 1 })]);
    step(scheduler);
    step(scheduler);
    const { plan } = step(scheduler);
    assert.equal(plan.preempted[0]!.request.id, 'r1');
    assert.equal(scheduler.getRequest('r1')!.status, 'preempted');
    scheduler.abort('r1');
    scheduler.abort('r0');
    assertNothingHeld(scheduler);
  });

  it('skips a request aborted between schedule and updateFromOutput, whose rows still come back', () => {
    const scheduler = makeScheduler();
    addAll(scheduler, makeRequests(3, 5));
    const plan = scheduler.schedule(0);
    scheduler.abort('r1');
    const result = scheduler.updateFromOutput(plan, [11, 12, 13], 1);
    assert.deepEqual(result.outputs.map((output) => [output.requestId, output.newTokenIds[0]]), [['r0', 11], ['r2', 13]]);
    assert.deepEqual(summary(step(scheduler).plan), ['r0/0+1*1', 'r2/0+1*1']);
    scheduler.checkInvariants();
  });

  it('finishes a request from outside (a stop string), like the detokenizer does', () => {
    const scheduler = makeScheduler();
    const request = scheduler.addRequest(makeRequest('r0', prompt(0, 5)), 0);
    step(scheduler);
    assert.equal(scheduler.finish('r0', 'stop', { nowMs: 9 }), true);
    assert.equal(request.sequences[0]!.status, 'finished_stopped');
    assert.equal(request.sequences[0]!.finishReason, 'stop');
    assert.deepEqual(request.outputTokenIds, [FILLER]);
    assertNothingHeld(scheduler);
  });

  it('a stop inside appended (jump-forward) tokens drops those after it, and never a computed token', () => {
    const scheduler = makeScheduler();
    const first = scheduler.addRequest(makeRequest('r0', prompt(0, 5)), 0);
    const second = scheduler.addRequest(makeRequest('r1', prompt(1, 5)), 0);
    step(scheduler);
    scheduler.appendTokens('r0', 0, [11, 12, 13], 1);
    scheduler.appendTokens('r1', 0, [11, 12], 1);
    assert.throws(() => scheduler.finish('r0', 'stop', { index: 0, dropTokens: 5 }), RangeError); // more than its output
    assert.throws(() => scheduler.finish('r0', 'stop', { dropTokens: 1 }), RangeError); // which sequence?
    assert.equal(scheduler.finish('r0', 'stop', { index: 0, nowMs: 2, dropTokens: 2 }), true);
    assert.deepEqual(first.outputTokenIds, [FILLER, 11]);
    step(scheduler, 3); // r1 computes FILLER, 11, 12 and samples one more
    assert.throws(() => scheduler.finish('r1', 'stop', { index: 0, dropTokens: 2 }), RangeError); // 12 is computed now
    assert.deepEqual(second.outputTokenIds, [FILLER, 11, 12, FILLER]);
    assert.equal(scheduler.finish('r1', 'stop', { index: 0, nowMs: 4, dropTokens: 1 }), true);
    assert.deepEqual(second.outputTokenIds, [FILLER, 11, 12]);
    assertNothingHeld(scheduler);
  });
});
