// The step core every engine worker shares: the real one (EngineCore: forward pass + sampler + detokenizer) and the
// simulated one (SimWorker: performance model + synthetic tokens and words). It owns the scheduler, the KV cache,
// the per-request token and text state, the end-of-step output loop, disaggregated handoff and adoption, and the
// stats; where tokens and text come from is injected (TokenSource, TextSource). Synchronous, no clock of its own:
// every call that needs a time is given one.

import { InvalidRequestError } from './errors.ts';
import {
  HandoffOutbox, kvLinkName, type AdoptedResult, type KvHandoff, type KvImportPreparation, type KvPoolLayout, type KvTransferStats, type PrefillProgress,
} from './handoff.ts';
import type { BlockHash, KvEvent } from '../protocols/kv-events.ts';
import { KvCacheManager, type BlockTable, type KvPin } from './kv-cache/manager.ts';
import type { KvBlockIo, KvTiers } from './kv-cache/tiers.ts';
import type { KvBlock } from './kv-cache/free-block-queue.ts';
import { copyTimestamps, type Request } from './request.ts';
import { Scheduler, type AdoptedState, type SchedulerConfig, type StepPlan } from './scheduler.ts';
import type {
  EngineErrorCode, EngineOutput, EngineRequest, EngineStepFacts, FinishReason, SamplingParams, TokenLogprob,
} from './types.ts';
import type { EngineStats, WorkerLoad } from '../protocols/worker.ts';

/**
 * The per-completion token state of a request (a sampler, or the seed of synthetic tokens), and what a handoff
 * carries of it. The tokens themselves are produced by the engine around the core (forward pass + sampler, or the
 * synthetic tokens of a priced step) and given to finishStep.
 */
export interface TokenSource<T> {
  /** One state per completion of a newly accepted request (request.sampling.n of them). */
  open(request: EngineRequest): T[];
  /** The state a handed-off request continues with; throws if it cannot be resumed where the prefill side left it. */
  resume(handoff: KvHandoff): T;
  /** The seed a request to be handed off gets when the client gave none, so that both sides draw the same stream. */
  handoffSeed(request: EngineRequest): number;
  /** What a handoff carries of the state (the decode side's resume() takes it back). */
  handoffState(request: Request, state: T): KvHandoff['sampler'];
  /** The request left this worker (finished, aborted, handed off): what its states hold outside the JS heap goes. */
  close?(state: T): void;
  /**
   * Tokens the completion must produce next whatever is sampled (jump-forward: text its grammar forces), after the
   * token just given; the state has already advanced over them. They are appended without sampling and computed
   * together in the next step. None when absent.
   */
  forced?(state: T): readonly number[];
}

/** One completion's text: token ids in, text out, stop strings checked and held back until decided. */
export interface TextStream {
  push(tokenId: number): TextDelta;
  /** The held-back rest once the completion ends. */
  finish(): TextDelta;
  /** True once finished or stopped on a stop string. */
  readonly done: boolean;
}

export interface TextDelta {
  delta: string;
  /** The stop string matched, when one was. */
  stopped?: string;
}

export interface TextSource {
  /** The text stream of one completion of a request with this prompt (a prompt with no text changes how it starts). */
  open(sampling: SamplingParams, promptTokenIds: readonly number[]): TextStream;
}

/**
 * How a handed-off request's missing KV blocks reach this worker: copied from the prefill worker's pool, or priced
 * as a transfer over a link. One per adoption.
 */
export interface KvImport {
  /** Copies (or accounts for) blocks [fromBlock, toBlock) of the handoff into table's blocks; throws if it cannot. */
  fill(table: BlockTable, fromBlock: number, toBlock: number): void;
  /** The transfer's figures once the request is in (nowMs: the time it joined). */
  stats(requestId: string, nowMs: number): KvTransferStats;
  /**
   * The KV was written in place, into the blocks prepareKvImport reserved for the request: the request's table takes
   * those (after its held prefix) and fill has nothing to copy.
   */
  inPlace?: boolean;
}


/** The logprob entries of one step's rows, by rowKey(requestId, completion index). */
export type StepLogprobs = ReadonlyMap<string, TokenLogprob>;

export function rowKey(requestId: string, index: number): string {
  return `${index}:${requestId}`;
}

