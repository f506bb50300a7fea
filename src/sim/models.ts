// Model profiles for the performance model: the shapes that decide how many bytes a step streams and how many FLOPs
// it does. Built-in profiles carry the published Hugging Face configs of Llama 3.1, Qwen2.5 and the mixture-of-experts
// models Qwen3-30B-A3B, Mixtral 8x7B and DeepSeek-V3; any ModelConfig (GGUF or config.json) converts with
// modelProfileFromConfig, so a model Conduit can load can also be simulated.
//
// Mixture of experts: every expert's weights count towards memory, but a token multiplies by only its top-k experts
// (plus any shared ones), so FLOPs follow the active parameters, and a step streams the experts its tokens chose: with
// T tokens routed uniformly, E * (1 - (1 - k/E)^T) distinct experts per layer (k at T = 1, all E for large batches).

import type { ModelConfig } from '../model/config.ts';

export interface ModelProfile {
  id: string;
  name: string;
  numLayers: number;
  hiddenDim: number;
  numHeads: number;
  numKvHeads: number;
  headDim: number;
  /** Intermediate size of the SwiGLU block (gate, up and down are each hiddenDim x ffnDim). */
  ffnDim: number;
  vocabSize: number;
  /** The output projection is the embedding matrix (counted once). */
  tiedEmbeddings: boolean;
  /** Q, K and V projections carry biases (Qwen2). */
  qkvBias: boolean;
  /** Bytes per weight element: 2 for BF16, 1 for FP8. */
  weightBytesPerParam: number;
  /** Bytes per cached K or V element: 2 for BF16, 1 for an FP8 KV cache. */
  kvBytesPerElement: number;
  /** Bytes per activation element moved between GPUs (the all-reduced hidden states, gathered logits). */
  activationBytesPerElement: number;
  /** Mixture-of-experts feed-forward blocks (ffnDim is then the dense layers' size, if any). */
  moe?: MoeProfile;
  /** Weights of one layer's attention projections when they are not GQA's Q, K, V, O (DeepSeek's MLA). */
  attentionParamsPerLayer?: number;
  /** K and V elements one token caches per layer when not 2 x numKvHeads x headDim (MLA's compressed latent). */
  kvElementsPerTokenPerLayer?: number;
}

export interface MoeProfile {
  numExperts: number;
  /** Routed experts per token (top-k). */
  numExpertsUsed: number;
  /** Intermediate size of each expert's SwiGLU block. */
  expertFfnDim: number;
  /** Experts every token goes through besides the routed ones (DeepSeek: 1). */
  numSharedExperts: number;
  /** The first layers keep a dense FFN of ffnDim (DeepSeek-V3: 3). */
  numDenseLayers: number;
}

// ---------------------------------------------------------------------------------------------------------------
// Derived quantities

/** Weights of one layer's attention projections: Q, K, V, O (or the profile's own count). */
export function attentionParamCount(m: ModelProfile): number {
  if (m.attentionParamsPerLayer !== undefined) return m.attentionParamsPerLayer;
  const qDim = m.numHeads * m.headDim;
  const kvDim = m.numKvHeads * m.headDim;
  return m.hiddenDim * qDim + 2 * m.hiddenDim * kvDim + qDim * m.hiddenDim;
}

/** Weights of one expert's gate, up and down matrices. */
export function expertParamCount(m: ModelProfile): number {
  return m.moe ? 3 * m.hiddenDim * m.moe.expertFfnDim : 0;
}

function moeLayers(m: ModelProfile): number {
  return m.moe ? m.numLayers - m.moe.numDenseLayers : 0;
}

/**
 * Feed-forward weights of all layers that `experts` routed experts per layer reach: dense layers in full, and in
 * each expert layer the router, the shared experts and `experts` routed ones.
 */
function ffnParamCount(m: ModelProfile, experts: number): number {
  const dense = (m.numLayers - moeLayers(m)) * 3 * m.hiddenDim * m.ffnDim;
  if (!m.moe) return dense;
  const perLayer = m.hiddenDim * m.moe.numExperts + (m.moe.numSharedExperts + experts) * expertParamCount(m);
  return dense + moeLayers(m) * perLayer;
}

/**
 * Weights of the matrices one layer multiplies by: Q, K, V, O and the three FFN projections (of a dense model; with
 * experts, the average per layer of every expert's weights: see modelMatmulParamCount).
 */
export function layerMatmulParamCount(m: ModelProfile): number {
  return modelMatmulParamCount(m) / m.numLayers;
}

