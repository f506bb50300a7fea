// The top layer of the KV cache: what a sequence needs. It maps a sequence's token positions onto blocks (its
// block table), finds the longest cached prefix on admission, registers blocks in the prefix cache once they are
// computed, shares prompt blocks between the n samples of a request, and gives blocks back on finish or
// preemption. Below it, the block pool owns reference counts and the hash map; below that, the free queue.
//
// Sliding-window attention (a model whose every layer attends only to its last `slidingWindow` positions): a
// sequence's leading blocks that fall before the window of its next token are read by no later step, so
// releaseOutsideWindow gives them back while the sequence runs. They stay in its table as released entries (the
// table still maps positions to blocks by index; the backends never read a position outside the window, so those
// ids are never dereferenced). A released block keeps its hash and KV until the pool reuses it, so a later prefix
// hit on it is as valid as on any free cached block; once reused its hash is gone and lookups stop before it.

import { BlockPool } from './block-pool.ts';
import { encodeExtraKeys, extendBlockHashes } from '../../protocols/block-hash.ts';
import { DEFAULT_BLOCK_SIZE, type BlockHashExtraKeys, type EncodedExtraKeys } from '../../protocols/block-hash.ts';
import type { BlockHash, KvEvent } from '../../protocols/kv-events.ts';
import type { KvBlock } from './free-block-queue.ts';
import type { KvBlockIo, KvTiers, KvTiersStats, OnboardPlan, OnboardSummary } from './tiers.ts';

export interface KvCacheConfig {
  /** Blocks in the pool (the caller sizes it from a memory budget with kvPoolBytes). */
  numBlocks: number;
  /** Tokens per block (default 16). */
  blockSize?: number;
  /** Reuse computed full blocks across requests (default true). */
  enablePrefixCaching?: boolean;
  /** Queue KV events for takeEvents() (default false). */
  enableEvents?: boolean;
  /** Lower tiers (RAM, disk) under the pool: evicted blocks are copied down and onboarded back (tiers.ts). */
  tiers?: KvTiers;
  /** The pool's bytes, for the tiers to copy blocks out of and into (none in the simulator: nothing to copy). */
  blockIo?: KvBlockIo;
  /**
   * The model's sliding window when every layer has one (ModelConfig uniformWindow): blocks before it can be given
   * back (releaseOutsideWindow). Absent: full attention somewhere, every block is kept.
   */
  slidingWindow?: number;
}

export interface KvCacheStats {
  numBlocks: number;
  blockSize: number;
  numUsedBlocks: number;
  numFreeBlocks: number;
  /** Blocks holding a reusable prefix, in use or free. */
  numCachedBlocks: number;
  /** Fraction of blocks in use, 0..1. */
  usage: number;
  /** Tokens looked up in the prefix cache on admission, and how many of them were found. */
  prefixQueryTokens: number;
  prefixHitTokens: number;
  /** Cached blocks overwritten by new allocations. */
  evictions: number;
  /** The lower tiers' figures, when there are any. */
  tiers?: KvTiersStats;
}

/** One sequence's blocks in position order: block i holds positions [i * blockSize, (i + 1) * blockSize). */
export class BlockTable {
  private readonly list: KvBlock[] = [];
  /** blocks[i].id at i: the batch builder copies block ids in one call instead of reading each block. */
  private ids = new Int32Array(8);
  /**
   * Chained hashes of the sequence's full blocks, computed as far as a lookup or registration needed. They depend
   * on the tokens alone, so they survive preemption and make the resumed sequence find its own blocks.
   */
  readonly blockHashes: BlockHash[] = [];
  /** Leading blocks already offered to the prefix cache (hit, registered, or lost to a duplicate). */
  numCachedBlocks = 0;
  /**
   * Leading blocks given back because they fell out of the sliding window (releaseOutsideWindow): their entries stay
   * for the position arithmetic but the table holds no reference on them.
   */
  numReleasedBlocks = 0;
  /** Set by allocateSlots when the table's last block is to start as a copy of a cached one; the scheduler takes it. */
  pendingCopy: KvBlockCopy | null = null;
  /** Set by allocateSlots when blocks were onboarded from lower tiers; the scheduler takes it. */
  onboarded: OnboardSummary | null = null;
  readonly extraKeys: EncodedExtraKeys;

