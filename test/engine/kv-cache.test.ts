// Bottom two layers of the KV cache: the intrusive free queue and the block pool (ref counts, hash map, events).
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { BlockPool } from '../../src/engine/kv-cache/block-pool.ts';
import { FreeBlockQueue, KvBlock } from '../../src/engine/kv-cache/free-block-queue.ts';
import { parseBlockHash } from '../../src/protocols/kv-events.ts';
import type { BlockHash } from '../../src/protocols/kv-events.ts';

const hash = (n: number): BlockHash => parseBlockHash(n.toString(16).padStart(16, '0'));
const ids = (blocks: Iterable<KvBlock>): number[] => [...blocks].map((block) => block.id);

function makePool(numBlocks: number, blockSize = 4): BlockPool {
  return new BlockPool({ numBlocks, blockSize, enableEvents: true });
}

describe('FreeBlockQueue', () => {
  it('pops from the head and removes from the middle in O(1) links', () => {
    const blocks = [0, 1, 2, 3, 4].map((id) => new KvBlock(id));
    const queue = new FreeBlockQueue(blocks);
    assert.equal(queue.popFront()!.id, 0);
    queue.remove(blocks[2]!);
    assert.deepEqual(ids(queue), [1, 3, 4]);
    queue.pushFront(blocks[2]!);
    queue.pushBack(blocks[0]!);
    assert.deepEqual(ids(queue), [2, 1, 3, 4, 0]);
    assert.equal(queue.length, 5);
    assert.equal(blocks[2]!.prevFree !== null, true);
  });

  it('empties to null and refuses blocks that are not (or already) queued', () => {
    const block = new KvBlock(7);
    const queue = new FreeBlockQueue([block]);
    assert.throws(() => queue.pushBack(block), /already in the free queue/);
    assert.equal(queue.popFront(), block);
    assert.equal(queue.popFront(), null);
    assert.throws(() => queue.remove(block), /not in the free queue/);
    assert.equal(queue.length, 0);
  });
});

