// Random-weight models of each supported architecture beyond Llama 2 (Qwen3 with tied and untied embeddings,
// Qwen3-MoE, Mixtral, Phi-3, Gemma 3, and Mistral with a sliding window in every layer), written by the project's GGUF writer with a real vocabulary, and the same weights as a Hugging
// Face folder (safetensors, config.json, a tokenizer.json built from the vocabulary). The bytes depend only on the
// spec and the vocabulary file, so llama.cpp's greedy outputs recorded once for a file (test/data/arch/, by
// record-llama-cpp.ts there) hold for the file a test writes again; the recording keeps each file's sha256.
//
// Values are generated in GGUF row order. For a llama-architecture file that is llama.cpp's interleaved RoPE order
// of the Q/K rows, so the HF writer moves those rows back to neox order as a real checkpoint has them; the Qwens keep
// HF order in GGUF. Gemma 3's norm weights are drawn around 0 as its checkpoints store them; its GGUF holds them
// plus 1, as llama.cpp's converter writes them.

import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { GgmlType } from '../../src/model/ggml-types.ts';
import { GgufValueType, readGguf } from '../../src/model/gguf.ts';
import type { GgufValue } from '../../src/model/gguf.ts';
import { writeGguf } from '../../src/model/gguf-writer.ts';
import type { GgufTensorToWrite, GgufValueTypeSpec } from '../../src/model/gguf-writer.ts';
import { interleavedRowOrder } from '../../src/model/hf.ts';
import { quantize } from '../../src/model/quant.ts';
import { writeSafetensors } from '../../src/model/safetensors.ts';
import type { SafetensorsTensorData } from '../../src/model/safetensors.ts';
import { LLAMA_SPM_TOKENIZER_PATH, SeededRandom } from '../../src/model/synthetic.ts';
import { hashString } from '../../src/util/random.ts';
import { sharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { byteLevelJson, HF_TOKENIZER_CONFIGS, sentencePieceJson } from './hf-tokenizer-json.ts';
import { invert, reorderRows } from './loader-fixtures.ts';

export interface ArchModelSpec {
  name: string;
  architecture: 'qwen3' | 'qwen3moe' | 'llama' | 'phi3' | 'gemma3';
  /** The vocabulary: Qwen2's (also Qwen3's) or Phi-3's from ../shared/models, or the Llama 2 one shipped in assets/. */
  vocab: 'qwen2' | 'llama-spm' | 'phi-3';
  dim: number;
  numLayers: number;
  numHeads: number;
  numKvHeads: number;
  headDim: number;
  ffnDim: number;
  moe?: { numExperts: number; numExpertsUsed: number; expertFfnDim: number };
  /** Router weights' std times sqrt(dim) (default 2): larger keeps the top-k far from ties. */
  routerGain?: number;
  tied: boolean;
  seed: number;
  contextLength: number;
  ropeTheta: number;
  rmsNormEps: number;
  /** Sliding-window attention: Gemma 3's local layers (five of every six), every layer of a llama (Mistral). */
  slidingWindow?: number;
  /** Gemma 3: the local layers' RoPE base, written as rope.freq_base_swa (absent: not written, 10000 by default). */
  ropeLocalTheta?: number;
  /** Gemma 3: final_logit_softcapping. */
  finalLogitSoftcap?: number;
  /**
   * Phi-3 LongRoPE: a long and a short set of ropeDim / 2 frequency divisors, and the context the short set is for
   * (shorter than contextLength, so the long set is the one used, by llama.cpp at a context of contextLength too).
   */
  longRope?: { long: number[]; short: number[]; originalContextLength: number };
}

/** LongRoPE's attention factor when the config gives none (transformers, llama.cpp's converter). */
export function longRopeAttentionFactor(contextLength: number, originalContextLength: number): number {
  const scale = contextLength / originalContextLength;
  return scale > 1 ? Math.sqrt(1 + Math.log(scale) / Math.log(originalContextLength)) : 1;
}

const QWEN3_BASE = {
  architecture: 'qwen3', vocab: 'qwen2', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2,
  // Qwen3's head size is its own: 32 here, not dim / numHeads = 16.
  headDim: 32, ffnDim: 128, contextLength: 512, ropeTheta: 1000000, rmsNormEps: 1e-6,
} as const;

export const ARCH_MODELS: readonly ArchModelSpec[] = [
  { ...QWEN3_BASE, name: 'qwen3-tied', tied: true, seed: 301 },
  { ...QWEN3_BASE, name: 'qwen3-untied', tied: false, seed: 302 },
  {
    ...QWEN3_BASE, name: 'qwen3moe', architecture: 'qwen3moe', tied: false, seed: 303, ffnDim: 96,
    moe: { numExperts: 8, numExpertsUsed: 2, expertFfnDim: 32 },
  },
  {
    name: 'mixtral', architecture: 'llama', vocab: 'llama-spm', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2,
    headDim: 16, ffnDim: 64, contextLength: 512, ropeTheta: 1000000, rmsNormEps: 1e-5, tied: true, seed: 304,
    moe: { numExperts: 4, numExpertsUsed: 2, expertFfnDim: 64 },
  },
  {
    // Phi-3 (4k context): fused QKV and gate/up, neox RoPE, untied; GQA as in Phi-3-medium.
    name: 'phi3', architecture: 'phi3', vocab: 'phi-3', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2,
    headDim: 16, ffnDim: 128, contextLength: 512, ropeTheta: 10000, rmsNormEps: 1e-5, tied: false, seed: 306,
  },
  {
    // Phi-3 with LongRoPE (the 128k-context models, Phi-4-mini): factors growing with the wavelength as the real
    // ones do, trained for 128 positions and served at 512.
    name: 'phi3-longrope', architecture: 'phi3', vocab: 'phi-3', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2,
    headDim: 16, ffnDim: 128, contextLength: 512, ropeTheta: 10000, rmsNormEps: 1e-5, tied: false, seed: 310,
    longRope: {
      long: [1, 1.5, 2.5, 4, 7, 12, 20, 32], short: [1, 1.1, 1.2, 1.3, 1.5, 1.8, 2.2, 3], originalContextLength: 128,
    },
  },
  {
    // Gemma 3 as its files are: six layers, so the default pattern makes layers 0-4 local (a window of 4 positions,
    // shorter than every prompt, RoPE base 10000 by default) and layer 5 global (base 1e6); tied embeddings, a head
    // size of its own. No Gemma vocabulary is in ../shared/models, so Llama 2's (SentencePiece) stands in.
    name: 'gemma3', architecture: 'gemma3', vocab: 'llama-spm', dim: 64, numLayers: 6, numHeads: 4, numKvHeads: 1,
    headDim: 32, ffnDim: 128, contextLength: 512, ropeTheta: 1000000, rmsNormEps: 1e-6, tied: true, seed: 307,
    slidingWindow: 4,
  },
  {
    // Untied, the local base written in the file, a final logit softcap (Gemma 2's 30, which Gemma 3 dropped but its
    // code keeps), two local layers and one global (sliding_window_pattern 3).
    name: 'gemma3-softcap', architecture: 'gemma3', vocab: 'llama-spm', dim: 64, numLayers: 3, numHeads: 2,
    numKvHeads: 2, headDim: 16, ffnDim: 96, contextLength: 512, ropeTheta: 1000000, rmsNormEps: 1e-6, tied: false,
    seed: 308, slidingWindow: 6, ropeLocalTheta: 20000, finalLogitSoftcap: 30,
  },
];

/**
 * Mistral's layout: a llama with a sliding window in every layer (what lets the paged KV cache free blocks). llama.cpp
 * ignores the window of a llama file, so this model has no llama.cpp recording: its tests compare the backends, the
 * Hugging Face folder and the engine with and without freed blocks, and Gemma 3's recordings cover the window's
 * masking.
 */
export const MISTRAL_SWA_MODEL: ArchModelSpec = {
  name: 'mistral-swa', architecture: 'llama', vocab: 'llama-spm', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2,
  headDim: 16, ffnDim: 128, contextLength: 512, ropeTheta: 10000, rmsNormEps: 1e-5, tied: false, seed: 309,
  slidingWindow: 5,
};

/**
 * A mixture-of-experts model for the kernel tests (no llama.cpp recording): rows of 256 so that every quant type of
 * the dense path (Q8_0, Q4_0, Q4_K, Q6_K) can store the experts, the Llama 2 vocabulary shipped in assets/.
 */
export const MOE_KERNEL_MODEL: ArchModelSpec = {
  name: 'moe-kernels', architecture: 'qwen3moe', vocab: 'llama-spm', dim: 256, numLayers: 2, numHeads: 4,
  numKvHeads: 2, headDim: 64, ffnDim: 512, contextLength: 256, ropeTheta: 1000000, rmsNormEps: 1e-6, tied: true,
  seed: 305, moe: { numExperts: 8, numExpertsUsed: 3, expertFfnDim: 256 },
  // Router scores of std 8: 8-bit activations move them by about 1e-2, far less than the gaps between experts, so
  // the native kernels pick the reference's experts and a logit comparison measures the matmuls, not a flipped choice.
  routerGain: 8,
};

export function archModel(name: string): ArchModelSpec {
  const spec = [...ARCH_MODELS, MISTRAL_SWA_MODEL].find((m) => m.name === name);
  if (!spec) throw new Error(`no architecture test model ${name}`);
  return spec;
}

/**
 * Gemma 3's chat template as its instruction-tuned models publish it (tokenizer_config.json of google/gemma-3-*-it;
 * llama.cpp's converter copies it into tokenizer.chat_template). The Gemma 3 test models carry it.
 */
export const GEMMA3_CHAT_TEMPLATE = [
  "{{ bos_token }}",
  "{%- if messages[0]['role'] == 'system' -%}",
  "    {%- if messages[0]['content'] is string -%}",
  "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}",
  "    {%- else -%}",
  "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}",
  "    {%- endif -%}",
  "    {%- set loop_messages = messages[1:] -%}",
  "{%- else -%}",
  "    {%- set first_user_prefix = \"\" -%}",
  "    {%- set loop_messages = messages -%}",
  "{%- endif -%}",
  "{%- for message in loop_messages -%}",
  "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}",
  "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}",
  "    {%- endif -%}",
  "    {%- if (message['role'] == 'assistant') -%}",
  "        {%- set role = \"model\" -%}",
  "    {%- else -%}",
  "        {%- set role = message['role'] -%}",
  "    {%- endif -%}",
  "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}",
  "    {%- if message['content'] is string -%}",
  "        {{ message['content'] | trim }}",
  "    {%- elif message['content'] is iterable -%}",
  "        {%- for item in message['content'] -%}",
  "            {%- if item['type'] == 'image' -%}",
  "                {{ '<start_of_image>' }}",
  "            {%- elif item['type'] == 'text' -%}",
  "                {{ item['text'] | trim }}",
  "            {%- endif -%}",
  "        {%- endfor -%}",
  "    {%- else -%}",
  "        {{ raise_exception(\"Invalid content type\") }}",
  "    {%- endif -%}",
  "    {{ '<end_of_turn>\\n' }}",
  "{%- endfor -%}",
  "{%- if add_generation_prompt -%}",
  "    {{'<start_of_turn>model\\n'}}",
  "{%- endif -%}",
  '',
].join('\n');

/** A conversation whose rendering by each Gemma 3 model's template is recorded from llama.cpp. */
export const ARCH_CHAT: readonly { role: 'system' | 'user' | 'assistant'; content: string }[] = [
  { role: 'system', content: 'You are terse.' },
  { role: 'user', content: 'Hi!' },
  { role: 'assistant', content: 'Hello. ' },
  { role: 'user', content: '  Name a color.' },
];

/** Prompts of the golden tests: English, code, numbers, and text outside ASCII. */
export const ARCH_PROMPTS: readonly string[] = [
  'Once upon a time',
  'The capital of France is',
  'def fibonacci(n):\n    return',
  '1, 2, 3, 5, 8,',
  'Größe und 日本語のテキスト',
];

/** Tokens generated per prompt. */
export const ARCH_NEW_TOKENS = 24;

export function vocabPath(spec: ArchModelSpec): string | undefined {
  return spec.vocab === 'llama-spm' ? LLAMA_SPM_TOKENIZER_PATH : sharedModel(`ggml-vocab-${spec.vocab}.gguf`);
}

/** The `skip` option of a suite that needs this model's vocabulary. */
export function skipUnlessVocabFor(spec: ArchModelSpec): string | false {
  return spec.vocab === 'llama-spm' ? false : skipUnlessShared(`ggml-vocab-${spec.vocab}.gguf`);
}

// ---------------------------------------------------------------------------------------------------------------
// Values

interface Values {
  /** ggml order. */
  shape: number[];
  values: Float32Array;
  /** The Hugging Face checkpoint's values when they differ (Gemma 3's norms, stored without the 1 GGUF adds). */
  hf?: Float32Array;
}

/** The layer's norms that Gemma 3 computes as x * (1 + weight). */
const GEMMA_NORMS = /(^|\.)(attn_norm|ffn_norm|post_attention_norm|post_ffw_norm|attn_q_norm|attn_k_norm|output_norm)\.weight$/;

/** Every tensor by GGUF name, in GGUF row order. */
export function archTensors(spec: ArchModelSpec, vocabSize: number): Map<string, Values> {
  const { dim, numHeads, numKvHeads, headDim, moe } = spec;
  const tensors = new Map<string, Values>();
  const add = (name: string, shape: number[], std: number, mean = 0): void => {
    const random = new SeededRandom((spec.seed ^ hashString(name)) >>> 0);
    const values = random.fillNormal(new Float32Array(shape.reduce((a, b) => a * b, 1)), std);
    const hf = spec.architecture === 'gemma3' && GEMMA_NORMS.test(name) ? values.slice() : undefined;
    if (mean !== 0) for (let i = 0; i < values.length; i++) values[i] = values[i]! + mean;
    tensors.set(name, { shape, values, ...(hf ? { hf } : {}) });
  };
  const qDim = numHeads * headDim;
  const kvDim = numKvHeads * headDim;
  // Scales as in src/model/synthetic.ts (unit-RMS inputs, large FFN gain) so greedy text wanders instead of looping,
  // with logits peaked enough that the argmax is far from a tie.
  // Gemma multiplies embeddings by sqrt(dim): drawn that much smaller, the residual stream starts at unit RMS as in
  // the other models instead of drowning every layer's (post-normed, unit-RMS) output.
  add('token_embd.weight', [dim, vocabSize], spec.architecture === 'gemma3' ? 1 / Math.sqrt(dim) : 0.5);
  add('output_norm.weight', [dim], 0.1, 1);
  if (!spec.tied) add('output.weight', [dim, vocabSize], 0.5);
  for (let i = 0; i < spec.numLayers; i++) {
    const p = `blk.${i}.`;
    add(`${p}attn_norm.weight`, [dim], 0.1, 1);
    add(`${p}attn_q.weight`, [dim, qDim], 1 / Math.sqrt(dim));
    add(`${p}attn_k.weight`, [dim, kvDim], 1 / Math.sqrt(dim));
    add(`${p}attn_v.weight`, [dim, kvDim], 1 / Math.sqrt(dim));
    if (spec.architecture === 'qwen3' || spec.architecture === 'qwen3moe' || spec.architecture === 'gemma3') {
      add(`${p}attn_q_norm.weight`, [headDim], 0.3, 1);
      add(`${p}attn_k_norm.weight`, [headDim], 0.3, 1);
    }
    add(`${p}attn_output.weight`, [qDim, dim], 0.5 / Math.sqrt(qDim));
    if (spec.architecture === 'gemma3') add(`${p}post_attention_norm.weight`, [dim], 0.1, 1);
    add(`${p}ffn_norm.weight`, [dim], 0.1, 1);
    if (spec.architecture === 'gemma3') add(`${p}post_ffw_norm.weight`, [dim], 0.1, 1);
    if (moe) {
      const { numExperts: e, expertFfnDim: f } = moe;
      add(`${p}ffn_gate_inp.weight`, [dim, e], (spec.routerGain ?? 2) / Math.sqrt(dim));
      add(`${p}ffn_gate_exps.weight`, [dim, f, e], 1 / Math.sqrt(dim));
      add(`${p}ffn_up_exps.weight`, [dim, f, e], 1 / Math.sqrt(dim));
      add(`${p}ffn_down_exps.weight`, [f, dim, e], 4 / Math.sqrt(f));
    } else {
      add(`${p}ffn_gate.weight`, [dim, spec.ffnDim], 1 / Math.sqrt(dim));
      add(`${p}ffn_up.weight`, [dim, spec.ffnDim], 1 / Math.sqrt(dim));
      add(`${p}ffn_down.weight`, [spec.ffnDim, dim], 4 / Math.sqrt(spec.ffnDim));
    }
  }
  return tensors;
}

// ---------------------------------------------------------------------------------------------------------------
// GGUF

/** Hyperparameters llama.cpp reads only as FLOAT32. */
const FLOAT_KEYS = ['rope.freq_base', 'attention.layer_norm_rms_epsilon', 'rope.freq_base_swa', 'final_logit_softcapping',
  'rope.scaling.attn_factor'];

/**
 * Writes the model as GGUF. `type` is the storage type of the 2-D and 3-D weights (norms and the router stay F32, as
 * llama-quantize keeps them).
 */
export function writeArchGguf(spec: ArchModelSpec, path: string, type: GgmlType = GgmlType.F32): void {
  const vocab = readGguf(vocabPath(spec)!);
  const tokens = vocab.metadata.get('tokenizer.ggml.tokens') as string[];
  const a = spec.architecture;
  const metadata: [string, GgufValue][] = [
    ['general.architecture', a],
    ['general.name', spec.name],
    ['general.file_type', type === GgmlType.F32 ? 0 : type === GgmlType.Q8_0 ? 7 : 1],
    [`${a}.context_length`, spec.contextLength],
    [`${a}.embedding_length`, spec.dim],
    [`${a}.block_count`, spec.numLayers],
    [`${a}.feed_forward_length`, spec.ffnDim],
    [`${a}.attention.head_count`, spec.numHeads],
    [`${a}.attention.head_count_kv`, spec.numKvHeads],
    [`${a}.attention.key_length`, spec.headDim],
    [`${a}.attention.value_length`, spec.headDim],
    [`${a}.rope.dimension_count`, spec.headDim],
    [`${a}.rope.freq_base`, spec.ropeTheta],
    [`${a}.attention.layer_norm_rms_epsilon`, spec.rmsNormEps],
  ];
  if (a === 'phi3') {
    metadata.push([`${a}.rope.scaling.original_context_length`, spec.longRope?.originalContextLength ?? spec.contextLength]);
  }
  if (spec.longRope) {
    metadata.push([`${a}.rope.scaling.attn_factor`,
      longRopeAttentionFactor(spec.contextLength, spec.longRope.originalContextLength)]);
  }
  if (spec.slidingWindow !== undefined) metadata.push([`${a}.attention.sliding_window`, spec.slidingWindow]);
  if (spec.ropeLocalTheta !== undefined) metadata.push([`${a}.rope.freq_base_swa`, spec.ropeLocalTheta]);
  if (spec.finalLogitSoftcap !== undefined) metadata.push([`${a}.final_logit_softcapping`, spec.finalLogitSoftcap]);
  // Gemma 3's converter writes no pattern (llama.cpp then takes 6); the three-layer model says its own.
  if (a === 'gemma3' && spec.numLayers !== 6) metadata.push([`${a}.attention.sliding_window_pattern`, spec.numLayers]);
  if (spec.moe) {
    metadata.push([`${a}.expert_count`, spec.moe.numExperts], [`${a}.expert_used_count`, spec.moe.numExpertsUsed]);
    if (a === 'qwen3moe') metadata.push([`${a}.expert_feed_forward_length`, spec.moe.expertFfnDim]);
  }
  const types = new Map<string, GgufValueTypeSpec>();
  for (const key of FLOAT_KEYS) types.set(`${a}.${key}`, { type: GgufValueType.FLOAT32 });
  for (const [key, value] of vocab.metadata) {
    if (!key.startsWith('tokenizer.') || (a === 'gemma3' && key === 'tokenizer.chat_template')) continue;
    metadata.push([key, value]);
    types.set(key, vocab.metadataTypes.get(key)!);
  }
  if (a === 'gemma3') metadata.push(['tokenizer.chat_template', GEMMA3_CHAT_TEMPLATE]);
  // Qwen's converted files say so; without the key llama.cpp would add a BOS to every prompt.
  if (spec.vocab === 'qwen2' && spec.architecture !== 'llama') metadata.push(['tokenizer.ggml.add_bos_token', false]);
  const tensors: GgufTensorToWrite[] = [];
  if (spec.longRope) {
    for (const kind of ['long', 'short'] as const) {
      const values = Float32Array.from(spec.longRope[kind]);
      tensors.push({ name: `rope_factors_${kind}.weight`, type: GgmlType.F32, shape: [values.length], data: new Uint8Array(values.buffer) });
    }
  }
  for (const [name, t] of ggufLayout(spec, archTensors(spec, tokens.length))) {
    const tensorType = t.shape.length === 1 || name.includes('ffn_gate_inp') ? GgmlType.F32 : type;
    tensors.push({
      name, type: tensorType, shape: t.shape,
      data: tensorType === GgmlType.F32 ? new Uint8Array(t.values.buffer) : quantize(tensorType, t.values),
    });
  }
  writeGguf(path, { metadata, types, tensors });
}

/** Phi-3's files fuse Q, K, V into attn_qkv and gate, up into ffn_up (gate first): rows one after the other. */
function ggufLayout(spec: ArchModelSpec, tensors: Map<string, Values>): Map<string, Values> {
  if (spec.architecture !== 'phi3') return tensors;
  const out = new Map<string, Values>();
  const fuse = (parts: Values[]): Values => {
    const values = new Float32Array(parts.reduce((n, p) => n + p.values.length, 0));
    let at = 0;
    for (const p of parts) { values.set(p.values, at); at += p.values.length; }
    return { shape: [parts[0]!.shape[0]!, parts.reduce((n, p) => n + p.shape[1]!, 0)], values };
  };
  for (const [name, t] of tensors) {
    const m = /^(blk\.\d+\.)(attn_[qkv]|ffn_gate|ffn_up)\.weight$/.exec(name);
    if (!m) { out.set(name, t); continue; }
    if (m[2] === 'attn_q') {
      out.set(`${m[1]}attn_qkv.weight`, fuse(['q', 'k', 'v'].map((x) => tensors.get(`${m[1]}attn_${x}.weight`)!)));
    } else if (m[2] === 'ffn_gate') {
      out.set(`${m[1]}ffn_up.weight`, fuse([t, tensors.get(`${m[1]}ffn_up.weight`)!]));
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Hugging Face folder

function hfArchitecture(spec: ArchModelSpec): string {
  if (spec.architecture === 'llama') return spec.moe ? 'MixtralForCausalLM' : 'MistralForCausalLM';
  return { qwen3: 'Qwen3ForCausalLM', qwen3moe: 'Qwen3MoeForCausalLM', phi3: 'Phi3ForCausalLM',
    gemma3: 'Gemma3ForCausalLM' }[spec.architecture];
}

function hfLayerName(spec: ArchModelSpec, part: string): string | undefined {
  const names: Record<string, string> = {
    'attn_norm.weight': 'input_layernorm.weight',
    'attn_q.weight': 'self_attn.q_proj.weight', 'attn_k.weight': 'self_attn.k_proj.weight',
    'attn_v.weight': 'self_attn.v_proj.weight', 'attn_output.weight': 'self_attn.o_proj.weight',
    'attn_q_norm.weight': 'self_attn.q_norm.weight', 'attn_k_norm.weight': 'self_attn.k_norm.weight',
    'ffn_norm.weight': spec.architecture === 'gemma3' ? 'pre_feedforward_layernorm.weight' : 'post_attention_layernorm.weight',
    'post_attention_norm.weight': 'post_attention_layernorm.weight',
    'post_ffw_norm.weight': 'post_feedforward_layernorm.weight',
    'ffn_gate.weight': 'mlp.gate_proj.weight', 'ffn_up.weight': 'mlp.up_proj.weight',
    'ffn_down.weight': 'mlp.down_proj.weight',
    'attn_qkv.weight': 'self_attn.qkv_proj.weight',
    // Phi-3's fused gate/up is ffn_up in GGUF.
    ...(spec.architecture === 'phi3' ? { 'ffn_up.weight': 'mlp.gate_up_proj.weight' } : {}),
    'ffn_gate_inp.weight': spec.architecture === 'llama' ? 'block_sparse_moe.gate.weight' : 'mlp.gate.weight',
  };
  return names[part];
}

function expertName(spec: ArchModelSpec, part: 'gate' | 'up' | 'down', e: number): string {
  if (spec.architecture === 'llama') return `block_sparse_moe.experts.${e}.${{ gate: 'w1', up: 'w3', down: 'w2' }[part]}.weight`;
  return `mlp.experts.${e}.${part}_proj.weight`;
}

function f32Bytes(values: Float32Array): Uint8Array {
  return new Uint8Array(values.slice().buffer);
}

/** Writes the same weights (F32) as a Hugging Face folder with a tokenizer.json built from the vocabulary. */
export function writeArchHf(spec: ArchModelSpec, dir: string): void {
  mkdirSync(dir, { recursive: true });
  const vocab = readGguf(vocabPath(spec)!);
  const vocabSize = (vocab.metadata.get('tokenizer.ggml.tokens') as string[]).length;
  const out: SafetensorsTensorData[] = [];
  const push = (name: string, shape: number[], values: Float32Array): void => {
    out.push({ name, dtype: 'F32', shape: [...shape].reverse(), data: f32Bytes(values) });
  };
  for (const [name, t] of ggufLayout(spec, archTensors(spec, vocabSize))) {
    if (name === 'token_embd.weight') { push('model.embed_tokens.weight', t.shape, t.values); continue; }
    if (name === 'output_norm.weight') { push('model.norm.weight', t.shape, t.hf ?? t.values); continue; }
    if (name === 'output.weight') { push('lm_head.weight', t.shape, t.values); continue; }
    const [, layer, part] = /^blk\.(\d+)\.(.+)$/.exec(name)!;
    const prefix = `model.layers.${layer}.`;
    const experts = /^ffn_(gate|up|down)_exps\.weight$/.exec(part!);
    if (experts) {
      const [cols, rows, count] = t.shape as [number, number, number];
      for (let e = 0; e < count; e++) {
        push(prefix + expertName(spec, experts[1] as 'gate' | 'up' | 'down', e), [cols, rows],
          t.values.subarray(e * cols * rows, (e + 1) * cols * rows));
      }
      continue;
    }
    let values = t.hf ?? t.values;
    if (spec.architecture === 'llama' && /^attn_[qk]\.weight$/.test(part!)) {
      const heads = part!.startsWith('attn_q') ? spec.numHeads : spec.numKvHeads;
      values = reorderRows(values, t.shape[0]!, invert(interleavedRowOrder(heads, spec.headDim)));
    }
    push(prefix + hfLayerName(spec, part!)!, t.shape, values);
  }
  writeSafetensors(join(dir, 'model.safetensors'), out, { format: 'pt' });
  const config: Record<string, unknown> = {
    architectures: [hfArchitecture(spec)],
    model_type: { llama: spec.moe ? 'mixtral' : 'mistral', qwen3: 'qwen3', qwen3moe: 'qwen3_moe', phi3: 'phi3',
      gemma3: 'gemma3_text' }[spec.architecture],
    hidden_size: spec.dim,
    num_hidden_layers: spec.numLayers,
    num_attention_heads: spec.numHeads,
    num_key_value_heads: spec.numKvHeads,
    head_dim: spec.headDim,
    intermediate_size: spec.moe && spec.architecture === 'llama' ? spec.moe.expertFfnDim : spec.ffnDim,
    ...(spec.architecture === 'phi3' ? {
      original_max_position_embeddings: spec.longRope?.originalContextLength ?? spec.contextLength,
      rope_scaling: spec.longRope ? { type: 'longrope', long_factor: spec.longRope.long, short_factor: spec.longRope.short } : null,
    } : {}),
    max_position_embeddings: spec.contextLength,
    rms_norm_eps: spec.rmsNormEps,
    rope_theta: spec.ropeTheta,
    attention_bias: false,
    tie_word_embeddings: spec.tied,
    vocab_size: vocabSize,
    torch_dtype: 'float32',
  };
  if (spec.slidingWindow !== undefined) config['sliding_window'] = spec.slidingWindow;
  if (spec.architecture === 'gemma3') {
    // The newer form of the layer pattern (layer_types); the GGUF gives it as a count or not at all.
    const period = spec.numLayers === 6 ? 6 : spec.numLayers;
    Object.assign(config, {
      layer_types: Array.from({ length: spec.numLayers }, (_, l) => (l % period < period - 1 ? 'sliding_attention' : 'full_attention')),
      rope_local_base_freq: spec.ropeLocalTheta ?? 10000, query_pre_attn_scalar: spec.headDim,
      hidden_activation: 'gelu_pytorch_tanh', final_logit_softcapping: spec.finalLogitSoftcap ?? null,
      attn_logit_softcapping: null, rope_scaling: null,
    });
  }
  if (spec.architecture === 'qwen3moe') {
    Object.assign(config, { num_experts: spec.moe!.numExperts, num_experts_per_tok: spec.moe!.numExpertsUsed,
      moe_intermediate_size: spec.moe!.expertFfnDim, norm_topk_prob: true, decoder_sparse_step: 1, mlp_only_layers: [] });
  } else if (spec.moe) {
    Object.assign(config, { num_local_experts: spec.moe.numExperts, num_experts_per_tok: spec.moe.numExpertsUsed });
  }
  writeFileSync(join(dir, 'config.json'), JSON.stringify(config, null, 2));
  const tokenizerJson = spec.vocab === 'qwen2' ? byteLevelJson('qwen2', vocab) : sentencePieceJson(vocab);
  writeFileSync(join(dir, 'tokenizer.json'), JSON.stringify(tokenizerJson));
  // Phi-3's GGUF vocabulary adds BOS (tokenizer.ggml.add_bos_token), so its folder says so too.
  const tokenizerConfig = {
    ...HF_TOKENIZER_CONFIGS[spec.vocab], ...(spec.vocab === 'phi-3' ? { add_bos_token: true } : {}),
    ...(spec.architecture === 'gemma3' ? { chat_template: GEMMA3_CHAT_TEMPLATE } : {}),
  };
  writeFileSync(join(dir, 'tokenizer_config.json'), JSON.stringify(tokenizerConfig));
}
