// The telemetry wired into the live server, with the real engine: what a response's `timings`, the request's trace
// (GET /v1/requests/{id}/trace), the spans and /metrics say about the same requests, and that they agree. Cold and
// warm prompts, streams, a client hanging up, refusals at each gateway check, a timeout mid-stream, the client's
// traceparent, and every metric name the dashboards and alert rules use, scraped from `conduit serve`'s own server.

import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { readdirSync, readFileSync } from 'node:fs';
import { request as httpRequest } from 'node:http';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, afterEach, before, describe, it } from 'node:test';
import { SpanStatusCode } from '@opentelemetry/api';
import { ADMIN_KEY, engineIdle, startTestServer, waitFor, type TestServer } from '../api/e2e-fixture.ts';
import { parseSse, rawRequest, type RawResponse } from '../api/http-client.ts';
import { total, value, type Exposition } from './exposition.ts';
import { moved, scrape, startLiveServer, type LiveServer } from './integration-fixture.ts';
import { PROMTOOL_MISSING, havePromtool, promtool } from './promtool.ts';
import { openCompletionStream } from '../helpers/http-stream.ts';

/** A hang guard, not a speed requirement. */
const LIVE = { timeout: 120_000 };
/** The trace view rounds offsets and durations to the µs; a sum of two may be off by that much each. */
const ROUNDING = 0.002;

const KEY = 'sk-telemetry-main-01';
const LIMITED_KEY = 'sk-telemetry-limit-2';
const SOLO_KEY = 'sk-telemetry-solo-03';
const KEYS_FILE = `${KEY} main\n${LIMITED_KEY} limited 1\n${SOLO_KEY} solo - - 1\n`;
const auth = (key = KEY): Record<string, string> => ({ Authorization: `Bearer ${key}` });

/** A prompt of a few hundred tokens no earlier request shares a block with. */
function longPrompt(): string {
  return `Request ${randomUUID()}: ${'the lighthouse keeper counted the ships that passed in the night, '.repeat(25)}`;
}

/**
 * A longPrompt whose token count is not a multiple of the block size, and that count. A fully cached prompt ending
 * on a block boundary has its last block copied, not shared, and reports n - 1 cached tokens while the router counts
 * whole blocks (test/engine/prefix-copy.test.ts covers that case); the tests that compare cached tokens with whole
 * blocks need the other case. The UUID's tokens put about one longPrompt in fifty on the boundary.
 */
async function longPromptOffBlockBoundary(url: string, model: string, blockSize: number): Promise<{ prompt: string; tokens: number }> {
  for (;;) {
    const prompt = longPrompt();
    const res = await rawRequest(url, { path: '/tokenize', headers: auth(), body: { model, prompt } });
    assert.equal(res.status, 200, res.text);
    const tokens = res.json().count as number;
    if (tokens % blockSize !== 0) return { prompt, tokens };
  }
}

interface TraceBody {
  request_id: string;
  trace_id: string | null;
  traceparent: string | null;
  outcome: string;
  finish_reason: string;
  error_type: string | null;
  status: number | null;
  ended_in_phase: string | null;
  worker: string | null;
  usage: { prompt_tokens: number; completion_tokens: number; cached_tokens: number };
  timings: Record<string, number | boolean | null>;
  phases: { phase: string; start_ms: number; duration_ms: number; worker?: string; attributes?: Record<string, string | number | boolean> }[];
  tbt: { count: number };
  waterfall: string;
  analysis: { request_id: string; category: string };
}

async function traceOf(url: string, id: string, key = KEY): Promise<TraceBody> {
  const res = await rawRequest(url, { path: `/v1/requests/${encodeURIComponent(id)}/trace`, headers: auth(key) });
  assert.equal(res.status, 200, `trace of ${id}: ${res.text}`);
  return res.json() as TraceBody;
}

/**
 * Polls the trace endpoint until the request has ended (a hung-up request ends when the engine lets it go). With the
 * admin key: the request may be any tenant's, or none's (refused before its key was known).
 */
async function endedTrace(url: string, id: string): Promise<TraceBody> {
  let found: TraceBody | undefined;
  const deadline = Date.now() + 30_000;
  while (!found) {
    const res = await rawRequest(url, { path: `/v1/requests/${id}/trace`, headers: auth(ADMIN_KEY) });
    if (res.status === 200) found = res.json() as TraceBody;
    else if (Date.now() > deadline) throw new Error(`no trace of ${id}: ${res.text}`);
    else await new Promise((resolve) => setTimeout(resolve, 20));
  }
  return found;
}

/** Opens a completion stream; resolves once `events` SSE events have arrived, with the request id and a hang-up. */
const names = (trace: TraceBody): string[] => trace.phases.map((p) => p.phase);
const phase = (trace: TraceBody, name: string) => trace.phases.find((p) => p.phase === name);
const prefillTokens = (trace: TraceBody): number =>
  trace.phases.filter((p) => p.phase === 'prefill_execution').reduce((sum, p) => sum + Number(p.attributes?.tokens), 0);

/**
 * Every timings field but total_ms, which the response reports before its own last byte, and decode_ms, which runs
 * from the first token to that end.
 */
function withoutTotal(timings: Record<string, unknown>): Record<string, unknown> {
  const { total_ms: _total, decode_ms: _decode, ...rest } = timings;
  return rest;
}

