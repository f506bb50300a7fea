// Calibrations of the performance model: which efficiency factors a simulation runs with.
//   - roofline: DEFAULT_EFFICIENCY, the datasheet-fraction estimates the simulator started from (60% GEMM MFU, 80% of
//     HBM, no elementwise or per-layer cost). Optimistic: 8-20% faster than real kernels.
//   - measured: fitted to kernel times of Llama 3.1 8B and a 70B TP=4 shard timed on a real H100 and H200 (plain
//     PyTorch BF16, unfused norms and activations, decode replayed from CUDA graphs, no tensor-parallel communication;
//     the files and the script that made them are described in docs/simulator.md). The fit is fitMeasuredEfficiency;
//     MEASURED_EFFICIENCY holds its result as constants so the simulator needs no data files at run time, and the
//     tests refit from the files when they are present and check the constants still match.
// GPUs without measurements (A100, B200) use the H100's fitted fractions: the fractions describe the kernels, not
// the chip, and that is an assumption docs/simulator.md states.

import type { HardwareProfile } from './hardware.ts';
import type { ModelProfile } from './models.ts';
import { getModelProfile } from './models.ts';
import {
  DEFAULT_EFFICIENCY, leastSquares, stepBreakdown, stepWork, type Efficiency, type StepShape,
} from './perf-model.ts';

export const CALIBRATIONS = ['roofline', 'measured'] as const;
export type CalibrationName = (typeof CALIBRATIONS)[number];

/** The calibration `conduit sim`, `conduit plan` and `conduit serve --engine sim` use unless told otherwise. */
export const DEFAULT_CALIBRATION: CalibrationName = 'roofline';

/** One model's figures in a measurement file (llama_roofline.py's output). */
export interface MeasuredModelFigures {
  prefill_1024_ms: number;
  prefill_gemms_per_layer_ms: number;
  prefill_gemm_mfu_vs_989: number;
  prefill_attention_per_layer_ms: number;
  [decode: `decode_b${number}_ms`]: number;
}

/** A measurement file: h100.json or h200.json. */
export interface MeasuredGpuFile {
  device: string;
  llama31_8b_tp1: MeasuredModelFigures;
  llama31_70b_tp4_shard: MeasuredModelFigures;
}

/** One measured figure, as the performance model sees it. */
export interface MeasuredFigure {
  /** e.g. "8B decode b=8". */
  label: string;
  model: ModelProfile;
  tp: number;
  step: StepShape;
  measuredMs: number;
}

/** Prompt length of the measured prefill and KV context of every measured decode sequence. */
export const MEASURED_TOKENS = 1024;

const MEASURED_MODELS = [
  { key: 'llama31_8b_tp1', id: 'llama-3.1-8b', tp: 1, short: '8B' },
  { key: 'llama31_70b_tp4_shard', id: 'llama-3.1-70b', tp: 4, short: '70B TP=4 shard' },
] as const;

/** Every whole-step figure of a measurement file (prefill of 1024 tokens, decode at each batch size). */
export function measuredFigures(file: MeasuredGpuFile): MeasuredFigure[] {
  const out: MeasuredFigure[] = [];
  for (const m of MEASURED_MODELS) {
    const figures = file[m.key];
    const model = getModelProfile(m.id);
    out.push({
      label: `${m.short} prefill ${MEASURED_TOKENS}`, model, tp: m.tp, measuredMs: figures.prefill_1024_ms,
      step: { prefillTokens: [{ newTokens: MEASURED_TOKENS, contextLen: 0 }], decodeSeqs: [] },
    });
    const decodes: [batch: number, ms: number][] = [];
    for (const [key, ms] of Object.entries(figures)) {
      const match = /^decode_b(\d+)_ms$/.exec(key);
      if (match) decodes.push([Number(match[1]), ms]);
    }
    decodes.sort((a, b) => a[0] - b[0]);
    for (const [b, measuredMs] of decodes) {
      out.push({
        label: `${m.short} decode b=${b}`, model, tp: m.tp, measuredMs,
        step: { prefillTokens: [], decodeSeqs: Array.from({ length: b }, () => ({ contextLen: MEASURED_TOKENS })) },
      });
    }
  }
  return out;
}

/**
 * What the measurement timed, from the model: the GPU's compute for the step, without the tensor-parallel
 * communication (the reference ran one shard alone) and without the per-step CPU overhead (decode replayed from a
 * CUDA graph, timed with CUDA events on the GPU).
 */
export function simulatedComputeMs(figure: MeasuredFigure, hw: HardwareProfile, efficiency: Efficiency): number {
  const b = stepBreakdown(figure.step, figure.model, hw, figure.tp, efficiency);
  return b.totalMs - b.commMs - b.overheadMs;
}

/**
 * Fits the measured calibration to one GPU's file, in closed form:
 *   - matmul MFU: the mean of the measured prefill GEMM MFUs (the four GEMMs of one layer at 1024 tokens);
 *   - attention MFU: the mean over both models of the model's prefill attention FLOPs per layer over the measured
 *     time of one layer's attention;
 *   - bandwidth utilisation, elementwise passes and per-layer floor: linear least squares over every whole-step
 *     figure, with the GEMM and attention compute terms above subtracted from the prefill, since each such step is
 *     t = layers x floor + (weight + KV bytes) / (HBM x util) + passes x activation bytes / (HBM x util).
 * Communication efficiency and the per-step CPU overhead are not in the measurements and stay at DEFAULT_EFFICIENCY.
 */
