// The shared-memory link of the KV transfer (src/cluster/kv-tcp.ts) for a prefill and a decode worker on one host:
// a ring, one region of the host's shared-memory file system (/dev/shm, a tmpfs: its pages are memory, never a
// disk) that both processes map, per kept-alive transfer connection. The prefill side copies each block run from
// its KV pool into the ring (checksumming it in the same pass) and sends only the run's header over the TCP
// connection, with the run's place in the ring: the header is the doorbell. The decode side copies the run from the
// ring straight into its destination blocks (checksumming it on the way, against the header's CRC-32C) and hands
// the space back with a credit frame on the same connection. Descriptor, order and checks are the TCP link's; only
// where the bytes travel differs. The region outlives transfers: it is made and mapped once per connection (its
// pages faulted in once), so a transfer costs two memory copies and no system call per run beyond its header.
//
// Same host is decided by a host id both sides announce, not by address: a hash of the kernel's boot id and the
// device of the shared-memory file system. Two processes get the same id only when they run under one kernel boot
// and see the same /dev/shm (a container with a /dev/shm of its own gets another id, and the TCP link). Mapping
// needs the native addon (shmMap): a process without it announces no host id and offers no shared memory.
//
// The region's file (conduit-kv-<pid>-<random>, mode 0600) is made by the prefill side; the decode side removes its
// name as soon as it has mapped it (the pages stay until both unmap), the prefill side when the connection closes
// (whichever comes first: a peer that dies before mapping leaves nothing behind once the connection is gone).

import { createHash, randomBytes } from 'node:crypto';
import { readFileSync, statSync, unlinkSync } from 'node:fs';
import { join } from 'node:path';
import { tryLoadNativeAddon } from '../kernels/native.ts';

export const SHM_DIR = '/dev/shm';
const REGION_FILE = /^conduit-kv-\d+-[0-9a-f]{16}$/;

/** How a KV transfer may travel: 'auto' (shared memory when both workers share a host, else TCP) or 'tcp'. */
export type KvLinkPreference = 'auto' | 'tcp';

/** Bounds of a ring's size (CONDUIT_KV_SHM_RING_BYTES, or the transfer server's option). */
export const MIN_SHM_RING_BYTES = 64 << 10;
export const MAX_SHM_RING_BYTES = 1 << 30;
/**
 * The default ring: a few MiB, so that what the prefill side writes is, on one host, still in the shared cache when
 * the decode side copies it out, and a few runs of 256 KiB are in flight at once.
 */
export const DEFAULT_SHM_RING_BYTES = 4 << 20;

const native = tryLoadNativeAddon();
const shmMap = typeof native?.shmMap === 'function' ? native.shmMap.bind(native) : undefined;
const shmUnmap = typeof native?.shmUnmap === 'function' ? native.shmUnmap.bind(native) : undefined;

let cachedHostId: string | null | undefined;

/**
 * This host's id for the KV transfer's same-host test: null when the host has no usable shared-memory file system
 * or this process cannot map one (then only TCP is offered). Computed once per process.
 */
export function kvHostId(): string | null {
  if (cachedHostId !== undefined) return cachedHostId;
  try {
    if (!shmMap || !shmUnmap) throw new Error('no shared-memory mapping without the native addon');
    const boot = readFileSync('/proc/sys/kernel/random/boot_id', 'utf8').trim();
    const shm = statSync(SHM_DIR);
    if (!shm.isDirectory()) throw new Error(`${SHM_DIR} is not a directory`);
    cachedHostId = createHash('sha256').update(`${boot}:${shm.dev}:${shm.ino}`).digest('hex').slice(0, 32);
  } catch {
    cachedHostId = null;
  }
  return cachedHostId;
}

/** The ring size to use: CONDUIT_KV_SHM_RING_BYTES when set and valid, else the default. */
export function shmRingBytes(setting: number | undefined = Number(process.env.CONDUIT_KV_SHM_RING_BYTES)): number {
  if (setting === undefined || !Number.isSafeInteger(setting) || setting <= 0) return DEFAULT_SHM_RING_BYTES;
  return Math.min(MAX_SHM_RING_BYTES, Math.max(MIN_SHM_RING_BYTES, Math.ceil(setting / 4096) * 4096));
}

/** One mapped region: the prefill side's (made by it) or the decode side's view of it. */
export class ShmRegion {
  private closed = false;

  private constructor(readonly name: string, readonly bytes: Uint8Array, private readonly buffer: ArrayBuffer,
    private readonly owner: boolean) {}

  /**
   * A new region of `size` bytes under /dev/shm, every page backed, or null when none can be made, /dev/shm too full
   * to back it included (the transfer then goes over TCP).
   */
  static create(size: number): ShmRegion | null {
    if (!shmMap) return null;
    const name = `conduit-kv-${process.pid}-${randomBytes(8).toString('hex')}`;
    try {
      const buffer = shmMap(join(SHM_DIR, name), size, true);
      return new ShmRegion(name, new Uint8Array(buffer), buffer, true);
    } catch {
      return null;
    }
  }

  /**
   * Maps the region the prefill side named, of the size it said, and removes its name (the mapping keeps the
   * pages). Throws for a name that is not a region's, a missing file (code ENOENT) or one of another size.
   */
  static open(name: string, size: number): ShmRegion {
    if (!REGION_FILE.test(name)) throw new Error(`"${name.slice(0, 80)}" is not a KV transfer region name`);
    if (!shmMap) throw new Error('this process cannot map shared memory');
    if (!Number.isSafeInteger(size) || size < MIN_SHM_RING_BYTES || size > MAX_SHM_RING_BYTES) {
      throw new Error(`a region of ${size} bytes is out of bounds`);
    }
    const path = join(SHM_DIR, name);
    const buffer = shmMap(path, size, false);
    unlinkQuietly(path);
    return new ShmRegion(name, new Uint8Array(buffer), buffer, false);
  }

  /** Unmaps the region (its views see nothing from now on) and, the owner, removes its name if still there. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    shmUnmap?.(this.buffer);
    if (this.owner) unlinkQuietly(join(SHM_DIR, this.name));
  }
}

function unlinkQuietly(path: string): void {
  try {
    unlinkSync(path);
  } catch {
    // Removed by the other side already.
  }
}
