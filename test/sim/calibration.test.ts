// The measured calibration against the real-GPU kernel times in ../shared/reference/gpu-measured (skipped when that
// folder is absent): refitting from the files gives the constants the simulator ships, and the calibrated model
// reproduces every measured figure within the tolerance docs/simulator.md states. The roofline calibration is
// checked to be the optimistic one the measurements disagree with.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import {
  calibrationEfficiency, CALIBRATIONS, DEFAULT_CALIBRATION, fitMeasuredEfficiency, MEASURED_EFFICIENCY,
  measuredFigures, parseCalibration, simulatedComputeMs, type MeasuredGpuFile,
} from '../../src/sim/calibration.ts';
import { A100_SXM_80GB, getHardwareProfile, H100_SXM, H200_SXM } from '../../src/sim/hardware.ts';
import { LLAMA_3_1_8B } from '../../src/sim/models.ts';
import { DEFAULT_EFFICIENCY, stepBreakdown, stepTimeMs, type Efficiency } from '../../src/sim/perf-model.ts';
import { readReferenceJson, skipUnlessReference } from '../helpers/shared-reference.ts';

/** The stated tolerance: every figure within 10% of the measured compute. */
const TOLERANCE = 0.10;
const GPUS = ['h100', 'h200'] as const;
const file = (gpu: string) => `gpu-measured/${gpu}.json`;

for (const gpu of GPUS) {
  const skip = skipUnlessReference(file(gpu));

  test(`measured calibration: refitting ${gpu}.json gives the shipped constants`, { skip }, () => {
    const fit = fitMeasuredEfficiency(readReferenceJson<MeasuredGpuFile>(file(gpu)), getHardwareProfile(gpu));
    const shipped = MEASURED_EFFICIENCY[gpu];
    for (const key of Object.keys(fit) as (keyof Efficiency)[]) {
      const want = fit[key]!;
      const got = shipped[key]!;
      // The constants are the fit rounded to three significant figures.
      assert.ok(Math.abs(got - want) <= 0.005 * Math.abs(want) + 1e-12, `${gpu} ${key}: shipped ${got}, fit ${want}`);
    }
  });

  test(`measured calibration reproduces every ${gpu} figure within ${TOLERANCE * 100}%; roofline is faster`, { skip }, () => {
    const data = readReferenceJson<MeasuredGpuFile>(file(gpu));
    const hw = getHardwareProfile(gpu);
    const figures = measuredFigures(data);
    // Both models, 1 prefill + the decode batch sizes each: nothing silently dropped.
    const decodes = (m: MeasuredGpuFile['llama31_8b_tp1']) => Object.keys(m).filter((k) => /^decode_b\d+_ms$/.test(k)).length;
    assert.equal(figures.length, 2 + decodes(data.llama31_8b_tp1) + decodes(data.llama31_70b_tp4_shard));
    const measured = calibrationEfficiency('measured', hw);
    for (const f of figures) {
      const sim = simulatedComputeMs(f, hw, measured);
      const error = sim / f.measuredMs - 1;
      assert.ok(Math.abs(error) <= TOLERANCE, `${gpu} ${f.label}: sim ${sim.toFixed(2)} ms, measured ` +
        `${f.measuredMs.toFixed(2)} ms (${(error * 100).toFixed(1)}%)`);
      // The seed's roofline factors are optimistic on every figure: that is what the calibration corrects.
      assert.ok(simulatedComputeMs(f, hw, DEFAULT_EFFICIENCY) < f.measuredMs, `${gpu} ${f.label}: roofline not faster`);
    }
  });
}

