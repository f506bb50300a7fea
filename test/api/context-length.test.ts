// On a KV cache smaller than the model's context, the server advertises the context one sequence can really get
// (GET /v1/models max_model_len), refuses a prompt + max_tokens beyond it with vLLM's 400, and without max_tokens
// generates up to it on chat, as vLLM does (max_tokens defaults to what is left; 16 on completions). vLLM's
// --max-model-len sets that context below the model's, and --no-enable-prefix-caching turns the prefix cache off.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI, { BadRequestError } from 'openai';
import { startupBanner } from '../../src/cli/serve.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 90_000 };
/** The built-in model's context length. */
const MODEL_CONTEXT = 2048;

describe('context length on a KV cache smaller than the model context', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;

  before(async () => {
    // 1 MiB holds 10 blocks of 16 tokens of the built-in model's KV cache.
    server = await startTestServer({ flags: ['--kv-cache-memory', '1MiB'] });
    client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('advertises what one sequence can get from the KV pool, not the model context', E2E, async () => {
    const { kvCapacityTokens, maxModelLen } = server.engine.info;
    assert.ok(kvCapacityTokens < MODEL_CONTEXT, `the test needs a small KV cache, got ${kvCapacityTokens} tokens`);
    // A sequence of N tokens keeps N - 1 of them in the KV cache (its last token is never fed).
    assert.equal(maxModelLen, kvCapacityTokens + 1);
    const listed = await client.models.list();
    assert.equal((listed.data[0] as unknown as { max_model_len: number }).max_model_len, maxModelLen);
    assert.match(startupBanner(server.running), new RegExp(`context ${maxModelLen} tokens, limited by the KV cache`));
  });

  it('refuses prompt + max_tokens beyond it with a 400 naming max_tokens and both counts', E2E, async () => {
    const { maxModelLen } = server.engine.info;
    const probe = await client.completions.create({ model, prompt: 'Hello', max_tokens: 1 });
    const promptTokens = probe.usage!.prompt_tokens;
    await assert.rejects(client.completions.create({ model, prompt: 'Hello', max_tokens: 1000 }), (err: unknown) => {
      assert.ok(err instanceof BadRequestError);
      assert.equal(err.status, 400);
      assert.equal(err.code, 'context_length_exceeded');
      assert.equal(err.param, 'max_tokens');
      assert.equal(err.message, `400 This model's maximum context length is ${maxModelLen} tokens. However, you requested `
        + `${promptTokens + 1000} tokens (${promptTokens} in the messages, 1000 in the completion). `
        + 'Please reduce the length of the messages or completion.');
      return true;
    });
    // Exactly what fits is accepted.
    const fits = await client.completions.create({
      model, prompt: 'Hello', max_tokens: maxModelLen - promptTokens, ignore_eos: true,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    assert.equal(fits.usage!.completion_tokens, maxModelLen - promptTokens);
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
  });

  it('without max_tokens: chat generates up to the advertised length, completions 16 tokens (OpenAI\'s and vLLM\'s defaults)', E2E, async () => {
    const { maxModelLen } = server.engine.info;
    const whole = await client.chat.completions.create({
      model, messages: [{ role: 'user', content: 'Hello' }], ignore_eos: true,
    } as OpenAI.ChatCompletionCreateParamsNonStreaming);
    assert.equal(whole.choices[0]!.finish_reason, 'length');
    assert.equal(whole.usage!.prompt_tokens + whole.usage!.completion_tokens, maxModelLen);
    const legacy = await client.completions.create({ model, prompt: 'Hello', ignore_eos: true } as OpenAI.CompletionCreateParamsNonStreaming);
    assert.equal(legacy.choices[0]!.finish_reason, 'length');
    assert.equal(legacy.usage!.completion_tokens, 16);
    // min_tokens above that default is refused as it is above an explicit max_tokens.
    await assert.rejects(client.completions.create({ model, prompt: 'Hello', min_tokens: 17 } as OpenAI.CompletionCreateParamsNonStreaming),
      (err: unknown) => err instanceof BadRequestError && err.param === 'min_tokens');
  });
});

describe('--max-model-len and --no-enable-prefix-caching, as vLLM\'s flags', () => {
  const MAX_MODEL_LEN = 96;
  /** A prompt of several KV blocks, sent twice. */
  const PROMPT = 'Once upon a time there was a little girl who lived in a village near the forest. '.repeat(3);
  let uncached: TestServer;
  let cached: TestServer;

  before(async () => {
    uncached = await startTestServer({ flags: ['--max-model-len', String(MAX_MODEL_LEN), '--no-enable-prefix-caching'] });
    cached = await startTestServer({ flags: ['--max-model-len', String(MAX_MODEL_LEN)] });
  });
  after(async () => {
    await uncached?.close();
    await cached?.close();
  });

  it('the context is --max-model-len: advertised, and a request beyond it is a 400', E2E, async () => {
    const client = new OpenAI({ apiKey: 'unused', baseURL: `${uncached.url}/v1`, maxRetries: 0, timeout: 60_000 });
    const model = uncached.running.api.gateway.servedModelName!;
    assert.ok(uncached.engine.info.kvCapacityTokens + 1 > MAX_MODEL_LEN, 'the KV cache holds more than --max-model-len');
    assert.equal(uncached.engine.info.maxModelLen, MAX_MODEL_LEN);
    const listed = await client.models.list();
    assert.equal((listed.data[0] as unknown as { max_model_len: number }).max_model_len, MAX_MODEL_LEN);
    const probe = await client.completions.create({ model, prompt: 'Hello', max_tokens: 1 });
    const promptTokens = probe.usage!.prompt_tokens;
    await assert.rejects(client.completions.create({ model, prompt: 'Hello', max_tokens: MAX_MODEL_LEN - promptTokens + 1 }),
      (err: unknown) => err instanceof BadRequestError && err.code === 'context_length_exceeded');
    const fits = await client.completions.create({
      model, prompt: 'Hello', max_tokens: MAX_MODEL_LEN - promptTokens, ignore_eos: true,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    assert.equal(fits.usage!.completion_tokens, MAX_MODEL_LEN - promptTokens);
  });

  it('without prefix caching a repeated prompt is computed whole; with it, its blocks are reused', E2E, async () => {
    const cachedTokens = async (server: TestServer) => {
      const tokens: number[] = [];
      for (let i = 0; i < 2; i++) {
        const response = await rawRequest(server.url, { path: '/v1/completions', body: { prompt: PROMPT, max_tokens: 1 } });
        assert.equal(response.status, 200, response.text);
        tokens.push(response.json().usage.prompt_tokens_details?.cached_tokens ?? 0);
      }
      return tokens;
    };
    assert.deepEqual(await cachedTokens(uncached), [0, 0]);
    const [first, second] = await cachedTokens(cached);
    assert.equal(first, 0);
    assert.ok(second! >= 32, `the second request reuses the prompt's full blocks, got ${second}`);
  });
});
