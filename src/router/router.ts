// The router: given a tokenized request, which worker should run it. It decides and does not send. The caller
// forwards the request to decision.workerId, feeds the router the workers' KV events and load reports, and tells it
// when a request's prefill is done and when it finishes. Everything here is synchronous and takes time as an
// argument, so a test can drive it call by call and a trace can be replayed.
//
// One routing call, in sub-phases (each timed with the injected clock and returned in decision.overhead):
//   hashing    the prompt's full blocks -> chained block hashes, with the engine's own hash function and salt
//   lookup     overlap per worker: the KV index (from events) joined with speculative inserts (recent routing
//              decisions not yet confirmed by events), and the blocks this router's active requests share
//   selection  cost terms per worker, the load guard, then the policy's choice
//
// When every worker is over the busy threshold, the request waits in the router's admission queue (the caller
// calls drainQueue when load drops); when that is full it is shed with a Retry-After hint.

import { hashTokenBlocks } from '../protocols/block-hash.ts';
import type { BlockHash, KvEvent } from '../protocols/kv-events.ts';
import { ActiveRequests } from './active-requests.ts';
import { AdmissionQueue, RetryAfterEstimator } from './admission.ts';
import type { RetryAfterOptions } from './admission.ts';
import { costTerms, reusableBlocks, selectByCost } from './cost.ts';
import type { WorkerView } from './cost.ts';
import { BitsetKvIndex } from './kv-index.ts';
import type { KvIndex, LowerTierDump } from './kv-index.ts';
import { pickLeastLoaded, pickPowerOfTwo, pickRandom, SessionAffinity } from './policies.ts';
import { parsePolicyName, servesModel } from './protocols.ts';
import type {
  PolicyName, RouteOutcome, RoutingDecision, RoutingRequest, RoutingStrategy, WorkerCostTerms, WorkerId,
} from './protocols.ts';
import { IDLE_LOAD, type WorkerLoad } from '../protocols/worker.ts';
import type { RandomSource } from '../util/random.ts';
import { SpeculativePrefixes } from './speculative.ts';

const NO_HASHES: readonly BlockHash[] = [];

export interface RouterOptions {
  /** Tokens per KV block; must equal the workers' block size or no hash will ever match. */
  blockSize: number;
  /** Default 'kv'. */
  policy?: PolicyName;
  /** Weight of the prefill term in the kv cost (default 1; 0 ignores the cache). */
  overlapWeight?: number;
  /** Softmax temperature over the kv cost (default 0: always the cheapest). */
  temperature?: number;
  /** A worker at or above this KV usage (0..1) is busy (default 0.95). */
  busyKvUsage?: number;
  /** A worker with this many waiting requests or more is busy (default 64). */
  busyNumWaiting?: number;
  /** How long a speculative insert stands without a confirming event (default 10 s; 0 disables them). */
  speculativeTtlMs?: number;
  /** Session affinity lifetime without use (default 30 min) and table size (default 100 000). */
  sessionTtlMs?: number;
  maxSessions?: number;
  /** Admission queue bound (default 256; 0 sheds as soon as every worker is busy) and wait limit (default 30 s). */
  maxQueued?: number;
  maxQueueWaitMs?: number;
  retryAfter?: RetryAfterOptions;
  /** Tie-breaking, softmax draws, random and power-of-two policies. Seed it for reproducible decisions. */
  random: RandomSource;
  /** Milliseconds, fractional; only used to time the routing sub-phases. Default: none (overheads read 0). */
  clock?: () => number;
  /** Default: a BitsetKvIndex. */
  index?: KvIndex;
}

export interface RouteOptions {
  /**
   * Record the decision as sent (default true): the router's own load accounting, the speculative insert, the
   * session affinity and the round-robin position. With false, call onRouted once the request is really sent.
   */
  commit?: boolean;
}

