// The continuous-batching scheduler: synchronous, no I/O, no clock of its own. schedule(nowMs) decides what the next
// forward pass computes; updateFromOutput(plan, sampledTokenIds, nowMs) applies what it produced. Only the engine
// loop around it awaits anything, and tests drive it step by step without a model.
//
// Each step:
//   1. running sequences, in admission order, each gets its remaining tokens (1 for a decode, a chunk for an
//      unfinished prompt) within the token budget. When the KV pool has no room, the running sequence the policy
//      ranks last is preempted (possibly the one asking) and its blocks freed: preemption by recompute.
//   2. if nothing was preempted, waiting sequences in policy order are admitted while the token budget, the seat
//      budget (maxNumSeqs) and the pool allow, each starting from its longest prefix-cache hit. The first that does
//      not fit stops admission, so nobody is overtaken by a smaller request behind it (no starvation).
//      A sequence whose tokens are all cached computes only its last token: the block that token ends is not
//      shared but copied into a fresh one (plan.blockCopies), which the engine does before the forward pass.
// A sequence whose step reaches its last token gets logits and a sampled token; a prompt chunk short of the end
// gets neither.
//
// Progress is guaranteed: the context limit is capped so that one sequence alone always fits the pool, and the
// sequence the policy ranks first is never the victim while another is running.

import { KvCacheManager } from './kv-cache/manager.ts';
import type { BlockTable, CachedPrefix, KvBlockCopy, KvPin } from './kv-cache/manager.ts';
import type { KvBlock } from './kv-cache/free-block-queue.ts';
import type { BlockHash } from '../protocols/kv-events.ts';
import { InvalidRequestError, type RejectionCode } from './errors.ts';
import { Request, Sequence, checkStop, copyTimestamps, finishedStatus } from './request.ts';
import type { EngineRequest, FinishReason, RequestTimestamps, SchedulingPolicy } from './types.ts';

// ---------------------------------------------------------------------------------------------------------------
// Configuration and the shapes of a step

export interface SchedulerConfig {
  /** Default 'fcfs'. */
  policy?: SchedulingPolicy;
  /** Tokens computed per step, all sequences together. */
  maxNumBatchedTokens: number;
  /** Sequences per step (a request with n samples holds n). */
  maxNumSeqs: number;
  /** Longest sequence (prompt + output) in tokens; also capped by what one sequence can hold in the pool. */
  maxModelLen: number;
  /** The model's end-of-generation token ids. */
  eosTokenIds?: readonly number[];
  /** Longest prompt chunk one sequence gets per step, so one long prompt cannot take a whole step (0 = no cap). */
  longPrefillTokenThreshold?: number;
  /**
   * Logits rows per step for prompt logprobs (sampling.promptLogprobs), all sequences together: a request asking for
   * them computes its prompt in chunks of at most this many positions, so the step's logits stay bounded (each row
   * is a vocabulary of floats). Default DEFAULT_MAX_PROMPT_LOGPROB_ROWS.
   */
  maxPromptLogprobRows?: number;
}

export const DEFAULT_MAX_PROMPT_LOGPROB_ROWS = 256;

export interface ScheduledSequence {
  readonly sequence: Sequence;
  /** First position computed this step: sequence.numComputedTokens when scheduled. */
  readonly startPosition: number;
  readonly numNewTokens: number;
  /**
   * Prompt positions from startPosition whose logits rows this step returns for prompt logprobs (each row gives the
   * logprob of the token after its position); 0 unless sequence.needsPromptLogprobs.
   */
  readonly numPromptLogprobRows: number;
  /**
   * Logits rows to sample from this sequence's last new token: 0 for a prompt chunk short of the end, 1 normally,
   * n when the step completes the prompt of a request with n samples (it forks on the result).
   */
  readonly numSamples: number;
  /** Feeds only the last sampled token (a decode step) rather than prompt or recompute tokens. */
  readonly isDecode: boolean;
}

/** Who a sampled row belongs to; the sampler keeps one random stream per (request, completionIndex). */
export interface SampleTarget {
  readonly request: Request;
  readonly completionIndex: number;
}

export interface StepStats {
  numRunning: number;
  /** Waiting and preempted sequences. */
  numWaiting: number;
  numScheduledSeqs: number;
  numScheduledTokens: number;
  numPrefillTokens: number;
  numDecodeTokens: number;
  numAdmitted: number;
  numPreempted: number;
  kvUsedBlocks: number;
  kvTotalBlocks: number;
}

export interface StepPlan {
  readonly stepId: number;
  readonly nowMs: number;
  readonly scheduled: readonly ScheduledSequence[];
  /** One per logits row, in row order: the rows of scheduled[0] first, then scheduled[1]'s, and so on. */
  readonly sampleTargets: readonly SampleTarget[];
  /**
   * Logits rows after the sampled ones: every scheduled sequence's numPromptLogprobRows, in the order of scheduled.
   */
  readonly numPromptLogprobRows: number;
  readonly numScheduledTokens: number;
  /** Sequences preempted while making this plan (back in the waiting queue, blocks freed). */
  readonly preempted: readonly Sequence[];
  /**
   * Blocks to copy before the forward pass (copy-on-write of a fully cached prompt's last block). The sources stay
   * pinned until updateFromOutput or discardPlan, whatever happens to the sequences meanwhile.
   */
  readonly blockCopies: readonly KvBlockCopy[];
  readonly stats: StepStats;
}

/** What one sequence got from a step. */
export interface SequenceOutput {
  requestId: string;
  /** Completion index within the request's n samples. */
  index: number;
  newTokenIds: number[];
  finishReason: FinishReason | null;
  /** The stop token id for finishReason 'stop'. */
  stopReason: number | null;
}

export interface StepResult {
  outputs: SequenceOutput[];
  /** Requests whose every sequence has now finished; the scheduler has forgotten them. */
  finishedRequests: Request[];
}

// ---------------------------------------------------------------------------------------------------------------
// Handing a request between workers (disaggregated prefill): the scheduler's half. It decides which blocks hold
// the request's KV and what travels with them; copying the bytes is the engine's (src/engine/handoff.ts).

/** What the prefill side's scheduler gives up: the request, its computed KV's blocks (pinned), and their identity. */
export interface SchedulerHandoff {
  readonly request: Request;
  /** Prompt then sampled tokens. */
  readonly tokenIds: readonly number[];
  readonly outputTokenIds: readonly number[];
  /** Positions whose KV the blocks hold: all but the last sampled token, which the next step would have fed. */
  readonly numComputedTokens: number;
  /** blocksFor(numComputedTokens) block ids in position order (the last one partial unless the prompt fills it). */
  readonly blockIds: readonly number[];
  /** Chained hashes of the full blocks among them. */
  readonly blockHashes: readonly BlockHash[];
  /** Keeps the blocks in use after the request is gone; KvCacheManager.unpin once they have been copied. */
  readonly pin: KvPin;
}

/** What the request already went through elsewhere, carried into this scheduler. */
export interface AdoptedState {
  /** Tokens sampled elsewhere (at least the first). */
  outputTokenIds: readonly number[];
  /** Prompt tokens the prefill worker found in its prefix cache (usage.cachedTokens). */
  numCachedTokens: number;
  /** The request's timestamps so far; they replace this scheduler's own. */
  timestamps?: RequestTimestamps;
}

