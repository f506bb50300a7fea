// The KV transfer between worker processes (src/cluster/kv-tcp.ts), the parts of benchmarks/kv-transfer.ts that
// need more than one process:
//
//   link     transfer throughput on loopback: a child process serves its pool on a KV port (and a raw TCP port that
//            writes the same number of bytes from one buffer); this process, the decode side, pulls 64 KiB, 1, 16
//            and 64 MiB of KV over the tcp link and the shm link (on their kept-alive connection) and reads the same
//            number of bytes raw (on a new connection per transfer and on one kept alive, into one reused buffer; and
//            on another kept alive with each read landing in a destination pool at the bytes' place, as a transfer's
//            must), alternating, best and median of N each, with the CPU time each side spent per transfer (median). With --link-compare (default on) the
//            links also go on a new connection per transfer (shm: a new ring), as every transfer did before
//            connections were kept. With --link-loop N (default 0: off), each size's raw kept, tcp and shm also run as
//            about N / blocks transfers back to back, for the CPU each side spends per transfer with its code hot.
//            Layout: 8 layers, 2 KV heads x 64, f16, blocks
//            of 16 tokens: 64 KiB per block, 4 KiB per run of one block; consecutive blocks, so a (layer, K|V) run
//            is size / 16.
//   overlap  how much of a streamed transfer hides behind the prefill: a prefill and a decode worker process
//            (the synthetic 110M model, chunked prefill) serve 512- and 2048-token prompts; per request the link's
//            busy time before the prefill ended (hidden) and after it (exposed). With --overlap-compare (default
//            on) a second pair whose decode worker adopts from staging (CONDUIT_KV_ADOPT_STAGING=1) alternates.
//   ttft     TTFT (and time to the second token, which waits for the transfer) of a 2048-token prompt on the 110M
//            model: one aggregated worker process vs a prefill and a decode worker process (and, --ttft-compare,
//            the same adopting from staging; --ttft-tcp on, the same with both workers on the tcp link), alternating.
//
// Run through benchmarks/kv-transfer.ts (--parts link,overlap,ttft); this file is also the child processes' entry
// (--child kv | worker).

import { spawn, type ChildProcess } from 'node:child_process';
import { loadavg } from 'node:os';
import { createInterface, type Interface } from 'node:readline';
import net from 'node:net';
import { fileURLToPath } from 'node:url';
import { closeIdleKvConnections, pullKvBlocks, KvTransferServer } from '../src/cluster/kv-tcp.ts';
import { kvHostId } from '../src/cluster/kv-shm.ts';
import { RemoteEngine } from '../src/cluster/remote-engine.ts';
import { remoteDisaggregatedEngine } from '../src/cluster/remote-disagg.ts';
import { WorkerServer } from '../src/cluster/worker-server.ts';
import { engineNow } from '../src/engine/clock.ts';
import { LocalEngine } from '../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest, type WorkerRole } from '../src/engine/types.ts';
import { kvPoolBytes, type KvPoolLayout } from '../src/kernels/types.ts';
import { ensureSyntheticModel } from '../src/model/synthetic.ts';
import { benchModelDir, ensureLlamaQuantized, LONG_CONTEXT_110M, llamaQuantizeMissing } from './model-files.ts';

/**
 * The 110M model with room for a 2048-token prompt and its output (the plain benchmark file stops at 2048 positions):
 * its 16k-context twin, Q8_0 when llama-quantize is there to make it, else F32.
 */
async function model110m(): Promise<{ path: string; label: string }> {
  const f32 = await ensureSyntheticModel(LONG_CONTEXT_110M, benchModelDir());
  if (llamaQuantizeMissing()) return { path: f32, label: `${LONG_CONTEXT_110M.name} F32` };
  return { path: ensureLlamaQuantized(f32, 'Q8_0'), label: `${LONG_CONTEXT_110M.name} Q8_0` };
}

