import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { summarize } from '../../src/bench/load-generator.ts';
import type { RequestOutcome } from '../../src/bench/client.ts';
import { reportJson } from '../../src/bench/report.ts';
import { SseParser } from '../../src/bench/sse-parser.ts';
import { formatTable } from '../../src/bench/tables.ts';
import { distribution, percentile } from '../../src/util/stats.ts';
import { randomWorkload, sharedPrefixWorkload } from '../../src/bench/prompt-workload.ts';

describe('bench stats', () => {
  it('takes nearest-rank percentiles: always a measured value', () => {
    const sorted = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
    assert.equal(percentile(sorted, 0.5), 5);
    assert.equal(percentile(sorted, 0.9), 9);
    assert.equal(percentile(sorted, 0.99), 10);
    assert.equal(percentile([42], 0.01), 42);
    assert.ok(Number.isNaN(percentile([], 0.5)));
  });

  it('sorts numerically, not as strings', () => {
    const d = distribution([10, 9, 100, 2]);
    assert.deepEqual([d.min, d.p50, d.max, d.count], [2, 9, 100, 4]);
    assert.equal(d.mean, 30.25);
  });

  it('aligns labels left and numbers right', () => {
    const text = formatTable(['name', 'ms'], [['ttft', '1.50'], ['end-to-end', '12.00']]);
    assert.deepEqual(text.split('\n'), ['name           ms', '----------  -----', 'ttft         1.50', 'end-to-end  12.00']);
  });
});

describe('SSE parser', () => {
  const stream = 'data: {"a":1}\n\nevent: error\ndata: {"error":{}}\n\n: a comment\n\ndata: [DONE]\n\n';

  it('gives the same events however the bytes are split', () => {
    const whole = new SseParser().push(stream);
    assert.deepEqual(whole, [
      { event: 'message', data: '{"a":1}' }, { event: 'error', data: '{"error":{}}' }, { event: 'message', data: '[DONE]' },
    ]);
    for (let cut = 1; cut < stream.length; cut++) {
      const parser = new SseParser();
      const events = [...parser.push(stream.slice(0, cut)), ...parser.push(stream.slice(cut))];
      assert.deepEqual(events, whole, `split at ${cut}`);
    }
    const byChar = new SseParser();
    assert.deepEqual([...stream].flatMap((c) => byChar.push(c)), whole);
  });

  it('accepts CRLF line endings and multi-line data, and holds an unfinished event back', () => {
    const parser = new SseParser();
    assert.deepEqual(parser.push('data: one\r\ndata: two\r\n\r\ndata: part'), [{ event: 'message', data: 'one\ntwo' }]);
    assert.equal(parser.pending, 'data: part');
  });
});

describe('bench workloads', () => {
  it('random prompts have the asked length and differ from one request to the next', () => {
    const w = randomWorkload({ promptTokens: 50, seed: 7 });
    assert.equal(w.prompt(0).user.split(' ').length, 50);
    assert.notEqual(w.prompt(0).user, w.prompt(1).user);
    assert.equal(w.prompt(3).user, randomWorkload({ promptTokens: 50, seed: 7 }).prompt(3).user, 'same seed, same prompt');
    assert.notEqual(w.prompt(3).user, randomWorkload({ promptTokens: 50, seed: 8 }).prompt(3).user);
  });

  it('shared-prefix requests of a group share its system prompt and nothing else', () => {
    const w = sharedPrefixWorkload({ groups: 3, systemPromptTokens: 100, questionTokens: 10, seed: 1 });
    const prompts = Array.from({ length: 60 }, (_, i) => w.prompt(i));
    const systems = new Map<number, string>();
    for (const p of prompts) {
      assert.ok(p.group !== undefined && p.group >= 0 && p.group < 3);
      const seen = systems.get(p.group);
      if (seen === undefined) systems.set(p.group, p.system!);
      else assert.equal(p.system, seen, 'one system prompt per group');
      assert.equal(p.user.split(' ').length, 10);
    }
    assert.equal(systems.size, 3, 'every group drawn in 60 requests');
    assert.equal(new Set(systems.values()).size, 3, 'groups have distinct system prompts');
    const words = [...systems.values()].map((s) => s.split(' '));
    assert.notEqual(words[0]![1], words[1]![1], 'distinct from their first words on');
    assert.equal(new Set(prompts.map((p) => p.user)).size, 60, 'questions are fresh');
  });

  it('refuses impossible sizes', () => {
    assert.throws(() => randomWorkload({ promptTokens: 0, seed: 1 }), /promptTokens/);
    assert.throws(() => sharedPrefixWorkload({ groups: 0, systemPromptTokens: 1, questionTokens: 1, seed: 1 }), /groups/);
  });
});

describe('bench summary', () => {
  const outcome = (index: number, fields: Partial<RequestOutcome>): RequestOutcome => ({
    index, startMs: 0, endMs: 0, ok: true, status: 200, itlMs: [], e2eMs: 0, completionTokens: 0, ...fields,
  });

  it('counts successes, errors by kind, tokens and the cached share of prompts', () => {
    const summary = summarize([
      outcome(0, { startMs: 0, endMs: 1000, e2eMs: 1000, ttftMs: 100, itlMs: [10, 20], completionTokens: 3, promptTokens: 100, cachedTokens: 0 }),
      outcome(1, { startMs: 500, endMs: 2000, e2eMs: 1500, ttftMs: 50, itlMs: [30], completionTokens: 2, promptTokens: 100, cachedTokens: 80 }),
      outcome(2, { ok: false, status: 503, error: 'http 503 overloaded', startMs: 600, endMs: 610, e2eMs: 10 }),
      outcome(3, { ok: false, status: 0, error: 'timeout', startMs: 700, endMs: 1700, e2eMs: 1000 }),
    ]);
    assert.equal(summary.numRequests, 4);
    assert.equal(summary.numOk, 2);
    assert.deepEqual(summary.errors, { 'http 503 overloaded': 1, timeout: 1 });
    assert.equal(summary.durationSec, 2);
    assert.equal(summary.requestsPerSec, 1);
    assert.equal(summary.outputTokensPerSec, 2.5);
    assert.equal(summary.cachedPromptFraction, 0.4);
    assert.equal(summary.meanPromptTokens, 100);
    assert.deepEqual([summary.ttftMs.count, summary.itlMs.count, summary.e2eMs.count], [2, 3, 2], 'failed requests have no latencies');
    assert.equal(summary.e2eMs.max, 1500);
  });

  it('writes JSON without NaN: an empty distribution reads null', () => {
    const summary = summarize([]);
    const json = JSON.parse(reportJson({
      url: 'http://127.0.0.1:1', endpoint: 'chat', stream: false, workload: 'w', outputTokens: 1,
      mode: { kind: 'closed', concurrency: 1 }, bounds: { requests: 1 }, startedAt: '', summary, requests: [],
    })) as { summary: { ttftMs: { p50: unknown } }; requests?: unknown };
    assert.equal(json.summary.ttftMs.p50, null);
    assert.equal(json.requests, undefined, 'per-request outcomes only when asked');
  });
});
