// Request migration over real CPU workers (worker threads running a synthetic model with the Llama 2 vocabulary):
// a worker killed mid-stream hands the request to a surviving worker and the caller's stream goes on, equal to a
// run that was never interrupted (tokens, text, usage), a stop string spanning the migration point included;
// migration off, the limit reached or no worker left fail as before; an abort between two workers ends the
// stream; a lost decode worker hands over to another decode worker; and no block stays in use anywhere.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import { engineNow } from '../../src/engine/clock.ts';
import { WorkerLostError } from '../../src/engine/errors.ts';
import { createLocalEngine, LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest, type SamplingParams } from '../../src/engine/types.ts';
import { BitsetKvIndex } from '../../src/router/kv-index.ts';
import { seededRandom } from '../../src/util/random.ts';
import { Router } from '../../src/router/router.ts';
import { RequestMigration } from '../../src/runtime/migration.ts';
import { RoutedEngine } from '../../src/runtime/routed-engine.ts';
import { createWorkerPool, type WorkerPool, type WorkerPoolOptions } from '../../src/runtime/worker-pool.ts';
import { collect, text, tokens } from '../helpers/outputs.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

let nextId = 0;
/** Greedy with a repetition penalty: no loops in a random model's text, and the same tokens after a migration. */
function request(promptTokenIds: number[], sampling: Partial<SamplingParams> = {}): EngineRequest {
  return {
    id: `m${nextId++}`, promptTokenIds, priority: 0, arrivalMs: engineNow(),
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 150, ignoreEos: true, temperature: 0, repetitionPenalty: 1.5, ...sampling },
  };
}

function prompt(group: number, length = 32): number[] {
  return Array.from({ length }, (_, i) => 100 + ((group * 7919 + i * 31) % 5000));
}

/**
 * Streams `req` and calls `kill` with the latest output once `killAfter` outputs arrived; with `kills` > 1, again
 * after each further `killAfter` outputs (the worker that took the request over).
 */
async function runWithKill(engine: { generate(r: EngineRequest): AsyncIterable<EngineOutput> }, req: EngineRequest,
  killAfter: number, kill: (output: EngineOutput) => Promise<void>, kills = 1): Promise<EngineOutput[]> {
  const outputs: EngineOutput[] = [];
  let sinceKill = 0;
  let killed = 0;
  for await (const output of engine.generate(req)) {
    outputs.push(output);
    if (killed < kills && ++sinceKill === killAfter) {
      killed++;
      sinceKill = 0;
      await kill(output);
    }
  }
  return outputs;
}

function killer(pool: WorkerPool) {
  return async (output: EngineOutput) => {
    const worker = pool.workers.find((w) => w.id === output.routing!.workerId)!;
    await (worker.engine as LocalEngine).kill();
  };
}

/** Settles every surviving worker, then checks that no block and no request is left anywhere. */
async function assertAllFree(pool: WorkerPool): Promise<void> {
  const alive = new Set([...(pool.routed?.workerIds ?? []), ...(pool.disaggregated?.prefillWorkerIds ?? []),
    ...(pool.disaggregated?.decodeWorkerIds ?? [])]);
  for (const { id, engine } of pool.workers) {
    if (!alive.has(id)) continue;
    const stats = await (engine as LocalEngine).sync();
    assert.equal(stats.kvBlocksUsed, 0, `worker ${id} holds no block`);
    assert.equal(stats.numRunning + stats.numWaiting, 0, `worker ${id} runs nothing`);
  }
  assert.equal(pool.engine.stats().numWaiting, 0, 'nothing waits for a worker');
}

let tempDir: string;
let modelPath: string;
before(() => {
  ({ dir: tempDir, modelPath } = writeWorkerLossFixture('migration'));
});
after(() => rmSync(tempDir, { recursive: true, force: true }));

/**
 * The reference kernels: a few ms per token, so the kill reliably lands mid-stream, and no native code running in
 * the thread that is killed.
 */
const WORKER = { modelPath: '', threads: 1, kvCacheMemoryBytes: 16 << 20, backend: 'reference' } as const;

