// A JSON body is read as JSON whatever Content-Type it came with: curl's -d sends
// application/x-www-form-urlencoded, a browser's fetch with a string body text/plain, some clients none. (vLLM's
// FastAPI refuses a body whose Content-Type is not JSON, which only breaks those clients: the body is parsed as JSON
// or refused as not JSON all the same.) A body that is not JSON and came as something else, a form most likely, is
// the 400 invalid_json it always was, whose message now names the type it was sent as and what the API takes.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 120_000 };

describe('the Content-Type of a request body', () => {
  let server: TestServer;
  let model: string;
  before(async () => {
    server = await startTestServer();
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('does not matter for a JSON body', E2E, async () => {
    const body = JSON.stringify({ model, prompt: 'hello', max_tokens: 2 });
    for (const type of [undefined, 'application/json', 'application/json; charset=utf-8', 'text/plain;charset=UTF-8',
      'application/x-www-form-urlencoded', 'application/octet-stream']) {
      const res = await rawRequest(server.url, {
        path: '/v1/completions', body: Buffer.from(body), headers: type === undefined ? {} : { 'Content-Type': type },
      });
      assert.equal(res.status, 200, `${type}: ${res.text}`);
      assert.equal(res.json().choices.length, 1);
    }
    // The official client's own requests, for the record.
    const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'none', maxRetries: 0 });
    assert.equal((await client.completions.create({ model, prompt: 'hello', max_tokens: 2 })).choices.length, 1);
  });

  it('is named in the 400 for a body that is not JSON', E2E, async () => {
    const form = await rawRequest(server.url, {
      path: '/v1/completions', body: `model=${model}&prompt=hello`, headers: { 'Content-Type': 'application/x-www-form-urlencoded' },
    });
    assert.equal(form.status, 400);
    assert.equal(form.json().error.code, 'invalid_json');
    assert.match(form.json().error.message,
      /^The request body is not valid JSON: .+ \(it was sent as application\/x-www-form-urlencoded; the API takes a JSON body, as Content-Type: application\/json\)$/);
    const boundary = 'xYz';
    const multipart = await rawRequest(server.url, {
      path: '/v1/chat/completions', headers: { 'Content-Type': `multipart/form-data; boundary=${boundary}` },
      body: `--${boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\n${model}\r\n--${boundary}--\r\n`,
    });
    assert.equal(multipart.status, 400);
    assert.match(multipart.json().error.message, /\(it was sent as multipart\/form-data; the API takes a JSON body/);
    // Bad JSON sent as JSON: no hint, the parser's own message.
    const json = await rawRequest(server.url, { path: '/v1/completions', body: '{"model": ' });
    assert.equal(json.status, 400);
    assert.doesNotMatch(json.json().error.message, /sent as/);
    // An empty body, with a type that is not JSON: the hint too.
    const empty = await rawRequest(server.url, {
      path: '/v1/completions', body: Buffer.alloc(0), headers: { 'Content-Type': 'text/plain', 'Content-Length': '0' },
    });
    assert.equal(empty.status, 400, empty.text);
    assert.match(empty.json().error.message, /body is empty\. \(it was sent as text\/plain;/);
  });
});
