// LoRA adapters in the engine: adapter and base requests in one batch give the text each gives alone, on every
// backend (and the native kernel the reference's); a PEFT folder loads to the same weights as the GGUF adapter;
// adapter KV is never reused across adapters; bad adapter files are refused at load naming the problem.
import assert from 'node:assert/strict';
import { copyFileSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import type { BackendFactory } from '../../src/kernels/types.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { inspectLoraAdapter, loadLoraAdapter, LoraAdapterError, type LoraWeights } from '../../src/model/lora.ts';
import { randomLoraAdapter, writeGgufLoraAdapter, writePeftLoraAdapter } from '../../src/model/lora-writer.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';
import type { Tokenizer } from '../../src/model/tokenizer/types.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { engineBackends } from '../helpers/backends.ts';

let dir: string;
let loaded: LoadedModel;
let tokenizer: Tokenizer;
let ggufPath: string;
let peftPath: string;
let second: LoraWeights;

before(async () => {
  dir = mkdtempSync(join(tmpdir(), 'conduit-lora-engine-'));
  const modelPath = join(dir, 'model.gguf');
  writeSyntheticModel({
    name: 'lora-base', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 256,
    dtype: 'F32', seed: 21, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
  }, modelPath);
  loaded = await loadModel(modelPath);
  tokenizer = createTokenizer(loaded.tokenizerSource);
  const adapter = randomLoraAdapter(loaded.config, { rank: 4, seed: 5, alpha: 8, bScale: 1 });
  ggufPath = join(dir, 'a.gguf');
  peftPath = join(dir, 'a-peft');
  writeGgufLoraAdapter(ggufPath, loaded.config, adapter);
  writePeftLoraAdapter(peftPath, adapter);
  const other = join(dir, 'b.gguf');
  writeGgufLoraAdapter(other, loaded.config, randomLoraAdapter(loaded.config, { rank: 2, seed: 6, targets: ['wq', 'wv', 'wDown'], bScale: 1 }));
  second = loadLoraAdapter(other, loaded.config).weights;
});
after(() => rmSync(dir, { recursive: true, force: true }));

function makeCore(backend: BackendFactory): EngineCore {
  const runner = backend.load(loaded.config, loaded.weights, { numBlocks: 64, blockSize: 16, dtype: 'f32' }, { threads: 2 });
  let clock = 0;
  const core = new EngineCore({
    backend: runner, tokenizer, maxNumSeqs: 16, maxNumBatchedTokens: 256, maxModelLen: 256, now: () => clock++,
  });
  core.loadLora('a', loadLoraAdapter(ggufPath, loaded.config).weights);
  core.loadLora('b', second);
  return core;
}

function request(id: string, prompt: number[], lora?: string): EngineRequest {
  return {
    id, promptTokenIds: prompt, priority: 0, arrivalMs: 0, ...(lora !== undefined ? { lora } : {}),
    sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens: 16, ignoreEos: true },
  };
}

/** Runs the requests (added together, so they share steps) to the end: tokens and cached prompt tokens by id. */
function run(core: EngineCore, requests: EngineRequest[]): Map<string, { tokens: number[]; cached: number }> {
  const out = new Map<string, { tokens: number[]; cached: number }>();
  for (const r of requests) core.add(r);
  const record = (o: EngineOutput) => {
    const entry = out.get(o.requestId) ?? { tokens: [], cached: 0 };
    entry.tokens.push(...o.newTokenIds);
    entry.cached = o.usage.cachedTokens;
    out.set(o.requestId, entry);
  };
  for (let step = 0; core.hasWork; step++) {
    for (const o of core.step()) record(o);
    assert.ok(step < 10_000, 'engine did not finish');
  }
  return out;
}

const PROMPTS = {
  one: [1, 450, 4996, 17354, 1701, 432, 17204, 975],
  two: [1, 9038, 2501, 263, 931, 727, 471, 263, 2217, 7826],
};

