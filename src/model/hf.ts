// A Hugging Face model folder: config.json, *.safetensors (one file, or shards listed by
// model.safetensors.index.json), tokenizer.json and tokenizer_config.json.
//
// RoPE pairing: HF Llama and Qwen2 checkpoints rotate pairs (x[i], x[i + headDim/2]) ("neox"), so their weights
// load as they are with ropeStyle 'neox'. llama.cpp's converter instead permutes the rows of Q and K for llama GGUFs
// so that the same rotation pairs adjacent elements (x[2i], x[2i+1]) ("interleaved"): within each head, HF row
// k * headDim/2 + j becomes GGUF row 2j + k (k = 0, 1). Both give the same attention scores; only the order of the
// elements inside each Q/K head differs. `interleavedRowOrder` below is that permutation.

import { existsSync } from 'node:fs';
import { readdir, stat } from 'node:fs/promises';
import { basename, join } from 'node:path';
import type { Architecture, ModelConfig, MoeConfig, RopeScaling } from './config.ts';
import {
  checkTokenizerFitsEmbedding, checkWeights, DEFAULT_ROPE_THETA, GEMMA3_DEFAULT_LOCAL_ROPE_THETA,
  GEMMA3_DEFAULT_WINDOW_PATTERN, gemma3WindowLayers, MAX_EXPERTS, MAX_LAYERS, ModelFormatError, refuseUnusedTensors,
  requireAtMost, requireCount, requirePositive, requireRopeDim, splitRows,
} from './gguf-model.ts';
import { ChatTemplateError, chatTemplateFromConfig } from './chat-template.ts';
import { readModelFile, readModelText } from './files.ts';
import { GgmlType } from './ggml-types.ts';
import { dequantizeTensor } from './quant.ts';
import { parseSafetensors } from './safetensors.ts';
import type { SafetensorsFile } from './safetensors.ts';
import { checkTokenizerJson } from './tokenizer/hf-tokenizer.ts';
import type { LayerWeights, ModelWeights, Tensor } from './weights.ts';

const ARCHITECTURES: Readonly<Record<string, Architecture>> = {
  LlamaForCausalLM: 'llama',
  Qwen2ForCausalLM: 'qwen2',
  Qwen3ForCausalLM: 'qwen3',
  Qwen3MoeForCausalLM: 'qwen3moe',
  // Mixtral is the llama layout with experts (llama.cpp converts it to a `llama` GGUF).
  MixtralForCausalLM: 'llama',
  // Mistral is the llama layout, with a sliding window when config.json gives one.
  MistralForCausalLM: 'llama',
  Phi3ForCausalLM: 'phi3',
  Gemma3ForCausalLM: 'gemma3',
};

/**
 * What each transformers configuration class takes for a key config.json leaves out (config.json files written by
 * transformers omit nothing, but trimmed or hand-written ones do): read with one default for all, a Mixtral or
 * Gemma 3 without rope_theta would rotate with Llama's base of 10000 instead of its own 1000000. One entry for each
 * class of ARCHITECTURES.
 */
const CLASS_DEFAULTS: Readonly<Record<string, { ropeTheta: number; rmsNormEps: number }>> = {
  LlamaForCausalLM: { ropeTheta: DEFAULT_ROPE_THETA, rmsNormEps: 1e-6 },
  Qwen2ForCausalLM: { ropeTheta: DEFAULT_ROPE_THETA, rmsNormEps: 1e-6 },
  Qwen3ForCausalLM: { ropeTheta: DEFAULT_ROPE_THETA, rmsNormEps: 1e-6 },
  Qwen3MoeForCausalLM: { ropeTheta: DEFAULT_ROPE_THETA, rmsNormEps: 1e-6 },
  MixtralForCausalLM: { ropeTheta: 1e6, rmsNormEps: 1e-5 },
  MistralForCausalLM: { ropeTheta: DEFAULT_ROPE_THETA, rmsNormEps: 1e-6 },
  Phi3ForCausalLM: { ropeTheta: DEFAULT_ROPE_THETA, rmsNormEps: 1e-5 },
  Gemma3ForCausalLM: { ropeTheta: 1e6, rmsNormEps: 1e-6 },
};

export interface HfModel {
  config: ModelConfig;
  weights: ModelWeights;
  tokenizerJsonPath: string;
  /** tokenizer.json parsed and checked (checkTokenizerJson): the tokenizer is built from this, not from the file again. */
  tokenizerJson: Record<string, unknown>;
  /** tokenizer_config.json parsed, {} when the folder has none. */
  tokenizerConfig: Record<string, unknown>;
  chatTemplate?: string;
  /** config.json facts worth showing. */
  details: Record<string, string | number>;
}

export async function isHfFolder(dir: string): Promise<boolean> {
  return existsSync(join(dir, 'config.json')) && (await stat(dir)).isDirectory();
}

