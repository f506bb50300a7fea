// Number formats of tensor data: half-precision conversions, dequantization of the ggml block types Conduit
// computes with, and straightforward quantizers for writing models.
//
// Block layouts (ggml-common.h), all little-endian:
//   Q8_0  (32 elements, 34 bytes):  f16 d | 32 x i8 q                         x = q * d
//   Q4_0  (32 elements, 18 bytes):  f16 d | 16 bytes; byte j holds element j in its low nibble and element j+16 in
//                                   its high nibble                            x = (q - 8) * d
//   Q4_K  (256 elements, 144 bytes): f16 d | f16 dmin | 12 bytes of eight 6-bit scales and eight 6-bit mins |
//                                   128 bytes of nibbles. Sub-block s (32 elements) has x = d*sc[s]*q - dmin*m[s].
//                                   Each 64 elements share 32 bytes: low nibbles are the first 32, high the next 32.
//   Q5_K  (256 elements, 176 bytes): f16 d | f16 dmin | 12 bytes of scales and mins as Q4_K | 32 bytes qh | 128 bytes
//                                   of nibbles as Q4_K. Element l of sub-block s takes 16 more when bit s of qh[l]
//                                   is set: x = d*sc[s]*q - dmin*m[s], q in 0..31.
//   Q6_K  (256 elements, 210 bytes): 128 bytes ql (low 4 bits) | 64 bytes qh (high 2 bits) | 16 x i8 scales | f16 d.
//                                   Sub-block s (16 elements) has x = d * scales[s] * (q - 32), q in 0..63.
// The quantizers here pick scales by simple rules (absolute maximum, min/max range), not llama.cpp's error-
// minimising search: files they write are valid ggml data, slightly less accurate than llama.cpp's.

import { byteSize, GGML_TYPES, GgmlType, ggmlTypeName } from './ggml-types.ts';
import type { Tensor } from './weights.ts';

export class UnsupportedTypeError extends Error {
  override name = 'UnsupportedTypeError';
}

// ---------------------------------------------------------------------------------------------------------------
// f16 and bf16 <-> f32

const f32Scratch = new Float32Array(1);
const u32Scratch = new Uint32Array(f32Scratch.buffer);

/** Bits of the IEEE 754 half nearest to `value` (round to nearest, ties to even; overflow gives infinity). */
export function f32ToF16Bits(value: number): number {
  f32Scratch[0] = value; // rounding to f32 first is what a C float argument would do
  const bits = u32Scratch[0]!;
  const sign = (bits >>> 16) & 0x8000;
  const exponent = (bits >>> 23) & 0xff;
  const mantissa = bits & 0x7fffff;

  if (exponent === 0xff) {
    // Keep NaN a NaN even when its payload sits only in the low mantissa bits that do not fit.
    return mantissa === 0 ? sign | 0x7c00 : sign | 0x7e00 | (mantissa >>> 13);
  }
  const halfExponent = exponent - 127 + 15;
  if (halfExponent >= 31) return sign | 0x7c00;

  if (halfExponent <= 0) {
    // Subnormal half: count units of 2^-24. Below half a unit everything rounds to zero.
    if (halfExponent < -10) return sign;
    const full = mantissa | 0x800000;
    const shift = 14 - halfExponent;
    return sign | roundShift(full, shift);
  }
  // Normal half; a carry out of the mantissa correctly bumps the exponent (up to infinity).
  let half = (halfExponent << 10) | (mantissa >>> 13);
  const rest = mantissa & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (half & 1) === 1)) half++;
  return sign | half;
}

function roundShift(value: number, shift: number): number {
  let q = value >>> shift;
  const rest = value & ((1 << shift) - 1);
  const halfway = 1 << (shift - 1);
  if (rest > halfway || (rest === halfway && (q & 1) === 1)) q++;
  return q;
}

function f16BitsToF32Slow(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exponent = (h >>> 10) & 0x1f;
  const mantissa = h & 0x3ff;
  if (exponent === 0) return sign * mantissa * 2 ** -24;
  if (exponent === 31) return mantissa === 0 ? sign * Infinity : NaN;
  return sign * (1 + mantissa / 1024) * 2 ** (exponent - 15);
}

