// A request with n > 1 looks its prompt up in the prefix cache once: its sequences share the prompt's blocks after
// one prefill, and that sharing is not counted as cache hits (docs/observability.md says how vLLM counts it instead).

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 120_000 };
const PROMPT = Array.from({ length: 80 }, (_, i) => `cold${i}`).join(' ');

describe('prefix-cache lookups of a request with n > 1', () => {
  let server: TestServer;
  before(async () => {
    server = await startTestServer();
  });
  after(async () => {
    await server?.close();
  });

  it('count its prompt once, with no hits for a cold prompt', E2E, async () => {
    const model = server.running.api.gateway.servedModelName!;
    const before = server.engine.stats();
    const res = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: PROMPT, max_tokens: 2, n: 4 } });
    assert.equal(res.status, 200, res.text);
    const promptTokens = res.json().usage.prompt_tokens as number;
    await waitFor(() => engineIdle(server.engine), 'the request done');
    const afterN = server.engine.stats();
    assert.equal(afterN.prefixCacheQueries - before.prefixCacheQueries, promptTokens, 'one lookup of the prompt');
    assert.equal(afterN.prefixCacheHits - before.prefixCacheHits, 0, 'a cold prompt: nothing found');
    // The same prompt again finds its full blocks.
    const again = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: PROMPT, max_tokens: 2 } });
    const cached = again.json().usage.prompt_tokens_details.cached_tokens as number;
    assert.ok(cached > 0);
    const afterOne = server.engine.stats();
    assert.equal(afterOne.prefixCacheQueries - afterN.prefixCacheQueries, promptTokens);
    assert.equal(afterOne.prefixCacheHits - afterN.prefixCacheHits, cached);
  });
});
