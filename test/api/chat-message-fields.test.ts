// What of a chat message reaches the chat template, read back through /tokenize and /detokenize with a template that
// prints it: an assistant turn's empty tool_calls is dropped (its content rendered on the plain path, as vLLM does),
// its reasoning / reasoning_content reach the template under both names, and Responses-style input_text /
// output_text content parts are text, and a developer message keeps its role.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 90_000 };

const PROBE = '{% for m in messages %}[{{ m.role }}'
  + '{% if m.role == "developer" %}|the developer role{% endif %}'
  + '{% if m.tool_calls is defined %}|calls={{ m.tool_calls | length }}{% endif %}'
  + '{% if m.reasoning is defined %}|reasoning={{ m.reasoning }}{% endif %}'
  + '{% if m.reasoning_content is defined %}|reasoning_content={{ m.reasoning_content }}{% endif %}'
  + '|{{ m.content }}]\n{% endfor %}';

describe('chat message fields as the template sees them', () => {
  let server: TestServer;

  before(async () => {
    server = await startTestServer({ flags: ['--chat-template', PROBE] });
  });
  after(async () => {
    await server?.close();
  });

  async function render(messages: unknown[]): Promise<string> {
    const tokenized = await rawRequest(server.url, { path: '/tokenize', body: { messages, add_generation_prompt: false } });
    assert.equal(tokenized.status, 200, tokenized.text);
    const text = await rawRequest(server.url, { path: '/detokenize', body: { tokens: tokenized.json().tokens } });
    return (text.json().prompt as string).replace(/^<s>\s*/, '');
  }

  it('an assistant turn with tool_calls [] renders its content as a plain turn', E2E, async () => {
    assert.equal(await render([
      { role: 'user', content: 'hi' }, { role: 'assistant', content: 'Hello there!', tool_calls: [] }, { role: 'user', content: 'again' },
    ]), '[user|hi]\n[assistant|Hello there!]\n[user|again]\n');
    // Without content too (accepted as before), and real calls are kept.
    assert.equal(await render([
      { role: 'user', content: 'hi' }, { role: 'assistant', tool_calls: [] },
      { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'f', arguments: '{}' } }] },
    ]), '[user|hi]\n[assistant|]\n[assistant|calls=1|]\n');
  });

  it("an assistant turn's reasoning reaches the template as reasoning and reasoning_content", E2E, async () => {
    for (const key of ['reasoning', 'reasoning_content']) {
      assert.equal(await render([
        { role: 'user', content: 'hi' }, { role: 'assistant', content: 'Answer', [key]: 'I thought hard' },
      ]), '[user|hi]\n[assistant|reasoning=I thought hard|reasoning_content=I thought hard|Answer]\n', key);
    }
    // Only an assistant's: on a user message the field is not read.
    assert.equal(await render([{ role: 'user', content: 'hi', reasoning: 'no' }]), '[user|hi]\n');
    const bad = await rawRequest(server.url, { path: '/tokenize', body: { messages: [{ role: 'assistant', content: 'a', reasoning: 5 }] } });
    assert.equal(bad.status, 400);
    assert.equal(bad.json().error.param, 'messages[0].reasoning');
  });

  it('input_text and output_text content parts are text, in chat completions as in /tokenize', E2E, async () => {
    assert.equal(await render([
      { role: 'user', content: [{ type: 'input_text', text: 'one' }, { type: 'text', text: 'two' }] },
      { role: 'assistant', content: [{ type: 'output_text', text: 'three' }] },
    ]), '[user|one\ntwo]\n[assistant|three]\n');
    const client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
    const response = await client.chat.completions.create({
      model: server.running.api.gateway.servedModelName!, max_tokens: 2,
      messages: [{ role: 'user', content: [{ type: 'input_text', text: 'Hello' }] as never }],
    });
    assert.equal(response.choices.length, 1);
  });

  it('a developer message reaches the template with its own role, as vLLM passes it, on chat and /v1/responses', E2E, async () => {
    // It used to be renamed "system", so a template could not tell the two apart.
    const developer = [{ role: 'developer', content: 'Be terse.' }, { role: 'user', content: 'hi' }];
    assert.equal(await render(developer), '[developer|the developer role|Be terse.]\n[user|hi]\n');
    const count = async (messages: unknown[]): Promise<number> =>
      (await rawRequest(server.url, { path: '/tokenize', body: { messages } })).json().count as number;
    const asDeveloper = await count(developer);
    assert.notEqual(asDeveloper, await count([{ role: 'system', content: 'Be terse.' }, { role: 'user', content: 'hi' }]));
    const response = await rawRequest(server.url, { path: '/v1/responses', body: { input: developer, max_output_tokens: 1 } });
    assert.equal(response.status, 200, response.text);
    assert.equal(response.json().usage.input_tokens, asDeveloper);
  });
});