// Every half value, so that decoding is one indexed load on the hot dequantization paths.
const F16_TABLE = (() => {
  const table = new Float32Array(65536);
  for (let h = 0; h < 65536; h++) table[h] = f16BitsToF32Slow(h);
  return table;
})();

export function f16BitsToF32(h: number): number {
  return F16_TABLE[h & 0xffff]!;
}

/** Bits of the bfloat16 nearest to `value` (round to nearest even; NaN stays a quiet NaN). */
export function f32ToBf16Bits(value: number): number {
  f32Scratch[0] = value;
  const bits = u32Scratch[0]!;
  if ((bits & 0x7fffffff) > 0x7f800000) return ((bits >>> 16) | 0x40) & 0xffff;
  return ((bits + 0x7fff + ((bits >>> 16) & 1)) >>> 16) & 0xffff;
}

export function bf16BitsToF32(b: number): number {
  u32Scratch[0] = (b & 0xffff) << 16;
  return f32Scratch[0]!;
}

// ---------------------------------------------------------------------------------------------------------------
// Dequantization

/** Whether this module can dequantize and quantize `type`. */
export function isSupportedType(type: GgmlType): boolean {
  return DEQUANTIZERS.has(type);
}

function unsupported(type: GgmlType, what: string): UnsupportedTypeError {
  const supported = [...DEQUANTIZERS.keys()].map(ggmlTypeName).join(', ');
  return new UnsupportedTypeError(`${what}: tensor type ${ggmlTypeName(type)} is not supported (supported: ${supported})`);
}

/** Decodes `numBlocks` blocks starting at `src[offset]` into `out[outOffset ...]`. */
type BlockDecoder = (src: Uint8Array, offset: number, numBlocks: number, out: Float32Array, outOffset: number) => void;

function halfAt(src: Uint8Array, offset: number): number {
  return F16_TABLE[src[offset]! | (src[offset + 1]! << 8)]!;
}

function decodeF32(src: Uint8Array, offset: number, count: number, out: Float32Array, outOffset: number): void {
  const byteOffset = src.byteOffset + offset;
  if (byteOffset % 4 === 0) {
    out.set(new Float32Array(src.buffer, byteOffset, count), outOffset);
    return;
  }
  const view = new DataView(src.buffer, byteOffset, count * 4);
  for (let i = 0; i < count; i++) out[outOffset + i] = view.getFloat32(i * 4, true);
}

function decodeF16(src: Uint8Array, offset: number, count: number, out: Float32Array, outOffset: number): void {
  for (let i = 0; i < count; i++) out[outOffset + i] = halfAt(src, offset + 2 * i);
}

function decodeBf16(src: Uint8Array, offset: number, count: number, out: Float32Array, outOffset: number): void {
  for (let i = 0; i < count; i++) {
    out[outOffset + i] = bf16BitsToF32(src[offset + 2 * i]! | (src[offset + 2 * i + 1]! << 8));
  }
}

function decodeQ8_0(src: Uint8Array, offset: number, numBlocks: number, out: Float32Array, outOffset: number): void {
  for (let b = 0; b < numBlocks; b++) {
    const o = offset + b * 34;
    const d = halfAt(src, o);
    const y = outOffset + b * 32;
    for (let j = 0; j < 32; j++) out[y + j] = ((src[o + 2 + j]! << 24) >> 24) * d;
  }
}

function decodeQ4_0(src: Uint8Array, offset: number, numBlocks: number, out: Float32Array, outOffset: number): void {
  for (let b = 0; b < numBlocks; b++) {
    const o = offset + b * 18;
    const d = halfAt(src, o);
    const y = outOffset + b * 32;
    for (let j = 0; j < 16; j++) {
      const byte = src[o + 2 + j]!;
      out[y + j] = ((byte & 0x0f) - 8) * d;
      out[y + j + 16] = ((byte >>> 4) - 8) * d;
    }
  }
}

