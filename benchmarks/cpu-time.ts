// CPU time (process.cpuUsage around each call) of native kernels and model steps: what a machine shared with other
// work still measures when wall times do not (every figure is the calling process's CPU, all its threads; with
// 1 thread it is that thread's). Four modes:
//
//   node --import tsx benchmarks/cpu-time.ts matmul [TYPES=Q8_0,Q4_K,Q5_K,Q6_K] [M=1] [THREADS=1]
//       packed avx512 matmul M x 768 x 8192 from DRAM (rotating over ~128 MB of copies) and from cache
//   node --import tsx benchmarks/cpu-time.ts model <model.gguf> [THREADS=1] [CONTEXT=512] [profile]
//       prefill of 512 tokens (min of 3) and decode steps at CONTEXT tokens (min and 25th percentile of 40); with
//       `profile`, then 3 prefills and 40 decode steps more with the model's section timers on: per section, the
//       calling thread's CPU time and the wall time per pass (with 1 thread the CPU time is the section's whole cost)
//   node --import tsx benchmarks/cpu-time.ts attention [CONTEXT=4096] [THREADS=2]
//       one layer of single-stream decode attention (12 / 4 heads, head_dim 64, f16 KV) from DRAM, median of 40
//   node --import tsx benchmarks/cpu-time.ts threads <model.gguf> [THREADS=1,2] [ROUNDS=5] [STEPS=16]
//       single-stream decode (after a 128-token prompt) on each thread count, one model instance per count, the
//       counts alternated round by round: wall and process CPU per step (the CPU of every thread, spinning included),
//       the best round of each count and the load average; then one profiled round per count (the mixture-of-experts
//       job's wall, its ready waits and the items threads took from another's share, the pool's hand-over wait)
//
// CONDUIT_NATIVE_ADDON points at another build (to compare two), CONDUIT_PACK_WEIGHTS=0 reads the ggml rows.
import { loadavg } from 'node:os';

import { loadNativeAddon, nativeModelSpec, supportedVariants } from '../src/kernels/native.ts';
import { GgmlType } from '../src/model/ggml-types.ts';
import { loadModel } from '../src/model/loader.ts';
import { quantize } from '../src/model/quant.ts';
import { kvPoolBytes, type ForwardBatch, type KvPoolLayout } from '../src/kernels/types.ts';

const addon = loadNativeAddon();
const [mode, ...rest] = process.argv.slice(2);
const cpuMs = (f: () => void): number => {
  const c = process.cpuUsage();
  f();
  const u = process.cpuUsage(c);
  return (u.user + u.system) / 1000;
};
const sorted = (xs: number[]): number[] => [...xs].sort((a, b) => a - b);

type ModelConfig = Awaited<ReturnType<typeof loadModel>>['config'];

/**
 * One sequence's KV pool of `maxBlocks` f16 blocks laid out in order, and its batches: `count` tokens from
 * position `start` (deterministic ids), logits of the last.
 */
function singleSequence(config: ModelConfig, maxBlocks: number, blockSize: number) {
  const layout: KvPoolLayout = { numLayers: config.numLayers, numBlocks: maxBlocks, blockSize,
    numKvHeads: config.numKvHeads, headDim: config.headDim, dtype: 'f16' };
  const table = Int32Array.from({ length: maxBlocks }, (_, i) => i);
  const batch = (start: number, count: number): ForwardBatch => ({
    numTokens: count, tokenIds: Int32Array.from({ length: count }, (_, i) => ((start + i) * 7919) % config.vocabSize),
    positions: Int32Array.from({ length: count }, (_, i) => start + i),
    slotMapping: Int32Array.from({ length: count }, (_, i) => start + i), numSeqs: 1,
    queryStartLoc: Int32Array.from([0, count]), seqLens: Int32Array.from([start + count]), blockTables: table,
    maxBlocksPerSeq: maxBlocks, logitsIndices: Int32Array.from([count - 1]),
  });
  return { layout, batch };
}

