// The shared-memory link of the KV transfer (src/cluster/kv-tcp.ts) for a prefill and a decode worker on one host:
// the prefill side writes each block run into a file on the host's shared-memory file system (/dev/shm, a tmpfs:
// the file's pages are memory, never a disk) and sends only the run's header over the TCP connection, with the
// file offset where the bytes are; the decode side reads them from the file straight into its destination blocks
// and checks the same length and CRC-32C as for a run that came over TCP. Descriptor, order and checks are the TCP
// link's; only where the bytes travel differs.
//
// Same host is decided by a host id both sides announce, not by address: a hash of the kernel's boot id and the
// device of the shared-memory file system. Two processes get the same id only when they run under one kernel boot
// and see the same /dev/shm (a container with a /dev/shm of its own gets another id, and the TCP link).
//
// One file per transfer (conduit-kv-<pid>-<random>), created by the prefill side with mode 0600 and removed by
// whichever side is done with it last (the decode side after reading, the prefill side when the connection closes).

import { createHash, randomBytes } from 'node:crypto';
import { closeSync, openSync, readFileSync, readSync, statSync, unlinkSync, writeSync } from 'node:fs';
import { join } from 'node:path';

export const SHM_DIR = '/dev/shm';
const SHM_FILE = /^conduit-kv-\d+-[0-9a-f]{16}$/;

/** How a KV transfer may travel: 'auto' (shared memory when both workers share a host, else TCP) or 'tcp'. */
export type KvLinkPreference = 'auto' | 'tcp';

let cachedHostId: string | null | undefined;

/**
 * This host's id for the KV transfer's same-host test: null when the host has no usable shared-memory file system
 * (then only TCP is offered). Computed once per process.
 */
export function kvHostId(): string | null {
  if (cachedHostId !== undefined) return cachedHostId;
  try {
    const boot = readFileSync('/proc/sys/kernel/random/boot_id', 'utf8').trim();
    const shm = statSync(SHM_DIR);
    if (!shm.isDirectory()) throw new Error(`${SHM_DIR} is not a directory`);
    cachedHostId = createHash('sha256').update(`${boot}:${shm.dev}:${shm.ino}`).digest('hex').slice(0, 32);
  } catch {
    cachedHostId = null;
  }
  return cachedHostId;
}

/** The prefill side's file of one transfer: runs appended, each at the offset write() returns. */
export class ShmRunWriter {
  private offset = 0;
  private closed = false;

  private constructor(readonly path: string, private readonly fd: number) {}

  /** A new file under /dev/shm, or null when none can be made (the transfer then goes over TCP). */
  static create(): ShmRunWriter | null {
    const path = join(SHM_DIR, `conduit-kv-${process.pid}-${randomBytes(8).toString('hex')}`);
    try {
      return new ShmRunWriter(path, openSync(path, 'wx', 0o600));
    } catch {
      return null;
    }
  }

  get name(): string {
    return this.path.slice(SHM_DIR.length + 1);
  }

  /** Appends the bytes; returns their offset in the file. Throws (ENOSPC, ...) when the file system is full. */
  write(bytes: Uint8Array): number {
    const at = this.offset;
    let done = 0;
    while (done < bytes.length) done += writeSync(this.fd, bytes, done, bytes.length - done, at + done);
    this.offset += bytes.length;
    return at;
  }

  /** Closes and removes the file (a reader that has it open keeps reading it). */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    closeSync(this.fd);
    try {
      unlinkSync(this.path);
    } catch {
      // The decode side removed it already.
    }
  }
}

/** The decode side's view of a transfer's file. */
export class ShmRunReader {
  private constructor(private readonly path: string, private readonly fd: number) {}

  /** Opens the file the prefill side named; throws for a name that is not a transfer file's. */
  static open(name: string): ShmRunReader {
    if (!SHM_FILE.test(name)) throw new Error(`"${name.slice(0, 80)}" is not a KV transfer file name`);
    const path = join(SHM_DIR, name);
    return new ShmRunReader(path, openSync(path, 'r'));
  }

  /** Reads `into.length` bytes at `offset` of the file into `into`; false when the file is shorter. */
  read(into: Uint8Array, offset: number): boolean {
    let done = 0;
    while (done < into.length) {
      const n = readSync(this.fd, into, done, into.length - done, offset + done);
      if (n === 0) return false;
      done += n;
    }
    return true;
  }

  /** Closes and removes the file. */
  close(): void {
    closeSync(this.fd);
    try {
      unlinkSync(this.path);
    } catch {
      // The prefill side removed it already.
    }
  }
}
