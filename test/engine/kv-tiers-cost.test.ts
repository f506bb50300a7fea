// The lower KV tiers' cost model (src/engine/kv-cache/tiers.ts, step-time-fit.ts): the step-time line fitted to the
// steps observed, recompute priced at its marginal cost on top of the tokens a prompt computes anyway (with the extra
// steps chunked prefill needs), and the split of a tier-held run into blocks onboarded and blocks recomputed.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { StepTimeFit } from '../../src/engine/kv-cache/step-time-fit.ts';
import { KvTiers } from '../../src/engine/kv-cache/tiers.ts';
import type { BlockHash } from '../../src/protocols/kv-events.ts';

const close = (actual: number | undefined, expected: number, tolerance = 1e-9) =>
  assert.ok(actual !== undefined && Math.abs(actual - expected) <= tolerance * Math.max(1, Math.abs(expected)), `${actual} vs ${expected}`);

describe('step-time fit', () => {
  test('recovers fixed + per-token from decode and prefill steps', () => {
    const fit = new StepTimeFit();
    const ms = (tokens: number) => 14 + 0.07 * tokens;
    for (const tokens of [1, 17, 1, 1, 8192, 1, 94, 1]) fit.observe(tokens, ms(tokens));
    const line = fit.line()!;
    close(line.fixedMs, 14);
    close(line.msPerToken, 0.07);
  });

  test('is not determined before steps of different sizes: no steps, decode steps alone, a spread of a few tokens', () => {
    const fit = new StepTimeFit();
    assert.equal(fit.line(), undefined);
    for (let i = 0; i < 50; i++) fit.observe(1, 14);
    assert.equal(fit.line(), undefined, 'steps of one size cannot tell the fixed part from the per-token part');
    for (let i = 0; i < 50; i++) fit.observe(2 + (i % 3), 14 + (i % 3) * 0.01);
    assert.equal(fit.line(), undefined, 'a spread of a couple of tokens is too little to trust a slope from');
    fit.observe(200, 28);
    assert.ok(fit.line() !== undefined);
  });

  test('a line with a negative slope or fixed part (timing noise) is not used', () => {
    const falling = new StepTimeFit();
    falling.observe(1, 20);
    falling.observe(100, 10);
    assert.equal(falling.line(), undefined);
    const throughZero = new StepTimeFit();
    throughZero.observe(10, 1);
    throughZero.observe(100, 30);
    assert.equal(throughZero.line(), undefined, 'fixed part 30 - 100 * 29/90 < 0');
  });

  test('follows the recent steps: older ones fade exponentially', () => {
    const fit = new StepTimeFit();
    const step = (tokens: number, msPerToken: number) => fit.observe(tokens, 5 + msPerToken * tokens);
    for (let i = 0; i < 100; i++) step(i % 2 === 0 ? 1 : 500, 0.1);
    close(fit.line()!.msPerToken, 0.1);
    // The machine gets twice as slow per token: 200 steps later (weight 0.95^200, about 3e-5) the old line is gone.
    for (let i = 0; i < 200; i++) step(i % 2 === 0 ? 1 : 500, 0.2);
    close(fit.line()!.msPerToken, 0.2, 1e-3);
    close(fit.line()!.fixedMs, 5, 1e-3);
  });

  test('stays accurate for long prompts with a small per-token part (no cancellation of large sums)', () => {
    const fit = new StepTimeFit();
    for (let i = 0; i < 1000; i++) {
      const tokens = i % 2 === 0 ? 1e6 : 1e6 + 16;
      fit.observe(tokens, 3 + 1e-4 * tokens);
    }
    close(fit.line()!.msPerToken, 1e-4, 1e-6);
  });
});

