// A prefill worker lost before it hands a request's KV over, on real worker threads killed mid-request: the request
// is prefilled again, on another prefill worker while one is left and then on its decode worker, and the caller's
// stream completes equal to an undisturbed run, whether the loss came before the first token or after it went out.
// Where nothing can prefill it (its decode worker gone too) it fails with a WorkerLostError that says so. Every
// block on every surviving worker is free afterwards.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import { engineNow } from '../../src/engine/clock.ts';
import { WorkerLostError } from '../../src/engine/errors.ts';
import type { LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest, type SamplingParams } from '../../src/engine/types.ts';
import { PREFILL_WORKER_LOST, type DisaggregatedEngine } from '../../src/runtime/disaggregated.ts';
import { createWorkerPool, type WorkerPool } from '../../src/runtime/worker-pool.ts';
import { cpuTestModel } from '../helpers/cpu-model.ts';
import { collect, text, tokens } from '../helpers/outputs.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

let nextId = 0;
/** Greedy with a repetition penalty: no loops in a random model's text. */
function request(promptTokenIds: number[], sampling: Partial<SamplingParams> = {}): EngineRequest {
  return {
    id: `pl${nextId++}`, promptTokenIds, priority: 0, arrivalMs: engineNow(),
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 24, ignoreEos: true, temperature: 0, repetitionPenalty: 1.5, ...sampling },
  };
}

function prompt(group: number, length: number): number[] {
  return Array.from({ length }, (_, i) => 100 + ((group * 7919 + i * 31) % 5000));
}

let tempDir: string;
let modelPath: string;
before(() => {
  ({ dir: tempDir, modelPath } = writeWorkerLossFixture('prefill-loss'));
});
after(() => rmSync(tempDir, { recursive: true, force: true }));

/**
 * Every prompt prefilled remotely (fixed estimates: a transfer always beats a local prefill), on the reference
 * kernels with 8-token steps: a 400-token prompt takes 50 prefill steps, time to kill its worker mid-prefill, and
 * no native code runs in the thread that is killed.
 */
function pool(prefillWorkers: number, decodeWorkers: number, migrationLimit = 0,
  options: { modelPath?: string; guidedJumpForward?: boolean } = {}): Promise<WorkerPool> {
  return createWorkerPool({
    engine: 'cpu', workers: 1, prefillWorkers, decodeWorkers, modelPath, threads: 1, backend: 'reference',
    kvCacheMemoryBytes: 16 << 20, maxNumBatchedTokens: 8, routerSeed: 5, migrationLimit, ...options,
    disaggregationPolicy: { minRemotePrefillTokens: 1 },
    disaggregationEstimates: { transferBytesPerSec: 1e12, prefillTokensPerSec: 1e3, fixed: true },
  });
}

const engineOf = (pool: WorkerPool, workerId: string) => pool.workers.find((w) => w.id === workerId)!.engine as LocalEngine;

async function turn(): Promise<void> {
  await new Promise<void>((resolve) => setImmediate(resolve));
}

/** Waits until the request is on a prefill worker and returns that worker's id. */
async function prefillWorkerOf(engine: DisaggregatedEngine, requestId: string): Promise<string> {
  for (let turns = 0; ; turns++) {
    const at = engine.requestStage(requestId) === 'prefill' ? engine.requestWorkers(requestId)?.prefillWorkerId : undefined;
    if (at !== undefined) return at;
    if (turns > 100_000) assert.fail(`request ${requestId} never reached a prefill worker (at ${engine.requestStage(requestId)})`);
    await turn();
  }
}

/** Kills the worker as a crash would, and waits until the engine has noticed (it left its tier). */
async function kill(pool: WorkerPool, workerId: string): Promise<void> {
  await engineOf(pool, workerId).kill();
  const engine = pool.disaggregated!;
  await waitUntil(() => ![...engine.prefillWorkerIds, ...engine.decodeWorkerIds].includes(workerId), `worker ${workerId} left its tier`);
}

/** Settles every surviving worker, then checks that no block and no request is left anywhere. */
async function assertAllFree(pool: WorkerPool): Promise<void> {
  const engine = pool.disaggregated!;
  for (const id of [...engine.prefillWorkerIds, ...engine.decodeWorkerIds]) {
    const stats = await engineOf(pool, id).sync();
    assert.equal(stats.kvBlocksUsed, 0, `worker ${id} holds no block`);
    assert.equal(stats.numRunning + stats.numWaiting, 0, `worker ${id} runs nothing`);
  }
  assert.equal(engine.stats().numWaiting, 0, 'nothing waits for a worker');
}

