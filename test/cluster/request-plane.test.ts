// The request plane over real TCP on 127.0.0.1: a CPU worker (a worker thread running a tiny synthetic model) served
// by WorkerServer, reached through RemoteEngine. Greedy output equals the engine's own, abort travels to the worker
// and frees its blocks, a dropped connection fails the request as worker_lost at once and stops it on the worker,
// and a wrong token, garbage, an oversized frame or a bad request (a prompt token id outside the vocabulary among them)
// are refused with a logged reason while the worker keeps serving others. The model card carries the tokenizer and
// chat template to the frontend, which drops a card it did not ask for without decoding it.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';
import { rmSync } from 'node:fs';
import { engineNow } from '../../src/engine/clock.ts';
import { createLocalEngine, type LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineRequest, type SamplingParams } from '../../src/engine/types.ts';
import { tokenizerFromWorkerSource } from '../../src/model/tokenizer/worker-source.ts';
import type { TokenizerWorkerSource } from '../../src/model/tokenizer/types.ts';
import { encodeBlobFrame, encodeJsonFrame, FRAME_BLOB, FrameReader, parseJsonMessage } from '../../src/cluster/frames.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { REQUEST_PLANE_VERSION } from '../../src/cluster/request-plane.ts';
import { MAX_UNSENT_BYTES, WorkerServer } from '../../src/cluster/worker-server.ts';
import { collect, text, tokens } from '../helpers/outputs.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

const TOKEN = 'test-cluster-token';
let nextId = 0;
function request(sampling: Partial<SamplingParams> = {}, promptLength = 24, group = 0): EngineRequest {
  return {
    id: `rp${nextId++}`, promptTokenIds: Array.from({ length: promptLength }, (_, i) => 200 + ((group * 7919 + i * 37) % 3000)), priority: 0,
    arrivalMs: engineNow(), traceparent: '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01',
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 40, ignoreEos: true, temperature: 0, repetitionPenalty: 1.3, ...sampling },
  };
}

/** Sends raw bytes to the worker and resolves with what it answered before closing. */
function rawExchange(port: number, bytes: Buffer): Promise<{ messages: Record<string, unknown>[]; closed: boolean }> {
  return new Promise((resolve) => {
    const socket = net.connect({ host: '127.0.0.1', port });
    const reader = new FrameReader();
    const messages: Record<string, unknown>[] = [];
    socket.on('data', (chunk) => { for (const f of reader.push(chunk)) messages.push(parseJsonMessage(f.payload)); });
    socket.on('error', () => {});
    socket.on('close', () => resolve({ messages, closed: true }));
    socket.on('connect', () => socket.write(bytes));
  });
}

