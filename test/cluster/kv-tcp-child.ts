// A prefill side in a process of its own for test/cluster/kv-tcp.test.ts: serves a pool on a KV port (printed as
// one JSON line) and stalls every transfer after its first two runs, until it is killed.
import { KvTransferServer } from '../../src/cluster/kv-tcp.ts';
import { kvPoolBytes, type KvPoolLayout } from '../../src/kernels/types.ts';

const layout: KvPoolLayout = { numLayers: 4, numBlocks: 8, blockSize: 16, numKvHeads: 4, headDim: 64, dtype: 'f32' };
const pool = new SharedArrayBuffer(kvPoolBytes(layout));
new Uint8Array(pool).fill(9);
const server = new KvTransferServer({ clusterToken: 'kv-test-token', pool: { pool, layout }, faults: { stallAfterRuns: 2 } });
const port = await server.listen(0, '127.0.0.1');
process.stdout.write(`${JSON.stringify({ port, layout })}\n`);
