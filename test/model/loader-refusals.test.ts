// What the model loader refuses, and how: one line naming the key or tensor and its value (a GgufFormatError or
// ModelFormatError), never a stack from a deeper layer and never a silent acceptance. Where llama.cpp reads a file
// differently, the cases here follow llama.cpp (its gguf.cpp and llama-model.cpp).

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { GgmlType } from '../../src/model/ggml-types.ts';
import { GGUF_MAX_BOOL_ELEMENTS, GGUF_MAX_NESTED_ARRAYS, GgufFormatError, GgufValueType, parseGguf } from '../../src/model/gguf.ts';
import type { GgufValue } from '../../src/model/gguf.ts';
import { llama3FreqFactors, ModelFormatError } from '../../src/model/gguf-model.ts';
import { chatTemplateFromConfig } from '../../src/model/chat-template.ts';
import { hfModelConfig } from '../../src/model/hf.ts';
import { isModelLoadError, loadModel } from '../../src/model/loader.ts';
import { quantize } from '../../src/model/quant.ts';
import { ReferenceModel } from '../../src/model/reference-forward.ts';
import { readSafetensors, writeSafetensors } from '../../src/model/safetensors.ts';
import type { SafetensorsTensorData } from '../../src/model/safetensors.ts';
import { archModel, skipUnlessVocabFor, writeArchHf } from './arch-models.ts';
import { makeTinyModel, TINY_DIMS, tinyGgufMetadata, writeTinyGguf, writeTinyHf } from './loader-fixtures.ts';
import type { GgufWriteOverrides, TinyModel } from './loader-fixtures.ts';

let dir: string;
before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-refusals-')); });
after(() => rmSync(dir, { recursive: true, force: true }));

let counter = 0;
const tempPath = (ext = '.gguf'): string => join(dir, `case-${counter++}${ext}`);

/** Asserts `error` is a one-line load error of the given class whose message matches `pattern`. */
function assertRefusal(error: unknown, type: typeof GgufFormatError | typeof ModelFormatError, pattern: RegExp): true {
  assert.ok(error instanceof type, `expected a ${type.name}, got ${String((error as Error)?.stack ?? error)}`);
  assert.ok(isModelLoadError(error), 'the CLI prints it as one line');
  assert.ok(!error.message.includes('\n'), `one line: ${error.message}`);
  assert.match(error.message, pattern);
  return true;
}

const refusesParse = (bytes: Uint8Array, pattern: RegExp): void => {
  assert.throws(() => parseGguf(bytes, 'x.gguf'), (e) => assertRefusal(e, GgufFormatError, pattern));
};

async function refusesLoad(path: string, type: typeof GgufFormatError | typeof ModelFormatError,
  pattern: RegExp): Promise<void> {
  await assert.rejects(loadModel(path), (e) => assertRefusal(e, type, pattern));
}

async function tinyGguf(overrides: GgufWriteOverrides, model: TinyModel = makeTinyModel()): Promise<string> {
  const path = tempPath();
  writeTinyGguf(path, model, overrides);
  return path;
}

// ---------------------------------------------------------------------------------------------------------------
// A GGUF assembled byte by byte, so that it can be wrong in ways no writer allows.

const u32 = (v: number): Buffer => { const b = Buffer.alloc(4); b.writeUInt32LE(v); return b; };
const u64 = (v: number | bigint): Buffer => { const b = Buffer.alloc(8); b.writeBigUInt64LE(BigInt(v)); return b; };
const str = (s: string): Buffer => Buffer.concat([u64(Buffer.byteLength(s)), Buffer.from(s, 'utf8')]);
const kvString = (key: string, value: string): Buffer => Buffer.concat([str(key), u32(GgufValueType.STRING), str(value)]);
const kvU32 = (key: string, value: number): Buffer => Buffer.concat([str(key), u32(GgufValueType.UINT32), u32(value)]);
/** An array entry's head: key, ARRAY, element type, length (the elements follow). */
const kvArrayHead = (key: string, elementType: GgufValueType, length: number | bigint): Buffer =>
  Buffer.concat([str(key), u32(GgufValueType.ARRAY), u32(elementType), u64(length)]);

interface RawTensor { name: string; shape: number[]; type: GgmlType; offset: number }

function rawGguf({ kv = [], tensors = [], alignment = 32, dataBytes = 0 }:
  { kv?: Buffer[]; tensors?: RawTensor[]; alignment?: number; dataBytes?: number }): Uint8Array {
  const parts: Buffer[] = [u32(0x46554747), u32(3), u64(tensors.length), u64(kv.length), ...kv];
  for (const t of tensors) {
    parts.push(str(t.name), u32(t.shape.length), ...t.shape.map((d) => u64(d)), u32(t.type), u64(t.offset));
  }
  const header = Buffer.concat(parts);
  const padded = Math.ceil(header.length / alignment) * alignment;
  return Buffer.concat([header, Buffer.alloc(padded - header.length + dataBytes)]);
}

const escape = (s: string): string => s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');

const f32 = (name: string, shape: number[], offset: number): RawTensor => ({ name, shape, type: GgmlType.F32, offset });

