import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { GgmlType } from '../../src/model/ggml-types.ts';
import {
  bf16BitsToF32, dequantize, dequantizeRow, dequantizeTensor, f16BitsToF32, f32ToBf16Bits, f32ToF16Bits, quantize,
  UnsupportedTypeError,
} from '../../src/model/quant.ts';
import { SeededRandom } from '../../src/model/synthetic.ts';
import type { Tensor } from '../../src/model/weights.ts';

/** Plain numbers with -0 folded into 0 (a zero scale times a negative level gives -0, which is still zero). */
function plain(values: Float32Array): number[] {
  return [...values].map((v) => v + 0);
}

function tensor(type: GgmlType, shape: number[], data: Uint8Array): Tensor {
  return { name: 'test.weight', type, shape, data };
}

// ---------------------------------------------------------------------------------------------------------------
describe('f16 conversion', () => {
  const cases: [number, number, string][] = [
    [1, 0x3c00, 'one'],
    [-2, 0xc000, 'minus two'],
    [0.1, 0x2e66, '0.1 rounds to nearest'],
    [65504, 0x7bff, 'largest finite'],
    [65519, 0x7bff, 'just below the overflow tie stays finite'],
    [65520, 0x7c00, 'tie at the top rounds to even, which is infinity'],
    [1e6, 0x7c00, 'overflow'],
    [2 ** -14, 0x0400, 'smallest normal'],
    [2 ** -24, 0x0001, 'smallest subnormal'],
    [1023 * 2 ** -24, 0x03ff, 'largest subnormal'],
    [2 ** -25, 0x0000, 'half the smallest subnormal ties to even zero'],
    [1.5 * 2 ** -25, 0x0001, 'above the tie rounds up'],
    [3 * 2 ** -25, 0x0002, 'subnormal tie rounds to even'],
    [1 + 2 ** -11, 0x3c00, 'normal tie to even (down)'],
    [1 + 3 * 2 ** -11, 0x3c02, 'normal tie to even (up)'],
    [4095 * 2 ** -25, 0x0800, 'a tie that carries out of the mantissa bumps the exponent'],
    [Infinity, 0x7c00, '+inf'],
    [-Infinity, 0xfc00, '-inf'],
    [-0, 0x8000, 'negative zero'],
  ];
  for (const [value, bits, label] of cases) {
    it(`encodes ${label}`, () => assert.equal(f32ToF16Bits(value), bits, `${value}`));
  }

  it('keeps NaN a NaN both ways', () => {
    const bits = f32ToF16Bits(NaN);
    assert.equal(bits & 0x7c00, 0x7c00);
    assert.notEqual(bits & 0x03ff, 0);
    assert.ok(Number.isNaN(f16BitsToF32(0x7e00)));
    assert.ok(Number.isNaN(f16BitsToF32(0xfc01)));
  });

  it('decodes normals, subnormals and infinities', () => {
    assert.equal(f16BitsToF32(0x3555), 0.333251953125);
    assert.equal(f16BitsToF32(0x8001), -(2 ** -24));
    assert.equal(f16BitsToF32(0x7bff), 65504);
    assert.equal(f16BitsToF32(0xfc00), -Infinity);
    assert.ok(Object.is(f16BitsToF32(0x8000), -0));
  });

  it('round-trips every finite half exactly', () => {
    for (let h = 0; h < 0x10000; h++) {
      if ((h & 0x7c00) === 0x7c00) continue;
      assert.equal(f32ToF16Bits(f16BitsToF32(h)), h);
    }
  });
});

