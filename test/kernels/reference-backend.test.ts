import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { DisposedBackendError, InvalidBatchError, referenceBackend } from '../../src/kernels/reference-backend.ts';
import {
  type ForwardBatch, type KvDtype, kvElementsPerBlockRun, type KvPoolLayout, kvPoolBytes, type ModelRunnerBackend,
} from '../../src/kernels/types.ts';
import type { ModelConfig } from '../../src/model/config.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { ggufModelConfig, ggufModelWeights } from '../../src/model/gguf-model.ts';
import { f32ToF16Bits } from '../../src/model/quant.ts';
import { ReferenceModel } from '../../src/model/reference-forward.ts';
import type { ModelWeights } from '../../src/model/weights.ts';
import { sharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { seededRandom, tinyConfig, tinyWeights } from '../model/reference-tiny-model.ts';

// ---------------------------------------------------------------------------------------------------------------
// A minimal engine: sequences with block tables drawn from a shuffled pool, batches built per step.

interface Sequence {
  tokens: number[];
  numComputed: number;
  blocks: number[];
}

class PagedRun {
  readonly sequences: Sequence[];
  private readonly freeBlocks: number[];

  constructor(readonly backend: ModelRunnerBackend, tokenLists: number[][], seed: number) {
    this.sequences = tokenLists.map((tokens) => ({ tokens, numComputed: 0, blocks: [] }));
    // Blocks handed out in a random order, so no sequence's blocks are contiguous or ascending.
    const random = seededRandom(seed);
    this.freeBlocks = Array.from({ length: backend.kvLayout.numBlocks }, (_, i) => i);
    for (let i = this.freeBlocks.length - 1; i > 0; i--) {
      const j = Math.floor(random() * (i + 1));
      [this.freeBlocks[i], this.freeBlocks[j]] = [this.freeBlocks[j]!, this.freeBlocks[i]!];
    }
  }

  /** The batch computing `numNew` more tokens of each listed sequence; allocates the blocks they need. */
  batch(step: Array<[seq: number, numNew: number]>): ForwardBatch {
    const { blockSize } = this.backend.kvLayout;
    const maxBlocksPerSeq = Math.max(...this.sequences.map((s) => Math.ceil(s.tokens.length / blockSize)));
    const tokenIds: number[] = [], positions: number[] = [], slotMapping: number[] = [];
    const queryStartLoc = [0], seqLens: number[] = [];
    const blockTables = new Int32Array(step.length * maxBlocksPerSeq).fill(-1);
    step.forEach(([index, numNew], s) => {
      const seq = this.sequences[index]!;
      const seqLen = seq.numComputed + numNew;
      while (seq.blocks.length * blockSize < seqLen) seq.blocks.push(this.freeBlocks.pop()!);
      for (let p = seq.numComputed; p < seqLen; p++) {
        tokenIds.push(seq.tokens[p]!);
        positions.push(p);
        slotMapping.push(seq.blocks[Math.floor(p / blockSize)]! * blockSize + (p % blockSize));
      }
      queryStartLoc.push(tokenIds.length);
      seqLens.push(seqLen);
      blockTables.set(seq.blocks, s * maxBlocksPerSeq);
    });
    return {
      numTokens: tokenIds.length, tokenIds: Int32Array.from(tokenIds), positions: Int32Array.from(positions),
      slotMapping: Int32Array.from(slotMapping), numSeqs: step.length, queryStartLoc: Int32Array.from(queryStartLoc),
      seqLens: Int32Array.from(seqLens), blockTables, maxBlocksPerSeq,
      logitsIndices: Int32Array.from(tokenIds, (_, i) => i),
    };
  }

  /** Runs the step and returns, per batch row, [sequence index, position, logits]. */
  run(step: Array<[seq: number, numNew: number]>): Array<[number, number, Float32Array]> {
    const batch = this.batch(step);
    const logits = this.backend.forward(batch);
    const vocab = this.backend.config.vocabSize;
    assert.equal(logits.length, batch.numTokens * vocab);
    const rows: Array<[number, number, Float32Array]> = [];
    step.forEach(([index], s) => {
      for (let r = batch.queryStartLoc[s]!; r < batch.queryStartLoc[s + 1]!; r++) {
        rows.push([index, batch.positions[r]!, logits.subarray(r * vocab, (r + 1) * vocab)]);
      }
    });
    for (const [index, numNew] of step) this.sequences[index]!.numComputed += numNew;
    return rows;
  }
}

/** Logits of every position of `tokens` from the contiguous reference model, one array per position. */
function contiguousLogits(model: ReferenceModel, tokens: number[]): Float32Array[] {
  model.reset();
  const all = model.forward(tokens, 0, { allLogits: true });
  const vocab = model.config.vocabSize;
  return tokens.map((_, p) => all.subarray(p * vocab, (p + 1) * vocab));
}

function assertRelativelyClose(actual: Float32Array, expected: Float32Array, tolerance: number, what: string): void {
  let scale = 0;
  for (const v of expected) scale = Math.max(scale, Math.abs(v));
  let worst = 0;
  for (let i = 0; i < expected.length; i++) worst = Math.max(worst, Math.abs(actual[i]! - expected[i]!));
  assert.ok(worst <= tolerance * scale, `${what}: largest difference ${worst} against logits up to ${scale}`);
}

function randomTokens(count: number, vocabSize: number, random: () => number): number[] {
  return Array.from({ length: count }, () => Math.floor(random() * vocabSize));
}

// Prefill chunks of several sizes, sequences joining and leaving batches, then decode steps together.
const LENGTHS = [15, 10, 24];
const STEPS: Array<Array<[number, number]>> = [
  [[0, 5], [1, 7], [2, 3]],
  [[0, 8], [1, 1], [2, 1]],
  [[2, 17], [0, 1]],
  [[1, 1], [0, 1], [2, 1]],
  [[0, 0], [2, 1], [1, 1]],
  [[2, 1]],
];

function checkAgainstContiguous(config: ModelConfig, weights: ModelWeights, blockSize: number, dtype: KvDtype,
  tolerance: number, seed: number): void {
  const random = seededRandom(seed);
  const tokenLists = LENGTHS.map((n) => randomTokens(n, config.vocabSize, random));
  const model = new ReferenceModel(config, weights);
  const expected = tokenLists.map((tokens) => contiguousLogits(model, tokens));
  const numBlocks = 4 + LENGTHS.reduce((sum, n) => sum + Math.ceil(n / blockSize), 0);
  const backend = referenceBackend.load(config, weights, { numBlocks, blockSize, dtype });
  const run = new PagedRun(backend, tokenLists, seed + 1);
  let checked = 0;
  for (const step of STEPS) {
    for (const [seq, position, logits] of run.run(step)) {
      assertRelativelyClose(logits, expected[seq]![position]!, tolerance,
        `block size ${blockSize}, ${dtype}: sequence ${seq} position ${position}`);
      checked++;
    }
  }
  assert.equal(checked, LENGTHS.reduce((a, b) => a + b, 0), 'every position was computed once');
  backend.dispose();
}

// ---------------------------------------------------------------------------------------------------------------
// Tests

const TINY = tinyConfig({
  architecture: 'qwen2', qkvBias: true, ropeStyle: 'neox', numLayers: 2, headDim: 8, ropeDim: 4, numHeads: 4,
  numKvHeads: 2, dim: 24, vocabSize: 29,
});

describe('reference backend over the paged pool equals the contiguous ReferenceModel', () => {
  for (const blockSize of [4, 16, 1]) {
    it(`tiny qwen2-style model (bias, GQA, partial neox RoPE), block size ${blockSize}`, () => {
      checkAgainstContiguous(TINY, tinyWeights(TINY, 11), blockSize, 'f32', 1e-5, 100 + blockSize);
    });
  }

  it('stories260K, block size 4', { skip: skipUnlessShared('stories260K.gguf') }, () => {
    const file = readGguf(sharedModel('stories260K.gguf')!);
    const config = ggufModelConfig(file, 'stories260K.gguf');
    checkAgainstContiguous(config, ggufModelWeights(file, config), 4, 'f32', 1e-5, 7);
  });

  it('f16 pool: stores K and V rounded to f16 and stays close to the f32 logits', () => {
    const weights = tinyWeights(TINY, 12);
    checkAgainstContiguous(TINY, weights, 4, 'f16', 1e-2, 5);

    // Layer 0's K and V do not depend on the cache, so the f16 pool must hold exactly the f16 of the f32 pool.
    const tokens = [3, 1, 4, 1, 5, 9, 2];
    const layout = { numBlocks: 3, blockSize: 4 };
    const f32 = referenceBackend.load(TINY, weights, { ...layout, dtype: 'f32' });
    const f16 = referenceBackend.load(TINY, weights, { ...layout, dtype: 'f16' });
    for (const backend of [f32, f16]) new PagedRun(backend, [tokens], 3).run([[0, tokens.length]]);
    const layer0 = 2 * kvElementsPerBlockRun(f32.kvLayout) * layout.numBlocks;
    const f32Values = new Float32Array(f32.kvPool, 0, layer0);
    const f16Bits = new Uint16Array(f16.kvPool, 0, layer0);
    assert.equal(f16.kvPool.byteLength, f32.kvPool.byteLength / 2);
    let nonzero = 0;
    for (let i = 0; i < layer0; i++) {
      assert.equal(f16Bits[i], f32ToF16Bits(f32Values[i]!), `element ${i}`);
      if (f32Values[i] !== 0) nonzero++;
    }
    assert.equal(nonzero, 2 * tokens.length * TINY.numKvHeads * TINY.headDim, 'every token wrote K and V');
  });

  it('follows the documented pool layout: blocks copied to other block ids of another pool keep working', () => {
    const weights = tinyWeights(TINY, 13);
    const tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14];
    const blockSize = 4;
    const source = referenceBackend.load(TINY, weights, { numBlocks: 6, blockSize, dtype: 'f32' });
    const target = referenceBackend.load(TINY, weights, { numBlocks: 6, blockSize, dtype: 'f32' });
    const sourceBlocks = [4, 1, 5];
    const targetBlocks = [2, 0, 3];
    const slot = (blocks: number[], p: number): number => blocks[Math.floor(p / blockSize)]! * blockSize + (p % blockSize);
    const batch = (blocks: number[], from: number, to: number): ForwardBatch => ({
      numTokens: to - from,
      tokenIds: Int32Array.from(tokens.slice(from, to)),
      positions: Int32Array.from({ length: to - from }, (_, i) => from + i),
      slotMapping: Int32Array.from({ length: to - from }, (_, i) => slot(blocks, from + i)),
      numSeqs: 1, queryStartLoc: Int32Array.of(0, to - from), seqLens: Int32Array.of(to),
      blockTables: Int32Array.from(blocks), maxBlocksPerSeq: blocks.length, logitsIndices: Int32Array.of(to - from - 1),
    });
    source.forward(batch(sourceBlocks, 0, 9));

    // A KV transfer: per layer, K then V, one contiguous run per block (types.ts).
    const run = kvElementsPerBlockRun(source.kvLayout);
    const from = new Float32Array(source.kvPool);
    const to = new Float32Array(target.kvPool);
    for (let layer = 0; layer < TINY.numLayers; layer++) {
      for (const kv of [0, 1]) {
        sourceBlocks.forEach((block, i) => {
          const at = (layer * 2 + kv) * source.kvLayout.numBlocks;
          to.set(from.subarray((at + block) * run, (at + block + 1) * run), (at + targetBlocks[i]!) * run);
        });
      }
    }
    const decoded = target.forward(batch(targetBlocks, 9, 10));
    const model = new ReferenceModel(TINY, weights);
    assertRelativelyClose(decoded, model.forward(tokens, 0), 1e-5, 'decode after transfer');
  });
});

