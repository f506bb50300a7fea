// Many workers behind the router, through the same Engine interface the gateway uses: simulated GPU workers and
// real CPU workers in threads. A repeated long prefix lands where its blocks are; independent prompts spread; a
// worker that dies leaves routing and its requests fail cleanly.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { WorkerLostError } from '../../src/engine/errors.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { LocalEngine } from '../../src/engine/local-engine.ts';
import { Router } from '../../src/router/router.ts';
import { RoutedEngine } from '../../src/runtime/routed-engine.ts';
import { createWorkerPool, simPool, type WorkerPool } from '../../src/runtime/worker-pool.ts';
import { seededRandom } from '../../src/util/random.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { cpuTestModel } from '../helpers/cpu-model.ts';
import { collect } from '../helpers/outputs.ts';

let nextId = 0;
function request(promptTokenIds: number[], maxTokens = 4, cacheSalt?: string): EngineRequest {
  return {
    id: `req-${nextId++}`, promptTokenIds, priority: 0, arrivalMs: performance.timeOrigin + performance.now(), cacheSalt,
    sampling: { ...DEFAULT_SAMPLING, maxTokens, temperature: 0, ignoreEos: true },
  };
}

/** A prompt of `length` tokens that shares its first `shared` tokens with every prompt of the same group. */
function prompt(group: number, length: number, variant: number, shared = length - 8): number[] {
  return Array.from({ length }, (_, i) => (i < shared ? 10 + ((group * 7919 + i * 31) % 400) : 20 + ((variant * 13 + i) % 400)));
}

async function placementOf(pool: WorkerPool, req: EngineRequest) {
  const outputs = await collect(pool.engine.generate(req));
  const last = outputs.at(-1)!;
  return { workerId: last.routing!.workerId, cached: last.usage.cachedTokens, overlap: last.routing!.overlapBlocks };
}

describe('routed engine over simulated GPU workers', () => {
  test('a repeated long prefix lands on the worker that holds it; independent prompts spread', async () => {
    const pool = await createWorkerPool({
      engine: 'sim', workers: 4, sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity }, routerSeed: 1,
    });
    try {
      const first = await placementOf(pool, request(prompt(1, 512, 0)));
      assert.equal(first.cached, 0);
      for (let v = 1; v <= 3; v++) {
        const again = await placementOf(pool, request(prompt(1, 512, v)));
        assert.equal(again.workerId, first.workerId, 'the shared prefix pulls the request to its worker');
        assert.ok(again.cached >= 496, `cached tokens ${again.cached}`);
        assert.ok(again.overlap >= 31);
      }
      // Sixteen unrelated prompts in flight at once: the router spreads them by load over every worker.
      const placements = await Promise.all(Array.from({ length: 16 }, (_, g) =>
        placementOf(pool, request(prompt(100 + g, 256, 0), 64))));
      assert.equal(new Set(placements.map((p) => p.workerId)).size, 4);
      assert.equal(pool.engine.stats().kvBlocksUsed, 0, 'every block is free again');
    } finally {
      await pool.engine.close();
    }
  });

  test('a request for prompt logprobs is routed as if no worker held its prefix, and computes the whole prompt', async () => {
    const pool = await createWorkerPool({
      engine: 'sim', workers: 2, sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity }, routerSeed: 3,
    });
    try {
      await placementOf(pool, request(prompt(7, 256, 0)));
      const scored = request(prompt(7, 256, 1));
      scored.sampling = { ...scored.sampling, promptLogprobs: 0 };
      const outputs = await collect(pool.engine.generate(scored));
      assert.equal(outputs.at(-1)!.routing!.overlapBlocks, 0);
      assert.equal(outputs.at(-1)!.usage.cachedTokens, 0);
      assert.equal(outputs[0]!.promptLogprobs?.length, 256);
      assert.ok((await placementOf(pool, request(prompt(7, 256, 2)))).overlap > 0, 'a plain request still finds the prefix');
    } finally {
      await pool.engine.close();
    }
  });

  test('tenants with different cache salts never share cached blocks', async () => {
    const pool = await createWorkerPool({
      engine: 'sim', workers: 2, sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity }, routerSeed: 2,
    });
    try {
      await placementOf(pool, request(prompt(5, 256, 0), 4, 'tenant-a'));
      const other = await placementOf(pool, request(prompt(5, 256, 1), 4, 'tenant-b'));
      assert.equal(other.cached, 0);
      assert.equal(other.overlap, 0);
      const same = await placementOf(pool, request(prompt(5, 256, 2), 4, 'tenant-a'));
      assert.ok(same.cached > 0);
    } finally {
      await pool.engine.close();
    }
  });
});

