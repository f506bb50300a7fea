// What the step core shared by EngineCore and SimWorker guarantees beyond the end-to-end invariants: the logits
// buffer reaches the backend and is reused step after step, and each output's timestamps are a snapshot that later
// steps do not change (the real engine used to hand out the request's live object, the sim a copy).
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import { nativeBackend } from '../../src/kernels/native.ts';
import type { ForwardBatch, ModelRunnerBackend } from '../../src/kernels/types.ts';
import { SimWorker } from '../../src/sim/sim-worker.ts';
import { getHardwareProfile } from '../../src/sim/hardware.ts';
import { getModelProfile } from '../../src/sim/models.ts';
import { loadSharedModel, skipUnlessShared } from '../helpers/shared-models.ts';

const MODEL = 'stories260K.gguf';

function request(id: string, prompt: number[], maxTokens: number): EngineRequest {
  return { id, promptTokenIds: prompt, priority: 0, arrivalMs: 0, sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens, ignoreEos: true } };
}

const skipNative = skipUnlessShared(MODEL) || (nativeBackend.available() ? false : 'the native addon is not built');

describe('step core', () => {
  test('EngineCore hands the native forward one logits buffer, reused every step, with the same tokens as without it', { skip: skipNative }, async () => {
    const { loaded, tokenizer } = await loadSharedModel(MODEL);
    const run = (passBuffer: boolean) => {
      const backend = nativeBackend.load(loaded.config, loaded.weights, { numBlocks: 64, blockSize: 16, dtype: 'f32' }, { threads: 1 });
      const buffers: (Float32Array | undefined)[] = [];
      const results: Float32Array[] = [];
      const recording: ModelRunnerBackend = {
        ...backend,
        forward(batch: ForwardBatch, out?: Float32Array) {
          buffers.push(out);
          const logits = passBuffer ? backend.forward(batch, out) : backend.forward(batch);
          results.push(logits);
          return logits;
        },
      };
      let clock = 0;
      const core = new EngineCore({ backend: recording, tokenizer, maxNumSeqs: 8, maxNumBatchedTokens: 256, maxModelLen: 256, now: () => clock++ });
      core.add(request('a', [1, 20, 30, 40], 12));
      core.add(request('b', [1, 50, 60], 12));
      const tokens: number[] = [];
      for (let i = 0; core.hasWork && i < 100; i++) for (const o of core.step()) tokens.push(...o.newTokenIds);
      backend.dispose();
      return { buffers, results, tokens };
    };
    const reused = run(true);
    const fresh = run(false);
    assert.ok(reused.buffers.length > 2);
    const first = reused.buffers[0];
    assert.ok(first instanceof Float32Array && first.length >= 2 * loaded.config.vocabSize, 'the first step gets a buffer for its two rows');
    for (const buffer of reused.buffers) assert.equal(buffer, first, 'every step gets the same buffer');
    // The native forward wrote into that buffer rather than allocating.
    for (const logits of reused.results) assert.equal(logits.buffer, first.buffer);
    assert.deepEqual(reused.tokens, fresh.tokens);
  });

  test('an output\'s timestamps do not change after it is handed out (real engine)', { skip: skipUnlessShared(MODEL) }, async () => {
    const { loaded, tokenizer } = await loadSharedModel(MODEL);
    const { referenceBackend } = await import('../../src/kernels/reference-backend.ts');
    const backend = referenceBackend.load(loaded.config, loaded.weights, { numBlocks: 64, blockSize: 16, dtype: 'f32' }, { threads: 1 });
    let clock = 0;
    const core = new EngineCore({ backend, tokenizer, maxNumSeqs: 4, maxNumBatchedTokens: 256, maxModelLen: 256, now: () => clock++ });
    core.add(request('a', [1, 20, 30], 4));
    checkSnapshots(() => core.step(), () => core.hasWork);
    backend.dispose();
  });

  test('an output\'s timestamps do not change after it is handed out (sim worker)', () => {
    const worker = new SimWorker({ model: getModelProfile('llama-3.1-8b'), hw: getHardwareProfile('h100'), tp: 1, numKvBlocks: 64 });
    worker.add(request('a', [1, 20, 30], 4), 0);
    let now = 0;
    checkSnapshots(() => {
      const step = worker.beginStep(now)!;
      now = step.endMs;
      return worker.finishStep(step);
    }, () => worker.hasWork);
  });
});

function checkSnapshots(step: () => EngineOutput[], hasWork: () => boolean): void {
  const seen: { output: EngineOutput; json: string }[] = [];
  for (let i = 0; hasWork() && i < 100; i++) {
    for (const output of step()) seen.push({ output, json: JSON.stringify(output.timestamps) });
  }
  assert.equal(seen.length, 4);
  for (const { output, json } of seen) assert.equal(JSON.stringify(output.timestamps), json);
  assert.equal(seen[0]!.output.timestamps.finished, undefined);
  assert.notEqual(seen[3]!.output.timestamps.finished, undefined, 'the last output carries the finish time');
}
