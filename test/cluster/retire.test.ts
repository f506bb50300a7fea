// A worker process that leaves discovery while it still runs a stream (it drains: SIGTERM): the frontend retires
// its connection (RemoteEngine.retire, what ClusterFrontend does when the worker's key goes), so the router drops it
// and sends it nothing new, while the stream it runs keeps flowing from it to its end. Two real CPU workers (a
// tiny synthetic model, each a worker thread behind a WorkerServer on 127.0.0.1), reached through RemoteEngine,
// behind the routed engine a frontend uses, with migration on: a stream that left its worker would show it.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import { engineNow } from '../../src/engine/clock.ts';
import { createLocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { WorkerServer } from '../../src/cluster/worker-server.ts';
import { RoutedEngine } from '../../src/runtime/routed-engine.ts';
import { makeRouter } from '../../src/runtime/worker-pool.ts';
import { collect, text, tokens } from '../helpers/outputs.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

const TOKEN = 'retire-test-token';
let nextId = 0;
function request(maxTokens: number): EngineRequest {
  return {
    id: `retire-${nextId++}`, promptTokenIds: Array.from({ length: 40 }, (_, i) => 300 + ((i * 53) % 2000)), priority: 0,
    arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens, ignoreEos: true, temperature: 0, repetitionPenalty: 1.3 },
  };
}

describe('a worker retired mid-stream (it left discovery to drain)', () => {
  let dir: string;
  const bundles: Awaited<ReturnType<typeof createLocalEngine>>[] = [];
  const servers: WorkerServer[] = [];
  const remotes = new Map<string, RemoteEngine>();
  let routed: RoutedEngine;

  before(async () => {
    const fixture = writeWorkerLossFixture('retire');
    dir = fixture.dir;
    for (const workerId of ['wa', 'wb']) {
      const bundle = await createLocalEngine({ modelPath: fixture.modelPath, threads: 1, enableKvEvents: true, kvCacheMemoryBytes: 8 * 1024 * 1024 });
      bundles.push(bundle);
      const server = new WorkerServer({ workerId, engine: bundle.engine, clusterToken: TOKEN, tokenizer: bundle.tokenizer, chatTemplate: bundle.chatTemplate });
      servers.push(server);
      const port = await server.listen(0, '127.0.0.1');
      remotes.set(workerId, await RemoteEngine.connect(`127.0.0.1:${port}`, { clusterToken: TOKEN, events: true }));
    }
    const router = makeRouter({ routingPolicy: 'kv', routerSeed: 5 }, bundles[0]!.engine.info.blockSize, 0);
    routed = new RoutedEngine([...remotes].map(([id, engine]) => ({ id, engine })), router, engineNow, { migration: { limit: 2 } });
  });

  after(async () => {
    await routed?.close();
    for (const server of servers) await server.close();
    for (const bundle of bundles) await bundle.engine.close();
    rmSync(dir, { recursive: true, force: true });
  });

  test('its stream runs to the end on it, unmoved; new requests go to the other worker', async () => {
    const expected = await collect(routed.generate(request(48)));
    const outputs: EngineOutput[] = [];
    let retired: string | undefined;
    for await (const output of routed.generate(request(48))) {
      outputs.push(output);
      if (retired === undefined) {
        retired = output.routing!.workerId;
        remotes.get(retired)!.retire(`worker ${retired} deregistered`);
        assert.deepEqual(routed.workerIds, [...remotes.keys()].filter((id) => id !== retired), 'the router dropped it at once');
      }
    }
    assert.ok(retired);
    assert.equal(outputs.length, 48, 'every token came');
    assert.deepEqual(outputs.map((o) => o.routing!.workerId), outputs.map(() => retired), 'every output from the retired worker');
    assert.equal(outputs.at(-1)!.routing!.migrations, undefined, 'the stream never moved');
    assert.equal(outputs.at(-1)!.finishReason, 'length');
    assert.deepEqual(tokens(outputs), tokens(expected));
    assert.equal(text(outputs), text(expected));
    assert.equal(routed.stats().requestMigrations, 0);

    const next = await collect(routed.generate(request(4)));
    assert.notEqual(next.at(-1)!.routing!.workerId, retired, 'nothing new goes to the retired worker');
  });

  test('an abort still reaches the retired worker: its stream stops there at once', async () => {
    const outputs: EngineOutput[] = [];
    const req = request(3000);
    let workerId: string | undefined;
    for await (const output of routed.generate(req)) {
      outputs.push(output);
      if (workerId === undefined) {
        workerId = output.routing!.workerId;
        remotes.get(workerId)!.retire(`worker ${workerId} deregistered`);
        routed.abort(req.id);
      }
    }
    assert.equal(outputs.at(-1)!.finishReason, 'abort');
    assert.ok(outputs.length < 3000, `${outputs.length} outputs`);
    const server = servers.find((s) => s.workerId === workerId)!;
    for (let turn = 0; server.inFlight > 0; turn++) {
      if (turn > 200) assert.fail('the request still runs on the retired worker');
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
  });
});