export interface StepCoreOptions<T> extends SchedulerConfig {
  /** The pool's shape: numBlocks and blockSize size the KV cache; a handoff names it as its source layout. */
  kvLayout: KvPoolLayout;
  enablePrefixCaching?: boolean;
  enableKvEvents?: boolean;
  /** Lower KV tiers under the pool (RAM, disk), and the pool's bytes for them to copy (none in the simulator). */
  kvTiers?: KvTiers;
  kvBlockIo?: KvBlockIo;
  /** The model's sliding window when every layer has one: the KV cache gives back blocks that fall out of it. */
  slidingWindow?: number;
  tokens: TokenSource<T>;
  text: TextSource;
}

interface RequestState<T> {
  request: Request;
  tokens: T[];
  texts: TextStream[];
  /** Prefill only: hand the request over once its first token is out (disaggregated serving). */
  handoff?: boolean;
}

/** A handed-off request waiting for room in this pool; its source blocks stay pinned meanwhile. */
interface PendingAdoption<T> {
  handoff: KvHandoff;
  tokens: T;
  text: TextStream;
  kvImport: KvImport;
}

export class StepCore<T> {
  readonly scheduler: Scheduler;
  readonly kv: KvCacheManager;
  readonly kvLayout: KvPoolLayout;
  protected readonly tokenSource: TokenSource<T>;
  private readonly textSource: TextSource;
  private readonly states = new Map<string, RequestState<T>>();
  /** Prefill side: blocks of handed-off requests, kept until the decode worker has them. */
  private readonly handoffs: HandoffOutbox;
  /** Decode side: handoffs waiting for room, oldest first, and adoptions not yet reported. */
  private pendingAdoptions: PendingAdoption<T>[] = [];
  private adoptedOut: AdoptedResult[] = [];
  /**
   * Decode side: cached blocks of a handed-off prompt pinned before its KV is fetched (holdCachedPrefix), by request;
   * kept until the request is adopted, recomputed or aborted.
   */
  private readonly prefixHolds = new Map<string, KvPin>();
  /** Decode side: blocks reserved for a handed-off prompt's KV to be written in place (prepareKvImport), by request. */
  private readonly importReservations = new Map<string, { ticket: number; pin: KvPin | null }>();
  private nextImportTicket = 1;
  /** Tokens appended without sampling (TokenSource.forced) since start. */
  private numForcedTokens = 0;
  /** Prefill side: what the prefills to hand off have computed since the last take (the KV transfer streams it). */
  private prefillProgress: PrefillProgress[] = [];

  constructor(options: StepCoreOptions<T>) {
    this.kvLayout = options.kvLayout;
    this.tokenSource = options.tokens;
    this.textSource = options.text;
    this.kv = new KvCacheManager({
      numBlocks: options.kvLayout.numBlocks, blockSize: options.kvLayout.blockSize,
      enablePrefixCaching: options.enablePrefixCaching ?? true, enableEvents: options.enableKvEvents ?? false,
      ...(options.kvTiers !== undefined ? { tiers: options.kvTiers } : {}),
      ...(options.kvBlockIo !== undefined ? { blockIo: options.kvBlockIo } : {}),
      ...(options.slidingWindow !== undefined ? { slidingWindow: options.slidingWindow } : {}),
    });
    this.handoffs = new HandoffOutbox(this.kv);
    this.scheduler = new Scheduler({
      policy: options.policy, maxNumBatchedTokens: options.maxNumBatchedTokens, maxNumSeqs: options.maxNumSeqs,
      maxModelLen: options.maxModelLen, eosTokenIds: options.eosTokenIds,
      longPrefillTokenThreshold: options.longPrefillTokenThreshold,
      ...(options.maxPromptLogprobRows !== undefined ? { maxPromptLogprobRows: options.maxPromptLogprobRows } : {}),
    }, this.kv);
  }

  /** Requests not yet finished (waiting, running or preempted), or handed-off ones waiting for room. */
  get hasWork(): boolean {
    return this.scheduler.numRequests > 0 || this.pendingAdoptions.length > 0;
  }

  hasRequest(requestId: string): boolean {
    return this.states.has(requestId);
  }

  /** Whether a request here (or a handoff waiting for room) runs with this LoRA adapter. */
  usesLora(name: string): boolean {
    for (const state of this.states.values()) if (state.request.engineRequest.lora === name) return true;
    return this.pendingAdoptions.some((pending) => pending.handoff.request.lora === name);
  }

  /** The token state of one completion of a request in the batch (undefined once it left). */
  protected tokenState(requestId: string, index: number): T | undefined {
    return this.states.get(requestId)?.tokens[index];
  }

