// One generation request's lifecycle events, as the gateway emits them on the telemetry bus: its own phases
// (http_receive, auth, rate_limit, validate, tokenize), what the engine's outputs say about routing and KV transfer,
// a streaming_response per SSE write, and exactly one terminal event (finish, error or abort) however the request
// ends. The request path only stamps times here; the telemetry layer derives everything when the request is over.
//
// Where the gateway's order differs from the phase order, the stamps keep the phase order and say so:
// - auth and the request-rate precheck run before the body is read (a refused request costs no upload), so they
//   fall inside http_receive, which spans arrival to the body's last byte. Their events wait for http_receive's,
//   since the first event of a request opens its trace and http_receive's carries the client's traceparent;
// - the tenant's token and concurrency admission needs the prompt's length, so it runs after tokenize. The single
//   rate_limit event is stamped where the precheck ran, lasts as long as both checks took, and carries the
//   admission's outcome, so a refusal at either point reads as "ended in rate_limit".

import type { EngineOutput } from '../engine/types.ts';
import type {
  EngineReport, LifecycleBus, LifecycleEvent, ResponseTimings, Telemetry, ValidateEvent,
} from '../telemetry/index.ts';
import {
  ClientClosedRequestError, ConcurrencyLimitError, RateLimitError, RequestExceedsConcurrencyError, RequestExceedsTokenLimitError, ShuttingDownError,
  type ApiError,
} from './errors.ts';

/** What the terminal event needs from the run: its final token counts, and when it was aborted. */
export interface RunCounts {
  readonly promptTokens: number;
  readonly completionTokens: number;
  readonly cachedPromptTokens: number;
  /** Aborts when the run is cut short (the client left, a timeout, shutdown). */
  readonly signal?: AbortSignal;
}

/** What validation found, as the validate event carries it. */
export type ValidateFields = Omit<ValidateEvent, 'requestId' | 'start' | 'time' | 'phase'>;

export interface CallEnd {
  /** The error the request was answered with, if it was refused or failed before its stream began. */
  error?: ApiError;
  /** The client went away before its response was complete. */
  clientGone: boolean;
  /** Reading the body began and did not finish (too large, or the client left while sending it). */
  bodyIncomplete: boolean;
  /** The served model, for requests refused before validation named it. */
  model?: string;
}

/** Outputs of one engine request: the first (the prefill worker's, when disaggregated) and the latest. */
interface EngineTrack {
  first: EngineOutput;
  last: EngineOutput;
  cachedTokens: number;
  kvTransferEmitted: boolean;
}

/**
 * The prefill worker of a disaggregated request that ended there, before any hand-over: its first output (a prefill
 * worker sends one, with the first token and any forced after it) finished the completion (max_tokens 1, a stop
 * token or string on the first token, an abort while prefilling). Every token came from that worker and the decode
 * worker the router placed it on never took it, so the trace names the prefill worker. Undefined otherwise.
 */
function endedOnPrefillWorker(track: EngineTrack): string | undefined {
  const { first, last } = track;
  const disaggregation = first.routing?.disaggregation;
  if (first !== last || first.finishReason === undefined || first.timestamps.kvTransfer !== undefined) return undefined;
  return disaggregation?.mode === 'disaggregated' ? disaggregation.prefillWorkerId : undefined;
}

/** The trace context the engine handed back on an output, as a report field. */
function traceparentOf(output: EngineOutput): { traceparent?: string } {
  return output.traceparent !== undefined ? { traceparent: output.traceparent } : {};
}

/** The reason label of a tenant-limit refusal. */
export function rateLimitReason(err: unknown): string | undefined {
  if (err instanceof ConcurrencyLimitError || err instanceof RequestExceedsConcurrencyError) return 'concurrency';
  if (err instanceof RequestExceedsTokenLimitError) return 'request_too_large';
  if (err instanceof RateLimitError) return err.type;
  return undefined;
}

