// Cross-origin calls (CORS, as vLLM's --allowed-origins): the headers on answers and preflights for allowed origins,
// none for others or with CORS off; and a real page on another origin in Chromium calling the API with a key, which
// the browser lets through only when the server allows that origin.

import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { createServer, request as httpRequest, type Server } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { parseOrigins } from '../../src/cli/serve.ts';
import { UsageError } from '../../src/cli/flags.ts';
import { launchChromium, CHROMIUM_PATH } from '../helpers/chromium.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };
// The second tenant has request, token and concurrency limits, so its answers carry the x-ratelimit-* headers and a
// request that kept a slot or a token would show.
const KEYS = 'sk-cors-0000 web\nsk-cors-limited limited 1000 1000000 1\n';

/** One raw HTTP exchange (fetch in Node would hide nothing, but this keeps the headers as sent). */
function exchange(url: string, method: string, path: string, headers: Record<string, string>, body?: string) {
  return new Promise<{ status: number; headers: Record<string, string | string[] | undefined>; text: string }>((resolve, reject) => {
    const req = httpRequest(`${url}${path}`, { method, headers }, (res) => {
      let text = '';
      res.setEncoding('utf8');
      res.on('data', (chunk) => { text += chunk; });
      res.on('end', () => resolve({ status: res.statusCode!, headers: res.headers, text }));
    });
    req.on('error', reject);
    req.end(body);
  });
}

const preflight = (url: string, origin: string) => exchange(url, 'OPTIONS', '/v1/chat/completions', {
  Origin: origin, 'Access-Control-Request-Method': 'POST', 'Access-Control-Request-Headers': 'authorization, content-type',
});
const chat = (url: string, origin?: string) => exchange(url, 'POST', '/v1/chat/completions', {
  'Content-Type': 'application/json', Authorization: 'Bearer sk-cors-0000', ...(origin ? { Origin: origin } : {}),
}, JSON.stringify({ messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2 }));

