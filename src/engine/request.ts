// A request as the scheduler sees it. There are no prefill and decode phases: each sequence has tokenIds (prompt,
// then output) and numComputedTokens catching up with them. A prompt chunk, a prefix-cache hit, a decode step and
// the recompute after preemption are all "compute the next tokens of this sequence".
//
// A request with sampling.n = k starts as one sequence (index 0). When its prompt is computed, the step samples k
// tokens from the last prompt position and the request forks into k sequences that share the prompt's full blocks.

import type { EngineRequest, FinishReason, RequestTimestamps, SamplingParams, TokenLogprob } from './types.ts';
import type { BlockTable } from './kv-cache/manager.ts';

/** A copy of a request's timestamps that later steps cannot change (the arrays and the summary copied too). */
export function copyTimestamps(timestamps: RequestTimestamps): RequestTimestamps {
  const { decodeSteps } = timestamps;
  return { ...timestamps, prefillChunks: timestamps.prefillChunks.slice(), ...(decodeSteps ? { decodeSteps: { ...decodeSteps } } : {}) };
}

export type SequenceStatus =
  | 'waiting' | 'running' | 'preempted'
  | 'finished_stopped' | 'finished_length' | 'finished_aborted' | 'finished_error'
  /** Given to another worker after its prompt (disaggregated prefill): it goes on there, not here. */
  | 'handed_off';

const FINISHED_STATUS: Record<FinishReason, SequenceStatus> = {
  stop: 'finished_stopped', length: 'finished_length', abort: 'finished_aborted', error: 'finished_error',
};

export function finishedStatus(reason: FinishReason): SequenceStatus {
  return FINISHED_STATUS[reason];
}

// ---------------------------------------------------------------------------------------------------------------
// Sequence

export class Sequence {
  readonly request: Request;
  /** Which of the request's n completions this is (0-based). */
  readonly index: number;
  /** Prompt then output: every token whose KV the sequence needs. */
  readonly tokenIds: number[];
  readonly outputTokenIds: number[];
  numComputedTokens = 0;
  status: SequenceStatus = 'waiting';
  readonly blockTable: BlockTable;
  finishReason: FinishReason | null = null;
  /** For finishReason 'stop' on a token: the token id that ended the sequence. */
  stopReason: number | null = null;
  numPreemptions = 0;
  /** Tokens computed before its last preemption: a chunk below this recomputes them. */
  recomputeUpTo = 0;

  constructor(request: Request, index: number, tokenIds: number[], outputTokenIds: number[], blockTable: BlockTable) {
    this.request = request;
    this.index = index;
    this.tokenIds = tokenIds;
    this.outputTokenIds = outputTokenIds;
    this.blockTable = blockTable;
  }

  get numTokens(): number {
    return this.tokenIds.length;
  }

  get numPromptTokens(): number {
    return this.request.promptTokenIds.length;
  }

  get isFinished(): boolean {
    return this.finishReason !== null;
  }

  /** Whether computing the rest of this sequence forks the request into its n samples. */
  get willFork(): boolean {
    return this.index === 0 && this.request.sequences.length < this.request.sampling.n;
  }

  /**
   * Whether the step computing this sequence's prompt positions returns their logits (the request asked for prompt
   * logprobs, and the prompt has not produced its first token yet; after a fork the samples have it).
   */
  get needsPromptLogprobs(): boolean {
    return this.request.sampling.promptLogprobs !== undefined && this.outputTokenIds.length === 0;
  }

  /** Batch seats the sequence holds: its own, plus before the fork the n - 1 samples it is about to become. */
  get numSeats(): number {
    return this.willFork ? this.request.sampling.n : 1;
  }

  appendToken(tokenId: number): void {
    this.tokenIds.push(tokenId);
    this.outputTokenIds.push(tokenId);
  }

