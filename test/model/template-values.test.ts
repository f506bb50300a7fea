// Numbers of tool-call arguments in a chat template print as Python's json and str() print them: integers with all
// their digits, floats as repr() writes them, in {{ }}, | string, | tojson (with its options) and ~ alike.

import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { ChatTemplate, type ChatMessage } from '../../src/model/chat-template.ts';
import { pythonFloatText } from '../../src/model/template-values.ts';

function withArguments(args: string): ChatMessage[] {
  return [{ role: 'assistant', content: null, tool_calls: [{ id: 'c1', type: 'function', function: { name: 'f', arguments: args } }] }];
}
const render = (template: string, args: string): string =>
  new ChatTemplate({ templates: `{% set a = messages[0].tool_calls[0].function.arguments %}${template}` })
    .render(withArguments(args), { addGenerationPrompt: false });

describe('numbers in template values', () => {
  it("writes floats as Python's repr()", () => {
    const cases: [number, string][] = [[0, '0.0'], [-0, '-0.0'], [1, '1.0'], [0.1, '0.1'], [1e-4, '0.0001'], [1e-5, '1e-05'],
      [1.5e-7, '1.5e-07'], [1e15, '1000000000000000.0'], [1e16, '1e+16'], [123.456, '123.456'], [1e22, '1e+22'],
      [5e-324, '5e-324'], [1.7976931348623157e308, '1.7976931348623157e+308'], [Infinity, 'Infinity']];
    for (const [value, text] of cases) assert.equal(pythonFloatText(value), text, String(value));
  });

  it('prints arguments exactly however the template writes them', () => {
    const args = '{"id": 1234567890123456789, "t": 1.0, "n": -0, "s": "9007199254740993"}';
    assert.equal(render('{{ a.id }}|{{ a.t }}|{{ a.id | string }}|{{ a.n }}|{{ a.s }}', args), '1234567890123456789|1.0|1234567890123456789|0|9007199254740993');
    assert.equal(render('{{ a | tojson }}', args), '{"id": 1234567890123456789, "t": 1.0, "n": 0, "s": "9007199254740993"}');
    assert.equal(render('{{ a | tojson(indent=1, sort_keys=true) }}', args),
      '{\n "id": 1234567890123456789,\n "n": 0,\n "s": "9007199254740993",\n "t": 1.0\n}');
    assert.equal(render('{{ a | tojson(separators=(",", ":")) }}', args), '{"id":1234567890123456789,"t":1.0,"n":0,"s":"9007199254740993"}');
    assert.equal(render('{{ "id=" ~ a.id }} {{ a.t ~ "s" }} {{ "[" + a.id + "]" }}', args), 'id=1234567890123456789 1.0s [1234567890123456789]');
  });

  it('still compares and computes with them as numbers', () => {
    const args = '{"t": 1.0, "k": 3, "id": 1234567890123456789}';
    assert.equal(render('{{ a.t + 1 }} {{ a.k * 2 }} {{ a.k > 2 }} {{ a.k == 3 }} {{ a.t is integer }} {{ a.k is integer }} {{ a.id is number }}', args),
      '2.0 6 True True False True True');
    // Arguments that are not JSON are {}, as vLLM passes them.
    assert.equal(render('{{ a | tojson }}', '{"unclosed": 1'), '{}');
  });
});

describe("values printed as Python's Jinja prints them", () => {
  // The expected texts are what Jinja2 renders from the same template and values (as transformers does for vLLM).
  const args = '{"a": 1, "b": [1.0, "x", true, null], "c": {"d": "it\'s"}}';

  it("writes lists and dicts as Python's str(), in {{ }}, | string, ~ and join", () => {
    // They were JSON: {"a": 1, "b": [1, "x", true, null], ...}.
    assert.equal(render('{{ a }}|{{ a.b }}|{{ a | string }}|{{ a.c ~ "!" }}|{{ a.b | join(",") }}', args),
      `{'a': 1, 'b': [1.0, 'x', True, None], 'c': {'d': "it's"}}|[1.0, 'x', True, None]|` +
      `{'a': 1, 'b': [1.0, 'x', True, None], 'c': {'d': "it's"}}|{'d': "it's"}!|1.0,x,True,None`);
  });

  it('writes booleans and none as Python does, and strings in containers with their repr() escapes', () => {
    assert.equal(render('{{ true }}|{{ none }}|{{ undefined_var }}|{{ "a" ~ false ~ none }}|{{ (1, "x") }}|' +
      '{{ [none, 1.0 * 10000000000000000, "x\\ny", "\u00a0é"] }}', '{}'),
      "True|None||aFalseNone|(1, 'x')|[None, 1e+16, 'x\\ny', '\\xa0é']");
    // A statement's none writes nothing; an expression's writes None.
    assert.equal(render('{% set x = none %}{% if x is none %}n{% endif %}{{ x }}', '{}'), 'nNone');
  });
});

