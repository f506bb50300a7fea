import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { createHash } from 'node:crypto';
import { copyFileSync, existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { Template } from '@huggingface/jinja';
import { GgmlType } from '../../src/model/ggml-types.ts';
import { GgufValueType, metaString, readGguf } from '../../src/model/gguf.ts';
import { loadModel } from '../../src/model/loader.ts';
import { dequantizeTensor } from '../../src/model/quant.ts';
import {
  BUILTIN_MODEL_NAME, BUILTIN_MODEL_SPEC, ensureBuiltinModel, ensureSyntheticModel, LLAMA2_CHAT_TEMPLATE, LLAMA_SPM_TOKENIZER_PATH,
  SeededRandom, storedSpecHash, SYNTHETIC_110M_Q8_0, syntheticSpec, syntheticSpecHash, writeSyntheticModel,
} from '../../src/model/synthetic.ts';
import type { SyntheticModelSpec } from '../../src/model/synthetic.ts';
import { ReferenceModel } from '../../src/model/reference-forward.ts';

let dir: string;
before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-synthetic-')); });
after(() => rmSync(dir, { recursive: true, force: true }));

const small: SyntheticModelSpec = {
  name: 'tiny-synthetic', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 128,
  dtype: 'Q8_0', seed: 5, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
};

const repoRoot = fileURLToPath(new URL('../../', import.meta.url));
const sha256 = (path: string): string => createHash('sha256').update(readFileSync(path)).digest('hex');

// ---------------------------------------------------------------------------------------------------------------
describe('SeededRandom', () => {
  it('matches an independent xoshiro128** (splitmix32-seeded) implementation', () => {
    // Values from a separate Python implementation of the same two published algorithms.
    const one = new SeededRandom(1);
    assert.deepEqual([1, 2, 3, 4].map(() => one.nextUint32()), [2442144158, 3238099751, 3819917871, 2104621829]);
    const other = new SeededRandom(42);
    assert.deepEqual([1, 2, 3].map(() => other.nextUint32()), [2837322924, 544945897, 479756282]);
  });

  it('draws normals with mean 0 and variance 1', () => {
    const values = new SeededRandom(9).fillNormal(new Float32Array(100_000), 1);
    const mean = values.reduce((a, b) => a + b, 0) / values.length;
    const variance = values.reduce((a, b) => a + (b - mean) ** 2, 0) / values.length;
    assert.ok(Math.abs(mean) < 0.02, `mean ${mean}`);
    assert.ok(Math.abs(variance - 1) < 0.02, `variance ${variance}`);
  });
});

// ---------------------------------------------------------------------------------------------------------------
describe('writeSyntheticModel', () => {
  it('is byte-identical for the same spec and differs for another seed', () => {
    const [a, b, c] = ['a', 'b', 'c'].map((n) => join(dir, `${n}.gguf`));
    writeSyntheticModel(small, a!);
    writeSyntheticModel(small, b!);
    writeSyntheticModel({ ...small, seed: 6 }, c!);
    assert.equal(sha256(a!), sha256(b!));
    assert.notEqual(sha256(a!), sha256(c!));
  });

  it('writes a loadable Llama model with the tokenizer metadata and the spec it was made from', async () => {
    const path = join(dir, 'loadable.gguf');
    writeSyntheticModel({ ...small, chatTemplate: '{{ messages }}' }, path);
    const model = await loadModel(path);
    assert.deepEqual(
      { ...model.config },
      { architecture: 'llama', name: 'tiny-synthetic', vocabSize: 32000, dim: 64, numLayers: 2, numHeads: 4,
        numKvHeads: 2, headDim: 16, ffnDim: 96, contextLength: 128, rmsNormEps: 1e-5, ropeTheta: 10000, ropeDim: 16,
        ropeStyle: 'interleaved', qkvBias: false, tiedEmbeddings: true });
    assert.equal(model.chatTemplate, '{{ messages }}');
    const file = readGguf(path);
    const vocab = readGguf(LLAMA_SPM_TOKENIZER_PATH);
    for (const key of ['tokenizer.ggml.tokens', 'tokenizer.ggml.scores', 'tokenizer.ggml.token_type', 'tokenizer.ggml.bos_token_id']) {
      assert.deepEqual(file.metadata.get(key), vocab.metadata.get(key), key);
      assert.deepEqual(file.metadataTypes.get(key), vocab.metadataTypes.get(key), `${key} type`);
    }
    assert.equal(metaString(file, 'conduit.synthetic.spec_hash'), syntheticSpecHash({ ...small, chatTemplate: '{{ messages }}' }));
    // Norms are ones; projections have the intended spread (std 1/sqrt(fan_in) = 0.125 for wq).
    assert.ok(dequantizeTensor(model.weights.layers[0]!.attnNorm).every((v) => v === 1));
    const wq = dequantizeTensor(model.weights.layers[0]!.wq);
    const std = Math.sqrt(wq.reduce((a, v) => a + v * v, 0) / wq.length);
    assert.ok(Math.abs(std - 0.125) < 0.01, `wq std ${std}`);
  });

  it('stores float hyperparameters as FLOAT32 even when their value is integral, as llama.cpp requires', () => {
    // llama.cpp refuses "key llama.rope.freq_base has wrong type u32 but expected type f32".
    for (const [label, spec] of [['defaults', small], ['integral epsilon', { ...small, ropeTheta: 500000, rmsNormEps: 1 }]] as const) {
      const path = join(dir, `float-keys-${label.replace(' ', '-')}.gguf`);
      writeSyntheticModel(spec, path);
      const file = readGguf(path);
      for (const [key, expected] of [
        ['llama.rope.freq_base', spec.ropeTheta ?? 10000],
        ['llama.attention.layer_norm_rms_epsilon', spec.rmsNormEps ?? 1e-5],
      ] as const) {
        assert.equal(file.metadataTypes.get(key)?.type, GgufValueType.FLOAT32, `${label}: ${key} type`);
        assert.equal(file.metadata.get(key), Math.fround(expected), `${label}: ${key} value`);
      }
      // Integer hyperparameters stay integers.
      assert.equal(file.metadataTypes.get('llama.context_length')?.type, GgufValueType.UINT32);
    }
  });

  it('falls back to Q8_0 for K-quant rows that are not whole 256-element blocks', () => {
    const path = join(dir, 'q4k.gguf');
    writeSyntheticModel({ ...small, dim: 256, ffnDim: 384, numHeads: 4, dtype: 'Q4_K' }, path);
    const file = readGguf(path);
    assert.equal(file.tensor('blk.0.attn_q.weight').type, GgmlType.Q4_K);
    assert.equal(file.tensor('blk.0.ffn_down.weight').type, GgmlType.Q8_0, 'rows of 384 do not hold whole Q4_K blocks');
  });

  it('rejects inconsistent specs and unknown names', () => {
    assert.throws(() => writeSyntheticModel({ ...small, numKvHeads: 3 }, join(dir, 'x.gguf')), /not a multiple of numKvHeads 3/);
    assert.throws(() => syntheticSpec('nope'), /unknown synthetic model "nope"/);
    assert.throws(() => syntheticSpec(BUILTIN_MODEL_NAME, 'Q3_K'), /unknown dtype "Q3_K"/);
    assert.equal(syntheticSpec('synthetic-110m', 'Q8_0').dtype, SYNTHETIC_110M_Q8_0.dtype);
  });
});

// ---------------------------------------------------------------------------------------------------------------
describe('model cache', () => {
  it('writes once, reuses the file, and regenerates a file made from another spec', async () => {
    const cache = join(dir, 'cache');
    const path = await ensureSyntheticModel(small, cache);
    const first = statSync(path);
    assert.equal(await ensureSyntheticModel(small, cache), path);
    assert.equal(statSync(path).mtimeMs, first.mtimeMs, 'reused, not rewritten');
    assert.deepEqual(readdirSync(cache), [`${small.name}-Q8_0.gguf`], 'no temporary files left behind');

    // A stale file (here: another seed's model under this name) is replaced.
    writeSyntheticModel({ ...small, seed: 99 }, path);
    assert.notEqual(storedSpecHash(path), syntheticSpecHash(small));
    await ensureSyntheticModel(small, cache);
    assert.equal(storedSpecHash(path), syntheticSpecHash(small));
  });

  it('copes with two processes generating the same model at once', async () => {
    const cache = join(dir, 'concurrent');
    const moduleUrl = new URL('../../src/model/synthetic.ts', import.meta.url).href;
    const script = `const m = await import(${JSON.stringify(moduleUrl)});` +
      `process.stdout.write(await m.ensureSyntheticModel(${JSON.stringify(small)}, ${JSON.stringify(cache)}));`;
    const run = (): Promise<string> => new Promise((resolve, reject) => {
      execFile(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script], { cwd: repoRoot },
        (error, stdout) => (error ? reject(error) : resolve(stdout)));
    });
    const [first, second] = await Promise.all([run(), run()]);
    assert.equal(first, second);
    assert.equal(storedSpecHash(first), syntheticSpecHash(small));
    assert.deepEqual(readdirSync(cache), [`${small.name}-Q8_0.gguf`]);
  });

  it('hashes the tokenizer file content, not its path', () => {
    const copy = join(dir, 'copy-of-vocab.gguf');
    copyFileSync(LLAMA_SPM_TOKENIZER_PATH, copy);
    assert.equal(syntheticSpecHash({ ...small, tokenizer: copy }), syntheticSpecHash(small));
    assert.notEqual(syntheticSpecHash({ ...small, dim: 128 }), syntheticSpecHash(small));
  });
});