export interface KvEventsResult {
  /** The worker lost events: fetch its cached block hashes and call resyncWorker. */
  needsResync: boolean;
  numApplied: number;
  numDuplicates: number;
}

export interface DrainResult {
  routed: { request: RoutingRequest; decision: RoutingDecision }[];
  /** Queued for maxQueueWaitMs or longer: to be failed (the caller answers 503 / 429). */
  expired: RoutingRequest[];
}

export interface RouterStats {
  numWorkers: number;
  numActiveRequests: number;
  numQueued: number;
  /** Counters since construction. */
  numRouted: number;
  numEnqueued: number;
  numRejected: number;
  numExpired: number;
  numIndexedBlocks: number;
  numIndexedEntries: number;
  numSpeculativeEntries: number;
  workersNeedingResync: WorkerId[];
}

interface Queued {
  request: RoutingRequest;
  hashes: BlockHash[];
}

interface Choice {
  index: number;
  strategy: RoutingStrategy;
  reason: string;
}

const NO_CLOCK = () => 0;

export class Router {
  readonly blockSize: number;
  readonly policy: PolicyName;
  readonly overlapWeight: number;
  readonly temperature: number;
  readonly busyKvUsage: number;
  readonly busyNumWaiting: number;
  readonly index: KvIndex;
  private readonly random: RandomSource;
  private readonly clock: () => number;
  private readonly speculative: SpeculativePrefixes;
  private readonly active = new ActiveRequests();
  private readonly sessions: SessionAffinity;
  private readonly queue: AdmissionQueue<Queued>;
  private readonly retryAfter: RetryAfterEstimator;
  /** Registration order: the order of cost terms in decisions and of the round-robin cycle. */
  private readonly workerIds: WorkerId[] = [];
  private readonly loads = new Map<WorkerId, WorkerLoad>();
  /** The models each worker holds, for workers that declared them (addWorker). */
  private readonly workerModels = new Map<WorkerId, ReadonlySet<string>>();
  /** The most tokens (prompt and output) one sequence may reach on each worker, for workers that declared it. */
  private readonly workerMaxTokens = new Map<WorkerId, number>();
  /** Index in workerIds where the round-robin scan starts next. */
  private roundRobinNext = 0;
  private counters = { numRouted: 0, numEnqueued: 0, numRejected: 0, numExpired: 0 };

  constructor(options: RouterOptions) {
    if (!Number.isSafeInteger(options.blockSize) || options.blockSize < 1) {
      throw new RangeError(`blockSize must be a positive integer, got ${options.blockSize}`);
    }
    this.blockSize = options.blockSize;
    this.policy = parsePolicyName(options.policy ?? 'kv');
    this.overlapWeight = nonNegative(options.overlapWeight ?? 1, 'overlapWeight');
    this.temperature = nonNegative(options.temperature ?? 0, 'temperature');
    this.busyKvUsage = options.busyKvUsage ?? 0.95;
    this.busyNumWaiting = options.busyNumWaiting ?? 64;
    this.random = options.random;
    this.clock = options.clock ?? NO_CLOCK;
    this.index = options.index ?? new BitsetKvIndex();
    this.speculative = new SpeculativePrefixes(options.speculativeTtlMs ?? 10_000);
    this.sessions = new SessionAffinity({ ttlMs: options.sessionTtlMs ?? 30 * 60_000, maxSessions: options.maxSessions ?? 100_000 });
    this.queue = new AdmissionQueue({ maxQueued: options.maxQueued ?? 256, maxWaitMs: options.maxQueueWaitMs ?? 30_000 });
    this.retryAfter = new RetryAfterEstimator(options.retryAfter);
  }

  // -------------------------------------------------------------------------------------------------------------
  // Membership and load

  /**
   * Adds (or updates) a worker. With `models`, it only takes requests for those models (RoutingRequest.model; see
   * servesModel); without, any request.
   */
  addWorker(workerId: WorkerId, load: WorkerLoad = IDLE_LOAD, models?: readonly string[]): void {
    if (!this.loads.has(workerId)) this.workerIds.push(workerId);
    this.loads.set(workerId, load);
    if (models !== undefined) this.workerModels.set(workerId, new Set(models));
  }

