// Numbers in tool-call arguments reach the prompt as the client wrote them, as with vLLM (Python's json keeps an
// integer's digits and a float's ".0"). They were parsed into JavaScript numbers: a 64-bit id 1234567890123456789
// reached the model as 1234567890123456800 and 1.0 as 1. Checked through /tokenize and /detokenize with the
// tool-call parts of official templates (Qwen2.5's Hermes format, Llama 3.1's JSON, Mistral's [TOOL_CALLS]).

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 90_000 };

// Qwen2.5-7B-Instruct's tool calls (its template, as published).
const QWEN25_CALLS = '{%- for message in messages %}{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}'
  + '{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}'
  + '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
  + '{{- tool_call.arguments | tojson }}{{- \'}\\n</tool_call>\' }}{%- endfor %}{%- endif %}{%- endfor %}';
// Llama 3.1's JSON tool call (its template, as published).
const LLAMA31_CALL = '{%- for message in messages %}{%- if \'tool_calls\' in message %}'
  + '{%- set tool_call = message.tool_calls[0].function %}'
  + '{{- \'{"name": "\' + tool_call.name + \'", \' }}{{- \'"parameters": \' }}{{- tool_call.arguments | tojson }}{{- "}" }}'
  + '{%- endif %}{%- endfor %}';
// Mistral-7B-Instruct-v0.3's: the whole function object, its closing brace cut.
const MISTRAL_CALLS = '{%- for message in messages %}{%- if message.tool_calls is defined %}{{- "[TOOL_CALLS] [" }}'
  + '{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function|tojson %}{{- out[:-1] }}'
  + '{{- \', "id": "\' + tool_call.id + \'"}\' }}{%- endfor %}{{- "]" }}{%- endif %}{%- endfor %}';
// Qwen3-Coder's XML parameters: each value printed as a string.
const QWEN3_CODER_PARAMETERS = '{%- for message in messages %}{%- for tool_call in message.tool_calls or [] %}'
  + '{%- for args_name, args_value in tool_call.function.arguments|items %}{{- \'<parameter=\' + args_name + \'>\\n\' }}'
  + '{%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}'
  + '{{- args_value }}{{- \'\\n</parameter>\\n\' }}{%- endfor %}{%- endfor %}{%- endfor %}';

const ARGUMENTS = '{"user_id": 1234567890123456789, "t": 1.0, "big": 1e16, "small": 1.5e-7, "list": [0.5, 9007199254740993]}';
/** What Python's json.dumps(json.loads(ARGUMENTS)) writes, so what vLLM's prompt holds. */
const PYTHON_ARGUMENTS = '{"user_id": 1234567890123456789, "t": 1.0, "big": 1e+16, "small": 1.5e-07, "list": [0.5, 9007199254740993]}';

const CALL = { role: 'assistant', content: null, tool_calls: [{ id: 'a1b2c3d4e', type: 'function', function: { name: 'lookup', arguments: ARGUMENTS } }] };

describe('numbers in tool-call arguments reach the prompt as written', () => {
  const servers: Record<string, TestServer> = {};
  const templates = { qwen25: QWEN25_CALLS, llama31: LLAMA31_CALL, mistral: MISTRAL_CALLS, qwen3coder: QWEN3_CODER_PARAMETERS };

  before(async () => {
    for (const [name, template] of Object.entries(templates)) {
      servers[name] = await startTestServer({ flags: ['--chat-template', template] });
    }
  });
  after(async () => {
    for (const server of Object.values(servers)) await server.close();
  });

  async function render(name: keyof typeof templates, messages: unknown[]): Promise<string> {
    const url = servers[name]!.url;
    const tokenized = await rawRequest(url, { path: '/tokenize', body: { messages, add_generation_prompt: false } });
    assert.equal(tokenized.status, 200, tokenized.text);
    const text = await rawRequest(url, { path: '/detokenize', body: { tokens: tokenized.json().tokens } });
    return (text.json().prompt as string).replace(/^<s>\s*/, '');
  }

  it("Qwen2.5's Hermes format", E2E, async () => {
    assert.equal(await render('qwen25', [{ role: 'user', content: 'who?' }, CALL]),
      `\n<tool_call>\n{"name": "lookup", "arguments": ${PYTHON_ARGUMENTS}}\n</tool_call>`);
  });

  it("Llama 3.1's JSON format", E2E, async () => {
    assert.equal(await render('llama31', [CALL]), `{"name": "lookup", "parameters": ${PYTHON_ARGUMENTS}}`);
  });

  it("Mistral's [TOOL_CALLS], the arguments nested in the function object", E2E, async () => {
    assert.equal(await render('mistral', [CALL]),
      `[TOOL_CALLS] [{"name": "lookup", "arguments": ${PYTHON_ARGUMENTS}, "id": "a1b2c3d4e"}]`);
  });

  it("Qwen3-Coder's parameters, each number printed with | string", E2E, async () => {
    assert.equal(await render('qwen3coder', [CALL]), '<parameter=user_id>\n1234567890123456789\n</parameter>\n'
      + '<parameter=t>\n1.0\n</parameter>\n<parameter=big>\n1e+16\n</parameter>\n<parameter=small>\n1.5e-07\n</parameter>\n'
      + '<parameter=list>\n[0.5, 9007199254740993]\n</parameter>\n');
  });
});

// Qwen2.5's tools block (as published), then a kwarg and the documents as a template would print them.
const TOOLS_AND_VALUES = '{%- if tools %}{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}{%- endif %}'
  + '|{{ limit }}|{{ documents | tojson }}';

describe('numbers in tools, chat_template_kwargs and documents reach the prompt as written', () => {
  let server: TestServer;
  before(async () => {
    server = await startTestServer({ flags: ['--chat-template', TOOLS_AND_VALUES] });
  });
  after(async () => {
    await server?.close();
  });

  it('on /tokenize as on chat completions', E2E, async () => {
    // Raw text, since a JavaScript client would round the numbers before sending them.
    const body = '{"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false, '
      + '"tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": '
      + '{"id": {"type": "integer", "enum": [1234567890123456789], "minimum": 0.0, "default": 1e16}}}}}], '
      + '"chat_template_kwargs": {"limit": 9007199254740993}, "documents": [{"title": "t", "score": 2.50}]}';
    const expected = '\n{"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": '
      + '{"id": {"type": "integer", "enum": [1234567890123456789], "minimum": 0.0, "default": 1e+16}}}}}'
      + '|9007199254740993|[{"title": "t", "score": 2.5}]';
    const tokenized = await rawRequest(server.url, { path: '/tokenize', body });
    assert.equal(tokenized.status, 200, tokenized.text);
    const text = await rawRequest(server.url, { path: '/detokenize', body: { tokens: tokenized.json().tokens } });
    assert.equal((text.json().prompt as string).replace(/^<s>/, ''), expected);
    // A chat completion renders the same prompt (the same number of tokens).
    const chat = await rawRequest(server.url, { path: '/v1/chat/completions', body: body.replace('"add_generation_prompt": false, ', '"add_generation_prompt": false, "max_tokens": 1, ') });
    assert.equal(chat.status, 200, chat.text);
    assert.equal(chat.json().usage.prompt_tokens, tokenized.json().count);
  });
});
