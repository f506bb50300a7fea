// The architecture description every backend computes from. One shape covers the Llama family (Llama 2/3,
// TinyLlama, SmolLM, Mixtral), Qwen2 (QKV bias), Qwen3 (per-head RMS norm on Q and K, a head size of its own),
// Qwen3-MoE, Phi-3 (fused QKV and gate/up, split at load), Mistral (sliding-window attention) and Gemma 3 (scaled
// embeddings, post-norms, GELU, interleaved local and global layers); differences are flags, never separate forward
// passes.

/**
 * GGUF's general.architecture names. Mixtral and Mistral are `llama` (with experts, with a sliding window: llama.cpp
 * writes them so).
 */
export type Architecture = 'llama' | 'qwen2' | 'qwen3' | 'qwen3moe' | 'phi3' | 'gemma3';

/**
 * How RoPE pairs the dimensions of a head.
 * - `interleaved`: pairs (x[2i], x[2i+1]); GGUF llama files (their converter permutes Q/K rows for this).
 * - `neox`: pairs (x[i], x[i + headDim/2]); Hugging Face checkpoints and GGUF qwen2.
 */
export type RopeStyle = 'interleaved' | 'neox';

/** Llama 3.1-style frequency scaling (`rope_scaling.rope_type = "llama3"`). */
export interface Llama3RopeScaling {
  type: 'llama3';
  factor: number;
  lowFreqFactor: number;
  highFreqFactor: number;
  originalContextLength: number;
}

/** Plain linear position interpolation (`rope_scaling.rope_type = "linear"`): positions divided by factor. */
export interface LinearRopeScaling {
  type: 'linear';
  factor: number;
}

/**
 * Phi-3's LongRoPE (`rope_scaling.type = "longrope"`, GGUF rope_factors_long / rope_factors_short): each frequency
 * divided by its own factor, and the rotated dimensions of Q and K multiplied by attentionFactor. A model has a long
 * and a short set; as llama.cpp does, the long one is used when the context served (here the model's context
 * length) is longer than originalContextLength, else the short one, and `factors` is that set.
 */
export interface LongRopeScaling {
  type: 'longrope';
  /** ropeDim / 2 divisors, one per frequency. */
  factors: number[];
  attentionFactor: number;
  originalContextLength: number;
}

export type RopeScaling = Llama3RopeScaling | LinearRopeScaling | LongRopeScaling;

export interface ModelConfig {
  architecture: Architecture;
  /** Display name (general.name or the folder name). */
  name: string;
  vocabSize: number;
  /** Hidden size (embedding length). */
  dim: number;
  numLayers: number;
  numHeads: number;
  numKvHeads: number;
  headDim: number;
  /** Intermediate size of the SwiGLU feed-forward block. */
  ffnDim: number;
  /** Longest context the model was trained for; requests are limited to it. */
  contextLength: number;
  rmsNormEps: number;
  ropeTheta: number;
  /** Rotated dimensions per head (= headDim unless the model rotates only part of each head). */
  ropeDim: number;
  ropeStyle: RopeStyle;
  ropeScaling?: RopeScaling;
  /** Q, K and V projections carry biases (Qwen2). */
  qkvBias: boolean;
  /** The output projection is the token embedding matrix. */
  tiedEmbeddings: boolean;
  /** Q and K get an RMS norm per head (weights of headDim) after the projection, before RoPE (Qwen3); absent = no. */
  qkNorm?: boolean;
  /** A mixture-of-experts feed-forward block in every layer instead of the dense SwiGLU one (ffnDim is then unused). */
  moe?: MoeConfig;
  /**
   * Sliding-window attention: a token at position p attends to positions p - slidingWindow + 1 .. p only (itself
   * and the slidingWindow - 1 before it), in the layers slidingWindowLayers marks; absent = full causal attention.
   */
  slidingWindow?: number;
  /** Which layers use the sliding window (Gemma 3: five local layers, then a global one); absent = every layer. */
  slidingWindowLayers?: boolean[];
  /**
   * RoPE base of the sliding-window layers, which also take no ropeScaling (Gemma 3's local layers; ropeTheta and
   * ropeScaling are its global layers'); absent = every layer rotates with ropeTheta and ropeScaling.
   */
  ropeLocalTheta?: number;
  /** Embeddings are multiplied by this before the first layer (Gemma: sqrt(dim)); absent = 1. */
  embeddingScale?: number;
  /**
   * Gemma 3: an RMS norm on the attention block's output and one on the feed-forward block's output, each before its
   * residual add (layers carry attnPostNorm and ffnPostNorm); absent = no.
   */
  postNorms?: boolean;
  /** The gated feed-forward's activation: SiLU (SwiGLU, the default) or tanh-approximated GELU (Gemma's GeGLU). */
  ffnActivation?: 'silu' | 'gelu_tanh';
  /** Scale of the attention scores; absent = 1 / sqrt(headDim). */
  attentionScale?: number;
  /** Final logits become cap * tanh(logits / cap) (Gemma's final_logit_softcapping); absent = none. */
  finalLogitSoftcap?: number;
}

/** The sliding window of layer l (0: full causal attention). */
export function layerWindow(config: ModelConfig, layer: number): number {
  if (!config.slidingWindow) return 0;
  return !config.slidingWindowLayers || config.slidingWindowLayers[layer] ? config.slidingWindow : 0;
}

/**
 * The window every layer shares when every layer has one (what the paged KV cache can free blocks by: a block before
 * every layer's window is read by no later step), else undefined.
 */
export function uniformWindow(config: ModelConfig): number | undefined {
  if (!config.slidingWindow) return undefined;
  if (config.slidingWindowLayers && !config.slidingWindowLayers.every((w) => w)) return undefined;
  return config.slidingWindow;
}

/**
 * Mixture of experts (Mixtral, Qwen3-MoE): a router matrix gives each token a score per expert; the softmax of the
 * scores picks the top `numExpertsUsed` experts; the token's feed-forward output is their SwiGLU outputs weighted by
 * those probabilities (renormalized to sum to 1 when `normalizeTopK`).
 */
export interface MoeConfig {
  numExperts: number;
  numExpertsUsed: number;
  /** Intermediate size of each expert's SwiGLU block. */
  expertFfnDim: number;
  normalizeTopK: boolean;
}
