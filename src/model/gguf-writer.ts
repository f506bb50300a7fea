// GGUF v3 writer: header, metadata of every value type, tensor infos, alignment padding, then tensor data.
//
// Tensor data is written as it is produced: a tensor may give its bytes as a function, called once when its turn
// comes, so a generator never holds more than one tensor in memory. Offsets are known up front from each tensor's
// type and shape. Each tensor starts on an `alignment` boundary of the data section, as llama.cpp expects.

import { closeSync, openSync, writeSync } from 'node:fs';
import { byteSize, GGML_TYPES, GgmlType, ggmlTypeName } from './ggml-types.ts';
import { GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GgufValueType } from './gguf.ts';
import type { GgufValue } from './gguf.ts';

export class GgufWriteError extends Error {
  override name = 'GgufWriteError';
}

export interface GgufValueTypeSpec {
  type: GgufValueType;
  /** Element type when `type` is ARRAY. */
  arrayType?: GgufValueType;
}

export interface GgufTensorToWrite {
  name: string;
  type: GgmlType;
  /** ggml order: shape[0] is the contiguous dimension. */
  shape: number[];
  /** The encoded bytes, or a function producing them when the writer reaches this tensor. */
  data: Uint8Array | (() => Uint8Array);
}

export interface GgufWriteOptions {
  /** Metadata in file order. */
  metadata: Iterable<[string, GgufValue]>;
  /**
   * Value types per key (as GgufFile.metadataTypes gives them) where inference is not wanted. Without one, integers
   * are written as UINT32 (INT32 if negative, 64-bit if large), other numbers as FLOAT32, bigints as (U)INT64, and
   * typed arrays by their element type.
   */
  types?: ReadonlyMap<string, GgufValueTypeSpec>;
  tensors: readonly GgufTensorToWrite[];
  /** Default: general.alignment from the metadata, else 32. Written as general.alignment when not 32. */
  alignment?: number;
}

// ---------------------------------------------------------------------------------------------------------------
// Byte buffer

/** Append-only little-endian buffer for the header. */
class ByteSink {
  private chunks: Uint8Array[] = [];
  private current = new Uint8Array(1 << 16);
  private view = new DataView(this.current.buffer);
  private used = 0;
  length = 0;

  private reserve(n: number): void {
    if (this.used + n <= this.current.byteLength) return;
    this.chunks.push(this.current.subarray(0, this.used));
    this.current = new Uint8Array(Math.max(1 << 16, n));
    this.view = new DataView(this.current.buffer);
    this.used = 0;
  }

  private advance(n: number): void { this.used += n; this.length += n; }

  u8(v: number): void { this.reserve(1); this.view.setUint8(this.used, v); this.advance(1); }
  i8(v: number): void { this.reserve(1); this.view.setInt8(this.used, v); this.advance(1); }
  u16(v: number): void { this.reserve(2); this.view.setUint16(this.used, v, true); this.advance(2); }
  i16(v: number): void { this.reserve(2); this.view.setInt16(this.used, v, true); this.advance(2); }
  u32(v: number): void { this.reserve(4); this.view.setUint32(this.used, v, true); this.advance(4); }
  i32(v: number): void { this.reserve(4); this.view.setInt32(this.used, v, true); this.advance(4); }
  f32(v: number): void { this.reserve(4); this.view.setFloat32(this.used, v, true); this.advance(4); }
  f64(v: number): void { this.reserve(8); this.view.setFloat64(this.used, v, true); this.advance(8); }
  u64(v: number | bigint): void { this.reserve(8); this.view.setBigUint64(this.used, BigInt(v), true); this.advance(8); }
  i64(v: number | bigint): void { this.reserve(8); this.view.setBigInt64(this.used, BigInt(v), true); this.advance(8); }

  bytes(b: Uint8Array): void {
    this.reserve(b.byteLength);
    this.current.set(b, this.used);
    this.advance(b.byteLength);
  }

