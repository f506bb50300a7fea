// The disk tier under a worker's KV pool (--kv-offload-disk DIR, --kv-offload-disk-size SIZE): one file per block,
// persistent across restarts, checked on every read, LRU and bounded in blocks.
//
// File `<block hash>.kvb`, little-endian:
//   0   "CKVB"            magic
//   4   u32 version       1
//   8   32 ASCII hex      model fingerprint (modelFingerprint below): KV of another model, block size or dtype is
//                         never served; such files are deleted when the tier opens
//   40  16 ASCII hex      the block's hash (must equal the file name)
//   56  u32 hasParent, 60 16 ASCII hex parent hash (zeros when none): the stored event that announces the block
//   76  u32 payload bytes (must equal the pool's block bytes)
//   80  32 bytes          SHA-256 of bytes [0, 80) and the payload
//   112 payload           the block's KV, as readKvBlocks lays it out
// A write goes to a temporary name and is renamed into place, so a crash leaves either the old state or a stray
// temporary (deleted at open), never a half-written .kvb; a file torn or altered anyway (a failing disk, a copy cut
// short, a hand edit) fails the size check at open or the checksum at read, and is deleted, never served.
//
// Writes are asynchronous (fs.promises, libuv's thread pool; the checksum through WebCrypto, also off the thread):
// the worker's step loop never waits for the disk. At most maxPendingBytes are in flight; blocks offered beyond
// that are skipped (counted), which bounds memory when the disk is slower than eviction. A block is indexed (and
// its stored event sent) only once its file is in place. Reads (onboarding) are synchronous: the request needs the
// bytes before its step, and the cost model has already judged them worth it.
//
// The folder of one worker is used by that worker alone; the folder given on the command line is locked against a
// second process (acquireDiskTierLock), and each worker gets a subfolder of it.

import * as crypto from 'node:crypto';
import {
  closeSync, constants as fsConstants, fstatSync, linkSync, mkdirSync, openSync, readdirSync, readFileSync, readSync, renameSync, rmSync, statfsSync, statSync, unlinkSync,
  utimesSync, writeFileSync,
} from 'node:fs';
import { rename, unlink, utimes, writeFile } from 'node:fs/promises';
import { hostname } from 'node:os';
import { join } from 'node:path';
import { createLogger } from '../../util/log.ts';
import type { KvPoolLayout } from '../../kernels/types.ts';
import type { ModelConfig } from '../../model/config.ts';
import type { ModelWeights, Tensor } from '../../model/weights.ts';
import { isBlockHash, type BlockHash } from '../../protocols/kv-events.ts';
import type { KvBlockStore, TierBlock, TierListener } from './tiers.ts';

const MAGIC = 'CKVB';
const VERSION = 1;
const HEADER_BYTES = 112;
const DIGEST_OFFSET = 80;
const SUFFIX = '.kvb';
const TEMP_MARK = '.tmp-';
const NO_PARENT = '0'.repeat(16);
/** Default bound on bytes being written at once. */
export const DEFAULT_MAX_PENDING_BYTES = 64 * 1024 * 1024;

export interface DiskKvTierOptions {
  /** This worker's folder (created if missing). */
  dir: string;
  capacityBytes: number;
  /** The pool's bytes per block; a file's payload must be exactly this. */
  blockBytes: number;
  /** modelFingerprint(...) of the model and KV layout the worker runs. */
  fingerprint: string;
  maxPendingBytes?: number;
  /** A monotonic clock in ms (default performance.now): write times, and the interval between failure warnings. */
  now?: () => number;
  /** Where the tier's warnings go (a full disk, too little free space at start); default: a warn line on stderr. */
  warn?: (message: string) => void;
}

/** A failing disk is warned about at most once in this many ms, however many episodes of failures it has. */
export const WRITE_FAILURE_WARN_INTERVAL_MS = 60_000;

/** What opening a folder found, and what it did about it. */
export interface DiskOpenReport {
  /** Blocks found valid and indexed. */
  blocks: number;
  /** Files of another model (fingerprint), deleted. */
  foreign: number;
  /** Files torn (wrong size or header) or leftover temporaries, deleted. */
  torn: number;
  /** Valid blocks beyond --kv-offload-disk-size (the least recently used), deleted. */
  evicted: number;
  /** Files that were to be deleted (for one of the reasons above) but could not be: `name: reason`. They stay in the folder, never served. */
  notDeleted: string[];
  /** Block files that could not be read (their header or their type): `name: reason`. Left as they are, not served. */
  unreadable: string[];
}