describe('recompute pricing', () => {
  const line = { fixedMs: 10, msPerToken: 0.01 };

  test('a block recomputed inside a step that runs anyway costs only its tokens', () => {
    const tiers = new KvTiers({ blockBytes: 1, ramBytes: 8, stepTime: line });
    // A 17-token prompt with 16 of them in a tier: the last token is computed anyway, its step's fixed part with it.
    close(tiers.recomputeMs(16, 1), 0.16);
    // The average rate of that step would charge the 16 tokens 16/17 of the whole step instead.
    close(tiers.recomputeMs(16, 1, 8192), 0.16);
    // Nothing computed anyway: the step itself is the recompute's.
    close(tiers.recomputeMs(16, 0), 10.16);
    assert.equal(tiers.recomputeMs(0, 5), 0);
  });

  test('chunked prefill: each extra step the recompute needs adds the fixed part', () => {
    const tiers = new KvTiers({ blockBytes: 1, ramBytes: 8, stepTime: line });
    // 60 tokens anyway fit one step of 64; with 16 more they need two.
    close(tiers.recomputeMs(16, 60, 64), 0.16 + 10);
    close(tiers.recomputeMs(16, 40, 64), 0.16);
    // 1 + 200 tokens in steps of 64: 4 steps instead of 1.
    close(tiers.recomputeMs(200, 1, 64), 2 + 3 * 10);
  });

  test('the fitted line prices once determined; until then the average prefill rate does, and a fixed rate always', () => {
    const tiers = new KvTiers({ blockBytes: 1, ramBytes: 8 });
    tiers.observeStep(17, 14 + 0.07 * 17, 17);
    close(tiers.recomputeMs(16, 1), 16 / (17 / (14 + 0.07 * 17)), 1e-12);
    tiers.observeStep(1, 14.07, 0);
    tiers.observeStep(94, 14 + 0.07 * 94, 94);
    close(tiers.stepTimeLine()!.msPerToken, 0.07);
    close(tiers.recomputeMs(16, 1), 16 * 0.07);
    const fixedRate = new KvTiers({ blockBytes: 1, ramBytes: 8, prefillTokensPerMs: 2 });
    for (const tokens of [1, 17, 94]) fixedRate.observeStep(tokens, 14 + 0.07 * tokens, tokens);
    assert.equal(fixedRate.stepTimeLine(), undefined);
    close(fixedRate.recomputeMs(16, 1), 8);
  });
});

describe('onboard or recompute', () => {
  const BLOCK_SIZE = 4;
  /** Tiers whose RAM tier holds the given blocks, each 1 ms to onboard, recompute priced by `line`. */
  function tiersHolding(hashes: BlockHash[], line: { fixedMs: number; msPerToken: number }): KvTiers {
    const tiers = new KvTiers({ blockBytes: 999, ramBytes: 999 * hashes.length, bandwidth: { ram: 1000 }, stepTime: line });
    for (const hash of hashes) tiers.ram!.put(hash, { bytes: new Uint8Array(0), parentHash: null });
    assert.equal(tiers.onboardMs('ram', 1), 0.999 + 0.001);
    return tiers;
  }
  const hashes = ['h0', 'h1', 'h2'] as BlockHash[];

  test('a short prompt recomputes the blocks a tier holds when reading them costs more than their tokens in the step', () => {
    // 13 tokens: 3 blocks in the tier, the last token computed anyway. 12 tokens at 0.01 ms < 3 blocks at 1 ms.
    const plan = tiersHolding(hashes, { fixedMs: 10, msPerToken: 0.01 }).planOnboard(hashes, 0, 3, BLOCK_SIZE, 13)!;
    assert.deepEqual([plan.hashes, plan.numRecomputed], [[], 3]);
  });

  test('blocks whose tokens cost more than their read are onboarded', () => {
    const plan = tiersHolding(hashes, { fixedMs: 10, msPerToken: 1 }).planOnboard(hashes, 0, 3, BLOCK_SIZE, 13)!;
    assert.deepEqual([plan.hashes, plan.tiers, plan.numRecomputed], [hashes, ['ram', 'ram', 'ram'], 0]);
  });

  test('with chunked prefill, just enough blocks are onboarded to save a step', () => {
    // Steps of 8 prompt tokens: recomputing all 13 takes 2 steps, 1 token alone 1. Onboarding 2 blocks (2 ms) leaves 5
    // tokens, one step: cheaper than a second step (10 ms), and than a third block's read (1 ms > 4 tokens at 0.01).
    const plan = tiersHolding(hashes, { fixedMs: 10, msPerToken: 0.01 }).planOnboard(hashes, 0, 3, BLOCK_SIZE, 13, 8)!;
    assert.deepEqual([plan.hashes, plan.numRecomputed], [hashes.slice(0, 2), 1]);
  });

  test('only the run the tier holds is planned, from the first block after the primary hits', () => {
    const tiers = tiersHolding(['h1', 'h2'] as BlockHash[], { fixedMs: 10, msPerToken: 1 });
    const plan = tiers.planOnboard([...hashes, 'h3' as BlockHash], 1, 4, BLOCK_SIZE, 17)!;
    assert.deepEqual([plan.hashes, plan.numRecomputed], [['h1', 'h2'], 0]);
    assert.equal(tiers.planOnboard(hashes, 0, 3, BLOCK_SIZE, 13), undefined, 'h0 is in no tier');
  });
});
