// Mixture-of-experts layers on the native kernels: for every quant type of the dense path (Q8_0, Q4_0, Q4_K, Q6_K)
// and every kernel variant this CPU runs, the logits of a batch match the reference backend's within the kernels'
// rounding bounds, and a sequence's logits are the same bits alone as in a batch with others (its rows meet other
// sequences' rows in the experts' grouped matmuls).
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
import { MOE_KERNEL_MODEL, writeArchGguf } from '../model/arch-models.ts';
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
