// Tiny random models written as GGUF or as a Hugging Face folder, for the loader tests. Values are f32 in GGUF
// (interleaved RoPE) row order; the HF writer reorders Q/K rows to neox order as a real checkpoint has them.

import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { GgmlType } from '../../src/model/ggml-types.ts';
import type { GgufValue } from '../../src/model/gguf.ts';
import { writeGguf } from '../../src/model/gguf-writer.ts';
import type { GgufTensorToWrite } from '../../src/model/gguf-writer.ts';
import { interleavedRowOrder } from '../../src/model/hf.ts';
import { f32ToBf16Bits, f32ToF16Bits, quantize } from '../../src/model/quant.ts';
import { writeSafetensors } from '../../src/model/safetensors.ts';
import type { SafetensorsDtype, SafetensorsTensorData } from '../../src/model/safetensors.ts';
import { SeededRandom } from '../../src/model/synthetic.ts';

export interface TinyDims {
  dim: number;
  numLayers: number;
  numHeads: number;
  numKvHeads: number;
  ffnDim: number;
  vocabSize: number;
  contextLength: number;
}

export const TINY_DIMS: TinyDims = { dim: 32, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 64, vocabSize: 48, contextLength: 64 };

export interface TinyTensor {
  /** ggml order. */
  shape: number[];
  values: Float32Array;
}

export interface TinyModel {
  architecture: 'llama' | 'qwen2';
  dims: TinyDims;
  /** By GGUF name. */
  tensors: Map<string, TinyTensor>;
}

export function makeTinyModel(
  dims: TinyDims = TINY_DIMS,
  { architecture = 'llama', tied = false, seed = 1 }: { architecture?: 'llama' | 'qwen2'; tied?: boolean; seed?: number } = {},
): TinyModel {
  const random = new SeededRandom(seed);
  const headDim = dims.dim / dims.numHeads;
  const qDim = dims.numHeads * headDim;
  const kvDim = dims.numKvHeads * headDim;
  const tensors = new Map<string, TinyTensor>();
  const add = (name: string, shape: number[], std = 0.3, mean = 0): void => {
    const values = new Float32Array(shape.reduce((a, b) => a * b, 1));
    for (let i = 0; i < values.length; i++) values[i] = mean + std * random.normal();
    tensors.set(name, { shape, values });
  };
  add('token_embd.weight', [dims.dim, dims.vocabSize]);
  add('output_norm.weight', [dims.dim], 0.1, 1);
  if (!tied) add('output.weight', [dims.dim, dims.vocabSize]);
  for (let i = 0; i < dims.numLayers; i++) {
    const p = `blk.${i}.`;
    add(`${p}attn_norm.weight`, [dims.dim], 0.1, 1);
    add(`${p}attn_q.weight`, [dims.dim, qDim]);
    add(`${p}attn_k.weight`, [dims.dim, kvDim]);
    add(`${p}attn_v.weight`, [dims.dim, kvDim]);
    if (architecture === 'qwen2') {
      add(`${p}attn_q.bias`, [qDim]);
      add(`${p}attn_k.bias`, [kvDim]);
      add(`${p}attn_v.bias`, [kvDim]);
    }
    add(`${p}attn_output.weight`, [qDim, dims.dim]);
    add(`${p}ffn_norm.weight`, [dims.dim], 0.1, 1);
    add(`${p}ffn_gate.weight`, [dims.dim, dims.ffnDim]);
    add(`${p}ffn_up.weight`, [dims.dim, dims.ffnDim]);
    add(`${p}ffn_down.weight`, [dims.ffnDim, dims.dim]);
  }
  return { architecture, dims, tensors };
}

// ---------------------------------------------------------------------------------------------------------------
// GGUF

