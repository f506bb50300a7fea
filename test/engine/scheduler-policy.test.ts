// Scheduling policies (order of admission, choice of preemption victim) and preemption by recompute.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import type { SchedulingPolicy } from '../../src/engine/types.ts';
import { FILLER, addAll, blockIds, makeRequest, makeScheduler, prompt, step, summary } from './scheduler-fixtures.ts';
import type { RequestOverrides } from './scheduler-fixtures.ts';

/** Admission order with one seat: each request runs alone (maxTokens 1) before the next is admitted. */
function admissionOrder(policy: SchedulingPolicy, requests: [string, RequestOverrides][]): string[] {
  const scheduler = makeScheduler({ policy, maxNumSeqs: 1 });
  requests.forEach(([id, overrides], i) => scheduler.addRequest(makeRequest(id, prompt(i, 3), { sampling: { maxTokens: 1 }, ...overrides }), 0));
  const order: string[] = [];
  for (let i = 0; i < requests.length; i++) order.push(...summary(step(scheduler).plan).map((entry) => entry.split('/')[0]!));
  return order;
}

describe('Scheduler policies', () => {
  it('fcfs serves by arrival time, then by the order requests reached the scheduler', () => {
    assert.deepEqual(admissionOrder('fcfs', [['a', { arrivalMs: 5 }], ['b', { arrivalMs: 3 }], ['c', { arrivalMs: 5, priority: -9 }]]),
      ['b', 'a', 'c']);
  });

  it('priority serves the lowest priority value first, then by arrival', () => {
    assert.deepEqual(admissionOrder('priority', [['a', { priority: 2, arrivalMs: 0 }], ['b', { priority: 0, arrivalMs: 1 }],
      ['c', { priority: 1, arrivalMs: 3 }], ['d', { priority: 1, arrivalMs: 2 }]]), ['b', 'd', 'c', 'a']);
  });

  it('deadline serves the nearest deadline first and requests without one last', () => {
    assert.deepEqual(admissionOrder('deadline', [['a', { deadlineMs: 50 }], ['b', { deadlineMs: 10 }], ['c', {}],
      ['d', { deadlineMs: 30, arrivalMs: 9 }], ['e', { deadlineMs: 30, arrivalMs: 1 }]]), ['b', 'e', 'd', 'a', 'c']);
  });

  it('rejects an unknown policy', () => {
    assert.throws(() => makeScheduler({ policy: 'random' as SchedulingPolicy }), /unknown scheduling policy "random"/);
  });
});

