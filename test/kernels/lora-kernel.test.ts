// The native batched LoRA kernel (native/lora.cc) against the TypeScript reference (src/model/lora.ts): one forward
// step of three sequences (base, adapter a, adapter b) gives the reference's logits, every row of a mixed batch is
// bit-identical to the same row computed alone (batch invariance), and slots that name no adapter are refused.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { nativeBackend } from '../../src/kernels/native.ts';
import { referenceBackend } from '../../src/kernels/reference-backend.ts';
import type { BackendFactory, ForwardBatch, ModelRunnerBackend } from '../../src/kernels/types.ts';
import { loadModel } from '../../src/model/loader.ts';
import { loadLoraAdapter } from '../../src/model/lora.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../../src/model/lora-writer.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { assertClose, skipNative } from './native-harness.ts';

const BLOCK = 16;

/** A prefill step of the given sequences, sequence s in blocks s*4 .. s*4+3, rows tagged with their LoRA slot. */
function prefillBatch(prompts: number[][], slots: number[]): ForwardBatch {
  const numTokens = prompts.reduce((n, p) => n + p.length, 0);
  const tokenIds = new Int32Array(numTokens), positions = new Int32Array(numTokens), slotMapping = new Int32Array(numTokens);
  const loraSlots = new Int32Array(numTokens);
  const queryStartLoc = new Int32Array(prompts.length + 1), seqLens = new Int32Array(prompts.length);
  const blockTables = new Int32Array(prompts.length * 4), logitsIndices = new Int32Array(prompts.length);
  let row = 0;
  prompts.forEach((prompt, s) => {
    for (let b = 0; b < 4; b++) blockTables[s * 4 + b] = s * 4 + b;
    prompt.forEach((token, p) => {
      tokenIds[row] = token; positions[row] = p; slotMapping[row] = (s * 4 + Math.floor(p / BLOCK)) * BLOCK + (p % BLOCK);
      loraSlots[row] = slots[s]!; row++;
    });
    queryStartLoc[s + 1] = row; seqLens[s] = prompt.length; logitsIndices[s] = row - 1;
  });
  return { numTokens, tokenIds, positions, slotMapping, numSeqs: prompts.length, queryStartLoc, seqLens, blockTables,
    maxBlocksPerSeq: 4, logitsIndices, loraSlots };
}

describe('native LoRA kernel', { skip: skipNative }, () => {
  it('matches the reference on a mixed batch and is batch invariant', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-lora-kernel-'));
    try {
      const path = join(dir, 'model.gguf');
      writeSyntheticModel({ name: 'k', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 128,
        dtype: 'F32', seed: 9, tokenizer: LLAMA_SPM_TOKENIZER_PATH }, path);
      const { config, weights } = await loadModel(path);
      const adapters = [0, 1].map((i) => {
        const file = join(dir, `${i}.gguf`);
        writeGgufLoraAdapter(file, config, randomLoraAdapter(config, { rank: 4 + i * 3, seed: 40 + i, bScale: 1 }));
        return loadLoraAdapter(file, config).weights;
      });
      const load = (factory: BackendFactory, threads: number): ModelRunnerBackend => {
        const backend = factory.load(config, weights, { numBlocks: 16, blockSize: BLOCK, dtype: 'f32' }, { threads });
        adapters.forEach((a, slot) => backend.setLora!(slot, a));
        return backend;
      };
      const prompts = [[1, 450, 4996, 17354, 1701], [1, 9038, 2501, 263, 931, 727, 471], [1, 29871, 13, 450]];
      const slots = [-1, 0, 1];
      const batch = prefillBatch(prompts, slots);
      const native = load(nativeBackend, 2);
      const mixed = native.forward(batch).slice();
      const reference = load(referenceBackend, 1).forward(batch);
      assertClose(mixed, reference, 1e-6, 'native vs reference logits with LoRA');
      const vocab = config.vocabSize;
      for (let s = 0; s < prompts.length; s++) {
        const alone = load(nativeBackend, 1).forward(prefillBatch([prompts[s]!], [slots[s]!]));
        assert.deepEqual(alone, mixed.subarray(s * vocab, (s + 1) * vocab), `row of sequence ${s} changed with its neighbours`);
      }
      const base = load(nativeBackend, 1).forward({ ...prefillBatch([prompts[1]!], [-1]), loraSlots: undefined });
      assert.notDeepEqual(base, mixed.subarray(vocab, 2 * vocab), 'the adapter changed nothing');
      assert.throws(() => native.forward(prefillBatch([prompts[0]!], [5])), /loraSlots\[0\] = 5 names no loaded LoRA adapter/);
      native.setLora!(1, null);
      assert.throws(() => native.forward(batch), /names no loaded LoRA adapter/);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
