// The engine as a whole on the synthetic 110M Q8_0 model (bench:engine), beside llama.cpp in the same run.
//
//   node --import tsx benchmarks/engine.ts [--runs 3] [--threads 2] [--concurrency 1,4,16,64] [--no-llama]
//                                          [--max-foreign 0.1] [--retries 3] [--gate-wait 20] [--quick] [--json FILE]
//
// 1. Throughput under load: a closed loop keeping N requests in flight (N = 1, 4, 16, 64; 2N requests, at least
//    8), prompts of mixed lengths (16, 32, 64, 128, 256 tokens in turn), 48 generated tokens each, greedy. Output
//    and total (prompt + output) tok/s over the makespan, TTFT p50 / p99, median inter-token gap. Engines:
//    Conduit's EngineCore, Conduit as served (worker thread), and llama.cpp through node-llama-cpp, as shipped
//    and with whole ordered batches (peer/llama-runner.ts), and through its C API with no JavaScript in the loop
//    (peer/llama-capi-runner.ts: the fair ceiling; needs git and g++ to build on first use). llama.cpp runs when
//    benchmarks/peer has been installed (`npm run bench:peer` does it), else it is left out and the run says so.
// 2. Control-plane overhead per step at 256 running requests: benchmarks/scheduler.ts (no model) as a child
//    process, then EngineCore and the served engine on the real model with 256 requests decoding together,
//    split into forward / schedule / build / sample / update / emit, and the served engine's delivery lag.
// 3. Prefix cache: TTFT of a 512-token prompt sent again, against the same prompt cold (target: at most 2%), and
//    the physical floor of any step (one decode step reads every weight once).
//
// Samples are taken when the machine is quiet and retaken when another process took CPU meanwhile (see
// peer/harness.ts); each table says how much foreign CPU its kept samples saw.
import { execFileSync } from 'node:child_process';
import { existsSync, writeFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

import { loadModel } from '../src/model/loader.ts';
import { ensureBenchModel } from './model-files.ts';
import {
  CoreRunner, decodeSteps, decodeWeightBytes, phaseMeans, ServedRunner, STEP_PHASES, type StepRecord,
} from './peer/conduit-runner.ts';
import { capiUnavailableReason, LlamaCApiRunner } from './peer/llama-capi-runner.ts';
import {
  checkTraces, loadLine, loadRunFigures, minMedMax, num, percentile, promptTokens, sample, speedRatio, summarize,
  table, ttftMs, type GenRequest, type LoadRunFigures, type Runner, type SampleOptions,
} from './peer/harness.ts';

const { values: args } = parseArgs({
  options: {
    runs: { type: 'string', default: '3' },
    threads: { type: 'string', default: '2' },
    concurrency: { type: 'string', default: '1,4,16,64' },
    'no-llama': { type: 'boolean', default: false },
    'max-foreign': { type: 'string', default: '0.1' },
    retries: { type: 'string', default: '3' },
    'gate-wait': { type: 'string', default: '20' },
    quick: { type: 'boolean', default: false },
    json: { type: 'string' },
  },
});

const QUICK = args.quick;
const RUNS = QUICK ? 1 : Number(args.runs);
const THREADS = Number(args.threads);
const CONCURRENCY = args.concurrency.split(',').map(Number);
const PROMPT_LENGTHS = [16, 32, 64, 128, 256];
const OUTPUT_TOKENS = QUICK ? 16 : 48;
const OVERHEAD_RUNNING = 256;
const OVERHEAD_PROMPT = 32;
const OVERHEAD_OUTPUT = QUICK ? 12 : 24;
const PROMPT_TTFT = 512;
const SAMPLING: SampleOptions = {
  maxForeignShare: Number(args['max-foreign']), retries: Number(args.retries), gateWaitMs: Number(args['gate-wait']) * 1000,
};
const KV_TOKENS = 32768;
let nextSeed = 500_000;

// ---------------------------------------------------------------------------------------------------------------
// llama.cpp, when benchmarks/peer is installed. Loaded through a computed specifier so that type-checking the
// product never needs node-llama-cpp; the shape used is declared here.

interface LlamaCppHandle {
  describe(): string;
  runner(batching: 'shipped' | 'ordered', sequences: number, contextSize: number): Promise<Runner>;
  close(): Promise<void>;
}

async function loadLlama(modelPath: string): Promise<LlamaCppHandle | string> {
  if (args['no-llama']) return 'left out (--no-llama)';
  const installed = fileURLToPath(new URL('./peer/node_modules/node-llama-cpp/package.json', import.meta.url));
  if (!existsSync(installed)) return 'not installed: run `cd benchmarks/peer && npm install` (or npm run bench:peer) first';
  const reason = capiUnavailableReason();
  if (reason) return `incomplete install: ${reason}`;
  const specifier = new URL('./peer/llama-runner.ts', import.meta.url).href;
  const module = (await import(specifier)) as { LlamaCpp: { load(path: string, threads: number): Promise<LlamaCppHandle> } };
  return module.LlamaCpp.load(modelPath, THREADS);
}

// ---------------------------------------------------------------------------------------------------------------

type EngineKey = 'core' | 'served' | 'capi' | 'ordered' | 'shipped';
const LABEL: Record<EngineKey, string> = {
  core: 'Conduit EngineCore', served: 'Conduit served', capi: 'llama.cpp C API', ordered: 'llama.cpp ordered',
  shipped: 'llama.cpp as shipped',
};
const LLAMA_KEYS = ['capi', 'ordered', 'shipped'] as const;

function rotate<T>(items: readonly T[], by: number): T[] {
  const k = by % items.length;
  return [...items.slice(k), ...items.slice(0, k)];
}

/** Foreign CPU seen by a section's kept samples, and how many samples were retaken. */
class Disturbance {
  private max = 0;
  private retakes = 0;
  note(foreignShare: number, attempts: number): void {
    if (Number.isFinite(foreignShare)) this.max = Math.max(this.max, foreignShare);
    this.retakes += attempts - 1;
  }
  line(): string {
    return `(samples kept saw at most ${(this.max * 100).toFixed(0)}% foreign CPU; ${this.retakes} retaken)`;
  }
}

function mixedRequests(count: number, maxTokens: number): GenRequest[] {
  return Array.from({ length: count }, (_, i) =>
    ({ prompt: promptTokens(nextSeed++, PROMPT_LENGTHS[i % PROMPT_LENGTHS.length]!), maxTokens }));
}

const cacheFile = await ensureBenchModel('Q8_0');
const model = await loadModel(cacheFile.path);
const decodeBytes = decodeWeightBytes(model);
const options = { threads: THREADS, kvDtype: 'f16', kvTokens: KV_TOKENS } as const;
const core = await CoreRunner.create(model, options);
const served = await ServedRunner.create(model, options);
const llama = await loadLlama(cacheFile.path);

console.log(`# Conduit engine benchmark, ${new Date().toISOString()}, node ${process.version}`);
console.log(`${cacheFile.label}: ${cacheFile.path}; ${(decodeBytes / 1e6).toFixed(1)} MB of weights per decode step; ` +
  `${THREADS} threads per engine; KV f16; ${loadLine()}`);
console.log(`llama.cpp: ${typeof llama === 'string' ? llama : llama.describe()}`);

const json: Record<string, unknown> = { date: new Date().toISOString(), node: process.version, threads: THREADS, runs: RUNS };

// ---------------------------------------------------------------------------------------------------------------
// 1. Throughput under load

async function throughput(): Promise<void> {
  console.log(`\n## Throughput: N requests in flight (closed loop), 2N requests (at least 8), prompts of ` +
    `${PROMPT_LENGTHS.join('/')} tokens in turn, ${OUTPUT_TOKENS} generated tokens each; min/median/max of ${RUNS} runs`);
  const rows: string[][] = [];
  const all: Record<string, Record<string, LoadRunFigures[]>> = {};
  for (const n of CONCURRENCY) {
    const count = Math.max(8, 2 * n);
    const contextSize = Math.max(...PROMPT_LENGTHS) + OUTPUT_TOKENS + 16;
    const runners: [EngineKey, Runner][] = [['core', core], ['served', served]];
    if (typeof llama !== 'string') {
      runners.push(['capi', await LlamaCApiRunner.start(cacheFile.path, THREADS, n, contextSize)]);
      runners.push(['ordered', await llama.runner('ordered', n, contextSize)]);
      runners.push(['shipped', await llama.runner('shipped', n, contextSize)]);
    }
    for (const [, runner] of runners) await runner.run(mixedRequests(Math.min(count, 2 * n), 8), n); // warm-up
    core.takeSteps();
    served.takeDeliveryLags();
    const figures: Partial<Record<EngineKey, LoadRunFigures[]>> = {};
    const foreign: number[] = [];
    let retakes = 0;
    for (let r = 0; r < RUNS; r++) {
      for (const [key, runner] of rotate(runners, r)) {
        const { value, foreignShare, attempts } = await sample(SAMPLING, async () => {
          const requests = mixedRequests(count, OUTPUT_TOKENS);
          const traces = await runner.run(requests, n);
          checkTraces(runner.name, requests, traces);
          return loadRunFigures(requests, traces);
        });
        (figures[key] ??= []).push(value);
        process.stderr.write(`  N=${n} ${LABEL[key]}: ${num(value.outputTokPerSec)} output tok/s (foreign CPU ` +
          `${(foreignShare * 100).toFixed(0)}%, attempt ${attempts})\n`);
        foreign.push(foreignShare);
        retakes += attempts - 1;
      }
    }
    for (const [key, runner] of runners) if (key !== 'core' && key !== 'served') await runner.close();
    all[`N=${n}`] = figures as Record<string, LoadRunFigures[]>;
    const best = Math.max(...LLAMA_KEYS.map((k) =>
      summarize((figures[k] ?? []).map((f) => f.outputTokPerSec)).median).filter(Number.isFinite));
    for (const [key] of runners) {
      const f = figures[key]!;
      const output = summarize(f.map((x) => x.outputTokPerSec));
      rows.push([`${n}`, LABEL[key], minMedMax(output), minMedMax(summarize(f.map((x) => x.totalTokPerSec))),
        num(summarize(f.map((x) => x.ttftP50Ms)).median), num(summarize(f.map((x) => x.ttftP99Ms)).median),
        num(summarize(f.map((x) => x.itlP50Ms)).median),
        key === 'core' || key === 'served' ? speedRatio(output.median, best, false) : '',
        key === 'core' ? `${(Math.max(0, ...foreign.filter(Number.isFinite)) * 100).toFixed(0)}% / ${retakes}` : '']);
    }
  }
  console.log(table(['N', 'engine', 'output tok/s', 'total tok/s', 'TTFT p50 ms', 'TTFT p99 ms', 'ITL p50 ms',
    'output vs llama best', 'foreign CPU max / retakes'], rows));
  json.throughput = all;
}

// ---------------------------------------------------------------------------------------------------------------
// 2. Control-plane overhead at 256 running requests

function phaseTable(label: string, steps: StepRecord[]): string[] {
  const p = phaseMeans(steps);
  const control = p.ms.schedule + p.ms.build + p.ms.update;
  return [label, String(p.steps), num(p.tokens), ...STEP_PHASES.map((phase) => num(p.ms[phase] * 1000)),
    num(p.ms.total), `${((control / p.ms.total) * 100).toFixed(1)}%`, `${(((p.ms.sample + p.ms.emit) / p.ms.total) * 100).toFixed(1)}%`];
}

async function overhead(): Promise<void> {
  console.log(`\n## Control-plane overhead per step at ${OVERHEAD_RUNNING} running requests`);
  console.log('\n### benchmarks/scheduler.ts (scheduler and batch builder alone, no model)');
  const schedulerScript = fileURLToPath(new URL('./scheduler.ts', import.meta.url));
  const output = execFileSync(process.execPath, ['--import', 'tsx', schedulerScript, '--running', String(OVERHEAD_RUNNING),
    '--steps', QUICK ? '200' : '1000'], { encoding: 'utf8' });
  console.log(output.trimEnd().split('\n').map((line) => `    ${line}`).join('\n'));

  console.log(`\n### On the model: ${OVERHEAD_RUNNING} requests of ${OVERHEAD_PROMPT}-token prompts decoding ` +
    `${OVERHEAD_OUTPUT} tokens together (µs per step unless noted)`);
  const rows: string[][] = [];
  const disturbance = new Disturbance();
  const lags: number[] = [];
  const itl: Record<string, number[]> = { core: [], served: [] };
  const requests = () => Array.from({ length: OVERHEAD_RUNNING }, () =>
    ({ prompt: promptTokens(nextSeed++, OVERHEAD_PROMPT), maxTokens: OVERHEAD_OUTPUT }));
  await core.run(requests().slice(0, 32), 32); // warm-up
  core.takeSteps();
  const coreSteps: StepRecord[] = [];
  for (let r = 0; r < RUNS; r++) {
    for (const [key, runner] of rotate([['core', core], ['served', served]] as [string, Runner][], r)) {
      const { value, foreignShare, attempts } = await sample(SAMPLING, async () => {
        core.takeSteps();
        served.takeDeliveryLags();
        const reqs = requests();
        const traces = await runner.run(reqs, reqs.length);
        checkTraces(runner.name, reqs, traces);
        return { traces, steps: core.takeSteps(), lags: served.takeDeliveryLags() };
      });
      // Only the steps where all of them decode (prompts are prefilled over the first few steps, in chunks).
      disturbance.note(foreignShare, attempts);
      if (key === 'core') coreSteps.push(...decodeSteps(value.steps).filter((s) => s.numSeqs === OVERHEAD_RUNNING));
      else lags.push(...value.lags);
      // The gap between consecutive steps as the caller sees it, in decode (all requests advance together).
      const gaps: number[] = [];
      for (const t of value.traces) for (let i = 1; i < t.tokenMs.length; i++) gaps.push(t.tokenMs[i]! - t.tokenMs[i - 1]!);
      itl[key]!.push(percentile(gaps, 0.5));
    }
  }
  rows.push(phaseTable(`EngineCore, ${OVERHEAD_RUNNING} decoding`, coreSteps));
  console.log(table(['', 'steps', 'tokens/step', ...STEP_PHASES.map((p) => `${p} µs`), 'step ms',
    'schedule+build+update share', 'sample+emit share'], rows));
  const coreItl = summarize(itl.core!).median;
  const servedItl = summarize(itl.served!).median;
  console.log(`step gap seen by the caller: EngineCore ${num(coreItl)} ms, served ${num(servedItl)} ms ` +
    `(served - core ${num(servedItl - coreItl)} ms); served delivery lag (worker stamp to main thread) ` +
    `p50 ${num(percentile(lags, 0.5))} ms, p99 ${num(percentile(lags, 0.99))} ms for ${OVERHEAD_RUNNING} outputs per step`);
  console.log(disturbance.line());
  json.overhead = { scheduler: output, core: phaseMeans(coreSteps), coreItl, servedItl, lagP50: percentile(lags, 0.5) };
}

// ---------------------------------------------------------------------------------------------------------------
// 3. Prefix cache

async function prefixCache(): Promise<void> {
  console.log(`\n## Prefix cache: TTFT of a ${PROMPT_TTFT}-token prompt sent again vs cold, min/median/max of ${RUNS} runs`);
  const runners: [EngineKey, Runner][] = [['core', core], ['served', served]];
  if (typeof llama !== 'string') {
    runners.push(['shipped', await llama.runner('shipped', 1, 2048)]);
    runners.push(['capi', await LlamaCApiRunner.start(cacheFile.path, THREADS, 1, 2048)]);
  }
  const cold: Partial<Record<EngineKey, number[]>> = {};
  const again: Partial<Record<EngineKey, number[]>> = {};
  const cached: Partial<Record<EngineKey, number>> = {};
  const againSteps: StepRecord[] = [];
  const disturbance = new Disturbance();
  for (const [, runner] of runners) { // warm-up
    const request = { prompt: promptTokens(nextSeed++, PROMPT_TTFT), maxTokens: 1 };
    await runner.run([request], 1);
    await runner.run([request], 1);
  }
  for (let r = 0; r < RUNS; r++) {
    for (const [key, runner] of rotate(runners, r)) {
      const { value, foreignShare, attempts } = await sample(SAMPLING, async () => {
        const request = { prompt: promptTokens(nextSeed++, PROMPT_TTFT), maxTokens: 1 };
        const [first] = await runner.run([request], 1);
        core.takeSteps();
        const [second] = await runner.run([request], 1);
        return { first: first!, second: second!, steps: core.takeSteps() };
      });
      disturbance.note(foreignShare, attempts);
      (cold[key] ??= []).push(ttftMs(value.first));
      (again[key] ??= []).push(ttftMs(value.second));
      cached[key] = value.second.cachedTokens;
      if (key === 'core') againSteps.push(...value.steps);
    }
  }
  for (const [key, runner] of runners) if (key !== 'core' && key !== 'served') await runner.close();
  // One decode step reads every weight once: no step, however few tokens it computes, can be faster.
  const { value: floorSteps } = await sample(SAMPLING, async () => {
    core.takeSteps();
    await core.run([{ prompt: promptTokens(nextSeed++, PROMPT_TTFT), maxTokens: 9 }], 1);
    return decodeSteps(core.takeSteps());
  });
  const decodeFloorMs = phaseMeans(floorSteps).ms.total;
  console.log(table(['engine', 'cold ms', 'again ms', 'again / cold (median)', 'prompt tokens reused'],
    runners.map(([key]) => {
      const c = summarize(cold[key]!);
      const a = summarize(again[key]!);
      return [LABEL[key], minMedMax(c), minMedMax(a), `${((a.median / c.median) * 100).toFixed(1)}%`, String(cached[key] ?? '-')];
    })));
  const p = phaseMeans(againSteps);
  console.log(`EngineCore's repeat step: ${num(p.tokens)} tokens recomputed (only the last prompt token: the cached block ` +
    `it ends is copied, not recomputed), forward ${num(p.ms.forward)} ms (the block copy included) of ` +
    `${num(p.ms.total)} ms. Target: at most 2% of cold = ${num(summarize(cold.core!).median * 0.02)} ms.`);
  console.log(`Floor: a one-token step at this context takes ${num(decodeFloorMs)} ms ` +
    `(${((decodeFloorMs / summarize(cold.core!).median) * 100).toFixed(1)}% of cold): every step streams all ` +
    `${(decodeBytes / 1e6).toFixed(0)} MB of weights.`);
  console.log(disturbance.line());
  json.prefixCache = { cold, again, cached, againPhases: p, decodeFloorMs };
}

try {
  await throughput();
  await overhead();
  await prefixCache();
  console.log(`\n${loadLine()}`);
} finally {
  await core.close();
  await served.close();
  if (typeof llama !== 'string') await llama.close();
}
if (args.json) writeFileSync(args.json, JSON.stringify(json, null, 2));
