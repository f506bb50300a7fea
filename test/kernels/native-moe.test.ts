// Mixture-of-experts layers on the native kernels: for every quant type of the dense path (Q8_0, Q4_0, Q4_K, Q6_K)
// and every kernel variant this CPU runs, the logits of a batch match the reference backend's within the kernels'
// rounding bounds, and a sequence's logits are the same bits alone as in a batch with others (its rows meet other
// sequences' rows in the experts' grouped matmuls). The one-job expert path on odd shapes (tiles cut short in both
// matmuls, an odd number of experts) and every weight type: a token decoded alone (one input row shared by its
// experts), or beside another stream, gets the bits of the same row in a prefill, on 1 and 3 threads, packed weights
// or ggml rows. And each active expert's weights are read once per layer and step however many rows chose it
// (counted by the native profile).
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';

import { kvPoolBytes, type ForwardBatch, type KvPoolLayout } from '../../src/kernels/types.ts';
import { nativeModelSpec, type KernelVariant } from '../../src/kernels/native.ts';
import { referenceBackend } from '../../src/kernels/reference-backend.ts';
import { GgmlType } from '../../src/model/ggml-types.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { MOE_KERNEL_MODEL, writeArchGguf, type ArchModelSpec } from '../model/arch-models.ts';
import { native, nmse, skipNative, variants } from './native-harness.ts';

const BLOCK_SIZE = 16;
const PROMPTS = [[1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203], [1, 3118, 29892, 727], [1, 29871, 29906]];

/** All prompts prefilled in one step (each sequence in its own blocks), logits of every row. */
function prefill(prompts: number[][]): ForwardBatch {
  const maxBlocksPerSeq = 1;
  const rows = prompts.flatMap((p, s) => p.map((token, position) => ({ s, token, position })));
  const queryStartLoc = new Int32Array(prompts.length + 1);
  prompts.forEach((p, s) => { queryStartLoc[s + 1] = queryStartLoc[s]! + p.length; });
  return {
    numTokens: rows.length,
    tokenIds: Int32Array.from(rows, (r) => r.token),
    positions: Int32Array.from(rows, (r) => r.position),
    slotMapping: Int32Array.from(rows, (r) => r.s * BLOCK_SIZE + r.position),
    numSeqs: prompts.length,
    queryStartLoc,
    seqLens: Int32Array.from(prompts, (p) => p.length),
    blockTables: Int32Array.from(prompts, (_, s) => s),
    maxBlocksPerSeq,
    logitsIndices: Int32Array.from(rows, (_, i) => i),
  };
}

/**
 * A MoE model whose expert tiles are cut short: intermediate size 160 (gate/up tiles of 64, 64, 32 rows), hidden
 * size 96 (down tiles of 64 and 32), 5 experts with 3 per token.
 */
const ODD_MOE_MODEL: ArchModelSpec = {
  ...MOE_KERNEL_MODEL, name: 'moe-odd', dim: 96, numHeads: 3, numKvHeads: 1, headDim: 32, ffnDim: 160, seed: 308,
  moe: { numExperts: 5, numExpertsUsed: 3, expertFfnDim: 160 },
};

function runNative(model: LoadedModel, variant: KernelVariant, batch: ForwardBatch): Float32Array {
  const layout: KvPoolLayout = { numLayers: model.config.numLayers, numBlocks: PROMPTS.length, blockSize: BLOCK_SIZE,
    numKvHeads: model.config.numKvHeads, headDim: model.config.headDim, dtype: 'f32' };
  const pool = new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout)));
  const m = new (native().NativeModel)(nativeModelSpec(model.config, model.weights, { layout, bytes: pool }, variant, 2));
  try {
    return m.forward(batch).slice();
  } finally {
    m.dispose();
  }
}

const TYPES: [string, GgmlType, number][] = [
  // Bounds on the normalised squared error of the logits: 8-bit activations in the quantized matmuls, a little more
  // for K-quants (one activation scale per 256 values), as in native-model.test.ts, with room for two layers.
  ['Q8_0', GgmlType.Q8_0, 1e-2], ['Q4_0', GgmlType.Q4_0, 1e-2], ['Q4_K', GgmlType.Q4_K, 2e-2],
  ['Q6_K', GgmlType.Q6_K, 2e-2],
];

