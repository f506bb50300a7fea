// One contract suite for every KV index implementation: overlap depths, events, gaps and resync, worker removal,
// dumps. Hashes come from the engine's block-hash function; the last tests feed the index a real KV cache's events.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import type { BlockHash, KvEvent } from '../../src/protocols/kv-events.ts';
import { BitsetKvIndex, HashSetKvIndex } from '../../src/router/kv-index.ts';
import type { KvIndex, KvIndexDump } from '../../src/router/kv-index.ts';
import { CacheOfWorker, cleared, hashes, removed, stored, tokens } from './fixtures.ts';

const IMPLEMENTATIONS: { name: string; make: (options?: { maxBufferedEvents?: number }) => KvIndex }[] = [
  { name: 'HashSetKvIndex', make: (options) => new HashSetKvIndex(options) },
  { name: 'BitsetKvIndex', make: (options) => new BitsetKvIndex(options) },
];

const sorted = (values: Iterable<string>): string[] => [...values].sort();

function normalized(dump: KvIndexDump): KvIndexDump {
  return {
    workers: dump.workers.map((worker) => ({ ...worker, blockHashes: sorted(worker.blockHashes) as BlockHash[] }))
      .sort((a, b) => a.workerId.localeCompare(b.workerId)),
  };
}

/** Overlap computed the slow, obvious way from per-worker sets: the oracle for the randomized tests. */
function expectedMatches(holdings: Map<string, Set<BlockHash>>, query: readonly BlockHash[]): Map<string, number> {
  const out = new Map<string, number>();
  for (const [workerId, held] of holdings) {
    let depth = 0;
    while (depth < query.length && held.has(query[depth]!)) depth++;
    if (depth > 0) out.set(workerId, depth);
  }
  return out;
}

const asSortedEntries = (matches: ReadonlyMap<string, number>) => [...matches].sort((a, b) => a[0].localeCompare(b[0]));

