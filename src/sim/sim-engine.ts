// The simulated engine behind the `Engine` interface: one SimWorker (sim-worker.ts) stepped on a virtual clock that
// runs `speedUp` times faster than real time (Infinity: as fast as the host can, and fully deterministic given
// arrivals). Requests arrive at their arrivalMs on that clock; each step lasts what the performance model says.

import type { GrammarLoader } from '../engine/grammar/runtime.ts';
import type { KvEvent } from '../protocols/kv-events.ts';
import { engineNow } from '../engine/clock.ts';
import { followQueue, OutputStream } from '../engine/streams.ts';
import {
  PrefillStream, type AdoptedResult, type KvHandoff, type KvPoolLayout, type PrefillEvent,
} from '../engine/handoff.ts';
import { EngineClosedError, InvalidRequestError } from '../engine/errors.ts';
import type { Engine, EngineInfo, EngineOutput, EngineRequest, LoraLoadInfo, WorkerRole } from '../engine/types.ts';
import { DEFAULT_SIM_LORA_RANK, simLoraAdapter } from './sim-lora.ts';
import type { EngineStats } from '../protocols/worker.ts';
import type { LinkProfile } from './hardware.ts';
import type { WorkerLoad } from '../protocols/worker.ts';
import { SimWorker, type SimWorkerConfig } from './sim-worker.ts';
import { kvBytesPerToken } from './models.ts';

export interface SimEngineOptions extends SimWorkerConfig {
  /**
   * Simulated milliseconds per real millisecond (default 1). Infinity runs steps back to back as fast as the host
   * can; then the timings depend only on the arrivals (arrivalMs) and not on the host.
   */
  speedUp?: number;
  /** The virtual clock at construction. Default: the engine clock (engineNow) for a finite speedUp, else 0. */
  startMs?: number;
  /**
   * performance.now() when the virtual clock read startMs (default: at construction). Workers of one pool share
   * startMs and realStartMs so that, at a finite speed-up, their clocks are one clock.
   */
  realStartMs?: number;
  /** Rank of an adapter loaded from a path that does not exist (a synthetic one; sim-lora.ts). Default 16. */
  loraRank?: number;
  /**
   * The clock of the pool this worker is part of (WorkerPool.clock: the latest of its workers' clocks), which the
   * gateway and the routers stamp a request with before it gets here. A request, or a hand-over, reaches this worker
   * no earlier than that clock reads when it is submitted: at --sim-speed-up inf each worker's clock moves with its
   * own steps, and a worker behind the others would otherwise start the request before the times already stamped
   * on it. Default: this worker's own clock only.
   */
  poolClock?: () => number;
  /** The pool's clock holds (speed-up Infinity): the clock moves on only while none is held. */
  clockHolds?: SimClockHolds;
  /**
   * The name the engine serves under (info.modelName), as a cpu engine takes its --served-model-name: default the
   * profile's (Llama 3.1 8B). A `conduit worker` registers under it.
   */
  servedModelName?: string;
}

/**
 * Holds on a simulated pool's clock at --sim-speed-up inf: while any is held, the pool's workers do not move their
 * clocks on. The API server holds it for each request from its arrival until its prompt is tokenized (or it is
 * refused), so the gateway's real work takes no simulated time, as the engine's host work takes none: otherwise the
 * workers, which step as fast as the host can, run ahead while the tokenizer works and the gateway's phases would
 * absorb their steps. Nothing the gateway awaits in that span waits for a simulated worker.
 */
export class SimClockHolds {
  private count = 0;
  private waiters: (() => void)[] = [];

  /** Takes a hold; the function returned gives it back (once; later calls do nothing). */
  hold(): () => void {
    this.count++;
    let released = false;
    return () => {
      if (released) return;
      released = true;
      if (--this.count > 0) return;
      const waiters = this.waiters;
      this.waiters = [];
      for (const resolve of waiters) resolve();
    };
  }

