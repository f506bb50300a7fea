// Conditional disaggregation: for one request, prefill on a prefill worker and move the KV, or let the decode worker
// prefill it itself. Pure: the inputs are the routers' decisions and throughput estimates, the output the choice and
// its reason, which goes on every output of the request (RoutingSummary.disaggregation).
//
// A remote prefill pays off when it keeps long prefills out of the decode batch (every running request's next token
// waits for a prefill step sharing its batch) at a lower price than computing them there. It does not when:
//   short-prompt        the decode worker lacks only a few prompt tokens (it holds the prefix, or the prompt is
//                       short): computing them costs about one decode step, less than the round trip; blocks it
//                       holds in its RAM or disk tier count at what copying them back costs, not as computed;
//   prefill-queue-full  the prefill worker the router would pick has more prefill queued than the bound, or every
//                       prefill worker is busy: waiting there would cost more time to first token than it saves;
//   transfer-slower     moving the KV blocks the decode worker lacks would take longer than computing them there
//                       (weighed unless compareTransfer is off: then, as Dynamo's conditional disaggregation, a prompt
//                       past the short-prompt bound goes to a prefill worker whenever one has room).
// (Besides those, a request with n > 1 samples is never handed over: its samples share the prompt's blocks.)
//
// The transfer estimate is learned only from transfers that happen, so a too-pessimistic one would keep every
// prompt local for good (nothing measures the link again). TransferProbe says when a request that would be
// transfer-slower goes remote anyway (transfer-probe) to measure it.

import type { DisaggregationReason, DisaggregationSummary } from '../engine/types.ts';
import { DEFAULT_LOWER_TIER_WEIGHT } from '../router/cost.ts';

export interface DisaggregationPolicy {
  /** Fewer uncached prompt tokens on the decode worker than this: prefill there (default 512). */
  minRemotePrefillTokens: number;
  /** More prefill tokens than this queued on the chosen prefill worker: prefill on the decode worker (default 16384). */
  maxPrefillQueueTokens: number;
  /** Fixed cost of one transfer besides its bytes (messages, allocation, registration), ms (default 0.2). */
  transferOverheadMs: number;
  /**
   * Weigh the transfer's estimated time against a local prefill (transfer-slower). Off: the estimates decide
   * nothing, and remote prefill is chosen by the prompt's length and the prefill queue alone (default true).
   */
  compareTransfer: boolean;
}

export const DEFAULT_DISAGGREGATION_POLICY: Readonly<DisaggregationPolicy> = Object.freeze({
  minRemotePrefillTokens: 512,
  maxPrefillQueueTokens: 16_384,
  transferOverheadMs: 0.2,
  compareTransfer: true,
});

/** Transfer-slower decisions in a row before the first probe of the link (TransferProbe). */
export const DEFAULT_TRANSFER_PROBE_INTERVAL = 8;

/** How far probes back off: at most interval x this many transfer-slower decisions between two. */
export const TRANSFER_PROBE_MAX_BACKOFF = 32;

export interface DisaggregationInputs {
  numPromptTokens: number;
  blockSize: number;
  /** Why the request can never be handed over (e.g. n > 1); absent when it can. */
  ineligible?: string;
  decodeWorkerId: string;
  /** Leading prompt blocks the decode worker holds (the decode router's overlap). */
  decodeOverlapBlocks: number;
  /**
   * Leading prompt blocks the decode worker holds, up to the whole prompt (WorkerCostTerms.heldBlocks): a transfer
   * moves none of them, not even the last block of a fully cached prompt, which a local prefill recomputes.
   * Default: decodeOverlapBlocks.
   */
  decodeHeldBlocks?: number;
  /**
   * Prompt blocks right after decodeOverlapBlocks the decode worker holds only in its RAM or disk tier, and how many
   * of them only on disk (WorkerCostTerms.lowerTierBlocks, lowerTierDiskBlocks). A local prefill copies them back
   * instead of computing them, at a fraction of the price (DEFAULT_LOWER_TIER_WEIGHT, as the router weighs them). A
   * transfer moves them all the same: an adoption imports every block past the decode worker's primary hits.
   */
  decodeLowerTierBlocks?: { blocks: number; disk: number };
  /** The prefill worker the prefill router would pick and its queue, or null when none is available. */
  prefill: { workerId: string; queuedPrefillTokens: number } | null;
  /** KV bytes of one token in the pools (every layer's K and V). */
  kvBytesPerToken: number;
  /** Estimated transfer throughput, bytes per second. */
  transferBytesPerSec: number;
  /** Estimated prefill throughput of the decode worker, tokens per second. */
  prefillTokensPerSec: number;
  /**
   * The transfer estimate is due a measurement (TransferProbe.due): a request that would be transfer-slower is
   * prefilled remotely instead, as transfer-probe. The other reasons for a local prefill still apply.
   */
  probeTransfer?: boolean;
}

