// Request migration as a client sees it: `conduit serve --workers 2 --migration-limit 1`, the official `openai`
// client streaming a completion, and the worker running it killed mid-stream. The client reads one uninterrupted
// stream equal to an unmigrated one, the tenant's concurrency slot is given back, and the migration counter moves.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import OpenAI from 'openai';
import { silentLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import type { LocalEngine } from '../../src/engine/local-engine.ts';
import type { RoutedEngine } from '../../src/runtime/routed-engine.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';
import { attributionProblems, type TraceBody } from '../telemetry/attribution-check.ts';

const KEY = 'sk-migration-0001';
/** /metrics is for the admin key when keys are configured. */
const ADMIN_KEY = 'sk-migration-0001-admin';

describe('request migration through the HTTP server', () => {
  let dir: string;
  let running: RunningServer;
  let client: OpenAI;

  before(async () => {
    const fixture = writeWorkerLossFixture('migration', KEY);
    dir = fixture.dir;
    const modelPath = fixture.modelPath;
    const config = parseServeConfig(['--port', '0', '--log-level', 'silent', '--model', modelPath, '--workers', '2',
      // The reference kernels: a few ms per token, so the kill lands mid-stream, and no native code in the killed thread.
      '--threads', '1', '--backend', 'reference', '--kv-cache-memory', '16MiB', '--api-keys-file', fixture.keysPath, '--admin-key', ADMIN_KEY],
    { CONDUIT_MIGRATION_LIMIT: '1' });
    assert.notEqual(config, 'help');
    running = await startServer(config as Exclude<typeof config, 'help'>, silentLogger);
    client = new OpenAI({ apiKey: KEY, baseURL: `${running.url}/v1`, maxRetries: 0, timeout: 60_000 });
  });

  after(async () => {
    await running?.api.shutdown(0);
    rmSync(dir, { recursive: true, force: true });
  });

  async function stream(onChunk?: (count: number) => Promise<void>) {
    const model = running.api.gateway.servedModelName!;
    const body = {
      model, prompt: 'Once upon a time', max_tokens: 150, temperature: 0, stream: true as const,
      stream_options: { include_usage: true }, ignore_eos: true, repetition_penalty: 1.5,
    };
    const chunks = await client.completions.create(body as OpenAI.CompletionCreateParamsStreaming);
    let text = '';
    let finish: string | null = null;
    let usage: OpenAI.CompletionUsage | undefined;
    const ids = new Set<string>();
    let count = 0;
    for await (const chunk of chunks) {
      ids.add(chunk.id);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices[0];
      if (!choice) continue;
      assert.equal(choice.index, 0);
      text += choice.text;
      finish = choice.finish_reason ?? finish;
      await onChunk?.(++count);
    }
    return { text, finish, usage, ids };
  }

  test('the openai client streams on through a worker loss', { timeout: 120_000 }, async () => {
    const expected = await stream();
    assert.equal(expected.usage?.completion_tokens, 150);

    const routed = running.api.gateway.engine as RoutedEngine;
    let victim: string | undefined;
    const migrated = await stream(async (count) => {
      if (count !== 20) return;
      for (const workerId of routed.workerIds) {
        const engine = routed.workerEngine(workerId) as LocalEngine;
        if ((await engine.sync()).numRunning > 0) victim = workerId;
      }
      assert.ok(victim, 'a worker runs the request');
      await (routed.workerEngine(victim) as LocalEngine).kill();
    });
    assert.ok(victim);
    assert.deepEqual(routed.workerIds.includes(victim), false, 'the worker is gone');
    assert.equal(migrated.ids.size, 1, 'one response id throughout');
    assert.equal(migrated.text, expected.text);
    assert.equal(migrated.finish, 'length');
    assert.deepEqual(migrated.usage, expected.usage);

    const survivor = routed.workerIds[0]!;
    // The request's trace names the move: the worker lost, the survivor, and how far the stream had got.
    const [responseId] = [...migrated.ids];
    const traceResponse = await fetch(`${running.url}/v1/requests/${responseId}/trace`, { headers: { authorization: `Bearer ${KEY}` } });
    assert.equal(traceResponse.status, 200);
    const trace = await traceResponse.json() as { migrations: { from_worker: string; to_worker: string | null; after_tokens: number }[] };
    assert.equal(trace.migrations.length, 1);
    assert.equal(trace.migrations[0]!.from_worker, victim);
    assert.equal(trace.migrations[0]!.to_worker, survivor);
    assert.ok(trace.migrations[0]!.after_tokens >= 20, `after ${trace.migrations[0]!.after_tokens} tokens`);
    // Every millisecond of the migrated request is still attributed: the survivor's recompute is decode time.
    assert.deepEqual(attributionProblems(trace as unknown as TraceBody), [],
      JSON.stringify((trace as unknown as TraceBody).phases));

    const again = await stream();
    assert.equal(again.text, expected.text, 'the tenant\'s slot was given back; the survivor serves on');

    const metrics = await (await fetch(`${running.url}/metrics`, { headers: { authorization: `Bearer ${ADMIN_KEY}` } })).text();
    const line = metrics.split('\n').find((l) => l.startsWith(`conduit_request_migrations_total{worker="${survivor}"}`));
    assert.equal(line?.split(' ').at(-1), '1', line ?? metrics.split('\n').filter((l) => l.includes('migration')).join('\n'));
  });
});