test('the compared quantity leaves out what the measurement did not time: all-reduce and CPU step overhead', () => {
  const [prefill70b] = measuredFigures(syntheticFile()).filter((f) => f.tp === 4);
  const e = MEASURED_EFFICIENCY.h100;
  const b = stepBreakdown(prefill70b!.step, prefill70b!.model, H100_SXM, 4, e);
  assert.ok(b.commMs > 0 && b.overheadMs > 0);
  assert.equal(simulatedComputeMs(prefill70b!, H100_SXM, e), b.totalMs - b.commMs - b.overheadMs);
  // The new terms are in the step: a decode step at the measured calibration pays the layers' floor and the
  // elementwise passes, the roofline calibration neither.
  const decode = { prefillTokens: [], decodeSeqs: [{ contextLen: 1024 }] };
  const m = stepBreakdown(decode, LLAMA_3_1_8B, H100_SXM, 1, e);
  assert.equal(m.layerOverheadMs, (LLAMA_3_1_8B.numLayers * e.layerOverheadUs!) / 1000);
  assert.ok(m.elementwiseMs > 0);
  const r = stepBreakdown(decode, LLAMA_3_1_8B, H100_SXM, 1, DEFAULT_EFFICIENCY);
  assert.equal(r.layerOverheadMs, 0);
  assert.equal(r.elementwiseMs, 0);
});

test('calibration names: roofline is the default and the seed factors; GPUs without measurements take the H100 fit', () => {
  assert.deepEqual([...CALIBRATIONS], ['roofline', 'measured']);
  assert.equal(DEFAULT_CALIBRATION, 'roofline');
  assert.equal(calibrationEfficiency('roofline', H200_SXM), DEFAULT_EFFICIENCY);
  assert.equal(calibrationEfficiency('measured', H200_SXM), MEASURED_EFFICIENCY.h200);
  assert.equal(calibrationEfficiency('measured', A100_SXM_80GB), MEASURED_EFFICIENCY.h100);
  assert.equal(parseCalibration('Measured'), 'measured');
  assert.throws(() => parseCalibration('fast'), /unknown simulator calibration "fast"; known: roofline, measured/);
  // Measured is slower than roofline on a serving-shaped step, and both are finite.
  const step = { prefillTokens: [{ newTokens: 512, contextLen: 0 }], decodeSeqs: [{ contextLen: 2048 }] };
  assert.ok(stepTimeMs(step, LLAMA_3_1_8B, H100_SXM, 1, MEASURED_EFFICIENCY.h100)
    > stepTimeMs(step, LLAMA_3_1_8B, H100_SXM, 1, DEFAULT_EFFICIENCY));
});

/** A file with the measured shapes and arbitrary times, for tests that need figures but not the data. */
function syntheticFile(): MeasuredGpuFile {
  const m = { prefill_1024_ms: 1, prefill_gemms_per_layer_ms: 1, prefill_gemm_mfu_vs_989: 0.7, prefill_attention_per_layer_ms: 0.05, decode_b1_ms: 1 };
  return { device: 'synthetic', llama31_8b_tp1: m, llama31_70b_tp4_shard: m };
}

test('conduit serve --engine sim: the worker pool gives every simulated worker the chosen calibration', async () => {
  const { createWorkerPool } = await import('../../src/runtime/worker-pool.ts');
  const { SimEngine } = await import('../../src/sim/sim-engine.ts');
  for (const [calibration, want] of [[undefined, DEFAULT_EFFICIENCY], ['measured', MEASURED_EFFICIENCY.h200]] as const) {
    const pool = await createWorkerPool({
      engine: 'sim', workers: 2, routerSeed: 1,
      sim: { model: 'llama-3.1-8b', gpu: 'h200', tp: 1, speedUp: Infinity, ...(calibration ? { calibration } : {}) },
    });
    try {
      assert.equal(pool.workers.length, 2);
      for (const w of pool.workers) {
        assert.ok(w.engine instanceof SimEngine);
        assert.equal(w.engine.worker.efficiency, want);
      }
      assert.match(pool.notices.map((notice) => notice.message).join('\n'), new RegExp(`${calibration ?? 'roofline'} calibration`));
    } finally {
      await pool.engine.close();
    }
  }
});
