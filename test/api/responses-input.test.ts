// How /v1/responses reads instructions and input into the chat it runs, under a template that writes every message
// out: empty instructions are none (as vLLM takes them), input of the wrong type is refused in words that name both
// of its shapes, tools under tool_choice "none" are not shown to the model (as vLLM's Responses API leaves them out),
// and the numbers of tools and chat_template_kwargs reach the template as written, as on a chat completion.

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
    // A template that renders every message, an empty one included (the built-in Llama 2 template drops an empty system
    // prompt), and the tools it is given.
    server = await startTestServer({ flags: ['--chat-template', '{% if tools %}{% for t in tools %}tool {{ t.function.name }}: '
      + '{{ t.function.description }} {{ t.function.parameters | tojson }}\n{% endfor %}{% endif %}'
      + '{% if kwarg is defined %}kwarg {{ kwarg | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:'] });
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

  it('tool_choice "none": the tools are not in the prompt, as vLLM leaves them out of a response\'s', E2E, async () => {
    const tools: OpenAI.Responses.Tool[] = [{
      type: 'function', name: 'get_weather', description: 'The weather in a city, today and for the week ahead.', strict: false,
      parameters: { type: 'object', properties: { city: { type: 'string' } } },
    }];
    const base = { model, input: 'Weather in Paris?', max_output_tokens: 2, temperature: 0 };
    const without = await client.responses.create(base);
    const offered = await client.responses.create({ ...base, tools, tool_choice: 'auto' });
    assert.ok(offered.usage!.input_tokens > without.usage!.input_tokens, 'offered tools are in the prompt');
    const none = await client.responses.create({ ...base, tools, tool_choice: 'none' });
    assert.equal(none.usage!.input_tokens, without.usage!.input_tokens);
    assert.equal(none.output_text, without.output_text);
    assert.deepEqual([none.tool_choice, none.tools.length], ['none', 1], 'echoed as sent');
  });

  it('numbers in tools and chat_template_kwargs reach the template as written (1.0, a 64-bit id), as on a chat completion', E2E, async () => {
    // Sent as text: JSON.parse would make 1.0 into 1 and round the id before the request left.
    const numbers = '[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 1234567890123456789]';
    const parameters = `{"type": "object", "properties": {"id": {"type": "number", "enum": ${numbers}}}}`;
    const post = async (path: string, fields: string) => {
      const res = await fetch(`${server.url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' },
        body: `{"model": "${model}", "max_tokens": 1, "max_output_tokens": 1, "temperature": 0, ${fields}}`.replace(path === '/v1/responses' ? /"max_tokens": 1, / : /"max_output_tokens": 1, /, '') });
      const body = await res.json() as { usage: Record<string, number> };
      assert.equal(res.status, 200, JSON.stringify(body));
      return body.usage;
    };
    const kwargs = `"chat_template_kwargs": {"kwarg": ${numbers}}`;
    const chat = await post('/v1/chat/completions', `"messages": [{"role": "user", "content": "Hi"}], ${kwargs}, `
      + `"tools": [{"type": "function", "function": {"name": "lookup", "description": "By id.", "parameters": ${parameters}}}]`);
    const rounded = await post('/v1/chat/completions', `"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"kwarg": [1, 2, 3, 4, 5, 6, 7, 8, 1234567890123456800]}, `
      + `"tools": [{"type": "function", "function": {"name": "lookup", "description": "By id.", "parameters": ${parameters.replace(numbers, '[1, 2, 3, 4, 5, 6, 7, 8, 1234567890123456800]')}}}]`);
    assert.notEqual(chat.prompt_tokens, rounded.prompt_tokens, 'the numbers as written make another prompt');
    const response = await post('/v1/responses', `"input": "Hi", ${kwargs}, `
      + `"tools": [{"type": "function", "name": "lookup", "description": "By id.", "parameters": ${parameters}}]`);
    assert.equal(response.input_tokens, chat.prompt_tokens);
  });
});
