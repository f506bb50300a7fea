// A worker's KV snapshot larger than the NATS server's max_payload (1 MiB by default: some 55 000 cached blocks) is
// not sent over NATS: the worker answers the snapshot request with a small tooLarge marker, its NATS connection
// stays up, and a frontend takes the snapshot from the request plane at once (no wait for the NATS request's 3 s
// timeout). Real nats-server (/usr/sbin/nats-server) with max_payload lowered to 16 KiB in its configuration, so a
// few hundred blocks are enough, and real etcd (/usr/bin/etcd), on free loopback ports.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import type { NatsConnection } from '@nats-io/transport-node';
import { etcdClient } from '../../src/cluster/discovery.ts';
import { EventPublisher, EventSubscriber, natsConnect } from '../../src/cluster/events.ts';
import { ClusterFrontend } from '../../src/cluster/frontend.ts';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING } from '../../src/engine/types.ts';
import type { BlockHash, KvEvent } from '../../src/protocols/kv-events.ts';
import type { EngineStats } from '../../src/protocols/worker.ts';
import {
  ETCD_BIN, freePort, NATS_BIN, removeDir, startEtcd, startProcess, stopAll, tempDir, waitForPort, type Etcd,
} from '../helpers/cluster-services.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(ETCD_BIN) && existsSync(NATS_BIN) ? undefined : `needs ${ETCD_BIN} and ${NATS_BIN} (Debian etcd-server, nats-server)`;
const TOKEN = 'nats-max-payload-test-token';
const MAX_PAYLOAD = 16 * 1024;

const STATS: EngineStats = {
  numRunning: 0, numWaiting: 0, kvBlocksUsed: 0, kvBlocksTotal: 100, prefixCacheQueries: 0, prefixCacheHits: 0, preemptions: 0,
};

function blockHashes(count: number, from = 0): BlockHash[] {
  return Array.from({ length: count }, (_, i) => (from + i).toString(16).padStart(16, '0') as BlockHash);
}

