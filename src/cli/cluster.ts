// `conduit cluster`: the distributed runtime on this machine in one command, for trying it out: etcd and
// nats-server (the Debian binaries, data in a temporary folder), N `conduit worker` processes and one
// `conduit frontend`, all on loopback. Ctrl-C (or SIGTERM, SIGHUP) stops them all: the frontend first, then the
// workers (they drain and deregister), then NATS and etcd; the temporary folder is removed. A worker or the frontend
// that exits on its own (a bad model, a port in use) stops them all the same way, with exit code 1.

import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { accessSync, constants, mkdtempSync, rmSync, statSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { POLICY_NAMES } from '../router/protocols.ts';
import { checkSimDeployment } from '../sim/sim-worker.ts';
import { checkCount, checkTimerSecondsAtMost, describeFileError, flagLabel, formatFlagHelp, MAX_WORKERS, nameEnvironment, parseFlags, UsageError, type FlagTable, type ParsedFlags } from './flags.ts';
import { positiveInteger, SERVE_FLAGS, simOptionWarnings } from './serve.ts';
import type { Command } from './main.ts';

const CONDUIT_BIN = fileURLToPath(new URL('../../bin/conduit.js', import.meta.url));

export const CLUSTER_DEMO_FLAGS = {
  workers: { type: 'number', help: 'worker processes (at most 1024)', default: 2 },
  port: { type: 'number', help: 'port of the frontend\'s OpenAI API', default: 8000, short: 'p' },
  engine: { type: 'string', help: 'the workers\' engine: cpu or sim', default: 'cpu' },
  model: { type: 'string', help: 'the workers\' model (default: the built-in synthetic model)', short: 'm' },
  'sim-model': { type: 'string', help: 'model profile of simulated workers', default: 'llama-3.1-8b' },
  // The workers' own options (conduit serve's and conduit worker's), passed to them as given.
  'sim-gpu': SERVE_FLAGS['sim-gpu'],
  'sim-tp': SERVE_FLAGS['sim-tp'],
  'migration-limit': { type: 'number', help: 'the frontend\'s --migration-limit', default: 1 },
  'routing-policy': { type: 'string', help: 'the frontend\'s --routing-policy', default: 'kv' },
  'shutdown-grace': { type: 'number', help: 'seconds the frontend and the workers get to finish their streams when stopped (their --shutdown-grace)', default: 30 },
  'etcd-bin': { type: 'string', help: 'the etcd binary', default: '/usr/bin/etcd' },
  'nats-bin': { type: 'string', help: 'the nats-server binary', default: '/usr/sbin/nats-server' },
  help: { type: 'boolean', help: 'show this help', short: 'h' },
} satisfies FlagTable;

/** `count` distinct free loopback ports: each is held until all are found, so listen(0) cannot give one twice. */
async function freePorts(count: number): Promise<number[]> {
  const servers: net.Server[] = [];
  try {
    for (let i = 0; i < count; i++) {
      const server = net.createServer();
      servers.push(server);
      await new Promise<void>((resolve, reject) => {
        server.once('error', reject);
        server.listen(0, '127.0.0.1', resolve);
      });
    }
    return servers.map((server) => (server.address() as net.AddressInfo).port);
  } finally {
    await Promise.all(servers.map((server) => new Promise((resolve) => server.close(resolve))));
  }
}

async function waitForPort(port: number, what: string, child: ChildProcess, maxMs = 30_000): Promise<void> {
  const deadline = Date.now() + maxMs;
  for (;;) {
    if (child.exitCode !== null) throw new Error(`${what} exited (code ${child.exitCode}) before listening on ${port}`);
    const ok = await new Promise<boolean>((resolve) => {
      const socket = net.connect({ host: '127.0.0.1', port });
      socket.once('connect', () => { socket.destroy(); resolve(true); });
      socket.once('error', () => resolve(false));
    });
    if (ok) return;
    if (Date.now() > deadline) throw new Error(`${what} did not listen on ${port} within ${maxMs / 1000} s`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

/**
 * A simulated worker of --sim-model on --sim-gpu with --sim-tp GPUs must be able to exist (a known profile, heads
 * that divide over tp, weights that leave HBM for KV blocks): otherwise each worker refuses it at start, once etcd and
 * NATS run (exit 1). Refused here with the workers' own message, as a usage error; a value from the environment is
 * named by its variable.
 */
function checkSimWorkers(parsed: ParsedFlags<typeof CLUSTER_DEMO_FLAGS>): number {
  const { values } = parsed;
  const label = (name: 'sim-model' | 'sim-gpu' | 'sim-tp'): string => flagLabel(CLUSTER_DEMO_FLAGS, parsed, name);
  const tp = positiveInteger(values['sim-tp'], 'sim-tp')!;
  try {
    checkSimDeployment({ model: values['sim-model']!, gpu: values['sim-gpu']!, tp },
      { model: label('sim-model'), gpu: label('sim-gpu'), tp: label('sim-tp') });
  } catch (err) {
    if (err instanceof RangeError) throw new UsageError(err.message);
    throw err;
  }
  return tp;
}

/**
 * A binary the cluster runs (--etcd-bin, --nats-bin) must be an executable file: checked before either service
 * starts, so that a missing etcd is said in one line rather than after NATS was started and stopped for nothing.
 */
function checkExecutable(flag: 'etcd-bin' | 'nats-bin', path: string): void {
  try {
    if (!statSync(path).isFile()) throw Object.assign(new Error(), { code: 'EISDIR' });
    accessSync(path, constants.X_OK);
  } catch (err) {
    throw new UsageError(`--${flag} cannot run ${path}: ${describeFileError(err)}`);
  }
}

/**
 * The options checked before anything starts. The frontend's are checked here, as the frontend checks them (and the
 * simulated workers' deployment, checkSimWorkers): refused before etcd, NATS and the workers start, rather than by a process that exits
 * once they run.
 */
function checkOptions(parsed: ParsedFlags<typeof CLUSTER_DEMO_FLAGS>): {
  port: number; routingPolicy: string; migrationLimit: number; count: number; graceSeconds: number; simTp: number;
} {
  const { values, positionals } = parsed;
  if (positionals.length > 0) throw new UsageError(`unexpected argument "${positionals[0]}"`);
  const port = values.port!;
  if (!Number.isInteger(port) || port < 0 || port > 65535) throw new UsageError(`--port must be 0..65535, got ${port}`);
  const routingPolicy = values['routing-policy']!;
  if (!(POLICY_NAMES as readonly string[]).includes(routingPolicy)) {
    throw new UsageError(`--routing-policy must be one of ${POLICY_NAMES.join(', ')}, got "${routingPolicy}"`);
  }
  const migrationLimit = checkCount('migration-limit', values['migration-limit']!);
  const count = values.workers!;
  if (!Number.isInteger(count) || count < 1) throw new UsageError(`--workers must be a whole number >= 1, got ${count}`);
  if (count > MAX_WORKERS) throw new UsageError(`--workers must be at most ${MAX_WORKERS}, got ${count}`);
  const graceSeconds = values['shutdown-grace']!;
  if (!(graceSeconds >= 0)) throw new UsageError(`--shutdown-grace must be a number of seconds >= 0, got ${graceSeconds}`);
  checkTimerSecondsAtMost('shutdown-grace', graceSeconds);
  if (values.engine !== 'cpu' && values.engine !== 'sim') throw new UsageError(`--engine must be cpu or sim, got "${values.engine}"`);
  const simTp = values.engine === 'sim' ? checkSimWorkers(parsed) : 1;
  checkExecutable('etcd-bin', values['etcd-bin']!);
  checkExecutable('nats-bin', values['nats-bin']!);
  return { port, routingPolicy, migrationLimit, count, graceSeconds, simTp };
}

export const clusterCommand: Command = {
  summary: 'a local demo cluster: etcd, NATS, N workers and a frontend on this machine',
  async run(argv) {
    const parsed = parseFlags(CLUSTER_DEMO_FLAGS, argv);
    const { values } = parsed;
    if (values.help) {
      console.log(`Usage: conduit cluster [options]\n\n${formatFlagHelp(CLUSTER_DEMO_FLAGS)}`);
      return 0;
    }
    let options: ReturnType<typeof checkOptions>;
    try {
      options = checkOptions(parsed);
    } catch (err) {
      // A value nobody typed is reported under the variable that gave it (CONDUIT_PORT (--port) must be ...).
      throw nameEnvironment(CLUSTER_DEMO_FLAGS, parsed, err);
    }
    const { port, routingPolicy, migrationLimit, count, graceSeconds, simTp } = options;
    // Typed for cpu workers, the --sim-* options do nothing: said as `conduit serve` says it.
    if (values.engine !== 'sim') for (const warning of simOptionWarnings(parsed.sources)) console.error(`conduit cluster: ${warning}`);
    const dir = mkdtempSync(join(tmpdir(), 'conduit-cluster-'));
    // etcd and NATS stop at once; the frontend and the workers finish their streams first (their grace), then exit.
    const children: { name: string; child: ChildProcess; killAfterMs: number }[] = [];
    const start = (name: string, command: string, args: string[], env: NodeJS.ProcessEnv = {}, killAfterMs = 10_000,
      drop: readonly string[] = []): ChildProcess => {
      const inherited = Object.fromEntries(Object.entries(process.env).filter(([key]) => !drop.includes(key)));
      // A process group of its own: Ctrl-C in a terminal signals the whole foreground group, which would stop etcd
      // and NATS at once with everything else, and the workers could not deregister. Only this process hears it and
      // stops the children in order.
      const child = spawn(command, args, { env: { ...inherited, ...env }, stdio: ['ignore', 'inherit', 'inherit'], detached: true });
      child.on('error', (error) => console.error(`conduit cluster: ${name}: ${error.message}`));
      children.push({ name, child, killAfterMs });
      return child;
    };
    const stopAll = async (): Promise<void> => {
      // Frontend first (no new requests), workers (they drain), then the services.
      for (const { child, killAfterMs } of [...children].reverse()) {
        if (child.exitCode !== null || child.signalCode !== null) continue;
        const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
        child.kill('SIGTERM');
        const timer = setTimeout(() => child.kill('SIGKILL'), killAfterMs);
        await exited;
        clearTimeout(timer);
      }
      rmSync(dir, { recursive: true, force: true });
    };
    let stopping = false;
    let exitCode = 0;
    let stopNow = (): void => {};
    const stopped = new Promise<void>((resolve) => {
      const handler = (): void => {
        if (stopping) return;
        stopping = true;
        console.error('conduit cluster: stopping the frontend, the workers, NATS and etcd');
        void stopAll().then(resolve);
      };
      stopNow = handler;
      for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) process.on(signal, handler);
      // Should this process end any other way, no child is left running (they are not in its group any more).
      process.once('exit', () => { for (const { child } of children) if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL'); });
    });
    try {
      const [etcdPort, peerPort, natsPort] = await freePorts(3) as [number, number, number];
      const etcdUrl = `http://127.0.0.1:${etcdPort}`;
      const etcd = start('etcd', values['etcd-bin']!, ['--data-dir', join(dir, 'etcd'), '--listen-client-urls', etcdUrl,
        '--advertise-client-urls', etcdUrl, '--listen-peer-urls', `http://127.0.0.1:${peerPort}`,
        '--initial-advertise-peer-urls', `http://127.0.0.1:${peerPort}`, '--initial-cluster', `default=http://127.0.0.1:${peerPort}`,
        '--log-level', 'error']);
      // NATS only once etcd listens: an etcd that cannot start (its data folder, a port taken meanwhile) leaves no
      // NATS started and stopped for nothing.
      await waitForPort(etcdPort, 'etcd', etcd);
      const nats = start('nats-server', values['nats-bin']!, ['-a', '127.0.0.1', '-p', String(natsPort)]);
      await waitForPort(natsPort, 'nats-server', nats);
      const env = {
        CONDUIT_ETCD_ENDPOINTS: etcdUrl, CONDUIT_NATS_SERVER: `nats://127.0.0.1:${natsPort}`,
        CONDUIT_CLUSTER_TOKEN: randomBytes(16).toString('hex'),
      };
      const engineArgs = ['--engine', values.engine!,
        ...(values.model !== undefined ? ['--model', values.model] : []),
        // The machine's cores shared between the workers: cpu workers' compute threads (simulated workers have none,
        // and would warn about the option at every start).
        ...(values.engine === 'sim' ? ['--sim-model', values['sim-model']!, '--sim-gpu', values['sim-gpu']!, '--sim-tp', String(simTp)]
          : ['--threads', String(Math.max(1, Math.floor((await import('node:os')).availableParallelism() / count)))])];
      const grace = ['--shutdown-grace', String(graceSeconds)];
      const killAfterMs = graceSeconds * 1000 + 10_000;
      for (let i = 0; i < count; i++) {
        // The workers listen on loopback, each on a free port it reports itself: this command's CONDUIT_PORT (the
        // frontend's port, its --port's twin) and a CONDUIT_HOST or CONDUIT_ADVERTISE_ADDRESS set for another
        // deployment are not theirs.
        const worker = start(`worker-${i}`, process.execPath, [CONDUIT_BIN, 'worker', '--worker-id', `worker-${i}`, '--host', '127.0.0.1',
          '--port', '0', ...engineArgs, ...grace], env, killAfterMs, ['CONDUIT_ADVERTISE_ADDRESS']);
        // A worker that exits on its own (it could not start: a bad model, a bad option) leaves a cluster that
        // would wait for it for ever: everything stops, exit code 1.
        worker.once('exit', (code, signal) => {
          if (stopping) return;
          console.error(`conduit cluster: worker-${i} exited (${signal ?? `code ${code}`})`);
          exitCode = 1;
          stopNow();
        });
      }
      const frontend = start('frontend', process.execPath, [CONDUIT_BIN, 'frontend', '--port', String(port), '--migration-limit',
        String(migrationLimit), '--routing-policy', routingPolicy, ...grace], env, killAfterMs);
      // Nor does a frontend that exits on its own (its port in use, an option it refuses): a cluster without its API
      // would otherwise go on running etcd, NATS and the workers for nobody.
      frontend.once('exit', (code, signal) => {
        if (stopping) return;
        console.error(`conduit cluster: the frontend exited (${signal ?? `code ${code}`})`);
        exitCode = 1;
        stopNow();
      });
      console.error(`conduit cluster: etcd ${etcdUrl}, NATS nats://127.0.0.1:${natsPort}, ${count} worker(s), frontend on `
        + `http://127.0.0.1:${port} (GET /health lists the workers); Ctrl-C stops everything`);
    } catch (error) {
      console.error(`conduit cluster: ${(error as Error).message}`);
      await stopAll();
      return 1;
    }
    await stopped;
    return exitCode;
  },
};
