// CPU time (process.cpuUsage around each call) of native kernels and model steps: what a machine shared with other
// work still measures when wall times do not (every figure is the calling process's CPU, all its threads; with
// 1 thread it is that thread's). Three modes:
//
//   node --import tsx benchmarks/cpu-time.ts matmul [TYPES=Q8_0,Q4_K,Q5_K,Q6_K] [M=1] [THREADS=1]
//       packed avx512 matmul M x 768 x 8192 from DRAM (rotating over ~128 MB of copies) and from cache
//   node --import tsx benchmarks/cpu-time.ts model <model.gguf> [THREADS=1] [CONTEXT=512] [profile]
//       prefill of 512 tokens (min of 3) and decode steps at CONTEXT tokens (min and 25th percentile of 40); with
//       `profile`, then 3 prefills and 40 decode steps more with the model's section timers on: per section, the
//       calling thread's CPU time and the wall time per pass (with 1 thread the CPU time is the section's whole cost)
//   node --import tsx benchmarks/cpu-time.ts attention [CONTEXT=4096] [THREADS=2]
//       one layer of single-stream decode attention (12 / 4 heads, head_dim 64, f16 KV) from DRAM, median of 40
//
// CONDUIT_NATIVE_ADDON points at another build (to compare two), CONDUIT_PACK_WEIGHTS=0 reads the ggml rows.
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
  const layout: KvPoolLayout = { numLayers: config.numLayers, numBlocks: maxBlocks, blockSize: BS,
    numKvHeads: config.numKvHeads, headDim: config.headDim, dtype: 'f16' };
  const model = new addon.NativeModel({ ...nativeModelSpec(config, weights,
    { layout, bytes: new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout))) }, supportedVariants(addon.cpuInfo()).at(-1)!,
    threads), packWeights: process.env.CONDUIT_PACK_WEIGHTS !== '0' });
  const table = Int32Array.from({ length: maxBlocks }, (_, i) => i);
  const batch = (start: number, count: number): ForwardBatch => ({
    numTokens: count, tokenIds: Int32Array.from({ length: count }, (_, i) => ((start + i) * 7919) % config.vocabSize),
    positions: Int32Array.from({ length: count }, (_, i) => start + i),
    slotMapping: Int32Array.from({ length: count }, (_, i) => start + i), numSeqs: 1,
    queryStartLoc: Int32Array.from([0, count]), seqLens: Int32Array.from([start + count]), blockTables: table,
    maxBlocksPerSeq: maxBlocks, logitsIndices: Int32Array.from([count - 1]),
  });
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
} else {
  console.error('usage: cpu-time.ts matmul [TYPES] [M] [THREADS] | model <file.gguf> [THREADS] [CONTEXT] [profile] | attention [CONTEXT] [THREADS]');
  process.exit(2);
}