for (const { name, make } of IMPLEMENTATIONS) {
  describe(`KV index contract: ${name}`, () => {
    const prompt = tokens(1, 40); // 10 blocks
    const chain = hashes(prompt);

    it('finds nothing in an empty index or for an empty query', () => {
      const index = make();
      assert.equal(index.findMatches(chain).size, 0);
      index.applyEvent('a', stored(1, chain));
      assert.equal(index.findMatches([]).size, 0);
    });

    it('reports the longest run of leading blocks each worker holds', () => {
      const index = make();
      index.applyEvent('a', stored(1, chain));
      index.applyEvent('b', stored(1, chain.slice(0, 3)));
      // c holds blocks 0, 1 and 3: the chain breaks at 2, so block 3 is of no use to this prompt.
      index.applyEvent('c', stored(1, chain.slice(0, 2)));
      index.applyEvent('c', stored(2, [chain[3]!], chain[2]!));
      // d holds a later block only.
      index.applyEvent('d', stored(1, chain.slice(5, 7), chain[4]!));
      assert.deepEqual(asSortedEntries(index.findMatches(chain)), [['a', 10], ['b', 3], ['c', 2]]);
      assert.deepEqual(asSortedEntries(index.findMatches(chain.slice(0, 2))), [['a', 2], ['b', 2], ['c', 2]]);
      // A prompt sharing 5 blocks and then diverging.
      const diverging = hashes([...prompt.slice(0, 20), ...tokens(2, 12)]);
      assert.deepEqual(asSortedEntries(index.findMatches(diverging)), [['a', 5], ['b', 3], ['c', 2]]);
    });

    it('follows every branch of a shared prefix, whichever was stored last, and survives slot reuse', () => {
      const index = make();
      const system = tokens(3, 16);
      const [a, b, c] = [4, 5, 6].map((seed) => [...system, ...tokens(seed, 16)]);
      const [hashesA, hashesB, hashesC] = [a!, b!, c!].map((prompt) => hashes(prompt));
      index.applyEvent('x', stored(1, hashesA!));
      index.applyEvent('y', stored(1, hashesB!.slice(4), hashesB![3]!)); // y holds only B's tail
      index.applyEvent('x', stored(2, hashesB!.slice(4), hashesB![3]!));
      assert.deepEqual(asSortedEntries(index.findMatches(hashesA!)), [['x', 8]]);
      assert.deepEqual(asSortedEntries(index.findMatches(hashesB!)), [['x', 8]]);
      // A's tail leaves; C's tail may take its freed places.
      index.applyEvent('x', removed(3, hashesA!.slice(4)));
      index.applyEvent('x', stored(4, hashesC!.slice(4), hashesC![3]!));
      assert.deepEqual(asSortedEntries(index.findMatches(hashesA!)), [['x', 4]]);
      assert.deepEqual(asSortedEntries(index.findMatches(hashesC!)), [['x', 8]]);
      index.applyEvent('x', stored(5, hashesA!.slice(4), hashesA![3]!));
      assert.deepEqual(asSortedEntries(index.findMatches(hashesA!)), [['x', 8]]);
      assert.deepEqual(asSortedEntries(index.findMatches(hashesC!)), [['x', 8]]);
    });

    it('answers with a map that reads consistently, and keeps naming its workers after the index changes', () => {
      const index = make();
      index.applyEvent('a', stored(1, chain.slice(0, 7)));
      index.applyEvent('b', stored(1, chain.slice(0, 2)));
      const matches = index.findMatches(chain);
      assert.equal(matches.size, 2);
      assert.deepEqual([matches.get('a'), matches.get('b'), matches.get('c')], [7, 2, undefined]);
      assert.deepEqual([matches.has('a'), matches.has('c')], [true, false]);
      assert.deepEqual(new Map(matches), new Map([['a', 7], ['b', 2]]));
      assert.deepEqual(sorted(matches.keys()), ['a', 'b']);
      assert.deepEqual([...matches.values()].sort(), [2, 7]);
      const seen: string[] = [];
      matches.forEach((depth, workerId) => seen.push(`${workerId}=${depth}`));
      assert.deepEqual(seen.sort(), ['a=7', 'b=2']);
      // b leaves and a newcomer takes its place in the index: the earlier answer is unchanged.
      index.removeWorker('b');
      index.applyEvent('c', stored(1, chain.slice(0, 9)));
      assert.deepEqual(asSortedEntries(matches), [['a', 7], ['b', 2]]);
      assert.deepEqual([matches.get('b'), matches.get('c')], [2, undefined]);
      assert.deepEqual(asSortedEntries(index.findMatches(chain)), [['a', 7], ['c', 9]]);
    });

    it('never matches the same tokens under another cache salt', () => {
      const index = make();
      index.applyEvent('a', stored(1, hashes(prompt, 'tenant-a')));
      assert.equal(index.findMatches(hashes(prompt, 'tenant-b')).size, 0);
      assert.equal(index.findMatches(chain).size, 0);
      assert.equal(index.findMatches(hashes(prompt, 'tenant-a')).get('a'), 10);
    });

    it('applies removals and clears, and counts blocks and entries', () => {
      const index = make();
      index.applyEvent('a', stored(1, chain));
      index.applyEvent('b', stored(1, chain.slice(0, 4)));
      index.applyEvent('a', stored(2, chain.slice(0, 4))); // already held: no double count
      assert.equal(index.numBlocks, 10);
      assert.equal(index.numEntries, 14);
      index.applyEvent('a', removed(3, [chain[6]!, chain[9]!]));
      assert.equal(index.findMatches(chain).get('a'), 6);
      assert.equal(index.numBlocks, 8);
      assert.ok(!index.holds('a', chain[6]!) && index.holds('a', chain[7]!));
      index.applyEvent('a', removed(4, [tokensHashNotHeld()])); // unknown hash: ignored
      index.applyEvent('a', cleared(5));
      assert.deepEqual(asSortedEntries(index.findMatches(chain)), [['b', 4]]);
      assert.equal(index.numBlocks, 4);
      assert.equal(index.numEntries, 4);
      assert.deepEqual(index.workerBlockHashes('a'), []);
    });

    it('flags a gap in event ids, keeps applying, and ignores redelivered ids', () => {
      const index = make();
      assert.deepEqual(index.applyEvent('a', stored(1, chain.slice(0, 2))), { status: 'applied', needsResync: false });
      assert.deepEqual(index.applyEvent('a', stored(2, chain.slice(2, 4), chain[1]!)), { status: 'applied', needsResync: false });
      // A redelivered event 2 carrying something else must not be applied.
      assert.deepEqual(index.applyEvent('a', removed(2, [chain[0]!])), { status: 'duplicate', needsResync: false });
      assert.equal(index.findMatches(chain).get('a'), 4);
      assert.deepEqual(index.workersNeedingResync(), []);
      assert.deepEqual(index.applyEvent('a', stored(5, chain.slice(4, 6), chain[3]!)),
        { status: 'gap', needsResync: true, expectedEventId: 3, receivedEventId: 5 });
      assert.equal(index.findMatches(chain).get('a'), 6, 'the event after the gap is applied');
      assert.deepEqual(index.workersNeedingResync(), ['a']);
      assert.deepEqual(index.applyEvent('a', stored(6, chain.slice(6, 7), chain[5]!)), { status: 'applied', needsResync: true });
    });

    it('treats a first event id above 1 as missed events', () => {
      const index = make();
      const result = index.applyEvent('late', stored(41, chain.slice(0, 1)));
      assert.equal(result.status, 'gap');
      assert.deepEqual(index.workersNeedingResync(), ['late']);
    });

    it('resyncs from a dump and replays the events newer than it', () => {
      const index = make();
      index.applyEvent('a', stored(1, chain.slice(0, 2)));
      index.applyEvent('a', stored(4, chain.slice(5, 6), chain[4]!)); // events 2 and 3 lost: the worker stored 2..4
      index.applyEvent('a', removed(5, [chain[0]!]));
      index.applyEvent('a', stored(6, [chain[0]!]));
      index.applyEvent('a', stored(7, chain.slice(6, 8), chain[5]!));
      // The dump reflects events up to 5: blocks 1..5 (block 0 was removed by event 5).
      index.resync('a', chain.slice(1, 6), 5);
      assert.deepEqual(index.workersNeedingResync(), []);
      assert.equal(index.findMatches(chain).get('a'), 8, 'events 6 and 7 replayed on top of the dump');
      assert.deepEqual(sorted(index.workerBlockHashes('a')), sorted(chain.slice(0, 8)));
      // Ids continue after the replayed ones.
      assert.equal(index.applyEvent('a', removed(8, [chain[7]!])).status, 'applied');
      assert.equal(index.applyEvent('a', stored(7, [chain[9]!])).status, 'duplicate');
    });

    it('events that arrive while a dump is on its way (no gap) are replayed on it, not wiped with the old blocks', () => {
      const index = make();
      index.applyEvent('a', stored(1, chain.slice(0, 1)));
      // The frontend asks for a dump (a worker joined, the event plane reconnected); it reflects event 1.
      index.beginResync('a');
      // Events 2 and 3 arrive before the dump is applied (the same read as the reply, or on the event plane).
      assert.equal(index.applyEvent('a', stored(2, chain.slice(1, 2), chain[0]!)).status, 'applied');
      assert.equal(index.applyEvent('a', stored(3, chain.slice(2, 3), chain[1]!)).status, 'applied');
      assert.deepEqual(index.workersNeedingResync(), [], 'a dump on its way is not a gap');
      index.resync('a', chain.slice(0, 1), 1);
      assert.equal(index.findMatches(chain).get('a'), 3, 'events 2 and 3 replayed on the dump');
      assert.deepEqual(index.workersNeedingResync(), []);
      assert.equal(index.applyEvent('a', stored(4, chain.slice(3, 4), chain[2]!)).status, 'applied', 'ids go on after the replay');
      // A dump that does not come: the events since stay applied, nothing more is kept.
      index.beginResync('a');
      index.applyEvent('a', stored(5, chain.slice(4, 5), chain[3]!));
      index.endResync('a');
      assert.equal(index.findMatches(chain).get('a'), 5);
      assert.equal(index.applyEvent('a', stored(6, chain.slice(5, 6), chain[4]!)).status, 'applied');
    });

    it('a resync with the worker\'s tiers replaces its RAM and disk blocks too; one without them leaves those alone', () => {
      const index = make();
      const inTier = (eventId: number, blockHashes: BlockHash[], tier: 'ram' | 'disk'): KvEvent => ({ ...stored(eventId, blockHashes), tier }) as KvEvent;
      index.applyEvent('a', stored(1, chain.slice(0, 2)));
      index.applyEvent('a', inTier(2, chain.slice(0, 6), 'ram'));
      index.applyEvent('a', inTier(3, chain.slice(0, 6), 'disk'));
      assert.deepEqual(index.lowerTierRun('a', chain, 2), { blocks: 4, disk: 0 });
      // Events 4..9 lost: the worker pushed blocks 2..5 out of its RAM tier and dropped blocks 4 and 5 from its disk
      // tier; its disk tier took in blocks 6..8 (read back from an earlier run).
      index.applyEvent('a', stored(10, chain.slice(2, 3), chain[1]!));
      index.beginResync('a');
      index.applyEvent('a', inTier(11, chain.slice(9, 10), 'ram'));
      index.resync('a', chain.slice(0, 3), 10, { disk: [...chain.slice(0, 4), ...chain.slice(6, 9)] });
      assert.deepEqual(index.lowerTierRun('a', chain, 3), { blocks: 1, disk: 1 }, 'block 3 on disk only, block 4 nowhere below');
      assert.deepEqual(index.lowerTierRun('a', chain, 6), { blocks: 4, disk: 3 }, 'blocks 6..8 from the dump, block 9 from the replayed event 11');
      // A worker of an earlier release sends its primary blocks alone: what the tiers' events left stays.
      index.resync('a', chain.slice(0, 3), 11);
      assert.deepEqual(index.lowerTierRun('a', chain, 6), { blocks: 4, disk: 3 });
    });

    it('stays in need of resync when the replay meets a hole', () => {
      const index = make({ maxBufferedEvents: 2 });
      index.applyEvent('a', stored(1, chain.slice(0, 1)));
      index.applyEvent('a', stored(3, chain.slice(2, 3), chain[1]!));
      index.applyEvent('a', stored(4, chain.slice(3, 4), chain[2]!));
      index.applyEvent('a', stored(5, chain.slice(4, 5), chain[3]!)); // the buffer keeps 4 and 5 only
      index.resync('a', chain.slice(0, 2), 2);
      assert.deepEqual(index.workersNeedingResync(), ['a'], 'event 3 is missing from the replay');
    });

    it('accepts any next id after a resync without an event id', () => {
      const index = make();
      index.applyEvent('a', stored(3, chain.slice(0, 1)));
      index.resync('a', chain.slice(0, 3));
      assert.equal(index.findMatches(chain).get('a'), 3);
      assert.deepEqual(index.applyEvent('a', stored(17, chain.slice(3, 4), chain[2]!)), { status: 'applied', needsResync: false });
      assert.equal(index.applyEvent('a', stored(19, chain.slice(4, 5), chain[3]!)).status, 'gap');
    });

    it('forgets a removed worker entirely, and a returning one starts its ids afresh', () => {
      const index = make();
      index.applyEvent('a', stored(1, chain));
      index.applyEvent('b', stored(1, chain.slice(0, 5)));
      index.applyEvent('b', stored(3, chain.slice(5, 6), chain[4]!)); // b needs resync
      index.removeWorker('b');
      assert.deepEqual(asSortedEntries(index.findMatches(chain)), [['a', 10]]);
      assert.deepEqual(index.workers(), ['a']);
      assert.deepEqual(index.workersNeedingResync(), []);
      assert.equal(index.numEntries, 10);
      index.removeWorker('a');
      assert.equal(index.numBlocks, 0);
      assert.equal(index.applyEvent('b', stored(1, chain.slice(0, 2))).status, 'applied');
      assert.equal(index.findMatches(chain).get('b'), 2);
    });

    it('handles more workers than one bitset word, and reuses a departed worker\'s place', () => {
      const index = make();
      const numWorkers = 70;
      for (let w = 0; w < numWorkers; w++) index.applyEvent(`w${w}`, stored(1, chain.slice(0, 1 + (w % 10))));
      const matches = index.findMatches(chain);
      assert.equal(matches.size, numWorkers);
      for (let w = 0; w < numWorkers; w++) assert.equal(matches.get(`w${w}`), 1 + (w % 10));
      index.removeWorker('w33');
      index.applyEvent('newcomer', stored(1, chain.slice(0, 4)));
      const after = index.findMatches(chain);
      assert.equal(after.has('w33'), false);
      assert.equal(after.get('newcomer'), 4);
      assert.equal(after.get('w34'), 5);
      assert.equal(after.size, numWorkers);
    });

    it('round-trips a dump: load and replay both reproduce the answers, across implementations too', () => {
      const index = make();
      const { holdings } = randomHistory(index, 11);
      const dump = index.dump();
      for (const other of IMPLEMENTATIONS) {
        const loaded = other.make();
        loaded.load(dump);
        assert.deepEqual(normalized(loaded.dump()), normalized(dump), `load into ${other.name}`);
        // Replay: the dump as one stored event per worker into a fresh index.
        const replayed = other.make();
        for (const worker of dump.workers) {
          if (worker.blockHashes.length > 0) replayed.applyEvent(worker.workerId, stored(1, worker.blockHashes));
        }
        for (let seed = 0; seed < 30; seed++) {
          const query = queryFor(seed);
          const expected = asSortedEntries(expectedMatches(holdings, query));
          assert.deepEqual(asSortedEntries(loaded.findMatches(query)), expected, `${other.name} loaded, query ${seed}`);
          assert.deepEqual(asSortedEntries(replayed.findMatches(query)), expected, `${other.name} replayed, query ${seed}`);
        }
      }
    });

    it('agrees with per-worker sets over a long random event history', () => {
      const index = make();
      const { holdings } = randomHistory(index, 5);
      let numMatched = 0;
      for (let seed = 0; seed < 200; seed++) {
        const query = queryFor(seed);
        const expected = expectedMatches(holdings, query);
        numMatched += expected.size;
        assert.deepEqual(asSortedEntries(index.findMatches(query)), asSortedEntries(expected), `query ${seed}`);
      }
      assert.ok(numMatched > 50, 'the history should leave many partial matches to compare');
      let numEntries = 0;
      for (const held of holdings.values()) numEntries += held.size;
      assert.equal(index.numEntries, numEntries);
      assert.equal(index.numBlocks, new Set([...holdings.values()].flatMap((held) => [...held])).size);
    });

    it('stays exact while it grows to thousands of blocks and churns through removals', () => {
      const index = make();
      const long = hashes(tokens(77, 4 * 6000)); // one chain of 6000 blocks
      const holdings = new Map<string, Set<BlockHash>>([['a', new Set()], ['b', new Set()]]);
      let eventId = 0;
      for (let start = 0; start < long.length; start += 500) {
        const batch = long.slice(start, start + 500);
        index.applyEvent('a', stored(++eventId, batch, start === 0 ? null : long[start - 1]!));
        for (const hash of batch) holdings.get('a')!.add(hash);
        // Evict most of what came before, so freed slots and table tombstones pile up and get reused.
        const victims = long.slice(Math.max(0, start - 500), start).filter((_, i) => i % 5 !== 0);
        index.applyEvent('a', removed(++eventId, victims));
        for (const hash of victims) holdings.get('a')!.delete(hash);
      }
      index.applyEvent('b', stored(1, long.slice(0, 3000)));
      for (const hash of long.slice(0, 3000)) holdings.get('b')!.add(hash);
      assert.equal(index.numEntries, holdings.get('a')!.size + 3000);
      for (const start of [0, 1, 499, 2600, 5499, 5500, 5999]) {
        const query = long.slice(start);
        assert.deepEqual(asSortedEntries(index.findMatches(query)), asSortedEntries(expectedMatches(holdings, query)), `from ${start}`);
      }
      assert.deepEqual(sorted(index.workerBlockHashes('a')), sorted(holdings.get('a')!));
    });

    it('mirrors a real KV cache fed through its events, evictions included', () => {
      const index = make();
      const worker = new CacheOfWorker(24);
      const system = tokens(100, 16);
      const prompts = Array.from({ length: 12 }, (_, i) => [...system, ...tokens(200 + i, 5 + 3 * i)]);
      for (const [i, prompt] of prompts.entries()) {
        worker.compute(prompt, { keepRunning: i % 4 === 0 });
        for (const event of worker.takeEvents()) assert.notEqual(index.applyEvent('w', event).status, 'gap');
        if (i === 7) worker.releaseAll();
      }
      assert.ok(worker.kv.stats().evictions > 0, 'the pool is small enough to evict');
      assert.deepEqual(sorted(index.workerBlockHashes('w')), sorted(worker.kv.cachedBlockHashes()));
      for (const prompt of prompts) {
        assert.equal(index.findMatches(hashes(prompt)).get('w') ?? 0, worker.heldBlocks(prompt));
      }
      // Resync from the worker's own dump after losing events.
      worker.compute(tokens(300, 30));
      const lost = worker.takeEvents();
      worker.compute(tokens(301, 30));
      for (const event of worker.takeEvents()) index.applyEvent('w', event);
      assert.ok(lost.length > 0);
      assert.deepEqual(index.workersNeedingResync(), ['w']);
      index.resync('w', worker.kv.cachedBlockHashes());
      assert.deepEqual(sorted(index.workerBlockHashes('w')), sorted(worker.kv.cachedBlockHashes()));
      assert.equal(index.findMatches(hashes(tokens(300, 30))).get('w') ?? 0, worker.heldBlocks(tokens(300, 30)));
    });
  });
}

