// The engine's side of a request in its spans and metrics: real decode steps (each forward pass the request was in,
// with the batch it shared), the budget allocation and the queue depth the worker reported, the traceparent handed
// through the engine and back, and KV evictions on /metrics. On live servers over every engine the gateway can sit
// on: one CPU worker, two behind the router, a disaggregated prefill/decode pair, and the simulated engine; and on
// constructed timelines for what the live ones cannot arrange (an engine context naming another span).
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { SpanStatusCode } from '@opentelemetry/api';
import { hrTimeToMilliseconds } from '@opentelemetry/core';
import { InMemorySpanExporter, type ReadableSpan } from '@opentelemetry/sdk-trace-node';
import type { LocalEngine } from '../../src/engine/local-engine.ts';
import { SupervisedEngine } from '../../src/runtime/supervised-engine.ts';
import type { EngineReport, LifecycleEvent } from '../../src/telemetry/lifecycle.ts';
import { Telemetry } from '../../src/telemetry/telemetry.ts';
import { engineIdle, waitFor } from '../api/e2e-fixture.ts';
import { parseSse, rawRequest } from '../api/http-client.ts';
import { coldTimeline } from './fixtures.ts';
import { moved, scrape, startLiveServer, type LiveServer } from './integration-fixture.ts';
import { openCompletionStream } from '../helpers/http-stream.ts';

/** A hang guard, not a speed requirement. */
const LIVE = { timeout: 120_000 };
/** Span times are hrtime (ns) from float ms: two routes to one instant may differ by a rounding step. */
const SAME_INSTANT_MS = 0.001;
const PER_STEP = { perTokenSpans: true, sampling: { baseRate: 1 } };

function longPrompt(): string {
  return `Request ${randomUUID()}: ${'the lighthouse keeper counted the ships that passed in the night, '.repeat(12)}`;
}

const startMs = (s: ReadableSpan) => hrTimeToMilliseconds(s.startTime);
const endMs = (s: ReadableSpan) => hrTimeToMilliseconds(s.endTime);
const parentOf = (s: ReadableSpan) => s.parentSpanContext?.spanId;
const idOf = (s: ReadableSpan) => s.spanContext().spanId;

function named(spans: readonly ReadableSpan[], name: string): ReadableSpan[] {
  return spans.filter((s) => s.name === name).sort((a, b) => startMs(a) - startMs(b));
}

function one(spans: readonly ReadableSpan[], name: string): ReadableSpan {
  const found = named(spans, name);
  assert.equal(found.length, 1, `one ${name} span, found ${found.length}`);
  return found[0]!;
}

/** Every span of the request's trace, once its root has been exported. */
async function spansOf(server: LiveServer, requestId: string): Promise<ReadableSpan[]> {
  const isRoot = (s: ReadableSpan) => s.name === 'request' && s.attributes['request.id'] === requestId;
  await waitFor(() => server.exporter.getFinishedSpans().some(isRoot), `the spans of ${requestId}`);
  const root = server.exporter.getFinishedSpans().find(isRoot)!;
  return server.exporter.getFinishedSpans().filter((s) => s.spanContext().traceId === root.spanContext().traceId);
}

/**
 * What every request that reached the engine shows: scheduling { queue_wait, budget_allocation } with the queue
 * depth and the budget the worker reported, budget_allocation ending where the first forward pass starts, and
 * (given `decodeSteps`) that many decode_step spans inside decode, one per forward pass, each with its batch.
 */