/** What the request gives undisturbed: the decode worker running it on its own, as an aggregated worker. */
function undisturbed(pool: WorkerPool, promptTokenIds: number[], sampling: Partial<SamplingParams> = {}): Promise<EngineOutput[]> {
  const decodeId = pool.disaggregated!.decodeWorkerIds[0]!;
  return collect(engineOf(pool, decodeId).generate(request(promptTokenIds, sampling)));
}

/**
 * Runs the request and kills its prefill worker once the first output is in. That output comes from the prefill
 * worker; held here, the handoff that follows it waits for this consumer, so the kill lands after the first token
 * and before the decode worker is told of the handoff.
 */
async function runKillingAfterFirst(p: WorkerPool, req: EngineRequest): Promise<{ outputs: EngineOutput[]; lost: string }> {
  const engine = p.disaggregated!;
  const outputs: EngineOutput[] = [];
  let lost: string | undefined;
  for await (const output of engine.generate(req)) {
    outputs.push(output);
    if (outputs.length === 1) {
      assert.equal(engine.requestStage(req.id), 'prefill');
      lost = engine.requestWorkers(req.id)!.prefillWorkerId!;
      await kill(p, lost);
    }
  }
  return { outputs, lost: lost! };
}

function assertComplete(outputs: EngineOutput[], req: EngineRequest): void {
  const last = outputs.at(-1)!;
  assert.equal(last.finishReason, 'length');
  assert.equal(last.usage.promptTokens, req.promptTokenIds.length, 'the caller\'s prompt');
  assert.equal(last.usage.completionTokens, req.sampling.maxTokens);
  assert.ok(outputs.every((o) => o.requestId === req.id && o.index === 0));
  // Completion tokens count on across the move, one per output that carries one.
  let seen = 0;
  for (const output of outputs) {
    seen += output.newTokenIds.length;
    assert.equal(output.usage.completionTokens, seen);
  }
}

