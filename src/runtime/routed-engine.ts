// Many workers behind one `Engine`: the router decides where each request goes, this class sends it there and
// keeps the router's view current (load after each output, KV events as they stream in, finishes, lost workers).
// The gateway holds it exactly as it would hold one engine.

import { WorkerLostError } from '../engine/errors.ts';
import type { KvEvent } from '../engine/kv-cache/events.ts';
import type {
  Engine, EngineInfo, EngineOutput, EngineRequest, EngineStats, RoutingSummary,
} from '../engine/types.ts';
import { workerLoadFromStats, type RoutingDecision, type RoutingRequest } from '../router/protocols.ts';
import type { Router } from '../router/router.ts';
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

  constructor(workers: readonly RoutedWorker[], private readonly router: Router, private readonly now: () => number) {
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
    const routingRequest: RoutingRequest = {
      requestId: request.id, tokenIds: request.promptTokenIds, cacheSalt: request.cacheSalt, sessionId: request.sessionId,
    };
    const routed = this;
    return (async function* () {
      const decision = await routed.admission.place(routingRequest);
      const workerId = decision.workerId;
      const engine = routed.workers.get(workerId);
      if (!engine) throw new WorkerLostError(workerId, `worker ${workerId} left before the request could start`);
      const summary = summarizeDecision(decision, routed.now());
      routed.placement.set(request.id, workerId);
      let first = true;
      try {
        for await (const output of engine.generate(request)) {
          if (first) {
            routed.router.onPrefillDone(request.id);
            first = false;
          }
          routed.router.updateLoad(workerId, workerLoadFromStats(engine.stats()));
          yield { ...output, routing: summary };
        }
      } catch (error) {
        if (!routed.workers.has(workerId)) {
          throw new WorkerLostError(workerId, `worker ${workerId} was lost while running request ${request.id}`);
        }
        throw error;
      } finally {
        routed.placement.delete(request.id);
        routed.router.onFinished(request.id, routed.now());
        routed.admission.drain();
      }
    })();
  }

  abort(requestId: string): void {
    if (this.admission.cancel(requestId)) return;
    const workerId = this.placement.get(requestId);
    if (workerId) this.workers.get(workerId)?.abort(requestId);
  }

  stats(): EngineStats {
    const total: EngineStats = {
      numRunning: 0, numWaiting: 0, kvBlocksUsed: 0, kvBlocksTotal: 0, prefixCacheQueries: 0, prefixCacheHits: 0,
      preemptions: 0, kvEvictions: 0,
    };
    for (const engine of this.workers.values()) {
      const s = engine.stats();
      total.numRunning += s.numRunning;
      total.numWaiting += s.numWaiting;
      total.kvBlocksUsed += s.kvBlocksUsed;
      total.kvBlocksTotal += s.kvBlocksTotal;
      total.prefixCacheQueries += s.prefixCacheQueries;
      total.prefixCacheHits += s.prefixCacheHits;
      total.preemptions += s.preemptions;
      total.kvEvictions! += s.kvEvictions ?? 0;
    }
    total.numWaiting += this.admission.size;
    return total;
  }

  /** Per-worker stats, for /health and the metrics' worker label. */
  workerStats(): { workerId: string; stats: EngineStats; info: EngineInfo }[] {
    return [...this.workers].map(([workerId, engine]) => ({ workerId, stats: engine.stats(), info: engine.info }));
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
