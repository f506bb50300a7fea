// Single-stream decode served over HTTP (`conduit serve`, streamed /v1/completions) against the same engine
// (LocalEngine: the step loop in a worker thread) consumed in this process without HTTP, alternated in one run so
// that both see the same machine at the same moment. The server's main thread takes every token in from the worker,
// drives the request's stream and writes it to the socket; what that costs comes out of the cores the two compute
// threads run on, which is why the HTTP figure is lower.
//
//   node --import tsx benchmarks/served-http.ts [--model FILE] [--rounds 6] [--tokens 256] [--threads 2] [--temperature 0]
//                                               [--stream-interval 1] [--compare DIR] [--port 8750]
//
// http:        decode tokens/s as the client sees them (content chunks after the first, over the time since it);
//              main us/tok: CPU time of the server's main thread per generated token, from the kernel's
//              /proc/<pid>/task/<pid>/schedstat, over the whole request.
// in-process:  decode tokens/s of LocalEngine.generate() read by a `for await` in this process.
// --stream-interval N: the servers and the in-process engine hand a completion's tokens over N at a time after its
//              first (`conduit serve --stream-interval`); the rates count tokens, not events.
// --compare DIR: also serves from another checkout of Conduit (its own bin/conduit.js and native addon, e.g. an
//              older commit in a second git worktree) in the same rounds, for before/after figures.
// Every engine stores f16 KV and decodes greedily (or, with --temperature, by seeded draws; ignore_eos) after a
// 16-token prompt that changes every request, so no request reuses another's prefix. Figures are per round; the
// summary gives medians and bests.
import { spawn, type ChildProcess } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { LocalEngine } from '../src/engine/local-engine.ts';
import { engineNow } from '../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../src/engine/types.ts';
import { percentileOf } from '../src/util/stats.ts';
import { ensureBenchModel } from './model-files.ts';

const { values: args } = parseArgs({
  options: {
    model: { type: 'string' },
    rounds: { type: 'string', default: '6' },
    tokens: { type: 'string', default: '256' },
    temperature: { type: 'string', default: '0' },
    threads: { type: 'string', default: '2' },
    'stream-interval': { type: 'string', default: '1' },
    compare: { type: 'string' },
    port: { type: 'string', default: '8750' },
  },
});
const ROUNDS = Number(args.rounds), TOKENS = Number(args.tokens), THREADS = Number(args.threads), PROMPT_TOKENS = 16;
const STREAM_INTERVAL = Number(args['stream-interval']);
/** 0: greedy (argmax); else a seeded draw over the whole vocabulary at that temperature (the API's default is 1). */
const TEMPERATURE = Number(args.temperature);
const path = args.model ?? (await ensureBenchModel('Q8_0')).path;
const median = (values: readonly number[]): number => percentileOf(values, 0.5);

interface Server {
  label: string;
  child: ChildProcess;
  port: number;
}

async function startServer(label: string, checkout: string, port: number): Promise<Server> {
  const child = spawn(process.execPath, [join(checkout, 'bin/conduit.js'), 'serve', '--model', path, '--port', String(port),
    '--threads', String(THREADS), '--kv-cache-memory', '64MiB', '--kv-cache-dtype', 'f16', '--no-request-log',
    '--log-level', 'warn', ...(STREAM_INTERVAL !== 1 ? ['--stream-interval', String(STREAM_INTERVAL)] : [])], { cwd: checkout, stdio: ['ignore', 'ignore', 'inherit'] });
  const exited = new Promise<never>((_, reject) => child.once('exit', (code) => reject(new Error(`${label} server exited with code ${code}`))));
  exited.catch(() => {});
  for (;;) {
    const up = await Promise.race([
      fetch(`http://127.0.0.1:${port}/health`).then((r) => r.status === 200, () => false),
      exited,
    ]);
    if (up) return { label, child, port };
    await new Promise((r) => setTimeout(r, 200));
  }
}

/** CPU time of a thread so far, µs (schedstat's first field: ns on the CPU). */
function threadCpuUs(pid: number, tid: number): number {
  return Number(readFileSync(`/proc/${pid}/task/${tid}/schedstat`, 'utf8').split(' ')[0]) / 1000;
}

let seed = 1;
const nextPrompt = (): number[] => {
  seed++;
  return Array.from({ length: PROMPT_TOKENS }, (_, k) => 1 + ((seed * 31 + k * 7) % 30000));
};

/**
 * Decode tokens per second from the arrival times of a stream's content: the tokens after the first over the time
 * from the first arrival to the last (the first event carries the first token alone).
 */
const rateOf = (times: readonly number[], tokens: number): number => (tokens - 1) / ((times.at(-1)! - times[0]!) / 1000);

