import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { byteSize, GgmlType } from '../../src/model/ggml-types.ts';
import { GgufValueType, parseGguf, readGguf } from '../../src/model/gguf.ts';
import type { GgufValue } from '../../src/model/gguf.ts';
import { encodeGguf, writeGguf } from '../../src/model/gguf-writer.ts';
import type { GgufTensorToWrite, GgufValueTypeSpec } from '../../src/model/gguf-writer.ts';
import { dequantizeTensor, quantize } from '../../src/model/quant.ts';
import { SeededRandom } from '../../src/model/synthetic.ts';
import { sharedModel, skipUnlessShared } from '../helpers/shared-models.ts';

let dir: string;
before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-gguf-')); });
after(() => rmSync(dir, { recursive: true, force: true }));

// ---------------------------------------------------------------------------------------------------------------
describe('GGUF metadata round trip', () => {
  // Every scalar type with an explicit type, every array element type, and values that need inference.
  const explicit: [string, GgufValue, GgufValueTypeSpec][] = [
    ['t.u8', 250, { type: GgufValueType.UINT8 }],
    ['t.i8', -100, { type: GgufValueType.INT8 }],
    ['t.u16', 65000, { type: GgufValueType.UINT16 }],
    ['t.i16', -32000, { type: GgufValueType.INT16 }],
    ['t.u32', 4000000000, { type: GgufValueType.UINT32 }],
    ['t.i32', -2000000000, { type: GgufValueType.INT32 }],
    ['t.f32', 0.5, { type: GgufValueType.FLOAT32 }],
    ['t.f64', 0.1, { type: GgufValueType.FLOAT64 }],
    ['t.bool', true, { type: GgufValueType.BOOL }],
    ['t.string', 'héllo, 世界', { type: GgufValueType.STRING }],
    ['t.u64', 2n ** 63n + 5n, { type: GgufValueType.UINT64 }],
    ['t.u64.small', 7, { type: GgufValueType.UINT64 }],
    ['t.i64', -(2n ** 62n), { type: GgufValueType.INT64 }],
    ['t.bool.array', [true, false, true], { type: GgufValueType.ARRAY, arrayType: GgufValueType.BOOL }],
    ['t.string.array', ['a', '', '▁b', '<0x0A>'], { type: GgufValueType.ARRAY, arrayType: GgufValueType.STRING }],
  ];
  const inferred: [string, GgufValue, GgufValueTypeSpec][] = [
    ['i.count', 42, { type: GgufValueType.UINT32 }],
    ['i.negative', -3, { type: GgufValueType.INT32 }],
    ['i.float', 1e-5, { type: GgufValueType.FLOAT32 }],
    ['i.bigint', 12345678901234567890n, { type: GgufValueType.UINT64 }],
    ['i.u8s', new Uint8Array([1, 2, 255]), { type: GgufValueType.ARRAY, arrayType: GgufValueType.UINT8 }],
    ['i.i8s', new Int8Array([-1, 2]), { type: GgufValueType.ARRAY, arrayType: GgufValueType.INT8 }],
    ['i.u16s', new Uint16Array([65535]), { type: GgufValueType.ARRAY, arrayType: GgufValueType.UINT16 }],
    ['i.i16s', new Int16Array([-32768]), { type: GgufValueType.ARRAY, arrayType: GgufValueType.INT16 }],
    ['i.u32s', new Uint32Array([1, 4294967295]), { type: GgufValueType.ARRAY, arrayType: GgufValueType.UINT32 }],
    ['i.i32s', new Int32Array([-1, 1, 3]), { type: GgufValueType.ARRAY, arrayType: GgufValueType.INT32 }],
    ['i.f32s', new Float32Array([0.25, -1.5]), { type: GgufValueType.ARRAY, arrayType: GgufValueType.FLOAT32 }],
    ['i.f64s', new Float64Array([Math.PI]), { type: GgufValueType.ARRAY, arrayType: GgufValueType.FLOAT64 }],
    ['i.u64s', new BigUint64Array([2n ** 64n - 1n]), { type: GgufValueType.ARRAY, arrayType: GgufValueType.UINT64 }],
    ['i.i64s', new BigInt64Array([-(2n ** 63n)]), { type: GgufValueType.ARRAY, arrayType: GgufValueType.INT64 }],
    ['i.empty', [], { type: GgufValueType.ARRAY, arrayType: GgufValueType.STRING }],
    ['i.nested', [['x', 'y'], new Int32Array([7])], { type: GgufValueType.ARRAY, arrayType: GgufValueType.ARRAY }],
  ];
  const all = [...explicit, ...inferred];

  function roundTrip(): ReturnType<typeof parseGguf> {
    const types = new Map(explicit.map(([k, , t]) => [k, t]));
    return parseGguf(encodeGguf({ metadata: all.map(([k, v]) => [k, v]), types, tensors: [] }));
  }

  it('reads back every value and its stored type', () => {
    const file = roundTrip();
    assert.equal(file.version, 3);
    assert.deepEqual([...file.metadata.keys()], all.map(([k]) => k), 'file order is kept');
    for (const [key, value, type] of all) {
      const read = file.metadata.get(key);
      if (key === 't.f32') assert.equal(read, 0.5);
      else if (key === 'i.float') assert.equal(read, Math.fround(1e-5));
      else if (key === 't.u64.small') assert.equal(read, 7);
      else assert.deepEqual(read, value, key);
      assert.deepEqual(file.metadataTypes.get(key), type, `${key} type`);
    }
  });

  it('rejects a value that does not fit its declared type, and duplicates', () => {
    const attempt = (value: GgufValue, type: GgufValueTypeSpec): Uint8Array =>
      encodeGguf({ metadata: [['k', value]], types: new Map([['k', type]]), tensors: [] });
    assert.throws(() => attempt(256, { type: GgufValueType.UINT8 }), /metadata k: .*UINT8/);
    assert.throws(() => attempt(-1, { type: GgufValueType.UINT32 }), /UINT32/);
    assert.throws(() => attempt('x', { type: GgufValueType.FLOAT32 }), /FLOAT32/);
    assert.throws(() => attempt([1, 300], { type: GgufValueType.ARRAY, arrayType: GgufValueType.INT8 }), /k\[1\]/);
    assert.throws(() => encodeGguf({ metadata: [['k', 1], ['k', 2]], tensors: [] }), /k appears twice/);
  });
});

