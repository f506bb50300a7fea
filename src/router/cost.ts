// The kv policy's cost of sending one request to one worker, and the choice among workers by cost.
//
//   cost = overlapWeight * prefillBlocks + decodeBlocks
//   prefillBlocks = (prompt tokens the worker must compute + prefill already queued on it) / blockSize
//   decodeBlocks  = blocks its running requests hold + the new blocks this request adds
//
// The prefill term is what the request waits for before its first token (TTFT); the decode term is how crowded
// the worker's batch is, which sets every running request's time between tokens (ITL). A cache hit lowers the
// prefill term, so overlapWeight trades TTFT (high: chase cache hits) against ITL (low: spread the load); at 0 the
// router ignores the cache.
//
// A block a worker holds only in a lower tier (RAM, disk: kv-cache/tiers.ts) is neither free nor full price: it is
// copied back rather than computed, so it counts as lowerTierWeight.ram (or .disk) of a block to compute. Primary
// hits therefore always beat lower-tier hits of the same depth, and a lower-tier hit beats a cold worker.
//
// A prefix counts once. Requests sharing a prefix on one worker share its KV blocks, so a request adds only the
// blocks past those its worker's active requests already hold. Likewise, when another request on the worker is
// computing this request's prefix right now, that queued prefill is not charged again: this request needs the
// prefix computed wherever it goes, and only there is it computed once for both. Without this, a follower in a
// burst of same-prefix requests would see the leader's worker as its own cold start plus the leader's work, and the
// burst would scatter, every worker computing the same prefix.
//
// Load comes from two places that overlap: what the worker last reported and what this router sent it since.
// Adding them would count every request twice once the worker's report includes it, so each term takes the larger
// of the two: the report wins when other routers also feed the worker, the router's own count wins inside a burst.

import type { WorkerCostTerms, WorkerId } from './protocols.ts';
import type { WorkerLoad } from '../protocols/worker.ts';
import type { OwnWorkerLoad } from './active-requests.ts';
import { randomIndex } from '../util/random.ts';
import type { RandomSource } from '../util/random.ts';

export interface RequestShape {
  numPromptTokens: number;
  blockSize: number;
  overlapWeight: number;
  /** Cost of a block a worker holds only in its RAM / disk tier, as a fraction of computing it (default below). */
  lowerTierWeight?: LowerTierWeight;
}

export interface LowerTierWeight {
  ram: number;
  disk: number;
}

/** Copying a block back from RAM costs about a quarter of computing it on a CPU worker, from disk about half. */
export const DEFAULT_LOWER_TIER_WEIGHT: LowerTierWeight = { ram: 0.25, disk: 0.5 };

export interface WorkerView {
  workerId: WorkerId;
  reported: Readonly<WorkerLoad>;
  own: Readonly<OwnWorkerLoad>;
  /** Leading prompt blocks the KV index says it holds. */
  indexedBlocks: number;
  /** Leading prompt blocks it holds by the KV index or a speculative insert (>= indexedBlocks). */
  matchedBlocks: number;
  /** Leading prompt blocks its active requests (routed here, unfinished) already hold. */
  sharedActiveBlocks: number;
  /** Prompt blocks its prefilling requests are computing right now. */
  computingBlocks: number;
  /** Prompt blocks right after matchedBlocks it holds below its primary pool, and how many of them only on disk. */
  lowerTierBlocks?: { blocks: number; disk: number };
  busy: boolean;
}

/**
 * The engine never takes a prompt's last token from the cache (it must compute at least one token to sample the
 * next), so a fully cached prompt whose length is a multiple of blockSize still recomputes its last block.
 */
export function reusableBlocks(numPromptTokens: number, blockSize: number, overlapBlocks: number): number {
  return Math.max(0, Math.min(overlapBlocks, Math.floor((numPromptTokens - 1) / blockSize)));
}

