// A request's n completions of one prompt run in one engine batch, so n above the batch size (--max-num-seqs) can
// never run: the engine refuses it, and the client's 400 names n and the flag, not the engine's internals. The tenant
// is charged nothing for it, and the server goes on.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import type { Tenant } from '../../src/api/auth.ts';
import { engineIdle, startTestServer, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };
const TENANT: Tenant = { name: 't', limits: { requestsPerMinute: 50, tokensPerMinute: 10_000 }, cacheSalt: undefined };

describe('n above the engine batch size', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;
  before(async () => {
    server = await startTestServer({ keysFile: 'sk-t t 50 10000\n', flags: ['--max-num-seqs', '2'] });
    client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'sk-t', maxRetries: 0 });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('is a 400 naming n and --max-num-seqs, charged nothing', E2E, async () => {
    for (const stream of [false, true]) {
      const error = await client.completions.create({ model, prompt: ['a', 'b'], max_tokens: 2, n: 3, stream }).then(
        () => assert.fail('expected a 400'), (e: unknown) => e);
      assert.ok(error instanceof OpenAI.BadRequestError, String(error));
      assert.equal(error.code, 'too_many_samples');
      assert.equal(error.param, 'n');
      assert.match(error.message, /n = 3 is more than one engine batch holds \(--max-num-seqs 2\)/);
    }
    assert.deepEqual(server.running.api.limiter.remaining(TENANT), { requests: 50, tokens: 10_000 });
    assert.equal(server.running.api.limiter.inFlight(TENANT), 0);
    assert.ok(engineIdle(server.engine), 'nothing left in the engine');
    const ok = await client.completions.create({ model, prompt: 'a', max_tokens: 2, n: 2 });
    assert.equal(ok.choices.length, 2);
  });
});
