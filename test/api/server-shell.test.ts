// The HTTP shell before a model is attached (the server opens its port first, then loads): routing, methods, auth,
// body limits and decoding, liveness and readiness, metrics format. The engine-backed behaviour is in e2e tests.

import assert from 'node:assert/strict';
import { connect } from 'node:net';
import { after, before, describe, it } from 'node:test';
import { combineKeyConfig, KeyStore, parseKeysList } from '../../src/api/auth.ts';
import { OverloadedError } from '../../src/api/errors.ts';
import { ApiServer } from '../../src/api/server.ts';
import { waitFor } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

describe('API server shell (no model yet)', () => {
  let api: ApiServer;
  let url: string;
  const auth = { Authorization: 'Bearer sk-test-key-0001' };
  const adminAuth = { Authorization: 'Bearer sk-test-admin-0001' };

  before(async () => {
    api = new ApiServer({
      keyStore: new KeyStore(combineKeyConfig(undefined, parseKeysList('sk-test-key-0001:acme'), 'sk-test-admin-0001')),
      maxBodyBytes: 64 * 1024,
    });
    await api.listen(0);
    url = api.url;
  });

  after(async () => {
    await api.shutdown(0);
  });

  it('answers /live at once and /health with 503 while loading', async () => {
    const live = await rawRequest(url, { path: '/live' });
    assert.equal(live.status, 200);
    const health = await rawRequest(url, { path: '/health' });
    assert.equal(health.status, 503);
    assert.equal(health.json().ready, false);
    assert.equal(health.json().status, 'loading');
  });

  it('refuses generation with 503 not_ready until the model is attached', async () => {
    const res = await rawRequest(url, { path: '/v1/completions', headers: auth, body: { prompt: 'x' } });
    assert.equal(res.status, 503);
    assert.equal(res.json().error.code, 'not_ready');
    assert.ok(Number(res.headers['retry-after']) >= 1);
  });

  it('closes the connection of a POST refused before its body is read (no key): no body is read past the refusal', async () => {
    // 1 GB announced, a few bytes sent: the answer must come, and the connection end, without the rest.
    const exchange = rawExchange(url, 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
      + 'Content-Length: 1000000000\r\n\r\n{"prompt":');
    const answer = await Promise.race([exchange, new Promise<string>((resolve) => setTimeout(() => resolve('still open after 10 s'), 10_000))]);
    assert.match(answer, /^HTTP\/1\.1 401 /);
    assert.match(answer, /\r\nConnection: close\r\n/);
  });

  it('gives 404 in OpenAI\'s shape for unknown routes', async () => {
    const res = await rawRequest(url, { path: '/v1/nothing-here', headers: auth });
    assert.equal(res.status, 404);
    assert.deepEqual(res.json(), {
      error: { message: 'Invalid URL (GET /v1/nothing-here).', type: 'invalid_request_error', param: null, code: 'unknown_url' },
    });
  });

  it('gives 405 with Allow for a wrong method', async () => {
    const res = await rawRequest(url, { method: 'GET', path: '/v1/chat/completions', headers: auth });
    assert.equal(res.status, 405);
    assert.equal(res.headers.allow, 'POST');
    const del = await rawRequest(url, { method: 'DELETE', path: '/v1/models', headers: auth });
    assert.equal(del.status, 405);
    assert.equal(del.headers.allow, 'GET, HEAD');
  });

  it('needs a known API key on /v1 routes and /metrics but not on /live, /health', async () => {
    const none = await rawRequest(url, { path: '/v1/models' });
    assert.equal(none.status, 401);
    assert.equal(none.json().error.code, 'missing_api_key');
    const wrong = await rawRequest(url, { path: '/v1/models', headers: { Authorization: 'Bearer sk-nope-nope-0000' } });
    assert.equal(wrong.status, 401);
    assert.equal(wrong.json().error.code, 'invalid_api_key');
    assert.equal((await rawRequest(url, { path: '/health' })).status, 503, 'loading, but answered');
    // Its series name tenants: with keys configured, for admin keys only (unless --public-metrics).
    assert.equal((await rawRequest(url, { path: '/metrics' })).status, 401);
    assert.equal((await rawRequest(url, { path: '/metrics', headers: auth })).status, 403);
  });

  it('serves /metrics without a key when told to (--public-metrics)', async () => {
    const open = new ApiServer({
      keyStore: new KeyStore({ keys: parseKeysList('sk-test-key-0001:acme'), tenants: new Map() }), publicMetrics: true,
    });
    await open.listen(0);
    try {
      assert.equal((await rawRequest(open.url, { path: '/metrics' })).status, 200);
    } finally {
      await open.shutdown(0);
    }
  });

  it('refuses a body announced larger than the cap without reading it', async () => {
    const res = await rawRequest(url, {
      path: '/v1/chat/completions', headers: { ...auth, 'Content-Length': String(10 * 1024 * 1024) }, body: '{}',
    });
    assert.equal(res.status, 413);
    assert.equal(res.json().error.code, 'body_too_large');
    assert.match(res.json().error.message, /65536 bytes/);
  });

  it('stops reading a 10 MB streamed body at the cap and still answers 413', async () => {
    const big = Buffer.alloc(10 * 1024 * 1024, 0x20);
    const res = await rawRequest(url, {
      path: '/v1/completions', headers: { ...auth, 'Transfer-Encoding': 'chunked' }, body: big, chunkBytes: 64 * 1024,
    });
    assert.equal(res.status, 413);
    assert.equal(res.headers.connection, 'close');
    assert.equal((await rawRequest(url, { path: '/live' })).status, 200, 'the server is still up');
  });

  it('rejects bad JSON and invalid UTF-8 with 400 before anything else happens', async () => {
    const bad = await rawRequest(url, { path: '/v1/chat/completions', headers: auth, body: '{"messages": [' });
    assert.equal(bad.status, 400);
    assert.equal(bad.json().error.code, 'invalid_json');
    const utf8 = await rawRequest(url, {
      path: '/v1/chat/completions', headers: auth, body: Buffer.from([0x7b, 0x22, 0xc3, 0x28, 0x22, 0x7d]),
    });
    assert.equal(utf8.status, 400);
    assert.equal(utf8.json().error.code, 'invalid_utf8');
  });

  it('answers a malformed percent-escape in the path with 400 in OpenAI\'s shape, not a 500', async () => {
    for (const path of ['/v1/models/%E0%A4%A', '/v1/models/%ZZ', '/v1/models/%C3%28']) {
      const res = await rawRequest(url, { path, headers: auth });
      assert.equal(res.status, 400, path);
      const { error } = res.json();
      assert.equal(error.code, 'invalid_url', path);
      assert.equal(error.type, 'invalid_request_error');
      assert.match(error.message, /percent-escape/);
    }
    assert.equal((await rawRequest(url, { path: '/live' })).status, 200, 'the server is still up');
  });

  it('keeps connections alive between requests', async () => {
    const res = await rawRequest(url, { path: '/live', headers: { Connection: 'keep-alive' } });
    assert.equal(res.headers.connection, 'keep-alive');
  });

  it('exposes valid Prometheus text with the responses counted so far', async () => {
    const res = await rawRequest(url, { path: '/metrics', headers: adminAuth });
    assert.match(String(res.headers['content-type']), /^text\/plain; version=0\.0\.4/);
    // Empty lines are allowed between families (the format ignores them; prom-client writes them).
    const lines = res.text.trimEnd().split('\n').filter((line) => line !== '');
    assert.ok(lines.some((line) => line.startsWith('# TYPE conduit_time_to_first_token_milliseconds histogram')),
      'the telemetry\'s families are there before a model is attached');
    for (const line of lines) {
      assert.match(line, /^(# (HELP|TYPE) [a-z_][a-z0-9_]* .+|[a-z_][a-z0-9_]*(\{[a-z_]+="[^"\n]*"(,[a-z_]+="[^"\n]*")*\})? [-+0-9.eInfNa]+)$/, line);
    }
    assert.ok(lines.some((line) => /^conduit_http_responses_total\{route="unknown",status="404",tenant="anonymous"\} [1-9]/.test(line)),
      'the 404 above was counted');
  });
});

describe('error messages', () => {
  it('an overload detail without a final period still reads as two sentences', () => {
    assert.equal(new OverloadedError('no worker is available').message,
      'The server is overloaded: no worker is available. Please retry shortly.');
    assert.equal(new OverloadedError('the queue is full.').message,
      'The server is overloaded: the queue is full. Please retry shortly.');
  });
});

/** One request over a fresh socket of its own (no agent, no keep-alive); resolves with all the server sent. */
function rawExchange(url: string, request: string): Promise<string> {
  const { hostname, port } = new URL(url);
  return new Promise((resolve, reject) => {
    const socket = connect(Number(port), hostname);
    const chunks: Buffer[] = [];
    socket.on('data', (chunk: Buffer) => chunks.push(chunk));
    socket.on('error', reject);
    socket.on('close', () => resolve(Buffer.concat(chunks).toString('utf8')));
    socket.write(request);
  });
}

describe('API server connections', () => {
  it('answers connections past --max-connections with a short 503 and closes them; the server stays up', async () => {
    const api = new ApiServer({ keyStore: new KeyStore({ keys: [], tenants: new Map() }), maxConnections: 2 });
    await api.listen(0);
    const { port } = new URL(api.url);
    const idle = [connect(Number(port), '127.0.0.1'), connect(Number(port), '127.0.0.1')];
    try {
      await waitFor(() => api.connectionCount === 2, 'two idle connections');
      const refused = await rawExchange(api.url, 'GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n');
      assert.match(refused, /^HTTP\/1\.1 503 Service Unavailable\r\n/);
      assert.match(refused, /\r\nRetry-After: 1\r\n/);
      assert.match(refused, /\r\nConnection: close\r\n/);
      const body = JSON.parse(refused.slice(refused.indexOf('\r\n\r\n') + 4));
      assert.equal(body.error.code, 'too_many_connections');
      assert.equal(body.error.type, 'server_error');
      assert.equal(api.connectionCount, 2, 'the refused connection was never counted');
      idle[0]!.destroy();
      await waitFor(() => api.connectionCount === 1, 'a slot to free');
      const served = await rawExchange(api.url, 'GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n');
      assert.match(served, /^HTTP\/1\.1 200 OK\r\n/);
    } finally {
      for (const socket of idle) socket.destroy();
      await api.shutdown(0);
    }
  });

  it('answers what Node cannot parse as HTTP in OpenAI\'s error shape, and serves the next connection', async () => {
    const api = new ApiServer({ keyStore: new KeyStore({ keys: [], tenants: new Map() }) });
    await api.listen(0);
    try {
      const body = '{"prompt": "hi"}';
      const cases: [string, RegExp, string][] = [
        // A body longer than its Content-Length: the rest is read as a second request line.
        [`POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\n${body}`, /^HTTP\/1\.1 400 Bad Request\r\n/, 'invalid_http_request'],
        ['GARBAGE\r\n\r\n', /^HTTP\/1\.1 400 Bad Request\r\n/, 'invalid_http_request'],
        [`GET /live HTTP/1.1\r\nHost: x\r\nX-Big: ${'a'.repeat(20_000)}\r\n\r\n`, /^HTTP\/1\.1 431 Request Header Fields Too Large\r\n/, 'request_header_fields_too_large'],
      ];
      for (const [request, statusLine, code] of cases) {
        const answer = await rawExchange(api.url, request);
        // The last response on the connection (the first case's own request is answered before the garbage after it).
        const last = [...answer.matchAll(/HTTP\/1\.1 \d{3} /g)].at(-1)!.index!;
        assert.match(answer.slice(last), statusLine, request.slice(0, 40));
        const error = JSON.parse(answer.slice(answer.lastIndexOf('\r\n\r\n') + 4)).error;
        assert.deepEqual([error.type, error.code], ['invalid_request_error', code]);
      }
      assert.equal((await rawRequest(api.url, { path: '/live' })).status, 200);
    } finally {
      await api.shutdown(0);
    }
  });

  it('closes a connection whose headers do not arrive within the header timeout, with a 408', { timeout: 10_000 }, async () => {
    // Node's default check runs every 30 s: without a shorter check interval this would wait that long.
    const api = new ApiServer({ keyStore: new KeyStore({ keys: [], tenants: new Map() }), headersTimeoutMs: 400 });
    await api.listen(0);
    try {
      const answer = await rawExchange(api.url, 'GET /live HTTP/1.1\r\nHost: x\r\n');
      assert.match(answer, /^HTTP\/1\.1 408 Request Timeout\r\n/);
      assert.equal(JSON.parse(answer.slice(answer.indexOf('\r\n\r\n') + 4)).error.code, 'request_timeout');
    } finally {
      await api.shutdown(0);
    }
  });
});
