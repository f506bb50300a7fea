// Conduit against llama.cpp through node-llama-cpp and its C API on the same GGUF files, side by side in one run
//
//   npm run bench:peer:engines, or: cd benchmarks/peer && npm install --no-audit --no-fund && node --import tsx bench.ts [options]
//
// (needs git and g++ for the C API driver, built on first use into build/)
//   --models Q8_0,F32   which synthetic 110M models (default both; written into the cache on first use)
//   --runs 3            measured runs per figure (min / median / max), after one warm-up run per engine
//   --threads 2         compute threads of every engine
//   --wait-load L       before each model, wait (up to --wait-max seconds, default 120) for the 1-minute load < L
//   --max-foreign 0.1   retake a sample (up to --retries 3 times) when other processes used more than this share of
//                       the CPU during it; before each sample wait up to --gate-wait 20 s for a quiet moment
//   --json FILE         also write every sample as JSON
//   --quick             one run, shorter generations: a smoke test, not a measurement
//
// Engines: Conduit's EngineCore with the native backend on the main thread (kernels + control plane), Conduit as
// served (createLocalEngine: the step loop in a worker thread, outputs as messages), and llama.cpp three ways:
// node-llama-cpp with its default batching ("as shipped"), node-llama-cpp with whole batches in sequence order
// ("ordered"; see llama-runner.ts), and its C API with no JavaScript in the loop ("C API", llama-capi-runner.ts,
// the same prebuilt libraries). The fair ceiling is llama.cpp's best of the three, in practice the C API; every
// ratio is against it. Each figure is taken for every engine within the same run, engines in rotating order,
// and a sample during which another process took CPU is retaken (see harness.ts).
//
// Figures: prefill tok/s and TTFT of a cold 512-token prompt; TTFT of the same prompt again (prefix cache);
// single-stream decode tok/s (128-token prompt, 128 tokens); aggregate decode tok/s of 4, 8 and 16 sequences
// (128-token prompts, 64 tokens each, counted while all are decoding). The machine's memory bandwidth is
// measured in the same run, before every figure (the addon's STREAM-like read and copy, and a JavaScript copy as
// a lower bound), and single-stream decode is shown as a share of the roofline: the best read bandwidth of the
// run / weight bytes per token.
import { writeFileSync } from 'node:fs';
import { parseArgs } from 'node:util';

import { loadNativeAddon } from '../../src/kernels/native.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { ensureBenchModel, parseBenchDtype, type BenchModelDtype } from '../model-files.ts';
import {
  CoreRunner, decodeSteps, decodeWeightBytes, phaseMeans, ServedRunner, STEP_PHASES, type StepRecord,
} from './conduit-runner.ts';
import {
  checkTraces, jsCopyBandwidthGBs, loadLine, minMedMax, num, percentile, promptTokens, sample, speedRatio,
  steadyDecodeTokPerSec, summarize, table, ttftMs, waitForQuiet, waitForQuietCpu, type GenRequest, type RequestTrace, type Runner,
  type SampleOptions, type Summary,
} from './harness.ts';
import { LlamaCApiRunner } from './llama-capi-runner.ts';
import { LlamaCpp, type LlamaRunner } from './llama-runner.ts';

const { values: args } = parseArgs({
  options: {
    models: { type: 'string', default: 'Q8_0,F32' },
    runs: { type: 'string', default: '3' },
    threads: { type: 'string', default: '2' },
    'wait-load': { type: 'string' },
    'wait-max': { type: 'string', default: '120' },
    'max-foreign': { type: 'string', default: '0.1' },
    retries: { type: 'string', default: '3' },
    'gate-wait': { type: 'string', default: '20' },
    json: { type: 'string' },
    quick: { type: 'boolean', default: false },
  },
});

const QUICK = args.quick;
const RUNS = QUICK ? 1 : Number(args.runs);
const THREADS = Number(args.threads);
const MODELS = args.models.split(',').map(parseBenchDtype);
const PROMPT_TTFT = 512;
const PROMPT_DECODE = 128;
const DECODE1_TOKENS = QUICK ? 32 : 128;
const DECODEN_TOKENS = QUICK ? 16 : 64;
const STREAMS = [4, 8, 16];
/** Context per llama.cpp sequence, and KV capacity of Conduit's pool: 16 sequences of it. */
const CONTEXT_PER_SEQUENCE = 2048;
const KV_DTYPE = 'f16';
const SAMPLING: SampleOptions = {
  maxForeignShare: Number(args['max-foreign']), retries: Number(args.retries), gateWaitMs: Number(args['gate-wait']) * 1000,
};
let nextSeed = 1;

