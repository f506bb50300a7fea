// Random sequences of scheduler operations (admit, step, abort, preemption under a small pool, prefix-cache reset,
// offload to lower tiers) checked against a plain reference: the set of block hashes each tier holds, rebuilt from
// the KV events alone, must equal what the worker really holds after every operation; and every onboarded block's
// bytes must be the KV of the hash it is registered under (never another prefix's, never another tenant's).
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { KvCacheManager } from '../../src/engine/kv-cache/manager.ts';
import { mkdtempSync, readdirSync, readFileSync, rmSync, truncateSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { DiskKvTier } from '../../src/engine/kv-cache/disk-tier.ts';
import { KvTiers, RamKvTier, type KvBlockIo } from '../../src/engine/kv-cache/tiers.ts';
import { Scheduler } from '../../src/engine/scheduler.ts';
import type { BlockHash, KvEvent } from '../../src/protocols/kv-events.ts';
import { makeRequest } from './scheduler-fixtures.ts';
import { hashTokenBlocks } from '../../src/protocols/block-hash.ts';

const BLOCK_SIZE = 4;
const BLOCK_BYTES = 16;

/** Deterministic PRNG (mulberry32). */
function random(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** A block's bytes are its hash (what the forward pass "wrote" there), so a wrong onboard shows as a wrong hash. */
class HashPool implements KvBlockIo {
  readonly blockBytes = BLOCK_BYTES;
  kv!: KvCacheManager;
  /** What each block id holds now: the hash its KV was computed or onboarded for. */
  readonly content = new Map<number, string>();

  read(blockId: number): Uint8Array {
    const hash = this.kv.pool.blocks[blockId]!.hash;
    assert.ok(hash !== null, `block ${blockId} is read while it holds no hash`);
    assert.equal(this.content.get(blockId), hash, `block ${blockId} is cached as ${hash} but holds ${this.content.get(blockId)}`);
    return Buffer.from(hash, 'latin1');
  }

  write(blockId: number, bytes: Uint8Array): void {
    this.content.set(blockId, Buffer.from(bytes).toString('latin1'));
  }
}

type Tier = 'primary' | 'ram' | 'disk';

/** The router's view of one worker, from its events alone. */
function applyEvents(held: Record<Tier, Set<BlockHash>>, events: KvEvent[]): void {
  for (const event of events) {
    const set = held[event.tier ?? 'primary'];
    if (event.type === 'stored') for (const hash of event.blockHashes) set.add(hash);
    else if (event.type === 'removed') for (const hash of event.blockHashes) set.delete(hash);
    else set.clear();
  }
}

interface RunOptions {
  slidingWindow?: number;
  /** A real disk tier in this folder (asynchronous writes, files damaged and the worker restarted at random). */
  diskDir?: string;
}

async function run(seed: number, options: RunOptions = {}): Promise<void> {
  const rand = random(seed);
  const pick = <T>(items: readonly T[]): T => items[Math.floor(rand() * items.length)]!;
  const { slidingWindow, diskDir } = options;
  const open = () => {
    const io = new HashPool();
    const disk = diskDir !== undefined
      ? new DiskKvTier({ dir: diskDir, capacityBytes: 6 * (112 + BLOCK_BYTES), blockBytes: BLOCK_BYTES, fingerprint: 'ab'.repeat(16) })
      : new RamKvTier(6, () => {}, 'disk');
    const tiers = new KvTiers({ blockBytes: BLOCK_BYTES, ramBytes: 4 * BLOCK_BYTES, disk, windowBlocks: 4, prefillTokensPerMs: 0.001 });
    const kv = new KvCacheManager({
      numBlocks: 10, blockSize: BLOCK_SIZE, enableEvents: true, tiers, blockIo: io, ...(slidingWindow !== undefined ? { slidingWindow } : {}),
    });
    io.kv = kv;
    const scheduler = new Scheduler({ maxNumBatchedTokens: 12, maxNumSeqs: 3, maxModelLen: 36, eosTokenIds: [2] }, kv);
    return { io, disk, tiers, kv, scheduler };
  };
  let { io, tiers, kv, scheduler } = open();
  let held: Record<Tier, Set<BlockHash>> = { primary: new Set(), ram: new Set(), disk: new Set() };
  // Prompts share prefixes: a few stems, continued differently, under two salts.
  const stems = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24], [11, 12, 13, 14, 31, 32, 33, 34]];
  let nextId = 0;
  let live: string[] = [];
  for (let op = 0; op < 300; op++) {
    const r = rand();
    if (r < 0.3 && live.length < 5) {
      const stem = pick(stems);
      const tail = Array.from({ length: Math.floor(rand() * 9) }, () => 40 + Math.floor(rand() * 3));
      const id = `q${nextId++}`;
      const salt = pick([undefined, 'tenant:a', 'tenant:b']);
      scheduler.addRequest(makeRequest(id, [...stem, ...tail], {
        sampling: { maxTokens: 1 + Math.floor(rand() * 6), n: rand() < 0.2 ? 2 : 1 }, ...(salt ? { cacheSalt: salt } : {}),
      }), op);
      live.push(id);
    } else if (r < 0.75) {
      // The forward pass: copies first, then each block the step completes holds the KV of its chained hash.
      const plan = scheduler.schedule(op);
      for (const copy of plan.blockCopies) io.content.set(copy.destination.id, io.content.get(copy.source.id) ?? '?');
      for (const { sequence, startPosition, numNewTokens } of plan.scheduled) {
        const salt = sequence.request.engineRequest.cacheSalt;
        const hashes = hashTokenBlocks(sequence.tokenIds, BLOCK_SIZE, salt ? { cacheSalt: salt } : {});
        const end = startPosition + numNewTokens;
        for (let i = Math.floor(startPosition / BLOCK_SIZE); i < Math.floor(end / BLOCK_SIZE); i++) {
          io.content.set(sequence.blockTable.blocks[i]!.id, hashes[i]!);
        }
        // A block left partial holds no full block's KV.
        if (end % BLOCK_SIZE !== 0) io.content.set(sequence.blockTable.blocks[Math.floor(end / BLOCK_SIZE)]!.id, 'partial');
      }
      // An abort arriving while the step runs (its blocks were written; the step's results for it are dropped).
      if (plan.scheduled.length > 0 && live.length > 0 && rand() < 0.1) {
        const id = pick(live);
        scheduler.abort(id, op);
        live.splice(live.indexOf(id), 1);
      }
      const result = plan.scheduled.length === 0 ? { finishedRequests: [] }
        : scheduler.updateFromOutput(plan, plan.sampleTargets.map(() => 50 + Math.floor(rand() * 2)), op + 1);
      for (const request of result.finishedRequests) live.splice(live.indexOf(request.id), 1);
    } else if (r < 0.83 && live.length > 0) {
      const id = pick(live);
      scheduler.abort(id, op);
      live.splice(live.indexOf(id), 1);
    } else if (r < 0.87) {
      kv.resetPrefixCache();
    } else if (r < 0.94 || diskDir === undefined) {
      kv.offloadEvictable(undefined, rand() < 0.5 ? Infinity : undefined);
    } else if (r < 0.96) {
      await tiers.flush();
    } else if (r < 0.98) {
      // A file damaged on disk: a flipped payload byte, cut short, deleted, or another block's file under its name.
      const names = readdirSync(diskDir).filter((name) => name.endsWith('.kvb'));
      if (names.length > 0) {
        const path = join(diskDir, pick(names));
        const damage = pick(['flip', 'truncate', 'delete', 'swap']);
        if (damage === 'flip') {
          const file = readFileSync(path);
          file[112 + Math.floor(rand() * BLOCK_BYTES)]! ^= 0x5a;
          writeFileSync(path, file);
        } else if (damage === 'truncate') truncateSync(path, Math.floor(rand() * (112 + BLOCK_BYTES)));
        else if (damage === 'delete') rmSync(path);
        else writeFileSync(path, readFileSync(join(diskDir, pick(names))));
      }
    } else {
      // A restart: writes in flight may land or not (the crash), the folder is read afresh.
      if (rand() < 0.5) await tiers.flush();
      for (const id of live) scheduler.abort(id, op);
      ({ io, tiers, kv, scheduler } = open());
      live = [];
      held = { primary: new Set(), ram: new Set(), disk: new Set() };
      await tiers.flush();
    }
    scheduler.checkInvariants();
    applyEvents(held, kv.takeEvents());
    const where = `seed ${seed}, operation ${op}`;
    assert.deepEqual([...held.primary].sort(), kv.cachedBlockHashes().sort(), `${where}: primary`);
    const lower = tiers.blockHashes();
    assert.deepEqual([...held.ram].sort(), lower.ram!.slice().sort(), `${where}: ram`);
    assert.deepEqual([...held.disk].sort(), lower.disk!.slice().sort(), `${where}: disk`);
    // Eviction order: free blocks holding nothing reusable go before every cached one.
    const order = kv.pool.freeBlocksInEvictionOrder();
    const firstCached = order.findIndex((block) => block.hash !== null);
    if (firstCached >= 0) assert.ok(order.slice(firstCached).every((block) => block.hash !== null), `${where}: an empty block is evicted after a cached one`);
    // Every registered block holds the KV of its own hash.
    for (const block of kv.pool.blocks) {
      if (block.hash !== null && io.content.has(block.id)) assert.equal(io.content.get(block.id), block.hash, `${where}: block ${block.id}`);
    }
  }
  await tiers.flush();
}

describe('KV cache against a reference of the hashes held', () => {
  test('random admissions, steps, aborts, resets and offloads keep the events equal to what each tier holds', async () => {
    for (let seed = 1; seed <= 200; seed++) await run(seed);
  });

  test('the same with a sliding window: blocks given back while their sequence runs stay consistent', async () => {
    for (let seed = 1; seed <= 200; seed++) await run(seed, { slidingWindow: 1 + (seed % 9) });
  });

  test('the same over a real disk tier whose files are damaged and whose worker restarts', async () => {
    for (let seed = 1; seed <= 40; seed++) {
      const dir = mkdtempSync(join(tmpdir(), 'conduit-kv-model-'));
      try {
        await run(seed, { diskDir: dir });
      } finally {
        rmSync(dir, { recursive: true, force: true });
      }
    }
  });
});
