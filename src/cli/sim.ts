// `conduit sim`: the GPU performance model as tables. `lifecycle` prints a request's cold and warm TTFT phase by
// phase, `decode-sweep` decode latency and throughput against batch size. Each table is then cross-checked by
// running the simulated engine (real scheduler and KV cache) on the same shapes; a disagreement exits with 1.
// Environment twins are CONDUIT_SIM_<FLAG>, so they never collide with `serve`'s CONDUIT_MODEL (a file path).

import { getHardwareProfile, getLinkProfile, HARDWARE_PROFILES, LINK_PROFILES } from '../sim/hardware.ts';
import type { HardwareProfile } from '../sim/hardware.ts';
import {
  counted, DEFAULT_BATCH_SIZES, decodeSweep, formatDecodeSweep, formatDisaggregatedPath, formatLifecycleTable, simulateDisaggregatedPath,
  simulateLifecycle,
} from '../sim/latency-model.ts';
import { checkDisaggregatedPathWithEngine } from '../sim/disagg-cold-path.ts';
import { getModelProfile, KV_DTYPE_NAMES, MODEL_PROFILES } from '../sim/models.ts';
import { CALIBRATIONS, calibrationEfficiency, DEFAULT_CALIBRATION, parseCalibration } from '../sim/calibration.ts';
import type { CalibrationName } from '../sim/calibration.ts';
import { checkTensorParallel, type Efficiency } from '../sim/perf-model.ts';
import { formatPrefillLayerTable, prefillLayerTable, SEED_001_PREFILL_LAYER_US } from '../sim/layer-table.ts';
import type { ModelProfile } from '../sim/models.ts';
import { checkDecodeSweepWithEngine, checkLifecycleWithEngine } from '../sim/engine-check.ts';
import { flagLabel, formatFlagHelp, nameEnvironment, parseFlags, UsageError, type FlagTable, type ParsedFlags } from './flags.ts';
import { formatKvTierTtft, simulateKvTierTtft } from '../sim/kv-tier-ttft.ts';
import { KV_TIER_PROFILES } from '../sim/hardware.ts';
import { checkSimSequenceFits, SIM_DEFAULTS, simKvBlocks, type SimDeploymentFlags, type SimRequestFlags } from '../sim/sim-worker.ts';
import type { Command } from './main.ts';

/** Gives every flag of a table the environment twin `${prefix}<FLAG>`. */
export function withEnvPrefix<T extends FlagTable>(prefix: string, table: T): T {
  const out: FlagTable = {};
  for (const [name, spec] of Object.entries(table)) out[name] = { ...spec, env: `${prefix}${name.replace(/-/g, '_').toUpperCase()}` };
  return out as T;
}

/** Flags naming the deployment, shared by `sim` and `plan`. */
export const DEPLOYMENT_FLAGS = {
  model: { type: 'string', help: 'model profile id (see `conduit sim --help`)', short: 'm' },
  gpu: { type: 'string', help: 'GPU profile id', default: 'h100' },
  tp: { type: 'number', help: 'tensor-parallel GPUs per worker' },
  'weight-bytes': { type: 'number', help: 'bytes per weight, the weights\' dtype: 2 = BF16, 1 = FP8, 0.5 = INT4 (weight-only, computed in BF16)', default: 2 },
  'kv-bytes': { type: 'number', help: 'bytes per KV cache element, the cache\'s dtype: 2 = BF16, 1 = FP8', default: 2 },
  calibration: {
    type: 'string', default: DEFAULT_CALIBRATION,
    help: `efficiency factors: ${CALIBRATIONS.join(' | ')} (roofline = datasheet-fraction estimates; measured = fitted ` +
      'to kernel times on a real H100/H200, see docs/simulator.md)',
  },
  'matmul-mfu': { type: 'number', help: 'override the calibration: fraction of peak FLOP/s the weight GEMMs reach' },
  'attention-mfu': { type: 'number', help: 'override the calibration: fraction of peak BF16 FLOP/s attention reaches' },
  'hbm-utilization': { type: 'number', help: 'override the calibration: fraction of HBM bandwidth memory-bound kernels reach' },
  'comm-efficiency': { type: 'number', help: 'override the calibration: fraction of link bandwidth collectives reach' },
  'step-overhead-ms': { type: 'number', help: 'override the calibration: CPU time per step the GPU waits on, ms' },
} satisfies FlagTable;

