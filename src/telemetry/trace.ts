// A request's timeline, assembled at its end from the lifecycle events it emitted and the engine's timestamps.
// RequestRecord accumulates while the request runs (cheap appends, nothing derived); buildRequestTrace turns it into
// an immutable RequestTrace that every consumer reads: metrics, spans, the per-response timings, the trace store,
// the SLO tracker and the analyzer. Deriving once, at the end, keeps the hot path to timestamping and lets the
// sampler decide with the whole request in view.
//
// TTFT = arrival to the first streamed write that carries a token. TBT = the gaps between consecutive such writes.
// Without streamed writes (a non-streaming response) both fall back to the engine: TTFT to the step that sampled
// the first token, TBT to the decode steps' ends, when the engine reported them.

import type {
  EngineReport, EngineStepSummary, GatewayPhase, KvOnboardFacts, LifecycleEvent, MigrationFact, PhaseName, RouterLookupEvent,
  TerminalEvent, FinishReasonName,
} from './lifecycle.ts';
// Block size assumed when the engine did not report one (Conduit's engine default).
import type { WorkerCostSummary } from '../protocols/worker.ts';
import { DEFAULT_BLOCK_SIZE as DEFAULT_KV_BLOCK_SIZE } from '../protocols/block-hash.ts';
import { GATEWAY_PHASES } from './lifecycle.ts';
import type { TraceParent } from './traceparent.ts';
import { round3 } from '../util/stats.ts';

// ---------------------------------------------------------------------------------------------------------------
// The derived trace

export type AttributeValue = string | number | boolean;

export interface PhaseInterval {
  phase: PhaseName;
  startMs: number;
  endMs: number;
  /** The phase never reported its end: the request ended inside it, and endMs is the request's end. */
  incomplete?: boolean;
  worker?: string;
  attributes?: Readonly<Record<string, AttributeValue>>;
}

export interface DecodeSummary {
  startMs: number;
  endMs: number;
  /** Decode steps after the first token. */
  steps: number;
  /**
   * Each step's duration, when known: the forward pass for 'engine_steps', the gap between writes for 'stream' (its
   * share of it when a write carried several tokens);
   * empty for 'engine_span'.
   */
  stepMs: readonly number[];
  /** Each step's start, parallel to stepMs. */
  stepStartsMs: readonly number[];
  /** Batch size (sequences) per step, parallel to stepMs; NaN where unreported. */
  batchSizes: readonly number[];
  /** Tokens computed per step by the whole batch, parallel to stepMs; NaN where unreported. */
  batchTokens: readonly number[];
  /** Where steps come from: the engine's decode_execution events, the gaps between streamed writes, or only the
   *  engine's first and last token stamps. */
  source: 'engine_steps' | 'stream' | 'engine_span';
  /** The batches of the decode steps, from the engine's per-step events or its per-request summary. */
  batch?: DecodeBatchSummary;
  /** The worker that ran the decode steps (the decode worker of a disaggregated pair). */
  worker?: string;
  incomplete?: boolean;
}

/** What the batches of a request's decode steps looked like. */
export interface DecodeBatchSummary {
  /** Steps the figures cover. */
  steps: number;
  /** Sequences per step. */
  seqsMean: number;
  seqsMin: number;
  seqsMax: number;
  /** Tokens computed per step, all sequences together (NaN when the steps did not report them). */
  tokensMean: number;
  tokensMin: number;
  tokensMax: number;
  /** The steps' forward passes summed, ms; the rest of the decode phase the request waited between steps. */
  forwardMs: number;
}

/** The router's decision: its router_lookup event's facts, over the event's interval. */
export interface RoutingSummary extends Pick<RouterLookupEvent,
  'strategy' | 'worker' | 'prefillWorker' | 'candidates' | 'overlapTokens' | 'kvCacheHit' | 'reason'
  | 'subPhasesMs' | 'costs'> {
  startMs: number;
  endMs: number;
  /** Where the request went after losing its worker mid-stream, in order (request migration). */
  migrations?: readonly MigrationFact[];
}

export interface PrefillSummary {
  startMs: number;
  /** The end of the last chunk up to the first token (chunks after it are decode's). */
  endMs: number;
  /** Chunks up to the first token. */
  chunks: number;
  /** Prompt tokens computed up to the first token (not found in the cache). */
  computedTokens: number;
  /**
   * Chunks that ran after the first token, within decode: the prompt positions each further completion of an n > 1
   * request computes for itself, forced text, tokens recomputed after a preemption. Absent when there were none.
   */
  afterFirstToken?: { chunks: number; tokens: number };
  /**
   * Time between chunks spent waiting again (preempted, or left out of full steps): the gaps of 1 ms or more
   * between consecutive chunks on one worker, traced as scheduler_queue phases and counted as queue, not prefill.
   */
  requeuedMs: number;
  batchSizeMax?: number;
  worker?: string;
}

export interface KvTransferSummary {
  startMs: number;
  endMs: number;
  bytes: number;
  blocks?: number;
  /** shm, tcp, or a simulated link (the first transfer's, when a migration made several). */
  link?: string;
  fromWorker?: string;
  toWorker?: string;
  /** Transfer time hidden behind the prefill (streamed while it ran), on top of startMs..endMs. */
  overlapMs?: number;
}

export interface EmitSummary {
  /** Every write, content or not. */
  writes: number;
  /** Writes that carried at least one token. */
  contentWrites: number;
  bytes: number;
  /** Times of the content writes, in order. */
  contentTimesMs: readonly number[];
  /** When formatting of the first content write began, if reported. */
  firstContentStartMs?: number;
}

export type Outcome = 'ok' | 'error' | 'abort';

/** The sampler's decision, carried on the trace so consumers can tell why it was kept. */
export interface SamplingDecision {
  sampled: boolean;
  reason: string;
}

export interface RequestTrace {
  requestId: string;
  /** The trace id the request's spans carry (the client's if it sent a traceparent). */
  traceId?: string;
  /** The root span's id, fixed at arrival so it can be handed out before the spans exist. */
  rootSpanId?: string;
  /** The client's span, parsed from its traceparent. */
  parent?: TraceParent;
  /** The client's tracestate, passed on unchanged (vendors' entries: Conduit adds none). */
  tracestate?: string;
  /** The head (arrival-time) sampling decision. */
  headSampling?: SamplingDecision;

  model: string;
  /** The LoRA adapter the request ran with (model is its base model). */
  adapter?: string;
  tenant?: string;
  /** The worker the router placed the request on: the decode worker of a disaggregated pair. */
  worker?: string;
  /**
   * The worker that ran the prompt: whose queue it waited in, whose prefix cache it was looked up in, which computed
   * it and sampled the first token. A disaggregated request's prefill worker (its decode worker when that prefilled
   * it), else the request's worker.
   */
  prefillWorker?: string;
  stream?: boolean;
  maxTokens?: number;
  temperature?: number;
  n?: number;

  outcome: Outcome;
  finishReason: FinishReasonName;
  errorType?: string;
  errorMessage?: string;
  status?: number;
  abortReason?: string;
  /** For error and abort: the phase the request was in when it ended. */
  endedInPhase?: PhaseName;
  rateLimited?: boolean;
  rateLimitReason?: string;

