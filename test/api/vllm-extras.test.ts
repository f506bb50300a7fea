// vLLM's request fields beyond OpenAI's that change what a request gets: each honoured (truncate_prompt_tokens,
// add_special_tokens (completions: default true; chat and /tokenize messages: default false), cache_salt,
// continue_final_message, documents and reasoning_effort for the template) or refused with a 400 naming it
// (bad_words, allowed_token_ids, logprob_token_ids, logits_processors, chat's echo, a verbosity other than the
// default), never silently ignored; /detokenize as vLLM's; against the real server on the built-in model.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { parseChatCompletionRequest } from '../../src/api/schemas/chat.ts';
import { rawRequest } from './http-client.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 90_000 };

describe('vLLM\'s extra request fields', () => {
  let server: TestServer;
  let model: string;
  const post = (path: string, body: object) => rawRequest(server.url, { path, body: { model, ...body } });

  before(async () => {
    server = await startTestServer();
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('refuses the fields it does not implement, naming them, and costs nothing', E2E, async () => {
    const cases: [string, object][] = [
      ['/v1/completions', { prompt: 'Hi', bad_words: ['the'] }],
      ['/v1/completions', { prompt: 'Hi', allowed_token_ids: [450] }],
      ['/v1/chat/completions', { messages: [{ role: 'user', content: 'Hi' }], logprob_token_ids: [450] }],
      ['/v1/chat/completions', { messages: [{ role: 'user', content: 'Hi' }], echo: true }],
      ['/v1/completions', { prompt: 'Hi', logits_processors: ['my_module.Processor'] }],
      ['/v1/chat/completions', { messages: [{ role: 'user', content: 'Hi' }], verbosity: 'low' }],
    ];
    for (const [path, body] of cases) {
      const response = await post(path, { max_tokens: 2, ...body });
      assert.equal(response.status, 400, response.text);
      const key = Object.keys(body).at(-1)!;
      assert.equal(response.json().error.param, key, response.text);
      assert.equal(response.json().error.code, 'unsupported_parameter');
    }
    await waitFor(() => engineIdle(server.engine), 'nothing running');
  });

  it('truncate_prompt_tokens keeps the prompt\'s last tokens; -1 as many as fit beside max_tokens', E2E, async () => {
    const ids = Array.from({ length: 40 }, (_, i) => 300 + i);
    const kept = await post('/v1/completions', {
      prompt: ids, max_tokens: 1, truncate_prompt_tokens: 10, echo: true, logprobs: 0, return_tokens_as_token_ids: true,
    });
    assert.equal(kept.status, 200, kept.text);
    assert.equal(kept.json().usage.prompt_tokens, 10);
    const echoed = kept.json().choices[0].logprobs.tokens as string[];
    assert.deepEqual(echoed.slice(0, 10), ids.slice(30).map((id) => `token_id:${id}`), 'the echoed prompt is what ran');
    // The same as sending those ten tokens.
    const direct = await post('/v1/completions', { prompt: ids.slice(30), max_tokens: 4, temperature: 0 });
    const truncated = await post('/v1/completions', { prompt: ids, max_tokens: 4, temperature: 0, truncate_prompt_tokens: 10 });
    assert.equal(truncated.json().choices[0].text, direct.json().choices[0].text);
    // Longer than the context: -1 keeps what fits with max_tokens.
    const { maxModelLen } = server.engine.info;
    const long = Array.from({ length: maxModelLen + 100 }, (_, i) => 300 + (i % 1000));
    const refused = await post('/v1/completions', { prompt: long, max_tokens: 5 });
    assert.equal(refused.status, 400, 'without truncation the prompt does not fit');
    const fitted = await post('/v1/completions', { prompt: long, max_tokens: 5, truncate_prompt_tokens: -1, ignore_eos: true });
    assert.equal(fitted.status, 200, fitted.text);
    assert.equal(fitted.json().usage.prompt_tokens, maxModelLen - 5);
    // Text far longer than the context is tokenized and truncated, not refused by the length check made before
    // tokenizing (which would refuse it without truncation).
    const longText = 'x '.repeat(20 * maxModelLen);
    assert.equal((await post('/v1/completions', { prompt: longText, max_tokens: 1 })).status, 400);
    const truncatedText = await post('/v1/completions', { prompt: longText, max_tokens: 1, truncate_prompt_tokens: 50 });
    assert.equal(truncatedText.status, 200, truncatedText.text);
    assert.equal(truncatedText.json().usage.prompt_tokens, 50);
    const longChat = await post('/v1/chat/completions', { messages: [{ role: 'user', content: longText }], max_tokens: 1, truncate_prompt_tokens: 50 });
    assert.equal(longChat.status, 200, longChat.text);
    assert.equal(longChat.json().usage.prompt_tokens, 50);
    const zero = await post('/v1/completions', { prompt: ids, max_tokens: 1, truncate_prompt_tokens: 0 });
    assert.equal(zero.json().error.param, 'truncate_prompt_tokens');
    // On chat, of the rendered conversation.
    const chat = await post('/v1/chat/completions', { messages: [{ role: 'user', content: 'Hello there, how are you today?' }], max_tokens: 1, truncate_prompt_tokens: 3 });
    assert.equal(chat.json().usage.prompt_tokens, 3, chat.text);
    await waitFor(() => engineIdle(server.engine), 'nothing running');
  });

  it('add_special_tokens: false on completions leaves the BOS out, as /tokenize counts it', E2E, async () => {
    const count = async (add: boolean) => (await post('/tokenize', { prompt: 'Once upon a time', add_special_tokens: add })).json().count as number;
    const withBos = await post('/v1/completions', { prompt: 'Once upon a time', max_tokens: 1 });
    const without = await post('/v1/completions', { prompt: 'Once upon a time', max_tokens: 1, add_special_tokens: false });
    assert.equal(withBos.json().usage.prompt_tokens, await count(true));
    assert.equal(without.json().usage.prompt_tokens, await count(false));
    assert.equal(await count(false), (await count(true)) - 1, 'the built-in tokenizer adds one BOS');
  });

  it('add_special_tokens on chat and /tokenize messages: off by default (the template writes its own), BOS on request', E2E, async () => {
    const messages = [{ role: 'user', content: 'Hi' }];
    // The built-in template writes BOS itself: asking for the tokenizer's too still gives one.
    const builtIn = async (extra: object) => (await post('/tokenize', { messages, ...extra })).json().tokens as number[];
    const bos = (await post('/tokenize', { prompt: 'a' })).json().tokens[0] as number;
    assert.equal((await builtIn({}))[0], bos);
    assert.deepEqual(await builtIn({ add_special_tokens: true }), await builtIn({}));
    // A template that writes no BOS: none unless asked for, as vLLM and Hugging Face's apply_chat_template do.
    const plain = await startTestServer({ flags: ['--chat-template', '{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:'] });
    try {
      const plainPost = (path: string, body: object) => rawRequest(plain.url, { path, body: { model, ...body } });
      const tokens = async (extra: object) => (await plainPost('/tokenize', { messages, ...extra })).json().tokens as number[];
      const without = await tokens({});
      assert.notEqual(without[0], bos);
      assert.deepEqual(await tokens({ add_special_tokens: false }), without);
      assert.deepEqual(await tokens({ add_special_tokens: true }), [bos, ...without]);
      for (const add of [undefined, true]) {
        const chat = await plainPost('/v1/chat/completions', { messages, max_tokens: 1, ...(add === undefined ? {} : { add_special_tokens: add }) });
        assert.equal(chat.status, 200, chat.text);
        assert.equal(chat.json().usage.prompt_tokens, without.length + (add ? 1 : 0));
      }
    } finally {
      await plain.close();
    }
  });

  it('cache_salt: a prompt\'s cached blocks serve only requests with the same salt', E2E, async () => {
    const prompt = Array.from({ length: 120 }, (_, i) => 900 + i);
    const cached = async (salt?: string) => {
      const response = await post('/v1/completions', { prompt, max_tokens: 1, ...(salt ? { cache_salt: salt } : {}) });
      assert.equal(response.status, 200, response.text);
      return response.json().usage.prompt_tokens_details?.cached_tokens ?? 0;
    };
    assert.equal(await cached('alpha'), 0, 'cold');
    assert.ok(await cached('alpha') >= 96, 'the same salt hits');
    assert.equal(await cached('beta'), 0, 'another salt does not');
    assert.equal(await cached(), 0, 'nor no salt');
    const empty = await post('/v1/completions', { prompt, max_tokens: 1, cache_salt: '' });
    assert.equal(empty.json().error.param, 'cache_salt');
  });

  it('stream_options.continuous_usage_stats: each chunk the usage of its own choice so far, the role chunks none', E2E, async () => {
    const events = (text: string) => text.split('\n').filter((line) => line.startsWith('data: {')).map((line) => JSON.parse(line.slice(6)));
    const streamOptions = { include_usage: true, continuous_usage_stats: true };
    // Two prompts of different lengths, two choices each: choice i belongs to prompt floor(i / 2).
    const prompts = ['Once upon a time', 'The weather today in the small town by the sea is'];
    const completions = await post('/v1/completions', {
      prompt: prompts, n: 2, max_tokens: 6, temperature: 1, seed: 9, ignore_eos: true, stream: true, stream_options: streamOptions,
    });
    assert.equal(completions.status, 200, completions.text);
    const chunks = events(completions.text);
    const usage = chunks.at(-1).usage;
    const promptTokens = [...new Set(chunks.filter((c) => c.choices.length > 0).map((c) => `${c.choices[0].index}:${c.usage.prompt_tokens}`))];
    assert.equal(promptTokens.length, 4, `one prompt length per choice: ${promptTokens.join(' ')}`);
    const seen = [0, 0, 0, 0];
    for (const chunk of chunks.slice(0, -1)) {
      const { index } = chunk.choices[0];
      assert.ok(chunk.usage.completion_tokens >= seen[index]! && chunk.usage.completion_tokens <= 6, JSON.stringify(chunk));
      assert.equal(chunk.usage.total_tokens, chunk.usage.prompt_tokens + chunk.usage.completion_tokens);
      seen[index] = chunk.usage.completion_tokens;
    }
    assert.deepEqual(seen, [6, 6, 6, 6], 'each choice\'s last chunk counts its own tokens');
    assert.equal(usage.completion_tokens, 24, 'the usage chunk counts every choice');
    const [short, long] = [Number(promptTokens[0]!.split(':')[1]), Number(promptTokens[2]!.split(':')[1])];
    assert.ok(short < long);
    assert.equal(usage.prompt_tokens, short + long, 'the usage chunk counts each prompt once');
    const chat = await post('/v1/chat/completions', {
      messages: [{ role: 'user', content: 'Hi' }], n: 2, max_tokens: 3, ignore_eos: true, stream: true, stream_options: streamOptions,
    });
    assert.equal(chat.status, 200, chat.text);
    const chatChunks = events(chat.text);
    const roles = chatChunks.filter((c) => c.choices[0]?.delta?.role === 'assistant');
    assert.equal(roles.length, 2);
    for (const role of roles) assert.equal(role.usage.completion_tokens, 0, JSON.stringify(role));
    await waitFor(() => engineIdle(server.engine), 'nothing running');
  });

  it('stream_options.continuous_usage_stats: an echoed prompt\'s chunk carries that prompt\'s usage, not every prompt\'s', E2E, async () => {
    const events = (text: string) => text.split('\n').filter((line) => line.startsWith('data: {')).map((line) => JSON.parse(line.slice(6)));
    const prompts = ['Once upon a time', 'The weather today in the small town by the sea is'];
    const promptLengths: number[] = [];
    for (const prompt of prompts) promptLengths.push((await post('/tokenize', { prompt })).json().count);
    const response = await post('/v1/completions', {
      prompt: prompts, max_tokens: 2, echo: true, ignore_eos: true, stream: true,
      stream_options: { include_usage: true, continuous_usage_stats: true },
    });
    assert.equal(response.status, 200, response.text);
    const chunks = events(response.text);
    for (const [index, prompt] of prompts.entries()) {
      const echoed = chunks.find((chunk) => chunk.choices[0]?.index === index && chunk.choices[0].text === prompt);
      assert.ok(echoed, `choice ${index} echoes its prompt: ${response.text}`);
      assert.deepEqual(
        { prompt: echoed.usage.prompt_tokens, completion: echoed.usage.completion_tokens, total: echoed.usage.total_tokens },
        { prompt: promptLengths[index], completion: 0, total: promptLengths[index] }, JSON.stringify(echoed));
    }
    assert.equal(chunks.at(-1).usage.prompt_tokens, promptLengths[0]! + promptLengths[1]!, 'the usage chunk counts each prompt once');
    await waitFor(() => engineIdle(server.engine), 'nothing running');
  });

  it('/detokenize keeps special tokens, as vLLM\'s does (a Hugging Face decode\'s default)', E2E, async () => {
    const detokenize = async (body: object) => {
      const ids = (await post('/tokenize', body)).json().tokens as number[];
      return (await post('/detokenize', { tokens: ids })).json().prompt as string;
    };
    assert.equal(await detokenize({ prompt: 'Once upon a time' }), '<s> Once upon a time');
    const messages = [{ role: 'user', content: 'Hi there' }, { role: 'assistant', content: 'Hello' }];
    assert.equal(await detokenize({ messages, add_generation_prompt: false }), '<s> [INST] Hi there [/INST] Hello </s>');
  });

  it('continue_final_message: the prompt ends inside the last message, which the model continues', E2E, async () => {
    const messages = [{ role: 'user', content: 'Hi' }, { role: 'assistant', content: 'The answer is' }];
    const tokenize = async (extra: object) => (await post('/tokenize', { messages, ...extra })).json().tokens as number[];
    const closed = await tokenize({ add_generation_prompt: false });
    const open = await tokenize({ continue_final_message: true, add_generation_prompt: false });
    const detokenize = async (tokens: number[]) => (await post('/detokenize', { tokens })).json().prompt as string;
    assert.match(await detokenize(open), /The answer is$/, 'nothing after the last message\'s content');
    assert.ok(open.length < closed.length, 'the end of the turn is left out');
    assert.deepEqual(open, closed.slice(0, open.length), 'the same tokens up to there');
    assert.deepEqual(await tokenize({ continue_final_message: true }), open, 'add_generation_prompt off by default with it');
    const chat = await post('/v1/chat/completions', { messages, continue_final_message: true, max_tokens: 3 });
    assert.equal(chat.status, 200, chat.text);
    assert.equal(chat.json().usage.prompt_tokens, open.length);
    const both = await post('/v1/chat/completions', { messages, continue_final_message: true, add_generation_prompt: true, max_tokens: 3 });
    assert.equal(both.status, 400);
    assert.equal(both.json().error.param, 'continue_final_message');
    const empty = await post('/v1/chat/completions', {
      messages: [{ role: 'user', content: 'Hi' }, { role: 'assistant', content: '' }], continue_final_message: true, max_tokens: 3,
    });
    assert.equal(empty.status, 400, empty.text);
    assert.equal(empty.json().error.param, 'continue_final_message');
    await waitFor(() => engineIdle(server.engine), 'nothing running');
  });

  it('documents and reasoning_effort reach the chat template beside chat_template_kwargs, which win', () => {
    const context = { vocabSize: 32000 };
    const documents = [{ title: 'a', text: 'b' }];
    const request = parseChatCompletionRequest({
      messages: [{ role: 'user', content: 'Hi' }], documents, reasoning_effort: 'low', chat_template_kwargs: { reasoning_effort: 'high', x: 1 },
    }, context);
    assert.deepEqual(request.chatTemplateKwargs, { documents, reasoning_effort: 'high', x: 1 });
    const alone = parseChatCompletionRequest({ messages: [{ role: 'user', content: 'Hi' }], reasoning_effort: 'medium' }, context);
    assert.deepEqual(alone.chatTemplateKwargs, { reasoning_effort: 'medium' });
    assert.equal(parseChatCompletionRequest({ messages: [{ role: 'user', content: 'Hi' }] }, context).chatTemplateKwargs, undefined);
  });
});