  /**
   * Queues a request. Throws (InvalidRequestError, RangeError) with a client-fit message if it can never run.
   * With handoff (a prefill worker's request), the request stops after its first token: its KV blocks stay pinned
   * and takeHandoffs() returns what a decode worker needs to continue it. It then needs a seed, chosen here by the
   * token source when the client gave none, so that the decode worker continues the same stream.
   * queuedMs is when the request reached the worker, where its queue time starts: a request that arrived while a
   * step was running is only taken in at the step's end (nowMs), but it has been waiting since it arrived.
   */
  protected addRequest(engineRequest: EngineRequest, nowMs: number, options: { handoff?: boolean; queuedMs?: number } = {}): void {
    if (this.pendingAdoptions.some((p) => p.handoff.requestId === engineRequest.id)) {
      // Else the adoption, retried later, would find the id taken: validation must not fail after it was accepted.
      throw new InvalidRequestError('duplicate_request_id', engineRequest.id, 'a request with this id is already here');
    }
    let accepted = engineRequest;
    if (options.handoff) {
      if (engineRequest.sampling.n !== 1) {
        throw new InvalidRequestError('invalid_request', engineRequest.id, 'only a request with n = 1 can be prefilled for another worker');
      }
      if (engineRequest.sampling.promptLogprobs !== undefined) {
        throw new InvalidRequestError('invalid_request', engineRequest.id, 'a request with prompt logprobs cannot be prefilled for another worker');
      }
      if (engineRequest.sampling.seed === undefined) {
        accepted = { ...engineRequest, sampling: { ...engineRequest.sampling, seed: this.tokenSource.handoffSeed(engineRequest) } };
      }
    }
    const tokens = this.tokenSource.open(accepted);
    let request: Request;
    try {
      request = this.scheduler.addRequest(accepted, nowMs, { queuedMs: options.queuedMs, handOff: options.handoff });
    } catch (error) {
      // Refused (too long, too many sequences): its token states (a grammar's matchers) go with it.
      if (this.tokenSource.close) for (const state of tokens) this.tokenSource.close(state);
      throw error;
    }
    const texts = tokens.map(() => this.textSource.open(accepted.sampling, accepted.promptTokenIds));
    this.states.set(request.id, { request, tokens, texts, handoff: options.handoff });
  }

  /**
   * Stops a request in any state and frees its blocks; returns the closing output of each unfinished completion.
   * A request handed off from here only has its pinned blocks freed (its stream continues on the decode worker);
   * one waiting here for room to adopt is dropped with a closing output.
   */
  protected abortRequest(requestId: string, nowMs: number, reason: FinishReason = 'abort', error?: string,
    errorCode?: EngineErrorCode): EngineOutput[] {
    this.releaseHandoff(requestId);
    this.releasePrefixHold(requestId);
    const pendingAt = this.pendingAdoptions.findIndex((p) => p.handoff.requestId === requestId);
    if (pendingAt >= 0) {
      const [pending] = this.pendingAdoptions.splice(pendingAt, 1);
      this.tokenSource.close?.(pending!.tokens);
      return [notAdoptedOutput(pending!.handoff, nowMs, reason, error)];
    }
    const state = this.states.get(requestId);
    if (!state) return [];
    const unfinished = state.request.sequences.filter((s) => !s.isFinished).map((s) => s.index);
    // Completions not yet forked (n > 1 before the prompt is done) end too.
    for (let index = state.request.sequences.length; index < state.tokens.length; index++) unfinished.push(index);
    this.scheduler.finish(requestId, reason, { nowMs });
    this.forget(state);
    state.request.timestamps.finished = nowMs;
    return unfinished.map((index) => output(state.request, index, [], '', { finishReason: reason, error, ...(errorCode ? { errorCode } : {}) }));
  }

  /** The next step's plan at nowMs (adoptions waiting for room retried first); null when nothing can run. */
  protected planStep(nowMs: number): StepPlan | null {
    if (this.pendingAdoptions.length > 0) this.retryAdoptions(nowMs);
    const plan = this.scheduler.schedule(nowMs);
    if (plan.scheduled.length > 0) return plan;
    this.scheduler.discardPlan(plan);
    return null;
  }

