// The KV transfer's checksum, CRC-32C: each of the addon's paths this CPU runs (carry-less multiply folding, the
// SSE4.2 instruction in three streams, the tables) and the TypeScript fallback agree with each other and with the
// standard check value, at every length, alignment and split, so a worker with the addon and one without check each
// other's runs.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { crc32cPortable, KvChecksumBatch, kvChecksum, kvChecksumCopy } from '../../src/cluster/kv-checksum.ts';
import type { Crc32cPathName } from '../../src/kernels/native.ts';
import { addon, skipNative } from '../kernels/native-harness.ts';

/** Runs check once with each CRC-32C path this CPU runs switched on, then restores the path in use. */
function forEachPath(check: (path: Crc32cPathName) => void): void {
  const { path: original, supported } = addon!.crc32cPath!();
  try {
    for (const path of supported) {
      addon!.crc32cPath!(path);
      check(path);
    }
  } finally {
    addon!.crc32cPath!(original);
  }
}

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

  test('every path the CPU runs equals the TypeScript one at each length 0..1100 and start offset 0..63', { skip: skipNative }, () => {
    const source = bytes(1100 + 64, 21);
    const expected = new Map<string, number>();
    for (let offset = 0; offset < 64; offset++) {
      for (let n = 0; n <= 1100; n++) expected.set(`${offset} ${n}`, crc32cPortable(source.subarray(offset, offset + n), offset * 7919));
    }
    const paths: string[] = [];
    forEachPath((path) => {
      paths.push(path);
      for (let offset = 0; offset < 64; offset++) {
        for (let n = 0; n <= 1100; n++) {
          const got = addon!.crc32c(source.subarray(offset, offset + n), offset * 7919);
          if (got !== expected.get(`${offset} ${n}`)) assert.fail(`${path}: ${n} bytes at offset ${offset}`);
        }
      }
    });
    assert.deepEqual(paths, addon!.crc32cPath!().supported);
    assert.ok(paths.includes('table'));
    if (process.arch === 'x64') assert.ok(paths.includes('sse42'), 'x86-64 CPUs this runs on have SSE4.2');
  });

  test('every path equals the TypeScript one on 1 MiB and odd sizes, at any split of the input', { skip: skipNative }, () => {
    const large = bytes((1 << 20) + 4093, 31);
    const wholeLarge = crc32cPortable(large);
    const medium = bytes(5000, 32);
    const wholeMedium = crc32cPortable(medium, 0xdeadbeef);
    forEachPath((path) => {
      for (const offset of [0, 1, 31, 63]) {
        const data = large.subarray(offset);
        assert.equal(addon!.crc32c(data), crc32cPortable(data), `${path}: 1 MiB + ${4093 - offset}`);
      }
      assert.equal(addon!.crc32c(large), wholeLarge);
      for (const at of [1, 255, 256, 65_537, 1 << 19, large.length - 300, large.length - 1]) {
        assert.equal(addon!.crc32c(large.subarray(at), addon!.crc32c(large.subarray(0, at))), wholeLarge, `${path}: split at ${at}`);
      }
      for (let at = 0; at <= medium.length; at += 7) {
        const first = addon!.crc32c(medium.subarray(0, at), 0xdeadbeef);
        assert.equal(addon!.crc32c(medium.subarray(at), first), wholeMedium, `${path}: split at ${at}`);
      }
    });
  });

  test('every path\'s checksum-and-copy, cached and uncached, at any length, alignment and destination offset', { skip: skipNative }, () => {
    const source = bytes(70_000, 41);
    const lengths = [0, 1, 63, 64, 255, 256, 257, 319, 320, 383, 1000, 1100, 4096, 24_577, 65_536 + 77];
    forEachPath((path) => {
      for (const n of lengths) {
        for (const [from, to] of [[0, 0], [1, 0], [0, 1], [13, 50], [63, 7], [64, 64]] as const) {
          for (const uncached of [false, true]) {
            const what = `${path}: ${n} bytes from ${from} to ${to}${uncached ? ', uncached' : ''}`;
            const data = source.subarray(from, from + n);
            const target = bytes(n + 200, n + to);
            const before = target.slice();
            assert.equal(addon!.crc32cCopy!(data, target, to, 0x5a5a, uncached), crc32cPortable(data, 0x5a5a), what);
            assert.deepEqual(target.subarray(to, to + n), data, `${what}: copied`);
            assert.deepEqual(target.subarray(0, to), before.subarray(0, to), `${what}: nothing before`);
            assert.deepEqual(target.subarray(to + n), before.subarray(to + n), `${what}: nothing after`);
          }
        }
      }
      const target = bytes(80_000, 42);
      const expected = target.slice();
      const ranges = [[0, 3, 4096, 0], [5000, 10_001, 24_577, 0x1234], [69_999, 79_999, 1, 7], [100, 40_000, 0, 9], [33, 45_000, 1100, 5],
        [40_000, 50_000, 20_000, 0xffffffff]];
      const plan = new Float64Array(ranges.flat());
      for (const [from, to, length] of ranges) expected.set(source.subarray(from!, from! + length!), to);
      for (const uncached of [false, true]) {
        plan.forEach((_, i) => { if (i % 4 === 3) plan[i] = ranges[i >> 2]![3]!; });
        addon!.crc32cCopyRuns!(source, target, plan, ranges.length, uncached);
        ranges.forEach(([from, , length, crc], i) => {
          assert.equal(plan[4 * i + 3], crc32cPortable(source.subarray(from!, from! + length!), crc), `${path}: run ${i}`);
        });
        assert.deepEqual(target, expected, `${path}: runs copied${uncached ? ', uncached' : ''}`);
      }
    });
  });

  test('the path can be chosen by CONDUIT_CRC32C or crc32cPath, and only among those the CPU runs', { skip: skipNative }, () => {
    const { path: original, supported } = addon!.crc32cPath!();
    assert.throws(() => addon!.crc32cPath!('crc32' as Crc32cPathName), /not a CRC-32C path/);
    assert.equal(addon!.crc32cPath!().path, original, 'a refused path changes nothing');
    const harness = fileURLToPath(new URL('../kernels/native-harness.ts', import.meta.url));
    const script = `import('${harness}').then(({ addon }) => console.log(JSON.stringify(addon.crc32cPath())))`;
    const inChild = (value: string) => {
      const child = spawnSync(process.execPath, ['--import', 'tsx', '-e', script], {
        encoding: 'utf8', env: { ...process.env, CONDUIT_CRC32C: value },
      });
      assert.equal(child.status, 0, child.stderr);
      return { ...JSON.parse(child.stdout) as { path: string }, stderr: child.stderr };
    };
    const forced = supported[0] === original ? supported[supported.length - 1]! : supported[0]!;
    assert.equal(inChild(forced).path, forced);
    const unknown = inChild('crc32');
    assert.equal(unknown.path, original);
    assert.match(unknown.stderr, /CONDUIT_CRC32C=crc32 is not a CRC-32C path/);
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
    // A plan in the destination's own memory: the first run's copy rewrites the second's length (to 1e9) after the
    // checks. The runs are those checked (the second copies its 8 bytes), nothing beyond the buffers.
    const shared = new Float64Array(16);
    const bytes = new Uint8Array(shared.buffer);
    const src = new Uint8Array(64).map((_, i) => i);
    new Float64Array(src.buffer, 0, 1)[0] = 1e9;
    shared.set([0, 48, 8, 0, 8, 64, 8, 0]);
    addon!.crc32cCopyRuns!(src, bytes, shared, 2);
    assert.equal(shared[6], 1e9, 'the second entry\'s length was overwritten by the first copy');
    assert.deepEqual([...bytes.subarray(64, 80)], [...src.subarray(8, 16), 0, 0, 0, 0, 0, 0, 0, 0], 'the second run copied its checked 8 bytes');
  });
});
