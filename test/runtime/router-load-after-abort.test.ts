// The router's figure of each worker's load follows the worker after requests end without their last output reaching
// a reader (a client that stopped reading: its request is aborted on the worker). The load came only with outputs
// handed to a reader, so such a request stayed counted as running on its worker, with its blocks, until a later
// request there produced an output; a worker counted busy that way got no requests to correct it.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { createWorkerPool } from '../../src/runtime/worker-pool.ts';
import { cpuTestModel } from '../helpers/cpu-model.ts';
import { waitUntil } from '../helpers/wait-until.ts';

test('after readers stop early on every request, the router sees idle workers as idle', { timeout: 120_000 }, async () => {
  const pool = await createWorkerPool({
    engine: 'cpu', modelPath: cpuTestModel().path, workers: 2, threads: 1, maxNumSeqs: 1, routerSeed: 3,
  });
  try {
    const request = (i: number): EngineRequest => ({
      id: `stop-early-${i}`, promptTokenIds: Array.from({ length: 20 }, (_, j) => 30 + ((i * 97 + j * 13) % 200)), priority: 0,
      arrivalMs: performance.timeOrigin + performance.now(),
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 200, temperature: 0, ignoreEos: true },
    });
    // Each reader leaves after a few outputs: the routed engine aborts its request on the worker.
    await Promise.all(Array.from({ length: 12 }, async (_, i) => {
      let seen = 0;
      for await (const output of pool.engine.generate(request(i))) {
        void output;
        if (++seen > 3) break;
      }
    }));
    const routed = pool.routed!;
    await waitUntil(() => routed.workerStats().every((w) => w.stats.numRunning === 0 && w.stats.numWaiting === 0 && w.stats.kvBlocksUsed === 0),
      'both workers report nothing running and no block in use', 30_000);
    // What the router weighs for a new request on each worker: its running requests' blocks plus the new one's.
    const probe = { requestId: 'probe', tokenIds: Array.from({ length: 20 }, (_, j) => 250 + j) };
    const outcome = pool.router!.route(probe, performance.timeOrigin + performance.now(), { commit: false });
    assert.equal(outcome.kind, 'routed');
    const terms = outcome.kind === 'routed' ? outcome.decision.costTerms : [];
    assert.equal(terms.length, 2);
    const own = Math.ceil(probe.tokenIds.length / 16);
    for (const t of terms) {
      assert.equal(t.busy, false, `${t.workerId} is counted busy`);
      assert.ok(t.decodeBlocks <= own, `${t.workerId}: the router still counts ${t.decodeBlocks - own} blocks of ended requests`);
    }
  } finally {
    await pool.engine.close();
  }
});
