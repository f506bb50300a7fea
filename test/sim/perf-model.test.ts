import { test } from 'node:test';
import assert from 'node:assert/strict';
import { A100_SXM_80GB, H100_SXM, INFINIBAND_NDR, NVLINK4, PCIE5_X16 } from '../../src/sim/hardware.ts';
import { LLAMA_3_1_70B, LLAMA_3_1_8B, withDtypes } from '../../src/sim/models.ts';
import type { ModelProfile } from '../../src/sim/models.ts';
import type { Efficiency, StepShape } from '../../src/sim/perf-model.ts';
import {
  DEFAULT_EFFICIENCY, calibrateEfficiency, kvBytesPerTokenPerGpu, kvCapacityTokens, kvTransferTimeMs, stepBreakdown,
  stepTimeMs,
} from '../../src/sim/perf-model.ts';

const close = (actual: number, expected: number, relTol = 1e-9) =>
  assert.ok(Math.abs(actual - expected) <= relTol * Math.abs(expected), `${actual} != ${expected}`);

/** Every factor at 100% and no step overhead: the bare roofline. */
const IDEAL: Efficiency = {
  matmulMfu: 1, attentionMfu: 1, bandwidthUtilization: 1, commEfficiency: 1, stepOverheadMs: 0,
};
/** Factors unlike the defaults, so a test cannot pass by leaning on them. */
const EFF: Efficiency = {
  matmulMfu: 0.5, attentionMfu: 0.25, bandwidthUtilization: 0.75, commEfficiency: 0.7, stepOverheadMs: 0.3,
};

const decode = (batch: number, contextLen: number): StepShape =>
  ({ prefillTokens: [], decodeSeqs: Array.from({ length: batch }, () => ({ contextLen })) });
const prefill = (newTokens: number, contextLen = 0): StepShape =>
  ({ prefillTokens: [{ newTokens, contextLen }], decodeSeqs: [] });

// Shapes written out by hand, independent of the model's helpers.
const L8 = { embedding: 128256 * 4096, params: 8_030_261_248 };
const L70 = {
  layerMatmul: 8192 * 8192 * 2 + 2 * 8192 * 1024 + 3 * 8192 * 28672, // Q, O, K, V, gate/up/down
  lmHead: 128256 * 8192,
  params: 70_553_706_496,
  embedding: 128256 * 8192,
};

test('8B BF16 decode, batch 1, one H100: the weights stream from HBM once', () => {
  // 16.06 GB of weights, less the 1.05 GB embedding table a lookup does not stream: 15.01 GB at 3.35 TB/s.
  const streamedBytes = 2 * (L8.params - L8.embedding);
  assert.equal(streamedBytes, 15_009_849_344);
  const ideal = stepBreakdown(decode(1, 0), LLAMA_3_1_8B, H100_SXM, 1, IDEAL);
  close(ideal.matmul.memoryMs, (streamedBytes / 3.35e12) * 1000); // 4.48 ms
  assert.equal(ideal.matmul.bound, 'memory');
  assert.equal(ideal.commMs, 0);

  const real = stepBreakdown(decode(1, 0), LLAMA_3_1_8B, H100_SXM, 1, EFF);
  const weightsMs = (streamedBytes / (3.35e12 * 0.75)) * 1000; // 5.97 ms
  const kvMs = ((2 * 32 * 8 * 128 * 2) / (3.35e12 * 0.75)) * 1000; // the new token's own K and V
  close(real.matmul.timeMs, weightsMs);
  close(real.decodeAttention.timeMs, kvMs);
  close(real.totalMs, weightsMs + kvMs + 0.3);
});

