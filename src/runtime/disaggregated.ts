// Disaggregated prefill and decode behind one `Engine`: prefill workers run prompts, decode workers generate, and
// the KV of each prompt moves from one to the other over a KvTransferChannel. The gateway holds it as it would hold
// one engine; the caller sees one stream, the first token from the prefill worker and the rest from the decode
// worker, in order.
//
// One request, prefill first:
//   1. the decode router picks the decode worker: load-aware and prefix-aware (its cost counts the blocks a worker
//      lacks, which is what would move), waiting in its admission queue when every decode worker is busy;
//   2. the prefill router says which prefill worker it would pick (KV-aware) without committing;
//   3. decideDisaggregation: remote prefill, or local prefill on the decode worker (short uncached prompt, prefill
//      queue over its bound, transfer slower than the prefill it saves, n > 1), except that a request that would
//      stay local only for the transfer estimate goes remote now and then to measure the link again
//      (transfer-probe); the choice and its reason go on every output (routing.disaggregation);
//   4. remote: the prefill worker prefills, samples and streams the first token, pins the blocks and hands over;
//      the decode worker reuses its own prefix hits, copies in the missing blocks, registers them and decodes on;
//      the prefill worker unpins when the decode worker says it has them.
// Abort reaches both workers whatever the stage. A prefill worker lost before the hand-over sends the request back
// to be prefilled again, whatever the migration limit: on another prefill worker when one is left (and the policy
// still says remote), else on its decode worker; from its prompt plus any token already streamed, so the stream
// goes on (runMigrating). A prefill worker failing otherwise before the first token, or a transfer that cannot
// happen, falls back to a local prefill on the decode worker; a failure after tokens went out ends the stream with
// an error, except a lost decode worker when migration is on: the request then continues on another decode worker
// (runMigrating). Either way the blocks on both sides are freed.

import {
  checkMigrationLimit, DEFAULT_MIGRATION_LIMIT, RequestMigration, type MigrationOptions,
} from './migration.ts';
import { EngineOverloadedError, InvalidRequestError, WorkerLostError } from '../engine/errors.ts';
import type { AdoptedResult, KvHandoff, KvImportPreparation, PrefillEvent } from '../engine/handoff.ts';
import type { BlockHash } from '../protocols/kv-events.ts';
import type { LowerTierDump } from '../router/kv-index.ts';
import { kvBytesPerToken } from '../engine/handoff.ts';
import type {
  DisaggregationSummary, Engine, EngineInfo, EngineOutput, EngineRequest, RoutingSummary, WorkerRole, LoraLoadInfo,
} from '../engine/types.ts';
import type { EngineStats } from '../protocols/worker.ts';
import type { RoutingDecision, RoutingRequest } from '../router/protocols.ts';
import type { Router } from '../router/router.ts';
import {
  DEFAULT_DISAGGREGATION_POLICY, DEFAULT_TRANSFER_PROBE_INTERVAL, RateEstimate, TransferProbe, decideDisaggregation,
  type DisaggregationPolicy,
} from './disaggregation-policy.ts';
import type { KvTransferChannel } from './kv-transfer.ts';
import type { Admitted } from './router-admission.ts';
import { routingRequestOf } from './routed-engine.ts';
import {
  combinedInfo, combinedStats, summarizeDecision, WorkerGroup, type EngineReadiness, type RoutableEngine,
  type NotRestarted, type WorkerGroupLog, type WorkerRestartOptions,
} from './worker-group.ts';

/** A prefill worker: runs a prompt to its first token and hands the request over. */
export interface PrefillWorkerEngine extends RoutableEngine {
  prefill(request: EngineRequest): AsyncIterable<PrefillEvent>;
  releaseHandoff(requestId: string): void;
  kvPool?: SharedArrayBuffer;
  kvLayout?: KvHandoff['sourceLayout'];
  /**
   * Bytes one token's KV takes in a transfer, when kvLayout's dtype cannot say it: a simulated FP8 cache moves one
   * byte per element, which no KvDtype names (its layout reads f16). Default: kvBytesPerToken(kvLayout).
   */
  kvTransferBytesPerToken?: number;
}

/** A decode worker: an ordinary engine that can also continue a handed-off request. */
export interface DecodeWorkerEngine extends RoutableEngine {
  adopt(handoff: KvHandoff, sourceId: string | null): AsyncIterable<EngineOutput>;
  onAdopted(listener: (result: AdoptedResult) => void): () => void;
  attachKvSource?(sourceId: string, pool: SharedArrayBuffer, layout: KvHandoff['sourceLayout']): void;
  /** Pins this worker's cached blocks of a handed-off prompt before its KV is fetched (LocalEngine.holdCachedPrefix). */
  holdCachedPrefix?(requestId: string, blockHashes: readonly KvHandoff['blockHashes'][number][]): Promise<number>;
  /**
   * Holds the cached prefix and reserves blocks of this worker's pool (kvPool) for the rest of a handed-off prompt's
   * KV, written there in place (LocalEngine.prepareKvImport); adopt(handoff, KV_IN_PLACE_SOURCE) then takes them.
   */
  prepareKvImport?(requestId: string, blockHashes: readonly KvHandoff['blockHashes'][number][], numBlocks: number, reserve?: boolean): Promise<KvImportPreparation>;
  releaseKvImport?(requestId: string, ticket: number): void;
  kvPool?: SharedArrayBuffer;
  /** The request is about to prefill on `prefillId`: a worker process may start taking its KV as it is computed. */
  expectHandoff?(request: EngineRequest, prefillId: string): void;
}

