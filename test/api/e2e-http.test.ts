// Raw HTTP against the real server and engine: SSE bytes and headers, status codes, a corpus of bad requests that
// must cost nothing, tenant accounting, disconnects, timeouts, overload and graceful shutdown.

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { request as httpRequest } from 'node:http';
import { connect } from 'node:net';
import { after, before, describe, it } from 'node:test';
import OpenAI, { APIError } from 'openai';
import { ADMIN_KEY, engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { parseSse, rawRequest, type RawResponse } from './http-client.ts';
import { openCompletionStream } from '../helpers/http-stream.ts';

const KEY = 'sk-http-main-0001';
const SOLO_KEY = 'sk-http-solo-0002';
const CUT_KEY = 'sk-http-cut-00003';
const CORPUS_KEY = 'sk-http-corpus-04';
const auth = (key = KEY): Record<string, string> => ({ Authorization: `Bearer ${key}` });
const user = [{ role: 'user', content: 'Describe a lighthouse.' }];

/** Opens a completion stream; resolves once its first event has arrived, with a way to hang up. */
/** A hang guard, not a speed requirement. */
const E2E = { timeout: 90_000 };

describe('HTTP API end to end', () => {
  let server: TestServer;
  let model: string;

  before(async () => {
    server = await startTestServer({
      keysFile: `${KEY} main 1000 1000000\n${SOLO_KEY} solo - - 1\n${CUT_KEY} cut - 100000 1\n${CORPUS_KEY} corpus 1000 1000000\n`,
    });
    model = server.running.api.gateway.servedModelName!;
  });

  after(async () => {
    await server?.close();
  });

  const post = (path: string, body: unknown, key = KEY): Promise<RawResponse> =>
    rawRequest(server.url, { path, headers: auth(key), body: body as object });

  it('streams SSE with the right headers and framing, ending in [DONE]', E2E, async () => {
    const res = await post('/v1/chat/completions', { model, messages: user, max_tokens: 5, temperature: 0, stream: true });
    assert.equal(res.status, 200);
    assert.match(String(res.headers['content-type']), /^text\/event-stream/);
    assert.equal(res.headers['cache-control'], 'no-cache');
    assert.equal(res.headers['x-accel-buffering'], 'no');
    assert.match(String(res.headers['x-request-id']), /^chatcmpl-/);
    const events = parseSse(res.text);
    assert.equal(events.at(-1)!.data, '[DONE]');
    assert.equal(events.filter((e) => e.data === '[DONE]').length, 1);
    const chunks = events.slice(0, -1).map((e) => JSON.parse(e.data));
    assert.ok(chunks.every((c) => c.id === chunks[0].id && c.object === 'chat.completion.chunk'));
    assert.equal(chunks.filter((c) => c.choices[0]?.finish_reason).length, 1, 'one finishing chunk');
    assert.ok(res.text.split('\n\n').slice(0, -1).every((block) => block.startsWith('data: ')));
  });

  it('streamed and non-streamed completions agree for the same seed, echo included', E2E, async () => {
    const body = { model, prompt: 'The harbour at dawn', max_tokens: 10, temperature: 0.9, seed: 55, echo: true };
    const whole = (await post('/v1/completions', body)).json();
    const streamed = parseSse((await post('/v1/completions', { ...body, stream: true })).text)
      .filter((e) => e.data !== '[DONE]').map((e) => JSON.parse(e.data));
    const text = streamed.map((c) => c.choices[0]?.text ?? '').join('');
    assert.equal(text, whole.choices[0].text);
    assert.ok(whole.choices[0].text.startsWith('The harbour at dawn'), 'echo puts the prompt first');
  });

  it('a stop string found only when the output\'s end flushes a broken character ends it with finish_reason stop', E2E, async () => {
    // One byte-fallback token, 0xE6 (the lead byte of a 3-byte character): at the end it decodes as U+FFFD, the stop.
    const byteToken = 3 + 0xe6;
    const res = await post('/v1/completions', { model, prompt: 'Hi', max_tokens: 1, logit_bias: { [byteToken]: 100 }, stop: ['\ufffd'] });
    assert.equal(res.status, 200, res.text);
    const [choice] = res.json().choices;
    assert.deepEqual({ text: choice.text, finish: choice.finish_reason, stop: choice.stop_reason }, { text: '', finish: 'stop', stop: '\ufffd' });
  });

  it('completes a batch of prompts with n choices each', E2E, async () => {
    const res = (await post('/v1/completions', { model, prompt: ['Red', 'Blue'], n: 2, max_tokens: 3, temperature: 1, seed: 3 })).json();
    assert.deepEqual(res.choices.map((c: { index: number }) => c.index), [0, 1, 2, 3]);
    const single = (await post('/v1/completions', { model, prompt: 'Blue', n: 2, max_tokens: 3, temperature: 1, seed: 3 })).json();
    assert.deepEqual(res.choices.slice(2).map((c: { text: string }) => c.text), single.choices.map((c: { text: string }) => c.text),
      'each prompt samples as it would alone');
  });

  it('refuses a corpus of bad requests with a 4xx naming the problem, and they cost nothing', E2E, async () => {
    const corpusTenant = server.running.keyStore.authenticate(`Bearer ${CORPUS_KEY}`);
    const budgetBefore = server.running.api.limiter.remaining(corpusTenant);
    const big = Buffer.alloc(10 * 1024 * 1024, 0x61);
    const corpus: { body: string | Buffer | object; path?: string; status: number; param?: string | null; code?: string }[] = [
      { body: '{', status: 400, code: 'invalid_json' },
      { body: 'null', status: 400, param: 'body' },
      { body: Buffer.from([0x7b, 0x22, 0xff, 0x22, 0x7d]), status: 400, code: 'invalid_utf8' },
      { body: { model, messages: [] }, status: 400, param: 'messages' },
      { body: { model, messages: [{ role: 'captain', content: 'x' }] }, status: 400, param: 'messages[0].role' },
      { body: { model, messages: [{ role: 'user', content: 42 }] }, status: 400, param: 'messages[0].content' },
      { body: { model, messages: user, max_tokens: -1 }, status: 400, param: 'max_tokens' },
      { body: { model, messages: user, max_tokens: 1e300 }, status: 400, param: 'max_tokens' },
      { body: { model, messages: user, temperature: 'warm' }, status: 400, param: 'temperature' },
      { body: { model, messages: user, n: 0 }, status: 400, param: 'n' },
      { body: { model, messages: user, logit_bias: { 99999999: 5 } }, status: 400, param: 'logit_bias.99999999' },
      { body: { model, messages: user, tool_choice: 'required' }, status: 400, param: 'tool_choice' },
      { body: { model, messages: user, response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'objekt' } } } }, status: 400,
        param: 'response_format.json_schema.schema.type' },
      { body: { model, messages: [{ role: 'tool', content: 'x', tool_call_id: 'a' }] }, status: 400, param: 'messages',
        code: 'chat_template_error' },
      { body: { model: 'gpt-9', messages: user }, status: 404, param: 'model' },
      { body: { model, prompt: 'x '.repeat(5000) }, path: '/v1/completions', status: 400, code: 'context_length_exceeded' },
      { body: { model, prompt: [1, 2, -3] }, path: '/v1/completions', status: 400, param: 'prompt[2]' },
      { body: { model, prompt: [] }, path: '/v1/completions', status: 400, param: 'prompt' },
      { body: { model, messages: user, stream: true, stream_options: 7 }, status: 400, param: 'stream_options' },
      { body: big, status: 413, code: 'body_too_large' },
    ];
    for (const entry of corpus) {
      const res = await post(entry.path ?? '/v1/chat/completions', entry.body, CORPUS_KEY);
      const what = `${typeof entry.body === 'object' && !Buffer.isBuffer(entry.body) ? JSON.stringify(entry.body).slice(0, 80) : 'raw body'}`;
      assert.equal(res.status, entry.status, `${what}: ${res.text}`);
      const error = res.json().error;
      assert.equal(typeof error.message, 'string');
      assert.ok(error.message.length > 10, what);
      if (entry.param !== undefined) assert.equal(error.param, entry.param, `${what}: ${error.message}`);
      if (entry.code !== undefined) assert.equal(error.code, entry.code, `${what}: ${error.message}`);
    }
    assert.equal((await rawRequest(server.url, { path: '/live' })).status, 200);
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
    // The rate-limit clock stands still in this test, so any request or token taken would show.
    assert.deepEqual(server.running.api.limiter.remaining(corpusTenant), budgetBefore, 'no request or token was taken');
    assert.equal(server.running.api.limiter.inFlight(corpusTenant), 0);
    const ok = await post('/v1/completions', { model, prompt: 'ok', max_tokens: 1 }, CORPUS_KEY);
    assert.equal(ok.status, 200);
    assert.equal(ok.headers['x-ratelimit-limit-requests'], '1000');
    assert.equal(Number(ok.headers['x-ratelimit-remaining-requests']), budgetBefore.requests - 1);
  });

  it('reserves prompt + max_tokens at admission and returns what was not used', E2E, async () => {
    const main = server.running.keyStore.authenticate(`Bearer ${KEY}`);
    const remainingBefore = server.running.api.limiter.remaining(main).tokens;
    const first = await post('/v1/completions', { model, prompt: 'Tide', max_tokens: 50, temperature: 0, stop: [' '] });
    const usage = first.json().usage;
    assert.equal(Number(first.headers['x-ratelimit-remaining-tokens']), remainingBefore - (usage.prompt_tokens + 50),
      'the whole possible use is reserved while the request runs');
    const second = await post('/v1/completions', { model, prompt: 'Tide', max_tokens: 1 });
    assert.equal(Number(second.headers['x-ratelimit-remaining-tokens']),
      remainingBefore - (usage.prompt_tokens + usage.completion_tokens) - (usage.prompt_tokens + 1),
      'only the tokens really used stayed spent');
    assert.match(String(second.headers['x-ratelimit-reset-tokens']), /^\d+(\.\d+)?(ms|s)$/);
  });

  it('caps requests in flight per tenant with 429', E2E, async () => {
    const long = await openCompletionStream(server.url, { model, prompt: 'Go on', max_tokens: 1500, ignore_eos: true }, { key: SOLO_KEY });
    const second = await post('/v1/completions', { model, prompt: 'me too', max_tokens: 1 }, SOLO_KEY);
    long.hangUp();
    assert.equal(second.status, 429);
    assert.equal(second.json().error.code, 'concurrency_limit_exceeded');
    assert.equal(second.headers['retry-after'], '1');
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
  });

  it('a client hanging up mid-stream aborts the request: blocks, slot and unused tokens come back', E2E, async () => {
    const cut = server.running.keyStore.authenticate(`Bearer ${CUT_KEY}`);
    const stream = await openCompletionStream(server.url, { model, prompt: 'Count the waves', max_tokens: 1500, ignore_eos: true }, { key: CUT_KEY });
    assert.equal(server.running.api.limiter.inFlight(cut), 1);
    stream.hangUp();
    await waitFor(() => engineIdle(server.engine), 'the aborted request to leave the engine');
    await waitFor(() => server.running.api.limiter.inFlight(cut) === 0, 'the concurrency slot to come back');
    // Far fewer than 1500 tokens were generated before the hang-up; the rest of the reservation is back.
    assert.ok(server.running.api.limiter.remaining(cut).tokens > 100000 - 1000);
    const next = await post('/v1/completions', { model, prompt: 'again', max_tokens: 1 }, CUT_KEY);
    assert.equal(next.status, 200, 'the single slot is free again');
  });

  it('a client hanging up on a non-streamed request aborts it too', E2E, async () => {
    const req = httpRequest(new URL('/v1/completions', server.url), {
      method: 'POST', headers: { ...auth(), 'Content-Type': 'application/json' },
    });
    req.on('error', () => {});
    req.end(JSON.stringify({ model, prompt: 'Long story', max_tokens: 1500, ignore_eos: true }));
    await waitFor(() => server.engine.stats().numRunning > 0, 'the request to start');
    req.destroy();
    await waitFor(() => engineIdle(server.engine), 'the aborted request to leave the engine');
  });

  it('requests pipelined on a connection that closes are aborted too, the one queued behind the other included', E2E, async () => {
    // The second request's response waits for the first's; Node gives it no 'close' of its own when the connection
    // dies. Streamed or not, its run must end and give its concurrency slot back.
    const main = server.running.keyStore.authenticate(`Bearer ${KEY}`);
    for (const stream of [true, false]) {
      const url = new URL(server.url);
      const socket = connect(Number(url.port), url.hostname);
      socket.on('error', () => {});
      const request = (body: object) => {
        const json = JSON.stringify({ model, prompt: 'Long story', max_tokens: 1500, ignore_eos: true, ...body });
        return `POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${KEY}\r\nContent-Type: application/json\r\n`
          + `Content-Length: ${Buffer.byteLength(json)}\r\n\r\n${json}`;
      };
      socket.write(request({}) + request({ stream }));
      await waitFor(() => server.engine.stats().numRunning + server.engine.stats().numWaiting === 2, 'both requests to reach the engine');
      socket.destroy();
      await waitFor(() => engineIdle(server.engine), 'both to leave the engine');
      await waitFor(() => server.running.api.limiter.inFlight(main) === 0, 'both concurrency slots to come back');
    }
  });

  it('keeps tenants out of each other\'s prefix cache', E2E, async () => {
    const prompt = `Shared preamble: ${'the quick brown fox jumps over the lazy dog, '.repeat(6)}and then`;
    const ask = async (key: string): Promise<number> => {
      const res = await post('/v1/completions', { model, prompt, max_tokens: 1 }, key);
      assert.equal(res.status, 200, res.text);
      return res.json().usage.prompt_tokens_details.cached_tokens;
    };
    await ask(KEY);
    const sameTenant = await ask(KEY);
    const otherTenant = await ask(SOLO_KEY);
    assert.ok(sameTenant >= server.engine.info.blockSize, `the same tenant reuses its blocks (cached ${sameTenant})`);
    assert.equal(otherTenant, 0, 'another tenant starts cold');
  });

  it('keeps each tenant to its own traces; the admin key sees all, and alone sees server-wide reports', E2E, async () => {
    const res = await post('/v1/completions', { model, prompt: 'Mine alone', max_tokens: 2 });
    assert.equal(res.status, 200);
    const id = res.json().id;
    const trace = (key: string): Promise<RawResponse> => rawRequest(server.url, { path: `/v1/requests/${id}/trace`, headers: auth(key) });
    await waitFor(() => server.running.api.telemetry.trace(id) !== undefined, 'the trace to be stored');
    assert.equal((await trace(KEY)).status, 200, 'its own tenant reads it');
    const other = await trace(CORPUS_KEY);
    const unknown = await rawRequest(server.url, { path: '/v1/requests/cmpl-000000000000000000000000/trace', headers: auth(CORPUS_KEY) });
    assert.equal(other.status, 404, 'another tenant gets a 404, as for an id that does not exist');
    assert.equal(other.json().error.code, 'trace_not_found');
    assert.equal(other.json().error.message.replace(id, '<id>'), unknown.json().error.message.replace('cmpl-000000000000000000000000', '<id>'));
    assert.equal((await trace(ADMIN_KEY)).status, 200, 'the admin key reads every tenant\'s');

    for (const path of ['/v1/slo', '/v1/analysis', '/metrics']) {
      assert.equal((await rawRequest(server.url, { path })).status, 401, `${path} without a key`);
      const tenant = await rawRequest(server.url, { path, headers: auth(KEY) });
      assert.equal(tenant.status, 403, `${path} with a tenant's key`);
      assert.equal(tenant.json().error.code, 'admin_required');
      assert.equal((await rawRequest(server.url, { path, headers: auth(ADMIN_KEY) })).status, 200, `${path} with the admin key`);
    }
  });

  it('answers 404 for a model it does not serve', E2E, async () => {
    const res = await rawRequest(server.url, { path: '/v1/models/gpt-imaginary', headers: auth() });
    assert.equal(res.status, 404);
    assert.equal(res.json().error.code, 'model_not_found');
  });

  it('tokenizes and detokenizes', E2E, async () => {
    const tokens = (await post('/tokenize', { model, prompt: 'Hello world' })).json();
    assert.equal(tokens.count, tokens.tokens.length);
    const bare = (await post('/tokenize', { prompt: 'Hello world', add_special_tokens: false })).json();
    assert.equal(bare.count, tokens.count - 1, 'add_special_tokens adds BOS');
    assert.equal((await post('/detokenize', { tokens: tokens.tokens })).json().prompt, '<s> Hello world', 'special tokens kept');
    assert.equal((await post('/detokenize', { tokens: bare.tokens })).json().prompt, 'Hello world');
    assert.equal((await post('/tokenize', { model: 'other', prompt: 'x' })).status, 404);
  });

  it('/detokenize decodes at most 16 contexts of ids: a longer list is a quick 400 naming tokens', E2E, async () => {
    const maxModelLen = (await post('/tokenize', { prompt: 'x' })).json().max_model_len as number;
    const limit = 16 * maxModelLen;
    const atLimit = await post('/detokenize', { tokens: new Array<number>(limit).fill(1) });
    assert.equal(atLimit.status, 200, atLimit.text);
    // Some 900k ids: the most a 4 MiB body holds, which took the event loop most of a second to decode.
    const started = performance.now();
    const tooMany = await post('/detokenize', { tokens: new Array<number>(Math.max(900_000, limit + 1)).fill(1) });
    assert.equal(tooMany.status, 400, tooMany.text);
    const { error } = tooMany.json() as { error: { code: string; param: string; message: string } };
    assert.equal(error.code, 'invalid_value');
    assert.equal(error.param, 'tokens');
    assert.match(error.message, new RegExp(`at most ${limit} token ids .*got ${Math.max(900_000, limit + 1)}`));
    assert.ok(performance.now() - started < 2000, `answered in ${Math.round(performance.now() - started)} ms`);
    assert.equal((await post('/detokenize', { tokens: [1] })).status, 200, 'the server stays up');
  });

  it('reports health with the kernel backend, and engine gauges in /metrics', E2E, async () => {
    const health = await rawRequest(server.url, { path: '/health' });
    assert.equal(health.status, 200);
    const body = health.json();
    assert.equal(body.ready, true);
    assert.equal(body.model, model);
    assert.equal(body.backend, server.engine.info.backend);
    assert.deepEqual(body.kernel_variants, server.engine.info.kernelVariants);
    const metrics = (await rawRequest(server.url, { path: '/metrics', headers: auth(ADMIN_KEY) })).text;
    assert.match(metrics, new RegExp(`^conduit_kv_cache_capacity_blocks\\{model="${model}"\\} ${server.engine.stats().kvBlocksTotal}$`, 'm'));
    assert.match(metrics, new RegExp(`^conduit_request_generation_tokens_total\\{model="${model}",worker="worker-0",tenant="main"\\} [1-9]\\d*$`, 'm'));
  });

  it('answers GET /version with the package\'s version, without a key (vLLM\'s endpoint)', E2E, async () => {
    const version = await rawRequest(server.url, { path: '/version' });
    assert.equal(version.status, 200, version.text);
    const pkg = JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8')) as { version: string };
    assert.deepEqual(version.json(), { version: pkg.version });
  });
});

