// Disaggregated prefill/decode over the request plane: a prefill worker server and a decode worker server (each a
// real CPU engine), the KV of each prompt pulled by the decode worker straight from the prefill worker's KV port.
// Greedy output equals an aggregated worker's; a corrupted transfer and a lost prefill worker fall back to a
// prefill on the decode worker with the same greedy text.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { engineNow } from '../../src/engine/clock.ts';
import { LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { remoteDisaggregatedEngine } from '../../src/cluster/remote-disagg.ts';
import { WorkerServer } from '../../src/cluster/worker-server.ts';
import { kvHostId } from '../../src/cluster/kv-shm.ts';
import type { DisaggregatedEngine } from '../../src/runtime/disaggregated.ts';
import { cpuTestModel } from '../helpers/cpu-model.ts';
import { collect, text, tokens } from '../helpers/outputs.ts';

const TOKEN = 'disagg-token';
const BLOCK = 16;
let nextId = 0;

function request(promptTokenIds: number[]): EngineRequest {
  return {
    id: `rd${nextId++}`, promptTokenIds, priority: 0, arrivalMs: engineNow(),
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 10, ignoreEos: true, temperature: 0 },
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
  faults?: { corruptRun?: number };
  /** Both workers' --kv-transfer-link. */
  kvLink?: 'auto' | 'tcp';
  /** The prefill worker's token budget per step: a longer prompt prefills in chunks of this. */
  prefillChunk?: number;
}

async function serve(id: string, role: 'prefill' | 'decode', path: string, options: BuildOptions = {}): Promise<Served> {
  const engine = await LocalEngine.start({
    modelPath: path, kvCacheMemoryBytes: 2 << 20, threads: 1, blockSize: BLOCK, enableKvEvents: true, role,
    ...(role === 'prefill' && options.prefillChunk ? { maxNumBatchedTokens: options.prefillChunk } : {}),
  });
  const server = new WorkerServer({
    workerId: id, engine, role, clusterToken: TOKEN, ...(options.faults ? { kvFaults: options.faults } : {}),
    ...(options.kvLink ? { kvLink: options.kvLink } : {}),
  });
  const port = await server.listen(0, '127.0.0.1');
  return { engine, server, address: `127.0.0.1:${port}` };
}

/** The link two workers on this host use when neither is set to tcp. */
const SAME_HOST_LINK = kvHostId() !== null ? 'shm' : 'tcp';

describe('disaggregated prefill/decode across worker servers (KV over TCP or shared memory)', () => {
  const model = cpuTestModel();
  let aggregated: LocalEngine;
  const served: Served[] = [];
  const remotes: RemoteEngine[] = [];
  const engines: DisaggregatedEngine[] = [];

  async function build(options: BuildOptions = {}) {
    const prefill = await serve(`prefill-${served.length}`, 'prefill', model.path, options);
    const decode = await serve(`decode-${served.length + 1}`, 'decode', model.path, { ...(options.kvLink ? { kvLink: options.kvLink } : {}) });
    served.push(prefill, decode);
    const connect = async (s: Served) => {
      const remote = await RemoteEngine.connect(s.address, { clusterToken: TOKEN, events: true });
      remotes.push(remote);
      return remote;
    };
    const engine = remoteDisaggregatedEngine({
      prefill: [await connect(prefill)], decode: [await connect(decode)], routerSeed: 3,
      policy: { minRemotePrefillTokens: 32 },
      estimates: { transferBytesPerSec: 1e12, prefillTokensPerSec: 1e3, fixed: true },
    });
    engines.push(engine);
    return { engine, prefill, decode };
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

  for (const kvLink of ['auto', 'tcp'] as const) {
    const link = kvLink === 'tcp' ? 'tcp' : SAME_HOST_LINK;
    test(`greedy output equals an aggregated worker's, the KV over ${link}${kvLink === 'tcp' ? ' (forced)' : ' (chosen: one host)'} (${model.name})`, async () => {
      const { engine, prefill, decode } = await build({ kvLink });
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

  test('a corrupted transfer is detected and the decode worker prefills itself: same greedy text', async () => {
    const { engine, prefill, decode } = await build({ faults: { corruptRun: 1 } });
    const ids = prompt(7, 90);
    const expected = await collect(aggregated.generate(request(ids)));
    const outputs = await collect(engine.generate(request(ids)));
    assert.deepEqual(tokens(outputs), tokens(expected));
    assert.equal(decode.server.kvTransfers.get('checksum'), 1);
    assert.equal(outputs.at(-1)!.routing?.disaggregation?.reason, 'transfer-failed');
    assert.equal(engine.decisionCounts().fallbacks, 1);
    for (const s of [prefill, decode]) await assertFree(s);
  });

  test('a run corrupted while streaming, before the handoff, is detected too: the decode worker prefills itself', async () => {
    const { engine, prefill, decode } = await build({ faults: { corruptRun: 1 }, prefillChunk: 32 });
    const ids = prompt(12, 200);
    const expected = await collect(aggregated.generate(request(ids)));
    const outputs = await collect(engine.generate(request(ids)));
    assert.deepEqual(tokens(outputs), tokens(expected));
    assert.equal(decode.server.kvTransfers.get('checksum'), 1);
    assert.equal(outputs.at(-1)!.routing?.disaggregation?.reason, 'transfer-failed');
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
});
