// Lost workers as an operator sees them through `conduit serve`: with every worker dead, /health answers 503 with
// a reason and requests get 503; the workers are restarted (logged), after which /health says ready and requests are
// served again, with the text they had before. A worker that keeps dying is restarted a bounded number of times,
// then given up, and /health says so. Disaggregated: /health needs a decode worker (not a prefill worker), and a
// restarted prefill worker is connected to the decode workers and prefills for them again. With several models, the
// loss of every worker of any one of them makes /health 503, naming that model.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import { createLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import type { LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineOutput } from '../../src/engine/types.ts';
import { DisaggregatedEngine } from '../../src/runtime/disaggregated.ts';
import { RoutedEngine } from '../../src/runtime/routed-engine.ts';
import { SupervisedEngine } from '../../src/runtime/supervised-engine.ts';
import { forEachStreamEvent } from '../helpers/sse-stream.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { writeWorkerLossFixture, type WorkerLossFixture } from '../helpers/worker-loss.ts';

/** The reference kernels: no native code runs in a killed thread. */
const WORKER_FLAGS = ['--threads', '1', '--backend', 'reference', '--kv-cache-memory', '16MiB'];

async function serve(fixture: WorkerLossFixture, flags: string[], lines: string[]): Promise<RunningServer> {
  // An empty environment: CONDUIT_* variables of whoever runs the tests must not change the server under test.
  const config = parseServeConfig(['--port', '0', '--model', fixture.modelPath, ...WORKER_FLAGS, ...flags], {});
  assert.notEqual(config, 'help');
  return startServer(config as Exclude<typeof config, 'help'>, createLogger('info', (line) => lines.push(line)));
}

async function health(running: RunningServer): Promise<{ status: number; body: { status: string; ready: boolean; reason?: string } }> {
  const response = await fetch(`${running.url}/health`);
  return { status: response.status, body: await response.json() as { status: string; ready: boolean; reason?: string } };
}

