// Capacity planner: the fewest workers (each `tp` GPUs) that keep p99 TTFT and p99 ITL under their targets for a
// Poisson stream of fixed-length requests, found by simulation on a SimCluster (seeded arrivals, least-loaded
// routing). Pure and synchronous: no wall clock, the same options give the same answer.
//
// The search is bounded from below by arithmetic, not simulation: a worker count whose steady-state throughput is
// below the demand is unstable (its queues grow without end), and no worker count beats one idle worker's TTFT and
// ITL. Above the bound it simulates, doubling the count until the targets are met and then bisecting between the
// last failure and the first success. It assumes that more workers never hurt, which least-loaded routing gives.

import type { EngineRequest } from '../engine/types.ts';
import type { HardwareProfile } from './hardware.ts';
import type { ModelProfile } from './models.ts';
import { DEFAULT_EFFICIENCY, stepTimeMs, type Efficiency, type StepShape } from './perf-model.ts';
import { SimCluster, leastLoaded, summarizeRequests, type RouteFunction, type RunSummary } from './cluster.ts';
import { checkSimSequenceFits, SIM_DEFAULTS, simKvBlocks, type SimWorkerConfig } from './sim-worker.ts';
import { poissonWorkload } from './workload.ts';
import { counted, gatewayTtftMs, simulateLifecycle } from './latency-model.ts';

/**
 * How the GPUs are split into workers. Only 'aggregated' (every worker prefills and decodes) is simulated today;
 * a prefill/decode split will search over (prefillWorkers, decodeWorkers) pairs with the same evaluation.
 */
export type DeploymentKind = 'aggregated' | 'disaggregated';

export interface PlanOptions {
  model: ModelProfile;
  hw: HardwareProfile;
  tp: number;
  ratePerSec: number;
  inputTokens: number;
  outputTokens: number;
  ttftP99Ms: number;
  itlP99Ms: number;
  /** Requests per simulated run (default 1000). */
  numRequests?: number;
  /** Arrival and prompt seed (default 1). */
  seed?: number;
  /** Leading fraction of requests (by arrival) left out of the percentiles (default 0.1). */
  warmupFraction?: number;
  /** Give up above this many workers (default 256). */
  maxWorkers?: number;
  /** Prompt tokens every request shares (a system prompt; default 0). */
  sharedPrefixTokens?: number;
  efficiency?: Efficiency;
  /** Engine settings of each worker (batch limits, KV pool, block size...). */
  worker?: Omit<SimWorkerConfig, 'model' | 'hw' | 'tp' | 'efficiency'>;
  /** Default leastLoaded. */
  route?: RouteFunction;
  /** Default 'aggregated'. */
  deployment?: DeploymentKind;
}

/** The arithmetic that bounds the search. */
export interface PlanBounds {
  /** Output tokens per second after each request's first (which its prefill step produces). */
  decodeDemandTokensPerSec: number;
  /** Most decode tokens per second one worker can produce: best batch / its step time at context inputTokens. */
  decodeCapacityTokensPerSec: number;
  /** The batch size at which that capacity is reached (seats and KV pool permitting). */
  decodeCapacityBatch: number;
  /** Prompt tokens per second to compute (after shared-prefix hits). */
  prefillDemandTokensPerSec: number;
  /** Most prompt tokens per second one worker can compute (a full token budget per step, no attention). */
  prefillCapacityTokensPerSec: number;
  /** The fewest workers whose combined capacity covers both demands. */
  minWorkers: number;
  /** TTFT of one request on an idle worker: no worker count does better. */
  idleTtftMs: number;
  /** One decode step at batch 1 and context inputTokens: no worker count does better. */
  idleItlMs: number;
}

export interface PlanTrial {
  workers: number;
  gpus: number;
  summary: RunSummary;
  /**
   * Requests the workers refused or ended before their max_tokens (all of them, warm-up included): the summary's
   * percentiles cover only the requests served, so a trial with any of these does not meet the targets.
   */
  unserved: number;
  meetsTargets: boolean;
}

