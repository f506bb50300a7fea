// `conduit serve --workers 2 --worker-processes`: CPU workers as child processes over the request plane. A native
// crash (SIGSEGV) of the child running a stream is survived: the stream migrates and ends with the same greedy
// text, the child is replaced by a new process, and the server keeps serving; a child that hangs is ended when it is
// declared lost, not left running beside its replacement. Closing the server ends the children.
// The engine options reach the children, as the server's command line gives them: the twins of the worker's options
// in the environment the children inherit do not override them, nor set the children's own options (the address a
// child reports). A child that cannot start gives the server its reason, which the server's error names.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import { join } from 'node:path';
import { acquireDiskTierLock } from '../../src/engine/kv-cache/disk-tier.ts';
import { EngineStartError } from '../../src/engine/errors.ts';
import { createLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { SLOW_DECODE_SHAPE, writeWorkerLossFixture } from '../helpers/worker-loss.ts';
import { forEachStreamEvent } from '../helpers/sse-stream.ts';

interface WorkerView { id: string; pid: number; state: string; running: number }

describe('serve --worker-processes', () => {
  let dir: string;
  let server: RunningServer;
  const pids = new Set<number>();

  before(async () => {
    const fixture = writeWorkerLossFixture('process-pool', undefined, SLOW_DECODE_SHAPE);
    dir = fixture.dir;
    const config = parseServeConfig(['--model', fixture.modelPath, '--port', '0', '--workers', '2', '--worker-processes', '--threads', '1',
      '--kv-cache-memory', '16MiB', '--migration-limit', '2', '--worker-restart-delay', '50', '--no-request-log'], {});
    assert.notEqual(config, 'help');
    server = await startServer(config as Exclude<typeof config, 'help'>, createLogger('error'));
  });

  after(async () => {
    await server?.api.shutdown(0);
    // Whatever the test did, no child outlives it.
    for (const pid of pids) {
      try { process.kill(pid, 'SIGKILL'); } catch { /* already gone */ }
    }
    rmSync(dir, { recursive: true, force: true });
  });

  const health = async (): Promise<{ ready: boolean; workers: WorkerView[]; kv_cache_dtype?: string }> => (await fetch(`${server.url}/health`)).json() as never;
  const body = (maxTokens: number) => ({ prompt: 'Once upon a time in a distributed system', max_tokens: maxTokens, temperature: 0, repetition_penalty: 1.3, ignore_eos: true });

  test('a SIGSEGV in the child running a stream: the stream migrates with the same text, the child is replaced', async () => {
    const first = await health();
    assert.equal(first.workers.length, 2);
    assert.equal(first.kv_cache_dtype, 'f16', 'child workers left at --kv-cache-dtype auto resolve it as a worker thread does');
    for (const w of first.workers) {
      assert.ok(w.pid > 0 && w.pid !== process.pid, 'each worker is a process of its own');
      pids.add(w.pid);
    }
    const expected = await (await fetch(`${server.url}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body(300)),
    })).json() as { choices: { text: string }[] };

    const res = await fetch(`${server.url}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ ...body(300), stream: true }),
    });
    let text = '';
    let events = 0;
    let crashed: WorkerView | undefined;
    let error: unknown;
    let streamId = '';
    await forEachStreamEvent(res, async (json) => {
      if (json.error) error = json.error;
      const { id } = json as { id?: unknown };
      if (typeof id === 'string') streamId = id;
      text += json.choices?.[0]?.text ?? '';
      if (++events === 10) {
        // Exactly one worker runs it (a count left from an earlier request clears with the next heartbeat); the
        // model decodes slowly enough (SLOW_DECODE_SHAPE) that the stream outlasts the wait.
        for (let i = 0; i < 100; i++) {
          const running = (await health()).workers.filter((w) => w.running > 0);
          if (running.length === 1) { crashed = running[0]; break; }
          await new Promise((resolve) => setTimeout(resolve, 50));
        }
        assert.ok(crashed, 'a worker runs the stream');
        process.kill(crashed.pid, 'SIGSEGV');
      }
    });
    assert.equal(error, undefined);
    assert.equal(text, expected.choices[0]!.text);
    assert.ok(crashed, 'the stream ran past ten events');
    // The trace is stored once the response's last byte is out, which the client may see a moment before.
    let traced = await fetch(`${server.url}/v1/requests/${streamId}/trace`);
    for (let i = 0; i < 100 && traced.status === 404; i++) {
      await new Promise((resolve) => setTimeout(resolve, 20));
      traced = await fetch(`${server.url}/v1/requests/${streamId}/trace`);
    }
    const moved = await traced.json() as { migrations?: { from_worker: string }[] };
    assert.deepEqual(moved.migrations?.map((m) => m.from_worker), [crashed.id], `the stream moved off the crashed worker: ${JSON.stringify(moved).slice(0, 300)}`);
    let replaced: WorkerView | undefined;
    for (let i = 0; i < 300 && !replaced; i++) {
      replaced = (await health()).workers.find((w) => w.id === `${crashed!.id}-r1` && w.state === 'ready');
      if (!replaced) await new Promise((resolve) => setTimeout(resolve, 100));
    }
    assert.ok(replaced, `${crashed!.id} was replaced by a new process`);
    pids.add(replaced.pid);
    assert.notEqual(replaced.pid, crashed!.pid);
    const after = await (await fetch(`${server.url}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body(20)),
    })).json() as { choices: { text: string }[] };
    assert.equal(after.choices[0]!.text, expected.choices[0]!.text.slice(0, after.choices[0]!.text.length));
  });

  test('a guided request runs under its grammar in a worker process', async () => {
    // The random model's free text is never exactly twelve lowercase letters and a full stop: only the grammar,
    // which must have crossed the request plane, makes it so.
    for (const temperature of [0, 1]) {
      const res = await fetch(`${server.url}/v1/completions`, {
        method: 'POST', headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ prompt: 'Spell a word:', max_tokens: 40, temperature, seed: 5, guided_regex: '[a-z]{12}\\.' }),
      });
      const json = await res.json() as { choices: { text: string; finish_reason: string }[] };
      assert.equal(res.status, 200, JSON.stringify(json));
      assert.match(json.choices[0]!.text, /^[a-z]{12}\.$/, `temperature ${temperature}`);
      assert.equal(json.choices[0]!.finish_reason, 'stop');
    }
  });

  test('a child that hangs (stopped past the heartbeat timeout) is lost, ended and replaced, not left running beside its replacement', async () => {
    const { workers } = await health();
    const hung = workers.find((w) => w.state === 'ready')!;
    pids.add(hung.pid);
    process.kill(hung.pid, 'SIGSTOP');
    let alive = true;
    // The heartbeat timeout is 5 s; the bound only guards against a hang.
    for (let i = 0; i < 300 && alive; i++) {
      try { process.kill(hung.pid, 0); await new Promise((resolve) => setTimeout(resolve, 100)); } catch { alive = false; }
    }
    if (alive) process.kill(hung.pid, 'SIGCONT');
    assert.equal(alive, false, `the hung worker process ${hung.pid} was ended`);
    let replaced: WorkerView | undefined;
    for (let i = 0; i < 300 && !replaced; i++) {
      replaced = (await health()).workers.find((w) => w.id.startsWith(`${hung.id}-r`) && w.state === 'ready');
      if (!replaced) await new Promise((resolve) => setTimeout(resolve, 100));
    }
    assert.ok(replaced, `${hung.id} was replaced`);
    pids.add(replaced.pid);
  });

  test('closing the server ends the worker processes', async () => {
    const { workers } = await health();
    await server.api.shutdown(0);
    for (const { pid } of workers) {
      let alive = true;
      for (let i = 0; i < 100 && alive; i++) {
        try { process.kill(pid, 0); await new Promise((resolve) => setTimeout(resolve, 50)); } catch { alive = false; }
      }
      assert.equal(alive, false, `worker process ${pid} exited`);
    }
  });
});

describe('serve --worker-processes with KV offload tiers', () => {
  let dir: string;
  let server: RunningServer | undefined;

  after(async () => {
    await server?.api.shutdown(0);
    rmSync(dir, { recursive: true, force: true });
  });

  test('the child workers get the RAM and disk tiers, and the server holds the disk folder', async () => {
    const fixture = writeWorkerLossFixture('process-pool-tiers');
    dir = fixture.dir;
    const tierDir = join(dir, 'tier');
    const config = parseServeConfig(['--model', fixture.modelPath, '--port', '0', '--workers', '1', '--worker-processes', '--threads', '1',
      '--kv-cache-memory', '4MiB', '--kv-offload-memory', '1MiB', '--kv-offload-disk', tierDir, '--kv-offload-disk-size', '4MiB', '--no-request-log'], {});
    assert.notEqual(config, 'help');
    server = await startServer(config as Exclude<typeof config, 'help'>, createLogger('error'));
    // A worker's stats carry its tiers from its first step on.
    const res = await fetch(`${server.url}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: 'Hello there', max_tokens: 2 }),
    });
    assert.equal(res.status, 200, await res.text());
    const text = await (await fetch(`${server.url}/metrics`)).text();
    for (const tier of ['ram', 'disk']) {
      const capacity = new RegExp(`^conduit_kv_tier_capacity_blocks\\{worker="worker-0",tier="${tier}"\\} (\\d+)$`, 'm').exec(text);
      assert.ok(capacity && Number(capacity[1]) > 0, `a ${tier} tier on the child worker`);
    }
    assert.throws(() => acquireDiskTierLock(tierDir), /already in use/, 'a second server on the folder is refused');
    await server.api.shutdown(0);
    server = undefined;
    acquireDiskTierLock(tierDir)();
  });
});

