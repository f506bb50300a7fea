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

async function serve(id: string, role: 'prefill' | 'decode', path: string, faults?: { corruptRun?: number }): Promise<Served> {
  const engine = await LocalEngine.start({ modelPath: path, kvCacheMemoryBytes: 2 << 20, threads: 1, blockSize: BLOCK, enableKvEvents: true, role });
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

  async function build(faults?: { corruptRun?: number }) {
    const prefill = await serve(`prefill-${served.length}`, 'prefill', model.path, faults);
    const decode = await serve(`decode-${served.length + 1}`, 'decode', model.path);
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
});