describe('CORS', () => {
  const servers: TestServer[] = [];
  let any: TestServer;
  let listed: TestServer;
  let off: TestServer;

  before(async () => {
    any = await startTestServer({ keysFile: KEYS });
    listed = await startTestServer({ keysFile: KEYS, flags: ['--allowed-origins', 'http://127.0.0.1:1, https://app.example'] });
    off = await startTestServer({ keysFile: KEYS, flags: ['--allowed-origins', ''] });
    servers.push(any, listed, off);
  });
  after(async () => {
    for (const server of servers) await server.close();
  });

  it('--allowed-origins takes a comma-separated list or vLLM\'s JSON list', () => {
    assert.deepEqual(parseOrigins('*'), ['*']);
    assert.deepEqual(parseOrigins(' https://a.example , http://b.example:8080 '), ['https://a.example', 'http://b.example:8080']);
    assert.deepEqual(parseOrigins('["https://a.example"]'), ['https://a.example']);
    assert.deepEqual(parseOrigins(''), []);
    assert.throws(() => parseOrigins('[1]'), UsageError);
    assert.throws(() => parseOrigins('[nope'), UsageError);
  });

  it('by default (*): preflights answered without a key, answers carry Access-Control-Allow-Origin: *', E2E, async () => {
    const pre = await preflight(any.url, 'https://app.example');
    assert.equal(pre.status, 204);
    assert.equal(pre.headers['access-control-allow-origin'], '*');
    assert.match(String(pre.headers['access-control-allow-methods']), /POST/);
    assert.equal(pre.headers['access-control-allow-headers'], 'authorization, content-type');
    assert.equal(pre.headers['access-control-allow-credentials'], undefined, 'never credentials');
    const answer = await chat(any.url, 'https://app.example');
    assert.equal(answer.status, 200, answer.text);
    assert.equal(answer.headers['access-control-allow-origin'], '*');
    assert.match(String(answer.headers['access-control-expose-headers']), /X-Request-Id/);
    // Refusals carry them too (a page must be able to read the error), and a same-origin call gets none.
    const refused = await exchange(any.url, 'POST', '/v1/chat/completions', { Origin: 'https://app.example', 'Content-Type': 'application/json' }, '{}');
    assert.equal(refused.status, 401);
    assert.equal(refused.headers['access-control-allow-origin'], '*');
    assert.equal((await chat(any.url)).headers['access-control-allow-origin'], undefined);
  });

  it('a page may read the rate-limit headers its answers carry', E2E, async () => {
    const answer = await exchange(any.url, 'POST', '/v1/chat/completions', {
      'Content-Type': 'application/json', Authorization: 'Bearer sk-cors-limited', Origin: 'https://app.example',
    }, JSON.stringify({ messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2 }));
    assert.equal(answer.status, 200, answer.text);
    const rateLimitHeaders = Object.keys(answer.headers).filter((name) => name.startsWith('x-ratelimit-'));
    assert.equal(rateLimitHeaders.length, 6, `requests and tokens: limit, remaining, reset (${rateLimitHeaders.join(', ')})`);
    const exposed = String(answer.headers['access-control-expose-headers']).split(',').map((name) => name.trim().toLowerCase());
    for (const name of rateLimitHeaders) assert.ok(exposed.includes(name), `${name} is exposed (${exposed.join(', ')})`);
  });

  it('a list: only its origins, each echoed with Vary: Origin; off: no CORS headers, a preflight is an ordinary OPTIONS', E2E, async () => {
    const allowed = await chat(listed.url, 'https://app.example');
    assert.equal(allowed.headers['access-control-allow-origin'], 'https://app.example');
    assert.equal(allowed.headers.vary, 'Origin');
    const other = await chat(listed.url, 'https://evil.example');
    assert.equal(other.status, 403, 'refused, not merely hidden from the page');
    assert.equal(other.headers['access-control-allow-origin'], undefined);
    for (const [server, origin] of [[listed, 'https://evil.example'], [off, 'https://app.example']] as const) {
      const pre = await preflight(server.url, origin);
      assert.equal(pre.status, 405);
      assert.equal(pre.headers['access-control-allow-origin'], undefined);
    }
  });

  it('a POST from an origin not allowed is refused before any work; no Origin, an allowed one and the server\'s own pass', E2E, async () => {
    // A "simple" request: text/plain needs no preflight, so a page on any site can make a browser send it.
    const completion = (server: TestServer, origin?: string) => exchange(server.url, 'POST', '/v1/completions', {
      'Content-Type': 'text/plain', Authorization: 'Bearer sk-cors-limited', ...(origin ? { Origin: origin } : {}),
    }, JSON.stringify({ prompt: 'Hi', max_tokens: 2 }));
    const remainingRequests = (answer: { headers: Record<string, unknown> }) => Number(answer.headers['x-ratelimit-remaining-requests']);

    const allowed = await completion(listed, 'https://app.example');
    assert.equal(allowed.status, 200, allowed.text);
    const forged = await completion(listed, 'https://evil.example');
    assert.equal(forged.status, 403, forged.text);
    const { error } = JSON.parse(forged.text) as { error: { code: string; type: string; message: string } };
    assert.equal(error.code, 'origin_not_allowed');
    assert.equal(error.type, 'invalid_request_error');
    assert.match(error.message, /"https:\/\/evil\.example"/);
    assert.match(error.message, /--allowed-origins/);
    assert.equal(forged.headers['access-control-allow-origin'], undefined);
    // No rate-limit token and no concurrency slot (the tenant has one) was taken: the next request gets both.
    const withoutOrigin = await completion(listed);
    assert.equal(withoutOrigin.status, 200, withoutOrigin.text);
    assert.equal(remainingRequests(withoutOrigin), remainingRequests(allowed) - 1, 'the refused request took no request token');
    const ownOrigin = await completion(listed, listed.url);
    assert.equal(ownOrigin.status, 200, `a page the server serves itself: ${ownOrigin.text}`);

    // Every route that acts is refused alike, before its key is checked; reads are not (the browser hides them).
    for (const path of ['/v1/chat/completions', '/v1/responses', '/tokenize', '/detokenize', '/reset_prefix_cache', '/v1/load_lora_adapter']) {
      const answer = await exchange(listed.url, 'POST', path, { 'Content-Type': 'text/plain', Origin: 'https://evil.example' }, '{}');
      assert.equal(answer.status, 403, `${path}: ${answer.text}`);
      assert.equal((JSON.parse(answer.text) as { error: { code: string } }).error.code, 'origin_not_allowed', path);
    }
    const read = await exchange(listed.url, 'GET', '/v1/models', { Authorization: 'Bearer sk-cors-limited', Origin: 'https://evil.example' });
    assert.equal(read.status, 200, read.text);

    // CORS off: no other origin may act; the default (*): every origin may, as before.
    assert.equal((await completion(off, 'https://app.example')).status, 403);
    assert.equal((await completion(off)).status, 200);
    assert.equal((await completion(any, 'https://evil.example')).status, 200);
    for (const server of [listed, off, any]) await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
  });

  it('a page on another origin calls the API in Chromium: allowed by *, blocked by the browser with CORS off', {
    ...E2E, skip: existsSync(CHROMIUM_PATH) ? false : `${CHROMIUM_PATH} is not installed`,
  }, async () => {
    // The page's own origin: another port on 127.0.0.1.
    const pageServer: Server = createServer((_req, res) => {
      res.writeHead(200, { 'Content-Type': 'text/html' });
      res.end('<!doctype html><title>app</title>');
    });
    await new Promise<void>((resolve) => pageServer.listen(0, '127.0.0.1', resolve));
    const pageUrl = `http://127.0.0.1:${(pageServer.address() as { port: number }).port}/`;
    const profile = mkdtempSync(join(tmpdir(), 'conduit-cors-'));
    const browser = await launchChromium(profile);
    try {
      const page = await browser.newPage();
      await page.goto(pageUrl);
      const call = (api: string) => page.evaluate(async (url) => {
        try {
          const res = await fetch(`${url}/v1/chat/completions`, {
            method: 'POST', headers: { 'Content-Type': 'application/json', Authorization: 'Bearer sk-cors-0000' },
            body: JSON.stringify({ messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2 }),
          });
          const body = await res.json() as { object?: string };
          return { status: res.status, object: body.object, requestId: res.headers.get('x-request-id') };
        } catch (error) {
          return { error: String(error) };
        }
      }, api);
      const allowed = await call(any.url);
      assert.deepEqual({ status: allowed.status, object: allowed.object }, { status: 200, object: 'chat.completion' }, JSON.stringify(allowed));
      assert.match(String(allowed.requestId), /^chatcmpl-/, 'an exposed header is readable');
      const blocked = await call(off.url);
      assert.match(String(blocked.error), /TypeError|Failed to fetch/, JSON.stringify(blocked));
    } finally {
      await browser.close();
      rmSync(profile, { recursive: true, force: true });
      await new Promise((resolve) => pageServer.close(resolve));
    }
  });
});