/** The report's problems in a few words each, for the start-up line: how many, and the first few by name. */
export function describeOpenReport(report: DiskOpenReport): string {
  const some = (list: string[]) => list.slice(0, 3).join('; ') + (list.length > 3 ? `; ${list.length - 3} more` : '');
  return (report.foreign > 0 ? `, ${report.foreign} of another model or KV layout (block size, dtype) deleted` : '')
    + (report.torn > 0 ? `, ${report.torn} torn or unfinished files deleted` : '')
    + (report.evicted > 0 ? `, ${report.evicted} beyond --kv-offload-disk-size deleted (least recently used)` : '')
    + (report.notDeleted.length > 0 ? `, ${report.notDeleted.length} that should go could not be deleted and stay unused (${some(report.notDeleted)})` : '')
    + (report.unreadable.length > 0 ? `, ${report.unreadable.length} could not be read and were skipped (${some(report.unreadable)})` : '');
}

export class DiskKvTier implements KvBlockStore {
  readonly tier = 'disk' as const;
  readonly capacityBlocks: number;
  readonly dir: string;
  readonly fileBytes: number;
  readonly openReport: DiskOpenReport;
  private readonly blockBytes: number;
  private readonly fingerprint: string;
  private readonly maxPendingBytes: number;
  /** Block hash -> parent hash, least recently used first. */
  private readonly index = new Map<BlockHash, BlockHash | null>();
  private readonly pending = new Map<BlockHash, Promise<void>>();
  private pendingBytes = 0;
  private tempCounter = 0;
  private skipped = 0;
  private failedWrites = 0;
  private listener: TierListener | undefined;
  private readonly now: () => number;
  private readonly warn: (message: string) => void;
  /** True from a failed write until a write succeeds: one warning per such episode (rate-limited as well). */
  private failing = false;
  private lastFailureWarning: number | undefined;

  constructor(options: DiskKvTierOptions) {
    this.dir = options.dir;
    this.blockBytes = options.blockBytes;
    this.fingerprint = options.fingerprint;
    if (!/^[0-9a-f]{32}$/.test(this.fingerprint)) throw new RangeError(`a disk tier fingerprint is 32 hex digits, got ${JSON.stringify(this.fingerprint)}`);
    this.fileBytes = HEADER_BYTES + this.blockBytes;
    this.capacityBlocks = Math.floor(options.capacityBytes / this.fileBytes);
    if (this.capacityBlocks < 1) {
      throw new RangeError(`--kv-offload-disk-size ${options.capacityBytes} bytes holds no KV block file of ${this.fileBytes} bytes`);
    }
    this.maxPendingBytes = options.maxPendingBytes ?? DEFAULT_MAX_PENDING_BYTES;
    this.now = options.now ?? (() => performance.now());
    const logger = options.warn === undefined ? createLogger('warn') : undefined;
    this.warn = options.warn ?? ((message) => logger!.warn(message));
    mkdirSync(this.dir, { recursive: true });
    this.openReport = this.scan();
    this.checkFreeSpace(options.capacityBytes);
  }

  /** Warns once when the folder's filesystem has less room left than the tier may fill (beyond what it holds). */
  private checkFreeSpace(capacityBytes: number): void {
    let free: number;
    try {
      const stats = statfsSync(this.dir);
      free = Number(stats.bavail) * Number(stats.bsize);
    } catch {
      return;
    }
    const room = free + this.index.size * this.fileBytes;
    if (room < capacityBytes) {
      this.warn(`KV disk tier ${this.dir}: its filesystem has ${free} bytes free (${room} with the blocks already there), less than the ${capacityBytes} bytes --kv-offload-disk-size gives it; block writes will fail once the disk is full`);
    }
  }

  get numBlocks(): number {
    return this.index.size;
  }

  /** Told when a write is in place and when the LRU bound pushes a block out (the tiers' events and stats). */
  listen(listener: TierListener): void {
    this.listener = listener;
  }

  /** Blocks not written because maxPendingBytes were already in flight, and writes that failed. */
  get writeStats(): { skipped: number; failed: number; pending: number } {
    return { skipped: this.skipped, failed: this.failedWrites, pending: this.pending.size };
  }

  has(hash: BlockHash): boolean {
    return this.index.has(hash);
  }

