// The engine's grammar runtime (XGrammar WASM) on the built-in Llama 2 vocabulary: masks, advancing, refusals.

import assert from 'node:assert/strict';
import { before, describe, it } from 'node:test';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { GuidedChecker } from '../../src/api/guided.ts';
import { InvalidValueError } from '../../src/api/errors.ts';
import { GrammarRuntime, grammarSource, parseGrammar, type GuidedSequence } from '../../src/engine/grammar/runtime.ts';
import {
  drawGuidedToken, greedyGuidedToken, NARROW_CANDIDATES, sampleGuidedRow, topCandidates, WIDE_CANDIDATES,
} from '../../src/engine/grammar/sampling.ts';
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
   * chosen rank (0 to 40, across both candidate widths, half of them below 4) behind refused tokens, some tied with it
   * at lower ids, and rows with every allowed token at -Infinity.
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
          // Half of them among the first few ranks, where the tries' edges are (the argmax tried alone, width 2).
          const rank = Math.floor(next() * (next() < 0.5 ? 4 : 41));
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
        // The width (and whether the row's argmax is tried alone first) as the walk left it, or chosen.
        if (fill !== 'noise') {
          tried.candidateWidth = [1, NARROW_CANDIDATES, WIDE_CANDIDATES][Math.floor(next() * 3)]!;
          tried.argmaxTaken = next() < 0.5;
        }
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
      guided.argmaxTaken = tokens % 3 === 0;
      const { tokenId } = sampleGuidedRow(sampler, row, sequence, guided, tokenizer.stopTokenIds);
      assert.equal(tokenId, expected, `token ${tokens}`);
      assert.equal(sequence.outputTokenCount, tokens + 1);
      assert.equal(reference.accept(tokenId), true);
    }
    assert.ok(tokens > 20);
    guided.dispose();
    reference.dispose();
  });

  const samplerFor = (seed: number, params: Partial<typeof DEFAULT_SAMPLING> = {}, guided?: GuidedDecoding) => createRequestSamplers({
    params: { ...DEFAULT_SAMPLING, maxTokens: 256, seed, ...params, ...(guided ? { guided } : {}) }, promptTokenIds: [1, 2, 3],
    vocabSize: runtime.vocabSize, eosTokenIds: tokenizer.stopTokenIds,
  })[0]!;

  it('Sampler.weighRow + drawWeighed: the first draw is sampleRow\'s for the same stream (temperatures, penalties)', () => {
    const sampler = new Sampler(runtime.vocabSize);
    const next = randomStream(21);
    for (let trial = 0; trial < 60; trial++) {
      const params = { temperature: [0.5, 1, 1.7][trial % 3]!, ...(trial % 4 === 0 ? { frequencyPenalty: 0.5, repetitionPenalty: 1.2 } : {}) };
      const a = samplerFor(trial, params);
      const b = samplerFor(trial, params);
      for (const id of [5, 9, 5]) { a.recordOutputToken(id); b.recordOutputToken(id); }
      const row = new Float32Array(runtime.vocabSize);
      for (let k = 0; k < row.length; k++) row[k] = next() * (trial % 2 === 0 ? 8 : 30);
      if (trial % 5 === 0) for (let k = 0; k < row.length; k += 3) row[k] = -Infinity;
      const expected = sampler.sampleRow(row, a).tokenId;
      const total = sampler.weighRow(row, b);
      assert.equal(sampler.drawWeighed(total, b.nextUniform()), expected, `trial ${trial}`);
      assert.equal(b.outputTokenCount, 3, 'nothing recorded');
    }
    assert.throws(() => sampler.weighRow(new Float32Array(runtime.vocabSize), samplerFor(1, { temperature: 0 })), RangeError);
    assert.throws(() => sampler.weighRow(new Float32Array(runtime.vocabSize), samplerFor(1, { topP: 0.9 })), RangeError);
  });

  it('drawGuidedToken draws from the masked distribution, whether a try or the mask gives the token', () => {
    // One state (the start of a choice), one row: its allowed tokens at varied values, a few refused tokens above
    // them (the allowed mass about 0.4), the rest negligible. Many seeded draws, each from a fresh matcher.
    const spec: GuidedDecoding = { kind: 'choice', choices: ['alpha', 'beta', 'gamma', 'delta'] };
    const probe = runtime.open(spec);
    const allowed = allowedIds(probe);
    probe.dispose();
    const next = randomStream(8);
    const row = new Float32Array(runtime.vocabSize).fill(-30);
    for (const id of allowed) row[id] = next() * 2;
    const allowedSet = new Set(allowed);
    for (let placed = 0; placed < allowed.length / 2;) {
      const id = Math.floor(next() * runtime.vocabSize);
      if (allowedSet.has(id) || row[id] !== -30) continue;
      row[id] = 1.5;
      placed++;
    }
    const weightOf = (id: number) => Math.exp(row[id]!);
    const allowedMass = allowed.reduce((sum, id) => sum + weightOf(id), 0);
    const sampler = new Sampler(runtime.vocabSize);
    const counts = new Map<number, number>();
    const ways = { tried: 0, masked: 0 };
    const trials = 2000;
    for (let trial = 0; trial < trials; trial++) {
      const sequence = samplerFor(1000 + trial, { temperature: 1 }, spec);
      const guided = runtime.open(spec);
      guided.candidateWidth = [1, NARROW_CANDIDATES, WIDE_CANDIDATES][trial % 3]!;
      const tokenId = drawGuidedToken(sampler, row, sequence, guided);
      assert.ok(allowedSet.has(tokenId), `token ${tokenId} is not allowed`);
      if (guided.candidateWidth === WIDE_CANDIDATES) ways.tried++;
      else ways.masked++;
      counts.set(tokenId, (counts.get(tokenId) ?? 0) + 1);
      guided.dispose();
    }
    assert.ok(ways.tried > 300 && ways.masked > 300, JSON.stringify(ways));
    // Pearson's chi-square against p(x) / Z over the allowed tokens (those expected under 5 times pooled).
    let chi = 0;
    let degrees = -1;
    let pooledExpected = 0;
    let pooledObserved = 0;
    for (const id of allowed) {
      const expected = trials * weightOf(id) / allowedMass;
      const observed = counts.get(id) ?? 0;
      if (expected < 5) {
        pooledExpected += expected;
        pooledObserved += observed;
        continue;
      }
      chi += (observed - expected) ** 2 / expected;
      degrees++;
    }
    if (pooledExpected > 0) {
      chi += (pooledObserved - pooledExpected) ** 2 / pooledExpected;
      degrees++;
    }
    assert.ok(degrees >= 4, `${degrees} degrees of freedom`);
    // Far above the 1e-4 tail for these degrees of freedom (about 3 per degree plus 10) would be a wrong distribution.
    assert.ok(chi < 10 + 3 * degrees, `chi-square ${chi.toFixed(1)} with ${degrees} degrees of freedom`);
  });

  it('sampleGuidedRow on sampled rows: tokens the grammar takes, draws tried or the mask first by the state, a seed replays', () => {
    const spec: GuidedDecoding = { kind: 'json_schema', schema: BOUNDED_SCHEMA };
    const sampler = new Sampler(runtime.vocabSize);
    const walk = (seed: number) => {
      const sequence = samplerFor(seed, { temperature: 1 }, spec);
      const guided = runtime.open(spec);
      const reference = runtime.open(spec);
      const next = randomStream(seed);
      const tokens: number[] = [];
      const widths = new Set<number>();
      for (let t = 0; t < 200 && !guided.isTerminated; t++) {
        widths.add(guided.candidateWidth);
        const row = new Float32Array(runtime.vocabSize);
        for (let k = 0; k < row.length; k++) row[k] = next() * 8;
        const { tokenId } = sampleGuidedRow(sampler, row, sequence, guided, tokenizer.stopTokenIds);
        assert.equal(reference.accept(tokenId), true, `token ${t}`);
        tokens.push(tokenId);
        assert.equal(sequence.outputTokenCount, tokens.length);
      }
      assert.equal(guided.isTerminated, true, 'the bounded grammar ends');
      guided.dispose();
      reference.dispose();
      return { tokens, widths };
    };
    const first = walk(31);
    assert.deepEqual([...first.widths].sort((a, b) => a - b), [NARROW_CANDIDATES, WIDE_CANDIDATES]);
    assert.deepEqual(walk(31).tokens, first.tokens);
  });

  it('sampleGuidedRow with logprobs: the tokens of the same walk without them, and the logprobs of the masked row (raw and processed)', () => {
    const spec: GuidedDecoding = { kind: 'json_schema', schema: BOUNDED_SCHEMA };
    const modes: Partial<typeof DEFAULT_SAMPLING>[] = [
      { temperature: 0 }, { temperature: 0, repetitionPenalty: 1.3, frequencyPenalty: 0.4 }, { temperature: 1 }, { temperature: 0.6 },
      { temperature: 1, topK: runtime.vocabSize }, { temperature: 1, topP: 0.8 },
    ];
    for (const [m, mode] of modes.entries()) {
      for (const logprobsMode of ['raw', 'processed'] as const) {
        const walk = (logprobs: number | null) => {
          const sampler = new Sampler(runtime.vocabSize, { logprobsMode });
          const sequence = samplerFor(40 + m, { ...mode, logprobs }, spec);
          const guided = runtime.open(spec);
          // The reference: the row masked by a matcher kept in step, and the sampler's own logprobs of that row.
          const reference = runtime.open(spec);
          const referenceSequence = samplerFor(40 + m, { ...mode, logprobs: logprobs ?? 0 }, spec);
          const next = randomStream(90 + m);
          const tokens: number[] = [];
          for (let t = 0; t < 200 && !guided.isTerminated; t++) {
            const row = new Float32Array(runtime.vocabSize);
            for (let k = 0; k < row.length; k++) row[k] = next() * 8;
            const masked = row.slice();
            reference.maskRow(masked);
            const expected = new Sampler(runtime.vocabSize, { logprobsMode }).sampleRow(masked, referenceSequence);
            const sampled = sampleGuidedRow(sampler, row, sequence, guided, tokenizer.stopTokenIds);
            tokens.push(sampled.tokenId);
            assert.equal(reference.accept(sampled.tokenId), true, `token ${t}`);
            // The reference sequence goes on with the walk's token (its penalties count what the walk output).
            referenceSequence.unrecordOutputToken(expected.tokenId);
            referenceSequence.recordOutputToken(sampled.tokenId);
            if (logprobs === null) {
              assert.equal(sampled.logprobs, undefined);
              continue;
            }
            const entry = sampled.logprobs!;
            const what = `${JSON.stringify(mode)} ${logprobsMode} token ${t}`;
            assert.equal(entry.tokenId, sampled.tokenId, what);
            assert.deepEqual(entry.top, expected.logprobs!.top, what);
            if (mode.temperature === 0) {
              // Greedy: the same token as the sampler's pass over the masked row, so the same entry, bit for bit.
              assert.equal(sampled.tokenId, expected.tokenId, what);
              assert.deepEqual(entry, expected.logprobs, what);
            } else {
              // The normaliser from the best alternative: the walk's token weighed against the same masked row.
              const best = expected.logprobs!.top[0];
              if (best !== undefined && logprobsMode === 'raw') {
                assert.ok(Math.abs(entry.logprob - (masked[sampled.tokenId]! - (masked[best.tokenId]! - best.logprob))) < 1e-9, what);
              }
              assert.ok(Number.isFinite(entry.logprob) && entry.logprob <= 0, what);
            }
          }
          assert.equal(guided.isTerminated, true, 'the bounded grammar ends');
          guided.dispose();
          reference.dispose();
          return tokens;
        };
        const without = walk(null);
        for (const logprobs of [0, 5]) assert.deepEqual(walk(logprobs), without, `${JSON.stringify(mode)} ${logprobsMode}: logprobs ${logprobs}`);
      }
    }
  });

  it('a sampled row whose allowed tokens weigh nothing beside its max is drawn from the masked row', () => {
    const spec: GuidedDecoding = { kind: 'choice', choices: ['alpha', 'beta'] };
    const guided = runtime.open(spec);
    const allowed = allowedIds(guided);
    const row = new Float32Array(runtime.vocabSize).fill(-5000);
    row[allowed[0]! === 0 ? 1 : 0] = 1000; // refused, and 5000+ above every allowed token: exp underflows to 0
    row[allowed[allowed.length - 1]!] = -4000; // the allowed token the masked row puts all its weight on
    const sequence = samplerFor(4, { temperature: 1 }, spec);
    const { tokenId } = sampleGuidedRow(new Sampler(runtime.vocabSize), row, sequence, guided, tokenizer.stopTokenIds);
    assert.equal(tokenId, allowed[allowed.length - 1]);
    assert.equal(sequence.outputTokenCount, 1);
    guided.dispose();
  });

  it('JSON grammars never allow tokens with raw control characters (tab included) nor bytes never in UTF-8', () => {
    const guided = runtime.open({ kind: 'json_schema', schema: JSON.stringify({ type: 'object', properties: { a: { type: 'string', maxLength: 4 } }, required: ['a'] }) });
    const byteToken = (byte: number) => tokenizer.tokenToId(`<0x${byte.toString(16).toUpperCase().padStart(2, '0')}>`)!;
    for (const char of '{"a":"') assert.equal(guided.accept(byteToken(char.charCodeAt(0))), true);
    const allowed = allowedIds(guided);
    const control = allowed.filter((id) => tokenizer.tokenBytes(id).some((b) => b < 0x20 && b !== 0x0a && b !== 0x0d));
    assert.deepEqual(control, []);
    // XGrammar alone takes 0xC0, 0xC1 and 0xF5-0xF7 as lead bytes inside a string; they never occur in UTF-8.
    const neverUtf8 = (id: number) => tokenizer.tokenBytes(id).some((b) => b === 0xc0 || b === 0xc1 || b >= 0xf5);
    assert.deepEqual(allowed.filter(neverUtf8), []);
    assert.equal(guided.accept(byteToken(0xf6)), false);
    // The other lead bytes are allowed (a character of 2-4 bytes begins), 0xC2 and 0xF4 among them.
    assert.ok(allowed.includes(byteToken(0xc2)) && allowed.includes(byteToken(0xf4)));
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
