// Integer bounds in a JSON schema. XGrammar 0.1.27 writes minimum/maximum as a regex of digit patterns, and for some
// bounds that regex (or the automaton it builds from it) is wider or narrower than the bounds: 100..110 allowed
// 100..119, 2000..2100 allowed 2000..2999, a negative minimum refused -105..-1, 64..190069 allowed 190070. Such
// bounds are refused (400 unsupported_parameter naming the keyword); bounds it enforces keep running, and a
// logit_bias pushing the output past them cannot get it there.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };

describe('guided JSON: integer bounds', () => {
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

  const objectWith = (bounds: Record<string, number>) => ({
    type: 'object', properties: { n: { type: 'integer', ...bounds } }, required: ['n'], additionalProperties: false,
  });
  const ask = (schema: Record<string, unknown>, extra: Record<string, unknown> = {}) => client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'A number, as JSON.' }], max_tokens: 60, temperature: 1, ...extra,
    response_format: { type: 'json_schema', json_schema: { name: 'n', schema, strict: true } },
  });

  it('bounds the grammar engine does not enforce as written are refused, naming the keyword', E2E, async () => {
    const refused: [Record<string, number>, string][] = [
      [{ minimum: 100, maximum: 110 }, 'maximum'],
      [{ minimum: 0, maximum: 120 }, 'maximum'],
      [{ minimum: 2000, maximum: 2100 }, 'maximum'],
      [{ minimum: 64, maximum: 190069 }, 'maximum'],
      [{ minimum: 109, maximum: 409 }, 'maximum'],
      [{ minimum: -105 }, 'minimum'],
      [{ minimum: 5 }, 'minimum'],
      [{ maximum: -105 }, 'maximum'],
      [{ exclusiveMinimum: 99, exclusiveMaximum: 111 }, 'exclusiveMaximum'],
      [{ minimum: 5, exclusiveMinimum: 10 }, 'exclusiveMinimum'],
      [{ minimum: 0, maximum: 2 ** 60 }, 'maximum'],
    ];
    for (const [bounds, keyword] of refused) {
      const error = await ask(objectWith(bounds)).then(() => undefined, (caught: unknown) => caught);
      assert.ok(error instanceof OpenAI.BadRequestError, `${JSON.stringify(bounds)}: expected a 400, got ${String(error)}`);
      assert.equal(error.code, 'unsupported_parameter', JSON.stringify(bounds));
      assert.equal(error.param, `response_format.json_schema.schema.properties.n.${keyword}`, JSON.stringify(bounds));
    }
    assert.equal((await fetch(`${server.url}/health`)).status, 200, 'the server stays up');
  });

  it('bounds it enforces run, and the output stays within them', E2E, async () => {
    const kept: Record<string, number>[] = [
      { minimum: 0 }, { minimum: 1 }, { minimum: 15 }, { maximum: -1 }, { minimum: 0, maximum: 129 }, { minimum: 1, maximum: 9 },
      { minimum: 18, maximum: 65 }, { minimum: 2000, maximum: 2999 }, { minimum: 120, maximum: 128 }, { minimum: -50, maximum: 50 },
      { exclusiveMinimum: 0, exclusiveMaximum: 10 },
    ];
    for (const bounds of kept) {
      const low = bounds.minimum ?? (bounds.exclusiveMinimum === undefined ? -Infinity : bounds.exclusiveMinimum + 1);
      const high = bounds.maximum ?? (bounds.exclusiveMaximum === undefined ? Infinity : bounds.exclusiveMaximum - 1);
      for (const seed of [1, 2]) {
        const chat = await ask(objectWith(bounds), { seed, n: 3 });
        for (const choice of chat.choices) {
          const text = choice.message.content!;
          const value = JSON.parse(text) as { n: number };
          assert.ok(Number.isInteger(value.n) && value.n >= low && value.n <= high, `${JSON.stringify(bounds)}: ${text}`);
        }
      }
    }
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });
});
