// A request that leaves max_tokens out reserves, against its tenant's tokens per minute, the most each completion may
// generate (the context left after its prompt). When that alone is over the limit, the 429 says max_tokens was not
// set and asks for it, rather than asking to lower a value the client never sent; the tenant loses nothing, and the
// same request with max_tokens set runs. Through the official openai client, as a user meets it.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import type { Tenant } from '../../src/api/auth.ts';
import { startTestServer, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };
/** Below the built-in model's 2048-token context: a chat without max_tokens reserves more than this. */
const TPM = 1000;
const KEYS = `sk-small small 100 ${TPM}\n`;
const SMALL: Tenant = { name: 'small', limits: { requestsPerMinute: 100, tokensPerMinute: TPM }, cacheSalt: undefined };

describe('tokens per minute and a request without max_tokens', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;
  before(async () => {
    server = await startTestServer({ keysFile: KEYS });
    client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'sk-small', maxRetries: 0 });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('is refused with a 429 that asks to set max_tokens, and takes nothing from the tenant', E2E, async () => {
    const messages = [{ role: 'user' as const, content: 'Tell me a story.' }];
    const error = await client.chat.completions.create({ model, messages }).then(
      () => assert.fail('expected a 429'), (e: unknown) => e);
    assert.ok(error instanceof OpenAI.RateLimitError, String(error));
    assert.equal(error.status, 429);
    assert.equal(error.code, 'rate_limit_exceeded');
    assert.equal(error.param, 'max_tokens');
    assert.match(error.message, /reserves \d+ tokens \(prompt \+ n \* max_tokens; max_tokens was not set, so each completion reserves the most it may generate\)/);
    assert.match(error.message, new RegExp(`the limit is ${TPM} tokens per minute\\. Set max_tokens, or lower n\\.`));
    assert.deepEqual(server.running.api.limiter.remaining(SMALL), { requests: 100, tokens: TPM }, 'nothing taken');

    // With max_tokens given the same request fits, and a refusal would name the value sent.
    const ran = await client.chat.completions.create({ model, messages, max_tokens: 4 });
    assert.equal(ran.choices.length, 1);
    const tooMany = await client.chat.completions.create({ model, messages, max_tokens: 1500 }).then(
      () => assert.fail('expected a 429'), (e: unknown) => e);
    assert.ok(tooMany instanceof OpenAI.RateLimitError, String(tooMany));
    assert.match(tooMany.message, /\(prompt \+ n \* max_tokens\) but the limit is 1000 tokens per minute\. Lower max_tokens or n\./);
  });
});