export function tinyGgufMetadata(model: TinyModel, extra: [string, GgufValue][] = []): [string, GgufValue][] {
  const a = model.architecture;
  const d = model.dims;
  const tokens = Array.from({ length: d.vocabSize }, (_, i) => `tok${i}`);
  return [
    ['general.architecture', a],
    ['general.name', 'tiny'],
    [`${a}.context_length`, d.contextLength],
    [`${a}.embedding_length`, d.dim],
    [`${a}.block_count`, d.numLayers],
    [`${a}.feed_forward_length`, d.ffnDim],
    [`${a}.attention.head_count`, d.numHeads],
    [`${a}.attention.head_count_kv`, d.numKvHeads],
    [`${a}.attention.layer_norm_rms_epsilon`, 1e-6],
    [`${a}.rope.freq_base`, 10000],
    ['tokenizer.ggml.model', 'llama'],
    ['tokenizer.ggml.tokens', tokens],
    ...extra,
  ];
}

export interface GgufWriteOverrides {
  /** Storage type of 2-D weights (1-D norms and biases stay F32). */
  type?: GgmlType;
  extraMetadata?: [string, GgufValue][];
  /** Replace metadata entries by key (undefined removes the key). */
  metadata?: Record<string, GgufValue | undefined>;
  /** Replace or add raw tensors (undefined removes one). */
  tensors?: Record<string, GgufTensorToWrite | undefined>;
}

export function writeTinyGguf(path: string, model: TinyModel, overrides: GgufWriteOverrides = {}): void {
  const type = overrides.type ?? GgmlType.F32;
  let metadata = tinyGgufMetadata(model, overrides.extraMetadata);
  for (const [key, value] of Object.entries(overrides.metadata ?? {})) {
    metadata = metadata.filter(([k]) => k !== key);
    if (value !== undefined) metadata.push([key, value]);
  }
  const tensors = new Map<string, GgufTensorToWrite>();
  for (const [name, t] of model.tensors) {
    const tensorType = t.shape.length === 1 ? GgmlType.F32 : type;
    tensors.set(name, { name, type: tensorType, shape: t.shape, data: quantize(tensorType, t.values) });
  }
  for (const [name, t] of Object.entries(overrides.tensors ?? {})) {
    if (t === undefined) tensors.delete(name);
    else tensors.set(name, t);
  }
  writeGguf(path, { metadata, tensors: [...tensors.values()] });
}

// ---------------------------------------------------------------------------------------------------------------
// Hugging Face folder

/** GGUF name -> HF name. */
export function hfName(ggufName: string): string {
  const fixed: Record<string, string> = {
    'token_embd.weight': 'model.embed_tokens.weight',
    'output_norm.weight': 'model.norm.weight',
    'output.weight': 'lm_head.weight',
  };
  if (fixed[ggufName]) return fixed[ggufName]!;
  const match = /^blk\.(\d+)\.(.+)$/.exec(ggufName);
  if (!match) throw new Error(`no HF name for ${ggufName}`);
  const parts: Record<string, string> = {
    'attn_norm.weight': 'input_layernorm.weight',
    'attn_q.weight': 'self_attn.q_proj.weight', 'attn_k.weight': 'self_attn.k_proj.weight',
    'attn_v.weight': 'self_attn.v_proj.weight', 'attn_output.weight': 'self_attn.o_proj.weight',
    'attn_q.bias': 'self_attn.q_proj.bias', 'attn_k.bias': 'self_attn.k_proj.bias', 'attn_v.bias': 'self_attn.v_proj.bias',
    'ffn_norm.weight': 'post_attention_layernorm.weight',
    'ffn_gate.weight': 'mlp.gate_proj.weight', 'ffn_up.weight': 'mlp.up_proj.weight', 'ffn_down.weight': 'mlp.down_proj.weight',
  };
  return `model.layers.${match[1]}.${parts[match[2]!]}`;
}

/** Rows of a [rowLength, rows] tensor reordered: output row r = input row order[r]. */
export function reorderRows(values: Float32Array, rowLength: number, order: ArrayLike<number>): Float32Array {
  const out = new Float32Array(values.length);
  for (let r = 0; r < order.length; r++) out.set(values.subarray(order[r]! * rowLength, (order[r]! + 1) * rowLength), r * rowLength);
  return out;
}