  arrivalMs: number;
  endMs: number;
  e2eMs: number;
  ttftMs?: number;
  ttftSource?: 'stream' | 'engine';
  /** Time between consecutive tokens as the client saw them (see the file comment for the fallback). */
  tbtMs: readonly number[];
  /**
   * When the first gap of tbtMs began (the first token's write, or the engine's first token for the fallback); the
   * gaps follow each other, so gap i ends at tbtFromMs + tbtMs[0] + ... + tbtMs[i]. Absent when tbtMs is empty.
   */
  tbtFromMs?: number;

  promptTokens: number;
  outputTokens: number;
  cachedTokens: number;

  /** Every phase interval, sorted by start. Decode and streaming appear once each, spanning all their steps. */
  phases: readonly PhaseInterval[];
  routing?: RoutingSummary;
  /** Sequences waiting in the worker's queue when the request joined it. */
  queueDepthAtEntry?: number;
  /** Budget allocation: from being picked to the first forward pass, and the tokens that step granted. */
  budgetMs?: number;
  budgetTokens?: number;
  /** The traceparent the engine handed back with the request's outputs: the span its facts belong under. */
  engineTraceparent?: string;
  prefill?: PrefillSummary;
  kvTransfer?: KvTransferSummary;
  /** Prompt blocks the worker(s) copied back from lower KV tiers instead of computing them (summed over workers). */
  kvOnboard?: KvOnboardFacts;
  decode?: DecodeSummary;
  emits: EmitSummary;
  engineFirstTokenMs?: number;
  engineLastTokenMs?: number;
  /** The engine's KV block size, if it reported one. */
  blockSize?: number;
}

// ---------------------------------------------------------------------------------------------------------------
// Accumulation

/**
 * One in-flight request's raw events. Token writes and decode steps, the only per-token events, go to parallel
 * number arrays instead of being kept as objects.
 */
export class RequestRecord {
  readonly events: LifecycleEvent[] = [];
  readonly emitTimes: number[] = [];
  readonly emitStarts: number[] = [];
  readonly emitTokens: number[] = [];
  emitBytes = 0;
  readonly stepStarts: number[] = [];
  readonly stepEnds: number[] = [];
  readonly stepBatch: number[] = [];
  readonly stepTokens: number[] = [];
  /** The worker of the latest decode step reported. */
  stepWorker: string | undefined;
  terminal: TerminalEvent | undefined;
  traceId: string | undefined;
  rootSpanId: string | undefined;
  parent: TraceParent | undefined;
  /** The client's traceparent header as received, passed on unchanged when Conduit is not tracing. */
  parentHeader: string | undefined;
  /** The client's tracestate header, passed on with whichever traceparent goes on. */
  tracestate: string | undefined;
  headSampling: SamplingDecision | undefined;
  /** Filled from events as they arrive, for the head sampling decision before the end. */
  model: string | undefined;
  promptTokens: number | undefined;

  constructor(readonly requestId: string, readonly firstSeenMs: number) {}

  /** Appends an event; true when it ended the request. Events after the end are ignored. */
  add(event: LifecycleEvent): boolean {
    if (this.terminal) return false;
    switch (event.phase) {
      case 'streaming_response':
        this.emitTimes.push(event.time);
        this.emitStarts.push(event.start ?? Number.NaN);
        this.emitTokens.push(event.tokens);
        this.emitBytes += event.bytes ?? 0;
        return false;
      case 'decode_execution':
        this.stepStarts.push(event.start);
        this.stepEnds.push(event.time);
        this.stepBatch.push(event.batchSize ?? Number.NaN);
        this.stepTokens.push(event.batchTokens ?? Number.NaN);
        if (event.worker !== undefined) this.stepWorker = event.worker;
        return false;
      case 'validate':
        if (event.model !== undefined) this.model = event.model;
        break;
      case 'tokenize':
        this.promptTokens = event.promptTokens;
        break;
      case 'finish':
      case 'error':
      case 'abort':
        this.terminal = event;
        if (event.model !== undefined) this.model ??= event.model;
        this.events.push(event);
        return true;
      default:
        break;
    }
    this.events.push(event);
    return false;
  }
}

/** Builds a record from a list of events (tests, replays); the collector builds records incrementally. */
export function recordFromEvents(events: readonly LifecycleEvent[], requestId?: string): RequestRecord {
  const id = requestId ?? events[0]?.requestId ?? '';
  const record = new RequestRecord(id, events[0]?.time ?? 0);
  for (const event of events) if (event.requestId === id) record.add(event);
  return record;
}

// ---------------------------------------------------------------------------------------------------------------
// Building

export interface BuildOptions {
  /** For a request still running (a preview of its timings): where the timeline ends. */
  nowMs?: number;
  /** For a request still running: the engine's latest timestamps. */
  engine?: EngineReport | readonly EngineReport[];
  /**
   * For a request still running: output tokens so far (a non-streaming response has no writes to count them from,
   * and without them its decode steps are unknown).
   */
  outputTokens?: number;
  /**
   * For a preview taken for the write about to go out (a stream's last chunk carries the timings): the output tokens
   * that write shows for the first time. It is counted as written at `nowMs`, as the finished trace will count it
   * once it went out; without it, a stream whose first token goes out in that very chunk would preview its TTFT at the
   * engine's first token and the finished trace (metrics, SLOs) at the write.
   */
  pendingWriteTokens?: number;
}

type Ev<P extends LifecycleEvent['phase']> = Extract<LifecycleEvent, { phase: P }>;

function firstOf<P extends LifecycleEvent['phase']>(events: readonly LifecycleEvent[], phase: P): Ev<P> | undefined {
  for (const e of events) if (e.phase === phase) return e as Ev<P>;
  return undefined;
}

function allOf<P extends LifecycleEvent['phase']>(events: readonly LifecycleEvent[], phase: P): Ev<P>[] {
  const out: Ev<P>[] = [];
  for (const e of events) if (e.phase === phase) out.push(e as Ev<P>);
  return out;
}

function reportsOf(engine: EngineReport | readonly EngineReport[] | undefined): readonly EngineReport[] {
  if (!engine) return [];
  return Array.isArray(engine) ? (engine as readonly EngineReport[]) : [engine as EngineReport];
}

function minDefined(values: readonly (number | undefined)[]): number | undefined {
  let m: number | undefined;
  for (const v of values) if (v !== undefined && (m === undefined || v < m)) m = v;
  return m;
}

function maxDefined(values: readonly (number | undefined)[]): number | undefined {
  let m: number | undefined;
  for (const v of values) if (v !== undefined && (m === undefined || v > m)) m = v;
  return m;
}

function defined(attrs: Record<string, AttributeValue | undefined>): Record<string, AttributeValue> {
  const out: Record<string, AttributeValue> = {};
  for (const k in attrs) {
    const v = attrs[k];
    if (v !== undefined) out[k] = v;
  }
  return out;
}

/** What every step of buildRequestTrace reads: the record, its events, and the engine's reports. */
interface BuildInput {
  record: RequestRecord;
  events: readonly LifecycleEvent[];
  terminal: TerminalEvent | undefined;
  reports: readonly EngineReport[];
  /** The worker whose queue and prefill the request went through first: the prefill side when disaggregated. */
  firstWorkerReport: EngineReport | undefined;
  router: Ev<'router_lookup'> | undefined;
  /** Phase intervals found so far; each step appends its own. */
  phases: PhaseInterval[];
}