  /** The parent hash recorded with a block (undefined when the tier does not hold it). */
  parentOf(hash: BlockHash): BlockHash | null | undefined {
    return this.index.get(hash);
  }

  hashes(): BlockHash[] {
    return [...this.index.keys()];
  }

  get(hash: BlockHash): TierBlock | null {
    if (!this.index.has(hash)) return null;
    const path = this.pathOf(hash);
    let file: Buffer | null;
    try {
      file = this.readBlockFile(path);
    } catch {
      this.index.delete(hash);
      return null;
    }
    const parsed = file === null ? null : this.parse(file, hash);
    if (file === null || parsed === null || !this.checksumOk(file)) {
      this.index.delete(hash);
      try {
        unlinkSync(path);
      } catch {
        // already gone
      }
      return null;
    }
    const parentHash = this.index.get(hash)!;
    this.index.delete(hash);
    this.index.set(hash, parentHash);
    // The LRU order survives a restart through the files' modification times; best effort, off the thread.
    const nowSeconds = Date.now() / 1000;
    utimes(path, nowSeconds, nowSeconds).catch(() => {});
    return { bytes: new Uint8Array(file.buffer, file.byteOffset + HEADER_BYTES, this.blockBytes), parentHash };
  }

  /**
   * Makes a block the most recently used in the index (what the LRU bound pushes out last), without reading it. Its
   * file's time is left as it is: after a restart the order is that of the writes and reads.
   */
  touch(hash: BlockHash): void {
    if (!this.index.has(hash)) return;
    const parentHash = this.index.get(hash)!;
    this.index.delete(hash);
    this.index.set(hash, parentHash);
  }

  /** True while a block's write is in flight. */
  writing(hash: BlockHash): boolean {
    return this.pending.has(hash);
  }

  /** True while one more block would pass the bound on bytes in flight. */
  get busy(): boolean {
    return this.pendingBytes + this.fileBytes > this.maxPendingBytes;
  }

  /** Starts writing a block; false when refused (already here or being written, or the in-flight bound is reached). */
  put(hash: BlockHash, block: TierBlock): boolean {
    if (this.index.has(hash) || this.pending.has(hash)) return false;
    if (block.bytes.length !== this.blockBytes) throw new RangeError(`a disk block is ${this.blockBytes} bytes, got ${block.bytes.length}`);
    if (this.busy) {
      this.skipped++;
      return false;
    }
    this.pendingBytes += this.fileBytes;
    const write = this.write(hash, block).finally(() => {
      this.pending.delete(hash);
      this.pendingBytes -= this.fileBytes;
    });
    this.pending.set(hash, write);
    return true;
  }

  /** Resolves once every write in flight has finished. */
  async flush(): Promise<void> {
    while (this.pending.size > 0) await Promise.all([...this.pending.values()]);
  }

  /** Deletes every block file (the folder stays). */
  clear(): void {
    for (const hash of this.index.keys()) {
      try {
        unlinkSync(this.pathOf(hash));
      } catch {
        // already gone
      }
    }
    this.index.clear();
  }

  // -------------------------------------------------------------------------------------------------------------

  /**
   * A block file's bytes; null when the path is not a regular file of a block file's size (read no further: a
   * named pipe would block the worker in open or read for good, a file grown huge would take its memory). Throws
   * when it cannot be opened.
   */
  private readBlockFile(path: string): Buffer | null {
    const fd = openSync(path, fsConstants.O_RDONLY | fsConstants.O_NONBLOCK);
    try {
      const stat = fstatSync(fd);
      if (!stat.isFile() || stat.size !== this.fileBytes) return null;
      const file = Buffer.alloc(this.fileBytes);
      const read = readSync(fd, file, 0, this.fileBytes, 0);
      return read === this.fileBytes ? file : null;
    } finally {
      closeSync(fd);
    }
  }

  private pathOf(hash: BlockHash): string {
    return join(this.dir, hash + SUFFIX);
  }

  private header(hash: BlockHash, parentHash: BlockHash | null): Buffer {
    const header = Buffer.alloc(HEADER_BYTES);
    header.write(MAGIC, 0, 'latin1');
    header.writeUInt32LE(VERSION, 4);
    header.write(this.fingerprint, 8, 'latin1');
    header.write(hash, 40, 'latin1');
    header.writeUInt32LE(parentHash === null ? 0 : 1, 56);
    header.write(parentHash ?? NO_PARENT, 60, 'latin1');
    header.writeUInt32LE(this.blockBytes, 76);
    return header;
  }

