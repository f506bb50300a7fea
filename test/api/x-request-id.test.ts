// The X-Request-Id request header, as vLLM takes it: chat and completion responses are named by it (chatcmpl-<id>,
// cmpl-<id>, every chunk too), before a request_id in the body, and every answer to the request, refusals included,
// carries it back in x-request-id. The server's own id still names the trace and the engine requests, so requests
// reusing an id never collide; the trace is found by the client's id too. vLLM's request_id in the body names a
// request the same way when no header does (the response id, the trace lookup), by the same rules: an id the header
// could not carry is a 400 naming request_id.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { parseSse, rawRequest } from './http-client.ts';

const KEY = 'sk-xrid-main-0001';
const OTHER_KEY = 'sk-xrid-other-0002';
const auth = { Authorization: `Bearer ${KEY}` };
const messages = [{ role: 'user' as const, content: 'Tell me about the sea.' }];
const E2E = { timeout: 90_000 };

describe('X-Request-Id names the request', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;

  before(async () => {
    server = await startTestServer({ keysFile: `${KEY} main\n${OTHER_KEY} other\n` });
    client = new OpenAI({ apiKey: KEY, baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('openai client: a chat completion is named by the header, which comes back as its request id', E2E, async () => {
    const { data, response, request_id } = await client.chat.completions
      .create({ model, messages, max_tokens: 4 }, { headers: { 'X-Request-Id': 'sdk-chat-1' } }).withResponse();
    assert.equal(data.id, 'chatcmpl-sdk-chat-1');
    assert.equal(request_id, 'sdk-chat-1');
    assert.equal(response.headers.get('x-request-id'), 'sdk-chat-1');
    assert.equal((data as unknown as { _request_id: string })._request_id, 'sdk-chat-1');
  });

  it('openai client: every chunk of a stream carries the id, chat and completions', E2E, async () => {
    const { data: chat, response } = await client.chat.completions.create(
      { model, messages, max_tokens: 4, stream: true, stream_options: { include_usage: true } },
      { headers: { 'X-Request-Id': 'sdk-stream-1' } }).withResponse();
    assert.equal(response.headers.get('x-request-id'), 'sdk-stream-1');
    let chunks = 0;
    for await (const chunk of chat) {
      assert.equal(chunk.id, 'chatcmpl-sdk-stream-1');
      chunks++;
    }
    assert.ok(chunks > 1, 'a stream of several chunks');
    const completion = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 3, stream: true },
      { headers: { 'X-Request-Id': 'sdk-stream-2' } });
    for await (const chunk of completion) assert.equal(chunk.id, 'cmpl-sdk-stream-2');
  });

  it('the header goes before a request_id in the body; without the header the body names the response', E2E, async () => {
    const both = await rawRequest(server.url, {
      path: '/v1/completions', headers: { ...auth, 'X-Request-Id': 'from-header' },
      body: { model, prompt: 'hello', max_tokens: 2, request_id: 'from-body' },
    });
    assert.equal(both.status, 200, both.text);
    assert.equal(both.json().id, 'cmpl-from-header');
    assert.equal(both.headers['x-request-id'], 'from-header');
    const body = await rawRequest(server.url, { path: '/v1/completions', headers: auth, body: { model, prompt: 'hello', max_tokens: 2, request_id: 'from-body' } });
    assert.equal(body.json().id, 'cmpl-from-body');
    assert.match(String(body.headers['x-request-id']), /^cmpl-[0-9a-f]+$/, 'the server id, which finds the trace');
    const none = await rawRequest(server.url, { path: '/v1/chat/completions', headers: { ...auth, 'X-Request-Id': '  ' }, body: { model, messages, max_tokens: 2 } });
    assert.match(none.json().id, /^chatcmpl-[0-9a-f]+$/, 'an empty header is none');
    assert.equal(none.headers['x-request-id'], none.json().id);
  });

  it('/v1/responses echoes the header but, as vLLM, is not named by it', E2E, async () => {
    const res = await rawRequest(server.url, { path: '/v1/responses', headers: { ...auth, 'X-Request-Id': 'resp-hdr' }, body: { model, input: 'hi', max_output_tokens: 2 } });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.headers['x-request-id'], 'resp-hdr');
    assert.match(res.json().id, /^resp_[0-9a-f]+$/);
    for (const id of ['resp-hdr', res.json().id]) {
      const trace = await rawRequest(server.url, { path: `/v1/requests/${id}/trace`, headers: auth });
      assert.equal(trace.status, 200, trace.text);
      assert.equal(trace.json().request_id, res.json().id, 'the header and the response id find the trace');
    }
  });

  it('refusals carry the header back too: a 400, a 401', E2E, async () => {
    const invalid = await rawRequest(server.url, {
      path: '/v1/chat/completions', headers: { ...auth, 'X-Request-Id': 'bad-1' }, body: { model, messages, temperature: 9 },
    });
    assert.equal(invalid.status, 400, invalid.text);
    assert.equal(invalid.headers['x-request-id'], 'bad-1');
    const unauthorized = await rawRequest(server.url, { path: '/v1/chat/completions', headers: { 'X-Request-Id': 'bad-2' }, body: { model, messages } });
    assert.equal(unauthorized.status, 401, unauthorized.text);
    assert.equal(unauthorized.headers['x-request-id'], 'bad-2');
  });

  it('an id longer than a request_id may be is refused, naming the header', E2E, async () => {
    const long = 'x'.repeat(257);
    const res = await rawRequest(server.url, { path: '/v1/completions', headers: { ...auth, 'X-Request-Id': long }, body: { model, prompt: 'hi', max_tokens: 2 } });
    assert.equal(res.status, 400, res.text);
    assert.equal(res.json().error.param, 'x-request-id');
    assert.match(String(res.headers['x-request-id']), /^cmpl-[0-9a-f]+$/);
    const longest = await rawRequest(server.url, {
      path: '/v1/completions', headers: { ...auth, 'X-Request-Id': 'y'.repeat(256) }, body: { model, prompt: 'hi', max_tokens: 2 },
    });
    assert.equal(longest.status, 200, longest.text);
    assert.equal(longest.json().id, `cmpl-${'y'.repeat(256)}`);
  });

  it('requests reusing an id run side by side; the trace is found by it (the newest), by its tenant only', E2E, async () => {
    const send = (prompt: string) => rawRequest(server.url, {
      path: '/v1/completions', headers: { ...auth, 'X-Request-Id': 'shared-id' }, body: { model, prompt, max_tokens: 8, ignore_eos: true, stream: true },
    });
    const [first, second] = await Promise.all([send('one request'), send('another request')]);
    for (const res of [first, second]) {
      assert.equal(res.status, 200, res.text);
      assert.equal(res.headers['x-request-id'], 'shared-id');
      const events = parseSse(res.text).filter((e) => e.data !== '[DONE]').map((e) => JSON.parse(e.data));
      assert.ok(events.length > 0 && events.every((e) => e.id === 'cmpl-shared-id'), res.text);
      assert.ok(!res.text.includes('"error"'), res.text);
    }
    const latest = await rawRequest(server.url, {
      path: '/v1/completions', headers: { ...auth, 'X-Request-Id': 'shared-id' }, body: { model, prompt: 'the last one', max_tokens: 2 },
    });
    assert.equal(latest.status, 200, latest.text);
    const trace = await rawRequest(server.url, { path: '/v1/requests/shared-id/trace', headers: auth });
    assert.equal(trace.status, 200, trace.text);
    const view = trace.json();
    assert.match(view.request_id, /^cmpl-[0-9a-f]+$/, 'the trace keeps the server id');
    assert.equal(view.usage.prompt_tokens, latest.json().usage.prompt_tokens, 'the newest request with that id');
    assert.equal(view.usage.completion_tokens, 2);
    const byResponseId = await rawRequest(server.url, { path: '/v1/requests/cmpl-shared-id/trace', headers: auth });
    assert.equal(byResponseId.json().request_id, view.request_id, 'the response id finds it too');
    const console = await rawRequest(server.url, { path: '/console/api/requests/shared-id', headers: auth });
    assert.equal(console.status, 200, console.text);
    assert.equal(console.json().request_id, view.request_id);
    const other = await rawRequest(server.url, { path: '/v1/requests/shared-id/trace', headers: { Authorization: `Bearer ${OTHER_KEY}` } });
    assert.equal(other.status, 404, other.text);
    assert.equal(other.json().error.code, 'trace_not_found');
  });

  /** The trace a lookup by `id` finds (its server id), or the lookup's 404. */
  const traceOf = async (id: string) => {
    const res = await rawRequest(server.url, { path: `/v1/requests/${encodeURIComponent(id)}/trace`, headers: auth });
    return res.status === 200 ? res.json().request_id as string : `${res.status} ${res.json().error.code}`;
  };
  /** Waits for the trace of the request the server named `serverId` to be stored (its end follows the last byte). */
  const finished = (serverId: string) => waitFor(() => server.running.api.telemetry.trace(serverId) !== undefined, `the trace of ${serverId}`);
  /** What a lookup by `id` finds once the request it names has ended (for a request whose server id is not known). */
  const traceFound = async (id: string): Promise<string> => {
    for (let tries = 1; ; tries++) {
      const found = await traceOf(id);
      if (!found.startsWith('404') || tries === 100) return found;
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
  };

  it('openai client: a body request_id names the response, and the trace is found by it and by the response id', E2E, async () => {
    const { data, response } = await client.chat.completions.create(
      { model, messages, max_tokens: 4, request_id: 'body-chat-1' } as OpenAI.ChatCompletionCreateParamsNonStreaming).withResponse();
    assert.equal(data.id, 'chatcmpl-body-chat-1');
    const serverId = response.headers.get('x-request-id')!;
    assert.match(serverId, /^chatcmpl-[0-9a-f]+$/, 'x-request-id stays the server\'s id: vLLM echoes only a header there');
    await finished(serverId);
    assert.equal(await traceOf('body-chat-1'), serverId);
    assert.equal(await traceOf('chatcmpl-body-chat-1'), serverId);

    const { data: stream, response: streamed } = await client.completions.create(
      { model, prompt: 'Once upon a time', max_tokens: 3, stream: true, request_id: 'body-cmpl-1' } as OpenAI.CompletionCreateParamsStreaming).withResponse();
    for await (const chunk of stream) assert.equal(chunk.id, 'cmpl-body-cmpl-1');
    const streamId = streamed.headers.get('x-request-id')!;
    await finished(streamId);
    assert.equal(await traceOf('body-cmpl-1'), streamId);
    assert.equal(await traceOf('cmpl-body-cmpl-1'), streamId);
    assert.equal(await traceOf('chatcmpl-body-cmpl-1'), '404 trace_not_found', 'the prefix of the endpoint that served it only');

    // A refusal is found by its body's id too, as by its header: the id was read before the field that failed.
    const refused = await rawRequest(server.url, {
      path: '/v1/chat/completions', headers: auth, body: { model, messages, temperature: 9, request_id: 'body-refused-1' },
    });
    assert.equal(refused.status, 400, refused.text);
    assert.equal(refused.json().error.param, 'temperature');
    await finished(String(refused.headers['x-request-id']));
    assert.equal(await traceOf('body-refused-1'), refused.headers['x-request-id']);
  });

  it('/v1/responses: the body request_id, its response id, finds the trace, beside a header', E2E, async () => {
    const sdk = await client.responses.create(
      { model, input: 'hi', max_output_tokens: 2, request_id: 'body-resp-1' } as OpenAI.Responses.ResponseCreateParamsNonStreaming).withResponse();
    assert.equal(sdk.data.id, 'body-resp-1');
    const serverId = sdk.response.headers.get('x-request-id')!;
    assert.match(serverId, /^resp_[0-9a-f]+$/);
    await finished(serverId);
    assert.equal(await traceOf('body-resp-1'), serverId);
    const both = await rawRequest(server.url, {
      path: '/v1/responses', headers: { ...auth, 'X-Request-Id': 'resp-hdr-2' }, body: { model, input: 'hi', max_output_tokens: 2, request_id: 'body-resp-2' },
    });
    assert.equal(both.status, 200, both.text);
    assert.equal(both.json().id, 'body-resp-2', 'as vLLM: the body names a response, the header does not');
    assert.equal(both.headers['x-request-id'], 'resp-hdr-2');
    const bothId = await traceFound('resp-hdr-2');
    assert.match(bothId, /^resp_[0-9a-f]+$/);
    assert.equal(await traceOf('body-resp-2'), bothId);
  });

  it('the header wins over a body request_id: the body\'s id then names nothing', E2E, async () => {
    const { data, response } = await client.chat.completions.create(
      { model, messages, max_tokens: 2, request_id: 'loser-body-1' } as OpenAI.ChatCompletionCreateParamsNonStreaming,
      { headers: { 'X-Request-Id': 'winner-hdr-1' } }).withResponse();
    assert.equal(data.id, 'chatcmpl-winner-hdr-1');
    assert.equal(response.headers.get('x-request-id'), 'winner-hdr-1');
    const serverId = await traceFound('winner-hdr-1');
    assert.match(serverId, /^chatcmpl-[0-9a-f]+$/);
    assert.equal(await traceOf('chatcmpl-winner-hdr-1'), serverId);
    assert.equal(await traceOf('loser-body-1'), '404 trace_not_found');
    assert.equal(await traceOf('chatcmpl-loser-body-1'), '404 trace_not_found');
  });

  it('a body request_id the header could not carry is refused like the header, naming request_id; the server goes on', E2E, async () => {
    const headerRefusal = await rawRequest(server.url, {
      path: '/v1/completions', headers: { ...auth, 'X-Request-Id': 'h'.repeat(257) }, body: { model, prompt: 'hi', max_tokens: 2 },
    });
    assert.equal(headerRefusal.status, 400, headerRefusal.text);
    const problemOf = (message: string) => message.replace(/^Invalid value for '[^']+': /, '');
    for (const [path, extra, why] of [
      ['/v1/completions', { prompt: 'hi' }, 'b'.repeat(257)],
      ['/v1/chat/completions', { messages }, 'b'.repeat(300)],
      ['/v1/responses', { input: 'hi' }, 'b'.repeat(257)],
      ['/v1/chat/completions', { messages }, 'line\nbreak'],
      ['/v1/completions', { prompt: 'hi' }, 'nul\u0000'],
    ] as const) {
      const res = await rawRequest(server.url, { path, headers: auth, body: { model, ...extra, request_id: why } });
      assert.equal(res.status, 400, res.text);
      const { error } = res.json();
      assert.deepEqual({ type: error.type, code: error.code, param: error.param },
        { type: 'invalid_request_error', code: 'invalid_value', param: 'request_id' }, res.text);
      assert.match(String(res.headers['x-request-id']), /^(cmpl-|chatcmpl-|resp_)[0-9a-f]+$/, 'answered under the server\'s id');
      if (why.length === 257) assert.equal(problemOf(error.message), problemOf(headerRefusal.json().error.message), 'the header\'s words');
      else if (why.length < 257) assert.match(error.message, /control character/, error.message);
    }
    await assert.rejects(client.completions.create({ model, prompt: 'hi', max_tokens: 2, request_id: 'r'.repeat(257) } as OpenAI.CompletionCreateParamsNonStreaming),
      (err: unknown) => err instanceof OpenAI.BadRequestError && err.param === 'request_id');
    const longest = await rawRequest(server.url, { path: '/v1/completions', headers: auth, body: { model, prompt: 'hi', max_tokens: 2, request_id: 'z'.repeat(256) } });
    assert.equal(longest.status, 200, longest.text);
    assert.equal(longest.json().id, `cmpl-${'z'.repeat(256)}`);
    const tab = await rawRequest(server.url, { path: '/v1/completions', headers: auth, body: { model, prompt: 'hi', max_tokens: 2, request_id: 'a\tb' } });
    assert.equal(tab.status, 200, 'a tab, which a header may hold, is taken');
    const health = await rawRequest(server.url, { path: '/health' });
    assert.equal(health.status, 200, health.text);
  });
});