describe('serve --worker-processes passes the engine options on to its children', () => {
  let server: RunningServer;

  before(async () => {
    const config = parseServeConfig(['--port', '0', '--workers', '1', '--worker-processes', '--threads', '1', '--kv-cache-memory', '8MiB',
      '--max-model-len', '80', '--no-enable-prefix-caching', '--guided-jump-forward', '--no-request-log'], {});
    assert.notEqual(config, 'help');
    server = await startServer(config as Exclude<typeof config, 'help'>, createLogger('error'));
  });
  after(async () => {
    await server?.api.shutdown(0);
  });

  test('--max-model-len and --no-enable-prefix-caching hold in the child worker', async () => {
    const models = await (await fetch(`${server.url}/v1/models`)).json() as { data: { max_model_len: number }[] };
    assert.equal(models.data[0]!.max_model_len, 80);
    const prompt = 'Once upon a time there was a little girl who lived in a village near the forest. '.repeat(2);
    for (let i = 0; i < 2; i++) {
      const response = await (await fetch(`${server.url}/v1/completions`, {
        method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt, max_tokens: 1 }),
      })).json() as { usage: { prompt_tokens_details?: { cached_tokens?: number } } };
      assert.equal(response.usage.prompt_tokens_details?.cached_tokens ?? 0, 0, `request ${i}: nothing from a prefix cache`);
    }
  });

  test('--guided-jump-forward holds in the child worker: forced text streams several tokens to a chunk', async () => {
    const res = await fetch(`${server.url}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({
        prompt: 'Pick:', temperature: 0, max_tokens: 32, guided_choice: ['the quick brown fox jumps over the lazy dog'],
        stream: true, stream_options: { include_usage: true, continuous_usage_stats: true },
      }),
    });
    assert.equal(res.status, 200);
    const counts: number[] = [];
    for (const line of (await res.text()).split('\n')) {
      if (!line.startsWith('data: {')) continue;
      const chunk = JSON.parse(line.slice(6)) as { choices: unknown[]; usage?: { completion_tokens: number } };
      if (chunk.choices.length > 0 && chunk.usage) counts.push(chunk.usage.completion_tokens);
    }
    assert.ok(counts.some((count, i) => count - (counts[i - 1] ?? 0) > 1), `tokens so far by chunk: ${counts.join(' ')}`);
  });
});

describe('serve --worker-processes --stream-interval 4', () => {
  let server: RunningServer;

  before(async () => {
    const config = parseServeConfig(['--port', '0', '--workers', '1', '--worker-processes', '--threads', '1', '--kv-cache-memory', '8MiB',
      '--stream-interval', '4', '--no-request-log'], {});
    assert.notEqual(config, 'help');
    server = await startServer(config as Exclude<typeof config, 'help'>, createLogger('error'));
  });
  after(async () => {
    await server?.api.shutdown(0);
  });

  test('holds in the child worker: the first token alone, then four tokens to a chunk', async () => {
    const res = await fetch(`${server.url}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ prompt: 'Once upon a time', temperature: 0, max_tokens: 13, logprobs: 1, stream: true }),
    });
    assert.equal(res.status, 200);
    const sizes: number[] = [];
    for (const line of (await res.text()).split('\n')) {
      if (!line.startsWith('data: {')) continue;
      const chunk = JSON.parse(line.slice(6)) as { choices: { logprobs: { tokens: string[] } | null }[] };
      const tokens = chunk.choices[0]?.logprobs?.tokens.length ?? 0;
      if (tokens > 0) sizes.push(tokens);
    }
    assert.deepEqual(sizes, [1, 4, 4, 4]);
  });
});

