// `conduit plan`: the fewest workers (each --tp GPUs) that meet p99 TTFT and ITL targets at a Poisson request
// rate, found by simulating the cluster (src/sim/planner.ts). Prints every worker count it simulated and the
// answer; exits 1 when no count up to --max-workers meets the targets. Environment twins are CONDUIT_PLAN_<FLAG>.

import { formatPlan, planCapacity, type PlanOptions } from '../sim/planner.ts';
import { checkSimSequenceFits } from '../sim/sim-worker.ts';
import { flagLabel, formatFlagHelp, nameEnvironment, parseFlags, UsageError, type FlagTable, type ParsedFlags } from './flags.ts';
import type { Command } from './main.ts';
import { DEPLOYMENT_FLAGS, fitsContext, resolveDeployment, wholeNumber, withEnvPrefix } from './sim.ts';

export const PLAN_FLAGS = withEnvPrefix('CONDUIT_PLAN_', {
  ...DEPLOYMENT_FLAGS,
  model: { ...DEPLOYMENT_FLAGS.model, default: 'llama-3.1-8b' },
  tp: { ...DEPLOYMENT_FLAGS.tp, default: 1 },
  rate: { type: 'number', help: 'requests per second (Poisson arrivals)' },
  isl: { type: 'number', help: 'input (prompt) tokens per request', default: 1024 },
  osl: { type: 'number', help: 'output tokens per request', default: 256 },
  'ttft-p99': { type: 'number', help: 'p99 time to first token target, ms: the workers\' TTFT (queueing and prefill), without the gateway\'s phases', default: 500 },
  'itl-p99': { type: 'number', help: 'p99 inter-token latency target, ms', default: 50 },
  'prefix-tokens': { type: 'number', help: 'prompt tokens every request shares (a system prompt)', default: 0 },
  requests: { type: 'number', help: 'requests simulated per worker count (at most 50000)', default: 1000 },
  seed: { type: 'number', help: 'arrival and prompt seed', default: 1 },
  warmup: { type: 'number', help: 'fraction of requests (by arrival) left out of the percentiles', default: 0.1 },
  'max-workers': { type: 'number', help: 'largest worker count to try', default: 256 },
  'max-num-seqs': { type: 'number', help: 'sequences per engine step (at most 16384)', default: 256 },
  'max-num-batched-tokens': { type: 'number', help: 'tokens per engine step (chunked prefill; at most 1048576)', default: 8192 },
  help: { type: 'boolean', help: 'show this help', short: 'h' },
} satisfies FlagTable);

/**
 * Bounds past any real deployment's: the planner prices a step per token of its budget and every batch size up to
 * the sequences, so a budget of 10^8 tokens would take minutes and gigabytes to say nothing more.
 */
const MAX_PLAN_STEP_TOKENS = 1 << 20;
const MAX_PLAN_SEQS = 16_384;
/**
 * Each simulated request keeps its token times (about 35 kB at the default lengths): 100,000 of them take 3.5 GB and
 * a few minutes per worker count, and many more run the process out of memory, a native crash with no message.
 */
const MAX_PLAN_REQUESTS = 50_000;

function atMost(flag: string, value: number, max: number): number {
  if (value > max) throw new UsageError(`--${flag} must be at most ${max}, got ${value}`);
  return value;
}

export function planOptionsFromFlags(argv: readonly string[], env: NodeJS.ProcessEnv = process.env): PlanOptions | null {
  const parsed = parseFlags(PLAN_FLAGS, argv, env);
  try {
    return planOptionsOf(parsed);
  } catch (err) {
    // A value nobody typed is reported under the variable that gave it (CONDUIT_PLAN_RATE (--rate) must be ...).
    throw nameEnvironment(PLAN_FLAGS, parsed, err);
  }
}

function planOptionsOf(parsed: ParsedFlags<typeof PLAN_FLAGS>): PlanOptions | null {
  const { values, positionals } = parsed;
  // Each flag a message names besides its first, by its variable too when the environment gave it.
  const label = (name: keyof typeof PLAN_FLAGS & string): string => flagLabel(PLAN_FLAGS, parsed, name);
  if (values.help) return null;
  if (positionals.length > 0) throw new UsageError(`unexpected argument "${positionals[0]}"`);
  const { model, hw, tp, efficiency, flags } = resolveDeployment(values, label);
  if (values.rate === undefined) throw new UsageError('--rate is required (requests per second)');
  if (!(values.rate > 0)) throw new UsageError(`--rate must be > 0, got ${values.rate}`);
  for (const flag of ['ttft-p99', 'itl-p99'] as const) {
    if (!(values[flag]! > 0)) throw new UsageError(`--${flag} must be > 0 ms, got ${values[flag]}`);
  }
  const warmup = values.warmup!;
  if (!(warmup >= 0 && warmup < 1)) throw new UsageError(`--warmup must be in [0, 1), got ${warmup}`);
  const inputTokens = wholeNumber('isl', values.isl, 1);
  const sharedPrefixTokens = wholeNumber('prefix-tokens', values['prefix-tokens'], 0);
  if (sharedPrefixTokens > inputTokens) throw new UsageError(`--prefix-tokens ${sharedPrefixTokens} exceeds ${label('isl')} ${inputTokens}`);
  const outputTokens = wholeNumber('osl', values.osl, 1);
  fitsContext(`--isl with ${label('osl')}`, inputTokens, outputTokens);
  // A request longer than one worker holds, or a worker that cannot exist, refused here (as the planner would) by the
  // options that set them.
  try {
    checkSimSequenceFits({ model, hw, tp }, inputTokens, outputTokens, { ...flags, request: `${label('isl')} with ${label('osl')}` });
  } catch (error) {
    if (error instanceof RangeError) throw new UsageError(error.message);
    throw error;
  }
  return {
    model, hw, tp, efficiency, ratePerSec: values.rate, inputTokens, outputTokens,
    ttftP99Ms: values['ttft-p99']!, itlP99Ms: values['itl-p99']!, sharedPrefixTokens,
    numRequests: atMost('requests', wholeNumber('requests', values.requests, 1), MAX_PLAN_REQUESTS), seed: wholeNumber('seed', values.seed, 0),
    warmupFraction: warmup, maxWorkers: wholeNumber('max-workers', values['max-workers'], 1),
    worker: {
      maxNumSeqs: atMost('max-num-seqs', wholeNumber('max-num-seqs', values['max-num-seqs'], 1), MAX_PLAN_SEQS),
      maxNumBatchedTokens: atMost('max-num-batched-tokens', wholeNumber('max-num-batched-tokens', values['max-num-batched-tokens'], 1), MAX_PLAN_STEP_TOKENS),
    },
  };
}

export const planCommand: Command = {
  summary: 'capacity planner: fewest GPUs meeting p99 TTFT/ITL targets at a request rate, by simulation',
  async run(argv) {
    const options = planOptionsFromFlags(argv);
    if (options === null) {
      console.log(`Usage: conduit plan --rate <req/s> [options]\n\n${formatFlagHelp(PLAN_FLAGS)}`);
      return 0;
    }
    let result;
    try {
      result = planCapacity(options);
    } catch (error) {
      // Profile combinations the model refuses (tp not dividing the heads, weights not fitting) are usage errors.
      if (error instanceof RangeError) throw new UsageError(error.message);
      throw error;
    }
    console.log(formatPlan(options, result));
    return result.answer ? 0 : 1;
  },
};
