// The disk tier (src/engine/kv-cache/disk-tier.ts): files that survive a restart, checksums that catch a torn or
// altered file (dropped, never served), another model's files deleted, the LRU bound of a full tier, tenants apart,
// and the folder lock against a second process. Then end to end: greedy tokens from disk equal the cold run's,
// after a restart too, and a corrupted block is recomputed instead of served.
import { afterEach, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, renameSync, rmSync, statfsSync, statSync, symlinkSync, truncateSync, utimesSync, writeFileSync } from 'node:fs';
import { hostname, tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import {
  acquireDiskTierLock, describeOpenReport, DiskKvTier, LOCK_REFRESH_MS, LOCK_STALE_MS, modelFingerprint, WRITE_FAILURE_WARN_INTERVAL_MS,
} from '../../src/engine/kv-cache/disk-tier.ts';
import { KvCacheManager } from '../../src/engine/kv-cache/manager.ts';
import { KvTiers } from '../../src/engine/kv-cache/tiers.ts';
import { Scheduler } from '../../src/engine/scheduler.ts';
import type { BlockHash } from '../../src/protocols/kv-events.ts';
import { nativeBackend } from '../../src/kernels/native.ts';
import { engineBackends } from '../helpers/backends.ts';
import { loadSharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { makeRequest, prompt, step, summary } from './scheduler-fixtures.ts';
import { flushPrimary, makeTieredCore, runGreedy, SLOW_PREFILL, TIER_TEST_BLOCK_SIZE, tierPrompt } from './kv-tiers-fixtures.ts';
import { loadModel } from '../../src/model/loader.ts';
import { ensureBuiltinModel } from '../../src/model/synthetic.ts';

const FINGERPRINT = 'ab'.repeat(16);
const OTHER_MODEL = 'cd'.repeat(16);
const BLOCK_BYTES = 64;

const dirs: string[] = [];
function tempDir(): string {
  const dir = mkdtempSync(join(tmpdir(), 'conduit-kv-disk-'));
  dirs.push(dir);
  return dir;
}
afterEach(() => {
  while (dirs.length > 0) rmSync(dirs.pop()!, { recursive: true, force: true });
});

const hash = (n: number) => n.toString(16).padStart(16, '0') as BlockHash;
const bytes = (n: number) => new Uint8Array(BLOCK_BYTES).fill(n);
const files = (dir: string) => readdirSync(dir).filter((name) => name.endsWith('.kvb')).sort();

function openDisk(dir: string, blocks = 8, fingerprint = FINGERPRINT): DiskKvTier {
  return new DiskKvTier({ dir, capacityBytes: blocks * (112 + BLOCK_BYTES), blockBytes: BLOCK_BYTES, fingerprint });
}

describe('disk tier: files', () => {
  test('blocks written are read back after a restart, in LRU order, with their parents', async () => {
    const dir = tempDir();
    const disk = openDisk(dir);
    const stored: string[] = [];
    disk.listen({ stored: (h) => stored.push(h), evicted: () => {} });
    disk.put(hash(1), { bytes: bytes(1), parentHash: null });
    disk.put(hash(2), { bytes: bytes(2), parentHash: hash(1) });
    assert.equal(disk.has(hash(1)), false, 'indexed only once the file is in place');
    await disk.flush();
    assert.deepEqual(stored.sort(), [hash(1), hash(2)]);
    assert.deepEqual(files(dir), [`${hash(1)}.kvb`, `${hash(2)}.kvb`]);

    const again = openDisk(dir);
    assert.deepEqual(again.openReport, { blocks: 2, foreign: 0, torn: 0, evicted: 0, notDeleted: [], unreadable: [] });
    assert.deepEqual(again.get(hash(2)), { bytes: bytes(2), parentHash: hash(1) });
    assert.deepEqual(again.get(hash(1))?.parentHash, null);
    assert.equal(again.get(hash(3)), null);
  });

  test('a corrupted payload is detected at read, deleted and never served', async () => {
    const dir = tempDir();
    const disk = openDisk(dir);
    disk.put(hash(1), { bytes: bytes(1), parentHash: null });
    await disk.flush();
    const path = join(dir, `${hash(1)}.kvb`);
    const file = readFileSync(path);
    file[112 + 5]! ^= 0xff;
    writeFileSync(path, file);
    const again = openDisk(dir);
    assert.equal(again.openReport.blocks, 1, 'the header is fine: found at open');
    assert.equal(again.get(hash(1)), null, 'the checksum fails: not served');
    assert.equal(again.has(hash(1)), false);
    assert.deepEqual(files(dir), [], 'and deleted');
  });

  test('a torn file, a leftover temporary and another model\'s file are deleted when the tier opens', async () => {
    const dir = tempDir();
    const disk = openDisk(dir);
    for (const n of [1, 2]) disk.put(hash(n), { bytes: bytes(n), parentHash: null });
    await disk.flush();
    truncateSync(join(dir, `${hash(1)}.kvb`), 100);
    writeFileSync(join(dir, `${hash(3)}.kvb.tmp-1-0`), 'half');
    const other = openDisk(tempDir(), 8, OTHER_MODEL);
    other.put(hash(4), { bytes: bytes(4), parentHash: null });
    await other.flush();
    writeFileSync(join(dir, `${hash(4)}.kvb`), readFileSync(join(other.dir, `${hash(4)}.kvb`)));
    const again = openDisk(dir);
    assert.deepEqual(again.openReport, { blocks: 1, foreign: 1, torn: 2, evicted: 0, notDeleted: [], unreadable: [] });
    assert.deepEqual(again.hashes(), [hash(2)]);
    assert.deepEqual(readdirSync(dir).sort(), [`${hash(2)}.kvb`]);
  });

  test('the report at open names what could not be deleted and what could not be read, and counts only what was deleted', async () => {
    const dir = tempDir();
    const disk = openDisk(dir);
    disk.put(hash(1), { bytes: bytes(1), parentHash: null });
    await disk.flush();
    // A folder under a block file's name, not empty: it is to go (not a block) but a file's unlink cannot take it.
    mkdirSync(join(dir, `${hash(2)}.kvb`));
    writeFileSync(join(dir, `${hash(2)}.kvb`, 'kept'), 'x');
    // A link to nothing under a block file's name: it cannot be read at all.
    symlinkSync(join(dir, 'nowhere'), join(dir, `${hash(3)}.kvb`));
    const again = openDisk(dir);
    assert.equal(again.openReport.blocks, 1);
    assert.equal(again.openReport.torn, 0, 'nothing was deleted');
    assert.deepEqual(again.openReport.notDeleted.map((line) => line.split(':')[0]), [`${hash(2)}.kvb`]);
    assert.deepEqual(again.openReport.unreadable, [`${hash(3)}.kvb: ENOENT`]);
    assert.match(describeOpenReport(again.openReport), new RegExp(`^, 1 that should go could not be deleted and stay unused \\(${hash(2)}\\.kvb: E[A-Z]+\\), 1 could not be read and were skipped \\(${hash(3)}\\.kvb: ENOENT\\)$`));
    assert.deepEqual(again.hashes(), [hash(1)]);
  });

  // A named pipe blocks whoever opens it for reading until a writer comes: the worker would hang at start or at a read.
  test('a named pipe under a block file\'s name is neither waited on at open nor at a read', { skip: process.platform === 'win32' }, async () => {
    const dir = tempDir();
    const disk = openDisk(dir);
    for (const n of [1, 2]) disk.put(hash(n), { bytes: bytes(n), parentHash: null });
    await disk.flush();
    rmSync(join(dir, `${hash(1)}.kvb`));
    assert.equal(spawnSync('mkfifo', [join(dir, `${hash(1)}.kvb`)]).status, 0);
    const diskTier = JSON.stringify(fileURLToPath(new URL('../../src/engine/kv-cache/disk-tier.ts', import.meta.url)));
    // In a child: the old behaviour hangs for good, which a timeout turns into a failure here.
    const run = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', `
      import { rmSync } from 'node:fs';
      import { join } from 'node:path';
      const { DiskKvTier } = await import(${diskTier});
      const open = () => new DiskKvTier({ dir: ${JSON.stringify(dir)}, capacityBytes: 8 * (112 + ${BLOCK_BYTES}), blockBytes: ${BLOCK_BYTES}, fingerprint: ${JSON.stringify(FINGERPRINT)} });
      const atOpen = open();
      // The same pipe put in place after the folder was read: the read finds it.
      const indexed = open();
      rmSync(join(${JSON.stringify(dir)}, '${hash(2)}.kvb'));
      const { execFileSync } = await import('node:child_process');
      execFileSync('mkfifo', [join(${JSON.stringify(dir)}, '${hash(2)}.kvb')]);
      console.log(JSON.stringify({ report: atOpen.openReport, read: indexed.get('${hash(2)}'), held: indexed.has('${hash(2)}') }));
    `], { encoding: 'utf8', timeout: 30_000 });
    assert.equal(run.status, 0, `the child hung or failed: ${run.stderr}`);
    assert.deepEqual(JSON.parse(run.stdout.trim()), { report: { blocks: 1, foreign: 0, torn: 1, evicted: 0, notDeleted: [], unreadable: [] }, read: null, held: false });
  });

  test('a full disk tier evicts its least recently used block, file and all', async () => {
    const dir = tempDir();
    const disk = openDisk(dir, 2);
    const evicted: string[] = [];
    disk.listen({ stored: () => {}, evicted: (h) => evicted.push(h) });
    disk.put(hash(1), { bytes: bytes(1), parentHash: null });
    await disk.flush();
    disk.put(hash(2), { bytes: bytes(2), parentHash: null });
    await disk.flush();
    assert.ok(disk.get(hash(1)), 'block 1 is used again');
    disk.put(hash(3), { bytes: bytes(3), parentHash: null });
    await disk.flush();
    assert.deepEqual(evicted, [hash(2)]);
    assert.deepEqual(disk.hashes(), [hash(1), hash(3)]);
    await new Promise((resolve) => setTimeout(resolve, 20)); // the unlink is asynchronous
    assert.deepEqual(files(dir), [`${hash(1)}.kvb`, `${hash(3)}.kvb`]);
    assert.deepEqual(openDisk(dir, 1).openReport, { blocks: 1, foreign: 0, torn: 0, evicted: 1, notDeleted: [], unreadable: [] },
      'reopened smaller: the older block goes, and the report says so');
  });

  test('writes beyond the in-flight bound are skipped, not queued without end', async () => {
    const disk = new DiskKvTier({ dir: tempDir(), capacityBytes: 1 << 20, blockBytes: BLOCK_BYTES, fingerprint: FINGERPRINT, maxPendingBytes: 2 * (112 + BLOCK_BYTES) });
    for (let n = 1; n <= 5; n++) disk.put(hash(n), { bytes: bytes(n), parentHash: null });
    assert.equal(disk.writeStats.skipped, 3);
    await disk.flush();
    assert.equal(disk.numBlocks, 2);
  });

  test('the model fingerprint changes with the model and the KV layout', { skip: skipUnlessShared('stories260K.gguf') }, async () => {
    const { loaded } = await loadSharedModel('stories260K.gguf');
    const layout = { numLayers: loaded.config.numLayers, blockSize: 16, numKvHeads: loaded.config.numKvHeads, headDim: loaded.config.headDim, dtype: 'f32' as const };
    const a = modelFingerprint(loaded.config, loaded.weights, layout);
    assert.match(a, /^[0-9a-f]{32}$/);
    assert.equal(modelFingerprint(loaded.config, loaded.weights, layout), a);
    assert.notEqual(modelFingerprint(loaded.config, loaded.weights, { ...layout, blockSize: 32 }), a);
    assert.notEqual(modelFingerprint(loaded.config, loaded.weights, { ...layout, dtype: 'f16' }), a);
    const changed = { ...loaded.weights, outputNorm: { ...loaded.weights.outputNorm, data: loaded.weights.outputNorm.data.slice() } };
    changed.outputNorm.data[0]! ^= 1;
    assert.notEqual(modelFingerprint(loaded.config, changed, layout), a);
  });
});

const FULL_DISK_CHILD = fileURLToPath(new URL('./kv-disk-full-child.ts', import.meta.url));

/** Why a small tmpfs cannot be mounted here (the full-disk case needs root and unshare), or false. */
function fullDiskUnavailable(): string | false {
  if (process.getuid?.() !== 0) return 'needs root to mount a small tmpfs in a mount namespace';
  const dir = mkdtempSync(join(tmpdir(), 'conduit-kv-disk-probe-'));
  const probe = spawnSync('unshare', ['-m', 'sh', '-c', 'mount -t tmpfs -o size=64k tmpfs "$0"', dir], { encoding: 'utf8' });
  rmSync(dir, { recursive: true, force: true });
  return probe.status === 0 ? false : `cannot mount a tmpfs in a mount namespace here (unshare -m: ${(probe.stderr || probe.error?.message || '').trim()})`;
}

describe('disk tier: a full disk', () => {
  test('failed writes are counted and warned about once per episode, naming the folder and the error', { skip: fullDiskUnavailable() }, () => {
    // A real full filesystem: a 1 MiB tmpfs in a mount namespace, filled to the last byte by the child.
    const run = spawnSync('unshare', ['-m', 'sh', '-c', 'mount -t tmpfs -o size=1m tmpfs "$2" && exec "$0" --import tsx "$1" "$2"',
      process.execPath, FULL_DISK_CHILD, tempDir()], { encoding: 'utf8', timeout: 60_000 });
    assert.equal(run.status, 0, run.stderr);
    const result = JSON.parse(run.stdout.trim().split('\n').at(-1)!) as {
      tierDir: string; storedAfterSpace: boolean; failed: number; warnings: string[];
      firstEpisode: { failed: number; failedEvents: number; warnings: string[]; files: string[] };
    };
    const first = result.firstEpisode;
    assert.equal(first.failed, 5);
    assert.equal(first.failedEvents, 5);
    assert.equal(first.warnings.length, 1, first.warnings.join('\n'));
    assert.ok(first.warnings[0]!.includes(result.tierDir), first.warnings[0]);
    assert.equal(first.warnings[0]!.match(/ENOSPC/g)?.length, 1, first.warnings[0]);
    assert.deepEqual(first.files, [], 'no temporary left behind');
    // Space came back, then the disk filled again at once: still rate-limited, the failures still counted.
    assert.equal(result.storedAfterSpace, true);
    assert.equal(result.failed, 6);
    assert.equal(result.warnings.length, 1, result.warnings.join('\n'));
  });

  test('a new episode of failed writes is warned about again once the warning interval has passed on the tier\'s clock', async () => {
    // Writes fail while a file stands where the tier's folder was (ENOTDIR), and succeed once the folder is back.
    const tierDir = join(tempDir(), 'tier');
    const warnings: string[] = [];
    let clockMs = 1_000;
    const disk = new DiskKvTier({ dir: tierDir, capacityBytes: 8 * (112 + BLOCK_BYTES), blockBytes: BLOCK_BYTES, fingerprint: FINGERPRINT,
      warn: (m) => warnings.push(m), now: () => clockMs });
    const episode = async (n: number) => {
      renameSync(tierDir, `${tierDir}.away`);
      writeFileSync(tierDir, '');
      disk.put(hash(n), { bytes: bytes(n), parentHash: null });
      await disk.flush();
      rmSync(tierDir);
      renameSync(`${tierDir}.away`, tierDir);
      disk.put(hash(n + 1), { bytes: bytes(n + 1), parentHash: null });
      await disk.flush();
      assert.equal(disk.has(hash(n + 1)), true, 'writes succeed again once the folder is back');
    };
    await episode(1);
    assert.equal(warnings.length, 1, warnings.join('\n'));
    assert.match(warnings[0]!, /ENOTDIR/);
    clockMs += WRITE_FAILURE_WARN_INTERVAL_MS - 1;
    await episode(3);
    assert.equal(warnings.length, 1, 'a second episode within the interval is counted, not warned about');
    clockMs += 1;
    await episode(5);
    assert.equal(warnings.length, 2, warnings.join('\n'));
    assert.equal(disk.writeStats.failed, 3);
  });

  test('a filesystem with less free space than the tier\'s size is warned about once at start, with both numbers', () => {
    const dir = tempDir();
    const warnings: string[] = [];
    const huge = 2 ** 60;
    const disk = new DiskKvTier({ dir, capacityBytes: huge, blockBytes: BLOCK_BYTES, fingerprint: FINGERPRINT, warn: (m) => warnings.push(m) });
    assert.ok(disk.capacityBlocks > 0);
    assert.equal(warnings.length, 1, warnings.join('\n'));
    const stats = statfsSync(dir);
    const free = Number(stats.bavail) * Number(stats.bsize);
    assert.ok(warnings[0]!.includes(dir), warnings[0]);
    assert.ok(warnings[0]!.includes(`${huge} bytes`), warnings[0]);
    const said = Number(/has (\d+) bytes free/.exec(warnings[0]!)?.[1]);
    assert.ok(Math.abs(said - free) < 64 * 1024 * 1024, `free bytes ${said} vs statfs ${free}`);

    const fits: string[] = [];
    new DiskKvTier({ dir: tempDir(), capacityBytes: 8 * (112 + BLOCK_BYTES), blockBytes: BLOCK_BYTES, fingerprint: FINGERPRINT, warn: (m) => fits.push(m) });
    assert.deepEqual(fits, []);
  });
});

describe('disk tier: lock', () => {
  test('a second holder in this process is refused; the lock is free again once released', () => {
    const dir = tempDir();
    const release = acquireDiskTierLock(dir);
    assert.throws(() => acquireDiskTierLock(dir), /already in use by this process/);
    release();
    acquireDiskTierLock(dir)();
  });

  test('a lock held by another running process is refused; a stale one is taken over', async () => {
    const dir = tempDir();
    const child = spawn(process.execPath, ['-e', 'setTimeout(() => {}, 30000)'], { stdio: 'ignore' });
    try {
      writeFileSync(join(dir, 'conduit.lock'), `${child.pid}\n`);
      assert.throws(() => acquireDiskTierLock(dir), new RegExp(`locked by process ${child.pid}`));
    } finally {
      child.kill();
      await new Promise((resolve) => child.once('exit', resolve));
    }
    const release = acquireDiskTierLock(dir);
    assert.equal(readFileSync(join(dir, 'conduit.lock'), 'utf8'), `${process.pid}\n${hostname()}\n`);
    release();
    assert.deepEqual(readdirSync(dir), []);
  });

  // Two containers sharing a volume each see their own pid namespace: the other's pid (often 1, as this one's) says
  // nothing about whether it runs. Its refreshed lock does.
  test('a lock from another host, or unreadable, is refused while refreshed and taken over once it lapses', () => {
    const dir = tempDir();
    const path = join(dir, 'conduit.lock');
    const lapsed = (Date.now() - LOCK_STALE_MS - 5_000) / 1000;
    for (const holder of [`${process.pid}\nother-host\n`, `999999999\nother-host\n`, '']) {
      writeFileSync(path, holder);
      assert.throws(() => acquireDiskTierLock(dir), /is locked by .*lapses after 30 s/, JSON.stringify(holder));
      assert.equal(readFileSync(path, 'utf8'), holder, 'a held lock is left as it is');
      utimesSync(path, lapsed, lapsed);
      const release = acquireDiskTierLock(dir);
      assert.equal(readFileSync(path, 'utf8'), `${process.pid}\n${hostname()}\n`, JSON.stringify(holder));
      release();
    }
    writeFileSync(path, `${process.pid}\nother-host\n`);
    assert.throws(() => acquireDiskTierLock(dir), new RegExp(`locked by process ${process.pid} on host other-host`));
    assert.deepEqual(readdirSync(dir), ['conduit.lock'], 'no temporary left behind');
  });

  test('a fresh lock naming this pid on this host (a predecessor that crashed, as a restarted container\'s pid 1) is taken over at once', () => {
    const dir = tempDir();
    const path = join(dir, 'conduit.lock');
    for (const holder of [`${process.pid}\n${hostname()}\n`, `${process.pid}\n`]) {
      writeFileSync(path, holder);
      const release = acquireDiskTierLock(dir);
      assert.equal(readFileSync(path, 'utf8'), `${process.pid}\n${hostname()}\n`, JSON.stringify(holder));
      release();
    }
  });

  test('the holder refreshes its lock, so a server on another host sees it held', async () => {
    const dir = tempDir();
    const path = join(dir, 'conduit.lock');
    const child = spawn(process.execPath, ['--import', 'tsx', '-e', `
      const { acquireDiskTierLock } = await import(${JSON.stringify(fileURLToPath(new URL('../../src/engine/kv-cache/disk-tier.ts', import.meta.url)))});
      acquireDiskTierLock(${JSON.stringify(dir)});
      console.log('held');
      setTimeout(() => {}, 60000);
    `], { stdio: ['ignore', 'pipe', 'inherit'] });
    try {
      await new Promise((resolve) => child.stdout.once('data', resolve));
      const lapsed = (Date.now() - LOCK_STALE_MS - 5_000) / 1000;
      utimesSync(path, lapsed, lapsed);
      const deadline = Date.now() + LOCK_REFRESH_MS + 5_000;
      while (Date.now() - statSync(path).mtimeMs > LOCK_STALE_MS && Date.now() < deadline) await new Promise((resolve) => setTimeout(resolve, 200));
      assert.ok(Date.now() - statSync(path).mtimeMs < LOCK_STALE_MS, 'refreshed within LOCK_REFRESH_MS');
    } finally {
      child.kill();
      await new Promise((resolve) => child.once('exit', resolve));
    }
  });
});

describe('disk tier under the KV cache', () => {
  test('without a RAM tier, a block whose write is in flight is not copied again, and a saturated disk takes nothing', async () => {
    const dir = tempDir();
    let reads = 0;
    const io = { blockBytes: BLOCK_BYTES, read: () => { reads++; return bytes(9); }, write: () => {} };
    const disk = new DiskKvTier({ dir, capacityBytes: 1 << 20, blockBytes: BLOCK_BYTES, fingerprint: FINGERPRINT, maxPendingBytes: 112 + BLOCK_BYTES });
    const tiers = new KvTiers({ blockBytes: BLOCK_BYTES, disk });
    const kv = new KvCacheManager({ numBlocks: 4, blockSize: 4, tiers, blockIo: io });
    const scheduler = new Scheduler({ maxNumBatchedTokens: 64, maxNumSeqs: 4, maxModelLen: 64 }, kv);
    scheduler.addRequest(makeRequest('a', prompt(0, 9), { sampling: { maxTokens: 1 } }), 0);
    step(scheduler);
    assert.equal(kv.offloadEvictable(), 1, 'one write fits the in-flight bound');
    assert.equal(tiers.diskBusy, true);
    assert.equal(kv.offloadEvictable(), 0, 'nothing while the disk is saturated');
    assert.equal(reads, 1);
    await tiers.flush();
    assert.equal(kv.offloadEvictable(), 1, 'the other block once the write landed');
    assert.equal(kv.offloadEvictable(), 0, 'its write is in flight: not copied again');
    assert.equal(reads, 2);
    await tiers.flush();
    assert.equal(disk.numBlocks, 2);
  });

  test('writes that fail (the folder removed while serving) are counted, and no block is announced for them', async () => {
    const dir = tempDir();
    const io = { blockBytes: BLOCK_BYTES, read: () => bytes(9), write: () => {} };
    const disk = openDisk(dir);
    const tiers = new KvTiers({ blockBytes: BLOCK_BYTES, disk });
    const kv = new KvCacheManager({ numBlocks: 4, blockSize: 4, tiers, blockIo: io });
    const scheduler = new Scheduler({ maxNumBatchedTokens: 64, maxNumSeqs: 4, maxModelLen: 64 }, kv);
    rmSync(dir, { recursive: true, force: true });
    scheduler.addRequest(makeRequest('a', prompt(0, 9), { sampling: { maxTokens: 1 } }), 0);
    step(scheduler);
    kv.takeEvents();
    assert.equal(kv.offloadEvictable(), 2);
    await tiers.flush();
    assert.deepEqual(kv.takeEvents().filter((e) => e.tier === 'disk'), []);
    const stats = kv.stats().tiers!.tiers.disk!;
    assert.deepEqual({ failed: stats.failedOffloadBlocks, stored: stats.offloadBlocks, used: stats.usedBlocks }, { failed: 2, stored: 0, used: 0 });
  });

  test('an idle sweep into a disk tier smaller than the cached blocks writes each block once and ends', async () => {
    const dir = tempDir();
    let reads = 0;
    const io = { blockBytes: BLOCK_BYTES, read: () => { reads++; return bytes(9); }, write: () => {} };
    const disk = new DiskKvTier({ dir, capacityBytes: 2 * (112 + BLOCK_BYTES), blockBytes: BLOCK_BYTES, fingerprint: FINGERPRINT });
    const tiers = new KvTiers({ blockBytes: BLOCK_BYTES, disk });
    const kv = new KvCacheManager({ numBlocks: 8, blockSize: 4, tiers, blockIo: io });
    const scheduler = new Scheduler({ maxNumBatchedTokens: 64, maxNumSeqs: 4, maxModelLen: 64 }, kv);
    scheduler.addRequest(makeRequest('a', prompt(0, 17), { sampling: { maxTokens: 1 } }), 0);
    step(scheduler);
    const cached = kv.pool.freeBlocksInEvictionOrder().filter((b) => b.hash !== null).map((b) => b.hash);
    assert.equal(cached.length, 4);
    // As the worker does: sweep again while something was copied, once the writes landed.
    let calls = 0;
    for (let copied = -1; copied !== 0; calls++) {
      assert.ok(calls < 20, 'the idle sweep ends');
      copied = kv.offloadEvictable(undefined, Infinity);
      await tiers.flush();
    }
    assert.equal(reads, 2, 'only the two blocks the tier keeps were written');
    assert.deepEqual(disk.hashes(), cached.slice(-2), 'the two most recently used');
    assert.equal(tiers.stats().tiers.disk!.evictedBlocks, 0);
  });

  test('an idle sweep does not write a block again after its write failed', async () => {
    const dir = tempDir();
    let reads = 0;
    const io = { blockBytes: BLOCK_BYTES, read: () => { reads++; return bytes(9); }, write: () => {} };
    const tiers = new KvTiers({ blockBytes: BLOCK_BYTES, disk: openDisk(dir) });
    const kv = new KvCacheManager({ numBlocks: 4, blockSize: 4, tiers, blockIo: io });
    const scheduler = new Scheduler({ maxNumBatchedTokens: 64, maxNumSeqs: 4, maxModelLen: 64 }, kv);
    rmSync(dir, { recursive: true, force: true });
    scheduler.addRequest(makeRequest('a', prompt(0, 9), { sampling: { maxTokens: 1 } }), 0);
    step(scheduler);
    assert.equal(kv.offloadEvictable(undefined, Infinity), 2);
    await tiers.flush();
    assert.equal(tiers.stats().tiers.disk!.failedOffloadBlocks, 2);
    assert.equal(kv.offloadEvictable(undefined, Infinity), 0, 'the failed blocks wait for the next idle period');
    assert.equal(reads, 2);
    // A step allocates: the next idle period tries them again.
    scheduler.addRequest(makeRequest('b', prompt(1, 5), { sampling: { maxTokens: 1 } }), 0);
    step(scheduler);
    assert.ok(kv.offloadEvictable(undefined, Infinity) > 0);
    await tiers.flush();
  });

  test('two tenants: the same prompt under another salt never hits the disk tier; its own salt does', async () => {
    const dir = tempDir();
    const io = { blockBytes: BLOCK_BYTES, read: () => bytes(9), written: [] as number[], write(id: number) { this.written.push(id); } };
    const tiers = new KvTiers({ blockBytes: BLOCK_BYTES, disk: openDisk(dir) });
    const kv = new KvCacheManager({ numBlocks: 4, blockSize: 4, tiers, blockIo: io });
    const scheduler = new Scheduler({ maxNumBatchedTokens: 64, maxNumSeqs: 4, maxModelLen: 64 }, kv);
    const run = (id: string, tokens: number[], cacheSalt: string) => {
      scheduler.addRequest(makeRequest(id, tokens, { cacheSalt, sampling: { maxTokens: 1 } }), 0);
      return summary(step(scheduler).plan);
    };
    const a = prompt(0, 9);
    run('a', a, 'tenant-a');
    kv.offloadEvictable();
    await tiers.flush();
    assert.equal(tiers.disk!.numBlocks, 2);
    run('b', prompt(1, 13), 'tenant-a'); // evicts a's blocks from the pool
    assert.deepEqual(run('x', a, 'tenant-b'), ['x/0+9*1']);
    assert.equal(io.written.length, 0);
    run('c', prompt(2, 13), 'tenant-a');
    assert.deepEqual(run('a2', a, 'tenant-a'), ['a2/0+1*1']);
    assert.equal(io.written.length, 2);
    assert.equal(tiers.stats().tiers.disk!.onboardBlocks, 2);
  });
});

for (const [name, load, backends] of [
  ['stories260K', async () => (await loadSharedModel('stories260K.gguf')).loaded, engineBackends],
  ['the built-in model', async () => loadModel(await ensureBuiltinModel()), () => (nativeBackend.available() ? [nativeBackend] : [])],
] as const) {
  const skip = name === 'stories260K' ? skipUnlessShared('stories260K.gguf') : false;
  for (const backend of backends()) {
    describe(`disk tier end to end on ${name} (${backend.name})`, { skip }, () => {
      test('greedy tokens from disk, after a restart, and with a corrupted block equal the cold run\'s', async () => {
        const loaded = await load();
        const vocab = loaded.config.vocabSize;
        const dir = tempDir();
        const layout = { numLayers: loaded.config.numLayers, blockSize: TIER_TEST_BLOCK_SIZE, numKvHeads: loaded.config.numKvHeads, headDim: loaded.config.headDim, dtype: 'f32' as const };
        const fingerprint = modelFingerprint(loaded.config, loaded.weights, layout);
        const diskTiers = (blockBytes: number) => new KvTiers({
          blockBytes, ...SLOW_PREFILL, disk: new DiskKvTier({ dir, capacityBytes: 64 * (112 + blockBytes), blockBytes, fingerprint }),
        });
        const prompt = tierPrompt(3, 3 * TIER_TEST_BLOCK_SIZE + 5, vocab);

        const core = makeTieredCore(backend, loaded, diskTiers);
        const cold = runGreedy(core, prompt);
        core.offloadKv(undefined, Infinity);
        await core.kv.tiers!.flush();
        flushPrimary(core, vocab, 20);
        const fromDisk = runGreedy(core, prompt);
        assert.deepEqual(fromDisk.onboard && [fromDisk.onboard.ram, fromDisk.onboard.disk], [0, 3]);
        assert.deepEqual(fromDisk.tokens, cold.tokens, 'onboarded from disk');

        // A restart: a new core (new pool, nothing cached) over the same folder.
        const restarted = makeTieredCore(backend, loaded, diskTiers);
        assert.ok(restarted.kv.tiers!.disk!.numBlocks >= 3);
        const warm = runGreedy(restarted, prompt);
        assert.deepEqual(warm.onboard?.disk, 3, 'found again after the restart');
        assert.deepEqual(warm.tokens, cold.tokens);

        // Corrupt the second block's file: the first is onboarded, the rest recomputed, the bad file deleted.
        const hashes = restarted.kv.fullBlockHashes(restarted.kv.createTable(), prompt, prompt.length);
        const path = join(dir, `${hashes[1]}.kvb`);
        const file = readFileSync(path);
        file[file.length - 3]! ^= 0x40;
        writeFileSync(path, file);
        const third = makeTieredCore(backend, loaded, diskTiers);
        const damaged = runGreedy(third, prompt);
        assert.deepEqual(damaged.onboard?.disk, 1, 'only the block before the corrupted one');
        assert.equal(damaged.cachedTokens, TIER_TEST_BLOCK_SIZE);
        assert.deepEqual(damaged.tokens, cold.tokens, 'the corrupted block was recomputed, not served');
        assert.equal(third.stats().kvTiers!.tiers.disk!.corruptBlocks, 1);
        assert.ok(!readdirSync(dir).includes(`${hashes[1]}.kvb`) || third.kv.tiers!.disk!.has(hashes[1]!),
          'the corrupted file is gone (or rewritten from the recomputed block)');
        await third.kv.tiers!.flush();
        third.scheduler.checkInvariants();
      });
    });
  }
}