/** Matmul weights of all layers, every expert counted. */
export function modelMatmulParamCount(m: ModelProfile): number {
  return m.numLayers * attentionParamCount(m) + ffnParamCount(m, m.moe?.numExperts ?? 0);
}

/** Matmul weights of all layers one token multiplies by: its top-k experts only (what its FLOPs follow). */
export function activeMatmulParamCount(m: ModelProfile): number {
  return m.numLayers * attentionParamCount(m) + ffnParamCount(m, m.moe?.numExpertsUsed ?? 0);
}

/** Expected distinct routed experts per layer that `tokens` tokens choose, routing uniformly at random. */
export function expectedActiveExperts(m: ModelProfile, tokens: number): number {
  if (!m.moe) return 0;
  const { numExperts: e, numExpertsUsed: k } = m.moe;
  if (tokens <= 0) return 0;
  return e * (1 - (1 - k / e) ** tokens);
}

/** Every parameter of one layer: matmul weights, QKV biases when present, and the two RMSNorm scales. */
export function layerParamCount(m: ModelProfile): number {
  const biases = m.qkvBias ? (m.numHeads + 2 * m.numKvHeads) * m.headDim : 0;
  return layerMatmulParamCount(m) + biases + 2 * m.hiddenDim;
}

export function embeddingParamCount(m: ModelProfile): number {
  return m.vocabSize * m.hiddenDim;
}

/** The output projection (LM head) multiplies every sampled position by a vocab x hidden matrix. */
export function lmHeadParamCount(m: ModelProfile): number {
  return m.vocabSize * m.hiddenDim;
}

/** All parameters: layers, final norm, embedding table, and the LM head unless it is the embedding table. */
export function paramCount(m: ModelProfile): number {
  const lmHead = m.tiedEmbeddings ? 0 : lmHeadParamCount(m);
  return m.numLayers * layerParamCount(m) + m.hiddenDim + embeddingParamCount(m) + lmHead;
}

/**
 * Parameters a forward step reads in full. An embedding lookup reads only the rows of the step's tokens, so an
 * untied embedding table is not streamed; a tied one is, because the LM head multiplies by all of it. With experts,
 * only those the step's `tokens` tokens chose are read (expectedActiveExperts); without `tokens`, all of them.
 */
export function streamedParamCount(m: ModelProfile, tokens?: number): number {
  const all = paramCount(m) - (m.tiedEmbeddings ? 0 : embeddingParamCount(m));
  if (!m.moe || tokens === undefined) return all;
  const unread = moeLayers(m) * (m.moe.numExperts - expectedActiveExperts(m, tokens)) * expertParamCount(m);
  return all - unread;
}

/** Parameters of the model, and those one token multiplies by (equal for a dense model). */
export function activeParamCount(m: ModelProfile): number {
  return paramCount(m) - (modelMatmulParamCount(m) - activeMatmulParamCount(m));
}

/** Bytes the weights occupy (what must fit in HBM, split over the tensor-parallel group). */
export function weightBytes(m: ModelProfile): number {
  return paramCount(m) * m.weightBytesPerParam;
}

/**
 * Bytes of weights one forward step streams from HBM, whatever the number of tokens in it (a dense model); with
 * experts, for a step of `tokens` tokens (all experts without it).
 */
export function streamedWeightBytes(m: ModelProfile, tokens?: number): number {
  return streamedParamCount(m, tokens) * m.weightBytesPerParam;
}

/** KV cache bytes one token occupies: K and V, every layer, every KV head (or the profile's own count). */
export function kvBytesPerToken(m: ModelProfile): number {
  const perLayer = m.kvElementsPerTokenPerLayer ?? 2 * m.numKvHeads * m.headDim;
  return m.numLayers * perLayer * m.kvBytesPerElement;
}

/**
 * Matmul FLOPs for one token that goes through every layer and the LM head: 2 per weight (multiply and add).
 * Norms, biases and the embedding lookup do no matmul and are left out.
 */
export function matmulFlopsPerToken(m: ModelProfile): number {
  return 2 * (activeMatmulParamCount(m) + lmHeadParamCount(m));
}

/**
 * Attention FLOPs for one token attending to `contextLen` keys: Q.K^T and P.V each cost 2 x headDim per key per
 * query head, in every layer.
 */
export function attentionFlopsPerToken(m: ModelProfile, contextLen: number): number {
  return 4 * m.numLayers * m.numHeads * m.headDim * contextLen;
}

