// The event plane's capacity: KV events per second one frontend takes in from NATS (receive, parse, validate, apply
// to the router's index), against the rate 8 busy simulated H100 workers emit.
//
//   node --import tsx benchmarks/cluster-events.ts [--seconds 5] [--publishers 2]
//
// Publishers are child processes, each publishing for 4 of 8 worker ids batches of one `stored` event of 4 blocks
// (what a decode step that completes blocks emits), as fast as NATS takes them; the frontend side is
// EventSubscriber feeding Router.applyKvEvents, as `conduit frontend` does. The emission side: one SimEngine
// (Llama 3.1 8B on an H100, virtual time) under 64 concurrent requests of 2048 prompt + 256 output tokens,
// its KV events counted per simulated second, times 8. Needs /usr/sbin/nats-server.

import { spawn } from 'node:child_process';
import net from 'node:net';
import { loadavg } from 'node:os';
import { fileURLToPath } from 'node:url';
import { connect } from '@nats-io/transport-node';
import { EventSubscriber } from '../src/cluster/events.ts';
import { engineNow } from '../src/engine/clock.ts';
import { DEFAULT_SAMPLING } from '../src/engine/types.ts';
import { BitsetKvIndex } from '../src/router/kv-index.ts';
import { Router } from '../src/router/router.ts';
import { simPool } from '../src/runtime/worker-pool.ts';
import { seededRandom } from '../src/util/random.ts';

function argument(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at >= 0 ? process.argv[at + 1]! : fallback;
}
const SECONDS = Number(argument('seconds', '5'));
const PUBLISHERS = Number(argument('publishers', '2'));

const hex = (n: number): string => n.toString(16).padStart(16, '0');

if (process.argv.includes('--publisher')) {
  // Child: publish for our worker ids until told to stop.
  const [url, first, count] = [argument('url', ''), Number(argument('first', '0')), Number(argument('count', '4'))];
  const nc = await connect({ servers: url });
  let stop = false;
  process.on('message', () => { stop = true; });
  const ids = Array.from({ length: count }, (_, i) => first + i);
  const eventIds = new Map(ids.map((id) => [id, 0]));
  let published = 0;
  while (!stop) {
    for (const id of ids) {
      const eventId = eventIds.get(id)! + 1;
      eventIds.set(id, eventId);
      const base = id * 1e9 + eventId * 4;
      nc.publish(`bench.kv.w${id}`, JSON.stringify({
        workerId: `w${id}`, instance: `${process.pid}@bench`, stats: { numRunning: 8, numWaiting: 0, kvBlocksUsed: 100, kvBlocksTotal: 1000, prefixCacheQueries: 1, prefixCacheHits: 0, preemptions: 0 },
        events: [{ type: 'stored', eventId, blockHashes: [hex(base), hex(base + 1), hex(base + 2), hex(base + 3)], parentHash: null, tokenCount: 64, blockSize: 16 }],
      }));
      published++;
    }
    if (published % 2000 === 0) await nc.flush();
  }
  await nc.flush();
  process.send!({ published });
  await nc.close();
  process.exit(0);
}

async function freePort(): Promise<number> {
  return new Promise((resolve) => {
    const server = net.createServer().listen(0, '127.0.0.1', () => {
      const { port } = server.address() as net.AddressInfo;
      server.close(() => resolve(port));
    });
  });
}

/** KV events one busy simulated worker emits per simulated second. */
async function emissionRate(): Promise<{ perWorker: number; seconds: number }> {
  const engine = simPool({ sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity } }).make({ enableKvEvents: true });
  let events = 0;
  engine.onKvEvents((batch) => { events += batch.length; });
  const random = seededRandom(7);
  const start = engineNow();
  let end = start;
  await Promise.all(Array.from({ length: 64 }, async (_, r) => {
    const prompt = Array.from({ length: 2048 }, () => 100 + Math.floor(random() * 30000));
    for await (const output of engine.generate({
      id: `e${r}`, promptTokenIds: prompt, priority: 0, arrivalMs: start,
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 256, ignoreEos: true, temperature: 0 },
    })) if (output.timestamps.finished !== undefined) end = Math.max(end, output.timestamps.finished);
  }));
  await engine.close();
  const seconds = (end - start) / 1000;
  return { perWorker: events / seconds, seconds };
}

const port = await freePort();
const nats = spawn('/usr/sbin/nats-server', ['-a', '127.0.0.1', '-p', String(port)], { stdio: 'ignore' });
try {
  await new Promise((resolve) => setTimeout(resolve, 500));
  const url = `nats://127.0.0.1:${port}`;
  const router = new Router({ blockSize: 16, random: seededRandom(1), index: new BitsetKvIndex({ hashSeed: 1 }) });
  for (let i = 0; i < 8; i++) router.addWorker(`w${i}`, { numRunning: 0, numWaiting: 0, activePrefillTokens: 0, activeDecodeBlocks: 0, kvUsage: 0 });
  let applied = 0;
  let gaps = 0;
  const subscriber = new EventSubscriber(await connect({ servers: url }), 'bench', {
    kv: (workerId, _instance, events) => {
      const result = router.applyKvEvents(workerId, events);
      applied += result.numApplied;
      if (result.needsResync) gaps++;
    },
    load: () => {},
    reconnected: () => {},
  }, () => {});
  await new Promise((resolve) => setTimeout(resolve, 200));
  const self = fileURLToPath(import.meta.url);
  const children = Array.from({ length: PUBLISHERS }, (_, p) => spawn(process.execPath, ['--import', 'tsx', self, '--publisher',
    '--url', url, '--first', String((p * 8) / PUBLISHERS), '--count', String(8 / PUBLISHERS)], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] }));
  await new Promise((resolve) => setTimeout(resolve, 1500));
  const appliedAtStart = applied;
  const t0 = performance.now();
  await new Promise((resolve) => setTimeout(resolve, SECONDS * 1000));
  const rate = (applied - appliedAtStart) / ((performance.now() - t0) / 1000);
  const published = await Promise.all(children.map((child) => new Promise<number>((resolve) => {
    child.once('message', (m: { published: number }) => resolve(m.published));
    child.send('stop');
  })));
  await new Promise((resolve) => setTimeout(resolve, 500));
  console.log(`frontend took in ${Math.round(rate)} KV events/s (applied to the index; ${PUBLISHERS} publisher processes, `
    + `${published.reduce((a, b) => a + b, 0)} published in all, ${applied} applied, ${subscriber.refused} refused, ${gaps} batches past a gap)`);
  const emission = await emissionRate();
  console.log(`a busy simulated H100 worker (Llama 3.1 8B, 64 x 2048+256 tokens) emits ${Math.round(emission.perWorker)} KV events per simulated s `
    + `(${emission.seconds.toFixed(1)} s simulated); 8 workers: ${Math.round(emission.perWorker * 8)} events/s, `
    + `${(rate / (emission.perWorker * 8)).toFixed(1)}x headroom`);
  console.log(`load average ${loadavg().map((l) => l.toFixed(2)).join(' ')}`);
  await subscriber.close();
} finally {
  nats.kill('SIGKILL');
}
