import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { Xoshiro128, drawRandomSeed, seededRandom } from '../../src/util/random.ts';
import {
  argmax, countAbove, expGap, heapSelectTop, MASS_BINS, Sampler, SequenceSampler, createRequestSamplers, selectTop, selectTopByMass, selectTopP,
  scaleRow, validateSamplingParams, WEIGH_BLOCK, weighCandidates,
} from '../../src/engine/sampler.ts';
import type { LogprobsMode, SampledToken } from '../../src/engine/sampler.ts';
import { DEFAULT_SAMPLING } from '../../src/engine/types.ts';
import type { SamplingParams } from '../../src/engine/types.ts';

const DRAWS = 20_000;
/** Absolute tolerance on an empirical frequency: about 4.5 standard deviations at p = 0.5 over DRAWS draws. */
const FREQUENCY_TOLERANCE = 0.016;

function params(overrides: Partial<SamplingParams> = {}): SamplingParams {
  return { ...DEFAULT_SAMPLING, ...overrides };
}

function sequence(
  vocabSize: number,
  overrides: Partial<SamplingParams> = {},
  extra: { prompt?: number[]; eos?: number[]; seed?: number; index?: number } = {},
): SequenceSampler {
  return new SequenceSampler({
    params: params(overrides),
    promptTokenIds: extra.prompt ?? [],
    vocabSize,
    eosTokenIds: extra.eos ?? [],
    requestSeed: extra.seed ?? 1234,
    completionIndex: extra.index ?? 0,
  });
}

/** Samples the same logits row many times and returns how often each id came out. */
function frequencies(logits: number[], overrides: Partial<SamplingParams>, draws = DRAWS): number[] {
  const sampler = new Sampler(logits.length);
  const seq = sequence(logits.length, overrides);
  const row = Float32Array.from(logits);
  const counts = new Array<number>(logits.length).fill(0);
  for (let i = 0; i < draws; i++) counts[sampler.sampleRow(row, seq).tokenId]!++;
  return counts.map((count) => count / draws);
}

function assertFrequencies(actual: number[], expected: number[]): void {
  assert.equal(actual.length, expected.length);
  for (let i = 0; i < expected.length; i++) {
    if (expected[i] === 0) assert.equal(actual[i], 0, `token ${i} must never be drawn (got ${actual[i]})`);
    else assert.ok(Math.abs(actual[i]! - expected[i]!) < FREQUENCY_TOLERANCE, `token ${i}: ${actual[i]} vs expected ${expected[i]}`);
  }
}

function softmax(values: number[]): number[] {
  const max = Math.max(...values);
  const exps = values.map((v) => Math.exp(v - max));
  const sum = exps.reduce((a, b) => a + b, 0);
  return exps.map((e) => e / sum);
}

function logSoftmax(values: number[]): number[] {
  const max = Math.max(...values);
  const logSum = max + Math.log(values.reduce((a, v) => a + Math.exp(v - max), 0));
  return values.map((v) => v - logSum);
}

function randomLogits(rng: Xoshiro128, count: number): Float32Array {
  const row = new Float32Array(count);
  for (let i = 0; i < count; i++) row[i] = (rng.nextFloat() - 0.5) * 8;
  return row;
}

describe('Xoshiro128', () => {
  it('matches the reference C implementation of xoshiro128** from state (1, 2, 3, 4)', () => {
    // Outputs and final state printed by Blackman & Vigna's xoshiro128starstar.c compiled with gcc.
    const rng = new Xoshiro128([1, 2, 3, 4]);
    const outputs = Array.from({ length: 6 }, () => rng.nextUint32());
    assert.deepEqual(outputs, [11520, 0, 5927040, 70819200, 2031721883, 1637235492]);
    assert.deepEqual(rng.state(), [1110993931, 286554632, 2431677446, 2165318166]);
  });

  it('matches the reference after 1000 draws from a state with high bits set', () => {
    const rng = new Xoshiro128([0x9e3779b9, 0xdeadbeef, 0x12345678, 0xcafebabe]);
    for (let i = 0; i < 1000; i++) rng.nextUint32();
    assert.equal(rng.nextUint32(), 1063874299);
  });

  it('gives uniform floats in [0, 1) with mean 1/2 and variance 1/12', () => {
    const rng = Xoshiro128.fromSeed(99);
    let sum = 0;
    let sumSquares = 0;
    const n = 50_000;
    for (let i = 0; i < n; i++) {
      const u = rng.nextFloat();
      assert.ok(u >= 0 && u < 1);
      sum += u;
      sumSquares += u * u;
    }
    const mean = sum / n;
    assert.ok(Math.abs(mean - 0.5) < 0.01, `mean ${mean}`);
    assert.ok(Math.abs(sumSquares / n - mean * mean - 1 / 12) < 0.005);
  });

  it('gives the same stream for the same (seed, stream) and different streams otherwise', () => {
    const draw = (rng: Xoshiro128) => Array.from({ length: 4 }, () => rng.nextUint32());
    assert.deepEqual(draw(Xoshiro128.fromSeed(42, 0)), draw(Xoshiro128.fromSeed(42, 0)));
    assert.notDeepEqual(draw(Xoshiro128.fromSeed(42, 0)), draw(Xoshiro128.fromSeed(42, 1)));
    assert.notDeepEqual(draw(Xoshiro128.fromSeed(42, 0)), draw(Xoshiro128.fromSeed(43, 0)));
    assert.notDeepEqual(draw(Xoshiro128.fromSeed(1, 0)), draw(Xoshiro128.fromSeed(1 + 2 ** 32, 0)));
    assert.notDeepEqual(draw(Xoshiro128.fromSeed(-1, 0)), draw(Xoshiro128.fromSeed(2 ** 32 - 1, 0)));
  });

  it('resumes a stream from a saved state', () => {
    const rng = Xoshiro128.fromSeed(5);
    rng.nextUint32();
    const resumed = new Xoshiro128(rng.state());
    assert.equal(resumed.nextUint32(), rng.nextUint32());
  });

  it('rejects unusable seeds and states', () => {
    assert.throws(() => Xoshiro128.fromSeed(1.5), /seed must be a safe integer/);
    assert.throws(() => Xoshiro128.fromSeed(2 ** 60), /seed must be a safe integer/);
    assert.throws(() => Xoshiro128.fromSeed(1, -1), /stream must be an integer/);
    assert.throws(() => new Xoshiro128([0, 0, 0, 0]), /must not be all zero/);
    assert.ok(Number.isSafeInteger(drawRandomSeed()));
  });
});

