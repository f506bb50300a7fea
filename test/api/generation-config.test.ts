// A model folder's generation_config.json, as vLLM applies it (--generation-config auto): its sampling fields are the
// defaults of requests that leave them out (a request's own value wins), max_new_tokens caps max_tokens, and its
// eos_token_id list ends generation (reported as the stop_reason). `--generation-config vllm` applies none; a folder
// names another file; a bad file is refused at start. Against the real server.

import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { silentLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { UsageError } from '../../src/cli/flags.ts';
import { readGenerationConfig } from '../../src/model/generation-config.ts';
import { ModelFormatError } from '../../src/model/gguf-model.ts';
import { archModel, skipUnlessVocabFor, writeArchHf } from '../model/arch-models.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 90_000 };
/** "\n" in the Llama 2 vocabulary (its byte token <0x0A>). */
const NEWLINE = 13;

async function serve(flags: string[]): Promise<RunningServer> {
  const config = parseServeConfig(['--port', '0', '--log-level', 'silent', '--kv-cache-memory', '8MiB', '--threads', '1',
    '--worker-restart-limit', '0', ...flags], {});
  if (config === 'help') throw new Error('unexpected --help');
  return startServer(config, silentLogger);
}

async function complete(server: RunningServer, body: object): Promise<{ text: string; tokens: number; finish: string; stop: unknown }> {
  const res = await rawRequest(server.url, { path: '/v1/completions', body: { prompt: 'Once upon a time', ...body } });
  assert.equal(res.status, 200, res.text);
  const json = res.json();
  return { text: json.choices[0].text, tokens: json.usage.completion_tokens, finish: json.choices[0].finish_reason, stop: json.choices[0].stop_reason };
}

describe('readGenerationConfig', () => {
  const dir = mkdtempSync(join(tmpdir(), 'conduit-generation-config-'));
  after(() => rmSync(dir, { recursive: true, force: true }));
  const write = (name: string, json: unknown): string => {
    const folder = join(dir, name);
    mkdirSync(folder, { recursive: true });
    writeFileSync(join(folder, 'generation_config.json'), typeof json === 'string' ? json : JSON.stringify(json));
    return folder;
  };

  it('reads the sampling fields, max_new_tokens and eos_token_id (a number or a list), and nothing else', async () => {
    assert.deepEqual(await readGenerationConfig(write('llama', {
      bos_token_id: 128000, do_sample: true, eos_token_id: [128001, 128008, 128009], temperature: 0.6, top_p: 0.9,
      transformers_version: '4.45.0',
    })), { temperature: 0.6, topP: 0.9, eosTokenIds: [128001, 128008, 128009] });
    assert.deepEqual(await readGenerationConfig(write('qwen', {
      eos_token_id: 151645, repetition_penalty: 1.05, temperature: 0.7, top_k: 20, top_p: 0.8, min_p: 0, max_new_tokens: 2048,
    })), { temperature: 0.7, topP: 0.8, topK: 20, minP: 0, repetitionPenalty: 1.05, maxTokens: 2048, eosTokenIds: [151645] });
    assert.deepEqual(await readGenerationConfig(write('top-k-off', { top_k: -1 })), { topK: 0 });
    assert.equal(await readGenerationConfig(join(dir, 'missing')), undefined);
  });

  it('without generation_config.json, takes them from config.json as vLLM does (less the transformers defaults)', async () => {
    const folder = join(dir, 'config-only');
    mkdirSync(folder, { recursive: true });
    writeFileSync(join(folder, 'config.json'), JSON.stringify({
      architectures: ['LlamaForCausalLM'], bos_token_id: 128000, eos_token_id: [128001, 128008, 128009], hidden_size: 4096,
      temperature: 1, top_k: 50, top_p: 0.95,
    }));
    assert.deepEqual(await readGenerationConfig(folder), { topP: 0.95, eosTokenIds: [128001, 128008, 128009] });
    // The file wins when both are there.
    writeFileSync(join(folder, 'generation_config.json'), JSON.stringify({ eos_token_id: 128009 }));
    assert.deepEqual(await readGenerationConfig(folder), { eosTokenIds: [128009] });
    const bad = join(dir, 'config-only-bad');
    mkdirSync(bad, { recursive: true });
    writeFileSync(join(bad, 'config.json'), JSON.stringify({ eos_token_id: 'x' }));
    await assert.rejects(readGenerationConfig(bad), /config\.json: eos_token_id must be a token id or a list of them, got "x"/);
  });

  it('refuses values a request could not give, and a file that is not a JSON object', async () => {
    const bad: [string, unknown, RegExp][] = [
      ['temperature', { temperature: -1 }, /temperature must be a number in \[0, 2\], got -1/],
      ['top_p', { top_p: 0 }, /top_p must be a number in \(0, 1\]/],
      ['top_k', { top_k: 2.5 }, /top_k must be a whole number >= -1/],
      ['repetition_penalty', { repetition_penalty: '1.1' }, /repetition_penalty must be a finite number > 0/],
      // JSON's 1e309 parses as Infinity, which no request may give (and the sampler refuses).
      ['repetition_penalty-infinite', '{"repetition_penalty": 1e309}', /repetition_penalty must be a finite number > 0, got Infinity/],
      ['max_new_tokens', { max_new_tokens: 0 }, /max_new_tokens must be a whole number >= 1/],
      ['eos_token_id', { eos_token_id: [2, -1] }, /eos_token_id must be a token id or a list of them/],
      ['array', [1, 2], /not a JSON object/],
      ['text', '{"temperature": ', /not JSON/],
    ];
    for (const [name, json, pattern] of bad) {
      await assert.rejects(readGenerationConfig(write(`bad-${name}`, json)), (error: unknown) =>
        error instanceof ModelFormatError && pattern.test(error.message), name);
    }
  });
});

describe('--generation-config on the server', () => {
  let dir: string;
  let folderDefaults: RunningServer;
  let none: RunningServer;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-generation-config-serve-'));
    const folder = join(dir, 'defaults');
    mkdirSync(folder);
    // Greedy by default, at most 5 tokens, and the newline ends generation.
    writeFileSync(join(folder, 'generation_config.json'), JSON.stringify({ temperature: 0, max_new_tokens: 5, eos_token_id: [2, NEWLINE] }));
    folderDefaults = await serve(['--generation-config', folder]);
    none = await serve(['--generation-config', 'vllm']);
  });
  after(async () => {
    await folderDefaults?.api.shutdown(0);
    await none?.api.shutdown(0);
    rmSync(dir, { recursive: true, force: true });
  });

  it('a request without temperature gets the file\'s (greedy here); one with its own keeps it', E2E, async () => {
    const greedy = await complete(folderDefaults, { max_tokens: 4, ignore_eos: true, temperature: 0 });
    assert.deepEqual(await complete(folderDefaults, { max_tokens: 4, ignore_eos: true }), greedy);
    // A seeded draw at temperature 1 is what the server without defaults gives for the same seed.
    const seeded = { max_tokens: 4, ignore_eos: true, temperature: 1, seed: 11 };
    assert.deepEqual(await complete(folderDefaults, seeded), await complete(none, seeded));
  });

  it('max_new_tokens caps max_tokens, given or not', E2E, async () => {
    assert.equal((await complete(folderDefaults, { max_tokens: 12, ignore_eos: true })).tokens, 5);
    assert.equal((await complete(folderDefaults, { ignore_eos: true })).tokens, 5, 'completions\' default of 16, capped');
    assert.equal((await complete(none, { max_tokens: 12, ignore_eos: true })).tokens, 12);
  });

  it('its eos_token_id ends generation with that id as the stop_reason (not under ignore_eos)', E2E, async () => {
    assert.deepEqual(await complete(folderDefaults, { logit_bias: { [NEWLINE]: 100 } }),
      { text: '', tokens: 1, finish: 'stop', stop: NEWLINE });
    assert.equal((await complete(folderDefaults, { logit_bias: { [NEWLINE]: 100 }, ignore_eos: true })).tokens, 5);
    assert.equal((await complete(none, { logit_bias: { [NEWLINE]: 100 }, max_tokens: 3 })).tokens, 3, 'no such stop without the file');
  });

  it('an eos_token_id outside the model\'s vocabulary stops the start (every request would be refused for it)', E2E, async () => {
    const folder = join(dir, 'outside');
    mkdirSync(folder);
    writeFileSync(join(folder, 'generation_config.json'), JSON.stringify({ eos_token_id: [2, 32000, 40000] }));
    const started = await serve(['--generation-config', folder]).catch((error: unknown) => error);
    if (!(started instanceof Error)) await (started as RunningServer).api.shutdown(0);
    assert.ok(started instanceof ModelFormatError, `the start fails, got ${String(started)}`);
    assert.match(started.message, /generation_config\.json: eos_token_id 32000, 40000 are not in the model's vocabulary of 32000 tokens$/);
  });

  it('a folder without the file is a usage error', () => {
    assert.throws(() => parseServeConfig(['--generation-config', dir], {}), (error: unknown) =>
      error instanceof UsageError && /holding generation_config\.json/.test(error.message));
  });
});

describe('--generation-config auto reads the model folder\'s own file', () => {
  const spec = archModel('qwen3-tied');
  let dir: string;

  it('a Hugging Face folder with generation_config.json: its max_new_tokens holds; vllm ignores it', { ...E2E, skip: skipUnlessVocabFor(spec) }, async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-generation-config-auto-'));
    try {
      const folder = join(dir, 'hf');
      writeArchHf(spec, folder);
      writeFileSync(join(folder, 'generation_config.json'), JSON.stringify({ max_new_tokens: 3 }));
      for (const [option, expected] of [['auto', 3], ['vllm', 6]] as const) {
        const server = await serve(['--model', folder, '--generation-config', option]);
        try {
          assert.equal((await complete(server, { max_tokens: 6, ignore_eos: true })).tokens, expected, option);
        } finally {
          await server.api.shutdown(0);
        }
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
