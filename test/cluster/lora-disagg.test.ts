// LoRA adapters on remote-disaggregated workers: real etcd and nats-server, `conduit worker --role prefill` and
// `--role decode` processes with --lora-modules (stories260K and a random rank-4 adapter written here), a `conduit
// frontend`. A request for the adapter is prefilled with it on a prefill worker that holds it (never on the one that
// does not), its KV moves to the decode worker, which decodes with it: the greedy text equals `conduit serve
// --lora-modules`'s (aggregated, one process). The prefix-cache keys carry the adapter on both sides: a base-model
// request's cached prompt is not reused for the adapter's (0 cached tokens, the adapter's text), the adapter's own
// is. An adapter loaded at run time through the frontend reaches the prefill and decode workers. The frontend runs
// with --no-disagg-compare-transfer: this model prefills a prompt in about a millisecond, which a loaded machine's
// transfer can exceed, and every prompt past the length bound must leave the decode worker for the test to say
// where it went. Skipped without ../shared/models or etcd / nats-server.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import OpenAI from 'openai';
import { createLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { loadModel } from '../../src/model/loader.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../../src/model/lora-writer.ts';
import {
  freePort, removeDir, servicesMissing, startConduit, startEtcd, startNats, stopAll, tempDir, waitForPort, type Proc,
} from '../helpers/cluster-services.ts';
import { sharedModel, skipUnlessShared } from '../helpers/shared-models.ts';

const MODEL_FILE = 'stories260K.gguf';
const skip = servicesMissing() ?? skipUnlessShared(MODEL_FILE);
const TOKEN = 'lora-disagg-token';
const MODEL = 'stories';

async function until(what: string, condition: () => Promise<boolean>, maxMs = 30_000): Promise<void> {
  const deadline = Date.now() + maxMs;
  while (!(await condition())) {
    if (Date.now() > deadline) assert.fail(`timed out after ${maxMs} ms waiting until ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

interface Trace { worker?: string; phases: { phase: string; attributes?: { from_worker?: string; reason?: string } }[] }

/** The prefill worker the request's KV came from (its kv_transfer phase). */
const prefilledOn = (t: Trace) => t.phases.find((p) => p.phase === 'kv_transfer')?.attributes?.from_worker;

async function trace(url: string, id: string): Promise<{ json: Trace; text: string }> {
  let text = '';
  await until(`the trace of ${id}`, async () => {
    const res = await fetch(`${url}/v1/requests/${id}/trace`);
    text = await res.text();
    return res.status === 200;
  });
  return { json: JSON.parse(text) as Trace, text };
}

describe('LoRA adapters on remote prefill and decode workers', { skip }, () => {
  let dir: string;
  const procs = new Map<string, Proc>();
  let url: string;
  let client: OpenAI;
  let reference: RunningServer;
  let referenceClient: OpenAI;
  const paths: Record<string, string> = {};

  const dump = (): string => [...procs].map(([id, p]) => `--- ${id}\n${p.output()}`).join('\n');
  const greedy = (model: string, prompt: string, maxTokens = 24) =>
    ({ model, prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true } as const);
  const prompt = (n: number) => `Once upon a time, in a small town by the river, there lived a girl named ${['Lily', 'Sue', 'Amy', 'Mia'][n % 4]} `
    + `who loved to play with her ${['red ball', 'big dog', 'old kite', 'toy boat'][n % 4]} every day after school, and one day she`;

  before(async () => {
    dir = tempDir('lora-disagg');
    paths.model = sharedModel(MODEL_FILE)!;
    const config = (await loadModel(paths.model)).config;
    for (const [name, seed] of [['a', 61], ['b', 62]] as const) {
      paths[name] = join(dir, `${name}.gguf`);
      writeGgufLoraAdapter(paths[name], config, randomLoraAdapter(config, { rank: 4, seed, bScale: 1 }));
    }
    const [etcd, nats] = await Promise.all([startEtcd(dir), startNats()]);
    const env = { CONDUIT_ETCD_ENDPOINTS: etcd.url, CONDUIT_NATS_SERVER: nats.url, CONDUIT_CLUSTER_TOKEN: TOKEN, CONDUIT_LOG_LEVEL: 'info' };
    // p2 holds no adapter: requests for 'a' must not be prefilled there.
    for (const [id, role, lora] of [['p1', 'prefill', true], ['p2', 'prefill', false], ['d1', 'decode', true]] as const) {
      procs.set(id, startConduit(['worker', '--model', paths.model, '--served-model-name', MODEL, '--worker-id', id, '--role', role,
        '--threads', '1', '--kv-cache-memory', '16MiB', '--lease-ttl', '3', ...(lora ? ['--lora-modules', `a=${paths.a}`] : [])], env));
    }
    const port = await freePort();
    procs.set('frontend', startConduit(['frontend', '--port', String(port), '--no-request-log', '--disagg-min-remote-prefill-tokens', '16',
      '--no-disagg-compare-transfer'], env));
    await waitForPort(port, '127.0.0.1', 60_000);
    url = `http://127.0.0.1:${port}`;
    client = new OpenAI({ apiKey: 'none', baseURL: `${url}/v1`, maxRetries: 0, timeout: 120_000 });
    const parsed = parseServeConfig(['--model', paths.model, '--served-model-name', MODEL, '--port', '0', '--threads', '1',
      '--kv-cache-memory', '16MiB', '--no-request-log', '--lora-modules', `a=${paths.a}`], {});
    reference = await startServer(parsed as Exclude<typeof parsed, 'help'>, createLogger('error'));
    referenceClient = new OpenAI({ apiKey: 'none', baseURL: `${reference.url}/v1`, maxRetries: 0, timeout: 120_000 });
    try {
      await until('the frontend serves with p1, p2 and d1', async () => {
        const health = await fetch(`${url}/health`).then((r) => r.json() as Promise<{ ready?: boolean; workers?: { id: string; state: string }[] }>, () => ({}) as { ready?: boolean; workers?: { id: string; state: string }[] });
        return health.ready === true && (health.workers ?? []).filter((w) => w.state === 'ready').map((w) => w.id).sort().join() === 'd1,p1,p2';
      }, 90_000);
    } catch (error) {
      console.error(dump());
      throw error;
    }
  });

  after(async () => {
    await reference?.api.shutdown(0);
    await stopAll();
    removeDir(dir);
  });

  test('the adapter\'s greedy text is aggregated serving\'s, prefilled on the prefill worker holding it and decoded on the decode worker', { timeout: 240_000 }, async () => {
    const models = await client.models.list();
    assert.deepEqual(models.data.map((m) => [m.id, (m as unknown as { parent: string | null }).parent]), [[MODEL, null], ['a', MODEL]]);
    for (let n = 0; n < 4; n++) {
      const [got, expected, base] = await Promise.all([
        client.completions.create(greedy('a', prompt(n))), referenceClient.completions.create(greedy('a', prompt(n))),
        referenceClient.completions.create(greedy(MODEL, prompt(n))),
      ]);
      assert.equal(got.model, 'a');
      assert.equal(got.choices[0]!.text, expected.choices[0]!.text, `prompt ${n}`);
      assert.notEqual(got.choices[0]!.text, base.choices[0]!.text, 'the adapter changed nothing');
      const { json } = await trace(url, got.id);
      assert.equal(json.worker, 'd1');
      // Never on p2, which lacks the adapter.
      assert.equal(prefilledOn(json), 'p1', `prompt ${n}`);
      const kv = (got as unknown as { timings?: { kv_transfer?: { blocks: number } } }).timings?.kv_transfer;
      assert.ok((kv?.blocks ?? 0) > 0, `its KV moved from the prefill worker: ${JSON.stringify(kv)}`);
    }
  });

  test('the prefix cache keys carry the adapter on both sides: no KV of the base model is reused for it', { timeout: 240_000 }, async () => {
    const cached = (c: OpenAI.Completion) => c.usage?.prompt_tokens_details?.cached_tokens ?? 0;
    const movedBlocks = (c: OpenAI.Completion) => (c as unknown as { timings?: { kv_transfer?: { blocks: number } } }).timings?.kv_transfer?.blocks;
    const blockSize = reference.api.gateway.engine!.info.blockSize;
    // A base-model prompt prefilled on p1 (the prefill worker that also holds 'a'): its blocks are cached there and
    // on d1, under the base model's keys.
    let p = '';
    let base: OpenAI.Completion | undefined;
    // Prompts that share no block with any before (no worker's cache helps): the prefill router picks p1 or p2 at
    // random between the two idle ones.
    const names = ['Tom', 'Ben', 'Sam', 'Max', 'Jim', 'Ted', 'Bob', 'Dan', 'Kim', 'Joe', 'Ann', 'Eve'];
    for (let n = 0; n < names.length && p === ''; n++) {
      const candidate = `${names[n]} was a boy who ran out to the park when the sun was warm and the birds were singing in the tall trees`;
      const done = await client.completions.create(greedy(MODEL, candidate));
      if (prefilledOn((await trace(url, done.id)).json) === 'p1') [p, base] = [candidate, done];
    }
    assert.ok(base, 'no base-model request was prefilled on p1');
    // The frontend's prefill router learns p1's new blocks from p1's KV events, which travel apart from the response:
    // a repeat sent before they arrive may go to p2, which had not seen the prompt (and has it cached after).
    let baseAgain = await client.completions.create(greedy(MODEL, p));
    for (let attempt = 0; cached(baseAgain) === 0 && attempt < 10; attempt++) {
      await new Promise((resolve) => setTimeout(resolve, 300));
      baseAgain = await client.completions.create(greedy(MODEL, p));
    }
    assert.ok(cached(baseAgain) > 0, 'the base model\'s prompt was not cached');
    assert.equal(baseAgain.choices[0]!.text, base.choices[0]!.text);
    const expected = await referenceClient.completions.create(greedy('a', p));
    const adapted = await client.completions.create(greedy('a', p));
    // p1 computed the whole prompt again, and d1 took every block of it over (it reused none of its own).
    assert.equal(cached(adapted), 0, 'the base model\'s KV was reused for the adapter');
    assert.equal(prefilledOn((await trace(url, adapted.id)).json), 'p1');
    assert.equal(movedBlocks(adapted), Math.ceil(adapted.usage!.prompt_tokens / blockSize), 'the decode worker reused the base model\'s KV');
    assert.equal(adapted.choices[0]!.text, expected.choices[0]!.text);
    const adaptedAgain = await client.completions.create(greedy('a', p));
    assert.ok(cached(adaptedAgain) > 0, 'the adapter\'s own prompt was not cached');
    assert.equal(adaptedAgain.choices[0]!.text, expected.choices[0]!.text);
  });

  test('an adapter loaded through the frontend reaches the prefill and decode workers', { timeout: 240_000 }, async () => {
    const load = await fetch(`${url}/v1/load_lora_adapter`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ lora_name: 'b', lora_path: paths.b }),
    });
    assert.equal(load.status, 200, await load.clone().text());
    const refLoad = await fetch(`${reference.url}/v1/load_lora_adapter`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ lora_name: 'b', lora_path: paths.b }),
    });
    assert.equal(refLoad.status, 200);
    assert.deepEqual((await client.models.list()).data.map((m) => m.id), [MODEL, 'a', 'b']);
    const song = (n: number) => `${['Red', 'Blue', 'Pink', 'Gray', 'Gold', 'Teal'][n]} birds sang a happy song in the garden while the cat slept in the sun`;
    const prefillWorkers = new Set<string>();
    for (let n = 0; n < 6 && prefillWorkers.size < 2; n++) {
      const [got, expected] = await Promise.all([
        client.completions.create(greedy('b', song(n), 12)), referenceClient.completions.create(greedy('b', song(n), 12)),
      ]);
      assert.equal(got.choices[0]!.text, expected.choices[0]!.text);
      const { json } = await trace(url, got.id);
      const on = prefilledOn(json);
      assert.ok(on !== undefined, `${song(n)}: prefilled on the decode worker`);
      prefillWorkers.add(on);
    }
    // Both prefill workers hold 'b' now: either may prefill it (at least one did).
    assert.ok(prefillWorkers.size > 0 && [...prefillWorkers].every((w) => w === 'p1' || w === 'p2'), [...prefillWorkers].join());
    const unload = await fetch(`${url}/v1/unload_lora_adapter`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ lora_name: 'b' }),
    });
    assert.equal(unload.status, 200, await unload.clone().text());
    await assert.rejects(client.completions.create(greedy('b', 'Hello')), OpenAI.NotFoundError);
  });
});
