// The checksum of each block run of a KV transfer between worker processes: CRC-32C (Castagnoli). The native addon
// computes it by carry-less multiply folding (VPCLMULQDQ) or with the crc32 instruction (native/checksum.cc: tens of
// GB/s, so the check costs the link little); a process without the addon uses the table version below, slower but
// giving the same values, so either side may lack the addon.

import { tryLoadNativeAddon } from '../kernels/native.ts';

const POLY = 0x82f63b78; // 0x1EDC6F41 reflected

let table: Uint32Array | undefined;

function crcTable(): Uint32Array {
  if (table) return table;
  table = new Uint32Array(256 * 8);
  for (let i = 0; i < 256; i++) {
    let c = i;
    for (let k = 0; k < 8; k++) c = c & 1 ? (c >>> 1) ^ POLY : c >>> 1;
    table[i] = c >>> 0;
  }
  for (let i = 0; i < 256; i++) {
    for (let s = 1; s < 8; s++) table[s * 256 + i] = ((table[(s - 1) * 256 + i]! >>> 8) ^ table[table[(s - 1) * 256 + i]! & 0xff]!) >>> 0;
  }
  return table;
}

/** CRC-32C in TypeScript (slice-by-8): the fallback, and the reference the native one is tested against. */
export function crc32cPortable(bytes: Uint8Array, crc = 0): number {
  const t = crcTable();
  let c = ~crc >>> 0;
  let i = 0;
  const n = bytes.length;
  for (; i + 8 <= n; i += 8) {
    const lo = (bytes[i]! | (bytes[i + 1]! << 8) | (bytes[i + 2]! << 16) | (bytes[i + 3]! << 24)) ^ c;
    c = t[7 * 256 + (lo & 0xff)]! ^ t[6 * 256 + ((lo >>> 8) & 0xff)]! ^ t[5 * 256 + ((lo >>> 16) & 0xff)]! ^ t[4 * 256 + (lo >>> 24)]!
      ^ t[3 * 256 + bytes[i + 4]!]! ^ t[2 * 256 + bytes[i + 5]!]! ^ t[256 + bytes[i + 6]!]! ^ t[bytes[i + 7]!]!;
  }
  for (; i < n; i++) c = (c >>> 8) ^ t[(c ^ bytes[i]!) & 0xff]!;
  return ~c >>> 0;
}

const native = tryLoadNativeAddon();
const nativeCrc = typeof native?.crc32c === 'function' ? native.crc32c.bind(native) : undefined;
const nativeCrcCopy = typeof native?.crc32cCopy === 'function' ? native.crc32cCopy.bind(native) : undefined;
const nativeCrcCopyRuns = typeof native?.crc32cCopyRuns === 'function' ? native.crc32cCopyRuns.bind(native) : undefined;

/** Where this process computes it: 'native' (the addon) or 'typescript'. */
export const KV_CHECKSUM_IMPLEMENTATION: 'native' | 'typescript' = nativeCrc ? 'native' : 'typescript';

/** CRC-32C of bytes, continuing crc (0 to start): kvChecksum(b, kvChecksum(a)) is the checksum of a then b. */
export function kvChecksum(bytes: Uint8Array, crc = 0): number {
  return nativeCrc ? nativeCrc(bytes, crc) : crc32cPortable(bytes, crc);
}

/**
 * Copies bytes into target at offset and returns their CRC-32C continuing crc: kvChecksum(bytes, crc) with the copy
 * made in the same pass (the addon checksums a few KiB, then copies them while they are in L1), so bytes that just
 * landed in a small buffer are read from cache once instead of twice. uncached: the addon's stores bypass the cache
 * (for a transfer larger than it; elsewhere a plain copy).
 */
export function kvChecksumCopy(bytes: Uint8Array, target: Uint8Array, offset: number, crc = 0, uncached = false): number {
  if (nativeCrcCopy) return nativeCrcCopy(bytes, target, offset, crc, uncached);
  const result = kvChecksum(bytes, crc);
  target.set(bytes, offset);
  return result;
}

/**
 * Checksum-and-copy of many ranges between one source and one destination, made in one call: the block runs of a
 * KV transfer's read (from the read buffer into the pool) or of a pack being written (from the pool into the pack,
 * or the ring). add() notes a range and returns its index; run() copies every noted range and leaves each one's
 * CRC-32C (continuing the crc it was added with) for crc(index); clear() starts over. One object is reused for every
 * transfer of a process side: no allocation per range or per transfer.
 */
export class KvChecksumBatch {
  /** [srcOffset, dstOffset, length, crc] per range. */
  private plan: Float64Array;
  count = 0;

  constructor(capacity = 64) {
    this.plan = new Float64Array(4 * capacity);
  }

  add(srcOffset: number, dstOffset: number, length: number, crc = 0): number {
    if (4 * this.count === this.plan.length) {
      const grown = new Float64Array(2 * this.plan.length);
      grown.set(this.plan);
      this.plan = grown;
    }
    const at = 4 * this.count;
    this.plan[at] = srcOffset;
    this.plan[at + 1] = dstOffset;
    this.plan[at + 2] = length;
    this.plan[at + 3] = crc;
    return this.count++;
  }

  /** Copies every range added since clear() from src to dst, each checksummed on the way (in one native call). */
  run(src: Uint8Array, dst: Uint8Array, uncached = false): void {
    if (this.count === 0) return;
    if (nativeCrcCopyRuns) {
      nativeCrcCopyRuns(src, dst, this.plan, this.count, uncached);
      return;
    }
    for (let i = 0, at = 0; i < this.count; i++, at += 4) {
      const from = this.plan[at]!;
      const length = this.plan[at + 2]!;
      this.plan[at + 3] = kvChecksumCopy(src.subarray(from, from + length), dst, this.plan[at + 1]!, this.plan[at + 3]!, uncached);
    }
  }

  /** The CRC-32C of range `index` after run(). */
  crc(index: number): number {
    return this.plan[4 * index + 3]!;
  }

  clear(): void {
    this.count = 0;
  }
}
