// One guided row's token: the row's best tokens (greedy) or the sampler's draw checked by the grammar, the grammar's
// mask when it refuses them. The engine samples every guided row through sampleGuidedRow (EngineCore.sampleRows);
// benchmarks/grammar.ts times it against a plain sampler pass.

import { argmax, GREEDY_TEMPERATURE, UnsampleableRowError, type SampledToken, type Sampler, type SequenceSampler } from '../sampler.ts';
import type { TokenLogprob } from '../types.ts';
import type { GuidedSequence } from './runtime.ts';
import { GrammarError } from './xgrammar.ts';

/**
 * Whether a guided row may be drawn from unmasked first, the mask computed only when the grammar refuses the draw.
 * Exact where masking commutes with the draw: greedy (the argmax of the whole row, if allowed, is the masked
 * argmax) and plain sampling without truncation (a draw x from p kept when allowed, else a draw from p masked, has
 * probability p(x) + (1 - Z) p(x) / Z = p(x) / Z, Z the allowed mass: the masked distribution; with d draws tried
 * before the mask, sum over k < d of (1 - Z)^k p(x), plus (1 - Z)^d p(x) / Z, is p(x) / Z too). Not with
 * top-k/top-p/min-p (truncating before the mask keeps other tokens); a top_k of the vocabulary's size or more
 * truncates nothing. Logprobs play no part: they are read from a masked copy of the row apart from the choice
 * (sampleGuidedRow), without a uniform, so a request gets the same tokens with them as without.
 * A model that follows the grammar then costs one advance per token instead of a mask.
 */
export function guidedDrawFirst(sequence: SequenceSampler): boolean {
  const { params } = sequence;
  if (params.temperature < GREEDY_TEMPERATURE) return true;
  return params.topP >= 1 && (params.topK <= 0 || params.topK >= sequence.vocabSize) && params.minP === 0;
}

/** A greedy row the sampler reads as it is (no penalties, bias or min_tokens). */
function greedyUnprocessed(sequence: SequenceSampler): boolean {
  return sequence.params.temperature < GREEDY_TEMPERATURE && !sequence.hasLogitProcessors;
}

/**
 * Candidates a guided row tries before the mask (a greedy row its best tokens, best first; a sampled row its draws):
 * WIDE_CANDIDATES after a token the grammar took without a mask (the model is writing where the grammar allows much:
 * inside a string, the dearest masks, whose masked argmax is nearly always among the row's few best),
 * NARROW_CANDIDATES after a mask (between JSON elements the grammar allows a few dozen tokens, the masked argmax is
 * far down the row, and a refused try costs about 2 µs against a mask of tens of µs). Either way the token is the
 * masked argmax, or a draw from the masked row; the width only moves the cost.
 */
export const WIDE_CANDIDATES = 16;
export const NARROW_CANDIDATES = 2;
/** A sampled row goes back to trying draws after a mask that allows at least 1/WIDE_STATE_SHARE of the vocabulary. */
export const WIDE_STATE_SHARE = 16;

const candidateIds = new Int32Array(WIDE_CANDIDATES);
const candidateValues = new Float32Array(WIDE_CANDIDATES);

/**
 * The `k` best tokens of `row` into ids[0, count), best first (higher value, then lower id: the order of the argmax's
 * ties), -Infinity left out; returns count (< k when fewer tokens are finite). One pass: four values per iteration
 * checked against the worst kept value at once, and only a better one inserted (insertCandidate), so the loop keeps
 * its variables in registers. A NaN throws the UnsampleableRowError the sampler's argmax throws.
 */
