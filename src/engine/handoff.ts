// Disaggregated prefill/decode, the engine's part: what travels from a prefill worker to a decode worker, and the
// copy of KV block runs between their pools.
//
// Two halves, as everywhere in the engine:
//   scheduler side  Scheduler.handOff picks the blocks that hold a request's KV (pinned until copied) and their
//                   hashes; Scheduler.adoptRequest on the other worker finds its own prefix-cache hits, allocates the
//                   rest and registers them. The KvHandoff below is that metadata plus the sampler's state, so
//                   sampling continues as if the request had never moved.
//   worker side     copyKvBlocks (shared memory: one typed-array set() per run, no serialisation) and the
//                   readKvBlocks / writeKvBlocks pair (copy out to bytes, copy in from bytes) for a channel that
//                   has to ship bytes, such as a future TCP one.
//
// Pool layout (src/kernels/types.ts KvPoolLayout): element (layer, kv, block, slot, head, d). One block of one
// layer's K (or V) is a contiguous run, so a block is 2 * numLayers runs; consecutive block ids in one (layer, kv)
// plane are contiguous too, and copies merge them into one run.

import { WIDE_CANDIDATES } from './grammar/sampling.ts';
import { AsyncQueue } from './streams.ts';
import { kvElementsPerBlockRun, type KvPoolLayout } from '../kernels/types.ts';
import type { KvCacheManager, KvPin } from './kv-cache/manager.ts';

export type { KvPoolLayout };
import type { BlockHash } from '../protocols/kv-events.ts';
import { isBlockHash } from '../protocols/kv-events.ts';
import type { EngineOutput, EngineRequest, RequestTimestamps } from './types.ts';

// ---------------------------------------------------------------------------------------------------------------
// The handoff descriptor

/**
 * Everything a decode worker needs to continue a request a prefill worker started. Plain data: it crosses threads
 * by structured clone. Serialization note for a byte channel: request.sampling.logitBias is a Map, which JSON
 * drops; encode it as entries.
 */
export interface KvHandoff {
  requestId: string;
  /** The request as the prefill worker ran it; sampling.seed is always set (drawn there if the client gave none). */
  request: EngineRequest;
  /**
   * Tokens the prefill worker produced (the first token, then with jump-forward the tokens its grammar forced after
   * it; the caller has already been sent them).
   */
  outputTokenIds: number[];
  /** Positions whose KV the source blocks hold: the prompt (the output tokens are not computed yet). */
  numComputedTokens: number;
  blockSize: number;
  /** Source pool block ids in position order, blocksFor(numComputedTokens) of them; the last may be partial. */
  sourceBlockIds: number[];
  /** Chained hashes of the full blocks, which the decode worker's own hashes must equal. */
  blockHashes: BlockHash[];
  /**
   * The sequence's random stream: its seed, and its state after the tokens above (checked after replay). A guided
   * request's also carries how its next row is to be tried (GuidedSequence.candidateWidth, argmaxTaken): a sampled
   * row's width decides which draws it makes, so the decode worker continues the prefill worker's choices exactly.
   */
  sampler: { seed: number; rngState: [number, number, number, number]; guided?: { candidateWidth: number; argmaxTaken: boolean } };
  /** Prompt tokens the prefill worker took from its prefix cache (usage.cachedTokens). */
  numCachedTokens: number;
  timestamps: RequestTimestamps;
  /** Shape of the source pool; the destination's must match in everything but numBlocks. */
  sourceLayout: KvPoolLayout;
  /** Engine-clock time the prefill worker pinned the blocks. */
  createdMs: number;
}