/** Inverse of a permutation. */
export function invert(order: ArrayLike<number>): Int32Array {
  const inverse = new Int32Array(order.length);
  for (let i = 0; i < order.length; i++) inverse[order[i]!] = i;
  return inverse;
}

function encodeFloat(values: Float32Array, dtype: SafetensorsDtype): Uint8Array {
  if (dtype === 'F32') return new Uint8Array(values.slice().buffer);
  const out = new Uint16Array(values.length);
  for (let i = 0; i < values.length; i++) out[i] = dtype === 'F16' ? f32ToF16Bits(values[i]!) : f32ToBf16Bits(values[i]!);
  return new Uint8Array(out.buffer);
}

export interface HfWriteOptions {
  dtype?: SafetensorsDtype;
  /** Split the tensors over this many shards with an index file. */
  shards?: number;
  configOverrides?: Record<string, unknown>;
  tokenizerConfig?: Record<string, unknown>;
}

/**
 * Writes `model` as an HF folder. For llama the Q/K rows go back to neox order (HF's), undoing the interleaving
 * permutation that llama.cpp's converter applies.
 */
export function writeTinyHf(dir: string, model: TinyModel, options: HfWriteOptions = {}): void {
  mkdirSync(dir, { recursive: true });
  const d = model.dims;
  const headDim = d.dim / d.numHeads;
  const dtype = options.dtype ?? 'F32';
  const tensors: SafetensorsTensorData[] = [];
  for (const [name, t] of model.tensors) {
    let values = t.values;
    if (model.architecture === 'llama' && /attn_[qk]\.weight$/.test(name)) {
      const heads = name.includes('attn_q') ? d.numHeads : d.numKvHeads;
      values = reorderRows(values, t.shape[0]!, invert(interleavedRowOrder(heads, headDim)));
    }
    tensors.push({ name: hfName(name), dtype, shape: [...t.shape].reverse(), data: encodeFloat(values, dtype) });
  }
  const shards = options.shards ?? 1;
  if (shards === 1) {
    writeSafetensors(join(dir, 'model.safetensors'), tensors, { format: 'pt' });
  } else {
    const weightMap: Record<string, string> = {};
    const perShard = Math.ceil(tensors.length / shards);
    for (let s = 0; s < shards; s++) {
      const file = `model-${String(s + 1).padStart(5, '0')}-of-${String(shards).padStart(5, '0')}.safetensors`;
      const part = tensors.slice(s * perShard, (s + 1) * perShard);
      writeSafetensors(join(dir, file), part, { format: 'pt' });
      for (const t of part) weightMap[t.name] = file;
    }
    writeFileSync(join(dir, 'model.safetensors.index.json'), JSON.stringify({ metadata: {}, weight_map: weightMap }));
  }
  const config = {
    architectures: [model.architecture === 'llama' ? 'LlamaForCausalLM' : 'Qwen2ForCausalLM'],
    model_type: model.architecture,
    hidden_size: d.dim,
    num_hidden_layers: d.numLayers,
    num_attention_heads: d.numHeads,
    num_key_value_heads: d.numKvHeads,
    intermediate_size: d.ffnDim,
    max_position_embeddings: d.contextLength,
    rms_norm_eps: 1e-6,
    rope_theta: 10000,
    tie_word_embeddings: !model.tensors.has('output.weight'),
    vocab_size: d.vocabSize,
    torch_dtype: dtype === 'F32' ? 'float32' : dtype === 'F16' ? 'float16' : 'bfloat16',
    ...options.configOverrides,
  };
  writeFileSync(join(dir, 'config.json'), JSON.stringify(config, null, 2));
  writeFileSync(join(dir, 'tokenizer.json'), JSON.stringify({ version: '1.0', model: { type: 'BPE', vocab: {}, merges: [] } }));
  writeFileSync(join(dir, 'tokenizer_config.json'), JSON.stringify(options.tokenizerConfig ?? {
    bos_token: '<s>', eos_token: '</s>', add_bos_token: true, chat_template: '{{ messages[0].content }}',
  }));
}
