import { test } from 'node:test';
import assert from 'node:assert/strict';
import { H100_SXM, INFINIBAND_NDR } from '../../src/sim/hardware.ts';
import { LLAMA_3_1_70B, LLAMA_3_1_8B } from '../../src/sim/models.ts';
import type { Efficiency } from '../../src/sim/perf-model.ts';
import { kvCapacityTokens, stepBreakdown, stepTimeMs } from '../../src/sim/perf-model.ts';
import {
  DEFAULT_OVERHEADS, LIFECYCLE_PHASES, decodeSweep, formatDecodeSweep, formatLifecycleTable, simulateLifecycle,
} from '../../src/sim/latency-model.ts';
import type { TtftTrace } from '../../src/sim/latency-model.ts';

const close = (actual: number, expected: number, relTol = 1e-9) =>
  assert.ok(Math.abs(actual - expected) <= relTol * Math.abs(expected), `${actual} != ${expected}`);
const EFF: Efficiency = {
  matmulMfu: 0.5, attentionMfu: 0.25, bandwidthUtilization: 0.75, commEfficiency: 0.7, stepOverheadMs: 0.3,
};
const phaseMs = (trace: TtftTrace, name: string) => trace.phases.find((p) => p.phase === name)?.ms;
const base = { model: LLAMA_3_1_70B, hw: H100_SXM, tp: 4, promptTokens: 1024, efficiency: EFF };

test('cold TTFT, aggregated: CPU phases plus one prefill step that samples the first token', () => {
  const { cold } = simulateLifecycle(base);
  assert.deepEqual(cold.phases.map((p) => p.phase), LIFECYCLE_PHASES);
  const o = DEFAULT_OVERHEADS;
  close(phaseMs(cold, 'tokenize')!, (1024 / o.tokenizeTokensPerSec) * 1000); // 5.12 ms at 200k tokens/s
  assert.equal(phaseMs(cold, 'scheduler_queue'), 0); // idle engine
  const prefillMs = stepTimeMs({ prefillTokens: [{ newTokens: 1024, contextLen: 0 }], decodeSeqs: [] },
    LLAMA_3_1_70B, H100_SXM, 4, EFF);
  close(phaseMs(cold, 'prefill_execution')!, prefillMs);
  assert.equal(phaseMs(cold, 'kv_transfer'), 0);
  assert.equal(phaseMs(cold, 'decode_execution'), 0);
  const cpuMs = o.httpReceiveMs + o.authMs + o.rateLimitMs + o.validateMs + (1024 / o.tokenizeTokensPerSec) * 1000
    + o.routerLookupMs + o.dispatchMs + o.streamingResponseMs;
  close(cold.ttftMs, cpuMs + prefillMs);
});

test('warm TTFT: a whole-block prefix hit leaves the last partial block to prefill', () => {
  const { warm, cold } = simulateLifecycle(base);
  assert.equal(warm.cachedTokens, 1008); // 63 blocks of 16; the 1024th token is always recomputed
  assert.equal(warm.computedTokens, 16);
  const warmStep = stepTimeMs({ prefillTokens: [{ newTokens: 16, contextLen: 1008 }], decodeSeqs: [] },
    LLAMA_3_1_70B, H100_SXM, 4, EFF);
  close(phaseMs(warm, 'prefill_execution')!, warmStep);
  assert.ok(warm.ttftMs < cold.ttftMs);
  // A 16-token step streams the same weights as a one-token decode, so it costs about as much.
  const decodeStep = stepTimeMs({ prefillTokens: [], decodeSeqs: [{ contextLen: 1023 }] },
    LLAMA_3_1_70B, H100_SXM, 4, EFF);
  assert.ok(warmStep >= decodeStep && warmStep < 1.2 * decodeStep);
  // A full hit still recomputes one token; a given hit is honoured.
  assert.equal(simulateLifecycle({ ...base, cachedTokens: 1024 }).warm.computedTokens, 1);
  assert.equal(simulateLifecycle({ ...base, cachedTokens: 512 }).warm.computedTokens, 512);
});

