// Session affinity through the real server: `conduit serve --routing-policy session` over several simulated
// workers, the session id taken from a request header. Requests of one session land on one worker whatever their
// prompts; requests without the header are routed by the KV cost as usual; a bad header is an OpenAI-style 400.
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { MAX_SESSION_ID_LENGTH } from '../../src/api/server.ts';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const SIM_WORKERS = ['--engine', 'sim', '--workers', '4', '--sim-speed-up', 'inf', '--routing-policy', 'session'];

/** Where a completion ran and why, from the request's trace. */
async function placement(server: TestServer, headers: Record<string, string>, prompt: string) {
  const res = await rawRequest(server.url, {
    path: '/v1/completions', headers, body: { prompt, max_tokens: 3, temperature: 0 },
  });
  assert.equal(res.status, 200, res.text);
  const id = res.headers['x-request-id'] as string;
  const trace = await rawRequest(server.url, { path: `/v1/requests/${encodeURIComponent(id)}/trace` });
  assert.equal(trace.status, 200, trace.text);
  const view = trace.json();
  const lookup = view.phases.find((p: { phase: string }) => p.phase === 'router_lookup');
  return { worker: view.worker as string, strategy: lookup.attributes.strategy as string };
}

/** Prompts that share nothing, so only the session can keep them together. */
const unrelated = (session: number, turn: number): string => `Session ${session} turn ${turn}: ${'abcdefghij'[turn % 10]!.repeat(turn + 3)} ${session * 7919 + turn * 104729}`;

describe('session routing by header', () => {
  let server: TestServer;
  before(async () => { server = await startTestServer({ flags: SIM_WORKERS }); });
  after(() => server.close());

  it('keeps every request of a session on one worker, whatever its prompt', async () => {
    // With four idle workers and prompts that share no blocks, the KV cost ties every worker and breaks the tie at
    // random: eight requests of a session on one worker by chance is a 1 in 4^7 event.
    const workersOf = new Map<string, Set<string>>();
    for (let turn = 0; turn < 8; turn++) {
      for (const session of [1, 2, 3]) {
        const sessionId = `conversation-${session}`;
        const { worker, strategy } = await placement(server, { 'x-session-id': sessionId }, unrelated(session, turn));
        if (turn > 0) assert.equal(strategy, 'session', `turn ${turn} of ${sessionId} kept its affinity`);
        workersOf.set(sessionId, (workersOf.get(sessionId) ?? new Set()).add(worker));
      }
    }
    for (const [sessionId, workers] of workersOf) assert.equal(workers.size, 1, `${sessionId} ran on ${[...workers]}`);
  });

  it('routes requests without the header by the KV cost', async () => {
    for (let turn = 0; turn < 3; turn++) {
      const { worker, strategy } = await placement(server, {}, unrelated(9, turn));
      assert.equal(strategy, 'kv');
      assert.match(worker, /^sim-\d$/);
    }
  });

  it('refuses an overlong session id with a 400 naming the header', async () => {
    const res = await rawRequest(server.url, {
      path: '/v1/completions', headers: { 'x-session-id': 's'.repeat(MAX_SESSION_ID_LENGTH + 1) },
      body: { prompt: 'Hello', max_tokens: 2 },
    });
    assert.equal(res.status, 400);
    assert.equal(res.json().error.type, 'invalid_request_error');
    assert.equal(res.json().error.param, 'x-session-id');
  });
});

describe('session routing with --session-header', () => {
  let server: TestServer;
  before(async () => { server = await startTestServer({ flags: [...SIM_WORKERS, '--session-header', 'X-Conversation'] }); });
  after(() => server.close());

  it('reads the configured header and ignores the default one', async () => {
    const configured = new Set<string>();
    for (let turn = 0; turn < 6; turn++) {
      const { worker, strategy } = await placement(server, { 'x-conversation': 'chat-a' }, unrelated(4, turn));
      if (turn > 0) assert.equal(strategy, 'session');
      configured.add(worker);
    }
    assert.equal(configured.size, 1);
    const { strategy } = await placement(server, { 'x-session-id': 'chat-a' }, unrelated(5, 0));
    assert.equal(strategy, 'kv', 'x-session-id is not the session header here');
  });
});

describe('session routing in a disaggregated deployment', () => {
  let server: TestServer;
  before(async () => {
    server = await startTestServer({
      flags: ['--engine', 'sim', '--prefill-workers', '1', '--decode-workers', '3', '--sim-speed-up', 'inf', '--routing-policy', 'session'],
    });
  });
  after(() => server.close());

  it('keeps a session on one decode worker', async () => {
    const workers = new Set<string>();
    for (let turn = 0; turn < 8; turn++) {
      const { worker, strategy } = await placement(server, { 'x-session-id': 'disagg-chat' }, unrelated(6, turn));
      if (turn > 0) assert.equal(strategy, 'session');
      workers.add(worker);
    }
    assert.equal(workers.size, 1, `ran on ${[...workers]}`);
    assert.match([...workers][0]!, /^sim-decode-\d$/);
  });
});
