// What a second thread gains on a decode step's matmuls, one call at a time. Each layer's q, k, v, o, gate, up and
// down projections run in the model's order at one activation row (every weight read once per pass, as in a decode
// step, so none is in L2 when its turn comes), from the load-time packed layout, on 1 and then 2 threads, alternated
// over rounds. Per matrix: the median µs per call on each, the rate its weights streamed at, and the second
// thread's fixed cost per call, t2 - t1 / 2 (what a call on two threads takes beyond half of one thread's time:
// handing the job to the worker and back, and the end of the shorter share). Beside them, the addon's read of a
// buffer the size of all the weights on 1 and 2 threads, taken before and after each round.
//
// Every call pays the same JavaScript-to-native entry on both thread counts, which the difference leaves out.
//
//   node --import tsx benchmarks/matmul-calls.ts [--model FILE.gguf] [--rounds 4] [--passes 100]
//
// --model: a GGUF (default: the synthetic 110M Q8_0 benchmark model).

import { basename } from 'node:path';
import { parseArgs } from 'node:util';

import { loadNativeAddon, supportedVariants } from '../src/kernels/native.ts';
import { ggmlTypeName } from '../src/model/ggml-types.ts';
import { loadModel } from '../src/model/loader.ts';
import { percentileOf } from '../src/util/stats.ts';
import { ensureBenchModel } from './model-files.ts';

const { values: args } = parseArgs({
  options: { model: { type: 'string' }, rounds: { type: 'string', default: '4' }, passes: { type: 'string', default: '100' } },
});
const ROUNDS = Number(args.rounds), PASSES = Number(args.passes);
const path = args.model ?? (await ensureBenchModel('Q8_0')).path;
const addon = loadNativeAddon();
const variant = supportedVariants(addon.cpuInfo()).at(-1)!;
const { weights } = await loadModel(path);

const NAMES = ['wq', 'wk', 'wv', 'wo', 'wGate', 'wUp', 'wDown'] as const;
type Name = (typeof NAMES)[number];
const calls = weights.layers.flatMap((layer) => NAMES.map((name) => {
  const tensor = layer[name];
  const k = tensor.shape[0]!, n = tensor.shape[1]!;
  return {
    name, type: tensor.type, k, n, packed: addon.ops.pack(variant, tensor.type, tensor.data, k, n),
    x: Float32Array.from({ length: k }, (_, i) => Math.sin(0.1 * i)), y: new Float32Array(n),
  };
}));
/** Mean bytes per call of a matrix kind (a file may store some layers' matrices of one kind in another type). */
const bytesOf = (name: Name) => {
  const of = calls.filter((c) => c.name === name);
  return of.reduce((sum, c) => sum + c.packed.length, 0) / of.length;
};
const totalBytes = calls.reduce((sum, c) => sum + c.packed.length, 0);

/** One pass of PASSES over every call on `threads` threads: each call's µs, by matrix name. */
function pass(threads: number): Record<Name, number[]> {
  const times = Object.fromEntries(NAMES.map((name) => [name, [] as number[]])) as Record<Name, number[]>;
  for (let p = 0; p < PASSES; p++) {
    for (const c of calls) {
      const started = performance.now();
      addon.ops.matmul(variant, c.type, c.packed, c.x, 1, c.k, c.n, c.y, threads, true);
      times[c.name].push(1000 * (performance.now() - started));
    }
  }
  return times;
}

const median = (values: readonly number[]) => percentileOf(values, 0.5);
const perRound: { t1: Record<Name, number>; t2: Record<Name, number> }[] = [];
const reads: Record<1 | 2, number[]> = { 1: [], 2: [] };
const read = () => {
  for (const threads of [1, 2] as const) reads[threads].push(addon.bench.memoryBandwidth('read', totalBytes, 5, threads));
};
pass(1);
pass(2);  // warm-up: both pools made, weights paged in
for (let round = 0; round < ROUNDS; round++) {
  read();
  const order = round % 2 === 0 ? [1, 2] : [2, 1];
  const got: Record<number, Record<Name, number[]>> = {};
  for (const threads of order) got[threads] = pass(threads);
  const medians = (t: Record<Name, number[]>) => Object.fromEntries(NAMES.map((name) => [name, median(t[name])])) as Record<Name, number>;
  perRound.push({ t1: medians(got[1]!), t2: medians(got[2]!) });
}
read();

const mb = (bytes: number) => (bytes / 1e6).toFixed(2);
const range = (values: number[]) => `${Math.min(...values).toFixed(1)}-${Math.max(...values).toFixed(1)}`;
console.log(`${basename(path)}, ${variant}, ${weights.layers.length} layers, one activation row, ${PASSES} passes per round, ${ROUNDS} rounds`);
console.log(`read of a ${mb(totalBytes)} MB buffer (all these weights): 1 thread ${range(reads[1])} GB/s, 2 threads ${range(reads[2])} GB/s`);
console.log('matrix  types        MB/call   1 thread: µs (GB/s)   2 threads: µs (GB/s)   2 threads / 1   t2 - t1/2 µs   (medians over rounds)');
for (const name of NAMES) {
  const t1 = median(perRound.map((r) => r.t1[name])), t2 = median(perRound.map((r) => r.t2[name]));
  const gbs = (us: number) => (bytesOf(name) / us / 1e3).toFixed(1);
  const types = [...new Set(calls.filter((c) => c.name === name).map((c) => ggmlTypeName(c.type)))].join('+');
  console.log(`${name.padEnd(7)} ${types.padEnd(11)}  ${mb(bytesOf(name)).padStart(7)}   ${t1.toFixed(1).padStart(8)} (${gbs(t1).padStart(5)})   ` +
    `${t2.toFixed(1).padStart(9)} (${gbs(t2).padStart(5)})     ${(t1 / t2).toFixed(2).padStart(6)}x   ${(t2 - t1 / 2).toFixed(2).padStart(12)}`);
}