/** Checks a handoff received from outside (another thread today, another process later) before acting on it. */
export function validateHandoff(value: unknown): KvHandoff {
  const fail = (what: string): never => {
    throw new TypeError(`invalid KV handoff: ${what}`);
  };
  if (typeof value !== 'object' || value === null) fail('not an object');
  const h = value as KvHandoff;
  if (typeof h.requestId !== 'string' || h.requestId.length === 0) fail('requestId must be a non-empty string');
  if (typeof h.request !== 'object' || h.request === null || h.request.id !== h.requestId) fail('request must be the request with requestId');
  if (!Number.isSafeInteger(h.request.sampling?.seed)) fail('request.sampling.seed must be set');
  const tokenList = (list: unknown, name: string) => {
    if (!Array.isArray(list) || list.some((t) => !Number.isInteger(t) || t < 0)) fail(`${name} must be token ids`);
  };
  tokenList(h.outputTokenIds, 'outputTokenIds');
  if (h.outputTokenIds.length === 0) fail('outputTokenIds must hold the first token');
  if (!Number.isSafeInteger(h.blockSize) || h.blockSize < 1) fail('blockSize must be a positive integer');
  const numTokens = h.request.promptTokenIds.length + h.outputTokenIds.length;
  if (!Number.isSafeInteger(h.numComputedTokens) || h.numComputedTokens < 0 || h.numComputedTokens >= numTokens) {
    fail(`numComputedTokens must be in [0, ${numTokens}), got ${h.numComputedTokens}`);
  }
  const numBlocks = Math.ceil(h.numComputedTokens / h.blockSize);
  if (!Array.isArray(h.sourceBlockIds) || h.sourceBlockIds.length !== numBlocks
    || h.sourceBlockIds.some((id) => !Number.isInteger(id) || id < 0 || id >= h.sourceLayout.numBlocks)) {
    fail(`sourceBlockIds must be ${numBlocks} block ids of the source pool`);
  }
  if (!Array.isArray(h.blockHashes) || h.blockHashes.length !== Math.floor(h.numComputedTokens / h.blockSize)
    || !h.blockHashes.every(isBlockHash)) {
    fail('blockHashes must hold one hash per full block');
  }
  if (!Array.isArray(h.sampler?.rngState) || h.sampler.rngState.length !== 4) fail('sampler.rngState must be 4 words');
  if (h.sampler.seed !== h.request.sampling.seed) fail('sampler.seed must equal request.sampling.seed');
  const guided = h.sampler.guided;
  if (guided !== undefined && (typeof guided !== 'object' || guided === null || !Number.isInteger(guided.candidateWidth)
    || guided.candidateWidth < 1 || guided.candidateWidth > WIDE_CANDIDATES || typeof guided.argmaxTaken !== 'boolean')) {
    fail(`sampler.guided must be { candidateWidth: 1..${WIDE_CANDIDATES}, argmaxTaken: boolean }`);
  }
  if (h.sourceLayout.blockSize !== h.blockSize) fail('sourceLayout.blockSize must equal blockSize');
  return h;
}

/** Bytes of KV one token takes in a pool of this layout (every layer's K and V). */
export function kvBytesPerToken(layout: Omit<KvPoolLayout, 'numBlocks'>): number {
  return 2 * layout.numLayers * layout.numKvHeads * layout.headDim * bytesPerElement(layout);
}

/** Bytes of one block of one layer's K or V. */
export function kvBlockRunBytes(layout: KvPoolLayout): number {
  return kvElementsPerBlockRun(layout) * bytesPerElement(layout);
}

/** Bytes of one whole block: 2 * numLayers runs. */
export function kvBlockBytes(layout: KvPoolLayout): number {
  return 2 * layout.numLayers * kvBlockRunBytes(layout);
}

function bytesPerElement(layout: { dtype: KvPoolLayout['dtype'] }): number {
  return layout.dtype === 'f32' ? 4 : 2;
}

/** What prepareKvImport did: the leading blocks held from the prefix cache, and where the rest is to be written. */
export interface KvImportPreparation {
  /** Identifies this preparation: releaseKvImport of an older one for the same request does nothing. */
  ticket: number;
  /** Leading blocks of the prompt this pool holds cached, now pinned: they need not move. */
  held: number;
  /** Blocks reserved for the rest, in position order (from block `held` on); null when the pool has too few free. */
  blockIds: number[] | null;
}

/**
 * The source id of an adoption whose KV was written in place, into the blocks the decode worker's engine reserved
 * for it (LocalEngine.prepareKvImport): nothing is copied. No attached pool may be named so.
 */
export const KV_IN_PLACE_SOURCE = 'in-place';

/**
 * Throws unless KV copied block for block from `source` means the same in `destination` (numBlocks may differ).
 * Each worker resolves --kv-cache-dtype auto by its own backend (resolveKvDtype), so a prefill and a decode worker
 * left at auto agree whenever their backends do.
 */
