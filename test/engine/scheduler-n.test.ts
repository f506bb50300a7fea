// n > 1: one prompt computed once, sampled n times, forked into n sequences sharing the prompt's full blocks.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { BatchBuilder } from '../../src/engine/batch-builder.ts';
import { EOS, blockIds, makeRequest, makeScheduler, prompt, step, summary } from './scheduler-fixtures.ts';
import type { SampleTarget } from '../../src/engine/scheduler.ts';

/** Sample k of a request picks 50 + k, so every fork's tokens are its own. */
const perSample = (target: SampleTarget): number => 50 + target.completionIndex;

describe('Scheduler with n > 1', () => {
  it('samples the last prompt row n times and forks, sharing the full prompt blocks', () => {
    const scheduler = makeScheduler({ maxNumSeqs: 3 });
    const request = scheduler.addRequest(makeRequest('r0', prompt(0, 10), { sampling: { n: 3, maxTokens: 3 } }), 0);
    const builder = BatchBuilder.forScheduler(scheduler);

    const plan = scheduler.schedule(0);
    assert.deepEqual(summary(plan), ['r0/0+10*3']);
    assert.deepEqual(plan.sampleTargets.map((target) => target.completionIndex), [0, 1, 2]);
    assert.deepEqual([...builder.build(plan).logitsIndices], [9, 9, 9]);
    const first = scheduler.updateFromOutput(plan, plan.sampleTargets.map(perSample), 1);
    assert.deepEqual(first.outputs.map((output) => [output.index, output.newTokenIds[0]]), [[0, 50], [1, 51], [2, 52]]);
    assert.deepEqual(request.sequences.map((sequence) => sequence.numComputedTokens), [10, 8, 8]);
    assert.deepEqual([0, 1, 2].map((index) => blockIds(scheduler, 'r0', index)), [[0, 1, 2], [0, 1], [0, 1]]);
    assert.deepEqual(scheduler.kv.pool.blocks.slice(0, 3).map((block) => block.refCount), [3, 3, 1]);
    scheduler.checkInvariants();

    // Each fork recomputes the two prompt tokens of the partial block, then its own token, into a block of its own.
    const second = step(scheduler, 2, perSample);
    assert.deepEqual(summary(second.plan), ['r0/0+1*1', 'r0/1+3*1', 'r0/2+3*1']);
    assert.deepEqual([0, 1, 2].map((index) => blockIds(scheduler, 'r0', index)), [[0, 1, 2], [0, 1, 3], [0, 1, 4]]);
    assert.deepEqual(request.sequences.map((sequence) => sequence.outputTokenIds), [[50, 50], [51, 51], [52, 52]]);
    scheduler.checkInvariants();
  });

  it('finishes each sample on its own and the request when the last one ends', () => {
    const scheduler = makeScheduler({ maxNumSeqs: 2 });
    const request = scheduler.addRequest(makeRequest('r0', prompt(0, 8), { sampling: { n: 2, maxTokens: 3 } }), 0);
    step(scheduler, 0, perSample);
    // A prompt filling whole blocks leaves no partial block: each fork feeds only its token.
    const second = step(scheduler, 0, (target) => (target.completionIndex === 1 ? EOS : 60));
    assert.deepEqual(summary(second.plan), ['r0/0+1*1', 'r0/1+1*1']);
    assert.deepEqual(second.result.outputs.map((output) => output.finishReason), [null, 'stop']);
    assert.deepEqual(second.result.finishedRequests, []);
    assert.equal(request.sequences[1]!.status, 'finished_stopped');
    const third = step(scheduler);
    assert.deepEqual(summary(third.plan), ['r0/0+1*1']);
    assert.deepEqual(third.result.finishedRequests, [request]);
    assert.deepEqual(request.sequences.map((sequence) => sequence.outputTokenIds), [[50, 60, 7], [51, EOS]]);
    assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
    scheduler.checkInvariants();
  });

  it('reserves a seat per sample from admission, so the forks always fit the batch', () => {
    const scheduler = makeScheduler({ maxNumSeqs: 3 });
    scheduler.addRequest(makeRequest('multi', prompt(0, 4), { sampling: { n: 3 } }), 0);
    scheduler.addRequest(makeRequest('single', prompt(1, 4)), 0);
    assert.deepEqual(summary(step(scheduler, 0, perSample).plan), ['multi/0+4*3']);
    assert.equal(scheduler.numWaiting, 1);
  });

  it('stops one sample on a stop string and aborts the rest', () => {
    const scheduler = makeScheduler({ maxNumSeqs: 2 });
    scheduler.addRequest(makeRequest('r0', prompt(0, 5), { sampling: { n: 2 } }), 0);
    step(scheduler, 0, perSample);
    assert.equal(scheduler.finish('r0', 'stop', { index: 0 }), false);
    assert.deepEqual(summary(step(scheduler, 0, perSample).plan), ['r0/1+2*1']);
    assert.equal(scheduler.abort('r0'), true);
    assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
    scheduler.checkInvariants();
  });

  it('resumes a preempted fork from the shared prompt blocks and its own cached block', () => {
    // 2 samples of a 9-token prompt in a pool of 5 blocks: the prompt takes 0-2 and fork 1 recomputes into 3; at
    // position 12 sequence 0 takes the last block and fork 1 (ranked after it) is preempted.
    const scheduler = makeScheduler({ numBlocks: 5, maxNumSeqs: 2 });
    const request = scheduler.addRequest(makeRequest('r0', prompt(0, 9), { sampling: { n: 2, maxTokens: 6 } }), 0);
    const plans: string[][] = [];
    const preempted: number[] = [];
    while (scheduler.numRequests > 0) {
      const { plan } = step(scheduler, 0, perSample);
      plans.push(summary(plan));
      preempted.push(...plan.preempted.map((sequence) => sequence.index));
      scheduler.checkInvariants();
    }
    assert.deepEqual(plans, [
      ['r0/0+9*2'], ['r0/0+1*1', 'r0/1+2*1'], ['r0/0+1*1', 'r0/1+1*1'], ['r0/0+1*1', 'r0/1+1*1'],
      ['r0/0+1*1'], ['r0/0+1*1'], ['r0/1+1*1'], ['r0/1+1*1'],
    ]);
    assert.deepEqual(preempted, [1]);
    // Resumed with 13 tokens, fork 1 found 12: two shared prompt blocks and the block it had filled itself.
    assert.equal(scheduler.kv.stats().prefixHitTokens, 12);
    assert.deepEqual(request.sequences.map((sequence) => sequence.outputTokenIds), [[50, 50, 50, 50, 50, 50], [51, 51, 51, 51, 51, 51]]);
    assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
  });
});
