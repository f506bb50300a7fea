// Lower KV tiers under the primary pool (src/engine/kv-cache/tiers.ts) on tiny pools with exact block ids: what is
// copied down and in which order, what the RAM tier's LRU bound pushes out, which fresh blocks an onboarded prefix
// lands in and with which bytes, the cost model's choice to recompute, and tenants kept apart.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { KvCacheManager } from '../../src/engine/kv-cache/manager.ts';
import { KvTiers, RamKvTier, type KvBlockIo, type KvBlockStore, type KvTiersOptions } from '../../src/engine/kv-cache/tiers.ts';
import { Scheduler } from '../../src/engine/scheduler.ts';
import type { BlockHash, KvEvent } from '../../src/protocols/kv-events.ts';
import { blockIds, makeRequest, prompt, step, summary } from './scheduler-fixtures.ts';

const BLOCK_SIZE = 4;
const BLOCK_BYTES = 16;

/**
 * A fake pool: a block's bytes are its hash's text (what the forward pass "wrote"), read while the block holds it;
 * writes are recorded by block id, so a test sees exactly which bytes an onboard put where.
 */
class FakePool implements KvBlockIo {
  readonly blockBytes = BLOCK_BYTES;
  readonly written = new Map<number, string>();
  reads: number[] = [];
  kv!: KvCacheManager;

  read(blockId: number): Uint8Array {
    this.reads.push(blockId);
    const hash = this.kv.pool.blocks[blockId]!.hash;
    assert.ok(hash !== null, `block ${blockId} is read while it holds a hash`);
    return Buffer.from(hash, 'latin1');
  }

  write(blockId: number, bytes: Uint8Array): void {
    this.written.set(blockId, Buffer.from(bytes).toString('latin1'));
  }
}

function setup(options: { numBlocks?: number; tiers?: Partial<KvTiersOptions> } = {}) {
  const io = new FakePool();
  const tiers = new KvTiers({ blockBytes: BLOCK_BYTES, ramBytes: 3 * BLOCK_BYTES, windowBlocks: 8, ...options.tiers });
  const kv = new KvCacheManager({ numBlocks: options.numBlocks ?? 4, blockSize: BLOCK_SIZE, enableEvents: true, tiers, blockIo: io });
  io.kv = kv;
  const scheduler = new Scheduler({ maxNumBatchedTokens: 64, maxNumSeqs: 4, maxModelLen: 64, eosTokenIds: [2] }, kv);
  return { io, tiers, kv, scheduler };
}

/** Runs a request to completion (one output token). */
function runOnce(scheduler: Scheduler, id: string, tokens: number[], salt?: string, nowMs = 0): string[] {
  scheduler.addRequest(makeRequest(id, tokens, { sampling: { maxTokens: 1 }, ...(salt ? { cacheSalt: salt } : {}) }), nowMs);
  const { plan } = step(scheduler, nowMs);
  assert.equal(scheduler.numRequests, 0, `${id} finished in one step`);
  return summary(plan);
}

function hashesOf(kv: KvCacheManager, tokens: number[], salt?: string): BlockHash[] {
  return kv.fullBlockHashes(kv.createTable(salt ? { cacheSalt: salt } : {}), tokens, tokens.length);
}

const tierEvents = (events: KvEvent[]) => events.filter((e) => e.tier !== undefined)
  .map((e) => `${e.type}:${e.tier}:${'blockHashes' in e ? e.blockHashes.join(',') : ''}`);

