// `conduit trace` gives up on a server that does not answer: one that accepts the connection and says nothing, and
// one that sends its headers and then stalls the body. --timeout (CONDUIT_TRACE_TIMEOUT) bounds the whole answer,
// reported in one line with exit code 1; a bad value is refused. Run in-process through main().
import assert from 'node:assert/strict';
import { createServer, type Server, type Socket } from 'node:net';
import { after, before, describe, it } from 'node:test';
import { runCli as run } from '../helpers/cli-main.ts';

async function listen(onConnection: (socket: Socket) => void): Promise<{ server: Server; url: string; sockets: Set<Socket> }> {
  const sockets = new Set<Socket>();
  const server = createServer((socket) => {
    sockets.add(socket);
    socket.on('error', () => {});
    onConnection(socket);
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return { server, url: `http://127.0.0.1:${(server.address() as { port: number }).port}`, sockets };
}

describe('conduit trace --timeout', () => {
  let silent: Awaited<ReturnType<typeof listen>>;
  let stalled: Awaited<ReturnType<typeof listen>>;
  before(async () => {
    silent = await listen(() => {});
    stalled = await listen((socket) => socket.write('HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"waterfall":'));
  });
  after(async () => {
    for (const { server, sockets } of [silent, stalled]) {
      for (const socket of sockets) socket.destroy();
      await new Promise((resolve) => server.close(resolve));
    }
  });

  it('reports a server that accepts and never answers, within --timeout', { timeout: 20_000 }, async () => {
    const start = Date.now();
    const { code, err } = await run(['trace', 'cmpl-1', '--url', silent.url, '--timeout', '1']);
    assert.equal(code, 1, err);
    assert.match(err, new RegExp(`^conduit trace: no answer from ${silent.url.replace(/\./g, '\\.')} within 1 s \\(--timeout\\)$`));
    assert.ok(Date.now() - start < 5000, `${Date.now() - start} ms`);
  });

  it('bounds the body too, and takes the timeout from CONDUIT_TRACE_TIMEOUT', { timeout: 20_000 }, async () => {
    const { code, err } = await run(['trace', 'cmpl-1', '--url', stalled.url], { CONDUIT_TRACE_TIMEOUT: '0.5' });
    assert.equal(code, 1, err);
    assert.match(err, /no answer from http:\/\/127\.0\.0\.1:\d+ within 0\.5 s/);
  });

  it('refuses a timeout that is not a positive number of seconds', async () => {
    for (const value of ['0', '-1', '1e10']) {
      const { code, err } = await run(['trace', 'cmpl-1', '--timeout', value]);
      assert.equal(code, 2, `${value}: ${err}`);
      assert.match(err, /--timeout must be in \(0, 2147483\] seconds/);
    }
  });
});
