// KV transfer for disaggregated prefill/decode, measured three ways in one run:
//
//   1. copy    copyKvBlocks between two shared-memory pools (the in-process channel's inner loop: one set() per
//              block run, 2 x layers runs per block) against one plain memcpy (Uint8Array.set) of the same bytes,
//              for a scattered and a contiguous destination;
//   2. workers a real prefill worker and decode worker (threads, native or reference backend, a synthetic model)
//              serving long prompts: the transfer's ms and GB/s as the decode worker measured them, next to the
//              TTFT (prefill on the prefill worker) and the time to the second token;
//   3. cluster the simulated cluster (SimCluster, Llama 3.1 70B on H100s, tp 4): TTFT and ITL p50/p99 for a mix of
//              long and short prompts, aggregated vs disaggregated on the same number of GPUs.
//   4. link    worker processes: KV transfer throughput on loopback, tcp and shm links, vs raw TCP in the same run;
//   5. overlap worker processes: share of a streamed transfer hidden behind a chunked prefill (512, 2048 tokens);
//   6. ttft    worker processes: TTFT of a 2048-token prompt on the 110M model, aggregated vs disaggregated
//              (4-6: benchmarks/kv-transfer-processes.ts).
//   7. checksum (only when named in --parts) the addon's CRC-32C paths side by side: GB/s of crc32c and crc32cCopy
//              (cached and uncached stores) at 4 KiB, 64 KiB, 1 MiB and 16 MiB, on one buffer reused (in cache) and
//              walking through 1 GiB (out of cache), the paths alternated within each round; best and median.
//
//   node --import tsx benchmarks/kv-transfer.ts [--parts copy,workers,cluster,link,overlap,ttft] [--requests 10]
//     [--rates 4,8] [--sim-requests 400] [--link-reps 7] [--link-sizes 64KiB,1MiB,16MiB,64MiB] [--overlap-reps 3]
//     [--ttft-reps 3] [--ttft-compare on|off] [--ttft-tcp on|off] [--link-compare on|off] [--link-loop 0] [--link-warm 300] [--chunk 256]
//     [--threads 1] [--checksum-rounds 7]

import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { engineNow } from '../src/engine/clock.ts';
import { copyKvBlocks, kvBlockBytes, type KvPoolView } from '../src/engine/handoff.ts';
import { tryLoadNativeAddon } from '../src/kernels/native.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../src/engine/types.ts';
import { kvPoolBytes, type KvPoolLayout } from '../src/kernels/types.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../src/model/synthetic.ts';
import { decideDisaggregation } from '../src/runtime/disaggregation-policy.ts';
import { createWorkerPool } from '../src/runtime/worker-pool.ts';
import { SimCluster, summarizeRequests, type DisaggregatedRoute, type RouteFunction, type RunSummary } from '../src/sim/cluster.ts';
import { H100_SXM, INFINIBAND_NDR } from '../src/sim/hardware.ts';
import { getModelProfile, kvBytesPerToken } from '../src/sim/models.ts';
import { DEFAULT_EFFICIENCY, kvTransferTimeMs, stepTimeMs } from '../src/sim/perf-model.ts';
import type { SimWorker, SimWorkerConfig } from '../src/sim/sim-worker.ts';
import { poissonWorkload } from '../src/sim/workload.ts';
import { fmt, gb, linkPart, median, overlapPart, table, ttftPart } from './kv-transfer-processes.ts';

function argument(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at >= 0 ? process.argv[at + 1]! : fallback;
}

const PARTS = new Set(argument('parts', 'copy,workers,cluster,link,overlap,ttft').split(','));

// ---------------------------------------------------------------------------------------------------------------
// 1. Block copies vs memcpy

