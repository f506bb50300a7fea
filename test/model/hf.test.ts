import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, unlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { GgmlType } from '../../src/model/ggml-types.ts';
import { hfModelConfig, interleavedRowOrder } from '../../src/model/hf.ts';
import { loadModel } from '../../src/model/loader.ts';
import type { LoadedModel } from '../../src/model/loader.ts';
import { bf16BitsToF32, dequantizeTensor, f32ToBf16Bits } from '../../src/model/quant.ts';
import { ReferenceModel } from '../../src/model/reference-forward.ts';
import { writeSafetensors } from '../../src/model/safetensors.ts';
import type { LayerWeights } from '../../src/model/weights.ts';
import { makeTinyModel, reorderRows, TINY_DIMS, writeTinyGguf, writeTinyHf } from './loader-fixtures.ts';

let dir: string;
before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-hf-')); });
after(() => rmSync(dir, { recursive: true, force: true }));

let counter = 0;
const tempDir = (): string => join(dir, `model-${counter++}`);

const LAYER_FIELDS: (keyof LayerWeights)[] = ['attnNorm', 'wq', 'wk', 'wv', 'wo', 'bq', 'bk', 'bv', 'ffnNorm', 'wGate', 'wUp', 'wDown'];

/** Same model as GGUF and as an HF folder. */
async function loadBoth(model = makeTinyModel(), hfOptions = {}): Promise<{ gguf: LoadedModel; hf: LoadedModel }> {
  const ggufPath = join(dir, `model-${counter++}.gguf`);
  writeTinyGguf(ggufPath, model);
  const hfDir = tempDir();
  writeTinyHf(hfDir, model, hfOptions);
  return { gguf: await loadModel(ggufPath), hf: await loadModel(hfDir) };
}

// ---------------------------------------------------------------------------------------------------------------
describe('Hugging Face folder vs the same model as GGUF', () => {
  it('gives the same config apart from name and RoPE pairing', async () => {
    const { gguf, hf } = await loadBoth();
    assert.equal(hf.source, 'hf');
    assert.equal(gguf.config.ropeStyle, 'interleaved');
    assert.equal(hf.config.ropeStyle, 'neox');
    assert.deepEqual({ ...hf.config, name: '', ropeStyle: '' }, { ...gguf.config, name: '', ropeStyle: '' });
  });

  it('gives the same weights, Q and K rows in neox order (interleavedRowOrder maps them to GGUF order)', async () => {
    const { gguf, hf } = await loadBoth();
    const headDim = TINY_DIMS.dim / TINY_DIMS.numHeads;
    assert.deepEqual(dequantizeTensor(hf.weights.tokenEmbedding), dequantizeTensor(gguf.weights.tokenEmbedding));
    assert.deepEqual(dequantizeTensor(hf.weights.output), dequantizeTensor(gguf.weights.output));
    assert.deepEqual(dequantizeTensor(hf.weights.outputNorm), dequantizeTensor(gguf.weights.outputNorm));
    for (let l = 0; l < TINY_DIMS.numLayers; l++) {
      for (const field of LAYER_FIELDS) {
        const a = hf.weights.layers[l]![field];
        const b = gguf.weights.layers[l]![field];
        if (!a || !b) { assert.equal(a, b, field); continue; }
        assert.deepEqual(a.shape, b.shape, `${field} shape`);
        let values = dequantizeTensor(a);
        if (field === 'wq' || field === 'wk') {
          const heads = field === 'wq' ? TINY_DIMS.numHeads : TINY_DIMS.numKvHeads;
          const hfOrder = dequantizeTensor(a);
          assert.notDeepEqual(hfOrder, dequantizeTensor(b), `${field} rows differ before reordering`);
          values = reorderRows(hfOrder, a.shape[0]!, interleavedRowOrder(heads, headDim));
        }
        assert.deepEqual(values, dequantizeTensor(b), `layer ${l} ${field}`);
      }
    }
  });

  it('computes the same logits: neox pairing on HF rows equals interleaved pairing on GGUF rows', async () => {
    const { gguf, hf } = await loadBoth();
    const tokens = [3, 17, 42, 8, 8, 29];
    const a = new ReferenceModel(gguf.config, gguf.weights).forward(tokens, 0, { allLogits: true });
    const b = new ReferenceModel(hf.config, hf.weights).forward(tokens, 0, { allLogits: true });
    const worst = a.reduce((m, v, i) => Math.max(m, Math.abs(v - b[i]!)), 0);
    assert.ok(worst < 1e-4, `largest logit difference ${worst}`);
  });

  it('hands the tokenizer files and chat template over', async () => {
    const hfDir = tempDir();
    writeTinyHf(hfDir, makeTinyModel());
    const model = await loadModel(hfDir);
    assert.deepEqual(model.tokenizerSource, {
      kind: 'hf', tokenizerJson: join(hfDir, 'tokenizer.json'),
      // Checked as the folder loaded: building the tokenizer from it does not walk it again.
      parsedTokenizerJson: { version: '1.0', model: { type: 'BPE', vocab: {}, merges: [] } }, parsedTokenizerJsonChecked: true,
      tokenizerConfig: { bos_token: '<s>', eos_token: '</s>', add_bos_token: true, chat_template: '{{ messages[0].content }}' },
    });
    assert.equal(model.chatTemplate, '{{ messages[0].content }}');
    assert.equal(model.metadata.details['architectures'], 'LlamaForCausalLM');
  });
});

