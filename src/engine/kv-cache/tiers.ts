// Lower tiers under a worker's primary KV pool: a RAM tier (--kv-offload-memory) and a persistent disk tier
// (--kv-offload-disk, disk-tier.ts). A cached block about to be evicted from the primary pool is copied down
// (offload); a prefix lookup that misses the primary pool but finds the next blocks in a lower tier copies them back
// into freshly allocated primary blocks (onboard) instead of recomputing them, when the cost model says that is faster.
//
// Offload is write-behind from the eviction end of the free queue, between steps, never inside one:
//   - after each step the worker calls offload(), which looks at the next `windowBlocks` blocks the pool would evict
//     (the head of its free queue) and copies those not yet held below. windowBlocks is about twice what one step
//     can allocate, so the blocks the next step may evict are already below when it does.
//   - each call copies at most `maxBlocksPerCall` blocks (one memcpy of blockBytes each into the RAM tier), so the
//     time it adds between two steps is bounded by maxBlocksPerCall * blockBytes / memory bandwidth: at most the
//     KV bytes one full step writes, a small fraction of the step itself. The disk tier's writes are asynchronous
//     (libuv's thread pool) and bounded in flight (disk-tier.ts); none is awaited on the step loop.
//   - when the worker is idle it keeps calling offload() until every cached free block a tier keeps is below (writes
//     through to disk for a warm restart), then stops.
// A block evicted before it was copied is simply lost to the tiers (counted: missedOffloads).
//
// A tier smaller than the blocks offered keeps the most recently used of them (the end of the eviction order), as an
// LRU given all of them in turn would, without copying the others only to push them out again: each call copies into
// a tier only the last `capacity` cached blocks of its window, after making those it already holds its most recently
// used ones (touch), so a copy pushes out only blocks it does not want. An idle sweep thus ends: once a tier holds its
// share it is left alone, and the sweep copies each block into a tier at most once until the pool allocates again
// (a disk write that failed is not retried in the same idle period).
//
// Tiers are inclusive and LRU each: the RAM tier keeps what it was given until its capacity pushes the least
// recently used out; the disk tier is written through (it gets the blocks copied down, as many of them as its own
// size keeps) and is bounded by its own size. Onboarding reads RAM first, then disk; a disk hit is also put back into the RAM tier.
//
// Tenants stay apart for free: a block is stored under its chained hash, which covers the cache salt (and adapter),
// so a lookup under another salt computes other hashes and cannot hit.

import type { BlockHash, KvEvent, KvLowerTier } from '../../protocols/kv-events.ts';
import type { KvTierStats, KvTiersStats } from '../../protocols/worker.ts';
import { StepTimeCurve, type StepTimeLine } from './step-time-curve.ts';

export type { KvLowerTier, KvTierStats, KvTiersStats, StepTimeLine };

/** The primary pool's bytes as the tiers see them: one block at a time, laid out as readKvBlocks does. */
export interface KvBlockIo {
  readonly blockBytes: number;
  /** A copy of the block's KV (every layer's K and V). */
  read(blockId: number): Uint8Array;
  /** Writes a block's KV (bytes as read() returned them). */
  write(blockId: number, bytes: Uint8Array): void;
}

/** A block below the primary pool: its bytes and its parent's hash (for the stored event that announces it). */
export interface TierBlock {
  bytes: Uint8Array;
  parentHash: BlockHash | null;
}

