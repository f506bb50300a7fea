// Two loads of one adapter name at once, each for another served model: one is taken, the other refused as a name
// already loaded, as when they come one after the other. A name stands for one adapter of one model.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import type { ModelConfig } from '../../src/model/config.ts';
import { loadModel } from '../../src/model/loader.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../../src/model/lora-writer.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { silentLogger } from '../../src/util/log.ts';
import { rawRequest } from './http-client.ts';

describe('loading one adapter name for two models at once', () => {
  it('takes one and refuses the other', { timeout: 90_000 }, async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-lora-race-'));
    let server: RunningServer | undefined;
    try {
      // Two bases of the same shapes: one adapter file fits both.
      const paths: Record<string, string> = {};
      let config: ModelConfig | undefined;
      for (const [name, seed] of [['m1', 41], ['m2', 42]] as const) {
        paths[name] = join(dir, `${name}.gguf`);
        writeSyntheticModel({ name, dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 256,
          dtype: 'F32', seed, tokenizer: LLAMA_SPM_TOKENIZER_PATH }, paths[name]);
        config = (await loadModel(paths[name])).config;
      }
      const adapter = join(dir, 'adapter.gguf');
      writeGgufLoraAdapter(adapter, config!, randomLoraAdapter(config!, { rank: 4, seed: 5, bScale: 1 }));
      const parsed = parseServeConfig(['--port', '0', '--log-level', 'silent', '--kv-cache-memory', '8MiB', '--threads', '1',
        '--model', `m1=${paths.m1}`, '--model', `m2=${paths.m2}`], {});
      if (parsed === 'help') throw new Error('unexpected --help');
      server = await startServer(parsed, silentLogger);
      const load = (base: string) => rawRequest(server!.url, {
        path: '/v1/load_lora_adapter', body: { lora_name: 'tuned', lora_path: adapter, base_model_name: base },
      });
      const answers = await Promise.all([load('m1'), load('m2')]);
      assert.deepEqual(answers.map((a) => a.status).sort(), [200, 400], answers.map((a) => a.text).join('\n'));
      const refused = answers.find((a) => a.status === 400)!;
      assert.equal(refused.json().error.code, 'lora_name_taken');
      const models = (await rawRequest(server.url, { path: '/v1/models' })).json().data as { id: string }[];
      assert.deepEqual(models.filter((m) => m.id === 'tuned').length, 1);
      // Unloaded once, the name is gone.
      assert.equal((await rawRequest(server.url, { path: '/v1/unload_lora_adapter', body: { lora_name: 'tuned' } })).status, 200);
      const after = await rawRequest(server.url, { path: '/v1/completions', body: { model: 'tuned', prompt: 'x', max_tokens: 1 } });
      assert.equal(after.status, 404, after.text);
    } finally {
      await server?.api.shutdown(0);
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
