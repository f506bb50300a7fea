// Wire types of the KV cache: what a worker tells the router about the blocks it holds. Everything that crosses a
// process boundary is here, with its validation, so a producer and a consumer cannot drift apart.
//
// Serialization notes:
// - A block hash is 64 bits. JSON numbers lose integers above 2^53 and BigInt does not serialize at all, so a hash
//   travels (and is kept in memory) as 16 lowercase hex digits.
// - Event ids are per worker and increase by one per event; a consumer that sees a gap has lost events and must
//   resync from a dump of the worker's cached hashes (KvCacheManager.cachedBlockHashes()).

declare const blockHashBrand: unique symbol;

/**
 * Chained hash of one full block: it covers the block's tokens, its extra keys (cache salt, adapter) and, through
 * the parent hash, every token before it. Equal hashes mean equal prefixes, so the router can match a request
 * against a worker's blocks without ever seeing token ids.
 */
export type BlockHash = string & { readonly [blockHashBrand]: 'BlockHash' };

const BLOCK_HASH_PATTERN = /^[0-9a-f]{16}$/;

export function isBlockHash(value: unknown): value is BlockHash {
  return typeof value === 'string' && BLOCK_HASH_PATTERN.test(value);
}

/** Brands a string received from outside, rejecting anything that is not 16 lowercase hex digits. */
export function parseBlockHash(value: unknown, where = 'block hash'): BlockHash {
  if (!isBlockHash(value)) throw new TypeError(`${where} must be 16 lowercase hex digits, got ${JSON.stringify(value)}`);
  return value;
}

// ---------------------------------------------------------------------------------------------------------------
// Events
//
// Tiers: a worker may keep blocks below its primary pool (RAM, disk; src/engine/kv-cache/tiers.ts). An event about
// such a tier carries `tier`; an event without it is about the primary pool, as every event was before tiers
// existed, so old producers and consumers of primary events are unaffected. The same hash can be held by several
// tiers at once (tiers are inclusive): each tier's stored and removed events are independent.

/** A tier below the primary pool; events without a tier are about the primary pool. */
export type KvLowerTier = 'ram' | 'disk';
export const KV_LOWER_TIERS: readonly KvLowerTier[] = ['ram', 'disk'];

/** Full blocks became reusable on this worker. They extend the chain ending at parentHash (null: from the start). */
export interface KvStoredEvent {
  type: 'stored';
  eventId: number;
  /** In chain order: blockHashes[0]'s parent is parentHash, blockHashes[i]'s parent is blockHashes[i - 1]. */
  blockHashes: BlockHash[];
  parentHash: BlockHash | null;
  /** blockHashes.length * blockSize: only full blocks are ever stored. */
  tokenCount: number;
  blockSize: number;
  /** Absent: the primary pool. */
  tier?: KvLowerTier;
}

/** Blocks were evicted: the worker no longer holds these prefixes. */
export interface KvRemovedEvent {
  type: 'removed';
  eventId: number;
  blockHashes: BlockHash[];
  tier?: KvLowerTier;
}

/** The worker dropped every cached block of a tier (prefix cache reset; absent tier: the primary pool). */
export interface KvClearedEvent {
  type: 'cleared';
  eventId: number;
  tier?: KvLowerTier;
}

export type KvEvent = KvStoredEvent | KvRemovedEvent | KvClearedEvent;

/** Events as they leave a worker: the runtime adds the worker id, the KV cache does not know it. */
export interface WorkerKvEvents {
  workerId: string;
  events: KvEvent[];
}

// ---------------------------------------------------------------------------------------------------------------
// Validation at the boundary (a router receiving JSON from the wire)

function fail(what: string): never {
  throw new TypeError(`invalid KV event: ${what}`);
}

function parseHashList(value: unknown, field: string): BlockHash[] {
  if (!Array.isArray(value)) fail(`${field} must be an array of block hashes`);
  return value.map((item, i) => parseBlockHash(item, `${field}[${i}]`));
}

function parseCount(value: unknown, field: string, minimum: number): number {
  if (!Number.isSafeInteger(value) || (value as number) < minimum) fail(`${field} must be an integer >= ${minimum}, got ${JSON.stringify(value)}`);
  return value as number;
}

function parseTier(value: unknown): { tier?: KvLowerTier } {
  if (value === undefined || value === null || value === 'primary') return {};
  if (!(KV_LOWER_TIERS as readonly unknown[]).includes(value)) fail(`tier must be one of ${KV_LOWER_TIERS.join(', ')} (or absent), got ${JSON.stringify(value)}`);
  return { tier: value as KvLowerTier };
}

export function parseKvEvent(value: unknown): KvEvent {
  if (typeof value !== 'object' || value === null) fail('not an object');
  const record = value as Record<string, unknown>;
  const eventId = parseCount(record.eventId, 'eventId', 0);
  const tier = parseTier(record.tier);
  switch (record.type) {
    case 'stored': {
      const blockHashes = parseHashList(record.blockHashes, 'blockHashes');
      if (blockHashes.length === 0) fail('a stored event needs at least one block hash');
      const parentHash = record.parentHash === null ? null : parseBlockHash(record.parentHash, 'parentHash');
      const blockSize = parseCount(record.blockSize, 'blockSize', 1);
      const tokenCount = parseCount(record.tokenCount, 'tokenCount', 1);
      if (tokenCount !== blockHashes.length * blockSize) {
        fail(`tokenCount ${tokenCount} is not ${blockHashes.length} blocks x blockSize ${blockSize}`);
      }
      return { type: 'stored', eventId, blockHashes, parentHash, tokenCount, blockSize, ...tier };
    }
    case 'removed':
      return { type: 'removed', eventId, blockHashes: parseHashList(record.blockHashes, 'blockHashes'), ...tier };
    case 'cleared':
      return { type: 'cleared', eventId, ...tier };
    default:
      return fail(`unknown type ${JSON.stringify(record.type)} (expected stored, removed or cleared)`);
  }
}