  /** Replaces the models a worker holds (its adapters changed); undefined: it takes any request again. */
  setWorkerModels(workerId: WorkerId, models: readonly string[] | undefined): void {
    if (!this.loads.has(workerId)) return;
    if (models === undefined) this.workerModels.delete(workerId);
    else this.workerModels.set(workerId, new Set(models));
  }

  /**
   * Sets the most tokens (prompt and output) one sequence may reach on the worker: its context length. Requests are
   * then sent to it only when they fit (see RoutingRequest.contextTokens). Undefined: no limit is known.
   */
  setWorkerMaxTokens(workerId: WorkerId, maxTokens: number | undefined): void {
    if (!this.loads.has(workerId)) return;
    if (maxTokens === undefined) this.workerMaxTokens.delete(workerId);
    else this.workerMaxTokens.set(workerId, maxTokens);
  }

  /**
   * Forgets the worker everywhere. Returns the ids of requests routed to it and not finished: they are lost with
   * it, and the caller fails or retries them.
   */
  removeWorker(workerId: WorkerId): string[] {
    const at = this.workerIds.indexOf(workerId);
    if (at >= 0) {
      this.workerIds.splice(at, 1);
      if (at < this.roundRobinNext) this.roundRobinNext--;
    }
    this.loads.delete(workerId);
    this.workerModels.delete(workerId);
    this.workerMaxTokens.delete(workerId);
    this.index.removeWorker(workerId);
    this.speculative.removeWorker(workerId);
    this.sessions.removeWorker(workerId);
    return this.active.removeWorker(workerId);
  }

  updateLoad(workerId: WorkerId, load: WorkerLoad): void {
    if (!this.loads.has(workerId)) throw new Error(`unknown worker ${workerId}: addWorker first`);
    this.loads.set(workerId, load);
  }

  workers(): WorkerId[] {
    return [...this.workerIds];
  }

  // -------------------------------------------------------------------------------------------------------------
  // KV events

  /** Applies a batch of one worker's events in order. Events of workers not (yet) added are indexed all the same. */
  applyKvEvents(workerId: WorkerId, events: readonly KvEvent[]): KvEventsResult {
    for (const event of events) {
      if (event.type === 'stored' && event.blockSize !== this.blockSize) {
        throw new RangeError(`worker ${workerId} stores blocks of ${event.blockSize} tokens; the router hashes blocks of ${this.blockSize}`);
      }
    }
    const result: KvEventsResult = { needsResync: false, numApplied: 0, numDuplicates: 0 };
    for (const event of events) {
      const applied = this.index.applyEvent(workerId, event);
      result.needsResync = applied.needsResync;
      if (applied.status === 'duplicate') {
        result.numDuplicates++;
        continue;
      }
      result.numApplied++;
      // The worker's own word replaces the router's guess, for better (stored) or worse (removed). Only its primary
      // pool's: the guess is about the blocks the request computes there, and a RAM or disk tier's copies (offloaded,
      // evicted, cleared) say nothing about those.
      if (event.tier !== undefined) continue;
      if (event.type === 'cleared') this.speculative.removeWorker(workerId);
      else this.speculative.drop(workerId, event.blockHashes);
    }
    return result;
  }

  /** Replaces the worker's indexed blocks with its dump; see KvIndex.resync for lastEventId and lowerTiers. */
  resyncWorker(workerId: WorkerId, blockHashes: readonly BlockHash[], lastEventId?: number, lowerTiers?: LowerTierDump): void {
    this.index.resync(workerId, blockHashes, lastEventId, lowerTiers);
  }

