// The per-layer prefill table: each row is the roofline of one kernel, the rows the step time models add up to the
// step time, and with every factor at 100% the rows are the hand-computed floors of docs/simulator.md section 4.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { H100_SXM } from '../../src/sim/hardware.ts';
import { prefillLayerTable, formatPrefillLayerTable, SEED_001_PREFILL_LAYER_US } from '../../src/sim/layer-table.ts';
import { DEEPSEEK_V3, LLAMA_3_1_70B, LLAMA_3_1_8B, lmHeadParamCount, MIXTRAL_8X7B } from '../../src/sim/models.ts';
import { DEFAULT_EFFICIENCY, stepBreakdown, type Efficiency } from '../../src/sim/perf-model.ts';
import { MEASURED_EFFICIENCY } from '../../src/sim/calibration.ts';

const FULL: Efficiency = { matmulMfu: 1, attentionMfu: 1, bandwidthUtilization: 1, commEfficiency: 1, stepOverheadMs: 0 };
const near = (a: number, b: number, what: string) => assert.ok(Math.abs(a - b) <= 1e-9 * Math.max(1, Math.abs(b)), `${what}: ${a} vs ${b}`);

test('at 100% the rows are the floors: FLOPs over peak, bytes over HBM bandwidth (70B, tp 4, 1024 tokens)', () => {
  const t = prefillLayerTable(LLAMA_3_1_70B, H100_SXM, 4, 1024, FULL);
  const us = (name: string) => t.rows.find((r) => r.kernel === name)!.timeUs;
  const peak = H100_SXM.bf16FlopsPerSec;
  const hbm = H100_SXM.hbmBytesPerSec;
  // Per GPU: 64/4 query heads and 8/4 KV heads of 128, FFN 28672/4, hidden 8192, BF16.
  near(us('QKV projection'), (2 * 1024 * 8192 * (16 + 2 * 2) * 128 / peak) * 1e6, 'QKV');
  near(us('O projection'), (2 * 1024 * 2048 * 8192 / peak) * 1e6, 'O');
  near(us('MLP gate + up'), (2 * 1024 * 8192 * 2 * 7168 / peak) * 1e6, 'gate/up');
  near(us('MLP down'), (2 * 1024 * 7168 * 8192 / peak) * 1e6, 'down');
  near(us('attention'), (4 * 16 * 128 * (1024 * 1025) / 2 / peak) * 1e6, 'attention');
  near(us('SiLU x multiply'), (3 * 1024 * 7168 * 2 / hbm) * 1e6, 'SiLU');
  near(us('RMSNorm x 2'), (4 * 1024 * 8192 * 2 / hbm) * 1e6, 'norms');
  near(us('RoPE'), (2 * 1024 * (2048 + 256) * 2 / hbm) * 1e6, 'RoPE');
  // Ring all-reduce of 16 MiB over 4 GPUs: 6 hops of 1 µs, 1.5 x payload at 450 GB/s.
  near(us('all-reduce (attention)'), 6 + (1.5 * 1024 * 8192 * 2 / 450e9) * 1e6, 'all-reduce');
  assert.deepEqual(t.rows.map((r) => r.kernel), ['QKV projection', 'RoPE', 'attention', 'O projection',
    'all-reduce (attention)', 'MLP gate + up', 'SiLU x multiply', 'MLP down', 'all-reduce (MLP)', 'RMSNorm x 2']);
  const text = formatPrefillLayerTable(t, SEED_001_PREFILL_LAYER_US);
  assert.match(text, /seed 001 µs/);
  assert.match(text, /^per layer\s+607\.0\s+518\s+571\.0 in step time$/m);
});

for (const [name, e] of [['roofline', DEFAULT_EFFICIENCY], ['100%', FULL]] as const) {
  test(`the rows in the step time add up to the prefill step (${name}): layers x rows + LM head (and its logits gather) + overhead`, () => {
    for (const [model, tp] of [[LLAMA_3_1_70B, 4], [LLAMA_3_1_8B, 1]] as const) {
      const t = prefillLayerTable(model, H100_SXM, tp, 1024, e);
      const step = stepBreakdown({ prefillTokens: [{ newTokens: 1024, contextLen: 0 }], decodeSeqs: [] }, model, H100_SXM, tp, e);
      assert.equal(step.matmul.bound, 'compute');
      const lmHeadMs = (2 * lmHeadParamCount(model) / tp) / (H100_SXM.bf16FlopsPerSec * e.matmulMfu) * 1000;
      near((model.numLayers * t.stepRowsUs) / 1000 + lmHeadMs + step.logitsGatherMs + step.overheadMs, step.totalMs, `${model.name} tp ${tp}`);
      assert.equal(t.rows.some((r) => r.kernel.startsWith('all-reduce')), tp > 1);
    }
  });
}

test('the measured calibration slows every GEMM row by its MFU and leaves the factors\' validation to the step model', () => {
  const roof = prefillLayerTable(LLAMA_3_1_8B, H100_SXM, 1, 1024);
  const meas = prefillLayerTable(LLAMA_3_1_8B, H100_SXM, 1, 1024, MEASURED_EFFICIENCY.h100);
  const qkv = (t: typeof roof) => t.rows.find((r) => r.kernel === 'QKV projection')!.timeUs;
  near(qkv(meas) * MEASURED_EFFICIENCY.h100.matmulMfu, qkv(roof) * DEFAULT_EFFICIENCY.matmulMfu, 'QKV scales with 1/MFU');
  assert.throws(() => prefillLayerTable(LLAMA_3_1_8B, H100_SXM, 1, 1024, { ...FULL, matmulMfu: 0 }), /matmulMfu must be > 0/);
});

test('mixture-of-experts and MLA models: the table says it is a dense approximation that does not add up', () => {
  // Mixtral 8x7B, tp 2: a token goes through 2 of 8 experts of 14,336, so its FFN FLOPs are twice the dense rows'
  // (2 x 3 x 4096 x 14336 per token against 3 x 4096 x 14336): the step is longer than the rows can say.
  const mixtral = prefillLayerTable(MIXTRAL_8X7B, H100_SXM, 2, 1024);
  const step = stepBreakdown({ prefillTokens: [{ newTokens: 1024, contextLen: 0 }], decodeSeqs: [] }, MIXTRAL_8X7B, H100_SXM, 2);
  assert.ok(step.totalMs > (MIXTRAL_8X7B.numLayers * mixtral.stepRowsUs) / 1000 + step.overheadMs + 1);
  assert.match(mixtral.denseApproximation ?? '', /^Mixtral 8x7B: its FFN is 8 experts of 14336, 2 per token, not the dense FFN/);
  assert.match(formatPrefillLayerTable(mixtral), /\nnote: Mixtral 8x7B: .*dense approximation and its rows do not add up to the prefill step/);
  const deepseek = prefillLayerTable(DEEPSEEK_V3, H100_SXM, 8, 1024);
  assert.match(deepseek.denseApproximation ?? '', /256 experts of 2048, 8 per token plus 1 shared \(after 3 dense layers\).*multi-head latent attention/);
  // Dense GQA models are what the table models: no note.
  assert.equal(prefillLayerTable(LLAMA_3_1_8B, H100_SXM, 1, 1024).denseApproximation, undefined);
  assert.doesNotMatch(formatPrefillLayerTable(prefillLayerTable(LLAMA_3_1_8B, H100_SXM, 1, 1024)), /note:/);
});