describe('KV tiers: offload', () => {
  test('the next blocks to be evicted are copied down in eviction order, each once, with stored events', () => {
    const { io, tiers, kv, scheduler } = setup();
    const a = prompt(0, 9); // blocks 0 and 1 full, block 2 holds the 9th token
    runOnce(scheduler, 'a', a);
    const [h0, h1] = hashesOf(kv, a);
    // a freed its blocks tail first: block 2 (no hash) to the head, then 1 (h1) and 0 (h0) to the tail.
    assert.deepEqual(kv.pool.freeBlocksInEvictionOrder().map((b) => b.id), [2, 3, 1, 0]);
    kv.takeEvents();
    assert.equal(kv.offloadEvictable(), 2);
    assert.deepEqual(io.reads, [1, 0], 'block 1 is evicted before block 0, so it is copied first');
    assert.deepEqual(tiers.ram!.hashes(), [h1, h0]);
    assert.deepEqual(tierEvents(kv.takeEvents()), [`stored:ram:${h1}`, `stored:ram:${h0}`]);
    assert.equal(kv.offloadEvictable(), 0, 'nothing new to copy');
    assert.deepEqual(io.reads, [1, 0]);
  });

  test('the per-call bound copies only the first blocks; the rest go on the next call', () => {
    const { io, kv, scheduler } = setup({ numBlocks: 8, tiers: { ramBytes: 8 * BLOCK_BYTES } });
    runOnce(scheduler, 'a', prompt(0, 17)); // 4 full blocks: ids 0..3, block 4 partial
    assert.equal(kv.offloadEvictable(1), 1);
    assert.deepEqual(io.reads, [3]);
    assert.equal(kv.offloadEvictable(2), 2);
    assert.deepEqual(io.reads, [3, 2, 1]);
    assert.equal(kv.offloadEvictable(), 1);
    assert.deepEqual(io.reads, [3, 2, 1, 0]);
  });

  test('a block evicted before it was copied is counted as missed; a copied one is not', () => {
    const { kv, scheduler, tiers } = setup();
    runOnce(scheduler, 'a', prompt(0, 9));
    runOnce(scheduler, 'b', prompt(1, 13)); // 4 blocks: evicts both of a's cached blocks
    assert.equal(tiers.stats().missedOffloads, 2);
    kv.offloadEvictable();
    runOnce(scheduler, 'c', prompt(2, 13));
    assert.equal(tiers.stats().missedOffloads, 2, 'b\'s three full blocks were copied before c evicted them');
    assert.equal(tiers.ram!.numBlocks, 3);
  });

  test('the RAM tier is LRU and bounded: the least recently used block goes, with a removed event', () => {
    const evicted: string[] = [];
    const ram = new RamKvTier(2, (hash) => evicted.push(hash));
    const block = { bytes: new Uint8Array(1), parentHash: null };
    ram.put('a' as BlockHash, block);
    ram.put('b' as BlockHash, block);
    assert.ok(ram.get('a' as BlockHash), 'a is used again');
    ram.put('c' as BlockHash, block);
    assert.deepEqual(evicted, ['b']);
    assert.deepEqual(ram.hashes(), ['a', 'c']);
    ram.put('a' as BlockHash, block);
    ram.put('d' as BlockHash, block);
    assert.deepEqual(evicted, ['b', 'c']);

    const { kv, scheduler, tiers } = setup(); // RAM tier of 3 blocks
    runOnce(scheduler, 'a', prompt(0, 9));
    kv.offloadEvictable();
    const [a0, a1] = hashesOf(kv, prompt(0, 9));
    runOnce(scheduler, 'b', prompt(1, 9));
    kv.takeEvents();
    kv.offloadEvictable();
    const [b0, b1] = hashesOf(kv, prompt(1, 9));
    // b took blocks 2, 3 and 1 (evicting a1 from the pool); a0 is still cached in block 0, already below. The RAM
    // tier held [a1, a0]: b1 fills it, b0 pushes out a1, the least recently used.
    assert.deepEqual(tiers.ram!.hashes(), [a0, b1, b0]);
    assert.deepEqual(tierEvents(kv.takeEvents()), [`stored:ram:${b1}`, `removed:ram:${a1}`, `stored:ram:${b0}`]);
    assert.equal(tiers.stats().tiers.ram!.evictedBlocks, 1);
  });
});

/** Calls an idle sweep (window Infinity) until it copies nothing; the number of calls, bounded so a sweep that never ends fails. */
function sweepUntilDone(kv: KvCacheManager, maxCalls = 50): number {
  for (let calls = 1; calls <= maxCalls; calls++) if (kv.offloadEvictable(undefined, Infinity) === 0) return calls;
  assert.fail(`the idle sweep still copied blocks after ${maxCalls} calls`);
}