export function checkKvLayoutsMatch(source: KvPoolLayout, destination: KvPoolLayout): void {
  for (const key of ['numLayers', 'blockSize', 'numKvHeads', 'headDim', 'dtype'] as const) {
    if (source[key] !== destination[key]) {
      throw new Error(`KV pools differ in ${key} (source ${source[key]}, destination ${destination[key]}): `
        + 'prefill and decode workers must run the same model with the same block size and KV dtype');
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Plans and stats

/** Which blocks move for one request: the scheduler's decision on the decode side, before any byte is copied. */
export interface KvTransferPlan {
  requestId: string;
  /** Blocks of the request found in the decode worker's own prefix cache: not moved. */
  numReusedBlocks: number;
  /** Source and destination block ids of the blocks that move, pairwise. */
  sourceBlockIds: number[];
  destinationBlockIds: number[];
  bytes: number;
}

/** One completed transfer, measured by the worker that did it. */
export interface KvTransferStats {
  requestId: string;
  /** Which prefill worker the blocks came from. */
  sourceId: string;
  /** 'shared-memory', 'simulated', 'tcp', 'shm' (worker processes on one host), ... */
  channel: string;
  blocks: number;
  reusedBlocks: number;
  bytes: number;
  /** Contiguous copies after merging adjacent blocks. */
  runs: number;
  /** Engine clock, ms. */
  startMs: number;
  endMs: number;
  ms: number;
  /** bytes / ms / 1e6 (decimal GB per second); 0 when nothing moved. */
  gbPerSec: number;
  /**
   * A transfer streamed during the prefill (worker processes): the link's busy time before the prefill ended,
   * hidden behind it (ms above counts only what came after), and the hidden share of all the busy time.
   */
  overlapMs?: number;
  hiddenShare?: number;
}

/** The link label of a channel in traces and metrics: 'shm' for shared memory, else the channel's name (tcp, simulated). */
export function kvLinkName(channel: string): string {
  return channel === 'shared-memory' ? 'shm' : channel;
}

export function transferStats(plan: KvTransferPlan, sourceId: string, channel: string, runs: number, startMs: number,
  endMs: number): KvTransferStats {
  const ms = Math.max(0, endMs - startMs);
  return {
    requestId: plan.requestId, sourceId, channel, blocks: plan.sourceBlockIds.length, reusedBlocks: plan.numReusedBlocks,
    bytes: plan.bytes, runs, startMs, endMs, ms, gbPerSec: ms > 0 ? plan.bytes / ms / 1e6 : 0,
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Worker side: copying block runs

/** One worker's pool as a transfer sees it. */
export interface KvPoolView {
  pool: SharedArrayBuffer;
  layout: KvPoolLayout;
}

/** Byte views are made once per pool rather than once per copy. */
const byteViews = new WeakMap<SharedArrayBuffer, Uint8Array>();

function bytesOf(pool: SharedArrayBuffer): Uint8Array {
  let view = byteViews.get(pool);
  if (view === undefined) byteViews.set(pool, view = new Uint8Array(pool));
  return view;
}

function checkIds(ids: readonly number[], layout: KvPoolLayout, which: string): void {
  for (const id of ids) {
    if (!Number.isInteger(id) || id < 0 || id >= layout.numBlocks) throw new RangeError(`${which} block id ${id} is outside the pool (${layout.numBlocks} blocks)`);
  }
}

/** Pairs of [source, destination, count]: consecutive ids on both sides merge into one run per plane. */
function mergeRuns(sourceIds: readonly number[], destinationIds: readonly number[]): [number, number, number][] {
  const runs: [number, number, number][] = [];
  for (let i = 0; i < sourceIds.length; i++) {
    const last = runs[runs.length - 1];
    if (last && sourceIds[i] === last[0] + last[2] && destinationIds[i] === last[1] + last[2]) last[2]++;
    else runs.push([sourceIds[i]!, destinationIds[i]!, 1]);
  }
  return runs;
}

/**
 * Copies blocks sourceIds[i] of `source` into destinationIds[i] of `destination`, every layer's K and V, pool to
 * pool: the in-process transfer. Returns the bytes moved and the number of set() calls. Both pools are shared
 * memory, so the copy reads the prefill worker's pool directly; the caller guarantees the source blocks are pinned
 * (nobody writes them) for the duration.
 */
export function copyKvBlocks(source: KvPoolView, destination: KvPoolView, sourceIds: readonly number[],
  destinationIds: readonly number[]): { bytes: number; runs: number } {
  if (sourceIds.length !== destinationIds.length) throw new RangeError(`${sourceIds.length} source blocks for ${destinationIds.length} destinations`);
  checkKvLayoutsMatch(source.layout, destination.layout);
  checkIds(sourceIds, source.layout, 'source');
  checkIds(destinationIds, destination.layout, 'destination');
  const from = bytesOf(source.pool);
  const to = bytesOf(destination.pool);
  const runBytes = kvBlockRunBytes(source.layout);
  const planes = 2 * source.layout.numLayers;
  const merged = mergeRuns(sourceIds, destinationIds);
  for (let plane = 0; plane < planes; plane++) {
    const sourcePlane = plane * source.layout.numBlocks * runBytes;
    const destinationPlane = plane * destination.layout.numBlocks * runBytes;
    for (const [sourceId, destinationId, count] of merged) {
      const at = sourcePlane + sourceId * runBytes;
      to.set(from.subarray(at, at + count * runBytes), destinationPlane + destinationId * runBytes);
    }
  }
  return { bytes: sourceIds.length * planes * runBytes, runs: merged.length * planes };
}

/**
 * Copy out: the KV of `blockIds`, block after block, each block its 2 * numLayers runs in plane order. A byte
 * channel sends this; writeKvBlocks is its inverse on the receiving worker.
 */
export function readKvBlocks(source: KvPoolView, blockIds: readonly number[]): Uint8Array {
  checkIds(blockIds, source.layout, 'source');
  const from = bytesOf(source.pool);
  const runBytes = kvBlockRunBytes(source.layout);
  const planes = 2 * source.layout.numLayers;
  const out = new Uint8Array(blockIds.length * planes * runBytes);
  let offset = 0;
  for (const id of blockIds) {
    for (let plane = 0; plane < planes; plane++) {
      const at = (plane * source.layout.numBlocks + id) * runBytes;
      out.set(from.subarray(at, at + runBytes), offset);
      offset += runBytes;
    }
  }
  return out;
}

/** Copy in: writes bytes laid out as readKvBlocks makes them into `blockIds` of the destination pool. */
export function writeKvBlocks(destination: KvPoolView, blockIds: readonly number[], bytes: Uint8Array): void {
  checkIds(blockIds, destination.layout, 'destination');
  const runBytes = kvBlockRunBytes(destination.layout);
  const planes = 2 * destination.layout.numLayers;
  if (bytes.length !== blockIds.length * planes * runBytes) {
    throw new RangeError(`${bytes.length} bytes for ${blockIds.length} blocks of ${planes * runBytes} bytes`);
  }
  const to = bytesOf(destination.pool);
  let offset = 0;
  for (const id of blockIds) {
    for (let plane = 0; plane < planes; plane++) {
      to.set(bytes.subarray(offset, offset + runBytes), (plane * destination.layout.numBlocks + id) * runBytes);
      offset += runBytes;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Engine faces

/**
 * The prefill side's handoffs: made by a step, taken by the worker loop that sends them, and their blocks pinned
 * until the decode worker has copied them (or given up on them). The real and the simulated engines share it.
 */
export class HandoffOutbox {
  private readonly parked = new Map<string, KvPin>();
  private made: KvHandoff[] = [];

  constructor(private readonly kv: KvCacheManager) {}

  /** A handoff to send, its request's blocks held by `pin` meanwhile. */
  add(handoff: KvHandoff, pin: KvPin): void {
    this.parked.set(handoff.requestId, pin);
    this.made.push(handoff);
  }

  /** Handoffs made since the last call, in order. */
  take(): KvHandoff[] {
    const made = this.made;
    this.made = [];
    return made;
  }

  /** The decode worker has the blocks (or gave up on them): unpin them. False if nothing was pinned for the request. */
  release(requestId: string): boolean {
    const pin = this.parked.get(requestId);
    if (pin === undefined) return false;
    this.parked.delete(requestId);
    this.kv.unpin(pin);
    return true;
  }

  /** Handed-off requests whose blocks are still pinned here. */
  get numParked(): number {
    return this.parked.size;
  }
}

/**
 * A prefill to hand off, after a step: the blocks whose KV is complete (every position computed), in position order,
 * or null when it was preempted (blocks reported before may be rewritten). The KV transfer streams these blocks to
 * the decode worker while the rest of the prompt computes.
 */
export interface PrefillProgress {
  requestId: string;
  fullBlockIds: number[] | null;
}

/** What a prefill worker's stream yields: the request's outputs (the first token), then the handoff. */
export type PrefillEvent =
  | { type: 'output'; output: EngineOutput }
  | { type: 'handoff'; handoff: KvHandoff };

/**
 * How a decode worker took a handed-off request: 'imported' (the KV was copied in; transfer says how much and how
 * fast) or 'recompute' (no usable source: the prompt is recomputed here, `error` says why). Either way the source
 * blocks are no longer needed.
 */
export interface AdoptedResult {
  requestId: string;
  status: 'imported' | 'recompute';
  transfer?: KvTransferStats;
  error?: string;
}

/**
 * A prefill worker's stream of one request, as its engine face hands it out: outputs pushed as steps end, then
 * the handoff; pulled by an async iterator. Ends after the handoff, or after an output with a finish reason.
 */
export class PrefillStream extends AsyncQueue<PrefillEvent> {
  pushOutput(output: EngineOutput): void {
    this.push({ type: 'output', output });
    if (output.finishReason !== undefined) this.end();
  }

  pushHandoff(handoff: KvHandoff): void {
    this.push({ type: 'handoff', handoff });
    this.end();
  }
}
