// Which integer bounds the gateway lets through (integerRangeEnforced), checked against XGrammar's (0.1.27) own
// matcher: every integer in a window around the range, as the whole output, is accepted exactly when it is in range.
// XGrammar writes bounds as a regex of digit patterns and merges states of the automaton it builds from them
// unsoundly for some shapes; the rule in src/api/guided.ts refuses those shapes and should accept the others.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { integerRangeEnforced } from '../../src/api/guided.ts';
import { XGrammar, type XgHandle } from '../../src/engine/grammar/xgrammar.ts';
import { byteLevelCompiler, END } from './xgrammar-fixtures.ts';

describe('integer bounds as XGrammar enforces them', () => {
  let xg: XGrammar;
  let compiler: XgHandle;

  before(async () => {
    xg = await XGrammar.load();
    compiler = byteLevelCompiler(xg);
  });
  after(() => compiler?.delete());

  /** The integers from `from` to `to` whose text XGrammar's grammar for low..high accepts and should not, or refuses and should not. */
  function mismatches(low: number, high: number, from: number, to: number): number[] {
    const compiled = xg.run('compile', () => compiler.CompileJSONSchema(JSON.stringify({ type: 'integer', minimum: low, maximum: high }),
      false, undefined, undefined, true, undefined));
    const wrong: number[] = [];
    for (let n = from; n <= to; n++) {
      const matcher = new xg.binding.GrammarMatcher(compiled, undefined, false, -1);
      const accepted = [...Buffer.from(String(n))].every((byte) => matcher.AcceptToken(byte, false)) && matcher.AcceptToken(END, false);
      matcher.delete();
      if (accepted !== (n >= low && n <= high)) wrong.push(n);
    }
    compiled.delete();
    return wrong;
  }

  it('ranges it enforces exactly are accepted: two digits up to three or four, three up to four, different first digits at three and four', () => {
    // Each was refused, though XGrammar enforced it exactly.
    for (const [low, high] of [[62, 624], [19, 215], [-322, -33], [655, 921], [226, 784], [1234, 5678], [3339, 5999], [64, 1069],
      [39, 7999], [-4569, -19], [19, 59], [258, 3481], [899, 5679], [-5981, -622]] as [number, number][]) {
      assert.ok(integerRangeEnforced(low, high), `${low}..${high} accepted`);
      const span = Math.max(Math.abs(low), Math.abs(high));
      assert.deepEqual(mismatches(low, high, -span - 100, span + 100), [], `${low}..${high}`);
    }
  });

  it('three-digit ranges of different first digits whose bounds both end in 9 are refused: the lower one let its tens through', () => {
    // 339..599 was accepted (its upper bound's 9s were taken to make it exact) and produced 330..338.
    for (const [low, high] of [[339, 599], [109, 409], [539, 909], [149, 899], [39, 799]] as [number, number][]) {
      assert.ok(!integerRangeEnforced(low, high), `${low}..${high} refused`);
      const below = Math.floor(low / 10) * 10;
      assert.deepEqual(mismatches(low, high, below, low - 1), Array.from({ length: low - below }, (_, i) => below + i), `${low}..${high}`);
    }
    // From 901..999 to four digits, refused too (901..1234 allowed 900).
    assert.ok(!integerRangeEnforced(901, 1234));
    assert.deepEqual(mismatches(901, 1234, 0, 2500), [900]);
    // Up to a block of 9s, and at two digits, exact.
    for (const [low, high] of [[339, 999], [19, 89]] as [number, number][]) {
      assert.ok(integerRangeEnforced(low, high), `${low}..${high} accepted`);
      assert.deepEqual(mismatches(low, high, 0, high + 100), [], `${low}..${high}`);
    }
  });
});
