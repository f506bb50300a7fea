import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import {
  addBias, applyRope, argmax, causalAttention, dot, matmul, rmsnorm, ropeAngles, ropeFrequencies, silu, softmax,
  swiglu,
} from '../../src/model/reference-math.ts';
import { llama3FreqFactors } from '../../src/model/gguf-model.ts';
import type { Llama3RopeScaling } from '../../src/model/config.ts';

function assertAllClose(actual: ArrayLike<number>, expected: number[], tolerance = 1e-6): void {
  assert.equal(actual.length, expected.length, 'length');
  for (let i = 0; i < expected.length; i++) {
    assert.ok(Math.abs(actual[i]! - expected[i]!) <= tolerance * Math.max(1, Math.abs(expected[i]!)),
      `element ${i}: ${actual[i]} != ${expected[i]}`);
  }
}

describe('reference vector kernels', () => {
  it('dot covers every length around the 4-way unroll, at offsets', () => {
    for (let length = 0; length <= 9; length++) {
      const a = Float32Array.from({ length: length + 3 }, (_, i) => i + 1);
      const b = Float32Array.from({ length: length + 2 }, (_, i) => 10 - i);
      let expected = 0;
      for (let i = 0; i < length; i++) expected += (i + 3 + 1) * (10 - (i + 2));
      assert.equal(dot(a, 3, b, 2, length), expected, `length ${length}`);
    }
  });

  it('rmsnorm divides by the root mean square and scales by the weight, row by row', () => {
    // Row 0: mean of squares (1 + 4 + 9 + 16) / 4 = 7.5; row 1 is row 0 doubled, so it normalizes the same.
    const x = Float32Array.of(1, 2, 3, 4, 2, 4, 6, 8);
    const out = new Float32Array(8);
    rmsnorm(out, x, Float32Array.of(1, 1, 2, 0.5), 2, 4, 0);
    const s = 1 / Math.sqrt(7.5);
    assertAllClose(out, [s, 2 * s, 6 * s, 2 * s, s, 2 * s, 6 * s, 2 * s]);
    rmsnorm(out, Float32Array.of(0, 0, 0, 0), Float32Array.of(1, 1, 1, 1), 1, 4, 1e-5);
    assertAllClose(out.subarray(0, 4), [0, 0, 0, 0]); // eps keeps a zero row finite
  });

  it('matmul computes W x for each row with W stored as output rows of contiguous inputs', () => {
    const w = Float32Array.of(1, 2, 3, /* output 1 */ 4, 5, 6); // ggml shape [3 inputs, 2 outputs]
    const x = Float32Array.of(1, 0, -1, /* row 1 */ 2, 1, 0);
    const out = new Float32Array(4);
    matmul(out, x, w, 2, 3, 2);
    assertAllClose(out, [-2, -2, 4, 13]);
  });

  it('addBias adds to every row', () => {
    const rows = Float32Array.of(1, 2, 3, 4);
    addBias(rows, Float32Array.of(10, 20), 2, 2);
    assertAllClose(rows, [11, 22, 13, 24]);
  });

  it('softmax, silu, swiglu and argmax', () => {
    const x = Float64Array.of(99, 1, 2, 3);
    softmax(x, 1, 3);
    const total = Math.exp(-2) + Math.exp(-1) + 1;
    assertAllClose(x, [99, Math.exp(-2) / total, Math.exp(-1) / total, 1 / total]);
    const large = Float64Array.of(1000, 1000);
    softmax(large, 0, 2);
    assertAllClose(large, [0.5, 0.5]); // no overflow: the max is subtracted first
    assertAllClose([silu(1), silu(0), silu(-2)], [1 / (1 + Math.exp(-1)), 0, -2 / (1 + Math.exp(2))]);
    const gate = Float32Array.of(1, -2);
    swiglu(gate, Float32Array.of(3, 0.5), 2);
    assertAllClose(gate, [3 * silu(1), 0.5 * silu(-2)]);
    assert.equal(argmax(Float32Array.of(0, 5, 2, 5), 0, 4), 1);
    assert.equal(argmax(Float32Array.of(9, 1, 3), 1, 2), 1);
  });
});

