// A worker restarted under its id while the old process still drains: both processes publish on the worker's NATS
// subjects (KV events, load) and answer its snapshot requests until the old one's drain ends. The frontend's view of
// the worker must be the new process's: no running request and no cached block of the old one. Real etcd and
// nats-server on free loopback ports, sim workers (real time, so the old process's stream lasts seconds) started as
// `conduit worker` starts them, and a ClusterFrontend in this process on the event plane.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { etcdClient } from '../../src/cluster/discovery.ts';
import { EventSubscriber, natsConnect } from '../../src/cluster/events.ts';
import { ClusterFrontend, type ClusterEngine } from '../../src/cluster/frontend.ts';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { freePort, removeDir, servicesMissing, startEtcd, startNats, stopAll, tempDir, type Etcd, type Nats } from '../helpers/cluster-services.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = servicesMissing();
const TOKEN = 'restart-same-id-test-token';
const NAMESPACE = 'restart-same-id';

describe('a worker restarted under its id while the old process drains', { skip }, () => {
  let dir: string;
  let etcd: Etcd;
  let nats: Nats;
  let frontend: ClusterFrontend;
  const workers: RunningWorker[] = [];

  before(async () => {
    dir = tempDir('restart-same-id');
    etcd = await startEtcd(dir);
    nats = await startNats();
    const nc = await natsConnect({ servers: [nats.url] });
    frontend = new ClusterFrontend({
      namespace: NAMESPACE, clusterToken: TOKEN, etcd: etcdClient({ endpoints: [etcd.url] }),
      events: (handlers) => new EventSubscriber(nc, NAMESPACE, handlers, () => {}), log: () => {},
    });
    await frontend.start();
  });

  after(async () => {
    await frontend?.close();
    for (const worker of workers) await worker.shutdown(0);
    await stopAll();
    removeDir(dir);
  });

  async function startWorker(): Promise<RunningWorker> {
    const worker = await startClusterWorker({
      workerId: 'w1', role: 'both', namespace: NAMESPACE, clusterToken: TOKEN, host: '127.0.0.1', port: await freePort(),
      etcd: { endpoints: [etcd.url] }, nats: { servers: [nats.url] }, leaseTtlSeconds: 5,
      // Real time: a decode step of the 8B model on an H100 is a few milliseconds, so the old stream lasts seconds.
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: 1 } },
      log: () => {},
    });
    workers.push(worker);
    return worker;
  }

  test('the frontend keeps the new process\'s load and KV view, not the old one\'s', async () => {
    const old = await startWorker();
    const engine = await frontend.ready() as ClusterEngine;
    await waitUntil(() => engine.workerIds.includes('w1'), 'w1 joined', 20_000);
    const request: EngineRequest = {
      id: 'long', promptTokenIds: Array.from({ length: 512 }, (_, i) => 100 + ((i * 37) % 900)), priority: 0,
      arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens: 1500, ignoreEos: true, temperature: 0 },
    };
    const stream = (async () => {
      let tokens = 0;
      for await (const output of engine.generate(request)) tokens += output.newTokenIds.length;
      return tokens;
    })();
    await waitUntil(() => old.server.inFlight === 1 && frontend.router!.stats().numIndexedEntries > 0,
      'the old process runs the stream and the router indexed its prompt', 20_000);

    // The old process drains its stream (deregistered, still publishing); a new one registers under the same id.
    const draining = old.shutdown(60_000);
    await waitUntil(() => !engine.workerIds.includes('w1'), 'the frontend saw w1 leave', 20_000);
    const replacement = await startWorker();
    await waitUntil(() => engine.workerIds.includes('w1') && replacement.server.frontendConnections === 1,
      'the new process joined', 20_000);

    // Over several of the old process's load periods (1 s) and KV batches, while its stream still runs:
    const view = () => frontend.workerViews().find((w) => w.id === 'w1');
    const seen = { running: 0, entries: 0 };
    const until = Date.now() + 3000;
    while (Date.now() < until) {
      seen.running = Math.max(seen.running, view()?.running ?? 0);
      seen.entries = Math.max(seen.entries, frontend.router!.stats().numIndexedEntries);
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
    assert.equal(old.server.inFlight, 1, 'the old process was still decoding throughout');
    assert.equal(replacement.server.inFlight, 0);
    assert.deepEqual(seen, { running: 0, entries: 0 }, 'w1 showed the old process\'s running stream or cached blocks');

    // The drained stream finished on the old process.
    assert.equal(await stream, 1500);
    await draining;
  });
});
