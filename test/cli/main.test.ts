// The `conduit` command itself: --version prints the package's version, a bare `conduit` prints usage and exits 2;
// output into a pipe whose reader has gone ends quietly, as a Unix tool killed by SIGPIPE does.
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
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

  it('writing into a pipe whose reader has gone (`conduit sim decode-sweep | head -1`) ends quietly with status 141, as SIGPIPE would', async () => {
    const bin = fileURLToPath(new URL('../../bin/conduit.js', import.meta.url));
    const child = spawn(process.execPath, [bin, 'sim', 'decode-sweep', '--no-check', '--batches', '1'], { stdio: ['ignore', 'pipe', 'pipe'] });
    // The reader goes before the first line is written: every write meets a closed pipe.
    child.stdout.destroy();
    let err = '';
    child.stderr.setEncoding('utf8').on('data', (chunk: string) => { err += chunk; });
    const [code, signal] = await once(child, 'exit') as [number | null, string | null];
    assert.deepEqual({ code, signal, err }, { code: 141, signal: null, err: '' });
  });
});