describe('selectTop', () => {
  it('puts the m best ids first, sorted by value then lower id, like a full sort', () => {
    const rng = Xoshiro128.fromSeed(3);
    for (let trial = 0; trial < 200; trial++) {
      const count = 1 + (rng.nextUint32() % 300);
      // Few distinct values, so ties are common.
      const values = Float32Array.from({ length: count }, () => rng.nextUint32() % 7);
      const m = 1 + (rng.nextUint32() % count);
      const order = Int32Array.from({ length: count }, (_, i) => i);
      selectTop(values, order, count, m);
      const fullySorted = [...order.keys()].sort((a, b) => values[b]! - values[a]! || a - b);
      assert.deepEqual([...order.subarray(0, m)], fullySorted.slice(0, m));
      assert.deepEqual([...order].sort((a, b) => a - b), [...fullySorted].sort((a, b) => a - b), 'a permutation');
    }
  });
});

describe('selectTopByMass', () => {
  it('keeps the smallest best-first prefix whose weight reaches the mass, like a full sort would', () => {
    const rng = Xoshiro128.fromSeed(4);
    for (let trial = 0; trial < 300; trial++) {
      const count = 1 + (rng.nextUint32() % 200);
      const values = Float32Array.from({ length: count }, () => rng.nextUint32() % 9);
      // Integer weights sum exactly, so the expected cut is not blurred by rounding.
      const weights = Float64Array.from({ length: count }, () => 1 + (rng.nextUint32() % 5));
      const total = weights.reduce((a, b) => a + b, 0);
      const mass = 1 + (rng.nextUint32() % total);
      const ranked = [...weights.keys()].sort((a, b) => values[b]! - values[a]! || a - b);
      let expectedCount = 0;
      for (let sum = 0; sum < mass; expectedCount++) sum += weights[ranked[expectedCount]!]!;
      const order = Int32Array.from({ length: count }, (_, i) => i);
      const kept = selectTopByMass(values, weights, order, count, mass);
      assert.equal(kept, expectedCount, `trial ${trial}`);
      assert.deepEqual([...order.subarray(0, kept)].sort((a, b) => a - b), ranked.slice(0, kept).sort((a, b) => a - b));
    }
  });
});

describe('argmax', () => {
  it('finds the largest value, ties to the lowest id, for every length and lane', () => {
    const rng = Xoshiro128.fromSeed(21);
    for (let trial = 0; trial < 500; trial++) {
      const count = 1 + (rng.nextUint32() % 40);
      // Few distinct values (some -Infinity), so the maximum is often shared by ids in different lanes.
      const values = Float32Array.from({ length: count }, () => {
        const draw = rng.nextUint32() % 6;
        return draw === 0 ? -Infinity : draw;
      });
      if (values.every((v) => v === -Infinity)) values[rng.nextUint32() % count] = 0;
      let expected = 0;
      for (let i = 1; i < count; i++) if (values[i]! > values[expected]!) expected = i;
      assert.equal(argmax(values), expected, `trial ${trial}: ${[...values]}`);
    }
  });

  it('reports the first NaN wherever it is, and a row with nothing but -Infinity', () => {
    for (let at = 0; at < 11; at++) {
      const values = Float32Array.from({ length: 11 }, (_, i) => i);
      values[at] = NaN;
      if (at < 10) values[10] = NaN;
      assert.throws(() => argmax(values), new RegExp(`NaN at token id ${at}$`), `NaN at ${at}`);
    }
    assert.throws(() => argmax(new Float32Array(9).fill(-Infinity)), /every token is masked/);
  });
});

describe('countAbove', () => {
  it('counts the values above a value as a plain filter does, at every length, with ties, infinities and NaN', () => {
    const pool = [0.5, -1, 0.5, Infinity, -Infinity, NaN, 2, -0, 0, 3.25];
    const random = seededRandom(11);
    for (let length = 0; length <= 13; length++) {
      for (let trial = 0; trial < 20; trial++) {
        const values = Float32Array.from({ length }, () => pool[Math.floor(random() * pool.length)]!);
        for (const value of [0.5, 0, -Infinity, Infinity, 2.5, NaN]) {
          assert.equal(countAbove(values, value), [...values].filter((x) => x > value).length, `length ${length}, value ${value}`);
        }
      }
    }
  });
});

describe('Sampler.promptLogprob', () => {
  it('a plain draw\'s one alternative is the best of two, as the draw weighed the row', () => {
    const random = seededRandom(9);
    for (let trial = 0; trial < 100; trial++) {
      const row = Float32Array.from({ length: 40 }, () => Math.floor(random() * 3));
      const one = new Sampler(40).sampleRow(row, sequence(40, { logprobs: 1 }, { seed: trial }));
      const two = new Sampler(40).sampleRow(row, sequence(40, { logprobs: 2 }, { seed: trial }));
      assert.equal(one.tokenId, two.tokenId);
      assert.deepEqual(one.logprobs!.top, two.logprobs!.top.slice(0, 1), `trial ${trial}`);
    }
  });

  it('one alternative is the best of two: the argmax, ties to the lowest id', () => {
    const random = seededRandom(5);
    const sampler = new Sampler(50);
    for (let trial = 0; trial < 200; trial++) {
      // Few distinct values, so the best is often tied.
      const row = Float32Array.from({ length: 50 }, () => Math.floor(random() * 4) - (random() < 0.1 ? Infinity : 0));
      assert.deepEqual(sampler.promptLogprob(row, 7, 1).top, sampler.promptLogprob(row, 7, 2).top.slice(0, 1), `trial ${trial}`);
    }
  });

  it('gives the token\'s log-softmax, the best alternatives and its rank, and leaves the row as it was', () => {
    const row = Float32Array.from([1, 3, 3, -2, 0.5, -Infinity, 2]);
    const copy = row.slice();
    const sampler = new Sampler(row.length);
    const entry = sampler.promptLogprob(row, 6, 2);
    const lse = Math.log([...row].reduce((sum, x) => sum + Math.exp(x), 0));
    assert.ok(Math.abs(entry.logprob - (2 - lse)) < 1e-12);
    // Ties rank by count of greater values: token 6 (2) has two above it (3, 3), so rank 3.
    assert.equal(entry.rank, 3);
    assert.deepEqual(entry.top.map((t) => t.tokenId), [1, 2]);
    assert.equal(sampler.promptLogprob(row, 2, 0).rank, 1, 'a tie for the best is rank 1');
    assert.equal(sampler.promptLogprob(row, 5, 0).rank, 7, 'a masked token is last');
    assert.deepEqual(row, copy);
  });
});

