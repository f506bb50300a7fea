// `conduit cluster` checks the options it hands its frontend (port, routing policy, migration limit) and its simulated
// workers (their profile, and that it fits the GPU and tp they read from the environment), and refuses stray
// arguments before it starts anything; and a frontend that exits on its own (its port in use) stops the whole cluster
// with exit code 1, etcd and NATS included, instead of leaving them running with no API in front. The command runs as
// a child process in a group of its own, as a shell starts a job; every wait is bounded.
import assert from 'node:assert/strict';
import net from 'node:net';
import { after, describe, it } from 'node:test';
import { freePort, servicesMissing, startConduit, stopAll, type Proc } from '../helpers/cluster-services.ts';

const listening = (port: number): Promise<boolean> => new Promise((resolve) => {
  const socket = net.connect({ host: '127.0.0.1', port });
  socket.once('connect', () => { socket.destroy(); resolve(true); });
  socket.once('error', () => resolve(false));
});

/** The exit code, or 'still running' after `ms` (then the command is stopped as Ctrl-C would, and its children with it). */
async function exitWithin(proc: Proc, ms: number): Promise<number | string> {
  let timer: NodeJS.Timeout | undefined;
  const code = await Promise.race([proc.exited, new Promise<string>((resolve) => { timer = setTimeout(() => resolve('still running'), ms); })]);
  clearTimeout(timer);
  if (code === 'still running') {
    proc.kill('SIGTERM');
    await Promise.race([proc.exited, new Promise((resolve) => setTimeout(resolve, 30_000))]);
  }
  return code;
}

