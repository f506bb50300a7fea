// The capacity planner on Llama 3.1 8B, one H100 per worker, default efficiencies. Expected step times are worked
// out here from the model's shapes and the datasheet figures, not taken from the performance model's code.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { H100_SXM } from '../../src/sim/hardware.ts';
import { LLAMA_3_1_8B } from '../../src/sim/models.ts';
import { evaluateWorkers, formatPlan, planBounds, planCapacity, planWorkload, type PlanOptions } from '../../src/sim/planner.ts';
import { close } from './sim-fixtures.ts';

// Llama 3.1 8B: 32 layers, d 4096, 32 / 8 heads of 128, FFN 14336, vocab 128256, untied embeddings, BF16.
const LAYER_MATMUL_PARAMS = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336; // 218,103,808
const EMBEDDING_PARAMS = 128_256 * 4096;
const PARAMS = 32 * (LAYER_MATMUL_PARAMS + 2 * 4096) + 4096 + 2 * EMBEDDING_PARAMS; // 8,030,261,248
const STREAMED_BYTES = (PARAMS - EMBEDDING_PARAMS) * 2; // the lookup table is not streamed
const KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2; // 131,072
const ATTENTION_FLOPS_PER_KEY = 4 * 32 * 32 * 128;
// H100 SXM at the default efficiencies: 60% of 989.4 TFLOP/s for GEMMs, 40% for attention, 80% of 3.35 TB/s.
const GEMM_FLOPS_PER_MS = 989.4e12 * 0.6 / 1000;
const ATTENTION_FLOPS_PER_MS = 989.4e12 * 0.4 / 1000;
const HBM_BYTES_PER_MS = 3.35e12 * 0.8 / 1000;
const OVERHEAD_MS = 0.4;

/** B sequences decoding after c cached tokens each: one token and one logits row per sequence. */
function decodeStepMs(batch: number, c: number): number {
  const gemm = Math.max(2 * (32 * LAYER_MATMUL_PARAMS + EMBEDDING_PARAMS) * batch / GEMM_FLOPS_PER_MS, STREAMED_BYTES / HBM_BYTES_PER_MS);
  const attention = batch * Math.max(ATTENTION_FLOPS_PER_KEY * (c + 1) / ATTENTION_FLOPS_PER_MS, KV_BYTES_PER_TOKEN * (c + 1) / HBM_BYTES_PER_MS);
  return gemm + attention + OVERHEAD_MS;
}

/** One prompt of n tokens from scratch, its last token sampled. */
function prefillStepMs(n: number): number {
  const gemm = Math.max(2 * (32 * LAYER_MATMUL_PARAMS * n + EMBEDDING_PARAMS) / GEMM_FLOPS_PER_MS, STREAMED_BYTES / HBM_BYTES_PER_MS);
  const keys = (n * (n + 1)) / 2;
  const attention = Math.max(ATTENTION_FLOPS_PER_KEY * keys / ATTENTION_FLOPS_PER_MS, KV_BYTES_PER_TOKEN * n / HBM_BYTES_PER_MS);
  return gemm + attention + OVERHEAD_MS;
}

const base = (over: Partial<PlanOptions>): PlanOptions => ({
  model: LLAMA_3_1_8B, hw: H100_SXM, tp: 1, ratePerSec: 1, inputTokens: 128, outputTokens: 64, ttftP99Ms: 200,
  itlP99Ms: 30, numRequests: 200, worker: { maxNumSeqs: 8 }, ...over,
});

test('hand arithmetic: an idle worker and the decode capacity of a worker limited to 8 sequences', () => {
  const bounds = planBounds(base({}));
  // The weight stream (15.01 GB at 2.68 TB/s = 5.6007 ms) outweighs 128 tokens of GEMMs (3.01 ms at 594 TFLOP/s).
  close(bounds.idleTtftMs, prefillStepMs(128));
  close(prefillStepMs(128), STREAMED_BYTES / HBM_BYTES_PER_MS + ATTENTION_FLOPS_PER_KEY * 8256 / ATTENTION_FLOPS_PER_MS + 0.4);
  close(bounds.idleItlMs, decodeStepMs(1, 128));
  // Best decode throughput at the 8-sequence cap: 8 / 6.0512 ms = 1,322 tokens/s.
  assert.equal(bounds.decodeCapacityBatch, 8);
  close(bounds.decodeCapacityTokensPerSec, 8 / decodeStepMs(8, 128) * 1000);
  assert.ok(Math.abs(bounds.decodeCapacityTokensPerSec - 1322.06) < 0.01);
});

