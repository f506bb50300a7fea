// Several models behind one server: `--model NAME=PATH` and `--served-model-name` per model, /v1/models lists them
// all, each request runs on the model it names (its own workers, tokenizer and template), an unknown name is a 404
// naming the served ones.

import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { silentLogger } from '../../src/util/log.ts';
import { modelFolderNames, parseModelSpecs, parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { UsageError } from '../../src/cli/flags.ts';
import { writeTinyModel } from '../helpers/cpu-model.ts';
import { rawRequest } from './http-client.ts';

function writeModel(dir: string, file: string, seed: number): string {
  return writeTinyModel(join(dir, file), { seed, name: `multi ${seed}` });
}

async function serve(flags: string[]): Promise<RunningServer> {
  const config = parseServeConfig(['--port', '0', '--log-level', 'silent', '--kv-cache-memory', '8MiB', '--threads', '1',
    '--worker-restart-limit', '0', ...flags], {});
  if (config === 'help') throw new Error('unexpected --help');
  return startServer(config, silentLogger);
}

async function complete(url: string, model: string, prompt = 'Once upon a time'): Promise<{ status: number; body: any }> {
  const res = await rawRequest(url, {
    path: '/v1/completions', body: { model, prompt, max_tokens: 12, temperature: 0, ignore_eos: true },
  });
  return { status: res.status, body: res.json() };
}

describe('several models behind one server', () => {
  let dir: string;
  let pathA: string;
  let pathB: string;
  let server: RunningServer;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-multi-model-'));
    pathA = writeModel(dir, 'a.gguf', 3);
    pathB = writeModel(dir, 'b.gguf', 4);
    server = await serve(['--model', `alpha=${pathA}`, '--model', pathB, '--served-model-name', 'alpha',
      '--served-model-name', 'beta', '--workers', '2']);
  });
  after(async () => {
    await server?.api.shutdown(0);
    rmSync(dir, { recursive: true, force: true });
  });

  it('lists every model in /v1/models and answers /v1/models/{name} for each', async () => {
    const list = (await rawRequest(server.url, { path: '/v1/models' })).json();
    assert.deepEqual(list.data.map((m: { id: string }) => m.id), ['alpha', 'beta']);
    assert.equal((await rawRequest(server.url, { path: '/v1/models/beta' })).json().id, 'beta');
    assert.equal((await rawRequest(server.url, { path: '/v1/models/gamma' })).status, 404);
  });

  it('runs each request on the model it names, as that model alone would', async () => {
    const [a, b] = await Promise.all([complete(server.url, 'alpha'), complete(server.url, 'beta')]);
    assert.equal(a.status, 200);
    assert.equal(b.status, 200);
    assert.equal(a.body.model, 'alpha');
    assert.equal(b.body.model, 'beta');
    assert.notEqual(a.body.choices[0].text, b.body.choices[0].text, 'two different models gave the same text');
    const alone = await serve(['--model', pathB, '--served-model-name', 'beta']);
    try {
      const solo = await complete(alone.url, 'beta');
      assert.equal(b.body.choices[0].text, solo.body.choices[0].text);
    } finally {
      await alone.api.shutdown(0);
    }
    // No "model": the first one.
    const res = await rawRequest(server.url, { path: '/v1/completions', body: { prompt: 'Hi', max_tokens: 2 } });
    assert.equal(res.json().model, 'alpha');
  });

  it('refuses an unknown model with a 404 that names the served ones', async () => {
    const res = await complete(server.url, 'gamma');
    assert.equal(res.status, 404);
    assert.equal(res.body.error.code, 'model_not_found');
    assert.match(res.body.error.message, /'gamma'.*'alpha' and 'beta'/);
  });

  it('keeps every model\'s workers apart in /metrics', async () => {
    const text = (await rawRequest(server.url, { path: '/metrics' })).text;
    assert.match(text, /worker="beta:worker-1"/);
    assert.match(text, /worker="alpha:worker-0"/);
    // The per-request series (TTFT, from the requests' traces) name the workers as the per-worker ones do: no bare
    // worker-0 that would merge both models' first workers.
    assert.match(text, /^conduit_time_to_first_token_milliseconds_count\{model="alpha",worker="alpha:worker-\d"\} [1-9]/m);
    assert.doesNotMatch(text, /worker="worker-\d"/);
    // Each model's KV pool, its own workers' blocks: both models' series, each its engine's capacity.
    for (const { name, backend } of server.api.gateway.servedModels) {
      const capacity = new RegExp(`^conduit_kv_cache_capacity_blocks\\{model="${name}"\\} (\\d+)$`, 'm').exec(text);
      assert.ok(capacity, `a KV capacity series for ${name}`);
      assert.equal(Number(capacity[1]), backend.engine.stats().kvBlocksTotal, name);
      assert.match(text, new RegExp(`^conduit_kv_cache_used_blocks\\{model="${name}"\\} \\d+$`, 'm'));
    }
  });
});