function decodeQ4_1(src: Uint8Array, offset: number, numBlocks: number, out: Float32Array, outOffset: number): void {
  for (let b = 0; b < numBlocks; b++) {
    const o = offset + b * 20;
    const d = halfAt(src, o), m = halfAt(src, o + 2);
    const y = outOffset + b * 32;
    for (let j = 0; j < 16; j++) {
      const byte = src[o + 4 + j]!;
      out[y + j] = (byte & 0x0f) * d + m;
      out[y + j + 16] = (byte >>> 4) * d + m;
    }
  }
}

// Q5_0 / Q5_1: bit j of the little-endian 32-bit qh is the fifth bit of element j; the low 4 bits as Q4_0's nibbles.
function decodeQ5(src: Uint8Array, offset: number, numBlocks: number, out: Float32Array, outOffset: number,
  withMin: boolean): void {
  const size = withMin ? 24 : 22, qhAt = withMin ? 4 : 2;
  for (let b = 0; b < numBlocks; b++) {
    const o = offset + b * size;
    const d = halfAt(src, o);
    const m = withMin ? halfAt(src, o + 2) : 0;
    const h = o + qhAt;
    const qh = (src[h]! | (src[h + 1]! << 8) | (src[h + 2]! << 16) | (src[h + 3]! << 24)) >>> 0;
    const y = outOffset + b * 32;
    for (let j = 0; j < 16; j++) {
      const byte = src[h + 4 + j]!;
      const q0 = (byte & 0x0f) | (((qh >>> j) & 1) << 4);
      const q1 = (byte >>> 4) | (((qh >>> (j + 16)) & 1) << 4);
      out[y + j] = withMin ? q0 * d + m : (q0 - 16) * d;
      out[y + j + 16] = withMin ? q1 * d + m : (q1 - 16) * d;
    }
  }
}

function decodeQ5_0(src: Uint8Array, offset: number, numBlocks: number, out: Float32Array, outOffset: number): void {
  decodeQ5(src, offset, numBlocks, out, outOffset, false);
}

function decodeQ5_1(src: Uint8Array, offset: number, numBlocks: number, out: Float32Array, outOffset: number): void {
  decodeQ5(src, offset, numBlocks, out, outOffset, true);
}

/**
 * The 6-bit scale and min of Q4_K sub-block `j` (0..7) from the 12 packed bytes at `p`. Sub-blocks 0..3 keep their
 * scale and min in the low 6 bits of bytes j and j+4; sub-blocks 4..7 keep the low 4 bits in byte j+4 (scale low
 * nibble, min high nibble) and the top 2 bits in the spare top bits of bytes j-4 (scale) and j (min).
 */
function q4kScaleMin(src: Uint8Array, p: number, j: number): [scale: number, min: number] {
  if (j < 4) return [src[p + j]! & 63, src[p + j + 4]! & 63];
  const scale = (src[p + j + 4]! & 0x0f) | ((src[p + j - 4]! >>> 6) << 4);
  const min = (src[p + j + 4]! >>> 4) | ((src[p + j]! >>> 6) << 4);
  return [scale, min];
}

/**
 * Q4_K (144-byte blocks: d, dmin, 12 bytes of scales and mins, 128 bytes of nibbles) and Q5_K (176: the same with
 * a 32-byte plane of fifth bits before the nibbles; bit s of its byte l is the fifth bit of element l of sub-block
 * s). Per pair of sub-blocks, the low nibbles of 32 bytes are sub-block 2 pair, the high nibbles 2 pair + 1.
 */
