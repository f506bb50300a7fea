// Where single-stream decode time goes: a model file, prefilled to CONTEXT tokens in steps of 512, then ROUNDS
// rounds of STEPS decode steps with the native model's section profile on (wall time per section, and the step's
// CPU time over all threads, which a busy machine leaves meaningful when wall times are not). Each matmul section
// is also given as the rate its weights streamed at, next to the addon's STREAM-like read of a buffer the size of
// all the weights with THREADS threads, taken before and after each round (this VM's read rate moves by 2x within
// minutes, so only a reading beside the figures says anything about them). Figures are medians over rounds.
// CONDUIT_PACK_WEIGHTS=0 reads the ggml rows instead of the load-time packed copy.
//
//   node --import tsx benchmarks/decode-context-profile.ts <model.gguf> [CONTEXT=8192] [THREADS=1] [STEPS=16] [ROUNDS=1]
import { loadNativeAddon, nativeModelSpec, supportedVariants } from '../src/kernels/native.ts';
import { loadModel } from '../src/model/loader.ts';
import { kvPoolBytes, type ForwardBatch, type KvPoolLayout } from '../src/kernels/types.ts';
import { ggmlTypeName } from '../src/model/ggml-types.ts';
import type { Tensor } from '../src/model/weights.ts';
import { percentileOf } from '../src/util/stats.ts';
const [path, ctxArg, threadsArg, stepsArg, roundsArg] = process.argv.slice(2);
if (!path) {
  console.error("usage: node --import tsx benchmarks/decode-context-profile.ts <model.gguf> [context] [threads] [steps] [rounds]");
  process.exit(2);
}
const ctx = Number(ctxArg ?? 8192), threads = Number(threadsArg ?? 1), BS = 16;
const steps = Number(stepsArg ?? 16), rounds = Number(roundsArg ?? 1);
const addon = loadNativeAddon();
const { config, weights } = await loadModel(path!);
const maxBlocks = Math.ceil((ctx + steps * rounds + 64) / BS);
const layout: KvPoolLayout = { numLayers: config.numLayers, numBlocks: maxBlocks, blockSize: BS, numKvHeads: config.numKvHeads, headDim: config.headDim, dtype: 'f16' };
const model = new addon.NativeModel({ ...nativeModelSpec(config, weights, { layout, bytes: new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout))) }, supportedVariants(addon.cpuInfo()).at(-1)!, threads),
  packWeights: process.env.CONDUIT_PACK_WEIGHTS !== "0" });
const table = Int32Array.from({ length: maxBlocks }, (_, i) => i);
const batch = (start: number, count: number): ForwardBatch => ({
  numTokens: count, tokenIds: Int32Array.from({ length: count }, (_, i) => (start + i) * 7919 % config.vocabSize),
  positions: Int32Array.from({ length: count }, (_, i) => start + i), slotMapping: Int32Array.from({ length: count }, (_, i) => start + i),
  numSeqs: 1, queryStartLoc: Int32Array.from([0, count]), seqLens: Int32Array.from([start + count]), blockTables: table,
  maxBlocksPerSeq: maxBlocks, logitsIndices: Int32Array.from([count - 1]),
});
let pos = 0;
const t0 = performance.now(), c0 = process.cpuUsage();
while (pos < ctx) { const n = Math.min(512, ctx - pos); model.forward(batch(pos, n)); pos += n; }
const pc = process.cpuUsage(c0);
console.log(`${path} ctx ${ctx} threads ${threads}: prefill ${ctx} tokens ${((performance.now() - t0) / 1000).toFixed(1)} s wall, ${((pc.user + pc.system) / 1e6).toFixed(1)} s CPU`);
const median = (xs: readonly number[]): number => percentileOf(xs, 0.5);
const layers = weights.layers;
/** The weights each matmul section of a decode step reads (the profile's section names, native/model.cc). */
const sectionWeights: Record<string, Tensor[]> = {
  'matmul attn_qkv': layers.flatMap((l) => [l.wq, l.wk, l.wv]),
  'matmul attn_output': layers.map((l) => l.wo),
  'matmul ffn_gate+up': layers.flatMap((l) => [l.wGate, l.wUp]),
  'matmul ffn_down': layers.map((l) => l.wDown),
  'matmul output': [weights.output],
};
const bytesOf = (ts: readonly Tensor[]) => ts.reduce((n, t) => n + t.data.byteLength, 0);
const typesOf = (ts: readonly Tensor[]) => [...new Set(ts.map((t) => ggmlTypeName(t.type)))].join('+');
const weightBytes = bytesOf(Object.values(sectionWeights).flat());
const readGBs = () => addon.bench.memoryBandwidth('read', weightBytes, 5, threads);