function assertEngineSpans(spans: readonly ReadableSpan[], expect: { decodeSteps?: number; budgetTokens?: number; queueDepth?: number }): void {
  const root = one(spans, 'request');
  const scheduling = one(spans, 'scheduling');
  const queueWait = one(spans, 'queue_wait');
  const budget = one(spans, 'budget_allocation');
  assert.equal(parentOf(scheduling), idOf(root));
  assert.equal(parentOf(queueWait), idOf(scheduling));
  assert.equal(parentOf(budget), idOf(scheduling));
  const depth = scheduling.attributes['scheduling.queue_depth_at_entry'];
  assert.equal(typeof depth, 'number', 'the worker reported the queue it joined');
  if (expect.queueDepth !== undefined) assert.equal(depth, expect.queueDepth);
  assert.equal(queueWait.attributes['scheduling.queue_depth_at_entry'], depth);
  const budgetTokens = budget.attributes['scheduling.budget_tokens'];
  assert.ok(typeof budgetTokens === 'number' && budgetTokens > 0, `budget tokens ${String(budgetTokens)}`);
  if (expect.budgetTokens !== undefined) assert.equal(budgetTokens, expect.budgetTokens);
  assert.ok(Math.abs(startMs(budget) - endMs(queueWait)) <= SAME_INSTANT_MS, 'the budget is allocated once the request is picked');
  const firstForward = named(spans, 'model_forward_prefill')[0]!;
  assert.ok(Math.abs(endMs(budget) - startMs(firstForward)) <= SAME_INSTANT_MS, 'and ends when its first forward pass begins');
  assert.ok(typeof firstForward.attributes['prefill.batch_size'] === 'number' && typeof firstForward.attributes['prefill.batch_tokens'] === 'number');

  if (expect.decodeSteps === undefined) return;
  const decode = one(spans, 'decode');
  const steps = named(spans, 'decode_step');
  assert.equal(steps.length, expect.decodeSteps);
  assert.equal(decode.attributes['decode.step_source'], 'engine_steps');
  assert.equal(decode.attributes['decode.total_steps'], expect.decodeSteps);
  let previousEnd = -Infinity;
  const sizes: number[] = [];
  for (const [i, step] of steps.entries()) {
    assert.equal(parentOf(step), idOf(decode));
    assert.equal(step.attributes['decode.step'], i + 1);
    const size = step.attributes['decode.batch_size'];
    const tokens = step.attributes['decode.batch_tokens'];
    assert.ok(typeof size === 'number' && size >= 1, `step ${i + 1}: batch of ${String(size)}`);
    assert.ok(typeof tokens === 'number' && tokens >= size, `step ${i + 1}: ${String(tokens)} tokens for ${size} sequences`);
    sizes.push(size);
    assert.ok(startMs(step) >= previousEnd - SAME_INSTANT_MS, 'one forward pass after the other');
    assert.ok(startMs(step) >= startMs(decode) - SAME_INSTANT_MS && endMs(step) <= endMs(decode) + SAME_INSTANT_MS, 'inside decode');
    previousEnd = endMs(step);
  }
  assert.equal(decode.attributes['decode.batch_size_max'], Math.max(...sizes));
  assert.equal(decode.attributes['decode.batch_size_min'], Math.min(...sizes));
  assert.ok(Math.abs(Number(decode.attributes['decode.batch_size_mean']) - sizes.reduce((a, b) => a + b, 0) / sizes.length) < 1e-3);
}

