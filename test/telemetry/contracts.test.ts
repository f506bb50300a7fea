// The telemetry layer states the engine shapes it reads instead of importing them (it imports nothing); these
// assignments fail to type-check if the engine's contract drifts away from them, and the test shows the mapping a
// shell uses to turn an EngineOutput into an EngineReport.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import type { EngineOutput, EngineStats, RequestTimestamps } from '../../src/engine/types.ts';
import type { EngineReport, EngineTimestamps } from '../../src/telemetry/lifecycle.ts';
import type { EngineStatsLike } from '../../src/telemetry/metrics.ts';
import { buildRequestTrace } from '../../src/telemetry/trace.ts';
import { T0 } from './fixtures.ts';

function reportOf(output: EngineOutput, worker: string): EngineReport {
  const timestamps: EngineTimestamps = output.timestamps satisfies RequestTimestamps;
  return { worker, timestamps, cachedTokens: output.usage.cachedTokens };
}

describe('engine contracts', () => {
  it('accepts the engine\'s RequestTimestamps and EngineStats as they are', () => {
    const stats: EngineStats = { numRunning: 1, numWaiting: 2, kvBlocksUsed: 3, kvBlocksTotal: 4, prefixCacheQueries: 5, prefixCacheHits: 6, preemptions: 7 };
    const like: EngineStatsLike = stats;
    assert.equal(like.numWaiting, 2);

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
});