export function costTerms(request: RequestShape, worker: WorkerView): WorkerCostTerms {
  const { numPromptTokens, blockSize, overlapWeight } = request;
  const overlapBlocks = reusableBlocks(numPromptTokens, blockSize, worker.matchedBlocks);
  const speculativeBlocks = overlapBlocks - Math.min(worker.indexedBlocks, overlapBlocks);
  // Lower-tier blocks continue the primary run only up to the blocks the engine may take from any cache.
  const lower = worker.lowerTierBlocks;
  const lowerBlocks = lower === undefined ? 0 : reusableBlocks(numPromptTokens, blockSize, overlapBlocks + lower.blocks) - overlapBlocks;
  const diskBlocks = lower === undefined ? 0 : Math.min(lower.disk, lowerBlocks);
  const weight = request.lowerTierWeight ?? DEFAULT_LOWER_TIER_WEIGHT;
  const lowerTierSaving = lowerBlocks === 0 ? 0
    : ((lowerBlocks - diskBlocks) * (1 - weight.ram) + diskBlocks * (1 - weight.disk)) * blockSize;
  const newPrefillTokens = numPromptTokens - overlapBlocks * blockSize - lowerTierSaving;
  const queuedPrefillTokens = Math.max(worker.reported.activePrefillTokens, worker.own.prefillTokens);
  // Only blocks this request reuses can be the ones being computed for it.
  const sharedQueuedTokens = Math.min(worker.computingBlocks, overlapBlocks) * blockSize;
  const queuedAheadTokens = Math.max(0, queuedPrefillTokens - sharedQueuedTokens);
  const prefillTokens = newPrefillTokens + queuedAheadTokens;
  const prefillBlocks = prefillTokens / blockSize;
  const numFullBlocks = Math.floor(numPromptTokens / blockSize);
  const requestBlocks = Math.ceil(numPromptTokens / blockSize);
  const newBlocks = requestBlocks - Math.min(worker.sharedActiveBlocks, numFullBlocks);
  const decodeBlocks = Math.max(worker.reported.activeDecodeBlocks, worker.own.numBlocks) + newBlocks;
  return {
    workerId: worker.workerId, overlapBlocks, speculativeBlocks, prefillTokens, queuedPrefillTokens: queuedAheadTokens,
    prefillBlocks, decodeBlocks,
    ...(lowerBlocks > 0 ? { lowerTierBlocks: lowerBlocks } : {}),
    ...(diskBlocks > 0 ? { lowerTierDiskBlocks: diskBlocks } : {}),
    ...(worker.matchedBlocks > overlapBlocks ? { heldBlocks: Math.min(worker.matchedBlocks, numFullBlocks) } : {}),
    cost: overlapWeight * prefillBlocks + decodeBlocks, busy: worker.busy,
  };
}

/** Costs closer than this (relative) are ties: floating-point noise must not decide between equal workers. */
const TIE_EPSILON = 1e-9;

/**
 * Index of the chosen entry of `candidates`. Temperature 0: the lowest cost; among equal costs the larger overlap
 * (same expected latency, but the prefix stays in one place and no worker recomputes it), then a uniform draw.
 * Temperature > 0: a draw with probability proportional to exp(-normalizedCost / temperature), where costs are
 * rescaled to [0, 1] first so that the temperature means the same whatever the prompt length or load: at 1, the
 * most expensive candidate is e times less likely than the cheapest.
 */
export function selectByCost(candidates: readonly WorkerCostTerms[], temperature: number, random: RandomSource): number {
  if (candidates.length === 0) throw new RangeError('no candidates to select from');
  if (candidates.length === 1) return 0;
  let minCost = Infinity;
  let maxCost = -Infinity;
  for (const { cost } of candidates) {
    if (cost < minCost) minCost = cost;
    if (cost > maxCost) maxCost = cost;
  }
  const range = maxCost - minCost;
  const tolerance = TIE_EPSILON * Math.max(1, Math.abs(minCost));
  if (temperature > 0 && range > tolerance) return softmaxDraw(candidates, minCost, range, temperature, random);
  if (temperature > 0) return randomIndex(random, candidates.length);

  let bestOverlap = -1;
  let tied: number[] = [];
  candidates.forEach((terms, i) => {
    if (terms.cost - minCost > tolerance) return;
    if (terms.overlapBlocks > bestOverlap) {
      bestOverlap = terms.overlapBlocks;
      tied = [i];
    } else if (terms.overlapBlocks === bestOverlap) {
      tied.push(i);
    }
  });
  return tied[randomIndex(random, tied.length)]!;
}

function softmaxDraw(candidates: readonly WorkerCostTerms[], minCost: number, range: number, temperature: number,
  random: RandomSource): number {
  const weights = candidates.map(({ cost }) => Math.exp(-(cost - minCost) / range / temperature));
  let total = 0;
  for (const weight of weights) total += weight;
  let point = random() * total;
  for (let i = 0; i < weights.length; i++) {
    point -= weights[i]!;
    if (point < 0) return i;
  }
  return weights.length - 1;
}
