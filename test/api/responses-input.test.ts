// How /v1/responses reads instructions and input into the chat it runs, under a template that writes every message
// out: empty instructions are none (as vLLM takes them), and input of the wrong type is refused in words that name
// both of its shapes.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI, { BadRequestError } from 'openai';
import { startTestServer, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 90_000 };

describe('/v1/responses input and instructions', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;

  before(async () => {
    // A template that renders every message, an empty one included (the built-in Llama 2 template drops an empty system prompt).
    server = await startTestServer({ flags: ['--chat-template', '{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:'] });
    client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('empty instructions are none: no empty system message in the prompt; echoed as sent', E2E, async () => {
    const without = await client.responses.create({ model, input: 'Tell me about a cat.', max_output_tokens: 2, temperature: 0 });
    const empty = await client.responses.create({ model, input: 'Tell me about a cat.', instructions: '', max_output_tokens: 2, temperature: 0 });
    assert.equal(empty.usage!.input_tokens, without.usage!.input_tokens);
    assert.equal(empty.output_text, without.output_text);
    assert.equal(empty.instructions, '');
    const given = await client.responses.create({ model, input: 'Tell me about a cat.', instructions: 'Be brief.', max_output_tokens: 2, temperature: 0 });
    assert.ok(given.usage!.input_tokens > without.usage!.input_tokens, 'instructions with text are the system message');
  });
});
