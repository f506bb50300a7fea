import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import wrapper from './helpers/assert.ts';

describe('test harness: node:assert/strict in test files', () => {
  it('is the wrapper test/run.ts resolves it to', () => {
    assert.equal(assert, wrapper, 'test files get test/helpers/assert.ts (run them through test/run.ts)');
    assert.equal(assert.strict, assert);
  });

  it('fails ok() and assert() without a message with a fixed one, the stack starting at the caller', () => {
    for (const call of [() => assert.ok(0), () => assert(null)]) {
      assert.throws(call, (error: unknown) => {
        assert.ok(error instanceof assert.AssertionError, 'an AssertionError');
        assert.match(error.message, /^expected a truthy value, got (0|null) \(the test gave no message\)$/);
        assert.equal(error.operator, '==');
        assert.equal(error.expected, true);
        // The first frame is this file (the arrow above), not the wrapper.
        const frame = error.stack!.split('\n').find((line) => line.includes(' at '))!;
        assert.ok(frame.includes(fileURLToPath(import.meta.url)) || frame.includes(import.meta.url), `first frame: ${frame}`);
        return true;
      });
    }
  });

  it('keeps a given message, throws a given Error as is, and passes truthy values', () => {
    assert.throws(() => assert.ok(false, 'why it failed'), { name: 'AssertionError', message: 'why it failed' });
    const own = new RangeError('mine');
    assert.throws(() => assert(0, own), (error: unknown) => error === own);
    assert.ok(1);
    assert('x');
    assert.doesNotThrow(() => assert.deepEqual({ a: [1] }, { a: [1] }));
    assert.throws(() => assert.equal(1, 2), { name: 'AssertionError' });
  });
});
