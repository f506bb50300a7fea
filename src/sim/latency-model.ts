// The data behind `conduit sim lifecycle` and `conduit sim decode-sweep`: a request's time to first token phase by
// phase, cold (no cached prefix) and warm (a prefix-cache hit), and decode latency and throughput against batch
// size. GPU phases come from the performance model; the CPU phases around them (gateway, tokenizer, router,
// dispatch, SSE write) are the documented constants below. Plain data plus text formatters; no I/O, no clock.

import { DEFAULT_BLOCK_SIZE } from '../protocols/block-hash.ts';
import type { HardwareProfile, LinkProfile } from './hardware.ts';
import { kvBytesPerToken, type ModelProfile } from './models.ts';
import type { Efficiency, StepBreakdown, StepLora, StepShape } from './perf-model.ts';
import {
  DEFAULT_EFFICIENCY, checkTensorParallel, kvCapacityBlocks, kvTransferTimeMs, stepBreakdown,
} from './perf-model.ts';

// ---------------------------------------------------------------------------------------------------------------
// CPU-side overheads

/** The request's phases, named as everywhere else in Conduit (spans, metrics, the CLI). */
export type LifecyclePhase =
  | 'http_receive' | 'auth' | 'rate_limit' | 'validate' | 'tokenize' | 'router_lookup' | 'scheduler_queue'
  | 'prefill_dispatch' | 'prefill_execution' | 'kv_transfer' | 'decode_dispatch' | 'decode_execution'
  | 'streaming_response';

export const LIFECYCLE_PHASES: readonly LifecyclePhase[] = [
  'http_receive', 'auth', 'rate_limit', 'validate', 'tokenize', 'router_lookup', 'scheduler_queue',
  'prefill_dispatch', 'prefill_execution', 'kv_transfer', 'decode_dispatch', 'decode_execution',
  'streaming_response',
];

/**
 * The phases of a first token spent outside the workers: the gateway's (receive, auth, rate limit, validate,
 * tokenize, route), its hand-over to the worker and its streaming of the token back. `conduit plan` simulates the
 * workers only, so its TTFT leaves these out (gatewayTtftMs says how much they add).
 */
export const GATEWAY_PHASES: readonly LifecyclePhase[] = [
  'http_receive', 'auth', 'rate_limit', 'validate', 'tokenize', 'router_lookup', 'prefill_dispatch', 'streaming_response',
];

/** Milliseconds of a TTFT trace in the gateway's phases (GATEWAY_PHASES). */
export function gatewayTtftMs(trace: TtftTrace): number {
  return trace.phases.reduce((sum, p) => sum + (GATEWAY_PHASES.includes(p.phase) ? p.ms : 0), 0);
}

export interface LifecycleOverheads {
  /** Read and parse the POST body (a 1K-token prompt is a few KB of JSON). */
  httpReceiveMs: number;
  /** API key lookup in memory. */
  authMs: number;
  /** Tenant token-bucket check in memory. */
  rateLimitMs: number;
  /** Schema and limit checks of the parsed request. */
  validateMs: number;
  /** Chat template plus tokenizer throughput, tokens per second. */
  tokenizeTokensPerSec: number;
  /** Hash the prompt's blocks and look them up in the router's KV index, pick a worker. */
  routerLookupMs: number;
  /** Hand a request to a worker (prefill or decode): one message between threads or processes. */
  dispatchMs: number;
  /** Detokenize the first token, format the SSE chunk, write it to the socket. */
  streamingResponseMs: number;
}

/**
 * Conduit's own costs in its default embedded deployment (gateway, router and workers in one process, workers in
 * worker threads). docs/simulator.md gives the basis of each: Node's raw HTTP server handles 26-30k JSON POSTs a
 * second on one core (~35 us each, rounded up for a larger body); the pure-JS tokenizer encodes 0.13-0.25M tokens a
 * second, 200k taken here; a worker-thread message costs tens of microseconds.
 */