describe('engine spans on a live server (one CPU worker, a span per decode step)', () => {
  let server: LiveServer;
  let model: string;

  before(async () => {
    server = await startLiveServer({ telemetry: PER_STEP });
    model = server.api.gateway.servedModelName!;
  });

  after(async () => {
    await server?.close();
  });

  const complete = async (body: object, headers: Record<string, string> = {}) => {
    const res = await rawRequest(server.url, { path: '/v1/completions', headers, body: { model, temperature: 0, ignore_eos: true, ...body } });
    assert.equal(res.status, 200, res.text);
    return res.json();
  };

  it('a cold then a warm prompt: real decode steps with their batches, the budget each was granted, the queue each met', LIVE, async () => {
    const prompt = longPrompt();
    const cold = await complete({ prompt, max_tokens: 6 });
    const warm = await complete({ prompt, max_tokens: 6 });
    const coldSpans = await spansOf(server, cold.id);
    const warmSpans = await spansOf(server, warm.id);
    // Alone on an idle worker: nobody queued ahead, the whole prompt (what the cache lacked) granted at once.
    assertEngineSpans(coldSpans, { decodeSteps: 5, budgetTokens: cold.usage.prompt_tokens, queueDepth: 0 });
    const cached = warm.usage.prompt_tokens_details.cached_tokens;
    assert.ok(cached > 0, 'the repeat found its prefix');
    assertEngineSpans(warmSpans, { decodeSteps: 5, budgetTokens: warm.usage.prompt_tokens - cached, queueDepth: 0 });
    for (const spans of [coldSpans, warmSpans]) {
      for (const step of named(spans, 'decode_step')) {
        assert.equal(step.attributes['decode.batch_size'], 1, 'alone in every step');
        assert.equal(step.attributes['decode.batch_tokens'], 1);
      }
    }
    assert.equal(one(coldSpans, 'model_forward_prefill').attributes['prefill.batch_tokens'], cold.usage.prompt_tokens);
    // The decode steps are the engine's forward passes, not the gaps between tokens: the gaps include the time
    // between passes, so the passes' total cannot exceed decode's span.
    const decode = one(coldSpans, 'decode');
    const forward = Number(decode.attributes['decode.forward_ms']);
    const stepTotal = named(coldSpans, 'decode_step').reduce((sum, s) => sum + endMs(s) - startMs(s), 0);
    assert.ok(Math.abs(forward - stepTotal) < 0.01, `forward ${forward} ms, steps ${stepTotal} ms`);
    assert.ok(forward <= endMs(decode) - startMs(decode) + SAME_INSTANT_MS);
  });

  it('requests sharing the worker: each step\'s batch counts them all', LIVE, async () => {
    const bodies = [0, 1, 2].map(() => complete({ prompt: longPrompt(), max_tokens: 48 }));
    const results = await Promise.all(bodies);
    const all = await Promise.all(results.map((r) => spansOf(server, r.id)));
    for (const spans of all) assertEngineSpans(spans, { decodeSteps: 47 });
    // A step all three were in is one forward pass: the same instants in each trace, and a batch of three.
    const byStart = new Map<string, ReadableSpan[]>();
    for (const spans of all) {
      for (const step of named(spans, 'decode_step')) {
        const key = `${step.startTime.join('.')}-${step.endTime.join('.')}`;
        byStart.set(key, [...(byStart.get(key) ?? []), step]);
      }
    }
    for (const shared of byStart.values()) {
      for (const step of shared) assert.ok(Number(step.attributes['decode.batch_size']) >= shared.length, 'a step holds at least the requests seen in it');
    }
    assert.ok([...byStart.values()].some((shared) => shared.length >= 2 && shared.every((s) => Number(s.attributes['decode.batch_size']) >= 2)),
      'some steps ran two or more of the requests together');
  });

  it('an aborted stream: the decode steps it got, then the abort', LIVE, async () => {
    const stream = await openCompletionStream(server.url, { model, prompt: longPrompt(), max_tokens: 1500, ignore_eos: true }, { events: 6 });
    stream.hangUp();
    const spans = await spansOf(server, stream.id);
    const root = one(spans, 'request');
    assert.equal(root.attributes['request.aborted'], true);
    assert.notEqual(root.status.code, SpanStatusCode.ERROR);
    const decode = one(spans, 'decode');
    assert.equal(decode.attributes['decode.completed'], false);
    const steps = named(spans, 'decode_step');
    assert.ok(steps.length >= 3, `${steps.length} decode steps before the hang-up`);
    assertEngineSpans(spans, { decodeSteps: steps.length });
    await waitFor(() => engineIdle(server.engine), 'the engine to let it go');
  });

  it('carries the client\'s traceparent through the engine and back: the engine\'s spans hang under the context it was given', LIVE, async () => {
    const clientTrace = 'a3ce929d0e0e47364bf92f3577b34da6';
    const clientSpan = '0ba902b700f067aa';
    const body = await complete({ prompt: 'Follow me through the engine', max_tokens: 3 }, { traceparent: `00-${clientTrace}-${clientSpan}-01` });
    const trace = server.telemetry.trace(body.id)!;
    assert.equal(trace.traceId, clientTrace);
    // What the engine was given (the gateway's root span as parent) came back on its outputs.
    assert.equal(trace.engineTraceparent, `00-${clientTrace}-${trace.rootSpanId}-01`);
    const view = await rawRequest(server.url, { path: `/v1/requests/${body.id}/trace` });
    assert.equal(view.json().engine_traceparent, trace.engineTraceparent);

    const spans = await spansOf(server, body.id);
    assert.ok(spans.every((s) => s.spanContext().traceId === clientTrace), 'every span in the client\'s trace');
    const root = one(spans, 'request');
    assert.equal(parentOf(root), clientSpan);
    assert.equal(idOf(root), trace.rootSpanId);
    assert.equal(root.attributes['conduit.engine.traceparent'], trace.engineTraceparent);
    for (const name of ['scheduling', 'prefill', 'decode']) assert.equal(parentOf(one(spans, name)), idOf(root), `${name} under the engine's context`);
    for (const step of named(spans, 'decode_step')) assert.equal(parentOf(step), idOf(one(spans, 'decode')));
  });
});