describe('serve --worker-processes: the children take the server\'s command line, not the environment\'s twins', () => {
  let server: RunningServer | undefined;
  // What an environment shared with other deployments may hold: serve's own twins, which the typed options override,
  // and those of `conduit worker`'s own options, meant for a cluster's workers.
  const env = {
    CONDUIT_ENABLE_PREFIX_CACHING: 'false', CONDUIT_KV_CACHE_DTYPE: 'f32',
    CONDUIT_ADVERTISE_ADDRESS: '127.0.0.1:1', CONDUIT_NAMESPACE: 'not a namespace', CONDUIT_LEASE_TTL: '1', CONDUIT_KV_PORT: '1',
  };

  before(async () => {
    const config = parseServeConfig(['--port', '0', '--workers', '1', '--worker-processes', '--threads', '1', '--kv-cache-memory', '8MiB',
      '--enable-prefix-caching', '--kv-cache-dtype', 'auto', '--no-request-log'], env);
    assert.notEqual(config, 'help');
    // The children are forked during the start: they inherit this environment.
    const saved = Object.fromEntries(Object.keys(env).map((key) => [key, process.env[key]]));
    Object.assign(process.env, env);
    try {
      server = await startServer(config as Exclude<typeof config, 'help'>, createLogger('error'));
    } finally {
      for (const [key, value] of Object.entries(saved)) {
        if (value === undefined) delete process.env[key];
        else process.env[key] = value;
      }
    }
  });
  after(async () => {
    await server?.api.shutdown(0);
  });

  test('typed --enable-prefix-caching and --kv-cache-dtype auto hold in the child; it reports its own address', async () => {
    const health = await (await fetch(`${server!.url}/health`)).json() as { kv_cache_dtype: string; workers: { address: string; state: string }[] };
    assert.equal(health.kv_cache_dtype, 'f16', 'auto, not CONDUIT_KV_CACHE_DTYPE=f32');
    assert.match(health.workers[0]!.address, /^127\.0\.0\.1:\d+$/);
    assert.notEqual(health.workers[0]!.address, env.CONDUIT_ADVERTISE_ADDRESS);
    assert.equal(health.workers[0]!.state, 'ready');
    const prompt = 'Once upon a time there was a little girl who lived in a village near the forest. '.repeat(2);
    const cached: number[] = [];
    for (let i = 0; i < 2; i++) {
      const response = await (await fetch(`${server!.url}/v1/completions`, {
        method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt, max_tokens: 1 }),
      })).json() as { usage: { prompt_tokens_details?: { cached_tokens?: number } } };
      cached.push(response.usage.prompt_tokens_details?.cached_tokens ?? 0);
    }
    assert.equal(cached[0], 0);
    assert.ok(cached[1]! > 0, `the second request found the first one's prefix: ${cached}`);
  });
});

describe('serve --worker-processes: a child that cannot start', () => {
  test('the server\'s error names the child\'s reason', async () => {
    const config = parseServeConfig(['--port', '0', '--workers', '1', '--worker-processes', '--threads', '1', '--kv-cache-memory', '8MiB',
      '--max-model-len', '99999', '--no-request-log'], {});
    assert.notEqual(config, 'help');
    await assert.rejects(startServer(config as Exclude<typeof config, 'help'>, createLogger('error')), (error: unknown) => {
      assert.ok(error instanceof EngineStartError, String(error));
      assert.match(error.message, /^worker process worker-0 could not start: --max-model-len 99999 is above the model's context length \(\d+ tokens\)$/);
      return true;
    });
  });
});
