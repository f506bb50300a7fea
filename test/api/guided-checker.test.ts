// The gateway's grammar check (GuidedChecker) when its XGrammar instance fails without XGrammar's own diagnosis of
// the input: the verdicts that instance gave are forgotten, the grammar is checked again on a fresh instance, and
// a failure there is a 400 that is not remembered. The failures are real: deeply nested regex groups overflow
// XGrammar's stack, either at once (500 levels) or silently, spoiling the instance for the next check (250 levels).
// The gateway refuses such nesting before this check (guided-limits.test.ts); the checker must survive it anyway.

import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { InvalidValueError } from '../../src/api/errors.ts';
import { GuidedChecker, type GuidedRequest } from '../../src/api/guided.ts';
import { XGrammar } from '../../src/engine/grammar/xgrammar.ts';

const regex = (pattern: string): GuidedRequest => ({ spec: { kind: 'regex', pattern }, param: 'guided_regex' });
const nested = (levels: number): GuidedRequest => regex(`${'('.repeat(levels)}a${')'.repeat(levels)}`);

/** Instances the check started. */
async function instancesFor(check: () => Promise<unknown>): Promise<number> {
  const before = XGrammar.stats().instances;
  await check();
  return XGrammar.stats().instances - before;
}

describe("the gateway's grammar check when its XGrammar instance fails", () => {
  it('a failure without a diagnosis is a 400, checked again on a fresh instance and not remembered; the instance\'s verdicts go with it', async () => {
    const checker = new GuidedChecker();
    const good = regex('[0-9]+');
    assert.equal(await instancesFor(() => checker.check(good)), 1);
    assert.equal(await instancesFor(() => checker.check(good)), 0, 'remembered');
    // The instance that passed `good` traps on this one: a fresh instance checks it again, and traps too.
    const crashing = nested(500);
    assert.equal(await instancesFor(() => assert.rejects(checker.check(crashing), (error: unknown) =>
      error instanceof InvalidValueError && error.param === 'guided_regex' && /grammar engine failed/.test(error.message))), 1);
    // Not remembered: the next check of it compiles again. Nor is `good`, which came from the instance that failed.
    assert.equal(checker.remembered(crashing), false);
    assert.equal(checker.remembered(good), false);
    assert.equal(await instancesFor(() => assert.rejects(checker.check(crashing), InvalidValueError)), 1);
    assert.equal(await instancesFor(() => checker.check(good)), 1);
    assert.equal(checker.remembered(good), true);
    assert.equal(await instancesFor(() => checker.check(good)), 0);
    // A bad grammar XGrammar diagnoses is remembered as before.
    const bad = regex('[0-9');
    await assert.rejects(checker.check(bad), /Unclosed/);
    assert.equal(await instancesFor(() => assert.rejects(checker.check(bad), /Unclosed/)), 0);
  });

  it('a check that passes but spoils the instance: the next grammar, failing on it, is checked on a fresh one and passes', async () => {
    const checker = new GuidedChecker();
    const spoiling = nested(250);
    await checker.check(spoiling);
    // Its instance now fails the next grammar with an uncaught C++ exception, not a verdict on that grammar.
    const next = regex('ab');
    assert.equal(await instancesFor(() => checker.check(next)), 1, 'checked again on a fresh instance');
    assert.equal(checker.remembered(next), true, 'and that verdict is remembered');
    // The spoiling grammar's verdict came from the instance that failed: forgotten.
    assert.equal(checker.remembered(spoiling), false);
  });
});
