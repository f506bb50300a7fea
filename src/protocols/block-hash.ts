// The chained block hash shared by the KV cache (which blocks can be reused) and the router (which worker holds a
// request's prefix). Both sides must call these functions, never a copy of them.
//
// Why SHA-256 and not a fast non-cryptographic hash: a collision is not a slow path here, it is a wrong answer.
// Two different prefixes with the same hash make a request attend to another request's KV and generate garbage
// with no error anywhere. Non-cryptographic hashes (FNV, xxHash, a language's built-in string hash) can be
// collided on purpose by anyone who picks the prompt, and a shared cache takes prompts from every tenant. SHA-256
// truncated to 64 bits cannot be steered, and random collisions stay negligible: about n^2 / 2^65, under 1 in 10^7
// for a million distinct cached blocks. It costs about 1 µs per 16-token block (0.3 µs of it SHA-256).
//
// Bytes hashed per block (integers are little-endian uint32):
//   hasParent (0 or 1), the parent hash as 16 ASCII hex digits (16 zero bytes when none), token count, token ids,
//   cache-salt byte length, salt bytes (UTF-8), adapter-id byte length, adapter bytes (UTF-8)
// Every variable-length field is length-prefixed, so no two different inputs share an encoding. The parent goes in
// as text because copying 16 character codes is cheaper than decoding hex, and the token ids land 4-byte aligned.

import * as crypto from 'node:crypto';
import type { BlockHash } from './kv-events.ts';

/** Tokens per KV block when none is configured: every Conduit worker's default, and what a reader of them assumes. */
export const DEFAULT_BLOCK_SIZE = 16;

/** Keys besides the tokens that decide whether KV can be shared: same tokens under another salt or adapter differ. */
export interface BlockHashExtraKeys {
  /** Per tenant (or per request) secret; blocks are shared only between requests with the same salt. */
  cacheSalt?: string;
  /** LoRA adapter (or any weight variant) the KV was computed with. */
  adapterId?: string;
}

/** Extra keys in their hashed byte form, encoded once per request rather than once per block. */
export type EncodedExtraKeys = Uint8Array;

/** Hex digits kept from the SHA-256 digest: 64 bits. */
const HASH_DIGITS = 16;
const PARENT_OFFSET = 4;
const COUNT_OFFSET = PARENT_OFFSET + HASH_DIGITS;
const HEADER_BYTES = COUNT_OFFSET + 4;

export function encodeExtraKeys(keys: BlockHashExtraKeys = {}): EncodedExtraKeys {
  const salt = Buffer.from(keys.cacheSalt ?? '', 'utf8');
  const adapter = Buffer.from(keys.adapterId ?? '', 'utf8');
  const out = Buffer.alloc(8 + salt.length + adapter.length);
  out.writeUInt32LE(salt.length, 0);
  salt.copy(out, 4);
  out.writeUInt32LE(adapter.length, 4 + salt.length);
  adapter.copy(out, 8 + salt.length);
  return out;
}

/** crypto.hash (one shot, ~4x faster than createHash) exists from Node 20.12; older 20.x falls back. */
const sha256Hex: (data: Uint8Array) => string = typeof crypto.hash === 'function'
  ? (data) => crypto.hash('sha256', data, 'hex')
  : (data) => crypto.createHash('sha256').update(data).digest('hex');

let scratch = Buffer.alloc(256);
let scratchView = new DataView(scratch.buffer, scratch.byteOffset, scratch.byteLength);
/** The hashed bytes are always the first `size` of scratch; reusing the view saves an allocation per block. */
let hashedBytes = scratch.subarray(0, 0);

/** Hash of the block tokenIds[start, start + blockSize) whose predecessor block has hash `parent`. */
export function hashBlock(parent: BlockHash | null, tokenIds: ArrayLike<number>, start: number, blockSize: number,
  extraKeys: EncodedExtraKeys): BlockHash {
  if (start < 0 || start + blockSize > tokenIds.length) {
    throw new RangeError(`block [${start}, ${start + blockSize}) is outside the ${tokenIds.length} token ids`);
  }
  const size = HEADER_BYTES + 4 * blockSize + extraKeys.length;
  if (scratch.length < size) {
    scratch = Buffer.alloc(Math.max(size, 2 * scratch.length));
    scratchView = new DataView(scratch.buffer, scratch.byteOffset, scratch.byteLength);
  }
  if (hashedBytes.buffer !== scratch.buffer || hashedBytes.length !== size) hashedBytes = scratch.subarray(0, size);
  const view = scratchView;
  if (parent === null) {
    view.setUint32(0, 0, true);
    scratch.fill(0, PARENT_OFFSET, COUNT_OFFSET);
  } else {
    view.setUint32(0, 1, true);
    for (let i = 0; i < HASH_DIGITS; i++) scratch[PARENT_OFFSET + i] = parent.charCodeAt(i);
  }
  view.setUint32(COUNT_OFFSET, blockSize, true);
  let offset = HEADER_BYTES;
  for (let i = start; i < start + blockSize; i++, offset += 4) {
    const tokenId = tokenIds[i]!;
    if (tokenId >>> 0 !== tokenId) throw new RangeError(`token id at index ${i} must be an integer in [0, 2^32), got ${tokenId}`);
    view.setUint32(offset, tokenId, true);
  }
  scratch.set(extraKeys, offset);
  return sha256Hex(hashedBytes).slice(0, HASH_DIGITS) as BlockHash;
}

/**
 * Chained hashes of the full blocks of tokenIds, continuing `previous` (hashes already known for the first blocks).
 * Returns `previous` extended in place up to `numBlocks` blocks (default: every full block).
 */
export function extendBlockHashes(previous: BlockHash[], tokenIds: ArrayLike<number>, blockSize: number,
  extraKeys: EncodedExtraKeys, numBlocks = Math.floor(tokenIds.length / blockSize)): BlockHash[] {
  if (numBlocks * blockSize > tokenIds.length) {
    throw new RangeError(`${numBlocks} blocks of ${blockSize} need ${numBlocks * blockSize} tokens; only ${tokenIds.length} given`);
  }
  for (let i = previous.length; i < numBlocks; i++) {
    previous.push(hashBlock(i === 0 ? null : previous[i - 1]!, tokenIds, i * blockSize, blockSize, extraKeys));
  }
  return previous;
}

/** The router's view: chained hashes of every full block of a request's tokens. */
export function hashTokenBlocks(tokenIds: ArrayLike<number>, blockSize: number, extraKeys: BlockHashExtraKeys = {}): BlockHash[] {
  return extendBlockHashes([], tokenIds, blockSize, encodeExtraKeys(extraKeys));
}