/** KV computed elsewhere for the first numTokens positions of an adopted request. */
export interface KvImport {
  numTokens: number;
  /** The source's hashes of the full blocks among them; this worker's must agree (same salt, block size, hash). */
  blockHashes?: readonly BlockHash[];
  /**
   * Copies the KV of blocks [fromBlock, toBlock) into table.blocks[fromBlock, toBlock): the blocks this worker's
   * prefix cache did not already hold. Throws if it cannot; the adoption then leaves nothing behind.
   */
  fill(table: BlockTable, fromBlock: number, toBlock: number): void;
  /**
   * Blocks of this pool that already hold the KV of the positions after the cached prefix (written in place,
   * KvCacheManager.reserveBlocks): the table takes them instead of fresh blocks, after exactly the
   * blocksFor(numTokens) - filled.length leading blocks of the prefix cache; fill is still called for them (nothing
   * to copy). Throws when the prefix cache holds fewer.
   */
  filled?: readonly KvBlock[];
}

export interface SchedulerStats {
  numRunning: number;
  numWaiting: number;
  numRequests: number;
  numSteps: number;
  numPreemptions: number;
  /** Times a running sequence needed KV blocks the pool did not have (each such shortfall preempted at least one sequence). */
  numKvAllocationFailures: number;
}

// ---------------------------------------------------------------------------------------------------------------
// Policies: a total order on sequences, best first. The waiting queue is kept in this order and the running
// sequence ranked last is the preemption victim.

type SequenceOrder = (a: Sequence, b: Sequence) => number;

function compareNumbers(a: number, b: number): number {
  return a < b ? -1 : a > b ? 1 : 0;
}

const byArrival: SequenceOrder = (a, b) =>
  compareNumbers(a.request.arrivalMs, b.request.arrivalMs)
  || a.request.arrivalOrder - b.request.arrivalOrder
  || a.index - b.index;

const byPriority: SequenceOrder = (a, b) => compareNumbers(a.request.priority, b.request.priority) || byArrival(a, b);

/** Earliest deadline first; requests without a deadline after every request with one, then by priority. */
const byDeadline: SequenceOrder = (a, b) =>
  compareNumbers(a.request.deadlineMs ?? Infinity, b.request.deadlineMs ?? Infinity) || byPriority(a, b);

const POLICY_ORDER: Record<SchedulingPolicy, SequenceOrder> = { fcfs: byArrival, priority: byPriority, deadline: byDeadline };

/**
 * What a plan's prompt-logprob rows score, in row order: the prompt token after each row's position, and the
 * alternatives its request asked for.
 */
export function promptLogprobTargets(plan: StepPlan): { tokenIds: number[]; numTops: number[] } {
  const tokenIds: number[] = [];
  const numTops: number[] = [];
  for (const { sequence, startPosition, numPromptLogprobRows } of plan.scheduled) {
    const { promptTokenIds, sampling } = sequence.request;
    for (let k = 0; k < numPromptLogprobRows; k++) {
      tokenIds.push(promptTokenIds[startPosition + k + 1]!);
      numTops.push(sampling.promptLogprobs!);
    }
  }
  return { tokenIds, numTops };
}

/** Prompt positions in [startPosition, startPosition + numNewTokens) before the prompt's last: one logits row each. */
function promptLogprobRows(sequence: Sequence, startPosition: number, numNewTokens: number): number {
  return Math.max(0, Math.min(startPosition + numNewTokens, sequence.numPromptTokens - 1) - startPosition);
}

// ---------------------------------------------------------------------------------------------------------------

/**
 * A ScheduledSequence while the plan is being made. It goes into the plan as is, and serves as the SampleTarget of
 * its row when it samples one: a step allocates as little as possible per sequence.
 */
interface PlanEntry extends ScheduledSequence, SampleTarget {
  /** Its sequence was preempted later in the same step. */
  cancelled: boolean;
}

export class Scheduler {
  readonly kv: KvCacheManager;
  readonly policy: SchedulingPolicy;
  readonly maxNumBatchedTokens: number;
  readonly maxNumSeqs: number;
  /** The context limit in force: the configured one, or less when one sequence of it would not fit the pool. */
  readonly maxModelLen: number;
  readonly longPrefillTokenThreshold: number;
  readonly maxPromptLogprobRows: number;
  private readonly eosTokenIds: ReadonlySet<number>;
  private readonly order: SequenceOrder;

  private readonly requests = new Map<string, Request>();
  /** Sorted by the policy order, best first. */
  private waiting: Sequence[] = [];
  /** In admission order. */
  private running: Sequence[] = [];
  /** Sum of numSeats over running sequences; admission keeps it <= maxNumSeqs. */
  private runningSeats = 0;
  private outstandingPlan: StepPlan | null = null;
  private nextStepId = 1;
  private nextArrivalOrder = 0;
  private numPreemptions = 0;
  private numKvAllocationFailures = 0;

  constructor(config: SchedulerConfig, kv: KvCacheManager) {
    const positive = (name: string, value: number): number => {
      if (!Number.isSafeInteger(value) || value < 1) throw new RangeError(`${name} must be a positive integer, got ${value}`);
      return value;
    };
    this.kv = kv;
    this.policy = config.policy ?? 'fcfs';
    if (!(this.policy in POLICY_ORDER)) throw new RangeError(`unknown scheduling policy ${JSON.stringify(this.policy)} (fcfs, priority, deadline)`);
    this.order = POLICY_ORDER[this.policy];
    this.maxNumBatchedTokens = positive('maxNumBatchedTokens', config.maxNumBatchedTokens);
    this.maxNumSeqs = positive('maxNumSeqs', config.maxNumSeqs);
    // A sequence of N tokens needs blocks for N positions (its last token is fed next step); N stays below the limit.
    this.maxModelLen = Math.min(positive('maxModelLen', config.maxModelLen), kv.numBlocks * kv.blockSize + 1);
    this.longPrefillTokenThreshold = config.longPrefillTokenThreshold ?? 0;
    if (!Number.isSafeInteger(this.longPrefillTokenThreshold) || this.longPrefillTokenThreshold < 0) {
      throw new RangeError(`longPrefillTokenThreshold must be an integer >= 0, got ${config.longPrefillTokenThreshold}`);
    }
    this.maxPromptLogprobRows = positive('maxPromptLogprobRows', config.maxPromptLogprobRows ?? DEFAULT_MAX_PROMPT_LOGPROB_ROWS);
    this.eosTokenIds = new Set(config.eosTokenIds ?? []);
  }

  // -------------------------------------------------------------------------------------------------------------
  // Requests in