export interface PlanResult {
  bounds: PlanBounds;
  /** Simulated worker counts in ascending order. */
  trials: PlanTrial[];
  /** Null when no count up to maxWorkers meets the targets (see reason). */
  answer: { workers: number; gpus: number } | null;
  reason: string;
}

/**
 * KV blocks the simulated workers of one trial may hold between them. Each block of a simulated pool is an object of
 * about 100 bytes, so past this a trial runs the process out of memory, which stops it with a native crash and no
 * message: 256 workers of Qwen2.5 7B on B200 (173,000 blocks each) would take over 4 GB. About 2 GB.
 */
export const MAX_SIMULATED_KV_BLOCKS = 20_000_000;

function checkPositive(name: string, value: number, integer: boolean): void {
  if (!(value > 0) || !Number.isFinite(value) || (integer && !Number.isSafeInteger(value))) {
    throw new RangeError(`${name} must be ${integer ? 'a positive integer' : 'a positive number'}, got ${value}`);
  }
}

function workerConfig(opts: PlanOptions): SimWorkerConfig {
  return { ...opts.worker, model: opts.model, hw: opts.hw, tp: opts.tp, efficiency: opts.efficiency ?? DEFAULT_EFFICIENCY };
}

/** Prompt tokens a request computes once the shared prefix is cached: whole blocks only, the last token always. */
function computedPromptTokens(opts: PlanOptions, blockSize: number): number {
  const shared = opts.sharedPrefixTokens ?? 0;
  const cached = Math.min(Math.floor(shared / blockSize), Math.floor((opts.inputTokens - 1) / blockSize)) * blockSize;
  return opts.inputTokens - cached;
}

/**
 * Throughput and latency floors. Each rests on the step time being non-decreasing in every token count and context
 * length: a decode step with prefill mixed in, or at a longer context, is never faster than a pure decode step at
 * context inputTokens; and n prompt tokens computed in one step cost at least n one-token chunks with no context and
 * no logits (the least attention and LM-head work any arrangement of them can have).
 */
export function planBounds(opts: PlanOptions): PlanBounds {
  const config = workerConfig(opts);
  const { model, hw, tp } = opts;
  const efficiency = config.efficiency!;
  const blockSize = config.blockSize ?? SIM_DEFAULTS.blockSize;
  const maxNumSeqs = config.maxNumSeqs ?? SIM_DEFAULTS.maxNumSeqs;
  const budget = config.maxNumBatchedTokens ?? SIM_DEFAULTS.maxNumBatchedTokens;
  const time = (shape: StepShape) => stepTimeMs(shape, model, hw, tp, efficiency);

  // Decode: a running sequence holds at least inputTokens + 1 tokens of KV, but the blocks of the shared prefix that
  // the cache serves are held once for the whole batch (refcounted), not once per sequence. Counting them per
  // sequence would shrink the batch, and with it the capacity, below what the engine reaches: the bound would no
  // longer be a lower bound on the workers.
  const computed = computedPromptTokens(opts, blockSize);
  const sharedBlocks = (opts.inputTokens - computed) / blockSize;
  const ownBlocksPerSeq = Math.ceil((opts.inputTokens + 1) / blockSize) - sharedBlocks;
  const maxBatch = Math.max(1, Math.min(maxNumSeqs, Math.floor((simKvBlocks(config) - sharedBlocks) / ownBlocksPerSeq)));
  let decodeCapacity = 0;
  let decodeBatch = 1;
  for (let batch = 1; batch <= maxBatch; batch++) {
    const perSec = (batch / time({ prefillTokens: [], decodeSeqs: Array.from({ length: batch }, () => ({ contextLen: opts.inputTokens })) })) * 1000;
    if (perSec > decodeCapacity) {
      decodeCapacity = perSec;
      decodeBatch = batch;
    }
  }
  const decodeDemand = opts.ratePerSec * (opts.outputTokens - 1);

  // Prefill: tokens per step over step time grows with the tokens (the fixed costs spread), so a full budget is best.
  const singletons = Array.from({ length: budget }, () => ({ newTokens: 1, contextLen: 0, sampled: false }));
  const prefillCapacity = (budget / time({ prefillTokens: singletons, decodeSeqs: [] })) * 1000;
  const prefillDemand = opts.ratePerSec * computed;

  // An idle worker: the prompt in budget-sized chunks, the last one sampled; then one decode step.
  const cached = opts.inputTokens - computed;
  let idleTtftMs = 0;
  for (let done = 0; done < computed; done += budget) {
    const newTokens = Math.min(budget, computed - done);
    idleTtftMs += time({ prefillTokens: [{ newTokens, contextLen: cached + done, sampled: done + newTokens === computed }], decodeSeqs: [] });
  }
  const idleItlMs = time({ prefillTokens: [], decodeSeqs: [{ contextLen: opts.inputTokens }] });

  const minWorkers = Math.max(1, Math.ceil(decodeDemand / decodeCapacity - 1e-12), Math.ceil(prefillDemand / prefillCapacity - 1e-12));
  return {
    decodeDemandTokensPerSec: decodeDemand, decodeCapacityTokensPerSec: decodeCapacity, decodeCapacityBatch: decodeBatch,
    prefillDemandTokensPerSec: prefillDemand, prefillCapacityTokensPerSec: prefillCapacity, minWorkers, idleTtftMs, idleItlMs,
  };
}

