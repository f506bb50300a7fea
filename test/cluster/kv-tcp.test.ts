// KV blocks over TCP between a prefill side and a decode side: only the blocks the descriptor names move, each run
// lands where the decode side allocated it, and a corrupted, truncated or unauthenticated transfer is detected.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { KvTransferError, KvTransferServer, pullKvBlocks, planRuns, type KvPullDescriptor } from '../../src/cluster/kv-tcp.ts';
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
  run: (port: number, server: KvTransferServer) => Promise<T>): Promise<T> {
  const server = new KvTransferServer({ clusterToken: TOKEN, pool: source, isPinned: (id) => id !== 'unpinned', ...(faults ? { faults } : {}) });
  const port = await server.listen(0, '127.0.0.1');
  try {
    return await run(port, server);
  } finally {
    await server.close();
  }
}

describe('KV transfer over TCP', () => {
  const source = pool(16, (i) => (i * 131 + 7) & 0xff);
  const descriptor: KvPullDescriptor = {
    requestId: 'r1', sourceBlockIds: [3, 4, 5, 9], destinationBlockIds: [0, 1, 7, 2], layers: [0, 3],
  };

  test('the named blocks arrive, every layer, where the decode side allocated them; nothing else is written', async () => {
    const destination = pool(8, () => 0);
    const result = await withServer(source, undefined, (port) => pullKvBlocks(descriptor, { clusterToken: TOKEN, host: '127.0.0.1', port, destination }));
    assert.deepEqual(readKvBlocks(destination, descriptor.destinationBlockIds), readKvBlocks(source, descriptor.sourceBlockIds));
    const blockBytes = 2 * 3 * kvBlockRunBytes(source.layout);
    assert.equal(result.bytes, 4 * blockBytes);
    assert.equal(result.blocks, 4);
    // 3->0, 4->1 merge; 5->7 and 9->2 do not: 3 runs per (layer, K|V).
    assert.equal(result.runs, 3 * 2 * 3);
    assert.equal(result.link, 'tcp');
    for (const untouched of [3, 4, 5, 6]) assert.ok(readKvBlocks(destination, [untouched]).every((b) => b === 0), `block ${untouched} untouched`);
  });

  test('a layer range moves only those layers', async () => {
    const destination = pool(8, () => 0);
    const one = { ...descriptor, layers: [1, 2] as [number, number] };
    const result = await withServer(source, undefined, (port) => pullKvBlocks(one, { clusterToken: TOKEN, host: '127.0.0.1', port, destination }));
    assert.equal(result.runs, planRuns(one).length);
    assert.equal(result.bytes, 4 * 2 * kvBlockRunBytes(source.layout));
  });

  test('a corrupted run is caught by its checksum, a truncated transfer by its missing runs', async () => {
    for (const [faults, reason] of [[{ corruptRun: 5 }, 'checksum'], [{ truncateAfterRuns: 4 }, 'truncated'], [{ truncateAfterRuns: 0 }, 'truncated']] as const) {
      const destination = pool(8, () => 0);
      await withServer(source, faults, (port) => assert.rejects(
        pullKvBlocks(descriptor, { clusterToken: TOKEN, host: '127.0.0.1', port, destination }),
        (e: unknown) => e instanceof KvTransferError && e.reason === reason));
    }
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
});
