// A live worker whose lease lapses (etcd revoked it: an outage past its TTL, a paused process) registers again under
// its id at once, from the same process and address. The frontend sees its key go (the connection is retired: it
// leaves the router, the stream running on it goes on) and come back (a new connection joins): the worker must be
// counted once, not once per connection, in the engine's workers, readiness, KV capacity and load. The stream that
// crossed the lapse goes on, and its abort still reaches the worker through the retired connection and frees its
// blocks. Real etcd on a free loopback port, a sim worker started as `conduit worker` starts it (real time, so the
// stream lasts seconds), and a ClusterFrontend in this process (KV events on the request plane, no NATS).
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { etcdClient, workersPrefix } from '../../src/cluster/discovery.ts';
import type { ClusterEngine } from '../../src/cluster/frontend.ts';
import { startClusterWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import { ETCD_BIN, freePort } from '../helpers/cluster-services.ts';
import { frontendBed } from '../helpers/frontend-bed.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(ETCD_BIN) ? undefined : `needs ${ETCD_BIN} (Debian etcd-server)`;
const TOKEN = 'lease-lapse-test-token';

describe('a live worker whose lease lapses and registers again', { skip }, () => {
  const bed = frontendBed('lease-lapse', TOKEN);

  test('is counted once, and the stream that crossed the lapse is still aborted on the worker', { timeout: 120_000 }, async () => {
    const logs: string[] = [];
    const { frontend, namespace } = await bed.startFrontend(logs);
    const worker = await startClusterWorker({
      workerId: 'w1', role: 'both', namespace, clusterToken: TOKEN, host: '127.0.0.1', port: await freePort(),
      etcd: { endpoints: [bed.etcdUrl] }, leaseTtlSeconds: 5,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: 1 } },
      log: (level, message) => logs.push(`worker ${level} ${message}`),
    });
    bed.workers.push(worker);
    const engine = await frontend.ready() as ClusterEngine;
    const capacity = worker.server.engine.info.kvCapacityTokens;
    assert.equal(engine.info.kvCapacityTokens, capacity);

    const request: EngineRequest = {
      id: 'across-the-lapse', promptTokenIds: Array.from({ length: 64 }, (_, i) => 100 + i), priority: 0, arrivalMs: engineNow(),
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 100_000, ignoreEos: true },
    };
    const outputs: EngineOutput[] = [];
    let failure: unknown;
    const stream = (async () => {
      try {
        for await (const output of engine.generate(request)) outputs.push(output);
      } catch (error) {
        failure = error;
      }
    })();
    await waitUntil(() => outputs.length > 2, 'the stream started', 30_000);

    // The lease goes as a lapse takes it (etcd revokes it); the worker puts its key again under a new one.
    const client = etcdClient({ endpoints: [bed.etcdUrl] });
    try {
      const held = await client.get(`${workersPrefix(namespace)}w1`).exec();
      await client.leaseClient.leaseRevoke({ ID: held.kvs[0]!.lease });
    } finally {
      client.close();
    }
    await waitUntil(() => logs.includes('info discovery: worker w1 left (its key is gone)'), 'the frontend saw the key go', 30_000);
    await waitUntil(() => logs.filter((l) => l.startsWith('info worker w1 joined')).length === 2
      && frontend.workerViews().find((w) => w.id === 'w1')?.state === 'ready', 'w1 joined again', 30_000);
    assert.ok(logs.some((l) => /^worker warn etcd: lease of .* lost/.test(l)), logs.join('\n'));

    // One worker, however many connections it has had: the retired one still carries the stream.
    assert.equal(failure, undefined);
    assert.deepEqual(engine.workerIds, ['w1']);
    assert.deepEqual(engine.readiness(), { ready: true, workersAlive: 1, workersTotal: 1 });
    assert.equal(engine.info.kvCapacityTokens, capacity, 'the KV capacity of one worker');
    assert.deepEqual(frontend.workerViews().map((w) => w.id), ['w1']);
    assert.equal(worker.server.frontendConnections, 2, 'the retired connection and the new one');
    await waitUntil(() => engine.stats().numRunning === 1, 'the load the worker reports: its one request', 10_000);
    assert.equal(engine.workerStats().length, 1);

    // The abort goes where the request runs (the retired connection) and frees its blocks there.
    const before = outputs.length;
    engine.abort(request.id);
    await stream;
    assert.equal(failure, undefined);
    assert.ok(outputs.length >= before);
    assert.equal(outputs.at(-1)?.finishReason, 'abort');
    await waitUntil(() => worker.server.engine.stats().numRunning === 0 && worker.server.engine.stats().kvBlocksUsed === 0,
      'the worker stopped the request and freed its blocks', 10_000);
    // With nothing of this frontend's left on it, the retired connection closes: the new one alone stays.
    await waitUntil(() => worker.server.frontendConnections === 1, 'the retired connection closed', 10_000);
    assert.deepEqual(engine.readiness(), { ready: true, workersAlive: 1, workersTotal: 1 });
  });
});
