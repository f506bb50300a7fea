// LoRA adapters through the HTTP API: --lora-modules at start, vLLM's /v1/load_lora_adapter and
// /v1/unload_lora_adapter, /v1/models with each adapter's parent, a request naming an adapter as its model, LRU
// eviction under --max-loras (an evicted adapter loads again on demand), the metrics, and refusals that name the
// problem while the server stays up.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { silentLogger } from '../../src/api/log.ts';
import { UsageError } from '../../src/cli/flags.ts';
import { parseLoraModules, parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import type { ModelConfig } from '../../src/model/config.ts';
import { loadModel } from '../../src/model/loader.ts';
import { randomLoraAdapter, writeGgufLoraAdapter, writePeftLoraAdapter } from '../../src/model/lora-writer.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { rawRequest } from './http-client.ts';

describe('LoRA adapters over HTTP', () => {
  let dir: string;
  let config: ModelConfig;
  let server: RunningServer;
  const paths: Record<string, string> = {};

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-lora-http-'));
    const modelPath = join(dir, 'base.gguf');
    writeSyntheticModel({
      name: 'lora http', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 256,
      dtype: 'F32', seed: 31, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
    }, modelPath);
    config = (await loadModel(modelPath)).config;
    for (const [name, seed] of [['a', 1], ['b', 2], ['c', 3]] as const) {
      paths[name] = join(dir, `${name}.gguf`);
      writeGgufLoraAdapter(paths[name], config, randomLoraAdapter(config, { rank: 4, seed, bScale: 1 }));
    }
    paths.peft = join(dir, 'c-peft');
    writePeftLoraAdapter(paths.peft, randomLoraAdapter(config, { rank: 4, seed: 3, bScale: 1 }));
    const small = { ...config, dim: 32, headDim: 8 };
    paths.wrong = join(dir, 'wrong.gguf');
    writeGgufLoraAdapter(paths.wrong, small, randomLoraAdapter(small, { rank: 4, seed: 9 }));
    const parsed = parseServeConfig(['--port', '0', '--log-level', 'silent', '--kv-cache-memory', '8MiB', '--threads', '1',
      '--model', `base=${modelPath}`, '--lora-modules', `a=${paths.a}`, '--max-loras', '2', '--workers', '2'], {});
    if (parsed === 'help') throw new Error('unexpected --help');
    server = await startServer(parsed, silentLogger);
  });
  after(async () => {
    await server?.api.shutdown(0);
    rmSync(dir, { recursive: true, force: true });
  });

  const complete = async (model: string, prompt = 'Once upon a time') => {
    const res = await rawRequest(server.url, {
      path: '/v1/completions', body: { model, prompt, max_tokens: 12, temperature: 0, ignore_eos: true },
    });
    return { status: res.status, body: res.json() };
  };
  const load = (body: object) => rawRequest(server.url, { path: '/v1/load_lora_adapter', body });
  const unload = (body: object) => rawRequest(server.url, { path: '/v1/unload_lora_adapter', body });

  it('lists the adapters of --lora-modules with their parent and runs a request named after one', async () => {
    const models = (await rawRequest(server.url, { path: '/v1/models' })).json().data;
    assert.deepEqual(models.map((m: { id: string; parent: string | null }) => [m.id, m.parent]), [['base', null], ['a', 'base']]);
    assert.equal(models[1].root, paths.a);
    const [base, adapted] = await Promise.all([complete('base'), complete('a')]);
    assert.equal(adapted.status, 200);
    assert.equal(adapted.body.model, 'a');
    assert.notEqual(adapted.body.choices[0].text, base.body.choices[0].text, 'the adapter changed nothing');
    // The trace names the adapter and its base model, on the span attributes and in the timings.
    const trace = await rawRequest(server.url, { path: `/v1/requests/${adapted.body.id}/trace` });
    assert.equal(trace.status, 200);
    assert.equal(trace.json().model, 'base');
    assert.equal(trace.json().lora_adapter, 'a');
    assert.equal(trace.json().timings.lora_adapter, 'a');
    const baseTrace = (await rawRequest(server.url, { path: `/v1/requests/${base.body.id}/trace` })).json();
    assert.equal(baseTrace.lora_adapter, undefined);
    // One at a time gives the same text as together.
    assert.equal((await complete('a')).body.choices[0].text, adapted.body.choices[0].text);
    assert.equal((await complete('base')).body.choices[0].text, base.body.choices[0].text);
  });

  it('loads and unloads adapters at run time (vLLM\'s API) and refuses bad ones clearly', async () => {
    const loaded = await load({ lora_name: 'b', lora_path: paths.b });
    assert.equal(loaded.status, 200);
    assert.match(loaded.text, /Success: LoRA adapter 'b' added successfully/);
    const again = await load({ lora_name: 'b', lora_path: paths.b });
    assert.equal(again.status, 400);
    assert.match(again.json().error.message, /already been loaded/);
    const wrong = await load({ lora_name: 'w', lora_path: paths.wrong });
    assert.equal(wrong.status, 400);
    assert.equal(wrong.json().error.code, 'invalid_lora_adapter');
    assert.match(wrong.json().error.message, /another base model/);
    const missing = await load({ lora_name: 'm', lora_path: join(dir, 'nope.gguf') });
    assert.equal(missing.status, 400);
    assert.match(missing.json().error.message, /does not exist/);
    assert.equal((await load({ lora_name: 'x' })).status, 400);
    assert.equal((await complete('w')).status, 404);
    assert.equal((await complete('b')).status, 200);
    const removed = await unload({ lora_name: 'b' });
    assert.equal(removed.status, 200);
    assert.match(removed.text, /removed successfully/);
    assert.equal((await unload({ lora_name: 'b' })).status, 404);
    const gone = await complete('b');
    assert.equal(gone.status, 404);
    assert.match(gone.body.error.message, /'base' and 'a'/);
  });

  it('evicts the least recently used adapter past --max-loras and loads it again when a request names it', async () => {
    const before = (await complete('a')).body.choices[0].text;
    assert.equal((await load({ lora_name: 'c', lora_path: paths.c })).status, 200);
    assert.equal((await load({ lora_name: 'c-peft', lora_path: paths.peft })).status, 200);
    let metrics = (await rawRequest(server.url, { path: '/metrics' })).text;
    assert.match(metrics, /conduit_lora_adapters_active\{model="base"\} 2/);
    assert.match(metrics, /conduit_lora_adapters_registered\{model="base"\} 3/);
    assert.match(metrics, /conduit_lora_adapter_evictions_total\{model="base"\} [1-9]/);
    // 'a' was evicted; naming it loads it again, same text as before.
    assert.equal((await complete('a')).body.choices[0].text, before);
    // The PEFT folder and the GGUF file of the same adapter give the same text.
    const [gguf, peft] = await Promise.all([complete('c'), complete('c-peft')]);
    assert.equal(gguf.status, 200);
    assert.equal(peft.body.choices[0].text, gguf.body.choices[0].text);
    metrics = (await rawRequest(server.url, { path: '/metrics' })).text;
    const loads = Number(/conduit_lora_adapter_loads_total\{model="base"\} (\d+)/.exec(metrics)?.[1]);
    assert.ok(loads >= 5, `expected at least 5 loads, got ${loads}`);
    assert.equal((await rawRequest(server.url, { path: '/health' })).status, 200);
  });
});