function assertValidExposition(text: string): void {
  const types = text.split('\n').filter((l) => l.startsWith('# TYPE ')).map((l) => l.split(' ')[2]!);
  assert.deepEqual(types.filter((name, i) => types.indexOf(name) !== i), [], 'no family is defined twice');
}

/** promtool's verdict on an exposition (its own test, so a machine without promtool reports a skip). */
function assertPromtoolAccepts(text: string): void {
  const { output } = promtool(['check', 'metrics'], text);
  // Milliseconds are the unit on purpose (docs/observability.md); promtool's only other remarks would be errors.
  const problems = output.split('\n').filter((l) => l.trim() !== '' && !/use base unit "seconds" instead of "milliseconds"/.test(l));
  assert.deepEqual(problems, []);
}

describe('telemetry on a live server (one worker, the test\'s own telemetry with an in-memory span exporter)', () => {
  let server: LiveServer;
  let model: string;
  let blockSize: number;

  before(async () => {
    server = await startLiveServer({ keysFile: KEYS_FILE });
    model = server.api.gateway.servedModelName!;
    blockSize = server.engine.info.blockSize;
  });

  after(async () => {
    await server?.close();
  });

  // After each test, on its own requests: every one ended, and exactly once, and none was dropped unfinished.
  afterEach(async () => {
    await waitFor(() => server.telemetry.inFlight === 0, 'every request to end');
    const notOnce = [...server.terminals].filter(([, ends]) => ends.length !== 1);
    assert.deepEqual(notOnce, [], 'requests ended other than once');
    const { exposition } = await scrape(server.url);
    assert.equal(total(exposition, 'conduit_telemetry_dropped_records_total'), 0);
  });

  const post = (body: object, key = KEY, headers: Record<string, string> = {}, path = '/v1/completions'): Promise<RawResponse> =>
    rawRequest(server.url, { path, headers: { ...auth(key), ...headers }, body });

  it('a cold then a warm prompt: body timings, traces and metrics agree, and the warm one skips its prefill', LIVE, async () => {
    const { prompt, tokens } = await longPromptOffBlockBoundary(server.url, model, blockSize);
    const before = (await scrape(server.url)).exposition;
    const ask = { model, prompt, max_tokens: 4, temperature: 0, ignore_eos: true };
    const coldRes = await post(ask);
    const warmRes = await post(ask);
    assert.equal(coldRes.status, 200, coldRes.text);
    assert.equal(warmRes.status, 200, warmRes.text);
    const cold = coldRes.json();
    const warm = warmRes.json();
    const { exposition: after, text } = await scrape(server.url);
    assertValidExposition(text);

    const promptTokens = cold.usage.prompt_tokens;
    assert.equal(promptTokens, tokens);
    assert.ok(promptTokens > 10 * blockSize, `a long prompt (${promptTokens} tokens)`);
    assert.equal(cold.usage.prompt_tokens_details.cached_tokens, 0);
    const warmCached = warm.usage.prompt_tokens_details.cached_tokens;
    assert.equal(warmCached, promptTokens - (promptTokens % blockSize),
      `the warm request found every full block of its prompt cached (${warmCached} of ${promptTokens})`);

    // The id the client sees is the id the trace endpoint takes.
    assert.equal(coldRes.headers['x-request-id'], cold.id);
    const coldTrace = await traceOf(server.url, cold.id);
    const warmTrace = await traceOf(server.url, warm.id);
    for (const [body, trace] of [[cold, coldTrace], [warm, warmTrace]] as const) {
      assert.equal(trace.request_id, body.id);
      assert.equal(trace.outcome, 'ok');
      assert.equal(trace.finish_reason, 'length');
      assert.equal(trace.worker, 'worker-0');
      assert.deepEqual(trace.usage, { prompt_tokens: promptTokens, completion_tokens: 4, cached_tokens: body.usage.prompt_tokens_details.cached_tokens });
      // The path in order: the gateway's phases, the worker's queue, the prompt's chunks, then decode.
      assert.match(names(trace).join(','),
        /^http_receive,auth,rate_limit,validate,tokenize,(prefill_dispatch,)?scheduler_queue,(prefill_execution,)+decode_execution,streaming_response$/);
      const starts = trace.phases.map((p) => p.start_ms);
      assert.deepEqual(starts, [...starts].sort((a, b) => a - b));
      const queue = phase(trace, 'scheduler_queue')!;
      const tokenize = phase(trace, 'tokenize')!;
      assert.ok(queue.start_ms >= tokenize.start_ms + tokenize.duration_ms - ROUNDING, 'queued after the prompt was tokenized');
      assert.ok(phase(trace, 'prefill_execution')!.start_ms >= queue.start_ms + queue.duration_ms - ROUNDING, 'prefill after the queue');
      // The body's timings were taken just before its last byte: the same figures as the finished trace's.
      assert.deepEqual(withoutTotal(body.timings), withoutTotal(trace.timings));
      assert.ok(body.timings.total_ms <= (trace.timings.total_ms as number));
      assert.ok(trace.waterfall.startsWith(`request ${body.id}  model ${model}  worker worker-0  ok (length)`), trace.waterfall);
    }
    assert.equal(prefillTokens(coldTrace), promptTokens, 'the cold request computed its whole prompt');
    assert.equal(prefillTokens(warmTrace), promptTokens - warmCached, 'the warm one only what the cache lacked');
    assert.equal(cold.timings.prefill_skipped, false);
    assert.equal(warm.timings.prefill_skipped, true);
    assert.equal(warm.timings.cached_tokens, warmCached);
    assert.equal(coldTrace.analysis.request_id, cold.id, 'the trace comes with its bottleneck diagnosis');

    const labels = { model, tenant: 'main' };
    assert.equal(moved(before, after, 'conduit_requests_total', { ...labels, finish_reason: 'length' }), 2);
    assert.equal(moved(before, after, 'conduit_request_prompt_tokens_total', { ...labels, worker: 'worker-0' }), 2 * promptTokens);
    assert.equal(moved(before, after, 'conduit_request_cached_tokens_total', { ...labels, worker: 'worker-0' }), warmCached);
    assert.equal(moved(before, after, 'conduit_request_generation_tokens_total', { ...labels, worker: 'worker-0' }), 8);
    assert.equal(moved(before, after, 'conduit_time_to_first_token_milliseconds_count', { model, worker: 'worker-0' }), 2);
    assert.equal(moved(before, after, 'conduit_request_prefix_cache_hit_ratio_count', { model, worker: 'worker-0' }), 2);
    assert.ok(Math.abs(moved(before, after, 'conduit_request_prefix_cache_hit_ratio_sum', { model, worker: 'worker-0' }) - warmCached / promptTokens) < 1e-9);
    // The histograms observed the traces' own figures.
    const prefillMoved = moved(before, after, 'conduit_prefill_duration_milliseconds_sum', { model, worker: 'worker-0' });
    assert.ok(Math.abs(prefillMoved - ((coldTrace.timings.prefill_ms as number) + (warmTrace.timings.prefill_ms as number))) < 0.01,
      `prefill histogram moved ${prefillMoved}`);
    // The engine's own prefix-cache counters, per worker, from its stats at scrape time.
    assert.equal(moved(before, after, 'conduit_prefix_cache_hit_tokens_total', { worker: 'worker-0' }), warmCached);
    assert.ok(moved(before, after, 'conduit_prefix_cache_query_tokens_total', { worker: 'worker-0' }) >= 2 * (promptTokens - 1));
    assert.equal(moved(before, after, 'conduit_http_responses_total', { route: 'completions', status: '200', tenant: 'main' }), 2);
    // The gateway's hand-rolled duplicates are gone: one family per thing.
    for (const gone of ['conduit_prompt_tokens_total', 'conduit_generation_tokens_total', 'conduit_preemptions_total',
      'conduit_prefix_cache_hits_total', 'conduit_prefix_cache_queries_total']) {
      assert.ok(!text.includes(`# TYPE ${gone} `), `${gone} is not exported`);
    }
  });

  it('a stream: its SSE writes are the trace\'s streaming_response and TTFT, and its last chunk carries timings', LIVE, async () => {
    const messages = [{ role: 'user', content: 'Tell me about the sea.' }];
    for (const includeUsage of [false, true]) {
      const res = await post({
        model, messages, max_tokens: 8, temperature: 0, ignore_eos: true, stream: true,
        ...(includeUsage ? { stream_options: { include_usage: true } } : {}),
      }, KEY, {}, '/v1/chat/completions');
      assert.equal(res.status, 200, res.text);
      const events = parseSse(res.text);
      const chunks = events.filter((e) => e.data !== '[DONE]').map((e) => JSON.parse(e.data));
      const withTimings = chunks.filter((c) => c.timings !== undefined);
      assert.equal(withTimings.length, 1, 'one chunk carries timings');
      assert.equal(withTimings[0], chunks.at(-1), 'the last one');
      if (includeUsage) assert.deepEqual(chunks.at(-1).choices, [], 'the usage chunk, when there is one');
      else assert.equal(chunks.at(-1).choices[0].finish_reason, 'length');

      const trace = await traceOf(server.url, chunks[0].id);
      const contentChunks = chunks.filter((c) => c.choices[0]?.delta?.content);
      const stream = phase(trace, 'streaming_response')!;
      assert.equal(stream.attributes!.writes, events.length, 'every SSE write, [DONE] included');
      assert.equal(stream.attributes!.content_writes, contentChunks.length);
      assert.equal(trace.tbt.count, contentChunks.length - 1, 'time between tokens: the gaps between content writes');
      assert.ok(names(trace).indexOf('streaming_response') > names(trace).indexOf('prefill_execution'));
      const timings = chunks.at(-1).timings;
      // Taken before the last write: the same TTFT (from the first content write) as the trace, and its queue and
      // prefill; only the total and the gaps still to come differ.
      assert.equal(timings.ttft_ms, trace.timings.ttft_ms);
      assert.equal(timings.prefill_ms, trace.timings.prefill_ms);
      assert.equal(timings.queue_ms, trace.timings.queue_ms);
      assert.ok(timings.total_ms <= (trace.timings.total_ms as number));
    }
  });

  it('a client hanging up mid-stream is counted as a cancellation and traced as an abort', LIVE, async () => {
    const before = (await scrape(server.url)).exposition;
    const stream = await openCompletionStream(server.url, { model, prompt: 'Count the waves', max_tokens: 1500, ignore_eos: true }, { key: KEY, events: 4 });
    stream.hangUp();
    const trace = await endedTrace(server.url, stream.id);
    await waitFor(() => engineIdle(server.engine), 'the aborted request to leave the engine');
    const after = (await scrape(server.url)).exposition;
    assert.equal(trace.outcome, 'abort');
    assert.equal(trace.finish_reason, 'abort');
    assert.equal(trace.ended_in_phase, 'decode_execution');
    assert.ok(trace.usage.completion_tokens > 0 && trace.usage.completion_tokens < 1500);
    assert.ok(phase(trace, 'streaming_response'), 'the writes before the hang-up are in the trace');
    assert.equal(moved(before, after, 'conduit_requests_total', { model, tenant: 'main', finish_reason: 'abort' }), 1);
    assert.equal(moved(before, after, 'conduit_request_cancellations_total', { model, tenant: 'main', phase: 'decode_execution' }), 1);
    assert.equal(moved(before, after, 'conduit_request_duration_milliseconds_count', { model, outcome: 'abort' }), 1);
    assert.equal(moved(before, after, 'conduit_request_errors_total'), 0, 'a hang-up is not an error');

    // Without a stream the client never sees the id: the bus names the one request that started.
    const seen = new Set(server.terminals.keys());
    const req = httpRequest(new URL('/v1/completions', server.url), { method: 'POST', headers: { ...auth(), 'Content-Type': 'application/json' } });
    req.on('error', () => {});
    req.end(JSON.stringify({ model, prompt: 'A long story', max_tokens: 1500, ignore_eos: true }));
    await waitFor(() => server.engine.stats().numRunning > 0, 'the request to start');
    req.destroy();
    await waitFor(() => server.terminals.size > seen.size, 'the request to end');
    const [quietId] = [...server.terminals.keys()].filter((id) => !seen.has(id));
    assert.deepEqual(server.terminals.get(quietId!), ['abort']);
    const quiet = await traceOf(server.url, quietId!);
    assert.equal(quiet.outcome, 'abort');
    assert.ok(['prefill_execution', 'decode_execution'].includes(quiet.ended_in_phase!), String(quiet.ended_in_phase));
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
  });

  it('refusals at each check are counted and traced where they happened, and stay out of the error-rate SLO', LIVE, async () => {
    const before = (await scrape(server.url)).exposition;
    const sloBefore = server.telemetry.sloReport().models.find((m) => m.model === model)?.error_rate.errors ?? 0;

    const invalid = await post({ model, prompt: 'x', max_tokens: -1 });
    const tooLong = await post({ model, prompt: Array.from({ length: server.engine.info.maxModelLen }, () => 500), max_tokens: 1 });
    const badKey = await post({ model, prompt: 'x' }, 'sk-not-a-key-000000');
    const firstOfLimited = await post({ model, prompt: 'x', max_tokens: 1 }, LIMITED_KEY);
    const overLimit = await post({ model, prompt: 'x', max_tokens: 1 }, LIMITED_KEY);
    const long = await openCompletionStream(server.url, { model, prompt: 'Go on', max_tokens: 1500, ignore_eos: true }, { key: SOLO_KEY });
    const overConcurrency = await post({ model, prompt: 'me too', max_tokens: 1 }, SOLO_KEY);
    long.hangUp();
    const tooBig = await rawRequest(server.url, { path: '/v1/completions', headers: auth(), body: Buffer.alloc(5 * 1024 * 1024, 0x61) });
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
    await endedTrace(server.url, long.id);

    assert.deepEqual([invalid, tooLong, badKey, firstOfLimited, overLimit, overConcurrency, tooBig].map((r) => r.status), [400, 400, 401, 200, 429, 429, 413]);
    const expected: [RawResponse, string, string][] = [
      [invalid, 'invalid_value', 'validate'],
      // Refused by its length once tokenized, before any router.
      [tooLong, 'context_length_exceeded', 'tokenize'],
      [overLimit, 'rate_limit_exceeded', 'rate_limit'],
      [overConcurrency, 'concurrency_limit_exceeded', 'rate_limit'],
      [tooBig, 'body_too_large', 'http_receive'],
    ];
    for (const [res, errorType, endedIn] of expected) {
      const id = String(res.headers['x-request-id']);
      assert.match(id, /^cmpl-/, 'a refused request is named too');
      // Several tenants' (and a request refused before its tenant was known): the admin key sees them all.
      const trace = await traceOf(server.url, id, ADMIN_KEY);
      assert.equal(trace.outcome, 'error', id);
      assert.equal(trace.error_type, errorType);
      assert.equal(trace.status, res.status);
      assert.equal(trace.ended_in_phase, endedIn, `${errorType} ended in ${endedIn}`);
      assert.equal(names(trace)[0], 'http_receive', 'its trace starts at arrival');
      if (res === tooBig) assert.equal(trace.phases[0]!.attributes?.ok, false, 'its body was not received');
    }

    // Refused for its key: counted below, but no trace kept (anyone can send these; a flood would evict the tenants').
    const badKeyTrace = await rawRequest(server.url, { path: `/v1/requests/${String(badKey.headers['x-request-id'])}/trace`, headers: auth(ADMIN_KEY) });
    assert.equal(badKeyTrace.status, 404);

    const after = (await scrape(server.url)).exposition;
    const errors = (errorType: string) => moved(before, after, 'conduit_request_errors_total', { model, error_type: errorType, origin: 'client' });
    assert.deepEqual(['invalid_value', 'context_length_exceeded', 'invalid_api_key', 'rate_limit_exceeded', 'concurrency_limit_exceeded', 'body_too_large'].map(errors),
      [1, 1, 1, 1, 1, 1]);
    assert.equal(moved(before, after, 'conduit_request_errors_total', { origin: 'server' }), 0);
    assert.equal(moved(before, after, 'conduit_rate_limit_rejections_total', { tenant: 'limited', reason: 'requests' }), 1);
    assert.equal(moved(before, after, 'conduit_rate_limit_rejections_total', { tenant: 'solo', reason: 'concurrency' }), 1);
    assert.equal(moved(before, after, 'conduit_requests_total', { finish_reason: 'error' }), 6);
    const sloAfter = server.telemetry.sloReport().models.find((m) => m.model === model)!.error_rate.errors;
    assert.equal(sloAfter, sloBefore, 'a client\'s error is not the server\'s');
  });

  it('continues the client\'s traceparent: the request\'s spans join the client\'s trace under its span', LIVE, async () => {
    const clientTrace = '4bf92f3577b34da6a3ce929d0e0e4736';
    const clientSpan = '00f067aa0ba902b7';
    const tracestate = 'vendor1=opaque,vendor2=x:y';
    const res = await post({ model, prompt: 'Follow the trace', max_tokens: 3, temperature: 0 }, KEY,
      { traceparent: `00-${clientTrace}-${clientSpan}-01`, tracestate });
    assert.equal(res.status, 200, res.text);
    const id = res.json().id;
    const trace = await traceOf(server.url, id);
    assert.equal(trace.trace_id, clientTrace);
    // The response names the context the request ran under (its root span), and passes the client's tracestate on.
    assert.equal(res.headers.traceparent, trace.traceparent);
    assert.equal(res.headers.tracestate, tracestate);
    assert.equal((trace as unknown as { tracestate: string }).tracestate, tracestate);
    const [, traceId, rootSpanId, flags] = trace.traceparent!.split('-');
    assert.equal(traceId, clientTrace);
    assert.equal(flags, '01', 'the client sampled it, so the request is traced');
    await waitFor(() => server.exporter.getFinishedSpans().some((s) => s.attributes['request.id'] === id), 'the spans to be exported');
    const spans = server.exporter.getFinishedSpans().filter((s) => s.spanContext().traceId === clientTrace);
    const root = spans.find((s) => s.name === 'request')!;
    assert.equal(root.attributes['request.id'], id);
    assert.equal(root.parentSpanContext?.spanId, clientSpan, 'the root span is the client\'s span\'s child');
    assert.equal(root.parentSpanContext?.traceState?.serialize(), tracestate, 'the client\'s tracestate goes with its context');
    assert.equal(root.spanContext().spanId, rootSpanId, 'the traceparent handed out at arrival names the root span');
    const spanNames = new Set(spans.map((s) => s.name));
    for (const name of ['gateway', 'http_receive', 'tokenize', 'scheduling', 'prefill', 'decode']) assert.ok(spanNames.has(name), name);
    assert.equal(root.attributes['request.prompt_tokens'], res.json().usage.prompt_tokens);
  });

  it('serves the trace, SLO and analysis endpoints behind the API key, with OpenAI-shaped errors', LIVE, async () => {
    const res = await post({ model, prompt: 'One more', max_tokens: 2 });
    const id = res.json().id;
    await waitFor(() => server.telemetry.inFlight === 0, 'the request to end');
    // Only generation requests are traced: reading traces, SLOs and analyses adds none.
    const traced = server.terminals.size;
    assert.equal((await rawRequest(server.url, { path: `/v1/requests/${id}/trace` })).status, 401);
    const unknown = await rawRequest(server.url, { path: '/v1/requests/cmpl-nothing-like-this/trace', headers: auth() });
    assert.equal(unknown.status, 404);
    assert.equal(unknown.json().error.code, 'trace_not_found');
    assert.equal(unknown.json().error.type, 'invalid_request_error');
    assert.match(unknown.json().error.message, /cmpl-nothing-like-this/);

    // Server-wide reports are for the admin key; a tenant's key gets a 403.
    assert.equal((await rawRequest(server.url, { path: '/v1/slo', headers: auth() })).status, 403);
    const slo = (await rawRequest(server.url, { path: '/v1/slo', headers: auth(ADMIN_KEY) })).json();
    const mine = slo.models.find((m: { model: string }) => m.model === model);
    assert.ok(mine.ttft.samples >= 1 && mine.error_rate.requests >= 1);
    assert.equal(slo.window_ms, 300_000);
    const analysis = (await rawRequest(server.url, { path: '/v1/analysis', headers: auth(ADMIN_KEY) })).json();
    assert.ok(analysis.requests >= 1);
    assert.equal(typeof analysis.phase_share.prefill, 'number');
    assert.equal((await rawRequest(server.url, { path: '/v1/slo' })).status, 401);
    assert.equal(server.terminals.size, traced);
  });
});

