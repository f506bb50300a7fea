// Conduit served over HTTP against llama.cpp built natively on this machine (`llama-bench`), on the GGUFs people
// download: Q8_0, Q4_K_M, Q5_K_M and Q6_K files made by llama.cpp's own `llama-quantize` from the F32 synthetic 110M
// Llama (dim 768, 12 layers, 12 / 4 heads, FFN 2048, vocabulary 32000, written by Conduit's GGUF writer with a
// context length of 32768, so a 16384-token context row and the tokens it decodes fit), plus decode at long context. The default table of `npm run bench:peer`.
//
//   node --import tsx benchmarks/peer/native.ts [options]
//     --types Q8_0,Q4_K_M,Q5_K_M,Q6_K   files to compare (llama-quantize type names)
//     --contexts 4096,16384             decode rows at these context lengths (tokens already in the sequence)
//     --runs 3                          rounds; each round measures every figure on both engines, order alternating
//     --threads 2                       compute threads of both engines
//     --llama-bin DIR                   llama.cpp binaries (default: CONDUIT_LLAMA_CPP_BIN, else
//                                       benchmarks/peer/llama.cpp/build/bin as scripts/build-llama-cpp.sh leaves them)
//     --json FILE                       every sample as JSON
//
// llama.cpp: `llama-bench -t THREADS -fa 0,1` per round: pp512 (prefill of 512 tokens), tg128 (decode of 128 from an
// empty context) and tg64 at depth N (decode of 64 tokens after N tokens of context); a round's figure is the better
// of flash attention off and on. Conduit: `conduit serve` on 127.0.0.1 (f16 KV, THREADS threads), /v1/completions
// streaming with token-id prompts (fresh each time, so no prefix-cache hit): prefill = 512 / time to the first
// token of a 512-token prompt with max_tokens 1; decode = (tokens - 1) / (last token - first token) of 128 tokens
// after a 16-token prompt (each round also prints the rate from the server's median gap between tokens,
// `timings.tbt_p50_ms`, as a check on the client's clock); context N = the same over 64 tokens after an N-token prompt. Figures are medians over
// rounds; ratios are Conduit / llama.cpp medians.
//
// The decode roofline is the weight bytes one decode step reads (every matrix, the output projection included) over
// the rate this machine streams that many bytes at that moment: the addon's STREAM-like read, THREADS threads, over
// a buffer the size of those weights, taken right before and right after each engine's figures in each round. The
// read rate of this VM moves by 2x within minutes, and a buffer of another size measures another thing (a 64 MiB
// read partly hits the host's caches, 1 GiB does not), so a probe from another moment or of another size says little
// about the decode beside it. Each round's share of the roofline is its decode over the mean of its two adjacent
// readings; the table gives the median of the rounds' shares. A 1 GiB read (DRAM only) is printed for context.
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { existsSync, mkdirSync, statSync, writeFileSync } from 'node:fs';
import { request as httpRequest } from 'node:http';
import { createServer } from 'node:net';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs, promisify } from 'node:util';

import { loadNativeAddon } from '../../src/kernels/native.ts';
import { loadModel } from '../../src/model/loader.ts';
import { ensureSyntheticModel } from '../../src/model/synthetic.ts';
import { benchModelDir, ensureLlamaQuantized, llamaCppBinDir, LONG_CONTEXT_110M } from '../model-files.ts';
import { decodeWeightBytes } from './conduit-runner.ts';
import { loadLine, minMedMax, num, promptTokens, summarize, table } from './harness.ts';

const REPO = fileURLToPath(new URL('../../', import.meta.url));

const { values: args } = parseArgs({
  options: {
    types: { type: 'string', default: 'Q8_0,Q4_K_M,Q5_K_M,Q6_K' },
    contexts: { type: 'string', default: '4096,16384' },
    runs: { type: 'string', default: '3' },
    threads: { type: 'string', default: '2' },
    'llama-bin': { type: 'string' },
    json: { type: 'string' },
  },
});

const TYPES = args.types.split(',').map((t) => t.trim()).filter(Boolean);
const CONTEXTS = args.contexts.split(',').map(Number).filter((n) => n > 0);
const RUNS = Number(args.runs);
const THREADS = Number(args.threads);
const PROMPT = 512;
const DECODE = 128;
const DECODE_SHORT_PROMPT = 16;
const CONTEXT_DECODE = 64;
const LLAMA_BIN = args['llama-bin'] ? resolve(args['llama-bin']) : llamaCppBinDir();

// ---------------------------------------------------------------------------------------------------------------
// llama.cpp: llama-bench

interface LlamaBenchRow {
  n_prompt: number;
  n_gen: number;
  n_depth?: number;
  flash_attn: boolean | number;
  avg_ts: number;
}

