// The fields of vLLM's ResponsesRequest on /v1/responses: request_id names the response as given (as vLLM's), and
// structured_outputs and include_stop_str_in_output work as on a chat completion; the ones this server has no use
// for (vLLM's extension, multimodal and disaggregation fields, stateless multi-turn), and chat completion fields
// that /v1/responses says another way or cannot show, are a 400 naming the field rather than silently dropped.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { parseSse, rawRequest } from './http-client.ts';

const E2E = { timeout: 90_000 };

describe('/v1/responses: vLLM request fields', () => {
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

  const respond = (body: object) => rawRequest(server.url, { path: '/v1/responses', body: { model, input: 'Tell me about the sea.', max_output_tokens: 4, ...body } });

  it('request_id is the response id as given, streamed or not; items keep ids of their own', E2E, async () => {
    const whole = await respond({ request_id: 'my-response-7' });
    assert.equal(whole.status, 200, whole.text);
    const body = whole.json();
    assert.equal(body.id, 'my-response-7');
    assert.match(String(whole.headers['x-request-id']), /^resp_[0-9a-f]+$/, 'the server id, which finds the trace');
    const again = (await respond({ request_id: 'my-response-7' })).json();
    assert.equal(again.id, 'my-response-7');
    assert.notEqual(again.output[0].id, body.output[0].id, 'two responses given one request_id share no item id');

    const streamed = await respond({ request_id: 'my-response-8', stream: true });
    const events = parseSse(streamed.text).map((event) => JSON.parse(event.data));
    const withResponse = events.filter((event) => event.response !== undefined);
    assert.deepEqual(withResponse.map((event) => event.type).slice(0, 2), ['response.created', 'response.in_progress']);
    assert.match(withResponse.at(-1).type, /^response\.(completed|incomplete)$/);
    for (const event of withResponse) assert.equal(event.response.id, 'my-response-8');

    const sdk = await client.responses.create({ model, input: 'hi', max_output_tokens: 2, request_id: 'sdk-response' } as OpenAI.Responses.ResponseCreateParamsNonStreaming);
    assert.equal(sdk.id, 'sdk-response');
    const tooLong = await respond({ request_id: 'r'.repeat(257) });
    assert.equal(tooLong.status, 400, tooLong.text);
    assert.equal(tooLong.json().error.param, 'request_id');
  });

  it('structured_outputs constrains the output, and cannot be combined with text.format', E2E, async () => {
    const choices = ['yes', 'no', 'maybe'];
    for (const temperature of [0, 1]) {
      const res = await respond({ structured_outputs: { choice: choices }, max_output_tokens: 8, temperature, seed: 3 });
      assert.equal(res.status, 200, res.text);
      assert.ok(choices.includes(res.json().output[0].content[0].text), res.text);
    }
    const plain = await respond({ structured_outputs: { regex: 'ab+' }, text: { format: { type: 'text' } }, max_output_tokens: 6 });
    assert.equal(plain.status, 200, plain.text);
    assert.match(plain.json().output[0].content[0].text, /^ab*$/);
    const both = await respond({
      structured_outputs: { choice: choices }, text: { format: { type: 'json_schema', name: 'x', schema: { type: 'object' } } },
    });
    assert.equal(both.status, 400, both.text);
    assert.equal(both.json().error.param, 'structured_outputs');
  });

  it('include_stop_str_in_output keeps the stop string, as the chat completion does', E2E, async () => {
    const messages = [{ role: 'user', content: 'Tell me about the sea.' }];
    const chat = (extra: object) => rawRequest(server.url, { path: '/v1/chat/completions', body: { model, messages, max_tokens: 16, temperature: 0, ...extra } })
      .then((res) => res.json().choices[0].message.content as string);
    const free = await chat({ ignore_eos: true });
    assert.ok(free.length >= 6, `a greedy output long enough to stop inside (${JSON.stringify(free)})`);
    const stop = free.slice(3, 5);
    for (const include of [true, false]) {
      const expected = await chat({ ignore_eos: true, stop: [stop], include_stop_str_in_output: include });
      assert.equal(expected.endsWith(stop), include, JSON.stringify({ expected, stop }));
      const res = await respond({ max_output_tokens: 16, temperature: 0, ignore_eos: true, stop: [stop], include_stop_str_in_output: include });
      assert.equal(res.status, 200, res.text);
      assert.equal(res.json().output[0].content[0].text, expected);
    }
  });

  it('prompt_cache_key and the default service tiers are taken; another tier is refused', E2E, async () => {
    for (const extra of [{ prompt_cache_key: 'conversation-1' }, { service_tier: 'auto' }, { service_tier: 'default' }]) {
      const res = await respond(extra);
      assert.equal(res.status, 200, `${JSON.stringify(extra)}: ${res.text}`);
    }
    const flex = await respond({ service_tier: 'flex' });
    assert.equal(flex.status, 400, flex.text);
    assert.equal(flex.json().error.param, 'service_tier');
    const wrongType = await respond({ prompt_cache_key: 5 });
    assert.equal(wrongType.status, 400, wrongType.text);
    assert.equal(wrongType.json().error.param, 'prompt_cache_key');
  });

  it('fields it has no use for are refused by name, never dropped', E2E, async () => {
    const refused: [string, unknown][] = [
      // vLLM's ResponsesRequest
      ['vllm_xargs', { a: 1 }], ['kv_transfer_params', { do_remote_decode: true }], ['mm_processor_kwargs', {}],
      ['media_io_kwargs', {}], ['enable_response_messages', true], ['previous_input_messages', []], ['previous_response', {}],
      // chat completion fields
      ['messages', [{ role: 'user', content: 'hi' }]], ['max_tokens', 4], ['max_completion_tokens', 4],
      ['response_format', { type: 'json_object' }], ['guided_json', { type: 'object' }], ['guided_regex', 'a+'],
      ['guided_choice', ['a', 'b']], ['guided_grammar', 'root ::= "a"'], ['reasoning_effort', 'low'], ['n', 2],
      ['logprobs', true], ['prompt_logprobs', 1], ['return_token_ids', true], ['return_tokens_as_token_ids', true],
      ['truncate_prompt_tokens', 8], ['add_generation_prompt', false], ['continue_final_message', true],
      ['add_special_tokens', true], ['documents', []], ['echo', true],
      // refused on every generation endpoint
      ['bad_words', ['sea']], ['allowed_token_ids', [1, 2]], ['logits_processors', ['x']], ['use_beam_search', true],
    ];
    for (const [field, value] of refused) {
      const res = await respond({ [field]: value });
      assert.equal(res.status, 400, `${field}: ${res.text}`);
      const { error } = res.json();
      assert.equal(error.param, field, res.text);
      assert.equal(error.code, 'unsupported_parameter', res.text);
    }
  });
});
