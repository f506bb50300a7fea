// Character classes holding \W, \S or \D, in guided_regex and in a schema's 'pattern', as XGrammar (0.1.27) enforces
// them: checked with its own matcher over a vocabulary of the 256 single bytes and an end token. Outside a class it
// reads \w, \s and \d as ASCII and \W, \S, \D as every other character, those outside ASCII included; inside a class
// it took \W, \S and \D for their ASCII characters alone, so [^\W] gave "é" and [\W] never did.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { checkJsonSchema, grammarSchema, readGuided } from '../../src/api/guided.ts';
import { Fields } from '../../src/api/validate.ts';
import { buildGrammar, grammarSource } from '../../src/engine/grammar/runtime.ts';
import type { GuidedDecoding } from '../../src/engine/types.ts';
import { XGrammar, type XgHandle } from '../../src/engine/grammar/xgrammar.ts';
import { byteLevelCompiler, END } from './xgrammar-fixtures.ts';

/** One character each: ASCII word, space and other characters, and characters outside ASCII (letters, spaces, a digit, an emoji). */
const SAMPLES = ['a', 'Z', '_', '7', ' ', '\t', '!', '-', 'é', 'ß', '中', '٣', '\u00a0', '\u3000', '😀'];
const OUTSIDE_ASCII = ['é', 'ß', '中', '٣', '\u00a0', '\u3000', '😀'];

describe('\\W, \\S and \\D inside a character class', () => {
  let xg: XGrammar;
  let compiler: XgHandle;

  before(async () => {
    xg = await XGrammar.load();
    compiler = byteLevelCompiler(xg);
  });
  after(() => compiler?.delete());

  /** The texts of `texts` the spec's grammar accepts whole (compact JSON for a schema). */
  function acceptedOf(spec: GuidedDecoding, texts: string[]): string[] {
    const compiled = xg.run('compile', () => {
      const grammar = buildGrammar(xg.binding, grammarSource(spec));
      try {
        return compiler.CompileGrammar(grammar);
      } finally {
        grammar.delete();
      }
    });
    try {
      return texts.filter((text) => {
        const matcher = new xg.binding.GrammarMatcher(compiled, undefined, false, -1);
        try {
          return [...Buffer.from(text, 'utf8')].every((byte) => matcher.AcceptToken(byte, false)) && matcher.AcceptToken(END, false);
        } finally {
          matcher.delete();
        }
      });
    } finally {
      compiled.delete();
    }
  }

  const regex = (pattern: string): GuidedDecoding => readGuided(new Fields({ guided_regex: pattern }))!.spec;
  const schemaPattern = (pattern: string): GuidedDecoding => {
    const schema = { type: 'string', pattern };
    checkJsonSchema(schema, 'guided_json');
    return { kind: 'json_schema', schema: JSON.stringify(grammarSchema(schema)), compact: true };
  };

  // Each class and the samples it matches when \w, \s and \d are ASCII and \W, \S, \D everything else (as outside a class).
  const CASES: [string, string[]][] = [
    ['[^\\W]', ['a', 'Z', '_', '7']],
    ['[^\\S]', [' ', '\t']],
    ['[^\\D]', ['7']],
    ['[^\\W\\d]', ['a', 'Z', '_']],
    ['[^\\S ]', ['\t']],
    ['[\\W]', [' ', '\t', '!', '-', ...OUTSIDE_ASCII]],
    ['[\\S]', ['a', 'Z', '_', '7', '!', '-', ...OUTSIDE_ASCII]],
    ['[\\D]', ['a', 'Z', '_', ' ', '\t', '!', '-', ...OUTSIDE_ASCII]],
    ['[a\\W]', ['a', ' ', '\t', '!', '-', ...OUTSIDE_ASCII]],
    ['[\\s\\S]', SAMPLES],
    // Already right: \w, \s and \d in a class, negated or not.
    ['[^\\w]', [' ', '\t', '!', '-', ...OUTSIDE_ASCII]],
    ['[^\\s]', ['a', 'Z', '_', '7', '!', '-', ...OUTSIDE_ASCII]],
    ['[\\w-]', ['a', 'Z', '_', '7', '-']],
  ];

  it('guided_regex: a class matches the characters its members do, outside ASCII too', () => {
    for (const [pattern, expected] of CASES) assert.deepEqual(acceptedOf(regex(pattern), SAMPLES), expected, pattern);
    assert.deepEqual(acceptedOf(regex('[^\\W\\d][\\w]*'), ['ab_1', 'é1', '1a', 'aé']), ['ab_1'], 'an identifier');
  });

  it("a schema's pattern: the same, as JSON strings (the characters JSON escapes left out)", () => {
    for (const [pattern, expected] of CASES) {
      const jsonTexts = SAMPLES.map((sample) => JSON.stringify(sample));
      const want = expected.filter((sample) => sample !== '\t').map((sample) => JSON.stringify(sample));
      if (want.length === 0) {
        // A tab alone ([^\S ]): JSON writes it escaped, so the pattern is refused as any needing it is.
        assert.throws(() => schemaPattern(pattern), /matches only/, pattern);
        continue;
      }
      assert.deepEqual(acceptedOf(schemaPattern(pattern), jsonTexts), want, pattern);
    }
  });

  it('a negated class that leaves out every character is a 400', () => {
    assert.throws(() => readGuided(new Fields({ guided_regex: 'a[^\\W\\w]' })), /character class \[\^\\W\\w\] matches no character/);
    assert.throws(() => checkJsonSchema({ type: 'string', pattern: '[^\\s\\S]' }, 'guided_json'), /matches no character/);
  });
});