export interface DisaggregatedEngineOptions {
  prefill: readonly { id: string; engine: PrefillWorkerEngine }[];
  decode: readonly { id: string; engine: DecodeWorkerEngine }[];
  /** Routers over the prefill and the decode workers (their block size must be the workers'). */
  prefillRouter: Router;
  decodeRouter: Router;
  channel: KvTransferChannel;
  policy?: Partial<DisaggregationPolicy>;
  /**
   * Starting estimates for the policy's transfer-vs-prefill comparison, refined by every measured transfer and
   * prefill unless fixed. Defaults: 2 GB/s and 2,000 tokens/s (a CPU worker's memcpy and prefill, roughly); a pool
   * of simulated workers starts from its link and performance model (worker-pool.ts).
   */
  estimates?: DisaggregationEstimates;
  /** Engine clock, ms. */
  now: () => number;
  /** How often a request may move to another decode worker when its decode worker is lost (default: never). */
  migration?: MigrationOptions;
  /** Lost workers are replaced (see worker-group.ts); default: not. `start` gets the role of the lost worker. */
  restart?: Omit<WorkerRestartOptions<never>, 'start'> & {
    startPrefill(id: string): Promise<PrefillWorkerEngine>;
    startDecode(id: string): Promise<DecodeWorkerEngine>;
  };
  /** Without `restart`: why a lost worker is not replaced (worker-group.ts; default: restarts are off). */
  notRestarted?: NotRestarted;
  log?: WorkerGroupLog;
}

/** The policy's starting throughput estimates, and how the transfer estimate is kept honest. */
export interface DisaggregationEstimates {
  transferBytesPerSec?: number;
  prefillTokensPerSec?: number;
  /** The estimates are the truth: never refined, and the link is never probed. */
  fixed?: boolean;
  /**
   * Transfer-slower decisions in a row after which a request goes remote anyway to measure the link
   * (transfer-probe, TransferProbe); 0: never. Default DEFAULT_TRANSFER_PROBE_INTERVAL (8).
   */
  probeInterval?: number;
}

export type DisaggregatedStage = 'routing' | 'prefill' | 'transfer' | 'decode' | 'local';

/** Where one request is, so that an abort or a failure reaches every worker that holds part of it. */
interface Flight {
  readonly requestId: string;
  stage: DisaggregatedStage;
  prefillId?: string;
  decodeId?: string;
  /**
   * The engines of those workers, for abort and release: a draining worker has left its group (and a worker that
   * rejoined under its id is another engine) while it finishes what it holds.
   */
  prefillEngine?: PrefillWorkerEngine;
  decodeEngine?: DecodeWorkerEngine;
  /** The decode router's decision, which the policy weighs again when a prefill worker is lost. */
  decodeDecision?: RoutingDecision;
  /** The handoff whose source blocks are still pinned on the prefill worker. */
  pinned?: KvHandoff;
  summary?: RoutingSummary;
  aborted: boolean;
  finished: boolean;
}

export class DisaggregatedEngine implements Engine {
  /** The first decode worker's info: what the workers share (model, block size, backend). */
  private readonly baseInfo: EngineInfo;
  /** The workers' info as one engine's (see info), recomputed whenever a prefill or decode worker joins or leaves. */
  private combined: EngineInfo;
  readonly channel: KvTransferChannel;
  readonly policy: DisaggregationPolicy;
  private readonly prefillWorkers: WorkerGroup<PrefillWorkerEngine>;
  private readonly decodeWorkers: WorkerGroup<DecodeWorkerEngine>;
  private readonly prefillRouter: Router;
  private readonly decodeRouter: Router;
  private readonly now: () => number;
  private readonly log: WorkerGroupLog | undefined;
  private readonly flights = new Map<string, Flight>();
  private readonly transferRate: RateEstimate;
  private readonly prefillRate: RateEstimate;
  /** When a transfer-slower verdict is tested by a transfer: only transfers refine transferRate. */
  private readonly transferProbe: TransferProbe;
  /**
   * KV bytes of one token as the prefill workers' transfers report them (the policy's transfer estimate), from the
   * first prefill worker that joins with a layout: 0 until then.
   */
  private kvBytesPerToken = 0;
  private readonly counts = { disaggregated: 0, local: 0, fallbacks: 0 };
  /**
   * Requests each worker took over from a lost worker (counted by its group): a decode worker from a lost decode
   * worker, a prefill worker (or the decode worker itself) the prefill of a request whose prefill worker was lost
   * before the hand-over.
   */
  private readonly migration: MigrationOptions;

  constructor(options: DisaggregatedEngineOptions) {
    if (options.decode.length === 0) throw new Error('a disaggregated engine needs at least one decode worker');
    this.channel = options.channel;
    this.policy = { ...DEFAULT_DISAGGREGATION_POLICY, ...options.policy };
    this.prefillRouter = options.prefillRouter;
    this.decodeRouter = options.decodeRouter;
    this.now = options.now;
    this.log = options.log;
    this.migration = { ...options.migration, limit: checkMigrationLimit(options.migration?.limit ?? DEFAULT_MIGRATION_LIMIT) };
    const fixed = options.estimates?.fixed ?? false;
    this.transferRate = new RateEstimate(options.estimates?.transferBytesPerSec ?? 2e9, 0.2, fixed);
    this.prefillRate = new RateEstimate(options.estimates?.prefillTokensPerSec ?? 2_000, 0.2, fixed);
    // Fixed estimates learn nothing from a transfer: no probe.
    this.transferProbe = new TransferProbe(fixed ? 0 : options.estimates?.probeInterval ?? DEFAULT_TRANSFER_PROBE_INTERVAL);

    this.baseInfo = options.decode[0]!.engine.info;
    this.combined = this.baseInfo;
    const { restart, log } = options;
    const notRestarted = options.notRestarted ? { notRestarted: options.notRestarted } : {};
    // A worker joining (at the start or restarted) is connected to every worker of the other tier; one lost is
    // disconnected.
    this.prefillWorkers = new WorkerGroup<PrefillWorkerEngine>({
      router: this.prefillRouter, now: this.now, label: 'prefill worker', ...(log ? { log } : {}),
      ...(restart ? { restart: { ...restart, start: restart.startPrefill } } : {}), ...notRestarted,
      onJoin: (id, engine) => {
        // The prefill router picks only prefill workers whose context holds the prompt (none: the decode worker
        // prefills it).
        this.prefillRouter.setWorkerMaxTokens(id, engine.info.maxModelLen);
        // In the bytes transfers report (KvTransferStats.bytes), which the transfer estimate learns from; known once
        // a prefill worker is (a frontend's first decode worker may join before any).
        if (!(this.kvBytesPerToken > 0)) {
          this.kvBytesPerToken = engine.kvTransferBytesPerToken ?? (engine.kvLayout ? kvBytesPerToken(engine.kvLayout) : 0);
        }
        for (const [decodeId, decode] of this.decodeWorkers.entries()) this.connect(id, engine, decodeId, decode);
        this.recombine();
        return [];
      },
      onLeave: (id) => {
        this.channel.disconnect(id);
        this.recombine();
      },
    });
    this.decodeWorkers = new WorkerGroup<DecodeWorkerEngine>({
      router: this.decodeRouter, now: this.now, label: 'decode worker', ...(log ? { log } : {}),
      ...(restart ? { restart: { ...restart, start: restart.startDecode } } : {}), ...notRestarted,
      onJoin: (id, engine) => {
        // The decode router sends the worker only requests its context holds (RoutingRequest.contextTokens).
        this.decodeRouter.setWorkerMaxTokens(id, engine.info.maxModelLen);
        for (const [prefillId, prefill] of this.prefillWorkers.entries()) this.connect(prefillId, prefill, id, engine);
        this.recombine();
        return [engine.onAdopted((result) => this.onAdopted(id, result))];
      },
      onLeave: (id) => {
        this.channel.disconnect(id);
        this.recombine();
      },
    });
    for (const { id, engine } of options.prefill) this.prefillWorkers.add(id, engine);
    for (const { id, engine } of options.decode) this.decodeWorkers.add(id, engine);
    const infos = [...options.prefill, ...options.decode].map((w) => w.engine.info);
    const blockSizes = new Set(infos.map((i) => i.blockSize));
    if (blockSizes.size > 1) throw new Error(`prefill and decode workers must share one block size, got ${[...blockSizes].join(', ')}`);
  }

