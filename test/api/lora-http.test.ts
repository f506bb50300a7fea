// LoRA adapters through the HTTP API: --lora-modules at start (NAME=PATH[@BASE] or vLLM's JSON, for the first of
// several models or the one named), vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (an unload while
// requests run lets them finish, new ones get 404), /v1/models with each adapter's parent, a request naming an
// adapter as its model, LRU eviction under --max-loras (an evicted adapter loads again on demand), the metrics,
// refusals that name the problem while the server stays up, and adapters on simulated workers.

import assert from 'node:assert/strict';
import { copyFileSync, mkdtempSync, rmSync, truncateSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { silentLogger } from '../../src/util/log.ts';
import { UsageError } from '../../src/cli/flags.ts';
import { parseLoraModules, parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import type { ModelConfig } from '../../src/model/config.ts';
import { loadModel } from '../../src/model/loader.ts';
import { randomLoraAdapter, writeGgufLoraAdapter, writePeftLoraAdapter } from '../../src/model/lora-writer.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { rawRequest } from './http-client.ts';
import { forEachStreamEvent } from '../helpers/sse-stream.ts';

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

  it('checks a file\'s start before reading it: a non-GGUF, a model and an adapter past 2 GiB are refused at once', async () => {
    // Sparse files: past 2 GiB without taking the disk space.
    const beyondReadLimit = 2 ** 31 + 4096;
    const zeros = join(dir, 'zeros.gguf');
    writeFileSync(zeros, '');
    truncateSync(zeros, beyondReadLimit);
    const model = join(dir, 'model-as-adapter.gguf');
    copyFileSync(join(dir, 'base.gguf'), model);
    truncateSync(model, beyondReadLimit);
    const huge = join(dir, 'huge-adapter.gguf');
    copyFileSync(paths.b!, huge);
    truncateSync(huge, beyondReadLimit);
    for (const [name, path, message] of [
      ['zeros', zeros, /neither a GGUF LoRA adapter nor a PEFT folder: .*not a GGUF file \(bad magic\)/],
      ['model', model, /is a model \(a GGUF with a block_count\), not a LoRA adapter/],
      ['huge', huge, new RegExp(`is a GGUF LoRA adapter of ${beyondReadLimit} bytes, too large to read`)],
    ] as const) {
      const started = performance.now();
      const refused = await load({ lora_name: name, lora_path: path });
      assert.equal(refused.status, 400, refused.text);
      assert.equal(refused.json().error.code, 'invalid_lora_adapter');
      assert.match(refused.json().error.message, message);
      assert.doesNotMatch(refused.json().error.message, /greater than 2 GiB/);
      assert.ok(performance.now() - started < 5000, `${name} answered in ${Math.round(performance.now() - started)} ms`);
      rmSync(path);
    }
    assert.equal((await complete('a')).status, 200, 'the server stays up');
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

  it('refuses an adapter above --max-lora-rank from its header, before evicting a resident idle one', async () => {
    const big = join(dir, 'big-r32.gguf');
    writeGgufLoraAdapter(big, config, randomLoraAdapter(config, { rank: 32, seed: 7 }));
    // Both slots of --max-loras 2 hold idle adapters.
    assert.equal((await complete('c')).status, 200);
    assert.equal((await complete('c-peft')).status, 200);
    const counters = async () => {
      const text = (await rawRequest(server.url, { path: '/metrics' })).text;
      const value = (name: string) => Number(new RegExp(`${name}\\{model="base"\\} (\\d+)`).exec(text)?.[1]);
      return { active: value('conduit_lora_adapters_active'), loads: value('conduit_lora_adapter_loads_total'), evictions: value('conduit_lora_adapter_evictions_total') };
    };
    const before = await counters();
    assert.equal(before.active, 2);
    const refused = await load({ lora_name: 'big', lora_path: big });
    assert.equal(refused.status, 400);
    assert.equal(refused.json().error.code, 'invalid_lora_adapter');
    assert.match(refused.json().error.message, /rank 32, greater than the maximum LoRA rank 16/);
    // Nothing was evicted for it, and both adapters run without being loaded again.
    assert.deepEqual(await counters(), before);
    assert.equal((await complete('c')).status, 200);
    assert.equal((await complete('c-peft')).status, 200);
    assert.deepEqual(await counters(), before);
    assert.equal((await complete('big')).status, 404);
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

describe('LoRA adapters on simulated disaggregated workers', () => {
  it('loads them on the prefill and the decode workers, runs a request for one through both, and applies --max-lora-rank', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-lora-sim-disagg-'));
    let server: RunningServer | undefined;
    try {
      // A GGUF adapter of rank 32 on a small model: simulated workers read only its shape.
      const modelPath = join(dir, 'base.gguf');
      writeSyntheticModel({
        name: 'lora sim', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 256,
        dtype: 'F32', seed: 34, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
      }, modelPath);
      const bigPath = join(dir, 'big.gguf');
      writeGgufLoraAdapter(bigPath, (await loadModel(modelPath)).config, randomLoraAdapter((await loadModel(modelPath)).config, { rank: 32, seed: 4 }));
      const parsed = parseServeConfig(['--port', '0', '--log-level', 'silent', '--engine', 'sim', '--sim-speed-up', 'inf',
        '--prefill-workers', '1', '--decode-workers', '1', '--disagg-min-remote-prefill-tokens', '1',
        '--lora-modules', 'sql=/adapters/sql-lora', '--sim-lora-rank', '8'], { CONDUIT_MAX_LORA_RANK: '16' });
      if (parsed === 'help') throw new Error('unexpected --help');
      assert.equal(parsed.maxLoraRank, 16);
      server = await startServer(parsed, silentLogger);
      const url = server.url;
      const models = (await rawRequest(url, { path: '/v1/models' })).json().data;
      assert.deepEqual(models.map((m: { id: string; parent: string | null }) => m.id), ['Llama-3.1-8B', 'sql']);
      const prompt = 'SELECT name FROM users WHERE the account was opened before the end of last year';
      const res = await rawRequest(url, { path: '/v1/completions', body: { model: 'sql', prompt, max_tokens: 8, ignore_eos: true } });
      assert.equal(res.status, 200, res.text);
      assert.equal(res.json().model, 'sql');
      const trace = (await rawRequest(url, { path: `/v1/requests/${res.json().id}/trace` })).json();
      assert.equal(trace.lora_adapter, 'sql');
      const ranOn = (phase: string) => trace.phases.find((p: { phase: string }) => p.phase === phase)?.worker;
      assert.equal(ranOn('prefill_execution'), 'sim-prefill-0', 'the request was not prefilled on the prefill worker');
      assert.equal(ranOn('decode_execution'), 'sim-decode-0');
      // Both workers ran it, so both hold the adapter (a worker refuses a request for one it lacks); one resident
      // adapter for the model.
      assert.match((await rawRequest(url, { path: '/metrics' })).text, /conduit_lora_adapters_active\{model="Llama-3.1-8B"\} 1/);
      const big = await rawRequest(url, { path: '/v1/load_lora_adapter', body: { lora_name: 'big', lora_path: bigPath } });
      assert.equal(big.status, 400, big.text);
      assert.match(big.json().error.message, /'big' has rank 32, greater than the maximum LoRA rank 16/);
      assert.equal((await rawRequest(url, { path: '/v1/completions', body: { model: 'big', prompt: 'x', max_tokens: 1 } })).status, 404);
      assert.equal((await rawRequest(url, { path: '/v1/unload_lora_adapter', body: { lora_name: 'sql' } })).status, 200);
      assert.equal((await rawRequest(url, { path: '/v1/completions', body: { model: 'sql', prompt, max_tokens: 1 } })).status, 404);
      assert.equal((await rawRequest(url, { path: '/v1/completions', body: { model: 'Llama-3.1-8B', prompt, max_tokens: 2 } })).status, 200);
    } finally {
      await server?.api.shutdown(0);
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('refuses a --lora-modules adapter above --max-lora-rank at start', async () => {
    const parsed = parseServeConfig(['--port', '0', '--log-level', 'silent', '--engine', 'sim', '--sim-speed-up', 'inf',
      '--lora-modules', 'sql=/adapters/sql-lora', '--sim-lora-rank', '64', '--max-lora-rank', '32'], {});
    if (parsed === 'help') throw new Error('unexpected --help');
    await assert.rejects(startServer(parsed, silentLogger),
      (error: Error) => error instanceof UsageError && /--lora-modules sql=\/adapters\/sql-lora: .*rank 64, greater than the maximum LoRA rank 32/.test(error.message));
    assert.throws(() => parseServeConfig(['--max-lora-rank', '0'], {}), /--max-lora-rank must be a whole number > 0/);
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

  it('--lora-dtype (and CONDUIT_LORA_DTYPE) picks q8, bf16 or f32 adapter storage', () => {
    const config = (argv: string[], env: NodeJS.ProcessEnv = {}) => {
      const parsed = parseServeConfig(argv, env);
      assert.ok(parsed !== 'help');
      return parsed;
    };
    assert.equal(config([]).loraDtype, undefined);
    assert.equal(config(['--lora-dtype', 'bf16']).loraDtype, 'bf16');
    assert.equal(config([], { CONDUIT_LORA_DTYPE: 'f32' }).loraDtype, 'f32');
    assert.throws(() => config(['--lora-dtype', 'fp8']), /--lora-dtype must be one of f32, bf16, q8, got "fp8"/);
  });

  it('names the base model with NAME=PATH@BASE or vLLM\'s JSON form, also through the environment', () => {
    assert.deepEqual(parseLoraModules(['a=/x.gguf@second,b=/y', '{"name": "c", "path": "/z,1", "base_model_name": "first"}', '{"name":"d","path":"/w"}']), [
      { name: 'a', path: '/x.gguf', base: 'second' }, { name: 'b', path: '/y' }, { name: 'c', path: '/z,1', base: 'first' },
      { name: 'd', path: '/w' }]);
    assert.throws(() => parseLoraModules(['a=/x@']), UsageError);
    assert.throws(() => parseLoraModules(['{"name":"a"}']), /"path" must be a non-empty string/);
    assert.throws(() => parseLoraModules(['{"name":"a","path":"/x","base":"m"}']), /unknown field\(s\) base/);
    assert.throws(() => parseLoraModules(['{"name":"a",']), /not valid JSON/);
    const fromEnv = parseServeConfig([], { CONDUIT_LORA_MODULES: '{"name":"c","path":"/z","base_model_name":"m2"},a=/x@m1' });
    assert.ok(fromEnv !== 'help');
    assert.deepEqual(fromEnv.loraModules, [{ name: 'c', path: '/z', base: 'm2' }, { name: 'a', path: '/x', base: 'm1' }]);
  });
});

describe('LoRA adapters of the second of two models', () => {
  it('attaches each adapter to the model --lora-modules names, and refuses an unknown base', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-lora-two-'));
    let server: RunningServer | undefined;
    try {
      // Two bases of different widths: an adapter loads only onto the one it was made for.
      const paths: Record<string, string> = {};
      const configs: Record<string, ModelConfig> = {};
      for (const [name, dim, seed] of [['m1', 64, 41], ['m2', 48, 42]] as const) {
        paths[name] = join(dir, `${name}.gguf`);
        writeSyntheticModel({ name, dim, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 256,
          dtype: 'F32', seed, tokenizer: LLAMA_SPM_TOKENIZER_PATH }, paths[name]);
        configs[name] = (await loadModel(paths[name])).config;
      }
      const forM2 = join(dir, 'for-m2.gguf');
      writeGgufLoraAdapter(forM2, configs.m2!, randomLoraAdapter(configs.m2!, { rank: 4, seed: 5, bScale: 1 }));
      const forM1 = join(dir, 'for-m1.gguf');
      writeGgufLoraAdapter(forM1, configs.m1!, randomLoraAdapter(configs.m1!, { rank: 4, seed: 6, bScale: 1 }));
      const flags = (modules: string[]) => {
        const parsed = parseServeConfig(['--port', '0', '--log-level', 'silent', '--kv-cache-memory', '8MiB', '--threads', '1',
          '--model', `m1=${paths.m1}`, '--model', `m2=${paths.m2}`, ...modules.flatMap((m) => ['--lora-modules', m])], {});
        if (parsed === 'help') throw new Error('unexpected --help');
        return parsed;
      };
      await assert.rejects(startServer(flags([`x=${forM2}@m3`]), silentLogger), /base model "m3" is not served \(m1, m2\)/);
      // Without @m2 the adapter goes to the first model, whose shapes it does not fit.
      await assert.rejects(startServer(flags([`x=${forM2}`]), silentLogger), /another base model/);
      server = await startServer(flags([`a=${forM2}@m2`, JSON.stringify({ name: 'b', path: forM1, base_model_name: 'm1' })]), silentLogger);
      const models = (await rawRequest(server.url, { path: '/v1/models' })).json().data;
      assert.deepEqual(models.map((m: { id: string; parent: string | null }) => [m.id, m.parent]),
        [['m1', null], ['b', 'm1'], ['m2', null], ['a', 'm2']]);
      const complete = async (model: string) => {
        const res = await rawRequest(server!.url, {
          path: '/v1/completions', body: { model, prompt: 'Once upon a time', max_tokens: 8, temperature: 0, ignore_eos: true },
        });
        assert.equal(res.status, 200, res.text);
        return res.json().choices[0].text as string;
      };
      assert.notEqual(await complete('a'), await complete('m2'), 'adapter a changed nothing on m2');
      assert.notEqual(await complete('b'), await complete('m1'), 'adapter b changed nothing on m1');
    } finally {
      await server?.api.shutdown(0);
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('unloading an adapter while requests run with it', () => {
  it('lets them finish (as vLLM), refuses new ones with 404, and unloads it after them', { timeout: 60_000 }, async () => {
    // Simulated workers at real time (a few ms per decode step) keep a 64-token stream in flight long enough; the
    // adapter has no file (a synthetic one of --sim-lora-rank).
    const parsed = parseServeConfig(['--port', '0', '--log-level', 'silent', '--engine', 'sim', '--sim-speed-up', '1',
      '--lora-modules', 'sql=/adapters/sql-lora', '--sim-lora-rank', '8'], {});
    if (parsed === 'help') throw new Error('unexpected --help');
    const server = await startServer(parsed, silentLogger);
    try {
      const models = (await rawRequest(server.url, { path: '/v1/models' })).json().data;
      assert.deepEqual(models.map((m: { id: string; parent: string | null }) => [m.id, m.parent]), [['Llama-3.1-8B', null], ['sql', 'Llama-3.1-8B']]);
      assert.equal((await rawRequest(server.url, { path: '/v1/completions', body: { model: 'nope', prompt: 'x', max_tokens: 1 } })).status, 404);
      const metric = async () => Number(/conduit_lora_adapters_active\{model="Llama-3.1-8B"\} (\d+)/.exec((await rawRequest(server.url, { path: '/metrics' })).text)?.[1]);
      const res = await fetch(`${server.url}/v1/completions`, {
        method: 'POST', headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify({ model: 'sql', prompt: 'SELECT', max_tokens: 64, ignore_eos: true, stream: true }),
      });
      assert.equal(res.status, 200);
      let events = 0;
      let finish: string | null | undefined;
      let unloaded = false;
      await forEachStreamEvent(res, async (event) => {
        assert.equal(event.error, undefined, JSON.stringify(event.error));
        events++;
        finish = event.choices?.[0]?.finish_reason ?? finish;
        if (unloaded) return;
        unloaded = true;
        const removed = await rawRequest(server.url, { path: '/v1/unload_lora_adapter', body: { lora_name: 'sql' } });
        assert.equal(removed.status, 200, removed.text);
        assert.match(removed.text, /removed successfully\. Its 1 request\(s\) in flight finish with it/);
        const refused = await rawRequest(server.url, { path: '/v1/completions', body: { model: 'sql', prompt: 'x', max_tokens: 1 } });
        assert.equal(refused.status, 404);
        assert.equal(await metric(), 1, 'the adapter left the workers while its request ran');
      });
      assert.equal(finish, 'length');
      assert.ok(events >= 64, `the stream ended after ${events} events`);
      for (let polls = 0; (await metric()) !== 0; polls++) {
        assert.ok(polls < 200, 'the drained adapter was not unloaded after its request');
        await new Promise((resolve) => setTimeout(resolve, 25));
      }
      // The name is free again.
      const again = await rawRequest(server.url, { path: '/v1/load_lora_adapter', body: { lora_name: 'sql', lora_path: '/adapters/sql-lora' } });
      assert.equal(again.status, 200, again.text);
      const done = await rawRequest(server.url, { path: '/v1/completions', body: { model: 'sql', prompt: 'SELECT', max_tokens: 2 } });
      assert.equal(done.status, 200, done.text);
    } finally {
      await server.api.shutdown(0);
    }
  });
});