/** Total FLOPs for one token at a given context length (matmuls plus attention). */
export function flopsPerToken(m: ModelProfile, contextLen: number): number {
  return matmulFlopsPerToken(m) + attentionFlopsPerToken(m, contextLen);
}

// ---------------------------------------------------------------------------------------------------------------
// Built-in profiles (Hugging Face config.json of each model)

function profile(p: Omit<ModelProfile, 'weightBytesPerParam' | 'kvBytesPerElement' | 'activationBytesPerElement'>):
  ModelProfile {
  return { ...p, weightBytesPerParam: 2, kvBytesPerElement: 2, activationBytesPerElement: 2 };
}

/** The Llama 3.1 family: 8 KV heads of 128 dimensions, the 128256-token vocabulary, untied embeddings, no QKV bias. */
function llama31(size: string, numLayers: number, hiddenDim: number, numHeads: number, ffnDim: number): ModelProfile {
  return profile({
    id: `llama-3.1-${size.toLowerCase()}`, name: `Llama 3.1 ${size}`, numLayers, hiddenDim, numHeads, numKvHeads: 8,
    headDim: 128, ffnDim, vocabSize: 128256, tiedEmbeddings: false, qkvBias: false,
  });
}

/** The Qwen2.5 family: heads of 128 dimensions, the 152064-token vocabulary, untied embeddings, QKV bias. */
function qwen25(size: string, numLayers: number, hiddenDim: number, numHeads: number, numKvHeads: number,
  ffnDim: number): ModelProfile {
  return profile({
    id: `qwen2.5-${size.toLowerCase()}`, name: `Qwen2.5 ${size}`, numLayers, hiddenDim, numHeads, numKvHeads,
    headDim: 128, ffnDim, vocabSize: 152064, tiedEmbeddings: false, qkvBias: true,
  });
}

export const LLAMA_3_1_8B = llama31('8B', 32, 4096, 32, 14336);
export const LLAMA_3_1_70B = llama31('70B', 80, 8192, 64, 28672);
export const LLAMA_3_1_405B = llama31('405B', 126, 16384, 128, 53248);
export const QWEN_2_5_7B = qwen25('7B', 28, 3584, 28, 4, 18944);
export const QWEN_2_5_72B = qwen25('72B', 80, 8192, 64, 8, 29568);

/** Qwen3-30B-A3B: 48 layers of 128 experts (8 routed, 768 wide), GQA 32/4 with heads of 128, untied. */
export const QWEN_3_30B_A3B = profile({
  id: 'qwen3-30b-a3b', name: 'Qwen3 30B-A3B', numLayers: 48, hiddenDim: 2048, numHeads: 32, numKvHeads: 4,
  headDim: 128, ffnDim: 6144, vocabSize: 151936, tiedEmbeddings: false, qkvBias: false,
  moe: { numExperts: 128, numExpertsUsed: 8, expertFfnDim: 768, numSharedExperts: 0, numDenseLayers: 0 },
});

/** Mixtral 8x7B: the Mistral 7B layout with 8 experts of 14336, 2 per token. */
export const MIXTRAL_8X7B = profile({
  id: 'mixtral-8x7b', name: 'Mixtral 8x7B', numLayers: 32, hiddenDim: 4096, numHeads: 32, numKvHeads: 8,
  headDim: 128, ffnDim: 14336, vocabSize: 32000, tiedEmbeddings: false, qkvBias: false,
  moe: { numExperts: 8, numExpertsUsed: 2, expertFfnDim: 14336, numSharedExperts: 0, numDenseLayers: 0 },
});

/**
 * DeepSeek-V3 (671B, 37B active): 61 layers, the first 3 dense (18432), then 256 routed experts of 2048 (8 per
 * token) and one shared. Its multi-head latent attention is counted by its projections' weights (q_a 7168x1536, q_b
 * 1536x(128x192), kv_a 7168x576, kv_b 512x(128x256), o 16384x7168) and caches a 576-element latent per token per
 * layer (numKvHeads 1: the latent is replicated, not split, over a tensor-parallel group). Its multi-token
 * prediction module is left out.
 */
export const DEEPSEEK_V3 = profile({
  id: 'deepseek-v3', name: 'DeepSeek-V3', numLayers: 61, hiddenDim: 7168, numHeads: 128, numKvHeads: 1,
  headDim: 128, ffnDim: 18432, vocabSize: 129280, tiedEmbeddings: false, qkvBias: false,
  moe: { numExperts: 256, numExpertsUsed: 8, expertFfnDim: 2048, numSharedExperts: 1, numDenseLayers: 3 },
  attentionParamsPerLayer: 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168,
  kvElementsPerTokenPerLayer: 576,
});

