// LoRA adapters whose files change under a running cpu worker pool, with the adapter table serve uses: a registered
// adapter's file overwritten in place (a retrained adapter written to the same path) or deleted is refused when the
// adapter loads again after an eviction, instead of serving new weights over KV cached with the old ones; loads the
// workers refuse (no file, an adapter made for another base model) evict no resident adapter, and are refusals, not
// capacity errors, when every slot is busy; and the workers' memory figures follow loads and unloads at once.
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { copyFileSync, mkdtempSync, rmSync, unlinkSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { loadModel } from '../../src/model/loader.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../../src/model/lora-writer.ts';
import { LoraCapacityError, LoraManager } from '../../src/runtime/lora-manager.ts';
import { createWorkerPool, type WorkerPool } from '../../src/runtime/worker-pool.ts';
import { cpuTestModel } from '../helpers/cpu-model.ts';
import { collect, tokens } from '../helpers/outputs.ts';

let nextId = 0;
const PROMPT = Array.from({ length: 40 }, (_, i) => 3 + ((i * 17) % 200));

describe('LoRA adapters whose files change, on a cpu worker pool', () => {
  let dir: string;
  let pool: WorkerPool;
  const file = (name: string) => join(dir, `${name}.gguf`);

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-lora-files-'));
    const model = cpuTestModel();
    const { config } = await loadModel(model.path);
    for (const [name, seed] of [['a', 1], ['b', 2], ['p', 3], ['q', 4]] as const) {
      writeGgufLoraAdapter(file(name), config, randomLoraAdapter(config, { rank: 4, seed, bScale: 1 }));
    }
    const other = { ...config, dim: config.dim * 2 };
    writeGgufLoraAdapter(file('other-base'), other, randomLoraAdapter(other, { rank: 4, seed: 9 }));
    pool = await createWorkerPool({ engine: 'cpu', workers: 1, modelPath: model.path, threads: 1, workerRestartLimit: 0 });
  });
  after(async () => {
    await pool?.engine.close();
    rmSync(dir, { recursive: true, force: true });
  });

  /** Greedy tokens of PROMPT with the adapter the key names. */
  const run = async (lora: string, cacheSalt?: string) => {
    const request: EngineRequest = {
      id: `lf-${nextId++}`, promptTokenIds: PROMPT, priority: 0, arrivalMs: performance.timeOrigin + performance.now(), lora,
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 8, temperature: 0, ignoreEos: true }, ...(cacheSalt ? { cacheSalt } : {}),
    };
    const outputs = await collect(pool.engine.generate(request));
    return { tokens: tokens(outputs), cachedTokens: outputs.at(-1)!.usage.cachedTokens };
  };
  const resident = (manager: LoraManager) => manager.list().filter((e) => e.resident).map((e) => e.name).sort();

  it('an adapter file overwritten in place is refused when the adapter loads again, not served over the old KV', async () => {
    const manager = new LoraManager(pool.engine, 2);
    const x = join(dir, 'x.gguf');
    copyFileSync(file('p'), x);
    await manager.register('x', x);
    const xKey = await manager.acquire('x');
    const withP = await run(xKey);
    manager.release(xKey);
    await manager.register('q', file('q'));
    const qKey = await manager.acquire('q');
    const withQ = await run(qKey);
    manager.release(qKey);
    assert.notDeepEqual(withQ.tokens, withP.tokens, 'the two adapters give different tokens');
    // Evicted by a third adapter, then retrained in place.
    await manager.register('a', file('a'));
    assert.deepEqual(resident(manager), ['a', 'q']);
    copyFileSync(file('q'), x);
    await assert.rejects(manager.acquire('x'), { code: 'invalid_adapter', message: /x\.gguf changed since the adapter was loaded/ });
    assert.deepEqual(resident(manager), ['a', 'q'], 'nothing was evicted for it');
    assert.equal(manager.stats().evictions, 1);
    // Loaded again, it serves the new file from scratch: nothing cached under its new key.
    await manager.unregister('x');
    await manager.register('x', x);
    const again = await manager.acquire('x');
    assert.notEqual(again, xKey);
    const reloaded = await run(again);
    manager.release(again);
    assert.equal(reloaded.cachedTokens, 0);
    assert.deepEqual(reloaded.tokens, withQ.tokens, 'the new file\'s tokens');
    for (const name of ['x', 'q', 'a']) await manager.unregister(name);
  });

  it('a registered adapter whose file was deleted is refused when it loads again, and evicts nothing', async () => {
    const manager = new LoraManager(pool.engine, 2);
    const d = join(dir, 'd.gguf');
    copyFileSync(file('p'), d);
    await manager.register('d', d);
    await manager.register('a', file('a'));
    await manager.register('b', file('b')); // evicts d
    unlinkSync(d);
    await assert.rejects(manager.acquire('d'), { code: 'invalid_adapter', message: /d\.gguf (does not|no longer) exists?/ });
    assert.deepEqual(resident(manager), ['a', 'b']);
    assert.equal(manager.stats().evictions, 1);
    for (const name of ['d', 'a', 'b']) await manager.unregister(name);
  });

  it('loads the workers refuse evict no idle adapter, and are refusals with every slot busy too', async () => {
    const manager = new LoraManager(pool.engine, 2);
    await manager.register('a', file('a'));
    await manager.register('b', file('b'));
    for (const path of [join(dir, 'missing.gguf'), file('other-base')]) {
      await assert.rejects(manager.register('zz', path), { code: 'invalid_adapter' }, path);
      assert.deepEqual(resident(manager), ['a', 'b'], `an idle adapter was evicted for ${path}`);
    }
    assert.equal(manager.stats().evictions, 0);
    const busy = [await manager.acquire('a'), await manager.acquire('b')];
    for (const path of [join(dir, 'missing.gguf'), file('other-base')]) {
      await assert.rejects(manager.register('zz', path), (error: Error) => !(error instanceof LoraCapacityError)
        && (error as { code?: string }).code === 'invalid_adapter', `${path} with every slot busy`);
    }
    // A good adapter with every slot busy is what waits (the load API: retry later).
    await assert.rejects(manager.register('p', file('p')), LoraCapacityError);
    assert.deepEqual(resident(manager), ['a', 'b']);
    for (const key of busy) manager.release(key);
    for (const name of ['a', 'b']) await manager.unregister(name);
  });

  it('the workers\' adapter memory follows a load and an unload at once, with no step in between', async () => {
    const manager = new LoraManager(pool.engine, 2);
    const bytes = () => pool.engine.stats().memory?.loraAdaptersBytes ?? 0;
    assert.equal(bytes(), 0);
    await manager.register('a', file('a'));
    const one = bytes();
    assert.ok(one > 0, 'the load is counted');
    await manager.register('b', file('b'));
    assert.ok(bytes() > one);
    await manager.unregister('a');
    await manager.unregister('b');
    assert.equal(bytes(), 0, 'the unloads are counted');
  });
});
