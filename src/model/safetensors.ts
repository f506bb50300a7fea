// The safetensors format (Hugging Face): an 8-byte little-endian header length N, N bytes of JSON
// ({ name: { dtype, shape, data_offsets: [begin, end] }, "__metadata__"?: { string: string } }), then the data.
// Offsets count from the end of the header; shapes are row-major with the outermost dimension first, so a linear
// layer's [out, in] weight is ggml shape [in, out] with the same bytes.

import { constants as bufferConstants } from 'node:buffer';
import { closeSync, fstatSync, openSync, readFileSync, readSync, writeSync } from 'node:fs';
import { open } from 'node:fs/promises';
import { byteSize, GgmlType } from './ggml-types.ts';
import type { Tensor } from './weights.ts';

export class SafetensorsFormatError extends Error {
  override name = 'SafetensorsFormatError';
}

/** safetensors dtype names of the types Conduit computes with. */
const DTYPE_TO_GGML: Readonly<Record<string, GgmlType>> = {
  F32: GgmlType.F32,
  F16: GgmlType.F16,
  BF16: GgmlType.BF16,
};

export type SafetensorsDtype = 'F32' | 'F16' | 'BF16';

export interface SafetensorsEntry {
  name: string;
  dtype: string;
  /** Row-major, outermost first (as in the file). */
  shape: number[];
  /** Absolute byte range in the file. */
  begin: number;
  end: number;
}

export interface SafetensorsFile {
  source: string;
  metadata: Record<string, string>;
  entries: Map<string, SafetensorsEntry>;
  bytes: Uint8Array;
  hasTensor(name: string): boolean;
  /** A zero-copy Tensor (ggml shape order); throws naming the dtype when it is not F32, F16 or BF16. */
  tensor(name: string): Tensor;
}

// The reference implementation refuses headers above 100 MB; a larger value means a corrupt or foreign file.
const MAX_HEADER_BYTES = 100_000_000;

// ---------------------------------------------------------------------------------------------------------------
// Reading

export function readSafetensors(path: string): SafetensorsFile {
  return parseSafetensors(readFileSync(path), path);
}

export function parseSafetensors(bytes: Uint8Array, source = 'safetensors buffer'): SafetensorsFile {
  const dataStart = 8 + headerLengthOf(bytes, bytes.byteLength, source);
  const { metadata, entries } = parseHeader(bytes.subarray(8, dataStart), dataStart, bytes.byteLength, source);
  const cache = new Map<string, Tensor>();
  return {
    source, metadata, entries, bytes,
    hasTensor: (name) => entries.has(name),
    tensor(name: string): Tensor {
      const cached = cache.get(name);
      if (cached) return cached;
      const entry = entries.get(name);
      if (!entry) throw new SafetensorsFormatError(`${source}: tensor ${name} not found`);
      const tensor: Tensor = {
        name, type: checkedType(entry, source), shape: ggmlShape(entry), data: bytes.subarray(entry.begin, entry.end),
      };
      cache.set(name, tensor);
      return tensor;
    },
  };
}

/**
 * A safetensors file read by parts: its header at once, each tensor's bytes when asked for, by positional reads from
 * an open file. A file of gigabytes costs the tensors read from it, not a copy of the whole file, and a file past
 * what Node reads into one buffer (2 GiB) is read as well as a small one.
 */
export interface SafetensorsReader {
  source: string;
  metadata: Record<string, string>;
  entries: Map<string, SafetensorsEntry>;
  /** The file's first bytes: the 8-byte header length and the header (the tensors' bytes follow). */
  head: Uint8Array;
  /** A Tensor (ggml shape order) of its own bytes, read now; throws naming the dtype when it is not F32, F16 or BF16. */
  tensor(name: string): Tensor;
  close(): void;
}

