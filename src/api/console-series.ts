// The web console's charts: TTFT, time between tokens and throughput over the last minutes, in fixed time buckets.
// Fed with every finished request's trace (Telemetry.onTrace); a request's tokens land in the buckets of the times
// they were written, so throughput over time is right even for requests that end long after they started. Memory
// is fixed: a ring of buckets, each holding at most a fixed number of latency samples (a uniform reservoir beyond
// it), whatever the traffic. Percentiles of a bucket are computed when asked and kept until a sample changes them.

import type { RequestTrace } from '../telemetry/index.ts';
import { percentile, round3 } from '../util/stats.ts';

export interface SeriesOptions {
  /** Width of one bucket, ms. Default 2000. */
  bucketMs?: number;
  /** How far back the series reach, ms. Default 5 minutes. */
  windowMs?: number;
  /** Latency samples kept per bucket and kind. Default 512. */
  samplesPerBucket?: number;
}

/** The series as the console's overview JSON carries them: parallel arrays, one entry per bucket, oldest first. */
export interface SeriesView {
  bucket_ms: number;
  /** Each bucket's start, unix seconds. */
  t: number[];
  /** Output tokens written per second. */
  output_tokens_per_s: number[];
  /** Requests finished per second. */
  requests_per_s: number[];
  /** TTFT of the requests whose first token came in the bucket; null where none did. */
  ttft_p50_ms: (number | null)[];
  ttft_p99_ms: (number | null)[];
  /** Time between tokens (RequestTrace.tbtMs, as /metrics counts it) of the gaps that ended in the bucket. */
  itl_p50_ms: (number | null)[];
  itl_p99_ms: (number | null)[];
}

class Reservoir {
  readonly values: number[] = [];
  seen = 0;
  private sorted: Float64Array | undefined;

  constructor(private readonly capacity: number) {}

  add(value: number, random: () => number): void {
    this.seen++;
    this.sorted = undefined;
    if (this.values.length < this.capacity) {
      this.values.push(value);
      return;
    }
    const slot = Math.floor(random() * this.seen);
    if (slot < this.capacity) this.values[slot] = value;
  }

  quantile(q: number): number | null {
    if (this.values.length === 0) return null;
    this.sorted ??= Float64Array.from(this.values).sort();
    return round3(percentile(this.sorted, q));
  }

  clear(): void {
    this.values.length = 0;
    this.seen = 0;
    this.sorted = undefined;
  }
}

interface Bucket {
  /** Bucket number (time / bucketMs) it holds; -1 = empty. */
  epoch: number;
  outputTokens: number;
  requests: number;
  ttft: Reservoir;
  itl: Reservoir;
}

export class ConsoleSeries {
  readonly bucketMs: number;
  private readonly buckets: Bucket[];
  /** A small xorshift generator for the reservoirs: cheap, and no Math.random in what tests compare. */
  private state = 0x9e3779b9;

  constructor(options: SeriesOptions = {}) {
    this.bucketMs = options.bucketMs ?? 2000;
    const windowMs = options.windowMs ?? 5 * 60 * 1000;
    const samples = options.samplesPerBucket ?? 512;
    if (!(this.bucketMs > 0 && windowMs >= this.bucketMs)) throw new RangeError('need 0 < bucketMs <= windowMs');
    this.buckets = Array.from({ length: Math.ceil(windowMs / this.bucketMs) }, () => ({
      epoch: -1, outputTokens: 0, requests: 0, ttft: new Reservoir(samples), itl: new Reservoir(samples),
    }));
  }

  private random = (): number => {
    let x = this.state;
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    this.state = x >>> 0;
    return this.state / 2 ** 32;
  };

  /** The bucket for time `ms`, recycled if it held an older epoch; undefined for a time older than the ring. */
  private bucketAt(ms: number): Bucket | undefined {
    const epoch = Math.floor(ms / this.bucketMs);
    const n = this.buckets.length;
    const bucket = this.buckets[((epoch % n) + n) % n]!;
    if (bucket.epoch === epoch) return bucket;
    if (bucket.epoch > epoch) return undefined;
    bucket.epoch = epoch;
    bucket.outputTokens = 0;
    bucket.requests = 0;
    bucket.ttft.clear();
    bucket.itl.clear();
    return bucket;
  }

  /**
   * Adds a finished request: its end, its first token, its token writes, and its time between tokens in the bucket
   * where each gap ended. The gaps are the trace's (tbtMs), those /metrics and the SLO report count: between the
   * writes of a one-sequence stream, else between the engine's decode steps when it reported them. The writes of
   * an n > 1 stream interleave its completions, so the gaps between them are no completion's.
   */
  record(trace: RequestTrace): void {
    const end = this.bucketAt(trace.endMs);
    if (end) end.requests++;
    if (trace.outcome !== 'ok' && trace.outputTokens === 0) return;
    if (trace.ttftMs !== undefined) this.bucketAt(trace.arrivalMs + trace.ttftMs)?.ttft.add(trace.ttftMs, this.random);
    if (trace.tbtFromMs !== undefined) {
      let at = trace.tbtFromMs;
      for (const gap of trace.tbtMs) {
        at += gap;
        this.bucketAt(at)?.itl.add(gap, this.random);
      }
    }
    const writes = trace.emits.contentTimesMs;
    if (writes.length === 0) {
      // Not streamed: the tokens are counted when the body went out.
      if (end) end.outputTokens += trace.outputTokens;
      return;
    }
    const perWrite = trace.outputTokens / writes.length;
    for (const time of writes) {
      const bucket = this.bucketAt(time);
      if (bucket) bucket.outputTokens += perWrite;
    }
  }

  /** The buckets of the window ending at `nowMs`, oldest first (empty buckets as zeros and nulls). */
  view(nowMs: number): SeriesView {
    const n = this.buckets.length;
    const last = Math.floor(nowMs / this.bucketMs);
    const out: SeriesView = {
      bucket_ms: this.bucketMs, t: [], output_tokens_per_s: [], requests_per_s: [],
      ttft_p50_ms: [], ttft_p99_ms: [], itl_p50_ms: [], itl_p99_ms: [],
    };
    const perSecond = 1000 / this.bucketMs;
    for (let epoch = last - n + 1; epoch <= last; epoch++) {
      const b = this.buckets[((epoch % n) + n) % n]!;
      const held = b.epoch === epoch;
      out.t.push((epoch * this.bucketMs) / 1000);
      out.output_tokens_per_s.push(held ? round3(b.outputTokens * perSecond) : 0);
      out.requests_per_s.push(held ? round3(b.requests * perSecond) : 0);
      out.ttft_p50_ms.push(held ? b.ttft.quantile(0.5) : null);
      out.ttft_p99_ms.push(held ? b.ttft.quantile(0.99) : null);
      out.itl_p50_ms.push(held ? b.itl.quantile(0.5) : null);
      out.itl_p99_ms.push(held ? b.itl.quantile(0.99) : null);
    }
    return out;
  }
}