export async function loadHfModel(dir: string): Promise<HfModel> {
  const configJson = await readJson(join(dir, 'config.json'));
  const config = hfModelConfig(configJson, basename(dir), dir);
  const files = await openSafetensors(dir);
  const weights = hfModelWeights(files, config, dir);
  checkWeights(config, weights, dir);

  const tokenizerJsonPath = join(dir, 'tokenizer.json');
  if (!existsSync(tokenizerJsonPath)) {
    throw new ModelFormatError(`${dir}: tokenizer.json is missing (only fast tokenizers are supported)`);
  }
  if (!(await stat(tokenizerJsonPath)).isFile()) throw new ModelFormatError(`${tokenizerJsonPath} is not a regular file`);
  // The engine builds the tokenizer from this object after the load (the file is read and parsed once); a model or
  // vocabulary it cannot tokenize with is refused now rather than at the first request.
  const tokenizerJson = await readJson(tokenizerJsonPath);
  const tokenIds = checkTokenizerJson(tokenizerJson, tokenizerJsonPath);
  // Added tokens count: their ids are inputs like any other.
  checkTokenizerFitsEmbedding(dir,
    { says: `tokenizer.json has token ids up to ${tokenIds - 1} (${tokenIds} ids)`, ids: tokenIds },
    { name: 'model.embed_tokens.weight (config.json vocab_size)', rows: weights.tokenEmbedding.shape[1]! }, false);
  const tokenizerConfigPath = join(dir, 'tokenizer_config.json');
  let tokenizerConfig = existsSync(tokenizerConfigPath) ? await readJson(tokenizerConfigPath) : {};
  tokenizerConfig = await withSpecialTokensMap(dir, tokenizerConfig);
  const found = await findChatTemplate(dir, tokenizerConfig, tokenizerConfigPath);
  if (found !== undefined) {
    // The engine builds its template from tokenizerConfig: one from a file beside it goes in there, or the engine
    // would serve the config's own template (or the fallback) instead.
    if (found.path !== tokenizerConfigPath) tokenizerConfig = { ...tokenizerConfig, chat_template: found.value };
    try {
      chatTemplateFromConfig({ chat_template: found.value });
    } catch (error) {
      if (!(error instanceof ChatTemplateError)) throw error;
      throw new ModelFormatError(`${found.path}: ${error.message}`);
    }
  }
  const model: HfModel = {
    config, weights, tokenizerJsonPath, tokenizerJson, tokenizerConfig,
    details: hfDetails(configJson),
  };
  const chatTemplate = pickTemplate(found?.value);
  if (chatTemplate !== undefined) model.chatTemplate = chatTemplate;
  return model;
}

/**
 * special_tokens_map.json, where tokenizers saved before transformers 4.34 keep their bos_token, eos_token, unk_token
 * and pad_token (their tokenizer_config.json often names none). transformers reads it when tokenizer_config.json has
 * no added_tokens_decoder (which newer versions write beside the tokens), and its tokens then replace the config's.
 * Unread, such a folder had no EOS (generation ran past the end of the reply) and a template's {{ bos_token }} was "".
 */
async function withSpecialTokensMap(dir: string, tokenizerConfig: Record<string, unknown>): Promise<Record<string, unknown>> {
  const path = join(dir, 'special_tokens_map.json');
  if ('added_tokens_decoder' in tokenizerConfig || !existsSync(path)) return tokenizerConfig;
  const map = await readJson(path);
  const merged = { ...tokenizerConfig };
  for (const [key, value] of Object.entries(map)) {
    if (!key.endsWith('_token') || value === null) continue;
    // A token is its text or an AddedToken object with that text as "content".
    if (typeof value !== 'string' && !(isRecord(value) && typeof value['content'] === 'string')) {
      throw new ModelFormatError(`${path}: ${key} is ${shownJson(value)}, not a token (a string, or an object with ` +
        'a "content" string)');
    }
    merged[key] = value;
  }
  return merged;
}

async function readJson(path: string): Promise<Record<string, unknown>> {
  const text = await readModelText(path);
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch (error) {
    throw new ModelFormatError(`${path} is not valid JSON (${(error as Error).message})`);
  }
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw new ModelFormatError(`${path} is not a JSON object`);
  }
  return value as Record<string, unknown>;
}

function hfDetails(configJson: Record<string, unknown>): Record<string, string | number> {
  const details: Record<string, string | number> = {};
  const architectures = configJson['architectures'];
  if (Array.isArray(architectures)) details['architectures'] = architectures.join(', ');
  for (const key of ['model_type', 'torch_dtype', 'transformers_version']) {
    const v = configJson[key];
    if (typeof v === 'string' || typeof v === 'number') details[key] = v;
  }
  return details;
}

// ---------------------------------------------------------------------------------------------------------------
// config.json

/** A config.json value as errors show it: its JSON, cut short. */
function shownJson(value: unknown): string {
  const text = JSON.stringify(value) ?? String(value);
  return text.length > 40 ? `${text.slice(0, 40)}...` : text;
}

/**
 * An optional number of config.json: undefined when absent or null, refused when of another type. Read as absent, a
 * string "0.75" or "168" (a hand-edited file) gave the default (every dimension rotated, the head size's attention
 * scale): another model than the one written, silently.
 */
function optionalNumber(json: Record<string, unknown>, key: string, source: string): number | undefined {
  const value = json[key];
  if (value === undefined || value === null) return undefined;
  if (typeof value !== 'number') throw new ModelFormatError(`${source}: config.json ${key} is ${shownJson(value)}, not a number`);
  return value;
}

/** An optional flag of config.json: undefined when absent or null, refused when not true or false ("true", 1). */
function optionalFlag(json: Record<string, unknown>, key: string, source: string): boolean | undefined {
  const value = json[key];
  if (value === undefined || value === null) return undefined;
  if (typeof value !== 'boolean') {
    throw new ModelFormatError(`${source}: config.json ${key} is ${shownJson(value)}, not true or false`);
  }
  return value;
}

