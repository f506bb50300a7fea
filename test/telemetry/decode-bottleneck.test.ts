// Decode-bound slowness named as such: requests that are slow only by their time between tokens are slow, and the
// analyzer calls them decode_batch_bound (steady steps in a full batch, on the simulated engine) or
// decode_preempted (KV blocks lost mid-decode, on the real engine with a pool too small for the batch), with a
// recommendation that fits the numbers, not prefill_no_cache and prefix-cache advice for a 13-token prompt.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { hrTimeToMilliseconds } from '@opentelemetry/core';
import { rawRequest } from '../api/http-client.ts';
import { TraceAnalyzer } from '../../src/telemetry/analyzer.ts';
import type { RequestTrace } from '../../src/telemetry/trace.ts';
import { startLiveServer, type LiveServer } from './integration-fixture.ts';

/** A hang guard, not a speed requirement. */
const LIVE = { timeout: 180_000 };

async function completions(server: LiveServer, count: number, body: Record<string, unknown>): Promise<RequestTrace[]> {
  const model = server.api.gateway.servedModelName!;
  const results = await Promise.all(Array.from({ length: count }, (_, i) => rawRequest(server.url, {
    path: '/v1/completions', body: { model, prompt: `Request ${i}: tell me a story about the sea.`, temperature: 0, ignore_eos: true, ...body },
  })));
  return results.map((r) => {
    assert.equal(r.status, 200, r.text);
    const trace = server.telemetry.traces.get(r.headers['x-request-id'] as string);
    assert.ok(trace, 'the trace is stored');
    return trace;
  });
}

describe('decode-bound requests on the simulated engine (a full batch of long outputs)', () => {
  let server: LiveServer;
  before(async () => {
    server = await startLiveServer({ sim: true, simSpeedUp: 1, maxNumSeqs: 8 });
  });
  after(async () => {
    await server?.close();
  });

  it('slow only by time per token: counted slow, and named decode_batch_bound with batch advice', LIVE, async () => {
    const traces = await completions(server, 8, { max_tokens: 48 });
    // The simulated 8B model on an H100 decodes a token in a few ms; a TBT target under that makes these slow by
    // TBT alone, while their TTFT is far under its target.
    const perToken = traces.map((t) => (t.decode!.endMs - t.decode!.startMs) / t.decode!.steps);
    const tbtTarget = Math.min(...perToken) * 0.9;
    const analyzer = new TraceAnalyzer({ slowTbtMs: tbtTarget });
    for (const trace of traces) {
      assert.ok(trace.promptTokens < 32, `a short prompt (${trace.promptTokens} tokens)`);
      const d = analyzer.classify(trace);
      assert.equal(d.category, 'decode_batch_bound', d.recommendation);
      assert.equal(d.dominant_phase, 'decode_execution');
      assert.match(d.recommendation, /in batches of [\d.]+ sequences on average/);
      assert.match(d.recommendation, /--max-num-seqs/);
      assert.doesNotMatch(d.recommendation, /prefix/);
      assert.ok(d.breakdown_ms.decode > (d.ttft_ms ?? 0), 'decode dominates');
    }
    const ttftMax = Math.max(...traces.map((t) => t.ttftMs!));
    const window = analyzer.analyze(traces, { slowTtftMs: ttftMax + 1000, slowTbtMs: tbtTarget });
    assert.equal(window.slow_requests, traces.length, 'slow by time per token alone (no stream) counts as slow');
    assert.equal(window.primary_bottleneck, 'decode_batch_bound');
  });

  it('a fast decode is not decode-bound', LIVE, async () => {
    const [trace] = await completions(server, 1, { max_tokens: 8 });
    const d = new TraceAnalyzer({ slowTbtMs: 1e6 }).classify(trace!);
    assert.notEqual(d.category, 'decode_batch_bound');
  });
});

describe('decode preempted on the real engine (a KV pool too small for the batch)', () => {
  let server: LiveServer;
  before(async () => {
    server = await startLiveServer({ threads: 1, kvCacheMemoryBytes: 1024 * 1024, maxNumSeqs: 4 });
  });
  after(async () => {
    await server?.close();
  });

  it('a request that lost its KV blocks mid-decode is decode_preempted, with KV advice', LIVE, async () => {
    const analyzer = new TraceAnalyzer();
    let preempted: RequestTrace[] = [];
    // Which request loses its blocks depends on the order of steps; a few rounds at most.
    for (let round = 0; round < 3 && preempted.length === 0; round++) {
      const traces = await completions(server, 4, { max_tokens: 100, stream: true });
      preempted = traces.filter((t) => t.phases.some((p) => p.phase === 'prefill_execution' && p.attributes?.recompute === true
        && p.startMs >= t.engineFirstTokenMs!));
    }
    assert.ok(preempted.length > 0, 'some request was preempted after its first token');
    for (const trace of preempted) {
      const d = analyzer.classify(trace);
      if (d.breakdown_ms.decode <= (d.ttft_ms ?? 0)) continue; // decode did not dominate it
      assert.equal(d.category, 'decode_preempted', d.recommendation);
      assert.match(d.recommendation, /tokens were recomputed/);
      assert.match(d.recommendation, /--kv-cache-memory/);
    }
  });
});

