// parallel_tool_calls false under tool_choice "auto": a model that writes two calls returns only the first, in the body
// and in the stream, on chat completions and /v1/responses, as vLLM filters them (maybe_filter_parallel_tool_calls).
// The built-in model's output is forced by a guided regex (taken beside "auto") into two Hermes calls; /v1/responses
// (which takes no guided_regex) runs on a token-chain model that writes them.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { ToolChatShape, type ToolsRequest } from '../../src/api/tool-calls.ts';
import type { TokenTexts } from '../../src/api/openai-format.ts';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';
import { writeTokenChainModel } from './token-chain-model.ts';

const E2E = { timeout: 90_000 };

const TOOLS = [
  { type: 'function' as const, function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } } },
  { type: 'function' as const, function: { name: 'get_time', parameters: { type: 'object', properties: { tz: { type: 'string' } } } } },
];
const TWO_CALLS = 'Ok <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
  + '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>';
const escape = (text: string): string => text.replace(/[{}[\]()|.*+?^$\\]/g, '\\$&');

interface Assembled { content: string; calls: [string, string][]; finish: string | null }

function assemble(sse: string): Assembled {
  const out: Assembled = { content: '', calls: [], finish: null };
  for (const line of sse.split('\n')) {
    if (!line.startsWith('data: {')) continue;
    const choice = JSON.parse(line.slice(6)).choices[0];
    if (!choice) continue;
    if (typeof choice.delta?.content === 'string') out.content += choice.delta.content;
    for (const piece of choice.delta?.tool_calls ?? []) {
      out.calls[piece.index] ??= ['', ''];
      if (piece.function?.name) out.calls[piece.index]![0] = piece.function.name;
      out.calls[piece.index]![1] += piece.function?.arguments ?? '';
    }
    if (choice.finish_reason) out.finish = choice.finish_reason;
  }
  return out;
}

describe('parallel_tool_calls false under tool_choice auto', () => {
  it('the shape keeps the first call, streamed in pieces or not', () => {
    const meta = { id: 'chatcmpl-1', created: 0, model: 'm', systemFingerprint: 'fp' };
    for (const parallel of [false, true]) {
      const request: ToolsRequest = { raw: TOOLS, tools: TOOLS.map((t) => ({ name: t.function.name })), choice: { kind: 'auto' }, parallel };
      const whole = new ToolChatShape(meta, 1, {} as TokenTexts, null, request, 'hermes');
      whole.collect({ index: 0, textDelta: TWO_CALLS, logprobs: undefined, finishReason: 'stop', stopReason: null, tokens: 1 });
      const message = (whole.body({ prompt_tokens: 0, completion_tokens: 0, total_tokens: 0 } as never) as {
        choices: { message: { content: string | null; tool_calls: { function: { name: string } }[] }; finish_reason: string }[] }).choices[0]!;
      assert.deepEqual(message.message.tool_calls.map((c) => c.function.name), parallel ? ['get_weather', 'get_time'] : ['get_weather']);
      assert.equal(message.message.content, 'Ok ');
      assert.equal(message.finish_reason, 'tool_calls');

      const streamed = new ToolChatShape(meta, 1, {} as TokenTexts, null, request, 'hermes');
      const chunks: object[] = [];
      for (let at = 0; at < TWO_CALLS.length; at += 5) {
        chunks.push(...streamed.updateChunks({ index: 0, textDelta: TWO_CALLS.slice(at, at + 5), logprobs: undefined,
          finishReason: at + 5 >= TWO_CALLS.length ? 'stop' : null, stopReason: null, tokens: 1 }, undefined));
      }
      const got = assemble(chunks.map((chunk) => `data: ${JSON.stringify(chunk)}`).join('\n'));
      assert.deepEqual(got.calls.map(([name]) => name), parallel ? ['get_weather', 'get_time'] : ['get_weather'], `parallel ${parallel}`);
      assert.deepEqual(got.calls[0], ['get_weather', '{"city": "Paris"}']);
      assert.equal(got.finish, 'tool_calls');
    }
  });
});

describe('parallel_tool_calls false through HTTP (synthetic model, output forced by a regex)', () => {
  let server: TestServer;
  let model: string;

  before(async () => {
    server = await startTestServer();
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  const body = (parallel: boolean, stream: boolean) => ({
    model, messages: [{ role: 'user', content: 'Weather and time in Paris?' }], temperature: 0, max_tokens: 200,
    tools: TOOLS, parallel_tool_calls: parallel, guided_regex: escape(TWO_CALLS), stream,
  });

  it('chat completions: one call in the body and the stream; both with parallel_tool_calls true', E2E, async () => {
    for (const parallel of [false, true]) {
      const whole = await rawRequest(server.url, { path: '/v1/chat/completions', body: body(parallel, false) });
      assert.equal(whole.status, 200, whole.text);
      const choice = whole.json().choices[0];
      const expected = parallel ? ['get_weather', 'get_time'] : ['get_weather'];
      assert.deepEqual(choice.message.tool_calls.map((c: { function: { name: string } }) => c.function.name), expected, whole.text);
      assert.equal(choice.finish_reason, 'tool_calls');
      assert.equal(choice.message.content, 'Ok ');
      const streamed = assemble((await rawRequest(server.url, { path: '/v1/chat/completions', body: body(parallel, true) })).text);
      assert.deepEqual(streamed, {
        content: 'Ok ', finish: 'tool_calls',
        calls: choice.message.tool_calls.map((c: { function: { name: string; arguments: string } }) => [c.function.name, c.function.arguments]),
      }, `parallel ${parallel}: the stream says what the body says`);
    }
  });

  it('/v1/responses (a model whose greedy output is the two calls): one function_call item', E2E, async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-chain-'));
    const chained = await (async () => {
      writeTokenChainModel(join(dir, 'two-calls.gguf'), {
        chain: [{ text: '<|gen|>', control: true }, ...TWO_CALLS.split('\n').map((text) => ({ text }))],
        chatTemplate: '{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|gen|>{% endif %}',
      });
      return startTestServer({ flags: ['--model', `chain=${join(dir, 'two-calls.gguf')}`] });
    })();
    try {
      const chainClient = new OpenAI({ apiKey: 'unused', baseURL: `${chained.url}/v1`, maxRetries: 0, timeout: 60_000 });
      for (const parallel of [false, true]) {
        const response = await chainClient.responses.create({
          model: 'chain', input: 'Weather and time in Paris?', temperature: 0, max_output_tokens: 8, parallel_tool_calls: parallel,
          tools: TOOLS.map((t) => ({ type: 'function' as const, name: t.function.name, parameters: t.function.parameters, strict: false })),
        });
        assert.deepEqual(response.output.filter((item) => item.type === 'function_call').map((item) => item.type === 'function_call' && item.name),
          parallel ? ['get_weather', 'get_time'] : ['get_weather'], `parallel ${parallel}`);
      }
    } finally {
      await chained.close();
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