describe('bf16 conversion', () => {
  it('rounds to nearest even and handles specials', () => {
    assert.equal(f32ToBf16Bits(1), 0x3f80);
    assert.equal(f32ToBf16Bits(1 + 2 ** -8), 0x3f80);
    assert.equal(f32ToBf16Bits(1 + 3 * 2 ** -8), 0x3f82);
    assert.equal(f32ToBf16Bits(-Infinity), 0xff80);
    assert.equal(f32ToBf16Bits(3.4028234663852886e38), 0x7f80, 'largest f32 rounds up to infinity');
    assert.equal(f32ToBf16Bits(2 ** -133), 0x0001, 'f32 subnormal');
    assert.ok(Number.isNaN(bf16BitsToF32(f32ToBf16Bits(NaN))));
    assert.equal(bf16BitsToF32(0x4049), 3.140625);
    assert.equal(bf16BitsToF32(0xc000), -2);
  });
});

// ---------------------------------------------------------------------------------------------------------------
describe('dequantization of hand-made blocks', () => {
  it('F32, F16 and BF16 rows', () => {
    const f32 = new Uint8Array(new Float32Array([1.5, -2, 0.25, 8]).buffer);
    assert.deepEqual([...dequantizeRow(tensor(GgmlType.F32, [2, 2], f32), 1, new Float32Array(2))], [0.25, 8]);
    // Unaligned f32 data (a view at an odd offset) decodes the same.
    const shifted = new Uint8Array(17);
    shifted.set(f32, 1);
    assert.deepEqual([...dequantizeTensor(tensor(GgmlType.F32, [4], shifted.subarray(1)))], [1.5, -2, 0.25, 8]);
    const f16 = new Uint8Array([0x00, 0x3c, 0x00, 0xc0, 0x00, 0x7c]);
    assert.deepEqual([...dequantizeTensor(tensor(GgmlType.F16, [3], f16))], [1, -2, Infinity]);
    const bf16 = new Uint8Array([0x80, 0x3f, 0x49, 0x40]);
    assert.deepEqual([...dequantizeTensor(tensor(GgmlType.BF16, [2], bf16))], [1, 3.140625]);
  });

  it('Q8_0: d = 0.5 times signed bytes', () => {
    const block = new Uint8Array(34);
    block[0] = 0x00; block[1] = 0x38; // f16 0.5
    const qs = [-128, -1, 0, 1, 127];
    qs.forEach((q, j) => { block[2 + j] = q & 0xff; });
    const expected = new Array(32).fill(0);
    expected.splice(0, 5, -64, -0.5, 0, 0.5, 63.5);
    assert.deepEqual([...dequantizeTensor(tensor(GgmlType.Q8_0, [32], block))], expected);
  });

  it('Q4_0: low nibbles are elements 0..15, high nibbles 16..31, offset 8', () => {
    const block = new Uint8Array(18);
    block[0] = 0x00; block[1] = 0x38; // d = 0.5
    block.fill(0x88, 2); // every nibble 8 -> 0
    block[2] = 0x0f; // element 0: (15-8)*0.5 = 3.5, element 16: (0-8)*0.5 = -4
    block[3] = 0x81; // element 1: (1-8)*0.5 = -3.5, element 17: 0
    block[17] = 0xa3; // element 15: (3-8)*0.5 = -2.5, element 31: (10-8)*0.5 = 1
    const expected = new Array(32).fill(0);
    expected[0] = 3.5; expected[16] = -4; expected[1] = -3.5; expected[15] = -2.5; expected[31] = 1;
    assert.deepEqual([...dequantizeTensor(tensor(GgmlType.Q4_0, [32], block))], expected);
  });

  it('Q4_1: q * d + m, nibbles as Q4_0', () => {
    const block = new Uint8Array(20);
    block[0] = 0x00; block[1] = 0x38; // d = 0.5
    block[2] = 0x00; block[3] = 0xbc; // m = -1
    block[4] = 0x0f; // element 0: 15 * 0.5 - 1 = 6.5, element 16: -1
    block[19] = 0xa3; // element 15: 3 * 0.5 - 1 = 0.5, element 31: 10 * 0.5 - 1 = 4
    const expected = new Array(32).fill(-1);
    expected[0] = 6.5; expected[15] = 0.5; expected[31] = 4;
    assert.deepEqual([...dequantizeTensor(tensor(GgmlType.Q4_1, [32], block))], expected);
  });

  it('Q5_0: bit j of the little-endian qh is the fifth bit of element j, offset 16', () => {
    const block = new Uint8Array(22);
    block[0] = 0x00; block[1] = 0x38; // d = 0.5
    block.fill(0x00, 6); // every nibble 0 and no fifth bit -> (0 - 16) * 0.5 = -8
    block[2] = 0b1; // element 0's fifth bit
    block[5] = 0b1000_0000; // bit 31: element 31's fifth bit
    block[4] = 0b1; // bit 16: element 16's fifth bit
    block[6] = 0x3f; // element 0: (15 + 16 - 16) * 0.5 = 7.5, element 16: (3 + 16 - 16) * 0.5 = 1.5
    block[21] = 0x20; // element 15: -8, element 31: (2 + 16 - 16) * 0.5 = 1
    const expected = new Array(32).fill(-8);
    expected[0] = 7.5; expected[16] = 1.5; expected[31] = 1;
    assert.deepEqual([...dequantizeTensor(tensor(GgmlType.Q5_0, [32], block))], expected);
  });

  it('Q5_1: q * d + m with Q5_0\'s bits', () => {
    const block = new Uint8Array(24);
    block[0] = 0x00; block[1] = 0x38; // d = 0.5
    block[2] = 0x00; block[3] = 0xbc; // m = -1
    block[4] = 0b1; // element 0's fifth bit
    block[7] = 0b1000_0000; // element 31's fifth bit
    block[8] = 0x3f; // element 0: (15 + 16) * 0.5 - 1 = 14.5, element 16: 3 * 0.5 - 1 = 0.5
    block[23] = 0x20; // element 31: (2 + 16) * 0.5 - 1 = 8
    const expected = new Array(32).fill(-1);
    expected[0] = 14.5; expected[16] = 0.5; expected[31] = 8;
    assert.deepEqual([...dequantizeTensor(tensor(GgmlType.Q5_1, [32], block))], expected);
  });

  it('Q4_K: 6-bit packed scales and mins, nibble order per 64 elements', () => {
    const block = new Uint8Array(144);
    block[0] = 0x00; block[1] = 0x3c; // d = 1
    block[2] = 0x00; block[3] = 0x38; // dmin = 0.5
    const scales = block.subarray(4, 16);
    // Sub-block 0: scale 2, min 4 (low 6 bits of bytes 0 and 4).
    scales[0] = 2; scales[4] = 4;
    // Sub-block 5: scale 33 = 0b10_0001, min 50 = 0b11_0010. Low nibbles in byte 9 (scale low, min high); top two
    // bits in bits 6..7 of byte 1 (scale) and byte 5 (min).
    scales[9] = 0x01 | (0x02 << 4);
    scales[1] = 0b10 << 6;
    scales[5] = 0b11 << 6;
    const qs = block.subarray(16);
    qs[0] = 0x07; // element 0 (sub-block 0, low nibble) = 7
    qs[64] = 0x30; // element 160 (sub-block 5 = high nibbles of bytes 64..95) = 3
    const out = dequantizeTensor(tensor(GgmlType.Q4_K, [256], block));
    const expected = new Float32Array(256);
    for (let i = 0; i < 32; i++) expected[i] = -0.5 * 4; // q = 0: -dmin * m
    expected[0] = 1 * 2 * 7 - 0.5 * 4; // 12
    for (let i = 160; i < 192; i++) expected[i] = -0.5 * 50;
    expected[160] = 1 * 33 * 3 - 0.5 * 50; // 74
    assert.deepEqual(plain(out), plain(expected));
  });

  it('Q5_K: Q4_K scales and nibbles, the fifth bit of sub-block s in bit s of qh', () => {
    const block = new Uint8Array(176);
    block[0] = 0x00; block[1] = 0x3c; // d = 1
    block[2] = 0x00; block[3] = 0x38; // dmin = 0.5
    const scales = block.subarray(4, 16);
    scales[0] = 2; scales[4] = 4; // sub-block 0: scale 2, min 4
    scales[9] = 0x01 | (0x02 << 4); scales[1] = 0b10 << 6; scales[5] = 0b11 << 6; // sub-block 5: scale 33, min 50
    const qh = block.subarray(16, 48);
    const qs = block.subarray(48);
    qs[0] = 0x07; qh[0] = 0b1; // element 0 (sub-block 0, low nibble, bit 0 of qh[0]) = 7 + 16
    qs[64 + 3] = 0x30; qh[3] = 0b10_0000; // element 163 (sub-block 5: high nibbles of bytes 64..95, bit 5) = 3 + 16
    qh[4] = 0b1_0000; // element 132 (sub-block 4: low nibbles of bytes 64..95, bit 4) = 0 + 16
    const out = dequantizeTensor(tensor(GgmlType.Q5_K, [256], block));
    const expected = new Float32Array(256);
    for (let i = 0; i < 32; i++) expected[i] = -0.5 * 4;
    expected[0] = 1 * 2 * 23 - 0.5 * 4;
    for (let i = 160; i < 192; i++) expected[i] = -0.5 * 50;
    expected[163] = 1 * 33 * 19 - 0.5 * 50;
    // Sub-block 4 has scale and min 0 (byte 8 is 0): its fifth bit still decodes to 0.
    expected[132] = 0;
    assert.deepEqual(plain(out), plain(expected));
  });

  it('Q6_K: ql low/high nibbles, qh 2-bit pairs, int8 scales per 16 elements', () => {
    const block = new Uint8Array(210);
    block[208] = 0x00; block[209] = 0x34; // d = 0.25
    const scales = new Int8Array(block.buffer, 192, 16);
    scales[0] = -3;
    scales[12] = 7;
    // Element 0: low nibble of ql[0] = 5, bits 0..1 of qh[0] = 2 -> q = 5 + 32 - 32 = 5.
    block[0] = 0x05;
    block[128] = 0x02;
    // Element 200 = second 128-half, position 72 = quarter 2 (high nibbles of ql[64 + 0..31]), l = 8:
    // high nibble of ql[64 + 8] = 10, bits 4..5 of qh[128 + 32 + 8] = 1 -> q = 10 + 16 - 32 = -6.
    block[72] = 0xa0;
    block[168] = 0x01 << 4;
    const out = dequantizeTensor(tensor(GgmlType.Q6_K, [256], block));
    const expected = new Float32Array(256);
    for (let i = 0; i < 16; i++) expected[i] = 0.25 * -3 * -32; // stored 0 means q = -32
    expected[0] = 0.25 * -3 * 5;
    for (let i = 192; i < 208; i++) expected[i] = 0.25 * 7 * -32;
    expected[200] = 0.25 * 7 * -6;
    assert.deepEqual(plain(out), plain(expected));
  });

  it('dequantizeRow picks the right blocks of a multi-row tensor', () => {
    // 127 in every block makes d exactly 1, so the integers survive quantization unchanged.
    const values = new Float32Array(3 * 64).map((_, i) => (i % 32 === 0 ? 127 : (i % 7) - 3));
    const data = quantize(GgmlType.Q8_0, values);
    const row = dequantizeRow(tensor(GgmlType.Q8_0, [64, 3], data), 2, new Float32Array(64));
    assert.deepEqual([...row], [...values.subarray(128)]);
    assert.throws(() => dequantizeRow(tensor(GgmlType.Q8_0, [64, 3], data), 3, new Float32Array(64)), /row 3 is out of range/);
  });

  it('names unsupported types', () => {
    assert.throws(() => dequantizeTensor(tensor(GgmlType.Q3_K, [256], new Uint8Array(110))), (e: Error) =>
      e instanceof UnsupportedTypeError && /Q3_K/.test(e.message) && /tensor test.weight/.test(e.message));
    assert.throws(() => quantize(GgmlType.Q2_K, new Float32Array(256)), /Q2_K is not supported/);
    assert.throws(() => dequantize(GgmlType.Q8_0, new Uint8Array(33), 32, new Float32Array(32)), /need 34 bytes/);
  });
});

