// POST /reset_prefix_cache against the real server and engine: a cached prompt is cold again after a reset, a
// reset while a request holds KV blocks is refused (409) and changes nothing, and with keys configured only the
// admin key may reset.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { ADMIN_KEY, engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest, type RawResponse } from './http-client.ts';
import { openCompletionStream } from '../helpers/http-stream.ts';

const KEY = 'sk-reset-tenant-01';
const auth = (key: string): Record<string, string> => ({ Authorization: `Bearer ${key}` });
/** A hang guard, not a speed requirement. */
const E2E = { timeout: 90_000 };

describe('POST /reset_prefix_cache', () => {
  let server: TestServer;
  let model: string;

  before(async () => {
    server = await startTestServer({ keysFile: `${KEY} tenant 1000 1000000\n` });
    model = server.running.api.gateway.servedModelName!;
  });

  after(async () => {
    await server?.close();
  });

  const reset = (key?: string): Promise<RawResponse> =>
    rawRequest(server.url, { path: '/reset_prefix_cache', method: 'POST', headers: key ? auth(key) : {}, body: {} });
  const prompt = `A preamble worth caching: ${'the tide comes in and the tide goes out, '.repeat(6)}and then`;
  const cachedTokens = async (): Promise<number> => {
    const res = await rawRequest(server.url, { path: '/v1/completions', headers: auth(KEY), body: { model, prompt, max_tokens: 1 } });
    assert.equal(res.status, 200, res.text);
    return res.json().usage.prompt_tokens_details.cached_tokens;
  };

  it('makes a cached prompt cold again', E2E, async () => {
    await cachedTokens();
    assert.ok(await cachedTokens() >= server.engine.info.blockSize, 'the repeated prompt reuses its blocks');
    const res = await reset(ADMIN_KEY);
    assert.equal(res.status, 200, res.text);
    assert.deepEqual(res.json(), { reset: true });
    assert.equal(await cachedTokens(), 0, 'after the reset the prompt is computed again');
    assert.ok(await cachedTokens() > 0, 'and cached again after that');
  });

  it('takes no body, as vLLM\'s (curl -X POST), while a body that is there must be JSON', E2E, async () => {
    const post = (body?: string) => fetch(`${server.url}/reset_prefix_cache`, {
      method: 'POST', headers: auth(ADMIN_KEY), ...(body !== undefined ? { body } : {}),
    });
    const bare = await post();
    assert.equal(bare.status, 200, await bare.clone().text());
    assert.deepEqual(await bare.json(), { reset: true });
    const broken = await post('{');
    assert.equal(broken.status, 400);
    assert.equal(((await broken.json()) as { error: { code: string } }).error.code, 'invalid_json');
  });

  it('refuses with 409 while a request holds KV blocks, and the server stays up', E2E, async () => {
    await cachedTokens();
    const stream = await openCompletionStream(server.url, { model, prompt: 'Keep going', max_tokens: 1500, ignore_eos: true }, { key: KEY });
    const refused = await reset(ADMIN_KEY);
    stream.hangUp();
    assert.equal(refused.status, 409, refused.text);
    assert.equal(refused.json().error.code, 'requests_running');
    assert.equal(typeof refused.json().error.message, 'string');
    await waitFor(() => engineIdle(server.engine), 'the aborted request to leave the engine');
    assert.ok(await cachedTokens() > 0, 'the refused reset kept the cache');
    assert.equal((await reset(ADMIN_KEY)).status, 200, 'once idle the reset goes through');
  });

  it('needs the admin key when keys are configured', E2E, async () => {
    assert.equal((await reset()).status, 401, 'without a key');
    const tenant = await reset(KEY);
    assert.equal(tenant.status, 403, 'with a tenant\'s key');
    assert.equal(tenant.json().error.code, 'admin_required');
    assert.equal((await reset(ADMIN_KEY)).status, 200, 'with the admin key');
  });
});