describe('telemetry on a live server: a request timing out mid-stream', () => {
  let server: LiveServer;
  let model: string;

  before(async () => {
    server = await startLiveServer({ requestTimeoutMs: 1000 });
    model = server.api.gateway.servedModelName!;
  });

  after(async () => {
    await server?.close();
  });

  const sloErrors = (): number => server.telemetry.sloReport().models.find((m) => m.model === model)?.error_rate.errors ?? 0;

  it('is a server error: counted, in the error-rate SLO, traced with its spans kept', LIVE, async () => {
    const before = (await scrape(server.url)).exposition;
    const sloBefore = sloErrors();
    const res = await rawRequest(server.url, {
      path: '/v1/completions', body: { model, prompt: 'Never ending', max_tokens: 2040, ignore_eos: true, stream: true },
    });
    const events = parseSse(res.text);
    assert.equal(JSON.parse(events.at(-2)!.data).error.code, 'request_timeout');
    const id = String(res.headers['x-request-id']);
    const trace = await traceOf(server.url, id, 'unused');
    assert.equal(trace.outcome, 'error');
    assert.equal(trace.error_type, 'request_timeout');
    assert.equal(trace.status, 504, 'the status the error stands for, though the stream had begun with 200');
    assert.equal(trace.ended_in_phase, 'decode_execution');
    const after = (await scrape(server.url)).exposition;
    assert.equal(moved(before, after, 'conduit_request_errors_total', { model, error_type: 'request_timeout', origin: 'server' }), 1);
    assert.equal(sloErrors(), sloBefore + 1);
    // Server errors are always kept by the tail sampler, whatever the head decided.
    await waitFor(() => server.exporter.getFinishedSpans().some((s) => s.name === 'request' && s.attributes['request.id'] === id), 'spans');
    const root = server.exporter.getFinishedSpans().find((s) => s.name === 'request' && s.attributes['request.id'] === id)!;
    assert.equal(root.status.code, SpanStatusCode.ERROR);
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
    assert.deepEqual(server.terminals.get(id), ['error']);
  });

  it('a request the server\'s shutdown cuts short is an abort, not an error', LIVE, async () => {
    const sloBefore = sloErrors();
    const streamed = rawRequest(server.url, {
      path: '/v1/completions', body: { model, prompt: 'Last words', max_tokens: 1900, ignore_eos: true, stream: true },
    });
    await waitFor(() => server.engine.stats().numRunning === 1, 'the stream to start');
    await server.api.shutdown(0);
    const res = await streamed;
    assert.equal(JSON.parse(parseSse(res.text).at(-2)!.data).error.code, 'shutting_down');
    const id = String(res.headers['x-request-id']);
    assert.deepEqual(server.terminals.get(id), ['abort']);
    const trace = server.telemetry.trace(id)!;
    assert.equal(trace.outcome, 'abort');
    assert.equal(trace.abortReason, 'shutdown');
    assert.equal(sloErrors(), sloBefore, 'a shutdown does not count against the SLO');
  });
});

