// --kv-cache-dtype f16: the same KV cache memory holds twice the tokens, requests are served, and the blocks come
// back after them.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 90_000 };

describe('KV cache dtype', () => {
  let f32: TestServer;
  let f16: TestServer;

  before(async () => {
    f32 = await startTestServer({ flags: ['--kv-cache-memory', '2MiB'] });
    f16 = await startTestServer({ flags: ['--kv-cache-memory', '2MiB', '--kv-cache-dtype', 'f16'] });
  });
  after(async () => {
    await f32?.close();
    await f16?.close();
  });

  it('f16 holds twice the tokens of f32 in the same memory, and serves', E2E, async () => {
    assert.equal(f16.engine.info.kvCapacityTokens, 2 * f32.engine.info.kvCapacityTokens);
    const client = new OpenAI({ apiKey: 'unused', baseURL: `${f16.url}/v1`, maxRetries: 0, timeout: 60_000 });
    const model = f16.running.api.gateway.servedModelName!;
    // Longer than the f32 pool could hold: only the f16 pool fits it.
    const tokens = f32.engine.info.kvCapacityTokens + 32;
    const completion = await client.completions.create({
      model, prompt: 'Hello', max_tokens: tokens, ignore_eos: true, temperature: 0,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    assert.equal(completion.usage!.completion_tokens, tokens);
    await waitFor(() => engineIdle(f16.engine), 'the engine to be idle (every block given back)');
  });
});