export function hfModelConfig(json: Record<string, unknown>, name: string, source = 'config.json'): ModelConfig {
  const architectures = json['architectures'];
  if (Array.isArray(architectures) && architectures.length === 0) {
    throw new ModelFormatError(`${source}: config.json "architectures" is an empty list: it must name the model class `
      + `(supported: ${Object.keys(ARCHITECTURES).join(', ')})`);
  }
  const declared = Array.isArray(architectures) ? String(architectures[0]) : undefined;
  // Own keys only: "constructor" or "toString" would otherwise find Object.prototype's and load as an architecture.
  const architecture = declared !== undefined && Object.hasOwn(ARCHITECTURES, declared) ? ARCHITECTURES[declared] : undefined;
  if (!architecture) {
    throw new ModelFormatError(`${source}: architecture ${declared ?? '(config.json has no "architectures")'} is not ` +
      `supported (supported: ${Object.keys(ARCHITECTURES).join(', ')})`);
  }
  const num = (key: string, fallback?: number): number => {
    const v = json[key];
    if (typeof v === 'number') return v;
    if ((v === undefined || v === null) && fallback !== undefined) return fallback;
    throw new ModelFormatError(`${source}: config.json ${key} is ${v === undefined ? 'missing' : 'not a number'}`);
  };
  /** A key that counts something (layers, heads, tokens): a positive whole number. */
  const count = (key: string, fallback?: number): number => {
    const v = num(key, fallback);
    requireCount(source, `config.json ${key}`, v);
    return v;
  };
  const dim = count('hidden_size');
  const numHeads = count('num_attention_heads');
  const givenHeadDim = optionalNumber(json, 'head_dim', source);
  const headDim = givenHeadDim ?? dim / numHeads;
  if (givenHeadDim === undefined && !Number.isInteger(headDim)) {
    throw new ModelFormatError(`${source}: hidden_size ${dim} is not divisible by num_attention_heads ${numHeads}`);
  }
  requireCount(source, 'config.json head_dim', headDim);
  const rope = hfRopeParameters(json, source);
  const rotaryFactor = optionalNumber(json, 'partial_rotary_factor', source) ??
    (rope.global ? optionalNumber(rope.global, 'partial_rotary_factor', `${source} (rope_parameters)`) : undefined);
  if (rotaryFactor !== undefined && rotaryFactor > 1) {
    throw new ModelFormatError(`${source}: config.json partial_rotary_factor is ${rotaryFactor}; a head rotates at most ` +
      'all of its dimensions (1)');
  }
  const numKvHeads = count('num_key_value_heads', numHeads);
  if (numHeads % numKvHeads !== 0) {
    throw new ModelFormatError(`${source}: num_attention_heads ${numHeads} is not a multiple of num_key_value_heads ${numKvHeads}`);
  }
  const config: ModelConfig = {
    architecture,
    name,
    vocabSize: count('vocab_size'),
    dim,
    numLayers: count('num_hidden_layers'),
    numHeads,
    numKvHeads,
    headDim,
    ffnDim: count('intermediate_size'),
    contextLength: count('max_position_embeddings'),
    rmsNormEps: num('rms_norm_eps', CLASS_DEFAULTS[declared!]!.rmsNormEps),
    ropeTheta: ropeBase(json, rope.global, rope.field, source) ?? CLASS_DEFAULTS[declared!]!.ropeTheta,
    // Phi-4-mini rotates 3/4 of each head (partial_rotary_factor 0.75).
    ropeDim: rotaryFactor !== undefined && rotaryFactor < 1 ? 2 * Math.floor((rotaryFactor * headDim) / 2) : headDim,
    ropeStyle: 'neox',
    // Qwen2 always has Q/K/V biases; Llama and Qwen3 have them only when attention_bias says so.
    qkvBias: architecture === 'qwen2' || optionalFlag(json, 'attention_bias', source) === true,
    // Gemma 3's configuration class ties them unless told otherwise.
    tiedEmbeddings: optionalFlag(json, 'tie_word_embeddings', source) ?? architecture === 'gemma3',
  };
  requireAtMost(source, 'config.json num_hidden_layers', config.numLayers, MAX_LAYERS);
  requirePositive(source, 'config.json rms_norm_eps', config.rmsNormEps);
  requirePositive(source, 'config.json rope_theta', config.ropeTheta);
  requireRopeDim(source, config.ropeDim === headDim ? 'the rotated dimension count'
    : `the rotated dimension count (partial_rotary_factor ${String(json['partial_rotary_factor'])})`, config.ropeDim, headDim);
  if (architecture === 'qwen3' || architecture === 'qwen3moe' || architecture === 'gemma3') config.qkNorm = true;
  const mistralWindow = declared === 'MistralForCausalLM' ? optionalNumber(json, 'sliding_window', source) : undefined;
  if (mistralWindow !== undefined && mistralWindow > 0) {
    config.slidingWindow = mistralWindow;
    requireCount(source, 'config.json sliding_window', config.slidingWindow);
  }
  if (declared === 'Qwen2ForCausalLM' || declared === 'Qwen3ForCausalLM' || declared === 'Qwen3MoeForCausalLM') {
    refuseQwenSlidingWindow(json, config.numLayers, source);
  }
  if (architecture === 'gemma3') hfGemma3Config(json, config, source, rope.local);
  const moe = hfMoeConfig(json, declared!, source);
  if (moe && moe.numExpertsUsed > moe.numExperts) {
    throw new ModelFormatError(`${source}: config.json num_experts_per_tok ${moe.numExpertsUsed} is more than the ` +
      `${moe.numExperts} experts`);
  }
  if (moe) {
    requireAtMost(source, `config.json ${declared === 'MixtralForCausalLM' ? 'num_local_experts' : 'num_experts'}`,
      moe.numExperts, MAX_EXPERTS);
    config.moe = moe;
  }
  const ropeScaling = hfScalingOf(json, rope, config.ropeDim, source);
  if (ropeScaling) config.ropeScaling = ropeScaling;
  return config;
}