describe('engine spans with --stream-interval 4 (tokens handed over four at a time)', () => {
  let server: LiveServer;

  before(async () => {
    server = await startLiveServer({ telemetry: PER_STEP, streamInterval: 4 });
  });
  after(async () => {
    await server?.close();
  });

  it('a span per decode step, the steps of held tokens included, each once for two completions', LIVE, async () => {
    const res = await rawRequest(server.url, { path: '/v1/completions', body: {
      model: server.api.gateway.servedModelName!, prompt: longPrompt(), max_tokens: 9, n: 2, temperature: 0.8, seed: 3, ignore_eos: true,
    } });
    assert.equal(res.status, 200, res.text);
    const body = res.json() as { id: string; usage: { completion_tokens: number } };
    assert.equal(body.usage.completion_tokens, 18);
    const spans = await spansOf(server, body.id);
    assertEngineSpans(spans, { decodeSteps: 8 });
    for (const step of named(spans, 'decode_step')) assert.equal(step.attributes['decode.batch_size'], 2, 'both completions in every step');
  });
});

describe('engine spans of a request that timed out mid-stream', () => {
  let timing: LiveServer;

  before(async () => {
    timing = await startLiveServer({ requestTimeoutMs: 1000, telemetry: PER_STEP });
  });

  after(async () => {
    await timing?.close();
  });

  it('an errored stream (timed out): the root is an error, and the engine\'s steps up to then are there', LIVE, async () => {
    const model = timing.api.gateway.servedModelName!;
    const res = await rawRequest(timing.url, {
      path: '/v1/completions', body: { model, prompt: 'Never ending', max_tokens: 2000, ignore_eos: true, stream: true },
    });
    assert.equal(JSON.parse(parseSse(res.text).at(-2)!.data).error.code, 'request_timeout');
    const spans = await spansOf(timing, String(res.headers['x-request-id']));
    const root = one(spans, 'request');
    assert.equal(root.status.code, SpanStatusCode.ERROR);
    assert.equal(one(spans, 'decode').attributes['decode.completed'], false, 'it ended inside decode');
    const steps = named(spans, 'decode_step');
    assert.ok(steps.length > 0);
    assertEngineSpans(spans, { decodeSteps: steps.length });
    await waitFor(() => engineIdle(timing.engine), 'the engine to let it go');
  });
});

describe('engine spans through the router (two CPU workers)', () => {
  let server: LiveServer;

  before(async () => {
    server = await startLiveServer({ workers: 2, telemetry: PER_STEP });
  });

  after(async () => {
    await server?.close();
  });

  it('the same engine facts, from the worker the router chose', LIVE, async () => {
    const model = server.api.gateway.servedModelName!;
    const res = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: longPrompt(), max_tokens: 5, temperature: 0, ignore_eos: true } });
    const body = res.json();
    const spans = await spansOf(server, body.id);
    assertEngineSpans(spans, { decodeSteps: 4, budgetTokens: body.usage.prompt_tokens });
    const worker = one(spans, 'routing').attributes['routing.selected_worker'];
    assert.match(String(worker), /^worker-[01]$/);
    assert.equal(one(spans, 'scheduling').attributes['scheduling.worker'], worker);
    assert.equal(one(spans, 'decode').attributes['decode.worker'], worker);
  });
});

