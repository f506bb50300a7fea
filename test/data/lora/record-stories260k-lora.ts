// Records llama.cpp's greedy output for stories260K with the random rank-4 adapter of test/helpers/stories-lora.ts,
// the reference of test/engine/lora-golden.test.ts. Run from the repository root:
//
//   node --import tsx test/data/lora/record-stories260k-lora.ts [LLAMA_CPP_BIN_DIR]
//
// (default bin dir: $LLAMA_CPP_BIN, else benchmarks/peer/llama.cpp/build/bin where scripts/build-llama-cpp.sh builds). It writes the adapter to a
// temporary folder, starts llama-server on 127.0.0.1 with --lora, asks /tokenize and /completion (temperature 0,
// top_k 1, no prompt cache) for each prompt, stops the server and writes stories260k-lora.expected.json here with
// the adapter's SHA-256 and llama.cpp's version.
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { loadModel } from '../../../src/model/loader.ts';
import { SHARED_MODELS_DIR } from '../../helpers/shared-models.ts';
import { STORIES_LORA, writeStoriesLora } from '../../helpers/stories-lora.ts';

const here = dirname(fileURLToPath(import.meta.url));
const binDir = resolve(process.argv[2] ?? process.env.LLAMA_CPP_BIN ?? join(here, '../../../benchmarks/peer/llama.cpp/build/bin'));
const versionFile = join(binDir, '../../VERSION');
const modelPath = join(SHARED_MODELS_DIR, 'stories260K.gguf');
const PROMPTS = ['Once upon a time', 'The little dog', 'Lily and Tom went to the park. They'];
const N_PREDICT = 32;
const PORT = 18000 + (process.pid % 1000);

async function main(): Promise<void> {
  const dir = mkdtempSync(join(tmpdir(), 'conduit-record-lora-'));
  const adapterPath = join(dir, 'stories260K-lora-r4.gguf');
  const { config } = await loadModel(modelPath);
  const sha256 = writeStoriesLora(adapterPath, config);
  const server = spawn(join(binDir, 'llama-server'), ['-m', modelPath, '--lora', adapterPath, '--host', '127.0.0.1',
    '--port', String(PORT), '-t', '1', '-c', '512', '-np', '1', '--no-warmup'], { stdio: ['ignore', 'ignore', 'pipe'] });
  let log = '';
  server.stderr.on('data', (chunk: Buffer) => { log += chunk.toString(); });
  const url = `http://127.0.0.1:${PORT}`;
  try {
    for (let attempt = 0; ; attempt++) {
      if (attempt > 300) throw new Error(`llama-server did not come up:\n${log}`);
      try {
        if ((await fetch(`${url}/health`)).ok) break;
      } catch { /* not listening yet */ }
      await new Promise((r) => setTimeout(r, 100));
    }
    const post = async (path: string, body: object) => (await fetch(`${url}${path}`, {
      method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body),
    })).json() as Promise<Record<string, unknown>>;
    const cases = [];
    for (const prompt of PROMPTS) {
      const promptTokens = (await post('/tokenize', { content: prompt, add_special: true })).tokens as number[];
      const completion = await post('/completion', {
        prompt: promptTokens, n_predict: N_PREDICT, temperature: 0, top_k: 1, cache_prompt: false, return_tokens: true,
        ignore_eos: true, samplers: ['top_k'],
      });
      cases.push({ prompt, prompt_tokens: promptTokens, greedy_tokens: completion.tokens, text: completion.content });
    }
    const out = {
      model: 'stories260K.gguf',
      adapter: { ...STORIES_LORA, format: 'gguf', sha256, writer: 'test/helpers/stories-lora.ts (src/model/lora-writer.ts)' },
      engine: `${existsSync(versionFile) ? readFileSync(versionFile, 'utf8').trim() : 'llama.cpp (version unknown)'}; llama-server --lora, greedy (temperature 0, top_k 1), ${N_PREDICT} new tokens, EOS ignored`,
      script: 'test/data/lora/record-stories260k-lora.ts',
      cases,
    };
    // Token arrays on one line each.
    const text = JSON.stringify(out, null, 1).replace(/\[\s*([\d,\s]+?)\s*\]/g, (_, list: string) => `[${list.split(/,\s*/).join(', ')}]`);
    writeFileSync(join(here, 'stories260k-lora.expected.json'), `${text}\n`);
    console.log(`wrote ${cases.length} cases`);
  } finally {
    server.kill('SIGTERM');
    rmSync(dir, { recursive: true, force: true });
  }
}

await main();
