// A request whose request-plane frame is over a worker's --max-frame-bytes is refused alone: an invalid_request error
// naming the limit (the client's 400), nothing sent, no other stream on the connection disturbed, no migration of it
// to the next worker. The frontend learns the worker's limit from its welcome; a frontend that does not check it (an
// earlier release) has the worker skip that frame and refuse that request only, the connection staying. A frame
// over the limit that names no request still closes the connection. A frontend whose own --max-frame-bytes is below
// the model card's size says so once, by name, and does not retry every second; as `conduit frontend` (a real
// process, over real NATS too), it names that worker and the limit in /health and in the 503 a request gets, until
// the worker's registration changes or a worker whose card it reads joins. Real etcd on a free loopback port, sim
// workers (real time, so streams last seconds) started as `conduit worker` starts them, ClusterFrontends and
// RemoteEngines in this process.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import net from 'node:net';
import { engineFailure } from '../../src/api/generation-run.ts';
import { etcdClient, WorkerRegistration } from '../../src/cluster/discovery.ts';
import { encodeJsonFrame, FrameReader, parseJsonMessage, type Frame } from '../../src/cluster/frames.ts';
import { ClusterFrontend } from '../../src/cluster/frontend.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { mayBeOversizedRequest, oversizedRequest, REQUEST_PLANE_VERSION, toWireRequest } from '../../src/cluster/request-plane.ts';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import type { ChatTemplate } from '../../src/model/chat-template.ts';
import { ETCD_BIN, freePort, servicesMissing, startConduit, startNats, waitForPort, type Nats } from '../helpers/cluster-services.ts';
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

