// Why was a request slow? The analyzer splits a request's time into its phases and names the bottleneck with a
// recommendation; over a window of requests it reports where time goes on average and which bottleneck is most
// common among the slow ones (GET /v1/analysis).
//
// The rules, in order:
//   1. decode_preempted   when decode dominates the request and it lost its KV blocks mid-decode (its tokens were
//                         recomputed: prompt chunks after the first token);
//      decode_latency_spike when decode dominates and a step took over `spikeFactor` times the median and at least
//                         `minSpikeExcessMs` longer than it (a few ms over a fast median is a loaded machine's noise);
//      decode_batch_bound when decode dominates and its time per token reaches `slowTbtMs`, with steady steps: each
//                         as slow as the batch it ran in makes it;
//      decode_output_length when decode dominates and none of the three applies: steady tokens at a healthy rate, so
//                         the time is the number of tokens the request generated. Never a TTFT category then: TTFT
//                         is under half of such a request, so naming its largest part would point at the lesser cost;
//   2. gateway_bound        when the gateway phases (http_receive .. tokenize) are over `gatewayShare` of TTFT, naming
//                         the one of them that took longest (tokenize: the chat template, a guided request's grammar
//                         check and the tokenizer; http_receive: the body's upload);
//   3. queue_saturation     when the scheduler queue is over `queueShare` of TTFT;
//   4. prefill_no_cache / prefill_compute_bound when prefill is over `prefillShare` of TTFT (split by the prefix
//      cache hit rate; a prompt shorter than one KV block, which the cache cannot hold, is never "no cache");
//   5. kv_transfer_bound    when the KV transfer is over `kvTransferShare` of TTFT;
//   6. decode_latency_spike when a step spiked, even though decode did not dominate;
//   In 1 and 6, a spike that is only the gap of a KV transfer after the first token (disaggregated serving: the
//   prefill worker streams the first token, the prompt's KV moves after it) is kv_transfer_bound, its share of the
//   request: the gap is the hand-over's, and a decode spike's advice would point away from it;
//   7. balanced.
// Shares of TTFT are of the measured TTFT (arrival to first streamed token), the decode categories' of the whole
// request (a spike's of the decode steps' time): `dominant_share_of` says which. "Decode dominates" means decode (the
// first token to the end of the response) took longer than TTFT; the TTFT rules (2-5) apply only when it did not, so
// only to a request whose TTFT is at least half of it.
//
// Only completed requests (outcome ok) have a bottleneck. A failed or refused request is `failed` and an aborted one
// `aborted`, with why in place of a recommendation: their phases stop where they ended, so the shares would name a
// bottleneck of something that never completed. The window report leaves both out.

import { GATEWAY_PHASES, type GatewayPhase, type PhaseName } from './lifecycle.ts';
import { percentile, round3 } from '../util/stats.ts';
import { phaseBreakdown, type PhaseBreakdown, type RequestTrace } from './trace.ts';

export type BottleneckCategory =
  | 'gateway_bound' | 'queue_saturation' | 'prefill_no_cache' | 'prefill_compute_bound' | 'kv_transfer_bound' | 'decode_latency_spike'
  | 'decode_preempted' | 'decode_batch_bound' | 'decode_output_length' | 'balanced';

/** What classify() says of a request: its bottleneck, or that it did not complete (no bottleneck then). */
export type DiagnosisCategory = BottleneckCategory | 'failed' | 'aborted';

export const BOTTLENECK_CATEGORIES: readonly BottleneckCategory[] = [
  'gateway_bound', 'queue_saturation', 'prefill_no_cache', 'prefill_compute_bound', 'kv_transfer_bound', 'decode_latency_spike',
  'decode_preempted', 'decode_batch_bound', 'decode_output_length', 'balanced',
];

/** What a diagnosis' dominant_share is a share of. */
export type ShareBase = 'ttft' | 'request' | 'decode_steps';

