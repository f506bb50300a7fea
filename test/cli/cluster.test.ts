// `conduit cluster` end to end: real etcd and nats-server, two sim workers and a frontend, all children of one
// process started as a shell starts a job (a process group of its own). A request goes through the official client;
// then Ctrl-C during a long stream, which a terminal sends to the whole foreground group: the command stops its
// children in order, each within its grace, so the stream ends whole, the workers deregister while etcd still runs,
// and nothing it started is left listening. Its CONDUIT_PORT is the frontend's port alone: the workers listen on free
// loopback ports and report those, whatever CONDUIT_PORT or CONDUIT_ADVERTISE_ADDRESS say. Simulated workers are
// started without the cpu workers' --threads, which they would warn about.
import assert from 'node:assert/strict';
import net from 'node:net';
import { after, describe, it } from 'node:test';
import OpenAI from 'openai';
import { freePort, servicesMissing, startConduit, stopAll, type Proc } from '../helpers/cluster-services.ts';

const listening = (port: number): Promise<boolean> => new Promise((resolve) => {
  const socket = net.connect({ host: '127.0.0.1', port });
  socket.once('connect', () => { socket.destroy(); resolve(true); });
  socket.once('error', () => resolve(false));
});

describe('conduit cluster', { skip: servicesMissing() }, () => {
  let cluster: Proc | undefined;
  after(async () => {
    // Should the test fail before Ctrl-C: SIGTERM stops the children too (they are in groups of their own).
    if (cluster?.child.exitCode === null) {
      cluster.kill('SIGTERM');
      await Promise.race([cluster.exited, new Promise((resolve) => setTimeout(resolve, 20_000))]);
    }
    await stopAll();
  });

  it('a worker that cannot start stops the whole cluster with exit code 1 instead of leaving it waiting', async () => {
    const port = await freePort();
    const failing = startConduit(['cluster', '--model', '/nonexistent/model.gguf', '--workers', '1', '--port', String(port)], {}, { detached: true });
    const code = await Promise.race([failing.exited, new Promise((resolve) => setTimeout(() => resolve('still running'), 60_000))]);
    if (code === 'still running') failing.kill('SIGTERM');
    assert.equal(code, 1, failing.output());
    assert.match(failing.output(), /conduit cluster: worker-0 exited \(code \d+\)/);
    assert.equal(await listening(port), false, 'nothing left listening');
  });

  it('takes its port from CONDUIT_PORT; the workers do not', { timeout: 180_000 }, async () => {
    const port = await freePort();
    const proc = startConduit(['cluster', '--engine', 'sim', '--workers', '1'], { CONDUIT_PORT: String(port), CONDUIT_ADVERTISE_ADDRESS: '127.0.0.1:1' },
      { detached: true });
    try {
      let workers: { address: string }[] | undefined;
      for (const deadline = Date.now() + 90_000; ;) {
        if (proc.child.exitCode !== null) throw new Error(`conduit cluster exited early:\n${proc.output()}`);
        const body = await fetch(`http://127.0.0.1:${port}/health`).then((res) => res.json() as Promise<{ ready?: boolean; workers?: { address: string }[] }>, () => undefined);
        if (body?.ready === true && body.workers?.length === 1) {
          workers = body.workers;
          break;
        }
        if (Date.now() > deadline) throw new Error(`the frontend was not ready on CONDUIT_PORT ${port} within 90 s:\n${proc.output()}`);
        await new Promise((resolve) => setTimeout(resolve, 200));
      }
      assert.doesNotMatch(proc.output(), /--threads is for cpu workers/, 'a simulated worker is given no --threads');
      assert.match(workers[0]!.address, /^127\.0\.0\.1:\d+$/);
      assert.notEqual(workers[0]!.address, `127.0.0.1:${port}`);
      assert.notEqual(workers[0]!.address, '127.0.0.1:1');
      const res = await fetch(`http://127.0.0.1:${port}/v1/completions`, {
        method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: 'The cluster answers', max_tokens: 4 }),
      });
      assert.equal(res.status, 200, await res.text());
    } finally {
      proc.kill('SIGTERM');
    }
    assert.equal(await Promise.race([proc.exited, new Promise((resolve) => setTimeout(() => resolve('still running'), 60_000))]), 0, proc.output());
  });

  it('serves through its workers, and Ctrl-C stops them before etcd and NATS, after their streams (--shutdown-grace)', async () => {
    const port = await freePort();
    cluster = startConduit(['cluster', '--engine', 'sim', '--workers', '2', '--port', String(port), '--shutdown-grace', '40'], {},
      { detached: true });
    const proc = cluster;
    const health = async (): Promise<{ ready?: boolean; workers?: unknown[] } | undefined> => {
      try {
        return await (await fetch(`http://127.0.0.1:${port}/health`)).json() as { ready?: boolean; workers?: unknown[] };
      } catch {
        return undefined;
      }
    };
    for (const deadline = Date.now() + 60_000; ;) {
      if (proc.child.exitCode !== null) throw new Error(`conduit cluster exited early:\n${proc.output()}`);
      const body = await health();
      if (body?.ready === true && body.workers?.length === 2) break;
      if (Date.now() > deadline) throw new Error(`the frontend was not ready with both workers within 60 s:\n${proc.output()}`);
      await new Promise((resolve) => setTimeout(resolve, 200));
    }

    const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: 'unused' });
    const [model] = (await client.models.list()).data;
    const completion = await client.completions.create({ model: model!.id, prompt: 'The cluster answers', max_tokens: 4 });
    assert.equal(completion.usage?.completion_tokens, 4);

    const services = /etcd http:\/\/127\.0\.0\.1:(\d+), NATS nats:\/\/127\.0\.0\.1:(\d+)/.exec(proc.output());
    assert.ok(services, `the command names its etcd and NATS:\n${proc.output()}`);
    const [etcdPort, natsPort] = [Number(services[1]), Number(services[2])];

    // A stream that outlasts the 10 s etcd and NATS get to stop (about 12 s of simulated decode at real time): Ctrl-C
    // during it lets the frontend and its worker finish it within their grace before anything is killed.
    const stream = await client.completions.create({
      model: model!.id, prompt: 'A long story', max_tokens: 2000, stream: true, ignore_eos: true,
    } as OpenAI.CompletionCreateParamsStreaming);
    const streamed = (async () => {
      let tokens = 0;
      let finish: string | null = null;
      for await (const chunk of stream) {
        if (chunk.choices[0]?.text) tokens++;
        finish = chunk.choices[0]?.finish_reason ?? finish;
      }
      return { tokens, finish };
    })();
    await new Promise((resolve) => setTimeout(resolve, 500));
    process.kill(-proc.child.pid!, 'SIGINT');
    assert.deepEqual(await streamed, { tokens: 2000, finish: 'length' }, proc.output());
    assert.equal(await proc.exited, 0, proc.output());
    const output = proc.output();
    for (const id of ['worker-0', 'worker-1']) assert.match(output, new RegExp(`worker ${id}: deregistered`));
    // Had etcd stopped with the rest, a worker could not revoke its lease and would say so.
    assert.doesNotMatch(output, /could not revoke the lease/);
    for (const [what, p] of [['frontend', port], ['etcd', etcdPort], ['NATS', natsPort]] as const) {
      assert.equal(await listening(p), false, `${what} still listens on ${p}`);
    }
  });
});
