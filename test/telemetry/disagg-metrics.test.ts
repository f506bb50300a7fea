// /metrics of a disaggregated request, on a live server with simulated prefill and decode workers: each per-request
// measurement is filed under the worker that did that part (the trace's phases say which), and a prompt's
// prefix-cache lookup counts once, on the worker that prefilled it.

import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { DECODE, disaggregatedLiveServer, LIVE, PREFILL } from './disagg-live-fixture.ts';
import { moved, scrape } from './integration-fixture.ts';

describe('metrics of a disaggregated request (simulated prefill and decode workers)', () => {
  const live = disaggregatedLiveServer();
  const complete = (prompt: string) => live.complete(prompt, { maxTokens: 6, stream: true });

  it('files queue wait, prefill, TTFT and the prefix hit ratio under the prefill worker, decode and TBT under the decode worker', LIVE, async () => {
    const model = live.model;
    const before = (await scrape(live.url)).exposition;
    const trace = await complete(`A cold prompt: ${'the tide came in over the flats and the gulls rose, '.repeat(30)}`);
    const after = (await scrape(live.url)).exposition;

    assert.equal(trace.worker, DECODE, 'the router placed it on the decode worker');
    const on = (phase: string) => trace.phases.filter((p) => p.phase === phase).map((p) => p.worker);
    assert.deepEqual(on('scheduler_queue'), [PREFILL]);
    assert.ok(on('prefill_execution').length > 0 && on('prefill_execution').every((w) => w === PREFILL));
    assert.deepEqual(on('decode_execution'), [DECODE]);

    const count = (name: string, worker: string) => moved(before, after, `${name}_count`, { model, worker });
    for (const name of ['conduit_queue_wait_milliseconds', 'conduit_prefill_duration_milliseconds', 'conduit_time_to_first_token_milliseconds',
      'conduit_request_prefix_cache_hit_ratio']) {
      assert.equal(count(name, PREFILL), 1, `${name} on the prefill worker`);
      assert.equal(count(name, DECODE), 0, `${name} not on the decode worker`);
    }
    assert.equal(count('conduit_decode_duration_milliseconds', DECODE), 1);
    assert.equal(count('conduit_decode_duration_milliseconds', PREFILL), 0);
    assert.equal(count('conduit_time_between_tokens_milliseconds', DECODE), 5, 'six streamed tokens, five gaps');
    assert.equal(count('conduit_time_between_tokens_milliseconds', PREFILL), 0);
    // The request's token counters stay with the request's worker.
    assert.equal(moved(before, after, 'conduit_request_prompt_tokens_total', { model, worker: DECODE }), trace.usage.prompt_tokens);
  });

  it('counts a prompt\'s prefix-cache lookup once, on the prefill worker, even when the decode worker holds the prefix', LIVE, async () => {
    const prompt = `A prompt sent twice: ${'the bell buoy rang twice at each swell off the point, '.repeat(30)}`;
    const before = (await scrape(live.url)).exposition;
    const first = await complete(prompt);
    const middle = (await scrape(live.url)).exposition;
    const second = await complete(prompt);
    const after = (await scrape(live.url)).exposition;
    const tokens = first.usage.prompt_tokens;

    const queried = (from: typeof before, to: typeof before, worker: string) => moved(from, to, 'conduit_prefix_cache_query_tokens_total', { worker });
    const hits = (from: typeof before, to: typeof before, worker: string) => moved(from, to, 'conduit_prefix_cache_hit_tokens_total', { worker });
    assert.equal(queried(before, middle, PREFILL), tokens, 'the prompt was looked up where it was prefilled');
    assert.equal(queried(before, middle, DECODE), 0, 'the decode worker took its KV: no lookup for a prefill there');
    // Again: the prefill worker's cache serves it; the decode worker reuses the blocks it took the first time instead
    // of moving them again, which is no prefix-cache query either.
    assert.ok(second.usage.cached_tokens > 0);
    assert.equal(queried(middle, after, PREFILL), tokens);
    assert.equal(hits(middle, after, PREFILL), second.usage.cached_tokens);
    assert.equal(queried(middle, after, DECODE), 0);
    assert.equal(hits(middle, after, DECODE), 0);
    const transfer = second.phases.find((p) => p.phase === 'kv_transfer');
    assert.ok(transfer, 'handed over again');
    const firstTransfer = first.phases.find((p) => p.phase === 'kv_transfer')!;
    assert.ok(Number(transfer.attributes!.blocks) < Number(firstTransfer.attributes!.blocks),
      `fewer blocks moved the second time (${transfer.attributes!.blocks} < ${firstTransfer.attributes!.blocks}): the decode worker held them`);
  });
});
