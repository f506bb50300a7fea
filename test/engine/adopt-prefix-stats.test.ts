// A handed-off prompt's prefix-cache statistics: the decode worker's scheduler looks up its own cached blocks when it
// adopts the request, to move fewer, but that lookup is not a query for a prefill (the prefill worker's was), so it
// adds neither queried nor hit tokens; a prompt it computes itself (no KV imported) is looked up as any other.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import { FILLER, makeRequest, makeScheduler, prompt, step } from './scheduler-fixtures.ts';

const lookups = (s: ReturnType<typeof makeScheduler>) => {
  const { prefixQueryTokens, prefixHitTokens } = s.kv.stats();
  return { queried: prefixQueryTokens, hit: prefixHitTokens };
};

test('adopting with imported KV reuses the cached blocks without counting a query or hits (copied and in-place imports)', () => {
  for (const inPlace of [false, true]) {
    const s = makeScheduler({ numBlocks: 16, blockSize: 4 });
    // An earlier request leaves the prompt's first two blocks cached here: 10 tokens looked up, none found.
    const shared = prompt(0, 13);
    s.addRequest(makeRequest('earlier', [...shared.slice(0, 8), 99, 98], { sampling: { maxTokens: 1 } }), 0);
    step(s);
    assert.deepEqual(lookups(s), { queried: 10, hit: 0 });

    const fills: [number, number][] = [];
    const reserved = inPlace ? s.kv.reserveBlocks(2)! : undefined;
    const request = s.adoptRequest(makeRequest('r', shared), 5, { outputTokenIds: [FILLER], numCachedTokens: 4 }, {
      numTokens: 13, fill: (_table, from, to) => fills.push([from, to]),
      ...(reserved ? { filled: reserved.blocks } : {}),
    });
    assert.ok(request);
    if (reserved) s.kv.unpin(reserved);
    assert.deepEqual(fills, [[2, 4]], 'the two cached blocks were reused');
    assert.equal(request.numCachedTokens, 4, 'usage keeps the prefill worker\'s hit');
    assert.deepEqual(lookups(s), { queried: 10, hit: 0 }, `${inPlace ? 'in-place' : 'copied'} import: no lookup counted`);
    s.checkInvariants();
  }
});

test('adopting without KV (the prompt recomputed here) counts the lookup of that prefill', () => {
  const s = makeScheduler({ numBlocks: 16, blockSize: 4 });
  const shared = prompt(0, 13);
  s.addRequest(makeRequest('earlier', [...shared.slice(0, 8), 99, 98], { sampling: { maxTokens: 1 } }), 0);
  step(s);
  s.adoptRequest(makeRequest('r', shared), 5, { outputTokenIds: [FILLER], numCachedTokens: 0 });
  step(s, 6);
  // The prompt and the first token, 14 tokens, looked up; the two cached blocks found.
  assert.deepEqual(lookups(s), { queried: 10 + 14, hit: 8 });
  s.checkInvariants();
});