async function viaHttp(server: Server): Promise<{ rate: number; mainUsPerToken: number }> {
  const pid = server.child.pid!;
  const cpuBefore = threadCpuUs(pid, pid);
  const response = await fetch(`http://127.0.0.1:${server.port}/v1/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ prompt: nextPrompt(), max_tokens: TOKENS, stream: true, ignore_eos: true, temperature: TEMPERATURE,
      ...(TEMPERATURE > 0 ? { seed } : {}) }),
  });
  if (response.status !== 200) throw new Error(`${server.label}: HTTP ${response.status}: ${await response.text()}`);
  const times: number[] = [];
  const decoder = new TextDecoder();
  let pending = '';
  for await (const chunk of response.body!) {
    const now = performance.now();
    pending += decoder.decode(chunk as Uint8Array, { stream: true });
    let end: number;
    while ((end = pending.indexOf('\n\n')) >= 0) {
      const event = pending.slice(0, end);
      pending = pending.slice(end + 2);
      if (event.startsWith('data: {') && event.includes('"text"')) times.push(now);
    }
  }
  const cpu = threadCpuUs(pid, pid) - cpuBefore;
  return { rate: rateOf(times, TOKENS), mainUsPerToken: cpu / TOKENS };
}

async function inProcess(engine: LocalEngine): Promise<number> {
  const request: EngineRequest = {
    id: `in-process-${seed}`, priority: 0, arrivalMs: engineNow(), promptTokenIds: nextPrompt(),
    sampling: { ...DEFAULT_SAMPLING, temperature: TEMPERATURE, maxTokens: TOKENS, ignoreEos: true, ...(TEMPERATURE > 0 ? { seed } : {}) },
  };
  const times: number[] = [];
  let tokens = 0;
  for await (const output of engine.generate(request)) {
    times.push(performance.now());
    tokens += output.newTokenIds.length;
  }
  return rateOf(times, tokens);
}

const PORT = Number(args.port);
const servers = [await startServer('http', process.cwd(), PORT)];
if (args.compare !== undefined) servers.push(await startServer('http --compare', resolve(args.compare), PORT + 1));
const engine = await LocalEngine.start({ modelPath: path, threads: THREADS, kvDtype: 'f16', kvCacheMemoryBytes: 64 << 20, streamInterval: STREAM_INTERVAL });
try {
  // Warm-up: each path once (JIT, first allocations).
  for (const server of servers) await viaHttp(server);
  await inProcess(engine);

  type Figures = { rates: number[]; mainUs: number[] };
  const http = new Map<string, Figures>(servers.map((s) => [s.label, { rates: [], mainUs: [] }]));
  const local: number[] = [];
  const labels = [...servers.map((s) => s.label), 'in-process'];
  console.log(`model ${path}, ${TOKENS} tokens per request, ${THREADS} threads, ${TEMPERATURE > 0 ? `temperature ${TEMPERATURE}` : 'greedy'}, `
    + `stream interval ${STREAM_INTERVAL}, ${ROUNDS} rounds (order rotates)`);
  for (let round = 0; round < ROUNDS; round++) {
    const order = labels.map((_, i) => labels[(i + round) % labels.length]!);
    const line: string[] = [];
    for (const label of order) {
      const server = servers.find((s) => s.label === label);
      if (server === undefined) {
        local.push(await inProcess(engine));
        continue;
      }
      const figures = await viaHttp(server);
      http.get(label)!.rates.push(figures.rate);
      http.get(label)!.mainUs.push(figures.mainUsPerToken);
    }
    for (const server of servers) {
      const f = http.get(server.label)!;
      line.push(`${server.label} ${f.rates.at(-1)!.toFixed(1)} tok/s (main ${f.mainUs.at(-1)!.toFixed(0)} us/tok)`);
    }
    line.push(`in-process ${local.at(-1)!.toFixed(1)} tok/s`);
    console.log(`round ${round}: ${line.join('  ')}`);
  }
  console.log('');
  console.log('| engine | decode tok/s median | best | vs in-process (median) | server main thread CPU us/token median | min |');
  console.log('|---|---|---|---|---|---|');
  for (const server of servers) {
    const f = http.get(server.label)!;
    console.log(`| ${server.label} | ${median(f.rates).toFixed(1)} | ${Math.max(...f.rates).toFixed(1)} | `
      + `${(median(f.rates) / median(local)).toFixed(3)} | ${median(f.mainUs).toFixed(0)} | ${Math.min(...f.mainUs).toFixed(0)} |`);
  }
  console.log(`| in-process | ${median(local).toFixed(1)} | ${Math.max(...local).toFixed(1)} | 1 | - | - |`);
} finally {
  await engine.close();
  for (const server of servers) server.child.kill('SIGTERM');
}