  constructor(extraKeys: EncodedExtraKeys) {
    this.extraKeys = extraKeys;
  }

  /** Changed only through append and clear, which keep the id mirror in step. */
  get blocks(): readonly KvBlock[] {
    return this.list;
  }

  get blockIds(): number[] {
    return this.blocks.map((block) => block.id);
  }

  /** The blocks the table holds a reference on: all of them, less the released leading ones. */
  get heldBlocks(): readonly KvBlock[] {
    return this.numReleasedBlocks === 0 ? this.list : this.list.slice(this.numReleasedBlocks);
  }

  /** Ids of the first numBlocks blocks, as a view valid until the table changes. */
  blockIdArray(numBlocks = this.blocks.length): Int32Array {
    if (numBlocks > this.blocks.length) throw new RangeError(`table holds ${this.blocks.length} blocks, not ${numBlocks}`);
    return this.ids.subarray(0, numBlocks);
  }

  /** The manager's: it owns the reference counting that goes with a block entering a table. */
  append(block: KvBlock): void {
    if (this.list.length === this.ids.length) {
      const grown = new Int32Array(2 * this.ids.length);
      grown.set(this.ids);
      this.ids = grown;
    }
    this.ids[this.list.length] = block.id;
    this.list.push(block);
  }

  /** The manager's, after it has released the blocks. */
  clear(): void {
    this.list.length = 0;
    this.numCachedBlocks = 0;
    this.numReleasedBlocks = 0;
    this.pendingCopy = null;
    this.onboarded = null;
  }
}

const NO_BLOCKS: readonly KvBlock[] = Object.freeze([]);

/**
 * References held on blocks outside any block table: a prefill worker keeps a handed-off request's blocks in use
 * until the decode worker has copied them, although the request itself is gone from its scheduler.
 */
export interface KvPin {
  readonly blocks: readonly KvBlock[];
}

/** The cached blocks a sequence can start from. */
export interface CachedPrefix {
  /** Cached blocks the sequence's table starts with, shared as they are. */
  blocks: KvBlock[];
  /**
   * A cached block whose KV the sequence's next block starts as a copy of (copy-on-write), or undefined. Set when
   * every token is cached and the last one ends a block: that block cannot be shared, since the step writes the
   * last token's KV into it, but its other positions need not be computed.
   */
  copySource?: KvBlock;
  /**
   * Blocks after `blocks` found in lower tiers and worth bringing back (cost model): allocateSlots reads them and
   * writes them into fresh blocks, which then count as computed.
   */
  onboard?: OnboardPlan;
  /**
   * Set by allocateSlots when a block of `onboard` was gone or unreadable by then (it returned null for that, not
   * for want of room): look the prefix up again, which plans without that block.
   */
  stale?: boolean;
  /**
   * The tokens the sequence need not compute: blocks.length * blockSize, plus blockSize - 1 with a copy source,
   * plus the onboarded blocks' tokens.
   */
  numTokens: number;
  /** Tokens the sequence had when it looked (for hit-rate statistics). */
  numQueryTokens: number;
}

/**
 * A pending copy of one block's KV into another, every layer's K and V, made by whoever owns the pool's bytes
 * before the step's forward pass. The source is pinned until then (releaseBlockCopy), so nothing can evict and
 * overwrite it even if the sequence that asked for the copy is aborted meanwhile.
 */
export interface KvBlockCopy {
  readonly source: KvBlock;
  readonly destination: KvBlock;
  readonly pin: KvPin;
}

export class KvCacheManager {
  readonly blockSize: number;
  readonly numBlocks: number;
  readonly enablePrefixCaching: boolean;
  readonly pool: BlockPool;
  readonly tiers: KvTiers | undefined;
  readonly slidingWindow: number | undefined;
  private prefixQueryTokens = 0;
  private prefixHitTokens = 0;
  private readonly pins = new Set<KvPin>();

