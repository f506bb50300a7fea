// SLO compliance over a sliding window, per model, in two tiers: the target (where the service should be) and the
// warning level (past which someone should act). Defaults: TTFT p99 under 200 ms (target) / 500 ms (warning), TBT
// p99 under 50 / 100 ms, server error rate under 0.1% / 1%.
//
// Percentiles over a window need the window's samples; keeping them all would grow with traffic (TBT adds a sample
// per token). Each window is instead a ring of time slots, and each slot holds log-bucketed histograms in the
// manner of DDSketch: a value v lands in bucket ceil(log_g v) and is read back as 2 g^i / (g + 1), which is within
// (g - 1) / (g + 1) of v. With g = 1.02 that is 1%, in at most a few hundred buckets per slot for 0.01 ms .. 10 min.
// Slots expire whole, so the window slides in slot-sized steps (10 s of a 5 min window by default).
//
// Pure: every call takes the time; nothing here reads a clock.

import type { RequestTrace } from './trace.ts';
import { nearestRank, round3 } from '../util/stats.ts';

// ---------------------------------------------------------------------------------------------------------------
// Configuration

export interface LatencyObjective {
  targetMs: number;
  warningMs: number;
}

export interface RateObjective {
  /** Fractions: 0.001 = 0.1%. */
  target: number;
  warning: number;
}

export interface SloObjectives {
  ttft: LatencyObjective;
  tbt: LatencyObjective;
  errorRate: RateObjective;
}

export interface SloConfig extends SloObjectives {
  windowMs: number;
  slotMs: number;
  /** The percentile the latency objectives apply to (0.99 = p99). */
  percentile: number;
  /** Overrides for particular models. */
  perModel: Readonly<Record<string, Partial<SloObjectives>>>;
  /** Models tracked at once; the least recently seen is dropped beyond it. */
  maxModels: number;
  /** Relative accuracy of the reported percentiles. */
  relativeAccuracy: number;
}

export const DEFAULT_SLO: Readonly<SloConfig> = Object.freeze({
  ttft: { targetMs: 200, warningMs: 500 },
  tbt: { targetMs: 50, warningMs: 100 },
  errorRate: { target: 0.001, warning: 0.01 },
  windowMs: 5 * 60 * 1000,
  slotMs: 10 * 1000,
  percentile: 0.99,
  perModel: {},
  maxModels: 64,
  relativeAccuracy: 0.01,
});

// ---------------------------------------------------------------------------------------------------------------
// Log-bucketed histogram

/** Values at or below this count as zero (a sub-10-microsecond latency is below the clock's meaning here). */
const MIN_TRACKED_MS = 1e-2;

export class LogHistogram {
  private readonly counts = new Map<number, number>();
  private zeroCount = 0;
  total = 0;

  constructor(private readonly lnGamma: number) {}

  add(value: number, count = 1): void {
    if (!(value > MIN_TRACKED_MS)) {
      this.zeroCount += count;
    } else {
      const key = Math.ceil(Math.log(value) / this.lnGamma);
      this.counts.set(key, (this.counts.get(key) ?? 0) + count);
    }
    this.total += count;
  }

  /** Adds every bucket of this histogram into `into` (a merge for a window's quantile). */
  mergeInto(into: Map<number, number>): number {
    for (const [k, c] of this.counts) into.set(k, (into.get(k) ?? 0) + c);
    return this.zeroCount;
  }

  clear(): void {
    this.counts.clear();
    this.zeroCount = 0;
    this.total = 0;
  }
}

/**
 * The q-quantile of merged buckets: the nearest rank ceil(q * n) (util/stats.ts, the same definition as every other
 * percentile), then the bucket holding that rank.
 */
function quantileOfBuckets(buckets: Map<number, number>, zeroCount: number, q: number, gamma: number): number {
  let total = zeroCount;
  for (const c of buckets.values()) total += c;
  if (total === 0) return Number.NaN;
  const rank = nearestRank(total, q) - 1; // 0-based
  if (rank < zeroCount) return 0;
  let seen = zeroCount;
  const keys = [...buckets.keys()].sort((a, b) => a - b);
  for (const k of keys) {
    seen += buckets.get(k)!;
    if (seen > rank) return (2 * gamma ** k) / (gamma + 1);
  }
  const last = keys[keys.length - 1]!;
  return (2 * gamma ** last) / (gamma + 1);
}

// ---------------------------------------------------------------------------------------------------------------
// Windows

