// The request log line names the client's X-Request-Id beside the server's id, so a line can be matched with the
// logs of the proxy or client that sent the header; one that could read as several fields is quoted.
import { it } from 'node:test';
import assert from 'node:assert/strict';
import { parseServeConfig, startServer } from '../../src/cli/serve.ts';
import { createLogger } from '../../src/util/log.ts';

it('logs client_request_id after id for a request that sent X-Request-Id, quoted when it holds a space or =', async () => {
  const lines: string[] = [];
  const config = parseServeConfig(['--port', '0', '--engine', 'sim', '--sim-speed-up', 'inf'], {});
  assert.notEqual(config, 'help');
  const running = await startServer(config as Exclude<typeof config, 'help'>, createLogger('info', (line) => lines.push(line)));
  const ids: string[] = [];
  try {
    for (const header of ['trace-42', 'a b=c', undefined]) {
      const response = await fetch(`${running.url}/v1/completions`, {
        method: 'POST', body: JSON.stringify({ prompt: 'Hello', max_tokens: 2 }),
        headers: { 'Content-Type': 'application/json', ...(header !== undefined ? { 'X-Request-Id': header } : {}) },
      });
      assert.equal(response.status, 200);
      ids.push((await response.json() as { id: string }).id);
    }
  } finally {
    await running.api.shutdown(0);
  }
  const requestLines = lines.filter((line) => /POST \/v1\/completions 200 /.test(line));
  assert.equal(requestLines.length, 3, lines.join(''));
  assert.match(requestLines[0]!, / id=cmpl-[0-9a-f]+ client_request_id=trace-42\n$/);
  assert.match(requestLines[1]!, / id=cmpl-[0-9a-f]+ client_request_id="a b=c"\n$/);
  assert.match(requestLines[2]!, new RegExp(` id=${ids[2]}\\n$`), 'no header: no client_request_id');
  // The server's id in the line is not the response's: the response is named by the header.
  assert.equal(ids[0], 'cmpl-trace-42');
});

it('logs a body request_id as client_request_id when no X-Request-Id is sent; the header goes first', async () => {
  const lines: string[] = [];
  const config = parseServeConfig(['--port', '0', '--engine', 'sim', '--sim-speed-up', 'inf'], {});
  assert.notEqual(config, 'help');
  const running = await startServer(config as Exclude<typeof config, 'help'>, createLogger('info', (line) => lines.push(line)));
  try {
    for (const [path, body, header] of [
      ['/v1/completions', { prompt: 'Hello', request_id: 'job-7' }, undefined],
      ['/v1/chat/completions', { messages: [{ role: 'user', content: 'Hello' }], request_id: 'a b' }, undefined],
      ['/v1/completions', { prompt: 'Hello', request_id: 'body-loses' }, 'header-wins'],
      ['/v1/responses', { input: 'Hello', request_id: 'resp-body' }, undefined],
    ] as const) {
      const response = await fetch(`${running.url}${path}`, {
        method: 'POST', body: JSON.stringify({ max_tokens: path === '/v1/responses' ? undefined : 2, ...body }),
        headers: { 'Content-Type': 'application/json', ...(header !== undefined ? { 'X-Request-Id': header } : {}) },
      });
      assert.equal(response.status, 200, await response.clone().text());
      await response.text();
    }
  } finally {
    await running.api.shutdown(0);
  }
  const requestLines = lines.filter((line) => /POST \/v1\/(chat\/)?(completions|responses) 200 /.test(line));
  assert.equal(requestLines.length, 4, lines.join(''));
  assert.match(requestLines[0]!, / id=cmpl-[0-9a-f]+ client_request_id=job-7\n$/);
  assert.match(requestLines[1]!, / id=chatcmpl-[0-9a-f]+ client_request_id="a b"\n$/);
  assert.match(requestLines[2]!, / id=cmpl-[0-9a-f]+ client_request_id=header-wins\n$/);
  assert.match(requestLines[3]!, / id=resp_[0-9a-f]+ client_request_id=resp-body\n$/);
});

it('escapes the controls JSON leaves raw (C1, line separators, bidi overrides) in a client id, so the id cannot colour or break its line', async () => {
  const lines: string[] = [];
  const config = parseServeConfig(['--port', '0', '--engine', 'sim', '--sim-speed-up', 'inf'], {});
  assert.notEqual(config, 'help');
  const running = await startServer(config as Exclude<typeof config, 'help'>, createLogger('info', (line) => lines.push(line)));
  try {
    // U+009B is the one-character form of ESC [ (a terminal then reads "31m" as red), U+0085 and U+2028 break lines
    // for some log readers, U+202E shows the rest of the line reversed. A header carries the first as the byte 0x9b.
    for (const [header, bodyId] of [['job\x9b31m', undefined], [undefined, 'a\u0085b\u2028c\u202ed']] as const) {
      const response = await fetch(`${running.url}/v1/completions`, {
        method: 'POST', body: JSON.stringify({ prompt: 'Hello', max_tokens: 2, ...(bodyId !== undefined ? { request_id: bodyId } : {}) }),
        headers: { 'Content-Type': 'application/json', ...(header !== undefined ? { 'X-Request-Id': header } : {}) },
      });
      assert.equal(response.status, 200, await response.clone().text());
      await response.text();
    }
  } finally {
    await running.api.shutdown(0);
  }
  const requestLines = lines.filter((line) => /POST \/v1\/completions 200 /.test(line));
  assert.equal(requestLines.length, 2, lines.join(''));
  for (const line of requestLines) assert.doesNotMatch(line, /[\x7f-\x9f\u2028\u2029\u202a-\u202e]/, JSON.stringify(line));
  assert.match(requestLines[0]!, / client_request_id="job\\u009b31m"\n$/);
  assert.match(requestLines[1]!, / client_request_id="a\\u0085b\\u2028c\\u202ed"\n$/);
});