describe('HTTP API end to end: timeouts, overload', () => {
  let server: TestServer;
  let model: string;

  before(async () => {
    server = await startTestServer({ flags: ['--request-timeout', '0.5', '--max-pending-requests', '1'] });
    model = server.running.api.gateway.servedModelName!;
  });

  after(async () => {
    await server?.close();
  });

  it('a timeout after the stream began arrives as an SSE error event, then [DONE]', E2E, async () => {
    const res = await rawRequest(server.url, {
      path: '/v1/completions', body: { model, prompt: 'Never ending', max_tokens: 2040, ignore_eos: true, stream: true },
    });
    assert.equal(res.status, 200);
    const events = parseSse(res.text);
    assert.equal(events.at(-1)!.data, '[DONE]');
    const error = events.at(-2)!;
    assert.equal(error.event, 'error');
    assert.equal(JSON.parse(error.data).error.code, 'request_timeout');
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
  });

  it('the official client raises the stream\'s error event as an APIError', E2E, async () => {
    const client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
    const stream = await client.completions.create({
      model, prompt: 'Never ending', max_tokens: 2040, stream: true, ignore_eos: true,
    } as OpenAI.CompletionCreateParamsStreaming);
    let chunks = 0;
    await assert.rejects((async () => { for await (const _ of stream) chunks++; })(),
      (err: unknown) => err instanceof APIError && (err.error as { code?: string }).code === 'request_timeout');
    assert.ok(chunks > 0, 'the stream had begun');
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
  });

  it('refuses work beyond the pending bound with 503 and Retry-After', E2E, async () => {
    const first = await openCompletionStream(server.url, { model, prompt: 'Busy', max_tokens: 1900, ignore_eos: true }, { key: 'unused' });
    const second = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: 'x', max_tokens: 1 } });
    first.hangUp();
    assert.equal(second.status, 503);
    assert.equal(second.json().error.code, 'server_overloaded');
    assert.ok(Number(second.headers['retry-after']) >= 1);
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
  });
});

