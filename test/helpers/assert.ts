// node:assert/strict for the tests, with one change: ok(), and assert() itself, given a falsy value and no message
// fail with a fixed message. test/run.ts points every test file's `import ... from 'node:assert/strict'` here
// (test/helpers/node-test-hooks.mjs); files need no change.
//
// Why: without a message, Node builds one from the asserting source line, which it reads from the file and parses
// with acorn (nodejs/node#52677). Under tsx the line and column it reads at are the compiled code's, applied to the
// TypeScript source, and in a long test file the parse ran for minutes: a failing assertion stopped the whole run
// (one process for every suite, and a synchronous parse no test timeout interrupts) instead of failing its test.
// Every other assertion builds its message from the values, not from the source.
import strict from 'node:assert/strict';

type Message = string | Error | undefined;

function fail(value: unknown, message: Message, stackStartFn: (...args: never[]) => unknown): never {
  if (message instanceof Error) throw message;
  throw new strict.AssertionError({
    message: message ?? `expected a truthy value, got ${String(value)} (the test gave no message)`,
    actual: value, expected: true, operator: '==', stackStartFn,
  });
}

function ok(value: unknown, message?: Message): asserts value {
  if (!value) fail(value, message, ok);
}

function assert(value: unknown, message?: Message): asserts value {
  if (!value) fail(value, message, assert);
}

const wrapped = Object.assign(assert, strict, { ok }) as typeof strict;
(wrapped as { strict: typeof strict }).strict = wrapped;

export default wrapped;
