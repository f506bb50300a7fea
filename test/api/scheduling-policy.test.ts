// --scheduling-policy through HTTP: with one batch seat (--max-num-seqs 1), which of two queued requests runs first
// is the policy's choice: arrival (fcfs), the request's priority (lower first), or its deadline_ms; and under priority
// and deadline, a more urgent request preempts the running one, which later resumes where it was.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { rawRequest } from './http-client.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };

// The blocker ranks first under every policy (so it is not preempted): priority 0 before the others' 1 and 2 (or
// equal and earlier), a deadline before theirs.
const cases: { policy: string; blocker?: object; first: object; second: object; secondOvertakes: boolean }[] = [
  { policy: 'fcfs', first: {}, second: {}, secondOvertakes: false },
  { policy: 'priority', first: { priority: 5 }, second: { priority: 0 }, secondOvertakes: true },
  { policy: 'priority', first: { priority: 1 }, second: { priority: 2 }, secondOvertakes: false },
  { policy: 'deadline', blocker: { deadline_ms: 1 }, first: { deadline_ms: 600_000 }, second: { deadline_ms: 1 }, secondOvertakes: true },
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

    // The fields this policy never reads are refused (vLLM refuses a priority without priority scheduling).
    const unread = { fcfs: [{ priority: 5 }, { deadline_ms: 1000 }], priority: [{ deadline_ms: 1000 }], deadline: [] }[policy]!;
    for (const extra of unread) {
      it(`refuses ${JSON.stringify(extra)}, which ${policy} never reads, with a 400 naming the field`, async () => {
        const response = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: 'hi', max_tokens: 2, ...extra } });
        assert.equal(response.status, 400, response.text);
        assert.equal((response.json() as { error: { param: string } }).error.param, Object.keys(extra)[0]);
      });
    }

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
        const blocker = send('blocker', c.blocker ?? {}, 96);
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

for (const [policy, low, high] of [
  ['priority', { priority: 5 }, { priority: 0 }],
  ['deadline', { deadline_ms: 600_000 }, { deadline_ms: 1 }],
] as const) {
  describe(`--scheduling-policy ${policy}: preemption for a more urgent request (--max-num-seqs 1)`, () => {
    let server: TestServer;
    let model: string;

    before(async () => {
      server = await startTestServer({ flags: ['--max-num-seqs', '1', '--scheduling-policy', policy] });
      model = server.running.api.gateway.servedModelName!;
    });
    after(async () => {
      await server?.close();
    });

    it(`a waiting ${JSON.stringify(high)} preempts a running ${JSON.stringify(low)}, which resumes and gives its greedy text as if alone`, E2E, async () => {
      const lowBody = { model, prompt: 'a long and unhurried request', max_tokens: 160, temperature: 0, ignore_eos: true, ...low };
      const complete = (body: object) => rawRequest(server.url, { path: '/v1/completions', body }).then((response) => {
        assert.equal(response.status, 200, response.text);
        return response.json().choices[0].text as string;
      });
      const alone = await complete(lowBody);
      const preemptionsBefore = server.engine.stats().preemptions;
      const finished: string[] = [];
      const lowRun = complete(lowBody).then((text) => { finished.push('low'); return text; });
      await waitFor(() => server.engine.stats().numRunning === 1, 'the low request running');
      const highRun = complete({ model, prompt: 'urgent', max_tokens: 4, temperature: 0, ignore_eos: true, ...high })
        .then((text) => { finished.push('high'); return text; });
      const [lowText] = await Promise.all([lowRun, highRun]);
      assert.deepEqual(finished, ['high', 'low'], 'the urgent request finished first');
      assert.ok(server.engine.stats().preemptions > preemptionsBefore, 'the running request was preempted');
      assert.equal(lowText, alone);
      await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
    });

    it('an equally or less urgent request waits instead', E2E, async () => {
      const preemptionsBefore = server.engine.stats().preemptions;
      const finished: string[] = [];
      const send = (name: string, extra: object, maxTokens: number) => rawRequest(server.url, { path: '/v1/completions', body: {
        model, prompt: `request ${name}`, max_tokens: maxTokens, ignore_eos: true, ...extra,
      } }).then((response) => {
        assert.equal(response.status, 200, response.text);
        finished.push(name);
      });
      const running = send('running', high, 96);
      await waitFor(() => server.engine.stats().numRunning === 1, 'the first request running');
      const later = send('later', high, 2);
      await Promise.all([running, later]);
      assert.deepEqual(finished, ['running', 'later']);
      assert.equal(server.engine.stats().preemptions, preemptionsBefore);
    });
  });
}

describe('scheduling fields are checked', () => {
  it('--scheduling-policy must name a policy', async () => {
    await assert.rejects(startTestServer({ flags: ['--scheduling-policy', 'lottery'] }), /--scheduling-policy must be one of fcfs, priority, deadline/);
  });
});
