// Module resolution hook for test/run.ts: inside test/, `node:test` resolves to test/helpers/node-test.ts (node:test
// with a default per-test timeout), except from that file itself.
let testRoot;
let wrapper;

export function initialize(data) {
  testRoot = data.testRoot;
  wrapper = data.wrapper;
}

export function resolve(specifier, context, next) {
  const parent = context.parentURL;
  if (specifier === 'node:test' && parent !== undefined && parent.startsWith(testRoot) && parent !== wrapper) {
    return next(wrapper, context);
  }
  return next(specifier, context);
}
