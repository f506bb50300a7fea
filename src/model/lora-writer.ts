// Writes LoRA adapters in the two formats src/model/lora.ts reads: llama.cpp's GGUF adapter and a Hugging Face
// PEFT folder. Used for seeded random adapters (tests, benchmarks, llama.cpp reference outputs); the matrices are
// given in Hugging Face row order, and the GGUF writer permutes q/k lora_B rows for a llama base as llama.cpp's
// converter does (the reader undoes nothing: it permutes PEFT's instead, so both load to the same weights).

import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { seededRandom } from '../util/random.ts';
import type { ModelConfig } from './config.ts';
import { GgmlType } from './ggml-types.ts';
import { GgufValueType } from './gguf.ts';
import { writeGguf } from './gguf-writer.ts';
import { interleavedRowOrder } from './hf.ts';
import { LORA_TARGETS, loraTargetShape, type LoraMatrix, type LoraTarget } from './lora.ts';
import { writeSafetensors } from './safetensors.ts';

/** An adapter in Hugging Face row order (before any RoPE permutation), with its alpha. */
export interface LoraAdapterSpec {
  alpha: number;
  layers: Partial<Record<LoraTarget, LoraMatrix>>[];
}

/**
 * A seeded random adapter of the given rank over `targets` of every layer: A uniform in +-1/sqrt(in), B uniform in
 * +-bScale (PEFT initialises B to zero; a random B makes the adapter change the output).
 */
export function randomLoraAdapter(config: ModelConfig, options: { rank: number; seed: number; alpha?: number;
  targets?: readonly LoraTarget[]; bScale?: number }): LoraAdapterSpec {
  const random = seededRandom(options.seed);
  const targets = options.targets ?? LORA_TARGETS;
  const uniform = (n: number, scale: number) => Float32Array.from({ length: n }, () => (random() * 2 - 1) * scale);
  const layers = Array.from({ length: config.numLayers }, () => {
    const layer: Partial<Record<LoraTarget, LoraMatrix>> = {};
    for (const target of targets) {
      const [inDim, outDim] = loraTargetShape(config, target);
      layer[target] = {
        rank: options.rank, a: uniform(options.rank * inDim, 1 / Math.sqrt(inDim)), b: uniform(outDim * options.rank, options.bScale ?? 0.5),
      };
    }
    return layer;
  });
  return { alpha: options.alpha ?? options.rank, layers };
}

const GGUF_NAMES: Record<LoraTarget, string> = {
  wq: 'attn_q', wk: 'attn_k', wv: 'attn_v', wo: 'attn_output', wGate: 'ffn_gate', wUp: 'ffn_up', wDown: 'ffn_down',
};
const PEFT_NAMES: Record<LoraTarget, string> = {
  wq: 'self_attn.q_proj', wk: 'self_attn.k_proj', wv: 'self_attn.v_proj', wo: 'self_attn.o_proj',
  wGate: 'mlp.gate_proj', wUp: 'mlp.up_proj', wDown: 'mlp.down_proj',
};

function bytes(values: Float32Array): Uint8Array {
  return new Uint8Array(values.buffer, values.byteOffset, values.byteLength);
}

/** llama.cpp's GGUF adapter for a base of this config (architecture from it, Q/K rows permuted for a llama GGUF). */
export function writeGgufLoraAdapter(path: string, config: ModelConfig, adapter: LoraAdapterSpec,
  options: { architecture?: string; name?: string } = {}): void {
  const tensors = [];
  for (const [l, layer] of adapter.layers.entries()) {
    for (const target of LORA_TARGETS) {
      const m = layer[target];
      if (!m) continue;
      const [inDim, outDim] = loraTargetShape(config, target);
      let b = m.b;
      if (config.ropeStyle === 'interleaved' && (target === 'wq' || target === 'wk')) {
        const order = interleavedRowOrder(target === 'wq' ? config.numHeads : config.numKvHeads, config.headDim);
        b = new Float32Array(m.b.length);
        for (let row = 0; row < outDim; row++) b.set(m.b.subarray(order[row]! * m.rank, (order[row]! + 1) * m.rank), row * m.rank);
      }
      const weight = `blk.${l}.${GGUF_NAMES[target]}.weight`;
      tensors.push({ name: `${weight}.lora_a`, type: GgmlType.F32, shape: [inDim, m.rank], data: bytes(m.a) });
      tensors.push({ name: `${weight}.lora_b`, type: GgmlType.F32, shape: [m.rank, outDim], data: bytes(b) });
    }
  }
  writeGguf(path, {
    metadata: [
      ['general.architecture', options.architecture ?? config.architecture],
      ['general.type', 'adapter'],
      ['general.name', options.name ?? 'lora'],
      ['adapter.type', 'lora'],
      ['adapter.lora.alpha', adapter.alpha],
    ],
    types: new Map([['adapter.lora.alpha', { type: GgufValueType.FLOAT32 }]]),
    tensors,
  });
}

/** A PEFT folder: adapter_config.json and adapter_model.safetensors (Hugging Face order, no permutation). */
export function writePeftLoraAdapter(dir: string, adapter: LoraAdapterSpec, options: { baseModel?: string } = {}): void {
  mkdirSync(dir, { recursive: true });
  const tensors = [];
  let rank = 0;
  const modules = new Set<string>();
  for (const [l, layer] of adapter.layers.entries()) {
    for (const target of LORA_TARGETS) {
      const m = layer[target];
      if (!m) continue;
      rank = m.rank;
      const module = PEFT_NAMES[target];
      modules.add(module.split('.')[1]!);
      const inDim = m.a.length / m.rank;
      const outDim = m.b.length / m.rank;
      const prefix = `base_model.model.model.layers.${l}.${module}`;
      tensors.push({ name: `${prefix}.lora_A.weight`, dtype: 'F32' as const, shape: [m.rank, inDim], data: bytes(m.a) });
      tensors.push({ name: `${prefix}.lora_B.weight`, dtype: 'F32' as const, shape: [outDim, m.rank], data: bytes(m.b) });
    }
  }
  writeSafetensors(join(dir, 'adapter_model.safetensors'), tensors, { format: 'pt' });
  writeFileSync(join(dir, 'adapter_config.json'), `${JSON.stringify({
    peft_type: 'LORA', r: rank, lora_alpha: adapter.alpha, target_modules: [...modules], bias: 'none',
    fan_in_fan_out: false, use_rslora: false, base_model_name_or_path: options.baseModel ?? null, task_type: 'CAUSAL_LM',
  }, null, 2)}\n`);
}