  get held(): boolean {
    return this.count > 0;
  }

  /** Resolves once nothing is held (at once when nothing is), or when `cancel` is called. */
  whenFree(): { done: Promise<void>; cancel: () => void } {
    if (this.count === 0) return { done: Promise.resolve(), cancel: () => {} };
    let cancel = () => {};
    const done = new Promise<void>((resolve) => {
      this.waiters.push(resolve);
      cancel = () => {
        this.waiters = this.waiters.filter((w) => w !== resolve);
        resolve();
      };
    });
    return { done, cancel };
  }
}

/**
 * A simulated worker behind the `Engine` interface. A request arrives at max(arrivalMs, now at submission) on the
 * virtual clock and joins the first step that starts at or after its arrival (an arrival in the future waits for
 * it); each step lasts what the performance model says, and outputs are stamped with virtual times. With a finite speedUp the virtual clock never runs behind real time x speedUp, and a step
 * never ends earlier in real time than its simulated duration / speedUp.
 */
export class SimEngine implements Engine {
  readonly worker: SimWorker;
  readonly info: EngineInfo;
  readonly role: WorkerRole;
  /** The link handed-off KV crosses to reach this worker. */
  readonly kvLink: LinkProfile;
  /** The pool's shape (there are no bytes: a simulated pool is not shared). */
  readonly kvLayout: KvPoolLayout;
  /** Bytes of one token's KV as a transfer moves it: the profile's, FP8 included (kvLayout's dtype reads f16). */
  readonly kvTransferBytesPerToken: number;
  readonly speedUp: number;
  private readonly loraRank: number;
  private readonly poolClock: (() => number) | undefined;
  private readonly clockHolds: SimClockHolds | undefined;
  /** Ends a wait for the pool's clock holds (close). */
  private cancelHoldWait: (() => void) | undefined;
  private virtualMs: number;
  private readonly realStartMs: number;
  private readonly virtualStartMs: number;
  /** Requests whose arrival time has not come yet, by arrival time then submission order. */
  private pending: EngineRequest[] = [];
  private readonly streams = new Map<string, OutputStream>();
  private readonly kvEventListeners = new Set<(events: KvEvent[]) => void>();
  private loop: Promise<void> | null = null;
  /** Ends the loop's current wait early; idleWait says whether it is an idle wait (a new arrival may end it). */
  private cancelWait: (() => void) | undefined;
  private idleWait = false;
  private closed = false;
  /** Disaggregated serving: prefill streams, requests to add as handoffs, KV transfers in flight (by end time). */
  private readonly prefills = new Map<string, PrefillStream>();
  private readonly handoffIds = new Set<string>();
  private transfers: { handoff: KvHandoff; sourceId: string | null; startMs: number; endMs: number }[] = [];
  private readonly adoptedListeners = new Set<(result: AdoptedResult) => void>();
  private readonly grammar: GrammarLoader | undefined;
  /** Guided requests waiting for the pool's grammars to load (not yet queued). */
  private readonly awaitingGrammar = new Map<string, EngineRequest>();

  constructor(options: SimEngineOptions) {
    this.worker = new SimWorker(options);
    this.grammar = options.grammar;
    this.info = options.servedModelName !== undefined ? { ...this.worker.info, modelName: options.servedModelName } : this.worker.info;
    this.role = this.worker.role;
    this.kvLink = this.worker.kvLink;
    this.kvLayout = this.worker.kvLayout;
    this.kvTransferBytesPerToken = kvBytesPerToken(this.worker.model);
    this.speedUp = options.speedUp ?? 1;
    this.loraRank = options.loraRank ?? DEFAULT_SIM_LORA_RANK;
    if (!Number.isInteger(this.loraRank) || this.loraRank < 1) throw new RangeError(`loraRank must be a whole number >= 1, got ${options.loraRank}`);
    if (!(this.speedUp > 0)) throw new RangeError(`speedUp must be > 0 (Infinity: as fast as possible), got ${options.speedUp}`);
    this.virtualStartMs = options.startMs ?? (Number.isFinite(this.speedUp) ? engineNow() : 0);
    this.virtualMs = this.virtualStartMs;
    this.realStartMs = options.realStartMs ?? performance.now();
    this.poolClock = options.poolClock;
    this.clockHolds = options.clockHolds;
  }