describe('the built-in model', () => {
  it('ships its vocabulary as assets/tokenizers/llama-spm.gguf with the documented sha256', () => {
    assert.equal(sha256(LLAMA_SPM_TOKENIZER_PATH), '16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69');
    const readme = readFileSync(join(LLAMA_SPM_TOKENIZER_PATH, '..', 'README.md'), 'utf8');
    assert.match(readme, /16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69/);
  });

  it('has a Llama 2 style chat template', () => {
    const template = new Template(LLAMA2_CHAT_TEMPLATE);
    const specials = { bos_token: '<s>', eos_token: '</s>' };
    const rendered = template.render({ ...specials, messages: [
      { role: 'system', content: 'Be brief.' }, { role: 'user', content: ' Hi ' },
      { role: 'assistant', content: 'Hello!' }, { role: 'user', content: 'Bye' },
    ] });
    assert.equal(rendered, '<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Bye [/INST]');
    assert.equal(template.render({ ...specials, messages: [{ role: 'user', content: 'Hi' }] }), '<s>[INST] Hi [/INST]');
    assert.throws(() => template.render({ ...specials, messages: [{ role: 'tool', content: 'x' }] }), /roles must be/);
  });

  it('is about 22M parameters of Q8_0 with the Llama 2 vocabulary, and greedy decoding does not loop on one token', async () => {
    const cache = join(dir, 'builtin');
    const path = await ensureBuiltinModel(cache);
    assert.ok(existsSync(path));
    const model = await loadModel(path);
    assert.equal(model.config.name, BUILTIN_MODEL_NAME);
    assert.equal(model.config.vocabSize, 32000);
    assert.equal(model.config.dim, BUILTIN_MODEL_SPEC.dim);
    assert.ok(model.metadata.parameterCount > 21e6 && model.metadata.parameterCount < 23e6, `${model.metadata.parameterCount}`);
    assert.ok(model.metadata.parametersByType['Q8_0']! > 21e6);
    assert.match(model.chatTemplate ?? '', /\[INST\]/);

    const reference = new ReferenceModel(model.config, model.weights);
    const tokens = [1, 9038, 2501, 263, 931]; // "<s> Once upon a time" in the Llama 2 vocabulary
    let logits = reference.forward(tokens, 0);
    const generated: number[] = [];
    for (let i = 0; i < 12; i++) {
      const next = logits.indexOf(Math.max(...logits));
      generated.push(next);
      logits = reference.forward([next], tokens.length + i);
    }
    assert.ok(new Set(generated).size >= 6, `greedy tokens ${generated}`);
  });
});