/**
 * The dtype widths --weight-bytes and --kv-bytes may name: the sizes the performance model prices (FP8 weights at the
 * GPU's FP8 peak where it has one, others at its BF16 peak). A width no dtype has (3, 100) is refused, not priced.
 */
const DTYPE_WIDTHS = {
  'weight-bytes': { 2: 'BF16', 1: 'FP8', 0.5: 'INT4' },
  'kv-bytes': KV_DTYPE_NAMES,
} as const satisfies Record<string, Readonly<Record<number, string>>>;

/** Efficiency flags and the factor each overrides. */
const EFFICIENCY_FLAGS = {
  'matmul-mfu': 'matmulMfu', 'attention-mfu': 'attentionMfu', 'hbm-utilization': 'bandwidthUtilization',
  'comm-efficiency': 'commEfficiency', 'step-overhead-ms': 'stepOverheadMs',
} as const;

export const LIFECYCLE_FLAGS = withEnvPrefix('CONDUIT_SIM_', {
  ...DEPLOYMENT_FLAGS,
  model: { ...DEPLOYMENT_FLAGS.model, default: 'llama-3.1-70b' },
  tp: { ...DEPLOYMENT_FLAGS.tp, default: 4 },
  prompt: { type: 'number', help: 'prompt tokens', default: 1024 },
  cached: { type: 'number', help: 'prompt tokens the warm request finds cached (default: all whole blocks before the last token)' },
  link: { type: 'string', help: 'disaggregate prefill and decode, KV crossing this link (e.g. ib-ndr); default aggregated' },
  'parallel-links': { type: 'number', help: 'links used side by side for the KV transfer (default: tp; at most the GPUs of a node, a link each)' },
  'block-size': { type: 'number', help: 'KV block size in tokens', default: 16 },
  'max-num-batched-tokens': { type: 'number', help: 'step token budget (chunked prefill)', default: 8192 },
  check: { type: 'boolean', help: 'cross-check against the simulated engine (--no-check to skip)', default: true },
  help: { type: 'boolean', help: 'show this help', short: 'h' },
} satisfies FlagTable);

export const DECODE_SWEEP_FLAGS = withEnvPrefix('CONDUIT_SIM_', {
  ...DEPLOYMENT_FLAGS,
  model: { ...DEPLOYMENT_FLAGS.model, default: 'llama-3.1-70b' },
  tp: { ...DEPLOYMENT_FLAGS.tp, default: 4 },
  context: { type: 'number', help: 'tokens in each sequence\'s KV cache', default: 1024 },
  batches: { type: 'string', help: 'comma-separated batch sizes', default: DEFAULT_BATCH_SIZES.join(',') },
  'lora-adapters': { type: 'number', help: 'distinct LoRA adapters the batch\'s sequences use (sequence i on adapter i mod N; 0 = the base model only); each adds its weights\' read and its tokens\' low-rank FLOPs to the step (S-LoRA / Punica batching)', default: 0 },
  'lora-rank': { type: 'number', help: 'rank of those adapters (on q, k, v, o, gate, up, down; at most the model\'s hidden size)', default: 16 },
  'block-size': { type: 'number', help: 'KV block size in tokens (the KV fits column and the engine check)', default: 16 },
  check: { type: 'boolean', help: 'cross-check against the simulated engine (--no-check to skip)', default: true },
  help: { type: 'boolean', help: 'show this help', short: 'h' },
} satisfies FlagTable);

// ---------------------------------------------------------------------------------------------------------------
// Shared helpers

