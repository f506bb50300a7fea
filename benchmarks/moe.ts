// Mixture-of-experts benchmark: a Qwen3-30B-A3B-shaped model scaled to this machine (24 layers, hidden 1024, GQA 16/2
// with heads of 64, 64 experts of 384, 8 per token, the Qwen2 vocabulary from ../shared/models), random weights, in
// Q8_0 (written by the project's GGUF writer) and Q4_K_M (made from it by llama.cpp's llama-quantize), run by
// Conduit's native backend and by llama.cpp (llama-bench, llama-batched-bench) in the same run, alternating:
//
//   node --import tsx benchmarks/moe.ts [--llama-bin DIR] [--runs N] [--types Q8_0,Q4_K_M] [--threads N] [--keep DIR]
//
// Figures: prefill of 512 tokens (one sequence, one step), decode of one stream and of 16 streams (each after a
// 128-token prompt, tokens/s over 32 steps), per round (Conduit then llama.cpp, with the load average after each) and
// the best of --runs rounds; the ratios are given per round too, since on a shared machine two runs far apart in
// time meet different loads. For Conduit the decode profile splits a step into the experts' work (one parallel job
// per layer: gate+up, SwiGLU, down) and the rest, and sets the experts' time against their roofline: the bytes of
// the experts the step streamed (counted by the native profile) over this machine's read bandwidth (measured by the
// addon in the same run). Last, a CPU-time profile of single-stream decode on one thread (each section's CPU time,
// which time slices taken by other processes do not inflate, unlike wall time), the experts' CPU time against the
// one-thread read bandwidth.
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';

import { kvPoolBytes, type ForwardBatch, type KvPoolLayout } from '../src/kernels/types.ts';
import { loadNativeAddon, nativeModelSpec, resolveKernelVariant, type NativeModel } from '../src/kernels/native.ts';
import { GgmlType, ggmlTypeName } from '../src/model/ggml-types.ts';
import { GgufValueType, readGguf } from '../src/model/gguf.ts';
import type { GgufValue } from '../src/model/gguf.ts';
import { writeGguf } from '../src/model/gguf-writer.ts';
import type { GgufTensorToWrite, GgufValueTypeSpec } from '../src/model/gguf-writer.ts';
import { loadModel, type LoadedModel } from '../src/model/loader.ts';
import { quantize } from '../src/model/quant.ts';
import { SeededRandom } from '../src/model/synthetic.ts';
import { hashString } from '../src/util/random.ts';

const { values: args } = parseArgs({
  options: {
    'llama-bin': { type: 'string', default: '/work/main/benchmarks/peer/llama.cpp/build/bin' },
    runs: { type: 'string', default: '2' },
    types: { type: 'string', default: 'Q8_0,Q4_K_M' },
    threads: { type: 'string', default: '2' },
    keep: { type: 'string' },
    vocab: { type: 'string', default: new URL('../../shared/models/ggml-vocab-qwen2.gguf', import.meta.url).pathname },
  },
});
const RUNS = Number(args.runs);
const THREADS = Number(args.threads);
const BIN = args['llama-bin']!;

const SHAPE = {
  layers: 24, dim: 1024, heads: 16, kvHeads: 2, headDim: 64, experts: 64, used: 8, expertFfn: 384, context: 1024,
};
const PREFILL = 512;
const PROMPT = 128;
const DECODE_STEPS = 32;
const STREAMS = 16;

const load = (): string => loadavg()[0]!.toFixed(1);

// ---------------------------------------------------------------------------------------------------------------
// The model