const execFileAsync = promisify(execFile);

/**
 * One llama-bench run: figure -> best tok/s over flash attention off and on. Run without blocking the event loop:
 * a loop blocked for minutes keeps the HTTP client's idle keep-alive socket to Conduit, which the server closed
 * meanwhile, and the next request on it fails ("other side closed").
 */
async function llamaBench(model: string): Promise<Record<string, number>> {
  const run = async (extra: string[]): Promise<LlamaBenchRow[]> => JSON.parse((await execFileAsync(join(LLAMA_BIN, 'llama-bench'),
    ['-m', model, '-t', String(THREADS), '-fa', '0,1', '-r', '1', '-o', 'json', ...extra],
    { encoding: 'utf8', maxBuffer: 1 << 24 })).stdout) as LlamaBenchRow[];
  const out: Record<string, number> = {};
  const keep = (key: string, value: number) => { out[key] = Math.max(out[key] ?? 0, value); };
  for (const row of await run(['-p', String(PROMPT), '-n', String(DECODE)])) {
    keep(row.n_prompt > 0 ? 'prefill' : 'decode', row.avg_ts);
  }
  for (const context of CONTEXTS) {
    for (const row of await run(['-p', '0', '-n', String(CONTEXT_DECODE), '-d', String(context)])) keep(`ctx${context}`, row.avg_ts);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Conduit: `conduit serve`, measured through /v1/completions

function freePort(): Promise<number> {
  return new Promise((resolvePort, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address() as { port: number };
      server.close(() => resolvePort(port));
    });
  });
}

class ConduitServer {
  private constructor(private readonly child: ChildProcess, readonly url: string) {}

  static async start(model: string): Promise<ConduitServer> {
    const port = await freePort();
    const child = spawn(process.execPath, [join(REPO, 'bin/conduit.js'), 'serve', '--model', model, '--port', String(port),
      '--threads', String(THREADS), '--kv-cache-memory', '640MiB', '--kv-cache-dtype', 'f16', '--no-request-log', '--log-level', 'warn'],
    { stdio: ['ignore', 'ignore', 'inherit'], cwd: REPO });
    const server = new ConduitServer(child, `http://127.0.0.1:${port}`);
    const deadline = performance.now() + 180_000;
    for (;;) {
      if (child.exitCode !== null) throw new Error(`conduit serve exited with ${child.exitCode}`);
      try {
        if ((await fetch(`${server.url}/health`)).status === 200) return server;
      } catch { /* not listening yet */ }
      if (performance.now() > deadline) {
        await server.close();
        throw new Error('conduit serve did not become healthy within 180 s');
      }
      await new Promise((r) => setTimeout(r, 250));
    }
  }

  /**
   * Streams one completion; returns when each token event arrived (ms from submission) and the token count. Read with
   * node:http rather than fetch: on 2 cores the client's CPU per event comes out of the server's decode (llama-bench
   * has no client at all), and node:http's data events cost about half of fetch's stream reader per token here
   * (53-106 against 103-143 us of client CPU per token over 128-token streams, alternated, machine under load).
   */
  complete(prompt: number[], maxTokens: number): Promise<{ eventMs: number[]; tokens: number; serverTbtMs?: number }> {
    const started = performance.now();
    const url = new URL('/v1/completions', this.url);
    const body = JSON.stringify({ prompt, max_tokens: maxTokens, stream: true, ignore_eos: true, temperature: 0,
      stream_options: { include_usage: true } });
    return new Promise((resolveStream, reject) => {
      const request = httpRequest(url, { method: 'POST', headers: { 'Content-Type': 'application/json' } }, (response) => {
        response.setEncoding('utf8');
        if (response.statusCode !== 200) {
          let text = '';
          response.on('data', (chunk: string) => { text += chunk; });
          response.on('end', () => reject(new Error(`completion failed: ${response.statusCode} ${text}`)));
          return;
        }
        const eventMs: number[] = [];
        let tokens = 0;
        let serverTbtMs: number | undefined;
        let buffered = '';
        response.on('data', (chunk: string) => {
          const now = performance.now() - started;
          buffered += chunk;
          let end: number;
          while ((end = buffered.indexOf('\n\n')) >= 0) {
            const event = buffered.slice(0, end);
            buffered = buffered.slice(end + 2);
            if (!event.startsWith('data: ') || event === 'data: [DONE]') continue;
            const parsed = JSON.parse(event.slice(6)) as
              { choices?: unknown[]; usage?: { completion_tokens: number }; timings?: { tbt_p50_ms: number | null } };
            if (parsed.usage) tokens = parsed.usage.completion_tokens;
            if (parsed.timings?.tbt_p50_ms) serverTbtMs = parsed.timings.tbt_p50_ms;
            if (parsed.choices && parsed.choices.length > 0) eventMs.push(now);
          }
        });
        response.on('end', () => {
          if (tokens !== maxTokens) reject(new Error(`asked for ${maxTokens} tokens, got ${tokens}`));
          else resolveStream({ eventMs, tokens, ...(serverTbtMs !== undefined ? { serverTbtMs } : {}) });
        });
        response.on('error', reject);
      });
      request.on('error', reject);
      request.end(body);
    });
  }