export interface AnalyzerThresholds {
  /** The gateway phases' (http_receive .. tokenize, their union) share of TTFT over which they are the bottleneck. */
  gatewayShare: number;
  queueShare: number;
  prefillShare: number;
  kvTransferShare: number;
  /** Below this prefix-cache hit rate a prefill-bound request is "no cache". */
  noCacheHitRate: number;
  /** A decode step over this multiple of the median step is a spike... */
  spikeFactor: number;
  /**
   * ...when it is also at least this many ms longer than the median. What a loaded machine adds to any thread's
   * wake-up with nothing wrong in the serving path reaches this: a Linux CFS scheduling period is 6 ms x (1 + log2 of
   * the CPUs, at most 8), up to 24 ms, and V8's young-generation collections pause for a few ms. Against a 1.5 ms
   * median, 3x is 4.5 ms, which one such delay exceeds in any short stream. 25 ms is also half the TBT target (50 ms):
   * a shorter stall is no stutter a client notices. For medians of 12.5 ms and more, 3x the median is the stricter
   * bound, so this changes nothing for slower steps.
   */
  minSpikeExcessMs: number;
  /** Steps over this multiple of the median (and minSpikeExcessMs above it) are counted as spikes in the recommendation. */
  spikeCountFactor: number;
  /** Fewer decode steps than this are too few for a median. */
  minDecodeSteps: number;
  /** Time per output token at or over which a decode-dominated request is decode-bound (the TBT target). */
  slowTbtMs: number;
}

export const DEFAULT_THRESHOLDS: Readonly<AnalyzerThresholds> = Object.freeze({
  gatewayShare: 0.6,
  queueShare: 0.6,
  prefillShare: 0.7,
  kvTransferShare: 0.4,
  noCacheHitRate: 0.1,
  spikeFactor: 3,
  minSpikeExcessMs: 25,
  spikeCountFactor: 2,
  minDecodeSteps: 4,
  slowTbtMs: 50,
});

/** Milliseconds per part of the request (keys as in the JSON report). */
export interface BreakdownMs {
  gateway: number;
  routing: number;
  queue: number;
  prefill: number;
  kv_transfer: number;
  /** Time to first token not in any phase above. */
  other_before_first_token: number;
  decode: number;
}

export interface Diagnosis<C extends DiagnosisCategory = DiagnosisCategory> {
  request_id: string;
  category: C;
  /** The phase the category points at ('none' for balanced, failed and aborted). */
  dominant_phase: PhaseName | 'none';
  /**
   * Its share (0..1) of TTFT for the TTFT categories, of the request for decode_preempted, decode_batch_bound,
   * decode_output_length and a KV transfer after the first token, of the decode steps' time for a decode spike; 0 for
   * balanced, failed, aborted.
   */
  dominant_share: number;
  /** What dominant_share is a share of; null when there is no dominant phase. */
  dominant_share_of: ShareBase | null;
  dominant_ms: number;
  /** What to do about the bottleneck; for failed and aborted, how the request ended ("failed: ..."). */
  recommendation: string;
  ttft_ms: number | null;
  total_ms: number;
  breakdown_ms: BreakdownMs;
}

function pct(share: number): string {
  return `${(share * 100).toFixed(0)}%`;
}

function ms(x: number): string {
  return x >= 100 ? `${x.toFixed(0)} ms` : `${x.toFixed(1)} ms`;
}

function bytes(n: number): string {
  if (n >= 1 << 30) return `${(n / (1 << 30)).toFixed(2)} GiB`;
  if (n >= 1 << 20) return `${(n / (1 << 20)).toFixed(1)} MiB`;
  if (n >= 1 << 10) return `${(n / (1 << 10)).toFixed(1)} KiB`;
  return `${n} B`;
}

export class TraceAnalyzer {
  readonly thresholds: Readonly<AnalyzerThresholds>;

  constructor(thresholds: Partial<AnalyzerThresholds> = {}) {
    this.thresholds = { ...DEFAULT_THRESHOLDS, ...thresholds };
  }