const TOKEN = 'kv-transfer-bench';
const SELF = fileURLToPath(import.meta.url);

function argument(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at >= 0 ? process.argv[at + 1]! : fallback;
}

export const fmt = (value: number, digits = 2) => (Number.isFinite(value) ? value.toFixed(digits) : '-');
/** GB/s of `bytes` moved in `ms`. */
export const gb = (bytes: number, ms: number) => (ms > 0 ? bytes / ms / 1e6 : NaN);

export function table(header: string[], rows: string[][]): string {
  const widths = header.map((h, i) => Math.max(h.length, ...rows.map((r) => r[i]!.length)));
  const line = (cells: string[]) => cells.map((c, i) => (i === 0 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!))).join('  ');
  return [line(header), line(widths.map((w) => '-'.repeat(w))), ...rows.map(line)].join('\n');
}

export function median(values: number[]): number {
  const sorted = values.slice().sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)]!;
}

// 64 KiB per block: 8 layers x K/V x 4 KiB.
const LINK_LAYOUT = (numBlocks: number): KvPoolLayout => ({ numLayers: 8, numBlocks, blockSize: 16, numKvHeads: 2, headDim: 64, dtype: 'f16' });
const BLOCK_BYTES = 64 * 1024;
const MAX_BLOCKS = 1024;

// ---------------------------------------------------------------------------------------------------------------
// Child processes

/** A child: prints one JSON line (its ports) and runs until its stdin closes. */
async function child(kind: string): Promise<void> {
  const stop: (() => Promise<void>)[] = [];
  if (kind === 'kv') {
    const layout = LINK_LAYOUT(MAX_BLOCKS);
    const pool = new SharedArrayBuffer(kvPoolBytes(layout));
    const bytes = new Uint8Array(pool);
    for (let i = 0; i < bytes.length; i += 4096) bytes[i] = (i >> 12) & 0xff;
    const server = new KvTransferServer({ clusterToken: TOKEN, pool: { pool, layout } });
    const kvPort = await server.listen(0, '127.0.0.1');
    // A second KV port on the same pool: the transfers measured on a new connection each go there, so they leave
    // the first port's kept-alive connection (and its ring) alone.
    const second = new KvTransferServer({ clusterToken: TOKEN, pool: { pool, layout } });
    const kvPortNew = await second.listen(0, '127.0.0.1');
    // Raw: the client sends a byte count (8 bytes); the server writes that many bytes from one buffer, and again
    // for each count that follows on the connection (kept alive, as the KV link's are).
    const payload = Buffer.from(pool);
    const raw = net.createServer((socket) => {
      let pending = Buffer.alloc(0);
      socket.on('data', (chunk) => {
        pending = Buffer.concat([pending, chunk]);
        for (; pending.length >= 8; pending = pending.subarray(8)) socket.write(payload.subarray(0, Number(pending.readBigUInt64BE(0))));
      });
      socket.on('error', () => {});
    });
    await new Promise<void>((resolve) => raw.listen(0, '127.0.0.1', resolve));
    stop.push(() => server.close(), () => second.close(), () => new Promise((resolve) => raw.close(() => resolve())));
    process.stdout.write(`${JSON.stringify({ kvPort, kvPortNew, rawPort: (raw.address() as net.AddressInfo).port })}\n`);
  } else {
    const role = argument('role', 'both') as WorkerRole;
    const engine = await LocalEngine.start({
      modelPath: argument('model', ''), threads: Number(argument('threads', '1')), kvCacheMemoryBytes: 256 << 20, blockSize: 16,
      maxNumBatchedTokens: Number(argument('chunk', '256')), enableKvEvents: true, role,
    });
    const kvLink = argument('kv-link', 'auto') === 'tcp' ? 'tcp' as const : 'auto' as const;
    const server = new WorkerServer({ workerId: argument('id', role), engine, role, clusterToken: TOKEN, kvLink });
    const port = await server.listen(0, '127.0.0.1');
    stop.push(() => server.close(), () => engine.close());
    process.stdout.write(`${JSON.stringify({ port })}\n`);
  }
  // 'cpu' on stdin: this process's CPU time so far (ms) on stdout; the end of stdin: stop.
  const input = createInterface({ input: process.stdin });
  input.on('line', (line) => {
    if (line.trim() !== 'cpu') return;
    const { user, system } = process.cpuUsage();
    process.stdout.write(`${JSON.stringify({ cpuMs: (user + system) / 1000 })}\n`);
  });
  input.on('close', () => {
    void (async () => {
      for (const s of stop) await s();
      process.exit(0);
    })();
  });
}

