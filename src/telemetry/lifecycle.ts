// Lifecycle events: one per phase boundary of a request, named as in docs/architecture.md, published on a small typed
// bus. The gateway, router and engine shells emit; the trace collector (and through it the metrics and span
// adapters) subscribes. Emitters only stamp times: nothing here formats, aggregates or exports, so a publisher pays
// a property read when nobody listens and one function call per listener when somebody does.
//
// Times are the engine clock: epoch milliseconds with a fractional part (src/engine/clock.ts), so stamps taken in
// the gateway thread and in worker threads line up.

import type { StepBatchSummary, WorkerCostSummary } from '../protocols/worker.ts';

// ---------------------------------------------------------------------------------------------------------------
// Phase names

/** Phases before the router, in the order the gateway runs them. */
export const GATEWAY_PHASES = ['http_receive', 'auth', 'rate_limit', 'validate', 'tokenize'] as const;

/** Every phase of a request's path, in path order (docs/architecture.md, "Request path and phase names"). */
export const PHASES = [
  ...GATEWAY_PHASES,
  'router_lookup', 'scheduler_queue',
  'prefill_dispatch', 'prefill_execution',
  // Disaggregated only: the hand-over to the decode worker after the first token, then the KV transfer.
  'decode_dispatch', 'kv_transfer',
  'decode_execution',
  'streaming_response',
] as const;

export type GatewayPhase = (typeof GATEWAY_PHASES)[number];
export type PhaseName = (typeof PHASES)[number];

/** Events that end a request; after one of them the request's later events are ignored. */
export const TERMINAL_EVENTS = ['finish', 'error', 'abort'] as const;
export type TerminalEventName = (typeof TERMINAL_EVENTS)[number];

export type LifecycleEventName = LifecycleEvent['phase'];

// ---------------------------------------------------------------------------------------------------------------
// Engine timestamps
//
// The engine reports its side of a request as RequestTimestamps on every EngineOutput (src/engine/types.ts). The
// telemetry layer imports nothing (docs/architecture.md), so it states the shape it reads; the engine's type is
// assignable to it (test/telemetry/contracts.test.ts checks that at compile time).

export interface EngineTimestamps {
  /** When the request reached the gateway (the gateway's stamp, carried into the engine). */
  arrival: number;
  /** When the worker's scheduler enqueued it. */
  queued?: number;
  /** When it first got a place in a step's batch. */
  firstScheduled?: number;
  /**
   * One entry per prefill chunk the worker computed (a prefix-cache hit shortens or removes them): its forward pass,
   * and the batch of its step (sequences, and tokens computed by all of them).
   */
  prefillChunks: readonly { start: number; end: number; tokens: number; batchSeqs?: number; batchTokens?: number; recompute?: boolean }[];
  /** End of the step that sampled the first output token. */
  firstToken?: number;
  /** End of the step that sampled the latest output token. */
  lastToken?: number;
  finished?: number;
  /** Sequences already waiting in the worker's queue when the request joined it. */
  queueDepthAtEntry?: number;
  /** The first step that scheduled the request: tokens granted, and when its forward began (end of budget allocation). */
  budget?: { tokens: number; forwardStart: number };
  /** The decode steps (after the first token) the request took part in, summarised by the engine. */
  decodeSteps?: EngineStepSummary;
  /** Prompt blocks copied back from the worker's lower KV tiers (RAM, disk) instead of computed, and the copy's ms. */
  kvOnboard?: KvOnboardFacts;
}

export interface KvOnboardFacts {
  ram: number;
  disk: number;
  bytes: number;
  ms: number;
}

/** Counts, sums and extremes of a request's decode steps: what telemetry reads of the engine's summary. */
export type EngineStepSummary = Omit<StepBatchSummary, 'lastStepId'>;

/** What one worker reports about its part of a request, carried on the terminal event. */
export interface EngineReport {
  worker?: string;
  /** 'unified' (prefill and decode on one worker, the default), or one side of a disaggregated pair. */
  role?: 'unified' | 'prefill' | 'decode';
  timestamps: EngineTimestamps;
  /** Prompt tokens this worker found in its prefix cache. */
  cachedTokens?: number;
  /** The worker's KV block size (EngineInfo.blockSize): how many tokens a full prefix hit still recomputes at most. */
  blockSize?: number;
  /**
   * The traceparent the worker was given with the request and handed back on its outputs: the span its part of the
   * request belongs under. A plain string, so it crosses threads and processes as is.
   */
  traceparent?: string;
  /** The workers the request moved between after losing one mid-stream (request migration), in order. */
  migrations?: readonly MigrationFact[];
}