  /**
   * Applies a step's sampled tokens (one per plan.sampleTargets row) at its end: the scheduler's update, text and
   * stop strings, one output per completion that got a token, finished requests forgotten, prefill-only requests
   * handed off. promptLogprobs: one entry per prompt-logprob row of the plan (plan.numPromptLogprobRows, in the
   * order of plan.scheduled), the logprob of the token after the row's position.
   */
  protected applyStep(plan: StepPlan, tokenIds: readonly number[], logprobs: StepLogprobs | undefined,
    startMs: number, endMs: number, promptLogprobs?: readonly TokenLogprob[]): EngineOutput[] {
    if (plan.numPromptLogprobRows > 0) this.recordPromptLogprobs(plan, promptLogprobs);
    const result = this.scheduler.updateFromOutput(plan, tokenIds as number[], endMs, startMs);
    // One object for every output of the step: structured clone keeps it one object in a message too.
    const step: EngineStepFacts = {
      id: plan.stepId, start: startMs, end: endMs, batchSeqs: plan.stats.numScheduledSeqs, batchTokens: plan.numScheduledTokens,
    };
    const outputs: EngineOutput[] = [];
    let handOffs: RequestState<T>[] | undefined;
    for (const out of result.outputs) {
      const state = this.states.get(out.requestId);
      if (!state) continue;
      let { newTokenIds, finishReason, stopReason } = out;
      // The completion's first output (its tokens are all it has) carries the prompt's logprobs.
      const promptLogprobs = state.request.promptLogprobs !== undefined
        && state.request.sequences[out.index]?.outputTokenIds.length === newTokenIds.length ? state.request.promptLogprobs : undefined;
      // Forced tokens follow the sampled one in the same output. A request to hand off takes them along: the decode
      // worker computes them with the sampled token, as this worker's next step would have.
      const forced = finishReason === null ? this.tokenSource.forced?.(state.tokens[out.index]!) : undefined;
      if (forced !== undefined && forced.length > 0) {
        const appended = this.scheduler.appendTokens(out.requestId, out.index, forced, endMs);
        newTokenIds = [...newTokenIds, ...appended.newTokenIds];
        ({ finishReason, stopReason } = appended);
        this.numForcedTokens += appended.numAppended;
      }
      const emitted = this.emitTokens(state, out.index, newTokenIds, finishReason, stopReason,
        logprobs?.get(rowKey(out.requestId, out.index)), endMs);
      if (promptLogprobs !== undefined) emitted.promptLogprobs = promptLogprobs;
      // Forced tokens after a stop string are dropped (emitTokens): they were never output.
      this.numForcedTokens -= newTokenIds.length - emitted.newTokenIds.length;
      emitted.step = step;
      outputs.push(emitted);
      if (state.handoff) (handOffs ??= []).push(state);
    }
    // Only after the loop: one step can finish several completions of a request, and each needs its state.
    for (const out of result.outputs) {
      const state = this.states.get(out.requestId);
      if (state?.request.isFinished) {
        state.request.timestamps.finished ??= endMs;
        this.forget(state);
      }
    }
    this.notePrefillProgress(plan);
    // A prefill-only request that got its first token (and any forced after it) and did not finish on them leaves
    // now, before the next step would feed them.
    if (handOffs) for (const state of handOffs) if (this.states.get(state.request.id) === state) this.handOff(state, endMs);
    return outputs;
  }

  /** Puts a step's prompt-logprob rows into their requests' entries, by prompt position (a recomputed one overwrites). */
  private recordPromptLogprobs(plan: StepPlan, rows: readonly TokenLogprob[] | undefined): void {
    if (rows === undefined || rows.length !== plan.numPromptLogprobRows) {
      throw new RangeError(`step ${plan.stepId} has ${plan.numPromptLogprobRows} prompt-logprob rows; got ${rows?.length ?? 'none'}`);
    }
    let at = 0;
    for (const { sequence, startPosition, numPromptLogprobRows } of plan.scheduled) {
      if (numPromptLogprobRows === 0) continue;
      const { request } = sequence;
      const entries = request.promptLogprobs!; // set up by the request for every one that asks
      for (let k = 0; k < numPromptLogprobRows; k++) entries[startPosition + k + 1] = rows[at++]!;
    }
  }

  /** A step could not run (the forward pass threw): every request in it fails with the reason. */
  protected failStep(plan: StepPlan, message: string, nowMs: number, errorCode?: EngineErrorCode): EngineOutput[] {
    this.scheduler.discardPlan(plan);
    const ids = new Set(plan.scheduled.map((s) => s.sequence.request.id));
    return [...ids].flatMap((id) => this.abortRequest(id, nowMs, 'error', message, errorCode));
  }

