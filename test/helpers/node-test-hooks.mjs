// Module resolution hook for test/run.ts: inside test/, `node:test` resolves to test/helpers/node-test.ts (node:test
// with a default per-test timeout) and `node:assert/strict` to test/helpers/assert.ts (ok() without a message fails
// fast), except from those files themselves.
let testRoot;
let wrappers;

export function initialize(data) {
  testRoot = data.testRoot;
  wrappers = new Map(Object.entries(data.wrappers));
}

export function resolve(specifier, context, next) {
  const parent = context.parentURL;
  const wrapper = wrappers.get(specifier);
  if (wrapper !== undefined && parent !== undefined && parent.startsWith(testRoot) && parent !== wrapper) {
    return next(wrapper, context);
  }
  return next(specifier, context);
}