describe('routed engine: prefix-cache reset', () => {
  test('reaches every worker and the router\'s index, and is refused while a request holds blocks', async () => {
    const pool = await createWorkerPool({
      engine: 'sim', workers: 2, sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity }, routerSeed: 4,
    });
    try {
      // A cached prefix on each worker.
      for (const group of [7, 8]) await placementOf(pool, request(prompt(group, 256, 0)));
      assert.ok((await placementOf(pool, request(prompt(7, 256, 1)))).cached > 0);

      const running = pool.engine.generate(request(prompt(9, 64, 0), 100_000));
      const iterator = running[Symbol.asyncIterator]();
      const firstOutput = await iterator.next();
      assert.equal(await pool.engine.resetPrefixCache(), false, 'a worker has blocks in use');
      pool.engine.abort(firstOutput.value.requestId);
      for (;;) if ((await iterator.next()).done) break;

      assert.equal(await pool.engine.resetPrefixCache(), true);
      for (const group of [7, 8]) {
        const again = await placementOf(pool, request(prompt(group, 256, 2)));
        assert.equal(again.cached, 0, `group ${group}: nothing cached after the reset`);
        assert.equal(again.overlap, 0, `group ${group}: the router's index was cleared too`);
      }
    } finally {
      await pool.engine.close();
    }
  });
});

describe('routed engine: a request aborted in the router\'s admission queue', () => {
  test('ends as an abort (its caller\'s reason applies), not as the queue\'s overload refusal', async () => {
    const sim = simPool({ sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: 1 } });
    const worker = sim.make({ enableKvEvents: false });
    // One request waiting for its first token makes the worker busy: the next waits in the admission queue.
    const router = new Router({ blockSize: worker.info.blockSize, policy: 'kv', busyNumWaiting: 1, random: seededRandom(1) });
    const routed = new RoutedEngine([{ id: 'w', engine: worker }], router, () => worker.now());
    try {
      const running = routed.generate(request(prompt(1, 64, 0), 100_000))[Symbol.asyncIterator]();
      const first = running.next();
      const queuedReq = request(prompt(2, 64, 0));
      const queued = collect(routed.generate(queuedReq));
      await waitUntil(() => router.stats().numQueued === 1, 'the second request waits in the admission queue', 5000);
      routed.abort(queuedReq.id);
      const outputs = await queued;
      assert.equal(outputs.length, 1);
      assert.equal(outputs[0]!.finishReason, 'abort');
      assert.equal(router.stats().numQueued, 0);
      routed.abort((await first).value.requestId);
      for (;;) if ((await running.next()).done) break;
      assert.equal(worker.stats().kvBlocksUsed, 0);
    } finally {
      await routed.close();
    }
  });
});

describe(`routed engine over real CPU workers (${cpuTestModel().name})`, () => {
  test('prefix affinity, then a killed worker leaves routing and its in-flight request fails cleanly', async () => {
    const pool = await createWorkerPool({
      engine: 'cpu', workers: 2, modelPath: cpuTestModel().path, kvCacheMemoryBytes: 16 << 20,
      threads: 1, routerSeed: 3,
    });
    try {
      const first = await placementOf(pool, request(prompt(1, 200, 0)));
      const again = await placementOf(pool, request(prompt(1, 200, 1)));
      assert.equal(again.workerId, first.workerId);
      assert.ok(again.cached >= 176, `cached ${again.cached}`);

      // Start a long request on the worker holding the prefix, then kill that worker's thread.
      const doomed = pool.engine.generate(request(prompt(1, 200, 2), 100_000));
      const iterator = doomed[Symbol.asyncIterator]();
      const firstOutput = await iterator.next();
      assert.equal(firstOutput.value.routing.workerId, first.workerId);
      const victim = pool.workers.find((w) => w.id === first.workerId)!.engine as LocalEngine;
      await victim.kill();
      await assert.rejects(async () => { for (;;) if ((await iterator.next()).done) break; }, WorkerLostError);

      assert.deepEqual(pool.routed!.workerIds, pool.workers.map((w) => w.id).filter((id) => id !== first.workerId));
      const after = await placementOf(pool, request(prompt(1, 200, 3)));
      assert.notEqual(after.workerId, first.workerId, 'new requests go to the surviving worker');
    } finally {
      await pool.engine.close();
    }
  });
});
