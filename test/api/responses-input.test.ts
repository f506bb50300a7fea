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

  it('input, a message\'s content and a function_call_output\'s output of the wrong type: a 400 naming both shapes they take', E2E, async () => {
    const cases: [unknown, string][] = [
      [5, 'input'],
      [{ role: 'user', content: 'Hi' }, 'input'],
      [[{ role: 'user', content: 5 }], 'input[0].content'],
      [[{ type: 'function_call_output', call_id: 'call_1', output: { text: 'sunny' } }], 'input[0].output'],
    ];
    for (const [input, param] of cases) {
      await assert.rejects(client.responses.create({ model, input, max_output_tokens: 2 } as never), (err: unknown) => {
        assert.ok(err instanceof BadRequestError, String(err));
        assert.equal(err.param, param, err.message);
        assert.equal(err.code, 'invalid_type', err.message);
        assert.match(err.message, /expected a string or an array/, err.message);
        return true;
      });
    }
  });
});
