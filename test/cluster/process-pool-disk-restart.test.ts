// `conduit serve --worker-processes` with a KV disk tier: a child that dies is replaced by a process that takes over
// its folder (DIR/worker-0, its lock included), as a restarted worker thread takes its slot's, rather than a new
// DIR/worker-0-r1 beside it: the blocks written there are found again, the tier stays within
// --kv-offload-disk-size, and the next start does not meet a folder it neither reads nor removes.
import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { readdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { createLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

interface WorkerView { id: string; pid: number; state: string }

describe('serve --worker-processes with a disk tier: a replaced child', () => {
  let dir: string | undefined;
  let server: RunningServer | undefined;
  const pids = new Set<number>();

  after(async () => {
    await server?.api.shutdown(0);
    for (const pid of pids) {
      try { process.kill(pid, 'SIGKILL'); } catch { /* already gone */ }
    }
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  test('keeps its place\'s folder and the tier in it', { timeout: 180_000 }, async () => {
    const fixture = writeWorkerLossFixture('process-pool-disk-restart');
    dir = fixture.dir;
    const tierDir = join(dir, 'tier');
    const config = parseServeConfig(['--model', fixture.modelPath, '--port', '0', '--workers', '1', '--worker-processes', '--threads', '1',
      '--kv-cache-memory', '4MiB', '--kv-offload-memory', '1MiB', '--kv-offload-disk', tierDir, '--kv-offload-disk-size', '4MiB',
      '--worker-restart-delay', '10', '--no-request-log'], {});
    assert.notEqual(config, 'help');
    server = await startServer(config as Exclude<typeof config, 'help'>, createLogger('error'));
    const url = server.url;
    const health = async (): Promise<{ workers: WorkerView[] }> => (await fetch(`${url}/health`)).json() as never;
    const complete = async () => {
      const res = await fetch(`${url}/v1/completions`, {
        method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: 'Hello there', max_tokens: 2 }),
      });
      assert.equal(res.status, 200, await res.text());
    };
    await complete();
    assert.deepEqual(readdirSync(tierDir).sort(), ['conduit.lock', 'worker-0']);

    const [first] = (await health()).workers;
    assert.equal(first?.id, 'worker-0');
    pids.add(first.pid);
    process.kill(first.pid, 'SIGKILL');
    let replaced: WorkerView | undefined;
    for (let turn = 0; !replaced; turn++) {
      assert.ok(turn < 1200, 'the child is replaced within a minute');
      await new Promise((resolve) => setTimeout(resolve, 50));
      replaced = (await health()).workers.find((w) => w.id === 'worker-0-r1' && w.state === 'ready');
    }
    pids.add(replaced.pid);

    await complete();
    assert.deepEqual(readdirSync(tierDir).sort(), ['conduit.lock', 'worker-0'], 'the replacement uses worker-0, no folder of its own');
    // It opened the tier there (its lock taken over from the dead child): its stats carry a disk tier.
    const metrics = await (await fetch(`${url}/metrics`)).text();
    const capacity = /^conduit_kv_tier_capacity_blocks\{worker="worker-0-r1",tier="disk"\} (\d+)$/m.exec(metrics);
    assert.ok(capacity && Number(capacity[1]) > 0, `a disk tier on the replacement:\n${metrics.split('\n').filter((l) => l.includes('tier')).join('\n')}`);
  });
});
