// A frontend holds one connection per worker, whatever order a lost connection's retry and a re-registration come
// in. Real etcd (/usr/bin/etcd) on a free loopback port, sim workers started as `conduit worker` starts them
// (startClusterWorker: a WorkerServer on 127.0.0.1, registered under a kept-alive lease), and a ClusterFrontend in
// this process (KV events on the request plane, no NATS). A worker "crashes" by closing its server while its lease
// stays alive (its key is still there, as in the seconds before a dead worker's lease lapses), and comes back with the
// same id on a new port; the frontend's planned retry (500 ms after the loss, or 1 s after a failed attempt) must not
// open a second connection to it once the re-registration has joined it. The count is taken on the worker's side.
// A worker does not take a key another live process's lease holds (discovery.ts), so the second process's record is
// put by hand here: the key changes under the frontend as when its watch missed the old key's delete, or as a worker
// of an older release registered.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import net from 'node:net';
import type { Etcd3, Lease } from 'etcd3';
import { etcdClient, workersPrefix } from '../../src/cluster/discovery.ts';
import { ClusterFrontend, type ClusterEngine } from '../../src/cluster/frontend.ts';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { ETCD_BIN, freePort, removeDir, startEtcd, stopAll, tempDir, type Etcd } from '../helpers/cluster-services.ts';
import { collect } from '../helpers/outputs.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(ETCD_BIN) ? undefined : `needs ${ETCD_BIN} (Debian etcd-server)`;
const TOKEN = 'reconnect-test-token';
const NAMESPACE = 'reconnect';
/** Longer than either planned retry (500 ms after a loss, 1 s after a failed attempt), counted from its arming. */
const PAST_THE_RETRIES_MS = 1600;

let nextId = 0;
function request(maxTokens: number): EngineRequest {
  return {
    id: `reconnect-${nextId++}`, promptTokenIds: Array.from({ length: 48 }, (_, i) => 100 + ((i * 37) % 900)), priority: 0,
    arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens, ignoreEos: true, temperature: 0 },
  };
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

