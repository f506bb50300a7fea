// The shared-memory KV link when /dev/shm cannot hold its ring (a container's /dev/shm is 64 MB by default, and every
// kept-alive transfer connection maps a ring of its own): the ring must be refused when it is made, and the transfer
// go over TCP. A ring the file system could not back used to be a sparse file whose first store to an unbacked page
// killed the prefill worker with SIGBUS. Each case runs a child in a mount namespace whose /dev/shm is a tmpfs of
// the given size (needs root and unshare).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { tryLoadNativeAddon } from '../../src/kernels/native.ts';

const CHILD = fileURLToPath(new URL('./kv-shm-full-child.ts', import.meta.url));

function unavailable(): string | false {
  if (process.getuid?.() !== 0) return 'needs root to mount a small tmpfs on /dev/shm in a mount namespace';
  if (typeof tryLoadNativeAddon()?.shmMap !== 'function') return 'the shared-memory link needs the native addon';
  const probe = spawnSync('unshare', ['-m', 'sh', '-c', 'mount -t tmpfs -o size=64k tmpfs /dev/shm'], { encoding: 'utf8' });
  return probe.status === 0 ? false : `cannot mount a tmpfs in a mount namespace here (unshare -m: ${(probe.stderr || probe.error?.message || '').trim()})`;
}
const skip = unavailable();

function pullWithShmOf(size: string): { status: number | null; signal: NodeJS.Signals | null; result?: { link: string; arrived: boolean }; stderr: string } {
  const child = spawnSync('unshare', ['-m', 'sh', '-c', `mount -t tmpfs -o size=${size} tmpfs /dev/shm && exec "$0" --import tsx "$1"`,
    process.execPath, CHILD], { encoding: 'utf8', timeout: 60_000 });
  const line = child.stdout.trim().split('\n').at(-1);
  return { status: child.status, signal: child.signal, stderr: child.stderr, ...(line ? { result: JSON.parse(line) } : {}) };
}

test('a /dev/shm with room for the ring: the transfer goes through shared memory', { skip }, () => {
  const run = pullWithShmOf('16m');
  assert.equal(run.status, 0, run.stderr);
  assert.deepEqual(run.result, { link: 'shm', arrived: true });
});

test('a /dev/shm too small for the ring: the transfer falls back to TCP and arrives whole, the process lives', { skip }, () => {
  const run = pullWithShmOf('256k');
  assert.equal(run.status, 0, `the child died (${run.signal ?? run.status}): ${run.stderr}`);
  assert.deepEqual(run.result, { link: 'tcp', arrived: true });
});
