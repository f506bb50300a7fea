// A frontend's router sees the load other frontends put on a worker process: every stats report on the worker's
// request-plane connection (on any frame, its heartbeat) reaches the router, not only those riding on outputs of
// requests this router sent. Two real CPU workers (a synthetic model decoding in milliseconds per token, each a
// worker thread behind a WorkerServer on 127.0.0.1) behind the routed engine a frontend uses; a second connection
// to one of them plays the other frontend.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import { engineNow } from '../../src/engine/clock.ts';
import { createLocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { WorkerServer } from '../../src/cluster/worker-server.ts';
import type { RoutingDecision } from '../../src/router/protocols.ts';
import type { Router } from '../../src/router/router.ts';
import { RoutedEngine } from '../../src/runtime/routed-engine.ts';
import { makeRouter } from '../../src/runtime/worker-pool.ts';
import { collect } from '../helpers/outputs.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { SLOW_DECODE_SHAPE, writeWorkerLossFixture } from '../helpers/worker-loss.ts';

const TOKEN = 'remote-load-token';
let nextId = 0;
function request(group: number, maxTokens: number): EngineRequest {
  return {
    id: `load-${nextId++}`, promptTokenIds: Array.from({ length: 40 }, (_, i) => 300 + ((group * 7919 + i * 53) % 2000)), priority: 0,
    arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens, ignoreEos: true, temperature: 0 },
  };
}

describe('a frontend\'s router and the load other frontends put on a worker process', () => {
  let dir: string;
  const bundles: Awaited<ReturnType<typeof createLocalEngine>>[] = [];
  const servers: WorkerServer[] = [];
  const ports = new Map<string, number>();
  const others: RemoteEngine[] = [];
  let router: Router;
  let routed: RoutedEngine;

  before(async () => {
    const fixture = writeWorkerLossFixture('remote-load', undefined, SLOW_DECODE_SHAPE);
    dir = fixture.dir;
    const remotes: { id: string; engine: RemoteEngine }[] = [];
    for (const workerId of ['wa', 'wb']) {
      const bundle = await createLocalEngine({ modelPath: fixture.modelPath, threads: 1, enableKvEvents: true, kvCacheMemoryBytes: 16 * 1024 * 1024 });
      bundles.push(bundle);
      const server = new WorkerServer({ workerId, engine: bundle.engine, clusterToken: TOKEN, tokenizer: bundle.tokenizer, chatTemplate: bundle.chatTemplate });
      servers.push(server);
      ports.set(workerId, await server.listen(0, '127.0.0.1'));
      remotes.push({ id: workerId, engine: await RemoteEngine.connect(`127.0.0.1:${ports.get(workerId)}`, { clusterToken: TOKEN, events: true }) });
    }
    router = makeRouter({ routingPolicy: 'kv', routerSeed: 3 }, bundles[0]!.engine.info.blockSize, 0);
    routed = new RoutedEngine(remotes, router, engineNow);
  });

  after(async () => {
    await routed?.close();
    for (const other of others) await other.close();
    for (const server of servers) await server.close();
    for (const bundle of bundles) await bundle.engine.close();
    rmSync(dir, { recursive: true, force: true });
  });

  test('a stream another frontend runs on a worker counts in this router\'s cost for it, and new requests go elsewhere', async () => {
    const other = await RemoteEngine.connect(`127.0.0.1:${ports.get('wa')}`, { clusterToken: TOKEN });
    others.push(other);
    const decide = (): RoutingDecision => {
      const outcome = router.route({ requestId: `probe-${nextId++}`, tokenIds: request(9, 1).promptTokenIds }, engineNow(), { commit: false });
      assert.equal(outcome.kind, 'routed');
      return (outcome as { decision: RoutingDecision }).decision;
    };
    const idle = decide().costTerms;
    assert.deepEqual(idle.map((t) => t.decodeBlocks), [3, 3], 'both idle: only the probe\'s own 3 blocks');

    const stream = other.generate(request(1, 600))[Symbol.asyncIterator]();
    // Its first output: the worker is computing it, and stays busy for hundreds of tokens more. Its next report on
    // the router's own connection (a KV event's, a heartbeat's: every 500 ms) shows it.
    assert.equal((await stream.next()).done, false);
    const waCost = () => decide().costTerms.find((t) => t.workerId === 'wa')!.decodeBlocks;
    await waitUntil(() => waCost() > 3, 'the router counts the other frontend\'s stream on wa', 5000);
    const busy = decide();
    const terms = new Map(busy.costTerms.map((t) => [t.workerId, t]));
    assert.ok(terms.get('wa')!.decodeBlocks > 3, `wa holds the other frontend's stream: ${JSON.stringify(busy.costTerms)}`);
    assert.equal(terms.get('wb')!.decodeBlocks, 3);
    assert.equal(busy.workerId, 'wb');
    const mine = await collect(routed.generate(request(2, 4)));
    assert.equal(mine.at(-1)!.routing!.workerId, 'wb', 'a new request goes to the idle worker');
    await stream.return?.();
  });

  test('a NATS load snapshot older than the connection\'s latest report does not replace it', async () => {
    const remote = await RemoteEngine.connect(`127.0.0.1:${ports.get('wb')}`, { clusterToken: TOKEN });
    others.push(remote);
    const outputs = remote.generate(request(3, 40))[Symbol.asyncIterator]();
    assert.equal((await outputs.next()).done, false);
    await waitUntil(() => remote.stats().numRunning === 1, 'wb reports the running stream', 5000);
    // What the worker's NATS publisher would have sent while the stream ran: a report numbered then.
    const whileRunning = remote.stats();
    assert.ok(whileRunning.reportSeq !== undefined, 'a worker process numbers its reports');
    while (!(await outputs.next()).done) { /* to the end */ }
    await waitUntil(() => remote.stats().numRunning === 0, 'the stream\'s end reaches the connection', 5000);
    remote.deliverStats(whileRunning);
    assert.equal(remote.stats().numRunning, 0, 'the late snapshot is older than the report that said the stream ended');
    const newer = { ...whileRunning, numWaiting: 7, reportSeq: remote.stats().reportSeq! + 1 };
    remote.deliverStats(newer);
    assert.equal(remote.stats().numWaiting, 7, 'a snapshot numbered after the latest report replaces it');
  });
});