describe('reference RoPE', () => {
  it('frequencies are base^(-2i/ropeDim), divided by the factor under linear scaling', () => {
    assertAllClose(ropeFrequencies(4, 10000), [1, 0.01]);
    assertAllClose(ropeFrequencies(6, 1000000), [1, 0.01, 0.0001]);
    assertAllClose(ropeFrequencies(4, 10000, { type: 'linear', factor: 4 }), [0.25, 0.0025]);
  });

  it('llama3 scaling matches the frequency factors the GGUF code derives (llama.cpp rope_freqs)', () => {
    const cases: Array<[Llama3RopeScaling, number, number]> = [
      [{ type: 'llama3', factor: 8, lowFreqFactor: 1, highFreqFactor: 4, originalContextLength: 8192 }, 500000, 128],
      [{ type: 'llama3', factor: 8, lowFreqFactor: 1, highFreqFactor: 4, originalContextLength: 32 }, 100, 8],
      [{ type: 'llama3', factor: 32, lowFreqFactor: 1, highFreqFactor: 4, originalContextLength: 8192 }, 500000, 64],
    ];
    for (const [scaling, base, ropeDim] of cases) {
      const divisors = llama3FreqFactors(scaling, base, ropeDim);
      const expected = Array.from(divisors, (d, i) => base ** (-(2 * i) / ropeDim) / d);
      assertAllClose(ropeFrequencies(ropeDim, base, scaling), expected, 1e-6);
    }
    // Hand check of the three bands for base 100, ropeDim 8, original context 32 (bands at wavelengths 8 and 32):
    // pair 0 has wavelength 2*pi (kept), pair 1 ~19.87 (blended), pairs 2 and 3 ~62.8 and ~198.7 (divided by 8).
    const f1 = 100 ** -0.25;
    const smooth = (32 / ((2 * Math.PI) / f1) - 1) / 3;
    assertAllClose(ropeFrequencies(8, 100, cases[1]![0]), [1, (1 - smooth) * f1 / 8 + smooth * f1, 0.1 / 8, 100 ** -0.75 / 8]);
  });

  it('rejects impossible settings', () => {
    assert.throws(() => ropeFrequencies(5, 10000), /positive even integer, got 5/);
    assert.throws(() => ropeFrequencies(4, 10000, { type: 'linear', factor: 0 }), /factor must be positive/);
    assert.throws(() => ropeFrequencies(4, 10000,
      { type: 'llama3', factor: 8, lowFreqFactor: 4, highFreqFactor: 1, originalContextLength: 8192 }),
    /highFreqFactor > lowFreqFactor/);
  });

  it('interleaved rotates pairs (2i, 2i+1), neox pairs (i, i + ropeDim/2); dimensions past ropeDim pass through', () => {
    // A quarter turn on pair 0 and no turn on pair 1.
    const cos = Float64Array.of(0, 1);
    const sin = Float64Array.of(1, 0);
    const interleaved = Float32Array.of(1, 2, 3, 4, 5, 6);
    applyRope(interleaved, 0, 1, 6, 'interleaved', cos, sin);
    assertAllClose(interleaved, [-2, 1, 3, 4, 5, 6]);
    const neox = Float32Array.of(1, 2, 3, 4, 5, 6, /* second head */ 1, 2, 3, 4, 5, 6);
    applyRope(neox, 0, 2, 6, 'neox', cos, sin);
    assertAllClose(neox, [-3, 2, 1, 4, 5, 6, -3, 2, 1, 4, 5, 6]);
  });

  it('angles are position times frequency', () => {
    const cos = new Float64Array(2);
    const sin = new Float64Array(2);
    ropeAngles(3, Float64Array.of(1, 0.5), cos, sin);
    assertAllClose(cos, [Math.cos(3), Math.cos(1.5)]);
    assertAllClose(sin, [Math.sin(3), Math.sin(1.5)]);
  });
});

describe('reference causal attention', () => {
  it('weights values by softmax(q.k / sqrt(headDim)) over positions up to the query\'s own', () => {
    // headDim 2, one KV head shared by two query heads, two positions.
    const keys = Float32Array.of(1, 0, /* position 1 */ 0, 1);
    const values = Float32Array.of(1, 2, /* position 1 */ 3, 4);
    // Row 0 at position 0 sees only position 0. Row 1 at position 1: head 0 scores (ln 3, 0) after scaling, so
    // weights 3/4 and 1/4; head 1 scores (0, 0), weights 1/2 each.
    const q = Float32Array.of(5, 7, -1, 2, /* row 1 */ Math.SQRT2 * Math.log(3), 0, 0, 0);
    const out = new Float32Array(8);
    causalAttention(out, q, 0, 2, 0, keys, values, { numHeads: 2, numKvHeads: 1, headDim: 2 });
    assertAllClose(out, [1, 2, 1, 2, 0.75 * 1 + 0.25 * 3, 0.75 * 2 + 0.25 * 4, 2, 3]);
  });

  it('query head h reads KV head floor(h / (numHeads / numKvHeads)), and writes at firstRow', () => {
    const keys = Float32Array.of(0, 0, 0, 0);
    const values = Float32Array.of(10, 11, 20, 21); // one position, KV head 0 then KV head 1
    const out = new Float32Array(2 * 8).fill(-1);
    causalAttention(out, new Float32Array(16), 1, 1, 0, keys, values, { numHeads: 4, numKvHeads: 2, headDim: 2 });
    assertAllClose(out, [-1, -1, -1, -1, -1, -1, -1, -1, 10, 11, 10, 11, 20, 21, 20, 21]);
  });
});
