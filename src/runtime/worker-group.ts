// A group of interchangeable workers behind one router: what the routed engine holds once and the disaggregated
// engine twice (its prefill and its decode workers). The group registers each worker with the router (its load,
// its KV events), drops a lost worker from the router, counts the requests each worker took over from a lost one,
// sums stats, closes, places a request again after its worker was lost (the migration branch both engines share),
// and restarts lost workers.
//
// Restarts: a lost worker (its thread died) is replaced by a new one, started by the pool's factory after a backoff
// (`baseDelayMs`, doubled per consecutive attempt up to `maxDelayMs`), at most `limit` attempts in a row; an attempt
// that fails to start counts like one that dies. A worker that stays up `stableMs` earns its slot a fresh count.
// A restarted worker is a new worker with a new id (`worker-0` comes back as `worker-0-r1`): an empty KV cache the
// router learns from scratch, and a request still failing on the old one is told apart from one on the new.
// Every step is logged. `readiness()` says whether any worker can serve, and why not (for /health).

import type { Engine, EngineInfo, LoraLoadInfo, RoutingSummary } from '../engine/types.ts';
import { EngineUnavailableError, LoraLoadError } from '../engine/errors.ts';
import type { KvEvent } from '../protocols/kv-events.ts';
import { workerLoadFromStats, type EngineStats, type WorkerCostSummary } from '../protocols/worker.ts';
import type { RoutingDecision, WorkerCostTerms } from '../router/protocols.ts';
import type { Router } from '../router/router.ts';
import { sumEngineStats } from './engine-stats.ts';
import type { RequestMigration } from './migration.ts';
import { RouterAdmission } from './router-admission.ts';

/**
 * A worker as the routed engines need it: any Engine, plus KV events, loss notices and stats reports between its
 * outputs when it has them.
 */
export interface RoutableEngine extends Engine {
  /**
   * True once the worker is gone for good. A worker process that drains leaves its group (no new requests) but is
   * not lost: it finishes what it holds. Without this, a worker out of its group counts as lost.
   */
  readonly lost?: boolean;
  onKvEvents?(listener: (events: KvEvent[]) => void): () => void;
  onLost?(listener: (error: Error) => void): () => void;
  /** Each stats report the worker sends, in order (a worker process: those on its request-plane connection). */
  onStats?(listener: (stats: EngineStats) => void): () => void;
  /**
   * True while stats() returns the last report passed to the onStats listeners (or, before the first report, what it
   * returned when they subscribed): a listener then knows all that stats() could tell. A worker thread always; a
   * worker process unless a load snapshot from the event plane, which is not a report, replaced its latest one
   * (RemoteEngine.deliverStats). Absent: stats() may change without a report (a simulated worker has no reports).
   */
  readonly statsReported?: boolean;
}

/** Whether an engine can serve now; `reason` says why not (what /health answers with its 503). */
export interface EngineReadiness {
  ready: boolean;
  reason?: string;
  /** Workers that can take requests, and how many the engine was started with. */
  workersAlive: number;
  workersTotal: number;
}

/** Restart attempts in a row per worker before it is given up, by default (cf. a supervisor's bounded retries). */
export const DEFAULT_WORKER_RESTART_LIMIT = 3;

export interface WorkerRestartOptions<E> {
  /** Attempts in a row per worker (0: a lost worker stays lost). */
  limit: number;
  /** Starts the worker that replaces a lost one; `id` is the new worker's. */
  start(id: string): Promise<E>;
  /** Wait before the first attempt, ms (default 500), doubled per further attempt up to maxDelayMs (default 30 s). */
  baseDelayMs?: number;
  maxDelayMs?: number;
  /** A worker up this long resets its slot's attempt count (default 60 s). */
  stableMs?: number;
}

export type WorkerGroupLogLevel = 'debug' | 'info' | 'warn' | 'error';
export type WorkerGroupLog = (level: WorkerGroupLogLevel, message: string) => void;