export class CallTrace {
  private readonly bus: LifecycleBus;
  /** auth and rate_limit events stamped before the body was read, emitted once http_receive has been. */
  private readonly beforeReceive: LifecycleEvent[] = [];
  private received = false;
  private bodyEndMs: number | undefined;
  private validateEndMs: number | undefined;
  private precheck: { start: number; end: number; tenant: string } | undefined;
  private rateLimitEmitted = false;
  private routingEmitted = false;
  private readonly tracks = new Map<string, EngineTrack>();
  private readonly finishReasons = new Set<string>();
  private run: RunCounts | undefined;
  private promptTokens: number | undefined;
  private blockSize: number | undefined;
  private worker: string | undefined;
  private streamError: ApiError | undefined;
  /** When the run was aborted (engine clock): the client left, or the server cut it short. */
  private abortedAt: number | undefined;
  private ended = false;
  /** Whether the engine's decode steps go on the bus one by one (only when per-step spans are wanted). */
  private readonly stepEvents: boolean;
  /** The last decode step put on the bus, so a step that advanced several completions is told once. */
  private lastStepId = -1;
  private lastStepWorker: string | undefined;
  private decodeSteps = 0;
  /** Gives back the simulated clock's hold (ModelBackend.holdClock) once the prompt is tokenized or the request ends. */
  private releaseClock: (() => void) | undefined;

  constructor(
    private readonly telemetry: Telemetry,
    readonly requestId: string,
    /** The engine-clock stamp of the request's arrival: EngineRequest.arrivalMs and http_receive's start. */
    readonly arrivalMs: number,
    private readonly route: string,
    private readonly now: () => number,
    /** The client's W3C traceparent, already checked for shape. */
    private readonly traceparent: string | undefined,
    /** The client's W3C tracestate (only with a traceparent). */
    private readonly tracestate?: string,
  ) {
    this.bus = telemetry.lifecycle;
    this.stepEvents = telemetry.wantsEngineSteps;
  }

  /** Keeps a hold on the simulated clock (ModelBackend.holdClock) until the prompt is tokenized or the request ends. */
  holdClockUntilTokenized(release: () => void): void {
    this.releaseClock = release;
  }

  private giveBackClock(): void {
    const release = this.releaseClock;
    this.releaseClock = undefined;
    release?.();
  }

  // ---- gateway phases ----

  authenticated(start: number, ok: boolean, tenant?: string): void {
    this.emitAfterReceive({ phase: 'auth', requestId: this.requestId, start, time: this.now(), ok, ...(tenant !== undefined ? { tenant } : {}) });
  }

  private emitAfterReceive(event: LifecycleEvent): void {
    if (!this.bus.active) return;
    if (this.received) this.bus.emit(event);
    else this.beforeReceive.push(event);
  }

  /** The request-rate precheck passed; the rate_limit event waits for the admission that follows tokenize. */
  prechecked(start: number, tenant: string): void {
    this.precheck = { start, end: this.now(), tenant };
  }

  precheckRefused(start: number, tenant: string, err: unknown): void {
    this.rateLimitEmitted = true;
    this.emitAfterReceive({
      phase: 'rate_limit', requestId: this.requestId, start, time: this.now(), allowed: false, tenant,
      reason: rateLimitReason(err) ?? 'requests',
    });
  }

  bodyRead(bodyBytes: number): void {
    this.bodyEndMs = this.now();
    this.receive({ bodyBytes });
  }

  /** http_receive, ending now (or when the body was read), then the events that waited for it. */
  private receive(fields: { bodyBytes?: number; ok?: boolean }): void {
    if (this.received) return;
    this.received = true;
    if (!this.bus.active) return;
    this.bus.emit({
      phase: 'http_receive', requestId: this.requestId, start: this.arrivalMs, time: this.bodyEndMs ?? this.now(),
      route: this.route, ...fields, ...(this.traceparent !== undefined ? { traceparent: this.traceparent } : {}),
      ...(this.tracestate !== undefined ? { tracestate: this.tracestate } : {}),
    });
    for (const event of this.beforeReceive.splice(0)) this.bus.emit(event);
  }

