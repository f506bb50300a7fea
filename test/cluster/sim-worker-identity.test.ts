// Simulated `conduit worker`s as a frontend sees them, all real processes over real etcd and nats-server: a worker
// registers under the name it was given (--served-model-name, or --model NAME=PATH), not its profile's, and says
// what it simulates (profile, GPUs, speed-up, calibration) as `conduit serve` does; prefill and decode workers carry
// their link's and performance model's estimates in their records, and a frontend over them starts its
// disaggregation policy from those, not the CPU engine's defaults (2 GB/s, 2000 tokens/s).
import assert from 'node:assert/strict';
import { Etcd3 } from 'etcd3';
import { after, before, describe, it } from 'node:test';
import { simDisaggregationEstimates, simPool } from '../../src/runtime/worker-pool.ts';
import { SIM_DEFAULTS } from '../../src/sim/sim-worker.ts';
import {
  freePort, removeDir, servicesMissing, startConduit, startEtcd, startNats, stopAll, tempDir, type Etcd, type Nats, type Proc,
} from '../helpers/cluster-services.ts';

const TOKEN = 'sim-identity-token';

async function waitForOutput(proc: Proc, pattern: RegExp, ms = 60_000): Promise<RegExpExecArray> {
  for (const deadline = Date.now() + ms; ;) {
    const match = pattern.exec(proc.output());
    if (match) return match;
    if (proc.child.exitCode !== null) throw new Error(`exited before ${pattern}:\n${proc.output()}`);
    if (Date.now() > deadline) throw new Error(`no ${pattern} within ${ms} ms:\n${proc.output()}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

describe('simulated cluster workers', { skip: servicesMissing() }, () => {
  let dir: string;
  let etcd: Etcd;
  let nats: Nats;
  let client: Etcd3;
  before(async () => {
    dir = tempDir('sim-identity');
    etcd = await startEtcd(dir);
    nats = await startNats();
    client = new Etcd3({ hosts: etcd.url });
  });
  after(async () => {
    client?.close();
    await stopAll();
    removeDir(dir);
  });

  it('register under their served name, say what they simulate, and give a frontend their disaggregation estimates', { timeout: 180_000 }, async () => {
    const services = ['--cluster-token', TOKEN, '--etcd-endpoints', etcd.url, '--nats-server', nats.url];
    const decode = startConduit(['worker', '--engine', 'sim', '--role', 'decode', '--worker-id', 'dec', '--served-model-name', 'my-sim', ...services]);
    const prefill = startConduit(['worker', '--engine', 'sim', '--role', 'prefill', '--worker-id', 'pre', '--model', 'my-sim=/models/unused.gguf', ...services]);
    for (const [proc, id] of [[decode, 'dec'], [prefill, 'pre']] as const) {
      await waitForOutput(proc, new RegExp(`worker ${id} serving my-sim \\(simulated engine: llama-3\\.1-8b on 1 x h100, speed-up 1, \\S+ calibration\\) on 127\\.0\\.0\\.1:\\d+ \\(registered`));
    }
    // What the records hold: the served name, and the estimates the workers' model gives.
    const sim = simPool({ sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: 1 } });
    const expected = simDisaggregationEstimates(sim.make({ enableKvEvents: false, role: 'decode' }), SIM_DEFAULTS.maxNumBatchedTokens);
    assert.ok(expected.transferBytesPerSec > 5e9, `${expected.transferBytesPerSec}`);
    for (const id of ['dec', 'pre']) {
      const record = JSON.parse((await client.get(`/conduit/workers/${id}`).string())!) as Record<string, unknown>;
      assert.equal(record.model, 'my-sim', id);
      assert.deepEqual(record.disaggregationEstimates, expected, id);
    }

    const port = await freePort();
    const frontend = startConduit(['frontend', '--port', String(port), ...services]);
    const logged = await waitForOutput(frontend, /disaggregation: estimates start from decode worker dec's: KV transfer ([\d.]+) GB\/s, prefill (\d+) tokens\/s/);
    assert.equal(logged[1], (expected.transferBytesPerSec / 1e9).toFixed(2));
    assert.equal(Number(logged[2]), Math.round(expected.prefillTokensPerSec));
    for (const deadline = Date.now() + 60_000; ;) {
      const health = await fetch(`http://127.0.0.1:${port}/health`).then((res) => res.json() as Promise<{ ready?: boolean; workers?: unknown[] }>, () => undefined);
      if (health?.ready === true && health.workers?.length === 2) break;
      if (Date.now() > deadline) throw new Error(`frontend not ready with both workers:\n${frontend.output()}`);
      await new Promise((resolve) => setTimeout(resolve, 200));
    }
    const models = await (await fetch(`http://127.0.0.1:${port}/v1/models`)).json() as { data: { id: string }[] };
    assert.deepEqual(models.data.map((m) => m.id), ['my-sim']);
    const res = await fetch(`http://127.0.0.1:${port}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'my-sim', prompt: 'A simulated cluster answers', max_tokens: 4, ignore_eos: true }),
    });
    const body = await res.text();
    assert.equal(res.status, 200, body);
    assert.equal((JSON.parse(body) as { usage: { completion_tokens: number } }).usage.completion_tokens, 4);
  });
});