describe('`conduit frontend` with a --max-frame-bytes below a worker\'s model card', { skip: servicesMissing() }, () => {
  const bed = frontendBed('frame-limit-health', TOKEN);
  // The bed's after hook stops every process started here (NATS and the frontend included).
  let nats: Nats;
  before(async () => {
    nats = await startNats();
  });

  /** A sim worker, not registered: the test registers it (its card changed first, or again after it left). */
  async function startWorker(workerId: string, namespace?: string): Promise<RunningWorker> {
    const worker = await startClusterWorker({
      workerId, role: 'both', namespace: namespace ?? 'unregistered', clusterToken: TOKEN, host: '127.0.0.1', port: await freePort(),
      ...(namespace ? { etcd: { endpoints: [bed.etcdUrl] } } : {}), leaseTtlSeconds: 5,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: 1 } },
      log: () => {},
    });
    bed.workers.push(worker);
    return worker;
  }

  interface Health { status: string; ready: boolean; reason?: string; workers?: { id: string; state: string; error?: string }[] }

  test('/health and a refused request name the worker, its card\'s size and the limit; the reason goes with its registration and once a worker joins', { timeout: 120_000 }, async () => {
    const namespace = 'frame-limit-health';
    const limit = 1536 * 1024;
    const port = await freePort();
    const frontend = startConduit(['frontend', '--port', String(port), '--namespace', namespace, '--cluster-token', TOKEN,
      '--etcd-endpoints', bed.etcdUrl, '--nats-server', nats.url, '--max-frame-bytes', '1536KiB']);
    await waitForPort(port);
    const base = `http://127.0.0.1:${port}`;
    const health = async () => {
      const res = await fetch(`${base}/health`);
      return { status: res.status, body: await res.json() as Health };
    };
    /** Polls /health until `done` holds (bounded), and gives that answer. */
    const healthWhen = async (done: (body: Health) => boolean, what: string) => {
      for (const deadline = Date.now() + 30_000; ;) {
        const answer = await health();
        if (done(answer.body)) return answer;
        if (Date.now() > deadline) assert.fail(`no /health ${what} within 30 s: ${JSON.stringify(answer.body)}\n${frontend.output()}`);
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
    };
    const etcd = etcdClient({ endpoints: [bed.etcdUrl] });
    const registrations: WorkerRegistration[] = [];
    const register = async (worker: RunningWorker) => {
      const registration = new WorkerRegistration(etcd, namespace, worker.record, 5, () => {});
      registrations.push(registration);
      await registration.start();
      return registration;
    };
    try {
      // Nothing registered: loading, and nothing more to say.
      const empty = await healthWhen((body) => body.workers !== undefined, 'listing the workers found');
      assert.equal(empty.status, 503);
      assert.deepEqual(empty.body.workers, []);
      assert.equal(empty.body.reason, undefined);

      // A worker whose card is padded (a chat template of 1 MiB of text) to about 2.1 MB: over the frontend's 1.5 MiB,
      // where the card of a plain sim worker (about 1.1 MB) fits.
      const big = await startWorker('w-card');
      const options = (big.server as unknown as { options: { chatTemplate: ChatTemplate } }).options;
      options.chatTemplate = options.chatTemplate.withTemplate(`${'padding '.repeat(1 << 17)}{{ messages[0]['content'] }}`);
      let registration = await register(big);
      const named = await healthWhen((body) => body.reason !== undefined, 'giving a reason');
      assert.equal(named.status, 503);
      assert.equal(named.body.status, 'loading');
      assert.equal(named.body.ready, false);
      const reason = new RegExp(`^the model card of worker w-card is a frame of (\\d+) bytes, (\\d+) over this frontend's --max-frame-bytes of `
        + `${limit} bytes: no model is served until the frontend runs with --max-frame-bytes \\(or CONDUIT_MAX_FRAME_BYTES\\) of at least (\\d+) bytes$`);
      const [, cardBytes, over, atLeast] = reason.exec(named.body.reason!) ?? assert.fail(named.body.reason);
      assert.ok(Number(cardBytes) > limit, cardBytes);
      assert.equal(Number(over), Number(cardBytes) - limit);
      assert.equal(atLeast, cardBytes);
      assert.equal(named.body.workers?.length, 1);
      assert.equal(named.body.workers![0]!.id, 'w-card');
      assert.equal(named.body.workers![0]!.state, 'unusable');
      assert.match(named.body.workers![0]!.error!, new RegExp(`^the model card of worker w-card at 127\\.0\\.0\\.1:\\d+ is a frame of ${cardBytes} bytes, `
        + `over this frontend's limit of ${limit} bytes \\(--max-frame-bytes\\)`));

      // A request is refused as before (503 not_ready), the reason in its OpenAI error.
      const refused = await fetch(`${base}/v1/completions`, {
        method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: 'Hello', max_tokens: 2 }),
      });
      assert.equal(refused.status, 503);
      const error = (await refused.json() as { error: { message: string; type: string; code: string } }).error;
      assert.equal(error.type, 'server_error');
      assert.equal(error.code, 'not_ready');
      assert.equal(error.message, `The server is without a model (${named.body.reason}) and cannot take requests yet.`);

      // The worker leaves: nothing stands in the way any more, the frontend is only loading.
      await registration.deregister();
      const gone = await healthWhen((body) => body.workers?.length === 0, 'without the worker that left');
      assert.equal(gone.status, 503);
      assert.equal(gone.body.status, 'loading');
      assert.equal(gone.body.reason, undefined);
      // Registered again, it is read again, and named again.
      registration = await register(big);
      await healthWhen((body) => reason.test(body.reason ?? ''), 'naming the worker again');

      // A worker whose card fits joins: the frontend serves, and only the worker's entry still says why it is unused.
      await startWorker('w-fits', namespace);
      const ready = await healthWhen((body) => body.ready, 'ready');
      assert.equal(ready.status, 200);
      assert.equal(ready.body.reason, undefined);
      const states = Object.fromEntries(ready.body.workers!.map((w) => [w.id, w.state]));
      assert.deepEqual(states, { 'w-card': 'unusable', 'w-fits': 'ready' });
      const served = await fetch(`${base}/v1/completions`, {
        method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: 'Hello', max_tokens: 2 }),
      });
      assert.equal(served.status, 200, await served.clone().text());
      // The card over the limit was logged once per registration (twice), never retried in between.
      assert.equal(frontend.output().match(/not retried while worker w-card stays registered as it is/g)?.length, 2, frontend.output());
    } finally {
      for (const registration of registrations) await registration.deregister();
      etcd.close();
      frontend.kill();
    }
  });
});