  /**
   * Detokenizes a step's tokens of one completion (the sampled one, then any forced ones), applies stop strings,
   * and shapes the output. A stop string ends it at the token that completes it.
   */
  private emitTokens(state: RequestState<T>, index: number, tokenIds: readonly number[], finish: FinishReason | null,
    stopTokenId: number | null, logprob: TokenLogprob | undefined, nowMs: number): EngineOutput {
    const { request } = state;
    const text = state.texts[index]!;
    let delta = '';
    let finishReason: FinishReason | undefined = finish ?? undefined;
    let stopReason: string | number | undefined = stopTokenId ?? undefined;
    let emitted = tokenIds.length;
    for (let i = 0; i < tokenIds.length; i++) {
      const tokenId = tokenIds[i]!;
      // A stop token's own text is left out unless asked for, as vLLM does.
      const endsOnStopToken = finish === 'stop' && stopTokenId === tokenId && i === tokenIds.length - 1;
      if (endsOnStopToken && !request.sampling.includeStopStrInOutput) break;
      const piece = text.push(tokenId);
      delta += piece.delta;
      if (piece.stopped !== undefined) {
        finishReason = 'stop';
        stopReason = piece.stopped;
        emitted = i + 1;
        // Tokens after this one (appended unsampled: jump-forward) are not output: the sequence gives them back, so
        // usage counts only the tokens up to the stop, as it does when the stop falls on a sampled token.
        const dropTokens = tokenIds.length - emitted;
        const sequence = request.sequences[index];
        if (sequence !== undefined && !sequence.isFinished) this.scheduler.finish(request.id, 'stop', { index, nowMs, dropTokens });
        else if (dropTokens > 0) sequence?.dropLastTokens(dropTokens); // it ended on a later one (EOS, length): no KV left
        break;
      }
    }
    if (finishReason !== undefined && !text.done) {
      const tail = text.finish();
      delta += tail.delta;
      // A stop string found only in the text the end of the output flushed (a broken character's U+FFFD) ends it too.
      if (tail.stopped !== undefined) {
        finishReason = 'stop';
        stopReason = tail.stopped;
      }
    }
    return output(request, index, emitted === tokenIds.length ? tokenIds.slice() : tokenIds.slice(0, emitted), delta,
      { finishReason, stopReason, logprobs: logprob ? [logprob] : undefined });
  }

  // -------------------------------------------------------------------------------------------------------------
  // Disaggregated serving

  /**
   * Prefill side, after a step: each request to hand off whose prompt chunk ended short of its first token reports
   * its full blocks so far (their KV is final: the transfer may send them while the next chunk computes); a
   * preempted one reports a reset (its blocks may be rewritten).
   */
  private notePrefillProgress(plan: StepPlan): void {
    const { blockSize } = this.kv;
    for (const sequence of plan.preempted) {
      if (this.states.get(sequence.request.id)?.handoff) this.prefillProgress.push({ requestId: sequence.request.id, fullBlockIds: null });
    }
    for (const { sequence, isDecode, numSamples } of plan.scheduled) {
      if (isDecode || numSamples > 0 || sequence.status !== 'running' || !this.states.get(sequence.request.id)?.handoff) continue;
      const full = Math.floor(sequence.numComputedTokens / blockSize);
      if (full > 0) this.prefillProgress.push({ requestId: sequence.request.id, fullBlockIds: sequence.blockTable.blockIds.slice(0, full) });
    }
  }

  /** Prefill progress since the last call, in order. */
  takePrefillProgress(): PrefillProgress[] {
    const progress = this.prefillProgress;
    this.prefillProgress = [];
    return progress;
  }

  /** Handoffs made since the last call (prefill side), in order. */
  takeHandoffs(): KvHandoff[] {
    return this.handoffs.take();
  }

  /** The decode worker has the blocks (or gave up on them): unpin them. False if nothing was pinned for the request. */
  releaseHandoff(requestId: string): boolean {
    return this.handoffs.release(requestId);
  }

  /** Tokens appended without sampling since start (jump-forward over text a grammar forces). */
  get forcedTokens(): number {
    return this.numForcedTokens;
  }

  /** Handed-off requests whose blocks are still pinned here. */
  get numParkedHandoffs(): number {
    return this.handoffs.numParked;
  }

  get numPendingAdoptions(): number {
    return this.pendingAdoptions.length;
  }

  /**
   * Decode side, before a handed-off request's KV is fetched from another process: pins the leading blocks of its
   * full-block hashes this pool already holds, so that only the rest need to move and nothing evicts these
   * meanwhile. Returns how many blocks are held. The adoption (imported or recomputed) or an abort of the request
   * drops the pin; the import must then cover at least the blocks after those held.
   */
  holdCachedPrefix(requestId: string, blockHashes: readonly BlockHash[]): number {
    this.releasePrefixHold(requestId);
    const pin = this.kv.pinCachedPrefix(blockHashes);
    if (pin === null) return 0;
    this.prefixHolds.set(requestId, pin);
    return pin.blocks.length;
  }

