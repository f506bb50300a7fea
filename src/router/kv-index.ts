// The router's picture of which worker holds which cached blocks, fed by the workers' KV events.
//
// Why a hash -> workers map and not a radix tree: a block hash is chained (it covers the block's tokens and, via
// its parent, every token before it), so equal hashes already mean equal prefixes. The tree's job, telling two
// prefixes apart, is done by the hash function; what remains is "which workers hold this hash". Matching a
// request is then one map lookup per block, walking the request's hashes in order and dropping a worker at the
// first block it lacks: the depth at which it drops out is its overlap. Parent links are not needed either: a
// worker's dump (KvCacheManager.cachedBlockHashes) is a flat list without them, a stored block whose parent is
// missing can never be reached by that walk anyway, and an eviction needs no cascade for the same reason. (The
// bitset index does remember which block followed which, but only as a shortcut that is checked before use.)
//
// Two implementations share the event handling below and one contract test suite:
//   HashSetKvIndex  Map<hash, Set<worker>>, the obvious version and the oracle for the other.
//   BitsetKvIndex   typed arrays only: an open-addressing table from hash to slot, a worker bitset per slot, and a
//                   successor hint per slot; matching ANDs a few words per block. A lookup stays in microseconds
//                   with hundreds of workers and a million blocks (benchmarks/router.ts).
//
// Lower tiers: events with a `tier` (a worker's RAM or disk tier, kv-events.ts) never touch the primary storage; a
// plain map per worker records which tiers hold each hash, and lowerTierRun reads it for the router's cost. A
// resync replaces the primary blocks with the dump's, and each lower tier's with the dump's list for that tier when
// it has one (a worker of an earlier release sends only its primary blocks: its tiers then stay as events left them).
//
// Event ids: each worker numbers its events 1, 2, 3, ... A gap means lost events, after which this index may
// believe a worker holds blocks it evicted (or miss blocks it stored). The index keeps applying what it receives,
// reports the worker as needing a resync, and buffers the events that arrive meanwhile; the caller fetches the
// worker's dump and calls resync(), which replaces the worker's blocks and replays the buffered events newer than
// the dump.

import type { BlockHash, KvEvent, KvLowerTier } from '../protocols/kv-events.ts';
import type { WorkerId } from './protocols.ts';

export type ApplyResult =
  | { status: 'applied'; needsResync: boolean }
  /** Event id already seen (redelivery): ignored. */
  | { status: 'duplicate'; needsResync: boolean }
  /** Events between expectedEventId and receivedEventId were lost; this one was applied, the worker needs a resync. */
  | { status: 'gap'; needsResync: true; expectedEventId: number; receivedEventId: number };

/** A worker's lower-tier blocks, per tier (a tier left out holds none). */
export type LowerTierDump = Partial<Record<KvLowerTier, readonly BlockHash[]>>;

export interface KvIndexWorkerDump {
  workerId: WorkerId;
  /** Id of the last event reflected in blockHashes; null: unknown, the next event id received is accepted as is. */
  lastEventId: number | null;
  blockHashes: BlockHash[];
}

export interface KvIndexDump {
  workers: KvIndexWorkerDump[];
}

export interface KvIndex {
  applyEvent(workerId: WorkerId, event: KvEvent): ApplyResult;
  /**
   * For each worker holding hashes[0], how many leading hashes it holds in a row (>= 1). Workers holding none are
   * absent from the map.
   */
  findMatches(hashes: readonly BlockHash[]): ReadonlyMap<WorkerId, number>;
  /** Whether the worker holds this one block. */
  holds(workerId: WorkerId, hash: BlockHash): boolean;
  /** Forgets a worker's blocks and event ids (it left, or restarted and will number its events from 1 again). */
  removeWorker(workerId: WorkerId): void;
  /**
   * Of hashes[from], hashes[from + 1], ..., how many in a row the worker holds below its primary pool (events with a
   * tier), and how many of those only on disk.
   */
  lowerTierRun(workerId: WorkerId, hashes: readonly BlockHash[], from: number): { blocks: number; disk: number };
  /**
   * Replaces a worker's blocks with a dump of them and clears its resync flag. With lastEventId (the id of the last
   * event the dump reflects), buffered events newer than it are replayed; without, the next event id is accepted.
   * With lowerTiers, the worker's lower-tier blocks are replaced too (a tier it does not list holds none).
   */
  resync(workerId: WorkerId, blockHashes: readonly BlockHash[], lastEventId?: number, lowerTiers?: LowerTierDump): void;
  /**
   * A dump of the worker is on its way (asked for before resync is called): events from now on are also kept, as
   * after a gap, so those the dump does not reflect are replayed on it instead of being wiped with the old blocks.
   * resync ends it; endResync ends it without a dump (the request for one failed).
   */
  beginResync(workerId: WorkerId): void;
  endResync(workerId: WorkerId): void;
  workersNeedingResync(): WorkerId[];
  workers(): WorkerId[];
  workerBlockHashes(workerId: WorkerId): BlockHash[];
  dump(): KvIndexDump;
  /** Replaces the whole index with a dump (a router replica starting from another's state). */
  load(dump: KvIndexDump): void;
  /** Distinct block hashes held by at least one worker. */
  readonly numBlocks: number;
  /** (worker, block) pairs: the sum over workers of the blocks each holds. */
  readonly numEntries: number;
}