  /** When something submitted now reaches this worker: its own clock, or the pool's when that is ahead. */
  private submittedAt(): number {
    const own = this.now();
    return this.poolClock === undefined ? own : Math.max(own, this.poolClock());
  }

  /** The engine clock: virtual milliseconds. Stamp EngineRequest.arrivalMs with it. */
  now(): number {
    if (!Number.isFinite(this.speedUp)) return this.virtualMs;
    return Math.max(this.virtualMs, this.virtualStartMs + (performance.now() - this.realStartMs) * this.speedUp);
  }

  generate(request: EngineRequest): AsyncIterable<EngineOutput> {
    if (this.closed) throw new EngineClosedError('engine is closed');
    if (this.streams.has(request.id) || this.prefills.has(request.id)) {
      throw new InvalidRequestError('duplicate_request_id', request.id, 'a request with this id is already running');
    }
    const stream = new OutputStream(request.sampling.n);
    this.streams.set(request.id, stream);
    const grammar = this.grammar;
    if (request.sampling.guided !== undefined && grammar !== undefined && grammar.current === undefined) {
      // The pool's grammars load on the first guided request; it joins the queue once they are there.
      this.awaitingGrammar.set(request.id, request);
      grammar.load().then(() => {
        if (this.awaitingGrammar.delete(request.id) && !this.closed) this.enqueue(request);
      }, (error: unknown) => {
        if (!this.awaitingGrammar.delete(request.id)) return;
        stream.fail(new InvalidRequestError('invalid_request', request.id, `guided decoding is unavailable: ${(error as Error).message}`));
        this.streams.delete(request.id);
      });
    } else {
      this.enqueue(request);
    }
    return followQueue(this.streams, request.id, stream, (id) => this.abort(id));
  }

  abort(requestId: string): void {
    if (this.closed) return;
    const awaiting = this.awaitingGrammar.get(requestId);
    if (awaiting !== undefined) {
      this.awaitingGrammar.delete(requestId);
      const stream = this.streams.get(requestId);
      for (let index = 0; index < awaiting.sampling.n; index++) stream?.push(notStartedOutput(awaiting, index, this.now()));
      this.streams.delete(requestId);
      return;
    }
    const at = this.pending.findIndex((r) => r.id === requestId);
    if (at >= 0) {
      const [request] = this.pending.splice(at, 1);
      const stream = this.streams.get(requestId);
      for (let index = 0; index < request!.sampling.n; index++) {
        const output = notStartedOutput(request!, index, this.now());
        stream?.push(output);
        this.prefills.get(requestId)?.pushOutput(output);
      }
      this.streams.delete(requestId);
      this.prefills.delete(requestId);
      this.handoffIds.delete(requestId);
      return;
    }
    const inTransfer = this.transfers.findIndex((t) => t.handoff.requestId === requestId);
    if (inTransfer >= 0) {
      const { handoff } = this.transfers.splice(inTransfer, 1)[0]!;
      this.streams.get(requestId)?.push({
        ...notStartedOutput(handoff.request, 0, this.now()),
        usage: { promptTokens: handoff.request.promptTokenIds.length, completionTokens: handoff.outputTokenIds.length, cachedTokens: handoff.numCachedTokens },
      });
      this.streams.delete(requestId);
      return;
    }
    this.deliver(this.worker.abort(requestId, this.now()));
  }

  // -------------------------------------------------------------------------------------------------------------
  // Disaggregated serving (same faces as LocalEngine's)

