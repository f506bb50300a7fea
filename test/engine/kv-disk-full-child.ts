// Run by kv-disk-tier.test.ts in a mount namespace whose folder argv[2] is a small tmpfs: a disk tier in it whose
// writes fail because the filesystem is full (a filler file takes the space), then succeed once the filler is
// deleted, then fail again. Prints what the tier counted and warned as one JSON line.
import { readdirSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { DiskKvTier } from '../../src/engine/kv-cache/disk-tier.ts';
import type { BlockHash } from '../../src/protocols/kv-events.ts';

const dir = process.argv[2]!;
const BLOCK_BYTES = 4096;
const hash = (n: number) => n.toString(16).padStart(16, '0') as BlockHash;
const bytes = (n: number) => new Uint8Array(BLOCK_BYTES).fill(n);

/** Fills the filesystem to the last byte, one page at a time once the big writes no longer fit. */
function fill(): void {
  const filler = join(dir, 'filler');
  const parts: Buffer[] = [];
  for (const size of [1 << 20, 1 << 16, 1 << 12, 1 << 9, 1]) {
    for (;;) {
      try {
        writeFileSync(filler, Buffer.concat([...parts, Buffer.alloc(size)]));
        parts.push(Buffer.alloc(size));
      } catch {
        break;
      }
    }
  }
  writeFileSync(filler, Buffer.concat(parts));
}

const warnings: string[] = [];
const tierDir = join(dir, 'tier');
const disk = new DiskKvTier({ dir: tierDir, capacityBytes: 8 * (112 + BLOCK_BYTES), blockBytes: BLOCK_BYTES, fingerprint: 'ab'.repeat(16),
  warn: (message) => warnings.push(message) });
let failedEvents = 0;
disk.listen({ stored: () => {}, evicted: () => {}, failed: () => { failedEvents++; } });
fill();
for (let n = 1; n <= 3; n++) disk.put(hash(n), { bytes: bytes(n), parentHash: null });
await disk.flush();
for (let n = 4; n <= 5; n++) disk.put(hash(n), { bytes: bytes(n), parentHash: null });
await disk.flush();
const firstEpisode = { failed: disk.writeStats.failed, failedEvents, warnings: [...warnings],
  files: readdirSync(tierDir).filter((name) => !name.startsWith('.')) };
// Space comes back, then the disk fills again at once.
rmSync(join(dir, 'filler'));
disk.put(hash(6), { bytes: bytes(6), parentHash: null });
await disk.flush();
const storedAfterSpace = disk.has(hash(6));
fill();
disk.put(hash(7), { bytes: bytes(7), parentHash: null });
await disk.flush();
console.log(JSON.stringify({ tierDir, firstEpisode, storedAfterSpace, failed: disk.writeStats.failed, warnings }));