/**
 * Why a group without `restart` leaves a lost worker lost, and how loud to say so: the line names the reason the
 * deployment has, not one that would send its reader to an option that is already set.
 */
export interface NotRestarted {
  reason: string;
  level: WorkerGroupLogLevel;
  /** A lost worker may come back by itself (a frontend's workers register again): a refusal meanwhile is not final. */
  rejoins?: boolean;
}

/** Restarts turned off (a restart limit of 0): an error, since the deployment could have had them. */
export const RESTARTS_OFF: NotRestarted = { reason: 'restarts are off', level: 'error' };

export interface WorkerGroupOptions<E> {
  router: Router;
  /** Engine clock, ms. */
  now: () => number;
  /** What the workers are called in messages ("worker", "decode worker"). */
  label?: string;
  restart?: WorkerRestartOptions<E>;
  /** Without `restart`: why a lost worker is not replaced (default RESTARTS_OFF). */
  notRestarted?: NotRestarted;
  log?: WorkerGroupLog;
  /** Called when a worker joins (at the start or restarted); returns what to undo when it leaves. */
  onJoin?(id: string, engine: E): (() => void)[];
  /** Called when a worker is lost, after the router dropped it. */
  onLeave?(id: string): void;
}

/** One place a worker stands in: its current worker, and its restarts. */
interface Slot {
  readonly name: string;
  workerId: string | undefined;
  attempts: number;
  joinedAt: number;
  timer: NodeJS.Timeout | undefined;
  givenUp: boolean;
}

export class WorkerGroup<E extends RoutableEngine> {
  readonly router: Router;
  /** The router's admission queue for requests of this group that wait for a free worker. */
  readonly admission: RouterAdmission;
  readonly label: string;
  private readonly workers = new Map<string, E>();
  /** Slot of each worker id, current or past. */
  private readonly slotOf = new Map<string, Slot>();
  private readonly slots: Slot[] = [];
  private readonly leave = new Map<string, (() => void)[]>();
  /** Requests each worker took over from a lost worker. */
  private readonly migrationsTo = new Map<string, number>();
  private readonly now: () => number;
  private closed = false;
  /**
   * LoRA adapters loaded on every worker: name -> path, and the digest of the bytes the workers read when that is
   * known (a restarted worker loads them too, and must read the same bytes).
   */
  private readonly loras = new Map<string, { path: string; digest?: string }>();

  constructor(private readonly options: WorkerGroupOptions<E>) {
    this.router = options.router;
    this.now = options.now;
    this.label = options.label ?? 'worker';
    this.admission = new RouterAdmission(this.router, this.now, this.label);
  }

  /**
   * Adds a worker: one the group starts with, or one that joins later (a worker process a frontend found). A worker
   * that joins again under the id of a worker the group lost (its connection dropped and came back) takes that
   * worker's empty slot, so that readiness counts it once however often it rejoins.
   */
  add(id: string, engine: E): void {
    const lost = this.slotOf.get(id);
    if (lost && lost.workerId === undefined) {
      clearTimeout(lost.timer);
      lost.timer = undefined;
      lost.givenUp = false;
      this.join(lost, id, engine);
      return;
    }
    const slot: Slot = { name: id, workerId: undefined, attempts: 0, joinedAt: 0, timer: undefined, givenUp: false };
    this.slots.push(slot);
    this.join(slot, id, engine);
  }

  /**
   * A worker left for good (its process deregistered): it leaves the router if it is still there, and its slot
   * goes, so that readiness no longer counts it. A worker that comes back under the same id later is a new one.
   */
  remove(id: string): void {
    const slot = this.slotOf.get(id);
    if (!slot) return;
    if (slot.workerId !== undefined) this.detach(slot.workerId);
    clearTimeout(slot.timer);
    this.slots.splice(this.slots.indexOf(slot), 1);
    for (const [workerId, s] of [...this.slotOf]) if (s === slot) this.slotOf.delete(workerId);
  }

  get size(): number {
    return this.workers.size;
  }