  /** The request's bottleneck; for a request that did not complete, `failed` or `aborted` and why. */
  classify(trace: RequestTrace): Diagnosis {
    if (trace.outcome === 'ok') return this.bottleneck(trace);
    const b = phaseBreakdown(trace);
    const where = trace.endedInPhase ? ` in ${trace.endedInPhase}` : '';
    const after = ` after ${ms(trace.e2eMs)}`;
    const why = trace.outcome === 'error'
      ? `failed: ${[trace.status, trace.errorType ?? 'error'].filter((x) => x !== undefined).join(' ')}${where}${after}`
        + `${trace.errorMessage ? `: ${trace.errorMessage}` : ''}`
      : `aborted${trace.abortReason ? ` (${trace.abortReason})` : ''}${where}${after}`;
    return {
      request_id: trace.requestId, category: trace.outcome === 'error' ? 'failed' : 'aborted', dominant_phase: 'none', dominant_share: 0,
      dominant_share_of: null, dominant_ms: 0,
      // The error's message is most often a sentence already (OpenAI's end with a full stop): not one stop more.
      recommendation: `${/[.!?]$/.test(why) ? why : `${why}.`} A request that did not complete gets no bottleneck diagnosis.`,
      ttft_ms: trace.ttftMs === undefined ? null : round3(trace.ttftMs), total_ms: round3(trace.e2eMs),
      breakdown_ms: {
        gateway: round3(b.gatewayMs), routing: round3(b.routingMs), queue: round3(b.queueMs), prefill: round3(b.prefillMs),
        kv_transfer: round3(b.kvTransferMs), other_before_first_token: 0, decode: round3(b.decodeMs),
      },
    };
  }

