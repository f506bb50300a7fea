// What every model-level benchmark shares: the workload shapes (requests of token ids), the trace each engine
// returns (when each token reached the caller), the figures computed from traces, min / median / max summaries,
// the machine's state (load, memory bandwidth) and table printing.
//
// Every engine under test (Conduit's EngineCore, Conduit as served, llama.cpp through node-llama-cpp) implements
// `Runner`, so a figure is computed by the same code from the same kind of trace whoever produced it.
import { readFileSync } from 'node:fs';
import { availableParallelism, loadavg } from 'node:os';
import { percentile as percentileOfSorted } from '../../src/util/stats.ts';

// ---------------------------------------------------------------------------------------------------------------
// Workload and traces

export interface GenRequest {
  /** Prompt token ids, BOS first. */
  prompt: readonly number[];
  /** Tokens to generate; end-of-sequence tokens do not stop generation, so every request produces exactly this. */
  maxTokens: number;
}

export interface RequestTrace {
  /** performance.now() when the request was handed to the engine. */
  submittedMs: number;
  /** performance.now() when each generated token reached the caller. */
  tokenMs: number[];
  /** Prompt tokens served from a cache, where the engine reports it. */
  cachedTokens?: number;
}

export interface Runner {
  readonly name: string;
  /**
   * Runs `requests` keeping at most `concurrency` in flight (a closed loop: the next starts when one finishes),
   * in order; returns one trace per request, in the same order.
   */
  run(requests: readonly GenRequest[], concurrency: number): Promise<RequestTrace[]>;
  close(): Promise<void>;
}

