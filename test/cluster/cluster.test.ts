// The distributed runtime end to end: real etcd and nats-server on free loopback ports, CPU workers (a tiny synthetic
// model with the Llama 2 vocabulary) as `conduit worker` processes, two `conduit frontend` processes. Greedy output
// equals the single-process server's; kill -9 of a worker mid-stream migrates the stream (limit 2) or ends it with
// worker_lost (limit 0); a late worker joins and takes traffic; the second frontend routes to where the first one's
// request left its KV blocks (events fan out); SIGTERM drains a worker; etcd, NATS and a frontend restart without the
// workers restarting. Every process is killed in the after hook.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { createLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import {
  freePort, removeDir, servicesMissing, startConduit, startEtcd, startNats, stopAll, tempDir, waitForPort,
  type Etcd, type Nats, type Proc,
} from '../helpers/cluster-services.ts';
import { SLOW_DECODE_SHAPE, writeWorkerLossFixture } from '../helpers/worker-loss.ts';
import { forEachStreamEvent } from '../helpers/sse-stream.ts';

const skip = servicesMissing();
const TOKEN = 'cluster-test-token';

interface Frontend { proc: Proc; url: string; port: number }

/** Reads an SSE completion stream; `onChunk` sees the text so far after each event. */
async function stream(url: string, body: object, onChunk?: (text: string, events: number) => Promise<void> | void):
  Promise<{ text: string; finish: string | null; error?: { code?: string; message?: string }; id: string }> {
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ ...body, stream: true }),
  });
  assert.equal(res.status, 200, await (res.status === 200 ? '' : res.clone().text()));
  let text = '';
  let finish: string | null = null;
  let error: { code?: string; message?: string } | undefined;
  let events = 0;
  await forEachStreamEvent(res, async (json) => {
    if (json.error) { error = json.error; return; }
    text += json.choices?.[0]?.text ?? '';
    finish = json.choices?.[0]?.finish_reason ?? finish;
    events++;
    await onChunk?.(text, events);
  });
  return { text, finish, ...(error ? { error } : {}), id: res.headers.get('x-request-id') ?? '' };
}

