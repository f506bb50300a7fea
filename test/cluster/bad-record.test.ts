// A worker key that names no usable worker (here: a worker registered with --advertise-address lacking its port) is
// logged once and ignored by every frontend watching the namespace, running or started later; the frontend serves
// on with its other workers. Nothing a discovery handler throws escapes into etcd's watch stream. Real etcd
// (/usr/bin/etcd) on a free loopback port, a sim worker started as `conduit worker` starts it, ClusterFrontends in
// this process.
import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import type { Etcd3 } from 'etcd3';
import { etcdClient, WorkerWatch, type WorkerRecord } from '../../src/cluster/discovery.ts';
import { ClusterFrontend } from '../../src/cluster/frontend.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineOutput } from '../../src/engine/types.ts';
import { ETCD_BIN, freePort } from '../helpers/cluster-services.ts';
import { frontendBed } from '../helpers/frontend-bed.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(ETCD_BIN) ? undefined : `needs ${ETCD_BIN} (Debian etcd-server)`;
const TOKEN = 'bad-record-test-token';

describe('a worker key that names no usable worker', { skip }, () => {
  const bed = frontendBed('bad-record', TOKEN);
  const clients: Etcd3[] = [];
  const others: { close(): Promise<void> }[] = [];

  after(async () => {
    for (const other of others) await other.close();
    for (const client of clients) client.close();
  });

  function client(): Etcd3 {
    const c = etcdClient({ endpoints: [bed.etcdUrl] });
    clients.push(c);
    return c;
  }

  async function startWorker(namespace: string, workerId: string): Promise<RunningWorker> {
    const worker = await startClusterWorker({
      workerId, role: 'both', namespace, clusterToken: TOKEN, host: '127.0.0.1', port: await freePort(),
      etcd: { endpoints: [bed.etcdUrl] }, leaseTtlSeconds: 5,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity } },
      log: () => {},
    });
    bed.workers.push(worker);
    return worker;
  }

  let nextId = 0;
  async function serve(frontend: ClusterFrontend): Promise<EngineOutput[]> {
    const engine = await frontend.ready();
    const outputs: EngineOutput[] = [];
    const request = {
      id: `bad-record-${nextId++}`, promptTokenIds: Array.from({ length: 40 }, (_, i) => 100 + i), priority: 0, arrivalMs: engineNow(),
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 4, ignoreEos: true },
    };
    for await (const output of engine.generate(request)) outputs.push(output);
    return outputs;
  }

  const ignored = (logs: string[], key: string) => logs.filter((l) => l.startsWith(`warn etcd: ignoring ${key}: `));
  const stateOf = (frontend: ClusterFrontend, id: string) => frontend.workerViews().find((w) => w.id === id)?.state;

  test('an address without a port is logged once and ignored; running and new frontends serve on', async () => {
    const logs: string[] = [];
    const { frontend, namespace } = await bed.startFrontend(logs);
    const good = await startWorker(namespace, 'good');
    await frontend.ready();
    await waitUntil(() => stateOf(frontend, 'good') === 'ready', 'good joined', 20_000);

    const etcd = client();
    const key = `/${namespace}/workers/bad`;
    const bad: WorkerRecord = { ...good.record, id: 'bad', address: '127.0.0.1', pid: good.record.pid + 1 };
    await etcd.put(key).value(JSON.stringify(bad));
    await waitUntil(() => ignored(logs, key).length > 0, 'the frontend logged the bad key', 20_000);
    assert.deepEqual(ignored(logs, key), [`warn etcd: ignoring ${key}: its address "127.0.0.1" is not host:port`]);
    // Put again with the same value: not logged again (a key put after it tells when the watch has seen it).
    await etcd.put(key).value(JSON.stringify(bad));
    const marker = `/${namespace}/workers/marker`;
    await etcd.put(marker).value('{"not":"a record"}');
    await waitUntil(() => ignored(logs, marker).length > 0, 'the frontend saw the put after it', 20_000);
    assert.equal(ignored(logs, key).length, 1, 'logged once');
    assert.deepEqual(frontend.workerViews().map((w) => w.id), ['good']);
    const outputs = await serve(frontend);
    assert.equal(outputs.at(-1)!.finishReason, 'length');
    assert.equal(outputs.at(-1)!.routing!.workerId, 'good');

    // A frontend started while the key exists comes up, logs it once and serves.
    const laterLogs: string[] = [];
    const later = new ClusterFrontend({
      namespace, clusterToken: TOKEN, etcd: client(), log: (level, message) => { laterLogs.push(`${level} ${message}`); },
    });
    others.push(later);
    await later.start();
    await later.ready();
    await waitUntil(() => stateOf(later, 'good') === 'ready', 'good joined the later frontend', 20_000);
    assert.equal(ignored(laterLogs, key).length, 1);
    assert.equal((await serve(later)).at(-1)!.finishReason, 'length');

    // The good worker's own key turning bad takes it out of the view (its key names no worker any more); its
    // record put back brings it back.
    const goodKey = `/${namespace}/workers/good`;
    await etcd.put(goodKey).value(JSON.stringify({ ...good.record, address: 'nowhere' }));
    await waitUntil(() => stateOf(frontend, 'good') === undefined, 'good left the view', 20_000);
    await etcd.put(goodKey).value(JSON.stringify(good.record));
    await waitUntil(() => stateOf(frontend, 'good') === 'ready', 'good joined again', 20_000);
    assert.equal((await serve(frontend)).at(-1)!.finishReason, 'length');
  });

  test('a discovery handler that throws is logged; the watch goes on', async () => {
    const etcd = client();
    const namespace = 'bad-record-handler';
    const logs: string[] = [];
    const puts: string[] = [];
    const deletes: string[] = [];
    const watch = new WorkerWatch(etcd, namespace, {
      put: (record) => {
        puts.push(record.id);
        if (record.id === 'boom') throw new Error('handler failed');
      },
      delete: (id) => {
        deletes.push(id);
        if (id === 'boom') throw new Error('delete handler failed');
      },
    }, (level, message) => { logs.push(`${level} ${message}`); });
    others.push({ close: () => watch.stop() });
    await watch.start();
    const record = (id: string): WorkerRecord => ({
      id, role: 'both', model: 'm', address: `127.0.0.1:${1000 + puts.length}`, blockSize: 16, capacityTokens: 1024,
      maxModelLen: 1024, engine: 'sim', pid: 1, startedAt: new Date().toISOString(),
    });
    await etcd.put(`/${namespace}/workers/boom`).value(JSON.stringify(record('boom')));
    await etcd.put(`/${namespace}/workers/fine`).value(JSON.stringify(record('fine')));
    await waitUntil(() => puts.includes('fine'), 'the put after the failing one was handled', 20_000);
    await etcd.delete().key(`/${namespace}/workers/boom`);
    await etcd.delete().key(`/${namespace}/workers/fine`);
    await waitUntil(() => deletes.includes('fine'), 'the delete after the failing one was handled', 20_000);
    assert.deepEqual(puts, ['boom', 'fine']);
    assert.deepEqual(deletes, ['boom', 'fine']);
    assert.deepEqual(logs.filter((l) => l.startsWith('error ')), [
      'error discovery: handling worker boom failed (handler failed); the watch goes on',
      'error discovery: handling worker boom failed (delete handler failed); the watch goes on',
    ]);
  });

  test('connecting to an address that is not host:port is a rejection, never a throw', async () => {
    for (const address of ['127.0.0.1', '127.0.0.1:0', '127.0.0.1:70000', 'host:port', '']) {
      let connecting: Promise<RemoteEngine> | undefined;
      assert.doesNotThrow(() => { connecting = RemoteEngine.connect(address, { clusterToken: TOKEN }); }, address);
      await assert.rejects(connecting!, /worker address must be host:port/, address);
    }
  });
});
