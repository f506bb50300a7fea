// Lower-tier KV events at the router: a block a worker holds only in its RAM or disk tier (events with a tier) is
// never taken for a primary hit, and counts at its tier's weight: primary beats RAM beats disk beats a cold worker,
// and a tier's removed or cleared event takes the block out again. Both index implementations.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { parseKvEvent, type BlockHash, type KvEvent, type KvLowerTier } from '../../src/protocols/kv-events.ts';
import { BitsetKvIndex, HashSetKvIndex } from '../../src/router/kv-index.ts';
import type { RouteOutcome, RoutingDecision } from '../../src/router/protocols.ts';
import { hashes, makeRouter, request, stored, tokens } from './fixtures.ts';

function routed(outcome: RouteOutcome): RoutingDecision {
  assert.equal(outcome.kind, 'routed');
  return (outcome as { decision: RoutingDecision }).decision;
}

const inTier = (eventId: number, blockHashes: BlockHash[], tier: KvLowerTier): KvEvent =>
  ({ ...stored(eventId, blockHashes), tier }) as KvEvent;

for (const [name, makeIndex] of [['hash-set', () => new HashSetKvIndex()], ['bitset', () => new BitsetKvIndex({ hashSeed: 7 })]] as const) {
  describe(`Router with lower-tier events (${name} index)`, () => {
    const prompt = tokens(3, 41); // 10 full blocks of 4

    it('primary beats RAM beats disk beats cold, at the same depth', () => {
      const router = makeRouter({ index: makeIndex() });
      const blocks = hashes(prompt).slice(0, 8);
      router.applyKvEvents('w1', [inTier(1, blocks, 'disk')]);
      router.applyKvEvents('w2', [inTier(1, blocks, 'ram')]);
      router.applyKvEvents('w3', [stored(1, blocks)]);
      const decision = routed(router.route(request(prompt), 0, { commit: false }));
      assert.equal(decision.workerId, 'w3');
      const terms = new Map(decision.costTerms.map((t) => [t.workerId, t]));
      assert.equal(terms.get('w1')!.overlapBlocks, 0, 'a disk block is not a primary hit');
      assert.equal(terms.get('w1')!.lowerTierBlocks, 8);
      assert.equal(terms.get('w2')!.lowerTierBlocks, 8);
      assert.deepEqual([terms.get('w1')!.lowerTierDiskBlocks, terms.get('w2')!.lowerTierDiskBlocks], [8, undefined],
        'which of them only on disk (the disaggregation policy prices their copy back by it)');
      assert.equal(terms.get('w3')!.overlapBlocks, 8);
      const costs = ['w3', 'w2', 'w1', 'w0'].map((w) => terms.get(w)!.cost);
      assert.deepEqual([...costs].sort((a, b) => a - b), costs, `costs in order primary < ram < disk < cold: ${costs}`);
      assert.equal(terms.get('w2')!.prefillTokens, 41 - 8 * 4 * 0.75);
      assert.equal(terms.get('w1')!.prefillTokens, 41 - 8 * 4 * 0.5);

      router.applyKvEvents('w3', [{ type: 'removed', eventId: 2, blockHashes: blocks }]);
      assert.equal(routed(router.route(request(prompt), 0, { commit: false })).workerId, 'w2', 'then the RAM tier wins');
      router.applyKvEvents('w2', [{ type: 'cleared', eventId: 2, tier: 'ram' }]);
      assert.equal(routed(router.route(request(prompt), 0, { commit: false })).workerId, 'w1', 'then the disk tier');
      router.applyKvEvents('w1', [{ type: 'removed', eventId: 2, blockHashes: blocks.slice(2), tier: 'disk' }]);
      const last = routed(router.route(request(prompt), 0, { commit: false }));
      assert.equal(new Map(last.costTerms.map((t) => [t.workerId, t])).get('w1')!.lowerTierBlocks, 2);
    });

    it('a lower tier continues a shorter primary run', () => {
      const router = makeRouter({ index: makeIndex() });
      const blocks = hashes(prompt);
      router.applyKvEvents('w1', [stored(1, blocks.slice(0, 3)), inTier(2, blocks, 'ram')]);
      const terms = routed(router.route(request(prompt), 0, { commit: false })).costTerms.find((t) => t.workerId === 'w1')!;
      assert.equal(terms.overlapBlocks, 3);
      assert.equal(terms.lowerTierBlocks, 7, 'the rest of the 10 full blocks');
    });
  });
}

describe('KV events with a tier', () => {
  it('round-trip through JSON; an event without one is about the primary pool', () => {
    const blocks = hashes(tokens(1, 8));
    const events: KvEvent[] = [
      inTier(1, blocks, 'ram'), { type: 'removed', eventId: 2, blockHashes: blocks, tier: 'disk' }, { type: 'cleared', eventId: 3, tier: 'ram' },
      stored(4, blocks),
    ];
    for (const event of events) assert.deepEqual(parseKvEvent(JSON.parse(JSON.stringify(event))), event);
    assert.equal(parseKvEvent({ ...stored(5, blocks), tier: 'primary' }).tier, undefined);
    assert.throws(() => parseKvEvent({ ...stored(5, blocks), tier: 'gpu' }), /tier must be one of ram, disk/);
  });
});