function writeModel(path: string): void {
  const vocab = readGguf(args.vocab!);
  const vocabSize = (vocab.metadata.get('tokenizer.ggml.tokens') as string[]).length;
  const a = 'qwen3moe';
  const s = SHAPE;
  const metadata: [string, GgufValue][] = [
    ['general.architecture', a], ['general.name', 'qwen3moe-bench'], ['general.file_type', 7],
    [`${a}.context_length`, s.context], [`${a}.embedding_length`, s.dim], [`${a}.block_count`, s.layers],
    [`${a}.feed_forward_length`, s.expertFfn * s.used], [`${a}.expert_feed_forward_length`, s.expertFfn],
    [`${a}.expert_count`, s.experts], [`${a}.expert_used_count`, s.used],
    [`${a}.attention.head_count`, s.heads], [`${a}.attention.head_count_kv`, s.kvHeads],
    [`${a}.attention.key_length`, s.headDim], [`${a}.attention.value_length`, s.headDim],
    [`${a}.rope.dimension_count`, s.headDim], [`${a}.rope.freq_base`, 1000000],
    [`${a}.attention.layer_norm_rms_epsilon`, 1e-6],
  ];
  const types = new Map<string, GgufValueTypeSpec>([
    [`${a}.rope.freq_base`, { type: GgufValueType.FLOAT32 }],
    [`${a}.attention.layer_norm_rms_epsilon`, { type: GgufValueType.FLOAT32 }],
  ]);
  for (const [key, value] of vocab.metadata) {
    if (!key.startsWith('tokenizer.')) continue;
    metadata.push([key, value]);
    types.set(key, vocab.metadataTypes.get(key)!);
  }
  const tensor = (name: string, shape: number[], std: number, type: GgmlType, mean = 0): GgufTensorToWrite => ({
    name, type, shape,
    data: () => {
      const values = new SeededRandom(hashString(name)).fillNormal(new Float32Array(shape.reduce((x, y) => x * y, 1)), std);
      if (mean !== 0) for (let i = 0; i < values.length; i++) values[i] = values[i]! + mean;
      return type === GgmlType.F32 ? new Uint8Array(values.buffer) : quantize(type, values);
    },
  });
  const q = GgmlType.Q8_0;
  const F32 = GgmlType.F32;
  const qDim = s.heads * s.headDim;
  const kvDim = s.kvHeads * s.headDim;
  const tensors: GgufTensorToWrite[] = [
    tensor('token_embd.weight', [s.dim, vocabSize], 0.5, q), tensor('output_norm.weight', [s.dim], 0.1, F32, 1),
    tensor('output.weight', [s.dim, vocabSize], 0.5, q),
  ];
  for (let l = 0; l < s.layers; l++) {
    const p = `blk.${l}.`;
    tensors.push(
      tensor(`${p}attn_norm.weight`, [s.dim], 0.1, F32, 1),
      tensor(`${p}attn_q.weight`, [s.dim, qDim], 1 / Math.sqrt(s.dim), q),
      tensor(`${p}attn_k.weight`, [s.dim, kvDim], 1 / Math.sqrt(s.dim), q),
      tensor(`${p}attn_v.weight`, [s.dim, kvDim], 1 / Math.sqrt(s.dim), q),
      tensor(`${p}attn_q_norm.weight`, [s.headDim], 0.1, F32, 1),
      tensor(`${p}attn_k_norm.weight`, [s.headDim], 0.1, F32, 1),
      tensor(`${p}attn_output.weight`, [qDim, s.dim], 0.5 / Math.sqrt(qDim), q),
      tensor(`${p}ffn_norm.weight`, [s.dim], 0.1, F32, 1),
      tensor(`${p}ffn_gate_inp.weight`, [s.dim, s.experts], 2 / Math.sqrt(s.dim), F32),
      tensor(`${p}ffn_gate_exps.weight`, [s.dim, s.expertFfn, s.experts], 1 / Math.sqrt(s.dim), q),
      tensor(`${p}ffn_up_exps.weight`, [s.dim, s.expertFfn, s.experts], 1 / Math.sqrt(s.dim), q),
      tensor(`${p}ffn_down_exps.weight`, [s.expertFfn, s.dim, s.experts], 4 / Math.sqrt(s.expertFfn), q),
    );
  }
  writeGguf(path, { metadata, types, tensors });
}

// ---------------------------------------------------------------------------------------------------------------
// Conduit

