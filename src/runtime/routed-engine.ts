// Many workers behind one `Engine`: the router decides where each request goes, this class sends it there and
// keeps the router's view current (load after each output, KV events as they stream in, finishes, lost workers).
// A request whose worker is lost mid-stream moves to another worker when migration is on (see migration.ts).
// The gateway holds it exactly as it would hold one engine.

import { WorkerLostError } from '../engine/errors.ts';
import type { KvEvent } from '../protocols/kv-events.ts';
import type { Engine, EngineInfo, EngineOutput, EngineRequest, RoutingSummary } from '../engine/types.ts';
import { workerLoadFromStats, type EngineStats } from '../protocols/worker.ts';
import type { RoutingDecision, RoutingRequest } from '../router/protocols.ts';
import type { Router } from '../router/router.ts';
import { sumEngineStats } from './engine-stats.ts';
import {
  checkMigrationLimit, DEFAULT_MIGRATION_LIMIT, RequestMigration, type MigrationOptions,
} from './migration.ts';
import { RouterAdmission } from './router-admission.ts';

/** A worker as the routed engine needs it: any Engine, plus KV events and loss notices when it has them. */
export interface RoutableEngine extends Engine {
  onKvEvents?(listener: (events: KvEvent[]) => void): () => void;
  onLost?(listener: (error: Error) => void): () => void;
}

export interface RoutedWorker {
  id: string;
  engine: RoutableEngine;
}

export class RoutedEngine implements Engine {
  readonly info: EngineInfo;
  private readonly workers = new Map<string, RoutableEngine>();
  /** Which worker runs each routed request (for abort). */
  private readonly placement = new Map<string, string>();
  private readonly admission: RouterAdmission;
  private readonly unsubscribe: (() => void)[] = [];
  /** Requests between generate() and their last output, for abort to reach one between two workers. */
  private readonly inFlight = new Map<string, RequestMigration>();
  /** Requests each worker took over from a lost worker. */
  private readonly migrationsTo = new Map<string, number>();
  private readonly migration: MigrationOptions;

  /** `migration`: how often a request may move on when its worker is lost (default: never). */
  constructor(workers: readonly RoutedWorker[], private readonly router: Router, private readonly now: () => number,
    migration: MigrationOptions = { limit: DEFAULT_MIGRATION_LIMIT }) {
    this.migration = { ...migration, limit: checkMigrationLimit(migration.limit) };
    if (workers.length === 0) throw new Error('a routed engine needs at least one worker');
    this.admission = new RouterAdmission(router, now);
    for (const { id, engine } of workers) {
      this.workers.set(id, engine);
      router.addWorker(id, workerLoadFromStats(engine.stats()));
      const offEvents = engine.onKvEvents?.((events) => router.applyKvEvents(id, events));
      const offLost = engine.onLost?.(() => this.dropWorker(id));
      if (offEvents) this.unsubscribe.push(offEvents);
      if (offLost) this.unsubscribe.push(offLost);
    }
    const infos = workers.map((w) => w.engine.info);
    const first = infos[0]!;
    this.info = {
      ...first,
      maxModelLen: Math.min(...infos.map((i) => i.maxModelLen)),
      kvCapacityTokens: infos.reduce((sum, i) => sum + i.kvCapacityTokens, 0),
    };
  }

  get workerIds(): string[] {
    return [...this.workers.keys()];
  }

  generate(request: EngineRequest): AsyncIterable<EngineOutput> {
    const routed = this;
    return (async function* () {
      const migration = new RequestMigration(request, routed.migration);
      routed.inFlight.set(request.id, migration);
      try {
        yield* routed.follow(migration);
      } finally {
        routed.inFlight.delete(request.id);
      }
    })();
  }

