// Many workers behind one `Engine`: the router decides where each request goes, this class sends it there and
// keeps the router's view current (load from each stats report a worker sends, and after each output when stats() may
// hold more than those reports; KV events as they stream in, finishes, lost workers).
// A request whose worker is lost mid-stream moves to another worker when migration is on (see migration.ts).
// The gateway holds it exactly as it would hold one engine.

import { EngineOverloadedError, type EngineUnavailableError, WorkerLostError } from '../engine/errors.ts';
import type { Engine, EngineInfo, EngineOutput, EngineRequest, LoraLoadInfo } from '../engine/types.ts';
import type { EngineStats } from '../protocols/worker.ts';
import type { RoutingRequest } from '../router/protocols.ts';
import type { Router } from '../router/router.ts';
import {
  checkMigrationLimit, DEFAULT_MIGRATION_LIMIT, RequestMigration, type MigrationOptions,
} from './migration.ts';
import type { Admitted } from './router-admission.ts';
import {
  combinedInfo, combinedStats, summarizeDecision, WorkerGroup, type EngineReadiness, type RoutableEngine,
  type NotRestarted, type WorkerGroupLog, type WorkerRestartOptions,
} from './worker-group.ts';

export interface RoutedWorker {
  id: string;
  engine: RoutableEngine;
}

export interface RoutedEngineOptions {
  /** How often a request may move on when its worker is lost (default: never). */
  migration?: MigrationOptions;
  /** Lost workers are replaced (see worker-group.ts); default: not. */
  restart?: WorkerRestartOptions<RoutableEngine>;
  /** Without `restart`: why a lost worker is not replaced (worker-group.ts; default: restarts are off). */
  notRestarted?: NotRestarted;
  log?: WorkerGroupLog;
}

export class RoutedEngine implements Engine {
  /** The first worker's info: what the workers share (model, block size, backend). */
  private readonly baseInfo: EngineInfo;
  /** The workers' info as one engine's (combinedInfo), recomputed whenever a worker joins or leaves. */
  private combined: EngineInfo;
  private readonly group: WorkerGroup<RoutableEngine>;
  /**
   * The worker running each routed request, for abort: its engine itself, since a draining worker has left the
   * group (and a worker that rejoined under its id is another engine) while it finishes what it runs.
   */
  private readonly placement = new Map<string, RoutableEngine | undefined>();
  /** Requests between generate() and their last output, for abort to reach one between two workers. */
  private readonly inFlight = new Map<string, RequestMigration>();
  private readonly migration: MigrationOptions;

  constructor(workers: readonly RoutedWorker[], private readonly router: Router, private readonly now: () => number,
    options: RoutedEngineOptions = {}) {
    const migration = options.migration ?? { limit: DEFAULT_MIGRATION_LIMIT };
    this.migration = { ...migration, limit: checkMigrationLimit(migration.limit) };
    if (workers.length === 0) throw new Error('a routed engine needs at least one worker');
    this.baseInfo = workers[0]!.engine.info;
    this.combined = combinedInfo(this.baseInfo, workers.map((w) => w.engine.info));
    this.group = new WorkerGroup({
      router, now, ...(options.restart ? { restart: options.restart } : {}), ...(options.log ? { log: options.log } : {}),
      ...(options.notRestarted ? { notRestarted: options.notRestarted } : {}),
      onJoin: (id, engine) => {
        // The router sends the worker only requests its context holds (RoutingRequest.contextTokens).
        router.setWorkerMaxTokens(id, engine.info.maxModelLen);
        this.recombine();
        return [];
      },
      onLeave: () => this.recombine(),
    });
    for (const { id, engine } of workers) this.group.add(id, engine);
  }

  /**
   * The workers' info as one engine's: the smallest context any worker in the group takes (so that every request
   * the gateway accepts against it fits every worker) and their summed KV capacity. It follows the group: a worker
   * with a shorter context that joins lowers maxModelLen from then on, and it rises again when that worker leaves.
   * Requests accepted before a change are routed only to workers that hold them (Router.setWorkerMaxTokens). With
   * no worker in the group, the last value stands.
   */
  get info(): EngineInfo {
    return this.combined;
  }

  private recombine(): void {
    const infos = this.group.entries().map(([, engine]) => engine.info);
    if (infos.length > 0) this.combined = combinedInfo(this.baseInfo, infos);
  }

  get workerIds(): string[] {
    return this.group.ids;
  }

  /**
   * A worker that joins after the start (a worker process found by discovery): registered with the router and
   * routed to from now on. It leaves as any worker does, through its onLost.
   */
  addWorker(id: string, engine: RoutableEngine): void {
    this.group.add(id, engine);
  }

