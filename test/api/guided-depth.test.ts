// The JSON schema depth the gateway accepts for guided decoding stays within what XGrammar compiles: a schema of 54
// nested objects ran its WebAssembly stack out, aborting the worker's grammar engine (and the requests on that worker).
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { checkJsonSchema } from '../../src/api/guided.ts';
import { XGrammar } from '../../src/engine/grammar/xgrammar.ts';

/** `levels` objects, each holding the next under "a". */
function nestedObjects(levels: number): object {
  let schema: object = { type: 'integer' };
  for (let i = 0; i < levels; i++) schema = { type: 'object', properties: { a: schema }, required: ['a'], additionalProperties: false };
  return schema;
}

describe('guided decoding schema depth', () => {
  it('the deepest nesting of objects the gateway accepts compiles; one level more is a 400', async () => {
    let deepest = 0;
    while (deepest < 200) {
      try {
        checkJsonSchema(nestedObjects(deepest + 1), 'guided_json');
      } catch (error) {
        assert.match((error as Error).message, /nested more than \d+ levels deep/);
        break;
      }
      deepest++;
    }
    assert.ok(deepest > 0 && deepest < 200, `the gateway bounds the depth (accepted ${deepest})`);
    const xg = await XGrammar.load();
    const schema = JSON.stringify(nestedObjects(deepest));
    xg.run('schema', (binding: any) => new binding.Grammar.FromJSONSchema(schema, true, undefined, undefined, true, undefined, false).delete());
    assert.equal(xg.usable, true, 'the grammar engine is still usable');
  });
});