test('70B 1024-token prefill on 4 x H100: compute-bound matmuls, attention, and 160 ring all-reduces', () => {
  const b = stepBreakdown(prefill(1024), LLAMA_3_1_70B, H100_SXM, 4, EFF);
  // Every token through 80 layers, the LM head only for the one sampled position; a quarter per GPU.
  const matmulFlops = (2 * (80 * L70.layerMatmul * 1024 + L70.lmHead)) / 4;
  close(b.matmul.computeMs, (matmulFlops / (989.4e12 * 0.5)) * 1000);
  assert.equal(b.matmul.bound, 'compute');
  // Causal attention: token i attends to i + 1 keys, 16 query heads per GPU.
  const attentionFlops = 4 * 80 * 16 * 128 * ((1024 * 1025) / 2);
  close(b.prefillAttention.computeMs, (attentionFlops / (989.4e12 * 0.25)) * 1000);
  // Ring all-reduce of 1024 x 8192 BF16 hidden states: 6 hops of 1 us, 1.5 x 16 MiB sent per GPU, twice a layer.
  const allReduceMs = 6 * 0.001 + ((1.5 * 1024 * 8192 * 2) / (450e9 * 0.7)) * 1000;
  close(b.allReduceMs, 160 * allReduceMs);
  // All-gather of one row of BF16 logits sharded 4 ways.
  close(b.logitsGatherMs, 3 * 0.001 + ((0.75 * 128256 * 2) / (450e9 * 0.7)) * 1000);
  close(b.totalMs, b.matmul.timeMs + b.prefillAttention.timeMs + b.commMs + 0.3);
});

test('a 35 ms 1024-token 70B prefill on 4 x H100 would need more than peak BF16', () => {
  const totalFlops = 2 * (80 * L70.layerMatmul * 1024 + L70.lmHead) + 4 * 80 * 64 * 128 * ((1024 * 1025) / 2);
  const floorMs = (totalFlops / (4 * 989.4e12)) * 1000;
  assert.ok(floorMs > 35, `floor ${floorMs} ms`);
  const ideal = stepBreakdown(prefill(1024), LLAMA_3_1_70B, H100_SXM, 4, { ...IDEAL, commEfficiency: Infinity });
  close(ideal.matmul.timeMs + ideal.prefillAttention.timeMs, floorMs);
  assert.ok(ideal.totalMs > 35);
});

test('FP8 weights run on FP8 tensor cores where the GPU has them (H100) and on BF16 where not (A100)', () => {
  const fp8 = withDtypes(LLAMA_3_1_70B, { weightBytesPerParam: 1 });
  const flopsPerGpu = (2 * (80 * L70.layerMatmul * 4096 + L70.lmHead)) / 4;
  close(stepBreakdown(prefill(4096), fp8, H100_SXM, 4, IDEAL).matmul.computeMs, (flopsPerGpu / 1978.9e12) * 1000);
  close(stepBreakdown(prefill(4096), fp8, A100_SXM_80GB, 4, IDEAL).matmul.computeMs, (flopsPerGpu / 312e12) * 1000);
  // And stream half the bytes.
  close(stepBreakdown(decode(1, 0), fp8, H100_SXM, 4, IDEAL).matmul.memoryMs,
    ((L70.params - L70.embedding) / 4 / 3.35e12) * 1000);
});

test('mixing decodes into a prefill step costs less than running them apart (the weights stream once)', () => {
  const mixed: StepShape = { prefillTokens: prefill(256).prefillTokens, decodeSeqs: decode(32, 2048).decodeSeqs };
  const together = stepTimeMs(mixed, LLAMA_3_1_70B, H100_SXM, 4, EFF);
  const apart = stepTimeMs(prefill(256), LLAMA_3_1_70B, H100_SXM, 4, EFF)
    + stepTimeMs(decode(32, 2048), LLAMA_3_1_70B, H100_SXM, 4, EFF);
  assert.ok(together < apart);
  assert.ok(together >= stepTimeMs(prefill(256), LLAMA_3_1_70B, H100_SXM, 4, EFF));
  assert.equal(stepTimeMs({ prefillTokens: [], decodeSeqs: [] }, LLAMA_3_1_70B, H100_SXM, 4, EFF), 0);
});

