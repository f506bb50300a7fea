// A request that waits for a LoRA slot (--max-loras, every resident adapter busy) while its adapter is unloaded:
// it gets the answer a request naming the adapter from then on gets (404 model_not_found on "model"), and the
// x-ratelimit-* headers of that answer count the request and its tokens as given back, as the tenant's buckets do.

import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import OpenAI, { NotFoundError } from 'openai';
import type { Tenant } from '../../src/api/auth.ts';
import { parseServeConfig, startServer } from '../../src/cli/serve.ts';
import { silentLogger } from '../../src/util/log.ts';
import { waitFor } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const ANONYMOUS: Tenant = { name: 'anonymous', limits: { requestsPerMinute: 100, tokensPerMinute: 100_000 }, cacheSalt: undefined };

describe('unloading an adapter a request waits for', () => {
  it('answers the waiting request as a new one naming it, with the rate-limit headers after the refund', { timeout: 60_000 }, async () => {
    // Simulated workers at real time keep the busy adapter's stream in flight while the other request waits.
    const parsed = parseServeConfig(['--port', '0', '--log-level', 'silent', '--engine', 'sim', '--sim-speed-up', '1',
      '--lora-modules', 'busy=/adapters/busy,queued=/adapters/queued', '--max-loras', '1', '--sim-lora-rank', '8',
      '--tenant-rpm', '100', '--tenant-tpm', '100000'], {});
    if (parsed === 'help') throw new Error('unexpected --help');
    // The rate limiter's clock stands still: nothing refills, so what the headers say is exact.
    const server = await startServer(parsed, silentLogger, () => 1_000_000);
    try {
      const adapters = server.api.gateway.servedModels[0]!.backend.adapters!;
      const client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 30_000 });
      const holder = client.completions.create({ model: 'busy', prompt: 'SELECT', max_tokens: 400, ignore_eos: true } as never);
      await waitFor(() => server.api.limiter.inFlight(ANONYMOUS) === 1, 'the busy adapter running');
      const waiter = client.completions.create({ model: 'queued', prompt: 'SELECT', max_tokens: 5 }).then(
        () => assert.fail('the request for an unloaded adapter ran'), (error: unknown) => error);
      await waitFor(() => adapters.stats().waiting === 1, 'the request waiting for a slot');
      const removed = await rawRequest(server.url, { path: '/v1/unload_lora_adapter', body: { lora_name: 'queued' } });
      assert.equal(removed.status, 200, removed.text);

      const error = await waiter;
      assert.ok(error instanceof NotFoundError, String(error));
      assert.equal(error.code, 'model_not_found');
      assert.equal(error.param, 'model');
      assert.match(error.message, /The model 'queued' does not exist on this server; it serves 'Llama-3.1-8B' and 'busy'/);
      // Only the request still running holds anything; the headers say so.
      const remaining = server.api.limiter.remaining(ANONYMOUS);
      assert.equal(remaining.requests, 99);
      assert.equal(error.headers?.get('x-ratelimit-remaining-requests'), String(remaining.requests));
      assert.equal(error.headers?.get('x-ratelimit-remaining-tokens'), String(remaining.tokens));
      await holder;
    } finally {
      await server.api.shutdown(0);
    }
  });
});