describe('chunks after the first token that are no recompute (the real engine, a pool with room)', () => {
  let server: LiveServer;
  before(async () => {
    // Jump-forward on: the guided request's forced text is computed in chunks after its first token.
    server = await startLiveServer({ threads: 1, maxNumSeqs: 8, guidedJumpForward: true, telemetry: { sampling: { baseRate: 1 } } });
  });
  after(async () => {
    await server?.close();
  });

  it('n > 1 and forced (jump-forward) text are not decode_preempted, the prefill phase ends at the first token, and an n > 1 stream\'s writes are not its steps', LIVE, async () => {
    const preemptionsBefore = server.api.gateway.engine!.stats().preemptions;
    const traces = [
      ...await completions(server, 1, { max_tokens: 24, n: 3, temperature: 1, seed: 1, stream: true }),
      ...await completions(server, 1, {
        max_tokens: 60, response_format: { type: 'json_schema', json_schema: { name: 'p', schema: { type: 'object', properties: { name: { type: 'string', maxLength: 8 }, age: { type: 'integer' } }, required: ['name', 'age'] } } },
      }),
    ];
    assert.equal(server.api.gateway.engine!.stats().preemptions, preemptionsBefore, 'nothing was preempted');
    // The n = 3 stream: a step writes one chunk per completion, so its writes are no steps, and the gaps between
    // them no completion's time between tokens.
    const forked = traces[0]!;
    assert.notEqual(forked.decode!.source, 'stream');
    assert.ok(forked.decode!.steps <= 24, `${forked.decode!.steps} decode steps for 24 tokens a completion`);
    assert.ok(forked.tbtMs.length <= forked.decode!.steps, `${forked.tbtMs.length} gaps`);
    for (const trace of traces) {
      const late = trace.phases.filter((p) => p.phase === 'prefill_execution' && p.startMs >= trace.engineFirstTokenMs!);
      assert.ok(late.every((p) => p.attributes?.recompute === undefined), 'no chunk is marked a recompute');
      const d = new TraceAnalyzer({ slowTbtMs: 1e-6 }).classify(trace);
      assert.notEqual(d.category, 'decode_preempted', d.recommendation);
      // The prefill phase ends at the first token (as timings.prefill_ms counts it), not with a later chunk.
      assert.ok(trace.prefill!.endMs <= trace.engineFirstTokenMs! + 1e-6, `prefill ends ${trace.prefill!.endMs - trace.engineFirstTokenMs!} ms after the first token`);
      // Its spans: every child within its parent, the chunks after the first token under decode (where they ran).
      const spans = server.exporter.getFinishedSpans().filter((x) => x.spanContext().traceId === trace.traceId);
      const byId = new Map(spans.map((x) => [x.spanContext().spanId, x]));
      for (const x of spans) {
        const parent = x.parentSpanContext ? byId.get(x.parentSpanContext.spanId) : undefined;
        if (!parent) continue;
        assert.ok(hrTimeToMilliseconds(x.startTime) >= hrTimeToMilliseconds(parent.startTime) - 1e-6
          && hrTimeToMilliseconds(x.endTime) <= hrTimeToMilliseconds(parent.endTime) + 1e-6,
        `${x.name} [${hrTimeToMilliseconds(x.startTime) - trace.arrivalMs}, ${hrTimeToMilliseconds(x.endTime) - trace.arrivalMs}] lies within ${parent.name} `
          + `[${hrTimeToMilliseconds(parent.startTime) - trace.arrivalMs}, ${hrTimeToMilliseconds(parent.endTime) - trace.arrivalMs}]`);
      }
      const decode = spans.find((x) => x.name === 'decode');
      assert.equal(spans.filter((x) => x.name === 'model_forward_prefill' && x.parentSpanContext?.spanId === decode?.spanContext().spanId).length, late.length);
    }
    assert.ok((forked.prefill!.afterFirstToken?.chunks ?? 0) > 0, 'the n = 3 request\'s further completions computed chunks after the first token');
    assert.ok((traces[1]!.prefill!.afterFirstToken?.chunks ?? 0) > 0, 'the guided request\'s forced text was computed in chunks after its first token');
  });
});
