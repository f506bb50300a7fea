// `conduit serve --prefill-workers 1 --decode-workers 1 --worker-processes`, a child killed: the log says why it is
// not restarted (this mode never restarts prefill or decode children), not "restarts are off", which sent the reader
// to --worker-restart-limit, on by default (3) and used by aggregated children only.
import { after, test } from 'node:test';
import assert from 'node:assert/strict';
import { rmSync } from 'node:fs';
import { createLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

interface Health { workers: { id: string; role: string; pid: number; state: string }[] }

const fixture = writeWorkerLossFixture('process-disagg-not-restarted');
let server: RunningServer | undefined;
const pids: number[] = [];

after(async () => {
  await server?.api.shutdown(0);
  for (const pid of pids) {
    try { process.kill(pid, 'SIGKILL'); } catch { /* already gone */ }
  }
  rmSync(fixture.dir, { recursive: true, force: true });
});

test('a lost prefill or decode child is logged as never restarted in this mode, with the restart limit at its default', { timeout: 120_000 }, async () => {
  const lines: string[] = [];
  const config = parseServeConfig(['--model', fixture.modelPath, '--port', '0', '--threads', '1', '--kv-cache-memory', '16MiB',
    '--no-request-log', '--prefill-workers', '1', '--decode-workers', '1', '--worker-processes'], {});
  assert.notEqual(config, 'help');
  server = await startServer(config as Exclude<typeof config, 'help'>, createLogger('info', (line) => lines.push(line)));
  const health = await (await fetch(`${server.url}/health`)).json() as Health;
  pids.push(...health.workers.map((w) => w.pid));
  const decode = health.workers.find((w) => w.role === 'decode')!;
  process.kill(decode.pid, 'SIGKILL');
  const notRestarted = (line: string) => line.includes(`decode worker ${decode.id} is not restarted`);
  await waitUntil(() => lines.some(notRestarted), 'the lost decode child is logged', 60_000);
  assert.match(lines.find(notRestarted)!,
    / ERROR decode worker \S+ is not restarted \(--worker-processes never restarts prefill or decode workers; --worker-restart-limit is for aggregated ones\)\n$/);
  assert.ok(!lines.some((line) => line.includes('restarts are off')), lines.join(''));
});
