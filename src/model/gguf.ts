// GGUF reader (format versions 2 and 3): metadata, tensor table, and zero-copy views of the tensors' bytes.
//
// Layout of a file: header (magic "GGUF", version, tensor count, metadata count), metadata key/value pairs, tensor
// infos (name, dims, type, offset), padding to `general.alignment` (default 32), then the tensor data. The whole
// file is read once into memory; tensor data are subarray views of that one buffer, never copies.
//
// What llama.cpp's reader refuses is refused here too, from the header alone (no pass over the data), each as one
// GgufFormatError line: a key or tensor name given twice, an alignment that is not a power of two, a tensor offset
// off the alignment, a tensor type the format does not define, tensor data past the end of the file, overlapping
// another tensor's or leaving bytes between tensors that belong to none, a quantized row that is not a whole number
// of blocks. Lengths are checked against the bytes left before anything is allocated, and arrays
// of arrays nest at most GGUF_MAX_ARRAY_NESTING deep.

import { constants as bufferConstants } from 'node:buffer';
import { readFileSync } from 'node:fs';
import { byteSize, GGML_TYPES, GgmlType } from './ggml-types.ts';
import type { GgmlTypeInfo } from './ggml-types.ts';
import type { Tensor } from './weights.ts';

export const GGUF_MAGIC = 0x46554747; // "GGUF" read as a little-endian uint32
export const GGUF_DEFAULT_ALIGNMENT = 32;

export enum GgufValueType {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
}

/**
 * A metadata value. Numeric arrays become typed arrays (a 150k-entry score table stays one allocation), string
 * arrays become string[], 64-bit integers become numbers when they fit exactly and bigints otherwise.
 */
export type GgufValue =
  | number | bigint | boolean | string
  | Uint8Array | Int8Array | Uint16Array | Int16Array | Uint32Array | Int32Array | Float32Array | Float64Array
  | BigUint64Array | BigInt64Array
  | string[] | boolean[] | GgufValue[];

export interface GgufTensorInfo {
  name: string;
  /** ggml order: shape[0] is the contiguous dimension. */
  shape: number[];
  type: GgmlType;
  /** Offset from the start of the data section. */
  offset: number;
}

export interface GgufFile {
  version: number;
  metadata: Map<string, GgufValue>;
  /** Metadata value types as stored, for writers that round-trip a file. */
  metadataTypes: Map<string, { type: GgufValueType; arrayType?: GgufValueType }>;
  tensorInfos: GgufTensorInfo[];
  alignment: number;
  /** Byte offset of the data section in the file. */
  dataOffset: number;
  /** The whole file. */
  bytes: Uint8Array;
  /** Tensors by name, each a view of `bytes` (of any type; checkWeights refuses those Conduit cannot compute with). */
  tensor(name: string): Tensor;
  hasTensor(name: string): boolean;
}

export class GgufFormatError extends Error {
  override name = 'GgufFormatError';
}

// ---------------------------------------------------------------------------------------------------------------
// Cursor over the bytes

const MAX_STRING_LENGTH = bufferConstants.MAX_STRING_LENGTH;

class Cursor {
  offset = 0;
  /** Arrays read inside other arrays, and BOOL array elements, so far (see GGUF_MAX_NESTED_ARRAYS). */
  nestedArrays = 0;
  boolElements = 0;
  private readonly view: DataView;
  // ignoreBOM keeps a leading U+FEFF: it is a real token in some vocabularies, not a byte order mark.
  private readonly decoder = new TextDecoder('utf-8', { fatal: false, ignoreBOM: true });

  constructor(private readonly bytes: Uint8Array, private readonly source: string) {
    this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  }

  /** Bytes between the cursor and the end of the file. */
  remaining(): number { return this.bytes.byteLength - this.offset; }

  private need(n: number): void {
    if (this.offset + n > this.bytes.byteLength) {
      throw new GgufFormatError(`${this.source}: truncated GGUF (wanted ${n} bytes at offset ${this.offset}, ` +
        `file has ${this.bytes.byteLength})`);
    }
  }