  private releasePrefixHold(requestId: string): void {
    const reservation = this.importReservations.get(requestId);
    if (reservation !== undefined) {
      this.importReservations.delete(requestId);
      if (reservation.pin !== null) this.kv.unpin(reservation.pin);
    }
    const pin = this.prefixHolds.get(requestId);
    if (pin === undefined) return;
    this.prefixHolds.delete(requestId);
    this.kv.unpin(pin);
  }

  /**
   * Decode side, before a handed-off prompt's KV comes from another process: holds its cached prefix (as
   * holdCachedPrefix) and reserves fresh blocks of this pool for the other numBlocks - held blocks, so the transfer
   * can write them where the request will read them and the adoption (adopt with inPlace) copies nothing. The
   * reservation is made only if the pool keeps a free block per running sequence after it (their next decode
   * blocks: a transfer must not make the running requests preempt each other); without that room (or with reserve
   * false), blockIds is null and only the hold is made. Dropped, with the hold, by the adoption (the table takes the
   * blocks), an abort, or releaseKvImport.
   */
  prepareKvImport(requestId: string, blockHashes: readonly BlockHash[], numBlocks: number, reserve = true): KvImportPreparation {
    if (!Number.isSafeInteger(numBlocks) || numBlocks < 1) throw new RangeError(`numBlocks must be >= 1, got ${numBlocks}`);
    const held = Math.min(this.holdCachedPrefix(requestId, blockHashes.slice(0, numBlocks)), numBlocks);
    const room = this.kv.numFreeBlocks - this.scheduler.sequences().running.length;
    const pin = reserve && numBlocks - held <= room ? this.kv.reserveBlocks(numBlocks - held) : null;
    const ticket = this.nextImportTicket++;
    this.importReservations.set(requestId, { ticket, pin });
    return { ticket, held, blockIds: pin === null ? null : pin.blocks.map((block) => block.id) };
  }

  /**
   * The KV prepared for will not come after all (the transfer failed or is not needed): the reservation and the
   * hold go, unless a later preparation for the request replaced them (ticket). False if there
   * was nothing to release.
   */
  releaseKvImport(requestId: string, ticket: number): boolean {
    const reservation = this.importReservations.get(requestId);
    if (reservation === undefined || reservation.ticket !== ticket) return false;
    this.releasePrefixHold(requestId);
    return true;
  }

  /** Blocks reserved for in-place imports (tests check none outlives its request). */
  get numImportReservations(): number {
    return this.importReservations.size;
  }

  /** Adoptions completed since the last call (decode side): the source blocks they name can be released. */
  takeAdopted(): AdoptedResult[] {
    const adopted = this.adoptedOut;
    this.adoptedOut = [];
    return adopted;
  }

  /**
   * Continues a request another worker prefilled (decode side). The token state resumes the prefill worker's
   * stream and the text state its text, so the stream goes on exactly as if the request had never moved. With a
   * KV import, the blocks this pool lacks come through it; returns null when the pool or the batch has no room yet:
   * the adoption is retried before each step, and reported by takeAdopted() once done. With a reason instead, or
   * when the import fails, the prompt is recomputed here ('recompute'). Throws InvalidRequestError for a request
   * that could never run on this worker, and an Error for a handoff that contradicts itself.
   */
  protected adoptHandoff(handoff: KvHandoff, nowMs: number, kvImport: KvImport | { recompute: string }): AdoptedResult | null {
    const id = handoff.requestId;
    if (this.states.has(id) || this.pendingAdoptions.some((p) => p.handoff.requestId === id)) {
      throw new InvalidRequestError('duplicate_request_id', id, 'a request with this id is already here');
    }
    let tokens: T | undefined;
    try {
      tokens = this.tokenSource.resume(handoff);
      const text = this.textSource.open(handoff.request.sampling, handoff.request.promptTokenIds);
      for (const tokenId of handoff.outputTokenIds) text.push(tokenId); // its text went out from the prefill worker
      if ('recompute' in kvImport) return this.adoptByRecompute(handoff, tokens, text, nowMs, kvImport.recompute);
      const pending: PendingAdoption<T> = { handoff, tokens, text, kvImport };
      const result = this.tryAdopt(pending, nowMs);
      if (result === null) this.pendingAdoptions.push(pending);
      return result;
    } catch (error) {
      // Refused here: what was opened or held for it goes (its token state, the prefix hold and blocks reserved
      // for its import), since no abort will follow for a request this worker never took.
      if (tokens !== undefined) this.tokenSource.close?.(tokens);
      this.releasePrefixHold(id);
      throw error;
    }
  }

