// The sampling rules that depend on the server's wiring, on a live server (the simulated engine): the new-model rate
// applies to the model the server attached, and a request slow only between tokens is kept by the tail.
// Every rule of TraceSampler itself is tested in sampling.test.ts.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { rawRequest } from '../api/http-client.ts';
import { moved, scrape, startLiveServer, type LiveServer } from './integration-fixture.ts';

const LIVE = { timeout: 60_000 };

async function complete(server: LiveServer, stream: boolean): Promise<string> {
  const model = server.api.gateway.servedModelName!;
  const res = await rawRequest(server.url, {
    path: '/v1/completions', body: { model, prompt: 'a short prompt', max_tokens: 4, ignore_eos: true, temperature: 0, stream },
  });
  assert.equal(res.status, 200, res.text);
  return res.headers['x-request-id'] as string;
}

describe('sampling on a live server: the model just attached is sampled at the new-model rate', () => {
  let server: LiveServer;
  before(async () => {
    server = await startLiveServer({ sim: true, simSpeedUp: 1, telemetry: { sampling: { baseRate: 0, newModelRate: 1 } } });
  });
  after(async () => {
    await server?.close();
  });

  it('keeps its requests with reason new_model', LIVE, async () => {
    const id = await complete(server, false);
    const res = await rawRequest(server.url, { path: `/v1/requests/${id}/trace` });
    assert.equal((res.json() as { sampling: string }).sampling, 'new_model');
    assert.ok(server.exporter.getFinishedSpans().some((s) => s.name === 'request'), 'its spans were exported');
  });
});

describe('sampling on a live server: a request slow only between tokens', () => {
  let server: LiveServer;
  before(async () => {
    // Nothing sampled at the head, no TTFT, end-to-end or quantile rule within reach: only a token gap can keep it.
    server = await startLiveServer({
      sim: true, simSpeedUp: 1,
      telemetry: { sampling: { baseRate: 0, newModelRate: 0, slowTtftMs: 1e9, slowE2eMs: 1e9, quantileMinSamples: 1e9, slowTbtMs: 0.001 } },
    });
  });
  after(async () => {
    await server?.close();
  });

  it('is kept with reason slow_tbt', LIVE, async () => {
    const before = (await scrape(server.url)).exposition;
    await complete(server, true);
    const after = (await scrape(server.url)).exposition;
    assert.equal(moved(before, after, 'conduit_trace_sampling_decisions_total', { kept: 'true', reason: 'slow_tbt' }), 1);
  });
});