function batchOf(seqs: { tokens: number[]; cached: number; block: number }[], blocksPerSeq: number, blockSize: number,
  logitsAll = false): ForwardBatch {
  const rows: { s: number; position: number; token: number }[] = [];
  const queryStartLoc = new Int32Array(seqs.length + 1);
  seqs.forEach((seq, s) => {
    for (let p = seq.cached; p < seq.tokens.length; p++) rows.push({ s, position: p, token: seq.tokens[p]! });
    queryStartLoc[s + 1] = rows.length;
  });
  const blockTables = new Int32Array(seqs.length * blocksPerSeq);
  seqs.forEach((seq, s) => { for (let b = 0; b < blocksPerSeq; b++) blockTables[s * blocksPerSeq + b] = seq.block + b; });
  return {
    numTokens: rows.length,
    tokenIds: Int32Array.from(rows, (r) => r.token),
    positions: Int32Array.from(rows, (r) => r.position),
    slotMapping: Int32Array.from(rows, (r) => (seqs[r.s]!.block + Math.floor(r.position / blockSize)) * blockSize + (r.position % blockSize)),
    numSeqs: seqs.length,
    queryStartLoc,
    seqLens: Int32Array.from(seqs, (q) => q.tokens.length),
    blockTables,
    maxBlocksPerSeq: blocksPerSeq,
    logitsIndices: logitsAll ? Int32Array.from(rows, (_, i) => i) : Int32Array.from(seqs, (_, s) => queryStartLoc[s + 1]! - 1),
  };
}

interface ConduitRun {
  prefillTps: number;
  decode1Tps: number;
  decode16Tps: number;
  /** Per single-stream decode step: ms in the experts' matmuls, ms in total, experts streamed. */
  expertMs: number;
  stepMs: number;
  expertsPerStep: number;
}

function runConduit(model: LoadedModel, native: NativeModel, blockSize: number): ConduitRun {
  const blocksPerSeq = Math.ceil((PREFILL + 8) / blockSize);
  const vocab = model.config.vocabSize;
  const token = (i: number): number => (i * 7919 + 13) % 150000;
  // Prefill 512 tokens in one step.
  const prompt = Array.from({ length: PREFILL }, (_, i) => token(i));
  let t = performance.now();
  native.forward(batchOf([{ tokens: prompt, cached: 0, block: 0 }], blocksPerSeq, blockSize));
  const prefillTps = PREFILL / ((performance.now() - t) / 1000);

  const decode = (streams: number, profile: boolean): { tps: number; expertMs: number; stepMs: number; experts: number } => {
    const seqs = Array.from({ length: streams }, (_, s) => ({
      tokens: Array.from({ length: PROMPT }, (_, i) => token(i + 1000 * s)), cached: 0, block: s * blocksPerSeq,
    }));
    const logits = native.forward(batchOf(seqs, blocksPerSeq, blockSize));
    seqs.forEach((seq, s) => { seq.cached = seq.tokens.length; seq.tokens.push(argmax(logits, s * vocab, vocab)); });
    native.setProfiling(profile);
    native.takeProfile();
    t = performance.now();
    for (let step = 0; step < DECODE_STEPS; step++) {
      const out = native.forward(batchOf(seqs, blocksPerSeq, blockSize));
      seqs.forEach((seq, s) => { seq.cached = seq.tokens.length; seq.tokens.push(argmax(out, s * vocab, vocab)); });
    }
    const elapsed = performance.now() - t;
    const sections = native.takeProfile();
    native.setProfiling(false);
    const expert = sections['moe experts']?.seconds ?? 0;
    return {
      tps: (streams * DECODE_STEPS) / (elapsed / 1000), expertMs: (expert * 1000) / DECODE_STEPS,
      stepMs: elapsed / DECODE_STEPS, experts: (sections['moe experts streamed']?.calls ?? 0) / DECODE_STEPS,
    };
  };
  const one = decode(1, false);
  const profiled = decode(1, true);
  const sixteen = decode(STREAMS, false);
  return {
    prefillTps, decode1Tps: one.tps, decode16Tps: sixteen.tps,
    expertMs: profiled.expertMs, stepMs: profiled.stepMs, expertsPerStep: profiled.experts,
  };
}

// ---------------------------------------------------------------------------------------------------------------
// CPU-time profile: single-stream decode on one thread. The model is loaded again (the timed instance gave the ggml
// bytes of its packed matrices back to the system).

