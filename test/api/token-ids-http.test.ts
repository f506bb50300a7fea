// vLLM's return_token_ids over HTTP, against the real server on the built-in model: completions choices carry their
// prompt's ids and their generated ids, chat responses the prompt's ids at the top and each choice its generated
// ids; streamed, the prompt's ids come with each choice's first chunk and every later chunk carries the ids of the
// tokens it adds. The generated ids are the engine's: a stop string's last token and a stop token are among them
// (their text is not), an echo's prompt is not. Also read by the official openai client.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import type { Tokenizer } from '../../src/model/tokenizer/types.ts';
import { rawRequest } from './http-client.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 90_000 };

interface CompletionChoice {
  index: number;
  text: string;
  finish_reason: string | null;
  stop_reason: string | number | null;
  prompt_token_ids?: number[];
  token_ids?: number[];
}

/** The JSON events of an SSE body, [DONE] left out. */
function events(text: string): any[] {
  return text.split('\n').filter((line) => line.startsWith('data: ') && line !== 'data: [DONE]').map((line) => JSON.parse(line.slice(6)));
}

describe('return_token_ids', () => {
  let server: TestServer;
  let model: string;
  let tokenizer: Tokenizer;
  const post = (path: string, body: object) => rawRequest(server.url, { path, body: { model, ...body } });
  const tokenize = async (body: object): Promise<number[]> => (await post('/tokenize', body)).json().tokens;
  /** Generated ids as the output's text (a first word keeps its leading space: the output continues the prompt). */
  const text = (ids: readonly number[]): string => {
    const bytes = ids.flatMap((id) => [...tokenizer.tokenBytes(id, false)]);
    return new TextDecoder().decode(new Uint8Array(bytes));
  };

  before(async () => {
    server = await startTestServer();
    model = server.running.api.gateway.servedModelName!;
    tokenizer = server.running.api.gateway.servedModels[0]!.backend.tokenizer;
  });
  after(async () => {
    await server?.close();
  });

  it('completions: each choice has its own prompt\'s ids and the ids it generated; none without the field', E2E, async () => {
    const prompts = ['The harbour at dawn', 'Seven quiet rivers run'];
    const res = await post('/v1/completions', { prompt: prompts, n: 2, max_tokens: 6, temperature: 0.8, seed: 7, ignore_eos: true, return_token_ids: true });
    assert.equal(res.status, 200, res.text);
    const body = res.json();
    const promptIds = [await tokenize({ prompt: prompts[0] }), await tokenize({ prompt: prompts[1] })];
    assert.equal(body.choices.length, 4);
    let generated = 0;
    for (const choice of body.choices as CompletionChoice[]) {
      assert.deepEqual(choice.prompt_token_ids, promptIds[Math.floor(choice.index / 2)], `choice ${choice.index}'s prompt`);
      assert.equal(choice.token_ids!.length, 6, `choice ${choice.index} generated 6 tokens`);
      assert.equal(text(choice.token_ids!), choice.text, `choice ${choice.index}'s ids are its text`);
      generated += choice.token_ids!.length;
    }
    assert.equal(body.usage.completion_tokens, generated);

    const plain = (await post('/v1/completions', { prompt: prompts[0], max_tokens: 2 })).json();
    assert.equal('prompt_token_ids' in plain.choices[0], false);
    assert.equal('token_ids' in plain.choices[0], false);
    const off = (await post('/v1/completions', { prompt: prompts[0], max_tokens: 2, return_token_ids: false })).json();
    assert.equal('token_ids' in off.choices[0], false);
    await waitFor(() => engineIdle(server.engine), 'nothing running');
  });

  it('chat: the prompt\'s ids at the top (the rendered conversation), each choice its own ids', E2E, async () => {
    const messages = [{ role: 'user', content: 'Name three colours of the sea.' }];
    const res = await post('/v1/chat/completions', { messages, n: 2, max_tokens: 5, temperature: 0.8, seed: 3, ignore_eos: true, return_token_ids: true });
    assert.equal(res.status, 200, res.text);
    const body = res.json();
    assert.deepEqual(body.prompt_token_ids, await tokenize({ messages }));
    assert.equal(body.usage.prompt_tokens, body.prompt_token_ids.length);
    for (const choice of body.choices) {
      assert.equal('prompt_token_ids' in choice, false, 'chat choices do not repeat the prompt');
      assert.equal(choice.token_ids.length, 5);
      assert.equal(text(choice.token_ids), choice.message.content);
    }
    const plain = (await post('/v1/chat/completions', { messages, max_tokens: 2 })).json();
    assert.equal('prompt_token_ids' in plain, false);
    assert.equal('token_ids' in plain.choices[0], false);
  });

  it('a stop string ends the ids with the token that completed it; a stop token id is the last id, not in the text', E2E, async () => {
    const prompt = 'Once upon a time in a small village';
    const free = (await post('/v1/completions', { prompt, max_tokens: 24, temperature: 0, ignore_eos: true, return_token_ids: true })).json();
    const ids: number[] = free.choices[0].token_ids;
    const freeText: string = free.choices[0].text;
    assert.equal(ids.length, 24);
    // A stop string from the middle of the text: the output stops at the first token whose text completes it.
    const from = Math.floor(freeText.length / 2);
    const stop = freeText.slice(from, from + 3);
    assert.ok(stop.trim().length > 0, `a visible stop string (${JSON.stringify(stop)})`);
    const at = freeText.indexOf(stop);
    let completing = 0;
    while (!text(ids.slice(0, completing + 1)).includes(stop)) completing++;
    const stopped = (await post('/v1/completions', { prompt, max_tokens: 24, temperature: 0, ignore_eos: true, stop, return_token_ids: true })).json();
    const choice: CompletionChoice = stopped.choices[0];
    assert.equal(choice.stop_reason, stop);
    assert.equal(choice.text, freeText.slice(0, at), 'the text ends before the stop string');
    assert.deepEqual(choice.token_ids, ids.slice(0, completing + 1), 'the ids run up to the token that completed it');
    assert.equal(stopped.usage.completion_tokens, completing + 1);
    // Streamed, the text held back while it could still begin the stop string shows no chunk of its own: its tokens'
    // ids come with the next chunk, and all of them together are the body's.
    const streamed = await post('/v1/completions', { prompt, max_tokens: 24, temperature: 0, ignore_eos: true, stop, stream: true, return_token_ids: true });
    const chunks = events(streamed.text);
    assert.deepEqual(chunks.flatMap((chunk) => chunk.choices[0].token_ids), choice.token_ids);
    assert.equal(chunks.map((chunk) => chunk.choices[0].text).join(''), choice.text);

    // A stop token id: the output ends on it, its id listed last and its text left out.
    const stopId = ids[3]!;
    const first = ids.indexOf(stopId);
    const byId = (await post('/v1/completions', { prompt, max_tokens: 24, temperature: 0, stop_token_ids: [stopId], return_token_ids: true })).json();
    assert.equal(byId.choices[0].stop_reason, stopId);
    assert.deepEqual(byId.choices[0].token_ids, ids.slice(0, first + 1));
    assert.equal(byId.choices[0].text, text(ids.slice(0, first)));
    // The model's EOS (</s>, id 2, made certain by logit_bias) ends it the same way.
    const eos = (await post('/v1/completions', { prompt, max_tokens: 24, logit_bias: { 2: 100 }, return_token_ids: true })).json();
    assert.equal(eos.choices[0].finish_reason, 'stop');
    assert.deepEqual(eos.choices[0].token_ids, [2]);
    assert.equal(eos.choices[0].text, '');
  });

  it('echo keeps the prompt\'s text and leaves its ids out of token_ids; echo with max_tokens 0 generates none', E2E, async () => {
    const prompt = 'A lantern by the window';
    const promptIds = await tokenize({ prompt });
    const echoed = (await post('/v1/completions', { prompt, max_tokens: 3, ignore_eos: true, echo: true, return_token_ids: true })).json();
    const choice: CompletionChoice = echoed.choices[0];
    assert.ok(choice.text.startsWith(prompt));
    assert.deepEqual(choice.prompt_token_ids, promptIds);
    assert.equal(choice.token_ids!.length, 3);
    assert.equal(prompt + text(choice.token_ids!), choice.text);
    const scored = (await post('/v1/completions', { prompt, max_tokens: 0, echo: true, logprobs: 0, return_token_ids: true })).json();
    assert.equal(scored.choices[0].text, prompt);
    assert.deepEqual(scored.choices[0].prompt_token_ids, promptIds);
    assert.deepEqual(scored.choices[0].token_ids, []);
    assert.equal(scored.usage.completion_tokens, 0);
  });

  it('streamed completions: the prompt\'s ids on each choice\'s first chunk, then each chunk the ids it adds', E2E, async () => {
    const prompts = ['Rain on the roof', 'The clockmaker said'];
    const res = await post('/v1/completions', {
      prompt: prompts, n: 2, max_tokens: 8, temperature: 0.8, seed: 11, ignore_eos: true, stream: true,
      stream_options: { include_usage: true }, return_token_ids: true,
    });
    assert.equal(res.status, 200, res.text);
    const promptIds = [await tokenize({ prompt: prompts[0] }), await tokenize({ prompt: prompts[1] })];
    const seen = new Map<number, { text: string; ids: number[]; chunks: number }>();
    let completionTokens = 0;
    for (const event of events(res.text)) {
      if (event.choices.length === 0) {
        completionTokens = event.usage.completion_tokens;
        continue;
      }
      const choice: CompletionChoice = event.choices[0];
      let state = seen.get(choice.index);
      if (!state) {
        assert.deepEqual(choice.prompt_token_ids, promptIds[Math.floor(choice.index / 2)], `choice ${choice.index}'s first chunk`);
        state = { text: '', ids: [], chunks: 0 };
        seen.set(choice.index, state);
      } else {
        assert.equal('prompt_token_ids' in choice, false, 'only the first chunk carries the prompt');
      }
      assert.ok(Array.isArray(choice.token_ids), 'every chunk carries token_ids');
      state.text += choice.text;
      state.ids.push(...choice.token_ids!);
      state.chunks++;
    }
    assert.equal(seen.size, 4);
    let total = 0;
    for (const [index, state] of seen) {
      assert.equal(state.ids.length, 8, `choice ${index}`);
      assert.equal(text(state.ids), state.text, `choice ${index}: its ids are its text`);
      total += state.ids.length;
    }
    assert.equal(completionTokens, total);
  });

  it('streamed chat: the prompt\'s ids at the top of the role chunks, token_ids on the content chunks', E2E, async () => {
    const messages = [{ role: 'user', content: 'Tell me about lighthouses.' }];
    const res = await post('/v1/chat/completions', {
      messages, n: 2, max_tokens: 6, temperature: 0.8, seed: 5, ignore_eos: true, stream: true, return_token_ids: true,
    });
    assert.equal(res.status, 200, res.text);
    const promptIds = await tokenize({ messages });
    const ids = [[], []] as number[][];
    const texts = ['', ''];
    let roleChunks = 0;
    for (const event of events(res.text)) {
      const choice = event.choices[0];
      if (choice.delta.role === 'assistant') {
        roleChunks++;
        assert.deepEqual(event.prompt_token_ids, promptIds);
        assert.equal('token_ids' in choice, false);
        continue;
      }
      assert.equal('prompt_token_ids' in event, false);
      ids[choice.index]!.push(...choice.token_ids);
      texts[choice.index] += choice.delta.content ?? '';
    }
    assert.equal(roleChunks, 2);
    for (const i of [0, 1]) {
      assert.equal(ids[i]!.length, 6);
      assert.equal(text(ids[i]!), texts[i]);
    }
  });

  it('with tools, streamed ids are the body\'s too: text held while a call is parsed brings its ids later', E2E, async () => {
    const tool = {
      type: 'function', function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } },
    };
    // The output forced by a regex: text, then a call in the Hermes format the auto parser reads.
    const forced = 'Ok <tool_call>\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}</tool_call>';
    const body = {
      messages: [{ role: 'user', content: 'Weather in Paris?' }], temperature: 0, max_tokens: 120, tools: [tool], tool_choice: 'auto',
      guided_regex: forced, return_token_ids: true,
    };
    const whole = (await post('/v1/chat/completions', body)).json();
    assert.equal(whole.choices[0].finish_reason, 'tool_calls', JSON.stringify(whole));
    assert.equal(whole.choices[0].token_ids.length, whole.usage.completion_tokens);
    const streamed = events((await post('/v1/chat/completions', { ...body, stream: true })).text);
    assert.deepEqual(streamed.flatMap((chunk) => chunk.choices[0]?.token_ids ?? []), whole.choices[0].token_ids);
  });

  it('the official openai client reads them as extra fields', E2E, async () => {
    const client = new OpenAI({ apiKey: 'none', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
    const completion = await client.completions.create({
      model, prompt: 'The old mill', max_tokens: 4, ignore_eos: true, return_token_ids: true,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    const choice = completion.choices[0] as unknown as CompletionChoice;
    assert.deepEqual(choice.prompt_token_ids, await tokenize({ prompt: 'The old mill' }));
    assert.equal(choice.token_ids!.length, 4);
    const chat = await client.chat.completions.create({
      model, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 3, ignore_eos: true, return_token_ids: true,
    } as OpenAI.ChatCompletionCreateParamsNonStreaming);
    assert.deepEqual((chat as unknown as { prompt_token_ids: number[] }).prompt_token_ids, await tokenize({ messages: [{ role: 'user', content: 'Hi' }] }));
    assert.equal((chat.choices[0] as unknown as { token_ids: number[] }).token_ids.length, 3);
  });

  it('refuses a return_token_ids that is not a boolean', E2E, async () => {
    const res = await post('/v1/completions', { prompt: 'x', max_tokens: 1, return_token_ids: 'yes' });
    assert.equal(res.status, 400);
    assert.equal(res.json().error.param, 'return_token_ids');
  });
});