describe('heapSelectTop', () => {
  it('keeps the k best ids at or above the floor, and every id tied with the k-th, as a mask below the k-th value', () => {
    const rng = Xoshiro128.fromSeed(22);
    for (let trial = 0; trial < 300; trial++) {
      const count = 1 + (rng.nextUint32() % 300);
      const values = Float32Array.from({ length: count }, () => {
        const draw = rng.nextUint32() % 8;
        return draw === 0 ? -Infinity : draw;
      });
      const k = 1 + (rng.nextUint32() % count);
      const floor = trial % 3 === 0 ? 4 : -Infinity;
      const order = new Int32Array(count);
      const kept = heapSelectTop(values, order, k, floor);
      const eligible = [...values.keys()].filter((i) => values[i]! >= floor && values[i]! > -Infinity);
      const ranked = eligible.sort((a, b) => values[b]! - values[a]! || a - b);
      // vLLM (and Hugging Face's TopKLogitsWarper) mask the values below the k-th best: the ties with it stay.
      const kthValue = values[ranked[Math.min(k, ranked.length) - 1]!];
      const unmasked = ranked.length <= k ? ranked : ranked.filter((i) => values[i]! >= kthValue!);
      assert.equal(kept, unmasked.length, `trial ${trial}`);
      assert.deepEqual([...order.subarray(0, kept)].sort((a, b) => a - b), [...unmasked].sort((a, b) => a - b), `trial ${trial}`);
      // The layout the native draw shares: the k first by rank (lower id on ties) in the heap, then the rest in id order.
      assert.deepEqual([...order.subarray(0, Math.min(k, kept))].sort((a, b) => a - b), ranked.slice(0, k).sort((a, b) => a - b), `trial ${trial}`);
      assert.deepEqual([...order.subarray(Math.min(k, kept), kept)], unmasked.slice(k).sort((a, b) => a - b), `trial ${trial}`);
    }
  });

  it('reports a NaN met before or after the heap is full', () => {
    const values = Float32Array.from([5, 4, 3, 2, 1, 0]);
    for (const at of [1, 4]) {
      const withNaN = values.slice();
      withNaN[at] = NaN;
      assert.throws(() => heapSelectTop(withNaN, new Int32Array(6), 2, -Infinity), new RegExp(`NaN at token id ${at}$`));
    }
  });
});

describe('expGap', () => {
  it('is exp within 2 units in the last place across the range of gaps, and exactly 1 at 0', () => {
    const rng = Xoshiro128.fromSeed(5);
    let worst = 0;
    const gaps = [0, -1e-300, -1e-20, -1e-8, -0.5, -Math.LN2 / 2, -Math.LN2, -1, -20, -100, -700, -707.99];
    for (let i = 0; i < 200_000; i++) gaps.push(-rng.nextFloat() * (i % 2 === 0 ? 1 : 707.9));
    for (const d of gaps) {
      const exact = Math.exp(d);
      // One unit in the last place of exact: 2^(exponent - 52).
      const ulp = 2 ** (Math.floor(Math.log2(exact)) - 52);
      worst = Math.max(worst, Math.abs(expGap(d) - exact) / ulp);
    }
    assert.ok(worst <= 2, `worst error ${worst} units in the last place`);
    assert.equal(expGap(0), 1);
    assert.equal(expGap(-0), 1);
  });

  it('gives 0 at and below -708 and for -Infinity, NaN for NaN, Infinity above 709', () => {
    for (const d of [-708, -708.5, -745, -1e300, -Infinity]) assert.equal(expGap(d), 0, `${d}`);
    assert.ok(Number.isNaN(expGap(NaN)));
    assert.equal(expGap(709.5), Infinity);
    assert.ok(Math.abs(expGap(700) / Math.exp(700) - 1) < 1e-15);
  });
});

