// The middle layer of the KV cache: every block of the pool, their reference counts, the hash -> block map of the
// prefix cache, and the queue of KV events for the router. It knows nothing of requests; the manager above it
// decides which blocks a sequence needs.
//
// A block is in exactly one of three states:
//   in use        refCount > 0, not in the free queue, hash set if it is registered in the prefix cache
//   free, cached  refCount = 0, in the free queue, hash set: reusable by a prefix hit until evicted
//   free, empty   refCount = 0, in the free queue, no hash
// Allocation takes blocks from the head of the free queue; taking a cached one evicts its hash.

import type { BlockHash, KvEvent } from '../../protocols/kv-events.ts';
import { FreeBlockQueue, KvBlock } from './free-block-queue.ts';

export interface BlockPoolOptions {
  numBlocks: number;
  /** Tokens per block; only reported in events here. */
  blockSize: number;
  /** Queue KV events for takeEvents(). Off by default: nobody draining them would grow the queue forever. */
  enableEvents?: boolean;
  /** Told of each cached block evicted by an allocation (the lower tiers count those they never got). */
  onEvict?: (hash: BlockHash) => void;
}

export class BlockPool {
  readonly numBlocks: number;
  readonly blockSize: number;
  readonly blocks: readonly KvBlock[];
  private readonly freeQueue: FreeBlockQueue;
  private readonly cachedBlocks = new Map<BlockHash, KvBlock>();
  private readonly enableEvents: boolean;
  private pendingEvents: KvEvent[] = [];
  private nextEventId = 1;
  private numEvictions = 0;
  private readonly onEvict: ((hash: BlockHash) => void) | undefined;

  constructor(options: BlockPoolOptions) {
    const { numBlocks, blockSize } = options;
    if (!Number.isSafeInteger(numBlocks) || numBlocks < 1) throw new RangeError(`numBlocks must be a positive integer, got ${numBlocks}`);
    if (!Number.isSafeInteger(blockSize) || blockSize < 1) throw new RangeError(`blockSize must be a positive integer, got ${blockSize}`);
    this.numBlocks = numBlocks;
    this.blockSize = blockSize;
    this.blocks = Array.from({ length: numBlocks }, (_, id) => new KvBlock(id));
    this.freeQueue = new FreeBlockQueue(this.blocks);
    this.enableEvents = options.enableEvents ?? false;
    this.onEvict = options.onEvict;
  }

  get numFreeBlocks(): number {
    return this.freeQueue.length;
  }

  get numUsedBlocks(): number {
    return this.numBlocks - this.freeQueue.length;
  }

  /** Blocks registered in the prefix cache, in use or free. */
  get numCachedBlocks(): number {
    return this.cachedBlocks.size;
  }

  get evictions(): number {
    return this.numEvictions;
  }

  /** Free blocks from next evicted to last evicted. */
  freeBlocksInEvictionOrder(): KvBlock[] {
    return [...this.freeQueue];
  }

  /** The same, lazily: what the lower tiers walk to copy down the next blocks to be evicted. */
  freeBlocksFromHead(): Iterable<KvBlock> {
    return this.freeQueue;
  }

  getCachedBlock(hash: BlockHash): KvBlock | undefined {
    return this.cachedBlocks.get(hash);
  }

  // -------------------------------------------------------------------------------------------------------------
  // Reference counting

  /** Takes one more reference on each block; a free block leaves the free queue (a prefix hit, or a fork). */
  touch(blocks: readonly KvBlock[]): void {
    for (const block of blocks) {
      if (block.refCount === 0) this.freeQueue.remove(block);
      block.refCount++;
    }
  }

  /** `count` blocks with one reference each, or null when fewer are free: the caller preempts or waits. */
  allocate(count: number): KvBlock[] | null {
    if (count > this.freeQueue.length) return null;
    const allocated: KvBlock[] = [];
    const evicted: BlockHash[] = [];
    for (let i = 0; i < count; i++) {
      const block = this.freeQueue.popFront()!;
      if (block.refCount !== 0) throw new Error(`free block ${block.id} has refCount ${block.refCount}`);
      if (block.hash !== null) {
        evicted.push(block.hash);
        this.cachedBlocks.delete(block.hash);
        this.onEvict?.(block.hash);
        block.hash = null;
        block.parentHash = null;
      }
      block.refCount = 1;
      allocated.push(block);
    }
    if (evicted.length > 0) {
      this.numEvictions += evicted.length;
      this.emit({ type: 'removed', eventId: 0, blockHashes: evicted });
    }
    return allocated;
  }

  /**
   * Drops one reference from each block, in the order given: of the blocks that become free, the first given is
   * evicted first. Blocks without a hash hold nothing reusable and go to the head, so cached blocks outlive them.
   */
  free(blocksInEvictionOrder: readonly KvBlock[]): void {
    for (const block of blocksInEvictionOrder) {
      if (block.refCount <= 0) throw new Error(`block ${block.id} freed with refCount ${block.refCount}`);
      block.refCount--;
      if (block.refCount > 0) continue;
      if (block.hash === null) this.freeQueue.pushFront(block);
      else this.freeQueue.pushBack(block);
    }
  }