interface Child {
  proc: ChildProcess;
  info: Record<string, number>;
  lines: Interface;
}

async function startChild(args: string[], env?: Record<string, string>): Promise<Child> {
  const proc = spawn(process.execPath, ['--import', 'tsx', SELF, '--child', ...args], {
    stdio: ['pipe', 'pipe', 'inherit'], ...(env ? { env: { ...process.env, ...env } } : {}),
  });
  const lines = createInterface({ input: proc.stdout! });
  const line = await new Promise<string>((resolve, reject) => {
    lines.once('line', resolve);
    proc.once('exit', (code) => reject(new Error(`child ${args.join(' ')} exited with code ${code}`)));
  });
  return { proc, info: JSON.parse(line) as Record<string, number>, lines };
}

/** A child's CPU time so far, ms. */
function childCpuMs(c: Child): Promise<number> {
  return new Promise((resolve) => {
    c.lines.once('line', (line) => resolve((JSON.parse(line) as { cpuMs: number }).cpuMs));
    c.proc.stdin!.write('cpu\n');
  });
}

function ownCpuMs(): number {
  const { user, system } = process.cpuUsage();
  return (user + system) / 1000;
}

async function stopChild(c: Child): Promise<void> {
  const exited = new Promise((resolve) => c.proc.once('exit', resolve));
  c.proc.stdin!.end();
  const timer = setTimeout(() => c.proc.kill('SIGKILL'), 10_000);
  await exited;
  clearTimeout(timer);
}

// ---------------------------------------------------------------------------------------------------------------
// link: throughput vs raw TCP

/**
 * Raw TCP: `bytes` read from the child's raw port into one reused buffer; ms. kept: on one connection kept alive.
 * into: on a second kept-alive connection, each read lands straight in this array at the bytes' place (a raw
 * transfer into the destination pool: the kernel's copy is the only one, nothing checked).
 */
function rawRead(port: number, bytes: number, kept: boolean, into?: Uint8Array): Promise<number> {
  const started = performance.now();
  return new Promise((resolve, reject) => {
    if (into) {
      rawInto = { target: into, at: 0, end: bytes };
      rawWant = (n: number) => {
        rawInto!.at += n;
        if (rawInto!.at < bytes) return;
        rawInto = undefined;
        rawWant = undefined;
        resolve(performance.now() - started);
      };
    }
    let socket = into ? keptRawInto : kept ? keptRaw : undefined;
    const ask = Buffer.alloc(8);
    ask.writeBigUInt64BE(BigInt(bytes));
    let got = 0;
    if (!into) {
      rawWant = (n: number) => {
        got += n;
        if (got < bytes) return;
        rawWant = undefined;
        resolve(performance.now() - started);
        if (!kept) socket!.destroy();
      };
    }
    if (socket) {
      socket.write(ask);
      return;
    }
    socket = net.connect({
      host: '127.0.0.1', port,
      onread: {
        // into: the next read goes where the next bytes belong (at most the rest of this transfer).
        buffer: into ? () => (rawInto ? rawInto.target.subarray(rawInto.at, rawInto.end) : rawBuffer) : rawBuffer,
        callback: (n: number) => { rawWant?.(n); return true; },
      },
    });
    if (into) keptRawInto = socket;
    else if (kept) keptRaw = socket;
    socket.on('connect', () => socket!.write(ask));
    socket.on('error', reject);
  });
}
const rawBuffer = Buffer.allocUnsafe(1 << 20);
let rawWant: ((n: number) => void) | undefined;
let keptRaw: net.Socket | undefined;
let keptRawInto: net.Socket | undefined;
let rawInto: { target: Uint8Array; at: number; end: number } | undefined;

