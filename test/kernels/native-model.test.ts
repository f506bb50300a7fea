// Whole-model checks of the native forward pass: the same engine steps (chunked prefill, decode, several
// sequences in shuffled pool blocks) through the native backend and the TypeScript reference backend give the same
// logits, for every weight type, KV dtype and kernel variant; logits do not depend on the thread count; and on the
// real stories260K model greedy decoding reproduces llama.cpp's tokens.
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';

import type { ModelConfig } from '../../src/model/config.ts';
import { GgmlType, ggmlTypeName } from '../../src/model/ggml-types.ts';
import { loadModel } from '../../src/model/loader.ts';
import { quantize } from '../../src/model/quant.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import type { LayerWeights, ModelWeights, Tensor } from '../../src/model/weights.ts';
import { nativeBackend, nativeModelSpec, type KernelVariant, type NativeModel } from '../../src/kernels/native.ts';
import { referenceBackend } from '../../src/kernels/reference-backend.ts';
import { kvPoolBytes, type ForwardBatch, type KvDtype, type KvPoolLayout } from '../../src/kernels/types.ts';
import { sharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { ensureLlamaQuantized, llamaQuantizeMissing } from '../../benchmarks/model-files.ts';
import {
  assertClose, native, randomArray, roundsBf16Activations, seeded, skipNative, variants,
} from './native-harness.ts';

// ---------------------------------------------------------------------------------------------------------------
// A small random model built in memory

interface ModelOptions {
  type: GgmlType;
  /** Type of the embedding and output matrices (default: type). */
  edgeType?: GgmlType;
  dim?: number;
  ffnDim?: number;
  qkvBias?: boolean;
  ropeStyle?: ModelConfig['ropeStyle'];
  ropeDim?: number;
  ropeScaling?: ModelConfig['ropeScaling'];
  tiedEmbeddings?: boolean;
}

function makeModel(seed: number, o: ModelOptions): { config: ModelConfig; weights: ModelWeights } {
  const rand = seeded(seed);
  const dim = o.dim ?? 256, ffnDim = o.ffnDim ?? 512, numHeads = 4, numKvHeads = 2, headDim = dim / numHeads;
  const config: ModelConfig = {
    architecture: o.qkvBias ? 'qwen2' : 'llama', name: 'test', vocabSize: 300, dim, numLayers: 2, numHeads,
    numKvHeads, headDim, ffnDim, contextLength: 256, rmsNormEps: 1e-5, ropeTheta: 10000,
    ropeDim: o.ropeDim ?? headDim, ropeStyle: o.ropeStyle ?? 'interleaved', ropeScaling: o.ropeScaling,
    qkvBias: o.qkvBias ?? false, tiedEmbeddings: o.tiedEmbeddings ?? false,
  };
  const tensor = (name: string, type: GgmlType, cols: number, rows: number, scale: number): Tensor => ({
    name, type, shape: rows === 1 ? [cols] : [cols, rows], data: quantize(type, randomArray(cols * rows, rand, scale)),
  });
  const norm = (name: string): Tensor => {
    const values = Float32Array.from({ length: dim }, () => 1 + (rand() - 0.5) * 0.2);
    return { name, type: GgmlType.F32, shape: [dim], data: new Uint8Array(values.buffer) };
  };
  const edge = o.edgeType ?? o.type;
  const qDim = numHeads * headDim, kvDim = numKvHeads * headDim;
  const layers: LayerWeights[] = Array.from({ length: config.numLayers }, (_, l) => ({
    attnNorm: norm(`blk.${l}.attn_norm`),
    wq: tensor(`blk.${l}.attn_q`, o.type, dim, qDim, Math.sqrt(3 / dim)),
    wk: tensor(`blk.${l}.attn_k`, o.type, dim, kvDim, Math.sqrt(3 / dim)),
    wv: tensor(`blk.${l}.attn_v`, o.type, dim, kvDim, Math.sqrt(3 / dim)),
    wo: tensor(`blk.${l}.attn_output`, o.type, qDim, dim, Math.sqrt(3 / qDim)),
    ...(o.qkvBias ? {
      bq: tensor(`blk.${l}.attn_q.bias`, GgmlType.F32, qDim, 1, 0.5),
      bk: tensor(`blk.${l}.attn_k.bias`, GgmlType.F32, kvDim, 1, 0.5),
      bv: tensor(`blk.${l}.attn_v.bias`, GgmlType.F32, kvDim, 1, 0.5),
    } : {}),
    ffnNorm: norm(`blk.${l}.ffn_norm`),
    wGate: tensor(`blk.${l}.ffn_gate`, o.type, dim, ffnDim, Math.sqrt(3 / dim)),
    wUp: tensor(`blk.${l}.ffn_up`, o.type, dim, ffnDim, Math.sqrt(3 / dim)),
    wDown: tensor(`blk.${l}.ffn_down`, o.type, ffnDim, dim, Math.sqrt(3 / ffnDim)),
  }));
  const tokenEmbedding = tensor('token_embd', edge, dim, config.vocabSize, 1);
  const output = config.tiedEmbeddings ? tokenEmbedding : tensor('output', edge, dim, config.vocabSize, Math.sqrt(3 / dim));
  return { config, weights: { tokenEmbedding, layers, outputNorm: norm('output_norm'), output } };
}

// ---------------------------------------------------------------------------------------------------------------
// Engine steps: three sequences in shuffled blocks; prefill in chunks, then decode, then a late arrival.

const BLOCK_SIZE = 8;
const NUM_BLOCKS = 24;
const MAX_BLOCKS = 8;

interface SeqState {
  tokens: number[];
  computed: number;
  blocks: number[];
}

function makeSteps(seed: number): ForwardBatch[] {
  const rand = seeded(seed);
  const free = Array.from({ length: NUM_BLOCKS }, (_, i) => i).sort(() => rand() - 0.5);
  const seqs: SeqState[] = [0, 1, 2].map((s) => ({
    tokens: Array.from({ length: [13, 6, 4][s]! }, () => Math.floor(rand() * 300)), computed: 0, blocks: [],
  }));
  // Per step, the new tokens each sequence gets (0 = not scheduled).
  const plan = [[9, 6, 0], [4, 1, 0], [1, 1, 4], [1, 1, 1], [1, 0, 1]];
  return plan.map((counts) => {
    const rows: { seq: number; position: number; token: number }[] = [];
    const scheduled: number[] = [];
    counts.forEach((count, s) => {
      if (count === 0) return;
      const seq = seqs[s]!;
      while (seq.tokens.length < seq.computed + count) seq.tokens.push(Math.floor(rand() * 300)); // "sampled"
      for (let i = 0; i < count; i++) rows.push({ seq: s, position: seq.computed + i, token: seq.tokens[seq.computed + i]! });
      seq.computed += count;
      while (seq.blocks.length * BLOCK_SIZE < seq.computed) seq.blocks.push(free.pop()!);
      scheduled.push(s);
    });
    const queryStartLoc = new Int32Array(scheduled.length + 1);
    const blockTables = new Int32Array(scheduled.length * MAX_BLOCKS).fill(-1);
    scheduled.forEach((s, i) => {
      queryStartLoc[i + 1] = queryStartLoc[i]! + counts[s]!;
      seqs[s]!.blocks.forEach((b, j) => { blockTables[i * MAX_BLOCKS + j] = b; });
    });
    const slotOf = (r: { seq: number; position: number }) =>
      seqs[r.seq]!.blocks[Math.floor(r.position / BLOCK_SIZE)]! * BLOCK_SIZE + (r.position % BLOCK_SIZE);
    return {
      numTokens: rows.length,
      tokenIds: Int32Array.from(rows, (r) => r.token),
      positions: Int32Array.from(rows, (r) => r.position),
      slotMapping: Int32Array.from(rows, slotOf),
      numSeqs: scheduled.length,
      queryStartLoc,
      seqLens: Int32Array.from(scheduled, (s) => seqs[s]!.computed),
      blockTables,
      maxBlocksPerSeq: MAX_BLOCKS,
      // Every sequence's last row, plus a middle row of the first one (logits of any row must be right).
      logitsIndices: Int32Array.from([...queryStartLoc.slice(1).map((e) => e - 1), ...(counts[0]! > 2 ? [1] : [])]),
    };
  });
}

function loadNative(config: ModelConfig, weights: ModelWeights, dtype: KvDtype, variant: KernelVariant,
  threads: number, packWeights = true): NativeModel {
  const layout: KvPoolLayout = {
    numLayers: config.numLayers, numBlocks: NUM_BLOCKS, blockSize: BLOCK_SIZE, numKvHeads: config.numKvHeads,
    headDim: config.headDim, dtype,
  };
  const pool = new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout)));
  return new (native().NativeModel)({
    ...nativeModelSpec(config, weights, { layout, bytes: pool }, variant, threads), packWeights,
  });
}