export const MODEL_PROFILES: Readonly<Record<string, ModelProfile>> = {
  [LLAMA_3_1_8B.id]: LLAMA_3_1_8B,
  [LLAMA_3_1_70B.id]: LLAMA_3_1_70B,
  [LLAMA_3_1_405B.id]: LLAMA_3_1_405B,
  [QWEN_2_5_7B.id]: QWEN_2_5_7B,
  [QWEN_2_5_72B.id]: QWEN_2_5_72B,
  [QWEN_3_30B_A3B.id]: QWEN_3_30B_A3B,
  [MIXTRAL_8X7B.id]: MIXTRAL_8X7B,
  [DEEPSEEK_V3.id]: DEEPSEEK_V3,
};

/** The KV cache dtypes the performance model prices, by bytes per element (a profile's kvBytesPerElement). */
export const KV_DTYPE_NAMES: Readonly<Record<number, string>> = { 2: 'BF16', 1: 'FP8' };

/** A profile's KV element as a message names it: "2 bytes, BF16" (just the bytes for a width no dtype has). */
export function describeKvElement(m: ModelProfile): string {
  const bytes = m.kvBytesPerElement;
  const name = KV_DTYPE_NAMES[bytes];
  return `${bytes} byte${bytes === 1 ? '' : 's'}${name !== undefined ? `, ${name}` : ''}`;
}

export interface ProfileDtypes {
  /** Bytes per weight element (default 2, BF16). */
  weightBytesPerParam?: number;
  /** Bytes per KV cache element (default 2, BF16). */
  kvBytesPerElement?: number;
}

/**
 * Looks a built-in model up by id ("llama-3.1-70b", also "llama3.1-70b" or "qwen2.5-72b"), case-insensitively,
 * optionally with other dtypes (an FP8 deployment of the same shapes). Throws a RangeError listing the ids.
 */
export function getModelProfile(id: string, dtypes: ProfileDtypes = {}): ModelProfile {
  const key = id.toLowerCase().replace(/^llama3\./, 'llama-3.').replace(/^qwen-2\.5/, 'qwen2.5');
  const found = Object.hasOwn(MODEL_PROFILES, key) ? MODEL_PROFILES[key] : undefined;
  if (!found) throw new RangeError(`unknown model "${id}"; known: ${Object.keys(MODEL_PROFILES).join(', ')}`);
  return withDtypes(found, dtypes);
}

/** The same shapes with other weight / KV dtypes. */
export function withDtypes(m: ModelProfile, dtypes: ProfileDtypes): ModelProfile {
  const out = {
    ...m,
    weightBytesPerParam: dtypes.weightBytesPerParam ?? m.weightBytesPerParam,
    kvBytesPerElement: dtypes.kvBytesPerElement ?? m.kvBytesPerElement,
  };
  for (const [field, value] of [['weightBytesPerParam', out.weightBytesPerParam], ['kvBytesPerElement',
    out.kvBytesPerElement]] as const) {
    if (!(value > 0)) throw new RangeError(`${field} must be > 0, got ${value}`);
  }
  return out;
}

/**
 * A profile for any model Conduit can load. The config says nothing about the dtype it will be served in on a GPU,
 * so BF16 weights and KV are assumed unless given.
 */
export function modelProfileFromConfig(config: ModelConfig, dtypes: ProfileDtypes = {}): ModelProfile {
  const base: ModelProfile = {
    id: config.name.toLowerCase().replace(/\s+/g, '-'),
    name: config.name,
    numLayers: config.numLayers,
    hiddenDim: config.dim,
    numHeads: config.numHeads,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    ffnDim: config.ffnDim,
    vocabSize: config.vocabSize,
    tiedEmbeddings: config.tiedEmbeddings,
    qkvBias: config.qkvBias,
    weightBytesPerParam: 2,
    kvBytesPerElement: 2,
    activationBytesPerElement: 2,
  };
  if (config.moe) {
    base.moe = { numExperts: config.moe.numExperts, numExpertsUsed: config.moe.numExpertsUsed,
      expertFfnDim: config.moe.expertFfnDim, numSharedExperts: 0, numDenseLayers: 0 };
  }
  return withDtypes(base, dtypes);
}
