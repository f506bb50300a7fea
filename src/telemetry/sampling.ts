// Which requests get full span traces. Metrics cover every request; spans cost more (building, exporting, storing
// at the collector), so they are kept for a sample plus the requests worth looking at:
//
//   head (after tokenize, before any engine work and before routing): the client's sampled flag, a base rate, a
//        higher rate for a model loaded recently (the API server registers its model when it attaches the engine),
//        and always for requests predicted slow (a long prompt);
//   tail (at the end): server errors, and requests slower than a fixed threshold (TTFT, end to end, or a gap
//        between tokens) or than the running p95 of TTFT.
//
// Spans are built only when a request ends (src/telemetry/otel-spans.ts), so the tail decision needs no span buffering: a
// request the head passed over costs nothing more than its metrics unless the tail keeps it. Memory is bounded: a
// fixed window of recent TTFTs and a capped table of new models. No clock or randomness of its own: both are passed
// in.
//
// A standard OpenTelemetry sampler named by OTEL_TRACES_SAMPLER (`otel` in the config) replaces all of the above: it
// alone decides, at the head, as the OpenTelemetry SDK's sampler of that name would (always_on, always_off,
// traceidratio on the trace id, and their parentbased_* forms following the client's sampled flag), and the tail
// keeps exactly what it sampled.

import type { RequestTrace, SamplingDecision } from './trace.ts';
import { percentile } from '../util/stats.ts';

/**
 * A standard OpenTelemetry sampler, as OTEL_TRACES_SAMPLER names it. `root` decides for a request without the
 * client's traceparent, and for every request when not `parentBased`; parent-based, a request with one follows its
 * sampled flag (sampled: kept; not sampled: dropped).
 */
export interface OtelSamplerSpec {
  root: 'always_on' | 'always_off' | 'traceidratio';
  parentBased: boolean;
  /** traceidratio: the share of trace ids sampled, within [0, 1]. */
  ratio?: number;
}

export interface TraceSamplingConfig {
  /** Fraction of requests traced from the head. */
  baseRate: number;
  /** Rate for a model registered as new, for newModelWindowMs after it was registered. */
  newModelRate: number;
  newModelWindowMs: number;
  /** Prompts at least this long are predicted slow and always traced. */
  slowPromptTokens: number;
  /** Trace when the client's traceparent says it sampled the trace (W3C parent-based sampling). */
  honourParentSampled: boolean;
  keepErrors: boolean;
  keepAborts: boolean;
  /** Keep every request whose TTFT reaches this. */
  slowTtftMs: number;
  /** Keep every request whose end-to-end time reaches this. */
  slowE2eMs: number;
  /** Keep every request with a gap between tokens (as the client saw them) of at least this. */
  slowTbtMs: number;
  /** Keep requests whose TTFT reaches this quantile of recent TTFTs... */
  slowQuantile: number;
  /** ...over this many recent requests... */
  quantileWindow: number;
  /** ...once at least this many have been seen (before that the quantile is noise). */
  quantileMinSamples: number;
  /** Bound on the new-model table; the registration expiring first is dropped beyond it. */
  maxNewModels: number;
  /**
   * A standard sampler (OTEL_TRACES_SAMPLER) that alone decides, at the head; every rule above is then unused and the
   * tail keeps exactly what the head sampled.
   */
  otel?: OtelSamplerSpec;
}

export const DEFAULT_TRACE_SAMPLING: Readonly<TraceSamplingConfig> = Object.freeze({
  baseRate: 0.01,
  newModelRate: 0.1,
  newModelWindowMs: 60 * 60 * 1000,
  slowPromptTokens: 8192,
  honourParentSampled: true,
  keepErrors: true,
  keepAborts: false,
  slowTtftMs: 500,
  slowE2eMs: 60_000,
  slowTbtMs: 100,
  slowQuantile: 0.95,
  quantileWindow: 512,
  quantileMinSamples: 50,
  maxNewModels: 64,
});

export type HeadReason = 'parent' | 'predicted_slow' | 'new_model' | 'base_rate' | 'always_on' | 'trace_id_ratio' | 'not_sampled';
export type TailReason = 'head' | 'error' | 'abort' | 'slow_ttft' | 'slow_e2e' | 'slow_tbt' | 'slow_quantile' | 'dropped';