export function topCandidates(row: Float32Array, k: number, ids: Int32Array, values: Float32Array): number {
  const n = row.length;
  let count = 0;
  let floor = -Infinity; // the worst kept value once k are kept: only a greater one gets in
  let i = 0;
  for (; i + 3 < n; i += 4) {
    const v0 = row[i]!, v1 = row[i + 1]!, v2 = row[i + 2]!, v3 = row[i + 3]!;
    // A NaN fails `<=` and is caught in insertCandidate.
    if (!(v0 <= floor) || !(v1 <= floor) || !(v2 <= floor) || !(v3 <= floor)) {
      if (!(v0 <= floor)) { count = insertCandidate(ids, values, count, k, i, v0); if (count === k) floor = values[k - 1]!; }
      if (!(v1 <= floor)) { count = insertCandidate(ids, values, count, k, i + 1, v1); if (count === k) floor = values[k - 1]!; }
      if (!(v2 <= floor)) { count = insertCandidate(ids, values, count, k, i + 2, v2); if (count === k) floor = values[k - 1]!; }
      if (!(v3 <= floor)) { count = insertCandidate(ids, values, count, k, i + 3, v3); if (count === k) floor = values[k - 1]!; }
    }
  }
  for (; i < n; i++) {
    const value = row[i]!;
    if (!(value <= floor)) { count = insertCandidate(ids, values, count, k, i, value); if (count === k) floor = values[k - 1]!; }
  }
  return count;
}

/** Inserts token `id` into the kept ids[0, count) (the worst dropped when k are kept); returns the new count. */
function insertCandidate(ids: Int32Array, values: Float32Array, count: number, k: number, id: number, value: number): number {
  if (value !== value) throw new UnsampleableRowError('nan', `logits row holds NaN at token id ${id}`);
  if (value === -Infinity) return count;
  // Behind every kept value >= value: an equal one has a lower id (ids arrive in increasing order).
  let at = count < k ? count++ : k - 1;
  while (at > 0 && values[at - 1]! < value) {
    values[at] = values[at - 1]!;
    ids[at] = ids[at - 1]!;
    at--;
  }
  values[at] = value;
  ids[at] = id;
  return count;
}

/**
 * The greedy token of a guided row the sampler would read as it is (greedyUnprocessed), the grammar advanced with
 * it; -1 (nothing advanced) when no allowed token has a finite value. The row's best few tokens (guided's candidate
 * width) are tried best first: the first the grammar takes is the masked argmax, since every token ranked before it
 * was refused (a refused token leaves the matcher as it was). Only when all are refused is the mask computed, and
 * the argmax of the allowed tokens read from it (GuidedSequence.maskedArgmax). After a token that was its row's
 * argmax (guided.argmaxTaken: a model writing the format, where that is the rule), the row's argmax is tried alone
 * first, by rowArgmax (the sampler's: the backend's pass where it has one; cheaper than the candidates' pass), and
 * the candidates' pass is made only if it is refused. The row is not written.
 */
export function greedyGuidedToken(values: Float32Array, guided: GuidedSequence,
  rowArgmax: (row: Float32Array) => number = argmax): number {
  let first = 0;
  if (guided.argmaxTaken && guided.candidateWidth > 1) {
    const best = rowArgmax(values); // throws on a NaN or a row of -Infinity, as topCandidates does
    if (guided.accept(best)) return best;
    first = 1; // the candidates' pass puts the same token first (ties to the lower id in both)
  }
  const count = topCandidates(values, guided.candidateWidth, candidateIds, candidateValues);
  if (count === 0) throw new UnsampleableRowError('masked', 'every token is masked (-Infinity logits): nothing to sample');
  for (let j = first; j < count; j++) {
    const tokenId = candidateIds[j]!;
    if (guided.accept(tokenId)) {
      guided.candidateWidth = WIDE_CANDIDATES;
      guided.argmaxTaken = j === 0;
      return tokenId;
    }
  }
  guided.candidateWidth = NARROW_CANDIDATES;
  guided.argmaxTaken = false;
  const tokenId = guided.maskedArgmax(values);
  if (tokenId >= 0 && !guided.accept(tokenId)) throw new Error(`the grammar refused token ${tokenId}, which its mask allows`);
  return tokenId;
}

/**
 * A plain sampled row's token (guidedDrawFirst, temperature > 0), the grammar advanced with it; -1 (nothing advanced,
 * no uniform taken after the tries) when the allowed tokens weigh too little for the row's weights (maskedDraw): the
 * caller then masks the row and draws from it. The row is weighed once (Sampler.weighRow; its first draw is the one
 * sampleRow would make), then up to guided's candidate width draws from it are tried, each a fresh uniform and a
 * binary search; the first the grammar takes is the token. When all are refused, one draw from the same weights
 * restricted to the mask's allowed tokens: the masked row's distribution, without writing the mask into the row nor
 * weighing it again. The row is not written.
 */
