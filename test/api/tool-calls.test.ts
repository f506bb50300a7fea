// Tool calling: the parsers on hand-written model outputs in each supported format, and tools through HTTP on the
// built-in synthetic model (noise): named and required choices are grammar-enforced, so even it makes valid calls.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { makeParseableResponseFormat } from 'openai/lib/parser';
import { detectToolCallParser, parseToolCalls, scanToolCalls, ToolChatShape, type ToolCallParserName, type ToolsRequest } from '../../src/api/tool-calls.ts';
import type { TokenTexts } from '../../src/api/openai-format.ts';
import { ChatTemplate } from '../../src/model/chat-template.ts';
import { isJsonObject } from '../../src/api/validate.ts';
import { rawRequest } from './http-client.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { assertPerson, PERSON_SCHEMA, schemaErrors } from './guided-fixtures.ts';

const E2E = { timeout: 120_000 };

describe('tool-call parsers on model outputs', () => {
  it('hermes / qwen: <tool_call> JSON blocks, content before them', () => {
    const text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
      + '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>';
    const parsed = parseToolCalls('hermes', text);
    assert.equal(parsed.content, 'Let me check.\n', 'the text before the calls as the model wrote it (a stream sends it so)');
    assert.deepEqual(parsed.calls, [
      { name: 'get_weather', arguments: '{"city": "Paris"}' }, { name: 'get_time', arguments: '{"zone": "CET"}' },
    ]);
    // No call, or a broken one: the text stays content.
    assert.deepEqual(parseToolCalls('hermes', 'Just text.'), { content: 'Just text.', calls: [] });
    assert.deepEqual(parseToolCalls('hermes', '<tool_call>{"name": "f", "argum'), { content: '<tool_call>{"name": "f", "argum', calls: [] });
  });

  it('llama 3.x JSON: {"name", "parameters"} objects, optionally after <|python_tag|>, several separated by ;', () => {
    assert.deepEqual(parseToolCalls('llama3_json', '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
      { content: null, calls: [{ name: 'get_weather', arguments: '{"city": "Oslo"}' }] });
    assert.deepEqual(parseToolCalls('llama3_json', '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": "}"}}').calls,
      [{ name: 'a', arguments: '{}' }, { name: 'b', arguments: '{"x": "}"}' }]);
    assert.deepEqual(parseToolCalls('llama3_json', 'The answer is {42}.'), { content: 'The answer is {42}.', calls: [] });
    assert.deepEqual(parseToolCalls('llama3_json', '{"not": "a call"}').calls, []);
  });

  it('mistral: [TOOL_CALLS] then a JSON array', () => {
    const parsed = parseToolCalls('mistral', '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "noop", "arguments": {}}]');
    assert.equal(parsed.content, null);
    assert.deepEqual(parsed.calls, [{ name: 'get_weather', arguments: '{"city": "Rome"}' }, { name: 'noop', arguments: '{}' }]);
    assert.deepEqual(parseToolCalls('mistral', 'No tools needed.').calls, []);
  });

  it('mistral, tokenizer v11 and later: [TOOL_CALLS]name[ARGS]{arguments}, one marker per call', () => {
    const parsed = parseToolCalls('mistral', 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]noop[ARGS]{}');
    assert.equal(parsed.content, 'Checking.');
    assert.deepEqual(parsed.calls, [{ name: 'get_weather', arguments: '{"city": "Rome"}' }, { name: 'noop', arguments: '{}' }]);
    // [ARGS] is a control token a detokenizer may leave out: the name then ends where the arguments begin.
    assert.deepEqual(parseToolCalls('mistral', '[TOOL_CALLS]get_weather{"city": "Oslo", "q": "{x}"}').calls,
      [{ name: 'get_weather', arguments: '{"city": "Oslo", "q": "{x}"}' }]);
  });

  it('scanning a growing text only extends what a shorter prefix found (names once complete, arguments as written)', () => {
    const text = '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "days": [1, {"x": 2}]}}, {"parameters": {"on": true}, "name": "set_flag"}]';
    let previous = scanToolCalls('');
    for (let end = 1; end <= text.length; end++) {
      const calls = scanToolCalls(text.slice(0, end));
      assert.ok(calls.length >= previous.length, `at ${end}`);
      previous.forEach((call, i) => {
        if (call.name !== undefined) assert.equal(calls[i]!.name, call.name, `at ${end}`);
        assert.ok(calls[i]!.args.startsWith(call.args), `at ${end}: ${JSON.stringify(calls[i]!.args)} after ${JSON.stringify(call.args)}`);
      });
      previous = calls;
    }
    assert.deepEqual(previous, [
      { name: 'get_weather', args: '{"city": "Pa\\"ris}", "days": [1, {"x": 2}]}', argsDone: true, done: true },
      { name: 'set_flag', args: '{"on": true}', argsDone: true, done: true },
    ]);
    assert.deepEqual(scanToolCalls('{"name": "f", "arguments": "{\\"a\\": 1}"}'), [{ name: 'f', args: '{"a": 1}', argsDone: true, done: true }]);
  });

  it('a call whose arguments are not valid JSON is a call in the body as in the stream, its arguments as written', () => {
    const weather = { type: 'function', function: { name: 'get_weather', parameters: { type: 'object' } } };
    const request: ToolsRequest = { raw: [weather], tools: [{ name: 'get_weather', parameters: { type: 'object' } }], choice: { kind: 'auto' }, parallel: true };
    const meta = { id: 'chatcmpl-1', created: 0, model: 'm', systemFingerprint: 'fp' };
    for (const [text, content, args] of [
      ['Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris",}}</tool_call>', 'Checking. ', '{"city": "Paris",}'],
      ['<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}', null, '{"city": "Oslo"}'],
    ] as const) {
      const streamed = new ToolChatShape(meta, 1, {} as TokenTexts, null, request, 'hermes');
      const calls: { name: string; arguments: string }[] = [];
      let streamedContent = '';
      let finish: string | null = null;
      for (let at = 0; at < text.length; at += 4) {
        const chunks = streamed.updateChunks({ index: 0, textDelta: text.slice(at, at + 4), logprobs: undefined,
          finishReason: at + 4 >= text.length ? 'stop' : null, stopReason: null, tokens: 1 }, undefined) as
          { choices: { delta: { content?: string; tool_calls?: { index: number; id?: string; function: { name?: string; arguments: string } }[] }; finish_reason: string | null }[] }[];
        for (const { choices: [choice] } of chunks) {
          streamedContent += choice!.delta.content ?? '';
          for (const piece of choice!.delta.tool_calls ?? []) {
            if (piece.id !== undefined) calls.push({ name: piece.function.name!, arguments: '' });
            else calls[piece.index]!.arguments += piece.function.arguments;
          }
          finish = choice!.finish_reason ?? finish;
        }
      }
      const collected = new ToolChatShape(meta, 1, {} as TokenTexts, null, request, 'hermes');
      collected.collect({ index: 0, textDelta: text, logprobs: undefined, finishReason: 'stop', stopReason: null, tokens: 1 });
      const body = collected.body({ prompt_tokens: 1, completion_tokens: 1, total_tokens: 2, prompt_tokens_details: { cached_tokens: 0 } }) as
        { choices: { message: { content: string | null; tool_calls?: { function: { name: string; arguments: string } }[] }; finish_reason: string }[] };
      const [choice] = body.choices;
      assert.deepEqual(choice!.message.tool_calls?.map((c) => c.function), [{ name: 'get_weather', arguments: args }], text);
      assert.deepEqual(calls, [{ name: 'get_weather', arguments: args }], text);
      assert.equal(choice!.message.content, content);
      assert.equal(streamedContent === '' ? null : streamedContent, content);
      assert.equal(choice!.finish_reason, 'tool_calls');
      assert.equal(finish, 'tool_calls');
    }
  });

  it('auto and required calls stream argument by argument: id and name first, then fragments; assembled == parsed', () => {
    const weather = { type: 'function', function: { name: 'get_weather', parameters: { type: 'object' } } };
    const flag = { type: 'function', function: { name: 'set_flag', parameters: { type: 'object' } } };
    const tools = (choice: ToolsRequest['choice']): ToolsRequest => ({
      raw: [weather, flag], tools: [{ name: 'get_weather', parameters: { type: 'object' } }, { name: 'set_flag', parameters: { type: 'object' } }],
      choice, parallel: true,
    });
    const cases: { parser: ToolCallParserName; choice: ToolsRequest['choice']; text: string; content: string | null }[] = [
      { parser: 'hermes', choice: { kind: 'auto' }, content: 'Checking.\n',
        text: 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
          + '<tool_call>\n{"name": "set_flag", "arguments": {"on": true}}\n</tool_call>' },
      { parser: 'mistral', choice: { kind: 'auto' }, content: null,
        text: '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "set_flag", "arguments": {}}]' },
      { parser: 'mistral', choice: { kind: 'auto' }, content: 'Checking.',
        text: 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]set_flag[ARGS]{"on": true}' },
      { parser: 'llama3_json', choice: { kind: 'auto' }, content: null,
        text: '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "set_flag", "parameters": {"on": false}}' },
      { parser: 'hermes', choice: { kind: 'required' }, content: null,
        text: '[{"name": "get_weather", "parameters": {"city": "Lima", "days": 3}}, {"name": "set_flag", "parameters": {"on": true}}]' },
    ];
    const meta = { id: 'chatcmpl-1', created: 0, model: 'm', systemFingerprint: 'fp' };
    for (const c of cases) {
      const label = `${c.parser}/${c.choice.kind}`;
      const shape = new ToolChatShape(meta, 1, {} as TokenTexts, null, tools(c.choice), c.parser);
      const deltas: Record<string, unknown>[] = [];
      let finish: string | null = null;
      // Three characters per update, as a detokenizer hands out text.
      for (let at = 0; at < c.text.length; at += 3) {
        const last = at + 3 >= c.text.length;
        const chunks = shape.updateChunks({ index: 0, textDelta: c.text.slice(at, at + 3), logprobs: undefined,
          finishReason: last ? 'stop' : null, stopReason: null, tokens: 1 }, undefined) as { choices: { delta: Record<string, unknown>; finish_reason: string | null }[] }[];
        for (const chunk of chunks) {
          deltas.push(chunk.choices[0]!.delta);
          finish = chunk.choices[0]!.finish_reason ?? finish;
        }
      }
      const collected = new ToolChatShape(meta, 1, {} as TokenTexts, null, tools(c.choice), c.parser);
      collected.collect({ index: 0, textDelta: c.text, logprobs: undefined, finishReason: 'stop', stopReason: null, tokens: 1 });
      const body = collected.body({ prompt_tokens: 1, completion_tokens: 1, total_tokens: 2, prompt_tokens_details: { cached_tokens: 0 } }) as
        { choices: { message: { content: string | null; tool_calls: { function: { name: string; arguments: string } }[] } }[] };
      const expected = body.choices[0]!.message.tool_calls.map((call) => ({ name: call.function.name, arguments: call.function.arguments }));
      assert.equal(expected.length, 2, label);
      const calls: { name: string; arguments: string }[] = [];
      let fragments = 0;
      let content = '';
      for (const delta of deltas) {
        if (typeof delta.content === 'string') content += delta.content;
        for (const piece of (delta.tool_calls ?? []) as { index: number; id?: string; function: { name?: string; arguments: string } }[]) {
          if (piece.id !== undefined) {
            assert.equal(piece.index, calls.length, `${label}: calls open in order`);
            assert.equal(piece.function.arguments, '', `${label}: the opening delta names the call`);
            calls.push({ name: piece.function.name!, arguments: '' });
          } else {
            assert.ok(piece.function.name === undefined);
            calls[piece.index]!.arguments += piece.function.arguments;
            fragments++;
          }
        }
      }
      assert.deepEqual(calls, expected, label);
      assert.ok(fragments > 4, `${label}: arguments in ${fragments} fragments`);
      assert.equal(finish, 'tool_calls', label);
      assert.equal(content === '' ? null : content, c.content, label);
      assert.equal(body.choices[0]!.message.content, c.content, label);
    }
  });

  it('an output cut off (max_tokens, a stop string) or not parsing: the body has what the stream sent, for every choice mode', () => {
    const weather = { type: 'function', function: { name: 'get_weather', parameters: { type: 'object' } } };
    const tools = (choice: ToolsRequest['choice']): ToolsRequest => ({
      raw: [weather], tools: [{ name: 'get_weather', parameters: { type: 'object' } }], choice, parallel: true,
    });
    const named: ToolsRequest['choice'] = { kind: 'named', name: 'get_weather' };
    const call = (args: string) => [{ name: 'get_weather', arguments: args }];
    const cases: { choice: ToolsRequest['choice']; text: string; finish: 'stop' | 'length'; content: string | null; calls: { name: string; arguments: string }[]; wire: string }[] = [
      { choice: named, text: '{"city": "Pa', finish: 'length', content: null, calls: call('{"city": "Pa'), wire: 'length' },
      { choice: named, text: '{"city": "Paris"}', finish: 'stop', content: null, calls: call('{"city": "Paris"}'), wire: 'stop' },
      { choice: { kind: 'required' }, text: '[{"name": "get_weather", "parameters": {"', finish: 'stop', content: null, calls: call('{"'), wire: 'tool_calls' },
      { choice: { kind: 'required' }, text: '[{"name": "get_weather", "parameters": {"city": "Li', finish: 'length', content: null, calls: call('{"city": "Li'), wire: 'length' },
      { choice: { kind: 'required' }, text: '[{"na', finish: 'length', content: '[{"na', calls: [], wire: 'length' },
      { choice: { kind: 'auto' }, text: 'Checking. <tool_call>{"name": "get_weather", "arguments": {"ci', finish: 'length', content: 'Checking. ', calls: call('{"ci'), wire: 'length' },
      { choice: { kind: 'auto' }, text: 'Checking. <tool_call>{"na', finish: 'length', content: 'Checking. <tool_call>{"na', calls: [], wire: 'length' },
      { choice: { kind: 'auto' }, text: 'Just text.', finish: 'length', content: 'Just text.', calls: [], wire: 'length' },
    ];
    const meta = { id: 'chatcmpl-1', created: 0, model: 'm', systemFingerprint: 'fp' };
    for (const c of cases) {
      const label = `${c.choice.kind} ${c.finish} ${c.text}`;
      const streamed = new ToolChatShape(meta, 1, {} as TokenTexts, null, tools(c.choice), 'hermes');
      const calls: { name: string; arguments: string }[] = [];
      let content = '';
      let finish: string | null = null;
      for (let at = 0; at < c.text.length; at += 3) {
        const chunks = streamed.updateChunks({ index: 0, textDelta: c.text.slice(at, at + 3), logprobs: undefined,
          finishReason: at + 3 >= c.text.length ? c.finish : null, stopReason: null, tokens: 1 }, undefined) as
          { choices: { delta: { content?: string | null; tool_calls?: { index: number; id?: string; function: { name?: string; arguments: string } }[] }; finish_reason: string | null }[] }[];
        for (const { choices: [choice] } of chunks) {
          content += choice!.delta.content ?? '';
          for (const piece of choice!.delta.tool_calls ?? []) {
            if (piece.id !== undefined) calls.push({ name: piece.function.name!, arguments: piece.function.arguments });
            else calls[piece.index]!.arguments += piece.function.arguments;
          }
          finish = choice!.finish_reason ?? finish;
        }
      }
      const collected = new ToolChatShape(meta, 1, {} as TokenTexts, null, tools(c.choice), 'hermes');
      collected.collect({ index: 0, textDelta: c.text, logprobs: undefined, finishReason: c.finish, stopReason: null, tokens: 1 });
      const body = collected.body({ prompt_tokens: 1, completion_tokens: 1, total_tokens: 2, prompt_tokens_details: { cached_tokens: 0 } }) as
        { choices: { message: { content: string | null; tool_calls?: { function: { name: string; arguments: string } }[] }; finish_reason: string }[] };
      const [choice] = body.choices;
      assert.deepEqual(calls, c.calls, `${label}: streamed calls`);
      assert.deepEqual(choice!.message.tool_calls?.map((t) => t.function) ?? [], c.calls, `${label}: the body's calls`);
      assert.equal(content === '' ? null : content, c.content, `${label}: streamed content`);
      assert.equal(choice!.message.content, c.content, `${label}: the body's content`);
      assert.equal(finish, c.wire, `${label}: streamed finish_reason`);
      assert.equal(choice!.finish_reason, c.wire, `${label}: the body's finish_reason`);
    }
  });

  it('the parser is chosen from the chat template', () => {
    assert.equal(detectToolCallParser('{% for tool in tools %}<tool_call>{{ tool | tojson }}</tool_call>{% endfor %}'), 'hermes');
    assert.equal(detectToolCallParser('{{ "[AVAILABLE_TOOLS]" }}{{ "[TOOL_CALLS]" }}'), 'mistral');
    assert.equal(detectToolCallParser('{%- if message.role == "ipython" %}<|python_tag|>{% endif %}'), 'llama3_json');
    assert.equal(detectToolCallParser('{{ messages[0].content }}'), 'hermes');
  });

  it('tools, assistant tool_calls and tool results reach the chat template as HF passes them', () => {
    const template = new ChatTemplate({ templates: '{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}'
      + '{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }} '
      + '{{ c.function.arguments.city }}{% endfor %}{% endif %}{{ m.content }}{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}{% endfor %}' });
    const text = template.render([
      { role: 'user', content: 'Weather?' },
      { role: 'assistant', content: null, tool_calls: [{ id: 'c1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Oslo"}' } }] },
      { role: 'tool', content: 'sunny', tool_call_id: 'c1' },
    ], { tools: [{ type: 'function', function: { name: 'get_weather' } }] });
    assert.equal(text, '[tool get_weather]<user>Weather?<assistant>call get_weather Oslo<tool>sunny (c1)');
  });
});

