// Boolean JSON schemas under guided decoding, read as JSON Schema reads them: `true` allows any value, `false` none.
// A root schema of `false` (guided_json, its JSON text, structured_outputs.json) was a 500 ("needs is not
// iterable") instead of the 400 an unsatisfiable schema gets; `false` where a value may go without it (an optional
// property, an anyOf branch, a prefixItems entry, or a part whose every value needs a false one) was XGrammar's
// 400 "Schema should not be false", though values fit the schema: it is left out of the grammar instead.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { InvalidValueError, UnsupportedFieldError } from '../../src/api/errors.ts';
import { checkJsonSchema, grammarSchema, grammarSchemaText } from '../../src/api/guided.ts';
import { XGrammar } from '../../src/engine/grammar/xgrammar.ts';
import { rawRequest } from './http-client.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { schemaErrors } from './guided-fixtures.ts';

const E2E = { timeout: 120_000 };
const messages = [{ role: 'user' as const, content: 'Answer in JSON.' }];

/** Satisfiable schemas with `false` (or a part with no finite value) where a value may leave it out. */
const LEFT_OUT: [string, object][] = [
  ['an optional property', { type: 'object', properties: { a: false, b: { type: 'integer' } }, required: ['b'] }],
  ['an optional property, other properties forbidden',
    { type: 'object', properties: { a: false, b: { type: 'boolean' } }, required: ['b'], additionalProperties: false }],
  ['an anyOf branch', { anyOf: [false, { type: 'integer' }] }],
  ['a oneOf branch', { oneOf: [{ type: 'boolean' }, false] }],
  ['a prefixItems entry', { type: 'array', prefixItems: [{ type: 'integer' }, false] }],
  ['an optional property referring to false', { type: 'object', properties: { a: { $ref: '#/$defs/never' }, b: { type: 'null' } }, required: ['b'],
    $defs: { never: false } }],
  ['an optional property requiring a false one',
    { type: 'object', properties: { a: { type: 'object', properties: { x: false }, required: ['x'] }, b: { type: 'boolean' } }, required: ['b'] }],
  ['items whose only branch is false', { type: 'array', items: { anyOf: [false] } }],
];

function compiles(schema: unknown): void {
  const text = grammarSchemaText(grammarSchema(schema), 'guided_json');
  const xg = XGrammar.startSync();
  xg.run('JSON schema', (b) => new b.Grammar.FromJSONSchema(text, true, undefined, undefined, true, undefined, false).delete());
}