describe('Scheduler preemption', () => {
  // Pool of 5 blocks of 4: two 7-token prompts take 2 blocks each; the third block boundary (position 8) of both
  // comes at step 3, with 1 block left.
  it('preempts the latest arrival, which later resumes from its own cached blocks with its outputs kept', () => {
    const scheduler = makeScheduler({ numBlocks: 5 });
    addAll(scheduler, [makeRequest('r0', prompt(0, 7), { sampling: { maxTokens: 4 } }), makeRequest('r1', prompt(1, 7), { arrivalMs: 1, sampling: { maxTokens: 4 } })]);
    step(scheduler);
    step(scheduler, 0, (target) => (target.request.id === 'r1' ? 31 : FILLER));
    const r1 = scheduler.getRequest('r1')!;
    assert.deepEqual(blockIds(scheduler, 'r1'), [2, 3]);

    const third = step(scheduler);
    assert.deepEqual(summary(third.plan), ['r0/0+1*1']);
    assert.deepEqual(third.plan.preempted.map((sequence) => sequence.request.id), ['r1']);
    assert.equal(third.plan.stats.numPreempted, 1);
    assert.equal(r1.status, 'preempted');
    assert.deepEqual(r1.outputTokenIds, [FILLER, 31]);
    assert.deepEqual(blockIds(scheduler, 'r0'), [0, 1, 4]);
    // r1's blocks are free but still cached, tail first in eviction order.
    assert.deepEqual(scheduler.kv.pool.freeBlocksInEvictionOrder().map((block) => block.id), [3, 2]);
    scheduler.checkInvariants();

    const fourth = step(scheduler);
    assert.deepEqual(summary(fourth.plan), ['r0/0+1*1'], 'r1 waits: its 2 cached blocks are all the room there is');
    assert.equal(fourth.result.finishedRequests.length, 1);

    const fifth = step(scheduler);
    assert.deepEqual(summary(fifth.plan), ['r1/0+1*1']);
    assert.equal(fifth.plan.scheduled[0]!.startPosition, 8, 'prompt and first output come from the cache');
    assert.deepEqual(blockIds(scheduler, 'r1'), [2, 3, 4]);
    assert.equal(r1.numCachedTokens, 0, 'usage reports the first admission');
    step(scheduler);
    assert.deepEqual(r1.outputTokenIds, [FILLER, 31, FILLER, FILLER]);
    assert.equal(r1.status, 'finished');
    assert.equal(scheduler.stats().numPreemptions, 1);
    assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
  });

  // Admitted together, 'high' (7-token prompt) feeds position 8, a block boundary, at step 3; 'low' (6 tokens) does
  // not. Pool: exactly their 4 blocks.
  const contenders = [
    makeRequest('low', prompt(0, 6), { priority: 5, arrivalMs: 0 }),
    makeRequest('high', prompt(1, 7), { priority: 0, arrivalMs: 1 }),
  ];

  it('under fcfs, the latest arrival is the victim even if it is the one asking', () => {
    const scheduler = makeScheduler({ numBlocks: 4, policy: 'fcfs' });
    addAll(scheduler, contenders);
    step(scheduler);
    step(scheduler);
    const { plan } = step(scheduler);
    assert.deepEqual(summary(plan), ['low/0+1*1']);
    assert.deepEqual(plan.preempted.map((sequence) => sequence.request.id), ['high']);
  });

  it('under priority, the least important is the victim, even when already scheduled in this step', () => {
    const scheduler = makeScheduler({ numBlocks: 4, policy: 'priority' });
    scheduler.addRequest(contenders[0]!, 0);
    step(scheduler);
    // Admitted a step later, so 'low' comes first in the running order; 8 tokens put its boundary at step 3 too.
    scheduler.addRequest(makeRequest('high', prompt(1, 8), { priority: 0, arrivalMs: 1 }), 0);
    step(scheduler);
    const { plan } = step(scheduler);
    assert.deepEqual(summary(plan), ['high/0+1*1']);
    assert.equal(plan.numScheduledTokens, 1, 'the victim\'s tokens leave the step');
    assert.deepEqual(plan.preempted.map((sequence) => sequence.request.id), ['low']);
    assert.deepEqual(blockIds(scheduler, 'high'), [2, 3, 1]);
    scheduler.checkInvariants();
  });

  it('admits no waiting request in a step that preempted', () => {
    const scheduler = makeScheduler({ numBlocks: 4, policy: 'priority' });
    addAll(scheduler, contenders);
    step(scheduler);
    step(scheduler);
    scheduler.addRequest(makeRequest('tiny', [9], { priority: -1 }), 0);
    const { plan } = step(scheduler);
    assert.deepEqual(summary(plan), ['high/0+1*1']);
    assert.deepEqual(summary(step(scheduler).plan), ['high/0+1*1', 'tiny/0+1*1']);
  });
});