function copyPart(): void {
  // A 110M-class model's pool: 12 layers, 4 KV heads of 64, f32, blocks of 16 tokens: 384 KiB per block.
  const layout = (numBlocks: number): KvPoolLayout => ({ numLayers: 12, numBlocks, blockSize: 16, numKvHeads: 4, headDim: 64, dtype: 'f32' });
  const source: KvPoolView = { pool: new SharedArrayBuffer(kvPoolBytes(layout(256))), layout: layout(256) };
  const destination: KvPoolView = { pool: new SharedArrayBuffer(kvPoolBytes(layout(256))), layout: layout(256) };
  new Uint8Array(source.pool).fill(7);
  const rows: string[][] = [];
  for (const numBlocks of [8, 64, 128]) {
    const bytes = numBlocks * kvBlockBytes(source.layout);
    const sourceIds = Array.from({ length: numBlocks }, (_, i) => i);
    // Scattered: every other destination block, so no run merges (the worst case for set() calls).
    const scattered = sourceIds.map((i) => (2 * i) % 256);
    const contiguous = sourceIds.map((i) => 100 + i);
    const memFrom = new Uint8Array(new SharedArrayBuffer(bytes)).fill(7);
    const memTo = new Uint8Array(new SharedArrayBuffer(bytes));
    const time = (run: () => void): number => {
      for (let i = 0; i < 3; i++) run(); // warm-up: page faults and JIT
      const samples: number[] = [];
      for (let i = 0; i < 15; i++) {
        const start = performance.now();
        run();
        samples.push(performance.now() - start);
      }
      return median(samples);
    };
    const memcpyMs = time(() => memTo.set(memFrom));
    const scatteredMs = time(() => copyKvBlocks(source, destination, sourceIds, scattered));
    const contiguousMs = time(() => copyKvBlocks(source, destination, sourceIds, contiguous));
    const runs = copyKvBlocks(source, destination, sourceIds, scattered).runs;
    rows.push([
      `${numBlocks} blocks (${numBlocks * 16} tokens)`, fmt(bytes / 2 ** 20, 1), fmt(gb(bytes, memcpyMs)),
      fmt(gb(bytes, scatteredMs)), String(runs), fmt(gb(bytes, contiguousMs)), fmt(scatteredMs / memcpyMs),
    ]);
  }
  console.log('\n1. copyKvBlocks between shared-memory pools vs one memcpy of the same bytes (median of 15)');
  console.log('   pool: 12 layers x 4 KV heads x 64, f32, 16-token blocks = 384 KiB per block (24 runs of 16 KiB)\n');
  console.log(table(['transfer', 'MiB', 'memcpy GB/s', 'scattered GB/s', 'set() calls', 'contiguous GB/s', 'scattered / memcpy time'], rows));
}

// ---------------------------------------------------------------------------------------------------------------
// 2. Real workers