describe('weighCandidates', () => {
  it('weighs the candidates at or above the floor, sums them by blocks of 8 ids, and bins them by distance below the max', () => {
    const rng = Xoshiro128.fromSeed(6);
    // 3003 ids: 375 whole blocks and a partial one.
    const row = randomLogits(rng, 3003);
    for (let i = 0; i < row.length; i += 7) row[i] = -Infinity;
    row[3002] = -Infinity;
    let max = -Infinity;
    for (const value of row) max = Math.max(max, value);
    const floor = max - 2.5;
    const weights = new Float64Array(row.length).fill(-1);
    const blockTotals = new Float64Array(Math.ceil(row.length / WEIGH_BLOCK) + 1).fill(-1);
    const binMass = new Float64Array(MASS_BINS);
    const binCount = new Int32Array(MASS_BINS);
    const last = new Int32Array(1);
    binMass.fill(3); // stale: the pass zeroes the bins
    binCount.fill(3);
    const total = weighCandidates(row, 1, max, floor, weights, blockTotals, binMass, binCount, last);
    let lastId = 0;
    const expectedCount = new Array<number>(MASS_BINS).fill(0);
    for (let i = 0; i < row.length; i++) {
      const candidate = row[i]! >= floor && row[i]! > -Infinity;
      assert.equal(weights[i], candidate ? expGap(row[i]! - max) : 0, `weight ${i}`);
      if (candidate) {
        lastId = i;
        expectedCount[Math.min(Math.floor((max - row[i]!) * 8), MASS_BINS - 1)]!++;
      }
    }
    // Each block's eight weights in the tree ((w0 + w1) + (w2 + w3)) + ((w4 + w5) + (w6 + w7)), past the end as 0.
    let running = 0;
    for (let b = 0; b * WEIGH_BLOCK < row.length; b++) {
      const w = (j: number) => weights[b * WEIGH_BLOCK + j] ?? 0;
      running += ((w(0) + w(1)) + (w(2) + w(3))) + ((w(4) + w(5)) + (w(6) + w(7)));
      assert.equal(blockTotals[b], running, `block ${b}`);
    }
    assert.equal(blockTotals[Math.ceil(row.length / WEIGH_BLOCK)], -1, 'nothing written past the last block');
    assert.equal(total, running);
    assert.equal(last[0], lastId);
    assert.deepEqual(Array.from(binCount), expectedCount);
    const binned = binMass.reduce((a, b) => a + b, 0);
    assert.ok(Math.abs(binned - total) < 1e-12 * total, `the bins hold the whole mass: ${binned} against ${total}`);
    // Candidates' probabilities as a softmax gives them.
    const probabilities = softmax(Array.from(row).map((v) => (v >= floor ? v : -Infinity)));
    for (let i = 0; i < row.length; i++) assert.ok(Math.abs(weights[i]! / total - probabilities[i]!) < 1e-14, `probability ${i}`);
  });

  it("draws, for a uniform u, the token whose share of the mass holds u (a weighed row's search by blocks)", () => {
    const rng = Xoshiro128.fromSeed(8);
    const vocabSize = 1003;
    const row = randomLogits(rng, vocabSize);
    for (let i = 0; i < vocabSize; i += 5) row[i] = -Infinity; // weight 0: never drawn
    const sampler = new Sampler(vocabSize);
    const total = sampler.weighRow(row, sequence(vocabSize, { temperature: 1 }));
    // Each token's interval [before, before + weight) of the mass, summed here in id order in exact-enough doubles.
    const weights = sampler.rowWeights;
    const edges: number[] = [];
    let before = 0;
    for (let i = 0; i < vocabSize; i++) {
      edges.push(before);
      before += weights[i]!;
    }
    let checked = 0;
    for (let k = 0; k < 5000; k++) {
      const u = rng.nextFloat();
      const target = u * total;
      let expected = vocabSize - 1;
      while (expected > 0 && edges[expected]! > target) expected--;
      while (weights[expected] === 0) expected--;
      // Away from an edge (the sums' rounding may move a draw within 1e-12 of one to its neighbour).
      const next = edges[expected]! + weights[expected]!;
      if (target - edges[expected]! < 1e-12 * total || next - target < 1e-12 * total) continue;
      assert.equal(sampler.drawWeighed(total, u), expected, `u = ${u}`);
      checked++;
    }
    assert.ok(checked > 4900);
    assert.notEqual(sampler.drawWeighed(total, 1 - 2 ** -53), 0, 'u near 1: a token at the top of the mass');
  });

  it('gives 0 as the last id when nothing weighs', () => {
    const row = Float32Array.from([-Infinity, -Infinity, -Infinity]);
    const last = Int32Array.of(9);
    assert.equal(weighCandidates(row, 1, 0, -Infinity, new Float64Array(3), null, null, null, last), 0);
    assert.equal(last[0], 0);
  });

  it('reads each value at a scale as a copy scaled to float32 would hold it', () => {
    const rng = Xoshiro128.fromSeed(7);
    const row = randomLogits(rng, 1001);
    const scale = 1 / 0.7;
    const copy = row.map((v) => v * scale); // a Float32Array: each product rounded to float32
    let max = -Infinity;
    for (const value of copy) max = Math.max(max, value);
    const floor = max - 2;
    const pass = (values: Float32Array, at: number) => {
      const out = { weights: new Float64Array(values.length), blockTotals: new Float64Array(values.length),
        binMass: new Float64Array(MASS_BINS), binCount: new Int32Array(MASS_BINS), last: new Int32Array(1) };
      const total = weighCandidates(values, at, max, floor, out.weights, out.blockTotals, out.binMass, out.binCount, out.last);
      return { total, ...out };
    };
    assert.deepEqual(pass(row, scale), pass(copy, 1));
  });
});

describe('selectTopP', () => {
  it('keeps exactly the smallest best-first set reaching topP of the mass, across many bins and ties', () => {
    const rng = Xoshiro128.fromSeed(23);
    const binMass = new Float64Array(MASS_BINS);
    const binCount = new Int32Array(MASS_BINS);
    for (let trial = 0; trial < 200; trial++) {
      const count = 1 + (rng.nextUint32() % 2000);
      // Values on a 1/16 grid over a span of 0..80 logits: ties, several tokens per bin, and a tail beyond the bins.
      const span = [2, 10, 80][trial % 3]!;
      const values = Float32Array.from({ length: count }, () => Math.round(rng.nextFloat() * span * 16) / 16);
      const topP = [0.1, 0.5, 0.9, 0.999, 1 - 1e-12][trial % 5]!;
      const floor = trial % 4 === 0 ? span / 2 : -Infinity;
      const max = Math.max(...values);
      const weights = new Float64Array(count);
      const order = new Int32Array(count);
      const kept = selectTopP(values, max, floor, topP, weights, order, binMass, binCount);

      const eligible = [...values.keys()].filter((i) => values[i]! >= floor);
      const mass = (id: number) => Math.exp(values[id]! - max);
      const total = eligible.reduce((sum, id) => sum + mass(id), 0);
      const ranked = eligible.sort((a, b) => values[b]! - values[a]! || a - b);
      // The best `kept` ids, and the fewest that reach the target: without the last one the mass falls short. (Sums
      // taken in another order differ in the last bits, hence the relative slack of 1e-12.)
      const keptIds = [...order.subarray(0, kept)].sort((a, b) => a - b);
      assert.deepEqual(keptIds, ranked.slice(0, kept).sort((a, b) => a - b), `trial ${trial}: the best ${kept}`);
      const target = topP * total;
      const keptMass = ranked.slice(0, kept).reduce((sum, id) => sum + mass(id), 0);
      assert.ok(kept === ranked.length || keptMass >= target * (1 - 1e-12), `trial ${trial}: ${keptMass} reaches ${target}`);
      assert.ok(keptMass - mass(ranked[kept - 1]!) < target * (1 + 1e-12), `trial ${trial}: ${kept} is the fewest`);
      // The weights themselves: the sampler's exp (within 2 units in the last place of Math.exp, tested above).
      for (const id of eligible) assert.equal(weights[id], expGap(values[id]! - max));
    }
  });
});

describe('Sampler: greedy', () => {
  it('picks the argmax, ties to the lowest id, whatever the seed', () => {
    const sampler = new Sampler(5);
    const row = Float32Array.from([0.5, 3, -1, 3, 2]);
    for (const seed of [1, 2, 3]) {
      assert.equal(sampler.sampleRow(row, sequence(5, { temperature: 0 }, { seed })).tokenId, 1);
    }
  });

  it('does not modify the logits row it is given', () => {
    const cases: Partial<SamplingParams>[] = [
      { temperature: 0.7, repetitionPenalty: 2 }, { temperature: 0 }, { temperature: 0.5 }, { temperature: 0.5, topK: 2 },
      { temperature: 1.5, topP: 0.5 }, { temperature: 0.5, logprobs: 2 }, { logitBias: new Map([[0, 5]]) },
    ];
    for (const overrides of cases) {
      const row = Float32Array.from([1, 2, 3]);
      for (const mode of ['raw', 'processed'] as const) {
        new Sampler(3, { logprobsMode: mode }).sampleRow(row, sequence(3, overrides, { prompt: [2] }));
        assert.deepEqual([...row], [1, 2, 3], JSON.stringify({ ...overrides, mode }, (_, v) => (v instanceof Map ? [...v] : v)));
      }
    }
  });

  it('reports NaN logits and rows where every token is masked', () => {
    const sampler = new Sampler(3);
    assert.throws(() => sampler.sampleRow(Float32Array.from([0, NaN, 1]), sequence(3, { temperature: 0 })), /NaN at token id 1/);
    const banned = new Map([[0, -Infinity], [1, -Infinity], [2, -Infinity]]);
    assert.throws(() => sampler.sampleRow(new Float32Array(3), sequence(3, { logitBias: banned })), /every token is masked/);
  });
});