  /** A dump of the worker was asked for: see KvIndex.beginResync. endResync when it will not come. */
  beginResync(workerId: WorkerId): void {
    this.index.beginResync(workerId);
  }

  endResync(workerId: WorkerId): void {
    this.index.endResync(workerId);
  }

  workersNeedingResync(): WorkerId[] {
    return this.index.workersNeedingResync();
  }

  // -------------------------------------------------------------------------------------------------------------
  // Routing

  route(request: RoutingRequest, nowMs: number, options: RouteOptions = {}): RouteOutcome {
    const { requestId } = request;
    if (this.active.has(requestId) || this.queue.has(requestId)) throw new Error(`request ${requestId} is already routed or queued`);
    const startMs = this.clock();
    if (this.workerIds.length === 0) {
      this.counters.numRejected++;
      return { kind: 'rejected', requestId, reason: 'no-workers', retryAfterMs: this.retryAfter.retryAfterMs(1, nowMs) };
    }
    if (request.model !== undefined && !this.workerIds.some((id) => servesModel(this.workerModels.get(id), request.model))) {
      this.counters.numRejected++;
      return { kind: 'rejected', requestId, reason: 'no-model-workers', retryAfterMs: this.retryAfter.retryAfterMs(1, nowMs) };
    }
    const need = this.contextNeed(request);
    if (need === null) {
      this.counters.numRejected++;
      return { kind: 'rejected', requestId, reason: 'no-context-workers', retryAfterMs: this.retryAfter.retryAfterMs(1, nowMs) };
    }
    const hashes = hashTokenBlocks(request.tokenIds, this.blockSize, { cacheSalt: request.cacheSalt, adapterId: request.lora });
    const hashedMs = this.clock();
    const decision = this.decide(request, hashes, need, nowMs, startMs, hashedMs);
    if (decision === null) {
      if (this.queue.offer(requestId, { request, hashes }, nowMs)) {
        this.counters.numEnqueued++;
        return { kind: 'queued', requestId, numQueued: this.queue.size };
      }
      this.counters.numRejected++;
      return { kind: 'rejected', requestId, reason: 'overloaded', retryAfterMs: this.retryAfter.retryAfterMs(this.queue.size + 1, nowMs) };
    }
    if (options.commit ?? true) this.commit(request, hashes, decision, nowMs);
    return { kind: 'routed', decision };
  }

  /** Records a decision made with commit: false, once the request was really sent. */
  onRouted(request: RoutingRequest, decision: RoutingDecision, nowMs: number): void {
    if (this.active.has(request.requestId)) throw new Error(`request ${request.requestId} is already routed`);
    if (!this.loads.has(decision.workerId)) throw new Error(`unknown worker ${decision.workerId}`);
    const hashes = hashTokenBlocks(request.tokenIds, this.blockSize, { cacheSalt: request.cacheSalt, adapterId: request.lora });
    this.commit(request, hashes, decision, nowMs);
  }

  /** The request's first token came out: its prompt no longer counts as pending prefill on its worker. */
  onPrefillDone(requestId: string): void {
    this.active.prefillDone(requestId);
  }

  /** The request ended (any reason). A request still in the admission queue is dropped from it. */
  onFinished(requestId: string, nowMs: number): void {
    if (this.active.finish(requestId) !== undefined) this.retryAfter.recordFinish(nowMs);
    else this.queue.remove(requestId);
  }

  /** Takes a queued request out (its client went away). */
  cancelQueued(requestId: string): boolean {
    return this.queue.remove(requestId) !== undefined;
  }

