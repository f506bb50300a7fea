// The request plane's cost: what a worker in another process adds to a request and to each streamed token, against
// the same engine in the server's process, and the message encoding it uses.
//
//   node --import tsx benchmarks/request-plane.ts [--requests 400] [--long-requests 20] [--long-tokens 1000]
//
// The engine is a simulated worker with an infinitely fast clock (--sim-speed-up inf): its steps cost only the CPU
// that plans and prices them, so what differs between the two runs is the request plane itself (encode, socket,
// decode, the extra event loop hop). The remote worker is a `conduit worker --parent-ipc` child (the path of
// `conduit serve --worker-processes`), reached through RemoteEngine over loopback TCP.
// - per request: p50 of a 1-token request's latency, remote minus local, sequential requests;
// - per token: wall time per streamed token of long requests, remote minus local (median over requests);
// - encoding: JSON vs Node's structured-clone serializer on a typical streamed output message, encode + decode.
// Runs alternate local and remote rounds and report the best round of each (the host is shared).

import { loadavg } from 'node:os';
import v8 from 'node:v8';
import { startChildWorker, type ChildWorker } from '../src/cluster/process-pool.ts';
import { engineNow } from '../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type Engine, type EngineRequest } from '../src/engine/types.ts';
import { simPool } from '../src/runtime/worker-pool.ts';

function argument(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at >= 0 ? process.argv[at + 1]! : fallback;
}
const REQUESTS = Number(argument('requests', '400'));
const LONG_REQUESTS = Number(argument('long-requests', '20'));
const LONG_TOKENS = Number(argument('long-tokens', '1000'));
const ROUNDS = Number(argument('rounds', '3'));

let nextId = 0;
function request(maxTokens: number): EngineRequest {
  return {
    id: `b${nextId++}`, promptTokenIds: Array.from({ length: 32 }, (_, i) => 100 + ((nextId * 31 + i) % 5000)), priority: 0,
    arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens, ignoreEos: true, temperature: 0 },
  };
}

function median(values: number[]): number {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)]!;
}

async function perRequest(engine: Engine): Promise<number> {
  const latencies: number[] = [];
  for (let i = 0; i < REQUESTS; i++) {
    const start = performance.now();
    for await (const _ of engine.generate(request(1))) { /* drain */ }
    latencies.push(performance.now() - start);
  }
  return median(latencies.slice(Math.floor(REQUESTS / 10)));
}

async function perToken(engine: Engine): Promise<number> {
  const perTokenMs: number[] = [];
  for (let i = 0; i < LONG_REQUESTS; i++) {
    const start = performance.now();
    let tokens = 0;
    for await (const output of engine.generate(request(LONG_TOKENS))) tokens += output.newTokenIds.length;
    perTokenMs.push((performance.now() - start) / tokens);
  }
  return median(perTokenMs);
}

function encoding(): { json: number; v8: number; jsonBytes: number; v8Bytes: number } {
  const output = {
    requestId: 'chatcmpl-abc123456789', index: 0, newTokenIds: [1234], textDelta: ' hello',
    usage: { promptTokens: 120, completionTokens: 17, cachedTokens: 64 },
    timestamps: {
      arrival: 1764140000000.123, queued: 1764140000001.5, firstScheduled: 1764140000002.1,
      prefillChunks: [{ start: 1764140000002.2, end: 1764140000010.2, tokens: 120, batchSeqs: 1, batchTokens: 120 }],
      firstToken: 1764140000010.3, lastToken: 1764140000020.3, budget: { tokens: 120, forwardStart: 1764140000002.15 }, queueDepthAtEntry: 0,
    },
    step: { id: 1234, start: 1764140000019.3, end: 1764140000020.3, batchSeqs: 4, batchTokens: 4 },
    traceparent: '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01',
  };
  const message = { t: 'out', id: 'chatcmpl-abc123456789', outputs: [output], stats: { numRunning: 4, numWaiting: 0, kvBlocksUsed: 30, kvBlocksTotal: 1000, prefixCacheQueries: 10, prefixCacheHits: 5, preemptions: 0 } };
  const n = 100_000;
  const time = (fn: () => void): number => {
    const start = performance.now();
    for (let i = 0; i < n; i++) fn();
    return ((performance.now() - start) * 1000) / n;
  };
  const best = (fn: () => void): number => Math.min(time(fn), time(fn), time(fn));
  return {
    json: best(() => JSON.parse(Buffer.from(JSON.stringify(message)).toString('utf8'))),
    v8: best(() => v8.deserialize(v8.serialize(message))),
    jsonBytes: Buffer.byteLength(JSON.stringify(message)), v8Bytes: v8.serialize(message).length,
  };
}

const options = {
  engine: 'sim' as const, sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity }, backend: 'auto' as const,
};
const local = simPool(options).make({ enableKvEvents: true });
const remote: ChildWorker = await startChildWorker({ ...options, workers: 1 }, 'bench-0', 'bench-token', 1);
try {
  const enc = encoding();
  console.log(`encoding of one streamed output message: JSON ${enc.json.toFixed(2)} µs (${enc.jsonBytes} B), `
    + `structured clone ${enc.v8.toFixed(2)} µs (${enc.v8Bytes} B), encode + decode`);
  // Warm both paths.
  await perRequest(local);
  await perRequest(remote);
  const rounds: { localReq: number; remoteReq: number; localTok: number; remoteTok: number }[] = [];
  for (let r = 0; r < ROUNDS; r++) {
    rounds.push({ localReq: await perRequest(local), remoteReq: await perRequest(remote), localTok: await perToken(local), remoteTok: await perToken(remote) });
  }
  const best = (key: keyof (typeof rounds)[number]): number => Math.min(...rounds.map((r) => r[key]));
  const [lr, rr, lt, rt] = [best('localReq'), best('remoteReq'), best('localTok'), best('remoteTok')];
  console.log(`per request (1 token, p50 of ${REQUESTS}): in-process ${(lr * 1000).toFixed(0)} µs, remote ${(rr * 1000).toFixed(0)} µs, `
    + `overhead ${((rr - lr) * 1000).toFixed(0)} µs`);
  console.log(`per token (${LONG_TOKENS}-token streams, median of ${LONG_REQUESTS}): in-process ${(lt * 1000).toFixed(1)} µs, `
    + `remote ${(rt * 1000).toFixed(1)} µs, overhead ${((rt - lt) * 1000).toFixed(1)} µs`);
  console.log(`rounds: ${ROUNDS} (best of each shown); load average ${loadavg().map((l) => l.toFixed(2)).join(' ')}`);
} finally {
  await remote.close();
  await local.close();
}
