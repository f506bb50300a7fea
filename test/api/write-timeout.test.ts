// A client that opens a stream and stops reading (its connection open, its buffers full) is closed after
// --write-timeout: its request is aborted and the sequences it held under --max-pending-requests are given back, so
// it cannot keep every other client at 503. With --write-timeout 0 the server waits for it for ever.

import assert from 'node:assert/strict';
import { connect, type Socket } from 'node:net';
import { after, describe, it } from 'node:test';
import { startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 120_000 };

/** A stream of 8 completions with 20 logprobs per token: megabytes of events, more than the socket buffers hold. */
const BODY = JSON.stringify({ prompt: 'Once upon a time', max_tokens: 1200, n: 8, stream: true, ignore_eos: true, logprobs: 20 });

/** Opens the stream and stops reading after its first bytes; resolves with the socket and whether it was closed. */
function stalledStream(server: TestServer): Promise<{ socket: Socket; closed: Promise<void> }> {
  const { port } = new URL(server.url);
  const socket = connect(Number(port), '127.0.0.1');
  const closed = new Promise<void>((resolve) => socket.once('close', () => resolve()));
  socket.on('error', () => {});
  socket.write(`POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(BODY)}\r\n\r\n${BODY}`);
  return new Promise((resolve) => socket.once('data', () => {
    socket.pause();
    resolve({ socket, closed });
  }));
}

async function until(check: () => Promise<boolean>, what: string, timeoutMs = 60_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
}

async function overloaded(server: TestServer): Promise<boolean> {
  const response = await rawRequest(server.url, { path: '/v1/completions', body: { prompt: 'Hi', max_tokens: 1 } });
  return response.status === 503;
}

describe('--write-timeout', () => {
  const servers: TestServer[] = [];
  after(async () => {
    for (const server of servers) await server.close();
  });

  it('a stream whose client stopped reading is closed, and its pending sequences given back', E2E, async () => {
    const server = await startTestServer({ flags: ['--write-timeout', '1', '--max-pending-requests', '8'] });
    servers.push(server);
    const { socket, closed } = await stalledStream(server);
    assert.equal(await overloaded(server), true, 'the stalled request holds all 8 pending sequences');
    await until(async () => !(await overloaded(server)), 'a new request to be admitted');
    assert.equal(server.engine.stats().kvBlocksUsed, 0);
    // The server ended the connection: once the client reads again, what was sent arrives, then the end.
    socket.resume();
    await closed;
  });

  it('with --write-timeout 0 the stalled client keeps its stream', E2E, async () => {
    const server = await startTestServer({ flags: ['--write-timeout', '0', '--max-pending-requests', '8'] });
    servers.push(server);
    const { socket, closed } = await stalledStream(server);
    let isClosed = false;
    void closed.then(() => { isClosed = true; });
    // Long enough for the engine to finish and the timeout above to have fired many times over.
    await waitFor(() => server.engine.stats().numRunning === 0, 'the engine to finish', 60_000);
    await new Promise((resolve) => setTimeout(resolve, 3000));
    assert.equal(isClosed, false);
    assert.equal(await overloaded(server), true, 'still held while the client holds the stream');
    socket.destroy();
    await until(async () => !(await overloaded(server)), 'the sequences back once the client leaves');
  });
});
