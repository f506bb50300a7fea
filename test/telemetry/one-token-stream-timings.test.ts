// A stream whose only content chunk is its last (max_tokens 1 on /v1/completions, no usage chunk): that chunk
// carries the first token and the response's timings together. Its TTFT is the write that carries the token, as the
// finished trace, the TTFT histogram and the SLO report count it, not the engine's first token: before, the body
// said the engine's time and the metrics the write's, and the difference went to decode_ms in the body only.
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { rawRequest } from '../api/http-client.ts';
import { startLiveServer, type LiveServer } from './integration-fixture.ts';

interface Timings { ttft_ms: number; total_ms: number; prefill_ms: number; decode_ms: number }

async function traceOf(url: string, id: string): Promise<{ timings: Timings; phases: { phase: string; start_ms: number; duration_ms: number }[] }> {
  // The trace is stored when the request's finish event is handled, just after its last byte.
  const deadline = Date.now() + 10_000;
  for (;;) {
    const res = await rawRequest(url, { path: `/v1/requests/${encodeURIComponent(id)}/trace` });
    if (res.status === 200 || Date.now() > deadline) {
      assert.equal(res.status, 200, res.text.slice(0, 300));
      return res.json() as never;
    }
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

describe('timings of a stream whose first token goes out with its last chunk', () => {
  let server: LiveServer;
  before(async () => {
    server = await startLiveServer();
  });
  after(async () => {
    await server?.close();
  });

  it('give the write as TTFT, after the engine sampled the token, as the trace does', async () => {
    const model = server.api.gateway.servedModelName!;
    const res = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: 'Hi', max_tokens: 1, stream: true } });
    assert.equal(res.status, 200, res.text.slice(0, 300));
    const chunks = res.text.split('\n').filter((l) => l.startsWith('data: {')).map((l) => JSON.parse(l.slice(6)) as { timings?: Timings });
    assert.equal(chunks.length, 1, 'one chunk: the token, the finish reason and the timings');
    const body = chunks[0]!.timings!;
    assert.ok(body, 'the last chunk carries timings');

    const view = await traceOf(server.url, res.headers['x-request-id'] as string);
    const prefill = view.phases.find((p) => p.phase === 'prefill_execution')!;
    const engineFirstTokenMs = prefill.start_ms + prefill.duration_ms;
    // The chunk is built after the engine's token reached the gateway: its TTFT cannot be the engine's own stamp.
    assert.ok(body.ttft_ms > engineFirstTokenMs + 0.002,
      `body TTFT ${body.ttft_ms} ms is the engine's first token (${engineFirstTokenMs} ms), not the write`);
    // The write that carried the token is stamped once it went out, just after the timings were taken.
    assert.ok(view.timings.ttft_ms >= body.ttft_ms, `trace TTFT ${view.timings.ttft_ms} before the body's ${body.ttft_ms}`);
    assert.ok(body.decode_ms <= 0.001, `nothing after the first token before the last chunk: decode_ms ${body.decode_ms}`);
  });
});
