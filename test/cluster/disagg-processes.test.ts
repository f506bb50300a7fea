// Disaggregated prefill/decode across processes end to end: real etcd and nats-server, `conduit worker --role
// prefill` and `--role decode` processes, one `conduit frontend`. Greedy output equals the single-process server's
// with the prompt prefilled on the prefill worker (its KV pulled over TCP by the decode worker); with the prefill
// worker killed, the decode worker prefills itself and the greedy text is the same. Workers on one host move the KV
// through shared memory unless set to tcp: a second pair, in a namespace of its own behind a second frontend, runs
// with CONDUIT_KV_TRANSFER_LINK=tcp, and both give the same greedy text.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { createLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import {
  freePort, removeDir, servicesMissing, startConduit, startEtcd, startNats, stopAll, tempDir, waitForPort, type Proc,
} from '../helpers/cluster-services.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';
import { kvHostId } from '../../src/cluster/kv-shm.ts';

const skip = servicesMissing();
/** The link two workers on this host use unless set to tcp. */
const SAME_HOST_LINK = kvHostId() !== null ? 'shm' : 'tcp';
const TOKEN = 'disagg-cluster-token';

interface KvTransferTimings { bytes: number; blocks: number; link: string | null; ms: number; bytes_per_sec: number }

async function complete(url: string, body: object): Promise<{ text: string; id: string; kvTransfer?: KvTransferTimings }> {
  const res = await fetch(`${url}/v1/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
  const json = await res.json() as { id: string; choices: { text: string }[]; timings?: { kv_transfer?: KvTransferTimings } };
  assert.equal(res.status, 200, JSON.stringify(json));
  return { text: json.choices[0]!.text, id: json.id, ...(json.timings?.kv_transfer ? { kvTransfer: json.timings.kv_transfer } : {}) };
}

async function until(what: string, condition: () => Promise<boolean>, maxMs = 30_000): Promise<void> {
  const deadline = Date.now() + maxMs;
  while (!(await condition())) {
    if (Date.now() > deadline) assert.fail(`timed out after ${maxMs} ms waiting until ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

async function trace(url: string, id: string): Promise<string> {
  let body = '';
  await until(`the trace of ${id}`, async () => {
    const res = await fetch(`${url}/v1/requests/${id}/trace`);
    body = await res.text();
    return res.status === 200;
  });
  return body;
}

describe('disaggregated prefill/decode across worker processes', { skip }, () => {
  let dir: string;
  let reference: RunningServer;
  const procs = new Map<string, Proc>();
  let url: string;
  let env: NodeJS.ProcessEnv;
  let tcpUrl: string;

  before(async () => {
    dir = tempDir('cluster-disagg');
    const { modelPath } = writeWorkerLossFixture('cluster-disagg');
    const [etcd, nats] = await Promise.all([startEtcd(dir), startNats()]);
    env = { CONDUIT_ETCD_ENDPOINTS: etcd.url, CONDUIT_NATS_SERVER: nats.url, CONDUIT_CLUSTER_TOKEN: TOKEN, CONDUIT_LOG_LEVEL: 'info' };
    for (const [id, role] of [['p1', 'prefill'], ['d1', 'decode']] as const) {
      procs.set(id, startConduit(['worker', '--model', modelPath, '--worker-id', id, '--role', role, '--threads', '1',
        '--kv-cache-memory', '16MiB', '--lease-ttl', '3'], env));
    }
    const tcpEnv = { ...env, CONDUIT_NAMESPACE: 'forced-tcp', CONDUIT_KV_TRANSFER_LINK: 'tcp' };
    for (const [id, role] of [['p2', 'prefill'], ['d2', 'decode']] as const) {
      procs.set(id, startConduit(['worker', '--model', modelPath, '--worker-id', id, '--role', role, '--threads', '1',
        '--kv-cache-memory', '16MiB', '--lease-ttl', '3'], tcpEnv));
    }
    const port = await freePort();
    procs.set('frontend', startConduit(['frontend', '--port', String(port), '--no-request-log', '--disagg-min-remote-prefill-tokens', '16'], env));
    const tcpPort = await freePort();
    procs.set('frontend-tcp', startConduit(['frontend', '--port', String(tcpPort), '--no-request-log', '--disagg-min-remote-prefill-tokens', '16'], tcpEnv));
    // Six processes start at once on a shared machine: the frontends may take a while to listen.
    await waitForPort(port, '127.0.0.1', 60_000);
    await waitForPort(tcpPort, '127.0.0.1', 60_000);
    url = `http://127.0.0.1:${port}`;
    tcpUrl = `http://127.0.0.1:${tcpPort}`;
    const config = parseServeConfig(['--model', modelPath, '--port', '0', '--threads', '1', '--kv-cache-memory', '16MiB', '--no-request-log'], {});
    reference = await startServer(config as Exclude<typeof config, 'help'>, createLogger('error'));
    try {
      for (const [at, prefill] of [[url, 'p1'], [tcpUrl, 'p2']] as const) {
        await until(`the frontend at ${at} serves`, async () => (await fetch(`${at}/health`).then((r) => r.json() as Promise<{ ready?: boolean }>, () => ({ ready: false }))).ready === true
          && (await fetch(`${at}/health`).then((r) => r.text())).includes(`"${prefill}"`));
      }
    } catch (error) {
      console.error([...procs].map(([id, p]) => `--- ${id}\n${p.output()}`).join('\n'));
      throw error;
    }
  });

  after(async () => {
    await reference?.api.shutdown(0);
    await stopAll();
    removeDir(dir);
  });

  const greedy = (prompt: string) => ({ prompt, max_tokens: 24, temperature: 0, repetition_penalty: 1.3, ignore_eos: true });
  const prompt = (n: number) => Array.from({ length: 60 }, (_, i) => `w${(n * 131 + i * 17) % 997}`).join(' ');

  test('greedy output equals the single-process server\'s, prefilled on the prefill worker', async () => {
    for (const n of [1, 2]) {
      const expected = await complete(reference.url, greedy(prompt(n)));
      const got = await complete(url, greedy(prompt(n)));
      assert.equal(got.text, expected.text);
      const body = await trace(url, got.id);
      assert.match(body, /"p1"/, `the trace names the prefill worker: ${body.slice(0, 600)}`);
      // The transfer as the response's timings and the trace show it: over its link, what moved and how fast.
      assert.equal(got.kvTransfer?.link, SAME_HOST_LINK, JSON.stringify(got.kvTransfer));
      assert.ok(got.kvTransfer!.blocks > 0 && got.kvTransfer!.bytes > 0);
      const phase = (JSON.parse(body) as { phases: { phase: string; attributes?: Record<string, unknown> }[] }).phases.find((p) => p.phase === 'kv_transfer');
      assert.equal(phase?.attributes?.link, SAME_HOST_LINK, body.slice(0, 600));
      assert.equal(phase?.attributes?.bytes, got.kvTransfer!.bytes);
    }
    // The frontend's /metrics: the transfers under the decode worker and the link.
    const metrics = await fetch(`${url}/metrics`).then((r) => r.text());
    assert.match(metrics, new RegExp(`conduit_kv_transfer_bytes_total\\{worker="d1",link="${SAME_HOST_LINK}"\\} [1-9]`));
    assert.match(metrics, new RegExp(`conduit_kv_transfer_blocks_total\\{worker="d1",link="${SAME_HOST_LINK}"\\} [1-9]`));
    assert.match(metrics, new RegExp(`conduit_kv_transfer_duration_milliseconds_count\\{worker="d1",link="${SAME_HOST_LINK}"\\} 2`));
  });

  test('a frontend started later sees the decode worker\'s cached prefixes (its router view is resynced, not empty)', async () => {
    const port = await freePort();
    const frontend2 = startConduit(['frontend', '--port', String(port), '--no-request-log', '--disagg-min-remote-prefill-tokens', '16'],
      { ...env, CONDUIT_LOG_LEVEL: 'debug' });
    procs.set('frontend2', frontend2);
    await waitForPort(port);
    const url2 = `http://127.0.0.1:${port}`;
    await until('the second frontend has resynced its view of d1', async () => frontend2.output().includes('KV view of d1 resynced'));
    const expected = await complete(reference.url, greedy(prompt(1)));
    const got = await complete(url2, greedy(prompt(1)));
    assert.equal(got.text, expected.text);
    const body = JSON.parse(await trace(url2, got.id)) as { phases: { phase: string; attributes?: { overlap_tokens?: number } }[] };
    const lookup = body.phases.find((p) => p.phase === 'router_lookup');
    assert.ok((lookup?.attributes?.overlap_tokens ?? 0) > 0, `the decode router knows the blocks d1 cached before this frontend started: ${JSON.stringify(lookup)}`);
  });

  test('workers on one host use shared memory, workers set to tcp use TCP: the same greedy text, the link in the trace', async () => {
    const expected = await complete(reference.url, greedy(prompt(5)));
    for (const [at, link] of [[url, SAME_HOST_LINK], [tcpUrl, 'tcp']] as const) {
      const got = await complete(at, greedy(prompt(5)));
      assert.equal(got.text, expected.text, `via ${at}`);
      const body = await trace(at, got.id);
      assert.match(body, new RegExp(`"link":"${link}"`), `the kv_transfer phase names the ${link} link: ${body.slice(0, 800)}`);
    }
  });

  test('the prefill worker killed: the decode worker prefills itself, same greedy text', async () => {
    procs.get('p1')!.kill('SIGKILL');
    await procs.get('p1')!.exited;
    const expected = await complete(reference.url, greedy(prompt(3)));
    const got = await complete(url, greedy(prompt(3)));
    assert.equal(got.text, expected.text);
  });
});