describe('several models with KV offload tiers', () => {
  it('split the RAM and disk budgets between the models, each model\'s disk blocks in a folder named by it', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-multi-model-tiers-'));
    try {
      const pathA = writeModel(dir, 'a.gguf', 3);
      const pathB = writeModel(dir, 'b.gguf', 4);
      const tiers = ['--kv-offload-memory', '1MiB', '--kv-offload-disk', join(dir, 'tier'), '--kv-offload-disk-size', '2MiB'];
      const capacities = async (flags: string[], workers: Record<string, string>) => {
        const server = await serve(flags);
        try {
          for (const model of Object.keys(workers)) assert.equal((await complete(server.url, model)).status, 200);
          const text = (await rawRequest(server.url, { path: '/metrics' })).text;
          const read = (tier: string) => Object.values(workers).reduce((sum, worker) =>
            sum + Number(new RegExp(`^conduit_kv_tier_capacity_blocks\\{worker="${worker}",tier="${tier}"\\} (\\d+)$`, 'm').exec(text)?.[1]), 0);
          return { ram: read('ram'), disk: read('disk') };
        } finally {
          await server.api.shutdown(0);
        }
      };
      const both = await capacities(['--model', `alpha=${pathA}`, '--model', `beta=${pathB}`, ...tiers], { alpha: 'alpha:worker-0', beta: 'beta:worker-0' });
      const alone = await capacities(['--model', `alpha=${pathA}`, ...tiers.slice(0, 2)], { alpha: 'worker-0' });
      assert.ok(both.ram > 0 && both.disk > 0, JSON.stringify(both));
      // The same models' blocks are the same size: two models hold what one would alone (up to rounding).
      assert.ok(Math.abs(both.ram - alone.ram) <= 2, `${both.ram} RAM blocks for two models, ${alone.ram} for one`);
      // Two unnamed models of one file name are told apart by their files' paths, not by their positions.
      const [alpha, b1, b2] = modelFolderNames([{ path: pathA, servedModelName: 'alpha' }, { path: pathB }, { path: '/x/b.gguf' }]);
      assert.equal(alpha, 'model-alpha');
      assert.match(b1!, /^model-b\.gguf~[0-9a-f]{12}$/);
      assert.match(b2!, /^model-b\.gguf~[0-9a-f]{12}$/);
      assert.notEqual(b1, b2);
      assert.deepEqual(modelFolderNames([{ path: '/x/b.gguf' }, { path: pathB }]), [b2, b1]);
      assert.ok(existsSync(join(dir, 'tier', 'model-alpha')) && existsSync(join(dir, 'tier', 'model-beta')));
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('gives models whose names differ only in characters a folder name cannot hold folders of their own', async () => {
    // `a/b` and `a_b` once both became `model-a_b`, and the second of them `model-a_b-1`, the folder of `a_b-1`.
    const names = modelFolderNames([{ servedModelName: 'a/b' }, { servedModelName: 'a_b' }, { servedModelName: 'a_b-1' },
      { servedModelName: 'a%2Fb' }, { servedModelName: 'x'.repeat(300) }, { servedModelName: `${'x'.repeat(300)}y` }]);
    assert.equal(new Set(names).size, names.length, names.join(' '));
    assert.deepEqual(names.slice(0, 4), ['model-a%2Fb', 'model-a_b', 'model-a_b-1', 'model-a%252Fb'], 'simple names keep their folders');
    assert.ok(names.every((name) => name.length <= 150), 'a long name is cut to fit a file system');
    const dir = mkdtempSync(join(tmpdir(), 'conduit-multi-model-folders-'));
    try {
      const path = writeModel(dir, 'a.gguf', 3);
      const server = await serve(['--model', path, '--model', path, '--model', path, '--served-model-name', 'a/b',
        '--served-model-name', 'a_b', '--served-model-name', 'a_b-1',
        '--kv-offload-memory', '1MiB', '--kv-offload-disk', join(dir, 'tier'), '--kv-offload-disk-size', '3MiB']);
      try {
        for (const model of ['a/b', 'a_b', 'a_b-1']) assert.equal((await complete(server.url, model)).status, 200, model);
      } finally {
        await server.api.shutdown(0);
      }
      for (const folder of names.slice(0, 3)) assert.ok(existsSync(join(dir, 'tier', folder)), folder);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('--model specs', () => {
  const none = () => false;
  it('takes NAME=PATH, names by position, and refuses clashes', () => {
    assert.deepEqual(parseModelSpecs(['a=/m/a.gguf', '/m/b.gguf'], [], none),
      [{ path: '/m/a.gguf', servedModelName: 'a' }, { path: '/m/b.gguf' }]);
    assert.deepEqual(parseModelSpecs(['/m/a.gguf', '/m/b.gguf'], ['x', 'y'], none),
      [{ path: '/m/a.gguf', servedModelName: 'x' }, { path: '/m/b.gguf', servedModelName: 'y' }]);
    // A path with "=" in a folder name is a path.
    assert.deepEqual(parseModelSpecs(['/m/k=v/a.gguf'], [], none), [{ path: '/m/k=v/a.gguf' }]);
    assert.throws(() => parseModelSpecs(['a=/x', 'a=/y'], [], none), UsageError);
    assert.throws(() => parseModelSpecs(['/x'], ['a', 'b'], none), UsageError);
    assert.throws(() => parseModelSpecs(['a=/x'], ['b'], none), UsageError);
  });

  it('keeps every --model (a repeated --model is no longer the last one only)', () => {
    const config = parseServeConfig(['--model', 'a=/x.gguf', '--model', 'b=/y.gguf'], {});
    assert.notEqual(config, 'help');
    if (config === 'help') return;
    assert.equal(config.modelPath, '/x.gguf');
    assert.equal(config.servedModelName, 'a');
    assert.deepEqual(config.extraModels, [{ path: '/y.gguf', servedModelName: 'b' }]);
    const fromEnv = parseServeConfig([], { CONDUIT_MODEL: 'a=/x.gguf,b=/y.gguf' });
    assert.deepEqual(fromEnv !== 'help' && fromEnv.extraModels, [{ path: '/y.gguf', servedModelName: 'b' }]);
  });
});