describe('boolean JSON schemas in guided decoding', () => {
  before(async () => {
    await XGrammar.load();
  });

  it('a root schema of false is a 400 naming the field; true is any value', () => {
    assert.throws(() => checkJsonSchema(false, 'guided_json'), (error: unknown) =>
      error instanceof InvalidValueError && error.param === 'guided_json' && /the schema is false/.test(error.message));
    checkJsonSchema(true, 'guided_json');
    compiles(true);
    assert.equal(grammarSchemaText(grammarSchema(true), 'guided_json'), 'true');
  });

  it('false where a value may go without it is left out of the grammar, which compiles', () => {
    for (const [what, schema] of LEFT_OUT) {
      checkJsonSchema(schema, 'guided_json');
      assert.doesNotThrow(() => compiles(schema), what);
    }
    assert.deepEqual(grammarSchema(LEFT_OUT[0]![1]), { type: 'object', properties: { b: { type: 'integer' } }, required: ['b'] });
    assert.deepEqual(grammarSchema(LEFT_OUT[2]![1]), { anyOf: [{ type: 'integer' }] });
    assert.deepEqual(grammarSchema(LEFT_OUT[4]![1]), { type: 'array', prefixItems: [{ type: 'integer' }], items: false });
    assert.deepEqual(grammarSchema(LEFT_OUT[7]![1]), { type: 'array', items: false });
    // true stays as it is wherever it is.
    const withTrue = { type: 'object', properties: { a: true }, required: ['a'], additionalProperties: false };
    assert.deepEqual(grammarSchema(withTrue), withTrue);
  });

  it('false where a value is needed, or an optional false property beside other properties allowed, is a 400 naming the place', () => {
    const cases: [unknown, string, typeof InvalidValueError | typeof UnsupportedFieldError][] = [
      [{ type: 'object', properties: { a: false }, required: ['a'] }, 'guided_json.properties.a', InvalidValueError],
      [{ anyOf: [false, false] }, 'guided_json.anyOf[0]', InvalidValueError],
      [{ type: 'array', items: false, minItems: 1 }, 'guided_json.items', InvalidValueError],
      [{ type: 'array', prefixItems: [true, false], minItems: 2 }, 'guided_json.prefixItems[1]', InvalidValueError],
      // XGrammar lets any name in as another property: 'a' would come back with any value.
      [{ type: 'object', properties: { a: false }, additionalProperties: true }, 'guided_json.properties.a', UnsupportedFieldError],
      [{ type: 'object', properties: { a: { anyOf: [false] } }, unevaluatedProperties: {} }, 'guided_json.properties.a', UnsupportedFieldError],
    ];
    for (const [schema, param, kind] of cases) {
      assert.throws(() => checkJsonSchema(schema, 'guided_json'), (error: unknown) => error instanceof kind && error.param === param,
        JSON.stringify(schema));
    }
  });

  describe('through HTTP', () => {
    let server: TestServer;
    let model: string;

    before(async () => {
      server = await startTestServer();
      model = server.running.api.gateway.servedModelName!;
    });
    after(async () => {
      await server?.close();
    });

    const post = (path: string, body: object) => rawRequest(server.url, { path, body: { model, ...body } });

    it('a root schema of false: 400 invalid_value naming the field, on both endpoints, streamed or not', E2E, async () => {
      const cases: [string, object, string][] = [
        ['/v1/completions', { prompt: 'Answer:', guided_json: false }, 'guided_json'],
        ['/v1/completions', { prompt: 'Answer:', guided_json: 'false' }, 'guided_json'],
        ['/v1/completions', { prompt: 'Answer:', stream: true, structured_outputs: { json: false } }, 'structured_outputs.json'],
        ['/v1/chat/completions', { messages, structured_outputs: { json: false } }, 'structured_outputs.json'],
        ['/v1/chat/completions', { messages, stream: true, guided_json: false }, 'guided_json'],
        ['/v1/chat/completions', { messages, guided_json: 'false' }, 'guided_json'],
      ];
      for (const [path, body, param] of cases) {
        const response = await post(path, { max_tokens: 8, ...body });
        assert.equal(response.status, 400, `${path} ${JSON.stringify(body)}: ${response.text}`);
        const { error } = response.json();
        assert.equal(error.code, 'invalid_value', response.text);
        assert.equal(error.param, param, response.text);
        assert.match(error.message, /the schema is false: no value can satisfy it/);
      }
      assert.ok(engineIdle(server.engine));
    });

    it('a root schema of true: any JSON value', E2E, async () => {
      let ended = 0;
      for (const seed of [1, 2, 3]) {
        const response = await post('/v1/completions', { prompt: 'JSON:', seed, temperature: 1, max_tokens: 200, guided_json: true });
        assert.equal(response.status, 200, response.text);
        const choice = response.json().choices[0];
        if (choice.finish_reason !== 'stop') continue;
        ended++;
        JSON.parse(choice.text);
      }
      assert.ok(ended >= 1, `${ended} of 3 ended`);
      for (const body of [{ guided_json: 'true', stream: true }, { structured_outputs: { json: true } }]) {
        const response = await post('/v1/chat/completions', { messages, max_tokens: 4, ...body });
        assert.equal(response.status, 200, response.text);
      }
      await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
    });

    it('false where a value may go without it: 200, and the output fits the schema as given', E2E, async () => {
      for (const [what, schema] of LEFT_OUT) {
        let ended = 0;
        for (const seed of [1, 2, 3]) {
          const response = await post('/v1/completions', { prompt: 'JSON:', seed, temperature: 1, max_tokens: 80, guided_json: schema });
          assert.equal(response.status, 200, `${what}: ${response.text}`);
          const choice = response.json().choices[0];
          if (choice.finish_reason !== 'stop') continue;
          ended++;
          assert.deepEqual(schemaErrors(schema, JSON.parse(choice.text)), [], `${what}: ${choice.text}`);
        }
        assert.ok(ended >= 1, `${what}: ${ended} of 3 ended`);
      }
      const refused = await post('/v1/chat/completions', {
        messages, max_tokens: 8, response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'object', properties: { a: false },
          additionalProperties: { type: 'integer' } } } },
      });
      assert.equal(refused.status, 400, refused.text);
      assert.equal(refused.json().error.param, 'response_format.json_schema.schema.properties.a');
      await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
    });
  });
});