describe('BlockPool', () => {
  it('allocates from the head with one reference each, and returns null without side effects when short', () => {
    const pool = makePool(4);
    const first = pool.allocate(3)!;
    assert.deepEqual(ids(first), [0, 1, 2]);
    assert.deepEqual(first.map((block) => block.refCount), [1, 1, 1]);
    assert.equal(pool.numFreeBlocks, 1);
    assert.equal(pool.allocate(2), null);
    assert.equal(pool.numFreeBlocks, 1);
    assert.deepEqual(ids(pool.freeBlocksInEvictionOrder()), [3]);
    pool.checkInvariants();
  });

  it('frees hashed blocks to the tail in the order given and unhashed ones to the head', () => {
    const pool = makePool(4);
    const [b0, b1, b2, b3] = pool.allocate(4)!;
    pool.cacheBlocks([b0!, b1!], [hash(10), hash(11)]);
    pool.free([b3!, b2!, b1!, b0!]); // a sequence's blocks, tail first
    assert.deepEqual(ids(pool.freeBlocksInEvictionOrder()), [2, 3, 1, 0]);
    assert.equal(pool.getCachedBlock(hash(11)), b1);
    pool.checkInvariants();
  });

  it('keeps a block until its last reference is dropped', () => {
    const pool = makePool(2);
    const [block] = pool.allocate(1)!;
    pool.touch([block!]);
    assert.equal(block!.refCount, 2);
    pool.free([block!]);
    assert.equal(pool.numFreeBlocks, 1);
    pool.free([block!]);
    assert.equal(pool.numFreeBlocks, 2);
    assert.throws(() => pool.free([block!]), /refCount 0/);
  });

  it('evicts the hash of a cached free block it hands out, and says so in a removed event', () => {
    const pool = makePool(3);
    const [b0, b1, b2] = pool.allocate(3)!;
    pool.cacheBlocks([b0!, b1!, b2!], [hash(1), hash(2), hash(3)]);
    pool.free([b2!, b1!, b0!]);
    pool.takeEvents();
    const [reused] = pool.allocate(1)!;
    assert.equal(reused, b2);
    assert.equal(reused!.hash, null);
    assert.equal(pool.getCachedBlock(hash(3)), undefined);
    assert.equal(pool.evictions, 1);
    assert.deepEqual(pool.takeEvents(), [{ type: 'removed', eventId: 2, blockHashes: [hash(3)] }]);
    pool.checkInvariants();
  });

  it('takes a cached free block out of the middle of the queue when it is hit again', () => {
    const pool = makePool(4);
    const blocks = pool.allocate(4)!;
    pool.cacheBlocks(blocks, [hash(1), hash(2), hash(3), hash(4)]);
    pool.free([...blocks].reverse());
    const hit = pool.getCachedBlock(hash(2))!;
    pool.touch([hit]);
    assert.equal(hit.refCount, 1);
    assert.deepEqual(ids(pool.freeBlocksInEvictionOrder()), [3, 2, 0]);
    assert.equal(hit.hash, hash(2), 'a hit block keeps its hash');
    pool.checkInvariants();
  });

  it('emits stored events per contiguous run, skipping a hash another block already holds', () => {
    const pool = makePool(5);
    const [a0, a1] = pool.allocate(2)!;
    pool.cacheBlocks([a0!, a1!], [hash(1), hash(2)]);
    const [c0, c1, c2] = pool.allocate(3)!;
    // A chain after a0 whose second block c1 computed a1's hash at the same time: a1 keeps it, c1 stays unregistered.
    pool.cacheBlocks([a0!, c0!, c1!, c2!], [hash(1), hash(7), hash(2), hash(8)], 1, 4);
    assert.equal(c1!.hash, null);
    assert.equal(pool.numCachedBlocks, 4);
    assert.deepEqual(pool.takeEvents(), [
      { type: 'stored', eventId: 1, blockHashes: [hash(1), hash(2)], parentHash: null, tokenCount: 8, blockSize: 4 },
      { type: 'stored', eventId: 2, blockHashes: [hash(7)], parentHash: hash(1), tokenCount: 4, blockSize: 4 },
      { type: 'stored', eventId: 3, blockHashes: [hash(8)], parentHash: hash(2), tokenCount: 4, blockSize: 4 },
    ]);
    assert.deepEqual(pool.takeEvents(), []);
    assert.throws(() => pool.cacheBlocks([a1!], [hash(9)]), /already cached/);
  });

  it('resets only when no block is in use, then emits cleared', () => {
    const pool = makePool(2);
    const blocks = pool.allocate(2)!;
    pool.cacheBlocks(blocks, [hash(1), hash(2)]);
    assert.equal(pool.reset(), false);
    pool.free(blocks);
    pool.takeEvents();
    assert.equal(pool.reset(), true);
    assert.deepEqual(pool.cachedBlockHashes(), []);
    assert.equal(blocks[0]!.hash, null);
    assert.deepEqual(pool.takeEvents(), [{ type: 'cleared', eventId: 2 }]);
    pool.checkInvariants();
  });

  it('queues no events unless asked to', () => {
    const pool = new BlockPool({ numBlocks: 2, blockSize: 4 });
    const blocks = pool.allocate(2)!;
    pool.cacheBlocks(blocks, [hash(1), hash(2)]);
    assert.deepEqual(pool.takeEvents(), []);
  });

  it('detects a broken invariant', () => {
    const pool = makePool(3);
    const [block] = pool.allocate(1)!;
    block!.refCount = 0; // in use but claims to be free
    assert.throws(() => pool.checkInvariants(), /used \+ .* free/);
  });

  it('rejects a pool without blocks', () => {
    assert.throws(() => new BlockPool({ numBlocks: 0, blockSize: 16 }), /numBlocks must be a positive integer/);
  });
});
