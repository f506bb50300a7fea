// A worker notices a frontend that is gone without closing its connection (its host vanished, a partition): a
// frontend that pings (its hello says so, and the welcome says how often) and then falls silent has its connection
// closed after the worker's silence timeout, so its request stops and its KV blocks are freed. A real frontend's
// pings keep an idle connection up; a peer that never said it pings (a frontend of an earlier release) is not timed.
// A real CPU worker (WorkerServer over a LocalEngine) on 127.0.0.1 with a short timeout, reached through RemoteEngine
// or a raw socket that says hello and then nothing.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';
import { rmSync } from 'node:fs';
import { engineNow } from '../../src/engine/clock.ts';
import { LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { encodeJsonFrame, FrameReader, parseJsonMessage } from '../../src/cluster/frames.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { REQUEST_PLANE_VERSION, toWireRequest } from '../../src/cluster/request-plane.ts';
import { WorkerServer } from '../../src/cluster/worker-server.ts';
import { collect } from '../helpers/outputs.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { SLOW_DECODE_SHAPE, writeWorkerLossFixture } from '../helpers/worker-loss.ts';

const TOKEN = 'frontend-silence-token';
/** The workers' silence timeout here: short, so that a silent frontend is noticed within the test. */
const SILENCE_MS = 400;

let nextId = 0;
function request(maxTokens: number): EngineRequest {
  return {
    id: `silence-${nextId++}`, promptTokenIds: Array.from({ length: 24 }, (_, i) => 200 + i * 37), priority: 0, arrivalMs: engineNow(),
    sampling: { ...DEFAULT_SAMPLING, maxTokens, ignoreEos: true, temperature: 0 },
  };
}

/** A raw connection that has said hello (with `hello` extra fields) and collects what the worker sends. */
async function rawPeer(port: number, hello: Record<string, unknown>): Promise<{
  socket: net.Socket; messages: Record<string, unknown>[]; closed: () => boolean;
}> {
  const socket = net.connect({ host: '127.0.0.1', port });
  const reader = new FrameReader();
  const messages: Record<string, unknown>[] = [];
  let closed = false;
  socket.on('data', (chunk) => { for (const f of reader.push(chunk)) messages.push(parseJsonMessage(f.payload)); });
  socket.on('error', () => {});
  socket.on('close', () => { closed = true; });
  await new Promise<void>((resolve) => socket.once('connect', () => resolve()));
  socket.write(encodeJsonFrame({ t: 'hello', v: REQUEST_PLANE_VERSION, token: TOKEN, ...hello }));
  await waitUntil(() => messages.some((m) => m.t === 'welcome') || closed, 'the worker welcomed the peer', 10_000);
  return { socket, messages, closed: () => closed };
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

describe('a worker and a frontend that falls silent', () => {
  let dir: string;
  let engine: LocalEngine;
  let server: WorkerServer;
  let port: number;
  const logs: string[] = [];
  const sockets: net.Socket[] = [];
  const remotes: RemoteEngine[] = [];

  before(async () => {
    // A model slow enough (about 10 ms a token on one thread) that a long request still runs when the timeout passes.
    const fixture = writeWorkerLossFixture('frontend-silence', undefined, SLOW_DECODE_SHAPE);
    dir = fixture.dir;
    engine = await LocalEngine.start({ modelPath: fixture.modelPath, threads: 1, kvCacheMemoryBytes: 16 * 1024 * 1024 });
    server = new WorkerServer({
      workerId: 'w-silence', engine, clusterToken: TOKEN, frontendSilenceTimeoutMs: SILENCE_MS,
      log: (level, message) => logs.push(`${level} ${message}`),
    });
    port = await server.listen(0, '127.0.0.1');
  });

  after(async () => {
    for (const socket of sockets) socket.destroy();
    for (const remote of remotes) await remote.close();
    await server?.close();
    await engine?.close();
    rmSync(dir, { recursive: true, force: true });
  });

  test('a frontend that pings, then falls silent mid-request, is cut off: its request stops and its blocks are freed', async () => {
    const peer = await rawPeer(port, { ping: true });
    sockets.push(peer.socket);
    const welcome = peer.messages.find((m) => m.t === 'welcome')!;
    assert.ok(Number(welcome.pingMs) > 0 && Number(welcome.pingMs) < SILENCE_MS, `the welcome asks for pings (pingMs ${String(welcome.pingMs)})`);
    const req = request(1000);
    peer.socket.write(encodeJsonFrame({ t: 'gen', request: toWireRequest(req), sentAt: engineNow() }));
    // The peer pings as asked until its request streams (a loaded machine may take a while to start it)...
    const pinging = setInterval(() => peer.socket.write(encodeJsonFrame({ t: 'ping' })), Number(welcome.pingMs));
    try {
      await waitUntil(() => peer.messages.some((m) => m.t === 'out'), 'the request streams', 20_000);
    } finally {
      clearInterval(pinging);
    }
    assert.equal(server.inFlight, 1);
    const silentBefore = server.silentFrontends;
    // ...and from here sends nothing, as a frontend whose host vanished (no FIN, no RST). 1000 tokens take seconds;
    // well before that the worker must have given up on it.
    await waitUntil(() => peer.closed(), 'the worker closed the silent connection', 3_000);
    assert.equal(server.silentFrontends, silentBefore + 1);
    await waitUntil(() => server.inFlight === 0, 'the worker stopped the silent frontend\'s request', 5_000);
    assert.ok(logs.some((l) => /sent nothing for 400 ms \(not even its ping\): closing its connection and stopping its 1 request/.test(l)), logs.join('\n'));
    assert.equal((await engine.sync()).kvBlocksUsed, 0);
    assert.ok(!peer.messages.some((m) => m.t === 'end'), 'the request was stopped, not finished');
  });

  test('a real frontend\'s pings keep an idle connection up past the timeout, and it still serves', async () => {
    const remote = await RemoteEngine.connect(`127.0.0.1:${port}`, { clusterToken: TOKEN });
    remotes.push(remote);
    const silentBefore = server.silentFrontends;
    await sleep(SILENCE_MS * 4);
    assert.equal(remote.lost, false);
    assert.equal(server.silentFrontends, silentBefore);
    const outputs = await collect(remote.generate(request(4)));
    assert.equal(outputs.at(-1)!.finishReason, 'length');
  });

  test('a frontend that never said it pings (an earlier release) is not timed out', async () => {
    const peer = await rawPeer(port, {});
    sockets.push(peer.socket);
    assert.equal(peer.messages.find((m) => m.t === 'welcome')!.pingMs, undefined, 'no pings asked of it');
    await sleep(SILENCE_MS * 4);
    assert.equal(peer.closed(), false);
  });
});
