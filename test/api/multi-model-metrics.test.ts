// Several models behind one server: a request refused in validation is counted under the model it named (when that
// model is served), not under the first one; a name that is not served does not become a label of its own.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { silentLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { writeTinyModel } from '../helpers/cpu-model.ts';
import { parseExposition, total, value, type Exposition } from '../telemetry/exposition.ts';
import { rawRequest } from './http-client.ts';

function writeModel(dir: string, file: string, seed: number): string {
  return writeTinyModel(join(dir, file), { seed, name: `metrics ${seed}` });
}

async function scrape(url: string): Promise<Exposition> {
  return parseExposition((await rawRequest(url, { path: '/metrics' })).text);
}

/** The exposition once `ready` holds of it (a request is counted when its trace ends, just after its answer). */
async function scrapeUntil(url: string, ready: (x: Exposition) => boolean): Promise<Exposition> {
  const deadline = Date.now() + 10_000;
  for (;;) {
    const x = await scrape(url);
    if (ready(x) || Date.now() > deadline) return x;
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

describe('validation refusals with several models served', () => {
  let dir: string;
  let server: RunningServer;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-multi-model-metrics-'));
    const config = parseServeConfig(['--port', '0', '--log-level', 'silent', '--kv-cache-memory', '8MiB', '--threads', '1',
      '--worker-restart-limit', '0', '--model', `alpha=${writeModel(dir, 'a.gguf', 3)}`, '--model', `beta=${writeModel(dir, 'b.gguf', 4)}`], {});
    if (config === 'help') throw new Error('unexpected --help');
    server = await startServer(config, silentLogger);
  });
  after(async () => {
    await server?.api.shutdown(0);
    rmSync(dir, { recursive: true, force: true });
  });

  it('counts a request refused in validation under the served model it named', async () => {
    // An invalid field (the body does not parse) and a valid body asking for more sequences than allowed.
    const bad = await rawRequest(server.url, { path: '/v1/completions', body: { model: 'beta', prompt: 'Hi', max_tokens: 2, temperature: -1 } });
    assert.equal(bad.status, 400);
    const many = await rawRequest(server.url, { path: '/v1/chat/completions', body: { model: 'beta', messages: [{ role: 'user', content: 'Hi' }], n: 100_000 } });
    assert.equal(many.status, 400);

    const requests = (x: Exposition, model: string): number =>
      value(x, 'conduit_requests_total', { model, tenant: 'anonymous', finish_reason: 'error' }) ?? 0;
    const x = await scrapeUntil(server.url, (e) => requests(e, 'beta') >= 2);
    assert.equal(requests(x, 'beta'), 2);
    assert.equal(requests(x, 'alpha'), 0, 'refusals of beta requests counted under alpha');
    assert.equal(total(x, 'conduit_request_errors_total', { model: 'beta', origin: 'client' }), 2);
    assert.equal(total(x, 'conduit_request_errors_total', { model: 'alpha', origin: 'client' }), 0);
  });

  it('counts a request naming no model under the default model, and one naming a model not served without its name', async () => {
    const none = await rawRequest(server.url, { path: '/v1/completions', body: { prompt: 'Hi', max_tokens: 2, temperature: -1 } });
    assert.equal(none.status, 400);
    const before = await scrape(server.url);
    const unknown = await rawRequest(server.url, { path: '/v1/completions', body: { model: 'gamma-0123', prompt: 'Hi', max_tokens: 2 } });
    assert.equal(unknown.status, 404);

    const notFound = (x: Exposition): number =>
      value(x, 'conduit_request_errors_total', { model: 'alpha', error_type: 'model_not_found', origin: 'client' }) ?? 0;
    const x = await scrapeUntil(server.url, (e) => notFound(e) > notFound(before));
    assert.equal(notFound(x), notFound(before) + 1);
    assert.ok((value(x, 'conduit_request_errors_total', { model: 'alpha', error_type: none.json().error.code, origin: 'client' }) ?? 0) >= 1);
    assert.equal(x.samples.some((s) => Object.values(s.labels).some((v) => v.includes('gamma'))), false, 'a label took the unknown name');
  });
});