  /** JSON parsing, the schema and the model check: from the body's end to now. */
  validated(fields: ValidateFields): void {
    const start = this.bodyEndMs ?? this.now();
    this.validateEndMs = this.now();
    if (this.bus.active) this.bus.emit({ phase: 'validate', requestId: this.requestId, start, time: this.validateEndMs, ...fields });
  }

  /** The chat template and the tokenizer: from validation's end to now. */
  tokenized(promptTokens: number): void {
    this.promptTokens = promptTokens;
    const start = this.validateEndMs ?? this.now();
    if (this.bus.active) this.bus.emit({ phase: 'tokenize', requestId: this.requestId, start, time: this.now(), promptTokens });
    this.giveBackClock();
  }

  /**
   * The traceparent for the engine request: the request's own root span as parent. Call after tokenize, when the
   * prompt's length (an input of the head sampling decision) is known.
   */
  context(): string | undefined {
    return this.telemetry.traceContext(this.requestId);
  }

  /** The tenant admission after tokenize: allowed, or refused with the error it threw. */
  admitted(start: number, refusal?: unknown): void {
    const reason = refusal === undefined ? undefined : rateLimitReason(refusal);
    // Only a tenant limit is a rate_limit refusal; an overloaded server refuses elsewhere (its terminal event says).
    this.emitRateLimit(start, this.now(), reason === undefined, reason);
  }

  private emitRateLimit(checkStart: number, checkEnd: number, allowed: boolean, reason?: string): void {
    if (this.rateLimitEmitted) return;
    this.rateLimitEmitted = true;
    if (!this.bus.active) return;
    const precheck = this.precheck;
    const start = precheck?.start ?? checkStart;
    const ms = (precheck ? precheck.end - precheck.start : 0) + (checkEnd - checkStart);
    this.bus.emit({
      phase: 'rate_limit', requestId: this.requestId, start, time: start + ms, allowed,
      ...(precheck ? { tenant: precheck.tenant } : {}), ...(reason !== undefined ? { reason } : {}),
    });
  }

  // ---- engine ----

  /**
   * The run whose counts the terminal event reports, the KV block size and the worker of an unrouted engine.
   * `model`: the served model whose workers run it, when several are served: each pool names its workers worker-0
   * ..., so the trace names them `<model>:<worker>`, as /metrics' per-worker series and the console do.
   */
  attachRun(run: RunCounts, blockSize: number, worker: string, model?: string): void {
    this.run = run;
    // Stamped as the abort happens: the engine finishes the step it is running before the abort reaches it, so its
    // timestamps can run past the moment the request was cut short (a first token sampled after the client left).
    const signal = run.signal;
    if (signal?.aborted) this.abortedAt = this.now();
    else signal?.addEventListener('abort', () => { this.abortedAt ??= this.now(); }, { once: true });
    this.blockSize = blockSize;
    this.workerPrefix = model === undefined ? undefined : `${model}:`;
    this.worker = this.named(worker);
  }

  private workerPrefix: string | undefined;

  /** A worker id as the trace and the metrics name it. */
  private named<T extends string | undefined>(id: T): T {
    return (id === undefined || this.workerPrefix === undefined ? id : `${this.workerPrefix}${id}`) as T;
  }