/**
 * Gemma 3 (Gemma3TextConfig): sliding-window layers from layer_types, else every sliding_window_pattern-th layer
 * global; the local layers' RoPE base rope_local_base_freq; scores scaled by query_pre_attn_scalar^-0.5; GELU-tanh;
 * the optional final logit softcap. The same fields as a GGUF of the model gives (gguf-model.ts ggufGemma3).
 */
function hfGemma3Config(json: Record<string, unknown>, config: ModelConfig, source: string,
  localRope: Record<string, unknown> | undefined): void {
  const activation = json['hidden_activation'] ?? 'gelu_pytorch_tanh';
  if (activation !== 'gelu_pytorch_tanh' && activation !== 'gelu') {
    throw new ModelFormatError(`${source}: Gemma 3 with hidden_activation ${JSON.stringify(activation)} is not supported`);
  }
  if (json['attn_logit_softcapping'] !== undefined && json['attn_logit_softcapping'] !== null) {
    throw new ModelFormatError(`${source}: attn_logit_softcapping is not supported (Gemma 3 has none)`);
  }
  config.embeddingScale = Math.sqrt(config.dim);
  config.postNorms = true;
  config.ffnActivation = 'gelu_tanh';
  const window = optionalNumber(json, 'sliding_window', source);
  if (window !== undefined && window > 0) {
    requireCount(source, 'config.json sliding_window', window);
    const types = json['layer_types'];
    // Any other entry (a typo, a number) would have been read as a global layer, silently.
    if (types !== undefined && types !== null &&
      !(Array.isArray(types) && types.every((t) => t === 'sliding_attention' || t === 'full_attention'))) {
      throw new ModelFormatError(`${source}: config.json layer_types must be a list of "sliding_attention" and ` +
        `"full_attention", got ${shownJson(types)}`);
    }
    const layers = Array.isArray(types)
      ? types.map((t) => t === 'sliding_attention')
      : gemma3WindowLayers(config.numLayers, optionalNumber(json, 'sliding_window_pattern', source) ?? GEMMA3_DEFAULT_WINDOW_PATTERN);
    if (layers.length !== config.numLayers) {
      throw new ModelFormatError(`${source}: layer_types has ${layers.length} entries for ${config.numLayers} layers`);
    }
    if (layers.some((w) => w)) {
      config.slidingWindow = window;
      if (!layers.every((w) => w)) config.slidingWindowLayers = layers;
      config.ropeLocalTheta = ropeBase(json, localRope, 'rope_parameters.sliding_attention', source, 'rope_local_base_freq') ??
        GEMMA3_DEFAULT_LOCAL_ROPE_THETA;
      requirePositive(source, 'config.json rope_local_base_freq', config.ropeLocalTheta);
    }
  }
  const scalar = optionalNumber(json, 'query_pre_attn_scalar', source);
  if (scalar !== undefined && scalar !== config.headDim) {
    requirePositive(source, 'config.json query_pre_attn_scalar', scalar);
    config.attentionScale = 1 / Math.sqrt(scalar);
  }
  const softcap = optionalNumber(json, 'final_logit_softcapping', source);
  if (softcap !== undefined && softcap > 0) config.finalLogitSoftcap = softcap;
}

/** Qwen2/Qwen3's max_window_layers when config.json gives none (the configuration classes' default). */
const QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28;

/**
 * Qwen2/Qwen3 with use_sliding_window: transformers and vLLM attend within sliding_window tokens on the layers from
 * max_window_layers on; Conduit runs Qwen layers with full attention, which past the window is another model. The
 * released models say false (or put every layer below max_window_layers), and load.
 */
function refuseQwenSlidingWindow(json: Record<string, unknown>, numLayers: number, source: string): void {
  if (optionalFlag(json, 'use_sliding_window', source) !== true) return;
  const window = optionalNumber(json, 'sliding_window', source);
  const firstWindowLayer = optionalNumber(json, 'max_window_layers', source) ?? QWEN_DEFAULT_MAX_WINDOW_LAYERS;
  if (window === undefined || window <= 0 || firstWindowLayer >= numLayers) return;
  throw new ModelFormatError(`${source}: config.json use_sliding_window is true (a ${window}-token window on layers ` +
    `${firstWindowLayer} to ${numLayers - 1}); Qwen models with a sliding window are not supported`);
}

/** Experts of Qwen3-MoE (every layer sparse) and Mixtral; undefined for a dense architecture. */
function hfMoeConfig(json: Record<string, unknown>, declared: string, source: string): MoeConfig | undefined {
  const num = (key: string): number => {
    const v = json[key];
    if (typeof v !== 'number') throw new ModelFormatError(`${source}: config.json ${key} is missing or not a number`);
    requireCount(source, `config.json ${key}`, v);
    return v;
  };
  if (declared === 'MixtralForCausalLM') {
    return { numExperts: num('num_local_experts'), numExpertsUsed: num('num_experts_per_tok'),
      expertFfnDim: num('intermediate_size'), normalizeTopK: true };
  }
  if (declared !== 'Qwen3MoeForCausalLM') return undefined;
  const denseLayers = json['mlp_only_layers'];
  const sparseStep = json['decoder_sparse_step'] ?? 1;
  if ((Array.isArray(denseLayers) && denseLayers.length > 0) || sparseStep !== 1) {
    throw new ModelFormatError(`${source}: Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step) is not ` +
      'supported');
  }
  // Absent, norm_topk_prob is Qwen3MoeConfig's default, false (the released models all say true).
  return { numExperts: num('num_experts'), numExpertsUsed: num('num_experts_per_tok'),
    expertFfnDim: num('moe_intermediate_size'), normalizeTopK: optionalFlag(json, 'norm_topk_prob', source) ?? false };
}