/** Runs the workload on `workers` workers and checks the targets. */
export function evaluateWorkers(opts: PlanOptions, workers: number, arrivals?: readonly EngineRequest[]): PlanTrial {
  const requests = arrivals ?? planWorkload(opts);
  const config = workerConfig(opts);
  const cluster = new SimCluster({ workers: Array.from({ length: workers }, () => config), route: opts.route ?? leastLoaded });
  const results = cluster.run(requests).requests;
  const summary = summarizeRequests(results, opts.warmupFraction ?? 0.1);
  // A request the workers refused (e.g. prompt_exceeds_kv_pool) or stopped at their context limit before its
  // max_tokens leaves the latency percentiles untouched, or even improves them: it must fail the trial instead.
  const maxTokens = new Map(requests.map((r) => [r.id, r.sampling.maxTokens]));
  const unserved = results.filter((r) => !(r.finishReason === 'stop'
    || (r.finishReason === 'length' && r.completionTokens >= (maxTokens.get(r.id) ?? 0)))).length;
  const meetsTargets = unserved === 0 && summary.numRequests > 0 && summary.ttftMs.p99 <= opts.ttftP99Ms
    && (summary.itlMs.count === 0 || summary.itlMs.p99 <= opts.itlP99Ms);
  return { workers, gpus: workers * opts.tp, summary, unserved, meetsTargets };
}

export function planWorkload(opts: PlanOptions): EngineRequest[] {
  return poissonWorkload({
    ratePerSec: opts.ratePerSec, numRequests: opts.numRequests ?? 1000, inputTokens: opts.inputTokens,
    outputTokens: opts.outputTokens, vocabSize: opts.model.vocabSize, seed: opts.seed ?? 1,
    sharedPrefixTokens: opts.sharedPrefixTokens,
  });
}