/**
 * A profile lookup or check whose refusal (`unknown GPU "x"; known: ...`, heads that do not divide over tp) starts with
 * the flag that gave the value, so that a value from the environment is named by its variable (nameEnvironment).
 */
function byFlag<R>(flag: string, lookup: () => R): R {
  try {
    return lookup();
  } catch (error) {
    if (error instanceof RangeError) throw new RangeError(`--${flag}: ${error.message}`);
    throw error;
  }
}

/**
 * Profile lookups turn their RangeError (which lists the known ids) into a usage error, as does a tp the model does
 * not split over. `label` names --model, --gpu and --tp in later refusals (flagLabel: by its variable too when the
 * environment gave the value); they come back as `flags`.
 */
export function resolveDeployment(values: {
  model?: string; gpu?: string; tp?: number; 'weight-bytes'?: number; 'kv-bytes'?: number; calibration?: string;
  'matmul-mfu'?: number; 'attention-mfu'?: number; 'hbm-utilization'?: number; 'comm-efficiency'?: number;
  'step-overhead-ms'?: number;
}, label: (name: keyof SimDeploymentFlags) => string = (name) => `--${name}`): {
  model: ModelProfile; hw: HardwareProfile; tp: number; calibration: CalibrationName; efficiency: Efficiency; flags: SimDeploymentFlags;
} {
  try {
    for (const flag of ['weight-bytes', 'kv-bytes'] as const) {
      const value = values[flag];
      const widths: Record<string, string> = DTYPE_WIDTHS[flag];
      if (value !== undefined && !Object.hasOwn(widths, String(value))) {
        const known = Object.entries(widths).sort(([a], [b]) => Number(b) - Number(a)).map(([width, name]) => `${width} (${name})`);
        throw new RangeError(`--${flag} must be ${known.slice(0, -1).join(', ')} or ${known.at(-1)}, got ${value}`);
      }
    }
    const model = byFlag('model', () => getModelProfile(values.model!, { weightBytesPerParam: values['weight-bytes'], kvBytesPerElement: values['kv-bytes'] }));
    const hw = byFlag('gpu', () => getHardwareProfile(values.gpu!));
    const tp = values.tp!;
    if (!Number.isInteger(tp) || tp < 1) throw new RangeError(`--tp must be a whole number >= 1, got ${tp}`);
    byFlag('tp', () => checkTensorParallel(model, hw, tp));
    const calibration = byFlag('calibration', () => parseCalibration(values.calibration ?? DEFAULT_CALIBRATION));
    let efficiency = calibrationEfficiency(calibration, hw);
    for (const [flag, key] of Object.entries(EFFICIENCY_FLAGS) as [keyof typeof EFFICIENCY_FLAGS, keyof Efficiency][]) {
      const value = values[flag];
      if (value === undefined) continue;
      const ok = key === 'stepOverheadMs' ? value >= 0 && Number.isFinite(value) : value > 0 && value <= 1;
      if (!ok) throw new RangeError(`--${flag} must be ${key === 'stepOverheadMs' ? 'a number >= 0' : 'in (0, 1]'}, got ${value}`);
      efficiency = { ...efficiency, [key]: value };
    }
    return { model, hw, tp, calibration, efficiency, flags: { model: label('model'), gpu: label('gpu'), tp: label('tp') } };
  } catch (error) {
    if (error instanceof RangeError) throw new UsageError(error.message);
    throw error;
  }
}

/** A request of `tokens` prompt tokens plus `outputTokens` must fit the simulated workers' context. */
export function fitsContext(what: string, tokens: number, outputTokens = 1): void {
  const context = SIM_DEFAULTS.maxModelLen;
  if (tokens + outputTokens > context) {
    throw new UsageError(`${what} (${counted(tokens, 'token')}, plus ${outputTokens} of output) does not fit the simulated context of ${counted(context, 'token')}`);
  }
}

/**
 * A worker of this deployment must exist (its weights fit, tp divides the heads) and hold a prompt of `tokens` and
 * its first output token in its KV pool. Profile combinations the model refuses are usage errors, naming the options
 * (`flags`) that set them.
 */
