// Prompt logprobs over HTTP with the official openai client: completions' echo with logprobs (what evaluation
// harnesses send to score a text), vLLM's prompt_logprobs on completions and chat, and the refusals; then
// lm-evaluation-harness's loglikelihood requests as it sends them, with vLLM's /tokenizer_info; then text_offset over
// characters outside the Basic Multilingual Plane, which count one each as in vLLM (Python), not two (UTF-16).

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import OpenAI, { BadRequestError } from 'openai';
import { loadModel } from '../../src/model/loader.ts';
import { ReferenceModel } from '../../src/model/reference-forward.ts';
import { tinySyntheticModel } from '../helpers/cpu-model.ts';
import { skipUnlessShared, writeSharedVocabModel } from '../helpers/shared-models.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

/** A hang guard, not a speed requirement. */
const E2E = { timeout: 90_000 };

type PromptLogprobs = (Record<string, { logprob: number; rank: number; decoded_token: string }> | null)[];

describe('prompt logprobs over HTTP', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;

  before(async () => {
    server = await startTestServer();
    client = new OpenAI({ apiKey: 'none', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
    model = server.running.api.gateway.servedModelName!;
  });

  after(async () => {
    await server?.close();
  });

  const tokenize = async (prompt: string): Promise<number[]> => {
    const res = await fetch(`${server.url}/tokenize`, { method: 'POST', body: JSON.stringify({ model, prompt }) });
    return ((await res.json()) as { tokens: number[] }).tokens;
  };

  it('echo with logprobs lists the prompt\'s tokens first, the first without a logprob, offsets running on', E2E, async () => {
    const prompt = 'The lighthouse keeper counted the ships';
    const ids = await tokenize(prompt);
    const res = await client.completions.create({ model, prompt, max_tokens: 3, temperature: 0, echo: true, logprobs: 2 });
    const choice = res.choices[0]!;
    const logprobs = choice.logprobs!;
    assert.ok(choice.text.startsWith(prompt), 'the text is the prompt, then the completion');
    assert.equal(logprobs.tokens!.length, ids.length + res.usage!.completion_tokens);
    assert.equal(logprobs.token_logprobs![0], null);
    assert.equal(logprobs.top_logprobs![0], null);
    for (let i = 1; i < logprobs.tokens!.length; i++) {
      const value = logprobs.token_logprobs![i]!;
      assert.ok(Number.isFinite(value) && value <= 0, `token ${i}`);
      const top = logprobs.top_logprobs![i]!;
      assert.equal(top[logprobs.tokens![i]!], value, `token ${i} is listed with its alternatives`);
      assert.ok(Object.keys(top).length >= 2 && Object.keys(top).length <= 3, `token ${i}: 2 alternatives and itself`);
      assert.equal(logprobs.text_offset![i], logprobs.text_offset![i - 1]! + [...logprobs.tokens![i - 1]!].length, `offset ${i}`);
    }
    assert.equal(logprobs.text_offset![0], 0);
  });

  it('a generated token\'s logprob equals its logprob as a prompt token (decode and prefill agree)', E2E, async () => {
    const prompt = 'A small boat crossed the bay';
    const ids = await tokenize(prompt);
    const generated = await client.completions.create({ model, prompt: ids, max_tokens: 2, temperature: 0, logprobs: 0 });
    const genIds = await tokenize(prompt + generated.choices[0]!.text);
    // The generated text tokenizes back to the generated ids (checked, or the comparison would mean nothing).
    assert.equal(genIds.length, ids.length + 2, 'the completion retokenizes to two tokens');
    assert.deepEqual(genIds.slice(0, ids.length), ids);
    const sampled = generated.choices[0]!.logprobs!.token_logprobs!;
    const scored = await client.completions.create({
      model, prompt: [...ids, ...genIds.slice(ids.length)], max_tokens: 1, temperature: 0, echo: true, logprobs: 0,
    });
    const echoed = scored.choices[0]!.logprobs!.token_logprobs!;
    sampled.forEach((value, k) => {
      assert.ok(Math.abs(echoed[ids.length + k]! - value!) < 1e-3, `generated token ${k}: ${echoed[ids.length + k]} vs ${value}`);
    });
    // Token-id prompts echo the same way: one entry per id.
    assert.equal(scored.choices[0]!.logprobs!.tokens!.length, genIds.length + 1);
  });

  it('prompt_logprobs on completions: per choice, the alternatives ranked, the prompt token with its rank', E2E, async () => {
    const prompt = 'Rain fell on the quiet town';
    const ids = await tokenize(prompt);
    const res = await client.completions.create({
      model, prompt: [prompt, prompt], n: 2, max_tokens: 2, temperature: 0, prompt_logprobs: 3,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    const echo = await client.completions.create({ model, prompt, max_tokens: 1, temperature: 0, echo: true, logprobs: 3 });
    assert.equal(res.choices.length, 4);
    for (const choice of res.choices) {
      const entries = (choice as unknown as { prompt_logprobs: PromptLogprobs }).prompt_logprobs;
      assert.equal(entries.length, ids.length);
      assert.equal(entries[0], null);
      entries.slice(1).forEach((entry, k) => {
        const p = k + 1;
        const mine = entry![String(ids[p])]!;
        assert.ok(mine.rank >= 1, `position ${p}`);
        // The same value echo shows for the token.
        assert.equal(mine.logprob, echo.choices[0]!.logprobs!.token_logprobs![p], `position ${p}`);
        // Ranks 1, 2, 3 (the prompt token may be one of them), better ranks at higher logprobs.
        const byRank = Object.values(entry!).sort((a, b) => a.rank - b.rank);
        assert.deepEqual(byRank.slice(0, 3).map((v) => v.rank), [1, 2, 3], `position ${p}`);
        byRank.forEach((v, r) => { if (r > 0) assert.ok(v.logprob <= byRank[r - 1]!.logprob, `position ${p}: ranked best first`); });
        assert.equal(typeof mine.decoded_token, 'string');
      });
    }
  });

  it('prompt_logprobs on chat: one list for the rendered prompt, at the top of the response', E2E, async () => {
    const res = await client.chat.completions.create({
      model, messages: [{ role: 'user', content: 'Name a colour.' }], max_tokens: 2, prompt_logprobs: 0,
    } as OpenAI.ChatCompletionCreateParamsNonStreaming);
    const entries = (res as unknown as { prompt_logprobs: PromptLogprobs }).prompt_logprobs;
    assert.equal(entries.length, res.usage!.prompt_tokens);
    assert.equal(entries[0], null);
    assert.ok(entries.slice(1).every((entry) => entry !== null && Object.keys(entry).length === 1));
  });

  it('echo with max_tokens 0 (the legacy scoring request): the prompt alone with its logprobs, no completion tokens', E2E, async () => {
    const prompt = 'Wind over the dunes';
    const ids = await tokenize(prompt);
    const body = { model, prompt, max_tokens: 0, temperature: 0, echo: true, logprobs: 1 };
    // The metrics (and the tenant's tokens) count no generated token either: the one computed is never shown.
    const generated = async () => (await (await fetch(`${server.url}/metrics`)).text()).split('\n')
      .filter((line) => line.startsWith('conduit_request_generation_tokens_total{')).reduce((sum, line) => sum + Number(line.split(' ').at(-1)), 0);
    const generatedBefore = await generated();
    const whole = await client.completions.create(body);
    assert.equal(await generated(), generatedBefore);
    const choice = whole.choices[0]!;
    assert.equal(choice.text, prompt);
    assert.equal(choice.logprobs!.tokens!.length, ids.length);
    assert.equal(choice.logprobs!.token_logprobs![0], null);
    assert.deepEqual(whole.usage, { ...whole.usage, prompt_tokens: ids.length, completion_tokens: 0, total_tokens: ids.length });
    // The same values as a request that also generates.
    const longer = await client.completions.create({ ...body, max_tokens: 2 });
    assert.deepEqual(choice.logprobs!.token_logprobs, longer.choices[0]!.logprobs!.token_logprobs!.slice(0, ids.length));
    const stream = await client.completions.create({ ...body, stream: true, stream_options: { include_usage: true } });
    let text = '';
    let tokens = 0;
    let usage: OpenAI.CompletionUsage | undefined;
    for await (const chunk of stream) {
      text += chunk.choices[0]?.text ?? '';
      tokens += chunk.choices[0]?.logprobs?.tokens?.length ?? 0;
      usage = chunk.usage ?? usage;
    }
    assert.equal(text, prompt);
    assert.equal(tokens, ids.length);
    assert.equal(usage!.completion_tokens, 0);
    await assert.rejects(client.completions.create({ model, prompt, max_tokens: 0 }),
      (error: unknown) => error instanceof BadRequestError && (error.error as { param?: string }).param === 'max_tokens');
  });

  it('return_tokens_as_token_ids names every listed token by its id: the prompt\'s ids, then the completion\'s text\'s', E2E, async () => {
    const prompt = 'Lanterns along the quay';
    const ids = await tokenize(prompt);
    const res = await client.completions.create({
      model, prompt, max_tokens: 4, temperature: 0, echo: true, logprobs: 2, return_tokens_as_token_ids: true,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    const logprobs = res.choices[0]!.logprobs!;
    const listed = logprobs.tokens!.map((token) => {
      assert.match(token, /^token_id:\d+$/);
      return Number(token.slice('token_id:'.length));
    });
    assert.deepEqual(listed.slice(0, ids.length), ids);
    const detokenized = await fetch(`${server.url}/detokenize`, { method: 'POST', body: JSON.stringify({ model, tokens: listed.slice(ids.length) }) });
    assert.equal(prompt + ((await detokenized.json()) as { prompt: string }).prompt, res.choices[0]!.text);
    assert.ok(logprobs.top_logprobs!.slice(1).every((top) => Object.keys(top!).every((key) => /^token_id:\d+$/.test(key))));
    const chat = await client.chat.completions.create({
      model, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2, logprobs: true, top_logprobs: 1, return_tokens_as_token_ids: true,
    } as OpenAI.ChatCompletionCreateParamsNonStreaming);
    for (const entry of chat.choices[0]!.logprobs!.content!) {
      assert.match(entry.token, /^token_id:\d+$/);
      assert.deepEqual(entry.bytes, [...Buffer.from(entry.token)]);
    }
  });

  it('streamed echo with logprobs carries the same prompt and tokens as the body', E2E, async () => {
    const body = { model, prompt: 'Snow on the hills', max_tokens: 4, temperature: 0, echo: true, logprobs: 1 };
    const whole = await client.completions.create(body);
    const stream = await client.completions.create({ ...body, stream: true });
    let text = '';
    const tokens: string[] = [];
    const values: (number | null)[] = [];
    for await (const chunk of stream) {
      text += chunk.choices[0]?.text ?? '';
      tokens.push(...(chunk.choices[0]?.logprobs?.tokens ?? []));
      values.push(...(chunk.choices[0]?.logprobs?.token_logprobs ?? []));
    }
    assert.equal(text, whole.choices[0]!.text);
    assert.deepEqual(tokens, whole.choices[0]!.logprobs!.tokens);
    assert.deepEqual(values, whole.choices[0]!.logprobs!.token_logprobs);
  });

  it('refuses prompt_logprobs with stream and beyond 20, and stays up with nothing held', E2E, async () => {
    for (const extra of [{ prompt_logprobs: 1, stream: true }, { prompt_logprobs: 21 }, { prompt_logprobs: -1 }]) {
      await assert.rejects(client.completions.create({ model, prompt: 'x', max_tokens: 1, ...extra } as OpenAI.CompletionCreateParamsNonStreaming),
        (error: unknown) => error instanceof BadRequestError && (error.error as { param?: string }).param === 'prompt_logprobs');
    }
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
    const ok = await client.completions.create({ model, prompt: 'x', max_tokens: 1, prompt_logprobs: 0 } as OpenAI.CompletionCreateParamsNonStreaming);
    assert.equal(ok.choices.length, 1);
  });
});

/**
 * lm-evaluation-harness's `local-completions` model as it scores a continuation (its loglikelihood requests): the
 * remote tokenizer's probe (GET /tokenizer_info, then /tokenize), context and continuation tokenized without special
 * tokens, one completions request with the token ids, echo, logprobs 1, max_tokens 1 and temperature 0, then the
 * sum of token_logprobs[ctxlen:-1] and whether each of those tokens was the best. Checked against the reference
 * forward pass over the same weights.
 */
describe('loglikelihood requests as lm-evaluation-harness sends them', () => {
  let server: TestServer;
  const modelPath = tinySyntheticModel();

  before(async () => {
    server = await startTestServer({ flags: ['--model', modelPath, '--enable-tokenizer-info-endpoint'] });
  });

  after(async () => {
    await server?.close();
  });

  const post = async <T>(path: string, body: object): Promise<T> => {
    const res = await fetch(`${server.url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
    assert.equal(res.status, 200, path);
    return await res.json() as T;
  };

  it('probes the tokenizer, scores a continuation, and gets the reference forward pass\'s sum', E2E, async () => {
    const info = await (await fetch(`${server.url}/tokenizer_info`)).json() as Record<string, unknown>;
    assert.equal(info.eos_token, '</s>');
    assert.equal(info.bos_token, '<s>');
    assert.equal(info.add_bos_token, true);
    assert.equal(typeof info.model_max_length, 'number');
    const tokenize = async (prompt: string) => (await post<{ tokens: number[] }>('/tokenize', { prompt, add_special_tokens: false })).tokens;
    const context = await tokenize('The old mill by the river');
    const continuation = await tokenize(' turned all night');
    assert.ok(context.length > 1 && continuation.length > 1);
    const ids = [...context, ...continuation];
    type Body = { choices: { logprobs: { token_logprobs: number[]; top_logprobs: Record<string, number>[] } }[] };
    const res = await post<Body>('/v1/completions', { prompt: [ids], temperature: 0, max_tokens: 1, logprobs: 1, seed: 1234, echo: true });
    const { token_logprobs: values, top_logprobs: tops } = res.choices[0]!.logprobs;
    assert.equal(values.length, ids.length + 1, 'every prompt token, then the one generated');
    const ctxlen = context.length;
    const score = values.slice(ctxlen, -1).reduce((sum, v) => sum + v, 0);
    const greedy = values.slice(ctxlen, -1).every((v, i) => v === Math.max(...Object.values(tops[ctxlen + i]!)));

    const { config, weights } = await loadModel(modelPath);
    const reference = new ReferenceModel(config, weights);
    const logits = reference.forward(ids, 0, { allLogits: true });
    let expected = 0;
    let expectedGreedy = true;
    for (let p = ctxlen; p < ids.length; p++) {
      const row = logits.subarray((p - 1) * config.vocabSize, p * config.vocabSize);
      let max = -Infinity;
      for (const x of row) max = Math.max(max, x);
      let sum = 0;
      for (const x of row) sum += Math.exp(x - max);
      expected += row[ids[p]!]! - max - Math.log(sum);
      if (row[ids[p]!]! < max) expectedGreedy = false;
    }
    // Q8_0 weights: the reference dequantizes them, the native kernels multiply 8-bit activations (0.003 per token here).
    assert.ok(Math.abs(score - expected) < 0.01 * continuation.length, `sum ${score} vs the reference's ${expected}`);
    assert.equal(greedy, expectedGreedy);
  });

  it('--return-tokens-as-token-ids makes it the default, and a request may still ask for texts', E2E, async () => {
    const ids = await startTestServer({ flags: ['--return-tokens-as-token-ids'] });
    try {
      const ask = async (extra: object) => {
        const res = await fetch(`${ids.url}/v1/completions`, {
          method: 'POST', headers: { 'content-type': 'application/json' },
          body: JSON.stringify({ prompt: 'Gulls', max_tokens: 2, temperature: 0, logprobs: 0, ...extra }),
        });
        return ((await res.json()) as { choices: { logprobs: { tokens: string[] } }[] }).choices[0]!.logprobs.tokens;
      };
      assert.ok((await ask({})).every((token) => /^token_id:\d+$/.test(token)));
      assert.ok((await ask({ return_tokens_as_token_ids: false })).every((token) => !token.startsWith('token_id:')));
    } finally {
      await ids.close();
    }
  });

  it('without --enable-tokenizer-info-endpoint there is no /tokenizer_info, as in vLLM', E2E, async () => {
    const plain = await startTestServer();
    try {
      assert.equal((await fetch(`${plain.url}/tokenizer_info`)).status, 404);
    } finally {
      await plain.close();
    }
  });
});

/**
 * text_offset counts characters (code points), as vLLM's Python strings do: a client slices the text it decoded at
 * each offset. A synthetic model with Qwen 2's vocabulary, where "𝕟" (U+1D55F, two UTF-16 code units) is one token;
 * the guided regex and logit_bias make the output that token three times, then a space.
 */
const QWEN_VOCAB = 'ggml-vocab-qwen2.gguf';
const DOUBLE_STRUCK_N = 147662;

describe('text_offset over characters outside the Basic Multilingual Plane', { skip: skipUnlessShared(QWEN_VOCAB) }, () => {
  let dir: string;
  let server: TestServer;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-text-offset-'));
    const path = join(dir, 'qwen-vocab.gguf');
    writeSharedVocabModel(QWEN_VOCAB, path, 'text offset');
    server = await startTestServer({ flags: ['--model', path, '--threads', '1'] });
  });
  after(async () => {
    await server?.close();
    rmSync(dir, { recursive: true, force: true });
  });

  interface Choice { index: number; text: string; logprobs: { tokens: string[]; text_offset: number[] } }

  /** Each token's offset is the code points before it, and the text's code points there are the token's. */
  function assertCodePointOffsets(choice: Choice, context: string): void {
    const chars = [...choice.text];
    const { tokens, text_offset: offsets } = choice.logprobs;
    assert.equal(offsets.length, tokens.length, context);
    let expected = 0;
    tokens.forEach((token, i) => {
      assert.equal(offsets[i], expected, `${context}: token ${i} ${JSON.stringify(token)}`);
      assert.equal(chars.slice(offsets[i], offsets[i]! + [...token].length).join(''), token, `${context}: token ${i}`);
      expected += [...token].length;
    });
    assert.equal(expected, chars.length, `${context}: the tokens make up the text`);
  }

  it('counts code points with and without echo, streamed or not, for every prompt and choice', { timeout: 90_000 }, async () => {
    const prompts = ['Hi', '𝕟 Hi'];
    for (const echo of [false, true]) {
      for (const stream of [false, true]) {
        const context = `echo ${echo} stream ${stream}`;
        const res = await rawRequest(server.url, {
          path: '/v1/completions', body: {
            prompt: prompts, n: 2, max_tokens: 4, temperature: 0, logprobs: 0, echo, stream,
            guided_regex: '𝕟𝕟𝕟 ok', logit_bias: { [DOUBLE_STRUCK_N]: 100 },
          },
        });
        assert.equal(res.status, 200, res.text);
        let choices: Choice[];
        if (!stream) {
          choices = res.json().choices;
        } else {
          // A choice's chunks joined: its text, tokens and offsets in order.
          const joined = new Map<number, Choice>();
          for (const line of res.text.split('\n').filter((l) => l.startsWith('data: {'))) {
            for (const chunk of JSON.parse(line.slice(6)).choices as Choice[]) {
              const into = joined.get(chunk.index) ?? { index: chunk.index, text: '', logprobs: { tokens: [], text_offset: [] } };
              into.text += chunk.text;
              into.logprobs.tokens.push(...(chunk.logprobs?.tokens ?? []));
              into.logprobs.text_offset.push(...(chunk.logprobs?.text_offset ?? []));
              joined.set(chunk.index, into);
            }
          }
          choices = [...joined.values()].sort((a, b) => a.index - b.index);
        }
        assert.equal(choices.length, 4, context);
        for (const choice of choices) {
          const prompt = prompts[Math.floor(choice.index / 2)]!;
          const completion = echo ? choice.text.slice(prompt.length) : choice.text;
          assert.equal(echo ? choice.text.slice(0, prompt.length) : prompt, prompt, `${context}: the echoed prompt`);
          assert.match(completion, /^𝕟𝕟𝕟 /u, `${context} choice ${choice.index}: the completion is the guided text`);
          assert.equal(choice.logprobs.tokens.filter((token) => token === '𝕟').length, 3 + (echo && prompt.startsWith('𝕟') ? 1 : 0),
            `${context} choice ${choice.index}: "𝕟" is one token`);
          assertCodePointOffsets(choice, `${context} choice ${choice.index}`);
        }
      }
    }
  });
});
