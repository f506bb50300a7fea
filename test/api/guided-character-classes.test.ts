// Character classes the grammar engine (XGrammar 0.1.27) does not enforce as written: a class holding a character
// outside ASCII matched single bytes ([à-ÿ]{2} gave two lone bytes, decoded as "��"; [\u4e00-\u9fa5] gave ASCII
// text), and \x inside a class took every hex digit after it. Such a request is a 400 naming the field; the forms
// that are enforced (a class of one character, alternatives of characters, ASCII classes) run, and their output
// matches.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };

describe('guided decoding: character classes the grammar engine does not enforce', () => {
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

  const complete = (extra: object) => client.completions.create({
    model, prompt: 'Word:', max_tokens: 12, temperature: 1, seed: 5, n: 4, ...extra,
  } as OpenAI.CompletionCreateParamsNonStreaming);

  it('a class holding a character outside ASCII, or \\x read with the hex digits after it: a 400 naming the field', E2E, async () => {
    const cases: [object, string][] = [
      [{ guided_regex: '[à-ÿ]{2}' }, 'guided_regex'],
      [{ guided_regex: '[a-zäöüß]+' }, 'guided_regex'],
      [{ guided_regex: '[\\u4e00-\\u9fa5]{2}' }, 'guided_regex'],
      [{ guided_regex: '[^é]{2}' }, 'guided_regex'],
      [{ guided_regex: '[\\x41-\\x5a0-9]{2}' }, 'guided_regex'],
      [{ guided_regex: '\\x41a' }, 'guided_regex'],
      [{ guided_regex: '[\\p{L}]' }, 'guided_regex'],
      [{ structured_outputs: { regex: '[aé]{3}' } }, 'structured_outputs.regex'],
      [{ guided_json: { type: 'object', properties: { name: { type: 'string', pattern: '[à-ÿ]{2}' } }, required: ['name'] } },
        'guided_json.properties.name.pattern'],
      [{ guided_grammar: 'root ::= [aé] [aé]' }, 'guided_grammar'],
    ];
    for (const [extra, param] of cases) {
      const error = await complete(extra).then(() => undefined, (err: unknown) => err);
      assert.ok(error instanceof OpenAI.BadRequestError, `${JSON.stringify(extra)}: ${String(error)}`);
      const body = error.error as { param: string; code: string; message: string };
      assert.equal(body.param, param, JSON.stringify(body));
      assert.equal(body.code, 'unsupported_parameter', JSON.stringify(body));
    }
    await waitFor(() => engineIdle(server.engine), 'nothing queued');
  });

  it('the forms the grammar engine enforces run, and every output matches', E2E, async () => {
    const cases: [object, RegExp][] = [
      [{ guided_regex: '(é|ü|[a-z]){3}' }, /^(é|ü|[a-z]){3}$/u],
      [{ guided_regex: '[é]{2}' }, /^é{2}$/u],
      [{ guided_regex: '[\\x41-\\x5a]{2}[0-9]' }, /^[A-Z]{2}[0-9]$/],
      [{ guided_regex: '[\\u0041-\\u005a0-9]{3}' }, /^[A-Z0-9]{3}$/],
      [{ guided_grammar: 'root ::= ("é" | "ü" | [a-z]) ("é" | "ü" | [a-z])' }, /^(é|ü|[a-z]){2}$/u],
    ];
    for (const [extra, pattern] of cases) {
      const completion = await complete(extra);
      for (const choice of completion.choices) {
        assert.equal(choice.finish_reason, 'stop', `${JSON.stringify(extra)}: ${JSON.stringify(choice)}`);
        assert.match(choice.text, pattern, JSON.stringify(extra));
      }
    }
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });
});