export async function linkPart(): Promise<void> {
  const reps = Number(argument('link-reps', '7'));
  const sizes = argument('link-sizes', '64KiB,1MiB,16MiB,64MiB').split(',');
  const compare = argument('link-compare', 'on') !== 'off';
  const loadBefore = loadavg();
  const kv = await startChild(['kv']);
  const layout = LINK_LAYOUT(MAX_BLOCKS);
  const destination = { pool: new SharedArrayBuffer(kvPoolBytes(layout)), layout };
  // Raw TCP into a pool of its own, as large as the links' destination (its pages touched by the warm-up, as theirs).
  const rawDestination = new SharedArrayBuffer(kvPoolBytes(layout));
  const shm = kvHostId() !== null;
  const pull = async (blocks: number, link: 'tcp' | 'auto', fresh: boolean) => {
    const ids = Array.from({ length: blocks }, (_, i) => i);
    // A new connection (and, shm, a new ring): what every transfer paid before connections were kept alive.
    const port = fresh ? kv.info.kvPortNew! : kv.info.kvPort!;
    if (fresh) closeIdleKvConnections({ host: '127.0.0.1', port });
    const started = performance.now();
    const result = await pullKvBlocks({ requestId: `bench-${blocks}`, sourceBlockIds: ids, destinationBlockIds: ids, layers: [0, layout.numLayers] },
      { clusterToken: TOKEN, host: '127.0.0.1', port, destination, link });
    if (result.link !== (link === 'tcp' || !shm ? 'tcp' : 'shm')) throw new Error(`expected the ${link} link, got ${result.link}`);
    return performance.now() - started;
  };
  type Way = 'raw' | 'rawKept' | 'rawInto' | 'tcp' | 'tcpNew' | 'shm' | 'shmNew';
  const ways: Way[] = ['raw', 'rawKept', 'rawInto', 'tcp', ...(compare ? ['tcpNew' as const] : []), ...(shm ? ['shm' as const] : []),
    ...(shm && compare ? ['shmNew' as const] : [])];
  const rawTarget = new Uint8Array(rawDestination);
  const once = (what: Way, blocks: number) => what === 'raw' || what === 'rawKept' || what === 'rawInto'
    ? rawRead(kv.info.rawPort!, blocks * BLOCK_BYTES, what !== 'raw', what === 'rawInto' ? rawTarget : undefined)
    : pull(blocks, what === 'tcp' || what === 'tcpNew' ? 'tcp' : 'auto', what === 'tcpNew' || what === 'shmNew');
  const record = <T>(fill: () => T): Record<Way, T> => ({
    raw: fill(), rawKept: fill(), rawInto: fill(), tcp: fill(), tcpNew: fill(), shm: fill(), shmNew: fill(),
  });
  try {
    // Warm-up: the destination's pages touched once by two whole-pool transfers per way; then every way's
    // per-transfer code (descriptor, connection reuse, done) run as many times as a serving worker has run it after
    // its first few hundred requests, so V8 has optimized it: two whole-pool transfers call the per-run code
    // thousands of times but the per-transfer code twice, and the timed transfers below would otherwise measure
    // the interpreter.
    for (let i = 0; i < 2; i++) for (const what of ways) await once(what, MAX_BLOCKS);
    const warmTransfers = Number(argument('link-warm', '300'));
    for (let i = 0; i < warmTransfers; i++) for (const what of ways) await once(what, 1);
    const rows: string[][] = [];
    const cpuRows: string[][] = [];
    for (const size of sizes) {
      const bytes = parseSize(size);
      const blocks = Math.max(1, Math.round(bytes / BLOCK_BYTES));
      const total = blocks * BLOCK_BYTES;
      const times = record<number[]>(() => []);
      const send = record<number[]>(() => []);
      const receive = record<number[]>(() => []);
      for (let rep = 0; rep < reps; rep++) {
        const order = rep % 2 === 0 ? ways : ways.slice().reverse();
        for (const what of order) {
          const childBefore = await childCpuMs(kv);
          const ownBefore = ownCpuMs();
          const ms = await once(what, blocks);
          receive[what].push(ownCpuMs() - ownBefore);
          send[what].push(await childCpuMs(kv) - childBefore);
          times[what].push(ms);
        }
      }
      // Best and median of the alternated runs.
      const best = (way: Way) => Math.min(...times[way]);
      const rate = (way: Way) => ways.includes(way) ? `${fmt(gb(total, best(way)))} (${fmt(gb(total, median(times[way])))})` : '-';
      // Shares as the rates: of the best times (of the median times).
      const share = (way: Way, of: Way) => ways.includes(way)
        ? `${fmt((100 * best(of)) / best(way), 0)}% (${fmt((100 * median(times[of])) / median(times[way]), 0)}%)` : '-';
      rows.push([size, String(blocks), rate('raw'), rate('rawKept'), rate('rawInto'), rate('tcp'), share('tcp', 'raw'), share('tcp', 'rawKept'),
        share('tcp', 'rawInto'), rate('shm'), share('shm', 'raw'), share('shm', 'rawKept'), share('shm', 'rawInto'), rate('tcpNew'), rate('shmNew')]);
      const cpu = (way: Way) => ways.includes(way) ? `${fmt(median(send[way]), 2)} / ${fmt(median(receive[way]), 2)}` : '-';
      cpuRows.push([size, cpu('raw'), cpu('rawKept'), cpu('rawInto'), cpu('tcp'), cpu('shm'), cpu('tcpNew'), cpu('shmNew')]);
    }
    console.log(`\n4. KV transfer between two processes on loopback (${reps} alternating runs per row; GB/s = 1e9 B/s, best (median);`);
    console.log('   raw: raw TCP on a new connection per transfer (set-up included) and on one kept-alive connection, read into one');
    console.log('   reused 1 MiB buffer; raw into: on a kept-alive connection, each read landing in a destination pool at its place;');
    console.log('   tcp, shm: the links on their kept-alive connection (descriptor, checksums, copies into the blocks included), with');
    console.log('   their share of raw, of the best times (of the medians); new conn: the same on a new connection (and, shm, a new ring)');
    console.log('   per transfer)\n');
    console.log(table(['KV', 'blocks', 'raw new', 'raw kept', 'raw into', 'tcp link', 'of new', 'of kept', 'of into', 'shm link',
      'of new', 'of kept', 'of into', 'tcp new conn', 'shm new conn'], rows));
    console.log('\n   CPU ms per transfer, sending process / receiving process (median; the sender\'s includes answering the query)\n');
    console.log(table(['KV', 'raw new', 'raw kept', 'raw into', 'tcp link', 'shm link', 'tcp new conn', 'shm new conn'], cpuRows));
    const loops = Number(argument('link-loop', '0'));
    if (loops > 0) {
      // Back to back: the fixed cost of a transfer with both processes' code and data hot, without the CPU queries
      // around each transfer (the table above measures single transfers, cold).
      const loopRows: string[][] = [];
      const loopWays: Way[] = ways.filter((way) => way === 'rawKept' || way === 'tcp' || way === 'shm');
      for (const size of sizes) {
        const blocks = Math.max(1, Math.round(parseSize(size) / BLOCK_BYTES));
        const n = Math.max(3, Math.round(loops / blocks));
        const best = record<{ send: number; receive: number; wall: number }>(() => ({ send: Infinity, receive: Infinity, wall: Infinity }));
        for (let rep = 0; rep < 3; rep++) {
          for (const what of rep % 2 === 0 ? loopWays : loopWays.slice().reverse()) {
            const childBefore = await childCpuMs(kv);
            const ownBefore = ownCpuMs();
            const started = performance.now();
            for (let i = 0; i < n; i++) await once(what, blocks);
            const wall = (performance.now() - started) / n;
            const receive = (ownCpuMs() - ownBefore) / n;
            const send = (await childCpuMs(kv) - childBefore) / n;
            const b = best[what];
            best[what] = { send: Math.min(b.send, send), receive: Math.min(b.receive, receive), wall: Math.min(b.wall, wall) };
          }
        }
        const cell = (way: Way) => loopWays.includes(way)
          ? `${fmt(1000 * best[way].send, 0)} / ${fmt(1000 * best[way].receive, 0)} / ${fmt(1000 * best[way].wall, 0)}` : '-';
        const share = (way: Way) => loopWays.includes(way) ? `${fmt((100 * best.rawKept.wall) / best[way].wall, 0)}%` : '-';
        loopRows.push([size, String(n), cell('rawKept'), cell('tcp'), share('tcp'), cell('shm'), share('shm')]);
      }
      console.log('\n   Back to back (--link-loop): n transfers in a row on the kept-alive connection, best of 3 alternated loops;');
      console.log('   us per transfer: sending process CPU / receiving process CPU / wall, and the link\'s share of raw kept\'s wall\n');
      console.log(table(['KV', 'n', 'raw kept', 'tcp link', 'of kept', 'shm link', 'of kept'], loopRows));
    }
    const loadAfter = loadavg();
    console.log(`\n   load average (1/5/15 min) before: ${loadBefore.map((l) => l.toFixed(2)).join(' ')}, after: ${loadAfter.map((l) => l.toFixed(2)).join(' ')}`);
  } finally {
    keptRaw?.destroy();
    keptRawInto?.destroy();
    closeIdleKvConnections();
    await stopChild(kv);
  }
}