/** Deterministic prompts: BOS then ids from the ordinary part of the vocabulary, a fresh stream per seed. */
export function promptTokens(seed: number, length: number, vocabSize = 32000, bosId = 1): number[] {
  let state = (seed * 0x9e3779b1) >>> 0 || 1;
  const out = [bosId];
  while (out.length < length) {
    state ^= state << 13; state >>>= 0;
    state ^= state >>> 17;
    state ^= state << 5; state >>>= 0;
    out.push(259 + (state % (vocabSize - 259))); // past the control and byte-fallback tokens of the SPM vocabulary
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Figures from traces

/** Time to first token of one request, ms. */
export function ttftMs(trace: RequestTrace): number {
  return trace.tokenMs[0]! - trace.submittedMs;
}

/**
 * Aggregate decode rate of requests run together: the tokens that arrived while every request was past its first
 * token and none had finished yet, over that window. Prefill and a ragged start or end (one sequence lagging)
 * are left out, so this is the steady-state rate with all streams active.
 */
export function steadyDecodeTokPerSec(traces: readonly RequestTrace[]): number {
  const start = Math.max(...traces.map((t) => t.tokenMs[0]!));
  const end = Math.min(...traces.map((t) => t.tokenMs.at(-1)!));
  if (!(end > start)) throw new Error('decode window is empty: the streams did not overlap');
  let tokens = 0;
  for (const t of traces) for (const ms of t.tokenMs) if (ms > start && ms <= end) tokens++;
  return tokens / ((end - start) / 1000);
}

export interface LoadRunFigures {
  /** Generated tokens over the makespan (first submission to last token). */
  outputTokPerSec: number;
  /** Prompt + generated tokens over the makespan. */
  totalTokPerSec: number;
  ttftP50Ms: number;
  ttftP99Ms: number;
  /** Median gap between consecutive tokens of a request, over all requests. */
  itlP50Ms: number;
}

export function loadRunFigures(requests: readonly GenRequest[], traces: readonly RequestTrace[]): LoadRunFigures {
  const start = Math.min(...traces.map((t) => t.submittedMs));
  const end = Math.max(...traces.map((t) => t.tokenMs.at(-1)!));
  const seconds = (end - start) / 1000;
  const output = traces.reduce((n, t) => n + t.tokenMs.length, 0);
  const prompt = requests.reduce((n, r) => n + r.prompt.length, 0);
  const ttfts = traces.map(ttftMs);
  const gaps: number[] = [];
  for (const t of traces) for (let i = 1; i < t.tokenMs.length; i++) gaps.push(t.tokenMs[i]! - t.tokenMs[i - 1]!);
  return {
    outputTokPerSec: output / seconds,
    totalTokPerSec: (output + prompt) / seconds,
    ttftP50Ms: percentile(ttfts, 0.5),
    ttftP99Ms: percentile(ttfts, 0.99),
    itlP50Ms: percentile(gaps, 0.5),
  };
}

/** Nearest-rank percentile of values in any order (src/util/stats.ts's, over a sorted copy). */
export function percentile(values: readonly number[], q: number): number {
  return percentileOfSorted(Float64Array.from(values).sort(), q);
}

/** Checks that a runner produced what was asked, so a short or broken run cannot pass as a fast one. */
export function checkTraces(runner: string, requests: readonly GenRequest[], traces: readonly RequestTrace[]): void {
  if (traces.length !== requests.length) throw new Error(`${runner}: ${traces.length} traces for ${requests.length} requests`);
  traces.forEach((t, i) => {
    if (t.tokenMs.length !== requests[i]!.maxTokens) {
      throw new Error(`${runner}: request ${i} produced ${t.tokenMs.length} tokens, expected ${requests[i]!.maxTokens}`);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Summaries

export interface Summary {
  min: number;
  median: number;
  max: number;
  n: number;
}

export function summarize(values: readonly number[]): Summary {
  if (values.length === 0) return { min: NaN, median: NaN, max: NaN, n: 0 };
  const sorted = [...values].sort((a, b) => a - b);
  const mid = sorted.length >> 1;
  const median = sorted.length % 2 === 1 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2;
  return { min: sorted[0]!, median, max: sorted.at(-1)!, n: sorted.length };
}

/** Number with about three significant digits, no exponent. */
export function num(value: number): string {
  if (!Number.isFinite(value)) return '-';
  const abs = Math.abs(value);
  return abs >= 100 ? value.toFixed(0) : abs >= 10 ? value.toFixed(1) : abs >= 1 ? value.toFixed(2) : value.toFixed(3);
}

export function minMedMax(s: Summary | undefined): string {
  return s && s.n > 0 ? `${num(s.min)}/${num(s.median)}/${num(s.max)}` : '-';
}

// ---------------------------------------------------------------------------------------------------------------
// Machine state

export function load1(): number {
  return loadavg()[0]!;
}

export function loadLine(): string {
  const [one, five, fifteen] = loadavg();
  return `load average ${one!.toFixed(2)}, ${five!.toFixed(2)}, ${fifteen!.toFixed(2)}`;
}

/**
 * Waits (up to maxSeconds) for the 1-minute load average to fall below `below`: the machine is shared, and a
 * figure taken while another job holds a core measures that job as much as ours. Returns the load it ended at.
 */
export async function waitForQuiet(below: number, maxSeconds: number): Promise<number> {
  const deadline = performance.now() + maxSeconds * 1000;
  while (load1() >= below && performance.now() < deadline) await new Promise((r) => setTimeout(r, 5000));
  return load1();
}

// Interference. The load average lags by a minute and counts our own threads; what spoils a sample is another
// process taking CPU while it runs. So each sample is bracketed by two readings of the machine's busy time
// (/proc/stat) and of this process's own CPU time (all its threads: the engine worker, the kernels' pool,
// llama.cpp's threads): the difference is what everything else used. llama.cpp's threads spin-wait on each
// other, so on two vCPUs a co-runner that takes one core for a moment stalls a whole step; Conduit's pool yields
// instead. A sample with more than a small share of foreign CPU measures the co-runner, not the engine.

export interface CpuSnapshot {
  /** Busy time of all CPUs (ms), from /proc/stat; NaN where it is not readable. */
  machineBusyMs: number;
  /** CPU time of this process (ms, every thread) and of the child processes it drives. */
  ownMs: number;
  wallMs: number;
}

/** Child processes whose CPU time is ours (an engine driven in another process), not interference. */
const trackedChildren = new Set<number>();

export function trackChildCpu(pid: number): void {
  trackedChildren.add(pid);
}

/** utime + stime of a process in ms (/proc/<pid>/stat fields 14 and 15), 0 once it has exited. */
function processCpuMs(pid: number): number {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' '); // the name may hold spaces; state is field 3
    return (Number(fields[11]) + Number(fields[12])) * MS_PER_TICK;
  } catch {
    trackedChildren.delete(pid);
    return 0;
  }
}

/** USER_HZ: /proc/stat counts in clock ticks of 10 ms on Linux. */
const MS_PER_TICK = 10;

export function cpuSnapshot(): CpuSnapshot {
  let machineBusyMs = NaN;
  try {
    const fields = readFileSync('/proc/stat', 'utf8').split('\n', 1)[0]!.trim().split(/\s+/).slice(1).map(Number);
    const idle = (fields[3] ?? 0) + (fields[4] ?? 0); // idle + iowait
    // user..steal (guest time is already inside user): stolen time hurts a sample as much as a co-runner does.
    machineBusyMs = (fields.slice(0, 8).reduce((a, b) => a + b, 0) - idle) * MS_PER_TICK;
  } catch {
    // not Linux: interference stays unknown
  }
  const own = process.cpuUsage();
  let childrenMs = 0;
  for (const pid of trackedChildren) childrenMs += processCpuMs(pid);
  return { machineBusyMs, ownMs: (own.user + own.system) / 1000 + childrenMs, wallMs: performance.now() };
}

/** Share of the machine's CPU (0..1) that other processes used between two snapshots. */
export function foreignCpuShare(from: CpuSnapshot, to: CpuSnapshot, cores = availableParallelism()): number {
  const wall = to.wallMs - from.wallMs;
  if (!(wall > 0) || Number.isNaN(from.machineBusyMs)) return NaN;
  const foreign = (to.machineBusyMs - from.machineBusyMs) - (to.ownMs - from.ownMs);
  return Math.max(0, foreign / (wall * cores));
}

/** Waits until a `windowMs` window shows at most `maxShare` foreign CPU, or until maxWaitMs; returns the last share. */
export async function waitForQuietCpu(maxShare: number, maxWaitMs: number, windowMs = 400): Promise<number> {
  const deadline = performance.now() + maxWaitMs;
  for (;;) {
    const from = cpuSnapshot();
    await new Promise((r) => setTimeout(r, windowMs));
    const share = foreignCpuShare(from, cpuSnapshot());
    if (!(share > maxShare) || performance.now() >= deadline) return share;
  }
}

export interface SampleOptions {
  /** Retake a sample during which other processes used more than this share of the CPU. */
  maxForeignShare: number;
  retries: number;
  /** Before each attempt, wait up to this long for a quiet window. */
  gateWaitMs: number;
}

export interface Sampled<T> {
  value: T;
  /** Foreign CPU share during the attempt kept. */
  foreignShare: number;
  /** Attempts made (1 = no retake). */
  attempts: number;
}

/**
 * Takes one sample: waits for a quiet moment, runs `attempt(k)`, and retakes it (k = 1, 2...) when other
 * processes took more than maxForeignShare of the CPU meanwhile; after `retries` retakes it keeps the least
 * disturbed attempt and reports its share. `attempt` gets k so it can use fresh prompts (a retried cold prompt
 * must not hit the cache).
 */
export async function sample<T>(options: SampleOptions, attempt: (k: number) => Promise<T>): Promise<Sampled<T>> {
  let best: Sampled<T> | undefined;
  let attempts = 0;
  for (let k = 0; k <= options.retries; k++) {
    attempts++;
    if (options.gateWaitMs > 0) await waitForQuietCpu(options.maxForeignShare / 2, options.gateWaitMs);
    const from = cpuSnapshot();
    const value = await attempt(k);
    const foreignShare = foreignCpuShare(from, cpuSnapshot());
    if (!best || !(foreignShare >= best.foreignShare)) best = { value, foreignShare, attempts: 0 };
    if (!(foreignShare > options.maxForeignShare)) break;
  }
  return { ...best!, attempts };
}

/** A lower bound on memory bandwidth from JavaScript: Float64Array.set of `bytes` (read + write counted). */
export function jsCopyBandwidthGBs(bytes = 256 << 20, repetitions = 5): number {
  const a = new Float64Array(bytes / 8).fill(1);
  const b = new Float64Array(bytes / 8);
  b.set(a); // fault the pages in before timing
  let best = Infinity;
  for (let r = 0; r < repetitions; r++) {
    const t = performance.now();
    b.set(a);
    best = Math.min(best, performance.now() - t);
  }
  return (2 * bytes) / (best / 1000) / 1e9;
}

// ---------------------------------------------------------------------------------------------------------------
// Tables

export function table(header: readonly string[], rows: readonly (readonly string[])[]): string {
  const widths = header.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? '').length)));
  const line = (cells: readonly string[]) => `| ${cells.map((c, i) => (c ?? '').padEnd(widths[i]!)).join(' | ')} |`;
  return [line(header), `|${widths.map((w) => '-'.repeat(w + 2)).join('|')}|`, ...rows.map(line)].join('\n');
}

/** "1.23x": ours over theirs for a rate, theirs over ours for a latency, so above 1 always means faster. */
export function speedRatio(ours: number, theirs: number, lowerIsBetter: boolean): string {
  if (!Number.isFinite(ours) || !Number.isFinite(theirs) || ours <= 0 || theirs <= 0) return '-';
  return `${(lowerIsBetter ? theirs / ours : ours / theirs).toFixed(2)}x`;
}
