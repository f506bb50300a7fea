// A simulated cluster for experiments: N SimWorkers on one virtual clock, fed timed arrivals through a routing
// function, advanced event by event. No wall clock, no promises: the same arrivals and routing give the same
// timings on any host, as fast as the host can compute them. The routing-quality benchmark and the capacity
// planner run on it.
//
// Events are arrivals and step ends. All events at one instant are handled together (step ends first, so a
// request arriving as a step ends is routed against the worker's state after that step), then every idle worker
// with work starts its next step at that instant. A worker runs one step at a time; a request routed to a busy
// worker joins at its next step, as in a real engine.

import type { KvHandoff } from '../engine/handoff.ts';
import { InvalidRequestError } from '../engine/errors.ts';
import type { KvEvent } from '../protocols/kv-events.ts';
import type { EngineOutput, EngineRequest, FinishReason, WorkerRole } from '../engine/types.ts';
import type { EngineStats } from '../protocols/worker.ts';
import { SimWorker, type SimStep, type SimWorkerConfig } from './sim-worker.ts';
import { distribution, type Distribution } from '../util/stats.ts';

// ---------------------------------------------------------------------------------------------------------------
// Routing

export interface RouteContext {
  nowMs: number;
  /** The workers, by index; a router may read their load, stats and cached prefixes (an oracle a real one lacks). */
  workers: readonly SimWorker[];
}

/**
 * Disaggregated placement: the prompt runs on worker `prefill`, which hands the request to worker `decode` after
 * the first token; the KV blocks the decode worker lacks cross its kvLink in the time SimWorker.planTransfer gives.
 */
export interface DisaggregatedRoute {
  prefill: number;
  decode: number;
}

/**
 * Picks the worker (index) for a request, a prefill/decode pair, or null to hold it: the caller then dispatches it
 * later with SimCluster.dispatch (a router with an admission queue does this from onOutput).
 */
export type RouteFunction = (request: EngineRequest, ctx: RouteContext) => number | DisaggregatedRoute | null;

/** Fewest unfinished requests (waiting, running, preempted); ties to the lowest index. */
export const leastLoaded: RouteFunction = (_request, { workers }) => {
  let best = 0;
  for (let i = 1; i < workers.length; i++) {
    if (workers[i]!.scheduler.numRequests < workers[best]!.scheduler.numRequests) best = i;
  }
  return best;
};

/** Worker 0, 1, 2, ... in turn, whatever their load. */
export function roundRobin(): RouteFunction {
  let next = 0;
  return (_request, { workers }) => next++ % workers.length;
}

// ---------------------------------------------------------------------------------------------------------------
// Results

export interface SimRequestResult {
  id: string;
  /** -1 if never dispatched. */
  workerIndex: number;
  arrivalMs: number;
  /** When the request reached its worker (later than arrival when the router held it). */
  dispatchMs?: number;
  firstTokenMs?: number;
  finishMs?: number;
  /** First token minus arrival at the cluster. */
  ttftMs?: number;
  /** Finish minus arrival. */
  e2eMs?: number;
  /** Gaps between consecutive tokens of each completion, in order. */
  itlMs: number[];
  /** When each output token (of every completion) was emitted, in order: one entry per token. */
  tokenTimesMs: number[];
  promptTokens: number;
  cachedTokens: number;
  completionTokens: number;
  finishReason?: FinishReason;
  /** Why the worker refused it (InvalidRequestError message). */
  error?: string;
  /** Disaggregated requests: the prefill worker, and the KV transfer to the decode worker (workerIndex). */
  prefillWorkerIndex?: number;
  kvTransferMs?: number;
  kvTransferBytes?: number;
  kvTransferBlocks?: number;
}

export interface SimWorkerSummary {
  index: number;
  steps: number;
  busyMs: number;
  stats: EngineStats;
  role: WorkerRole;
}

export interface SimClusterResult {
  requests: SimRequestResult[];
  workers: SimWorkerSummary[];
  /** Virtual time when the last event was handled. */
  endMs: number;
}

