// Per-tenant admission: a token bucket for requests per minute, one for tokens per minute, and a cap on requests in
// flight. A request reserves prompt + n * max_tokens tokens when admitted (the most it can use) and gives back what
// it did not use when it ends, so short answers do not eat a tenant's budget. Pure: time comes from the clock
// passed in, so tests step it exactly.

import type { Tenant } from './auth.ts';
import {
  ConcurrencyLimitError, formatDuration, RateLimitError, RequestExceedsConcurrencyError, RequestExceedsTokenLimitError,
} from './errors.ts';

export type Clock = () => number;

const MS_PER_MINUTE = 60_000;

/** A bucket that holds up to a minute's allowance and refills continuously at limit per minute. */
export class TokenBucket {
  private level: number;
  private updatedMs: number;

  constructor(readonly capacity: number, nowMs: number) {
    this.level = capacity;
    this.updatedMs = nowMs;
  }

  private refill(nowMs: number): void {
    const elapsed = Math.max(0, nowMs - this.updatedMs);
    this.level = Math.min(this.capacity, this.level + (elapsed * this.capacity) / MS_PER_MINUTE);
    this.updatedMs = Math.max(this.updatedMs, nowMs);
  }

  available(nowMs: number): number {
    this.refill(nowMs);
    return this.level;
  }

  tryTake(amount: number, nowMs: number): boolean {
    this.refill(nowMs);
    if (this.level < amount) return false;
    this.level -= amount;
    return true;
  }

  giveBack(amount: number, nowMs: number): void {
    this.refill(nowMs);
    this.level = Math.min(this.capacity, this.level + amount);
  }

  /** Time until `amount` is available (0 if it is now). */
  msUntil(amount: number, nowMs: number): number {
    this.refill(nowMs);
    const missing = amount - this.level;
    return missing <= 0 ? 0 : (missing * MS_PER_MINUTE) / this.capacity;
  }
}

interface TenantState {
  requests?: TokenBucket;
  tokens?: TokenBucket;
  inFlight: number;
}

/** What one admitted request holds; settle it exactly once when the request ends, however it ends. */
export class Admission {
  private settled = false;

  constructor(
    private readonly limiter: TenantRateLimiter,
    readonly tenant: Tenant,
    readonly reservedTokens: number,
    /** Sequences (prompts x n) the request runs: what it holds of the tenant's concurrency cap. */
    readonly sequences: number,
  ) {}

  /**
   * Frees the concurrency slot and returns the reserved tokens that were not used. `refundRequest` also returns
   * the request itself (for requests that never reached the engine).
   */
  settle(usedTokens: number, options: { refundRequest?: boolean } = {}): void {
    if (this.settled) return;
    this.settled = true;
    this.limiter.release(this, Math.max(0, this.reservedTokens - usedTokens), options.refundRequest ?? false);
  }
}

/** Every header TenantRateLimiter.headers may send: per limit (requests, tokens), its limit, what remains, its reset. */
export const RATE_LIMIT_HEADER_NAMES: readonly string[] = (['requests', 'tokens'] as const)
  .flatMap((suffix) => [`x-ratelimit-limit-${suffix}`, `x-ratelimit-remaining-${suffix}`, `x-ratelimit-reset-${suffix}`]);

export class TenantRateLimiter {
  private readonly states = new Map<string, TenantState>();

  constructor(private readonly clock: Clock) {}

  private state(tenant: Tenant): TenantState {
    let state = this.states.get(tenant.name);
    if (!state) {
      const now = this.clock();
      const { requestsPerMinute, tokensPerMinute } = tenant.limits;
      state = {
        ...(requestsPerMinute ? { requests: new TokenBucket(requestsPerMinute, now) } : {}),
        ...(tokensPerMinute ? { tokens: new TokenBucket(tokensPerMinute, now) } : {}),
        inFlight: 0,
      };
      this.states.set(tenant.name, state);
    }
    return state;
  }