  // -------------------------------------------------------------------------------------------------------------
  // Prefix cache

  /**
   * Registers computed full blocks under their chained hashes: blocks[i] gets hashes[i] for i in [start, end), and
   * hashes[start - 1] is the parent of the first. A hash already held by another block (two sequences computed the
   * same prefix at once) is left to that block: this one stays unregistered.
   */
  cacheBlocks(blocks: readonly KvBlock[], hashes: readonly BlockHash[], start = 0, end = blocks.length): void {
    if (end > blocks.length || end > hashes.length || start < 0) {
      throw new RangeError(`blocks [${start}, ${end}) of ${blocks.length} blocks and ${hashes.length} hashes`);
    }
    let runStart = -1;
    for (let i = start; i < end; i++) {
      const block = blocks[i]!;
      const hash = hashes[i]!;
      if (block.refCount === 0) throw new Error(`cannot cache free block ${block.id}`);
      const registrable = block.hash === null && !this.cachedBlocks.has(hash);
      if (block.hash !== null && block.hash !== hash) throw new Error(`block ${block.id} already cached as ${block.hash}, not ${hash}`);
      if (!registrable) {
        if (runStart >= 0) this.emitStored(hashes, runStart, i);
        runStart = -1;
        continue;
      }
      block.hash = hash;
      block.parentHash = i === 0 ? null : hashes[i - 1]!;
      this.cachedBlocks.set(hash, block);
      if (runStart < 0) runStart = i;
    }
    if (runStart >= 0) this.emitStored(hashes, runStart, end);
  }

  private emitStored(hashes: readonly BlockHash[], start: number, end: number): void {
    if (!this.enableEvents) return;
    this.emit({
      type: 'stored', eventId: 0, blockHashes: hashes.slice(start, end), parentHash: start === 0 ? null : hashes[start - 1]!,
      tokenCount: (end - start) * this.blockSize, blockSize: this.blockSize,
    });
  }

  /** Hashes of every cached block, in use or free: what a router resyncs its index from. */
  cachedBlockHashes(): BlockHash[] {
    return [...this.cachedBlocks.keys()];
  }

  /**
   * Forgets every cached prefix (after a weight reload, or on demand). Only possible when no block is in use,
   * since a running sequence may still register its blocks; returns false otherwise.
   */
  reset(): boolean {
    if (this.numUsedBlocks > 0) return false;
    for (const block of this.cachedBlocks.values()) {
      block.hash = null;
      block.parentHash = null;
    }
    this.cachedBlocks.clear();
    this.emit({ type: 'cleared', eventId: 0 });
    return true;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Events

  /** Events since the last call, in order, with increasing ids. */
  takeEvents(): KvEvent[] {
    const events = this.pendingEvents;
    this.pendingEvents = [];
    return events;
  }

  /** Queues an event made outside the pool (the lower tiers'), in the same id sequence as the pool's own. */
  emitExternal(event: KvEvent): void {
    this.emit(event);
  }

  private emit(event: KvEvent): void {
    if (!this.enableEvents) return;
    event.eventId = this.nextEventId++;
    this.pendingEvents.push(event);
  }

  // -------------------------------------------------------------------------------------------------------------
  // Invariants

  /** Throws if the free queue, the reference counts and the hash map disagree. O(numBlocks): for tests. */
  checkInvariants(): void {
    let numFree = 0;
    for (const block of this.freeQueue) {
      if (block.refCount !== 0) throw new Error(`block ${block.id} is in the free queue with refCount ${block.refCount}`);
      numFree++;
    }
    if (numFree !== this.freeQueue.length) throw new Error(`free queue holds ${numFree} blocks but counts ${this.freeQueue.length}`);
    let numInUse = 0;
    for (const block of this.blocks) {
      if (block.refCount < 0) throw new Error(`block ${block.id} has refCount ${block.refCount}`);
      if (block.refCount > 0) {
        numInUse++;
        if (block.prevFree !== null || block.nextFree !== null) throw new Error(`block ${block.id} is in use and linked in the free queue`);
      }
      if (block.hash !== null && this.cachedBlocks.get(block.hash) !== block) {
        throw new Error(`block ${block.id} carries hash ${block.hash} that the cache maps elsewhere`);
      }
    }
    if (numInUse + numFree !== this.numBlocks) throw new Error(`${numInUse} used + ${numFree} free != ${this.numBlocks} blocks`);
    for (const [hash, block] of this.cachedBlocks) {
      if (block.hash !== hash) throw new Error(`cache maps ${hash} to block ${block.id}, which carries ${block.hash}`);
    }
  }
}
