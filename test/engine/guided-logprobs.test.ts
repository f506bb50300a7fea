// Logprobs describe a guided request's output and never change it: the same tokens with logprobs 0 or 5, or a top_k
// of the vocabulary's size (which truncates nothing), as without, greedy and seeded, for every kind of grammar, a
// request alone or batched beside others. Jump-forward (text the grammar forces, appended unsampled) is off unless
// the engine is told to use it. A small synthetic model (Llama 2 vocabulary, noise text).

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { GrammarRuntime } from '../../src/engine/grammar/runtime.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type GuidedDecoding, type SamplingParams, type TokenLogprob } from '../../src/engine/types.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { createTokenizer, type Tokenizer } from '../../src/model/tokenizer/index.ts';
import { engineBackends } from '../helpers/backends.ts';
import { PERSON_SCHEMA } from '../api/guided-fixtures.ts';

const SPEC = {
  name: 'guided-logprobs-synthetic', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 512,
  dtype: 'Q8_0' as const, seed: 11, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
};

const GRAMMARS: Record<string, GuidedDecoding> = {
  json_schema: { kind: 'json_schema', schema: JSON.stringify(PERSON_SCHEMA) },
  json_compact: { kind: 'json_schema', schema: JSON.stringify(PERSON_SCHEMA), compact: true },
  // A tool call's grammar under tool_choice "required": an array of {"name", "parameters"} items.
  tool_call: {
    kind: 'json_schema', schema: JSON.stringify({
      type: 'array', minItems: 1, maxItems: 1, items: {
        type: 'object', required: ['name', 'parameters'], additionalProperties: false,
        properties: { name: { enum: ['get_weather'] }, parameters: { type: 'object', required: ['city'], additionalProperties: false, properties: { city: { type: 'string', maxLength: 10 } } } },
      },
    }),
  },
  regex: { kind: 'regex', pattern: '[a-z ]{5,30}\\.' },
  choice: { kind: 'choice', choices: ['red apple', 'green pear', 'blue berry', 'yellow banana'] },
  grammar: { kind: 'grammar', ebnf: 'root ::= "answer: " ("yes" | "no" | [a-z]{2,6}) "!"' },
};

/** Greedy, greedy with a penalty (drawn from the processed row), plain sampling at two temperatures, top_p. */
const MODES: Record<string, Partial<SamplingParams>> = {
  greedy: { temperature: 0 },
  greedy_penalised: { temperature: 0, repetitionPenalty: 1.3 },
  sampled: { temperature: 1, seed: 3 },
  sampled_cool: { temperature: 0.7, seed: 4 },
  top_p: { temperature: 1, seed: 5, topP: 0.9 },
};

interface Completion { tokens: number[]; logprobs: TokenLogprob[]; finish?: string }

