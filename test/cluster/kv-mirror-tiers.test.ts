// A worker's KV snapshot (what a frontend resyncs its router's index from: a worker joining, an event-id gap, a NATS
// reconnect) lists the blocks of its primary pool and, apart, those of each lower tier (RAM, disk). The router's index
// keeps a worker's lower-tier blocks apart and costs them as copies, not as free hits. Events of the tiers (a block
// copied down, pushed out of the RAM tier by its LRU bound, the disk tier's blocks announced at start) must therefore
// change the tiers' lists and not the primary blocks. Checked on a real worker (a worker thread running a tiny
// model) with a RAM tier a few blocks large, behind a real WorkerServer and RemoteEngine.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import { engineNow } from '../../src/engine/clock.ts';
import { createLocalEngine, type LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { hashTokenBlocks } from '../../src/protocols/block-hash.ts';
import type { BlockHash, KvEvent } from '../../src/protocols/kv-events.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { WorkerServer } from '../../src/cluster/worker-server.ts';
import { collect } from '../helpers/outputs.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

const TOKEN = 'test-kv-mirror-token';
let nextId = 0;

function request(promptTokenIds: number[]): EngineRequest {
  return {
    id: `km${nextId++}`, promptTokenIds, priority: 0, arrivalMs: engineNow(),
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 2, ignoreEos: true, temperature: 0 },
  };
}

function prompt(group: number, length: number): number[] {
  return Array.from({ length }, (_, i) => 200 + ((group * 7919 + i * 37) % 3000));
}

describe('a worker\'s KV snapshot with a RAM tier', () => {
  let dir: string;
  let bundle: Awaited<ReturnType<typeof createLocalEngine>>;
  let server: WorkerServer;
  let remote: RemoteEngine;
  const events: KvEvent[] = [];

  before(async () => {
    const fixture = writeWorkerLossFixture('kv-mirror-tiers');
    dir = fixture.dir;
    // A pool far larger than the prompts (nothing is evicted from it), and a RAM tier of a few blocks.
    bundle = await createLocalEngine({
      modelPath: fixture.modelPath, threads: 1, enableKvEvents: true, kvCacheMemoryBytes: 8 * 1024 * 1024,
      kvOffload: { memoryBytes: 64 * 1024 },
    });
    bundle.engine.onKvEvents!((batch) => events.push(...batch));
    server = new WorkerServer({
      workerId: 'w-mirror', engine: bundle.engine, clusterToken: TOKEN, maxFrameBytes: 1024 * 1024,
      tokenizer: bundle.tokenizer, chatTemplate: bundle.chatTemplate, log: () => {},
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

  test('lists the blocks the pool holds, whatever the RAM tier took in or pushed out', async () => {
    const engine = bundle.engine as LocalEngine;
    const ramCapacity = (await engine.sync()).kvTiers!.tiers.ram!.capacityBlocks;
    const { blockSize } = engine.info;
    const first = prompt(1, 2 * blockSize + 1);
    await collect(engine.generate(request(first)));
    const firstHashes = hashTokenBlocks(first, blockSize);
    const tierEvent = (type: 'stored' | 'removed', hash: BlockHash) => events.some((event) => event.type === type
      && event.tier === 'ram' && event.blockHashes.includes(hash));
    await waitUntil(() => firstHashes.every((hash) => tierEvent('stored', hash)), 'the idle worker copied the first prompt\'s blocks down');
    // More blocks than the RAM tier holds, computed after the first prompt's: the idle offload keeps these below and
    // pushes the first prompt's blocks out of the RAM tier, while the pool still holds them.
    await collect(engine.generate(request(prompt(2, (ramCapacity + 2) * blockSize + 1))));
    await waitUntil(() => firstHashes.every((hash) => tierEvent('removed', hash)), 'the RAM tier pushed the first prompt\'s blocks out');
    assert.ok(!events.some((event) => event.type !== 'stored' && event.tier === undefined),
      'nothing left the pool: its blocks are all still cached there');

    // The pool still has them: the same prompt again is served from it, nothing onboarded.
    const again = (await collect(engine.generate(request(first)))).at(-1)!;
    assert.equal(again.usage.cachedTokens, 2 * blockSize);
    assert.equal(again.timestamps.kvOnboard, undefined);

    // The idle worker may still be copying blocks down (more tier events) while the snapshot is asked for: its last
    // event id is at least that of the events seen before it was asked, tier events included, and at most the last.
    const before = events.at(-1)!.eventId;
    const snapshot = await remote.snapshot();
    const listed = new Set(snapshot.hashes);
    for (const hash of firstHashes) assert.ok(listed.has(hash), `the snapshot lists block ${hash}, which the pool holds`);
    // Its RAM tier is what the tier's events up to its last event id leave there (the idle worker may have copied
    // the first prompt's blocks down again after they were used again).
    const ramAt = new Set<BlockHash>();
    for (const event of events) {
      if (event.eventId > snapshot.lastEventId || event.tier !== 'ram') continue;
      if (event.type === 'stored') for (const hash of event.blockHashes) ramAt.add(hash);
      else if (event.type === 'removed') for (const hash of event.blockHashes) ramAt.delete(hash);
      else ramAt.clear();
    }
    assert.ok(ramAt.size > 0, 'the RAM tier holds blocks');
    assert.deepEqual([...(snapshot.tiers?.ram ?? [])].sort(), [...ramAt].sort(), 'the snapshot\'s RAM tier lists the blocks its events left there');
    assert.ok(snapshot.lastEventId >= before && snapshot.lastEventId <= events.at(-1)!.eventId,
      `the snapshot's last event id ${snapshot.lastEventId} is among the events (${before}..${events.at(-1)!.eventId})`);
  });
});
