// --kv-cache-idle-release on the local engine (the built-in model in a worker thread): a worker idle for the set
// time drops its prefix cache by itself (a 'cleared' KV event) and the same prompt is then computed again; with a
// long interval the cache stays.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { createLocalEngine, type LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { ensureBuiltinModel } from '../../src/model/synthetic.ts';
import type { KvEvent } from '../../src/protocols/kv-events.ts';
import { collect } from '../helpers/outputs.ts';
import { waitUntil } from '../helpers/wait-until.ts';

/** Four full blocks of 16 ordinary vocabulary ids (the first few are control tokens). */
const PROMPT = Array.from({ length: 64 }, (_, i) => 300 + ((i * 31) % 20_000));
let nextId = 0;

async function cachedTokens(engine: LocalEngine): Promise<number> {
  const request: EngineRequest = {
    id: `idle-${nextId++}`, promptTokenIds: PROMPT, sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens: 2 },
    priority: 0, arrivalMs: 0,
  };
  const outputs = await collect(engine.generate(request));
  return outputs.at(-1)!.usage.cachedTokens;
}

async function start(idleSeconds: number): Promise<{ engine: LocalEngine; events: KvEvent[] }> {
  const { engine } = await createLocalEngine({
    modelPath: await ensureBuiltinModel(), backend: 'auto', threads: 1, maxNumSeqs: 4,
    kvCacheMemoryBytes: 4 << 20, enableKvEvents: true, kvCacheIdleReleaseSeconds: idleSeconds,
  });
  const events: KvEvent[] = [];
  engine.onKvEvents((batch) => events.push(...batch));
  return { engine, events };
}

describe('KV cache idle release', () => {
  it('an idle worker drops its prefix cache by itself, and the prompt is computed again', async () => {
    const { engine, events } = await start(0.05);
    try {
      await cachedTokens(engine);
      await waitUntil(() => events.some((e) => e.type === 'cleared'), 'the idle worker reports its cache cleared');
      assert.equal(await cachedTokens(engine), 0, 'nothing cached after the idle release');
      // The release happens once per busy period: the next one comes only after more work.
      const cleared = events.filter((e) => e.type === 'cleared').length;
      await waitUntil(() => events.filter((e) => e.type === 'cleared').length > cleared, 'a second release after the second request');
      assert.equal((await engine.sync()).kvBlocksUsed, 0);
    } finally {
      await engine.close();
    }
  });

  it('keeps the cache while the worker has not been idle that long', async () => {
    const { engine, events } = await start(3600);
    try {
      await cachedTokens(engine);
      assert.ok(await cachedTokens(engine) >= 16, 'the repeated prompt reuses its blocks');
      assert.ok(!events.some((e) => e.type === 'cleared'), 'no reset');
    } finally {
      await engine.close();
    }
  });
});
