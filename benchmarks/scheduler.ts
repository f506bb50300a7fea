// Scheduler overhead per engine step, without a model: the time the control plane adds to every forward pass.
//
//   node --import tsx benchmarks/scheduler.ts [--running 256] [--steps 2000]
//
// Each scenario runs `steps` steps timed part by part with the wall clock (percentiles: schedule, updateFromOutput,
// and BatchBuilder.build apart), then `steps` more of schedule + updateFromOutput measured in process CPU time, the
// headline number (it does not count time spent waiting for a core on a busy machine).
//
// Scenario "decode": `running` requests in steady decode (one token each per step), 512-527-token prompts, blocks
// of 16. About one sequence in 16 crosses a block boundary per step, so block allocation and prefix-cache
// registration (SHA-256) are included.
// Scenario "churn": the same batch size, but requests finish after 32 tokens and are replaced by new ones sharing
// a 256-token system prompt, so admission, prefix hits, chunked prefill and freeing are included.

import { BatchBuilder } from '../src/engine/batch-builder.ts';
import { KvCacheManager } from '../src/engine/kv-cache/manager.ts';
import { Scheduler } from '../src/engine/scheduler.ts';
import { DEFAULT_SAMPLING } from '../src/engine/types.ts';
import type { EngineRequest } from '../src/engine/types.ts';

function argument(name: string, fallback: number): number {
  const at = process.argv.indexOf(`--${name}`);
  const value = at >= 0 ? Number(process.argv[at + 1]) : fallback;
  if (!Number.isSafeInteger(value) || value < 1) throw new RangeError(`--${name} must be a positive integer`);
  return value;
}

const NUM_RUNNING = argument('running', 256);
const NUM_STEPS = argument('steps', 2000);
const BLOCK_SIZE = 16;
const PROMPT_TOKENS = 512;
const WARMUP_STEPS = 200;
/** Decode requests outlive the prefill, the warm-up and the measured steps. */
const DECODE_MAX_TOKENS = 2 * NUM_STEPS + WARMUP_STEPS + 64;

let randomState = 12345;
function randomToken(): number {
  randomState = (Math.imul(randomState, 1103515245) + 12345) >>> 0;
  return 100 + (randomState % 30000);
}

function makeEngine(maxNumBatchedTokens: number): { scheduler: Scheduler; builder: BatchBuilder } {
  const maxModelLen = PROMPT_TOKENS + BLOCK_SIZE + DECODE_MAX_TOKENS;
  const kv = new KvCacheManager({ numBlocks: NUM_RUNNING * Math.ceil(maxModelLen / BLOCK_SIZE) + 64, blockSize: BLOCK_SIZE });
  const scheduler = new Scheduler({ maxNumBatchedTokens, maxNumSeqs: NUM_RUNNING, maxModelLen, eosTokenIds: [2] }, kv);
  return { scheduler, builder: BatchBuilder.forScheduler(scheduler) };
}

let nextId = 0;
function request(promptTokenIds: number[], maxTokens: number, nowMs: number): EngineRequest {
  return {
    id: `bench-${nextId++}`, promptTokenIds, priority: 0, arrivalMs: nowMs,
    sampling: { ...DEFAULT_SAMPLING, maxTokens, ignoreEos: true },
  };
}

interface Timings {
  schedule: number[];
  update: number[];
  build: number[];
}

function runStep(scheduler: Scheduler, builder: BatchBuilder | null, nowMs: number, timings?: Timings): number {
  const t0 = performance.now();
  const plan = scheduler.schedule(nowMs);
  const t1 = performance.now();
  if (plan.scheduled.length > 0) builder?.build(plan);
  const t2 = performance.now();
  let finished = 0;
  if (plan.scheduled.length > 0) {
    const sampled = new Int32Array(plan.sampleTargets.length);
    for (let i = 0; i < sampled.length; i++) sampled[i] = randomToken();
    finished = scheduler.updateFromOutput(plan, sampled, nowMs + 1).finishedRequests.length;
  }
  const t3 = performance.now();
  timings?.schedule.push((t1 - t0) * 1000);
  timings?.build.push((t2 - t1) * 1000);
  timings?.update.push((t3 - t2) * 1000);
  return finished;
}