test('step time never decreases when tokens, context or batch grow (randomised shapes)', () => {
  let seed = 12345;
  const rand = (n: number) => { seed = (seed * 1103515245 + 12345) % 2 ** 31; return seed % n; };
  const randomStep = (): StepShape => ({
    prefillTokens: Array.from({ length: rand(3) }, () => ({ newTokens: 1 + rand(4096), contextLen: rand(8192) })),
    decodeSeqs: Array.from({ length: rand(64) }, () => ({ contextLen: rand(16384) })),
  });
  for (const [model, tp] of [[LLAMA_3_1_8B, 1], [LLAMA_3_1_70B, 4], [LLAMA_3_1_70B, 8]] as const) {
    for (let i = 0; i < 60; i++) {
      const s = randomStep();
      const t = stepTimeMs(s, model, H100_SXM, tp);
      const grown: StepShape[] = [
        { ...s, decodeSeqs: [...s.decodeSeqs, { contextLen: rand(8192) }] },
        { ...s, prefillTokens: [...s.prefillTokens, { newTokens: 1 + rand(512), contextLen: rand(4096) }] },
        { ...s, decodeSeqs: s.decodeSeqs.map((d) => ({ contextLen: d.contextLen + 1 + rand(1000) })) },
        { ...s, prefillTokens: s.prefillTokens.map((c) => ({ ...c, newTokens: c.newTokens + 1 + rand(100) })) },
        { ...s, prefillTokens: s.prefillTokens.map((c) => ({ ...c, contextLen: c.contextLen + 1 + rand(100) })) },
      ];
      for (const g of grown) assert.ok(stepTimeMs(g, model, H100_SXM, tp) >= t, JSON.stringify(s));
    }
  }
  // Along the decode batch axis, strictly: every extra sequence adds KV to read and hidden states to all-reduce.
  let previous = 0;
  for (let batch = 1; batch <= 512; batch *= 2) {
    const t = stepTimeMs(decode(batch, 1024), LLAMA_3_1_70B, H100_SXM, 4);
    assert.ok(t > previous);
    previous = t;
  }
});

test('tensor parallelism splits weights, FLOPs and KV, and adds communication', () => {
  const base = stepBreakdown(decode(1, 4096), LLAMA_3_1_70B, H100_SXM, 1, EFF);
  for (const tp of [2, 4, 8]) {
    const b = stepBreakdown(decode(1, 4096), LLAMA_3_1_70B, H100_SXM, tp, EFF);
    close(b.matmul.memoryMs, base.matmul.memoryMs / tp);
    close(b.decodeAttention.memoryMs, base.decodeAttention.memoryMs / tp);
    assert.ok(b.commMs > 0);
    assert.ok(b.totalMs < base.totalMs && b.totalMs > base.totalMs / tp);
  }
  assert.equal(base.commMs, 0);
  // Fewer KV heads than GPUs: each GPU keeps one replicated head, not a fraction of one.
  const twoKvHeads: ModelProfile = { ...LLAMA_3_1_8B, numKvHeads: 2 };
  assert.equal(kvBytesPerTokenPerGpu(twoKvHeads, 4), 2 * 32 * 1 * 128 * 2);
  assert.equal(kvBytesPerTokenPerGpu(LLAMA_3_1_8B, 4), 2 * 32 * 2 * 128 * 2);
});

test('tensor-parallel degrees the model cannot be split into, or beyond a node, are refused', () => {
  assert.throws(() => stepTimeMs(decode(1, 0), LLAMA_3_1_70B, H100_SXM, 3), /64 attention heads/);
  assert.throws(() => stepTimeMs(decode(1, 0), LLAMA_3_1_70B, H100_SXM, 16), /exceeds the 8 GPUs/);
  assert.throws(() => stepTimeMs(decode(1, 0), LLAMA_3_1_70B, H100_SXM, 0), RangeError);
  assert.throws(() => stepTimeMs(prefill(-1), LLAMA_3_1_70B, H100_SXM, 1), RangeError);
  assert.throws(() => stepTimeMs(decode(1, 0), LLAMA_3_1_70B, H100_SXM, 1, { ...EFF, matmulMfu: 0 }), RangeError);
});