function parseSize(text: string): number {
  const match = /^(\d+)(KiB|MiB)$/.exec(text);
  if (!match) throw new Error(`size ${text}: use e.g. 64KiB or 16MiB`);
  return Number(match[1]) * (match[2] === 'KiB' ? 1024 : 1 << 20);
}

// ---------------------------------------------------------------------------------------------------------------
// overlap and ttft: real worker processes on the 110M model

function promptOf(length: number, seed: number): number[] {
  return Array.from({ length }, (_, t) => 3 + ((seed * 7919 + t * 104_729) % 31_000));
}

function requestOf(id: string, promptTokenIds: number[], maxTokens: number): EngineRequest {
  return { id, promptTokenIds, priority: 0, arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens, temperature: 0, ignoreEos: true } };
}

interface Timed { ttftMs: number; secondMs: number; outputs: EngineOutput[] }

async function timed(stream: AsyncIterable<EngineOutput>): Promise<Timed> {
  const started = performance.now();
  const outputs: EngineOutput[] = [];
  const times: number[] = [];
  for await (const output of stream) {
    if (output.newTokenIds.length > 0) times.push(performance.now() - started);
    outputs.push(output);
  }
  return { ttftMs: times[0]!, secondMs: times[1]!, outputs };
}

async function workers(modelPath: string, roles: WorkerRole[], chunk: number, env?: Record<string, string>,
  link: 'auto' | 'tcp' = 'auto'): Promise<{ children: Child[]; remotes: RemoteEngine[] }> {
  const threads = argument('threads', '1');
  const children: Child[] = [];
  for (const role of roles) {
    children.push(await startChild(['worker', '--role', role, '--id', `${role}-1`, '--model', modelPath, '--threads', threads,
      '--chunk', String(chunk), '--kv-link', link], env));
  }
  const remotes = await Promise.all(children.map((c) => RemoteEngine.connect(`127.0.0.1:${c.info.port}`, { clusterToken: TOKEN, events: true })));
  return { children, remotes };
}