type EngineKey = 'core' | 'served' | 'shipped' | 'ordered' | 'capi';
const ENGINES: readonly EngineKey[] = ['core', 'served', 'shipped', 'ordered', 'capi'];
const LLAMA_ENGINES = ['shipped', 'ordered', 'capi'] as const;
const ENGINE_LABEL: Record<EngineKey, string> = {
  core: 'Conduit EngineCore', served: 'Conduit served', shipped: 'llama.cpp as shipped', ordered: 'llama.cpp ordered',
  capi: 'llama.cpp C API',
};

interface FigureDef {
  key: string;
  label: string;
  lowerIsBetter: boolean;
}
const FIGURES: FigureDef[] = [
  { key: 'prefill', label: `prefill ${PROMPT_TTFT} tok/s`, lowerIsBetter: false },
  { key: 'ttftCold', label: `TTFT ${PROMPT_TTFT} cold ms`, lowerIsBetter: true },
  { key: 'ttftAgain', label: `TTFT ${PROMPT_TTFT} again ms`, lowerIsBetter: true },
  { key: 'decode1', label: 'decode 1 stream tok/s', lowerIsBetter: false },
  ...STREAMS.map((n) => ({ key: `decode${n}`, label: `decode ${n} streams tok/s`, lowerIsBetter: false })),
];

// ---------------------------------------------------------------------------------------------------------------
// Results

interface ModelResults {
  dtype: BenchModelDtype;
  path: string;
  decodeBytesPerToken: number;
  loadBefore: string;
  loadAfter: string;
  /** figure -> engine -> one value per run. */
  samples: Record<string, Partial<Record<EngineKey, number[]>>>;
  /** Prompt tokens each engine served from its cache on the repeated prompt. */
  cachedOnRepeat: Partial<Record<EngineKey, number>>;
  /** EngineCore's step phases per figure. */
  coreSteps: Record<string, StepRecord[]>;
  /** Conduit served: ms from the worker's token stamp to the main thread reading the output, per figure. */
  deliveryLagMs: Record<string, number[]>;
  /** Median inter-token gap per engine and figure (ms). */
  itlMs: Record<string, Partial<Record<EngineKey, number[]>>>;
  /** Share of the CPU other processes used during each kept sample, per figure (all engines). */
  foreignShare: Record<string, number[]>;
  /** Samples retaken because of foreign CPU use, per figure. */
  retakes: Record<string, number>;
}

function add(results: ModelResults, figure: string, engine: EngineKey, value: number): void {
  ((results.samples[figure] ??= {})[engine] ??= []).push(value);
}

function addItl(results: ModelResults, figure: string, engine: EngineKey, tokenMs: readonly number[][]): void {
  const gaps: number[] = [];
  for (const t of tokenMs) for (let i = 1; i < t.length; i++) gaps.push(t[i]! - t[i - 1]!);
  ((results.itlMs[figure] ??= {})[engine] ??= []).push(percentile(gaps, 0.5));
}

function rotate<T>(items: readonly T[], by: number): T[] {
  const k = by % items.length;
  return [...items.slice(k), ...items.slice(0, k)];
}

// ---------------------------------------------------------------------------------------------------------------
// Measurements

interface Engines {
  core: CoreRunner;
  served: ServedRunner;
  llama: LlamaCpp;
  modelPath: string;
}

interface EngineRun {
  traces: RequestTrace[];
  steps: StepRecord[];
  lags: number[];
}

/** Runs `requests` on one engine, all at once, with the Conduit-side diagnostics of that run. */
async function runOn(engines: Engines, runner: Runner, key: EngineKey, requests: GenRequest[]): Promise<EngineRun> {
  engines.core.takeSteps();
  engines.served.takeDeliveryLags();
  const traces = await runner.run(requests, requests.length);
  checkTraces(runner.name, requests, traces);
  return {
    traces,
    steps: key === 'core' ? engines.core.takeSteps() : [],
    lags: key === 'served' ? engines.served.takeDeliveryLags() : [],
  };
}

