// The official `openai` client against the real server and engine: if these pass, OpenAI-speaking tools work.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI, { AuthenticationError, BadRequestError, NotFoundError, RateLimitError } from 'openai';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const MAIN_KEY = 'sk-e2e-main-00001';
const STRICT_KEY = 'sk-e2e-strict-0002';
const messages = [{ role: 'user' as const, content: 'Tell me about the sea.' }];

/** A hang guard, not a speed requirement. */
const E2E = { timeout: 90_000 };

describe('official openai client end to end', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;

  before(async () => {
    server = await startTestServer({ keysFile: `${MAIN_KEY} main\n${STRICT_KEY} strict 1\n` });
    // A hang guard, not a speed requirement: every request here is a few tokens.
    client = new OpenAI({ apiKey: MAIN_KEY, baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
    model = server.running.api.gateway.servedModelName!;
  });

  after(async () => {
    await server?.close();
  });

  it('lists the served model', E2E, async () => {
    const list = await client.models.list();
    assert.deepEqual(list.data.map((m) => m.id), [model]);
    assert.equal((await client.models.retrieve(model)).id, model);
  });

  it('chat: non-streamed and streamed greedy answers are identical, usage included', E2E, async () => {
    const whole = await client.chat.completions.create({ model, messages, max_tokens: 8, temperature: 0 });
    assert.match(whole.id, /^chatcmpl-/);
    assert.equal(whole.object, 'chat.completion');
    assert.equal(whole.model, model);
    const choice = whole.choices[0]!;
    assert.equal(choice.message.role, 'assistant');
    assert.equal(typeof choice.message.content, 'string');
    assert.ok(choice.finish_reason === 'length' || choice.finish_reason === 'stop');
    const usage = whole.usage!;
    assert.ok(usage.completion_tokens <= 8 && usage.completion_tokens > 0);
    assert.equal(choice.finish_reason === 'length', usage.completion_tokens === 8);
    assert.equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens);
    assert.equal(typeof usage.prompt_tokens_details?.cached_tokens, 'number');

    const stream = await client.chat.completions.create({
      model, messages, max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true },
    });
    let text = '';
    let finish: string | null = null;
    let streamedUsage: OpenAI.CompletionUsage | undefined;
    let sawRole = false;
    for await (const chunk of stream) {
      assert.equal(chunk.object, 'chat.completion.chunk');
      assert.equal(chunk.id.startsWith('chatcmpl-'), true);
      if (chunk.usage) {
        assert.deepEqual(chunk.choices, [], 'the usage chunk has no choices');
        streamedUsage = chunk.usage;
        continue;
      }
      assert.equal(chunk.usage, null, 'with include_usage every other chunk has usage: null');
      const delta = chunk.choices[0]!.delta;
      if (delta.role) sawRole = true;
      text += delta.content ?? '';
      finish = chunk.choices[0]!.finish_reason ?? finish;
    }
    assert.ok(sawRole);
    assert.equal(text, choice.message.content);
    assert.equal(finish, choice.finish_reason);
    assert.equal(streamedUsage?.prompt_tokens, usage.prompt_tokens);
    assert.equal(streamedUsage?.completion_tokens, usage.completion_tokens);
  });

  it('chat prompt tokens agree with /tokenize for the same messages', E2E, async () => {
    const whole = await client.chat.completions.create({ model, messages, max_tokens: 1 });
    const res = await fetch(`${server.url}/tokenize`, {
      method: 'POST', headers: { Authorization: `Bearer ${MAIN_KEY}`, 'Content-Type': 'application/json' },
      body: JSON.stringify({ model, messages }),
    });
    const tokenized = await res.json() as { count: number; tokens: number[]; max_model_len: number };
    assert.equal(tokenized.count, whole.usage!.prompt_tokens);
    assert.equal(tokenized.tokens.length, tokenized.count);
    assert.equal(tokenized.max_model_len, server.engine.info.maxModelLen);
  });

  it('completions: the same seed gives the same text, streamed or not; another seed differs', E2E, async () => {
    const params = { model, prompt: 'Once upon a time', max_tokens: 12, temperature: 1, seed: 1234 };
    const first = await client.completions.create(params);
    const second = await client.completions.create(params);
    assert.equal(first.object, 'text_completion');
    assert.match(first.id, /^cmpl-/);
    assert.equal(second.choices[0]!.text, first.choices[0]!.text);
    let streamed = '';
    for await (const chunk of await client.completions.create({ ...params, stream: true })) streamed += chunk.choices[0]?.text ?? '';
    assert.equal(streamed, first.choices[0]!.text);
    const other = await client.completions.create({ ...params, seed: 98765 });
    assert.notEqual(other.choices[0]!.text, first.choices[0]!.text, 'the seed reaches the sampler');
  });

  it('n > 1: one choice per index, streamed texts equal the non-streamed ones', E2E, async () => {
    const params = { model, messages, max_tokens: 6, temperature: 1, seed: 7, n: 3 };
    const whole = await client.chat.completions.create(params);
    assert.deepEqual(whole.choices.map((c) => c.index), [0, 1, 2]);
    const texts = ['', '', ''];
    let usage: OpenAI.CompletionUsage | undefined;
    for await (const chunk of await client.chat.completions.create({ ...params, stream: true, stream_options: { include_usage: true } })) {
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices) texts[c.index] += c.delta.content ?? '';
    }
    assert.deepEqual(texts, whole.choices.map((c) => c.message.content));
    assert.equal(usage!.completion_tokens, whole.usage!.completion_tokens);
    assert.equal(usage!.prompt_tokens, whole.usage!.prompt_tokens, 'the prompt is counted once for all n');
  });

  it('stop strings end the text before the stop, or after it with include_stop_str_in_output', E2E, async () => {
    const prompt = 'The weather today is';
    const free = (await client.completions.create({ model, prompt, max_tokens: 16, temperature: 0 })).choices[0]!.text;
    // A stop string that first occurs a few characters into the greedy text.
    let at = 2;
    while (at + 3 <= free.length && free.indexOf(free.slice(at, at + 3)) !== at) at++;
    assert.ok(at + 3 <= free.length, `greedy text too short to pick a stop string from: ${JSON.stringify(free)}`);
    const stop = free.slice(at, at + 3);
    const stopped = await client.completions.create({ model, prompt, max_tokens: 16, temperature: 0, stop: [stop] });
    assert.equal(stopped.choices[0]!.text, free.slice(0, at));
    assert.equal(stopped.choices[0]!.finish_reason, 'stop');
    const kept = await client.completions.create({
      model, prompt, max_tokens: 16, temperature: 0, stop, include_stop_str_in_output: true,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    assert.equal(kept.choices[0]!.text, free.slice(0, at + 3));
  });

  it('logprobs in both shapes', E2E, async () => {
    const chat = await client.chat.completions.create({ model, messages, max_tokens: 5, temperature: 0, logprobs: true, top_logprobs: 3 });
    const content = chat.choices[0]!.logprobs!.content!;
    assert.equal(content.length, chat.usage!.completion_tokens);
    for (const entry of content) {
      assert.ok(entry.logprob <= 0);
      assert.ok(Array.isArray(entry.bytes));
      assert.equal(entry.top_logprobs.length, 3);
      const tops = entry.top_logprobs.map((t) => t.logprob);
      assert.deepEqual(tops, [...tops].sort((a, b) => b - a), 'alternatives best first');
      assert.equal(entry.logprob, tops[0], 'greedy picks the most likely token');
    }
    const completion = await client.completions.create({ model, prompt: 'Hello', max_tokens: 4, temperature: 0, logprobs: 2 });
    const lp = completion.choices[0]!.logprobs!;
    assert.equal(lp.tokens!.length, completion.usage!.completion_tokens);
    assert.equal(lp.token_logprobs!.length, lp.tokens!.length);
    lp.top_logprobs!.forEach((top, i) => {
      const size = Object.keys(top).length;
      assert.ok(size >= 2 && size <= 3, `top_logprobs[${i}] has ${size} entries`);
    });
    const offsets = lp.text_offset!;
    for (let i = 1; i < offsets.length; i++) assert.ok(offsets[i]! >= offsets[i - 1]!);
  });

  it('errors surface as the client\'s typed exceptions', E2E, async () => {
    await assert.rejects(client.chat.completions.create({ model, messages, temperature: 5 }),
      (err: unknown) => err instanceof BadRequestError && (err.error as { param?: string }).param === 'temperature');
    await assert.rejects(client.chat.completions.create({ model: 'no-such-model', messages }),
      (err: unknown) => err instanceof NotFoundError && err.code === 'model_not_found');
    const stranger = new OpenAI({ apiKey: 'sk-not-a-real-key-9', baseURL: `${server.url}/v1`, maxRetries: 0 });
    await assert.rejects(stranger.models.list(), (err: unknown) => err instanceof AuthenticationError);
    const strict = new OpenAI({ apiKey: STRICT_KEY, baseURL: `${server.url}/v1`, maxRetries: 0 });
    await strict.completions.create({ model, prompt: 'a', max_tokens: 1 });
    await assert.rejects(strict.completions.create({ model, prompt: 'a', max_tokens: 1 }),
      (err: unknown) => err instanceof RateLimitError && Number(err.headers?.get('retry-after')) > 0);
  });

  it('a prompt longer than the context is a 400 naming both numbers', E2E, async () => {
    const maxModelLen = server.engine.info.maxModelLen;
    const prompt = 'sea '.repeat(maxModelLen + 10);
    await assert.rejects(client.completions.create({ model, prompt, max_tokens: 1 }), (err: unknown) => {
      assert.ok(err instanceof BadRequestError);
      assert.equal(err.code, 'context_length_exceeded');
      assert.match(err.message, new RegExp(`maximum context length is ${maxModelLen} tokens`));
      assert.match(err.message, /prompt has \d+ tokens/);
      return true;
    });
    await assert.rejects(client.completions.create({ model, prompt: 'hi', max_tokens: maxModelLen }), (err: unknown) =>
      err instanceof BadRequestError && new RegExp(`${maxModelLen} in the completion`).test(err.message));
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
  });
});