export function decideDisaggregation(inputs: DisaggregationInputs, policy: DisaggregationPolicy = DEFAULT_DISAGGREGATION_POLICY): DisaggregationSummary {
  const { numPromptTokens, blockSize } = inputs;
  // The decode worker's hits are whole blocks, and the last prompt token is always computed (it gives the logits),
  // so at most floor((n - 1) / blockSize) blocks are spared locally; remotely, every block it lacks moves.
  const localHitBlocks = Math.max(0, Math.min(inputs.decodeOverlapBlocks, Math.floor((numPromptTokens - 1) / blockSize)));
  const uncachedTokens = numPromptTokens - localHitBlocks * blockSize;
  // Of those, the ones a local prefill copies back from a lower tier: what computing the rest and copying them costs,
  // in tokens of prefill, is the local work.
  const lower = inputs.decodeLowerTierBlocks;
  const onboardBlocks = Math.max(0, Math.min(lower?.blocks ?? 0, Math.floor((numPromptTokens - 1) / blockSize) - localHitBlocks));
  const diskBlocks = Math.max(0, Math.min(lower?.disk ?? 0, onboardBlocks));
  const onboardTokens = onboardBlocks * blockSize;
  const localWorkTokens = uncachedTokens - onboardTokens
    + ((onboardBlocks - diskBlocks) * DEFAULT_LOWER_TIER_WEIGHT.ram + diskBlocks * DEFAULT_LOWER_TIER_WEIGHT.disk) * blockSize;
  const heldBlocks = Math.max(0, Math.min(inputs.decodeHeldBlocks ?? inputs.decodeOverlapBlocks, Math.floor(numPromptTokens / blockSize)));
  const transferBlocks = Math.ceil(numPromptTokens / blockSize) - heldBlocks;
  const transferBytes = transferBlocks * blockSize * inputs.kvBytesPerToken;
  const estimatedTransferMs = policy.transferOverheadMs + (transferBytes / Math.max(1, inputs.transferBytesPerSec)) * 1000;
  const estimatedPrefillMs = (localWorkTokens / Math.max(1e-9, inputs.prefillTokensPerSec)) * 1000;
  const summary = (mode: DisaggregationSummary['mode'], reason: DisaggregationReason, detail: string): DisaggregationSummary => ({
    mode, reason, detail, prefillWorkerId: mode === 'disaggregated' ? inputs.prefill?.workerId : undefined,
    decodeWorkerId: inputs.decodeWorkerId, uncachedTokens, transferBlocks, estimatedTransferMs, estimatedPrefillMs,
  });
  const ms = (value: number) => `${value.toFixed(3)} ms`;

  if (inputs.ineligible !== undefined) return summary('local', 'not-eligible', inputs.ineligible);
  if (localWorkTokens < policy.minRemotePrefillTokens) {
    const copied = onboardTokens === 0 ? ''
      : `, ${onboardTokens} of them in its RAM or disk tier (the work of ~${Math.round(localWorkTokens)} to compute)`;
    return summary('local', 'short-prompt', `${uncachedTokens} uncached prompt tokens on ${inputs.decodeWorkerId}${copied} `
      + `< ${policy.minRemotePrefillTokens}`);
  }
  if (inputs.prefill === null) return summary('local', 'prefill-queue-full', 'no prefill worker available (all busy or gone)');
  if (inputs.prefill.queuedPrefillTokens > policy.maxPrefillQueueTokens) {
    return summary('local', 'prefill-queue-full', `${inputs.prefill.queuedPrefillTokens} prefill tokens queued on `
      + `${inputs.prefill.workerId} > ${policy.maxPrefillQueueTokens}`);
  }
  const transferSlower = policy.compareTransfer && estimatedTransferMs >= estimatedPrefillMs;
  if (transferSlower && inputs.probeTransfer === true) {
    return summary('disaggregated', 'transfer-probe', `${uncachedTokens} uncached tokens on ${inputs.prefill.workerId} `
      + `to measure the link: ${transferBlocks} blocks estimated at ~${ms(estimatedTransferMs)} to move >= `
      + `~${ms(estimatedPrefillMs)} to prefill locally`);
  }
  if (transferSlower) {
    return summary('local', 'transfer-slower', `moving ${transferBlocks} blocks ~${ms(estimatedTransferMs)} >= `
      + `prefilling ${uncachedTokens} tokens ~${ms(estimatedPrefillMs)}`);
  }
  return summary('disaggregated', 'remote-prefill', `${uncachedTokens} uncached tokens on ${inputs.prefill.workerId}, `
    + `${transferBlocks} blocks ~${ms(estimatedTransferMs)} to move vs ~${ms(estimatedPrefillMs)} to prefill locally`);
}