function fitsWorker(config: Parameters<typeof checkSimSequenceFits>[0], tokens: number, flags: SimRequestFlags): void {
  try {
    checkSimSequenceFits(config, tokens, 1, flags);
  } catch (error) {
    if (error instanceof RangeError) throw new UsageError(error.message);
    throw error;
  }
}

/**
 * A worker of this deployment must exist: its weight shard must leave HBM for at least one KV block (decode-sweep's
 * table says itself which batches its pool holds).
 */
function workerExists(config: Parameters<typeof simKvBlocks>[0], flags: SimDeploymentFlags): void {
  try {
    simKvBlocks(config, flags);
  } catch (error) {
    if (error instanceof RangeError) throw new UsageError(error.message);
    throw error;
  }
}

export function wholeNumber(flag: string, value: number | undefined, min: number): number {
  if (value === undefined || !Number.isSafeInteger(value) || value < min) {
    throw new UsageError(`--${flag} must be a whole number >= ${min}, got ${value}`);
  }
  return value;
}

/** The subcommands take options only. */
function refuseArguments(positionals: readonly string[]): void {
  if (positionals.length > 0) throw new UsageError(`unexpected argument "${positionals[0]}"`);
}

/**
 * Runs a subcommand on its parsed flags. A usage error about a value nobody typed is reported under the variable that
 * gave it (CONDUIT_SIM_PROMPT (--prompt) must be ...), as `conduit serve` reports it.
 */
export async function namingEnvironment<T extends FlagTable>(table: T, parsed: ParsedFlags<T>,
  body: (parsed: ParsedFlags<T>) => Promise<number>): Promise<number> {
  try {
    return await body(parsed);
  } catch (err) {
    throw nameEnvironment(table, parsed, err);
  }
}

/** Same up to rounding: the engine sums the same step times the tables do. */
function agrees(a: number, b: number): boolean {
  return Math.abs(a - b) <= 1e-9 * Math.max(1, Math.abs(b));
}

export function simHelp(): string {
  const models = Object.values(MODEL_PROFILES).map((m) => `  ${m.id.padEnd(16)} ${m.name}`);
  const gpus = Object.values(HARDWARE_PROFILES).map((h) => `  ${h.id.padEnd(16)} ${h.name}, ${(h.hbmBytes / 2 ** 30).toFixed(0)} GiB, ${h.tpLink.name}`);
  const links = Object.values(LINK_PROFILES).map((l) => `  ${l.id.padEnd(16)} ${l.name}, ${(l.bytesPerSecPerDirection / 1e9).toFixed(1)} GB/s per direction`);
  return [
    'Usage: conduit sim <lifecycle | decode-sweep | kv-tiers> [options]',
    '',
    '  lifecycle      cold vs warm time to first token, phase by phase',
    '  decode-sweep   inter-token latency and throughput against batch size',
    '  kv-tiers       time to first token with the prefix from HBM, host RAM (PCIe), NVMe, or computed',
    '',
    'Models:', ...models, '', 'GPUs:', ...gpus, '', 'Links (--link):', ...links, '',
    'conduit sim lifecycle options:', formatFlagHelp(LIFECYCLE_FLAGS), '',
    'conduit sim decode-sweep options:', formatFlagHelp(DECODE_SWEEP_FLAGS), '',
    'conduit sim kv-tiers options:', formatFlagHelp(KV_TIERS_FLAGS),
  ].join('\n');
}

// ---------------------------------------------------------------------------------------------------------------
// Subcommands

async function lifecycle(argv: string[]): Promise<number> {
  // --parallel-links shapes the KV transfer of a disaggregated deployment: typed without --link it is refused (as a
  // value --link would refuse), from the environment alone it is ignored with a warning.
  const parsed = parseFlags(LIFECYCLE_FLAGS, argv, process.env, {
    inapplicable: (v) => (v.link === undefined ? { names: ['parallel-links'], why: 'only for a disaggregated deployment (give --link too)' } : undefined),
  });
  return namingEnvironment(LIFECYCLE_FLAGS, parsed, runLifecycle);
}