  /** The bottleneck of a completed request (the rules in the file comment). */
  bottleneck(trace: RequestTrace): Diagnosis<BottleneckCategory> {
    const t = this.thresholds;
    const b = phaseBreakdown(trace);
    const ttft = trace.ttftMs;
    const beforeFirst = b.gatewayMs + b.routingMs + b.queueMs + b.prefillMs + b.kvTransferMs;
    const ttftBase = Math.max(ttft ?? beforeFirst, beforeFirst, 1e-9);
    const breakdown: BreakdownMs = {
      gateway: round3(b.gatewayMs), routing: round3(b.routingMs), queue: round3(b.queueMs), prefill: round3(b.prefillMs), kv_transfer: round3(b.kvTransferMs),
      other_before_first_token: round3(Math.max(0, (ttft ?? beforeFirst) - beforeFirst)), decode: round3(b.decodeMs),
    };
    const base = { request_id: trace.requestId, ttft_ms: ttft === undefined ? null : round3(ttft), total_ms: round3(trace.e2eMs), breakdown_ms: breakdown };
    const make: Make = (category, phase, share, shareOf, dominantMs, recommendation) => ({
      ...base, category, dominant_phase: phase, dominant_share: round3(share), dominant_share_of: phase === 'none' ? null : shareOf,
      dominant_ms: round3(dominantMs), recommendation,
    });

    // On the disaggregated path the prompt's KV moves after the first token, so a slow transfer is one long gap among
    // the decode steps. When the largest step is that gap and no spike is left without the steps it overlaps, the spike
    // is the transfer's, not a decode stall: it is named as such.
    const handOver = this.transferAfterFirstToken(trace);
    const anySpike = this.spike(trace);
    const gapIsTransfer = anySpike !== undefined && handOver !== undefined
      && (trace.decode?.stepMs ?? []).some((s, i) => s >= anySpike.maxStepMs && overlapsStep(trace, i, handOver));
    const spike = gapIsTransfer ? this.spike(trace, handOver) : anySpike;
    const transferGap = gapIsTransfer && !spike ? this.transferGap(trace, handOver!, anySpike!, make) : undefined;
    const decodeDominates = b.decodeMs > ttftBase;
    // A preemption mid-decode shows as a long gap between steps too: it is named first, as the cause.
    const preempted = decodeDominates ? this.decodeBound(trace, b.decodeMs, make, 'preempted') : undefined;
    if (preempted) return preempted;
    if (spike && decodeDominates) return make('decode_latency_spike', 'decode_execution', spike.share, 'decode_steps', spike.spikeMs, spike.recommendation);
    if (transferGap && decodeDominates) return transferGap;
    if (decodeDominates) return this.decodeBound(trace, b.decodeMs, make, 'batch') ?? this.outputLength(trace, b, ttftBase, make);

    const gatewayShare = b.gatewayMs / ttftBase;
    if (gatewayShare > t.gatewayShare) return this.gatewayBound(trace, b.gatewayMs, ttftBase, make);

    const queueShare = b.queueMs / ttftBase;
    if (queueShare > t.queueShare) {
      const depth = trace.queueDepthAtEntry !== undefined ? ` with ${trace.queueDepthAtEntry} requests ahead` : '';
      const where = trace.worker ? ` on ${trace.worker}` : '';
      return make('queue_saturation', 'scheduler_queue', queueShare, 'ttft', b.queueMs,
        `Queue wait ${ms(b.queueMs)} is ${pct(queueShare)} of the ${ms(ttftBase)} TTFT${depth}: the worker${where} is saturated. ` +
        'Add workers or batch capacity, shed or rate-limit load, or let the router weigh queue depth more.');
    }

    const prefillShare = b.prefillMs / ttftBase;
    if (prefillShare > t.prefillShare) {
      const hitRate = trace.cachedTokens / Math.max(1, trace.promptTokens);
      const computed = trace.prefill?.computedTokens ?? Math.max(0, trace.promptTokens - trace.cachedTokens);
      // The prefix cache holds whole KV blocks (one of them, copied, can cover all but a prompt's last token): a prompt
      // shorter than one block has nothing it could find there, so caching is no advice for it.
      const blockSize = trace.blockSize;
      if (blockSize !== undefined && trace.promptTokens < blockSize) {
        return make('prefill_compute_bound', 'prefill_execution', prefillShare, 'ttft', b.prefillMs,
          `Prefill ${ms(b.prefillMs)} is ${pct(prefillShare)} of TTFT for a ${trace.promptTokens}-token prompt, shorter than one ` +
          `${blockSize}-token KV block: the prefix cache holds whole blocks, so none of it could come from there and computing ` +
          `${computed} tokens is the cost. A step that short is slow when it shares its batch with long prefill chunks (lower ` +
          '--max-num-batched-tokens, or disaggregated prefill workers) or when the forward pass itself is slow (a faster ' +
          'backend, a smaller or more quantized model).');
      }
      if (hitRate < t.noCacheHitRate) {
        return make('prefill_no_cache', 'prefill_execution', prefillShare, 'ttft', b.prefillMs,
          `Prefill ${ms(b.prefillMs)} is ${pct(prefillShare)} of TTFT and ${pct(hitRate)} of the ${trace.promptTokens}-token prompt came from ` +
          'the prefix cache. Keep shared content (system prompt, documents) at the start of prompts, route by KV overlap, ' +
          'or give the KV cache more blocks so prefixes survive.');
      }
      return make('prefill_compute_bound', 'prefill_execution', prefillShare, 'ttft', b.prefillMs,
        `Prefill ${ms(b.prefillMs)} is ${pct(prefillShare)} of TTFT despite a ${pct(hitRate)} prefix-cache hit: computing ${computed} tokens ` +
        'is the cost. Use chunked prefill so it shares steps with decodes, a faster backend, or disaggregated prefill workers.');
    }

    const kvShare = b.kvTransferMs / ttftBase;
    if (kvShare > t.kvTransferShare && trace.kvTransfer) {
      const kv = trace.kvTransfer;
      const rate = b.kvTransferMs > 0 ? `${bytes(kv.bytes / (b.kvTransferMs / 1000))}/s` : 'n/a';
      const link = kv.fromWorker && kv.toWorker ? ` from ${kv.fromWorker} to ${kv.toWorker}` : '';
      return make('kv_transfer_bound', 'kv_transfer', kvShare, 'ttft', b.kvTransferMs,
        `KV transfer${link} took ${ms(b.kvTransferMs)} (${bytes(kv.bytes)} at ${rate}), ${pct(kvShare)} of TTFT. ` +
        'Pair prefill and decode workers on the same host, use a faster transfer channel, or serve short prompts without disaggregation.');
    }

    if (spike) return make('decode_latency_spike', 'decode_execution', spike.share, 'decode_steps', spike.spikeMs, spike.recommendation);
    if (transferGap) return transferGap;

    const total = Math.max(trace.e2eMs, 1e-9);
    // Every part, as the window's phase_share splits them: routing has no rule of its own, so a request it slowed
    // lands here, and the split must show it; a transfer after the first token is told apart from decode.
    const kvMs = b.kvTransferMs + b.decodeKvTransferMs;
    const kvPart = trace.kvTransfer ? `, KV transfer ${pct(kvMs / total)}` : '';
    return make('balanced', 'none', 0, 'request', 0,
      `No single phase dominates: gateway ${pct(b.gatewayMs / total)}, routing ${pct(b.routingMs / total)}, queue ${pct(b.queueMs / total)}, ` +
      `prefill ${pct(b.prefillMs / total)}${kvPart}, decode ${pct((b.decodeMs - b.decodeKvTransferMs) / total)} of the request.`);
  }

