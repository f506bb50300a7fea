// `conduit cluster` starts NATS only once etcd listens, and checks both binaries (--etcd-bin, --nats-bin) before it
// starts either: an etcd that cannot start used to leave a nats-server started and stopped again for nothing, and a
// missing binary was reported as `etcd exited (code -2)` after NATS had started.
import assert from 'node:assert/strict';
import { after, describe, it } from 'node:test';
import { servicesMissing, startConduit, stopAll, type Proc } from '../helpers/cluster-services.ts';

async function exited(proc: Proc): Promise<number | string> {
  let timer: NodeJS.Timeout | undefined;
  const code = await Promise.race([proc.exited, new Promise<string>((resolve) => { timer = setTimeout(() => resolve('still running'), 30_000); })]);
  clearTimeout(timer);
  if (code === 'still running') proc.kill('SIGTERM');
  return code;
}

/** What nats-server prints as it starts (its banner, its ready line). */
const NATS_STARTED = /\[INF\]|Server is ready/;

describe('conduit cluster start order', () => {
  after(stopAll);

  it('starts no NATS when etcd exits before it listens', { skip: servicesMissing() }, async () => {
    const proc = startConduit(['cluster', '--engine', 'sim', '--workers', '1', '--etcd-bin', '/bin/false'], {}, { detached: true });
    assert.equal(await exited(proc), 1, proc.output());
    assert.match(proc.output(), /^conduit cluster: etcd exited \(code 1\) before listening on \d+$/m);
    assert.doesNotMatch(proc.output(), NATS_STARTED);
  });

  it('refuses a binary it cannot run, typed or from the environment, before it starts anything (exit 2)', async () => {
    const cases: [string[], NodeJS.ProcessEnv, RegExp][] = [
      [['--etcd-bin', '/nonexistent/etcd'], {}, /^conduit cluster: --etcd-bin cannot run \/nonexistent\/etcd: no such file or folder$/m],
      [['--etcd-bin', '/tmp'], {}, /^conduit cluster: --etcd-bin cannot run \/tmp: is a folder, not a file$/m],
      [[], { CONDUIT_NATS_BIN: '/nonexistent/nats-server' },
        /^conduit cluster: CONDUIT_NATS_BIN \(--nats-bin\) cannot run \/nonexistent\/nats-server: no such file or folder$/m],
    ];
    for (const [args, env, message] of cases) {
      const what = `${args.join(' ')} ${JSON.stringify(env)}`;
      const proc = startConduit(['cluster', '--engine', 'sim', '--workers', '1', ...args], env, { detached: true });
      assert.equal(await exited(proc), 2, `${what}:\n${proc.output()}`);
      assert.match(proc.output(), message, what);
      assert.doesNotMatch(proc.output(), NATS_STARTED, what);
    }
  });
});