/** One request migration: the worker lost, the one that took over (unset if none did), and when. */
export interface MigrationFact {
  fromWorker: string;
  toWorker?: string;
  /** Tokens the caller had received when the worker was lost. */
  afterTokens: number;
  reason: string;
}

// ---------------------------------------------------------------------------------------------------------------
// Events

interface PointEvent {
  requestId: string;
  /** Engine-clock ms: when the phase ended, or when the instant happened. */
  time: number;
}

interface IntervalEvent extends PointEvent {
  /** Engine-clock ms when the phase began. */
  start: number;
}

export interface HttpReceiveEvent extends IntervalEvent {
  phase: 'http_receive';
  /** start = the request's arrival: TTFT and end-to-end time are measured from it. */
  route?: string;
  bodyBytes?: number;
  /** The client's W3C traceparent header, if any: the request's trace continues the client's. */
  traceparent?: string;
  /** The client's W3C tracestate header, passed on with the request's trace context (only with a traceparent). */
  tracestate?: string;
  /**
   * false: the body was not received (too large, or the client left while sending it), so the request ended in
   * http_receive. Unset when the body came, or when a later check refused the request before it was read.
   */
  ok?: boolean;
}

export interface AuthEvent extends IntervalEvent {
  phase: 'auth';
  ok: boolean;
  tenant?: string;
}

export interface RateLimitEvent extends IntervalEvent {
  phase: 'rate_limit';
  allowed: boolean;
  tenant?: string;
  /** Why it was refused: 'requests', 'tokens', 'concurrency', ... */
  reason?: string;
}

export interface ValidateEvent extends IntervalEvent {
  phase: 'validate';
  ok: boolean;
  model?: string;
  /** The LoRA adapter the request names as its model (model is then the adapter's base model). */
  adapter?: string;
  stream?: boolean;
  maxTokens?: number;
  temperature?: number;
  n?: number;
  /** Prompts of a completions request that sends several (absent: one). */
  prompts?: number;
}

export interface TokenizeEvent extends IntervalEvent {
  phase: 'tokenize';
  /** Prompt length after the chat template: known before any engine work, so it feeds the sampling decision. */
  promptTokens: number;
}

/** The router's own costs, the parts of router_lookup. */
export interface RouterSubPhasesMs {
  /** Hashing the prompt's blocks. */
  hashing?: number;
  /** Finding each worker's overlap in the KV block index. */
  indexLookup?: number;
  /** Scoring workers and choosing one. */
  selection?: number;
}

export interface RouterLookupEvent extends IntervalEvent {
  phase: 'router_lookup';
  /** When the request entered the router's admission queue, if it waited there for a worker with room. */
  admissionQueuedAt?: number;
  /** The worker that runs the request (the decode worker when disaggregated). */
  worker: string;
  /** 'kv_aware', 'round_robin', 'least_loaded', ... */
  strategy: string;
  /** The prefill worker when prefill and decode are disaggregated. */
  prefillWorker?: string;
  candidates?: number;
  /** Prompt tokens already cached on the chosen worker, by the router's index. */
  overlapTokens?: number;
  kvCacheHit?: boolean;
  reason?: string;
  /** The cost terms of the cheapest workers weighed, cheapest first (RoutingSummary.costs). */
  costs?: readonly WorkerCostSummary[];
  subPhasesMs?: RouterSubPhasesMs;
}




export interface KvTransferEvent extends IntervalEvent {
  phase: 'kv_transfer';
  bytes: number;
  blocks?: number;
  /** The link the blocks moved over: shm (shared memory), tcp, or a simulated link. */
  link?: string;
  fromWorker?: string;
  toWorker?: string;
  /** The transfer's busy time hidden behind the prefill (streamed while it ran); start..time is what came after. */
  overlapMs?: number;
  /**
   * Why the KV could not be imported, when it could not: the decode worker prefilled the prompt itself. Nothing moved
   * (bytes and blocks 0); start = time, when the frontend learned it.
   */
  failed?: string;
}


/** One decode step's forward pass (start to sampled) that the request took part in, as the engine reported it. */
export interface DecodeExecutionEvent extends IntervalEvent {
  phase: 'decode_execution';
  /** 1 for the first decode step after prefill. */
  step?: number;
  /** Sequences in the step's batch. */
  batchSize?: number;
  /** Tokens the step computed, all sequences together. */
  batchTokens?: number;
  worker?: string;
}



