// The engine's grammar runtime (XGrammar WASM) on the built-in Llama 2 vocabulary: masks, advancing, refusals.

import assert from 'node:assert/strict';
import { before, describe, it } from 'node:test';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { GuidedChecker } from '../../src/api/guided.ts';
import { InvalidValueError } from '../../src/api/errors.ts';
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
    assert.equal(guided.isTerminated, false);
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

  it('maskedArgmax is the argmax of the row maskRow leaves (ties to the lowest id, forbidden tokens out, -1 when none is finite)', () => {
    const schema = JSON.stringify({ type: 'object', properties: { note: { type: 'string', maxLength: 12 }, n: { type: 'integer' } },
      required: ['note', 'n'] });
    // The states a greedy walk over random rows passes through (keys, strings with forbidden tokens, numbers, the end).
    const guided = runtime.open({ kind: 'json_schema', schema });
    let random = 7;
    const next = () => (random = (random * 1103515245 + 12345) % 2147483648) / 2147483648;
    let states = 0;
    for (; states < 60 && !guided.isTerminated; states++) {
      let walk = -1;
      for (const fill of ['random', 'ties', 'refused-only', 'empty'] as const) {
        const row = new Float32Array(runtime.vocabSize);
        for (let k = 0; k < row.length; k++) row[k] = fill === 'ties' ? Math.floor(next() * 3) : next() * 10;
        const masked = row.slice();
        guided.maskRow(masked);
        if (fill === 'refused-only' || fill === 'empty') {
          // Every allowed token at -Infinity: no argmax.
          for (let k = 0; k < row.length; k++) if (masked[k] !== -Infinity) row[k] = -Infinity;
          if (fill === 'empty') row.fill(-Infinity);
          assert.equal(guided.maskedArgmax(row), -1);
          continue;
        }
        let best = -1;
        for (let k = 0; k < masked.length; k++) if (masked[k]! !== -Infinity && (best < 0 || masked[k]! > masked[best]!)) best = k;
        assert.notEqual(best, -1);
        assert.equal(guided.maskedArgmax(row), best, `${fill} row, state ${states}`);
        if (fill === 'random') walk = best;
      }
      assert.equal(guided.accept(walk), true);
      // The ending kept by the sequence is the matcher's own.
      assert.equal(guided.isTerminated, (guided as unknown as { handle: { IsTerminated(): boolean } }).handle.IsTerminated());
    }
    assert.ok(states > 5, `only ${states} states visited`);
    guided.dispose();
  });

  it('JSON grammars never allow tokens with raw control characters (tab included)', () => {
    const guided = runtime.open({ kind: 'json_schema', schema: JSON.stringify({ type: 'object', properties: { a: { type: 'string', maxLength: 4 } }, required: ['a'] }) });
    for (const text of ['{"a":"']) for (const id of tokenizer.encode(text, { addSpecialTokens: false }).slice(1)) guided.accept(id);
    const control = allowedIds(guided).filter((id) => tokenizer.tokenBytes(id).some((b) => b < 0x20 && b !== 0x0a && b !== 0x0d));
    assert.deepEqual(control, []);
    guided.dispose();
  });

  it('forcedTokens: the forced text as vocabulary tokens, accepted, its last piece left to the model', () => {
    const text = 'the quick brown fox jumps over the lazy dog';
    const guided = runtime.open({ kind: 'choice', choices: [text, 'zebra'] });
    assert.deepEqual(guided.forcedTokens(), [], 'two choices: nothing forced yet');
    const t = tokenizer.tokenToId('t');
    const decode = (ids: number[]) => new TextDecoder().decode(Buffer.concat(ids.map((id) => tokenizer.tokenBytes(id))));
    const rest = text.slice(decode([t!]).length);
    assert.equal(guided.accept(t!), true);
    const forced = guided.forcedTokens();
    const spelled = decode(forced);
    assert.ok(forced.length >= 4 && spelled.length < rest.length && rest.startsWith(spelled), JSON.stringify(spelled));
    // The state is past them: what is allowed now continues the rest.
    const left = rest.slice(spelled.length);
    const allowed = allowedIds(guided);
    assert.ok(allowed.length > 0 && allowed.every((id) => left.startsWith(decode([id]))), JSON.stringify(allowed.map((id) => decode([id]))));
    guided.dispose();
  });

  it('bad grammars in the gateway: one instance at a time, a fresh one only per new bad grammar, none kept alive', async () => {
    setFlagsFromString('--expose-gc');
    const gc = runInNewContext('gc') as () => void;
    const checker = new GuidedChecker();
    const bad = (i: number) => ({ spec: { kind: 'regex' as const, pattern: `[${i}` }, param: 'guided_regex' });
    await checker.check({ spec: { kind: 'choice', choices: ['a'] }, param: 'guided_choice' });
    const start = XGrammar.stats();
    // The same bad grammar again and again: it aborts the instance once, then is refused from memory (the next
    // instance is only started by the next grammar to compile).
    for (let i = 0; i < 20; i++) await assert.rejects(checker.check(bad(0)), InvalidValueError);
    assert.equal(XGrammar.stats().instances - start.instances, 0);
    // Twelve different ones, all at once: one instance each (each aborts its own), started one after another.
    const results = await Promise.allSettled(Array.from({ length: 12 }, (_, i) => checker.check(bad(i + 1))));
    assert.ok(results.every((r) => r.status === 'rejected' && r.reason instanceof InvalidValueError && r.reason.param === 'guided_regex'));
    const end = XGrammar.stats();
    assert.equal(end.bundles, start.bundles, 'the bundle is evaluated and compiled once');
    assert.ok(end.instances - start.instances <= 12, `${end.instances - start.instances} instances`);
    // A good grammar still passes afterwards.
    await checker.check({ spec: { kind: 'regex', pattern: '[0-9]+' }, param: 'guided_regex' });
    // The aborted instances are garbage: after collection, no more are alive than before them (others in this
    // process, e.g. this file's runtime, are counted too) but the checker's current one.
    let live = XGrammar.stats().live;
    for (let round = 0; round < 20 && live > start.live + 1; round++) {
      gc();
      await new Promise((resolve) => setTimeout(resolve, 20));
      live = XGrammar.stats().live;
    }
    assert.ok(live <= start.live + 1, `${live} XGrammar instances alive, ${start.live} before`);
  });

  it('an abort inside a matcher call is a GrammarError and leaves the module marked unusable', async () => {
    // Its own runtime: the abort spoils the module it happens in.
    const own = await GrammarRuntime.create(tokenizer);
    const guided = own.open({ kind: 'choice', choices: ['a'] });
    for (let guard = 0; !guided.isTerminated && guard < 8; guard++) {
      const out = new Int32Array(own.vocabSize);
      const allowed = out.subarray(0, guided.allowedTokens(out));
      assert.ok(guided.accept(allowed.includes(tokenizer.eosId!) ? tokenizer.eosId! : allowed[0]!));
    }
    assert.equal(guided.isTerminated, true);
    // XGrammar aborts when asked for the forced text of a matcher that has ended.
    assert.throws(() => guided.jumpForwardString(), GrammarError);
    assert.throws(() => guided.accept(tokenizer.eosId!), /aborted earlier/);
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
