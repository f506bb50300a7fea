// What XGrammar (0.1.27) accepts for the grammars Conduit writes of alternatives (guided_choice, a schema's enum and
// anyOf/oneOf of consts) and of property names, listed in full with XGrammar's own matcher: a vocabulary of the 256
// single bytes and an end token, walked depth first over every byte the mask allows, each string the end token may
// follow recorded. XGrammar merges states of the automaton it builds from alternatives unsoundly, so left to it
// ["521", "600", "601"] also took "520"; these check that every string accepted is one of the values, and each value
// is accepted, on the cases found wrong and on seeded random lists.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { checkJsonSchema, grammarSchema } from '../../src/api/guided.ts';
import { buildGrammar, choiceGrammar, grammarSource } from '../../src/engine/grammar/runtime.ts';
import { XGrammar, type XgHandle } from '../../src/engine/grammar/xgrammar.ts';
import { byteLevelCompiler, END } from './xgrammar-fixtures.ts';
import { seededRandom } from '../../src/util/random.ts';

describe('alternatives as XGrammar accepts them', () => {
  let xg: XGrammar;
  let compiler: XgHandle;

  before(async () => {
    xg = await XGrammar.load();
    compiler = byteLevelCompiler(xg);
  });
  after(() => compiler?.delete());

  /**
   * Every complete text (UTF-8) of at most `maxBytes` bytes the grammar accepts: of EBNF, of a schema as XGrammar
   * compiles it, or of a schema as a worker does (compact JSON, 'spec').
   */
  function accepted(kind: 'ebnf' | 'json' | 'spec', source: string, maxBytes: number): string[] {
    const b = xg.binding;
    const compiled = xg.run('compile', () => {
      if (kind === 'json') return compiler.CompileJSONSchema(source, false, undefined, undefined, true, undefined);
      const grammar = kind === 'spec' ? buildGrammar(b, grammarSource({ kind: 'json_schema', schema: source, compact: true }))
        : new b.Grammar.FromEBNF(source, 'root');
      try {
        return compiler.CompileGrammar(grammar);
      } finally {
        grammar.delete();
      }
    });
    const matcher = new b.GrammarMatcher(compiled, undefined, false, -1);
    const texts: string[] = [];
    const bytes: number[] = [];
    const walk = (): void => {
      const vector = matcher.GetNextTokenBitmask(END + 1);
      const words = Int32Array.from(b.vecIntToView(vector));
      vector.delete();
      const allowed = (id: number) => ((words[id >>> 5]! >>> (id & 31)) & 1) === 1;
      if (allowed(END)) texts.push(Buffer.from(bytes).toString('utf8'));
      if (bytes.length >= maxBytes || texts.length > 1000) return;
      for (let byte = 0; byte < 256; byte++) {
        if (!allowed(byte)) continue;
        assert.ok(matcher.AcceptToken(byte, false), 'the mask allowed a byte the matcher refuses');
        bytes.push(byte);
        walk();
        bytes.pop();
        matcher.Rollback(1);
      }
    };
    walk();
    matcher.delete();
    compiled.delete();
    return texts;
  }

  /** The choices' grammar accepts exactly the choices (strings up to 4 bytes past the longest, to see past them). */
  function assertChoices(choices: string[]): void {
    const maxBytes = Math.max(...choices.map((choice) => Buffer.byteLength(choice))) + 4;
    assert.deepEqual(accepted('ebnf', choiceGrammar(choices), maxBytes).sort(), [...new Set(choices)].sort(), JSON.stringify(choices));
  }

  /** The schema's grammar (compact JSON) accepts exactly the values' JSON texts. */
  function assertEnum(schema: object, values: unknown[]): void {
    const texts = values.map((value) => JSON.stringify(value));
    const maxBytes = Math.max(...texts.map((text) => Buffer.byteLength(text))) + 4;
    const got = accepted('json', JSON.stringify(grammarSchema(schema)), maxBytes);
    assert.deepEqual(got.sort(), [...new Set(texts)].sort(), JSON.stringify(schema));
  }

  const randomStrings = (random: () => number, alphabet: string[], count: number): string[] => {
    const set = new Set<string>();
    while (set.size < count) {
      let text = '';
      for (let length = 1 + Math.floor(random() * 3); length > 0; length--) text += alphabet[Math.floor(random() * alphabet.length)];
      set.add(text);
    }
    return [...set];
  };

  it('guided_choice: choices whose characters share their first UTF-8 bytes are not mixed', () => {
    // Each took another string as a tree of characters: "乙中a", "a丁", "中中丁", "乙丁a".
    for (const choices of [['乙丁', '丁', 'b', '中a'], ['a中', '丁', '中'], ['b', 'baa', '中丁', '丁'], ['乙中', '丁a', '中', 'bb'],
      ['é😀', '😁', 'é😁è', '中é😁', 'èè', '丁']]) {
      assertChoices(choices);
    }
    // Seeded random lists (a tree of characters let 4 of these 300 take another string).
    const random = seededRandom(1);
    for (let list = 0; list < 300; list++) assertChoices(randomStrings(random, ['a', 'b', '中', '丁', '乙'], 2 + Math.floor(random() * 5)));
  });

  it('guided_choice: ASCII choices, prefixes of one another and the empty tail still take exactly the choices', () => {
    assertChoices(['521', '600', '601']);
    assertChoices(['a', 'ab', 'abc', 'b"\\', '中', '中文', 'a中']);
  });

  it('an enum of numbers, and an anyOf/oneOf of number consts, give only their values', () => {
    const codes = [521, 600, 601];
    assertEnum({ enum: codes }, codes);
    assertEnum({ anyOf: codes.map((code) => ({ const: code })) }, codes);
    assertEnum({ type: 'integer', oneOf: [{ const: 521 }, { enum: [600, 601] }] }, codes);
    assertEnum({ enum: [2, 1, 22, 112, 220, 222] }, [2, 1, 22, 112, 220, 222]);
    // Seeded random enums of one- to three-digit numbers of the digits 0-2 (side by side, 4 of these 300 mixed).
    const random = seededRandom(2);
    for (let schema = 0; schema < 300; schema++) {
      const values = [...new Set(randomStrings(random, ['0', '1', '2'], 2 + Math.floor(random() * 5)).map(Number))];
      if (values.length < 2) continue;
      assertEnum(schema % 2 === 0 ? { enum: values } : { anyOf: values.map((value) => ({ const: value })) }, values);
    }
  });

  it('an enum of mixed values, or of strings outside ASCII, gives only its values', () => {
    assertEnum({ enum: [[1, 2], 'ab', [1], '12', false, null] }, [[1, 2], 'ab', [1], '12', false, null]);
    assertEnum({ anyOf: [{ const: true }, { const: 19 }, { const: '12' }, { const: [1] }, { const: '1' }] }, [true, 19, '12', [1], '1']);
    assertEnum({ enum: ['a中', '丁', '中'] }, ['a中', '丁', '中']);
    const random = seededRandom(3);
    for (let schema = 0; schema < 200; schema++) {
      const values = randomStrings(random, ['a', 'b', '中', '丁', '乙'], 2 + Math.floor(random() * 5));
      assertEnum(schema % 2 === 0 ? { enum: values } : { oneOf: values.map((value) => ({ const: value })) }, values);
    }
  });

  it('numbers in an enum or const come out as JSON writes them (decimals, exponents, past 2^53), not respelled', () => {
    const spelled = (schema: object) => accepted('spec', JSON.stringify(grammarSchema(schema)), 40);
    // XGrammar wrote each with 17 significant digits: 2.3900000000000001, 9.9999999999999995e-08, 1e+20.
    assert.deepEqual(spelled({ const: 2.39 }), ['2.39']);
    assert.deepEqual(spelled({ type: 'number', const: -0.1 }), ['-0.1']);
    const values = [2.39, 1e21, 1e-7, -0, -5, 0.1, -2.5e-300, 1e20, 2 ** 53 + 2, 12, 1.5];
    const texts = values.map((value) => JSON.stringify(value));
    assert.deepEqual(texts, ['2.39', '1e+21', '1e-7', '0', '-5', '0.1', '-2.5e-300', '100000000000000000000', '9007199254740994', '12', '1.5']);
    assert.deepEqual(spelled({ enum: values }).sort(), [...texts].sort());
    assert.deepEqual(spelled({ type: 'number', anyOf: values.map((value) => ({ const: value })) }).sort(), [...texts].sort());
    // Integers past 2^53 with the digits the schema's text writes (JSON.parse rounds both of these to one double).
    assert.deepEqual(accepted('spec', '{"enum":[1234567890123456789,1234567890123456790,-9223372036854775808]}', 24).sort(),
      ['-9223372036854775808', '1234567890123456789', '1234567890123456790']);
    assert.deepEqual(accepted('spec', '{"type":"array","maxItems":1,"items":{"const":12345678901234567890123}}', 30).sort(), ['[12345678901234567890123]', '[]']);
    // Inside arrays and objects, and inside a property; a string that looks like the placeholders stays a string.
    assert.deepEqual(spelled({ const: [2.39, { a: 0.3 }] }), ['[2.39,{"a":0.3}]']);
    assert.deepEqual(spelled({ type: 'object', properties: { x: { enum: [0.7, 'jsonnumber_0_'] } }, required: ['x'], additionalProperties: false }).sort(),
      ['{"x": "jsonnumber_0_"}', '{"x": 0.7}']);
    // With any whitespace, as a worker compiles it by default: the same values.
    const compiled = xg.run('compile', () => {
      const grammar = buildGrammar(xg.binding, grammarSource({ kind: 'json_schema', schema: JSON.stringify({ const: 2.39 }) }));
      try {
        return compiler.CompileGrammar(grammar);
      } finally {
        grammar.delete();
      }
    });
    const matcher = new xg.binding.GrammarMatcher(compiled, undefined, false, -1);
    for (const byte of Buffer.from('2.39')) assert.ok(matcher.AcceptToken(byte, false));
    assert.ok(matcher.AcceptToken(END, false), 'ends after 2.39');
    matcher.delete();
    compiled.delete();
  });

  it('a pattern gives JSON strings: characters JSON escapes are left out of what it matches, or it is refused if it needs them', () => {
    // Left to XGrammar, '.' let a raw quote (and a raw backslash, raw controls) between the string's quotes.
    const raw = accepted('json', JSON.stringify({ type: 'string', pattern: '.' }), 3);
    assert.ok(raw.includes('"""') && raw.includes('"\\"') && raw.includes('"\n"'), 'XGrammar writes them raw');
    for (const pattern of ['.', '\\S', '\\W', '\\D', '\\s', '[ -~]', '[^,]', '[^-a]', '[\\w!-$]', '[a"]', '[^"\\\\\\x00-\\x1f]']) {
      const schema = { type: 'string', pattern };
      checkJsonSchema(schema, 'guided_json');
      const texts = accepted('json', JSON.stringify(grammarSchema(schema)), 3);
      assert.ok(texts.length > 0, pattern);
      for (const text of texts) assert.match(JSON.parse(text) as string, new RegExp(`^${pattern}$`), `${pattern}: ${JSON.stringify(text)}`);
    }
    assert.equal(accepted('json', JSON.stringify(grammarSchema({ type: 'string', pattern: '[ -~]' })), 3).length, 93, 'printable ASCII but " and \\');
    for (const pattern of ['a"b', '\\\\', '\\n', '[\\x00-\\x1f]', 'tab\there']) {
      assert.throws(() => checkJsonSchema({ type: 'string', pattern }, 'guided_json'), /matches only/, pattern);
    }
  });

  it('property names holding a quote, a backslash or a control character come out as JSON writes them', () => {
    for (const name of ['a"b', 'a\\b', 'x\\x41a', 'tab\there', 'é"', '\\', '"']) {
      const schema = { type: 'object', properties: { [name]: { type: 'boolean' }, plain: { type: 'null' } }, required: [name, 'plain'],
        additionalProperties: false };
      const texts = accepted('json', JSON.stringify(grammarSchema(schema)), 64);
      assert.equal(texts.length, 2, `${JSON.stringify(name)}: ${JSON.stringify(texts)}`);
      for (const text of texts) assert.deepEqual(Object.keys(JSON.parse(text) as object), [name, 'plain'], text);
    }
  });

  it("a '$ref' through such a property's name, or written with a JSON pointer's escapes, reaches its schema", () => {
    // The pointer names the property as the request does ('#/properties/a"b', or percent-encoded as a URI fragment);
    // the grammar holds the name spelled otherwise, and the reference pointed nowhere (XGrammar's "Cannot find field").
    for (const [name, pointer] of [['a"b', 'a"b'], ['a\\b', 'a%5Cb'], ['tab\there', 'tab%09here'], ['"', '%22']] as [string, string][]) {
      const schema = { type: 'object', properties: { [name]: { type: 'null' }, copy: { $ref: `#/properties/${pointer}` } },
        required: [name, 'copy'], additionalProperties: false };
      const texts = accepted('json', JSON.stringify(grammarSchema(schema)), 64);
      assert.deepEqual(texts.map((text) => JSON.parse(text)), [{ [name]: null, copy: null }], `${JSON.stringify(name)}: ${JSON.stringify(texts)}`);
    }
    // ~0 is '~' and ~1 is '/' in a segment (XGrammar reads neither); a segment that is a name as written still reaches it.
    assert.deepEqual(accepted('json', JSON.stringify(grammarSchema({ $defs: { 'a~b': { const: 1 } }, $ref: '#/$defs/a~0b' })), 8), ['1']);
    assert.deepEqual(accepted('json', JSON.stringify(grammarSchema({ $defs: { 'a~1b': { const: 1 } }, $ref: '#/$defs/a~1b' })), 8), ['1']);
  });

  it("a '$ref' into an array, to an entry the grammar leaves out or rewrites, or through a name holding '/' reaches its schema", () => {
    // XGrammar follows object keys only ("Cannot find field 1" for an index), and the grammar schema drops anyOf
    // branches no value satisfies (shifting the others) and rewrites an anyOf of consts whole.
    const refTo = (schema: object, ref: string) => {
      const whole = { ...schema, $ref: ref };
      checkJsonSchema(whole, 'guided_json');
      return accepted('json', JSON.stringify(grammarSchema(whole)), 8).sort();
    };
    assert.deepEqual(refTo({ $defs: { x: { anyOf: [{ type: 'null' }, { type: 'boolean' }] } } }, '#/$defs/x/anyOf/1'), ['false', 'true']);
    assert.deepEqual(refTo({ $defs: { x: { anyOf: [false, { type: 'null' }, { type: 'boolean' }] } } }, '#/$defs/x/anyOf/2'), ['false', 'true']);
    assert.deepEqual(refTo({ $defs: { x: { anyOf: [{ const: 'a' }, { const: 'b' }] } } }, '#/$defs/x/anyOf/1'), ['"b"']);
    assert.deepEqual(refTo({ $defs: { x: { oneOf: [{ const: 1 }, { enum: [2, 3] }] } } }, '#/$defs/x/oneOf/1'), ['2', '3']);
    assert.deepEqual(refTo({ $defs: { 'a/b': { const: 4 } } }, '#/$defs/a~1b'), ['4']);
    // Into an array's prefixItems, from a property beside it; and a reference to a reference's own target.
    const pair = { type: 'object', properties: { a: { type: 'array', prefixItems: [{ type: 'null' }, { enum: [1, 2] }], items: false, minItems: 2 },
      b: { $ref: '#/properties/a/prefixItems/1' }, c: { $ref: '#/properties/b' } }, required: ['a', 'b', 'c'], additionalProperties: false };
    checkJsonSchema(pair, 'guided_json');
    const texts = accepted('spec', JSON.stringify(grammarSchema(pair)), 40);
    assert.deepEqual(texts.map((text) => JSON.parse(text)).sort((x, y) => JSON.stringify(x).localeCompare(JSON.stringify(y))),
      [1, 2].flatMap((a1) => [1, 2].flatMap((b) => [1, 2].map((c) => ({ a: [null, a1], b, c })))));
  });

  it("a '$ref' that points to nothing, or to what is not a schema, is a 400 naming it", () => {
    assert.throws(() => checkJsonSchema({ type: 'object', properties: { a: { $ref: '#/$defs/missing' } } }, 'guided_json'),
      (error: Error & { param?: string }) => error.param === 'guided_json.properties.a.$ref' && /points to nothing/.test(error.message));
    // Unused, it is still refused: the schema is wrong (XGrammar looked only at references it reached).
    assert.throws(() => checkJsonSchema({ type: 'null', $defs: { x: { $ref: '#/$defs/x/anyOf/3' } } }, 'guided_json'), /points to nothing/);
    assert.throws(() => checkJsonSchema({ type: 'object', required: [], $ref: '#/required' }, 'guided_json'), /not a schema/);
  });
});