describe('Sampler: temperature and truncation', () => {
  // The distribution p = [0.5, 0.3, 0.15, 0.05] laid on ids in a shuffled order, so ranking by id would be wrong.
  const probabilityById = [0.15, 0.5, 0.05, 0.3];
  const logits = probabilityById.map(Math.log);

  it('draws the first +Infinity logit under top_p, where the mass is, and uses one uniform as any draw', () => {
    const row = Float32Array.of(1, Infinity, 3, Infinity);
    const seq = sequence(4, { topP: 0.9, temperature: 0.8 });
    const twin = sequence(4, { topP: 0.9, temperature: 0.8 });
    assert.equal(new Sampler(4).sampleRow(row, seq).tokenId, 1);
    twin.nextUniform();
    assert.equal(seq.nextUniform(), twin.nextUniform());
  });

  it('samples softmax(logits) at temperature 1', () => {
    assertFrequencies(frequencies(logits, {}), probabilityById);
  });

  it('samples softmax(logits / T) at temperature T', () => {
    const raw = [2, 1, 0, -1];
    assertFrequencies(frequencies(raw, { temperature: 0.5 }), softmax(raw.map((l) => l / 0.5)));
    assertFrequencies(frequencies(raw, { temperature: 2 }), softmax(raw.map((l) => l / 2)));
  });

  it('top_k keeps the k most likely tokens, renormalised', () => {
    // Top 2 are 0.5 (id 1) and 0.3 (id 3): 0.5/0.8 and 0.3/0.8.
    assertFrequencies(frequencies(logits, { topK: 2 }), [0, 0.625, 0, 0.375]);
    assertFrequencies(frequencies(logits, { topK: 1, temperature: 1.5 }), [0, 1, 0, 0]);
    assertFrequencies(frequencies(logits, { topK: 10 }), probabilityById);
  });

  it('top_k at a temperature samples softmax(logits / T) over the k best of a large vocabulary', () => {
    const vocabSize = 3000;
    const rng = Xoshiro128.fromSeed(24);
    // Nine high logits among low ones, two of them tied at the cut.
    const row = Array.from({ length: vocabSize }, () => rng.nextFloat() * 2);
    const high: [number, number][] = [[2900, 9], [17, 8.5], [1500, 8], [40, 7.5], [2999, 7], [600, 6.5], [701, 6], [700, 6], [3, 5.5]];
    for (const [id, logit] of high) row[id] = logit;
    const temperature = 0.7;
    const expectedFor = (kept: number[]): number[] => {
      const probabilities = softmax(kept.map((id) => row[id]! / temperature));
      const expected = new Array<number>(vocabSize).fill(0);
      kept.forEach((id, j) => { expected[id] = probabilities[j]!; });
      return expected;
    };
    // Ids 700 and 701 tie for the seventh place: both stay, as vLLM masks only the logits below the k-th.
    assertFrequencies(frequencies(row, { topK: 7, temperature }), expectedFor(high.slice(0, 8).map(([id]) => id)));
    assertFrequencies(frequencies(row, { topK: 8, temperature }), expectedFor(high.slice(0, 8).map(([id]) => id)));
    assertFrequencies(frequencies(row, { topK: 6, temperature }), expectedFor(high.slice(0, 6).map(([id]) => id)));
  });

  it('top_p keeps the smallest top set whose mass reaches p', () => {
    // Mass before each token, best first: 0 (0.5), 0.5 (0.3), 0.8 (0.15), 0.95 (0.05).
    assertFrequencies(frequencies(logits, { topP: 0.7 }), [0, 0.625, 0, 0.375]);
    assertFrequencies(frequencies(logits, { topP: 0.85 }), [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95]);
    assertFrequencies(frequencies(logits, { topP: 0.4 }), [0, 1, 0, 0]);
  });

  it('top_p stops once the mass reaches p exactly, ranking ties by lower id', () => {
    // Four equal tokens: the first two hold exactly 0.5, so the third is not needed.
    assertFrequencies(frequencies([0, 0, 0, 0], { topP: 0.5 }), [0.5, 0.5, 0, 0]);
  });

  it('min_p drops tokens below min_p x the top probability', () => {
    // Threshold 0.2 x 0.5 = 0.1 drops only the 0.05 token.
    assertFrequencies(frequencies(logits, { minP: 0.2 }), [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95]);
    // Threshold 0.4 x 0.5 = 0.2 drops 0.15 and 0.05.
    assertFrequencies(frequencies(logits, { minP: 0.4 }), [0, 0.625, 0, 0.375]);
  });

  it('applies min_p before top_k', () => {
    // min_p 0.2 drops the 0.05 token; top_k 3 then keeps the remaining three, top_k 2 the best two.
    assertFrequencies(frequencies(logits, { minP: 0.2, topK: 3 }), [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95]);
    assertFrequencies(frequencies(logits, { minP: 0.2, topK: 2, temperature: 1 }), [0, 0.625, 0, 0.375]);
  });

  it('applies top_p to the distribution renormalised after top_k', () => {
    // After top_k = 2: [0.625, 0.375]; p = 0.55 then keeps only the first (0.625 >= 0.55). Measured on the
    // untruncated distribution the mass before the second token would be 0.5 < 0.55 and keep both.
    assertFrequencies(frequencies(logits, { topK: 2, topP: 0.55 }), [0, 1, 0, 0]);
  });

  it('top_p over a large flat vocabulary keeps exactly the smallest top set with the mass', () => {
    const vocabSize = 1000;
    const rng = Xoshiro128.fromSeed(11);
    const row = Array.from({ length: vocabSize }, () => rng.nextFloat() * 0.5);
    const probabilities = softmax(row);
    const ranked = [...probabilities.keys()].sort((a, b) => probabilities[b]! - probabilities[a]! || a - b);
    const expected = new Array<number>(vocabSize).fill(0);
    let massBefore = 0;
    for (const id of ranked) {
      if (massBefore >= 0.6) break;
      expected[id] = probabilities[id]!;
      massBefore += probabilities[id]!;
    }
    const keptIds = ranked.filter((id) => expected[id]! > 0);
    assert.ok(keptIds.length > 300, 'a large kept set, so selection descends through many partitions');
    const observed = frequencies(row, { topP: 0.6 }, 10_000);
    for (let id = 0; id < vocabSize; id++) if (expected[id] === 0) assert.equal(observed[id], 0, `token ${id} is outside top_p`);
    // Mass on the lower-ranked half of the kept set: a sampler that kept too few would put nothing there.
    const tail = keptIds.slice(keptIds.length / 2);
    const tailExpected = tail.reduce((sum, id) => sum + expected[id]!, 0) / massBefore;
    const tailObserved = tail.reduce((sum, id) => sum + observed[id]!, 0);
    assert.ok(Math.abs(tailObserved - tailExpected) < FREQUENCY_TOLERANCE, `${tailObserved} vs ${tailExpected}`);
  });
});