async function cpuProfile(path: string, expertBytes: number): Promise<void> {
  const model = await loadModel(path);
  const blockSize = 16;
  const blocksPerSeq = Math.ceil((PREFILL + 8) / blockSize);
  const layout: KvPoolLayout = {
    numLayers: model.config.numLayers, numBlocks: blocksPerSeq + 1, blockSize,
    numKvHeads: model.config.numKvHeads, headDim: model.config.headDim, dtype: 'f16',
  };
  const pool = new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout)));
  const native = new addon.NativeModel({
    ...nativeModelSpec(model.config, model.weights, { layout, bytes: pool }, resolveKernelVariant(), 1),
    releaseUnpackedWeights: true,
  });
  const oneThread = addon.bench.memoryBandwidth('read', 256 << 20, 3, 1) * 1e9;
  const vocab = model.config.vocabSize;
  const seq = { tokens: Array.from({ length: PROMPT }, (_, i) => (i * 7919 + 13) % 150000), cached: 0, block: 0 };
  const next = (logits: Float32Array): void => { seq.cached = seq.tokens.length; seq.tokens.push(argmax(logits, 0, vocab)); };
  next(native.forward(batchOf([seq], blocksPerSeq, blockSize)));
  for (let i = 0; i < 4; i++) next(native.forward(batchOf([seq], blocksPerSeq, blockSize)));  // warm-up
  native.setProfiling(true);
  native.takeProfile();
  const cpu0 = process.cpuUsage();
  const t0 = performance.now();
  for (let step = 0; step < DECODE_STEPS; step++) next(native.forward(batchOf([seq], blocksPerSeq, blockSize)));
  const wallMs = (performance.now() - t0) / DECODE_STEPS;
  const cpu = process.cpuUsage(cpu0);
  const processCpuMs = (cpu.user + cpu.system) / 1000 / DECODE_STEPS;
  const sections = native.takeProfile();
  native.dispose();
  const perStep = (x: number): number => (x * 1000) / DECODE_STEPS;
  const rows = Object.entries(sections).filter(([, v]) => v.seconds > 0).sort((a, b) => b[1].cpuSeconds - a[1].cpuSeconds);
  console.log(`single-stream decode, 1 thread, CPU time per step (process: ${processCpuMs.toFixed(2)} ms CPU, ` +
    `${wallMs.toFixed(2)} ms wall; load ${load()}); nested sections are also inside their parents:`);
  for (const [name, v] of rows.slice(0, 14)) {
    console.log(`  ${name.padEnd(40)} ${perStep(v.cpuSeconds).toFixed(2).padStart(7)} ms CPU ` +
      `${perStep(v.seconds).toFixed(2).padStart(7)} ms wall  ${(v.calls / DECODE_STEPS).toFixed(0).padStart(4)} calls`);
  }
  const experts = (sections['moe experts streamed']?.calls ?? 0) / DECODE_STEPS;
  const expertCpuMs = perStep(sections['moe experts']?.cpuSeconds ?? 0);
  const rooflineMs = ((experts * expertBytes) / oneThread) * 1000;
  console.log(`  experts: ${expertCpuMs.toFixed(2)} ms CPU per step for ${(experts * expertBytes / 1e6).toFixed(1)} MB ` +
    `(${experts.toFixed(0)} experts): ${((experts * expertBytes) / (expertCpuMs / 1000) / 1e9).toFixed(1)} GB/s, ` +
    `${((100 * rooflineMs) / expertCpuMs).toFixed(0)}% of the one-thread read bandwidth (${(oneThread / 1e9).toFixed(1)} GB/s)`);
}

function argmax(x: Float32Array, offset: number, n: number): number {
  let best = 0;
  for (let i = 1; i < n; i++) if (x[offset + i]! > x[offset + best]!) best = i;
  return best;
}

// ---------------------------------------------------------------------------------------------------------------
// llama.cpp

interface LlamaRun { prefillTps: number; decode1Tps: number; decode16Tps: number }