  constructor(config: KvCacheConfig) {
    this.blockSize = config.blockSize ?? DEFAULT_BLOCK_SIZE;
    const tiers = config.tiers?.enabled ? config.tiers : undefined;
    this.pool = new BlockPool({
      numBlocks: config.numBlocks, blockSize: this.blockSize, enableEvents: config.enableEvents,
      ...(tiers !== undefined ? { onEvict: (hash: BlockHash) => tiers.primaryEvicted(hash) } : {}),
    });
    this.numBlocks = this.pool.numBlocks;
    this.enablePrefixCaching = config.enablePrefixCaching ?? true;
    if (config.slidingWindow !== undefined && !(Number.isSafeInteger(config.slidingWindow) && config.slidingWindow > 0)) {
      throw new RangeError(`slidingWindow must be a positive integer, got ${config.slidingWindow}`);
    }
    this.slidingWindow = config.slidingWindow;
    this.tiers = this.enablePrefixCaching ? tiers : undefined;
    this.tiers?.attach(config.blockIo, (event) => this.pool.emitExternal(event), this.blockSize);
  }

  /** An empty table for a new sequence; extra keys (cache salt, adapter) enter every block hash. */
  createTable(extraKeys: BlockHashExtraKeys = {}): BlockTable {
    return new BlockTable(encodeExtraKeys(extraKeys));
  }

  /** Blocks that hold numTokens tokens. */
  blocksFor(numTokens: number): number {
    return Math.ceil(numTokens / this.blockSize);
  }

  // -------------------------------------------------------------------------------------------------------------
  // Admission

  /**
   * The longest run of cached full blocks at the start of tokenIds. The last token is never taken from the
   * cache, even when the whole sequence is: the step must compute at least one token to produce the logits the
   * next token is sampled from. When the last token ends a cached block, that block becomes the copy source of
   * a fresh one (copy-on-write, unless copyOnWrite is false), so only the last token is computed rather than its
   * whole block. Nothing is reserved: pass the result to allocateSlots in the same step. With reuse false nothing is
   * looked up (a request that needs every position's logits): the prefix is empty and counts no queried tokens (the
   * hit rate is that of the lookups made, as vLLM counts it). prefillChunkTokens, the most prompt tokens one step
   * computes (the scheduler's chunking), lets the lower tiers' cost model count the steps a recompute would add.
   */
  findCachedPrefix(table: BlockTable, tokenIds: ArrayLike<number>,
    options: { copyOnWrite?: boolean; lowerTiers?: boolean; reuse?: boolean; prefillChunkTokens?: number } = {}): CachedPrefix {
    const blocks: KvBlock[] = [];
    let copySource: KvBlock | undefined;
    let onboard: OnboardPlan | undefined;
    if (this.enablePrefixCaching && tokenIds.length > 0 && (options.reuse ?? true)) {
      const numFullBlocks = Math.floor(tokenIds.length / this.blockSize);
      const maxBlocks = Math.floor((tokenIds.length - 1) / this.blockSize);
      // Only a sequence ending exactly on a block boundary has a full block beyond maxBlocks worth looking up. Its
      // copy takes one block more than the sequence (the source stays while the copy is made): a sequence as long
      // as the pool would never fit that way, so its last block is computed instead.
      const copyOnWrite = (options.copyOnWrite ?? true) && numFullBlocks < this.numBlocks;
      const numLookups = copyOnWrite ? numFullBlocks : maxBlocks;
      extendBlockHashes(table.blockHashes, tokenIds, this.blockSize, table.extraKeys, numLookups);
      for (let i = 0; i < numLookups; i++) {
        const block = this.pool.getCachedBlock(table.blockHashes[i]!);
        if (block === undefined) break;
        if (i === maxBlocks) copySource = block;
        else blocks.push(block);
      }
      // Past the primary hits, the lower tiers may hold the next blocks (never the last token's block: no copy-on-write
      // from a lower tier, that block is computed).
      if (this.tiers !== undefined && (options.lowerTiers ?? true) && copySource === undefined && blocks.length < maxBlocks) {
        onboard = this.tiers.planOnboard(table.blockHashes, blocks.length, maxBlocks, this.blockSize, tokenIds.length, options.prefillChunkTokens);
      }
    }
    const numOnboarded = onboard?.hashes.length ?? 0;
    const numTokens = copySource === undefined ? (blocks.length + numOnboarded) * this.blockSize : tokenIds.length - 1;
    return {
      blocks, ...(copySource === undefined ? {} : { copySource }), ...(onboard === undefined ? {} : { onboard }),
      // With prefix caching off nothing was looked up, so nothing counts as queried (vLLM records no lookup then):
      // the query counter would otherwise grow with every prompt while hits stay 0, a 0% hit rate for no cache.
      numTokens, numQueryTokens: this.enablePrefixCaching && (options.reuse ?? true) ? tokenIds.length : 0,
    };
  }

