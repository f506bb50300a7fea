// A frontend's router learns a worker's RAM- and disk-tier blocks from the worker's snapshot, not only from the tiers'
// KV events: a frontend that starts after the worker (it never saw the events that copied the blocks down, nor the
// disk tier's announcement of what an earlier run left) resyncs every tier when the worker joins. Real etcd and
// nats-server, a real CPU worker (tiny model) with a RAM tier of a few blocks and a disk tier, and a real frontend
// whose snapshot request goes over NATS.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import { etcdClient } from '../../src/cluster/discovery.ts';
import { EventSubscriber, natsConnect } from '../../src/cluster/events.ts';
import { ClusterFrontend } from '../../src/cluster/frontend.ts';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING } from '../../src/engine/types.ts';
import { hashTokenBlocks } from '../../src/protocols/block-hash.ts';
import type { BlockHash, KvEvent } from '../../src/protocols/kv-events.ts';
import {
  freePort, removeDir, servicesMissing, startEtcd, startNats, stopAll, tempDir, type Etcd, type Nats,
} from '../helpers/cluster-services.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

const TOKEN = 'kv-tiers-resync-token';

function prompt(group: number, length: number): number[] {
  return Array.from({ length }, (_, i) => 200 + ((group * 7919 + i * 37) % 3000));
}

describe('a frontend that starts after a worker with KV tiers', { skip: servicesMissing() }, () => {
  let dir: string;
  let modelDir: string;
  let etcd: Etcd;
  let nats: Nats;
  const closers: (() => Promise<void>)[] = [];

  before(async () => {
    dir = tempDir('kv-tiers-resync');
    modelDir = writeWorkerLossFixture('kv-tiers-resync').dir;
    etcd = await startEtcd(dir);
    nats = await startNats();
  });

  after(async () => {
    for (const close of closers.reverse()) await close().catch(() => {});
    await stopAll();
    removeDir(dir);
    removeDir(modelDir);
  });

  test('learns the blocks of its RAM and disk tiers from the snapshot, as the worker holds them', { timeout: 180_000 }, async () => {
    const worker: RunningWorker = await startClusterWorker({
      workerId: 'tiers', role: 'both', namespace: 'kt', clusterToken: TOKEN, host: '127.0.0.1', port: await freePort(),
      etcd: { endpoints: [etcd.url] }, nats: { servers: [nats.url] }, leaseTtlSeconds: 5,
      pool: {
        engine: 'cpu', backend: 'reference', modelPath: join(modelDir, 'synthetic.gguf'), threads: 1,
        kvCacheMemoryBytes: 8 * 1024 * 1024, kvOffloadMemoryBytes: 64 * 1024,
        kvOffloadDiskDir: join(dir, 'disk'), kvOffloadDiskBytes: 16 * 1024 * 1024,
      },
      log: () => {},
    });
    closers.push(() => worker.shutdown(0));
    const events: KvEvent[] = [];
    worker.server.onKvEvents((batch) => events.push(...batch));
    const engine = worker.server.engine;
    const { blockSize } = engine.info;
    const generate = async (id: string, tokenIds: number[]): Promise<void> => {
      const request = { id, promptTokenIds: tokenIds, priority: 0, arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens: 2, ignoreEos: true } };
      for await (const output of engine.generate(request)) void output;
    };
    // Each tier's blocks as the worker's events tell them.
    const tiers = { ram: new Set<BlockHash>(), disk: new Set<BlockHash>() };
    worker.server.onKvEvents((batch) => {
      for (const event of batch) {
        if (event.tier === undefined) continue;
        const held = tiers[event.tier];
        if (event.type === 'stored') for (const hash of event.blockHashes) held.add(hash);
        else if (event.type === 'removed') for (const hash of event.blockHashes) held.delete(hash);
        else held.clear();
      }
    });
    const inTier = (tier: 'ram' | 'disk', hash: BlockHash) => tiers[tier].has(hash);

    // The first prompt's blocks go down to both tiers; then more blocks than the RAM tier holds push them out of it,
    // leaving them on disk only (and in the pool, which is far larger than both prompts).
    const first = hashTokenBlocks(prompt(1, 2 * blockSize + 1), blockSize);
    await generate('t1', prompt(1, 2 * blockSize + 1));
    await waitUntil(() => first.every((hash) => inTier('ram', hash) && inTier('disk', hash)), 'the first prompt\'s blocks were copied down', 60_000);
    const ramCapacity = engine.stats().kvTiers!.tiers.ram!.capacityBlocks;
    await generate('t2', prompt(2, (ramCapacity + 2) * blockSize + 1));
    await waitUntil(() => first.every((hash) => !inTier('ram', hash)), 'the RAM tier pushed the first prompt\'s blocks out', 60_000);
    // The idle sweep is over: no event for a second.
    for (let seen = -1, polls = 0; seen !== events.length; polls++) {
      assert.ok(polls < 60, 'the worker\'s tiers settled within a minute');
      seen = events.length;
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
    const ram = [...tiers.ram];
    const disk = [...tiers.disk];
    assert.ok(ram.length > 0 && disk.length > ram.length, `RAM tier ${ram.length} blocks, disk tier ${disk.length}`);

    const logs: string[] = [];
    const frontendNc = await natsConnect({ servers: [nats.url], name: 'late-frontend' });
    const frontend = new ClusterFrontend({
      namespace: 'kt', clusterToken: TOKEN, etcd: etcdClient({ endpoints: [etcd.url] }),
      events: (handlers) => new EventSubscriber(frontendNc, 'kt', handlers, () => {}),
      log: (level, message) => { logs.push(`${level} ${message}`); },
    });
    closers.push(() => frontend.close());
    await frontend.start();
    await frontend.ready();
    await waitUntil(() => logs.some((l) => l.startsWith('debug KV view of tiers resynced (joined)')), 'the frontend resynced the worker', 20_000);

    const index = frontend.router!.index;
    for (const hash of disk) {
      const expected = { blocks: 1, disk: inTier('ram', hash) ? 0 : 1 };
      assert.deepEqual(index.lowerTierRun('tiers', [hash], 0), expected, `block ${hash} below the pool, as the worker holds it`);
    }
    for (const hash of ram) assert.equal(index.lowerTierRun('tiers', [hash], 0).blocks, 1, `block ${hash} in the RAM tier`);
    assert.deepEqual(index.lowerTierRun('tiers', first, 0), { blocks: first.length, disk: first.length }, 'the first prompt: on disk only');
    const resynced = logs.find((l) => l.startsWith('debug KV view of tiers resynced (joined)'))!;
    assert.match(resynced, new RegExp(`, ${ram.length} in its ram tier, ${disk.length} in its disk tier, event `), resynced);
  });
});
