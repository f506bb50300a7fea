// Step plan -> ForwardBatch: every array checked by hand against the block tables the scheduler assigned.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { BatchBuilder } from '../../src/engine/batch-builder.ts';
import { FILLER, makeRequest, makeScheduler, prompt, summary } from './scheduler-fixtures.ts';

describe('BatchBuilder', () => {
  it('lays out a decode and a prompt chunk back to back', () => {
    const scheduler = makeScheduler({ maxModelLen: 16 }); // blockSize 4 -> 4 block ids per row
    const builder = BatchBuilder.forScheduler(scheduler);
    scheduler.addRequest(makeRequest('a', prompt(0, 6)), 0);
    const first = scheduler.schedule(0);
    scheduler.updateFromOutput(first, [FILLER], 1);
    scheduler.addRequest(makeRequest('b', prompt(1, 5)), 1);

    const plan = scheduler.schedule(2);
    assert.deepEqual(summary(plan), ['a/0+1*1', 'b/0+5*1']); // a holds blocks [0, 1], b holds [2, 3]
    const batch = builder.build(plan);
    assert.equal(batch.numTokens, 6);
    assert.equal(batch.numSeqs, 2);
    assert.deepEqual([...batch.tokenIds], [FILLER, 2000, 2001, 2002, 2003, 2004]);
    assert.deepEqual([...batch.positions], [6, 0, 1, 2, 3, 4]);
    // slot = block * 4 + position % 4: a's position 6 is in block 1; b's positions 0-3 in block 2, 4 in block 3.
    assert.deepEqual([...batch.slotMapping], [6, 8, 9, 10, 11, 12]);
    assert.deepEqual([...batch.queryStartLoc], [0, 1, 6]);
    assert.deepEqual([...batch.seqLens], [7, 5]);
    assert.equal(batch.maxBlocksPerSeq, 4);
    assert.equal(batch.blockTables.length, 8);
    assert.deepEqual([...batch.blockTables.subarray(0, 2)], [0, 1]);
    assert.deepEqual([...batch.blockTables.subarray(4, 6)], [2, 3]);
    assert.deepEqual([...batch.logitsIndices], [0, 5]);
  });

  it('asks for no logits from a prompt chunk short of the end, and reuses its buffers', () => {
    const scheduler = makeScheduler({ maxNumBatchedTokens: 4, maxModelLen: 32 });
    const builder = BatchBuilder.forScheduler(scheduler);
    scheduler.addRequest(makeRequest('a', prompt(0, 7)), 0);
    const plan = scheduler.schedule(0);
    const batch = builder.build(plan);
    assert.deepEqual([...batch.positions], [0, 1, 2, 3]);
    assert.deepEqual([...batch.logitsIndices], []);
    scheduler.updateFromOutput(plan, [], 1);

    const rest = builder.build(scheduler.schedule(2));
    assert.deepEqual([...rest.positions], [4, 5, 6]);
    assert.deepEqual([...rest.slotMapping], [4, 5, 6]);
    assert.deepEqual([...rest.seqLens], [7]);
    assert.deepEqual([...rest.logitsIndices], [2]);
    assert.equal(rest.tokenIds.buffer, batch.tokenIds.buffer, 'no new allocation per step');
  });

  it('refuses a sequence whose blocks are gone', () => {
    const scheduler = makeScheduler();
    const builder = BatchBuilder.forScheduler(scheduler);
    scheduler.addRequest(makeRequest('a', prompt(0, 5)), 0);
    const plan = scheduler.schedule(0);
    scheduler.abort('a');
    assert.throws(() => builder.build(plan), /sequence a\/0 needs 2 blocks for 5 tokens but holds 0/);
  });

  it('rejects sizes it cannot hold', () => {
    assert.throws(() => new BatchBuilder({ blockSize: 16, maxNumBatchedTokens: 0, maxNumSeqs: 4, maxModelLen: 64 }),
      /maxNumBatchedTokens must be a positive integer, got 0/);
  });
});
