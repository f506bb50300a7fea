// min_tokens against the max_tokens a request ends up with: when max_tokens is left out (chat's default is the
// context left after the prompt) or generation_config.json's max_new_tokens caps it, a min_tokens above it is a 400
// on min_tokens, as it is when max_tokens is given, and as vLLM's sampling parameters refuse it. It used to be lowered
// to max_tokens silently, and the answer ended "length" short of the min_tokens asked.
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const CONTEXT = 64;
const chat = { messages: [{ role: 'user', content: 'Hi' }], temperature: 0 };

describe('min_tokens above the max_tokens a request ends up with', () => {
  let server: TestServer;
  let capped: TestServer;
  let dir: string;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-min-tokens-'));
    writeFileSync(join(dir, 'generation_config.json'), JSON.stringify({ max_new_tokens: 5 }));
    server = await startTestServer({ flags: ['--max-model-len', String(CONTEXT)] });
    capped = await startTestServer({ flags: ['--generation-config', dir] });
  });
  after(async () => {
    await server?.close();
    await capped?.close();
    rmSync(dir, { recursive: true, force: true });
  });

  it('chat without max_tokens: a min_tokens over the context left is a 400 naming min_tokens', async () => {
    const response = await rawRequest(server.url, { path: '/v1/chat/completions', body: { ...chat, min_tokens: CONTEXT } });
    assert.equal(response.status, 400, response.text);
    const { error } = response.json() as { error: { param: string; code: string; message: string } };
    assert.equal(error.param, 'min_tokens');
    assert.equal(error.code, 'invalid_value');
    assert.match(error.message, /larger than max_tokens \(\d+: the context left after the prompt's \d+ tokens\)/);
  });

  it('chat without max_tokens: a min_tokens the context holds runs and is honoured', async () => {
    const response = await rawRequest(server.url, { path: '/v1/chat/completions', body: { ...chat, min_tokens: 8, logit_bias: { 2: 100 } } });
    assert.equal(response.status, 200, response.text);
    const body = response.json() as { usage: { completion_tokens: number } };
    // The EOS is pushed by logit_bias; min_tokens holds it back for 8 tokens.
    assert.ok(body.usage.completion_tokens >= 8, `completion_tokens ${body.usage.completion_tokens}`);
  });

  it("max_new_tokens of generation_config.json below min_tokens: a 400 that says the cap is the file's, chat and completions", async () => {
    for (const [path, body] of [
      ['/v1/chat/completions', { ...chat, min_tokens: 8 }],
      ['/v1/chat/completions', { ...chat, min_tokens: 8, max_tokens: 12 }],
      ['/v1/completions', { prompt: 'Hi', min_tokens: 8, max_tokens: 12 }],
    ] as const) {
      const response = await rawRequest(capped.url, { path, body });
      assert.equal(response.status, 400, `${path} ${JSON.stringify(body)}: ${response.text}`);
      const { error } = response.json() as { error: { param: string; message: string } };
      assert.equal(error.param, 'min_tokens');
      assert.match(error.message, /larger than max_tokens \(5: the model's generation_config\.json caps max_tokens\)/);
    }
    // Under the cap it runs, and the server took nothing from the refusals.
    const ok = await rawRequest(capped.url, { path: '/v1/chat/completions', body: { ...chat, min_tokens: 3 } });
    assert.equal(ok.status, 200, ok.text);
  });
});
