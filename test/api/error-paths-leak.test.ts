// Every way a request can fail after it was admitted, or after its prompt was tokenized, gives back what it held: the
// tenant's concurrency slots and reserved tokens, the server's pending sequences, the engine's KV blocks and batch
// seats. Many such failures in a row, then the state is checked for leftovers and full-sized requests still run.

import assert from 'node:assert/strict';
import { request as httpRequest } from 'node:http';
import { after, before, describe, it } from 'node:test';
import type { Tenant } from '../../src/api/auth.ts';
import { ADMIN_KEY, engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 240_000 };
const MAX_CONCURRENT = 8;
const TPM = 1_000_000;
const KEYS = `sk-t t 100000 ${TPM} ${MAX_CONCURRENT}\n`;
const TENANT: Tenant = { name: 't', limits: { requestsPerMinute: 100000, tokensPerMinute: TPM, maxConcurrent: MAX_CONCURRENT }, cacheSalt: undefined };
const auth = { Authorization: 'Bearer sk-t' };
const ROUNDS = 4;

/** Sends a request and drops the connection once `leaveWhen` says so (after the first body bytes, or at once). */
function leave(url: string, path: string, body: object, leaveWhen: 'first-bytes' | 'sent'): Promise<void> {
  const text = JSON.stringify(body);
  return new Promise((resolve) => {
    const req = httpRequest(new URL(path, url), {
      method: 'POST', headers: { ...auth, 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(text) },
    }, (res) => {
      res.once('data', () => { if (leaveWhen === 'first-bytes') req.destroy(); });
      res.on('error', () => {});
    });
    req.on('error', () => {});
    req.on('close', () => resolve());
    req.end(text, () => { if (leaveWhen === 'sent') setTimeout(() => req.destroy(), 30); });
  });
}

describe('failures after admission give back everything they held', () => {
  let server: TestServer;
  let model: string;
  let maxModelLen: number;
  before(async () => {
    server = await startTestServer({ keysFile: KEYS, flags: ['--request-timeout', '1'] });
    model = server.running.api.gateway.servedModelName!;
    maxModelLen = server.engine.info.maxModelLen;
  });
  after(async () => {
    await server?.close();
  });

  it('leaves no slot, token, sequence or KV block behind', E2E, async () => {
    const { limiter } = server.running.api;
    const long = 'word '.repeat(maxModelLen + 10);
    for (let round = 0; round < ROUNDS; round++) {
      const refusals = await Promise.all([
        // Refused after tokenizing: a prompt past the context, alone and as one prompt of a batch.
        rawRequest(server.url, { path: '/v1/completions', headers: auth, body: { model, prompt: long, max_tokens: 4 } }),
        rawRequest(server.url, { path: '/v1/completions', headers: auth, body: { model, prompt: ['hello', long], max_tokens: 4 } }),
        rawRequest(server.url, { path: '/v1/completions', headers: auth, body: { model, prompt: [[1, 2, 3], 'hi'], max_tokens: 4000 } }),
        // A chat whose max_tokens leaves no room once its prompt is rendered and counted.
        rawRequest(server.url, { path: '/v1/chat/completions', headers: auth,
          body: { model, messages: [{ role: 'user', content: 'hi' }], max_tokens: maxModelLen } }),
        // min_tokens above the context left after the prompt.
        rawRequest(server.url, { path: '/v1/chat/completions', headers: auth,
          body: { model, messages: [{ role: 'user', content: 'hi' }], min_tokens: maxModelLen } }),
        // Timed out by --request-timeout while generating (streamed and not).
        rawRequest(server.url, { path: '/v1/completions', headers: auth,
          body: { model, prompt: ['a', 'b'], n: 2, max_tokens: 1500, ignore_eos: true } }),
        rawRequest(server.url, { path: '/v1/chat/completions', headers: auth,
          body: { model, messages: [{ role: 'user', content: 'go' }], max_tokens: 1500, ignore_eos: true, stream: true } }),
      ]);
      for (const refusal of refusals.slice(0, 5)) assert.equal(refusal.status, 400, refusal.text);
      assert.equal(refusals[5]!.status, 504, refusals[5]!.text);
      assert.match(refusals[6]!.text, /error/, 'the stream ends with an error event');
      // Clients that leave: mid-stream (several prompts, n > 1), and before a non-streamed answer.
      await Promise.all([
        leave(server.url, '/v1/completions', { model, prompt: ['x', 'y'], n: 2, max_tokens: 200, ignore_eos: true, stream: true }, 'first-bytes'),
        leave(server.url, '/v1/chat/completions', { model, messages: [{ role: 'user', content: 'hi' }], max_tokens: 200, ignore_eos: true, stream: true }, 'first-bytes'),
        leave(server.url, '/v1/completions', { model, prompt: 'hello there', max_tokens: 300, ignore_eos: true, echo: true }, 'sent'),
        leave(server.url, '/v1/chat/completions', { model, messages: [{ role: 'user', content: 'hi' }], max_tokens: 300, ignore_eos: true, n: 3 }, 'sent'),
        leave(server.url, '/v1/responses', { model, input: 'hi', max_output_tokens: 200, stream: true }, 'first-bytes'),
        leave(server.url, '/v1/chat/completions', { model, messages: [{ role: 'user', content: 'hi' }], max_tokens: 200, stream: true,
          tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object' } } }], tool_choice: 'required' }, 'first-bytes'),
        leave(server.url, '/v1/completions', { model, prompt: 'x', max_tokens: 200, stream: true, guided_regex: '[a-z]{1,150}' }, 'first-bytes'),
      ]);
      // The server notices a client leaving when its socket closes, a moment after the client closed it.
      await waitFor(() => limiter.inFlight(TENANT) === 0, `round ${round}'s requests ended`, 60_000);
    }
    await waitFor(() => limiter.inFlight(TENANT) === 0 && engineIdle(server.engine), 'every request ended', 60_000);
    await server.running.api.gateway.whenIdle();
    assert.equal(limiter.inFlight(TENANT), 0, 'no concurrency slot held');
    const stats = server.engine.stats();
    assert.deepEqual({ used: stats.kvBlocksUsed, running: stats.numRunning, waiting: stats.numWaiting }, { used: 0, running: 0, waiting: 0 });
    const metrics = await rawRequest(server.url, { path: '/metrics', headers: { Authorization: `Bearer ${ADMIN_KEY}` } });
    const inFlight = metrics.text.split('\n').filter((line) => /^conduit\w*in_flight\w*\{[^}]*tenant="t"/.test(line));
    assert.ok(inFlight.length > 0, 'an in-flight series for the tenant');
    for (const line of inFlight) assert.match(line, / 0$/, line);
    // The tenant was charged for what ran, no more than it reserved: the rate-limit clock is the test's and never moved.
    const { tokens } = limiter.remaining(TENANT);
    assert.ok(tokens > 0 && tokens < TPM, `some tokens charged, ${tokens} left`);

    // The whole concurrency cap is free: a request of MAX_CONCURRENT sequences runs.
    const full = await rawRequest(server.url, { path: '/v1/completions', headers: auth,
      body: { model, prompt: ['one', 'two'], n: MAX_CONCURRENT / 2, max_tokens: 3 } });
    assert.equal(full.status, 200, full.text);
    assert.equal(full.json().choices.length, MAX_CONCURRENT);
    await waitFor(() => engineIdle(server.engine), 'the last request done');
  });
});
