// A request's priority and deadline_ms against the server's scheduling policy: a field the policy never reads is a
// 400 naming it and the policy (vLLM refuses a non-zero priority without priority scheduling), never silently
// ignored; the deadline policy breaks ties by priority, so it takes both. A gateway that does not know its workers'
// policy takes both. A refused request costs its tenant nothing and holds no pending slot.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { KeyStore, parseKeysFile, type Tenant } from '../../src/api/auth.ts';
import { modelIdFromName } from '../../src/api/gateway.ts';
import { silentLogger } from '../../src/util/log.ts';
import { ApiServer } from '../../src/api/server.ts';
import type { SchedulingPolicy } from '../../src/engine/types.ts';
import { createWorkerPool, type WorkerPool } from '../../src/runtime/worker-pool.ts';
import { rawRequest, type RawResponse } from './http-client.ts';

const KEY = 'sk-sched-0001';
const TENANT: Tenant = { name: 'sched', limits: { requestsPerMinute: 10, tokensPerMinute: 5000 }, cacheSalt: undefined };
const auth = { Authorization: `Bearer ${KEY}` };

interface Served {
  api: ApiServer;
  pool: WorkerPool;
  model: string;
  close(): Promise<void>;
}

/** An API server whose gateway is told `policy` (undefined: not told), over one simulated worker that runs it. */
async function serve(policy: SchedulingPolicy | undefined, options: { limited?: boolean; maxPendingRequests?: number } = {}): Promise<Served> {
  // The rate limiter's clock stands still: nothing refills during a test.
  const api = new ApiServer({
    keyStore: new KeyStore(parseKeysFile(`${KEY} sched${options.limited ? ' 10 5000' : ''}\n`)), logger: silentLogger, clock: () => 1_000_000,
    maxPendingRequests: options.maxPendingRequests ?? 256, ...(policy !== undefined ? { schedulingPolicy: policy } : {}),
  });
  await api.listen(0);
  const pool = await createWorkerPool({
    engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: 100 }, workers: 1, ...(policy !== undefined ? { policy } : {}),
  });
  api.attach({ engine: pool.engine, tokenizer: pool.tokenizer, chatTemplate: pool.chatTemplate });
  return {
    api, pool, model: modelIdFromName(pool.engine.info.modelName),
    async close() {
      await api.shutdown(0);
      await pool.engine.close();
    },
  };
}

const ENDPOINTS = [
  { path: '/v1/completions', body: (model: string) => ({ model, prompt: 'hello there', max_tokens: 2 }) },
  { path: '/v1/chat/completions', body: (model: string) => ({ model, messages: [{ role: 'user', content: 'hello' }], max_tokens: 2 }) },
  { path: '/v1/responses', body: (model: string) => ({ model, input: 'hello', max_output_tokens: 2 }) },
];

const FIELDS: { extra: object; param: string; refusedUnder: readonly (SchedulingPolicy | undefined)[] }[] = [
  { extra: { priority: 5 }, param: 'priority', refusedUnder: ['fcfs'] },
  { extra: { priority: -3 }, param: 'priority', refusedUnder: ['fcfs'] },
  { extra: { priority: 0 }, param: 'priority', refusedUnder: [] },
  { extra: { deadline_ms: 1000 }, param: 'deadline_ms', refusedUnder: ['fcfs', 'priority'] },
  { extra: { deadline_ms: 0 }, param: 'deadline_ms', refusedUnder: ['fcfs', 'priority'] },
];

function assertRefused(response: RawResponse, param: string, policy: string): void {
  assert.equal(response.status, 400, response.text);
  const { error } = response.json();
  assert.equal(error.type, 'invalid_request_error');
  assert.equal(error.code, 'invalid_value');
  assert.equal(error.param, param);
  assert.match(error.message, new RegExp(`'${param}'`));
  assert.match(error.message, new RegExp(`scheduling policy is ${policy}\\b`));
}

for (const policy of ['fcfs', 'priority', 'deadline', undefined] as const) {
  describe(`scheduling fields with the gateway told ${policy === undefined ? 'no policy' : `--scheduling-policy ${policy}`}`, () => {
    let served: Served;
    before(async () => {
      served = await serve(policy);
    });
    after(async () => {
      await served?.close();
    });

    for (const { extra, param, refusedUnder } of FIELDS) {
      const refused = refusedUnder.includes(policy);
      it(`${JSON.stringify(extra)} is ${refused ? 'refused, naming the field and the policy' : 'taken'} on every generation endpoint`, async () => {
        for (const endpoint of ENDPOINTS) {
          const response = await rawRequest(served.api.url, { path: endpoint.path, headers: auth, body: { ...endpoint.body(served.model), ...extra } });
          if (refused) assertRefused(response, param, policy!);
          else assert.equal(response.status, 200, `${endpoint.path}: ${response.text}`);
        }
      });
    }
  });
}

describe('a request refused for its scheduling fields costs nothing', () => {
  let served: Served;
  before(async () => {
    // One pending sequence at most: a refusal that kept its slot would turn the next request away with a 503.
    served = await serve('fcfs', { limited: true, maxPendingRequests: 1 });
  });
  after(async () => {
    await served?.close();
  });

  it('its tenant keeps its request and tokens, and the pending slot stays free', async () => {
    const { limiter } = served.api;
    const { model } = served;
    for (const stream of [false, true]) {
      for (const extra of [{ priority: 1 }, { deadline_ms: 50 }]) {
        const response = await rawRequest(served.api.url, {
          path: '/v1/completions', headers: auth, body: { model, prompt: 'hello there', max_tokens: 20, stream, ...extra },
        });
        assertRefused(response, Object.keys(extra)[0]!, 'fcfs');
        assert.equal(response.headers['x-ratelimit-remaining-requests'], undefined, 'refused before admission');
      }
    }
    assert.deepEqual(limiter.remaining(TENANT), { requests: 10, tokens: 5000 });
    assert.equal(limiter.inFlight(TENANT), 0);
    const ran = await rawRequest(served.api.url, {
      path: '/v1/completions', headers: auth, body: { model, prompt: 'hello there', max_tokens: 2, ignore_eos: true, priority: 0 },
    });
    assert.equal(ran.status, 200, ran.text);
    const { usage } = ran.json();
    assert.deepEqual(limiter.remaining(TENANT), { requests: 9, tokens: 5000 - usage.prompt_tokens - usage.completion_tokens });
  });
});