// ---------------------------------------------------------------------------------------------------------------
describe('quantize -> dequantize', () => {
  const random = new SeededRandom(7);
  const values = new Float32Array(4096).map(() => random.normal() * (random.next() < 0.1 ? 4 : 1));

  /** The worst error of each block stays within bound(block values). */
  function checkBound(type: GgmlType, blockSize: number, bound: (block: Float32Array) => number): void {
    const decoded = new Float32Array(values.length);
    dequantize(type, quantize(type, values), values.length, decoded);
    for (let b = 0; b < values.length / blockSize; b++) {
      const block = values.subarray(b * blockSize, (b + 1) * blockSize);
      const limit = bound(block);
      for (let i = 0; i < blockSize; i++) {
        const error = Math.abs(decoded[b * blockSize + i]! - block[i]!);
        assert.ok(error <= limit, `${GgmlType[type]} block ${b} element ${i}: error ${error} > ${limit}`);
      }
    }
  }
  const amax = (block: Float32Array): number => Math.max(...block.map(Math.abs));
  const range = (block: Float32Array): number => Math.max(...block) - Math.min(0, ...block);

  it('F32 is exact, F16 and BF16 within half an ulp', () => {
    checkBound(GgmlType.F32, 1, () => 0);
    checkBound(GgmlType.F16, 1, (b) => Math.max(Math.abs(b[0]!) * 2 ** -11, 2 ** -25));
    checkBound(GgmlType.BF16, 1, (b) => Math.abs(b[0]!) * 2 ** -8);
  });
  it('Q8_0 within half a step of amax/127', () => checkBound(GgmlType.Q8_0, 32, (b) => (amax(b) / 127) * 0.51));
  // The largest magnitude maps to -8 * d; its opposite can only reach 7 * d, one full step away.
  it('Q4_0 within one step of amax/8', () => checkBound(GgmlType.Q4_0, 32, (b) => (amax(b) / 8) * 1.01));
  it('Q4_1 within one step of the block range / 15', () => checkBound(GgmlType.Q4_1, 32,
    (b) => (Math.max(...b) - Math.min(...b)) / 15 + amax(b) * 2 ** -10));
  it('Q5_1 within one step of the block range / 31', () => checkBound(GgmlType.Q5_1, 32,
    (b) => (Math.max(...b) - Math.min(...b)) / 31 + amax(b) * 2 ** -10));
  // As Q4_0: the largest magnitude maps to -16 * d, its opposite reaches 15 * d.
  it('Q5_0 within one step of amax/16', () => checkBound(GgmlType.Q5_0, 32, (b) => (amax(b) / 16) * 1.01));
  it('Q4_K within one step of the super-block range / 15', () => checkBound(GgmlType.Q4_K, 256, (b) => range(b) / 15));
  it('Q5_K within one step of the super-block range / 31', () => checkBound(GgmlType.Q5_K, 256, (b) => range(b) / 31));
  it('Q6_K within one step of amax/31', () => checkBound(GgmlType.Q6_K, 256, (b) => amax(b) / 31));

  it('quantizes an all-zero block to zeros', () => {
    for (const type of [GgmlType.Q8_0, GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0, GgmlType.Q5_1, GgmlType.Q4_K,
      GgmlType.Q5_K, GgmlType.Q6_K]) {
      const out = new Float32Array(256);
      dequantize(type, quantize(type, new Float32Array(256)), 256, out);
      assert.ok(out.every((v) => v === 0), GgmlType[type]);
    }
  });

  it('rejects non-finite values in block types and partial blocks', () => {
    assert.throws(() => quantize(GgmlType.Q8_0, new Float32Array(32).fill(NaN)), /not finite/);
    assert.throws(() => quantize(GgmlType.Q4_K, new Float32Array(32)), /not a multiple of the block size 256/);
  });
});
