// `conduit help <command>` prints that command's help, as `conduit <command> --help` does; an unknown command after
// `help` is refused with the usage. Run in-process through main().
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { runCli as run } from '../helpers/cli-main.ts';

test('conduit help <command> is conduit <command> --help', async () => {
  for (const command of ['serve', 'trace', 'cluster', 'frontend']) {
    const viaHelp = await run(['help', command]);
    const viaFlag = await run([command, '--help']);
    assert.equal(viaHelp.code, 0, viaHelp.err);
    assert.match(viaHelp.out, new RegExp(`^Usage: conduit ${command} `));
    assert.equal(viaHelp.out, viaFlag.out);
  }
});

test('conduit help refuses a command it does not know', async () => {
  const { code, err } = await run(['help', 'bogus']);
  assert.equal(code, 2);
  assert.match(err, /^conduit help: unknown command "bogus"/);
  assert.match(err, /Usage: conduit <command>/);
});
