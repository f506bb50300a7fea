// A request for a LoRA adapter that is not resident while every --max-loras slot is busy waits for a slot without
// holding up the requests behind it: with --max-loras 1, a long request on adapter 'a' running and a request for
// 'b' waiting, a base-model request sent after them gets its first token while 'a' still runs; 'b' runs once 'a'
// ends (its slot goes to 'b'), under each scheduling policy. The waiting request counts against
// --max-pending-requests; everything (KV blocks, pending slots, the waiter) is given back at the end.
//
// Simulated workers at real time (a few ms per decode step) keep the long request running while the others are
// sent; the adapters have no files (synthetic ones of --sim-lora-rank).

import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { silentLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer } from '../../src/cli/serve.ts';
import { rawRequest } from './http-client.ts';
import { engineIdle, waitFor } from './e2e-fixture.ts';
import { forEachStreamEvent } from '../helpers/sse-stream.ts';

const E2E = { timeout: 120_000 };

const cases = [
  { policy: 'fcfs', a: {}, b: {}, base: {} },
  // The waiting request is the most urgent of the three: it still waits for the slot, and the base one still runs.
  { policy: 'priority', a: { priority: 1 }, b: { priority: -5 }, base: { priority: 3 } },
  { policy: 'deadline', a: { deadline_ms: 600_000 }, b: { deadline_ms: 1 }, base: {} },
];

for (const c of cases) {
  describe(`--max-loras 1, --scheduling-policy ${c.policy}: a request for a non-resident adapter`, () => {
    it('waits for the busy slot while a base request behind it runs, then runs after the adapter holding it', E2E, async () => {
      const parsed = parseServeConfig(['--port', '0', '--log-level', 'silent', '--engine', 'sim', '--sim-speed-up', '1',
        '--lora-modules', 'a=/adapters/a,b=/adapters/b', '--sim-lora-rank', '8', '--max-loras', '1', '--max-num-seqs', '16',
        '--max-pending-requests', '3', '--scheduling-policy', c.policy], {});
      if (parsed === 'help') throw new Error('unexpected --help');
      const server = await startServer(parsed, silentLogger);
      try {
        const gateway = server.api.gateway;
        const engine = gateway.engine!;
        const adapters = gateway.servedModels[0]!.backend.adapters!;
        const events: string[] = [];
        const stream = async (name: string, body: object, onFirst?: () => void) => {
          const res = await fetch(`${server.url}/v1/completions`, {
            method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ ...body, stream: true }),
          });
          assert.equal(res.status, 200, `${name}: ${res.status}`);
          let tokens = 0;
          let finish: string | null | undefined;
          await forEachStreamEvent(res, (event) => {
            assert.equal(event.error, undefined, `${name}: ${JSON.stringify(event.error)}`);
            if (event.choices?.[0]?.text === undefined) return;
            if (tokens++ === 0) {
              events.push(`${name} first`);
              onFirst?.();
            }
            finish = event.choices[0].finish_reason ?? finish;
          });
          events.push(`${name} done`);
          return { tokens, finish };
        };

        let aStarted!: () => void;
        const aRunning = new Promise<void>((resolve) => { aStarted = resolve; });
        const a = stream('a', { model: 'a', prompt: 'a long request', max_tokens: 300, ignore_eos: true, ...c.a }, aStarted);
        await aRunning;
        const b = stream('b', { model: 'b', prompt: 'the waiting one', max_tokens: 8, ignore_eos: true, ...c.b });
        await waitFor(() => adapters.stats().waiting === 1, 'the request for b waiting');
        const metrics = async () => (await rawRequest(server.url, { path: '/metrics' })).text;
        assert.match(await metrics(), /conduit_lora_requests_waiting\{model="Llama-3.1-8B"\} 1/);
        const base = stream('base', { model: 'Llama-3.1-8B', prompt: 'the base model', max_tokens: 8, ignore_eos: true, ...c.base });
        await waitFor(() => events.includes('base first'), 'the base request starting');
        // The waiting request holds one of the three pending slots: a fourth request is refused meanwhile.
        const fourth = await rawRequest(server.url, { path: '/v1/completions', body: { model: 'Llama-3.1-8B', prompt: 'x', max_tokens: 1 } });
        assert.equal(fourth.status, 503, fourth.text);
        const [aResult, bResult, baseResult] = await Promise.all([a, b, base]);
        assert.deepEqual([aResult, bResult, baseResult], [
          { tokens: 300, finish: 'length' }, { tokens: 8, finish: 'length' }, { tokens: 8, finish: 'length' },
        ]);
        const at = (event: string) => events.indexOf(event);
        assert.ok(at('base first') < at('a done'), `the base request waited for a: ${events.join(', ')}`);
        assert.ok(at('b first') > at('a done'), `b ran before a ended: ${events.join(', ')}`);
        await waitFor(() => engineIdle(engine), 'KV blocks given back');
        assert.deepEqual(adapters.stats(), { registered: 2, resident: 1, loads: 4, evictions: 3, waiting: 0 });
        const after = await metrics();
        assert.match(after, /conduit_lora_requests_waiting\{model="Llama-3.1-8B"\} 0/);
        assert.doesNotMatch(after, /conduit_gateway_requests_in_flight\{[^}]*\} [1-9]/);
        // The pending slots are back: three requests at once are taken.
        const again = await Promise.all(['a', 'b', 'Llama-3.1-8B'].map((model) =>
          rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: 'again', max_tokens: 2 } })));
        assert.deepEqual(again.map((r) => r.status), [200, 200, 200], again.map((r) => r.text).join('\n'));
      } finally {
        await server.api.shutdown(0);
      }
    });
  });
}
