import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { GgmlType } from '../../src/model/ggml-types.ts';
import { readGguf } from '../../src/model/gguf.ts';
import {
  ggufModelConfig, llama3FreqFactors, llama3ScalingFromFreqFactors, ModelFormatError,
} from '../../src/model/gguf-model.ts';
import { loadModel } from '../../src/model/loader.ts';
import { dequantizeTensor, quantize } from '../../src/model/quant.ts';
import { sharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { makeTinyModel, TINY_DIMS, writeTinyGguf } from './loader-fixtures.ts';

let dir: string;
before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-loader-')); });
after(() => rmSync(dir, { recursive: true, force: true }));

let counter = 0;
const tempPath = (): string => join(dir, `model-${counter++}.gguf`);

// ---------------------------------------------------------------------------------------------------------------
describe('stories260K', { skip: skipUnlessShared('stories260K.gguf') }, () => {
  it('loads with the config its README states', async () => {
    const model = await loadModel(sharedModel('stories260K.gguf')!);
    assert.equal(model.source, 'gguf');
    assert.deepEqual({ ...model.config, name: undefined }, {
      architecture: 'llama', name: undefined, vocabSize: 512, dim: 64, numLayers: 5, numHeads: 8, numKvHeads: 4,
      headDim: 8, ffnDim: 172, contextLength: 2048, rmsNormEps: 1e-5, ropeTheta: 10000, ropeDim: 8,
      ropeStyle: 'interleaved', qkvBias: false, tiedEmbeddings: false,
    });
    assert.equal(model.metadata.parameterCount, 292_800);
    assert.deepEqual(model.metadata.parametersByType, { F32: 292_800 });
    assert.equal(model.tokenizerSource.kind, 'gguf');
    assert.equal(model.chatTemplate, undefined);
  });

  it('has a separate output matrix whose values equal the embeddings', async () => {
    const { weights } = await loadModel(sharedModel('stories260K.gguf')!);
    assert.notEqual(weights.output, weights.tokenEmbedding);
    assert.equal(weights.output.name, 'output.weight');
    assert.deepEqual(dequantizeTensor(weights.output), dequantizeTensor(weights.tokenEmbedding));
    assert.equal(weights.layers.length, 5);
    assert.deepEqual(weights.layers[4]!.wk.shape, [64, 32]);
    assert.deepEqual(weights.layers[4]!.wDown.shape, [172, 64]);
  });
});

describe('vocabulary-only GGUFs', () => {
  for (const name of ['ggml-vocab-llama-spm.gguf', 'ggml-vocab-qwen2.gguf']) {
    it(`${name}: metadata gives a config, loading it as a model is a clear error`, { skip: skipUnlessShared(name) }, async () => {
      const path = sharedModel(name)!;
      const config = ggufModelConfig(readGguf(path), path);
      await assert.rejects(loadModel(path), (e: Error) => e instanceof ModelFormatError && /has no tensors/.test(e.message));
      if (name.includes('qwen2')) {
        assert.equal(config.architecture, 'qwen2');
        assert.equal(config.ropeStyle, 'neox');
        assert.equal(config.ropeTheta, 1_000_000);
        assert.equal(config.vocabSize, 151_936);
        assert.equal(config.rmsNormEps, 1e-6);
      } else {
        assert.equal(config.vocabSize, 32_000);
        assert.equal(config.headDim, 128);
      }
    });
  }
});

// ---------------------------------------------------------------------------------------------------------------
describe('GGUF models written here', () => {
  it('loads a tied qwen2 model with Q/K/V biases, quantized weights and a chat template', async () => {
    const model = makeTinyModel({ ...TINY_DIMS, dim: 64, ffnDim: 96 }, { architecture: 'qwen2', tied: true });
    const path = tempPath();
    writeTinyGguf(path, model, { type: GgmlType.Q8_0, extraMetadata: [['tokenizer.chat_template', '{{ x }}']] });
    const loaded = await loadModel(path);
    assert.equal(loaded.config.architecture, 'qwen2');
    assert.equal(loaded.config.qkvBias, true);
    assert.equal(loaded.config.tiedEmbeddings, true);
    assert.equal(loaded.weights.output, loaded.weights.tokenEmbedding);
    assert.equal(loaded.chatTemplate, '{{ x }}');
    const bias = loaded.weights.layers[1]!.bk!;
    assert.deepEqual(dequantizeTensor(bias), model.tensors.get('blk.1.attn_k.bias')!.values);
    assert.equal(loaded.weights.layers[0]!.wq.type, GgmlType.Q8_0);
    assert.deepEqual(loaded.metadata.parametersByType, {
      Q8_0: 48 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96),
      F32: 64 + 2 * (2 * 64 + 64 + 2 * 32),
    });
  });

  it('names an unsupported architecture', async () => {
    const path = tempPath();
    writeTinyGguf(path, makeTinyModel(), { metadata: { 'general.architecture': 'gpt2' } });
    await assert.rejects(loadModel(path), /architecture "gpt2" is not supported \(supported: llama, qwen2, qwen3, qwen3moe, phi3, gemma3\)/);
  });

  it('names the tensor whose type cannot be computed with', async () => {
    const path = tempPath();
    const dims = { ...TINY_DIMS, dim: 256 };
    writeTinyGguf(path, makeTinyModel(dims), {
      tensors: { 'blk.1.ffn_up.weight': { name: 'blk.1.ffn_up.weight', type: GgmlType.Q3_K, shape: [256, 64], data: new Uint8Array(110 * 64) } },
    });
    await assert.rejects(loadModel(path), /tensor blk\.1\.ffn_up\.weight has type Q3_K, which Conduit cannot compute with/);
  });

  it('names the tensor whose shape disagrees with the config', async () => {
    const path = tempPath();
    const wrong = new Float32Array(32 * 32);
    writeTinyGguf(path, makeTinyModel(), {
      tensors: { 'blk.0.attn_k.weight': { name: 'blk.0.attn_k.weight', type: GgmlType.F32, shape: [32, 32], data: quantize(GgmlType.F32, wrong) } },
    });
    await assert.rejects(loadModel(path), /tensor blk\.0\.attn_k\.weight has shape \[32, 32\], expected \[32, 16\]/);
  });

  it('names a missing tensor and a missing metadata key', async () => {
    const noFfn = tempPath();
    writeTinyGguf(noFfn, makeTinyModel(), { tensors: { 'blk.1.ffn_gate.weight': undefined } });
    await assert.rejects(loadModel(noFfn), /tensor blk\.1\.ffn_gate\.weight is missing/);
    const noHeads = tempPath();
    writeTinyGguf(noHeads, makeTinyModel(), { metadata: { 'llama.attention.head_count': undefined } });
    await assert.rejects(loadModel(noHeads), /metadata llama\.attention\.head_count is missing/);
  });

  it('says what is wrong with paths that are not models', async () => {
    await assert.rejects(loadModel(join(dir, 'absent.gguf')), /no such file or folder/);
    const text = join(dir, 'notes.txt');
    writeFileSync(text, 'hello');
    await assert.rejects(loadModel(text), /neither a GGUF file .* nor a Hugging Face model folder/);
    await assert.rejects(loadModel(dir), /folder without config\.json/);
  });
});

