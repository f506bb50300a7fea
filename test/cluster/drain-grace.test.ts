// A `conduit worker` whose --shutdown-grace runs out while a request still runs on it: the request ends as one on a
// lost worker (the worker sends an engine-closed error frame), never as a normal end with finish_reason "abort". With
// --migration-limit the frontend moves it to another worker, where it completes; without, its stream fails with
// WorkerLostError (the gateway's SSE error event). Real etcd (/usr/bin/etcd) on a free loopback port, sim workers
// (real time) started and drained as `conduit worker` starts and stops them, a ClusterFrontend in this process.
import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { etcdClient } from '../../src/cluster/discovery.ts';
import { ClusterFrontend } from '../../src/cluster/frontend.ts';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import { ETCD_BIN, freePort } from '../helpers/cluster-services.ts';
import { frontendBed } from '../helpers/frontend-bed.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(ETCD_BIN) ? undefined : `needs ${ETCD_BIN} (Debian etcd-server)`;
const TOKEN = 'drain-grace-test-token';
/** Tokens a request asks for: a few seconds of simulated decode in real time, far past the grace. */
const MAX_TOKENS = 400;
const GRACE_MS = 200;

describe('a worker whose shutdown grace runs out mid-stream', { skip }, () => {
  const bed = frontendBed('drain-grace', TOKEN);
  const frontends: ClusterFrontend[] = [];
  let namespaces = 0;

  after(async () => {
    for (const frontend of frontends) await frontend.close();
  });

  async function startFrontend(migrationLimit: number, logs: string[]): Promise<{ frontend: ClusterFrontend; namespace: string }> {
    const namespace = `drain-grace-${namespaces++}`;
    const frontend = new ClusterFrontend({
      namespace, clusterToken: TOKEN, etcd: etcdClient({ endpoints: [bed.etcdUrl] }), migrationLimit,
      log: (level, message) => { logs.push(`${level} ${message}`); },
    });
    frontends.push(frontend);
    await frontend.start();
    return { frontend, namespace };
  }

  async function startWorker(namespace: string, workerId: string, logs: string[]): Promise<RunningWorker> {
    const worker = await startClusterWorker({
      workerId, role: 'both', namespace, clusterToken: TOKEN, host: '127.0.0.1', port: await freePort(),
      etcd: { endpoints: [bed.etcdUrl] }, leaseTtlSeconds: 5,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: 1 } },
      log: (level, message) => { logs.push(`${workerId} ${level} ${message}`); },
    });
    bed.workers.push(worker);
    return worker;
  }

  let nextId = 0;
  function request(): EngineRequest {
    return {
      id: `drain-grace-${nextId++}`, promptTokenIds: Array.from({ length: 64 }, (_, i) => 200 + i), priority: 0, arrivalMs: engineNow(),
      sampling: { ...DEFAULT_SAMPLING, maxTokens: MAX_TOKENS, ignoreEos: true },
    };
  }

  /** Two workers behind a frontend; resolves once both are routed to. */
  async function cluster(migrationLimit: number) {
    const logs: string[] = [];
    const { frontend, namespace } = await startFrontend(migrationLimit, logs);
    const workers = new Map<string, RunningWorker>();
    for (const id of ['w1', 'w2']) workers.set(id, await startWorker(namespace, id, logs));
    const engine = await frontend.ready();
    await waitUntil(() => frontend.engine?.workerIds.length === 2, 'both workers joined', 20_000);
    return { engine, workers, logs };
  }

  test('with a migration limit, the request moves to the other worker and completes there', async () => {
    const { engine, workers, logs } = await cluster(2);
    const outputs: EngineOutput[] = [];
    let drained: string | undefined;
    let shutdown: Promise<void> | undefined;
    for await (const output of engine.generate(request())) {
      outputs.push(output);
      if (drained === undefined) {
        drained = output.routing!.workerId;
        // SIGTERM with --shutdown-grace 0.2: deregister, drain, and stop what still runs after 200 ms.
        shutdown = workers.get(drained)!.shutdown(GRACE_MS);
      }
    }
    await shutdown;
    assert.ok(drained);
    assert.ok(logs.some((l) => l.startsWith(`${drained} warn drain: 1 request(s) still running`)), 'the grace ran out on it');
    assert.deepEqual(outputs.filter((o) => o.finishReason === 'abort'), [], 'no output says aborted');
    const last = outputs.at(-1)!;
    assert.equal(last.finishReason, 'length');
    assert.equal(outputs.reduce((n, o) => n + o.newTokenIds.length, 0), MAX_TOKENS, 'every token came');
    assert.equal(last.usage.completionTokens, MAX_TOKENS);
    const other = [...workers.keys()].find((id) => id !== drained)!;
    assert.equal(last.routing!.workerId, other);
    assert.deepEqual(last.routing!.migrations?.map((m) => [m.fromWorkerId, m.toWorkerId, m.reason]), [[drained, other, 'worker-lost']]);
  });

  test('without migration, the stream fails as on a lost worker instead of ending as aborted', async () => {
    const { engine, workers, logs } = await cluster(0);
    const outputs: EngineOutput[] = [];
    let drained: string | undefined;
    let shutdown: Promise<void> | undefined;
    let failure: Error | undefined;
    try {
      for await (const output of engine.generate(request())) {
        outputs.push(output);
        if (drained === undefined) {
          drained = output.routing!.workerId;
          shutdown = workers.get(drained)!.shutdown(GRACE_MS);
        }
      }
    } catch (error) {
      failure = error as Error;
    }
    await shutdown;
    assert.ok(logs.some((l) => l.startsWith(`${drained} warn drain: 1 request(s) still running`)), 'the grace ran out on it');
    assert.equal(failure?.name, 'WorkerLostError', `the stream failed (its outputs ended with ${outputs.at(-1)?.finishReason})`);
    assert.ok(outputs.length > 0 && outputs.length < MAX_TOKENS, `${outputs.length} outputs before the failure`);
    assert.deepEqual(outputs.filter((o) => o.finishReason !== undefined), [], 'no output ended it');
  });
});