// ---------------------------------------------------------------------------------------------------------------
// Events

interface ArrivalEvent { kind: 1; timeMs: number; seq: number; request: EngineRequest }
interface StepEndEvent { kind: 0; timeMs: number; seq: number; worker: number; step: SimStep }
interface TransferEndEvent { kind: 2; timeMs: number; seq: number; handoff: KvHandoff; prefill: number; decode: number; startMs: number }
type SimEvent = ArrivalEvent | StepEndEvent | TransferEndEvent;

/** Earlier first; at one instant step ends (kind 0) before arrivals, then transfer ends; then insertion order. */
function before(a: SimEvent, b: SimEvent): boolean {
  return a.timeMs < b.timeMs || (a.timeMs === b.timeMs && (a.kind < b.kind || (a.kind === b.kind && a.seq < b.seq)));
}

/** Binary min-heap: arrivals and step ends of hundreds of workers, each in O(log n). */
class EventQueue {
  private readonly heap: SimEvent[] = [];

  get size(): number {
    return this.heap.length;
  }

  peek(): SimEvent | undefined {
    return this.heap[0];
  }

  push(event: SimEvent): void {
    const heap = this.heap;
    heap.push(event);
    let i = heap.length - 1;
    while (i > 0) {
      const parent = (i - 1) >> 1;
      if (!before(heap[i]!, heap[parent]!)) break;
      [heap[i], heap[parent]] = [heap[parent]!, heap[i]!];
      i = parent;
    }
  }