describe('engine spans from a disaggregated pair (prefill worker, then decode worker)', () => {
  let server: LiveServer;

  before(async () => {
    server = await startLiveServer({ disaggregated: { prefillWorkers: 1, decodeWorkers: 1 }, telemetry: PER_STEP });
  });

  after(async () => {
    await server?.close();
  });

  it('queue and budget from the prefill worker, decode steps from the decode worker, one trace context on both', LIVE, async () => {
    const model = server.api.gateway.servedModelName!;
    const clientTrace = '5f2c1a9e8d7b6c5a4f3e2d1c0b9a8f7e';
    const res = await rawRequest(server.url, {
      path: '/v1/completions', headers: { traceparent: `00-${clientTrace}-1a2b3c4d5e6f7a8b-01` },
      body: { model, prompt: longPrompt(), max_tokens: 6, temperature: 0, ignore_eos: true },
    });
    const body = res.json();
    const spans = await spansOf(server, body.id);
    assertEngineSpans(spans, { decodeSteps: 5, budgetTokens: body.usage.prompt_tokens });
    assert.equal(one(spans, 'scheduling').attributes['scheduling.worker'], 'prefill-0');
    assert.equal(one(spans, 'prefill').attributes['prefill.worker'], 'prefill-0');
    assert.ok(named(spans, 'kv_transfer').length === 1);
    // The hand-over after the first token, then the transfer: decode_dispatch ends where kv_transfer starts.
    const handOver = one(spans, 'decode_dispatch');
    assert.equal(handOver.attributes['dispatch.worker'], 'decode-0');
    assert.deepEqual(handOver.endTime, one(spans, 'kv_transfer').startTime);
    assert.equal(one(spans, 'decode').attributes['decode.worker'], 'decode-0', 'the decode steps are the decode worker\'s');
    const trace = server.telemetry.trace(body.id)!;
    assert.equal(trace.engineTraceparent, `00-${clientTrace}-${trace.rootSpanId}-01`);
    assert.ok(spans.every((s) => s.spanContext().traceId === clientTrace));
  });
});

describe('engine spans from the simulated engine', () => {
  let server: LiveServer;

  before(async () => {
    server = await startLiveServer({ sim: true, telemetry: PER_STEP });
  });

  after(async () => {
    await server?.close();
  });

  it('the simulated steps, with their batches, budget and queue', LIVE, async () => {
    const model = server.api.gateway.servedModelName!;
    const results = await Promise.all([0, 1].map(() =>
      rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: longPrompt(), max_tokens: 8, temperature: 0, ignore_eos: true } })));
    for (const res of results) {
      assert.equal(res.status, 200, res.text);
      const body = res.json();
      const spans = await spansOf(server, body.id);
      assertEngineSpans(spans, { decodeSteps: 7 });
      assert.equal(one(spans, 'decode').attributes['decode.worker'], server.api.gateway.workerId);
    }
  });
});

describe('KV evictions on /metrics', () => {
  let server: LiveServer;

  before(async () => {
    // 64 blocks of 16 tokens (f16 KV, what --kv-cache-dtype auto stores): room for a few of the prompts below (over a
    // hundred tokens each), cached, before the next ones evict them.
    server = await startLiveServer({ kvCacheMemoryBytes: 64 * 2 * 6 * 2 * 64 * 2 * 16 });
    assert.equal(server.engine.info.kvCapacityTokens, 64 * 16, `64 blocks (${server.engine.info.kvDtype} KV)`);
  });

  after(async () => {
    await server?.close();
  });

  it('conduit_kv_cache_evictions_total moves by what the engine evicted', LIVE, async () => {
    const model = server.api.gateway.servedModelName!;
    // The one cpu worker's own engine (the server's is the supervisor over it): sync() settles its stats.
    const engine = (server.engine instanceof SupervisedEngine ? server.engine.worker!.engine : server.engine) as LocalEngine;
    const worker = server.api.gateway.workerId;
    const before = (await scrape(server.url)).exposition;
    const startEvictions = (await engine.sync()).kvEvictions!;
    for (let i = 0; i < 6; i++) {
      const res = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: longPrompt(), max_tokens: 2, temperature: 0 } });
      assert.equal(res.status, 200, res.text);
    }
    const evicted = (await engine.sync()).kvEvictions! - startEvictions;
    const after = (await scrape(server.url)).exposition;
    assert.ok(evicted > 0, 'six distinct prompts overflow 64 blocks and evict cached ones');
    assert.equal(moved(before, after, 'conduit_kv_cache_evictions_total', { worker }), evicted);
  });
});

