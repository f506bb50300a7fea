// Many workers behind one `Engine`: the router decides where each request goes, this class sends it there and
// keeps the router's view current (load after each output, KV events as they stream in, finishes, lost workers).
// The gateway holds it exactly as it would hold one engine.

import { EngineOverloadedError, WorkerLostError } from '../engine/errors.ts';
import type { KvEvent } from '../engine/kv-cache/events.ts';
import type {
  Engine, EngineInfo, EngineOutput, EngineRequest, EngineStats, RoutingSummary,
} from '../engine/types.ts';
import { workerLoadFromStats, type RoutingDecision, type RoutingRequest } from '../router/protocols.ts';
import type { Router } from '../router/router.ts';

/** A worker as the routed engine needs it: any Engine, plus KV events and loss notices when it has them. */
export interface RoutableEngine extends Engine {
  onKvEvents?(listener: (events: KvEvent[]) => void): () => void;
  onLost?(listener: (error: Error) => void): () => void;
}

export interface RoutedWorker {
  id: string;
  engine: RoutableEngine;
}

/** How often queued requests are re-offered to the router while any wait (they are also re-offered on finishes). */
const QUEUE_POLL_MS = 50;

interface Waiter {
  resolve(decision: RoutingDecision): void;
  reject(error: Error): void;
}

export class RoutedEngine implements Engine {
  readonly info: EngineInfo;
  private readonly workers = new Map<string, RoutableEngine>();
  /** Which worker runs each routed request (for abort). */
  private readonly placement = new Map<string, string>();
  private readonly waiting = new Map<string, Waiter>();
  private readonly unsubscribe: (() => void)[] = [];
  private pollTimer: NodeJS.Timeout | undefined;

  constructor(workers: readonly RoutedWorker[], private readonly router: Router, private readonly now: () => number) {
    if (workers.length === 0) throw new Error('a routed engine needs at least one worker');
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
      requestId: request.id, tokenIds: request.promptTokenIds, cacheSalt: request.cacheSalt,
    };
    const routed = this;
    return (async function* () {
      const decision = await routed.place(routingRequest);
      const workerId = decision.workerId;
      const engine = routed.workers.get(workerId);
      if (!engine) throw new WorkerLostError(workerId, `worker ${workerId} left before the request could start`);
      const summary = summarize(decision, routed.now());
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
        routed.drain();
      }
    })();
  }

  abort(requestId: string): void {
    const waiter = this.waiting.get(requestId);
    if (waiter && this.router.cancelQueued(requestId)) {
      this.waiting.delete(requestId);
      waiter.reject(new EngineOverloadedError(`request ${requestId} was aborted while queued`, 0));
      return;
    }
    const workerId = this.placement.get(requestId);
    if (workerId) this.workers.get(workerId)?.abort(requestId);
  }

  stats(): EngineStats {
    const total: EngineStats = {
      numRunning: 0, numWaiting: 0, kvBlocksUsed: 0, kvBlocksTotal: 0, prefixCacheQueries: 0, prefixCacheHits: 0,
      preemptions: 0,
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
    }
    total.numWaiting += this.waiting.size;
    return total;
  }

  /** Per-worker stats, for /health and the metrics' worker label. */
  workerStats(): { workerId: string; stats: EngineStats; info: EngineInfo }[] {
    return [...this.workers].map(([workerId, engine]) => ({ workerId, stats: engine.stats(), info: engine.info }));
  }

  async close(): Promise<void> {
    clearInterval(this.pollTimer);
    for (const off of this.unsubscribe) off();
    for (const [id, waiter] of this.waiting) waiter.reject(new EngineOverloadedError(`engine closed while ${id} was queued`, 0));
    this.waiting.clear();
    await Promise.all([...this.workers.values()].map((engine) => engine.close()));
  }

  // -------------------------------------------------------------------------------------------------------------

  /** Routes now, or waits in the router's admission queue, or fails with overload. */
  private place(request: RoutingRequest): Promise<RoutingDecision> {
    const outcome = this.router.route(request, this.now());
    switch (outcome.kind) {
      case 'routed':
        return Promise.resolve(outcome.decision);
      case 'rejected':
        return Promise.reject(new EngineOverloadedError(
          outcome.reason === 'no-workers' ? 'no worker is available' : 'every worker is busy and the queue is full',
          outcome.retryAfterMs));
      case 'queued':
        return new Promise<RoutingDecision>((resolve, reject) => {
          this.waiting.set(request.requestId, { resolve, reject });
          this.pollTimer ??= setInterval(() => this.drain(), QUEUE_POLL_MS);
        });
    }
  }

  /** Offers queued requests to the router again; fails those that waited too long. */
  private drain(): void {
    if (this.waiting.size === 0) return;
    const { routed, expired } = this.router.drainQueue(this.now());
    for (const { request, decision } of routed) {
      const waiter = this.waiting.get(request.requestId);
      this.waiting.delete(request.requestId);
      waiter?.resolve(decision);
    }
    for (const request of expired) {
      const waiter = this.waiting.get(request.requestId);
      this.waiting.delete(request.requestId);
      waiter?.reject(new EngineOverloadedError('the request waited too long for a free worker', 1000));
    }
    if (this.waiting.size === 0) {
      clearInterval(this.pollTimer);
      this.pollTimer = undefined;
    }
  }

  private dropWorker(workerId: string): void {
    if (!this.workers.delete(workerId)) return;
    this.router.removeWorker(workerId);
  }
}

function summarize(decision: RoutingDecision, decidedAt: number): RoutingSummary {
  const { overhead } = decision;
  return {
    workerId: decision.workerId, strategy: decision.strategy, overlapBlocks: decision.overlapBlocks,
    reason: decision.reason, decidedAt,
    overheadUs: { hashing: overhead.hashingUs, lookup: overhead.lookupUs, selection: overhead.selectionUs, total: overhead.totalUs },
  };
}