describe('request plane', () => {
  let dir: string;
  let bundle: Awaited<ReturnType<typeof createLocalEngine>>;
  let server: WorkerServer;
  let port: number;
  const logs: string[] = [];
  const remotes: RemoteEngine[] = [];

  before(async () => {
    const fixture = writeWorkerLossFixture('request-plane');
    dir = fixture.dir;
    bundle = await createLocalEngine({ modelPath: fixture.modelPath, threads: 1, enableKvEvents: true, kvCacheMemoryBytes: 8 * 1024 * 1024 });
    server = new WorkerServer({
      workerId: 'w-test', engine: bundle.engine, clusterToken: TOKEN, maxFrameBytes: 1024 * 1024,
      tokenizer: bundle.tokenizer, chatTemplate: bundle.chatTemplate, log: (level, message) => logs.push(`${level} ${message}`),
    });
    port = await server.listen(0, '127.0.0.1');
  });

  after(async () => {
    for (const remote of remotes) await remote.close();
    await server?.close();
    await bundle?.engine.close();
    rmSync(dir, { recursive: true, force: true });
  });

  const connect = async (events = false): Promise<RemoteEngine> => {
    const remote = await RemoteEngine.connect(`127.0.0.1:${port}`, { clusterToken: TOKEN, events });
    remotes.push(remote);
    return remote;
  };

  test('greedy output over the connection equals the engine\'s own, traceparent and timestamps carried', async () => {
    const remote = await connect();
    assert.equal(remote.workerId, 'w-test');
    assert.equal(remote.info.blockSize, bundle.engine.info.blockSize);
    // How the weights are stored crosses the wire too: the frontend's prefill metrics are labelled by it.
    assert.ok(bundle.engine.info.quantization !== undefined);
    assert.equal(remote.info.quantization, bundle.engine.info.quantization);
    assert.equal(remote.info.kvDtype, bundle.engine.info.kvDtype);
    const local = await collect(bundle.engine.generate(request()));
    const req = request({ logitBias: new Map([[300, -2]]) });
    const direct = await collect(bundle.engine.generate({ ...request({ logitBias: new Map([[300, -2]]) }) }));
    const viaWire = await collect(remote.generate(req));
    assert.deepEqual(tokens(viaWire), tokens(direct));
    assert.equal(text(viaWire), text(direct));
    assert.equal(tokens(local).length, 40);
    const last = viaWire.at(-1)!;
    assert.equal(last.finishReason, 'length');
    assert.equal(last.traceparent, req.traceparent);
    assert.ok(last.timestamps.firstToken! >= last.timestamps.arrival && last.timestamps.prefillChunks.length > 0);
    assert.equal(remote.stats().numRunning, 0);
  });

  test('abort from the frontend stops the request on the worker and frees its blocks', async () => {
    const remote = await connect();
    const req = request({ maxTokens: 400 });
    const outputs = [];
    for await (const output of remote.generate(req)) {
      outputs.push(output);
      if (outputs.length === 3) remote.abort(req.id);
    }
    // Stopped by the abort, not by max_tokens. How many outputs were already on their way when it went depends on
    // how far the worker ran ahead of this reader (a loaded machine: dozens), so no count is asserted beyond that.
    assert.equal(outputs.at(-1)!.finishReason, 'abort');
    const generated = outputs.reduce((sum, output) => sum + output.newTokenIds.length, 0);
    assert.ok(generated < req.sampling.maxTokens, `${generated} tokens of ${req.sampling.maxTokens}`);
    const stats = await (bundle.engine as LocalEngine).sync();
    assert.equal(stats.kvBlocksUsed, 0);
    assert.equal(server.inFlight, 0);
  });

  test('a dropped connection fails the stream as worker_lost at once and stops the request on the worker', async () => {
    const remote = await connect();
    let lost: Error | undefined;
    remote.onLost((error) => { lost = error; });
    const req = request({ maxTokens: 800 });
    const seen: number[] = [];
    await assert.rejects(async () => {
      for await (const output of remote.generate(req)) {
        seen.push(...output.newTokenIds);
        // The worker end goes away, as when its process dies: the kernel closes the socket.
        if (seen.length === 3) (remote as unknown as { socket: net.Socket }).socket.destroy();
      }
    }, (error: Error) => error.name === 'WorkerLostError');
    assert.equal(lost?.name, 'WorkerLostError');
    await waitUntil(() => server.inFlight === 0, 'the worker stopped the orphaned request');
    const stats = await (bundle.engine as LocalEngine).sync();
    assert.equal(stats.kvBlocksUsed, 0);
  });

  test('a wrong token, garbage, an oversized frame and a bad request are refused, logged, and the worker serves on', async () => {
    const refusalsBefore = server.refusals;
    const wrong = await rawExchange(port, encodeJsonFrame({ t: 'hello', v: REQUEST_PLANE_VERSION, token: 'nope' }));
    assert.equal(wrong.messages[0]?.t, 'refused');
    assert.match(String(wrong.messages[0]?.reason), /wrong cluster token/);
    await assert.rejects(RemoteEngine.connect(`127.0.0.1:${port}`, { clusterToken: 'nope' }), /refused the connection: wrong cluster token/);
    // A peer of another protocol version (one from before lora-load / lora-unload) is refused at hello, by name.
    const older = await rawExchange(port, encodeJsonFrame({ t: 'hello', v: 1, token: TOKEN }));
    assert.equal(older.messages[0]?.t, 'refused');
    assert.equal(older.messages[0]?.reason, `request plane version 1 (this worker speaks ${REQUEST_PLANE_VERSION})`);
    assert.equal(REQUEST_PLANE_VERSION, 2);
    const garbage = await rawExchange(port, Buffer.from('\x00\x00\x00\x05\x00{{{{GET / HTTP/1.1\r\n\r\n'));
    assert.equal(garbage.messages[0]?.t, 'refused');
    assert.match(String(garbage.messages[0]?.reason), /not JSON/);
    const oversized = Buffer.alloc(8);
    oversized.writeUInt32BE(0x7fffffff, 0);
    const big = await rawExchange(port, oversized);
    assert.match(String(big.messages[0]?.reason), /over the limit/);
    // Authenticated, then a frame past the post-hello limit (1 MiB here) and, on another connection, a bad request.
    const hello = encodeJsonFrame({ t: 'hello', v: REQUEST_PLANE_VERSION, token: TOKEN });
    const huge = Buffer.alloc(8);
    huge.writeUInt32BE(2 * 1024 * 1024, 0);
    const afterHello = await rawExchange(port, Buffer.concat([hello, huge]));
    assert.equal(afterHello.messages[0]?.t, 'welcome');
    assert.match(String(afterHello.messages.at(-1)?.reason), /over the limit of 1048576/);
    const badRequest = await rawExchange(port, Buffer.concat([hello, encodeJsonFrame({ t: 'gen', request: { id: 'x' } }),
      encodeJsonFrame({ t: 'nonsense' })]));
    const err = badRequest.messages.find((m) => m.t === 'err');
    assert.equal(err?.code, 'invalid_request');
    assert.match(String(badRequest.messages.at(-1)?.reason), /unknown message type/);
    assert.ok(server.refusals >= refusalsBefore + 7);
    assert.ok(logs.some((line) => /wrong cluster token/.test(line)) && logs.some((line) => /over the limit/.test(line)));
    // Still serving.
    const remote = await connect();
    const outputs = await collect(remote.generate(request({ maxTokens: 5 })));
    assert.equal(tokens(outputs).length, 5);
  });

  test('a prompt holding a token id outside the vocabulary is refused as invalid_request, naming the id', async () => {
    const remote = await connect();
    const vocab = bundle.engine.info.vocabSize;
    // The engine would end such a request with an empty stream and no error: the worker refuses it first.
    const outside = { ...request({ maxTokens: 4 }), promptTokenIds: [1, 2, vocab + 5, 3] };
    await assert.rejects(collect(remote.generate(outside)), (error: Error & { code?: string }) => {
      assert.equal(error.name, 'InvalidRequestError');
      assert.equal(error.code, 'invalid_request');
      assert.match(error.message, new RegExp(`token id ${vocab + 5}, outside the model's vocabulary of ${vocab} tokens`));
      return true;
    });
    // The id just past the end is outside too; the last one is not. The connection serves on.
    await assert.rejects(collect(remote.generate({ ...request({ maxTokens: 4 }), promptTokenIds: [vocab] })), /token id/);
    const outputs = await collect(remote.generate({ ...request({ maxTokens: 4 }), promptTokenIds: [1, 2, vocab - 1] }));
    assert.equal(outputs.at(-1)!.finishReason, 'length');
    assert.equal(remote.lost, false);
    assert.equal(server.inFlight, 0);
  });

  test('the model card rebuilds the worker\'s tokenizer and chat template', async () => {
    const remote = await connect();
    const card = await remote.modelCard();
    assert.ok(card);
    const tokenizer = tokenizerFromWorkerSource(card.tokenizer as TokenizerWorkerSource);
    assert.deepEqual(tokenizer.encode('Hello there, distributed world'), bundle.tokenizer.encode('Hello there, distributed world'));
    assert.equal(card.chatTemplate.isFallback, bundle.chatTemplate.isFallback);
  });

  test('a peer that asks for model cards without reading the answers does not make the worker buffer them all', async () => {
    const socket = net.connect({ host: '127.0.0.1', port });
    socket.on('error', () => {});
    // Nothing is read until the end: the answers pile up in the kernel's buffers, then in the worker's.
    socket.pause();
    await new Promise((resolve) => socket.once('connect', resolve));
    const asks = 40;
    socket.write(Buffer.concat([encodeJsonFrame({ t: 'hello', v: REQUEST_PLANE_VERSION, token: TOKEN }),
      ...Array.from({ length: asks }, () => encodeJsonFrame({ t: 'card' }))]));
    const cardBytes = encodeJsonFrame({ t: 'card' }).length;
    assert.ok(cardBytes < 20, 'each ask is a few bytes');
    // The worker answers until its unsent bytes pass its bound, and then reads no more of the connection.
    await waitUntil(() => server.unsentBytes > MAX_UNSENT_BYTES, 'the worker answered past its bound');
    await new Promise((resolve) => setTimeout(resolve, 300));
    const oneCard = 2 * 1024 * 1024;
    assert.ok(server.unsentBytes < MAX_UNSENT_BYTES + oneCard,
      `${server.unsentBytes} bytes held for a peer that sent ${asks} asks of ${cardBytes} bytes (bound ${MAX_UNSENT_BYTES})`);
    // Deferred, not dropped: once the peer reads, every card comes, and the connection serves on.
    const reader = new FrameReader(64 * 1024 * 1024);
    let cards = 0;
    socket.on('data', (chunk) => { for (const frame of reader.push(chunk)) if (frame.kind === FRAME_BLOB) cards++; });
    socket.resume();
    await waitUntil(() => cards === asks, `all ${asks} cards arrived (${cards})`, 60_000);
    socket.destroy();
    const remote = await connect();
    assert.equal(tokens(await collect(remote.generate(request({ maxTokens: 3 })))).length, 3);
  });

  test('KV events reach a connection that asked for them, and a snapshot matches them', async () => {
    const remote = await connect(true);
    const seen = new Set<string>();
    remote.onKvEvents((events) => { for (const e of events) if (e.type === 'stored') for (const h of e.blockHashes) seen.add(h); });
    await collect(remote.generate(request({ maxTokens: 4 }, 70, 5)));
    await waitUntil(() => seen.size >= 4, 'stored events arrived');
    const snapshot = await remote.snapshot();
    for (const hash of seen) assert.ok(snapshot.hashes.includes(hash as never));
    assert.equal(snapshot.lastEventId, server.kv.lastEventId);
  });
});

