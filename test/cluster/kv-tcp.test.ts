// KV blocks between a prefill side and a decode side, over TCP and over shared memory: only the blocks the
// descriptor names move, each run lands where the decode side allocated it, a corrupted, truncated or
// unauthenticated transfer is detected, and a stream sends blocks as the prefill reports them, the rest after the
// handoff.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { readdirSync, readFileSync } from 'node:fs';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import {
  KvTransferError, KvTransferServer, pullKvBlocks, planRuns, setKvReceiveSettings, streamKvBlocks, type KvPullDescriptor,
} from '../../src/cluster/kv-tcp.ts';
import { kvHostId, SHM_DIR } from '../../src/cluster/kv-shm.ts';
import { kvBlockRunBytes, readKvBlocks, type KvPoolView } from '../../src/engine/handoff.ts';
import { kvPoolBytes, type KvPoolLayout } from '../../src/kernels/types.ts';

const TOKEN = 'kv-test-token';

function pool(numBlocks: number, fill: (i: number) => number): KvPoolView {
  const layout: KvPoolLayout = { numLayers: 3, numBlocks, blockSize: 4, numKvHeads: 2, headDim: 8, dtype: 'f16' };
  const buffer = new SharedArrayBuffer(kvPoolBytes(layout));
  const bytes = new Uint8Array(buffer);
  for (let i = 0; i < bytes.length; i++) bytes[i] = fill(i);
  return { pool: buffer, layout };
}

async function withServer<T>(source: KvPoolView,
  faults: { corruptRun?: number; truncateAfterRuns?: number; stallAfterRuns?: number } | undefined,
  run: (port: number, server: KvTransferServer) => Promise<T>, link: 'auto' | 'tcp' = 'auto', shmRingBytes?: number): Promise<T> {
  const server = new KvTransferServer({
    clusterToken: TOKEN, pool: source, isPinned: (id) => id !== 'unpinned', link, ...(faults ? { faults } : {}),
    ...(shmRingBytes ? { shmRingBytes } : {}),
  });
  const port = await server.listen(0, '127.0.0.1');
  try {
    return await run(port, server);
  } finally {
    await server.close();
  }
}

/** Ring files of this process's servers (or of another pid's) left in /dev/shm. */
function leftoverShmFiles(pid = process.pid): string[] {
  try {
    return readdirSync(SHM_DIR).filter((name) => name.startsWith(`conduit-kv-${pid}-`));
  } catch {
    return [];
  }
}

/** The shared-memory rings this process has mapped (inode and file), of one pid's servers or of any. */
function mappedRings(pid?: number): string[] {
  return readFileSync('/proc/self/maps', 'utf8').split('\n').filter((line) => line.includes(`/conduit-kv-${pid ?? ''}`))
    .map((line) => line.split(/\s+/).slice(4, 6).join(' ')).sort();
}