function routedPool(workers: number, migrationLimit?: number, extra: Partial<WorkerPoolOptions> = {}): Promise<WorkerPool> {
  return createWorkerPool({
    engine: 'cpu', workers, ...WORKER, modelPath, routerSeed: 7,
    ...(migrationLimit !== undefined ? { migrationLimit } : {}), ...extra,
  });
}

describe('request migration between routed workers', () => {
  test('a worker killed mid-stream: the stream continues on the other worker, equal to an uninterrupted run', async () => {
    const pool = await routedPool(2, 3);
    try {
      const expected = await collect(pool.engine.generate(request(prompt(1))));
      const req = request(prompt(1));
      const outputs = await runWithKill(pool.engine, req, 20, killer(pool));

      const moves = outputs.at(-1)!.routing!.migrations!;
      assert.equal(moves.length, 1, 'one migration');
      const [move] = moves;
      assert.notEqual(move!.toWorkerId, move!.fromWorkerId);
      assert.ok(move!.afterTokens >= 20 && move!.afterTokens < 150, `migrated after ${move!.afterTokens} tokens, mid-stream`);
      assert.equal(outputs.at(-1)!.routing!.workerId, move!.toWorkerId);
      assert.equal(outputs[0]!.routing!.workerId, move!.fromWorkerId);

      assert.deepEqual(tokens(outputs), tokens(expected), 'greedy tokens as if nothing happened');
      assert.equal(text(outputs), text(expected), 'and the same text, nothing repeated or dropped');
      assert.ok(outputs.every((o) => o.requestId === req.id && o.index === 0));
      const last = outputs.at(-1)!;
      assert.equal(last.finishReason, 'length');
      assert.equal(last.usage.promptTokens, 32, 'the caller\'s prompt, not the continuation\'s');
      assert.equal(last.usage.completionTokens, 150);
      // Completion tokens count on across the migration, one per output.
      outputs.forEach((o, i) => assert.equal(o.usage.completionTokens, i + 1, `output ${i}`));
      assert.equal(last.timestamps.firstToken, outputs[0]!.timestamps.firstToken, 'the first token stays the first worker\'s');

      const survivor = pool.routed!.workerStats();
      assert.deepEqual(survivor.map((w) => [w.workerId, w.stats.requestMigrations]), [[move!.toWorkerId, 1]]);
      assert.equal(pool.engine.stats().requestMigrations, 1);
      await assertAllFree(pool);
      // The survivor now holds the prompt's blocks; the router knows it, and it serves the next request.
      const next = await collect(pool.engine.generate(request(prompt(1), { maxTokens: 4 })));
      assert.equal(next.at(-1)!.routing!.workerId, move!.toWorkerId);
      assert.ok(next.at(-1)!.usage.cachedTokens > 0);
    } finally {
      await pool.engine.close();
    }
  });

  test('a stop string spanning the migration point stops the stream exactly where an uninterrupted run stops', async () => {
    const pool = await routedPool(2, 1);
    try {
      const killAfter = 20;
      const whole = await collect(pool.engine.generate(request(prompt(2))));
      // The stop string starts a few tokens before the kill and ends well after it: the lost worker held back all
      // of its text that had arrived (it could still become the stop string); the new worker never sees it.
      const textOf = (n: number) => text(whole.slice(0, n));
      const stop = whole.map((o) => o.textDelta).join('').slice(textOf(killAfter - 3).length, textOf(killAfter + 100).length);
      assert.ok(stop.length > 20);
      const expected = await collect(pool.engine.generate(request(prompt(2), { stop: [stop] })));
      assert.equal(expected.at(-1)!.stopReason, stop);

      const outputs = await runWithKill(pool.engine, request(prompt(2), { stop: [stop] }), killAfter, killer(pool));
      const move = outputs.at(-1)!.routing!.migrations![0]!;
      assert.ok(move.afterTokens < killAfter + 100, `the migration (after ${move.afterTokens} tokens) is inside the stop string`);
      const before = outputs.filter((o) => o.routing!.workerId === move.fromWorkerId);
      assert.equal(text(before), textOf(killAfter - 3), 'the lost worker sent only the text before the stop string');
      assert.equal(text(outputs), text(expected));
      assert.deepEqual(tokens(outputs), tokens(expected));
      assert.equal(outputs.at(-1)!.finishReason, 'stop');
      assert.equal(outputs.at(-1)!.stopReason, stop);
      await assertAllFree(pool);
    } finally {
      await pool.engine.close();
    }
  });

  test('frequency and presence penalties go on across the migration: the tokens of an uninterrupted run', async () => {
    const pool = await routedPool(2, 1);
    try {
      const sampling = { repetitionPenalty: 1, frequencyPenalty: 2, presencePenalty: 2, maxTokens: 150 };
      const expected = await collect(pool.engine.generate(request(prompt(4), sampling)));
      const outputs = await runWithKill(pool.engine, request(prompt(4), sampling), 20, killer(pool));
      assert.equal(outputs.at(-1)!.routing!.migrations!.length, 1, 'one migration');
      assert.deepEqual(tokens(outputs), tokens(expected));
      await assertAllFree(pool);
    } finally {
      await pool.engine.close();
    }
  });

  test('a guided request keeps its grammar across the migration: the output is one match, as an uninterrupted run', async () => {
    const pool = await routedPool(2, 1);
    try {
      // Free choice at every character (no forced text, so no jump-forward) and a fixed length: a grammar started
      // again on the new worker would allow another 60 letters after the first worker's.
      const guided = { kind: 'regex', pattern: '[a-z]{60}\\.' } as const;
      const expected = await collect(pool.engine.generate(request(prompt(3), { guided, ignoreEos: false })));
      assert.match(text(expected), /^[a-z]{60}\.$/);
      const killAfter = 6;
      assert.ok(expected.length > killAfter + 3, `${expected.length} outputs: the kill lands mid-output`);

      const outputs = await runWithKill(pool.engine, request(prompt(3), { guided, ignoreEos: false }), killAfter, killer(pool));
      assert.equal(outputs.at(-1)!.routing!.migrations!.length, 1, 'one migration');
      assert.equal(text(outputs), text(expected));
      assert.deepEqual(tokens(outputs), tokens(expected));
      assert.equal(outputs.at(-1)!.finishReason, 'stop', 'the grammar ended the output');
      await assertAllFree(pool);
    } finally {
      await pool.engine.close();
    }
  });

  test('migration off (the default): the stream fails with WorkerLostError as before', async () => {
    const pool = await routedPool(2);
    try {
      await assert.rejects(runWithKill(pool.engine, request(prompt(3)), 5, killer(pool)), WorkerLostError);
      assert.equal(pool.engine.stats().requestMigrations, 0);
      await assertAllFree(pool);
    } finally {
      await pool.engine.close();
    }
  });

  test('limit reached: the second loss fails with WorkerLostError although a worker is left', async () => {
    const pool = await routedPool(3, 1);
    try {
      await assert.rejects(runWithKill(pool.engine, request(prompt(4), { maxTokens: 300 }), 10, killer(pool), 2),
        (error: unknown) => error instanceof WorkerLostError);
      assert.equal(pool.routed!.workerIds.length, 1);
      assert.equal(pool.engine.stats().requestMigrations, 1);
      await assertAllFree(pool);
      const next = await collect(pool.engine.generate(request(prompt(4), { maxTokens: 4 })));
      assert.equal(next.at(-1)!.finishReason, 'length', 'the last worker serves on');
    } finally {
      await pool.engine.close();
    }
  });

  test('no worker left: the stream fails with the worker\'s WorkerLostError', async () => {
    const pool = await routedPool(2, 5);
    try {
      await assert.rejects(runWithKill(pool.engine, request(prompt(5), { maxTokens: 300 }), 10, killer(pool), 2),
        (error: unknown) => error instanceof WorkerLostError && /was lost while running/.test(error.message));
      assert.deepEqual(pool.routed!.workerIds, []);
    } finally {
      await pool.engine.close();
    }
  });

  test('aborted while waiting for a worker to take it over: the stream ends with abort, nothing is held', async () => {
    // A worker with any KV in use counts as busy, so the migrating request waits in the router's queue while the
    // other worker runs a long request.
    const first = await createLocalEngine({ ...WORKER, modelPath, enableKvEvents: true });
    const second = await LocalEngine.start({ ...WORKER, modelPath, enableKvEvents: true });
    const router = new Router({
      blockSize: first.engine.info.blockSize, policy: 'kv', random: seededRandom(1), clock: () => performance.now(),
      index: new BitsetKvIndex({ hashSeed: 1 }), busyKvUsage: 1e-6,
    });
    const engines = new Map<string, LocalEngine>([['a', first.engine], ['b', second]]);
    const routed = new RoutedEngine([...engines].map(([id, engine]) => ({ id, engine })), router, engineNow,
      { migration: { limit: 2, tokenizer: first.tokenizer } });
    try {
      const blocker = request(prompt(6), { maxTokens: 600 });
      const blockerStream = routed.generate(blocker)[Symbol.asyncIterator]();
      const blockerWorker = (await blockerStream.next()).value.routing.workerId as string;
      const req = request(prompt(7), { maxTokens: 300 });
      const stream = routed.generate(req)[Symbol.asyncIterator]();
      const firstOutput = (await stream.next()).value as EngineOutput;
      assert.notEqual(firstOutput.routing!.workerId, blockerWorker);
      await engines.get(firstOutput.routing!.workerId)!.kill();
      const rest: EngineOutput[] = [];
      const pump = (async () => { for (let r = await stream.next(); !r.done; r = await stream.next()) rest.push(r.value); })();
      await waitUntil(() => routed.stats().numWaiting > 0, 'the migrating request waits for a worker');
      routed.abort(req.id);
      await pump;
      const last = rest.at(-1)!;
      assert.equal(last.finishReason, 'abort');
      assert.equal(last.usage.completionTokens, 1 + rest.filter((o) => o.newTokenIds.length > 0).length);
      assert.equal(routed.stats().numWaiting, 0);
      routed.abort(blocker.id);
      for (let r = await blockerStream.next(); !r.done; r = await blockerStream.next());
      const stats = await engines.get(blockerWorker)!.sync();
      assert.equal(stats.kvBlocksUsed, 0);
      assert.equal(stats.numRunning + stats.numWaiting, 0);
      assert.equal(routed.stats().requestMigrations, 0, 'the request never reached another worker');
    } finally {
      await routed.close();
    }
  });

  test('n > 1 is not migrated', async () => {
    const pool = await routedPool(2, 3);
    try {
      await assert.rejects(runWithKill(pool.engine, request(prompt(8), { n: 2 }), 10, killer(pool)), WorkerLostError);
      await assertAllFree(pool);
    } finally {
      await pool.engine.close();
    }
  });
});

