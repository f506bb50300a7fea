// Where the grammar engine (XGrammar 0.1.27, the newest on npm) compiles a request into something other than what it
// says, and what Conduit does about each, on one server:
// - character classes it does not enforce as written: a class holding a character outside ASCII matched single bytes
//   ([à-ÿ]{2} gave two lone bytes, decoded as "��"; [\u4e00-\u9fa5] gave ASCII text), and \x inside a class took every
//   hex digit after it, as it does in an EBNF string literal ("\x41a" read as U+041A). Such a request is a 400
//   naming the field; the forms that are enforced (a class of one character, alternatives of characters, ASCII
//   classes, "\x41" "a") run, and their output matches;
// - guided_choice whose choices share prefixes: the choices side by side as EBNF alternatives ("521" | "600" | "601")
//   compiled into an automaton that also took "520" (after "52", the "0" of "600"); written as a tree of their common
//   prefixes they cannot be mixed;
// - a string schema's pattern with an alternation at its top ("521|60[01]"): XGrammar wrote the pattern between the
//   string's quotes without a group around it, so each branch kept only one quote and the output was 600" or "521, not
//   JSON. Each pattern now goes to it in a group of its own: the output parses and the string matches;
// - a JSON schema's string enum whose values share prefixes: compiled side by side, {"enum": ["521", "600", "601"]}
//   took "520"; the enum now goes to it as a pattern that is the tree of the values' common prefixes, values with '"',
//   '\' or control characters as their JSON text, and so does an anyOf/oneOf of nothing but string consts and enums
//   (which took "520" the same way); an enum of numbers, {"enum": [521, 600, 601]}, took 520 too, and goes to it as an
//   anyOf of one rule per value;
// - a property name holding '"' or '\': written into the grammar as it is, it was XGrammar's "EBNF lexer error", and
//   a backslash or a tab came out raw (not JSON); the name now goes to it escaped, and comes out as JSON writes it;
// - integer bounds: written as a regex of digit patterns, some bounds came out wider or narrower (100..110 allowed
//   100..119, 2000..2100 allowed 2000..2999, a negative minimum refused -105..-1, 64..190069 allowed 190070). Such
//   bounds are refused (400 unsupported_parameter naming the keyword); bounds it enforces keep running, and a
//   logit_bias pushing the output past them cannot get it there.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };

describe('guided decoding around the grammar engine\'s limits', () => {
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

  describe('character classes the grammar engine does not enforce', () => {
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
        [{ guided_grammar: 'root ::= "\\x41a"' }, 'guided_grammar'],
        [{ structured_outputs: { grammar: 'root ::= "x" ("\\x41bc" | "y")' } }, 'structured_outputs.grammar'],
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
        [{ guided_grammar: 'root ::= "\\x41" "a" | "\\u0041b" | "\\x42"' }, /^(Aa|Ab|B)$/],
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

  describe('guided_choice with shared prefixes', () => {
    it('the output is one of the choices, even when the model favours mixing two of them', E2E, async () => {
      const choices = ['521', '600', '601'];
      // A model that favours "0" everywhere, and "5" to start: left to the bare alternatives' automaton, "52" then "0".
      const logit_bias = { [await tokenId('0')]: 100, [await tokenId('5')]: 50 };
      const completion = await client.completions.create({
        model, prompt: 'Code:', max_tokens: 8, temperature: 0, logit_bias, guided_choice: choices,
      } as OpenAI.CompletionCreateParamsNonStreaming);
      assert.equal(completion.choices[0]!.text, '521');
      assert.equal(completion.choices[0]!.finish_reason, 'stop');

      const chat = await client.chat.completions.create({
        model, messages: [{ role: 'user', content: 'Pick a code.' }], max_tokens: 8, temperature: 0, logit_bias, guided_choice: choices,
      } as OpenAI.ChatCompletionCreateParamsNonStreaming);
      assert.equal(chat.choices[0]!.message.content, '521');

      // Sampled, with the digits a list's choices mix favoured: every output is a choice.
      const mixed = ['002', '112', '202', '111', '121'];
      const sampled = await client.completions.create({
        model, prompt: 'Code:', max_tokens: 8, temperature: 1, seed: 3, n: 8, guided_choice: mixed,
        logit_bias: { [await tokenId('0')]: 20, [await tokenId('1')]: 20, [await tokenId('2')]: 20 },
      } as OpenAI.CompletionCreateParamsNonStreaming);
      for (const choice of sampled.choices) assert.ok(mixed.includes(choice.text), `${JSON.stringify(choice.text)} is not a choice`);
      await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
    });

    it('choices that are prefixes of one another, many deep, still compile and run', E2E, async () => {
      const choices = Array.from({ length: 200 }, (_, i) => 'ab'.repeat(i) + 'c');
      choices.push('a', 'ab');
      const completion = await client.completions.create({
        model, prompt: 'Word:', max_tokens: 64, temperature: 1, seed: 1, n: 4, guided_choice: choices,
      } as OpenAI.CompletionCreateParamsNonStreaming);
      for (const choice of completion.choices) {
        if (choice.finish_reason === 'stop') assert.ok(choices.includes(choice.text), `${JSON.stringify(choice.text)} is not a choice`);
        else assert.ok(choices.some((c) => c.startsWith(choice.text)), `${JSON.stringify(choice.text)} starts no choice`);
      }
      await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
    });
  });

  describe('guided JSON: a pattern that is an alternation', () => {
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

  describe('guided JSON: a string enum with shared prefixes', () => {
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

  describe('guided JSON: anyOf/oneOf of string consts, and enums with escaped characters', () => {
    it('the value is one of the branches, even when the model favours mixing two of them', E2E, async () => {
      const codes = ['521', '600', '601'];
      const logit_bias = { [await tokenId('0')]: 100, [await tokenId('5')]: 50 };
      const shapes = {
        anyOf: { anyOf: codes.map((code) => ({ const: code })) },
        oneOf: { type: 'string', oneOf: [{ const: '521', description: 'old' }, { type: 'string', enum: ['600', '601'] }] },
      };
      for (const [name, code] of Object.entries(shapes)) {
        const schema = { type: 'object', properties: { code }, required: ['code'], additionalProperties: false };
        for (const seed of [1, 2]) {
          const chat = await client.chat.completions.create({
            model, messages: [{ role: 'user', content: 'Pick a code, as JSON.' }], max_tokens: 40, temperature: seed === 1 ? 0 : 1, seed,
            logit_bias, response_format: { type: 'json_schema', json_schema: { name: 'code', schema, strict: true } },
          });
          const text = chat.choices[0]!.message.content!;
          const value = JSON.parse(text) as { code: string };
          assert.ok(codes.includes(value.code), `${name}: ${text}: not one of ${codes.join(', ')}`);
        }
      }
      // Values JSON writes with escapes: a quote, a backslash, a newline, side by side with plain ones sharing prefixes.
      const escaped = ['5"1', '5\\0', '6\n0', '601', '600', '5"0\t'];
      const schema = { type: 'object', properties: { v: { enum: escaped } }, required: ['v'], additionalProperties: false };
      const chat = await client.chat.completions.create({
        model, messages: [{ role: 'user', content: 'Pick one, as JSON.' }], max_tokens: 40, temperature: 1, seed: 5, n: 8,
        logit_bias, response_format: { type: 'json_schema', json_schema: { name: 'v', schema } },
      });
      for (const choice of chat.choices) {
        const value = JSON.parse(choice.message.content!) as { v: string };
        assert.ok(escaped.includes(value.v), `${choice.message.content}: not one of the enum`);
      }
      await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
    });
  });

  describe('guided JSON: an enum of numbers, and an anyOf of number consts', () => {
    it('the value is one of them, even when the model favours mixing two of them', E2E, async () => {
      const codes = [521, 600, 601];
      // A model that favours "0" everywhere, and "5" to start: left to the bare alternatives' automaton, 52 then 0.
      const logit_bias = { [await tokenId('0')]: 100, [await tokenId('5')]: 50 };
      const shapes = { enum: { enum: codes }, anyOf: { anyOf: codes.map((code) => ({ const: code })) } };
      for (const [name, code] of Object.entries(shapes)) {
        const schema = { type: 'object', properties: { code }, required: ['code'], additionalProperties: false };
        for (const seed of [1, 2]) {
          const chat = await client.chat.completions.create({
            model, messages: [{ role: 'user', content: 'Pick a code, as JSON.' }], max_tokens: 40, temperature: seed === 1 ? 0 : 1, seed,
            logit_bias, response_format: { type: 'json_schema', json_schema: { name: 'code', schema, strict: true } },
          });
          const text = chat.choices[0]!.message.content!;
          assert.ok(codes.includes((JSON.parse(text) as { code: number }).code), `${name}: ${text}: not one of ${codes.join(', ')}`);
        }
      }
      await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
    });
  });

  describe('guided JSON: property names JSON writes with escapes', () => {
    it('a name holding a quote, a backslash or a tab runs, and comes out as JSON writes it', E2E, async () => {
      const names = ['say "hi"', 'C:\\temp', 'a\\b', 'tab\there'];
      const schema = {
        type: 'object', properties: Object.fromEntries(names.map((name) => [name, { type: 'boolean' }])), required: names,
        additionalProperties: false,
      };
      const chat = await client.chat.completions.create({
        model, messages: [{ role: 'user', content: 'Fill in the flags, as JSON.' }], max_tokens: 120, temperature: 1, seed: 2, n: 2,
        response_format: { type: 'json_schema', json_schema: { name: 'flags', schema, strict: true } },
      });
      for (const choice of chat.choices) {
        const text = choice.message.content!;
        assert.equal(choice.finish_reason, 'stop', text);
        assert.deepEqual(Object.keys(JSON.parse(text) as object), names, text);
      }
      await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
    });
  });

  describe('guided JSON: integer bounds', () => {
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
        [{ minimum: 339, maximum: 599 }, 'maximum'],
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
        { exclusiveMinimum: 0, exclusiveMaximum: 10 }, { minimum: 62, maximum: 624 }, { minimum: 655, maximum: 921 }, { minimum: 1234, maximum: 5678 },
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
});