async function workersPart(): Promise<void> {
  const numRequests = Number(argument('requests', '10'));
  const dir = mkdtempSync(join(tmpdir(), 'conduit-kv-bench-'));
  const modelPath = join(dir, 'model.gguf');
  // 8 layers x 4 KV heads x 64: 16 KiB of f32 KV per token, so a 1,000-token prompt moves ~16 MiB.
  writeSyntheticModel({
    name: 'kv-bench', dim: 512, numLayers: 8, numHeads: 8, numKvHeads: 4, ffnDim: 1024, contextLength: 2048,
    dtype: 'Q8_0', seed: 3, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
  }, modelPath);
  const pool = await createWorkerPool({
    engine: 'cpu', workers: 1, prefillWorkers: 1, decodeWorkers: 1, modelPath, threads: 1, kvCacheMemoryBytes: 64 << 20,
    // f32 as the header says, and as the numbers in docs/disaggregation.md were measured (auto would store f16).
    kvDtype: 'f32',
    disaggregationPolicy: { minRemotePrefillTokens: 64 },
    disaggregationEstimates: { transferBytesPerSec: 1e12, prefillTokensPerSec: 1e3, fixed: true },
  });
  try {
    const decodeBlocks = pool.workers.find((w) => w.role === 'decode')!.engine.info.kvCapacityTokens / 16;
    console.log(`\n2. one prefill + one decode worker thread, KV over shared memory; synthetic model: 8 layers, 4 KV heads x 64, f32 KV;`);
    console.log(`   decode pool ${decodeBlocks} blocks. The first transfer into a fresh pool also pays the OS's first touch of`);
    console.log('   its pages (page faults); the summary leaves it out.\n');
    const rows: string[][] = [];
    const measured: { ms: number; bytes: number; ttftMs: number; secondMs: number }[] = [];
    for (let i = 0; i < numRequests; i++) {
      const length = 1000;
      const request: EngineRequest = {
        id: `bench-${i}`, priority: 0, arrivalMs: engineNow(),
        promptTokenIds: Array.from({ length }, (_, t) => 3 + ((i * 7919 + t * 104_729) % 31_000)),
        sampling: { ...DEFAULT_SAMPLING, maxTokens: 3, temperature: 0, ignoreEos: true },
      };
      const outputs: EngineOutput[] = [];
      for await (const output of pool.engine.generate(request)) outputs.push(output);
      const last = outputs.at(-1)!;
      const ts = last.timestamps;
      const transfer = ts.kvTransfer!;
      const ttftMs = ts.firstToken! - ts.arrival;
      const secondMs = outputs[1]!.timestamps.lastToken! - ts.arrival;
      const transferMs = transfer.end - transfer.start;
      if (i > 0) measured.push({ ms: transferMs, bytes: transfer.bytes, ttftMs, secondMs });
      rows.push([
        request.id, String(length), fmt(ttftMs, 1), fmt(secondMs, 1), String(transfer.blocks), fmt(transfer.bytes / 2 ** 20, 1),
        fmt(transferMs, 3), fmt(gb(transfer.bytes, transferMs)), `${fmt((100 * transferMs) / ttftMs, 2)}%`,
        `${fmt((100 * transferMs) / secondMs, 2)}%`,
      ]);
    }
    console.log(table(['request', 'prompt', 'TTFT ms', '2nd token ms', 'blocks', 'MiB', 'transfer ms', 'GB/s', 'vs TTFT', 'of 2nd token'], rows));
    const medianMs = median(measured.map((m) => m.ms));
    console.log(`median of requests 1-${numRequests - 1}: transfer ${fmt(medianMs, 3)} ms, `
      + `${fmt(median(measured.map((m) => gb(m.bytes, m.ms))))} GB/s, ${fmt(100 * median(measured.map((m) => m.ms / m.ttftMs)), 2)}% of TTFT, `
      + `${fmt(100 * median(measured.map((m) => m.ms / m.secondMs)), 2)}% of the time to the second token`);
    const summary = pool.disaggregated!.channel.log.summary();
    console.log(`channel log (all ${summary.transfers} transfers): ${fmt(summary.bytes / 2 ** 20, 1)} MiB, p50 ${fmt(summary.p50Ms, 3)} ms, `
      + `p99 ${fmt(summary.p99Ms, 3)} ms per transfer`);
  } finally {
    await pool.engine.close();
    rmSync(dir, { recursive: true, force: true });
  }
}

// ---------------------------------------------------------------------------------------------------------------
// 3. Simulated cluster

function clusterPart(): void {
  for (const rate of argument('rates', '4,8').split(',').map(Number)) clusterRun(rate);
}