describe('HTTP API end to end: graceful shutdown', () => {
  const stream = (server: TestServer, prompt: string): Promise<RawResponse> => rawRequest(server.url, {
    path: '/v1/completions',
    body: { model: server.running.api.gateway.servedModelName!, prompt, max_tokens: 1900, ignore_eos: true, stream: true },
  });

  it('keeps listening while it drains: /health 503 draining, new requests 503 shutting_down with Retry-After', E2E, async () => {
    const server = await startTestServer();
    try {
      const streamed = stream(server, 'Last words');
      await waitFor(() => server.engine.stats().numRunning === 1, 'the stream to start');
      const stopping = server.running.api.shutdown(60_000);
      const health = await rawRequest(server.url, { path: '/health' });
      assert.equal(health.status, 503);
      assert.equal(health.json().status, 'draining');
      assert.equal(health.headers.connection, 'close', 'answers while draining close their connection');
      const refused = await rawRequest(server.url, { path: '/v1/completions', body: { prompt: 'x', max_tokens: 1 } });
      assert.equal(refused.status, 503);
      assert.equal(refused.json().error.code, 'shutting_down');
      assert.ok(Number(refused.headers['retry-after']) >= 1, 'Retry-After is set');
      assert.equal((await rawRequest(server.url, { path: '/live' })).status, 200, 'still alive while draining');
      // A second signal ends the grace period: the stream still running is cut and told so.
      server.running.api.endGrace();
      const events = parseSse((await streamed).text);
      assert.equal(events.at(-1)!.data, '[DONE]');
      const error = JSON.parse(events.at(-2)!.data).error;
      assert.equal(error.code, 'shutting_down');
      assert.match(error.message, /second stop signal ended its 60 s shutdown grace period early/);
      assert.doesNotMatch(error.message, /takes no new requests/);
      await stopping;
      await assert.rejects(rawRequest(server.url, { path: '/live' }), 'the port is closed');
    } finally {
      await server.close();
    }
  });

  it('a stream still running when the grace period runs out ends with an error event that says so', E2E, async () => {
    const server = await startTestServer();
    try {
      const streamed = stream(server, 'Last words');
      await waitFor(() => server.engine.stats().numRunning === 1, 'the stream to start');
      const stopping = server.running.api.shutdown(100);
      const events = parseSse((await streamed).text);
      assert.equal(events.at(-1)!.data, '[DONE]');
      const error = JSON.parse(events.at(-2)!.data).error;
      assert.equal(error.code, 'shutting_down');
      assert.match(error.message, /its 0\.1 s shutdown grace period ran out/);
      await stopping;
      await assert.rejects(rawRequest(server.url, { path: '/live' }), 'the port is closed');
    } finally {
      await server.close();
    }
  });
});

