// The scheduler's step loop: prefill to decode to finish, stop conditions, budgets, chunking, prefix hits, rejection.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { InvalidRequestError } from '../../src/engine/errors.ts';
import { EOS, FILLER, addAll, blockIds, makeRequest, makeRequests, makeScheduler, prompt, step, summary } from './scheduler-fixtures.ts';

describe('Scheduler: one request', () => {
  it('computes the prompt, decodes one token per step and finishes at max_tokens with every block freed', () => {
    const scheduler = makeScheduler();
    const request = scheduler.addRequest(makeRequest('r0', prompt(0, 6), { sampling: { maxTokens: 3 }, arrivalMs: 5 }), 10);

    const first = step(scheduler, 20);
    assert.deepEqual(summary(first.plan), ['r0/0+6*1']);
    assert.equal(first.plan.scheduled[0]!.isDecode, false);
    assert.deepEqual(blockIds(scheduler, 'r0'), [0, 1]);
    assert.deepEqual(first.result.outputs, [{ requestId: 'r0', index: 0, newTokenIds: [FILLER], finishReason: null, stopReason: null }]);
    assert.equal(request.numComputedTokens, 6);

    const second = step(scheduler, 30);
    assert.deepEqual(summary(second.plan), ['r0/0+1*1']);
    assert.equal(second.plan.scheduled[0]!.startPosition, 6);
    assert.equal(second.plan.scheduled[0]!.isDecode, true);

    const third = step(scheduler, 40, () => 11);
    assert.equal(third.result.outputs[0]!.finishReason, 'length');
    assert.deepEqual(third.result.finishedRequests, [request]);
    assert.deepEqual(request.outputTokenIds, [FILLER, FILLER, 11]);
    assert.equal(request.sequences[0]!.status, 'finished_length');
    assert.equal(scheduler.getRequest('r0'), undefined);
    assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
    assert.deepEqual(request.timestamps, {
      arrival: 5, queued: 10, queueDepthAtEntry: 0, firstScheduled: 20, budget: { tokens: 6, forwardStart: 20 },
      prefillChunks: [{ start: 20, end: 21, tokens: 6, batchSeqs: 1, batchTokens: 6 }],
      firstToken: 21, lastToken: 41, finished: 41,
      decodeSteps: {
        steps: 2, lastStepId: 3, forwardMs: 2, batchSeqsSum: 2, batchSeqsMin: 1, batchSeqsMax: 1,
        batchTokensSum: 2, batchTokensMin: 1, batchTokensMax: 1,
      },
    });
    scheduler.checkInvariants();
  });

  it('stops on EOS only after min_tokens outputs', () => {
    const scheduler = makeScheduler();
    const request = scheduler.addRequest(makeRequest('r0', prompt(0, 3), { sampling: { minTokens: 2 } }), 0);
    const reasons = [1, 2, 3].map(() => step(scheduler, 0, () => EOS).result.outputs[0]!.finishReason);
    assert.deepEqual(reasons, [null, null, 'stop']);
    assert.deepEqual(request.outputTokenIds, [EOS, EOS, EOS]);
    assert.equal(request.sequences[0]!.stopReason, EOS);
  });

  it('ignores EOS with ignore_eos but still stops on stop_token_ids', () => {
    const scheduler = makeScheduler();
    const request = scheduler.addRequest(makeRequest('r0', prompt(0, 3), { sampling: { ignoreEos: true, stopTokenIds: [9] } }), 0);
    const tokens = [EOS, EOS, 9];
    const reasons = tokens.map((token) => step(scheduler, 0, () => token).result.outputs[0]!);
    assert.deepEqual(reasons.map((output) => output.finishReason), [null, null, 'stop']);
    assert.equal(reasons[2]!.stopReason, 9);
    assert.deepEqual(request.outputTokenIds, tokens);
  });

  it('finishes with length at the context limit', () => {
    const scheduler = makeScheduler({ maxModelLen: 10 });
    const request = scheduler.addRequest(makeRequest('r0', prompt(0, 8)), 0);
    step(scheduler);
    const { result } = step(scheduler);
    assert.equal(result.outputs[0]!.finishReason, 'length');
    assert.equal(request.sequences[0]!.numTokens, 10);
  });

  it('caps the context limit so that one sequence always fits the pool', () => {
    const scheduler = makeScheduler({ numBlocks: 4, blockSize: 4, maxModelLen: 256 });
    assert.equal(scheduler.maxModelLen, 17);
    const request = scheduler.addRequest(makeRequest('r0', prompt(0, 16)), 0);
    const { plan, result } = step(scheduler);
    assert.deepEqual(summary(plan), ['r0/0+16*1']);
    assert.equal(result.outputs[0]!.finishReason, 'length');
    assert.equal(request.outputTokenIds.length, 1);
  });

  it('rejects what could never run, with a code and a message naming the problem', () => {
    const scheduler = makeScheduler({ numBlocks: 4, blockSize: 4, maxModelLen: 12, maxNumSeqs: 2 });
    const rejects = (request: ReturnType<typeof makeRequest>, code: string, message: RegExp): void => {
      assert.throws(() => scheduler.addRequest(request, 0), (error: unknown) =>
        error instanceof InvalidRequestError && error.code === code && message.test(error.message));
    };
    rejects(makeRequest('big', prompt(0, 17)), 'prompt_exceeds_kv_pool', /17 tokens can never fit the KV pool \(4 blocks x 4 tokens = 16\)/);
    rejects(makeRequest('long', prompt(0, 12)), 'prompt_too_long', /12 tokens leaves no room for output within the context length 12/);
    rejects(makeRequest('empty', []), 'invalid_request', /promptTokenIds must be a non-empty array/);
    rejects(makeRequest('neg', [5, -1]), 'invalid_request', /promptTokenIds\[1\] is -1/);
    rejects(makeRequest('many', prompt(0, 3), { sampling: { n: 3 } }), 'too_many_samples', /n = 3 is more than one engine batch holds \(--max-num-seqs 2\)/);
    rejects(makeRequest('zero', prompt(0, 3), { sampling: { maxTokens: 0 } }), 'invalid_request', /maxTokens must be a positive integer/);
    scheduler.addRequest(makeRequest('ok', prompt(0, 3)), 0);
    rejects(makeRequest('ok', prompt(1, 3)), 'duplicate_request_id', /already scheduled/);
    assert.equal(scheduler.numRequests, 1);
  });

  it('refuses to schedule again before the outstanding step is applied or discarded', () => {
    const scheduler = makeScheduler();
    scheduler.addRequest(makeRequest('r0', prompt(0, 5)), 0);
    const plan = scheduler.schedule(0);
    assert.throws(() => scheduler.schedule(1), /step 1 is still outstanding/);
    assert.throws(() => scheduler.updateFromOutput(plan, [], 1), /samples 1 rows; got 0 token ids/);
    scheduler.discardPlan(plan);
    const again = scheduler.schedule(2);
    assert.deepEqual(summary(again), ['r0/0+5*1'], 'a discarded step counts as not computed');
    assert.throws(() => scheduler.updateFromOutput(plan, [FILLER], 3), /step 1 is not the outstanding step/);
    scheduler.updateFromOutput(again, [FILLER], 3);
    scheduler.checkInvariants();
  });

  it('lets an empty plan be skipped, applied or discarded alike', () => {
    const scheduler = makeScheduler();
    const empty = scheduler.schedule(0);
    assert.equal(empty.scheduled.length, 0);
    scheduler.discardPlan(empty);
    assert.deepEqual(scheduler.updateFromOutput(empty, [], 1), { outputs: [], finishedRequests: [] });
    assert.equal(scheduler.schedule(2).stepId, 2);
  });
});