describe("trim and strip take off Python's whitespace, or the characters given", () => {
  it('as str.strip() does', () => {
    // JavaScript's trim() took U+FEFF off and left U+001F and U+0085 on; trim("xy") and strip("-") were refused.
    assert.equal(render('{{ "\\x1f\\x85 a \\ufeff" | trim }}|{{ " \\u3000a\\u2003" | trim }}|{{ "xxhixy" | trim("xy") }}|' +
      '{{ "  a  ".strip() }}|{{ "--a--".lstrip("-") }}|{{ "--a--".rstrip("-") }}|{{ "\\x85b\\x1c".strip() }}|{{ "Ab".upper() }}', '{}'),
    'a \ufeff|a|hi|a|a--|--a|b|AB');
  });
});

describe("tojson is transformers' json.dumps", () => {
  it('sorts keys by code point, and writes floats, indents and separators as Python does', () => {
    // sort_keys put "_" and "a" before "B" (localeCompare); floats the template computed were JavaScript's (1, 10000000000000000).
    assert.equal(render('{{ {"b": 1, "B": 2, "_": 3, "a": [], "é": {}, "😀": 1, "\uffff": 2} | tojson(sort_keys=true) }}', '{}'),
      '{"B": 2, "_": 3, "a": [], "b": 1, "é": {}, "\uffff": 2, "😀": 1}');
    assert.equal(render('{{ [1.0 * 10000000000000000, 2.5, 1.0, 3, true, none] | tojson }}|{{ ["é😀"] | tojson(ensure_ascii=true) }}', '{}'),
      '[1e+16, 2.5, 1.0, 3, true, null]|["\\u00e9\\ud83d\\ude00"]');
    assert.equal(render('{{ {"a": [1, {"b": []}]} | tojson(indent=0) }}|{{ {"a": [1, 2]} | tojson(indent="\t", separators=(", ", ": ")) }}', '{}'),
      '{\n"a": [\n1,\n{\n"b": []\n}\n]\n}|{\n\t"a": [\n\t\t1, \n\t\t2\n\t]\n}');
  });
});

describe("string formatting with %, as Python's", () => {
  it('formats one value, a tuple, or a dict by key, with flags, width and precision', () => {
    // The library refused `'%s' % x` (or computed a number's remainder from a string).
    assert.equal(render('{{ "%s-%d|%r|%5.1f|%-4s|%03d|%%|%x" % ("a", 3, "q", 2.25, "b", 7, 255) }}|{{ "%(n)s=%(v)r" % {"n": "k", "v": [1, none]} }}|' +
      '{{ "%s" % [1, "a"] }}|{{ "%d" % 2.7 }}|{{ "%.3s" % "abcdef" }}|{{ "%+d % d" % (5, 5) }}|{{ "%.0f %.2f %f" % (2.5, 1.005, -1.5) }}', '{}'),
    "a-3|'q'|  2.2|b   |007|%|ff|k=[1, None]|[1, 'a']|2|abc|+5  5|2 1.00 -1.500000");
    // Exact numbers keep their digits; numbers still take their remainder.
    assert.equal(render('{{ "id=%s n=%d t=%s" % (a.id, a.id, a.t) }}|{{ 10 % 3 }}', '{"id": 1234567890123456789, "t": 1.0}'),
      'id=1234567890123456789 n=1234567890123456789 t=1.0|1');
    assert.throws(() => render('{{ "%s" % ("a", "b") }}', '{}'), /not all arguments converted/);
  });
});

describe('empty tool-call arguments', () => {
  it('reach the template as an empty object, as vLLM passes "" and "null"', () => {
    for (const args of ['', 'null']) {
      assert.equal(render('{{ a | tojson }}|{{ a is mapping }}', args), '{}|True', JSON.stringify(args));
    }
  });
});