export function buildRequestTrace(source: RequestRecord | readonly LifecycleEvent[], options: BuildOptions = {}): RequestTrace {
  const record = source instanceof RequestRecord ? source : recordFromEvents(source);
  const events = record.events;
  const reports = reportsOf(record.terminal?.engine ?? options.engine);
  const input: BuildInput = {
    record, events, terminal: record.terminal, reports,
    firstWorkerReport: reports.find((r) => r.role === 'prefill') ?? reports.find((r) => r.role !== 'decode') ?? reports[0],
    router: firstOf(events, 'router_lookup'),
    phases: [],
  };
  const { terminal, router, firstWorkerReport, phases } = input;
  const auth = firstOf(events, 'auth');
  const rateLimit = firstOf(events, 'rate_limit');
  const validate = firstOf(events, 'validate');
  const tokenize = firstOf(events, 'tokenize');

  const { arrivalMs, endMs } = timeBounds(input, options.nowMs);
  addGatewayPhases(input);
  const routing = routingOf(input);
  const queue = queueOf(input, arrivalMs, endMs);
  addHandOff(input, queue.startMs);
  const prefill = prefillOf(input);
  const kvTransfer = kvTransferOf(input);
  const pending = options.nowMs !== undefined && (options.pendingWriteTokens ?? 0) > 0
    ? { atMs: options.nowMs, tokens: options.pendingWriteTokens! } : undefined;
  const streamed = streamedWrites(record, pending);
  const { emits, contentTimes } = streamed;
  const engineFirstTokenMs = minDefined(reports.map((r) => r.timestamps.firstToken));
  const engineLastTokenMs = maxDefined(reports.map((r) => r.timestamps.lastToken));

  // Counts.
  const promptTokens = terminal?.promptTokens ?? tokenize?.promptTokens ?? record.promptTokens
    ?? (prefill ? prefill.computedTokens : 0) + (terminal?.cachedTokens ?? 0);
  const cachedTokens = terminal?.cachedTokens ?? maxDefined(reports.map((r) => r.cachedTokens)) ?? 0;
  const outputTokens = terminal?.outputTokens ?? options.outputTokens ?? streamed.contentTokens;

  const sequences = (validate?.n ?? 1) * (validate?.prompts ?? 1);
  const decode = decodeOf(input, streamed, engineFirstTokenMs, engineLastTokenMs, outputTokens, sequences, endMs);
  placeHandOver(input, kvTransfer, engineFirstTokenMs);
  addStreamingPhase(input, streamed, engineFirstTokenMs);
  addResponseBodyPhase(input, engineLastTokenMs ?? engineFirstTokenMs, decode?.endMs);
  phases.sort((a, b) => a.startMs - b.startMs || a.endMs - b.endMs);

  const { ttftMs, ttftSource, tbtMs, tbtFromMs } = latencies(record, contentTimes, engineFirstTokenMs, arrivalMs, decode, sequences);
  const ended = outcomeOf(terminal);
  const endedInPhase = ended.outcome === 'ok' ? undefined
    : phaseAtEnd(events, reports, record, router !== undefined, queue.startMs !== undefined, ended.status,
      terminal !== undefined && 'abortedAt' in terminal ? terminal.abortedAt : undefined);
  closeGatewayPhaseEndedIn(phases, endedInPhase, arrivalMs, endMs);
  const rateLimited = rateLimit && !rateLimit.allowed ? true : undefined;
  const worker = router?.worker ?? reports.find((r) => r.role === 'decode')?.worker ?? firstWorkerReport?.worker;
  const prefillWorker = firstWorkerReport?.worker ?? worker;

  return {
    requestId: record.requestId,
    traceId: record.traceId, rootSpanId: record.rootSpanId, parent: record.parent, headSampling: record.headSampling,
    ...(record.tracestate !== undefined ? { tracestate: record.tracestate } : {}),
    model: validate?.model ?? record.model ?? 'unknown',
    ...(validate?.adapter !== undefined ? { adapter: validate.adapter } : {}),
    tenant: auth?.tenant ?? rateLimit?.tenant, worker, ...(prefillWorker !== undefined ? { prefillWorker } : {}),
    stream: validate?.stream, maxTokens: validate?.maxTokens,
    temperature: validate?.temperature, n: validate?.n,
    ...ended, endedInPhase,
    rateLimited, rateLimitReason: rateLimited ? rateLimit?.reason : undefined,
    arrivalMs, endMs, e2eMs: endMs - arrivalMs,
    ttftMs, ttftSource,
    tbtMs, ...(tbtFromMs !== undefined ? { tbtFromMs } : {}),
    promptTokens, outputTokens, cachedTokens,
    phases,
    routing, queueDepthAtEntry: queue.depthAtEntry, budgetMs: queue.budgetMs, budgetTokens: queue.budgetTokens,
    engineTraceparent: reports.find((r) => r.traceparent !== undefined)?.traceparent,
    prefill, kvTransfer, ...kvOnboardOf(reports), decode,
    emits,
    engineFirstTokenMs, engineLastTokenMs, blockSize: reports.find((r) => r.blockSize !== undefined)?.blockSize,
  };
}

/** The lower-tier onboards the workers reported, summed (absent when none onboarded anything). */
function kvOnboardOf(reports: readonly EngineReport[]): { kvOnboard?: KvOnboardFacts } {
  let sum: KvOnboardFacts | undefined;
  for (const report of reports) {
    const facts = report.timestamps.kvOnboard;
    if (facts === undefined) continue;
    sum = sum === undefined ? { ...facts }
      : { ram: sum.ram + facts.ram, disk: sum.disk + facts.disk, bytes: sum.bytes + facts.bytes, ms: sum.ms + facts.ms };
  }
  return sum === undefined ? {} : { kvOnboard: sum };
}

/** Arrival (the gateway's first stamp, else the engine's, else the earliest seen) and end (the terminal event's, or
 *  for a request still running `nowMs`, else the latest seen). */
function timeBounds({ record, events, terminal, reports, firstWorkerReport }: BuildInput, nowMs: number | undefined): { arrivalMs: number; endMs: number } {
  const http = firstOf(events, 'http_receive');
  const eventTimes = events.map((e) => ('start' in e && e.start !== undefined ? e.start : e.time));
  const arrivalMs = http?.start ?? firstWorkerReport?.timestamps.arrival ?? minDefined([...eventTimes, record.emitTimes[0], record.stepStarts[0]]) ?? record.firstSeenMs;
  const lastSeen = maxDefined([
    ...events.map((e) => e.time), record.emitTimes[record.emitTimes.length - 1], record.stepEnds[record.stepEnds.length - 1],
    ...reports.map((r) => r.timestamps.finished ?? r.timestamps.lastToken),
  ]);
  return { arrivalMs, endMs: terminal?.time ?? nowMs ?? lastSeen ?? arrivalMs };
}

/** The gateway's phases, as the gateway stamped them. */
function addGatewayPhases({ events, phases }: BuildInput): void {
  for (const phase of GATEWAY_PHASES) {
    for (const e of allOf(events, phase)) {
      phases.push({ phase, startMs: e.start, endMs: e.time, attributes: gatewayAttributes(e) });
    }
  }
}