interface WorkerEventState {
  /** null: accept whatever id comes next (after a resync whose dump had no event id). */
  lastEventId: number | null;
  needsResync: boolean;
  /** A dump was asked for (beginResync) and not applied yet. */
  dumpPending: boolean;
  /** Events received since the gap (or since the dump was asked for), replayed on top of the dump by resync(). */
  sinceGap: KvEvent[];
}

/** Events held for a worker awaiting resync; past this the oldest are dropped and the replay stops at the hole. */
export const DEFAULT_MAX_BUFFERED_EVENTS = 10_000;

/** Event sequencing, resync and dumps, over block storage supplied by the implementation. */
const TIER_BIT: Record<KvLowerTier, number> = { ram: 1, disk: 2 };

export abstract class KvIndexBase implements KvIndex {
  private readonly states = new Map<WorkerId, WorkerEventState>();
  /** Per worker: hash -> bits of the lower tiers holding it. */
  private readonly lowerTiers = new Map<WorkerId, Map<BlockHash, number>>();
  private readonly maxBufferedEvents: number;

  constructor(options: { maxBufferedEvents?: number } = {}) {
    this.maxBufferedEvents = options.maxBufferedEvents ?? DEFAULT_MAX_BUFFERED_EVENTS;
  }

  abstract findMatches(hashes: readonly BlockHash[]): ReadonlyMap<WorkerId, number>;
  abstract holds(workerId: WorkerId, hash: BlockHash): boolean;
  abstract workerBlockHashes(workerId: WorkerId): BlockHash[];
  abstract get numBlocks(): number;
  abstract get numEntries(): number;
  /**
   * chainParent: hashes form a chain continuing this block (null: from the start), as in a stored event;
   * undefined: they are an unordered set, as in a dump.
   */
  protected abstract addBlocks(workerId: WorkerId, hashes: readonly BlockHash[], chainParent?: BlockHash | null): void;
  protected abstract removeBlocks(workerId: WorkerId, hashes: readonly BlockHash[]): void;
  /** Drops every block of the worker; the worker itself may stay registered. */
  protected abstract clearBlocks(workerId: WorkerId): void;
  /** Drops the worker's blocks and any per-worker storage. */
  protected abstract dropWorker(workerId: WorkerId): void;

  private state(workerId: WorkerId): WorkerEventState {
    let state = this.states.get(workerId);
    if (state === undefined) {
      // A worker's first event is 1: a first event with a larger id means the index missed the earlier ones.
      state = { lastEventId: 0, needsResync: false, dumpPending: false, sinceGap: [] };
      this.states.set(workerId, state);
    }
    return state;
  }

  applyEvent(workerId: WorkerId, event: KvEvent): ApplyResult {
    const state = this.state(workerId);
    const { lastEventId } = state;
    if (lastEventId !== null && event.eventId <= lastEventId) return { status: 'duplicate', needsResync: state.needsResync };
    const gap = lastEventId !== null && event.eventId !== lastEventId + 1;
    state.lastEventId = event.eventId;
    if (gap && !state.needsResync) {
      state.needsResync = true;
      // Kept since the dump was asked for: those events may still be newer than the dump.
      if (!state.dumpPending) state.sinceGap = [];
    }
    if (state.needsResync || state.dumpPending) {
      state.sinceGap.push(event);
      if (state.sinceGap.length > this.maxBufferedEvents) state.sinceGap.shift();
    }
    this.applyToStorage(workerId, event);
    if (gap) return { status: 'gap', needsResync: true, expectedEventId: lastEventId! + 1, receivedEventId: event.eventId };
    return { status: 'applied', needsResync: state.needsResync };
  }