describe('Scheduler preemption: only for a request that can then run', () => {
  it('a seat is not freed by preemption for a request the KV pool could not hold even then', () => {
    const scheduler = makeScheduler({ policy: 'priority', numBlocks: 8, maxNumSeqs: 2, maxModelLen: 1000 });
    scheduler.addRequest(makeRequest('c', prompt(0, 15), { priority: 0, sampling: { maxTokens: 50 } }), 0); // 4 blocks
    scheduler.addRequest(makeRequest('a', prompt(1, 3), { priority: 2, sampling: { maxTokens: 50 } }), 0); // 1 block
    step(scheduler, 0);
    // b ranks between them and needs 5 blocks: the 3 free and a's 1-2 can never hold it while c runs.
    scheduler.addRequest(makeRequest('b', prompt(2, 20), { priority: 1, sampling: { maxTokens: 50 } }), 1);
    for (let t = 1; t < 5; t++) {
      const { plan } = step(scheduler, t);
      assert.deepEqual(plan.preempted.map((s) => s.request.id), [], `step ${t}: nobody preempted for b`);
      assert.deepEqual(summary(plan).map((e) => e.split('/')[0]).sort(), ['a', 'c']);
    }
    assert.equal(scheduler.stats().numPreemptions, 0);
    scheduler.checkInvariants();
  });

  it('a request\'s own free cached blocks are not counted as room a preemption could make', () => {
    const scheduler = makeScheduler({ policy: 'priority', numBlocks: 10, maxModelLen: 1000 });
    const long = prompt(3, 36);
    scheduler.addRequest(makeRequest('p', long.slice(0, 20), { sampling: { maxTokens: 1 } }), 0);
    step(scheduler, 0); // 5 cached blocks, free
    scheduler.addRequest(makeRequest('h', prompt(4, 9), { priority: 0, sampling: { maxTokens: 50 } }), 1); // 3 blocks
    scheduler.addRequest(makeRequest('l', prompt(5, 5), { priority: 2, sampling: { maxTokens: 50 } }), 1); // 2 blocks
    step(scheduler, 1);
    // s needs its 5 cached blocks and 4 fresh ones; the 5 free blocks are all its own prefix, and l's 2 are too few.
    scheduler.addRequest(makeRequest('s', long, { priority: 1, sampling: { maxTokens: 50 } }), 2);
    for (let t = 2; t < 5; t++) assert.deepEqual(step(scheduler, t).plan.preempted.map((s) => s.request.id), [], `step ${t}`);
    assert.equal(scheduler.getRequest('l')!.sequences[0]!.status, 'running');
    assert.equal(scheduler.stats().numPreemptions, 0);
    scheduler.checkInvariants();
  });

  it('blocks of a running request that the waiting one would take as its cached prefix are not counted as room either', () => {
    const scheduler = makeScheduler({ policy: 'priority', numBlocks: 10, maxModelLen: 1000 });
    const long = prompt(3, 36);
    scheduler.addRequest(makeRequest('h', prompt(4, 7), { priority: 0, sampling: { maxTokens: 50 } }), 0); // 2 blocks
    scheduler.addRequest(makeRequest('l', long.slice(0, 17), { priority: 2, sampling: { maxTokens: 50 } }), 0); // 5 blocks
    step(scheduler, 0);
    // s needs l's 4 cached prompt blocks and 5 fresh ones: preempting l frees 5 blocks, but 4 of them are s's own
    // prefix, so the room is the 3 free and l's last one, too few.
    scheduler.addRequest(makeRequest('s', long, { priority: 1, sampling: { maxTokens: 50 } }), 1);
    for (let t = 1; t < 4; t++) assert.deepEqual(step(scheduler, t).plan.preempted.map((s) => s.request.id), [], `step ${t}`);
    assert.equal(scheduler.getRequest('l')!.sequences[0]!.status, 'running');
    assert.equal(scheduler.getRequest('s')!.sequences[0]!.status, 'waiting');
    assert.equal(scheduler.stats().numPreemptions, 0);
    scheduler.checkInvariants();
  });

  it('blocks a running request shares with one ranked before the waiting request are not counted as room', () => {
    const scheduler = makeScheduler({ policy: 'priority', numBlocks: 10, maxModelLen: 1000 });
    const shared = prompt(3, 16);
    scheduler.addRequest(makeRequest('top', [...shared, 1], { priority: 0, sampling: { maxTokens: 50 } }), 0); // 5 blocks
    step(scheduler, 0);
    scheduler.addRequest(makeRequest('low', [...shared, 1, 2, 3, 4, 5], { priority: 2, sampling: { maxTokens: 50 } }), 1);
    step(scheduler, 1); // low: top's 4 cached blocks and 2 of its own
    // mid needs 6 fresh blocks: the 3 free and low's own 2 are too few; low's other 4 stay in use by top.
    scheduler.addRequest(makeRequest('mid', prompt(4, 24), { priority: 1, sampling: { maxTokens: 50 } }), 2);
    for (let t = 2; t < 4; t++) assert.deepEqual(step(scheduler, t).plan.preempted.map((s) => s.request.id), [], `step ${t}`);
    assert.equal(scheduler.getRequest('low')!.sequences[0]!.status, 'running');
    assert.equal(scheduler.getRequest('mid')!.sequences[0]!.status, 'waiting');
    assert.equal(scheduler.stats().numPreemptions, 0);
    scheduler.checkInvariants();
  });

  it('a request with n samples does not preempt for seats when those ranked after it hold fewer than it lacks', () => {
    const scheduler = makeScheduler({ policy: 'priority', maxNumSeqs: 3 });
    scheduler.addRequest(makeRequest('a', prompt(0, 4), { priority: 0, sampling: { maxTokens: 50 } }), 0);
    scheduler.addRequest(makeRequest('b', prompt(1, 4), { priority: 0, sampling: { maxTokens: 50 } }), 0);
    scheduler.addRequest(makeRequest('c', prompt(2, 4), { priority: 5, sampling: { maxTokens: 50 } }), 0);
    step(scheduler, 0);
    // w needs 3 seats; only c ranks after it, and its one seat would leave w short of two.
    scheduler.addRequest(makeRequest('w', prompt(3, 4), { priority: 1, sampling: { n: 3, maxTokens: 50 } }), 1);
    for (let t = 1; t < 4; t++) {
      const { plan } = step(scheduler, t);
      assert.deepEqual(plan.preempted.map((s) => s.request.id), [], `step ${t}`);
      assert.deepEqual(summary(plan).map((e) => e.split('/')[0]).sort(), ['a', 'b', 'c'], `step ${t}`);
    }
    assert.equal(scheduler.stats().numPreemptions, 0);
    scheduler.checkInvariants();
  });
});