export function drawGuidedToken(sampler: Sampler, values: Float32Array, sequence: SequenceSampler, guided: GuidedSequence): number {
  const total = sampler.weighRow(values, sequence);
  for (let d = 0; d < guided.candidateWidth; d++) {
    const tokenId = sampler.drawWeighed(total, sequence.nextUniform());
    if (guided.accept(tokenId)) {
      guided.candidateWidth = WIDE_CANDIDATES;
      return tokenId;
    }
  }
  guided.candidateWidth = NARROW_CANDIDATES;
  const tokenId = guided.maskedDraw(sampler.rowWeights, () => sequence.nextUniform());
  if (tokenId >= 0 && !guided.accept(tokenId)) throw new Error(`the grammar refused token ${tokenId}, which its mask allows`);
  return tokenId;
}

/**
 * Samples a guided row whose grammar has not ended, advances the grammar with the token and returns it (recorded
 * in the sequence, as Sampler.sampleRow does). `values` is the step's own logits row: the mask may be written into it.
 *
 * The token does not depend on whether the request asked for logprobs. With logprobs, the row is first copied and
 * masked (Sampler.logprobsRow: the state before the token, as they describe it), the token is then chosen as below
 * from the unmasked row, the copy standing in for the mask where the choice needs one, and the logprobs are read from
 * the copy: those of the masked row, as sampleRow reports them for the row it drew from. No uniform is drawn for them.
 *
 * A greedy row the sampler reads as it is (no penalties, bias or min_tokens) takes greedyGuidedToken: a few
 * candidates tried, the mask only when all are refused. A plain sampled row (no top-k/top-p/min-p) takes
 * drawGuidedToken likewise while its candidate width is wide; after a mask (narrow) it goes to the mask first,
 * since weighing the whole row (an exp per token) for draws the grammar mostly refuses costs more than the masked
 * row's pass, which meets -Infinity nearly everywhere between JSON elements, and it goes back to drawing first once a
 * mask allows at least 1/WIDE_STATE_SHARE of the vocabulary (inside a string). A greedy row with penalties, bias or
 * min_tokens draws from the whole row first and, refused, goes to the mask. Any other row (truncated sampling), and a
 * row whose allowed tokens have no weight in the unmasked row: the masked row and the sampler's pass over it.
 */
export function sampleGuidedRow(sampler: Sampler, values: Float32Array, sequence: SequenceSampler, guided: GuidedSequence,
  eosTokenIds: readonly number[]): SampledToken {
  try {
    const numTop = sequence.params.logprobs;
    if (numTop === null) {
      const chosen = chooseGuidedToken(sampler, values, sequence, guided, eosTokenIds, undefined);
      if (chosen.endedFrom !== undefined) endWith(sequence, guided, chosen.tokenId);
      return { tokenId: chosen.tokenId };
    }
    let allowed = 0;
    const source = sampler.logprobsRow(values, sequence, (row) => { allowed = guided.maskRow(row); });
    // Raw logprobs: the copy is the masked row itself, which the choice takes instead of masking `values` again.
    const chosen = chooseGuidedToken(sampler, values, sequence, guided, eosTokenIds,
      sampler.logprobsMode === 'raw' ? { row: source, allowed } : undefined);
    if (chosen.endedFrom === undefined) return { tokenId: chosen.tokenId, logprobs: sampler.tokenLogprobs(source, chosen.tokenId, numTop) };
    // Ended for want of any token to draw (min_tokens held back the only tokens the grammar allows), with EOS all the
    // same: a token of the output like any other, so it gets its entry too (one per token, as token_ids and usage
    // count them). The processed masked row holds nothing finite; the entry is read from it with min_tokens' hold
    // lifted, as the choice lifted it: for raw logprobs the masked row (`source`), for processed ones the masked row
    // processed without the hold (the request's other processing, and 1/T, still apply). Before the token is recorded,
    // so that the penalties read the output before it, as for any other token. A model whose logits are -Infinity for
    // every token the grammar allows leaves no distribution even so: the entry says the token's logprob is -Infinity.
    const from = sampler.logprobsMode === 'raw' ? source : sampler.logprobsRow(chosen.endedFrom, sequence, () => {}, false);
    let logprobs: TokenLogprob;
    try {
      logprobs = sampler.tokenLogprobs(from, chosen.tokenId, numTop);
    } catch (error) {
      if (!(error instanceof UnsampleableRowError) || error.reason !== 'masked') throw error;
      logprobs = { tokenId: chosen.tokenId, logprob: -Infinity, top: [] };
    }
    endWith(sequence, guided, chosen.tokenId);
    return { tokenId: chosen.tokenId, logprobs };
  } catch (error) {
    // The grammar engine instance failed (here or earlier, under another request): this completion's grammar state is
    // lost, so the request fails alone (the step's other rows go on); the worker's next guided request gets a fresh
    // instance (GrammarRuntime.open).
    if (error instanceof GrammarError) {
      throw new UnsampleableRowError('grammar', `the grammar engine failed, so the output can no longer be constrained (${error.message})`);
    }
    throw error;
  }
}