/** One line per sample on stderr, so a long run shows where it is. */
function progress(results: ModelResults, figure: string, key: EngineKey, value: number, foreignShare: number, attempts: number): void {
  process.stderr.write(`  ${results.dtype} ${figure} ${ENGINE_LABEL[key]}: ${num(value)} (foreign CPU ` +
    `${(foreignShare * 100).toFixed(0)}%, attempt ${attempts})\n`);
}

function file(results: ModelResults, figure: string, run: EngineRun, foreignShare: number, attempts: number): void {
  (results.coreSteps[figure] ??= []).push(...run.steps);
  (results.deliveryLagMs[figure] ??= []).push(...run.lags);
  (results.foreignShare[figure] ??= []).push(foreignShare);
  results.retakes[figure] = (results.retakes[figure] ?? 0) + attempts - 1;
}

async function measureTtft(engines: Engines, results: ModelResults): Promise<void> {
  const llama1 = await engines.llama.runner('shipped', 1, CONTEXT_PER_SEQUENCE);
  const capi1 = await LlamaCApiRunner.start(engines.modelPath, THREADS, 1, CONTEXT_PER_SEQUENCE);
  const runners: [EngineKey, Runner][] = [['core', engines.core], ['served', engines.served], ['shipped', llama1],
    ['capi', capi1]];
  for (const [, runner] of runners) { // warm-up: scratch buffers, page faults, JIT
    const request = { prompt: promptTokens(nextSeed++, PROMPT_TTFT), maxTokens: 1 };
    await runner.run([request], 1);
    await runner.run([request], 1);
  }
  for (let r = 0; r < RUNS; r++) {
    for (const [key, runner] of rotate(runners, r)) {
      // A fresh prompt per attempt: cold must miss every cache; the repeat must hit the one just computed.
      const { value, foreignShare, attempts } = await sample(SAMPLING, async () => {
        const request = { prompt: promptTokens(nextSeed++, PROMPT_TTFT), maxTokens: 1 };
        return { cold: await runOn(engines, runner, key, [request]), again: await runOn(engines, runner, key, [request]) };
      });
      const cold = value.cold.traces[0]!;
      const again = value.again.traces[0]!;
      add(results, 'ttftCold', key, ttftMs(cold));
      add(results, 'prefill', key, PROMPT_TTFT / (ttftMs(cold) / 1000));
      add(results, 'ttftAgain', key, ttftMs(again));
      results.cachedOnRepeat[key] = again.cachedTokens;
      file(results, 'ttftCold', value.cold, foreignShare, attempts);
      progress(results, 'ttft cold/again', key, ttftMs(cold), foreignShare, attempts);
      file(results, 'ttftAgain', value.again, foreignShare, 1);
    }
  }
  await llama1.close();
  await capi1.close();
}

async function measureDecode(engines: Engines, results: ModelResults, streams: number): Promise<void> {
  const figure = `decode${streams}`;
  const maxTokens = streams === 1 ? DECODE1_TOKENS : DECODEN_TOKENS;
  const llamaRunners: [EngineKey, LlamaRunner | LlamaCApiRunner][] = [
    ['shipped', await engines.llama.runner('shipped', streams, CONTEXT_PER_SEQUENCE)],
    ['capi', await LlamaCApiRunner.start(engines.modelPath, THREADS, streams, CONTEXT_PER_SEQUENCE)],
  ];
  if (streams > 1) llamaRunners.push(['ordered', await engines.llama.runner('ordered', streams, CONTEXT_PER_SEQUENCE)]);
  const runners: [EngineKey, Runner][] = [['core', engines.core], ['served', engines.served], ...llamaRunners];
  const freshRequests = (): GenRequest[] => Array.from({ length: streams }, () =>
    ({ prompt: promptTokens(nextSeed++, PROMPT_DECODE), maxTokens }));
  for (const [, runner] of runners) await runner.run(freshRequests(), streams); // warm-up
  for (let r = 0; r < RUNS; r++) {
    for (const [key, runner] of rotate(runners, r)) {
      const { value, foreignShare, attempts } = await sample(SAMPLING, () => runOn(engines, runner, key, freshRequests()));
      add(results, figure, key, steadyDecodeTokPerSec(value.traces));
      addItl(results, figure, key, value.traces.map((t) => t.tokenMs));
      file(results, figure, value, foreignShare, attempts);
      progress(results, figure, key, results.samples[figure]![key]!.at(-1)!, foreignShare, attempts);
    }
  }
  for (const [, runner] of llamaRunners) await runner.close();
}

