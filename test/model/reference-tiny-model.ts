// Tiny random F32 models built in memory (no file), for the reference forward tests.
import type { ModelConfig } from '../../src/model/config.ts';
import { GgmlType } from '../../src/model/ggml-types.ts';
import type { LayerWeights, ModelWeights, Tensor } from '../../src/model/weights.ts';
import { seededRandom } from '../../src/util/random.ts';

export { seededRandom };

export function tinyConfig(overrides: Partial<ModelConfig> = {}): ModelConfig {
  return {
    architecture: 'llama', name: 'tiny', vocabSize: 13, dim: 16, numLayers: 1, numHeads: 4, numKvHeads: 2,
    headDim: 4, ffnDim: 24, contextLength: 64, rmsNormEps: 1e-5, ropeTheta: 10000, ropeDim: 4,
    ropeStyle: 'interleaved', qkvBias: false, tiedEmbeddings: false,
    ...overrides,
  };
}

/** An F32 tensor in ggml shape order holding `values` (row-major over the reversed shape). */
export function f32Tensor(name: string, shape: number[], values: Float32Array): Tensor {
  const count = shape.reduce((a, b) => a * b, 1);
  if (values.length !== count) throw new Error(`${name}: ${values.length} values for shape [${shape}]`);
  return { name, type: GgmlType.F32, shape, data: new Uint8Array(values.buffer, values.byteOffset, values.byteLength) };
}

/** The tensor's values (F32 only). */
export function tensorValues(t: Tensor): Float32Array {
  if (t.type !== GgmlType.F32) throw new Error(`${t.name} is not F32`);
  return new Float32Array(t.data.slice().buffer);
}

/**
 * Random weights for `config`: matrices uniform in +-1/sqrt(inputs) (activations stay near unit size through the
 * layers), norm weights near 1, biases small; the embedding uniform in +-1.
 */
export function tinyWeights(config: ModelConfig, seed: number): ModelWeights {
  const random = seededRandom(seed);
  const uniform = (count: number, scale: number, centre = 0): Float32Array =>
    Float32Array.from({ length: count }, () => centre + scale * (2 * random() - 1));
  const matrix = (name: string, inputs: number, outputs: number): Tensor =>
    f32Tensor(name, [inputs, outputs], uniform(inputs * outputs, 1 / Math.sqrt(inputs)));
  const vector = (name: string, length: number, scale: number, centre = 0): Tensor =>
    f32Tensor(name, [length], uniform(length, scale, centre));

  const { dim, ffnDim, vocabSize } = config;
  const qDim = config.numHeads * config.headDim;
  const kvDim = config.numKvHeads * config.headDim;
  const layers: LayerWeights[] = [];
  for (let l = 0; l < config.numLayers; l++) {
    const p = `blk.${l}.`;
    const layer: LayerWeights = {
      attnNorm: vector(`${p}attn_norm.weight`, dim, 0.3, 1),
      wq: matrix(`${p}attn_q.weight`, dim, qDim),
      wk: matrix(`${p}attn_k.weight`, dim, kvDim),
      wv: matrix(`${p}attn_v.weight`, dim, kvDim),
      wo: matrix(`${p}attn_output.weight`, qDim, dim),
      ffnNorm: vector(`${p}ffn_norm.weight`, dim, 0.3, 1),
      wGate: matrix(`${p}ffn_gate.weight`, dim, ffnDim),
      wUp: matrix(`${p}ffn_up.weight`, dim, ffnDim),
      wDown: matrix(`${p}ffn_down.weight`, ffnDim, dim),
    };
    if (config.qkvBias) {
      layer.bq = vector(`${p}attn_q.bias`, qDim, 0.5);
      layer.bk = vector(`${p}attn_k.bias`, kvDim, 0.5);
      layer.bv = vector(`${p}attn_v.bias`, kvDim, 0.5);
    }
    layers.push(layer);
  }
  const tokenEmbedding = f32Tensor('token_embd.weight', [dim, vocabSize], uniform(dim * vocabSize, 1));
  return {
    tokenEmbedding,
    layers,
    outputNorm: vector('output_norm.weight', dim, 0.3, 1),
    output: config.tiedEmbeddings ? tokenEmbedding : matrix('output.weight', dim, vocabSize),
  };
}