  /**
   * Makes the table cover numComputedTokens + numNewTokens positions. With a prefix (admission of an empty table),
   * the prefix blocks come first and numComputedTokens must equal prefix.numTokens; with a copy source, the next
   * block is a fresh one and table.pendingCopy says what to copy into it (the source is pinned until
   * releaseBlockCopy). Returns the newly allocated blocks, or null when the pool has too few free blocks: then
   * nothing changed and the caller preempts or waits.
   */
  allocateSlots(table: BlockTable, numComputedTokens: number, numNewTokens: number, prefix?: CachedPrefix): readonly KvBlock[] | null {
    // Most decode steps stay inside the last block: nothing to check or allocate.
    if (prefix === undefined && numComputedTokens + numNewTokens <= table.blocks.length * this.blockSize
      && numNewTokens >= 0 && numComputedTokens >= 0) return NO_BLOCKS;
    if (!Number.isSafeInteger(numNewTokens) || numNewTokens < 0) throw new RangeError(`numNewTokens must be >= 0, got ${numNewTokens}`);
    const prefixBlocks = prefix?.blocks ?? NO_BLOCKS;
    const copySource = prefix?.copySource;
    if (prefix !== undefined) {
      if (table.blocks.length !== 0) throw new Error('a cached prefix can only start an empty block table');
      if (numComputedTokens !== prefix.numTokens) {
        throw new Error(`numComputedTokens ${numComputedTokens} differs from the cached prefix's ${prefix.numTokens}`);
      }
      if (copySource === undefined && numComputedTokens !== (prefixBlocks.length + (prefix.onboard?.hashes.length ?? 0)) * this.blockSize) {
        throw new Error(`numComputedTokens ${numComputedTokens} is not the cached prefix's blocks`);
      }
      if (copySource !== undefined && (numNewTokens < 1 || numComputedTokens !== (prefixBlocks.length + 1) * this.blockSize - 1)) {
        throw new Error(`a copied block holds the ${this.blockSize - 1} positions before the last token: `
          + `${numComputedTokens} computed and ${numNewTokens} new tokens after ${prefixBlocks.length} shared blocks do not fit it`);
      }
    } else if (this.blocksFor(numComputedTokens) > table.blocks.length) {
      throw new Error(`${numComputedTokens} computed tokens but only ${table.blocks.length} blocks in the table`);
    }
    const numRequired = this.blocksFor(numComputedTokens + numNewTokens);
    const numToAllocate = Math.max(0, numRequired - table.blocks.length - prefixBlocks.length);
    // Prefix blocks (and a copy source) that are free leave the free queue when taken, so they cannot also count
    // as room.
    let numFreePrefixBlocks = copySource !== undefined && copySource.refCount === 0 ? 1 : 0;
    for (const block of prefixBlocks) if (block.refCount === 0) numFreePrefixBlocks++;
    if (numToAllocate > this.pool.numFreeBlocks - numFreePrefixBlocks) return null;
    // Lower-tier blocks are read (and checked) before anything changes: one gone or unreadable meanwhile leaves the
    // table as it was, and the next lookup plans without it.
    const onboard = prefix?.onboard;
    const onboardStart = onboard !== undefined && onboard.hashes.length > 0 ? this.tiers!.stamp() : 0;
    const fetched = onboard !== undefined && onboard.hashes.length > 0 ? this.tiers!.fetch(onboard) : undefined;
    if (fetched === null) {
      prefix!.stale = true;
      return null;
    }

    // Pinned before allocating: a free copy source would otherwise be the next block the allocation evicts.
    const copyPin = copySource !== undefined ? this.pinBlocks([copySource]) : null;
    if (prefix !== undefined) {
      this.pool.touch(prefixBlocks);
      for (const block of prefixBlocks) table.append(block);
      table.numCachedBlocks = prefixBlocks.length;
      this.countLookup(prefix);
    }
    const allocated = numToAllocate > 0 ? this.pool.allocate(numToAllocate)! : NO_BLOCKS;
    // The pool changes under the tiers: the next idle sweep decides afresh what goes down.
    if (numToAllocate > 0) this.tiers?.allocated();
    for (const block of allocated) table.append(block);
    if (onboard !== undefined) this.tiers!.noteRecomputed(onboard.numRecomputed);
    if (fetched !== undefined) {
      // The onboarded blocks are the first allocated ones, right after the shared prefix: filled, then registered
      // (their KV is there now), so they are as good as computed.
      const numOnboarded = fetched.blocks.length;
      const ids = allocated.slice(0, numOnboarded).map((block) => block.id);
      table.onboarded = this.tiers!.writeOnboarded(fetched, onboard!.hashes, ids, onboardStart);
      const end = prefixBlocks.length + numOnboarded;
      this.pool.cacheBlocks(table.blocks, table.blockHashes, prefixBlocks.length, end);
      table.numCachedBlocks = end;
    }
    if (copyPin !== null) {
      // The copy is not marked cached: cacheComputedBlocks offers it under its hash once computed, and the pool
      // keeps it unregistered while the source still holds that hash (no duplicate, no extra KV event).
      table.pendingCopy = { source: copySource!, destination: table.blocks[prefixBlocks.length]!, pin: copyPin };
    }
    return allocated;
  }

