// A JSON schema's string enum whose values share prefixes: the value is one of them. XGrammar 0.1.27 compiles an
// enum's values side by side, and its automaton took "520" for {"enum": ["521", "600", "601"]} (after "52", the "0"
// of "600"); the enum now goes to it as a pattern that is the tree of the values' common prefixes.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };

describe('guided JSON: a string enum with shared prefixes', () => {
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

  /** The vocabulary's id of a one-token text (a digit: the built-in model's tokenizer writes each digit alone). */
  async function tokenId(text: string): Promise<number> {
    const response = await fetch(`${server.url}/tokenize`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: text, add_special_tokens: false }),
    });
    const { tokens } = await response.json() as { tokens: number[] };
    return tokens.at(-1)!;
  }

  it('the value is one of the enum, even when the model favours mixing two of them', E2E, async () => {
    const codes = ['521', '600', '601'];
    const schema = { type: 'object', properties: { code: { enum: codes } }, required: ['code'], additionalProperties: false };
    // A model that favours "0" everywhere, and "5" to start: left to the bare alternatives' automaton, "52" then "0".
    const logit_bias = { [await tokenId('0')]: 100, [await tokenId('5')]: 50 };
    for (const seed of [1, 2, 3]) {
      const chat = await client.chat.completions.create({
        model, messages: [{ role: 'user', content: 'Pick a code, as JSON.' }], max_tokens: 40, temperature: seed === 1 ? 0 : 1, seed,
        logit_bias, response_format: { type: 'json_schema', json_schema: { name: 'code', schema, strict: true } },
      });
      const text = chat.choices[0]!.message.content!;
      const value = JSON.parse(text) as { code: string };
      assert.ok(codes.includes(value.code), `${text}: not one of ${codes.join(', ')}`);
    }
    // Values with regex characters, one a prefix of another, and the empty string.
    const odd = ['a.b', 'a|b', 'a', '', '(x)?', 'a.bc'];
    const chat = await client.chat.completions.create({
      model, messages: [{ role: 'user', content: 'Pick one, as JSON.' }], max_tokens: 40, temperature: 1, seed: 4, n: 8,
      response_format: { type: 'json_schema', json_schema: { name: 'v', schema: { type: 'object', properties: { v: { type: 'string', enum: odd } }, required: ['v'] } } },
    });
    for (const choice of chat.choices) {
      const value = JSON.parse(choice.message.content!) as { v: string };
      assert.ok(odd.includes(value.v), `${choice.message.content}: not one of the enum`);
    }
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });
});
