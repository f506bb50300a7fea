// Two live processes given one worker id: the second must not take the etcd key over (the frontend would drop the
// first one's connection, and once the second left, the first, alive and idle, would never register again). Its
// registration is an etcd transaction that creates the key only when absent: it waits for the holder's lease to
// lapse (a killed worker's restart), and when the key is still held after that, `conduit worker` refuses to start
// with one line naming the id and the live holder, exit 1. The first worker stays registered and served throughout.
// A frontend that sees a live, not draining connection replaced by another process's record (a worker of an older
// release, or a watch that missed a delete) says so. Real etcd and nats-server on free loopback ports, sim workers
// (the first in this process, the second as `conduit worker`), and a ClusterFrontend in this process.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import type { Etcd3 } from 'etcd3';
import { etcdClient, workersPrefix, type WorkerRecord } from '../../src/cluster/discovery.ts';
import { ClusterFrontend, type ClusterEngine } from '../../src/cluster/frontend.ts';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING } from '../../src/engine/types.ts';
import {
  freePort, removeDir, servicesMissing, startConduit, startEtcd, startNats, stopAll, tempDir, type Etcd, type Nats,
} from '../helpers/cluster-services.ts';
import { collect } from '../helpers/outputs.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = servicesMissing();
const TOKEN = 'duplicate-worker-id-test-token';
const NAMESPACE = 'duplicate-id';
const TTL_SECONDS = 2;

describe('a worker id already held by a live worker', { skip }, () => {
  let dir: string;
  let etcd: Etcd;
  let nats: Nats;
  let client: Etcd3;
  let frontend: ClusterFrontend;
  const logs: string[] = [];
  const workers: RunningWorker[] = [];

  before(async () => {
    dir = tempDir('duplicate-id');
    etcd = await startEtcd(dir);
    nats = await startNats();
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
    client?.close();
    await stopAll();
    removeDir(dir);
  });

  async function startWorker(workerId: string, log: (message: string) => void = () => {}): Promise<RunningWorker> {
    const worker = await startClusterWorker({
      workerId, role: 'both', namespace: NAMESPACE, clusterToken: TOKEN, host: '127.0.0.1', port: await freePort(),
      etcd: { endpoints: [etcd.url] }, leaseTtlSeconds: TTL_SECONDS,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity } },
      log: (level, message) => log(`${level} ${message}`),
    });
    workers.push(worker);
    return worker;
  }

  const view = (id: string) => frontend.workerViews().find((w) => w.id === id);
  const keyOf = (id: string) => `${workersPrefix(NAMESPACE)}${id}`;
  const recordAt = async (id: string) => JSON.parse((await client.get(keyOf(id)).string())!) as WorkerRecord;

  async function served(id: string): Promise<void> {
    const engine = frontend.engine as ClusterEngine;
    const outputs = await collect(engine.generate({
      id: `dup-${Math.random()}`, promptTokenIds: [101, 102, 103, 104], priority: 0, arrivalMs: engineNow(),
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 4, ignoreEos: true, temperature: 0 },
    }));
    assert.equal(outputs.at(-1)!.finishReason, 'length');
    assert.equal(outputs.at(-1)!.routing?.workerId, id);
  }

  test('a second `conduit worker` with the id refuses to start, in one line; the first stays registered and served', async () => {
    const first = await startWorker('w1');
    await frontend.ready();
    await waitUntil(() => view('w1')?.state === 'ready' && view('w1')?.address === first.address, 'w1 joined', 20_000);

    const second = startConduit(['worker', '--etcd-endpoints', etcd.url, '--nats-server', nats.url, '--cluster-token', TOKEN,
      '--namespace', NAMESPACE, '--worker-id', 'w1', '--engine', 'sim', '--lease-ttl', String(TTL_SECONDS)]);
    let timer: NodeJS.Timeout | undefined;
    const code = await Promise.race([second.exited,
      new Promise<string>((resolve) => { timer = setTimeout(() => resolve('still running'), 40_000); })]);
    clearTimeout(timer);
    const output = second.output();
    assert.equal(code, 1, output);
    const lines = output.trim().split('\n');
    // It waited for the holder's lease to lapse, as it would after a killed worker, and then gave up.
    assert.ok(lines.some((l) => /etcd: worker id w1 is registered by pid \d+ at 127\.0\.0\.1:\d+ .*waiting up to \d+ s/.test(l)), output);
    assert.equal(lines.at(-1), `conduit worker: worker id w1 is held by a live worker, pid ${process.pid} at ${first.address} `
      + `(started ${first.record.startedAt}) (its lease under ${keyOf('w1')} is kept alive): give this worker another --worker-id, or stop that one first`);
    assert.doesNotMatch(output, /\n {4}at /, 'no stack trace');
    assert.ok(!lines.some((l) => /etcd: registered/.test(l)), output);

    // The key is still the first worker's, the frontend never dropped it, and it serves.
    assert.equal((await recordAt('w1')).startedAt, first.record.startedAt);
    assert.equal(view('w1')?.address, first.address);
    assert.equal(first.server.frontendConnections, 1);
    assert.ok(!logs.some((l) => /worker w1 was lost|re-registered/.test(l)), logs.join('\n'));
    await served('w1');
  });

  test('the key of a worker whose lease is no longer kept alive (killed) is taken once it lapses', async () => {
    // A killed worker's key: under a lease nobody renews any more.
    const dead = client.lease(TTL_SECONDS, { autoKeepAlive: false });
    const stale: WorkerRecord = {
      id: 'w2', role: 'both', model: 'Llama 3.1 8B', address: '127.0.0.1:9', blockSize: 16, capacityTokens: 1000,
      maxModelLen: 1000, engine: 'sim', pid: 999_999, startedAt: new Date(0).toISOString(),
    };
    await dead.put(keyOf('w2')).value(JSON.stringify(stale));
    const workerLogs: string[] = [];
    const started = Date.now();
    const restarted = await startWorker('w2', (line) => workerLogs.push(line));
    assert.ok(Date.now() - started < 15_000);
    assert.ok(workerLogs.some((l) => /^info etcd: worker id w2 is registered by pid 999999 at 127\.0\.0\.1:9 .*waiting up to \d+ s/.test(l)),
      workerLogs.join('\n'));
    assert.equal((await recordAt('w2')).startedAt, restarted.record.startedAt);
    await waitUntil(() => view('w2')?.state === 'ready' && view('w2')?.address === restarted.address, 'w2 joined', 20_000);
  });

  test('the frontend warns when a live, not draining connection\'s key names another process', async () => {
    const live = workers.find((w) => w.record.id === 'w1')!;
    // As a worker of an older release would put it: another process's record over the live one's key.
    const other: WorkerRecord = { ...live.record, pid: live.record.pid + 1, startedAt: new Date().toISOString() };
    const lease = client.lease(TTL_SECONDS);
    try {
      await lease.put(keyOf('w1')).value(JSON.stringify(other));
      await waitUntil(() => logs.some((l) => l.startsWith('warn worker w1 was registered again by another process')), 'the warning', 20_000);
      const warning = logs.find((l) => l.startsWith('warn worker w1 was registered again by another process'))!;
      assert.equal(warning, `warn worker w1 was registered again by another process (pid ${other.pid} at ${other.address}, started `
        + `${other.startedAt}) while the connection to the previous one (pid ${live.record.pid} at ${live.address}, started `
        + `${live.record.startedAt}) is live and not draining: two processes may run with this worker id; dropping the previous one's connection`);
    } finally {
      await lease.revoke();
    }
  });
});
