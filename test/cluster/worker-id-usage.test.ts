// `conduit worker` refuses a --worker-id (or CONDUIT_WORKER_ID) that is not 1-128 letters, digits, "-" or "_" as it
// refuses such a --namespace: one line `conduit worker: ...` naming the flag (or the variable that gave the value),
// exit code 2, before anything starts. Run as a child process, as a user runs it: the services named are unreachable
// and never tried.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { startConduit } from '../helpers/cluster-services.ts';

const SERVICES = ['--cluster-token', 't', '--etcd-endpoints', 'http://127.0.0.1:1', '--nats-server', 'nats://127.0.0.1:1', '--engine', 'sim'];

async function run(args: string[], env: NodeJS.ProcessEnv = {}): Promise<{ code: number | string; output: string }> {
  const proc = startConduit(['worker', ...SERVICES, ...args], env);
  const timer = setTimeout(() => proc.kill(), 30_000);
  const code = await proc.exited;
  clearTimeout(timer);
  return { code, output: proc.output() };
}

describe('conduit worker: an invalid worker id', () => {
  test('typed on the command line: one line naming --worker-id, exit 2', async () => {
    const { code, output } = await run(['--worker-id', 'a/b']);
    assert.equal(code, 2, output);
    assert.equal(output, 'conduit worker: --worker-id must be 1-128 letters, digits, "-" or "_", got "a/b"\n');
  });

  test('from CONDUIT_WORKER_ID: one line naming the variable, exit 2', async () => {
    const id = 'w'.repeat(129);
    const { code, output } = await run([], { CONDUIT_WORKER_ID: id });
    assert.equal(code, 2, output);
    assert.equal(output, `conduit worker: CONDUIT_WORKER_ID (--worker-id) must be 1-128 letters, digits, "-" or "_", got "${id}"\n`);
  });

  test('an empty id is refused the same way', async () => {
    const { code, output } = await run(['--worker-id=']);
    assert.equal(code, 2, output);
    assert.match(output, /^conduit worker: --worker-id must be 1-128 letters/);
    assert.doesNotMatch(output, /\n {4}at /);
  });
});
