// A worker's memory by category and its allocation failures, as EngineCore.stats() reports them and the metrics
// module exports them (conduit_memory_used_bytes, conduit_oom_events_total, conduit_kv_block_shortfalls_total): KV blocks the pool did not have
// (a tiny pool forces preemption), and a step whose native scratch could not be allocated (the test-only scratch
// limit): its request fails, the worker goes on serving.
import assert from 'node:assert/strict';
import { before, describe, it } from 'node:test';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import { nativeBackend } from '../../src/kernels/native.ts';
import { referenceBackend } from '../../src/kernels/reference-backend.ts';
import type { BackendFactory, BackendLoadOptions } from '../../src/kernels/types.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';
import { ConduitMetrics } from '../../src/telemetry/metrics.ts';
import { tinySyntheticModel } from '../helpers/cpu-model.ts';
import { parseExposition, value } from '../telemetry/exposition.ts';
import { skipNative } from '../kernels/native-harness.ts';

let model: LoadedModel;

function makeCore(backend: BackendFactory, kv: { numBlocks: number; blockSize: number }, options: BackendLoadOptions = {}, maxNumSeqs = 8): EngineCore {
  const runner = backend.load(model.config, model.weights, { ...kv, dtype: 'f32' }, { threads: 1, ...options });
  let clock = 0;
  return new EngineCore({
    backend: runner, tokenizer: createTokenizer(model.tokenizerSource), maxNumSeqs, maxNumBatchedTokens: 512,
    maxModelLen: model.config.contextLength, enablePrefixCaching: false, now: () => clock++,
  });
}

function request(id: string, promptTokens: number, maxTokens: number): EngineRequest {
  return {
    id, promptTokenIds: Array.from({ length: promptTokens }, (_, i) => 10 + ((i * 7 + id.length) % 200)),
    sampling: { ...DEFAULT_SAMPLING, maxTokens, ignoreEos: true, temperature: 0 }, priority: 0, arrivalMs: 0,
  };
}

/** Steps until nothing is left (bounded); every output. */
function drain(core: EngineCore): EngineOutput[] {
  const outputs: EngineOutput[] = [];
  for (let i = 0; i < 2000 && core.hasWork; i++) outputs.push(...core.step());
  assert.equal(core.hasWork, false, 'the engine finished its requests within 2000 steps');
  return outputs;
}

async function exposition(metrics: ConduitMetrics) {
  return parseExposition(await metrics.render());
}

describe('memory and allocation failures in a worker\'s stats and metrics', () => {
  before(async () => {
    model = await loadModel(tinySyntheticModel());
  });

  it('a KV pool too small for the batch: each shortfall counted (kv_blocks), preemptions follow', async () => {
    // 6 blocks of 16 slots; four requests of 10 + 40 tokens need 4 x 4 blocks.
    const core = makeCore(referenceBackend, { numBlocks: 6, blockSize: 16 }, {}, 4);
    for (let i = 0; i < 4; i++) core.add(request(`r${i}`, 10, 40));
    const outputs = drain(core);
    assert.equal(outputs.filter((o) => o.finishReason === 'length').length, 4, 'every request finished');
    const stats = core.stats();
    assert.ok(stats.preemptions > 0, 'requests were preempted');
    const shortfalls = stats.allocationFailures!.kvBlocks;
    assert.ok(shortfalls > 0 && shortfalls <= stats.preemptions, `${shortfalls} shortfalls, ${stats.preemptions} preemptions`);
    assert.equal(stats.allocationFailures!.scratch, 0);

    const metrics = new ConduitMetrics();
    metrics.updateFromEngineStats({ worker: 'w0', stats });
    metrics.updateFromEngineStats({ worker: 'w0', stats: core.stats() });
    const e = await exposition(metrics);
    assert.equal(value(e, 'conduit_kv_block_shortfalls_total', { worker: 'w0' }), shortfalls, 'counted once, not per snapshot');
    assert.equal(value(e, 'conduit_oom_events_total', { worker: 'w0', kind: 'scratch' }), 0, 'a shortfall is not an OOM event');
    // The reference backend: its f32 weights and the pool; no buffers kept between steps, only the engine's own.
    const memory = stats.memory!;
    assert.equal(value(e, 'conduit_memory_used_bytes', { worker: 'w0', category: 'weights' }), memory.weightsBytes);
    assert.equal(value(e, 'conduit_memory_used_bytes', { worker: 'w0', category: 'kv_cache' }), 6 * 16 * 2 * model.config.numLayers * model.config.numKvHeads * model.config.headDim * 4);
    assert.equal(value(e, 'conduit_memory_used_bytes', { worker: 'w0', category: 'activations' }), memory.activationsBytes);
    assert.ok(memory.activationsBytes! >= 4 * model.config.vocabSize * 4, 'the logits of four rows');

    metrics.forgetWorker('w0');
    assert.equal(value(await exposition(metrics), 'conduit_memory_used_bytes', { worker: 'w0', category: 'weights' }), undefined,
      'a departed worker\'s memory series are removed');
  });

  it('a step whose native scratch cannot be allocated: its request fails, counted (scratch), the next one runs', { skip: skipNative }, async () => {
    const { dim, numHeads, numKvHeads, headDim, ffnDim } = model.config;
    const rowBytes = 4 * (3 * dim + 2 * numHeads * headDim + 2 * numKvHeads * headDim + 2 * ffnDim);
    const core = makeCore(nativeBackend, { numBlocks: 32, blockSize: 16 }, { scratchLimitBytes: 8 * rowBytes, packWeights: false });
    core.add(request('long', 64, 4));
    const failed = drain(core);
    assert.equal(failed.length, 1);
    assert.equal(failed[0]!.finishReason, 'error');
    assert.match(failed[0]!.error ?? '', /^out of memory: .*forward: out of memory/);
    assert.equal(failed[0]!.errorCode, 'out_of_memory');
    core.add(request('short', 4, 6));
    const served = drain(core);
    assert.equal(served.at(-1)!.finishReason, 'length');
    assert.equal(served.flatMap((o) => o.newTokenIds).length, 6);

    const stats = core.stats();
    assert.deepEqual(stats.allocationFailures, { kvBlocks: 0, scratch: 1 });
    // Activations: the native buffers of the largest step that ran (4 rows), the logits buffer, the batch arrays.
    assert.ok(stats.memory!.activationsBytes! >= 4 * rowBytes + model.config.vocabSize * 4, `${stats.memory!.activationsBytes} bytes`);
    const metrics = new ConduitMetrics();
    metrics.updateFromEngineStats({ worker: 'w1', stats });
    const e = await exposition(metrics);
    assert.equal(value(e, 'conduit_oom_events_total', { worker: 'w1', kind: 'scratch' }), 1);
    assert.equal(value(e, 'conduit_memory_used_bytes', { worker: 'w1', category: 'activations' }), stats.memory!.activationsBytes);
  });
});