const WEATHER_TOOL = {
  type: 'function' as const,
  function: {
    name: 'get_weather', description: 'Current weather',
    parameters: {
      type: 'object', properties: { city: { enum: ['Paris', 'Oslo', 'Rome'] }, days: { type: 'integer', minimum: 1, maximum: 7 } },
      required: ['city', 'days'], additionalProperties: false,
    },
  },
};
const PERSON_TOOL = { type: 'function' as const, function: { name: 'save_person', parameters: PERSON_SCHEMA } };
const FLAG_TOOL = {
  type: 'function' as const,
  function: { name: 'set_flag', parameters: { type: 'object', properties: { on: { type: 'boolean' } }, required: ['on'], additionalProperties: false } },
};

/**
 * Pydantic's schema of a model holding another: the inner model under $defs, referred to as "#/$defs/Address" (twice,
 * once in an Optional's anyOf), titles and a default beside. Bounded in every part, so a noise model's call ends.
 */
const REGISTER_PARAMETERS = {
  $defs: {
    Address: {
      properties: { street: { maxLength: 8, title: 'Street', type: 'string' }, zip: { maximum: 99999, minimum: 0, title: 'Zip', type: 'integer' } },
      required: ['street', 'zip'], title: 'Address', type: 'object',
    },
  },
  properties: {
    name: { maxLength: 8, title: 'Name', type: 'string' },
    home: { $ref: '#/$defs/Address' },
    work: { anyOf: [{ $ref: '#/$defs/Address' }, { type: 'null' }], default: null },
  },
  required: ['name', 'home', 'work'], title: 'Person', type: 'object',
};
const REGISTER_TOOL = { type: 'function' as const, function: { name: 'register', parameters: REGISTER_PARAMETERS } };
/** A recursive model: each node's child is a node again ("#", the tool's own root) or null. */
const TREE_PARAMETERS = {
  type: 'object',
  properties: { label: { type: 'integer', minimum: 0, maximum: 9 }, child: { anyOf: [{ $ref: '#' }, { type: 'null' }] } },
  required: ['label', 'child'], additionalProperties: false,
};
const TREE_TOOL = { type: 'function' as const, function: { name: 'tree', parameters: TREE_PARAMETERS } };