describe('telemetry on a live server: disaggregated prefill and decode', () => {
  let server: LiveServer;
  let model: string;

  before(async () => {
    server = await startLiveServer({ disaggregated: { prefillWorkers: 1, decodeWorkers: 1 } });
    model = server.api.gateway.servedModelName!;
  });

  after(async () => {
    await server?.close();
  });

  it('traces the prompt on the prefill worker, the KV moving, and decode on the decode worker', LIVE, async () => {
    const before = (await scrape(server.url)).exposition;
    const clientTrace = '0af7651916cd43dd8448eb211c80319c';
    const res = await rawRequest(server.url, {
      path: '/v1/completions', headers: { traceparent: `00-${clientTrace}-b7ad6b7169203331-01` },
      body: { model, prompt: longPrompt(), max_tokens: 4, temperature: 0, ignore_eos: true },
    });
    assert.equal(res.status, 200, res.text);
    const body = res.json();
    const trace = await traceOf(server.url, body.id, 'unused');
    const after = (await scrape(server.url)).exposition;

    assert.equal(trace.worker, 'decode-0');
    assert.equal(phase(trace, 'router_lookup')!.worker, 'decode-0');
    assert.equal(phase(trace, 'scheduler_queue')!.worker, 'prefill-0', 'queued on the prefill worker');
    const chunks = trace.phases.filter((p) => p.phase === 'prefill_execution');
    assert.ok(chunks.length > 0 && chunks.every((c) => c.worker === 'prefill-0'), 'the prompt ran on the prefill worker');
    assert.equal(prefillTokens(trace), body.usage.prompt_tokens, 'and only there');
    const transfer = phase(trace, 'kv_transfer')!;
    assert.ok(transfer, names(trace).join(','));
    assert.equal(transfer.attributes!.from_worker, 'prefill-0');
    assert.equal(transfer.attributes!.to_worker, 'decode-0');
    assert.ok(Number(transfer.attributes!.blocks) > 0 && Number(transfer.attributes!.bytes) > 0);
    assert.ok(transfer.start_ms >= chunks.at(-1)!.start_ms + chunks.at(-1)!.duration_ms - ROUNDING, 'after the prompt was computed');
    assert.equal(body.timings.kv_transfer_ms, transfer.duration_ms);
    assert.equal(transfer.attributes!.link, 'shm', 'the workers share memory: one process');
    assert.equal(body.timings.kv_transfer.link, 'shm');
    assert.equal(body.timings.kv_transfer.bytes, transfer.attributes!.bytes);
    assert.deepEqual(withoutTotal(body.timings), withoutTotal(trace.timings));

    assert.equal(moved(before, after, 'conduit_kv_transfer_bytes_total', { worker: 'decode-0' }), transfer.attributes!.bytes);
    assert.equal(moved(before, after, 'conduit_kv_transfer_duration_milliseconds_count', { worker: 'decode-0', link: 'shm' }), 1);
    assert.equal(moved(before, after, 'conduit_kv_transfer_blocks_total', { worker: 'decode-0', link: 'shm' }), transfer.attributes!.blocks);
    assert.equal(moved(before, after, 'conduit_request_prompt_tokens_total', { worker: 'decode-0' }), body.usage.prompt_tokens);
    for (const worker of ['prefill-0', 'decode-0']) {
      assert.notEqual(value(after, 'conduit_running_batch_size', { model, worker }), undefined, `${worker} reports its load`);
    }

    // The client sampled it: the spans carry the router's reason, which says where the prompt ran and why.
    await waitFor(() => server.exporter.getFinishedSpans().some((s) => s.name === 'routing' && s.spanContext().traceId === clientTrace), 'spans');
    const routing = server.exporter.getFinishedSpans().find((s) => s.name === 'routing' && s.spanContext().traceId === clientTrace)!;
    assert.match(String(routing.attributes['routing.selection_reason']), /prefill disaggregated \(remote-prefill\)$/);
    assert.ok(server.exporter.getFinishedSpans().some((s) => s.name === 'kv_transfer' && s.spanContext().traceId === clientTrace));
  });
});

