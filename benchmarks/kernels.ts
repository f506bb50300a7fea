// Native kernel benchmark: throughput of each kernel next to this machine's limits measured in the same run
// (STREAM-like memory bandwidth and peak multiply-add rates, both from the addon), each figure also as a
// percentage of its roofline: the time the kernel would take if it ran at peak compute or at full memory
// bandwidth, whichever binds.
//
//   node --import tsx benchmarks/kernels.ts [--quick] [--threads N] [--all-variants] [--filter TEXT] [--model]
//                                           [--model-dtype Q8_0|BF16|Q4_K|Q6_K] [--profile] [--json FILE] [--help]
//
// --filter runs only the kernels whose name (e.g. "matmul q8_0", "attention") contains TEXT.
// --model adds the end-to-end figures of the 110M-class synthetic Llama (Q8_0, or the --model-dtype given):
// prefill of 512 tokens, decode of one stream and of 16 streams, min / median / max of a few runs, with the weights
// in the kernels' load-time packed layout (the default) and, for single-stream decode, also streamed from the ggml
// rows (packWeights off) for comparison. The VM this runs on stalls in bursts: compare figures taken side by side
// in one run.
// --profile (with --model) adds a per-section profile of single-stream decode steps, for both weight layouts:
// time per step of each matmul (per weight), attention and the small ops, the pool's hand-over waits, and the
// share of the step outside any section.
// BF16 against f32 FMA: where BF16 matmuls run on VDPBF16PS (kernel avx512_bf16), "matmul bf16" also times the f32
// FMA kernel they replace on prefill and decode shapes, and --model --model-dtype BF16 the whole model both ways:
// the old kernel runs in a second process started with CONDUIT_BF16_DOT=0 (kernel-baseline.ts), its runs
// alternating with this process's.
// K-quants: where Q4_K / Q6_K matmuls take 8-bit activations (kernels avx2_int8, avx512_vnni), "matmul q4_k" and
// "matmul q6_k" also time the f32 kernel on decoded weights they replace (a baseline process started with
// CONDUIT_KQUANT_DOT=0) on the 110M model's prefill and decode shapes, alternating, with the load average beside each.
import { readFileSync, writeFileSync } from 'node:fs';
import { loadavg } from 'node:os';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

import { GgmlType, byteSize, ggmlTypeName } from '../src/model/ggml-types.ts';
import {
  loadNativeAddon, supportedVariants, type KernelVariant, type NativeAddon, type NativeModel,
} from '../src/kernels/native.ts';
import type { Tensor } from '../src/model/weights.ts';
import { kvPoolBytes, type ForwardBatch, type KvPoolLayout } from '../src/kernels/types.ts';
import { MODEL_RUNS, ModelSteps, matmulRunner, startBaseline, type Baseline, type MatmulCase } from './kernel-baseline.ts';
import { randomFloats, randomWeights, seededBytes, timeCall, type Timing } from './kernel-inputs.ts';

const { values: args } = parseArgs({
  options: {
    quick: { type: 'boolean', default: false },
    threads: { type: 'string' },
    'all-variants': { type: 'boolean', default: false },
    model: { type: 'boolean', default: false },
    profile: { type: 'boolean', default: false },
    filter: { type: 'string', default: '' },
    json: { type: 'string' },
    'model-dtype': { type: 'string', default: 'Q8_0' },
    help: { type: 'boolean', default: false },
  },
});

if (args.help) {
  // The usage is the comment at the top of this file.
  const lines = readFileSync(fileURLToPath(import.meta.url), 'utf8').split('\n');
  console.log(lines.slice(0, lines.findIndex((l) => !l.startsWith('//'))).map((l) => l.replace(/^\/\/ ?/, '')).join('\n'));
  process.exit(0);
}
const modelDtype = args['model-dtype']!.toUpperCase();
if (!['Q8_0', 'BF16', 'Q4_K', 'Q6_K'].includes(modelDtype)) {
  throw new RangeError(`--model-dtype must be Q8_0, BF16, Q4_K or Q6_K, not ${modelDtype}`);
}

const addon: NativeAddon = loadNativeAddon();
const cpu = addon.cpuInfo();
const threads = args.threads ? Number(args.threads) : cpu.defaultThreads;
const variants: KernelVariant[] = args['all-variants'] ? supportedVariants(cpu) : [cpu.bestVariant];
const quick = args.quick;

// ---------------------------------------------------------------------------------------------------------------
// Timing

const minSeconds = quick ? 0.05 : 0.2;

/** Runs fn until `minSeconds` have passed (at least `minReps` times) and returns min / median seconds per call. */
function time(fn: () => void, minReps = 3): Timing {
  return timeCall(fn, minReps, minSeconds);
}

// ---------------------------------------------------------------------------------------------------------------
// Machine limits

const bandwidthBytes = (quick ? 64 : 256) << 20;
const machine = {
  readGBs: addon.bench.memoryBandwidth('read', bandwidthBytes, 5, threads),
  copyGBs: addon.bench.memoryBandwidth('copy', bandwidthBytes / 2, 5, threads),
  triadGBs: addon.bench.memoryBandwidth('triad', bandwidthBytes / 2, 5, threads),
  peakF32: addon.bench.peakFlops('f32', threads),
  peakInt8: addon.bench.peakFlops('int8', threads),
  peakBf16: addon.bench.peakFlops('bf16', threads), // 0 without AVX512-BF16
};
// The roofline of a variant uses the peak of its own instructions (a plain loop has no useful peak: the best
// variant's is used, so generic rows show how far from the hardware they are).
const peaks = new Map(variants.map((v) => [v, v === 'generic'
  ? { f32: machine.peakF32, int8: machine.peakInt8, bf16: machine.peakBf16 }
  : { f32: addon.bench.peakFlops('f32', threads, v), int8: addon.bench.peakFlops('int8', threads, v),
    bf16: addon.bench.peakFlops('bf16', threads, v) }]));

