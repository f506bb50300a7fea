// min_tokens with ignore_eos, as vLLM: min_tokens holds the model's EOS back (-inf) for its first min_tokens outputs
// even when ignore_eos is set, so none of them is an EOS; after them the EOS may be drawn and, ignored, does not end
// the output. It used to be held back only without ignore_eos, and the first outputs were EOS ids when the model (or a
// logit_bias) favoured them. The same for an end-of-generation id only the model's generation_config.json lists,
// which ignore_eos had dropped from what min_tokens holds.
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 90_000 };

describe('min_tokens with ignore_eos', () => {
  let server: TestServer;
  let eosId: number;

  before(async () => {
    server = await startTestServer();
    eosId = server.running.api.gateway.servedModels[0]!.backend.tokenizer.eosId!;
  });
  after(async () => {
    await server?.close();
  });

  it('completions: no EOS among the first min_tokens outputs; after them the pushed EOS is drawn and ignored', E2E, async () => {
    const response = await rawRequest(server.url, {
      path: '/v1/completions',
      body: {
        prompt: 'Hello there', temperature: 0, max_tokens: 6, min_tokens: 4, ignore_eos: true,
        logit_bias: { [eosId]: 100 }, return_token_ids: true,
      },
    });
    assert.equal(response.status, 200, response.text);
    const [choice] = response.json().choices as { token_ids: number[]; finish_reason: string }[];
    assert.equal(choice!.token_ids.length, 6);
    assert.ok(!choice!.token_ids.slice(0, 4).includes(eosId), `EOS ${eosId} within min_tokens: ${choice!.token_ids}`);
    assert.deepEqual(choice!.token_ids.slice(4), [eosId, eosId]);
    assert.equal(choice!.finish_reason, 'length');
  });

  it('chat: the same hold', E2E, async () => {
    const response = await rawRequest(server.url, {
      path: '/v1/chat/completions',
      body: {
        messages: [{ role: 'user', content: 'Hi' }], temperature: 0, max_tokens: 5, min_tokens: 3, ignore_eos: true,
        logit_bias: { [eosId]: 100 }, return_token_ids: true,
      },
    });
    assert.equal(response.status, 200, response.text);
    const [choice] = response.json().choices as { token_ids: number[]; finish_reason: string }[];
    assert.ok(!choice!.token_ids.slice(0, 3).includes(eosId), `EOS ${eosId} within min_tokens: ${choice!.token_ids}`);
    assert.deepEqual(choice!.token_ids.slice(3), [eosId, eosId]);
  });
});

describe('min_tokens with ignore_eos, an end-of-generation id of generation_config.json', () => {
  // An id the tokenizer does not count as an end (a plain word piece), listed by the file as one.
  const LISTED = 500;
  let server: TestServer;
  let dir: string;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-min-tokens-eos-'));
    writeFileSync(join(dir, 'generation_config.json'), JSON.stringify({ eos_token_id: [2, LISTED] }));
    server = await startTestServer({ flags: ['--generation-config', dir] });
  });
  after(async () => {
    await server?.close();
    rmSync(dir, { recursive: true, force: true });
  });

  it('is held back for min_tokens, then drawn and ignored; without ignore_eos it ends the output after them', E2E, async () => {
    const body = { prompt: 'Hello there', temperature: 0, max_tokens: 6, min_tokens: 4, logit_bias: { [LISTED]: 100 }, return_token_ids: true };
    const ignored = await rawRequest(server.url, { path: '/v1/completions', body: { ...body, ignore_eos: true } });
    assert.equal(ignored.status, 200, ignored.text);
    const [choice] = ignored.json().choices as { token_ids: number[]; finish_reason: string }[];
    assert.ok(!choice!.token_ids.slice(0, 4).includes(LISTED), `${LISTED} within min_tokens: ${choice!.token_ids}`);
    assert.deepEqual(choice!.token_ids.slice(4), [LISTED, LISTED]);
    assert.equal(choice!.finish_reason, 'length');
    const ended = await rawRequest(server.url, { path: '/v1/completions', body });
    assert.equal(ended.status, 200, ended.text);
    const [stopped] = ended.json().choices as { token_ids: number[]; finish_reason: string; stop_reason: number }[];
    assert.equal(stopped!.token_ids.length, 5, String(stopped!.token_ids));
    assert.deepEqual([stopped!.finish_reason, stopped!.stop_reason], ['stop', LISTED]);
  });
});