  private applyToStorage(workerId: WorkerId, event: KvEvent): void {
    if (event.tier !== undefined) {
      this.applyToLowerTier(workerId, event, TIER_BIT[event.tier]);
      return;
    }
    switch (event.type) {
      case 'stored':
        this.addBlocks(workerId, event.blockHashes, event.parentHash);
        break;
      case 'removed':
        this.removeBlocks(workerId, event.blockHashes);
        break;
      case 'cleared':
        this.clearBlocks(workerId);
        break;
    }
  }

  private applyToLowerTier(workerId: WorkerId, event: KvEvent, bit: number): void {
    let held = this.lowerTiers.get(workerId);
    if (held === undefined) this.lowerTiers.set(workerId, held = new Map());
    switch (event.type) {
      case 'stored':
        for (const hash of event.blockHashes) held.set(hash, (held.get(hash) ?? 0) | bit);
        break;
      case 'removed':
        for (const hash of event.blockHashes) {
          const bits = (held.get(hash) ?? 0) & ~bit;
          if (bits === 0) held.delete(hash);
          else held.set(hash, bits);
        }
        break;
      case 'cleared':
        for (const [hash, bits] of held) {
          if ((bits & ~bit) === 0) held.delete(hash);
          else held.set(hash, bits & ~bit);
        }
        break;
    }
  }

  lowerTierRun(workerId: WorkerId, hashes: readonly BlockHash[], from: number): { blocks: number; disk: number } {
    const held = this.lowerTiers.get(workerId);
    let blocks = 0;
    let disk = 0;
    if (held === undefined) return { blocks, disk };
    for (let i = from; i < hashes.length; i++) {
      const bits = held.get(hashes[i]!);
      if (bits === undefined) break;
      blocks++;
      if (bits === TIER_BIT.disk) disk++;
    }
    return { blocks, disk };
  }

  beginResync(workerId: WorkerId): void {
    const state = this.state(workerId);
    if (!state.dumpPending && !state.needsResync) state.sinceGap = [];
    state.dumpPending = true;
  }

  endResync(workerId: WorkerId): void {
    const state = this.states.get(workerId);
    if (state === undefined || !state.dumpPending) return;
    state.dumpPending = false;
    if (!state.needsResync) state.sinceGap = [];
  }

  resync(workerId: WorkerId, blockHashes: readonly BlockHash[], lastEventId?: number, lowerTiers?: LowerTierDump): void {
    const state = this.state(workerId);
    const buffered = state.sinceGap;
    this.clearBlocks(workerId);
    this.addBlocks(workerId, blockHashes);
    if (lowerTiers !== undefined) {
      const held = new Map<BlockHash, number>();
      for (const tier of Object.keys(TIER_BIT) as KvLowerTier[]) {
        for (const hash of lowerTiers[tier] ?? []) held.set(hash, (held.get(hash) ?? 0) | TIER_BIT[tier]);
      }
      this.lowerTiers.set(workerId, held);
    }
    state.needsResync = false;
    state.dumpPending = false;
    state.sinceGap = [];
    if (lastEventId === undefined) {
      state.lastEventId = null;
      return;
    }
    // Replay what arrived after the dump was taken, in id order, stopping at a hole (the buffer overflowed, or
    // the events are still in flight: then the worker needs another resync).
    state.lastEventId = lastEventId;
    for (const event of buffered) {
      if (event.eventId <= state.lastEventId) continue;
      if (event.eventId !== state.lastEventId + 1) {
        state.needsResync = true;
        break;
      }
      this.applyToStorage(workerId, event);
      state.lastEventId = event.eventId;
    }
  }

  removeWorker(workerId: WorkerId): void {
    this.states.delete(workerId);
    this.lowerTiers.delete(workerId);
    this.dropWorker(workerId);
  }

  workersNeedingResync(): WorkerId[] {
    const out: WorkerId[] = [];
    for (const [workerId, state] of this.states) if (state.needsResync) out.push(workerId);
    return out;
  }

  workers(): WorkerId[] {
    return [...this.states.keys()];
  }

  dump(): KvIndexDump {
    return {
      workers: this.workers().map((workerId) => ({
        workerId, lastEventId: this.states.get(workerId)!.lastEventId, blockHashes: this.workerBlockHashes(workerId),
      })),
    };
  }

