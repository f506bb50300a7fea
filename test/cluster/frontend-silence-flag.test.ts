// `conduit worker --frontend-silence-timeout` (twin CONDUIT_FRONTEND_SILENCE_TIMEOUT): how long a frontend that pings
// may send nothing before the worker closes its connection and stops its requests. Real `conduit worker` processes
// (simulated engine) over real etcd and nats-server, reached by a raw connection that says hello, asks for pings and
// then falls silent: the welcome's ping interval follows the setting, and the connection is closed after it. A value
// that would cut live frontends (under a second) or no timer can hold is refused before anything starts (exit 2).
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';
import { encodeJsonFrame, FrameReader, parseJsonMessage } from '../../src/cluster/frames.ts';
import { REQUEST_PLANE_VERSION } from '../../src/cluster/request-plane.ts';
import {
  freePort, removeDir, servicesMissing, startConduit, startEtcd, startNats, stopAll, tempDir, type Etcd, type Nats, type Proc,
} from '../helpers/cluster-services.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const TOKEN = 'silence-flag-token';

async function waitForOutput(proc: Proc, pattern: RegExp, ms = 60_000): Promise<void> {
  for (const deadline = Date.now() + ms; ;) {
    if (pattern.test(proc.output())) return;
    if (proc.child.exitCode !== null) throw new Error(`exited before ${pattern}:\n${proc.output()}`);
    if (Date.now() > deadline) throw new Error(`no ${pattern} within ${ms} ms:\n${proc.output()}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

/** A connection that said hello asking for pings, then sends nothing; what the worker sent, and when it closed. */
async function silentFrontend(port: number): Promise<{ welcome: Record<string, unknown>; closedAfterMs: () => number | undefined; socket: net.Socket }> {
  const socket = net.connect({ host: '127.0.0.1', port });
  const reader = new FrameReader();
  const messages: Record<string, unknown>[] = [];
  let welcomedAt = 0;
  let closedAt: number | undefined;
  socket.on('data', (chunk) => {
    for (const frame of reader.push(chunk)) {
      const message = parseJsonMessage(frame.payload);
      if (message.t === 'welcome') welcomedAt = performance.now();
      messages.push(message);
    }
  });
  socket.on('error', () => {});
  socket.on('close', () => { closedAt = performance.now(); });
  await new Promise<void>((resolve) => socket.once('connect', () => resolve()));
  socket.write(encodeJsonFrame({ t: 'hello', v: REQUEST_PLANE_VERSION, token: TOKEN, ping: true }));
  await waitUntil(() => welcomedAt > 0 || closedAt !== undefined, 'the worker welcomed the peer', 10_000);
  const welcome = messages.find((m) => m.t === 'welcome');
  assert.ok(welcome, 'welcomed');
  return { welcome, closedAfterMs: () => (closedAt === undefined ? undefined : closedAt - welcomedAt), socket };
}

describe('conduit worker --frontend-silence-timeout', { skip: servicesMissing() }, () => {
  let dir: string;
  let etcd: Etcd;
  let nats: Nats;
  let services: string[];
  before(async () => {
    dir = tempDir('silence-flag');
    etcd = await startEtcd(dir);
    nats = await startNats();
    services = ['--cluster-token', TOKEN, '--etcd-endpoints', etcd.url, '--nats-server', nats.url, '--engine', 'sim'];
  });
  after(async () => {
    await stopAll();
    removeDir(dir);
  });

  async function worker(id: string, args: string[], env: NodeJS.ProcessEnv = {}): Promise<{ proc: Proc; port: number }> {
    const port = await freePort();
    const proc = startConduit(['worker', ...services, '--worker-id', id, '--port', String(port), ...args], env);
    await waitForOutput(proc, new RegExp(`worker ${id} serving .* \\(registered`));
    return { proc, port };
  }

  test('the flag sets the timeout: pings asked for 4 times within it, a silent frontend cut after it', { timeout: 120_000 }, async () => {
    const { proc, port } = await worker('flag-1s', ['--frontend-silence-timeout', '1']);
    const peer = await silentFrontend(port);
    assert.equal(peer.welcome.pingMs, 250, 'a quarter of the timeout');
    await waitUntil(() => peer.closedAfterMs() !== undefined, 'the silent frontend was cut off', 10_000);
    // The default (15 s) would have kept it far longer.
    assert.ok(peer.closedAfterMs()! >= 1000 && peer.closedAfterMs()! < 8000, `${peer.closedAfterMs()} ms`);
    await waitForOutput(proc, /request plane: frontend at 127\.0\.0\.1:\d+ sent nothing for 1000 ms \(not even its ping\): closing its connection/, 10_000);
  });

  test('CONDUIT_FRONTEND_SILENCE_TIMEOUT sets it too; 0 turns it off (no pings asked for)', { timeout: 120_000 }, async () => {
    const { proc, port } = await worker('env-2s', [], { CONDUIT_FRONTEND_SILENCE_TIMEOUT: '2' });
    const peer = await silentFrontend(port);
    assert.equal(peer.welcome.pingMs, 500);
    await waitUntil(() => peer.closedAfterMs() !== undefined, 'the silent frontend was cut off', 10_000);
    assert.ok(peer.closedAfterMs()! >= 2000, `${peer.closedAfterMs()} ms`);
    await waitForOutput(proc, /sent nothing for 2000 ms/, 10_000);

    const never = await worker('never', ['--frontend-silence-timeout', '0']);
    const untimed = await silentFrontend(never.port);
    assert.equal(untimed.welcome.pingMs, undefined, 'no pings asked for');
    await new Promise((resolve) => setTimeout(resolve, 2500));
    assert.equal(untimed.closedAfterMs(), undefined, 'an untimed connection stays');
    untimed.socket.destroy();
  });

  for (const [args, env, line] of [
    [['--frontend-silence-timeout', '0.5'], {}, 'conduit worker: --frontend-silence-timeout must be 0 (never) or at least 1 second, got 0.5'],
    [[], { CONDUIT_FRONTEND_SILENCE_TIMEOUT: '-3' }, 'conduit worker: CONDUIT_FRONTEND_SILENCE_TIMEOUT (--frontend-silence-timeout) must be 0 (never) or at least 1 second, got -3'],
    [['--frontend-silence-timeout', '1e9'], {}, 'conduit worker: --frontend-silence-timeout must be at most 2147483 seconds (about 24.8 days; 0 = never), got 1000000000'],
  ] as const) {
    test(`refused before anything starts: ${line.slice('conduit worker: '.length)}`, { timeout: 60_000 }, async () => {
      // Unreachable services: a refused value is never tried against them.
      const proc = startConduit(['worker', '--cluster-token', 't', '--etcd-endpoints', 'http://127.0.0.1:1', '--nats-server', 'nats://127.0.0.1:1',
        '--engine', 'sim', ...args], env);
      const timer = setTimeout(() => proc.kill(), 30_000);
      const code = await proc.exited;
      clearTimeout(timer);
      assert.equal(code, 2, proc.output());
      assert.equal(proc.output(), `${line}\n`);
    });
  }
});
