// The bottom layer of the KV cache: blocks and the queue of free ones.
//
// Why an intrusive doubly linked list rather than an array or a Set: a free block that still holds a cached prefix
// can be hit again by a new request, and must then leave the queue from wherever it sits. With the links stored on
// the block itself, removal from the middle, push at either end and pop from the head are all O(1) with no
// allocation, and the queue order is exactly the eviction order (head = evicted first).

import type { BlockHash } from '../../protocols/kv-events.ts';

/** One fixed-size block of the paged KV pool: the bookkeeping only; the bytes live in the backend's pool. */
export class KvBlock {
  readonly id: number;
  /** Number of sequences whose block table holds this block; 0 means it sits in the free queue. */
  refCount = 0;
  /** Set while the block is registered in the prefix cache (full, computed, and the first block with this hash). */
  hash: BlockHash | null = null;
  /** The hash of the block before this one in its chain while registered (null: the first block, or unregistered). */
  parentHash: BlockHash | null = null;
  /** Free-queue links, null while the block is in use. */
  prevFree: KvBlock | null = null;
  nextFree: KvBlock | null = null;

  constructor(id: number) {
    this.id = id;
  }
}

export class FreeBlockQueue {
  /** Sentinels: every real block in the queue has both links set, which removes the edge cases from the code. */
  private readonly head = new KvBlock(-1);
  private readonly tail = new KvBlock(-1);
  private count = 0;

  constructor(blocks: readonly KvBlock[] = []) {
    this.head.nextFree = this.tail;
    this.tail.prevFree = this.head;
    for (const block of blocks) this.pushBack(block);
  }

  get length(): number {
    return this.count;
  }

  /** Removes and returns the block to evict next, or null when the queue is empty. */
  popFront(): KvBlock | null {
    const first = this.head.nextFree!;
    if (first === this.tail) return null;
    this.remove(first);
    return first;
  }

  remove(block: KvBlock): void {
    const { prevFree, nextFree } = block;
    if (prevFree === null || nextFree === null) throw new Error(`block ${block.id} is not in the free queue`);
    prevFree.nextFree = nextFree;
    nextFree.prevFree = prevFree;
    block.prevFree = null;
    block.nextFree = null;
    this.count--;
  }

  /** Evicted last of the blocks now free. */
  pushBack(block: KvBlock): void {
    this.insertBetween(block, this.tail.prevFree!, this.tail);
  }

  /** Evicted first. */
  pushFront(block: KvBlock): void {
    this.insertBetween(block, this.head, this.head.nextFree!);
  }

  /** Blocks from head (next evicted) to tail; for tests and invariant checks. */
  *[Symbol.iterator](): IterableIterator<KvBlock> {
    for (let block = this.head.nextFree!; block !== this.tail; block = block.nextFree!) yield block;
  }

  private insertBetween(block: KvBlock, before: KvBlock, after: KvBlock): void {
    if (block.prevFree !== null || block.nextFree !== null) throw new Error(`block ${block.id} is already in the free queue`);
    block.prevFree = before;
    block.nextFree = after;
    before.nextFree = block;
    after.prevFree = block;
    this.count++;
  }
}