  string(s: string): void {
    const encoded = Buffer.from(s, 'utf8');
    this.u64(encoded.byteLength);
    this.bytes(encoded);
  }

  finish(): Uint8Array[] {
    return [...this.chunks, this.current.subarray(0, this.used)];
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Value types

const TYPED_ARRAY_TYPES: [new (...args: never[]) => ArrayBufferView, GgufValueType][] = [
  [Uint8Array, GgufValueType.UINT8], [Int8Array, GgufValueType.INT8],
  [Uint16Array, GgufValueType.UINT16], [Int16Array, GgufValueType.INT16],
  [Uint32Array, GgufValueType.UINT32], [Int32Array, GgufValueType.INT32],
  [Float32Array, GgufValueType.FLOAT32], [Float64Array, GgufValueType.FLOAT64],
  [BigUint64Array, GgufValueType.UINT64], [BigInt64Array, GgufValueType.INT64],
];

function inferScalarType(value: unknown, key: string): GgufValueType {
  switch (typeof value) {
    case 'string': return GgufValueType.STRING;
    case 'boolean': return GgufValueType.BOOL;
    case 'bigint': return value < 0n ? GgufValueType.INT64 : GgufValueType.UINT64;
    case 'number':
      if (!Number.isInteger(value)) return GgufValueType.FLOAT32;
      if (value >= 0) return value <= 0xffffffff ? GgufValueType.UINT32 : GgufValueType.UINT64;
      return value >= -0x80000000 ? GgufValueType.INT32 : GgufValueType.INT64;
    default: throw new GgufWriteError(`metadata ${key}: cannot store a value of type ${typeof value}`);
  }
}

/** The type spec of a value: the given one, else inferred. */
function inferType(value: GgufValue, key: string): GgufValueTypeSpec {
  for (const [ctor, type] of TYPED_ARRAY_TYPES) {
    if (value instanceof ctor) return { type: GgufValueType.ARRAY, arrayType: type };
  }
  if (Array.isArray(value)) {
    if (value.length === 0) return { type: GgufValueType.ARRAY, arrayType: GgufValueType.STRING };
    const first = value[0];
    if (Array.isArray(first) || ArrayBuffer.isView(first)) return { type: GgufValueType.ARRAY, arrayType: GgufValueType.ARRAY };
    if (typeof first === 'number') {
      const allInt32 = (value as number[]).every((v) => Number.isInteger(v) && v >= -0x80000000 && v <= 0x7fffffff);
      return { type: GgufValueType.ARRAY, arrayType: allInt32 ? GgufValueType.INT32 : GgufValueType.FLOAT32 };
    }
    return { type: GgufValueType.ARRAY, arrayType: inferScalarType(first, key) };
  }
  return { type: inferScalarType(value, key) };
}

// ---------------------------------------------------------------------------------------------------------------
// Encoding values

function writeScalar(sink: ByteSink, type: GgufValueType, value: unknown, key: string): void {
  const expect = (kind: string, ok: boolean): void => {
    if (!ok) throw new GgufWriteError(`metadata ${key}: ${JSON.stringify(String(value))} is not a valid ${kind}`);
  };
  const int = (lo: number, hi: number): number => {
    const n = Number(value);
    expect(GgufValueType[type], (typeof value === 'number' || typeof value === 'bigint') && Number.isInteger(n) && n >= lo && n <= hi);
    return n;
  };
  switch (type) {
    case GgufValueType.UINT8: sink.u8(int(0, 0xff)); return;
    case GgufValueType.INT8: sink.i8(int(-0x80, 0x7f)); return;
    case GgufValueType.UINT16: sink.u16(int(0, 0xffff)); return;
    case GgufValueType.INT16: sink.i16(int(-0x8000, 0x7fff)); return;
    case GgufValueType.UINT32: sink.u32(int(0, 0xffffffff)); return;
    case GgufValueType.INT32: sink.i32(int(-0x80000000, 0x7fffffff)); return;
    case GgufValueType.FLOAT32: expect('FLOAT32', typeof value === 'number'); sink.f32(value as number); return;
    case GgufValueType.FLOAT64: expect('FLOAT64', typeof value === 'number'); sink.f64(value as number); return;
    case GgufValueType.BOOL: expect('BOOL', typeof value === 'boolean'); sink.u8(value ? 1 : 0); return;
    case GgufValueType.STRING: expect('STRING', typeof value === 'string'); sink.string(value as string); return;
    case GgufValueType.UINT64:
      expect('UINT64', (typeof value === 'bigint' && value >= 0n) || (typeof value === 'number' && Number.isInteger(value) && value >= 0));
      sink.u64(value as number | bigint); return;
    case GgufValueType.INT64:
      expect('INT64', typeof value === 'bigint' || (typeof value === 'number' && Number.isInteger(value)));
      sink.i64(value as number | bigint); return;
    default: throw new GgufWriteError(`metadata ${key}: unknown value type ${type}`);
  }
}

function writeArrayBody(sink: ByteSink, elementType: GgufValueType, value: GgufValue, key: string): void {
  if (!Array.isArray(value) && !ArrayBuffer.isView(value)) {
    throw new GgufWriteError(`metadata ${key}: declared an array but the value is ${typeof value}`);
  }
  const elements = value as ArrayLike<unknown>;
  sink.u64(elements.length);
  if (elementType === GgufValueType.ARRAY) {
    for (let i = 0; i < elements.length; i++) {
      const inner = elements[i] as GgufValue;
      const spec = inferType(inner, `${key}[${i}]`);
      if (spec.type !== GgufValueType.ARRAY) throw new GgufWriteError(`metadata ${key}[${i}] is not an array`);
      sink.u32(spec.arrayType!);
      writeArrayBody(sink, spec.arrayType!, inner, `${key}[${i}]`);
    }
    return;
  }
  for (let i = 0; i < elements.length; i++) writeScalar(sink, elementType, elements[i], `${key}[${i}]`);
}

function writeEntry(sink: ByteSink, key: string, value: GgufValue, spec: GgufValueTypeSpec): void {
  sink.string(key);
  sink.u32(spec.type);
  if (spec.type === GgufValueType.ARRAY) {
    if (spec.arrayType === undefined) throw new GgufWriteError(`metadata ${key}: array without an element type`);
    sink.u32(spec.arrayType);
    writeArrayBody(sink, spec.arrayType, value, key);
  } else {
    writeScalar(sink, spec.type, value, key);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// File

function alignUp(n: number, alignment: number): number {
  return Math.ceil(n / alignment) * alignment;
}

/** The encoded header (everything before the data section, unpadded) and each tensor's data offset. */
export function encodeGgufHeader(options: GgufWriteOptions): { header: Uint8Array[]; headerLength: number;
  alignment: number; offsets: number[]; dataLength: number } {
  const entries = [...options.metadata];
  const metadataAlignment = entries.find(([k]) => k === 'general.alignment')?.[1];
  const alignment = options.alignment ?? (typeof metadataAlignment === 'number' ? metadataAlignment : GGUF_DEFAULT_ALIGNMENT);
  if (!Number.isInteger(alignment) || alignment <= 0 || alignment % 8 !== 0) {
    throw new GgufWriteError(`alignment ${alignment} must be a positive multiple of 8`);
  }
  const withoutAlignment = entries.filter(([k]) => k !== 'general.alignment');
  if (alignment !== GGUF_DEFAULT_ALIGNMENT || metadataAlignment !== undefined) {
    withoutAlignment.push(['general.alignment', alignment]);
  }

  const sink = new ByteSink();
  sink.u32(GGUF_MAGIC);
  sink.u32(3);
  sink.u64(options.tensors.length);
  sink.u64(withoutAlignment.length);
  const keys = new Set<string>();
  for (const [key, value] of withoutAlignment) {
    if (keys.has(key)) throw new GgufWriteError(`metadata ${key} appears twice`);
    keys.add(key);
    const spec = key === 'general.alignment' ? { type: GgufValueType.UINT32 } : options.types?.get(key) ?? inferType(value, key);
    writeEntry(sink, key, value, spec);
  }

  const offsets: number[] = [];
  const names = new Set<string>();
  let dataLength = 0;
  for (const t of options.tensors) {
    if (names.has(t.name)) throw new GgufWriteError(`tensor ${t.name} appears twice`);
    names.add(t.name);
    if (!GGML_TYPES.has(t.type)) throw new GgufWriteError(`tensor ${t.name}: unknown type ${ggmlTypeName(t.type)}`);
    if (t.shape.length < 1 || t.shape.length > 4 || !t.shape.every((d) => Number.isInteger(d) && d > 0)) {
      throw new GgufWriteError(`tensor ${t.name}: shape [${t.shape.join(', ')}] must have 1 to 4 positive dimensions`);
    }
    const offset = alignUp(dataLength, alignment);
    sink.string(t.name);
    sink.u32(t.shape.length);
    for (const d of t.shape) sink.u64(d);
    sink.u32(t.type);
    sink.u64(offset);
    offsets.push(offset);
    dataLength = offset + byteSize(t.type, t.shape.reduce((a, b) => a * b, 1));
  }
  return { header: sink.finish(), headerLength: sink.length, alignment, offsets, dataLength };
}

/** Writes a GGUF v3 file to `path`, tensor data streamed one tensor at a time. */
export function writeGguf(path: string, options: GgufWriteOptions): void {
  const { header, headerLength, alignment, offsets } = encodeGgufHeader(options);
  const fd = openSync(path, 'w');
  try {
    for (const chunk of header) writeAll(fd, chunk);
    let position = headerLength;
    const padTo = (target: number): void => {
      if (target > position) writeAll(fd, new Uint8Array(target - position));
      position = target;
    };
    const dataStart = alignUp(headerLength, alignment);
    // A file without tensors (a vocabulary-only GGUF) ends with its header, as llama.cpp writes it.
    if (options.tensors.length > 0) padTo(dataStart);
    options.tensors.forEach((t, i) => {
      padTo(dataStart + offsets[i]!);
      const data = tensorBytes(t);
      writeAll(fd, data);
      position += data.byteLength;
    });
  } finally {
    closeSync(fd);
  }
}

/** The same file in memory (tests, small files). */
export function encodeGguf(options: GgufWriteOptions): Uint8Array {
  const { header, headerLength, alignment, offsets, dataLength } = encodeGgufHeader(options);
  const dataStart = options.tensors.length > 0 ? alignUp(headerLength, alignment) : headerLength;
  const out = new Uint8Array(dataStart + dataLength);
  let position = 0;
  for (const chunk of header) { out.set(chunk, position); position += chunk.byteLength; }
  options.tensors.forEach((t, i) => {
    out.set(tensorBytes(t), dataStart + offsets[i]!);
  });
  return out;
}

function tensorBytes(t: GgufTensorToWrite): Uint8Array {
  const data = typeof t.data === 'function' ? t.data() : t.data;
  const expected = byteSize(t.type, t.shape.reduce((a, b) => a * b, 1));
  if (data.byteLength !== expected) {
    throw new GgufWriteError(`tensor ${t.name}: ${data.byteLength} bytes given, ${ggmlTypeName(t.type)} ` +
      `[${t.shape.join(', ')}] needs ${expected}`);
  }
  return data;
}

function writeAll(fd: number, data: Uint8Array): void {
  let written = 0;
  while (written < data.byteLength) written += writeSync(fd, data, written, data.byteLength - written);
}
