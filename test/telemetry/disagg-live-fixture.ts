// A live server with one simulated prefill worker and one simulated decode worker, for the tests that check which
// worker a disaggregated request's trace and metrics name: started before the tests of the describe block that calls
// disaggregatedLiveServer() and closed after them, with a completion that waits for the request's trace.

import assert from 'node:assert/strict';
import { after, before } from 'node:test';
import { rawRequest } from '../api/http-client.ts';
import { startLiveServer, type LiveServer } from './integration-fixture.ts';

export const LIVE = { timeout: 120_000 };
export const PREFILL = 'sim-prefill-0';
export const DECODE = 'sim-decode-0';

/** The parts of /v1/requests/{id}/trace these tests read. */
export interface DisaggTrace {
  worker: string | null;
  usage: { prompt_tokens: number; completion_tokens: number; cached_tokens: number };
  phases: { phase: string; worker?: string; attributes?: Record<string, string | number | boolean> }[];
}

export interface DisaggLiveServer {
  readonly url: string;
  /** The served model's name. */
  readonly model: string;
  /** Sends a greedy completion (ignore_eos) and returns its trace once the server has it. */
  complete(prompt: string, options: { maxTokens: number; stream: boolean }): Promise<DisaggTrace>;
}

/** Registers the server's start and close as hooks of the enclosing describe block. */
export function disaggregatedLiveServer(): DisaggLiveServer {
  let server: LiveServer | undefined;
  let model = '';
  before(async () => {
    // Every prompt is prefilled on the prefill worker (the fixture's policy and fixed estimates).
    server = await startLiveServer({ sim: true, disaggregated: { prefillWorkers: 1, decodeWorkers: 1 } });
    model = server.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });
  const url = (): string => {
    if (!server) throw new Error('the live server is not started yet (use it inside a test)');
    return server.url;
  };
  return {
    get url() { return url(); },
    get model() { return model; },
    async complete(prompt, { maxTokens, stream }) {
      const res = await rawRequest(url(), {
        path: '/v1/completions', body: { model, prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true, stream },
      });
      assert.equal(res.status, 200, res.text);
      const id = res.headers['x-request-id'] as string;
      const deadline = Date.now() + 30_000;
      for (;;) {
        const t = await rawRequest(url(), { path: `/v1/requests/${id}/trace` });
        if (t.status === 200) return t.json() as DisaggTrace;
        if (Date.now() > deadline) throw new Error(`no trace of ${id}: ${t.text}`);
        await new Promise((resolve) => setTimeout(resolve, 20));
      }
    },
  };
}
