// `conduit bench` refuses bad flags before it sends anything: one line, exit code 2. It probes the server with the
// run's first request before the load: a server that is not there, or refuses the run's requests, is one line and
// exit code 1, with no load sent.
import assert from 'node:assert/strict';
import { createServer, type IncomingMessage, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { test } from 'node:test';
import { runCli as run } from '../helpers/cli-main.ts';

/** A server on 127.0.0.1 answering with `handler`, the paths it was asked for, and a way to stop it. */
async function stub(handler: (req: IncomingMessage, res: ServerResponse) => void) {
  const paths: string[] = [];
  const server = createServer((req, res) => {
    paths.push(req.url!);
    req.resume();
    req.on('end', () => handler(req, res));
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  const close = (): Promise<void> => {
    server.closeAllConnections();
    return new Promise((resolve) => server.close(() => resolve()));
  };
  return { url, paths, close };
}

test('conduit bench refuses a timeout Node\'s timers cannot hold (it would fire at once) or one not above 0', async () => {
  // An unreachable server: a refusal must come before any request.
  for (const timeout of ['1e7', '0', '-1']) {
    const { code, err } = await run(['bench', '--url', 'http://127.0.0.1:1', '-n', '1', '--timeout', timeout]);
    assert.equal(code, 2, `${timeout}: ${err}`);
    assert.match(err, /--timeout must be in \(0, 2147483\] seconds/);
  }
});

test('conduit bench refuses prompt lengths no context holds (building such a prompt crashed V8), naming the flag and the bound', async () => {
  for (const [flag, extra] of [['--prompt-tokens', []], ['--system-prompt-tokens', ['--workload', 'shared-prefix']],
    ['--question-tokens', ['--workload', 'shared-prefix']]] as const) {
    for (const value of ['1e9', '1048577']) {
      const { code, out, err } = await run(['bench', '--url', 'http://127.0.0.1:1', '-n', '1', ...extra, flag, value]);
      assert.equal(code, 2, `${flag} ${value}: ${err}`);
      assert.equal(out, '');
      assert.equal(err, `conduit bench: ${flag} must be a whole number from 1 to 1048576, got ${Number(value)}`);
    }
  }
});

test('conduit bench refuses more clients than one address has connections (10^12 was a stack trace, 10^7 gigabytes and a hang)', async () => {
  for (const value of ['1e12', '65537']) {
    const { code, out, err } = await run(['bench', '--url', 'http://127.0.0.1:1', '-n', '1', '--no-probe', '--concurrency', value]);
    assert.equal(code, 2, `--concurrency ${value}: ${err}`);
    assert.equal(out, '');
    assert.equal(err, `conduit bench: --concurrency must be at most 65536 (connections one client address can open to a server), got ${Number(value)}`);
  }
});

test('conduit bench against a server that is not there: one line after one request, not a load of failures', async () => {
  const { url, close } = await stub(() => undefined);
  await close();
  const { code, out, err } = await run(['bench', '--url', url, '--duration', '1', '--no-progress']);
  assert.equal(code, 1, err);
  assert.equal(out, '', 'no report: nothing was measured');
  assert.equal(err, `conduit bench: the first request, sent once before the load, failed: ECONNREFUSED from ${url}/v1/chat/completions; `
    + 'no load was sent (--no-probe skips this check)');
});

test('conduit bench: a server refusing the run\'s first request stops it with the server\'s reason; --no-probe sends the load anyway', async () => {
  const server = await stub((req, res) => {
    if (req.url === '/v1/models') return res.writeHead(200, { 'Content-Type': 'application/json' }).end('{"data":[{"id":"m"}]}');
    res.writeHead(400, { 'Content-Type': 'application/json' })
      .end(JSON.stringify({ error: { message: 'max_tokens is too large', type: 'invalid_request_error', code: 'invalid_value' } }));
  });
  try {
    const probed = await run(['bench', '--url', server.url, '-n', '5', '--no-progress']);
    assert.equal(probed.code, 1);
    assert.equal(probed.out, '');
    assert.equal(probed.err, 'conduit bench: the first request, sent once before the load, failed: http 400 invalid_value '
      + `("max_tokens is too large") from ${server.url}/v1/chat/completions; no load was sent (--no-probe skips this check)`);
    assert.deepEqual(server.paths, ['/v1/models', '/v1/chat/completions']);
    server.paths.length = 0;
    const unprobed = await run(['bench', '--url', server.url, '-n', '5', '--no-progress', '--no-probe', '--json']);
    assert.equal(unprobed.code, 1, 'no request succeeded');
    assert.deepEqual(JSON.parse(unprobed.out).summary.errors, { 'http 400 invalid_value': 5 });
    assert.deepEqual(server.paths, ['/v1/models', ...Array(5).fill('/v1/chat/completions')]);
    server.paths.length = 0;
    const fromEnv = await run(['bench', '--url', server.url, '-n', '2', '--no-progress', '--json'], { CONDUIT_BENCH_PROBE: 'false' });
    assert.equal(fromEnv.code, 1);
    assert.equal(server.paths.length, 3, 'CONDUIT_BENCH_PROBE=false: no probe either');
  } finally {
    await server.close();
  }
});

test('conduit bench: the probe, when it passes, is not counted in the report', async () => {
  const server = await stub((_req, res) => {
    res.writeHead(200, { 'Content-Type': 'application/json' })
      .end(JSON.stringify({ data: [{ id: 'm' }], choices: [{ message: { content: 'x' } }], usage: { prompt_tokens: 4, completion_tokens: 1 } }));
  });
  try {
    const { code, out, err } = await run(['bench', '--url', server.url, '-n', '3', '--no-progress', '--json']);
    assert.equal(code, 0, err);
    assert.equal(JSON.parse(out).summary.numRequests, 3);
    assert.deepEqual(server.paths, ['/v1/models', ...Array(4).fill('/v1/chat/completions')]);
  } finally {
    await server.close();
  }
});

test('conduit bench\'s report header names the URL its requests went to, with a base URL ending in /v1 or /v1/ too', async () => {
  const server = await stub((_req, res) => {
    res.writeHead(200, { 'Content-Type': 'application/json' })
      .end(JSON.stringify({ data: [{ id: 'm' }], choices: [{ message: { content: 'x' }, text: 'x' }], usage: { prompt_tokens: 4, completion_tokens: 1 } }));
  });
  try {
    for (const [base, endpoint, path] of [
      [`${server.url}/v1/`, 'chat', '/v1/chat/completions'],
      [`${server.url}/v1`, 'completions', '/v1/completions'],
      [`${server.url}/proxy/v1/`, 'chat', '/proxy/v1/chat/completions'],
      [server.url, 'chat', '/v1/chat/completions'],
    ] as const) {
      server.paths.length = 0;
      const { code, out, err } = await run(['bench', '--url', base, '--endpoint', endpoint, '-n', '1', '--no-progress', '--no-probe']);
      assert.equal(code, 0, err);
      assert.equal(out.split('\n')[0], `conduit bench: ${server.url}${path}, model m`, base);
      assert.equal(server.paths.at(-1), path, `${base}: the path the request used`);
    }
  } finally {
    await server.close();
  }
});