describe('request migration between decode workers', () => {
  test('a decode worker lost mid-decode: another decode worker recomputes the prompt and tokens and goes on', async () => {
    const pool = await createWorkerPool({
      engine: 'cpu', workers: 1, prefillWorkers: 1, decodeWorkers: 2, ...WORKER, modelPath, routerSeed: 9, migrationLimit: 1,
      // Every prompt is prefilled remotely, so the lost worker is one that adopted a handoff.
      disaggregationPolicy: { minRemotePrefillTokens: 1 },
    });
    try {
      const reference = (pool.workers.find((w) => w.role === 'decode')!.engine as LocalEngine);
      const expected = await collect(reference.generate(request(prompt(9, 64))));
      const outputs = await runWithKill(pool.engine, request(prompt(9, 64)), 20, async (output) => {
        const decodeId = output.routing!.disaggregation!.decodeWorkerId;
        await (pool.workers.find((w) => w.id === decodeId)!.engine as LocalEngine).kill();
      });
      assert.equal(outputs[0]!.routing!.disaggregation!.mode, 'disaggregated', 'the first worker adopted a handoff');
      const last = outputs.at(-1)!;
      const move = last.routing!.migrations![0]!;
      assert.equal(move.fromWorkerId, outputs[0]!.routing!.workerId);
      assert.equal(last.routing!.workerId, move.toWorkerId);
      assert.equal(last.routing!.disaggregation!.decodeWorkerId, move.toWorkerId);
      assert.deepEqual(tokens(outputs), tokens(expected));
      assert.equal(text(outputs), text(expected));
      assert.equal(last.usage.completionTokens, 150);
      assert.equal(last.usage.promptTokens, 64);
      assert.equal(pool.disaggregated!.stats().requestMigrations, 1);
      assert.deepEqual(pool.disaggregated!.workerStats().filter((w) => w.role === 'decode')
        .map((w) => [w.workerId, w.stats.requestMigrations]), [[move.toWorkerId, 1]]);
      await assertAllFree(pool);
    } finally {
      await pool.engine.close();
    }
  });
});