/**
 * A request that ended inside a gateway phase the gateway never stamped (a client that left while its prompt was
 * tokenized) gets that phase from the end of the gateway phases before it to its end, cut short, as decode and the
 * queue are: else its trace, the waterfall and the spans would not show where the time went.
 */
function closeGatewayPhaseEndedIn(phases: PhaseInterval[], endedIn: PhaseName | undefined, arrivalMs: number, endMs: number): void {
  if (endedIn === undefined || !(GATEWAY_PHASES as readonly string[]).includes(endedIn)) return;
  if (phases.some((p) => p.phase === endedIn)) return;
  let startMs = arrivalMs;
  for (const p of phases) if ((GATEWAY_PHASES as readonly string[]).includes(p.phase)) startMs = Math.max(startMs, p.endMs);
  if (endMs <= startMs) return;
  phases.push({ phase: endedIn, startMs, endMs, incomplete: true });
  phases.sort((a, b) => a.startMs - b.startMs || a.endMs - b.endMs);
}

/**
 * The router's cost terms for the workers it weighed, cheapest first, as one attribute value:
 * "worker-1 3.5 (overlap 4, prefill 40, decode 1); worker-0 ...". Undefined when the decision carried none.
 */
export function formatWorkerCosts(costs: readonly WorkerCostSummary[] | undefined): string | undefined {
  return costs?.map((c) => `${c.workerId} ${c.cost} (overlap ${c.overlapBlocks}, prefill ${c.prefillTokens}, ` +
    `decode ${c.decodeBlocks}${c.busy ? ', busy' : ''})`).join('; ');
}

/** The router's decision, with the migrations the engine reported. */
function routingOf({ router, reports, phases }: BuildInput): RoutingSummary | undefined {
  if (!router) return undefined;
  const routing: RoutingSummary = {
    startMs: router.start, endMs: router.time, strategy: router.strategy, worker: router.worker,
    prefillWorker: router.prefillWorker, candidates: router.candidates, overlapTokens: router.overlapTokens,
    kvCacheHit: router.kvCacheHit, reason: router.reason,
    subPhasesMs: router.subPhasesMs, costs: router.costs,
  };
  const migrations = reports.flatMap((r) => r.migrations ?? []);
  if (migrations.length > 0) routing.migrations = migrations;
  // Waiting in the router's admission queue for a worker with room is queue time, as the scheduler's queue is.
  if (router.admissionQueuedAt !== undefined && router.start > router.admissionQueuedAt) {
    phases.push({
      phase: 'scheduler_queue', startMs: router.admissionQueuedAt, endMs: router.start,
      worker: router.worker, attributes: { router_admission: true },
    });
  }
  phases.push({
    phase: 'router_lookup', startMs: router.start, endMs: router.time, worker: router.worker,
    attributes: defined({
      strategy: router.strategy, candidates: router.candidates, kv_cache_hit: router.kvCacheHit, overlap_tokens: router.overlapTokens,
      reason: router.reason, worker_costs: formatWorkerCosts(router.costs),
    }),
  });
  return routing;
}

interface QueueFacts {
  startMs?: number;
  depthAtEntry?: number;
  budgetMs?: number;
  budgetTokens?: number;
}

/** The queue: the engine's queued -> firstScheduled stamps, and the queue depth and budget the worker reported. */
function queueOf({ router, firstWorkerReport, phases }: BuildInput, arrivalMs: number, endMs: number): QueueFacts {
  const firstTimestamps = firstWorkerReport?.timestamps;
  const depthAtEntry = firstTimestamps?.queueDepthAtEntry;
  const queueStart = firstTimestamps?.queued;
  const queueEnd = firstTimestamps?.firstScheduled;
  const engineBudget = firstTimestamps?.budget;
  const budgetMs = engineBudget && queueEnd !== undefined ? Math.max(0, engineBudget.forwardStart - queueEnd) : undefined;
  const budgetTokens = engineBudget?.tokens;
  if (queueStart !== undefined || queueEnd !== undefined) {
    const start = queueStart ?? router?.time ?? arrivalMs;
    const incomplete = queueEnd === undefined;
    const attributes = defined({ queue_depth: depthAtEntry, budget_ms: budgetMs, budget_tokens: budgetTokens });
    phases.push({
      phase: 'scheduler_queue', startMs: start, endMs: queueEnd ?? endMs,
      incomplete: incomplete || undefined,
      worker: firstWorkerReport?.worker,
      attributes: Object.keys(attributes).length > 0 ? attributes : undefined,
    });
  }
  return { startMs: queueStart, depthAtEntry, budgetMs, budgetTokens };
}

/**
 * The hand-off to the worker: from the end of the gateway's phases (or of the router's decision) to the request's
 * arrival in the worker's queue, as prefill_dispatch. It holds the tenant admission after tokenize and putting the
 * request in the worker's inbox. Behind a router it has a first leg too, from the gateway to the router (the
 * tenant admission, and the engine call reaching the router: a busy event loop shows there), marked
 * `leg: 'to_router'`.
 */
function addHandOff({ router, phases, firstWorkerReport }: BuildInput, queueStartMs: number | undefined): void {
  if (queueStartMs === undefined) return;
  let gatewayEndMs: number | undefined;
  for (const p of phases) if ((GATEWAY_PHASES as readonly string[]).includes(p.phase)) gatewayEndMs = Math.max(gatewayEndMs ?? p.endMs, p.endMs);
  const worker = router?.worker ?? firstWorkerReport?.worker;
  if (router && gatewayEndMs !== undefined) {
    const routerFromMs = router.admissionQueuedAt ?? router.start;
    if (routerFromMs > gatewayEndMs) {
      phases.push({ phase: 'prefill_dispatch', startMs: gatewayEndMs, endMs: routerFromMs, worker, attributes: { leg: 'to_router' } });
    }
  }
  const fromMs = router ? Math.max(router.time, gatewayEndMs ?? router.time) : gatewayEndMs;
  if (fromMs === undefined || !(queueStartMs > fromMs)) return;
  phases.push({ phase: 'prefill_dispatch', startMs: fromMs, endMs: queueStartMs, worker });
}

/**
 * Prefill chunks, from the engine's timestamps (every worker's, for a disaggregated pair whose decode worker
 * recomputed some tokens).
 */