async function benchModel(dtype: BenchModelDtype): Promise<ModelResults> {
  const file = await ensureBenchModel(dtype);
  if (args['wait-load']) await waitForQuiet(Number(args['wait-load']), Number(args['wait-max']));
  const model: LoadedModel = await loadModel(file.path);
  const results: ModelResults = {
    dtype, path: file.path, decodeBytesPerToken: decodeWeightBytes(model), loadBefore: loadLine(), loadAfter: '',
    samples: {}, cachedOnRepeat: {}, coreSteps: {}, deliveryLagMs: {}, itlMs: {}, foreignShare: {}, retakes: {},
  };
  console.log(`\n## ${file.label}: ${file.path}`);
  console.log(`${(results.decodeBytesPerToken / 1e6).toFixed(1)} MB of weights read per decode step; ${results.loadBefore}`);
  const options = { threads: THREADS, kvDtype: KV_DTYPE, kvTokens: 16 * CONTEXT_PER_SEQUENCE } as const;
  const engines: Engines = {
    core: await CoreRunner.create(model, options),
    served: await ServedRunner.create(model, options),
    llama: await LlamaCpp.load(file.path, THREADS),
    modelPath: file.path,
  };
  console.log(`llama.cpp: ${engines.llama.describe()}`);
  const info = engines.served.bundle.engine.info;
  console.log(`Conduit: backend ${info.backend}, ${info.threads} threads, kernels ${Object.entries(info.kernelVariants)
    .map(([k, v]) => `${k}=${v}`).join(' ')}, KV ${KV_DTYPE}, ${info.kvCapacityTokens} tokens`);
  try {
    const started = performance.now();
    await noteBandwidth();
    await measureTtft(engines, results);
    await noteBandwidth();
    await measureDecode(engines, results, 1);
    for (const n of STREAMS) {
      await noteBandwidth();
      await measureDecode(engines, results, n);
    }
    results.loadAfter = loadLine();
    console.log(`measured in ${((performance.now() - started) / 1000).toFixed(0)} s; ${results.loadAfter}`);
  } finally {
    await engines.core.close();
    await engines.served.close();
    await engines.llama.close();
  }
  return results;
}

// ---------------------------------------------------------------------------------------------------------------
// Report

function summaryOf(results: ModelResults, figure: string, engine: EngineKey): Summary | undefined {
  const values = results.samples[figure]?.[engine];
  return values ? summarize(values) : undefined;
}

/** llama.cpp's best median for the figure, however it was driven: the fair ceiling. */
function llamaCeiling(results: ModelResults, figure: FigureDef): number {
  const medians = LLAMA_ENGINES.map((e) => summaryOf(results, figure.key, e)?.median)
    .filter((v): v is number => v !== undefined);
  return figure.lowerIsBetter ? Math.min(...medians) : Math.max(...medians);
}

