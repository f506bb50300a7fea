// stop_reason when the client lists the model's EOS in stop_token_ids. vLLM's check_stop tests the EOS (unless
// ignore_eos) before stop_token_ids, and only the latter sets stop_reason, so an ending on the EOS reports null
// whether or not the list names it; with ignore_eos, the EOS listed there ends the output as a stop token id and
// reports its id. Conduit reported the id in both cases. The built-in synthetic model (Llama 2's vocabulary, EOS 2);
// logit_bias makes the EOS the token sampled once min_tokens lets it through.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { parseSse, rawRequest } from './http-client.ts';
import { startTestServer, type TestServer } from './e2e-fixture.ts';

const EOS = 2;

describe('stop_reason of the EOS listed in stop_token_ids', () => {
  let server: TestServer;
  let model: string;

  before(async () => {
    server = await startTestServer();
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  const base = { prompt: 'Hello there', max_tokens: 8, temperature: 0, logit_bias: { [EOS]: 100 }, min_tokens: 2, return_token_ids: true };

  async function ending(path: string, body: object): Promise<{ finish: string; stop: unknown; last: number | undefined }> {
    const response = await rawRequest(server.url, { path, body: { model, ...base, ...body } });
    assert.equal(response.status, 200, response.text);
    if (!('stream' in body)) {
      const choice = response.json().choices[0];
      return { finish: choice.finish_reason, stop: choice.stop_reason, last: choice.token_ids.at(-1) };
    }
    const choices = parseSse(response.text).filter((e) => e.data !== '[DONE]').flatMap((e) => JSON.parse(e.data).choices);
    const final = choices.find((c: any) => c.finish_reason !== null);
    return { finish: final.finish_reason, stop: final.stop_reason, last: choices.flatMap((c: any) => c.token_ids ?? []).at(-1) };
  }

  it('ending on the EOS: null, listed or not, completions and chat, streamed or not', async () => {
    const chat = { messages: [{ role: 'user', content: 'hi' }] };
    for (const [path, extra] of [['/v1/completions', {}], ['/v1/chat/completions', chat]] as const) {
      for (const stream of [{}, { stream: true }]) {
        for (const listed of [{}, { stop_token_ids: [EOS] }, { stop_token_ids: [7, EOS] }]) {
          const got = await ending(path, { ...extra, ...stream, ...listed });
          assert.deepEqual(got, { finish: 'stop', stop: null, last: EOS }, `${path} ${JSON.stringify({ ...stream, ...listed })}`);
        }
      }
    }
  });

  it('with ignore_eos, the EOS listed in stop_token_ids ends the output as a stop token id: its id', async () => {
    assert.deepEqual(await ending('/v1/completions', { ignore_eos: true, stop_token_ids: [EOS] }), { finish: 'stop', stop: EOS, last: EOS });
    // Not listed: ignore_eos goes past it, to max_tokens.
    assert.deepEqual(await ending('/v1/completions', { ignore_eos: true }), { finish: 'length', stop: null, last: EOS });
  });
});