function prefillOf({ reports, phases }: BuildInput): PrefillSummary | undefined {
  const chunks: { start: number; end: number; tokens: number; worker?: string; batchSize?: number; batchTokens?: number; recompute?: boolean }[] = [];
  for (const r of reports) {
    for (const c of r.timestamps.prefillChunks) {
      chunks.push({
        start: c.start, end: c.end, tokens: c.tokens, worker: r.worker, batchSize: c.batchSeqs, batchTokens: c.batchTokens,
        ...(c.recompute ? { recompute: true } : {}),
      });
    }
  }
  chunks.sort((a, b) => a.start - b.start);
  let requeuedMs = 0;
  // Chunks after the first token (forced text, a fork's position, a recompute after a preemption mid-decode) are
  // decode's time, and so are the waits around them.
  const firstTokenMs = minDefined(reports.map((r) => r.timestamps.firstToken)) ?? Infinity;
  chunks.forEach((c, i) => {
    const previous = chunks[i - 1];
    if (previous && previous.worker === c.worker && c.start <= firstTokenMs && c.start - previous.end >= REQUEUE_GAP_MS) {
      requeuedMs += c.start - previous.end;
      phases.push({ phase: 'scheduler_queue', startMs: previous.end, endMs: c.start, worker: c.worker, attributes: { requeued: true } });
    }
    phases.push({
      phase: 'prefill_execution', startMs: c.start, endMs: c.end, worker: c.worker,
      attributes: defined({
        chunk: i, tokens: c.tokens, batch_size: c.batchSize, batch_tokens: c.batchTokens, recompute: c.recompute,
        after_first_token: c.start > firstTokenMs ? true : undefined,
      }),
    });
  });
  if (chunks.length === 0) return undefined;
  // The prompt's prefill ends with the last chunk up to the first token; the chunks after it ran within decode.
  let prompt = chunks.filter((c) => c.start <= firstTokenMs);
  if (prompt.length === 0) prompt = chunks;
  const later = chunks.length - prompt.length;
  return {
    startMs: prompt[0]!.start, endMs: prompt[prompt.length - 1]!.end, chunks: prompt.length,
    computedTokens: prompt.reduce((s, c) => s + c.tokens, 0), requeuedMs,
    ...(later > 0 ? { afterFirstToken: { chunks: later, tokens: chunks.slice(prompt.length).reduce((s, c) => s + c.tokens, 0) } } : {}),
    batchSizeMax: maxDefined(prompt.map((c) => c.batchSize)),
    worker: prompt[0]!.worker,
  };
}

/** A wait between two prompt chunks at least this long is queue time (a request waiting again), not prefill. */
const REQUEUE_GAP_MS = 1;

/** KV transfers (disaggregated only), as one summary of those that moved the KV (a failed one is a phase only). */
function kvTransferOf({ events, phases }: BuildInput): KvTransferSummary | undefined {
  const all = allOf(events, 'kv_transfer');
  for (const e of all) {
    phases.push({
      phase: 'kv_transfer', startMs: e.start, endMs: e.time, worker: e.toWorker,
      attributes: defined({
        bytes: e.bytes, blocks: e.blocks, link: e.link, from_worker: e.fromWorker, to_worker: e.toWorker,
        bytes_per_sec: e.time > e.start ? Math.round(e.bytes / ((e.time - e.start) / 1000)) : undefined,
        overlap_ms: e.overlapMs, hidden_share: hiddenShare(e), ...(e.failed !== undefined ? { ok: false, failed: e.failed } : {}),
      }),
    });
  }
  const transfers = all.filter((e) => e.failed === undefined);
  if (transfers.length === 0) return undefined;
  return {
    startMs: Math.min(...transfers.map((e) => e.start)), endMs: Math.max(...transfers.map((e) => e.time)),
    bytes: transfers.reduce((s, e) => s + e.bytes, 0),
    blocks: sumDefined(transfers.map((e) => e.blocks)), fromWorker: transfers[0]!.fromWorker, toWorker: transfers[0]!.toWorker,
    ...(transfers[0]!.link !== undefined ? { link: transfers[0]!.link } : {}),
    ...(transfers[0]!.overlapMs !== undefined ? { overlapMs: transfers[0]!.overlapMs } : {}),
  };
}

/** Share of a streamed transfer hidden behind the prefill: overlap / (overlap + what came after); rounded to 0.001. */
function hiddenShare(e: { start: number; time: number; overlapMs?: number }): number | undefined {
  if (e.overlapMs === undefined) return undefined;
  const total = e.overlapMs + Math.max(0, e.time - e.start);
  return total > 0 ? Math.round((e.overlapMs / total) * 1000) / 1000 : 0;
}

/**
 * A disaggregated request's hand-over, after the first token (the prefill worker samples and streams it): from that
 * token to the transfer's start the prefill worker hands the request over and the decode worker takes it
 * (decode_dispatch), then the KV moves (kv_transfer), then the decode worker decodes (decode_execution, from the
 * transfer's end). Without this the decode phase would start at the first token and hold the transfer inside it.
 */
function placeHandOver({ phases }: BuildInput, kvTransfer: KvTransferSummary | undefined, firstTokenMs: number | undefined): void {
  if (!kvTransfer) {
    placeFailedHandOver(phases, firstTokenMs);
    return;
  }
  if (firstTokenMs === undefined || kvTransfer.startMs < firstTokenMs) return;
  const decode = phases.find((p) => p.phase === 'decode_execution');
  if (decode && decode.startMs < kvTransfer.endMs && kvTransfer.endMs <= decode.endMs) decode.startMs = kvTransfer.endMs;
  if (!(kvTransfer.startMs > firstTokenMs)) return;
  phases.push({
    phase: 'decode_dispatch', startMs: firstTokenMs, endMs: kvTransfer.startMs, worker: kvTransfer.toWorker,
    attributes: defined({ from_worker: kvTransfer.fromWorker, to_worker: kvTransfer.toWorker }),
  });
}

/**
 * A hand-over whose KV never arrived (kv_transfer failed): the decode worker computed the prompt again. From the first
 * token to that recompute the request was being handed over and its transfer tried (decode_dispatch); the recompute
 * is its prefill on the decode worker, and decode starts after it.
 */
function placeFailedHandOver(phases: PhaseInterval[], firstTokenMs: number | undefined): void {
  const failed = phases.find((p) => p.phase === 'kv_transfer' && p.attributes?.ok === false);
  if (!failed || firstTokenMs === undefined || failed.worker === undefined) return;
  const recompute = phases.filter((p) => p.phase === 'prefill_execution' && p.worker === failed.worker && p.startMs > firstTokenMs);
  if (recompute.length === 0) return;
  const recomputeEndMs = Math.max(...recompute.map((p) => p.endMs));
  const decode = phases.find((p) => p.phase === 'decode_execution');
  if (decode && decode.startMs < recomputeEndMs && recomputeEndMs <= decode.endMs) decode.startMs = recomputeEndMs;
  phases.push({
    phase: 'decode_dispatch', startMs: firstTokenMs, endMs: Math.min(...recompute.map((p) => p.startMs)), worker: failed.worker,
    attributes: defined({ from_worker: failed.attributes?.from_worker, to_worker: failed.worker, transfer_failed: true }),
  });
}

interface StreamedWrites {
  emits: EmitSummary;
  /** Times of the writes that carried tokens. */
  contentTimes: number[];
  firstContentStartMs: number | undefined;
  /** Tokens those writes carried. */
  contentTokens: number;
  /** Tokens each of those writes carried (parallel to contentTimes). */
  contentTokensPerWrite: number[];
}

/**
 * The streamed writes, and among them those that carried tokens; `pending`: a write being prepared (a preview's),
 * counted as made at its time.
 */