/**
 * transformers 5 saves RoPE as `rope_parameters`: rope_theta and the scaling fields in one object (no top-level
 * rope_theta or rope_scaling), or, for models with two kinds of attention layer (Gemma 3), one such object per layer
 * type. Read as absent, a Llama 3.1 saved so would run with a base of 10000 and no scaling: another model, silently.
 */
interface HfRopeParameters {
  /** The (global attention layers') parameters; undefined when config.json has no rope_parameters. */
  global?: Record<string, unknown>;
  /** Gemma 3's sliding-window layers' parameters. */
  local?: Record<string, unknown>;
  /** How errors name `global`. */
  field: string;
}

function hfRopeParameters(json: Record<string, unknown>, source: string): HfRopeParameters {
  const value = json['rope_parameters'];
  if (value === undefined || value === null) return { field: 'rope_parameters' };
  if (!isRecord(value)) throw new ModelFormatError(`${source}: config.json rope_parameters is ${shownJson(value)}, not an object`);
  if (!('full_attention' in value) && !('sliding_attention' in value)) return { global: value, field: 'rope_parameters' };
  const part = (key: string): Record<string, unknown> | undefined => {
    const v = value[key];
    if (v === undefined || v === null) return undefined;
    if (!isRecord(v)) throw new ModelFormatError(`${source}: config.json rope_parameters.${key} is ${shownJson(v)}, not an object`);
    return v;
  };
  const result: HfRopeParameters = { field: 'rope_parameters.full_attention' };
  const global = part('full_attention');
  const local = part('sliding_attention');
  if (global) result.global = global;
  if (local) {
    const type = local['rope_type'] ?? local['type'];
    // The sliding-window layers rotate with their base alone (ModelConfig.ropeLocalTheta takes no scaling).
    if (type !== undefined && type !== null && type !== 'default') {
      throw new ModelFormatError(`${source}: config.json rope_parameters.sliding_attention rope_type ` +
        `${JSON.stringify(type)} is not supported (the sliding-window layers' RoPE must be "default")`);
    }
    result.local = local;
  }
  return result;
}

/**
 * A RoPE base given at the top of config.json (`key`) or in its rope_parameters object (`rope_theta`): undefined when
 * neither gives one, refused when both do and differ (which one the model was trained with is unknown).
 */
function ropeBase(json: Record<string, unknown>, parameters: Record<string, unknown> | undefined, field: string,
  source: string, key = 'rope_theta'): number | undefined {
  const top = optionalNumber(json, key, source);
  const inner = parameters ? optionalNumber(parameters, 'rope_theta', `${source} (${field})`) : undefined;
  if (top !== undefined && inner !== undefined && top !== inner) {
    throw new ModelFormatError(`${source}: config.json ${key} ${top} and ${field}.rope_theta ${inner} differ; ` +
      'which one the model was trained with is unknown');
  }
  return inner ?? top;
}

/**
 * The scaling of rope_parameters (its rope_type, "default" when it names none, as transformers reads it) or of the
 * older rope_scaling; refused when both are given and say different things.
 */
function hfScalingOf(json: Record<string, unknown>, rope: HfRopeParameters, ropeDim: number,
  source: string): RopeScaling | undefined {
  const legacy = hfRopeScaling(json['rope_scaling'], json, ropeDim, source);
  if (!rope.global) return legacy;
  const typed = rope.global['rope_type'] ?? rope.global['type'];
  const current = typed === undefined || typed === null ? undefined : hfRopeScaling(rope.global, json, ropeDim, source, rope.field);
  if (json['rope_scaling'] !== undefined && json['rope_scaling'] !== null &&
    JSON.stringify(legacy) !== JSON.stringify(current)) {
    throw new ModelFormatError(`${source}: config.json has both rope_scaling and ${rope.field}, which differ; ` +
      'which scaling the model was trained with is unknown');
  }
  return current;
}

function hfRopeScaling(value: unknown, json: Record<string, unknown>, ropeDim: number,
  source: string, field = 'rope_scaling'): RopeScaling | undefined {
  if (value === undefined || value === null) return undefined;
  if (typeof value !== 'object' || Array.isArray(value)) throw new ModelFormatError(`${source}: ${field} is not an object`);
  const s = value as Record<string, unknown>;
  const type = s['rope_type'] ?? s['type'];
  if (type === undefined || type === null) {
    throw new ModelFormatError(`${source}: ${field} has no rope_type (or type): which scaling is meant is unknown`);
  }
  const num = (key: string): number => {
    const v = s[key];
    if (typeof v !== 'number') throw new ModelFormatError(`${source}: ${field}.${key} is missing or not a number`);
    return v;
  };
  /** A factor of the scaling: a positive finite number, else every rotated frequency is infinite, NaN or reversed. */
  const positive = (key: string): number => {
    const v = num(key);
    requirePositive(source, `config.json ${field}.${key}`, v);
    return v;
  };
  switch (type) {
    case 'default': return undefined;
    case 'linear': return { type: 'linear', factor: positive('factor') };
    case 'llama3': {
      const scaling: RopeScaling = {
        type: 'llama3',
        factor: positive('factor'),
        lowFreqFactor: positive('low_freq_factor'),
        highFreqFactor: positive('high_freq_factor'),
        originalContextLength: num('original_max_position_embeddings'),
      };
      requireCount(source, `config.json ${field}.original_max_position_embeddings`, scaling.originalContextLength);
      // The blend between them divides by their difference.
      if (!(scaling.highFreqFactor > scaling.lowFreqFactor)) {
        throw new ModelFormatError(`${source}: ${field}.high_freq_factor ${scaling.highFreqFactor} is not above ` +
          `low_freq_factor ${scaling.lowFreqFactor}`);
      }
      return scaling;
    }
    case 'longrope':
    case 'su': return hfLongRope(s, json, ropeDim, source, field);
    default: throw new ModelFormatError(`${source}: ${field} type ${JSON.stringify(type)} is not supported ` +
      '(supported: default, linear, llama3, longrope)');
  }
}

