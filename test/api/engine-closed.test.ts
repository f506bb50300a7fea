// A request in flight when its engine closes is answered 503 (the server is stopping), whatever kind of engine it
// is: the simulated engine used to end its streams with an error of its own name, which the gateway did not know
// and answered with a 500.

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { KeyStore } from '../../src/api/auth.ts';
import { modelIdFromName } from '../../src/api/gateway.ts';
import { silentLogger } from '../../src/util/log.ts';
import { ApiServer } from '../../src/api/server.ts';
import { createWorkerPool, type WorkerPool } from '../../src/runtime/worker-pool.ts';
import { rawRequest } from './http-client.ts';

describe('engine closed while a request runs', () => {
  let api: ApiServer;
  let pool: WorkerPool;

  before(async () => {
    api = new ApiServer({ keyStore: new KeyStore({ keys: [], tenants: new Map() }), logger: silentLogger });
    await api.listen(0);
    // Real time: 4000 tokens of an 8B model on one H100 take tens of seconds, so the request is still running.
    pool = await createWorkerPool({ engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: 1 }, workers: 1 });
    api.attach({ engine: pool.engine, tokenizer: pool.tokenizer, chatTemplate: pool.chatTemplate });
  });

  after(async () => {
    await api.shutdown(0);
  });

  test('sim engine: the gateway answers 503 shutting_down, not 500', async () => {
    const response = rawRequest(api.url, {
      path: '/v1/completions', body: { model: modelIdFromName(pool.engine.info.modelName), prompt: 'hello there', max_tokens: 4000, ignore_eos: true },
    });
    // Wait (bounded) until the request runs in the engine, then close the engine under it.
    for (let i = 0; i < 500 && pool.engine.stats().numRunning === 0; i++) await new Promise((resolve) => setTimeout(resolve, 10));
    assert.equal(pool.engine.stats().numRunning, 1, 'the request should be running before the engine closes');
    await pool.engine.close();
    const res = await response;
    assert.equal(res.status, 503, res.text);
    assert.equal(res.json().error.code, 'shutting_down');
  });

  test('a request after the close is refused with 503 too', async () => {
    const res = await rawRequest(api.url, { path: '/v1/completions', body: { model: modelIdFromName(pool.engine.info.modelName), prompt: 'again', max_tokens: 4 } });
    assert.equal(res.status, 503, res.text);
    assert.equal(res.json().error.code, 'shutting_down');
  });
});