test('KV transfer: bytes over the link per direction, split over parallel links', () => {
  const bytes = 1024 * 2 * 80 * 8 * 128 * 2; // 320 MiB
  // One 400 Gb/s port = 50 GB/s each way: 6.7 ms, not the 0.8 ms of seed 001.
  const oneNic = kvTransferTimeMs(1024, LLAMA_3_1_70B, INFINIBAND_NDR, { efficiency: 1 });
  close(oneNic, 0.003 + (bytes / 50e9) * 1000);
  assert.ok(oneNic > 6.7 && oneNic < 6.72);
  close(kvTransferTimeMs(1024, LLAMA_3_1_70B, INFINIBAND_NDR, { parallelLinks: 4, efficiency: 0.9 }),
    0.003 + (bytes / 4 / (50e9 * 0.9)) * 1000);
  close(kvTransferTimeMs(1024, LLAMA_3_1_70B, NVLINK4, { efficiency: 1 }), 0.001 + (bytes / 450e9) * 1000);
  // PCIe 5 x16: 32 GT/s x 16 lanes, 128b/130b, per direction.
  close(kvTransferTimeMs(1024, LLAMA_3_1_70B, PCIE5_X16, { efficiency: 1 }),
    0.002 + (bytes / ((32e9 * 16 * 128) / 130 / 8)) * 1000);
  assert.equal(kvTransferTimeMs(0, LLAMA_3_1_70B, INFINIBAND_NDR), 0);
  close(kvTransferTimeMs(1024, LLAMA_3_1_70B, INFINIBAND_NDR),
    0.003 + (bytes / (50e9 * DEFAULT_EFFICIENCY.commEfficiency)) * 1000);
});

test('KV capacity: what 90% of HBM holds after the weight shard', () => {
  const perGpuFree = 80 * 2 ** 30 * 0.9 - (2 * L70.params) / 4;
  assert.equal(kvCapacityTokens(LLAMA_3_1_70B, H100_SXM, 4), Math.floor(perGpuFree / (327_680 / 4)));
  assert.equal(kvCapacityTokens(LLAMA_3_1_70B, H100_SXM, 1), 0); // 141 GB of weights on one 80 GB GPU
});

// A spread of steps that exercises every factor: small decodes (bandwidth), long prefills (matmul MFU), prefills on
// long cached prefixes (attention MFU), token counts varying at tp 2 (communication), and all of them (overhead).
function calibrationSteps(): StepShape[] {
  const steps: StepShape[] = [];
  for (const batch of [1, 8, 32, 128]) for (const ctx of [128, 2048, 8192]) steps.push(decode(batch, ctx));
  for (const n of [512, 2048, 8192]) for (const ctx of [0, 8192]) steps.push(prefill(n, ctx));
  steps.push({ prefillTokens: [{ newTokens: 1024, contextLen: 0 }], decodeSeqs: decode(32, 4096).decodeSeqs });
  return steps;
}

/** Step times the model itself gives for known factors, tp 2. */
const synthetic = (truth: Efficiency) => calibrationSteps()
  .map((step) => ({ step, timeMs: stepTimeMs(step, LLAMA_3_1_8B, H100_SXM, 2, truth) }));