function runNative(config: ModelConfig, weights: ModelWeights, dtype: KvDtype, variant: KernelVariant,
  threads: number, steps: ForwardBatch[], packWeights = true): Float32Array[] {
  const model = loadNative(config, weights, dtype, variant, threads, packWeights);
  try {
    return steps.map((b) => model.forward(b));
  } finally {
    model.dispose();
  }
}

function runReference(config: ModelConfig, weights: ModelWeights, dtype: KvDtype, steps: ForwardBatch[]): Float32Array[] {
  const backend = referenceBackend.load(config, weights, { numBlocks: NUM_BLOCKS, blockSize: BLOCK_SIZE, dtype });
  return steps.map((b) => backend.forward(b));
}

/** Whether `variant` multiplies K-quant `type` weights with 8-bit activations (kernels avx2_int8, avx512_vnni). */
function kQuantIntDot(variant: KernelVariant, type: GgmlType): boolean {
  const kind = `matmul_${ggmlTypeName(type).toLowerCase()}`;
  return ['avx2_int8', 'avx512_vnni'].includes(native().kernelVariants(variant)[kind] ?? '');
}

// Float weights only reorder sums; 8-bit activations in the Q8_0 / Q4_0 matmuls add ~1e-5 per matmul. BF16 on
// VDPBF16PS rounds the activations to bf16 instead: a mean square relative error of 2^-16 / 7 per value (an error
// spread evenly over half an ulp, an ulp being 2^-7 of the value's power of two, over values spread over their
// binade) against 1 / (4 * 127^2) for int8 blocks of uniform values (a step of amax / 127 over values of mean square
// amax^2 / 3; real activations, less uniform, fare worse). Its bound is the 8-bit one scaled by that ratio, 0.14.
function bound(type: GgmlType, variant: KernelVariant): number {
  const int8Activations = 3e-3;
  if ([GgmlType.Q8_0, GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0, GgmlType.Q5_1].includes(type)) return int8Activations;
  // K-quants on 8-bit activations with one scale per 256 values instead of 32: the rounding's mean square grows with
  // the square of the block's largest magnitude, E[max^2] of 256 |N(0,1)| values over that of 32 (9.40 / 5.71).
  if ([GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K].includes(type) && kQuantIntDot(variant, type)) {
    return int8Activations * (9.40 / 5.71);
  }
  if (type === GgmlType.BF16 && roundsBf16Activations(variant)) {
    return (int8Activations * (2 ** -16 / 7)) / (1 / (4 * 127 ** 2));
  }
  return 1e-7;
}