  /** Prefill worker: the prompt and the first token, then the handoff (blocks pinned until releaseHandoff). */
  prefill(request: EngineRequest): AsyncIterable<PrefillEvent> {
    if (this.closed) throw new EngineClosedError('engine is closed');
    if (this.streams.has(request.id) || this.prefills.has(request.id)) {
      throw new InvalidRequestError('duplicate_request_id', request.id, 'a request with this id is already running');
    }
    const stream = new PrefillStream();
    this.prefills.set(request.id, stream);
    this.handoffIds.add(request.id);
    this.enqueue(request);
    return followQueue(this.prefills, request.id, stream, (id) => this.abort(id));
  }

  releaseHandoff(requestId: string): void {
    this.worker.releaseHandoff(requestId);
  }

  /**
   * Decode worker: continues a handed-off request once its missing blocks have crossed kvLink (the time
   * SimWorker.planTransfer prices now, on this engine's virtual clock).
   */
  adopt(handoff: KvHandoff, sourceId: string | null): AsyncIterable<EngineOutput> {
    const requestId = handoff.requestId;
    if (this.closed) throw new EngineClosedError('engine is closed');
    if (this.streams.has(requestId) || this.prefills.has(requestId)) {
      throw new InvalidRequestError('duplicate_request_id', requestId, 'a request with this id is already running');
    }
    const stream = new OutputStream(1);
    this.streams.set(requestId, stream);
    // Not before the prefill worker's first token, which the pool's clock has reached (this worker's may lag).
    const startMs = this.submittedAt();
    const endMs = startMs + this.worker.planTransfer(handoff).ms;
    let at = this.transfers.length;
    while (at > 0 && this.transfers[at - 1]!.endMs > endMs) at--;
    this.transfers.splice(at, 0, { handoff, sourceId, startMs, endMs });
    this.wake();
    return followQueue(this.streams, requestId, stream, (id) => this.abort(id));
  }

  onAdopted(listener: (result: AdoptedResult) => void): () => void {
    this.adoptedListeners.add(listener);
    return () => this.adoptedListeners.delete(listener);
  }

  stats(): EngineStats {
    return this.worker.stats();
  }

  load(): WorkerLoad {
    return this.worker.load();
  }

  /** Subscribes to the KV cache's events (sent only with enableKvEvents); returns the unsubscribe function. */
  onKvEvents(listener: (events: KvEvent[]) => void): () => void {
    this.kvEventListeners.add(listener);
    return () => this.kvEventListeners.delete(listener);
  }

  /**
   * Holds a LoRA adapter's shape under `name` (sim-lora.ts: read from the file or folder, or synthetic when the path
   * does not exist); its requests then cost what their adapter adds to each step.
   */
  async loadLora(name: string, path: string): Promise<LoraLoadInfo> {
    if (this.closed) throw new EngineClosedError('engine is closed');
    const { adapter, info } = await simLoraAdapter(path, this.loraRank);
    this.worker.loadLora(name, adapter);
    return info;
  }

  async unloadLora(name: string): Promise<void> {
    this.worker.unloadLora(name);
  }

  /** Drops the simulated worker's prefix cache unless blocks are in use (false); there are no pages to release. */
  async resetPrefixCache(): Promise<boolean> {
    if (this.closed) throw new EngineClosedError('engine is closed');
    const reset = this.worker.resetPrefixCache();
    if (reset) this.deliver([]);
    return reset;
  }

  /** Resolves when no request is pending or running (the step loop has stopped). */
  async idle(): Promise<void> {
    while (this.loop) await this.loop;
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    for (const [id, stream] of this.streams) stream.fail(new EngineClosedError(`engine closed while request ${id} was running`));
    this.streams.clear();
    for (const [id, stream] of this.prefills) stream.fail(new EngineClosedError(`engine closed while request ${id} was prefilling`));
    this.prefills.clear();
    this.transfers = [];
    this.pending = [];
    this.cancelWait?.();
    this.cancelHoldWait?.();
    await this.loop;
  }

