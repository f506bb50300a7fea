// The lower KV tiers as `conduit serve` runs them: a cpu worker thread with a RAM and a disk tier, a pool closed and
// started again over the same folder (a warm restart finds the prompt's blocks on disk), a second pool refused
// the folder while the first holds it, and an idle worker whose RAM tier is smaller than its cached blocks settling.
import { afterEach, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import { createWorkerPool, type WorkerPoolOptions } from '../../src/runtime/worker-pool.ts';
import { cpuTestModel } from '../helpers/cpu-model.ts';
import { collect } from '../helpers/outputs.ts';
import { LocalEngine } from '../../src/engine/local-engine.ts';
import { hashTokenBlocks } from '../../src/protocols/block-hash.ts';
import type { KvEvent } from '../../src/protocols/kv-events.ts';

let nextId = 0;
function request(promptTokenIds: number[]): EngineRequest {
  return {
    id: `tier-${nextId++}`, promptTokenIds, priority: 0, arrivalMs: performance.timeOrigin + performance.now(),
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 6, temperature: 0, ignoreEos: true },
  };
}

const dirs: string[] = [];
afterEach(() => {
  while (dirs.length > 0) rmSync(dirs.pop()!, { recursive: true, force: true });
});

describe('KV tiers in a cpu worker pool', () => {
  test('a restart over the same disk folder finds the prompt again; a second pool is refused the folder', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-kv-pool-'));
    dirs.push(dir);
    const model = cpuTestModel();
    const options: WorkerPoolOptions = {
      engine: 'cpu', workers: 1, modelPath: model.path, threads: 1, kvOffloadMemoryBytes: 8 << 20,
      kvOffloadDiskDir: dir, kvOffloadDiskBytes: 64 << 20, workerRestartLimit: 0,
    };
    const prompt = Array.from({ length: 70 }, (_, i) => 10 + ((i * 13) % 200));

    const first = await createWorkerPool(options);
    let cold: EngineOutput[];
    try {
      // Before any request: the stats (what /metrics and the console read) have the tiers and the memory already.
      const idle = first.engine.stats();
      assert.equal(idle.kvTiers?.tiers.disk?.capacityBlocks !== undefined && idle.kvTiers.tiers.disk.capacityBlocks > 0, true, JSON.stringify(idle.kvTiers));
      assert.ok((idle.kvTiers?.tiers.ram?.capacityBlocks ?? 0) > 0);
      assert.ok((idle.memory?.weightsBytes ?? 0) > 0);
      await assert.rejects(createWorkerPool(options), /already in use by this process/);
      cold = await collect(first.engine.generate(request(prompt)));
      // Once idle the worker writes its cached blocks down; the disk tier holds the prompt's 4 full blocks.
      const worker = first.workers[0]!.engine as LocalEngine;
      for (let turns = 0; ((await worker.sync()).kvTiers?.tiers.disk?.usedBlocks ?? 0) < 4; turns++) {
        assert.ok(turns < 2000, 'the disk tier got the prompt\'s blocks');
        await new Promise((resolve) => setTimeout(resolve, 5));
      }
    } finally {
      await first.engine.close();
    }
    assert.equal(readdirSync(join(dir, 'worker-0')).filter((name) => name.endsWith('.kvb')).length >= 4, true);
    assert.ok(!readdirSync(dir).includes('conduit.lock'), 'the lock is released on close');
    // Left by a run with more workers: a worker's folder of blocks goes (nobody here reads it, and the size bound is
    // this run's); a folder of that name holding anything else stays.
    mkdirSync(join(dir, 'worker-3'));
    writeFileSync(join(dir, 'worker-3', `${'ab'.repeat(8)}.kvb`), 'x');
    mkdirSync(join(dir, 'worker-5'));
    writeFileSync(join(dir, 'worker-5', 'notes.txt'), 'mine');

    const second = await createWorkerPool(options);
    try {
      assert.deepEqual(readdirSync(dir).filter((name) => name.startsWith('worker-')).sort(), ['worker-0', 'worker-5']);
      const notices = second.notices.map(({ level, message }) => `${level} ${message}`);
      assert.ok(notices.some((notice) => /^info KV disk tier .*: removed worker-3, left by a run with more workers/.test(notice)), notices.join('\n'));
      assert.ok(notices.some((notice) => /^info KV disk tier .*: [4-9]\d* blocks of this model found/.test(notice)), notices.join('\n'));
      const warm = await collect(second.engine.generate(request(prompt)));
      assert.equal(warm.at(-1)!.usage.cachedTokens, 64, 'four blocks onboarded from disk');
      assert.equal(warm.at(-1)!.timestamps.kvOnboard?.disk, 4);
      assert.deepEqual(warm.flatMap((o) => o.newTokenIds), cold.flatMap((o) => o.newTokenIds), 'same greedy tokens');
    } finally {
      await second.engine.close();
    }
  });
});