  get ids(): string[] {
    return [...this.workers.keys()];
  }

  get(id: string): E | undefined {
    return this.workers.get(id);
  }

  has(id: string): boolean {
    return this.workers.has(id);
  }

  entries(): [string, E][] {
    return [...this.workers];
  }

  /** The first worker the group has now (the only one of a one-worker group), if any. */
  first(): [string, E] | undefined {
    return this.workers.entries().next().value;
  }

  countMigration(workerId: string): void {
    this.migrationsTo.set(workerId, (this.migrationsTo.get(workerId) ?? 0) + 1);
  }

  get migrations(): number {
    return [...this.migrationsTo.values()].reduce((sum, n) => sum + n, 0);
  }

  /**
   * Loads a LoRA adapter onto every worker (and onto workers started later in place of lost ones). When any worker
   * refuses it, those that took it unload it again and the first refusal is thrown. Each worker reads the file
   * itself: workers that report what they read must have read the same bytes (the adapter's KV blocks are keyed by
   * one digest), or the load is refused as a changed file.
   */
  async loadLora(name: string, path: string): Promise<LoraLoadInfo> {
    const engines = [...this.workers.values()];
    if (engines.length === 0) throw new LoraLoadError('invalid_adapter', `no ${this.label} is up to load LoRA adapter '${name}'`);
    if (engines.some((engine) => !engine.loadLora)) throw new LoraLoadError('invalid_adapter', `these ${this.label}s run no LoRA adapters`);
    const results = await Promise.allSettled(engines.map((engine) => engine.loadLora!(name, path)));
    const refused = results.find((r): r is PromiseRejectedResult => r.status === 'rejected');
    const infos = refused ? [] : results.map((r) => (r as PromiseFulfilledResult<LoraLoadInfo>).value);
    const digests = new Set(infos.flatMap((info) => info.digest !== undefined ? [info.digest] : []));
    if (refused || digests.size > 1) {
      await Promise.allSettled(engines.map((engine, i) => results[i]!.status === 'fulfilled' ? engine.unloadLora!(name) : undefined));
      throw refused ? refused.reason : new LoraLoadError('invalid_adapter',
        `LoRA adapter '${name}': the file at ${path} changed while the ${this.label}s loaded it (they read different bytes); load it again`);
    }
    const [digest] = digests;
    this.loras.set(name, { path, ...(digest !== undefined ? { digest } : {}) });
    return infos[0]!;
  }

  /** Unloads a LoRA adapter from every worker. */
  async unloadLora(name: string): Promise<void> {
    this.loras.delete(name);
    const results = await Promise.allSettled([...this.workers.values()].map((engine) => engine.unloadLora?.(name)));
    const refused = results.find((r): r is PromiseRejectedResult => r.status === 'rejected'
      && !(r.reason instanceof LoraLoadError && r.reason.code === 'lora_not_loaded'));
    if (refused) throw refused.reason;
  }

  /** Every worker resets its prefix cache (see Engine.resetPrefixCache); true when all of them did. */
  async resetPrefixCache(): Promise<boolean> {
    const results = await Promise.all([...this.workers.values()].map((engine) => engine.resetPrefixCache()));
    return results.every(Boolean);
  }

  workerStats(): { workerId: string; stats: EngineStats; info: EngineInfo }[] {
    return [...this.workers].map(([workerId, engine]) => ({
      workerId, stats: { ...engine.stats(), requestMigrations: this.migrationsTo.get(workerId) ?? 0 }, info: engine.info,
    }));
  }

  readiness(): EngineReadiness {
    const total = this.slots.length;
    const alive = this.workers.size;
    if (alive > 0) return { ready: true, workersAlive: alive, workersTotal: total };
    const reason = this.closed ? `the ${this.label}s are closed` : `no ${this.label} can serve: ${this.whyNone()}`;
    return { ready: false, reason, workersAlive: 0, workersTotal: total };
  }