describe('a frontend and a blob frame it did not ask for', () => {
  let fake: net.Server;
  const peers: net.Socket[] = [];

  after(async () => {
    for (const socket of peers) socket.destroy();
    await new Promise<void>((resolve) => fake.close(() => resolve()));
  });

  test('is dropped undecoded: the connection stays and the frames after it are read', async () => {
    const stats = { numRunning: 0, numWaiting: 0, kvBlocksUsed: 0, kvBlocksTotal: 64, prefixCacheQueries: 0, prefixCacheHits: 0, preemptions: 0 };
    // A worker that welcomes, then sends a blob frame nobody asked for (bytes no structured clone decodes), then a
    // heartbeat whose stats the frontend must take.
    fake = net.createServer((socket) => {
      peers.push(socket);
      socket.on('error', () => {});
      socket.once('data', () => {
        socket.write(encodeJsonFrame({
          t: 'welcome', v: REQUEST_PLANE_VERSION, workerId: 'fake', role: 'both', draining: false, stats,
          info: { modelName: 'fake', maxModelLen: 256, vocabSize: 256, kvCapacityTokens: 1024, blockSize: 16, backend: 'cpu', kernelVariants: {}, threads: 1 },
        }));
        setTimeout(() => {
          socket.write(encodeBlobFrame(Buffer.from('not a structured clone at all')));
          socket.write(encodeJsonFrame({ t: 'hb', stats: { ...stats, numWaiting: 7 } }));
        }, 50);
      });
    });
    const fakePort = await new Promise<number>((resolve) => fake.listen(0, '127.0.0.1', () => resolve((fake.address() as net.AddressInfo).port)));
    const remote = await RemoteEngine.connect(`127.0.0.1:${fakePort}`, { clusterToken: TOKEN });
    let lost: Error | undefined;
    remote.onLost((error) => { lost = error; });
    await waitUntil(() => remote.stats().numWaiting === 7 || lost !== undefined, 'the heartbeat after the blob arrived', 10_000);
    assert.equal(lost, undefined, `the connection was dropped: ${lost?.message}`);
    assert.equal(remote.lost, false);
    await remote.close();
  });
});