export function openSafetensors(path: string): SafetensorsReader {
  const fd = openSync(path, 'r');
  try {
    const fileLength = fstatSync(fd).size;
    const prefix = readExactly(fd, 0, Math.min(8, fileLength), path);
    const dataStart = 8 + headerLengthOf(prefix, fileLength, path);
    const head = Buffer.alloc(dataStart);
    head.set(prefix);
    head.set(readExactly(fd, 8, dataStart - 8, path), 8);
    const { metadata, entries } = parseHeader(head.subarray(8), dataStart, fileLength, path);
    let closed = false;
    return {
      source: path, metadata, entries, head,
      tensor(name: string): Tensor {
        const entry = entries.get(name);
        if (!entry) throw new SafetensorsFormatError(`${path}: tensor ${name} not found`);
        const type = checkedType(entry, path);
        return { name, type, shape: ggmlShape(entry), data: readExactly(fd, entry.begin, entry.end - entry.begin, path) };
      },
      close(): void {
        if (closed) return;
        closed = true;
        closeSync(fd);
      },
    };
  } catch (error) {
    closeSync(fd);
    throw error;
  }
}

/** The header of a safetensors file (what openSafetensors gives but the tensors), read without reading the rest. */
export async function readSafetensorsHeaderAsync(path: string): Promise<Pick<SafetensorsReader, 'source' | 'metadata' | 'entries' | 'head'>> {
  const handle = await open(path, 'r');
  try {
    const fileLength = (await handle.stat()).size;
    const prefix = Buffer.alloc(Math.min(8, fileLength));
    await handle.read(prefix, 0, prefix.byteLength, 0);
    const dataStart = 8 + headerLengthOf(prefix, fileLength, path);
    const head = Buffer.alloc(dataStart);
    const { bytesRead } = await handle.read(head, 0, dataStart, 0);
    if (bytesRead !== dataStart) throw new SafetensorsFormatError(`${path}: the file ended while its header was read (was it being written?)`);
    const { metadata, entries } = parseHeader(head.subarray(8), dataStart, fileLength, path);
    return { source: path, metadata, entries, head };
  } finally {
    await handle.close();
  }
}

/** `length` bytes at `position`, or an error naming the file when it ends first (it shrank since it was opened). */
function readExactly(fd: number, position: number, length: number, source: string): Buffer {
  if (length > bufferConstants.MAX_LENGTH) {
    throw new SafetensorsFormatError(`${source}: a tensor of ${length} bytes is more than one buffer holds ` +
      `(${bufferConstants.MAX_LENGTH} bytes)`);
  }
  const out = Buffer.alloc(length);
  let done = 0;
  while (done < length) {
    const n = readSync(fd, out, done, length - done, position + done);
    if (n === 0) {
      throw new SafetensorsFormatError(`${source}: the file ended at byte ${position + done}, before the ${length} ` +
        `bytes at ${position} were read (was it changed while it was read?)`);
    }
    done += n;
  }
  return out;
}

/** The header length the first 8 bytes give, checked against the file's length. */
function headerLengthOf(prefix: Uint8Array, fileLength: number, source: string): number {
  if (fileLength < 8 || prefix.byteLength < 8) throw new SafetensorsFormatError(`${source}: too short to be a safetensors file`);
  const headerLength = new DataView(prefix.buffer, prefix.byteOffset, 8).getBigUint64(0, true);
  if (headerLength > BigInt(Math.min(MAX_HEADER_BYTES, fileLength - 8))) {
    throw new SafetensorsFormatError(`${source}: header length ${headerLength} does not fit the file ` +
      `(${fileLength} bytes); not a safetensors file?`);
  }
  return Number(headerLength);
}