test('cold TTFT, disaggregated: the prefill worker samples the first token; the transfer comes after it', () => {
  const agg = simulateLifecycle(base);
  const disagg = simulateLifecycle({ ...base, disaggregated: { link: INFINIBAND_NDR } });
  for (const after of ['kv_transfer', 'decode_dispatch', 'decode_execution'] as const) assert.equal(phaseMs(disagg.cold, after), 0);
  close(disagg.cold.ttftMs, agg.cold.ttftMs);
  // The note gives the transfer's time: one 400 Gb/s NIC per GPU, each sending its quarter of the 320 MiB.
  const transferMs = 0.003 + ((1024 * 327_680) / 4 / (50e9 * EFF.commEfficiency)) * 1000;
  assert.match(disagg.cold.phases.find((p) => p.phase === 'kv_transfer')!.detail, new RegExp(`^after the first token: ${transferMs.toFixed(2)} ms`));
  // The warm request stays on the worker holding the prefix: nothing crosses the link.
  close(disagg.warm.ttftMs, agg.warm.ttftMs);
});

test('long prompts are prefilled in chunks of the step budget, each attending to the chunks before it', () => {
  const { cold } = simulateLifecycle({ ...base, model: LLAMA_3_1_8B, tp: 1, promptTokens: 10_000,
    maxNumBatchedTokens: 4096 });
  const prefillPhase = cold.phases.find((p) => p.phase === 'prefill_execution')!;
  assert.deepEqual(prefillPhase.steps!.map((s) => s.work.newTokens), [4096, 4096, 1808]);
  assert.deepEqual(prefillPhase.steps!.map((s) => s.work.sampledTokens), [0, 0, 1]);
  const expected = [[4096, 0, false], [4096, 4096, false], [1808, 8192, true]] as const;
  const sum = expected.reduce((s, [newTokens, contextLen, sampled]) => s + stepTimeMs(
    { prefillTokens: [{ newTokens, contextLen, sampled }], decodeSeqs: [] }, LLAMA_3_1_8B, H100_SXM, 1, EFF), 0);
  close(prefillPhase.ms, sum);
});

test('decode sweep: ITL grows with batch, throughput is batch / ITL, KV capacity is checked', () => {
  const sweep = decodeSweep({ model: LLAMA_3_1_70B, hw: H100_SXM, tp: 4, contextLen: 8192, efficiency: EFF });
  assert.deepEqual(sweep.rows.map((r) => r.batch), [1, 2, 4, 8, 16, 32, 64, 128, 256]);
  for (let i = 0; i < sweep.rows.length; i++) {
    const r = sweep.rows[i]!;
    close(r.tokensPerSec, (r.batch / r.itlMs) * 1000);
    close(r.tokensPerSecPerGpu, r.tokensPerSec / 4);
    const decodeSeqs = Array.from({ length: r.batch }, () => ({ contextLen: 8192 }));
    close(r.itlMs, stepBreakdown({ prefillTokens: [], decodeSeqs }, LLAMA_3_1_70B, H100_SXM, 4, EFF).totalMs);
    // Whole blocks of 16: ceil(8,193 / 16) = 513 per sequence.
    assert.equal(r.kvFits, r.batch * 513 <= Math.floor(kvCapacityTokens(LLAMA_3_1_70B, H100_SXM, 4) / 16));
    if (i > 0) {
      assert.ok(r.itlMs > sweep.rows[i - 1]!.itlMs);
      assert.ok(r.tokensPerSec > sweep.rows[i - 1]!.tokensPerSec);
    }
  }
  // About 513k tokens fit (each GPU holds a quarter of every token): 62 sequences of 8193, so 32 fit and 64 do not.
  assert.equal(sweep.rows.find((r) => r.batch === 32)!.kvFits, true);
  assert.equal(sweep.rows.find((r) => r.batch === 64)!.kvFits, false);
});

