// Records llama.cpp's greedy outputs for the architecture test models (test/model/arch-models.ts) into
// llama-cpp-greedy.json beside this script. Run from the repository root, with llama.cpp built by
// scripts/build-llama-cpp.sh:
//
//   node --import tsx test/data/arch/record-llama-cpp.ts [path/to/llama.cpp/build/bin]
//
// For each model: the GGUF is written to a temporary folder (its sha256 is recorded; the test writes it again and
// checks the bytes are the same), llama-server serves it on 127.0.0.1 with an f32 KV cache, and for each prompt we
// record the prompt's tokens (/tokenize with special tokens added as llama.cpp adds them) and the greedy completion
// (/completion, top_k 1, temperature 0): its token ids, text and why it stopped. For the models that carry a chat
// template (Gemma 3), llama-server runs with --jinja and /apply-template's rendering of a conversation is recorded,
// with its tokens (/tokenize, special tokens added and parsed).

import { spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { ARCH_CHAT, ARCH_MODELS, ARCH_NEW_TOKENS, ARCH_PROMPTS, vocabPath, writeArchGguf } from '../../model/arch-models.ts';

const here = dirname(fileURLToPath(import.meta.url));
const bin = resolve(process.argv[2] ?? '/work/main/benchmarks/peer/llama.cpp/build/bin');
const versionFile = join(bin, '..', '..', 'VERSION');
const PORT = 18431;

async function waitReady(): Promise<void> {
  for (let i = 0; i < 600; i++) {
    try {
      const r = await fetch(`http://127.0.0.1:${PORT}/health`);
      if (r.ok) return;
    } catch { /* not up yet */ }
    await new Promise((f) => setTimeout(f, 200));
  }
  throw new Error('llama-server did not become ready');
}

async function post(path: string, body: unknown): Promise<Record<string, unknown>> {
  const r = await fetch(`http://127.0.0.1:${PORT}${path}`, {
    method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
  });
  if (!r.ok) throw new Error(`${path}: ${r.status} ${await r.text()}`);
  return await r.json() as Record<string, unknown>;
}

const dir = mkdtempSync(join(tmpdir(), 'conduit-arch-record-'));
const models: Record<string, unknown> = {};
try {
  for (const spec of ARCH_MODELS) {
    if (!vocabPath(spec)) throw new Error(`${spec.name}: its vocabulary is not in ../shared/models`);
    const path = join(dir, `${spec.name}.gguf`);
    writeArchGguf(spec, path);
    const sha256 = createHash('sha256').update(readFileSync(path)).digest('hex');
    const withTemplate = spec.architecture === 'gemma3';
    const server = spawn(join(bin, 'llama-server'), ['-m', path, '--host', '127.0.0.1', '--port', String(PORT),
      '-c', String(spec.contextLength), '-np', '1', '-t', '2', '-ctk', 'f32', '-ctv', 'f32', '-fa', 'off',
      '--no-warmup', ...(withTemplate ? ['--jinja'] : [])], { stdio: ['ignore', 'ignore', 'pipe'] });
    let log = '';
    server.stderr.on('data', (d: Buffer) => { log += d.toString(); });
    try {
      await waitReady();
      const prompts = [];
      for (const prompt of ARCH_PROMPTS) {
        const promptTokens = (await post('/tokenize', { content: prompt, add_special: true })).tokens as number[];
        const completion = await post('/completion', {
          prompt, n_predict: ARCH_NEW_TOKENS, temperature: 0, top_k: 1, return_tokens: true, cache_prompt: false,
          seed: 0,
        });
        prompts.push({
          prompt, promptTokens, tokens: completion.tokens, content: completion.content,
          stopType: completion.stop_type,
        });
      }
      let chat: { messages: typeof ARCH_CHAT; prompt: string; promptTokens: number[] } | undefined;
      if (withTemplate) {
        const prompt = (await post('/apply-template', { messages: ARCH_CHAT })).prompt as string;
        const promptTokens = (await post('/tokenize', { content: prompt, add_special: true, parse_special: true })).tokens as number[];
        chat = { messages: ARCH_CHAT, prompt, promptTokens };
      }
      models[spec.name] = { sha256, prompts, ...(chat ? { chat } : {}) };
      console.log(`${spec.name}: ${prompts.map((p) => (p.tokens as number[]).length).join(', ')} tokens`);
    } catch (error) {
      console.error(log);
      throw error;
    } finally {
      server.kill('SIGTERM');
      await new Promise((f) => server.once('exit', f));
    }
  }
} finally {
  rmSync(dir, { recursive: true, force: true });
}
const llamaCpp = existsSync(versionFile) ? readFileSync(versionFile, 'utf8').trim() : 'unknown';
writeFileSync(join(here, 'llama-cpp-greedy.json'), JSON.stringify({
  llamaCpp, recordedWith: 'test/data/arch/record-llama-cpp.ts', newTokens: ARCH_NEW_TOKENS, models,
}, null, 1) + '\n');