/** The header's JSON: its entries, checked to lie in the file and tile the data section. */
function parseHeader(json: Uint8Array, dataStart: number, fileLength: number, source: string):
  { metadata: Record<string, string>; entries: Map<string, SafetensorsEntry> } {
  let header: unknown;
  try {
    header = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(json));
  } catch (error) {
    throw new SafetensorsFormatError(`${source}: header is not valid JSON (${(error as Error).message})`);
  }
  if (typeof header !== 'object' || header === null || Array.isArray(header)) {
    throw new SafetensorsFormatError(`${source}: header is not a JSON object`);
  }
  let metadata: Record<string, string> = {};
  const entries = new Map<string, SafetensorsEntry>();
  for (const [name, value] of Object.entries(header as Record<string, unknown>)) {
    if (name === '__metadata__') {
      // A map of strings, as the reference reader requires (it refuses any other, so transformers cannot load the file).
      if (value !== null && (typeof value !== 'object' || Array.isArray(value) ||
        !Object.values(value as object).every((v) => typeof v === 'string'))) {
        const shown = JSON.stringify(value);
        throw new SafetensorsFormatError(`${source}: __metadata__ must be an object of strings, got ` +
          `${shown.length > 40 ? `${shown.slice(0, 40)}...` : shown}`);
      }
      metadata = (value ?? {}) as Record<string, string>;
      continue;
    }
    entries.set(name, parseEntry(name, value, dataStart, fileLength, source));
  }
  checkTiling([...entries.values()], dataStart, fileLength, source);
  return { metadata, entries };
}

/** The ggml type of an entry's dtype, checked to match its byte count. */
function checkedType(entry: SafetensorsEntry, source: string): GgmlType {
  // Own keys only: a dtype of "constructor" must be refused by name, not found on Object.prototype.
  const type = Object.hasOwn(DTYPE_TO_GGML, entry.dtype) ? DTYPE_TO_GGML[entry.dtype] : undefined;
  if (type === undefined) {
    throw new SafetensorsFormatError(`${source}: tensor ${entry.name} has dtype ${entry.dtype}, which is not supported ` +
      `(supported: ${Object.keys(DTYPE_TO_GGML).join(', ')})`);
  }
  const elements = entry.shape.reduce((a, b) => a * b, 1);
  if (byteSize(type, elements) !== entry.end - entry.begin) {
    throw new SafetensorsFormatError(`${source}: tensor ${entry.name} has ${entry.end - entry.begin} bytes, but ` +
      `${entry.dtype} [${entry.shape.join(', ')}] needs ${byteSize(type, elements)}`);
  }
  return type;
}

function ggmlShape(entry: SafetensorsEntry): number[] {
  return entry.shape.length === 0 ? [1] : [...entry.shape].reverse();
}

function parseEntry(name: string, value: unknown, dataStart: number, fileLength: number, source: string): SafetensorsEntry {
  const v = value as { dtype?: unknown; shape?: unknown; data_offsets?: unknown };
  const offsets = v?.data_offsets;
  if (typeof v?.dtype !== 'string' || !Array.isArray(v.shape) || !Array.isArray(offsets) || offsets.length !== 2 ||
      !v.shape.every((d) => Number.isInteger(d) && d >= 0) || !offsets.every((o) => Number.isInteger(o) && o >= 0)) {
    throw new SafetensorsFormatError(`${source}: header entry for ${name} is malformed (needs dtype, shape, data_offsets)`);
  }
  const elements = (v.shape as number[]).reduce((a, b) => a * b, 1);
  if (!Number.isSafeInteger(elements)) {
    throw new SafetensorsFormatError(`${source}: tensor ${name} of shape [${v.shape.join(', ')}] has too many elements`);
  }
  const begin = dataStart + (offsets[0] as number);
  const end = dataStart + (offsets[1] as number);
  if (end < begin) {
    throw new SafetensorsFormatError(`${source}: tensor ${name} data_offsets [${offsets.join(', ')}] end before they begin`);
  }
  if (end > fileLength) {
    throw new SafetensorsFormatError(`${source}: tensor ${name} data [${offsets.join(', ')}] lies outside the file`);
  }
  return { name, dtype: v.dtype, shape: v.shape as number[], begin, end };
}

