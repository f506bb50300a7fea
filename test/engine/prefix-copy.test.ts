// A prompt whose every token is in the prefix cache computes only its last token: the cached block that token ends
// is copied into a fresh block (copy-on-write) instead of being recomputed. Checked in the scheduler (the plan,
// pins, aborts, n > 1) and end to end on every backend (same tokens as the cold run, cached bytes untouched).
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { readKvBlocks } from '../../src/engine/handoff.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest, type SamplingParams } from '../../src/engine/types.ts';
import type { BackendFactory } from '../../src/kernels/types.ts';
import { engineBackends } from '../helpers/backends.ts';
import { loadSharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { blockIds, makeRequest, makeScheduler, prompt, step, summary } from './scheduler-fixtures.ts';

describe('Scheduler: copy-on-write of a fully cached prompt', () => {
  test('a repeated prompt ending on a block boundary computes its last token into a copy of the cached block', () => {
    const scheduler = makeScheduler({ blockSize: 4 });
    scheduler.addRequest(makeRequest('a', prompt(0, 8), { sampling: { maxTokens: 1 } }), 0);
    assert.deepEqual(summary(step(scheduler).plan), ['a/0+8*1']);
    const cachedIds = [...scheduler.kv.pool.blocks].filter((block) => block.hash !== null).map((block) => block.id);
    assert.equal(cachedIds.length, 2);

    scheduler.addRequest(makeRequest('b', prompt(0, 8), { sampling: { maxTokens: 3 } }), 1);
    const plan = scheduler.schedule(1);
    assert.deepEqual(summary(plan), ['b/0+1*1']);
    assert.equal(plan.numScheduledTokens, 1);
    const ids = blockIds(scheduler, 'b');
    assert.equal(ids[0], cachedIds[0], 'the first block is shared');
    assert.ok(!cachedIds.includes(ids[1]!), 'the last one is fresh');
    assert.deepEqual(plan.blockCopies.map((copy) => [copy.source.id, copy.destination.id]), [[cachedIds[1], ids[1]]]);
    assert.equal(scheduler.getRequest('b')!.numCachedTokens, 7);
    assert.equal(scheduler.kv.numPins, 1, 'the source is pinned for the step');
    scheduler.checkInvariants();

    scheduler.updateFromOutput(plan, [7], 2);
    assert.equal(scheduler.kv.numPins, 0);
    scheduler.checkInvariants();
    while (scheduler.numRequests > 0) step(scheduler, 3);
    assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
    assert.deepEqual([...scheduler.kv.pool.blocks].filter((block) => block.hash !== null).map((block) => block.id), cachedIds,
      'the copy never took the cached hash');
    scheduler.checkInvariants();
  });

  test('a prompt ending inside a block recomputes that partial block and copies nothing', () => {
    const scheduler = makeScheduler({ blockSize: 4 });
    scheduler.addRequest(makeRequest('a', prompt(0, 10), { sampling: { maxTokens: 1 } }), 0);
    step(scheduler);
    scheduler.addRequest(makeRequest('b', prompt(0, 10), { sampling: { maxTokens: 1 } }), 1);
    const { plan } = step(scheduler, 1);
    assert.deepEqual(summary(plan), ['b/0+2*1']);
    assert.deepEqual(plan.blockCopies, []);
    assert.equal(plan.stats.numPrefillTokens, 2);
  });

  test('a cached prompt as long as the whole pool computes its last block (a copy would need one block more): it and the requests behind it run', () => {
    const scheduler = makeScheduler({ blockSize: 4, numBlocks: 4 });
    scheduler.addRequest(makeRequest('a', prompt(0, 16), { sampling: { maxTokens: 1 } }), 0);
    step(scheduler);
    assert.equal(scheduler.numRequests, 0);
    // Sent again (a client's retry), then a small request behind it.
    scheduler.addRequest(makeRequest('b', prompt(0, 16), { sampling: { maxTokens: 1 } }), 1);
    scheduler.addRequest(makeRequest('c', prompt(1, 3), { sampling: { maxTokens: 1 } }), 1);
    const plan = scheduler.schedule(1);
    assert.deepEqual(summary(plan), ['b/0+4*1'], 'three blocks from the cache, the last one computed');
    assert.equal(scheduler.getRequest('b')!.numCachedTokens, 12);
    assert.deepEqual(plan.blockCopies, []);
    scheduler.updateFromOutput(plan, [7], 2);
    for (let turn = 0; scheduler.numRequests > 0; turn++) {
      assert.ok(turn < 5, 'every request ran');
      step(scheduler, 2 + turn);
    }
    scheduler.checkInvariants();
  });

  for (const ending of ['updateFromOutput', 'discardPlan'] as const) {
    test(`an abort between scheduling and the copy loses nothing (then ${ending})`, () => {
      const scheduler = makeScheduler({ blockSize: 4, numBlocks: 4 });
      scheduler.addRequest(makeRequest('a', prompt(0, 8), { sampling: { maxTokens: 1 } }), 0);
      step(scheduler);
      scheduler.addRequest(makeRequest('b', prompt(0, 8)), 1);
      const plan = scheduler.schedule(1);
      const [copy] = plan.blockCopies;
      assert.ok(copy !== undefined);
      assert.ok(scheduler.abort('b', 1));
      assert.equal(copy.source.refCount, 1, 'b let go of its blocks, the step still holds the source');
      // Only the pinned source is in use: filling the rest of the pool cannot evict it.
      assert.equal(scheduler.kv.pool.numUsedBlocks, 1);
      scheduler.checkInvariants();
      if (ending === 'updateFromOutput') scheduler.updateFromOutput(plan, [7], 2);
      else scheduler.discardPlan(plan);
      assert.equal(scheduler.kv.numPins, 0);
      assert.equal(scheduler.kv.pool.numUsedBlocks, 0, 'every block is free');
      scheduler.checkInvariants();

      scheduler.addRequest(makeRequest('c', prompt(0, 8), { sampling: { maxTokens: 1 } }), 3);
      const again = scheduler.schedule(3);
      assert.equal(again.blockCopies[0]?.source, copy.source, 'the source still holds the prefix');
      scheduler.updateFromOutput(again, [7], 4);
      assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
      scheduler.checkInvariants();
    });
  }

  test('n > 1 forks after the one computed token, every sample sharing the copied block', () => {
    const scheduler = makeScheduler({ blockSize: 4 });
    scheduler.addRequest(makeRequest('a', prompt(0, 8), { sampling: { maxTokens: 1 } }), 0);
    step(scheduler);
    scheduler.addRequest(makeRequest('b', prompt(0, 8), { sampling: { n: 3, maxTokens: 4 } }), 1);
    const { plan } = step(scheduler, 1, (target) => 10 + target.completionIndex);
    assert.deepEqual(summary(plan), ['b/0+1*3']);
    assert.equal(plan.blockCopies.length, 1);
    const destination = plan.blockCopies[0]!.destination;
    const request = scheduler.getRequest('b')!;
    assert.equal(request.sequences.length, 3);
    for (const sequence of request.sequences) assert.equal(sequence.blockTable.blocks[1], destination);
    assert.equal(destination.refCount, 3);
    scheduler.checkInvariants();
    while (scheduler.numRequests > 0) {
      step(scheduler, 2);
      scheduler.checkInvariants();
    }
    assert.equal(scheduler.kv.pool.numUsedBlocks, 0);
    assert.equal(scheduler.kv.numPins, 0);
  });
});

// ---------------------------------------------------------------------------------------------------------------
// End to end on the real backends

const MODEL = 'stories260K.gguf';
const BLOCK_SIZE = 16;

const model = () => loadSharedModel(MODEL);

async function makeCore(backend: BackendFactory): Promise<EngineCore> {
  const { loaded, tokenizer } = await model();
  const runner = backend.load(loaded.config, loaded.weights, { numBlocks: 64, blockSize: BLOCK_SIZE, dtype: 'f32' }, { threads: 1 });
  let clock = 0;
  return new EngineCore({
    backend: runner, tokenizer, maxNumSeqs: 8, maxNumBatchedTokens: 256, maxModelLen: loaded.config.contextLength, now: () => clock++,
  });
}

interface Run {
  /** Tokens per completion index. */
  tokens: number[][];
  cachedTokens: number;
  /** Tokens in the step that produced the first token. */
  firstStepTokens: number;
}

function run(core: EngineCore, request: EngineRequest): Run {
  core.add(request);
  const result: Run = { tokens: [], cachedTokens: -1, firstStepTokens: -1 };
  const take = (output: EngineOutput) => {
    (result.tokens[output.index] ??= []).push(...output.newTokenIds);
    result.cachedTokens = output.usage.cachedTokens;
    if (result.firstStepTokens < 0 && output.step) result.firstStepTokens = output.step.batchTokens;
  };
  for (let steps = 0; core.hasWork; steps++) {
    for (const output of core.step()) take(output);
    assert.ok(steps < 10_000, 'engine did not finish');
  }
  return result;
}

const SAMPLINGS: [string, Partial<SamplingParams>][] = [
  ['greedy', { temperature: 0 }],
  ['seeded', { temperature: 0.9, topP: 0.95, seed: 4242 }],
  ['seeded, n = 2', { temperature: 0.9, seed: 77, n: 2 }],
];

for (const backend of engineBackends()) {
  describe(`copy-on-write of a cached prompt on ${backend.name}`, { skip: skipUnlessShared(MODEL) }, () => {
    for (const length of [2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 5]) {
      test(`a repeated ${length}-token prompt gives the cold run's tokens and leaves the cached blocks untouched`, async () => {
        const { tokenizer } = await model();
        const text = 'Once upon a time, there was a little girl named Lily. She liked to play outside in the park with her friends and her dog.';
        const ids = tokenizer.encode(text).slice(0, length);
        assert.equal(ids.length, length, 'the text is long enough');
        const core = await makeCore(backend);
        const onBoundary = length % BLOCK_SIZE === 0;
        for (const [name, sampling] of SAMPLINGS) {
          const make = (id: string): EngineRequest => ({
            id, promptTokenIds: ids, priority: 0, arrivalMs: 0, sampling: { ...DEFAULT_SAMPLING, maxTokens: 12, ignoreEos: true, ...sampling },
          });
          core.kv.resetPrefixCache();
          const cold = run(core, make(`cold ${name}`));
          assert.equal(cold.cachedTokens, 0);
          assert.equal(cold.firstStepTokens, length);

          const hashes = core.kv.fullBlockHashes(core.kv.createTable(), ids, length);
          const cachedBlocks = hashes.map((hash) => core.kv.pool.getCachedBlock(hash)!);
          assert.equal(cachedBlocks.length, Math.floor(length / BLOCK_SIZE));
          const bytesBefore = readKvBlocks(core.kvPoolView, cachedBlocks.map((block) => block.id));

          const again = run(core, make(`again ${name}`));
          assert.deepEqual(again.tokens, cold.tokens, `${name}: the same tokens from the cache`);
          assert.equal(again.firstStepTokens, onBoundary ? 1 : length % BLOCK_SIZE, `${name}: tokens computed by the repeat`);
          assert.equal(again.cachedTokens, onBoundary ? length - 1 : length - (length % BLOCK_SIZE));
          assert.deepEqual(readKvBlocks(core.kvPoolView, cachedBlocks.map((block) => block.id)), bytesBefore,
            `${name}: the cached blocks' bytes are unchanged`);
          assert.deepEqual(hashes.map((hash) => core.kv.pool.getCachedBlock(hash)), cachedBlocks, 'still cached, in the same blocks');

          const stats = core.stats();
          assert.equal(stats.kvBlocksUsed, 0, 'every KV block is back in the pool');
          assert.equal(core.kv.numPins, 0);
          core.scheduler.checkInvariants();
        }
      });
    }
  });
}