function clusterRun(rate: number): void {
  const model = getModelProfile('llama-3.1-70b');
  const tp = 4;
  const numRequests = Number(argument('sim-requests', '400'));
  const kvLink = { link: INFINIBAND_NDR, parallelLinks: tp };
  const worker: SimWorkerConfig = { model, hw: H100_SXM, tp, kvLink, enableKvEvents: false };
  // A mix: one request in four has an 8,000-token prompt (a document), the rest 400 (chat turns); 200 output tokens.
  const long = poissonWorkload({ ratePerSec: rate / 4, numRequests: numRequests / 4, inputTokens: 8000, outputTokens: 200, vocabSize: model.vocabSize, seed: 1, idPrefix: 'long-' });
  const short = poissonWorkload({ ratePerSec: (rate * 3) / 4, numRequests: (numRequests * 3) / 4, inputTokens: 400, outputTokens: 200, vocabSize: model.vocabSize, seed: 2, idPrefix: 'short-' });
  const arrivals = [...long, ...short].sort((a, b) => a.arrivalMs - b.arrivalMs);

  const pendingPrefill = (w: SimWorker) => w.load().activePrefillTokens;
  const leastBy = (indices: number[], workers: readonly SimWorker[], cost: (w: SimWorker) => number) =>
    indices.reduce((best, i) => (cost(workers[i]!) < cost(workers[best]!) ? i : best), indices[0]!);
  const decodeLoad = (w: SimWorker) => w.scheduler.numRequests + w.numPendingAdoptions;
  // Per-token prefill speed of one worker, and what a transfer of n tokens costs: the policy's estimates.
  const prefillTokensPerSec = (n: number) => (n / stepTimeMs({ prefillTokens: [{ newTokens: n, contextLen: 0 }], decodeSeqs: [] }, model, H100_SXM, tp)) * 1000;
  const transferBytesPerSec = (kvBytesPerToken(model) * 1000) / kvTransferTimeMs(1000, model, INFINIBAND_NDR, { parallelLinks: tp, efficiency: DEFAULT_EFFICIENCY.commEfficiency }) * 1000;

  const configs: { name: string; roles: ('both' | 'prefill' | 'decode')[]; route: () => RouteFunction }[] = [
    { name: 'aggregated 4 x (tp 4)', roles: ['both', 'both', 'both', 'both'], route: () => (_r, { workers }) => leastBy([0, 1, 2, 3], workers, decodeLoad) },
  ];
  for (const numPrefill of [1, 2]) {
    const roles = [...Array(numPrefill).fill('prefill'), ...Array(4 - numPrefill).fill('decode')] as ('prefill' | 'decode')[];
    const prefillIdx = roles.flatMap((r, i) => (r === 'prefill' ? [i] : []));
    const decodeIdx = roles.flatMap((r, i) => (r === 'decode' ? [i] : []));
    for (const conditional of [false, true]) {
      configs.push({
        name: `${numPrefill}P + ${4 - numPrefill}D${conditional ? ', conditional' : ''}`, roles,
        route: () => (request, { workers }) => {
          const decode = leastBy(decodeIdx, workers, decodeLoad);
          const prefill = leastBy(prefillIdx, workers, pendingPrefill);
          if (!conditional) return { prefill, decode } satisfies DisaggregatedRoute;
          const n = request.promptTokenIds.length;
          const choice = decideDisaggregation({
            numPromptTokens: n, blockSize: 16, decodeWorkerId: String(decode), decodeOverlapBlocks: 0,
            prefill: { workerId: String(prefill), queuedPrefillTokens: pendingPrefill(workers[prefill]!) },
            kvBytesPerToken: kvBytesPerToken(model), transferBytesPerSec, prefillTokensPerSec: prefillTokensPerSec(n),
          }, { minRemotePrefillTokens: 1024, maxPrefillQueueTokens: 32_768, transferOverheadMs: 0.1, compareTransfer: true });
          return choice.mode === 'disaggregated' ? { prefill, decode } : decode;
        },
      });
    }
  }

  const rows: string[][] = [];
  for (const config of configs) {
    const cluster = new SimCluster({ workers: config.roles.map((role) => ({ ...worker, role })), route: config.route() });
    const result = cluster.run(arrivals.map((r) => ({ ...r })));
    const s: RunSummary = summarizeRequests(result.requests, 0.1);
    const byKind = (prefix: string) => summarizeRequests(result.requests.filter((r) => r.id.startsWith(prefix)), 0.1);
    const transfers = result.requests.filter((r) => r.kvTransferMs !== undefined);
    const meanTransferMs = transfers.reduce((sum, r) => sum + r.kvTransferMs!, 0) / Math.max(1, transfers.length);
    rows.push([
      config.name, fmt(s.ttftMs.p50, 0), fmt(s.ttftMs.p99, 0), fmt(byKind('short-').ttftMs.p99, 0), fmt(byKind('long-').ttftMs.p99, 0),
      fmt(s.itlMs.p50, 1), fmt(s.itlMs.p99, 1), fmt(s.itlMs.max, 0), fmt(s.outputTokensPerSec, 0), `${transfers.length}`, fmt(meanTransferMs, 1),
    ]);
  }
  console.log(`\n3. simulated cluster: ${model.name} on 16 x ${H100_SXM.name} (4 workers of tp ${tp}), KV over ${tp} x ${INFINIBAND_NDR.name}`);
  console.log(`   ${numRequests} requests, Poisson ${rate}/s: 25% 8,000-token prompts, 75% 400-token; 200 output tokens; first 10% excluded\n`);
  console.log(table(['deployment', 'TTFT p50', 'TTFT p99', 'short p99', 'long p99', 'ITL p50', 'ITL p99', 'ITL max', 'out tok/s', 'transfers', 'transfer ms'], rows));
  console.log('   (ms; "short p99"/"long p99": TTFT p99 of each kind; "transfer ms": mean over the requests that moved KV)');
}

