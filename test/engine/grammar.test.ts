// The engine's grammar runtime (XGrammar WASM) on the built-in Llama 2 vocabulary: masks, advancing, refusals.

import assert from 'node:assert/strict';
import { before, describe, it } from 'node:test';
import { GrammarRuntime, grammarSource, parseGrammar } from '../../src/engine/grammar/runtime.ts';
import { GrammarError, XGrammar } from '../../src/engine/grammar/xgrammar.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { LLAMA_SPM_TOKENIZER_PATH } from '../../src/model/synthetic.ts';
import { createTokenizer, type Tokenizer } from '../../src/model/tokenizer/index.ts';

describe('grammar runtime', () => {
  let tokenizer: Tokenizer;
  let runtime: GrammarRuntime;

  before(async () => {
    tokenizer = createTokenizer({ kind: 'gguf', file: readGguf(LLAMA_SPM_TOKENIZER_PATH) });
    runtime = await GrammarRuntime.create(tokenizer);
  });

  const allowedIds = (guided: ReturnType<GrammarRuntime['open']>): number[] => {
    const out = new Int32Array(runtime.vocabSize);
    return Array.from(out.subarray(0, guided.allowedTokens(out)));
  };

  it('a choice allows exactly the tokens that begin a choice; a refused token leaves the state as it was', () => {
    const guided = runtime.open({ kind: 'choice', choices: ['yes', 'no'] });
    const first = allowedIds(guided).map((id) => new TextDecoder().decode(tokenizer.tokenBytes(id)));
    assert.ok(first.length > 0 && first.every((text) => 'yes'.startsWith(text) || 'no'.startsWith(text)), JSON.stringify(first));
    const [x] = tokenizer.encode('x', { addSpecialTokens: false }).slice(-1);
    assert.equal(guided.accept(x!), false);
    // Still at the start: "no" goes through (an allowed token that spells the rest of it, each step), then only EOS.
    let rest = 'no';
    for (let guard = 0; rest !== '' && guard < 4; guard++) {
      const next = allowedIds(guided).find((id) => {
        const text = new TextDecoder().decode(tokenizer.tokenBytes(id));
        return text !== '' && rest.startsWith(text);
      });
      assert.ok(next !== undefined, `no allowed token continues "${rest}"`);
      assert.equal(guided.accept(next), true);
      rest = rest.slice(new TextDecoder().decode(tokenizer.tokenBytes(next)).length);
    }
    assert.equal(rest, '');
    assert.deepEqual(allowedIds(guided), [...tokenizer.stopTokenIds]);
    assert.equal(guided.accept(tokenizer.stopTokenIds[0]!), true);
    assert.equal(guided.isTerminated, true);
    guided.dispose();
  });

  it('maskRow sets every refused token to -Infinity and leaves the allowed ones', () => {
    const guided = runtime.open({ kind: 'regex', pattern: '[0-9]+' });
    const row = new Float32Array(runtime.vocabSize).fill(1);
    guided.maskRow(row);
    const allowed = new Set(allowedIds(guided));
    for (let id = 0; id < row.length; id++) assert.equal(row[id] === 1, allowed.has(id), `token ${id}`);
    assert.ok(allowed.size > 0);
    guided.dispose();
  });

  it('JSON grammars never allow tokens with raw control characters (tab included)', () => {
    const guided = runtime.open({ kind: 'json_schema', schema: JSON.stringify({ type: 'object', properties: { a: { type: 'string', maxLength: 4 } }, required: ['a'] }) });
    for (const text of ['{"a":"']) for (const id of tokenizer.encode(text, { addSpecialTokens: false }).slice(1)) guided.accept(id);
    const control = allowedIds(guided).filter((id) => tokenizer.tokenBytes(id).some((b) => b < 0x20 && b !== 0x0a && b !== 0x0d));
    assert.deepEqual(control, []);
    guided.dispose();
  });

  it('a bad grammar is a GrammarError with XGrammar\'s reason, and a fresh module serves after an abort', async () => {
    const xg = await XGrammar.load();
    assert.throws(() => parseGrammar(xg, grammarSource({ kind: 'regex', pattern: '[0-9' })), (error: unknown) =>
      error instanceof GrammarError && /Unclosed/.test(error.message));
    assert.equal(xg.usable, false);
    const fresh = await XGrammar.load();
    parseGrammar(fresh, grammarSource({ kind: 'choice', choices: ['a'] }));
  });
});
