// The attribution invariant (test/telemetry/attribution-check.ts) across processes: `conduit frontend` and
// `conduit worker` processes over real etcd and NATS, each worker's engine clock set seconds away from the
// frontend's (CONDUIT_CLOCK_SKEW_MS, as if it ran on another machine). A worker's stamps reach the frontend's trace
// on the frontend's clock (src/cluster/clock-offset.ts), so gateway + routing + queue + prefill = TTFT, TTFT + decode
// = total, and the phases tile every request, including short requests that reach the worker while it runs a long
// prefill step (their wait there is queue time) and disaggregated requests whose prefill and decode workers' clocks
// disagree with each other too.
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, it } from 'node:test';
import { ensureBuiltinModel } from '../../src/model/synthetic.ts';
import { rawRequest } from '../api/http-client.ts';
import {
  freePort, removeDir, servicesMissing, startConduit, startEtcd, startNats, stopAll, tempDir, waitForPort, type Proc,
} from '../helpers/cluster-services.ts';
import { assertAttributed, type TraceBody } from '../telemetry/attribution-check.ts';
import { parseExposition, value } from '../telemetry/exposition.ts';

const skip = servicesMissing();
const TOKEN = 'attribution-cluster-token';
/** A hang guard, not a speed requirement. */
const LIVE = { timeout: 240_000 };

