// A string schema's pattern with an alternation at its top ("521|60[01]"): XGrammar 0.1.27 wrote the pattern between
// the string's quotes without a group around it, so each branch kept only one quote and the output was 600" or "521,
// not JSON. Each pattern now goes to it in a group of its own: the output parses and the string matches.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };

describe('guided JSON: a pattern that is an alternation', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;

  before(async () => {
    server = await startTestServer();
    client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 90_000 });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('the output is JSON and the string matches the whole pattern', E2E, async () => {
    const cases: [string, RegExp][] = [['521|60[01]', /^(?:521|60[01])$/], ['^yes|no$', /^(?:yes|no)$/], ['a(b|c)|d', /^(?:a(b|c)|d)$/]];
    for (const [pattern, matches] of cases) {
      const schema = { type: 'object', properties: { code: { type: 'string', pattern } }, required: ['code'], additionalProperties: false };
      for (const seed of [1, 2, 3]) {
        const chat = await client.chat.completions.create({
          model, messages: [{ role: 'user', content: 'A code, as JSON.' }], max_tokens: 120, temperature: 1, seed, n: 4,
          response_format: { type: 'json_schema', json_schema: { name: 'code', schema, strict: true } },
        });
        for (const choice of chat.choices) {
          const text = choice.message.content!;
          assert.equal(choice.finish_reason, 'stop', `${pattern}: ${JSON.stringify(text)}`);
          let value: { code: string };
          assert.doesNotThrow(() => { value = JSON.parse(text); }, `${pattern}: ${JSON.stringify(text)} is not JSON`);
          assert.match(value!.code, matches, `${pattern}: ${JSON.stringify(text)}`);
        }
      }
    }
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });
});