async function runLifecycle(parsed: ParsedFlags<typeof LIFECYCLE_FLAGS>): Promise<number> {
  const { values, positionals, warnings } = parsed;
  // Each flag a message names besides its first, by its variable too when the environment gave it.
  const label = (name: keyof typeof LIFECYCLE_FLAGS & string): string => flagLabel(LIFECYCLE_FLAGS, parsed, name);
  if (values.help) {
    console.log(`Usage: conduit sim lifecycle [options]\n\n${formatFlagHelp(LIFECYCLE_FLAGS)}`);
    return 0;
  }
  refuseArguments(positionals);
  for (const warning of warnings) console.error(`conduit sim: ${warning}`);
  const { model, hw, tp, calibration, efficiency, flags } = resolveDeployment(values, label);
  const promptTokens = wholeNumber('prompt', values.prompt, 1);
  fitsContext('--prompt', promptTokens);
  const blockSize = wholeNumber('block-size', values['block-size'], 1);
  const maxNumBatchedTokens = wholeNumber('max-num-batched-tokens', values['max-num-batched-tokens'], 1);
  // The tables describe a worker that must exist (its weights fit the GPUs) and hold the prompt and its first token
  // in its KV pool; otherwise the engine check dies after the tables, and with --no-check they describe nothing.
  fitsWorker({ model, hw, tp, blockSize }, promptTokens, { ...flags, request: label('prompt') });
  const cachedTokens = values.cached === undefined ? undefined : wholeNumber('cached', values.cached, 0);
  // The engine computes a prompt's last token whatever the cache holds (its logits give the first output token).
  if (cachedTokens !== undefined && cachedTokens > promptTokens - 1) {
    throw new UsageError(`--cached must be at most ${promptTokens - 1} with ${label('prompt')} ${promptTokens} (the last prompt token is always `
      + `computed), got ${cachedTokens}`);
  }
  let disaggregated: { link: ReturnType<typeof getLinkProfile>; parallelLinks?: number } | undefined;
  if (values.link !== undefined) {
    try {
      disaggregated = { link: byFlag('link', () => getLinkProfile(values.link!)) };
    } catch (error) {
      throw new UsageError((error as Error).message);
    }
    if (values['parallel-links'] !== undefined) {
      const parallelLinks = wholeNumber('parallel-links', values['parallel-links'], 1);
      // A link per GPU of the node is what one has (a DGX H100 has a 400 Gb/s port per GPU): more side by side were
      // taken without a bound, and 10^12 of them priced the transfer at nothing.
      if (parallelLinks > hw.gpusPerNode) {
        throw new UsageError(`--parallel-links must be at most ${hw.gpusPerNode} (a link per GPU of the node, which holds ${hw.gpusPerNode} ${hw.name}), got ${parallelLinks}`);
      }
      disaggregated.parallelLinks = parallelLinks;
    }
  }
  let report;
  try {
    report = simulateLifecycle({
      model, hw, tp, promptTokens, cachedTokens, blockSize, maxNumBatchedTokens, disaggregated, efficiency,
    });
  } catch (error) {
    if (error instanceof RangeError) throw new UsageError(error.message);
    throw error;
  }
  console.log(`calibration: ${calibration}`);
  console.log(formatLifecycleTable(report));
  // With a link: the cold path of Conduit's disaggregated serving (first token on the prefill worker, then the
  // transfer and the decode worker's first step) next to the aggregated one.
  const path = disaggregated
    ? simulateDisaggregatedPath({ model, hw, tp, promptTokens, blockSize, maxNumBatchedTokens, efficiency, ...disaggregated })
    : undefined;
  if (path) console.log(formatDisaggregatedPath(path));
  // One layer of the cold prefill kernel by kernel, next to seed 001's when the deployment is the one it measured:
  // Llama 3.1 70B on 4 x H100, a 1024-token prompt, BF16 weights and KV.
  const seed = model.id === 'llama-3.1-70b' && hw.id === 'h100' && tp === 4 && promptTokens === 1024
    && model.weightBytesPerParam === 2 && model.kvBytesPerElement === 2 ? SEED_001_PREFILL_LAYER_US : undefined;
  const layerTable = prefillLayerTable(model, hw, tp, promptTokens, efficiency);
  console.log(`one layer of the ${promptTokens}-token prefill, per GPU${seed ? ', next to seed 001' : ''}`
    + `${layerTable.denseApproximation ? ', as a dense layer (an approximation: see the note under it)' : ''}:`);
  console.log(`${formatPrefillLayerTable(layerTable, seed)}\n`);
  if (!values.check) return 0;

  const check = await checkLifecycleWithEngine({
    model, hw, tp, promptTokens, cachedTokens: report.warm.cachedTokens, blockSize, maxNumBatchedTokens, efficiency,
  });
  const line = (name: string, c: typeof check.cold) => `  ${name}: ${counted(c.cachedTokens, 'cached token')}, engine TTFT `
    + `${c.engineMs.toFixed(2)} ms, model prefill_execution ${c.modelMs.toFixed(2)} ms  ${agrees(c.engineMs, c.modelMs) ? 'ok' : 'MISMATCH'}`;
  const lines = ['simulated engine on one idle aggregated worker (same scheduler and KV cache as the real engine):',
    line('cold', check.cold), line('warm', check.warm)];
  if (check.warm.cachedTokens !== report.warm.cachedTokens) {
    lines.push(`  note: the KV cache keeps whole blocks of ${blockSize}, so the engine hit ${check.warm.cachedTokens} of the `
      + `${counted(report.warm.cachedTokens, 'cached token')} asked for; the warm check uses the engine's hit`);
  }
  let pathOk = true;
  if (disaggregated) {
    const pathCheck = checkDisaggregatedPathWithEngine({
      model, hw, tp, promptTokens, blockSize, maxNumBatchedTokens, efficiency, ...disaggregated,
    });
    pathOk = agrees(pathCheck.engineTtftMs, pathCheck.modelPrefillMs)
      && agrees(pathCheck.engineSecondTokenGapMs, pathCheck.modelSecondTokenGapMs)
      && pathCheck.engineTransferBlocks === pathCheck.modelTransferBlocks;
    lines.push('simulated engine, one prefill and one decode worker (handoff, transfer over the link, adoption):',
      `  first token ${pathCheck.engineTtftMs.toFixed(2)} ms (model prefill_execution ${pathCheck.modelPrefillMs.toFixed(2)} ms), `
      + `second token ${pathCheck.engineSecondTokenGapMs.toFixed(2)} ms later (model kv_transfer + decode_execution `
      + `${pathCheck.modelSecondTokenGapMs.toFixed(2)} ms), ${counted(pathCheck.engineTransferBlocks, 'block')} moved  ${pathOk ? 'ok' : 'MISMATCH'}`);
  }
  console.log(lines.join('\n'));
  return agrees(check.cold.engineMs, check.cold.modelMs) && agrees(check.warm.engineMs, check.warm.modelMs) && pathOk ? 0 : 1;
}