function streamedWrites(record: RequestRecord, pending?: { atMs: number; tokens: number }): StreamedWrites {
  const contentTimes: number[] = [];
  const contentTokensPerWrite: number[] = [];
  let firstContentStartMs: number | undefined;
  let contentTokens = 0;
  for (let i = 0; i < record.emitTimes.length; i++) {
    if (record.emitTokens[i]! <= 0) continue;
    if (contentTimes.length === 0 && !Number.isNaN(record.emitStarts[i]!)) firstContentStartMs = record.emitStarts[i]!;
    contentTimes.push(record.emitTimes[i]!);
    contentTokensPerWrite.push(record.emitTokens[i]!);
    contentTokens += record.emitTokens[i]!;
  }
  if (pending) {
    if (contentTimes.length === 0) firstContentStartMs = pending.atMs;
    contentTimes.push(pending.atMs);
    contentTokensPerWrite.push(pending.tokens);
    contentTokens += pending.tokens;
  }
  const emits: EmitSummary = {
    writes: record.emitTimes.length + (pending ? 1 : 0), contentWrites: contentTimes.length, bytes: record.emitBytes, contentTimesMs: contentTimes,
    firstContentStartMs,
  };
  return { emits, contentTimes, firstContentStartMs, contentTokens, contentTokensPerWrite };
}

/** Decode, from the engine's steps, the streamed gaps or its first and last token, on the worker that ran it. */
function decodeOf(
  { record, terminal, reports, router, firstWorkerReport, phases }: BuildInput, { contentTimes, contentTokensPerWrite }: StreamedWrites,
  engineFirstTokenMs: number | undefined, engineLastTokenMs: number | undefined, outputTokens: number, sequences: number, endMs: number,
): DecodeSummary | undefined {
  const engineSteps = mergeStepSummaries(reports);
  // Engine requests of one call (several prompts) decode side by side: their steps are the longest one's.
  const engineStepCount = maxDefined(reports.map((r) => r.timestamps.decodeSteps?.steps));
  const decoded = buildDecode(record, contentTimes, contentTokensPerWrite, engineFirstTokenMs, engineLastTokenMs, outputTokens, sequences,
    terminal, endMs, engineSteps, engineStepCount);
  const decodeWorker = record.stepWorker ?? reports.find((r) => r.role === 'decode')?.worker ?? router?.worker ?? firstWorkerReport?.worker;
  const decode = decoded && decodeWorker !== undefined ? { ...decoded, worker: decodeWorker } : decoded;
  if (decode) {
    const batch = decode.batch;
    phases.push({
      phase: 'decode_execution', startMs: decode.startMs, endMs: decode.endMs, incomplete: decode.incomplete, worker: decode.worker,
      attributes: defined({
        steps: decode.steps, source: decode.source,
        batch_size_mean: batch ? round3(batch.seqsMean) : undefined, batch_size_max: batch?.seqsMax,
        batch_tokens_mean: batch && Number.isFinite(batch.tokensMean) ? round3(batch.tokensMean) : undefined,
      }),
    });
  }
  return decode;
}

/**
 * One streaming_response phase over every write: from the first token (the engine's, carried to the gateway) or the
 * first write if earlier, to the last write, or to the end of a response that finished (its last byte).
 */
function addStreamingPhase({ record, terminal, phases }: BuildInput, { emits, contentTimes, firstContentStartMs }: StreamedWrites,
  engineFirstTokenMs: number | undefined): void {
  if (record.emitTimes.length === 0) return;
  const first = firstContentStartMs ?? contentTimes[0] ?? record.emitTimes[0]!;
  const startMs = Math.min(first, record.emitTimes[0]!, engineFirstTokenMs ?? Infinity);
  const lastWriteMs = record.emitTimes[record.emitTimes.length - 1]!;
  phases.push({
    phase: 'streaming_response', startMs,
    endMs: terminal?.phase === 'finish' ? Math.max(lastWriteMs, terminal.time) : lastWriteMs,
    attributes: { writes: emits.writes, content_writes: emits.contentWrites },
  });
}

/**
 * A response not streamed is written once, after its last token: that write (building the body, sending it) is the
 * request's streaming_response phase, from the last token to the end, so that no time after the engine is left out.
 */
function addResponseBodyPhase({ record, terminal, phases }: BuildInput, lastTokenMs: number | undefined, decodeEndMs: number | undefined): void {
  if (record.emitTimes.length > 0 || terminal?.phase !== 'finish' || lastTokenMs === undefined) return;
  const startMs = Math.max(lastTokenMs, decodeEndMs ?? lastTokenMs);
  if (terminal.time <= startMs) return;
  phases.push({ phase: 'streaming_response', startMs, endMs: terminal.time, attributes: { writes: 1, body: true } });
}

/** TTFT and TBT as the client saw them, else as the engine stamped them (see the file comment). */
function latencies(
  record: RequestRecord, contentTimes: readonly number[], engineFirstTokenMs: number | undefined, arrivalMs: number,
  decode: DecodeSummary | undefined, sequences: number,
): { ttftMs?: number; ttftSource?: 'stream' | 'engine'; tbtMs: readonly number[]; tbtFromMs?: number } {
  let ttftMs: number | undefined;
  let ttftSource: 'stream' | 'engine' | undefined;
  if (contentTimes.length > 0) {
    ttftMs = contentTimes[0]! - arrivalMs;
    ttftSource = 'stream';
  } else if (engineFirstTokenMs !== undefined) {
    ttftMs = engineFirstTokenMs - arrivalMs;
    ttftSource = 'engine';
  }
  // Without engine steps the decode steps are the streamed gaps: share the array rather than compute it twice. With
  // several sequences in one stream the gaps between writes are not any sequence's: the engine's steps, if traced.
  if (contentTimes.length > 1 && sequences === 1) {
    // The client's gaps: a write of several tokens is one gap (the stream's steps split it).
    const oneTokenPerWrite = decode?.source === 'stream' && decode.stepMs.length === contentTimes.length - 1;
    return { ttftMs, ttftSource, tbtMs: oneTokenPerWrite ? decode.stepMs : gaps(contentTimes), tbtFromMs: contentTimes[0]! };
  }
  if (record.stepEnds.length > 0 && engineFirstTokenMs !== undefined) {
    return { ttftMs, ttftSource, tbtMs: gaps([engineFirstTokenMs, ...record.stepEnds]), tbtFromMs: engineFirstTokenMs };
  }
  return { ttftMs, ttftSource, tbtMs: [] };
}

/** How the request ended, from its terminal event (none yet: ok so far). */
function outcomeOf(terminal: TerminalEvent | undefined): Pick<RequestTrace, 'outcome' | 'finishReason' | 'errorType' | 'errorMessage' | 'status' | 'abortReason'> {
  const status = terminal?.phase === 'finish' || terminal?.phase === 'error' ? terminal.status : undefined;
  if (terminal?.phase === 'finish') {
    const finishReason = terminal.finishReason;
    const outcome: Outcome = finishReason === 'error' ? 'error' : finishReason === 'abort' ? 'abort' : 'ok';
    return { outcome, finishReason, errorType: undefined, errorMessage: undefined, status, abortReason: undefined };
  }
  if (terminal?.phase === 'error') {
    return { outcome: 'error', finishReason: 'error', errorType: terminal.errorType, errorMessage: terminal.message, status, abortReason: undefined };
  }
  if (terminal?.phase === 'abort') {
    return { outcome: 'abort', finishReason: 'abort', errorType: undefined, errorMessage: undefined, status, abortReason: terminal.reason };
  }
  return { outcome: 'ok', finishReason: 'stop', errorType: undefined, errorMessage: undefined, status, abortReason: undefined };
}