  /** A cheap check before the body is read: rejects when the tenant has no request left right now. Takes nothing. */
  precheck(tenant: Tenant): void {
    const state = this.state(tenant);
    const now = this.clock();
    if (state.requests && state.requests.available(now) < 1) {
      throw new RateLimitError('requests', tenant.name, state.requests.capacity, state.requests.msUntil(1, now));
    }
  }

  /**
   * Takes `sequences` of the tenant's concurrency cap, one request and `reservedTokens` tokens, all or nothing. The
   * cap counts sequences (prompts x n), as the server's own pending bound does: counted in requests, a tenant capped at
   * 2 could hold the whole server with two requests of n = 128.
   */
  admit(tenant: Tenant, reservedTokens: number, sequences = 1, request: { maxTokensUnset?: boolean } = {}): Admission {
    const state = this.state(tenant);
    const now = this.clock();
    const { maxConcurrent } = tenant.limits;
    if (state.tokens && reservedTokens > state.tokens.capacity) {
      throw new RequestExceedsTokenLimitError(tenant.name, reservedTokens, state.tokens.capacity, request.maxTokensUnset ?? false);
    }
    if (maxConcurrent !== undefined && sequences > maxConcurrent) {
      throw new RequestExceedsConcurrencyError(tenant.name, sequences, maxConcurrent);
    }
    if (maxConcurrent !== undefined && state.inFlight + sequences > maxConcurrent) {
      throw new ConcurrencyLimitError(tenant.name, maxConcurrent, state.inFlight);
    }
    if (state.requests && state.requests.available(now) < 1) {
      throw new RateLimitError('requests', tenant.name, state.requests.capacity, state.requests.msUntil(1, now));
    }
    if (state.tokens && state.tokens.available(now) < reservedTokens) {
      throw new RateLimitError('tokens', tenant.name, state.tokens.capacity, state.tokens.msUntil(reservedTokens, now));
    }
    state.requests?.tryTake(1, now);
    state.tokens?.tryTake(reservedTokens, now);
    state.inFlight += sequences;
    return new Admission(this, tenant, reservedTokens, sequences);
  }

  /** Called by Admission.settle. */
  release(admission: Admission, unusedTokens: number, refundRequest: boolean): void {
    const state = this.state(admission.tenant);
    const now = this.clock();
    state.inFlight = Math.max(0, state.inFlight - admission.sequences);
    if (unusedTokens > 0) state.tokens?.giveBack(unusedTokens, now);
    if (refundRequest) state.requests?.giveBack(1, now);
  }

  inFlight(tenant: Tenant): number {
    return this.states.get(tenant.name)?.inFlight ?? 0;
  }

  /** Remaining allowance right now (Infinity where the tenant has no limit). */
  remaining(tenant: Tenant): { requests: number; tokens: number } {
    const state = this.state(tenant);
    const now = this.clock();
    return {
      requests: state.requests ? Math.floor(state.requests.available(now)) : Infinity,
      tokens: state.tokens ? Math.floor(state.tokens.available(now)) : Infinity,
    };
  }

  /** OpenAI's x-ratelimit-* headers for the limits the tenant has (names among RATE_LIMIT_HEADER_NAMES). */
  headers(tenant: Tenant): Record<string, string> {
    const state = this.state(tenant);
    const now = this.clock();
    const headers: Record<string, string> = {};
    const describe = (suffix: 'requests' | 'tokens', bucket: TokenBucket | undefined): void => {
      if (!bucket) return;
      headers[`x-ratelimit-limit-${suffix}`] = String(bucket.capacity);
      headers[`x-ratelimit-remaining-${suffix}`] = String(Math.floor(bucket.available(now)));
      headers[`x-ratelimit-reset-${suffix}`] = formatDuration(bucket.msUntil(bucket.capacity, now));
    };
    describe('requests', state.requests);
    describe('tokens', state.tokens);
    return headers;
  }
}
