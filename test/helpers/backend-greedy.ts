// Greedy generation straight on a compute backend (no engine): every prompt is one sequence of one batch, prefilled
// in one step, then one decode step per new token with all sequences together. Each sequence owns a run of blocks.
import { argmax } from '../../src/model/reference-math.ts';
import type { ForwardBatch, ModelRunnerBackend } from '../../src/kernels/types.ts';

/** The tokens generated after each prompt, `newTokens` each (no stop tokens), with the last step's logits. */
export function greedyOnBackend(backend: ModelRunnerBackend, prompts: readonly number[][], newTokens: number,
  firstBlock = 0): number[][] {
  const { blockSize } = backend.kvLayout;
  const vocab = backend.config.vocabSize;
  const maxLen = Math.max(...prompts.map((p) => p.length)) + newTokens;
  const maxBlocksPerSeq = Math.ceil(maxLen / blockSize);
  if (firstBlock + prompts.length * maxBlocksPerSeq > backend.kvLayout.numBlocks) {
    throw new Error(`the KV pool has ${backend.kvLayout.numBlocks} blocks, ${prompts.length * maxBlocksPerSeq} needed`);
  }
  const blockTables = new Int32Array(prompts.length * maxBlocksPerSeq);
  for (let s = 0; s < prompts.length; s++) {
    for (let b = 0; b < maxBlocksPerSeq; b++) blockTables[s * maxBlocksPerSeq + b] = firstBlock + s * maxBlocksPerSeq + b;
  }
  const seqs = prompts.map((p) => ({ tokens: [...p], computed: 0 }));
  const generated: number[][] = prompts.map(() => []);
  for (let step = 0; step < newTokens; step++) {
    const rows: { s: number; position: number; token: number }[] = [];
    const queryStartLoc = new Int32Array(seqs.length + 1);
    seqs.forEach((seq, s) => {
      for (let p = seq.computed; p < seq.tokens.length; p++) rows.push({ s, position: p, token: seq.tokens[p]! });
      queryStartLoc[s + 1] = rows.length;
    });
    const batch: ForwardBatch = {
      numTokens: rows.length,
      tokenIds: Int32Array.from(rows, (r) => r.token),
      positions: Int32Array.from(rows, (r) => r.position),
      slotMapping: Int32Array.from(rows, (r) =>
        blockTables[r.s * maxBlocksPerSeq + Math.floor(r.position / blockSize)]! * blockSize + (r.position % blockSize)),
      numSeqs: seqs.length,
      queryStartLoc,
      seqLens: Int32Array.from(seqs, (seq) => seq.tokens.length),
      blockTables,
      maxBlocksPerSeq,
      logitsIndices: Int32Array.from(seqs, (_, s) => queryStartLoc[s + 1]! - 1),
    };
    const logits = backend.forward(batch);
    seqs.forEach((seq, s) => {
      const token = argmax(logits, s * vocab, vocab);
      seq.computed = seq.tokens.length;
      seq.tokens.push(token);
      generated[s]!.push(token);
    });
  }
  return generated;
}
