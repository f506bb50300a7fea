// The KV cache manager: prefix hits, allocation, registration, sharing, tail-first eviction and events.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { KvCacheManager } from '../../src/engine/kv-cache/manager.ts';
import type { BlockTable, KvCacheConfig } from '../../src/engine/kv-cache/manager.ts';
import { hashTokenBlocks } from '../../src/protocols/block-hash.ts';
import type { BlockHash, KvEvent } from '../../src/protocols/kv-events.ts';

const BLOCK_SIZE = 4;

function makeManager(numBlocks: number, config: Partial<KvCacheConfig> = {}): KvCacheManager {
  return new KvCacheManager({ numBlocks, blockSize: BLOCK_SIZE, enableEvents: true, ...config });
}

const range = (start: number, count: number): number[] => Array.from({ length: count }, (_, i) => start + i);
const refCounts = (table: BlockTable): number[] => table.blocks.map((block) => block.refCount);

/** Admits tokens as a new sequence (prefix hit, then every remaining token) and marks them all computed. */
function computeSequence(kv: KvCacheManager, tokens: number[], extraKeys = {}): { table: BlockTable; hitTokens: number } {
  const table = kv.createTable(extraKeys);
  const prefix = kv.findCachedPrefix(table, tokens);
  const allocated = kv.allocateSlots(table, prefix.numTokens, tokens.length - prefix.numTokens, prefix);
  assert.notEqual(allocated, null, 'the pool should have room');
  // No bytes here: the copy a fully cached sequence asks for is "made" at once.
  if (table.pendingCopy !== null) kv.releaseBlockCopy(table.pendingCopy);
  table.pendingCopy = null;
  kv.cacheComputedBlocks(table, tokens, tokens.length);
  return { table, hitTokens: prefix.numTokens };
}