  /**
   * Queues a request; throws InvalidRequestError for one that could never run. queuedMs (at most nowMs) is when it
   * reached the worker, where its queue time starts, when that was before the worker could take it in. handOff marks
   * a prefill-only request (handOff() takes it once its prompt is computed): its prompt blocks are all kept until then.
   */
  addRequest(engineRequest: EngineRequest, nowMs: number,
    options: { adapterId?: string; queuedMs?: number; handOff?: boolean } = {}): Request {
    this.validate(engineRequest);
    const queuedMs = options.queuedMs !== undefined && Number.isFinite(options.queuedMs) ? Math.min(options.queuedMs, nowMs) : nowMs;
    const request = new Request(engineRequest, this.nextArrivalOrder++, queuedMs, options.adapterId ?? engineRequest.lora);
    request.handsOff = options.handOff === true;
    const adapterId = options.adapterId ?? engineRequest.lora;
    const table = this.kv.createTable({ cacheSalt: engineRequest.cacheSalt, adapterId });
    const sequence = new Sequence(request, 0, engineRequest.promptTokenIds.slice(), [], table);
    request.sequences.push(sequence);
    this.requests.set(request.id, request);
    request.timestamps.queueDepthAtEntry = this.waiting.length;
    this.enqueueWaiting(sequence);
    return request;
  }

  private validate(r: EngineRequest): void {
    const id = typeof r.id === 'string' ? r.id : String(r.id);
    const reject = (code: RejectionCode, message: string): never => {
      throw new InvalidRequestError(code, id, message);
    };
    if (typeof r.id !== 'string' || r.id.length === 0) reject('invalid_request', 'id must be a non-empty string');
    if (this.requests.has(r.id)) reject('duplicate_request_id', 'a request with this id is already scheduled');
    const prompt = r.promptTokenIds;
    if (!Array.isArray(prompt) || prompt.length === 0) reject('invalid_request', 'promptTokenIds must be a non-empty array');
    for (let i = 0; i < prompt.length; i++) {
      const tokenId = prompt[i];
      if (!Number.isInteger(tokenId) || tokenId! < 0) reject('invalid_request', `promptTokenIds[${i}] is ${tokenId}, not a token id`);
    }
    const { n, maxTokens, minTokens } = r.sampling;
    if (!Number.isSafeInteger(n) || n < 1) reject('invalid_request', `sampling.n must be a positive integer, got ${n}`);
    // A prompt's n sequences are forked from one prefill and run together, so they must fit one batch.
    if (n > this.maxNumSeqs) {
      reject('too_many_samples', `n = ${n} is more than one engine batch holds (--max-num-seqs ${this.maxNumSeqs}): `
        + 'the n completions of a prompt run together');
    }
    if (!Number.isSafeInteger(maxTokens) || maxTokens < 1) reject('invalid_request', `sampling.maxTokens must be a positive integer, got ${maxTokens}`);
    if (!Number.isSafeInteger(minTokens) || minTokens < 0) reject('invalid_request', `sampling.minTokens must be an integer >= 0, got ${minTokens}`);
    if (!Number.isFinite(r.priority)) reject('invalid_request', `priority must be a finite number, got ${r.priority}`);
    if (!Number.isFinite(r.arrivalMs)) reject('invalid_request', `arrivalMs must be a finite number, got ${r.arrivalMs}`);
    if (r.deadlineMs !== undefined && !Number.isFinite(r.deadlineMs)) reject('invalid_request', `deadlineMs must be a finite number, got ${r.deadlineMs}`);
    const poolTokens = this.kv.numBlocks * this.kv.blockSize;
    if (prompt.length > poolTokens) {
      reject('prompt_exceeds_kv_pool', `prompt of ${prompt.length} tokens can never fit the KV pool `
        + `(${this.kv.numBlocks} blocks x ${this.kv.blockSize} tokens = ${poolTokens})`);
    }
    if (prompt.length >= this.maxModelLen) {
      reject('prompt_too_long', `prompt of ${prompt.length} tokens leaves no room for output within the context length ${this.maxModelLen}`);
    }
  }

  // -------------------------------------------------------------------------------------------------------------
  // schedule

