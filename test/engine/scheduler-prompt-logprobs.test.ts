// The scheduler's side of prompt logprobs (sampling.promptLogprobs): such a prompt is computed whole (no prefix-cache
// hits, also after a preemption), its chunks are cut to the step's prompt-logprob rows, and each chunk names the
// positions whose logits rows the step returns.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { addAll, makeRequest, makeScheduler, prompt, step, summary } from './scheduler-fixtures.ts';

describe('scheduler with prompt logprobs', () => {
  test('chunks share the step\'s rows, and only positions before the prompt\'s last take one', () => {
    const scheduler = makeScheduler({ maxPromptLogprobRows: 5, maxNumBatchedTokens: 64 });
    addAll(scheduler, [
      makeRequest('a', prompt(0, 8), { sampling: { promptLogprobs: 1 } }),
      makeRequest('b', prompt(1, 4), { sampling: { promptLogprobs: 0 } }),
      makeRequest('plain', prompt(2, 9)),
    ]);
    // a takes all 5 rows with a chunk of 5; b waits for rows (admission stops there, first come first served).
    let { plan } = step(scheduler);
    assert.deepEqual(summary(plan), ['a/0+5']);
    assert.deepEqual(plan.scheduled.map((s) => s.numPromptLogprobRows), [5]);
    assert.equal(plan.numPromptLogprobRows, 5);
    // a's last 3 positions need 2 rows (its last position is sampled, not a prompt row); b gets the other 3 with its
    // whole prompt (4 positions, the last sampled); the plain request takes no row.
    ({ plan } = step(scheduler));
    assert.deepEqual(summary(plan), ['a/0+3*1', 'b/0+4*1', 'plain/0+9*1']);
    assert.deepEqual(plan.scheduled.map((s) => [s.startPosition, s.numPromptLogprobRows]), [[5, 2], [0, 3], [0, 0]]);
    assert.equal(plan.numPromptLogprobRows, 5);
    // Decoding needs no row.
    ({ plan } = step(scheduler));
    assert.equal(plan.numPromptLogprobRows, 0);
    scheduler.checkInvariants();
  });

  test('a prompt whose logprobs are wanted is computed whole even when its blocks are cached', () => {
    const scheduler = makeScheduler({ enablePrefixCaching: true, blockSize: 4 });
    const ids = prompt(0, 13);
    scheduler.addRequest(makeRequest('warm', ids, { sampling: { maxTokens: 1 } }), 0);
    while (scheduler.numRequests > 0) step(scheduler);
    scheduler.addRequest(makeRequest('cached', ids, { sampling: { maxTokens: 1 } }), 0);
    scheduler.addRequest(makeRequest('scored', ids, { sampling: { maxTokens: 1, promptLogprobs: 0 } }), 0);
    const { plan } = step(scheduler);
    // The plain request starts after its 3 cached blocks; the one with prompt logprobs at 0, a row for each of its
    // first 12 positions.
    assert.deepEqual(plan.scheduled.map((s) => [s.sequence.request.id, s.startPosition, s.numNewTokens, s.numPromptLogprobRows]),
      [['cached', 12, 1, 0], ['scored', 0, 13, 12]]);
    assert.equal(plan.scheduled[1]!.sequence.request.numCachedTokens, 0);
    scheduler.checkInvariants();
  });

  test('preempted before its first token, it recomputes the prompt from the start; a plain request resumes from the cache', () => {
    for (const promptLogprobs of [0, undefined]) {
      // One seat: a more important request takes it by preempting the one running (chunks of 4 leave it tokens).
      const scheduler = makeScheduler({
        policy: 'priority', enablePrefixCaching: true, blockSize: 4, maxNumBatchedTokens: 8, longPrefillTokenThreshold: 4, maxNumSeqs: 1,
      });
      const sampling = promptLogprobs === undefined ? {} : { promptLogprobs };
      scheduler.addRequest(makeRequest('long', prompt(0, 20), { priority: 1, sampling: { ...sampling, maxTokens: 1 } }), 0);
      let { plan } = step(scheduler);
      assert.deepEqual(summary(plan), ['long/0+4']);
      // A more important request preempts it (its full block stays cached).
      scheduler.addRequest(makeRequest('urgent', prompt(1, 4), { priority: 0, sampling: { maxTokens: 1 } }), 1);
      ({ plan } = step(scheduler, 1));
      assert.deepEqual(plan.preempted.map((s) => s.request.id), ['long']);
      while (scheduler.getRequest('urgent') !== undefined) step(scheduler, 2);
      ({ plan } = step(scheduler, 3));
      const entry = plan.scheduled.find((s) => s.sequence.request.id === 'long')!;
      if (promptLogprobs === undefined) {
        assert.equal(entry.startPosition, 4, 'a plain request takes its cached block back');
      } else {
        assert.equal(entry.startPosition, 0, 'the prompt-logprob request computes every position again');
        assert.equal(entry.numPromptLogprobRows, 4);
      }
      scheduler.checkInvariants();
    }
  });
});