describe('HTTP API end to end: sequences (prompts x n)', () => {
  let server: TestServer;
  let model: string;

  before(async () => {
    server = await startTestServer({ flags: ['--max-pending-requests', '4', '--max-sequences-per-request', '4'] });
    model = server.running.api.gateway.servedModelName!;
  });

  after(async () => {
    await server?.close();
  });

  it('refuses a request that asks for more sequences than one request may, before tokenizing, at no cost', E2E, async () => {
    // Under 2 KB of JSON that would be 8,192 sequences of 1,000 tokens.
    const prompts = Array.from({ length: 64 }, (_, i) => `p${i}`);
    const res = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: prompts, n: 128, max_tokens: 1000 } });
    assert.equal(res.status, 400);
    assert.equal(res.json().error.code, 'too_many_sequences');
    assert.equal(res.json().error.param, 'n');
    assert.match(res.json().error.message, /8192 sequences \(64 prompts x n=128\); one request may ask for at most 4/);
    const chat = await rawRequest(server.url, { path: '/v1/chat/completions', body: { model, messages: user, n: 5, max_tokens: 1 } });
    assert.equal(chat.status, 400);
    assert.equal(chat.json().error.code, 'too_many_sequences');
    const fits = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: ['a', 'b'], n: 2, max_tokens: 1 } });
    assert.equal(fits.status, 200);
    assert.equal(fits.json().choices.length, 4);
    assert.ok(engineIdle(server.engine));
  });

  it('the pending bound counts sequences, not requests', E2E, async () => {
    const first = await openCompletionStream(server.url, { model, prompt: 'Busy', n: 3, max_tokens: 1900, ignore_eos: true });
    try {
      // Two requests in flight would be under a bound of 4; 3 + 2 sequences are not.
      const second = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: 'x', n: 2, max_tokens: 1 } });
      assert.equal(second.status, 503);
      assert.equal(second.json().error.code, 'server_overloaded');
      assert.match(second.json().error.message, /3 sequences are pending, this request adds 2, and the bound is 4\./);
      const third = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: 'x', max_tokens: 1 } });
      assert.equal(third.status, 200, 'one more sequence still fits');
    } finally {
      first.hangUp();
    }
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
  });
});