  schedule(nowMs: number): StepPlan {
    if (this.outstandingPlan !== null) {
      throw new Error(`step ${this.outstandingPlan.stepId} is still outstanding: call updateFromOutput or discardPlan first`);
    }
    const entries: PlanEntry[] = [];
    const preempted: Sequence[] = [];
    const blockCopies: KvBlockCopy[] = [];
    let tokenBudget = this.maxNumBatchedTokens;
    let promptRowBudget = this.maxPromptLogprobRows;

    // 1. Running sequences.
    for (let i = 0; i < this.running.length && tokenBudget > 0; i++) {
      const sequence = this.running[i]!;
      if (sequence.status !== 'running') continue; // preempted by an earlier sequence of this loop
      const numNewTokens = this.withinPromptRows(sequence, sequence.numComputedTokens,
        this.chunkSize(sequence.numTokens - sequence.numComputedTokens, tokenBudget), promptRowBudget);
      if (numNewTokens === 0) continue;
      // Sliding window: blocks before the window of the next token (the first of this step's chunk) go back to the
      // pool, already while a long prompt is computed chunk by chunk; a prompt that forks into n samples or is handed
      // off to another worker keeps all its blocks until it is computed (the step that computed it has forked the
      // samples and handed the request off).
      if (this.kv.slidingWindow !== undefined && (sequence.numComputedTokens >= sequence.numPromptTokens
        || (!sequence.willFork && !sequence.request.handsOff))) {
        this.kv.releaseOutsideWindow(sequence.blockTable, sequence.numComputedTokens);
      }
      let fits = this.kv.allocateSlots(sequence.blockTable, sequence.numComputedTokens, numNewTokens) !== null;
      if (!fits) this.numKvAllocationFailures++;
      while (!fits) {
        const victim = this.lastRankedRunning();
        const back = this.preemptFromPlan(victim, entries, preempted);
        tokenBudget += back.tokens;
        promptRowBudget += back.promptLogprobRows;
        if (victim === sequence) break;
        fits = this.kv.allocateSlots(sequence.blockTable, sequence.numComputedTokens, numNewTokens) !== null;
      }
      if (!fits) continue;
      const entry = this.planEntry(sequence, numNewTokens);
      entries.push(entry);
      tokenBudget -= numNewTokens;
      promptRowBudget -= entry.numPromptLogprobRows;
    }
    if (preempted.length > 0) this.running = this.running.filter((sequence) => sequence.status === 'running');

    // 2. Waiting sequences. Not after a preemption: the room just freed would readmit the victim at once.
    // Under priority and deadline, a waiting sequence that finds no seat or no room takes them from the running
    // sequence ranked last, if it ranks strictly before it (that one is preempted); admission then stops before
    // anyone not ranked before every such victim, which would otherwise take the room back.
    let numAdmitted = 0;
    if (preempted.length === 0) {
      const preemptive = this.policy !== 'fcfs';
      /** The best-ranked sequence preempted for a waiting one: admission stops at it. */
      let bound: Sequence | null = null;
      const makeRoom = (sequence: Sequence): boolean => {
        if (!preemptive) return false;
        const victim = this.lastRankedRunningOrNull();
        if (victim === null || this.order(sequence, victim) >= 0) return false;
        const back = this.preemptFromPlan(victim, entries, preempted);
        tokenBudget += back.tokens;
        promptRowBudget += back.promptLogprobRows;
        if (bound === null || this.order(victim, bound) < 0) bound = victim;
        return true;
      };
      for (let at = 0; at < this.waiting.length; at++) {
        const sequence = this.waiting[at]!;
        if (tokenBudget === 0 || (bound !== null && this.order(sequence, bound) >= 0)) break;
        // A prompt whose logprobs are wanted waits for a step with rows left (before it could preempt anyone).
        if (promptRowBudget === 0 && sequence.needsPromptLogprobs && sequence.numPromptTokens > 1) break;
        // The chunk is planned against the budgets as they stand before anyone is preempted for this sequence: a
        // victim's cancelled entry gives its tokens (and rows) back, and a chunk grown by them could cross one more
        // block boundary than the room its preemption was judged to make, and then not fit at all.
        const plannedTokenBudget = tokenBudget;
        const plannedPromptRowBudget = promptRowBudget;
        // A prompt whose logprobs are wanted is computed whole: a cached position would have no logits row.
        const lookUp = () => {
          const found = this.kv.findCachedPrefix(sequence.blockTable, sequence.tokenIds,
            { reuse: !sequence.needsPromptLogprobs, prefillChunkTokens: this.chunkSize(Infinity, this.maxNumBatchedTokens) });
          const tokens = this.withinPromptRows(sequence, found.numTokens,
            this.chunkSize(sequence.numTokens - found.numTokens, plannedTokenBudget), plannedPromptRowBudget);
          return { prefix: found, numNewTokens: tokens };
        };
        // Only when the victims' blocks could be enough: nobody is preempted (for a seat or for room) for a request
        // that would wait anyway.
        const worthPreempting = (planned: ReturnType<typeof lookUp>) => preemptive
          && this.reclaimableFor(sequence, planned.prefix) >= this.freshBlocksFor(planned.prefix, planned.numNewTokens);
        if (this.runningSeats + sequence.numSeats > this.maxNumSeqs) {
          // Nor for seats that the running sequences ranked after it do not hold enough of (n samples need n).
          if (preemptive && this.runningSeats - this.seatsRankedAfter(sequence) + sequence.numSeats <= this.maxNumSeqs
            && worthPreempting(lookUp())) {
            while (this.runningSeats + sequence.numSeats > this.maxNumSeqs && makeRoom(sequence));
          }
          if (this.runningSeats + sequence.numSeats > this.maxNumSeqs) break;
        }
        let { prefix, numNewTokens } = lookUp();
        let fits = this.kv.allocateSlots(sequence.blockTable, prefix.numTokens, numNewTokens, prefix) !== null;
        // A lower-tier block gone or unreadable since the lookup: look again (the lookup no longer plans it).
        for (let retry = 0; !fits && prefix.stale && retry < 4; retry++) {
          ({ prefix, numNewTokens } = lookUp());
          fits = this.kv.allocateSlots(sequence.blockTable, prefix.numTokens, numNewTokens, prefix) !== null;
        }
        if (!fits && worthPreempting({ prefix, numNewTokens })) {
          while (!fits && makeRoom(sequence)) {
            fits = this.kv.allocateSlots(sequence.blockTable, prefix.numTokens, numNewTokens, prefix) !== null;
          }
        }
        if (!fits) break;
        const copy = sequence.blockTable.pendingCopy;
        if (copy !== null) {
          blockCopies.push(copy);
          sequence.blockTable.pendingCopy = null;
        }
        const onboarded = sequence.blockTable.onboarded;
        if (onboarded !== null) {
          sequence.blockTable.onboarded = null;
          const seen = sequence.request.timestamps.kvOnboard;
          sequence.request.timestamps.kvOnboard = seen === undefined ? onboarded : {
            ram: seen.ram + onboarded.ram, disk: seen.disk + onboarded.disk, bytes: seen.bytes + onboarded.bytes, ms: seen.ms + onboarded.ms,
          };
        }
        sequence.numComputedTokens = prefix.numTokens;
        this.admit(sequence, prefix.numTokens, nowMs);
        const entry = this.planEntry(sequence, numNewTokens);
        entries.push(entry);
        tokenBudget -= numNewTokens;
        promptRowBudget -= entry.numPromptLogprobRows;
        numAdmitted++;
      }
      // The admitted are the queue's first numAdmitted: a victim ranks after every one of them.
      this.waiting.splice(0, numAdmitted);
      if (preempted.length > 0) this.running = this.running.filter((sequence) => sequence.status === 'running');
    }

    return this.finishPlan(nowMs, entries, preempted, numAdmitted, blockCopies);
  }

  /**
   * Preempts a running sequence while a plan is being made: its entry in the plan so far, if any, is cancelled, and
   * it joins the step's preempted. Returns the tokens and prompt-logprob rows its cancelled entry gives back to the
   * step's budgets.
   */
  private preemptFromPlan(victim: Sequence, entries: readonly PlanEntry[], preempted: Sequence[]): { tokens: number; promptLogprobRows: number } {
    const victimEntry = entries.find((entry) => entry.sequence === victim && !entry.cancelled);
    if (victimEntry !== undefined) victimEntry.cancelled = true;
    this.preempt(victim);
    preempted.push(victim);
    return { tokens: victimEntry?.numNewTokens ?? 0, promptLogprobRows: victimEntry?.numPromptLogprobRows ?? 0 };
  }

  private chunkSize(numRemainingTokens: number, tokenBudget: number): number {
    const threshold = this.longPrefillTokenThreshold;
    const capped = threshold > 0 && numRemainingTokens > threshold ? threshold : numRemainingTokens;
    return Math.min(capped, tokenBudget);
  }

  /**
   * A chunk of a sequence that needs prompt logprobs shortened to the rows left in the step (0: it waits for the
   * next step); others unchanged. Only positions before the prompt's last take a row (the last one's is sampled).
   */
  private withinPromptRows(sequence: Sequence, startPosition: number, numNewTokens: number, rowsLeft: number): number {
    if (!sequence.needsPromptLogprobs || promptLogprobRows(sequence, startPosition, numNewTokens) <= rowsLeft) return numNewTokens;
    return rowsLeft;
  }

  private planEntry(sequence: Sequence, numNewTokens: number): PlanEntry {
    const startPosition = sequence.numComputedTokens;
    const reachesEnd = startPosition + numNewTokens === sequence.numTokens;
    return {
      sequence, startPosition, numNewTokens,
      numPromptLogprobRows: sequence.needsPromptLogprobs ? promptLogprobRows(sequence, startPosition, numNewTokens) : 0,
      numSamples: reachesEnd ? (sequence.willFork ? sequence.request.sampling.n : 1) : 0,
      isDecode: numNewTokens === 1 && reachesEnd && sequence.outputTokenIds.length > 0,
      request: sequence.request, completionIndex: sequence.index, cancelled: false,
    };
  }

