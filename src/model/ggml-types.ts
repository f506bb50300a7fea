// ggml tensor element types as numbered in the GGUF format (ggml.h `enum ggml_type`).
// Quantized types pack `blockSize` elements into `typeSize` bytes; a row's length must be a multiple of blockSize.

export enum GgmlType {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
}

export interface GgmlTypeInfo {
  name: string;
  /** Elements per block (1 for plain floats). */
  blockSize: number;
  /** Bytes per block. */
  typeSize: number;
}

// Layouts (ggml-common.h): Q8_0 = f16 d + 32 x i8; Q4_0 = f16 d + 16 bytes of nibbles (low nibbles are elements
// 0..15, high nibbles 16..31), value = (q - 8) * d; Q4_K = f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes
// of nibbles per 256; Q4_1 = f16 d, f16 m + Q4_0's nibbles, value = q * d + m; Q5_0 = f16 d, 32 fifth bits (bit j of
// a little-endian u32 for element j) + Q4_0's nibbles, value = (q - 16) * d; Q5_1 = f16 d, f16 m + Q5_0's bits, value =
// q * d + m; Q5_K = Q4_K's header, 32 bytes of fifth bits, 128 bytes of nibbles per 256; Q6_K = 128 bytes low nibbles, 64 bytes high 2-bits, 16 x i8 scales, f16 d per 256.
export const GGML_TYPES: ReadonlyMap<GgmlType, GgmlTypeInfo> = new Map([
  [GgmlType.F32, { name: 'F32', blockSize: 1, typeSize: 4 }],
  [GgmlType.F16, { name: 'F16', blockSize: 1, typeSize: 2 }],
  [GgmlType.BF16, { name: 'BF16', blockSize: 1, typeSize: 2 }],
  [GgmlType.Q4_0, { name: 'Q4_0', blockSize: 32, typeSize: 18 }],
  [GgmlType.Q4_1, { name: 'Q4_1', blockSize: 32, typeSize: 20 }],
  [GgmlType.Q5_0, { name: 'Q5_0', blockSize: 32, typeSize: 22 }],
  [GgmlType.Q5_1, { name: 'Q5_1', blockSize: 32, typeSize: 24 }],
  [GgmlType.Q8_0, { name: 'Q8_0', blockSize: 32, typeSize: 34 }],
  [GgmlType.Q8_1, { name: 'Q8_1', blockSize: 32, typeSize: 36 }],
  [GgmlType.Q2_K, { name: 'Q2_K', blockSize: 256, typeSize: 84 }],
  [GgmlType.Q3_K, { name: 'Q3_K', blockSize: 256, typeSize: 110 }],
  [GgmlType.Q4_K, { name: 'Q4_K', blockSize: 256, typeSize: 144 }],
  [GgmlType.Q5_K, { name: 'Q5_K', blockSize: 256, typeSize: 176 }],
  [GgmlType.Q6_K, { name: 'Q6_K', blockSize: 256, typeSize: 210 }],
  [GgmlType.Q8_K, { name: 'Q8_K', blockSize: 256, typeSize: 292 }],
  // Types Conduit does not compute with, known by their layout so that a file holding them is checked like any other
  // (its tensors' byte ranges, whole blocks per row) and refused by name (gguf-py's GGML_QUANT_SIZES).
  [GgmlType.IQ2_XXS, { name: 'IQ2_XXS', blockSize: 256, typeSize: 66 }],
  [GgmlType.IQ2_XS, { name: 'IQ2_XS', blockSize: 256, typeSize: 74 }],
  [GgmlType.IQ3_XXS, { name: 'IQ3_XXS', blockSize: 256, typeSize: 98 }],
  [GgmlType.IQ1_S, { name: 'IQ1_S', blockSize: 256, typeSize: 50 }],
  [GgmlType.IQ4_NL, { name: 'IQ4_NL', blockSize: 32, typeSize: 18 }],
  [GgmlType.IQ3_S, { name: 'IQ3_S', blockSize: 256, typeSize: 110 }],
  [GgmlType.IQ2_S, { name: 'IQ2_S', blockSize: 256, typeSize: 82 }],
  [GgmlType.IQ4_XS, { name: 'IQ4_XS', blockSize: 256, typeSize: 136 }],
  [GgmlType.I8, { name: 'I8', blockSize: 1, typeSize: 1 }],
  [GgmlType.I16, { name: 'I16', blockSize: 1, typeSize: 2 }],
  [GgmlType.I32, { name: 'I32', blockSize: 1, typeSize: 4 }],
  [GgmlType.I64, { name: 'I64', blockSize: 1, typeSize: 8 }],
  [GgmlType.F64, { name: 'F64', blockSize: 1, typeSize: 8 }],
  [GgmlType.IQ1_M, { name: 'IQ1_M', blockSize: 256, typeSize: 56 }],
  [GgmlType.TQ1_0, { name: 'TQ1_0', blockSize: 256, typeSize: 54 }],
  [GgmlType.TQ2_0, { name: 'TQ2_0', blockSize: 256, typeSize: 66 }],
  [GgmlType.MXFP4, { name: 'MXFP4', blockSize: 32, typeSize: 17 }],
]);

/** The types Conduit can compute with (dequantize in the reference path, native kernels). */
export const SUPPORTED_TYPES: readonly GgmlType[] = [
  GgmlType.F32, GgmlType.F16, GgmlType.BF16, GgmlType.Q8_0, GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0,
  GgmlType.Q5_1, GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K,
];

export function ggmlTypeName(type: number): string {
  return GGML_TYPES.get(type)?.name ?? `unknown type ${type}`;
}

/** Bytes taken by `numElements` elements of `type`; throws if the count is not a whole number of blocks. */
export function byteSize(type: GgmlType, numElements: number): number {
  const info = GGML_TYPES.get(type);
  if (!info) throw new Error(`unknown ggml type ${type}`);
  if (numElements % info.blockSize !== 0) {
    throw new Error(`${info.name}: ${numElements} elements is not a multiple of the block size ${info.blockSize}`);
  }
  return (numElements / info.blockSize) * info.typeSize;
}