  /**
   * Routes queued requests, oldest first, while some worker is not busy, and hands back those that waited too
   * long. Call it after load reports, finishes or prefill completions; the routed ones are committed. Requests for
   * a model (or adapter) none of whose workers has room keep their place without holding up those for another, and
   * so do requests too long for the workers that have room: order is kept among the requests of one model and need.
   */
  drainQueue(nowMs: number): DrainResult {
    const expired = this.queue.takeExpired(nowMs).map((entry) => entry.item.request);
    this.counters.numExpired += expired.length;
    const routed: DrainResult['routed'] = [];
    /**
     * Per model (undefined: any), the smallest context need that found no worker with room: a later request of that
     * model needing as much or more finds none either, and neither does any request when no model was named.
     */
    const waiting = new Map<string | undefined, number>();
    for (const entry of this.queue.inOrder()) {
      const { request, hashes } = entry.item;
      const need = this.contextNeed(request);
      // No worker takes its prompt any more (the ones that did left): it keeps its place until one does or it expires.
      if (need === null) continue;
      if ((waiting.get(undefined) ?? Infinity) <= need) continue;
      if (request.model !== undefined && (waiting.get(request.model) ?? Infinity) <= need) continue;
      const startMs = this.clock();
      const decision = this.decide(request, hashes, need, nowMs, startMs, startMs);
      if (decision === null) {
        // A request naming no model may go to any worker: when it cannot, no other needing as much can either.
        if (request.model === undefined && need === 0) break;
        waiting.set(request.model, Math.min(waiting.get(request.model) ?? Infinity, need));
        continue;
      }
      this.queue.remove(entry.id);
      this.commit(request, hashes, decision, nowMs);
      routed.push({ request, decision });
    }
    return { routed, expired };
  }

  stats(): RouterStats {
    return {
      numWorkers: this.workerIds.length, numActiveRequests: this.active.size, numQueued: this.queue.size, ...this.counters,
      numIndexedBlocks: this.index.numBlocks, numIndexedEntries: this.index.numEntries,
      numSpeculativeEntries: this.speculative.size, workersNeedingResync: this.index.workersNeedingResync(),
    };
  }

  // -------------------------------------------------------------------------------------------------------------
  // Internals

  private isBusy(reported: WorkerLoad, numOwnPrefilling: number): boolean {
    // Requests this router sent and that have not produced a token yet are waiting as far as it can tell.
    const numWaiting = Math.max(reported.numWaiting, numOwnPrefilling);
    return reported.kvUsage >= this.busyKvUsage || numWaiting >= this.busyNumWaiting;
  }

  /**
   * Leading blocks held by the index or a speculative insert. Either may hold any of them (a guess is dropped
   * block by block as events confirm it), so past the longer of the two runs the walk checks both per block.
   */
  private matchedBlocks(workerId: WorkerId, hashes: readonly BlockHash[], indexed: number, speculative: number, nowMs: number): number {
    let depth = Math.max(indexed, speculative);
    while (depth < hashes.length && (this.index.holds(workerId, hashes[depth]!) || this.speculative.holds(workerId, hashes[depth]!, nowMs))) {
      depth++;
    }
    return depth;
  }

  /** Whether the worker's context takes `tokens` (no limit known: it does). */
  private takes(workerId: WorkerId, tokens: number): boolean {
    const limit = this.workerMaxTokens.get(workerId);
    return limit === undefined || tokens <= limit;
  }

  /**
   * The tokens a candidate's context must take for this request: its prompt and max_tokens when some registered
   * worker of its model takes that many, else its prompt and one token of output (the request ends with "length"
   * there); 0 when no worker declared a limit. Null when no registered worker of its model takes even the prompt.
   */
  private contextNeed(request: RoutingRequest): number | null {
    if (this.workerMaxTokens.size === 0) return 0;
    const eligible = this.workerIds.filter((id) => servesModel(this.workerModels.get(id), request.model));
    const prompt = request.tokenIds.length + 1;
    const full = Math.max(prompt, request.contextTokens ?? 0);
    if (eligible.some((id) => this.takes(id, full))) return full;
    return eligible.some((id) => this.takes(id, prompt)) ? prompt : null;
  }

