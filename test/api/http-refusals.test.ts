// Refusals at the HTTP layer, before or while a request is read: each in OpenAI's error shape and counted in
// conduit_http_responses_total. A body that does not arrive in time is a 408 saying so (not the headers' message),
// counted and logged as a 408, not as the client's leaving (499); a request Node cannot parse is counted too, and
// so are a missing Host and an unknown Expect, in the same shape; an absolute-form target is routed by its path. An
// invalid traceparent header is ignored. A transfer coding other than chunked is a 501 and a compressed body a 415 (both
// would otherwise be read still encoded); "Expect: 100-continue" gets its 100 only once the request is accepted and the
// body about to be read; "OPTIONS *" lists the server's methods and OPTIONS on a route that route's; CONNECT is a 405 (Node would drop the connection unanswered);
// an unknown model's name is not echoed whole. A connection that never sends a byte is closed after the headers
// timeout (Node times out only requests it has begun to read).

import assert from 'node:assert/strict';
import { connect } from 'node:net';
import { gzipSync } from 'node:zlib';
import { after, before, describe, it } from 'node:test';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 60_000 };

/** Writes `text` on a new connection and resolves with everything the server sends before it closes. */
function exchange(server: TestServer, text: string | Buffer): Promise<string> {
  return new Promise((resolve, reject) => {
    const socket = connect(Number(new URL(server.url).port), '127.0.0.1');
    let received = '';
    socket.on('data', (chunk) => { received += chunk.toString('utf8'); });
    socket.on('close', () => resolve(received));
    socket.on('error', reject);
    socket.write(text);
  });
}

async function responses(server: TestServer, route: string, status: number): Promise<number> {
  const metrics = (await rawRequest(server.url, { path: '/metrics' })).text;
  const line = metrics.split('\n').find((l) => l.startsWith('conduit_http_responses_total{')
    && l.includes(`route="${route}"`) && l.includes(`status="${status}"`));
  return line === undefined ? 0 : Number(line.split(' ').at(-1));
}