async function until(what: string, condition: () => Promise<boolean>, maxMs = 60_000): Promise<void> {
  const deadline = Date.now() + maxMs;
  while (!(await condition())) {
    if (Date.now() > deadline) assert.fail(`timed out after ${maxMs} ms waiting until ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

async function traceOf(url: string, id: string): Promise<TraceBody> {
  let res = await rawRequest(url, { path: `/v1/requests/${encodeURIComponent(id)}/trace` });
  // The trace is stored when the response's last byte is out; the client may read it a moment before.
  for (let i = 0; i < 100 && res.status === 404; i++) {
    await new Promise((resolve) => setTimeout(resolve, 20));
    res = await rawRequest(url, { path: `/v1/requests/${encodeURIComponent(id)}/trace` });
  }
  assert.equal(res.status, 200, `trace of ${id}: ${res.text}`);
  return res.json() as TraceBody;
}

const words = (n: number) => `Request ${randomUUID()}: ${'the lighthouse keeper counted ships '.repeat(n)}`;

/** One long prompt, then `shorts` short ones 50 ms later, while the long one's prefill runs; every trace. */
async function longThenShort(url: string, longWords: number, shorts: number, stream: boolean): Promise<TraceBody[]> {
  const post = (prompt: string, maxTokens: number) => rawRequest(url, {
    path: '/v1/completions', body: { prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true, stream },
  });
  const long = post(words(longWords), 2);
  await new Promise((resolve) => setTimeout(resolve, 50));
  const results = await Promise.all([long, ...Array.from({ length: shorts }, () => post(words(2), 4))]);
  const ids = results.map((r) => {
    assert.equal(r.status, 200, r.text);
    return r.headers['x-request-id'] as string;
  });
  return Promise.all(ids.map((id) => traceOf(url, id)));
}

const absolute = (trace: TraceBody, offsetMs: number) => (trace as unknown as { arrival_unix_ms: number }).arrival_unix_ms + offsetMs;

interface Cluster {
  url: string;
  procs: Map<string, Proc>;
  dir: string;
}

/** etcd, NATS, the given workers (each with its clock skew) and one frontend, ready to serve. */
async function startCluster(name: string, workers: { id: string; skewMs: number; role?: 'prefill' | 'decode' }[], frontendFlags: string[] = []): Promise<Cluster> {
  const dir = tempDir(name);
  const modelPath = await ensureBuiltinModel();
  const [etcd, nats] = await Promise.all([startEtcd(dir), startNats()]);
  const env = { CONDUIT_ETCD_ENDPOINTS: etcd.url, CONDUIT_NATS_SERVER: nats.url, CONDUIT_CLUSTER_TOKEN: TOKEN, CONDUIT_LOG_LEVEL: 'info' };
  const procs = new Map<string, Proc>();
  for (const w of workers) {
    procs.set(w.id, startConduit(['worker', '--model', modelPath, '--worker-id', w.id, '--threads', '1', '--kv-cache-memory', '32MiB',
      '--lease-ttl', '3', ...(w.role ? ['--role', w.role] : [])], { ...env, CONDUIT_CLOCK_SKEW_MS: String(w.skewMs) }));
  }
  const port = await freePort();
  procs.set('frontend', startConduit(['frontend', '--port', String(port), '--no-request-log', ...frontendFlags], env));
  const url = `http://127.0.0.1:${port}`;
  try {
    await waitForPort(port);
    await until('the frontend serves every worker', async () => {
      const health = await fetch(`${url}/health`).then((r) => r.text(), () => '');
      return health.includes('"ready":true') && workers.every((w) => health.includes(`"${w.id}"`));
    });
  } catch (error) {
    console.error([...procs].map(([id, p]) => `--- ${id}\n${p.output()}`).join('\n'));
    throw error;
  }
  return { url, procs, dir };
}

describe('attribution across processes: a worker whose clock is 7 s ahead of the frontend\'s', { skip }, () => {
  let cluster: Cluster | undefined;
  before(async () => {
    cluster = await startCluster('attribution-remote', [{ id: 'w1', skewMs: 7000 }]);
  });
  after(async () => {
    await stopAll();
    removeDir(cluster?.dir);
  });

  it('short requests arriving during a long prefill step: queue time from their arrival, every ms attributed', LIVE, async () => {
    for (const stream of [false, true]) {
      // A short request must reach the worker while the long step runs; a few tries at most on a loaded machine.
      let during = 0;
      for (let attempt = 0; attempt < 6 && during === 0; attempt++) {
        const traces = await longThenShort(cluster!.url, 220, 5, stream);
        assertAttributed(traces);
        const [long, ...shorts] = traces;
        const longStep = long!.phases.find((p) => p.phase === 'prefill_execution')!;
        const stepStart = absolute(long!, longStep.start_ms);
        const stepEnd = absolute(long!, longStep.start_ms + longStep.duration_ms);
        for (const short of shorts) {
          const queue = short.phases.find((p) => p.phase === 'scheduler_queue')!;
          const queuedAt = absolute(short, queue.start_ms);
          if (queuedAt <= stepStart || queuedAt >= stepEnd) continue;
          during++;
          assert.ok(absolute(short, queue.start_ms + queue.duration_ms) >= stepEnd - 0.01, 'it waited in the queue until the step ended');
          assert.ok((short.timings.queue_ms as number) >= stepEnd - queuedAt - 0.01, 'queue_ms holds the wait behind the step');
        }
      }
      assert.ok(during > 0, 'a short request reached the worker while the long prompt\'s step ran');
    }
  });

  it('the frontend\'s /metrics carries the worker process\'s memory by category and allocation failures', LIVE, async () => {
    const res = await rawRequest(cluster!.url, { path: '/metrics' });
    assert.equal(res.status, 200);
    const metrics = parseExposition(res.text);
    // The built-in model: 6 layers, 2 KV heads of 64; 16-token f32 blocks of K and V; --kv-cache-memory 32MiB.
    const blockBytes = 2 * 6 * 16 * 2 * 64 * 4;
    assert.equal(value(metrics, 'conduit_memory_used_bytes', { worker: 'w1', category: 'kv_cache' }), Math.floor(32 * 1024 * 1024 / blockBytes) * blockBytes);
    assert.ok((value(metrics, 'conduit_memory_used_bytes', { worker: 'w1', category: 'weights' }) ?? 0) > 0);
    assert.ok((value(metrics, 'conduit_memory_used_bytes', { worker: 'w1', category: 'activations' }) ?? 0) > 0);
    assert.equal(value(metrics, 'conduit_oom_events_total', { worker: 'w1', kind: 'scratch' }), 0);
  });
});

describe('attribution across processes: disaggregated, the prefill worker 7 s ahead and the decode worker 3 s behind', { skip }, () => {
  let cluster: Cluster | undefined;
  before(async () => {
    cluster = await startCluster('attribution-remote-disagg',
      [{ id: 'p1', skewMs: 7000, role: 'prefill' }, { id: 'd1', skewMs: -3000, role: 'decode' }], ['--disagg-min-remote-prefill-tokens', '16']);
  });
  after(async () => {
    await stopAll();
    removeDir(cluster?.dir);
  });

  it('prefilled on one worker, decoded on the other: every ms attributed, the hand-over after the first token', LIVE, async () => {
    for (const stream of [false, true]) {
      const traces = await longThenShort(cluster!.url, 40, 3, stream);
      assertAttributed(traces);
      const moved = traces.filter((trace) => trace.phases.some((p) => p.phase === 'kv_transfer'));
      assert.ok(moved.length > 0, 'prompts were prefilled on the prefill worker and their KV moved');
      for (const trace of moved) {
        const prefill = trace.phases.filter((p) => p.phase === 'prefill_execution');
        assert.ok(prefill.length > 0 && prefill.every((p) => p.start_ms >= 0), `${trace.request_id}: prefill within the request`);
        const kv = trace.phases.find((p) => p.phase === 'kv_transfer')!;
        const firstTokenAt = prefill.at(-1)!.start_ms + prefill.at(-1)!.duration_ms;
        assert.ok(kv.start_ms >= firstTokenAt - 0.01, `the transfer (${kv.start_ms}) comes after the first token (${firstTokenAt})`);
        assert.ok(kv.start_ms + kv.duration_ms <= Number(trace.timings.total_ms) + 0.01, 'and before the end');
      }
    }
  });
});