  /** The decision, or null when every worker (of the request's model, whose context takes `need` tokens) is busy. */
  private decide(request: RoutingRequest, promptHashes: readonly BlockHash[], need: number, nowMs: number, startMs: number,
    hashedMs: number): RoutingDecision | null {
    this.speculative.prune(nowMs);
    // A prompt computed whole matches nothing anywhere (commit still records its blocks where it goes).
    const hashes = request.computesWholePrompt ? NO_HASHES : promptHashes;
    const indexed = this.index.findMatches(hashes);
    const speculative = this.speculative.findMatches(hashes, nowMs);
    const shared = this.active.sharedBlocks(hashes);
    const computing = this.active.computingBlocks(hashes);
    const lookedUpMs = this.clock();

    const overlapWeight = nonNegative(request.override?.overlapWeight ?? this.overlapWeight, 'overlapWeight');
    const temperature = nonNegative(request.override?.temperature ?? this.temperature, 'temperature');
    const shape = { numPromptTokens: request.tokenIds.length, blockSize: this.blockSize, overlapWeight };
    const views: WorkerView[] = [];
    const terms: WorkerCostTerms[] = [];
    const candidates: number[] = [];
    const tooSmall: WorkerId[] = [];
    for (const workerId of this.workerIds) {
      if (!servesModel(this.workerModels.get(workerId), request.model)) continue;
      if (!this.takes(workerId, need)) {
        tooSmall.push(workerId);
        continue;
      }
      const reported = this.loads.get(workerId)!;
      const own = this.active.load(workerId);
      const indexedBlocks = indexed.get(workerId) ?? 0;
      const speculativeBlocks = speculative.get(workerId) ?? 0;
      const view: WorkerView = {
        workerId, reported, own, indexedBlocks,
        matchedBlocks: (indexedBlocks === 0 && speculativeBlocks === 0) || this.speculative.size === 0 ? indexedBlocks
          : this.matchedBlocks(workerId, hashes, indexedBlocks, speculativeBlocks, nowMs),
        sharedActiveBlocks: shared.get(workerId) ?? 0, computingBlocks: computing.get(workerId) ?? 0, busy: this.isBusy(reported, own.numPrefilling),
      };
      const lower = this.index.lowerTierRun(workerId, hashes, view.matchedBlocks);
      if (lower.blocks > 0) view.lowerTierBlocks = lower;
      if (!view.busy) candidates.push(views.length);
      views.push(view);
      terms.push(costTerms(shape, view));
    }
    if (candidates.length === 0) return null;

    const choice = this.choose(request, views, terms, candidates, temperature, nowMs);
    const chosen = terms[choice.index]!;
    const numSkipped = views.length - candidates.length;
    let reason = numSkipped === 0 ? choice.reason
      : `${choice.reason}; skipped busy ${views.filter((view) => view.busy).map((view) => view.workerId).join(', ')}`;
    if (tooSmall.length > 0) reason += `; skipped ${tooSmall.join(', ')} (context under ${need} tokens)`;
    const selectedMs = this.clock();
    return {
      requestId: request.requestId, workerId: chosen.workerId, overlapBlocks: chosen.overlapBlocks,
      newPrefillTokens: request.tokenIds.length - chosen.overlapBlocks * this.blockSize, costTerms: terms,
      candidates: candidates.length, strategy: choice.strategy, reason,
      overhead: {
        hashingUs: 1000 * (hashedMs - startMs), lookupUs: 1000 * (lookedUpMs - hashedMs),
        selectionUs: 1000 * (selectedMs - lookedUpMs), totalUs: 1000 * (selectedMs - startMs),
      },
    };
  }