function runLlama(path: string): LlamaRun {
  const bench = spawnSync(join(BIN, 'llama-bench'), ['-m', path, '-t', String(THREADS), '-p', String(PREFILL), '-n',
    String(DECODE_STEPS), '-d', '0', '-r', '1', '-o', 'json'], { encoding: 'utf8', maxBuffer: 1 << 26 });
  if (bench.status !== 0) throw new Error(`llama-bench failed: ${bench.stderr.slice(-2000)}`);
  const rows = JSON.parse(bench.stdout) as { n_prompt: number; n_gen: number; avg_ts: number }[];
  const prefillTps = rows.find((r) => r.n_prompt === PREFILL && r.n_gen === 0)!.avg_ts;
  // Decode after a 128-token prompt, one and 16 streams: llama-batched-bench's S_TG.
  const batched = spawnSync(join(BIN, 'llama-batched-bench'), ['-m', path, '-t', String(THREADS), '-c',
    String(STREAMS * (PROMPT + DECODE_STEPS) + 64), '-b', '2048', '-ub', '512', '-npp', String(PROMPT), '-ntg',
    String(DECODE_STEPS), '-npl', `1,${STREAMS}`, '--output-format', 'jsonl'], { encoding: 'utf8', maxBuffer: 1 << 26 });
  if (batched.status !== 0) throw new Error(`llama-batched-bench failed: ${batched.stderr.slice(-2000)}`);
  const lines = batched.stdout.split('\n').filter((l) => l.startsWith('{')).map((l) => JSON.parse(l) as { pl: number; speed_tg: number });
  return {
    prefillTps,
    decode1Tps: lines.find((l) => l.pl === 1)!.speed_tg,
    decode16Tps: lines.find((l) => l.pl === STREAMS)!.speed_tg,
  };
}

// ---------------------------------------------------------------------------------------------------------------

const dir = args.keep ?? mkdtempSync(join(tmpdir(), 'conduit-moe-bench-'));
mkdirSync(dir, { recursive: true });
const q8 = join(dir, 'qwen3moe-bench-Q8_0.gguf');
const q4km = join(dir, 'qwen3moe-bench-Q4_K_M.gguf');
if (!existsSync(q8)) {
  console.log(`writing ${q8} ...`);
  writeModel(q8);
}
const types = args.types!.split(',');
if (types.includes('Q4_K_M') && !existsSync(q4km)) {
  // The expert FFN (384) is not a multiple of 256, so llama-quantize falls back for ffn_down_exps (to Q5_0, which
  // Conduit does not run): those take Q8_0, as Q4_K_M's larger types would.
  const r = spawnSync(join(BIN, 'llama-quantize'), ['--allow-requantize', '--tensor-type', 'ffn_down_exps=q8_0', q8,
    q4km, 'Q4_K_M', String(THREADS)], { encoding: 'utf8', maxBuffer: 1 << 26 });
  if (r.status !== 0) throw new Error(`llama-quantize failed: ${r.stderr.slice(-2000)}`);
}

const addon = loadNativeAddon();
const bandwidth = addon.bench.memoryBandwidth('read', 256 << 20, 3, THREADS) * 1e9;
console.log(`read bandwidth ${(bandwidth / 1e9).toFixed(1)} GB/s, ${THREADS} threads, load ${load()}`);

