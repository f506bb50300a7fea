// Real etcd (/usr/bin/etcd) and nats-server (/usr/sbin/nats-server) for the distributed runtime's tests, on free
// loopback ports with their data in a temporary folder; and `conduit` child processes (workers, frontends). Every
// process started here is killed by stopAll() (tests call it in an after hook) and on process exit. Waits are bounded.
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

export const ETCD_BIN = '/usr/bin/etcd';
export const NATS_BIN = '/usr/sbin/nats-server';
const CONDUIT = fileURLToPath(new URL('../../bin/conduit.js', import.meta.url));

/** Why the services cannot run here (the binaries are missing), or undefined. */
export function servicesMissing(): string | undefined {
  const missing = [ETCD_BIN, NATS_BIN].filter((bin) => !existsSync(bin));
  return missing.length > 0 ? `needs ${missing.join(' and ')} (Debian etcd-server, nats-server)` : undefined;
}

const children = new Set<ChildProcess>();
process.once('exit', () => { for (const child of children) child.kill('SIGKILL'); });

/** Ports handed out in this process: never twice, though the first may have been closed again before the next call. */
const handedOut = new Set<number>();

/**
 * A loopback port free now, for a server a test starts later. Taken below Linux's ephemeral range (32768 up) so that
 * no listen(0) and no outgoing connection, of this process or another, is given it by the kernel in the meantime: a
 * port from listen(0) itself can be handed straight to the next listen(0), which then takes it from the server the
 * test meant it for (EADDRINUSE).
 */
export async function freePort(host = '127.0.0.1'): Promise<number> {
  for (let attempt = 0; attempt < 200; attempt++) {
    const port = 20_000 + Math.floor(Math.random() * 12_768);
    if (handedOut.has(port)) continue;
    const free = await new Promise<boolean>((resolve) => {
      const server = net.createServer();
      server.once('error', () => resolve(false));
      server.listen(port, host, () => server.close(() => resolve(true)));
    });
    if (free) {
      handedOut.add(port);
      return port;
    }
  }
  throw new Error(`no free port on ${host} between 20000 and 32767 after 200 tries`);
}

export async function waitForPort(port: number, host = '127.0.0.1', maxMs = 60_000): Promise<void> {
  const deadline = Date.now() + maxMs;
  for (;;) {
    const ok = await new Promise<boolean>((resolve) => {
      const socket = net.connect({ host, port });
      socket.once('connect', () => { socket.destroy(); resolve(true); });
      socket.once('error', () => resolve(false));
    });
    if (ok) return;
    if (Date.now() > deadline) throw new Error(`nothing listens on ${host}:${port} after ${maxMs} ms`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

export interface Proc {
  child: ChildProcess;
  /** Everything it wrote to stdout and stderr so far. */
  output(): string;
  /** Resolves with the exit code (or signal) once it exited. */
  exited: Promise<number | string>;
  kill(signal?: NodeJS.Signals): void;
}

/** `detached`: in a process group of its own, as a shell starts a job (a signal to -pid then reaches that group). */
export function startProcess(command: string, args: string[], env: NodeJS.ProcessEnv = {}, options: { ipc?: boolean; detached?: boolean } = {}): Proc {
  const child = spawn(command, args, {
    env: { ...process.env, ...env }, stdio: options.ipc ? ['ignore', 'pipe', 'pipe', 'ipc'] : ['ignore', 'pipe', 'pipe'],
    detached: options.detached ?? false,
  });
  children.add(child);
  let text = '';
  child.stdout!.on('data', (chunk) => { text += chunk; });
  child.stderr!.on('data', (chunk) => { text += chunk; });
  const exited = new Promise<number | string>((resolve) => child.once('exit', (code, signal) => {
    children.delete(child);
    resolve(code ?? signal ?? -1);
  }));
  return { child, output: () => text, exited, kill: (signal = 'SIGKILL') => { if (child.exitCode === null && child.signalCode === null) child.kill(signal); } };
}

export interface Etcd {
  url: string;
  proc: Proc;
  stop(): Promise<void>;
  /** Starts it again on the same ports and data (an etcd restart). */
  restart(): Promise<void>;
}

/** Where a service runs: loopback by default, or an address inside a network namespace (`ip netns exec`). */
export interface Placement {
  host?: string;
  netns?: string;
}

function placed(placement: Placement, command: string, args: string[]): [string, string[]] {
  return placement.netns ? ['ip', ['netns', 'exec', placement.netns, command, ...args]] : [command, args];
}

export async function startEtcd(dir: string, placement: Placement = {}): Promise<Etcd> {
  const host = placement.host ?? '127.0.0.1';
  const clientPort = await freePort();
  const peerPort = await freePort();
  const url = `http://${host}:${clientPort}`;
  const args = ['--data-dir', join(dir, 'etcd'), '--listen-client-urls', url, '--advertise-client-urls', url,
    '--listen-peer-urls', `http://${host}:${peerPort}`, '--initial-advertise-peer-urls', `http://${host}:${peerPort}`,
    '--initial-cluster', `default=http://${host}:${peerPort}`, '--log-level', 'error'];
  const etcd: Etcd = {
    url,
    proc: startProcess(...placed(placement, ETCD_BIN, args)),
    async stop() {
      etcd.proc.kill('SIGKILL');
      await etcd.proc.exited;
    },
    async restart() {
      await etcd.stop();
      etcd.proc = startProcess(...placed(placement, ETCD_BIN, args));
      await waitForPort(clientPort);
    },
  };
  // Inside another namespace the port cannot be reached from here: the clients retry until it answers.
  if (!placement.netns) await waitForPort(clientPort);
  return etcd;
}

export interface Nats {
  url: string;
  proc: Proc;
  stop(): Promise<void>;
  restart(): Promise<void>;
}

export async function startNats(placement: Placement = {}): Promise<Nats> {
  const host = placement.host ?? '127.0.0.1';
  const port = await freePort();
  const args = ['-a', host, '-p', String(port)];
  const nats: Nats = {
    url: `nats://${host}:${port}`,
    proc: startProcess(...placed(placement, NATS_BIN, args)),
    async stop() {
      nats.proc.kill('SIGKILL');
      await nats.proc.exited;
    },
    async restart() {
      await nats.stop();
      nats.proc = startProcess(...placed(placement, NATS_BIN, args));
      await waitForPort(port);
    },
  };
  if (!placement.netns) await waitForPort(port);
  return nats;
}

/** `conduit <args>` as a child process. */
export function startConduit(args: string[], env: NodeJS.ProcessEnv = {}, options: { ipc?: boolean; detached?: boolean; netns?: string } = {}): Proc {
  if (options.netns) return startProcess('ip', ['netns', 'exec', options.netns, process.execPath, CONDUIT, ...args], env);
  return startProcess(process.execPath, [CONDUIT, ...args], env, options);
}

export function tempDir(name: string): string {
  return mkdtempSync(join(tmpdir(), `conduit-${name}-`));
}

/** Kills every process started here and waits for them (bounded). */
export async function stopAll(): Promise<void> {
  const waits = [...children].map((child) => new Promise<void>((resolve) => {
    if (child.exitCode !== null || child.signalCode !== null) return resolve();
    child.once('exit', () => resolve());
    child.kill('SIGKILL');
  }));
  await Promise.race([Promise.all(waits), new Promise((resolve) => setTimeout(resolve, 5000))]);
}

export function removeDir(dir: string | undefined): void {
  if (dir) rmSync(dir, { recursive: true, force: true });
}