  /** Every engine output, as it arrives. */
  output(output: EngineOutput): void {
    let track = this.tracks.get(output.requestId);
    if (!track) {
      track = { first: output, last: output, cachedTokens: 0, kvTransferEmitted: false };
      this.tracks.set(output.requestId, track);
    }
    track.last = output;
    track.cachedTokens = Math.max(track.cachedTokens, output.usage.cachedTokens);
    if (output.finishReason) this.finishReasons.add(output.finishReason);
    if (!this.bus.active) return;
    const routing = output.routing;
    if (routing && !this.routingEmitted) {
      this.routingEmitted = true;
      const us = routing.overheadUs;
      // A request that ended on its prefill worker ran there only: the trace's worker (and its metrics' label) is
      // that one, not the decode worker it would have been handed to.
      const endedOn = endedOnPrefillWorker(track);
      const decodeWorker = this.named(routing.workerId);
      // Where the prompt ran, and why, is part of a disaggregated deployment's decision.
      let reason = routing.disaggregation
        ? `${routing.reason}; prefill ${routing.disaggregation.mode} (${routing.disaggregation.reason})` : routing.reason;
      if (endedOn !== undefined) reason += `; ended on the prefill worker, before the hand-over to ${decodeWorker}`;
      this.bus.emit({
        phase: 'router_lookup', requestId: this.requestId, start: routing.startedAt ?? routing.decidedAt - us.total / 1000, time: routing.decidedAt,
        ...(routing.admissionQueuedAt !== undefined ? { admissionQueuedAt: routing.admissionQueuedAt } : {}),
        worker: endedOn !== undefined ? this.named(endedOn) : decodeWorker, strategy: routing.strategy,
        ...(routing.candidates !== undefined ? { candidates: routing.candidates } : {}),
        reason,
        ...(routing.disaggregation?.prefillWorkerId !== undefined ? { prefillWorker: this.named(routing.disaggregation.prefillWorkerId) } : {}),
        kvCacheHit: routing.overlapBlocks > 0,
        ...(this.blockSize !== undefined ? { overlapTokens: routing.overlapBlocks * this.blockSize } : {}),
        ...(routing.costs !== undefined ? { costs: routing.costs } : {}),
        subPhasesMs: { hashing: us.hashing / 1000, indexLookup: us.lookup / 1000, selection: us.selection / 1000 },
      });
    }
    const step = output.step;
    if (step && this.stepEvents) {
      const worker = this.named(routing?.workerId) ?? this.worker;
      // Tokens held back for --stream-interval came from steps of their own, each a decode step of the trace.
      for (const held of output.heldSteps ?? []) this.decodeStep(output, held, worker);
      this.decodeStep(output, step, worker);
    }
    const transfer = output.timestamps.kvTransfer;
    if (transfer && !track.kvTransferEmitted) {
      track.kvTransferEmitted = true;
      const prefillWorker = this.named(routing?.disaggregation?.prefillWorkerId);
      this.bus.emit({
        phase: 'kv_transfer', requestId: this.requestId, start: transfer.start, time: transfer.end, bytes: transfer.bytes,
        blocks: transfer.blocks, ...(prefillWorker !== undefined ? { fromWorker: prefillWorker } : {}),
        ...(transfer.link !== undefined ? { link: transfer.link } : {}),
        ...(transfer.overlapMs !== undefined ? { overlapMs: transfer.overlapMs } : {}),
        ...(routing ? { toWorker: this.named(routing.workerId) } : {}),
      });
    }
    // The prompt's KV was to move from the prefill worker (its first output said so) and could not be imported: the
    // decode worker prefilled the prompt itself. Marked where the frontend learned it, as a failed transfer.
    const now = routing?.disaggregation;
    if (!transfer && !track.kvTransferEmitted && now?.mode === 'local' && now.reason === 'transfer-failed'
      && track.first.routing?.disaggregation?.mode === 'disaggregated') {
      track.kvTransferEmitted = true;
      const at = this.now();
      const prefillWorker = this.named(track.first.routing.disaggregation.prefillWorkerId);
      this.bus.emit({
        phase: 'kv_transfer', requestId: this.requestId, start: at, time: at, bytes: 0, blocks: 0, failed: now.detail ?? 'KV not imported',
        ...(prefillWorker !== undefined ? { fromWorker: prefillWorker } : {}), toWorker: this.named(routing!.workerId),
      });
    }
  }