describe('Sampler: penalties and biases', () => {
  it('applies repetition, frequency and presence penalties as computed by hand', () => {
    // prompt [0, 1], outputs [1, 3, 3]; repetition 2, frequency 0.5, presence 0.25:
    //   id 0 (prompt):            2 / 2                     = 1
    //   id 1 (prompt, output x1): -1 * 2 - 0.5 * 1 - 0.25   = -2.75
    //   id 2 (unseen):            0.5
    //   id 3 (output x2):         3 / 2 - 0.5 * 2 - 0.25    = 0.25
    //   id 4 (unseen):            -2
    const seq = sequence(5, { repetitionPenalty: 2, frequencyPenalty: 0.5, presencePenalty: 0.25 }, { prompt: [0, 1] });
    for (const id of [1, 3, 3]) seq.recordOutputToken(id);
    const logits = Float32Array.from([2, -1, 0.5, 3, -2]);
    seq.applyLogitProcessors(logits);
    assert.deepEqual([...logits], [1, -2.75, 0.5, 0.25, -2]);
  });

  it('penalises a token once however often it is in the prompt and output', () => {
    const seq = sequence(2, { repetitionPenalty: 4 }, { prompt: [0, 0, 0] });
    seq.recordOutputToken(0);
    const logits = Float32Array.from([8, 1]);
    seq.applyLogitProcessors(logits);
    assert.deepEqual([...logits], [2, 1]);
  });

  it('feeds penalised logits to the processed logprobs and the draw', () => {
    const sampler = new Sampler(5, { logprobsMode: 'processed' });
    const seq = sequence(5, { repetitionPenalty: 2, frequencyPenalty: 0.5, presencePenalty: 0.25, logprobs: 5 }, { prompt: [0, 1] });
    for (const id of [1, 3, 3]) seq.recordOutputToken(id);
    const row = Float32Array.from([2, -1, 0.5, 3, -2]);
    const { tokenId, logprobs } = sampler.sampleRow(row, seq);
    const expected = logSoftmax([1, -2.75, 0.5, 0.25, -2]);
    // All five alternatives, best first by the penalised values (the raw row's best would be id 3).
    assert.deepEqual(logprobs!.top.map((t) => t.tokenId), [0, 2, 3, 4, 1]);
    for (const { tokenId: id, logprob } of logprobs!.top) assert.ok(Math.abs(logprob - expected[id]!) < 1e-6);
    assert.equal(logprobs!.tokenId, tokenId);
    assert.ok(Math.abs(logprobs!.logprob - expected[tokenId]!) < 1e-6);
    // The draw sees the penalised values too: greedily it picks id 0, where the raw row's argmax is id 3.
    const greedy = sequence(5, { temperature: 0, repetitionPenalty: 2, frequencyPenalty: 0.5, presencePenalty: 0.25 }, { prompt: [0, 1] });
    for (const id of [1, 3, 3]) greedy.recordOutputToken(id);
    assert.equal(sampler.sampleRow(row, greedy).tokenId, 0);
  });

  it('adds logit_bias before sampling, and -Infinity bans a token', () => {
    const sampler = new Sampler(3);
    const row = Float32Array.from([1, 2, 3]);
    assert.equal(sampler.sampleRow(row, sequence(3, { temperature: 0, logitBias: new Map([[0, 5]]) })).tokenId, 0);
    const banned = frequencies([1, 2, 3], { logitBias: new Map([[2, -Infinity]]) }, 2000);
    assert.equal(banned[2], 0);
    assertFrequencies(frequencies([0, 0, 0], { logitBias: new Map([[1, Math.log(2)]]) }), [0.25, 0.5, 0.25]);
  });
});

describe('Sampler: min_tokens, EOS and stop ids', () => {
  const EOS = 3;

  it('masks EOS and stop token ids until min_tokens outputs, then lets them through', () => {
    const sampler = new Sampler(5);
    const seq = sequence(5, { temperature: 0, minTokens: 3, stopTokenIds: [4] }, { eos: [EOS] });
    // EOS is the argmax, stop id 4 second, id 0 third.
    const row = Float32Array.from([1, 0, 0, 5, 4]);
    const picked = Array.from({ length: 4 }, () => sampler.sampleRow(row, seq).tokenId);
    assert.deepEqual(picked, [0, 0, 0, EOS]);
  });

  it('stops on EOS and stop_token_ids; ignore_eos keeps only the explicit stop ids', () => {
    assert.deepEqual([...sequence(5, { stopTokenIds: [4] }, { eos: [EOS] }).stopTokenIds].sort(), [3, 4]);
    assert.deepEqual([...sequence(5, { stopTokenIds: [4], ignoreEos: true }, { eos: [EOS] }).stopTokenIds], [4]);
    // With ignore_eos, min_tokens still masks EOS, as vLLM's min_tokens processor does: the EOS ends nothing, but
    // the first min_tokens outputs hold none.
    const seq = sequence(5, { temperature: 0, minTokens: 2, ignoreEos: true }, { eos: [EOS] });
    assert.equal(new Sampler(5).sampleRow(Float32Array.from([1, 0, 0, 5, 4]), seq).tokenId, 4);
  });
});

