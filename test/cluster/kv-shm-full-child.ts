// For test/cluster/kv-shm-full.test.ts, run in a mount namespace of its own whose /dev/shm is a small tmpfs: one
// pull over the link the transfer chooses ('auto', so shared memory when a ring can be made), of 64 blocks of 64
// KiB (the ring is 4 MiB), then one JSON line: the link it took and whether every byte arrived.
import { KvTransferServer, pullKvBlocks } from '../../src/cluster/kv-tcp.ts';
import { kvPoolBytes, type KvPoolLayout } from '../../src/kernels/types.ts';

const layout: KvPoolLayout = { numLayers: 8, numBlocks: 64, blockSize: 16, numKvHeads: 2, headDim: 64, dtype: 'f16' };
const source = new SharedArrayBuffer(kvPoolBytes(layout));
const sourceBytes = new Uint8Array(source);
for (let i = 0; i < sourceBytes.length; i++) sourceBytes[i] = (i * 31 + 7) & 0xff;
const server = new KvTransferServer({ clusterToken: 'kv-test-token', pool: { pool: source, layout } });
const port = await server.listen(0, '127.0.0.1');
const destination = { pool: new SharedArrayBuffer(kvPoolBytes(layout)), layout };
const ids = Array.from({ length: layout.numBlocks }, (_, i) => i);
try {
  const result = await pullKvBlocks({ requestId: 'full-shm', sourceBlockIds: ids, destinationBlockIds: ids, layers: [0, layout.numLayers] },
    { clusterToken: 'kv-test-token', host: '127.0.0.1', port, destination, link: 'auto' });
  const arrived = Buffer.compare(Buffer.from(source), Buffer.from(destination.pool)) === 0;
  process.stdout.write(`${JSON.stringify({ link: result.link, arrived })}\n`);
} finally {
  await server.close();
}