function buildDecode(
  record: RequestRecord, contentTimes: readonly number[], tokensPerWrite: readonly number[], engineFirst: number | undefined, engineLast: number | undefined,
  outputTokens: number, sequences: number, terminal: TerminalEvent | undefined, endMs: number, engineSteps: EngineStepSummary | undefined,
  engineStepCount: number | undefined,
): DecodeSummary | undefined {
  const endedEarly = terminal !== undefined && terminal.phase !== 'finish';
  const summarised = engineSteps ? batchFromSummary(engineSteps) : undefined;
  if (record.stepEnds.length > 0) {
    const stepMs = record.stepEnds.map((end, i) => end - record.stepStarts[i]!);
    return {
      startMs: engineFirst ?? record.stepStarts[0]!, endMs: record.stepEnds[record.stepEnds.length - 1]!,
      steps: stepMs.length, stepMs, stepStartsMs: [...record.stepStarts], batchSizes: [...record.stepBatch],
      batchTokens: [...record.stepTokens], source: 'engine_steps',
      batch: batchFromSteps(stepMs, record.stepBatch, record.stepTokens) ?? summarised,
      ...(endedEarly ? { incomplete: true } : {}),
    };
  }
  // The streamed gaps are steps only for one sequence: a step advancing several writes one chunk for each. A write
  // that carries k tokens (--stream-interval, or a character whose bytes came in k tokens) ends k steps, which share
  // its gap evenly.
  if (contentTimes.length > 1 && sequences === 1) {
    const { stepMs, stepStartsMs } = stepsOfWrites(contentTimes, tokensPerWrite);
    const unreported = stepMs.map(() => Number.NaN);
    return {
      startMs: engineFirst ?? contentTimes[0]!, endMs: engineLast !== undefined && engineLast > (engineFirst ?? -Infinity) ? engineLast : contentTimes[contentTimes.length - 1]!,
      steps: stepMs.length, stepMs, stepStartsMs, batchSizes: unreported, batchTokens: unreported, source: 'stream',
      ...(summarised ? { batch: summarised } : {}), ...(endedEarly ? { incomplete: true } : {}),
    };
  }
  if (engineFirst !== undefined) {
    const perCompletion = Math.ceil(outputTokens / Math.max(1, sequences));
    // The engine counted its decode steps; without its summary they are inferred from the output length.
    const steps = engineStepCount ?? Math.max(0, perCompletion - 1);
    const last = engineLast ?? engineFirst;
    if (steps === 0 && !(endedEarly && endMs > engineFirst)) return undefined;
    const span = {
      startMs: engineFirst, steps, stepMs: [], stepStartsMs: [], batchSizes: [], batchTokens: [], source: 'engine_span' as const,
      ...(summarised ? { batch: summarised } : {}),
    };
    if (endedEarly) return { ...span, endMs: Math.max(last, endMs), incomplete: true };
    return { ...span, endMs: last };
  }
  return undefined;
}

/** The decode steps a stream's content writes stand for: after the first write, k steps of gap / k for a write of k tokens. */
function stepsOfWrites(times: readonly number[], tokensPerWrite: readonly number[]): { stepMs: number[]; stepStartsMs: number[] } {
  const stepMs: number[] = [];
  const stepStartsMs: number[] = [];
  for (let i = 1; i < times.length; i++) {
    const k = Math.max(1, tokensPerWrite[i] ?? 1);
    const each = (times[i]! - times[i - 1]!) / k;
    for (let j = 0; j < k; j++) {
      stepMs.push(each);
      stepStartsMs.push(times[i - 1]! + j * each);
    }
  }
  return { stepMs, stepStartsMs };
}

/**
 * The engine's step summaries of every engine request of the call (its prompts, or a disaggregated pair's decode
 * side), as one: the batch figures over all their steps.
 */
function mergeStepSummaries(reports: readonly EngineReport[]): EngineStepSummary | undefined {
  let merged: EngineStepSummary | undefined;
  for (const r of reports) {
    const s = r.timestamps.decodeSteps;
    if (!s || s.steps <= 0) continue;
    if (!merged) {
      merged = { ...s };
      continue;
    }
    merged.steps += s.steps;
    merged.forwardMs += s.forwardMs;
    merged.batchSeqsSum += s.batchSeqsSum;
    merged.batchSeqsMin = Math.min(merged.batchSeqsMin, s.batchSeqsMin);
    merged.batchSeqsMax = Math.max(merged.batchSeqsMax, s.batchSeqsMax);
    merged.batchTokensSum += s.batchTokensSum;
    merged.batchTokensMin = Math.min(merged.batchTokensMin, s.batchTokensMin);
    merged.batchTokensMax = Math.max(merged.batchTokensMax, s.batchTokensMax);
  }
  return merged;
}

function batchFromSummary(s: EngineStepSummary): DecodeBatchSummary {
  return {
    steps: s.steps, seqsMean: s.batchSeqsSum / s.steps, seqsMin: s.batchSeqsMin, seqsMax: s.batchSeqsMax,
    tokensMean: s.batchTokensSum / s.steps, tokensMin: s.batchTokensMin, tokensMax: s.batchTokensMax, forwardMs: s.forwardMs,
  };
}

/** The same figures from per-step events, over the steps that reported a batch. */
function batchFromSteps(stepMs: readonly number[], seqs: readonly number[], tokens: readonly number[]): DecodeBatchSummary | undefined {
  let steps = 0;
  let forwardMs = 0;
  let seqsSum = 0;
  let seqsMin = Infinity;
  let seqsMax = -Infinity;
  let tokensSteps = 0;
  let tokensSum = 0;
  let tokensMin = Number.NaN;
  let tokensMax = Number.NaN;
  for (let i = 0; i < seqs.length; i++) {
    const b = seqs[i]!;
    if (Number.isNaN(b)) continue;
    steps++;
    forwardMs += stepMs[i]!;
    seqsSum += b;
    if (b < seqsMin) seqsMin = b;
    if (b > seqsMax) seqsMax = b;
    const t = tokens[i]!;
    if (Number.isNaN(t)) continue;
    tokensSteps++;
    tokensSum += t;
    if (!(t >= tokensMin)) tokensMin = t;
    if (!(t <= tokensMax)) tokensMax = t;
  }
  if (steps === 0) return undefined;
  return {
    steps, seqsMean: seqsSum / steps, seqsMin, seqsMax, forwardMs,
    tokensMean: tokensSteps > 0 ? tokensSum / tokensSteps : Number.NaN, tokensMin, tokensMax,
  };
}

/**
 * The phase a failed or aborted request was in when it ended. `abortedAt`: when its run was cut short (the abort or error event's);
 * only what had happened by then counts, so a client that left while the prompt's last step ran (its first token
 * sampled after that) ended in prefill, and one that left while queued, in the queue.
 */
