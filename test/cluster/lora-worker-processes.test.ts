// LoRA adapters on workers that are child processes (`serve --worker-processes`, aggregated and disaggregated): the
// adapters of --lora-modules and of POST /v1/load_lora_adapter reach every child over the request plane, a request
// naming one carries it to the child (and from the prefill child to the decode child), the children store the
// adapters as --lora-dtype says, and the text is the in-process server's. --max-lora-rank refuses a larger adapter
// there too, naming its rank and the limit.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import type { Logger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { loadModel } from '../../src/model/loader.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../../src/model/lora-writer.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { rawRequest } from '../api/http-client.ts';

describe('LoRA adapters on worker processes', () => {
  let dir: string;
  let modelPath: string;
  const paths: Record<string, string> = {};

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-lora-procs-'));
    modelPath = join(dir, 'base.gguf');
    writeSyntheticModel({
      name: 'lora procs', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 256,
      dtype: 'F32', seed: 33, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
    }, modelPath);
    const config = (await loadModel(modelPath)).config;
    for (const [name, rank, seed] of [['a', 4, 11], ['b', 4, 12], ['big', 32, 13]] as const) {
      paths[name] = join(dir, `${name}.gguf`);
      writeGgufLoraAdapter(paths[name], config, randomLoraAdapter(config, { rank, seed, bScale: 1 }));
    }
  });
  after(() => rmSync(dir, { recursive: true, force: true }));

  /**
   * Starts a server with the layout's flags, runs `a` and a runtime-loaded `b`; the texts and the startup log. With
   * fromEnvironment, `a` comes from CONDUIT_LORA_MODULES (set in this process, which the children inherit) instead of
   * the flag.
   */
  async function serve(layout: string[], fromEnvironment = false): Promise<{ a: string; b: string; log: string[] }> {
    const log: string[] = [];
    const logger: Logger = { debug: () => {}, info: (m) => log.push(m), warn: (m) => log.push(m), error: (m) => log.push(m) };
    const adapter = fromEnvironment ? [] : ['--lora-modules', `a=${paths.a}`];
    const env = fromEnvironment ? { CONDUIT_LORA_MODULES: `a=${paths.a}` } : {};
    const parsed = parseServeConfig(['--port', '0', '--log-level', 'info', '--no-request-log', '--kv-cache-memory', '8MiB',
      '--threads', '1', '--model', `base=${modelPath}`, ...adapter, '--lora-dtype', 'f32', ...layout], env);
    if (parsed === 'help') throw new Error('unexpected --help');
    let server: RunningServer | undefined;
    Object.assign(process.env, env);
    try {
      server = await startServer(parsed, logger);
      const url = server.url;
      const complete = async (model: string) => {
        const res = await rawRequest(url, {
          path: '/v1/completions',
          body: { model, prompt: 'Once upon a time there was a little dog', max_tokens: 12, temperature: 0, ignore_eos: true },
        });
        assert.equal(res.status, 200, `${model}: ${res.text}`);
        return res.json().choices[0].text as string;
      };
      const loaded = await rawRequest(url, { path: '/v1/load_lora_adapter', body: { lora_name: 'b', lora_path: paths.b } });
      assert.equal(loaded.status, 200, loaded.text);
      const big = await rawRequest(url, { path: '/v1/load_lora_adapter', body: { lora_name: 'big', lora_path: paths.big } });
      assert.equal(big.status, 400, big.text);
      assert.equal(big.json().error.code, 'invalid_lora_adapter');
      assert.match(big.json().error.message, /rank 32, greater than the maximum LoRA rank 16 \(--max-lora-rank\)/);
      assert.equal((await rawRequest(url, { path: '/v1/completions', body: { model: 'big', prompt: 'x', max_tokens: 1 } })).status, 404);
      const [a, b] = await Promise.all([complete('a'), complete('b')]);
      assert.notEqual(a, b, 'two adapters gave the same text');
      return { a, b, log };
    } finally {
      await server?.api.shutdown(0);
      for (const name of Object.keys(env)) delete process.env[name];
    }
  }

  it('gives the in-process text with the adapters stored as --lora-dtype in the children', { timeout: 180_000 }, async () => {
    const inProcess = await serve([]);
    const stored = (log: string[]) => log.find((line) => line.startsWith('LoRA adapter a '));
    assert.match(stored(inProcess.log) ?? '', /\(gguf, rank 4, stored as f32\)/);
    const children = await serve(['--workers', '2', '--worker-processes']);
    assert.match(stored(children.log) ?? '', /\(gguf, rank 4, stored as f32\)/, children.log.join('\n'));
    assert.deepEqual(children, { ...inProcess, log: children.log });
    const disaggregated = await serve(['--prefill-workers', '1', '--decode-workers', '1', '--worker-processes',
      '--disagg-min-remote-prefill-tokens', '1']);
    assert.match(stored(disaggregated.log) ?? '', /\(gguf, rank 4, stored as f32\)/, disaggregated.log.join('\n'));
    assert.deepEqual(disaggregated, { ...inProcess, log: disaggregated.log });
    // The adapters from the environment: the children inherit it, and leave the parent's option to the parent.
    const fromEnvironment = await serve(['--workers', '1', '--worker-processes'], true);
    assert.deepEqual(fromEnvironment, { ...inProcess, log: fromEnvironment.log });
  });
});