function report(results: ModelResults, reads: Summary): void {
  console.log(`\n### ${results.dtype}: min/median/max of ${RUNS} runs (ratios: medians, above 1 = Conduit faster)`);
  const rows = FIGURES.map((f) => {
    const ceiling = llamaCeiling(results, f);
    const foreign = results.foreignShare[f.key === 'prefill' ? 'ttftCold' : f.key] ?? [];
    return [f.label, ...ENGINES.map((e) => minMedMax(summaryOf(results, f.key, e))),
      speedRatio(summaryOf(results, f.key, 'core')?.median ?? NaN, ceiling, f.lowerIsBetter),
      speedRatio(summaryOf(results, f.key, 'served')?.median ?? NaN, ceiling, f.lowerIsBetter),
      speedRatio(summaryOf(results, f.key, 'core')?.median ?? NaN, summaryOf(results, f.key, 'shipped')?.median ?? NaN,
        f.lowerIsBetter),
      `${(Math.max(0, ...foreign.filter(Number.isFinite)) * 100).toFixed(0)}% / ${results.retakes[f.key === 'prefill' ? 'ttftCold' : f.key] ?? 0}`];
  });
  console.log(table(['figure', ...ENGINES.map((e) => ENGINE_LABEL[e]), 'core / llama best', 'served / llama best',
    'core / llama shipped', 'foreign CPU max / retakes'], rows));
  console.log(`cached prompt tokens on the repeat: ${ENGINES.filter((e) => results.cachedOnRepeat[e] !== undefined)
    .map((e) => `${ENGINE_LABEL[e]} ${results.cachedOnRepeat[e]}`).join(', ')}`);

  // The roofline takes the best read bandwidth seen in the run: that is what the memory system can deliver; the
  // readings below it were taken while something else (another VM, another process) shared it.
  const rooflineTokPerSec = (reads.max * 1e9) / results.decodeBytesPerToken;
  const medianRoofline = (reads.median * 1e9) / results.decodeBytesPerToken;
  console.log(`\nRoofline: ${(results.decodeBytesPerToken / 1e6).toFixed(1)} MB of weights per token at ${reads.max.toFixed(1)} ` +
    `GB/s (best read of the run) = ${rooflineTokPerSec.toFixed(0)} tok/s single-stream decode; at the median reading ` +
    `${reads.median.toFixed(1)} GB/s, ${medianRoofline.toFixed(0)} tok/s`);
  console.log(table(['engine', 'decode 1 stream median tok/s', '% of roofline (best GB/s)', '% at median GB/s',
    'effective GB/s'],
    (['core', 'served', 'shipped', 'capi'] as const).map((e) => {
      const median = summaryOf(results, 'decode1', e)?.median ?? NaN;
      return [ENGINE_LABEL[e], num(median), `${((median / rooflineTokPerSec) * 100).toFixed(0)}%`,
        `${((median / medianRoofline) * 100).toFixed(0)}%`, num((median * results.decodeBytesPerToken) / 1e9)];
    })));

  if (results.dtype === 'Q8_0') {
    const median = (figure: string, engine: EngineKey) => summaryOf(results, figure, engine)?.median ?? NaN;
    const targets: [string, (e: EngineKey) => number, number][] = [
      ['decode 1 stream >= 1.1x llama.cpp', (e) => median('decode1', e) / llamaCeiling(results, FIGURES[3]!), 1.1],
      ['decode 1 stream >= 85% of roofline', (e) => median('decode1', e) / rooflineTokPerSec, 0.85],
      ['prefill 512 >= 1.2x llama.cpp', (e) => median('prefill', e) / llamaCeiling(results, FIGURES[0]!), 1.2],
      ['decode 16 streams >= 1.5x llama.cpp', (e) => median('decode16', e) /
        llamaCeiling(results, FIGURES.find((f) => f.key === 'decode16')!), 1.5],
    ];
    console.log('\nTargets (Q8_0):');
    console.log(table(['target', 'Conduit EngineCore', 'Conduit served'], targets.map(([label, value, goal]) =>
      [label, ...(['core', 'served'] as const).map((e) => `${value(e).toFixed(2)} ${value(e) >= goal ? 'met' : 'NOT met'}`)])));
  }

  console.log('\nWhere Conduit\'s time goes (EngineCore, mean ms per step; prefill/again = the step that ran the prompt):');
  const phaseRows: string[][] = [];
  const addPhaseRow = (label: string, steps: StepRecord[]) => {
    if (steps.length === 0) return;
    const p = phaseMeans(steps);
    phaseRows.push([label, String(p.steps), num(p.tokens), ...STEP_PHASES.map((phase) => num(p.ms[phase])), num(p.ms.total),
      `${((p.ms.forward / p.ms.total) * 100).toFixed(1)}%`]);
  };
  addPhaseRow('prefill 512 cold', results.coreSteps.ttftCold ?? []);
  addPhaseRow('512 again (prefix hit)', results.coreSteps.ttftAgain ?? []);
  for (const n of [1, ...STREAMS]) addPhaseRow(`decode ${n}`, decodeSteps(results.coreSteps[`decode${n}`] ?? []));
  console.log(table(['figure', 'steps', 'tokens/step', ...STEP_PHASES, 'step total', 'forward share'], phaseRows));

  console.log('\nConduit served vs EngineCore: median inter-token gap (ms) and the worker-to-main-thread delivery lag:');
  console.log(table(['figure', 'core ITL', 'served ITL', 'served - core', 'delivery lag p50', 'delivery lag p99',
    'llama shipped ITL', 'llama ordered ITL', 'llama C API ITL'], [1, ...STREAMS].map((n) => {
    const figure = `decode${n}`;
    const itl = (e: EngineKey) => summarize(results.itlMs[figure]?.[e] ?? []).median;
    const lags = results.deliveryLagMs[figure] ?? [];
    return [`decode ${n}`, num(itl('core')), num(itl('served')), num(itl('served') - itl('core')),
      lags.length ? num(percentile(lags, 0.5)) : '-', lags.length ? num(percentile(lags, 0.99)) : '-',
      num(itl('shipped')), num(itl('ordered')), num(itl('capi'))];
  })));
  const ttftLags = results.deliveryLagMs.ttftCold ?? [];
  if (ttftLags.length) console.log(`delivery lag of the first token (512 cold): p50 ${num(percentile(ttftLags, 0.5))} ms`);
}