/**
 * The largest batch decode-sweep prices: a decode step of B sequences computes B tokens, and conduit plan's step
 * budget stops at 2^20 tokens too. The sweep builds every sequence of a batch, so a billion of them did not finish.
 */
const MAX_SWEEP_BATCH = 1 << 20;

/**
 * --lora-rank, at most the model's hidden size: an adapter of a higher rank is no low-rank one (its two matrices
 * outweigh the one they adapt), and a rank of 10^9 was priced as steps of hours without a word.
 */
function loraRank(value: number | undefined, model: ModelProfile): number {
  const rank = wholeNumber('lora-rank', value, 1);
  if (rank > model.hiddenDim) {
    throw new UsageError(`--lora-rank must be at most ${model.hiddenDim} (the hidden size of ${model.name}), got ${rank}`);
  }
  return rank;
}

async function sweep(argv: string[]): Promise<number> {
  // --lora-rank shapes the adapters --lora-adapters adds: typed without them it is refused, from the environment
  // alone (CONDUIT_SIM_LORA_RANK is serve's --sim-lora-rank too) ignored with a warning, as lifecycle's --parallel-links.
  const parsed = parseFlags(DECODE_SWEEP_FLAGS, argv, process.env, {
    inapplicable: (v) => (v['lora-adapters'] === 0 ? { names: ['lora-rank'], why: 'only with LoRA adapters (give --lora-adapters N > 0 too)' } : undefined),
  });
  return namingEnvironment(DECODE_SWEEP_FLAGS, parsed, runSweep);
}

