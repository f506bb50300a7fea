// A prefill worker's handed-off blocks stay pinned until the frontend whose request it was releases them (or its
// connection closes): a `release` naming the request from another connection is ignored, as an `abort` from another
// connection is. A real CPU prefill worker (WorkerServer over a LocalEngine) on 127.0.0.1, the owner a RemoteEngine,
// the other connection a raw socket that says hello.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';
import { engineNow } from '../../src/engine/clock.ts';
import { LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { encodeJsonFrame, FrameReader, parseJsonMessage } from '../../src/cluster/frames.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { REQUEST_PLANE_VERSION } from '../../src/cluster/request-plane.ts';
import { WorkerServer } from '../../src/cluster/worker-server.ts';
import { cpuTestModel } from '../helpers/cpu-model.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const TOKEN = 'release-owner-token';

describe('handed-off blocks are released only by the frontend that owns them', () => {
  let engine: LocalEngine;
  let server: WorkerServer;
  let port: number;
  const sockets: net.Socket[] = [];
  const remotes: RemoteEngine[] = [];

  before(async () => {
    engine = await LocalEngine.start({
      modelPath: cpuTestModel().path, kvCacheMemoryBytes: 2 << 20, threads: 1, blockSize: 16, enableKvEvents: true, role: 'prefill',
    });
    server = new WorkerServer({ workerId: 'p-owner', engine, role: 'prefill', clusterToken: TOKEN });
    port = await server.listen(0, '127.0.0.1');
  });

  after(async () => {
    for (const socket of sockets) socket.destroy();
    for (const remote of remotes) await remote.close();
    await server?.close();
    await engine?.close();
  });

  test('a release from another connection leaves the blocks pinned; the owner\'s release frees them', async () => {
    const owner = await RemoteEngine.connect(`127.0.0.1:${port}`, { clusterToken: TOKEN });
    remotes.push(owner);
    const req: EngineRequest = {
      id: 'owned-0', promptTokenIds: Array.from({ length: 40 }, (_, i) => 10 + ((i * 53) % 240)), priority: 0, arrivalMs: engineNow(),
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 8, ignoreEos: true, temperature: 0 },
    };
    let handedOff = false;
    for await (const event of owner.prefill(req)) if (event.type === 'handoff') handedOff = true;
    assert.ok(handedOff);
    await waitUntil(() => server.handoffsPinned === 1, 'the handoff is pinned', 10_000);
    const usedWhilePinned = (await engine.sync()).kvBlocksUsed;
    assert.ok(usedWhilePinned > 0);

    // Another authenticated connection names the request in a release, then asks for a snapshot: its answer comes
    // after the release was handled.
    const other = net.connect({ host: '127.0.0.1', port });
    sockets.push(other);
    const reader = new FrameReader();
    const messages: Record<string, unknown>[] = [];
    other.on('data', (chunk) => { for (const f of reader.push(chunk)) messages.push(parseJsonMessage(f.payload)); });
    other.on('error', () => {});
    await new Promise<void>((resolve) => other.once('connect', () => resolve()));
    other.write(Buffer.concat([
      encodeJsonFrame({ t: 'hello', v: REQUEST_PLANE_VERSION, token: TOKEN }),
      encodeJsonFrame({ t: 'release', id: req.id }),
      encodeJsonFrame({ t: 'snapshot', rid: 1 }),
    ]));
    await waitUntil(() => messages.some((m) => m.t === 'snapshot'), 'the worker answered the snapshot', 10_000);
    assert.equal(server.handoffsPinned, 1, 'another connection\'s release does not unpin the blocks');
    assert.equal((await engine.sync()).kvBlocksUsed, usedWhilePinned);

    owner.releaseHandoff(req.id);
    await waitUntil(() => server.handoffsPinned === 0, 'the owner\'s release unpins them', 10_000);
  });
});