async function complete(running: RunningServer): Promise<{ status: number; text: string; body: string; headers: Headers }> {
  const response = await fetch(`${running.url}/v1/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ prompt: 'Once upon a time', max_tokens: 12, temperature: 0, ignore_eos: true }),
  });
  const body = await response.text();
  const text = response.status === 200 ? (JSON.parse(body) as { choices: { text: string }[] }).choices[0]!.text : '';
  return { status: response.status, text, body, headers: response.headers };
}

/** A refusal while no worker is in the group: not an overload, and a retry is promised only while a restart runs. */
function assertNoWorkerRefusal(refused: { status: number; body: string; headers: Headers }, restarting: boolean): void {
  assert.equal(refused.status, 503, refused.body);
  const { error } = JSON.parse(refused.body) as { error: { code: string; type: string; message: string } };
  assert.equal(error.code, 'no_worker_available', refused.body);
  assert.equal(error.type, 'server_error');
  assert.doesNotMatch(error.message, /overloaded|retry shortly/i, refused.body);
  if (restarting) {
    assert.match(refused.headers.get('retry-after') ?? '', /^[1-9]\d*$/, 'a restart is under way: worth coming back');
    assert.match(error.message, /Retry once the restart is done\.$/);
    assert.equal(refused.headers.get('x-should-retry'), null);
  } else {
    assert.equal(refused.headers.get('retry-after'), null, 'nothing brings a worker back: no time to retry after');
    assert.equal(refused.headers.get('x-should-retry'), 'false', 'the OpenAI SDKs do not send it again');
    assert.match(error.message, /No worker will come back without an operator\.$/);
  }
}

describe('lost workers are restarted, and /health says whether any can serve', () => {
  let fixture: WorkerLossFixture;
  before(() => {
    fixture = writeWorkerLossFixture('restart');
  });
  after(() => rmSync(fixture.dir, { recursive: true, force: true }));

  test('every worker killed: /health 503 with a reason, requests 503; restarted: /health 200, requests served', { timeout: 120_000 }, async () => {
    const lines: string[] = [];
    // A first restart 3 s after the loss: the checks in between take milliseconds.
    const running = await serve(fixture, ['--workers', '2', '--worker-restart-delay', '3000'], lines);
    try {
      const routed = running.api.gateway.engine;
      assert.ok(routed instanceof RoutedEngine);
      assert.equal((await health(running)).status, 200);
      const expected = await complete(running);
      assert.equal(expected.status, 200, expected.body);

      const killed = routed.workerIds;
      await Promise.all(killed.map((id) => (routed.workerEngine(id) as LocalEngine).kill()));
      await waitUntil(() => routed.workerIds.length === 0, 'both workers left the router');

      const down = await health(running);
      assert.equal(down.status, 503);
      assert.equal(down.body.ready, false);
      assert.equal(down.body.status, 'unavailable');
      assert.match(down.body.reason ?? '', /^no worker can serve: all 2 workers were lost, restarting$/);
      const refused = await complete(running);
      assert.equal(refused.status, 503, refused.body);
      assert.match(refused.body, /no worker is available \(all 2 workers were lost, restarting\)/, 'the refusal says why, as /health');
      assertNoWorkerRefusal(refused, true);
      const reset = await fetch(`${running.url}/reset_prefix_cache`, { method: 'POST' });
      assert.equal(reset.status, 200, `a reset with no live worker has nothing to forget: ${await reset.text()}`);

      await waitUntil(() => routed.workerIds.length === 2, 'both workers were restarted', 60_000);
      assert.deepEqual(routed.workerIds.sort(), killed.map((id) => `${id}-r1`).sort(), 'new workers, new ids');
      const up = await health(running);
      assert.equal(up.status, 200);
      assert.equal(up.body.ready, true);
      assert.equal(up.body.reason, undefined);
      const again = await complete(running);
      assert.equal(again.status, 200, again.body);
      assert.equal(again.text, expected.text, 'the restarted workers serve the same text');

      for (const id of killed) {
        assert.ok(lines.some((l) => l.includes(`worker ${id} was lost`)), `the loss of ${id} is logged`);
        assert.ok(lines.some((l) => l.includes(`worker ${id}: restart attempt 1 of 3 in 3000 ms (as ${id}-r1)`)), `its restart is logged`);
        assert.ok(lines.some((l) => l.includes(`worker ${id}-r1 started in place of the lost one`)));
      }
    } finally {
      await running.api.shutdown(0);
    }
  });

  test('a worker that keeps dying is restarted up to the limit, then given up; /health says so', { timeout: 120_000 }, async () => {
    const lines: string[] = [];
    const running = await serve(fixture, ['--worker-restart-limit', '2', '--worker-restart-delay', '10'], lines);
    try {
      const engine = running.api.gateway.engine;
      assert.ok(engine instanceof SupervisedEngine, 'one cpu worker with restarts on runs supervised');
      const expected = await complete(running);
      assert.equal(expected.status, 200, expected.body);

      // Killed as soon as it is back, three times: the first worker and its two restarts.
      const ids: string[] = [];
      for (let kill = 0; kill < 3; kill++) {
        await waitUntil(() => engine.worker !== undefined, `worker ${kill} is running`, 60_000);
        const worker = engine.worker!;
        ids.push(worker.id);
        if (kill === 1) {
          // Between two deaths it serves as before.
          const served = await complete(running);
          assert.equal(served.text, expected.text);
        }
        await (worker.engine as LocalEngine).kill();
        await waitUntil(() => engine.worker?.id !== worker.id, `worker ${worker.id} was noticed lost`);
      }
      assert.deepEqual(ids, ['worker-0', 'worker-0-r1', 'worker-0-r2']);
      await waitUntil(() => lines.some((l) => l.includes('giving up')), 'the restarts give up');

      const down = await health(running);
      assert.equal(down.status, 503);
      assert.equal(down.body.reason, 'no worker can serve: its one worker was lost, and restarting it gave up');
      const refused = await complete(running);
      assert.equal(refused.status, 503, refused.body);
      assert.match(refused.body, /no worker is available \(its one worker was lost, and restarting it gave up\)/, 'the refusal says why, as /health');
      assertNoWorkerRefusal(refused, false);
      assert.equal(engine.worker, undefined, 'no third restart');
      assert.equal(lines.filter((l) => /restart attempt \d+ of \d+/.test(l)).length, 2, lines.join(''));
      assert.ok(lines.some((l) => l.includes('worker worker-0: giving up after 2 restart attempts in a row')), lines.join(''));
    } finally {
      await running.api.shutdown(0);
    }
  });

  test('one worker with restarts off: its loss fails the request it ran with 503 worker_lost, /health says so, requests get 503',
    { timeout: 120_000 }, async () => {
      const lines: string[] = [];
      const running = await serve(fixture, ['--worker-restart-limit', '0'], lines);
      try {
        const engine = running.api.gateway.engine!;
        const worker = engine instanceof SupervisedEngine ? engine.worker! : { engine };
        // Long enough (ignore_eos) that it still runs when its worker dies.
        const running1 = fetch(`${running.url}/v1/completions`, {
          method: 'POST', headers: { 'Content-Type': 'application/json' },
          body: JSON.stringify({ prompt: 'Once upon a time', max_tokens: 900, ignore_eos: true }),
        }).then(async (response) => ({ status: response.status, body: await response.text() }));
        await waitUntil(() => worker.engine.stats().numRunning === 1, 'the request runs');
        await (worker.engine as LocalEngine).kill();
        const lost = await running1;
        assert.equal(lost.status, 503, lost.body);
        assert.equal((JSON.parse(lost.body) as { error: { code: string } }).error.code, 'worker_lost', lost.body);

        const down = await health(running);
        assert.equal(down.status, 503);
        assert.equal(down.body.status, 'unavailable');
        assert.equal(down.body.reason, 'no worker can serve: its one worker was lost, and this process does not restart workers');
        const refused = await complete(running);
        assert.equal(refused.status, 503, refused.body);
        assert.match(refused.body, /no worker is available \(its one worker was lost, and this process does not restart workers\)/);
        assertNoWorkerRefusal(refused, false);
        assert.ok(lines.some((l) => /ERROR .*worker worker-0 is not restarted \(restarts are off\)/.test(l)), lines.join(''));
      } finally {
        await running.api.shutdown(0);
      }
    });

  test('one worker with restarts on: a stream running when it dies ends with a worker_lost error event, then it is restarted',
    { timeout: 120_000 }, async () => {
      const lines: string[] = [];
      const running = await serve(fixture, ['--worker-restart-delay', '10'], lines);
      try {
        const engine = running.api.gateway.engine;
        assert.ok(engine instanceof SupervisedEngine);
        const worker = engine.worker!;
        const response = await fetch(`${running.url}/v1/completions`, {
          method: 'POST', headers: { 'Content-Type': 'application/json' },
          body: JSON.stringify({ prompt: 'Once upon a time', max_tokens: 900, ignore_eos: true, stream: true }),
        });
        assert.equal(response.status, 200);
        let error: { code?: string } | undefined;
        let events = 0;
        await forEachStreamEvent(response, (json) => {
          if (events++ === 0) void (worker.engine as LocalEngine).kill();
          if (json.error) error = json.error;
        });
        assert.equal(error?.code, 'worker_lost', JSON.stringify(error));
        await waitUntil(() => engine.worker !== undefined, 'the worker was restarted', 60_000);
        const again = await complete(running);
        assert.equal(again.status, 200, again.body);
      } finally {
        await running.api.shutdown(0);
      }
    });

  test('disaggregated: a lost prefill worker leaves /health ready, a lost decode worker does not; both come back and serve', { timeout: 120_000 }, async () => {
    const lines: string[] = [];
    const running = await serve(fixture, ['--prefill-workers', '1', '--decode-workers', '1', '--disagg-min-remote-prefill-tokens', '1',
      '--worker-restart-delay', '3000'], lines);
    try {
      const engine = running.api.gateway.engine;
      assert.ok(engine instanceof DisaggregatedEngine);
      const expected = await complete(running);
      assert.equal(expected.status, 200, expected.body);

      await (engine.workerEngine('prefill-0') as LocalEngine).kill();
      await waitUntil(() => engine.prefillWorkerIds.length === 0, 'the prefill worker left');
      assert.equal((await health(running)).status, 200, 'the decode worker prefills itself meanwhile');
      await (engine.workerEngine('decode-0') as LocalEngine).kill();
      await waitUntil(() => engine.decodeWorkerIds.length === 0, 'the decode worker left');
      const down = await health(running);
      assert.equal(down.status, 503);
      assert.equal(down.body.reason, 'no decode worker can serve: its one decode worker was lost, restarting');
      const refused = await complete(running);
      assert.match(refused.body, /no decode worker is available \(its one decode worker was lost, restarting\)/, 'the refusal says why, as /health');
      assertNoWorkerRefusal(refused, true);

      await waitUntil(() => engine.prefillWorkerIds.length === 1 && engine.decodeWorkerIds.length === 1, 'both workers were restarted', 60_000);
      assert.deepEqual([engine.prefillWorkerIds, engine.decodeWorkerIds], [['prefill-0-r1'], ['decode-0-r1']]);
      assert.equal((await health(running)).status, 200);
      const again = await complete(running);
      assert.equal(again.text, expected.text);
      // The new prefill worker prefills for the new decode worker, its KV moved over the channel.
      assert.equal(engine.channel.sourceFor('prefill-0-r1', 'decode-0-r1'), 'prefill-0-r1', 'the new workers are connected');
      const transfers = engine.channel.log.summary().transfers;
      const outputs: EngineOutput[] = [];
      for await (const output of engine.generate({
        id: 'after-restart', promptTokenIds: Array.from({ length: 40 }, (_, i) => 100 + i), priority: 0, arrivalMs: 0,
        sampling: { ...DEFAULT_SAMPLING, maxTokens: 4, temperature: 0, ignoreEos: true },
      })) outputs.push(output);
      const decision = outputs.at(-1)!.routing!.disaggregation!;
      assert.equal(decision.mode, 'disaggregated', JSON.stringify(decision));
      assert.equal(decision.prefillWorkerId, 'prefill-0-r1');
      assert.equal(outputs.at(-1)!.routing!.workerId, 'decode-0-r1');
      assert.equal(engine.channel.log.summary().transfers, transfers + 1, 'its KV went over the channel');
    } finally {
      await running.api.shutdown(0);
    }
  });

  test('several models: every worker of the second lost makes /health 503 naming it; the first still serves', { timeout: 120_000 }, async () => {
    const lines: string[] = [];
    // A restart far later than the checks: the second model stays without workers meanwhile.
    const running = await serve(fixture, ['--model', `second=${fixture.modelPath}`, '--served-model-name', 'first',
      '--workers', '2', '--worker-restart-delay', '60000'], lines);
    try {
      const [first, second] = running.api.gateway.servedModels;
      assert.equal(first!.name, 'first');
      assert.equal(second!.name, 'second');
      const routed = second!.backend.engine;
      assert.ok(routed instanceof RoutedEngine);
      const before = await fetch(`${running.url}/health`);
      assert.equal(before.status, 200);
      const listed = Object.keys(await before.json() as object);

      await Promise.all(routed.workerIds.map((id) => (routed.workerEngine(id) as LocalEngine).kill()));
      await waitUntil(() => routed.workerIds.length === 0, 'the second model\'s workers left its router');

      const response = await fetch(`${running.url}/health`);
      const body = await response.json() as { status: string; ready: boolean; reason?: string; model: string };
      assert.equal(response.status, 503);
      assert.equal(body.ready, false);
      assert.equal(body.status, 'unavailable');
      assert.equal(body.reason, 'second: no worker can serve: all 2 workers were lost, restarting');
      assert.equal(body.model, 'first');
      assert.deepEqual(Object.keys(body).filter((key) => key !== 'reason'), listed, 'the body lists what it listed');
      const served = await fetch(`${running.url}/v1/completions`, {
        method: 'POST', headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify({ model: 'first', prompt: 'Once upon a time', max_tokens: 4 }),
      });
      assert.equal(served.status, 200, await served.text());
    } finally {
      await running.api.shutdown(0);
    }
  });
});