  /**
   * The gateway phases dominate TTFT: named by the one that took longest (its own time: auth and rate_limit run inside
   * http_receive, before the body is read, and are not http_receive's), with what that phase does.
   */
  private gatewayBound(trace: RequestTrace, gatewayMs: number, ttftBase: number, make: Make): Diagnosis<BottleneckCategory> {
    const own = new Map<GatewayPhase, number>();
    const gateway = trace.phases.filter((p) => (GATEWAY_PHASES as readonly string[]).includes(p.phase));
    for (const p of gateway) {
      let msOwn = p.endMs - p.startMs;
      if (p.phase === 'http_receive') {
        for (const q of gateway) {
          if (q.phase === 'auth' || q.phase === 'rate_limit') msOwn -= Math.max(0, Math.min(p.endMs, q.endMs) - Math.max(p.startMs, q.startMs));
        }
      }
      own.set(p.phase as GatewayPhase, (own.get(p.phase as GatewayPhase) ?? 0) + Math.max(0, msOwn));
    }
    let phase: GatewayPhase = 'tokenize';
    let phaseMs = -1;
    for (const name of GATEWAY_PHASES) {
      const x = own.get(name);
      if (x !== undefined && x > phaseMs) [phase, phaseMs] = [name, x];
    }
    phaseMs = Math.max(0, phaseMs);
    const share = phaseMs / ttftBase;
    const why = {
      http_receive: 'receiving the request: its body arrived slowly (a large body, or a slow or distant client), which no ' +
        'server setting shortens. Send smaller requests, or put the client nearer the server.',
      auth: 'checking the API key: the event loop was busy with other work when the request came in. Look for long ' +
        'inline work on the gateway thread (GC pauses, large responses being written).',
      rate_limit: 'the tenant\'s rate-limit check: the event loop was busy with other work when the request came in. ' +
        'Look for long inline work on the gateway thread (GC pauses, large responses being written).',
      validate: 'checking the request\'s fields: a very large request (many messages, tools, stop strings or ' +
        'logit_bias entries) costs here. Send smaller requests.',
      tokenize: `the chat template, a guided request's grammar check and tokenizing the ${trace.promptTokens}-token prompt. ` +
        'A long prompt is tokenized on the model\'s tokenizer thread, one at a time, so it also waits behind other ' +
        'requests\' long prompts. Send shorter prompts or prompt token ids (/v1/completions), keep tool and schema ' +
        'definitions small, or spread long-prompt traffic over more servers.',
    }[phase];
    return make('gateway_bound', phase, share, 'ttft', phaseMs,
      `The gateway took ${ms(gatewayMs)}, ${pct(gatewayMs / ttftBase)} of the ${ms(ttftBase)} TTFT, ${ms(phaseMs)} of it in ${phase}: ${why}`);
  }

  /** Decode dominates without a spike: preempted mid-decode, or every step as slow as its batch makes it. */
  private decodeBound(trace: RequestTrace, decodeMs: number, make: Make, kind: 'preempted' | 'batch'): Diagnosis<BottleneckCategory> | undefined {
    const share = decodeMs / Math.max(trace.e2eMs, 1e-9);
    const decode = trace.decode;
    const steps = decode?.steps ?? 0;
    const perToken = steps > 0 ? decodeMs / steps : decodeMs;
    // After the first token, the chunks that recompute tokens computed before a preemption (not the forced text or a
    // fork's position other chunks after it compute; a recompute before it is a preemption during the prefill).
    const firstToken = trace.engineFirstTokenMs;
    const recomputes = firstToken === undefined ? []
      : trace.phases.filter((p) => p.phase === 'prefill_execution' && p.attributes?.recompute === true && p.startMs >= firstToken);
    if (kind === 'preempted') {
      if (recomputes.length === 0) return undefined;
      let recomputeMs = 0;
      let recomputedTokens = 0;
      for (const p of recomputes) {
        recomputeMs += p.endMs - p.startMs;
        recomputedTokens += Number(p.attributes?.tokens ?? 0);
      }
      return make('decode_preempted', 'decode_execution', share, 'request', decodeMs,
        `Decode took ${ms(decodeMs)} (${pct(share)} of the request) and the request was preempted during it: its KV blocks went to ` +
        `other requests and ${recomputedTokens} tokens were recomputed in ${recomputes.length} chunk(s) (${ms(recomputeMs)}), with ` +
        'waiting in between. Give the KV cache more memory (--kv-cache-memory), lower --max-num-seqs so fewer requests share ' +
        'the pool, or lower max_tokens.');
    }
    if (recomputes.length > 0 || perToken < this.thresholds.slowTbtMs) return undefined;
    const batch = decode?.batch;
    const seqs = batch ? batch.seqsMean : Number.NaN;
    const batchText = Number.isFinite(seqs) ? ` in batches of ${seqs.toFixed(1)} sequences on average (at most ${batch!.seqsMax})` : '';
    const advice = Number.isFinite(seqs) && seqs >= 2
      ? 'Each step carries the whole batch: lower --max-num-seqs for faster tokens per request (at some throughput), or add ' +
        'workers so fewer decodes share each one.'
      : 'The request decoded nearly alone, so the forward pass itself is the cost: a faster backend, more threads per worker, ' +
        'or a smaller or more quantized model.';
    return make('decode_batch_bound', 'decode_execution', share, 'request', decodeMs,
      `Decode took ${ms(decodeMs)}, ${pct(share)} of the request: ${steps} steps at ${ms(perToken)} per token${batchText}, ` +
      `with no step spiking. ${advice}`);
  }