describe('Sampler: seeds and batches', () => {
  const vocabSize = 50;
  const steps = 20;
  const stepLogits = (() => {
    const rng = Xoshiro128.fromSeed(2024);
    return Array.from({ length: steps }, () => randomLogits(rng, vocabSize));
  })();

  function run(batchOf: (step: number, target: SequenceSampler) => SequenceSampler[], target: SequenceSampler): number[] {
    const sampler = new Sampler(vocabSize);
    const tokens: number[] = [];
    for (let step = 0; step < steps; step++) {
      const batch = batchOf(step, target);
      const logits = new Float32Array(batch.length * vocabSize);
      // Every row gets this step's logits for the target; other rows get the same values, as the real case would.
      batch.forEach((_, row) => logits.set(stepLogits[step]!, row * vocabSize));
      const results: SampledToken[] = sampler.sample(logits, batch);
      tokens.push(results[batch.indexOf(target)]!.tokenId);
    }
    return tokens;
  }

  const sampling = { temperature: 1, topK: 20, topP: 0.95 };

  it('gives a seeded sequence the same tokens alone or in any batch', () => {
    const alone = run((_, t) => [t], sequence(vocabSize, sampling, { seed: 7 }));
    const others = [sequence(vocabSize, sampling, { seed: 8 }), sequence(vocabSize, sampling, { seed: 9 })];
    const shifting = run(
      (step, t) => (step % 3 === 0 ? [t] : step % 3 === 1 ? [others[0]!, t] : [others[1]!, others[0]!, t]),
      sequence(vocabSize, sampling, { seed: 7 }),
    );
    assert.deepEqual(shifting, alone);
    assert.ok(new Set(alone).size > 3, 'a random stream, not a constant');
  });

  it('gives each completion index its own stream from the same request seed', () => {
    const many = { ...sampling, n: 3 };
    const first = run((_, t) => [t], sequence(vocabSize, many, { seed: 7, index: 0 }));
    const second = run((_, t) => [t], sequence(vocabSize, many, { seed: 7, index: 1 }));
    const secondAgain = run((_, t) => [t], sequence(vocabSize, many, { seed: 7, index: 1 }));
    assert.notDeepEqual(first, second);
    assert.deepEqual(second, secondAgain);
  });

  it('creates a request\'s n sequences from its seed, or from one seed drawn for the whole request', () => {
    const streams = (seed: number | undefined) => createRequestSamplers({
      params: params({ seed, n: 2 }), promptTokenIds: [], vocabSize, eosTokenIds: [],
    }).map((seq) => Array.from({ length: 3 }, () => seq.nextUniform()));
    const seeded = streams(7);
    const manual = [0, 1].map((index) => {
      const seq = sequence(vocabSize, { n: 2 }, { seed: 7, index });
      return Array.from({ length: 3 }, () => seq.nextUniform());
    });
    assert.deepEqual(seeded, manual);
    const [first, second] = streams(undefined);
    assert.notDeepEqual(first, second);
    assert.notDeepEqual(streams(undefined)[0], first);
  });

  it('checks the logits shape against the batch', () => {
    const sampler = new Sampler(4);
    assert.throws(() => sampler.sample(new Float32Array(7), [sequence(4), sequence(4)]), /expected 2 rows x vocabSize 4/);
    assert.throws(() => sampler.sampleRow(new Float32Array(4), sequence(5)), /vocabSize 5/);
  });
});

describe('Sampler: a weighing pass given by the backend', () => {
  it('draws what the sampler draws alone, the scaling left to the pass (plain, min_p, top_p, top_k, guided weighing)', () => {
    const vocabSize = 3000;
    const rng = Xoshiro128.fromSeed(31);
    const rows = Array.from({ length: 40 }, () => randomLogits(rng, vocabSize).map((v) => v * 2));
    let calls = 0;
    // The backend's pass as the engine gets it (ModelRunnerBackend.sampleWeigh): here weighCandidates itself, so the
    // Sampler takes the path that leaves 1/T to the pass.
    const given = new Sampler(vocabSize, { weigh: (...args) => { calls++; return weighCandidates(...args); } });
    const alone = new Sampler(vocabSize);
    for (const overrides of [{ temperature: 0.7 }, { temperature: 1.3, minP: 0.02 }, { temperature: 0.8, topP: 0.9 },
      { temperature: 1, topK: 40, minP: 0.01 }]) {
      const draws = (sampler: Sampler) => {
        const seq = sequence(vocabSize, overrides, { seed: 77 });
        return rows.map((row) => sampler.sampleRow(row, seq).tokenId);
      };
      const expected = draws(alone);
      assert.deepEqual(draws(given), expected, JSON.stringify(overrides));
      assert.ok(new Set(expected).size > 5, `${JSON.stringify(overrides)}: random draws`);
    }
    // Guided rows are weighed once and drawn from by a search (weighRow, drawWeighed).
    const seqA = sequence(vocabSize, { temperature: 0.6 }, { seed: 5 });
    const seqB = sequence(vocabSize, { temperature: 0.6 }, { seed: 5 });
    for (const row of rows) {
      const a = given.drawWeighed(given.weighRow(row, seqA), 0.37);
      const b = alone.drawWeighed(alone.weighRow(row, seqB), 0.37);
      assert.equal(a, b);
      assert.deepEqual(given.rowWeights, alone.rowWeights);
    }
    assert.ok(calls >= rows.length * 3, `the given pass weighed the rows (${calls} calls)`);
  });
});

describe('Sampler: a scaled copy given by the backend', () => {
  it('scales the rows that need a copy with it (top_p, logit processors) and draws what the sampler draws alone', () => {
    const vocabSize = 3000;
    const rng = Xoshiro128.fromSeed(37);
    const rows = Array.from({ length: 30 }, () => randomLogits(rng, vocabSize).map((v) => v * 2));
    const calls: string[] = [];
    const given = new Sampler(vocabSize, {
      scale: (row, out, factor) => {
        calls.push(row === out ? 'in place' : 'copy');
        scaleRow(row, out, factor);
      },
    });
    const alone = new Sampler(vocabSize);
    for (const [overrides, expectedCall] of [[{ temperature: 0.8, topP: 0.9 }, 'copy'],
      [{ temperature: 1.4, minP: 0.05, logitBias: new Map([[3, 4]]) }, 'in place']] as const) {
      const draws = (sampler: Sampler) => {
        const seq = sequence(vocabSize, overrides, { seed: 91, prompt: [1, 2, 3] });
        return rows.map((row) => sampler.sampleRow(row, seq).tokenId);
      };
      calls.length = 0;
      const got = draws(given);
      assert.deepEqual(got, draws(alone), JSON.stringify(overrides));
      assert.deepEqual(new Set(calls), new Set([expectedCall]), `${JSON.stringify(overrides)}: ${calls.length} calls`);
      assert.equal(calls.length, rows.length);
    }
  });
});