export interface HeadInput {
  model?: string;
  promptTokens?: number;
  /** The client's sampled flag, when it sent a traceparent. */
  parentSampled?: boolean;
  /** The request's trace id (32 hex digits), which a traceidratio sampler decides on. */
  traceId?: string;
}

/** The parts of a finished request the tail decision reads. */
export type TailInput = Pick<RequestTrace, 'outcome' | 'ttftMs' | 'e2eMs' | 'status'> & {
  headSampling?: SamplingDecision;
  /** Gaps between consecutive tokens as the client saw them (RequestTrace.tbtMs). */
  tbtMs?: readonly number[];
};

/**
 * The last `capacity` values and their quantiles. Re-sorting on every query would cost O(n log n) per request, so
 * the sorted copy is refreshed only after `refreshEvery` new values (the quantile lags by at most that many).
 */
export class RecentQuantile {
  private readonly ring: Float64Array;
  private sorted = new Float64Array(0);
  private count = 0;
  private next = 0;
  private sinceSort = 0;

  constructor(readonly capacity: number, private readonly refreshEvery = 16) {
    if (!(capacity > 0)) throw new RangeError('capacity must be positive');
    this.ring = new Float64Array(capacity);
  }

  get size(): number {
    return this.count;
  }

  add(value: number): void {
    this.ring[this.next] = value;
    this.next = (this.next + 1) % this.capacity;
    if (this.count < this.capacity) this.count++;
    this.sinceSort++;
  }

  quantile(q: number): number {
    if (this.count === 0) return Number.NaN;
    if (this.sinceSort >= this.refreshEvery || this.sorted.length === 0) {
      this.sorted = this.ring.slice(0, this.count).sort();
      this.sinceSort = 0;
    }
    return percentile(this.sorted, q);
  }
}

export class TraceSampler {
  readonly config: Readonly<TraceSamplingConfig>;
  /** model -> engine-clock ms until which it is sampled at the new-model rate. */
  private readonly newModels = new Map<string, number>();
  private readonly recentTtft: RecentQuantile;

  constructor(config: Partial<TraceSamplingConfig> = {}, private readonly random: () => number = Math.random) {
    this.config = { ...DEFAULT_TRACE_SAMPLING, ...config };
    for (const key of ['baseRate', 'newModelRate', 'slowQuantile'] as const) {
      const v = this.config[key];
      if (!(v >= 0 && v <= 1)) throw new RangeError(`${key} must be within [0, 1], got ${v}`);
    }
    const ratio = this.config.otel?.ratio;
    if (ratio !== undefined && !(ratio >= 0 && ratio <= 1)) throw new RangeError(`otel.ratio must be within [0, 1], got ${ratio}`);
    this.recentTtft = new RecentQuantile(this.config.quantileWindow);
  }

  /** Raises the sampling rate for a model that was just loaded, for `durationMs` from `nowMs`. */
  registerNewModel(model: string, nowMs: number, durationMs = this.config.newModelWindowMs): void {
    this.newModels.delete(model);
    this.newModels.set(model, nowMs + durationMs);
    if (this.newModels.size > this.config.maxNewModels) {
      let soonest: string | undefined;
      let soonestAt = Number.POSITIVE_INFINITY;
      for (const [m, until] of this.newModels) if (until < soonestAt) [soonest, soonestAt] = [m, until];
      if (soonest !== undefined) this.newModels.delete(soonest);
    }
  }

  /** Whether `model` is inside its new-model window at `nowMs` (expired entries are dropped on the way). */
  isNewModel(model: string, nowMs: number): boolean {
    const until = this.newModels.get(model);
    if (until === undefined) return false;
    if (until <= nowMs) {
      this.newModels.delete(model);
      return false;
    }
    return true;
  }

  /** The decision at arrival. Draws one random number only when a rate decides. */
  head(input: HeadInput, nowMs: number): SamplingDecision {
    const c = this.config;
    if (c.otel) return otelHead(c.otel, input);
    if (c.honourParentSampled && input.parentSampled) return { sampled: true, reason: 'parent' };
    if ((input.promptTokens ?? 0) >= c.slowPromptTokens) {
      return { sampled: true, reason: 'predicted_slow' };
    }
    if (input.model !== undefined && this.isNewModel(input.model, nowMs)) {
      const rate = Math.max(c.baseRate, c.newModelRate);
      return this.random() < rate ? { sampled: true, reason: 'new_model' } : { sampled: false, reason: 'not_sampled' };
    }
    return c.baseRate > 0 && this.random() < c.baseRate ? { sampled: true, reason: 'base_rate' } : { sampled: false, reason: 'not_sampled' };
  }

