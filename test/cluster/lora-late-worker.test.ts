// An adapter loaded at run time through `conduit frontend` reaches a `conduit worker` that registers afterwards: the
// frontend repeats its load on the new worker before routing requests for the adapter there, so with the first
// worker gone the new one serves the adapter with the same greedy text. An adapter unloaded through the frontend is
// unloaded likewise from a worker that joins later holding it by its own --lora-modules. Real etcd and nats-server.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import { loadModel } from '../../src/model/loader.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../../src/model/lora-writer.ts';
import {
  freePort, removeDir, servicesMissing, startConduit, startEtcd, startNats, stopAll, tempDir, waitForPort, type Proc,
} from '../helpers/cluster-services.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

const skip = servicesMissing();
const TOKEN = 'lora-late-token';
const MODEL = 'base';

async function until(what: string, condition: () => Promise<boolean> | boolean, maxMs = 60_000): Promise<void> {
  const deadline = Date.now() + maxMs;
  while (!(await condition())) {
    if (Date.now() > deadline) assert.fail(`timed out after ${maxMs} ms waiting until ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

describe('runtime LoRA loads and unloads reach workers that join later', { skip }, () => {
  let dir: string;
  let fixtureDir: string;
  let env: NodeJS.ProcessEnv;
  let url: string;
  let frontend: Proc;
  let modelPath: string;
  let adapterPath: string;
  const workers = new Map<string, Proc>();

  const startWorker = (id: string, extra: string[] = []) => {
    workers.set(id, startConduit(['worker', '--model', modelPath, '--served-model-name', MODEL, '--worker-id', id, '--threads', '1',
      '--kv-cache-memory', '16MiB', '--lease-ttl', '3', ...extra], env));
  };
  const readyWorkers = async (): Promise<string> => {
    try {
      const health = await (await fetch(`${url}/health`)).json() as { workers?: { id: string; state: string }[] };
      return (health.workers ?? []).filter((w) => w.state === 'ready').map((w) => w.id).sort().join();
    } catch {
      return '';
    }
  };
  const post = (path: string, body: object) => fetch(`${url}${path}`, {
    method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
  });
  const complete = async (model: string) => {
    const res = await post('/v1/completions', { model, prompt: 'Once upon a time', max_tokens: 16, temperature: 0, ignore_eos: true });
    const json = await res.json() as { id: string; choices?: { text: string }[]; error?: { message: string } };
    return { status: res.status, text: json.choices?.[0]?.text, id: json.id, error: json.error };
  };
  const workerOf = async (id: string): Promise<string | undefined> => {
    const res = await fetch(`${url}/v1/requests/${id}/trace`);
    return res.status === 200 ? (await res.json() as { worker?: string }).worker : undefined;
  };
  const models = async () => ((await (await fetch(`${url}/v1/models`)).json()) as { data: { id: string }[] }).data.map((m) => m.id);
  const dump = () => [...workers].map(([id, p]) => `--- ${id}\n${p.output()}`).join('\n') + `\n--- frontend\n${frontend?.output()}`;

  before(async () => {
    dir = tempDir('lora-late');
    const fixture = writeWorkerLossFixture('lora-late');
    fixtureDir = fixture.dir;
    modelPath = fixture.modelPath;
    const config = (await loadModel(modelPath)).config;
    adapterPath = join(dir, 'b.gguf');
    writeGgufLoraAdapter(adapterPath, config, randomLoraAdapter(config, { rank: 4, seed: 71, bScale: 1 }));
    const [etcd, nats] = await Promise.all([startEtcd(dir), startNats()]);
    env = { CONDUIT_ETCD_ENDPOINTS: etcd.url, CONDUIT_NATS_SERVER: nats.url, CONDUIT_CLUSTER_TOKEN: TOKEN, CONDUIT_LOG_LEVEL: 'info' };
    startWorker('w1');
    const port = await freePort();
    frontend = startConduit(['frontend', '--port', String(port), '--no-request-log'], env);
    url = `http://127.0.0.1:${port}`;
    await waitForPort(port, '127.0.0.1', 60_000);
    try {
      await until('the frontend sees w1', async () => (await readyWorkers()) === 'w1', 90_000);
    } catch (error) {
      console.error(dump());
      throw error;
    }
  });

  after(async () => {
    await stopAll();
    removeDir(dir);
    removeDir(fixtureDir);
  });

  test('a worker started after a load gets the adapter and, the first worker gone, serves it with the same text', { timeout: 240_000 }, async () => {
    const loaded = await post('/v1/load_lora_adapter', { lora_name: 'b', lora_path: adapterPath });
    assert.equal(loaded.status, 200, await loaded.clone().text());
    const first = await complete('b');
    assert.equal(first.status, 200, JSON.stringify(first.error));
    const base = await complete(MODEL);
    assert.notEqual(first.text, base.text, 'the adapter changed nothing');
    startWorker('w2');
    try {
      await until('the frontend loaded b on w2', () => /'b' \(loaded through this frontend\) loaded on worker w2/.test(frontend.output()), 90_000);
      await until('w2 is ready', async () => (await readyWorkers()) === 'w1,w2');
    } catch (error) {
      console.error(dump());
      throw error;
    }
    workers.get('w1')!.kill('SIGKILL');
    await until('the frontend dropped w1', async () => (await readyWorkers()) === 'w2');
    assert.deepEqual(await models(), [MODEL, 'b']);
    const again = await complete('b');
    assert.equal(again.status, 200, JSON.stringify(again.error));
    assert.equal(again.text, first.text);
    assert.equal(await workerOf(again.id), 'w2');
  });

  test('a worker started after an unload holding the adapter by its own --lora-modules has it unloaded', { timeout: 240_000 }, async () => {
    const unloaded = await post('/v1/unload_lora_adapter', { lora_name: 'b' });
    assert.equal(unloaded.status, 200, await unloaded.clone().text());
    assert.deepEqual(await models(), [MODEL]);
    startWorker('w3', ['--lora-modules', `b=${adapterPath}`]);
    try {
      await until('the frontend unloaded b from w3', () => /'b' \(unloaded through this frontend\) unloaded from worker w3/.test(frontend.output()), 90_000);
      await until('w3 is ready', async () => (await readyWorkers()) === 'w2,w3');
    } catch (error) {
      console.error(dump());
      throw error;
    }
    assert.deepEqual(await models(), [MODEL]);
    assert.equal((await complete('b')).status, 404);
    // Loaded again through the frontend: every worker takes it, w3 included.
    const loaded = await post('/v1/load_lora_adapter', { lora_name: 'b', lora_path: adapterPath });
    assert.equal(loaded.status, 200, await loaded.clone().text());
    workers.get('w2')!.kill('SIGKILL');
    await until('the frontend dropped w2', async () => (await readyWorkers()) === 'w3');
    const onW3 = await complete('b');
    assert.equal(onW3.status, 200, JSON.stringify(onW3.error));
    assert.equal(await workerOf(onW3.id), 'w3');
  });
});
