// How a worker's load reaches its router: each stats report the worker sends is given to the router as it comes
// (WorkerGroup's onStats listener), and the routed and disaggregated engines read the worker's stats() again after
// each output only when it may hold more than those reports. A worker thread (LocalEngine) reports every change, so
// its streams cost the router one update per engine step, not one more per streamed token; a worker process
// (RemoteEngine) whose stats() took a newer load snapshot from the event plane still hands it to the router with
// the next output.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { WorkerServer } from '../../src/cluster/worker-server.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { createLocalEngine, type LocalEngineBundle } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { workerLoadFromStats, type EngineStats, type WorkerLoad } from '../../src/protocols/worker.ts';
import type { Router } from '../../src/router/router.ts';
import { RoutedEngine } from '../../src/runtime/routed-engine.ts';
import type { RoutableEngine } from '../../src/runtime/worker-group.ts';
import { createWorkerPool, makeRouter } from '../../src/runtime/worker-pool.ts';
import { cpuTestModel } from '../helpers/cpu-model.ts';
import { collect } from '../helpers/outputs.ts';
import { waitUntil } from '../helpers/wait-until.ts';

let nextId = 0;
function request(promptLength: number, maxTokens: number): EngineRequest {
  const group = nextId;
  return {
    id: `load-${nextId++}`, promptTokenIds: Array.from({ length: promptLength }, (_, i) => 30 + ((group * 7919 + i * 53) % 200)),
    priority: 0, arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens, temperature: 0, ignoreEos: true },
  };
}

interface LoadWatch {
  /** Every router.updateLoad call, in order. */
  updates: { workerId: string; load: WorkerLoad }[];
  /** Stats reports the workers sent. */
  reports: number;
  /** Reports after which the router's load for that worker was not the report's. */
  missed: string[];
  stop(): void;
}

/**
 * Records the router's load updates and the workers' stats reports from now on. A report's listener here runs after
 * the group's (subscribed when the worker joined), so it sees what the router holds once the report was taken.
 */
function watchLoad(router: Router, workers: readonly { id: string; engine: RoutableEngine }[]): LoadWatch {
  const watch: LoadWatch = { updates: [], reports: 0, missed: [], stop: () => {} };
  const updateLoad = router.updateLoad.bind(router);
  router.updateLoad = (workerId, load) => {
    watch.updates.push({ workerId, load });
    updateLoad(workerId, load);
  };
  const offs = workers.map(({ id, engine }) => engine.onStats!((stats: EngineStats) => {
    watch.reports++;
    const last = watch.updates.findLast((u) => u.workerId === id);
    if (!last || JSON.stringify(last.load) !== JSON.stringify(workerLoadFromStats(stats))) watch.missed.push(id);
  }));
  watch.stop = () => {
    router.updateLoad = updateLoad;
    for (const off of offs) off();
  };
  return watch;
}

