// A worker's stats as the request plane carries them to a frontend: every field the worker reports arrives, checked
// (parseStats refuses what is not a count), its lower KV tiers and request migrations included. A real CPU worker
// with a RAM tier (a tiny synthetic model in a worker thread) behind a WorkerServer on 127.0.0.1, through RemoteEngine.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import { isDeepStrictEqual } from 'node:util';
import { engineNow } from '../../src/engine/clock.ts';
import { createLocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING } from '../../src/engine/types.ts';
import { FrameError } from '../../src/cluster/frames.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { parseStats } from '../../src/cluster/request-plane.ts';
import { WorkerServer } from '../../src/cluster/worker-server.ts';
import type { EngineStats } from '../../src/protocols/worker.ts';
import { collect } from '../helpers/outputs.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

const TOKEN = 'stats-wire-token';

describe('worker stats over the request plane', () => {
  let dir: string;
  let bundle: Awaited<ReturnType<typeof createLocalEngine>>;
  let server: WorkerServer;
  let remote: RemoteEngine;

  before(async () => {
    const fixture = writeWorkerLossFixture('stats-wire');
    dir = fixture.dir;
    bundle = await createLocalEngine({
      modelPath: fixture.modelPath, threads: 1, enableKvEvents: true, kvCacheMemoryBytes: 4 * 1024 * 1024, kvOffload: { memoryBytes: 2 * 1024 * 1024 },
    });
    server = new WorkerServer({ workerId: 'w-stats', engine: bundle.engine, clusterToken: TOKEN, tokenizer: bundle.tokenizer, chatTemplate: bundle.chatTemplate });
    const port = await server.listen(0, '127.0.0.1');
    remote = await RemoteEngine.connect(`127.0.0.1:${port}`, { clusterToken: TOKEN });
  });

  after(async () => {
    await remote?.close();
    await server?.close();
    await bundle?.engine.close();
    rmSync(dir, { recursive: true, force: true });
  });

  test('a worker\'s RAM tier reaches the frontend: the figures the worker reports, once its heartbeat caught up', async () => {
    await collect(remote.generate({
      id: 'stats-1', promptTokenIds: Array.from({ length: 80 }, (_, i) => 200 + ((i * 37) % 3000)), priority: 0, arrivalMs: engineNow(),
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 8, ignoreEos: true, temperature: 0 },
    }));
    // Once idle the worker copies its cached blocks down to RAM: the stats settle, and a heartbeat carries them.
    await waitUntil(() => (server.stats().kvTiers?.tiers.ram?.offloadBlocks ?? 0) > 0, 'the worker offloaded blocks to RAM');
    await waitUntil(() => isDeepStrictEqual(remote.stats().kvTiers, server.stats().kvTiers), 'the frontend has the worker\'s tier figures');
    const ram = remote.stats().kvTiers!.tiers.ram!;
    assert.ok(ram.capacityBlocks > 0 && ram.offloadBlocks > 0 && ram.blockBytes > 0, JSON.stringify(ram));
    assert.deepEqual(remote.stats().kvTiers, server.stats().kvTiers);
  });

  test('parseStats keeps request migrations, tiers, memory and allocation failures, and refuses a malformed tier', () => {
    const tier = {
      capacityBlocks: 64, usedBlocks: 3, blockBytes: 4096, offloadBlocks: 5, offloadBytes: 20480, offloadMs: 0.25,
      onboardBlocks: 2, onboardBytes: 8192, onboardMs: 0.5, corruptBlocks: 0, evictedBlocks: 1, failedOffloadBlocks: 2,
    };
    const stats: EngineStats = {
      numRunning: 1, numWaiting: 0, kvBlocksUsed: 4, kvBlocksTotal: 128, prefixCacheQueries: 10, prefixCacheHits: 4, preemptions: 0,
      kvEvictions: 2, requestMigrations: 3, kvTiers: { tiers: { ram: tier, disk: { ...tier, capacityBlocks: 512 } }, missedOffloads: 1, recomputedBlocks: 0 },
      memory: { weightsBytes: 1 << 24, kvCacheBytes: 1 << 22, activationsBytes: 1 << 20, loraAdaptersBytes: 65_536 },
      allocationFailures: { kvBlocks: 4, scratch: 1 },
    };
    assert.deepEqual(parseStats(JSON.parse(JSON.stringify(stats))), stats);
    // A simulated worker's memory has no activations figure.
    const sim = { ...stats, memory: { weightsBytes: 1 << 24, kvCacheBytes: 1 << 22, loraAdaptersBytes: 0 } };
    assert.deepEqual(parseStats(JSON.parse(JSON.stringify(sim))), sim);
    assert.throws(() => parseStats({ ...JSON.parse(JSON.stringify(stats)), memory: { ...stats.memory, loraAdaptersBytes: -1 } }), FrameError);
    const withTiers = (tiers: unknown) => JSON.parse(JSON.stringify({ ...stats, kvTiers: { ...stats.kvTiers, tiers } }));
    assert.throws(() => parseStats(withTiers({ tape: tier })), FrameError);
    assert.throws(() => parseStats(withTiers({ ram: { ...tier, usedBlocks: -1 } })), FrameError);
    assert.throws(() => parseStats(withTiers({ ram: { ...tier, onboardMs: 'slow' } })), FrameError);
    assert.throws(() => parseStats({ ...JSON.parse(JSON.stringify(stats)), requestMigrations: 1.5 }), FrameError);
  });
});
