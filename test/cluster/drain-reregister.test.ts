// A worker that drains tells its frontends so on its connection (WorkerServer.drain: new requests are refused, the
// running ones finish); the frontend takes it out of its router and keeps the connection for those streams, and plans
// no reconnection (the worker is leaving). When the worker's key then names another process at the same address (a
// restart behind a fixed address: a proxy, a service, a forwarded port), the frontend must connect to that process,
// whether its registration comes after the drain notice or before it. Real etcd (/usr/bin/etcd) on a free loopback
// port, sim workers started as `conduit worker` starts them, both processes of a worker behind one TCP relay on
// 127.0.0.1 (the address they advertise; new connections go to the process the test points it at), and a
// ClusterFrontend in this process (KV events on the request plane, no NATS). The old process drains with its key still
// there (as when its lease revoke did not reach etcd and the key lapses later, or the frontend's watch was away while
// the key went and came back): that is the case where the frontend sees the drain and the new registration on one key.
// A worker does not take a key another live process's lease holds (discovery.ts), so the new process's record is put
// at the key by hand, as the frontend sees it when its watch missed the old key's delete.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import type { Etcd3, Lease } from 'etcd3';
import { etcdClient, workersPrefix } from '../../src/cluster/discovery.ts';
import { ClusterFrontend, type ClusterEngine } from '../../src/cluster/frontend.ts';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { ETCD_BIN, freePort, removeDir, startEtcd, stopAll, tempDir, type Etcd } from '../helpers/cluster-services.ts';
import { collect } from '../helpers/outputs.ts';
import { startTcpRelay, type TcpRelay } from '../helpers/tcp-relay.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(ETCD_BIN) ? undefined : `needs ${ETCD_BIN} (Debian etcd-server)`;
const TOKEN = 'drain-reregister-test-token';
const NAMESPACE = 'drain-reregister';

let nextId = 0;
function request(maxTokens: number): EngineRequest {
  return {
    id: `drain-reregister-${nextId++}`, promptTokenIds: Array.from({ length: 48 }, (_, i) => 100 + ((i * 37) % 900)), priority: 0,
    arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens, ignoreEos: true, temperature: 0 },
  };
}

describe('a draining worker whose key names a new process at the same address', { skip }, () => {
  let dir: string;
  let etcd: Etcd;
  let frontend: ClusterFrontend;
  let engine: ClusterEngine;
  const workers: RunningWorker[] = [];
  const relays: TcpRelay[] = [];
  let client: Etcd3;
  /** Leases the test put new processes' records under, by worker id. */
  const handLeases: { id: string; lease: Lease }[] = [];

  before(async () => {
    dir = tempDir('drain-reregister');
    etcd = await startEtcd(dir);
    client = etcdClient({ endpoints: [etcd.url] });
    frontend = new ClusterFrontend({
      namespace: NAMESPACE, clusterToken: TOKEN, etcd: etcdClient({ endpoints: [etcd.url] }), log: () => {},
    });
    await frontend.start();
  });

  after(async () => {
    await frontend?.close();
    for (const worker of workers) await worker.shutdown(0);
    for (const relay of relays) await relay.close();
    client?.close();
    await stopAll();
    removeDir(dir);
  });

  /** A worker process behind the relay: new connections through it go to this one from now on. */
  async function startWorker(workerId: string, relay: TcpRelay, register = true): Promise<RunningWorker> {
    const port = await freePort();
    relay.target = port;
    const worker = await startClusterWorker({
      workerId, role: 'both', namespace: NAMESPACE, clusterToken: TOKEN, host: '127.0.0.1', port, advertiseAddress: relay.address,
      ...(register ? { etcd: { endpoints: [etcd.url] } } : {}), leaseTtlSeconds: 5,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity } },
      log: () => {},
    });
    workers.push(worker);
    return worker;
  }

  /** The worker's new process, its record put at the key by hand (the old one keeps its lease). */
  async function startNewProcess(workerId: string, relay: TcpRelay): Promise<RunningWorker> {
    const worker = await startWorker(workerId, relay, false);
    const lease = client.lease(5);
    await lease.put(`${workersPrefix(NAMESPACE)}${workerId}`).value(JSON.stringify(worker.record));
    handLeases.push({ id: workerId, lease });
    return worker;
  }

  const view = (id: string) => frontend.workerViews().find((w) => w.id === id);

  async function joined(worker: RunningWorker, what: string): Promise<void> {
    await waitUntil(() => worker.server.frontendConnections === 1 && view(worker.record.id)?.state === 'ready'
      && engine.workerIds.includes(worker.record.id), what, 20_000);
  }

  /** The first process of a worker, behind a relay of its own, joined. */
  async function firstProcess(id: string): Promise<{ old: RunningWorker; relay: TcpRelay }> {
    const relay = await startTcpRelay(0);
    relays.push(relay);
    const old = await startWorker(id, relay);
    engine = await frontend.ready() as ClusterEngine;
    await joined(old, `${id} joined`);
    return { old, relay };
  }

  /** The new process serves the worker's requests; the old one has no connection from the frontend left. */
  async function servedByTheNewProcess(id: string, old: RunningWorker, replacement: RunningWorker): Promise<void> {
    await joined(replacement, `the frontend connected to ${id}'s new process`);
    await waitUntil(() => old.server.frontendConnections === 0, `the old process's connection closed`, 20_000);
    assert.deepEqual(engine.workerIds, [id]);
    const outputs = await collect(engine.generate(request(8)));
    assert.equal(outputs.length, 8);
    assert.equal(outputs.at(-1)!.finishReason, 'length');
    assert.equal(outputs.at(-1)!.routing?.workerId, id);
    assert.equal(replacement.server.frontendConnections, 1);
  }

  async function leave(id: string): Promise<void> {
    for (const worker of workers.filter((w) => w.record.id === id)) await worker.shutdown(0);
    for (const { lease } of handLeases.filter((h) => h.id === id)) await lease.revoke();
    await waitUntil(() => view(id) === undefined, `${id} left`, 20_000);
  }

  test('it drains, then a new process registers at its address: the frontend connects to the new one', async () => {
    try {
      const { old, relay } = await firstProcess('w1');
      await old.server.drain(0);
      await waitUntil(() => view('w1')?.state === 'draining' && !engine.workerIds.includes('w1'), 'the frontend saw w1 drain', 20_000);
      const replacement = await startNewProcess('w1', relay);
      await servedByTheNewProcess('w1', old, replacement);
    } finally {
      await leave('w1');
    }
  });

  test('a new process registers at its address, then the old one drains: the frontend ends on the new one', async () => {
    try {
      const { old, relay } = await firstProcess('w2');
      const replacement = await startNewProcess('w2', relay);
      await old.server.drain(0);
      await servedByTheNewProcess('w2', old, replacement);
    } finally {
      await leave('w2');
    }
  });
});
