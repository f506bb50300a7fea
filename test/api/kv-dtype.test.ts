// --kv-cache-dtype: auto is the backend's choice (f16 on both CPU backends), so the default pool holds twice the
// tokens of an f32 one in the same memory; f32 asked for still is f32 and serves; /health and the banner say which.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { startupBanner } from '../../src/cli/serve.ts';
import { referenceBackend } from '../../src/kernels/reference-backend.ts';
import { nativeBackend } from '../../src/kernels/native.ts';
import { resolveKvDtype } from '../../src/kernels/types.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 90_000 };

describe('KV cache dtype', () => {
  let auto: TestServer;
  let f32: TestServer;

  before(async () => {
    auto = await startTestServer({ flags: ['--kv-cache-memory', '2MiB'] });
    f32 = await startTestServer({ flags: ['--kv-cache-memory', '2MiB', '--kv-cache-dtype', 'f32'] });
  });
  after(async () => {
    await auto?.close();
    await f32?.close();
  });

  it('auto stores f16: twice the tokens of f32 in the same memory, and serves past what f32 holds', E2E, async () => {
    assert.equal(auto.engine.info.kvDtype, 'f16');
    assert.equal(f32.engine.info.kvDtype, 'f32');
    assert.equal(auto.engine.info.kvCapacityTokens, 2 * f32.engine.info.kvCapacityTokens);
    const client = new OpenAI({ apiKey: 'unused', baseURL: `${auto.url}/v1`, maxRetries: 0, timeout: 60_000 });
    const model = auto.running.api.gateway.servedModelName!;
    // Longer than the f32 pool could hold: only the f16 pool fits it.
    const tokens = f32.engine.info.kvCapacityTokens + 32;
    const completion = await client.completions.create({
      model, prompt: 'Hello', max_tokens: tokens, ignore_eos: true, temperature: 0,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    assert.equal(completion.usage!.completion_tokens, tokens);
    await waitFor(() => engineIdle(auto.engine), 'the engine to be idle (every block given back)');
  });

  it('f32 asked for is served, and the blocks come back', E2E, async () => {
    const client = new OpenAI({ apiKey: 'unused', baseURL: `${f32.url}/v1`, maxRetries: 0, timeout: 60_000 });
    const model = f32.running.api.gateway.servedModelName!;
    const completion = await client.completions.create({
      model, prompt: 'Hello', max_tokens: 16, ignore_eos: true, temperature: 0,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    assert.equal(completion.usage!.completion_tokens, 16);
    await waitFor(() => engineIdle(f32.engine), 'the engine to be idle (every block given back)');
  });

  it('/health and the start-up banner name the dtype the worker resolved', E2E, async () => {
    for (const [server, dtype] of [[auto, 'f16'], [f32, 'f32']] as const) {
      const health = await rawRequest(server.url, { path: '/health' });
      assert.equal(health.status, 200);
      assert.equal(health.json().kv_cache_dtype, dtype);
      const info = server.engine.info;
      assert.match(startupBanner(server.running), new RegExp(`KV cache +${info.kvCapacityTokens} tokens \\(\\d+ blocks of ${info.blockSize}, ${dtype}\\)`));
    }
  });

  it('the reference backend stores f16 at auto as well (one answer whichever backend a worker falls back to)', E2E, async () => {
    const reference = await startTestServer({ flags: ['--kv-cache-memory', '2MiB', '--backend', 'reference'] });
    try {
      assert.equal(reference.engine.info.backend, 'reference');
      assert.equal(reference.engine.info.kvDtype, 'f16');
      assert.equal(reference.engine.info.kvCapacityTokens, auto.engine.info.kvCapacityTokens);
    } finally {
      await reference.close();
    }
  });
});

describe('resolveKvDtype', () => {
  it('auto is the first dtype a backend lists: f16 on both CPU backends', () => {
    assert.equal(resolveKvDtype(nativeBackend, undefined), 'f16');
    assert.equal(resolveKvDtype(referenceBackend, undefined), 'f16');
    assert.equal(resolveKvDtype(nativeBackend, 'f32'), 'f32');
    assert.equal(resolveKvDtype(referenceBackend, 'f32'), 'f32');
  });

  it('a backend that cannot store f16 keeps auto at f32, and refuses f16 asked for by name', () => {
    const f32Only = { name: 'f32-only', kvDtypes: ['f32'] as const };
    assert.equal(resolveKvDtype(f32Only, undefined), 'f32');
    assert.equal(resolveKvDtype(f32Only, 'f32'), 'f32');
    assert.throws(() => resolveKvDtype(f32Only, 'f16'), /the f32-only backend cannot store the KV cache as f16/);
  });
});
