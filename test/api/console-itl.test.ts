// The console's time-between-tokens chart counts the gaps /metrics and the SLO report count (RequestTrace.tbtMs),
// not the gaps between any two writes of a stream: an n > 1 stream interleaves its completions' writes, and the
// gaps between them belong to no completion.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { parseExposition, total } from '../telemetry/exposition.ts';

const E2E = { timeout: 90_000 };

interface Series { itl_p50_ms: (number | null)[]; itl_p99_ms: (number | null)[] }

describe('console time between tokens (one simulated worker)', () => {
  let server: TestServer;

  before(async () => {
    server = await startTestServer({ flags: ['--engine', 'sim', '--sim-speed-up', 'inf'] });
  });
  after(async () => {
    await server?.close();
  });

  async function stream(n: number): Promise<string> {
    const res = await fetch(`${server.url}/v1/chat/completions`, {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ messages: [{ role: 'user', content: 'four completions please' }], max_tokens: 12, n, stream: true, ignore_eos: true }),
    });
    assert.equal(res.status, 200);
    await res.text();
    const id = res.headers.get('x-request-id')!;
    await waitFor(() => server.running.api.telemetry.traces.get(id) !== undefined, `trace of ${id}`);
    return id;
  }

  const itl = async (): Promise<number[]> => {
    const body = await (await fetch(`${server.url}/console/api/overview`)).json() as { series: Series };
    return [...body.series.itl_p50_ms, ...body.series.itl_p99_ms].filter((v): v is number => v !== null);
  };
  const tbtCount = async (): Promise<number> =>
    total(parseExposition(await (await fetch(`${server.url}/metrics`)).text()), 'conduit_time_between_tokens_milliseconds_count');
  const sloSamples = async (): Promise<number> => {
    const body = await (await fetch(`${server.url}/v1/slo`)).json() as { models: { tbt: { samples: number } }[] };
    return body.models.reduce((sum, m) => sum + m.tbt.samples, 0);
  };

  it('leaves out the gaps between an n = 2 stream\'s interleaved writes, as /metrics and /v1/slo do', E2E, async () => {
    const id = await stream(2);
    const trace = server.running.api.telemetry.traces.get(id)!;
    assert.ok(trace.emits.contentWrites > 2, 'the completions were streamed in several writes');
    assert.deepEqual(trace.tbtMs, [], 'no completion\'s gaps: the writes interleave two completions');
    assert.equal(await tbtCount(), 0);
    assert.equal(await sloSamples(), 0);
    assert.deepEqual(await itl(), [], 'nothing in the console chart either');
  });

  it('charts a one-completion stream\'s gaps, those /metrics counts', E2E, async () => {
    const id = await stream(1);
    const trace = server.running.api.telemetry.traces.get(id)!;
    assert.equal(trace.tbtMs.length, 11);
    assert.equal(await tbtCount(), 11);
    const charted = await itl();
    assert.ok(charted.length > 0, 'the gaps are charted');
    const least = Math.min(...trace.tbtMs);
    const most = Math.max(...trace.tbtMs);
    for (const v of charted) assert.ok(v >= least - 0.001 && v <= most + 0.001, `${v} ms is one of the request's gaps (${least} to ${most} ms)`);
  });
});