  /** Runs the request on the worker the router picks and, when that worker is lost, on the next one. */
  private async *follow(migration: RequestMigration): AsyncGenerator<EngineOutput> {
    const request = migration.request;
    let lost: WorkerLostError | undefined;
    for (;;) {
      const attempt = migration.attempt();
      const routingRequest: RoutingRequest = {
        requestId: request.id, tokenIds: attempt.promptTokenIds, cacheSalt: request.cacheSalt, sessionId: request.sessionId,
      };
      let decision: RoutingDecision;
      try {
        decision = await this.admission.place(routingRequest);
      } catch (error) {
        if (lost === undefined) throw error;
        if (migration.aborted) {
          yield migration.closingOutput(this.now());
          return;
        }
        // No worker to take it (none left, or all busy past the queue bound): the loss is what the caller sees.
        throw lost;
      }
      const workerId = decision.workerId;
      const engine = this.workers.get(workerId);
      if (lost !== undefined) migration.placed(workerId);
      const summary = migration.summarize(summarizeDecision(decision, this.now()));
      this.placement.set(request.id, workerId);
      let first = true;
      try {
        if (!engine) throw new WorkerLostError(workerId, `worker ${workerId} left before the request could start`);
        if (migration.aborted) {
          yield migration.closingOutput(this.now());
          return;
        }
        if (lost !== undefined) this.migrationsTo.set(workerId, (this.migrationsTo.get(workerId) ?? 0) + 1);
        for await (const output of engine.generate(attempt)) {
          if (first) {
            this.router.onPrefillDone(request.id);
            first = false;
          }
          this.router.updateLoad(workerId, workerLoadFromStats(engine.stats()));
          const adapted = migration.adapt({ ...output, routing: summary });
          yield adapted.output;
          // A stop string matched on this side after a migration: leaving the loop aborts the worker's request.
          if (adapted.stopped) return;
        }
        return;
      } catch (error) {
        const failure = this.workers.has(workerId) || !engine ? error
          : new WorkerLostError(workerId, `worker ${workerId} was lost while running request ${request.id}`);
        if (migration.abortedWhenLost(failure)) {
          yield migration.closingOutput(this.now());
          return;
        }
        if (!migration.canMigrate(failure)) throw failure;
        lost = failure as WorkerLostError;
        migration.migrateFrom(workerId, 'worker-lost');
      } finally {
        this.placement.delete(request.id);
        this.router.onFinished(request.id, this.now());
        this.admission.drain();
      }
    }
  }

  abort(requestId: string): void {
    const migration = this.inFlight.get(requestId);
    if (migration) migration.aborted = true;
    if (this.admission.cancel(requestId)) return;
    const workerId = this.placement.get(requestId);
    if (workerId) this.workers.get(workerId)?.abort(requestId);
  }

  stats(): EngineStats {
    const total = sumEngineStats([...this.workers.values()].map((engine) => engine.stats()));
    total.requestMigrations = [...this.migrationsTo.values()].reduce((sum, n) => sum + n, 0);
    total.numWaiting += this.admission.size;
    return total;
  }

  /** One worker's engine (for drills that kill it); undefined once it left. */
  workerEngine(workerId: string): RoutableEngine | undefined {
    return this.workers.get(workerId);
  }

  /** Per-worker stats, for /health and the metrics' worker label. */
  workerStats(): { workerId: string; stats: EngineStats; info: EngineInfo }[] {
    return [...this.workers].map(([workerId, engine]) => ({
      workerId, stats: { ...engine.stats(), requestMigrations: this.migrationsTo.get(workerId) ?? 0 }, info: engine.info,
    }));
  }

  async close(): Promise<void> {
    for (const off of this.unsubscribe) off();
    this.admission.close();
    await Promise.all([...this.workers.values()].map((engine) => engine.close()));
  }

  // -------------------------------------------------------------------------------------------------------------

  private dropWorker(workerId: string): void {
    if (!this.workers.delete(workerId)) return;
    this.router.removeWorker(workerId);
  }
}

/** The router's decision as it travels on the request's outputs (trace and timings). */
export function summarizeDecision(decision: RoutingDecision, decidedAt: number): RoutingSummary {
  const { overhead } = decision;
  return {
    workerId: decision.workerId, strategy: decision.strategy, overlapBlocks: decision.overlapBlocks,
    reason: decision.reason, decidedAt,
    overheadUs: { hashing: overhead.hashingUs, lookup: overhead.lookupUs, selection: overhead.selectionUs, total: overhead.totalUs },
  };
}
