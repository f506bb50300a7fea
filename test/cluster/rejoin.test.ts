// A worker whose connection drops and comes back, again and again, is one worker to the frontend's engine: the
// readiness it reports (what /health says when no worker can serve) counts it once, and a worker that leaves for good
// (its key goes) is not counted any more. Real etcd (/usr/bin/etcd) on a free loopback port, sim workers started as
// `conduit worker` starts them, each reached through a TCP relay on 127.0.0.1 whose connections the test cuts (the
// worker stays registered at the same address: the frontend's own retry brings the connection back), and a
// ClusterFrontend in this process (KV events on the request plane, no NATS).
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import type { ClusterFrontend } from '../../src/cluster/frontend.ts';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import type { WorkerRole } from '../../src/engine/types.ts';
import { ETCD_BIN, freePort } from '../helpers/cluster-services.ts';
import { frontendBed } from '../helpers/frontend-bed.ts';
import { startTcpRelay, type TcpRelay } from '../helpers/tcp-relay.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(ETCD_BIN) ? undefined : `needs ${ETCD_BIN} (Debian etcd-server)`;
const TOKEN = 'rejoin-test-token';
const REJOINS = 3;

describe('a worker that drops and rejoins is counted once', { skip }, () => {
  const bed = frontendBed('rejoin', TOKEN);

  /** A worker behind a relay of its own: it advertises the relay's address. */
  async function startWorker(namespace: string, workerId: string, role: WorkerRole): Promise<{ worker: RunningWorker; relay: TcpRelay; port: number }> {
    const port = await freePort();
    const relay = await startTcpRelay(port);
    bed.relays.push(relay);
    const worker = await startClusterWorker({
      workerId, role, namespace, clusterToken: TOKEN, host: '127.0.0.1', port, advertiseAddress: relay.address,
      etcd: { endpoints: [bed.etcdUrl] }, leaseTtlSeconds: 5,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity } },
      log: () => {},
    });
    bed.workers.push(worker);
    return { worker, relay, port };
  }

  const stateOf = (frontend: ClusterFrontend, id: string) => frontend.workerViews().find((w) => w.id === id)?.state;
  const lossesOf = (logs: string[], id: string) => logs.filter((l) => l.startsWith(`warn worker ${id}: `)).length;

  /** The relay's connections are cut REJOINS times; each time the frontend reconnects and the worker joins again. */
  async function dropAndRejoin(frontend: ClusterFrontend, logs: string[], id: string, relay: TcpRelay): Promise<void> {
    for (let i = 0; i < REJOINS; i++) {
      const lost = lossesOf(logs, id);
      const accepted = relay.accepted;
      relay.cut();
      await waitUntil(() => lossesOf(logs, id) > lost, `the frontend saw ${id}'s connection drop (${i + 1})`, 20_000);
      await waitUntil(() => relay.accepted > accepted && stateOf(frontend, id) === 'ready', `${id} joined again (${i + 1})`, 20_000);
    }
  }

  test('aggregated: readiness counts a rejoined worker once, and a worker that left not at all', async () => {
    const logs: string[] = [];
    const { frontend, namespace } = await bed.startFrontend(logs);
    const { relay } = await startWorker(namespace, 'a1', 'both');
    await frontend.ready();
    await waitUntil(() => stateOf(frontend, 'a1') === 'ready', 'a1 joined', 20_000);
    const engine = frontend.engine!;
    assert.deepEqual(engine.readiness(), { ready: true, workersAlive: 1, workersTotal: 1 });

    await dropAndRejoin(frontend, logs, 'a1', relay);
    // A frontend starts no worker process, so it restarts none: its log says so as it is, at debug level.
    assert.ok(logs.includes('debug worker a1 is not restarted (a worker process that starts again registers by itself)'), logs.join('\n'));
    assert.ok(!logs.some((l) => l.includes('restarts are off')), logs.join('\n'));
    assert.deepEqual(engine.workerIds, ['a1']);
    assert.deepEqual(engine.readiness(), { ready: true, workersAlive: 1, workersTotal: 1 },
      `one worker after ${REJOINS} rejoins, not ${REJOINS + 1}`);

    // A second worker joins, then leaves for good (SIGTERM: its key goes): it is not counted any more.
    const second = await startWorker(namespace, 'a2', 'both');
    await waitUntil(() => stateOf(frontend, 'a2') === 'ready' && engine.workerIds.includes('a2'), 'a2 joined', 20_000);
    assert.deepEqual(engine.readiness(), { ready: true, workersAlive: 2, workersTotal: 2 });
    await second.worker.shutdown(0);
    await waitUntil(() => stateOf(frontend, 'a2') === undefined, 'a2 left', 20_000);
    assert.deepEqual(engine.readiness(), { ready: true, workersAlive: 1, workersTotal: 1 }, 'the worker that left is not counted');
  });

  test('disaggregated: the decode worker that rejoined is "its one decode worker" when it is lost', async () => {
    const logs: string[] = [];
    const { frontend, namespace } = await bed.startFrontend(logs);
    const { relay, port } = await startWorker(namespace, 'd1', 'decode');
    await frontend.ready();
    await waitUntil(() => stateOf(frontend, 'd1') === 'ready', 'd1 joined', 20_000);
    const engine = frontend.disaggregated!;

    await dropAndRejoin(frontend, logs, 'd1', relay);
    assert.deepEqual(engine.readiness(), { ready: true, workersAlive: 1, workersTotal: 1 });
    assert.ok(logs.includes('debug decode worker d1 is not restarted (a worker process that starts again registers by itself)'), logs.join('\n'));
    assert.ok(!logs.some((l) => l.includes('restarts are off')), logs.join('\n'));

    // The relay now leads nowhere: the connection drops and every retry fails, while the key stays.
    const lost = lossesOf(logs, 'd1');
    relay.target = await freePort();
    relay.cut();
    await waitUntil(() => lossesOf(logs, 'd1') > lost, 'the frontend saw d1 drop', 20_000);
    const readiness = engine.readiness();
    assert.equal(readiness.ready, false);
    assert.equal(readiness.workersTotal, 1);
    // A frontend restarts no worker process (they come back by registering again): /health does not say it tried.
    assert.equal(readiness.reason, 'no decode worker can serve: its one decode worker was lost, and this process does not restart decode workers');

    // The relay leads to it again: a retry reaches it, and it is counted once still.
    relay.target = port;
    await waitUntil(() => stateOf(frontend, 'd1') === 'ready', 'd1 joined again', 20_000);
    assert.deepEqual(engine.readiness(), { ready: true, workersAlive: 1, workersTotal: 1 });
  });
});
