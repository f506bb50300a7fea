// A worker's own LoRA adapters over the request plane (what `conduit worker` runs): lora-load registers with the
// worker's LoRA manager and answers with the content key, a request carrying the key runs with the adapter (loaded
// again after an eviction), and when every resident adapter (--max-loras) has a request in flight a load is refused
// as lora_capacity (LoraCapacityError on the frontend) while a request for another adapter waits for the slot (a
// base request behind it runs meanwhile; an abort ends the wait); an unknown key is lora_not_loaded. The worker
// serves on.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import { rmSync } from 'node:fs';
import { engineNow } from '../../src/engine/clock.ts';
import { createLocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { loadModel } from '../../src/model/loader.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../../src/model/lora-writer.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { WorkerServer } from '../../src/cluster/worker-server.ts';
import { LoraManager } from '../../src/runtime/lora-manager.ts';
import { collect, text, tokens } from '../helpers/outputs.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

const TOKEN = 'lora-worker-token';
let nextId = 0;
function request(lora: string | undefined, maxTokens = 16): EngineRequest {
  return {
    id: `lw${nextId++}`, promptTokenIds: Array.from({ length: 20 }, (_, i) => 300 + i * 41), priority: 0, arrivalMs: engineNow(),
    sampling: { ...DEFAULT_SAMPLING, maxTokens, ignoreEos: true, temperature: 0 }, ...(lora !== undefined ? { lora } : {}),
  };
}

describe('a worker\'s own LoRA adapters over the request plane', () => {
  let dir: string;
  let bundle: Awaited<ReturnType<typeof createLocalEngine>>;
  let server: WorkerServer;
  let remote: RemoteEngine;
  let changes = 0;
  let adapters: LoraManager;
  const paths: Record<string, string> = {};

  before(async () => {
    const fixture = writeWorkerLossFixture('lora-worker-server');
    dir = fixture.dir;
    const config = (await loadModel(fixture.modelPath)).config;
    for (const [name, seed] of [['a', 51], ['b', 52]] as const) {
      paths[name] = join(dir, `${name}.gguf`);
      writeGgufLoraAdapter(paths[name], config, randomLoraAdapter(config, { rank: 4, seed, bScale: 1 }));
    }
    bundle = await createLocalEngine({ modelPath: fixture.modelPath, threads: 1, enableKvEvents: true, kvCacheMemoryBytes: 8 * 1024 * 1024 });
    adapters = new LoraManager(bundle.engine, 1, undefined, 16);
    server = new WorkerServer({
      workerId: 'w-lora', engine: bundle.engine, clusterToken: TOKEN, tokenizer: bundle.tokenizer, chatTemplate: bundle.chatTemplate,
      adapters, onAdaptersChanged: () => { changes++; },
    });
    const port = await server.listen(0, '127.0.0.1');
    remote = await RemoteEngine.connect(`127.0.0.1:${port}`, { clusterToken: TOKEN });
  });

  after(async () => {
    await remote?.close();
    await server?.close();
    await bundle?.engine.close();
    rmSync(dir, { recursive: true, force: true });
  });

  test('load answers the content key; requests with it run the adapter; a busy --max-loras refuses a load and queues a request; unload', async () => {
    const a = await remote.registerLora('a', paths.a!);
    assert.equal(a.info.rank, 4);
    assert.match(a.key ?? '', /^a#[0-9a-f]{16}$/);
    const b = await remote.registerLora('b', paths.b!);  // --max-loras 1: 'a' is evicted (idle)
    assert.equal(changes, 2);
    const base = text(await collect(remote.generate(request(undefined))));
    const withA = await collect(remote.generate(request(a.key)));  // loaded again on demand
    const withB = await collect(remote.generate(request(b.key)));
    assert.notEqual(text(withA), base, 'adapter a changed nothing');
    assert.notEqual(text(withB), text(withA));
    assert.deepEqual(tokens(await collect(remote.generate(request(a.key)))), tokens(withA));
    // 'b' runs a long request: the one resident slot is busy.
    const long = collect(remote.generate(request(b.key, 900)));
    await waitUntil(() => server.inFlight === 1, 'the long request runs');
    let longDone = false;
    void long.then(() => { longDone = true; }, () => {});
    // A request for 'a' waits for the slot; one aborted while it waits ends without output and leaves no waiter.
    let waitingDone = false;
    const waiting = collect(remote.generate(request(a.key))).finally(() => { waitingDone = true; });
    const dropped = request(a.key);
    const droppedRun = collect(remote.generate(dropped));
    await waitUntil(() => adapters.stats().waiting === 2, 'both requests for a wait');
    remote.abort(dropped.id);
    assert.deepEqual(tokens(await droppedRun), []);
    assert.equal(adapters.stats().waiting, 1);
    // The base request behind them runs now, while the long one still does.
    assert.equal(text(await collect(remote.generate(request(undefined)))), base);
    assert.equal(longDone, false, 'the base request waited for the long one');
    assert.equal(waitingDone, false);
    await assert.rejects(remote.registerLora('c', paths.a!), { name: 'LoraCapacityError', message: /all 1 resident adapters/ });
    await assert.rejects(collect(remote.generate(request('nope#0000'))), { name: 'LoraLoadError', message: /no LoRA adapter with key 'nope#0000'/ });
    assert.equal(tokens(await long).length, 900);
    // Then 'a' takes the slot and runs as before.
    assert.deepEqual(tokens(await waiting), tokens(withA));
    assert.equal(adapters.stats().waiting, 0);
    await waitUntil(() => server.inFlight === 0, 'every request ended');
    // Unloading while idle answers 0 in flight; the name is gone.
    assert.deepEqual(await remote.unregisterLora('a'), { inFlight: 0 });
    await assert.rejects(remote.unregisterLora('a'), { code: 'lora_not_loaded' });
    assert.equal(text(await collect(remote.generate(request(undefined)))), base);
  });
});
