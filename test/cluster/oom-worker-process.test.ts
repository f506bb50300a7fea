// A real out-of-memory failure in a worker process: `conduit serve --worker-processes` with the built-in model, the
// child's data memory then capped (prlimit --data, util-linux: RLIMIT_DATA, which Linux checks for every private
// writable mapping, malloc's arenas growing included) a few MiB above what it has, and a prompt whose step needs
// tens of MiB more scratch than that. The addon's allocation fails for real (std::bad_alloc from
// the allocator, no test hook), the request gets an OpenAI-style 503 out_of_memory naming the memory failure, the worker counts it
// (conduit_oom_events_total{kind="scratch"}), gives the request's KV blocks back, and serves the next request: the
// same process, not a restarted one.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { after, before, describe, it } from 'node:test';
import { createLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { rawRequest } from '../api/http-client.ts';
import { parseExposition } from '../telemetry/exposition.ts';

const PRLIMIT_MISSING = 'prlimit not found: install util-linux to run this test';
const havePrlimit = spawnSync('prlimit', ['--version'], { encoding: 'utf8' }).status === 0;
const LIVE = { timeout: 180_000 };
/** Data memory the worker may add to what it had: well below the long prompt's scratch (~35 MiB of activations). */
const HEADROOM_BYTES = 12 * 1024 * 1024;
const LONG_PROMPT_TOKENS = 2000;

interface WorkerView { id: string; pid: number; state: string; running: number }

function vmDataBytes(pid: number): number {
  const m = /^VmData:\s+(\d+) kB$/m.exec(readFileSync(`/proc/${pid}/status`, 'utf8'));
  assert.ok(m, `VmData of ${pid}`);
  return Number(m[1]) * 1024;
}

describe('a real allocation failure in a worker process (prlimit --data)', { skip: havePrlimit ? false : PRLIMIT_MISSING }, () => {
  let server: RunningServer;
  let pid = 0;
  before(async () => {
    const config = parseServeConfig(['--port', '0', '--workers', '1', '--worker-processes', '--threads', '1',
      '--kv-cache-memory', '64MiB', '--max-num-batched-tokens', '2048', '--no-request-log'], {});
    assert.notEqual(config, 'help');
    server = await startServer(config as Exclude<typeof config, 'help'>, createLogger('error'));
  });
  after(async () => {
    await server?.api.shutdown(0);
    if (pid > 0) {
      try { process.kill(pid, 'SIGKILL'); } catch { /* already gone */ }
    }
  });

  const health = async () => (await (await fetch(`${server.url}/health`)).json()) as { workers: WorkerView[] };
  const complete = (prompt: string | number[], maxTokens: number) => rawRequest(server.url, {
    path: '/v1/completions', body: { prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true },
  });
  const oomEvents = async (): Promise<number> => {
    const { samples } = parseExposition(await (await fetch(`${server.url}/metrics`)).text());
    return samples.filter((s) => s.name === 'conduit_oom_events_total' && s.labels.kind === 'scratch').reduce((sum, s) => sum + s.value, 0);
  };

  it('the request fails with a 503 naming the memory failure, is counted, and the worker serves the next one', LIVE, async () => {
    const [worker] = (await health()).workers;
    assert.ok(worker && worker.pid > 0 && worker.pid !== process.pid, 'the worker is a process of its own');
    pid = worker.pid;
    // Warm up: the short path's buffers, threads and heap are in place before the cap.
    for (let i = 0; i < 3; i++) assert.equal((await complete('A lighthouse keeper counted ships', 8)).status, 200);
    const before = await oomEvents();

    const cap = vmDataBytes(pid) + HEADROOM_BYTES;
    const set = spawnSync('prlimit', ['--pid', String(pid), `--data=${cap}`], { encoding: 'utf8' });
    assert.equal(set.status, 0, set.stderr);

    const long = await complete(Array.from({ length: LONG_PROMPT_TOKENS }, (_, i) => 100 + (i % 5000)), 1);
    assert.equal(long.status, 503, long.text);
    const error = long.json().error as { type: string; code: string; message: string };
    assert.equal(error.code, 'out_of_memory', long.text);
    assert.match(error.message, /^The engine worker ran out of memory for this request: out of memory: the step's 2000 tokens needed buffers that could not be allocated \(forward: out of memory/, error.message);

    // The worker's stats reach the gateway with its next load report.
    let counted = before;
    for (let i = 0; i < 100 && counted === before; i++) {
      await new Promise((resolve) => setTimeout(resolve, 50));
      counted = await oomEvents();
    }
    assert.equal(counted - before, 1, 'one scratch allocation failure counted');

    const next = await complete('A lighthouse keeper counted ships', 8);
    assert.equal(next.status, 200, next.text);
    const after = (await health()).workers;
    assert.deepEqual(after.map((w) => [w.pid, w.state, w.running]), [[pid, 'ready', 0]], 'the same process serves on, nothing left running');
  });
});