// ---------------------------------------------------------------------------------------------------------------
describe('RoPE scaling from GGUF', () => {
  it('reads linear scaling from metadata', async () => {
    const path = tempPath();
    writeTinyGguf(path, makeTinyModel(), {
      extraMetadata: [['llama.rope.scaling.type', 'linear'], ['llama.rope.scaling.factor', 4]],
    });
    assert.deepEqual((await loadModel(path)).config.ropeScaling, { type: 'linear', factor: 4 });
  });

  it('rejects scaling types it cannot compute', async () => {
    const path = tempPath();
    writeTinyGguf(path, makeTinyModel(), {
      extraMetadata: [['llama.rope.scaling.type', 'yarn'], ['llama.rope.scaling.factor', 4]],
    });
    await assert.rejects(loadModel(path), /RoPE scaling type "yarn" is not supported/);
  });

  // Llama 3.1 8B: head_dim 128, base 500000, factor 8, low 1, high 4, original context 8192.
  const llama31 = { type: 'llama3', factor: 8, lowFreqFactor: 1, highFreqFactor: 4, originalContextLength: 8192 } as const;

  it('computes the llama3 divisors from the published formula', () => {
    const factors = llama3FreqFactors(llama31, 500000, 128);
    // Pair 0 has wavelength 2*pi (< 8192/4): unscaled. Pair 63 has wavelength 2*pi*500000^(126/128), about 2.5M
    // (> 8192/1): divided by the full factor.
    assert.equal(factors[0], 1);
    assert.equal(factors[63], 8);
    // Pair 32: wavelength w = 2*pi*500000^(64/128), about 4443; smooth = (8192/w - 1)/(4 - 1);
    // divisor 1/((1-smooth)/8 + smooth).
    const w = 2 * Math.PI * 500000 ** (64 / 128);
    const smooth = (8192 / w - 1) / 3;
    assert.ok(w > 2048 && w < 8192, 'pair 32 lies in the blended band');
    assert.ok(Math.abs(factors[32]! - 1 / ((1 - smooth) / 8 + smooth)) < 1e-5);
  });

  it('recovers llama3 parameters from a rope_freqs.weight tensor', async () => {
    const dims = { ...TINY_DIMS, dim: 256, numHeads: 2, numKvHeads: 1 }; // head_dim 128 like Llama 3
    const path = tempPath();
    writeTinyGguf(path, makeTinyModel(dims), {
      metadata: { 'llama.rope.freq_base': 500000 },
      tensors: { 'rope_freqs.weight': { name: 'rope_freqs.weight', type: GgmlType.F32, shape: [64],
        data: quantize(GgmlType.F32, llama3FreqFactors(llama31, 500000, 128)) } },
    });
    assert.deepEqual((await loadModel(path)).config.ropeScaling, llama31);
  });

  it('recovers other llama3 parameters (Llama 3.2 uses factor 32)', () => {
    const scaling = { type: 'llama3', factor: 32, lowFreqFactor: 2, highFreqFactor: 6, originalContextLength: 8192 } as const;
    assert.deepEqual(llama3ScalingFromFreqFactors(llama3FreqFactors(scaling, 500000, 128), 500000, 128, 8192), scaling);
    assert.equal(llama3ScalingFromFreqFactors(new Float32Array(64).fill(1), 500000, 128, 8192), undefined);
  });

  it('refuses frequency factors that are not llama3 scaling', () => {
    const bogus = new Float32Array(64).map((_, i) => 1 + (i % 3));
    assert.throws(() => llama3ScalingFromFreqFactors(bogus, 500000, 128, 8192), /does not give/);
    assert.throws(() => llama3ScalingFromFreqFactors(new Float32Array(10), 500000, 128, 8192), /expected ropeDim \/ 2 = 64/);
  });
});