describe('request migration between decode workers, guided', () => {
  test('a guided request whose decode worker is lost goes on under its grammar: the text of an uninterrupted run', async () => {
    const pool = await createWorkerPool({
      engine: 'cpu', workers: 1, prefillWorkers: 1, decodeWorkers: 2, ...WORKER, modelPath, routerSeed: 9, migrationLimit: 1,
      disaggregationPolicy: { minRemotePrefillTokens: 1 },
    });
    try {
      const guided = { kind: 'regex', pattern: '[a-z]{60}\\.' } as const;
      const reference = (pool.workers.find((w) => w.role === 'decode')!.engine as LocalEngine);
      const expected = await collect(reference.generate(request(prompt(10, 64), { guided, ignoreEos: false })));
      assert.match(text(expected), /^[a-z]{60}\.$/);
      const outputs = await runWithKill(pool.engine, request(prompt(10, 64), { guided, ignoreEos: false }), 6, async (output) => {
        const decodeId = output.routing!.disaggregation!.decodeWorkerId;
        await (pool.workers.find((w) => w.id === decodeId)!.engine as LocalEngine).kill();
      });
      assert.equal(outputs.at(-1)!.routing!.migrations!.length, 1, 'one migration');
      assert.equal(text(outputs), text(expected));
      assert.deepEqual(tokens(outputs), tokens(expected));
      await assertAllFree(pool);
    } finally {
      await pool.engine.close();
    }
  });
});

