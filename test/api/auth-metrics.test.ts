// A request refused for its API key (401) has no tenant: both the telemetry's request counters and the gateway's
// response counter label it with the one tenant of requests without an authenticated one.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { ANONYMOUS_TENANT } from '../../src/api/auth.ts';
import { parseExposition, total, value, type Exposition } from '../telemetry/exposition.ts';
import { ADMIN_KEY, startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

describe('the tenant label of a 401', () => {
  let server: TestServer;

  before(async () => {
    server = await startTestServer({ keysFile: 'sk-acme-00000001 acme\n' });
  });
  after(async () => {
    await server?.close();
  });

  async function scrape(): Promise<Exposition> {
    const res = await rawRequest(server.url, { path: '/metrics', headers: { Authorization: `Bearer ${ADMIN_KEY}` } });
    assert.equal(res.status, 200);
    return parseExposition(res.text);
  }

  it('is "anonymous" in conduit_requests_total and conduit_http_responses_total alike', async () => {
    assert.equal(ANONYMOUS_TENANT, 'anonymous');
    const body = { prompt: 'Hi', max_tokens: 2 };
    const missing = await rawRequest(server.url, { path: '/v1/completions', body });
    assert.equal(missing.status, 401);
    const wrong = await rawRequest(server.url, { path: '/v1/completions', body, headers: { Authorization: 'Bearer sk-wrong-00000001' } });
    assert.equal(wrong.status, 401);

    // A request is counted when its trace ends, just after its answer went out.
    const requests = (x: Exposition): number => total(x, 'conduit_requests_total', { tenant: ANONYMOUS_TENANT, finish_reason: 'error' });
    const deadline = Date.now() + 10_000;
    let x = await scrape();
    while (requests(x) < 2 && Date.now() < deadline) {
      await new Promise((resolve) => setTimeout(resolve, 20));
      x = await scrape();
    }
    assert.equal(requests(x), 2);
    assert.equal(value(x, 'conduit_http_responses_total', { route: 'completions', status: '401', tenant: ANONYMOUS_TENANT }), 2);
    for (const family of ['conduit_requests_total', 'conduit_http_responses_total', 'conduit_request_errors_total']) {
      assert.equal(x.samples.some((s) => s.name === family && s.labels.tenant !== undefined && s.labels.tenant !== ANONYMOUS_TENANT
        && s.labels.tenant !== 'admin'), false, `${family}: a tenant label other than ${ANONYMOUS_TENANT}`);
    }
    assert.equal(x.samples.some((s) => s.labels.tenant === 'none'), false, 'a series with tenant="none"');
  });
});