describe('refusals at the HTTP layer', () => {
  let server: TestServer;

  before(async () => {
    // Node's upload limit (requestTimeout, at least 60 s in production) made short so that the test is; Node checks it
    // every quarter of the headers timeout.
    server = await startTestServer({ flags: ['--headers-timeout', '1.5'] });
    (server.running.api as unknown as { server: { requestTimeout: number } }).server.requestTimeout = 1500;
  });
  after(async () => {
    await server?.close();
  });

  it('a body that does not arrive in time: 408 naming the body, counted as a 408', E2E, async () => {
    const before408 = await responses(server, 'completions', 408);
    const before499 = await responses(server, 'completions', 499);
    const answer = await exchange(server, 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
      + 'Content-Length: 100\r\n\r\n{"prompt":');
    assert.match(answer, /^HTTP\/1\.1 408 /);
    const body = JSON.parse(answer.slice(answer.indexOf('\r\n\r\n') + 4)) as { error: { code: string; message: string } };
    assert.equal(body.error.code, 'request_timeout');
    assert.match(body.error.message, /body did not arrive within 1\.5 s/);
    // Counted when the handler sees its read fail, which may be just after the answer went out.
    const deadline = Date.now() + 10_000;
    while (await responses(server, 'completions', 408) === before408 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
    assert.equal(await responses(server, 'completions', 408), before408 + 1);
    assert.equal(await responses(server, 'completions', 499), before499, 'not counted as the client leaving');
  });

  it('a request Node cannot parse: 400 in OpenAI\'s shape, counted under the unknown route', E2E, async () => {
    const before400 = await responses(server, 'unknown', 400);
    const answer = await exchange(server, 'THIS IS NOT HTTP\r\n\r\n');
    assert.match(answer, /^HTTP\/1\.1 400 /);
    assert.match(answer, /"code":"invalid_http_request"/);
    assert.equal(await responses(server, 'unknown', 400), before400 + 1);
  });

  it('many requests pipelined on one connection are all answered, in order, without a listener-leak warning', E2E, async () => {
    // Each queued request watched its connection's close with a listener of its own: past 10, Node printed
    // "MaxListenersExceededWarning: Possible EventEmitter memory leak detected" to the server's log.
    const warnings: string[] = [];
    const onWarning = (warning: Error): void => { warnings.push(`${warning.name}: ${warning.message}`); };
    process.on('warning', onWarning);
    try {
      const model = server.running.api.gateway.servedModelName!;
      const count = 16;
      const requests = Array.from({ length: count }, (_, i) => {
        const body = JSON.stringify({ model, prompt: `request ${i}`, max_tokens: 2 });
        return `POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: pipelined-${i}\r\n`
          + `Content-Length: ${Buffer.byteLength(body)}${i === count - 1 ? '\r\nConnection: close' : ''}\r\n\r\n${body}`;
      });
      const answer = await exchange(server, requests.join(''));
      const ids = [...answer.matchAll(/x-request-id: (pipelined-\d+)/gi)].map((match) => match[1]);
      assert.deepEqual(ids, Array.from({ length: count }, (_, i) => `pipelined-${i}`));
      assert.equal(answer.match(/HTTP\/1\.1 200 /g)?.length, count);
      await new Promise((resolve) => setImmediate(resolve));
      assert.deepEqual(warnings.filter((warning) => warning.startsWith('MaxListenersExceededWarning')), []);
    } finally {
      process.off('warning', onWarning);
    }
  });

  it('unparsable bytes after a whole request on its connection: that request\'s answer first, then the 400', E2E, async () => {
    // Written at once, the 400 went out as the answer to the valid request (abandoned), or into the middle of its
    // stream; HTTP answers a connection's requests in the order they came.
    const model = server.running.api.gateway.servedModelName!;
    for (const stream of [false, true]) {
      const body = JSON.stringify({ model, prompt: 'hi', max_tokens: 12, ignore_eos: true, stream });
      const answer = await exchange(server, `POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n`
        + `Content-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}THIS IS NOT HTTP\r\n\r\n`);
      assert.match(answer, /^HTTP\/1\.1 200 /, `stream ${stream}: ${answer.slice(0, 300)}`);
      const refusal = answer.indexOf('HTTP/1.1 400 ');
      assert.ok(refusal > 0, `stream ${stream}: the 400 follows: ${answer.slice(-300)}`);
      const answered = answer.slice(0, refusal);
      if (stream) assert.match(answered, /data: \[DONE\]\r?\n\r?\n\r\n0\r\n\r\n$/, 'the whole stream, its last chunk included');
      else assert.equal(JSON.parse(answered.slice(answered.indexOf('\r\n\r\n') + 4)).usage.completion_tokens, 12);
      assert.match(answer.slice(refusal), /"code":"invalid_http_request"/);
    }
    await waitFor(() => engineIdle(server.engine), 'the requests done');
  });

  it('an invalid traceparent (all-zero ids, version ff) is ignored, not passed on or echoed; a valid one continues', E2E, async () => {
    const traceId = '4bf92f3577b34da6a3ce929d0e0e4736';
    const send = async (traceparent: string) => (await rawRequest(server.url, {
      path: '/v1/completions', body: { prompt: 'Hi', max_tokens: 1 }, headers: { traceparent },
    })).headers.traceparent as string | undefined;
    for (const invalid of [`00-${'0'.repeat(32)}-00f067aa0ba902b7-01`, `00-${traceId}-${'0'.repeat(16)}-01`, `ff-${traceId}-00f067aa0ba902b7-01`]) {
      const echoed = await send(invalid);
      assert.notEqual(echoed, invalid);
      assert.doesNotMatch(echoed ?? '', /^ff-|-0{32}-|-0{16}-/);
    }
    assert.match((await send(`00-${traceId}-00f067aa0ba902b7-01`)) ?? '', new RegExp(`^00-${traceId}-`));
    // A later version is parsed by 00's layout, its extra fields ignored (W3C Trace Context, "Versioning of
    // traceparent"): the client's trace goes on, named in version 00, whatever the length of what follows.
    const later = await send(`cc-${traceId}-00f067aa0ba902b7-01-${'x'.repeat(4000)}`);
    assert.match(later ?? '', new RegExp(`^00-${traceId}-[0-9a-f]{16}-0[01]$`));
    // ... but not when the flags are not followed by a dash or the end.
    assert.doesNotMatch((await send(`cc-${traceId}-00f067aa0ba902b7-01x`)) ?? '', new RegExp(traceId));
  });

  it('a request without Host, or with an Expect other than 100-continue, is answered in OpenAI\'s shape and counted', E2E, async () => {
    const before400 = await responses(server, 'unknown', 400);
    const before417 = await responses(server, 'unknown', 417);
    const noHost = await exchange(server, 'GET /health HTTP/1.1\r\nConnection: close\r\n\r\n');
    assert.match(noHost, /^HTTP\/1\.1 400 /);
    assert.match(noHost, /needs a Host header.*"code":"invalid_http_request"/);
    const expect = await exchange(server, 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: teapot\r\nContent-Length: 2\r\n\r\n{}');
    assert.match(expect, /^HTTP\/1\.1 417 /);
    assert.match(expect, /"code":"expectation_failed"/);
    assert.equal(await responses(server, 'unknown', 400), before400 + 1);
    assert.equal(await responses(server, 'unknown', 417), before417 + 1);
    // HTTP/1.0 needs no Host.
    assert.match(await exchange(server, 'GET /live HTTP/1.0\r\n\r\n'), /^HTTP\/1\.1 200 /);
  });

  it('a body in a transfer coding other than chunked: 501; with a Content-Encoding: 415; both counted', E2E, async () => {
    const before501 = await responses(server, 'unknown', 501);
    const before415 = await responses(server, 'completions', 415);
    const gzipped = gzipSync(JSON.stringify({ prompt: 'Hi', max_tokens: 1 }));
    const chunk = Buffer.concat([Buffer.from(`${gzipped.length.toString(16)}\r\n`), gzipped, Buffer.from('\r\n0\r\n\r\n')]);
    const coded = await exchange(server, Buffer.concat([Buffer.from('POST /v1/completions HTTP/1.1\r\nHost: x\r\n'
      + 'Content-Type: application/json\r\nTransfer-Encoding: gzip, chunked\r\n\r\n'), chunk]));
    assert.match(coded, /^HTTP\/1\.1 501 /);
    assert.match(coded, /Connection: close/i);
    assert.match(coded, /"code":"unsupported_transfer_encoding"/);
    const compressed = await exchange(server, Buffer.concat([Buffer.from('POST /v1/completions HTTP/1.1\r\nHost: x\r\n'
      + `Content-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: ${gzipped.length}\r\nConnection: close\r\n\r\n`), gzipped]));
    assert.match(compressed, /^HTTP\/1\.1 415 /);
    assert.match(compressed, /"code":"unsupported_content_encoding"/);
    assert.equal(await responses(server, 'unknown', 501), before501 + 1);
    assert.equal(await responses(server, 'completions', 415), before415 + 1);
    // Chunked alone, and an identity Content-Encoding, are read as before.
    const plain = Buffer.from(JSON.stringify({ prompt: 'Hi', max_tokens: 1 }));
    const chunked = await exchange(server, Buffer.concat([Buffer.from('POST /v1/completions HTTP/1.1\r\nHost: x\r\n'
      + 'Content-Type: application/json\r\nContent-Encoding: identity\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n'
      + `${plain.length.toString(16)}\r\n`), plain, Buffer.from('\r\n0\r\n\r\n')]));
    assert.match(chunked, /^HTTP\/1\.1 200 /);
  });

  it('Expect: 100-continue is answered 100 only for a request about to be read, never before a refusal', E2E, async () => {
    const body = JSON.stringify({ prompt: 'Hi', max_tokens: 1 });
    const accepted = await exchange(server, 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
      + `Expect: 100-continue\r\nContent-Length: ${body.length}\r\nConnection: close\r\n\r\n${body}`);
    assert.match(accepted, /^HTTP\/1\.1 100 Continue\r\n\r\nHTTP\/1\.1 200 /);
    // The client has not sent its body: it waits for the 100, which must not come.
    const tooLarge = await exchange(server, 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
      + 'Expect: 100-continue\r\nContent-Length: 999999999\r\n\r\n');
    assert.match(tooLarge, /^HTTP\/1\.1 413 /);
    const unknownRoute = await exchange(server, 'POST /v1/nothing-here HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
      + 'Expect: 100-continue\r\nContent-Length: 10\r\n\r\n');
    assert.match(unknownRoute, /^HTTP\/1\.1 404 /);
  });

  it('OPTIONS * lists the server\'s methods', E2E, async () => {
    const answer = await exchange(server, 'OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n');
    assert.match(answer, /^HTTP\/1\.1 204 /);
    assert.match(answer, /\r\nAllow: GET, HEAD, POST, OPTIONS\r\n/i);
  });

  it('OPTIONS on a route lists that route\'s methods; on no route it is a 404', E2E, async () => {
    const post = await exchange(server, 'OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n');
    assert.match(post, /^HTTP\/1\.1 204 /);
    assert.match(post, /\r\nAllow: POST, OPTIONS\r\n/i);
    const get = await exchange(server, 'OPTIONS /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n');
    assert.match(get, /^HTTP\/1\.1 204 /);
    assert.match(get, /\r\nAllow: GET, HEAD, OPTIONS\r\n/i);
    const none = await exchange(server, 'OPTIONS /v1/nothing-here HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n');
    assert.match(none, /^HTTP\/1\.1 404 /);
  });

  it('an unknown model\'s name is quoted cut short in the 404, not echoed whole', E2E, async () => {
    const model = 'm'.repeat(100_000);
    const answer = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: 'Hi', max_tokens: 1 } });
    assert.equal(answer.status, 404);
    const message = (answer.json() as { error: { message: string } }).error.message;
    assert.ok(message.length < 1000, `message of ${message.length} characters`);
    assert.match(message, /\(99744 more characters\)/);
  });

  it('a request target in absolute form (http://host/path) is routed by its path, as RFC 9112 asks', E2E, async () => {
    const answer = await exchange(server, 'GET http://example.test/live?probe=1 HTTP/1.1\r\nHost: example.test\r\nConnection: close\r\n\r\n');
    assert.match(answer, /^HTTP\/1\.1 200 /);
    assert.match(answer, /"status":"alive"/);
  });

  it('CONNECT is a 405 in OpenAI\'s shape with Allow, counted, not a dropped connection', E2E, async () => {
    const before405 = await responses(server, 'unknown', 405);
    for (const target of ['example.test:443', '/v1/completions']) {
      const answer = await exchange(server, `CONNECT ${target} HTTP/1.1\r\nHost: example.test:443\r\n\r\n`);
      assert.match(answer, /^HTTP\/1\.1 405 /);
      assert.match(answer, /\r\nAllow: GET, HEAD, POST, OPTIONS\r\n/i);
      assert.match(answer, /"code":"method_not_allowed"/);
    }
    assert.equal(await responses(server, 'unknown', 405), before405 + 2);
  });

  it('a connection that never sends a byte is closed after the headers timeout, freeing its place', E2E, async () => {
    const api = server.running.api as unknown as { connectionCount: number };
    const socket = connect(Number(new URL(server.url).port), '127.0.0.1');
    socket.on('error', () => {});
    await new Promise((resolve) => socket.once('connect', resolve));
    await waitFor(() => api.connectionCount >= 1, 'the server to count the connection', 5_000);
    const closed = new Promise<boolean>((resolve) => {
      const guard = setTimeout(() => resolve(false), 10_000);
      socket.once('close', () => { clearTimeout(guard); resolve(true); });
    });
    const result = await closed;
    socket.destroy();
    assert.ok(result, 'the silent connection was still open 10 s after a 1.5 s headers timeout');
    await waitFor(() => api.connectionCount === 0, 'the connection to be uncounted', 5_000);
  });
});