  private async write(hash: BlockHash, block: TierBlock): Promise<void> {
    const start = this.now();
    const header = this.header(hash, block.parentHash);
    const file = Buffer.concat([header, block.bytes]);
    const digest = await crypto.webcrypto.subtle.digest('SHA-256', Buffer.concat([file.subarray(0, DIGEST_OFFSET), file.subarray(HEADER_BYTES)]));
    Buffer.from(digest).copy(file, DIGEST_OFFSET);
    const temp = join(this.dir, `${hash}${SUFFIX}${TEMP_MARK}${process.pid}-${this.tempCounter++}`);
    try {
      await writeFile(temp, file);
      await rename(temp, this.pathOf(hash));
    } catch (error) {
      this.failedWrites++;
      await unlink(temp).catch(() => {});
      this.writeFailed(error);
      this.listener?.failed?.(hash);
      return;
    }
    this.failing = false;
    this.index.set(hash, block.parentHash);
    this.listener?.stored(hash, block.parentHash, file.length, Math.max(0, this.now() - start));
    this.evictOverCapacity();
  }

  /**
   * One warning per episode of failed writes (a full disk fails every block until space comes back), and at most one
   * per WRITE_FAILURE_WARN_INTERVAL_MS: the failures themselves are counted (conduit_kv_offload_failed_blocks_total).
   */
  private writeFailed(error: unknown): void {
    if (this.failing) return;
    this.failing = true;
    // The tier's monotonic clock: after a wall-clock step back, Date.now() would keep the next episode quiet until it caught up.
    const at = this.now();
    if (this.lastFailureWarning !== undefined && at - this.lastFailureWarning < WRITE_FAILURE_WARN_INTERVAL_MS) return;
    this.lastFailureWarning = at;
    // Node's file errors already begin with their code ("ENOSPC: no space left on device, open ..."); others may not.
    const e = error as NodeJS.ErrnoException;
    const reason = !(e instanceof Error) ? String(error)
      : e.code !== undefined && !e.message.startsWith(e.code) ? `${e.code}: ${e.message}` : e.message;
    this.warn(`KV disk tier ${this.dir}: cannot write KV blocks (${reason}); blocks are not kept on disk until writes succeed again (counted in conduit_kv_offload_failed_blocks_total)`);
  }

  private evictOverCapacity(): void {
    while (this.index.size > this.capacityBlocks) {
      const oldest = this.index.keys().next().value as BlockHash;
      this.index.delete(oldest);
      unlink(this.pathOf(oldest)).catch(() => {});
      this.listener?.evicted(oldest);
    }
  }

  /** The header's fields if they fit this tier and the file's name and size; null otherwise. */
  private parse(file: Buffer, hash: BlockHash): { parentHash: BlockHash | null } | null {
    if (file.length !== this.fileBytes) return null;
    if (file.toString('latin1', 0, 4) !== MAGIC || file.readUInt32LE(4) !== VERSION) return null;
    if (file.toString('latin1', 8, 40) !== this.fingerprint || file.toString('latin1', 40, 56) !== hash) return null;
    if (file.readUInt32LE(76) !== this.blockBytes) return null;
    const hasParent = file.readUInt32LE(56);
    const parent = file.toString('latin1', 60, 76);
    if (hasParent > 1 || (hasParent === 1 && !isBlockHash(parent))) return null;
    return { parentHash: hasParent === 1 ? parent as BlockHash : null };
  }

  private checksumOk(file: Buffer): boolean {
    const digest = crypto.createHash('sha256').update(file.subarray(0, DIGEST_OFFSET)).update(file.subarray(HEADER_BYTES)).digest();
    return digest.equals(file.subarray(DIGEST_OFFSET, HEADER_BYTES));
  }