/**
 * A prefill and a decode worker process behind a disaggregated engine. staging: the decode worker lands the KV in its
 * staging pool and its engine copies it from there (CONDUIT_KV_ADOPT_STAGING=1, the previous way) instead of having
 * it written into the blocks the request will own.
 */
async function disaggregated(modelPath: string, chunk: number, staging = false, link: 'auto' | 'tcp' = 'auto') {
  const { children, remotes } = await workers(modelPath, ['prefill', 'decode'], chunk, staging ? { CONDUIT_KV_ADOPT_STAGING: '1' } : undefined, link);
  const engine = remoteDisaggregatedEngine({
    prefill: [remotes[0]!], decode: [remotes[1]!], routerSeed: 1, policy: { minRemotePrefillTokens: 1 },
    estimates: { transferBytesPerSec: 1e12, prefillTokensPerSec: 1e3, fixed: true },
  });
  return {
    engine,
    close: async () => {
      await engine.close();
      for (const c of children) await stopChild(c);
    },
  };
}

export async function overlapPart(): Promise<void> {
  const chunk = Number(argument('chunk', '256'));
  const reps = Number(argument('overlap-reps', '3'));
  const compare = argument('overlap-compare', 'on') !== 'off';
  const model = await model110m();
  const loadBefore = loadavg();
  const clusters = [{ name: 'in place', cluster: await disaggregated(model.path, chunk) }];
  if (compare) clusters.push({ name: 'staging', cluster: await disaggregated(model.path, chunk, true) });
  try {
    const rows: string[][] = [];
    let seed = 100;
    for (const { cluster } of clusters) await timed(cluster.engine.generate(requestOf(`warm-${seed}`, promptOf(64, seed++), 2)));
    for (const length of [512, 2048]) {
      for (let rep = 0; rep < reps; rep++) {
        for (const { name, cluster } of rep % 2 === 0 ? clusters : clusters.slice().reverse()) {
          const run = await timed(cluster.engine.generate(requestOf(`ov-${length}-${rep}-${name}`, promptOf(length, seed++), 2)));
          const transfer = cluster.engine.channel.log.recent().at(-1)!;
          const hidden = transfer.overlapMs ?? 0;
          // ms: from the handoff's arrival to the blocks in the decode pool (waited for); the link's busy time after
          // the prefill is within it.
          rows.push([
            String(length), String(rep + 1), name, transfer.channel, fmt(run.ttftMs, 0), fmt(transfer.bytes / 2 ** 20, 1), fmt(hidden, 1),
            fmt(transfer.ms, 1), `${fmt(100 * (transfer.hiddenShare ?? 0), 0)}%`, fmt(run.secondMs - run.ttftMs, 1),
          ]);
        }
      }
    }
    console.log(`\n5. transfer hidden behind the prefill: ${model.label}, a prefill and a decode worker process (1 thread each),`);
    console.log(`   chunked prefill of ${chunk} tokens; blocks of each chunk stream while the next computes; decode: the KV written`);
    console.log('   into the blocks the request will own (in place) or into staging and copied from there (staging), alternating\n');
    console.log(table(['prompt', 'run', 'decode', 'link', 'TTFT ms', 'MiB', 'hidden ms', 'after ms', 'hidden share', '1st->2nd token ms'], rows));
    console.log('   hidden ms: the prefill worker\'s link time before the prefill ended; after ms: from the handoff reaching the decode');
    console.log('   worker to the blocks in its engine\'s pool (the last chunk\'s blocks, and for staging the copy out of it: what the');
    console.log('   second token waits for); hidden share = hidden / (hidden + after)');
    const loadAfter = loadavg();
    console.log(`   load average (1/5/15 min) before: ${loadBefore.map((l) => l.toFixed(2)).join(' ')}, after: ${loadAfter.map((l) => l.toFixed(2)).join(' ')}`);
  } finally {
    for (const { cluster } of clusters) await cluster.close();
  }
}