  private finishPlan(nowMs: number, entries: PlanEntry[], preempted: Sequence[], numAdmitted: number,
    blockCopies: KvBlockCopy[]): StepPlan {
    const scheduled = preempted.length > 0 ? entries.filter((entry) => !entry.cancelled) : entries;
    const sampleTargets: SampleTarget[] = [];
    let numScheduledTokens = 0;
    let numDecodeTokens = 0;
    let numPromptLogprobRows = 0;
    for (const entry of scheduled) {
      const { sequence, numNewTokens, numSamples, isDecode } = entry;
      numScheduledTokens += numNewTokens;
      numPromptLogprobRows += entry.numPromptLogprobRows;
      if (isDecode) numDecodeTokens++;
      if (numSamples === 1) sampleTargets.push(entry);
      else for (let k = 0; k < numSamples; k++) sampleTargets.push({ request: sequence.request, completionIndex: k });
    }
    this.numPreemptions += preempted.length;
    const plan: StepPlan = {
      stepId: this.nextStepId++, nowMs, scheduled, sampleTargets, numPromptLogprobRows, numScheduledTokens, preempted, blockCopies,
      stats: {
        numRunning: this.running.length, numWaiting: this.waiting.length, numScheduledSeqs: scheduled.length,
        numScheduledTokens, numPrefillTokens: numScheduledTokens - numDecodeTokens, numDecodeTokens, numAdmitted,
        numPreempted: preempted.length, kvUsedBlocks: this.kv.pool.numUsedBlocks, kvTotalBlocks: this.kv.numBlocks,
      },
    };
    // An empty plan needs no answer: the caller may skip the step, or pass it to updateFromOutput or discardPlan.
    if (scheduled.length > 0) this.outstandingPlan = plan;
    return plan;
  }

  // -------------------------------------------------------------------------------------------------------------
  // updateFromOutput

  /**
   * Applies a step's result. sampledTokenIds holds one token per logits row, in the order of plan.sampleTargets
   * (= batch.logitsIndices). Sequences aborted or finished since the plan was made are skipped. forwardStartMs is
   * when the step's forward pass began (default: when it was planned); the requests' timestamps record it as the
   * start of their prefill chunks and decode steps, so planning and batch building count as budget allocation.
   */
  updateFromOutput(plan: StepPlan, sampledTokenIds: ArrayLike<number>, nowMs: number, forwardStartMs = plan.nowMs): StepResult {
    if (plan.scheduled.length === 0 && sampledTokenIds.length === 0) return { outputs: [], finishedRequests: [] };
    if (plan !== this.outstandingPlan) throw new Error(`step ${plan.stepId} is not the outstanding step`);
    if (sampledTokenIds.length !== plan.sampleTargets.length) {
      throw new RangeError(`step ${plan.stepId} samples ${plan.sampleTargets.length} rows; got ${sampledTokenIds.length} token ids`);
    }
    for (let i = 0; i < sampledTokenIds.length; i++) {
      const tokenId = sampledTokenIds[i]!;
      if (!Number.isInteger(tokenId) || tokenId < 0) throw new RangeError(`sampled token id ${tokenId} (row ${i}) is not a token id`);
    }
    this.outstandingPlan = null;
    this.releaseBlockCopies(plan);
    const outputs: SequenceOutput[] = [];
    const finishedRequests: Request[] = [];
    let anyFinished = false;
    let row = 0;
    const { blockSize } = this.kv;
    for (const entry of plan.scheduled) {
      const { sequence, numSamples } = entry;
      const firstRow = row;
      row += numSamples;
      if (sequence.status !== 'running') continue;
      if (sequence.numComputedTokens !== entry.startPosition) {
        throw new Error(`sequence ${sequence.request.id}/${sequence.index} computed ${sequence.numComputedTokens} tokens, planned from ${entry.startPosition}`);
      }
      const { request } = sequence;
      const numComputedBefore = sequence.numComputedTokens;
      sequence.numComputedTokens += entry.numNewTokens;
      // Only a step that fills a block has anything to register; most decode steps do not, and skipping the call
      // skips touching the block table at all.
      if (Math.floor(sequence.numComputedTokens / blockSize) > Math.floor(numComputedBefore / blockSize)) {
        this.kv.cacheComputedBlocks(sequence.blockTable, sequence.tokenIds, sequence.numComputedTokens);
      }
      const { timestamps } = request;
      timestamps.budget ??= { tokens: entry.numNewTokens, forwardStart: forwardStartMs };
      if (timestamps.firstToken !== undefined) recordDecodeStep(timestamps, plan, nowMs - forwardStartMs);
      if (!entry.isDecode) {
        timestamps.prefillChunks.push({
          start: forwardStartMs, end: nowMs, tokens: entry.numNewTokens,
          batchSeqs: plan.stats.numScheduledSeqs, batchTokens: plan.numScheduledTokens,
          ...(numComputedBefore < sequence.recomputeUpTo ? { recompute: true } : {}),
        });
      }
      if (numSamples === 0) continue;

      request.timestamps.firstToken ??= nowMs;
      request.timestamps.lastToken = nowMs;
      // Forks first, so that a stop of sample 0 sees the request's n sequences (its seats are counted as n until then).
      for (let k = 1; k < numSamples; k++) this.fork(sequence, k, sampledTokenIds[firstRow + k]!);
      let finished = this.acceptToken(sequence, sampledTokenIds[firstRow]!, outputs);
      for (let k = 1; k < numSamples; k++) finished = this.applyStop(request.sequences[k]!, outputs) || finished;
      if (!finished) continue;
      anyFinished = true;
      if (stopIfFinished(request, nowMs)) {
        this.requests.delete(request.id);
        finishedRequests.push(request);
      }
    }
    if (anyFinished) this.running = this.running.filter((sequence) => sequence.status === 'running');
    return { outputs, finishedRequests };
  }

  /** Appends a sampled token and checks the stop conditions; true if the sequence finished. */
  private acceptToken(sequence: Sequence, tokenId: number, outputs: SequenceOutput[]): boolean {
    sequence.appendToken(tokenId);
    return this.applyStop(sequence, outputs);
  }

  private applyStop(sequence: Sequence, outputs: SequenceOutput[]): boolean {
    const stop = checkStop(sequence, this.eosTokenIds, this.maxModelLen);
    if (stop !== null) this.finishSequence(sequence, stop.reason, stop.stopReason);
    outputs.push({
      requestId: sequence.request.id, index: sequence.index, newTokenIds: [sequence.tokenIds[sequence.numTokens - 1]!],
      finishReason: sequence.finishReason, stopReason: sequence.stopReason,
    });
    return stop !== null;
  }

  /**
   * Appends tokens no one sampled to a running sequence that was just given one (jump-forward: text a grammar
   * forces), checking the stop conditions after each; the next step computes them with the token before them, as a
   * prompt chunk. Call after updateFromOutput and before the next schedule. Returns how many were appended (fewer
   * when one ends the sequence) and how the sequence ended, if it did; a finished request is forgotten.
   */
  appendTokens(requestId: string, index: number, tokenIds: readonly number[], nowMs: number): SequenceOutput & { numAppended: number } {
    const request = this.requests.get(requestId);
    const sequence = request?.sequences[index];
    if (request === undefined || sequence === undefined || sequence.status !== 'running' || this.outstandingPlan !== null) {
      throw new Error(`cannot append tokens to ${requestId}/${index} now`);
    }
    let numAppended = 0;
    let stop: ReturnType<typeof checkStop> = null;
    for (const tokenId of tokenIds) {
      if (!Number.isInteger(tokenId) || tokenId < 0) throw new RangeError(`token id ${tokenId} is not a token id`);
      sequence.appendToken(tokenId);
      numAppended++;
      stop = checkStop(sequence, this.eosTokenIds, this.maxModelLen);
      if (stop !== null) break;
    }
    if (stop !== null) {
      this.finishSequence(sequence, stop.reason, stop.stopReason);
      this.running = this.running.filter((s) => s.status === 'running');
      if (stopIfFinished(request, nowMs)) this.requests.delete(requestId);
    }
    return {
      requestId, index, newTokenIds: tokenIds.slice(0, numAppended), finishReason: sequence.finishReason,
      stopReason: sequence.stopReason, numAppended,
    };
  }

