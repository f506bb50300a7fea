// One guided row's token: the sampler's draw checked by the grammar, the grammar's mask when it refuses. The engine
// samples every guided row through sampleGuidedRow (EngineCore.sampleRows); benchmarks/grammar.ts times it against
// a plain sampler pass.

import { GREEDY_TEMPERATURE, type SampledToken, type Sampler, type SequenceSampler } from '../sampler.ts';
import type { GuidedSequence } from './runtime.ts';

/** Most sampled (not greedy) guided tokens drawn straight from the masked row after repeated refusals. */
export const MAX_SKIPPED_DRAWS = 7;

/**
 * Whether a guided row may be drawn from unmasked first, the mask computed only when the grammar refuses the draw.
 * Exact where masking commutes with the draw: greedy (the argmax of the whole row, if allowed, is the masked
 * argmax) and plain sampling without truncation (a draw x from p kept when allowed, else a draw from p masked, has
 * probability p(x) + (1 - Z) p(x) / Z = p(x) / Z, Z the allowed mass: the masked distribution). Not with
 * top-k/top-p/min-p (truncating before the mask keeps other tokens) nor logprobs (they describe the masked row).
 * A model that follows the grammar then costs one advance per token instead of a mask. Skipping the draw (after
 * repeated refusals) is exact too: the masked row is what either path draws from.
 */
export function guidedDrawFirst(sequence: SequenceSampler): boolean {
  const { params } = sequence;
  if (params.logprobs !== null) return false;
  if (params.temperature < GREEDY_TEMPERATURE) return true;
  return params.topP >= 1 && params.topK <= 0 && params.minP === 0;
}

/** A greedy row the sampler reads as it is (no penalties, bias or min_tokens), without logprobs. */
function greedyUnprocessed(sequence: SequenceSampler): boolean {
  const { params } = sequence;
  return params.temperature < GREEDY_TEMPERATURE && params.logprobs === null && !sequence.hasLogitProcessors;
}

/**
 * Samples a guided row whose grammar has not ended, advances the grammar with the token and returns it (recorded
 * in the sequence, as Sampler.sampleRow does). `values` is the step's own logits row: the mask is written into it.
 *
 * Draw first (guidedDrawFirst), else or when refused the mask. A sampled row that keeps being refused stops
 * drawing first for a while: after k refusals in a row the next k - 1 tokens (at most MAX_SKIPPED_DRAWS) go
 * straight to the mask, since each refused draw wastes a sampler pass (exp over the vocabulary) and a random draw.
 * A greedy row always draws first: its draw takes no randomness, so drawing or not never changes its output, a
 * refused draw costs one argmax pass, and skipping it would pay for masks where the draw is mostly taken (inside a
 * string, whose masks are the dearest: milliseconds for a bounded length). A refused greedy row whose values the
 * sampler takes as they are gets the argmax of the allowed tokens from the mask (GuidedSequence.maskedArgmax).
 */
export function sampleGuidedRow(sampler: Sampler, values: Float32Array, sequence: SequenceSampler, guided: GuidedSequence,
  eosTokenIds: readonly number[]): SampledToken {
  let sampled: SampledToken | undefined;
  if (guided.skipDraws > 0) {
    guided.skipDraws--;
  } else if (guidedDrawFirst(sequence)) {
    // Drawn from the whole row; if the grammar takes it, that is what a draw from the masked row gives.
    sampled = sampler.sampleRow(values, sequence);
    if (guided.accept(sampled.tokenId)) {
      guided.refusedRun = 0;
      return sampled;
    }
    sequence.unrecordOutputToken(sampled.tokenId);
    if (sequence.params.temperature >= GREEDY_TEMPERATURE) {
      guided.refusedRun++;
      guided.skipDraws = Math.min(guided.refusedRun - 1, MAX_SKIPPED_DRAWS);
    }
  }
  if (sampled !== undefined && greedyUnprocessed(sequence)) {
    // The row's argmax among the allowed tokens, read straight from the mask: what the masked row's pass would
    // give, without writing the mask into the row nor a second pass over it (the first one found no NaN in it).
    const tokenId = guided.maskedArgmax(values);
    if (tokenId >= 0) {
      sequence.recordOutputToken(tokenId);
      guided.accept(tokenId);
      return { tokenId };
    }
  }
  // The grammar's mask first (the logits buffer is the step's own), then the request's own processing.
  guided.maskRow(values);
  try {
    sampled = sampler.sampleRow(values, sequence);
  } catch (error) {
    // Nothing left: the grammar allows only an end it may not take yet (min_tokens holds EOS back). It ends.
    if (!(error instanceof RangeError)) throw error;
    sampled = { tokenId: eosTokenIds.find((id) => values[id] !== -Infinity) ?? eosTokenIds[0] ?? 0 };
    sequence.recordOutputToken(sampled.tokenId);
  }
  guided.accept(sampled.tokenId);
  return sampled;
}