// Models small enough for the TypeScript reference to run quickly (K-quants need rows of 256); f32 and f16 KV
// alternate between them.
const MODELS: { name: string; kv: KvDtype; options: ModelOptions }[] = [
  { name: 'F32', kv: 'f32', options: { type: GgmlType.F32, dim: 128, ffnDim: 192 } },
  { name: 'F16, neox RoPE, tied embeddings', kv: 'f16',
    options: { type: GgmlType.F16, dim: 128, ffnDim: 160, ropeStyle: 'neox', tiedEmbeddings: true } },
  { name: 'BF16, QKV bias (Qwen2)', kv: 'f32',
    options: { type: GgmlType.BF16, dim: 128, ffnDim: 128, qkvBias: true, ropeStyle: 'neox' } },
  { name: 'Q8_0 with F16 edges', kv: 'f16', options: { type: GgmlType.Q8_0, edgeType: GgmlType.F16, dim: 128, ffnDim: 256 } },
  { name: 'Q4_0, Llama 3 RoPE scaling', kv: 'f32', options: {
    type: GgmlType.Q4_0, edgeType: GgmlType.Q8_0, dim: 128, ffnDim: 192,
    ropeScaling: { type: 'llama3', factor: 8, lowFreqFactor: 1, highFreqFactor: 4, originalContextLength: 64 },
  } },
  { name: 'Q5_0 with Q4_1 edges', kv: 'f16', options: { type: GgmlType.Q5_0, edgeType: GgmlType.Q4_1, dim: 128, ffnDim: 160 } },
  { name: 'Q5_1', kv: 'f32', options: { type: GgmlType.Q5_1, dim: 128, ffnDim: 96 } },
  { name: 'Q4_K, partial RoPE', kv: 'f16', options: { type: GgmlType.Q4_K, edgeType: GgmlType.Q6_K, ropeDim: 32, ffnDim: 256 } },
  { name: 'Q5_K with Q6_K edges', kv: 'f16', options: { type: GgmlType.Q5_K, edgeType: GgmlType.Q6_K, ffnDim: 256 } },
  { name: 'Q6_K, linear RoPE scaling', kv: 'f32',
    options: { type: GgmlType.Q6_K, ffnDim: 256, ropeScaling: { type: 'linear', factor: 2 } } },
];