// ---------------------------------------------------------------------------------------------------------------
// deploy/: the names the dashboards and alert rules query, against `conduit serve`'s own server

const deploy = fileURLToPath(new URL('../../deploy/', import.meta.url));

/** The PromQL of the dashboards (panel targets, template variables) and of the alert rules (`expr:`, inline or block). */
function deployExpressions(): string[] {
  const out: string[] = [];
  for (const f of readdirSync(join(deploy, 'grafana')).filter((f) => f.endsWith('.json'))) {
    const dashboard = JSON.parse(readFileSync(join(deploy, 'grafana', f), 'utf8')) as {
      panels: { targets?: { expr: string }[] }[]; templating: { list: { definition?: string }[] };
    };
    for (const panel of dashboard.panels) for (const target of panel.targets ?? []) out.push(target.expr);
    for (const variable of dashboard.templating.list) if (variable.definition) out.push(variable.definition);
  }
  for (const f of readdirSync(join(deploy, 'prometheus')).filter((f) => f.endsWith('.yml') && !f.endsWith('.test.yml') && f !== 'prometheus.yml')) {
    const lines = readFileSync(join(deploy, 'prometheus', f), 'utf8').split('\n');
    for (let i = 0; i < lines.length; i++) {
      const m = /^(\s*)(?:- )?expr:\s*(.*)$/.exec(lines[i]!);
      if (!m) continue;
      const block: string[] = [m[2]!];
      while (i + 1 < lines.length && (lines[i + 1]!.trim() === '' || lines[i + 1]!.search(/\S/) > m[1]!.length)) block.push(lines[++i]!);
      out.push(block.join(' '));
    }
  }
  return out;
}