  /**
   * The workers' info as one engine's, following the workers there now (recomputed as they join and leave; with no
   * decode worker left, the last value stands): maxModelLen is the smallest context among the decode workers, which
   * hold a request's whole sequence, so every request the gateway accepts against it fits every decode worker (a
   * prompt longer than every prefill worker's context is prefilled on its decode worker); kvCapacityTokens is the
   * summed KV capacity of the prefill and decode workers. Requests accepted before a change are routed only to
   * decode workers that hold them (Router.setWorkerMaxTokens).
   */
  get info(): EngineInfo {
    return this.combined;
  }

  private recombine(): void {
    const decode = this.decodeWorkers.entries().map(([, engine]) => engine.info);
    if (decode.length === 0) return;
    const all = [...this.prefillWorkers.entries().map(([, engine]) => engine.info), ...decode];
    this.combined = { ...combinedInfo(this.baseInfo, decode), kvCapacityTokens: combinedInfo(this.baseInfo, all).kvCapacityTokens };
  }

  /** A prefill worker joins (a worker process found after the start); it is connected to every decode worker. */
  addPrefillWorker(id: string, engine: PrefillWorkerEngine): void {
    this.prefillWorkers.add(id, engine);
  }

  /** A decode worker joins; it is connected to every prefill worker. */
  addDecodeWorker(id: string, engine: DecodeWorkerEngine): void {
    this.decodeWorkers.add(id, engine);
  }

  /** A prefill or decode worker that left for good: no longer counted by readiness (see WorkerGroup.remove). */
  removeWorker(id: string): void {
    this.prefillWorkers.remove(id);
    this.decodeWorkers.remove(id);
  }

  private connect(prefillId: string, prefill: PrefillWorkerEngine, decodeId: string, decode: DecodeWorkerEngine): void {
    this.channel.connect({ id: prefillId, kvPool: prefill.kvPool, kvLayout: prefill.kvLayout },
      { id: decodeId, attachKvSource: decode.attachKvSource?.bind(decode) });
  }