describe('the router\'s load for worker threads', () => {
  test('routed: one update per stats report, none more per streamed output', { timeout: 120_000 }, async () => {
    const pool = await createWorkerPool({
      engine: 'cpu', modelPath: cpuTestModel().path, workers: 2, threads: 1, routerSeed: 3, kvCacheMemoryBytes: 8 << 20,
    });
    try {
      const watch = watchLoad(pool.router!, pool.workers as { id: string; engine: RoutableEngine }[]);
      const streams = await Promise.all([0, 1, 2].map(() => collect(pool.engine.generate(request(24, 16)))));
      watch.stop();
      const outputs = streams.reduce((sum, s) => sum + s.length, 0);
      assert.ok(outputs >= 3 * 16, `${outputs} outputs`);
      assert.ok(watch.reports > 0, 'the workers reported their stats');
      assert.deepEqual(watch.missed, [], 'after every report the router holds that report\'s load');
      assert.equal(watch.updates.length, watch.reports,
        `${watch.updates.length} load updates for ${watch.reports} stats reports and ${outputs} outputs`);
    } finally {
      await pool.engine.close();
    }
  });

  test('disaggregated: one update per stats report on either router, remote prefill or local', { timeout: 120_000 }, async () => {
    const pool = await createWorkerPool({
      engine: 'cpu', modelPath: cpuTestModel().path, workers: 1, prefillWorkers: 1, decodeWorkers: 1, threads: 1, routerSeed: 7,
      kvCacheMemoryBytes: 8 << 20, disaggregationPolicy: { minRemotePrefillTokens: 32 },
      // A transfer always beats a local prefill here: a long prompt goes remote whatever the timing.
      disaggregationEstimates: { transferBytesPerSec: 1e12, prefillTokensPerSec: 1e3, fixed: true },
    });
    try {
      const role = (r: string) => pool.workers.filter((w) => w.role === r) as { id: string; engine: RoutableEngine }[];
      const prefill = watchLoad(pool.prefillRouter!, role('prefill'));
      const decode = watchLoad(pool.decodeRouter!, role('decode'));
      const remote = await collect(pool.engine.generate(request(48, 12)));
      const local = await collect(pool.engine.generate(request(8, 12)));
      prefill.stop();
      decode.stop();
      assert.equal(remote.at(-1)!.routing!.disaggregation?.mode, 'disaggregated', remote.at(-1)!.routing!.disaggregation?.detail);
      assert.equal(local.at(-1)!.routing!.disaggregation?.mode, 'local');
      for (const [name, watch] of [['prefill', prefill], ['decode', decode]] as const) {
        assert.ok(watch.reports > 0, `the ${name} worker reported its stats`);
        assert.deepEqual(watch.missed, [], `${name}: after every report the router holds that report's load`);
        assert.equal(watch.updates.length, watch.reports, `${name}: ${watch.updates.length} load updates for ${watch.reports} stats reports`);
      }
    } finally {
      await pool.engine.close();
    }
  });
});

describe('the router\'s load for a worker process', () => {
  const TOKEN = 'worker-group-load-token';
  let bundle: LocalEngineBundle;
  let server: WorkerServer;
  let remote: RemoteEngine;
  let router: Router;
  let routed: RoutedEngine;

  before(async () => {
    bundle = await createLocalEngine({ modelPath: cpuTestModel().path, threads: 1, kvCacheMemoryBytes: 8 << 20 });
    server = new WorkerServer({ workerId: 'wp', engine: bundle.engine, clusterToken: TOKEN, tokenizer: bundle.tokenizer, chatTemplate: bundle.chatTemplate });
    const port = await server.listen(0, '127.0.0.1');
    remote = await RemoteEngine.connect(`127.0.0.1:${port}`, { clusterToken: TOKEN, events: true });
    router = makeRouter({ routingPolicy: 'kv', routerSeed: 3 }, bundle.engine.info.blockSize, 0);
    routed = new RoutedEngine([{ id: 'wp', engine: remote }], router, engineNow);
  });

  after(async () => {
    await routed?.close();
    await server?.close();
    await bundle?.engine.close();
  });

  test('its connection\'s reports alone: one update per report', { timeout: 60_000 }, async () => {
    const watch = watchLoad(router, [{ id: 'wp', engine: remote }]);
    const outputs = await collect(routed.generate(request(24, 16)));
    watch.stop();
    assert.ok(outputs.length >= 16);
    assert.deepEqual(watch.missed, []);
    assert.equal(watch.updates.length, watch.reports, `${watch.updates.length} load updates for ${watch.reports} stats reports`);
  });

  test('an event-plane snapshot newer than its last report reaches the router with the next output', { timeout: 60_000 }, async () => {
    const stream = routed.generate(request(24, 8))[Symbol.asyncIterator]();
    assert.equal((await stream.next()).done, false);
    // Every output of the request is on this side once the worker reported it ended: the rest wait unread.
    await waitUntil(() => remote.stats().numRunning === 0, 'the stream\'s end reaches the connection', 30_000);
    const latest = remote.stats();
    assert.ok(latest.reportSeq !== undefined, 'a worker process numbers its reports');
    const snapshot = { ...latest, numWaiting: 7, reportSeq: latest.reportSeq + 1 };
    remote.deliverStats(snapshot);
    assert.equal(remote.statsReported, false, 'the snapshot went to no onStats listener');
    const watch = watchLoad(router, [{ id: 'wp', engine: remote }]);
    assert.equal((await stream.next()).done, false);
    watch.stop();
    assert.deepEqual(watch.updates.at(-1), { workerId: 'wp', load: workerLoadFromStats(snapshot) }, 'the router has the snapshot\'s load');
    while (!(await stream.next()).done) { /* to the end */ }
  });
});