/** Until the condition holds (bounded). */
async function until(what: string, condition: () => boolean): Promise<void> {
  for (let turn = 0; !condition(); turn++) {
    if (turn > 1000) assert.fail(`timed out waiting until ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}

const shm = kvHostId() !== null;
const LINKS = shm ? ['tcp', 'shm'] as const : ['tcp'] as const;

describe('KV transfer between workers', () => {
  // Where /dev/shm cannot be used the shm cases below are not registered; the report says so with a skip.
  if (!shm) test('the shared-memory link', { skip: `${SHM_DIR} is not usable here: the shm link's tests do not run` }, () => {});
  const source = pool(16, (i) => (i * 131 + 7) & 0xff);
  const descriptor: KvPullDescriptor = {
    requestId: 'r1', sourceBlockIds: [3, 4, 5, 9], destinationBlockIds: [0, 1, 7, 2], layers: [0, 3],
  };

  for (const link of LINKS) {
    test(`${link}: the named blocks arrive, every layer, where the decode side allocated them; nothing else is written`, async () => {
      const destination = pool(8, () => 0);
      const result = await withServer(source, undefined, (port) => pullKvBlocks(descriptor, {
        clusterToken: TOKEN, host: '127.0.0.1', port, destination, link: link === 'tcp' ? 'tcp' : 'auto',
      }));
      assert.deepEqual(readKvBlocks(destination, descriptor.destinationBlockIds), readKvBlocks(source, descriptor.sourceBlockIds));
      const blockBytes = 2 * 3 * kvBlockRunBytes(source.layout);
      assert.equal(result.bytes, 4 * blockBytes);
      assert.equal(result.blocks, 4);
      // 3->0, 4->1 merge; 5->7 and 9->2 do not: 3 runs per (layer, K|V).
      assert.equal(result.runs, 3 * 2 * 3);
      assert.equal(result.link, link);
      assert.deepEqual(result.sourceBlockIds, descriptor.sourceBlockIds);
      assert.equal(result.overlapMs, 0, 'a pull is all after the prefill');
      for (const untouched of [3, 4, 5, 6]) assert.ok(readKvBlocks(destination, [untouched]).every((b) => b === 0), `block ${untouched} untouched`);
      assert.deepEqual(leftoverShmFiles(), []);
    });

    test(`${link}: a corrupted run is caught by its checksum, a truncated transfer by its missing runs`, async () => {
      for (const [faults, reason] of [[{ corruptRun: 5 }, 'checksum'], [{ truncateAfterRuns: 4 }, 'truncated'], [{ truncateAfterRuns: 0 }, 'truncated']] as const) {
        const destination = pool(8, () => 0);
        await withServer(source, faults, (port) => assert.rejects(
          pullKvBlocks(descriptor, { clusterToken: TOKEN, host: '127.0.0.1', port, destination, link: link === 'tcp' ? 'tcp' : 'auto' }),
          (e: unknown) => e instanceof KvTransferError && e.reason === reason));
      }
      assert.deepEqual(leftoverShmFiles(), []);
    });
  }

  if (shm) {
    test('either side set to tcp keeps a same-host transfer off shared memory', async () => {
      const destination = pool(8, () => 0);
      const result = await withServer(source, undefined, (port) => pullKvBlocks(descriptor, { clusterToken: TOKEN, host: '127.0.0.1', port, destination }), 'tcp');
      assert.equal(result.link, 'tcp');
      assert.deepEqual(readKvBlocks(destination, descriptor.destinationBlockIds), readKvBlocks(source, descriptor.sourceBlockIds));
    });
  }

  test('a layer range moves only those layers', async () => {
    const destination = pool(8, () => 0);
    const one = { ...descriptor, layers: [1, 2] as [number, number] };
    const result = await withServer(source, undefined, (port) => pullKvBlocks(one, { clusterToken: TOKEN, host: '127.0.0.1', port, destination }));
    assert.equal(result.runs, planRuns(one).length);
    assert.equal(result.bytes, 4 * 2 * kvBlockRunBytes(source.layout));
  });

  test('a wrong token, an unpinned request and a block outside the pool are refused', async () => {
    const destination = pool(8, () => 0);
    await withServer(source, undefined, async (port, server) => {
      await assert.rejects(pullKvBlocks(descriptor, { clusterToken: 'wrong', host: '127.0.0.1', port, destination }),
        (e: unknown) => e instanceof KvTransferError && e.reason === 'refused' && /wrong cluster token/.test(e.message));
      await assert.rejects(pullKvBlocks({ ...descriptor, requestId: 'unpinned' }, { clusterToken: TOKEN, host: '127.0.0.1', port, destination }),
        (e: unknown) => e instanceof KvTransferError && e.reason === 'refused');
      await assert.rejects(pullKvBlocks({ ...descriptor, sourceBlockIds: [3, 4, 5, 99] }, { clusterToken: TOKEN, host: '127.0.0.1', port, destination }),
        (e: unknown) => e instanceof KvTransferError && e.reason === 'refused' && /outside the pool/.test(e.message));
      assert.equal(server.refused, 3);
      // The server goes on serving.
      await pullKvBlocks(descriptor, { clusterToken: TOKEN, host: '127.0.0.1', port, destination });
      assert.equal(server.served, 1);
    });
  });

  for (const link of LINKS) {
    test(`${link}: a stream sends each block as the prefill reports it, the rest after the handoff, then its sources`, async () => {
      const destination = pool(8, () => 0);
      const stream = { requestId: 's1', destinationBlockIds: [0, 1, 7, 2], layers: [0, 3] as [number, number] };
      await withServer(source, undefined, async (port, server) => {
        server.started('s1');
        const handle = streamKvBlocks(stream, { clusterToken: TOKEN, host: '127.0.0.1', port, destination, link: link === 'tcp' ? 'tcp' : 'auto' });
        // The first two blocks are computed: they come now, before any handoff.
        server.progress('s1', [3, 4]);
        const runBytes = kvBlockRunBytes(source.layout);
        const early = Buffer.from(readKvBlocks(source, [3, 4]));
        for (let turn = 0; !Buffer.from(readKvBlocks(destination, [0, 1])).equals(early); turn++) {
          if (turn > 500) assert.fail('the reported blocks never arrived before the handoff');
          await new Promise((resolve) => setTimeout(resolve, 10));
        }
        assert.ok(readKvBlocks(destination, [7, 2]).every((b) => b === 0), 'nothing else came yet');
        // Preempted: its blocks are sent again (here from other source blocks).
        server.reset('s1');
        server.progress('s1', [10, 11]);
        server.handedOff('s1', [10, 11, 5, 9]);
        const result = await handle.result;
        assert.deepEqual(result.sourceBlockIds, [10, 11, 5, 9]);
        assert.equal(result.link, link);
        assert.deepEqual(readKvBlocks(destination, stream.destinationBlockIds), readKvBlocks(source, [10, 11, 5, 9]));
        // [3,4]->[0,1] once and [10,11]->[0,1] again, then 5->7 and 9->2: 6 blocks x 3 layers x K/V moved.
        assert.equal(result.bytes, 6 * 2 * 3 * runBytes);
        assert.ok(result.overlapMs > 0, `busy before the handoff: ${result.overlapMs} ms`);
      });
      assert.deepEqual(leftoverShmFiles(), []);
    });
  }

  for (const link of LINKS) {
    test(`${link}: a stream from firstBlock on leaves the blocks before it alone (the decode side holds them)`, async () => {
      const destination = pool(8, () => 0);
      const stream = { requestId: 'h1', destinationBlockIds: [6, 2], layers: [0, 3] as [number, number], firstBlock: 2 };
      await withServer(source, undefined, async (port, server) => {
        server.started('h1');
        const handle = streamKvBlocks(stream, { clusterToken: TOKEN, host: '127.0.0.1', port, destination, link: link === 'tcp' ? 'tcp' : 'auto' });
        server.progress('h1', [3, 4]);
        server.handedOff('h1', [3, 4, 5, 9]);
        const result = await handle.result;
        assert.deepEqual(result.sourceBlockIds, [3, 4, 5, 9], 'kv-done names the source of every position');
        assert.equal(result.blocks, 2);
        assert.equal(result.bytes, 2 * 2 * 3 * kvBlockRunBytes(source.layout), 'only the blocks from position 2 on moved');
        assert.deepEqual(readKvBlocks(destination, [6, 2]), readKvBlocks(source, [5, 9]));
        assert.ok(readKvBlocks(destination, [0, 1, 3, 4, 5, 7]).every((b) => b === 0), 'nothing else was written');
      });
      assert.deepEqual(leftoverShmFiles(), []);
    });
  }

  test('a stream ends with a refusal when its request ends without a handoff, or has other blocks than destinations', async () => {
    const destination = pool(8, () => 0);
    await withServer(source, undefined, async (port, server) => {
      server.started('s2');
      const ended = streamKvBlocks({ requestId: 's2', destinationBlockIds: [0, 1], layers: [0, 3] }, { clusterToken: TOKEN, host: '127.0.0.1', port, destination });
      server.progress('s2', [3]);
      server.ended('s2', 'finished on its first token');
      await assert.rejects(ended.result, (e: unknown) => e instanceof KvTransferError && e.reason === 'refused' && /finished on its first token/.test(e.message));
      server.started('s3');
      const mismatch = streamKvBlocks({ requestId: 's3', destinationBlockIds: [0, 1], layers: [0, 3] }, { clusterToken: TOKEN, host: '127.0.0.1', port, destination });
      server.handedOff('s3', [3, 4, 5]);
      await assert.rejects(mismatch.result, (e: unknown) => e instanceof KvTransferError && e.reason === 'refused' && /2 destinations/.test(e.message));
      // Cancelled by the decode side: rejects at once, the server goes on.
      server.started('s4');
      const cancelled = streamKvBlocks({ requestId: 's4', destinationBlockIds: [0], layers: [0, 3] }, { clusterToken: TOKEN, host: '127.0.0.1', port, destination });
      cancelled.cancel('aborted');
      await assert.rejects(cancelled.result, (e: unknown) => e instanceof KvTransferError && e.reason === 'cancelled');
      const after = await pullKvBlocks(descriptor, { clusterToken: TOKEN, host: '127.0.0.1', port, destination: pool(8, () => 0) });
      assert.equal(after.blocks, 4);
    });
  });

  test('large runs arrive intact across many reads (8 MiB, runs of 1 MiB)', async () => {
    const layout: KvPoolLayout = { numLayers: 4, numBlocks: 128, blockSize: 16, numKvHeads: 4, headDim: 64, dtype: 'f32' };
    const big = { pool: new SharedArrayBuffer(kvPoolBytes(layout)), layout };
    const bytes = new Uint8Array(big.pool);
    for (let i = 0; i < bytes.length; i += 4093) bytes[i] = (i >> 12) & 0xff;
    const ids = Array.from({ length: 64 }, (_, i) => i + 8);
    // Both ways of taking a run's bytes off the socket: through the read buffer (default) and read(2) into the block.
    for (const [link, direct] of [...LINKS.map((l) => [l, false] as const), ['tcp', true] as const]) {
      const destination = { pool: new SharedArrayBuffer(kvPoolBytes(layout)), layout };
      if (direct) setKvReceiveSettings({ directRead: true });
      try {
        const result = await withServer(big, undefined, (port) => pullKvBlocks(
          { requestId: 'big', sourceBlockIds: ids, destinationBlockIds: ids.map((i) => i + 40), layers: [0, 4] },
          { clusterToken: TOKEN, host: '127.0.0.1', port, destination, link: link === 'tcp' ? 'tcp' : 'auto' }));
        assert.equal(result.link, link);
        assert.equal(result.bytes, 64 * 2 * 4 * kvBlockRunBytes(layout));
        assert.ok(Buffer.from(readKvBlocks(destination, ids.map((i) => i + 40))).equals(Buffer.from(readKvBlocks(big, ids))), `${link}${direct ? ', direct' : ''}`);
      } finally {
        setKvReceiveSettings({ directRead: false });
      }
    }
  });

  for (const link of LINKS) {
    const opts = (port: number, destination: KvPoolView) => ({ clusterToken: TOKEN, host: '127.0.0.1', port, destination, link: link === 'tcp' ? 'tcp' as const : 'auto' as const });

    test(`${link}: transfers to one prefill worker go one after another on one kept-alive connection`, async () => {
      const before = new Set(mappedRings());
      let ringsOfFirst: string[] = [];
      await withServer(source, undefined, async (port, server) => {
        for (let i = 0; i < 4; i++) {
          const destination = pool(8, () => 0);
          const ids = [[3, 4, 5, 9], [0, 1, 2, 3], [9], [15, 14, 13, 12]][i]!;
          const result = await pullKvBlocks({ requestId: `k${i}`, sourceBlockIds: ids, destinationBlockIds: ids.map((_, j) => j + 2), layers: [0, 3] },
            opts(port, destination));
          assert.equal(result.link, link);
          assert.deepEqual(readKvBlocks(destination, ids.map((_, j) => j + 2)), readKvBlocks(source, ids), `transfer ${i}`);
          if (i === 0) ringsOfFirst = mappedRings().filter((ring) => !before.has(ring));
        }
        // A stream after the pulls, on the same connection.
        server.started('k-stream');
        const destination = pool(8, () => 0);
        const handle = streamKvBlocks({ requestId: 'k-stream', destinationBlockIds: [5, 6], layers: [0, 3] }, opts(port, destination));
        server.progress('k-stream', [7]);
        server.handedOff('k-stream', [7, 8]);
        assert.deepEqual((await handle.result).sourceBlockIds, [7, 8]);
        assert.deepEqual(readKvBlocks(destination, [5, 6]), readKvBlocks(source, [7, 8]));
        assert.equal(server.connections, 1, 'one connection for all five');
        assert.equal(server.reusedConnections, 4);
        assert.equal(server.served, 5);
        const rings = mappedRings().filter((ring) => !before.has(ring));
        assert.equal(ringsOfFirst.length, link === 'shm' ? 2 : 0, `shm: one ring, mapped by each side: ${ringsOfFirst.join(', ')}`);
        assert.deepEqual(rings, ringsOfFirst, 'the same ring served every transfer');
      });
      assert.deepEqual(leftoverShmFiles(), []);
    });

    test(`${link}: a transfer cancelled or aborted mid-way closes its connection; the next one goes on a new connection`, async () => {
      await withServer(source, { stallAfterRuns: 3 }, async (port, server) => {
        const first = await pullKvBlocks({ requestId: 'a0', sourceBlockIds: [1], destinationBlockIds: [1], layers: [0, 1] }, opts(port, pool(8, () => 0)));
        assert.equal(first.runs, 2, 'the first transfer (2 runs) is whole');
        // The second stalls after its first run (runs counted over the server's life): cancelled mid-way.
        const destination = pool(8, () => 0);
        server.started('a1');
        const stalled = streamKvBlocks({ requestId: 'a1', destinationBlockIds: [0, 1], layers: [0, 3] }, opts(port, destination));
        server.handedOff('a1', [3, 4]);
        await until('the first run of the stalled transfer was sent', () => server.runsSent === 3);
        assert.equal(server.connections, 1, 'it went on the kept-alive connection');
        stalled.cancel('test');
        await assert.rejects(stalled.result, (e: unknown) => e instanceof KvTransferError && e.reason === 'cancelled');
        await until('the prefill side saw the connection close', () => (server as unknown as { sockets: Set<unknown> }).sockets.size === 0);
        // An aborted one (the signal) on a new connection: closed too.
        const controller = new AbortController();
        const aborted = pullKvBlocks({ requestId: 'a2', sourceBlockIds: [3, 4], destinationBlockIds: [0, 1], layers: [0, 3] },
          { ...opts(port, pool(8, () => 0)), signal: controller.signal });
        await until('the aborted transfer is under way', () => server.connections === 2);
        controller.abort();
        await assert.rejects(aborted, (e: unknown) => e instanceof KvTransferError && e.reason === 'aborted');
        assert.equal(server.connections, 2, 'a new connection after the cancelled one');
      });
      // Without the fault, the next transfer goes on a fresh connection and lands whole.
      await withServer(source, undefined, async (port, server) => {
        const destination = pool(8, () => 0);
        await pullKvBlocks(descriptor, opts(port, destination));
        assert.deepEqual(readKvBlocks(destination, descriptor.destinationBlockIds), readKvBlocks(source, descriptor.sourceBlockIds));
        assert.equal(server.connections, 1);
      });
      assert.deepEqual(leftoverShmFiles(), []);
    });

    test(`${link}: a stalled transfer fails as a timeout at its own deadline; a deadline moved later holds`, async () => {
      await withServer(source, { stallAfterRuns: 0 }, async (port, server) => {
        const settled: string[] = [];
        const watch = (name: string, result: Promise<unknown>) => result.then(() => { settled.push(`${name} done`); }, (e: unknown) => {
          assert.ok(e instanceof KvTransferError && e.reason === 'timeout', String(e));
          settled.push(e.message);
        });
        // A stream whose deadline is moved from 50 ms to 600 ms, and a pull due at 150 ms: the pull fails first, and
        // the stream not at 50 ms (both transfers are in flight and idle meanwhile: the server sends nothing).
        server.started('late');
        const late = streamKvBlocks({ requestId: 'late', destinationBlockIds: [0], layers: [0, 1] }, { ...opts(port, pool(8, () => 0)), timeoutMs: 50 });
        late.deadline(600);
        const soon = pullKvBlocks({ requestId: 'soon', sourceBlockIds: [1], destinationBlockIds: [1], layers: [0, 1] },
          { ...opts(port, pool(8, () => 0)), timeoutMs: 150 });
        await Promise.all([watch('late', late.result), watch('soon', soon)]);
        assert.deepEqual(settled, ['KV transfer of soon took over 150 ms', 'KV transfer of late took over 600 ms']);
      });
    });

    test(`${link}: a kept-alive connection the prefill worker closed meanwhile is replaced without failing the transfer`, async () => {
      await withServer(source, undefined, async (port, server) => {
        await pullKvBlocks(descriptor, opts(port, pool(8, () => 0)));
        // The server drops its end; the decode side's idle connection may not have seen it yet when the next starts.
        for (const socket of (server as unknown as { sockets: Set<{ destroy(): void }> }).sockets) socket.destroy();
        const destination = pool(8, () => 0);
        await pullKvBlocks(descriptor, opts(port, destination));
        assert.deepEqual(readKvBlocks(destination, descriptor.destinationBlockIds), readKvBlocks(source, descriptor.sourceBlockIds));
        assert.equal(server.connections, 2);
      });
    });
  }

  if (shm) {
    // A pool with 16 KiB per block run: 8 layers x K/V x 64 blocks = 8 MiB per transfer of all of them.
    const bigLayout: KvPoolLayout = { numLayers: 8, numBlocks: 64, blockSize: 16, numKvHeads: 4, headDim: 64, dtype: 'f32' };
    const bigSource = { pool: new SharedArrayBuffer(kvPoolBytes(bigLayout)), layout: bigLayout };
    const sourceBytes = new Uint8Array(bigSource.pool);
    for (let i = 0; i < sourceBytes.length; i += 1021) sourceBytes[i] = (i * 7 + (i >> 14)) & 0xff;
    const all = Array.from({ length: 64 }, (_, i) => i);

    test('shm: a transfer many times larger than the ring goes round it, credit by credit, and arrives whole', async () => {
      await withServer(bigSource, undefined, async (port, server) => {
        const destination = { pool: new SharedArrayBuffer(kvPoolBytes(bigLayout)), layout: bigLayout };
        const reversed = all.slice().reverse();
        // 8 MiB through a 64 KiB ring (frames of 16 KiB, a quarter of it): 128 laps.
        const result = await pullKvBlocks({ requestId: 'lap', sourceBlockIds: all, destinationBlockIds: reversed, layers: [0, 8] },
          { clusterToken: TOKEN, host: '127.0.0.1', port, destination });
        assert.equal(result.link, 'shm');
        assert.equal(result.bytes, 64 * 16 * kvBlockRunBytes(bigLayout));
        assert.ok(Buffer.from(readKvBlocks(destination, reversed)).equals(Buffer.from(readKvBlocks(bigSource, all))));
        // Again on the same connection and ring (positions go on from where the first transfer left them).
        const again = { pool: new SharedArrayBuffer(kvPoolBytes(bigLayout)), layout: bigLayout };
        await pullKvBlocks({ requestId: 'lap2', sourceBlockIds: all, destinationBlockIds: all, layers: [0, 8] },
          { clusterToken: TOKEN, host: '127.0.0.1', port, destination: again });
        assert.ok(Buffer.from(readKvBlocks(again, all)).equals(Buffer.from(readKvBlocks(bigSource, all))));
        assert.equal(server.connections, 1);
      }, 'auto', 64 << 10);
      assert.deepEqual(leftoverShmFiles(), []);
    });

    test('shm: concurrent transfers each get a connection and a ring of their own, and all arrive whole', async () => {
      await withServer(bigSource, undefined, async (port, server) => {
        const destinations = Array.from({ length: 4 }, () => ({ pool: new SharedArrayBuffer(kvPoolBytes(bigLayout)), layout: bigLayout }));
        const results = await Promise.all(destinations.map((destination, k) => pullKvBlocks(
          { requestId: `c${k}`, sourceBlockIds: all.slice(k * 16, k * 16 + 16), destinationBlockIds: all.slice(0, 16), layers: [0, 8] },
          { clusterToken: TOKEN, host: '127.0.0.1', port, destination })));
        for (const [k, result] of results.entries()) {
          assert.equal(result.link, 'shm');
          assert.ok(Buffer.from(readKvBlocks(destinations[k]!, all.slice(0, 16))).equals(Buffer.from(readKvBlocks(bigSource, all.slice(k * 16, k * 16 + 16)))), `transfer ${k}`);
        }
        assert.equal(server.connections, 4, 'one connection per concurrent transfer');
        // Kept alive, they serve the next ones: no new connection.
        await Promise.all(destinations.map((destination, k) => pullKvBlocks(
          { requestId: `d${k}`, sourceBlockIds: [k], destinationBlockIds: [k], layers: [0, 8] }, { clusterToken: TOKEN, host: '127.0.0.1', port, destination })));
        assert.equal(server.connections, 4);
      }, 'auto', 256 << 10);
      assert.deepEqual(leftoverShmFiles(), []);
    });

    test('shm: the prefill process killed mid-transfer: the transfer fails as truncated, its ring leaves no file behind', async () => {
      const child = spawn(process.execPath, ['--import', 'tsx', fileURLToPath(import.meta.url).replace(/kv-tcp\.test\.ts$/, 'kv-tcp-child.ts')],
        { stdio: ['pipe', 'pipe', 'inherit'] });
      try {
        const line = await new Promise<string>((resolve, reject) => {
          createInterface({ input: child.stdout! }).once('line', resolve);
          child.once('exit', (code) => reject(new Error(`the child exited with ${code}`)));
        });
        const { port, layout } = JSON.parse(line) as { port: number; layout: KvPoolLayout };
        const destination = { pool: new SharedArrayBuffer(kvPoolBytes(layout)), layout };
        const written = new Uint8Array(destination.pool);
        const transfer = pullKvBlocks({ requestId: 'killed', sourceBlockIds: [0, 1, 2, 3], destinationBlockIds: [0, 1, 2, 3], layers: [0, layout.numLayers] },
          { clusterToken: TOKEN, host: '127.0.0.1', port, destination, timeoutMs: 30_000 });
        // The child stalls after its first runs: they landed, the rest never comes.
        await until('the first runs arrived', () => written.some((b) => b !== 0));
        assert.equal(mappedRings(child.pid).length, 1, 'this side mapped the child\'s ring');
        assert.deepEqual(leftoverShmFiles(child.pid), [], 'and removed its name at once');
        child.kill('SIGKILL');
        await assert.rejects(transfer, (e: unknown) => e instanceof KvTransferError && e.reason === 'truncated' && e.link === 'shm');
      } finally {
        child.kill('SIGKILL');
      }
      await new Promise((resolve) => setImmediate(resolve));
      assert.deepEqual(mappedRings(child.pid), [], 'the ring is unmapped with its connection');
      assert.deepEqual(leftoverShmFiles(child.pid), []);
    });
  }
});
