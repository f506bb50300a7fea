// Workers of different context lengths behind one frontend: the frontend's engine info (what the gateway checks
// prompts against and /health and /v1/models report) follows the workers it routes to (the smallest max_model_len,
// the summed KV capacity), and the router sends a worker only requests its context holds: requests accepted against
// a longer context before a shorter worker joined go to the workers that take them. Real etcd (/usr/bin/etcd) on a
// free loopback port, sim workers started as `conduit worker --max-model-len N` starts them, a ClusterFrontend in
// this process.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import type { ClusterFrontend } from '../../src/cluster/frontend.ts';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type Engine, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import { ETCD_BIN, freePort } from '../helpers/cluster-services.ts';
import { frontendBed } from '../helpers/frontend-bed.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(ETCD_BIN) ? undefined : `needs ${ETCD_BIN} (Debian etcd-server)`;
const TOKEN = 'heterogeneous-context-test-token';

describe('workers of different context lengths behind one frontend', { skip }, () => {
  const bed = frontendBed('hetero-context', TOKEN);

  async function startWorker(namespace: string, workerId: string, maxModelLen: number): Promise<RunningWorker> {
    const worker = await startClusterWorker({
      workerId, role: 'both', namespace, clusterToken: TOKEN, host: '127.0.0.1', port: await freePort(),
      etcd: { endpoints: [bed.etcdUrl] }, leaseTtlSeconds: 5,
      pool: { engine: 'sim', maxModelLen, sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity } },
      log: () => {},
    });
    bed.workers.push(worker);
    return worker;
  }

  let nextId = 0;
  function request(promptTokens: number, maxTokens: number): EngineRequest {
    const seed = nextId;
    return {
      id: `hetero-${nextId++}`, promptTokenIds: Array.from({ length: promptTokens }, (_, i) => 100 + ((i * 7 + seed * 31) % 20_000)),
      priority: 0, arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens, ignoreEos: true },
    };
  }

  async function run(engine: Engine, req: EngineRequest): Promise<EngineOutput[]> {
    const outputs: EngineOutput[] = [];
    for await (const output of engine.generate(req)) outputs.push(output);
    return outputs;
  }

  const stateOf = (frontend: ClusterFrontend, id: string) => frontend.workerViews().find((w) => w.id === id)?.state;

  test('max_model_len is the smallest context, KV capacity the sum; long requests go only where they fit', async () => {
    const logs: string[] = [];
    const { frontend, namespace } = await bed.startFrontend(logs);
    const big = await startWorker(namespace, 'big', 2048);
    const engine = await frontend.ready();
    await waitUntil(() => stateOf(frontend, 'big') === 'ready', 'big joined', 20_000);
    assert.equal(engine.info.maxModelLen, 2048);
    assert.equal(engine.info.kvCapacityTokens, big.record.capacityTokens);
    // Accepted now, against 2048 tokens; they start once the short-context worker has joined.
    const accepted = Array.from({ length: 6 }, () => request(900, 8));

    const small = await startWorker(namespace, 'small', 512);
    await waitUntil(() => stateOf(frontend, 'small') === 'ready', 'small joined', 20_000);
    assert.equal(engine.info.maxModelLen, 512, 'every worker takes what the frontend accepts from now on');
    assert.equal(engine.info.kvCapacityTokens, big.record.capacityTokens + small.record.capacityTokens, 'both workers\' KV capacity');
    assert.ok(logs.some((l) => l.startsWith('warn worker small takes at most 512 tokens: this frontend\'s max_model_len is 512')),
      logs.filter((l) => l.includes('small')).join('\n'));

    // Two at a time, as a client would send them: every one runs to its end, on the worker that holds it.
    for (let i = 0; i < accepted.length; i += 2) {
      const pair = await Promise.all(accepted.slice(i, i + 2).map((req) => run(engine, req)));
      for (const outputs of pair) {
        assert.equal(outputs.at(-1)!.finishReason, 'length');
        assert.equal(outputs.at(-1)!.usage.completionTokens, 8);
        assert.equal(outputs.at(-1)!.routing!.workerId, 'big');
      }
    }
    // Short requests still go to both.
    const placed = new Set<string>();
    for (let i = 0; i < 12 && placed.size < 2; i++) {
      const pair = await Promise.all([run(engine, request(40, 4)), run(engine, request(40, 4))]);
      for (const outputs of pair) placed.add(outputs.at(-1)!.routing!.workerId);
    }
    assert.deepEqual([...placed].sort(), ['big', 'small']);

    // The long-context worker leaves: the info follows, and a prompt no worker left takes is refused (503), never
    // sent to a worker that would refuse it.
    await big.shutdown(0);
    await waitUntil(() => stateOf(frontend, 'big') === undefined, 'big left', 20_000);
    assert.equal(engine.info.maxModelLen, 512);
    assert.equal(engine.info.kvCapacityTokens, small.record.capacityTokens);
    await assert.rejects(run(engine, request(900, 8)), (error: Error) => {
      assert.equal(error.name, 'EngineOverloadedError');
      assert.match(error.message, /no worker takes a prompt of 900 tokens/);
      return true;
    });
    assert.equal((await run(engine, request(300, 8))).at(-1)!.routing!.workerId, 'small');
  });
});