  /** A worker that left for good (its key went): no longer counted by readiness (see WorkerGroup.remove). */
  removeWorker(id: string): void {
    this.group.remove(id);
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

  /** The refusal of a request while no worker is in the group (a frontend's says where it looks for workers). */
  protected noWorkerError(retryAfterMs: number): EngineUnavailableError {
    return this.group.noWorkerError(retryAfterMs);
  }

  /** Runs the request on the worker the router picks and, when that worker is lost, on the next one. */
  private async *follow(migration: RequestMigration): AsyncGenerator<EngineOutput> {
    const request = migration.request;
    const routingRequest = routingRequestOf(request);
    let routeStartedAt: number | undefined = this.now();
    let placed: Admitted;
    try {
      placed = await this.group.admission.place(routingRequest);
    } catch (error) {
      // Aborted while it waited in the admission queue (client gone, timeout, drain): an abort, as on a worker, so
      // the caller reports its own reason rather than the queue's refusal.
      if (!migration.aborted) {
        // Refused because no worker is left: the refusal says why (restarting, given up), as /health does.
        if (error instanceof EngineOverloadedError && this.group.size === 0) throw this.noWorkerError(error.retryAfterMs);
        throw error;
      }
      yield migration.closingOutput(this.now());
      return;
    }
    let { decision, queuedAt } = placed;
    let engine = this.group.get(decision.workerId);
    for (;;) {
      const workerId = decision.workerId;
      const summary = migration.summarize(summarizeDecision(decision, this.now(), queuedAt, routeStartedAt));
      this.placement.set(request.id, engine);
      let first = true;
      let lost: WorkerLostError;
      try {
        if (!engine) throw new WorkerLostError(workerId, `worker ${workerId} left before the request could start`);
        if (migration.aborted) {
          yield migration.closingOutput(this.now());
          return;
        }
        for await (const output of engine.generate(migration.attempt())) {
          if (first) {
            this.router.onPrefillDone(request.id);
            first = false;
          }
          this.group.updateLoad(workerId, engine);
          const adapted = migration.adapt({ ...output, routing: summary });
          yield adapted.output;
          // A stop string matched on this side after a migration: leaving the loop aborts the worker's request.
          if (adapted.stopped) return;
        }
        return;
      } catch (error) {
        const failure = this.group.has(workerId) || !engine ? error
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
        this.group.admission.drain();
      }
      queuedAt = undefined;  // a move after a loss is a migration, not an admission wait
      routeStartedAt = undefined;
      const next = await this.group.placeAfterLoss(migration, lost);
      if (next === null) {
        yield migration.closingOutput(this.now());
        return;
      }
      ({ decision, engine } = next);
    }
  }

  abort(requestId: string): void {
    const migration = this.inFlight.get(requestId);
    if (migration) migration.aborted = true;
    if (this.group.admission.cancel(requestId)) return;
    this.placement.get(requestId)?.abort(requestId);
  }

  /** Every worker resets its prefix cache; the router's index hears each worker's 'cleared' event. */
  resetPrefixCache(): Promise<boolean> {
    return this.group.resetPrefixCache();
  }

  /** Loads a LoRA adapter onto every worker (see WorkerGroup.loadLora). */
  loadLora(name: string, path: string): Promise<LoraLoadInfo> {
    return this.group.loadLora(name, path);
  }

  unloadLora(name: string): Promise<void> {
    return this.group.unloadLora(name);
  }

  stats(): EngineStats {
    return combinedStats([this.group]);
  }

  /** Whether any worker can serve, for /health. */
  readiness(): EngineReadiness {
    return this.group.readiness();
  }

  /** One worker's engine (for drills that kill it); undefined once it left. */
  workerEngine(workerId: string): RoutableEngine | undefined {
    return this.group.get(workerId);
  }

  /** Per-worker stats, for /health and the metrics' worker label. */
  workerStats(): { workerId: string; stats: EngineStats; info: EngineInfo }[] {
    return this.group.workerStats();
  }

  async close(): Promise<void> {
    await this.group.close();
  }
}

/** What the router weighs of a request. */
export function routingRequestOf(request: EngineRequest): RoutingRequest {
  return {
    requestId: request.id, tokenIds: request.promptTokenIds, cacheSalt: request.cacheSalt, sessionId: request.sessionId, lora: request.lora,
    // Only workers holding the adapter take it (those that declared what they hold; see Router.setWorkerModels).
    ...(request.lora !== undefined ? { model: request.lora } : {}),
    // Only workers whose context holds the prompt and max_tokens take it (see Router.setWorkerMaxTokens).
    contextTokens: request.promptTokenIds.length + request.sampling.maxTokens,
    // Prompt logprobs need every position's logits: the worker reuses none of its cached blocks.
    ...(request.sampling.promptLogprobs !== undefined ? { computesWholePrompt: true } : {}),
  };
}