describe('Sampler: logprobs', () => {
  const raw = [2, -1, 0.5, 3, -2, 0];

  function sampleWith(mode: LogprobsMode, overrides: Partial<SamplingParams>): SampledToken {
    return new Sampler(raw.length, { logprobsMode: mode }).sampleRow(Float32Array.from(raw), sequence(raw.length, overrides));
  }

  it('raw mode gives the log-softmax of the model logits, whatever the temperature and filters', () => {
    const expected = logSoftmax(raw);
    const { tokenId, logprobs } = sampleWith('raw', { temperature: 0.3, topK: 2, logprobs: raw.length });
    assert.equal(logprobs!.tokenId, tokenId);
    assert.ok(Math.abs(logprobs!.logprob - expected[tokenId]!) < 1e-6);
    const total = logprobs!.top.reduce((sum, { logprob }) => sum + Math.exp(logprob), 0);
    assert.ok(Math.abs(total - 1) < 1e-6, `probabilities sum to ${total}`);
    for (const { tokenId: id, logprob } of logprobs!.top) assert.ok(Math.abs(logprob - expected[id]!) < 1e-6);
  });

  it('processed mode gives the log-softmax after temperature', () => {
    const expected = logSoftmax(raw.map((l) => l / 0.5));
    const { logprobs } = sampleWith('processed', { temperature: 0.5, logprobs: 3 });
    assert.deepEqual(logprobs!.top.map((t) => t.tokenId), [3, 0, 2]);
    for (const { tokenId, logprob } of logprobs!.top) assert.ok(Math.abs(logprob - expected[tokenId]!) < 1e-6);
  });

  it("takes the normaliser from the backend's weighing pass: the log-softmax of a large row with masked tokens", () => {
    const vocabSize = 5000;
    const rng = Xoshiro128.fromSeed(41);
    let calls = 0;
    const given = new Sampler(vocabSize, { weigh: (...args) => { calls++; return weighCandidates(...args); } });
    for (let r = 0; r < 4; r++) {
      const row = randomLogits(rng, vocabSize).map((v) => v * 3);
      for (let i = r; i < vocabSize; i += 7) row[i] = -Infinity;
      const values = Array.from(row);
      const expected = logSoftmax(values);
      const ranked = values.map((_, i) => i).sort((a, b) => values[b]! - values[a]! || a - b);
      // Greedy (no draw weighs the row: the logprobs alone call the pass), a draw at 0.7 (it weighs the row at 1/T,
      // the logprobs at 1), and a draw at temperature 1, whose weighing of the row the logprobs reuse.
      for (const [overrides, passes] of [[{ temperature: 0, logprobs: 8 }, 1], [{ temperature: 0.7, logprobs: 3 }, 2],
        [{ temperature: 1, logprobs: 4 }, 1]] as const) {
        const before = calls;
        const { tokenId, logprobs } = given.sampleRow(row, sequence(vocabSize, overrides, { seed: r }));
        assert.equal(calls - before, passes, `${JSON.stringify(overrides)}: passes over the row`);
        assert.ok(Math.abs(logprobs!.logprob - expected[tokenId]!) < 1e-9, `token ${tokenId}: ${logprobs!.logprob} against ${expected[tokenId]}`);
        assert.deepEqual(logprobs!.top.map((t) => t.tokenId), ranked.slice(0, overrides.logprobs));
        for (const { tokenId: id, logprob } of logprobs!.top) {
          assert.ok(Math.abs(logprob - expected[id]!) < 1e-9, `alternative ${id}: ${logprob} against ${expected[id]}`);
        }
      }
    }
  });

  it('ranks few and many alternatives best first, ties to the lower id', () => {
    const rng = Xoshiro128.fromSeed(12);
    // Three distinct values over 120 ids: the cuts at 20 and 90 fall inside runs of ties.
    const row = Float32Array.from({ length: 120 }, () => rng.nextUint32() % 3);
    const ranked = [...row.keys()].sort((a, b) => row[b]! - row[a]! || a - b);
    for (const count of [20, 90]) {
      const { logprobs } = new Sampler(120).sampleRow(row, sequence(120, { temperature: 0, logprobs: count }));
      assert.deepEqual(logprobs!.top.map((t) => t.tokenId), ranked.slice(0, count));
    }
  });

  it('lists the best alternatives in order and only the chosen token when logprobs = 0', () => {
    const { logprobs } = sampleWith('raw', { temperature: 0, logprobs: 2 });
    assert.deepEqual(logprobs!.top.map((t) => t.tokenId), [3, 0]);
    assert.equal(logprobs!.tokenId, 3);
    assert.deepEqual(sampleWith('raw', { temperature: 0, logprobs: 0 }).logprobs!.top, []);
    assert.equal(sampleWith('raw', { temperature: 0 }).logprobs, undefined);
  });
});

describe('validateSamplingParams', () => {
  const cases: [Partial<SamplingParams>, RegExp][] = [
    [{ temperature: -1 }, /temperature must be finite and >= 0/],
    [{ topP: 0 }, /topP must be in \(0, 1\]/],
    [{ topK: 2.5 }, /topK must be an integer/],
    [{ minP: 1.5 }, /minP must be in \[0, 1\]/],
    [{ repetitionPenalty: 0 }, /repetitionPenalty must be finite and > 0/],
    [{ presencePenalty: 3 }, /presencePenalty must be in \[-2, 2\]/],
    [{ frequencyPenalty: NaN }, /frequencyPenalty must be in \[-2, 2\]/],
    [{ logprobs: 11 }, /logprobs must be null or an integer in \[0, 10\]/],
    [{ stopTokenIds: [10] }, /stopTokenIds has token id 10 outside \[0, 10\)/],
    [{ logitBias: new Map([[-1, 1]]) }, /logitBias has token id -1/],
    [{ logitBias: new Map([[1, NaN]]) }, /logitBias for token 1/],
    [{ minTokens: -1 }, /minTokens must be an integer >= 0/],
  ];
  for (const [overrides, message] of cases) {
    it(`rejects ${JSON.stringify(overrides, (_, v) => (v instanceof Map ? [...v] : v))}`, () => {
      assert.throws(() => validateSamplingParams(params(overrides), 10), message);
    });
  }

  it('accepts the defaults and rejects a completion index beyond n', () => {
    validateSamplingParams(params(), 10);
    assert.throws(() => sequence(10, { n: 2 }, { index: 2 }), /completionIndex must be an integer in \[0, n=2\)/);
  });
});
