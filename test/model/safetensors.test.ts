import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync, truncateSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { GgmlType } from '../../src/model/ggml-types.ts';
import { dequantizeTensor } from '../../src/model/quant.ts';
import { openSafetensors, parseSafetensors, readSafetensors, writeSafetensors } from '../../src/model/safetensors.ts';

let dir: string;
before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-safetensors-')); });
after(() => rmSync(dir, { recursive: true, force: true }));

/** A file assembled by hand from the format definition: u64 header length, JSON header, data. */
function handMade(header: object, data: number[]): Uint8Array {
  const json = Buffer.from(JSON.stringify(header));
  const prefix = Buffer.alloc(8);
  prefix.writeBigUInt64LE(BigInt(json.byteLength));
  return new Uint8Array(Buffer.concat([prefix, json, Buffer.from(data)]));
}

describe('safetensors reader', () => {
  it('reads a hand-made file: dtypes, reversed shapes, zero-copy views', () => {
    const bytes = handMade({
      __metadata__: { format: 'pt' },
      'w.f16': { dtype: 'F16', shape: [2, 3], data_offsets: [0, 12] },
      'b.bf16': { dtype: 'BF16', shape: [2], data_offsets: [12, 16] },
      'n.f32': { dtype: 'F32', shape: [1], data_offsets: [16, 20] },
    }, [
      0x00, 0x3c, 0x00, 0x40, 0x00, 0x42, 0x00, 0xbc, 0x00, 0xc0, 0x00, 0x00, // f16 1 2 3 -1 -2 0
      0x80, 0x3f, 0x49, 0x40, // bf16 1, 3.140625
      0x00, 0x00, 0x20, 0x41, // f32 10
    ]);
    const file = parseSafetensors(bytes, 'hand.safetensors');
    assert.deepEqual(file.metadata, { format: 'pt' });
    const w = file.tensor('w.f16');
    assert.equal(w.type, GgmlType.F16);
    assert.deepEqual(w.shape, [3, 2], 'row-major [2, 3] is ggml [3, 2]');
    assert.deepEqual([...dequantizeTensor(w)], [1, 2, 3, -1, -2, 0]);
    assert.equal(w.data.buffer, bytes.buffer, 'a view, not a copy');
    assert.deepEqual([...dequantizeTensor(file.tensor('b.bf16'))], [1, 3.140625]);
    assert.deepEqual([...dequantizeTensor(file.tensor('n.f32'))], [10]);
  });

  it('names what is wrong with a bad file', () => {
    const tensor = (entry: object): Uint8Array => handMade({ t: entry }, [0, 0, 0, 0]);
    assert.throws(() => parseSafetensors(tensor({ dtype: 'I64', shape: [1], data_offsets: [0, 4] }), 'f').tensor('t'),
      /f: tensor t has dtype I64, which is not supported \(supported: F32, F16, BF16\)/);
    assert.throws(() => parseSafetensors(tensor({ dtype: 'constructor', shape: [1], data_offsets: [0, 4] }), 'f').tensor('t'),
      /f: tensor t has dtype constructor, which is not supported \(supported: F32, F16, BF16\)/);
    assert.throws(() => parseSafetensors(tensor({ dtype: 'F32', shape: [2], data_offsets: [0, 4] }), 'f').tensor('t'),
      /tensor t has 4 bytes, but F32 \[2\] needs 8/);
    assert.throws(() => parseSafetensors(tensor({ dtype: 'F32', shape: [2], data_offsets: [0, 8] }), 'f'), /outside the file/);
    assert.throws(() => parseSafetensors(tensor({ dtype: 'F32' }), 'f'), /header entry for t is malformed/);
    assert.throws(() => parseSafetensors(tensor({ dtype: 'F32', shape: [1], data_offsets: [0, 4] }), 'f').tensor('u'), /tensor u not found/);
    const huge = new Uint8Array(16);
    new DataView(huge.buffer).setBigUint64(0, 1000n, true);
    assert.throws(() => parseSafetensors(huge, 'f'), /header length 1000 does not fit/);
    // __metadata__ is a map of strings (the reference reader refuses anything else, so transformers cannot load it).
    for (const metadata of [5, 'pt', ['pt'], { format: 1 }]) {
      assert.throws(() => parseSafetensors(handMade({ __metadata__: metadata, t: { dtype: 'F32', shape: [1], data_offsets: [0, 4] } },
        [0, 0, 0, 0]), 'f'), /f: __metadata__ must be an object of strings, got /);
    }
    assert.deepEqual(parseSafetensors(handMade({ __metadata__: null }, []), 'f').metadata, {});
    const notJson = new Uint8Array([2, 0, 0, 0, 0, 0, 0, 0, 0x7b, 0x7b]);
    assert.throws(() => parseSafetensors(notJson, 'f'), /header is not valid JSON/);
  });

  it('refuses tensors that share bytes, bytes that belong to no tensor, and shapes whose size overflows', () => {
    const f32 = (begin: number, end: number, shape = [(end - begin) / 4]) => ({ dtype: 'F32', shape, data_offsets: [begin, end] });
    const parse = (header: object, dataBytes: number) => () => parseSafetensors(handMade(header, new Array(dataBytes).fill(0)), 'f');
    // Well tiled: in any header order.
    assert.deepEqual([...parse({ b: f32(8, 16), a: f32(0, 8) }, 16)().entries.keys()], ['b', 'a']);
    assert.throws(parse({ a: f32(0, 8), b: f32(4, 12) }, 12), /f: tensors a and b overlap \(data \[0, 8\] and \[4, 12\]\)/);
    assert.throws(parse({ a: f32(0, 8), b: f32(0, 8) }, 8), /tensors a and b overlap/);
    assert.throws(parse({ a: f32(0, 8), b: f32(12, 16) }, 16),
      /f: tensor b starts at data offset 12, 4 bytes after the end of tensor a; the bytes between belong to no tensor/);
    assert.throws(parse({ a: f32(4, 8) }, 8), /tensor a starts at data offset 4, 4 bytes after the start of the data/);
    assert.throws(parse({ a: f32(0, 8) }, 12), /f: the file has 4 bytes after the last tensor's data, which belong to no tensor/);
    assert.throws(parse({ a: f32(8, 0, [2]) }, 8), /f: tensor a data_offsets \[8, 0\] end before they begin/);
    // 2^40 x 2^40 elements: no byte count can be computed, and the error is the file's, not an arithmetic one.
    assert.throws(parse({ a: f32(0, 8, [2 ** 40, 2 ** 40]) }, 8), /f: tensor a of shape \[1099511627776, 1099511627776\] has too many elements/);
    assert.throws(parse({ a: f32(0, 8, [1e300, 1e300]) }, 8), /tensor a of shape \[1e\+300, 1e\+300\] has too many elements/);
  });
});

describe('safetensors writer', () => {
  it('round-trips tensors and metadata, with 8-byte aligned data', () => {
    const path = join(dir, 'round.safetensors');
    const f32 = new Float32Array([1.5, -2, 0.25, 4, 5, 6]);
    const f16 = new Uint8Array([0x00, 0x3c, 0x00, 0xc0]);
    writeSafetensors(path, [
      { name: 'a', dtype: 'F32', shape: [3, 2], data: new Uint8Array(f32.buffer) },
      { name: 'b', dtype: 'F16', shape: [2], data: f16 },
    ], { format: 'pt' });
    const raw = readFileSync(path);
    const headerLength = Number(raw.readBigUInt64LE(0));
    assert.equal((8 + headerLength) % 8, 0);
    const header = JSON.parse(raw.subarray(8, 8 + headerLength).toString());
    assert.deepEqual(header.a, { dtype: 'F32', shape: [3, 2], data_offsets: [0, 24] });
    const file = readSafetensors(path);
    assert.deepEqual(file.metadata, { format: 'pt' });
    assert.deepEqual(file.tensor('a').shape, [2, 3]);
    assert.deepEqual(dequantizeTensor(file.tensor('a')), f32);
    assert.deepEqual([...dequantizeTensor(file.tensor('b'))], [1, -2]);

    // Read by parts (the header, then a tensor's bytes at its position): the same header and tensors.
    const reader = openSafetensors(path);
    try {
      assert.deepEqual(reader.head, raw.subarray(0, 8 + headerLength));
      assert.deepEqual(reader.tensor('a').shape, [2, 3]);
      assert.deepEqual(dequantizeTensor(reader.tensor('a')), f32);
      assert.deepEqual([...dequantizeTensor(reader.tensor('b'))], [1, -2]);
      // A file cut short after its header was read: named, not a tensor of zeros.
      truncateSync(path, raw.byteLength - 2);
      assert.throws(() => reader.tensor('b'), /the file ended at byte \d+, before the 4 bytes at \d+ were read/);
    } finally {
      reader.close();
    }
  });

  it('rejects data of the wrong size and duplicate names', () => {
    const path = join(dir, 'bad.safetensors');
    assert.throws(() => writeSafetensors(path, [{ name: 'a', dtype: 'F32', shape: [2], data: new Uint8Array(4) }]), /a has 4 bytes/);
    const t = { name: 'a', dtype: 'F16' as const, shape: [1], data: new Uint8Array(2) };
    assert.throws(() => writeSafetensors(path, [t, t]), /tensor a appears twice/);
  });
});
