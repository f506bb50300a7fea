// Trace context with tracing off (no exporter): the client's trace id is the request's, in the trace view and on
// the response, and the client's traceparent and tracestate pass on unchanged. With tracing on,
// integration.test.ts checks the same headers name the request's root span.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { rawRequest } from '../api/http-client.ts';
import { startLiveServer, type LiveServer } from './integration-fixture.ts';

const LIVE = { timeout: 60_000 };

describe('trace context with tracing off', () => {
  let server: LiveServer;
  before(async () => {
    server = await startLiveServer({ sim: true, simSpeedUp: 1, telemetry: { tracing: false } });
  });
  after(async () => {
    await server?.close();
  });

  it('keeps the client\'s trace id and passes its traceparent and tracestate on', LIVE, async () => {
    const model = server.api.gateway.servedModelName!;
    const traceparent = '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01';
    const tracestate = 'congo=t61rcWkgMzE';
    for (const stream of [false, true]) {
      const res = await rawRequest(server.url, {
        path: '/v1/completions', headers: { traceparent, tracestate },
        body: { model, prompt: 'trace me', max_tokens: 2, temperature: 0, stream },
      });
      assert.equal(res.status, 200, res.text);
      assert.equal(res.headers.traceparent, traceparent, 'no span of Conduit\'s own: the client\'s context goes on');
      assert.equal(res.headers.tracestate, tracestate);
      const view = (await rawRequest(server.url, { path: `/v1/requests/${res.headers['x-request-id']}/trace` })).json() as Record<string, unknown>;
      assert.equal(view.trace_id, '0af7651916cd43dd8448eb211c80319c');
      assert.equal(view.engine_traceparent, traceparent);
      assert.equal(view.tracestate, tracestate);
      assert.equal(view.traceparent, null, 'no root span of its own');
    }
  });

  it('continues a traceparent of a later version, passed on in version 00 without its extra fields', LIVE, async () => {
    const model = server.api.gateway.servedModelName!;
    const traceId = '0af7651916cd43dd8448eb211c80319c';
    const tracestate = 'congo=t61rcWkgMzE';
    const res = await rawRequest(server.url, {
      path: '/v1/completions', headers: { traceparent: `01-${traceId}-b7ad6b7169203331-03-${'f'.repeat(1000)}`, tracestate },
      body: { model, prompt: 'trace me', max_tokens: 2, temperature: 0 },
    });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.headers.traceparent, `00-${traceId}-b7ad6b7169203331-01`);
    assert.equal(res.headers.tracestate, tracestate);
    const view = (await rawRequest(server.url, { path: `/v1/requests/${res.headers['x-request-id']}/trace` })).json() as Record<string, unknown>;
    assert.equal(view.trace_id, traceId);
    assert.equal(view.engine_traceparent, `00-${traceId}-b7ad6b7169203331-01`);
  });

  it('without a client context: no trace id, no traceparent header', LIVE, async () => {
    const model = server.api.gateway.servedModelName!;
    const res = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: 'untraced', max_tokens: 2, temperature: 0 } });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.headers.traceparent, undefined);
    const view = (await rawRequest(server.url, { path: `/v1/requests/${res.headers['x-request-id']}/trace` })).json() as Record<string, unknown>;
    assert.equal(view.trace_id, null);
  });
});
