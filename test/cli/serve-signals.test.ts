// `conduit serve` as a process: SIGHUP (the terminal that started it closed) drains as SIGTERM does: the stream in
// flight finishes whole, then the process exits 0. Node's default for SIGHUP would end it at once, mid-stream.
// With --worker-processes the server alone decides when its children stop: Ctrl-C (SIGINT to the whole foreground
// process group) and a service manager's SIGTERM to every process drain the stream in flight as with worker threads,
// and no child is lost or restarted meanwhile. A signal while the model still loads stops the start at once, exit 0,
// with no worker process left behind.
import { after, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { readdirSync, readFileSync } from 'node:fs';
import { freePort, startConduit, stopAll } from '../helpers/cluster-services.ts';
import { forEachStreamEvent } from '../helpers/sse-stream.ts';

describe('conduit serve and signals', () => {
  after(stopAll);

  it('drains on SIGHUP: the stream in flight ends whole, then exit code 0', { timeout: 120_000 }, async () => {
    const port = await freePort();
    // Simulated workers in real time: a 150-token stream of the 8B profile lasts about a second.
    const proc = startConduit(['serve', '--engine', 'sim', '--sim-speed-up', '1', '--port', String(port), '--no-request-log']);
    const url = `http://127.0.0.1:${port}`;
    for (let tries = 0; ; tries++) {
      const ready = await fetch(`${url}/health`).then((res) => res.status === 200, () => false);
      if (ready) break;
      assert.ok(tries < 600, `the server came up: ${proc.output()}`);
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
    const res = await fetch(`${url}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ prompt: 'Once upon a time', max_tokens: 150, ignore_eos: true, stream: true }),
    });
    assert.equal(res.status, 200);
    let chunks = 0;
    let finish: string | undefined;
    await forEachStreamEvent(res, (json) => {
      if (chunks++ === 3) proc.kill('SIGHUP');
      finish = json.choices?.[0]?.finish_reason ?? finish;
    });
    assert.equal(finish, 'length', 'the stream in flight finished');
    assert.equal(await proc.exited, 0, proc.output());
    assert.match(proc.output(), /SIGHUP: shutting down/);
  });

  it('--worker-processes: Ctrl-C to the process group and SIGTERM to every process drain the stream; no child is lost or restarted',
    { timeout: 180_000 }, async () => {
      const port = await freePort();
      // In a process group of its own, as a shell starts a job: a terminal's Ctrl-C signals that whole group.
      const proc = startConduit(['serve', '--engine', 'sim', '--sim-speed-up', '1', '--workers', '2', '--worker-processes',
        '--port', String(port), '--no-request-log'], {}, { detached: true });
      const url = `http://127.0.0.1:${port}`;
      let pids: number[] = [];
      for (let tries = 0; ; tries++) {
        const health = await fetch(`${url}/health`).then(async (res) => res.status === 200 ? await res.json() as { workers: { pid: number }[] } : undefined, () => undefined);
        if (health) {
          pids = health.workers.map((w) => w.pid);
          break;
        }
        assert.ok(tries < 1200, `the server came up: ${proc.output()}`);
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
      assert.equal(pids.length, 2);
      // About 3 s of simulated decode at real time: it outlasts the signals by far.
      const res = await fetch(`${url}/v1/completions`, {
        method: 'POST', headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ prompt: 'Once upon a time', max_tokens: 400, ignore_eos: true, stream: true }),
      });
      assert.equal(res.status, 200);
      let chunks = 0;
      let finish: string | undefined;
      let error: unknown;
      await forEachStreamEvent(res, (json) => {
        if (chunks++ === 3) {
          process.kill(-proc.child.pid!, 'SIGINT');
          // A service manager stopping the unit (systemd's KillMode=control-group) signals every process in it.
          for (const pid of pids) process.kill(pid, 'SIGTERM');
        }
        if (json.error) error = json.error;
        finish = json.choices?.[0]?.finish_reason ?? finish;
      });
      assert.equal(error, undefined, proc.output());
      assert.equal(finish, 'length', `the stream in flight finished: ${proc.output()}`);
      assert.equal(await proc.exited, 0, proc.output());
      assert.match(proc.output(), /SIGINT: shutting down/);
      assert.doesNotMatch(proc.output(), /was lost|restart attempt/);
      for (const pid of pids) {
        let alive = true;
        for (let i = 0; i < 100 && alive; i++) {
          try { process.kill(pid, 0); await new Promise((resolve) => setTimeout(resolve, 50)); } catch { alive = false; }
        }
        assert.equal(alive, false, `worker process ${pid} exited with the server`);
      }
    });

  for (const signal of ['SIGTERM', 'SIGINT'] as const) {
    it(`${signal} while the workers start: exit 0 at once, no worker process left`, { timeout: 120_000 }, async () => {
      const port = await freePort();
      // Four child processes take seconds to start: the port answers (/live) long before /health is ready.
      const proc = startConduit(['serve', '--engine', 'sim', '--workers', '4', '--worker-processes', '--port', String(port),
        '--no-request-log', '--log-level', 'info']);
      const url = `http://127.0.0.1:${port}`;
      for (let tries = 0; ; tries++) {
        if (await fetch(`${url}/live`).then((res) => res.status === 200, () => false)) break;
        assert.ok(tries < 600, `the port opened: ${proc.output()}`);
        await new Promise((resolve) => setTimeout(resolve, 50));
      }
      let children: number[] = [];
      for (let tries = 0; children.length === 0; tries++) {
        children = childrenOf(proc.child.pid!);
        assert.ok(tries < 600, `a worker process started: ${proc.output()}`);
        await new Promise((resolve) => setTimeout(resolve, 20));
      }
      assert.equal((await fetch(`${url}/health`)).status, 503, 'still starting when signalled');
      const signalledAt = Date.now();
      proc.kill(signal);
      assert.equal(await proc.exited, 0, proc.output());
      assert.ok(Date.now() - signalledAt < 5000, `exited promptly, took ${Date.now() - signalledAt} ms`);
      assert.match(proc.output(), new RegExp(`${signal} during start-up: stopping`));
      for (const pid of children) {
        let alive = true;
        for (let i = 0; i < 100 && alive; i++) {
          try { process.kill(pid, 0); await new Promise((resolve) => setTimeout(resolve, 50)); } catch { alive = false; }
        }
        assert.equal(alive, false, `worker process ${pid} exited with the server`);
      }
    });
  }
});

/** The process ids whose parent is `pid` (from /proc). */
function childrenOf(pid: number): number[] {
  const found: number[] = [];
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      // The command name, in parentheses, may hold spaces: the parent id is the second field after it.
      const stat = readFileSync(`/proc/${entry}/stat`, 'utf8');
      if (Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]) === pid) found.push(Number(entry));
    } catch {
      // Gone meanwhile.
    }
  }
  return found;
}