  pop(): SimEvent | undefined {
    const heap = this.heap;
    const top = heap[0];
    const last = heap.pop();
    if (heap.length > 0 && last !== undefined) {
      heap[0] = last;
      let i = 0;
      for (;;) {
        const left = 2 * i + 1;
        const right = left + 1;
        let smallest = i;
        if (left < heap.length && before(heap[left]!, heap[smallest]!)) smallest = left;
        if (right < heap.length && before(heap[right]!, heap[smallest]!)) smallest = right;
        if (smallest === i) break;
        [heap[i], heap[smallest]] = [heap[smallest]!, heap[i]!];
        i = smallest;
      }
    }
    return top;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The cluster

export interface SimClusterOptions {
  /** One config per worker (heterogeneous clusters and, later, prefill/decode roles are per-worker configs). */
  workers: readonly SimWorkerConfig[];
  route: RouteFunction;
  /** Every output, as its step ends (a router's onPrefillDone / onFinished hook). */
  onOutput?: (workerIndex: number, output: EngineOutput, nowMs: number) => void;
  /** The worker's KV events after each step (set enableKvEvents in the worker configs). */
  onKvEvents?: (workerIndex: number, events: KvEvent[], nowMs: number) => void;
  /** Virtual time the clock starts at (default 0). */
  startMs?: number;
}

export class SimCluster {
  readonly workers: readonly SimWorker[];
  private readonly options: SimClusterOptions;
  private readonly events = new EventQueue();
  private readonly records = new Map<string, SimRequestResult>();
  /** Per request: time of the previous token of each completion, for the inter-token gaps. */
  private readonly lastTokenMs = new Map<string, number[]>();
  /** Workers touched since their last step started: candidates to start one now. */
  private readonly dirty = new Set<number>();
  /** Disaggregated requests not yet adopted by their decode worker: where they run. */
  private readonly pairs = new Map<string, DisaggregatedRoute>();
  private clockMs: number;
  private nextSeq = 0;

  constructor(options: SimClusterOptions) {
    if (options.workers.length === 0) throw new RangeError('a cluster needs at least one worker');
    this.options = options;
    this.workers = options.workers.map((config) => new SimWorker(config));
    this.clockMs = options.startMs ?? 0;
  }

  get nowMs(): number {
    return this.clockMs;
  }

  /** Schedules an arrival at request.arrivalMs (now, if that is already past). */
  submit(request: EngineRequest): void {
    if (this.records.has(request.id)) throw new RangeError(`request ${request.id} was already submitted`);
    const timeMs = Math.max(request.arrivalMs, this.clockMs);
    const arrived = timeMs === request.arrivalMs ? request : { ...request, arrivalMs: timeMs };
    this.records.set(request.id, {
      id: request.id, workerIndex: -1, arrivalMs: timeMs, itlMs: [], tokenTimesMs: [], promptTokens: request.promptTokenIds.length,
      cachedTokens: 0, completionTokens: 0,
    });
    this.events.push({ kind: 1, timeMs, seq: this.nextSeq++, request: arrived });
  }

  /** Hands a request to a worker, or a prefill/decode pair, now (after a route function returned null for it). */
  dispatch(target: number | DisaggregatedRoute, request: EngineRequest): void {
    const pair = typeof target === 'number' ? undefined : target;
    const workerIndex = pair ? pair.prefill : target as number;
    const worker = this.workers[workerIndex];
    if (worker === undefined) throw new RangeError(`no worker ${workerIndex} (the cluster has ${this.workers.length})`);
    if (pair && this.workers[pair.decode] === undefined) throw new RangeError(`no worker ${pair.decode} (the cluster has ${this.workers.length})`);
    const record = this.records.get(request.id);
    if (record === undefined) throw new RangeError(`request ${request.id} was never submitted`);
    record.workerIndex = pair ? pair.decode : workerIndex;
    if (pair) record.prefillWorkerIndex = pair.prefill;
    record.dispatchMs = this.clockMs;
    try {
      worker.add(request, this.clockMs, { handoff: pair !== undefined });
      if (pair) this.pairs.set(request.id, pair);
    } catch (error) {
      if (!(error instanceof InvalidRequestError)) throw error;
      record.error = error.message;
      record.finishReason = 'error';
      record.finishMs = this.clockMs;
      return;
    }
    this.dirty.add(workerIndex);
  }

  /** Stops a request wherever it is: on its prefill worker, in transfer, or on its (decode) worker. */
  abort(requestId: string): void {
    const record = this.records.get(requestId);
    if (record === undefined || record.workerIndex < 0) return;
    const pair = this.pairs.get(requestId);
    this.pairs.delete(requestId);
    for (const index of pair ? [pair.prefill, pair.decode] : [record.workerIndex]) {
      for (const output of this.workers[index]!.abort(requestId, this.clockMs)) this.record(index, output);
      this.dirty.add(index);
    }
    // Handed off and crossing the link: neither worker holds a stream to close.
    if (pair && record.finishReason === undefined) this.record(pair.decode, abortedInTransfer(requestId, record));
  }

  /** Handles every event up to and including timeMs; the clock ends at timeMs (or later, if it already was). */
  runUntil(timeMs: number): void {
    this.startSteps();
    for (;;) {
      const next = this.events.peek();
      if (next === undefined || next.timeMs > timeMs) break;
      this.handleInstant(next.timeMs);
    }
    this.clockMs = Math.max(this.clockMs, timeMs);
  }

  /** Handles events until nothing is left: every submitted request finished, every worker idle. */
  runToCompletion(): void {
    this.startSteps();
    for (let next = this.events.peek(); next !== undefined; next = this.events.peek()) this.handleInstant(next.timeMs);
  }

  /** Submits the arrivals, runs to completion, and returns every request's timings. */
  run(arrivals: Iterable<EngineRequest>): SimClusterResult {
    for (const request of arrivals) this.submit(request);
    this.runToCompletion();
    return this.result();
  }

  result(): SimClusterResult {
    return {
      requests: [...this.records.values()],
      workers: this.workers.map((worker, index) => ({ index, steps: worker.numSteps, busyMs: worker.busyMs, stats: worker.stats(), role: worker.role })),
      endMs: this.clockMs,
    };
  }

  // -------------------------------------------------------------------------------------------------------------

  private handleInstant(timeMs: number): void {
    this.clockMs = timeMs;
    for (let event = this.events.peek(); event !== undefined && event.timeMs === timeMs; event = this.events.peek()) {
      this.events.pop();
      if (event.kind === 0) this.endStep(event);
      else if (event.kind === 1) this.arrive(event.request);
      else this.endTransfer(event);
    }
    this.startSteps();
  }

  /** The handoff's blocks have crossed the link: the decode worker takes the request (or queues it for room). */
  private endTransfer(event: TransferEndEvent): void {
    const { handoff, prefill, decode } = event;
    if (!this.pairs.has(handoff.requestId)) {
      // Aborted while in transfer.
      this.workers[prefill]!.releaseHandoff(handoff.requestId);
      return;
    }
    this.workers[decode]!.adopt(handoff, this.clockMs, event.startMs, String(prefill));
    this.takeAdopted(decode);
    this.dirty.add(decode);
  }

  /** Adoptions the decode worker completed: the prefill worker unpins, the record gets the transfer. */
  private takeAdopted(decode: number): void {
    for (const result of this.workers[decode]!.takeAdopted()) {
      const pair = this.pairs.get(result.requestId);
      this.pairs.delete(result.requestId);
      if (pair) this.workers[pair.prefill]!.releaseHandoff(result.requestId);
      const record = this.records.get(result.requestId);
      if (record && result.transfer) {
        record.kvTransferMs = result.transfer.ms;
        record.kvTransferBytes = result.transfer.bytes;
        record.kvTransferBlocks = result.transfer.blocks;
      }
    }
  }

  private arrive(request: EngineRequest): void {
    const choice = this.options.route(request, { nowMs: this.clockMs, workers: this.workers });
    if (choice !== null) this.dispatch(choice, request);
  }

  private endStep(event: StepEndEvent): void {
    const worker = this.workers[event.worker]!;
    for (const output of worker.finishStep(event.step)) this.record(event.worker, output);
    for (const handoff of worker.takeHandoffs()) {
      const pair = this.pairs.get(handoff.requestId);
      if (pair === undefined) {
        worker.releaseHandoff(handoff.requestId);
        continue;
      }
      const plan = this.workers[pair.decode]!.planTransfer(handoff);
      this.events.push({
        kind: 2, timeMs: this.clockMs + plan.ms, seq: this.nextSeq++, handoff, prefill: event.worker, decode: pair.decode,
        startMs: this.clockMs,
      });
    }
    if (this.options.onKvEvents) {
      const events = worker.takeKvEvents();
      if (events.length > 0) this.options.onKvEvents(event.worker, events, this.clockMs);
    }
    this.dirty.add(event.worker);
  }

  private startSteps(): void {
    if (this.dirty.size === 0) return;
    // In index order, so the event sequence numbers (and with them every tie) do not depend on set order.
    const indices = [...this.dirty].sort((a, b) => a - b);
    this.dirty.clear();
    for (const index of indices) {
      const worker = this.workers[index]!;
      if (worker.currentStep !== null || !worker.hasWork) continue;
      const step = worker.beginStep(this.clockMs);
      // beginStep may have taken in handoffs that waited for room.
      if (this.pairs.size > 0) this.takeAdopted(index);
      if (step !== null) this.events.push({ kind: 0, timeMs: step.endMs, seq: this.nextSeq++, worker: index, step });
    }
  }

  private record(workerIndex: number, output: EngineOutput): void {
    const record = this.records.get(output.requestId);
    if (record !== undefined) {
      const nowMs = this.clockMs;
      if (output.newTokenIds.length > 0) {
        record.firstTokenMs ??= nowMs;
        record.ttftMs ??= nowMs - record.arrivalMs;
        let last = this.lastTokenMs.get(record.id);
        if (last === undefined) this.lastTokenMs.set(record.id, last = []);
        const previous = last[output.index];
        if (previous !== undefined) record.itlMs.push(nowMs - previous);
        last[output.index] = nowMs;
        for (let i = 0; i < output.newTokenIds.length; i++) record.tokenTimesMs.push(nowMs);
      }
      record.cachedTokens = output.usage.cachedTokens;
      record.completionTokens = Math.max(record.completionTokens, output.usage.completionTokens);
      if (output.finishReason !== undefined) {
        record.finishReason = output.finishReason;
        record.finishMs = nowMs;
        record.e2eMs = nowMs - record.arrivalMs;
        if (output.error !== undefined) record.error = output.error;
        this.lastTokenMs.delete(record.id);
      }
    }
    this.options.onOutput?.(workerIndex, output, this.clockMs);
  }
}

/** The closing output of a request aborted while its KV was crossing to the decode worker. */
function abortedInTransfer(requestId: string, record: SimRequestResult): EngineOutput {
  return {
    requestId, index: 0, newTokenIds: [], textDelta: '', finishReason: 'abort',
    usage: { promptTokens: record.promptTokens, completionTokens: record.completionTokens, cachedTokens: record.cachedTokens },
    timestamps: { arrival: record.arrivalMs, prefillChunks: [] },
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Summaries

export interface RunSummary {
  /** Requests measured (finished, after the warm-up). */
  numRequests: number;
  ttftMs: Distribution;
  /** Every inter-token gap of every measured request, pooled (vLLM's ITL). */
  itlMs: Distribution;
  e2eMs: Distribution;
  /**
   * Output tokens per second in steady state: the tokens every request (warm-up included) emitted from the first
   * finish of a measured request to the last arrival, over that window's length. Before the window the cluster was
   * still filling from empty (a request's whole life had not yet passed since the measured ones began arriving);
   * after it, it drains and emits less. It comes to rate x output tokens when the workers keep up, and is what they
   * manage when they do not. NaN when the window is shorter than the measured requests' median end-to-end latency
   * (empty included): a run too short for a steady state, whose few steps would give the rate of whatever burst of
   * prefills or decodes they caught.
   */
  outputTokensPerSec: number;
  /** Prompt tokens served from the prefix cache / prompt tokens, measured requests. */
  prefixHitRate: number;
}

/**
 * Latency distributions of the finished requests. The first `warmupFraction` of them by arrival are left out: they
 * met an empty cluster, which flatters the numbers.
 */
export function summarizeRequests(requests: readonly SimRequestResult[], warmupFraction = 0): RunSummary {
  const finished = requests.filter((r) => r.firstTokenMs !== undefined && r.finishMs !== undefined)
    .sort((a, b) => a.arrivalMs - b.arrivalMs);
  const measured = finished.slice(Math.floor(finished.length * warmupFraction));
  const itl: number[] = [];
  let promptTokens = 0;
  let cachedTokens = 0;
  for (const r of measured) {
    for (const gap of r.itlMs) itl.push(gap);
    promptTokens += r.promptTokens;
    cachedTokens += r.cachedTokens;
  }
  // The steady-state window (see RunSummary.outputTokensPerSec), tokens counted in (startMs, endMs].
  let startMs = Infinity;
  for (const r of measured) startMs = Math.min(startMs, r.finishMs!);
  let endMs = -Infinity;
  for (const r of requests) endMs = Math.max(endMs, r.arrivalMs);
  const e2eMs = distribution(measured.map((r) => r.e2eMs!));
  const steady = endMs > startMs && endMs - startMs >= e2eMs.p50;
  let windowTokens = 0;
  if (steady) {
    for (const r of requests) {
      for (const t of r.tokenTimesMs) if (t > startMs && t <= endMs) windowTokens++;
    }
  }
  return {
    numRequests: measured.length,
    ttftMs: distribution(measured.map((r) => r.ttftMs!)),
    itlMs: distribution(itl),
    e2eMs,
    outputTokensPerSec: steady ? (windowTokens / (endMs - startMs)) * 1000 : NaN,
    prefixHitRate: promptTokens > 0 ? cachedTokens / promptTokens : 0,
  };
}
