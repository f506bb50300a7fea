// A disaggregated request that ends on its prefill worker (max_tokens 1: the prefill worker samples the only token
// and the request never reaches the decode worker the router placed it on): its trace names the prefill worker, for
// the request and for every phase, and so do its metrics. A longer request of the same deployment still names the
// decode worker for what the decode worker did.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { rawRequest } from './http-client.ts';
import { moved, scrape, startLiveServer, type LiveServer } from '../telemetry/integration-fixture.ts';

const LIVE = { timeout: 120_000 };
const PREFILL = 'sim-prefill-0';
const DECODE = 'sim-decode-0';

interface TraceBody {
  worker: string | null;
  usage: { prompt_tokens: number; completion_tokens: number };
  phases: { phase: string; worker?: string; attributes?: Record<string, string | number | boolean> }[];
}

describe('a disaggregated request that ends on its prefill worker (simulated prefill and decode workers)', () => {
  let server: LiveServer;
  let model: string;

  before(async () => {
    // Every prompt is prefilled on the prefill worker (the fixture's policy and fixed estimates).
    server = await startLiveServer({ sim: true, disaggregated: { prefillWorkers: 1, decodeWorkers: 1 } });
    model = server.api.gateway.servedModelName!;
  });

  after(async () => {
    await server?.close();
  });

  async function complete(prompt: string, maxTokens: number, stream: boolean): Promise<TraceBody> {
    const res = await rawRequest(server.url, {
      path: '/v1/completions', body: { model, prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true, stream },
    });
    assert.equal(res.status, 200, res.text);
    const id = res.headers['x-request-id'] as string;
    const deadline = Date.now() + 30_000;
    for (;;) {
      const t = await rawRequest(server.url, { path: `/v1/requests/${id}/trace` });
      if (t.status === 200) return t.json() as TraceBody;
      if (Date.now() > deadline) throw new Error(`no trace of ${id}: ${t.text}`);
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
  }

  for (const stream of [true, false]) {
    it(`names the prefill worker for a max_tokens 1 request, in its trace and its metrics (stream: ${stream})`, LIVE, async () => {
      const before = (await scrape(server.url)).exposition;
      const trace = await complete(`One token only (${stream}): ${'the tide came in over the flats and the gulls rose, '.repeat(30)}`, 1, stream);
      const after = (await scrape(server.url)).exposition;

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
    const trace = await complete(`Several tokens: ${'the bell buoy rang twice at each swell off the point, '.repeat(30)}`, 4, true);
    assert.equal(trace.worker, DECODE);
    const on = (phase: string) => trace.phases.filter((p) => p.phase === phase).map((p) => p.worker);
    assert.deepEqual(on('scheduler_queue'), [PREFILL]);
    assert.deepEqual(on('decode_execution'), [DECODE]);
    const router = trace.phases.find((p) => p.phase === 'router_lookup')!;
    assert.doesNotMatch(String(router.attributes?.reason), /ended on the prefill worker/);
  });
});
