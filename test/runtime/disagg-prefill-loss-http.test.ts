// A prefill worker lost mid-prefill as a client sees it: `conduit serve --prefill-workers 2 --decode-workers 1`
// (migration off, the default), the official `openai` client streaming a completion, and the prefill worker running
// its prompt killed. The client reads one complete stream equal to an undisturbed one, the tenant's concurrency slot
// is given back, no block is held, and the trace and the migration counter name the move.
import { attributionProblems, type TraceBody } from '../telemetry/attribution-check.ts';
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import OpenAI from 'openai';
import { silentLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import type { LocalEngine } from '../../src/engine/local-engine.ts';
import { DisaggregatedEngine, PREFILL_WORKER_LOST } from '../../src/runtime/disaggregated.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

const KEY = 'sk-prefill-loss-0001';
/** /metrics is for the admin key when keys are configured. */
const ADMIN_KEY = 'sk-prefill-loss-0001-admin';

describe('a prefill worker lost mid-prefill, through the HTTP server', () => {
  let dir: string;
  let running: RunningServer;
  let client: OpenAI;
  let engine: DisaggregatedEngine;

  before(async () => {
    const fixture = writeWorkerLossFixture('prefill-loss', KEY);
    dir = fixture.dir;
    const modelPath = fixture.modelPath;
    const config = parseServeConfig(['--port', '0', '--log-level', 'silent', '--model', modelPath,
      '--prefill-workers', '2', '--decode-workers', '1', '--disagg-min-remote-prefill-tokens', '1',
      // The reference kernels in 8-token steps: a prompt of a few hundred tokens takes tens of prefill steps, time
      // to kill its worker mid-prefill, and no native code runs in the killed thread.
      '--threads', '1', '--backend', 'reference', '--max-num-batched-tokens', '8', '--kv-cache-memory', '16MiB',
      '--api-keys-file', fixture.keysPath, '--admin-key', ADMIN_KEY], {});
    assert.notEqual(config, 'help');
    running = await startServer(config as Exclude<typeof config, 'help'>, silentLogger);
    assert.ok(running.api.gateway.engine instanceof DisaggregatedEngine);
    engine = running.api.gateway.engine;
    client = new OpenAI({ apiKey: KEY, baseURL: `${running.url}/v1`, maxRetries: 0, timeout: 60_000 });
  });

  after(async () => {
    await running?.api.shutdown(0);
    rmSync(dir, { recursive: true, force: true });
  });

  async function stream(whileRunning?: () => Promise<void>) {
    const model = running.api.gateway.servedModelName!;
    const body = {
      model, prompt: 'Once upon a time a lighthouse keeper counted the ships. '.repeat(30), max_tokens: 40, temperature: 0,
      stream: true as const, stream_options: { include_usage: true }, ignore_eos: true, repetition_penalty: 1.5,
    };
    const read = (async () => {
      const chunks = await client.completions.create(body as OpenAI.CompletionCreateParamsStreaming);
      let text = '';
      let finish: string | null = null;
      let usage: OpenAI.CompletionUsage | undefined;
      const ids = new Set<string>();
      for await (const chunk of chunks) {
        ids.add(chunk.id);
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices[0];
        if (!choice) continue;
        text += choice.text;
        finish = choice.finish_reason ?? finish;
      }
      return { text, finish, usage, ids };
    })();
    await whileRunning?.();
    return read;
  }

  /** The prefill worker running the one request in flight, once it runs it. */
  async function busyPrefillWorker(): Promise<string> {
    for (const deadline = Date.now() + 30_000; Date.now() < deadline;) {
      for (const workerId of engine.prefillWorkerIds) {
        if ((await (engine.workerEngine(workerId) as LocalEngine).sync()).numRunning > 0) return workerId;
      }
      await new Promise((resolve) => setTimeout(resolve, 1));
    }
    assert.fail('no prefill worker took the request');
  }

  test('the openai client reads a complete stream, equal to an undisturbed one', { timeout: 120_000 }, async () => {
    let lost: string | undefined;
    const disturbed = await stream(async () => {
      lost = await busyPrefillWorker();
      await (engine.workerEngine(lost) as LocalEngine).kill();
    });
    assert.ok(lost);
    assert.equal(engine.prefillWorkerIds.includes(lost), false, 'the worker is gone');
    const [survivor] = engine.prefillWorkerIds;
    assert.equal(disturbed.ids.size, 1, 'one response id throughout');
    assert.equal(disturbed.finish, 'length');
    assert.equal(disturbed.usage?.completion_tokens, 40);

    // Undisturbed, after: the slot came back, or this would be refused.
    const undisturbed = await stream();
    assert.equal(disturbed.text, undisturbed.text);
    assert.deepEqual(disturbed.usage?.completion_tokens, undisturbed.usage?.completion_tokens);
    assert.deepEqual(disturbed.usage?.prompt_tokens, undisturbed.usage?.prompt_tokens);

    const [responseId] = [...disturbed.ids];
    const traceResponse = await fetch(`${running.url}/v1/requests/${responseId}/trace`, { headers: { authorization: `Bearer ${KEY}` } });
    assert.equal(traceResponse.status, 200);
    const trace = await traceResponse.json() as { outcome: string; migrations: { from_worker: string; to_worker: string | null; after_tokens: number; reason: string }[] };
    assert.equal(trace.outcome, 'ok');
    assert.deepEqual(trace.migrations, [{ from_worker: lost, to_worker: survivor, after_tokens: 0, reason: PREFILL_WORKER_LOST }]);
    // Prefilled again elsewhere, and still every millisecond attributed.
    assert.deepEqual(attributionProblems(trace as unknown as TraceBody), [], JSON.stringify((trace as unknown as TraceBody).phases));

    const metrics = await (await fetch(`${running.url}/metrics`, { headers: { authorization: `Bearer ${ADMIN_KEY}` } })).text();
    const line = metrics.split('\n').find((l) => l.startsWith(`conduit_request_migrations_total{worker="${survivor}"}`));
    assert.equal(line?.split(' ').at(-1), '1', line ?? metrics.split('\n').filter((l) => l.includes('migration')).join('\n'));

    // Nothing held anywhere once the streams are over.
    for (const workerId of [...engine.prefillWorkerIds, ...engine.decodeWorkerIds]) {
      const stats = await (engine.workerEngine(workerId) as LocalEngine).sync();
      assert.equal(stats.kvBlocksUsed, 0, `worker ${workerId} holds no block`);
      assert.equal(stats.numRunning + stats.numWaiting, 0, `worker ${workerId} runs nothing`);
    }
    assert.equal(running.api.gateway.activeRunCount, 0);
  });
});
