import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { Tenant } from '../../src/api/auth.ts';
import { ApiError } from '../../src/api/errors.ts';
import { TenantRateLimiter, TokenBucket } from '../../src/api/rate-limit.ts';

function tenant(name: string, limits: Tenant['limits']): Tenant {
  return { name, limits, cacheSalt: name };
}

/** A clock the test moves by hand. */
function manualClock(startMs = 1_000_000): { now: () => number; advance: (ms: number) => void } {
  let t = startMs;
  return { now: () => t, advance: (ms) => { t += ms; } };
}

function errorOf(fn: () => unknown): ApiError {
  try {
    fn();
  } catch (err) {
    assert.ok(err instanceof ApiError);
    return err;
  }
  assert.fail('expected an ApiError');
}

describe('TokenBucket', () => {
  it('refills at capacity per minute and never above capacity', () => {
    const bucket = new TokenBucket(60, 0);
    assert.equal(bucket.tryTake(60, 0), true);
    assert.equal(bucket.available(0), 0);
    assert.equal(bucket.available(1000), 1);
    assert.equal(bucket.available(30_000), 30);
    assert.equal(bucket.available(600_000), 60);
  });

  it('says how long until an amount is available', () => {
    const bucket = new TokenBucket(600, 0);
    bucket.tryTake(600, 0);
    assert.equal(bucket.msUntil(10, 0), 1000);
    assert.equal(bucket.msUntil(10, 500), 500);
    assert.equal(bucket.msUntil(10, 1000), 0);
  });
});

describe('TenantRateLimiter', () => {
  it('limits requests per minute and reports when to retry', () => {
    const clock = manualClock();
    const limiter = new TenantRateLimiter(clock.now);
    const acme = tenant('acme', { requestsPerMinute: 2 });
    limiter.admit(acme, 10).settle(10);
    limiter.admit(acme, 10).settle(10);
    const error = errorOf(() => limiter.admit(acme, 10));
    assert.equal(error.statusCode, 429);
    assert.equal(error.type, 'requests');
    assert.equal(error.headers['Retry-After'], '30');
    assert.equal(error.headers['retry-after-ms'], '30000');
    assert.throws(() => limiter.precheck(acme), /requests per minute/);
    clock.advance(30_000);
    limiter.precheck(acme);
    limiter.admit(acme, 10);
  });

  it('reserves prompt + max tokens and returns what was not used', () => {
    const clock = manualClock();
    const limiter = new TenantRateLimiter(clock.now);
    const acme = tenant('acme', { tokensPerMinute: 1000 });
    const first = limiter.admit(acme, 700);
    assert.equal(limiter.remaining(acme).tokens, 300);
    const refused = errorOf(() => limiter.admit(acme, 400));
    assert.equal(refused.type, 'tokens');
    assert.equal(refused.headers['retry-after-ms'], '6000', '100 missing tokens at 1000/min take 6 s');
    first.settle(250);
    assert.equal(limiter.remaining(acme).tokens, 750, 'the 450 unused tokens came back');
    first.settle(0);
    assert.equal(limiter.remaining(acme).tokens, 750, 'settling twice returns nothing more');
    limiter.admit(acme, 400);
  });

  it('refuses a request that could never fit the token limit, whatever the wait', () => {
    const limiter = new TenantRateLimiter(manualClock().now);
    const error = errorOf(() => limiter.admit(tenant('acme', { tokensPerMinute: 100 }), 101));
    assert.equal(error.statusCode, 429);
    assert.match(error.message, /reserves 101 tokens .* limit is 100/);
  });

  it('caps requests in flight and frees the slot on settle', () => {
    const limiter = new TenantRateLimiter(manualClock().now);
    const acme = tenant('acme', { maxConcurrent: 1 });
    const first = limiter.admit(acme, 1);
    assert.equal(errorOf(() => limiter.admit(acme, 1)).code, 'concurrency_limit_exceeded');
    first.settle(1);
    assert.equal(limiter.inFlight(acme), 0);
    limiter.admit(acme, 1);
  });

  it('counts sequences (prompts x n) against the cap: two requests of n = 128 cannot hold the server', () => {
    const limiter = new TenantRateLimiter(manualClock().now);
    const acme = tenant('acme', { maxConcurrent: 4 });
    const three = limiter.admit(acme, 1, 3);
    assert.equal(limiter.inFlight(acme), 3);
    const busy = errorOf(() => limiter.admit(acme, 1, 2));
    assert.equal(busy.code, 'concurrency_limit_exceeded');
    assert.equal(busy.headers['Retry-After'], '1', 'one finishing would make room');
    // More sequences than the cap: no wait helps, so no Retry-After.
    const never = errorOf(() => limiter.admit(acme, 1, 5));
    assert.equal(never.code, 'concurrency_limit_exceeded');
    assert.equal(never.headers['Retry-After'], undefined);
    assert.equal(limiter.inFlight(acme), 3, 'refusals take nothing');
    limiter.admit(acme, 1, 1);
    three.settle(1);
    assert.equal(limiter.inFlight(acme), 1);
  });

  it('takes nothing when a request is refused', () => {
    const limiter = new TenantRateLimiter(manualClock().now);
    const acme = tenant('acme', { requestsPerMinute: 5, tokensPerMinute: 100, maxConcurrent: 3 });
    limiter.admit(acme, 90);
    errorOf(() => limiter.admit(acme, 20));
    assert.deepEqual(limiter.remaining(acme), { requests: 4, tokens: 10 });
    assert.equal(limiter.inFlight(acme), 1);
  });

  it('can refund the request itself for a run the engine refused', () => {
    const limiter = new TenantRateLimiter(manualClock().now);
    const acme = tenant('acme', { requestsPerMinute: 3, tokensPerMinute: 100 });
    limiter.admit(acme, 50).settle(0, { refundRequest: true });
    assert.deepEqual(limiter.remaining(acme), { requests: 3, tokens: 100 });
  });

  it('keeps tenants apart', () => {
    const limiter = new TenantRateLimiter(manualClock().now);
    const a = tenant('a', { requestsPerMinute: 1 });
    const b = tenant('b', { requestsPerMinute: 1 });
    limiter.admit(a, 1);
    limiter.admit(b, 1);
    assert.throws(() => limiter.admit(a, 1));
  });

  it('writes OpenAI\'s x-ratelimit headers for the limits a tenant has', () => {
    const clock = manualClock();
    const limiter = new TenantRateLimiter(clock.now);
    const acme = tenant('acme', { requestsPerMinute: 60, tokensPerMinute: 6000 });
    limiter.admit(acme, 3000);
    assert.deepEqual(limiter.headers(acme), {
      'x-ratelimit-limit-requests': '60',
      'x-ratelimit-remaining-requests': '59',
      'x-ratelimit-reset-requests': '1s',
      'x-ratelimit-limit-tokens': '6000',
      'x-ratelimit-remaining-tokens': '3000',
      'x-ratelimit-reset-tokens': '30s',
    });
    assert.deepEqual(limiter.headers(tenant('free', {})), {});
  });
});
