import { test } from 'node:test';
import assert from 'node:assert/strict';
import { TimestampCompactor, TimestampExpander } from '../../src/engine/timestamp-changes.ts';
import type { EngineOutput, RequestTimestamps } from '../../src/engine/types.ts';

const output = (requestId: string, timestamps: RequestTimestamps, finishReason?: EngineOutput['finishReason'], index = 0): EngineOutput => ({
  requestId, index, newTokenIds: [1], textDelta: 'a', usage: { promptTokens: 2, completionTokens: 1, cachedTokens: 0 },
  timestamps, ...(finishReason !== undefined ? { finishReason } : {}),
});

/** The engine side's view of a sequence of messages, as they crossed (structured clone) from the worker's. */
function roundTrip(messages: EngineOutput[][], forget: (compactor: TimestampCompactor, expander: TimestampExpander, step: number) => void = () => {}) {
  const compactor = new TimestampCompactor();
  const expander = new TimestampExpander();
  const sent: { outputs: EngineOutput[]; changesAt?: number[] }[] = [];
  const received = messages.map((outputs, step) => {
    forget(compactor, expander, step);
    const posted = compactor.compact(outputs);
    sent.push(posted);
    const copy = structuredClone(posted);
    expander.expand(copy.outputs, copy.changesAt);
    return copy.outputs;
  });
  return { received, sent };
}

const decoding = (arrival: number, steps: number): RequestTimestamps => ({
  arrival, queued: arrival + 0.1, prefillChunks: [{ start: arrival + 1, end: arrival + 5, tokens: 16, batchSeqs: 1, batchTokens: 16 }],
  firstScheduled: arrival + 0.5, firstToken: arrival + 5, lastToken: arrival + 5 + steps,
  ...(steps > 0 ? { decodeSteps: { steps, lastStepId: steps, forwardMs: steps * 0.9, batchSeqsSum: steps, batchSeqsMin: 1, batchSeqsMax: 1, batchTokensSum: steps, batchTokensMin: 1, batchTokensMax: 1 } } : {}),
});

test('decode outputs carry only the changed fields, and the engine side rebuilds every timestamps object exactly', () => {
  const messages = [
    [output('a', decoding(100, 0))],
    [output('a', decoding(100, 1)), output('b', decoding(200, 0))],
    [output('a', decoding(100, 2)), output('b', decoding(200, 1))],
    [output('a', { ...decoding(100, 3), finished: 104 }, 'length'), output('b', decoding(200, 2))],
    [output('a', decoding(300, 0)), output('b', { ...decoding(200, 3), finished: 204 }, 'stop')],
  ];
  const { received, sent } = roundTrip(messages);
  assert.deepEqual(received, messages);
  // Whole: each request's first output, and 'a' again after it finished (a new request under the id).
  assert.equal(sent[0]!.changesAt, undefined);
  assert.deepEqual(sent[1]!.changesAt, [0]);
  assert.deepEqual(Object.keys(sent[1]!.outputs[0]!.timestamps).sort(), ['decodeSteps', 'lastToken']);
  assert.deepEqual(sent[2]!.changesAt, [0, 1]);
  assert.deepEqual(sent[4]!.changesAt, [1]);
  assert.deepEqual(Object.keys(sent[4]!.outputs[1]!.timestamps).sort(), ['decodeSteps', 'finished', 'lastToken']);
  // The worker's own outputs are never changed.
  assert.deepEqual(Object.keys(messages[1]![0]!.timestamps).length, Object.keys(decoding(100, 1)).length);
});

test('a field that disappears, or one set to undefined, crosses as it is', () => {
  const { queued: _queued, ...withoutQueued } = decoding(100, 2);
  const messages = [
    [output('a', decoding(100, 1))],
    [output('a', withoutQueued as RequestTimestamps)],
    [output('a', { ...decoding(100, 3), firstToken: undefined })],
  ];
  const { received, sent } = roundTrip(messages);
  assert.deepEqual(received, messages);
  assert.equal(sent[1]!.changesAt, undefined);
  assert.equal(Object.hasOwn(received[2]![0]!.timestamps, 'firstToken'), true);
});

test('two completions of one request in one message; a request the worker forgets goes whole next', () => {
  const messages = [
    [output('a', decoding(100, 0), undefined, 0), output('a', decoding(100, 0), undefined, 1)],
    [output('a', decoding(100, 1), undefined, 0), output('a', decoding(100, 1), undefined, 1)],
    [output('a', decoding(100, 2), undefined, 0), output('a', decoding(100, 2), undefined, 1)],
  ];
  const { received, sent } = roundTrip(messages, (compactor, _expander, step) => {
    if (step === 2) compactor.forget('a');
  });
  assert.deepEqual(received, messages);
  assert.deepEqual(sent[1]!.changesAt, [0, 1]);
  assert.deepEqual(sent[1]!.outputs[1]!.timestamps, {});
  assert.deepEqual(sent[2]!.changesAt, [1]);
});
