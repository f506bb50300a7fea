// A disaggregated request that ends on its prefill worker (max_tokens 1: the prefill worker samples the only token
// and the request never reaches the decode worker the router placed it on): its trace names the prefill worker, for
// the request and for every phase, and so do its metrics. A longer request of the same deployment still names the
// decode worker for what the decode worker did.

import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { moved, scrape } from '../telemetry/integration-fixture.ts';
import { DECODE, disaggregatedLiveServer, LIVE, PREFILL } from '../telemetry/disagg-live-fixture.ts';

describe('a disaggregated request that ends on its prefill worker (simulated prefill and decode workers)', () => {
  const live = disaggregatedLiveServer();

  for (const stream of [true, false]) {
    it(`names the prefill worker for a max_tokens 1 request, in its trace and its metrics (stream: ${stream})`, LIVE, async () => {
      const model = live.model;
      const before = (await scrape(live.url)).exposition;
      const trace = await live.complete(`One token only (${stream}): ${'the tide came in over the flats and the gulls rose, '.repeat(30)}`,
        { maxTokens: 1, stream });
      const after = (await scrape(live.url)).exposition;

      assert.equal(trace.usage.completion_tokens, 1);
      assert.equal(trace.worker, PREFILL, 'the request ran on the prefill worker only');
      const workers = new Set(trace.phases.map((p) => p.worker).filter((w) => w !== undefined));
      assert.deepEqual([...workers], [PREFILL], `phases on ${[...workers].join(', ')}`);
      const on = (phase: string) => trace.phases.filter((p) => p.phase === phase).map((p) => p.worker);
      assert.deepEqual(on('scheduler_queue'), [PREFILL]);
      assert.ok(on('prefill_execution').length > 0);
      assert.deepEqual(on('decode_execution'), [], 'nothing decoded after the first token');
      assert.deepEqual(on('kv_transfer'), [], 'nothing handed over');
      const router = trace.phases.find((p) => p.phase === 'router_lookup')!;
      assert.match(String(router.attributes?.reason), new RegExp(`ended on the prefill worker, before the hand-over to ${DECODE}$`));

      const count = (name: string, worker: string) => moved(before, after, `${name}_count`, { model, worker });
      for (const name of ['conduit_queue_wait_milliseconds', 'conduit_prefill_duration_milliseconds', 'conduit_time_to_first_token_milliseconds',
        'conduit_request_prefix_cache_hit_ratio']) {
        assert.equal(count(name, PREFILL), 1, `${name} on the prefill worker`);
        assert.equal(count(name, DECODE), 0, `${name} not on the decode worker`);
      }
      for (const name of ['conduit_request_prompt_tokens_total', 'conduit_request_generation_tokens_total']) {
        assert.ok(moved(before, after, name, { model, worker: PREFILL }) > 0, `${name} on the prefill worker`);
        assert.equal(moved(before, after, name, { model, worker: DECODE }), 0, `${name} not on the decode worker`);
      }
    });
  }

  it('still names the decode worker for a request handed over to it', LIVE, async () => {
    const trace = await live.complete(`Several tokens: ${'the bell buoy rang twice at each swell off the point, '.repeat(30)}`,
      { maxTokens: 4, stream: true });
    assert.equal(trace.worker, DECODE);
    const on = (phase: string) => trace.phases.filter((p) => p.phase === phase).map((p) => p.worker);
    assert.deepEqual(on('scheduler_queue'), [PREFILL]);
    assert.deepEqual(on('decode_execution'), [DECODE]);
    const router = trace.phases.find((p) => p.phase === 'router_lookup')!;
    assert.doesNotMatch(String(router.attributes?.reason), /ended on the prefill worker/);
  });
});