  /**
   * A request refused because no worker is in the group: the refusal says why (lost and restarting, given up, not
   * restarted), as /health does, and only a restart under way comes with a time to retry after: a client must not be
   * told to retry when no worker is coming back.
   */
  noWorkerError(retryAfterMs: number): EngineUnavailableError {
    const why = this.closed ? `the ${this.label}s are closed` : this.whyNone();
    const restarting = !this.closed && this.slots.some((s) => !s.givenUp);
    // Final: nothing brings a worker back (restarts gave up or are off). A group whose workers come back by themselves
    // (a frontend's, which register again) restarts nothing either, but a worker may yet join it.
    const final = this.closed || (!restarting && this.options.notRestarted?.rejoins !== true);
    return new EngineUnavailableError(`no ${this.label} is available (${why})`, restarting ? retryAfterMs : undefined, final);
  }

  /** Why no worker is in the group: none was, or every one was lost (and whether they are being restarted). */
  private whyNone(): string {
    const total = this.slots.length;
    if (total === 0) return 'none is left';
    const restarting = this.slots.filter((s) => !s.givenUp).length;
    // Without restarts (a frontend's worker processes, which come back by registering again; --worker-restart-limit
    // 0), nothing was tried that could have given up.
    const restarts = (this.options.restart?.limit ?? 0) > 0;
    return restarting > 0 ? `${this.lostCount(total)}, restarting`
      : !restarts ? `${this.lostCount(total)}, and this process does not restart ${this.label}s`
      : `${this.lostCount(total)}, and restarting ${total === 1 ? 'it' : 'them'} gave up`;
  }

  /**
   * Places the continuation of a request whose worker was lost (`lost`): the new worker, or null when the request
   * was aborted on the way (`aborted`; the caller ends the stream with migration.closingOutput). Throws `lost` when no worker
   * takes it (none left, or all busy past the queue bound): the loss is what the caller sees.
   */
  async placeAfterLoss(migration: RequestMigration, lost: Error, aborted = () => migration.aborted):
    Promise<{ decision: RoutingDecision; engine: E } | null> {
    const request = migration.request;
    const attempt = migration.attempt();
    let decision: RoutingDecision;
    try {
      ({ decision } = await this.admission.place({
        requestId: request.id, tokenIds: attempt.promptTokenIds, cacheSalt: request.cacheSalt, sessionId: request.sessionId, lora: request.lora,
        // Only a worker holding the adapter takes it over (see Router.setWorkerModels); none: the loss stands.
        ...(request.lora !== undefined ? { model: request.lora } : {}),
        // The prompt and output so far plus what is left to generate: what the request needed where it was accepted.
        contextTokens: attempt.promptTokenIds.length + attempt.sampling.maxTokens,
      }));
    } catch {
      if (aborted()) return null;
      throw lost;
    }
    migration.placed(decision.workerId);
    const engine = this.workers.get(decision.workerId);
    if (!engine || aborted()) {
      // The placement ends here: the router lets go of it.
      this.router.onFinished(request.id, this.now());
      this.admission.drain();
      if (!engine) throw lost;
      return null;
    }
    this.countMigration(decision.workerId);
    return { decision, engine };
  }

  /**
   * Reports the worker's latest load to the router (after each of its outputs) when its stats reports have not
   * already done so. A worker that left the group is the router's no more, yet its streams may still be flowing (a
   * draining worker finishes what it runs): their outputs report nothing, and the streams go on.
   */
  updateLoad(workerId: string, engine: E): void {
    if (this.workers.get(workerId) !== engine) return;
    // A member's onStats listener (join) gave the router each report as it came, before the outputs it rode with
    // reached their reader: when stats() holds nothing newer, reading it again per output would only set the same
    // load again, on the server's main thread, once per streamed token.
    if (engine.onStats && engine.statsReported === true) return;
    this.router.updateLoad(workerId, workerLoadFromStats(engine.stats()));
  }

