// A request naming an adapter of the second of two served models is read with that model's sampling defaults (its
// folder's generation_config.json, --generation-config auto), as a request naming the model itself is: not with the
// first model's.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import OpenAI from 'openai';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { loadModel } from '../../src/model/loader.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../../src/model/lora-writer.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { silentLogger } from '../../src/util/log.ts';
import { archModel, writeArchHf } from '../model/arch-models.ts';

describe('an adapter of the second model', () => {
  it('takes the sampling defaults of its own base model', { timeout: 90_000 }, async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-lora-defaults-'));
    let server: RunningServer | undefined;
    try {
      const first = join(dir, 'first.gguf');
      writeSyntheticModel({ name: 'first', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 256,
        dtype: 'F32', seed: 41, tokenizer: LLAMA_SPM_TOKENIZER_PATH }, first);
      // The second is a Hugging Face folder whose generation_config.json makes greedy decoding the default.
      const second = join(dir, 'second');
      writeArchHf(archModel('mistral-swa'), second);
      writeFileSync(join(second, 'generation_config.json'), JSON.stringify({ temperature: 0 }));
      const adapter = join(dir, 'for-second.gguf');
      const config = (await loadModel(second)).config;
      writeGgufLoraAdapter(adapter, config, randomLoraAdapter(config, { rank: 4, seed: 5, bScale: 1 }));
      const parsed = parseServeConfig(['--port', '0', '--log-level', 'silent', '--kv-cache-memory', '8MiB', '--threads', '1',
        '--model', `first=${first}`, '--model', `second=${second}`, '--lora-modules', `tuned=${adapter}@second`], {});
      if (parsed === 'help') throw new Error('unexpected --help');
      server = await startServer(parsed, silentLogger);
      const client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
      const text = async (model: string, temperature?: number) => (await client.completions.create({
        model, prompt: 'Once upon a time', max_tokens: 8, seed: 7, ignore_eos: true,
        ...(temperature !== undefined ? { temperature } : {}),
      } as OpenAI.CompletionCreateParamsNonStreaming)).choices[0]!.text;
      // The base model's own default holds for it ...
      assert.equal(await text('second'), await text('second', 0), 'the model');
      // ... and for its adapter: greedy, as the same request with temperature 0 says.
      assert.equal(await text('tuned'), await text('tuned', 0), 'its adapter');
    } finally {
      await server?.api.shutdown(0);
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