test('calibration recovers known factors from synthetic step times', () => {
  const truth: Efficiency = {
    matmulMfu: 0.45, attentionMfu: 0.3, bandwidthUtilization: 0.7, commEfficiency: 0.65, stepOverheadMs: 0.9,
  };
  const points = synthetic(truth);
  const fit = calibrateEfficiency(points, LLAMA_3_1_8B, H100_SXM, 2);
  assert.deepEqual(fit.unidentified, []);
  for (const key of Object.keys(truth) as (keyof Efficiency)[]) close(fit.efficiency[key]!, truth[key]!, 1e-6);
  assert.ok(fit.rmsErrorMs < 1e-9);

  // With 0.5% noise on every point: the big terms within 3%; communication, a few percent of each step here, within
  // 10% (the same noise is a larger share of a smaller term).
  let seed = 7;
  const noisy = points.map((p) => {
    seed = (seed * 1103515245 + 12345) % 2 ** 31;
    return { ...p, timeMs: p.timeMs * (1 + 0.005 * ((seed / 2 ** 31) * 2 - 1)) };
  });
  const rough = calibrateEfficiency(noisy, LLAMA_3_1_8B, H100_SXM, 2);
  for (const key of ['matmulMfu', 'attentionMfu', 'bandwidthUtilization'] as const) {
    close(rough.efficiency[key], truth[key], 0.03);
  }
  close(rough.efficiency.commEfficiency, truth.commEfficiency, 0.1);
});

test('calibration reports factors the points cannot determine and leaves them as given', () => {
  const truth: Efficiency = { ...DEFAULT_EFFICIENCY, bandwidthUtilization: 0.85, stepOverheadMs: 0.25 };
  // Single-GPU decodes only: every step memory-bound, no communication.
  const points = [1, 2, 4, 8, 16].flatMap((batch) => [256, 4096].map((ctx) => {
    const step = decode(batch, ctx);
    return { step, timeMs: stepTimeMs(step, LLAMA_3_1_8B, H100_SXM, 1, truth) };
  }));
  const fit = calibrateEfficiency(points, LLAMA_3_1_8B, H100_SXM, 1);
  assert.deepEqual(fit.fitted.sort(), ['bandwidthUtilization', 'stepOverheadMs']);
  assert.deepEqual(fit.unidentified.sort(), ['attentionMfu', 'commEfficiency', 'matmulMfu']);
  close(fit.efficiency.bandwidthUtilization, 0.85, 1e-9);
  close(fit.efficiency.stepOverheadMs, 0.25, 1e-9);
  assert.equal(fit.efficiency.matmulMfu, DEFAULT_EFFICIENCY.matmulMfu);
  // Fitting a subset holds the rest at `initial`.
  const subset = calibrateEfficiency(points, LLAMA_3_1_8B, H100_SXM, 1, { fit: ['bandwidthUtilization'] });
  assert.deepEqual(subset.fitted, ['bandwidthUtilization']);
  assert.equal(subset.efficiency.stepOverheadMs, DEFAULT_EFFICIENCY.stepOverheadMs);
  assert.throws(() => calibrateEfficiency(points.slice(0, 2), LLAMA_3_1_8B, H100_SXM, 1), RangeError);
});

test('calibration holds the factors it is not asked to fit exactly where they were given', () => {
  const truth: Efficiency = {
    matmulMfu: 0.55, attentionMfu: 0.35, bandwidthUtilization: 0.72, commEfficiency: 0.75, stepOverheadMs: 0.6,
  };
  const points = synthetic(truth);
  const initial = { ...truth, bandwidthUtilization: 0.9, stepOverheadMs: 0.1 };
  const fit = calibrateEfficiency(points, LLAMA_3_1_8B, H100_SXM, 2,
    { fit: ['bandwidthUtilization', 'stepOverheadMs'], initial });
  assert.equal(fit.efficiency.matmulMfu, 0.55);
  assert.equal(fit.efficiency.attentionMfu, 0.35);
  assert.equal(fit.efficiency.commEfficiency, 0.75);
  close(fit.efficiency.bandwidthUtilization, 0.72, 1e-6);
  close(fit.efficiency.stepOverheadMs, 0.6, 1e-6);
});