export const DEFAULT_OVERHEADS: Readonly<LifecycleOverheads> = Object.freeze({
  httpReceiveMs: 0.1,
  authMs: 0.01,
  rateLimitMs: 0.01,
  validateMs: 0.02,
  tokenizeTokensPerSec: 200_000,
  routerLookupMs: 0.05,
  dispatchMs: 0.05,
  streamingResponseMs: 0.05,
});

// ---------------------------------------------------------------------------------------------------------------
// Time to first token

export interface LifecycleOptions {
  model: ModelProfile;
  hw: HardwareProfile;
  tp: number;
  promptTokens: number;
  /**
   * Prompt tokens the warm request finds in the prefix cache. Default: the longest whole-block prefix shorter than
   * the prompt, i.e. a request that shares every block of an earlier one but its last (blocks are cached whole). A
   * prompt sent again verbatim reuses promptTokens - 1 tokens (the engine copies its cached last block and computes
   * only the final token, whose logits it needs): pass that to model it. Clamped to promptTokens - 1, because the
   * last prompt token is always computed.
   */
  cachedTokens?: number;
  /** KV block size in tokens (default 16). */
  blockSize?: number;
  /**
   * Prefill and decode on separate workers, the prompt's KV crossing `link` between them. parallelLinks: links used
   * side by side (default tp: one NIC per GPU, each sending its GPU's KV shard).
   */
  disaggregated?: { link: LinkProfile; parallelLinks?: number };
  /** Token budget of one step (chunked prefill splits longer prompts); default 8192. */
  maxNumBatchedTokens?: number;
  /** Time waiting for the scheduler; 0 for an idle engine, which starts a step as soon as a request arrives. */
  queueMs?: number;
  efficiency?: Efficiency;
  overheads?: Partial<LifecycleOverheads>;
}

/** Where one GPU phase's time went, summed over its steps. */
export interface ExecutionComponents {
  matmulMs: number;
  attentionMs: number;
  commMs: number;
  overheadMs: number;
  /** Unfused norm / residual / activation kernels and the per-layer floor (0 under the roofline calibration). */
  elementwiseMs: number;
  /** Which side of the matmul roofline limited the (last) step. */
  matmulBound: string;
}

export interface PhaseTiming {
  phase: LifecyclePhase;
  ms: number;
  detail: string;
  /** The engine steps of a GPU phase, in order. */
  steps?: StepBreakdown[];
  components?: ExecutionComponents;
}

export interface TtftTrace {
  scenario: 'cold' | 'warm';
  promptTokens: number;
  /** Prompt tokens found in the prefix cache. */
  cachedTokens: number;
  /** Prompt tokens computed by a prefill. */
  computedTokens: number;
  phases: PhaseTiming[];
  ttftMs: number;
}

export interface LifecycleReport {
  modelName: string;
  hardwareName: string;
  tp: number;
  promptTokens: number;
  /** The link name when disaggregated, else null. */
  disaggregatedOver: string | null;
  kvTransferParallelLinks: number;
  efficiency: Efficiency;
  overheads: LifecycleOverheads;
  cold: TtftTrace;
  warm: TtftTrace;
}

/** `1 token`, `2 tokens`: a count and its noun, singular for one. */
export function counted(count: number, noun: string): string {
  return `${count} ${noun}${count === 1 ? '' : 's'}`;
}

function checkCount(name: string, value: number, min: number): void {
  if (!Number.isInteger(value) || value < min) {
    throw new RangeError(`${name} must be an integer >= ${min}, got ${value}`);
  }
}

/** Steps that prefill `tokens` prompt tokens after `cachedTokens`, chunked by the step budget; the last samples. */
function prefillSteps(cachedTokens: number, tokens: number, budget: number): StepShape[] {
  const steps: StepShape[] = [];
  for (let done = 0; done < tokens; done += budget) {
    const newTokens = Math.min(budget, tokens - done);
    steps.push({
      prefillTokens: [{ newTokens, contextLen: cachedTokens + done, sampled: done + newTokens === tokens }],
      decodeSeqs: [],
    });
  }
  return steps;
}

