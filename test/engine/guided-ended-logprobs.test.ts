// A guided output whose grammar allows only its end while min_tokens still holds the end back ends with EOS all the
// same (docs/structured-outputs.md). That EOS is a token of the output like any other: it is in token_ids and usage,
// so it gets its logprobs entry too, one per token. It had none (sampleGuidedRow gave no logprobs for it), so the
// logprobs came out one entry short. The entry is read from the masked row with min_tokens' hold lifted: the grammar
// allows only the end there, so the end is certain.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { GrammarRuntime } from '../../src/engine/grammar/runtime.ts';
import { sampleGuidedRow } from '../../src/engine/grammar/sampling.ts';
import { createRequestSamplers, Sampler } from '../../src/engine/sampler.ts';
import { DEFAULT_SAMPLING, type GuidedDecoding, type SamplingParams, type TokenLogprob } from '../../src/engine/types.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { LLAMA_SPM_TOKENIZER_PATH } from '../../src/model/synthetic.ts';
import { createTokenizer, type Tokenizer } from '../../src/model/tokenizer/index.ts';
import { parseSse, rawRequest } from '../api/http-client.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from '../api/e2e-fixture.ts';

const E2E = { timeout: 120_000 };

describe('a guided output ended despite min_tokens: its EOS has a logprobs entry', () => {
  let tokenizer: Tokenizer;
  let runtime: GrammarRuntime;

  before(async () => {
    tokenizer = createTokenizer({ kind: 'gguf', file: readGguf(LLAMA_SPM_TOKENIZER_PATH) });
    runtime = await GrammarRuntime.create(tokenizer);
  });

  const randomStream = (seed: number) => {
    let state = seed;
    return () => (state = (state * 1103515245 + 12345) % 2147483648) / 2147483648;
  };

  /** A guided walk over random rows to the grammar's end: each token and its logprobs entry, if any. */
  function walk(spec: GuidedDecoding, params: Partial<SamplingParams>, logprobsMode: 'raw' | 'processed', seed: number) {
    const sampler = new Sampler(runtime.vocabSize, { logprobsMode });
    const sequence = createRequestSamplers({
      params: { ...DEFAULT_SAMPLING, maxTokens: 64, seed, ...params, guided: spec }, promptTokenIds: [1, 2, 3],
      vocabSize: runtime.vocabSize, eosTokenIds: tokenizer.stopTokenIds,
    })[0]!;
    const guided = runtime.open(spec);
    const next = randomStream(seed);
    const tokens: number[] = [];
    const entries: (TokenLogprob | undefined)[] = [];
    for (let t = 0; t < 64 && !guided.isTerminated; t++) {
      const row = new Float32Array(runtime.vocabSize);
      for (let k = 0; k < row.length; k++) row[k] = next() * 8;
      const sampled = sampleGuidedRow(sampler, row, sequence, guided, tokenizer.stopTokenIds);
      tokens.push(sampled.tokenId);
      entries.push(sampled.logprobs);
    }
    assert.equal(guided.isTerminated, true, 'the grammar ended');
    assert.equal(sequence.outputTokenCount, tokens.length, 'each token recorded once');
    guided.dispose();
    return { tokens, entries };
  }

  it('one entry per token, the EOS included (raw and processed, greedy and sampled, with penalties)', () => {
    const eos = tokenizer.stopTokenIds[0]!;
    const specs: GuidedDecoding[] = [{ kind: 'choice', choices: ['yes'] }, { kind: 'regex', pattern: 'a{3}' }];
    const modes: Partial<SamplingParams>[] = [
      { temperature: 0 }, { temperature: 0, frequencyPenalty: 0.5, logitBias: new Map([[eos, 2]]) }, { temperature: 1 }, { temperature: 0.6 },
      { temperature: 1, topP: 0.8 },
    ];
    for (const spec of specs) {
      for (const [m, mode] of modes.entries()) {
        for (const logprobsMode of ['raw', 'processed'] as const) {
          const what = `${JSON.stringify(spec)} ${JSON.stringify({ ...mode, logitBias: undefined })} ${logprobsMode}`;
          const without = walk(spec, { ...mode, minTokens: 20, logprobs: null }, logprobsMode, 7 + m);
          assert.equal(without.tokens.at(-1), eos, `${what}: ended by EOS`);
          assert.ok(without.tokens.length < 20, `${what}: before min_tokens`);
          for (const logprobs of [0, 3]) {
            const got = walk(spec, { ...mode, minTokens: 20, logprobs }, logprobsMode, 7 + m);
            assert.deepEqual(got.tokens, without.tokens, `${what}: logprobs ${logprobs} change no token`);
            assert.equal(got.entries.length, got.tokens.length);
            for (const [k, entry] of got.entries.entries()) {
              assert.ok(entry !== undefined, `${what} logprobs ${logprobs}: token ${k} of ${got.tokens.length} has an entry`);
              assert.equal(entry.tokenId, got.tokens[k], what);
              assert.equal(entry.top.length, logprobs, what);
              assert.ok(Number.isFinite(entry.logprob) && entry.logprob <= 0, `${what} token ${k}: ${entry.logprob}`);
            }
            // The end: the only token the grammar allows there, so certain (the others -Infinity).
            const end = got.entries.at(-1)!;
            assert.equal(end.logprob, 0, what);
            if (logprobs > 0) {
              assert.deepEqual(end.top[0], { tokenId: eos, logprob: 0 }, what);
              assert.ok(end.top.slice(1).every((alternative) => alternative.logprob === -Infinity), what);
            }
          }
        }
      }
    }
  });

  describe('through HTTP: logprobs as long as token_ids and usage, completions and chat, streamed or not', () => {
    let server: TestServer;
    let model: string;

    before(async () => {
      server = await startTestServer();
      model = server.running.api.gateway.servedModelName!;
    });
    after(async () => {
      await server?.close();
    });

    const post = (path: string, body: object) => rawRequest(server.url, { path, body: { model, ...body } });
    const chunksOf = (text: string) => parseSse(text).filter((e) => e.data !== '[DONE]').map((e) => JSON.parse(e.data));

    it('completions', E2E, async () => {
      const body = { prompt: 'Answer:', max_tokens: 10, temperature: 0, logprobs: 2, return_token_ids: true, guided_regex: 'a{3}' };
      for (const extra of [{}, { min_tokens: 5 }, { min_tokens: 5, temperature: 1, seed: 3 }]) {
        const response = await post('/v1/completions', { ...body, ...extra });
        assert.equal(response.status, 200, response.text);
        const { choices: [choice], usage } = response.json();
        assert.equal(choice.text, 'aaa');
        assert.equal(choice.finish_reason, 'stop');
        const n = choice.token_ids.length;
        assert.equal(usage.completion_tokens, n, JSON.stringify(extra));
        for (const key of ['tokens', 'token_logprobs', 'top_logprobs', 'text_offset']) {
          assert.equal(choice.logprobs[key].length, n, `${JSON.stringify(extra)}: logprobs.${key} ${JSON.stringify(choice.logprobs[key])}`);
        }
        assert.equal(choice.logprobs.tokens.at(-1), '</s>');
        assert.equal(choice.logprobs.token_logprobs.at(-1), 0);

        const stream = await post('/v1/completions', { ...body, ...extra, stream: true, stream_options: { include_usage: true } });
        assert.equal(stream.status, 200, stream.text);
        const chunks = chunksOf(stream.text);
        const ids = chunks.flatMap((c) => c.choices.flatMap((x: any) => x.token_ids ?? []));
        const tokens = chunks.flatMap((c) => c.choices.flatMap((x: any) => x.logprobs?.tokens ?? []));
        assert.deepEqual(ids, choice.token_ids);
        assert.deepEqual(tokens, choice.logprobs.tokens, `${JSON.stringify(extra)} streamed`);
        assert.equal(chunks.at(-1).usage.completion_tokens, n);
      }
      await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
    });

    it('chat', E2E, async () => {
      const body = { messages: [{ role: 'user', content: 'x' }], max_tokens: 10, temperature: 0, logprobs: true, top_logprobs: 2, guided_regex: 'a{3}' };
      for (const extra of [{}, { min_tokens: 5 }]) {
        const response = await post('/v1/chat/completions', { ...body, ...extra });
        assert.equal(response.status, 200, response.text);
        const { choices: [choice], usage } = response.json();
        assert.equal(choice.message.content, 'aaa');
        const content = choice.logprobs.content;
        assert.equal(content.length, usage.completion_tokens, `${JSON.stringify(extra)}: ${JSON.stringify(content.map((e: any) => e.token))}`);
        assert.equal(content.at(-1).token, '</s>');
        assert.equal(content.at(-1).logprob, 0);
        assert.equal(content.at(-1).top_logprobs.length, 2);

        const stream = await post('/v1/chat/completions', { ...body, ...extra, stream: true, stream_options: { include_usage: true } });
        assert.equal(stream.status, 200, stream.text);
        const chunks = chunksOf(stream.text);
        const streamed = chunks.flatMap((c) => c.choices.flatMap((x: any) => x.logprobs?.content ?? []));
        assert.deepEqual(streamed.map((e: any) => e.token), content.map((e: any) => e.token), `${JSON.stringify(extra)} streamed`);
        assert.equal(chunks.at(-1).usage.completion_tokens, streamed.length);
      }
      await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
    });
  });
});
