// A streaming request whose client leaves before the stream's first byte (here: while the request waits in the
// engine's queue) is the client's leaving: no status line is sent for it, it is counted and logged as a 499 (as a
// non-streaming request that leaves is), not as a 200 stream, and what it held in the engine is given back.

import assert from 'node:assert/strict';
import { connect } from 'node:net';
import { after, describe, it } from 'node:test';
import { startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 180_000 };

async function responses(server: TestServer, route: string, status: number): Promise<number> {
  const text = (await rawRequest(server.url, { path: '/metrics' })).text;
  let sum = 0;
  for (const line of text.split('\n')) {
    if (line.startsWith('conduit_http_responses_total{') && line.includes(`route="${route}"`) && line.includes(`status="${status}"`)) {
      sum += Number(line.slice(line.lastIndexOf(' ') + 1));
    }
  }
  return sum;
}

describe('a stream whose client left before it opened', () => {
  let server: TestServer | undefined;
  after(async () => {
    await server?.close();
  });

  it('is counted as a 499, sends nothing, and gives back its place in the engine', E2E, async () => {
    server = await startTestServer({ flags: ['--max-num-seqs', '1'] });
    const s = server;
    const model = s.running.api.gateway.servedModelName!;
    // The only batch seat is taken by a long request, so the stream waits in the queue for its first output.
    let blockerDone = false;
    const blocker = rawRequest(s.url, { path: '/v1/completions', body: { model, prompt: 'block', max_tokens: 2000, ignore_eos: true } })
      .finally(() => { blockerDone = true; });
    await waitFor(() => s.engine.stats().numRunning === 1, 'the blocker running');
    const before = { gone: await responses(s, 'completions', 499), ok: await responses(s, 'completions', 200) };

    const text = JSON.stringify({ model, prompt: 'a streamed prompt', max_tokens: 10, stream: true });
    const socket = connect(Number(new URL(s.url).port), '127.0.0.1');
    socket.on('error', () => {});
    let received = '';
    socket.on('data', (chunk: Buffer) => { received += chunk.toString('latin1'); });
    socket.write(`POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n`
      + `Content-Length: ${Buffer.byteLength(text)}\r\n\r\n${text}`);
    await waitFor(() => s.engine.stats().numWaiting === 1, 'the stream queued');
    assert.equal(received, '', 'nothing was sent before the first output');
    socket.destroy();

    await waitFor(() => s.engine.stats().numWaiting === 0, 'the stream taken out of the queue');
    await waitFor(() => s.running.api.gateway.activeRunCount === 1, 'only the blocker running');
    assert.equal(blockerDone, false, 'the blocker held the seat all along: the stream never got a step');
    assert.equal(s.engine.stats().numRunning, 1);
    let gone = 0;
    const deadline = Date.now() + 10_000;
    while ((gone = await responses(s, 'completions', 499)) === before.gone && Date.now() < deadline) {
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
    assert.equal(gone, before.gone + 1, 'counted as the client closing the request');
    assert.equal(await responses(s, 'completions', 200), before.ok, 'not counted as a 200');
    await blocker;
  });
});