/**
 * When a transfer-slower verdict is tested by a transfer (transfer-probe). Only a transfer measures the link, and
 * only a remote prefill makes one: without probes a transfer estimate too low for the link would keep every prompt
 * local however fast the link is. After `interval` transfer-slower decisions in a row, the next one becomes a
 * probe; a probe doubles the wait before the next (up to TRANSFER_PROBE_MAX_BACKOFF x interval), so a link that
 * really is slower costs fewer and fewer probes; a remote-prefill decision (the estimates now favour moving the KV,
 * which measures the link anyway) starts over. Decisions for other reasons leave it as it is.
 */
export class TransferProbe {
  private streak = 0;
  private wait: number;

  /** interval 0: never due. */
  constructor(private readonly interval: number) {
    if (!Number.isInteger(interval) || interval < 0) throw new RangeError(`the probe interval must be a whole number >= 0, got ${interval}`);
    this.wait = interval;
  }

  /** Whether the next request that would be transfer-slower goes remote to measure the link. */
  get due(): boolean {
    return this.interval > 0 && this.streak >= this.wait;
  }

  /** Transfer-slower decisions since the last probe or remote prefill, and how many make the next probe due. */
  get state(): { streak: number; wait: number } {
    return { streak: this.streak, wait: this.wait };
  }

  /** Takes one decision's reason into account. */
  record(reason: DisaggregationReason): void {
    if (reason === 'transfer-slower') {
      this.streak++;
    } else if (reason === 'transfer-probe') {
      this.streak = 0;
      this.wait = Math.min(this.wait * 2, this.interval * TRANSFER_PROBE_MAX_BACKOFF);
    } else if (reason === 'remote-prefill') {
      this.streak = 0;
      this.wait = this.interval;
    }
  }
}

/**
 * A throughput learned from observations: an exponentially weighted mean of rates, starting from a prior. Pure;
 * the caller passes amounts and durations it measured.
 */
export class RateEstimate {
  private rate: number;

  constructor(prior: number, private readonly weight = 0.2, private readonly fixed = false) {
    if (!(prior > 0) || !Number.isFinite(prior)) throw new RangeError(`prior rate must be a positive finite number, got ${prior}`);
    this.rate = prior;
  }

  /** amount (bytes, tokens) done in durationMs; ignored when too small to time (under 1 µs) or the estimate is fixed. */
  observe(amount: number, durationMs: number): void {
    if (this.fixed || !(amount > 0) || !(durationMs >= 1e-3)) return;
    this.rate += this.weight * ((amount / durationMs) * 1000 - this.rate);
  }

  /** Per second. */
  get perSec(): number {
    return this.rate;
  }
}
