import { test } from 'node:test';
import assert from 'node:assert/strict';
import { samePlainData } from '../../src/util/plain-data.ts';

const stats = () => ({
  numRunning: 1, numWaiting: 0, kvBlocksUsed: 3, kvEvictions: 0,
  kvTiers: { tiers: { ram: { capacityBlocks: 8, usedBlocks: 2 } }, missedOffloads: 0 },
  memory: { weightsBytes: 100, kvCacheBytes: 50 },
  allocationFailures: { kvBlocks: 0, scratch: 0 },
});

test('equal nested stats compare equal, whatever their key order', () => {
  assert.equal(samePlainData(stats(), stats()), true);
  const { numRunning, ...rest } = stats();
  assert.equal(samePlainData(stats(), { ...rest, numRunning }), true);
  assert.equal(samePlainData([1, 'a', null, undefined, Number.NaN], [1, 'a', null, undefined, Number.NaN]), true);
});

test('any difference a receiver could see is a change', () => {
  const deep = stats();
  deep.kvTiers.tiers.ram.usedBlocks = 3;
  assert.equal(samePlainData(stats(), deep), false);
  assert.equal(samePlainData(stats(), { ...stats(), kvBlocksUsed: 4 }), false);
  const { memory: _memory, ...withoutMemory } = stats();
  assert.equal(samePlainData(stats(), withoutMemory), false);
  assert.equal(samePlainData(withoutMemory, stats()), false);
  assert.equal(samePlainData({ a: undefined }, {}), false);
  assert.equal(samePlainData({}, { a: undefined }), false);
  assert.equal(samePlainData(0, -0), false);
  assert.equal(samePlainData([1, 2], { 0: 1, 1: 2 }), false);
  assert.equal(samePlainData({ 0: 1, 1: 2 }, [1, 2]), false);
  assert.equal(samePlainData([1, 2], [1, 2, 3]), false);
  assert.equal(samePlainData(null, {}), false);
  assert.equal(samePlainData('1', 1), false);
});