describe('LoRA adapters on disaggregated workers', () => {
  it('gives the text of aggregated serving, the adapter loaded on prefill and decode workers', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-lora-disagg-'));
    const servers: RunningServer[] = [];
    try {
      const modelPath = join(dir, 'base.gguf');
      writeSyntheticModel({
        name: 'lora disagg', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 256,
        dtype: 'F32', seed: 32, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
      }, modelPath);
      const config = (await loadModel(modelPath)).config;
      const adapterPath = join(dir, 'a.gguf');
      writeGgufLoraAdapter(adapterPath, config, randomLoraAdapter(config, { rank: 4, seed: 8, bScale: 1 }));
      const texts: string[] = [];
      for (const layout of [[], ['--prefill-workers', '1', '--decode-workers', '1', '--disagg-min-remote-prefill-tokens', '1']]) {
        const parsed = parseServeConfig(['--port', '0', '--log-level', 'silent', '--kv-cache-memory', '8MiB', '--threads', '1',
          '--model', `base=${modelPath}`, '--lora-modules', `a=${adapterPath}`, ...layout], {});
        if (parsed === 'help') throw new Error('unexpected --help');
        const server = await startServer(parsed, silentLogger);
        servers.push(server);
        const prompt = 'Once upon a time there was a little dog who liked to run in the park every day';
        const res = await rawRequest(server.url, {
          path: '/v1/completions', body: { model: 'a', prompt, max_tokens: 12, temperature: 0, ignore_eos: true },
        });
        assert.equal(res.status, 200, res.text);
        texts.push(res.json().choices[0].text);
      }
      assert.equal(texts[1], texts[0]);
    } finally {
      for (const server of servers) await server.api.shutdown(0);
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('--lora-modules', () => {
  it('takes NAME=PATH items, comma-separated or repeated', () => {
    assert.deepEqual(parseLoraModules(['a=/x.gguf,b=/y', 'c=/z']), [
      { name: 'a', path: '/x.gguf' }, { name: 'b', path: '/y' }, { name: 'c', path: '/z' }]);
    assert.throws(() => parseLoraModules(['/x.gguf']), UsageError);
    assert.throws(() => parseLoraModules(['a=/x,a=/y']), UsageError);
    const fromEnv = parseServeConfig([], { CONDUIT_LORA_MODULES: 'a=/x.gguf', CONDUIT_MAX_LORAS: '3' });
    assert.ok(fromEnv !== 'help');
    assert.deepEqual(fromEnv.loraModules, [{ name: 'a', path: '/x.gguf' }]);
    assert.equal(fromEnv.maxLoras, 3);
  });
});
