// Where single-stream decode time goes at a long context: a model file, prefilled to CONTEXT tokens in steps of 512,
// then 16 decode steps with the native model's section profile on (wall time per section, and the step's CPU time
// over all threads, which a busy machine leaves meaningful when wall times are not). CONDUIT_PACK_WEIGHTS=0 reads
// the ggml rows instead of the load-time packed copy.
//
//   node --import tsx benchmarks/decode-context-profile.ts <model.gguf> [CONTEXT=8192] [THREADS=1]
import { loadNativeAddon, nativeModelSpec, supportedVariants } from '../src/kernels/native.ts';
import { loadModel } from '../src/model/loader.ts';
import { kvPoolBytes, type ForwardBatch, type KvPoolLayout } from '../src/kernels/types.ts';
const [path, ctxArg, threadsArg] = process.argv.slice(2);
if (!path) {
  console.error("usage: node --import tsx benchmarks/decode-context-profile.ts <model.gguf> [context] [threads]");
  process.exit(2);
}
const ctx = Number(ctxArg ?? 8192), threads = Number(threadsArg ?? 1), BS = 16;
const addon = loadNativeAddon();
const { config, weights } = await loadModel(path!);
const maxBlocks = Math.ceil((ctx + 64) / BS);
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
model.setProfiling(true); model.takeProfile();
const steps = 16; const c1 = process.cpuUsage(); const t1 = performance.now();
for (let i = 0; i < steps; i++) model.forward(batch(pos++, 1));
const wall = (performance.now() - t1) / steps, cu = process.cpuUsage(c1), cpu = (cu.user + cu.system) / 1000 / steps;
const prof = model.takeProfile();
console.log(`decode step: ${wall.toFixed(2)} ms wall, ${cpu.toFixed(2)} ms CPU (all threads)`);
const kvBytes = pos * config.numLayers * config.numKvHeads * config.headDim * 2 * 2;
const weightBytes = [weights.output, ...weights.layers.flatMap((l) => [l.wq, l.wk, l.wv, l.wo, l.wGate, l.wUp, l.wDown])]
  .reduce((n, t) => n + t.data.byteLength, 0);
console.log(`bytes read per step: ${(kvBytes / 1e6).toFixed(1)} MB of f16 K/V, ${(weightBytes / 1e6).toFixed(1)} MB of weights`);
for (const [k, v] of Object.entries(prof).sort((a, b) => b[1].seconds - a[1].seconds)) {
  console.log(`  ${k.padEnd(28)} ${(v.seconds * 1e3 / steps).toFixed(3)} ms/step  ${((v.seconds * 1e3 / steps) / wall * 100).toFixed(1)}%`);
}
model.dispose();