function decodeQ4_5K(src: Uint8Array, offset: number, numBlocks: number, out: Float32Array, outOffset: number,
  withHighBits: boolean): void {
  const size = withHighBits ? 176 : 144;
  for (let b = 0; b < numBlocks; b++) {
    const o = offset + b * size;
    const d = halfAt(src, o);
    const dmin = halfAt(src, o + 2);
    const scales = o + 4;
    const qh = o + 16;
    const qs = withHighBits ? o + 48 : o + 16;
    const y = outOffset + b * 256;
    for (let pair = 0; pair < 4; pair++) {
      const [sc0, m0] = q4kScaleMin(src, scales, 2 * pair);
      const [sc1, m1] = q4kScaleMin(src, scales, 2 * pair + 1);
      const d0 = d * sc0, min0 = dmin * m0, d1 = d * sc1, min1 = dmin * m1;
      const q = qs + 32 * pair;
      const base = y + 64 * pair;
      for (let l = 0; l < 32; l++) {
        const byte = src[q + l]!, high = withHighBits ? src[qh + l]! >>> (2 * pair) : 0;
        out[base + l] = d0 * ((byte & 0x0f) | ((high & 1) << 4)) - min0;
        out[base + 32 + l] = d1 * ((byte >>> 4) | ((high & 2) << 3)) - min1;
      }
    }
  }
}

function decodeQ4_K(src: Uint8Array, offset: number, numBlocks: number, out: Float32Array, outOffset: number): void {
  decodeQ4_5K(src, offset, numBlocks, out, outOffset, false);
}

function decodeQ5_K(src: Uint8Array, offset: number, numBlocks: number, out: Float32Array, outOffset: number): void {
  decodeQ4_5K(src, offset, numBlocks, out, outOffset, true);
}

function decodeQ6_K(src: Uint8Array, offset: number, numBlocks: number, out: Float32Array, outOffset: number): void {
  for (let b = 0; b < numBlocks; b++) {
    const o = offset + b * 210;
    const d = halfAt(src, o + 208);
    const y0 = outOffset + b * 256;
    for (let half = 0; half < 2; half++) {
      const ql = o + 64 * half;
      const qh = o + 128 + 32 * half;
      const sc = o + 192 + 8 * half;
      const y = y0 + 128 * half;
      for (let l = 0; l < 32; l++) {
        const s = l >>> 4;
        const low0 = src[ql + l]!, low1 = src[ql + l + 32]!, high = src[qh + l]!;
        const q1 = ((low0 & 0x0f) | ((high & 3) << 4)) - 32;
        const q2 = ((low1 & 0x0f) | (((high >>> 2) & 3) << 4)) - 32;
        const q3 = ((low0 >>> 4) | (((high >>> 4) & 3) << 4)) - 32;
        const q4 = ((low1 >>> 4) | (((high >>> 6) & 3) << 4)) - 32;
        out[y + l] = d * int8(src[sc + s]!) * q1;
        out[y + l + 32] = d * int8(src[sc + s + 2]!) * q2;
        out[y + l + 64] = d * int8(src[sc + s + 4]!) * q3;
        out[y + l + 96] = d * int8(src[sc + s + 6]!) * q4;
      }
    }
  }
}

function int8(byte: number): number {
  return (byte << 24) >> 24;
}

// For plain float types a "block" is one element.
const DEQUANTIZERS: ReadonlyMap<GgmlType, BlockDecoder> = new Map<GgmlType, BlockDecoder>([
  [GgmlType.F32, decodeF32],
  [GgmlType.F16, decodeF16],
  [GgmlType.BF16, decodeBf16],
  [GgmlType.Q8_0, decodeQ8_0],
  [GgmlType.Q4_0, decodeQ4_0],
  [GgmlType.Q4_1, decodeQ4_1],
  [GgmlType.Q5_0, decodeQ5_0],
  [GgmlType.Q5_1, decodeQ5_1],
  [GgmlType.Q4_K, decodeQ4_K],
  [GgmlType.Q5_K, decodeQ5_K],
  [GgmlType.Q6_K, decodeQ6_K],
]);

/**
 * Decodes `numElements` elements of `type` stored in `src` (starting at byte `srcOffset`) into
 * `out[outOffset ...]`. `numElements` must be a whole number of blocks.
 */