  /**
   * The decision at the end: whether to build and keep this request's spans. Every finished request with a TTFT
   * then joins the window the quantile is taken over (after the decision, so a request is compared with its
   * predecessors only).
   */
  tail(trace: TailInput): SamplingDecision {
    const decision = this.tailDecision(trace);
    if (trace.outcome === 'ok' && trace.ttftMs !== undefined) this.recentTtft.add(trace.ttftMs);
    return decision;
  }

  /** The running quantile the tail compares TTFT with; NaN until quantileMinSamples requests have finished. */
  runningTtftQuantile(): number {
    if (this.recentTtft.size < this.config.quantileMinSamples) return Number.NaN;
    return this.recentTtft.quantile(this.config.slowQuantile);
  }

  private tailDecision(trace: TailInput): SamplingDecision {
    const c = this.config;
    if (trace.headSampling?.sampled) return { sampled: true, reason: 'head' };
    // A standard sampler's decision is final: nothing it dropped is kept afterwards.
    if (c.otel) return { sampled: false, reason: 'dropped' };
    // Server errors only: a flood of refusals (429s under overload, bad requests) would otherwise flood the traces.
    const serverError = trace.outcome === 'error' && (trace.status === undefined || trace.status >= 500);
    if (serverError && c.keepErrors) return { sampled: true, reason: 'error' };
    if (trace.outcome === 'abort' && c.keepAborts) return { sampled: true, reason: 'abort' };
    if (trace.ttftMs !== undefined && trace.ttftMs >= c.slowTtftMs) return { sampled: true, reason: 'slow_ttft' };
    if (trace.e2eMs >= c.slowE2eMs) return { sampled: true, reason: 'slow_e2e' };
    if (trace.tbtMs) {
      for (const gap of trace.tbtMs) if (gap >= c.slowTbtMs) return { sampled: true, reason: 'slow_tbt' };
    }
    if (trace.ttftMs !== undefined) {
      const threshold = this.runningTtftQuantile();
      if (!Number.isNaN(threshold) && trace.ttftMs > threshold) return { sampled: true, reason: 'slow_quantile' };
    }
    return { sampled: false, reason: 'dropped' };
  }
}

/** The head decision of a standard OpenTelemetry sampler (ParentBased, AlwaysOn, AlwaysOff, TraceIdRatioBased). */
function otelHead(spec: OtelSamplerSpec, input: HeadInput): SamplingDecision {
  if (spec.parentBased && input.parentSampled !== undefined) {
    return input.parentSampled ? { sampled: true, reason: 'parent' } : { sampled: false, reason: 'not_sampled' };
  }
  if (spec.root === 'always_on') return { sampled: true, reason: 'always_on' };
  if (spec.root === 'traceidratio' && traceIdRatioSampled(input.traceId, spec.ratio ?? 1)) return { sampled: true, reason: 'trace_id_ratio' };
  return { sampled: false, reason: 'not_sampled' };
}

/**
 * The OpenTelemetry JS SDK's TraceIdRatioBasedSampler: the four 32-bit words of the trace id XORed together, sampled
 * below ratio x (2^32 - 1). Deterministic per trace id, so every service of a trace sampling at one ratio agrees, and
 * a higher ratio keeps every trace a lower one keeps. An invalid trace id (absent, malformed, all zeros) is not sampled.
 */
export function traceIdRatioSampled(traceId: string | undefined, ratio: number): boolean {
  if (traceId === undefined || !/^[0-9a-f]{32}$/i.test(traceId) || /^0+$/.test(traceId)) return false;
  const upperBound = ratio >= 1 ? 0x100000000 : ratio <= 0 ? 0 : Math.floor(ratio * 0xffffffff);
  let accumulation = 0;
  for (let i = 0; i < 32; i += 8) accumulation = (accumulation ^ Number.parseInt(traceId.slice(i, i + 8), 16)) >>> 0;
  return accumulation < upperBound;
}
