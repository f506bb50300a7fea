// /v1/responses' tool fields in OpenAI's Responses shape: a bad tool_choice is refused with a message describing that
// shape (not chat's), a function_call_output's output may be a list of content parts (their texts, as a message's),
// and a named tool_choice without tools says so in words a client knows, on chat completions too.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 90_000 };

const TOOLS = [{ type: 'function', name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } }];

describe('/v1/responses tool fields', () => {
  let server: TestServer;

  before(async () => {
    // A template that renders every role, tool results included (the built-in model's Llama 2 template has none).
    server = await startTestServer({ flags: ['--chat-template', '{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:'] });
  });
  after(async () => {
    await server?.close();
  });

  const post = (path: string, body: object) => rawRequest(server.url, { path, body });

  it('a bad tool_choice is a 400 describing the Responses shape', E2E, async () => {
    for (const toolChoice of ['sometimes', 5, ['auto']]) {
      const res = await post('/v1/responses', { input: 'x', tools: TOOLS, tool_choice: toolChoice, max_output_tokens: 2 });
      assert.equal(res.status, 400, res.text);
      const { error } = res.json();
      assert.equal(error.param, 'tool_choice');
      assert.match(error.message, /\{"type": "function", "name": \.\.\.\}/, error.message);
      assert.doesNotMatch(error.message, /"function": \{/, 'not the chat shape');
    }
  });

  it("function_call_output's output as content parts renders as their texts joined, as a message's parts", E2E, async () => {
    const input = (output: unknown) => [
      { role: 'user', content: 'Weather in Paris?' },
      { type: 'function_call', call_id: 'call_1', name: 'get_weather', arguments: '{"city": "Paris"}' },
      { type: 'function_call_output', call_id: 'call_1', output },
    ];
    const asString = await post('/v1/responses', { input: input('sunny\n20 C'), tools: TOOLS, max_output_tokens: 1 });
    assert.equal(asString.status, 200, asString.text);
    const asParts = await post('/v1/responses', {
      input: input([{ type: 'input_text', text: 'sunny' }, { type: 'input_text', text: '20 C' }]), tools: TOOLS, max_output_tokens: 1 });
    assert.equal(asParts.status, 200, asParts.text);
    assert.equal(asParts.json().usage.input_tokens, asString.json().usage.input_tokens);
    const image = await post('/v1/responses', {
      input: input([{ type: 'input_image', image_url: 'https://example.com/a.png' }]), tools: TOOLS, max_output_tokens: 1 });
    assert.equal(image.status, 400, image.text);
    assert.equal(image.json().error.param, 'input[2].output[0].type');
  });

  it('a named tool_choice without tools names the function, on chat completions and /v1/responses', E2E, async () => {
    const chat = await post('/v1/chat/completions', {
      messages: [{ role: 'user', content: 'x' }], tool_choice: { type: 'function', function: { name: 'get_weather' } }, max_tokens: 2 });
    const responses = await post('/v1/responses', { input: 'x', tool_choice: { type: 'function', name: 'get_weather' }, max_output_tokens: 2 });
    for (const res of [chat, responses]) {
      assert.equal(res.status, 400, res.text);
      assert.equal(res.json().error.param, 'tool_choice');
      assert.match(res.json().error.message, /tool_choice names the function 'get_weather', but the request has no tools\.$/);
    }
  });
});
