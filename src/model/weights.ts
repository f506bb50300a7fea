import type { GgmlType } from './ggml-types.ts';

/**
 * One tensor's raw bytes as stored in the file, never converted on load.
 * `shape` is in ggml order: shape[0] is the contiguous (innermost) dimension. A weight matrix of a linear layer
 * y = W x with `in` inputs and `out` outputs has shape [in, out]: `out` rows of `in` contiguous elements, which is
 * also the row-major [out, in] layout of a Hugging Face safetensors checkpoint.
 */
export interface Tensor {
  name: string;
  type: GgmlType;
  shape: number[];
  /** A view of the file's bytes (no copy), `byteSize(type, elements)` long. */
  data: Uint8Array;
}

export interface LayerWeights {
  attnNorm: Tensor;
  wq: Tensor;
  wk: Tensor;
  wv: Tensor;
  wo: Tensor;
  bq?: Tensor;
  bk?: Tensor;
  bv?: Tensor;
  /** Per-head RMS norm weights of Q and K ([headDim]), when the config has qkNorm. */
  qNorm?: Tensor;
  kNorm?: Tensor;
  ffnNorm: Tensor;
  /** Gemma 3's norms of the attention output and the feed-forward output ([dim]), when the config has postNorms. */
  attnPostNorm?: Tensor;
  ffnPostNorm?: Tensor;
  /**
   * The SwiGLU matrices. With experts (config.moe) each holds every expert's matrix back to back, a third ggml
   * dimension: gate and up [dim, expertFfnDim, numExperts], down [expertFfnDim, dim, numExperts] (llama.cpp's
   * ffn_*_exps layout).
   */
  wGate: Tensor;
  wUp: Tensor;
  wDown: Tensor;
  /** The router of a mixture-of-experts layer, [dim, numExperts]. */
  ffnGateInp?: Tensor;
}

export interface ModelWeights {
  tokenEmbedding: Tensor;
  layers: LayerWeights[];
  outputNorm: Tensor;
  /** The logits projection; the same object as tokenEmbedding when the model ties them. */
  output: Tensor;
}
