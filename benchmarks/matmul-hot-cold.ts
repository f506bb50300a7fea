// Whether a decode matmul's weight stream overlaps its arithmetic. One kind of projection (default the feed-forward
// gate) at one activation row, from the load-time packed layout, on one thread: "hot" calls the first layer's matrix
// again and again (its weights stay in L2, so the time is the kernel's arithmetic and L2 reads), "cold" calls every
// layer's in turn (each call's weights come from L3 or memory, as in a decode step). Beside them, the addon's read of
// a buffer the size of all those matrices on one thread. If compute and the stream overlapped fully, cold would run
// at min(hot, read); if not at all, at 1 / (1/hot + 1/read).
//
//   node --import tsx benchmarks/matmul-hot-cold.ts [--model FILE.gguf] [--matrix wGate] [--threads 1] [--rounds 3]
//
// --model: a GGUF (default: the synthetic 110M Q8_0 benchmark model). Medians of each round's calls, GB/s of weights.

import { basename } from 'node:path';
import { parseArgs } from 'node:util';

import { loadNativeAddon, supportedVariants } from '../src/kernels/native.ts';
import { ggmlTypeName } from '../src/model/ggml-types.ts';
import { loadModel } from '../src/model/loader.ts';
import { percentileOf } from '../src/util/stats.ts';
import { ensureBenchModel } from './model-files.ts';

const MATRICES = ['wq', 'wk', 'wv', 'wo', 'wGate', 'wUp', 'wDown'] as const;
type Matrix = (typeof MATRICES)[number];
const { values: args } = parseArgs({
  options: {
    model: { type: 'string' }, matrix: { type: 'string', default: 'wGate' }, threads: { type: 'string', default: '1' },
    rounds: { type: 'string', default: '3' },
  },
});
if (!(MATRICES as readonly string[]).includes(args.matrix!)) throw new Error(`--matrix must be one of ${MATRICES.join(', ')}`);
const matrix = args.matrix as Matrix;
const THREADS = Number(args.threads), ROUNDS = Number(args.rounds);
const path = args.model ?? (await ensureBenchModel('Q8_0')).path;
const addon = loadNativeAddon();
const variant = supportedVariants(addon.cpuInfo()).at(-1)!;
const { weights } = await loadModel(path);
const calls = weights.layers.map((layer) => {
  const tensor = layer[matrix];
  const k = tensor.shape[0]!, n = tensor.shape[1]!;
  return {
    type: tensor.type, k, n, packed: addon.ops.pack(variant, tensor.type, tensor.data, k, n),
    x: Float32Array.from({ length: k }, (_, i) => Math.sin(0.1 * i)), y: new Float32Array(n),
  };
});

/** Median µs of `reps` passes over `set`, one call at a time. */
function medianUs(set: typeof calls, reps: number): number {
  const times: number[] = [];
  for (let r = 0; r < reps; r++) {
    for (const c of set) {
      const started = performance.now();
      addon.ops.matmul(variant, c.type, c.packed, c.x, 1, c.k, c.n, c.y, THREADS, true);
      times.push(1000 * (performance.now() - started));
    }
  }
  return percentileOf(times, 0.5);
}

const first = calls[0]!;
const mb = first.packed.length / 1e6;
const totalBytes = calls.reduce((sum, c) => sum + c.packed.length, 0);
const gbs = (us: number) => (mb / us * 1e3).toFixed(1);
medianUs(calls, 20);  // warm-up: pool made, weights paged in
const types = [...new Set(calls.map((c) => ggmlTypeName(c.type)))].join('+');
console.log(`${basename(path)}, ${variant}, ${matrix} (${types}, ${mb.toFixed(2)} MB a layer, ${calls.length} layers), ${THREADS} thread(s)`);
for (let round = 0; round < ROUNDS; round++) {
  const read = addon.bench.memoryBandwidth('read', totalBytes, 5, THREADS);
  const hot = medianUs([first], 600), cold = medianUs(calls, 50);
  const serial = 1 / (1 / (mb / hot * 1e3) + 1 / read);
  console.log(`round ${round + 1}: hot ${hot.toFixed(1)} µs (${gbs(hot)} GB/s), cold ${cold.toFixed(1)} µs (${gbs(cold)} GB/s), `
    + `read ${read.toFixed(1)} GB/s; no overlap would give ${serial.toFixed(1)} GB/s, full overlap ${Math.min(Number(gbs(hot)), read).toFixed(1)}`);
}