/**
 * The tensors' bytes must tile the data section exactly, as the reference implementation requires: in offset order,
 * the first at 0, each starting where the one before ends, the last ending at the end of the file. Otherwise two
 * tensors share bytes, or bytes belong to no tensor, which means an offset or a shape is not what was written.
 */
function checkTiling(entries: SafetensorsEntry[], dataStart: number, fileLength: number, source: string): void {
  const sorted = [...entries].sort((a, b) => a.begin - b.begin || a.end - b.end);
  let expected = dataStart;
  let previous: SafetensorsEntry | undefined;
  for (const entry of sorted) {
    if (previous && entry.begin < previous.end) {
      throw new SafetensorsFormatError(`${source}: tensors ${previous.name} and ${entry.name} overlap (data ` +
        `[${previous.begin - dataStart}, ${previous.end - dataStart}] and [${entry.begin - dataStart}, ` +
        `${entry.end - dataStart}])`);
    }
    if (entry.begin !== expected) {
      throw new SafetensorsFormatError(`${source}: tensor ${entry.name} starts at data offset ${entry.begin - dataStart}, ` +
        `${entry.begin - expected} bytes after ${previous ? `the end of tensor ${previous.name}` : 'the start of the data'}; ` +
        'the bytes between belong to no tensor, so an offset or shape is not what was written');
    }
    previous = entry;
    expected = entry.end;
  }
  if (expected !== fileLength) {
    throw new SafetensorsFormatError(`${source}: the file has ${fileLength - expected} bytes after the last tensor's ` +
      'data, which belong to no tensor (a damaged file, or offsets that are not what was written)');
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Writing

export interface SafetensorsTensorData {
  name: string;
  dtype: SafetensorsDtype;
  /** Row-major, outermost first. */
  shape: number[];
  data: Uint8Array;
}

/**
 * Writes a safetensors file, tensors in the given order, one write per tensor (no second copy of the data). The
 * header is padded with spaces to a multiple of 8 bytes so every tensor starts 8-byte aligned, as HF's writer does.
 */
export function writeSafetensors(path: string, tensors: readonly SafetensorsTensorData[], metadata?: Record<string, string>): void {
  const header: Record<string, unknown> = {};
  if (metadata && Object.keys(metadata).length > 0) header['__metadata__'] = metadata;
  let offset = 0;
  const seen = new Set<string>();
  for (const t of tensors) {
    if (seen.has(t.name)) throw new SafetensorsFormatError(`writeSafetensors: tensor ${t.name} appears twice`);
    seen.add(t.name);
    const type = DTYPE_TO_GGML[t.dtype];
    if (type === undefined) throw new SafetensorsFormatError(`writeSafetensors: dtype ${t.dtype} of ${t.name} is not supported`);
    const expected = byteSize(type, t.shape.reduce((a, b) => a * b, 1));
    if (expected !== t.data.byteLength) {
      throw new SafetensorsFormatError(`writeSafetensors: ${t.name} has ${t.data.byteLength} bytes, ${t.dtype} ` +
        `[${t.shape.join(', ')}] needs ${expected}`);
    }
    header[t.name] = { dtype: t.dtype, shape: t.shape, data_offsets: [offset, offset + expected] };
    offset += expected;
  }
  let json = JSON.stringify(header);
  const jsonLength = Buffer.byteLength(json);
  json += ' '.repeat((8 - ((8 + jsonLength) % 8)) % 8);
  const headerBytes = Buffer.from(json, 'utf8');
  const prefix = Buffer.alloc(8);
  prefix.writeBigUInt64LE(BigInt(headerBytes.byteLength));

  const fd = openSync(path, 'w');
  try {
    writeAll(fd, prefix);
    writeAll(fd, headerBytes);
    for (const t of tensors) writeAll(fd, t.data);
  } finally {
    closeSync(fd);
  }
}

function writeAll(fd: number, data: Uint8Array): void {
  let written = 0;
  while (written < data.byteLength) written += writeSync(fd, data, written, data.byteLength - written);
}