describe('a KV snapshot larger than NATS\'s max_payload', { skip }, () => {
  let dir: string;
  let natsUrl: string;
  let etcd: Etcd;
  const connections: NatsConnection[] = [];
  const closers: (() => Promise<void>)[] = [];

  before(async () => {
    dir = tempDir('nats-max-payload');
    const port = await freePort();
    const config = join(dir, 'nats.conf');
    writeFileSync(config, `listen: 127.0.0.1:${port}\nmax_payload: ${MAX_PAYLOAD}\n`);
    startProcess(NATS_BIN, ['-c', config]);
    await waitForPort(port);
    natsUrl = `nats://127.0.0.1:${port}`;
    etcd = await startEtcd(dir);
  });

  after(async () => {
    for (const close of closers.reverse()) await close().catch(() => {});
    for (const nc of connections) await nc.close().catch(() => {});
    await stopAll();
    removeDir(dir);
  });

  async function connect(name: string): Promise<NatsConnection> {
    const nc = await natsConnect({ servers: [natsUrl], name });
    connections.push(nc);
    return nc;
  }

  test('the worker answers with a marker and its connection stays up; a snapshot that fits still comes over NATS', async () => {
    const logs: string[] = [];
    const log = (level: string, message: string) => { logs.push(`${level} ${message}`); };
    const workerNc = await connect('worker');
    assert.equal(workerNc.info?.max_payload, MAX_PAYLOAD);
    let hashes = blockHashes(2000); // about 38 KB of JSON
    const kvListeners = new Set<(events: KvEvent[]) => void>();
    const publisher = new EventPublisher(workerNc, 'mp', 'w1', 'instance-1', {
      stats: () => STATS, snapshot: () => ({ lastEventId: 7, hashes }),
      onKvEvents: (listener) => { kvListeners.add(listener); return () => kvListeners.delete(listener); },
    }, log);
    closers.push(() => publisher.close());
    const received: KvEvent[][] = [];
    const subscriber = new EventSubscriber(await connect('frontend'), 'mp', {
      kv: (_workerId, _instance, events) => { received.push(events); }, load: () => {}, reconnected: () => {},
    }, log);
    closers.push(() => subscriber.close());

    await assert.rejects(subscriber.snapshot('w1', 'instance-1'), (error: Error) => {
      assert.equal(error.name, 'SnapshotTooLargeError', error.message);
      assert.match(error.message, /2000 blocks/);
      return true;
    });
    assert.equal(publisher.snapshotsTooLarge, 1);
    assert.ok(logs.some((l) => l.startsWith('info nats: KV snapshot of 2000 blocks') && l.includes(`max_payload (${MAX_PAYLOAD} bytes)`)),
      logs.join('\n'));
    // The worker's connection is intact: a smaller snapshot comes over NATS, and so do its KV events.
    hashes = blockHashes(10);
    const snapshot = await subscriber.snapshot('w1', 'instance-1');
    assert.deepEqual(snapshot, { lastEventId: 7, hashes });
    for (const listener of kvListeners) listener([{ type: 'stored', eventId: 8, blockHashes: blockHashes(2), parentHash: null, tokenCount: 32, blockSize: 16 }]);
    await waitUntil(() => received.length === 1, 'the KV events came', 10_000);
    // A KV batch too large for NATS is not published (the frontends see an event-id gap and resync); the next is.
    for (const listener of kvListeners) listener([{ type: 'stored', eventId: 9, blockHashes: blockHashes(2000, 10), parentHash: null, tokenCount: 32_000, blockSize: 16 }]);
    for (const listener of kvListeners) listener([{ type: 'removed', eventId: 10, blockHashes: blockHashes(1) }]);
    await waitUntil(() => received.length === 2, 'the next KV events came', 10_000);
    assert.equal(received[1]![0]!.eventId, 10);
    assert.equal(publisher.tooLarge, 1);
    assert.ok(!workerNc.isClosed());
    assert.deepEqual(logs.filter((l) => /disconnected|could not answer/.test(l)), []);
  });

  test('a frontend joining a worker with a large cache resyncs it from the request plane at once', async () => {
    const workerLogs: string[] = [];
    const worker: RunningWorker = await startClusterWorker({
      workerId: 'big-cache', role: 'both', namespace: 'mp2', clusterToken: TOKEN, host: '127.0.0.1', port: await freePort(),
      etcd: { endpoints: [etcd.url] }, nats: { servers: [natsUrl] }, leaseTtlSeconds: 5,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity } },
      log: (level, message) => { workerLogs.push(`${level} ${message}`); },
    });
    closers.push(() => worker.shutdown(0));
    // Fill its prefix cache (over a frontend of its own) past what one NATS message holds.
    const filler = new ClusterFrontend({ namespace: 'mp2', clusterToken: TOKEN, etcd: etcdClient({ endpoints: [etcd.url] }), log: () => {} });
    closers.push(() => filler.close());
    await filler.start();
    const engine = await filler.ready();
    for (let r = 0; r < 4; r++) {
      const request = {
        id: `fill-${r}`, promptTokenIds: Array.from({ length: 4000 }, (_, i) => 100 + ((i * 13 + r * 7919) % 30_000)), priority: 0,
        arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens: 1, ignoreEos: true },
      };
      for await (const output of engine.generate(request)) void output;
    }
    await waitUntil(() => worker.server.kv.hashes.size >= 1000, 'the worker caches 1000 blocks', 20_000);

    const logs: { at: number; line: string }[] = [];
    const frontendNc = await natsConnect({ servers: [natsUrl], name: 'frontend' });
    const frontend = new ClusterFrontend({
      namespace: 'mp2', clusterToken: TOKEN, etcd: etcdClient({ endpoints: [etcd.url] }),
      events: (handlers) => new EventSubscriber(frontendNc, 'mp2', handlers, () => {}),
      log: (level, message) => { logs.push({ at: performance.now(), line: `${level} ${message}` }); },
    });
    closers.push(() => frontend.close());
    await frontend.start();
    await frontend.ready();
    const joined = () => logs.find((l) => l.line.startsWith('info worker big-cache joined'));
    const resynced = () => logs.find((l) => l.line.startsWith('debug KV view of big-cache resynced (joined)'));
    await waitUntil(() => resynced() !== undefined, 'the frontend resynced the worker', 20_000);
    const blocks = Number(/: (\d+) blocks/.exec(resynced()!.line)![1]);
    assert.ok(blocks >= 1000, `${blocks} blocks`);
    const waited = resynced()!.at - joined()!.at;
    assert.ok(waited < 2000, `the resync took ${Math.round(waited)} ms after the join (a NATS request that times out waits 3000)`);
    assert.ok(workerLogs.some((l) => l.startsWith('info nats: KV snapshot of')), workerLogs.join('\n'));
    assert.deepEqual(workerLogs.filter((l) => /nats: disconnected|could not answer/.test(l)), []);
  });
});