  async close(): Promise<void> {
    this.closed = true;
    for (const slot of this.slots) clearTimeout(slot.timer);
    for (const offs of this.leave.values()) for (const off of offs) off();
    this.leave.clear();
    this.admission.close();
    await Promise.all([...this.workers.values()].map((engine) => engine.close()));
  }

  // -------------------------------------------------------------------------------------------------------------

  private join(slot: Slot, id: string, engine: E): void {
    slot.workerId = id;
    slot.joinedAt = performance.now();
    this.slotOf.set(id, slot);
    this.workers.set(id, engine);
    this.router.addWorker(id, workerLoadFromStats(engine.stats()));
    const offs = [...(this.options.onJoin?.(id, engine) ?? [])];
    const offEvents = engine.onKvEvents?.((events) => this.router.applyKvEvents(id, events));
    const offLost = engine.onLost?.((error) => this.lose(id, error));
    // Reports between this router's outputs carry the load other routers (frontends) put on the worker too.
    const offStats = engine.onStats?.((stats) => {
      if (this.workers.get(id) === engine) this.router.updateLoad(id, workerLoadFromStats(stats));
    });
    if (offEvents) offs.push(offEvents);
    if (offLost) offs.push(offLost);
    if (offStats) offs.push(offStats);
    this.leave.set(id, offs);
  }

  private lose(id: string, error: Error): void {
    if (this.closed || !this.detach(id)) return;
    const slot = this.slotOf.get(id)!;
    slot.workerId = undefined;
    const stable = this.options.restart?.stableMs ?? 60_000;
    if (performance.now() - slot.joinedAt >= stable) slot.attempts = 0;
    this.log('warn', `${this.label} ${id} was lost: ${error.message}`);
    this.scheduleRestart(slot);
  }

  /** Takes a worker out of the group and the router; false when it was not in it. */
  private detach(id: string): boolean {
    if (!this.workers.delete(id)) return false;
    for (const off of this.leave.get(id) ?? []) off();
    this.leave.delete(id);
    this.router.removeWorker(id);
    this.options.onLeave?.(id);
    return true;
  }

  private scheduleRestart(slot: Slot): void {
    const restart = this.options.restart;
    if (this.closed) return;
    if (!restart || slot.attempts >= restart.limit) {
      slot.givenUp = true;
      if (restart && restart.limit > 0) {
        this.log('error', `${this.label} ${slot.name}: giving up after ${slot.attempts} restart attempt${slot.attempts === 1 ? '' : 's'} in a row`);
      } else {
        const { reason, level } = restart ? RESTARTS_OFF : this.options.notRestarted ?? RESTARTS_OFF;
        this.log(level, `${this.label} ${slot.name} is not restarted (${reason})`);
      }
      return;
    }
    slot.attempts++;
    const delay = Math.min((restart.baseDelayMs ?? 500) * 2 ** (slot.attempts - 1), restart.maxDelayMs ?? 30_000);
    const id = `${slot.name}-r${this.restartCount(slot)}`;
    this.log('info', `${this.label} ${slot.name}: restart attempt ${slot.attempts} of ${restart.limit} in ${delay} ms (as ${id})`);
    slot.timer = setTimeout(() => {
      slot.timer = undefined;
      restart.start(id).then(async (engine) => {
        // The new worker gets the adapters the group has loaded before it takes requests; one that cannot load them
        // is closed (it would otherwise keep running, with its KV pool, beside the next attempt).
        try {
          for (const [name, { path, digest }] of this.loras) {
            const info = await engine.loadLora!(name, path);
            if (digest !== undefined && info.digest !== undefined && info.digest !== digest) {
              throw new LoraLoadError('invalid_adapter', `LoRA adapter '${name}': the file at ${path} changed since the other ` +
                `${this.label}s loaded it, so this one would serve other weights under its cached prefixes; unload the adapter and load it again`);
            }
          }
        } catch (error) {
          await engine.close().catch(() => {});
          throw error;
        }
        return engine;
      }).then((engine) => {
        if (this.closed) {
          void engine.close();
          return;
        }
        this.log('info', `${this.label} ${id} started in place of the lost one`);
        this.join(slot, id, engine);
      }, (error: unknown) => {
        this.log('warn', `${this.label} ${id} failed to start: ${error instanceof Error ? error.message : String(error)}`);
        this.scheduleRestart(slot);
      });
    }, delay);
  }

