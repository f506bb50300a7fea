// Model profiles for the performance model: the shapes that decide how many bytes a step streams and how many FLOPs
// it does. Built-in profiles carry the published Hugging Face configs of Llama 3.1 and Qwen2.5; any ModelConfig
// (GGUF or config.json) converts with modelProfileFromConfig, so a model Conduit can load can also be simulated.

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
}

// ---------------------------------------------------------------------------------------------------------------
// Derived quantities

/** Weights of the matrices one layer multiplies by: Q, K, V, O and the three FFN projections. */
export function layerMatmulParamCount(m: ModelProfile): number {
  const qDim = m.numHeads * m.headDim;
  const kvDim = m.numKvHeads * m.headDim;
  const attention = m.hiddenDim * qDim + 2 * m.hiddenDim * kvDim + qDim * m.hiddenDim;
  const ffn = 3 * m.hiddenDim * m.ffnDim;
  return attention + ffn;
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
 * untied embedding table is not streamed; a tied one is, because the LM head multiplies by all of it.
 */
export function streamedParamCount(m: ModelProfile): number {
  return paramCount(m) - (m.tiedEmbeddings ? 0 : embeddingParamCount(m));
}

/** Bytes the weights occupy (what must fit in HBM, split over the tensor-parallel group). */
export function weightBytes(m: ModelProfile): number {
  return paramCount(m) * m.weightBytesPerParam;
}

/** Bytes of weights one forward step streams from HBM, whatever the number of tokens in it. */
export function streamedWeightBytes(m: ModelProfile): number {
  return streamedParamCount(m) * m.weightBytesPerParam;
}

/** KV cache bytes one token occupies: K and V, every layer, every KV head. */
export function kvBytesPerToken(m: ModelProfile): number {
  return 2 * m.numLayers * m.numKvHeads * m.headDim * m.kvBytesPerElement;
}

/**
 * Matmul FLOPs for one token that goes through every layer and the LM head: 2 per weight (multiply and add).
 * Norms, biases and the embedding lookup do no matmul and are left out.
 */
export function matmulFlopsPerToken(m: ModelProfile): number {
  return 2 * (m.numLayers * layerMatmulParamCount(m) + lmHeadParamCount(m));
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

export const MODEL_PROFILES: Readonly<Record<string, ModelProfile>> = {
  [LLAMA_3_1_8B.id]: LLAMA_3_1_8B,
  [LLAMA_3_1_70B.id]: LLAMA_3_1_70B,
  [LLAMA_3_1_405B.id]: LLAMA_3_1_405B,
  [QWEN_2_5_7B.id]: QWEN_2_5_7B,
  [QWEN_2_5_72B.id]: QWEN_2_5_72B,
};

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
  const found = MODEL_PROFILES[key];
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
  return withDtypes(base, dtypes);
}
