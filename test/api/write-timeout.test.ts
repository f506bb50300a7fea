// A client that opens a stream and stops reading (its connection open, its buffers full) is closed after
// --write-timeout: its request is aborted and the sequences it held under --max-pending-requests are given back, so
// it cannot keep every other client at 503. With --write-timeout 0 the server waits for it for ever. A client that
// never reads a large non-streaming answer is closed the same way, so it cannot hold a connection (and the answer,
// in memory) for ever; one that reads slowly but keeps reading gets the whole answer.

import assert from 'node:assert/strict';
import { connect, type Socket } from 'node:net';
import { after, describe, it } from 'node:test';
import { startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 120_000 };

/** A stream of 8 completions with 20 logprobs per token: megabytes of events, more than the socket buffers hold. */
const BODY = JSON.stringify({ prompt: 'Once upon a time', max_tokens: 1200, n: 8, stream: true, ignore_eos: true, logprobs: 20 });

/**
 * A non-streaming chat answer of 8 completions with 20 alternatives per token: some 10 MB of JSON, more than the
 * loopback socket's buffers hold while the client reads nothing.
 */
const LARGE_ANSWER = JSON.stringify({
  messages: [{ role: 'user', content: 'Tell me a story' }], max_tokens: 800, n: 8, logprobs: true, top_logprobs: 20, ignore_eos: true,
});

/**
 * Sends a request and stops reading after its first bytes; resolves with the socket, those bytes and a promise of
 * its close.
 */
function stalledRequest(server: TestServer, path = '/v1/completions', body = BODY): Promise<{ socket: Socket; first: string; closed: Promise<void> }> {
  const { port } = new URL(server.url);
  const socket = connect(Number(port), '127.0.0.1');
  const closed = new Promise<void>((resolve) => socket.once('close', () => resolve()));
  socket.on('error', () => {});
  socket.write(`POST ${path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`);
  return new Promise((resolve) => socket.once('data', (data: Buffer) => {
    socket.pause();
    resolve({ socket, first: data.toString('latin1'), closed });
  }));
}

function stalledStream(server: TestServer): Promise<{ socket: Socket; closed: Promise<void> }> {
  return stalledRequest(server);
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

  it('a non-streaming answer whose client never reads it is cut off, freeing the connection (--max-connections 1)', E2E, async () => {
    const server = await startTestServer({ flags: ['--write-timeout', '1', '--max-connections', '1'] });
    servers.push(server);
    const { socket, first, closed } = await stalledRequest(server, '/v1/chat/completions', LARGE_ANSWER);
    assert.match(first, /^HTTP\/1\.1 200 /);
    const length = Number(/\r\ncontent-length: (\d+)\r\n/i.exec(first)![1]);
    const id = /\r\nx-request-id: (\S+)\r\n/i.exec(first)![1]!;
    assert.ok(length > 4_000_000, `an answer of ${length} bytes`);
    // The generation is over before the first byte is sent: the wait is the client's alone. The server closes its
    // end (the client sees it once it reads what was sent before).
    await waitFor(() => server.running.api.connectionCount === 0, 'the server to close the connection of a client that does not read', 90_000);
    let received = first.length;
    socket.on('data', (data: Buffer) => { received += data.length; });
    socket.resume();
    await closed;
    assert.ok(received < length, `the answer was cut off: ${received} of ${length} bytes`);
    // The only connection allowed is free again.
    await until(async () => (await rawRequest(server.url, { path: '/health' }).catch(() => ({ status: 0 }))).status === 200, '/health to answer');
    // Counted as the stream case is: a 200 whose client left.
    await waitFor(() => server.running.api.telemetry.trace(id) !== undefined, 'the request\'s trace');
    const trace = server.running.api.telemetry.trace(id)!;
    assert.equal(trace.outcome, 'abort');
    assert.equal(trace.abortReason, 'client_disconnect');
    assert.equal(server.engine.stats().kvBlocksUsed, 0);
  });

  it('a slow reader of a large non-streaming answer that keeps reading gets all of it, however long that takes', E2E, async () => {
    const server = await startTestServer({ flags: ['--write-timeout', '1'] });
    servers.push(server);
    const { socket, first } = await stalledRequest(server, '/v1/chat/completions', LARGE_ANSWER);
    const startedMs = Date.now();
    const headerEnd = first.indexOf('\r\n\r\n') + 4;
    const length = Number(/\r\ncontent-length: (\d+)\r\n/i.exec(first)![1]);
    const chunks: Buffer[] = [Buffer.from(first.slice(headerEnd), 'latin1')];
    let received = chunks[0]!.length;
    let closed = false;
    socket.once('close', () => { closed = true; });
    // At most 64 KiB a read and a 20 ms pause after each: seconds in all, each pause far shorter than the timeout.
    const done = new Promise<void>((resolve) => {
      socket.on('data', (data: Buffer) => {
        chunks.push(data);
        received += data.length;
        if (received >= length) resolve();
        socket.pause();
        setTimeout(() => socket.resume(), 20);
      });
    });
    socket.resume();
    await Promise.race([done, new Promise<void>((resolve) => socket.once('close', () => resolve()))]);
    assert.equal(received, length, `all of the answer (connection ${closed ? 'closed' : 'open'})`);
    assert.ok(Date.now() - startedMs > 1000, 'reading it took longer than the write timeout');
    const body = JSON.parse(Buffer.concat(chunks).toString('utf8'));
    assert.equal(body.choices.length, 8);
    socket.destroy();
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