describe('Scheduler preemption for a more urgent waiting request', () => {
  it('priority, no free seat: the running request ranked last is preempted and the waiting one admitted in its place', () => {
    const scheduler = makeScheduler({ policy: 'priority', maxNumSeqs: 1, enablePrefixCaching: false });
    scheduler.addRequest(makeRequest('low', prompt(0, 5), { priority: 5, sampling: { maxTokens: 4 } }), 0);
    step(scheduler);
    step(scheduler);
    scheduler.addRequest(makeRequest('high', prompt(1, 3), { priority: 0, arrivalMs: 1, sampling: { maxTokens: 2 } }), 0);
    const { plan } = step(scheduler);
    assert.deepEqual(summary(plan), ['high/0+3*1'], 'the victim\'s decode left the step');
    assert.deepEqual(plan.preempted.map((sequence) => sequence.request.id), ['low']);
    assert.equal(scheduler.getRequest('low')!.sequences[0]!.status, 'preempted');
    scheduler.checkInvariants();
    assert.deepEqual(summary(step(scheduler).plan), ['high/0+1*1']);
    // high finished; low recomputes its prompt and its two outputs, then finishes its four tokens.
    assert.deepEqual(summary(step(scheduler).plan), ['low/0+7*1']);
    step(scheduler);
    assert.equal(scheduler.getRequest('low'), undefined, 'low finished');
    assert.equal(scheduler.stats().numPreemptions, 1);
    assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
  });

  it('deadline, no free KV block: the later deadline is preempted for the earlier one', () => {
    // 4 blocks of 4: 'late' holds 3 (a 10-token prompt); 'soon' needs 2.
    const scheduler = makeScheduler({ policy: 'deadline', numBlocks: 4 });
    scheduler.addRequest(makeRequest('late', prompt(0, 10), { deadlineMs: 500 }), 0);
    step(scheduler);
    scheduler.addRequest(makeRequest('soon', prompt(1, 6), { deadlineMs: 100, arrivalMs: 1 }), 0);
    const { plan } = step(scheduler);
    assert.deepEqual(summary(plan), ['soon/0+6*1']);
    assert.deepEqual(plan.preempted.map((sequence) => sequence.request.id), ['late']);
    scheduler.checkInvariants();
  });

  it('fcfs never preempts for a waiting request, nor does priority for an equal or lower one; admission stops at a victim', () => {
    for (const [policy, priority] of [['fcfs', -5], ['priority', 0], ['priority', 3]] as const) {
      const scheduler = makeScheduler({ policy, maxNumSeqs: 1 });
      scheduler.addRequest(makeRequest('running', prompt(0, 3), { priority: 0 }), 0);
      step(scheduler);
      scheduler.addRequest(makeRequest('waiting', prompt(1, 3), { priority, arrivalMs: 1 }), 0);
      const { plan } = step(scheduler);
      assert.deepEqual(summary(plan), ['running/0+1*1'], `${policy} ${priority}`);
      assert.equal(plan.preempted.length, 0);
    }
    // Two seats, two running (priority 4 and 5), two waiting (0 and 6): 0 takes 5's seat; 6 ranks after the
    // victim, so it is not admitted (and the victim is not readmitted at once).
    const scheduler = makeScheduler({ policy: 'priority', maxNumSeqs: 2 });
    scheduler.addRequest(makeRequest('p4', prompt(0, 3), { priority: 4 }), 0);
    scheduler.addRequest(makeRequest('p5', prompt(1, 3), { priority: 5 }), 0);
    step(scheduler);
    scheduler.addRequest(makeRequest('p0', prompt(2, 3), { priority: 0 }), 0);
    scheduler.addRequest(makeRequest('p6', prompt(3, 3), { priority: 6 }), 0);
    const { plan } = step(scheduler);
    assert.deepEqual(summary(plan), ['p4/0+1*1', 'p0/0+3*1']);
    assert.deepEqual(plan.preempted.map((sequence) => sequence.request.id), ['p5']);
    assert.deepEqual(scheduler.sequences().waiting.map((sequence) => sequence.request.id), ['p5', 'p6']);
    scheduler.checkInvariants();
  });
});

