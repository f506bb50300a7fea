// The architecture description every backend computes from. One shape covers the Llama family (Llama 2/3,
// TinyLlama, SmolLM, Mixtral), Qwen2 (QKV bias), Qwen3 (per-head RMS norm on Q and K, a head size of its own),
// Qwen3-MoE and Phi-3 (fused QKV and gate/up, split at load); differences are flags, never separate forward passes.

/** GGUF's general.architecture names. Mixtral is `llama` with experts (llama.cpp writes it so). */
export type Architecture = 'llama' | 'qwen2' | 'qwen3' | 'qwen3moe' | 'phi3';

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

export type RopeScaling = Llama3RopeScaling | LinearRopeScaling;

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