  // -------------------------------------------------------------------------------------------------------------

  private enqueue(submitted: EngineRequest): void {
    // An arrival stamped before now on this clock (or the pool's) comes from another clock or was submitted late: it
    // arrives now, so its timings count only what the simulated worker did, after every stamp the gateway and the
    // routers put on it. (One that waits for a step in flight keeps its time.)
    const nowMs = this.submittedAt();
    const request = submitted.arrivalMs < nowMs ? { ...submitted, arrivalMs: nowMs } : submitted;
    // Stable insertion by arrival: equal arrivals keep submission order, which the scheduler then keeps too.
    let at = this.pending.length;
    while (at > 0 && this.pending[at - 1]!.arrivalMs > request.arrivalMs) at--;
    this.pending.splice(at, 0, request);
    this.wake();
  }

  /** Starts the loop, or cuts its idle wait short: something new may be due before what it waits for. */
  private wake(): void {
    if (this.loop) {
      if (this.idleWait) this.cancelWait?.();
    } else this.loop = this.run().finally(() => { this.loop = null; });
  }

  /** The next arrival or transfer end, whichever comes first (undefined when neither is pending). */
  private nextArrivalMs(): number | undefined {
    const arrival = this.pending[0]?.arrivalMs;
    const transfer = this.transfers[0]?.endMs;
    if (arrival === undefined) return transfer;
    return transfer === undefined ? arrival : Math.min(arrival, transfer);
  }

  /** Moves every request whose arrival has come into the worker; one that can never run fails its stream. */
  private admitArrivals(nowMs: number): void {
    while (this.pending.length > 0 && this.pending[0]!.arrivalMs <= nowMs) {
      this.add(this.pending.shift()!, nowMs);
    }
    let adopted = false;
    while (this.transfers.length > 0 && this.transfers[0]!.endMs <= nowMs) {
      const { handoff, sourceId, startMs } = this.transfers.shift()!;
      try {
        this.worker.adopt(handoff, nowMs, startMs, sourceId ?? '');
        adopted = true;
      } catch (error) {
        this.streams.get(handoff.requestId)?.fail(error instanceof Error ? error : new Error(String(error)));
        this.streams.delete(handoff.requestId);
      }
    }
    if (adopted) this.deliver([]);
  }

  private add(request: EngineRequest, nowMs: number): void {
    const handoff = this.handoffIds.delete(request.id);
    try {
      // It reached the worker at its arrival; a step running then only took it in at its end (nowMs).
      this.worker.add(request, nowMs, { handoff, queuedMs: request.arrivalMs });
    } catch (error) {
      const failure = error instanceof Error ? error : new Error(String(error));
      this.streams.get(request.id)?.fail(failure);
      this.streams.delete(request.id);
      this.prefills.get(request.id)?.fail(failure);
      this.prefills.delete(request.id);
    }
  }

  private async run(): Promise<void> {
    // Starting on a later macrotask lets every request submitted in the same tick join the first step.
    await new Promise<void>((resolve) => setImmediate(resolve));
    while (!this.closed) {
      this.admitArrivals(this.now());
      if (!this.worker.hasWork) {
        const nextMs = this.nextArrivalMs();
        if (nextMs === undefined) return;
        await this.advanceTo(nextMs);
        continue;
      }
      const startMs = this.now();
      this.virtualMs = startMs;
      const step = this.worker.beginStep(startMs);
      if (step === null) {
        // Requests exist but none can be scheduled (cannot happen with a consistent scheduler); do not spin.
        await new Promise<void>((resolve) => setImmediate(resolve));
        continue;
      }
      await this.advanceTo(step.endMs);
      if (this.closed) return;
      this.virtualMs = step.endMs;
      this.deliver(this.worker.finishStep(step));
    }
  }