/**
 * Phi-3's LongRoPE (transformers' longrope): long_factor for a context longer than original_max_position_embeddings
 * (here: max_position_embeddings, the context served), else short_factor; attention_factor, or
 * sqrt(1 + ln(s) / ln(original)) with s = max / original. Factors and attention factor are rounded to f32 as
 * llama.cpp's converter stores them, so a folder and its GGUF give the same config.
 */
function hfLongRope(s: Record<string, unknown>, json: Record<string, unknown>, ropeDim: number,
  source: string, field: string): RopeScaling {
  const numbers = (key: string): number[] => {
    const v = s[key];
    if (!Array.isArray(v) || v.length !== ropeDim / 2 || !v.every((x) => typeof x === 'number' && Number.isFinite(x) && x > 0)) {
      throw new ModelFormatError(`${source}: ${field}.${key} must be ${ropeDim / 2} positive numbers`);
    }
    return v.map((x) => Math.fround(x as number));
  };
  const original = s['original_max_position_embeddings'] ?? json['original_max_position_embeddings'];
  const max = json['max_position_embeddings'];
  if (typeof original !== 'number' || typeof max !== 'number') {
    throw new ModelFormatError(`${source}: LongRoPE needs original_max_position_embeddings and max_position_embeddings`);
  }
  requireCount(source, 'config.json original_max_position_embeddings (LongRoPE)', original);
  const scale = max / original;
  const given = s['attention_factor'];
  // Read as absent, a string "1.19" gave the computed factor instead of the one written.
  if (given !== undefined && given !== null && typeof given !== 'number') {
    throw new ModelFormatError(`${source}: ${field}.attention_factor is ${shownJson(given)}, not a number`);
  }
  const attentionFactor = Math.fround(typeof given === 'number' ? given
    : scale > 1 ? Math.sqrt(1 + Math.log(scale) / Math.log(original)) : 1);
  requirePositive(source, `config.json ${field}.attention_factor`, attentionFactor);
  numbers(max > original ? 'short_factor' : 'long_factor'); // the set not used is checked too
  return { type: 'longrope', factors: numbers(max > original ? 'long_factor' : 'short_factor'), attentionFactor,
    originalContextLength: original };
}

// ---------------------------------------------------------------------------------------------------------------
// Weights

/** Tensor name -> the safetensors file holding it. */
type TensorIndex = Map<string, SafetensorsFile>;

async function openSafetensors(dir: string): Promise<TensorIndex> {
  const indexPath = join(dir, 'model.safetensors.index.json');
  const index: TensorIndex = new Map();
  const open = async (shard: string, what: string): Promise<SafetensorsFile> => {
    const path = join(dir, shard);
    if (!existsSync(path)) throw new ModelFormatError(`${dir}: shard ${shard} ${what} is missing`);
    return parseSafetensors(await readModelFile(path), path);
  };

  if (existsSync(indexPath)) {
    const weightMap = (await readJson(indexPath))['weight_map'];
    if (typeof weightMap !== 'object' || weightMap === null || Array.isArray(weightMap)) {
      throw new ModelFormatError(`${indexPath} has no weight_map object`);
    }
    const files = new Map<string, SafetensorsFile>();
    for (const [name, shard] of Object.entries(weightMap as Record<string, unknown>)) {
      // A shard is a file beside the index: a path elsewhere (../, /) would read another folder's files.
      if (typeof shard !== 'string' || shard === '' || shard === '.' || shard === '..' || /[/\\]/.test(shard)) {
        throw new ModelFormatError(`${indexPath}: weight_map gives tensor ${name} the shard ${JSON.stringify(shard)}, ` +
          'which is not the name of a file in the folder');
      }
      let file = files.get(shard);
      if (!file) files.set(shard, (file = await open(shard, 'listed in the index')));
      if (!file.hasTensor(name)) {
        throw new ModelFormatError(`${indexPath} lists tensor ${name} in shard ${shard}, which does not hold it ` +
          '(the index and the shards do not belong together)');
      }
      index.set(name, file);
    }
    // transformers reads every tensor of a listed shard; one the index does not list would be left out here.
    for (const [shard, file] of files) {
      for (const name of file.entries.keys()) {
        const listed = index.get(name);
        // A second copy in another shard: transformers and vLLM load every listed shard's tensors, so the one read
        // last would be the model's, maybe not the one the index names.
        if (listed !== undefined && listed !== file) {
          throw new ModelFormatError(`${dir}: tensor ${name} is in both ${basename(listed.source)} and ${shard}; ` +
            `which one is meant is unclear (${basename(indexPath)} names ${basename(listed.source)})`);
        }
        if (!index.has(name)) {
          throw new ModelFormatError(`${dir}: shard ${shard} holds tensor ${name}, which ${basename(indexPath)} does ` +
            'not list (the index and the shards do not belong together)');
        }
      }
    }
    return index;
  }

  const shardNames = (await readdir(dir)).filter((f) => f.endsWith('.safetensors')).sort();
  if (shardNames.length === 0) throw new ModelFormatError(`${dir}: no *.safetensors files`);
  const shardOf = new Map<string, string>();
  for (const shard of shardNames) {
    const file = await open(shard, 'in the folder');
    for (const name of file.entries.keys()) {
      const previous = shardOf.get(name);
      if (previous !== undefined) {
        throw new ModelFormatError(`${dir}: tensor ${name} is in both ${previous} and ${shard}; ` +
          'which one is meant is unclear (a model.safetensors.index.json would say)');
      }
      shardOf.set(name, shard);
      index.set(name, file);
    }
  }
  return index;
}