  async close(): Promise<void> {
    if (this.child.exitCode !== null) return;
    const exited = new Promise((r) => this.child.once('exit', r));
    this.child.kill('SIGTERM');
    await exited;
  }
}

let nextSeed = 1;

/** One round of Conduit's figures: figure -> tok/s. */
async function conduitRound(server: ConduitServer): Promise<Record<string, number>> {
  const out: Record<string, number> = {};
  const prefill = await server.complete(promptTokens(nextSeed++, PROMPT), 1);
  out.prefill = PROMPT / (prefill.eventMs[0]! / 1000);
  const rate = (r: { eventMs: number[]; tokens: number }) => (r.tokens - 1) / ((r.eventMs.at(-1)! - r.eventMs[0]!) / 1000);
  const decode = await server.complete(promptTokens(nextSeed++, DECODE_SHORT_PROMPT), DECODE);
  out.decode = rate(decode);
  // A diagnostic, not in the table: the rate from the server's own median gap between tokens, which a late first
  // event at the client (two tokens in one read) cannot inflate.
  if (decode.serverTbtMs !== undefined) out['decode (server p50 gap)'] = 1000 / decode.serverTbtMs;
  for (const context of CONTEXTS) {
    out[`ctx${context}`] = rate(await server.complete(promptTokens(nextSeed++, context), CONTEXT_DECODE + 1));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------

interface TypeResults {
  type: string;
  path: string;
  fileMB: number;
  decodeBytes: number;
  conduit: Record<string, number[]>;
  llama: Record<string, number[]>;
  /** GB/s of reads over decodeBytes, two per engine per round (before and after its figures). */
  readings: number[];
  /** Per round: decode tok/s over the roofline at the mean of the two adjacent readings. */
  rooflineShare: { conduit: number[]; llama: number[] };
  loadBefore: string;
  loadAfter: string;
}

const FIGURES = [
  { key: 'prefill', label: `prefill ${PROMPT}`, target: 1.2 },
  { key: 'decode', label: `decode ${DECODE}`, target: 1.1 },
  ...CONTEXTS.map((c) => ({ key: `ctx${c}`, label: `decode ${CONTEXT_DECODE} at ${c} context`, target: c >= 16384 ? 1.0 : 1.1 })),
];

/** GB/s of a THREADS-thread read over `bytes` (best of five passes over a fresh buffer, so the first pass faulting its pages in does not count). */
function readBandwidth(bytes: number): number {
  return loadNativeAddon().bench.memoryBandwidth('read', Math.round(bytes), 5, THREADS);
}
const dramReadings: number[] = [];

if (!existsSync(join(LLAMA_BIN, 'llama-bench')) || !existsSync(join(LLAMA_BIN, 'llama-quantize'))) {
  console.error(`llama.cpp binaries not found in ${LLAMA_BIN}: run scripts/build-llama-cpp.sh or pass --llama-bin`);
  process.exit(2);
}
const cpu = loadNativeAddon().cpuInfo();
console.log(`# Conduit (HTTP) vs llama.cpp native (llama-bench), ${new Date().toISOString()}, node ${process.version}`);
console.log(`CPU: ${cpu.defaultThreads} cores, best kernel variant ${cpu.bestVariant}${cpu.avx512vnni ? ', AVX-512 VNNI' : ''}; ` +
  `${THREADS} threads per engine; llama.cpp ${LLAMA_BIN}; ${loadLine()}`);
const dir = benchModelDir();
mkdirSync(dir, { recursive: true });
const f32 = await ensureSyntheticModel(LONG_CONTEXT_110M, dir);
// A context row is its prompt plus CONTEXT_DECODE + 1 tokens: refuse up front what the model's context cannot hold
// (Conduit rejects such a request; llama-bench would run it past the trained length).
const tooLong = CONTEXTS.filter((c) => c + CONTEXT_DECODE + 1 > LONG_CONTEXT_110M.contextLength);
if (tooLong.length > 0) {
  console.error(`--contexts ${tooLong.join(',')}: a row needs context + ${CONTEXT_DECODE + 1} tokens; the model holds ` +
    `${LONG_CONTEXT_110M.contextLength}`);
  process.exit(2);
}
const results: TypeResults[] = [];
for (const type of TYPES) {
  const path = ensureLlamaQuantized(f32, type, LLAMA_BIN, THREADS);
  const model = await loadModel(path);
  const r: TypeResults = { type, path, fileMB: statSync(path).size / 1e6, decodeBytes: decodeWeightBytes(model), conduit: {},
    llama: {}, readings: [], rooflineShare: { conduit: [], llama: [] }, loadBefore: loadLine(), loadAfter: '' };
  process.stderr.write(`${type}: ${path} (${r.fileMB.toFixed(1)} MB), ${r.loadBefore}\n`);
  const server = await ConduitServer.start(path);
  try {
    await server.complete(promptTokens(nextSeed++, 64), 8); // warm-up: page faults, scratch buffers, JIT
    for (let round = 0; round < RUNS; round++) {
      dramReadings.push(readBandwidth(1 << 30));
      const order = round % 2 === 0 ? ['conduit', 'llama'] as const : ['llama', 'conduit'] as const;
      for (const engine of order) {
        const before = readBandwidth(r.decodeBytes);
        const figures = engine === 'conduit' ? await conduitRound(server) : await llamaBench(path);
        const after = readBandwidth(r.decodeBytes);
        for (const [key, value] of Object.entries(figures)) (r[engine][key] ??= []).push(value);
        r.readings.push(before, after);
        const roofline = ((before + after) / 2) * 1e9 / r.decodeBytes;
        if (figures.decode !== undefined) r.rooflineShare[engine].push(figures.decode / roofline);
        process.stderr.write(`  ${type} round ${round + 1} ${engine}: ${Object.entries(figures).map(([k, v]) => `${k} ${num(v)}`).join(', ')}; ` +
          `read ${num(before)}/${num(after)} GB/s\n`);
      }
    }
  } finally {
    await server.close();
  }
  r.loadAfter = loadLine();
  results.push(r);
}
const median = (values: number[] | undefined): number => (values ? summarize(values).median : NaN);
const ratio = (a: number, b: number): string => (Number.isFinite(a) && Number.isFinite(b) && b > 0 ? `${(a / b).toFixed(2)}x` : '-');
const rows: string[][] = [];
for (const r of results) {
  for (const f of FIGURES) {
    const c = median(r.conduit[f.key]), l = median(r.llama[f.key]);
    rows.push([`${r.type} ${f.label}`, minMedMax(summarize(r.conduit[f.key] ?? [])), minMedMax(summarize(r.llama[f.key] ?? [])),
      ratio(c, l), `${f.target}x ${c / l >= f.target ? 'met' : 'NOT met'}`]);
  }
}
console.log(`\ntok/s, min/median/max of ${RUNS} rounds; ratio = Conduit median / llama.cpp median`);
console.log(table(['figure', 'Conduit (HTTP)', 'llama.cpp native (best of fa off/on)', 'ratio', 'target'], rows));
console.log(`\nDecode roofline: weight bytes per decode step over the read rate of a buffer that size, read before and after ` +
  `each engine's figures (${THREADS} threads); share = the median over rounds of each round's decode / its roofline. ` +
  `DRAM read (1 GiB) over the run: min/median/max ${minMedMax(summarize(dramReadings))} GB/s`);
const pct = (share: number[]): string => { const s = summarize(share); return s.n > 0 ? `${(s.median * 100).toFixed(0)}% (${(s.min * 100).toFixed(0)}-${(s.max * 100).toFixed(0)})` : '-'; };
console.log(table(['file', 'decode MB/token', 'read GB/s min/med/max', 'roofline tok/s (median read)', 'Conduit decode', 'Conduit % roofline',
  'llama.cpp decode', 'llama.cpp % roofline', 'target 85%'],
  results.map((r) => {
    const roof = (median(r.readings) * 1e9) / r.decodeBytes;
    const share = median(r.rooflineShare.conduit);
    return [r.type, (r.decodeBytes / 1e6).toFixed(1), minMedMax(summarize(r.readings)), roof.toFixed(0), num(median(r.conduit.decode)),
      pct(r.rooflineShare.conduit), num(median(r.llama.decode)), pct(r.rooflineShare.llama), share >= 0.85 ? 'met' : 'NOT met'];
  })));
console.log(`\n${results.map((r) => `${r.type}: ${r.loadBefore} before, ${r.loadAfter} after`).join('\n')}`);

if (args.json) {
  writeFileSync(args.json, JSON.stringify({ date: new Date().toISOString(), threads: THREADS, runs: RUNS, cpu,
    dramReadGBs: dramReadings, results }, null, 2));
}