  /** How many workers this slot has had after its first: the suffix of the next one's id. */
  private restartCount(slot: Slot): number {
    let count = 0;
    for (const s of this.slotOf.values()) if (s === slot) count++;
    return count;
  }

  private lostCount(total: number): string {
    return total === 1 ? `its one ${this.label} was lost` : `all ${total} ${this.label}s were lost`;
  }

  private log(level: WorkerGroupLogLevel, message: string): void {
    this.options.log?.(level, message);
  }
}

/** The engine info of several workers as one engine's: the smallest context, the summed KV capacity. */
export function combinedInfo(base: EngineInfo, infos: readonly EngineInfo[]): EngineInfo {
  return {
    ...base,
    maxModelLen: Math.min(...infos.map((i) => i.maxModelLen)),
    kvCapacityTokens: infos.reduce((sum, i) => sum + i.kvCapacityTokens, 0),
  };
}

/** The stats of the groups' workers as one engine's, with their waiting requests and migrations. */
export function combinedStats(groups: readonly WorkerGroup<RoutableEngine>[]): EngineStats {
  const total = sumEngineStats(groups.flatMap((g) => g.entries().map(([, engine]) => engine.stats())));
  for (const group of groups) total.numWaiting += group.admission.size;
  total.requestMigrations = groups.reduce((sum, g) => sum + g.migrations, 0);
  return total;
}

/** Cost terms kept on a decision's trace: enough to see the runners-up without a 64-worker list on every request. */
export const MAX_TRACED_COSTS = 8;

/** The cheapest MAX_TRACED_COSTS workers' terms, cheapest first, the chosen worker always included. */
function tracedCosts(terms: readonly WorkerCostTerms[], chosen: string): WorkerCostSummary[] {
  const sorted = [...terms].sort((a, b) => a.cost - b.cost);
  const kept = sorted.slice(0, MAX_TRACED_COSTS);
  if (!kept.some((t) => t.workerId === chosen)) {
    const own = sorted.find((t) => t.workerId === chosen);
    if (own) kept[kept.length - 1] = own;
  }
  return kept.map((t) => ({
    workerId: t.workerId, overlapBlocks: t.overlapBlocks, prefillTokens: t.prefillTokens, decodeBlocks: t.decodeBlocks,
    cost: Math.round(t.cost * 1000) / 1000, busy: t.busy,
  }));
}

/** The router's decision as it travels on the request's outputs (trace and timings). */
export function summarizeDecision(decision: RoutingDecision, decidedAt: number, admissionQueuedAt?: number, routeStartedAt?: number): RoutingSummary {
  const { overhead } = decision;
  // After an admission wait the decision came at a re-offer: it began its measured overhead before decidedAt, but
  // not before the wait (on a simulated clock real microseconds do not pass).
  const startedAt = admissionQueuedAt !== undefined ? Math.max(admissionQueuedAt, decidedAt - overhead.totalUs / 1000) : routeStartedAt;
  return {
    workerId: decision.workerId, strategy: decision.strategy, overlapBlocks: decision.overlapBlocks,
    ...(decision.candidates !== undefined ? { candidates: decision.candidates } : {}),
    reason: decision.reason, decidedAt, ...(admissionQueuedAt !== undefined ? { admissionQueuedAt } : {}),
    ...(decision.costTerms.length > 0 ? { costs: tracedCosts(decision.costTerms, decision.workerId) } : {}),
    ...(startedAt !== undefined ? { startedAt } : {}),
    overheadUs: { hashing: overhead.hashingUs, lookup: overhead.lookupUs, selection: overhead.selectionUs, total: overhead.totalUs },
  };
}