async function runSweep(parsed: ParsedFlags<typeof DECODE_SWEEP_FLAGS>): Promise<number> {
  const { values, positionals, warnings } = parsed;
  const label = (name: keyof typeof DECODE_SWEEP_FLAGS & string): string => flagLabel(DECODE_SWEEP_FLAGS, parsed, name);
  if (values.help) {
    console.log(`Usage: conduit sim decode-sweep [options]\n\n${formatFlagHelp(DECODE_SWEEP_FLAGS)}`);
    return 0;
  }
  refuseArguments(positionals);
  for (const warning of warnings) console.error(`conduit sim: ${warning}`);
  const { model, hw, tp, calibration, efficiency, flags } = resolveDeployment(values, label);
  const contextLen = wholeNumber('context', values.context, 1);
  // As lifecycle's and kv-tiers' prompts: the engine check decodes after a prompt of that many tokens (two output
  // tokens: the prefill's and the decode step's), so the table too describes only what the simulated context holds.
  fitsContext('--context', contextLen, 2);
  const blockSize = wholeNumber('block-size', values['block-size'], 1);
  // Checked before any table, whatever --no-check says (that flag skips the engine cross-check only): a deployment
  // whose weights do not fit its GPUs has no KV pool and no step times to tabulate.
  workerExists({ model, hw, tp, blockSize }, flags);
  const batchSizes = values.batches!.split(',').map((text) => {
    const batch = Number(text.trim());
    if (!Number.isSafeInteger(batch) || batch < 1) throw new UsageError(`--batches expects whole numbers >= 1, got "${text}"`);
    if (batch > MAX_SWEEP_BATCH) throw new UsageError(`--batches expects batches of at most ${MAX_SWEEP_BATCH} sequences, got "${text}"`);
    return batch;
  });
  const loraAdapters = wholeNumber('lora-adapters', values['lora-adapters'], 0);
  const lora = loraAdapters > 0 ? { adapters: loraAdapters, rank: loraRank(values['lora-rank'], model) } : undefined;
  let table;
  try {
    table = decodeSweep({ model, hw, tp, contextLen, batchSizes, efficiency, blockSize, ...(lora ? { lora } : {}) });
  } catch (error) {
    if (error instanceof RangeError) throw new UsageError(error.message);
    throw error;
  }
  console.log(`calibration: ${calibration}`);
  console.log(formatDecodeSweep(table));
  if (!values.check) return 0;

  const rows = await checkDecodeSweepWithEngine({ model, hw, tp, contextLen, batchSizes, blockSize, efficiency, ...(lora ? { lora } : {}) });
  let ok = true;
  const lines = ['simulated engine: the batch prefilled in one step, then one decode step of all of it:',
    'batch  model ITL ms  engine ITL ms  check', '-----  ------------  -------------  -----'];
  for (const row of rows) {
    const verdict = row.skipped ?? (agrees(row.engineItlMs, row.modelItlMs) ? 'ok' : 'MISMATCH');
    if (verdict === 'MISMATCH') ok = false;
    lines.push(`${String(row.batch).padStart(5)}  ${row.modelItlMs.toFixed(2).padStart(12)}  `
      + `${(row.skipped ? '-' : row.engineItlMs.toFixed(2)).padStart(13)}  ${verdict}`);
  }
  console.log(lines.join('\n'));
  return ok ? 0 : 1;
}

