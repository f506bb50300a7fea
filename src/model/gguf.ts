// GGUF reader (format versions 2 and 3): metadata, tensor table, and zero-copy views of the tensors' bytes.
//
// Layout of a file: header (magic "GGUF", version, tensor count, metadata count), metadata key/value pairs, tensor
// infos (name, dims, type, offset), padding to `general.alignment` (default 32), then the tensor data. The whole
// file is read once into memory; tensor data are subarray views of that one buffer, never copies.

import { readFileSync } from 'node:fs';
import { byteSize, GGML_TYPES, GgmlType, ggmlTypeName } from './ggml-types.ts';
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
  /** Tensors by name, each a view of `bytes`. Throws a clear error for types Conduit cannot compute with. */
  tensor(name: string): Tensor;
  hasTensor(name: string): boolean;
}

export class GgufFormatError extends Error {
  override name = 'GgufFormatError';
}

// ---------------------------------------------------------------------------------------------------------------
// Cursor over the bytes

class Cursor {
  offset = 0;
  private readonly view: DataView;
  // ignoreBOM keeps a leading U+FEFF: it is a real token in some vocabularies, not a byte order mark.
  private readonly decoder = new TextDecoder('utf-8', { fatal: false, ignoreBOM: true });

  constructor(private readonly bytes: Uint8Array, private readonly source: string) {
    this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  }

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

function narrow64(v: bigint): number | bigint {
  return v <= BigInt(Number.MAX_SAFE_INTEGER) && v >= BigInt(Number.MIN_SAFE_INTEGER) ? Number(v) : v;
}

function readScalar(c: Cursor, type: GgufValueType): GgufValue {
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
    default: throw new GgufFormatError(`unknown GGUF value type ${type}`);
  }
}

function readArray(c: Cursor, elementType: GgufValueType, length: number): GgufValue {
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
      const out: boolean[] = new Array(length);
      for (let i = 0; i < length; i++) out[i] = c.u8() !== 0;
      return out;
    }
    case GgufValueType.STRING: {
      const out: string[] = new Array(length);
      for (let i = 0; i < length; i++) out[i] = c.string();
      return out;
    }
    case GgufValueType.ARRAY: {
      const out: GgufValue[] = new Array(length);
      for (let i = 0; i < length; i++) {
        const inner = c.u32();
        out[i] = readArray(c, inner, c.count('array length'));
      }
      return out;
    }
    default: throw new GgufFormatError(`unknown GGUF array element type ${elementType}`);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Parsing

export function readGguf(path: string): GgufFile {
  return parseGguf(readFileSync(path), path);
}

export function parseGguf(bytes: Uint8Array, source = 'GGUF buffer'): GgufFile {
  const c = new Cursor(bytes, source);
  const magic = c.u32();
  if (magic !== GGUF_MAGIC) throw new GgufFormatError(`${source}: not a GGUF file (bad magic)`);
  const version = c.u32();
  if (version !== 2 && version !== 3) {
    throw new GgufFormatError(`${source}: GGUF version ${version} is not supported (only 2 and 3)`);
  }
  const tensorCount = c.count('tensor count');
  const metadataCount = c.count('metadata count');

  const metadata = new Map<string, GgufValue>();
  const metadataTypes = new Map<string, { type: GgufValueType; arrayType?: GgufValueType }>();
  for (let i = 0; i < metadataCount; i++) {
    const key = c.string();
    const type = c.u32() as GgufValueType;
    if (type === GgufValueType.ARRAY) {
      const arrayType = c.u32() as GgufValueType;
      metadata.set(key, readArray(c, arrayType, c.count('array length')));
      metadataTypes.set(key, { type, arrayType });
    } else {
      metadata.set(key, readScalar(c, type));
      metadataTypes.set(key, { type });
    }
  }

  const tensorInfos: GgufTensorInfo[] = [];
  for (let i = 0; i < tensorCount; i++) {
    const name = c.string();
    const numDims = c.u32();
    if (numDims > 4) throw new GgufFormatError(`${source}: tensor ${name} has ${numDims} dimensions (at most 4)`);
    const shape: number[] = [];
    for (let d = 0; d < numDims; d++) shape.push(c.count(`dimension of ${name}`));
    const type = c.u32() as GgmlType;
    const offset = c.count(`offset of ${name}`);
    tensorInfos.push({ name, shape, type, offset });
  }

  const alignmentValue = metadata.get('general.alignment');
  const alignment = typeof alignmentValue === 'number' && alignmentValue > 0 ? alignmentValue : GGUF_DEFAULT_ALIGNMENT;
  const dataOffset = Math.ceil(c.offset / alignment) * alignment;

  const byName = new Map(tensorInfos.map((t) => [t.name, t]));
  const cache = new Map<string, Tensor>();

  return {
    version, metadata, metadataTypes, tensorInfos, alignment, dataOffset, bytes,
    hasTensor: (name) => byName.has(name),
    tensor(name: string): Tensor {
      const cached = cache.get(name);
      if (cached) return cached;
      const info = byName.get(name);
      if (!info) throw new GgufFormatError(`${source}: tensor ${name} not found`);
      if (!GGML_TYPES.has(info.type)) {
        throw new GgufFormatError(`${source}: tensor ${name} has ${ggmlTypeName(info.type)}, which Conduit cannot read`);
      }
      const elements = info.shape.reduce((a, b) => a * b, 1);
      const size = byteSize(info.type, elements);
      const start = dataOffset + info.offset;
      if (start + size > bytes.byteLength) {
        throw new GgufFormatError(`${source}: tensor ${name} runs past the end of the file`);
      }
      const tensor: Tensor = { name, type: info.type, shape: info.shape, data: bytes.subarray(start, start + size) };
      cache.set(name, tensor);
      return tensor;
    },
  };
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
