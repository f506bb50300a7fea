// `conduit cluster --engine cpu` with a --sim-* option typed says that its cpu workers ignore it, as `conduit serve`
// does, instead of dropping it without a word; from the environment (set up for another deployment) it says nothing.
// etcd here is /bin/false, so the command stops right after its checks and warnings (exit 1), starting nothing else.
import assert from 'node:assert/strict';
import { after, describe, it } from 'node:test';
import { startConduit, stopAll, type Proc } from '../helpers/cluster-services.ts';

async function exited(proc: Proc): Promise<number | string> {
  let timer: NodeJS.Timeout | undefined;
  const code = await Promise.race([proc.exited, new Promise<string>((resolve) => { timer = setTimeout(() => resolve('still running'), 30_000); })]);
  clearTimeout(timer);
  if (code === 'still running') proc.kill('SIGTERM');
  return code;
}

describe('conduit cluster --engine cpu with --sim-* options', () => {
  after(stopAll);

  it('warns about each --sim-* option typed, as conduit serve does', async () => {
    const proc = startConduit(['cluster', '--engine', 'cpu', '--workers', '1', '--sim-gpu', 'h200', '--sim-tp', '2',
      '--etcd-bin', '/bin/false'], {}, { detached: true });
    assert.equal(await exited(proc), 1, proc.output());
    assert.match(proc.output(), /^conduit cluster: --sim-gpu is for simulated workers \(--engine sim\): cpu workers ignore it$/m);
    assert.match(proc.output(), /^conduit cluster: --sim-tp is for simulated workers \(--engine sim\): cpu workers ignore it$/m);
    assert.doesNotMatch(proc.output(), /--sim-model is for/, 'an option left at its default is not named');
  });

  it('says nothing of --sim-* variables from the environment, nor of the options given to simulated workers', async () => {
    for (const [args, env] of [[['--engine', 'cpu'], { CONDUIT_SIM_GPU: 'h200' }], [['--engine', 'sim', '--sim-gpu', 'h200'], {}]] as const) {
      const proc = startConduit(['cluster', '--workers', '1', ...args, '--etcd-bin', '/bin/false'], env, { detached: true });
      assert.equal(await exited(proc), 1, proc.output());
      assert.doesNotMatch(proc.output(), /is for simulated workers/, `${args.join(' ')} ${JSON.stringify(env)}`);
    }
  });
});