test('a rate so low that one worker suffices', () => {
  const opts = base({ ratePerSec: 0.5, outputTokens: 16, numRequests: 60, ttftP99Ms: 100, itlP99Ms: 50 });
  const result = planCapacity(opts);
  assert.deepEqual(result.answer, { workers: 1, gpus: 1 });
  assert.equal(result.trials.length, 1);
  const { summary } = result.trials[0]!;
  // Nobody beats an idle worker; at 0.5 requests/s, 2 s apart on average, most requests find it idle.
  assert.ok(summary.ttftMs.p50 >= prefillStepMs(128) - 1e-9);
  close(summary.ttftMs.p50, prefillStepMs(128));
  assert.match(formatPlan(opts, result), /answer: 1 worker\(s\) x tp 1 = 1 GPU\(s\)/);
});

test('a rate whose decode demand alone needs more than two workers', () => {
  // 45 requests/s x 63 decode tokens (the first token comes from the prefill) = 2,835 tokens/s > 2 x 1,322.
  const opts = base({ ratePerSec: 45 });
  const result = planCapacity(opts);
  assert.equal(result.bounds.decodeDemandTokensPerSec, 45 * 63);
  assert.ok(45 * 63 > 2 * (8 / decodeStepMs(8, 128) * 1000));
  assert.equal(result.bounds.minWorkers, 3);
  assert.ok(result.answer !== null && result.answer.workers >= 3);
  assert.ok(result.trials.every((t) => t.workers >= 3));
  // The answer meets the targets, and one worker fewer (if simulated) does not.
  const answerTrial = result.trials.find((t) => t.workers === result.answer!.workers)!;
  assert.ok(answerTrial.meetsTargets && answerTrial.summary.ttftMs.p99 <= 200 && answerTrial.summary.itlMs.p99 <= 30);
  const below = result.trials.find((t) => t.workers === result.answer!.workers - 1);
  if (below) assert.equal(below.meetsTargets, false);
});

test('more rate never needs fewer workers', () => {
  let previous = 0;
  for (const ratePerSec of [2, 20, 45, 80]) {
    const result = planCapacity(base({ ratePerSec }));
    assert.ok(result.answer !== null, `rate ${ratePerSec}: ${result.reason}`);
    assert.ok(result.answer.workers >= previous, `rate ${ratePerSec} needs ${result.answer.workers} < ${previous}`);
    previous = result.answer.workers;
  }
  assert.ok(previous >= 4); // 80 x 63 = 5,040 tokens/s over 1,322 per worker
});