describe('Hugging Face folder variants', () => {
  it('loads a sharded, tied, BF16 Qwen2 model with biases', async () => {
    const model = makeTinyModel(TINY_DIMS, { architecture: 'qwen2', tied: true });
    const hfDir = tempDir();
    writeTinyHf(hfDir, model, { dtype: 'BF16', shards: 3 });
    const loaded = await loadModel(hfDir);
    assert.equal(loaded.config.architecture, 'qwen2');
    assert.equal(loaded.config.qkvBias, true);
    assert.equal(loaded.config.tiedEmbeddings, true);
    assert.equal(loaded.weights.output, loaded.weights.tokenEmbedding);
    assert.equal(loaded.weights.layers[0]!.wq.type, GgmlType.BF16);
    const toBf16 = (v: Float32Array): Float32Array => v.map((x) => bf16BitsToF32(f32ToBf16Bits(x)));
    // Qwen2 keeps HF row order in GGUF too, so no reordering here.
    assert.deepEqual(dequantizeTensor(loaded.weights.layers[1]!.wk), toBf16(model.tensors.get('blk.1.attn_k.weight')!.values));
    assert.deepEqual(dequantizeTensor(loaded.weights.layers[1]!.bq!), toBf16(model.tensors.get('blk.1.attn_q.bias')!.values));
  });

  it('reads llama3 and linear rope_scaling and an explicit head_dim', async () => {
    const llama3 = tempDir();
    writeTinyHf(llama3, makeTinyModel(), { configOverrides: {
      rope_theta: 500000, head_dim: 8,
      rope_scaling: { rope_type: 'llama3', factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192 },
    } });
    const config = (await loadModel(llama3)).config;
    assert.deepEqual(config.ropeScaling, { type: 'llama3', factor: 8, lowFreqFactor: 1, highFreqFactor: 4, originalContextLength: 8192 });
    assert.equal(config.ropeTheta, 500000);
    assert.equal(config.headDim, 8);
    const linear = tempDir();
    writeTinyHf(linear, makeTinyModel(), { configOverrides: { rope_scaling: { type: 'linear', factor: 2 } } });
    assert.deepEqual((await loadModel(linear)).config.ropeScaling, { type: 'linear', factor: 2 });
  });

  it('reads RoPE from rope_parameters, where transformers 5 saves rope_theta and the scaling', async () => {
    const llama31 = tempDir();
    writeTinyHf(llama31, makeTinyModel(), { configOverrides: {
      rope_theta: undefined,
      rope_parameters: { rope_theta: 500000, rope_type: 'llama3', factor: 8, low_freq_factor: 1, high_freq_factor: 4,
        original_max_position_embeddings: 8192 },
    } });
    const config = (await loadModel(llama31)).config;
    assert.equal(config.ropeTheta, 500000);
    assert.deepEqual(config.ropeScaling, { type: 'llama3', factor: 8, lowFreqFactor: 1, highFreqFactor: 4, originalContextLength: 8192 });

    const plain = tempDir();
    writeTinyHf(plain, makeTinyModel(), { configOverrides: { rope_theta: undefined, rope_parameters: { rope_theta: 1e6, rope_type: 'default' } } });
    assert.equal((await loadModel(plain)).config.ropeTheta, 1e6);
    assert.equal((await loadModel(plain)).config.ropeScaling, undefined);

    // Gemma 3: one set per attention type, the global layers' and the sliding-window layers'.
    const gemma3 = {
      architectures: ['Gemma3ForCausalLM'], hidden_size: 32, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8,
      vocab_size: 48, num_hidden_layers: 2, intermediate_size: 64, max_position_embeddings: 64, rms_norm_eps: 1e-6,
      sliding_window: 16, sliding_window_pattern: 2, query_pre_attn_scalar: 8,
      rope_parameters: {
        full_attention: { rope_theta: 1e6, rope_type: 'linear', factor: 8 },
        sliding_attention: { rope_theta: 20000, rope_type: 'default' },
      },
    };
    const gemma = hfModelConfig(gemma3, 'g', 'g');
    assert.equal(gemma.ropeTheta, 1e6);
    assert.deepEqual(gemma.ropeScaling, { type: 'linear', factor: 8 });
    assert.equal(gemma.ropeLocalTheta, 20000);
    const scaledLocal = { ...gemma3, rope_parameters: { ...gemma3.rope_parameters, sliding_attention: { rope_theta: 1e4, rope_type: 'linear', factor: 2 } } };
    assert.throws(() => hfModelConfig(scaledLocal, 'g', 'g'), /rope_parameters\.sliding_attention rope_type "linear" is not supported/);

    // Two different bases in one file: which one was trained with is unknown.
    const both = tempDir();
    writeTinyHf(both, makeTinyModel(), { configOverrides: { rope_theta: 10000, rope_parameters: { rope_theta: 500000, rope_type: 'default' } } });
    await assert.rejects(loadModel(both), /config\.json rope_theta 10000 and rope_parameters\.rope_theta 500000 differ/);
    const bothScalings = tempDir();
    writeTinyHf(bothScalings, makeTinyModel(), { configOverrides: {
      rope_scaling: { rope_type: 'linear', factor: 2 }, rope_parameters: { rope_theta: 10000, rope_type: 'default' },
    } });
    await assert.rejects(loadModel(bothScalings), /config\.json has both rope_scaling and rope_parameters, which differ/);
  });

  it('takes the defaults of each configuration class for an absent rope_theta or rms_norm_eps', () => {
    const base = {
      hidden_size: 32, num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 48, num_hidden_layers: 2,
      intermediate_size: 64, max_position_embeddings: 64,
    };
    const expected: [string, Record<string, unknown>, number, number][] = [
      ['LlamaForCausalLM', {}, 10000, 1e-6],
      ['MistralForCausalLM', {}, 10000, 1e-6],
      ['Qwen2ForCausalLM', {}, 10000, 1e-6],
      ['Phi3ForCausalLM', {}, 10000, 1e-5],
      // MixtralConfig and Gemma3TextConfig default to a base of 1000000, not Llama's 10000.
      ['MixtralForCausalLM', { num_local_experts: 4, num_experts_per_tok: 2 }, 1e6, 1e-5],
      ['Gemma3ForCausalLM', { head_dim: 8 }, 1e6, 1e-6],
    ];
    for (const [architecture, extra, ropeTheta, rmsNormEps] of expected) {
      const config = hfModelConfig({ ...base, ...extra, architectures: [architecture] }, 'm', 'm');
      assert.deepEqual([architecture, config.ropeTheta, config.rmsNormEps], [architecture, ropeTheta, rmsNormEps]);
    }
  });

  it('takes the special tokens of special_tokens_map.json as transformers does', async () => {
    // An older tokenizer: tokenizer_config.json without added_tokens_decoder, its tokens in special_tokens_map.json.
    const legacy = tempDir();
    writeTinyHf(legacy, makeTinyModel(), { tokenizerConfig: { add_bos_token: true, bos_token: '<unk>' } });
    writeFileSync(join(legacy, 'special_tokens_map.json'), JSON.stringify({
      bos_token: '<s>', eos_token: { content: '</s>', lstrip: false, normalized: false, rstrip: false, single_word: false },
      pad_token: null, additional_special_tokens: ['<x>'],
    }));
    const loaded = await loadModel(legacy);
    assert.equal(loaded.tokenizerSource.kind, 'hf');
    const config = loaded.tokenizerSource.kind === 'hf' ? loaded.tokenizerSource.tokenizerConfig : undefined;
    assert.equal(config?.['bos_token'], '<s>');
    assert.equal((config?.['eos_token'] as { content: string }).content, '</s>');
    assert.equal(config?.['add_bos_token'], true);

    // A newer one (added_tokens_decoder written): transformers does not read the map, nor do we.
    const current = tempDir();
    writeTinyHf(current, makeTinyModel(), { tokenizerConfig: { added_tokens_decoder: {}, eos_token: '<|im_end|>' } });
    writeFileSync(join(current, 'special_tokens_map.json'), JSON.stringify({ eos_token: '</s>' }));
    const currentSource = (await loadModel(current)).tokenizerSource;
    assert.equal(currentSource.kind === 'hf' ? currentSource.tokenizerConfig?.['eos_token'] : undefined, '<|im_end|>');

    const bad = tempDir();
    writeTinyHf(bad, makeTinyModel(), { tokenizerConfig: {} });
    writeFileSync(join(bad, 'special_tokens_map.json'), JSON.stringify({ eos_token: 2 }));
    await assert.rejects(loadModel(bad), /special_tokens_map\.json: eos_token is 2, not a token/);
  });

  it('names what it cannot load', async () => {
    const gemma2 = tempDir();
    writeTinyHf(gemma2, makeTinyModel(), { configOverrides: { architectures: ['Gemma2ForCausalLM'] } });
    await assert.rejects(loadModel(gemma2), /architecture Gemma2ForCausalLM is not supported \(supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, MistralForCausalLM, Phi3ForCausalLM, Gemma3ForCausalLM\)/);

    // Mistral loads (the llama layout), with its window when config.json gives one.
    const mistral = tempDir();
    writeTinyHf(mistral, makeTinyModel(), { configOverrides: { architectures: ['MistralForCausalLM'], sliding_window: 4096 } });
    assert.equal((await loadModel(mistral)).config.slidingWindow, 4096);

    // An empty list names no class: say so, rather than "architecture undefined".
    const emptyList = tempDir();
    writeTinyHf(emptyList, makeTinyModel(), { configOverrides: { architectures: [] } });
    await assert.rejects(loadModel(emptyList), /config\.json "architectures" is an empty list: it must name the model class \(supported: LlamaForCausalLM/);

    // Names of Object.prototype's properties are no architecture either (they must not be found on the prototype).
    for (const name of ['constructor', 'toString', '__proto__']) {
      const folder = tempDir();
      writeTinyHf(folder, makeTinyModel(), { configOverrides: { architectures: [name] } });
      await assert.rejects(loadModel(folder), new RegExp(`: architecture ${name} is not supported`));
    }

    const yarn = tempDir();
    writeTinyHf(yarn, makeTinyModel(), { configOverrides: { rope_scaling: { rope_type: 'yarn', factor: 4 } } });
    await assert.rejects(loadModel(yarn), /rope_scaling type "yarn" is not supported/);

    const noTokenizer = tempDir();
    writeTinyHf(noTokenizer, makeTinyModel());
    unlinkSync(join(noTokenizer, 'tokenizer.json'));
    await assert.rejects(loadModel(noTokenizer), /tokenizer\.json is missing/);

    const missingShard = tempDir();
    writeTinyHf(missingShard, makeTinyModel(), { shards: 2 });
    unlinkSync(join(missingShard, 'model-00002-of-00002.safetensors'));
    await assert.rejects(loadModel(missingShard), /shard model-00002-of-00002\.safetensors listed in the index is missing/);

    const wrongShape = tempDir();
    writeTinyHf(wrongShape, makeTinyModel(), { configOverrides: { intermediate_size: 80 } });
    await assert.rejects(loadModel(wrongShape), /tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \[32, 64\], expected \[32, 80\]/);
  });

  it('names a tensor stored in a dtype it cannot compute with', async () => {
    // The model without its final norm, plus a second file holding that norm as F64.
    const model = makeTinyModel();
    model.tensors.delete('output_norm.weight');
    const hfDir = tempDir();
    writeTinyHf(hfDir, model);
    const f64 = new Float64Array(TINY_DIMS.dim).fill(1);
    const header = Buffer.from(JSON.stringify({ 'model.norm.weight': { dtype: 'F64', shape: [TINY_DIMS.dim], data_offsets: [0, f64.byteLength] } }));
    const prefix = Buffer.alloc(8);
    prefix.writeBigUInt64LE(BigInt(header.byteLength));
    writeFileSync(join(hfDir, 'norm.safetensors'), Buffer.concat([prefix, header, Buffer.from(f64.buffer)]));
    await assert.rejects(loadModel(hfDir), /tensor model\.norm\.weight has dtype F64, which is not supported/);
  });

  it('refuses a tensor defined by two files when no index says which one to use', async () => {
    const hfDir = tempDir();
    writeTinyHf(hfDir, makeTinyModel());
    writeSafetensors(join(hfDir, 'copy.safetensors'), [{ name: 'model.norm.weight', dtype: 'F32', shape: [1], data: new Uint8Array(4) }]);
    await assert.rejects(loadModel(hfDir), /model\.norm\.weight is in both copy\.safetensors and model\.safetensors/);
  });
});

describe('Qwen3-MoE config.json', () => {
  const base = {
    architectures: ['Qwen3MoeForCausalLM'], hidden_size: 64, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16,
    num_hidden_layers: 2, intermediate_size: 128, vocab_size: 100, rms_norm_eps: 1e-6, max_position_embeddings: 256,
    num_experts: 8, num_experts_per_tok: 2, moe_intermediate_size: 32,
  };

  it('renormalizes the chosen experts\' weights only when norm_topk_prob says so (absent: false, as Qwen3MoeConfig)', () => {
    assert.equal(hfModelConfig({ ...base }, 'm').moe?.normalizeTopK, false);
    assert.equal(hfModelConfig({ ...base, norm_topk_prob: true }, 'm').moe?.normalizeTopK, true);
    assert.equal(hfModelConfig({ ...base, norm_topk_prob: false }, 'm').moe?.normalizeTopK, false);
  });
});