describe('request migration: text and usage carried on this side', () => {
  /** Token id k is the letter 'a' + k: enough to detokenize outputs here. */
  const letters = { tokenBytes: (id: number) => new Uint8Array([97 + id]), stripsLeadingSpace: false };
  const output = (newTokenIds: number[], completionTokens: number, fields: Partial<EngineOutput> = {}): EngineOutput => ({
    requestId: 'r', index: 0, newTokenIds, textDelta: '', timestamps: { arrival: 0, prefillChunks: [] },
    usage: { promptTokens: 2, completionTokens, cachedTokens: 0 }, ...fields,
  });

  test('a stop string in the middle of a multi-token output (jump-forward) after a migration: the rest is not output or counted', () => {
    const migration = new RequestMigration(request([1, 2], { stop: ['cde'], maxTokens: 20 }), { limit: 1, tokenizer: letters });
    migration.adapt(output([0, 1], 2)); // "ab", before the worker is lost
    migration.migrateFrom('w0', 'lost');
    // The new worker (no stop strings) sends one sampled token and forced ones after it: "cdefg".
    const { output: adapted, stopped } = migration.adapt(output([2, 3, 4, 5, 6], 5));
    assert.equal(stopped, true);
    assert.equal(adapted.finishReason, 'stop');
    assert.equal(adapted.stopReason, 'cde');
    assert.deepEqual(adapted.newTokenIds, [2, 3, 4]);
    assert.equal(adapted.usage.completionTokens, 5);
    assert.deepEqual(migration.generated, [0, 1, 2, 3, 4]);
  });

  test('prompt logprobs are asked of the next worker only when the lost one sent no token (they come with the first)', () => {
    const early = new RequestMigration(request([1, 2], { promptLogprobs: 1 }), { limit: 2 });
    early.migrateFrom('w0', 'lost');
    assert.equal(early.attempt().sampling.promptLogprobs, 1);
    const late = new RequestMigration(request([1, 2], { promptLogprobs: 1 }), { limit: 2 });
    late.adapt(output([0], 1, { promptLogprobs: [null, { tokenId: 2, logprob: -1, top: [], rank: 3 }] }));
    late.migrateFrom('w0', 'lost');
    const next = late.attempt();
    assert.deepEqual(next.promptTokenIds, [1, 2, 0]);
    assert.equal(next.sampling.promptLogprobs, undefined);
  });
});
