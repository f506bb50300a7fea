// A toy deployment whose step times can be worked out by hand: a 2-layer model on a GPU that does 1 GFLOP/s and
// streams 1 PB/s, so every kernel is compute-bound and a step costs (its FLOPs / 1e6) ms plus 0.5 ms of overhead.
//
// Per token through the layers: 2 x layers x W_layer = 2 x 2 x 163,840 = 655,360 FLOPs, where
//   W_layer = d.H.h + 2.d.Hkv.h + H.h.d + 3.d.F = 128.128 + 2.128.128 + 128.128 + 3.128.256 = 163,840.
// Per sampled row, the LM head: 2 x vocab x d = 2 x 1000 x 128 = 256,000 FLOPs.
// Per attended key: 4 x layers x heads x headDim = 4 x 2 x 2 x 64 = 1,024 FLOPs.
// Memory terms are at most 1 MB / 1e15 B/s = 1e-6 ms: never the active side of a roofline.

import { DEFAULT_SAMPLING, type EngineRequest, type SamplingParams } from '../../src/engine/types.ts';
import { NVLINK4, type HardwareProfile } from '../../src/sim/hardware.ts';
import type { ModelProfile } from '../../src/sim/models.ts';
import type { Efficiency } from '../../src/sim/perf-model.ts';

export const TOY_MODEL: ModelProfile = {
  id: 'toy', name: 'Toy', numLayers: 2, hiddenDim: 128, numHeads: 2, numKvHeads: 2, headDim: 64, ffnDim: 256,
  vocabSize: 1000, tiedEmbeddings: false, qkvBias: false, weightBytesPerParam: 2, kvBytesPerElement: 2,
  activationBytesPerElement: 2,
};

export const TOY_GPU: HardwareProfile = {
  id: 'toy-gpu', name: 'Toy GPU', bf16FlopsPerSec: 1e9, hbmBytes: 2 ** 30, hbmBytesPerSec: 1e15, tpLink: NVLINK4,
  gpusPerNode: 8,
};

export const TOY_EFFICIENCY: Efficiency = {
  matmulMfu: 1, attentionMfu: 1, bandwidthUtilization: 1, commEfficiency: 1, stepOverheadMs: 0.5,
};

const FLOPS_PER_MS = 1e6;
const TOKEN_FLOPS = 655_360;
const LM_HEAD_FLOPS = 256_000;
const KEY_FLOPS = 1_024;
const OVERHEAD_MS = 0.5;

/** A step prefilling n prompt tokens after c cached ones (causal: token i attends to c + i + 1 keys), sampled. */
export function toyPrefillMs(n: number, c: number, sampled = true): number {
  return (TOKEN_FLOPS * n + (sampled ? LM_HEAD_FLOPS : 0) + KEY_FLOPS * (n * c + (n * (n + 1)) / 2)) / FLOPS_PER_MS + OVERHEAD_MS;
}

/** A step decoding one token after c cached ones. */
export function toyDecodeMs(c: number): number {
  return (TOKEN_FLOPS + LM_HEAD_FLOPS + KEY_FLOPS * (c + 1)) / FLOPS_PER_MS + OVERHEAD_MS;
}

export const toyWorker = { model: TOY_MODEL, hw: TOY_GPU, tp: 1, efficiency: TOY_EFFICIENCY, numKvBlocks: 64 };

export function prompt(length: number, variant = 0): number[] {
  return Array.from({ length }, (_, i) => (variant * 7 + i * 13 + 1) % 1000);
}

export function req(id: string, promptTokenIds: number[], arrivalMs = 0, sampling: Partial<SamplingParams> = {}): EngineRequest {
  return { id, promptTokenIds, sampling: { ...DEFAULT_SAMPLING, maxTokens: 4, ...sampling }, priority: 0, arrivalMs };
}

export const close = (actual: number, expected: number, relTol = 1e-9) => {
  if (!(Math.abs(actual - expected) <= relTol * Math.max(1, Math.abs(expected)))) {
    throw new Error(`${actual} != ${expected}`);
  }
};
