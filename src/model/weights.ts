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

/**
 * Bytes of the model's tensors, each byte range counted once (a tied output matrix is the token embedding; fused
 * matrices split into row views add up to the fused tensor).
 */
export function weightBytes(weights: ModelWeights): number {
  const seen = new Map<ArrayBufferLike, Set<string>>();
  let total = 0;
  const add = (t: Tensor | undefined): void => {
    if (t === undefined) return;
    const ranges = seen.get(t.data.buffer) ?? new Set<string>();
    seen.set(t.data.buffer, ranges);
    const key = `${t.data.byteOffset}:${t.data.byteLength}`;
    if (ranges.has(key)) return;
    ranges.add(key);
    total += t.data.byteLength;
  };
  add(weights.tokenEmbedding);
  add(weights.outputNorm);
  add(weights.output);
  for (const layer of weights.layers) for (const tensor of Object.values(layer)) add(tensor as Tensor | undefined);
  return total;
}
