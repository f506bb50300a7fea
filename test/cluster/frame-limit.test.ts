// A request whose request-plane frame is over a worker's --max-frame-bytes is refused alone: an invalid_request error
// naming the limit (the client's 400), nothing sent, no other stream on the connection disturbed, no migration of it
// to the next worker. The frontend learns the worker's limit from its welcome; a frontend that does not check it (an
// earlier release) has the worker skip that frame and refuse that request only, the connection staying. A frame
// over the limit that names no request still closes the connection. A frontend whose own --max-frame-bytes is below
// the model card's size says so once, by name, and does not retry every second. Real etcd on a free loopback port,
// sim workers (real time, so streams last seconds) started as `conduit worker` starts them, ClusterFrontends and
// RemoteEngines in this process.
import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import net from 'node:net';
import { engineFailure } from '../../src/api/generation-run.ts';
import { etcdClient } from '../../src/cluster/discovery.ts';
import { encodeJsonFrame, FrameReader, parseJsonMessage, type Frame } from '../../src/cluster/frames.ts';
import { ClusterFrontend } from '../../src/cluster/frontend.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { mayBeOversizedRequest, oversizedRequest, REQUEST_PLANE_VERSION, toWireRequest } from '../../src/cluster/request-plane.ts';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import { ETCD_BIN, freePort } from '../helpers/cluster-services.ts';
import { collect } from '../helpers/outputs.ts';
import { frontendBed } from '../helpers/frontend-bed.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(ETCD_BIN) ? undefined : `needs ${ETCD_BIN} (Debian etcd-server)`;
const TOKEN = 'frame-limit-test-token';
const WORKER_LIMIT = 64 * 1024;

let nextId = 0;
/** A prompt of `length` tokens (ids of four digits: about five bytes each in the frame) and `maxTokens` to generate. */
function request(length: number, maxTokens: number): EngineRequest {
  const n = nextId++;
  return {
    id: `frame-limit-${n}`, promptTokenIds: Array.from({ length }, (_, i) => 1000 + ((n * 7919 + i * 37) % 9000)), priority: 0,
    arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens, ignoreEos: true, temperature: 0 },
  };
}

/** Runs a stream to its end: its outputs, or the error it failed with. */
async function run(stream: AsyncIterable<EngineOutput>): Promise<EngineOutput[] | Error> {
  try {
    return await collect(stream);
  } catch (error) {
    return error as Error;
  }
}

describe('a worker\'s frame reader skipping an oversized request', () => {
  const skipping = () => {
    const reader = new FrameReader(WORKER_LIMIT);
    reader.skipOversized = { headBytes: 1024, plausible: mayBeOversizedRequest };
    return reader;
  };

  test('the oversized frame comes out as its head, the rest is dropped, and the next frame follows, whatever the chunks', () => {
    // The fields in the order a frontend's gateway builds them: its template's scalars, then the id.
    const { id, promptTokenIds, sampling } = request(20_000, 2);
    const big: EngineRequest = {
      priority: 0, arrivalMs: 1.5, tenant: 'acme "corp"', traceparent: '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01',
      id, promptTokenIds, sampling,
    };
    const oversized = encodeJsonFrame({ t: 'gen', request: toWireRequest(big), sentAt: 1 });
    const next = encodeJsonFrame({ t: 'abort', id: 'x' });
    const bytes = Buffer.concat([oversized, next]);
    for (const chunk of [1, 7, 1000, 65_536]) {
      const reader = skipping();
      const frames: Frame[] = [];
      for (let at = 0; at < bytes.length; at += chunk) frames.push(...reader.push(bytes.subarray(at, at + chunk)));
      assert.equal(frames.length, 2, `chunks of ${chunk}`);
      assert.equal(frames[0]!.oversizedBytes, oversized.length - 4);
      assert.equal(frames[0]!.payload.length, 1023);
      assert.deepEqual(oversizedRequest(frames[0]!.payload), { t: 'gen', id: big.id });
      assert.deepEqual(parseJsonMessage(frames[1]!.payload), { t: 'abort', id: 'x' });
    }
  });

  test('a frame over the limit that does not begin as a request is refused at once', () => {
    const header = Buffer.alloc(12);
    header.writeUInt32BE(WORKER_LIMIT + 1, 0);
    header.write('{"t":"snap', 5, 'latin1');
    assert.throws(() => skipping().push(header), /frame of 65537 bytes is over the limit of 65536 bytes/);
    // The beginning of a request: the reader waits for the rest of its head.
    header.write('{"t":"gen"', 5, 'latin1');
    assert.deepEqual(skipping().push(header.subarray(0, 15)), []);
  });
});