/** One lower tier: an LRU map from block hash to bytes with a bounded number of blocks. */
export interface KvBlockStore {
  readonly tier: KvLowerTier;
  readonly capacityBlocks: number;
  readonly numBlocks: number;
  has(hash: BlockHash): boolean;
  /** The block, made most recently used; null when absent (or, on disk, unreadable: then dropped). */
  get(hash: BlockHash): TierBlock | null;
  /** Stores (or refreshes) a block; may evict the least recently used. False when refused (a disk tier's writes in flight are at their bound). */
  put(hash: BlockHash, block: TierBlock): boolean | void;
  /** Makes a block it holds the most recently used, without reading it (a store without it keeps its order). */
  touch?(hash: BlockHash): void;
  /** True while a block is being written (not yet has(), but not to be offered again). */
  writing?(hash: BlockHash): boolean;
  /** True while the tier refuses new blocks until writes in flight finish. */
  readonly busy?: boolean;
  /** Hashes held, least recently used first. */
  hashes(): BlockHash[];
  clear(): void;
  /** The parent hash stored with a block (a persistent tier announces what it found at start with it). */
  parentOf?(hash: BlockHash): BlockHash | null | undefined;
  /** A tier that stores asynchronously tells when a block is in place, and when its own bound pushed one out. */
  listen?(listener: TierListener): void;
  /** Resolves once writes in flight are done. */
  flush?(): Promise<void>;
}

export interface TierListener {
  stored(hash: BlockHash, parentHash: BlockHash | null, bytes: number, ms: number): void;
  evicted(hash: BlockHash): void;
  /** A block's write failed: the tier does not hold it. */
  failed?(hash: BlockHash): void;
}

/** What a prefix lookup onboards: per block, the tier it comes from; and lower-tier blocks it chose to recompute. */
export interface OnboardPlan {
  hashes: BlockHash[];
  tiers: KvLowerTier[];
  numRecomputed: number;
}

/** Blocks onboarded for one request, by tier, and how long the copies took. */
export interface OnboardSummary {
  ram: number;
  disk: number;
  bytes: number;
  ms: number;
}

export interface KvTiersOptions {
  blockBytes: number;
  /** RAM tier capacity in bytes (0 or unset: no RAM tier). */
  ramBytes?: number;
  /** The disk tier (disk-tier.ts), already opened. */
  disk?: KvBlockStore;
  /** Milliseconds, for timing copies (default performance.now). */
  now?: () => number;
  /** Fixed tier bandwidths in bytes per ms instead of measured ones (tests, and the simulator). */
  bandwidth?: Partial<Record<KvLowerTier, number>>;
  /**
   * A fixed latency (ms) per onboard that reads from the tier, instead of TIER_BLOCK_OVERHEAD_MS per block (the
   * simulator, whose tier profiles price a transfer as one latency and then the bytes).
   */
  latencyMs?: Partial<Record<KvLowerTier, number>>;
  /**
   * A fixed prefill rate in tokens per ms instead of the measured step times: recomputing x tokens is then priced
   * x / rate, with no fixed part (tests that want the tier or the recompute to win outright).
   */
  prefillTokensPerMs?: number;
  /** A fixed step-time line instead of the curve through the steps observed (tests). */
  stepTime?: StepTimeLine;
  /**
   * The simulator's price of an onboard (ms for so many blocks per tier) instead of the measured copy time; the
   * step that onboards takes that much longer (takeOnboardMs).
   */
  priceOnboard?: (blocks: { ram: number; disk: number }) => number;
  /** Blocks at the eviction end of the free queue offload() keeps copied below (default 64). */
  windowBlocks?: number;
  /** Blocks offload() copies per call at most (default windowBlocks). */
  maxBlocksPerCall?: number;
}

/** Starting bandwidth estimates before anything was measured (bytes per ms): memcpy-class RAM, an NVMe-class disk. */
export const DEFAULT_TIER_BANDWIDTH: Record<KvLowerTier, number> = { ram: 4e6, disk: 5e5 };
/** Fixed cost per block besides the bytes (ms): a map lookup in RAM, an open + read + close on disk. */
export const TIER_BLOCK_OVERHEAD_MS: Record<KvLowerTier, number> = { ram: 0.001, disk: 0.05 };
const EWMA = 0.3;

function emptyStats(capacityBlocks: number, blockBytes: number): KvTierStats {
  return {
    capacityBlocks, usedBlocks: 0, blockBytes, offloadBlocks: 0, offloadBytes: 0, offloadMs: 0, onboardBlocks: 0,
    onboardBytes: 0, onboardMs: 0, corruptBlocks: 0, evictedBlocks: 0, failedOffloadBlocks: 0,
  };
}

