// The KV transfer's checksum, CRC-32C: the addon's (SSE4.2 instruction in three streams, and its table path) and the
// TypeScript fallback agree with each other and with the standard check value, at every length and split, so a
// worker with the addon and one without check each other's runs.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { crc32cPortable, KvChecksumBatch, kvChecksum, kvChecksumCopy } from '../../src/cluster/kv-checksum.ts';
import { addon, skipNative } from '../kernels/native-harness.ts';

function bytes(n: number, seed: number): Uint8Array {
  const out = new Uint8Array(new SharedArrayBuffer(n + 3)).subarray(3); // unaligned, over shared memory as a pool is
  let x = seed >>> 0;
  for (let i = 0; i < n; i++) {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    out[i] = x >>> 24;
  }
  return out;
}

describe('KV transfer checksum (CRC-32C)', () => {
  test('the check value of "123456789" is 0xE3069283, and an empty input leaves the running value', () => {
    assert.equal(crc32cPortable(Buffer.from('123456789')), 0xe3069283);
    assert.equal(kvChecksum(Buffer.from('123456789')), 0xe3069283);
    assert.equal(kvChecksum(new Uint8Array(0), 0x1234), 0x1234);
  });

  test('a flipped bit changes it; continuing over a split equals the whole', () => {
    const data = bytes(10_000, 1);
    const whole = kvChecksum(data);
    for (const at of [0, 1, 7, 4096, 9_999]) {
      const copy = data.slice();
      copy[at]! ^= 0x10;
      assert.notEqual(kvChecksum(copy), whole, `bit flipped at ${at}`);
      assert.equal(kvChecksum(data.subarray(at), kvChecksum(data.subarray(0, at))), whole, `split at ${at}`);
    }
  });

  test('the addon\'s hardware and table paths equal the TypeScript one at every length around its stream sizes', { skip: skipNative }, () => {
    for (const n of [1, 7, 8, 9, 63, 383, 384, 385, 511, 3071, 3072, 3073, 4095, 4096, 4097, 16_384, 24_575, 24_576, 24_577, 49_152 + 13, 200_003, 1 << 20]) {
      const data = bytes(n, n);
      const expected = crc32cPortable(data);
      assert.equal(addon!.crc32c(data), expected, `native, ${n} bytes`);
      assert.equal(addon!.crc32c(data, 0, true), expected, `native table, ${n} bytes`);
      assert.equal(addon!.crc32c(data.subarray(5), addon!.crc32c(data.subarray(0, 5))), expected, `native continued, ${n} bytes`);
    }
    assert.throws(() => addon!.crc32c(new Float32Array(4) as unknown as Uint8Array), /Uint8Array/);
    assert.throws(() => addon!.crc32c(new Uint8Array(4), 2 ** 32), /32-bit/);
  });

  test('checksum-and-copy gives the checksum of its source and leaves exactly it at the offset', () => {
    for (const [n, uncached] of [0, 1, 9, 63, 64, 24_575, 24_576, 24_577, 100_003].flatMap((n) => [[n, false], [n, true]] as const)) {
      const data = bytes(n, n + 1);
      const target = bytes(n + 64, 7);
      const before = target.slice();
      const crc = kvChecksumCopy(data, target, 17, 0x1234, uncached);
      assert.equal(crc, kvChecksum(data, 0x1234), `${n} bytes${uncached ? ', uncached' : ''}`);
      assert.deepEqual(target.subarray(17, 17 + n), data, `${n} bytes copied`);
      assert.deepEqual(target.subarray(0, 17), before.subarray(0, 17), `${n} bytes: nothing before the offset`);
      assert.deepEqual(target.subarray(17 + n), before.subarray(17 + n), `${n} bytes: nothing after`);
    }
  });

  test('the addon\'s checksum-and-copy refuses a source that does not fit, or overlaps', { skip: skipNative }, () => {
    const target = new Uint8Array(100);
    assert.throws(() => addon!.crc32cCopy!(new Uint8Array(10), target, 91), /does not fit/);
    assert.throws(() => addon!.crc32cCopy!(new Uint8Array(10), target, -1), /dstOffset/);
    assert.throws(() => addon!.crc32cCopy!(target.subarray(0, 10), target, 5), /overlap/);
    assert.equal(addon!.crc32cCopy!(new Uint8Array(10), target, 90), kvChecksum(new Uint8Array(10)));
  });

  test('a batch copies each range and gives each its checksum, continuing its crc, as one call per range would', () => {
    const source = bytes(100_000, 11);
    const target = bytes(120_000, 12);
    const expected = target.slice();
    const batch = new KvChecksumBatch(2); // grows past its first capacity
    const ranges: [number, number, number, number][] = [[0, 0, 4096, 0], [4096, 50_000, 24_577, 0x1234], [99_999, 119_999, 1, 0],
      [7, 30_000, 0, 0xdeadbeef], [33, 70_000, 3073, 5]];
    for (const [from, to, length, crc] of ranges) {
      expected.set(source.subarray(from, from + length), to);
      assert.equal(batch.add(from, to, length, crc), ranges.indexOf(ranges.find((r) => r[0] === from)!));
    }
    batch.run(source, target);
    ranges.forEach(([from, , length, crc], i) => assert.equal(batch.crc(i), kvChecksum(source.subarray(from, from + length), crc), `range ${i}`));
    assert.deepEqual(target, expected);
    batch.clear();
    assert.equal(batch.count, 0);
    batch.run(source, target); // nothing to do
    assert.deepEqual(target, expected);
  });

  test('the addon\'s batch refuses a range outside either array, a bad crc, overlap, or a count over the plan, before copying any', { skip: skipNative }, () => {
    const source = new Uint8Array(100);
    const target = new Uint8Array(100).fill(9);
    const plan = (...entries: number[][]) => new Float64Array(entries.flat());
    const call = (p: Float64Array, count = p.length / 4, src = source, dst = target) => addon!.crc32cCopyRuns!(src, dst, p, count);
    assert.throws(() => call(plan([0, 0, 10, 0], [95, 0, 10, 0])), /entry 1 does not fit/);
    assert.throws(() => call(plan([0, 0, 10, 0], [0, 91, 10, 0])), /entry 1 does not fit/);
    assert.throws(() => call(plan([-1, 0, 10, 0])), /does not fit/);
    assert.throws(() => call(plan([0.5, 0, 10, 0])), /does not fit/);
    assert.throws(() => call(plan([0, 0, 10, 2 ** 32])), /32-bit/);
    assert.throws(() => call(plan([0, 0, 10, 0]), 2), /count/);
    assert.throws(() => call(plan([0, 5, 10, 0]), 1, target, target), /overlap/);
    assert.ok(target.every((v) => v === 9), 'nothing copied before the refusal');
    assert.throws(() => addon!.crc32cCopyRuns!(source, target, new Float32Array(4) as unknown as Float64Array, 1), /Float64Array/);
  });
});
