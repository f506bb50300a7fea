// The simulated engine at speed-up inf keeps its own clock (it moves with the simulated steps only), yet the times
// served as wall-clock Unix milliseconds must be dates of now: a trace's arrival_unix_ms, the console overview's
// generated_at_ms, its SLO report's and its chart buckets' times (the chart's axis shows them as dates). The console's
// finding, reused for 5 s, must not outlive 5 real seconds on a clock that stands still between requests.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { ADMIN_KEY, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 90_000 };

async function chat(server: TestServer): Promise<string> {
  const res = await fetch(`${server.url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${ADMIN_KEY}` },
    body: JSON.stringify({ messages: [{ role: 'user', content: 'Tell me about the sea' }], max_tokens: 4 }),
  });
  assert.equal(res.status, 200, await res.clone().text());
  await res.text();
  const id = res.headers.get('x-request-id')!;
  await waitFor(() => server.running.api.telemetry.traces.get(id) !== undefined, `the trace of ${id}`);
  return id;
}

async function getJson<T>(server: TestServer, path: string): Promise<T> {
  const res = await fetch(`${server.url}${path}`, { headers: { Authorization: `Bearer ${ADMIN_KEY}` } });
  assert.equal(res.status, 200, path);
  return await res.json() as T;
}

interface Overview {
  generated_at_ms: number;
  series: { t: number[] };
  slo: { generated_at_ms: number };
  analysis: { requests: number };
}

describe('conduit serve --engine sim --sim-speed-up inf: wall-clock fields are Unix times of now', () => {
  let server: TestServer;
  let startedAtMs: number;

  before(async () => {
    startedAtMs = Date.now();
    server = await startTestServer({ keysFile: '', flags: ['--engine', 'sim', '--sim-speed-up', 'inf'] });
  });
  after(async () => {
    await server?.close();
  });

  /** Within this test's run on the wall clock (the simulated steps add a little to it), or `earlierMs` before it. */
  const isNow = (ms: number, what: string, earlierMs = 1000): void => {
    assert.ok(ms >= startedAtMs - earlierMs && ms <= Date.now() + 60_000, `${what} ${ms} (${new Date(ms).toISOString()}) is not now`);
  };

  it('a trace\'s arrival_unix_ms, and the console overview\'s generated_at_ms and chart times', E2E, async () => {
    const id = await chat(server);
    const trace = await getJson<{ arrival_unix_ms: number; phases: { duration_ms: number }[] }>(server, `/v1/requests/${id}/trace`);
    isNow(trace.arrival_unix_ms, 'arrival_unix_ms');
    assert.ok(trace.phases.some((p) => p.duration_ms > 0), 'simulated phases take simulated time');
    const overview = await getJson<Overview>(server, '/console/api/overview');
    isNow(overview.generated_at_ms, 'generated_at_ms');
    isNow(overview.slo.generated_at_ms, 'slo.generated_at_ms');
    assert.ok(overview.series.t.length > 0);
    // The buckets of the chart's window (5 minutes) ending now.
    for (const t of overview.series.t) isNow(t * 1000, 'a chart bucket', 6 * 60_000);
    assert.ok(overview.generated_at_ms >= trace.arrival_unix_ms);
  });

  it('the console\'s finding is computed again after 5 real seconds, though the simulated clock stood still', E2E, async () => {
    const first = await getJson<Overview>(server, '/console/api/overview');
    await chat(server);
    // The simulated clock moved by this request's few simulated milliseconds only; 5 s pass on the real one.
    await new Promise((resolve) => setTimeout(resolve, 5200));
    const later = await getJson<Overview>(server, '/console/api/overview');
    assert.equal(later.analysis.requests, first.analysis.requests + 1);
  });
});
