// Structured outputs through HTTP on the built-in synthetic model, whose free text is noise: only the grammar can
// make its output parse, so every parse here is the grammar's doing.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { rawRequest } from './http-client.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { assertPerson, PERSON_SCHEMA, schemaErrors } from './guided-fixtures.ts';

/** A hang guard, not a speed requirement. */
const E2E = { timeout: 120_000 };
const messages = [{ role: 'user' as const, content: 'Describe a person as JSON.' }];

describe('structured outputs (response_format, guided_*)', () => {
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

  const post = (path: string, body: object) => rawRequest(server.url, { path, body });

  it('json_schema output parses and fits the schema for several seeds and temperatures', E2E, async () => {
    const seen = new Set<string>();
    for (const [seed, temperature] of [[1, 0], [2, 0.7], [3, 1], [4, 1.5]] as const) {
      const response = await client.chat.completions.create({
        model, messages, seed, temperature, max_tokens: 200,
        response_format: { type: 'json_schema', json_schema: { name: 'person', schema: PERSON_SCHEMA, strict: true } },
      });
      const choice = response.choices[0]!;
      assert.equal(choice.finish_reason, 'stop', `seed ${seed} T ${temperature}: ${choice.message.content}`);
      assertPerson(JSON.parse(choice.message.content!));
      seen.add(choice.message.content!);
    }
    // Noise under a grammar: different seeds give different valid documents.
    assert.ok(seen.size >= 3, `only ${seen.size} distinct outputs`);
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

  it('streamed json_schema output assembles to the same valid document as the non-streamed one', E2E, async () => {
    const body = {
      model, messages, seed: 11, temperature: 0.8, max_tokens: 200,
      response_format: { type: 'json_schema' as const, json_schema: { name: 'person', schema: PERSON_SCHEMA } },
    };
    const whole = await client.chat.completions.create(body);
    const stream = await client.chat.completions.create({ ...body, stream: true });
    let text = '';
    for await (const chunk of stream) text += chunk.choices[0]?.delta.content ?? '';
    assert.equal(text, whole.choices[0]!.message.content);
    assertPerson(JSON.parse(text));
  });

  it('json_object gives a JSON object (or, cut by max_tokens, the start of one)', E2E, async () => {
    for (const seed of [1, 2, 3]) {
      const response = await client.chat.completions.create({
        model, messages, seed, temperature: 1, max_tokens: 64, response_format: { type: 'json_object' },
      });
      const { content } = response.choices[0]!.message;
      assert.match(content!, /^\s*\{/);
      if (response.choices[0]!.finish_reason === 'stop') {
        const value = JSON.parse(content!);
        assert.ok(typeof value === 'object' && !Array.isArray(value));
      }
    }
  });

  it("vLLM's guided_choice, guided_regex and guided_grammar, on both endpoints", E2E, async () => {
    for (const seed of [1, 2, 3, 4]) {
      const chat = await post('/v1/chat/completions', {
        model, messages, seed, max_tokens: 16, guided_choice: ['yes', 'no', 'maybe not'],
      });
      assert.equal(chat.status, 200, chat.text);
      assert.ok(['yes', 'no', 'maybe not'].includes(chat.json().choices[0].message.content), chat.text);
      const regex = await post('/v1/completions', {
        model, prompt: 'Phone:', seed, max_tokens: 32, guided_regex: '[0-9]{3}-[0-9]{4}',
      });
      assert.equal(regex.status, 200, regex.text);
      assert.match(regex.json().choices[0].text, /^[0-9]{3}-[0-9]{4}$/);
      const grammar = await post('/v1/completions', {
        model, prompt: 'Sum:', seed, max_tokens: 32, temperature: 1,
        guided_grammar: 'root ::= num " + " num\nnum ::= [1-9] [0-9]?',
      });
      assert.equal(grammar.status, 200, grammar.text);
      assert.match(grammar.json().choices[0].text, /^[1-9][0-9]? \+ [1-9][0-9]?$/);
    }
    const json = await post('/v1/completions', {
      model, prompt: '{', seed: 5, max_tokens: 200, guided_json: PERSON_SCHEMA,
    });
    assert.equal(json.status, 200, json.text);
    assertPerson(JSON.parse(json.json().choices[0].text));
  });

  it('an enum of decimals gives one of them as the request wrote it (not with 17 significant digits), streamed or not', E2E, async () => {
    const schema = { type: 'object', properties: { price: { enum: [2.39, 0.1, 1e-7] }, rate: { const: 4.15 } }, required: ['price', 'rate'],
      additionalProperties: false };
    for (const seed of [1, 2, 3]) {
      const response = await post('/v1/completions', { model, prompt: '{', seed, temperature: 1, max_tokens: 64, guided_json: schema });
      assert.equal(response.status, 200, response.text);
      const text = response.json().choices[0].text as string;
      assert.match(text, /^\{\s*"price"\s*:\s*(2\.39|0\.1|1e-7)\s*,\s*"rate"\s*:\s*4\.15\s*\}$/, text);
    }
    const stream = await client.chat.completions.create({ model, messages, seed: 4, max_tokens: 64, stream: true,
      response_format: { type: 'json_schema', json_schema: { name: 'price', schema } } });
    let text = '';
    for await (const chunk of stream) text += chunk.choices[0]?.delta.content ?? '';
    assert.match(text, /^\{\s*"price"\s*:\s*(2\.39|0\.1|1e-7)\s*,\s*"rate"\s*:\s*4\.15\s*\}$/, text);
  });

  it('an integer enum past 2^53 gives one of its values with the digits the request wrote, in every schema field', E2E, async () => {
    // Raw text, since a JavaScript client would round the numbers before sending them. Both values are one double:
    // JSON.parse made one enum value of them, and the grammar produced 1234567890123456800.
    const schema = '{"type": "integer", "enum": [1234567890123456789, 1234567890123456790]}';
    const bodies = [
      `"prompt": "x", "guided_json": ${schema}`,
      `"prompt": "x", "guided_json": ${JSON.stringify(schema)}`,
      `"prompt": "x", "structured_outputs": {"json": ${schema}}`,
      `"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "id", "schema": ${schema}}}`,
    ];
    for (const [i, fields] of bodies.entries()) {
      const path = fields.startsWith('"prompt"') ? '/v1/completions' : '/v1/chat/completions';
      const response = await rawRequest(server.url, { path, body: `{"model": "${model}", "seed": ${i}, "temperature": 1, "max_tokens": 40, ${fields}}` });
      assert.equal(response.status, 200, response.text);
      const choice = response.json().choices[0];
      const text = (choice.text ?? choice.message.content) as string;
      assert.match(text, /^\s*12345678901234567(89|90)\s*$/, `${fields}: ${text}`);
    }
  });

  it("a pattern of any character ('.', '\\S') gives JSON: the characters JSON escapes are left out of it", E2E, async () => {
    const schema = { type: 'object', properties: { any: { type: 'string', pattern: '.{8,16}' }, word: { type: 'string', pattern: '\\S{8,16}' } },
      required: ['any', 'word'], additionalProperties: false };
    let ended = 0;
    for (const seed of [1, 2, 3, 4, 5, 6]) {
      const response = await post('/v1/completions', { model, prompt: '{', seed, temperature: 1.5, max_tokens: 120, guided_json: schema });
      assert.equal(response.status, 200, response.text);
      const choice = response.json().choices[0];
      if (choice.finish_reason !== 'stop') continue;
      ended++;
      const value = JSON.parse(choice.text) as { any: string; word: string };
      assert.match(value.any, /^[^"\\\x00-\x1f]{8,16}$/u, choice.text);
      assert.match(value.word, /^[^\s"\\\x00-\x1f]{8,16}$/u, choice.text);
    }
    assert.ok(ended >= 3, `${ended} of 6 ended`);
  });

  it('min_tokens and ignore_eos do not reach past the grammar\'s end: the output is the grammar\'s, ended by its EOS', E2E, async () => {
    const schema = { type: 'object', properties: { a: { type: 'boolean' } }, required: ['a'], additionalProperties: false };
    for (const extra of [{ min_tokens: 30 }, { ignore_eos: true }, { min_tokens: 30, ignore_eos: true }]) {
      const chat = await post('/v1/chat/completions', {
        model, messages, seed: 3, temperature: 0.8, max_tokens: 60, ...extra,
        response_format: { type: 'json_schema', json_schema: { name: 'flag', schema } },
      });
      assert.equal(chat.status, 200, chat.text);
      const choice = chat.json().choices[0];
      assert.equal(choice.finish_reason, 'stop', `${JSON.stringify(extra)}: ${chat.text}`);
      assert.deepEqual(Object.keys(JSON.parse(choice.message.content)), ['a'], `${JSON.stringify(extra)}: ${chat.text}`);
      for (const [prompt, maxTokens] of [['Answer:', 5], ['Well,', 12]] as const) {
        const completion = await post('/v1/completions', {
          model, prompt, seed: 4, max_tokens: maxTokens, guided_choice: ['yes', 'no'], ...extra,
          ...('min_tokens' in extra ? { min_tokens: maxTokens - 1 } : {}),
        });
        assert.equal(completion.status, 200, completion.text);
        const [only] = completion.json().choices;
        assert.ok(['yes', 'no'].includes(only.text), `${JSON.stringify(extra)}: ${completion.text}`);
        assert.equal(only.finish_reason, 'stop', completion.text);
      }
    }
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

  it('logprobs, and a top_k that truncates nothing, leave a guided output as it is: greedy and seeded, every kind of constraint', E2E, async () => {
    const tool = {
      type: 'function', function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 12 } }, required: ['city'] } },
    };
    const constraints: [string, object][] = [
      ['/v1/completions', { prompt: 'Answer:', guided_json: PERSON_SCHEMA }],
      ['/v1/completions', { prompt: 'Answer:', guided_regex: '[a-z ]{5,30}\\.' }],
      ['/v1/completions', { prompt: 'Answer:', guided_choice: ['red apple', 'green pear', 'blue berry', 'yellow banana'] }],
      ['/v1/completions', { prompt: 'Sum:', guided_grammar: 'root ::= num " + " num\nnum ::= [1-9] [0-9]?' }],
      ['/v1/chat/completions', { messages, response_format: { type: 'json_schema', json_schema: { name: 'person', schema: PERSON_SCHEMA } } }],
      ['/v1/chat/completions', { messages, structured_outputs: { json: PERSON_SCHEMA, disable_any_whitespace: true } }],
      ['/v1/chat/completions', { messages, tools: [tool], tool_choice: { type: 'function', function: { name: 'get_weather' } } }],
      ['/v1/chat/completions', { messages, tools: [tool], tool_choice: 'required' }],
    ];
    // The text, or the message's content and its calls (their ids are random).
    const output = (json: { choices: { text?: string; message?: { content: string | null; tool_calls?: { function: unknown }[] } }[] }) => {
      const [choice] = json.choices;
      return JSON.stringify(choice!.text ?? [choice!.message!.content, choice!.message!.tool_calls?.map((call) => call.function)]);
    };
    for (const [path, constraint] of constraints) {
      const chat = path === '/v1/chat/completions';
      for (const sampling of [{ temperature: 0 }, { temperature: 1, seed: 3 }]) {
        const body = { model, max_tokens: 48, ...sampling, ...constraint };
        const plain = await post(path, body);
        assert.equal(plain.status, 200, plain.text);
        const variants = [
          chat ? { logprobs: true, top_logprobs: 0 } : { logprobs: 0 },
          chat ? { logprobs: true, top_logprobs: 5 } : { logprobs: 5 },
          { top_k: 1_000_000 },
        ];
        for (const variant of variants) {
          const other = await post(path, { ...body, ...variant });
          assert.equal(other.status, 200, other.text);
          assert.equal(output(other.json()), output(plain.json()), `${path} ${JSON.stringify({ ...sampling, ...constraint, ...variant })}`);
          assert.deepEqual(other.json().usage, plain.json().usage);
        }
      }
    }
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

  it('jump-forward is off by default: the text a grammar forces is decoded a token per step, as with logprobs', E2E, async () => {
    const body = { model, prompt: 'Pick:', temperature: 0, max_tokens: 32, guided_choice: ['the quick brown fox jumps over the lazy dog'] };
    const { counts } = await streamedUsage(post, body);
    assert.ok(counts.length > 5, `${counts.length} chunks`);
    assert.deepEqual(counts, counts.map((_, i) => i + 1), 'one token per chunk');
    const withLogprobs = await post('/v1/completions', { ...body, logprobs: 0 });
    assert.equal(withLogprobs.json().usage.completion_tokens, counts.at(-1));
  });
  it('structured_outputs.disable_any_whitespace: compact JSON (a space after , and : only), still fitting the schema', E2E, async () => {
    for (const [seed, temperature] of [[1, 0], [2, 1]] as const) {
      const response = await post('/v1/chat/completions', {
        model, messages, seed, temperature, max_tokens: 200,
        structured_outputs: { json: PERSON_SCHEMA, disable_any_whitespace: true },
      });
      assert.equal(response.status, 200, response.text);
      const text = response.json().choices[0].message.content as string;
      const value = JSON.parse(text);
      assertPerson(value);
      // Outside its strings (which may escape characters either way), the text is the value re-serialized with
      // those separators.
      const skeleton = (json: string) => json.replace(/"(?:[^"\\]|\\.)*"/g, '""');
      assert.equal(skeleton(text), skeleton(JSON.stringify(value)).replace(/[,:]/g, '$& '));
    }
    const bad = await post('/v1/chat/completions', {
      model, messages, max_tokens: 4, response_format: { type: 'json_object' }, structured_outputs: { disable_any_whitespace: 'yes' },
    });
    assert.equal(bad.status, 400, bad.text);
    assert.equal(bad.json().error.param, 'structured_outputs.disable_any_whitespace');
  });

  it('n > 1: every completion follows the grammar', E2E, async () => {
    const response = await post('/v1/chat/completions', {
      model, messages, n: 2, seed: 9, temperature: 1, max_tokens: 200, guided_json: PERSON_SCHEMA,
    });
    assert.equal(response.status, 200, response.text);
    for (const choice of response.json().choices) assertPerson(JSON.parse(choice.message.content));
  });

  it('bad schemas and grammars are a 400 naming the field, and cost nothing', E2E, async () => {
    const cases: [object, string, RegExp][] = [
      [{ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'object', properties: { a: { not: { type: 'string' } } } } } } },
        'response_format.json_schema.schema.properties.a.not', /not/],
      [{ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'objekt' } } } },
        'response_format.json_schema.schema.type', /unknown type/],
      [{ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'array', uniqueItems: true } } } },
        'response_format.json_schema.schema.uniqueItems', /uniqueItems/],
      [{ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { $ref: 'https://example.com/s.json' } } } },
        'response_format.json_schema.schema.$ref', /references/],
      // A pointer to nothing: named here (XGrammar's "Cannot find field" named only the schema, and an unused one passed).
      [{ guided_json: { type: 'object', properties: { a: { $ref: '#/$defs/a' } } } }, 'guided_json.properties.a.$ref', /points to nothing/],
      [{ guided_json: { type: 'null', $defs: { x: { $ref: '#/$defs/y' } } } }, 'guided_json.$defs.x.$ref', /points to nothing/],
      [{ response_format: { type: 'json_schema', json_schema: { schema: { type: 'object' } } } },
        'response_format.json_schema.name', /missing/i],
      [{ response_format: { type: 'yaml' } }, 'response_format.type', /unknown response format/],
      [{ guided_json: '{not json' }, 'guided_json', /not valid JSON/],
      [{ guided_regex: '[0-9' }, 'guided_regex', /Unclosed|regex/i],
      [{ guided_grammar: 'root ::= "a" |' }, 'guided_grammar', /EBNF|grammar/i],
      [{ guided_choice: [] }, 'guided_choice', /empty/],
      [{ guided_choice: ['a'], guided_regex: 'a' }, 'guided_choice', /only one/],
      [{ response_format: { type: 'json_object' }, guided_json: { type: 'object' } }, 'guided_json', /only one/],
      // vLLM's options this server's grammars lack: refused, not run unconstrained.
      [{ structured_outputs: { structural_tag: '{"type": "structural_tag"}' } }, 'structured_outputs.structural_tag', /structural tags/],
      [{ structured_outputs: { json: { type: 'object' }, whitespace_pattern: ' ?' } }, 'structured_outputs.whitespace_pattern', /whitespace/],
      [{ guided_json: { type: 'object' }, guided_whitespace_pattern: ' ?' }, 'guided_whitespace_pattern', /whitespace/],
    ];
    for (const [extra, param, message] of cases) {
      const response = await post('/v1/chat/completions', { model, messages, max_tokens: 8, ...extra });
      assert.equal(response.status, 400, `${JSON.stringify(extra)}: ${response.text}`);
      const { error } = response.json();
      assert.equal(error.param, param, response.text);
      assert.match(error.message, message);
      assert.ok(['invalid_value', 'unsupported_parameter', 'missing_required_parameter'].includes(error.code), response.text);
    }
    // The gateway's grammar engine survived the refusals: a good request still runs.
    const ok = await post('/v1/chat/completions', { model, messages, max_tokens: 8, guided_regex: '(ab)+' });
    assert.equal(ok.status, 200, ok.text);
    assert.match(ok.json().choices[0].message.content, /^(ab)+a?$/, ok.text);
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

  it('unsatisfiable schemas are a 400 naming the place (the grammar gave output that did not fit, or never ended)', E2E, async () => {
    const cases: [object, string, RegExp][] = [
      // A required property additionalProperties forbids: XGrammar left it out of the output.
      [{ type: 'object', properties: { b: { type: 'integer' } }, required: ['a'], additionalProperties: false }, 'required[0]', /no value can satisfy/],
      // A $ref cycle with no way out: every value needs another one inside it, so the output never ended.
      [{ type: 'object', properties: { next: { $ref: '#' } }, required: ['next'] }, 'properties.next.$ref', /no finite value/],
      [{ $defs: { A: { type: 'object', properties: { b: { $ref: '#/$defs/B' } }, required: ['b'] }, B: { type: 'array', items: { $ref: '#/$defs/A' }, minItems: 1 } },
        $ref: '#/$defs/A' }, '$defs.B.items.$ref', /no finite value/],
      [{ anyOf: [{ $ref: '#' }, { type: 'array', items: { $ref: '#' }, minItems: 2 }] }, 'anyOf[0].$ref', /no finite value/],
      // What the grammar would not enforce: a required property 'properties' does not list (XGrammar left it out),
      // an enum or const value of another type than the schema's (XGrammar produced it anyway).
      [{ type: 'object', required: ['a'] }, 'required[0]', /define it under 'properties'/],
      [{ type: 'string', enum: ['a', 1] }, 'enum[1]', /not of the schema's type/],
      [{ type: 'integer', const: 'x' }, 'const', /not of the schema's type/],
    ];
    for (const [schema, place, message] of cases) {
      for (const [body, param] of [
        [{ guided_json: schema }, 'guided_json'],
        [{ response_format: { type: 'json_schema', json_schema: { name: 'x', schema } } }, 'response_format.json_schema.schema'],
      ] as const) {
        const response = await post('/v1/chat/completions', { model, messages, max_tokens: 16, ...body });
        assert.equal(response.status, 400, `${JSON.stringify(schema)}: ${response.text}`);
        assert.equal(response.json().error.param, `${param}.${place}`, response.text);
        assert.match(response.json().error.message, message);
      }
    }
    // Recursion with a way out (a nullable child) is fine, and its output fits.
    const list = { type: 'object', properties: { v: { type: 'boolean' }, next: { anyOf: [{ $ref: '#' }, { type: 'null' }] } }, required: ['v', 'next'],
      additionalProperties: false };
    let ended = 0;
    for (const seed of [1, 2, 3]) {
      const response = await post('/v1/chat/completions', { model, messages, seed, temperature: 1, max_tokens: 200, guided_json: list });
      assert.equal(response.status, 200, response.text);
      const choice = response.json().choices[0];
      if (choice.finish_reason !== 'stop') continue;
      ended++;
      assert.deepEqual(schemaErrors(list, JSON.parse(choice.message.content)), [], choice.message.content);
    }
    assert.ok(ended >= 2, `${ended} of 3 ended`);
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

  it('string formats: the output is a valid value of each enforced format; others, and keywords the engine would drop beside them, are a 400', E2E, async () => {
    const formats = ['date', 'time', 'date-time', 'ipv4', 'hostname', 'uuid'];
    const schema = {
      type: 'object', properties: Object.fromEntries(formats.map((format) => [format, { type: 'string', format }])), required: formats,
      additionalProperties: false,
    };
    let ended = 0;
    for (const seed of [1, 2, 3, 4, 5, 6]) {
      const response = await post('/v1/chat/completions', { model, messages, seed, temperature: 1, max_tokens: 400, guided_json: schema });
      assert.equal(response.status, 200, response.text);
      const choice = response.json().choices[0];
      if (choice.finish_reason !== 'stop') continue;
      ended++;
      assert.deepEqual(schemaErrors(schema, JSON.parse(choice.message.content)), [], choice.message.content);
    }
    assert.ok(ended >= 4, `${ended} of 6 ended`);
    const refused: [object, string, RegExp][] = [
      // Formats the grammar engine would ignore (any string), and 'format' where it would allow any value.
      [{ type: 'string', format: 'idn-hostname' }, 'format', /not enforced in guided decoding; the formats enforced are/],
      [{ type: 'integer', format: 'int64' }, 'format', /not enforced/],
      [{ format: 'date' }, 'format', /only beside "type": "string"/],
      [{ maxLength: 4 }, 'maxLength', /only beside "type": "string"/],
      // Beside a format or a pattern, the engine keeps that one and drops the rest.
      [{ type: 'string', format: 'hostname', maxLength: 20 }, 'maxLength', /beside 'format' is not enforced/],
      [{ type: 'string', pattern: '[a-z]+', minLength: 2 }, 'minLength', /beside 'pattern' is not enforced/],
      [{ type: 'string', format: 'date', pattern: '2024-.*' }, 'pattern', /beside 'format' is not enforced/],
    ];
    for (const [schema, place, message] of refused) {
      const response = await post('/v1/chat/completions', { model, messages, max_tokens: 16, guided_json: schema });
      assert.equal(response.status, 400, `${JSON.stringify(schema)}: ${response.text}`);
      assert.equal(response.json().error.param, `guided_json.${place}`, response.text);
      assert.equal(response.json().error.code, 'unsupported_parameter');
      assert.match(response.json().error.message, message);
    }
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });
});

describe('structured outputs with --guided-jump-forward', () => {
  let server: TestServer;
  let model: string;

  before(async () => {
    server = await startTestServer({ flags: ['--guided-jump-forward'] });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  const post = (path: string, body: object) => rawRequest(server.url, { path, body });

  it('the text a grammar forces comes with the sampled token before it, several tokens in one chunk; not for a request with logprobs', E2E, async () => {
    const body = { model, prompt: 'Pick:', temperature: 0, max_tokens: 32, guided_choice: ['the quick brown fox jumps over the lazy dog'] };
    const { counts, text } = await streamedUsage(post, body);
    assert.equal(text, 'the quick brown fox jumps over the lazy dog');
    assert.ok(counts.some((count, i) => count - (counts[i - 1] ?? 0) > 1), `tokens so far by chunk: ${counts.join(' ')}`);
    const withLogprobs = await streamedUsage(post, { ...body, logprobs: 0 });
    assert.deepEqual(withLogprobs.counts, withLogprobs.counts.map((_, i) => i + 1), 'one token per chunk');
  });

  it('a stop string inside the forced text: the output ends there and usage counts only the tokens up to it', E2E, async () => {
    const choice = 'the quick brown fox jumps over the lazy dog';
    const body = { model, prompt: 'Pick:', temperature: 0, guided_choice: [choice] };
    const whole = await post('/v1/completions', { ...body, max_tokens: 32 });
    assert.equal(whole.status, 200, whole.text);
    assert.equal(whole.json().choices[0].text, choice);
    // Greedy under a one-choice grammar, the tokens are the same whatever max_tokens; max_tokens k cuts them after
    // the k-th (forced ones included), so the fewest that show "fox" are the tokens up to the stop.
    const total = whole.json().usage.completion_tokens as number;
    let upToStop: number | undefined;
    for (let k = 1; k <= total && upToStop === undefined; k++) {
      const cut = await post('/v1/completions', { ...body, max_tokens: k });
      assert.equal(cut.json().usage.completion_tokens, k, cut.text);
      if ((cut.json().choices[0].text as string).includes('fox')) upToStop = k;
    }
    assert.ok(upToStop !== undefined && upToStop < total - 2, `"fox" after ${upToStop} of ${total} tokens`);
    // Ended by the grammar's end (the model's EOS): stop_reason null, as vLLM's. Ended by a stop token id the request
    // gave: that id. (The whole text's first token is the stop token id asked for below.)
    assert.equal(whole.json().choices[0].finish_reason, 'stop');
    assert.equal(whole.json().choices[0].stop_reason, null, whole.text);
    const firstToken = await post('/v1/completions', { ...body, max_tokens: 1, logprobs: 0, return_tokens_as_token_ids: true });
    const firstId = Number(/^token_id:(\d+)$/.exec(firstToken.json().choices[0].logprobs.tokens[0])![1]);
    const onToken = await post('/v1/completions', { ...body, max_tokens: 32, stop_token_ids: [firstId] });
    assert.equal(onToken.json().choices[0].finish_reason, 'stop', onToken.text);
    assert.equal(onToken.json().choices[0].stop_reason, firstId, onToken.text);
    const stopped = await post('/v1/completions', { ...body, max_tokens: 32, stop: ['fox'] });
    assert.equal(stopped.status, 200, stopped.text);
    const stoppedChoice = stopped.json().choices[0];
    assert.equal(stoppedChoice.text, 'the quick brown ');
    assert.equal(stoppedChoice.finish_reason, 'stop');
    assert.equal(stoppedChoice.stop_reason, 'fox');
    assert.equal(stopped.json().usage.completion_tokens, upToStop, stopped.text);
    // Streamed, with usage on every chunk: the same count.
    const streamed = await post('/v1/completions', {
      ...body, max_tokens: 32, stop: ['fox'], stream: true, stream_options: { include_usage: true, continuous_usage_stats: true },
    });
    const chunks = streamed.text.split('\n').filter((line) => line.startsWith('data: {')).map((line) => JSON.parse(line.slice(6)));
    assert.equal(chunks.map((chunk) => chunk.choices[0]?.text ?? '').join(''), 'the quick brown ');
    assert.equal(chunks.at(-1).usage.completion_tokens, upToStop, streamed.text);
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

});

/** A streamed completion's text and, by chunk, its choice's tokens so far (continuous_usage_stats). */
async function streamedUsage(post: (path: string, body: object) => Promise<{ status: number; text: string }>, body: object) {
  const streamed = await post('/v1/completions', { ...body, stream: true, stream_options: { include_usage: true, continuous_usage_stats: true } });
  assert.equal(streamed.status, 200, streamed.text);
  const chunks = streamed.text.split('\n').filter((line) => line.startsWith('data: {')).map((line) => JSON.parse(line.slice(6)));
  const withChoice = chunks.filter((chunk) => chunk.choices.length > 0 && chunk.usage !== undefined && chunk.usage !== null);
  return {
    text: chunks.map((chunk) => chunk.choices[0]?.text ?? '').join(''),
    counts: withChoice.map((chunk) => chunk.usage.completion_tokens as number),
  };
}

for (const layout of [['--workers', '2'], ['--prefill-workers', '1', '--decode-workers', '1']]) {
  describe(`structured outputs on simulated workers (${layout.join(' ')})`, () => {
    let server: TestServer;
    let model: string;

    before(async () => {
      server = await startTestServer({ flags: ['--engine', 'sim', '--sim-speed-up', 'inf', ...layout] });
      model = server.running.api.gateway.servedModelName!;
    });
    after(async () => {
      await server?.close();
    });

    it('synthetic tokens follow the grammar: json_schema, choice; text is the vocabulary\'s, not synthetic words', E2E, async () => {
      for (const seed of [1, 2, 3]) {
        const json = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
          model, messages, seed, max_tokens: 300,
          response_format: { type: 'json_schema', json_schema: { name: 'person', schema: PERSON_SCHEMA } },
        } });
        assert.equal(json.status, 200, json.text);
        assert.equal(json.json().choices[0].finish_reason, 'stop', json.text);
        assertPerson(JSON.parse(json.json().choices[0].message.content));
        const choice = await rawRequest(server.url, { path: '/v1/completions', body: {
          model, prompt: 'Pick:', seed, max_tokens: 8, guided_choice: ['alpha', 'beta'],
        } });
        assert.equal(choice.status, 200, choice.text);
        assert.ok(['alpha', 'beta'].includes(choice.json().choices[0].text), choice.text);
      }
      // Unguided requests keep their synthetic words.
      const plain = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: 'x', max_tokens: 3, seed: 1 } });
      assert.match(plain.json().choices[0].text, /^( [a-z]{4}){3}$/);
      await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
    });
  });
}
