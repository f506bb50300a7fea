// A request that alone reserves more tokens than its tenant may use in a minute, or runs more sequences than the
// tenant may run at once, can never succeed. It gets OpenAI's answer (429 rate_limit_exceeded, "Request too large"),
// without Retry-After, and with x-should-retry: false, the header the official SDKs obey before their own rule: they
// retry every 429 otherwise, sending the same hopeless request again and again. An ordinary 429 keeps being retried.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { startTestServer, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };
const KEYS = 'sk-small small 100 1000 2\n';

describe('a request too large for its tenant ever to run', () => {
  let server: TestServer;
  let model: string;
  /** POSTs that reached the server through the client under test. */
  let sent = 0;
  let client: OpenAI;
  before(async () => {
    server = await startTestServer({ keysFile: KEYS });
    model = server.running.api.gateway.servedModelName!;
    // The SDK's default retries (2), quick: the test counts attempts, not their waits.
    client = new OpenAI({
      baseURL: `${server.url}/v1`, apiKey: 'sk-small', maxRetries: 2, timeout: 60_000,
      fetch: (url, init) => { sent++; return fetch(url, init); },
    });
  });
  after(async () => {
    await server?.close();
  });

  it('is refused once: the official client does not retry it', E2E, async () => {
    sent = 0;
    const error = await client.completions.create({ model, prompt: 'hello', max_tokens: 1500 }).then(
      () => assert.fail('expected a 429'), (e: unknown) => e);
    assert.ok(error instanceof OpenAI.RateLimitError, String(error));
    assert.equal(error.code, 'rate_limit_exceeded');
    assert.match(error.message, /Request too large for tenant 'small'/);
    assert.equal(error.headers.get('retry-after'), null);
    assert.equal(error.headers.get('x-should-retry'), 'false');
    assert.equal(sent, 1, 'one attempt, no retries');
  });

  it('nor one of more sequences than the tenant may run at once', E2E, async () => {
    sent = 0;
    const error = await client.completions.create({ model, prompt: 'hello', max_tokens: 2, n: 3 }).then(
      () => assert.fail('expected a 429'), (e: unknown) => e);
    assert.ok(error instanceof OpenAI.RateLimitError, String(error));
    assert.equal(error.code, 'concurrency_limit_exceeded');
    assert.equal(error.headers.get('x-should-retry'), 'false');
    assert.equal(sent, 1, 'one attempt, no retries');
  });

  it('while a request that fits after a wait is still retried', E2E, async () => {
    const small = { name: 'small', limits: { requestsPerMinute: 100, tokensPerMinute: 1000 }, cacheSalt: undefined };
    const first = await client.completions.create({ model, prompt: 'hello', max_tokens: 800, ignore_eos: true } as never);
    assert.ok(first.choices.length === 1);
    // The rate-limit clock is the test's, so nothing refills by itself: ask for 30 tokens more than remain (about two
    // seconds of refill, which the client waits for as Retry-After tells it).
    const { tokens } = server.running.api.limiter.remaining(small);
    sent = 0;
    const oneRetry = client.withOptions({ maxRetries: 1 });
    const error = await oneRetry.completions.create({ model, prompt: 'hello', max_tokens: tokens + 30 }).then(
      () => assert.fail('expected a 429'), (e: unknown) => e);
    assert.ok(error instanceof OpenAI.RateLimitError, String(error));
    assert.notEqual(error.headers.get('retry-after'), null);
    assert.equal(error.headers.get('x-should-retry'), null);
    assert.equal(sent, 2, 'the first attempt and one retry');
  });
});
