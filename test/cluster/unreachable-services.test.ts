// A frontend or worker whose NATS does not answer says so every few seconds ("waiting for NATS at ...", with the
// reason) instead of waiting silently, and SIGINT/SIGTERM stop it at once, exit code 0; a worker waiting to register
// in an etcd that does not answer stops as promptly. Real processes, real nats-server where one must answer; every
// wait is bounded.
import assert from 'node:assert/strict';
import { after, describe, it } from 'node:test';
import { freePort, servicesMissing, startConduit, startNats, stopAll, type Nats, type Proc } from '../helpers/cluster-services.ts';

async function waitForOutput(proc: Proc, pattern: RegExp, ms: number, from = 0): Promise<void> {
  for (const deadline = Date.now() + ms; ;) {
    if (pattern.test(proc.output().slice(from))) return;
    if (proc.child.exitCode !== null) throw new Error(`exited before ${pattern}:\n${proc.output()}`);
    if (Date.now() > deadline) throw new Error(`no ${pattern} within ${ms} ms:\n${proc.output()}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

/** Signals the process and resolves with its exit code and how long it took (or 'still running' after 10 s). */
async function stopWith(proc: Proc, signal: NodeJS.Signals): Promise<{ code: number | string; ms: number }> {
  const start = Date.now();
  proc.kill(signal);
  let timer: NodeJS.Timeout | undefined;
  const code = await Promise.race([proc.exited, new Promise<string>((resolve) => { timer = setTimeout(() => resolve('still running'), 10_000); })]);
  clearTimeout(timer);
  return { code, ms: Date.now() - start };
}

describe('services that do not answer', () => {
  after(stopAll);

  it('a frontend and a worker say they wait for NATS, again every few seconds, and a signal stops them at once', { timeout: 60_000 }, async () => {
    const natsPort = await freePort();
    const services = ['--cluster-token', 't', '--etcd-endpoints', `http://127.0.0.1:${await freePort()}`, '--nats-server', `nats://127.0.0.1:${natsPort}`];
    const waiting = new RegExp(`WARN\\s+waiting for NATS at nats://127\\.0\\.0\\.1:${natsPort} \\(connection refused\\); retrying`);
    for (const [args, signal] of [[['frontend', '--port', '0'], 'SIGINT'], [['worker', '--engine', 'sim'], 'SIGTERM']] as const) {
      const proc = startConduit([...args, ...services]);
      await waitForOutput(proc, waiting, 20_000);
      // Said again while the wait goes on.
      const seen = proc.output().length;
      await waitForOutput(proc, waiting, 10_000, seen);
      const { code, ms } = await stopWith(proc, signal);
      assert.equal(code, 0, `${args[0]}:\n${proc.output()}`);
      assert.ok(ms < 5000, `${args[0]} took ${ms} ms to stop`);
      assert.match(proc.output(), new RegExp(`${signal}: stopped while waiting for NATS at nats://127\\.0\\.0\\.1:${natsPort}`));
    }
  });

  describe('with NATS up', { skip: servicesMissing() }, () => {
    let nats: Nats;
    it('a worker waiting to register in an etcd that does not answer stops at once on SIGINT', { timeout: 60_000 }, async () => {
      nats = await startNats();
      const etcdPort = await freePort();
      const proc = startConduit(['worker', '--engine', 'sim', '--worker-id', 'lonely', '--cluster-token', 't',
        '--etcd-endpoints', `http://127.0.0.1:${etcdPort}`, '--nats-server', nats.url]);
      await waitForOutput(proc, /etcd: cannot register \/conduit\/workers\/lonely yet/, 20_000);
      const { code, ms } = await stopWith(proc, 'SIGINT');
      assert.equal(code, 0, proc.output());
      assert.ok(ms < 5000, `took ${ms} ms to stop`);
      assert.match(proc.output(), /SIGINT: stopped while registering \/conduit\/workers\/lonely/);
    });
  });
});
