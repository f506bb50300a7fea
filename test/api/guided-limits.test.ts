// The bounds on what a guided request may compile: enum values, bytes, nested groups. A grammar is compiled on the
// worker's engine thread, between steps of every request there, so a huge one (an enum of 100k strings took
// seconds) stalled every stream of that worker; and deeply nested regex or EBNF groups overflowed XGrammar's stack.
// Past a bound: a 400 naming the field and the bound, nothing queued, and the server goes on.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { MAX_GROUP_DEPTH, MAX_GUIDED_BYTES, MAX_GUIDED_CHOICES, MAX_GUIDED_ENUM_VALUES, MAX_SCHEMA_JSON_DEPTH } from '../../src/api/guided.ts';
import { rawRequest } from './http-client.ts';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };
const messages = [{ role: 'user' as const, content: 'Pick one.' }];
const values = (n: number, prefix = 'v') => Array.from({ length: n }, (_, i) => `${prefix}${i}`);
const nested = (levels: number, inner: string) => `${'('.repeat(levels)}${inner}${')'.repeat(levels)}`;
/** JSON text of `levels` objects, each holding the next under "a". */
const nestedJson = (levels: number) => `${'{"a":'.repeat(levels)}1${'}'.repeat(levels)}`;

describe('guided decoding limits', () => {
  let server: TestServer;
  let model: string;

  before(async () => {
    server = await startTestServer();
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  const post = (body: object) => rawRequest(server.url, { path: '/v1/chat/completions', body: { model, messages, max_tokens: 8, ...body } });

  it('enum values: as many as guided_choice\'s choices in a schema, all its enums together; more is a 400 naming the bound', E2E, async () => {
    assert.equal(MAX_GUIDED_ENUM_VALUES, MAX_GUIDED_CHOICES);
    const schema = (enums: number[]) => ({
      type: 'object',
      properties: Object.fromEntries(enums.map((n, i) => [`p${i}`, { enum: values(n, `p${i}_`) }])),
      required: enums.map((_, i) => `p${i}`),
      additionalProperties: false,
    });
    const cases: [object, string][] = [
      [{ guided_json: { enum: values(100_000) } }, 'guided_json.enum'],
      [{ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: schema([MAX_GUIDED_ENUM_VALUES + 1]) } } },
        'response_format.json_schema.schema.properties.p0.enum'],
      // Two enums within the bound each, over it together.
      [{ structured_outputs: { json: schema([600, 600]) } }, 'structured_outputs.json.properties.p1.enum'],
    ];
    for (const [body, param] of cases) {
      const response = await post(body);
      assert.equal(response.status, 400, `${param}: ${response.text.slice(0, 300)}`);
      assert.equal(response.json().error.param, param);
      assert.match(response.json().error.message, new RegExp(`at most ${MAX_GUIDED_ENUM_VALUES} enum values`));
    }
    const ok = await post({ guided_json: schema([MAX_GUIDED_ENUM_VALUES / 2, MAX_GUIDED_ENUM_VALUES / 2]), max_tokens: 40 });
    assert.equal(ok.status, 200, ok.text.slice(0, 300));
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

  it(`a grammar's source: at most ${MAX_GUIDED_BYTES} bytes (a schema without its annotations, a regex, a grammar, the choices together)`, E2E, async () => {
    const big = 'x'.repeat(MAX_GUIDED_BYTES + 1);
    const manyProperties = { type: 'object', properties: Object.fromEntries(values(3000).map((name) => [name, { type: 'boolean' }])) };
    const cases: [object, string][] = [
      [{ guided_json: manyProperties }, 'guided_json'],
      [{ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'string', pattern: big } } } }, 'response_format.json_schema.schema'],
      [{ guided_regex: big }, 'guided_regex'],
      [{ guided_grammar: `root ::= "${big}"` }, 'guided_grammar'],
      [{ guided_choice: values(8).map((v) => v + big.slice(0, MAX_GUIDED_BYTES / 8)) }, 'guided_choice'],
      // A tool's parameters under a named choice, and all of them under "required".
      [{ tools: [{ type: 'function', function: { name: 'f', parameters: manyProperties } }], tool_choice: { type: 'function', function: { name: 'f' } } },
        'tools[0].function.parameters'],
      [{ tools: values(40).map((name) => ({ type: 'function', function: { name, parameters: {
        type: 'object', properties: Object.fromEntries(values(80).map((p) => [p, { type: 'boolean' }])) } } })), tool_choice: 'required' }, 'tools'],
    ];
    for (const [body, param] of cases) {
      const response = await post(body);
      assert.equal(response.status, 400, `${param}: ${response.text.slice(0, 300)}`);
      assert.equal(response.json().error.param, param);
      assert.match(response.json().error.message, new RegExp(`at most ${MAX_GUIDED_BYTES} in guided decoding`));
    }
    // Annotations do not count: long descriptions pass (they are not compiled).
    const described = {
      type: 'object', description: big, title: 'Big',
      properties: { ok: { type: 'boolean', description: big, examples: [true] } }, required: ['ok'], additionalProperties: false,
    };
    const ok = await post({ guided_json: described, max_tokens: 60, temperature: 0 });
    assert.equal(ok.status, 200, ok.text.slice(0, 300));
    assert.equal(ok.json().choices[0].finish_reason, 'stop', ok.text.slice(0, 300));
    assert.equal(typeof JSON.parse(ok.json().choices[0].message.content).ok, 'boolean');
    // An enum counts as its values do (49 KB here), not as the rule per value it is compiled into (72 KB).
    const wide = Array.from({ length: MAX_GUIDED_ENUM_VALUES }, (_, i) => `值${String(i).padStart(4, '0')}${'中'.repeat(13)}`);
    const enumOk = await post({ guided_json: { type: 'object', properties: { v: { enum: wide } }, required: ['v'] } });
    assert.equal(enumOk.status, 200, enumOk.text.slice(0, 300));
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

  it(`nested groups: at most ${MAX_GROUP_DEPTH} in a regex, a schema's pattern or an EBNF grammar (deeper ones overflowed XGrammar's stack)`, E2E, async () => {
    const deep = MAX_GROUP_DEPTH + 1;
    const cases: [object, string][] = [
      [{ guided_regex: nested(200, 'a') }, 'guided_regex'],
      [{ structured_outputs: { regex: nested(deep, 'a') } }, 'structured_outputs.regex'],
      [{ guided_json: { type: 'string', pattern: nested(deep, 'a') } }, 'guided_json.pattern'],
      [{ guided_grammar: `root ::= ${nested(deep, '"a"')}` }, 'guided_grammar'],
    ];
    for (const [body, param] of cases) {
      const response = await post(body);
      assert.equal(response.status, 400, `${param}: ${response.text.slice(0, 300)}`);
      assert.equal(response.json().error.param, param);
      assert.match(response.json().error.message, new RegExp(`at most ${MAX_GROUP_DEPTH}`));
    }
    // Parentheses inside a class, escaped, or inside an EBNF string are not groups.
    for (const body of [
      { guided_regex: `${nested(MAX_GROUP_DEPTH, 'a')}[(]\\(` },
      { guided_grammar: `root ::= ${nested(MAX_GROUP_DEPTH, `"${'('.repeat(100)}"`)} [(]` },
    ]) {
      const response = await post({ ...body, max_tokens: 120 });
      assert.equal(response.status, 200, `${JSON.stringify(body).slice(0, 100)}: ${response.text.slice(0, 300)}`);
    }
    // The gateway and the worker survived: a guided request still runs, and nothing is held.
    const after = await post({ guided_regex: '(ab)+' });
    assert.equal(after.status, 200, after.text);
    assert.match(after.json().choices[0].message.content, /^(ab)+a?$/);
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

  it(`a schema's JSON: at most ${MAX_SCHEMA_JSON_DEPTH} levels in any keyword (400 levels aborted XGrammar, 100k overflowed the gateway's stack: a 500)`, E2E, async () => {
    // Values the schema walk does not enter: an unknown keyword's, a const's, an enum's. Sent as text, as a client would.
    const post = (path: string, fields: string) => rawRequest(server.url, { path, body: `{"model":${JSON.stringify(model)},${
      path === '/v1/responses' ? '"input":"x","max_output_tokens":8' : '"messages":[{"role":"user","content":"x"}],"max_tokens":8'},${fields}}` });
    const cases: [string, string, string][] = [
      ['/v1/chat/completions', `"guided_json":{"type":"object","x-extra":${nestedJson(400)}}`, 'guided_json'],
      ['/v1/chat/completions', `"guided_json":{"const":${nestedJson(100_000)}}`, 'guided_json'],
      ['/v1/chat/completions', `"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"x":${nestedJson(100_000)}}}}`,
        'response_format.json_schema.schema'],
      ['/v1/chat/completions', `"guided_json":{"enum":[${'['.repeat(MAX_SCHEMA_JSON_DEPTH)}${']'.repeat(MAX_SCHEMA_JSON_DEPTH)}]}`, 'guided_json'],
      ['/v1/responses', `"text":{"format":{"type":"json_schema","name":"n","schema":{"x":${nestedJson(100_000)}}}}`, 'text.format.schema'],
      // An integer past 2^53 has the schema, or the whole body, read again with exact numbers: not before the check.
      ['/v1/chat/completions', `"guided_json":{"enum":[1234567890123456789],"x":${nestedJson(100_000)}}`, 'guided_json'],
      ['/v1/chat/completions', `"guided_json":${JSON.stringify(`{"enum":[1234567890123456789],"x":${nestedJson(100_000)}}`)}`, 'guided_json'],
      ['/v1/chat/completions', `"chat_template_kwargs":{"n":1234567890123456789},"guided_json":{"x":${nestedJson(100_000)}}`, 'guided_json'],
    ];
    for (const [path, fields, param] of cases) {
      const response = await post(path, fields);
      assert.equal(response.status, 400, `${fields.slice(0, 80)}: ${response.text.slice(0, 300)}`);
      assert.equal(response.json().error.param, param);
      assert.match(response.json().error.message, new RegExp(`nested more than ${MAX_SCHEMA_JSON_DEPTH} levels`));
    }
    // At the bound: accepted and compiled (the root object is one level, the value under "x-extra" the rest).
    const atBound = await post('/v1/chat/completions', `"guided_json":{"type":"object","x-extra":${nestedJson(MAX_SCHEMA_JSON_DEPTH - 1)}}`);
    assert.equal(atBound.status, 200, atBound.text.slice(0, 300));
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });
});
