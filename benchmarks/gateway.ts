// Gateway overhead: what the OpenAI-compatible gateway adds per request and per streamed token, measured against a
// bare node:http server that writes the same JSON and SSE bytes, in the same run.
//
//   node --import tsx benchmarks/gateway.ts [--duration 3] [--repeat 3] [--connections 64] [--tokens 64]
//                                           [--client auto|wrk|conduit]
//
// Servers (each in this process, one at a time, on 127.0.0.1; the load generator is a separate process on the
// other core):
//   baseline      node:http: parse the JSON body, write a chat.completion of the same shape, or the same SSE chunks
//                 (role chunk, one chunk per token, finish chunk, usage chunk, [DONE]) with one res.write each
//   gw+instant    ApiServer with an engine that returns every token at once: HTTP shell, auth, rate limits,
//                 validation, chat template, tokenizer, admission, response shaping and SSE, and nothing else
//   gw+sim        ApiServer over one simulated worker at an infinite speed-up: adds the real scheduler and KV cache
//   gw+router+8   ApiServer over the kv router and 8 simulated workers (what `conduit serve --engine sim --workers 8`
//                 runs): adds routing (block hashing, index lookup) and the routed engine
//
// Loads (wrk: 1 thread, C connections, closed loop; or `conduit bench` as a child process when wrk is missing):
//   non-stream, max_tokens 1, C connections        -> req/s, p50 / p99 latency
//   non-stream, max_tokens 1, 1 connection         -> unloaded p50 / p99 latency: the added latency of one request
//   stream, max_tokens 1 and max_tokens T, C conns -> per streamed token: (1/rps(T) - 1/rps(1)) / (T - 1)
// At C connections the server's one thread is saturated, so 1 / req/s is its CPU time per request; "added" is that
// time minus the baseline's. Each load runs --repeat times with the servers interleaved; the median is reported.

import { execFileSync, spawn } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir, loadavg } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { KeyStore } from '../src/api/auth.ts';
import { ApiServer } from '../src/api/server.ts';
import { formatTable } from '../src/bench/tables.ts';
import type { Engine, EngineOutput, EngineRequest } from '../src/engine/types.ts';
import { createWorkerPool } from '../src/runtime/worker-pool.ts';

function argument(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at >= 0 ? process.argv[at + 1]! : fallback;
}

const DURATION_SEC = Number(argument('duration', '3'));
const REPEAT = Number(argument('repeat', '3'));
const CONNECTIONS = Number(argument('connections', '64'));
const STREAM_TOKENS = Number(argument('tokens', '64'));
const CLIENT = argument('client', 'auto');
const MODEL = 'Llama 3.1 8B';
const PROMPT = 'Say hello to the world in one short sentence.';

// ---------------------------------------------------------------------------------------------------------------
// Servers

interface Target {
  name: string;
  url: string;
  close(): Promise<void>;
}

const WORD = ' hola';