if (mode === 'matmul') {
  const M = Number(rest[1] ?? 1), threads = Number(rest[2] ?? 1), K = 768, N = 8192;
  for (const name of (rest[0] ?? 'Q8_0,Q4_K,Q5_K,Q6_K').split(',')) {
    const type = GgmlType[name as keyof typeof GgmlType] as GgmlType;
    const src = quantize(type, Float32Array.from({ length: N * K }, (_, i) => Math.sin(i * 0.37) * (1 + (i % 7))));
    const first = addon.ops.pack('avx512', type, src, K, N);
    const copies = Math.max(2, Math.ceil(128e6 / first.byteLength));
    const mats = [first, ...Array.from({ length: copies - 1 }, () => addon.ops.pack('avx512', type, src, K, N))];
    const x = Float32Array.from({ length: M * K }, (_, i) => Math.cos(i));
    const y = new Float32Array(M * N);
    const run = (w: Uint8Array) => cpuMs(() => addon.ops.matmul('avx512', type, w, x, M, K, N, y, threads, true));
    const cold = sorted(Array.from({ length: 3 * copies }, (_, r) => run(mats[r % copies]!)));
    const warm = sorted(Array.from({ length: 30 }, () => run(first)));
    const mb = first.byteLength / 1e6, med = cold[cold.length >> 1]!;
    console.log(`${name} ${M} x ${K} x ${N} (${mb.toFixed(1)} MB): from DRAM min ${cold[0]!.toFixed(3)} median ` +
      `${med.toFixed(3)} ms (${(mb / med).toFixed(1)} GB per CPU-second); from cache min ${warm[0]!.toFixed(3)} ms ` +
      `(${(mb / warm[0]!).toFixed(1)})`);
  }
} else if (mode === 'model' && rest[0]) {
  const path = rest[0], threads = Number(rest[1] ?? 1), ctx = Number(rest[2] ?? 512), BS = 16;
  const { config, weights } = await loadModel(path);
  const maxBlocks = Math.ceil((Math.max(ctx, 512) + 128) / BS); // room for the 40 + 40 decode steps
  const { layout, batch } = singleSequence(config, maxBlocks, BS);
  const model = new addon.NativeModel({ ...nativeModelSpec(config, weights,
    { layout, bytes: new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout))) }, supportedVariants(addon.cpuInfo()).at(-1)!,
    threads), packWeights: process.env.CONDUIT_PACK_WEIGHTS !== '0' });
  const prefill = sorted(Array.from({ length: 3 }, () => cpuMs(() => model.forward(batch(0, 512)))));
  let pos = 512;
  while (pos < ctx) { const n = Math.min(512, ctx - pos); model.forward(batch(pos, n)); pos += n; }
  pos = ctx;
  // Decode steps write their logits into one reused buffer, as the engine's steps do (a fresh 128 KB array per step
  // is the allocation the engine avoids).
  const logits = new Float32Array(config.vocabSize);
  const decode = sorted(Array.from({ length: 40 }, () => cpuMs(() => model.forward(batch(pos++, 1), logits))));
  console.log(`${path.replace(/^.*\//, '')}, ${threads} thread(s): prefill 512 min ${prefill[0]!.toFixed(0)} ms; ` +
    `decode at context ${ctx} min ${decode[0]!.toFixed(2)} ms, 25th percentile ${decode[10]!.toFixed(2)} ms`);
  if (rest[3] === 'profile') {
    const profile = (what: string, passes: number, pass: () => void): void => {
      model.setProfiling(true);
      model.takeProfile();
      const total = cpuMs(() => { for (let i = 0; i < passes; i++) pass(); });
      const sections = Object.entries(model.takeProfile()).sort((a, b) => b[1].cpuSeconds - a[1].cpuSeconds);
      model.setProfiling(false);
      console.log(`${what} profile (${passes} passes, process CPU ${(total / passes).toFixed(3)} ms per pass; nested ` +
        `sections are inside their parents too):`);
      for (const [name, v] of sections) {
        console.log(`  ${name.padEnd(40)} ${((v.cpuSeconds * 1000) / passes).toFixed(3).padStart(8)} ms CPU ` +
          `${((v.seconds * 1000) / passes).toFixed(3).padStart(8)} ms wall ${(v.calls / passes).toFixed(1).padStart(6)} calls`);
      }
    };
    profile('prefill 512', 3, () => model.forward(batch(0, 512)));
    profile(`decode step at context ${pos}`, 40, () => model.forward(batch(pos++, 1), logits));
  }
  model.dispose();
} else if (mode === 'attention') {
  const ctx = Number(rest[0] ?? 4096), threads = Number(rest[1] ?? 2), reps = 40;
  const numHeads = 12, numKvHeads = 4, headDim = 64, blockSize = 16, blocks = Math.ceil(ctx / blockSize);
  const layers = Math.max(4, Math.round((96 * 700) / ctx)); // ~70 MB of K and V: from DRAM
  const layout: KvPoolLayout = { numLayers: layers, numBlocks: blocks, blockSize, numKvHeads, headDim, dtype: 'f16' };
  const pool = new Uint8Array(kvPoolBytes(layout));
  for (let i = 0; i < pool.length; i += 2) { pool[i] = (i * 7919) & 0xff; pool[i + 1] = (i * 31) & 0x3b; } // finite halves
  const q = Float32Array.from({ length: numHeads * headDim }, (_, i) => Math.sin(i));
  const out = new Float32Array(q.length);
  const tables = Int32Array.from({ length: blocks }, (_, i) => i);
  const times = sorted(Array.from({ length: reps }, (_, r) => cpuMs(() => addon.ops.attention('avx512', q, out, pool, layout,
    r % layers, Int32Array.from([0, 1]), Int32Array.from([ctx]), tables, blocks, numHeads, threads))));
  const med = times[reps >> 1]!;
  console.log(`decode attention, context ${ctx}, ${threads} threads: min ${times[0]!.toFixed(3)} median ${med.toFixed(3)} ms ` +
    `(${((ctx * 1024) / 1e6 / med).toFixed(1)} GB of K and V per CPU-second)`);
} else if (mode === 'threads' && rest[0]) {
  const path = rest[0], counts = (rest[1] ?? '1,2').split(',').map(Number), rounds = Number(rest[2] ?? 5);
  const steps = Number(rest[3] ?? 16), prompt = 128, BS = 16;
  const { config, weights } = await loadModel(path);
  const maxBlocks = Math.ceil((prompt + rounds * (steps + 4) + 4 * steps + 64) / BS);
  const { layout, batch } = singleSequence(config, maxBlocks, BS);
  const variant = supportedVariants(addon.cpuInfo()).at(-1)!;
  const runs = counts.map((threads) => {
    const model = new addon.NativeModel({ ...nativeModelSpec(config, weights,
      { layout, bytes: new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout))) }, variant, threads),
    packWeights: process.env.CONDUIT_PACK_WEIGHTS !== '0' });
    model.forward(batch(0, prompt));
    return { threads, model, pos: prompt, best: { wall: Infinity, cpu: Infinity, load: '' } };
  });
  const load = (): string => loadavg()[0]!.toFixed(1);
  const decode = (r: (typeof runs)[number]): { wall: number; cpu: number } => {
    r.model.forward(batch(r.pos++, 1)); // warm-up step
    const c = process.cpuUsage();
    const t = performance.now();
    for (let i = 0; i < steps; i++) r.model.forward(batch(r.pos++, 1));
    const wall = (performance.now() - t) / steps;
    const u = process.cpuUsage(c);
    return { wall, cpu: (u.user + u.system) / 1000 / steps };
  };
  for (let round = 0; round < rounds; round++) {
    const line: string[] = [];
    for (const r of round % 2 === 0 ? runs : [...runs].reverse()) {
      const { wall, cpu } = decode(r);
      if (wall < r.best.wall) r.best = { wall, cpu, load: load() };
      line.push(`${r.threads}t ${wall.toFixed(2)} ms wall ${cpu.toFixed(2)} ms CPU`);
    }
    console.log(`round ${round + 1}: ${line.join(', ')} (load ${load()})`);
  }
  for (const r of runs) {
    console.log(`${path.replace(/^.*\//, '')}, ${r.threads} thread(s): best ${r.best.wall.toFixed(2)} ms/step wall, ` +
      `${r.best.cpu.toFixed(2)} ms CPU (load ${r.best.load})`);
  }
  for (const r of runs) {
    r.model.setProfiling(true);
    r.model.takeProfile();
    const { wall } = decode(r);
    const p = r.model.takeProfile();
    r.model.setProfiling(false);
    const per = (name: string): string => `${(((p[name]?.seconds ?? 0) * 1000) / (steps + 1)).toFixed(2)} ms`;
    const calls = (name: string): string => ((p[name]?.calls ?? 0) / (steps + 1)).toFixed(1);
    console.log(`profiled, ${r.threads} thread(s): ${wall.toFixed(2)} ms/step; per step: moe experts ${per('moe experts')}, ` +
      `moe router ${per('moe router')}, ready waits ${calls('moe expert ready waits')} (${per('moe expert ready waits')} ` +
      `summed over threads), items helped ${calls('moe expert items helped')}, pool hand-over wait ` +
      `${per('pool hand-over wait')} over ${calls('pool hand-over wait')} jobs (load ${load()})`);
    r.model.dispose();
  }
} else {
  console.error('usage: cpu-time.ts matmul [TYPES] [M] [THREADS] | model <file.gguf> [THREADS] [CONTEXT] [profile]'
    + ' | attention [CONTEXT] [THREADS] | threads <file.gguf> [THREADS] [ROUNDS] [STEPS]');
  process.exit(2);
}
