import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { createHash } from 'node:crypto';
import { GgufFormatError, parseGguf, readGguf, metaNumber, metaString } from '../../src/model/gguf.ts';
import { GgmlType } from '../../src/model/ggml-types.ts';
import { sharedModel, skipUnlessShared } from '../helpers/shared-models.ts';

// A GGUF header assembled byte by byte here, independently of any writer: version, counts, one metadata pair, one
// tensor info, padding, data.
function handMadeGguf(options: { magic?: number; version?: number; truncateAt?: number } = {}): Uint8Array {
  const parts: number[] = [];
  const u32 = (v: number) => { for (let i = 0; i < 4; i++) parts.push((v >>> (8 * i)) & 0xff); };
  const u64 = (v: number) => { u32(v); u32(0); };
  const str = (s: string) => { const b = Buffer.from(s, 'utf8'); u64(b.length); parts.push(...b); };
  u32(options.magic ?? 0x46554747);
  u32(options.version ?? 3);
  u64(1); // tensors
  u64(2); // metadata pairs
  str('general.name'); u32(8); str('tiny');
  str('tiny.values'); u32(9); u32(6); u64(3); // array of 3 float32
  for (const f of [1.5, -2, 0.25]) { const b = Buffer.alloc(4); b.writeFloatLE(f); parts.push(...b); }
  str('w'); u32(2); u64(2); u64(3); u32(GgmlType.F32); u64(0); // 2x3 f32 tensor at offset 0
  while (parts.length % 32 !== 0) parts.push(0);
  for (let i = 0; i < 6; i++) { const b = Buffer.alloc(4); b.writeFloatLE(i + 0.5); parts.push(...b); }
  const bytes = Uint8Array.from(parts);
  return options.truncateAt !== undefined ? bytes.subarray(0, options.truncateAt) : bytes;
}

test('GGUF reader parses a hand-assembled file: metadata, typed arrays, tensor view at the aligned data offset', () => {
  const file = parseGguf(handMadeGguf());
  assert.equal(file.version, 3);
  assert.equal(metaString(file, 'general.name'), 'tiny');
  assert.deepEqual(Array.from(file.metadata.get('tiny.values') as Float32Array), [1.5, -2, 0.25]);
  assert.equal(file.dataOffset % 32, 0);
  const w = file.tensor('w');
  assert.deepEqual(w.shape, [2, 3]);
  const floats = new Float32Array(w.data.slice().buffer);
  assert.deepEqual(Array.from(floats), [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]);
});

test('GGUF reader rejects bad magic, unsupported versions, truncation and unknown tensors with clear errors', () => {
  assert.throws(() => parseGguf(handMadeGguf({ magic: 0x12345678 })), /not a GGUF file/);
  assert.throws(() => parseGguf(handMadeGguf({ version: 1 })), /version 1 is not supported/);
  assert.throws(() => parseGguf(handMadeGguf({ truncateAt: 40 })), GgufFormatError);
  assert.throws(() => parseGguf(handMadeGguf()).tensor('missing'), /tensor missing not found/);
  const full = handMadeGguf();
  assert.throws(() => parseGguf(full.subarray(0, full.length - 4)).tensor('w'), /runs past the end/);
});

test('stories260K.gguf: metadata and tensor table as its README states', { skip: skipUnlessShared('stories260K.gguf') }, () => {
  const path = sharedModel('stories260K.gguf')!;
  assert.equal(createHash('sha256').update(readFileSync(path)).digest('hex'),
    '270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d');
  const file = readGguf(path);
  assert.equal(metaString(file, 'general.architecture'), 'llama');
  assert.equal(metaNumber(file, 'llama.embedding_length'), 64);
  assert.equal(metaNumber(file, 'llama.block_count'), 5);
  assert.equal(metaNumber(file, 'llama.attention.head_count'), 8);
  assert.equal(metaNumber(file, 'llama.attention.head_count_kv'), 4);
  assert.equal((file.metadata.get('tokenizer.ggml.tokens') as string[]).length, 512);
  assert.equal(file.tensorInfos.length, 48);
  const q = file.tensor('blk.0.attn_q.weight');
  assert.equal(q.type, GgmlType.F32);
  assert.deepEqual(q.shape, [64, 64]);
  assert.equal(q.data.byteLength, 64 * 64 * 4);
});
