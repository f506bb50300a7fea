// More of vLLM's request fields, against the real server on the built-in model: request_id names the response
// ("cmpl-<id>", "chatcmpl-<id>", every chunk too) while the server's own id keeps naming the request (x-request-id,
// its trace), so two requests with one request_id do not collide; spaces_between_special_tokens is taken and changes
// nothing (the detokenizer never spaces special tokens off); /tokenize's return_token_strs lists each token's
// vocabulary entry; and a stop string with a lone UTF-16 surrogate, which could never match, is a 400 naming stop.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI, { BadRequestError } from 'openai';
import { rawRequest } from './http-client.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 90_000 };

/** The JSON events of an SSE body, [DONE] left out. */
function events(text: string): any[] {
  return text.split('\n').filter((line) => line.startsWith('data: ') && line !== 'data: [DONE]').map((line) => JSON.parse(line.slice(6)));
}

describe('vLLM\'s request_id, spaces_between_special_tokens, return_token_strs, and stop strings that cannot match', () => {
  let server: TestServer;
  let model: string;
  const post = (path: string, body: object) => rawRequest(server.url, { path, body: { model, ...body } });
  const chat = [{ role: 'user', content: 'Hello there' }];

  before(async () => {
    server = await startTestServer();
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('request_id names the response, streamed or not; the server\'s id stays in x-request-id and the trace', E2E, async () => {
    const completion = await post('/v1/completions', { prompt: 'Hi', max_tokens: 2, request_id: 'job-42' });
    assert.equal(completion.status, 200, completion.text);
    assert.equal(completion.json().id, 'cmpl-job-42');
    const serverId = completion.headers['x-request-id'] as string;
    assert.match(serverId, /^cmpl-[0-9a-f]{24}$/);
    await waitFor(() => server.running.api.telemetry.trace(serverId) !== undefined, 'the trace under the server\'s id');

    const answer = await post('/v1/chat/completions', { messages: chat, max_tokens: 2, request_id: 'job-43' });
    assert.equal(answer.json().id, 'chatcmpl-job-43');
    const streamed = await post('/v1/chat/completions', {
      messages: chat, max_tokens: 3, stream: true, stream_options: { include_usage: true }, request_id: 'job-44',
    });
    const chunks = events(streamed.text);
    assert.ok(chunks.length >= 3);
    for (const chunk of chunks) assert.equal(chunk.id, 'chatcmpl-job-44');
    const streamedCompletion = await post('/v1/completions', { prompt: 'Hi', max_tokens: 2, stream: true, request_id: 'job-45' });
    for (const chunk of events(streamedCompletion.text)) assert.equal(chunk.id, 'cmpl-job-45');

    // Without one (or with an empty one) the response keeps the server's id.
    for (const extra of [{}, { request_id: '' }]) {
      const own = await post('/v1/completions', { prompt: 'Hi', max_tokens: 1, ...extra });
      assert.equal(own.json().id, own.headers['x-request-id']);
    }
  });

  it('requests that share a request_id run side by side, each answered under it', E2E, async () => {
    const answers = await Promise.all([0, 1, 2].map(() =>
      post('/v1/completions', { prompt: ['One', 'Two'], n: 2, max_tokens: 4, ignore_eos: true, request_id: 'same' })));
    for (const answer of answers) {
      assert.equal(answer.status, 200, answer.text);
      assert.equal(answer.json().id, 'cmpl-same');
      assert.equal(answer.json().choices.length, 4);
    }
    assert.equal(new Set(answers.map((a) => a.headers['x-request-id'])).size, 3, 'each its own server id');
    await waitFor(() => engineIdle(server.engine), 'nothing running');
  });

  it('refuses a request_id that is not a string, or too long', E2E, async () => {
    for (const [path, body] of [
      ['/v1/completions', { prompt: 'Hi', request_id: 42 }],
      ['/v1/chat/completions', { messages: chat, request_id: 'x'.repeat(257) }],
    ] as const) {
      const res = await post(path, { max_tokens: 1, ...body });
      assert.equal(res.status, 400, res.text);
      assert.equal(res.json().error.param, 'request_id');
    }
  });

  it('spaces_between_special_tokens is taken and changes nothing; it must be a boolean', E2E, async () => {
    // Special tokens kept in the text, one after another: the output is forced to EOS (</s>, id 2) six times.
    const base = {
      prompt: [1, 15043, 3186], max_tokens: 6, ignore_eos: true, logit_bias: { 2: 100 }, skip_special_tokens: false,
    };
    const texts = [];
    for (const spaces of [undefined, true, false]) {
      const res = await post('/v1/completions', { ...base, ...(spaces === undefined ? {} : { spaces_between_special_tokens: spaces }) });
      assert.equal(res.status, 200, res.text);
      texts.push(res.json().choices[0].text);
    }
    assert.equal(texts[0], '</s>'.repeat(6));
    assert.equal(texts[1], texts[0]);
    assert.equal(texts[2], texts[0]);
    const wrong = await post('/v1/chat/completions', { messages: chat, max_tokens: 1, spaces_between_special_tokens: 'no' });
    assert.equal(wrong.status, 400);
    assert.equal(wrong.json().error.param, 'spaces_between_special_tokens');
  });

  it('/tokenize with return_token_strs lists each token\'s vocabulary entry', E2E, async () => {
    const res = await post('/tokenize', { prompt: 'Hello world\n', return_token_strs: true });
    assert.equal(res.status, 200, res.text);
    const body = res.json();
    assert.deepEqual(body.tokens, [1, 15043, 3186, 13]);
    assert.deepEqual(body.token_strs, ['<s>', '▁Hello', '▁world', '<0x0A>']);
    assert.equal(body.count, 4);
    const messages = await post('/tokenize', { messages: chat, return_token_strs: true });
    assert.equal(messages.json().token_strs.length, messages.json().tokens.length);
    const plain = await post('/tokenize', { prompt: 'Hello world' });
    assert.equal('token_strs' in plain.json(), false);
    const wrong = await post('/tokenize', { prompt: 'Hello', return_token_strs: 1 });
    assert.equal(wrong.status, 400);
    assert.equal(wrong.json().error.param, 'return_token_strs');
  });

  it('a stop string with a lone surrogate is a 400 naming stop; whole characters outside the BMP are taken', E2E, async () => {
    const cases: [string, object][] = [
      ['/v1/completions', { prompt: 'Hi', stop: '\ud83d' }],
      ['/v1/completions', { prompt: 'Hi', stop: ['ok', 'a\udc00b'] }],
      ['/v1/chat/completions', { messages: chat, stop: ['\ude00\ud83d'] }],
      ['/v1/chat/completions', { messages: chat, stop: 'end\ud83d' }],
    ];
    for (const [path, body] of cases) {
      const res = await post(path, { max_tokens: 2, ...body });
      assert.equal(res.status, 400, res.text);
      const { error } = res.json();
      assert.equal(error.type, 'invalid_request_error');
      assert.equal(error.param, 'stop');
      assert.match(error.message, /surrogate/);
    }
    const whole = await post('/v1/completions', { prompt: 'Hi', max_tokens: 2, stop: ['\ud83d\ude00', 'é'] });
    assert.equal(whole.status, 200, whole.text);

    const client = new OpenAI({ apiKey: 'none', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
    await assert.rejects(client.chat.completions.create({ model, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2, stop: ['\ud800'] }),
      (err: unknown) => err instanceof BadRequestError && (err.error as { param?: string }).param === 'stop');
    await waitFor(() => engineIdle(server.engine), 'nothing running');
  });
});
