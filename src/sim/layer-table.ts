// One transformer layer of a prefill, kernel by kernel, per GPU: the roofline of each kernel the way seeds 001 and 002
// tabulate them (QKV, RoPE, attention, O, all-reduce, norms, gate/up, SiLU, down). The GEMM, attention and all-reduce
// rows are the terms of the step time (perf-model.ts); RoPE, the norms and SiLU are floors (bytes at the chosen
// bandwidth) that the step time includes only through a calibration's elementwise passes (calibration.ts).

import type { HardwareProfile } from './hardware.ts';
import { matmulPeakFlopsPerSec } from './hardware.ts';
import type { ModelProfile } from './models.ts';
import {
  DEFAULT_EFFICIENCY, kvHeadsPerGpu, ringAllReduceTimeMs, stepBreakdown, type Bound,
  type Efficiency,
} from './perf-model.ts';

export interface LayerKernelRow {
  kernel: string;
  flops: number;
  bytes: number;
  /** Microseconds. */
  computeUs: number;
  memoryUs: number;
  timeUs: number;
  bound: Bound | 'comm';
  /** Part of the roofline step time (false: a floor the step time counts only via elementwise passes). */
  inStepTime: boolean;
}

/** Seed 001's per-layer prefill breakdown (Llama 3.1 70B, tp 4, 1024 tokens, per GPU), microseconds. */
export const SEED_001_PREFILL_LAYER_US: Readonly<Record<string, number>> = Object.freeze({
  'QKV projection': 65, 'attention': 120, 'O projection': 25, 'all-reduce (attention)': 35, 'MLP gate + up': 150,
  'SiLU x multiply': 8, 'MLP down': 75, 'all-reduce (MLP)': 35, 'RMSNorm x 2': 5,
});

export interface PrefillLayerTable {
  rows: LayerKernelRow[];
  /** Sum of the rows, µs. */
  totalUs: number;
  /** Sum of the rows in the step time, µs: the step's per-layer share without LM head and step overhead. */
  stepRowsUs: number;
  /**
   * Set for models whose layers the table does not model (mixture-of-experts FFNs, multi-head latent attention): the
   * rows are a dense GQA layer of the same dimensions and do not add up to the step time. Says what differs.
   */
  denseApproximation?: string;
}

/**
 * The rows are those of a dense GQA layer. Mixture-of-experts FFNs (top-k of E experts, each step streaming the
 * experts its tokens chose) and MLA's projections are modelled only by the step time (perf-model.ts), whose matmul
 * roofline takes them whole; splitting them kernel by kernel is not done, so the table says it is an approximation
 * rather than print rows that silently miss up to half of the step.
 */
function denseApproximationNote(model: ModelProfile): string | undefined {
  const parts: string[] = [];
  if (model.moe) {
    const { numExperts, numExpertsUsed, numSharedExperts, numDenseLayers, expertFfnDim } = model.moe;
    parts.push(`its FFN is ${numExperts} experts of ${expertFfnDim}, ${numExpertsUsed} per token`
      + `${numSharedExperts > 0 ? ` plus ${numSharedExperts} shared` : ''}${numDenseLayers > 0 ? ` (after ${numDenseLayers} dense layers)` : ''}, `
      + `not the dense FFN of ${model.ffnDim} the MLP rows show`);
  }
  if (model.attentionParamsPerLayer !== undefined || model.kvElementsPerTokenPerLayer !== undefined) {
    parts.push('its attention is multi-head latent attention, not the grouped-query QKV, attention and O rows shown');
  }
  if (parts.length === 0) return undefined;
  return `${model.name}: ${parts.join('; ')}. This table is the dense approximation and its rows do not add up to the `
    + 'prefill step; prefill_execution above is the step model\'s time, which counts them.';
}

