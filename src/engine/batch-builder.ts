// Turns a step plan into the flat typed arrays of one forward call (ForwardBatch in src/kernels/types.ts).
//
// The arrays are allocated once, at their largest size, and the batch returned is a set of views into them: a
// batch stays valid until the next build(). Build right after schedule(): the views read the sequences' block
// tables, which an abort would empty.
//
// Where the time goes: one pass over the new tokens (token id, position, slot) and one copy of each sequence's
// block ids (a memcpy from the id mirror its BlockTable keeps), the only part that grows with context length.

import type { ForwardBatch } from '../kernels/types.ts';
import type { Scheduler, StepPlan } from './scheduler.ts';

export interface BatchBuilderOptions {
  blockSize: number;
  maxNumBatchedTokens: number;
  maxNumSeqs: number;
  /** Longest sequence; sets maxBlocksPerSeq, the row width of blockTables. */
  maxModelLen: number;
  /** Logits rows a step may return for prompt logprobs, beyond its sampled rows (default 0). */
  maxPromptLogprobRows?: number;
}

export class BatchBuilder {
  readonly blockSize: number;
  readonly maxBlocksPerSeq: number;
  private readonly tokenIds: Int32Array;
  private readonly positions: Int32Array;
  private readonly slotMapping: Int32Array;
  private readonly queryStartLoc: Int32Array;
  private readonly seqLens: Int32Array;
  private readonly blockTables: Int32Array;
  private readonly logitsIndices: Int32Array;
  private readonly loraSlots: Int32Array;

  constructor(options: BatchBuilderOptions) {
    for (const key of ['blockSize', 'maxNumBatchedTokens', 'maxNumSeqs', 'maxModelLen'] as const) {
      if (!Number.isSafeInteger(options[key]) || options[key] < 1) throw new RangeError(`${key} must be a positive integer, got ${options[key]}`);
    }
    this.blockSize = options.blockSize;
    this.maxBlocksPerSeq = Math.ceil(options.maxModelLen / options.blockSize);
    this.tokenIds = new Int32Array(options.maxNumBatchedTokens);
    this.positions = new Int32Array(options.maxNumBatchedTokens);
    this.slotMapping = new Int32Array(options.maxNumBatchedTokens);
    this.queryStartLoc = new Int32Array(options.maxNumSeqs + 1);
    this.seqLens = new Int32Array(options.maxNumSeqs);
    this.blockTables = new Int32Array(options.maxNumSeqs * this.maxBlocksPerSeq);
    // A request forking into n samples reads its last row n times, but holds n seats, so sampled rows <= maxNumSeqs.
    this.logitsIndices = new Int32Array(options.maxNumSeqs + (options.maxPromptLogprobRows ?? 0));
    this.loraSlots = new Int32Array(options.maxNumBatchedTokens);
  }

  /** Bytes of the arrays it fills every step (allocated once, sized for the largest step). */
  get bytes(): number {
    return [this.tokenIds, this.positions, this.slotMapping, this.queryStartLoc, this.seqLens, this.blockTables,
      this.logitsIndices, this.loraSlots].reduce((sum, array) => sum + array.byteLength, 0);
  }

  /** Sized for everything the scheduler can plan. */
  static forScheduler(scheduler: Scheduler): BatchBuilder {
    return new BatchBuilder({
      blockSize: scheduler.kv.blockSize, maxNumBatchedTokens: scheduler.maxNumBatchedTokens,
      maxNumSeqs: scheduler.maxNumSeqs, maxModelLen: scheduler.maxModelLen, maxPromptLogprobRows: scheduler.maxPromptLogprobRows,
    });
  }

  /**
   * loraSlot: the backend's LoRA slot of a request's adapter (Request.adapterId), -1 for none; the batch carries
   * loraSlots only when some row has an adapter.
   */
  build(plan: StepPlan, loraSlot?: (adapterId: string) => number): ForwardBatch {
    const { blockSize, maxBlocksPerSeq, tokenIds, positions, slotMapping, queryStartLoc, seqLens, blockTables, logitsIndices } = this;
    const numSeqs = plan.scheduled.length;
    if (numSeqs > seqLens.length) throw new RangeError(`plan has ${numSeqs} sequences; the builder holds ${seqLens.length}`);
    if (plan.numScheduledTokens > tokenIds.length) {
      throw new RangeError(`plan has ${plan.numScheduledTokens} tokens; the builder holds ${tokenIds.length}`);
    }
    const numRows = plan.sampleTargets.length + plan.numPromptLogprobRows;
    if (numRows > logitsIndices.length) {
      throw new RangeError(`plan wants ${numRows} logits rows; the builder holds ${logitsIndices.length}`);
    }
    let row = 0;
    let numLogits = 0;
    // Prompt-logprob rows go after every sampled row, so the sampled ones keep plan.sampleTargets' order.
    let promptRow = plan.sampleTargets.length;
    let anyLora = false;
    queryStartLoc[0] = 0;
    for (let s = 0; s < numSeqs; s++) {
      const { sequence, startPosition, numNewTokens, numSamples, numPromptLogprobRows } = plan.scheduled[s]!;
      const sequenceTokens = sequence.tokenIds;
      const table = sequence.blockTable;
      const seqLen = startPosition + numNewTokens;
      const numBlocks = Math.ceil(seqLen / blockSize);
      if (numBlocks > table.blocks.length) {
        throw new Error(`sequence ${sequence.request.id}/${sequence.index} needs ${numBlocks} blocks for ${seqLen} tokens `
          + `but holds ${table.blocks.length} (was it aborted after scheduling?)`);
      }
      if (numBlocks > maxBlocksPerSeq) throw new RangeError(`sequence ${sequence.request.id}/${sequence.index} needs ${numBlocks} blocks; rows hold ${maxBlocksPerSeq}`);

      const ids = table.blockIdArray(numBlocks);
      const adapterId = sequence.request.adapterId;
      const slot = adapterId !== undefined && loraSlot ? loraSlot(adapterId) : -1;
      if (slot >= 0) anyLora = true;
      this.loraSlots.fill(slot, row, row + (seqLen - startPosition));
      for (let k = 0; k < numPromptLogprobRows; k++) logitsIndices[promptRow++] = row + k;
      for (let position = startPosition; position < seqLen; position++, row++) {
        const blockIndex = Math.floor(position / blockSize);
        tokenIds[row] = sequenceTokens[position]!;
        positions[row] = position;
        slotMapping[row] = ids[blockIndex]! * blockSize + (position - blockIndex * blockSize);
      }
      seqLens[s] = seqLen;
      blockTables.set(ids, s * maxBlocksPerSeq);
      queryStartLoc[s + 1] = row;
      for (let k = 0; k < numSamples; k++) logitsIndices[numLogits++] = row - 1;
    }
    return {
      numTokens: row,
      tokenIds: tokenIds.subarray(0, row),
      positions: positions.subarray(0, row),
      slotMapping: slotMapping.subarray(0, row),
      numSeqs,
      queryStartLoc: queryStartLoc.subarray(0, numSeqs + 1),
      seqLens: seqLens.subarray(0, numSeqs),
      blockTables: blockTables.subarray(0, numSeqs * maxBlocksPerSeq),
      maxBlocksPerSeq,
      logitsIndices: logitsIndices.subarray(0, promptRow),
      ...(anyLora ? { loraSlots: this.loraSlots.subarray(0, row) } : {}),
    };
  }
}