export function dequantize(
  type: GgmlType, src: Uint8Array, numElements: number, out: Float32Array, srcOffset = 0, outOffset = 0,
): void {
  const decode = DEQUANTIZERS.get(type);
  if (!decode) throw unsupported(type, 'dequantize');
  const info = GGML_TYPES.get(type)!;
  const bytes = byteSize(type, numElements);
  if (srcOffset + bytes > src.byteLength) {
    throw new RangeError(`dequantize ${info.name}: ${numElements} elements need ${bytes} bytes at offset ` +
      `${srcOffset}, the source has ${src.byteLength}`);
  }
  if (outOffset + numElements > out.length) {
    throw new RangeError(`dequantize ${info.name}: output has room for ${out.length - outOffset} of ` +
      `${numElements} elements`);
  }
  decode(src, srcOffset, numElements / info.blockSize, out, outOffset);
}

export function numElements(shape: readonly number[]): number {
  return shape.reduce((a, b) => a * b, 1);
}

/** Number of rows (product of every dimension but the contiguous one). */
export function numRows(t: Tensor): number {
  return t.shape.length === 0 ? 1 : numElements(t.shape) / t.shape[0]!;
}

/** The whole tensor as f32, in storage order (row r is elements r*shape[0] .. (r+1)*shape[0]-1). */
export function dequantizeTensor(t: Tensor): Float32Array {
  if (!DEQUANTIZERS.has(t.type)) throw unsupported(t.type, `tensor ${t.name}`);
  const count = numElements(t.shape);
  const out = new Float32Array(count);
  dequantize(t.type, t.data, count, out);
  return out;
}