describe('Scheduler: budgets and chunked prefill', () => {
  it('fills the token budget with decodes first, then prompt chunks; a chunk short of the end is not sampled', () => {
    const scheduler = makeScheduler({ maxNumBatchedTokens: 10 });
    addAll(scheduler, makeRequests(3, 6));
    const first = step(scheduler);
    assert.deepEqual(summary(first.plan), ['r0/0+6*1', 'r1/0+4']);
    assert.equal(first.plan.sampleTargets.length, 1);
    assert.deepEqual(first.plan.stats, {
      numRunning: 2, numWaiting: 1, numScheduledSeqs: 2, numScheduledTokens: 10, numPrefillTokens: 10, numDecodeTokens: 0,
      numAdmitted: 2, numPreempted: 0, kvUsedBlocks: 3, kvTotalBlocks: 64,
    });
    assert.deepEqual(first.result.outputs.map((output) => output.requestId), ['r0']);
    const second = step(scheduler);
    assert.deepEqual(summary(second.plan), ['r0/0+1*1', 'r1/0+2*1', 'r2/0+6*1']);
    assert.equal(second.plan.stats.numDecodeTokens, 1);
    assert.equal(second.plan.scheduled[1]!.startPosition, 4);
    assert.deepEqual(summary(step(scheduler).plan), ['r0/0+1*1', 'r1/0+1*1', 'r2/0+1*1']);
    scheduler.checkInvariants();
  });

  it('caps one prompt chunk at longPrefillTokenThreshold', () => {
    const scheduler = makeScheduler({ longPrefillTokenThreshold: 4 });
    addAll(scheduler, makeRequests(2, 10));
    assert.deepEqual(summary(step(scheduler).plan), ['r0/0+4', 'r1/0+4']);
    assert.deepEqual(summary(step(scheduler).plan), ['r0/0+4', 'r1/0+4']);
    assert.deepEqual(summary(step(scheduler).plan), ['r0/0+2*1', 'r1/0+2*1']);
    const request = scheduler.getRequest('r0')!;
    assert.deepEqual(request.timestamps.prefillChunks.map((chunk) => chunk.tokens), [4, 4, 2]);
  });

  it('admits no more sequences than maxNumSeqs', () => {
    const scheduler = makeScheduler({ maxNumSeqs: 2 });
    addAll(scheduler, makeRequests(3, 4, { sampling: { maxTokens: 2 } }));
    assert.deepEqual(summary(step(scheduler).plan), ['r0/0+4*1', 'r1/0+4*1']);
    const second = step(scheduler);
    assert.deepEqual(summary(second.plan), ['r0/0+1*1', 'r1/0+1*1']);
    assert.equal(second.result.finishedRequests.length, 2);
    assert.deepEqual(summary(step(scheduler).plan), ['r2/0+4*1']);
  });

  it('admits in order and lets nobody overtake a request that does not fit', () => {
    const scheduler = makeScheduler({ numBlocks: 4, blockSize: 4 });
    addAll(scheduler, [makeRequest('big', prompt(0, 6), { arrivalMs: 0 }), makeRequest('huge', prompt(1, 12), { arrivalMs: 1 }),
      makeRequest('small', prompt(2, 2), { arrivalMs: 2 })]);
    assert.deepEqual(summary(step(scheduler).plan), ['big/0+6*1']);
    assert.equal(scheduler.numWaiting, 2);
  });
});

