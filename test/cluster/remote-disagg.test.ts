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
import type { DisaggregatedEngine } from '../../src/runtime/disaggregated.ts';
import { cpuTestModel } from '../helpers/cpu-model.ts';
import { collect, text, tokens } from '../helpers/outputs.ts';
import { kvBlockBytes } from '../../src/engine/handoff.ts';

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

type Faults = { corruptRun?: number; stallAfterRuns?: number };

async function serve(id: string, role: 'prefill' | 'decode', path: string, faults?: Faults, maxNumBatchedTokens?: number): Promise<Served> {
  const engine = await LocalEngine.start({
    modelPath: path, kvCacheMemoryBytes: 2 << 20, threads: 1, blockSize: BLOCK, enableKvEvents: true, role,
    ...(maxNumBatchedTokens !== undefined ? { maxNumBatchedTokens } : {}),
  });
  const server = new WorkerServer({ workerId: id, engine, role, clusterToken: TOKEN, ...(faults ? { kvFaults: faults } : {}) });
  const port = await server.listen(0, '127.0.0.1');
  return { engine, server, address: `127.0.0.1:${port}` };
}

describe('disaggregated prefill/decode across worker servers (KV over TCP)', () => {
  const model = cpuTestModel();
  let aggregated: LocalEngine;
  const served: Served[] = [];
  const remotes: RemoteEngine[] = [];
  const engines: DisaggregatedEngine[] = [];

  async function build(faults?: Faults, options: { decodeWorkers?: number; migrationLimit?: number; prefillChunk?: number } = {}) {
    const prefill = await serve(`prefill-${served.length}`, 'prefill', model.path, faults, options.prefillChunk);
    const decodes: Served[] = [];
    for (let i = 0; i < (options.decodeWorkers ?? 1); i++) decodes.push(await serve(`decode-${served.length + 1 + i}`, 'decode', model.path));
    served.push(prefill, ...decodes);
    const connect = async (s: Served) => {
      const remote = await RemoteEngine.connect(s.address, { clusterToken: TOKEN, events: true });
      remotes.push(remote);
      return remote;
    };
    const decodeRemotes: RemoteEngine[] = [];
    for (const d of decodes) decodeRemotes.push(await connect(d));
    const engine = remoteDisaggregatedEngine({
      prefill: [await connect(prefill)], decode: decodeRemotes, routerSeed: 3,
      policy: { minRemotePrefillTokens: 32 },
      estimates: { transferBytesPerSec: 1e12, prefillTokensPerSec: 1e3, fixed: true },
      ...(options.migrationLimit !== undefined ? { migration: { limit: options.migrationLimit } } : {}),
    });
    engines.push(engine);
    return { engine, prefill, decode: decodes[0]!, decodes };
  }

  /** Nothing of the request is left anywhere: no flight, no pull, no staging block, no block on either worker. */
  async function assertClean(engine: DisaggregatedEngine, id: string, workers: Served[]): Promise<void> {
    assert.equal(engine.requestStage(id), undefined, 'the request has left the disaggregated engine');
    for (const s of workers) {
      assert.equal(s.server.pullsInFlight, 0, `${s.server.workerId}: no pull in flight`);
      assert.equal(s.server.inFlight, 0, `${s.server.workerId}: no request running`);
      await assertFree(s);
      assert.equal(s.server.stagingBlocksHeld, 0, `${s.server.workerId}: no staging block held`);
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
    for (const s of served) {
      await s.server.close();
      await s.engine.close();
    }
    await aggregated.close();
  });

  test(`greedy output equals an aggregated worker's, the KV pulled over TCP (${model.name})`, async () => {
    const { engine, prefill, decode } = await build();
    for (const length of [40, 75, 130]) {
      const ids = prompt(length, length);
      const expected = await collect(aggregated.generate(request(ids)));
      const outputs = await collect(engine.generate(request(ids)));
      assert.deepEqual(tokens(outputs), tokens(expected), `prompt of ${length}`);
      assert.equal(text(outputs), text(expected));
      assert.equal(outputs.at(-1)!.routing?.disaggregation?.mode, 'disaggregated', outputs.at(-1)!.routing?.disaggregation?.detail);
    }
    assert.equal(decode.server.kvTransfers.get('ok'), 3);
    const last = engine.channel.log.recent().at(-1)!;
    assert.equal(last.channel, 'tcp');
    assert.equal(last.blocks, Math.ceil(130 / BLOCK));
    assert.ok(last.bytes > 0);
    // Every pin released on the prefill worker, every block free on both.
    for (const s of [prefill, decode]) await assertFree(s);
  });

  test('a corrupted transfer is detected and the decode worker prefills itself: same greedy text', async () => {
    const { engine, prefill, decode } = await build({ corruptRun: 1 });
    const ids = prompt(7, 90);
    const expected = await collect(aggregated.generate(request(ids)));
    const outputs = await collect(engine.generate(request(ids)));
    assert.deepEqual(tokens(outputs), tokens(expected));
    assert.equal(decode.server.kvTransfers.get('checksum'), 1);
    assert.equal(outputs.at(-1)!.routing?.disaggregation?.reason, 'transfer-failed');
    assert.equal(engine.decisionCounts().fallbacks, 1);
    for (const s of [prefill, decode]) await assertFree(s);
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
    await assertFree(decode);
  });
  test('blocks the decode worker holds in its prefix cache are not pulled: only the rest moves, same greedy text', async () => {
    const { engine, prefill, decode } = await build();
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
    assert.equal(transfer.channel, 'tcp');
    assert.equal(transfer.reusedBlocks, 4, 'the 4 shared blocks stayed on the decode worker');
    assert.equal(transfer.blocks, blocks - 4, 'only the blocks the decode worker lacked were pulled');
    assert.equal(transfer.bytes, (blocks - 4) * kvBlockBytes(decode.engine.kvLayout!));
    // The output's kv_transfer (what traces, timings and metrics show) says the same, and the link.
    const kv = outputs.at(-1)!.timestamps.kvTransfer!;
    assert.deepEqual({ blocks: kv.blocks, bytes: kv.bytes, link: kv.link }, { blocks: blocks - 4, bytes: transfer.bytes, link: 'tcp' });
    await assertClean(engine, outputs[0]!.requestId, [prefill, decode]);
  });

  test('abort while the prefill runs: nothing held on either worker, and the next request is served', async () => {
    // The prompt in chunks of 32 tokens (one step each), and the abort sent as soon as the prefill worker starts it.
    const { engine, prefill, decode } = await build(undefined, { prefillChunk: 32 });
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

  test('abort while the KV pull is in flight: the pull stops at once, nothing held, the next request is served', async () => {
    const { engine, prefill, decode } = await build({ stallAfterRuns: 1 });
    const req = request(prompt(22, 90), 8);
    const run = start(engine, req);
    await until('the prefill worker has sent the first run and stalls', () => prefill.server.kvRunsSent === 1);
    assert.equal(decode.server.pullsInFlight, 1);
    assert.equal(engine.requestStage(req.id), 'transfer');
    engine.abort(req.id);
    const outputs = await run.done;
    assert.equal(outputs.at(-1)?.finishReason, 'abort');
    assert.equal(tokens(outputs).length, 1, 'only the first token (from the prefill worker) was streamed');
    await assertClean(engine, req.id, [prefill, decode]);
    assert.equal(decode.server.kvTransfers.get('aborted'), undefined, 'an abort is not a failed transfer');
    assert.equal(decode.server.stats().kvTransferLinks, undefined, 'nor a fallback');
  });

  test('abort after the hand-over, while the decode worker streams: nothing held', async () => {
    const { engine, prefill, decode } = await build();
    const req = request(prompt(23, 90), 400);
    const outputs: EngineOutput[] = [];
    for await (const output of engine.generate(req)) {
      outputs.push(output);
      if (outputs.length === 3) engine.abort(req.id);
    }
    assert.equal(outputs.at(-1)?.finishReason, 'abort');
    assert.ok(tokens(outputs).length < 400);
    await assertClean(engine, req.id, [prefill, decode]);
  });

  test('the prefill worker gone mid-transfer: the decode worker prefills itself, same greedy text, counted by link and reason', async () => {
    const { engine, prefill, decode } = await build({ stallAfterRuns: 1 });
    const ids = prompt(24, 90);
    const expected = await collect(aggregated.generate(request(ids)));
    const req = request(ids);
    const run = start(engine, req);
    await until('the prefill worker has sent the first run and stalls', () => prefill.server.kvRunsSent === 1);
    assert.equal(decode.server.pullsInFlight, 1);
    // As a killed process: every connection of the prefill worker drops (its KV port's too).
    await prefill.server.close();
    const outputs = await run.done;
    assert.deepEqual(tokens(outputs), tokens(expected));
    assert.equal(text(outputs), text(expected));
    assert.equal(decode.server.kvTransfers.get('truncated'), 1, JSON.stringify([...decode.server.kvTransfers]));
    assert.deepEqual(decode.server.stats().kvTransferLinks, { tcp: { failures: { truncated: 1 }, fallbacks: 1 } });
    // The prefill worker's engine is left as a killed process would leave it; the decode worker holds nothing.
    await assertClean(engine, req.id, [decode]);
  });

  test('the decode worker lost mid-stream: the request moves to the other decode worker, same greedy text, nothing held', async () => {
    const { engine, prefill, decodes } = await build(undefined, { decodeWorkers: 2, migrationLimit: 1 });
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