  /** Takes back the last `count` output tokens (the caller checks that none was computed). */
  dropLastTokens(count: number): void {
    this.tokenIds.length -= count;
    this.outputTokenIds.length -= count;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Request

export type RequestStatus = 'waiting' | 'running' | 'preempted' | 'finished';

export class Request {
  readonly id: string;
  readonly engineRequest: EngineRequest;
  readonly promptTokenIds: readonly number[];
  readonly sampling: SamplingParams;
  /** Lower value = more important. */
  readonly priority: number;
  readonly arrivalMs: number;
  readonly deadlineMs: number | undefined;
  readonly adapterId: string | undefined;
  /** Order in which the scheduler received the request: breaks ties between equal arrival times. */
  readonly arrivalOrder: number;
  /** Sequence 0 from the start; 1..n-1 once the prompt is computed. */
  readonly sequences: Sequence[] = [];
  /** Prompt tokens found in the prefix cache on first admission (usage.cachedTokens). */
  numCachedTokens = 0;
  wasAdmitted = false;
  /**
   * A prefill-only request: once its prompt is computed its KV blocks are pinned and copied to another worker
   * (Scheduler.handOff), so none of them is given back before then, sliding window or not.
   */
  handsOff = false;
  /**
   * With sampling.promptLogprobs: each prompt position's entry as the steps computing the prompt produce it (null at
   * position 0 and until computed); the completions' first outputs carry it.
   */
  promptLogprobs: (TokenLogprob | null)[] | undefined;
  readonly timestamps: RequestTimestamps;

  constructor(engineRequest: EngineRequest, arrivalOrder: number, queuedMs: number, adapterId?: string) {
    this.id = engineRequest.id;
    this.engineRequest = engineRequest;
    this.promptTokenIds = engineRequest.promptTokenIds;
    this.sampling = engineRequest.sampling;
    if (this.sampling.promptLogprobs !== undefined) this.promptLogprobs = new Array<TokenLogprob | null>(this.promptTokenIds.length).fill(null);
    this.priority = engineRequest.priority;
    this.arrivalMs = engineRequest.arrivalMs;
    this.deadlineMs = engineRequest.deadlineMs;
    this.adapterId = adapterId;
    this.arrivalOrder = arrivalOrder;
    this.timestamps = { arrival: engineRequest.arrivalMs, queued: queuedMs, prefillChunks: [] };
  }

  get status(): RequestStatus {
    let waiting = false;
    let preempted = false;
    for (const sequence of this.sequences) {
      if (sequence.status === 'running') return 'running';
      if (sequence.status === 'waiting') waiting = true;
      if (sequence.status === 'preempted') preempted = true;
    }
    return preempted ? 'preempted' : waiting ? 'waiting' : 'finished';
  }

  /** All sequences finished (before the fork there is only sequence 0, and if it ends the request never forks). */
  get isFinished(): boolean {
    for (const sequence of this.sequences) if (sequence.finishReason === null) return false;
    return true;
  }

  /** Sequence 0's view, the whole request when n = 1. */
  get outputTokenIds(): readonly number[] {
    return this.sequences[0]!.outputTokenIds;
  }

  get numComputedTokens(): number {
    return this.sequences[0]!.numComputedTokens;
  }

  get blockTable(): BlockTable {
    return this.sequences[0]!.blockTable;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Stop conditions checked after each sampled token (stop strings are the detokenizer's, outside the scheduler)

export interface StopDecision {
  reason: 'stop' | 'length';
  stopReason: number | null;
}

/**
 * Whether the token just appended ends the sequence. EOS (unless ignoreEos) and stop token ids count only after
 * minTokens outputs, matching a sampler that masks them until then; maxTokens and the context length always apply.
 * Under a grammar, EOS always ends it: the grammar allows EOS only once its text is complete (or when nothing else
 * is left), so any token after it would fall outside the grammar, whatever minTokens or ignoreEos ask.
 */
export function checkStop(sequence: Sequence, eosTokenIds: ReadonlySet<number>, maxModelLen: number): StopDecision | null {
  const { sampling } = sequence.request;
  const numOutputTokens = sequence.outputTokenIds.length;
  const lastTokenId = sequence.tokenIds[sequence.tokenIds.length - 1]!;
  if (sampling.guided !== undefined && eosTokenIds.has(lastTokenId)) return { reason: 'stop', stopReason: lastTokenId };
  if (numOutputTokens > sampling.minTokens) {
    if (!sampling.ignoreEos && eosTokenIds.has(lastTokenId)) return { reason: 'stop', stopReason: lastTokenId };
    if (sampling.stopTokenIds.includes(lastTokenId)) return { reason: 'stop', stopReason: lastTokenId };
  }
  if (numOutputTokens >= sampling.maxTokens) return { reason: 'length', stopReason: null };
  if (sequence.numTokens >= maxModelLen) return { reason: 'length', stopReason: null };
  return null;
}
