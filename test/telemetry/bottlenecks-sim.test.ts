// Each TTFT bottleneck the analyzer names, constructed on the simulated engine (one worker at --sim-speed-up inf,
// so the timings depend only on the requests) and read from the trace view a user gets
// (GET /v1/requests/{id}/trace, its `analysis`): a long prompt alone is prefill_no_cache; the same prompt's first
// half followed by new tokens is prefill_compute_bound (the cache hit did not make it cheap); requests queued behind
// a running request (--max-num-seqs 1) are queue_saturation; a streamed decode that shared a step with a long
// prompt's prefill is decode_latency_spike. decode_batch_bound and decode_preempted are constructed in
// decode-bottleneck.test.ts. kv_transfer_bound by TTFT is not constructed here: Conduit's prefill worker streams the
// first token, so a KV transfer never counts towards TTFT on the engine as it runs (the analyzer's tests construct
// it); transfer-gap.test.ts constructs the transfer after the first token that is the request's spike.
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { rawRequest } from '../api/http-client.ts';
import { forEachStreamEvent } from '../helpers/sse-stream.ts';
import { startLiveServer, type LiveServer } from './integration-fixture.ts';

const LIVE = { timeout: 180_000 };

interface Analysis { category: string; dominant_phase: string; recommendation: string }

/** Token ids 1000.. for a prompt: `offset` makes one that shares nothing with another. */
const tokens = (n: number, offset = 0) => Array.from({ length: n }, (_, i) => 1000 + ((i + offset) % 30_000));

async function analysisOf(server: LiveServer, prompts: number[][], maxTokens: number): Promise<{ analysis: Analysis; timings: Record<string, number> }[]> {
  const model = server.api.gateway.servedModelName!;
  const results = await Promise.all(prompts.map((prompt) => rawRequest(server.url, {
    path: '/v1/completions', body: { model, prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true },
  })));
  return Promise.all(results.map(async (r) => {
    assert.equal(r.status, 200, r.text);
    const trace = await rawRequest(server.url, { path: `/v1/requests/${r.headers['x-request-id'] as string}/trace` });
    assert.equal(trace.status, 200, trace.text);
    return trace.json() as { analysis: Analysis; timings: Record<string, number> };
  }));
}

describe('TTFT bottlenecks constructed on the simulated engine (one worker, speed-up inf)', () => {
  let server: LiveServer;
  before(async () => {
    server = await startLiveServer({ sim: true, simSpeedUp: Infinity, maxNumSeqs: 1 });
  });
  after(async () => {
    await server?.close();
  });

  it('a long prompt alone, nothing cached: prefill_no_cache', LIVE, async () => {
    const [only] = await analysisOf(server, [tokens(6000, 7)], 2);
    assert.equal(only!.analysis.category, 'prefill_no_cache', only!.analysis.recommendation);
    assert.equal(only!.analysis.dominant_phase, 'prefill_execution');
  });

  it('half the prompt cached and the other half still long: prefill_compute_bound', LIVE, async () => {
    const first = tokens(6000, 10_000);
    await analysisOf(server, [first], 1);
    const [second] = await analysisOf(server, [[...first.slice(0, 3000), ...tokens(3000, 20_000)]], 2);
    assert.ok(second!.timings.cached_tokens! >= 2900, `the shared half came from the cache: ${JSON.stringify(second!.timings)}`);
    assert.equal(second!.analysis.category, 'prefill_compute_bound', second!.analysis.recommendation);
  });

  it('requests queued behind a running one (one sequence at a time): queue_saturation', LIVE, async () => {
    const [running, ...queued] = await analysisOf(server, [tokens(16, 25_000), tokens(16, 26_000), tokens(16, 27_000)], 64);
    assert.notEqual(running!.analysis.category, 'queue_saturation');
    for (const q of queued) {
      assert.ok(q.timings.queue_ms! > 0.6 * q.timings.ttft_ms!, JSON.stringify(q.timings));
      assert.equal(q.analysis.category, 'queue_saturation', q.analysis.recommendation);
      assert.equal(q.analysis.dominant_phase, 'scheduler_queue');
      assert.match(q.analysis.recommendation, /saturated/);
    }
  });
});

describe('a decode latency spike constructed on the simulated engine (one worker, speed-up inf)', () => {
  let server: LiveServer;
  before(async () => {
    server = await startLiveServer({ sim: true, simSpeedUp: Infinity });
  });
  after(async () => {
    await server?.close();
  });

  it('a streamed decode that shared a step with a 6000-token prefill: decode_latency_spike', LIVE, async () => {
    const model = server.api.gateway.servedModelName!;
    // Once the stream's first token is out a long prompt follows; the gateway holds the simulated clock while it
    // takes it in, so it joins one of the stream's next steps. A few tries at most, in case the stream ran to its
    // end before the long prompt reached the server.
    let spiked = false;
    for (let attempt = 0; attempt < 5 && !spiked; attempt++) {
      const res = await fetch(`${server.url}/v1/completions`, {
        method: 'POST', headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ model, prompt: tokens(16, 28_000 + 100 * attempt), max_tokens: 1500, temperature: 0, ignore_eos: true, stream: true }),
      });
      assert.equal(res.status, 200);
      const id = res.headers.get('x-request-id')!;
      let long: ReturnType<typeof rawRequest> | undefined;
      await forEachStreamEvent(res, () => {
        long ??= rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: tokens(6000, 3000 + 50 * attempt), max_tokens: 1 } });
      });
      assert.equal((await long!).status, 200);
      const trace = (await rawRequest(server.url, { path: `/v1/requests/${id}/trace` })).json() as {
        analysis: Analysis; tbt: { count: number; p50_ms: number; max_ms: number };
      };
      // The analyzer's spike: over 3x the median gap and at least 25 ms longer than it.
      if (trace.tbt.max_ms <= 3 * trace.tbt.p50_ms || trace.tbt.max_ms - trace.tbt.p50_ms < 25) continue;
      spiked = true;
      assert.equal(trace.analysis.category, 'decode_latency_spike', trace.analysis.recommendation);
      assert.equal(trace.analysis.dominant_phase, 'decode_execution');
      assert.match(trace.analysis.recommendation, /long prefill chunks sharing the batch/);
    }
    assert.ok(spiked, 'the long prefill shared a step with the stream\'s decode');
  });
});
