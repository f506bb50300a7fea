// Disaggregated prefill/decode over the request plane: a prefill worker server and a decode worker server (each a
// real CPU engine), the KV of each prompt pulled by the decode worker straight from the prefill worker's KV port.
// Greedy output equals an aggregated worker's, also when the decode worker holds part of the prompt in its own
// prefix cache (only the rest moves); a corrupted transfer and a lost prefill worker fall back to a prefill on the
// decode worker with the same greedy text. Cancellation at every stage (prefill, pull in flight, decode), the prefill
// worker gone mid-transfer and the decode worker lost mid-stream leave no block held, no pull or queue slot taken.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { engineNow } from '../../src/engine/clock.ts';
import { LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { remoteDisaggregatedEngine } from '../../src/cluster/remote-disagg.ts';
import { WorkerServer } from '../../src/cluster/worker-server.ts';
import { kvHostId } from '../../src/cluster/kv-shm.ts';
import { PREFILL_WORKER_LOST, type DisaggregatedEngine } from '../../src/runtime/disaggregated.ts';
import { cpuTestModel } from '../helpers/cpu-model.ts';
import { freePort } from '../helpers/cluster-services.ts';
import { collect, text, tokens } from '../helpers/outputs.ts';
import { kvBlockBytes, type KvHandoff } from '../../src/engine/handoff.ts';
import { startTcpRelay, type TcpRelay, type TcpRelayOptions } from '../helpers/tcp-relay.ts';
import { CallTrace } from '../../src/api/call-trace.ts';
import { Telemetry } from '../../src/telemetry/telemetry.ts';
import type { RequestTrace } from '../../src/telemetry/trace.ts';

const TOKEN = 'disagg-token';
const BLOCK = 16;
let nextId = 0;

function request(promptTokenIds: number[], maxTokens = 10): EngineRequest {
  return {
    id: `rd${nextId++}`, promptTokenIds, priority: 0, arrivalMs: engineNow(),
    sampling: { ...DEFAULT_SAMPLING, maxTokens, ignoreEos: true, temperature: 0 },
  };
}

/**
 * Waits (bounded) until a worker holds no block: the release of a handed-off request's pin travels over the request
 * plane, and may reach the prefill engine after a sync() posted to it directly.
 */
async function assertFree(s: { engine: LocalEngine; server: WorkerServer }): Promise<void> {
  for (let turn = 0; (await s.engine.sync()).kvBlocksUsed > 0; turn++) {
    if (turn > 300) assert.fail(`${s.server.workerId} still holds ${(await s.engine.sync()).kvBlocksUsed} blocks`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

function prompt(group: number, length: number): number[] {
  return Array.from({ length }, (_, i) => 10 + ((Math.imul(group + 1, 0x9e3779b1) ^ Math.imul(i + 1, 0x85ebca6b)) >>> 0) % 250);
}

interface Served { engine: LocalEngine; server: WorkerServer; address: string }

interface BuildOptions {
  faults?: { corruptRun?: number; stallAfterRuns?: number };
  /** Both workers' --kv-transfer-link. */
  kvLink?: 'auto' | 'tcp';
  /** The prefill worker's token budget per step: a longer prompt prefills in chunks of this. */
  prefillChunk?: number;
  decodeWorkers?: number;
  migrationLimit?: number;
  /** false: the frontend does not tell the decode worker ahead (no stream during the prefill): the adopt pulls. */
  stream?: boolean;
  /** The decode workers take KV through their staging pool and copy it from there (CONDUIT_KV_ADOPT_STAGING=1). */
  staging?: boolean;
  /** The frontend reaches the prefill worker's request plane through a relay set so. */
  prefillRelay?: TcpRelayOptions;
  /** The policy's estimates (default: fixed, transfers always the faster way). */
  estimates?: { transferBytesPerSec: number; prefillTokensPerSec: number; fixed?: boolean };
}

async function serve(id: string, role: 'prefill' | 'decode', path: string, options: BuildOptions = {}): Promise<Served> {
  const engine = await LocalEngine.start({
    modelPath: path, kvCacheMemoryBytes: 2 << 20, threads: 1, blockSize: BLOCK, enableKvEvents: true, role,
    ...(role === 'prefill' && options.prefillChunk ? { maxNumBatchedTokens: options.prefillChunk } : {}),
  });
  // The server reads the switch when it is made.
  if (options.staging) process.env.CONDUIT_KV_ADOPT_STAGING = '1';
  let server: WorkerServer;
  try {
    server = new WorkerServer({
      workerId: id, engine, role, clusterToken: TOKEN, ...(options.faults ? { kvFaults: options.faults } : {}),
      ...(options.kvLink ? { kvLink: options.kvLink } : {}),
    });
  } finally {
    if (options.staging) delete process.env.CONDUIT_KV_ADOPT_STAGING;
  }
  assert.equal(server.adoptsInPlace, role === 'decode' && !options.staging);
  const port = await server.listen(0, '127.0.0.1');
  return { engine, server, address: `127.0.0.1:${port}` };
}

/** The link two workers on this host use when neither is set to tcp. */
const SAME_HOST_LINK = kvHostId() !== null ? 'shm' : 'tcp';

/** The trace a gateway builds for one completion from the engine's outputs (the CallTrace the server uses). */
function traceOf(outputs: EngineOutput[], promptTokens: number): RequestTrace {
  const telemetry = new Telemetry({ tracing: false });
  const call = new CallTrace(telemetry, 'call', outputs[0]!.timestamps.arrival, '/v1/completions', engineNow, undefined);
  call.bodyRead(100);
  call.validated({ ok: true });
  call.tokenized(promptTokens);
  call.attachRun({ promptTokens, completionTokens: tokens(outputs).length, cachedPromptTokens: 0 }, BLOCK, 'd');
  for (const output of outputs) call.output(output);
  call.end({ clientGone: false, bodyIncomplete: false });
  return telemetry.trace('call')!;
}

describe('disaggregated prefill/decode across worker servers (KV over TCP or shared memory)', () => {
  const model = cpuTestModel();
  let aggregated: LocalEngine;
  const served: Served[] = [];
  const remotes: RemoteEngine[] = [];
  const engines: DisaggregatedEngine[] = [];
  const relays: TcpRelay[] = [];

  async function build(options: BuildOptions = {}) {
    const prefill = await serve(`prefill-${served.length}`, 'prefill', model.path, options);
    const decodes: Served[] = [];
    for (let i = 0; i < (options.decodeWorkers ?? 1); i++) {
      decodes.push(await serve(`decode-${served.length + 1 + i}`, 'decode', model.path, {
        ...(options.kvLink ? { kvLink: options.kvLink } : {}), ...(options.staging ? { staging: true } : {}),
      }));
    }
    served.push(prefill, ...decodes);
    const connect = async (s: Served, through?: TcpRelayOptions) => {
      let address = s.address;
      if (through) {
        const relay = await startTcpRelay(Number(s.address.split(':')[1]), through);
        relays.push(relay);
        address = relay.address;
      }
      const remote = await RemoteEngine.connect(address, { clusterToken: TOKEN, events: true });
      remotes.push(remote);
      return remote;
    };
    const decodeRemotes: RemoteEngine[] = [];
    for (const d of decodes) {
      const remote = await connect(d);
      if (options.stream === false) (remote as { expectHandoff?: unknown }).expectHandoff = undefined;
      decodeRemotes.push(remote);
    }
    const engine = remoteDisaggregatedEngine({
      prefill: [await connect(prefill, options.prefillRelay)], decode: decodeRemotes, routerSeed: 3,
      policy: { minRemotePrefillTokens: 32 },
      estimates: options.estimates ?? { transferBytesPerSec: 1e12, prefillTokensPerSec: 1e3, fixed: true },
      ...(options.migrationLimit !== undefined ? { migration: { limit: options.migrationLimit } } : {}),
    });
    engines.push(engine);
    return { engine, prefill, decode: decodes[0]!, decodes, prefillRemote: remotes.at(-1)!, decodeRemotes };
  }

  /** Nothing of the request is left anywhere: no flight, no pull, no staging block, no block on either worker. */
  async function assertClean(engine: DisaggregatedEngine, id: string, workers: Served[]): Promise<void> {
    assert.equal(engine.requestStage(id), undefined, 'the request has left the disaggregated engine');
    for (const s of workers) {
      assert.equal(s.server.pullsInFlight, 0, `${s.server.workerId}: no pull in flight`);
      assert.equal(s.server.inFlight, 0, `${s.server.workerId}: no request running`);
      await assertFree(s);
      assert.equal(s.server.stagingBlocksHeld, 0, `${s.server.workerId}: no staging block held`);
      assert.equal(s.server.importsPrepared, 0, `${s.server.workerId}: no held prefix or reserved block left for an adoption`);
      const stats = await s.engine.sync();
      assert.equal(stats.numRunning + stats.numWaiting, 0, `${s.server.workerId}: no request queued or running`);
    }
    // The frontend's view follows the workers' stats (on their outputs and heartbeats).
    await until('no request is queued or running in the frontend\'s view', () => engine.stats().numRunning + engine.stats().numWaiting === 0);
  }

  /** Starts a request and reads it in the background; resolves with its outputs once it ends (also when aborted). */
  function start(engine: DisaggregatedEngine, req: EngineRequest): { outputs: EngineOutput[]; done: Promise<EngineOutput[]> } {
    const outputs: EngineOutput[] = [];
    const done = (async () => {
      for await (const output of engine.generate(req)) outputs.push(output);
      return outputs;
    })();
    return { outputs, done };
  }

  async function until(what: string, condition: () => boolean): Promise<void> {
    for (let turn = 0; !condition(); turn++) {
      if (turn > 1000) assert.fail(`timed out waiting until ${what}`);
      await new Promise((resolve) => setTimeout(resolve, 5));
    }
  }

  before(async () => {
    aggregated = await LocalEngine.start({ modelPath: model.path, kvCacheMemoryBytes: 2 << 20, threads: 1, blockSize: BLOCK });
  });
  after(async () => {
    for (const engine of engines) await engine.close();
    for (const relay of relays) await relay.close();
    for (const s of served) {
      await s.server.close();
      await s.engine.close();
    }
    await aggregated.close();
  });

  for (const [kvLink, staging] of [['auto', false], ['tcp', false], ['tcp', true]] as const) {
    const link = kvLink === 'tcp' ? 'tcp' : SAME_HOST_LINK;
    const into = staging ? ', adopted from staging' : ', written into the decode engine\'s own blocks';
    test(`greedy output equals an aggregated worker's, the KV over ${link}${kvLink === 'tcp' ? ' (forced)' : ' (chosen: one host)'}${into} (${model.name})`, async () => {
      const { engine, prefill, decode } = await build({ kvLink, staging });
      for (const length of [40, 75, 130]) {
        const ids = prompt(length, length);
        const expected = await collect(aggregated.generate(request(ids)));
        const outputs = await collect(engine.generate(request(ids)));
        assert.deepEqual(tokens(outputs), tokens(expected), `prompt of ${length}`);
        assert.equal(text(outputs), text(expected));
        assert.equal(outputs.at(-1)!.routing?.disaggregation?.mode, 'disaggregated', outputs.at(-1)!.routing?.disaggregation?.detail);
        // The output that reports the transfer names its link.
        const reported = outputs.find((o) => o.timestamps.kvTransfer)?.timestamps.kvTransfer;
        assert.equal(reported?.link, link);
      }
      assert.equal(decode.server.kvTransfers.get('ok'), 3);
      const last = engine.channel.log.recent().at(-1)!;
      assert.equal(last.channel, link);
      assert.equal(last.blocks, Math.ceil(130 / BLOCK));
      assert.ok(last.bytes > 0);
      // Every pin released on the prefill worker, every block free on both.
      for (const s of [prefill, decode]) await assertFree(s);
    });
  }

  test('a prompt prefilled in chunks streams its blocks while the next chunk computes: same greedy text, overlap reported', async () => {
    const chunked = await LocalEngine.start({ modelPath: model.path, kvCacheMemoryBytes: 2 << 20, threads: 1, blockSize: BLOCK, maxNumBatchedTokens: 32 });
    try {
      const { engine, prefill, decode } = await build({ prefillChunk: 32 });
      // The prompt starts once the decode worker's stream is open (it prepares its blocks first, a round trip to its
      // engine): the tiny model's whole prefill could otherwise end before, and nothing would go early.
      const prefillOf = prefill.engine.prefill.bind(prefill.engine);
      prefill.engine.prefill = (r) => (async function* () {
        await until('the decode worker has opened its stream', () => decode.server.streamsOpen === 1);
        yield* prefillOf(r);
      })();
      const ids = prompt(11, 200);
      const expected = await collect(chunked.generate(request(ids)));
      const outputs = await collect(engine.generate(request(ids)));
      assert.deepEqual(tokens(outputs), tokens(expected));
      assert.equal(outputs.at(-1)!.routing?.disaggregation?.mode, 'disaggregated', outputs.at(-1)!.routing?.disaggregation?.detail);
      // The prompt's first token came after 7 chunks: blocks of the first six went before the handoff.
      assert.ok(expected[0]!.timestamps.prefillChunks.length > 1, 'the reference prefilled in chunks');
      const last = engine.channel.log.recent().at(-1)!;
      assert.equal(last.blocks, Math.ceil(200 / BLOCK));
      assert.ok((last.overlapMs ?? 0) > 0, `busy time hidden behind the prefill: ${last.overlapMs} ms`);
      assert.ok((last.hiddenShare ?? 0) > 0 && (last.hiddenShare ?? 0) <= 1);
      const reported = outputs.find((o) => o.timestamps.kvTransfer)?.timestamps.kvTransfer;
      assert.ok((reported?.overlapMs ?? 0) > 0);
      assert.equal(decode.server.kvTransfers.get('ok'), 1);
      for (const s of [prefill, decode]) await assertFree(s);
    } finally {
      await chunked.close();
    }
  });

  test('the transfer estimate learns from a streamed transfer\'s bytes over all of its link time, the part hidden behind the prefill too', async () => {
    const prior = 1e12;
    const { engine, prefill, decode } = await build({ prefillChunk: 32, estimates: { transferBytesPerSec: prior, prefillTokensPerSec: 1e3 } });
    const prefillOf = prefill.engine.prefill.bind(prefill.engine);
    prefill.engine.prefill = (r) => (async function* () {
      await until('the decode worker has opened its stream', () => decode.server.streamsOpen === 1);
      yield* prefillOf(r);
    })();
    const outputs = await collect(engine.generate(request(prompt(12, 200))));
    assert.equal(outputs.at(-1)!.routing?.disaggregation?.mode, 'disaggregated', outputs.at(-1)!.routing?.disaggregation?.detail);
    const transfer = engine.channel.log.recent().at(-1)!;
    assert.ok((transfer.overlapMs ?? 0) > 0, `busy time hidden behind the prefill: ${transfer.overlapMs} ms`);
    // One observation moves the estimate a fifth of the way (RateEstimate's weight) to the link's measured rate.
    const linkBytesPerSec = (transfer.bytes / (transfer.ms + transfer.overlapMs!)) * 1000;
    const expected = prior + 0.2 * (linkBytesPerSec - prior);
    const learned = engine.estimates().transferBytesPerSec;
    assert.ok(Math.abs(learned - expected) <= 1e-9 * expected, `learned ${learned} B/s, expected ${expected} B/s`);
    for (const s of [prefill, decode]) await assertFree(s);
  });

  test('a corrupted transfer is detected and the decode worker prefills itself: same greedy text, a failed kv_transfer in the trace', async () => {
    const { engine, prefill, decode } = await build({ faults: { corruptRun: 1 } });
    const ids = prompt(7, 90);
    const expected = await collect(aggregated.generate(request(ids)));
    const outputs = await collect(engine.generate(request(ids)));
    assert.deepEqual(tokens(outputs), tokens(expected));
    assert.equal(decode.server.kvTransfers.get('checksum'), 1);
    assert.equal(outputs.at(-1)!.routing?.disaggregation?.reason, 'transfer-failed');
    assert.equal(engine.decisionCounts().fallbacks, 1);
    // The trace a gateway builds from these outputs: the routing said remote prefill, and the transfer failed.
    const trace = traceOf(outputs, ids.length);
    const lookup = trace.phases.find((p) => p.phase === 'router_lookup')!;
    assert.match(String(lookup.attributes?.reason), /prefill disaggregated/);
    const transfers = trace.phases.filter((p) => p.phase === 'kv_transfer');
    assert.equal(transfers.length, 1);
    assert.equal(transfers[0]!.attributes?.ok, false);
    assert.match(String(transfers[0]!.attributes?.failed), /checksum/);
    assert.equal(trace.kvTransfer, undefined, 'no bytes moved: no transfer summary (nor its metrics)');
    // The prefill ran on the prefill worker and the request was handed over, though its KV did not arrive: the
    // decode worker's own recompute is its prefill, not decode steps.
    const prefillWorker = outputs[0]!.routing!.disaggregation!.prefillWorkerId!;
    const decodeWorker = outputs.at(-1)!.routing!.workerId;
    const on = (phase: string) => trace.phases.filter((p) => p.phase === phase).map((p) => p.worker);
    assert.equal(on('prefill_execution')[0], prefillWorker, JSON.stringify(trace.phases.map((p) => [p.phase, p.worker])));
    assert.equal(on('scheduler_queue')[0], prefillWorker);
    assert.equal(on('decode_dispatch').length, 1, 'the hand-over is a phase');
    assert.ok(on('prefill_execution').includes(decodeWorker), 'the decode worker\'s recompute is a prefill on it');
    const recomputeEnd = Math.max(...trace.phases.filter((p) => p.phase === 'prefill_execution' && p.worker === decodeWorker).map((p) => p.endMs));
    assert.ok(trace.phases.find((p) => p.phase === 'decode_execution')!.startMs >= recomputeEnd, 'decode begins after the recompute');
    await assertClean(engine, outputs[0]!.requestId, [prefill, decode]);
  });

  test('a run corrupted while streaming, before the handoff, is detected too: the decode worker prefills itself', async () => {
    const { engine, prefill, decode } = await build({ faults: { corruptRun: 1 }, prefillChunk: 32 });
    const ids = prompt(12, 200);
    const expected = await collect(aggregated.generate(request(ids)));
    const outputs = await collect(engine.generate(request(ids)));
    assert.deepEqual(tokens(outputs), tokens(expected));
    assert.equal(decode.server.kvTransfers.get('checksum'), 1);
    assert.equal(outputs.at(-1)!.routing?.disaggregation?.reason, 'transfer-failed');
    await assertClean(engine, outputs[0]!.requestId, [prefill, decode]);
  });

  test('a prefill worker gone: the decode worker prefills the request itself, same greedy text', async () => {
    const { engine, prefill, decode } = await build();
    await prefill.server.close();
    // Bounded wait for the frontend side to notice the closed connection.
    for (let turn = 0; engine.prefillWorkerIds.length > 0; turn++) {
      if (turn > 500) assert.fail('the lost prefill worker never left');
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
    const ids = prompt(8, 90);
    const expected = await collect(aggregated.generate(request(ids)));
    const outputs = await collect(engine.generate(request(ids)));
    assert.deepEqual(tokens(outputs), tokens(expected));
    assert.equal(outputs.at(-1)!.routing?.disaggregation?.mode, 'local');
    await assertClean(engine, outputs[0]!.requestId, [decode]);
  });
  test('a prefill worker\'s KV port can be pinned (--kv-port): frontends are told that one', async () => {
    const kvPort = await freePort();
    const engine = await LocalEngine.start({ modelPath: model.path, kvCacheMemoryBytes: 1 << 20, threads: 1, blockSize: BLOCK, role: 'prefill' });
    const server = new WorkerServer({ workerId: 'pinned-port', engine, role: 'prefill', clusterToken: TOKEN, kvPort });
    try {
      const port = await server.listen(0, '127.0.0.1');
      const remote = await RemoteEngine.connect(`127.0.0.1:${port}`, { clusterToken: TOKEN });
      assert.equal(remote.kvPort, kvPort);
      await remote.close();
    } finally {
      await server.close();
      await engine.close();
    }
  });

  for (const stream of [false, true]) {
    test(`the frontend stops reading a prefill at its handoff, before the worker's end arrives (${stream ? 'KV streamed during the prefill' : 'KV pulled at the adopt'}): no abort unpins the blocks, the KV moves`, async () => {
      const { engine, prefill, decode } = await build({ stream, prefillRelay: { pauseAfterWorkerFrame: { type: 'handoff', ms: 150 } } });
      const ids = prompt(23, 75);
      const expected = await collect(aggregated.generate(request(ids)));
      const outputs = await collect(engine.generate(request(ids)));
      assert.deepEqual(tokens(outputs), tokens(expected));
      const disaggregation = outputs.at(-1)!.routing?.disaggregation;
      assert.equal(disaggregation?.mode, 'disaggregated', disaggregation?.detail);
      assert.deepEqual([...decode.server.kvTransfers], [['ok', 1]]);
      assert.ok(outputs.some((o) => (o.timestamps.kvTransfer?.blocks ?? 0) > 0), 'the output reports the blocks moved');
      for (const s of [prefill, decode]) await assertFree(s);
    });
  }

  test('a decode worker that drains after the routing and before the hand-over: another decode worker takes the handoff, same greedy text', async () => {
    const { engine, prefill, decodes } = await build({ decodeWorkers: 2 });
    // The prompt waits until the chosen decode worker has opened its stream (expectHandoff), and that worker drains.
    const prefillOf = prefill.engine.prefill.bind(prefill.engine);
    let drained: Served | undefined;
    prefill.engine.prefill = (r) => (async function* () {
      await until('the chosen decode worker has opened its stream', () => decodes.some((d) => d.server.streamsOpen === 1));
      drained = decodes.find((d) => d.server.streamsOpen === 1)!;
      await drained.server.drain(10_000);
      yield* prefillOf(r);
    })();
    try {
      const ids = prompt(29, 75);
      const expected = await collect(aggregated.generate(request(ids)));
      const outputs = await collect(engine.generate(request(ids)));
      assert.deepEqual(tokens(outputs), tokens(expected));
      const taker = decodes.find((d) => d !== drained)!;
      const disaggregation = outputs.at(-1)!.routing?.disaggregation;
      assert.equal(disaggregation?.mode, 'disaggregated', disaggregation?.detail);
      assert.equal(disaggregation?.decodeWorkerId, taker.server.workerId);
      assert.deepEqual([...taker.server.kvTransfers], [['ok', 1]], 'the other decode worker pulled the KV');
      assert.deepEqual([...drained!.server.kvTransfers], []);
      assert.equal(drained!.server.streamsOpen, 0, 'the drained worker\'s stream for it stopped');
      for (const s of [prefill, ...decodes]) await assertFree(s);
    } finally {
      prefill.engine.prefill = prefillOf;
    }
  });

  test('a prefill worker that drains after a hand-over keeps the blocks until the decode worker has them: the KV moves, nothing is computed again', async () => {
    const { engine, prefill, decode, prefillRemote } = await build({ kvLink: 'tcp' });
    // The frontend learns of the drain as the handoff reaches it: the worker has left the router by the time the
    // decode worker is told where the blocks are.
    const prefillOf = prefillRemote.prefill.bind(prefillRemote);
    let drain: Promise<void> | undefined;
    prefillRemote.prefill = (r) => (async function* () {
      for await (const event of prefillOf(r)) {
        if (event.type === 'handoff') {
          drain = prefill.server.drain(10_000);
          await until('the frontend knows the prefill worker drains', () => prefillRemote.draining);
        }
        yield event;
      }
    })();
    const ids = prompt(31, 75);
    const expected = await collect(aggregated.generate(request(ids)));
    const outputs = await collect(engine.generate(request(ids)));
    assert.deepEqual(tokens(outputs), tokens(expected));
    const disaggregation = outputs.at(-1)!.routing?.disaggregation;
    assert.equal(disaggregation?.mode, 'disaggregated', disaggregation?.detail);
    assert.deepEqual([...decode.server.kvTransfers], [['ok', 1]], 'pulled from the draining prefill worker');
    assert.ok(drain, 'the prefill worker drained');
    await drain;
    for (const s of [prefill, decode]) await assertFree(s);
  });

  test('a prefill worker that drains between the routing and its prefill refuses the prompt: the decode worker prefills it (prefill-failed), no migration', async () => {
    const { engine, prefill, decode, prefillRemote } = await build();
    // The frontend knows of the drain (the worker has left the router) only after the policy chose the worker: its
    // prefill frame reaches a worker that refuses it, which is no loss.
    const prefillOf = prefillRemote.prefill.bind(prefillRemote);
    let drain: Promise<void> | undefined;
    prefillRemote.prefill = (r) => (async function* () {
      drain = prefill.server.drain(10_000);
      await until('the frontend knows the prefill worker drains', () => prefillRemote.draining && engine.prefillWorkerIds.length === 0);
      yield* prefillOf(r);
    })();
    const ids = prompt(32, 75);
    const expected = await collect(aggregated.generate(request(ids)));
    const outputs = await collect(engine.generate(request(ids)));
    assert.deepEqual(tokens(outputs), tokens(expected));
    const routing = outputs.at(-1)!.routing!;
    assert.equal(routing.disaggregation?.reason, 'prefill-failed', routing.disaggregation?.detail);
    assert.match(routing.disaggregation?.detail ?? '', /is draining/);
    assert.equal(routing.migrations, undefined, 'a refusal is not a lost worker');
    assert.equal(engine.stats().requestMigrations, 0);
    assert.equal(engine.decisionCounts().fallbacks, 1);
    assert.ok(drain, 'the prefill worker drained');
    await drain;
    await assertClean(engine, outputs[0]!.requestId, [prefill, decode]);
  });

  test('a prefill worker whose drain grace runs out under the prompt: a lost worker, the request is prefilled again (prefill-worker-lost)', async () => {
    const { engine, prefill, decode, prefillRemote } = await build();
    // The worker took the prompt, then drains with no grace: the prompt is cut (an EngineClosedError frame).
    const server = prefill.server as unknown as { cut: Set<string> };
    const prefillOf = prefill.engine.prefill.bind(prefill.engine);
    prefill.engine.prefill = (r) => (async function* () {
      void prefill.server.drain(1);
      await until('the drain\'s grace ran out on the prompt', () => server.cut.has(r.id) && prefillRemote.draining);
      yield* prefillOf(r);
    })();
    try {
      const ids = prompt(34, 75);
      const expected = await collect(aggregated.generate(request(ids)));
      const outputs = await collect(engine.generate(request(ids)));
      assert.deepEqual(tokens(outputs), tokens(expected));
      const routing = outputs.at(-1)!.routing!;
      assert.deepEqual(routing.migrations?.map((m) => m.reason), [PREFILL_WORKER_LOST], JSON.stringify(routing));
      assert.equal(routing.disaggregation?.reason, 'prefill-failed');
      assert.equal(engine.stats().requestMigrations, 1);
      await assertClean(engine, outputs[0]!.requestId, [decode]);
    } finally {
      prefill.engine.prefill = prefillOf;
    }
  });

  for (const stream of [true, false]) {
    const how = stream ? 'streamed during the prefill' : 'pulled after the handoff';
    test(`KV that arrives but that the decode engine cannot import (${how}): one import failure, counted alike by the worker and its link stats`, async () => {
      const { engine, prefill, decode } = await build({ stream });
      // The engine refuses the blocks at its own check (as for a pool of another KV dtype), after the transfer ended.
      const adoptOf = decode.engine.adopt.bind(decode.engine);
      const other = decode.engine.kvLayout!.dtype === 'f32' ? 'f16' : 'f32';
      decode.engine.adopt = (handoff, sourceId) => adoptOf({ ...handoff, sourceLayout: { ...handoff.sourceLayout, dtype: other } }, sourceId);
      try {
        const ids = prompt(33, 75);
        const expected = await collect(aggregated.generate(request(ids)));
        const outputs = await collect(engine.generate(request(ids)));
        assert.deepEqual(tokens(outputs), tokens(expected));
        const disaggregation = outputs.at(-1)!.routing!.disaggregation!;
        assert.equal(disaggregation.reason, 'transfer-failed', disaggregation.detail);
        assert.match(disaggregation.detail, /differ in dtype/);
        assert.deepEqual([...decode.server.kvTransfers], [['import', 1]]);
        assert.deepEqual(decode.server.stats().kvTransferLinks, { [SAME_HOST_LINK]: { failures: { import: 1 }, fallbacks: 1 } });
        await assertClean(engine, outputs[0]!.requestId, [prefill, decode]);
      } finally {
        decode.engine.adopt = adoptOf;
      }
    });
  }

  test('a frontend gone after the hand-over, before it released the handoff: the prefill worker frees the pinned blocks', async () => {
    const prefill = await serve(`prefill-${served.length}`, 'prefill', model.path);
    served.push(prefill);
    const frontend = await RemoteEngine.connect(prefill.address, { clusterToken: TOKEN });
    let handoff: KvHandoff | undefined;
    for await (const event of frontend.prefill(request(prompt(9, 90)))) if (event.type === 'handoff') handoff = event.handoff;
    assert.ok(handoff && handoff.sourceBlockIds.length > 0, 'a handoff with pinned blocks');
    assert.ok((await prefill.engine.sync()).kvBlocksUsed > 0, 'the handed-off blocks stay pinned until released');
    await frontend.close();
    await assertFree(prefill);
  });

  test('blocks the decode worker holds in its prefix cache are not pulled: only the rest moves, same greedy text', async () => {
    // Pulled after the handoff (a stream started during the prefill moves every block; see the test after this one).
    const { engine, prefill, decode } = await build({ stream: false });
    const shared = prompt(11, 4 * BLOCK);
    const first = [...shared, ...prompt(12, 40)];
    const second = [...shared, ...prompt(13, 70)];
    // The first leaves its full blocks in the decode worker's prefix cache (an imported prompt is cached as a computed one).
    assert.deepEqual(tokens(await collect(engine.generate(request(first)))), tokens(await collect(aggregated.generate(request(first)))));
    const expected = await collect(aggregated.generate(request(second)));
    const outputs = await collect(engine.generate(request(second)));
    assert.deepEqual(tokens(outputs), tokens(expected));
    assert.equal(text(outputs), text(expected));
    assert.equal(outputs.at(-1)!.routing?.disaggregation?.mode, 'disaggregated', outputs.at(-1)!.routing?.disaggregation?.detail);
    const transfer = engine.channel.log.recent().at(-1)!;
    const blocks = Math.ceil(second.length / BLOCK);
    assert.equal(transfer.channel, SAME_HOST_LINK);
    assert.equal(transfer.reusedBlocks, 4, 'the 4 shared blocks stayed on the decode worker');
    assert.equal(transfer.blocks, blocks - 4, 'only the blocks the decode worker lacked were pulled');
    assert.equal(transfer.bytes, (blocks - 4) * kvBlockBytes(decode.engine.kvLayout!));
    // The output's kv_transfer (what traces, timings and metrics show) says the same, and the link.
    const kv = outputs.at(-1)!.timestamps.kvTransfer!;
    assert.deepEqual({ blocks: kv.blocks, bytes: kv.bytes, link: kv.link }, { blocks: blocks - 4, bytes: transfer.bytes, link: SAME_HOST_LINK });
    await assertClean(engine, outputs[0]!.requestId, [prefill, decode]);
  });

  for (const staging of [false, true]) {
  test(`with prefix hits on the decode side and a stream during the prefill: only the blocks it lacks are streamed, same greedy text${staging ? ' (staging)' : ''}`, async () => {
    const { engine, prefill, decode } = await build({ staging });
    const shared = prompt(14, 4 * BLOCK);
    const first = [...shared, ...prompt(15, 40)];
    const second = [...shared, ...prompt(16, 70)];
    assert.deepEqual(tokens(await collect(engine.generate(request(first)))), tokens(await collect(aggregated.generate(request(first)))));
    const expected = await collect(aggregated.generate(request(second)));
    const outputs = await collect(engine.generate(request(second)));
    assert.deepEqual(tokens(outputs), tokens(expected));
    assert.equal(text(outputs), text(expected));
    assert.equal(outputs.at(-1)!.routing?.disaggregation?.mode, 'disaggregated', outputs.at(-1)!.routing?.disaggregation?.detail);
    const transfer = engine.channel.log.recent().at(-1)!;
    const blocks = Math.ceil(second.length / BLOCK);
    // The frontend sent the prompt's block hashes with expect: the decode worker held its 4 cached blocks, the stream
    // named only the others.
    assert.equal(transfer.reusedBlocks, 4, 'the 4 shared blocks stayed on the decode worker');
    assert.equal(transfer.blocks, blocks - 4);
    assert.equal(transfer.bytes, (blocks - 4) * kvBlockBytes(decode.engine.kvLayout!), 'the stream moved only the missing blocks');
    assert.equal(decode.server.streamsAdopted, 2, 'both came by streams started at expect');
    await assertClean(engine, outputs[0]!.requestId, [prefill, decode]);
  });
  }

  test('blocks cached on the decode worker after expect was sent are not streamed: its cache is checked when the destinations are allocated', async () => {
    const { engine, prefill, decode } = await build();
    const shared = prompt(17, 4 * BLOCK);
    const first = [...shared, ...prompt(18, 40)];
    const second = [...shared, ...prompt(19, 70)];
    const expected = await collect(aggregated.generate(request(second)));
    // The prefill waits until the decode worker has opened its stream (so the KV comes by the stream, not a pull).
    const prefillOf = prefill.engine.prefill.bind(prefill.engine);
    let letPrefill!: () => void;
    const prefillGate = new Promise<void>((resolve) => { letPrefill = resolve; });
    prefill.engine.prefill = (r) => (async function* () {
      await prefillGate;
      yield* prefillOf(r);
    })();
    // The expect reaches the decode worker only after its prefix cache got the shared blocks (from a request run on
    // its engine directly, which the frontend knew nothing of when it sent expect).
    const server = decode.server as unknown as { expect(connection: unknown, message: unknown): void; incoming: Map<string, { ready: Promise<void> }> };
    const expectOf = server.expect.bind(server);
    let held: (() => void) | undefined;
    server.expect = (connection, message) => { held = () => expectOf(connection, message); };
    try {
      const req = request(second);
      const run = start(engine, req);
      await until('the frontend sent expect', () => held !== undefined);
      assert.equal(server.incoming.size, 0, 'no stream opened yet');
      await collect(decode.engine.generate(request(first)));
      held!();
      await server.incoming.get(req.id)?.ready;
      letPrefill();
      const outputs = await run.done;
      assert.deepEqual(tokens(outputs), tokens(expected));
      assert.equal(text(outputs), text(expected));
      const transfer = engine.channel.log.recent().at(-1)!;
      const blocks = Math.ceil(second.length / BLOCK);
      assert.equal(decode.server.streamsAdopted, 1, 'the KV came by the stream opened at expect');
      assert.equal(transfer.reusedBlocks, 4, 'the 4 blocks cached after expect was sent stayed on the decode worker');
      assert.equal(transfer.blocks, blocks - 4);
      assert.equal(transfer.bytes, (blocks - 4) * kvBlockBytes(decode.engine.kvLayout!), 'the stream moved only the blocks missing then');
      await assertClean(engine, req.id, [prefill, decode]);
    } finally {
      server.expect = expectOf;
      letPrefill();
      prefill.engine.prefill = prefillOf;
    }
  });

  test('two requests with the same leading blocks at once: the second\'s stream waits for the first\'s blocks and moves only the rest', async () => {
    const { engine, prefill, decode } = await build();
    const shared = prompt(26, 4 * BLOCK);
    const reqA = request([...shared, ...prompt(27, 40)]);
    const reqB = request([...shared, ...prompt(28, 70)]);
    const expectedA = await collect(aggregated.generate(request([...reqA.promptTokenIds])));
    const expectedB = await collect(aggregated.generate(request([...reqB.promptTokenIds])));
    const deferredBefore = decode.server.streamsDeferred;
    const [outA, outB] = await Promise.all([collect(engine.generate(reqA)), collect(engine.generate(reqB))]);
    assert.deepEqual(tokens(outA), tokens(expectedA));
    assert.deepEqual(tokens(outB), tokens(expectedB));
    assert.equal(text(outB), text(expectedB));
    const log = engine.channel.log.recent();
    const a = log.find((t) => t.requestId === reqA.id)!;
    const b = log.find((t) => t.requestId === reqB.id)!;
    assert.equal(a.reusedBlocks, 0);
    assert.equal(a.blocks, Math.ceil(reqA.promptTokenIds.length / BLOCK));
    assert.equal(decode.server.streamsDeferred, deferredBefore + 1, 'the second expect waited for the first import');
    assert.equal(b.reusedBlocks, 4, 'the 4 shared blocks came once, with the first request');
    assert.equal(b.blocks, Math.ceil(reqB.promptTokenIds.length / BLOCK) - 4);
    assert.equal(b.bytes, b.blocks * kvBlockBytes(decode.engine.kvLayout!));
    await assertClean(engine, reqA.id, [prefill, decode]);
    await assertClean(engine, reqB.id, [prefill, decode]);
  });

  test('a request aborted while its stream waits for another import\'s blocks: nothing held, the other completes', async () => {
    const { engine, prefill, decode } = await build();
    const shared = prompt(29, 4 * BLOCK);
    const reqA = request([...shared, ...prompt(30, 40)]);
    const reqB = request([...shared, ...prompt(31, 70)], 8);
    const expectedA = await collect(aggregated.generate(request([...reqA.promptTokenIds])));
    const deferredBefore = decode.server.streamsDeferred;
    const runA = start(engine, reqA);
    const runB = start(engine, reqB);
    await until('the second expect waits for the first import', () => decode.server.streamsDeferred === deferredBefore + 1);
    engine.abort(reqB.id);
    assert.equal((await runB.done).at(-1)?.finishReason, 'abort');
    assert.deepEqual(tokens(await runA.done), tokens(expectedA));
    await assertClean(engine, reqB.id, [prefill, decode]);
    await assertClean(engine, reqA.id, [prefill, decode]);
  });

  test('abort while the prefill runs: nothing held on either worker, and the next request is served', async () => {
    // The prompt in chunks of 32 tokens (one step each), and the abort sent as soon as the prefill worker starts it.
    const { engine, prefill, decode } = await build({ prefillChunk: 32 });
    const req = request(prompt(20, 300), 8);
    const prefillOf = prefill.engine.prefill.bind(prefill.engine);
    let stage: string | undefined;
    prefill.engine.prefill = (r) => {
      const stream = prefillOf(r);
      stage = engine.requestStage(req.id);
      engine.abort(req.id);
      return stream;
    };
    const outputs = await start(engine, req).done;
    assert.equal(stage, 'prefill', 'aborted while the prefill worker runs the prompt');
    assert.equal(outputs.at(-1)?.finishReason, 'abort');
    await assertClean(engine, req.id, [prefill, decode]);
    const ids = prompt(21, 60);
    assert.deepEqual(tokens(await collect(engine.generate(request(ids)))), tokens(await collect(aggregated.generate(request(ids)))));
  });

  for (const stream of [true, false]) {
    const how = stream ? 'streamed during the prefill' : 'pulled after the handoff';
    test(`abort while the KV transfer (${how}) is in flight: it stops at once, nothing held, the next request is served`, async () => {
      const { engine, prefill, decode } = await build({ faults: { stallAfterRuns: 1 }, stream });
      const req = request(prompt(22, 90), 8);
      const run = start(engine, req);
      // The run may go (streamed) before the handoff reaches the decode worker: wait for both.
      await until('the prefill worker has sent the first run and stalls, the decode worker waits for the rest',
        () => prefill.server.kvRunsSent === 1 && decode.server.pullsInFlight === 1);
      assert.equal(engine.requestStage(req.id), 'transfer');
      engine.abort(req.id);
      const outputs = await run.done;
      assert.equal(outputs.at(-1)?.finishReason, 'abort');
      assert.equal(tokens(outputs).length, 1, 'only the first token (from the prefill worker) was streamed');
      await assertClean(engine, req.id, [prefill, decode]);
      assert.equal(decode.server.kvTransfers.get('aborted') ?? decode.server.kvTransfers.get('cancelled'), undefined, 'an abort is not a failed transfer');
      assert.equal(decode.server.stats().kvTransferLinks, undefined, 'nor a fallback');
    });
  }

  test('abort after the hand-over, while the decode worker streams: nothing held', async () => {
    const { engine, prefill, decode } = await build();
    // The model decodes its 400 tokens in tens of milliseconds: on a busy machine the decode worker can finish before
    // the abort reaches it. Such a run ends by length and must leave nothing held too; one of a few runs must abort.
    const finishes: (string | undefined)[] = [];
    for (let attempt = 0; attempt < 5 && !finishes.includes('abort'); attempt++) {
      const req = request(prompt(23 + 100 * attempt, 90), 400);
      const outputs: EngineOutput[] = [];
      for await (const output of engine.generate(req)) {
        outputs.push(output);
        if (outputs.length === 3) engine.abort(req.id);
      }
      const finish = outputs.at(-1)?.finishReason;
      finishes.push(finish);
      if (finish === 'abort') assert.ok(tokens(outputs).length < 400);
      else assert.equal(finish, 'length', 'a run the abort did not reach ran to its end');
      await assertClean(engine, req.id, [prefill, decode]);
    }
    assert.ok(finishes.includes('abort'), `an abort reached the decode worker in one of ${finishes.length} runs (${finishes.join(', ')})`);
  });

  for (const stream of [true, false]) {
    const how = stream ? 'streamed during the prefill' : 'pulled after the handoff';
    test(`the prefill worker gone mid-transfer (${how}): the decode worker prefills itself, same greedy text, counted by link and reason`, async () => {
      const { engine, prefill, decode } = await build({ faults: { stallAfterRuns: 1 }, stream });
      const ids = prompt(24, 90);
      const expected = await collect(aggregated.generate(request(ids)));
      const req = request(ids);
      const run = start(engine, req);
      // The run may go (streamed) before the handoff reaches the decode worker: wait for both.
      await until('the prefill worker has sent the first run and stalls, the decode worker waits for the rest',
        () => prefill.server.kvRunsSent === 1 && decode.server.pullsInFlight === 1);
      // As a killed process: every connection of the prefill worker drops (its KV port's too).
      await prefill.server.close();
      const outputs = await run.done;
      assert.deepEqual(tokens(outputs), tokens(expected));
      assert.equal(text(outputs), text(expected));
      assert.equal(decode.server.kvTransfers.get('truncated'), 1, JSON.stringify([...decode.server.kvTransfers]));
      assert.deepEqual(decode.server.stats().kvTransferLinks, { [SAME_HOST_LINK]: { failures: { truncated: 1 }, fallbacks: 1 } });
      // The prefill worker's engine is left as a killed process would leave it; the decode worker holds nothing.
      await assertClean(engine, req.id, [decode]);
    });
  }

  test('the decode worker lost mid-stream: the request moves to the other decode worker, same greedy text, nothing held', async () => {
    const { engine, prefill, decodes } = await build({ decodeWorkers: 2, migrationLimit: 1 });
    const ids = prompt(25, 90);
    const expected = await collect(aggregated.generate(request(ids, 300)));
    const req = request(ids, 300);
    const outputs: EngineOutput[] = [];
    let lost: Served | undefined;
    let closed: Promise<void> | undefined;
    for await (const output of engine.generate(req)) {
      outputs.push(output);
      if (outputs.length === 3) {
        // As a killed process: every connection of the decode worker drops.
        const lostId = engine.requestWorkers(req.id)!.decodeWorkerId!;
        lost = decodes.find((d) => d.server.workerId === lostId)!;
        closed = lost.server.close();
      }
    }
    await closed;
    assert.ok(lost, 'the decode worker was closed mid-stream');
    assert.equal(outputs.at(-1)!.routing?.migrations?.length, 1, JSON.stringify(outputs.at(-1)!.routing));
    assert.deepEqual(tokens(outputs), tokens(expected));
    assert.equal(text(outputs), text(expected));
    await assertClean(engine, req.id, [prefill, ...decodes.filter((d) => d !== lost)]);
    assert.equal(engine.stats().requestMigrations, 1);
    // The lost worker's engine (its process gone, in a real deployment) stopped the request when its connection closed.
    await assertFree(lost);
  });
});