// ---------------------------------------------------------------------------------------------------------------
describe('GGUF reader: what llama.cpp refuses, refused in one line', () => {
  it('reads a well-formed file (the baseline the cases below break)', () => {
    const file = parseGguf(rawGguf({ kv: [kvString('general.name', 'x')],
      tensors: [f32('a', [8], 0), f32('b', [4, 2], 32)], dataBytes: 64 }));
    assert.deepEqual(file.tensorInfos.map((t) => t.name), ['a', 'b']);
    assert.equal(file.tensor('b').data.byteLength, 32);
  });

  it('a metadata key given twice', () => {
    refusesParse(rawGguf({ kv: [kvString('general.name', 'a'), kvU32('x.n', 1), kvString('general.name', 'b')] }),
      /x\.gguf: metadata key general\.name appears twice/);
  });

  it('a tensor name given twice', () => {
    refusesParse(rawGguf({ tensors: [f32('w', [8], 0), f32('w', [8], 32)], dataBytes: 64 }),
      /tensor w appears twice in the tensor table/);
  });

  it('general.alignment that is not a power of two, or not a UINT32', () => {
    refusesParse(rawGguf({ kv: [kvU32('general.alignment', 48)], alignment: 48 }), /general\.alignment 48 is not a power of two/);
    refusesParse(rawGguf({ kv: [kvU32('general.alignment', 0)] }), /general\.alignment 0 is not a power of two/);
    const asString = rawGguf({ kv: [kvString('general.alignment', '64')] });
    refusesParse(asString, /general\.alignment is stored as STRING, not UINT32/);
    // A power of two is fine, and the data offsets follow it.
    const file = parseGguf(rawGguf({ kv: [kvU32('general.alignment', 64)], tensors: [f32('v', [4], 0), f32('w', [4], 64)],
      alignment: 64, dataBytes: 128 }));
    assert.equal(file.alignment, 64);
    assert.equal(file.dataOffset % 64, 0);
    assert.equal(file.tensor('w').data.byteOffset - file.bytes.byteOffset, file.dataOffset + 64);
  });

  it('a tensor offset that is not a multiple of the alignment', () => {
    refusesParse(rawGguf({ tensors: [f32('a', [4], 0), f32('b', [4], 16)], dataBytes: 64 }),
      /tensor b starts at data offset 16, which is not a multiple of the file's alignment 32/);
  });

  it('tensors whose data overlap', () => {
    // a: 16 floats = 64 bytes from offset 0; b starts at 32, inside a.
    refusesParse(rawGguf({ tensors: [f32('a', [16], 0), f32('b', [4], 32)], dataBytes: 128 }),
      /tensors a and b overlap \(data offsets 0 and 32, the first is 64 bytes\)/);
    // In whichever order the table lists them.
    refusesParse(rawGguf({ tensors: [f32('b', [4], 32), f32('a', [16], 0)], dataBytes: 128 }), /tensors a and b overlap/);
  });

  it('bytes between tensors, or before the first, that belong to no tensor', () => {
    // a: 8 floats = 32 bytes, so b belongs at 32 (the next multiple of 32); at 64 there are 32 bytes of nothing.
    refusesParse(rawGguf({ tensors: [f32('a', [8], 0), f32('b', [4], 64)], dataBytes: 96 }),
      /tensor b starts at data offset 64, 32 bytes after the end of tensor a \(at data offset 32 with padding\); the bytes between belong to no tensor/);
    refusesParse(rawGguf({ tensors: [f32('a', [8], 32)], dataBytes: 64 }),
      /tensor a starts at data offset 32, 32 bytes after the start of the data section/);
    // Padding up to the alignment is not a gap: a is 16 bytes, b starts at the next multiple of 32.
    assert.deepEqual(parseGguf(rawGguf({ tensors: [f32('a', [4], 0), f32('b', [4], 32)], dataBytes: 64 }))
      .tensorInfos.map((t) => t.offset), [0, 32]);
  });

  it('an F32 tensor relabelled F16: half its bytes would be read as other numbers, so the file is refused', async () => {
    const path = await tinyGguf({});
    const bytes = readFileSync(path);
    // The tensor info: name, dimension count, dimensions, then the type.
    const name = Buffer.from('blk.0.ffn_up.weight');
    const at = bytes.indexOf(Buffer.concat([u64(name.length), name])) + 8 + name.length;
    const typeAt = at + 4 + 8 * bytes.readUInt32LE(at);
    assert.equal(bytes.readUInt32LE(typeAt), GgmlType.F32);
    bytes.writeUInt32LE(GgmlType.F16, typeAt);
    writeFileSync(path, bytes);
    await refusesLoad(path, GgufFormatError, /tensor blk\.0\.ffn_down\.weight starts at data offset \d+, 4096 bytes after the end of tensor blk\.0\.ffn_up\.weight .* the bytes between belong to no tensor/);
  });

  it('a tensor type the format does not define, wherever its data is said to be', () => {
    refusesParse(rawGguf({ tensors: [{ name: 'x', shape: [8], type: 99 as GgmlType, offset: 2 ** 40 }], dataBytes: 32 }),
      /tensor x has ggml type 99, which is not a type the GGUF format defines/);
    // Q4_2 (4) was removed from ggml; llama.cpp refuses it too.
    refusesParse(rawGguf({ tensors: [{ name: 'x', shape: [32], type: 4 as GgmlType, offset: 0 }], dataBytes: 32 }),
      /tensor x has ggml type 4, which is not a type the GGUF format defines/);
  });

  it('tensors of types Conduit does not compute with (IQ, ternary) get every structural check', () => {
    // IQ4_NL: 32 elements in 18 bytes. 64 elements take 36 bytes, so the next tensor belongs at 64, not 32.
    const iq = (name: string, shape: number[], type: GgmlType, offset: number): RawTensor => ({ name, shape, type, offset });
    refusesParse(rawGguf({ tensors: [iq('q', [64], GgmlType.IQ4_NL, 0), f32('b', [4], 32)], dataBytes: 96 }),
      /tensors q and b overlap/);
    refusesParse(rawGguf({ tensors: [f32('a', [8], 0), iq('q', [256, 4], GgmlType.IQ2_XXS, 32)], dataBytes: 64 }),
      /tensor q runs past the end of the file/);
    refusesParse(rawGguf({ tensors: [iq('q', [128], GgmlType.IQ2_XXS, 0)], dataBytes: 96 }),
      /tensor q has rows of 128 elements, which is not a multiple of the IQ2_XXS block size 256/);
    refusesParse(rawGguf({ tensors: [iq('q', [64], GgmlType.IQ4_NL, 0), f32('b', [4], 96)], dataBytes: 128 }),
      /tensor b starts at data offset 96, 32 bytes after the end of tensor q/);
    // Well laid out, it parses, and its bytes are its own.
    const file = parseGguf(rawGguf({ tensors: [iq('q', [256, 2], GgmlType.TQ2_0, 0), f32('b', [4], 160)], dataBytes: 192 }));
    assert.equal(file.tensor('q').data.byteLength, 2 * 66);
  });

  it('a big-endian GGUF, named as such', () => {
    const bytes = Buffer.from(rawGguf({}));
    bytes.writeUInt32BE(3, 4);
    refusesParse(bytes, /x\.gguf: a big-endian GGUF \(version 3 in big-endian byte order\); Conduit reads little-endian GGUF files only/);
  });

  it('tensor data beyond the end of the file, at parse time', () => {
    refusesParse(rawGguf({ tensors: [f32('a', [8], 0), f32('b', [16], 32)], dataBytes: 64 }),
      /tensor b runs past the end of the file \(its data ends at byte \d+, the file has \d+\)/);
  });

  it('a quantized tensor whose rows are not a whole number of blocks (even when the total is)', () => {
    // Q8_0 packs 32 elements per block: 16 x 64 is 32 blocks, but each 16-element row is half a block.
    refusesParse(rawGguf({ tensors: [{ name: 'q', shape: [16, 64], type: GgmlType.Q8_0, offset: 0 }], dataBytes: 32 * 34 }),
      /tensor q has rows of 16 elements, which is not a multiple of the Q8_0 block size 32/);
  });

  it('a quantized tensor whose element count is not a whole number of blocks', () => {
    refusesParse(rawGguf({ tensors: [{ name: 'q', shape: [16, 3], type: GgmlType.Q8_0, offset: 0 }], dataBytes: 64 }),
      /tensor q has rows of 16 elements, which is not a multiple of the Q8_0 block size 32/);
    refusesParse(rawGguf({ tensors: [{ name: 'k', shape: [300], type: GgmlType.Q4_K, offset: 0 }], dataBytes: 512 }),
      /tensor k has rows of 300 elements, which is not a multiple of the Q4_K block size 256/);
  });

  it('metadata arrays of 2^40 elements, before allocating them', () => {
    for (const type of [GgufValueType.STRING, GgufValueType.BOOL, GgufValueType.ARRAY, GgufValueType.UINT8, GgufValueType.FLOAT64]) {
      refusesParse(rawGguf({ kv: [Buffer.concat([kvArrayHead('tokenizer.ggml.tokens', type, 2n ** 40n), Buffer.alloc(64)])] }),
        /metadata tokenizer\.ggml\.tokens claims 1099511627776 array elements, more than the \d+ bytes left in the file can hold/);
    }
  });

  it('a string longer than any JS string, named (decoding it threw a plain Error)', () => {
    // Only the length is read: the check comes before the bytes are looked for.
    const length = 2 ** 30;
    refusesParse(rawGguf({ kv: [Buffer.concat([u64(length), Buffer.from('x')])] }),
      new RegExp(`x\\.gguf: the key of metadata entry 0 of 1: a string of ${length} bytes at offset 32, longer than the ` +
        'longest string Conduit can hold'));
  });

  it('a string of a bad length inside a string array or a value, naming the key and the element', () => {
    // The second of three tokens claims a million bytes; a value string claims more bytes than are left.
    const tokens = Buffer.concat([kvArrayHead('tokenizer.ggml.tokens', GgufValueType.STRING, 3), str('a'), u64(1_000_000),
      Buffer.from('b')]);
    refusesParse(rawGguf({ kv: [tokens] }), /^x\.gguf: metadata tokenizer\.ggml\.tokens, string 1 of 3: truncated GGUF \(wanted 1000000 bytes/);
    const value = Buffer.concat([str('general.name'), u32(GgufValueType.STRING), u64(1000), Buffer.from('short')]);
    refusesParse(rawGguf({ kv: [value] }), /^x\.gguf: metadata general\.name: truncated GGUF \(wanted 1000 bytes/);
    refusesParse(Buffer.concat([u32(0x46554747), u32(3), u64(1), u64(0), u64(50), Buffer.from('abc')]),
      /^x\.gguf: the name of tensor 0 of 1 in the tensor table: truncated GGUF \(wanted 50 bytes/);
  });

  it('a file cut inside a tensor entry, naming the tensor', () => {
    // Tensor "wq" (1 of 2) ends after its second dimension: its type and offset are missing.
    const entries = Buffer.concat([u32(0x46554747), u32(3), u64(2), u64(0), str('a'), u32(1), u64(8), u32(GgmlType.F32), u64(0),
      str('wq'), u32(2), u64(8), u64(8)]);
    refusesParse(entries, /^x\.gguf: the entry of tensor wq \(1 of 2\) in the tensor table: truncated GGUF \(wanted 4 bytes/);
    // Cut inside its dimensions.
    refusesParse(entries.subarray(0, entries.length - 4),
      /^x\.gguf: the entry of tensor wq \(1 of 2\) in the tensor table: truncated GGUF \(wanted 8 bytes/);
  });

  it('arrays nested 200000 deep (a bounded depth, not a stack overflow)', () => {
    const levels = 200_000;
    const inner = Buffer.alloc(levels * 12 + 12);
    for (let i = 0; i < levels; i++) { inner.writeUInt32LE(GgufValueType.ARRAY, i * 12); inner.writeBigUInt64LE(1n, i * 12 + 4); }
    inner.writeUInt32LE(GgufValueType.UINT32, levels * 12); // innermost: an empty UINT32 array
    refusesParse(rawGguf({ kv: [Buffer.concat([kvArrayHead('x.deep', GgufValueType.ARRAY, 1), inner])] }),
      /metadata x\.deep nests arrays more than \d+ deep/);
    // Nesting within the bound still reads.
    const shallow = Buffer.concat([kvArrayHead('x.shallow', GgufValueType.ARRAY, 1), u32(GgufValueType.ARRAY), u64(1),
      u32(GgufValueType.UINT32), u64(1), u32(7)]);
    assert.deepEqual(parseGguf(rawGguf({ kv: [shallow] })).metadata.get('x.shallow'), [[new Uint32Array([7])]]);
  });

  it('more arrays inside arrays, or BOOL elements, than any writer writes (each costs far more memory than bytes)', () => {
    // 70000 empty UINT8 arrays inside one array: 12 bytes each in the file, a JS object each in memory.
    const count = GGUF_MAX_NESTED_ARRAYS + 10;
    const inner = Buffer.alloc(count * 12);
    for (let i = 0; i < count; i++) inner.writeUInt32LE(GgufValueType.UINT8, i * 12);
    refusesParse(rawGguf({ kv: [Buffer.concat([kvArrayHead('x.wide', GgufValueType.ARRAY, count), inner])] }),
      new RegExp(`metadata x\\.wide brings the file's arrays inside arrays to more than ${GGUF_MAX_NESTED_ARRAYS}`));
    // The bound is on the file: two keys under it each, over it together.
    const half = (key: string) => Buffer.concat([kvArrayHead(key, GgufValueType.BOOL, GGUF_MAX_BOOL_ELEMENTS / 2 + 1),
      Buffer.alloc(GGUF_MAX_BOOL_ELEMENTS / 2 + 1)]);
    refusesParse(rawGguf({ kv: [half('x.a'), half('x.b')] }),
      new RegExp(`metadata x\\.b brings the file's BOOL array elements to ${GGUF_MAX_BOOL_ELEMENTS + 2}, more than`));
    // One flag per layer reads as ever.
    const flags = Buffer.concat([kvArrayHead('x.flags', GgufValueType.BOOL, 3), Buffer.from([1, 0, 1])]);
    assert.deepEqual(parseGguf(rawGguf({ kv: [flags] })).metadata.get('x.flags'), [true, false, true]);
  });

  it('counts, lengths and dimensions near 2^64, and dimensions whose product overflows', () => {
    const header = (tensors: bigint, kvs: bigint) => Buffer.concat([u32(0x46554747), u32(3), u64(tensors), u64(kvs)]);
    refusesParse(header(2n ** 64n - 1n, 0n), /x\.gguf: tensor count 18446744073709551615 is too large/);
    refusesParse(header(0n, 2n ** 63n), /metadata count 9223372036854775808 is too large/);
    // A count that fits but that the file cannot hold ends within the file's bytes, not in a loop or an allocation
    // (here the zero bytes read as nameless tensors, the second of which repeats the first's name).
    refusesParse(Buffer.concat([header(2n ** 50n, 0n), Buffer.alloc(64)]), /tensor {2}appears twice/);
    refusesParse(Buffer.concat([header(2n ** 50n, 0n), u64(1), Buffer.from('a')]), /truncated GGUF/);
    refusesParse(Buffer.concat([header(0n, 1n), u64(2n ** 64n - 1n)]), /string length 18446744073709551615 is too large/);
    refusesParse(rawGguf({ tensors: [f32('a', [2 ** 40, 2 ** 40], 0)], dataBytes: 32 }),
      /tensor a of shape \[1099511627776, 1099511627776\] has too many elements/);
    refusesParse(rawGguf({ tensors: [f32('a', [2 ** 26, 2 ** 26], 0)], dataBytes: 32 }), /tensor a runs past the end of the file/);
    const dimension = Buffer.concat([header(1n, 0n), str('a'), u32(1), u64(2n ** 63n), u32(GgmlType.F32), u64(0)]);
    refusesParse(dimension, /dimension of a 9223372036854775808 is too large/);
    refusesParse(rawGguf({ tensors: [{ name: 'a', shape: [1, 1, 1, 1, 1], type: GgmlType.F32, offset: 0 }], dataBytes: 32 }),
      /tensor a has 5 dimensions \(at most 4\)/);
  });

  it('an unknown value type, naming the key', () => {
    refusesParse(rawGguf({ kv: [Buffer.concat([str('x.odd'), u32(99), u32(0)])] }), /metadata x\.odd has unknown GGUF value type 99/);
    refusesParse(rawGguf({ kv: [kvArrayHead('x.odd', 99 as GgufValueType, 1)] }), /metadata x\.odd is an array of unknown GGUF value type 99/);
  });
});

// ---------------------------------------------------------------------------------------------------------------
describe('model metadata that cannot be computed with', () => {
  const eps = 'llama.attention.layer_norm_rms_epsilon';
  for (const value of [Number.NaN, Number.POSITIVE_INFINITY, 0, -1e-6]) {
    it(`GGUF ${eps} ${value}`, async () => {
      await refusesLoad(await tinyGguf({ metadata: { [eps]: value } }), ModelFormatError,
        // GGUF stores it as f32; the loader reads back the shortest decimal with that f32 (-1e-6, not -9.99999997e-7).
        new RegExp(`metadata ${escape(eps)} is ${escape(String(value))}, not a positive finite number`));
    });
  }

  for (const value of [0, -5, 2.5]) {
    it(`GGUF context_length ${value}`, async () => {
      await refusesLoad(await tinyGguf({ metadata: { 'llama.context_length': value } }), ModelFormatError,
        new RegExp(`metadata llama\\.context_length is ${value}, not a positive whole number`));
    });
  }

  it('GGUF per-layer values: an empty array is named as such, not as values that differ between layers', async () => {
    await refusesLoad(await tinyGguf({ metadata: { 'llama.attention.head_count_kv': new Uint32Array(0) } }), ModelFormatError,
      /metadata llama\.attention\.head_count_kv is an empty array, not a number/);
    await refusesLoad(await tinyGguf({ metadata: { 'llama.attention.head_count_kv': new Uint32Array([2, 4]) } }), ModelFormatError,
      /metadata llama\.attention\.head_count_kv differs between layers/);
  });

  it('GGUF block_count 0, head_count 0, feed_forward_length 0', async () => {
    await refusesLoad(await tinyGguf({ metadata: { 'llama.block_count': 0 } }), ModelFormatError,
      /metadata llama\.block_count is 0, not a positive whole number/);
    await refusesLoad(await tinyGguf({ metadata: { 'llama.attention.head_count': 0 } }), ModelFormatError,
      /metadata llama\.attention\.head_count is 0, not a positive whole number/);
    await refusesLoad(await tinyGguf({ metadata: { 'llama.feed_forward_length': 0 } }), ModelFormatError,
      /metadata llama\.feed_forward_length is 0, not a positive whole number/);
  });

  it('GGUF rope.dimension_count 0 or odd, and a RoPE base of 0', async () => {
    await refusesLoad(await tinyGguf({ metadata: { 'llama.rope.dimension_count': 0 } }), ModelFormatError,
      /metadata llama\.rope\.dimension_count is 0; the rotated dimensions must be a positive even number, at most the head size 8/);
    await refusesLoad(await tinyGguf({ metadata: { 'llama.rope.dimension_count': 5 } }), ModelFormatError,
      /metadata llama\.rope\.dimension_count is 5/);
    await refusesLoad(await tinyGguf({ metadata: { 'llama.rope.freq_base': 0 } }), ModelFormatError,
      /metadata llama\.rope\.freq_base is 0, not a positive finite number/);
  });

  it('a layer or expert count of 10^9: refused before tables of that size are built (it ran out of heap)', async () => {
    const gemma3: Record<string, GgufValue | undefined> = { 'general.architecture': 'gemma3' };
    for (const [key, value] of tinyGgufMetadata(makeTinyModel())) if (key.startsWith('llama.')) gemma3[`gemma3.${key.slice(6)}`] = value;
    await refusesLoad(await tinyGguf({ metadata: { ...gemma3, 'gemma3.block_count': 1e9, 'gemma3.attention.sliding_window': 16 } }),
      ModelFormatError, /metadata gemma3\.block_count is 1000000000, more than the 65536 any model has/);
    await refusesLoad(await tinyGguf({ metadata: { 'llama.expert_count': 1e9, 'llama.expert_used_count': 2 } }),
      ModelFormatError, /metadata llama\.expert_count is 1000000000, more than the 65536 any model has/);
    const cases: [Record<string, unknown>, RegExp][] = [
      [{ architectures: ['Gemma3ForCausalLM'], num_hidden_layers: 1e9, sliding_window: 16 },
        /config\.json num_hidden_layers is 1000000000, more than the 65536 any model has/],
      [{ architectures: ['MixtralForCausalLM'], num_local_experts: 1e9, num_experts_per_tok: 2 },
        /config\.json num_local_experts is 1000000000, more than the 65536 any model has/],
    ];
    for (const [overrides, pattern] of cases) {
      const folder = tempPath('');
      writeTinyHf(folder, makeTinyModel(), { configOverrides: overrides });
      await refusesLoad(folder, ModelFormatError, pattern);
    }
  });

  it('Hugging Face num_experts_per_tok above the number of experts (the reference backend ran it)', async (t) => {
    // Mixtral's test model has the bundled Llama 2 vocabulary; Qwen3-MoE's needs /work/shared's Qwen2 one.
    const qwenSkip = skipUnlessVocabFor(archModel('qwen3moe'));
    if (qwenSkip) t.diagnostic(`the Qwen3-MoE case is skipped: ${qwenSkip}`);
    const models = qwenSkip ? [['mixtral', 4]] as const : [['mixtral', 4], ['qwen3moe', 8]] as const;
    for (const [name, experts] of models) {
      const folder = tempPath('');
      writeArchHf(archModel(name), folder);
      const config = JSON.parse(readFileSync(join(folder, 'config.json'), 'utf8')) as Record<string, unknown>;
      writeFileSync(join(folder, 'config.json'), JSON.stringify({ ...config, num_experts_per_tok: experts + 1 }));
      await refusesLoad(folder, ModelFormatError,
        new RegExp(`config\\.json num_experts_per_tok ${experts + 1} is more than the ${experts} experts`));
    }
  });

  it('Hugging Face rms_norm_eps 0 or negative, max_position_embeddings 0 or fractional, num_hidden_layers 0', async () => {
    const cases: [Record<string, unknown>, RegExp][] = [
      [{ rms_norm_eps: 0 }, /config\.json rms_norm_eps is 0, not a positive finite number/],
      [{ rms_norm_eps: -1e-6 }, /config\.json rms_norm_eps is -0\.000001, not a positive finite number/],
      [{ max_position_embeddings: 0 }, /config\.json max_position_embeddings is 0, not a positive whole number/],
      [{ max_position_embeddings: 100.5 }, /config\.json max_position_embeddings is 100\.5, not a positive whole number/],
      [{ num_hidden_layers: 0 }, /config\.json num_hidden_layers is 0, not a positive whole number/],
      [{ partial_rotary_factor: 0.01 }, /rotated dimension count \(partial_rotary_factor 0\.01\) is 0/],
    ];
    for (const [overrides, pattern] of cases) {
      const folder = tempPath('');
      writeTinyHf(folder, makeTinyModel(), { configOverrides: overrides });
      await refusesLoad(folder, ModelFormatError, pattern);
    }
  });

  it('Hugging Face config fields of the wrong type: refused naming the field, never read as absent (another model, silently)', async () => {
    const cases: [Record<string, unknown>, RegExp][] = [
      [{ tie_word_embeddings: 'true' }, /config\.json tie_word_embeddings is "true", not true or false/],
      [{ attention_bias: 1 }, /config\.json attention_bias is 1, not true or false/],
      [{ partial_rotary_factor: '0.5' }, /config\.json partial_rotary_factor is "0\.5", not a number/],
      [{ partial_rotary_factor: 1.5 }, /config\.json partial_rotary_factor is 1\.5; a head rotates at most all of its dimensions/],
      [{ head_dim: '8' }, /config\.json head_dim is "8", not a number/],
      [{ head_dim: 8.5 }, /config\.json head_dim is 8\.5, not a positive whole number/],
      [{ architectures: ['MistralForCausalLM'], sliding_window: '4096' }, /config\.json sliding_window is "4096", not a number/],
      [{ rope_scaling: [] }, /rope_scaling is not an object/],
      [{ rope_scaling: { factor: 2 } }, /rope_scaling has no rope_type \(or type\)/],
    ];
    for (const [overrides, pattern] of cases) {
      const folder = tempPath('');
      writeTinyHf(folder, makeTinyModel(), { configOverrides: overrides });
      await refusesLoad(folder, ModelFormatError, pattern);
    }
    // Gemma 3's own fields, on its config alone.
    const gemma3 = {
      architectures: ['Gemma3ForCausalLM'], hidden_size: 32, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8,
      vocab_size: 48, num_hidden_layers: 2, intermediate_size: 64, max_position_embeddings: 64, rms_norm_eps: 1e-6,
      sliding_window: 16, query_pre_attn_scalar: 8,
    };
    assert.equal(hfModelConfig(gemma3, 'g', 'g').slidingWindow, 16);
    const gemmaCases: [Record<string, unknown>, RegExp][] = [
      [{ query_pre_attn_scalar: '168' }, /config\.json query_pre_attn_scalar is "168", not a number/],
      [{ query_pre_attn_scalar: 0 }, /config\.json query_pre_attn_scalar is 0, not a positive finite number/],
      [{ final_logit_softcapping: '30' }, /config\.json final_logit_softcapping is "30", not a number/],
      [{ rope_local_base_freq: '10000' }, /config\.json rope_local_base_freq is "10000", not a number/],
      [{ sliding_window_pattern: '2' }, /config\.json sliding_window_pattern is "2", not a number/],
      [{ layer_types: ['sliding', 'full_attention'] }, /config\.json layer_types must be a list of "sliding_attention" and "full_attention"/],
      [{ tie_word_embeddings: 'false' }, /config\.json tie_word_embeddings is "false", not true or false/],
    ];
    for (const [overrides, pattern] of gemmaCases) {
      assert.throws(() => hfModelConfig({ ...gemma3, ...overrides }, 'g', 'g'), (e) => assertRefusal(e, ModelFormatError, pattern));
    }
  });

  it('Hugging Face Qwen with use_sliding_window on some layers: refused (transformers and vLLM apply the window)', () => {
    // Conduit would attend to every token on those layers; with the window on none of them, the model loads.
    const qwen = { architectures: ['Qwen2ForCausalLM'], hidden_size: 32, num_attention_heads: 4, num_key_value_heads: 2,
      vocab_size: 48, num_hidden_layers: 2, intermediate_size: 64, max_position_embeddings: 64, rms_norm_eps: 1e-6,
      sliding_window: 16, max_window_layers: 1 };
    assert.throws(() => hfModelConfig({ ...qwen, use_sliding_window: true }, 'q', 'q'), (e) => assertRefusal(e, ModelFormatError,
      /^q: config\.json use_sliding_window is true \(a 16-token window on layers 1 to 1\); Qwen models with a sliding window are not supported$/));
    assert.equal(hfModelConfig({ ...qwen, use_sliding_window: false }, 'q', 'q').slidingWindow, undefined);
    assert.equal(hfModelConfig({ ...qwen, use_sliding_window: true, max_window_layers: 2 }, 'q', 'q').slidingWindow, undefined);
  });
});

// ---------------------------------------------------------------------------------------------------------------
describe('tensors the model does not use', () => {
  const f32Tensor = (name: string, shape: number[]) => ({ name, type: GgmlType.F32, shape,
    data: quantize(GgmlType.F32, new Float32Array(shape.reduce((a, b) => a * b, 1)).fill(0.5)) });

  it('GGUF attn_output.bias: refused, naming it (llama.cpp adds it to the attention output)', async () => {
    await refusesLoad(await tinyGguf({ tensors: { 'blk.0.attn_output.bias': f32Tensor('blk.0.attn_output.bias', [32]) } }),
      ModelFormatError, /tensor blk\.0\.attn_output\.bias is a bias Conduit does not apply; running without it would give wrong output, so the model is refused/);
  });

  it('GGUF feed-forward biases: refused, naming the first, counting the rest', async () => {
    const tensors: GgufWriteOverrides['tensors'] = {};
    for (let l = 0; l < 2; l++) {
      tensors[`blk.${l}.ffn_up.bias`] = f32Tensor(`blk.${l}.ffn_up.bias`, [64]);
      tensors[`blk.${l}.ffn_down.bias`] = f32Tensor(`blk.${l}.ffn_down.bias`, [32]);
    }
    await refusesLoad(await tinyGguf({ tensors }), ModelFormatError,
      /tensor blk\.0\.ffn_up\.bias is a bias Conduit does not apply; .* \(and 3 more unused tensors\)/);
  });

  it('GGUF Q/K/V biases on a layer other than the first (blk.0 decides whether the model has them)', async () => {
    await refusesLoad(await tinyGguf({ tensors: { 'blk.1.attn_k.bias': f32Tensor('blk.1.attn_k.bias', [16]) } }),
      ModelFormatError, /tensor blk\.1\.attn_k\.bias is a bias Conduit does not apply/);
  });

  it('a qwen2 GGUF without its Q/K/V biases: refused, not run without them (llama.cpp requires them too)', async () => {
    const model = makeTinyModel(TINY_DIMS, { architecture: 'qwen2' });
    const tensors: GgufWriteOverrides['tensors'] = {};
    for (const l of [0, 1]) for (const x of ['q', 'k', 'v']) tensors[`blk.${l}.attn_${x}.bias`] = undefined;
    await refusesLoad(await tinyGguf({ tensors }, model), ModelFormatError, /tensor blk\.0\.attn_q\.bias is missing/);
    assert.equal((await loadModel(await tinyGguf({}, model))).config.qkvBias, true);
  });

  it('GGUF tensors of other kinds', async () => {
    await refusesLoad(await tinyGguf({ tensors: { 'blk.0.attn_rot_embd': f32Tensor('blk.0.attn_rot_embd', [4]) } }),
      ModelFormatError, /tensor blk\.0\.attn_rot_embd is not one that Conduit's llama model reads; running without it could give wrong output, so the model is refused/);
    await refusesLoad(await tinyGguf({ tensors: { 'rope_factors_short.weight': f32Tensor('rope_factors_short.weight', [4]) } }),
      ModelFormatError, /tensor rope_factors_short\.weight is not one that Conduit's llama model reads/);
  });

  it('GGUF rope_freqs.weight stays accepted: the config carries the same llama3 scaling', async () => {
    const dims = { ...TINY_DIMS, dim: 256, numHeads: 2, numKvHeads: 1 };
    const scaling = { type: 'llama3', factor: 8, lowFreqFactor: 1, highFreqFactor: 4, originalContextLength: 8192 } as const;
    const path = await tinyGguf({ metadata: { 'llama.rope.freq_base': 500000 },
      tensors: { 'rope_freqs.weight': { name: 'rope_freqs.weight', type: GgmlType.F32, shape: [64],
        data: quantize(GgmlType.F32, llama3FreqFactors(scaling, 500000, 128)) } } }, makeTinyModel(dims));
    assert.deepEqual((await loadModel(path)).config.ropeScaling, scaling);
    // All ones: no scaling, and nothing left out.
    const ones = await tinyGguf({ tensors: { 'rope_freqs.weight': { name: 'rope_freqs.weight', type: GgmlType.F32, shape: [4],
      data: quantize(GgmlType.F32, new Float32Array(4).fill(1)) } } });
    await loadModel(ones).then((m) => assert.equal(m.config.ropeScaling, undefined));
  });

  /** An HF folder plus extra.safetensors holding `extra` (the folder's shards are every *.safetensors file). */
  async function hfWithExtra(extra: SafetensorsTensorData[], configOverrides: Record<string, unknown> = {},
    tied = false): Promise<string> {
    const folder = tempPath('');
    writeTinyHf(folder, makeTinyModel(TINY_DIMS, { tied }), { configOverrides });
    writeSafetensors(join(folder, 'extra.safetensors'), extra, { format: 'pt' });
    return folder;
  }
  const hfF32 = (name: string, shape: number[]): SafetensorsTensorData =>
    ({ name, dtype: 'F32', shape, data: new Uint8Array(new Float32Array(shape.reduce((a, b) => a * b, 1)).buffer) });

  it('HF attention_bias: true with an o_proj bias: refused, naming it (transformers adds it)', async () => {
    const extra: SafetensorsTensorData[] = [];
    for (let l = 0; l < 2; l++) {
      extra.push(hfF32(`model.layers.${l}.self_attn.q_proj.bias`, [32]), hfF32(`model.layers.${l}.self_attn.k_proj.bias`, [16]),
        hfF32(`model.layers.${l}.self_attn.v_proj.bias`, [16]), hfF32(`model.layers.${l}.self_attn.o_proj.bias`, [32]));
    }
    await refusesLoad(await hfWithExtra(extra, { attention_bias: true }), ModelFormatError,
      /tensor model\.layers\.0\.self_attn\.o_proj\.bias is a bias Conduit does not apply; .* \(and 1 more unused tensors\)/);
  });

  it('HF mlp_bias: true: refused, naming the first MLP bias', async () => {
    const extra = [0, 1].flatMap((l) => [hfF32(`model.layers.${l}.mlp.gate_proj.bias`, [64]),
      hfF32(`model.layers.${l}.mlp.up_proj.bias`, [64]), hfF32(`model.layers.${l}.mlp.down_proj.bias`, [32])]);
    await refusesLoad(await hfWithExtra(extra, { mlp_bias: true }), ModelFormatError,
      /tensor model\.layers\.0\.mlp\.(gate|up|down)_proj\.bias is a bias Conduit does not apply/);
  });

  it('HF rotary_emb.inv_freq and a tied checkpoint\'s lm_head copy stay accepted', async () => {
    const extra = [0, 1].map((l) => hfF32(`model.layers.${l}.self_attn.rotary_emb.inv_freq`, [4]));
    extra.push(hfF32('model.rotary_emb.inv_freq', [4]), hfF32('lm_head.weight', [48, 32]));
    const loaded = await loadModel(await hfWithExtra(extra, {}, true));
    assert.equal(loaded.weights.output, loaded.weights.tokenEmbedding);
    // Anything else is refused.
    await refusesLoad(await hfWithExtra([hfF32('model.layers.0.self_attn.extra.weight', [4])]), ModelFormatError,
      /tensor model\.layers\.0\.self_attn\.extra\.weight is not one that Conduit's llama model reads/);
  });
});

// ---------------------------------------------------------------------------------------------------------------
describe('GGUF RoPE scaling keys, read as llama.cpp reads them', () => {
  const scalingOf = async (metadata: Record<string, GgufValue | undefined>, overrides: GgufWriteOverrides = {}) =>
    (await loadModel(await tinyGguf({ ...overrides, metadata }))).config.ropeScaling;

  it('rope.scaling.factor without rope.scaling.type is linear', async () => {
    assert.deepEqual(await scalingOf({ 'llama.rope.scaling.factor': 4 }), { type: 'linear', factor: 4 });
  });

  it('the legacy rope.scale_linear is a linear factor; rope.scaling.factor wins over it', async () => {
    assert.deepEqual(await scalingOf({ 'llama.rope.scale_linear': 2 }), { type: 'linear', factor: 2 });
    assert.deepEqual(await scalingOf({ 'llama.rope.scale_linear': 2, 'llama.rope.scaling.factor': 4 }),
      { type: 'linear', factor: 4 });
  });

  it('type "none" never scales; a factor of 1 is no scaling', async () => {
    assert.equal(await scalingOf({ 'llama.rope.scaling.type': 'none', 'llama.rope.scaling.factor': 4 }), undefined);
    assert.equal(await scalingOf({ 'llama.rope.scaling.factor': 1 }), undefined);
  });

  it('refuses a factor that is not a positive number, and linear scaling on top of rope_freqs.weight', async () => {
    await refusesLoad(await tinyGguf({ metadata: { 'llama.rope.scaling.factor': -2 } }), ModelFormatError,
      /metadata llama\.rope\.scaling\.factor is -2; a RoPE scaling factor must be a positive number/);
    await refusesLoad(await tinyGguf({ metadata: { 'llama.rope.scale_linear': Number.NaN } }), ModelFormatError,
      /metadata llama\.rope\.scale_linear is NaN/);
    // A type that is not a string was read as absent, which means linear: refused instead.
    await refusesLoad(await tinyGguf({ metadata: { 'llama.rope.scaling.type': 2, 'llama.rope.scaling.factor': 4 } }), ModelFormatError,
      /metadata llama\.rope\.scaling\.type is not a string/);
    const freqs = { name: 'rope_freqs.weight', type: GgmlType.F32, shape: [4], data: quantize(GgmlType.F32, new Float32Array(4).fill(1)) };
    await refusesLoad(await tinyGguf({ metadata: { 'llama.rope.scaling.factor': 4 }, tensors: { 'rope_freqs.weight': freqs } }),
      ModelFormatError, /linear RoPE scaling \(llama\.rope\.scaling\.factor 4\) together with rope_freqs\.weight is not supported/);
  });

  it('RoPE divisors that are not positive finite numbers, or below 1: refused, never NaN scores or a silent no-op', async () => {
    const freqs = (values: number[]): GgufWriteOverrides => ({ tensors: { 'rope_freqs.weight': { name: 'rope_freqs.weight',
      type: GgmlType.F32, shape: [values.length], data: quantize(GgmlType.F32, new Float32Array(values)) } } });
    await refusesLoad(await tinyGguf(freqs([1, 1, 1, Number.NaN])), ModelFormatError,
      /rope_freqs\.weight: entry 3 is NaN; RoPE frequency factors must be positive finite numbers/);
    await refusesLoad(await tinyGguf(freqs([0, 0, 0, 0])), ModelFormatError, /rope_freqs\.weight: entry 0 is 0; RoPE frequency factors/);
    await refusesLoad(await tinyGguf(freqs([1, 1, 1, Infinity])), ModelFormatError, /entry 3 is Infinity/);
    // All below 1 was taken for "no scaling" (the largest is not above 1); llama.cpp divides by them.
    await refusesLoad(await tinyGguf(freqs([0.5, 0.5, 0.5, 0.5])), ModelFormatError,
      /rope_freqs\.weight: entry 0 is 0\.5, which llama3 RoPE scaling does not give/);
  });

  it('GGUF LongRoPE: both factor sets, the attention factor and the original context are checked', async () => {
    const f32 = (name: string, values: number[]) => ({ name, type: GgmlType.F32, shape: [values.length],
      data: quantize(GgmlType.F32, new Float32Array(values)) });
    const longRope = (long: number[], short: number[], metadata: Record<string, GgufValue> = {}): GgufWriteOverrides => ({
      metadata: { 'llama.rope.scaling.original_context_length': 32, ...metadata },
      tensors: { 'rope_factors_long.weight': f32('rope_factors_long.weight', long), 'rope_factors_short.weight': f32('rope_factors_short.weight', short) },
    });
    const ones = [1, 1, 1, 1];
    await refusesLoad(await tinyGguf(longRope([1, 0, 1, 1], ones)), ModelFormatError, /rope_factors_long\.weight: entry 1 is 0/);
    // The context (64) is above the original (32): the long set is used, and the short one is checked all the same.
    await refusesLoad(await tinyGguf(longRope(ones, [1, 1])), ModelFormatError, /rope_factors_short\.weight has 2 entries, expected ropeDim \/ 2 = 4/);
    await refusesLoad(await tinyGguf(longRope(ones, ones, { 'llama.rope.scaling.attn_factor': Number.NaN })), ModelFormatError,
      /metadata llama\.rope\.scaling\.attn_factor is NaN, not a positive finite number/);
    // Of the wrong type: refused, not read as absent (an attention factor of 1, or "needs an original context").
    await refusesLoad(await tinyGguf(longRope(ones, ones, { 'llama.rope.scaling.attn_factor': '1.19' })), ModelFormatError,
      /metadata llama\.rope\.scaling\.attn_factor is not a number/);
    await refusesLoad(await tinyGguf(longRope(ones, ones, { 'llama.rope.scaling.original_context_length': '32' })), ModelFormatError,
      /metadata llama\.rope\.scaling\.original_context_length is not a number/);
    await refusesLoad(await tinyGguf(longRope(ones, ones, { 'llama.rope.scaling.original_context_length': 0 })), ModelFormatError,
      /metadata llama\.rope\.scaling\.original_context_length is 0, not a positive whole number/);
    assert.equal((await loadModel(await tinyGguf(longRope([2, 2, 2, 2], ones)))).config.ropeScaling?.type, 'longrope');
  });

  it('Hugging Face rope_scaling: factors that are not positive numbers, a llama3 band of no width, LongRoPE without an original context', async () => {
    const llama3 = { rope_type: 'llama3', factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192 };
    const longrope = { type: 'longrope', long_factor: [1, 1, 1, 1], short_factor: [1, 1, 1, 1], original_max_position_embeddings: 32 };
    const cases: [unknown, RegExp][] = [
      [{ type: 'linear', factor: 0 }, /config\.json rope_scaling\.factor is 0, not a positive finite number/],
      [{ type: 'linear', factor: -2 }, /config\.json rope_scaling\.factor is -2/],
      [{ ...llama3, factor: 0 }, /config\.json rope_scaling\.factor is 0/],
      [{ ...llama3, low_freq_factor: 4 }, /rope_scaling\.high_freq_factor 4 is not above low_freq_factor 4/],
      [{ ...llama3, original_max_position_embeddings: 0 }, /rope_scaling\.original_max_position_embeddings is 0, not a positive whole number/],
      [{ ...longrope, original_max_position_embeddings: 0 }, /original_max_position_embeddings \(LongRoPE\) is 0, not a positive whole number/],
      [{ ...longrope, attention_factor: -1 }, /config\.json rope_scaling\.attention_factor is -1, not a positive finite number/],
      [{ ...longrope, attention_factor: '1.19' }, /rope_scaling\.attention_factor is "1\.19", not a number/],
      [{ ...longrope, short_factor: [1, 0, 1, 1] }, /rope_scaling\.short_factor must be 4 positive numbers/],
    ];
    for (const [ropeScaling, pattern] of cases) {
      const folder = tempPath('');
      writeTinyHf(folder, makeTinyModel(), { configOverrides: { rope_scaling: ropeScaling } });
      await refusesLoad(folder, ModelFormatError, pattern);
    }
  });

  it('the scaled model computes different logits from the unscaled one', async () => {
    const model = makeTinyModel();
    const plain = await loadModel(await tinyGguf({}, model));
    const scaled = await loadModel(await tinyGguf({ metadata: { 'llama.rope.scaling.factor': 4 } }, model));
    const tokens = [1, 7, 3, 12, 5, 9];
    const a = new ReferenceModel(plain.config, plain.weights).forward(tokens, 0);
    const b = new ReferenceModel(scaled.config, scaled.weights).forward(tokens, 0);
    const maxDiff = a.reduce((m, v, i) => Math.max(m, Math.abs(v - b[i]!)), 0);
    assert.ok(maxDiff > 1e-3, `logits differ (max difference ${maxDiff})`);
  });
});

// ---------------------------------------------------------------------------------------------------------------
describe('whole model files', () => {
  it('is refused at load, not at worker start', async () => {
    // dim 48: Q8_0 rows of 48 elements are 1.5 blocks, though every tensor's total is a whole number of blocks.
    const model = makeTinyModel({ ...TINY_DIMS, dim: 48 });
    await refusesLoad(await tinyGguf({ type: GgmlType.Q8_0 }, model), GgufFormatError,
      /tensor token_embd\.weight has rows of 48 elements, which is not a multiple of the Q8_0 block size 32/);
  });

  it('an IQ-quantized weight is refused naming its type and the supported ones', async () => {
    // IQ4_NL: 18 bytes per 32 elements; blk.1.ffn_up.weight is [32, 64].
    const path = await tinyGguf({ tensors: { 'blk.1.ffn_up.weight': { name: 'blk.1.ffn_up.weight', type: GgmlType.IQ4_NL,
      shape: [32, 64], data: new Uint8Array(18 * 64) } } });
    await refusesLoad(path, ModelFormatError,
      /tensor blk\.1\.ffn_up\.weight has type IQ4_NL, which Conduit cannot compute with \(supported: F32, F16, BF16, Q8_0/);
  });

  it('a file written to disk with a duplicate key is refused by loadModel too', async () => {
    const path = tempPath();
    writeFileSync(path, rawGguf({ kv: [kvString('general.architecture', 'llama'), kvString('general.architecture', 'qwen2')] }));
    await refusesLoad(path, GgufFormatError, /metadata key general\.architecture appears twice/);
  });
});

// ---------------------------------------------------------------------------------------------------------------
describe('Hugging Face folders: the shard index, and files that are not files', () => {
  const shard = (i: number): string => `model-0000${i}-of-00003.safetensors`;
  /** A tiny folder in three shards, its index edited by `edit`. */
  function shardedFolder(edit: (weightMap: Record<string, unknown>, folder: string) => void = () => {}): string {
    const folder = tempPath('');
    writeTinyHf(folder, makeTinyModel(), { shards: 3 });
    const indexPath = join(folder, 'model.safetensors.index.json');
    const index = JSON.parse(readFileSync(indexPath, 'utf8')) as { weight_map: Record<string, unknown> };
    edit(index.weight_map, folder);
    writeFileSync(indexPath, JSON.stringify(index));
    return folder;
  }
  const lastTensor = (weightMap: Record<string, unknown>): string => Object.keys(weightMap).at(-1)!;

  it('the baseline: a sharded folder loads', async () => {
    assert.equal((await loadModel(shardedFolder())).config.numLayers, 2);
  });

  it('an index that names a shard for a tensor the shard does not hold', async () => {
    let moved = '';
    const folder = shardedFolder((map) => { moved = lastTensor(map); map[moved] = shard(1); });
    await refusesLoad(folder, ModelFormatError, new RegExp(`model\\.safetensors\\.index\\.json lists tensor ${escape(moved)} ` +
      `in shard ${escape(shard(1))}, which does not hold it`));
  });

  it('a shard holding a tensor the index does not list (it would have been left out)', async () => {
    let dropped = '';
    const folder = shardedFolder((map) => { dropped = lastTensor(map); delete map[dropped]; });
    await refusesLoad(folder, ModelFormatError, new RegExp(`shard ${escape(shard(3))} holds tensor ${escape(dropped)}, ` +
      'which model\\.safetensors\\.index\\.json does not list'));
  });

  it('a tensor held by two listed shards (transformers and vLLM would load whichever comes last)', async () => {
    let copied = '';
    const folder = shardedFolder((map, dir) => {
      copied = Object.keys(map).find((name) => map[name] === shard(1))!;
      const first = readSafetensors(join(dir, shard(1))).tensor(copied);
      const third = readSafetensors(join(dir, shard(3)));
      const tensors: SafetensorsTensorData[] = [...third.entries.values()].map((e) =>
        ({ name: e.name, dtype: e.dtype as 'F32', shape: e.shape, data: third.bytes.slice(e.begin, e.end) }));
      const entry = readSafetensors(join(dir, shard(1))).entries.get(copied)!;
      // Another value for the same name: which one is the model's is unclear.
      tensors.push({ name: copied, dtype: entry.dtype as 'F32', shape: entry.shape, data: new Uint8Array(first.data.byteLength) });
      writeSafetensors(join(dir, shard(3)), tensors);
    });
    await refusesLoad(folder, ModelFormatError, new RegExp(`tensor ${escape(copied)} is in both ${escape(shard(1))} and ` +
      `${escape(shard(3))}`));
  });

  it('an index whose shard is not a file name in the folder', async () => {
    for (const value of [5, null, '../elsewhere.safetensors', '/etc/passwd', '']) {
      const folder = shardedFolder((map) => { map['model.norm.weight'] = value; });
      await refusesLoad(folder, ModelFormatError,
        /index\.json: weight_map gives tensor model\.norm\.weight the shard .*, which is not the name of a file in the folder/);
    }
    const arrayMap = shardedFolder();
    writeFileSync(join(arrayMap, 'model.safetensors.index.json'), JSON.stringify({ weight_map: [shard(1)] }));
    await refusesLoad(arrayMap, ModelFormatError, /model\.safetensors\.index\.json has no weight_map object/);
  });

  it('a folder where a shard, config.json or tokenizer_config.json belongs', async () => {
    for (const name of [shard(2), 'config.json', 'tokenizer_config.json', 'tokenizer.json']) {
      const folder = shardedFolder();
      rmSync(join(folder, name));
      mkdirSync(join(folder, name));
      await refusesLoad(folder, ModelFormatError, new RegExp(`${escape(name)} is not a regular file`));
    }
  });

  it('an untied model without lm_head.weight: refused, not run with the embeddings as its output projection', async () => {
    const model = makeTinyModel();
    model.tensors.delete('output.weight');
    for (const overrides of [{ tie_word_embeddings: false }, { tie_word_embeddings: undefined }]) {
      const folder = tempPath('');
      writeTinyHf(folder, model, { configOverrides: overrides });
      await refusesLoad(folder, ModelFormatError, /tensor lm_head\.weight is missing, and config\.json does not tie the output projection to the embeddings/);
    }
    // Tied, it loads with the embeddings as the output.
    const tied = tempPath('');
    writeTinyHf(tied, model, { configOverrides: { tie_word_embeddings: true } });
    const loaded = await loadModel(tied);
    assert.equal(loaded.weights.output, loaded.weights.tokenEmbedding);
  });

  it('a file of a Hugging Face folder given instead of the folder, and an empty file, say so', async () => {
    const folder = shardedFolder();
    for (const name of [shard(1), 'config.json']) {
      await refusesLoad(join(folder, name), ModelFormatError, new RegExp(`${escape(name)} is neither a GGUF file .*; it is a ` +
        `file of the Hugging Face model folder ${escape(folder)}, which is what --model takes$`));
    }
    const empty = tempPath();
    writeFileSync(empty, '');
    await refusesLoad(empty, ModelFormatError, /case-\d+\.gguf is empty, neither a GGUF file \(no "GGUF" magic\) nor a Hugging Face model folder$/);
  });

  it('chat_template.jinja beside tokenizer_config.json is the template the engine builds (it got the fallback)', async () => {
    const folder = tempPath('');
    writeTinyHf(folder, makeTinyModel(), { tokenizerConfig: { bos_token: '<s>', eos_token: '</s>' } });
    writeFileSync(join(folder, 'chat_template.jinja'), 'JINJA:{{ messages[0].content }}');
    const loaded = await loadModel(folder);
    assert.equal(loaded.tokenizerSource.kind, 'hf');
    // What createLocalEngine builds the served template from.
    const config = loaded.tokenizerSource.kind === 'hf' ? loaded.tokenizerSource.tokenizerConfig : {};
    const template = chatTemplateFromConfig(config);
    assert.equal(template.isFallback, false);
    assert.equal(template.render([{ role: 'user', content: 'hi' }]), 'JINJA:hi');
    assert.equal(config.eos_token, '</s>', 'the rest of tokenizer_config.json is kept');
  });

  it('a chat template that does not parse, or a malformed template list: refused at load naming the file', async () => {
    const cases: [Record<string, unknown>, RegExp][] = [
      [{ chat_template: '{% for %}' }, /tokenizer_config\.json: chat template "default" does not parse/],
      // [null] was a TypeError from inside the loader.
      [{ chat_template: [null] }, /tokenizer_config\.json: chat_template list entries must be \{ name, template \} strings/],
      [{ chat_template: { a: 1 } }, /tokenizer_config\.json: chat_template must be a string or a list/],
    ];
    for (const [tokenizerConfig, pattern] of cases) {
      const folder = tempPath('');
      writeTinyHf(folder, makeTinyModel(), { tokenizerConfig });
      await refusesLoad(folder, ModelFormatError, pattern);
    }
    const jinja = tempPath('');
    writeTinyHf(jinja, makeTinyModel(), { tokenizerConfig: {} });
    writeFileSync(join(jinja, 'chat_template.jinja'), '{% if %}');
    await refusesLoad(jinja, ModelFormatError, /chat_template\.jinja: chat template "default" does not parse/);
    await refusesLoad(await tinyGguf({ extraMetadata: [['tokenizer.chat_template', '{% for %}']] }), ModelFormatError,
      /\.gguf: tokenizer\.chat_template: chat template "default" does not parse/);
  });

  it('a device or a FIFO given as the model: refused at once, not read forever', async (t) => {
    if (existsSync('/dev/zero')) {
      await refusesLoad('/dev/zero', ModelFormatError, /\/dev\/zero is not a regular file \(a device, FIFO or socket\)/);
    }
    const fifo = join(dir, 'fifo');
    try {
      execFileSync('mkfifo', [fifo]);
    } catch {
      t.skip('mkfifo is not available');
      return;
    }
    await refusesLoad(fifo, ModelFormatError, /fifo is not a regular file \(a device, FIFO or socket\)/);
  });
});