  /**
   * Decode dominates, and its tokens came steadily at a healthy rate: the time is the output's length. What shortens
   * it is fewer tokens (or, a distant second, a faster time per token), not anything before the first token.
   */
  private outputLength(trace: RequestTrace, b: PhaseBreakdown, ttftBase: number, make: Make): Diagnosis<BottleneckCategory> {
    const { decodeMs, gatewayMs, queueMs, prefillMs } = b;
    const share = decodeMs / Math.max(trace.e2eMs, 1e-9);
    const steps = trace.decode?.steps ?? 0;
    const tokens = `${trace.outputTokens} output token${trace.outputTokens === 1 ? '' : 's'}`;
    const pace = steps > 0
      ? `${tokens} in ${steps} steps at ${ms(decodeMs / steps)} per token (under the ${ms(this.thresholds.slowTbtMs)} TBT target), with no step spiking`
      : tokens;
    const limit = trace.maxTokens !== undefined ? `max_tokens (${trace.maxTokens})` : 'max_tokens or the context length';
    const ended = trace.finishReason === 'length' ? `the request ran until its token limit, ${limit}`
      : trace.finishReason === 'stop' ? 'the model ended the answer itself (an end-of-sequence token or a stop sequence)'
        : `the request finished with ${trace.finishReason}`;
    // Where TTFT went, when one part of it crosses the line of its TTFT rule: the lesser cost, but a cost to know of.
    const ttftPart = gatewayMs / ttftBase > this.thresholds.gatewayShare ? `, ${pct(gatewayMs / ttftBase)} of it in the gateway`
      : queueMs / ttftBase > this.thresholds.queueShare ? `, ${pct(queueMs / ttftBase)} of it waiting in the queue`
      : prefillMs / ttftBase > this.thresholds.prefillShare ? `, ${pct(prefillMs / ttftBase)} of it prefill` : '';
    const ttft = trace.ttftMs !== undefined ? ` The first token came after ${ms(trace.ttftMs)}${ttftPart}` : '';
    const firstToken = ttft === '' ? ''
      : trace.stream === false ? `${ttft}: streaming (stream: true) would show it then instead of the whole answer at the end.`
        : `${ttft}.`;
    return make('decode_output_length', 'decode_execution', share, 'request', decodeMs,
      `Decode took ${ms(decodeMs)}, ${pct(share)} of the request: ${pace}. The time is the length of the output, not a slow ` +
      `phase; ${ended}. A lower max_tokens, stop sequences, or a prompt that asks for a shorter answer would shorten it; ` +
      `beyond that only a faster time per token would (a faster backend or a smaller model).${firstToken}`);
  }

  /** The KV transfer when it began at or after the engine's first token (the disaggregated hand-over), else undefined. */
  private transferAfterFirstToken(trace: RequestTrace): { startMs: number; endMs: number } | undefined {
    const kv = trace.kvTransfer;
    const firstToken = trace.engineFirstTokenMs;
    if (!kv || firstToken === undefined || kv.startMs < firstToken || !(kv.endMs > kv.startMs)) return undefined;
    return { startMs: kv.startMs, endMs: kv.endMs };
  }