export function planCapacity(opts: PlanOptions): PlanResult {
  checkPositive('ratePerSec', opts.ratePerSec, false);
  checkPositive('inputTokens', opts.inputTokens, true);
  checkPositive('outputTokens', opts.outputTokens, true);
  checkPositive('ttftP99Ms', opts.ttftP99Ms, false);
  checkPositive('itlP99Ms', opts.itlP99Ms, false);
  const maxWorkers = opts.maxWorkers ?? 256;
  checkPositive('maxWorkers', maxWorkers, true);
  if ((opts.deployment ?? 'aggregated') !== 'aggregated') {
    throw new RangeError('only aggregated deployments are planned so far (every worker prefills and decodes)');
  }
  // A request longer than one worker holds is refused or cut short on every worker count: say so rather than
  // simulate up to maxWorkers for nothing.
  checkSimSequenceFits(workerConfig(opts), opts.inputTokens, opts.outputTokens);
  const bounds = planBounds(opts);
  const trials: PlanTrial[] = [];
  const none = (reason: string): PlanResult => ({ bounds, trials, answer: null, reason });
  if (bounds.idleTtftMs > opts.ttftP99Ms) {
    return none(`no worker count can: an idle worker's TTFT is ${bounds.idleTtftMs.toFixed(2)} ms, above the ${opts.ttftP99Ms} ms target`);
  }
  if (bounds.idleItlMs > opts.itlP99Ms) {
    return none(`no worker count can: one decode step at batch 1 takes ${bounds.idleItlMs.toFixed(2)} ms, above the ${opts.itlP99Ms} ms ITL target`);
  }
  if (bounds.minWorkers > maxWorkers) {
    return none(`throughput alone needs ${bounds.minWorkers} workers, more than --max-workers ${maxWorkers}`);
  }
  // The most workers a trial can simulate in memory: the search stops there, with a reason, rather than crash.
  const blocksPerWorker = simKvBlocks(workerConfig(opts));
  const simulable = Math.max(1, Math.floor(MAX_SIMULATED_KV_BLOCKS / blocksPerWorker));
  const memoryLimit = `more than ${simulable} workers of ${blocksPerWorker} KV blocks each cannot be simulated in memory`;
  if (bounds.minWorkers > simulable) return none(`throughput alone needs ${bounds.minWorkers} workers; ${memoryLimit}`);
  const searchLimit = Math.min(maxWorkers, simulable);

  const arrivals = planWorkload(opts);
  const tried = new Map<number, PlanTrial>();
  const evaluate = (workers: number): PlanTrial => {
    let trial = tried.get(workers);
    if (!trial) {
      trial = evaluateWorkers(opts, workers, arrivals);
      tried.set(workers, trial);
    }
    return trial;
  };
  // Grow until the targets are met, then bisect (failing, passing].
  let failing = bounds.minWorkers - 1;
  let passing = -1;
  for (let workers = bounds.minWorkers; ; workers = Math.min(searchLimit, workers * 2)) {
    if (evaluate(workers).meetsTargets) {
      passing = workers;
      break;
    }
    failing = workers;
    if (workers === searchLimit) break;
  }
  while (passing > 0 && passing - failing > 1) {
    const middle = (failing + passing) >> 1;
    if (evaluate(middle).meetsTargets) passing = middle;
    else failing = middle;
  }
  trials.push(...[...tried.values()].sort((a, b) => a.workers - b.workers));
  if (passing < 0) {
    return none(`no worker count up to ${searchLimit} meets the targets${searchLimit < maxWorkers ? `; ${memoryLimit}` : ''}`);
  }
  const reason = passing === bounds.minWorkers && bounds.minWorkers > 1
    ? `fewer than ${bounds.minWorkers} workers cannot keep up with the throughput demand`
    : passing === 1 ? 'one worker meets the targets'
      : `${passing - 1} worker${passing - 1 === 1 ? '' : 's'} miss${passing - 1 === 1 ? 'es' : ''} the targets in simulation`;
  return { bounds, trials, answer: { workers: passing, gpus: passing * opts.tp }, reason };
}

// ---------------------------------------------------------------------------------------------------------------
// Text

function table(header: readonly string[], rows: readonly (readonly string[])[]): string {
  const widths = header.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? '').length)));
  const line = (cells: readonly string[]) => cells.map((c, i) => c.padStart(widths[i]!)).join('  ').trimEnd();
  return [line(header), line(widths.map((w) => '-'.repeat(w))), ...rows.map(line)].join('\n');
}

