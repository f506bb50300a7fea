// The bound on whitespace runs between JSON elements, kept beside XGrammar (src/engine/grammar/json-whitespace.ts):
// checked against two independent references on random walks through JSON documents that favour whitespace: the
// unbounded grammar's own mask filtered by a from-scratch scan of the whole text, and XGrammar's own bounded grammar
// (its maximum whitespace count) where that one is consistent (a schema whose values are all typed).

import assert from 'node:assert/strict';
import { before, describe, it } from 'node:test';
import { GrammarRuntime, JSON_MAX_WHITESPACE, type GuidedSequence } from '../../src/engine/grammar/runtime.ts';
import { byteLevelChars, XGrammar, type XgHandle } from '../../src/engine/grammar/xgrammar.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { LLAMA_SPM_TOKENIZER_PATH } from '../../src/model/synthetic.ts';
import { createTokenizer, type Tokenizer } from '../../src/model/tokenizer/index.ts';
import { Xoshiro128 } from '../../src/util/random.ts';

/** `text` with its strings (closed or not) cut down to one quote each. */
function outsideStrings(text: string): string {
  return text.replace(/"(?:[^"\\]|\\.)*(?:"|\\?$)/gs, '"');
}

/** The longest run of JSON whitespace outside strings in `text`. */
function longestOutsideRun(text: string): number {
  let longest = 0;
  for (const run of outsideStrings(text).match(/[ \n\t]+/g) ?? []) longest = Math.max(longest, run.length);
  return longest;
}

/** `text` ends inside a string: a quote is left once its closed strings are taken out. */
function inString(text: string): boolean {
  return text.replace(/"(?:[^"\\]|\\.)*"/gs, '').includes('"');
}