async function complete(url: string, body: object, headers: Record<string, string> = {}): Promise<{ text: string; id: string; finish: string }> {
  const res = await fetch(`${url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: JSON.stringify(body) });
  const json = await res.json() as { id: string; choices: { text: string; finish_reason: string }[]; error?: unknown };
  assert.equal(res.status, 200, JSON.stringify(json));
  return { text: json.choices[0]!.text, id: json.id, finish: json.choices[0]!.finish_reason };
}

async function health(url: string): Promise<{ ready: boolean; workers?: { id: string; state: string; running?: number }[] }> {
  try {
    return await (await fetch(`${url}/health`)).json() as never;
  } catch {
    return { ready: false };
  }
}

async function until(what: string, condition: () => Promise<boolean> | boolean, maxMs = 20_000): Promise<void> {
  const deadline = Date.now() + maxMs;
  while (!(await condition())) {
    if (Date.now() > deadline) assert.fail(`timed out after ${maxMs} ms waiting until ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

/** The worker a request ran on (last), and the overlap the router saw, from the frontend's trace. */
async function placement(url: string, id: string): Promise<{ workerId: string; overlapBlocks: number; text: string }> {
  let body = '';
  await until(`the trace of ${id}`, async () => {
    const res = await fetch(`${url}/v1/requests/${id}/trace`);
    body = await res.text();
    return res.status === 200;
  });
  const json = JSON.parse(body) as { worker: string; phases: { phase: string; attributes?: { overlap_tokens?: number } }[] };
  const lookup = json.phases.find((p) => p.phase === 'router_lookup');
  assert.ok(json.worker && lookup, `trace of ${id} names the worker and the routing: ${body.slice(0, 400)}`);
  // The test model's blocks hold 16 tokens.
  return { workerId: json.worker, overlapBlocks: Math.floor((lookup.attributes?.overlap_tokens ?? 0) / 16), text: body };
}

/**
 * The worker a stream of `prompt` will run on, chosen before it starts: a one-token request leaves the prompt's
 * blocks on a worker, and once its KV events reached the frontend's router (NATS; a moment), the same prompt goes
 * there again. Acting on this worker right after the stream's first event does not depend on when /health's load
 * figures catch up, nor on how far the client's reading lags behind the server's generating. Each test that acts
 * on it checks afterwards, from the stream's own trace, that the stream did run there.
 */
async function pinnedWorker(url: string, prompt: string): Promise<string> {
  const warm = await complete(url, { prompt, max_tokens: 1, temperature: 0 });
  const { workerId } = await placement(url, warm.id);
  await new Promise((resolve) => setTimeout(resolve, 1000));
  return workerId;
}

let nextPrompt = 0;
/** A prompt no earlier request shared (so its blocks are cached nowhere yet). */
function freshPrompt(words = 60): string {
  const n = nextPrompt++;
  return Array.from({ length: words }, (_, i) => `w${(n * 131 + i * 17) % 997}`).join(' ');
}

describe('distributed runtime', { skip }, () => {
  let dir: string;
  let modelPath: string;
  let etcd: Etcd;
  let nats: Nats;
  const workers = new Map<string, Proc>();
  let a: Frontend;
  let b: Frontend;
  let reference: RunningServer;
  let env: NodeJS.ProcessEnv;

  const startWorker = (id: string): Proc => {
    const proc = startConduit(['worker', '--model', modelPath, '--worker-id', id, '--threads', '1', '--kv-cache-memory', '16MiB',
      '--lease-ttl', '3', '--shutdown-grace', '20'], env);
    workers.set(id, proc);
    return proc;
  };
  const startFrontend = async (migrationLimit: number, port?: number, extra: string[] = []): Promise<Frontend> => {
    const p = port ?? await freePort();
    const proc = startConduit(['frontend', '--port', String(p), '--migration-limit', String(migrationLimit), '--no-request-log', ...extra], env);
    await waitForPort(p);
    return { proc, url: `http://127.0.0.1:${p}`, port: p };
  };
  const readyWorkers = async (frontend: Frontend): Promise<string[]> =>
    ((await health(frontend.url)).workers ?? []).filter((w) => w.state === 'ready').map((w) => w.id).sort();
  const dump = (): string => [...workers].map(([id, p]) => `--- ${id}\n${p.output()}`).join('\n')
    + `\n--- frontend a\n${a?.proc.output()}\n--- frontend b\n${b?.proc.output()}`;

  before(async () => {
    dir = tempDir('cluster');
    ({ modelPath } = writeWorkerLossFixture('cluster', undefined, SLOW_DECODE_SHAPE));
    [etcd, nats] = await Promise.all([startEtcd(dir), startNats()]);
    env = { CONDUIT_ETCD_ENDPOINTS: etcd.url, CONDUIT_NATS_SERVER: nats.url, CONDUIT_CLUSTER_TOKEN: TOKEN, CONDUIT_LOG_LEVEL: 'info' };
    startWorker('w1');
    startWorker('w2');
    [a, b] = await Promise.all([startFrontend(2), startFrontend(0)]);
    const config = parseServeConfig(['--model', modelPath, '--port', '0', '--threads', '1', '--kv-cache-memory', '16MiB', '--no-request-log'], {});
    reference = await startServer(config as Exclude<typeof config, 'help'>, createLogger('error'));
    try {
      await until('both frontends see both workers', async () =>
        (await readyWorkers(a)).join() === 'w1,w2' && (await readyWorkers(b)).join() === 'w1,w2', 90_000);
    } catch (error) {
      console.error(dump());
      throw error;
    }
  });

  after(async () => {
    await reference?.api.shutdown(0);
    await stopAll();
    removeDir(dir);
  });

  const greedy = (prompt: string, maxTokens = 40) => ({ prompt, max_tokens: maxTokens, temperature: 0, repetition_penalty: 1.3, ignore_eos: true });

  test('greedy output through the frontend equals the single-process server\'s; the trace shows the worker and its phases', async () => {
    for (const prompt of [freshPrompt(), freshPrompt(10)]) {
      const expected = await complete(reference.url, greedy(prompt));
      const traceId = '4bf92f3577b34da6a3ce929d0e0e4736';
      const viaCluster = await complete(a.url, greedy(prompt), { traceparent: `00-${traceId}-00f067aa0ba902b7-01` });
      assert.equal(viaCluster.text, expected.text);
      const streamed = await stream(b.url, greedy(prompt));
      assert.equal(streamed.text, expected.text);
      const { workerId, text } = await placement(a.url, viaCluster.id);
      assert.match(workerId, /^w[12]$/);
      // The traceparent went to the worker process and came back with its outputs: same trace.
      const trace = JSON.parse(text) as { engine_traceparent: string | null };
      assert.equal(trace.engine_traceparent?.split('-')[1], traceId);
      for (const phase of ['router_lookup', 'prefill_execution', 'decode_execution']) assert.ok(text.includes(phase), `trace has ${phase}`);
    }
  });

  test('echo with logprobs through the frontend: the prompt\'s logprobs as the single-process server gives them', async () => {
    const body = { prompt: freshPrompt(12), max_tokens: 2, temperature: 0, echo: true, logprobs: 2 };
    const logprobs = async (url: string) => {
      const res = await fetch(`${url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
      const json = await res.json() as { choices: { logprobs: { tokens: string[]; token_logprobs: (number | null)[] } }[] };
      assert.equal(res.status, 200, JSON.stringify(json));
      return json.choices[0]!.logprobs;
    };
    const expected = await logprobs(reference.url);
    const viaCluster = await logprobs(a.url);
    assert.equal(viaCluster.token_logprobs[0], null);
    assert.ok(viaCluster.tokens.length > 12, 'the prompt\'s tokens, then the completion\'s');
    assert.deepEqual(viaCluster, expected);
  });

  test('a second frontend routes to the worker holding the prefix the first one\'s request left (KV events fan out)', async () => {
    for (let i = 0; i < 2; i++) {
      const prompt = freshPrompt(120);
      const first = await complete(a.url, greedy(prompt, 4));
      const holder = (await placement(a.url, first.id)).workerId;
      // The stored events reach the other frontend over NATS within a moment.
      await new Promise((resolve) => setTimeout(resolve, 300));
      const second = await complete(b.url, greedy(`${prompt} more`, 4));
      const seen = await placement(b.url, second.id);
      assert.equal(seen.workerId, holder);
      assert.ok(seen.overlapBlocks >= 3, `frontend b saw ${seen.overlapBlocks} cached blocks on ${holder}`);
    }
  });

  test('kill -9 of a worker mid-stream: migration limit 2 continues with the same greedy text, limit 0 ends with worker_lost', async () => {
    const prompt = freshPrompt();
    const expected = await complete(reference.url, greedy(prompt, 400));
    const killed = await pinnedWorker(a.url, prompt);
    const migrated = await stream(a.url, greedy(prompt, 400), (_text, events) => {
      if (events === 3) workers.get(killed)!.kill('SIGKILL');
    });
    assert.equal(migrated.error, undefined, `no error: ${JSON.stringify(migrated.error)}`);
    assert.equal(migrated.text, expected.text);
    assert.equal(migrated.finish, 'length');
    const moved = JSON.parse((await placement(a.url, migrated.id)).text) as { migrations: { from_worker: string }[] };
    assert.deepEqual(moved.migrations.map((m) => m.from_worker), [killed], 'the stream moved off the killed worker');
    await until('the killed worker left both frontends', async () =>
      !(await readyWorkers(a)).includes(killed) && !(await readyWorkers(b)).includes(killed), 10_000);
    // Back to two workers: the replacement is a new process (a late worker joining).
    const replacement = `${killed}x`;
    startWorker(replacement);
    await until('the replacement joined both frontends', async () =>
      (await readyWorkers(a)).includes(replacement) && (await readyWorkers(b)).includes(replacement), 90_000);

    const lostPrompt = freshPrompt();
    const victim = await pinnedWorker(b.url, lostPrompt);
    const failed = await stream(b.url, greedy(lostPrompt, 400), (_text, events) => {
      if (events === 3) workers.get(victim)!.kill('SIGKILL');
    });
    assert.equal(failed.error?.code, 'worker_lost', JSON.stringify(failed));
    assert.equal((await placement(b.url, failed.id)).workerId, victim, 'the failed stream ran on the killed worker');
    const survivor = (await readyWorkers(b)).find((id) => id !== victim);
    assert.ok(survivor);
    await until('the victim left frontend b', async () => !(await readyWorkers(b)).includes(victim), 10_000);
    startWorker(`${victim}x`);
    await until('two workers again', async () => (await readyWorkers(a)).length === 2 && (await readyWorkers(b)).length === 2, 90_000);
  });

  test('a late worker joins and takes traffic', async () => {
    startWorker('late');
    await until('the late worker joined', async () => (await readyWorkers(a)).includes('late'), 90_000);
    const results = await Promise.all(Array.from({ length: 6 }, () => complete(a.url, greedy(freshPrompt(), 30))));
    const placed = await Promise.all(results.map((r) => placement(a.url, r.id)));
    assert.ok(placed.some((p) => p.workerId === 'late'), `placements: ${placed.map((p) => p.workerId).join()}`);
  });

  test('SIGTERM drains a worker: it leaves discovery first, finishes its stream, then exits 0', async () => {
    const prompt = freshPrompt();
    const expected = await complete(reference.url, greedy(prompt, 600));
    const drained = await pinnedWorker(a.url, prompt);
    const result = await stream(a.url, greedy(prompt, 600), async (_text, events) => {
      if (events !== 1) return;
      workers.get(drained)!.kill('SIGTERM');
      await until('the draining worker takes no new requests', async () => !(await readyWorkers(a)).includes(drained), 5000);
      const meanwhile = await complete(a.url, greedy(freshPrompt(), 3));
      assert.notEqual((await placement(a.url, meanwhile.id)).workerId, drained);
    });
    assert.equal(result.error, undefined);
    assert.equal(result.text, expected.text);
    // The stream ran on the drained worker from start to end: its trace names it, and it never moved.
    const ran = JSON.parse((await placement(a.url, result.id)).text) as { worker: string; migrations: unknown[] };
    assert.equal(ran.worker, drained, 'the stream ran on the drained worker');
    assert.deepEqual(ran.migrations, [], 'the stream did not move off the draining worker');
    assert.equal(await workers.get(drained)!.exited, 0);
    assert.match(workers.get(drained)!.output(), /deregistered; draining 1 request/);
  });

  test('etcd, NATS and a frontend restart without the workers restarting', async () => {
    const before = (await readyWorkers(a)).join();
    const pids = [...workers.values()].filter((p) => p.child.exitCode === null && p.child.signalCode === null).map((p) => p.child.pid);
    await etcd.restart();
    await complete(a.url, greedy(freshPrompt(), 5));
    await until('the frontends see the same workers after the etcd restart', async () => (await readyWorkers(a)).join() === before
      && (await readyWorkers(b)).join() === before, 20_000);
    await nats.restart();
    // After NATS is back, KV awareness is back: frontend b routes to the prefix frontend a left.
    await until('KV events flow again', async () => {
      const prompt = freshPrompt(120);
      const first = await complete(a.url, greedy(prompt, 2));
      const holder = (await placement(a.url, first.id)).workerId;
      await new Promise((resolve) => setTimeout(resolve, 300));
      const second = await complete(b.url, greedy(prompt, 2));
      const seen = await placement(b.url, second.id);
      return seen.workerId === holder && seen.overlapBlocks > 0;
    }, 20_000);
    // A frontend restarted finds the workers and their cached prefixes (snapshot resync).
    const prompt = freshPrompt(120);
    const first = await complete(a.url, greedy(prompt, 2));
    const holder = (await placement(a.url, first.id)).workerId;
    b.proc.kill('SIGKILL');
    await b.proc.exited;
    // At debug level it logs each worker's KV view resynced from its snapshot.
    b = await startFrontend(0, b.port, ['--log-level', 'debug']);
    await until('the restarted frontend sees the workers', async () => (await readyWorkers(b)).join() === before, 20_000);
    // A worker is ready in /health once it joined; its KV view arrives just after (the snapshot): wait for the
    // holder's, or the request below races it.
    await until('the restarted frontend resynced its view of the holder', () => b.proc.output().includes(`KV view of ${holder} resynced`), 20_000);
    const second = await complete(b.url, greedy(prompt, 2));
    const seen = await placement(b.url, second.id);
    assert.equal(seen.workerId, holder);
    assert.ok(seen.overlapBlocks > 0);
    const pidsAfter = [...workers.values()].filter((p) => p.child.exitCode === null && p.child.signalCode === null).map((p) => p.child.pid);
    assert.deepEqual(pidsAfter, pids, 'no worker restarted');
  });
});