/**
 * The RAM tier: a Map in insertion order is an LRU list (get re-inserts; the first key is the oldest). The simulator
 * also uses one, with tier 'disk' and a listener, as its model of a disk tier (no bytes, no files).
 */
export class RamKvTier implements KvBlockStore {
  readonly tier: KvLowerTier;
  readonly capacityBlocks: number;
  private readonly blocks = new Map<BlockHash, TierBlock>();
  private listener: TierListener | undefined;

  constructor(capacityBlocks: number, private readonly onEvict: (hash: BlockHash) => void = () => {}, tier: KvLowerTier = 'ram') {
    if (!Number.isSafeInteger(capacityBlocks) || capacityBlocks < 1) throw new RangeError(`${tier} tier capacity must be >= 1 block, got ${capacityBlocks}`);
    this.capacityBlocks = capacityBlocks;
    this.tier = tier;
  }

  /** Stored and evicted blocks reported to a listener instead (a tier plugged in as the disk tier). */
  listen(listener: TierListener): void {
    this.listener = listener;
  }

  parentOf(hash: BlockHash): BlockHash | null | undefined {
    return this.blocks.get(hash)?.parentHash;
  }

  get numBlocks(): number {
    return this.blocks.size;
  }

  has(hash: BlockHash): boolean {
    return this.blocks.has(hash);
  }

  get(hash: BlockHash): TierBlock | null {
    const block = this.blocks.get(hash);
    if (block === undefined) return null;
    this.blocks.delete(hash);
    this.blocks.set(hash, block);
    return block;
  }

  touch(hash: BlockHash): void {
    const block = this.blocks.get(hash);
    if (block === undefined) return;
    this.blocks.delete(hash);
    this.blocks.set(hash, block);
  }

  put(hash: BlockHash, block: TierBlock): void {
    if (this.blocks.delete(hash)) {
      this.blocks.set(hash, block);
      return;
    }
    while (this.blocks.size >= this.capacityBlocks) {
      const oldest = this.blocks.keys().next().value as BlockHash;
      this.blocks.delete(oldest);
      if (this.listener !== undefined) this.listener.evicted(oldest);
      else this.onEvict(oldest);
    }
    this.blocks.set(hash, block);
    this.listener?.stored(hash, block.parentHash, block.bytes.length, 0);
  }

  hashes(): BlockHash[] {
    return [...this.blocks.keys()];
  }

  clear(): void {
    this.blocks.clear();
  }
}

/** A primary block the tiers may copy down: its id, hash and parent's hash (the manager's KvBlock fits). */
export interface OffloadCandidate {
  readonly id: number;
  readonly hash: BlockHash | null;
  readonly parentHash: BlockHash | null;
}

export class KvTiers {
  readonly blockBytes: number;
  readonly ram: RamKvTier | undefined;
  readonly disk: KvBlockStore | undefined;
  readonly windowBlocks: number;
  readonly maxBlocksPerCall: number;
  private io: KvBlockIo | undefined;
  private readonly now: () => number;
  private readonly fixedBandwidth: Partial<Record<KvLowerTier, number>>;
  private readonly fixedLatencyMs: Partial<Record<KvLowerTier, number>>;
  private readonly measuredBandwidth: Record<KvLowerTier, number> = { ...DEFAULT_TIER_BANDWIDTH };
  /** Average prefill rate (tokens per ms of steps that computed a block of prompt or more): the fallback price. */
  private prefillTokensPerMs: number | undefined;
  private readonly fixedPrefillRate: boolean;
  private readonly stepTimeCurve = new StepTimeCurve();
  private readonly fixedStepTime: StepTimeLine | undefined;
  private readonly counters: Partial<Record<KvLowerTier, KvTierStats>> = {};
  private missedOffloads = 0;
  private recomputedBlocks = 0;
  private readonly priceOnboard: KvTiersOptions['priceOnboard'];
  private onboardMsSinceTake = 0;
  private emit: (event: KvEvent) => void = () => {};
  private blockSize = 1;
  /**
   * Blocks the current idle sweep (offload with window Infinity) copied into each tier (a disk write: started):
   * never copied there again until the pool allocates (allocated()) or a step's bounded offload runs.
   */
  private sweep: { ram: Set<BlockHash>; disk: Set<BlockHash> } | undefined;

