// The KV transfer's checksum, CRC-32C: the addon's (SSE4.2 instruction in three streams, and its table path) and the
// TypeScript fallback agree with each other and with the standard check value, at every length and split, so a
// worker with the addon and one without check each other's runs.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { crc32cPortable, kvChecksum, kvChecksumCopy } from '../../src/cluster/kv-checksum.ts';
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
    for (const n of [1, 7, 8, 9, 63, 4095, 24_575, 24_576, 24_577, 49_152 + 13, 200_003, 1 << 20]) {
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
});
