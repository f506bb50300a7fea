// Nothing assumes 127.0.0.1: the frontend runs in one network namespace, etcd, NATS and a worker in another, joined by
// a veth pair (10.231.<n>.1 and .2). Requests are sent from inside the frontend's namespace. Then disaggregated: a
// prefill worker in one namespace, a decode worker in the other, the KV pulled over the veth pair (link tcp), greedy
// text as an aggregated server's. Needs root and `ip netns`; skipped with a message elsewhere.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { join } from 'node:path';
import { createLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { removeDir, servicesMissing, startConduit, startEtcd, startNats, stopAll, tempDir, type Proc } from '../helpers/cluster-services.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

const suffix = `${process.pid % 10000}`;
const NS_FE = `cdfe${suffix}`;
const NS_WK = `cdwk${suffix}`;
const NET = `10.231.${process.pid % 250}`;

function ip(...args: string[]): void {
  execFileSync('ip', args, { stdio: 'pipe' });
}

function netnsUnavailable(): string | undefined {
  if (servicesMissing()) return servicesMissing();
  if (process.getuid?.() !== 0) return 'needs root for ip netns';
  try {
    ip('netns', 'add', `cdprobe${suffix}`);
    ip('netns', 'del', `cdprobe${suffix}`);
    return undefined;
  } catch (error) {
    return `ip netns is not available here (${(error as Error).message.split('\n')[0]})`;
  }
}

/** GET or POST from inside a namespace (a short node process there). */
function fetchIn(ns: string, url: string, body?: object): { status: number; text: string } {
  const script = `fetch(${JSON.stringify(url)}, ${body ? JSON.stringify({ method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) }) : '{}'})`
    + '.then(async (r) => console.log(JSON.stringify({ status: r.status, text: await r.text() }))).catch((e) => console.log(JSON.stringify({ status: 0, text: String(e) })))';
  const out = execFileSync('ip', ['netns', 'exec', ns, process.execPath, '-e', script], { encoding: 'utf8', timeout: 20_000 });
  return JSON.parse(out.trim()) as { status: number; text: string };
}

const skip = netnsUnavailable();
if (skip) console.log(`# netns test skipped: ${skip}`);

describe('frontend and workers in two network namespaces', { skip }, () => {
  let dir: string;
  let modelDir: string;
  const procs: Proc[] = [];
  let reference: RunningServer | undefined;

  before(() => {
    dir = tempDir('netns');
    ip('netns', 'add', NS_FE);
    ip('netns', 'add', NS_WK);
    ip('link', 'add', `vfe${suffix}`, 'type', 'veth', 'peer', 'name', `vwk${suffix}`);
    ip('link', 'set', `vfe${suffix}`, 'netns', NS_FE);
    ip('link', 'set', `vwk${suffix}`, 'netns', NS_WK);
    ip('-n', NS_FE, 'addr', 'add', `${NET}.1/24`, 'dev', `vfe${suffix}`);
    ip('-n', NS_WK, 'addr', 'add', `${NET}.2/24`, 'dev', `vwk${suffix}`);
    for (const [ns, dev] of [[NS_FE, `vfe${suffix}`], [NS_WK, `vwk${suffix}`]] as const) {
      ip('-n', ns, 'link', 'set', dev, 'up');
      ip('-n', ns, 'link', 'set', 'lo', 'up');
    }
  });

  after(async () => {
    await reference?.api.shutdown(0);
    await stopAll();
    for (const ns of [NS_FE, NS_WK]) {
      try { ip('netns', 'del', ns); } catch { /* gone */ }
    }
    removeDir(dir);
    removeDir(modelDir);
  });

  test('a frontend reaches etcd, NATS and a worker across the veth pair and serves', async () => {
    const etcd = await startEtcd(dir, { host: `${NET}.2`, netns: NS_WK });
    const nats = await startNats({ host: `${NET}.2`, netns: NS_WK });
    procs.push(etcd.proc, nats.proc);
    const fixture = writeWorkerLossFixture('netns');
    modelDir = fixture.dir;
    const env = { CONDUIT_ETCD_ENDPOINTS: etcd.url, CONDUIT_NATS_SERVER: nats.url, CONDUIT_CLUSTER_TOKEN: 'netns-token' };
    const worker = startConduit(['worker', '--model', fixture.modelPath, '--worker-id', 'wk', '--host', `${NET}.2`, '--port', '7100',
      '--threads', '1', '--kv-cache-memory', '16MiB'], env, { netns: NS_WK });
    const frontend = startConduit(['frontend', '--host', `${NET}.1`, '--port', '8100'], env, { netns: NS_FE });
    procs.push(worker, frontend);
    let health: { ready?: boolean; workers?: { id: string; address: string; state: string }[] } = {};
    for (let i = 0; i < 80 && !(health.ready && health.workers?.[0]?.state === 'ready'); i++) {
      await new Promise((resolve) => setTimeout(resolve, 500));
      const res = fetchIn(NS_FE, `http://${NET}.1:8100/health`);
      if (res.status > 0) health = JSON.parse(res.text);
    }
    assert.equal(health.ready, true, `frontend ready; frontend log:\n${frontend.output()}\nworker log:\n${worker.output()}`);
    assert.equal(health.workers![0]!.address, `${NET}.2:7100`);
    const res = fetchIn(NS_FE, `http://${NET}.1:8100/v1/completions`, { prompt: 'across namespaces', max_tokens: 6, temperature: 0 });
    assert.equal(res.status, 200, res.text);
    assert.equal(JSON.parse(res.text).usage.completion_tokens, 6);
    // The frontend's namespace has no route to the workers' loopback: nothing here used 127.0.0.1 across.
    assert.equal(fetchIn(NS_FE, 'http://127.0.0.1:7100/').status, 0);
  });
  test('disaggregated across the namespaces: prefill worker in one, decode worker in the other, KV over TCP on the veth pair', async () => {
    // An etcd of its own (the first test's still holds its data folder).
    const etcd = await startEtcd(join(dir, 'disagg'), { host: `${NET}.2`, netns: NS_WK });
    const nats = await startNats({ host: `${NET}.2`, netns: NS_WK });
    procs.push(etcd.proc, nats.proc);
    const fixture = writeWorkerLossFixture('netns-disagg');
    // Namespaces of the network only: the two workers still share /dev/shm (one host to the shm link), so they are
    // set to tcp to move the KV over the veth pair.
    const env = {
      CONDUIT_ETCD_ENDPOINTS: etcd.url, CONDUIT_NATS_SERVER: nats.url, CONDUIT_CLUSTER_TOKEN: 'netns-disagg-token',
      CONDUIT_KV_TRANSFER_LINK: 'tcp',
    };
    const common = ['--model', fixture.modelPath, '--threads', '1', '--kv-cache-memory', '16MiB'];
    const prefill = startConduit(['worker', ...common, '--worker-id', 'np', '--role', 'prefill', '--host', `${NET}.1`, '--port', '7101'], env, { netns: NS_FE });
    const decode = startConduit(['worker', ...common, '--worker-id', 'nd', '--role', 'decode', '--host', `${NET}.2`, '--port', '7102'], env, { netns: NS_WK });
    const frontend = startConduit(['frontend', '--host', `${NET}.1`, '--port', '8101', '--disagg-min-remote-prefill-tokens', '16'], env, { netns: NS_FE });
    procs.push(prefill, decode, frontend);
    const logs = () => `frontend:\n${frontend.output()}\nprefill:\n${prefill.output()}\ndecode:\n${decode.output()}`;
    let health: { ready?: boolean; workers?: { id: string; state: string }[] } = {};
    const ready = () => health.ready === true && ['np', 'nd'].every((id) => health.workers?.some((w) => w.id === id && w.state === 'ready'));
    for (let i = 0; i < 80 && !ready(); i++) {
      await new Promise((resolve) => setTimeout(resolve, 500));
      const res = fetchIn(NS_FE, `http://${NET}.1:8101/health`);
      if (res.status > 0) health = JSON.parse(res.text);
    }
    assert.ok(ready(), `both workers ready; ${logs()}`);
    const config = parseServeConfig(['--model', fixture.modelPath, '--port', '0', '--threads', '1', '--kv-cache-memory', '16MiB', '--no-request-log'], {});
    reference = await startServer(config as Exclude<typeof config, 'help'>, createLogger('error'));
    const body = { prompt: Array.from({ length: 50 }, (_, i) => `n${(i * 37) % 211}`).join(' '), max_tokens: 16, temperature: 0, ignore_eos: true };
    const expected = await fetch(`${reference.url}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
    }).then((r) => r.json() as Promise<{ choices: { text: string }[] }>);
    const res = fetchIn(NS_FE, `http://${NET}.1:8101/v1/completions`, body);
    assert.equal(res.status, 200, `${res.text}\n${logs()}`);
    const got = JSON.parse(res.text) as { choices: { text: string }[]; timings?: { kv_transfer?: { link: string; blocks: number } } };
    assert.equal(got.choices[0]!.text, expected.choices[0]!.text);
    assert.equal(got.timings?.kv_transfer?.link, 'tcp', `the KV moved between the namespaces: ${res.text}`);
    assert.ok(got.timings!.kv_transfer!.blocks > 0);
    removeDir(fixture.dir);
  });
});
