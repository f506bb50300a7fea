// POST /v1/responses through the official openai client: the answer is the chat completion the request translates to
// (same tokens under greedy decoding), shaped as a response object (output_text, usage, status, incomplete_details),
// streamed as typed events in order with consecutive sequence numbers and no [DONE]; text.format json_schema holds;
// function tools give function_call items, and calls with their outputs go back in as input items;
// what the server does not do is a 400 naming the Responses field; nothing is held afterwards. A stream failing after
// it began ends with response.failed holding what was streamed and its usage; not streamed, the failure is an error.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI, { APIError, BadRequestError } from 'openai';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 90_000 };

describe('POST /v1/responses', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;

  before(async () => {
    server = await startTestServer();
    client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('answers as the chat completion of instructions + input would, as a response object', E2E, async () => {
    const response = await client.responses.create({
      model, instructions: 'You tell short stories.', input: 'Tell me about a cat.', max_output_tokens: 12, temperature: 0,
      metadata: { run: 'test' },
    });
    const chat = await client.chat.completions.create({
      model, max_tokens: 12, temperature: 0,
      messages: [{ role: 'system', content: 'You tell short stories.' }, { role: 'user', content: 'Tell me about a cat.' }],
    });
    assert.equal(response.object, 'response');
    assert.match(response.id, /^resp_[0-9a-f]{24}$/);
    assert.equal(response.output_text, chat.choices[0]!.message.content);
    assert.equal(response.output.length, 1);
    const message = response.output[0]!;
    assert.equal(message.type, 'message');
    assert.equal(message.type === 'message' && message.role, 'assistant');
    assert.deepEqual(response.usage && {
      input: response.usage.input_tokens, output: response.usage.output_tokens, total: response.usage.total_tokens,
    }, { input: chat.usage!.prompt_tokens, output: chat.usage!.completion_tokens, total: chat.usage!.total_tokens });
    // Ended by max_output_tokens (the synthetic model rarely says EOS this early), or by the model.
    if (chat.choices[0]!.finish_reason === 'length') {
      assert.equal(response.status, 'incomplete');
      assert.deepEqual(response.incomplete_details, { reason: 'max_output_tokens' });
    } else {
      assert.equal(response.status, 'completed');
    }
    assert.deepEqual([response.instructions, response.max_output_tokens, response.temperature, response.metadata, (response as unknown as { store: boolean }).store],
      ['You tell short stories.', 12, 0, { run: 'test' }, false]);
  });

  it('input as message items with input_text parts is the same conversation', E2E, async () => {
    const asString = await client.responses.create({ model, input: 'Hello there', max_output_tokens: 6, temperature: 0 });
    const asItems = await client.responses.create({
      model, max_output_tokens: 6, temperature: 0,
      input: [{ type: 'message', role: 'user', content: [{ type: 'input_text', text: 'Hello there' }] }],
    });
    assert.equal(asItems.output_text, asString.output_text);
  });

  it('streams typed events in order, numbered from 0, their deltas the final text, and no [DONE]', E2E, async () => {
    const stream = await client.responses.create({ model, input: 'Once upon a time', max_output_tokens: 10, temperature: 0, stream: true });
    const types: string[] = [];
    const numbers: number[] = [];
    let deltas = '';
    let final: OpenAI.Responses.Response | undefined;
    for await (const event of stream) {
      types.push(event.type);
      numbers.push(event.sequence_number);
      if (event.type === 'response.output_text.delta') deltas += event.delta;
      if (event.type === 'response.completed' || event.type === 'response.incomplete') final = event.response;
    }
    assert.deepEqual(numbers, types.map((_, i) => i));
    const distinct = types.filter((type, i) => type !== types[i - 1]);
    assert.deepEqual(distinct, [
      'response.created', 'response.in_progress', 'response.output_item.added', 'response.content_part.added',
      'response.output_text.delta', 'response.output_text.done', 'response.content_part.done', 'response.output_item.done',
      final?.status === 'completed' ? 'response.completed' : 'response.incomplete',
    ]);
    assert.ok(final);
    assert.equal(final.output_text ?? (final.output[0] as OpenAI.Responses.ResponseOutputMessage).content
      .map((part) => (part.type === 'output_text' ? part.text : '')).join(''), deltas);
    const whole = await client.responses.create({ model, input: 'Once upon a time', max_output_tokens: 10, temperature: 0 });
    assert.equal(whole.output_text, deltas, 'the stream says what the non-streamed response says');
    assert.equal(final.usage?.output_tokens, whole.usage?.output_tokens);
    const raw = await rawRequest(server.url, { path: '/v1/responses', body: { input: 'Hi', max_output_tokens: 2, stream: true } });
    assert.match(raw.text, /^event: response\.created\ndata: \{"type":"response\.created","sequence_number":0,/);
    assert.doesNotMatch(raw.text, /\[DONE\]/);
  });

  it('text.format json_schema constrains the output', E2E, async () => {
    const schema = { type: 'object', properties: { name: { type: 'string', maxLength: 8 } }, required: ['name'], additionalProperties: false };
    const response = await client.responses.create({
      model, input: 'Name a cat.', max_output_tokens: 40, temperature: 0,
      text: { format: { type: 'json_schema', name: 'cat', schema, strict: true } },
    });
    assert.equal(response.status, 'completed', response.output_text);
    const value = JSON.parse(response.output_text) as { name: unknown };
    assert.deepEqual(Object.keys(value), ['name']);
    assert.equal(typeof value.name, 'string');
  });

  it('an integer enum past 2^53 in text.format, structured_outputs or a tool is produced with the digits the request wrote', E2E, async () => {
    // Raw text, since a JavaScript client would round the numbers before sending them. Both values are one double
    // (1234567890123456768): JSON.parse made one enum value of them, and the grammar produced 1234567890123456800.
    const schema = '{"type": "integer", "enum": [1234567890123456789, 1234567890123456790]}';
    const objectSchema = `{"type": "object", "properties": {"id": ${schema}}, "required": ["id"], "additionalProperties": false}`;
    const bodies = [
      `"text": {"format": {"type": "json_schema", "name": "id", "schema": ${schema}}}`,
      `"structured_outputs": {"json": ${schema}}`,
      `"tools": [{"type": "function", "name": "lookup", "parameters": ${objectSchema}}], "tool_choice": "required"`,
    ];
    for (const [i, fields] of bodies.entries()) {
      const body = `{"model": "${model}", "input": "x", "seed": ${i}, "temperature": 1, "max_output_tokens": 400, ${fields}}`;
      const response = await rawRequest(server.url, { path: '/v1/responses', body });
      assert.equal(response.status, 200, response.text);
      const item = response.json().output[0];
      const text = (item.type === 'function_call' ? item.arguments : item.content[0].text) as string;
      assert.match(text, /^\s*(\{\s*"id"\s*:\s*)?12345678901234567(89|90)\s*\}?\s*$/, `${fields}: ${text}`);
    }
  });

  const WEATHER = {
    type: 'function' as const, name: 'get_weather', description: 'The weather in a city.', strict: true,
    parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 12 } }, required: ['city'], additionalProperties: false },
  };

  it('function tools: a named tool_choice gives a function_call item with arguments that follow its schema', E2E, async () => {
    const response = await client.responses.create({
      model, input: 'What is the weather in Paris?', max_output_tokens: 40, temperature: 0,
      tools: [WEATHER], tool_choice: { type: 'function', name: 'get_weather' },
    });
    assert.equal(response.status, 'completed');
    const calls = response.output.filter((item) => item.type === 'function_call');
    assert.equal(calls.length, 1, JSON.stringify(response.output));
    const call = calls[0] as OpenAI.Responses.ResponseFunctionToolCall;
    assert.equal(call.name, 'get_weather');
    assert.deepEqual(Object.keys(JSON.parse(call.arguments) as object), ['city']);
    assert.deepEqual(response.tools.map((tool) => (tool as { name: string }).name), ['get_weather']);

    // Streamed: the call's events, its arguments whole in them, and the same response at the end.
    const stream = await client.responses.create({
      model, input: 'What is the weather in Paris?', max_output_tokens: 40, temperature: 0,
      tools: [WEATHER], tool_choice: { type: 'function', name: 'get_weather' }, stream: true,
    });
    const types: string[] = [];
    let args = '';
    let final: OpenAI.Responses.Response | undefined;
    for await (const event of stream) {
      types.push(event.type);
      if (event.type === 'response.function_call_arguments.done') args = event.arguments;
      if (event.type === 'response.completed') final = event.response;
    }
    assert.deepEqual(types, ['response.created', 'response.in_progress', 'response.output_item.added',
      'response.function_call_arguments.delta', 'response.function_call_arguments.done', 'response.output_item.done', 'response.completed']);
    assert.equal(args, call.arguments);
    assert.deepEqual(final?.output.map((item) => item.type), ['function_call']);

    // Cut short by max_output_tokens inside its arguments: the call is incomplete, as the response is.
    const cut = await client.responses.create({
      model, input: 'What is the weather in Paris?', max_output_tokens: 3, temperature: 0,
      tools: [WEATHER], tool_choice: { type: 'function', name: 'get_weather' },
    });
    assert.equal(cut.status, 'incomplete');
    const cutCall = cut.output.find((item) => item.type === 'function_call') as OpenAI.Responses.ResponseFunctionToolCall;
    assert.throws(() => JSON.parse(cutCall.arguments), SyntaxError, cutCall.arguments);
    assert.equal(cutCall.status, 'incomplete');
  });

  it('ids are OpenAI\'s (resp_, msg_, fc_), through responses.create and responses.stream; the id finds the trace', E2E, async () => {
    const created = await client.responses.create({ model, input: 'Hi', max_output_tokens: 3, temperature: 0 });
    assert.match(created.id, /^resp_[0-9a-f]{24}$/);
    assert.deepEqual(created.output.map((item) => item.id), [`msg_${created.id.slice('resp_'.length)}`]);

    const stream = client.responses.stream({ model, input: 'Hi', max_output_tokens: 3, temperature: 0 });
    const eventIds = new Set<string>();
    for await (const event of stream) {
      if ('response' in event) eventIds.add(event.response.id);
      if ('item_id' in event) eventIds.add(event.item_id);
    }
    const streamed = await stream.finalResponse();
    assert.match(streamed.id, /^resp_[0-9a-f]{24}$/);
    const messageId = `msg_${streamed.id.slice('resp_'.length)}`;
    assert.deepEqual(streamed.output.map((item) => item.id), [messageId]);
    assert.deepEqual([...eventIds].sort(), [messageId, streamed.id].sort(), 'every event names the response and its item alike');

    const called = await client.responses.create({
      model, input: 'What is the weather in Paris?', max_output_tokens: 40, temperature: 0,
      tools: [WEATHER], tool_choice: { type: 'function', name: 'get_weather' },
    });
    assert.deepEqual(called.output.map((item) => item.id), [`fc_${called.id.slice('resp_'.length)}_0`]);

    for (const id of [created.id, streamed.id]) {
      // The trace is kept when the server has finished the request, which may be just after the client's last byte.
      let trace = await rawRequest(server.url, { path: `/v1/requests/${id}/trace` });
      for (let tries = 0; trace.status === 404 && tries < 50; tries++) {
        await new Promise((resolve) => setTimeout(resolve, 20));
        trace = await rawRequest(server.url, { path: `/v1/requests/${id}/trace` });
      }
      assert.equal(trace.status, 200, trace.text);
      assert.equal(trace.json().request_id, id);
    }
  });

  it('function_call and function_call_output input items are the assistant\'s tool calls and the tool\'s messages', E2E, async () => {
    // The built-in model's Llama 2 template has no tool turns: a template that writes them out.
    const template = '{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %} call {{ c.id }} '
      + '{{ c.function.name }}({{ c.function.arguments }}){% endfor %}{% else %} {{ m.content }}{% endif %}{% if m.tool_call_id %} '
      + 'for {{ m.tool_call_id }}{% endif %}\n{% endfor %}assistant:';
    const tooled = await startTestServer({ flags: ['--chat-template', template] });
    try {
      const tooledClient = new OpenAI({ apiKey: 'unused', baseURL: `${tooled.url}/v1`, maxRetries: 0, timeout: 60_000 });
      const args = '{"city":"Paris"}';
      const response = await tooledClient.responses.create({
        model, max_output_tokens: 4, temperature: 0, tools: [WEATHER],
        input: [
          { role: 'user', content: 'Weather in Paris and Rome?' },
          { type: 'function_call', call_id: 'call_1', name: 'get_weather', arguments: args },
          { type: 'function_call', call_id: 'call_2', name: 'get_weather', arguments: '{"city":"Rome"}' },
          { type: 'function_call_output', call_id: 'call_1', output: 'sunny' },
          { type: 'function_call_output', call_id: 'call_2', output: 'rain' },
        ],
      });
      const chat = await tooledClient.chat.completions.create({
        model, max_tokens: 4, temperature: 0, tools: [{ type: 'function', function: { name: WEATHER.name, description: WEATHER.description, parameters: WEATHER.parameters } }],
        messages: [
          { role: 'user', content: 'Weather in Paris and Rome?' },
          { role: 'assistant', tool_calls: [
            { id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: args } },
            { id: 'call_2', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Rome"}' } },
          ] },
          { role: 'tool', tool_call_id: 'call_1', content: 'sunny' },
          { role: 'tool', tool_call_id: 'call_2', content: 'rain' },
        ],
      });
      assert.equal(response.usage!.input_tokens, chat.usage!.prompt_tokens, 'the same prompt: one assistant turn with both calls');
      assert.equal(response.output_text, chat.choices[0]!.message.content ?? '');
    } finally {
      await tooled.close();
    }
  });

  it('refuses what it does not do with a 400 naming the Responses field, and holds nothing after', E2E, async () => {
    const cases: [object, string, string][] = [
      [{ previous_response_id: 'resp_1' }, 'previous_response_id', 'unsupported_parameter'],
      [{ tools: [{ type: 'web_search' }] }, 'tools[0].type', 'unsupported_parameter'],
      [{ tools: [{ type: 'function', name: 'bad name' }] }, 'tools[0].name', 'invalid_value'],
      [{ input: [{ role: 'user', content: [{ type: 'input_image', image_url: 'https://x' }] }] }, 'input[0].content[0].type', 'unsupported_parameter'],
      [{ input: [{ type: 'reasoning', id: 'r', summary: [] }] }, 'input[0].type', 'unsupported_parameter'],
      [{ input: [{ type: 'function_call', name: 'f', arguments: '{}' }] }, 'input[0].call_id', 'missing_required_parameter'],
      [{ max_output_tokens: 0 }, 'max_output_tokens', 'invalid_value'],
      [{ max_output_tokens: 1_000_000 }, 'max_output_tokens', 'context_length_exceeded'],
      [{ temperature: 3 }, 'temperature', 'invalid_value'],
      [{ text: { format: { type: 'json_schema', name: 'x', schema: { type: 'object', allOf: [] } } } }, 'text.format.schema.allOf', 'unsupported_parameter'],
      [{ instructions: 'Be brief.', input: [{ role: 'wizard', content: 'x' }] }, 'input[0].role', 'invalid_value'],
    ];
    for (const [body, param, code] of cases) {
      await assert.rejects(client.responses.create({ model, input: 'Hi', max_output_tokens: 4, ...body } as never), (err: unknown) => {
        assert.ok(err instanceof BadRequestError, String(err));
        assert.equal(err.param, param, `${JSON.stringify(body)}: ${err.message}`);
        assert.equal(err.code, code, err.message);
        return true;
      });
    }
    await waitFor(() => engineIdle(server.engine), 'nothing running');
    assert.equal(server.engine.stats().kvBlocksUsed, 0);
  });

  it('a final assistant message "incomplete" or "in_progress" is continued, as vLLM does; a completed one is a turn of its own', E2E, async () => {
    const conversation = (status?: string) => [
      { role: 'user' as const, content: 'Tell me about a cat.' },
      { type: 'message' as const, role: 'assistant' as const, id: 'msg_1', content: [{ type: 'output_text' as const, text: 'The cat sat', annotations: [] }], ...(status ? { status } : {}) },
    ] as OpenAI.Responses.ResponseInputItem[];
    const chat = async (continued: boolean) => client.chat.completions.create({
      model, max_tokens: 6, temperature: 0,
      messages: [{ role: 'user', content: 'Tell me about a cat.' }, { role: 'assistant', content: 'The cat sat' }],
      ...(continued ? { continue_final_message: true, add_generation_prompt: false } : {}),
    } as OpenAI.Chat.ChatCompletionCreateParamsNonStreaming);
    const [continuedChat, newTurnChat] = [await chat(true), await chat(false)];
    assert.notEqual(continuedChat.usage!.prompt_tokens, newTurnChat.usage!.prompt_tokens);
    for (const status of ['incomplete', 'in_progress']) {
      const response = await client.responses.create({ model, max_output_tokens: 6, temperature: 0, input: conversation(status) });
      assert.equal(response.usage!.input_tokens, continuedChat.usage!.prompt_tokens, status);
      assert.equal(response.output_text, continuedChat.choices[0]!.message.content, status);
    }
    for (const status of ['completed', undefined]) {
      const response = await client.responses.create({ model, max_output_tokens: 6, temperature: 0, input: conversation(status) });
      assert.equal(response.usage!.input_tokens, newTurnChat.usage!.prompt_tokens, String(status));
    }
  });

  it('a field it does not do, sent with the value that asks for nothing, is taken (the openai-agents SDK sends include: [])', E2E, async () => {
    for (const extra of [{ include: [] }, { background: false }, { top_logprobs: 0 }, { include: [], background: false, top_logprobs: 0 }]) {
      const response = await client.responses.create({ model, input: 'Hi', max_output_tokens: 2, ...extra });
      assert.equal(response.object, 'response', JSON.stringify(extra));
    }
    const refused: [object, string][] = [
      [{ include: ['message.output_text.logprobs'] }, 'include'], [{ background: true }, 'background'], [{ top_logprobs: 2 }, 'top_logprobs'],
      [{ include: 'nothing' }, 'include'],
    ];
    for (const [extra, param] of refused) {
      await assert.rejects(client.responses.create({ model, input: 'Hi', max_output_tokens: 2, ...extra } as never), (err: unknown) => {
        assert.ok(err instanceof BadRequestError, String(err));
        assert.equal(err.param, param, err.message);
        return true;
      });
    }
  });
});