describe('reference backend contract', () => {
  const weights = tinyWeights(TINY, 14);
  const load = (): ModelRunnerBackend => referenceBackend.load(TINY, weights, { numBlocks: 8, blockSize: 4, dtype: 'f32' });

  it('describes itself and sizes the pool from the layout', () => {
    assert.equal(referenceBackend.name, 'reference');
    assert.equal(referenceBackend.available(), true);
    const backend = load();
    assert.equal(backend.info.name, 'reference');
    const expectedLayout: KvPoolLayout = {
      numLayers: 2, numBlocks: 8, blockSize: 4, numKvHeads: 2, headDim: 8, dtype: 'f32',
    };
    assert.deepEqual(backend.kvLayout, expectedLayout);
    assert.ok(backend.kvPool instanceof SharedArrayBuffer);
    assert.equal(backend.kvPool.byteLength, kvPoolBytes(expectedLayout));
    assert.equal(backend.kvPool.byteLength, 2 * 2 * 8 * 4 * 2 * 8 * 4);
  });

  it('returns logits only for logitsIndices, in their order', () => {
    const backend = load();
    const run = new PagedRun(backend, [[1, 2, 3, 4, 5]], 1);
    const batch = run.batch([[0, 5]]);
    const all = backend.forward(batch);
    const picked = load().forward({ ...batch, logitsIndices: Int32Array.of(4, 0) });
    const vocab = TINY.vocabSize;
    assert.equal(picked.length, 2 * vocab);
    assert.deepEqual(picked.subarray(0, vocab), all.subarray(4 * vocab, 5 * vocab));
    assert.deepEqual(picked.subarray(vocab), all.subarray(0, vocab));
  });

  it('rejects malformed batches naming the problem', () => {
    const backend = load();
    const good = new PagedRun(backend, [[1, 2, 3, 4, 5, 6]], 2).batch([[0, 6]]);
    const broken = (change: Partial<ForwardBatch>, pattern: RegExp): void => {
      assert.throws(() => backend.forward({ ...good, ...change }),
        (e: unknown) => e instanceof InvalidBatchError && pattern.test(e.message));
    };
    const slots = good.slotMapping.slice();
    slots[2] = slots[2]! + 1;
    broken({ slotMapping: slots }, /row 2 .* maps to slot \d+, its block table says \d+/);
    broken({ positions: Int32Array.of(0, 1, 2, 3, 4, 6) }, /row 5 .* has position 6, its place in the sequence is 5/);
    broken({ seqLens: Int32Array.of(5) }, /6 new tokens but seqLen 5/);
    broken({ queryStartLoc: Int32Array.of(0, 5) }, /must equal numTokens 6/);
    broken({ blockTables: Int32Array.of(good.blockTables[0]!, 99) }, /block table entry 1 is 99/);
    broken({ maxBlocksPerSeq: 1, blockTables: good.blockTables.subarray(0, 1) }, /needs 2 blocks, maxBlocksPerSeq is 1/);
    assert.throws(() => backend.forward({ ...good, logitsIndices: Int32Array.of(6) }), /logits wanted for row 6/);
    assert.throws(() => backend.forward({ ...good, tokenIds: Int32Array.of(1, 2, 3, 4, 5, 29) }),
      /token id 29 is outside the vocabulary/);
  });

  it('refuses to run after dispose and rejects a bad pool layout', () => {
    const backend = load();
    backend.dispose();
    const batch = new PagedRun(load(), [[1]], 3).batch([[0, 1]]);
    assert.throws(() => backend.forward(batch), DisposedBackendError);
    assert.throws(() => referenceBackend.load(TINY, weights, { numBlocks: 0, blockSize: 4, dtype: 'f32' }),
      /numBlocks must be a positive integer, got 0/);
  });
});
