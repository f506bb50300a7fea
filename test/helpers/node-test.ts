// node:test with a default timeout on every test and hook, so a test that hangs fails instead of stopping the run.
// test/run.ts points every test file's `import ... from 'node:test'` here (test/helpers/node-test-hooks.mjs);
// files need no change. A test's own `timeout` option wins. Suites get none: a suite's timeout would bound all of
// its tests together, while each of its tests already has its own.
//
// Why not `--test-timeout`: on Node 20 it bounds each test *file* the runner starts, and test/run.ts is one file
// holding every suite, so it would only be a limit on the whole run.
import * as nodeTest from 'node:test';

export const { describe, suite, mock, run } = nodeTest;

/** The default timeout: CONDUIT_TEST_TIMEOUT_MS, else two minutes (the slowest test took 19 s in a full run on a loaded 2-core machine). */
export const DEFAULT_TEST_TIMEOUT_MS = (() => {
  const raw = process.env.CONDUIT_TEST_TIMEOUT_MS;
  const n = raw === undefined || raw.trim() === '' ? Number.NaN : Number(raw);
  return Number.isFinite(n) && n > 0 ? n : 120_000;
})();

type AnyFn = (...args: unknown[]) => unknown;

const isOptions = (value: unknown): value is Record<string, unknown> =>
  typeof value === 'object' && value !== null && !Array.isArray(value);

/** test([name][, options][, fn]) with the default timeout in options unless it names one. */
function testArgs(args: unknown[]): unknown[] {
  const at = typeof args[0] === 'string' || args[0] === undefined ? 1 : 0;
  const given = args[at];
  if (isOptions(given)) return given.timeout === undefined ? args.with(at, { ...given, timeout: DEFAULT_TEST_TIMEOUT_MS }) : args;
  const out = [...args];
  out.splice(at, 0, { timeout: DEFAULT_TEST_TIMEOUT_MS });
  return out;
}

/** hook(fn[, options]) likewise. */
function hookArgs(args: unknown[]): unknown[] {
  const [fn, options] = args;
  if (isOptions(options)) return options.timeout === undefined ? [fn, { ...options, timeout: DEFAULT_TEST_TIMEOUT_MS }] : args;
  return [fn, { timeout: DEFAULT_TEST_TIMEOUT_MS }];
}

function withTimeout<F>(inner: F, argsOf: (args: unknown[]) => unknown[]): F {
  const call = inner as unknown as AnyFn & Record<string, unknown>;
  const wrapped = Object.assign((...args: unknown[]) => call(...argsOf(args)), call);
  for (const variant of ['skip', 'todo', 'only'] as const) {
    const original = call[variant];
    if (typeof original === 'function') wrapped[variant] = (...args: unknown[]) => (original as AnyFn)(...argsOf(args));
  }
  return wrapped as unknown as F;
}

export const test = withTimeout(nodeTest.test, testArgs);
export const it = withTimeout(nodeTest.it, testArgs);
export const before = withTimeout(nodeTest.before, hookArgs);
export const after = withTimeout(nodeTest.after, hookArgs);
export const beforeEach = withTimeout(nodeTest.beforeEach, hookArgs);
export const afterEach = withTimeout(nodeTest.afterEach, hookArgs);
export default test;
