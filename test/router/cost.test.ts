// The kv cost terms and the choice among workers by cost: lowest wins, ties are drawn uniformly, softmax draws
// follow their probabilities.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { costTerms, reusableBlocks, selectByCost } from '../../src/router/cost.ts';
import type { WorkerView } from '../../src/router/cost.ts';
import type { WorkerCostTerms } from '../../src/router/protocols.ts';
import { seededRandom } from '../../src/util/random.ts';
import { assertBinomial, histogram, load } from './fixtures.ts';

function view(partial: Partial<WorkerView>): WorkerView {
  return {
    workerId: 'w', reported: load(), own: { numRequests: 0, numPrefilling: 0, prefillTokens: 0, numBlocks: 0 },
    indexedBlocks: 0, matchedBlocks: 0, sharedActiveBlocks: 0, computingBlocks: 0, busy: false, ...partial,
  };
}

function terms(cost: number, overlapBlocks = 0, workerId = `c${cost}`): WorkerCostTerms {
  return { workerId, overlapBlocks, speculativeBlocks: 0, prefillTokens: 0, queuedPrefillTokens: 0, prefillBlocks: 0, decodeBlocks: 0, cost, busy: false };
}

describe('kv cost terms', () => {
  it('adds the prefill the request needs to the prefill queued, and the blocks it adds to those held', () => {
    // 100 prompt tokens in blocks of 16: 6 full blocks + a partial one. The worker holds 4 of them (3 per its
    // events, a 4th by speculative insert) and its active requests share 2.
    const shape = { numPromptTokens: 100, blockSize: 16, overlapWeight: 2 };
    const result = costTerms(shape, view({
      workerId: 'a', indexedBlocks: 3, matchedBlocks: 4, sharedActiveBlocks: 2,
      reported: load({ activePrefillTokens: 50, activeDecodeBlocks: 10 }),
      own: { numRequests: 3, numPrefilling: 2, prefillTokens: 20, numBlocks: 12 },
    }));
    const newPrefillTokens = 100 - 4 * 16;
    const prefillTokens = newPrefillTokens + 50; // the report (50) exceeds the router's own count (20)
    const decodeBlocks = 12 + (7 - 2); // own count (12) exceeds the report (10); 7 blocks, 2 shared
    assert.deepEqual(result, {
      workerId: 'a', overlapBlocks: 4, speculativeBlocks: 1, prefillTokens, queuedPrefillTokens: 50, prefillBlocks: prefillTokens / 16, decodeBlocks,
      cost: 2 * (prefillTokens / 16) + decodeBlocks, busy: false,
    });
  });

  it('does not charge a request for queued prefill that computes its own prefix', () => {
    const shape = { numPromptTokens: 41, blockSize: 4, overlapWeight: 1 };
    const leaderBusy = { numRequests: 1, numPrefilling: 1, prefillTokens: 41, numBlocks: 11 };
    // The leader computes blocks 0..9 of the same prompt; this request reuses all 10 (speculatively).
    const follower = costTerms(shape, view({ matchedBlocks: 10, sharedActiveBlocks: 10, computingBlocks: 10, own: leaderBusy }));
    assert.equal(follower.prefillTokens, 1 + (41 - 40), 'its own last token plus the leader\'s unshared token');
    assert.equal(follower.queuedPrefillTokens, 41 - 40, 'ahead of it: the leader\'s unshared token');
    assert.equal(follower.decodeBlocks, 11 + 1, 'one partial block of its own');
    // Without the overlap (no speculative insert) the same queue is charged in full.
    const blind = costTerms(shape, view({ matchedBlocks: 0, sharedActiveBlocks: 10, computingBlocks: 10, own: leaderBusy }));
    assert.equal(blind.prefillTokens, 41 + 41);
    // Reusing 3 blocks caps the discount at 3 blocks.
    const partial = costTerms(shape, view({ matchedBlocks: 3, computingBlocks: 10, own: leaderBusy }));
    assert.equal(partial.prefillTokens, (41 - 12) + (41 - 12));
  });

  it('never reuses the block holding the last prompt token', () => {
    assert.equal(reusableBlocks(64, 16, 4), 3);
    assert.equal(reusableBlocks(65, 16, 4), 4);
    assert.equal(reusableBlocks(65, 16, 2), 2);
    assert.equal(reusableBlocks(0, 16, 0), 0);
    const fullyCached = costTerms({ numPromptTokens: 64, blockSize: 16, overlapWeight: 1 }, view({ indexedBlocks: 4, matchedBlocks: 4 }));
    assert.equal(fullyCached.overlapBlocks, 3);
    assert.equal(fullyCached.prefillTokens, 16);
  });

  it('makes overlap worth more as overlapWeight grows, and nothing at 0', () => {
    const shape = (overlapWeight: number) => ({ numPromptTokens: 256, blockSize: 16, overlapWeight });
    // 16 prompt blocks. Cached: 12 of them held, but 40 blocks of running requests; idle: nothing either way.
    // Cost (cached) = 4w + 56, cost (idle) = 16w + 16: they cross at w = 10 / 3.
    const cached = view({ indexedBlocks: 12, matchedBlocks: 12, reported: load({ activeDecodeBlocks: 40 }) });
    const idle = view({});
    const cost = (w: number, worker: WorkerView) => costTerms(shape(w), worker).cost;
    assert.equal(cost(0, cached), 56);
    assert.equal(cost(0, idle), 16);
    assert.ok(cost(1, cached) > cost(1, idle), 'at weight 1 the idle worker is cheaper');
    assert.ok(cost(4, cached) < cost(4, idle), 'at weight 4 the cache hit wins');
  });
});