describe('KV tiers: idle sweep into a tier smaller than the cached blocks', () => {
  test('each block is copied at most once, the sweep ends, and the tier keeps the most recently used', () => {
    // 8 cached blocks in the pool, a RAM tier of 3, 2 copies per call.
    const { io, tiers, kv, scheduler } = setup({ numBlocks: 16, tiers: { ramBytes: 3 * BLOCK_BYTES, maxBlocksPerCall: 2 } });
    runOnce(scheduler, 'a', prompt(0, 17));
    runOnce(scheduler, 'b', prompt(1, 17));
    const cached = kv.pool.freeBlocksInEvictionOrder().filter((b) => b.hash !== null);
    assert.equal(cached.length, 8);
    kv.takeEvents();
    assert.equal(sweepUntilDone(kv), 3, 'two calls of 2 and 1 copies, then one that copies nothing');
    assert.deepEqual(io.reads, cached.slice(-3).map((b) => b.id), 'only the 3 most recently used blocks were copied, in eviction order');
    assert.deepEqual(tiers.ram!.hashes(), cached.slice(-3).map((b) => b.hash));
    assert.deepEqual(tierEvents(kv.takeEvents()), cached.slice(-3).map((b) => `stored:ram:${b.hash}`), 'no block stored only to be removed');
    assert.equal(tiers.stats().tiers.ram!.offloadBlocks, 3);
    // Still idle: nothing more to do, however often the worker asks.
    assert.equal(kv.offloadEvictable(undefined, Infinity), 0);
    assert.deepEqual(kv.takeEvents(), []);
  });

  test('the tier\'s share is made its most recently used first, so copies push out only other blocks', () => {
    const { io, tiers, kv, scheduler } = setup({ numBlocks: 16, tiers: { ramBytes: 3 * BLOCK_BYTES } });
    runOnce(scheduler, 'a', prompt(0, 17));
    const share = kv.pool.freeBlocksInEvictionOrder().filter((b) => b.hash !== null).slice(-3);
    // The RAM tier holds the oldest block of the share as its least recently used, then two blocks no longer in the
    // pool: a copy into the full tier that pushed out its least recently used would push out that block.
    const other = { bytes: new Uint8Array(BLOCK_BYTES), parentHash: null };
    tiers.ram!.put(share[0]!.hash!, other);
    tiers.ram!.put('00000000000000f1' as BlockHash, other);
    tiers.ram!.put('00000000000000f2' as BlockHash, other);
    kv.takeEvents();
    sweepUntilDone(kv);
    assert.deepEqual(tiers.ram!.hashes(), share.map((b) => b.hash), 'the 3 most recently used, in eviction order');
    assert.deepEqual(io.reads, share.slice(1).map((b) => b.id), 'the block already held was not copied again');
    assert.deepEqual(tierEvents(kv.takeEvents()), [
      'removed:ram:00000000000000f1', `stored:ram:${share[1]!.hash}`, 'removed:ram:00000000000000f2', `stored:ram:${share[2]!.hash}`,
    ]);
  });

  test('after a step the next idle period sweeps the new blocks', () => {
    const { tiers, kv, scheduler } = setup({ numBlocks: 16, tiers: { ramBytes: 3 * BLOCK_BYTES } });
    runOnce(scheduler, 'a', prompt(0, 17));
    sweepUntilDone(kv);
    runOnce(scheduler, 'b', prompt(1, 13));
    assert.equal(sweepUntilDone(kv), 2);
    const cached = kv.pool.freeBlocksInEvictionOrder().filter((b) => b.hash !== null);
    assert.deepEqual(tiers.ram!.hashes(), cached.slice(-3).map((b) => b.hash));
    assert.deepEqual(hashesOf(kv, prompt(1, 13)).every((h) => tiers.ram!.has(h)), true, 'b\'s blocks, the most recently used, are below');
  });
});