  /** kv_transfer_bound for a transfer after the first token whose gap was the request's only spike. */
  private transferGap(trace: RequestTrace, transfer: { startMs: number; endMs: number }, spike: Spike, make: Make): Diagnosis<BottleneckCategory> {
    const kv = trace.kvTransfer!;
    const transferMs = transfer.endMs - transfer.startMs;
    const share = transferMs / Math.max(trace.e2eMs, 1e-9);
    const link = kv.fromWorker && kv.toWorker ? ` from ${kv.fromWorker} to ${kv.toWorker}` : '';
    return make('kv_transfer_bound', 'kv_transfer', share, 'request', transferMs,
      `KV transfer${link} took ${ms(transferMs)} (${bytes(kv.bytes)} at ${bytes(kv.bytes / (transferMs / 1000))}/s) after the first token, ` +
      `${pct(share)} of the request: the prefill worker streamed the first token and the decode worker waited for the prompt's KV, ` +
      `so the client waited ${ms(spike.maxStepMs)} for the next token against a median step of ${ms(spike.medianMs)}. ` +
      'Pair prefill and decode workers on the same host, use a faster transfer channel, or serve short prompts without disaggregation.');
  }

  /** A decode spike; with `except`, among the steps that do not overlap that interval (the KV transfer's). */
  private spike(trace: RequestTrace, except?: { startMs: number; endMs: number }): Spike | undefined {
    const t = this.thresholds;
    const all = trace.decode?.stepMs ?? [];
    const steps = except === undefined ? all : all.filter((_, i) => !overlapsStep(trace, i, except));
    if (steps.length < t.minDecodeSteps) return undefined;
    const median = percentile(Float64Array.from(steps).sort(), 0.5); // nearest rank, as every percentile
    let maxStep = 0;
    for (const s of steps) if (s > maxStep) maxStep = s;
    if (!(median > 0) || maxStep <= t.spikeFactor * median || maxStep - median < t.minSpikeExcessMs) return undefined;
    let spikeMs = 0;
    let spikes = 0;
    let total = 0;
    for (const s of steps) {
      total += s;
      if (s > t.spikeCountFactor * median && s - median >= t.minSpikeExcessMs) {
        spikes++;
        spikeMs += s;
      }
    }
    return {
      share: total > 0 ? spikeMs / total : 0,
      spikeMs,
      maxStepMs: maxStep,
      medianMs: median,
      recommendation: `Decode steps spiked: max ${ms(maxStep)} against a median of ${ms(median)}, ${spikes} of ${steps.length} steps over ` +
        `${t.spikeCountFactor}x the median and ${ms(t.minSpikeExcessMs)} or more above it. Look for preemptions (KV cache pressure), long prefill chunks sharing the batch ` +
        '(lower the chunk size), or event-loop and GC pauses.',
    };
  }

