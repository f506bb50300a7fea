// One worker whose thread is restarted when it dies (unless restarts are off): what `conduit serve` runs when it runs a
// single CPU worker. Requests go to the worker there is now; while none is (lost, restarting, or given up) they are
// refused with EngineUnavailableError (503, with Retry-After only while a restart is under way) and readiness() says why. A request running on the worker when
// it dies fails with WorkerLostError (503 worker_lost), as on a routed engine's worker. The restarts are the worker
// group's.

import { WorkerLostError } from '../engine/errors.ts';
import type { Engine, EngineInfo, EngineOutput, EngineRequest, LoraLoadInfo } from '../engine/types.ts';
import type { EngineStats } from '../protocols/worker.ts';
import type { Router } from '../router/router.ts';
import {
  combinedStats, WorkerGroup, type EngineReadiness, type RoutableEngine, type WorkerGroupLog, type WorkerRestartOptions,
} from './worker-group.ts';

export class SupervisedEngine implements Engine {
  readonly info: EngineInfo;
  private readonly group: WorkerGroup<RoutableEngine>;
  /** The worker each request runs on (for abort). */
  private readonly placement = new Map<string, RoutableEngine>();

  /** `router`: a router of its own (the group keeps its one worker registered there). `restart` undefined: off. */
  constructor(id: string, engine: RoutableEngine, router: Router, now: () => number,
    restart: WorkerRestartOptions<RoutableEngine> | undefined, log?: WorkerGroupLog) {
    this.info = engine.info;
    this.group = new WorkerGroup({ router, now, ...(restart ? { restart } : {}), ...(log ? { log } : {}) });
    this.group.add(id, engine);
  }

  generate(request: EngineRequest): AsyncIterable<EngineOutput> {
    const supervised = this;
    return (async function* () {
      const current = supervised.group.first();
      // As the routed engine says it, with the reason /health gives.
      if (!current) throw supervised.group.noWorkerError(1000);
      const [workerId, engine] = current;
      supervised.placement.set(request.id, engine);
      try {
        yield* engine.generate(request);
      } catch (error) {
        // The worker died under the request (the group dropped it on its loss notice, which comes before the
        // request's failure): the thread's exit is no error of the request's, and the client may retry it.
        if (!supervised.group.has(workerId)) {
          throw new WorkerLostError(workerId, `worker ${workerId} was lost while running request ${request.id}`);
        }
        throw error;
      } finally {
        supervised.placement.delete(request.id);
      }
    })();
  }

  abort(requestId: string): void {
    this.placement.get(requestId)?.abort(requestId);
  }

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
    const stats = combinedStats([this.group]);
    delete stats.requestMigrations;
    return stats;
  }

  readiness(): EngineReadiness {
    return this.group.readiness();
  }

  /** The worker there is now: its id and engine (for drills that kill it); undefined while there is none. */
  get worker(): { id: string; engine: RoutableEngine } | undefined {
    const current = this.group.first();
    return current ? { id: current[0], engine: current[1] } : undefined;
  }

  async close(): Promise<void> {
    await this.group.close();
  }
}