function execution(phase: LifecyclePhase, steps: StepShape[], opts: LifecycleOptions, efficiency: Efficiency,
  detail: string): PhaseTiming {
  const breakdowns = steps.map((s) => stepBreakdown(s, opts.model, opts.hw, opts.tp, efficiency));
  const sum = (f: (b: StepBreakdown) => number) => breakdowns.reduce((s, b) => s + f(b), 0);
  const last = breakdowns[breakdowns.length - 1];
  return {
    phase,
    ms: sum((b) => b.totalMs),
    detail,
    steps: breakdowns,
    components: {
      matmulMs: sum((b) => b.matmul.timeMs),
      attentionMs: sum((b) => b.prefillAttention.timeMs + b.decodeAttention.timeMs),
      commMs: sum((b) => b.commMs),
      overheadMs: sum((b) => b.overheadMs),
      elementwiseMs: sum((b) => b.elementwiseMs + b.layerOverheadMs),
      matmulBound: last ? last.matmul.bound : 'idle',
    },
  };
}

/** Time to first token of one request on an otherwise idle deployment, cold and warm, phase by phase. */
export function simulateLifecycle(opts: LifecycleOptions): LifecycleReport {
  const { model, hw, tp, promptTokens } = opts;
  checkTensorParallel(model, hw, tp);
  checkCount('promptTokens', promptTokens, 1);
  const blockSize = opts.blockSize ?? DEFAULT_BLOCK_SIZE;
  checkCount('blockSize', blockSize, 1);
  const budget = opts.maxNumBatchedTokens ?? 8192;
  checkCount('maxNumBatchedTokens', budget, 1);
  const efficiency = opts.efficiency ?? DEFAULT_EFFICIENCY;
  const overheads: LifecycleOverheads = { ...DEFAULT_OVERHEADS, ...opts.overheads };
  const queueMs = opts.queueMs ?? 0;
  const defaultHit = Math.floor((promptTokens - 1) / blockSize) * blockSize;
  const cachedTokens = Math.min(opts.cachedTokens ?? defaultHit, promptTokens - 1);
  checkCount('cachedTokens', cachedTokens, 0);
  const parallelLinks = opts.disaggregated?.parallelLinks ?? tp;

  const front = (): PhaseTiming[] => [
    { phase: 'http_receive', ms: overheads.httpReceiveMs, detail: 'read and parse the request' },
    { phase: 'auth', ms: overheads.authMs, detail: 'API key lookup' },
    { phase: 'rate_limit', ms: overheads.rateLimitMs, detail: 'tenant token bucket' },
    { phase: 'validate', ms: overheads.validateMs, detail: 'schema and limits' },
    {
      phase: 'tokenize', ms: (promptTokens / overheads.tokenizeTokensPerSec) * 1000,
      detail: `${counted(promptTokens, 'token')} at ${overheads.tokenizeTokensPerSec} tokens/s`,
    },
    { phase: 'router_lookup', ms: overheads.routerLookupMs, detail: 'block hashes against the KV index' },
    { phase: 'scheduler_queue', ms: queueMs, detail: queueMs === 0 ? 'idle engine: scheduled at once' : 'given' },
  ];
  const streaming: PhaseTiming = {
    phase: 'streaming_response', ms: overheads.streamingResponseMs, detail: 'detokenize, SSE chunk, socket write',
  };
  const none = (phase: LifecyclePhase, detail: string): PhaseTiming => ({ phase, ms: 0, detail });

  // Cold: nothing cached. The prefill's last step samples the first token, aggregated or not: disaggregated, as
  // Conduit's engine runs it, the prefill worker samples and streams the first token, and only then hands the
  // request over (the KV transfer and the decode worker's first step are on the path to the second token:
  // simulateDisaggregatedPath).
  const coldPhases = front();
  coldPhases.push({
    phase: 'prefill_dispatch', ms: overheads.dispatchMs,
    detail: opts.disaggregated ? 'to the prefill worker' : 'to the worker',
  });
  if (opts.disaggregated) {
    const link = opts.disaggregated.link;
    const transferMs = kvTransferTimeMs(promptTokens, model, link, { parallelLinks, efficiency: efficiency.commEfficiency });
    coldPhases.push(execution('prefill_execution', prefillSteps(0, promptTokens, budget), opts, efficiency,
      `${counted(promptTokens, 'token')} on the prefill worker, last step samples the first token`));
    coldPhases.push(none('kv_transfer', `after the first token: ${transferMs.toFixed(2)} ms over ${parallelLinks} x ${link.name}`));
    coldPhases.push(none('decode_dispatch', 'after the first token (hand-over to the decode worker)'));
    coldPhases.push(none('decode_execution', 'first token comes from the prefill worker\'s last step'));
  } else {
    coldPhases.push(execution('prefill_execution', prefillSteps(0, promptTokens, budget), opts, efficiency,
      `${counted(promptTokens, 'token')}, last step samples the first token`));
    coldPhases.push(none('kv_transfer', 'same worker'));
    coldPhases.push(none('decode_dispatch', 'same worker'));
    coldPhases.push(none('decode_execution', 'first token comes from the prefill step'));
  }
  coldPhases.push(streaming);

  // Warm: the router sends the request to the worker holding the prefix, which prefills only the rest itself (a
  // short remainder is not worth a disaggregated round trip), so nothing crosses a link.
  const computed = promptTokens - cachedTokens;
  const warmPhases = front();
  warmPhases.push({ phase: 'prefill_dispatch', ms: overheads.dispatchMs, detail: 'to the worker holding the prefix' });
  warmPhases.push(execution('prefill_execution', prefillSteps(cachedTokens, computed, budget), opts, efficiency,
    `${counted(computed, 'token')} after a ${cachedTokens}-token prefix hit`));
  warmPhases.push(none('kv_transfer', 'KV already on the worker'));
  warmPhases.push(none('decode_dispatch', 'same worker'));
  warmPhases.push(none('decode_execution', 'first token comes from the prefill step'));
  warmPhases.push(streaming);

  const trace = (scenario: 'cold' | 'warm', phases: PhaseTiming[], cached: number): TtftTrace => ({
    scenario, promptTokens, cachedTokens: cached, computedTokens: promptTokens - cached, phases,
    ttftMs: phases.reduce((s, p) => s + p.ms, 0),
  });
  return {
    modelName: model.name,
    hardwareName: hw.name,
    tp,
    promptTokens,
    disaggregatedOver: opts.disaggregated ? opts.disaggregated.link.name : null,
    kvTransferParallelLinks: parallelLinks,
    efficiency,
    overheads,
    cold: trace('cold', coldPhases, 0),
    warm: trace('warm', warmPhases, cachedTokens),
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Disaggregated cold path, next to the aggregated one

export interface DisaggregatedPathOptions extends Omit<LifecycleOptions, 'disaggregated' | 'cachedTokens'> {
  /** The link the prompt's KV crosses from the prefill worker to the decode worker. */
  link: LinkProfile;
  /** Links used side by side (default tp: one NIC per GPU, each sending its GPU's KV shard). */
  parallelLinks?: number;
  /** Prompt tokens the decode worker already holds (whole blocks): the transfer skips them. Default 0. */
  decodeCachedTokens?: number;
}

export interface PathColumn {
  /** Every phase up to the second token, in order; `segment` says which token it precedes. */
  phases: (PhaseTiming & { segment: 'first_token' | 'second_token' })[];
  ttftMs: number;
  /** Arrival to the second token written: TTFT plus what the decode side does before its first step ends. */
  secondTokenMs: number;
}

export interface DisaggregatedPathReport {
  modelName: string;
  hardwareName: string;
  tp: number;
  promptTokens: number;
  linkName: string;
  parallelLinks: number;
  /** What crosses the link: the prompt's blocks the decode worker lacks. */
  transferBlocks: number;
  transferBytes: number;
  aggregated: PathColumn;
  disaggregated: PathColumn;
}

/**
 * One cold request on an idle deployment, aggregated vs disaggregated, to its second token. Conduit's prefill
 * worker samples and streams the first token itself, so both have the same TTFT; disaggregation then adds the KV
 * transfer and a dispatch before the decode worker's first step. It pays off under load, where decode steps no
 * longer share the batch with other requests' prefills (benchmarks/kv-transfer.ts measures that on a cluster).
 */
export function simulateDisaggregatedPath(opts: DisaggregatedPathOptions): DisaggregatedPathReport {
  const { model, promptTokens } = opts;
  const blockSize = opts.blockSize ?? DEFAULT_BLOCK_SIZE;
  const base = simulateLifecycle({ ...opts, cachedTokens: 0 });
  const efficiency = base.efficiency;
  const overheads = base.overheads;
  const parallelLinks = opts.parallelLinks ?? opts.tp;
  const decodeCached = opts.decodeCachedTokens ?? 0;
  checkCount('decodeCachedTokens', decodeCached, 0);
  const heldBlocks = Math.min(Math.floor(decodeCached / blockSize), Math.floor(promptTokens / blockSize));
  const transferBlocks = Math.ceil(promptTokens / blockSize) - heldBlocks;
  const transferTokens = transferBlocks * blockSize;
  const transferBytes = transferTokens * kvBytesPerToken(model);
  const firstToken = base.cold.phases.filter((p) => p.ms > 0 || !['kv_transfer', 'decode_dispatch', 'decode_execution'].includes(p.phase));
  const decodeStep = execution('decode_execution', [{ prefillTokens: [], decodeSeqs: [{ contextLen: promptTokens }] }], opts,
    efficiency, `first decode step at context ${promptTokens}: the second token`);
  const column = (secondPhases: PhaseTiming[], label: string): PathColumn => {
    const phases = [
      ...firstToken.map((p) => ({ ...p, detail: p.phase === 'prefill_dispatch' ? `to the ${label}worker` : p.detail, segment: 'first_token' as const })),
      ...secondPhases.map((p) => ({ ...p, segment: 'second_token' as const })),
    ];
    const ttftMs = base.cold.ttftMs;
    return { phases, ttftMs, secondTokenMs: ttftMs + secondPhases.reduce((sum, p) => sum + p.ms, 0) };
  };
  const aggregated = column([
    { phase: 'kv_transfer', ms: 0, detail: 'same worker' },
    { phase: 'decode_dispatch', ms: 0, detail: 'same worker' },
    decodeStep,
    { phase: 'streaming_response', ms: overheads.streamingResponseMs, detail: 'the second token' },
  ], '');
  const disaggregated = column([
    {
      phase: 'kv_transfer',
      ms: kvTransferTimeMs(transferTokens, model, opts.link, { parallelLinks, efficiency: efficiency.commEfficiency }),
      detail: `${counted(transferBlocks, 'block')} (${(transferBytes / 2 ** 20).toFixed(1)} MiB) over ${parallelLinks} x ${opts.link.name}`,
    },
    { phase: 'decode_dispatch', ms: overheads.dispatchMs, detail: 'handoff to the decode worker' },
    decodeStep,
    { phase: 'streaming_response', ms: overheads.streamingResponseMs, detail: 'the second token' },
  ], 'prefill ');
  return {
    modelName: model.name, hardwareName: opts.hw.name, tp: opts.tp, promptTokens, linkName: opts.link.name,
    parallelLinks, transferBlocks, transferBytes, aggregated, disaggregated,
  };
}

/** The two cold paths side by side, phase by phase, with TTFT and the second token's time. */
export function formatDisaggregatedPath(report: DisaggregatedPathReport): string {
  const title = [
    `${report.modelName} on ${report.tp} x ${report.hardwareName} (tp ${report.tp}), prompt ${counted(report.promptTokens, 'token')}, cold: `
      + `aggregated vs disaggregated (KV over ${report.parallelLinks} x ${report.linkName})`,
    'the prefill worker samples and streams the first token; the decode worker continues from the second',
  ];
  const rows: string[][] = [];
  const agg = report.aggregated.phases;
  const dis = report.disaggregated.phases;
  const pushPhase = (i: number) => {
    const a = agg[i]!;
    const d = dis[i]!;
    rows.push([a.phase, fmt(a.ms), fmt(d.ms), fmt(d.ms - a.ms), d.ms > 0 && d.detail !== a.detail && a.ms > 0 ? `${a.detail} / ${d.detail}` : d.ms > 0 ? d.detail : a.detail]);
  };
  for (let i = 0; i < agg.length; i++) {
    if (agg[i]!.segment === 'second_token' && agg[i - 1]?.segment === 'first_token') {
      rows.push(['TTFT', fmt(report.aggregated.ttftMs), fmt(report.disaggregated.ttftMs), fmt(report.disaggregated.ttftMs - report.aggregated.ttftMs), 'first token written']);
    }
    pushPhase(i);
  }
  rows.push(['second token', fmt(report.aggregated.secondTokenMs), fmt(report.disaggregated.secondTokenMs),
    fmt(report.disaggregated.secondTokenMs - report.aggregated.secondTokenMs), 'arrival to the second token written']);
  return `${title.join('\n')}\n\n${table(['phase', 'aggregated ms', 'disaggregated ms', 'delta ms', 'note'], rows, [0, 4])}\n`;
}

// ---------------------------------------------------------------------------------------------------------------
// Decode sweep

export interface DecodeSweepOptions {
  model: ModelProfile;
  hw: HardwareProfile;
  tp: number;
  /** Tokens already in each sequence's KV cache. */
  contextLen: number;
  /** Default 1, 2, 4, ... 256. */
  batchSizes?: readonly number[];
  efficiency?: Efficiency;
  /** Fraction of HBM the engine may use (default 0.9), for the KV capacity check. */
  memoryUtilization?: number;
  /** KV block size in tokens (default 16), for the KV capacity check: the engine allocates whole blocks. */
  blockSize?: number;
  /**
   * LoRA: the batch's sequences use `adapters` distinct adapters of this rank (sequence i adapter i mod adapters;
   * a batch smaller than `adapters` has one per sequence). Default none: the base model.
   */
  lora?: SweepLora;
}

export interface SweepLora {
  adapters: number;
  rank: number;
}

/** The distinct adapters of a decode batch of `batch` sequences spread over lora.adapters (one token each). */
export function sweepLoras(batch: number, lora: SweepLora | undefined): StepLora[] | undefined {
  if (lora === undefined || lora.adapters <= 0) return undefined;
  return Array.from({ length: Math.min(batch, lora.adapters) }, (_, a) => ({
    tokens: Math.floor(batch / lora.adapters) + (a < batch % lora.adapters ? 1 : 0), rank: lora.rank,
  }));
}

export interface DecodeSweepRow {
  batch: number;
  /** Inter-token latency: one decode step, which every sequence in the batch waits for. */
  itlMs: number;
  tokensPerSec: number;
  tokensPerSecPerGpu: number;
  /** KV tokens the batch holds after the step, per GPU's cache (each GPU keeps a shard of every token). */
  kvTokens: number;
  /**
   * The batch's KV fits in what HBM leaves after the weights, as the engine allocates it: each sequence takes
   * ceil((context + 1) / blockSize) whole blocks of the pool (kvCapacityBlocks).
   */
  kvFits: boolean;
  breakdown: StepBreakdown;
}

export interface DecodeSweep {
  modelName: string;
  hardwareName: string;
  tp: number;
  contextLen: number;
  /** The KV pool in whole blocks of blockSize tokens, as the engine allocates it. */
  kvCapacityTokens: number;
  blockSize: number;
  efficiency: Efficiency;
  lora?: SweepLora;
  rows: DecodeSweepRow[];
}

export const DEFAULT_BATCH_SIZES: readonly number[] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/** Decode step time and throughput against batch size at one context length. */
export function decodeSweep(opts: DecodeSweepOptions): DecodeSweep {
  const { model, hw, tp, contextLen } = opts;
  checkTensorParallel(model, hw, tp);
  checkCount('contextLen', contextLen, 0);
  const efficiency = opts.efficiency ?? DEFAULT_EFFICIENCY;
  // Tokens alone say a batch fits when its sequences' partly filled last blocks push it past the pool.
  const blockSize = opts.blockSize ?? DEFAULT_BLOCK_SIZE;
  checkCount('blockSize', blockSize, 1);
  const poolBlocks = kvCapacityBlocks(model, hw, tp, blockSize, opts.memoryUtilization ?? 0.9);
  // The pool the engine allocates, in whole blocks, as `conduit serve --engine sim` reports its KV cache.
  const capacity = poolBlocks * blockSize;
  const blocksPerSeq = Math.ceil((contextLen + 1) / blockSize);
  const rows = (opts.batchSizes ?? DEFAULT_BATCH_SIZES).map((batch): DecodeSweepRow => {
    checkCount('batch size', batch, 1);
    const decodeSeqs = Array.from({ length: batch }, () => ({ contextLen }));
    const loras = sweepLoras(batch, opts.lora);
    const breakdown = stepBreakdown({ prefillTokens: [], decodeSeqs, ...(loras ? { loras } : {}) }, model, hw, tp, efficiency);
    const tokensPerSec = (batch / breakdown.totalMs) * 1000;
    const kvTokens = batch * (contextLen + 1);
    return {
      batch, itlMs: breakdown.totalMs, tokensPerSec, tokensPerSecPerGpu: tokensPerSec / tp, kvTokens,
      kvFits: batch * blocksPerSeq <= poolBlocks, breakdown,
    };
  });
  return {
    modelName: model.name, hardwareName: hw.name, tp, contextLen, kvCapacityTokens: capacity, blockSize, efficiency,
    ...(opts.lora && opts.lora.adapters > 0 ? { lora: opts.lora } : {}), rows,
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Text tables

/** Fixed-width text table; numbers right-aligned, the columns listed in `leftAligned` (labels, notes) left. */
function table(header: readonly string[], rows: readonly (readonly string[])[],
  leftAligned: readonly number[]): string {
  const widths = header.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? '').length)));
  const line = (cells: readonly string[]) => cells
    .map((c, i) => (leftAligned.includes(i) ? c.padEnd(widths[i]!) : c.padStart(widths[i]!)))
    .join('  ')
    .trimEnd();
  return [line(header), line(widths.map((w) => '-'.repeat(w))), ...rows.map(line)].join('\n');
}