describe('JSON whitespace bound', () => {
  let tokenizer: Tokenizer;
  let runtime: GrammarRuntime;
  let xg: XGrammar;
  let compiler: XgHandle;
  /** Each token's bytes as latin1 text (one character per byte), for the scan. */
  let texts: string[];

  before(async () => {
    tokenizer = createTokenizer({ kind: 'gguf', file: readGguf(LLAMA_SPM_TOKENIZER_PATH) });
    runtime = await GrammarRuntime.create(tokenizer);
    // A second XGrammar of its own, for the references.
    xg = await XGrammar.load();
    const table = byteLevelChars();
    texts = [];
    const encoded: string[] = [];
    for (let id = 0; id < tokenizer.vocabSize; id++) {
      const bytes = tokenizer.tokenBytes(id, false);
      texts.push(Buffer.from(bytes).toString('latin1'));
      encoded.push([...bytes].map((byte) => table[byte]).join(''));
    }
    compiler = xg.run('vocabulary', (b) => new b.GrammarCompiler(new b.TokenizerInfo(b.vecStringFromJSArray(encoded), 'BYTE_LEVEL',
      tokenizer.vocabSize, b.vecIntFromJSArray([...tokenizer.stopTokenIds]), false), 1, false));
  });

  const allowedOf = (guided: GuidedSequence): number[] => {
    const out = new Int32Array(runtime.vocabSize);
    return Array.from(out.subarray(0, guided.allowedTokens(out)));
  };

  const referenceMatcher = (schema: string, maxWhitespace: number | undefined): XgHandle => xg.run('reference', (b) =>
    new b.GrammarMatcher(compiler.CompileJSONSchema(schema, true, undefined, undefined, true, maxWhitespace), undefined, false, -1));

  const maskOf = (matcher: XgHandle): number[] => {
    const vector = matcher.GetNextTokenBitmask(tokenizer.vocabSize);
    const words = xg.binding.vecIntToView(vector);
    const ids: number[] = [];
    for (let id = 0; id < tokenizer.vocabSize; id++) if ((words[id >>> 5]! >>> (id & 31)) & 1) ids.push(id);
    vector.delete();
    return ids;
  };

  // JSON grammars never allow these whatever the bound (GrammarRuntime.jsonForbidden).
  const forbidden = (id: number) => [...tokenizer.tokenBytes(id, false)].some((b) => (b < 0x20 && b !== 0x0a && b !== 0x0d) || b === 0xc0 || b === 0xc1 || b >= 0xf5);

  /**
   * Walks `steps` tokens through `schema`: at each step the sequence's allowed tokens are compared with the
   * references', then a token is taken at random among them: between elements one holding whitespace two times in
   * three when there is one (so runs reach the bound), inside a string one with a quote half the time; the end of
   * generation never while anything else is allowed.
   */
  function walk(schema: object, seed: number, steps: number, compareBounded: boolean): { runsAtBound: number; refusedAtBound: number } {
    const source = JSON.stringify(schema);
    const guided = runtime.open({ kind: 'json_schema', schema: source });
    const unbounded = referenceMatcher(source, undefined);
    const bounded = compareBounded ? referenceMatcher(source, JSON_MAX_WHITESPACE) : undefined;
    const rng = Xoshiro128.fromSeed(seed, 0);
    const row = new Float32Array(runtime.vocabSize);
    const stops = new Set(tokenizer.stopTokenIds);
    let text = '';
    let runsAtBound = 0;
    let refusedAtBound = 0;
    try {
      for (let step = 0; step < steps && !guided.isTerminated; step++) {
        const ours = allowedOf(guided);
        const grammarAllows = maskOf(unbounded).filter((id) => !forbidden(id));
        // Inside a string only a token with a quote can reach whitespace outside it; outside, one with whitespace.
        const open = inString(text);
        const reference = grammarAllows.filter((id) => stops.has(id) || !(open ? /"/ : /[ \n\t"]/).test(texts[id]!)
          || longestOutsideRun(text + texts[id]) <= JSON_MAX_WHITESPACE);
        assert.deepEqual(ours, reference, `after ${JSON.stringify(text)}: the bound's allowed tokens differ from the scan's`);
        if (bounded) assert.deepEqual(ours, maskOf(bounded).filter((id) => !forbidden(id)), `after ${JSON.stringify(text)}: XGrammar's bounded grammar differs`);
        if (reference.length < grammarAllows.length) refusedAtBound++;
        // A token the bound refuses is refused by accept too, the state unchanged.
        const kept = new Set(reference);
        // maskedArgmax checks the bound per token instead of on the mask: the best allowed token of a row whose top
        // values sit on the tokens only the bound refuses.
        for (let id = 0; id < row.length; id++) row[id] = rng.nextFloat();
        for (const id of grammarAllows) if (!kept.has(id)) row[id] = 100;
        const best = ours.reduce((at, id) => (at < 0 || row[id]! > row[at]! ? id : at), -1);
        assert.equal(guided.maskedArgmax(row), best, `after ${JSON.stringify(text)}: maskedArgmax`);
        const over = grammarAllows.find((id) => !kept.has(id));
        if (over !== undefined) assert.equal(guided.accept(over), false);
        const candidates = ours.filter((id) => !stops.has(id));
        if (candidates.length === 0) {
          assert.equal(guided.accept(ours[0]!), true);
          break;
        }
        // In a string, a token that closes it half the time (so the walk spends its steps between elements).
        const preferred = candidates.filter((id) => (open ? /"/ : /[ \n\t]/).test(texts[id]!));
        const pool = preferred.length > 0 && rng.nextFloat() < (open ? 1 / 2 : 2 / 3) ? preferred : candidates;
        const id = pool[Math.floor(rng.nextFloat() * pool.length)]!;
        assert.equal(guided.accept(id), true);
        assert.equal(unbounded.AcceptToken(id, false), true);
        if (bounded) assert.equal(bounded.AcceptToken(id, false), true);
        text += texts[id];
        if (new RegExp(`[ \\n\\t]{${JSON_MAX_WHITESPACE}}$`).test(outsideStrings(text))) runsAtBound++;
      }
    } finally {
      guided.dispose();
      unbounded.delete();
      bounded?.delete();
    }
    return { runsAtBound, refusedAtBound };
  }

  it('typed schema: the same tokens as the whole-text scan and as XGrammar\'s own bounded grammar', () => {
    const schema = {
      type: 'object',
      properties: {
        name: { type: 'string', maxLength: 6 }, age: { type: 'integer', minimum: 0, maximum: 120 },
        tags: { type: 'array', items: { type: 'string', maxLength: 3 }, maxItems: 3 }, color: { enum: ['red', 'green'] },
        point: { type: 'object', properties: { x: { type: 'number' } }, required: ['x'], additionalProperties: false },
      },
      required: ['name', 'age', 'tags', 'color', 'point'], additionalProperties: false,
    };
    let atBound = 0;
    let refused = 0;
    for (const seed of [1, 2, 3]) {
      const { runsAtBound, refusedAtBound } = walk(schema, seed, 120, true);
      atBound += runsAtBound;
      refused += refusedAtBound;
    }
    // The walks reached the bound and the bound refused tokens the grammar alone would take.
    assert.ok(atBound > 0 && refused > 0, `runs at the bound ${atBound}, steps with tokens refused by it ${refused}`);
  });

  it('any JSON object: the same tokens as the whole-text scan (strings with quotes and escapes, nested arrays)', () => {
    let refused = 0;
    for (const seed of [5, 6]) refused += walk({ type: 'object' }, seed, 120, false).refusedAtBound;
    assert.ok(refused > 0);
  });
});