describe('KV tiers: onboard', () => {
  test('a prefix evicted from the pool is copied back into fresh blocks instead of recomputed', () => {
    const { io, kv, scheduler, tiers } = setup();
    const a = prompt(0, 9);
    runOnce(scheduler, 'a', a);
    kv.offloadEvictable();
    const [h0, h1] = hashesOf(kv, a);
    runOnce(scheduler, 'b', prompt(1, 13)); // evicts every cached block of a
    assert.equal(kv.pool.getCachedBlock(h0!), undefined);
    kv.takeEvents();

    scheduler.addRequest(makeRequest('a2', a, { sampling: { maxTokens: 1 } }), 1);
    const plan = scheduler.schedule(1);
    assert.deepEqual(summary(plan), ['a2/0+1*1'], 'only the last token is computed');
    const ids = blockIds(scheduler, 'a2');
    assert.deepEqual(ids.length, 3);
    // The onboarded blocks got exactly the bytes copied down from a's blocks, in order.
    assert.equal(io.written.get(ids[0]!), h0);
    assert.equal(io.written.get(ids[1]!), h1);
    assert.equal(io.written.size, 2);
    assert.equal(kv.pool.getCachedBlock(h0!)?.id, ids[0], 'registered again in the primary pool');
    assert.equal(kv.pool.getCachedBlock(h1!)?.id, ids[1]);
    const request = scheduler.getRequest('a2')!;
    assert.equal(request.numCachedTokens, 8);
    assert.deepEqual({ ...request.timestamps.kvOnboard, ms: 0 }, { ram: 2, disk: 0, bytes: 2 * BLOCK_BYTES, ms: 0 });
    const stored = kv.takeEvents().filter((e) => e.type === 'stored' && e.tier === undefined);
    assert.deepEqual(stored.map((e) => e.type === 'stored' && e.blockHashes), [[h0, h1]], 'primary stored event for the onboarded blocks');
    scheduler.updateFromOutput(plan, [7], 2);
    assert.equal(tiers.stats().tiers.ram!.onboardBlocks, 2);
    scheduler.checkInvariants();
  });

  test('primary hits first, then the lower tier continues the chain', () => {
    const { kv, scheduler, tiers } = setup({ numBlocks: 6 });
    const a = prompt(0, 13); // 3 full blocks
    runOnce(scheduler, 'a', a);
    kv.offloadEvictable();
    const hashes = hashesOf(kv, a);
    // b takes 4 blocks: a's partial one, the two never used, then block 2 (h2); a keeps h0 and h1 in blocks 0, 1.
    runOnce(scheduler, 'b', prompt(1, 13));
    assert.equal(kv.pool.getCachedBlock(hashes[2]!), undefined);
    assert.ok(kv.pool.getCachedBlock(hashes[0]!));
    scheduler.addRequest(makeRequest('a2', a, { sampling: { maxTokens: 1 } }), 1);
    const plan = scheduler.schedule(1);
    assert.deepEqual(summary(plan), ['a2/0+1*1']);
    assert.deepEqual(scheduler.getRequest('a2')!.timestamps.kvOnboard?.ram, 1);
    scheduler.updateFromOutput(plan, [7], 2);
    assert.equal(tiers.stats().tiers.ram!.onboardBlocks, 1);
    scheduler.checkInvariants();
  });

  test('the cost model recomputes when the tier is slower than the prefill', () => {
    const { kv, scheduler, tiers } = setup({ tiers: { bandwidth: { ram: 1 }, prefillTokensPerMs: 1000 } });
    const a = prompt(0, 9);
    runOnce(scheduler, 'a', a);
    kv.offloadEvictable();
    runOnce(scheduler, 'b', prompt(1, 13));
    assert.equal(tiers.onboardMs('ram', 1), BLOCK_BYTES + 0.001);
    assert.ok(tiers.recomputeMs(BLOCK_SIZE) < tiers.onboardMs('ram', 1));
    const summaryLine = runOnce(scheduler, 'a2', a, undefined, 1);
    assert.deepEqual(summaryLine, ['a2/0+9*1'], 'the whole prompt is recomputed');
    assert.equal(tiers.stats().recomputedBlocks, 2);
    assert.equal(tiers.stats().tiers.ram!.onboardBlocks, 0);
  });

  test('before any prefill was measured, a tier hit is onboarded; the measured rate then decides', () => {
    const tiers = new KvTiers({ blockBytes: 1e6, ramBytes: 1e7, bandwidth: { ram: 1e3 } });
    assert.equal(tiers.recomputeMs(16), Infinity);
    // Steps of one size do not determine the step-time curve: the average prefill rate prices the recompute.
    tiers.observeStep(1600, 1, 1600);
    assert.equal(tiers.stepMs(), undefined);
    assert.ok(tiers.recomputeMs(16) < tiers.onboardMs('ram', 1), '1 GB/s cannot beat 1600 tokens per ms for 1 MB blocks');
    const fast = new KvTiers({ blockBytes: 1e3, ramBytes: 1e7 });
    fast.observeStep(16, 10, 16);
    assert.ok(fast.onboardMs('ram', 1) < fast.recomputeMs(16));
  });

  test('tenants never hit each other\'s blocks in a lower tier', () => {
    const { kv, scheduler, tiers } = setup();
    const a = prompt(0, 9);
    runOnce(scheduler, 'a', a, 'tenant-a');
    kv.offloadEvictable();
    runOnce(scheduler, 'b', prompt(1, 13), 'tenant-a');
    assert.deepEqual(runOnce(scheduler, 'x', a, 'tenant-b', 1), ['x/0+9*1'], 'another salt computes everything');
    assert.equal(tiers.stats().tiers.ram!.onboardBlocks, 0);
    runOnce(scheduler, 'c', prompt(2, 13), 'tenant-a');
    assert.deepEqual(runOnce(scheduler, 'a2', a, 'tenant-a', 2), ['a2/0+1*1'], 'the same salt finds them');
  });

  test('a handed-off request adopted on this worker does not onboard (its KV comes from the prefill worker)', () => {
    const { kv, scheduler } = setup();
    const a = prompt(0, 9);
    runOnce(scheduler, 'a', a);
    kv.offloadEvictable();
    runOnce(scheduler, 'b', prompt(1, 13));
    const table = kv.createTable();
    assert.equal(kv.findCachedPrefix(table, a, { lowerTiers: false }).numTokens, 0);
    assert.equal(kv.findCachedPrefix(kv.createTable(), a).numTokens, 8);
  });

  test('a planned lower-tier block found unreadable at onboard: the prompt is looked up again and admitted, nobody preempted', () => {
    // A disk tier that lists the prompt's first block but cannot read it (as a file failing its checksum: dropped).
    const hi = prompt(7, 9);
    const listed = new Set<BlockHash>();
    const disk: KvBlockStore = {
      tier: 'disk', capacityBlocks: 100, get numBlocks() { return listed.size; }, has: (hash) => listed.has(hash),
      get: (hash) => { listed.delete(hash); return null; }, put: () => true, hashes: () => [...listed], clear: () => listed.clear(),
    };
    const io = new FakePool();
    const kv = new KvCacheManager({ numBlocks: 64, blockSize: BLOCK_SIZE, tiers: new KvTiers({ blockBytes: BLOCK_BYTES, disk }), blockIo: io });
    io.kv = kv;
    listed.add(hashesOf(kv, hi)[0]!);
    const scheduler = new Scheduler({ policy: 'priority', maxNumBatchedTokens: 64, maxNumSeqs: 8, maxModelLen: 64, eosTokenIds: [2] }, kv);
    for (let i = 0; i < 4; i++) scheduler.addRequest(makeRequest(`low${i}`, prompt(20 + i, 3), { priority: 5, sampling: { maxTokens: 50 } }), 0);
    step(scheduler, 0);
    scheduler.addRequest(makeRequest('hi', hi, { priority: 0, sampling: { maxTokens: 50 } }), 1);
    const { plan } = step(scheduler, 1);
    assert.deepEqual(plan.preempted.map((s) => s.request.id), [], 'the pool had room: an unreadable block is no reason to preempt');
    assert.ok(summary(plan).includes('hi/0+9*1'), `hi computes its whole prompt in this step: ${summary(plan).join(' ')}`);
    assert.equal(kv.stats().tiers!.tiers.disk!.corruptBlocks, 1);
    scheduler.checkInvariants();
  });

  test('a prefix-cache reset forgets the RAM tier too', () => {
    const { kv, scheduler, tiers } = setup();
    runOnce(scheduler, 'a', prompt(0, 9));
    kv.offloadEvictable();
    kv.takeEvents();
    assert.ok(kv.resetPrefixCache());
    assert.equal(tiers.ram!.numBlocks, 0);
    assert.deepEqual(kv.takeEvents().map((e) => `${e.type}:${e.tier ?? 'primary'}`), ['cleared:primary', 'cleared:ram']);
  });
});