describe('native forward == reference forward', { skip: skipNative }, () => {
  const steps = makeSteps(1);
  MODELS.forEach(({ name, kv, options }, i) => {
    it(`${name}, ${kv} KV`, () => {
      const { config, weights } = makeModel(10 + i, options);
      const expected = runReference(config, weights, kv, steps);
      for (const variant of variants) {
        const actual = runNative(config, weights, kv, variant, 2, steps);
        actual.forEach((logits, s) => {
          assert.equal(logits.length, steps[s]!.logitsIndices.length * config.vocabSize);
          assertClose(logits, expected[s]!, bound(options.type, variant), `${name} ${variant} step ${s}`);
        });
      }
    });
  });

  // Models written to GGUF by the project's writer (src/model/synthetic.ts: tied embeddings, the real 32000-token
  // vocabulary) and read back by the loader: Q4_K, Q5_K and Q6_K matmuls on every variant, packed and ggml-row
  // weights.
  for (const dtype of ['Q4_K', 'Q5_K', 'Q6_K'] as const) {
    it(`synthetic ${dtype} GGUF from the writer: native == reference, packed or not, 1 or 2 threads`, async () => {
      const dir = mkdtempSync(join(tmpdir(), 'conduit-kquant-model-'));
      try {
        const path = join(dir, `synthetic-${dtype}.gguf`);
        writeSyntheticModel({
          name: `synthetic-${dtype}`, dim: 256, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 512,
          contextLength: 256, dtype, seed: 19, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
        }, path);
        const { config, weights } = await loadModel(path);
        assert.equal(weights.layers[0]!.wq.type, GgmlType[dtype]);
        const steps = makeSteps(5).map((b) => ({ ...b, tokenIds: b.tokenIds.map((t) => (t * 101) % config.vocabSize) }));
        const expected = runReference(config, weights, 'f16', steps);
        for (const variant of variants) {
          const packed = runNative(config, weights, 'f16', variant, 2, steps);
          packed.forEach((logits, s) => assertClose(logits, expected[s]!, bound(weights.layers[0]!.wq.type, variant),
            `${dtype} ${variant} step ${s}`));
          assert.deepEqual(runNative(config, weights, 'f16', variant, 1, steps, false), packed,
            `${dtype} ${variant}: ggml rows on 1 thread differ from packed on 2`);
        }
      } finally {
        rmSync(dir, { recursive: true, force: true });
      }
    });
  }

  // The same from files llama.cpp's llama-quantize made (its own scale search and type mix: Q4_K_M and Q5_K_M put
  // Q6_K in some layers and the output), from an F32 model the writer made. Needs the llama.cpp build
  // (scripts/build-llama-cpp.sh, or CONDUIT_LLAMA_CPP_BIN).
  const quantizeMissing = llamaQuantizeMissing();
  // An FFN of 320 (not whole super-blocks): llama-quantize stores ffn_down (rows of 320) as Q5_0 in a Q4_K_M file
  // and as Q5_1 in a Q5_K_M one, which files of real models with such FFN widths carry.
  for (const [type, fallback] of [['Q4_K_M', GgmlType.Q5_0], ['Q5_K_M', GgmlType.Q5_1]] as const) {
    it(`synthetic ${type} GGUF from llama-quantize with ${ggmlTypeName(fallback)} fallback rows: native == reference`,
      { skip: quantizeMissing ? `llama-quantize unavailable: ${quantizeMissing}` : false }, async () => {
        const dir = mkdtempSync(join(tmpdir(), 'conduit-llama-quantize-'));
        try {
          const f32 = join(dir, 'synthetic-llq320-F32.gguf');
          writeSyntheticModel({
            name: 'synthetic-llq320', dim: 256, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 320,
            contextLength: 256, dtype: 'F32', seed: 29, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
          }, f32);
          const { config, weights } = await loadModel(ensureLlamaQuantized(f32, type));
          assert.ok(weights.layers.some((l) => l.wDown.type === fallback), `${type}: some ffn_down is ${ggmlTypeName(fallback)} ` +
            `(types: ${weights.layers.map((l) => ggmlTypeName(l.wDown.type)).join(', ')})`);
          const steps = makeSteps(5).map((b) => ({ ...b, tokenIds: b.tokenIds.map((t) => (t * 101) % config.vocabSize) }));
          const expected = runReference(config, weights, 'f16', steps);
          for (const variant of variants) {
            const packed = runNative(config, weights, 'f16', variant, 2, steps);
            // The fallback matrices take 8-bit activations on every variant, the K-quant ones on the SIMD variants.
            const limit = Math.max(bound(GgmlType.Q4_K, variant), bound(fallback, variant));
            packed.forEach((logits, s) => assertClose(logits, expected[s]!, limit, `${type} ${variant} step ${s}`));
            assert.deepEqual(runNative(config, weights, 'f16', variant, 1, steps, false), packed,
              `${type} ${variant}: ggml rows on 1 thread differ from packed on 2`);
          }
        } finally {
          rmSync(dir, { recursive: true, force: true });
        }
      });
  }

  for (const type of ['Q4_K_M', 'Q5_K_M', 'Q6_K'] as const) {
    it(`synthetic ${type} GGUF from llama-quantize: native == reference, packed or not`,
      { skip: quantizeMissing ? `llama-quantize unavailable: ${quantizeMissing}` : false }, async () => {
        const dir = mkdtempSync(join(tmpdir(), 'conduit-llama-quantize-'));
        try {
          const f32 = join(dir, 'synthetic-llq-F32.gguf');
          writeSyntheticModel({
            name: 'synthetic-llq', dim: 256, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 512,
            contextLength: 256, dtype: 'F32', seed: 23, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
          }, f32);
          const { config, weights } = await loadModel(ensureLlamaQuantized(f32, type));
          const main = type === 'Q4_K_M' ? GgmlType.Q4_K : type === 'Q5_K_M' ? GgmlType.Q5_K : GgmlType.Q6_K;
          assert.equal(weights.layers[0]!.wq.type, main, `${type}: attn_q`);
          const steps = makeSteps(5).map((b) => ({ ...b, tokenIds: b.tokenIds.map((t) => (t * 101) % config.vocabSize) }));
          const expected = runReference(config, weights, 'f16', steps);
          for (const variant of variants) {
            const packed = runNative(config, weights, 'f16', variant, 2, steps);
            packed.forEach((logits, s) => assertClose(logits, expected[s]!, bound(main, variant), `${type} ${variant} step ${s}`));
            assert.deepEqual(runNative(config, weights, 'f16', variant, 1, steps, false), packed,
              `${type} ${variant}: ggml rows on 1 thread differ from packed on 2`);
          }
        } finally {
          rmSync(dir, { recursive: true, force: true });
        }
      });
  }

  it('logits are identical for 1, 2 and 3 threads', () => {
    const { config, weights } = makeModel(30, { type: GgmlType.Q8_0, dim: 128, ffnDim: 256 });
    const one = runNative(config, weights, 'f16', variants.at(-1)!, 1, steps);
    for (const threads of [2, 3]) {
      assert.deepEqual(runNative(config, weights, 'f16', variants.at(-1)!, threads, steps), one, `${threads} threads`);
    }
  });

  it('a sequence gets the same logits alone, chunked differently, or batched with others', () => {
    // Sequence s owns pool blocks 4s .. 4s+3; token ids are a function of (sequence, position).
    const tokenAt = (seq: number, position: number) => (seq * 37 + position * 11) % 300;
    const stepOf = (entries: { seq: number; start: number; count: number }[]): ForwardBatch => {
      const rows = entries.flatMap((e) => Array.from({ length: e.count }, (_, i) => ({ seq: e.seq, position: e.start + i })));
      const queryStartLoc = new Int32Array(entries.length + 1);
      entries.forEach((e, i) => { queryStartLoc[i + 1] = queryStartLoc[i]! + e.count; });
      return {
        numTokens: rows.length, tokenIds: Int32Array.from(rows, (r) => tokenAt(r.seq, r.position)),
        positions: Int32Array.from(rows, (r) => r.position),
        slotMapping: Int32Array.from(rows, (r) => (4 * r.seq + Math.floor(r.position / BLOCK_SIZE)) * BLOCK_SIZE + (r.position % BLOCK_SIZE)),
        numSeqs: entries.length, queryStartLoc, seqLens: Int32Array.from(entries, (e) => e.start + e.count),
        blockTables: Int32Array.from(entries.flatMap((e) => Array.from({ length: MAX_BLOCKS }, (_, b) => (b < 4 ? 4 * e.seq + b : 0)))),
        maxBlocksPerSeq: MAX_BLOCKS, logitsIndices: Int32Array.from(entries, (_, i) => queryStartLoc[i + 1]! - 1),
      };
    };
    const batched = [
      stepOf([{ seq: 0, start: 0, count: 9 }, { seq: 1, start: 0, count: 6 }]),
      stepOf([{ seq: 0, start: 9, count: 1 }, { seq: 1, start: 6, count: 1 }, { seq: 2, start: 0, count: 4 }]),
      stepOf([{ seq: 2, start: 4, count: 1 }, { seq: 1, start: 7, count: 1 }, { seq: 0, start: 10, count: 1 }]),
    ];
    // Sequence 1 alone: its prompt in chunks of 2, 1 and 3 rows, then the same two decode steps.
    const alone = [[0, 2], [2, 1], [3, 3], [6, 1], [7, 1]].map(([start, count]) => stepOf([{ seq: 1, start: start!, count: count! }]));
    for (const type of [GgmlType.Q8_0, GgmlType.F16, GgmlType.Q4_K]) {
      const { config, weights } = makeModel(33, { type, dim: type === GgmlType.Q4_K ? 256 : 128, ffnDim: 256,
        edgeType: type === GgmlType.Q4_K ? GgmlType.Q6_K : undefined });
      const v = config.vocabSize;
      const inBatch = runNative(config, weights, 'f16', variants.at(-1)!, 2, batched);
      const byItself = runNative(config, weights, 'f16', variants.at(-1)!, 1, alone);
      const what = `${ggmlTypeName(type)} ${variants.at(-1)}`;
      assert.deepEqual(byItself[2], inBatch[0]!.slice(v, 2 * v), `${what}: last prompt row`);
      assert.deepEqual(byItself[3], inBatch[1]!.slice(v, 2 * v), `${what}: first decode step`);
      assert.deepEqual(byItself[4], inBatch[2]!.slice(v, 2 * v), `${what}: second decode step`);
    }
  });

  it('weights packed at load give the bits of the ggml rows, and their memory is reported', () => {
    // Odd sizes for the 16-row panels: vocab 300 rows (partial last panel), K and V 48 rows (odd panel count),
    // rows of 96 columns (3 blocks); the output projection shares the embedding's bytes, which stay unpacked for
    // lookups.
    const { config, weights } = makeModel(34, { type: GgmlType.Q8_0, dim: 96, ffnDim: 160, tiedEmbeddings: true });
    const steps = makeSteps(3);
    const matrices = [weights.output, ...weights.layers.flatMap((l) => [l.wq, l.wk, l.wv, l.wo, l.wGate, l.wUp,
      l.wDown])];
    for (const variant of variants) {
      const packedBytes = matrices.reduce((s, t) => s + native().ops.packedBytes(variant, t.type, t.shape[0]!,
        t.shape[1]!), 0);
      const packed = loadNative(config, weights, 'f16', variant, 2);
      const rows = loadNative(config, weights, 'f16', variant, 2, false);
      try {
        assert.ok(packed.info().packedWeightBytes >= packedBytes, `${variant}: packed copy reported`);
        assert.equal(packedBytes > 0, packed.info().packedWeightBytes > 0, `${variant}: nothing packed, nothing held`);
        assert.equal(rows.info().packedWeightBytes, 0, `${variant}: packWeights off`);
        steps.forEach((b, s) => assert.deepEqual(packed.forward(b), rows.forward(b), `${variant} step ${s}`));
      } finally {
        packed.dispose();
        rows.dispose();
      }
    }
    // Packing must not touch the ggml bytes JavaScript owns (the embedding, and the reference backend, read them).
    const expected = runReference(config, weights, 'f16', steps);
    runNative(config, weights, 'f16', variants.at(-1)!, 2, steps).forEach((logits, s) =>
      assertClose(logits, expected[s]!, bound(GgmlType.Q8_0, variants.at(-1)!), `after packing, step ${s}`));
  });

  it('rejects inconsistent batches with a message naming the field', () => {
    const { config, weights } = makeModel(31, { type: GgmlType.F32, dim: 64, ffnDim: 64 });
    const backend = nativeBackend.load(config, weights, { numBlocks: NUM_BLOCKS, blockSize: BLOCK_SIZE, dtype: 'f32' });
    const good = makeSteps(2)[0]!;
    assert.throws(() => backend.forward({ ...good, tokenIds: good.tokenIds.map(() => 300) }), /tokenIds\[0\] = 300/);
    assert.throws(() => backend.forward({ ...good, slotMapping: good.slotMapping.map((s) => s + 1) }), /slotMapping\[0\]/);
    assert.throws(() => backend.forward({ ...good, positions: good.positions.map((p) => p + 1) }), /positions\[0\]/);
    assert.throws(() => backend.forward({ ...good, blockTables: good.blockTables.map(() => NUM_BLOCKS) }), /blockTables/);
    assert.throws(() => backend.forward({ ...good, logitsIndices: Int32Array.of(good.numTokens) }), /logitsIndices/);
    backend.dispose();
    assert.throws(() => backend.forward(good), /disposed/);
  });

  it('refuses sizes whose products overflow (a wrapped size would pass the length checks) and rows past numTokens', () => {
    const { config, weights } = makeModel(32, { type: GgmlType.F32, dim: 64, ffnDim: 64 });
    const layout: KvPoolLayout = { numLayers: config.numLayers, numBlocks: NUM_BLOCKS, blockSize: BLOCK_SIZE,
      numKvHeads: config.numKvHeads, headDim: config.headDim, dtype: 'f32' };
    const spec = nativeModelSpec(config, weights, { layout, bytes: new Uint8Array(kvPoolBytes(layout)) }, 'generic', 1);
    const Addon = native().NativeModel;
    // numBlocks x blockSize x KV width x 2 layers-ways x 4 bytes wraps to this pool's size when numBlocks is 2^61 more.
    assert.throws(() => new Addon({ ...spec, numBlocks: 2 ** 61 + NUM_BLOCKS }), /too large/);
    assert.throws(() => new Addon({ ...spec, numBlocks: 2 ** 44 + 1, blockSize: 65536 }), /too large/);
    const model = new Addon(spec);
    try {
      const rank = 2 ** 62 + 1024;
      const matrix = { rank, a: new Float32Array(65536), b: new Float32Array(65536) };
      const adapter = { scale: 1, layers: Array.from({ length: config.numLayers }, () => ({ wq: matrix })) };
      assert.throws(() => model.setLora(0, adapter as never), /rank/);
      // A sequence whose rows run past numTokens, found before its rows are read (a later one then decreases).
      const good = makeSteps(2)[0]!;
      const seqs = { ...good, numSeqs: 2, queryStartLoc: Int32Array.of(0, good.numTokens + 50, good.numTokens),
        seqLens: Int32Array.of(good.numTokens + 50, 1), blockTables: new Int32Array(2 * good.maxBlocksPerSeq) };
      assert.throws(() => model.forward(seqs), /passes numTokens/);
    } finally {
      model.dispose();
    }
  });

  it('writes the logits into a buffer the caller reuses, when it is large enough', () => {
    const { config, weights } = makeModel(34, { type: GgmlType.Q8_0, dim: 64, ffnDim: 96 });
    const steps = makeSteps(3);
    const expected = runNative(config, weights, 'f16', variants.at(-1)!, 2, steps);
    const model = loadNative(config, weights, 'f16', variants.at(-1)!, 2);
    try {
      const most = Math.max(...expected.map((e) => e.length));
      const out = new Float32Array(most + 7);
      steps.forEach((step, s) => {
        out.fill(-7.5);
        const logits = model.forward(step, out);
        assert.equal(logits.buffer, out.buffer, `step ${s} wrote into the given buffer`);
        assert.equal(logits.byteOffset, out.byteOffset);
        assert.deepEqual(logits, expected[s], `step ${s}`);
        assert.ok(out.subarray(logits.length).every((x) => x === -7.5), `step ${s} wrote past its logits`);
      });
      // Too small: a new array, the given one untouched. Not a Float32Array: refused.
      const small = new Float32Array(3).fill(-7.5);
      const fresh = model.forward(steps[0]!, small);
      assert.notEqual(fresh.buffer, small.buffer);
      assert.ok(small.every((x) => x === -7.5));
      assert.throws(() => model.forward(steps[0]!, new Int32Array(most) as unknown as Float32Array), /out/);
    } finally {
      model.dispose();
    }
  });

  it('loads with and without the packed copy to the same bits (packWeights)', () => {
    const { config, weights } = makeModel(33, { type: GgmlType.Q8_0, dim: 64, ffnDim: 96 });
    const kv = { numBlocks: NUM_BLOCKS, blockSize: BLOCK_SIZE, dtype: 'f32' as const };
    const step = makeSteps(2)[0]!;
    const packed = nativeBackend.load(config, weights, kv, { packWeights: true });
    const rows = nativeBackend.load(config, weights, kv, { packWeights: false });
    try {
      assert.deepEqual(packed.forward(step), rows.forward(step));
      // An explicit choice needs no notice about repacking; an AMX machine's notice (whether Linux granted AMX) is
      // about the CPU, and stays.
      const repacking = (packed.info.notices ?? []).filter((notice) => !notice.startsWith('AMX detected'));
      assert.deepEqual(repacking, [], 'an explicit choice needs no notice');
    } finally {
      packed.dispose();
      rows.dispose();
    }
  });

  it('gives the packed matrices\' original bytes back when asked, and computes the same bits', () => {
    const kv = { numBlocks: NUM_BLOCKS, blockSize: BLOCK_SIZE, dtype: 'f32' as const };
    const options = { type: GgmlType.Q8_0, dim: 256, ffnDim: 512, tiedEmbeddings: true };
    const kept = makeModel(35, options);
    const twin = makeModel(35, options);  // the same bytes, to be released
    const keptBackend = nativeBackend.load(kept.config, kept.weights, kv, { packWeights: true });
    const releasedBackend = nativeBackend.load(twin.config, twin.weights, kv, { packWeights: true, releaseUnpackedWeights: true });
    try {
      const packs = native().ops.packedBytes(variants.at(-1)!, GgmlType.Q8_0, 256, 512) > 0;
      const gate = twin.weights.layers[0]!.wGate.data;
      const zeroPages = gate.subarray(4096, gate.length - 4096).every((b) => b === 0);
      // Released only where the kernels pack (avx512); the tied embedding table is kept either way.
      assert.equal(zeroPages, packs, packs ? 'the gate matrix\'s pages were given back' : 'nothing packed, nothing released');
      assert.deepEqual(twin.weights.tokenEmbedding.data, kept.weights.tokenEmbedding.data);
      for (const step of makeSteps(5)) assert.deepEqual(releasedBackend.forward(step), keptBackend.forward(step));
    } finally {
      keptBackend.dispose();
      releasedBackend.dispose();
    }
  });

  it('reports the variant serving each kernel kind', () => {
    const { config, weights } = makeModel(32, { type: GgmlType.Q8_0, dim: 64, ffnDim: 64 });
    const backend = nativeBackend.load(config, weights, { numBlocks: 4, blockSize: 16, dtype: 'f32' }, { threads: 1 });
    assert.equal(backend.info.name, 'native');
    assert.equal(backend.info.threads, 1);
    const best = native().cpuInfo().bestVariant;
    assert.ok(backend.info.variants.matmul_q8_0?.startsWith(process.env.CONDUIT_KERNEL_VARIANT || best));
    assert.ok(backend.info.variants.attention);
    backend.dispose();
  });
});

