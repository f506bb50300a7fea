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

  it('refuses simulated workers their GPU cannot hold (the GPU and tp from CONDUIT_SIM_GPU / CONDUIT_SIM_TP, as the workers read them) before starting anything', async () => {
    const cases: [string[], NodeJS.ProcessEnv, RegExp][] = [
      [['--sim-model', 'llama-3.1-405b'], {},
        /^conduit cluster: --sim-model: Llama 3\.1 405B on 1 x H100 SXM5 80GB: the weights leave no HBM for the KV cache; use a larger CONDUIT_SIM_TP \(--sim-tp\) or a CONDUIT_SIM_GPU \(--sim-gpu\) with more memory$/m],
      [[], { CONDUIT_SIM_MODEL: 'llama-3.1-70b', CONDUIT_SIM_GPU: 'a100' },
        /^conduit cluster: CONDUIT_SIM_MODEL \(--sim-model\): Llama 3\.1 70B on 1 x A100 .*: the weights leave no HBM for the KV cache;/m],
      [['--sim-model', 'llama-3.1-405b'], { CONDUIT_SIM_TP: '3' },
        /^conduit cluster: CONDUIT_SIM_TP \(--sim-tp\): Llama 3\.1 405B: 128 attention heads do not divide over tp 3$/m],
      [[], { CONDUIT_SIM_GPU: 'xyz' }, /^conduit cluster: CONDUIT_SIM_GPU \(--sim-gpu\): unknown GPU "xyz"; known: h100/m],
      [[], { CONDUIT_SIM_TP: '0' }, /^conduit cluster: CONDUIT_SIM_TP \(--sim-tp\) must be a whole number > 0, got 0$/m],
    ];
    for (const [args, env, message] of cases) {
      const what = `${args.join(' ')} ${JSON.stringify(env)}`;
      const proc = startConduit(['cluster', '--engine', 'sim', '--workers', '1', ...args], env, { detached: true });
      assert.equal(await exitWithin(proc, 20_000), 2, `${what}:\n${proc.output()}`);
      assert.match(proc.output(), message, what);
      assert.doesNotMatch(proc.output(), /etcd http|nats-server|worker-0/, what);
    }
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
