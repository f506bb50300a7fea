// The `conduit` command itself: --version prints the package's version, a bare `conduit` prints usage and exits 2.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { describe, it } from 'node:test';
import { runCli } from '../helpers/cli-main.ts';

describe('conduit', () => {
  it('--version (and -V, version) prints the package version', async () => {
    const { version } = JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8')) as { version: string };
    for (const argv of [['--version'], ['-V'], ['version']]) {
      assert.deepEqual(await runCli(argv), { code: 0, out: version, err: '' }, argv[0]);
    }
  });

  it('with no command prints the usage, which names --version, and exits 2', async () => {
    const run = await runCli([]);
    assert.equal(run.code, 2);
    assert.match(run.out, /^Usage: conduit <command>/);
    assert.match(run.out, /conduit --version/);
  });
});
