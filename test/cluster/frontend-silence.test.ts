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
import { createLocalEngine, LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { encodeJsonFrame, FRAME_BLOB, FrameReader, parseJsonMessage } from '../../src/cluster/frames.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { REQUEST_PLANE_VERSION, toWireRequest } from '../../src/cluster/request-plane.ts';
import { MAX_UNSENT_BYTES, WorkerServer } from '../../src/cluster/worker-server.ts';
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

// A frontend that asks faster than it reads has its frames held back unread (MAX_UNSENT_BYTES), its pings with them:
// then what it reads of its answers is what the worker hears from it. One that stopped reading as well (its host
// vanished with megabytes on their way to it) is cut off after the timeout as a silent one is; one that reads on is not.
describe('a worker and a frontend whose frames it holds back unread', () => {
  /** Longer than above: the peer that reads on must be seen reading within it on a loaded machine. */
  const HELD_SILENCE_MS = 1500;
  /** Model cards asked for: megabytes each, past MAX_UNSENT_BYTES together. */
  const CARDS = 20;
  let dir: string;
  let bundle: Awaited<ReturnType<typeof createLocalEngine>>;
  let server: WorkerServer;
  let port: number;
  const logs: string[] = [];
  const sockets: net.Socket[] = [];

  before(async () => {
    // Slow enough (about 10 ms a token) that a long request still runs when the timeout passes.
    const fixture = writeWorkerLossFixture('frontend-silence-held', undefined, SLOW_DECODE_SHAPE);
    dir = fixture.dir;
    // A worker with a tokenizer: its model card (asked for with a frame of a few bytes) is answered with megabytes.
    bundle = await createLocalEngine({ modelPath: fixture.modelPath, threads: 1, kvCacheMemoryBytes: 8 * 1024 * 1024 });
    server = new WorkerServer({
      workerId: 'w-held', engine: bundle.engine, clusterToken: TOKEN, frontendSilenceTimeoutMs: HELD_SILENCE_MS,
      tokenizer: bundle.tokenizer, chatTemplate: bundle.chatTemplate, log: (level, message) => logs.push(`${level} ${message}`),
    });
    port = await server.listen(0, '127.0.0.1');
  });

  after(async () => {
    for (const socket of sockets) socket.destroy();
    await server?.close();
    await bundle?.engine.close();
    rmSync(dir, { recursive: true, force: true });
  });

  /**
   * A peer that said hello (asking for pings), started a long request and asked for 20 model cards, reading none of
   * the answers yet.
   */
  async function askingWithoutReading(): Promise<{ socket: net.Socket; closed: () => boolean; pingMs: number }> {
    const peer = await rawPeer(port, { ping: true });
    sockets.push(peer.socket);
    peer.socket.pause();
    // What comes now is cards (blob frames, megabytes each) and outputs, read by the test itself.
    peer.socket.removeAllListeners('data');
    peer.socket.write(Buffer.concat([encodeJsonFrame({ t: 'gen', request: toWireRequest(request(1000)), sentAt: engineNow() }),
      ...Array.from({ length: CARDS }, () => encodeJsonFrame({ t: 'card' }))]));
    await waitUntil(() => server.unsentBytes > MAX_UNSENT_BYTES, 'the worker holds back the peer\'s frames', 20_000);
    return { socket: peer.socket, closed: peer.closed, pingMs: Number(peer.messages.find((m) => m.t === 'welcome')!.pingMs) };
  }

  test('one that then reads nothing and sends nothing is cut off after the timeout', async () => {
    const silentBefore = server.silentFrontends;
    await askingWithoutReading();
    assert.equal(server.inFlight, 1);
    // The peer's end never sees the close (the worker's FIN waits behind the data the peer does not read): the worker's does.
    await waitUntil(() => server.silentFrontends === silentBefore + 1, 'the worker closed the connection of the peer that reads nothing', 6 * HELD_SILENCE_MS);
    await waitUntil(() => server.inFlight === 0, 'the worker stopped the peer\'s request', 5_000);
    assert.equal(server.frontendConnections, 0);
    assert.ok(logs.some((l) => new RegExp(`sent nothing \\(its frames wait unread\\) and read none of the \\d+ bytes held for it for ${HELD_SILENCE_MS} ms: closing its connection and stopping its 1 request`).test(l)),
      logs.join('\n'));
    assert.equal(server.unsentBytes, 0, 'what was held for it is dropped with the connection');
  });

  test('one that reads on and pings is not, and gets every answer', async () => {
    const silentBefore = server.silentFrontends;
    const peer = await askingWithoutReading();
    // Pings (which wait unread behind the held frames) and a slow read: one chunk (64 KiB at most) every 10 ms, so
    // the worker holds frames back for several of its checks and sees the peer read. (The worker sees the kernel take
    // more of its answers each time the peer has read about a third of the socket's send buffer, a megabyte or so:
    // a peer reading slower than that per timeout is taken for a silent one.)
    const pinging = setInterval(() => peer.socket.write(encodeJsonFrame({ t: 'ping' })), peer.pingMs);
    const reader = new FrameReader(64 * 1024 * 1024);
    let cards = 0;
    peer.socket.on('data', (chunk) => {
      peer.socket.pause();
      for (const frame of reader.push(chunk)) if (frame.kind === FRAME_BLOB) cards++;
    });
    const reading = setInterval(() => peer.socket.resume(), 10);
    const heldFor = performance.now();
    try {
      await waitUntil(() => cards === CARDS || server.silentFrontends > silentBefore, 'every card arrived', 10_000_000);
      assert.ok(performance.now() - heldFor > HELD_SILENCE_MS, 'the slow read outlasted the timeout');
      assert.equal(server.silentFrontends, silentBefore, 'a peer that reads is heard from');
    } finally {
      clearInterval(pinging);
      clearInterval(reading);
    }
    peer.socket.resume();
    const pingingOn = setInterval(() => peer.socket.write(encodeJsonFrame({ t: 'ping' })), peer.pingMs);
    try {
      await sleep(2 * HELD_SILENCE_MS);
    } finally {
      clearInterval(pingingOn);
    }
    assert.equal(peer.closed(), false, 'its pings, read again, keep it up');
    assert.equal(server.silentFrontends, silentBefore);
    peer.socket.destroy();
    await waitUntil(() => server.inFlight === 0, 'its request, if still running, stopped with its connection', 5_000);
  });
});
