// seed -1 over HTTP, as vLLM reads it: no seed, so each request draws its own and two such requests sample apart,
// as requests without a seed do. It used to be taken as the seed -1, and every request sent with it gave the same
// output.
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 90_000 };

describe('seed -1', () => {
  let server: TestServer;

  before(async () => {
    server = await startTestServer();
  });
  after(async () => {
    await server?.close();
  });

  async function sampled(seed: number): Promise<string> {
    const response = await rawRequest(server.url, {
      path: '/v1/completions',
      body: { prompt: 'Once upon a time', temperature: 1, max_tokens: 24, ignore_eos: true, seed, return_token_ids: true },
    });
    assert.equal(response.status, 200, response.text);
    return response.json().choices[0].token_ids.join(',');
  }

  it('is no seed: requests sent with it sample apart, while a real seed replays', E2E, async () => {
    assert.equal(await sampled(7), await sampled(7));
    const outputs = new Set([await sampled(-1), await sampled(-1), await sampled(-1)]);
    assert.ok(outputs.size > 1, `three requests with seed -1 gave the same output: ${[...outputs][0]}`);
  });
});