/**
 * Which TTFT the targets are checked against: the workers' (from a request reaching a worker to its first token,
 * queue and prefill), which `conduit sim lifecycle` adds the gateway's phases to; and how much those add here.
 */
function planTtftNote(opts: PlanOptions): string {
  const config = workerConfig(opts);
  const gatewayMs = gatewayTtftMs(simulateLifecycle({
    model: opts.model, hw: opts.hw, tp: opts.tp, promptTokens: opts.inputTokens, efficiency: config.efficiency,
    blockSize: config.blockSize ?? SIM_DEFAULTS.blockSize,
    maxNumBatchedTokens: config.maxNumBatchedTokens ?? SIM_DEFAULTS.maxNumBatchedTokens,
  }).cold);
  return 'TTFT below: from a request reaching a worker to its first token (queueing and prefill), the one the p99 TTFT '
    + `target is checked against; the gateway's phases, which conduit sim lifecycle's TTFT includes, add `
    + `${gatewayMs.toFixed(2)} ms at ${counted(opts.inputTokens, 'prompt token')}, not included`;
}

export function formatPlan(opts: PlanOptions, result: PlanResult): string {
  const b = result.bounds;
  const lines = [
    `${opts.model.name} on ${opts.hw.name}, tp ${opts.tp} per worker; ${opts.ratePerSec} req/s Poisson, `
      + `${opts.inputTokens} in / ${opts.outputTokens} out tokens; targets p99 TTFT <= ${opts.ttftP99Ms} ms, `
      + `p99 ITL <= ${opts.itlP99Ms} ms`,
    `simulated ${opts.numRequests ?? 1000} requests per worker count (seed ${opts.seed ?? 1}, first `
      + `${((opts.warmupFraction ?? 0.1) * 100).toFixed(0)}% left out), least-loaded routing`,
    `per worker: decode capacity ${b.decodeCapacityTokensPerSec.toFixed(0)} tok/s (batch ${b.decodeCapacityBatch}) vs demand `
      + `${b.decodeDemandTokensPerSec.toFixed(0)} tok/s; prefill capacity ${b.prefillCapacityTokensPerSec.toFixed(0)} tok/s vs demand `
      + `${b.prefillDemandTokensPerSec.toFixed(0)} tok/s => at least ${b.minWorkers} worker(s)`,
    `idle worker: TTFT ${b.idleTtftMs.toFixed(2)} ms, ITL ${b.idleItlMs.toFixed(2)} ms`,
    planTtftNote(opts),
    '',
  ];
  const f = (v: number) => (Number.isFinite(v) ? v.toFixed(2) : '-');
  const rows = result.trials.map((t) => [
    String(t.workers), String(t.gpus), f(t.summary.ttftMs.p50), f(t.summary.ttftMs.p99), f(t.summary.itlMs.p50),
    f(t.summary.itlMs.p99), Number.isFinite(t.summary.outputTokensPerSec) ? t.summary.outputTokensPerSec.toFixed(0) : '-',
    t.meetsTargets ? 'yes' : t.unserved > 0 ? `no (${t.unserved} refused or cut short)` : 'no',
  ]);
  if (rows.length > 0) {
    lines.push(table(['workers', 'GPUs', 'TTFT p50 ms', 'TTFT p99 ms', 'ITL p50 ms', 'ITL p99 ms', 'out tok/s', 'meets'], rows));
    if (result.trials.some((t) => !Number.isFinite(t.summary.outputTokensPerSec))) {
      lines.push('(out tok/s counts from the first measured request\'s finish to the last arrival; - where that window is shorter '
        + 'than the median request\'s latency: no steady state within the run, too few --requests or queues still growing)');
    }
    lines.push('');
  }
  lines.push(result.answer
    ? `answer: ${result.answer.workers} worker(s) x tp ${opts.tp} = ${result.answer.gpus} GPU(s) (${result.reason})`
    : `answer: none (${result.reason})`);
  return `${lines.join('\n')}\n`;
}