describe('conduit cluster options', () => {
  after(stopAll);

  it('refuses a bad --port, --routing-policy, --migration-limit or --sim-model, and stray arguments, before starting anything', async () => {
    const cases: [string[], RegExp][] = [
      [['--port', '70000'], /conduit cluster: --port must be 0\.\.65535, got 70000/],
      [['--routing-policy', 'bogus'], /conduit cluster: --routing-policy must be one of kv, .*got "bogus"/],
      [['--migration-limit', '-1'], /conduit cluster: --migration-limit must be a whole number >= 0, got -1/],
      [['extra-arg'], /conduit cluster: unexpected argument "extra-arg"/],
      [['--workers', '1e9'], /conduit cluster: --workers must be at most 1024, got 1000000000/],
      [['--sim-model', 'bogus'], /conduit cluster: --sim-model: unknown model "bogus"; known: llama-3\.1-8b/],
    ];
    for (const [args, message] of cases) {
      const proc = startConduit(['cluster', '--engine', 'sim', '--workers', '1', ...args], {}, { detached: true });
      assert.equal(await exitWithin(proc, 20_000), 2, `${args.join(' ')}:\n${proc.output()}`);
      assert.match(proc.output(), message);
      // Nothing was started: no etcd, NATS or worker to report on.
      assert.doesNotMatch(proc.output(), /etcd http|worker-0/, args.join(' '));
    }
  });

  it('refuses simulated workers their GPU cannot hold (--sim-gpu / --sim-tp or their twins CONDUIT_SIM_GPU / CONDUIT_SIM_TP) before starting anything', async () => {
    const cases: [string[], NodeJS.ProcessEnv, RegExp][] = [
      [['--sim-model', 'llama-3.1-405b'], {},
        /^conduit cluster: --sim-model: Llama 3\.1 405B on 1 x H100 SXM5 80GB: the weights leave no HBM for the KV cache; use a larger --sim-tp or a --sim-gpu with more memory$/m],
      [[], { CONDUIT_SIM_MODEL: 'llama-3.1-70b', CONDUIT_SIM_GPU: 'a100' },
        /^conduit cluster: CONDUIT_SIM_MODEL \(--sim-model\): Llama 3\.1 70B on 1 x A100 .*: the weights leave no HBM for the KV cache;/m],
      [['--sim-model', 'llama-3.1-405b'], { CONDUIT_SIM_TP: '3' },
        /^conduit cluster: CONDUIT_SIM_TP \(--sim-tp\): Llama 3\.1 405B: 128 attention heads do not divide over tp 3$/m],
      [[], { CONDUIT_SIM_GPU: 'xyz' }, /^conduit cluster: CONDUIT_SIM_GPU \(--sim-gpu\): unknown GPU "xyz"; known: h100/m],
      [[], { CONDUIT_SIM_TP: '0' }, /^conduit cluster: CONDUIT_SIM_TP \(--sim-tp\) must be a whole number > 0, got 0$/m],
      // The same options typed: named as typed, and a flag wins over its variable.
      [['--sim-model', 'llama-3.1-70b', '--sim-gpu', 'a100'], { CONDUIT_SIM_GPU: 'h200' },
        /^conduit cluster: --sim-model: Llama 3\.1 70B on 1 x A100 .*: the weights leave no HBM for the KV cache;/m],
      [['--sim-model', 'llama-3.1-405b', '--sim-tp', '3'], { CONDUIT_SIM_TP: '8' },
        /^conduit cluster: --sim-tp: Llama 3\.1 405B: 128 attention heads do not divide over tp 3$/m],
      [['--sim-gpu', 'xyz'], {}, /^conduit cluster: --sim-gpu: unknown GPU "xyz"; known: h100/m],
      [['--sim-tp', '0'], {}, /^conduit cluster: --sim-tp must be a whole number > 0, got 0$/m],
    ];
    for (const [args, env, message] of cases) {
      const what = `${args.join(' ')} ${JSON.stringify(env)}`;
      const proc = startConduit(['cluster', '--engine', 'sim', '--workers', '1', ...args], env, { detached: true });
      assert.equal(await exitWithin(proc, 20_000), 2, `${what}:\n${proc.output()}`);
      assert.match(proc.output(), message, what);
      assert.doesNotMatch(proc.output(), /etcd http|nats-server|worker-0/, what);
    }
  });

  it('hands --sim-gpu and --sim-tp to the simulated workers, and lists them with their variables in --help',
    { skip: servicesMissing(), timeout: 150_000 }, async () => {
      const help = startConduit(['cluster', '--help']);
      assert.equal(await help.exited, 0, help.output());
      assert.match(help.output(), /^ {2}--sim-gpu <string> .*\(default h100\) \[env CONDUIT_SIM_GPU\]$/m);
      assert.match(help.output(), /^ {2}--sim-tp <number> .*\(default 1\) \[env CONDUIT_SIM_TP\]$/m);
      // 405B fits 8 x H200 (not the default 1 x H100): the check and the workers both use the flags.
      const port = await freePort();
      const proc = startConduit(['cluster', '--engine', 'sim', '--workers', '1', '--port', String(port), '--shutdown-grace', '1',
        '--sim-model', 'llama-3.1-405b', '--sim-gpu', 'h200', '--sim-tp', '8'], {}, { detached: true });
      const serving = /worker worker-0 serving .* \(simulated engine: llama-3\.1-405b on 8 x h200,/;
      for (const deadline = Date.now() + 90_000; !serving.test(proc.output());) {
        if (proc.child.exitCode !== null || Date.now() > deadline) assert.fail(`no ${serving}:\n${proc.output()}`);
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
      assert.equal(await exitWithin(proc, 0), 'still running', proc.output());
    });

  it('stops etcd, NATS and the workers with exit code 1 when the frontend exits on its own (its port in use)',
    { skip: servicesMissing(), timeout: 150_000 }, async () => {
      const port = await freePort();
      const busy = net.createServer();
      await new Promise<void>((resolve) => busy.listen(port, '127.0.0.1', resolve));
      try {
        const proc = startConduit(['cluster', '--engine', 'sim', '--workers', '1', '--port', String(port), '--shutdown-grace', '1'], {},
          { detached: true });
        const code = await exitWithin(proc, 90_000);
        const output = proc.output();
        assert.equal(code, 1, output);
        assert.match(output, /cannot listen on 127\.0\.0\.1:\d+/);
        assert.match(output, /conduit cluster: the frontend exited \(code 1\)/);
        const services = /etcd http:\/\/127\.0\.0\.1:(\d+), NATS nats:\/\/127\.0\.0\.1:(\d+)/.exec(output);
        assert.ok(services, output);
        for (const [what, p] of [['etcd', Number(services[1])], ['NATS', Number(services[2])]] as const) {
          assert.equal(await listening(p), false, `${what} still listens on ${p}`);
        }
      } finally {
        await new Promise((resolve) => busy.close(resolve));
      }
    });
});