describe('a prefill worker lost before the hand-over', () => {
  test('mid-prefill: prefilled again on another prefill worker, then, with none left, on the decode worker', async () => {
    const p = await pool(3, 1);
    const engine = p.disaggregated!;
    try {
      // Migration is off (the default): a request that has not reached its decode worker is not a migration case.
      const first = request(prompt(1, 400));
      const firstStream = collect(engine.generate(first));
      const lost = await prefillWorkerOf(engine, first.id);
      await kill(p, lost);
      const outputs = await firstStream;
      assert.equal(engine.prefillWorkerIds.includes(lost), false);
      const survivor = outputs.at(-1)!.routing!.disaggregation!.prefillWorkerId!;
      assert.ok(engine.prefillWorkerIds.includes(survivor));
      assertComplete(outputs, first);
      const routing = outputs.at(-1)!.routing!;
      assert.deepEqual(routing.migrations, [{ fromWorkerId: lost, toWorkerId: survivor, afterTokens: 0, reason: PREFILL_WORKER_LOST }]);
      assert.equal(routing.disaggregation!.mode, 'disaggregated', routing.disaggregation!.detail);
      assert.equal(routing.disaggregation!.reason, 'remote-prefill');
      assert.ok(outputs.at(-1)!.timestamps.kvTransfer!.bytes > 0, 'the survivor\'s KV moved to the decode worker');
      assert.ok(outputs.every((o) => o.routing!.disaggregation!.prefillWorkerId === survivor), 'nothing came from the lost worker');
      const firstExpected = await undisturbed(p, prompt(1, 400));
      assert.deepEqual(tokens(outputs), tokens(firstExpected));
      assert.equal(text(outputs), text(firstExpected));
      assert.equal(engine.workerStats().find((w) => w.workerId === survivor)!.stats.requestMigrations, 1);
      assert.equal(engine.stats().requestMigrations, 1);
      await assertAllFree(p);

      // Seeded sampling: the request starts over with its seed, so it draws what an undisturbed run draws.
      const seeded = { temperature: 0.8, topK: 40, seed: 77, repetitionPenalty: 1 };
      const again = request(prompt(3, 400), seeded);
      const againStream = collect(engine.generate(again));
      await kill(p, await prefillWorkerOf(engine, again.id));
      const seededOutputs = await againStream;
      assertComplete(seededOutputs, again);
      assert.equal(seededOutputs.at(-1)!.routing!.migrations![0]!.afterTokens, 0);
      assert.deepEqual(tokens(seededOutputs), tokens(await undisturbed(p, prompt(3, 400), seeded)));
      assert.equal(engine.prefillWorkerIds.length, 1);
      await assertAllFree(p);

      // The last prefill worker lost too: the decode worker prefills the prompt itself.
      const [last] = engine.prefillWorkerIds;
      const second = request(prompt(2, 400));
      const secondStream = collect(engine.generate(second));
      assert.equal(await prefillWorkerOf(engine, second.id), last);
      await kill(p, last!);
      const local = await secondStream;
      assertComplete(local, second);
      const localRouting = local.at(-1)!.routing!;
      assert.deepEqual(localRouting.migrations, [{ fromWorkerId: last, toWorkerId: 'decode-0', afterTokens: 0, reason: PREFILL_WORKER_LOST }]);
      const why = localRouting.disaggregation!;
      assert.deepEqual([why.mode, why.reason, why.prefillWorkerId], ['local', 'prefill-failed', undefined]);
      assert.match(why.detail, new RegExp(`prefill worker ${last} was lost before the hand-over; prefilled here: no prefill worker`));
      assert.equal(local.at(-1)!.timestamps.kvTransfer, undefined, 'nothing moved');
      const secondExpected = await undisturbed(p, prompt(2, 400));
      assert.deepEqual(tokens(local), tokens(secondExpected));
      assert.equal(text(local), text(secondExpected));
      assert.deepEqual(engine.prefillWorkerIds, []);
      assert.deepEqual(engine.decisionCounts(), { disaggregated: 3, local: 0, fallbacks: 1 });
      assert.deepEqual(engine.workerStats().map((w) => [w.workerId, w.stats.requestMigrations]), [['decode-0', 1]]);
      await assertAllFree(p);
    } finally {
      await p.engine.close();
    }
  });

  test('after the first token went out: the prompt and that token are prefilled again, the stream goes on', async () => {
    const p = await pool(2, 1);
    const engine = p.disaggregated!;
    try {
      const first = request(prompt(3, 64), { maxTokens: 40 });
      const { outputs, lost } = await runKillingAfterFirst(p, first);
      const [survivor] = engine.prefillWorkerIds;
      assertComplete(outputs, first);
      assert.deepEqual(outputs.at(-1)!.routing!.migrations,
        [{ fromWorkerId: lost, toWorkerId: survivor, afterTokens: 1, reason: PREFILL_WORKER_LOST }]);
      assert.equal(outputs.at(-1)!.routing!.disaggregation!.prefillWorkerId, survivor);
      assert.equal(outputs.at(-1)!.timestamps.firstToken, outputs[0]!.timestamps.firstToken, 'the first token stays the lost worker\'s');
      const firstExpected = await undisturbed(p, prompt(3, 64), { maxTokens: 40 });
      assert.deepEqual(tokens(outputs), tokens(firstExpected));
      assert.equal(text(outputs), text(firstExpected), 'nothing repeated or dropped');
      await assertAllFree(p);

      const second = request(prompt(4, 64), { maxTokens: 40 });
      const local = await runKillingAfterFirst(p, second);
      assert.equal(local.lost, survivor);
      assertComplete(local.outputs, second);
      assert.deepEqual(local.outputs.at(-1)!.routing!.migrations,
        [{ fromWorkerId: survivor, toWorkerId: 'decode-0', afterTokens: 1, reason: PREFILL_WORKER_LOST }]);
      assert.equal(local.outputs.at(-1)!.routing!.disaggregation!.reason, 'prefill-failed');
      const secondExpected = await undisturbed(p, prompt(4, 64), { maxTokens: 40 });
      assert.deepEqual(tokens(local.outputs), tokens(secondExpected));
      assert.equal(text(local.outputs), text(secondExpected));
      await assertAllFree(p);
    } finally {
      await p.engine.close();
    }
  });

  test('after the first output went out, prefilled again on another prefill worker: the decode worker counts that output for the penalties and advances the grammar over it', async () => {
    // stories260K when it is there: its greedy text with these penalties turns on the first token (the synthetic
    // model's noise hardly repeats a token, so penalties on one rarely change its argmax).
    const model = cpuTestModel();
    const storyPrompt = [1, 403, 407, 261, 378, 263, 100, 288, 261, 493, 289, 300, 301, 302, 303, 304, 305];
    const penalties = { frequencyPenalty: 2, presencePenalty: 2, repetitionPenalty: 1 };
    const regex: SamplingParams['guided'] = { kind: 'regex', pattern: '(Once|Lily|The) [a-z]+ [a-z]+ [a-z]+ [a-z]+\\.' };
    const cases: [string, Partial<SamplingParams>][] = [
      ['penalties, greedy', { ...penalties }],
      ['penalties, seeded', { ...penalties, temperature: 0.9, seed: 7 }],
      ['guided regex, greedy', { guided: regex, ignoreEos: false, repetitionPenalty: 1 }],
      ['guided regex, seeded', { guided: regex, ignoreEos: false, repetitionPenalty: 1, temperature: 0.9, seed: 5 }],
      // Jump-forward (on in this pool): the rest of the choice but its last piece goes out with the first token.
      ['guided choice, greedy', { guided: { kind: 'choice', choices: ['Once upon a time in a land far away', 'The end'] }, ignoreEos: false, repetitionPenalty: 1 }],
    ];
    // One prefill worker lost per case, one left for the last.
    const p = await pool(cases.length + 1, 1, 0, { modelPath: model.path, guidedJumpForward: true });
    const engine = p.disaggregated!;
    const decode = engineOf(p, engine.decodeWorkerIds[0]!);
    try {
      for (const [label, sampling] of cases) {
        const maxTokens = 30;
        const req = request(storyPrompt, { ...sampling, maxTokens });
        const { outputs, lost } = await runKillingAfterFirst(p, req);
        const last = outputs.at(-1)!;
        assert.equal(last.error, undefined, label);
        const done = outputs[0]!.newTokenIds;
        if (sampling.guided?.kind === 'choice') assert.ok(done.length > 1, `${label}: the forced text went out with the first token`);
        assert.deepEqual(last.routing!.migrations, [{ fromWorkerId: lost, toWorkerId: last.routing!.disaggregation!.prefillWorkerId,
          afterTokens: done.length, reason: PREFILL_WORKER_LOST }], label);
        assert.equal(last.routing!.disaggregation!.mode, 'disaggregated', `${label}: ${last.routing!.disaggregation!.detail}`);
        // What one worker gives for the request as it was sent again: the prompt and the output so far, that output
        // counted for the penalties and taken by the grammar, max_tokens less it.
        const again: EngineRequest = {
          ...request([...storyPrompt, ...done], { ...sampling, maxTokens: maxTokens - done.length }), priorOutputTokenIds: done,
        };
        const continued = await collect(decode.generate(again));
        assert.deepEqual(tokens(outputs), [...done, ...tokens(continued)], label);
        assert.equal(last.finishReason, continued.at(-1)!.finishReason, label);
        assert.equal(last.usage.completionTokens, done.length + continued.at(-1)!.usage.completionTokens, label);
        // Greedy, that is the undisturbed output.
        if (sampling.temperature === undefined) {
          const expected = await undisturbed(p, storyPrompt, { ...sampling, maxTokens });
          assert.deepEqual(tokens(outputs), tokens(expected), label);
          assert.equal(text(outputs), text(expected), label);
        }
        if (sampling.guided?.kind === 'regex') assert.match(text(outputs), /^(Once|Lily|The) [a-z]+ [a-z]+ [a-z]+ [a-z]+\.$|^(Once|Lily|The) [a-z ]*$/, label);
        await assertAllFree(p);
      }
    } finally {
      await p.engine.close();
    }
  });

  test('its decode worker gone too: a WorkerLostError that says so, nothing held; with migration on, another decode worker', async () => {
    for (const migrationLimit of [0, 1]) {
      const p = await pool(1, 2, migrationLimit);
      const engine = p.disaggregated!;
      try {
        // 800 tokens, 100 prefill steps: room for two kills before the prompt is done.
        const req = request(prompt(5 + migrationLimit, 800));
        const stream = collect(engine.generate(req));
        const prefillId = await prefillWorkerOf(engine, req.id);
        const decodeId = engine.requestWorkers(req.id)!.decodeWorkerId!;
        // The decode worker first: it has no part in the request until the handoff, so the prompt is still being
        // prefilled when the prefill worker goes too, and the request learns of both losses at once.
        await kill(p, decodeId);
        await kill(p, prefillId);
        const [other] = engine.decodeWorkerIds;
        if (migrationLimit === 0) {
          await assert.rejects(stream, (error: unknown) => error instanceof WorkerLostError
            && new RegExp(`prefill worker ${prefillId} was lost before the hand-over, and decode worker ${decodeId}, which would `
              + 'prefill it instead, is gone too').test(error.message));
        } else {
          const outputs = await stream;
          assertComplete(outputs, req);
          assert.deepEqual(outputs.at(-1)!.routing!.migrations, [
            { fromWorkerId: prefillId, afterTokens: 0, reason: PREFILL_WORKER_LOST },
            { fromWorkerId: decodeId, toWorkerId: other, afterTokens: 0, reason: 'worker-lost' },
          ]);
          assert.deepEqual(tokens(outputs), tokens(await undisturbed(p, prompt(5 + migrationLimit, 800))));
        }
        assert.equal(engine.requestStage(req.id), undefined, 'the request is over');
        await assertAllFree(p);
        // The surviving decode worker serves on, prefilling locally now that no prefill worker is left.
        const next = await collect(engine.generate(request(prompt(9, 40), { maxTokens: 4 })));
        assert.equal(next.at(-1)!.finishReason, 'length');
        assert.equal(next.at(-1)!.routing!.disaggregation!.reason, 'prefill-queue-full');
        await assertAllFree(p);
      } finally {
        await p.engine.close();
      }
    }
  });
});