// ---------------------------------------------------------------------------------------------------------------
// 7. CRC-32C paths

function checksumPart(): void {
  const native = tryLoadNativeAddon();
  if (!native?.crc32cPath || !native.crc32cCopy) {
    console.log('\n7. checksum: skipped (native addon not built)');
    return;
  }
  const { path: original, supported } = native.crc32cPath();
  const paths = supported.filter((p) => p !== 'table'); // the tables run at a tenth of the others' rate at best
  const rounds = Number(argument('checksum-rounds', '7'));
  // Walked through by the out-of-cache rows: larger than the last-level cache lscpu reports here (480 MiB).
  const region = 1 << 30;
  const source = new Uint8Array(region);
  let x = 1;
  for (let i = 0; i < region; i += 4096) {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    source.fill(x >>> 24, i, i + 4096);
  }
  const target = new Uint8Array(region).fill(1); // pages mapped before any timing
  const ops = {
    crc32c: (n: number, from: number) => native.crc32c(source.subarray(from, from + n)),
    copy: (n: number, from: number, to: number) => native.crc32cCopy!(source.subarray(from, from + n), target, to),
    'copy uncached': (n: number, from: number, to: number) => native.crc32cCopy!(source.subarray(from, from + n), target, to, 0, true),
  };
  // One sample: at least 64 MiB and 4 calls; `walk` moves source and target on by n each call (cold lines).
  const sample = (op: (n: number, from: number, to: number) => number, n: number, walk: boolean): number => {
    const calls = Math.max(4, Math.ceil((64 << 20) / n));
    let at = 0;
    const start = performance.now();
    for (let i = 0; i < calls; i++) {
      op(n, at, walk ? at : 0);
      if (walk && (at += n) + n > region) at = 0;
    }
    return gb(calls * n, performance.now() - start);
  };
  const header = ['size', 'memory', 'call', ...paths.flatMap((p) => [`${p} best`, `${p} med`]), `${paths.at(-1)}/${paths[0]}`];
  const rows: string[][] = [];
  try {
    for (const n of [4 << 10, 64 << 10, 1 << 20, 16 << 20]) {
      for (const walk of [false, true]) {
        for (const [name, op] of Object.entries(ops)) {
          const rates = new Map(paths.map((p) => [p, [] as number[]]));
          for (let round = 0; round <= rounds; round++) {
            // Alternated within each round, in turn first; round 0 warms up and is dropped.
            for (let k = 0; k < paths.length; k++) {
              const path = paths[(k + round) % paths.length]!;
              native.crc32cPath(path);
              const rate = sample(op, n, walk);
              if (round > 0) rates.get(path)!.push(rate);
            }
          }
          const medians = paths.map((p) => median(rates.get(p)!));
          rows.push([n >= 1 << 20 ? `${n >> 20} MiB` : `${n >> 10} KiB`, walk ? 'out of cache' : 'in cache', name,
            ...paths.flatMap((p) => [fmt(Math.max(...rates.get(p)!), 1), fmt(median(rates.get(p)!), 1)]),
            fmt(medians.at(-1)! / medians[0]!, 2)]);
        }
      }
    }
  } finally {
    native.crc32cPath(original);
  }
  console.log(`\n7. CRC-32C paths: GB/s of the source's bytes, ${rounds} rounds, paths alternated (in use by default: ${original})\n`);
  console.log(table(header, rows));
}

if (PARTS.has('checksum')) checksumPart();
if (PARTS.has('copy')) copyPart();
if (PARTS.has('workers')) await workersPart();
if (PARTS.has('cluster')) clusterPart();
if (PARTS.has('link')) await linkPart();
if (PARTS.has('overlap')) await overlapPart();
if (PARTS.has('ttft')) await ttftPart();