function phaseAtEnd(
  events: readonly LifecycleEvent[], reports: readonly EngineReport[], record: RequestRecord, routed: boolean, queued: boolean,
  status: number | undefined, abortedAt?: number,
): PhaseName {
  const ts = reports.map((r) => r.timestamps);
  const by = (time: number | undefined): boolean => time !== undefined && (abortedAt === undefined || time <= abortedAt);
  if (record.emitTimes.some(by) || record.stepStarts.some(by) || ts.some((t) => by(t.firstToken))) return 'decode_execution';
  if (ts.some((t) => by(t.firstScheduled) || t.prefillChunks.some((c) => by(c.start)))) return 'prefill_execution';
  if (queued) return 'scheduler_queue';
  if (routed) return 'scheduler_queue';
  // Before the router: the gateway phase that refused it, or the one after the last that passed; a client error
  // after them all (the prompt's length, checked once it is tokenized) ends in the last.
  let next: GatewayPhase | 'router_lookup' = 'http_receive';
  let last: GatewayPhase | undefined;
  for (const phase of GATEWAY_PHASES) {
    const e = firstOf(events, phase);
    if (!e) break;
    if (('ok' in e && e.ok === false) || ('allowed' in e && e.allowed === false)) return phase;
    last = phase;
    const i = GATEWAY_PHASES.indexOf(phase);
    next = i + 1 < GATEWAY_PHASES.length ? GATEWAY_PHASES[i + 1]! : 'router_lookup';
  }
  if (next === 'router_lookup' && last !== undefined && status !== undefined && status >= 400 && status < 500) return last;
  return next;
}

function gatewayAttributes(e: LifecycleEvent): Record<string, AttributeValue> | undefined {
  switch (e.phase) {
    case 'http_receive': return defined({ route: e.route, body_bytes: e.bodyBytes, ...(e.ok === false ? { ok: false } : {}) });
    case 'auth': return defined({ ok: e.ok, tenant: e.tenant });
    case 'rate_limit': return defined({ allowed: e.allowed, reason: e.reason });
    case 'validate': return defined({ ok: e.ok });
    case 'tokenize': return { prompt_tokens: e.promptTokens };
    default: return undefined;
  }
}

function gaps(times: readonly number[]): number[] {
  const out: number[] = [];
  for (let i = 1; i < times.length; i++) out.push(times[i]! - times[i - 1]!);
  return out;
}

function sumDefined(values: readonly (number | undefined)[]): number | undefined {
  let s: number | undefined;
  for (const v of values) if (v !== undefined) s = (s ?? 0) + v;
  return s;
}

// ---------------------------------------------------------------------------------------------------------------
// Phase totals

/** Milliseconds per part of a request, the figures the timings object, the analyzer and the metrics share. */
export interface PhaseBreakdown {
  /**
   * Time covered by the gateway phases (http_receive .. tokenize): their union, since the gateway checks the key
   * and the request rate before it reads the body, inside http_receive.
   */
  gatewayMs: number;
  /** The router's decision and the hand-off to the worker (prefill_dispatch). */
  routingMs: number;
  /** The scheduler_queue phases, and the budget allocation after the first (up to the first forward pass). */
  queueMs: number;
  /**
   * First prefill chunk's start to the first token (the last chunk's end, carried to the client), less the waits
   * between chunks (requeued: they are queue time); 0 when prefill was skipped.
   */
  prefillMs: number;
  /** The KV transfer's time before the first token (part of TTFT). */
  kvTransferMs: number;
  /**
   * The KV transfer's time after the first token: Conduit's prefill worker streams the first token, so the transfer
   * and the hand-over around it are the start of decode (part of decodeMs).
   */
  decodeKvTransferMs: number;
  /** The first token (as TTFT counts it) to the end of the response; without a first token, the engine's decode. */
  decodeMs: number;
  ttftMs: number;
  totalMs: number;
}

export function phaseBreakdown(trace: RequestTrace): PhaseBreakdown {
  let gatewayMs = 0;
  let gatewayCoveredTo = -Infinity;
  let queueMs = 0;
  let dispatchMs = 0;
  // Phases are sorted by start, so each gateway phase adds only what reaches past those before it.
  for (const p of trace.phases) {
    if ((GATEWAY_PHASES as readonly string[]).includes(p.phase)) {
      gatewayMs += Math.max(0, p.endMs - Math.max(p.startMs, gatewayCoveredTo));
      gatewayCoveredTo = Math.max(gatewayCoveredTo, p.endMs);
    } else if (p.phase === 'scheduler_queue') queueMs += p.endMs - p.startMs;
    else if (p.phase === 'prefill_dispatch') dispatchMs += p.endMs - p.startMs;
  }
  // The first token as the client got it: TTFT ends there, prefill runs up to it and decode from it.
  const firstTokenMs = trace.ttftMs !== undefined ? trace.arrivalMs + trace.ttftMs : undefined;
  const { prefill, decode } = trace;
  let prefillMs = 0;
  if (prefill) {
    // Up to the first token: chunks after it (a recompute after a preemption mid-decode) are decode's time.
    const prefillEndMs = firstTokenMs ?? prefill.endMs;
    prefillMs = Math.max(0, prefillEndMs - prefill.startMs - prefill.requeuedMs);
  }
  let decodeMs = decode ? decode.endMs - decode.startMs : 0;
  if (firstTokenMs !== undefined && trace.outcome === 'ok') decodeMs = Math.max(0, trace.endMs - firstTokenMs);
  else if (firstTokenMs !== undefined && decode) decodeMs = Math.max(0, decode.endMs - firstTokenMs);
  // The budget allocation (picked, then planned into a step) is still waiting for the first forward pass.
  if (queueMs > 0 && trace.budgetMs !== undefined) queueMs += trace.budgetMs;
  return {
    gatewayMs,
    routingMs: (trace.routing ? trace.routing.endMs - trace.routing.startMs : 0) + dispatchMs,
    queueMs,
    prefillMs,
    ...kvTransferParts(trace, firstTokenMs),
    decodeMs,
    ttftMs: trace.ttftMs ?? 0,
    totalMs: trace.e2eMs,
  };
}

/** The KV transfer split at the first token: before it (TTFT's) and after it (decode's). */
function kvTransferParts(trace: RequestTrace, firstTokenMs: number | undefined): { kvTransferMs: number; decodeKvTransferMs: number } {
  const kv = trace.kvTransfer;
  if (!kv) return { kvTransferMs: 0, decodeKvTransferMs: 0 };
  // Begun after the engine's first token: all of it is decode's, even the part before the client got that token.
  if (trace.engineFirstTokenMs !== undefined && kv.startMs >= trace.engineFirstTokenMs) return { kvTransferMs: 0, decodeKvTransferMs: kv.endMs - kv.startMs };
  const split = Math.min(Math.max(firstTokenMs ?? kv.endMs, kv.startMs), kv.endMs);
  return { kvTransferMs: split - kv.startMs, decodeKvTransferMs: kv.endMs - split };
}

/**
 * Whether prefill was skipped: the prompt came from the prefix cache (or by KV transfer) and the worker computed at
 * most the prompt's last block. An engine always recomputes at least the last prompt token to sample from, and a
 * cache holds whole blocks only, so a complete hit still computes up to one block's worth of tokens.
 */
export function prefillSkipped(trace: RequestTrace): boolean {
  if (!trace.prefill) return trace.engineFirstTokenMs !== undefined;
  const blockSize = trace.blockSize ?? DEFAULT_KV_BLOCK_SIZE;
  return trace.cachedTokens > 0 && trace.prefill.computedTokens <= blockSize && trace.prefill.computedTokens < trace.promptTokens;
}
