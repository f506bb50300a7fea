// The engine's grammar runtime (XGrammar WASM) on the built-in Llama 2 vocabulary: masks, advancing, refusals.

import assert from 'node:assert/strict';
import { before, describe, it } from 'node:test';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { GuidedChecker } from '../../src/api/guided.ts';
import { InvalidValueError } from '../../src/api/errors.ts';
import { GrammarRuntime, grammarSource, parseGrammar, type GuidedSequence } from '../../src/engine/grammar/runtime.ts';
import { greedyGuidedToken, NARROW_CANDIDATES, sampleGuidedRow, topCandidates, WIDE_CANDIDATES } from '../../src/engine/grammar/sampling.ts';
import { createRequestSamplers, Sampler } from '../../src/engine/sampler.ts';
import { DEFAULT_SAMPLING, type GuidedDecoding } from '../../src/engine/types.ts';
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

  /** A seeded stream of floats in [0, 1). */
  const randomStream = (seed: number) => {
    let state = seed;
    return () => (state = (state * 1103515245 + 12345) % 2147483648) / 2147483648;
  };

  const BOUNDED_SCHEMA = JSON.stringify({
    type: 'object',
    properties: {
      name: { type: 'string', maxLength: 16 }, age: { type: 'integer', minimum: 0, maximum: 120 },
      tags: { type: 'array', items: { type: 'string', maxLength: 8 }, maxItems: 4 }, color: { enum: ['red', 'green', 'blue'] },
    },
    required: ['name', 'age', 'tags', 'color'], additionalProperties: false,
  });

  it('a refused token leaves the matcher as it was: the same mask and forced text after it (JSON, all kinds of states)', () => {
    const guided = runtime.open({ kind: 'json_schema', schema: BOUNDED_SCHEMA });
    const next = randomStream(11);
    let states = 0;
    let refusals = 0;
    for (; states < 80 && !guided.isTerminated; states++) {
      const before = allowedIds(guided);
      const forcedBefore = guided.jumpForwardString();
      const allowed = new Set(before);
      for (let tries = 0; tries < 12; tries++) {
        const id = Math.floor(next() * runtime.vocabSize);
        if (allowed.has(id)) continue;
        assert.equal(guided.accept(id), false);
        refusals++;
      }
      assert.deepEqual(allowedIds(guided), before, `state ${states}`);
      assert.equal(guided.jumpForwardString(), forcedBefore);
      // On along a random allowed token (mostly the short ones, so strings fill up and close).
      assert.equal(guided.accept(before[Math.floor(next() * Math.min(before.length, 64))]!), true);
    }
    assert.ok(states > 20 && refusals > 200, `${states} states, ${refusals} refusals`);
    guided.dispose();
  });

  it('topCandidates: the k best finite values, best first, ties to the lower id; NaN throws', () => {
    const next = randomStream(5);
    const ids = new Int32Array(WIDE_CANDIDATES);
    const values = new Float32Array(WIDE_CANDIDATES);
    for (let trial = 0; trial < 200; trial++) {
      const n = 1 + Math.floor(next() * 300);
      const row = new Float32Array(n);
      for (let i = 0; i < n; i++) row[i] = next() < 0.2 ? -Infinity : Math.floor(next() * (trial % 2 === 0 ? 4 : 1000));
      const k = 1 + Math.floor(next() * WIDE_CANDIDATES);
      const expected = Array.from(row.keys()).filter((i) => row[i] !== -Infinity)
        .sort((a, b) => row[b]! - row[a]! || a - b).slice(0, k);
      const count = topCandidates(row, k, ids, values);
      assert.deepEqual(Array.from(ids.subarray(0, count)), expected, `trial ${trial}`);
    }
    assert.throws(() => topCandidates(Float32Array.of(1, 2, NaN, 0, 5), 2, ids, values), /NaN at token id 2/);
  });

  /**
   * Two matchers of one spec walked in step: on each row the reference takes the argmax of the row maskRow leaves,
   * the other greedyGuidedToken; they must agree on every row. Rows: noise, rows whose masked argmax is planted at a
   * chosen rank (0 to 40, across both candidate widths) behind refused tokens, some tied with it at lower ids, and
   * rows with every allowed token at -Infinity.
   */
  const compareGreedy = (spec: GuidedDecoding, seed: number, maxStates: number) => {
    const reference = runtime.open(spec);
    const tried = runtime.open(spec);
    const next = randomStream(seed);
    const outcome = { states: 0, hits: 0, masks: 0, none: 0 };
    const maskedArgmaxOf = (guided: GuidedSequence, row: Float32Array): number => {
      const masked = row.slice();
      guided.maskRow(masked);
      let best = -1;
      for (let k = 0; k < masked.length; k++) if (masked[k]! !== -Infinity && (best < 0 || masked[k]! > masked[best]!)) best = k;
      return best;
    };
    for (; outcome.states < maxStates && !reference.isTerminated; outcome.states++) {
      const allowed = allowedIds(reference);
      assert.deepEqual(allowedIds(tried), allowed, 'the two matchers are in the same state');
      const allowedSet = new Set(allowed);
      // First a row with every allowed token at -Infinity (nothing taken, nothing advanced), then one that advances.
      const kinds = ['noise', 'planted', 'planted-ties'] as const;
      for (const fill of ['none-finite', kinds[Math.floor(next() * kinds.length)]!]) {
        const row = new Float32Array(runtime.vocabSize);
        for (let k = 0; k < row.length; k++) row[k] = next() * 8;
        if (fill === 'planted' || fill === 'planted-ties') {
          const target = allowed[Math.floor(next() * allowed.length)]!;
          const rank = Math.floor(next() * 41);
          row[target] = 20;
          for (let placed = 0; placed < rank;) {
            const id = Math.floor(next() * runtime.vocabSize);
            if (allowedSet.has(id) || row[id]! >= 20) continue;
            // A tie with the target only where the lower id wins it, so the target stays the masked argmax.
            row[id] = fill === 'planted-ties' && id > target ? 20 : 20 + 1 + Math.floor(next() * 8);
            placed++;
          }
        }
        if (fill === 'none-finite') for (const id of allowed) row[id] = -Infinity;
        const expected = maskedArgmaxOf(reference, row);
        // The width as the walk left it, or a chosen one.
        if (fill !== 'noise') tried.candidateWidth = [1, NARROW_CANDIDATES, WIDE_CANDIDATES][Math.floor(next() * 3)]!;
        const masksBefore = counted.masks;
        const got = greedyGuidedToken(row, tried);
        assert.equal(got, expected, `${fill} row, state ${outcome.states}`);
        if (fill === 'none-finite') {
          assert.equal(got, -1);
          outcome.none++;
          continue;
        }
        if (counted.masks === masksBefore) outcome.hits++;
        else outcome.masks++;
        // The tried matcher advanced; so does the reference (and the next rows see the state after it).
        assert.equal(reference.accept(got), true);
      }
    }
    reference.dispose();
    tried.dispose();
    return outcome;
  };
  /** Masks computed by greedyGuidedToken's matchers (counted by wrapping maskedArgmax on the prototype). */
  const counted = { masks: 0 };

  it('greedyGuidedToken is the masked argmax: candidates tried before the mask give the same token as the mask', () => {
    const proto = Object.getPrototypeOf(runtime.open({ kind: 'choice', choices: ['x'] })) as GuidedSequence;
    const maskedArgmax = proto.maskedArgmax;
    proto.maskedArgmax = function (this: GuidedSequence, row: Float32Array) {
      counted.masks++;
      return maskedArgmax.call(this, row);
    };
    try {
      const total = { states: 0, hits: 0, masks: 0, none: 0 };
      const specs: GuidedDecoding[] = [
        { kind: 'json_schema', schema: BOUNDED_SCHEMA },
        { kind: 'json_schema', schema: BOUNDED_SCHEMA, compact: true },
        { kind: 'json_object' },
        { kind: 'regex', pattern: '[a-z]{1,12}@[a-z]{2,8}\\.(com|org)' },
        { kind: 'choice', choices: ['alpha', 'beta', 'gamma delta'] },
      ];
      specs.forEach((spec, i) => {
        const outcome = compareGreedy(spec, 100 + i, 80);
        for (const key of Object.keys(total) as (keyof typeof total)[]) total[key] += outcome[key];
      });
      // Both ways to the token were taken, many times each.
      assert.ok(total.states > 150 && total.hits > 40 && total.masks > 40, JSON.stringify(total));
    } finally {
      proto.maskedArgmax = maskedArgmax;
    }
  });

  it('sampleGuidedRow on a greedy row: the masked argmax, recorded once in the sequence, for any candidate width', () => {
    const spec: GuidedDecoding = { kind: 'json_schema', schema: BOUNDED_SCHEMA };
    const sampler = new Sampler(runtime.vocabSize);
    const sequence = createRequestSamplers({
      params: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens: 256, guided: spec }, promptTokenIds: [1],
      vocabSize: runtime.vocabSize, eosTokenIds: tokenizer.stopTokenIds,
    })[0]!;
    const guided = runtime.open(spec);
    const reference = runtime.open(spec);
    const next = randomStream(3);
    let tokens = 0;
    for (; tokens < 120 && !guided.isTerminated; tokens++) {
      const row = new Float32Array(runtime.vocabSize);
      for (let k = 0; k < row.length; k++) row[k] = next() * 8;
      const expected = reference.maskedArgmax(row);
      guided.candidateWidth = 1 + (tokens % WIDE_CANDIDATES);
      const { tokenId } = sampleGuidedRow(sampler, row, sequence, guided, tokenizer.stopTokenIds);
      assert.equal(tokenId, expected, `token ${tokens}`);
      assert.equal(sequence.outputTokenCount, tokens + 1);
      assert.equal(reference.accept(tokenId), true);
    }
    assert.ok(tokens > 20);
    guided.dispose();
    reference.dispose();
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