describe('Scheduler: prefix caching', () => {
  it('starts a request with the same prompt from the cached blocks and recomputes the last token', () => {
    const scheduler = makeScheduler({ enableEvents: true });
    scheduler.addRequest(makeRequest('r0', prompt(0, 10), { sampling: { maxTokens: 2 } }), 0);
    step(scheduler);
    assert.deepEqual(blockIds(scheduler, 'r0'), [0, 1, 2]);
    const later = scheduler.addRequest(makeRequest('r1', prompt(0, 10)), 0);
    const { plan } = step(scheduler);
    assert.deepEqual(summary(plan), ['r0/0+1*1', 'r1/0+2*1']);
    assert.equal(plan.scheduled[1]!.startPosition, 8);
    assert.equal(later.numCachedTokens, 8);
    assert.deepEqual(blockIds(scheduler, 'r1'), [0, 1, 3]);
    const events = scheduler.kv.takeEvents();
    assert.deepEqual(events.map((event) => event.type), ['stored']);
    assert.equal(scheduler.kv.stats().prefixHitTokens, 8);
    scheduler.checkInvariants();
  });

  it('reuses the blocks of a finished request', () => {
    const scheduler = makeScheduler();
    scheduler.addRequest(makeRequest('r0', prompt(0, 9), { sampling: { maxTokens: 1 } }), 0);
    step(scheduler);
    assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
    const again = scheduler.addRequest(makeRequest('r1', [...prompt(0, 8), 5, 5, 5]), 0);
    assert.deepEqual(summary(step(scheduler).plan), ['r1/0+3*1']);
    assert.equal(again.numCachedTokens, 8);
    assert.deepEqual(blockIds(scheduler, 'r1').slice(0, 2), [0, 1]);
  });
});
