// Values a request hands to the chat template (tool parameters under tool_choice "auto", an assistant's tool-call
// arguments, chat_template_kwargs, documents) are nested at most MAX_TEMPLATE_VALUE_DEPTH deep: the template engine
// renders them recursively, and one thousands of levels deep overflowed its stack, which the client saw as a 400
// chat_template_error blaming `messages`. Now a 400 names the field; a value within the bound renders; the server
// and its engine are untouched either way.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { MAX_TEMPLATE_VALUE_DEPTH } from '../../src/api/validate.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 120_000 };
/** JSON text of `levels` objects, each holding the next under "a" (written as text: JSON.stringify recurses). */
const nested = (levels: number) => '{"a":'.repeat(levels) + '1' + '}'.repeat(levels);

describe('values the chat template renders are bounded in depth', () => {
  let server: TestServer;
  let model: string;

  before(async () => {
    server = await startTestServer();
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  const chat = (fields: string) => rawRequest(server.url, {
    path: '/v1/chat/completions',
    body: `{"model":${JSON.stringify(model)},"max_tokens":2,"messages":[{"role":"user","content":"Hi"}],${fields}}`,
  });

  it('too deep: a 400 naming the field, for each place such a value comes from', E2E, async () => {
    const deep = nested(5000);
    const cases: [string, string][] = [
      [`"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":${deep}}}}],"tool_choice":"auto"`,
        'tools[0].function.parameters'],
      [`"chat_template_kwargs":${deep}`, 'chat_template_kwargs'],
      [`"documents":[${deep}]`, 'documents'],
    ];
    for (const [fields, param] of cases) {
      const response = await chat(fields);
      assert.equal(response.status, 400, response.text);
      const { error } = response.json();
      assert.equal(error.param, param, response.text);
      assert.match(error.message, new RegExp(`nested more than ${MAX_TEMPLATE_VALUE_DEPTH} levels deep`));
    }
    const withCall = await rawRequest(server.url, {
      path: '/v1/chat/completions',
      body: {
        model, max_tokens: 2, messages: [
          { role: 'user', content: 'Hi' },
          { role: 'assistant', tool_calls: [{ id: 'c1', type: 'function', function: { name: 'f', arguments: deep } }] },
          { role: 'tool', tool_call_id: 'c1', content: 'ok' },
        ],
      },
    });
    assert.equal(withCall.status, 400, withCall.text);
    assert.equal(withCall.json().error.param, 'messages[1].tool_calls[0].function.arguments');
    const responses = await rawRequest(server.url, {
      path: '/v1/responses',
      body: { model, max_output_tokens: 2, input: [
        { type: 'message', role: 'user', content: 'Hi' },
        { type: 'function_call', call_id: 'c1', name: 'f', arguments: deep },
        { type: 'function_call_output', call_id: 'c1', output: 'ok' },
      ] },
    });
    assert.equal(responses.status, 400, responses.text);
    assert.equal(responses.json().error.param, 'input[1].arguments');
    await waitFor(() => engineIdle(server.engine), 'nothing queued');
  });

  it('within the bound: the request renders and runs', E2E, async () => {
    const within = nested(MAX_TEMPLATE_VALUE_DEPTH - 4);
    const response = await chat(`"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":${within}}}}],` +
      `"tool_choice":"auto","chat_template_kwargs":${within}`);
    assert.equal(response.status, 200, response.text);
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });
});
