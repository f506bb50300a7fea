// Speculative prefixes on their own: deadlines (with and without pruning), refreshes, confirmation and removal.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { SpeculativePrefixes } from '../../src/router/speculative.ts';
import { hashes, tokens } from './fixtures.ts';

describe('SpeculativePrefixes', () => {
  const chain = hashes(tokens(1, 24)); // 6 blocks

  it('holds a guess until its deadline, pruned or not', () => {
    const guesses = new SpeculativePrefixes(100);
    guesses.insert('a', chain, 0);
    guesses.insert('b', chain.slice(0, 2), 50);
    assert.deepEqual([...guesses.findMatches(chain, 99)].sort(), [['a', 6], ['b', 2]]);
    // Past a's deadline but before pruning: a no longer counts, block by block and as a whole.
    assert.deepEqual([...guesses.findMatches(chain, 100)], [['b', 2]]);
    assert.equal(guesses.holds('a', chain[0]!, 100), false);
    assert.equal(guesses.holds('b', chain[1]!, 100), true);
    assert.equal(guesses.size, 8);
    guesses.prune(100);
    assert.equal(guesses.size, 2);
    guesses.prune(150);
    assert.equal(guesses.size, 0);
    assert.equal(guesses.findMatches(chain, 150).size, 0);
  });

  it('extends a guess made again, and stops a walk at a guess that expired in the middle', () => {
    const guesses = new SpeculativePrefixes(100);
    guesses.insert('a', chain, 0);
    guesses.insert('a', chain.slice(0, 3), 80); // the first 3 blocks refreshed to 180
    assert.deepEqual([...guesses.findMatches(chain, 120)], [['a', 3]], 'unpruned, blocks 3.. have expired');
    guesses.prune(120);
    assert.equal(guesses.size, 3, 'the stale deadline of the refreshed blocks is skipped, the rest expire');
    assert.deepEqual([...guesses.findMatches(chain, 120)], [['a', 3]]);
    guesses.insert('a', chain.slice(3), 150); // blocks 3.. until 250, blocks 0..2 until 180
    assert.deepEqual([...guesses.findMatches(chain, 179)], [['a', 6]]);
    assert.equal(guesses.findMatches(chain, 180).size, 0, 'block 0 expired: nothing leads to the rest');
  });

  it('drops guesses the worker confirmed or denied, and all of a worker\'s on removal', () => {
    const guesses = new SpeculativePrefixes(1000);
    guesses.insert('a', chain, 0);
    guesses.insert('b', chain, 0);
    guesses.drop('a', chain.slice(2, 3));
    assert.deepEqual([...guesses.findMatches(chain, 1)].sort(), [['a', 2], ['b', 6]]);
    guesses.removeWorker('b');
    assert.deepEqual([...guesses.findMatches(chain, 1)], [['a', 2]]);
    assert.equal(guesses.size, 5);
  });

  it('makes no guesses with a ttl of 0', () => {
    const guesses = new SpeculativePrefixes(0);
    guesses.insert('a', chain, 0);
    assert.equal(guesses.size, 0);
    assert.throws(() => new SpeculativePrefixes(-1), RangeError);
  });

  it('keeps its expiry queue bounded under steady use', () => {
    const guesses = new SpeculativePrefixes(10);
    for (let nowMs = 0; nowMs < 5000; nowMs++) {
      guesses.insert('a', chain.slice(0, 1), nowMs);
      guesses.prune(nowMs);
    }
    assert.equal(guesses.size, 1);
    // 5000 deadlines went through it; compaction keeps the array near the 1024 consumed entries that trigger it.
    assert.ok(guesses.expiryQueueLength <= 2100, `${guesses.expiryQueueLength} entries held`);
  });
});