  /**
   * Indexes the folder's block files, least recently used (oldest modification) first: headers and sizes are
   * checked here (the payload's checksum at each read), files of another model and torn ones deleted.
   */
  private scan(): DiskOpenReport {
    const report: DiskOpenReport = { blocks: 0, foreign: 0, torn: 0, evicted: 0, notDeleted: [], unreadable: [] };
    // Counted under `reason` only once it is gone; what stays is named in notDeleted.
    const remove = (name: string, reason: 'foreign' | 'torn' | 'evicted') => {
      const failure = unlinkFailure(join(this.dir, name));
      if (failure === undefined) report[reason]++;
      else report.notDeleted.push(`${name}: ${failure}`);
    };
    const found: { hash: BlockHash; parentHash: BlockHash | null; mtimeMs: number }[] = [];
    const header = Buffer.alloc(HEADER_BYTES);
    for (const name of readdirSync(this.dir)) {
      const path = join(this.dir, name);
      if (name.includes(SUFFIX + TEMP_MARK)) {
        remove(name, 'torn');
        continue;
      }
      if (!name.endsWith(SUFFIX)) continue;
      const hash = name.slice(0, -SUFFIX.length);
      if (!isBlockHash(hash)) continue;
      let size: number;
      let mtimeMs: number;
      try {
        const stat = statSync(path);
        // Not a file (a named pipe would block the worker in open for good; a folder holds no block): nothing to
        // read, and nothing a tier wrote.
        if (!stat.isFile()) {
          remove(name, 'torn');
          continue;
        }
        size = stat.size;
        mtimeMs = stat.mtimeMs;
        const fd = openSync(path, fsConstants.O_RDONLY | fsConstants.O_NONBLOCK);
        try {
          header.fill(0);
          readSync(fd, header, 0, HEADER_BYTES, 0);
        } finally {
          closeSync(fd);
        }
      } catch (error) {
        report.unreadable.push(`${name}: ${errorReason(error)}`);
        continue;
      }
      const foreign = header.toString('latin1', 0, 4) === MAGIC && header.toString('latin1', 8, 40) !== this.fingerprint;
      // The header's own checks on a buffer of the file's claimed size: the payload is read (and checked) later.
      const claimed = size === this.fileBytes ? this.parse(Buffer.concat([header, Buffer.alloc(this.blockBytes)]), hash) : null;
      if (claimed === null) {
        remove(name, foreign ? 'foreign' : 'torn');
        continue;
      }
      found.push({ hash, parentHash: claimed.parentHash, mtimeMs });
    }
    found.sort((a, b) => a.mtimeMs - b.mtimeMs);
    for (const block of found) this.index.set(block.hash, block.parentHash);
    // A smaller size than last time: the least recently used go.
    while (this.index.size > this.capacityBlocks) {
      const oldest = this.index.keys().next().value as BlockHash;
      this.index.delete(oldest);
      remove(oldest + SUFFIX, 'evicted');
    }
    report.blocks = this.index.size;
    return report;
  }
}

/** Deletes a file; undefined when it is gone (also when it was gone already), else why it stays. */
function unlinkFailure(path: string): string | undefined {
  try {
    unlinkSync(path);
    return undefined;
  } catch (error) {
    return (error as NodeJS.ErrnoException).code === 'ENOENT' ? undefined : errorReason(error);
  }
}

/** A file error in a few words: Node's messages already begin with their code ("EACCES: permission denied, ..."). */
function errorReason(error: unknown): string {
  const e = error as NodeJS.ErrnoException;
  if (!(e instanceof Error)) return String(error);
  return e.code !== undefined ? e.code : e.message;
}