  /** A handed-off request this worker refuses before adopting it: its prefix hold and import reservation go. */
  protected refuseAdoption(requestId: string): void {
    this.releasePrefixHold(requestId);
  }

  private handOff(state: RequestState<T>, nowMs: number): void {
    const { request } = state;
    const given = this.scheduler.handOff(request.id);
    this.forget(state);
    this.handoffs.add({
      requestId: request.id, request: request.engineRequest, outputTokenIds: given.outputTokenIds.slice(),
      numComputedTokens: given.numComputedTokens, blockSize: this.kv.blockSize, sourceBlockIds: given.blockIds.slice(),
      blockHashes: given.blockHashes.slice(), sampler: this.tokenSource.handoffState(request, state.tokens[0]!),
      numCachedTokens: request.numCachedTokens, timestamps: copyTimestamps(request.timestamps),
      sourceLayout: this.kvLayout, createdMs: nowMs,
    }, given.pin);
  }

  /** Drops a request's state, closing its token states. */
  private forget(state: RequestState<T>): void {
    this.states.delete(state.request.id);
    if (this.tokenSource.close) for (const tokens of state.tokens) this.tokenSource.close(tokens);
  }

  private tryAdopt(pending: PendingAdoption<T>, nowMs: number): AdoptedResult | null {
    const { handoff, kvImport } = pending;
    // The source was filled only after the blocks held here: an import must not reach below them.
    const held = this.prefixHolds.get(handoff.requestId)?.blocks.length ?? 0;
    const reservation = kvImport.inPlace ? this.importReservations.get(handoff.requestId)?.pin ?? undefined : undefined;
    if (kvImport.inPlace && reservation === undefined) {
      return this.adoptByRecompute(handoff, pending.tokens, pending.text, nowMs, 'no blocks were reserved here for its KV');
    }
    if (reservation !== undefined && this.kv.blocksFor(handoff.numComputedTokens) !== held + reservation.blocks.length) {
      return this.adoptByRecompute(handoff, pending.tokens, pending.text, nowMs,
        `${held} held and ${reservation.blocks.length} reserved blocks do not cover its ${handoff.numComputedTokens} positions`);
    }
    let request: Request | null;
    try {
      request = this.scheduler.adoptRequest(handoff.request, nowMs, adoptedState(handoff), {
        numTokens: handoff.numComputedTokens, blockHashes: handoff.blockHashes,
        ...(reservation !== undefined ? { filled: reservation.blocks } : {}),
        fill: (table, fromBlock, toBlock) => {
          if (fromBlock < held) throw new Error(`${held} blocks were held as cached, but only ${fromBlock} were found`);
          kvImport.fill(table, fromBlock, toBlock);
        },
      });
    } catch (error) {
      if (error instanceof InvalidRequestError) {
        this.releasePrefixHold(handoff.requestId);
        throw error;
      }
      return this.adoptByRecompute(handoff, pending.tokens, pending.text, nowMs, `KV import failed: ${(error as Error).message}`);
    }
    if (request === null) return null;
    this.releasePrefixHold(request.id);
    const transfer = kvImport.stats(request.id, nowMs);
    request.timestamps.kvTransfer = {
      start: transfer.startMs, end: transfer.endMs, bytes: transfer.bytes, blocks: transfer.blocks, link: kvLinkName(transfer.channel),
    };
    this.states.set(request.id, { request, tokens: [pending.tokens], texts: [pending.text] });
    const result: AdoptedResult = { requestId: request.id, status: 'imported', transfer };
    this.adoptedOut.push(result);
    return result;
  }

  private adoptByRecompute(handoff: KvHandoff, tokens: T, text: TextStream, nowMs: number, error: string): AdoptedResult {
    this.releasePrefixHold(handoff.requestId);
    const request = this.scheduler.adoptRequest(handoff.request, nowMs, adoptedState(handoff))!;
    this.states.set(request.id, { request, tokens: [tokens], texts: [text] });
    const result: AdoptedResult = { requestId: request.id, status: 'recompute', error };
    this.adoptedOut.push(result);
    return result;
  }

  /** Oldest first; the first that still does not fit keeps its place and everything behind it waits too. */
  private retryAdoptions(nowMs: number): void {
    while (this.pendingAdoptions.length > 0) {
      if (this.tryAdopt(this.pendingAdoptions[0]!, nowMs) === null) return;
      this.pendingAdoptions.shift();
    }
  }

  // -------------------------------------------------------------------------------------------------------------
  // What the worker reports

