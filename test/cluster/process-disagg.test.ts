// `conduit serve --prefill-workers 1 --decode-workers 1 --worker-processes`: the prefill and the decode worker are
// child processes; the decode worker takes each prompt's KV from the prefill worker's KV port (on one host through
// shared memory, the runs' headers over loopback TCP). Greedy output equals an aggregated server's, the response's timings name the link, and closing the
// server ends the children.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import { createLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { UsageError } from '../../src/cli/flags.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';
import { kvHostId } from '../../src/cluster/kv-shm.ts';

interface WorkerView { id: string; role: string; pid: number; state: string }

async function complete(url: string, body: object): Promise<{ text: string; timings?: { kv_transfer?: { link: string | null; blocks: number; bytes: number } } }> {
  const res = await fetch(`${url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
  const json = await res.json() as { choices: { text: string }[]; timings?: { kv_transfer?: { link: string | null; blocks: number; bytes: number } } };
  assert.equal(res.status, 200, JSON.stringify(json));
  return { text: json.choices[0]!.text, ...(json.timings ? { timings: json.timings } : {}) };
}

describe('serve --worker-processes with prefill and decode workers', () => {
  let dir: string;
  let server: RunningServer;
  let reference: RunningServer;
  const pids: number[] = [];

  before(async () => {
    const fixture = writeWorkerLossFixture('process-disagg');
    dir = fixture.dir;
    const common = ['--model', fixture.modelPath, '--port', '0', '--threads', '1', '--kv-cache-memory', '16MiB', '--no-request-log'];
    const config = parseServeConfig([...common, '--prefill-workers', '1', '--decode-workers', '1', '--worker-processes',
      '--disagg-min-remote-prefill-tokens', '16'], {});
    assert.notEqual(config, 'help');
    server = await startServer(config as Exclude<typeof config, 'help'>, createLogger('error'));
    const plain = parseServeConfig(common, {});
    reference = await startServer(plain as Exclude<typeof plain, 'help'>, createLogger('error'));
  });

  after(async () => {
    await server?.api.shutdown(0);
    await reference?.api.shutdown(0);
    for (const pid of pids) {
      try { process.kill(pid, 'SIGKILL'); } catch { /* already gone */ }
    }
    rmSync(dir, { recursive: true, force: true });
  });

  test('greedy output equals an aggregated server\'s; the KV moved between the two children (shm: one host)', async () => {
    const health = await (await fetch(`${server.url}/health`)).json() as { workers: WorkerView[] };
    assert.deepEqual(health.workers.map((w) => [w.id, w.role, w.state]), [['prefill-0', 'prefill', 'ready'], ['decode-0', 'decode', 'ready']]);
    for (const w of health.workers) {
      assert.ok(w.pid > 0 && w.pid !== process.pid, 'each worker is a process of its own');
      pids.push(w.pid);
    }
    const body = { prompt: Array.from({ length: 40 }, (_, i) => `p${(i * 53) % 307}`).join(' '), max_tokens: 16, temperature: 0, ignore_eos: true };
    const expected = await complete(reference.url, body);
    const got = await complete(server.url, body);
    assert.equal(got.text, expected.text);
    // Two children of one server share a host: the link is shm where /dev/shm is usable, else tcp.
    assert.equal(got.timings?.kv_transfer?.link, kvHostId() !== null ? 'shm' : 'tcp', JSON.stringify(got.timings));
    assert.ok(got.timings!.kv_transfer!.blocks > 0 && got.timings!.kv_transfer!.bytes > 0);
  });

  test('closing the server ends the children', async () => {
    await server.api.shutdown(0);
    for (const pid of pids) {
      let alive = true;
      for (let turn = 0; alive && turn < 200; turn++) {
        try {
          process.kill(pid, 0);
          await new Promise((resolve) => setTimeout(resolve, 25));
        } catch {
          alive = false;
        }
      }
      assert.equal(alive, false, `worker process ${pid} ended`);
    }
  });

  test('simulated workers are refused as disaggregated processes, with the reason', () => {
    assert.throws(() => parseServeConfig(['--engine', 'sim', '--prefill-workers', '1', '--decode-workers', '1', '--worker-processes'], {}),
      (error: unknown) => error instanceof UsageError && /cpu workers/.test(error.message));
  });
});