describe('a frontend connects to a worker once', { skip }, () => {
  let dir: string;
  let etcd: Etcd;
  let frontend: ClusterFrontend;
  let engine: ClusterEngine;
  const logs: string[] = [];
  const workers: RunningWorker[] = [];
  const proxies: net.Server[] = [];
  let client: Etcd3;
  /** Leases the test put second processes' records under, by worker id. */
  const handLeases: { id: string; lease: Lease }[] = [];

  async function startWorker(workerId: string, advertiseAddress?: (port: number) => Promise<string>, register = true): Promise<RunningWorker> {
    const port = await freePort();
    const worker = await startClusterWorker({
      workerId, role: 'both', namespace: NAMESPACE, clusterToken: TOKEN, host: '127.0.0.1', port,
      ...(advertiseAddress ? { advertiseAddress: await advertiseAddress(port) } : {}),
      ...(register ? { etcd: { endpoints: [etcd.url] } } : {}), leaseTtlSeconds: 5,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity } },
      log: () => {},
    });
    workers.push(worker);
    return worker;
  }

  /** Another process of a worker whose first one keeps its lease: its record put at the key by hand. */
  async function startSecondProcess(workerId: string): Promise<RunningWorker> {
    const worker = await startWorker(workerId, undefined, false);
    const lease = client.lease(5);
    await lease.put(`${workersPrefix(NAMESPACE)}${workerId}`).value(JSON.stringify(worker.record));
    handLeases.push({ id: workerId, lease });
    return worker;
  }

  /** What the frontend shows for the worker: its address and state. */
  function view(id: string): { address: string; state: string } | undefined {
    return frontend.workerViews().find((w) => w.id === id);
  }

  async function joinedAt(worker: RunningWorker): Promise<void> {
    await waitUntil(() => worker.server.frontendConnections >= 1 && view(worker.record.id)?.address === worker.address
      && view(worker.record.id)?.state === 'ready', `the frontend joined ${worker.record.id} at ${worker.address}`, 20_000);
  }

  async function completes(id: string): Promise<void> {
    const outputs = await collect(engine.generate(request(8)));
    assert.equal(outputs.length, 8);
    assert.equal(outputs.at(-1)!.finishReason, 'length');
    assert.equal(outputs.at(-1)!.routing?.workerId, id);
  }

  /** A worker of its own for each test, joined; and what the frontend saw of it so far. */
  async function firstWorker(id: string): Promise<RunningWorker> {
    const worker = await startWorker(id);
    engine = await frontend.ready() as ClusterEngine;
    await joinedAt(worker);
    assert.deepEqual(engine.workerIds, [id]);
    await completes(id);
    return worker;
  }

  /** The test's workers leave (their keys go): the next test starts with none. */
  async function leave(id: string): Promise<void> {
    for (const worker of workers.filter((w) => w.record.id === id)) await worker.shutdown(0);
    for (const { lease } of handLeases.filter((h) => h.id === id)) await lease.revoke();
    await waitUntil(() => !engine?.workerIds.includes(id) && view(id) === undefined, `${id} left`, 20_000);
  }

  const lossesOf = (id: string) => logs.filter((l) => l.startsWith(`warn worker ${id}: `)).length;
  const failedAttemptsOf = (id: string) => logs.filter((l) => l.includes(`retrying in 1 s while ${id} is registered`)).length;

  before(async () => {
    dir = tempDir('reconnect');
    etcd = await startEtcd(dir);
    client = etcdClient({ endpoints: [etcd.url] });
    frontend = new ClusterFrontend({
      namespace: NAMESPACE, clusterToken: TOKEN, etcd: etcdClient({ endpoints: [etcd.url] }),
      log: (level, message) => { logs.push(`${level} ${message}`); },
    });
    await frontend.start();
  });

  after(async () => {
    await frontend?.close();
    for (const worker of workers) await worker.shutdown(0);
    for (const proxy of proxies) await new Promise((resolve) => proxy.close(resolve));
    client?.close();
    await stopAll();
    removeDir(dir);
  });

  test('the connection is lost, the worker re-registers at a new port before the 500 ms retry: one connection', async () => {
    try {
      const crashed = await firstWorker('w1');
      const lostBefore = lossesOf('w1');
      // Its server goes (the connection drops); its lease is kept alive, so its key stays.
      await crashed.server.close();
      await waitUntil(() => lossesOf('w1') > lostBefore, 'the frontend saw the connection drop', 20_000);
      const restarted = await startSecondProcess('w1');
      await joinedAt(restarted);
      await sleep(PAST_THE_RETRIES_MS);
      assert.equal(restarted.server.frontendConnections, 1, 'one connection from the frontend, not one per reconnection path');
      assert.deepEqual(engine.workerIds, ['w1']);
      await completes('w1');
      assert.equal(restarted.server.frontendConnections, 1);
    } finally {
      await leave('w1');
    }
  });

  test('an attempt failed (1 s retry planned), the worker re-registers meanwhile: one connection', async () => {
    try {
      const crashed = await firstWorker('w2');
      const failedBefore = failedAttemptsOf('w2');
      await crashed.server.close();
      // The 500 ms retry goes to the old port, which refuses: the next retry is planned 1 s later.
      await waitUntil(() => failedAttemptsOf('w2') > failedBefore, 'the retry to the old port failed', 20_000);
      const restarted = await startSecondProcess('w2');
      await joinedAt(restarted);
      await sleep(PAST_THE_RETRIES_MS);
      assert.equal(restarted.server.frontendConnections, 1);
      assert.deepEqual(engine.workerIds, ['w2']);
      await completes('w2');
      assert.equal(restarted.server.frontendConnections, 1);
    } finally {
      await leave('w2');
    }
  });

  test('the worker re-registers at a new port while its old connection stands: that one closes, one connection', async () => {
    try {
      const old = await firstWorker('w3');
      assert.equal(old.server.frontendConnections, 1);
      const replacement = await startSecondProcess('w3');
      await joinedAt(replacement);
      await sleep(PAST_THE_RETRIES_MS);
      assert.equal(replacement.server.frontendConnections, 1);
      await waitUntil(() => old.server.frontendConnections === 0, 'the old connection closed', 20_000);
      assert.deepEqual(engine.workerIds, ['w3']);
      await completes('w3');
    } finally {
      await leave('w3');
    }
  });

  test('the connection drops while the worker stays at its address: the retry reconnects, once', async () => {
    try {
      // The worker is reached through a TCP relay on 127.0.0.1 whose connections the test cuts (a network blip): the
      // key and the address stay, so only the frontend's own retry brings the connection back.
      const sockets = new Set<net.Socket>();
      const proxyPort = await freePort();
      let behind = 0;
      const proxy = net.createServer((downstream) => {
        const upstream = net.connect({ host: '127.0.0.1', port: behind });
        for (const socket of [downstream, upstream]) {
          sockets.add(socket);
          socket.on('error', () => {});
          socket.on('close', () => { sockets.delete(socket); downstream.destroy(); upstream.destroy(); });
        }
        downstream.pipe(upstream);
        upstream.pipe(downstream);
      });
      proxies.push(proxy);
      await new Promise<void>((resolve) => proxy.listen(proxyPort, '127.0.0.1', resolve));
      const relayed = await startWorker('w4', async (port) => {
        behind = port;
        return `127.0.0.1:${proxyPort}`;
      });
      engine = await frontend.ready() as ClusterEngine;
      await joinedAt(relayed);
      assert.equal(relayed.server.frontendConnections, 1);

      const lostBefore = lossesOf('w4');
      for (const socket of sockets) socket.destroy();
      await waitUntil(() => lossesOf('w4') > lostBefore, 'the frontend saw the connection drop', 20_000);
      await waitUntil(() => relayed.server.frontendConnections === 0, 'the worker saw the connection drop', 20_000);
      await joinedAt(relayed);
      await sleep(PAST_THE_RETRIES_MS);
      assert.equal(relayed.server.frontendConnections, 1);
      assert.deepEqual(engine.workerIds, ['w4']);
      await completes('w4');
    } finally {
      await leave('w4');
    }
  });
});