  constructor(options: KvTiersOptions) {
    if (!Number.isSafeInteger(options.blockBytes) || options.blockBytes < 1) throw new RangeError(`blockBytes must be >= 1, got ${options.blockBytes}`);
    this.blockBytes = options.blockBytes;
    this.now = options.now ?? (() => performance.now());
    this.fixedBandwidth = options.bandwidth ?? {};
    this.fixedLatencyMs = options.latencyMs ?? {};
    this.prefillTokensPerMs = options.prefillTokensPerMs;
    this.fixedPrefillRate = options.prefillTokensPerMs !== undefined;
    this.fixedStepTime = options.stepTime;
    this.windowBlocks = options.windowBlocks ?? 64;
    this.maxBlocksPerCall = options.maxBlocksPerCall ?? this.windowBlocks;
    this.priceOnboard = options.priceOnboard;
    const ramBlocks = Math.floor((options.ramBytes ?? 0) / this.blockBytes);
    if ((options.ramBytes ?? 0) > 0 && ramBlocks < 1) {
      throw new RangeError(`--kv-offload-memory ${options.ramBytes} bytes holds no KV block of ${this.blockBytes} bytes`);
    }
    if (ramBlocks > 0) {
      this.ram = new RamKvTier(ramBlocks, (hash) => {
        this.stat('ram').evictedBlocks++;
        this.emit({ type: 'removed', eventId: 0, blockHashes: [hash], tier: 'ram' });
      });
      this.counters.ram = emptyStats(ramBlocks, this.blockBytes);
    }
    if (options.disk !== undefined) {
      this.disk = options.disk;
      this.counters.disk = emptyStats(options.disk.capacityBlocks, this.blockBytes);
      options.disk.listen?.({
        stored: (hash, parentHash, bytes, ms) => this.diskStored(hash, parentHash, bytes, ms),
        evicted: (hash) => this.diskRemoved(hash, 'evicted'),
        failed: () => { this.stat('disk').failedOffloadBlocks++; },
      });
    }
  }

  /** The manager connects the pool's bytes and its KV event queue. */
  attach(io: KvBlockIo | undefined, emit: (event: KvEvent) => void, blockSize: number): void {
    if (io !== undefined && io.blockBytes !== this.blockBytes) {
      throw new RangeError(`the pool's blocks are ${io.blockBytes} bytes, the tiers were sized for ${this.blockBytes}`);
    }
    this.io = io;
    this.emit = emit;
    this.blockSize = blockSize;
    // What a persistent tier already held (a warm restart): announced once, oldest first.
    for (const hash of this.disk?.hashes() ?? []) {
      this.emit({
        type: 'stored', eventId: 0, blockHashes: [hash], parentHash: this.disk!.parentOf?.(hash) ?? null,
        tokenCount: blockSize, blockSize, tier: 'disk',
      });
    }
  }

  get enabled(): boolean {
    return this.ram !== undefined || this.disk !== undefined;
  }

  private stat(tier: KvLowerTier): KvTierStats {
    return (this.counters[tier] ??= emptyStats(0, this.blockBytes));
  }

  /** The tiers' clock (ms), for timing an onboard from before its reads. */
  stamp(): number {
    return this.now();
  }

