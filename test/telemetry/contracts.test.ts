// The telemetry layer states the per-request engine shapes it reads (EngineTimestamps) instead of importing them;
// these assignments fail to type-check if the engine's contract drifts away from them, and the test shows the
// mapping a shell uses to turn an EngineOutput into an EngineReport. Engine statistics and step summaries it takes
// from src/protocols/worker.ts, as the engine does.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import type { EngineOutput, RequestTimestamps } from '../../src/engine/types.ts';
import type { EngineReport, EngineTimestamps } from '../../src/telemetry/lifecycle.ts';
import { buildRequestTrace } from '../../src/telemetry/trace.ts';
import { T0 } from './fixtures.ts';

function reportOf(output: EngineOutput, worker: string): EngineReport {
  const timestamps: EngineTimestamps = output.timestamps satisfies RequestTimestamps;
  return { worker, timestamps, cachedTokens: output.usage.cachedTokens, ...(output.traceparent !== undefined ? { traceparent: output.traceparent } : {}) };
}

describe('engine contracts', () => {
  it('accepts the engine\'s RequestTimestamps as they are', () => {
    const output: EngineOutput = {
      requestId: 'r', index: 0, newTokenIds: [5], textDelta: 'x', finishReason: 'stop',
      usage: { promptTokens: 32, completionTokens: 2, cachedTokens: 16 },
      timestamps: { arrival: T0, queued: T0 + 1, firstScheduled: T0 + 2, prefillChunks: [{ start: T0 + 2, end: T0 + 9, tokens: 16 }], firstToken: T0 + 9, lastToken: T0 + 20, finished: T0 + 20 },
    };
    const trace = buildRequestTrace([
      { phase: 'finish', requestId: 'r', time: T0 + 21, finishReason: 'stop', promptTokens: 32, outputTokens: 2, model: 'm', engine: reportOf(output, 'w0') },
    ]);
    assert.equal(trace.arrivalMs, T0);
    assert.equal(trace.worker, 'w0');
    assert.equal(trace.ttftMs, 9);
    assert.equal(trace.cachedTokens, 16);
    assert.equal(trace.phases.find((p) => p.phase === 'scheduler_queue')?.endMs, T0 + 2);
  });

  it('reads the engine\'s step facts, queue depth, budget and traceparent', () => {
    const traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';
    const output: EngineOutput = {
      requestId: 'r', index: 0, newTokenIds: [5], textDelta: 'x', finishReason: 'length', traceparent,
      step: { id: 12, start: T0 + 18, end: T0 + 20, batchSeqs: 3, batchTokens: 3 },
      usage: { promptTokens: 32, completionTokens: 3, cachedTokens: 16 },
      timestamps: {
        arrival: T0, queued: T0 + 1, queueDepthAtEntry: 4, firstScheduled: T0 + 2, budget: { tokens: 16, forwardStart: T0 + 2.5 },
        prefillChunks: [{ start: T0 + 2.5, end: T0 + 9, tokens: 16, batchSeqs: 2, batchTokens: 17 }], firstToken: T0 + 9, lastToken: T0 + 20,
        finished: T0 + 20,
        decodeSteps: {
          steps: 2, lastStepId: 12, forwardMs: 3, batchSeqsSum: 5, batchSeqsMin: 2, batchSeqsMax: 3,
          batchTokensSum: 5, batchTokensMin: 2, batchTokensMax: 3,
        },
      },
    };
    const trace = buildRequestTrace([
      { phase: 'finish', requestId: 'r', time: T0 + 21, finishReason: 'length', promptTokens: 32, outputTokens: 3, model: 'm', engine: reportOf(output, 'w0') },
    ]);
    assert.equal(trace.queueDepthAtEntry, 4);
    assert.equal(trace.budgetMs, 0.5);
    assert.equal(trace.budgetTokens, 16);
    assert.equal(trace.engineTraceparent, traceparent);
    assert.equal(trace.prefill!.batchSizeMax, 2);
    assert.deepEqual(trace.decode!.batch, {
      steps: 2, seqsMean: 2.5, seqsMin: 2, seqsMax: 3, tokensMean: 2.5, tokensMin: 2, tokensMax: 3, forwardMs: 3,
    });
    assert.equal(trace.decode!.steps, 2, 'the engine counted its decode steps');
  });
});