interface Slot {
  /** Slot number (time / slotMs) this slot currently holds; -1 = empty. */
  epoch: number;
  ttft: LogHistogram;
  tbt: LogHistogram;
  requests: number;
  serverErrors: number;
}

class ModelWindow {
  readonly slots: Slot[];
  lastSeenMs = 0;

  constructor(numSlots: number, lnGamma: number) {
    this.slots = Array.from({ length: numSlots }, () => ({
      epoch: -1, ttft: new LogHistogram(lnGamma), tbt: new LogHistogram(lnGamma), requests: 0, serverErrors: 0,
    }));
  }

  /** The slot for `epoch`, recycled if it held an older one; undefined for a sample older than the slot's. */
  slotFor(epoch: number): Slot | undefined {
    const slot = this.slots[((epoch % this.slots.length) + this.slots.length) % this.slots.length]!;
    if (slot.epoch === epoch) return slot;
    if (slot.epoch > epoch) return undefined;
    slot.epoch = epoch;
    slot.ttft.clear();
    slot.tbt.clear();
    slot.requests = 0;
    slot.serverErrors = 0;
    return slot;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Report (the body of GET /v1/slo)

export type SloStatus = 'ok' | 'warning' | 'violated' | 'no_data';

export interface LatencySloReport {
  samples: number;
  p50_ms: number | null;
  /** The configured percentile (p99 by default). */
  p99_ms: number | null;
  target_ms: number;
  warning_ms: number;
  target_met: boolean | null;
  warning_met: boolean | null;
  status: SloStatus;
}

export interface ErrorRateSloReport {
  requests: number;
  errors: number;
  rate: number | null;
  target: number;
  warning: number;
  target_met: boolean | null;
  warning_met: boolean | null;
  status: SloStatus;
}

export interface ModelSloReport {
  model: string;
  ttft: LatencySloReport;
  tbt: LatencySloReport;
  error_rate: ErrorRateSloReport;
  /** The worst of the three. */
  status: SloStatus;
}

export interface SloReport {
  generated_at_ms: number;
  window_ms: number;
  percentile: number;
  status: SloStatus;
  models: ModelSloReport[];
}

const STATUS_ORDER: Record<SloStatus, number> = { no_data: 0, ok: 1, warning: 2, violated: 3 };

export function worstStatus(statuses: readonly SloStatus[]): SloStatus {
  let worst: SloStatus = 'no_data';
  for (const s of statuses) if (STATUS_ORDER[s] > STATUS_ORDER[worst]) worst = s;
  return worst;
}

function tier(value: number, target: number, warning: number): SloStatus {
  if (value < target) return 'ok';
  if (value < warning) return 'warning';
  return 'violated';
}

// ---------------------------------------------------------------------------------------------------------------
// Tracker

export interface SloSample {
  model: string;
  /** Engine-clock ms the request ended. */
  atMs: number;
  ttftMs?: number;
  tbtMs?: readonly number[];
  /** A server-side failure (status >= 500 or none): counts against the error-rate objective. */
  serverError: boolean;
  /** A request refused as the client's fault (status < 500): left out of the error rate's denominator. */
  clientError?: boolean;
}

export class SloTracker {
  readonly config: Readonly<SloConfig>;
  private readonly models = new Map<string, ModelWindow>();
  private readonly numSlots: number;
  private readonly gamma: number;
  private readonly lnGamma: number;

  constructor(config: Partial<SloConfig> = {}) {
    this.config = { ...DEFAULT_SLO, ...config };
    const { windowMs, slotMs, relativeAccuracy } = this.config;
    if (!(slotMs > 0 && windowMs >= slotMs)) throw new RangeError('need 0 < slotMs <= windowMs');
    if (!(relativeAccuracy > 0 && relativeAccuracy < 1)) throw new RangeError('relativeAccuracy must be within (0, 1)');
    this.numSlots = Math.ceil(windowMs / slotMs);
    this.gamma = (1 + relativeAccuracy) / (1 - relativeAccuracy);
    this.lnGamma = Math.log(this.gamma);
  }

  /** The objectives that apply to `model` (defaults with its overrides). */
  objectivesFor(model: string): SloObjectives {
    const o = this.config.perModel[model] ?? {};
    return { ttft: o.ttft ?? this.config.ttft, tbt: o.tbt ?? this.config.tbt, errorRate: o.errorRate ?? this.config.errorRate };
  }

  record(sample: SloSample): void {
    let window = this.models.get(sample.model);
    if (!window) {
      window = new ModelWindow(this.numSlots, this.lnGamma);
      window.lastSeenMs = sample.atMs;
      this.models.set(sample.model, window);
      this.evictBeyondLimit(sample.model);
    }
    window.lastSeenMs = Math.max(window.lastSeenMs, sample.atMs);
    const slot = window.slotFor(Math.floor(sample.atMs / this.config.slotMs));
    if (!slot) return;
    if (sample.ttftMs !== undefined) slot.ttft.add(sample.ttftMs);
    if (sample.tbtMs) for (const v of sample.tbtMs) slot.tbt.add(v);
    if (sample.clientError) return;
    slot.requests++;
    if (sample.serverError) slot.serverErrors++;
  }

  /** Records a finished request. */
  recordTrace(trace: RequestTrace): void {
    const status = trace.status;
    const isError = trace.outcome === 'error';
    const clientError = isError && status !== undefined && status < 500;
    this.record({
      model: trace.model, atMs: trace.endMs,
      ...(trace.ttftMs !== undefined ? { ttftMs: trace.ttftMs } : {}),
      tbtMs: trace.tbtMs,
      serverError: isError && !clientError,
      clientError,
    });
  }

  /** Compliance of every model seen within the window ending at `nowMs`. */
  report(nowMs: number): SloReport {
    const models: ModelSloReport[] = [];
    for (const model of [...this.models.keys()].sort()) {
      const m = this.modelReport(model, nowMs);
      if (m) models.push(m);
    }
    return {
      generated_at_ms: nowMs, window_ms: this.config.windowMs, percentile: this.config.percentile,
      status: worstStatus(models.map((m) => m.status)), models,
    };
  }

  modelReport(model: string, nowMs: number): ModelSloReport | undefined {
    const window = this.models.get(model);
    if (!window) return undefined;
    const objectives = this.objectivesFor(model);
    const currentEpoch = Math.floor(nowMs / this.config.slotMs);
    const oldestEpoch = currentEpoch - this.numSlots + 1;
    const ttftBuckets = new Map<number, number>();
    const tbtBuckets = new Map<number, number>();
    let ttftZero = 0;
    let tbtZero = 0;
    let requests = 0;
    let errors = 0;
    let seen = false;
    for (const slot of window.slots) {
      if (slot.epoch < oldestEpoch || slot.epoch > currentEpoch) continue;
      seen = true;
      ttftZero += slot.ttft.mergeInto(ttftBuckets);
      tbtZero += slot.tbt.mergeInto(tbtBuckets);
      requests += slot.requests;
      errors += slot.serverErrors;
    }
    if (!seen) return undefined;
    const ttft = this.latencyReport(ttftBuckets, ttftZero, objectives.ttft);
    const tbt = this.latencyReport(tbtBuckets, tbtZero, objectives.tbt);
    const rate = requests > 0 ? errors / requests : null;
    const { target, warning } = objectives.errorRate;
    const errorStatus: SloStatus = rate === null ? 'no_data' : tier(rate, target, warning);
    const error_rate: ErrorRateSloReport = {
      requests, errors, rate, target, warning,
      target_met: rate === null ? null : rate < target, warning_met: rate === null ? null : rate < warning, status: errorStatus,
    };
    return { model, ttft, tbt, error_rate, status: worstStatus([ttft.status, tbt.status, errorStatus]) };
  }

  private latencyReport(buckets: Map<number, number>, zero: number, objective: LatencyObjective): LatencySloReport {
    let samples = zero;
    for (const c of buckets.values()) samples += c;
    if (samples === 0) {
      return {
        samples, p50_ms: null, p99_ms: null, target_ms: objective.targetMs, warning_ms: objective.warningMs,
        target_met: null, warning_met: null, status: 'no_data',
      };
    }
    const p50 = quantileOfBuckets(buckets, zero, 0.5, this.gamma);
    const pN = quantileOfBuckets(buckets, zero, this.config.percentile, this.gamma);
    return {
      samples, p50_ms: round3(p50), p99_ms: round3(pN), target_ms: objective.targetMs, warning_ms: objective.warningMs,
      target_met: pN < objective.targetMs, warning_met: pN < objective.warningMs, status: tier(pN, objective.targetMs, objective.warningMs),
    };
  }

  private evictBeyondLimit(keep: string): void {
    while (this.models.size > this.config.maxModels) {
      let oldest: string | undefined;
      let oldestAt = Number.POSITIVE_INFINITY;
      for (const [m, w] of this.models) if (m !== keep && w.lastSeenMs < oldestAt) [oldest, oldestAt] = [m, w.lastSeenMs];
      if (oldest === undefined) return;
      this.models.delete(oldest);
    }
  }
}