  /**
   * Starts an empty table with blocks that already hold KV: the cached prefix (shared, as allocateSlots would take
   * it, counted as prefix hits) and then `filled`, blocks of this pool reserved earlier (reserveBlocks) whose KV was
   * written in place, one more reference each. The caller drops the reservation afterwards; the filled blocks are
   * not cached yet (cacheComputedBlocks offers them under their hashes).
   */
  adoptFilledBlocks(table: BlockTable, prefix: CachedPrefix, filled: readonly KvBlock[]): void {
    if (table.blocks.length !== 0) throw new Error('filled blocks can only start an empty block table');
    if (prefix.copySource !== undefined || prefix.onboard !== undefined) throw new Error('filled blocks follow shared prefix blocks only');
    this.pool.touch(prefix.blocks);
    for (const block of prefix.blocks) table.append(block);
    table.numCachedBlocks = prefix.blocks.length;
    this.countLookup(prefix);
    this.pool.touch(filled);
    for (const block of filled) table.append(block);
  }

  /**
   * The prefix-cache statistics of a prefix taken: its queried tokens, and its hits when it queried any. A prefix
   * with numQueryTokens 0 is not a lookup for the hit rate (nothing looked up, or a handed-off prompt, whose lookup
   * was the prefill worker's: Scheduler.adoptRequest), so its blocks are not hits either.
   */
  private countLookup(prefix: CachedPrefix): void {
    if (prefix.numQueryTokens === 0) return;
    this.prefixQueryTokens += prefix.numQueryTokens;
    this.prefixHitTokens += prefix.numTokens;
  }

  /** The copy is made (or no longer needed): the source's pin goes, and the block is evictable again once free. */
  releaseBlockCopy(copy: KvBlockCopy): void {
    this.unpin(copy.pin);
  }

  // -------------------------------------------------------------------------------------------------------------
  // After a step