// ---------------------------------------------------------------------------------------------------------------

interface Bandwidth {
  readGBs: number;
  copyGBs: number;
  jsCopyGBs: number;
}

const bandwidthReadings: Bandwidth[] = [];

/** Reads the memory bandwidth now (after a quiet moment) and keeps the reading. */
async function noteBandwidth(): Promise<void> {
  bandwidthReadings.push(await measureBandwidth());
}

async function measureBandwidth(): Promise<Bandwidth> {
  await waitForQuietCpu(SAMPLING.maxForeignShare / 2, SAMPLING.gateWaitMs);
  const addon = loadNativeAddon();
  const bytes = 256 << 20; // well past the last-level cache
  return {
    readGBs: addon.bench.memoryBandwidth('read', bytes, 5, THREADS),
    copyGBs: addon.bench.memoryBandwidth('copy', bytes / 2, 5, THREADS),
    jsCopyGBs: jsCopyBandwidthGBs(bytes / 2),
  };
}

const cpu = loadNativeAddon().cpuInfo();
console.log(`# Conduit vs llama.cpp, ${new Date().toISOString()}, node ${process.version}`);
console.log(`CPU: ${cpu.defaultThreads} cores available, best kernel variant ${cpu.bestVariant}` +
  `${cpu.avx512vnni ? ', AVX-512 VNNI' : ''}${cpu.amxInt8 ? ', AMX-INT8' : ', no AMX'}; ${THREADS} threads per engine; ${loadLine()}`);
await noteBandwidth();
const b0 = bandwidthReadings[0]!;
console.log(`Memory bandwidth at start: read ${b0.readGBs.toFixed(1)} GB/s, copy ${b0.copyGBs.toFixed(1)} GB/s (addon, ` +
  `${THREADS} threads, STREAM counting), JS Float64Array copy ${b0.jsCopyGBs.toFixed(1)} GB/s (1 thread, lower bound)`);

const allResults: ModelResults[] = [];
for (const dtype of MODELS) allResults.push(await benchModel(dtype));
await noteBandwidth();

const reads = summarize(bandwidthReadings.map((b) => b.readGBs));
console.log(`
Memory bandwidth over the run (${reads.n} readings, one before each figure): read min/median/max ` +
  `${minMedMax(reads)} GB/s; copy ${minMedMax(summarize(bandwidthReadings.map((b) => b.copyGBs)))} GB/s; JS copy ` +
  `${minMedMax(summarize(bandwidthReadings.map((b) => b.jsCopyGBs)))} GB/s`);
for (const results of allResults) report(results, reads);

if (args.json) {
  writeFileSync(args.json, JSON.stringify({
    date: new Date().toISOString(), node: process.version, threads: THREADS, runs: RUNS, cpu,
    bandwidth: bandwidthReadings,
    models: allResults.map(({ coreSteps, ...rest }) => ({
      ...rest,
      corePhases: Object.fromEntries(Object.entries(coreSteps).map(([figure, steps]) => [figure, phaseMeans(steps)])),
    })),
  }, null, 2));
}