for (const type of types) {
  const path = type === 'Q8_0' ? q8 : q4km;
  const model = await loadModel(path);
  const byType: Record<string, number> = {};
  for (const t of model.metadata ? Object.entries(model.metadata.parametersByType) : []) byType[t[0]] = t[1];
  const layout: KvPoolLayout = {
    numLayers: model.config.numLayers, numBlocks: STREAMS * Math.ceil((PREFILL + 8) / 16) + 1, blockSize: 16,
    numKvHeads: model.config.numKvHeads, headDim: model.config.headDim, dtype: 'f16',
  };
  const pool = new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout)));
  // The packed copy replaces the matrices' file bytes (as in an engine worker), so Conduit holds the weights once
  // while llama.cpp runs beside it.
  const native = new addon.NativeModel({
    ...nativeModelSpec(model.config, model.weights, { layout, bytes: pool }, resolveKernelVariant(), THREADS),
    releaseUnpackedWeights: true,
  });
  const e = model.weights.layers[0]!;
  // Byte lengths only (the bytes themselves may have been given back).
  const expertBytes = (e.wGate.data.byteLength + e.wUp.data.byteLength + e.wDown.data.byteLength) / SHAPE.experts;
  console.log(`\n${type}: ${(model.metadata.weightBytes / 1e9).toFixed(2)} GB of weights (${Object.entries(byType)
    .map(([k, v]) => `${k} ${(v / 1e6).toFixed(0)}M`).join(', ')}); experts: gate ${ggmlTypeName(e.wGate.type)}, ` +
    `up ${ggmlTypeName(e.wUp.type)}, down ${ggmlTypeName(e.wDown.type)}, ${(expertBytes / 1e6).toFixed(2)} MB each`);
  const best = { conduit: undefined as ConduitRun | undefined, llama: undefined as LlamaRun | undefined };
  const loads: string[] = [];
  for (let run = 0; run < RUNS; run++) {
    const c = runConduit(model, native, 16);
    loads.push(load());
    const l = runLlama(path);
    loads.push(load());
    const keep = <T extends Record<string, number>>(a: T | undefined, b: T): T =>
      (a ? Object.fromEntries(Object.entries(b).map(([k, v]) => [k, k.endsWith('Ms') ? Math.min(v, a[k]!) : Math.max(v, a[k]!)])) as T : b);
    best.conduit = keep(best.conduit as unknown as Record<string, number> | undefined, c as unknown as Record<string, number>) as unknown as ConduitRun;
    best.llama = keep(best.llama as unknown as Record<string, number> | undefined, l as unknown as Record<string, number>) as unknown as LlamaRun;
    console.log(`run ${run + 1}: conduit prefill ${c.prefillTps.toFixed(1)} t/s, decode ${c.decode1Tps.toFixed(2)} / ` +
      `${c.decode16Tps.toFixed(2)} t/s; llama.cpp prefill ${l.prefillTps.toFixed(1)}, decode ${l.decode1Tps.toFixed(2)} / ` +
      `${l.decode16Tps.toFixed(2)} t/s (load ${loads.slice(-2).join(', ')}); ratios prefill ` +
      `${(c.prefillTps / l.prefillTps).toFixed(2)}x, decode ${(c.decode1Tps / l.decode1Tps).toFixed(2)}x / ` +
      `${(c.decode16Tps / l.decode16Tps).toFixed(2)}x`);
  }
  const c = best.conduit!;
  const l = best.llama!;
  const ratio = (a: number, b: number): string => `${(a / b).toFixed(2)}x`;
  console.log(`best of ${RUNS}      conduit     llama.cpp   ratio`);
  console.log(`prefill ${PREFILL}     ${c.prefillTps.toFixed(1).padStart(8)}  ${l.prefillTps.toFixed(1).padStart(10)}   ${ratio(c.prefillTps, l.prefillTps)}`);
  console.log(`decode 1 stream  ${c.decode1Tps.toFixed(2).padStart(8)}  ${l.decode1Tps.toFixed(2).padStart(10)}   ${ratio(c.decode1Tps, l.decode1Tps)}`);
  console.log(`decode ${STREAMS} streams ${c.decode16Tps.toFixed(2).padStart(8)}  ${l.decode16Tps.toFixed(2).padStart(10)}   ${ratio(c.decode16Tps, l.decode16Tps)}`);
  const rooflineMs = (c.expertsPerStep * expertBytes / bandwidth) * 1000;
  console.log(`single-stream decode step (profiled): ${c.stepMs.toFixed(2)} ms, of which expert matmuls ${c.expertMs.toFixed(2)} ms ` +
    `(${((100 * c.expertMs) / c.stepMs).toFixed(0)}%), ${c.expertsPerStep.toFixed(0)} experts streamed ` +
    `(${(c.expertsPerStep * expertBytes / 1e6).toFixed(1)} MB): roofline ${rooflineMs.toFixed(2)} ms at ` +
    `${(bandwidth / 1e9).toFixed(1)} GB/s, expert matmuls at ${((100 * rooflineMs) / c.expertMs).toFixed(0)}% of it`);
  native.dispose();
  await cpuProfile(path, expertBytes);
}
if (!args.keep) rmSync(dir, { recursive: true, force: true });