describe('KvCacheManager', () => {
  it('pins the leading cached blocks of a hash chain, which nothing evicts until unpinned', () => {
    const kv = makeManager(4);
    const tokens = range(100, 12);
    const { table } = computeSequence(kv, tokens);
    kv.free(table);
    const hashes = hashTokenBlocks([...range(100, 8), 5, 5, 5, 5], BLOCK_SIZE);
    const pin = kv.pinCachedPrefix(hashes)!;
    assert.deepEqual(pin.blocks.map((block) => block.id), [0, 1], 'the first two blocks match; the chain stops at the third');
    assert.equal(kv.stats().numUsedBlocks, 2);
    // The pool needs room: only the unpinned cached block and the free one can be taken.
    const other = kv.createTable();
    assert.equal(kv.allocateSlots(other, 0, 12), null);
    assert.notEqual(kv.allocateSlots(other, 0, 8), null);
    kv.checkInvariants([other]);
    assert.equal(kv.unpin(pin), true);
    kv.free(other);
    assert.equal(kv.stats().numUsedBlocks, 0);
    assert.equal(kv.pinCachedPrefix(hashTokenBlocks(range(500, 8), BLOCK_SIZE)), null, 'nothing cached: nothing pinned');
    kv.checkInvariants([]);
  });

  it('allocates exactly the blocks the tokens need and registers the full ones', () => {
    const kv = makeManager(8);
    const tokens = range(100, 10);
    const { table, hitTokens } = computeSequence(kv, tokens);
    assert.equal(hitTokens, 0);
    assert.deepEqual(table.blockIds, [0, 1, 2]);
    assert.deepEqual(kv.cachedBlockHashes(), hashTokenBlocks(tokens, BLOCK_SIZE));
    assert.deepEqual(kv.takeEvents(), [{
      type: 'stored', eventId: 1, blockHashes: hashTokenBlocks(tokens, BLOCK_SIZE), parentHash: null, tokenCount: 8, blockSize: 4,
    }]);
    kv.checkInvariants([table]);
  });

  it('shares the longest full-block prefix and counts the references', () => {
    const kv = makeManager(8);
    const a = computeSequence(kv, range(100, 10));
    const b = computeSequence(kv, [...range(100, 8), 7, 7, 7]);
    assert.equal(b.hitTokens, 8);
    assert.deepEqual(b.table.blockIds, [0, 1, 3]);
    assert.deepEqual(refCounts(a.table), [2, 2, 1]);
    const stats = kv.stats();
    assert.equal(stats.prefixQueryTokens, 21);
    assert.equal(stats.prefixHitTokens, 8);
    assert.equal(stats.numUsedBlocks, 4);
    kv.checkInvariants([a.table, b.table]);
  });

  it('always leaves the last token to compute, even when every block is cached', () => {
    const kv = makeManager(8);
    const first = computeSequence(kv, range(100, 8)).table;
    const table = kv.createTable();
    const prefix = kv.findCachedPrefix(table, range(100, 8));
    assert.deepEqual(prefix.blocks.map((block) => block.id), [first.blocks[0]!.id], 'the block holding the last token is not shared');
    assert.equal(prefix.copySource, first.blocks[1], 'but copied');
    assert.equal(prefix.numTokens, 7);
    const notCopied = kv.findCachedPrefix(kv.createTable(), range(100, 8), { copyOnWrite: false });
    assert.equal(notCopied.numTokens, 4);
    assert.equal(notCopied.copySource, undefined);
    const longer = kv.findCachedPrefix(kv.createTable(), range(100, 9));
    assert.equal(longer.numTokens, 8, 'a token past the cached blocks: both are shared');
    assert.equal(longer.copySource, undefined);
  });

  it('gives a fully cached sequence a fresh last block to copy into, pinning the source until released', () => {
    const kv = makeManager(8);
    const tokens = range(100, 8);
    const first = computeSequence(kv, tokens).table;
    kv.takeEvents();
    const table = kv.createTable();
    const prefix = kv.findCachedPrefix(table, tokens);
    const allocated = kv.allocateSlots(table, prefix.numTokens, 1, prefix)!;
    assert.equal(allocated.length, 1);
    const copy = table.pendingCopy!;
    assert.equal(copy.source, first.blocks[1]);
    assert.equal(copy.destination, allocated[0]);
    assert.deepEqual(table.blocks, [first.blocks[0], allocated[0]]);
    assert.equal(copy.source.refCount, 2, 'the first table and the pin');
    assert.equal(table.numCachedBlocks, 1, 'the copy is not a hit');
    assert.equal(kv.stats().prefixHitTokens, 7);
    table.pendingCopy = null;
    kv.checkInvariants([first, table]);

    kv.releaseBlockCopy(copy);
    assert.equal(copy.source.refCount, 1);
    kv.cacheComputedBlocks(table, tokens, 8);
    assert.equal(copy.destination.hash, null, 'its hash stays with the source: no duplicate entry');
    assert.equal(kv.pool.getCachedBlock(hashTokenBlocks(tokens, BLOCK_SIZE)[1]!), copy.source);
    assert.deepEqual(kv.takeEvents(), [], 'nothing new is stored for the router');
    kv.free(first);
    kv.free(table);
    assert.equal(kv.numFreeBlocks, 8);
    assert.equal(kv.numPins, 0);
    kv.checkInvariants([]);
    assert.equal(kv.findCachedPrefix(kv.createTable(), tokens).copySource, copy.source, 'the source is still cached');
  });

  it('never hands out a free copy source as the fresh block, and counts it when checking room', () => {
    const kv = makeManager(3);
    const a = computeSequence(kv, range(100, 8)).table; // blocks 0 and 1
    const b = computeSequence(kv, range(500, 4)).table; // block 2
    kv.free(a);
    kv.free(b);
    assert.deepEqual(kv.pool.freeBlocksInEvictionOrder().map((block) => block.id), [1, 0, 2], 'the source is next to evict');
    const table = kv.createTable();
    const prefix = kv.findCachedPrefix(table, range(100, 8));
    assert.deepEqual(kv.allocateSlots(table, 7, 1, prefix)!.map((block) => block.id), [2]);
    assert.equal(table.pendingCopy!.source.id, 1);
    assert.equal(kv.pool.blocks[1]!.hash, hashTokenBlocks(range(100, 8), BLOCK_SIZE)[1], 'the source kept its KV');
    const copy = table.pendingCopy!;
    table.pendingCopy = null;
    kv.checkInvariants([table]);
    kv.releaseBlockCopy(copy);
    kv.free(table);

    // Three blocks, one held by another sequence: the shared block, the pinned source and a fresh one do not fit
    // now, so nothing is taken (the request waits for room).
    const tight = makeManager(3);
    const d = computeSequence(tight, range(100, 8)).table;
    tight.free(d);
    const other = computeSequence(tight, range(900, 4)).table;
    const waiting = tight.createTable();
    const hit = tight.findCachedPrefix(waiting, range(100, 8));
    assert.ok(hit.copySource !== undefined);
    assert.equal(tight.allocateSlots(waiting, 7, 1, hit), null);
    assert.equal(waiting.pendingCopy, null);
    assert.equal(tight.numPins, 0);
    assert.equal(tight.numFreeBlocks, 2);
    tight.free(other);
    tight.checkInvariants([]);

    // Two blocks, the whole pool: a copy would never fit (it needs three), so the prompt's last block is computed.
    const small = makeManager(2);
    const c = computeSequence(small, range(100, 8)).table;
    small.free(c);
    const whole = small.createTable();
    const cached = small.findCachedPrefix(whole, range(100, 8));
    assert.equal(cached.copySource, undefined);
    assert.equal(cached.numTokens, 4);
    assert.equal(small.allocateSlots(whole, 4, 4, cached)!.length, 1);
    assert.equal(whole.pendingCopy, null);
    small.free(whole);
    small.checkInvariants([]);
  });

  it('shares nothing across cache salts or adapters', () => {
    const kv = makeManager(16);
    const tokens = range(100, 9);
    computeSequence(kv, tokens, { cacheSalt: 'tenant-a' });
    assert.equal(computeSequence(kv, tokens, { cacheSalt: 'tenant-b' }).hitTokens, 0);
    assert.equal(computeSequence(kv, tokens).hitTokens, 0);
    assert.equal(computeSequence(kv, tokens, { cacheSalt: 'tenant-a', adapterId: 'lora' }).hitTokens, 0);
    assert.equal(computeSequence(kv, tokens, { cacheSalt: 'tenant-a' }).hitTokens, 8);
  });

  it('keeps freed blocks reusable, and evicts the tail of the least recently freed sequence first', () => {
    const kv = makeManager(6);
    const a = computeSequence(kv, range(100, 13)); // blocks 0..3, 0..2 registered
    const aHashes = hashTokenBlocks(range(100, 12), BLOCK_SIZE);
    kv.free(a.table);
    assert.deepEqual(kv.pool.freeBlocksInEvictionOrder().map((block) => block.id), [3, 4, 5, 2, 1, 0]);
    kv.takeEvents();

    const b = computeSequence(kv, range(500, 16)); // needs 4 blocks: 3, 4, 5, then A's tail block 2
    assert.deepEqual(b.table.blockIds, [3, 4, 5, 2]);
    assert.equal(kv.stats().evictions, 1);
    assert.deepEqual(kv.takeEvents()[0], { type: 'removed', eventId: 2, blockHashes: [aHashes[2]] });

    kv.free(b.table);
    assert.deepEqual(kv.pool.freeBlocksInEvictionOrder().map((block) => block.id), [1, 0, 2, 5, 4, 3]);
    const again = computeSequence(kv, range(100, 13));
    assert.equal(again.hitTokens, 8, 'the two head blocks survived');
    // 0 and 1 leave the queue from where they sit; the 2 new blocks are B's tail blocks, the next to evict.
    assert.deepEqual(again.table.blockIds, [0, 1, 2, 5]);
    kv.checkInvariants([again.table]);
  });

  it('returns null and changes nothing when the pool is short', () => {
    const kv = makeManager(3);
    const a = computeSequence(kv, range(100, 9)); // 3 blocks, 2 registered
    kv.free(a.table);
    const b = kv.createTable();
    const tokens = [...range(100, 8), ...range(900, 5)];
    const prefix = kv.findCachedPrefix(b, tokens);
    assert.equal(prefix.numTokens, 8);
    // 13 tokens need 4 blocks: the 2 hit blocks are free but cannot also be counted as room for the 2 new ones.
    assert.equal(kv.allocateSlots(b, 8, 5, prefix), null);
    assert.deepEqual(b.blockIds, []);
    assert.equal(kv.numFreeBlocks, 3);
    assert.equal(kv.stats().prefixHitTokens, 0, 'a lookup that was not admitted is not counted');
    const fits = kv.findCachedPrefix(b, tokens.slice(0, 12));
    assert.deepEqual(kv.allocateSlots(b, 8, 4, fits)!.map((block) => block.id), [2]);
    assert.deepEqual(b.blockIds, [0, 1, 2]);
    kv.checkInvariants([b]);
  });

  it('grows a table one decode slot at a time, allocating only at block boundaries', () => {
    const kv = makeManager(4);
    const table = kv.createTable();
    assert.equal(kv.allocateSlots(table, 0, 3)!.length, 1);
    assert.equal(kv.allocateSlots(table, 3, 1)!.length, 0);
    assert.equal(kv.allocateSlots(table, 4, 1)!.length, 1);
    assert.deepEqual(table.blockIds, [0, 1]);
    assert.throws(() => kv.allocateSlots(table, 9, 1), /9 computed tokens but only 2 blocks/);
  });

  it('forks a table by sharing its leading blocks', () => {
    const kv = makeManager(6);
    const parent = computeSequence(kv, range(100, 10)).table;
    const child = kv.fork(parent, 2);
    assert.deepEqual(child.blockIds, [0, 1]);
    assert.deepEqual(refCounts(parent), [2, 2, 1]);
    assert.equal(child.numCachedBlocks, 2);
    kv.checkInvariants([parent, child]);
    kv.free(child);
    assert.deepEqual(refCounts(parent), [1, 1, 1]);
    assert.throws(() => kv.checkInvariants([parent, parent]), /refCount 1 but 2 tables hold it/);
  });

  it('lets a router rebuild the cached set by replaying events, matching the dump', () => {
    const kv = makeManager(5);
    const replayed = new Set<BlockHash>();
    let lastEventId = 0;
    const replay = (events: KvEvent[]): void => {
      for (const event of events) {
        assert.equal(event.eventId, lastEventId + 1, 'event ids increase by one');
        lastEventId = event.eventId;
        if (event.type === 'stored') event.blockHashes.forEach((h) => replayed.add(h));
        else if (event.type === 'removed') event.blockHashes.forEach((h) => replayed.delete(h));
        else replayed.clear();
      }
    };
    for (const start of [100, 200, 100, 300, 400, 200]) {
      const { table } = computeSequence(kv, range(start, 9 + (start % 7)));
      replay(kv.takeEvents());
      kv.free(table);
      assert.deepEqual([...replayed].sort(), kv.cachedBlockHashes().sort());
    }
    assert.ok(kv.stats().evictions > 0, 'the workload must evict to test removed events');
    assert.equal(kv.resetPrefixCache(), true);
    replay(kv.takeEvents());
    assert.equal(replayed.size, 0);
  });

  it('does no caching when prefix caching is off', () => {
    const kv = makeManager(8, { enablePrefixCaching: false });
    computeSequence(kv, range(100, 9));
    assert.equal(computeSequence(kv, range(100, 9)).hitTokens, 0);
    assert.deepEqual(kv.cachedBlockHashes(), []);
    assert.deepEqual(kv.takeEvents(), []);
  });

  it('counts no prefix-cache lookups when prefix caching is off', () => {
    const kv = makeManager(8, { enablePrefixCaching: false });
    computeSequence(kv, range(100, 9));
    computeSequence(kv, range(100, 9));
    const stats = kv.stats();
    assert.equal(stats.prefixQueryTokens, 0, 'nothing was looked up, so nothing was queried');
    assert.equal(stats.prefixHitTokens, 0);
  });
});