const fmt = (ms: number, digits = 2) => ms.toFixed(digits);

function efficiencyLine(e: Efficiency): string {
  const unfused = (e.hiddenPasses ?? 0) > 0 || (e.ffnPasses ?? 0) > 0 || (e.layerOverheadUs ?? 0) > 0
    ? `, elementwise passes ${e.hiddenPasses ?? 0} hidden / ${e.ffnPasses ?? 0} FFN, layer floor ` +
      `${e.layerOverheadUs ?? 0} us`
    : '';
  return `efficiency: matmul MFU ${e.matmulMfu}, attention MFU ${e.attentionMfu}, HBM ${e.bandwidthUtilization}, ` +
    `comm ${e.commEfficiency}, step overhead ${e.stepOverheadMs} ms${unfused}`;
}

/** Cold and warm TTFT side by side, one row per phase, GPU phases split into matmul / attention / comm / overhead. */
export function formatLifecycleTable(report: LifecycleReport): string {
  const { cold, warm } = report;
  const mode = report.disaggregatedOver
    ? `disaggregated, KV over ${report.kvTransferParallelLinks} x ${report.disaggregatedOver}`
    : 'aggregated (prefill and decode on one worker)';
  const title = [
    `${report.modelName} on ${report.tp} x ${report.hardwareName} (tp ${report.tp}), ` +
      `prompt ${counted(report.promptTokens, 'token')}, ${mode}`,
    `cold: no cached prefix; warm: ${warm.cachedTokens}-token prefix hit, ${counted(warm.computedTokens, 'token')} computed`,
    efficiencyLine(report.efficiency),
  ];
  const rows: string[][] = [];
  const warmByPhase = new Map(warm.phases.map((p) => [p.phase, p]));
  for (const c of cold.phases) {
    const w = warmByPhase.get(c.phase);
    const wMs = w?.ms ?? 0;
    // The note of the column that spends time in the phase; cold's when neither does (a disaggregated cold path's
    // transfer and hand-over come after the first token, which warm's "same worker" would deny).
    rows.push([c.phase, fmt(c.ms), fmt(wMs), fmt(c.ms - wMs), c.ms > 0 || !(wMs > 0) ? c.detail : w!.detail]);
    const cc = c.components;
    const wc = w?.components;
    if (cc || wc) {
      const part = (label: string, f: (x: ExecutionComponents) => number) => {
        const a = cc ? f(cc) : 0;
        const b = wc ? f(wc) : 0;
        rows.push([`  ${label}`, fmt(a), fmt(b), fmt(a - b), '']);
      };
      part(`matmul (${cc?.matmulBound ?? '-'} / ${wc?.matmulBound ?? '-'})`, (x) => x.matmulMs);
      part('attention', (x) => x.attentionMs);
      // Only calibrations that model them (measured) have these; the roofline table stays as it was.
      if ((cc?.elementwiseMs ?? 0) > 0 || (wc?.elementwiseMs ?? 0) > 0) {
        part('norms, activations, layer floor', (x) => x.elementwiseMs);
      }
      part('tensor-parallel comm', (x) => x.commMs);
      part('step overhead', (x) => x.overheadMs);
    }
  }
  rows.push(['TTFT', fmt(cold.ttftMs), fmt(warm.ttftMs), fmt(cold.ttftMs - warm.ttftMs),
    `warm saves ${((1 - warm.ttftMs / cold.ttftMs) * 100).toFixed(0)}%`]);
  return `${title.join('\n')}\n\n${table(['phase', 'cold ms', 'warm ms', 'saved ms', 'note'], rows, [0, 4])}\n`;
}

