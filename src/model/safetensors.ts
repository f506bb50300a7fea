// The safetensors format (Hugging Face): an 8-byte little-endian header length N, N bytes of JSON
// ({ name: { dtype, shape, data_offsets: [begin, end] }, "__metadata__"?: { string: string } }), then the data.
// Offsets count from the end of the header; shapes are row-major with the outermost dimension first, so a linear
// layer's [out, in] weight is ggml shape [in, out] with the same bytes.

import { closeSync, openSync, readFileSync, writeSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
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

export async function readSafetensorsAsync(path: string): Promise<SafetensorsFile> {
  return parseSafetensors(await readFile(path), path);
}

export function parseSafetensors(bytes: Uint8Array, source = 'safetensors buffer'): SafetensorsFile {
  if (bytes.byteLength < 8) throw new SafetensorsFormatError(`${source}: too short to be a safetensors file`);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const headerLength = view.getBigUint64(0, true);
  if (headerLength > BigInt(Math.min(MAX_HEADER_BYTES, bytes.byteLength - 8))) {
    throw new SafetensorsFormatError(`${source}: header length ${headerLength} does not fit the file ` +
      `(${bytes.byteLength} bytes); not a safetensors file?`);
  }
  const dataStart = 8 + Number(headerLength);
  let header: unknown;
  try {
    header = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes.subarray(8, dataStart)));
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
      metadata = (value ?? {}) as Record<string, string>;
      continue;
    }
    entries.set(name, parseEntry(name, value, dataStart, bytes.byteLength, source));
  }
  checkTiling([...entries.values()], dataStart, bytes.byteLength, source);

  const cache = new Map<string, Tensor>();
  return {
    source, metadata, entries, bytes,
    hasTensor: (name) => entries.has(name),
    tensor(name: string): Tensor {
      const cached = cache.get(name);
      if (cached) return cached;
      const entry = entries.get(name);
      if (!entry) throw new SafetensorsFormatError(`${source}: tensor ${name} not found`);
      // Own keys only: a dtype of "constructor" must be refused by name, not found on Object.prototype.
      const type = Object.hasOwn(DTYPE_TO_GGML, entry.dtype) ? DTYPE_TO_GGML[entry.dtype] : undefined;
      if (type === undefined) {
        throw new SafetensorsFormatError(`${source}: tensor ${name} has dtype ${entry.dtype}, which is not supported ` +
          `(supported: ${Object.keys(DTYPE_TO_GGML).join(', ')})`);
      }
      const elements = entry.shape.reduce((a, b) => a * b, 1);
      if (byteSize(type, elements) !== entry.end - entry.begin) {
        throw new SafetensorsFormatError(`${source}: tensor ${name} has ${entry.end - entry.begin} bytes, but ` +
          `${entry.dtype} [${entry.shape.join(', ')}] needs ${byteSize(type, elements)}`);
      }
      const tensor: Tensor = {
        name, type,
        shape: entry.shape.length === 0 ? [1] : [...entry.shape].reverse(),
        data: bytes.subarray(entry.begin, entry.end),
      };
      cache.set(name, tensor);
      return tensor;
    },
  };
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