// ---------------------------------------------------------------------------------------------------------------
// Giving the KV pool's pages back to the system (after a prefix-cache reset)

describe('native KV pool release', { skip: skipNative }, () => {
  it('releaseKvPool drops the pool\'s resident pages and later steps match a fresh model', () => {
    const { config, weights } = makeModel(7, { type: GgmlType.F32, dim: 128, ffnDim: 192 });
    const variant = variants[0]!;
    const model = loadNative(config, weights, 'f32', variant, 2);
    try {
      // A small pool comes from the heap, resident from the start: release it once to begin with none.
      model.releaseKvPool();
      const before = model.kvPoolResidentBytes();
      for (const batch of makeSteps(1)) model.forward(batch);
      const filled = model.kvPoolResidentBytes();
      assert.ok(filled > before, `forward steps fault pool pages in (${before} -> ${filled} resident bytes)`);
      const released = model.releaseKvPool();
      assert.ok(released >= filled, `released ${released} bytes, ${filled} were resident`);
      assert.ok(before <= filled / 16, `${before} pool bytes resident after the first release`);
      const after = model.kvPoolResidentBytes();
      assert.ok(after <= filled / 16, `${after} of ${filled} pool bytes still resident after the release`);
      // Other sequences in other blocks: every position a step reads was written by an earlier step of its own.
      const steps = makeSteps(2);
      const fresh = runNative(config, weights, 'f32', variant, 2, steps);
      steps.forEach((batch, s) => assertClose(model.forward(batch), fresh[s]!, 0, `step ${s} after the release`));
      assert.ok(model.kvPoolResidentBytes() > after, 'the steps after the release fault pages in again');
    } finally {
      model.dispose();
    }
  });
});