describe('mixture of experts on the native kernels', { skip: skipNative }, () => {
  let dir: string;
  before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-moe-')); });
  after(() => rmSync(dir, { recursive: true, force: true }));

  for (const [name, type, bound] of TYPES) {
    it(`${name} experts: logits match the reference on every variant, and a sequence alone gets the same bits as in the batch`, async () => {
      const path = join(dir, `moe-${name}.gguf`);
      writeArchGguf(MOE_KERNEL_MODEL, path, type);
      const model = await loadModel(path);
      assert.equal(model.weights.layers[0]!.wGate.type, type);
      assert.deepEqual(model.weights.layers[0]!.wGate.shape, [256, 256, 8]);
      const batch = prefill(PROMPTS);
      const reference = referenceBackend.load(model.config, model.weights, { numBlocks: PROMPTS.length, blockSize: BLOCK_SIZE, dtype: 'f32' })
        .forward(batch);
      const vocab = model.config.vocabSize;
      for (const variant of variants) {
        const logits = runNative(model, variant, batch);
        const error = nmse(logits, reference);
        assert.ok(error < bound, `${variant}: normalised error ${error} (bound ${bound})`);
        // The last sequence alone: the same bits as its rows in the batch.
        const last = PROMPTS.length - 1;
        const alone = runNative(model, variant, prefill([PROMPTS[last]!]));
        const offset = batch.queryStartLoc[last]! * vocab;
        assert.deepEqual(alone, logits.subarray(offset, offset + alone.length), `${variant}: alone vs batched`);
      }
    });
  }
});

interface Stream { tokens: number[]; block: number }

/** One step: each stream's rows [from, to) (its earlier tokens are in its pool blocks), logits of every row. */
function step(streams: { s: Stream; from: number; to: number }[], blocksPerSeq: number): ForwardBatch {
  const rows = streams.flatMap(({ s, from, to }, i) =>
    Array.from({ length: to - from }, (_, k) => ({ i, token: s.tokens[from + k]!, position: from + k, block: s.block })));
  const queryStartLoc = new Int32Array(streams.length + 1);
  streams.forEach(({ from, to }, i) => { queryStartLoc[i + 1] = queryStartLoc[i]! + to - from; });
  return {
    numTokens: rows.length,
    tokenIds: Int32Array.from(rows, (r) => r.token),
    positions: Int32Array.from(rows, (r) => r.position),
    slotMapping: Int32Array.from(rows, (r) => r.block * BLOCK_SIZE + r.position),
    numSeqs: streams.length,
    queryStartLoc,
    seqLens: Int32Array.from(streams, ({ to }) => to),
    blockTables: Int32Array.from(streams.flatMap(({ s }) => Array.from({ length: blocksPerSeq }, (_, b) => s.block + b))),
    maxBlocksPerSeq: blocksPerSeq,
    logitsIndices: Int32Array.from(rows, (_, i) => i),
  };
}

function instance(model: LoadedModel, variant: KernelVariant, threads: number, packWeights: boolean, blocks: number) {
  const layout: KvPoolLayout = { numLayers: model.config.numLayers, numBlocks: blocks, blockSize: BLOCK_SIZE,
    numKvHeads: model.config.numKvHeads, headDim: model.config.headDim, dtype: 'f32' };
  const pool = new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout)));
  return new (native().NativeModel)({
    ...nativeModelSpec(model.config, model.weights, { layout, bytes: pool }, variant, threads), packWeights,
  });
}

const ONE_JOB_CASES: [string, ArchModelSpec, GgmlType][] = [
  ['F32', ODD_MOE_MODEL, GgmlType.F32], ['F16', ODD_MOE_MODEL, GgmlType.F16], ['BF16', ODD_MOE_MODEL, GgmlType.BF16],
  ['Q8_0', ODD_MOE_MODEL, GgmlType.Q8_0], ['Q4_0', ODD_MOE_MODEL, GgmlType.Q4_0],
  ['Q4_K', MOE_KERNEL_MODEL, GgmlType.Q4_K], ['Q5_K', MOE_KERNEL_MODEL, GgmlType.Q5_K],
  ['Q6_K', MOE_KERNEL_MODEL, GgmlType.Q6_K],
];

