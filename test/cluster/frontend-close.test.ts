// A closed ClusterFrontend keeps no connection open, also those its engine no longer holds: a worker that said it
// drains (the engine dropped it, the connection stays for the streams it finishes) and a worker whose key went while
// its streams finished (leaving). Real etcd (/usr/bin/etcd) on a free loopback port, a sim worker (real time) started
// as `conduit worker` starts it, a ClusterFrontend in this process; the worker counts the frontend connections open.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import type { FrontendEngine } from '../../src/cluster/frontend.ts';
import { ETCD_BIN, freePort } from '../helpers/cluster-services.ts';
import { frontendBed } from '../helpers/frontend-bed.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(ETCD_BIN) ? undefined : `needs ${ETCD_BIN} (Debian etcd-server)`;
const TOKEN = 'frontend-close-test-token';

describe('a closed frontend', { skip }, () => {
  const bed = frontendBed('frontend-close', TOKEN);

  async function startWorker(namespace: string, workerId: string): Promise<RunningWorker> {
    const worker = await startClusterWorker({
      workerId, role: 'both', namespace, clusterToken: TOKEN, host: '127.0.0.1', port: await freePort(),
      etcd: { endpoints: [bed.etcdUrl] }, leaseTtlSeconds: 5,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: 1 } },
      log: () => {},
    });
    bed.workers.push(worker);
    return worker;
  }

  let nextId = 0;
  /** A request that runs for many seconds of simulated decode in real time. */
  function longRequest(): EngineRequest {
    return {
      id: `frontend-close-${nextId++}`, promptTokenIds: Array.from({ length: 64 }, (_, i) => 200 + i), priority: 0, arrivalMs: engineNow(),
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 4000, ignoreEos: true },
    };
  }

  /** Starts a long request and resolves once its first output came; the stream goes on in the background. */
  async function streaming(engine: FrontendEngine): Promise<void> {
    const outputs = engine.generate(longRequest())[Symbol.asyncIterator]();
    await outputs.next();
    void (async () => {
      try {
        while (!(await outputs.next()).done);
      } catch {
        // The frontend closed under it.
      }
    })();
  }

  test('closes a draining worker\'s connection the engine dropped', async () => {
    const { frontend, namespace } = await bed.startFrontend([]);
    const worker = await startWorker(namespace, 'w1');
    const engine = await frontend.ready();
    await streaming(engine);
    // The worker drains (its key stays): the frontend takes it out of its router and keeps the connection for the
    // stream it finishes.
    const drained = worker.server.drain(60_000);
    await waitUntil(() => frontend.workerViews().some((w) => w.id === 'w1' && w.state === 'draining'), 'the frontend saw the drain', 10_000);
    assert.equal(worker.server.frontendConnections, 1);
    await frontend.close();
    await waitUntil(() => worker.server.frontendConnections === 0, 'the closed frontend\'s connection is closed', 5_000);
    await drained;
  });

  test('closes the connection of a worker whose key went while its stream finishes', async () => {
    const { frontend, namespace } = await bed.startFrontend([]);
    const worker = await startWorker(namespace, 'w1');
    const engine = await frontend.ready();
    await streaming(engine);
    // A shutdown deregisters (the key goes) and drains: the frontend keeps the connection while the stream runs.
    const shutdown = worker.shutdown(60_000);
    await waitUntil(() => !frontend.workerViews().some((w) => w.id === 'w1'), 'the frontend saw the key go', 10_000);
    assert.equal(worker.server.frontendConnections, 1);
    await frontend.close();
    await waitUntil(() => worker.server.frontendConnections === 0, 'the closed frontend\'s connection is closed', 5_000);
    await shutdown;
  });
});
