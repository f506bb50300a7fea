// Tool-call markers that are special (control) tokens, as <tool_call> is in some Hermes models and <|python_tag|> in
// Llama 3: under tool_choice "auto" those tokens keep their text, so the parser finds its marker, while special tokens
// that are no part of the format (and EOS) stay out of the content as before.
// The model is a token chain (token-chain-model.ts), whose greedy output is an exact sequence of tokens.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';
import { writeTokenChainModel } from './token-chain-model.ts';

const E2E = { timeout: 90_000 };

const ARGS = '{"city": "Paris"}';
const TEMPLATE_END = '{% if add_generation_prompt %}<|gen|>{% endif %}';
const TURNS = '{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}';

const WEATHER = {
  type: 'function' as const,
  function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } },
};

interface Assembled {
  content: string;
  calls: { name: string; arguments: string }[];
  finish: string | null;
}

function assembleStream(text: string): Assembled {
  const out: Assembled = { content: '', calls: [], finish: null };
  for (const line of text.split('\n')) {
    if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
    const choice = JSON.parse(line.slice(6)).choices[0];
    if (!choice) continue;
    if (typeof choice.delta?.content === 'string') out.content += choice.delta.content;
    for (const piece of choice.delta?.tool_calls ?? []) {
      out.calls[piece.index] ??= { name: '', arguments: '' };
      if (piece.function?.name) out.calls[piece.index]!.name = piece.function.name;
      out.calls[piece.index]!.arguments += piece.function?.arguments ?? '';
    }
    if (choice.finish_reason) out.finish = choice.finish_reason;
  }
  return out;
}

