// LoRA adapters in the distributed runtime: real etcd and nats-server, `conduit worker` processes of which only some
// hold the adapter (--lora-modules), a `conduit frontend`, and the official `openai` client. The adapter's greedy
// text through the frontend equals `conduit serve --lora-modules`'s; /v1/models lists it with its parent; the
// router sends requests for it only to the workers that hold it, and an unknown adapter is a 404 naming the
// available ones. POST /v1/load_lora_adapter on the frontend loads on every worker (all or none: a rank above
// --max-lora-rank is refused by the workers before they evict anything), unload removes it; a worker that joins
// later with the same --lora-modules takes the adapter's requests, and a stream whose worker is killed moves on only
// to a worker that holds the adapter.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import OpenAI from 'openai';
import { createLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { loadModel } from '../../src/model/loader.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../../src/model/lora-writer.ts';
import {
  freePort, removeDir, servicesMissing, startConduit, startEtcd, startNats, stopAll, tempDir, waitForPort,
  type Etcd, type Nats, type Proc,
} from '../helpers/cluster-services.ts';
import { SLOW_DECODE_SHAPE, writeWorkerLossFixture } from '../helpers/worker-loss.ts';

const skip = servicesMissing();
const TOKEN = 'lora-cluster-token';
const MODEL = 'base';

async function until(what: string, condition: () => Promise<boolean> | boolean, maxMs = 30_000): Promise<void> {
  const deadline = Date.now() + maxMs;
  while (!(await condition())) {
    if (Date.now() > deadline) assert.fail(`timed out after ${maxMs} ms waiting until ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

/** The worker a request ran on (the last it moved to, if it moved), and its moves, from the frontend's trace. */
async function trace(url: string, id: string): Promise<{ worker: string; movedFrom: string[] }> {
  let json: { worker?: string; migrations?: { from_worker: string; to_worker: string | null }[] } = {};
  await until(`the trace of ${id}`, async () => {
    const res = await fetch(`${url}/v1/requests/${id}/trace`);
    if (res.status !== 200) return false;
    json = await res.json() as typeof json;
    return true;
  });
  const moves = json.migrations ?? [];
  return { worker: moves.at(-1)?.to_worker ?? json.worker ?? '', movedFrom: moves.map((m) => m.from_worker) };
}

describe('LoRA adapters through conduit frontend and conduit worker', { skip }, () => {
  let dir: string;
  let fixtureDir: string;
  let etcd: Etcd;
  let nats: Nats;
  let env: NodeJS.ProcessEnv;
  const workers = new Map<string, Proc>();
  let frontend: Proc;
  let url: string;
  let client: OpenAI;
  let reference: RunningServer;
  let referenceClient: OpenAI;
  const paths: Record<string, string> = {};

  const startWorker = (id: string, lora: string[]): Proc => {
    const proc = startConduit(['worker', '--model', paths.model!, '--served-model-name', MODEL, '--worker-id', id, '--threads', '1',
      '--kv-cache-memory', '16MiB', '--lease-ttl', '3', '--max-loras', '2', ...lora], env);
    workers.set(id, proc);
    return proc;
  };
  const readyWorkers = async (): Promise<string[]> => {
    try {
      const health = await (await fetch(`${url}/health`)).json() as { workers?: { id: string; state: string }[] };
      return (health.workers ?? []).filter((w) => w.state === 'ready').map((w) => w.id).sort();
    } catch {
      return [];
    }
  };
  const dump = (): string => [...workers].map(([id, p]) => `--- ${id}\n${p.output()}`).join('\n') + `\n--- frontend\n${frontend?.output()}`;
  const greedy = (model: string, prompt: string, maxTokens = 24) =>
    ({ model, prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true } as const);

  before(async () => {
    dir = tempDir('lora-cluster');
    const fixture = writeWorkerLossFixture('lora-cluster', undefined, SLOW_DECODE_SHAPE);
    fixtureDir = fixture.dir;
    paths.model = fixture.modelPath;
    const config = (await loadModel(paths.model)).config;
    for (const [name, rank, seed] of [['a', 4, 41], ['b', 4, 42], ['big', 32, 43]] as const) {
      paths[name] = join(dir, `${name}.gguf`);
      writeGgufLoraAdapter(paths[name], config, randomLoraAdapter(config, { rank, seed, bScale: 1 }));
    }
    [etcd, nats] = await Promise.all([startEtcd(dir), startNats()]);
    env = { CONDUIT_ETCD_ENDPOINTS: etcd.url, CONDUIT_NATS_SERVER: nats.url, CONDUIT_CLUSTER_TOKEN: TOKEN, CONDUIT_LOG_LEVEL: 'info' };
    startWorker('w1', ['--lora-modules', `a=${paths.a}`]);
    startWorker('w2', []);
    const port = await freePort();
    frontend = startConduit(['frontend', '--port', String(port), '--migration-limit', '2', '--no-request-log'], env);
    url = `http://127.0.0.1:${port}`;
    await waitForPort(port);
    client = new OpenAI({ apiKey: 'none', baseURL: `${url}/v1`, maxRetries: 0, timeout: 120_000 });
    const parsed = parseServeConfig(['--model', paths.model, '--served-model-name', MODEL, '--port', '0', '--threads', '1',
      '--kv-cache-memory', '16MiB', '--no-request-log', '--lora-modules', `a=${paths.a}`], {});
    reference = await startServer(parsed as Exclude<typeof parsed, 'help'>, createLogger('error'));
    referenceClient = new OpenAI({ apiKey: 'none', baseURL: `${reference.url}/v1`, maxRetries: 0, timeout: 120_000 });
    try {
      await until('the frontend sees both workers', async () => (await readyWorkers()).join() === 'w1,w2', 90_000);
    } catch (error) {
      console.error(dump());
      throw error;
    }
  });

  after(async () => {
    await reference?.api.shutdown(0);
    await stopAll();
    removeDir(dir);
    removeDir(fixtureDir);
  });

  test('/v1/models lists the adapter a worker holds with its parent; its greedy text is conduit serve\'s; only its worker runs it', { timeout: 240_000 }, async () => {
    const models = await client.models.list();
    const listed = models.data.map((m) => [m.id, (m as unknown as { parent: string | null }).parent]);
    assert.deepEqual(listed, [[MODEL, null], ['a', MODEL]]);
    for (let i = 0; i < 4; i++) {
      const prompt = `Once upon a time number ${i} there was a little dog named ${['Rex', 'Max', 'Bo', 'Pip'][i]}`;
      const [viaCluster, expected] = await Promise.all([
        client.completions.create(greedy('a', prompt)), referenceClient.completions.create(greedy('a', prompt)),
      ]);
      assert.equal(viaCluster.model, 'a');
      assert.equal(viaCluster.choices[0]!.text, expected.choices[0]!.text);
      // w2 holds no adapter: every request for 'a' ran on w1 (the base model's go anywhere).
      assert.equal((await trace(url, viaCluster.id)).worker, 'w1');
    }
    const base = await client.completions.create(greedy(MODEL, 'Once upon a time'));
    const baseExpected = await referenceClient.completions.create(greedy(MODEL, 'Once upon a time'));
    assert.equal(base.choices[0]!.text, baseExpected.choices[0]!.text);
    const adapted = await client.completions.create(greedy('a', 'Once upon a time'));
    assert.notEqual(adapted.choices[0]!.text, base.choices[0]!.text, 'the adapter changed nothing');
  });

  test('an unknown adapter is a 404 naming the available ones', async () => {
    await assert.rejects(client.completions.create(greedy('nope', 'Hello')), (error: unknown) => {
      assert.ok(error instanceof OpenAI.NotFoundError, String(error));
      assert.match(error.message, /'base' and 'a'/);
      return true;
    });
  });

  test('load and unload on the frontend reach the workers; a rank above --max-lora-rank is refused before any eviction', { timeout: 240_000 }, async () => {
    const load = (body: object) => fetch(`${url}/v1/load_lora_adapter`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
    const unload = (body: object) => fetch(`${url}/v1/unload_lora_adapter`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
    const loaded = await load({ lora_name: 'b', lora_path: paths.b });
    assert.equal(loaded.status, 200, await loaded.clone().text());
    assert.match(await loaded.text(), /Success: LoRA adapter 'b' added successfully/);
    const refLoad = await fetch(`${reference.url}/v1/load_lora_adapter`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ lora_name: 'b', lora_path: paths.b }) });
    assert.equal(refLoad.status, 200);
    assert.deepEqual((await client.models.list()).data.map((m) => m.id), [MODEL, 'a', 'b']);
    // Both workers hold 'b' now: requests for it run on either, with serve's text.
    const ran = new Set<string>();
    for (let i = 0; i < 6 && ran.size < 2; i++) {
      const prompt = `The ${i}th knight rode out`;
      const [viaCluster, expected] = await Promise.all([client.completions.create(greedy('b', prompt, 8)), referenceClient.completions.create(greedy('b', prompt, 8))]);
      assert.equal(viaCluster.choices[0]!.text, expected.choices[0]!.text);
      ran.add((await trace(url, viaCluster.id)).worker);
    }
    assert.ok([...ran].every((w) => w === 'w1' || w === 'w2'));
    // w1 holds 'a' and 'b' (--max-loras 2, both idle): 'big' (rank 32 > 16) is refused, nothing evicted on w1.
    const big = await load({ lora_name: 'big', lora_path: paths.big });
    assert.equal(big.status, 400);
    const bigError = (await big.json() as { error: { code: string; message: string } }).error;
    assert.equal(bigError.code, 'invalid_lora_adapter');
    assert.match(bigError.message, /rank 32, greater than the maximum LoRA rank 16/);
    assert.doesNotMatch(workers.get('w1')!.output(), /evicted/, 'w1 evicted an adapter for a refused one');
    assert.deepEqual((await client.models.list()).data.map((m) => m.id), [MODEL, 'a', 'b']);
    const unloaded = await unload({ lora_name: 'b' });
    assert.equal(unloaded.status, 200, await unloaded.clone().text());
    assert.equal((await unload({ lora_name: 'b' })).status, 404);
    await assert.rejects(client.completions.create(greedy('b', 'Hello')), OpenAI.NotFoundError);
    assert.deepEqual((await client.models.list()).data.map((m) => m.id), [MODEL, 'a']);
  });

  test('a worker joining with the same --lora-modules takes the adapter; a killed worker\'s stream moves only to another holder', { timeout: 240_000 }, async () => {
    startWorker('w3', ['--lora-modules', `a=${paths.a}`]);
    await until('the frontend sees w3', async () => (await readyWorkers()).join() === 'w1,w2,w3', 90_000);
    const prompt = 'In a quiet village by the sea there lived an old fisherman who';
    const expected = await referenceClient.completions.create(greedy('a', prompt, 300));
    let killed = '';
    const chunks = await client.completions.create({ ...greedy('a', prompt, 300), stream: true });
    let text = '';
    let id = '';
    let events = 0;
    for await (const chunk of chunks) {
      id = chunk.id;
      text += chunk.choices[0]?.text ?? '';
      if (++events === 3) {
        const running = await (await fetch(`${url}/health`)).json() as { workers: { id: string; running?: number }[] };
        killed = running.workers.find((w) => (w.running ?? 0) > 0)?.id ?? '';
        assert.ok(killed === 'w1' || killed === 'w3', `the stream ran on ${killed || 'no worker'}, not on a holder of 'a'`);
        workers.get(killed)!.kill('SIGKILL');
      }
    }
    assert.equal(text, expected.choices[0]!.text);
    const { worker, movedFrom } = await trace(url, id);
    assert.deepEqual(movedFrom, [killed]);
    assert.equal(worker, killed === 'w1' ? 'w3' : 'w1', `moved to ${worker}, which does not hold 'a'`);
    // With one holder of 'a' left, its requests all go there; w2 still takes none.
    await until(`the frontend dropped ${killed}`, async () => !(await readyWorkers()).includes(killed));
    for (let i = 0; i < 3; i++) {
      const done = await client.completions.create(greedy('a', `A short tale ${i}`, 4));
      assert.equal((await trace(url, done.id)).worker, worker);
    }
  });
});