function assertWeatherArgs(args: string): void {
  const value = JSON.parse(args);
  assert.ok(['Paris', 'Oslo', 'Rome'].includes(value.city), args);
  assert.ok(Number.isInteger(value.days) && value.days >= 1 && value.days <= 7, args);
  assert.deepEqual(Object.keys(value).sort(), ['city', 'days']);
}

describe('tool calling through HTTP (synthetic model)', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;
  const messages = [
    { role: 'user' as const, content: 'What is the weather in Paris?' },
  ];

  before(async () => {
    server = await startTestServer();
    client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 90_000 });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('named tool choice: message.tool_calls with an id, the name and arguments fitting the schema', E2E, async () => {
    for (const [seed, temperature] of [[1, 0], [2, 1]] as const) {
      const response = await client.chat.completions.create({
        model, messages, seed, temperature, max_tokens: 64, tools: [WEATHER_TOOL, PERSON_TOOL],
        tool_choice: { type: 'function', function: { name: 'get_weather' } },
      });
      const choice = response.choices[0]!;
      // A named (forced) call ends with "stop", as OpenAI's and vLLM's do; "tool_calls" is for calls the model chose.
      assert.equal(choice.finish_reason, 'stop');
      assert.equal(choice.message.content, null);
      const calls = choice.message.tool_calls!;
      assert.equal(calls.length, 1);
      assert.match(calls[0]!.id, /^call_/);
      assert.equal(calls[0]!.type, 'function');
      assert.ok(calls[0]!.type === 'function');
      assert.equal(calls[0]!.function.name, 'get_weather');
      assertWeatherArgs(calls[0]!.function.arguments);
    }
  });

  it('with logprobs, a stream carries every token\'s logprob once, as the body does: held text and call tokens too', E2E, async () => {
    // The output forced by a regex: text, then a call in the Hermes format the auto parser reads.
    const forced = 'Ok <tool_call>\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}</tool_call>';
    for (const choice of ['auto', 'required'] as const) {
      const body = {
        model, messages, temperature: 0, max_tokens: 120, logprobs: true, top_logprobs: 1, tools: [WEATHER_TOOL], tool_choice: choice,
        ...(choice === 'auto' ? { guided_regex: forced } : {}),
      };
      const whole = await rawRequest(server.url, { path: '/v1/chat/completions', body });
      assert.equal(whole.status, 200, whole.text);
      const tokens = whole.json().usage.completion_tokens as number;
      assert.equal(whole.json().choices[0].logprobs.content.length, tokens, choice);
      if (choice === 'auto') assert.equal(whole.json().choices[0].finish_reason, 'tool_calls', whole.text);
      const streamed = await rawRequest(server.url, { path: '/v1/chat/completions', body: { ...body, stream: true } });
      const chunks = streamed.text.split('\n').filter((line) => line.startsWith('data: {')).map((line) => JSON.parse(line.slice(6)));
      const entries = chunks.flatMap((chunk) => chunk.choices[0]?.logprobs?.content ?? []);
      assert.deepEqual(entries.map((e: { token: string }) => e.token),
        whole.json().choices[0].logprobs.content.map((e: { token: string }) => e.token), `${choice}: the same tokens, in order`);
    }
  });

  it('named tool choice streamed: delta.tool_calls assemble to the non-streamed call', E2E, async () => {
    const body = {
      model, messages, seed: 3, temperature: 0.9, max_tokens: 64, tools: [WEATHER_TOOL],
      tool_choice: { type: 'function' as const, function: { name: 'get_weather' } },
    };
    const whole = await client.chat.completions.create(body);
    const stream = await client.chat.completions.create({ ...body, stream: true });
    const assembled = assembleToolCalls();
    for await (const chunk of stream) assembled.add(chunk);
    assert.equal(assembled.finishReason, 'stop');
    assert.equal(assembled.calls.length, 1);
    assert.equal(assembled.calls[0]!.name, 'get_weather');
    assert.equal(assembled.calls[0]!.arguments, whole.choices[0]!.message.tool_calls![0]!.type === 'function'
      ? whole.choices[0]!.message.tool_calls![0]!.function.arguments : '');
    assertWeatherArgs(assembled.calls[0]!.arguments);
  });

  it('required: one call (parallel_tool_calls false) to one of the tools, non-streamed and streamed', E2E, async () => {
    for (const seed of [4, 5]) {
      const body = { model, messages, seed, temperature: 1, max_tokens: 120, tools: [WEATHER_TOOL, FLAG_TOOL],
        tool_choice: 'required' as const, parallel_tool_calls: false };
      const response = await client.chat.completions.create(body);
      const choice = response.choices[0]!;
      assert.equal(choice.finish_reason, 'tool_calls', JSON.stringify(choice));
      const calls = choice.message.tool_calls!;
      assert.equal(calls.length, 1);
      const call = calls[0]!;
      assert.ok(call.type === 'function');
      if (call.function.name === 'get_weather') assertWeatherArgs(call.function.arguments);
      else { assert.equal(call.function.name, 'set_flag'); assert.equal(typeof JSON.parse(call.function.arguments).on, 'boolean'); }

      const stream = await client.chat.completions.create({ ...body, stream: true });
      const assembled = assembleToolCalls();
      for await (const chunk of stream) assembled.add(chunk);
      assert.equal(assembled.finishReason, 'tool_calls');
      assert.deepEqual(assembled.calls, [{ name: call.function.name, arguments: call.function.arguments }]);
    }
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

  it('a tool whose parameters name no type ({}, or none at all) is called with an arguments object, named or required', E2E, async () => {
    // A function's arguments are an object: "parameters": {} (a tool without arguments, as clients often write it)
    // decodes as one, as vLLM's "required" grammar takes an empty schema for {"type": "object", "properties": {}}.
    const tools = [
      { type: 'function', function: { name: 'ping', parameters: {} } },
      { type: 'function', function: { name: 'now' } },
    ];
    for (const seed of [1, 2, 3]) {
      for (const toolChoice of [{ type: 'function', function: { name: 'ping' } }, 'required']) {
        const response = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
          model, messages, seed, temperature: 1, max_tokens: 24, tools, tool_choice: toolChoice, parallel_tool_calls: false,
        } });
        assert.equal(response.status, 200, response.text);
        const choice = response.json().choices[0];
        const args = choice.message.tool_calls[0].function.arguments as string;
        const label = `${JSON.stringify(toolChoice)} seed ${seed}: ${args}`;
        // Cut off by max_tokens, the object is still being written (or not begun); finished, it parses to one.
        if (args !== '' || choice.finish_reason !== 'length') assert.match(args, /^\s*\{/, label);
        if (choice.finish_reason !== 'length') assert.ok(isJsonObject(JSON.parse(args)), label);
      }
    }
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

  it('required and named: references inside a tool\'s parameters ($defs, "#") resolve in its own schema; the arguments fit it', E2E, async () => {
    const schemas: Record<string, object> = { register: REGISTER_PARAMETERS, tree: TREE_PARAMETERS };
    let finished = 0;
    for (const seed of [1, 2, 3]) {
      for (const toolChoice of ['required', { type: 'function', function: { name: 'register' } }, { type: 'function', function: { name: 'tree' } }]) {
        const response = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
          model, messages, seed, temperature: 1, max_tokens: 300, tools: [WEATHER_TOOL, REGISTER_TOOL, TREE_TOOL], tool_choice: toolChoice,
          parallel_tool_calls: false,
        } });
        assert.equal(response.status, 200, `${JSON.stringify(toolChoice)}: ${response.text}`);
        const choice = response.json().choices[0];
        if (choice.finish_reason === 'length') continue; // (a deep tree)
        finished++;
        const calls = choice.message.tool_calls;
        assert.equal(calls.length, 1, response.text);
        const { name, arguments: args } = calls[0].function;
        if (typeof toolChoice === 'object') assert.equal(name, toolChoice.function.name);
        if (name === 'get_weather') assertWeatherArgs(args);
        else assert.deepEqual(schemaErrors(schemas[name], JSON.parse(args)), [], `${name}: ${args}`);
      }
    }
    assert.ok(finished >= 6, `only ${finished} of 9 calls ended`);
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

  it('required and named: an integer enum past 2^53 is produced with its digits as written, not rounded', E2E, async () => {
    // Raw text, since a JavaScript client would round the numbers before sending them. Both values are one double
    // (1234567890123456768): JSON.parse made one enum value of them, and the grammar produced 1234567890123456800.
    const values = ['1234567890123456789', '1234567890123456790'];
    const tool = `{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"id": {"type": "integer", `
      + `"enum": [${values.join(', ')}]}}, "required": ["id"], "additionalProperties": false}}}`;
    const seen = new Set<string>();
    for (const [choice, seed] of [['{"type": "function", "function": {"name": "lookup"}}', 1], ['"required"', 2], ['"required"', 3], ['{"type": "function", "function": {"name": "lookup"}}', 4]] as const) {
      const body = `{"model": "${model}", "messages": [{"role": "user", "content": "find it"}], "max_tokens": 400, "temperature": 1, `
        + `"seed": ${seed}, "tools": [${tool}], "tool_choice": ${choice}}`;
      const response = await rawRequest(server.url, { path: '/v1/chat/completions', body });
      assert.equal(response.status, 200, response.text);
      const calls = response.json().choices[0].message.tool_calls;
      assert.equal(calls.length >= 1, true, response.text);
      for (const call of calls) {
        const id = /^\{\s*"id"\s*:\s*(-?\d+)\s*\}$/.exec(call.function.arguments)?.[1];
        assert.ok(id !== undefined && values.includes(id), `${choice}: ${call.function.arguments}`);
        seen.add(id);
      }
    }
    assert.ok(seen.size > 0);
  });

  it("required streamed through the openai client's stream helper: the call opens with its name, its arguments follow in fragments", E2E, async () => {
    const body = { model, messages, seed: 6, temperature: 1, max_tokens: 120, tools: [WEATHER_TOOL, FLAG_TOOL],
      tool_choice: 'required' as const, parallel_tool_calls: false };
    const whole = await client.chat.completions.create(body);
    assert.equal(whole.choices[0]!.finish_reason, 'tool_calls', JSON.stringify(whole.choices[0]));
    const stream = client.chat.completions.stream(body);
    let fragments = 0;
    let named = false;
    stream.on('chunk', (chunk) => {
      for (const delta of chunk.choices[0]?.delta.tool_calls ?? []) {
        if (delta.id !== undefined) named = true;
        else if (delta.function?.arguments) {
          assert.ok(named, 'arguments only after the call was named');
          fragments++;
        }
      }
    });
    const final = await stream.finalChatCompletion();
    const simplify = (calls: OpenAI.ChatCompletionMessageToolCall[] | undefined) =>
      (calls ?? []).map((call) => call.type === 'function' ? { name: call.function.name, arguments: call.function.arguments } : call);
    assert.equal(final.choices[0]!.finish_reason, 'tool_calls');
    assert.deepEqual(simplify(final.choices[0]!.message.tool_calls), simplify(whole.choices[0]!.message.tool_calls));
    assert.ok(fragments >= 2, `arguments in ${fragments} fragments`);
  });

  it('auto on a model that writes no call: the text is content, finish_reason stop or length', E2E, async () => {
    const response = await client.chat.completions.create({ model, messages, seed: 1, max_tokens: 12, tools: [WEATHER_TOOL] });
    const choice = response.choices[0]!;
    assert.ok(choice.finish_reason === 'stop' || choice.finish_reason === 'length');
    assert.equal(typeof choice.message.content, 'string');
    assert.equal(choice.message.tool_calls, undefined);
    // tool_choice none: plain chat.
    const none = await client.chat.completions.create({ model, messages, seed: 1, max_tokens: 12, tools: [WEATHER_TOOL], tool_choice: 'none' });
    assert.equal(none.choices[0]!.message.tool_calls, undefined);
  });

  it("tool results go to the model's template: one without a tool role refuses them with a 400, and the server goes on", E2E, async () => {
    // The built-in model has Llama 2's template, which raises on any role but system/user/assistant.
    const response = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
      model, max_tokens: 4, tools: [WEATHER_TOOL], messages: [
        ...messages,
        { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Paris","days":1}' } }] },
        { role: 'tool', tool_call_id: 'call_1', content: '{"sky":"clear"}' },
      ],
    } });
    assert.equal(response.status, 400, response.text);
    assert.equal(response.json().error.param, 'messages');
    assert.match(response.json().error.message, /chat template refused/);
    const after = await client.chat.completions.create({ model, messages, max_tokens: 2 });
    assert.equal(after.choices.length, 1);
  });

  it("the openai client's helpers: chat.completions.parse and runTools", E2E, async () => {
    const format = makeParseableResponseFormat(
      { type: 'json_schema', json_schema: { name: 'person', schema: PERSON_SCHEMA as unknown as Record<string, unknown>, strict: true } },
      (content) => JSON.parse(content) as Record<string, unknown>);
    const parsed = await client.chat.completions.parse({ model, messages, seed: 8, max_tokens: 300, response_format: format });
    assertPerson(parsed.choices[0]!.message.parsed);

    const seen: unknown[] = [];
    const runner = client.chat.completions.runTools({
      model, messages, seed: 9, max_tokens: 64,
      tool_choice: { type: 'function', function: { name: 'get_weather' } },
      tools: [{ type: 'function', function: {
        name: 'get_weather', description: 'Current weather', parameters: WEATHER_TOOL.function.parameters,
        parse: (args: string) => JSON.parse(args) as { city: string; days: number },
        function: (args: { city: string; days: number }) => { seen.push(args); return { sky: 'clear' }; },
      } }],
    });
    await runner.done();
    assert.equal(seen.length, 1);
    assertWeatherArgs(JSON.stringify(seen[0]));
  });

  it('bad tool definitions and choices are a 400 naming the field, and cost nothing', E2E, async () => {
    const cases: [object, string][] = [
      [{ tools: [{ type: 'function', function: {} }] }, 'tools[0].function.name'],
      [{ tools: [{ type: 'function', function: { name: 'has space' } }] }, 'tools[0].function.name'],
      [{ tools: [{ type: 'retrieval' }] }, 'tools[0].type'],
      [{ tools: [{ type: 'function' }] }, 'tools[0].function'],
      [{ tools: [WEATHER_TOOL, WEATHER_TOOL] }, 'tools[1].function.name'],
      [{ tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'array' } } }] }, 'tools[0].function.parameters.type'],
      // A schema a grammar cannot enforce is refused where the output is decoded under it: "required", or its tool named.
      [{ tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object', properties: { a: { not: {} } } } } }], tool_choice: 'required' },
        'tools[0].function.parameters.properties.a.not'],
      [{ tools: [WEATHER_TOOL, { type: 'function', function: { name: 'f', parameters: { type: 'object', properties: { a: { uniqueItems: true } } } } }],
        tool_choice: { type: 'function', function: { name: 'f' } } }, 'tools[1].function.parameters.properties.a.uniqueItems'],
      [{ tools: [WEATHER_TOOL], tool_choice: { type: 'function', function: { name: 'nope' } } }, 'tool_choice.function.name'],
      [{ tool_choice: 'required' }, 'tool_choice'],
      [{ tools: [WEATHER_TOOL], tool_choice: 'sometimes' }, 'tool_choice'],
      [{ tools: [WEATHER_TOOL], tool_choice: 'required', response_format: { type: 'json_object' } }, 'response_format.type'],
    ];
    for (const [extra, param] of cases) {
      const response = await rawRequest(server.url, { path: '/v1/chat/completions', body: { model, messages, max_tokens: 4, ...extra } });
      assert.equal(response.status, 400, `${JSON.stringify(extra)}: ${response.text}`);
      assert.equal(response.json().error.param, param, response.text);
    }
    await waitFor(() => engineIdle(server.engine), 'nothing running');
  });

  it('under "auto" and "none" a tool\'s schema only goes to the template: keywords no grammar enforces are accepted', E2E, async () => {
    // pydantic's set[str] gives uniqueItems; generated schemas often carry not / if-then-else / patternProperties.
    const loose = { type: 'function', function: { name: 'tag', parameters: { type: 'object', properties: {
      tags: { type: 'array', items: { type: 'string' }, uniqueItems: true }, n: { type: 'integer', multipleOf: 2, not: { const: 0 } },
    } } } };
    for (const choice of [undefined, 'auto', 'none']) {
      const response = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
        model, messages, max_tokens: 4, tools: [WEATHER_TOOL, loose], ...(choice ? { tool_choice: choice } : {}),
      } });
      assert.equal(response.status, 200, `${choice}: ${response.text}`);
    }
    // Naming another tool decodes under that tool's schema only: the loose one is still just for the template.
    const named = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
      model, messages, max_tokens: 4, tools: [WEATHER_TOOL, loose], tool_choice: { type: 'function', function: { name: WEATHER_TOOL.function.name } },
    } });
    assert.equal(named.status, 200, named.text);
    await waitFor(() => engineIdle(server.engine), 'nothing running');
  });
});