export async function ttftPart(): Promise<void> {
  const chunk = Number(argument('chunk', '256'));
  const reps = Number(argument('ttft-reps', '3'));
  const compare = argument('ttft-compare', 'on') !== 'off';
  const length = 2048;
  const model = await model110m();
  const loadBefore = loadavg();
  const aggregated = await workers(model.path, ['both'], chunk);
  const deployments: { name: string; generate: (r: EngineRequest) => AsyncIterable<EngineOutput>; close: () => Promise<void>; runs: Timed[] }[] = [{
    name: 'aggregated (1 worker)', generate: (r) => aggregated.remotes[0]!.generate(r), runs: [],
    close: async () => {
      await aggregated.remotes[0]!.close();
      for (const c of aggregated.children) await stopChild(c);
    },
  }];
  const inPlace = await disaggregated(model.path, chunk);
  deployments.push({ name: 'disaggregated (prefill + decode)', generate: (r) => inPlace.engine.generate(r), close: inPlace.close, runs: [] });
  if (argument('ttft-tcp', 'off') === 'on') {
    // The same with both workers set to tcp (loopback TCP where they would use shared memory).
    const tcp = await disaggregated(model.path, chunk, false, 'tcp');
    deployments.push({ name: 'disaggregated, tcp link', generate: (r) => tcp.engine.generate(r), close: tcp.close, runs: [] });
  }
  if (compare) {
    const staging = await disaggregated(model.path, chunk, true);
    deployments.push({ name: 'disaggregated, adopted from staging', generate: (r) => staging.engine.generate(r), close: staging.close, runs: [] });
  }
  try {
    let seed = 500;
    for (const d of deployments) await timed(d.generate(requestOf(`warm-${seed}`, promptOf(64, seed++), 2)));
    for (let rep = 0; rep < reps; rep++) {
      // Alternating, each with a prompt of its own (no prefix-cache hit).
      for (const d of rep % 2 === 0 ? deployments : deployments.slice().reverse()) {
        d.runs.push(await timed(d.generate(requestOf(`ttft-${rep}-${seed}`, promptOf(length, seed++), 4))));
      }
    }
  } finally {
    for (const d of deployments) await d.close();
  }
  const linkOf = (runs: Timed[]) => [...new Set(runs.map((r) => r.outputs.find((o) => o.timestamps.kvTransfer)?.timestamps.kvTransfer?.link ?? '-'))].join(',');
  const row = (name: string, runs: Timed[]) => [name, linkOf(runs), fmt(median(runs.map((r) => r.ttftMs)), 0), fmt(Math.min(...runs.map((r) => r.ttftMs)), 0),
    fmt(median(runs.map((r) => r.secondMs)), 0), fmt(median(runs.map((r) => r.secondMs - r.ttftMs)), 1)];
  console.log(`\n6. TTFT of a ${length}-token prompt, ${model.label}, chunked prefill of ${chunk} tokens, 1 thread per worker process,`);
  console.log(`   ${reps} alternating runs each (median; min TTFT)\n`);
  console.log(table(['deployment', 'link', 'TTFT ms', 'min TTFT', '2nd token ms', '1st->2nd ms'], deployments.map((d) => row(d.name, d.runs))));
  const loadAfter = loadavg();
  console.log(`   load average (1/5/15 min) before: ${loadBefore.map((l) => l.toFixed(2)).join(' ')}, after: ${loadAfter.map((l) => l.toFixed(2)).join(' ')}`);
}

if (process.argv.includes('--child')) await child(argument('child', ''));