describe('a request frame over a worker\'s --max-frame-bytes', { skip }, () => {
  const bed = frontendBed('frame-limit', TOKEN);
  const frontends: ClusterFrontend[] = [];
  const remotes: RemoteEngine[] = [];
  let namespaces = 0;

  after(async () => {
    for (const remote of remotes) await remote.close();
    for (const frontend of frontends) await frontend.close();
  });

  async function startFrontend(logs: string[], options: { migrationLimit?: number; maxFrameBytes?: number } = {}) {
    const namespace = `frame-limit-${namespaces++}`;
    const frontend = new ClusterFrontend({
      namespace, clusterToken: TOKEN, etcd: etcdClient({ endpoints: [bed.etcdUrl] }), ...options,
      log: (level, message) => { logs.push(`${level} ${message}`); },
    });
    frontends.push(frontend);
    await frontend.start();
    return { frontend, namespace };
  }

  /** A sim worker with a 64 KiB frame limit; registered in `namespace` when one is given. */
  async function startWorker(workerId: string, namespace?: string, logs: string[] = []): Promise<RunningWorker> {
    const worker = await startClusterWorker({
      workerId, role: 'both', namespace: namespace ?? 'unregistered', clusterToken: TOKEN, host: '127.0.0.1', port: await freePort(),
      ...(namespace ? { etcd: { endpoints: [bed.etcdUrl] } } : {}), leaseTtlSeconds: 5, maxFrameBytes: WORKER_LIMIT,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: 1 } },
      log: (level, message) => { logs.push(`${workerId} ${level} ${message}`); },
    });
    bed.workers.push(worker);
    return worker;
  }

  test('through a frontend with migration on: only that request fails, with a 400 naming the limit', async () => {
    const logs: string[] = [];
    const { frontend, namespace } = await startFrontend(logs, { migrationLimit: 3 });
    const workers = [await startWorker('w1', namespace, logs), await startWorker('w2', namespace, logs)];
    const engine = await frontend.ready();
    await waitUntil(() => frontend.engine?.workerIds.length === 2, 'both workers joined', 20_000);

    // Long streams on both workers (the router spreads them), then a request whose frame is about 100 KB.
    const innocent = [0, 1, 2, 3].map(() => run(engine.generate(request(8, 200))));
    await waitUntil(() => workers.every((w) => w.server.inFlight > 0), 'the streams run on both workers', 20_000);
    const big = request(20_000, 2);
    const failure = await run(engine.generate(big));
    assert.ok(failure instanceof Error, 'the oversized request failed');
    assert.equal(failure.name, 'InvalidRequestError');
    assert.equal((failure as Error & { code?: string }).code, 'invalid_request');
    assert.match(failure.message, new RegExp(`^request "${big.id}": the request is too large for the engine worker: its request-plane `
      + `frame of \\d+ bytes is over worker w[12]'s limit of ${WORKER_LIMIT} bytes \\(--max-frame-bytes\\)$`));
    // What its client gets: a 400 invalid_request, not a 503 worker_lost.
    const answer = engineFailure(failure);
    assert.equal(answer.statusCode, 400);
    assert.equal(answer.code, 'invalid_request');

    for (const outputs of await Promise.all(innocent)) {
      assert.ok(Array.isArray(outputs), `an unrelated stream failed: ${String(outputs)}`);
      assert.equal(outputs.at(-1)!.finishReason, 'length');
      assert.equal(outputs.flatMap((o) => o.newTokenIds).length, 200);
    }
    // Nothing was lost or moved: the frontend never sent the frame, and each worker kept its one connection.
    assert.ok(!logs.some((l) => /was lost|bad frame|closing connection/.test(l)), logs.join('\n'));
    for (const worker of workers) {
      assert.equal(worker.server.frontendConnections, 1);
      assert.equal(worker.server.oversizedRequests, 0);
    }
    assert.deepEqual(frontend.engine!.workerIds.sort(), ['w1', 'w2']);
  });

  test('a frontend that does not check the limit: the worker refuses that request alone, the connection stays', async () => {
    const worker = await startWorker('w-old');
    const remote = await RemoteEngine.connect(worker.address, { clusterToken: TOKEN });
    remotes.push(remote);
    assert.equal(remote.maxFrameBytes, WORKER_LIMIT, 'the welcome says the worker\'s limit');
    // As a frontend of an earlier release: no limit known, every frame sent.
    (remote as unknown as { maxFrameBytes: number | undefined }).maxFrameBytes = undefined;

    const long = run(remote.generate(request(8, 200)));
    await waitUntil(() => worker.server.inFlight === 1, 'the long stream runs', 20_000);
    const big = request(20_000, 2);
    const failure = await run(remote.generate(big));
    assert.ok(failure instanceof Error);
    assert.equal(failure.name, 'InvalidRequestError');
    assert.match(failure.message, new RegExp(`^request "${big.id}": the request is too large for the engine worker: its request-plane `
      + `frame of \\d+ bytes is over worker w-old's limit of ${WORKER_LIMIT} bytes \\(--max-frame-bytes\\)$`));
    assert.equal(worker.server.oversizedRequests, 1);
    assert.equal(remote.lost, false);
    // The frames after the skipped one are read as before, on the same connection.
    const after = await run(remote.generate(request(16, 4)));
    assert.ok(Array.isArray(after) && after.at(-1)!.finishReason === 'length', String(after));
    const outputs = await long;
    assert.ok(Array.isArray(outputs) && outputs.at(-1)!.finishReason === 'length', String(outputs));
    assert.equal(worker.server.frontendConnections, 1);

    // A frame over the limit that carries no request the worker can name still closes that connection.
    const answered = await new Promise<{ messages: Record<string, unknown>[] }>((resolve) => {
      const socket = net.connect({ host: '127.0.0.1', port: Number(worker.address.split(':')[1]) });
      const reader = new FrameReader();
      const messages: Record<string, unknown>[] = [];
      socket.on('data', (chunk) => { for (const f of reader.push(chunk)) messages.push(parseJsonMessage(f.payload)); });
      socket.on('error', () => {});
      socket.on('close', () => resolve({ messages }));
      socket.on('connect', () => socket.write(Buffer.concat([
        encodeJsonFrame({ t: 'hello', v: REQUEST_PLANE_VERSION, token: TOKEN }),
        encodeJsonFrame({ t: 'snapshot', padding: 'x'.repeat(WORKER_LIMIT) }),
      ])));
    });
    assert.equal(answered.messages[0]?.t, 'welcome');
    assert.equal(answered.messages[0]?.maxFrameBytes, WORKER_LIMIT);
    assert.match(String(answered.messages.at(-1)?.reason), new RegExp(`over the limit of ${WORKER_LIMIT} bytes`));
  });

  test('a model card over the frontend\'s own limit is named once, not retried every second', async () => {
    const logs: string[] = [];
    const { frontend, namespace } = await startFrontend(logs, { maxFrameBytes: 256 * 1024 });
    await startWorker('w-card', namespace);
    const named = (l: string) => l.startsWith('error request plane: the model card of worker w-card');
    await waitUntil(() => logs.some(named), 'the frontend named the model card', 20_000);
    assert.match(logs.find(named)!, new RegExp('^error request plane: the model card of worker w-card at 127\\.0\\.0\\.1:\\d+ is a frame of '
      + '\\d+ bytes, over this frontend\'s limit of 262144 bytes \\(--max-frame-bytes\\): this frontend cannot serve the model until '
      + 'it runs with a larger --max-frame-bytes; not retried while worker w-card stays registered as it is$'));
    await new Promise((resolve) => setTimeout(resolve, 2500));
    assert.equal(logs.filter(named).length, 1, logs.join('\n'));
    assert.ok(!logs.some((l) => /retrying in 1 s/.test(l)), logs.join('\n'));
    assert.equal(frontend.engine, undefined);
  });
});