  /**
   * A step after the request's first token, as the engine timed it: its forward pass and its batch. The step that
   * sampled the first token is the prefill's; its end is the firstToken stamp.
   */
  private decodeStep(output: EngineOutput, step: NonNullable<EngineOutput['step']>, worker: string | undefined): void {
    const firstToken = output.timestamps.firstToken;
    if (firstToken === undefined || step.end <= firstToken) return;
    // A worker numbers its steps in order, and every completion of the request (n > 1) reports the steps they shared,
    // held ones (--stream-interval) included: a step is new when it comes after the last one taken from that worker.
    if (step.id <= this.lastStepId && worker === this.lastStepWorker) return;
    this.lastStepId = step.id;
    this.lastStepWorker = worker;
    this.bus.emit({
      phase: 'decode_execution', requestId: this.requestId, start: step.start, time: step.end, step: ++this.decodeSteps,
      batchSize: step.batchSeqs, batchTokens: step.batchTokens, ...(worker !== undefined ? { worker } : {}),
    });
  }

  /** One SSE write: `tokens` output tokens the client sees for the first time in it (0 for other chunks). */
  wrote(bytes: number, tokens: number): void {
    if (this.bus.active) this.bus.emit({ phase: 'streaming_response', requestId: this.requestId, time: this.now(), tokens, bytes });
  }

  /** A stream that failed after it began (its error went out as an SSE error event). */
  /** Token counts and time to first token (ms from arrival), for the request's log line. */
  summary(): { promptTokens?: number; outputTokens?: number; ttftMs?: number } {
    let firstToken: number | undefined;
    for (const { first, last } of this.tracks.values()) {
      const stamp = first.timestamps.firstToken ?? last.timestamps.firstToken;
      if (stamp !== undefined && (firstToken === undefined || stamp < firstToken)) firstToken = stamp;
    }
    const promptTokens = this.run?.promptTokens ?? this.promptTokens;
    return {
      ...(promptTokens !== undefined ? { promptTokens } : {}),
      ...(this.run ? { outputTokens: this.run.completionTokens } : {}),
      ...(firstToken !== undefined ? { ttftMs: firstToken - this.arrivalMs } : {}),
    };
  }

  failedMidStream(error: ApiError): void {
    this.streamError ??= error;
  }

  /**
   * The timings object for the final body or SSE chunk, before the request is over; `pendingWriteTokens`: the output
   * tokens that chunk shows for the first time (its write is when the client sees them).
   */
  timings(pendingWriteTokens?: number): ResponseTimings | undefined {
    return this.telemetry.timings(this.requestId, this.reports(), this.now(), this.run?.completionTokens, pendingWriteTokens);
  }

