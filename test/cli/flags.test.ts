// The flag table's parser: where each value came from, --help having no environment twin, and flags that have no
// effect in the configuration at hand (an error when typed, a warning and the default when they come from the
// environment).
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { formatFlagHelp, ignoreInapplicable, parseFlags, UsageError, type FlagTable } from '../../src/cli/flags.ts';
import { runCli } from '../helpers/cli-main.ts';

const TABLE = {
  size: { type: 'number', help: 'a size', default: 4 },
  name: { type: 'string', help: 'a name' },
  fast: { type: 'boolean', help: 'go fast' },
  label: { type: 'string', help: 'a label', env: 'OTHER_LABEL' },
} satisfies FlagTable;

describe('parseFlags', () => {
  it('says where each value came from: the command line, the environment, or the default', () => {
    const parsed = parseFlags(TABLE, ['--size', '8', '--no-fast'], { CONDUIT_SIZE: '16', CONDUIT_NAME: 'env-name', OTHER_LABEL: 'x', CONDUIT_FAST: 'true' });
    assert.deepEqual(parsed.values, { size: 8, name: 'env-name', fast: false, label: 'x' });
    assert.deepEqual(parsed.sources, { size: 'command line', name: 'environment', fast: 'command line', label: 'environment' });
    const bare = parseFlags(TABLE, [], { CONDUIT_NAME: '' });
    assert.deepEqual(bare.values, { size: 4, name: undefined, fast: false, label: undefined });
    assert.deepEqual(bare.sources, { size: 'default', name: 'default', fast: 'default', label: 'default' }, 'an empty variable is unset');
  });
});

describe('an internal flag without a twin (noEnvTwin)', () => {
  it('is set by its command line alone, and --help shows no variable for it', () => {
    const table = { ...TABLE, child: { type: 'boolean', help: 'internal', noEnvTwin: true } } satisfies FlagTable;
    const parsed = parseFlags(table, [], { CONDUIT_CHILD: '1' });
    assert.equal(parsed.values.child, false);
    assert.equal(parsed.sources.child, 'default');
    assert.equal(parseFlags(table, ['--child'], {}).values.child, true);
    assert.doesNotMatch(formatFlagHelp(table), /CONDUIT_CHILD/);
  });
});

describe('--help', () => {
  it('has no environment twin: a stray CONDUIT_HELP (or a prefixed one) does not turn a command into its help', () => {
    const table = { ...TABLE, help: { type: 'boolean', help: 'show this help', short: 'h' } } satisfies FlagTable;
    const prefixed = { ...table, help: { ...table.help, env: 'CONDUIT_SIM_HELP' } } satisfies FlagTable;
    for (const t of [table, prefixed]) {
      const parsed = parseFlags(t, [], { CONDUIT_HELP: '1', CONDUIT_SIM_HELP: '1' });
      assert.equal(parsed.values.help, false);
      assert.equal(parsed.sources.help, 'default');
      assert.equal(parseFlags(t, ['-h'], {}).values.help, true);
      assert.doesNotMatch(formatFlagHelp(t), /_HELP/);
      assert.match(formatFlagHelp(t), /\[env CONDUIT_SIZE\]/);
    }
  });

  it('through the commands: each one runs (here, to its first usage error) rather than printing its help', async () => {
    const env = { CONDUIT_HELP: '1', CONDUIT_SIM_HELP: '1', CONDUIT_PLAN_HELP: '1', CONDUIT_TRACE_HELP: '1' };
    for (const [argv, message] of [
      [['generate'], /--prompt is required/], [['plan'], /--rate is required/], [['trace'], /a request id is needed/],
      [['bench', '--timeout', '0'], /--timeout must be in/], [['sim', 'lifecycle', '--tp', '3'], /do not divide over tp 3/],
      [['serve', '--port', '-1'], /--port/],
    ] as const) {
      const { code, out, err } = await runCli([...argv], env);
      assert.equal(code, 2, `${argv.join(' ')}: ${out}${err}`);
      assert.match(err, message);
    }
  });
});

describe('ignoreInapplicable', () => {
  it('refuses inapplicable flags typed on the command line, naming them', () => {
    const parsed = parseFlags(TABLE, ['--size', '8', '--fast'], { CONDUIT_NAME: 'n' });
    assert.throws(() => ignoreInapplicable(TABLE, parsed, ['size', 'fast', 'name'], 'not here'),
      (err: unknown) => err instanceof UsageError && err.message === '--size, --fast: not here');
  });

  it('ignores those from the environment: one warning each, the value back to its default', () => {
    const parsed = parseFlags(TABLE, ['--name', 'typed'], { CONDUIT_SIZE: '16', OTHER_LABEL: 'x', CONDUIT_FAST: '1' });
    const warnings = ignoreInapplicable(TABLE, parsed, ['size', 'label', 'fast'], 'only with --name unset');
    assert.deepEqual(warnings, [
      'ignoring CONDUIT_SIZE=16: --size is only with --name unset',
      'ignoring OTHER_LABEL=x: --label is only with --name unset',
      'ignoring CONDUIT_FAST=1: --fast is only with --name unset',
    ]);
    assert.deepEqual(parsed.values, { size: 4, name: 'typed', fast: false, label: undefined });
    assert.deepEqual(parsed.sources, { size: 'default', name: 'command line', fast: 'default', label: 'default' });
    assert.deepEqual(ignoreInapplicable(TABLE, parseFlags(TABLE, [], {}), ['size', 'name'], 'never'), [], 'defaults are not settings');
  });

  it('through parseFlags: an inapplicable environment value is ignored even when it does not convert', () => {
    const env = { CONDUIT_SIZE: 'big', CONDUIT_NAME: 'n' };
    const options = { inapplicable: (v: { name?: string }) => v.name === 'typed' ? { names: ['size'] as const, why: 'unused' } : undefined };
    const parsed = parseFlags(TABLE, ['--name', 'typed'], env, options);
    assert.deepEqual(parsed.warnings, ['ignoring CONDUIT_SIZE=big: --size is unused']);
    assert.equal(parsed.values.size, 4);
    assert.throws(() => parseFlags(TABLE, [], env, options),
      (err: unknown) => err instanceof UsageError && err.message === 'CONDUIT_SIZE --size expects a number, got "big"', 'applicable: refused');
    assert.throws(() => parseFlags(TABLE, [], env), UsageError, 'no rule: refused');
  });
});