  /** The tier holding a block, the fastest first; undefined when none does. */
  tierOf(hash: BlockHash): KvLowerTier | undefined {
    if (this.ram?.has(hash)) return 'ram';
    if (this.disk?.has(hash)) return 'disk';
    return undefined;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Cost model

  /** Milliseconds to bring `blocks` blocks from a tier into the primary pool. */
  onboardMs(tier: KvLowerTier, blocks: number): number {
    if (blocks <= 0) return 0;
    const bandwidth = this.fixedBandwidth[tier] ?? this.measuredBandwidth[tier];
    const latencyMs = this.fixedLatencyMs[tier];
    if (latencyMs !== undefined) return latencyMs + blocks * this.blockBytes / bandwidth;
    return blocks * (this.blockBytes / bandwidth + TIER_BLOCK_OVERHEAD_MS[tier]);
  }

  /**
   * Milliseconds that computing `tokens` more prompt tokens adds to a prefill that computes `anywayTokens` tokens
   * regardless (those after the blocks a tier could serve: at least the prompt's last token), with at most
   * `chunkTokens` prompt tokens per step (the scheduler's budget: chunked prefill).
   *
   * That is the difference between the prefill's steps with and without them, each step priced by the step-time
   * curve (step-time-curve.ts): the step that computes `anywayTokens` runs whatever is decided, so the part of it
   * every step pays (streaming all the weights once) is no price of recomputing a block in it. The average prefill
   * rate would charge each token its share of that part, which for a short prompt is most of the step: the model
   * then read a block from a tier slower than the few more tokens it spared, and the request's first token came
   * later than with no tier at all. Until the curve is determined (the steps seen were all of about one size) the
   * average rate prices it all the same; before any step was measured, Infinity (a tier hit is onboarded).
   */
  recomputeMs(tokens: number, anywayTokens = 0, chunkTokens = Infinity): number {
    if (tokens <= 0) return 0;
    const stepMs = this.stepMs();
    if (stepMs === undefined) return this.prefillTokensPerMs === undefined ? Infinity : tokens / this.prefillTokensPerMs;
    // Chunked prefill computes the prompt in full steps of chunkTokens and a last one of the rest.
    const prefillMs = (promptTokens: number) => {
      if (promptTokens <= 0) return 0;
      if (!(promptTokens > chunkTokens)) return stepMs(promptTokens);
      const fullSteps = Math.floor(promptTokens / chunkTokens);
      const rest = promptTokens - fullSteps * chunkTokens;
      return fullSteps * stepMs(chunkTokens) + (rest > 0 ? stepMs(rest) : 0);
    };
    return Math.max(0, prefillMs(anywayTokens + tokens) - prefillMs(anywayTokens));
  }

  /**
   * The time of a step of so many tokens that recompute is priced with: the fixed line (options.stepTime), else the
   * curve through the steps observed; undefined while the curve is not determined, or when a fixed average rate
   * (options.prefillTokensPerMs) replaces it.
   */
  stepMs(): ((tokens: number) => number) | undefined {
    const line = this.fixedStepTime;
    if (line !== undefined) return (tokens) => line.fixedMs + line.msPerToken * tokens;
    return this.fixedPrefillRate ? undefined : this.stepTimeCurve.stepMs();
  }

  /**
   * A step computed `tokens` tokens, `prefillTokens` of them prompt tokens, in `ms`. Every step feeds the step-time
   * curve (decode steps are what pins its low end down); steps that computed a block of prompt or more also feed the
   * average prefill rate, the price while the curve is not determined.
   */
  observeStep(tokens: number, ms: number, prefillTokens: number): void {
    if (tokens <= 0 || !(ms > 0)) return;
    this.stepTimeCurve.observe(tokens, ms);
    if (this.fixedPrefillRate || prefillTokens < this.blockSize) return;
    const rate = tokens / ms;
    this.prefillTokensPerMs = this.prefillTokensPerMs === undefined ? rate : (1 - EWMA) * this.prefillTokensPerMs + EWMA * rate;
  }

  private observeBandwidth(tier: KvLowerTier, bytes: number, ms: number): void {
    if (!(ms > 0) || bytes <= 0) return;
    const rate = bytes / Math.max(0, ms - TIER_BLOCK_OVERHEAD_MS[tier] * bytes / this.blockBytes) || bytes / ms;
    this.measuredBandwidth[tier] = (1 - EWMA) * this.measuredBandwidth[tier] + EWMA * Math.min(rate, 1e9);
  }

  /**
   * The lower-tier blocks to onboard among hashes[from, to) of a sequence of `numTokens` tokens whose prefill computes
   * at most `chunkTokens` tokens per step. The run of consecutive blocks some tier holds is split into a head that is
   * onboarded and a tail that is recomputed (each block's KV needs its predecessors', so nothing after a recomputed
   * block can be onboarded): the split is the one with the least onboard + recompute time, the recompute priced at
   * its marginal cost on top of the tokens after the run, which are computed either way (recomputeMs). Ties go to
   * recomputing: no tier read for nothing.
   */
  planOnboard(hashes: readonly BlockHash[], from: number, to: number, blockSize: number, numTokens: number,
    chunkTokens = Infinity): OnboardPlan | undefined {
    if (!this.enabled || from >= to) return undefined;
    const tiers: KvLowerTier[] = [];
    for (let i = from; i < to; i++) {
      const tier = this.tierOf(hashes[i]!);
      if (tier === undefined) break;
      tiers.push(tier);
    }
    if (tiers.length === 0) return undefined;
    const anywayTokens = numTokens - (from + tiers.length) * blockSize;
    let bestOnboarded = 0;
    let bestMs = this.recomputeMs(tiers.length * blockSize, anywayTokens, chunkTokens);
    const onboardedFrom: Record<KvLowerTier, number> = { ram: 0, disk: 0 };
    for (let onboarded = 1; onboarded <= tiers.length; onboarded++) {
      onboardedFrom[tiers[onboarded - 1]!]++;
      const onboardMs = this.onboardMs('ram', onboardedFrom.ram) + this.onboardMs('disk', onboardedFrom.disk);
      const ms = onboardMs + this.recomputeMs((tiers.length - onboarded) * blockSize, anywayTokens, chunkTokens);
      if (ms < bestMs) {
        bestMs = ms;
        bestOnboarded = onboarded;
      }
    }
    return { hashes: hashes.slice(from, from + bestOnboarded), tiers: tiers.slice(0, bestOnboarded), numRecomputed: tiers.length - bestOnboarded };
  }

  /** A lookup's plan was taken: the blocks it chose to recompute are counted. */
  noteRecomputed(blocks: number): void {
    this.recomputedBlocks += blocks;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Onboard (lower tier -> primary)

  /**
   * Reads every planned block (RAM, else disk, checksums checked there). Returns the blocks and where each came
   * from, or null when one is gone or unreadable meanwhile (it is dropped; a new lookup plans without it).
   */
  fetch(plan: OnboardPlan): { blocks: TierBlock[]; tiers: KvLowerTier[] } | null {
    const blocks: TierBlock[] = [];
    const tiers: KvLowerTier[] = [];
    for (const hash of plan.hashes) {
      let block = this.ram?.get(hash) ?? null;
      let tier: KvLowerTier = 'ram';
      if (block === null && this.disk !== undefined) {
        tier = 'disk';
        const before = this.disk.has(hash);
        block = this.disk.get(hash);
        if (block === null && before) {
          this.stat('disk').corruptBlocks++;
          this.emit({ type: 'removed', eventId: 0, blockHashes: [hash], tier: 'disk' });
        }
      }
      if (block === null) return null;
      blocks.push(block);
      tiers.push(tier);
    }
    return { blocks, tiers };
  }

  /** Writes fetched blocks into primary block ids (same order); a disk block is also put back into RAM. */
  writeOnboarded(fetched: { blocks: TierBlock[]; tiers: KvLowerTier[] }, hashes: readonly BlockHash[],
    blockIds: readonly number[], startMs: number): OnboardSummary {
    const summary: OnboardSummary = { ram: 0, disk: 0, bytes: 0, ms: 0 };
    fetched.blocks.forEach((block, i) => {
      this.io?.write(blockIds[i]!, block.bytes);
      const tier = fetched.tiers[i]!;
      summary[tier]++;
      summary.bytes += this.blockBytes;
      if (tier === 'disk' && this.ram !== undefined) this.putRam(hashes[i]!, block);
    });
    summary.ms = this.priceOnboard !== undefined ? this.priceOnboard(summary) : Math.max(0, this.now() - startMs);
    this.onboardMsSinceTake += summary.ms;
    for (const tier of ['ram', 'disk'] as const) {
      if (summary[tier] === 0) continue;
      const share = summary[tier] * this.blockBytes / Math.max(1, summary.bytes);
      const s = this.stat(tier);
      s.onboardBlocks += summary[tier];
      s.onboardBytes += summary[tier] * this.blockBytes;
      s.onboardMs += summary.ms * share;
      if (this.priceOnboard === undefined) this.observeBandwidth(tier, summary[tier] * this.blockBytes, summary.ms * share);
    }
    return summary;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Offload (primary -> lower tiers)

  /**
   * Copies down cached blocks among the first `window` of `candidates` (the next blocks the pool evicts, in eviction
   * order), at most maxBlocks of them; returns how many were copied. A tier takes only the last `capacityBlocks` cached
   * blocks of the window (the most recently used: what an LRU of that size keeps of them) that it does not hold yet;
   * those it holds are touched first, so its copies push out only blocks it does not want. An idle worker passes
   * window Infinity to copy everything a tier keeps, chunk by chunk: such a sweep copies a block into a tier at most
   * once (until allocated()), so it ends, with 0, once each tier holds its share.
   */
  offload(candidates: Iterable<OffloadCandidate>, maxBlocks = this.maxBlocksPerCall, window = this.windowBlocks): number {
    if (!this.enabled || this.io === undefined) return 0;
    const idle = window === Infinity;
    if (!idle) this.sweep = undefined;
    const sweep = idle ? (this.sweep ??= { ram: new Set(), disk: new Set() }) : undefined;
    const cached: OffloadCandidate[] = [];
    let seen = 0;
    for (const block of candidates) {
      if (seen >= window) break;
      seen++;
      if (block.hash !== null) cached.push(block);
    }
    const { ram, disk } = this;
    // Index of the first block each tier takes: the last capacityBlocks of the window (all of them when it is larger).
    const ramFrom = ram === undefined ? cached.length : Math.max(0, cached.length - ram.capacityBlocks);
    const diskFrom = disk === undefined ? cached.length : Math.max(0, cached.length - disk.capacityBlocks);
    // What a tier already holds of its share becomes its most recently used, in eviction order: the copies below then
    // push out only blocks outside the share (there are enough of them, since the share fits the tier).
    for (let i = Math.min(ramFrom, diskFrom); i < cached.length; i++) {
      const hash = cached[i]!.hash!;
      if (i >= ramFrom) ram!.touch(hash);
      if (i >= diskFrom) disk!.touch?.(hash);
    }
    let copied = 0;
    for (let i = Math.min(ramFrom, diskFrom); i < cached.length; i++) {
      const block = cached[i]!;
      const hash = block.hash!;
      const toRam = i >= ramFrom && !ram!.has(hash) && !(sweep?.ram.has(hash) ?? false);
      // A disk tier at its bound of writes in flight takes nothing now: the block is offered again by a later call.
      const toDisk = i >= diskFrom && !disk!.has(hash) && !(disk!.writing?.(hash) ?? false) && !(sweep?.disk.has(hash) ?? false)
        && !disk!.busy;
      if (!toRam && !toDisk) continue;
      if (copied >= maxBlocks) break;
      const start = this.now();
      const tierBlock: TierBlock = { bytes: this.io.read(block.id), parentHash: block.parentHash };
      if (toRam) {
        this.putRam(hash, tierBlock);
        sweep?.ram.add(hash);
        this.stat('ram').offloadMs += Math.max(0, this.now() - start);
      }
      // Write-through to disk (asynchronous there; the stored event goes out when the write is durable).
      if (toDisk && disk!.put(hash, tierBlock) !== false) sweep?.disk.add(hash);
      copied++;
    }
    return copied;
  }

  /**
   * The pool allocated blocks (a step ran): what the next idle sweep copies is decided afresh. Blocks copied by the
   * last sweep and pushed out of a tier since may be copied again.
   */
  allocated(): void {
    this.sweep = undefined;
  }

  private putRam(hash: BlockHash, block: TierBlock): void {
    const ram = this.ram!;
    const fresh = !ram.has(hash);
    ram.put(hash, block);
    if (!fresh) return;
    const s = this.stat('ram');
    s.offloadBlocks++;
    s.offloadBytes += this.blockBytes;
    this.emit({
      type: 'stored', eventId: 0, blockHashes: [hash], parentHash: block.parentHash, tokenCount: this.blockSize, blockSize: this.blockSize, tier: 'ram',
    });
  }

  /** The disk tier finished writing a block (called by it): the block is durable and announced. */
  diskStored(hash: BlockHash, parentHash: BlockHash | null, bytes: number, ms: number): void {
    const s = this.stat('disk');
    s.offloadBlocks++;
    s.offloadBytes += bytes;
    s.offloadMs += ms;
    this.emit({ type: 'stored', eventId: 0, blockHashes: [hash], parentHash, tokenCount: this.blockSize, blockSize: this.blockSize, tier: 'disk' });
  }

  /** The disk tier dropped a block (its LRU bound, or a file found bad). */
  diskRemoved(hash: BlockHash, reason: 'evicted' | 'corrupt'): void {
    const s = this.stat('disk');
    if (reason === 'evicted') s.evictedBlocks++;
    else s.corruptBlocks++;
    this.emit({ type: 'removed', eventId: 0, blockHashes: [hash], tier: 'disk' });
  }

  /** A cached primary block was evicted; counted when no tier had it. */
  primaryEvicted(hash: BlockHash): void {
    if (this.tierOf(hash) === undefined) this.missedOffloads++;
  }

  /** Forgets the RAM tier (a prefix-cache reset); the disk tier keeps its blocks (it holds no memory). */
  resetMemory(): void {
    this.sweep = undefined;
    if (this.ram === undefined || this.ram.numBlocks === 0) return;
    this.ram.clear();
    this.emit({ type: 'cleared', eventId: 0, tier: 'ram' });
  }

  /** Hashes each tier holds: what a router resyncs its lower-tier index from. */
  blockHashes(): Partial<Record<KvLowerTier, BlockHash[]>> {
    return {
      ...(this.ram !== undefined ? { ram: this.ram.hashes() } : {}),
      ...(this.disk !== undefined ? { disk: this.disk.hashes() } : {}),
    };
  }

  /** Onboard time (ms) since the last call: what the simulator adds to the step that onboarded. */
  takeOnboardMs(): number {
    const ms = this.onboardMsSinceTake;
    this.onboardMsSinceTake = 0;
    return ms;
  }

  /** True while the disk tier refuses blocks until its writes in flight finish (an idle worker retries later). */
  get diskBusy(): boolean {
    return this.disk?.busy ?? false;
  }

  /** Resolves once the disk tier's writes in flight are done (tests, shutdown). */
  async flush(): Promise<void> {
    await this.disk?.flush?.();
  }

  stats(): KvTiersStats {
    const tiers: Partial<Record<KvLowerTier, KvTierStats>> = {};
    if (this.ram !== undefined) tiers.ram = { ...this.stat('ram'), capacityBlocks: this.ram.capacityBlocks, usedBlocks: this.ram.numBlocks };
    if (this.disk !== undefined) tiers.disk = { ...this.stat('disk'), capacityBlocks: this.disk.capacityBlocks, usedBlocks: this.disk.numBlocks };
    return { tiers, missedOffloads: this.missedOffloads, recomputedBlocks: this.recomputedBlocks };
  }
}
