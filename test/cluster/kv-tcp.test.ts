// KV blocks between a prefill side and a decode side, over TCP and over shared memory: only the blocks the
// descriptor names move, each run lands where the decode side allocated it, a corrupted, truncated or
// unauthenticated transfer is detected, and a stream sends blocks as the prefill reports them, the rest after the
// handoff.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readdirSync } from 'node:fs';
import {
  KvTransferError, KvTransferServer, pullKvBlocks, planRuns, streamKvBlocks, type KvPullDescriptor,
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

async function withServer<T>(source: KvPoolView, faults: { corruptRun?: number; truncateAfterRuns?: number } | undefined,
  run: (port: number, server: KvTransferServer) => Promise<T>, link: 'auto' | 'tcp' = 'auto'): Promise<T> {
  const server = new KvTransferServer({ clusterToken: TOKEN, pool: source, isPinned: (id) => id !== 'unpinned', link, ...(faults ? { faults } : {}) });
  const port = await server.listen(0, '127.0.0.1');
  try {
    return await run(port, server);
  } finally {
    await server.close();
  }
}

/** Transfer files of this process's servers left in /dev/shm. */
function leftoverShmFiles(): string[] {
  try {
    return readdirSync(SHM_DIR).filter((name) => name.startsWith(`conduit-kv-${process.pid}-`));
  } catch {
    return [];
  }
}

const shm = kvHostId() !== null;
const LINKS = shm ? ['tcp', 'shm'] as const : ['tcp'] as const;
if (!shm) console.log(`# KV transfer over shared memory not tested: ${SHM_DIR} is not usable here`);

describe('KV transfer between workers', () => {
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
      if (direct) process.env.CONDUIT_KV_DIRECT_READ = '1';
      try {
        const result = await withServer(big, undefined, (port) => pullKvBlocks(
          { requestId: 'big', sourceBlockIds: ids, destinationBlockIds: ids.map((i) => i + 40), layers: [0, 4] },
          { clusterToken: TOKEN, host: '127.0.0.1', port, destination, link: link === 'tcp' ? 'tcp' : 'auto' }));
        assert.equal(result.link, link);
        assert.equal(result.bytes, 64 * 2 * 4 * kvBlockRunBytes(layout));
        assert.ok(Buffer.from(readKvBlocks(destination, ids.map((i) => i + 40))).equals(Buffer.from(readKvBlocks(big, ids))), `${link}${direct ? ', direct' : ''}`);
      } finally {
        delete process.env.CONDUIT_KV_DIRECT_READ;
      }
    }
  });
});