  u8(): number { this.need(1); return this.view.getUint8(this.offset++); }
  i8(): number { this.need(1); return this.view.getInt8(this.offset++); }
  u16(): number { this.need(2); const v = this.view.getUint16(this.offset, true); this.offset += 2; return v; }
  i16(): number { this.need(2); const v = this.view.getInt16(this.offset, true); this.offset += 2; return v; }
  u32(): number { this.need(4); const v = this.view.getUint32(this.offset, true); this.offset += 4; return v; }
  i32(): number { this.need(4); const v = this.view.getInt32(this.offset, true); this.offset += 4; return v; }
  f32(): number { this.need(4); const v = this.view.getFloat32(this.offset, true); this.offset += 4; return v; }
  f64(): number { this.need(8); const v = this.view.getFloat64(this.offset, true); this.offset += 8; return v; }
  u64(): bigint { this.need(8); const v = this.view.getBigUint64(this.offset, true); this.offset += 8; return v; }
  i64(): bigint { this.need(8); const v = this.view.getBigInt64(this.offset, true); this.offset += 8; return v; }

  /** A uint64 used as a count or offset: must fit a JS number. */
  count(what: string): number {
    const v = this.u64();
    if (v > BigInt(Number.MAX_SAFE_INTEGER)) throw new GgufFormatError(`${this.source}: ${what} ${v} is too large`);
    return Number(v);
  }

  string(): string {
    const length = this.count('string length');
    // V8 makes no string longer than this; decoding one would throw a plain Error instead of naming the file.
    if (length > MAX_STRING_LENGTH) {
      throw new GgufFormatError(`${this.source}: a string of ${length} bytes at offset ${this.offset}, longer than ` +
        `the longest string Conduit can hold (${MAX_STRING_LENGTH})`);
    }
    this.need(length);
    const s = this.decoder.decode(this.bytes.subarray(this.offset, this.offset + length));
    this.offset += length;
    return s;
  }

  /** `count` little-endian elements copied into a fresh (aligned) typed array. */
  typedArray<T>(ctor: { new(buffer: ArrayBuffer): T; BYTES_PER_ELEMENT: number }, count: number): T {
    const byteLength = count * ctor.BYTES_PER_ELEMENT;
    this.need(byteLength);
    // Uint8Array.prototype.slice copies; Buffer#slice would return a view of Node's shared pool.
    const copy = Uint8Array.prototype.slice.call(this.bytes, this.offset, this.offset + byteLength);
    this.offset += byteLength;
    return new ctor(copy.buffer); // x86 and ARM are little-endian, like the file
  }
}

/**
 * A GgufFormatError about what was being read (`context`: a key, an element) when its message does not say so
 * already; any other error as it is.
 */
function inContext(error: unknown, source: string, context: string): unknown {
  if (!(error instanceof GgufFormatError) || !error.message.startsWith(`${source}: `)) return error;
  const detail = error.message.slice(source.length + 2);
  if (detail.startsWith(context)) return error;
  return new GgufFormatError(`${source}: ${context}: ${detail}`);
}

function narrow64(v: bigint): number | bigint {
  return v <= BigInt(Number.MAX_SAFE_INTEGER) && v >= BigInt(Number.MIN_SAFE_INTEGER) ? Number(v) : v;
}

function readScalar(c: Cursor, source: string, key: string, type: GgufValueType): GgufValue {
  switch (type) {
    case GgufValueType.UINT8: return c.u8();
    case GgufValueType.INT8: return c.i8();
    case GgufValueType.UINT16: return c.u16();
    case GgufValueType.INT16: return c.i16();
    case GgufValueType.UINT32: return c.u32();
    case GgufValueType.INT32: return c.i32();
    case GgufValueType.FLOAT32: return c.f32();
    case GgufValueType.FLOAT64: return c.f64();
    case GgufValueType.BOOL: return c.u8() !== 0;
    case GgufValueType.STRING: return c.string();
    case GgufValueType.UINT64: return narrow64(c.u64());
    case GgufValueType.INT64: return narrow64(c.i64());
    default: throw new GgufFormatError(`${source}: metadata ${key} has unknown GGUF value type ${type}`);
  }
}