describe('mixture of experts: one job per layer over every (expert, tile)', { skip: skipNative }, () => {
  let dir: string;
  before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-moe-job-')); });
  after(() => rmSync(dir, { recursive: true, force: true }));

  const A: Stream = { tokens: [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278], block: 0 };
  const B: Stream = { tokens: [1, 3118, 29892, 727, 29871, 29906, 4996, 17354, 1701], block: 1 };
  const PROMPT = 4;

  for (const [name, spec, type] of ONE_JOB_CASES) {
    it(`${name} experts (${spec.name}): decoded tokens, alone and beside another stream, get their prefill rows' bits`, async () => {
      const path = join(dir, `${spec.name}-${name}.gguf`);
      writeArchGguf(spec, path, type);
      const model = await loadModel(path);
      assert.equal(model.weights.layers[0]!.wGate.type, type);
      const vocab = model.config.vocabSize;
      for (const variant of variants) {
        // The whole of A in one prefill: rows of many tokens in the grouped matmuls, 1 thread, packed weights.
        const whole = instance(model, variant, 1, true, 2);
        const expected = whole.forward(step([{ s: A, from: 0, to: A.tokens.length }], 1)).slice();
        whole.dispose();
        for (const [threads, packWeights] of [[3, false], [2, true]] as const) {
          const label = `${variant}, ${threads} threads, ${packWeights ? 'packed' : 'ggml rows'}`;
          // A alone: its prompt, then one token per step (the single-row path).
          const alone = instance(model, variant, threads, packWeights, 2);
          alone.forward(step([{ s: A, from: 0, to: PROMPT }], 1));
          for (let p = PROMPT; p < A.tokens.length; p++) {
            const got = alone.forward(step([{ s: A, from: p, to: p + 1 }], 1));
            assert.deepEqual(got, expected.subarray(p * vocab, (p + 1) * vocab), `${label}: A decoded alone, position ${p}`);
          }
          alone.dispose();
          // A beside B: two rows per decode step (their experts' rows gathered).
          const pair = instance(model, variant, threads, packWeights, 2);
          pair.forward(step([{ s: A, from: 0, to: PROMPT }, { s: B, from: 0, to: PROMPT + 2 }], 1));
          for (let p = PROMPT; p < A.tokens.length - 2; p++) {
            const got = pair.forward(step([{ s: A, from: p, to: p + 1 }, { s: B, from: p + 2, to: p + 3 }], 1));
            assert.deepEqual(got.subarray(0, vocab), expected.subarray(p * vocab, (p + 1) * vocab),
              `${label}: A decoded beside B, position ${p}`);
          }
          pair.dispose();
        }
      }
    });
  }

  it('streams each active expert\'s weights once per layer and step, however many rows chose it', async () => {
    const path = join(dir, 'stream-once.gguf');
    writeArchGguf(ODD_MOE_MODEL, path, GgmlType.Q8_0);
    const model = await loadModel(path);
    const { numLayers } = model.config;
    const { numExperts, numExpertsUsed, expertFfnDim } = model.config.moe!;
    const dim = model.config.dim;
    const l0 = model.weights.layers[0]!;
    const expertBytes = (l0.wGate.data.byteLength + l0.wUp.data.byteLength + l0.wDown.data.byteLength) / numExperts;
    // Kernel tiles of one expert: gate and up over the intermediate size, down over the hidden size (64 rows each).
    const tilesPerExpert = 2 * Math.ceil(expertFfnDim / 64) + Math.ceil(dim / 64);
    for (const threads of [1, 2]) {
      const m = instance(model, variants.at(-1)!, threads, true, 2);
      m.setProfiling(true);
      m.takeProfile();
      // 9 + 7 rows x 3 experts = 48 (row, expert) pairs per layer over 5 experts: every expert is shared.
      m.forward(step([{ s: A, from: 0, to: 9 }, { s: B, from: 0, to: 7 }], 1));
      const prefill = m.takeProfile();
      const pairs = (9 + 7) * numExpertsUsed;
      const streamed = prefill['moe experts streamed']!.calls;
      assert.ok(streamed >= numLayers * numExpertsUsed && streamed <= numLayers * numExperts, `experts streamed ${streamed}`);
      assert.ok(streamed < numLayers * pairs);
      assert.equal(prefill['moe expert tiles revisited']!.calls, 0, `${threads} threads: a tile was read twice`);
      // The experts' job is timed in wall and in the calling thread's CPU time (all of the work on one thread).
      const job = prefill['moe experts']!;
      assert.ok(job.seconds > 0 && job.cpuSeconds >= 0 && job.cpuSeconds <= job.seconds + 1e-3, JSON.stringify(job));
      if (threads === 1) {
        assert.ok(job.cpuSeconds > 0, 'one thread: the caller did the work');
        // Alone, a thread runs each expert's gate+up items before its down items: nothing to wait for, nobody to help.
        assert.equal(prefill['moe expert ready waits']!.calls, 0);
        assert.equal(prefill['moe expert items helped']!.calls, 0);
      }
      assert.equal(prefill['moe expert tiles']!.calls, streamed * tilesPerExpert);
      assert.equal(prefill['moe expert weight bytes']!.calls, streamed * expertBytes,
        'the weight bytes read are the active experts\' bytes, once each');
      // Every (row, expert) pair went through every tile of its expert, in the calls above.
      assert.equal(prefill['moe expert tile rows']!.calls, numLayers * pairs * tilesPerExpert);
      // One decode row: exactly its experts, once each.
      m.forward(step([{ s: A, from: 9 - 1, to: 9 }], 1));
      const decode = m.takeProfile();
      assert.equal(decode['moe experts streamed']!.calls, numLayers * numExpertsUsed);
      assert.equal(decode['moe expert tiles revisited']!.calls, 0);
      assert.equal(decode['moe expert weight bytes']!.calls, numLayers * numExpertsUsed * expertBytes);
      assert.equal(decode['moe expert tile rows']!.calls, numLayers * numExpertsUsed * tilesPerExpert);
      m.dispose();
    }
  });
});