describe('KV events of a warm restart', () => {
  test('the blocks a worker finds on disk are announced before its first step, to a listener added after it started', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-kv-pool-'));
    dirs.push(dir);
    const model = cpuTestModel();
    const options = { modelPath: model.path, threads: 1, enableKvEvents: true, kvOffload: { memoryBytes: 0, diskDir: dir, diskBytes: 64 << 20 } };
    const prompt = Array.from({ length: 70 }, (_, i) => 10 + ((i * 13) % 200));
    const first = await LocalEngine.start(options);
    try {
      await collect(first.generate(request(prompt)));
      for (let turns = 0; ((await first.sync()).kvTiers?.tiers.disk?.usedBlocks ?? 0) < 4; turns++) {
        assert.ok(turns < 2000, 'the disk tier got the prompt\'s blocks');
        await new Promise((resolve) => setTimeout(resolve, 5));
      }
    } finally {
      await first.close();
    }
    const second = await LocalEngine.start(options);
    try {
      // As a router adds a worker: once it started (here, well after), with no request run yet.
      await new Promise((resolve) => setTimeout(resolve, 300));
      const events: KvEvent[] = [];
      second.onKvEvents((batch) => events.push(...batch));
      assert.equal(events[0]?.eventId, 1, 'from the first event on: no gap for the index to resync over');
      const announced = events.flatMap((event) => event.type === 'stored' && event.tier === 'disk' ? event.blockHashes : []);
      const promptBlocks = hashTokenBlocks(prompt, second.info.blockSize).slice(0, 4);
      assert.deepEqual(promptBlocks.filter((hash) => announced.includes(hash)), promptBlocks);
    } finally {
      await second.close();
    }
  });
});

describe('engine stats summed over workers', () => {
  test('keep the KV tiers, tier by tier (a single supervised worker reports through the sum too)', async () => {
    const { sumEngineStats } = await import('../../src/runtime/engine-stats.ts');
    const tier = (used: number, onboard: number) => ({
      capacityBlocks: 10, usedBlocks: used, blockBytes: 100, offloadBlocks: 0, offloadBytes: 0, offloadMs: 0,
      onboardBlocks: onboard, onboardBytes: 100 * onboard, onboardMs: 1, corruptBlocks: 0, evictedBlocks: 0, failedOffloadBlocks: 0,
    });
    const base = { numRunning: 0, numWaiting: 0, kvBlocksUsed: 0, kvBlocksTotal: 4, prefixCacheQueries: 0, prefixCacheHits: 0, preemptions: 0 };
    const sum = sumEngineStats([
      { ...base, kvTiers: { tiers: { ram: tier(3, 1) }, missedOffloads: 1, recomputedBlocks: 0 } },
      { ...base, kvTiers: { tiers: { ram: tier(4, 2), disk: tier(5, 0) }, missedOffloads: 2, recomputedBlocks: 3 } },
      base,
    ]);
    assert.deepEqual(sum.kvTiers, {
      tiers: { ram: { ...tier(7, 3), capacityBlocks: 20, onboardMs: 2 }, disk: tier(5, 0) }, missedOffloads: 3, recomputedBlocks: 3,
    });
  });

  test('an idle worker with tiers smaller than its cached blocks copies them down once, then stops', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-kv-pool-'));
    dirs.push(dir);
    const model = cpuTestModel();
    // A RAM tier a quarter of the pool's size, a disk tier half of it; the prompts cache more blocks than the disk tier
    // holds (how many that is depends on the model's block bytes: at least four prompts).
    const pool = await createWorkerPool({
      engine: 'cpu', workers: 1, modelPath: model.path, threads: 1, kvCacheMemoryBytes: 256 << 10, kvOffloadMemoryBytes: 64 << 10,
      kvOffloadDiskDir: dir, kvOffloadDiskBytes: 128 << 10, workerRestartLimit: 0,
    });
    const worker = pool.workers[0]!.engine as LocalEngine;
    try {
      const start = await worker.sync();
      const promptBlocks = Math.floor(96 / worker.info.blockSize);
      const prompts = Math.max(4, Math.ceil((start.kvTiers!.tiers.disk!.capacityBlocks + 1) / promptBlocks));
      assert.ok(prompts * promptBlocks <= start.kvBlocksTotal, 'the prompts fit the pool together');
      for (let i = 0; i < prompts; i++) {
        await collect(pool.engine.generate({ ...request(Array.from({ length: 96 }, (_, j) => 3 + ((j * (i + 7) * 31) % 200))), sampling: { ...DEFAULT_SAMPLING, maxTokens: 1 } }));
      }
      // What /metrics reads without asking the worker: the state it sent by itself once idle (sync() below updates it).
      await new Promise((resolve) => setTimeout(resolve, 500));
      const reported = structuredClone(pool.engine.stats().kvTiers!.tiers);
      const ram = async () => (await worker.sync()).kvTiers!.tiers.ram!;
      const { capacityBlocks } = await ram();
      // Settled: the offload counter stops moving (it kept climbing while the sweep copied blocks round the tier).
      let last = -1;
      for (let turns = 0; ; turns++) {
        assert.ok(turns < 50, `the idle sweep did not end: ${last} blocks copied into a tier of ${capacityBlocks}`);
        await new Promise((resolve) => setTimeout(resolve, 100));
        const now = (await ram()).offloadBlocks;
        if (now === last) break;
        last = now;
      }
      await new Promise((resolve) => setTimeout(resolve, 300));
      const settled = await ram();
      assert.equal(settled.offloadBlocks, last, 'nothing copied while idle once settled');
      assert.equal(settled.usedBlocks, capacityBlocks, 'the tier is full');
      const disk = (await worker.sync()).kvTiers!.tiers.disk!;
      assert.equal(disk.usedBlocks, disk.capacityBlocks, 'the disk tier is full');
      assert.equal(readdirSync(join(dir, 'worker-0')).filter((name) => name.endsWith('.kvb')).length, disk.usedBlocks);
      assert.ok(disk.offloadBlocks <= 2 * disk.capacityBlocks, `${disk.offloadBlocks} blocks written into a tier of ${disk.capacityBlocks}`);
      assert.deepEqual(reported, { ram: settled, disk }, 'the worker sent its tiers\' last state, the disk writes that landed after the sweep included');
    } finally {
      await pool.engine.close();
    }
  });
});
