// A warning raised in the engine's worker thread (the KV disk tier's: less free space than --kv-offload-disk-size)
// follows `conduit serve --log-level` as the server's own warnings do: the thread hands it to the server's logger
// instead of writing it itself at warn level. Under --worker-processes, each child logs at the server's level and its
// lines come out once, at their own level, named by the worker (they used to be wrapped in an info line of the
// server's, with the children fixed at warn). The CLI runs as a child process, as a user runs it.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, it } from 'node:test';
import { startConduit, stopAll, type Proc } from '../helpers/cluster-services.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const FREE_SPACE_WARNING = /KV disk tier .*: its filesystem has \d+ bytes free .* less than the \d+ bytes --kv-offload-disk-size gives it/;

describe('engine-thread warnings and --log-level', () => {
  const dir = mkdtempSync(join(tmpdir(), 'conduit-engine-warnings-'));
  after(async () => {
    await stopAll();
    rmSync(dir, { recursive: true, force: true });
  });

  it('the disk tier\'s free-space warning shows at warn and debug, not at error', { timeout: 180_000 }, async () => {
    const levels = ['warn', 'debug', 'error'] as const;
    // A size no filesystem here has room for: the tier warns once as it opens, before the server listens.
    const runs: Proc[] = levels.map((level) => startConduit(['serve', '--port', '0', '--host', '127.0.0.1', '--kv-cache-memory', '16MiB',
      '--kv-offload-disk', join(dir, `tier-${level}`), '--kv-offload-disk-size', '1000TiB', '--log-level', level]));
    try {
      for (const run of runs) await waitUntil(() => /Conduit is serving/.test(run.output()) || run.child.exitCode !== null, 'the server started', 150_000);
      for (const [i, level] of levels.entries()) {
        const output = runs[i]!.output();
        assert.match(output, /Conduit is serving/, `${level}: ${output}`);
        if (level === 'error') assert.doesNotMatch(output, FREE_SPACE_WARNING, output);
        else assert.equal(output.split('\n').filter((line) => FREE_SPACE_WARNING.test(line) && / WARN  /.test(line)).length, 1, `${level}: ${output}`);
      }
    } finally {
      for (const run of runs) run.kill('SIGKILL');
    }
  });

  it('under --worker-processes, a child logs at the server\'s level, each line once at its own level', { timeout: 180_000 }, async () => {
    const levels = ['warn', 'debug', 'error'] as const;
    const runs: Proc[] = levels.map((level) => startConduit(['serve', '--port', '0', '--host', '127.0.0.1', '--kv-cache-memory', '16MiB',
      '--worker-processes', '--kv-offload-disk', join(dir, `processes-${level}`), '--kv-offload-disk-size', '1000TiB', '--log-level', level]));
    try {
      for (const run of runs) await waitUntil(() => /Conduit is serving/.test(run.output()) || run.child.exitCode !== null, 'the server started', 150_000);
      const lines = (i: number, pattern: RegExp) => runs[i]!.output().split('\n').filter((line) => pattern.test(line));
      for (const [i, level] of levels.entries()) {
        const output = runs[i]!.output();
        assert.match(output, /Conduit is serving/, `${level}: ${output}`);
        const warned = lines(i, FREE_SPACE_WARNING);
        if (level === 'error') assert.deepEqual(warned, [], output);
        else assert.equal(warned.length === 1 && /^\S+ WARN  \[worker-0\] KV disk tier /.test(warned[0]!), true, `${level}: ${output}`);
        // The child's own info line (its address) shows at debug only, as an info line of the worker.
        const serving = lines(i, /worker worker-0 serving /);
        assert.equal(serving.length, level === 'debug' ? 1 : 0, `${level}: ${output}`);
        if (level === 'debug') assert.match(serving[0]!, /^\S+ INFO  \[worker-0\] worker worker-0 serving /);
      }
    } finally {
      for (const run of runs) run.kill('SIGKILL');
    }
  });
});