describe('guided decoding: logprobs never change the tokens', () => {
  let dir: string;
  let loaded: LoadedModel;
  let tokenizer: Tokenizer;
  let grammar: GrammarRuntime;
  let vocabSize: number;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-guided-logprobs-'));
    writeSyntheticModel(SPEC, join(dir, 'model.gguf'));
    loaded = await loadModel(join(dir, 'model.gguf'));
    tokenizer = createTokenizer(loaded.tokenizerSource);
    vocabSize = loaded.config.vocabSize;
    grammar = await GrammarRuntime.create(tokenizer, vocabSize);
  });
  after(() => {
    rmSync(dir, { recursive: true, force: true });
  });

  /** Runs the requests together in one engine (all added at once); each one's tokens and logprobs by id. */
  function run(requests: { id: string; sampling: Partial<SamplingParams> }[], options: { jumpForward?: boolean } = {}) {
    const runner = engineBackends().at(-1)!.load(loaded.config, loaded.weights, { numBlocks: 1024, blockSize: 16, dtype: 'f32' }, { threads: 1 });
    let clock = 0;
    const core = new EngineCore({
      backend: runner, tokenizer, maxNumSeqs: 128, maxNumBatchedTokens: 512, maxModelLen: SPEC.contextLength,
      now: () => clock++, grammar: () => grammar, ...(options.jumpForward !== undefined ? { jumpForward: options.jumpForward } : {}),
    });
    const prompt = tokenizer.encode('Answer:');
    for (const { id, sampling } of requests) {
      core.add({ id, promptTokenIds: prompt, priority: 0, arrivalMs: 0, sampling: { ...DEFAULT_SAMPLING, maxTokens: 60, ...sampling } });
    }
    const results = new Map<string, Completion>(requests.map(({ id }) => [id, { tokens: [], logprobs: [] }]));
    for (let steps = 0; core.hasWork; steps++) {
      assert.ok(steps < 2000, 'the engine did not finish');
      for (const output of core.step() as EngineOutput[]) {
        const result = results.get(output.requestId)!;
        assert.equal(output.error, undefined, `${output.requestId}: ${output.error}`);
        result.tokens.push(...output.newTokenIds);
        result.logprobs.push(...output.logprobs ?? []);
        result.finish = output.finishReason ?? result.finish;
      }
    }
    assert.equal(core.kv.pool.numUsedBlocks, 0);
    const forced = core.forcedTokens;
    runner.dispose();
    return { results, forced };
  }

  /** Each grammar under each mode, without logprobs and with each variant that must not change the tokens. */
  function cases() {
    const variants: Record<string, Partial<SamplingParams>> = {
      plain: {}, logprobs0: { logprobs: 0 }, logprobs5: { logprobs: 5 }, topKVocab: { topK: vocabSize },
      topKVocabLogprobs: { topK: vocabSize, logprobs: 1 },
    };
    const list: { id: string; key: string; sampling: Partial<SamplingParams> }[] = [];
    for (const [kind, guided] of Object.entries(GRAMMARS)) {
      for (const [mode, sampling] of Object.entries(MODES)) {
        for (const [variant, extra] of Object.entries(variants)) {
          list.push({ id: `${kind}/${mode}/${variant}`, key: `${kind}/${mode}`, sampling: { ...sampling, ...extra, guided } });
        }
      }
    }
    return list;
  }

  /** Every variant's tokens are its plain request's; the logprobs are there, one per token, of the masked row. */
  function assertSameTokens(list: ReturnType<typeof cases>, results: Map<string, Completion>) {
    for (const { id, key, sampling } of list) {
      const mode = MODES[key.split('/')[1]!]!;
      const plain = results.get(`${key}/plain`)!;
      const got = results.get(id)!;
      assert.ok(plain.tokens.length > 1, `${key}: ${plain.tokens.length} tokens`);
      assert.deepEqual(got.tokens, plain.tokens, `${id}: "${tokenizer.decode(got.tokens)}" vs "${tokenizer.decode(plain.tokens)}"`);
      assert.equal(got.finish, plain.finish, id);
      if (sampling.logprobs === undefined || sampling.logprobs === null) {
        assert.equal(got.logprobs.length, 0, id);
        continue;
      }
      assert.equal(got.logprobs.length, got.tokens.length, `${id}: a logprobs entry per token`);
      for (const [k, entry] of got.logprobs.entries()) {
        assert.equal(entry.tokenId, got.tokens[k], id);
        assert.ok(Number.isFinite(entry.logprob) && entry.logprob <= 0, `${id} token ${k}: logprob ${entry.logprob}`);
        assert.equal(entry.top.length, Math.min(sampling.logprobs, vocabSize), id);
        // The masked row's: greedy takes its best token (on this noise model the unmasked row's best is almost never
        // allowed), and its alternatives are allowed tokens or -Infinity.
        if (mode.temperature === 0 && mode.repetitionPenalty === undefined && entry.top.length > 0) {
          assert.equal(entry.top[0]!.tokenId, entry.tokenId, `${id} token ${k}: the masked row's argmax`);
        }
      }
    }
  }

  it('each request alone: the same tokens with logprobs 0 or 5 and with top_k of the vocabulary size', () => {
    const list = cases();
    const results = new Map<string, Completion>();
    for (const request of list) results.set(request.id, run([request]).results.get(request.id)!);
    assertSameTokens(list, results);
  });

  it('batched, beside each other and unguided requests: the same tokens', () => {
    const list = cases();
    const unguided = [0, 1, 2].map((i) => ({ id: `unguided/${i}`, sampling: { temperature: i === 0 ? 0 : 1, seed: i, ...(i === 2 ? { logprobs: 2 } : {}) } }));
    const { results } = run([...unguided, ...list]);
    assertSameTokens(list, results);
  });

  it('min_tokens beyond the only choice: the grammar ends the output with EOS all the same, with or without logprobs', () => {
    const guided: GuidedDecoding = { kind: 'choice', choices: ['yes'] };
    const list = [{ temperature: 0 }, { temperature: 1, seed: 2 }].flatMap((mode, m) => [null, 0, 3].map((logprobs) => ({
      id: `${m}/${logprobs}`, sampling: { ...mode, minTokens: 20, logprobs, guided },
    })));
    const { results } = run(list);
    for (const { id } of list) {
      const got = results.get(id)!;
      const plain = results.get(`${id.split('/')[0]}/null`)!;
      assert.deepEqual(got.tokens, plain.tokens, id);
      assert.equal(tokenizer.decode(got.tokens.filter((t) => !tokenizer.stopTokenIds.includes(t))), 'yes', id);
      assert.equal(got.finish, 'stop', id);
    }
  });

  it('jump-forward is off unless asked for; on, it appends forced tokens to requests without logprobs only', () => {
    const choice: GuidedDecoding = { kind: 'choice', choices: ['the quick brown fox jumps over the lazy dog'] };
    const requests = [
      { id: 'greedy', sampling: { temperature: 0, guided: choice } },
      { id: 'greedy-logprobs', sampling: { temperature: 0, logprobs: 0, guided: choice } },
      { id: 'json', sampling: { temperature: 1, seed: 7, guided: GRAMMARS.json_compact! } },
    ];
    const byDefault = run(requests);
    assert.equal(byDefault.forced, 0, 'nothing forced by default');
    assert.equal(run(requests, { jumpForward: false }).forced, 0);
    const jumped = run(requests, { jumpForward: true });
    assert.ok(jumped.forced > 5, `${jumped.forced} tokens forced`);
    // The forced text spells the same choice; the request with logprobs is decoded token by token as without it.
    assert.equal(tokenizer.decode(jumped.results.get('greedy')!.tokens), tokenizer.decode(byDefault.results.get('greedy')!.tokens));
    assert.deepEqual(jumped.results.get('greedy-logprobs')!.tokens, byDefault.results.get('greedy-logprobs')!.tokens);
    assert.deepEqual(byDefault.results.get('greedy-logprobs')!.tokens, byDefault.results.get('greedy')!.tokens);
  });
});