for (const backend of engineBackends()) {
  describe(`LoRA in the engine (${backend.name} backend)`, () => {
    it('runs base and adapter requests in one batch with the tokens each gets alone', () => {
      const cases: [string, number[], string | undefined][] = [
        ['base-1', PROMPTS.one, undefined], ['a-1', PROMPTS.one, 'a'], ['b-2', PROMPTS.two, 'b'],
        ['a-2', PROMPTS.two, 'a'], ['base-2', PROMPTS.two, undefined],
      ];
      const alone = new Map<string, number[]>();
      for (const [id, prompt, lora] of cases) {
        // A fresh core each time: no prefix cache, no neighbours.
        alone.set(id, run(makeCore(backend), [request(id, prompt, lora)]).get(id)!.tokens);
      }
      const together = run(makeCore(backend), cases.map(([id, prompt, lora]) => request(id, prompt, lora)));
      for (const [id] of cases) assert.deepEqual(together.get(id)!.tokens, alone.get(id), `${id} differs in a mixed batch`);
      assert.notDeepEqual(alone.get('a-1'), alone.get('base-1'), 'the adapter changed nothing');
      assert.notDeepEqual(alone.get('b-2'), alone.get('a-2'), 'two adapters gave the same tokens');
    });

    it('never reuses KV across adapters or with the base model', () => {
      const core = makeCore(backend);
      const prompt = [...PROMPTS.two, ...PROMPTS.one, ...PROMPTS.two];
      assert.equal(run(core, [request('base', prompt)]).get('base')!.cached, 0);
      assert.equal(run(core, [request('a', prompt, 'a')]).get('a')!.cached, 0);
      assert.equal(run(core, [request('b', prompt, 'b')]).get('b')!.cached, 0);
      assert.ok(run(core, [request('a-again', prompt, 'a')]).get('a-again')!.cached >= 16, 'the same adapter reuses its own blocks');
    });

    it('refuses a request for an adapter it has not loaded, and unloading one in use', () => {
      const core = makeCore(backend);
      assert.throws(() => core.add(request('x', PROMPTS.one, 'nope')), { code: 'lora_not_loaded' });
      core.add(request('busy', PROMPTS.one, 'a'));
      assert.throws(() => core.unloadLora('a'), { code: 'lora_in_use' });
      while (core.hasWork) core.step();
      core.unloadLora('a');
      assert.throws(() => core.add(request('y', PROMPTS.one, 'a')), { code: 'lora_not_loaded' });
    });
  });
}

describe('LoRA adapter files', () => {
  it('a load\'s digest is that of the bytes it read, as inspect gives it: the same file the same, an overwritten one another', async () => {
    for (const path of [ggufPath, peftPath]) {
      assert.equal(loadLoraAdapter(path, loaded.config).digest, (await inspectLoraAdapter(path))!.digest, path);
    }
    const copy = join(dir, 'copy.gguf');
    copyFileSync(ggufPath, copy);
    const before = loadLoraAdapter(copy, loaded.config).digest;
    assert.equal(before, loadLoraAdapter(ggufPath, loaded.config).digest);
    writeGgufLoraAdapter(copy, loaded.config, randomLoraAdapter(loaded.config, { rank: 4, seed: 7, alpha: 8, bScale: 1 }));
    assert.notEqual(loadLoraAdapter(copy, loaded.config).digest, before);
    assert.equal(loadLoraAdapter(copy, loaded.config).digest, (await inspectLoraAdapter(copy))!.digest);
  });

  it('loads a PEFT folder to the same weights as the GGUF adapter (Q/K rows permuted for a llama GGUF base)', () => {
    const gguf = loadLoraAdapter(ggufPath, loaded.config);
    const peft = loadLoraAdapter(peftPath, loaded.config);
    assert.equal(gguf.format, 'gguf');
    assert.equal(peft.format, 'peft');
    assert.equal(gguf.weights.scale, 2);
    assert.equal(peft.weights.scale, 2);
    assert.deepEqual(peft.weights.layers, gguf.weights.layers);
  });

  it('refuses adapters for another base, another architecture, or files that are no adapter', () => {
    const smaller = { ...loaded.config, dim: 32, headDim: 8 };
    const wrongShape = join(dir, 'small.gguf');
    writeGgufLoraAdapter(wrongShape, smaller, randomLoraAdapter(smaller, { rank: 4, seed: 1 }));
    assert.throws(() => loadLoraAdapter(wrongShape, loaded.config), (error: Error) =>
      error instanceof LoraAdapterError && /attn_q\.weight has lora_a \[32, 4\].*needs lora_a \[64, r\].*another base model/.test(error.message));
    const qwen = join(dir, 'qwen.gguf');
    writeGgufLoraAdapter(qwen, loaded.config, randomLoraAdapter(loaded.config, { rank: 4, seed: 1 }), { architecture: 'qwen2' });
    assert.throws(() => loadLoraAdapter(qwen, loaded.config), /adapter for "qwen2", the base model is "llama"/);
    // The base model itself, passed by mistake: refused from its first bytes, as a model.
    assert.throws(() => loadLoraAdapter(loaded.path, loaded.config), /is a model \(a GGUF with (a block_count|general\.type "model")\), not a LoRA adapter/);
    assert.throws(() => loadLoraAdapter(join(dir, 'missing.gguf'), loaded.config), /does not exist/);
    assert.throws(() => loadLoraAdapter(dir, loaded.config), /without adapter_config\.json/);
    const deeper = { ...loaded.config, numLayers: 3 };
    const extraLayer = join(dir, 'deep.gguf');
    writeGgufLoraAdapter(extraLayer, deeper, randomLoraAdapter(deeper, { rank: 2, seed: 1 }));
    assert.throws(() => loadLoraAdapter(extraLayer, loaded.config), /layer 2, the base model has 2 layers/);
  });
});