describe('Scheduler preemption for a waiting request: the chunk admitted is the one the room was planned for', () => {
  // Blocks of 4, a step of 10 tokens, 2 seats, a pool of 5 blocks. 'top' (9-token prompt) holds 3 blocks and 'low'
  // (3-token prompt) 1, both decoding; 1 block is free. 'mid' waits with a 20-token prompt: the step has 8 tokens
  // left, a chunk of 2 blocks, which the free block and low's make room for. Preempting low for its seat gives its
  // decode token back to the step; a chunk of 9 would need a third block, which nobody can free.
  for (const policy of ['priority', 'deadline'] as const) {
    it(`${policy}: the victim's token given back does not grow the chunk past the room its preemption made`, () => {
      const scheduler = makeScheduler({ policy, numBlocks: 5, maxNumSeqs: 2, maxNumBatchedTokens: 10 });
      const rank = (value: number): RequestOverrides => (policy === 'priority' ? { priority: value } : { deadlineMs: 100 * (value + 1) });
      scheduler.addRequest(makeRequest('top', prompt(0, 9), { ...rank(0), sampling: { maxTokens: 50 } }), 0);
      step(scheduler, 0);
      scheduler.addRequest(makeRequest('low', prompt(1, 3), { ...rank(5), sampling: { maxTokens: 50 } }), 1);
      step(scheduler, 1);
      scheduler.addRequest(makeRequest('mid', prompt(2, 20), { ...rank(1), sampling: { maxTokens: 50 } }), 2);
      const { plan } = step(scheduler, 2);
      assert.deepEqual(plan.preempted.map((s) => s.request.id), ['low']);
      assert.deepEqual(summary(plan), ['top/0+1*1', 'mid/0+8'], 'mid admitted with the chunk the room was made for');
      assert.equal(scheduler.getRequest('mid')!.sequences[0]!.status, 'running');
      assert.equal(scheduler.getRequest('low')!.sequences[0]!.status, 'preempted');
      scheduler.checkInvariants();
    });
  }

  // The same with prompt-logprob rows: a step of 14 tokens and 10 rows, a pool of 6 blocks. 'top' (13-token prompt)
  // holds 4 blocks; 'low' (4-token prompt, scored) got the step's last token with it and now holds 1 block, its
  // remaining 3 tokens taking 2 rows. 'mid' (scored, 20 tokens) gets the 8 rows left, a chunk of 2 blocks: the free
  // one and low's. Preempting low gives its 2 rows back; a chunk of 10 would need a third block.
  it('priority: the victim\'s prompt-logprob rows given back do not grow the chunk past the room its preemption made', () => {
    const scheduler = makeScheduler({ policy: 'priority', numBlocks: 6, maxNumSeqs: 2, maxNumBatchedTokens: 14, maxPromptLogprobRows: 10 });
    scheduler.addRequest(makeRequest('top', prompt(0, 13), { priority: 0, sampling: { maxTokens: 50 } }), 0);
    scheduler.addRequest(makeRequest('low', prompt(1, 4), { priority: 5, sampling: { maxTokens: 50, promptLogprobs: 0 } }), 0);
    assert.deepEqual(summary(step(scheduler, 0).plan), ['top/0+13*1', 'low/0+1']);
    scheduler.addRequest(makeRequest('mid', prompt(2, 20), { priority: 1, sampling: { maxTokens: 50, promptLogprobs: 0 } }), 1);
    const { plan } = step(scheduler, 1);
    assert.deepEqual(plan.preempted.map((s) => s.request.id), ['low']);
    assert.deepEqual(summary(plan), ['top/0+1*1', 'mid/0+8'], 'mid admitted with the chunk the room was made for');
    assert.equal(plan.numPromptLogprobRows, 8);
    scheduler.checkInvariants();
  });
});