/** HF parameter names of each layer field. */
const LAYER_TENSORS: Readonly<Record<keyof LayerWeights, string>> = {
  attnNorm: 'input_layernorm.weight',
  wq: 'self_attn.q_proj.weight',
  wk: 'self_attn.k_proj.weight',
  wv: 'self_attn.v_proj.weight',
  wo: 'self_attn.o_proj.weight',
  bq: 'self_attn.q_proj.bias',
  bk: 'self_attn.k_proj.bias',
  bv: 'self_attn.v_proj.bias',
  qNorm: 'self_attn.q_norm.weight',
  kNorm: 'self_attn.k_norm.weight',
  ffnNorm: 'post_attention_layernorm.weight',
  attnPostNorm: 'post_attention_layernorm.weight',
  ffnPostNorm: 'post_feedforward_layernorm.weight',
  wGate: 'mlp.gate_proj.weight',
  wUp: 'mlp.up_proj.weight',
  wDown: 'mlp.down_proj.weight',
  ffnGateInp: 'mlp.gate.weight',
};

const BIAS_FIELDS: ReadonlySet<keyof LayerWeights> = new Set(['bq', 'bk', 'bv']);
const QK_NORM_FIELDS: ReadonlySet<keyof LayerWeights> = new Set(['qNorm', 'kNorm']);
const FFN_FIELDS: ReadonlySet<keyof LayerWeights> = new Set(['wGate', 'wUp', 'wDown', 'ffnGateInp']);
const POST_NORM_FIELDS: ReadonlySet<keyof LayerWeights> = new Set(['attnPostNorm', 'ffnPostNorm']);

/**
 * Gemma 3's RMS norms compute x * (1 + weight) and its checkpoints store `weight`; the backends multiply by the
 * stored vector, as llama.cpp does with the converted files (which hold 1 + weight). So the folder's norms are
 * loaded as f32 copies with the 1 added.
 */
function plusOne(t: Tensor): Tensor {
  const values = dequantizeTensor(t);
  for (let i = 0; i < values.length; i++) values[i] = values[i]! + 1;
  return { name: t.name, type: GgmlType.F32, shape: t.shape, data: new Uint8Array(values.buffer) };
}

/** HF names of a layer's experts: the router, and expert e's gate, up and down matrices. */
function expertNames(mixtral: boolean, layer: number): {
  router: string; gate: (e: number) => string; up: (e: number) => string; down: (e: number) => string;
} {
  const p = `model.layers.${layer}.`;
  if (mixtral) {
    return { router: `${p}block_sparse_moe.gate.weight`, gate: (e) => `${p}block_sparse_moe.experts.${e}.w1.weight`,
      up: (e) => `${p}block_sparse_moe.experts.${e}.w3.weight`, down: (e) => `${p}block_sparse_moe.experts.${e}.w2.weight` };
  }
  return { router: `${p}mlp.gate.weight`, gate: (e) => `${p}mlp.experts.${e}.gate_proj.weight`,
    up: (e) => `${p}mlp.experts.${e}.up_proj.weight`, down: (e) => `${p}mlp.experts.${e}.down_proj.weight` };
}

/**
 * One expert matrix per expert (HF) as one tensor with a third dimension (llama.cpp's ffn_*_exps layout, what the
 * backends take): the experts' bytes copied back to back. Every expert must have the same type and shape.
 */
function stackExperts(name: string, experts: Tensor[], source: string): Tensor {
  const first = experts[0]!;
  for (const t of experts) {
    if (t.type !== first.type || t.shape.join() !== first.shape.join()) {
      throw new ModelFormatError(`${source}: expert tensor ${t.name} differs in type or shape from ${first.name}`);
    }
  }
  const data = new Uint8Array(first.data.byteLength * experts.length);
  experts.forEach((t, e) => data.set(t.data, e * first.data.byteLength));
  return { name, type: first.type, shape: [...first.shape, experts.length], data };
}

/**
 * Tensors a checkpoint may carry that the model does not need: RoPE's inverse frequencies (older transformers
 * versions saved the buffer, per layer or once; they follow from rope_theta, head_dim and rope_scaling, from which
 * the backends compute them, and transformers no longer loads them either).
 */
const IGNORABLE_HF_TENSOR = /^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.(original_)?inv_freq$/;

