import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import { seededRandom } from '../../src/util/random.ts';

describe('seededRandom', () => {
  it('uses the seed\'s bits above 32: seeds 2^32 apart give different streams', () => {
    for (const seed of [0, 1, 12345, 2 ** 40 + 7]) {
      const a = seededRandom(seed), b = seededRandom(seed + 2 ** 32);
      assert.notDeepEqual([a(), a(), a()], [b(), b(), b()]);
    }
  });

  it('keeps the streams of seeds below 2^32 as they were (mulberry32 from the seed itself)', () => {
    // mulberry32's first output for state 0, written out from its definition.
    let t = 0x6d2b79f5;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    assert.equal(seededRandom(0)(), ((t ^ (t >>> 14)) >>> 0) / 2 ** 32);
  });

  it('is reproducible for one seed', () => {
    const a = seededRandom(42), b = seededRandom(42);
    assert.deepEqual(Array.from({ length: 8 }, a), Array.from({ length: 8 }, b));
  });
});