const wallMs: number[] = [], cpuMs: number[] = [], readings: number[] = [];
const sectionMs = new Map<string, number[]>();
const sectionShare = new Map<string, number[]>();
const stepShare: number[] = [];
model.setProfiling(true); model.takeProfile();
for (let round = 0; round < rounds; round++) {
  const before = readGBs();
  model.takeProfile();
  const c1 = process.cpuUsage(); const t1 = performance.now();
  for (let i = 0; i < steps; i++) model.forward(batch(pos++, 1));
  const wall = (performance.now() - t1) / steps, cu = process.cpuUsage(c1);
  const prof = model.takeProfile();
  const after = readGBs();
  const probe = (before + after) / 2;
  readings.push(before, after);
  wallMs.push(wall); cpuMs.push((cu.user + cu.system) / 1000 / steps);
  stepShare.push(weightBytes / (wall / 1e3) / 1e9 / probe);
  for (const [k, v] of Object.entries(prof)) {
    const ms = v.seconds * 1e3 / steps;
    sectionMs.set(k, [...(sectionMs.get(k) ?? []), ms]);
    const w = sectionWeights[k];
    if (w) sectionShare.set(k, [...(sectionShare.get(k) ?? []), bytesOf(w) / (ms / 1e3) / 1e9 / probe]);
  }
}
const wall = median(wallMs);
const kvBytes = pos * config.numLayers * config.numKvHeads * config.headDim * 2 * 2;
console.log(`decode step at ${pos - steps * rounds}-${pos} tokens of context, median of ${rounds} rounds of ${steps}: ${wall.toFixed(2)} ms wall, ${median(cpuMs).toFixed(2)} ms CPU (all threads)`);
console.log(`bytes read per step: ${(kvBytes / 1e6).toFixed(1)} MB of f16 K/V (at the end), ${(weightBytes / 1e6).toFixed(1)} MB of weights`);
console.log(`read of a ${(weightBytes / 1e6).toFixed(0)} MB buffer, ${threads} threads: ${Math.min(...readings).toFixed(1)}-${Math.max(...readings).toFixed(1)} GB/s; `
  + `weights over the step's wall time: ${(weightBytes / wall / 1e6).toFixed(1)} GB/s, ${(100 * median(stepShare)).toFixed(0)}% of the reading beside it`);
const rows = [...sectionMs].map(([k, ms]) => [k, median(ms)] as const).sort((a, b) => b[1] - a[1]);
for (const [k, ms] of rows) {
  const w = sectionWeights[k];
  const stream = w ? `  ${typesOf(w).padEnd(10)} ${(bytesOf(w) / 1e6).toFixed(1).padStart(5)} MB at ${(bytesOf(w) / ms / 1e6).toFixed(1).padStart(5)} GB/s = ${(100 * median(sectionShare.get(k)!)).toFixed(0).padStart(3)}% of the read` : '';
  console.log(`  ${k.padEnd(40)} ${ms.toFixed(3)} ms/step ${(ms / wall * 100).toFixed(1).padStart(5)}%${stream}`);
}
// The hand-over waits are timed inside the matmul and attention sections, so they are not added again.
const inSections = rows.reduce((n, [k, ms]) => (k === 'pool hand-over wait' ? n : n + ms), 0);
console.log(`  ${'outside any section'.padEnd(40)} ${(wall - inSections).toFixed(3)} ms/step ${((wall - inSections) / wall * 100).toFixed(1).padStart(5)}%`);
model.dispose();