  /** Registers the full blocks among the first numComputedTokens positions, which the step has now written. */
  cacheComputedBlocks(table: BlockTable, tokenIds: ArrayLike<number>, numComputedTokens: number): void {
    if (!this.enablePrefixCaching) return;
    const numFull = Math.min(Math.floor(numComputedTokens / this.blockSize), table.blocks.length);
    const start = table.numCachedBlocks;
    if (numFull <= start) return;
    extendBlockHashes(table.blockHashes, tokenIds, this.blockSize, table.extraKeys, numFull);
    this.pool.cacheBlocks(table.blocks, table.blockHashes, start, numFull);
    table.numCachedBlocks = numFull;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Sliding window

  /**
   * Gives back the table's leading blocks that hold only positions before the window of the token at
   * numComputedTokens (the next one computed), which no later step of this sequence reads; returns how many were
   * released now. Nothing without a sliding window. With prefix caching, only blocks already offered to the cache are
   * released (a released block must not be registered later). The caller decides when a sequence may release: not
   * while another table will still be made from its blocks (a fork of its prompt, a handoff of its KV). The pool
   * still bounds a sequence's length (Scheduler.maxModelLen): a preempted sequence is recomputed whole.
   */
  releaseOutsideWindow(table: BlockTable, numComputedTokens: number): number {
    if (this.slidingWindow === undefined) return 0;
    const firstNeeded = numComputedTokens - this.slidingWindow + 1;
    let end = Math.min(Math.floor(Math.max(0, firstNeeded) / this.blockSize), table.blocks.length);
    if (this.enablePrefixCaching) end = Math.min(end, table.numCachedBlocks);
    const start = table.numReleasedBlocks;
    if (end <= start) return 0;
    // Last block first, as free() does: a prefix hit needs the blocks from the start on, so the earliest one should
    // be the last evicted.
    this.pool.free(table.blocks.slice(start, end).reverse());
    table.numReleasedBlocks = end;
    return end - start;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Sharing and release

  /** A new table sharing the first numSharedBlocks blocks of `table` (one more reference each). */
  fork(table: BlockTable, numSharedBlocks: number): BlockTable {
    if (numSharedBlocks > table.blocks.length) {
      throw new RangeError(`cannot share ${numSharedBlocks} blocks of a table holding ${table.blocks.length}`);
    }
    const child = new BlockTable(table.extraKeys);
    const shared = table.blocks.slice(0, numSharedBlocks);
    child.numReleasedBlocks = Math.min(table.numReleasedBlocks, numSharedBlocks);
    this.pool.touch(shared.slice(child.numReleasedBlocks));
    for (const block of shared) child.append(block);
    for (const hash of table.blockHashes.slice(0, numSharedBlocks)) child.blockHashes.push(hash);
    child.numCachedBlocks = Math.min(table.numCachedBlocks, numSharedBlocks);
    return child;
  }

  /**
   * Gives back every block of the table. Tail blocks are freed first so they are evicted first: a later request
   * is far more likely to share a sequence's beginning (system prompt, conversation so far) than its end.
   */
  free(table: BlockTable): void {
    this.pool.free(table.heldBlocks.slice().reverse());
    table.clear();
  }

  // -------------------------------------------------------------------------------------------------------------
  // Pins (disaggregated prefill: blocks outlive their sequence until copied elsewhere)

  /** One more reference on the first numBlocks blocks of the table, kept until unpin: freeing the table then leaves them in use. */
  pin(table: BlockTable, numBlocks = table.blocks.length): KvPin {
    if (!Number.isSafeInteger(numBlocks) || numBlocks < 0 || numBlocks > table.blocks.length) {
      throw new RangeError(`cannot pin ${numBlocks} blocks of a table holding ${table.blocks.length}`);
    }
    if (numBlocks > 0 && table.numReleasedBlocks > 0) {
      throw new Error(`cannot pin blocks of a table that released ${table.numReleasedBlocks} blocks outside its window`);
    }
    return this.pinBlocks(table.blocks.slice(0, numBlocks));
  }

  /**
   * Pins the leading blocks of `hashes` this pool holds cached (stopping at the first it lacks), so nothing evicts
   * them until unpin; null when the first is not cached (or prefix caching is off). A decode worker holds its own
   * hits on a handed-off prompt this way while the rest of the prompt's KV comes over the network.
   */
  pinCachedPrefix(hashes: readonly BlockHash[]): KvPin | null {
    if (!this.enablePrefixCaching) return null;
    const blocks: KvBlock[] = [];
    for (const hash of hashes) {
      const block = this.pool.getCachedBlock(hash);
      if (block === undefined) break;
      blocks.push(block);
    }
    return blocks.length > 0 ? this.pinBlocks(blocks) : null;
  }

  /**
   * `count` fresh blocks (evicting cached free ones as an allocation does), pinned until unpin: a decode worker has
   * a handed-off prompt's KV written straight into them, and its adoption then takes them (adoptFilledBlocks).
   * Null when fewer are free.
   */
  reserveBlocks(count: number): KvPin | null {
    if (!Number.isSafeInteger(count) || count < 0) throw new RangeError(`count must be >= 0, got ${count}`);
    const blocks = count > 0 ? this.pool.allocate(count) : [];
    if (blocks === null) return null;
    if (count > 0) this.tiers?.allocated();
    const pin: KvPin = { blocks };
    this.pins.add(pin);
    return pin;
  }

  private pinBlocks(blocks: readonly KvBlock[]): KvPin {
    const pin: KvPin = { blocks };
    this.pool.touch(pin.blocks);
    this.pins.add(pin);
    return pin;
  }

  /** Drops the pin's references (tail first, as free does); false if it was already dropped. */
  unpin(pin: KvPin): boolean {
    if (!this.pins.delete(pin)) return false;
    this.pool.free(pin.blocks.slice().reverse());
    return true;
  }

  get numPins(): number {
    return this.pins.size;
  }

  /**
   * Chained hashes of the full blocks among the first numTokens tokens, computed as far as needed (also with prefix
   * caching off, where nothing else computes them): what a handoff carries so the receiver can check its own.
   */
  fullBlockHashes(table: BlockTable, tokenIds: ArrayLike<number>, numTokens: number): BlockHash[] {
    const numFull = Math.floor(numTokens / this.blockSize);
    extendBlockHashes(table.blockHashes, tokenIds, this.blockSize, table.extraKeys, numFull);
    return table.blockHashes.slice(0, numFull);
  }

  // -------------------------------------------------------------------------------------------------------------
  // Events, stats, invariants

  takeEvents(): KvEvent[] {
    return this.pool.takeEvents();
  }

  cachedBlockHashes(): BlockHash[] {
    return this.pool.cachedBlockHashes();
  }

  /** Forgets every cached prefix (and the RAM tier's blocks); false (and nothing done) while any block is in use. */
  resetPrefixCache(): boolean {
    if (!this.pool.reset()) return false;
    this.tiers?.resetMemory();
    return true;
  }

  /**
   * Copies the next cached blocks the pool would evict down to the lower tiers (at most the tiers' per-call bound);
   * returns how many were copied. Called between steps, never inside one.
   */
  offloadEvictable(maxBlocks?: number, window?: number): number {
    return this.tiers?.offload(this.pool.freeBlocksFromHead(), maxBlocks, window) ?? 0;
  }

  get numFreeBlocks(): number {
    return this.pool.numFreeBlocks;
  }

  stats(): KvCacheStats {
    const { pool } = this;
    return {
      numBlocks: this.numBlocks, blockSize: this.blockSize, numUsedBlocks: pool.numUsedBlocks, numFreeBlocks: pool.numFreeBlocks,
      numCachedBlocks: pool.numCachedBlocks, usage: pool.numUsedBlocks / this.numBlocks,
      prefixQueryTokens: this.prefixQueryTokens, prefixHitTokens: this.prefixHitTokens, evictions: pool.evictions,
      ...(this.tiers !== undefined ? { tiers: this.tiers.stats() } : {}),
    };
  }

  /** Throws unless every block's refCount equals the number of given tables and pins holding it (plus pool invariants). */
  checkInvariants(liveTables: Iterable<BlockTable>): void {
    this.pool.checkInvariants();
    const references = new Int32Array(this.numBlocks); // block ids are in [0, numBlocks)
    for (const table of liveTables) {
      if (table.numCachedBlocks > table.blocks.length) {
        throw new Error(`table marks ${table.numCachedBlocks} cached blocks but holds ${table.blocks.length}`);
      }
      if (table.numReleasedBlocks > table.blocks.length) {
        throw new Error(`table released ${table.numReleasedBlocks} blocks but has ${table.blocks.length}`);
      }
      for (const block of table.heldBlocks) references[block.id]! += 1;
    }
    for (const pin of this.pins) for (const block of pin.blocks) references[block.id]! += 1;
    for (const block of this.pool.blocks) {
      if (block.refCount !== references[block.id]) {
        throw new Error(`block ${block.id} has refCount ${block.refCount} but ${references[block.id]} tables hold it`);
      }
    }
  }
}