const features = ['avx2', 'fma', 'f16c', 'avx512f', 'avx512bw', 'avx512vl', 'avx512vnni', 'avx512bf16', 'amxTile',
  'amxInt8'] as const;
console.log(`CPU: ${features.filter((f) => cpu[f]).join(' ')}${cpu.amxTile ? '' : ' (no AMX)'}; best variant ` +
  `${cpu.bestVariant}; ${threads} threads`);
console.log(`Limits: read ${machine.readGBs.toFixed(1)} GB/s, copy ${machine.copyGBs.toFixed(1)} GB/s, triad ` +
  `${machine.triadGBs.toFixed(1)} GB/s, f32 FMA ${machine.peakF32.toFixed(0)} GFLOP/s, int8 dot ` +
  `${machine.peakInt8.toFixed(0)} GOP/s${machine.peakBf16 > 0 ? `, bf16 dot ${machine.peakBf16.toFixed(0)} GFLOP/s` : ''}\n`);
for (const [v, p] of peaks) {
  if (v !== cpu.bestVariant && v !== 'generic') {
    console.log(`  ${v} instructions: f32 FMA ${p.f32.toFixed(0)} GFLOP/s, int8 dot ${p.int8.toFixed(0)} GOP/s`);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Kernel rows

interface Row {
  kernel: string;
  variant: string;
  shape: string;
  ms: number;
  msMedian: number;
  gflops: number;
  gbs: number;
  /** Measured time as a share of the roofline time (100% = at the machine's limit). */
  roofline: number;
  bound: 'compute' | 'memory';
}
const rows: Row[] = [];

function record(kernel: string, variant: string, shape: string, t: Timing, ops: number, bytes: number,
  peakOps: number): void {
  const computeTime = ops / (peakOps * 1e9);
  const memoryTime = bytes / (machine.readGBs * 1e9);
  const row: Row = {
    kernel, variant, shape, ms: t.min * 1e3, msMedian: t.median * 1e3, gflops: ops / t.min / 1e9,
    gbs: bytes / t.min / 1e9, roofline: (Math.max(computeTime, memoryTime) / t.min) * 100,
    bound: computeTime > memoryTime ? 'compute' : 'memory',
  };
  rows.push(row);
  console.log(formatRow(row));
}

function formatRow(r: Row): string {
  return `${r.kernel.padEnd(14)} ${r.variant.padEnd(11)} ${r.shape.padEnd(34)} ${r.ms.toFixed(3).padStart(9)} ` +
    `${r.msMedian.toFixed(3).padStart(9)} ${r.gflops.toFixed(1).padStart(8)} ${r.gbs.toFixed(1).padStart(7)} ` +
    `${r.roofline.toFixed(0).padStart(5)}% ${r.bound}`;
}

console.log(`${'kernel'.padEnd(14)} ${'variant'.padEnd(11)} ${'shape'.padEnd(34)} ${'min ms'.padStart(9)} ` +
  `${'med ms'.padStart(9)} ${'GFLOP/s'.padStart(8)} ${'GB/s'.padStart(7)} ${'roof'.padStart(6)} bound`);

// ---------------------------------------------------------------------------------------------------------------
// matmul

const MATMUL_TYPES = [GgmlType.Q8_0, GgmlType.Q4_0, GgmlType.F32, GgmlType.F16, GgmlType.BF16, GgmlType.Q4_K,
  GgmlType.Q6_K];
// Weights of the decode cases are larger than the last-level cache, as a model's layers are when streamed.
const streamBytes = (quick ? 48 : 64) << 20;

// Kernels that multiply K-quant weights with 8-bit activations (the others decode them to f32).
const K_QUANT_INT_KERNELS = ['avx2_int8', 'avx512_vnni'];

const selected = (kernel: string) => kernel.includes(args.filter!);

/** The kernel serving `type` in `variant`, e.g. avx512_vnni for Q8_0 or avx512_bf16 for BF16 on VDPBF16PS. */
function matmulKernel(type: GgmlType, variant: KernelVariant): string {
  return addon.kernelVariants(variant)[`matmul_${ggmlTypeName(type).toLowerCase()}`] ?? variant;
}

/** The peak of the instructions the kernel multiplies with. */
function matmulPeak(type: GgmlType, variant: KernelVariant, kernel = matmulKernel(type, variant)): number {
  const p = peaks.get(variant)!;
  if (type === GgmlType.Q8_0 || type === GgmlType.Q4_0 || K_QUANT_INT_KERNELS.includes(kernel)) return p.int8;
  return kernel === 'avx512_bf16' ? p.bf16 : p.f32;
}

function benchMatmul(type: GgmlType, variant: KernelVariant): void {
  if (!selected(`matmul ${ggmlTypeName(type).toLowerCase()}`)) return;
  const k = 768;
  const kernel = matmulKernel(type, variant);
  const peak = matmulPeak(type, variant, kernel);
  const cases: { name: string; m: number; n: number }[] = [
    { name: 'decode', m: 1, n: Math.floor(streamBytes / byteSize(type, k) / 64) * 64 },
    { name: 'decode x16', m: 16, n: Math.floor(streamBytes / byteSize(type, k) / 64) * 64 },
    { name: 'prefill', m: quick ? 128 : 512, n: 2048 },
  ];
  for (const c of cases) {
    if (variant === 'generic' && c.name !== 'prefill') c.n = 4096; // the plain loops are slow; keep the run short
    const w = randomWeights(type, k, c.n, c.n + type);
    const x = randomFloats(c.m * k, 7);
    const y = new Float32Array(c.m * c.n);
    const t = time(() => addon.ops.matmul(variant, type, w, x, c.m, k, c.n, y, threads));
    const bytes = w.byteLength + x.byteLength + y.byteLength;
    record(`matmul ${ggmlTypeName(type).toLowerCase()}`, kernel, `${c.name} m=${c.m} k=${k} n=${c.n}`, t,
      2 * c.m * k * c.n, bytes, peak);
    // The same matrix in the load-time packed layout a model streams (where the variant has one).
    if (addon.ops.packedBytes(variant, type, k, c.n) > 0) {
      const packed = addon.ops.pack(variant, type, w, k, c.n);
      const tp = time(() => addon.ops.matmul(variant, type, packed, x, c.m, k, c.n, y, threads, true));
      record(`matmul ${ggmlTypeName(type).toLowerCase()}`, kernel, `${c.name} packed m=${c.m} k=${k} n=${c.n}`, tp,
        2 * c.m * k * c.n, packed.byteLength + x.byteLength + y.byteLength, peak);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// attention

function benchAttention(variant: KernelVariant): void {
  if (!selected('attention')) return;
  const numHeads = 12, numKvHeads = 4, headDim = 64, blockSize = 16;
  // The single-stream decode of the 110M model (--model) runs `decode 1 seq ctx 700` once per layer, with the KV
  // cache in DRAM: the weights streamed since the previous step have evicted it. The cold cases time that by
  // giving each repetition the next of enough layers for ~70 MB of K and V (96 at context 700; twice the last-level
  // cache), back to back so the pool's workers stay awake as they do within a step.
  const cases = [
    { name: 'decode 16 seqs ctx 512', seqs: 16, ctx: 512, newTokens: 1, cold: false },
    { name: 'decode 1 seq ctx 700', seqs: 1, ctx: 700, newTokens: 1, cold: false },
    { name: 'decode 1 seq ctx 700 cold', seqs: 1, ctx: 700, newTokens: 1, cold: true },
    // Long-context decode (bench:peer's 4096 and 16384 rows): one layer's K and V are 4 / 16 MB, from DRAM.
    ...(quick ? [] : [
      { name: 'decode 1 seq ctx 4096 cold', seqs: 1, ctx: 4096, newTokens: 1, cold: true },
      { name: 'decode 1 seq ctx 16384 cold', seqs: 1, ctx: 16384, newTokens: 1, cold: true },
    ]),
    { name: 'prefill 512', seqs: 1, ctx: quick ? 256 : 512, newTokens: quick ? 256 : 512, cold: false },
  ];
  for (const dtype of ['f16', 'f32'] as const) {
    for (const c of cases) {
      if (dtype === 'f32' && c.ctx > 4096) continue; // the f16 KV cache is the default; keep the pool small
      const blocksPerSeq = Math.ceil(c.ctx / blockSize);
      // Cold: about 70 MB of K and V over the layers the repetitions rotate through (96 at context 700).
      const coldLayers = Math.max(4, Math.round((96 * 700) / c.ctx));
      const layout: KvPoolLayout = {
        numLayers: c.cold ? coldLayers : 1, numBlocks: c.seqs * blocksPerSeq, blockSize, numKvHeads, headDim, dtype,
      };
      const pool = seededBytes(kvPoolBytes(layout), 3);
      if (dtype === 'f16') { // finite halves: clear the exponent's top bit
        for (let i = 1; i < pool.length; i += 2) pool[i] = pool[i]! & 0x3b;
      } else {
        pool.set(new Uint8Array(randomFloats(pool.length / 4, 5).buffer));
      }
      const tokens = c.seqs * c.newTokens;
      const q = randomFloats(tokens * numHeads * headDim, 9);
      const out = new Float32Array(q.length);
      const queryStartLoc = Int32Array.from({ length: c.seqs + 1 }, (_, i) => i * c.newTokens);
      const seqLens = new Int32Array(c.seqs).fill(c.ctx);
      // Blocks interleaved across sequences, as a busy pool hands them out.
      const tables = Int32Array.from({ length: c.seqs * blocksPerSeq }, (_, i) =>
        (i % blocksPerSeq) * c.seqs + Math.floor(i / blocksPerSeq));
      let layer = 0;
      const t = time(() => addon.ops.attention(variant, q, out, pool, layout, layer++ % layout.numLayers, queryStartLoc,
        seqLens, tables, blocksPerSeq, numHeads, threads));
      // Per query row and head: QK and PV, 2 multiply-adds per context position and dimension.
      let pairs = 0;
      for (let r = 0; r < c.newTokens; r++) pairs += c.ctx - c.newTokens + r + 1;
      const ops = 4 * pairs * c.seqs * numHeads * headDim;
      const kvBytes = c.seqs * c.ctx * 2 * numKvHeads * headDim * (dtype === 'f16' ? 2 : 4);
      record('attention', variant, `${c.name} ${dtype} KV`, t, ops, kvBytes + q.byteLength + out.byteLength,
        peaks.get(variant)!.f32);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Row kernels over arrays larger than the caches (so they stream from memory like the roofline assumes).

function benchRowOps(variant: KernelVariant): void {
  if (!['rmsnorm', 'add', 'swiglu', 'softmax', 'rope'].some(selected)) return;
  const dim = 4096, rows = quick ? 1024 : 4096, n = dim * rows;
  const a = randomFloats(n, 1), b = randomFloats(n, 2), out = new Float32Array(n);
  const weight = randomFloats(dim, 3);
  const shape = `${rows} x ${dim}`;
  const peak = peaks.get(variant)!.f32;
  record('rmsnorm', variant, shape, time(() => addon.ops.rmsnorm(variant, a, weight, rows, dim, 1e-5, out)),
    3 * n, 2 * 4 * n, peak);
  record('add', variant, shape, time(() => addon.ops.add(variant, out, a)), n, 3 * 4 * n, peak);
  record('swiglu', variant, shape, time(() => addon.ops.swiglu(variant, a, b, out)), 20 * n, 3 * 4 * n, peak);
  out.set(a);
  record('softmax', variant, shape, time(() => addon.ops.softmax(variant, out, rows, dim)), 20 * n, 3 * 4 * n, peak);
  const positions = Int32Array.from({ length: rows }, (_, i) => i);
  record('rope', variant, `${rows} x 64 heads x 64`, time(() =>
    addon.ops.rope(variant, out, positions, 64, 64, 64, false, 10000)), 3 * n, 2 * 4 * n, peak);
}

for (const variant of variants) {
  for (const type of MATMUL_TYPES) benchMatmul(type, variant);
  benchAttention(variant);
  benchRowOps(variant);
}

// ---------------------------------------------------------------------------------------------------------------
// BF16 weights: VDPBF16PS (activations rounded to bf16) against the f32 FMA kernel it replaced (weights widened to
// f32), which runs in the baseline process (CONDUIT_BF16_DOT=0). The new kernel is timed on the packed layout a
// model streams and on ggml rows; the old one has no packed layout.

let baselineProcess: Baseline | undefined;
const baseline = (): Baseline => (baselineProcess ??= startBaseline({ CONDUIT_BF16_DOT: '0' }));

interface Bf16Comparison {
  shape: string;
  f32Fma: Timing;
  bf16Packed: Timing;
  bf16Rows: Timing;
  gflops: { f32Fma: number; bf16Packed: number; bf16Rows: number };
  /** Old median time over new median time (packed). */
  speedup: number;
}
const bf16Comparisons: Bf16Comparison[] = [];

async function compareBf16Matmul(variant: KernelVariant): Promise<void> {
  if (!selected('matmul bf16') || matmulKernel(GgmlType.BF16, variant) !== 'avx512_bf16') return;
  const oldKernel = (await baseline().kernelVariants(variant)).matmul_bf16;
  const shapes: { m: number; k: number; n: number }[] = [];
  for (const k of [768, 2048]) {
    for (const n of quick ? [2048] : [768, 2048, 32000]) shapes.push({ m: quick ? 128 : 512, k, n });
  }
  for (const k of [768, 2048]) {
    for (const m of [1, 4, 16]) shapes.push({ m, k, n: Math.floor(streamBytes / (2 * k) / 64) * 64 });
  }
  const rounds = quick ? 2 : 3;
  console.log(`\nBF16 matmul, ${threads} threads: avx512_bf16 (VDPBF16PS, peak ${peaks.get(variant)!.bf16.toFixed(0)} ` +
    `GFLOP/s) against ${oldKernel} (f32 FMA, peak ${peaks.get(variant)!.f32.toFixed(0)} GFLOP/s) in the baseline ` +
    `process; min / median ms over ${rounds} alternating rounds, GFLOP/s and share of the roofline at the min`);
  console.log(`${'shape'.padEnd(24)} ${'f32 FMA'.padStart(28)} ${'bf16 dot, packed'.padStart(28)} ` +
    `${'bf16 dot, ggml rows'.padStart(28)}  speedup (median, packed)`);
  for (const { m, k, n } of shapes) {
    const c: MatmulCase = { variant, type: GgmlType.BF16, m, k, n, packed: false, threads };
    const packedRun = matmulRunner(addon, { ...c, packed: true });
    const rowsRun = matmulRunner(addon, c);
    const samples = { f32Fma: [] as Timing[], bf16Packed: [] as Timing[], bf16Rows: [] as Timing[] };
    for (let r = 0; r < rounds; r++) {
      samples.bf16Packed.push(time(packedRun));
      samples.f32Fma.push(await baseline().matmul(c, 3, minSeconds));
      samples.bf16Rows.push(time(rowsRun));
    }
    const ops = 2 * m * k * n, bytes = 2 * k * n + 4 * m * (k + n);
    const combine = (ts: Timing[]): Timing => {
      const medians = ts.map((t) => t.median).sort((a, b) => a - b);
      return { min: Math.min(...ts.map((t) => t.min)), median: medians[Math.floor(medians.length / 2)]! };
    };
    const f32Fma = combine(samples.f32Fma), bf16Packed = combine(samples.bf16Packed), bf16Rows = combine(samples.bf16Rows);
    const cell = (t: Timing, peak: number) => {
      const roof = Math.max(ops / (peak * 1e9), bytes / (machine.readGBs * 1e9)) / t.min;
      return `${(t.min * 1e3).toFixed(3)} / ${(t.median * 1e3).toFixed(3)} ${(ops / t.min / 1e9).toFixed(0).padStart(4)} ` +
        `${(roof * 100).toFixed(0).padStart(3)}%`;
    };
    const shape = `m=${m} k=${k} n=${n}`;
    const speedup = f32Fma.median / bf16Packed.median;
    console.log(`${shape.padEnd(24)} ${cell(f32Fma, peaks.get(variant)!.f32).padStart(28)} ` +
      `${cell(bf16Packed, peaks.get(variant)!.bf16).padStart(28)} ${cell(bf16Rows, peaks.get(variant)!.bf16).padStart(28)}` +
      `  ${speedup.toFixed(2)}x`);
    bf16Comparisons.push({
      shape, f32Fma, bf16Packed, bf16Rows, speedup,
      gflops: { f32Fma: ops / f32Fma.min / 1e9, bf16Packed: ops / bf16Packed.min / 1e9, bf16Rows: ops / bf16Rows.min / 1e9 },
    });
  }
}

for (const variant of variants) await compareBf16Matmul(variant);

// ---------------------------------------------------------------------------------------------------------------
// K-quants: the integer-dot kernels (8-bit activations) against the f32 kernel on decoded weights they replaced,
// which runs in a second baseline process (CONDUIT_KQUANT_DOT=0), alternating rounds, on the 110M model's shapes:
// prefill of 512 rows (q/k/v/o: 768 x 768, gate/up: 2048 x 768, down: 768 x 2048) and decode (1 row, a matrix
// larger than the last-level cache, as a model's layers are when streamed). Decode also as a share of the memory
// roofline (weight bytes / read bandwidth over the time). Each comparison line carries the load average beside it.

let kquantBaselineProcess: Baseline | undefined;
const kquantBaseline = (): Baseline => (kquantBaselineProcess ??= startBaseline({ CONDUIT_KQUANT_DOT: '0' }));

interface KquantComparison {
  type: string;
  shape: string;
  f32Decode: Timing;
  intDot: Timing;
  /** Old median time over new median time. */
  speedup: number;
  /** Decode shapes: share of the memory roofline at the median time, old and new. */
  roofline?: { f32Decode: number; intDot: number };
  load: number;
}
const kquantComparisons: KquantComparison[] = [];

async function compareKquantMatmul(type: GgmlType, variant: KernelVariant): Promise<void> {
  const name = ggmlTypeName(type).toLowerCase();
  if (!selected(`matmul ${name}`) || !K_QUANT_INT_KERNELS.includes(matmulKernel(type, variant))) return;
  const oldKernel = (await kquantBaseline().kernelVariants(variant))[`matmul_${name}`];
  const shapes: { m: number; k: number; n: number }[] = [
    { m: quick ? 128 : 512, k: 768, n: 768 }, { m: quick ? 128 : 512, k: 768, n: 2048 },
    { m: quick ? 128 : 512, k: 2048, n: 768 },
  ];
  for (const k of [768, 2048]) shapes.push({ m: 1, k, n: Math.floor(streamBytes / byteSize(type, k) / 64) * 64 });
  const rounds = quick ? 2 : 3;
  console.log(`\n${ggmlTypeName(type)} matmul, ${threads} threads: ${matmulKernel(type, variant)} (8-bit activations) ` +
    `against ${oldKernel} (weights decoded to f32) in the baseline process; min / median ms over ${rounds} ` +
    `alternating rounds; decode rows also as % of the memory roofline (read ${machine.readGBs.toFixed(1)} GB/s)`);
  console.log(`${'shape'.padEnd(24)} ${'f32 decode'.padStart(22)} ${'int8 dot'.padStart(22)}  speedup (median)  load`);
  for (const { m, k, n } of shapes) {
    const c: MatmulCase = { variant, type, m, k, n, packed: false, threads };
    const run = matmulRunner(addon, c);
    const samples = { f32Decode: [] as Timing[], intDot: [] as Timing[] };
    for (let r = 0; r < rounds; r++) {
      samples.intDot.push(time(run));
      samples.f32Decode.push(await kquantBaseline().matmul(c, 3, minSeconds));
    }
    const combine = (ts: Timing[]): Timing => {
      const medians = ts.map((t) => t.median).sort((a, b) => a - b);
      return { min: Math.min(...ts.map((t) => t.min)), median: medians[Math.floor(medians.length / 2)]! };
    };
    const f32Decode = combine(samples.f32Decode), intDot = combine(samples.intDot);
    const weightBytes = byteSize(type, k) * n;
    const share = (t: Timing) => (weightBytes / (machine.readGBs * 1e9)) / t.median * 100;
    const roofline = m === 1 ? { f32Decode: share(f32Decode), intDot: share(intDot) } : undefined;
    const cell = (t: Timing, key: 'f32Decode' | 'intDot') => `${(t.min * 1e3).toFixed(3)} / ${(t.median * 1e3).toFixed(3)}` +
      (roofline ? ` ${roofline[key].toFixed(0).padStart(3)}%` : '     ');
    const shape = `m=${m} k=${k} n=${n}`;
    const speedup = f32Decode.median / intDot.median;
    const load = loadavg()[0]!;
    console.log(`${shape.padEnd(24)} ${cell(f32Decode, 'f32Decode').padStart(22)} ${cell(intDot, 'intDot').padStart(22)}  ` +
      `${speedup.toFixed(2).padStart(6)}x          ${load.toFixed(1)}`);
    kquantComparisons.push({ type: ggmlTypeName(type), shape, f32Decode, intDot, speedup, roofline, load });
  }
}

for (const variant of variants) {
  for (const type of [GgmlType.Q4_K, GgmlType.Q6_K]) await compareKquantMatmul(type, variant);
}

// ---------------------------------------------------------------------------------------------------------------
// The 110M model end to end

interface ModelResult {
  name: string;
  tokPerSec: { min: number; median: number; max: number };
  note: string;
}
const modelResults: ModelResult[] = [];
/** Single-stream decode as a percentage of the memory bandwidth roofline (median and best run). */
let decodeShare: { median: number; best: number } | undefined;

interface ProfileRow {
  section: string;
  msPerStep: number;
  share: number;
  callsPerStep: number;
  gbs?: number;
}
const profiles: { layout: string; msPerStep: number; rows: ProfileRow[] }[] = [];

async function benchModel(path: string): Promise<void> {
  const { loadModel, allTensors } = await import('../src/model/loader.ts');
  const { nativeModelSpec, resolveKernelVariant } = await import('../src/kernels/native.ts');
  const model = await loadModel(path);
  const blockSize = 16, maxBlocks = 64, numSeqs = 16;
  const layout: KvPoolLayout = {
    numLayers: model.config.numLayers, numBlocks: numSeqs * maxBlocks, blockSize,
    numKvHeads: model.config.numKvHeads, headDim: model.config.headDim, dtype: 'f16',
  };
  // The model as the native backend loads it (packed), and one streaming the ggml rows, each with its own pool.
  const load = (packWeights: boolean): NativeModel => new addon.NativeModel({
    ...nativeModelSpec(model.config, model.weights, { layout, bytes: new Uint8Array(new SharedArrayBuffer(
      kvPoolBytes(layout))) }, resolveKernelVariant(undefined, cpu), threads),
    packWeights,
  });
  const packed = load(true), unpacked = load(false);
  // One logits buffer for every step, as an engine passes (EngineCore): no allocation per step.
  const logitsOut = new Float32Array(numSeqs * model.config.vocabSize);
  // Bytes a decode step must read: every matrix except the embedding table (one row is read per token), and the
  // K and V of every position of the context in every layer.
  const weightBytes = allTensors(model.weights).filter((t) => t !== model.weights.tokenEmbedding ||
    model.weights.output === model.weights.tokenEmbedding).reduce((s, t) => s + t.data.byteLength, 0);
  const kvBytesPerPosition = 2 * model.config.numLayers * model.config.numKvHeads * model.config.headDim * 2;
  const stepBytes = (context: number) => weightBytes + context * kvBytesPerPosition;

  // Block placement: sequence 0's blocks are consecutive, as a pool hands them to a lone request; the other
  // sequences' are interleaved, as a busy pool hands them out to sequences growing in lockstep.
  const blockOf = (id: number, b: number) => id === 0 ? b : maxBlocks + b * (numSeqs - 1) + id - 1;

  const batchFor = (seqs: { id: number; start: number; count: number }[]): ForwardBatch => {
    const flat = seqs.flatMap((s) => Array.from({ length: s.count }, (_, i) => ({ s, p: s.start + i })));
    const queryStartLoc = new Int32Array(seqs.length + 1);
    seqs.forEach((s, i) => { queryStartLoc[i + 1] = queryStartLoc[i]! + s.count; });
    const blockTables = new Int32Array(seqs.length * maxBlocks);
    seqs.forEach((s, i) => { for (let b = 0; b < maxBlocks; b++) blockTables[i * maxBlocks + b] = blockOf(s.id, b); });
    const slot = (id: number, p: number) => blockOf(id, Math.floor(p / blockSize)) * blockSize + (p % blockSize);
    return {
      numTokens: flat.length, tokenIds: Int32Array.from(flat, (r) => (r.p * 31 + r.s.id * 7) % model.config.vocabSize),
      positions: Int32Array.from(flat, (r) => r.p), slotMapping: Int32Array.from(flat, (r) => slot(r.s.id, r.p)),
      numSeqs: seqs.length, queryStartLoc, seqLens: Int32Array.from(seqs, (s) => s.start + s.count), blockTables,
      maxBlocksPerSeq: maxBlocks, logitsIndices: Int32Array.from(seqs, (_, i) => queryStartLoc[i + 1]! - 1),
    };
  };
  const runs = quick ? 2 : 3;
  const report = (name: string, note: string, rates: number[]) => {
    rates.sort((a, b) => a - b);
    const result = { name, note, tokPerSec: { min: rates[0]!, median: rates[Math.floor(rates.length / 2)]!,
      max: rates.at(-1)! } };
    modelResults.push(result);
    const { min, median, max } = result.tokPerSec;
    console.log(`${name.padEnd(36)} ${min.toFixed(0).padStart(6)} / ${median.toFixed(0).padStart(6)} / ` +
      `${max.toFixed(0).padStart(6)} tok/s  ${note}`);
    return result;
  };
  const rate = (tokens: number, fn: () => void) => {
    const t = performance.now();
    fn();
    return tokens / ((performance.now() - t) / 1000);
  };
  const measure = (name: string, note: string, tokens: number, fn: () => void) => {
    fn();
    return report(name, note, Array.from({ length: runs }, () => rate(tokens, fn)));
  };

  const info = packed.info();
  console.log(`\nModel: ${model.config.name} (${(weightBytes / 1e6).toFixed(1)} MB of weights and ` +
    `${(kvBytesPerPosition / 1e3).toFixed(1)} KB of K and V per context position read per decode step), ${modelDtype}, ` +
    `f16 KV, ${threads} threads; packed copy ${(info.packedWeightBytes / 1e6).toFixed(1)} MB, ` +
    `${(info.hugePageBytes / 1e6).toFixed(1)} MB on huge pages; min / median / max`);
  measure('prefill 512', '', 512, () => { packed.forward(batchFor([{ id: 0, start: 0, count: 512 }]), logitsOut); });
  unpacked.forward(batchFor([{ id: 0, start: 0, count: 512 }]), logitsOut); // its pool needs the same prompt
  packed.forward(batchFor([{ id: 1, start: 0, count: 512 }]), logitsOut); // the same prompt in interleaved blocks
  const decodeSteps = quick ? 16 : 64;
  // The read bandwidth varies with other guests' load (30 to 55 GB/s seen on one 2-core VM within minutes), so
  // each run is set against readings taken just before and just after it: its share of the roofline is its
  // rate over the rate that the mean of those readings would allow.
  const readNow = () => addon.bench.memoryBandwidth('read', bandwidthBytes / 2, 3, threads);
  // A run decodes positions 512 .. 512 + decodeSteps - 1: its mean context is this.
  const meanContext = 512 + (decodeSteps + 1) / 2;
  const rooflineAt = (gbs: number) => (gbs * 1e9) / stepBytes(meanContext);
  // Single-stream decode of both weight layouts and both block placements, alternating runs so that bursts of
  // load hit all alike.
  const decodeOne = (m: NativeModel, id: number, start: number) => () => {
    for (let i = 0; i < decodeSteps; i++) m.forward(batchFor([{ id, start: start + i, count: 1 }]), logitsOut);
  };
  const singles = [
    { name: 'decode 1 stream (ctx 512+)', run: decodeOne(packed, 0, 512), rates: [] as number[], shares: [] as number[] },
    { name: 'decode 1 stream, interleaved blocks', run: decodeOne(packed, 1, 512), rates: [] as number[],
      shares: [] as number[] },
    { name: 'decode 1 stream, ggml rows', run: decodeOne(unpacked, 0, 512), rates: [] as number[],
      shares: [] as number[] },
  ];
  for (const d of singles) d.run();
  const readings: number[] = [];
  for (let r = 0; r < Math.max(runs, 5); r++) {
    for (const d of singles) {
      const before = readNow();
      const tokPerSec = rate(decodeSteps, d.run);
      const after = readNow();
      readings.push(before, after);
      d.rates.push(tokPerSec);
      d.shares.push(tokPerSec / rooflineAt((before + after) / 2));
    }
  }
  readings.sort((a, b) => a - b);
  const readGBs = readings[Math.floor(readings.length / 2)]!;
  const note = `roofline ${rooflineAt(readGBs).toFixed(0)} tok/s: ${(stepBytes(meanContext) / 1e6).toFixed(1)} MB ` +
    `per step at ${readGBs.toFixed(1)} GB/s (median reading; ${readings[0]!.toFixed(1)} to ` +
    `${readings.at(-1)!.toFixed(1)})`;
  for (const d of singles) report(d.name, note, d.rates);
  for (let s = 1; s < numSeqs; s++) packed.forward(batchFor([{ id: s, start: 0, count: 128 }]), logitsOut);
  let step = 0;
  measure(`decode ${numSeqs} streams (ctx 128+)`, '', decodeSteps * numSeqs, () => {
    for (let i = 0; i < decodeSteps; i++, step++) {
      packed.forward(batchFor(Array.from({ length: numSeqs }, (_, s) => ({
        id: s, start: (s === 0 ? 512 + decodeSteps : 128) + (step % 128), count: 1,
      }))), logitsOut);
    }
  });
  const shares = singles.map((d) => {
    const sorted = [...d.shares].sort((a, b) => a - b);
    return { median: (sorted[Math.floor(sorted.length / 2)]! * 100).toFixed(0), best: (sorted.at(-1)! * 100).toFixed(0) };
  });
  console.log(`decode at ${shares[0]!.median}% of the memory bandwidth roofline (median over runs, each against ` +
    `the bandwidth read around it; best run ${shares[0]!.best}%; interleaved blocks: ${shares[1]!.median}%, best ` +
    `${shares[1]!.best}%; ggml rows: ${shares[2]!.median}%, best ${shares[2]!.best}%)`);
  decodeShare = { median: Number(shares[0]!.median), best: Number(shares[0]!.best) };

  if (args.profile) {
    // Bytes each matmul section streams per step, for its bandwidth.
    const bytesOf = (pick: (l: (typeof model.weights.layers)[number]) => Tensor[]) =>
      model.weights.layers.reduce((s, l) => s + pick(l).reduce((t, w) => t + w.data.byteLength, 0), 0);
    const sectionBytes: Record<string, number> = {
      'matmul attn_qkv': bytesOf((l) => [l.wq, l.wk, l.wv]),
      'matmul attn_output': bytesOf((l) => [l.wo]),
      'matmul ffn_gate+up': bytesOf((l) => [l.wGate, l.wUp]),
      'matmul ffn_down': bytesOf((l) => [l.wDown]),
      'matmul output': model.weights.output.data.byteLength,
    };
    // Sections that run inside others (not added to the step's total).
    const nested = new Set(['quantize activations', 'pool hand-over wait']);
    // Windows of steps, alternating between the layouts so that bursts of load from other processes hit both
    // alike; each layout's profile is its fastest window (the one least disturbed), next to its median step time.
    const windows = quick ? 4 : 12, stepsPerWindow = 16, start = 600;
    const layouts = [{ name: 'packed', m: packed }, { name: 'ggml rows', m: unpacked }].map((l) => ({
      ...l, windows: [] as { msPerStep: number; sections: Record<string, { seconds: number; calls: number }> }[],
    }));
    for (const l of layouts) {
      l.m.forward(batchFor([{ id: 0, start, count: 1 }]), logitsOut);
      l.m.setProfiling(true);
    }
    for (let w = 0; w < windows; w++) {
      for (const l of layouts) {
        l.m.takeProfile();
        const t = performance.now();
        for (let i = 1; i <= stepsPerWindow; i++) {
          l.m.forward(batchFor([{ id: 0, start: start + w * stepsPerWindow + i, count: 1 }]), logitsOut);
        }
        l.windows.push({ msPerStep: (performance.now() - t) / stepsPerWindow, sections: l.m.takeProfile() });
      }
    }
    for (const l of layouts) {
      l.m.setProfiling(false);
      const sortedSteps = l.windows.map((w) => w.msPerStep).sort((a, b) => a - b);
      const best = l.windows.find((w) => w.msPerStep === sortedSteps[0])!;
      const msPerStep = best.msPerStep;
      const rows: ProfileRow[] = Object.entries(best.sections).map(([section, v]) => ({
        section, msPerStep: (v.seconds * 1e3) / stepsPerWindow, share: (v.seconds * 1e3) / stepsPerWindow / msPerStep,
        callsPerStep: v.calls / stepsPerWindow,
        ...(sectionBytes[section] ? { gbs: sectionBytes[section]! / (v.seconds / stepsPerWindow) / 1e9 } : {}),
      }));
      const top = rows.filter((r) => !nested.has(r.section));
      const matmulMs = top.filter((r) => r.section.startsWith('matmul')).reduce((s, r) => s + r.msPerStep, 0);
      const accounted = top.reduce((s, r) => s + r.msPerStep, 0);
      top.sort((a, b) => b.msPerStep - a.msPerStep);
      const ordered = [...top, ...rows.filter((r) => nested.has(r.section)).map((r) => ({ ...r,
        section: `  (within the above) ${r.section}` })), {
        section: 'outside any section (validation, N-API, the JS loop)', msPerStep: msPerStep - accounted,
        share: (msPerStep - accounted) / msPerStep, callsPerStep: 1 }];
      profiles.push({ layout: l.name, msPerStep, rows: ordered });
      // Windows decode positions start + 1 .. start + windows * stepsPerWindow.
      const bytes = stepBytes(start + (windows * stepsPerWindow + 1) / 2);
      const gbs = (ms: number, read = bytes) => (read / (ms / 1e3) / 1e9).toFixed(1);
      console.log(`\nProfile of single-stream decode (ctx ${start}+), weights ${l.name}, fastest of ${windows} ` +
        `windows of ${stepsPerWindow} steps: ${msPerStep.toFixed(3)} ms per step (median window ` +
        `${sortedSteps[Math.floor(windows / 2)]!.toFixed(3)} ms), ${(1000 / msPerStep).toFixed(0)} tok/s, ` +
        `${gbs(msPerStep)} GB/s overall = ${((bytes / (msPerStep / 1e3) / 1e9 / readGBs) * 100)
          .toFixed(0)}% of the roofline; all matmuls ${matmulMs.toFixed(3)} ms = ${gbs(matmulMs, weightBytes)} GB/s`);
      console.log(`${'section'.padEnd(56)} ${'ms/step'.padStart(8)} ${'share'.padStart(6)} ${'calls'.padStart(6)} ` +
        `${'GB/s'.padStart(6)}`);
      for (const r of ordered) {
        console.log(`${r.section.padEnd(56)} ${r.msPerStep.toFixed(3).padStart(8)} ${(r.share * 100).toFixed(1)
          .padStart(5)}% ${r.callsPerStep.toFixed(0).padStart(6)} ${r.gbs ? r.gbs.toFixed(1).padStart(6) : ''}`);
      }
    }
  }
  packed.dispose();
  unpacked.dispose();
}

// The BF16 model on VDPBF16PS against the f32 FMA kernel, and the Q4_K / Q6_K models on 8-bit activations against
// the f32 kernel on decoded weights (each in its baseline process): each kind of run alternates between the two
// processes, one run at a time.
const bf16ModelComparison: { run: string; f32Fma: number[]; bf16Dot: number[] }[] = [];
const kquantModelComparison: { run: string; f32Decode: number[]; intDot: number[]; load: number[] }[] = [];

async function compareModel(path: string, base: Baseline, title: string, oldName: string, newName: string):
  Promise<{ run: string; before: number[]; after: number[]; load: number[] }[]> {
  const { resolveKernelVariant } = await import('../src/kernels/native.ts');
  const variant = resolveKernelVariant(undefined, cpu);
  await base.loadModel(path, variant, threads);
  const local = await ModelSteps.load(addon, path, variant, threads);
  const runs = quick ? 3 : 5;
  console.log(`\n${title}, ${threads} threads, ${runs} alternating runs each; tok/s min / median / max, load average ` +
    `(1 min) at the end`);
  const stats = (rates: number[]) => {
    const sorted = [...rates].sort((a, b) => a - b);
    return { text: `${sorted[0]!.toFixed(0)} / ${sorted[Math.floor(sorted.length / 2)]!.toFixed(0)} / ` +
      `${sorted.at(-1)!.toFixed(0)}`, median: sorted[Math.floor(sorted.length / 2)]! };
  };
  const results: { run: string; before: number[]; after: number[]; load: number[] }[] = [];
  for (const which of MODEL_RUNS) {
    const entry = { run: which, before: [] as number[], after: [] as number[], load: [] as number[] };
    local.run(which);
    await base.runModel(which); // warm up both
    for (let r = 0; r < runs; r++) {
      entry.after.push(local.run(which));
      entry.before.push(await base.runModel(which));
      entry.load.push(loadavg()[0]!);
    }
    const before = stats(entry.before), after = stats(entry.after);
    console.log(`${which.padEnd(20)} ${oldName} ${before.text.padStart(18)}   ${newName} ${after.text.padStart(18)}   ` +
      `${(after.median / before.median).toFixed(2)}x   load ${entry.load.at(-1)!.toFixed(1)}`);
    results.push(entry);
  }
  local.dispose();
  return results;
}

async function compareBf16Model(path: string): Promise<void> {
  const { resolveKernelVariant } = await import('../src/kernels/native.ts');
  if (matmulKernel(GgmlType.BF16, resolveKernelVariant(undefined, cpu)) !== 'avx512_bf16') return;
  const results = await compareModel(path, baseline(), 'The BF16 model, avx512_bf16 against f32 FMA (baseline process)',
    'f32 FMA', 'bf16 dot');
  for (const r of results) bf16ModelComparison.push({ run: r.run, f32Fma: r.before, bf16Dot: r.after });
}

async function compareKquantModel(path: string, type: GgmlType): Promise<void> {
  const { resolveKernelVariant } = await import('../src/kernels/native.ts');
  const kernel = matmulKernel(type, resolveKernelVariant(undefined, cpu));
  if (!K_QUANT_INT_KERNELS.includes(kernel)) return;
  const results = await compareModel(path, kquantBaseline(), `The ${ggmlTypeName(type)} model, ${kernel} (8-bit ` +
    'activations) against weights decoded to f32 (baseline process)', 'f32 decode', 'int8 dot');
  for (const r of results) kquantModelComparison.push({ run: r.run, f32Decode: r.before, intDot: r.after, load: r.load });
}

if (args.model) {
  const { ensureSyntheticModel, synthetic110mSpec } = await import('../src/model/synthetic.ts');
  const path = await ensureSyntheticModel(synthetic110mSpec(modelDtype as 'Q8_0' | 'BF16' | 'Q4_K' | 'Q6_K'));
  await benchModel(path);
  if (modelDtype === 'BF16') await compareBf16Model(path);
  if (modelDtype === 'Q4_K') await compareKquantModel(path, GgmlType.Q4_K);
  if (modelDtype === 'Q6_K') await compareKquantModel(path, GgmlType.Q6_K);
}
baselineProcess?.close();
kquantBaselineProcess?.close();

if (args.json) {
  writeFileSync(args.json, JSON.stringify({ cpu, threads, machine, kernels: rows, bf16Comparisons, kquantComparisons, model: modelResults,
    bf16ModelComparison, kquantModelComparison, decodeShare, profiles }, null, 2));
}