/** Every conduit_* name the dashboards and alert rules query. */
function deployNames(): Set<string> {
  return new Set(deployExpressions().flatMap((expr) => [...expr.matchAll(/\bconduit_[a-zA-Z0-9_:]*/g)].map((m) => m[0])));
}

/** The family a series name belongs to (a histogram's _bucket, _sum and _count are its own). */
function familyOf(series: string, exposition: Exposition): string | undefined {
  if (exposition.types.has(series)) return series;
  const base = series.replace(/_(bucket|sum|count)$/, '');
  return exposition.types.get(base) === 'histogram' ? base : undefined;
}

/** Families a single-model server of routed CPU workers, without OTEL_* variables, has no series in; and why. */
const NO_SERIES_HERE: Record<string, string> = {
  conduit_kv_transfer_duration_milliseconds: 'KV transfer happens in disaggregated serving only',
  conduit_kv_transfer_bytes_total: 'KV transfer happens in disaggregated serving only',
  conduit_kv_transfer_blocks_total: 'KV transfer happens in disaggregated serving only',
  conduit_kv_transfer_failures_total: 'counted only when a decode worker process fails to import a handed-off request\'s KV',
  conduit_kv_transfer_fallbacks_total: 'counted only when a decode worker process fails to import a handed-off request\'s KV',
  conduit_trace_sampling_decisions_total: 'the sampler decides only when tracing is configured',
  conduit_slow_request_bottlenecks_total: 'counted only for requests over the SLO targets',
  conduit_kv_onboard_duration_milliseconds: 'observed only for a request whose prefix came back from a lower KV tier',
};