  private choose(request: RoutingRequest, views: readonly WorkerView[], terms: readonly WorkerCostTerms[],
    candidates: readonly number[], temperature: number, nowMs: number): Choice {
    const pick = (pickIn: (subset: WorkerView[], random: RandomSource) => number) => {
      return candidates[pickIn(candidates.map((i) => views[i]!), this.random)]!;
    };
    switch (this.policy) {
      case 'kv':
        return this.chooseByCost(terms, candidates, temperature, '');
      case 'session': {
        if (request.sessionId === undefined) return this.chooseByCost(terms, candidates, temperature, 'no session id; ');
        const workerId = this.sessions.get(request.sessionId, nowMs);
        const at = workerId === undefined ? -1 : candidates.find((i) => views[i]!.workerId === workerId) ?? -1;
        if (at >= 0) return { index: at, strategy: 'session', reason: `session ${request.sessionId} stays on ${workerId}` };
        const why = workerId === undefined ? 'new session' : this.loads.has(workerId) ? `session worker ${workerId} busy` : `session worker ${workerId} gone`;
        return this.chooseByCost(terms, candidates, temperature, `${why}; `);
      }
      case 'round-robin': {
        // The turn is over every registered worker; views holds only those serving the request's model, in the
        // same order, so each turn's worker is looked up among them.
        const numWorkers = this.workerIds.length;
        for (let step = 0; step < numWorkers; step++) {
          const workerId = this.workerIds[(this.roundRobinNext + step) % numWorkers]!;
          const at = views.findIndex((view) => view.workerId === workerId);
          if (at >= 0 && !views[at]!.busy) return { index: at, strategy: 'round-robin', reason: 'next in turn' };
        }
        throw new Error('round-robin found no candidate although one is not busy');
      }
      case 'random':
        return { index: pick(pickRandom), strategy: 'random', reason: 'uniform draw' };
      case 'least-loaded':
        return { index: pick(pickLeastLoaded), strategy: 'least-loaded', reason: 'fewest requests in flight' };
      case 'power-of-two':
        return { index: pick(pickPowerOfTwo), strategy: 'power-of-two', reason: 'less loaded of two drawn' };
    }
  }

  private chooseByCost(terms: readonly WorkerCostTerms[], candidates: readonly number[], temperature: number, prefix: string): Choice {
    const subset = candidates.map((i) => terms[i]!);
    const index = candidates[selectByCost(subset, temperature, this.random)]!;
    const chosen = terms[index]!;
    const lowest = Math.min(...subset.map((t) => t.cost));
    const how = temperature > 0 ? `softmax draw at temperature ${temperature}, cost ${round(chosen.cost)} (lowest ${round(lowest)})`
      : `lowest cost ${round(chosen.cost)}`;
    return { index, strategy: 'kv', reason: `${prefix}${how}, overlap ${chosen.overlapBlocks} blocks` };
  }

  private commit(request: RoutingRequest, hashes: readonly BlockHash[], decision: RoutingDecision, nowMs: number): void {
    const { workerId } = decision;
    const numPromptTokens = request.tokenIds.length;
    const overlapBlocks = reusableBlocks(numPromptTokens, this.blockSize, decision.overlapBlocks);
    this.active.add(request.requestId, workerId, hashes, numPromptTokens % this.blockSize !== 0, overlapBlocks,
      numPromptTokens - overlapBlocks * this.blockSize);
    // Blocks the index already vouches for need no guess; the rest will be stored once the worker computes them.
    let numIndexed = 0;
    while (numIndexed < hashes.length && this.index.holds(workerId, hashes[numIndexed]!)) numIndexed++;
    this.speculative.insert(workerId, hashes.slice(numIndexed), nowMs);
    if (this.policy === 'session' && request.sessionId !== undefined) this.sessions.set(request.sessionId, workerId, nowMs);
    const at = this.workerIds.indexOf(workerId);
    if (at >= 0) this.roundRobinNext = (at + 1) % this.workerIds.length;
    this.counters.numRouted++;
  }
}

function nonNegative(value: number, name: string): number {
  if (!(value >= 0) || !Number.isFinite(value)) throw new RangeError(`${name} must be a finite number >= 0, got ${value}`);
  return value;
}

function round(value: number): number {
  return Math.round(value * 100) / 100;
}
