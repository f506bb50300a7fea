// The lower KV tiers' cost model (src/engine/kv-cache/tiers.ts, step-time-curve.ts): the step-time curve through the
// steps observed, recompute priced at its marginal cost on top of the tokens a prompt computes anyway (with the extra
// steps chunked prefill needs), and the split of a tier-held run into blocks onboarded and blocks recomputed.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { StepTimeCurve } from '../../src/engine/kv-cache/step-time-curve.ts';
import { KvTiers } from '../../src/engine/kv-cache/tiers.ts';
import type { BlockHash } from '../../src/protocols/kv-events.ts';

const close = (actual: number | undefined, expected: number, tolerance = 1e-9) =>
  assert.ok(actual !== undefined && Math.abs(actual - expected) <= tolerance * Math.max(1, Math.abs(expected)), `${actual} vs ${expected}`);

describe('step-time curve', () => {
  test('passes through the steps observed, one point per power-of-two range of sizes, and prices between them', () => {
    const curve = new StepTimeCurve();
    const ms = (tokens: number) => 14 + 0.07 * tokens;
    for (const tokens of [1, 17, 1, 1, 8192, 1, 94, 1]) curve.observe(tokens, ms(tokens));
    assert.deepEqual(curve.knots()!.map((k) => k.tokens), [1, 17, 94, 8192]);
    const stepMs = curve.stepMs()!;
    for (const tokens of [1, 10, 17, 50, 94, 1000, 8192, 20_000]) close(stepMs(tokens), ms(tokens));
  });

  test('follows a step time no line can: flat while memory bound, then steep', () => {
    // A GPU step streams the weights whatever it computes up to a few hundred tokens, then its arithmetic dominates.
    const ms = (tokens: number) => Math.max(20, 0.05 * tokens);
    const curve = new StepTimeCurve();
    for (const tokens of [1, 16, 300, 3000, 1, 1]) curve.observe(tokens, ms(tokens));
    const stepMs = curve.stepMs()!;
    // 288 tokens recomputed beside 12 computed anyway cost nothing: the step stays memory bound.
    close(stepMs(300) - stepMs(12), 0);
    close(stepMs(3000) - stepMs(300), 150 - 20);
  });

  test('is not determined before steps some tokens apart: no steps, decode steps alone, a spread of a few tokens', () => {
    const curve = new StepTimeCurve();
    assert.equal(curve.stepMs(), undefined);
    for (let i = 0; i < 50; i++) curve.observe(1, 14);
    assert.equal(curve.stepMs(), undefined, 'steps of one size cannot tell what a token adds');
    for (let i = 0; i < 50; i++) curve.observe(2 + (i % 3), 14 + (i % 3) * 0.01);
    assert.equal(curve.stepMs(), undefined, 'a spread of a few tokens is too little to trust a slope from');
    curve.observe(200, 28);
    assert.ok(curve.stepMs() !== undefined);
  });

  test('a point timing noise put below a smaller step\'s is pooled with it: the curve never falls', () => {
    const curve = new StepTimeCurve();
    for (let i = 0; i < 20; i++) curve.observe(1, 10);
    curve.observe(40, 9); // one noisy prefill, faster than the decode steps
    curve.observe(400, 30);
    const knots = curve.knots()!;
    // The 40-token point (weight 1) and the decode point (weight about 13.6) share their weighted mean.
    const decodeWeight = (1 - 0.95 ** 20) / (1 - 0.95);
    close(knots[0]!.ms, (10 * decodeWeight + 9) / (decodeWeight + 1));
    close(knots[1]!.ms, knots[0]!.ms);
    close(knots[2]!.ms, 30);
    const stepMs = curve.stepMs()!;
    assert.ok(stepMs(20) >= stepMs(5) && stepMs(1000) > stepMs(400));
  });

  test('each range follows its recent steps: older ones fade exponentially', () => {
    const curve = new StepTimeCurve();
    for (let i = 0; i < 100; i++) curve.observe(i % 2 === 0 ? 1 : 500, i % 2 === 0 ? 5 : 55);
    close(curve.stepMs()!(500), 55);
    // Long steps get twice as slow: 200 steps of that range later (weight 0.95^200, about 3e-5) the old time is gone.
    for (let i = 0; i < 400; i++) curve.observe(i % 2 === 0 ? 1 : 500, i % 2 === 0 ? 5 : 105);
    close(curve.stepMs()!(500), 105, 1e-3);
  });

  test('below its first point the curve goes on at its first slope, not below zero', () => {
    const curve = new StepTimeCurve();
    curve.observe(100, 10);
    curve.observe(200, 30);
    const stepMs = curve.stepMs()!;
    close(stepMs(60), 2);
    assert.equal(stepMs(10), 0);
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

  test('the curve prices once determined; until then the average prefill rate does, and a fixed rate always', () => {
    const tiers = new KvTiers({ blockBytes: 1, ramBytes: 8 });
    tiers.observeStep(17, 14 + 0.07 * 17, 17);
    close(tiers.recomputeMs(16, 1), 16 / (17 / (14 + 0.07 * 17)), 1e-12);
    tiers.observeStep(1, 14.07, 0);
    tiers.observeStep(94, 14 + 0.07 * 94, 94);
    close(tiers.stepMs()!(50), 14 + 0.07 * 50);
    close(tiers.recomputeMs(16, 1), 16 * 0.07);
    const fixedRate = new KvTiers({ blockBytes: 1, ramBytes: 8, prefillTokensPerMs: 2 });
    for (const tokens of [1, 17, 94]) fixedRate.observeStep(tokens, 14 + 0.07 * tokens, tokens);
    assert.equal(fixedRate.stepMs(), undefined);
    close(fixedRate.recomputeMs(16, 1), 8);
  });

  test('recompute is priced by the steps\' own sizes: a short prefill on a memory-bound step is nearly free', () => {
    // Flat at 20 ms up to 400 tokens, then 0.05 ms a token. A line through these steps would have priced the 288
    // tokens at its slope (about 0.04 ms each, 11 ms); the prefill they join still takes one 20 ms step.
    const ms = (tokens: number) => Math.max(20, 0.05 * tokens);
    const tiers = new KvTiers({ blockBytes: 1, ramBytes: 8 });
    for (const tokens of [300, 1, 1, 12, 1, 1, 2000, 1]) tiers.observeStep(tokens, ms(tokens), tokens > 1 ? tokens : 0);
    close(tiers.recomputeMs(288, 12), 0);
    // Chunked in steps of 256: 300 tokens need a second step, 12 alone one.
    close(tiers.recomputeMs(288, 12, 256), 20);
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

  test('a fixed latency per onboard (the simulator\'s tier profiles) is paid once per tier read, not per block', () => {
    // 0.2 ms a block plus 1 ms for the read: 3 blocks 1.6 ms, more than their 12 tokens at 0.1 ms (1.2 ms). Priced
    // per block (0.2 + the 0.001 ms RAM overhead each) the read would have looked cheaper and won.
    const tiers = new KvTiers({ blockBytes: 200, ramBytes: 600, bandwidth: { ram: 1000 }, latencyMs: { ram: 1 }, stepTime: { fixedMs: 10, msPerToken: 0.1 } });
    for (const hash of hashes) tiers.ram!.put(hash, { bytes: new Uint8Array(0), parentHash: null });
    close(tiers.onboardMs('ram', 3), 1.6);
    assert.equal(tiers.onboardMs('ram', 0), 0);
    assert.deepEqual(tiers.planOnboard(hashes, 0, 3, BLOCK_SIZE, 13)!.numRecomputed, 3);
    // At 1 ms a token the blocks are worth reading despite the latency: 1.6 ms against 12.
    const dear = new KvTiers({ blockBytes: 200, ramBytes: 600, bandwidth: { ram: 1000 }, latencyMs: { ram: 1 }, stepTime: { fixedMs: 10, msPerToken: 1 } });
    for (const hash of hashes) dear.ram!.put(hash, { bytes: new Uint8Array(0), parentHash: null });
    assert.deepEqual(dear.planOnboard(hashes, 0, 3, BLOCK_SIZE, 13)!.hashes, hashes);
  });
});