describe('selectByCost', () => {
  it('picks the lowest cost whatever its position', () => {
    const random = seededRandom(1);
    for (let at = 0; at < 5; at++) {
      const candidates = [9, 8, 7, 6, 5].map((cost, i) => terms(i === at ? 1 : cost));
      assert.equal(selectByCost(candidates, 0, random), at);
    }
  });

  it('breaks a cost tie toward the larger overlap', () => {
    const candidates = [terms(5, 1, 'a'), terms(5, 3, 'b'), terms(5, 2, 'c'), terms(4.5, 0, 'd')];
    assert.equal(selectByCost(candidates, 0, seededRandom(1)), 3);
    candidates[3] = terms(6, 0, 'd');
    for (let seed = 0; seed < 20; seed++) assert.equal(selectByCost(candidates, 0, seededRandom(seed)), 1);
  });

  it('draws uniformly among equal candidates', () => {
    const random = seededRandom(3);
    const candidates = [terms(5, 0, 'a'), terms(5 + 1e-12, 0, 'b'), terms(7, 0, 'c'), terms(5, 0, 'd')];
    const numDraws = 3000;
    const picks = histogram(Array.from({ length: numDraws }, () => selectByCost(candidates, 0, random)));
    assert.equal(picks.get(2), undefined, 'the costlier candidate never wins');
    for (const at of [0, 1, 3]) assertBinomial(picks.get(at) ?? 0, numDraws, 1 / 3, `candidate ${at}`);
  });

  it('draws with softmax probabilities over normalized costs at temperature > 0', () => {
    const costs = [10, 12, 20];
    const candidates = costs.map((cost) => terms(cost));
    for (const temperature of [0.25, 1, 4]) {
      const random = seededRandom(11);
      const numDraws = 4000;
      const picks = histogram(Array.from({ length: numDraws }, () => selectByCost(candidates, temperature, random)));
      // Costs 10, 12, 20 normalize to 0, 0.2, 1.
      const weights = [0, 0.2, 1].map((normalized) => Math.exp(-normalized / temperature));
      const total = weights.reduce((a, b) => a + b, 0);
      weights.forEach((weight, i) => assertBinomial(picks.get(i) ?? 0, numDraws, weight / total, `T=${temperature} candidate ${i}`));
    }
  });

  it('returns the only candidate and refuses none', () => {
    assert.equal(selectByCost([terms(3)], 1, seededRandom(1)), 0);
    assert.throws(() => selectByCost([], 0, seededRandom(1)), RangeError);
  });
});