describe('POST /v1/responses: a stream that fails after it began', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;

  before(async () => {
    // A generation far longer than the limit: the stream opens, then the timeout cuts it.
    server = await startTestServer({ flags: ['--request-timeout', '0.5'] });
    client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  const NEVER_ENDING = { input: 'Never ending', max_output_tokens: 2000, ignore_eos: true, temperature: 0 };

  it('ends with response.failed carrying the failed response and its error, as OpenAI\'s does', E2E, async () => {
    const stream = await client.responses.create({ model, ...NEVER_ENDING, stream: true } as never) as unknown as AsyncIterable<OpenAI.Responses.ResponseStreamEvent>;
    const events: OpenAI.Responses.ResponseStreamEvent[] = [];
    for await (const event of stream) events.push(event);
    assert.ok(events.some((e) => e.type === 'response.output_text.delta'), 'the stream had begun');
    assert.deepEqual(events.map((e) => e.sequence_number), events.map((_, i) => i), 'consecutive sequence numbers');
    assert.ok(!events.some((e) => e.type === 'error'), 'no error event beside response.failed');
    const last = events.at(-1)!;
    assert.equal(last.type, 'response.failed');
    const failed = (last as OpenAI.Responses.ResponseFailedEvent).response;
    assert.equal(failed.id, (events[0] as OpenAI.Responses.ResponseCreatedEvent).response.id);
    assert.equal(failed.status, 'failed');
    assert.equal(failed.error?.code, 'request_timeout');
    assert.match(failed.error!.message, /--request-timeout/);
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
  });

  it('responses.stream() gives the failed response as the final one', E2E, async () => {
    const stream = client.responses.stream({ model, ...NEVER_ENDING } as never);
    const response = await stream.finalResponse();
    assert.equal(response.status, 'failed');
    assert.equal(response.error?.code, 'request_timeout');
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
  });

  it('response.failed keeps what was streamed: the message cut short as "incomplete", and the usage so far', E2E, async () => {
    // The prompt's token count, from a request that finishes well within the limit.
    const short = await client.responses.create({ model, input: NEVER_ENDING.input, max_output_tokens: 1, temperature: 0 });
    const stream = client.responses.stream({ model, ...NEVER_ENDING } as never);
    let shownText = '';
    let deltas = 0;
    stream.on('response.output_text.delta', (event) => {
      shownText += event.delta;
      deltas++;
    });
    const failed = await stream.finalResponse();
    assert.ok(shownText.length > 0, 'text was streamed before the failure');
    assert.equal(failed.status, 'failed');
    assert.equal(failed.output.length, 1);
    const message = failed.output[0]!;
    assert.equal(message.type, 'message');
    assert.equal(message.status, 'incomplete');
    assert.equal(failed.output_text, shownText, 'the failed response holds the text the client was shown');
    assert.ok(failed.usage, 'usage up to the failure');
    assert.equal(failed.usage.input_tokens, short.usage!.input_tokens);
    assert.ok(failed.usage.output_tokens >= deltas, `${failed.usage.output_tokens} output tokens for ${deltas} deltas`);
    assert.ok(failed.usage.output_tokens < NEVER_ENDING.max_output_tokens);
    assert.equal(failed.usage.total_tokens, failed.usage.input_tokens + failed.usage.output_tokens);
    assert.equal(failed.incomplete_details, null);
    // Nothing is held after the failure: no KV blocks, no running or waiting request, no concurrency slot.
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
    const anyone = server.running.keyStore.authenticate(undefined);
    await waitFor(() => server.running.api.limiter.inFlight(anyone) === 0, 'the concurrency slot to come back');
  });

  it('not streamed, the same failure is a 504 with OpenAI\'s error body, and nothing is held after', E2E, async () => {
    await assert.rejects(client.responses.create({ model, ...NEVER_ENDING } as never), (err: unknown) => {
      assert.ok(err instanceof APIError, String(err));
      assert.equal(err.status, 504);
      assert.equal(err.code, 'request_timeout');
      assert.equal(err.type, 'server_error');
      assert.match(err.message, /--request-timeout/);
      return true;
    });
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
    const anyone = server.running.keyStore.authenticate(undefined);
    await waitFor(() => server.running.api.limiter.inFlight(anyone) === 0, 'the concurrency slot to come back');
    const after = await client.responses.create({ model, input: 'Still there?', max_output_tokens: 2, temperature: 0 });
    assert.notEqual(after.status, 'failed', 'the server still answers');
  });
});