  /** Where time goes over a set of requests, and the commonest bottleneck among the slow ones. */
  analyze(traces: Iterable<RequestTrace>, options: WindowOptions = {}): WindowAnalysis {
    const slowTtftMs = options.slowTtftMs ?? 200;
    const slowTbtMs = options.slowTbtMs ?? 50;
    const shareSums = { gateway: 0, routing: 0, queue: 0, prefill: 0, kv_transfer: 0, decode: 0, other: 0 };
    const categories = Object.fromEntries(BOTTLENECK_CATEGORIES.map((c) => [c, 0])) as Record<BottleneckCategory, number>;
    const examples: Partial<Record<BottleneckCategory, string[]>> = {};
    const slowDiagnoses: Diagnosis<BottleneckCategory>[] = [];
    let requests = 0;
    for (const trace of traces) {
      // Failed, refused and aborted requests have no bottleneck (classify) and are left out of the shares too.
      if (trace.outcome !== 'ok') continue;
      requests++;
      const b = phaseBreakdown(trace);
      const total = Math.max(trace.e2eMs, 1e-9);
      // A transfer after the first token is inside decodeMs: its share is told apart, not counted twice.
      const parts = {
        gateway: b.gatewayMs, routing: b.routingMs, queue: b.queueMs, prefill: b.prefillMs,
        kv_transfer: b.kvTransferMs + b.decodeKvTransferMs, decode: b.decodeMs - b.decodeKvTransferMs,
      };
      let attributed = 0;
      for (const [k, v] of Object.entries(parts)) {
        shareSums[k as keyof typeof parts] += v / total;
        attributed += v;
      }
      shareSums.other += Math.max(0, total - attributed) / total;
      // A loop, not Math.max(...gaps): spread as arguments, a stream of some 125 000 tokens overflows the stack.
      let worstTbt = 0;
      for (const gap of trace.tbtMs) if (gap > worstTbt) worstTbt = gap;
      // Slow by time between tokens too: the worst gap the client saw, or (no stream) the engine's time per token.
      const perToken = trace.decode && trace.decode.steps > 0 ? (trace.decode.endMs - trace.decode.startMs) / trace.decode.steps : 0;
      // Each request against its own model's targets (SLO objectives can be set per model), as the
      // slow-request counter of /metrics judges it.
      const targets = options.targetsFor?.(trace.model) ?? { ttftMs: slowTtftMs, tbtMs: slowTbtMs };
      const slow = (trace.ttftMs ?? 0) >= targets.ttftMs || worstTbt >= targets.tbtMs || perToken >= targets.tbtMs;
      if (!slow) continue;
      const d = this.bottleneck(trace);
      slowDiagnoses.push(d);
      categories[d.category]++;
      const list = (examples[d.category] ??= []);
      if (list.length < 3) list.push(trace.requestId);
    }
    const phase_share = Object.fromEntries(
      Object.entries(shareSums).map(([k, v]) => [k, requests > 0 ? round3(v / requests) : 0]),
    ) as WindowAnalysis['phase_share'];
    let primary: BottleneckCategory = 'balanced';
    let best = 0;
    for (const c of BOTTLENECK_CATEGORIES) {
      // The commonest named bottleneck; 'balanced' only when it outnumbers every named one.
      if (c !== 'balanced' && categories[c] > best) [primary, best] = [c, categories[c]];
    }
    if (categories.balanced > best) primary = 'balanced';
    const representative = slowDiagnoses.find((d) => d.category === primary);
    const recommendation = slowDiagnoses.length === 0
      ? 'No slow requests in the window.'
      : representative?.recommendation ?? 'No single bottleneck dominates the slow requests.';
    return {
      requests, slow_requests: slowDiagnoses.length, slow_ttft_ms: slowTtftMs, slow_tbt_ms: slowTbtMs,
      phase_share, categories, primary_bottleneck: primary, recommendation, examples,
    };
  }
}

interface Spike { share: number; spikeMs: number; maxStepMs: number; medianMs: number; recommendation: string }

/** Whether the i-th decode step (its gap, for steps read from the stream) overlaps `interval`. */
function overlapsStep(trace: RequestTrace, i: number, interval: { startMs: number; endMs: number }): boolean {
  const start = trace.decode?.stepStartsMs[i];
  const length = trace.decode?.stepMs[i];
  return start !== undefined && length !== undefined && start < interval.endMs && start + length > interval.startMs;
}

type Make = (category: BottleneckCategory, phase: PhaseName | 'none', share: number, shareOf: ShareBase, dominantMs: number,
  recommendation: string) => Diagnosis<BottleneckCategory>;

export interface WindowOptions {
  /** A request is slow when its TTFT reaches this (default 200 ms, the TTFT target)... */
  slowTtftMs?: number;
  /** ...or when one of its token gaps reaches this (default 50 ms, the TBT target). */
  slowTbtMs?: number;
  /** A model's own targets, in place of the two above, for a model whose SLO objectives differ. */
  targetsFor?: (model: string) => { ttftMs: number; tbtMs: number };
}

export interface WindowAnalysis {
  requests: number;
  slow_requests: number;
  slow_ttft_ms: number;
  slow_tbt_ms: number;
  /** Mean share of end-to-end time per part, over all finished requests in the window. */
  phase_share: { gateway: number; routing: number; queue: number; prefill: number; kv_transfer: number; decode: number; other: number };
  /** Slow requests per bottleneck. */
  categories: Record<BottleneckCategory, number>;
  primary_bottleneck: BottleneckCategory;
  recommendation: string;
  /** Up to three request ids per category, for GET /v1/requests/{id}/trace. */
  examples: Partial<Record<BottleneckCategory, string[]>>;
}

