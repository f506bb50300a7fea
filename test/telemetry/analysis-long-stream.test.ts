// The window analysis after a very long stream: a request streamed 126 000 tokens (the simulated Llama 3.1 8B's
// context allows it, and at --sim-speed-up inf it takes a second or two), so its trace holds about as many gaps
// between tokens. GET /v1/analysis and the console's overview, which reports that analysis, must still answer for
// the whole SLO window the trace stays in.
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { rawRequest } from '../api/http-client.ts';
import { startLiveServer, type LiveServer } from './integration-fixture.ts';

const LIVE = { timeout: 180_000 };
const OUTPUT_TOKENS = 126_000;

describe('the window analysis after a 126 000-token stream (simulated engine, speed-up inf)', () => {
  let server: LiveServer;
  before(async () => {
    // KV room for the whole sequence (the simulated worker models the memory; it allocates none of it).
    server = await startLiveServer({ sim: true, simSpeedUp: Infinity, kvCacheMemoryBytes: 32 * 1024 ** 3 });
  });
  after(async () => {
    await server?.close();
  });

  it('GET /v1/analysis and /console/api/overview answer 200 and count the request', LIVE, async () => {
    const model = server.api.gateway.servedModelName!;
    const stream = await rawRequest(server.url, {
      path: '/v1/completions',
      body: { model, prompt: 'Hi', max_tokens: OUTPUT_TOKENS, ignore_eos: true, stream: true },
    });
    assert.equal(stream.status, 200, stream.text.slice(0, 500));
    const id = stream.headers['x-request-id'] as string;
    const trace = await rawRequest(server.url, { path: `/v1/requests/${id}/trace` });
    assert.equal(trace.status, 200, trace.text.slice(0, 500));
    const view = trace.json() as { usage: { completion_tokens: number }; tbt: { count: number } };
    assert.equal(view.usage.completion_tokens, OUTPUT_TOKENS);
    assert.ok(view.tbt.count > 125_000, `the trace holds the stream's gaps: ${view.tbt.count}`);

    const analysis = await rawRequest(server.url, { path: '/v1/analysis' });
    assert.equal(analysis.status, 200, analysis.text.slice(0, 500));
    assert.equal((analysis.json() as { requests: number }).requests, 1);

    const overview = await rawRequest(server.url, { path: '/console/api/overview' });
    assert.equal(overview.status, 200, overview.text.slice(0, 500));
    assert.equal((overview.json() as { analysis: { requests: number } }).analysis.requests, 1);
  });
});