test('targets below what an idle worker does are refused without simulating', () => {
  const tooFast = planCapacity(base({ ttftP99Ms: 5 }));
  assert.equal(tooFast.answer, null);
  assert.equal(tooFast.trials.length, 0);
  assert.match(tooFast.reason, /idle worker's TTFT is 6\.01 ms/);
  const itl = planCapacity(base({ itlP99Ms: 5 }));
  assert.equal(itl.answer, null);
  assert.match(itl.reason, /decode step at batch 1/);
  assert.throws(() => planCapacity(base({ deployment: 'disaggregated' })), /only aggregated/);
  assert.throws(() => planCapacity(base({ ratePerSec: 0 })), /ratePerSec/);
});

test('a shared prefix is held once in the KV pool, so it does not shrink the decode batch of the bound', () => {
  // A 100-block pool (16 tokens each); 1,024-token prompts whose first 1,008 tokens (63 whole blocks) are shared.
  // A decoding sequence holds ceil(1,025 / 16) = 65 blocks, 63 of them the shared ones, refcounted: the pool holds
  // the 63 once and (100 - 63) / 2 = 18 sequences' own 2 blocks. Counting 65 per sequence allowed 1 sequence.
  const opts = base({
    ratePerSec: 5, inputTokens: 1024, outputTokens: 64, sharedPrefixTokens: 1008, numRequests: 100,
    worker: { numKvBlocks: 100 },
  });
  const result = planCapacity(opts);
  assert.equal(result.bounds.decodeCapacityBatch, 18);
  close(result.bounds.decodeCapacityTokensPerSec, 18 / decodeStepMs(18, 1024) * 1000);
  // 5 requests/s x 63 decode tokens = 315 tokens/s: more than one sequence at a time decodes (1 / 6.2 ms = 161/s),
  // far less than 18 do. One worker is enough, and the simulation agrees.
  assert.ok(5 * 63 > 1 / decodeStepMs(1, 1024) * 1000);
  assert.equal(result.bounds.minWorkers, 1);
  assert.deepEqual(result.answer, { workers: 1, gpus: 1 });
  assert.equal(result.trials[0]!.meetsTargets, true);
});

test('requests longer than one worker holds are refused up front; cut-short or refused ones fail a trial', () => {
  // 100 blocks of 16 = 1,600 tokens of KV. A sequence of N tokens needs blocks for its first N - 1 (the last is fed
  // to a step that never runs), so the longest is 1,601 tokens: 1,500 in + 101 out fits, 1,500 + 102 does not.
  const small = (inputTokens: number, outputTokens: number) => base({
    ratePerSec: 0.1, inputTokens, outputTokens, numRequests: 20, ttftP99Ms: 1000, itlP99Ms: 100, worker: { numKvBlocks: 100 },
  });
  const fits = planCapacity(small(1500, 101));
  assert.deepEqual(fits.answer, { workers: 1, gpus: 1 });
  assert.equal(fits.trials[0]!.unserved, 0);
  assert.throws(() => planCapacity(small(1500, 102)), (error: Error) => error.name === 'SimConfigError'
    && /1500 prompt \+ 102 output tokens do not fit one worker .* at most 1601 tokens \(KV pool 100 blocks x 16 tokens/.test(error.message));
  // Simulated anyway: every request stops at 101 tokens, which flatters the latencies, so the trial fails.
  const cut = evaluateWorkers(small(1500, 102), 1);
  assert.equal(cut.unserved, 20);
  assert.equal(cut.meetsTargets, false);
  assert.match(formatPlan(small(1500, 102), { bounds: fits.bounds, trials: [cut], answer: null, reason: 'x' }), / no \(20 refused or cut short\)$/m);
  // A prompt over the pool is refused by every worker (prompt_exceeds_kv_pool).
  const refused = evaluateWorkers(small(1700, 8), 4);
  assert.equal(refused.unserved, 20);
  assert.equal(refused.meetsTargets, false);
});

test('out tok/s is the steady-state rate: it comes to the demand the arrivals made when the workers keep up', () => {
  const opts: PlanOptions = {
    model: LLAMA_3_1_8B, hw: H100_SXM, tp: 1, ratePerSec: 60, inputTokens: 1024, outputTokens: 256, ttftP99Ms: 500, itlP99Ms: 50,
  };
  const arrivals = planWorkload(opts).map((r) => r.arrivalMs).sort((a, b) => a - b);
  assert.equal(arrivals.length, 1000);
  // The demand those arrivals make: 256 output tokens for each request after the first measured one (the 101st,
  // past the 10% warm-up), over the time they took to arrive.
  const demand = ((arrivals.length - 1 - 100) * 256) / (arrivals.at(-1)! - arrivals[100]!) * 1000;
  const trial = evaluateWorkers(opts, 4);
  assert.equal(trial.meetsTargets, true);
  // It read 12% low (13,922 tok/s against 15,797) when it divided by the time to the last finish, the drain included.
  const rate = trial.summary.outputTokensPerSec;
  assert.ok(Math.abs(rate - demand) / demand < 0.02, `${rate.toFixed(0)} tok/s vs a demand of ${demand.toFixed(0)}`);

  // 300 requests at that rate are over before a steady state (the window from the first measured finish to the last
  // arrival is shorter than a request's latency): no figure rather than a low one.
  const short = evaluateWorkers({ ...opts, numRequests: 300 }, 4);
  assert.ok(Number.isNaN(short.summary.outputTokensPerSec));
  const text = formatPlan({ ...opts, numRequests: 300 }, { bounds: planBounds(opts), trials: [short], answer: null, reason: 'x' });
  assert.match(text, /^ +4 +4 +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +- +yes$/m);
  assert.match(text, /^\(out tok\/s counts from the first measured request's finish to the last arrival; - where/m);
});