function tokensHashNotHeld(): BlockHash {
  return hashes(tokens(999, 4))[0]!;
}

// A family of prompts sharing prefixes at several depths, so random histories produce partial matches.
const TRUNKS = [tokens(10, 24), tokens(11, 24), tokens(12, 24)];
function queryFor(seed: number): BlockHash[] {
  const trunk = TRUNKS[seed % TRUNKS.length]!;
  const keep = 4 * (seed % 7);
  return hashes([...trunk.slice(0, keep), ...tokens(50 + (seed % 5), 16)]);
}

/** Random stored / removed / cleared events for 6 workers, applied to the index and to plain sets alike. */
function randomHistory(index: KvIndex, seed: number): { holdings: Map<string, Set<BlockHash>> } {
  let state = seed;
  const next = (n: number): number => {
    state = (Math.imul(state, 1103515245) + 12345) >>> 0;
    return (state >>> 8) % n;
  };
  const holdings = new Map<string, Set<BlockHash>>();
  const eventIds = new Map<string, number>();
  for (let step = 0; step < 600; step++) {
    const workerId = `w${next(6)}`;
    const held = holdings.get(workerId) ?? new Set<BlockHash>();
    holdings.set(workerId, held);
    const eventId = (eventIds.get(workerId) ?? 0) + 1;
    eventIds.set(workerId, eventId);
    const roll = next(100);
    let event: KvEvent;
    if (roll < 65) {
      const chain = queryFor(next(35));
      const start = next(chain.length);
      const end = start + 1 + next(chain.length - start);
      event = stored(eventId, chain.slice(start, end), start === 0 ? null : chain[start - 1]!);
      for (const hash of chain.slice(start, end)) held.add(hash);
    } else if (roll < 98) {
      const victims = [...held].filter(() => next(3) === 0);
      event = removed(eventId, victims);
      for (const hash of victims) held.delete(hash);
    } else {
      event = cleared(eventId);
      held.clear();
    }
    assert.equal(index.applyEvent(workerId, event).status, 'applied');
  }
  return { holdings };
}