// ---------------------------------------------------------------------------------------------------------------
describe('GGUF tensor round trip', () => {
  const random = new SeededRandom(3);
  const types = [GgmlType.F32, GgmlType.F16, GgmlType.BF16, GgmlType.Q8_0, GgmlType.Q4_0, GgmlType.Q4_K, GgmlType.Q5_K,
    GgmlType.Q6_K];
  const tensors: GgufTensorToWrite[] = types.map((type, i) => {
    const shape = [256, 3];
    const values = new Float32Array(768).map(() => random.normal());
    return { name: `t${i}.${GgmlType[type]}`, type, shape, data: quantize(type, values) };
  });
  // A 1-D tensor of odd byte length makes the next tensor's offset need padding.
  tensors.push({ name: 'odd', type: GgmlType.F16, shape: [3], data: quantize(GgmlType.F16, new Float32Array([1, 2, 3])) });
  tensors.push({ name: 'after-odd', type: GgmlType.F32, shape: [2, 1, 1, 2], data: quantize(GgmlType.F32, new Float32Array([1, 2, 3, 4])) });

  for (const alignment of [32, 64]) {
    it(`keeps every dtype's bytes, shape and alignment ${alignment}`, () => {
      const path = join(dir, `tensors-${alignment}.gguf`);
      writeGguf(path, { metadata: [['general.architecture', 'llama']], tensors, alignment });
      const file = readGguf(path);
      assert.equal(file.alignment, alignment);
      assert.equal(file.dataOffset % alignment, 0);
      for (const t of tensors) {
        const info = file.tensorInfos.find((i) => i.name === t.name)!;
        assert.equal(info.offset % alignment, 0, `${t.name} offset aligned`);
        const read = file.tensor(t.name);
        assert.equal(read.type, t.type);
        assert.deepEqual(read.shape, t.shape);
        assert.ok(Buffer.from(read.data).equals(t.data as Uint8Array), t.name);
      }
      assert.deepEqual([...dequantizeTensor(file.tensor('after-odd'))], [1, 2, 3, 4]);
      assert.deepEqual(readFileSync(path), Buffer.from(encodeGguf({ metadata: [['general.architecture', 'llama']], tensors, alignment })),
        'streaming and in-memory writers agree');
    });
  }

  it('asks for lazily produced tensor data once each, in file order', () => {
    const calls: string[] = [];
    const lazy = ['a', 'b', 'c'].map((name): GgufTensorToWrite => ({
      name, type: GgmlType.F32, shape: [4],
      data: () => { calls.push(name); return new Uint8Array(16); },
    }));
    writeGguf(join(dir, 'lazy.gguf'), { metadata: [], tensors: lazy });
    assert.deepEqual(calls, ['a', 'b', 'c']);
  });

  it('rejects data of the wrong size, bad shapes and duplicate names', () => {
    const base = { name: 'x', type: GgmlType.Q8_0, shape: [32] };
    assert.throws(() => encodeGguf({ metadata: [], tensors: [{ ...base, data: new Uint8Array(33) }] }),
      /tensor x: 33 bytes given, Q8_0 \[32\] needs 34/);
    assert.throws(() => encodeGguf({ metadata: [], tensors: [{ ...base, shape: [0], data: new Uint8Array(0) }] }), /shape \[0\]/);
    assert.throws(() => encodeGguf({ metadata: [], tensors: [{ ...base, shape: [16], data: new Uint8Array(17) }] }),
      /not a multiple of the block size 32/);
    const ok = { ...base, data: new Uint8Array(byteSize(GgmlType.Q8_0, 32)) };
    assert.throws(() => encodeGguf({ metadata: [], tensors: [ok, ok] }), /tensor x appears twice/);
  });
});

// ---------------------------------------------------------------------------------------------------------------
describe('rewriting real GGUF files', () => {
  for (const name of ['stories260K.gguf', 'ggml-vocab-llama-spm.gguf']) {
    it(`reproduces ${name} byte for byte from what the reader parsed`, { skip: skipUnlessShared(name) }, () => {
      const original = readFileSync(sharedModel(name)!);
      const file = parseGguf(original);
      const rewritten = encodeGguf({
        metadata: file.metadata,
        types: file.metadataTypes,
        tensors: file.tensorInfos.map((info) => ({ ...file.tensor(info.name), shape: info.shape })),
      });
      assert.equal(rewritten.byteLength, original.byteLength);
      assert.ok(Buffer.from(rewritten).equals(original));
    });
  }
});