/** The bare server: the same bytes the gateway writes, with nothing in between. */
async function startBaseline(): Promise<Target> {
  let nextId = 0;
  const server = createServer({ noDelay: true }, (req: IncomingMessage, res: ServerResponse) => {
    const chunks: Buffer[] = [];
    req.on('data', (chunk: Buffer) => chunks.push(chunk));
    req.on('end', () => {
      const body = JSON.parse(Buffer.concat(chunks).toString('utf8')) as { max_tokens: number; stream?: boolean };
      const id = `chatcmpl-${(nextId++).toString(16).padStart(24, '0')}`;
      const created = Math.floor(Date.now() / 1000);
      const head = { id, object: 'chat.completion.chunk', created, model: MODEL, system_fingerprint: 'conduit-sim' };
      const usage = { prompt_tokens: 12, completion_tokens: body.max_tokens, total_tokens: 12 + body.max_tokens, prompt_tokens_details: { cached_tokens: 0 } };
      if (!body.stream) {
        const payload = JSON.stringify({
          id, object: 'chat.completion', created, model: MODEL, system_fingerprint: 'conduit-sim',
          choices: [{ index: 0, message: { role: 'assistant', content: WORD.repeat(body.max_tokens), refusal: null }, logprobs: null, finish_reason: 'length', stop_reason: null }],
          usage,
        });
        res.writeHead(200, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(payload) });
        res.end(payload);
        return;
      }
      res.socket?.setNoDelay(true);
      res.writeHead(200, { 'Content-Type': 'text/event-stream; charset=utf-8', 'Cache-Control': 'no-cache', 'X-Accel-Buffering': 'no' });
      res.flushHeaders();
      const send = (data: object) => res.write(`data: ${JSON.stringify(data)}\n\n`);
      send({ ...head, choices: [{ index: 0, delta: { role: 'assistant', content: '' }, logprobs: null, finish_reason: null }], usage: null });
      for (let i = 0; i < body.max_tokens; i++) {
        send({ ...head, choices: [{ index: 0, delta: { content: WORD }, logprobs: null, finish_reason: null }], usage: null });
      }
      send({ ...head, choices: [{ index: 0, delta: {}, logprobs: null, finish_reason: 'length', stop_reason: null }], usage: null });
      send({ ...head, choices: [], usage });
      res.end('data: [DONE]\n\n');
    });
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return { name: 'baseline (node:http)', url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, close: () => closeServer(server) };
}

function closeServer(server: Server): Promise<void> {
  server.closeAllConnections();
  return new Promise((resolve) => server.close(() => resolve()));
}

/** An engine with nothing behind it: every token of a request comes out at once, one output per token. */
function instantEngine(info: Engine['info']): Engine {
  let closed = false;
  return {
    info,
    stats: () => ({ numRunning: 0, numWaiting: 0, kvBlocksUsed: 0, kvBlocksTotal: 1, prefixCacheQueries: 0, prefixCacheHits: 0, preemptions: 0 }),
    abort: () => undefined,
    resetPrefixCache: async () => true,
    close: async () => { closed = true; },
    async *generate(request: EngineRequest): AsyncGenerator<EngineOutput> {
      if (closed) throw new Error('engine is closed');
      const { maxTokens } = request.sampling;
      const promptTokens = request.promptTokenIds.length;
      for (let i = 1; i <= maxTokens; i++) {
        yield {
          requestId: request.id, index: 0, newTokenIds: [1000 + i], textDelta: WORD,
          ...(i === maxTokens ? { finishReason: 'length' as const } : {}),
          usage: { promptTokens, completionTokens: i, cachedTokens: 0 },
          timestamps: { arrival: request.arrivalMs, prefillChunks: [] },
        };
      }
    },
  };
}

/**
 * A fresh worker pool per server: shutting an ApiServer down closes its engine, so a pool cannot serve two rounds.
 * `instant` puts the engine with nothing behind it in front of the pool's tokenizer and chat template.
 */
async function startGateway(name: string, workers: number, instant = false): Promise<Target> {
  const pool = await createWorkerPool({
    engine: 'sim', workers, sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity },
    ...(workers > 1 ? { routingPolicy: 'kv' as const, routerSeed: 1 } : {}),
  });
  const engine = instant ? instantEngine(pool.engine.info) : pool.engine;
  const api = new ApiServer({ keyStore: new KeyStore({ keys: [], tenants: new Map() }, {}), maxPendingRequests: 4096 });
  api.attach({ engine, tokenizer: pool.tokenizer, chatTemplate: pool.chatTemplate });
  await api.listen(0, '127.0.0.1');
  return {
    name, url: api.url,
    async close() {
      await api.shutdown(0);
      if (instant) await pool.engine.close();
    },
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Load generators

interface LoadResult {
  requestsPerSec: number;
  p50Us: number;
  p99Us: number;
  errors: number;
}

interface Load {
  name: string;
  stream: boolean;
  maxTokens: number;
  connections: number;
}

function requestBody(load: Load): string {
  return JSON.stringify({
    model: MODEL, messages: [{ role: 'user', content: PROMPT }], max_tokens: load.maxTokens, ignore_eos: true,
    ...(load.stream ? { stream: true, stream_options: { include_usage: true } } : {}),
  });
}

function hasWrk(): boolean {
  try {
    execFileSync('wrk', ['--version'], { stdio: 'ignore' });
    return true;
  } catch (error) {
    // wrk --version exits 1 after printing its banner; only a missing binary throws ENOENT.
    return (error as NodeJS.ErrnoException).code !== 'ENOENT';
  }
}

const workDir = mkdtempSync(join(tmpdir(), 'conduit-gateway-bench-'));

/** wrk with a Lua script that sends the POST and prints the summary as JSON (latencies in µs). */
function runWrk(url: string, load: Load, seconds: number): Promise<LoadResult> {
  const script = join(workDir, `${load.stream ? 's' : 'j'}${load.maxTokens}.lua`);
  writeFileSync(script, [
    'wrk.method = "POST"',
    `wrk.body = [==[${requestBody(load)}]==]`,
    'wrk.headers["Content-Type"] = "application/json"',
    'done = function(summary, latency, requests)',
    '  local e = summary.errors',
    '  io.write(string.format(\'\\nRESULT {"requests":%d,"duration_us":%d,"errors":%d,"p50":%d,"p99":%d}\\n\',',
    '    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout + e.status,',
    '    latency:percentile(50), latency:percentile(99)))',
    'end',
  ].join('\n'));
  const args = ['-t', '1', '-c', String(load.connections), '-d', `${seconds}s`, '--timeout', '10s', '-s', script, `${url}/v1/chat/completions`];
  return new Promise((resolve, reject) => {
    const child = spawn('wrk', args, { stdio: ['ignore', 'pipe', 'inherit'] });
    let out = '';
    child.stdout.on('data', (chunk: Buffer) => { out += chunk.toString('utf8'); });
    child.on('error', reject);
    child.on('close', () => {
      const line = out.split('\n').find((l) => l.startsWith('RESULT '));
      if (!line) return reject(new Error(`wrk printed no result:\n${out}`));
      const r = JSON.parse(line.slice(7)) as { requests: number; duration_us: number; errors: number; p50: number; p99: number };
      resolve({ requestsPerSec: r.requests / (r.duration_us / 1e6), p50Us: r.p50, p99Us: r.p99, errors: r.errors });
    });
  });
}

/** `conduit bench` in a child process (so it does not share the server's thread): the fallback without wrk. */
function runConduitBench(url: string, load: Load, seconds: number): Promise<LoadResult> {
  const bin = fileURLToPath(new URL('../bin/conduit.js', import.meta.url));
  const args = [bin, 'bench', '--url', url, '--json', '--concurrency', String(load.connections), '--duration', String(seconds),
    '--workload', 'random', '--prompt-tokens', '9', '--output-tokens', String(load.maxTokens), '--ignore-eos', '--model', MODEL,
    ...(load.stream ? ['--stream'] : [])];
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, args, { stdio: ['ignore', 'pipe', 'inherit'], env: { ...process.env, NODE_OPTIONS: '' } });
    let out = '';
    child.stdout.on('data', (chunk: Buffer) => { out += chunk.toString('utf8'); });
    child.on('error', reject);
    child.on('close', () => {
      try {
        const { summary } = JSON.parse(out) as { summary: { requestsPerSec: number; numErrors: number; e2eMs: { p50: number; p99: number } } };
        resolve({ requestsPerSec: summary.requestsPerSec, p50Us: summary.e2eMs.p50 * 1000, p99Us: summary.e2eMs.p99 * 1000, errors: summary.numErrors });
      } catch {
        reject(new Error(`conduit bench printed no report:\n${out}`));
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Run

const median = (values: number[]): number => {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor((sorted.length - 1) / 2)]!;
};
const f = (value: number, decimals = 1) => (Number.isFinite(value) ? value.toFixed(decimals) : '-');

async function main(): Promise<void> {
  const useWrk = CLIENT === 'wrk' || (CLIENT === 'auto' && hasWrk());
  const client = useWrk ? runWrk : runConduitBench;
  const starters: (() => Promise<Target>)[] = [
    startBaseline,
    () => startGateway('gw+instant engine', 1, true),
    () => startGateway('gw+1 sim worker', 1),
    () => startGateway('gw+kv router+8 sim', 8),
  ];
  const loads: Load[] = [
    { name: `non-stream, 1 token, ${CONNECTIONS} conns`, stream: false, maxTokens: 1, connections: CONNECTIONS },
    { name: 'non-stream, 1 token, 1 conn', stream: false, maxTokens: 1, connections: 1 },
    { name: `stream, 1 token, ${CONNECTIONS} conns`, stream: true, maxTokens: 1, connections: CONNECTIONS },
    { name: `stream, ${STREAM_TOKENS} tokens, ${CONNECTIONS} conns`, stream: true, maxTokens: STREAM_TOKENS, connections: CONNECTIONS },
  ];
  console.log(`Gateway overhead: ${useWrk ? 'wrk (1 thread)' : 'conduit bench (child process)'}, ${DURATION_SEC} s per run, `
    + `median of ${REPEAT}, load average ${loadavg().map((l) => l.toFixed(2)).join(' ')} on this host`);

  /** results[server][load] = one LoadResult per repetition. */
  const results: LoadResult[][][] = starters.map(() => loads.map(() => []));
  const names: string[] = [];
  for (let round = 0; round < REPEAT; round++) {
    for (const [s, start] of starters.entries()) {
      const target = await start();
      names[s] = target.name;
      try {
        // A short untimed run first: JIT compilation and connection set-up are not what is measured.
        await client(target.url, loads[0]!, 1);
        for (const [l, load] of loads.entries()) results[s]![l]!.push(await client(target.url, load, DURATION_SEC));
      } finally {
        await target.close();
      }
      process.stderr.write(`  round ${round + 1}/${REPEAT}: ${target.name} done\n`);
    }
  }

  const cell = (s: number, l: number) => {
    const runs = results[s]![l]!;
    return {
      rps: median(runs.map((r) => r.requestsPerSec)), p50: median(runs.map((r) => r.p50Us)), p99: median(runs.map((r) => r.p99Us)),
      errors: runs.reduce((sum, r) => sum + r.errors, 0),
    };
  };
  for (const [l, load] of loads.entries()) {
    const base = cell(0, l);
    console.log(`\n${load.name}`);
    console.log(formatTable(['server', 'req/s', 'p50 ms', 'p99 ms', 'us/request', 'added us/request', 'added p50 ms', 'added p99 ms', 'errors'],
      names.map((name, s) => {
        const c = cell(s, l);
        const added = s === 0;
        return [name, f(c.rps, 0), f(c.p50 / 1000, 3), f(c.p99 / 1000, 3), f(1e6 / c.rps, 1),
          added ? '-' : f(1e6 / c.rps - 1e6 / base.rps, 1), added ? '-' : f((c.p50 - base.p50) / 1000, 3),
          added ? '-' : f((c.p99 - base.p99) / 1000, 3), String(c.errors)];
      })));
  }

  // Per streamed token: the slope of CPU time per request against tokens per request.
  const oneToken = loads.findIndex((l) => l.stream && l.maxTokens === 1);
  const manyTokens = loads.findIndex((l) => l.stream && l.maxTokens === STREAM_TOKENS);
  const perToken = (s: number) => (1e6 / cell(s, manyTokens).rps - 1e6 / cell(s, oneToken).rps) / (STREAM_TOKENS - 1);
  console.log(`\nper streamed token (CPU time per request at ${CONNECTIONS} connections, ${STREAM_TOKENS} vs 1 token)`);
  console.log(formatTable(['server', 'us/token', 'added us/token'], names.map((name, s) => [
    name, f(perToken(s), 2), s === 0 ? '-' : f(perToken(s) - perToken(0), 2),
  ])));
  const unloaded = loads.findIndex((l) => l.connections === 1);
  const gw = cell(1, unloaded);
  const base = cell(0, unloaded);
  console.log(`\ntargets (gateway alone = gw+instant engine): < 0.5 ms p99 added per request: ${f((gw.p99 - base.p99) / 1000, 3)} ms unloaded; `
    + `< 20 us per streamed token: ${f(perToken(1) - perToken(0), 2)} us`);
}

try {
  await main();
} finally {
  rmSync(workDir, { recursive: true, force: true });
}
