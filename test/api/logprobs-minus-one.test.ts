// A logprobs count of -1 over HTTP. vLLM's chat takes top_logprobs -1 as the whole vocabulary and holds it to
// --max-logprobs, whose default (20, the fixed limit here) refuses it; its completions refuse logprobs -1 outright.
// Conduit refuses both with a 400 naming the field; chat's says the whole vocabulary is more than the server returns,
// and, as in vLLM, a -1 without logprobs true is first refused for that. It used to be a bare "out of range" for
// either. The server stays up.
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 90_000 };
const messages = [{ role: 'user', content: 'Hi' }];

describe('logprobs -1', () => {
  let server: TestServer;
  let vocabSize: number;

  before(async () => {
    server = await startTestServer();
    vocabSize = server.running.api.gateway.servedModels[0]!.backend.tokenizer.vocabSize;
  });
  after(async () => {
    await server?.close();
  });

  async function refusal(path: string, body: object): Promise<{ message: string; type: string; param: string; code: string }> {
    const response = await rawRequest(server.url, { path, body: { max_tokens: 2, ...body } });
    assert.equal(response.status, 400, response.text);
    return response.json().error;
  }

  it('chat top_logprobs -1: a 400 that says the whole vocabulary is more than the server returns', E2E, async () => {
    const error = await refusal('/v1/chat/completions', { messages, logprobs: true, top_logprobs: -1 });
    assert.equal(error.param, 'top_logprobs');
    assert.equal(error.code, 'invalid_value');
    assert.equal(error.type, 'invalid_request_error');
    assert.match(error.message, new RegExp(`whole vocabulary \\(${vocabSize} alternatives per token\\).*at most 20`));
  });

  it('chat top_logprobs -1 without logprobs true: refused for that first, as vLLM', E2E, async () => {
    const error = await refusal('/v1/chat/completions', { messages, top_logprobs: -1 });
    assert.equal(error.param, 'top_logprobs');
    assert.match(error.message, /needs logprobs set to true/);
  });

  it('chat top_logprobs -2 and completions logprobs -1: out of range; the server answers on', E2E, async () => {
    assert.match((await refusal('/v1/chat/completions', { messages, logprobs: true, top_logprobs: -2 })).message, /out of range/);
    const completions = await refusal('/v1/completions', { prompt: 'Hi', logprobs: -1 });
    assert.equal(completions.param, 'logprobs');
    assert.equal(completions.code, 'invalid_value');
    const ok = await rawRequest(server.url, { path: '/v1/chat/completions', body: { messages, max_tokens: 2, logprobs: true, top_logprobs: 20 } });
    assert.equal(ok.status, 200, ok.text);
    assert.equal(ok.json().choices[0].logprobs.content[0].top_logprobs.length, 20);
  });
});