  private get admission() {
    return this.decodeWorkers.admission;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Engine

  generate(request: EngineRequest): AsyncIterable<EngineOutput> {
    const engine = this;
    return (async function* () {
      if (engine.flights.has(request.id)) throw new Error(`request ${request.id} is already running`);
      const flight: Flight = { requestId: request.id, stage: 'routing', aborted: false, finished: false };
      engine.flights.set(request.id, flight);
      try {
        yield* engine.runMigrating(request, flight);
      } finally {
        engine.flights.delete(request.id);
        // The consumer left early (client gone) or a failure: stop it on every worker that holds part of it.
        if (!flight.finished) engine.stopEverywhere(flight);
        engine.releaseSource(flight);
        if (flight.decodeId !== undefined) engine.decodeRouter.onFinished(request.id, engine.now());
        engine.admission.drain();
      }
    })();
  }

  abort(requestId: string): void {
    const flight = this.flights.get(requestId);
    if (flight) flight.aborted = true;
    if (this.admission.cancel(requestId)) return;
    if (!flight) return;
    this.stopEverywhere(flight);
  }

  /** Every prefill and decode worker resets its prefix cache; true when all of them did. */
  async resetPrefixCache(): Promise<boolean> {
    const results = await Promise.all([this.prefillWorkers.resetPrefixCache(), this.decodeWorkers.resetPrefixCache()]);
    return results.every(Boolean);
  }

  /** Loads a LoRA adapter onto every decode worker, then every prefill worker (a request may run on either). */
  async loadLora(name: string, path: string): Promise<LoraLoadInfo> {
    const info = await this.decodeWorkers.loadLora(name, path);
    try {
      if (this.prefillWorkers.size > 0) await this.prefillWorkers.loadLora(name, path);
    } catch (error) {
      await this.decodeWorkers.unloadLora(name).catch(() => {});
      throw error;
    }
    return info;
  }

  async unloadLora(name: string): Promise<void> {
    await Promise.all([this.prefillWorkers.unloadLora(name), this.decodeWorkers.unloadLora(name)]);
  }

  /**
   * The adapters (their keys) a worker holds, when workers hold different ones (a frontend's `conduit worker`s): a
   * request for one is routed only to prefill and decode workers that hold it (none among the prefill workers: the
   * decode worker prefills it; none among the decode workers: refused). Undefined: the worker takes any request.
   */
  setWorkerModels(workerId: string, models: readonly string[] | undefined): void {
    if (this.prefillWorkers.has(workerId)) this.prefillRouter.setWorkerModels(workerId, models);
    if (this.decodeWorkers.has(workerId)) this.decodeRouter.setWorkerModels(workerId, models);
  }

  stats(): EngineStats {
    return combinedStats([this.prefillWorkers, this.decodeWorkers]);
  }

  /**
   * Whether a request can be served: a decode worker is enough (with no prefill worker left, decode workers
   * prefill themselves).
   */
  readiness(): EngineReadiness {
    const decode = this.decodeWorkers.readiness();
    const prefill = this.prefillWorkers.readiness();
    return {
      ...decode,
      workersAlive: decode.workersAlive + prefill.workersAlive, workersTotal: decode.workersTotal + prefill.workersTotal,
    };
  }

  /** Per-worker stats with the worker's role, for /health and the metrics' worker label. */
  workerStats(): { workerId: string; role: WorkerRole; stats: EngineStats; info: EngineInfo }[] {
    return [
      ...this.prefillWorkers.workerStats().map((w) => ({ ...w, role: 'prefill' as const })),
      ...this.decodeWorkers.workerStats().map((w) => ({ ...w, role: 'decode' as const })),
    ];
  }

  /** How many requests went each way, and how many fell back to a local prefill after a failure. */
  decisionCounts(): { disaggregated: number; local: number; fallbacks: number } {
    return { ...this.counts };
  }

  /** The policy's current throughput estimates. */
  estimates(): { transferBytesPerSec: number; prefillTokensPerSec: number } {
    return { transferBytesPerSec: this.transferRate.perSec, prefillTokensPerSec: this.prefillRate.perSec };
  }

  /** Where a request is: routing, prefill, transfer, decode or local (a decode worker prefilling it); undefined once over. */
  requestStage(requestId: string): DisaggregatedStage | undefined {
    return this.flights.get(requestId)?.stage;
  }

  get prefillWorkerIds(): string[] {
    return this.prefillWorkers.ids;
  }

  get decodeWorkerIds(): string[] {
    return this.decodeWorkers.ids;
  }

  /** Which workers hold part of a request now; undefined once it is over. */
  requestWorkers(requestId: string): { prefillWorkerId?: string; decodeWorkerId?: string } | undefined {
    const flight = this.flights.get(requestId);
    if (!flight) return undefined;
    return {
      ...(flight.prefillId !== undefined ? { prefillWorkerId: flight.prefillId } : {}),
      ...(flight.decodeId !== undefined ? { decodeWorkerId: flight.decodeId } : {}),
    };
  }

  /**
   * Replaces the router's view of a worker's KV cache (the prefill or the decode router, whichever routes to it)
   * with a snapshot of its cached block hashes: a worker that joins with blocks cached, or that lost events.
   * False when no router knows the worker.
   */
  resyncWorker(workerId: string, blockHashes: readonly BlockHash[], lastEventId?: number, lowerTiers?: LowerTierDump): boolean {
    const router = this.routerOf(workerId);
    router?.resyncWorker(workerId, blockHashes, lastEventId, lowerTiers);
    return router !== undefined;
  }

  /** A dump of the worker was asked for (Router.beginResync), or will not come (endResync). */
  beginResync(workerId: string): void {
    this.routerOf(workerId)?.beginResync(workerId);
  }

  endResync(workerId: string): void {
    this.routerOf(workerId)?.endResync(workerId);
  }

  private routerOf(workerId: string): Router | undefined {
    return this.prefillWorkers.has(workerId) ? this.prefillRouter : this.decodeWorkers.has(workerId) ? this.decodeRouter : undefined;
  }

  /** Workers whose KV events had a gap: their views need a resync. */
  workersNeedingResync(): string[] {
    return [...this.prefillRouter.workersNeedingResync(), ...this.decodeRouter.workersNeedingResync()];
  }

  /** One worker's engine, prefill or decode (for drills that kill it); undefined once it left. */
  workerEngine(workerId: string): RoutableEngine | undefined {
    return this.prefillWorkers.get(workerId) ?? this.decodeWorkers.get(workerId);
  }

  async close(): Promise<void> {
    await Promise.all([this.prefillWorkers.close(), this.decodeWorkers.close()]);
  }

  // -------------------------------------------------------------------------------------------------------------
  // One request

  /**
   * The request as run() runs it, and continued when a worker running it is lost:
   * - its prefill worker, before the hand-over: prefilled again (replacePrefillWorker), whatever the migration limit;
   * - its decode worker, mid-stream: continued on another decode worker, up to the migration limit. The new decode
   *   worker computes the prompt and the tokens so far itself: the lost worker's KV is gone, and the prefill worker
   *   that computed the prompt has released it, so going back through a prefill worker would redo the same work plus
   *   a transfer, and move the stream through one more worker that could fail. Its own prefix cache still serves
   *   whatever of the prompt it holds.
   */
  private async *runMigrating(request: EngineRequest, flight: Flight): AsyncGenerator<EngineOutput> {
    const migration = new RequestMigration(request, this.migration);
    let stream: AsyncGenerator<EngineOutput> = this.run(request, flight);
    for (;;) {
      try {
        for await (const output of stream) {
          const adapted = migration.adapt(output);
          yield adapted.output;
          // A stop string matched on this side after a migration: the decode worker is stopped on the way out.
          if (adapted.stopped) return;
        }
        return;
      } catch (error) {
        migration.aborted = flight.aborted;
        // n > 1 after its first tokens is not continued (migration.ts): its completions would need n prompts.
        const prefillLost = flight.stage === 'prefill' && flight.prefillId !== undefined && !this.prefillWorkers.has(flight.prefillId)
          && (request.sampling.n === 1 || migration.generated.length === 0);
        if (prefillLost) {
          if (flight.aborted) {
            flight.finished = true;
            yield migration.closingOutput(this.now());
            return;
          }
          stream = this.replacePrefillWorker(migration, flight);
          continue;
        }
        const decodeLost = flight.decodeId !== undefined && !this.decodeWorkers.has(flight.decodeId)
          && (flight.stage === 'local' || flight.stage === 'decode' || flight.stage === 'transfer');
        if (decodeLost && migration.abortedWhenLost(error)) {
          flight.finished = true;
          yield migration.closingOutput(this.now());
          return;
        }
        if (!decodeLost || !migration.canMigrate(error)) throw error;
        migration.migrateFrom(flight.decodeId!, 'worker-lost');
        const next = yield* this.replaceDecodeWorker(migration, flight, error as Error);
        if (next === null) return;
        stream = next;
      }
    }
  }

  /** Places a migrating request on another decode worker; null when it was aborted on the way (closing output sent). */
  private async *replaceDecodeWorker(migration: RequestMigration, flight: Flight, lost: Error):
    AsyncGenerator<EngineOutput, AsyncGenerator<EngineOutput> | null> {
    const request = migration.request;
    // The lost attempt's placement ends here: its worker is gone from the router, its pins with the prefill worker.
    this.decodeRouter.onFinished(request.id, this.now());
    this.releaseSource(flight);
    flight.prefillId = undefined;
    flight.prefillEngine = undefined;
    flight.decodeId = undefined;
    flight.decodeEngine = undefined;
    flight.stage = 'routing';
    const placed = await this.decodeWorkers.placeAfterLoss(migration, lost, () => flight.aborted);
    if (placed === null) {
      flight.finished = true;
      yield migration.closingOutput(this.now());
      return null;
    }
    const { decision, engine: decodeEngine } = placed;
    flight.decodeId = decision.workerId;
    flight.decodeEngine = decodeEngine;
    flight.decodeDecision = decision;
    const attempt = migration.attempt();
    const previous = flight.summary?.disaggregation;
    flight.summary = {
      ...summarizeDecision(decision, this.now()),
      ...(previous ? { disaggregation: { ...previous, decodeWorkerId: decision.workerId } } : {}),
    };
    return this.runLocal(attempt, flight, decodeEngine);
  }

  private async *run(request: EngineRequest, flight: Flight): AsyncGenerator<EngineOutput> {
    this.checkFitsDecodeWorker(request);
    const routing = routingRequestOf(request);
    const routeStartedAt = this.now();
    let placed: Admitted;
    try {
      placed = await this.admission.place(routing);
    } catch (error) {
      // Refused because no decode worker is left: the refusal says why (restarting, given up), as /health does.
      if (!flight.aborted && error instanceof EngineOverloadedError && this.decodeWorkers.size === 0) {
        throw this.decodeWorkers.noWorkerError(error.retryAfterMs);
      }
      // Aborted while it waited in the admission queue: an abort, so the caller reports its own reason.
      if (!flight.aborted) throw error;
      flight.finished = true;
      yield closingOutput(request, this.now());
      return;
    }
    const { decision: decodeDecision, queuedAt } = placed;
    flight.decodeId = decodeDecision.workerId;
    flight.decodeDecision = decodeDecision;
    const decodeEngine = this.decodeWorkers.get(decodeDecision.workerId);
    if (!decodeEngine) throw new WorkerLostError(decodeDecision.workerId, `decode worker ${decodeDecision.workerId} left before the request could start`);
    flight.decodeEngine = decodeEngine;
    if (flight.aborted) {
      flight.finished = true;
      yield closingOutput(request, this.now());
      return;
    }

    const { choice, prefillDecision } = this.decide(request, routing, decodeDecision);
    flight.summary = { ...summarizeDecision(decodeDecision, this.now(), queuedAt, routeStartedAt), disaggregation: choice };
    if (choice.mode === 'local' || prefillDecision === null) {
      this.counts.local++;
      yield* this.runLocal(request, flight, decodeEngine);
      return;
    }
    this.counts.disaggregated++;
    // The decode worker will not compute this prompt: its router must not count it as pending prefill there.
    this.decodeRouter.onPrefillDone(request.id);
    yield* this.runRemote(request, flight, prefillDecision, decodeEngine);
  }

  /** Prefill on a prefill worker, then decode on the decode worker with the KV it hands over. */
  private async *runRemote(request: EngineRequest, flight: Flight, prefillDecision: RoutingDecision,
    decodeEngine: DecodeWorkerEngine): AsyncGenerator<EngineOutput> {
    decodeEngine.expectHandoff?.(request, prefillDecision.workerId);
    const handoff = yield* this.runPrefill(request, flight, prefillDecision, decodeEngine);
    if (handoff === null) return;
    const prefillId = flight.prefillId!;
    // Lost between its handoff and the decode worker taking it: the decode worker was never told where the blocks
    // are, so nothing was handed over (runMigrating prefills again). Once told, the copy goes on without the
    // prefill worker: its pool is shared memory that outlives its thread, and the pin stays with the blocks.
    if (this.prefillGone(flight)) {
      throw new WorkerLostError(prefillId, `prefill worker ${prefillId} was lost before handing request ${request.id} over`);
    }
    // The decode worker chosen before the prefill may leave (drain, or be lost) before it takes anything of the
    // request: another takes the handoff, whose blocks stay pinned on the prefill worker. Not a migration: no decode
    // work is lost. Once an output came from the decode side, a loss is runMigrating's.
    let decode: DecodeWorkerEngine | null = decodeEngine;
    for (let redirects = 0; ; redirects++) {
      if (!this.decodeWorkers.has(flight.decodeId!)) decode = await this.redirectDecode(request, flight, redirects);
      if (decode === null) {
        flight.finished = true;
        yield closingOutput(request, this.now(), handoff.outputTokenIds.length);
        return;
      }
      try {
        yield* this.runDecode(request, flight, handoff, decode);
        return;
      } catch (error) {
        if (flight.stage !== 'transfer' || flight.aborted || this.decodeWorkers.has(flight.decodeId!)) throw error;
      }
    }
  }

  /**
   * Another decode worker for a handed-off request whose decode worker left before taking it (runRemote); null when
   * the request was aborted on the way. Gives up after a few, with the loss, rather than following a fleet that
   * drains one worker after another.
   */
  private async redirectDecode(request: EngineRequest, flight: Flight, redirects: number): Promise<DecodeWorkerEngine | null> {
    const left = flight.decodeId!;
    const lost = new WorkerLostError(left, `decode worker ${left} left before request ${request.id} was handed over to it`);
    // A draining worker may still be streaming the prompt's blocks in for it (expectHandoff): they stop.
    flight.decodeEngine?.abort(request.id);
    this.decodeRouter.onFinished(request.id, this.now());
    if (redirects >= MAX_DECODE_REDIRECTS) throw lost;
    let placed: Admitted;
    try {
      placed = await this.admission.place(routingRequestOf(request));
    } catch {
      if (flight.aborted) return null;
      throw lost;
    }
    const decodeEngine = this.decodeWorkers.get(placed.decision.workerId);
    if (!decodeEngine || flight.aborted) {
      this.decodeRouter.onFinished(request.id, this.now());
      this.admission.drain();
      if (!decodeEngine) throw lost;
      return null;
    }
    // It will not compute the prompt: the router must not count it as pending prefill there.
    this.decodeRouter.onPrefillDone(request.id);
    this.log?.('info', `request ${request.id}: decode worker ${left} left before the hand-over; ${placed.decision.workerId} takes it`);
    flight.decodeId = placed.decision.workerId;
    flight.decodeEngine = decodeEngine;
    flight.decodeDecision = placed.decision;
    const disaggregation = flight.summary?.disaggregation;
    if (flight.summary && disaggregation) flight.summary = { ...flight.summary, workerId: placed.decision.workerId, disaggregation: { ...disaggregation, decodeWorkerId: placed.decision.workerId } };
    return decodeEngine;
  }

  /**
   * The request back to be prefilled after its prefill worker was lost before the hand-over: the prompt plus the
   * tokens the caller already has (none, or the first token) go to another prefill worker when the policy still
   * sends them out (the lost worker has left the prefill router), or are prefilled on the decode worker, which stays
   * the request's decode worker either way (its router placement is kept; it holds no block for the request yet).
   * Greedy output is unchanged; a seeded request's draws after a streamed first token differ, as after any
   * migration (migration.ts).
   */
  private replacePrefillWorker(migration: RequestMigration, flight: Flight): AsyncGenerator<EngineOutput> {
    const lostId = flight.prefillId!;
    const decodeId = flight.decodeId!;
    migration.migrateFrom(lostId, PREFILL_WORKER_LOST, { againstLimit: false });
    this.releaseSource(flight);
    flight.prefillId = undefined;
    flight.prefillEngine = undefined;
    flight.stage = 'routing';
    const attempt = migration.attempt();
    const decodeEngine = this.decodeWorkers.get(decodeId);
    if (!decodeEngine) {
      // Nowhere to prefill it: the decode worker is gone too. runMigrating moves it on like any request whose
      // decode worker is lost (when migration is on: that worker prefills it), or fails it with this error.
      const why = `prefill worker ${lostId} was lost before the hand-over, and decode worker ${decodeId}, which would `
        + 'prefill it instead, is gone too';
      flight.stage = 'local';
      flight.summary = {
        ...flight.summary!,
        disaggregation: { ...flight.summary!.disaggregation!, mode: 'local', reason: 'prefill-failed', prefillWorkerId: undefined, detail: why },
      };
      const lost = new WorkerLostError(decodeId, `request ${migration.request.id}: ${why}`);
      return (async function* () { throw lost; })();
    }
    const routing: RoutingRequest = {
      requestId: attempt.id, tokenIds: attempt.promptTokenIds, cacheSalt: attempt.cacheSalt, sessionId: attempt.sessionId, lora: attempt.lora,
      ...(attempt.lora !== undefined ? { model: attempt.lora } : {}),
    };
    const { choice, prefillDecision } = this.decide(attempt, routing, flight.decodeDecision!);
    const takenBy = prefillDecision?.workerId ?? decodeId;
    migration.placed(takenBy);
    (prefillDecision !== null ? this.prefillWorkers : this.decodeWorkers).countMigration(takenBy);
    if (prefillDecision !== null) {
      flight.summary = { ...flight.summary!, disaggregation: choice };
      return this.runRemote(attempt, flight, prefillDecision, decodeEngine);
    }
    this.counts.fallbacks++;
    flight.summary = {
      ...flight.summary!,
      disaggregation: {
        ...choice, mode: 'local', reason: 'prefill-failed', prefillWorkerId: undefined,
        detail: `prefill worker ${lostId} was lost before the hand-over; prefilled here: ${choice.detail}`,
      },
    };
    return this.runLocal(attempt, flight, decodeEngine);
  }

  /**
   * Refuses, before any work, a prompt that no decode worker's context holds with room for one token of output, as
   * one worker refuses it (prompt_too_long): it would otherwise be prefilled, its first token streamed, and only then
   * be refused by the decode worker it was handed to. With no decode worker there, the admission says so.
   */
  private checkFitsDecodeWorker(request: EngineRequest): void {
    const contexts = this.decodeWorkers.entries().map(([, engine]) => engine.info.maxModelLen);
    if (contexts.length === 0) return;
    const largest = Math.max(...contexts);
    const length = request.promptTokenIds.length;
    if (length >= largest) {
      throw new InvalidRequestError('prompt_too_long', request.id,
        `prompt of ${length} tokens leaves no room for output within the context length ${largest} of any decode worker`);
    }
  }

  private decide(request: EngineRequest, routing: RoutingRequest, decodeDecision: RoutingDecision):
    { choice: DisaggregationSummary; prefillDecision: RoutingDecision | null } {
    let prefillDecision: RoutingDecision | null = null;
    let ineligible = request.sampling.n !== 1 ? `n = ${request.sampling.n} samples share the prompt's blocks on one worker`
      : request.sampling.promptLogprobs !== undefined ? 'prompt logprobs come from the worker that computes the prompt, which then samples'
        : undefined;
    if (this.prefillWorkers.size > 0 && ineligible === undefined) {
      // A prefill worker computes the prompt and samples one token: its context must hold that much, not max_tokens.
      const { contextTokens: _, ...prompt } = routing;
      const outcome = this.prefillRouter.route(prompt, this.now(), { commit: false });
      // The prefill router never queues: a busy prefill tier is a reason to prefill on the decode worker.
      if (outcome.kind === 'queued') this.prefillRouter.cancelQueued(request.id);
      if (outcome.kind === 'routed') prefillDecision = outcome.decision;
      // No prefill worker could ever take it (not one busy now): the request is not one to hand over here.
      if (outcome.kind === 'rejected' && outcome.reason === 'no-context-workers') {
        ineligible = `no prefill worker's context holds a prompt of ${request.promptTokenIds.length} tokens`;
      } else if (outcome.kind === 'rejected' && outcome.reason === 'no-model-workers') {
        ineligible = `no prefill worker holds adapter ${request.lora}`;
      }
    }
    const chosen = prefillDecision?.costTerms.find((t) => t.workerId === prefillDecision!.workerId);
    const decodeTerms = decodeDecision.costTerms.find((t) => t.workerId === decodeDecision.workerId);
    const decodeHeldBlocks = decodeTerms?.heldBlocks;
    const decodeLowerTierBlocks = decodeTerms?.lowerTierBlocks;
    const choice = decideDisaggregation({
      numPromptTokens: request.promptTokenIds.length, blockSize: this.info.blockSize,
      ineligible,
      decodeWorkerId: decodeDecision.workerId, decodeOverlapBlocks: decodeDecision.overlapBlocks,
      ...(decodeHeldBlocks !== undefined ? { decodeHeldBlocks } : {}),
      ...(decodeLowerTierBlocks !== undefined
        ? { decodeLowerTierBlocks: { blocks: decodeLowerTierBlocks, disk: decodeTerms?.lowerTierDiskBlocks ?? 0 } } : {}),
      prefill: prefillDecision && chosen
        ? { workerId: prefillDecision.workerId, queuedPrefillTokens: chosen.queuedPrefillTokens }
        : null,
      kvBytesPerToken: this.kvBytesPerToken, transferBytesPerSec: this.transferRate.perSec,
      prefillTokensPerSec: this.prefillRate.perSec, probeTransfer: this.transferProbe.due,
    }, this.policy);
    this.transferProbe.record(choice.reason);
    return { choice, prefillDecision: choice.mode === 'disaggregated' ? prefillDecision : null };
  }

  /** The decode worker runs the whole request, as an aggregated worker would. */
  private async *runLocal(request: EngineRequest, flight: Flight, decodeEngine: DecodeWorkerEngine): AsyncGenerator<EngineOutput> {
    flight.stage = 'local';
    const workerId = flight.decodeId!;
    let first = true;
    try {
      for await (const output of decodeEngine.generate(request)) {
        if (first) {
          this.decodeRouter.onPrefillDone(request.id);
          this.observePrefill(output);
          first = false;
        }
        this.decodeWorkers.updateLoad(workerId, decodeEngine);
        if (output.finishReason !== undefined) flight.finished = true;
        yield { ...output, routing: flight.summary };
      }
    } catch (error) {
      throw this.lostOr(error, workerId, this.decodeWorkers, request.id);
    }
  }

  /**
   * The prefill worker's part: yields the first token and returns the handoff, or null when the stream is over
   * (finished on its first token, aborted, or prefilled locally after the prefill worker failed). Throws
   * WorkerLostError when the prefill worker is lost before its handoff (runMigrating sends the request on).
   */
  private async *runPrefill(request: EngineRequest, flight: Flight, decision: RoutingDecision,
    decodeEngine: DecodeWorkerEngine): AsyncGenerator<EngineOutput, KvHandoff | null> {
    const prefillId = decision.workerId;
    const prefillEngine = this.prefillWorkers.get(prefillId);
    flight.stage = 'prefill';
    flight.prefillId = prefillId;
    flight.prefillEngine = prefillEngine;
    if (!prefillEngine) throw new WorkerLostError(prefillId, `prefill worker ${prefillId} left before request ${request.id} could start`);
    const routing = routingRequestOf(request);
    this.prefillRouter.onRouted(routing, decision, this.now());
    let handoff: KvHandoff | null = null;
    let emitted = false;
    let fallBackWhy: string | undefined;
    try {
      for await (const event of prefillEngine.prefill(request)) {
        if (event.type === 'handoff') {
          handoff = event.handoff;
          flight.pinned = handoff;
          // The last event: a loss noticed after it must not fail the stream (runRemote checks the worker).
          break;
        }
        const { output } = event;
        if (!emitted && output.newTokenIds.length > 0) {
          emitted = true;
          this.prefillRouter.onPrefillDone(request.id);
          this.observePrefill(output);
        }
        this.prefillWorkers.updateLoad(prefillId, prefillEngine);
        if (output.finishReason !== undefined) flight.finished = true;
        yield { ...output, routing: flight.summary };
        if (flight.finished) return null;
      }
    } catch (error) {
      // Lost: gone (prefillGone), or its stream ended as a lost worker's does (a drain's grace ran out under it). A
      // draining worker that refused the prompt is not lost: that is a failure like any other error's.
      if (!this.prefillWorkers.has(prefillId) && ((prefillEngine.lost ?? true) || error instanceof WorkerLostError)) {
        throw new WorkerLostError(prefillId, `prefill worker ${prefillId} was lost while prefilling request ${request.id}`);
      }
      if (flight.aborted) throw error;
      if (emitted) {
        throw new Error(`request ${request.id}: prefill worker ${prefillId} failed after the first token and before `
          + `handing the request over: ${error instanceof Error ? error.message : String(error)}`, { cause: error });
      }
      fallBackWhy = `prefill worker ${prefillId} failed: ${error instanceof Error ? error.message : String(error)}`;
    } finally {
      this.prefillRouter.onFinished(request.id, this.now());
    }
    // Prefilled on the decode worker instead: the prefill worker's part (and its router entry) ended above.
    if (fallBackWhy !== undefined) return yield* this.fallBack(request, flight, decodeEngine, fallBackWhy);
    if (flight.aborted) {
      // The abort crossed the handoff on its way: the prefill worker's own abort unpinned the blocks (or will).
      this.releaseSource(flight);
      flight.finished = true;
      yield closingOutput(request, this.now(), handoff?.outputTokenIds.length ?? 0);
      return null;
    }
    if (handoff === null) throw new Error(`request ${request.id}: prefill worker ${prefillId} ended the prompt without a handoff`);
    return handoff;
  }

  /** The decode worker's part: takes the handoff, copies what it lacks, and streams the rest. */
  private async *runDecode(request: EngineRequest, flight: Flight, handoff: KvHandoff, decodeEngine: DecodeWorkerEngine): AsyncGenerator<EngineOutput> {
    const decodeId = flight.decodeId!;
    const prefillId = flight.prefillId!;
    flight.stage = 'transfer';
    const sourceId = this.prefillGone(flight) ? null : this.channel.sourceFor(prefillId, decodeId);
    try {
      for await (const output of decodeEngine.adopt(handoff, sourceId)) {
        flight.stage = 'decode';
        this.decodeWorkers.updateLoad(decodeId, decodeEngine);
        if (output.finishReason !== undefined) flight.finished = true;
        yield { ...output, routing: flight.summary };
      }
    } catch (error) {
      throw this.lostOr(error, decodeId, this.decodeWorkers, request.id);
    }
  }

  /** A local prefill on the decode worker after the disaggregated path broke before any token went out. */
  private async *fallBack(request: EngineRequest, flight: Flight, decodeEngine: DecodeWorkerEngine, why: string): AsyncGenerator<EngineOutput, null> {
    this.counts.fallbacks++;
    this.releaseSource(flight);
    flight.prefillId = undefined;
    flight.prefillEngine = undefined;
    const previous = flight.summary!.disaggregation!;
    flight.summary = {
      ...flight.summary!,
      disaggregation: { ...previous, mode: 'local', reason: 'prefill-failed', detail: why, prefillWorkerId: undefined },
    };
    yield* this.runLocal(request, flight, decodeEngine);
    return null;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Bookkeeping

  /** The decode worker has the blocks (or will recompute them): the prefill worker may unpin them. */
  private onAdopted(decodeId: string, result: AdoptedResult): void {
    if (result.transfer) {
      this.channel.log.record(result.transfer);
      // A transfer streamed during the prefill reports in ms only the part after the handoff; its bytes crossed the
      // link over that and the busy time hidden behind the prefill (overlapMs). Bytes over ms alone would make the
      // link look faster than it is, and send prompts remote that it cannot move in time.
      const { bytes, ms, overlapMs } = result.transfer;
      this.transferRate.observe(bytes, ms + (overlapMs ?? 0));
    }
    const flight = this.flights.get(result.requestId);
    if (!flight || flight.decodeId !== decodeId) return;
    this.releaseSource(flight);
    if (result.status === 'recompute' && flight.summary?.disaggregation) {
      this.counts.fallbacks++;
      flight.summary = {
        ...flight.summary,
        disaggregation: { ...flight.summary.disaggregation, mode: 'local', reason: 'transfer-failed', detail: result.error ?? 'KV not imported' },
      };
    }
  }

  private releaseSource(flight: Flight): void {
    const handoff = flight.pinned;
    if (!handoff) return;
    flight.pinned = undefined;
    flight.prefillEngine?.releaseHandoff(handoff.requestId);
  }

  /** Abort on both sides: each worker frees whatever of the request it holds (queued, running, pinned, pending). */
  private stopEverywhere(flight: Flight): void {
    flight.prefillEngine?.abort(flight.requestId);
    flight.decodeEngine?.abort(flight.requestId);
  }

  /** Measured prefill speed from the first output's chunks: what a local prefill would cost. */
  private observePrefill(output: EngineOutput): void {
    const chunks = output.timestamps.prefillChunks;
    if (chunks.length === 0) return;
    const tokens = chunks.reduce((sum, c) => sum + c.tokens, 0);
    const ms = chunks.reduce((sum, c) => sum + (c.end - c.start), 0);
    this.prefillRate.observe(tokens, ms);
  }

  /** The request's prefill worker is lost: out of its group and not merely draining (which keeps its handoffs). */
  private prefillGone(flight: Flight): boolean {
    return !this.prefillWorkers.has(flight.prefillId!) && (flight.prefillEngine?.lost ?? true);
  }

  private lostOr(error: unknown, workerId: string, pool: WorkerGroup<RoutableEngine>, requestId: string): unknown {
    if (!pool.has(workerId)) return new WorkerLostError(workerId, `worker ${workerId} was lost while running request ${requestId}`);
    return error;
  }
}

/** How many decode workers a handed-off request may be sent on to when the one it was placed on leaves first. */
const MAX_DECODE_REDIRECTS = 3;

/** MigrationRecord.reason of a request sent back to be prefilled after its prefill worker was lost. */
export const PREFILL_WORKER_LOST = 'prefill-worker-lost';

/** The closing output of a request stopped between workers, where no worker had an output to send. */
function closingOutput(request: EngineRequest, nowMs: number, completionTokens = 0): EngineOutput {
  return {
    requestId: request.id, index: 0, newTokenIds: [], textDelta: '', finishReason: 'abort',
    usage: { promptTokens: request.promptTokenIds.length, completionTokens, cachedTokens: 0 },
    timestamps: { arrival: request.arrivalMs, prefillChunks: [], finished: nowMs },
    ...(request.traceparent !== undefined ? { traceparent: request.traceparent } : {}),
  };
}
