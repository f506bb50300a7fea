// `conduit bench` refuses a bad --timeout before it sends anything: one line, exit code 2.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { runCli as run } from '../helpers/cli-main.ts';

test('conduit bench refuses a timeout Node\'s timers cannot hold (it would fire at once) or one not above 0', async () => {
  // An unreachable server: a refusal must come before any request.
  for (const timeout of ['1e7', '0', '-1']) {
    const { code, err } = await run(['bench', '--url', 'http://127.0.0.1:1', '-n', '1', '--timeout', timeout]);
    assert.equal(code, 2, `${timeout}: ${err}`);
    assert.match(err, /--timeout must be in \(0, 2147483\] seconds/);
  }
});

test('conduit bench refuses prompt lengths no context holds (building such a prompt crashed V8), naming the flag and the bound', async () => {
  for (const [flag, extra] of [['--prompt-tokens', []], ['--system-prompt-tokens', ['--workload', 'shared-prefix']],
    ['--question-tokens', ['--workload', 'shared-prefix']]] as const) {
    for (const value of ['1e9', '1048577']) {
      const { code, out, err } = await run(['bench', '--url', 'http://127.0.0.1:1', '-n', '1', ...extra, flag, value]);
      assert.equal(code, 2, `${flag} ${value}: ${err}`);
      assert.equal(out, '');
      assert.equal(err, `conduit bench: ${flag} must be a whole number from 1 to 1048576, got ${Number(value)}`);
    }
  }
});