test('decode sweep: KV fits counts whole blocks, as the engine allocates them', () => {
  // 4 x H100 at 90% of 80 GiB: 77,309,411,328 B less a quarter of 70,553,706,496 BF16 params (35,276,853,248 B)
  // leaves 42,032,558,080 B per GPU, 513,092 tokens of 81,920 B (2 KV heads per GPU), 32,068 blocks of 16.
  // At context 1024 a sequence holds 1,025 tokens in 65 blocks: 490 x 65 = 31,850 fit, 500 x 65 = 32,500 do not,
  // though 500 x 1,025 = 512,500 tokens are fewer than 513,092.
  assert.equal(kvCapacityTokens(LLAMA_3_1_70B, H100_SXM, 4), 513_092);
  const sweep = decodeSweep({ model: LLAMA_3_1_70B, hw: H100_SXM, tp: 4, contextLen: 1024, batchSizes: [490, 500], efficiency: EFF });
  assert.deepEqual(sweep.rows.map((r) => r.kvFits), [true, false]);
  // Blocks of 1 are tokens: 500 sequences of 1,025 then fit.
  const perToken = decodeSweep({ model: LLAMA_3_1_70B, hw: H100_SXM, tp: 4, contextLen: 1024, batchSizes: [500], efficiency: EFF, blockSize: 1 });
  assert.equal(perToken.rows[0]!.kvFits, true);
});

test('the text tables show every phase and batch with the numbers of the data', () => {
  const report = simulateLifecycle({ ...base, disaggregated: { link: INFINIBAND_NDR } });
  const text = formatLifecycleTable(report);
  for (const phase of LIFECYCLE_PHASES) assert.match(text, new RegExp(`^${phase} `, 'm'));
  assert.match(text, new RegExp(`^TTFT +${report.cold.ttftMs.toFixed(2)} +${report.warm.ttftMs.toFixed(2)} `, 'm'));
  assert.match(text, /^ {2}tensor-parallel comm /m);
  // A phase neither column spends time in carries the cold path's note: disaggregated, the transfer and the hand-over
  // come after the first token, not "KV already on the worker" / "same worker" (the warm request's).
  assert.match(text, /^kv_transfer( +0\.00){3} +after the first token: [\d.]+ ms over 4 x InfiniBand NDR/m);
  assert.match(text, /^decode_dispatch( +0\.00){3} +after the first token \(hand-over to the decode worker\)$/m);
  assert.match(text, /^decode_execution( +0\.00){3} +first token comes from the prefill worker's last step$/m);
  assert.match(formatLifecycleTable(simulateLifecycle(base)), /^kv_transfer( +0\.00){3} +same worker$/m);
  const sweep = decodeSweep({ model: LLAMA_3_1_70B, hw: H100_SXM, tp: 4, contextLen: 1024, batchSizes: [1, 64] });
  const lines = formatDecodeSweep(sweep).trimEnd().split('\n');
  assert.equal(lines.length, 2 + 1 + 2 + 2); // title, blank, header, rule, two rows
  assert.match(lines[5]!, new RegExp(`^ +1 +${sweep.rows[0]!.itlMs.toFixed(2)} `));
  assert.match(lines[6]!, new RegExp(`^ +64 +${sweep.rows[1]!.itlMs.toFixed(2)} `));
});

test('bad inputs are refused', () => {
  assert.throws(() => simulateLifecycle({ ...base, promptTokens: 0 }), RangeError);
  assert.throws(() => simulateLifecycle({ ...base, tp: 3 }), RangeError);
  assert.throws(() => decodeSweep({ model: LLAMA_3_1_70B, hw: H100_SXM, tp: 4, contextLen: 10, batchSizes: [0] }),
    RangeError);
});