// ---------------------------------------------------------------------------------------------------------------
// stories260K: a real trained model, against llama.cpp's greedy output

describe('native forward on stories260K', { skip: skipNative || skipUnlessShared('stories260K.gguf') }, () => {
  it('greedy decoding reproduces llama.cpp tokens in every variant', async () => {
    const model = await loadModel(sharedModel('stories260K.gguf')!);
    const golden = JSON.parse(readFileSync(sharedModel('stories260K.expected.json')!, 'utf8')) as {
      cases: { prompt_tokens: number[]; greedy_tokens: number[] }[];
    };
    const reference = referenceBackend.load(model.config, model.weights, { numBlocks: 8, blockSize: 16, dtype: 'f32' });
    for (const variant of variants) {
      for (const c of golden.cases) {
        const layout: KvPoolLayout = {
          numLayers: model.config.numLayers, numBlocks: 8, blockSize: 16, numKvHeads: model.config.numKvHeads,
          headDim: model.config.headDim, dtype: 'f32',
        };
        const pool = new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout)));
        const m = new (native().NativeModel)(nativeModelSpec(model.config, model.weights, { layout, bytes: pool }, variant, 2));
        const blockTables = Int32Array.from([5, 2, 7, 0, 1, 3, 4, 6]);
        const slot = (p: number) => blockTables[Math.floor(p / 16)]! * 16 + (p % 16);
        const generated: number[] = [];
        let pending = [...c.prompt_tokens];
        let seqLen = 0;
        for (let step = 0; step < c.greedy_tokens.length; step++) {
          const positions = Int32Array.from(pending, (_, i) => seqLen + i);
          seqLen += pending.length;
          const batch: ForwardBatch = {
            numTokens: pending.length, tokenIds: Int32Array.from(pending), positions,
            slotMapping: positions.map(slot), numSeqs: 1, queryStartLoc: Int32Array.of(0, pending.length),
            seqLens: Int32Array.of(seqLen), blockTables, maxBlocksPerSeq: 8,
            logitsIndices: Int32Array.of(pending.length - 1),
          };
          const logits = m.forward(batch);
          if (step === 0) assertClose(logits, reference.forward(batch), 1e-9, `${variant} prompt logits vs reference`);
          let best = 0;
          for (let i = 1; i < logits.length; i++) if (logits[i]! > logits[best]!) best = i;
          generated.push(best);
          pending = [best];
        }
        m.dispose();
        assert.deepEqual(generated, c.greedy_tokens, `${variant}: greedy tokens differ from llama.cpp`);
      }
    }
  });
});