/**
 * How deep arrays of arrays may nest. The format puts no bound on it and llama.cpp reads no nested arrays at all; a
 * bound keeps a hostile file from exhausting the stack (200k levels take 2.4 MB).
 */
export const GGUF_MAX_ARRAY_NESTING = 16;

/**
 * How many arrays may sit inside other arrays, and how many BOOL array elements a file may hold, in all. Each becomes
 * a JS object or array slot far larger than its bytes in the file (an empty inner array: 12 bytes in the file, some
 * 200 in memory; a BOOL: 1 byte, 8), so without a bound a hostile file of a few hundred MB exhausts the heap. No
 * writer comes near either: llama.cpp reads no nested arrays, and BOOL arrays hold one flag per layer.
 */
export const GGUF_MAX_NESTED_ARRAYS = 1 << 16;
export const GGUF_MAX_BOOL_ELEMENTS = 1 << 24;

/** The fewest bytes one element of an array of this type takes (an inner array: its type and its length). */
const MIN_ELEMENT_BYTES: ReadonlyMap<GgufValueType, number> = new Map([
  [GgufValueType.UINT8, 1], [GgufValueType.INT8, 1], [GgufValueType.BOOL, 1],
  [GgufValueType.UINT16, 2], [GgufValueType.INT16, 2],
  [GgufValueType.UINT32, 4], [GgufValueType.INT32, 4], [GgufValueType.FLOAT32, 4],
  [GgufValueType.UINT64, 8], [GgufValueType.INT64, 8], [GgufValueType.FLOAT64, 8],
  [GgufValueType.STRING, 8], [GgufValueType.ARRAY, 12],
]);