export interface StreamingResponseEvent extends PointEvent {
  phase: 'streaming_response';
  /** time = when the chunk was written to the socket. start, if given, = when formatting it began. */
  start?: number;
  /** Output tokens the chunk carries; 0 for role-only, finish or usage chunks (they do not count for TTFT/TBT). */
  tokens: number;
  bytes?: number;
}

export type FinishReasonName = 'stop' | 'length' | 'abort' | 'error' | (string & {});

/** What every terminal event may carry: the request's final counts and the engine's timestamps. */
interface TerminalFields extends PointEvent {
  promptTokens?: number;
  /** Output tokens over all completions. */
  outputTokens?: number;
  cachedTokens?: number;
  /** The model, when no validate event named it (requests that do not come through the gateway). */
  model?: string;
  engine?: EngineReport | readonly EngineReport[];
}

export interface FinishEvent extends TerminalFields {
  phase: 'finish';
  /** time = when the response's last byte was written. */
  finishReason: FinishReasonName;
  status?: number;
}

/**
 * What an ending that cut a run short (abort, error) may carry: when the run was aborted (engine-clock ms), as the
 * gateway saw the client leave or the timeout expire. The engine learns of an abort only after the step it is running,
 * so its stamps of that step (a first token sampled, the step's end) may come after this instant; the phase a request
 * ended in is the one running then.
 */
interface CutShortFields extends TerminalFields {
  abortedAt?: number;
}

export interface ErrorEvent extends CutShortFields {
  phase: 'error';
  /** A stable code ('rate_limited', 'invalid_request', 'engine_error', 'timeout', ...): a metric label. */
  errorType: string;
  message?: string;
  /** HTTP status sent; below 500 is the client's error and does not count against the error-rate SLO. */
  status?: number;
}

export interface AbortEvent extends CutShortFields {
  phase: 'abort';
  /** 'client_disconnect', 'shutdown', ... */
  reason?: string;
}

/**
 * What is published. The engine's side (queue, prefill chunks, hand-offs) has one source, the engine's timestamps on
 * the terminal event (EngineReport); the trace builder derives scheduler_queue, prefill_dispatch, prefill_execution
 * and decode_dispatch phases from them, so there are no events for those.
 */
export type LifecycleEvent =
  | HttpReceiveEvent | AuthEvent | RateLimitEvent | ValidateEvent | TokenizeEvent
  | RouterLookupEvent | KvTransferEvent | DecodeExecutionEvent
  | StreamingResponseEvent
  | FinishEvent | ErrorEvent | AbortEvent;

export type TerminalEvent = FinishEvent | ErrorEvent | AbortEvent;

export function isTerminal(event: LifecycleEvent): event is TerminalEvent {
  return event.phase === 'finish' || event.phase === 'error' || event.phase === 'abort';
}

// ---------------------------------------------------------------------------------------------------------------
// The bus

export type LifecycleListener = (event: LifecycleEvent) => void;

/**
 * A synchronous publish/subscribe channel for lifecycle events. Publishers write
 * `if (bus.active) bus.emit({...})` so that with no subscriber they neither build the event object nor call
 * anything; `emit` without the guard is also safe and costs a call and a length check.
 *
 * A listener that throws does not stop the others or the publisher: telemetry must never fail a request. The error
 * goes to the `onListenerError` hook (by default it is dropped after the first report to stderr).
 */
export class LifecycleBus {
  /** True while at least one listener is subscribed. A plain field, so the publisher's check is one load. */
  active = false;
  private listeners: LifecycleListener[] = [];
  private reportedListenerError = false;

  constructor(private readonly onListenerError?: (err: unknown, event: LifecycleEvent) => void) {}

  /** Adds a listener; the returned function removes it. */
  subscribe(listener: LifecycleListener): () => void {
    // Copy on write: a listener that unsubscribes during emit does not disturb the loop in progress.
    this.listeners = [...this.listeners, listener];
    this.active = true;
    return () => {
      this.listeners = this.listeners.filter((l) => l !== listener);
      this.active = this.listeners.length > 0;
    };
  }

  get listenerCount(): number {
    return this.listeners.length;
  }

  emit(event: LifecycleEvent): void {
    const listeners = this.listeners;
    for (let i = 0; i < listeners.length; i++) {
      try {
        listeners[i]!(event);
      } catch (err) {
        this.listenerFailed(err, event);
      }
    }
  }

  private listenerFailed(err: unknown, event: LifecycleEvent): void {
    if (this.onListenerError) {
      this.onListenerError(err, event);
      return;
    }
    if (this.reportedListenerError) return;
    this.reportedListenerError = true;
    process.emitWarning(`lifecycle listener failed on ${event.phase} (later failures are not reported): ${String(err)}`);
  }
}