  load(dump: KvIndexDump): void {
    for (const workerId of this.workers()) this.removeWorker(workerId);
    for (const worker of dump.workers) {
      this.states.set(worker.workerId, { lastEventId: worker.lastEventId, needsResync: false, dumpPending: false, sinceGap: [] });
      this.addBlocks(worker.workerId, worker.blockHashes);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Map of sets: the plain version

export class HashSetKvIndex extends KvIndexBase {
  private readonly holders = new Map<BlockHash, Set<WorkerId>>();
  private readonly blocksOf = new Map<WorkerId, Set<BlockHash>>();
  private entries = 0;

  get numBlocks(): number {
    return this.holders.size;
  }

  get numEntries(): number {
    return this.entries;
  }

  protected addBlocks(workerId: WorkerId, hashes: readonly BlockHash[]): void {
    let own = this.blocksOf.get(workerId);
    if (own === undefined) this.blocksOf.set(workerId, own = new Set());
    for (const hash of hashes) {
      if (own.has(hash)) continue;
      own.add(hash);
      this.entries++;
      let workers = this.holders.get(hash);
      if (workers === undefined) this.holders.set(hash, workers = new Set());
      workers.add(workerId);
    }
  }

  protected removeBlocks(workerId: WorkerId, hashes: readonly BlockHash[]): void {
    const own = this.blocksOf.get(workerId);
    if (own === undefined) return;
    for (const hash of hashes) {
      if (!own.delete(hash)) continue;
      this.entries--;
      const workers = this.holders.get(hash)!;
      workers.delete(workerId);
      if (workers.size === 0) this.holders.delete(hash);
    }
  }

  protected clearBlocks(workerId: WorkerId): void {
    const own = this.blocksOf.get(workerId);
    if (own !== undefined) this.removeBlocks(workerId, [...own]);
  }

  protected dropWorker(workerId: WorkerId): void {
    this.clearBlocks(workerId);
    this.blocksOf.delete(workerId);
  }

  workerBlockHashes(workerId: WorkerId): BlockHash[] {
    return [...(this.blocksOf.get(workerId) ?? [])];
  }

  holds(workerId: WorkerId, hash: BlockHash): boolean {
    return this.blocksOf.get(workerId)?.has(hash) ?? false;
  }

  findMatches(hashes: readonly BlockHash[]): Map<WorkerId, number> {
    const first = hashes.length > 0 ? this.holders.get(hashes[0]!) : undefined;
    return prefixDepths(hashes, first ?? [], (workerId, hash) => this.holders.get(hash)?.has(workerId) ?? false);
  }
}

/**
 * The prefix walk behind every findMatches but the bitset index's: starting from the workers holding the first
 * block, follows the chain of hashes and records for each worker how many leading blocks it holds in a row.
 */
export function prefixDepths(hashes: readonly BlockHash[], firstHolders: Iterable<WorkerId>,
  holds: (workerId: WorkerId, hash: BlockHash) => boolean): Map<WorkerId, number> {
  const depths = new Map<WorkerId, number>();
  const active = new Set(firstHolders);
  let depth = 1;
  for (; depth < hashes.length && active.size > 0; depth++) {
    const hash = hashes[depth]!;
    for (const workerId of active) {
      if (holds(workerId, hash)) continue;
      depths.set(workerId, depth);
      active.delete(workerId);
    }
  }
  for (const workerId of active) depths.set(workerId, depth);
  return depths;
}

// ---------------------------------------------------------------------------------------------------------------
// Flat bitsets over an open-addressing table: the fast version

/**
 * One 32-bit half of a 16-hex-digit hash, read without allocating. Branded hashes are validated at the boundary
 * (parseBlockHash), so every character is 0-9 (codes 48-57) or a-f (97-102): the low nibble of the code plus 9
 * for letters (bit 6 set) is the digit's value. Branch-free, because hex digits of a hash are random and a
 * mispredicted branch per character was most of the lookup time.
 */
function hexWord(hash: string, start: number): number {
  let word = 0;
  for (let i = start; i < start + 8; i++) {
    const code = hash.charCodeAt(i);
    word = (word << 4) | ((code & 15) + 9 * (code >> 6));
  }
  return word;
}

function hexOf(high: number, low: number): BlockHash {
  return ((high >>> 0).toString(16).padStart(8, '0') + (low >>> 0).toString(16).padStart(8, '0')) as BlockHash;
}

const EMPTY = -1;
const TOMBSTONE = -2;
/** Table entries are [high word, low word, slot, unused]: 16 bytes, four to a cache line, one miss per probe. */
const ENTRY_WORDS = 4;
/** Slot records are [high word, low word, holder count, successor hint]: one cache line holds four. */
const SLOT_WORDS = 4;
const SLOT_HIGH = 0;
const SLOT_LOW = 1;
const SLOT_HOLDERS = 2;
const SLOT_NEXT = 3;
const INITIAL_TABLE_ENTRIES = 2048;
const INITIAL_SLOTS = 1024;

export interface BitsetKvIndexOptions {
  maxBufferedEvents?: number;
  /**
   * Mixed into table positions. Block hashes come from prompts anyone can send, and without a secret seed a
   * client could grind prompts whose hashes share table positions and make every lookup probe a long run. A
   * serving process passes a random seed; the default keeps tests reproducible.
   */
  hashSeed?: number;
}

/**
 * Each distinct hash owns a slot; slot s's worker bitset is words [s * wordsPerSlot, (s + 1) * wordsPerSlot) of
 * one Uint32Array. Hashes find their slot through an open-addressing table held in an Int32Array (linear probing,
 * load factor <= 1/2): no JavaScript object and no string per block, so a million blocks cost tens of megabytes
 * instead of hundreds. Each worker owns a bit, reused after it leaves (its bits are all clear by then). Freed
 * slots are reused too.
 *
 * Where the time goes: with a million blocks the table is far larger than the caches and the TLB, so a probe is a
 * cache miss and often a page walk, several times the cost of everything else per block. Requests follow chains,
 * though, and a stored event delivers a chain in order, so each slot remembers the slot of the block that last
 * followed it (the successor hint). The walk tries the hint first, checks its key, and probes the table only
 * when the chain branches somewhere else; slots of one chain are usually allocated side by side, so following
 * hints reads memory mostly in order.
 */
export class BitsetKvIndex extends KvIndexBase {
  private readonly seedHigh: number;
  private readonly seedLow: number;

  private table = new Int32Array(INITIAL_TABLE_ENTRIES * ENTRY_WORDS).fill(EMPTY);
  private tableMask = INITIAL_TABLE_ENTRIES - 1;
  /** Entries live or tombstoned: what bounds probe lengths. */
  private tableFilled = 0;

  private wordsPerSlot = 1;
  private slotCapacity = INITIAL_SLOTS;
  private bits = new Uint32Array(INITIAL_SLOTS);
  /** Per slot: its hash, how many workers hold it (freed at 0), and the successor hint (-1: none). */
  private slots = new Int32Array(INITIAL_SLOTS * SLOT_WORDS);
  private readonly freeSlots: number[] = [];
  private numSlotsUsed = 0;
  private numLiveSlots = 0;

  /**
   * Worker <-> bit. Both are replaced, not edited, when an existing entry changes (only when a worker leaves),
   * because answers of findMatches hold on to them; adding a worker only adds entries no earlier answer reads.
   */
  private bitOf = new Map<WorkerId, number>();
  private workerOfBit: (WorkerId | undefined)[] = [];
  /** Slots whose bitset has the worker's bit: what clearing or dumping a worker walks. */
  private readonly slotsOfBit: (Set<number> | undefined)[] = [];
  private readonly freeBits: number[] = [];
  private entries = 0;
  /** Scratch for findMatches: the bitset of workers still matching. */
  private active = new Uint32Array(1);

  constructor(options: BitsetKvIndexOptions = {}) {
    super(options);
    const seed = options.hashSeed ?? 0x2545f491;
    this.seedHigh = Math.imul(seed ^ 0x5bd1e995, 0x27d4eb2f);
    this.seedLow = seed | 0;
  }

  get numBlocks(): number {
    return this.numLiveSlots;
  }

  get numEntries(): number {
    return this.entries;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Hash table: (high, low) -> slot

  private position(high: number, low: number): number {
    let h = Math.imul(low ^ this.seedLow, 0x9e3779b1) ^ Math.imul(high ^ this.seedHigh, 0x85ebca77);
    h ^= h >>> 15;
    h = Math.imul(h, 0x2c1b3c6d);
    h ^= h >>> 12;
    return h & this.tableMask;
  }

  /** Table index of the key's entry, or -1. */
  private entryOf(high: number, low: number): number {
    const table = this.table;
    const mask = this.tableMask;
    for (let position = this.position(high, low); ; position = (position + 1) & mask) {
      const at = position * ENTRY_WORDS;
      const slot = table[at + 2]!;
      if (slot === EMPTY) return -1;
      if (slot >= 0 && table[at] === high && table[at + 1] === low) return at;
    }
  }

  private slotOf(hash: BlockHash): number {
    const at = this.entryOf(hexWord(hash, 0), hexWord(hash, 8));
    return at < 0 ? -1 : this.table[at + 2]!;
  }

  /** The slot of the hash (high, low) that follows `previous` in a chain, trying its successor hint first. */
  private nextSlot(previous: number, high: number, low: number): number {
    const slots = this.slots;
    const hint = slots[previous * SLOT_WORDS + SLOT_NEXT]!;
    if (hint >= 0) {
      const at = hint * SLOT_WORDS;
      if (slots[at + SLOT_HIGH] === high && slots[at + SLOT_LOW] === low && slots[at + SLOT_HOLDERS]! > 0) return hint;
    }
    const entry = this.entryOf(high, low);
    return entry < 0 ? -1 : this.table[entry + 2]!;
  }

  /** Adds a key known to be absent. */
  private insertEntry(high: number, low: number, slot: number): void {
    if (2 * (this.tableFilled + 1) > this.tableMask + 1) this.rehash();
    const table = this.table;
    const mask = this.tableMask;
    let position = this.position(high, low);
    while (table[position * ENTRY_WORDS + 2]! >= 0) position = (position + 1) & mask;
    const at = position * ENTRY_WORDS;
    if (table[at + 2] === EMPTY) this.tableFilled++;
    table[at] = high;
    table[at + 1] = low;
    table[at + 2] = slot;
  }

  /** Doubles the table when live entries fill a quarter of it, else rebuilds it at its size to shed tombstones. */
  private rehash(): void {
    const old = this.table;
    const numEntries = 4 * this.numLiveSlots >= this.tableMask + 1 ? 2 * (this.tableMask + 1) : this.tableMask + 1;
    this.table = new Int32Array(numEntries * ENTRY_WORDS).fill(EMPTY);
    this.tableMask = numEntries - 1;
    this.tableFilled = 0;
    for (let at = 0; at < old.length; at += ENTRY_WORDS) {
      if (old[at + 2]! >= 0) this.insertEntry(old[at]!, old[at + 1]!, old[at + 2]!);
    }
  }

  // -------------------------------------------------------------------------------------------------------------
  // Slots and worker bits

  private bitFor(workerId: WorkerId): number {
    let bit = this.bitOf.get(workerId);
    if (bit !== undefined) return bit;
    bit = this.freeBits.pop();
    if (bit === undefined) {
      bit = this.workerOfBit.length;
      this.workerOfBit.push(workerId);
    } else {
      this.workerOfBit = this.workerOfBit.slice();
      this.workerOfBit[bit] = workerId;
    }
    if (bit >= 32 * this.wordsPerSlot) this.widen(2 * this.wordsPerSlot);
    this.bitOf.set(workerId, bit);
    this.slotsOfBit[bit] = new Set();
    return bit;
  }

  /** More workers than bits: re-lay every slot with the new stride. */
  private widen(wordsPerSlot: number): void {
    const old = this.bits;
    const oldWords = this.wordsPerSlot;
    this.bits = new Uint32Array(this.slotCapacity * wordsPerSlot);
    for (let slot = 0; slot < this.numSlotsUsed; slot++) {
      for (let w = 0; w < oldWords; w++) this.bits[slot * wordsPerSlot + w] = old[slot * oldWords + w]!;
    }
    this.wordsPerSlot = wordsPerSlot;
    this.active = new Uint32Array(wordsPerSlot);
  }

  private slotFor(hash: BlockHash): number {
    const high = hexWord(hash, 0);
    const low = hexWord(hash, 8);
    const entry = this.entryOf(high, low);
    if (entry >= 0) return this.table[entry + 2]!;
    let slot = this.freeSlots.pop();
    if (slot === undefined) {
      if (this.numSlotsUsed === this.slotCapacity) this.growSlots();
      slot = this.numSlotsUsed++;
    }
    const at = slot * SLOT_WORDS;
    this.slots[at + SLOT_HIGH] = high;
    this.slots[at + SLOT_LOW] = low;
    this.slots[at + SLOT_HOLDERS] = 0;
    this.slots[at + SLOT_NEXT] = -1;
    this.insertEntry(high, low, slot);
    this.numLiveSlots++;
    return slot;
  }

  private growSlots(): void {
    const capacity = 2 * this.slotCapacity;
    const grow = <T extends Int32Array | Uint32Array>(old: T, make: (length: number) => T, stride: number): T => {
      const grown = make(capacity * stride);
      grown.set(old);
      return grown;
    };
    this.bits = grow(this.bits, (n) => new Uint32Array(n), this.wordsPerSlot);
    this.slots = grow(this.slots, (n) => new Int32Array(n), SLOT_WORDS);
    this.slotCapacity = capacity;
  }

  private releaseSlot(slot: number): void {
    const at = this.entryOf(this.slots[slot * SLOT_WORDS + SLOT_HIGH]!, this.slots[slot * SLOT_WORDS + SLOT_LOW]!);
    this.table[at + 2] = TOMBSTONE;
    this.freeSlots.push(slot);
    this.numLiveSlots--;
  }

  /** For a chain, the parent and each block point their successor hint at the block after them. */
  protected addBlocks(workerId: WorkerId, hashes: readonly BlockHash[], chainParent?: BlockHash | null): void {
    const bit = this.bitFor(workerId);
    const owned = this.slotsOfBit[bit]!;
    const word = bit >>> 5;
    const mask = 1 << (bit & 31);
    const isChain = chainParent !== undefined;
    let previous = isChain && chainParent !== null ? this.slotOf(chainParent) : -1;
    for (const hash of hashes) {
      const slot = this.slotFor(hash);
      if (previous >= 0) this.slots[previous * SLOT_WORDS + SLOT_NEXT] = slot;
      if (isChain) previous = slot;
      const at = slot * this.wordsPerSlot + word;
      if ((this.bits[at]! & mask) !== 0) continue;
      this.bits[at]! |= mask;
      this.slots[slot * SLOT_WORDS + SLOT_HOLDERS]!++;
      owned.add(slot);
      this.entries++;
    }
  }

  /** Clears the worker's bit in one slot it holds. */
  private unset(slot: number, word: number, mask: number): void {
    this.bits[slot * this.wordsPerSlot + word]! &= ~mask;
    this.entries--;
    if (--this.slots[slot * SLOT_WORDS + SLOT_HOLDERS]! === 0) this.releaseSlot(slot);
  }

  protected removeBlocks(workerId: WorkerId, hashes: readonly BlockHash[]): void {
    const bit = this.bitOf.get(workerId);
    if (bit === undefined) return;
    const slots = this.slotsOfBit[bit]!;
    for (const hash of hashes) {
      const slot = this.slotOf(hash);
      if (slot < 0 || !slots.delete(slot)) continue;
      this.unset(slot, bit >>> 5, 1 << (bit & 31));
    }
  }

  protected clearBlocks(workerId: WorkerId): void {
    const bit = this.bitOf.get(workerId);
    if (bit === undefined) return;
    const slots = this.slotsOfBit[bit]!;
    for (const slot of slots) this.unset(slot, bit >>> 5, 1 << (bit & 31));
    slots.clear();
  }

  protected dropWorker(workerId: WorkerId): void {
    const bit = this.bitOf.get(workerId);
    if (bit === undefined) return;
    this.clearBlocks(workerId);
    this.bitOf = new Map(this.bitOf);
    this.bitOf.delete(workerId);
    this.workerOfBit = this.workerOfBit.slice();
    this.workerOfBit[bit] = undefined;
    this.slotsOfBit[bit] = undefined;
    this.freeBits.push(bit);
  }

  workerBlockHashes(workerId: WorkerId): BlockHash[] {
    const bit = this.bitOf.get(workerId);
    if (bit === undefined) return [];
    return [...this.slotsOfBit[bit]!].map((slot) => hexOf(this.slots[slot * SLOT_WORDS + SLOT_HIGH]!, this.slots[slot * SLOT_WORDS + SLOT_LOW]!));
  }

  holds(workerId: WorkerId, hash: BlockHash): boolean {
    const bit = this.bitOf.get(workerId);
    if (bit === undefined) return false;
    const slot = this.slotOf(hash);
    return slot >= 0 && (this.bits[slot * this.wordsPerSlot + (bit >>> 5)]! & (1 << (bit & 31))) !== 0;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Matching

  findMatches(hashes: readonly BlockHash[]): ReadonlyMap<WorkerId, number> {
    const numHashes = hashes.length;
    let slot = numHashes > 0 ? this.slotOf(hashes[0]!) : -1;
    if (slot < 0) return NO_MATCHES;
    const words = this.wordsPerSlot;
    const bits = this.bits;
    const active = this.active;
    const depths = new Int32Array(32 * words);
    let numMatched = 0;
    for (let w = 0; w < words; w++) {
      active[w] = bits[slot * words + w]!;
      numMatched += popCount(active[w]!);
    }
    let depth = 1;
    for (; depth < numHashes; depth++) {
      const hash = hashes[depth]!;
      slot = this.nextSlot(slot, hexWord(hash, 0), hexWord(hash, 8));
      if (slot < 0) break;
      const base = slot * words;
      let remaining = 0;
      for (let w = 0; w < words; w++) {
        const before = active[w]!;
        if (before === 0) continue;
        const kept = before & bits[base + w]!;
        if (kept !== before) {
          record(depths, before & ~kept, w, depth);
          active[w] = kept;
        }
        remaining |= kept;
      }
      if (remaining === 0) return new BitDepths(depths, numMatched, this.workerOfBit, this.bitOf);
    }
    for (let w = 0; w < words; w++) if (active[w] !== 0) record(depths, active[w]!, w, depth);
    return new BitDepths(depths, numMatched, this.workerOfBit, this.bitOf);
  }
}

/** Every worker whose bit is set in `mask` (word w) matched exactly `depth` blocks. */
function record(depths: Int32Array, mask: number, word: number, depth: number): void {
  let rest = mask;
  while (rest !== 0) {
    const lowest = rest & -rest;
    depths[32 * word + 31 - Math.clz32(lowest)] = depth;
    rest ^= lowest;
  }
}

function popCount(word: number): number {
  let v = word - ((word >>> 1) & 0x55555555);
  v = (v & 0x33333333) + ((v >>> 2) & 0x33333333);
  return (Math.imul((v + (v >>> 4)) & 0x0f0f0f0f, 0x01010101) >>> 24);
}

const NO_MATCHES: ReadonlyMap<WorkerId, number> = new Map();

/**
 * findMatches' answer from the bitset index: depths by worker bit, read through the ReadonlyMap interface.
 * Filling a real Map took longer than the walk itself when a hundred workers share a system prompt and drop out
 * at the same block. Worker ids are resolved when read, through the index's worker <-> bit tables as they were
 * when the answer was made (the index replaces them rather than edit an entry), so it keeps naming its workers.
 */
class BitDepths implements ReadonlyMap<WorkerId, number> {
  readonly size: number;
  private readonly depths: Int32Array;
  private readonly workerOfBit: readonly (WorkerId | undefined)[];
  private readonly bitOf: ReadonlyMap<WorkerId, number>;

  constructor(depths: Int32Array, size: number, workerOfBit: readonly (WorkerId | undefined)[], bitOf: ReadonlyMap<WorkerId, number>) {
    this.depths = depths;
    this.size = size;
    this.workerOfBit = workerOfBit;
    this.bitOf = bitOf;
  }

  get(workerId: WorkerId): number | undefined {
    const bit = this.bitOf.get(workerId);
    if (bit === undefined || bit >= this.depths.length || this.workerOfBit[bit] !== workerId) return undefined;
    const depth = this.depths[bit]!;
    return depth > 0 ? depth : undefined;
  }

  has(workerId: WorkerId): boolean {
    return this.get(workerId) !== undefined;
  }

  forEach(callback: (depth: number, workerId: WorkerId, map: ReadonlyMap<WorkerId, number>) => void, thisArg?: unknown): void {
    for (const [workerId, depth] of this.entries()) callback.call(thisArg, depth, workerId, this);
  }

  *entries(): MapIterator<[WorkerId, number]> {
    for (let bit = 0; bit < this.depths.length; bit++) {
      const depth = this.depths[bit]!;
      if (depth > 0) yield [this.workerOfBit[bit]!, depth];
    }
  }

  *keys(): MapIterator<WorkerId> {
    for (const [workerId] of this.entries()) yield workerId;
  }

  *values(): MapIterator<number> {
    for (const [, depth] of this.entries()) yield depth;
  }

  [Symbol.iterator](): MapIterator<[WorkerId, number]> {
    return this.entries();
  }
}