export const KV_TIERS_FLAGS = withEnvPrefix('CONDUIT_SIM_', {
  ...DEPLOYMENT_FLAGS,
  model: { ...DEPLOYMENT_FLAGS.model, default: 'llama-3.1-70b' },
  tp: { ...DEPLOYMENT_FLAGS.tp, default: 4 },
  prompt: { type: 'number', help: 'prompt tokens', default: 8192 },
  'host-tier': { type: 'string', help: `host RAM tier profile: ${Object.keys(KV_TIER_PROFILES).join(', ')} (default: the GPU's PCIe generation)` },
  'disk-tier': { type: 'string', help: `disk tier profile: ${Object.keys(KV_TIER_PROFILES).join(', ')}`, default: 'nvme-gen4' },
  help: { type: 'boolean', help: 'show this help', short: 'h' },
} satisfies FlagTable);

async function kvTiers(argv: string[]): Promise<number> {
  return namingEnvironment(KV_TIERS_FLAGS, parseFlags(KV_TIERS_FLAGS, argv), runKvTiers);
}

async function runKvTiers(parsed: ParsedFlags<typeof KV_TIERS_FLAGS>): Promise<number> {
  const { values, positionals } = parsed;
  const label = (name: keyof typeof KV_TIERS_FLAGS & string): string => flagLabel(KV_TIERS_FLAGS, parsed, name);
  if (values.help) {
    console.log(`Usage: conduit sim kv-tiers [options]\n\n${formatFlagHelp(KV_TIERS_FLAGS)}`);
    return 0;
  }
  refuseArguments(positionals);
  const { model, hw, tp, calibration, efficiency, flags } = resolveDeployment(values, label);
  const promptTokens = wholeNumber('prompt', values.prompt, 1);
  fitsContext('--prompt', promptTokens);
  const requestFlags = { ...flags, request: label('prompt') };
  fitsWorker({ model, hw, tp }, promptTokens, requestFlags);
  const profile = (flag: string, id: string | undefined) => {
    if (id === undefined) return undefined;
    const found = Object.hasOwn(KV_TIER_PROFILES, id) ? KV_TIER_PROFILES[id] : undefined;
    if (found === undefined) throw new UsageError(`--${flag} must be one of ${Object.keys(KV_TIER_PROFILES).join(', ')}, got "${id}"`);
    return found;
  };
  const ram = profile('host-tier', values['host-tier']);
  const disk = profile('disk-tier', values['disk-tier']);
  let report;
  try {
    report = simulateKvTierTtft({ model, hw, tp, promptTokens, efficiency, ...(ram ? { ram } : {}), ...(disk ? { disk } : {}), flags: requestFlags });
  } catch (error) {
    if (error instanceof RangeError) throw new UsageError(error.message);
    throw error;
  }
  console.log(`calibration: ${calibration}; TTFT of a ${promptTokens}-token prompt on one ${model.name} worker (${tp} x ${hw.name}), by where its prefix comes from:`);
  console.log(formatKvTierTtft(report));
  return 0;
}

export const simCommand: Command = {
  summary: 'simulated GPU cluster: TTFT lifecycle and decode sweep from the performance model',
  async run(argv) {
    const [sub, ...rest] = argv;
    switch (sub) {
      case 'lifecycle':
        return lifecycle(rest);
      case 'decode-sweep':
        return sweep(rest);
      case 'kv-tiers':
        return kvTiers(rest);
      case '--help': case '-h': case 'help':
        console.log(simHelp());
        return 0;
      case undefined:
        console.log(simHelp());
        return 2;
      default:
        throw new UsageError(`unknown subcommand "${sub}" (lifecycle, decode-sweep, kv-tiers; see --help)`);
    }
  },
};