function unlinkQuietly(path: string): void {
  try {
    unlinkSync(path);
  } catch {
    // already gone
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Model fingerprint

/** Bytes hashed from each end of a tensor, and samples taken in between. */
const EDGE_BYTES = 4096;
const SAMPLES = 64;
const SAMPLE_BYTES = 256;

/**
 * 32 hex digits identifying the KV a model computes: its configuration, the KV layout (block size, dtype, heads),
 * and every tensor's name, type, shape and a sample of its bytes (both ends and 64 evenly spaced 256-byte pieces).
 * Hashing every byte of a large model would take seconds at start; the sample catches another model, another
 * quantization or another fine-tune, which change nearly every byte. Must be computed before the backend may
 * release the weights' bytes.
 */
export function modelFingerprint(config: ModelConfig, weights: ModelWeights, layout: Omit<KvPoolLayout, 'numBlocks'>): string {
  const hash = crypto.createHash('sha256');
  hash.update(JSON.stringify(config));
  hash.update(JSON.stringify([layout.numLayers, layout.blockSize, layout.numKvHeads, layout.headDim, layout.dtype]));
  const tensors: Tensor[] = [weights.tokenEmbedding, weights.outputNorm, weights.output];
  for (const layer of weights.layers) {
    for (const tensor of Object.values(layer)) if (tensor !== undefined) tensors.push(tensor as Tensor);
  }
  for (const tensor of tensors) {
    const { data } = tensor;
    hash.update(`${tensor.name}|${tensor.type}|${tensor.shape.join('x')}|${data.length}|`);
    hash.update(data.subarray(0, EDGE_BYTES));
    hash.update(data.subarray(Math.max(0, data.length - EDGE_BYTES)));
    if (data.length > 2 * EDGE_BYTES) {
      for (let k = 1; k < SAMPLES; k++) {
        const at = Math.floor((data.length - SAMPLE_BYTES) * k / SAMPLES);
        hash.update(data.subarray(at, at + SAMPLE_BYTES));
      }
    }
  }
  return hash.digest('hex').slice(0, 32);
}

// ---------------------------------------------------------------------------------------------------------------
// The folder lock

/** The disk tier's folder is held by another process (or already by this one): `conduit serve` says so in one line. */
export class DiskTierLockedError extends Error {
  override name = 'DiskTierLockedError';
}

/** Folders this process holds, so a second pool in the same process is refused too. */
const heldHere = new Set<string>();
const LOCK_FILE = 'conduit.lock';
/** How often a holder refreshes its lock file's modification time, and how old it may get before it counts as left. */
export const LOCK_REFRESH_MS = 10_000;
export const LOCK_STALE_MS = 30_000;

/** What a lock file says: the holder's pid and host (a lock written before hosts were recorded names none). */
interface LockHolder {
  pid: number | undefined;
  host: string | undefined;
  ageMs: number;
  text: string;
}

/**
 * Takes the disk tier's folder for this process: a lock file holding the pid and the host name, put in place whole
 * (written under a temporary name and linked to the lock's, which fails if it exists), so another process never
 * reads it half written. A lock is refused while its holder lives: on this host, a running process of that pid
 * other than this one (a lock naming this pid was left by this process's predecessor); on another host (a
 * container's process, in another pid namespace), a lock its holder keeps refreshing (every LOCK_REFRESH_MS; one
 * older than LOCK_STALE_MS was left). A lock left is taken over. A second holder in this process is refused. Returns
 * the release function (also run at exit).
 */
export function acquireDiskTierLock(dir: string): () => void {
  mkdirSync(dir, { recursive: true });
  const path = join(dir, LOCK_FILE);
  if (heldHere.has(path)) throw new DiskTierLockedError(`--kv-offload-disk ${dir} is already in use by this process`);
  const host = hostname();
  const text = `${process.pid}\n${host}\n`;
  for (let attempt = 0; attempt < 4; attempt++) {
    if (!placeLock(path, text)) {
      const holder = readLock(path);
      if (holder === undefined) continue; // gone meanwhile
      if (lockHeld(holder, host)) {
        const who = holder.pid === undefined ? 'another process'
          : `process ${holder.pid}${holder.host !== undefined && holder.host !== host ? ` on host ${holder.host}` : ''}`;
        const lapse = holder.pid === undefined || (holder.host !== undefined && holder.host !== host)
          ? `; a lock its holder stops refreshing lapses after ${LOCK_STALE_MS / 1000} s` : '';
        throw new DiskTierLockedError(`--kv-offload-disk ${dir} is locked by ${who} (${path})${lapse}; give each server its own folder`);
      }
      takeOverStale(path, holder);
      continue;
    }
    heldHere.add(path);
    // Tells a holder on another host (which cannot see this pid) that the lock is still held.
    const refresh = setInterval(() => {
      if (readFileSafe(path) !== text) return;
      const now = new Date();
      try {
        utimesSync(path, now, now);
      } catch {
        // the folder is gone or read-only: the lock file is then no better than its last time
      }
    }, LOCK_REFRESH_MS);
    refresh.unref();
    let released = false;
    const release = () => {
      if (released) return;
      released = true;
      clearInterval(refresh);
      heldHere.delete(path);
      process.off('exit', release);
      if (readFileSafe(path) === text) unlinkQuietly(path);
    };
    process.on('exit', release);
    return release;
  }
  throw new Error(`--kv-offload-disk ${dir}: could not take the lock ${path}`);
}

function readLock(path: string): LockHolder | undefined {
  let text: string;
  let mtimeMs: number;
  try {
    mtimeMs = statSync(path).mtimeMs;
    text = readFileSync(path, 'utf8');
  } catch {
    return undefined;
  }
  const [pidText = '', hostText = ''] = text.split('\n');
  const pid = /^\d+$/.test(pidText) ? Number(pidText) : undefined;
  return { pid: pid !== undefined && Number.isSafeInteger(pid) && pid > 0 ? pid : undefined, host: hostText !== '' ? hostText : undefined, ageMs: Date.now() - mtimeMs, text };
}

function lockHeld(holder: LockHolder, host: string): boolean {
  const fresh = holder.ageMs < LOCK_STALE_MS;
  // Unreadable content (a lock of another kind, or one cut short by a crash): its age is all there is to go by.
  if (holder.pid === undefined) return fresh;
  // Another host (a container's, with its own pid namespace: the pid says nothing here): only a holder refreshing
  // its lock says it still runs.
  if (holder.host !== undefined && holder.host !== host) return fresh;
  // This pid on this host is this process's predecessor (a container restarted after a crash runs as pid 1 again):
  // no process of this host can hold it, so it is taken over at once, not after LOCK_STALE_MS of refused starts.
  if (holder.pid === process.pid) return false;
  return processRuns(holder.pid);
}

/**
 * Removes a lock judged left, unless another process took it over meanwhile: the lock is moved aside (only one
 * process can move a given file), and if what was moved is no longer what was judged, it is put back.
 */
function takeOverStale(path: string, judged: LockHolder): void {
  const aside = `${path}.stale-${process.pid}-${crypto.randomBytes(6).toString('hex')}`;
  try {
    renameSync(path, aside);
  } catch {
    return; // moved or removed by another process: look again
  }
  const moved = readFileSafe(aside);
  unlinkQuietly(aside);
  // If a third process holds the lock by now, this fails and its lock stays.
  if (moved !== judged.text) placeLock(path, moved);
}

/**
 * Creates the lock file with its whole content, or returns false when it exists. The content goes to a temporary
 * name first and is linked into place; a filesystem without hard links gets it created exclusively and written.
 */
function placeLock(path: string, text: string): boolean {
  const temp = `${path}.${process.pid}-${crypto.randomBytes(6).toString('hex')}`;
  let linkError: unknown;
  try {
    writeFileSync(temp, text, { flag: 'wx' });
    linkSync(temp, path);
    return true;
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === 'EEXIST') return false;
    linkError = error;
  } finally {
    unlinkQuietly(temp);
  }
  try {
    writeFileSync(path, text, { flag: 'wx' });
    return true;
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code === 'EEXIST') return false;
    throw linkError ?? error;
  }
}