/** Records the EOS that ends a guided output for want of any token to draw, and advances the grammar with it. */
function endWith(sequence: SequenceSampler, guided: GuidedSequence, tokenId: number): void {
  sequence.recordOutputToken(tokenId);
  guided.accept(tokenId);
}

/**
 * sampleGuidedRow's choice of the token, recorded in the sequence and accepted by the grammar. `masked`, when given,
 * is the row with the grammar's mask already applied and how many tokens the mask allows (maskRow's count): the mask
 * path reads it instead of writing the mask into `values`. endedFrom: nothing could be drawn from the masked row (the
 * grammar allows only an end min_tokens holds back), and the output ends with EOS, the token returned; endedFrom is
 * the masked row (unprocessed) it was taken from, and the token is neither recorded nor accepted yet (endWith, once
 * the caller has read its logprobs).
 */
function chooseGuidedToken(sampler: Sampler, values: Float32Array, sequence: SequenceSampler, guided: GuidedSequence,
  eosTokenIds: readonly number[], masked: { row: Float32Array; allowed: number } | undefined): { tokenId: number; endedFrom?: Float32Array } {
  const drawFirst = guidedDrawFirst(sequence);
  const sampledPlain = drawFirst && sequence.params.temperature >= GREEDY_TEMPERATURE;
  if (sampledPlain && guided.candidateWidth === NARROW_CANDIDATES) {
    // A sampled row after a mask goes to the mask first (below): between JSON elements the weighing pass (an exp
    // per token) would mostly be wasted, while the masked row's pass meets -Infinity nearly everywhere.
  } else if (drawFirst) {
    if (greedyUnprocessed(sequence) || sampledPlain) {
      const tokenId = greedyUnprocessed(sequence) ? greedyGuidedToken(values, guided, sampler.argmax) : drawGuidedToken(sampler, values, sequence, guided);
      if (tokenId >= 0) {
        sequence.recordOutputToken(tokenId);
        return { tokenId };
      }
      // No allowed token has a finite value, or any weight in the unmasked row: the masked row's own pass below.
    } else {
      // Greedy with processing: the argmax of the processed row, if allowed, is the masked one.
      const { tokenId } = sampler.sampleRow(values, sequence, false);
      if (guided.accept(tokenId)) return { tokenId };
      sequence.unrecordOutputToken(tokenId);
    }
  }
  // The grammar's mask first (written into the step's own row unless a masked copy is at hand), then the request's
  // own processing.
  const row = masked?.row ?? values;
  const allowed = masked?.allowed ?? guided.maskRow(values);
  // A sampled row tries draws again once a mask allows a good share of the vocabulary (inside a string).
  if (sampledPlain) guided.candidateWidth = allowed * WIDE_STATE_SHARE >= guided.vocabSize ? WIDE_CANDIDATES : NARROW_CANDIDATES;
  let tokenId: number;
  try {
    tokenId = sampler.sampleRow(row, sequence, false).tokenId;
  } catch (error) {
    // Nothing left: the grammar allows only an end it may not take yet (min_tokens holds EOS back). It ends. A NaN
    // is the model's fault, not the grammar's: the request fails (the caller's).
    if (!(error instanceof UnsampleableRowError) || error.reason !== 'masked') throw error;
    return { tokenId: eosTokenIds.find((id) => row[id] !== -Infinity) ?? eosTokenIds[0] ?? 0, endedFrom: row };
  }
  guided.accept(tokenId);
  return { tokenId };
}