/** `key` names the metadata entry in errors; `depth` is 1 for the entry's own array. */
function readArray(c: Cursor, source: string, key: string, elementType: GgufValueType, depth = 1): GgufValue {
  const minBytes = MIN_ELEMENT_BYTES.get(elementType);
  if (minBytes === undefined) {
    throw new GgufFormatError(`${source}: metadata ${key} is an array of unknown GGUF value type ${elementType}`);
  }
  if (depth > GGUF_MAX_ARRAY_NESTING) {
    throw new GgufFormatError(`${source}: metadata ${key} nests arrays more than ${GGUF_MAX_ARRAY_NESTING} deep`);
  }
  if (depth > 1 && ++c.nestedArrays > GGUF_MAX_NESTED_ARRAYS) {
    throw new GgufFormatError(`${source}: metadata ${key} brings the file's arrays inside arrays to more than ` +
      `${GGUF_MAX_NESTED_ARRAYS}`);
  }
  const length = c.count(`length of metadata ${key}`);
  // Checked before anything is allocated: a corrupt length of 2^40 must not reach new Array().
  if (length * minBytes > c.remaining()) {
    throw new GgufFormatError(`${source}: metadata ${key} claims ${length} array elements, more than the ` +
      `${c.remaining()} bytes left in the file can hold`);
  }
  switch (elementType) {
    case GgufValueType.UINT8: return c.typedArray(Uint8Array, length);
    case GgufValueType.INT8: return c.typedArray(Int8Array, length);
    case GgufValueType.UINT16: return c.typedArray(Uint16Array, length);
    case GgufValueType.INT16: return c.typedArray(Int16Array, length);
    case GgufValueType.UINT32: return c.typedArray(Uint32Array, length);
    case GgufValueType.INT32: return c.typedArray(Int32Array, length);
    case GgufValueType.FLOAT32: return c.typedArray(Float32Array, length);
    case GgufValueType.FLOAT64: return c.typedArray(Float64Array, length);
    case GgufValueType.UINT64: return c.typedArray(BigUint64Array, length);
    case GgufValueType.INT64: return c.typedArray(BigInt64Array, length);
    case GgufValueType.BOOL: {
      c.boolElements += length;
      if (c.boolElements > GGUF_MAX_BOOL_ELEMENTS) {
        throw new GgufFormatError(`${source}: metadata ${key} brings the file's BOOL array elements to ` +
          `${c.boolElements}, more than ${GGUF_MAX_BOOL_ELEMENTS}`);
      }
      const out: boolean[] = new Array(length);
      for (let i = 0; i < length; i++) out[i] = c.u8() !== 0;
      return out;
    }
    case GgufValueType.STRING: {
      const out: string[] = new Array(length);
      let i = 0;
      try {
        for (; i < length; i++) out[i] = c.string();
      } catch (error) {
        // A bad length deep in a 150k-token list: which key and which element, not only a byte offset.
        throw inContext(error, source, `metadata ${key}, string ${i} of ${length}`);
      }
      return out;
    }
    default: { // ARRAY
      const out: GgufValue[] = new Array(length);
      for (let i = 0; i < length; i++) out[i] = readArray(c, source, key, c.u32(), depth + 1);
      return out;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Parsing

export function readGguf(path: string): GgufFile {
  return parseGguf(readFileSync(path), path);
}

/**
 * The metadata found in the first bytes of a GGUF file, up to where `head` ends: enough to tell what a file is (its
 * general.type, written among the first keys) before reading it whole. A bad magic or version throws as parseGguf
 * does; the scan ends, keeping the keys before it, at a key `head` cuts off (or one parseGguf would refuse, which it
 * does once the file is read whole).
 */
export function peekGgufMetadata(head: Uint8Array, source: string): Map<string, GgufValue> {
  const c = new Cursor(head, source);
  const metadata = new Map<string, GgufValue>();
  readHeader(c, source);
  try {
    c.count('tensor count');
    const metadataCount = c.count('metadata count');
    for (let i = 0; i < metadataCount; i++) {
      const key = c.string();
      const type = c.u32() as GgufValueType;
      metadata.set(key, type === GgufValueType.ARRAY ? readArray(c, source, key, c.u32() as GgufValueType) : readScalar(c, source, key, type));
    }
  } catch (error) {
    if (!(error instanceof GgufFormatError)) throw error;
  }
  return metadata;
}

/** The magic and version at the start of a GGUF file; throws for what parseGguf cannot read. */
function readHeader(c: Cursor, source: string): number {
  const magic = c.u32();
  if (magic !== GGUF_MAGIC) throw new GgufFormatError(`${source}: not a GGUF file (bad magic)`);
  const version = c.u32();
  // The magic is four bytes in either byte order; the version is not: 3 read the wrong way round is 0x03000000.
  if (version === 0x02000000 || version === 0x03000000) {
    throw new GgufFormatError(`${source}: a big-endian GGUF (version ${version >>> 24} in big-endian byte order); ` +
      'Conduit reads little-endian GGUF files only');
  }
  if (version !== 2 && version !== 3) {
    throw new GgufFormatError(`${source}: GGUF version ${version} is not supported (only 2 and 3)`);
  }
  return version;
}

export function parseGguf(bytes: Uint8Array, source = 'GGUF buffer'): GgufFile {
  const c = new Cursor(bytes, source);
  const version = readHeader(c, source);
  const tensorCount = c.count('tensor count');
  const metadataCount = c.count('metadata count');

  const metadata = new Map<string, GgufValue>();
  const metadataTypes = new Map<string, { type: GgufValueType; arrayType?: GgufValueType }>();
  for (let i = 0; i < metadataCount; i++) {
    let key: string;
    try {
      key = c.string();
    } catch (error) {
      throw inContext(error, source, `the key of metadata entry ${i} of ${metadataCount}`);
    }
    // Which of two values is meant is unclear; llama.cpp refuses such a file too.
    if (metadata.has(key)) throw new GgufFormatError(`${source}: metadata key ${key} appears twice`);
    try {
      const type = c.u32() as GgufValueType;
      if (type === GgufValueType.ARRAY) {
        const arrayType = c.u32() as GgufValueType;
        metadata.set(key, readArray(c, source, key, arrayType));
        metadataTypes.set(key, { type, arrayType });
      } else {
        metadata.set(key, readScalar(c, source, key, type));
        metadataTypes.set(key, { type });
      }
    } catch (error) {
      throw inContext(error, source, `metadata ${key}`);
    }
  }
  const alignment = readAlignment(metadata, metadataTypes, source);

  /** A field of a tensor's entry, a file cut inside it named by the tensor (else only the offset says where). */
  const entryField = <T>(read: () => T, name: string, i: number, count: number): T => {
    try {
      return read();
    } catch (error) {
      throw inContext(error, source, `the entry of tensor ${name} (${i} of ${count}) in the tensor table`);
    }
  };
  const tensorInfos: GgufTensorInfo[] = [];
  const byName = new Map<string, GgufTensorInfo>();
  /** Byte size of each tensor. */
  const sizes = new Map<GgufTensorInfo, number>();
  for (let i = 0; i < tensorCount; i++) {
    let name: string;
    try {
      name = c.string();
    } catch (error) {
      throw inContext(error, source, `the name of tensor ${i} of ${tensorCount} in the tensor table`);
    }
    if (byName.has(name)) throw new GgufFormatError(`${source}: tensor ${name} appears twice in the tensor table`);
    const numDims = entryField(() => c.u32(), name, i, tensorCount);
    if (numDims > 4) throw new GgufFormatError(`${source}: tensor ${name} has ${numDims} dimensions (at most 4)`);
    const shape: number[] = [];
    for (let d = 0; d < numDims; d++) shape.push(entryField(() => c.count(`dimension of ${name}`), name, i, tensorCount));
    const type = entryField(() => c.u32(), name, i, tensorCount) as GgmlType;
    const offset = entryField(() => c.count(`offset of ${name}`), name, i, tensorCount);
    if (offset % alignment !== 0) {
      throw new GgufFormatError(`${source}: tensor ${name} starts at data offset ${offset}, which is not a multiple ` +
        `of the file's alignment ${alignment}`);
    }
    const info: GgufTensorInfo = { name, shape, type, offset };
    // Without its type's layout a tensor's size is unknown, and so is whether its bytes lie in the file or overlap
    // another's; llama.cpp refuses such a file too.
    const typeInfo = GGML_TYPES.get(type);
    if (!typeInfo) {
      throw new GgufFormatError(`${source}: tensor ${name} has ggml type ${type}, which is not a type the GGUF format ` +
        'defines (a damaged file, or a type newer than Conduit knows)');
    }
    sizes.set(info, tensorByteSize(info, typeInfo, source));
    tensorInfos.push(info);
    byName.set(name, info);
  }

  const dataOffset = Math.ceil(c.offset / alignment) * alignment;
  checkDataRanges(tensorInfos, sizes, dataOffset, alignment, bytes.byteLength, source);
  const cache = new Map<string, Tensor>();

  return {
    version, metadata, metadataTypes, tensorInfos, alignment, dataOffset, bytes,
    hasTensor: (name) => byName.has(name),
    tensor(name: string): Tensor {
      const cached = cache.get(name);
      if (cached) return cached;
      const info = byName.get(name);
      if (!info) throw new GgufFormatError(`${source}: tensor ${name} not found`);
      const size = sizes.get(info)!;
      const start = dataOffset + info.offset;
      const tensor: Tensor = { name, type: info.type, shape: info.shape, data: bytes.subarray(start, start + size) };
      cache.set(name, tensor);
      return tensor;
    },
  };
}

/** `general.alignment`: a UINT32 power of two when present (as llama.cpp requires), else 32. */
function readAlignment(metadata: Map<string, GgufValue>,
  types: Map<string, { type: GgufValueType }>, source: string): number {
  const value = metadata.get('general.alignment');
  if (value === undefined) return GGUF_DEFAULT_ALIGNMENT;
  if (types.get('general.alignment')!.type !== GgufValueType.UINT32) {
    throw new GgufFormatError(`${source}: metadata general.alignment is stored as ` +
      `${GgufValueType[types.get('general.alignment')!.type] ?? 'an unknown type'}, not UINT32`);
  }
  const alignment = value as number;
  if (alignment === 0 || !Number.isInteger(Math.log2(alignment))) {
    throw new GgufFormatError(`${source}: metadata general.alignment ${alignment} is not a power of two`);
  }
  return alignment;
}

/**
 * Bytes of a tensor's data. Refuses what ggml cannot lay out: a row (shape[0]) that is not a whole number of the
 * type's blocks, or more elements than a double counts exactly.
 */
function tensorByteSize(info: GgufTensorInfo, type: GgmlTypeInfo, source: string): number {
  const rowLength = info.shape[0] ?? 1;
  if (rowLength % type.blockSize !== 0) {
    throw new GgufFormatError(`${source}: tensor ${info.name} has rows of ${rowLength} elements, which is not a ` +
      `multiple of the ${type.name} block size ${type.blockSize}`);
  }
  const elements = info.shape.reduce((a, b) => a * b, 1);
  if (!Number.isSafeInteger(elements)) {
    throw new GgufFormatError(`${source}: tensor ${info.name} of shape [${info.shape.join(', ')}] has too many elements`);
  }
  return byteSize(info.type, elements);
}

/**
 * The tensors' data must tile the data section as a GGUF writer lays it out (llama.cpp's reader requires the same):
 * in offset order, the first at offset 0 and each next one at the end of the one before, rounded up to the alignment.
 * So no tensor runs past the end of the file, no two share bytes (one tensor's bytes read as another's), and no bytes
 * between two tensors belong to neither: such a gap means a tensor's type, shape or offset is not what its writer
 * wrote (an F32 tensor relabelled F16 takes half its bytes and reads them as other numbers). Tensors of no elements
 * take no bytes and are only checked to start inside the file. Bytes after the last tensor are allowed.
 */
function checkDataRanges(infos: GgufTensorInfo[], sizes: Map<GgufTensorInfo, number>, dataOffset: number,
  alignment: number, fileLength: number, source: string): void {
  const ranges: { info: GgufTensorInfo; start: number; end: number }[] = [];
  for (const info of infos) {
    const size = sizes.get(info)!;
    const start = dataOffset + info.offset;
    const end = start + size;
    if (end > fileLength) {
      throw new GgufFormatError(`${source}: tensor ${info.name} runs past the end of the file (its data ends at byte ` +
        `${end}, the file has ${fileLength})`);
    }
    if (size > 0) ranges.push({ info, start, end });
  }
  ranges.sort((a, b) => a.start - b.start);
  let expected = dataOffset; // where the next tensor's data must start
  let previous: { info: GgufTensorInfo; start: number; end: number } | undefined;
  for (const current of ranges) {
    if (previous && current.start < previous.end) {
      throw new GgufFormatError(`${source}: tensors ${previous.info.name} and ${current.info.name} overlap (data ` +
        `offsets ${previous.info.offset} and ${current.info.offset}, the first is ${previous.end - previous.start} bytes)`);
    }
    if (current.start !== expected) {
      const after = previous
        ? `the end of tensor ${previous.info.name} (at data offset ${expected - dataOffset} with padding)`
        : 'the start of the data section';
      throw new GgufFormatError(`${source}: tensor ${current.info.name} starts at data offset ${current.info.offset}, ` +
        `${current.start - expected} bytes after ${after}; the bytes between belong to no tensor, so a tensor's ` +
        'type, shape or offset is not what was written');
    }
    previous = current;
    expected = dataOffset + Math.ceil((current.end - dataOffset) / alignment) * alignment;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Typed metadata access

export function metaString(file: GgufFile, key: string): string | undefined {
  const v = file.metadata.get(key);
  return typeof v === 'string' ? v : undefined;
}

export function metaNumber(file: GgufFile, key: string): number | undefined {
  const v = file.metadata.get(key);
  if (typeof v === 'number') return v;
  if (typeof v === 'bigint') return Number(v);
  return undefined;
}

export function metaBool(file: GgufFile, key: string): boolean | undefined {
  const v = file.metadata.get(key);
  return typeof v === 'boolean' ? v : undefined;
}

export function requireNumber(file: GgufFile, key: string): number {
  const v = metaNumber(file, key);
  if (v === undefined) throw new GgufFormatError(`GGUF metadata ${key} is missing`);
  return v;
}