/** Row `row` of a tensor (shape[0] elements) into `out` (at least shape[0] long); returns `out`. */
export function dequantizeRow(t: Tensor, row: number, out: Float32Array): Float32Array {
  if (!DEQUANTIZERS.has(t.type)) throw unsupported(t.type, `tensor ${t.name}`);
  const rowLength = t.shape[0] ?? 1;
  const rows = numRows(t);
  if (!Number.isInteger(row) || row < 0 || row >= rows) {
    throw new RangeError(`tensor ${t.name}: row ${row} is out of range (it has ${rows} rows)`);
  }
  const rowBytes = byteSize(t.type, rowLength);
  dequantize(t.type, t.data, rowLength, out, row * rowBytes, 0);
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Quantization

type BlockEncoder = (values: Float32Array, offset: number, dst: Uint8Array, dstOffset: number) => void;

function writeHalf(dst: Uint8Array, offset: number, value: number): void {
  const h = f32ToF16Bits(value);
  dst[offset] = h & 0xff;
  dst[offset + 1] = h >>> 8;
}

function encodeF32(values: Float32Array, offset: number, dst: Uint8Array, dstOffset: number): void {
  new DataView(dst.buffer, dst.byteOffset).setFloat32(dstOffset, values[offset]!, true);
}

function encodeF16(values: Float32Array, offset: number, dst: Uint8Array, dstOffset: number): void {
  writeHalf(dst, dstOffset, values[offset]!);
}

function encodeBf16(values: Float32Array, offset: number, dst: Uint8Array, dstOffset: number): void {
  const b = f32ToBf16Bits(values[offset]!);
  dst[dstOffset] = b & 0xff;
  dst[dstOffset + 1] = b >>> 8;
}

// Scale by the largest magnitude so it maps to +-127.
function encodeQ8_0(values: Float32Array, offset: number, dst: Uint8Array, dstOffset: number): void {
  let amax = 0;
  for (let j = 0; j < 32; j++) amax = Math.max(amax, Math.abs(values[offset + j]!));
  const d = f16Round(amax / 127);
  const inv = d === 0 ? 0 : 1 / d;
  writeHalf(dst, dstOffset, d);
  for (let j = 0; j < 32; j++) {
    const q = Math.max(-127, Math.min(127, Math.round(values[offset + j]! * inv)));
    dst[dstOffset + 2 + j] = q & 0xff;
  }
}

// The element of largest magnitude maps to -8 exactly (its sign folded into d), which uses all 16 levels.
function encodeQ4_0(values: Float32Array, offset: number, dst: Uint8Array, dstOffset: number): void {
  let extreme = 0;
  for (let j = 0; j < 32; j++) {
    const v = values[offset + j]!;
    if (Math.abs(v) > Math.abs(extreme)) extreme = v;
  }
  const d = f16Round(extreme / -8);
  const inv = d === 0 ? 0 : 1 / d;
  writeHalf(dst, dstOffset, d);
  for (let j = 0; j < 16; j++) {
    const lo = Math.max(0, Math.min(15, Math.round(values[offset + j]! * inv) + 8));
    const hi = Math.max(0, Math.min(15, Math.round(values[offset + j + 16]! * inv) + 8));
    dst[dstOffset + 2 + j] = lo | (hi << 4);
  }
}

// d = (max - min) / 15 and m = min, both as halves; levels round against them.
function encodeQ4_1(values: Float32Array, offset: number, dst: Uint8Array, dstOffset: number): void {
  let lo = Infinity, hi = -Infinity;
  for (let j = 0; j < 32; j++) {
    lo = Math.min(lo, values[offset + j]!);
    hi = Math.max(hi, values[offset + j]!);
  }
  const d = f16Round((hi - lo) / 15), m = f16Round(lo);
  const inv = d === 0 ? 0 : 1 / d;
  writeHalf(dst, dstOffset, d);
  writeHalf(dst, dstOffset + 2, m);
  for (let j = 0; j < 16; j++) {
    const a = Math.max(0, Math.min(15, Math.round((values[offset + j]! - m) * inv)));
    const b = Math.max(0, Math.min(15, Math.round((values[offset + j + 16]! - m) * inv)));
    dst[dstOffset + 4 + j] = a | (b << 4);
  }
}

// 32 levels (0..31) of a Q5_0 / Q5_1 block into its qh (4 bytes) and nibbles (16 bytes) at `at`.
function writeQ5Levels(levels: Uint8Array, dst: Uint8Array, at: number): void {
  let qh = 0;
  for (let j = 0; j < 16; j++) {
    const a = levels[j]!, b = levels[j + 16]!;
    dst[at + 4 + j] = (a & 0x0f) | ((b & 0x0f) << 4);
    qh |= ((a >>> 4) << j) | ((b >>> 4) << (j + 16));
  }
  for (let i = 0; i < 4; i++) dst[at + i] = (qh >>> (8 * i)) & 0xff;
}

// As Q4_0 with 32 levels: the element of largest magnitude maps to -16; the fifth bits go to qh.
function encodeQ5_0(values: Float32Array, offset: number, dst: Uint8Array, dstOffset: number): void {
  let extreme = 0;
  for (let j = 0; j < 32; j++) {
    const v = values[offset + j]!;
    if (Math.abs(v) > Math.abs(extreme)) extreme = v;
  }
  const d = f16Round(extreme / -16);
  const inv = d === 0 ? 0 : 1 / d;
  writeHalf(dst, dstOffset, d);
  for (let j = 0; j < 32; j++) scratchLevels[j] = Math.max(0, Math.min(31, Math.round(values[offset + j]! * inv) + 16));
  writeQ5Levels(scratchLevels, dst, dstOffset + 2);
}

// As Q4_1 with 32 levels: d = (max - min) / 31, m = min.
function encodeQ5_1(values: Float32Array, offset: number, dst: Uint8Array, dstOffset: number): void {
  let lo = Infinity, hi = -Infinity;
  for (let j = 0; j < 32; j++) {
    lo = Math.min(lo, values[offset + j]!);
    hi = Math.max(hi, values[offset + j]!);
  }
  const d = f16Round((hi - lo) / 31), m = f16Round(lo);
  const inv = d === 0 ? 0 : 1 / d;
  writeHalf(dst, dstOffset, d);
  writeHalf(dst, dstOffset + 2, m);
  for (let j = 0; j < 32; j++) scratchLevels[j] = Math.max(0, Math.min(31, Math.round((values[offset + j]! - m) * inv)));
  writeQ5Levels(scratchLevels, dst, dstOffset + 4);
}

// Each 32-element sub-block gets range (max - min) / top and offset -min (min clamped to <= 0), top = 15 (Q4_K) or
// 31 (Q5_K); the eight scales and eight offsets are then quantized to 6 bits against their own maxima (d and dmin),
// stored as Q4_K's 12 packed bytes. The levels (0..top) go to scratchLevels.
function encodeKScalesMins(values: Float32Array, offset: number, top: number, dst: Uint8Array, dstOffset: number): void {
  const subScale = scratchScales;
  const subMin = scratchMins;
  let maxScale = 0, maxMin = 0;
  for (let s = 0; s < 8; s++) {
    let lo = 0, hi = -Infinity; // lo starts at 0: the offset only ever shifts values up
    for (let l = 0; l < 32; l++) {
      const v = values[offset + 32 * s + l]!;
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }
    subScale[s] = (hi - lo) / top;
    subMin[s] = -lo;
    if (subScale[s]! > maxScale) maxScale = subScale[s]!;
    if (subMin[s]! > maxMin) maxMin = subMin[s]!;
  }
  const d = f16Round(maxScale / 63);
  const dmin = f16Round(maxMin / 63);
  const sc = scratchSc;
  const m = scratchM;
  for (let s = 0; s < 8; s++) {
    sc[s] = d === 0 ? 0 : Math.min(63, Math.round(subScale[s]! / d));
    // Round the offset up so that the sub-block's minimum stays representable (q >= 0).
    m[s] = dmin === 0 ? 0 : Math.min(63, Math.ceil(subMin[s]! / dmin - 1e-6));
  }
  writeHalf(dst, dstOffset, d);
  writeHalf(dst, dstOffset + 2, dmin);
  const p = dstOffset + 4;
  for (let j = 0; j < 4; j++) {
    dst[p + j] = sc[j]! | ((sc[j + 4]! >>> 4) << 6);
    dst[p + j + 4] = m[j]! | ((m[j + 4]! >>> 4) << 6);
    dst[p + j + 8] = (sc[j + 4]! & 0x0f) | ((m[j + 4]! & 0x0f) << 4);
  }
  const levels = scratchLevels;
  for (let s = 0; s < 8; s++) {
    const step = d * sc[s]!;
    const inverse = step === 0 ? 0 : 1 / step;
    const shift = dmin * m[s]!;
    for (let l = 0; l < 32; l++) {
      const i = 32 * s + l;
      levels[i] = Math.max(0, Math.min(top, Math.round((values[offset + i]! + shift) * inverse)));
    }
  }
}

function encodeQ4_K(values: Float32Array, offset: number, dst: Uint8Array, dstOffset: number): void {
  encodeKScalesMins(values, offset, 15, dst, dstOffset);
  const levels = scratchLevels;
  const qs = dstOffset + 16;
  for (let pair = 0; pair < 4; pair++) {
    for (let l = 0; l < 32; l++) dst[qs + 32 * pair + l] = levels[64 * pair + l]! | (levels[64 * pair + 32 + l]! << 4);
  }
}

// As Q4_K with 32 levels: the low 4 bits as Q4_K's nibbles, bit 4 of sub-block s's element l in bit s of qh[l].
function encodeQ5_K(values: Float32Array, offset: number, dst: Uint8Array, dstOffset: number): void {
  encodeKScalesMins(values, offset, 31, dst, dstOffset);
  const levels = scratchLevels;
  const qh = dstOffset + 16;
  const qs = dstOffset + 48;
  for (let l = 0; l < 32; l++) {
    let high = 0;
    for (let s = 0; s < 8; s++) high |= (levels[32 * s + l]! >>> 4) << s;
    dst[qh + l] = high;
  }
  for (let pair = 0; pair < 4; pair++) {
    for (let l = 0; l < 32; l++) {
      dst[qs + 32 * pair + l] = (levels[64 * pair + l]! & 0x0f) | ((levels[64 * pair + 32 + l]! & 0x0f) << 4);
    }
  }
}

// Per-block working memory of the K-quant encoders (single-threaded, never re-entered).
const scratchScales = new Float64Array(16);
const scratchMins = new Float64Array(8);
const scratchSc = new Uint8Array(8);
const scratchM = new Uint8Array(8);
const scratchQ6Scales = new Int8Array(16);
const scratchLevels = new Uint8Array(256);

// Each 16-element sub-block gets scale amax / 31 (levels -31..31 of the available -32..31); the sixteen scales are
// quantized to int8 against their maximum (d).
function encodeQ6_K(values: Float32Array, offset: number, dst: Uint8Array, dstOffset: number): void {
  const subScale = scratchScales;
  let maxScale = 0;
  for (let s = 0; s < 16; s++) {
    let amax = 0;
    for (let l = 0; l < 16; l++) amax = Math.max(amax, Math.abs(values[offset + 16 * s + l]!));
    subScale[s] = amax / 31;
    if (subScale[s]! > maxScale) maxScale = subScale[s]!;
  }
  const d = f16Round(maxScale / 127);
  const scales = scratchQ6Scales;
  for (let s = 0; s < 16; s++) scales[s] = d === 0 ? 0 : Math.min(127, Math.round(subScale[s]! / d));
  const levels = scratchLevels;
  for (let i = 0; i < 256; i++) {
    const step = d * scales[i >>> 4]!;
    const q = step === 0 ? 0 : Math.max(-32, Math.min(31, Math.round(values[offset + i]! / step)));
    levels[i] = q + 32;
  }
  for (let half = 0; half < 2; half++) {
    const ql = dstOffset + 64 * half;
    const qh = dstOffset + 128 + 32 * half;
    const L = 128 * half;
    for (let l = 0; l < 32; l++) {
      const a = levels[L + l]!, b = levels[L + l + 32]!, c = levels[L + l + 64]!, e = levels[L + l + 96]!;
      dst[ql + l] = (a & 0x0f) | ((c & 0x0f) << 4);
      dst[ql + l + 32] = (b & 0x0f) | ((e & 0x0f) << 4);
      dst[qh + l] = (a >>> 4) | ((b >>> 4) << 2) | ((c >>> 4) << 4) | ((e >>> 4) << 6);
    }
  }
  for (let s = 0; s < 16; s++) dst[dstOffset + 192 + s] = scales[s]! & 0xff;
  writeHalf(dst, dstOffset + 208, d);
}

/** `value` rounded to the nearest half, as the decoder will see it. */
export function f16Round(value: number): number {
  return f16BitsToF32(f32ToF16Bits(value));
}

const QUANTIZERS: ReadonlyMap<GgmlType, BlockEncoder> = new Map<GgmlType, BlockEncoder>([
  [GgmlType.F32, encodeF32],
  [GgmlType.F16, encodeF16],
  [GgmlType.BF16, encodeBf16],
  [GgmlType.Q8_0, encodeQ8_0],
  [GgmlType.Q4_0, encodeQ4_0],
  [GgmlType.Q4_1, encodeQ4_1],
  [GgmlType.Q5_0, encodeQ5_0],
  [GgmlType.Q5_1, encodeQ5_1],
  [GgmlType.Q4_K, encodeQ4_K],
  [GgmlType.Q5_K, encodeQ5_K],
  [GgmlType.Q6_K, encodeQ6_K],
]);

/**
 * Encodes `values` as `type`. Blocks never straddle rows as long as the row length is a multiple of the block size,
 * so a whole tensor can be quantized in one call. Non-finite values are rejected for block types (they would poison
 * the whole block's scale).
 */
export function quantize(type: GgmlType, values: Float32Array): Uint8Array {
  const encode = QUANTIZERS.get(type);
  if (!encode) throw unsupported(type, 'quantize');
  const info = GGML_TYPES.get(type)!;
  const out = new Uint8Array(byteSize(type, values.length));
  if (type === GgmlType.F32) {
    out.set(new Uint8Array(values.buffer, values.byteOffset, values.byteLength));
    return out;
  }
  if (info.blockSize > 1) {
    for (let i = 0; i < values.length; i++) {
      if (!Number.isFinite(values[i]!)) throw new RangeError(`quantize ${info.name}: value ${values[i]} at index ${i} is not finite`);
    }
  }
  const numBlocks = values.length / info.blockSize;
  for (let b = 0; b < numBlocks; b++) encode(values, b * info.blockSize, out, b * info.typeSize);
  return out;
}