/** Decode ITL and throughput against batch size, with where each step's time goes. */
export function formatDecodeSweep(sweep: DecodeSweep): string {
  const title = [
    `${sweep.modelName} on ${sweep.tp} x ${sweep.hardwareName} (tp ${sweep.tp}), decode at context ` +
      `${counted(sweep.contextLen, 'token')}; KV capacity ${counted(sweep.kvCapacityTokens, 'token')} `
      + `(${counted(sweep.kvCapacityTokens / sweep.blockSize, 'block')} of ${sweep.blockSize})`
      + (sweep.lora ? `; ${counted(sweep.lora.adapters, 'LoRA adapter')} of rank ${sweep.lora.rank} (sequence i on adapter i mod ${sweep.lora.adapters})` : ''),
    efficiencyLine(sweep.efficiency),
  ];
  const lora = sweep.lora !== undefined;
  // The elementwise column only for calibrations that model it (measured); the roofline table stays as it was.
  const unfused = sweep.rows.some((r) => r.breakdown.elementwiseMs + r.breakdown.layerOverheadMs > 0);
  const rows = sweep.rows.map((r) => {
    const b = r.breakdown;
    return [
      String(r.batch), fmt(r.itlMs), r.tokensPerSec.toFixed(0), r.tokensPerSecPerGpu.toFixed(0),
      fmt(b.matmul.timeMs), b.matmul.bound, fmt(b.decodeAttention.timeMs),
      ...(lora ? [fmt(b.lora.timeMs)] : []),
      ...(unfused ? [fmt(b.elementwiseMs + b.layerOverheadMs)] : []), fmt(b.commMs), fmt(b.overheadMs),
      r.kvFits ? 'yes' : 'no',
    ];
  });
  const header = ['batch', 'ITL ms', 'tok/s', 'tok/s/GPU', 'matmul ms', 'bound', 'KV read ms',
    ...(lora ? ['LoRA ms'] : []),
    ...(unfused ? ['elementwise ms'] : []), 'comm ms', 'overhead ms', 'KV fits'];
  return `${title.join('\n')}\n\n${table(header, rows, [])}\n`;
}