/** Assembles streamed delta.tool_calls by index, as clients do. */
function assembleToolCalls() {
  const calls: { name: string; arguments: string }[] = [];
  const ids: string[] = [];
  return {
    calls,
    finishReason: null as string | null,
    add(chunk: OpenAI.ChatCompletionChunk) {
      const choice = chunk.choices[0];
      if (!choice) return;
      for (const delta of choice.delta.tool_calls ?? []) {
        if (delta.id !== undefined) {
          assert.equal(calls[delta.index], undefined, 'an id opens each call once');
          ids[delta.index] = delta.id;
          calls[delta.index] = { name: delta.function?.name ?? '', arguments: '' };
        }
        calls[delta.index]!.arguments += delta.function?.arguments ?? '';
      }
      if (choice.finish_reason) this.finishReason = choice.finish_reason;
    },
  };
}

describe('a --chat-template that renders tools (synthetic model)', () => {
  let server: TestServer;
  let model: string;
  const template = '{% if tools %}{% for t in tools %}<tool>{{ t.function.name }}: {{ t.function.description }}</tool>\n{% endfor %}{% endif %}'
    + '{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}';

  before(async () => {
    server = await startTestServer({ flags: ['--chat-template', template] });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('renders chat with it, and /tokenize counts the tools as chat completions do', E2E, async () => {
    const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];
    const post = (path: string, body: object) => rawRequest(server.url, { path, body });
    const chat = await post('/v1/chat/completions', { model, messages, tools: [WEATHER_TOOL], max_tokens: 1 });
    assert.equal(chat.status, 200, chat.text);
    const withTools = await post('/tokenize', { model, messages, tools: [WEATHER_TOOL] });
    assert.equal(withTools.status, 200, withTools.text);
    assert.equal(withTools.json().count, chat.json().usage.prompt_tokens);
    const rendered = (await post('/detokenize', { model, tokens: withTools.json().tokens })).json().prompt as string;
    assert.match(rendered, /<tool>get_weather: Current weather<\/tool>\n\[user\] What is the weather in Paris\?\n\[assistant\]$/);
    const without = await post('/tokenize', { model, messages });
    assert.ok(without.json().count < withTools.json().count, 'the tools are part of the prompt');
    const bad = await post('/tokenize', { model, messages, tools: [{ type: 'function' }] });
    assert.equal(bad.status, 400, bad.text);
    assert.match(bad.json().error.param, /^tools/);
  });
});

describe('a Mistral chat template (synthetic model)', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;
  // As Mistral's own templates do, a call's id and a tool result's tool_call_id must be nine letters and digits.
  const idCheck = (value: string) => `{% if ${value} is not defined or ${value}|length != 9 %}`
    + '{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}';
  const template = '{% for m in messages %}{% if m.role == "user" %}[INST] {{ m.content }}[/INST]'
    + `{% elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}${idCheck('c.id')}{{ c.function | tojson }} {{ c.id }}{% endfor %}]`
    + `{% elif m.role == "tool" %}${idCheck('m.tool_call_id')}[TOOL_RESULTS] {{ m.content }} {{ m.tool_call_id }}[/TOOL_RESULTS]`
    + '{% else %}{{ m.content }}{% endif %}{% endfor %}';

  before(async () => {
    server = await startTestServer({ flags: ['--chat-template', template] });
    client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 90_000 });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it("calls get ids the template takes back: a call and its tool result render on the next turn", E2E, async () => {
    const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: 'user', content: 'What is the weather in Paris?' }];
    const body = { model, messages, seed: 1, temperature: 0, max_tokens: 120, tools: [WEATHER_TOOL], parallel_tool_calls: false };
    const ids: string[] = [];
    for (const toolChoice of ['required', { type: 'function', function: { name: 'get_weather' } }] as const) {
      const whole = await client.chat.completions.create({ ...body, tool_choice: toolChoice });
      ids.push(whole.choices[0]!.message.tool_calls![0]!.id);
      const stream = await client.chat.completions.create({ ...body, tool_choice: toolChoice, stream: true });
      for await (const chunk of stream) {
        for (const piece of chunk.choices[0]?.delta.tool_calls ?? []) if (piece.id !== undefined) ids.push(piece.id);
      }
    }
    assert.equal(ids.length, 4);
    for (const id of ids) assert.match(id, /^[a-zA-Z0-9]{9}$/);
    const call = (await client.chat.completions.create({ ...body, tool_choice: 'required' })).choices[0]!.message;
    const next = await client.chat.completions.create({ model, max_tokens: 2, tools: [WEATHER_TOOL], messages: [
      ...messages,
      { role: 'assistant', content: null, tool_calls: call.tool_calls },
      { role: 'tool', tool_call_id: call.tool_calls![0]!.id, content: '{"sky": "clear"}' },
    ] });
    assert.equal(next.choices.length, 1);
  });

  it("ids of another shape in the messages (OpenAI's call_...) reach the template cut to their last nine characters", E2E, async () => {
    const messages = [
      { role: 'user', content: 'What is the weather in Paris?' },
      { role: 'assistant', content: null, tool_calls: [{ id: 'call_8f2a61c0d94e4b7fa3c5', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris", "days": 1}' } }] },
      { role: 'tool', tool_call_id: 'call_8f2a61c0d94e4b7fa3c5', content: '{"sky": "clear"}' },
    ];
    const chat = await rawRequest(server.url, { path: '/v1/chat/completions', body: { model, max_tokens: 2, tools: [WEATHER_TOOL], messages } });
    assert.equal(chat.status, 200, chat.text);
    const tokenized = await rawRequest(server.url, { path: '/tokenize', body: { model, tools: [WEATHER_TOOL], messages } });
    assert.equal(tokenized.status, 200, tokenized.text);
    assert.equal(tokenized.json().count, chat.json().usage.prompt_tokens);
    const rendered = (await rawRequest(server.url, { path: '/detokenize', body: { model, tokens: tokenized.json().tokens } })).json().prompt as string;
    // A call and its result cut alike, so they still pair.
    assert.ok(rendered.includes('e4b7fa3c5]') && rendered.includes('{"sky": "clear"} e4b7fa3c5[/TOOL_RESULTS]'), rendered);
  });

  it('auto reads the calls of Mistral\'s newer format ([TOOL_CALLS]name[ARGS]{...}), in the body as in the stream', E2E, async () => {
    const tools = [WEATHER_TOOL, FLAG_TOOL];
    // The output forced by a regex: text, then two calls in the format of Mistral's v11 and later tokenizers.
    const forced = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]set_flag[ARGS]{"on": true}';
    const escaped = forced.replace(/[{}[\]()|.*+?^$\\]/g, '\\$&');
    const body = { model, messages: [{ role: 'user' as const, content: 'Weather in Rome?' }], max_tokens: 200, temperature: 0, tools,
      guided_regex: escaped };
    const whole = await client.chat.completions.create(body);
    const choice = whole.choices[0]!;
    assert.equal(choice.finish_reason, 'tool_calls', JSON.stringify(choice));
    assert.equal(choice.message.content, 'Checking.');
    const simplify = (calls: OpenAI.ChatCompletionMessageToolCall[] | undefined) =>
      (calls ?? []).map((call) => call.type === 'function' ? { name: call.function.name, arguments: call.function.arguments } : call);
    assert.deepEqual(simplify(choice.message.tool_calls),
      [{ name: 'get_weather', arguments: '{"city": "Rome", "days": 2}' }, { name: 'set_flag', arguments: '{"on": true}' }]);
    const stream = await client.chat.completions.create({ ...body, stream: true });
    const assembled = assembleToolCalls();
    let content = '';
    for await (const chunk of stream) {
      assembled.add(chunk);
      content += chunk.choices[0]?.delta.content ?? '';
    }
    assert.equal(assembled.finishReason, 'tool_calls');
    assert.equal(content, 'Checking.');
    assert.deepEqual(assembled.calls, simplify(choice.message.tool_calls));
  });
});