  /**
   * Lets virtual time reach targetMs. Infinity: jump, yielding to the event loop once so consumers and aborts run,
   * and waiting while the pool's clock is held (SimClockHolds). Finite: sleep until real time catches up with it (a
   * new request may wake an idle wait early).
   */
  private async advanceTo(targetMs: number): Promise<void> {
    if (!Number.isFinite(this.speedUp)) {
      await new Promise<void>((resolve) => setImmediate(resolve));
      while (this.clockHolds?.held && !this.closed) {
        const wait = this.clockHolds.whenFree();
        this.cancelHoldWait = wait.cancel;
        await wait.done;
        this.cancelHoldWait = undefined;
        // A request whose hold just ended may be about to arrive: let its submission run first.
        await new Promise<void>((resolve) => setImmediate(resolve));
      }
      if (this.closed) return;
      const nextMs = this.nextArrivalMs();
      if (this.worker.currentStep === null && nextMs !== undefined && nextMs < targetMs) return;
      this.virtualMs = Math.max(this.virtualMs, targetMs);
      return;
    }
    const realDeadlineMs = this.realStartMs + (targetMs - this.virtualStartMs) / this.speedUp;
    if (realDeadlineMs - performance.now() <= 0) {
      await new Promise<void>((resolve) => setImmediate(resolve));
      return;
    }
    // Only an idle wait is cut short by a new arrival; a step's duration is not. close() cuts either. A timer may
    // fire up to a millisecond early (the event loop counts whole ms), so a step's wait goes on until real time has
    // reached its end: outputs stamped with the step's end are never delivered before that time on the engine clock,
    // which a disaggregated pair's other worker (its own clock) stamps the hand-over with. Each round waits at least
    // 1 ms, so it ends.
    const idle = this.worker.currentStep === null;
    for (;;) {
      const waitMs = realDeadlineMs - performance.now();
      if (waitMs <= 0 || this.closed) return;
      this.idleWait = idle;
      const cut = await new Promise<boolean>((resolve) => {
        const timer = setTimeout(() => {
          this.cancelWait = undefined;
          this.idleWait = false;
          resolve(false);
        }, waitMs);
        this.cancelWait = () => {
          clearTimeout(timer);
          this.cancelWait = undefined;
          this.idleWait = false;
          resolve(true);
        };
      });
      if (cut || idle) return;
    }
  }

  private deliver(outputs: EngineOutput[]): void {
    for (const output of outputs) {
      const stream = this.streams.get(output.requestId);
      if (!stream) {
        const prefill = this.prefills.get(output.requestId);
        prefill?.pushOutput(output);
        if (prefill?.done) this.prefills.delete(output.requestId);
        continue;
      }
      stream.push(output);
      if (stream.done) this.streams.delete(output.requestId);
    }
    for (const handoff of this.worker.takeHandoffs()) {
      const prefill = this.prefills.get(handoff.requestId);
      this.prefills.delete(handoff.requestId);
      // Nobody waits for it any more: its blocks must not stay pinned.
      if (prefill) prefill.pushHandoff(handoff);
      else this.worker.releaseHandoff(handoff.requestId);
    }
    for (const result of this.worker.takeAdopted()) for (const listener of this.adoptedListeners) listener(result);
    const events = this.worker.takeKvEvents();
    if (events.length > 0) for (const listener of this.kvEventListeners) listener(events);
  }
}

/** The closing output of a request aborted before it arrived at the worker. */
function notStartedOutput(request: EngineRequest, index: number, nowMs: number): EngineOutput {
  return {
    requestId: request.id, index, newTokenIds: [], textDelta: '', finishReason: 'abort',
    usage: { promptTokens: request.promptTokenIds.length, completionTokens: 0, cachedTokens: 0 },
    timestamps: { arrival: request.arrivalMs, prefillChunks: [], finished: nowMs },
    ...(request.traceparent !== undefined ? { traceparent: request.traceparent } : {}),
  };
}
