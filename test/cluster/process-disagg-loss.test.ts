// `conduit serve --prefill-workers 1 --decode-workers 1 --worker-processes`, the decode child killed (SIGKILL) while
// the official `openai` client streams a completion from it: the stream ends with a worker_lost error, the server
// stays up and says why it cannot serve (lost children are not restarted in this mode), and /health lists the lost
// child without the request counts of the moment it died (the request it ran has failed since), as a frontend lists
// a lost worker.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import OpenAI from 'openai';
import { silentLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { SLOW_DECODE_SHAPE, writeWorkerLossFixture } from '../helpers/worker-loss.ts';

interface WorkerView { id: string; role: string; pid: number; state: string; running?: number; waiting?: number }
interface Health { ready: boolean; reason?: string; workers: WorkerView[] }

describe('serve --worker-processes, prefill and decode: the decode child killed mid-stream', () => {
  let dir: string;
  let server: RunningServer;
  const pids: number[] = [];

  before(async () => {
    // A model slow enough to decode that the kill lands while the stream runs.
    const fixture = writeWorkerLossFixture('process-disagg-loss', undefined, SLOW_DECODE_SHAPE);
    dir = fixture.dir;
    const config = parseServeConfig(['--model', fixture.modelPath, '--port', '0', '--threads', '1', '--kv-cache-memory', '16MiB',
      '--no-request-log', '--prefill-workers', '1', '--decode-workers', '1', '--worker-processes'], {});
    assert.notEqual(config, 'help');
    server = await startServer(config as Exclude<typeof config, 'help'>, silentLogger);
  });

  after(async () => {
    await server?.api.shutdown(0);
    for (const pid of pids) {
      try { process.kill(pid, 'SIGKILL'); } catch { /* already gone */ }
    }
    rmSync(dir, { recursive: true, force: true });
  });

  const health = async (): Promise<Health> => await (await fetch(`${server.url}/health`)).json() as Health;

  test('the stream fails with worker_lost; /health lists the lost child without stale counts', { timeout: 180_000 }, async () => {
    const before = await health();
    pids.push(...before.workers.map((w) => w.pid));
    const decode = before.workers.find((w) => w.role === 'decode')!;
    assert.equal(decode.state, 'ready');

    const client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 120_000 });
    const body = {
      model: server.api.gateway.servedModelName!, prompt: 'Once upon a time', max_tokens: 600, temperature: 0,
      stream: true as const, ignore_eos: true,
    };
    const chunks = await client.completions.create(body as OpenAI.CompletionCreateParamsStreaming);
    let count = 0;
    let failure: unknown;
    try {
      for await (const chunk of chunks) {
        assert.equal(chunk.choices[0]?.finish_reason ?? null, null, 'the stream does not finish before the kill');
        if (++count === 5) process.kill(decode.pid, 'SIGKILL');
      }
    } catch (error) {
      failure = error;
    }
    assert.ok(failure instanceof OpenAI.APIError, `the stream ends with an error, after ${count} chunks: ${String(failure)}`);
    assert.match(failure.message, /worker.*lost/i);

    // The server is up and says why it serves nothing now.
    let after = await health();
    for (let turn = 0; after.workers.find((w) => w.id === decode.id)?.state !== 'lost'; turn++) {
      assert.ok(turn < 600, `the decode child is seen lost: ${JSON.stringify(after)}`);
      await new Promise((resolve) => setTimeout(resolve, 50));
      after = await health();
    }
    assert.equal(after.ready, false);
    assert.match(after.reason ?? '', /decode worker/);
    const lost = after.workers.find((w) => w.id === decode.id)!;
    assert.equal(lost.running, undefined, `a lost child runs nothing: ${JSON.stringify(lost)}`);
    assert.equal(lost.waiting, undefined, JSON.stringify(lost));
    const prefill = after.workers.find((w) => w.role === 'prefill')!;
    assert.deepEqual([prefill.state, prefill.running, prefill.waiting], ['ready', 0, 0]);
    const refused = await fetch(`${server.url}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: 'x', max_tokens: 2 }),
    });
    assert.equal(refused.status, 503, await refused.text());
  });
});
