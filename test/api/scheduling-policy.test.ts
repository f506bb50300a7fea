// --scheduling-policy through HTTP: with one batch seat (--max-num-seqs 1), which of two queued requests runs first
// is the policy's choice: arrival (fcfs), the request's priority (lower first), or its deadline_ms.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { rawRequest } from './http-client.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };

const cases: { policy: string; first: object; second: object; secondOvertakes: boolean }[] = [
  { policy: 'fcfs', first: { priority: 5 }, second: { priority: 0 }, secondOvertakes: false },
  { policy: 'priority', first: { priority: 5 }, second: { priority: 0 }, secondOvertakes: true },
  { policy: 'priority', first: { priority: -1 }, second: { priority: 0 }, secondOvertakes: false },
  { policy: 'deadline', first: { deadline_ms: 600_000 }, second: { deadline_ms: 1 }, secondOvertakes: true },
];

for (const policy of ['fcfs', 'priority', 'deadline']) {
  describe(`--scheduling-policy ${policy} with --max-num-seqs 1`, () => {
    let server: TestServer;
    let model: string;

    before(async () => {
      server = await startTestServer({ flags: ['--max-num-seqs', '1', '--scheduling-policy', policy] });
      model = server.running.api.gateway.servedModelName!;
    });
    after(async () => {
      await server?.close();
    });

    for (const c of cases.filter((x) => x.policy === policy)) {
      it(`a later request ${JSON.stringify(c.second)} ${c.secondOvertakes ? 'overtakes' : 'waits behind'} a queued ${JSON.stringify(c.first)}`, E2E, async () => {
        const finished: string[] = [];
        const send = (name: string, extra: object, maxTokens: number) => rawRequest(server.url, { path: '/v1/completions', body: {
          model, prompt: `request ${name}`, max_tokens: maxTokens, ignore_eos: true, ...extra,
        } }).then((response) => {
          assert.equal(response.status, 200, response.text);
          finished.push(name);
        });
        // The seat is taken by a long request; the two others queue behind it, in this order.
        const blocker = send('blocker', {}, 96);
        await waitFor(() => server.engine.stats().numRunning === 1, 'the blocker running');
        const first = send('first', c.first, 2);
        await waitFor(() => server.engine.stats().numWaiting === 1, 'the first request queued');
        const second = send('second', c.second, 2);
        await waitFor(() => server.engine.stats().numWaiting === 2, 'the second request queued');
        assert.deepEqual(finished, [], 'the blocker was still running when both were queued');
        await Promise.all([blocker, first, second]);
        assert.deepEqual(finished, c.secondOvertakes ? ['blocker', 'second', 'first'] : ['blocker', 'first', 'second']);
        await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
      });
    }
  });
}

describe('scheduling fields are checked', () => {
  it('--scheduling-policy must name a policy', async () => {
    await assert.rejects(startTestServer({ flags: ['--scheduling-policy', 'lottery'] }), /--scheduling-policy must be one of fcfs, priority, deadline/);
  });
});