/** A subfolder a pool's worker keeps its blocks in (worker-<n>, and a process pool's prefill-<n> and decode-<n>). */
const WORKER_FOLDER = /^(worker|prefill|decode)-\d+$/;

/**
 * Deletes the per-worker subfolders of a held disk tier folder that none of `used` names: a run with more workers
 * left them, no worker of this run reads them, and --kv-offload-disk-size is split between this run's workers only,
 * so kept they would hold blocks beyond it. Only a folder holding nothing but what a disk tier writes is removed
 * (block files, their temporaries, a lock, such folders of its own): a folder of that name made by someone else stays.
 * Returns the names removed.
 */
export function removeUnusedWorkerFolders(dir: string, used: readonly string[]): string[] {
  const removed: string[] = [];
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    if (!entry.isDirectory() || !WORKER_FOLDER.test(entry.name) || used.includes(entry.name)) continue;
    const path = join(dir, entry.name);
    if (!holdsOnlyKvBlocks(path)) continue;
    rmSync(path, { recursive: true, force: true });
    removed.push(entry.name);
  }
  return removed.sort();
}

function holdsOnlyKvBlocks(dir: string): boolean {
  return readdirSync(dir, { withFileTypes: true }).every((entry) => entry.isDirectory()
    ? WORKER_FOLDER.test(entry.name) && holdsOnlyKvBlocks(join(dir, entry.name))
    : entry.isFile() && (entry.name === LOCK_FILE || entry.name.startsWith(`${LOCK_FILE}.`) || entry.name.endsWith(SUFFIX)
      || entry.name.includes(SUFFIX + TEMP_MARK)));
}

function readFileSafe(path: string): string {
  try {
    return readFileSync(path, 'utf8');
  } catch {
    return '';
  }
}

function processRuns(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    return (error as NodeJS.ErrnoException).code === 'EPERM';
  }
}