describe('`conduit serve`\'s server, two workers behind the KV router', () => {
  let server: TestServer;
  let model: string;

  before(async () => {
    // With a RAM tier under each pool, so the tier families have series (ram) from the first stats on.
    server = await startTestServer({ flags: ['--workers', '2', '--kv-offload-memory', '16MiB'], keysFile: `${KEY} main\n${LIMITED_KEY} limited 1\n` });
    model = server.running.api.gateway.servedModelName!;
  });

  after(async () => {
    await server?.close();
  });

  it('traces the router\'s decision, and sends the warm request where its prefix is cached', LIVE, async () => {
    const { prompt } = await longPromptOffBlockBoundary(server.url, model, server.engine.info.blockSize);
    const ask = { model, prompt, max_tokens: 2, temperature: 0 };
    // No wait between the two: the cold prompt's blocks reach the router's index with the worker's outputs that
    // computed them (the KV events travel in the same message, applied before the outputs are read), so they are
    // indexed before the cold response ends; the warm request is routed on that, not on luck.
    const cold = (await rawRequest(server.url, { path: '/v1/completions', headers: auth(), body: ask })).json();
    const warm = (await rawRequest(server.url, { path: '/v1/completions', headers: auth(), body: ask })).json();
    const coldTrace = await traceOf(server.url, cold.id);
    const warmTrace = await traceOf(server.url, warm.id);
    for (const trace of [coldTrace, warmTrace]) {
      assert.match(names(trace).join(','), /^http_receive,auth,rate_limit,validate,tokenize,(prefill_dispatch,)?router_lookup,(prefill_dispatch,)?scheduler_queue,(prefill_execution,)+decode_execution(,streaming_response)?$/);
      assert.match(trace.worker!, /^worker-[01]$/);
      assert.equal(phase(trace, 'router_lookup')!.worker, trace.worker);
      assert.equal(phase(trace, 'router_lookup')!.attributes!.candidates, 2, 'the router chose among both workers');
    }
    assert.equal(warmTrace.worker, coldTrace.worker, 'KV-aware routing sends the repeat to the worker holding its blocks');
    assert.equal(phase(coldTrace, 'router_lookup')!.attributes!.kv_cache_hit, false);
    assert.equal(phase(warmTrace, 'router_lookup')!.attributes!.kv_cache_hit, true);
    assert.equal(phase(warmTrace, 'router_lookup')!.attributes!.overlap_tokens, warm.usage.prompt_tokens_details.cached_tokens);
    // Why that worker: both workers' cost terms, cheapest first, the holder first with the overlap the router counted.
    const costs = String(phase(warmTrace, 'router_lookup')!.attributes!.worker_costs).split('; ');
    assert.equal(costs.length, 2, `both workers weighed: ${costs.join('; ')}`);
    const [first, second] = costs.map((c) => c.match(/^(worker-[01]) ([\d.]+) \(overlap (\d+), prefill (\d+), decode (\d+)\)$/)!);
    assert.ok(first && second, `cost terms: ${costs.join('; ')}`);
    assert.equal(first[1], warmTrace.worker, 'the chosen worker is the cheapest');
    assert.equal(Number(first[3]) * server.engine.info.blockSize, warm.usage.prompt_tokens_details.cached_tokens);
    assert.equal(Number(second[3]), 0, 'the other worker holds none of the prompt');
    assert.ok(Number(first[2]) < Number(second[2]), `the holder costs less: ${costs.join('; ')}`);
    assert.ok(Number(first[4]) < Number(second[4]), 'it has fewer prompt tokens to compute');
    assert.match(String(phase(warmTrace, 'router_lookup')!.attributes!.reason), /lowest cost/);
    assert.ok(warm.timings.routing_ms > 0);
    const { exposition } = await scrape(server.url);
    assert.ok(total(exposition, 'conduit_routing_duration_milliseconds_count') >= 2);
    assert.ok((value(exposition, 'conduit_request_cached_tokens_total', { model, worker: warmTrace.worker!, tenant: 'main' }) ?? 0) > 0,
      'token counters carry the worker the router chose');
  });

  it('exports every metric name the dashboards and alert rules query', LIVE, async () => {
    // Traffic of every kind: finished, streamed, hung up, refused, rate limited.
    await rawRequest(server.url, { path: '/v1/completions', headers: auth(), body: { model, prompt: 'Hello', max_tokens: 3, stream: true } });
    await rawRequest(server.url, { path: '/v1/completions', headers: auth(), body: { model, prompt: 'x', max_tokens: -1 } });
    for (let i = 0; i < 2; i++) {
      await rawRequest(server.url, { path: '/v1/completions', headers: auth(LIMITED_KEY), body: { model, prompt: 'x', max_tokens: 1 } });
    }
    const stream = await openCompletionStream(server.url, { model, prompt: 'Keep going', max_tokens: 1500, ignore_eos: true }, { key: KEY, events: 3 });
    stream.hangUp();
    await endedTrace(server.url, stream.id);
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');

    const { text, exposition } = await scrape(server.url);
    assertValidExposition(text);
    const used = deployNames();
    assert.ok(used.size > 20, `${used.size} names in deploy/`);
    const missing = [...used].filter((name) => familyOf(name, exposition) === undefined);
    assert.deepEqual(missing, [], 'names queried in deploy/ that the live server does not export');
    const withoutSeries = [...used].filter((name) => !exposition.samples.some((s) => s.name === name));
    const unexplained = withoutSeries.filter((name) => NO_SERIES_HERE[familyOf(name, exposition)!] === undefined);
    assert.deepEqual(unexplained, [], 'names queried in deploy/ with no series after traffic of every kind');
    // The exceptions are still exceptions: if one of them gets series here, its entry should go.
    for (const family of Object.keys(NO_SERIES_HERE)) {
      if (family === 'conduit_slow_request_bottlenecks_total') continue; // depends on how fast this machine is
      assert.ok(!exposition.samples.some((s) => familyOf(s.name, exposition) === family), `${family} has series now`);
    }
  });

  // After the test above, the exposition holds series of every kind (finished, streamed, hung up, refused, limited).
  it('promtool accepts the live exposition', LIVE, async (t) => {
    if (!havePromtool()) return t.skip(PROMTOOL_MISSING);
    assertPromtoolAccepts((await scrape(server.url)).text);
  });
});