/** The per-layer kernels of a prefill of `tokens` tokens from an empty cache, on one GPU of a tp group. */
export function prefillLayerTable(model: ModelProfile, hw: HardwareProfile, tp: number, tokens: number,
  efficiency: Efficiency = DEFAULT_EFFICIENCY): PrefillLayerTable {
  // Validates tp and the factors the same way the step model does.
  const step = stepBreakdown({ prefillTokens: [{ newTokens: tokens, contextLen: 0 }], decodeSeqs: [] }, model, hw, tp,
    efficiency);
  const act = model.activationBytesPerElement;
  const wb = model.weightBytesPerParam;
  const qDim = (model.numHeads * model.headDim) / tp;
  const kvDim = kvHeadsPerGpu(model, tp) * model.headDim;
  const ffn = model.ffnDim / tp;
  const h = model.hiddenDim;
  const mmFlops = matmulPeakFlopsPerSec(hw, wb) * efficiency.matmulMfu;
  const atFlops = hw.bf16FlopsPerSec * efficiency.attentionMfu;
  const bw = hw.hbmBytesPerSec * efficiency.bandwidthUtilization;
  const us = (amount: number, perSec: number) => (amount / perSec) * 1e6;
  const row = (kernel: string, flops: number, bytes: number, flopsPerSec: number, inStepTime: boolean): LayerKernelRow => {
    const computeUs = us(flops, flopsPerSec);
    const memoryUs = us(bytes, bw);
    const timeUs = Math.max(computeUs, memoryUs);
    return { kernel, flops, bytes, computeUs, memoryUs, timeUs, bound: computeUs >= memoryUs ? 'compute' : 'memory', inStepTime };
  };
  const gemm = (kernel: string, k: number, n: number) => row(kernel, 2 * tokens * k * n, k * n * wb, mmFlops, true);
  const allReduce = (kernel: string): LayerKernelRow => {
    const timeUs = ringAllReduceTimeMs(tokens * h * act, tp, hw.tpLink, efficiency.commEfficiency) * 1000;
    return { kernel, flops: 0, bytes: tokens * h * act, computeUs: 0, memoryUs: 0, timeUs, bound: 'comm', inStepTime: true };
  };
  const layers = model.numLayers;
  const attention: LayerKernelRow = row('attention', step.work.prefillAttentionFlops / layers,
    step.work.prefillKvBytes / layers, atFlops, true);
  const rows = [
    gemm('QKV projection', h, qDim + 2 * kvDim),
    // Rotate Q and K in place: read and write both.
    row('RoPE', 0, 2 * tokens * (qDim + kvDim) * act, Infinity, false),
    attention,
    gemm('O projection', qDim, h),
    ...(tp > 1 ? [allReduce('all-reduce (attention)')] : []),
    gemm('MLP gate + up', h, 2 * ffn),
    // Read gate and up, write their product.
    row('SiLU x multiply', 0, 3 * tokens * ffn * act, Infinity, false),
    gemm('MLP down', ffn, h),
    ...(tp > 1 ? [allReduce('all-reduce (MLP)')] : []),
    // Two norms, each reading and writing the hidden states.
    row('RMSNorm x 2', 0, 2 * 2 * tokens * h * act, Infinity, false),
  ];
  const totalUs = rows.reduce((s, r) => s + r.timeUs, 0);
  const stepRowsUs = rows.filter((r) => r.inStepTime).reduce((s, r) => s + r.timeUs, 0);
  const note = denseApproximationNote(model);
  return { rows, totalUs, stepRowsUs, ...(note !== undefined ? { denseApproximation: note } : {}) };
}

/** The table as text, with seed 001's column when the deployment is the one it describes. */
export function formatPrefillLayerTable(table: PrefillLayerTable, seed?: Readonly<Record<string, number>>): string {
  const header = ['kernel', 'ours µs', 'bound', 'compute µs', 'memory µs', ...(seed ? ['seed 001 µs'] : []), 'in step time'];
  const rows = table.rows.map((r) => [
    r.kernel, r.timeUs.toFixed(1), r.bound, r.computeUs.toFixed(1), r.memoryUs.toFixed(1),
    ...(seed ? [seed[r.kernel] !== undefined ? String(seed[r.kernel]) : '-'] : []),
    r.inStepTime ? 'yes' : 'floor only',
  ]);
  const seedTotal = seed ? Object.values(seed).reduce((s, v) => s + v, 0) : 0;
  rows.push(['per layer', table.totalUs.toFixed(1), '', '', '', ...(seed ? [String(seedTotal)] : []),
    `${table.stepRowsUs.toFixed(1)} in step time`]);
  const widths = header.map((hd, i) => Math.max(hd.length, ...rows.map((r) => r[i]!.length)));
  const line = (cells: string[]) => cells.map((c, i) => (i === 0 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!))).join('  ');
  const lines = [line(header), line(widths.map((w) => '-'.repeat(w))), ...rows.map(line)];
  if (table.denseApproximation !== undefined) lines.push(`note: ${table.denseApproximation}`);
  return lines.join('\n');
}