  /**
   * What the engine reported, one entry per engine request (two for a disaggregated one: prefill and decode; one, the
   * prefill worker's, for a disaggregated one that ended there).
   */
  reports(): EngineReport[] {
    const reports: EngineReport[] = [];
    const blockSize = this.blockSize !== undefined ? { blockSize: this.blockSize } : {};
    for (const track of this.tracks.values()) {
      const { first, last } = track;
      const routing = last.routing;
      const worker = this.named(routing?.workerId) ?? this.worker;
      // Whether the prefill ran elsewhere is the first output's to say: after a failed transfer the decode worker's
      // outputs say 'local' (it prefilled again), but the prefill worker's run and the hand-over still happened.
      const disaggregation = first.routing?.disaggregation;
      if (disaggregation?.mode === 'disaggregated' && disaggregation.prefillWorkerId !== undefined && first !== last) {
        // The decode worker carries on the prefill worker's timestamps; its own prefill chunks (if it recomputed
        // any) are those the prefill worker's first output did not have.
        const prefillTs = first.timestamps;
        const prefillChunkStarts = new Set(prefillTs.prefillChunks.map((c) => c.start));
        reports.push({
          worker: this.named(disaggregation.prefillWorkerId), role: 'prefill', timestamps: prefillTs, cachedTokens: first.usage.cachedTokens, ...blockSize,
          ...traceparentOf(first),
        });
        reports.push({
          ...(worker !== undefined ? { worker } : {}), role: 'decode', cachedTokens: track.cachedTokens, ...blockSize,
          timestamps: { ...last.timestamps, prefillChunks: last.timestamps.prefillChunks.filter((c) => !prefillChunkStarts.has(c.start)) },
          ...traceparentOf(last),
        });
      } else {
        const endedOn = endedOnPrefillWorker(track);
        reports.push({
          ...(endedOn !== undefined ? { worker: this.named(endedOn), role: 'prefill' as const } : worker !== undefined ? { worker } : {}),
          timestamps: last.timestamps, cachedTokens: track.cachedTokens, ...blockSize,
          ...traceparentOf(last),
        });
      }
      const migrations = routing?.migrations;
      if (migrations && migrations.length > 0) {
        reports.at(-1)!.migrations = migrations.map((m) => ({
          fromWorker: this.named(m.fromWorkerId), ...(m.toWorkerId !== undefined ? { toWorker: this.named(m.toWorkerId) } : {}), afterTokens: m.afterTokens, reason: m.reason,
        }));
      }
    }
    return reports;
  }

  // ---- the end ----

  /**
   * The terminal event, once: abort when the client left (or the server's shutdown cut a running request short),
   * error when the request was refused or failed, finish otherwise. Call after the response's last byte.
   */
  end(end: CallEnd): void {
    this.giveBackClock();
    if (this.ended) return;
    this.ended = true;
    // Refused before its body was read (or while reading it): the receive phase ends here.
    this.receive(end.bodyIncomplete ? { ok: false } : {});
    // A request refused after the precheck but before admission still passed the tenant limits it met.
    if (this.precheck && !this.rateLimitEmitted) this.emitRateLimit(this.precheck.end, this.precheck.end, true);
    if (!this.bus.active) return;
    const error = end.error ?? this.streamError;
    const reports = this.reports();
    const counts = {
      ...(this.run ? {
        promptTokens: this.run.promptTokens, outputTokens: this.run.completionTokens, cachedTokens: this.run.cachedPromptTokens,
      } : this.promptTokens !== undefined ? { promptTokens: this.promptTokens, outputTokens: 0 } : {}),
      ...(reports.length > 0 ? { engine: reports } : {}),
    };
    const base = { requestId: this.requestId, time: this.now(), ...(end.model !== undefined ? { model: end.model } : {}), ...counts };
    // An ending that cut the run short says when it did: the phase it ended in is the one running then.
    const cut = this.abortedAt !== undefined ? { abortedAt: this.abortedAt } : {};
    if (end.clientGone || error instanceof ClientClosedRequestError) {
      this.bus.emit({ ...base, ...cut, phase: 'abort', reason: 'client_disconnect' });
    } else if (error instanceof ShuttingDownError && this.run) {
      this.bus.emit({ ...base, ...cut, phase: 'abort', reason: 'shutdown' });
    } else if (error) {
      this.bus.emit({ ...base, ...cut, phase: 'error', errorType: error.code, status: error.statusCode, message: error.message });
    } else if (this.finishReasons.has('abort') && !this.finishReasons.has('stop') && !this.finishReasons.has('length')) {
      this.bus.emit({ ...base, phase: 'abort', reason: 'engine' });
    } else {
      // With several completions, one cut at max_tokens makes the response a 'length' one.
      const finishReason = this.finishReasons.has('length') ? 'length' : 'stop';
      this.bus.emit({ ...base, phase: 'finish', finishReason, status: 200 });
    }
  }
}