export function fitMeasuredEfficiency(file: MeasuredGpuFile, hw: HardwareProfile): Efficiency {
  const measuredPeak = 989e12; // the reference script's MFU denominator
  const mfus = MEASURED_MODELS.map((m) => file[m.key].prefill_gemm_mfu_vs_989 * (measuredPeak / hw.bf16FlopsPerSec));
  const matmulMfu = mean(mfus);
  const prefillStep: StepShape = { prefillTokens: [{ newTokens: MEASURED_TOKENS, contextLen: 0 }], decodeSeqs: [] };
  const attentionMfu = mean(MEASURED_MODELS.map((m) => {
    const model = getModelProfile(m.id);
    const flopsPerLayer = stepWork(prefillStep, model, m.tp).prefillAttentionFlops / model.numLayers;
    return flopsPerLayer / (file[m.key].prefill_attention_per_layer_ms / 1000) / hw.bf16FlopsPerSec;
  }));
  // Unknowns: k = 1 / (HBM bytes/ms x util), hidden and FFN passes x k, c = floor per layer (ms).
  const rows: number[][] = [];
  const rhs: number[] = [];
  const computeOnly: Efficiency = { ...DEFAULT_EFFICIENCY, matmulMfu, attentionMfu, bandwidthUtilization: 1e9 };
  for (const f of measuredFigures(file)) {
    const w = stepWork(f.step, f.model, f.tp);
    const hbmBytesPerMs = hw.hbmBytesPerSec / 1000;
    if (f.step.prefillTokens.length > 0) {
      // Compute-bound GEMMs and attention at the fitted MFUs (bandwidth made free so only compute counts).
      const b = stepBreakdown(f.step, f.model, hw, f.tp, computeOnly);
      rows.push([0, w.hiddenPassBytes / hbmBytesPerMs, w.ffnPassBytes / hbmBytesPerMs, f.model.numLayers]);
      rhs.push(f.measuredMs - b.matmul.timeMs - b.prefillAttention.timeMs);
    } else {
      rows.push([(w.weightBytes + w.decodeKvBytes) / hbmBytesPerMs, w.hiddenPassBytes / hbmBytesPerMs,
        w.ffnPassBytes / hbmBytesPerMs, f.model.numLayers]);
      rhs.push(f.measuredMs);
    }
  }
  // Each row divided by its measured time: the fit minimises relative error, so the 1 ms and 30 ms figures count
  // alike.
  const measured = measuredFigures(file).map((f) => f.measuredMs);
  const [k, qh, qf, c] = leastSquares(rows.map((r, i) => r.map((v) => v / measured[i]!)),
    rhs.map((v, i) => v / measured[i]!));
  if (k == null || qh == null || qf == null || c == null || !(k > 0) || !(qh >= 0) || !(qf >= 0) || !(c >= 0)) {
    throw new RangeError(`measurements of ${file.device} do not determine a physical fit ` +
      `(k ${k}, hidden ${qh}, ffn ${qf}, layer ${c})`);
  }
  return {
    ...DEFAULT_EFFICIENCY, matmulMfu, attentionMfu, bandwidthUtilization: 1 / k, hiddenPasses: qh / k,
    ffnPasses: qf / k,
    layerOverheadUs: c * 1000,
  };
}

function mean(xs: readonly number[]): number {
  return xs.reduce((s, x) => s + x, 0) / xs.length;
}

/** fitMeasuredEfficiency's results on the measured files, rounded (the tests refit and compare). */
export const MEASURED_EFFICIENCY: Readonly<Record<'h100' | 'h200', Readonly<Efficiency>>> = Object.freeze({
  h100: Object.freeze({
    ...DEFAULT_EFFICIENCY, matmulMfu: 0.741, attentionMfu: 0.126, bandwidthUtilization: 0.791, hiddenPasses: 41.7,
    ffnPasses: 2.91, layerOverheadUs: 42.1,
  }),
  h200: Object.freeze({
    ...DEFAULT_EFFICIENCY, matmulMfu: 0.722, attentionMfu: 0.12, bandwidthUtilization: 0.685, hiddenPasses: 52.5,
    ffnPasses: 4.86, layerOverheadUs: 31.3,
  }),
});

/** The efficiency factors a calibration gives a GPU (GPUs without measurements take the H100's). */
export function calibrationEfficiency(name: CalibrationName, hw: HardwareProfile): Efficiency {
  if (name === 'roofline') return DEFAULT_EFFICIENCY;
  return hw.id === 'h200' ? MEASURED_EFFICIENCY.h200 : MEASURED_EFFICIENCY.h100;
}

/** Parses a calibration name (flag value), throwing a RangeError that lists the known ones. */
export function parseCalibration(value: string): CalibrationName {
  const v = value.toLowerCase();
  if (!(CALIBRATIONS as readonly string[]).includes(v)) {
    throw new RangeError(`unknown simulator calibration "${value}"; known: ${CALIBRATIONS.join(', ')}`);
  }
  return v as CalibrationName;
}
