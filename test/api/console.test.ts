// The web console's routes over HTTP (src/api/console.ts): the pages and assets, the overview and request JSON, and
// access: with keys configured the JSON needs a key, an admin key sees the cluster, a tenant's key only its own
// requests. Simulated workers (two, behind the router) keep it quick; the browser test drives real ones.

import assert from 'node:assert/strict';
import { gunzipSync } from 'node:zlib';
import { after, before, describe, it } from 'node:test';
import { ADMIN_KEY, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 90_000 };
const TENANT_A = 'sk-console-acme-01';
const TENANT_B = 'sk-console-globex1';

async function chat(server: TestServer, key: string | undefined, maxTokens = 6): Promise<string> {
  const res = await fetch(`${server.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', ...(key ? { Authorization: `Bearer ${key}` } : {}) },
    body: JSON.stringify({ messages: [{ role: 'user', content: 'Tell me about the sea' }], max_tokens: maxTokens, stream: true }),
  });
  assert.equal(res.status, 200);
  await res.text();
  return res.headers.get('x-request-id')!;
}

async function get(server: TestServer, path: string, key?: string, headers: Record<string, string> = {}): Promise<Response> {
  return fetch(`${server.url}${path}`, { headers: { ...headers, ...(key ? { Authorization: `Bearer ${key}` } : {}) } });
}

interface Overview {
  scope: string;
  tenant: string;
  requests: { id: string; tenant: string | null; output_tokens: number; bottleneck: string | null; outcome: string }[];
  workers?: { id: string; role: string; kv_total_blocks: number; recent_batch_sizes: number[]; memory_bytes?: Record<string, number> }[];
  series?: { t: number[]; output_tokens_per_s: number[]; ttft_p50_ms: (number | null)[] };
  slo?: { models: { model: string }[] };
  analysis?: { requests: number };
  health?: { status: string };
}

describe('web console routes (two simulated workers, keys configured)', () => {
  let server: TestServer;
  let idA: string;
  let idB: string;

  before(async () => {
    server = await startTestServer({
      keysFile: `${TENANT_A} acme\n${TENANT_B} globex\n`,
      flags: ['--engine', 'sim', '--sim-speed-up', 'inf', '--workers', '2'],
    });
    idA = await chat(server, TENANT_A, 8);
    idB = await chat(server, TENANT_B, 5);
    const store = server.running.api.telemetry.traces;
    await waitFor(() => store.get(idA) !== undefined && store.get(idB) !== undefined, 'both traces');
  });
  after(async () => {
    await server?.close();
  });

  it('serves the page shell and its assets without a key: they hold no data; nothing else under /console/assets', E2E, async () => {
    for (const path of ['/console', '/console/', `/console/requests/${idA}`]) {
      const res = await get(server, path);
      assert.equal(res.status, 200, path);
      assert.match(res.headers.get('content-type')!, /^text\/html/);
      assert.match(res.headers.get('content-security-policy')!, /default-src 'self'/);
      assert.match(await res.text(), /<script type="module" src="\/console\/assets\/console\.js">/);
    }
    for (const name of ['console.js', 'console.css', 'waterfall-layout.js', 'uPlot.iife.min.js', 'uPlot.min.css']) {
      const res = await get(server, `/console/assets/${name}`);
      assert.equal(res.status, 200, name);
      assert.ok((await res.arrayBuffer()).byteLength > 100, name);
    }
    for (const name of ['index.d.ts', 'waterfall-layout.d.ts', '..%2Fpackage.json', 'package.json']) {
      assert.equal((await get(server, `/console/assets/${name}`)).status, 404, name);
    }
  });

  it('sends assets gzip-compressed when the browser accepts it, and says how much a page weighs', E2E, async () => {
    const res = await fetch(`${server.url}/console/assets/console.js`, { headers: { 'Accept-Encoding': 'gzip' } });
    assert.equal(res.headers.get('content-encoding'), 'gzip');
    const weight = server.running.api.webConsole.pageWeight();
    assert.ok(weight.gzipBytes < weight.bytes);
    // fetch decodes it; the raw file is what a client without gzip gets.
    const plain = await (await get(server, '/console/assets/console.js')).text();
    assert.equal(await res.text(), plain);
    assert.equal(gunzipSync(server.running.api.webConsole.asset('console.js')!.gzip).toString(), plain);
    // Loaded again, an unchanged file is a 304 with no body.
    const etag = res.headers.get('etag')!;
    assert.match(etag, /^"[\w-]+"$/);
    const again = await get(server, '/console/assets/console.js', undefined, { 'If-None-Match': etag });
    assert.equal(again.status, 304);
    assert.equal((await again.arrayBuffer()).byteLength, 0);
    assert.equal((await get(server, '/console/assets/console.js', undefined, { 'If-None-Match': '"other"' })).status, 200);
    // Weak validators, lists and `*` name it too (RFC 9110's weak comparison).
    for (const header of [`W/${etag}`, `"other", ${etag}`, '*']) {
      assert.equal((await get(server, '/console/assets/console.js', undefined, { 'If-None-Match': header, 'Accept-Encoding': 'gzip' })).status, 304, header);
    }
    // The identity bytes have a validator of their own, and a client that refuses gzip (q=0) gets them.
    const refused = await get(server, '/console/assets/console.js', undefined, { 'Accept-Encoding': 'gzip;q=0, identity' });
    assert.equal(refused.headers.get('content-encoding'), null);
    assert.notEqual(refused.headers.get('etag'), etag);
    assert.equal(await refused.text(), plain);
    assert.equal((await get(server, '/console/assets/console.js', undefined, { 'If-None-Match': etag, 'Accept-Encoding': 'identity' })).status, 200);
  });

  it('sends the page\'s Content-Security-Policy with the shell under its asset URL too (no framing by another site)', E2E, async () => {
    const res = await get(server, '/console/assets/index.html');
    assert.equal(res.status, 200);
    assert.match(res.headers.get('content-security-policy')!, /frame-ancestors 'none'/);
  });

  it('answers HEAD as GET without a body; a method a route lacks is a 405 counted under that route', E2E, async () => {
    for (const path of ['/console', '/console/assets/console.js', '/health', '/v1/models']) {
      const res = await fetch(`${server.url}${path}`, { method: 'HEAD', headers: { Authorization: `Bearer ${ADMIN_KEY}` } });
      const full = await get(server, path, ADMIN_KEY);
      assert.equal(res.status, full.status, path);
      assert.equal(res.headers.get('content-type'), full.headers.get('content-type'), path);
      assert.equal((await res.arrayBuffer()).byteLength, 0, path);
    }
    const refused = await fetch(`${server.url}/console`, { method: 'DELETE' });
    assert.equal(refused.status, 405);
    assert.equal(refused.headers.get('allow'), 'GET, HEAD');
    const metrics = await (await get(server, '/metrics', ADMIN_KEY)).text();
    assert.match(metrics, /conduit_http_responses_total\{[^}]*route="console"[^}]*status="405"[^}]*\} [1-9]/);
  });

  it('refuses the JSON without a key (401), like the traces', E2E, async () => {
    assert.equal((await get(server, '/console/api/overview')).status, 401);
    assert.equal((await get(server, `/console/api/requests/${idA}`)).status, 401);
  });

  it('shows an admin the cluster: both workers, the charts, SLO, analysis and every tenant\'s requests', E2E, async () => {
    const res = await get(server, '/console/api/overview', ADMIN_KEY);
    assert.equal(res.status, 200);
    const body = await res.json() as Overview;
    assert.equal(body.scope, 'all');
    const engine = server.engine as unknown as { workerStats(): { workerId: string }[] };
    assert.deepEqual(body.workers!.map((w) => w.id).sort(), engine.workerStats().map((w) => w.workerId).sort());
    assert.equal(body.workers!.length, 2);
    assert.ok(body.workers!.every((w) => w.kv_total_blocks > 0 && w.role === 'worker'));
    assert.ok(body.workers!.some((w) => w.recent_batch_sizes.length > 0), 'a worker that decoded shows its batches');
    // Simulated workers show their modelled GPU memory: weights and KV pool, no activations figure.
    for (const w of body.workers!) {
      assert.deepEqual(Object.keys(w.memory_bytes ?? {}), ['weights', 'lora_adapters', 'kv_cache'], JSON.stringify(w.memory_bytes));
      assert.ok(w.memory_bytes!.weights! > 0 && w.memory_bytes!.kv_cache! > 0);
    }
    assert.deepEqual(body.requests.map((r) => r.id).sort(), [idA, idB].sort());
    const a = body.requests.find((r) => r.id === idA)!;
    assert.equal(a.tenant, 'acme');
    assert.equal(a.output_tokens, 8);
    assert.equal(a.outcome, 'ok');
    assert.equal(typeof a.bottleneck, 'string');
    assert.equal(body.health!.status, 'ready');
    assert.equal(body.slo!.models.length, 1);
    assert.equal(body.analysis!.requests, 2);
    const tokens = body.series!.output_tokens_per_s.reduce((s, v) => s + v, 0) * 2; // 2 s buckets
    assert.ok(Math.abs(tokens - 13) < 1e-6, `13 tokens written in the window, got ${tokens}`);
    assert.equal(body.series!.ttft_p50_ms.filter((v) => v !== null).length >= 1, true);
  });

  it('shows a tenant only its own requests, and nothing server-wide', E2E, async () => {
    const body = await (await get(server, '/console/api/overview', TENANT_A)).json() as Overview;
    assert.equal(body.scope, 'tenant');
    assert.equal(body.tenant, 'acme');
    assert.deepEqual(body.requests.map((r) => r.id), [idA]);
    assert.equal(body.workers, undefined);
    assert.equal(body.series, undefined);
    assert.equal(body.slo, undefined);
    assert.equal(body.analysis, undefined);
  });

  it('gives a request\'s waterfall data to its tenant and the admin, and a 404 to another tenant', E2E, async () => {
    assert.equal((await get(server, `/console/api/requests/${idA}`, TENANT_B)).status, 404);
    assert.equal((await get(server, '/console/api/requests/chatcmpl-nope', ADMIN_KEY)).status, 404);
    for (const key of [TENANT_A, ADMIN_KEY]) {
      const res = await get(server, `/console/api/requests/${idA}`, key);
      assert.equal(res.status, 200);
      const view = await res.json() as {
        request_id: string; total_ms: number; phases: { phase: string; start_ms: number; duration_ms: number }[];
        routing: { worker: string; strategy: string; candidates: number | null } | null; token_times_ms: number[];
        analysis: { category: string; recommendation: string }; usage: { completion_tokens: number };
      };
      assert.equal(view.request_id, idA);
      assert.equal(view.token_times_ms.length, 8, 'one write time per token');
      assert.ok(view.token_times_ms.every((t, i) => i === 0 || t >= view.token_times_ms[i - 1]!));
      assert.ok(view.routing && view.routing.worker.length > 0 && view.routing.strategy.length > 0);
      const names = new Set(view.phases.map((p) => p.phase));
      for (const name of ['http_receive', 'router_lookup', 'scheduler_queue', 'prefill_execution', 'decode_execution', 'streaming_response']) {
        assert.ok(names.has(name), `phase ${name} in ${[...names].join(', ')}`);
      }
      assert.ok(view.analysis.recommendation.length > 0);
    }
  });
});