function summarize(label: string, values: number[]): string {
  const sorted = [...values].sort((a, b) => a - b);
  const mean = values.reduce((sum, value) => sum + value, 0) / values.length;
  const at = (q: number): number => sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))]!;
  return `${label.padEnd(28)} mean ${mean.toFixed(1).padStart(7)} µs   p50 ${at(0.5).toFixed(1).padStart(7)} µs   p99 ${at(0.99).toFixed(1).padStart(7)} µs`;
}

/**
 * Runs `steps` steps of schedule + updateFromOutput (no batch build) and returns the process CPU time per step in
 * µs. CPU time rather than wall time: on a shared machine the wall clock also counts time the process waits for a
 * core; CPU time counts only work done (garbage collection included).
 */
function cpuMicrosPerStep(steps: number, runOne: () => void): number {
  const before = process.cpuUsage();
  for (let i = 0; i < steps; i++) runOne();
  const used = process.cpuUsage(before);
  return (used.user + used.system) / steps;
}

function report(title: string, timings: Timings, cpuMicros: number): void {
  const control = timings.schedule.map((value, i) => value + timings.update[i]!);
  console.log(`\n${title}`);
  console.log(`${'schedule + updateFromOutput'.padEnd(28)} CPU ${cpuMicros.toFixed(1).padStart(7)} µs per step`);
  console.log(summarize('  wall clock', control));
  console.log(summarize('  schedule', timings.schedule));
  console.log(summarize('  updateFromOutput', timings.update));
  console.log(summarize('BatchBuilder.build', timings.build));
}

// ---------------------------------------------------------------------------------------------------------------

function decodeScenario(): void {
  const { scheduler, builder } = makeEngine(8192);
  for (let i = 0; i < NUM_RUNNING; i++) {
    // Prompt lengths 512..527 spread block boundaries evenly over the steps, as in a real batch.
    scheduler.addRequest(request(Array.from({ length: PROMPT_TOKENS + (i % BLOCK_SIZE) }, randomToken), DECODE_MAX_TOKENS, 0), 0);
  }
  let now = 0;
  while (scheduler.sequences().running.some((sequence) => sequence.outputTokenIds.length === 0) || scheduler.numWaiting > 0) {
    runStep(scheduler, builder, now++);
  }
  for (let i = 0; i < WARMUP_STEPS; i++) runStep(scheduler, builder, now++); // JIT warm-up
  const timings: Timings = { schedule: [], update: [], build: [] };
  for (let i = 0; i < NUM_STEPS; i++) runStep(scheduler, builder, now++, timings);
  const cpu = cpuMicrosPerStep(NUM_STEPS, () => runStep(scheduler, null, now++));
  if (scheduler.numRunning !== NUM_RUNNING) throw new Error(`expected ${NUM_RUNNING} running, got ${scheduler.numRunning}`);
  report(`decode: ${NUM_RUNNING} running sequences, ${NUM_STEPS} + ${NUM_STEPS} steps`, timings, cpu);
}

function churnScenario(): void {
  const { scheduler, builder } = makeEngine(2048);
  const systemPrompt = Array.from({ length: 256 }, randomToken);
  const add = (now: number): void => {
    const user = Array.from({ length: 16 + (randomToken() % 64) }, randomToken);
    scheduler.addRequest(request([...systemPrompt, ...user], 32, now), now);
  };
  for (let i = 0; i < NUM_RUNNING; i++) add(0);
  let now = 0;
  for (let i = 0; i < 300; i++) {
    const finished = runStep(scheduler, builder, now++);
    for (let k = 0; k < finished; k++) add(now);
  }
  const timings: Timings = { schedule: [], update: [], build: [] };
  for (let i = 0; i < NUM_STEPS; i++) {
    const finished = runStep(scheduler, builder, now++, timings);
    for (let k = 0; k < finished; k++) add(now);
  }
  const cpu = cpuMicrosPerStep(NUM_STEPS, () => {
    const finished = runStep(scheduler, null, now++);
    for (let k = 0; k < finished; k++) add(now);
  });
  const kv = scheduler.kv.stats();
  report(`churn: ${NUM_RUNNING} requests in flight, 32 tokens each, shared 256-token prefix, ${NUM_STEPS} + ${NUM_STEPS} steps`, timings, cpu);
  console.log(`  prefix hit rate ${(100 * kv.prefixHitTokens / kv.prefixQueryTokens).toFixed(1)} %, ${scheduler.stats().numSteps} steps in all`
    + ' (the churn CPU time includes creating and adding the new requests)');
}

console.log(`scheduler overhead per step (node ${process.version}, block size ${BLOCK_SIZE})`);

decodeScenario();
churnScenario();