export function hfModelWeights(index: TensorIndex, config: ModelConfig, source: string): ModelWeights {
  // Every tensor read here; any other tensor in the checkpoint makes the load fail (refuseUnusedTensors).
  const used = new Set<string>();
  const get = (name: string): Tensor => {
    const file = index.get(name);
    if (!file) throw new ModelFormatError(`${source}: tensor ${name} is missing`);
    used.add(name);
    return file.tensor(name);
  };
  const tokenEmbedding = get('model.embed_tokens.weight');
  const layers: LayerWeights[] = [];
  for (let i = 0; i < config.numLayers; i++) {
    const layer: Partial<LayerWeights> = {};
    const p = `model.layers.${i}.`;
    if (config.architecture === 'phi3') {
      // Fused Q/K/V and gate/up (gate first), split into views.
      const kvDim = config.numKvHeads * config.headDim;
      [layer.wq, layer.wk, layer.wv] = splitRows(get(`${p}self_attn.qkv_proj.weight`),
        [config.numHeads * config.headDim, kvDim, kvDim], source);
      [layer.wGate, layer.wUp] = splitRows(get(`${p}mlp.gate_up_proj.weight`), [config.ffnDim, config.ffnDim], source);
    }
    for (const [field, suffix] of Object.entries(LAYER_TENSORS) as [keyof LayerWeights, string][]) {
      if (layer[field]) continue;
      if (BIAS_FIELDS.has(field) && !config.qkvBias) continue;
      if (QK_NORM_FIELDS.has(field) && !config.qkNorm) continue;
      if (POST_NORM_FIELDS.has(field) && !config.postNorms) continue;
      if (FFN_FIELDS.has(field) && (config.moe || field === 'ffnGateInp')) continue;
      // Gemma 3: post_attention_layernorm is the attention block's post-norm, the feed-forward's pre-norm has a name
      // of its own.
      const name = config.postNorms && field === 'ffnNorm' ? 'pre_feedforward_layernorm.weight' : suffix;
      layer[field] = get(`model.layers.${i}.${name}`);
    }
    if (config.architecture === 'gemma3') {
      for (const field of ['attnNorm', 'ffnNorm', 'attnPostNorm', 'ffnPostNorm', 'qNorm', 'kNorm'] as const) {
        layer[field] = plusOne(layer[field]!);
      }
    }
    if (config.moe) {
      const names = expertNames(index.has(expertNames(true, i).router), i);
      const experts = Array.from({ length: config.moe.numExperts }, (_, e) => e);
      layer.ffnGateInp = get(names.router);
      layer.wGate = stackExperts(`blk.${i}.ffn_gate_exps`, experts.map((e) => get(names.gate(e))), source);
      layer.wUp = stackExperts(`blk.${i}.ffn_up_exps`, experts.map((e) => get(names.up(e))), source);
      layer.wDown = stackExperts(`blk.${i}.ffn_down_exps`, experts.map((e) => get(names.down(e))), source);
    }
    layers.push(layer as LayerWeights);
  }
  // Checkpoints that tie embeddings usually omit lm_head; some store a copy anyway, which we ignore (transformers
  // ties lm_head to the embeddings whatever the file holds). An untied model without lm_head is missing its output
  // projection (transformers would start it from random values); the embeddings are not it.
  if (!config.tiedEmbeddings && !index.has('lm_head.weight')) {
    throw new ModelFormatError(`${source}: tensor lm_head.weight is missing, and config.json does not tie the output ` +
      'projection to the embeddings (tie_word_embeddings is not true)');
  }
  const output = config.tiedEmbeddings ? tokenEmbedding : get('lm_head.weight');
  const outputNorm = get('model.norm.weight');
  for (const name of index.keys()) if (IGNORABLE_HF_TENSOR.test(name) || name === 'lm_head.weight') used.add(name);
  refuseUnusedTensors(index.keys(), used, config, source);
  return { tokenEmbedding, layers, outputNorm: config.architecture === 'gemma3' ? plusOne(outputNorm) : outputNorm, output };
}

// ---------------------------------------------------------------------------------------------------------------
// Chat template

/**
 * The chat template, in transformers' order: a chat_template.jinja file (newer transformers versions save the
 * template there; when a folder also has one in tokenizer_config.json, transformers' tokenizer loading lets the file
 * take priority, replacing the config's whole chat_template, named templates included), else tokenizer_config.json's
 * chat_template (a string, or a list of named templates of which we take "default"), else chat_template.json (a
 * processor's older file, which the tokenizer itself never reads, so it comes last).
 */
async function findChatTemplate(dir: string, tokenizerConfig: Record<string, unknown>,
  tokenizerConfigPath: string): Promise<{ value: unknown; path: string } | undefined> {
  const jinjaPath = join(dir, 'chat_template.jinja');
  if (existsSync(jinjaPath)) return { value: await readModelText(jinjaPath), path: jinjaPath };
  const fromConfig = tokenizerConfig['chat_template'];
  if (fromConfig !== undefined && fromConfig !== null) return { value: fromConfig, path: tokenizerConfigPath };
  const jsonPath = join(dir, 'chat_template.json');
  if (existsSync(jsonPath)) {
    const value = (await readJson(jsonPath))['chat_template'];
    if (value !== undefined && value !== null) return { value, path: jsonPath };
  }
  return undefined;
}

function pickTemplate(value: unknown): string | undefined {
  if (typeof value === 'string') return value;
  if (Array.isArray(value)) {
    const named = value as unknown[];
    const chosen = named.find((t) => isRecord(t) && t['name'] === 'default') ?? named[0];
    return isRecord(chosen) && typeof chosen['template'] === 'string' ? chosen['template'] : undefined;
  }
  return undefined;
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

// ---------------------------------------------------------------------------------------------------------------
// RoPE row order

/**
 * For a Q or K projection with `numHeads` heads of `headDim` rows: entry r of the result is the HF (neox-order)
 * row that becomes row r in llama.cpp's interleaved order. Inverting it maps GGUF rows back to HF order.
 */
export function interleavedRowOrder(numHeads: number, headDim: number): Int32Array {
  if (headDim % 2 !== 0) throw new RangeError(`head dimension ${headDim} is odd`);
  const half = headDim / 2;
  const order = new Int32Array(numHeads * headDim);
  for (let h = 0; h < numHeads; h++) {
    for (let j = 0; j < half; j++) {
      for (let k = 0; k < 2; k++) order[h * headDim + 2 * j + k] = h * headDim + k * half + j;
    }
  }
  return order;
}
