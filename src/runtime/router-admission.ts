// Sending side of the router's admission queue: a request the router queued (every worker busy) waits here on a
// promise until a later drainQueue routes it, it waits too long, it is aborted, or the engine closes. Shared by the
// routed and the disaggregated engines.

import { EngineOverloadedError } from '../engine/errors.ts';
import type { RoutingDecision, RoutingRequest } from '../router/protocols.ts';
import type { Router } from '../router/router.ts';

/** How often queued requests are re-offered to the router while any wait (they are also re-offered on finishes). */
const QUEUE_POLL_MS = 50;

interface Waiter {
  resolve(admitted: Admitted): void;
  reject(error: Error): void;
  queuedAt: number;
}

/** The router's decision, and when the request entered the admission queue if it had to wait there. */
export interface Admitted {
  decision: RoutingDecision;
  queuedAt?: number;
}

export class RouterAdmission {
  private readonly waiting = new Map<string, Waiter>();
  private pollTimer: NodeJS.Timeout | undefined;

  /** `workers` names them in errors ("worker", "decode worker"). */
  constructor(private readonly router: Router, private readonly now: () => number, private readonly workers = 'worker') {}

  get size(): number {
    return this.waiting.size;
  }

  /** Routes now, or waits in the router's admission queue, or fails with overload. */
  place(request: RoutingRequest): Promise<Admitted> {
    // Room that opened since the last drain (a prefill done, a lower load report) goes to the requests that waited
    // for it first: routed straight away, every newcomer would overtake them, and under a steady stream of arrivals
    // they would wait until they expire.
    this.drain();
    const now = this.now();
    const outcome = this.router.route(request, now);
    switch (outcome.kind) {
      case 'routed':
        return Promise.resolve({ decision: outcome.decision });
      case 'rejected':
        return Promise.reject(new EngineOverloadedError(
          outcome.reason === 'no-workers' ? `no ${this.workers} is available`
            : outcome.reason === 'no-model-workers' ? `no ${this.workers} holds ${request.model}`
            : outcome.reason === 'no-context-workers' ? `no ${this.workers} takes a prompt of ${request.tokenIds.length} tokens`
            : `every ${this.workers} is busy and the queue is full`,
          outcome.retryAfterMs));
      case 'queued':
        return new Promise<Admitted>((resolve, reject) => {
          this.waiting.set(request.requestId, { resolve, reject, queuedAt: now });
          this.pollTimer ??= setInterval(() => this.drain(), QUEUE_POLL_MS);
        });
    }
  }

  /** Offers queued requests to the router again; fails those that waited too long. */
  drain(): void {
    if (this.waiting.size === 0) return;
    const { routed, expired } = this.router.drainQueue(this.now());
    for (const { request, decision } of routed) {
      const waiter = this.take(request.requestId);
      waiter?.resolve({ decision, queuedAt: waiter.queuedAt });
    }
    for (const request of expired) {
      this.take(request.requestId)?.reject(new EngineOverloadedError(`the request waited too long for a free ${this.workers}`, 1000));
    }
    if (this.waiting.size === 0) this.stopPolling();
  }

  /** Takes a queued request out (aborted); false if it was not queued. */
  cancel(requestId: string): boolean {
    const waiter = this.waiting.get(requestId);
    if (!waiter || !this.router.cancelQueued(requestId)) return false;
    this.take(requestId);
    waiter.reject(new EngineOverloadedError(`request ${requestId} was aborted while queued`, 0));
    return true;
  }

  close(): void {
    this.stopPolling();
    for (const [id, waiter] of this.waiting) waiter.reject(new EngineOverloadedError(`engine closed while ${id} was queued`, 0));
    this.waiting.clear();
  }

  private take(requestId: string): Waiter | undefined {
    const waiter = this.waiting.get(requestId);
    this.waiting.delete(requestId);
    return waiter;
  }

  private stopPolling(): void {
    clearInterval(this.pollTimer);
    this.pollTimer = undefined;
  }
}