  stats(): EngineStats {
    const kv = this.kv.stats();
    const scheduler = this.scheduler.stats();
    return {
      numRunning: scheduler.numRunning, numWaiting: scheduler.numWaiting,
      kvBlocksUsed: kv.numUsedBlocks, kvBlocksTotal: kv.numBlocks,
      prefixCacheQueries: kv.prefixQueryTokens, prefixCacheHits: kv.prefixHitTokens,
      preemptions: scheduler.numPreemptions, kvEvictions: kv.evictions,
      ...(kv.tiers !== undefined ? { kvTiers: kv.tiers } : {}),
      allocationFailures: { kvBlocks: scheduler.numKvAllocationFailures },
    };
  }

  /**
   * Copies the next cached blocks the pool would evict down to the lower KV tiers, at most their per-call bound
   * (tiers.ts says why that bounds the time): the worker calls it between steps (window Infinity when idle: every
   * cached free block, chunk by chunk). Returns how many were copied.
   */
  offloadKv(maxBlocks?: number, window?: number): number {
    return this.kv.offloadEvictable(maxBlocks, window);
  }

  /** The router's load view of this worker: prompt tokens still to compute, decode blocks held, KV use. */
  load(): WorkerLoad {
    const { running, waiting } = this.scheduler.sequences();
    let activePrefillTokens = 0;
    // A prefix-cache block shared by several running requests is one block of the pool: counted once, as the
    // router counts its own (active-requests.ts), or a burst on one prefix would look like its copies.
    const decodeBlocks = new Set<KvBlock>();
    for (const sequence of waiting) activePrefillTokens += sequence.numTokens;
    for (const sequence of running) {
      const remaining = sequence.numTokens - sequence.numComputedTokens;
      if (remaining > 1) activePrefillTokens += remaining;
      for (const block of sequence.blockTable.heldBlocks) decodeBlocks.add(block);
    }
    return {
      numRunning: running.length, numWaiting: waiting.length, activePrefillTokens, activeDecodeBlocks: decodeBlocks.size,
      kvUsage: this.kv.pool.numUsedBlocks / this.kv.numBlocks,
    };
  }

  takeKvEvents(): KvEvent[] {
    return this.kv.takeEvents();
  }

  /**
   * Forgets every cached prefix (a 'cleared' KV event tells the router); false, and nothing done, while any block
   * is in use (a running request or a pinned handoff).
   */
  resetPrefixCache(): boolean {
    return this.kv.resetPrefixCache();
  }
}

function adoptedState(handoff: KvHandoff): AdoptedState {
  return { outputTokenIds: handoff.outputTokenIds, numCachedTokens: handoff.numCachedTokens, timestamps: handoff.timestamps };
}

/**
 * One output of a completion. Its timestamps are a snapshot: the request's own keep changing after the output is
 * handed out (in this thread, or until a worker thread posts it).
 */
function output(request: Request, index: number, newTokenIds: number[], textDelta: string, fields: {
  finishReason?: FinishReason; stopReason?: string | number; logprobs?: TokenLogprob[]; error?: string; errorCode?: EngineErrorCode;
}): EngineOutput {
  const sequence = request.sequences[index];
  const result: EngineOutput = {
    requestId: request.id, index, newTokenIds, textDelta, logprobs: fields.logprobs, finishReason: fields.finishReason,
    stopReason: fields.stopReason, error: fields.error, ...(fields.errorCode ? { errorCode: fields.errorCode } : {}),
    usage: {
      promptTokens: request.promptTokenIds.length,
      completionTokens: sequence ? sequence.outputTokenIds.length : 0,
      cachedTokens: request.numCachedTokens,
    },
    timestamps: copyTimestamps(request.timestamps),
  };
  const { traceparent } = request.engineRequest;
  if (traceparent !== undefined) result.traceparent = traceparent;
  return result;
}

/** The closing output of a handed-off request stopped before this worker took it in. */
function notAdoptedOutput(handoff: KvHandoff, nowMs: number, reason: FinishReason, error?: string): EngineOutput {
  const { traceparent } = handoff.request;
  return {
    requestId: handoff.requestId, index: 0, newTokenIds: [], textDelta: '', finishReason: reason, error,
    ...(traceparent !== undefined ? { traceparent } : {}),
    usage: {
      promptTokens: handoff.request.promptTokenIds.length, completionTokens: handoff.outputTokenIds.length,
      cachedTokens: handoff.numCachedTokens,
    },
    timestamps: { ...copyTimestamps(handoff.timestamps), finished: nowMs },
  };
}