  /** Forgets a plan whose forward pass failed (or that was empty): nothing it scheduled counts as computed. */
  discardPlan(plan: StepPlan): void {
    if (plan.scheduled.length === 0) return; // never outstanding
    if (plan !== this.outstandingPlan) throw new Error(`step ${plan.stepId} is not the outstanding step`);
    this.outstandingPlan = null;
    this.releaseBlockCopies(plan);
  }

  /** The step is over: its copies are made (or moot), so their sources may be evicted again once free. */
  private releaseBlockCopies(plan: StepPlan): void {
    for (const copy of plan.blockCopies) this.kv.releaseBlockCopy(copy);
  }

  /**
   * The prompt is computed: sample k joins the running sequences with the prompt's full blocks shared. The last,
   * partial prompt block is not shared: each sample writes its own tokens after it, so each sample recomputes
   * those few prompt positions into a block of its own on its next step (fewer than blockSize tokens, once),
   * which needs no copy-on-write and no block-copy operation in the backend.
   */
  private fork(parent: Sequence, index: number, tokenId: number): Sequence {
    const { request } = parent;
    const numSharedBlocks = Math.floor(request.promptTokenIds.length / this.kv.blockSize);
    const table = this.kv.fork(parent.blockTable, numSharedBlocks);
    const child = new Sequence(request, index, request.promptTokenIds.slice(), [], table);
    child.appendToken(tokenId);
    child.numComputedTokens = numSharedBlocks * this.kv.blockSize;
    child.status = 'running';
    request.sequences.push(child);
    this.running.push(child);
    return child;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Requests out: abort, finish from outside (stop strings)

  /** Stops every sequence of the request and frees its blocks, in any state. False for an unknown request. */
  abort(requestId: string, nowMs?: number): boolean {
    return this.finish(requestId, 'abort', { nowMs });
  }

  /**
   * Finishes a request from outside (e.g. the detokenizer found a stop string): only sample `index` when given,
   * else all. Returns true when this call finished the whole request, which the scheduler then forgets.
   * dropTokens (with index): the sequence's last output tokens are dropped first, so that they do not count as
   * output: tokens appended unsampled (appendTokens) after the one a stop string ended on. They must not have been
   * computed yet.
   */
  finish(requestId: string, reason: FinishReason, options: { index?: number; nowMs?: number; dropTokens?: number } = {}): boolean {
    const request = this.requests.get(requestId);
    if (request === undefined) return false;
    const dropTokens = options.dropTokens ?? 0;
    if (dropTokens > 0) {
      const sequence = options.index === undefined ? undefined : request.sequences[options.index];
      if (sequence === undefined || sequence.isFinished || !Number.isSafeInteger(dropTokens)
        || dropTokens > sequence.outputTokenIds.length || sequence.numTokens - dropTokens < sequence.numComputedTokens) {
        throw new RangeError(`cannot drop ${dropTokens} tokens of ${requestId}/${options.index}: only output tokens not yet computed of one unfinished sequence can be dropped`);
      }
      sequence.dropLastTokens(dropTokens);
    }
    let anyRunning = false;
    for (const sequence of request.sequences) {
      if (sequence.isFinished || (options.index !== undefined && sequence.index !== options.index)) continue;
      if (sequence.status === 'running') anyRunning = true;
      this.finishSequence(sequence, reason, null);
    }
    if (anyRunning) this.running = this.running.filter((sequence) => sequence.status === 'running');
    if (!stopIfFinished(request, options.nowMs)) return false;
    this.requests.delete(requestId);
    return true;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Handoff between workers

  /**
   * Gives a request away after its prompt is computed and its first token sampled (call between steps): its blocks
   * up to the computed positions are pinned, the request leaves the batch and the scheduler forgets it. Returns
   * what the receiving worker needs to find, copy and check those blocks. Only n = 1 requests can be handed off:
   * n > 1 forks into samples that share the prompt's blocks here.
   */
  handOff(requestId: string): SchedulerHandoff {
    const request = this.requests.get(requestId);
    if (request === undefined) throw new Error(`cannot hand off unknown request ${requestId}`);
    if (request.sampling.n !== 1 || request.sequences.length !== 1) {
      throw new Error(`request ${requestId} has n = ${request.sampling.n}; only n = 1 can be handed off`);
    }
    const sequence = request.sequences[0]!;
    // Its output (the sampled token, and the tokens jump-forward appended after it) is the next step's input.
    if (sequence.status !== 'running' || sequence.outputTokenIds.length === 0
      || sequence.numComputedTokens !== sequence.numTokens - sequence.outputTokenIds.length) {
      throw new Error(`request ${requestId} can be handed off once its prompt is computed and a token sampled `
        + `(status ${sequence.status}, ${sequence.numComputedTokens} of ${sequence.numTokens} tokens computed)`);
    }
    const table = sequence.blockTable;
    const numComputedTokens = sequence.numComputedTokens;
    const numBlocks = this.kv.blocksFor(numComputedTokens);
    const blockHashes = this.kv.fullBlockHashes(table, sequence.tokenIds, numComputedTokens);
    const blockIds = table.blockIds.slice(0, numBlocks);
    const pin = this.kv.pin(table, numBlocks);
    this.runningSeats -= sequence.numSeats;
    this.kv.free(table);
    sequence.status = 'handed_off';
    this.running = this.running.filter((s) => s !== sequence);
    this.requests.delete(requestId);
    return {
      request, tokenIds: sequence.tokenIds.slice(), outputTokenIds: sequence.outputTokenIds.slice(), numComputedTokens,
      blockIds, blockHashes, pin,
    };
  }

  /**
   * Takes over a request whose prompt ran elsewhere and whose first token(s) were sampled there.
   *
   * With kvImport, the request joins the running batch now with the tokens after kvImport.numTokens left to compute
   * (its output so far: the first token, and any a grammar forced after it, go in its next step together): its table
   * starts with this worker's longest cached prefix, new blocks cover the rest of kvImport.numTokens, kvImport.fill
   * copies KV into just those, and their full blocks enter this prefix cache (KV events go out as for computed
   * blocks). Returns null, changing nothing, when the seats or the pool lack room: the caller retries later.
   *
   * Without kvImport (the KV is lost or not worth moving), the request queues like a preempted one and recomputes
   * its prompt and sampled tokens when admitted. Throws InvalidRequestError for a request that could never run here.
   */
  adoptRequest(engineRequest: EngineRequest, nowMs: number, adopted: AdoptedState, kvImport?: KvImport): Request | null {
    this.validate(engineRequest);
    const id = engineRequest.id;
    const outputTokenIds = adopted.outputTokenIds;
    if (engineRequest.sampling.n !== 1) throw new InvalidRequestError('invalid_request', id, 'only a request with n = 1 can be adopted');
    if (outputTokenIds.length < 1 || outputTokenIds.length >= engineRequest.sampling.maxTokens) {
      throw new InvalidRequestError('invalid_request', id,
        `an adopted request needs 1 to maxTokens - 1 = ${engineRequest.sampling.maxTokens - 1} sampled tokens, got ${outputTokenIds.length}`);
    }
    for (const tokenId of outputTokenIds) {
      if (!Number.isInteger(tokenId) || tokenId < 0) throw new InvalidRequestError('invalid_request', id, `sampled token ${tokenId} is not a token id`);
    }
    const tokenIds = [...engineRequest.promptTokenIds, ...outputTokenIds];
    if (tokenIds.length >= this.maxModelLen) {
      throw new InvalidRequestError('prompt_too_long', id, `${tokenIds.length} tokens leave no room within the context length ${this.maxModelLen}`);
    }
    if (kvImport !== undefined) {
      const n = kvImport.numTokens;
      if (!Number.isSafeInteger(n) || n < 0 || n >= tokenIds.length) {
        throw new RangeError(`imported KV covers ${n} positions; the request has ${tokenIds.length} tokens and must compute at least one`);
      }
      if (this.runningSeats + 1 > this.maxNumSeqs) return null;
    }

    const request = new Request(engineRequest, this.nextArrivalOrder, nowMs, engineRequest.lora);
    request.wasAdmitted = true;
    request.numCachedTokens = adopted.numCachedTokens;
    if (adopted.timestamps) Object.assign(request.timestamps, copyTimestamps(adopted.timestamps));
    const table = this.kv.createTable({ cacheSalt: engineRequest.cacheSalt, adapterId: engineRequest.lora });
    const sequence = new Sequence(request, 0, tokenIds, outputTokenIds.slice(), table);
    request.sequences.push(sequence);
    if (kvImport === undefined) {
      this.nextArrivalOrder++;
      this.requests.set(id, request);
      this.enqueueWaiting(sequence);
      return request;
    }

    const numTokens = kvImport.numTokens;
    if (kvImport.blockHashes !== undefined) {
      const own = this.kv.fullBlockHashes(table, tokenIds, numTokens);
      const theirs = kvImport.blockHashes;
      if (own.length !== theirs.length || own.some((hash, i) => hash !== theirs[i])) {
        throw new Error(`request ${id}: the source's block hashes differ from this worker's `
          + '(different cache salt, block size or hash function): its KV cannot be registered here');
      }
    }
    // The longest cached prefix, but never past the imported positions (blocks are cached whole).
    // No copy-on-write: the block a copy would fill is imported with the rest. Not a prefix-cache query for the
    // statistics (numQueryTokens 0): the blocks found here spare a transfer, not a prefill, and the prompt's query
    // was counted where it was prefilled; counted again here, every handed-off prompt would count twice.
    const found = this.kv.findCachedPrefix(table, tokenIds, { copyOnWrite: false, lowerTiers: false });
    const maxHitBlocks = Math.floor(numTokens / this.kv.blockSize);
    const prefix = {
      blocks: found.blocks.length <= maxHitBlocks ? found.blocks : found.blocks.slice(0, maxHitBlocks),
      numTokens: Math.min(found.blocks.length, maxHitBlocks) * this.kv.blockSize, numQueryTokens: 0,
    };
    if (kvImport.filled !== undefined) {
      const numShared = this.kv.blocksFor(numTokens) - kvImport.filled.length;
      if (numShared < 0 || prefix.blocks.length < numShared) {
        throw new Error(`request ${id}: ${kvImport.filled.length} filled blocks need ${numShared} cached ones before them, `
          + `${prefix.blocks.length} are cached here`);
      }
      this.kv.adoptFilledBlocks(table, {
        blocks: prefix.blocks.slice(0, numShared), numTokens: numShared * this.kv.blockSize, numQueryTokens: 0,
      }, kvImport.filled);
    } else if (this.kv.allocateSlots(table, prefix.numTokens, numTokens - prefix.numTokens, prefix) === null) return null;
    try {
      kvImport.fill(table, prefix.blocks.length, table.blocks.length);
    } catch (error) {
      this.kv.free(table);
      throw error;
    }
    this.kv.cacheComputedBlocks(table, tokenIds, numTokens);
    sequence.numComputedTokens = numTokens;
    sequence.status = 'running';
    this.nextArrivalOrder++;
    this.requests.set(id, request);
    this.running.push(sequence);
    this.runningSeats += sequence.numSeats;
    return request;
  }

  // -------------------------------------------------------------------------------------------------------------
  // State transitions

  private admit(sequence: Sequence, numCachedTokens: number, nowMs: number): void {
    const { request } = sequence;
    if (!request.wasAdmitted) {
      request.wasAdmitted = true;
      request.numCachedTokens = numCachedTokens;
      request.timestamps.firstScheduled = nowMs;
    }
    sequence.status = 'running';
    this.running.push(sequence);
    this.runningSeats += sequence.numSeats;
  }

  /** Frees the sequence's blocks and sends it back to wait; it recomputes its tokens (prompt and output) later. */
  private preempt(sequence: Sequence): void {
    this.kv.free(sequence.blockTable);
    this.runningSeats -= sequence.numSeats;
    sequence.recomputeUpTo = Math.max(sequence.recomputeUpTo, sequence.numComputedTokens);
    sequence.numComputedTokens = 0;
    sequence.status = 'preempted';
    sequence.numPreemptions++;
    this.enqueueWaiting(sequence);
  }

  /** Leaves `running` to the caller, who filters it once per batch of finishes. */
  private finishSequence(sequence: Sequence, reason: FinishReason, stopReason: number | null): void {
    if (sequence.status === 'running') {
      this.runningSeats -= sequence.numSeats;
    } else {
      const at = this.waiting.indexOf(sequence);
      if (at < 0) throw new Error(`sequence ${sequence.request.id}/${sequence.index} is ${sequence.status} but not queued`);
      this.waiting.splice(at, 1);
    }
    this.kv.free(sequence.blockTable);
    sequence.status = finishedStatus(reason);
    sequence.finishReason = reason;
    sequence.stopReason = stopReason;
  }

  private enqueueWaiting(sequence: Sequence): void {
    // Upper bound: after every sequence ranked equal, so equals keep their queueing order.
    let low = 0;
    let high = this.waiting.length;
    if (high > 0 && this.order(this.waiting[high - 1]!, sequence) <= 0) low = high; // the common case: append
    while (low < high) {
      const mid = (low + high) >>> 1;
      if (this.order(this.waiting[mid]!, sequence) <= 0) low = mid + 1;
      else high = mid;
    }
    this.waiting.splice(low, 0, sequence);
  }

  private lastRankedRunning(): Sequence {
    const victim = this.lastRankedRunningOrNull();
    if (victim === null) throw new Error('no running sequence to preempt');
    return victim;
  }

  /** Fresh blocks a sequence's admission takes beyond its cached prefix (the copy of a copy source included). */
  private freshBlocksFor(prefix: CachedPrefix, numNewTokens: number): number {
    return this.kv.blocksFor(prefix.numTokens + numNewTokens) - prefix.blocks.length;
  }

  /**
   * Blocks a sequence's admission could get as fresh ones: the free blocks, less those of its own cached prefix (and
   * copy source) that are free (they are taken as they are, not as room), plus the blocks that preempting every
   * running sequence ranked after it would free: those only such sequences hold. A block also held by a sequence
   * ranked before it or by a pin stays in use, and one of its own prefix is taken as it is. Blocks a sequence gave
   * back outside its sliding window are free already, counted there.
   */
  private reclaimableFor(sequence: Sequence, prefix: CachedPrefix): number {
    let blocks = this.kv.numFreeBlocks;
    for (const block of prefix.blocks) if (block.refCount === 0) blocks--;
    if (prefix.copySource !== undefined && prefix.copySource.refCount === 0) blocks--;
    /** References the running sequences ranked after it hold, per block. */
    const victimReferences = new Map<KvBlock, number>();
    for (const other of this.running) {
      if (other.status !== 'running' || this.order(sequence, other) >= 0) continue;
      for (const block of other.blockTable.heldBlocks) victimReferences.set(block, (victimReferences.get(block) ?? 0) + 1);
    }
    if (victimReferences.size === 0) return blocks;
    const own = new Set<KvBlock>(prefix.blocks);
    if (prefix.copySource !== undefined) own.add(prefix.copySource);
    for (const [block, references] of victimReferences) if (references === block.refCount && !own.has(block)) blocks++;
    return blocks;
  }

  /** Seats held by the running sequences ranked after this one: what preempting them all would give back. */
  private seatsRankedAfter(sequence: Sequence): number {
    let seats = 0;
    for (const other of this.running) if (other.status === 'running' && this.order(sequence, other) < 0) seats += other.numSeats;
    return seats;
  }

  private lastRankedRunningOrNull(): Sequence | null {
    let victim: Sequence | null = null;
    for (const sequence of this.running) {
      if (sequence.status === 'running' && (victim === null || this.order(sequence, victim) > 0)) victim = sequence;
    }
    return victim;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Introspection

  getRequest(requestId: string): Request | undefined {
    return this.requests.get(requestId);
  }

  get numRunning(): number {
    return this.running.length;
  }

  get numWaiting(): number {
    return this.waiting.length;
  }

  /** Requests not yet finished (waiting, running or preempted). */
  get numRequests(): number {
    return this.requests.size;
  }

  /** Running sequences in admission order, then waiting ones in policy order. */
  sequences(): { running: readonly Sequence[]; waiting: readonly Sequence[] } {
    return { running: this.running, waiting: this.waiting };
  }

  stats(): SchedulerStats {
    return {
      numRunning: this.running.length, numWaiting: this.waiting.length, numRequests: this.requests.size,
      numSteps: this.nextStepId - 1, numPreemptions: this.numPreemptions,
      numKvAllocationFailures: this.numKvAllocationFailures,
    };
  }

  /** Throws if queues, seats, sequence states and block reference counts disagree. O(everything): for tests. */
  checkInvariants(): void {
    const seen = new Set<Sequence>();
    let seats = 0;
    for (const sequence of this.running) {
      const where = `running sequence ${sequence.request.id}/${sequence.index}`;
      if (sequence.status !== 'running') throw new Error(`${where} has status ${sequence.status}`);
      if (seen.has(sequence)) throw new Error(`${where} is listed twice`);
      seen.add(sequence);
      seats += sequence.numSeats;
      if (sequence.numComputedTokens >= sequence.numTokens) throw new Error(`${where} has nothing left to compute`);
      if (sequence.blockTable.blocks.length < this.kv.blocksFor(sequence.numComputedTokens)) {
        throw new Error(`${where} computed ${sequence.numComputedTokens} tokens into ${sequence.blockTable.blocks.length} blocks`);
      }
    }
    if (seats !== this.runningSeats) throw new Error(`running sequences hold ${seats} seats, counted ${this.runningSeats}`);
    if (seats > this.maxNumSeqs) throw new Error(`${seats} seats exceed maxNumSeqs ${this.maxNumSeqs}`);
    for (let i = 0; i < this.waiting.length; i++) {
      const sequence = this.waiting[i]!;
      const where = `waiting sequence ${sequence.request.id}/${sequence.index}`;
      if (sequence.status !== 'waiting' && sequence.status !== 'preempted') throw new Error(`${where} has status ${sequence.status}`);
      if (seen.has(sequence)) throw new Error(`${where} is listed twice`);
      seen.add(sequence);
      if (sequence.blockTable.blocks.length > 0 || sequence.numComputedTokens > 0) throw new Error(`${where} holds KV`);
      if (i > 0 && this.order(this.waiting[i - 1]!, sequence) > 0) throw new Error(`${where} is out of policy order`);
    }
    for (const request of this.requests.values()) {
      for (const sequence of request.sequences) {
        if (!sequence.isFinished && !seen.has(sequence)) throw new Error(`sequence ${request.id}/${sequence.index} is in no queue`);
        if (sequence.isFinished && sequence.blockTable.blocks.length > 0) throw new Error(`finished sequence ${request.id}/${sequence.index} holds blocks`);
      }
    }
    for (const sequence of seen) {
      if (this.requests.get(sequence.request.id) !== sequence.request) throw new Error(`sequence of forgotten request ${sequence.request.id} is queued`);
    }
    this.kv.checkInvariants([...seen].map((sequence) => sequence.blockTable));
  }
}

/**
 * Counts a step after the request's first token into its decode summary, once per step however many of its
 * completions the step advanced. Updated in place: a few additions per request per step, whatever the length.
 */
function recordDecodeStep(timestamps: RequestTimestamps, plan: StepPlan, forwardMs: number): void {
  const seqs = plan.stats.numScheduledSeqs;
  const tokens = plan.numScheduledTokens;
  const summary = timestamps.decodeSteps;
  if (summary === undefined) {
    timestamps.decodeSteps = {
      steps: 1, lastStepId: plan.stepId, forwardMs,
      batchSeqsSum: seqs, batchSeqsMin: seqs, batchSeqsMax: seqs,
      batchTokensSum: tokens, batchTokensMin: tokens, batchTokensMax: tokens,
    };
    return;
  }
  if (summary.lastStepId === plan.stepId) return;
  summary.steps++;
  summary.lastStepId = plan.stepId;
  summary.forwardMs += forwardMs;
  summary.batchSeqsSum += seqs;
  if (seqs < summary.batchSeqsMin) summary.batchSeqsMin = seqs;
  if (seqs > summary.batchSeqsMax) summary.batchSeqsMax = seqs;
  summary.batchTokensSum += tokens;
  if (tokens < summary.batchTokensMin) summary.batchTokensMin = tokens;
  if (tokens > summary.batchTokensMax) summary.batchTokensMax = tokens;
}

/** Stamps the finish time when every sequence of the request is done; true if so. */
function stopIfFinished(request: Request, nowMs: number | undefined): boolean {
  if (!request.isFinished) return false;
  if (nowMs !== undefined) request.timestamps.finished = nowMs;
  return true;
}
