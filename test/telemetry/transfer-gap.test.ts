// A disaggregated request whose KV transfer is the long gap before its second token, on the simulated engine (one
// prefill and one decode worker at --sim-speed-up inf, so the times depend only on the request): the prefill worker
// streams the first token and the prompt's KV moves after it, so a slow transfer shows as one long step among steady
// decode steps. The analyzer must name the transfer there, not a decode spike whose advice (preemptions, prefill
// chunks sharing the batch, GC pauses) points away from it.
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { rawRequest } from '../api/http-client.ts';
import { startLiveServer, type LiveServer } from './integration-fixture.ts';

const LIVE = { timeout: 180_000 };

interface TraceBody {
  analysis: { category: string; dominant_phase: string; dominant_ms: number; recommendation: string };
  phases: { phase: string; start_ms: number; duration_ms: number }[];
  decode: { step_p50_ms: number; step_max_ms: number };
}

describe('a slow KV transfer after the first token (simulated disaggregated workers, speed-up inf)', () => {
  let server: LiveServer;
  before(async () => {
    server = await startLiveServer({
      sim: true, simSpeedUp: Infinity, disaggregated: { prefillWorkers: 1, decodeWorkers: 1 }, kvCacheMemoryBytes: 8 * 1024 ** 3,
    });
  });
  after(async () => {
    await server?.close();
  });

  it('is named kv_transfer_bound, with the transfer\'s time, in the trace and in /v1/analysis', LIVE, async () => {
    const model = server.api.gateway.servedModelName!;
    // 24 000 prompt tokens of Llama 3.1 8B are about 3 GiB of KV: some 80 ms on the simulated link (40 GB/s). 200
    // output tokens, so that decode takes longer than the prompt's prefill (else prefill is the bottleneck).
    const prompt = Array.from({ length: 24_000 }, (_, i) => 1000 + (i % 30_000));
    const res = await rawRequest(server.url, {
      path: '/v1/completions', body: { model, prompt, max_tokens: 200, temperature: 0, ignore_eos: true, stream: true },
    });
    assert.equal(res.status, 200, res.text.slice(0, 500));
    const id = res.headers['x-request-id'] as string;
    const trace = await rawRequest(server.url, { path: `/v1/requests/${id}/trace` });
    assert.equal(trace.status, 200, trace.text.slice(0, 500));
    const body = trace.json() as TraceBody;
    const transfer = body.phases.find((p) => p.phase === 'kv_transfer');
    assert.ok(transfer, `a transfer: ${body.phases.map((p) => p.phase).join(',')}`);
    // The setting the test needs: the transfer is the one long gap, the decode steps are short.
    assert.ok(transfer.duration_ms > 50 && body.decode.step_p50_ms < 20 && body.decode.step_max_ms >= transfer.duration_ms,
      `${JSON.stringify(transfer)} ${JSON.stringify(body.decode)}`);
    assert.equal(body.analysis.category, 'kv_transfer_bound', body.analysis.recommendation);
    assert.equal(body.analysis.dominant_phase, 'kv_transfer');
    assert.ok(Math.abs(body.analysis.dominant_ms - transfer.duration_ms) < 0.01, JSON.stringify(body.analysis));
    assert.match(body.analysis.recommendation, /after the first token/);
    assert.doesNotMatch(body.analysis.recommendation, /preemptions|GC pauses/);

    const analysis = await rawRequest(server.url, { path: '/v1/analysis' });
    assert.equal(analysis.status, 200, analysis.text);
    const window = analysis.json() as { categories: Record<string, number>; primary_bottleneck: string };
    assert.equal(window.categories.kv_transfer_bound, 1, JSON.stringify(window.categories));
    assert.equal(window.categories.decode_latency_spike, 0);
    assert.equal(window.primary_bottleneck, 'kv_transfer_bound');
  });
});
