// A tenant is charged what the engine computed for it. A request that waits in the engine's queue and ends before
// it gets a step (its client left, or --request-timeout expired) computed nothing: its tokens and the request itself
// go back to the tenant's buckets. One that ran is charged its prompt and what it generated.

import assert from 'node:assert/strict';
import { connect } from 'node:net';
import { after, describe, it } from 'node:test';
import type { Tenant } from '../../src/api/auth.ts';
import { startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest, type RawResponse } from './http-client.ts';

const E2E = { timeout: 180_000 };

const KEYS = 'sk-blocker blocker\nsk-victim victim 10 5000\n';
const VICTIM: Tenant = { name: 'victim', limits: { requestsPerMinute: 10, tokensPerMinute: 5000 }, cacheSalt: undefined };
const victimAuth = { Authorization: 'Bearer sk-victim' };
const blockerAuth = { Authorization: 'Bearer sk-blocker' };
/** Some 300 tokens. */
const PROMPT = Array.from({ length: 300 }, (_, i) => `word${i}`).join(' ');

/** A request that is known to be over once `done` is set. */
function tracked(response: Promise<RawResponse>): { response: Promise<RawResponse>; done: boolean } {
  const handle = { response, done: false };
  void response.then(() => { handle.done = true; }, () => { handle.done = true; });
  return handle;
}

describe('rate-limit tokens of a request that never got a step', () => {
  const servers: TestServer[] = [];
  after(async () => {
    for (const server of servers) await server.close();
  });

  it('a client that leaves while its request waits in the engine queue is charged nothing', E2E, async () => {
    const server = await startTestServer({ keysFile: KEYS, flags: ['--max-num-seqs', '1'] });
    servers.push(server);
    const { limiter } = server.running.api;
    const model = server.running.api.gateway.servedModelName!;
    // The only batch seat is taken by a long request of another tenant.
    const blocker = tracked(rawRequest(server.url, {
      path: '/v1/completions', headers: blockerAuth, body: { model, prompt: 'block', max_tokens: 2000, ignore_eos: true },
    }));
    await waitFor(() => server.engine.stats().numRunning === 1, 'the blocker running');
    const text = JSON.stringify({ model, prompt: PROMPT, max_tokens: 10 });
    const socket = connect(Number(new URL(server.url).port), '127.0.0.1');
    socket.on('error', () => {});
    socket.write(`POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-victim\r\nContent-Type: application/json\r\n`
      + `Content-Length: ${Buffer.byteLength(text)}\r\n\r\n${text}`);
    await waitFor(() => server.engine.stats().numWaiting === 1, 'the victim queued');
    assert.equal(limiter.remaining(VICTIM).requests, 9, 'admitted: one request taken');
    socket.destroy();
    await waitFor(() => server.engine.stats().numWaiting === 0 && limiter.inFlight(VICTIM) === 0, 'the victim gone');
    assert.equal(blocker.done, false, 'the blocker held the seat all along: the victim never got a step');
    // The rate limiter's clock is the test's: nothing refilled, all was given back.
    assert.deepEqual(limiter.remaining(VICTIM), { requests: 10, tokens: 5000 });
    assert.equal(server.engine.stats().numRunning, 1);

    // A request that runs (after the blocker) is charged its prompt and its completion.
    const tokenized = await rawRequest(server.url, { path: '/tokenize', headers: victimAuth, body: { model, prompt: 'short one' } });
    const promptTokens = tokenized.json().count as number;
    const ran = await rawRequest(server.url, { path: '/v1/completions', headers: victimAuth, body: { model, prompt: 'short one', max_tokens: 3, ignore_eos: true } });
    assert.equal(ran.status, 200, ran.text);
    assert.equal(ran.json().usage.prompt_tokens, promptTokens);
    assert.deepEqual(limiter.remaining(VICTIM), { requests: 9, tokens: 5000 - promptTokens - 3 });
    await blocker.response;
  });

  it('--request-timeout expiring while the request waits in the engine queue charges nothing', E2E, async () => {
    const server = await startTestServer({
      keysFile: KEYS, flags: ['--max-num-seqs', '1', '--scheduling-policy', 'priority', '--request-timeout', '3'],
    });
    servers.push(server);
    const { limiter } = server.running.api;
    const model = server.running.api.gateway.servedModelName!;
    const block = (): ReturnType<typeof tracked> => tracked(rawRequest(server.url, {
      path: '/v1/completions', headers: blockerAuth, body: { model, prompt: 'block', max_tokens: 2000, ignore_eos: true, priority: 0 },
    }));
    // The seat is held by one blocker, then by a second one that ranks before the victim: when the first ends (at its
    // own timeout) the second takes the seat, and the victim's timeout, which began before the second's, comes first.
    const first = block();
    await waitFor(() => server.engine.stats().numRunning === 1, 'the first blocker running');
    const victim = tracked(rawRequest(server.url, {
      path: '/v1/completions', headers: victimAuth, body: { model, prompt: PROMPT, max_tokens: 10, priority: 5 },
    }));
    await waitFor(() => server.engine.stats().numWaiting === 1, 'the victim queued');
    const second = block();
    await waitFor(() => server.engine.stats().numWaiting === 2, 'the second blocker queued');
    assert.equal(first.done, false, 'the first blocker still held the seat when both were queued');
    const timedOut = await victim.response;
    assert.equal(second.done, false, 'the second blocker held the seat when the victim timed out: the victim never got a step');
    assert.equal(timedOut.status, 504, timedOut.text);
    assert.equal(timedOut.json().error.code, 'request_timeout');
    await waitFor(() => limiter.inFlight(VICTIM) === 0, 'the victim settled');
    assert.deepEqual(limiter.remaining(VICTIM), { requests: 10, tokens: 5000 });
    // The answer's headers say so too: they are the state after the refund, not at the admission.
    assert.equal(timedOut.headers['x-ratelimit-remaining-requests'], '10');
    assert.equal(timedOut.headers['x-ratelimit-remaining-tokens'], '5000');
    await Promise.all([first.response, second.response]);
  });
});