describe('engine facts in spans, from constructed timelines', () => {
  function traced(): { telemetry: Telemetry; exporter: InMemorySpanExporter } {
    const exporter = new InMemorySpanExporter();
    return { telemetry: new Telemetry({ env: {}, exporters: [exporter], processor: 'simple', sampling: { baseRate: 1 } }), exporter };
  }

  /** The cold fixture with what an engine reports beside its timestamps: queue depth, budget, decode summary. */
  function withEngineFacts(events: readonly LifecycleEvent[], facts: Partial<EngineReport>): LifecycleEvent[] {
    return events.map((e) => {
      if (e.phase !== 'finish') return e;
      const engine = e.engine as EngineReport;
      return { ...e, engine: { ...engine, ...facts, timestamps: { ...engine.timestamps, ...facts.timestamps } } };
    });
  }

  it('summarised decode (no per-step spans) takes its batch figures from the engine\'s summary', () => {
    const { telemetry, exporter } = traced();
    const cold = coldTimeline();
    const { firstScheduled } = cold.at;
    const events = withEngineFacts(cold.events, {
      timestamps: {
        ...cold.engine.timestamps, queueDepthAtEntry: 3, budget: { tokens: 512, forwardStart: firstScheduled + 0.25 },
        decodeSteps: {
          steps: 7, forwardMs: 70, batchSeqsSum: 28, batchSeqsMin: 2, batchSeqsMax: 6,
          batchTokensSum: 540, batchTokensMin: 2, batchTokensMax: 514,
        },
      },
    });
    for (const e of events) telemetry.lifecycle.emit(e);
    const spans = exporter.getFinishedSpans();
    const scheduling = one(spans, 'scheduling');
    assert.equal(scheduling.attributes['scheduling.queue_depth_at_entry'], 3);
    const budget = one(spans, 'budget_allocation');
    assert.equal(budget.attributes['scheduling.budget_tokens'], 512);
    assert.ok(Math.abs(endMs(budget) - startMs(budget) - 0.25) < SAME_INSTANT_MS);
    const decode = one(spans, 'decode');
    assert.equal(named(spans, 'decode_step').length, 0);
    assert.equal(decode.attributes['decode.batch_size_mean'], 4);
    assert.equal(decode.attributes['decode.batch_size_min'], 2);
    assert.equal(decode.attributes['decode.batch_size_max'], 6);
    assert.equal(decode.attributes['decode.batch_tokens_max'], 514);
    assert.equal(decode.attributes['decode.batch_tokens_mean'], 77.143, '540 / 7, to the µs-style 3 decimals of span figures');
    assert.equal(decode.attributes['decode.forward_ms'], 70);
    void telemetry.shutdown();
  });

  it('hangs the engine\'s spans under the span the engine\'s traceparent names, when another span of the trace stands between', () => {
    const { telemetry, exporter } = traced();
    const traceId = '0af7651916cd43dd8448eb211c80319c';
    const workerSpan = 'b7ad6b7169203331';
    const cold = coldTimeline({ traceparent: `00-${traceId}-00f067aa0ba902b7-01` });
    const events = withEngineFacts(cold.events, { traceparent: `00-${traceId}-${workerSpan}-01` });
    for (const e of events) telemetry.lifecycle.emit(e);
    const spans = exporter.getFinishedSpans();
    const root = one(spans, 'request');
    for (const name of ['scheduling', 'prefill', 'decode']) assert.equal(parentOf(one(spans, name)), workerSpan, name);
    for (const name of ['gateway', 'routing', 'token_emit']) assert.equal(parentOf(one(spans, name)), idOf(root), name);
    assert.ok(spans.every((s) => s.spanContext().traceId === traceId));

    // A context from another trace is not followed: the engine's part stays in the request's own tree.
    exporter.reset();
    const other = withEngineFacts(coldTimeline({ id: 'req-other', traceparent: `00-${traceId}-00f067aa0ba902b7-01` }).events,
      { traceparent: `00-${'1'.repeat(32)}-${workerSpan}-01` });
    for (const e of other) telemetry.lifecycle.emit(e);
    const again = exporter.getFinishedSpans();
    for (const name of ['scheduling', 'prefill', 'decode']) assert.equal(parentOf(one(again, name)), idOf(one(again, 'request')), name);
    void telemetry.shutdown();
  });
});