describe('tool-call markers that are special tokens', () => {
  let dir: string;
  let server: TestServer;
  let client: OpenAI;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-chain-'));
    // Hermes: text, a control token of no format, then the call between control-token tags.
    writeTokenChainModel(join(dir, 'hermes.gguf'), {
      chain: [
        { text: '<|gen|>', control: true }, { text: 'Sure.' }, { text: '<|extra|>', control: true },
        { text: '<tool_call>', control: true }, { text: `{"name": "get_weather", "arguments": ${ARGS}}` },
        { text: '</tool_call>', control: true },
      ],
      chatTemplate: `${TURNS}{% if tools %}Call tools in <tool_call></tool_call> tags.\n{% endif %}${TEMPLATE_END}`,
    });
    // Llama 3.x JSON: <|python_tag|> (a control token), the call, another control token.
    writeTokenChainModel(join(dir, 'llama.gguf'), {
      chain: [
        { text: '<|gen|>', control: true }, { text: '<|python_tag|>', control: true },
        { text: `{"name": "get_weather", "parameters": ${ARGS}}` }, { text: '<|extra|>', control: true },
      ],
      chatTemplate: `${TURNS}{% if tools %}Answer with a call after <|python_tag|>.\n{% endif %}${TEMPLATE_END}`,
    });
    // Hermes again, with ordinary text that spells the vocabulary's BOS and EOS (<s>, </s>: HTML's strikethrough).
    writeTokenChainModel(join(dir, 'html.gguf'), {
      chain: [
        { text: '<|gen|>', control: true }, { text: 'Use <s>old</s> new.' },
        { text: '<tool_call>', control: true }, { text: `{"name": "get_weather", "arguments": ${ARGS}}` },
        { text: '</tool_call>', control: true },
      ],
      chatTemplate: `${TURNS}{% if tools %}Call tools in <tool_call></tool_call> tags.\n{% endif %}${TEMPLATE_END}`,
    });
    server = await startTestServer({ flags: ['--model', `hermes=${join(dir, 'hermes.gguf')}`, '--model', `llama=${join(dir, 'llama.gguf')}`,
      '--model', `html=${join(dir, 'html.gguf')}`] });
    client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
  });
  after(async () => {
    await server?.close();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  const messages = [{ role: 'user' as const, content: 'Weather in Paris?' }];

  it('hermes: a <tool_call> control token opens a call, in the body and the stream; other special tokens stay out', E2E, async () => {
    const response = await client.chat.completions.create({ model: 'hermes', messages, tools: [WEATHER], temperature: 0, max_tokens: 16 });
    const choice = response.choices[0]!;
    assert.equal(choice.finish_reason, 'tool_calls');
    assert.equal(choice.message.content, 'Sure.', 'the text before the call, without <|extra|>');
    assert.deepEqual(choice.message.tool_calls?.map((c) => c.type === 'function' && [c.function.name, c.function.arguments]), [['get_weather', ARGS]]);

    const stream = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
      model: 'hermes', messages, tools: [WEATHER], temperature: 0, max_tokens: 16, stream: true } });
    assert.equal(stream.status, 200);
    assert.deepEqual(assembleStream(stream.text), { content: 'Sure.', calls: [{ name: 'get_weather', arguments: ARGS }], finish: 'tool_calls' });
  });

  it('hermes: ordinary text that spells a special token\'s text stays in the content', E2E, async () => {
    const response = await client.chat.completions.create({ model: 'html', messages, tools: [WEATHER], temperature: 0, max_tokens: 16 });
    assert.equal(response.choices[0]!.message.content, 'Use <s>old</s> new.');
    assert.equal(response.choices[0]!.message.tool_calls?.length, 1);
    const stream = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
      model: 'html', messages, tools: [WEATHER], temperature: 0, max_tokens: 16, stream: true } });
    assert.deepEqual(assembleStream(stream.text), { content: 'Use <s>old</s> new.', calls: [{ name: 'get_weather', arguments: ARGS }], finish: 'tool_calls' });
  });

  it('hermes: a skipped special token is never seen by stop strings, even one that could start with its text', E2E, async () => {
    // "|>" ends <|extra|>'s text and begins the stop string: had the token's text reached the stop matcher, "|>" would
    // be held back from the text around it, and the token's text would no longer come whole to be recognised.
    for (const stream of [false, true]) {
      const res = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
        model: 'hermes', messages, tools: [WEATHER], temperature: 0, max_tokens: 16, stop: ['|><tool', '|>x'], stream } });
      assert.equal(res.status, 200);
      const got = stream ? assembleStream(res.text) : (() => {
        const choice = res.json().choices[0];
        return { content: choice.message.content, finish: choice.finish_reason,
          calls: (choice.message.tool_calls ?? []).map((c: { function: { name: string; arguments: string } }) => ({ name: c.function.name, arguments: c.function.arguments })) };
      })();
      assert.deepEqual(got, { content: 'Sure.', calls: [{ name: 'get_weather', arguments: ARGS }], finish: 'tool_calls' }, `stream ${stream}`);
    }
  });

  it('hermes: asked for with skip_special_tokens false, every special token shows, as in vLLM', E2E, async () => {
    const res = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
      model: 'hermes', messages, tools: [WEATHER], temperature: 0, max_tokens: 16, skip_special_tokens: false } });
    const choice = res.json().choices[0];
    assert.equal(choice.finish_reason, 'tool_calls');
    assert.equal(choice.message.content, 'Sure.<|extra|>');
    assert.equal(choice.message.tool_calls.length, 1);
  });

  it('hermes: with ignore_eos the EOS tokens written after the call never reach the content', E2E, async () => {
    for (const stream of [false, true]) {
      const res = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
        model: 'hermes', messages, tools: [WEATHER], temperature: 0, max_tokens: 9, ignore_eos: true, stream } });
      assert.equal(res.status, 200);
      const got = stream ? assembleStream(res.text) : (() => {
        const choice = res.json().choices[0];
        return { content: choice.message.content, finish: choice.finish_reason,
          calls: choice.message.tool_calls.map((c: { function: { name: string; arguments: string } }) => ({ name: c.function.name, arguments: c.function.arguments })) };
      })();
      assert.equal(got.finish, 'length', `stream ${stream}`);
      assert.equal(got.content, 'Sure.', `stream ${stream}: no </s> in ${JSON.stringify(got.content)}`);
      assert.deepEqual(got.calls, [{ name: 'get_weather', arguments: ARGS }], `stream ${stream}`);
    }
  });

  it('without tools (or tool_choice none) special tokens are skipped as always', E2E, async () => {
    for (const extra of [{}, { tools: [WEATHER], tool_choice: 'none' as const }]) {
      const response = await client.chat.completions.create({ model: 'hermes', messages, temperature: 0, max_tokens: 16, ...extra });
      assert.equal(response.choices[0]!.message.content, `Sure.{"name": "get_weather", "arguments": ${ARGS}}`);
      assert.equal(response.choices[0]!.finish_reason, 'stop');
    }
  });

  it('/v1/responses: the call is a function_call item', E2E, async () => {
    const response = await client.responses.create({
      model: 'hermes', input: 'Weather in Paris?', temperature: 0, max_output_tokens: 16,
      tools: [{ type: 'function', name: 'get_weather', parameters: WEATHER.function.parameters, strict: false }],
    });
    assert.deepEqual(response.output.map((item) => item.type), ['message', 'function_call']);
    assert.equal(response.output_text, 'Sure.');
    const call = response.output[1]!;
    assert.ok(call.type === 'function_call');
    assert.deepEqual([call.name, call.arguments], ['get_weather', ARGS]);
  });

  it('llama3_json: a call after the <|python_tag|> control token; the token of no format stays out', E2E, async () => {
    const response = await client.chat.completions.create({ model: 'llama', messages, tools: [WEATHER], temperature: 0, max_tokens: 16 });
    const choice = response.choices[0]!;
    assert.equal(choice.finish_reason, 'tool_calls');
    assert.equal(choice.message.content, null);
    assert.deepEqual(choice.message.tool_calls?.map((c) => c.type === 'function' && [c.function.name, c.function.arguments]), [['get_weather', ARGS]]);
    const stream = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
      model: 'llama', messages, tools: [WEATHER], temperature: 0, max_tokens: 16, stream: true } });
    assert.deepEqual(assembleStream(stream.text), { content: '', calls: [{ name: 'get_weather', arguments: ARGS }], finish: 'tool_calls' });
  });
});
