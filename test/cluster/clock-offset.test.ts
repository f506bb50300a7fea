// Moving a request's times between a frontend's clock and a worker's (src/cluster/clock-offset.ts): every absolute
// time moves by the offset, durations and counts do not, a time sent in and back out is unchanged, and the
// connection's estimate only ever tightens towards the true offset.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { shiftAdopted, shiftHandoff, shiftOutput, shiftRequest, shiftTimestamps, tightenClockOffset } from '../../src/cluster/clock-offset.ts';
import type { KvHandoff } from '../../src/engine/handoff.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type RequestTimestamps } from '../../src/engine/types.ts';

const timestamps: RequestTimestamps = {
  arrival: 100, queued: 101, firstScheduled: 102, firstToken: 110, lastToken: 150, finished: 151,
  prefillChunks: [{ start: 103, end: 105, tokens: 16, batchSeqs: 1, batchTokens: 16 }, { start: 106, end: 109, tokens: 8 }],
  kvTransfer: { start: 111, end: 112, bytes: 4096, blocks: 2 }, kvOnboard: { ram: 1, disk: 0, bytes: 2048, ms: 0.5 },
  queueDepthAtEntry: 3, budget: { tokens: 16, forwardStart: 102.5 },
  decodeSteps: { steps: 4, lastStepId: 9, forwardMs: 8, batchSeqsSum: 4, batchSeqsMin: 1, batchSeqsMax: 1, batchTokensSum: 4, batchTokensMin: 1, batchTokensMax: 1 },
};

describe('clock offsets between a frontend and a worker', () => {
  it('moves every absolute time of a request\'s timestamps and nothing else', () => {
    const shifted = shiftTimestamps(timestamps, 1000);
    assert.deepEqual(shifted, {
      ...timestamps, arrival: 1100, queued: 1101, firstScheduled: 1102, firstToken: 1110, lastToken: 1150, finished: 1151,
      prefillChunks: [{ start: 1103, end: 1105, tokens: 16, batchSeqs: 1, batchTokens: 16 }, { start: 1106, end: 1109, tokens: 8 }],
      kvTransfer: { start: 1111, end: 1112, bytes: 4096, blocks: 2 }, budget: { tokens: 16, forwardStart: 1102.5 },
    });
    assert.deepEqual(shiftTimestamps(shifted, -1000), timestamps, 'there and back is the identity');
    assert.equal(timestamps.arrival, 100, 'the original is not modified');
    const partial = shiftTimestamps({ arrival: 5, prefillChunks: [] }, 10);
    assert.deepEqual(partial, { arrival: 15, prefillChunks: [] }, 'absent stamps stay absent');
  });

  it('moves outputs (and their step), requests, handoffs and adoptions', () => {
    const output: EngineOutput = {
      requestId: 'r', index: 0, newTokenIds: [1], textDelta: 'a', usage: { promptTokens: 1, completionTokens: 1, cachedTokens: 0 },
      timestamps, step: { id: 3, start: 120, end: 125, batchSeqs: 2, batchTokens: 2 },
    };
    const out = shiftOutput(output, -50);
    assert.deepEqual(out.step, { id: 3, start: 70, end: 75, batchSeqs: 2, batchTokens: 2 });
    assert.equal(out.timestamps.firstToken, 60);
    assert.equal(output.step!.start, 120, 'the step object other outputs share is not modified');
    const request = { id: 'r', promptTokenIds: [1], sampling: DEFAULT_SAMPLING, priority: 0, arrivalMs: 100, deadlineMs: 300 };
    assert.deepEqual(shiftRequest(request, 7), { ...request, arrivalMs: 107, deadlineMs: 307 });
    const handoff = { requestId: 'r', request, timestamps, createdMs: 140 } as unknown as KvHandoff;
    const moved = shiftHandoff(handoff, 7);
    assert.equal(moved.createdMs, 147);
    assert.equal(moved.request.arrivalMs, 107);
    assert.equal(moved.timestamps.finished, 158);
    const adopted = shiftAdopted({ requestId: 'r', status: 'imported', transfer: { startMs: 10, endMs: 12, ms: 2 } as never }, 5);
    assert.deepEqual([adopted.transfer!.startMs, adopted.transfer!.endMs, adopted.transfer!.ms], [15, 17, 2]);
  });

  it('keeps the largest lower bound per connection, and ignores frames without a send time', () => {
    // True offset 5000 ms (frontend = worker + 5000); frames delayed 3, 0.5 and 2 ms on the way.
    let estimate: number | undefined;
    for (const [sentAt, delay] of [[10_000, 3], [10_100, 0.5], [10_200, 2]] as const) {
      estimate = tightenClockOffset(estimate, sentAt, sentAt - 5000 + delay);
    }
    assert.equal(estimate, 4999.5, 'the fastest frame\'s bound');
    assert.equal(tightenClockOffset(estimate, undefined, 1), 4999.5);
    assert.equal(tightenClockOffset(undefined, 'x', 1), undefined);
  });
});
