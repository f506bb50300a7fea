// KV blocks between worker processes over a direct connection: the byte channel for disaggregated prefill and
// decode when the two workers are separate processes (src/runtime/kv-transfer.ts has the in-process ones). Neither
// NATS nor the frontend carries a byte of KV.
//
// The shape is NIXL's: the decode side has allocated the destination blocks and sends the prefill side a
// descriptor (the request, which destination blocks, which layers, and for a pull which source blocks); the prefill
// side writes the blocks into those destinations, layer by layer, K then V, consecutive blocks merged into one run.
// Only the blocks the decode worker lacks are named in the descriptor, so only they move.
//
// Two ways to ask:
//   pull    after the handoff: the decode side names the source blocks (the handoff's) and gets them all at once.
//   stream  as soon as the request is placed, before its prefill has run: the decode side names the destinations
//           of every block of the prompt from firstBlock on (those before it it holds cached), and the prefill side
//           sends each of them as soon as the prefill has computed
//           it (every layer of each finished chunk, while the next chunk computes), the rest after the handoff, and
//           then which source blocks they were. Most of the transfer hides behind the prefill (kv-done says how
//           much: the link's busy time before the handoff).
//
// Two links, chosen per transfer: 'tcp' (the bytes follow their run headers on this connection) and 'shm' (both
// workers on one host: the bytes go through a ring in shared memory that the connection keeps, src/cluster/kv-shm.ts,
// and only the headers come over the connection, each the doorbell of its run). The decode side announces its host
// id; the prefill side picks shm when the ids match and neither side is set to tcp (--kv-transfer-link tcp,
// CONDUIT_KV_TRANSFER_LINK=tcp), and says which in kv-link.
//
// Connections are kept alive between a worker pair: the decode side keeps the ones whose transfer ended cleanly
// (up to MAX_IDLE_PER_PEER per prefill worker, IDLE_MS each) and sends its next descriptor on one of them, so a
// transfer is one descriptor and its bytes (no connection, no hello), and a shared-memory ring, once mapped, serves
// every transfer of its connection. One transfer at a time per connection; concurrent transfers take more
// connections. A transfer that fails or is cancelled closes its connection (nothing of it can arrive on another).
//
// Wire, version 5 (both directions in frames: 4-byte big-endian length, kind byte, payload; the control messages
// other than kv-hello and kv-error are binary, kind FRAME_KV_CONTROL, their layout in src/cluster/kv-wire.ts):
//   decode -> prefill  JSON  {t: 'kv-hello', v, token}             once per connection; the cluster token, compared
//                                                                    in constant time
//   decode -> prefill  CTRL  pull (requestId, layers [from, to), hostId?, source and destination block ids)
//                         or stream (requestId, layers, hostId?, firstBlock, destination block ids)
//   prefill -> decode  CTRL  link (tcp | shm, and for shm the ring's file and size)
//   prefill -> decode  RUN   header (24 bytes) + bytes                 (tcp), one per (layer, K|V, merged run;
//                                                                      a run over 256 KiB goes as several)
//                      SHM   header (24 bytes) + ring position (8 bytes) (shm: the bytes are at position mod size)
//   decode -> prefill  CTRL  credit (upTo)                           (shm) the ring is free up to this position
//   prefill -> decode  CTRL  done (runs, bytes, overlapMs, source block ids) | JSON {t: 'kv-error', reason}
//   ... then the next descriptor on the same connection, or the connection closes.
// A run header: layer u16, kv u8 (0 K, 1 V), reserved u8, destination block u32, count u32, byte length u32, CRC-32C
// of the bytes u32, reserved u32. The receiver checks each run against the descriptor (its layer, that its
// destination blocks are consecutive destinations of the descriptor, its length) and its checksum, and at kv-done
// that every (block, layer, K|V) came. A corrupted, truncated or misdirected transfer rejects with KvTransferError;
// the caller then prefills on the decode worker instead.
//
// The ring: positions count bytes written since the ring was made; a run sits at position mod size, whole (one that
// would cross the end starts at the next lap instead), and the prefill side writes one only while it fits in the
// size after the last credited position. The decode side credits once a quarter of the ring is consumed, and frames
// are at most a quarter of it, so a writer that waits always gets the credit it waits for.
//
// Copies (tcp): the prefill side writes runs straight from its pool (the blocks are pinned, or, while streaming, full
// blocks of a running prefill, which nobody rewrites), each frame checksummed just before it is written and small
// ones corked together, at most SEND_AHEAD_BYTES queued ahead of the kernel (about its send buffer, so a frame is
// copied by the kernel within a few MiB of its checksum, from the shared cache); the small frames of a pack are
// checksummed and copied into it in one native call (KvChecksumBatch) when it is written. The decode side lets the
// kernel copy what arrives into one small reused read buffer and moves each run's bytes into its destination block
// with a native pass that checksums them on the way, one call for all the run pieces of a read (KvChecksumBatch):
// the bytes are read from memory once. The destination blocks are, on a decode worker, the blocks its engine
// reserved for the request, so nothing copies them again. Copies (shm): the prefill side copies each frame from its
// pool into the ring and the decode side from the ring into its blocks, each in a native pass that checksums on the
// way (again one call per pack, and per read of doorbells): two copies, no system call but the header's.

import { readSync } from 'node:fs';
import net from 'node:net';
import { kvBlockRunBytes, validateHandoff, type KvHandoff, type KvPoolView } from '../engine/handoff.ts';
import { encodeJsonFrame, FrameError, FrameReader, FRAME_JSON, parseJsonMessage } from './frames.ts';
import {
  encodeCredit, encodeDescriptor, encodeDone, encodeShmLink, FRAME_KV_CONTROL, KV_CREDIT, KV_DONE, KV_LINK, KV_LINK_TCP_FRAME, KV_PULL,
  KV_STREAM, parseControl, type KvDescriptorMessage,
} from './kv-wire.ts';
import { KvChecksumBatch, kvChecksum } from './kv-checksum.ts';
import { kvHostId, ShmRegion, shmRingBytes, type KvLinkPreference } from './kv-shm.ts';
import { parseWireRequest, tokenMatches, toWireRequest } from './request-plane.ts';
import { PairedChannel, type KvSinkEndpoint, type KvSourceEndpoint } from '../runtime/kv-transfer.ts';

export const KV_TCP_VERSION = 5;
/** Frame kind of a KV run with its bytes (the request plane's kinds are 0 and 1). */
export const FRAME_KV_RUN = 2;
/** Frame kind of a KV run whose bytes are in the connection's shared-memory ring. */
export const FRAME_KV_SHM_RUN = 3;
const RUN_HEADER_BYTES = 24;
const SHM_OFFSET_BYTES = 8;
/** A shared-memory run's frame: frame header, run header, ring position. */
const SHM_RUN_FRAME_BYTES = 5 + RUN_HEADER_BYTES + SHM_OFFSET_BYTES;
const MAX_CONTROL_BYTES = 16 * 1024 * 1024;
/**
 * How the decode side takes a run's bytes off the socket. 'copy' (the default): the kernel copies them into one
 * small reused read buffer, which stays in cache (as a plain TCP reader's does), and one native pass checksums
 * each piece and copies it on into its block (kvChecksumCopy), so the bytes are read from cache once. 'direct'
 * (CONDUIT_KV_DIRECT_READ=1, POSIX only): read(2) straight into the destination block, then the checksum over what
 * landed; kept to compare against. Read once per process (an environment read costs a transfer a microsecond);
 * setKvReceiveSettings changes it within one (tests, and measuring both in one process).
 */
let receiveMode: 'copy' | 'direct' = process.platform !== 'win32' && process.env.CONDUIT_KV_DIRECT_READ === '1' ? 'direct' : 'copy';
/**
 * The decode side's read buffer in 'copy' mode: one per process (a read is consumed before the callback returns),
 * as large as a read worth one system call, small enough to stay in L2 with the block lines it is copied into.
 */
const COPY_READ_BUFFER_BYTES = 256 << 10;
let copyReadBuffer: Buffer | undefined;
/**
 * A transfer of at least this many bytes is copied into its blocks with stores that bypass the cache: it would not
 * stay there anyway, and the destination lines are then neither read from memory first nor evict the read buffer.
 * CONDUIT_KV_UNCACHED_COPY=0 or 1: never or always (to compare).
 */
const UNCACHED_COPY_BYTES = 8 << 20;
let uncachedSetting = process.env.CONDUIT_KV_UNCACHED_COPY;
function uncachedCopy(bytes: number): boolean {
  return uncachedSetting === '1' || (uncachedSetting !== '0' && bytes >= UNCACHED_COPY_BYTES);
}

/**
 * The decode side's ways of landing bytes, as CONDUIT_KV_DIRECT_READ and CONDUIT_KV_UNCACHED_COPY set them at start
 * (read once): for transfers from now on. Undefined fields are left as they are.
 */
export function setKvReceiveSettings(settings: { directRead?: boolean; uncachedCopy?: '0' | '1' | 'auto' }): void {
  if (settings.directRead !== undefined) receiveMode = settings.directRead && process.platform !== 'win32' ? 'direct' : 'copy';
  if (settings.uncachedCopy !== undefined) uncachedSetting = settings.uncachedCopy === 'auto' ? undefined : settings.uncachedCopy;
}
/** In 'direct' mode the read buffer holds headers and control frames only: a run's bytes are read into the block. */
const DIRECT_READ_BUFFER_BYTES = 16 << 10;
const DIRECT_READ_BUDGET = 8 << 20;
/** The prefill side's frames: a longer run of consecutive blocks goes as several (each checksummed while in cache). */
const SEND_FRAME_BYTES = 256 << 10;
/** A tcp frame of at most this many bytes is packed with its neighbours into one buffer (one copy, checksummed in it). */
const PACK_RUN_BYTES = 16 << 10;
/**
 * The buffers small frames are packed into, reused (a fresh one per write would be faulted in page by page): one is
 * free again once the kernel has taken it (its write's callback). A few are kept per process.
 */
const PACK_BUFFER_BYTES = SEND_FRAME_BYTES + (SEND_FRAME_BYTES >> 2);
const freePackBuffers: Buffer[] = [];
const MAX_FREE_PACK_BUFFERS = 8;
function releasePack(pack: Buffer): void {
  if (freePackBuffers.length < MAX_FREE_PACK_BUFFERS) freePackBuffers.push(pack);
}
/**
 * The checksum-and-copy of a pack's runs, made in one native call when the pack is written: one per process (a
 * pack is written before its sender returns or waits).
 */
const packBatch = new KvChecksumBatch();
/** Room a shared-memory pack keeps after its headers for a pull's kv-done (up to a few hundred source blocks). */
const PACK_DONE_ROOM = 2048;
const EMPTY = Buffer.alloc(0);
/**
 * Bytes the prefill side lets wait in the process for the kernel before it waits for the socket to drain: about
 * the kernel's largest send buffer (4 MiB by default on Linux), so each wait for the socket lets the kernel take
 * megabytes before the next one. Queued bytes are views of the pool (pinned blocks) or reused pack buffers, not
 * copies. Against 512 KiB (the previous value) the sending process spends less CPU on a large transfer (fewer
 * waits, each an event-loop turn and system calls; docs/benchmarks.md).
 * CONDUIT_KV_SEND_AHEAD_BYTES sets it (to compare).
 */
const SEND_AHEAD_BYTES = (() => {
  const value = Number(process.env.CONDUIT_KV_SEND_AHEAD_BYTES);
  return Number.isSafeInteger(value) && value > 0 ? value : 4 << 20;
})();
/**
 * The prefill side hands the kernel its corked frames every this many bytes (tcp): one write(2) of 1 MiB instead of
 * four of 256 KiB (the frame size). Each write on a socket costs a system call and, on loopback, the receiving
 * side's TCP processing and wake-up. Measured under load (docs/benchmarks.md): a 1 MiB pull cost the sending
 * process about 25% less CPU; at 16 and 64 MiB 15-20% less in one period and no difference in others. A MiB just
 * checksummed is still in cache when the kernel copies it. CONDUIT_KV_FLUSH_BYTES sets it (to compare).
 */
const FLUSH_BYTES = (() => {
  const value = Number(process.env.CONDUIT_KV_FLUSH_BYTES);
  return Number.isSafeInteger(value) && value > 0 ? value : 1 << 20;
})();
/** How long, and for how many requests at most, the prefill side remembers requests that ended. */
const ENDED_MEMORY_MS = 60_000;
const ENDED_MEMORY_MAX = 10_000;
/** How long a stream waits for the prefill side to learn of its request before giving up. */
const UNKNOWN_REQUEST_MS = 30_000;
/** Idle connections the decode side keeps per prefill worker, and how long each. */
const MAX_IDLE_PER_PEER = 4;
const IDLE_MS = 30_000;

export type KvLink = 'tcp' | 'shm';

export type KvTransferFailure =
  | 'checksum' | 'length' | 'truncated' | 'refused' | 'unexpected-run' | 'connect' | 'timeout' | 'link' | 'cancelled' | 'aborted';

export class KvTransferError extends Error {
  override name = 'KvTransferError';
  /** The link the transfer was on (the decode side sets it; 'tcp' before the prefill side named one). */
  link?: KvLink;
  constructor(readonly reason: KvTransferFailure, message: string) {
    super(message);
  }
}

/** What the decode side asks for after the handoff. Source and destination ids pair up; layers is [from, to). */
export interface KvPullDescriptor {
  requestId: string;
  sourceBlockIds: number[];
  destinationBlockIds: number[];
  layers: [number, number];
}

/**
 * What the decode side asks for before the prefill: a destination for each block of the prompt from firstBlock on, in
 * position order (the blocks before firstBlock it holds already, cached: they do not move).
 */
export interface KvStreamDescriptor {
  requestId: string;
  destinationBlockIds: number[];
  layers: [number, number];
  /** Default 0. */
  firstBlock?: number;
}

export interface KvPullResult {
  bytes: number;
  blocks: number;
  runs: number;
  /** From the connection's start to the last run checked. */
  ms: number;
  link: KvLink;
  /** The source blocks the runs came from, in position order (a stream learns them at the end). */
  sourceBlockIds: number[];
  /**
   * The prefill side's link busy time (its writes until the kernel took them) before the prefill ended: hidden
   * behind it. 0 for a pull.
   */
  overlapMs: number;
}

interface PlannedRun {
  layer: number;
  kv: number;
  source: number;
  destination: number;
  count: number;
}

/** [source, destination, count]: consecutive ids on both sides merge into one run. */
function mergeRuns(sources: readonly number[], destinations: readonly number[]): [number, number, number][] {
  const merged: [number, number, number][] = [];
  for (let i = 0; i < sources.length; i++) {
    const last = merged[merged.length - 1];
    if (last && sources[i] === last[0] + last[2] && destinations[i] === last[1] + last[2]) last[2]++;
    else merged.push([sources[i]!, destinations[i]!, 1]);
  }
  return merged;
}

function layerRuns(merged: readonly [number, number, number][], layers: readonly [number, number]): PlannedRun[] {
  const runs: PlannedRun[] = [];
  for (let layer = layers[0]; layer < layers[1]; layer++) {
    for (let kv = 0; kv < 2; kv++) {
      for (const [source, destination, count] of merged) runs.push({ layer, kv, source, destination, count });
    }
  }
  return runs;
}

/** The runs a descriptor means, in the order the prefill side sends them: layer, then K and V, then block order. */
export function planRuns(descriptor: KvPullDescriptor): PlannedRun[] {
  return layerRuns(mergeRuns(descriptor.sourceBlockIds, descriptor.destinationBlockIds), descriptor.layers);
}

function blockIds(list: unknown, name: string, view: KvPoolView | null): number[] {
  if (!Array.isArray(list)) throw new FrameError(`${name} must be block ids`);
  // A loop, not some() with a closure: both sides check every descriptor on a transfer's critical path.
  const limit = view ? view.layout.numBlocks : Infinity;
  let outside = false;
  for (let i = 0; i < list.length; i++) {
    const id: unknown = list[i];
    if (!Number.isInteger(id) || (id as number) < 0) throw new FrameError(`${name} must be block ids`);
    if ((id as number) >= limit) outside = true;
  }
  if (outside) {
    throw new FrameError(`a ${name === 'sourceBlockIds' ? 'source' : 'destination'} block id is outside the pool (${view!.layout.numBlocks} blocks)`);
  }
  return list as number[];
}

function checkLayers(value: unknown, view: KvPoolView): [number, number] {
  const layers = value;
  if (!Array.isArray(layers) || layers.length !== 2 || !Number.isInteger(layers[0]) || !Number.isInteger(layers[1])
    || layers[0] < 0 || layers[1] > view.layout.numLayers || layers[0] > layers[1]) {
    throw new FrameError(`layers must be [from, to) within ${view.layout.numLayers} layers`);
  }
  return [layers[0], layers[1]];
}

function checkRequestId(value: unknown): string {
  if (typeof value !== 'string' || value.length === 0) throw new FrameError('requestId must be a non-empty string');
  return value;
}

function checkDescriptor(value: Record<string, unknown>, view: KvPoolView, side: 'source' | 'destination'): KvPullDescriptor {
  const requestId = checkRequestId(value.requestId);
  const sourceBlockIds = blockIds(value.sourceBlockIds, 'sourceBlockIds', side === 'source' ? view : null);
  const destinationBlockIds = blockIds(value.destinationBlockIds, 'destinationBlockIds', side === 'destination' ? view : null);
  if (sourceBlockIds.length !== destinationBlockIds.length) throw new FrameError('sourceBlockIds and destinationBlockIds must pair up');
  return { requestId, sourceBlockIds, destinationBlockIds, layers: checkLayers(value.layers, view) };
}

/**
 * Big-endian u32 stores and loads on a frame's bytes, without Buffer's per-call argument checks: run headers are
 * written and read 16 at a time for a 64 KiB transfer, on its critical path. Callers keep offsets within the buffer.
 */
function putU32(bytes: Uint8Array, at: number, value: number): void {
  bytes[at] = value >>> 24;
  bytes[at + 1] = value >>> 16;
  bytes[at + 2] = value >>> 8;
  bytes[at + 3] = value;
}

function getU32(bytes: Uint8Array, at: number): number {
  return ((bytes[at]! << 24) | (bytes[at + 1]! << 16) | (bytes[at + 2]! << 8) | bytes[at + 3]!) >>> 0;
}

/** Resolves when the socket has handed the kernel everything written to it, or closed. */
function drained(socket: net.Socket): Promise<void> {
  return new Promise((resolve) => {
    const done = () => {
      socket.off('drain', done);
      socket.off('close', done);
      resolve();
    };
    socket.on('drain', done);
    socket.on('close', done);
  });
}

/** Hands the kernel what a corked socket holds, then corks it again as deep as it was. */
function flushCorked(socket: net.Socket): void {
  const depth = socket.writableCorked;
  for (let i = 0; i < depth; i++) socket.uncork();
  for (let i = 0; i < depth; i++) socket.cork();
}

/**
 * A link's busy time before one instant (the end of the prefill): batches from their first write until the kernel
 * took their last byte; overlapping batches count once. A batch still in flight counts up to the instant.
 */
class BusyClock {
  private before = 0;
  private lastEnd = -Infinity;
  private readonly inFlight = new Set<{ start: number }>();

  begin(): { start: number } {
    const batch = { start: performance.now() };
    this.inFlight.add(batch);
    return batch;
  }

  end(batch: { start: number }, split: number | undefined): void {
    if (!this.inFlight.delete(batch)) return;
    const from = Math.max(batch.start, this.lastEnd);
    const end = Math.min(performance.now(), split ?? Infinity);
    if (end > from) {
      this.before += end - from;
      this.lastEnd = end;
    }
  }

  /** Busy time before `split`, counting the batches in flight (they started before it, or count nothing). */
  beforeAt(split: number): number {
    let total = this.before;
    let lastEnd = this.lastEnd;
    for (const { start } of [...this.inFlight].sort((a, b) => a.start - b.start)) {
      const from = Math.max(start, lastEnd);
      if (split > from) {
        total += split - from;
        lastEnd = split;
      }
    }
    return total;
  }
}

/** A pull's clock: a pull has no busy time before a prefill's end, so its transfers share this one, never used. */
const PULL_BUSY = new BusyClock();

// ---------------------------------------------------------------------------------------------------------------
// Prefill side

export interface KvTransferServerOptions {
  clusterToken: string;
  /** The prefill worker's own pool (shared memory with its engine thread). */
  pool: KvPoolView;
  /** Whether the request's blocks are still pinned here; a pull for any other request is refused. */
  isPinned?: (requestId: string) => boolean;
  /** 'tcp' never offers shared memory (default 'auto'). */
  link?: KvLinkPreference;
  log?: (level: 'debug' | 'info' | 'warn' | 'error', message: string) => void;
  /**
   * Fault injection for tests: flip a byte of run `corruptRun`, close the connection after `truncateAfterRuns`, or
   * send nothing after `stallAfterRuns` runs and keep the connection open (a transfer in flight, as long as a test
   * needs it). Runs are counted over the server's life (runsSent).
   */
  faults?: { corruptRun?: number; truncateAfterRuns?: number; stallAfterRuns?: number };
  /** Bytes of each connection's shared-memory ring (default CONDUIT_KV_SHM_RING_BYTES or 4 MiB). */
  shmRingBytes?: number;
}

/** The prefill side's end of a connection's shared-memory ring. */
interface WriterRing {
  region: ShmRegion;
  size: number;
  /** Position after the last run written, and up to which the decode side has credited the ring back. */
  head: number;
  tail: number;
  /** Wakes a writer waiting for room (a credit came, or the connection closed). */
  wake?: () => void;
  /** The kv-link message naming it (the same for every transfer of the connection). */
  linkFrame: Buffer;
}

/** A connection from a decode worker: its transfers one after the other, and its ring once a transfer needs it. */
interface Peer {
  socket: net.Socket;
  transfer?: Transfer;
  ring?: WriterRing;
  closed: boolean;
}

/** What the prefill side knows of a request's blocks: the full ones so far, all of them once handed off. */
interface KnownRequest {
  /** Source block ids of the computed full blocks, in position order (prefill running). */
  full: number[];
  /** Every block, once handed off (the blocks are pinned). */
  final?: number[];
  /** performance.now() at the handoff. */
  handedOffAt?: number;
}

interface Transfer {
  socket: net.Socket;
  peer: Peer;
  requestId: string;
  destinations: number[];
  layers: [number, number];
  /** The position of destinations[0]: positions before it are not sent (the decode side holds them). */
  first: number;
  /** Which source block each destination was sent from (-1: not sent). */
  sent: Int32Array;
  /** A pull: its source blocks, fixed. */
  pullSources?: number[];
  /** The shared-memory link: the connection's ring (else tcp). */
  ring: WriterRing | null;
  runs: number;
  bytes: number;
  busy: BusyClock;
  done: boolean;
  /** A batch is on its way (flush waits for it, then sends what is new). */
  sending: boolean;
  /** When the prefill ended (performance.now()): busy time after it is not hidden. A pull's is -Infinity. */
  handedOffAt?: number;
  timer?: NodeJS.Timeout;
}

/** Serves pulls and streams of this worker's blocks. */
export class KvTransferServer {
  private readonly server: net.Server;
  private readonly sockets = new Set<net.Socket>();
  private readonly known = new Map<string, KnownRequest>();
  private readonly streams = new Map<string, Set<Transfer>>();
  /** Requests that ended lately, and why: a stream that comes after the end is refused at once. */
  private readonly endedLately = new Map<string, { why: string; at: number }>();
  /** Transfers served, refused. */
  served = 0;
  refused = 0;
  /** Runs written since the start (fault injection counts them). */
  runsSent = 0;
  /** Connections accepted, and transfers started on a connection that had served one before. */
  connections = 0;
  reusedConnections = 0;
  /** The pool as bytes (the source of every run), and one run's bytes. */
  private readonly poolBytes: Uint8Array;
  private readonly runBytes: number;
  /**
   * The pack being filled by sendFrames, and the kv-link waiting to start the next one (lead): written (and emptied)
   * before sendFrames waits and before flush returns, so nothing of one transfer is left here across a wait.
   */
  private readonly packer: { pack: Buffer | null; packed: number; crcAt: number[]; corruptAt: number; lead: Buffer | null } = {
    pack: null, packed: 0, crcAt: [], corruptAt: -1, lead: null,
  };

  constructor(private readonly options: KvTransferServerOptions) {
    this.poolBytes = new Uint8Array(options.pool.pool);
    this.runBytes = kvBlockRunBytes(options.pool.layout);
    this.server = net.createServer((socket) => this.accept(socket));
  }

  listen(port: number, host: string): Promise<number> {
    return new Promise((resolve, reject) => {
      this.server.once('error', reject);
      this.server.listen(port, host, () => {
        this.server.off('error', reject);
        resolve((this.server.address() as net.AddressInfo).port);
      });
    });
  }

  async close(): Promise<void> {
    for (const socket of this.sockets) socket.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }

  // -------------------------------------------------------------------------------------------------------------
  // What the engine tells: a prefill's progress, its handoff, its end

  /** A request to hand off arrived: a stream for it waits for its blocks however long it queues. */
  started(requestId: string): void {
    this.endedLately.delete(requestId);
    if (!this.known.has(requestId)) this.known.set(requestId, { full: [] });
  }

  /** A running prefill has computed these full blocks (position order, from the first): streams send the new ones. */
  progress(requestId: string, fullBlockIds: readonly number[]): void {
    const known = this.known.get(requestId) ?? { full: [] };
    if (known.final) return;
    known.full = fullBlockIds.slice();
    this.known.set(requestId, known);
    for (const transfer of this.streams.get(requestId) ?? []) this.flush(transfer);
  }

  /** A running prefill was preempted: its blocks may be rewritten, so whatever was sent of it is sent again. */
  reset(requestId: string): void {
    const known = this.known.get(requestId);
    if (known && !known.final) known.full = [];
    for (const transfer of this.streams.get(requestId) ?? []) transfer.sent.fill(-1);
  }

  /** The request is handed off, its blocks pinned: streams get the rest and end. */
  handedOff(requestId: string, sourceBlockIds: readonly number[]): void {
    const known = this.known.get(requestId) ?? { full: [] };
    known.final = sourceBlockIds.slice();
    known.handedOffAt = performance.now();
    this.known.set(requestId, known);
    for (const transfer of this.streams.get(requestId) ?? []) this.flush(transfer);
  }

  /** The request is over here (released after its handoff, aborted, or finished on its first token). */
  ended(requestId: string, why: string): void {
    this.known.delete(requestId);
    const now = performance.now();
    this.endedLately.delete(requestId);
    this.endedLately.set(requestId, { why, at: now });
    for (const [id, { at }] of this.endedLately) {
      if (now - at < ENDED_MEMORY_MS && this.endedLately.size <= ENDED_MEMORY_MAX) break;
      this.endedLately.delete(id);
    }
    for (const transfer of this.streams.get(requestId) ?? []) {
      if (!transfer.done) this.fail(transfer, `request ${requestId} ${why} before its blocks were all sent`);
    }
  }

  // -------------------------------------------------------------------------------------------------------------

  private accept(socket: net.Socket): void {
    this.sockets.add(socket);
    this.connections++;
    socket.setNoDelay(true);
    socket.on('error', () => {});
    const peer: Peer = { socket, closed: false };
    socket.on('close', () => {
      this.sockets.delete(socket);
      peer.closed = true;
      if (peer.transfer) this.forget(peer.transfer);
      if (peer.ring) {
        peer.ring.region.close();
        peer.ring.wake?.();
      }
    });
    const reader = new FrameReader(64 * 1024, [FRAME_KV_CONTROL]);
    let authenticated = false;
    const timer = setTimeout(() => this.refuse(socket, 'no hello within 10 s'), 10_000);
    /** A control frame's payload, after the hello: a credit, or the next transfer's descriptor. */
    const control = (payload: Buffer): void => {
      const message = parseControl(payload);
      if (message.type === KV_CREDIT) {
        const ring = peer.ring;
        const upTo = message.upTo;
        if (!ring || upTo < ring.tail || upTo > ring.head) throw new FrameError('kv-credit beyond the ring\'s runs');
        ring.tail = upTo;
        ring.wake?.();
        return;
      }
      if (message.type !== KV_PULL && message.type !== KV_STREAM) throw new FrameError(`control message ${message.type} is not the decode side's`);
      if (peer.transfer && !peer.transfer.done) throw new FrameError('one transfer at a time per connection');
      if (peer.transfer) {
        this.reusedConnections++;
        this.forget(peer.transfer);
      }
      peer.transfer = this.start(peer, message);
    };
    socket.on('data', (chunk: Buffer) => {
      try {
        // The usual read after the hello: one whole control frame (a descriptor, or a credit), parsed where it lies
        // (the checks the frame reader would make, without its buffering).
        if (authenticated && reader.pending === 0 && chunk.length > 5 && chunk[4] === FRAME_KV_CONTROL
          && getU32(chunk, 0) === chunk.length - 4 && chunk.length - 4 <= reader.maxFrameBytes) {
          control(chunk.subarray(5));
          return;
        }
        for (const frame of reader.push(chunk)) {
          if (!authenticated) {
            clearTimeout(timer);
            const message = frame.kind === FRAME_JSON ? parseJsonMessage(frame.payload) : undefined;
            if (message?.t !== 'kv-hello' || message.v !== KV_TCP_VERSION) throw new FrameError(`expected kv-hello, version ${KV_TCP_VERSION}`);
            if (!tokenMatches(this.options.clusterToken, message.token)) throw new FrameError('wrong cluster token');
            authenticated = true;
            reader.maxFrameBytes = MAX_CONTROL_BYTES;
            continue;
          }
          if (frame.kind !== FRAME_KV_CONTROL) throw new FrameError('after kv-hello the KV port accepts binary control frames only');
          control(frame.payload);
        }
      } catch (error) {
        this.refuse(socket, (error as Error).message);
      }
    });
  }

  private start(peer: Peer, message: KvDescriptorMessage): Transfer {
    const { socket } = peer;
    const view = this.options.pool;
    let transfer: Transfer;
    if (message.type === KV_PULL) {
      const descriptor = checkDescriptor(message as unknown as Record<string, unknown>, view, 'source');
      if (this.options.isPinned && !this.options.isPinned(descriptor.requestId)) {
        throw new FrameError(`request ${descriptor.requestId} has no pinned blocks here`);
      }
      transfer = this.transfer(peer, descriptor.requestId, descriptor.destinationBlockIds, descriptor.layers, message.hostId, 0, true);
      transfer.pullSources = descriptor.sourceBlockIds;
      transfer.handedOffAt = -Infinity;
    } else {
      const requestId = checkRequestId(message.requestId);
      const ended = this.endedLately.get(requestId);
      if (ended && !this.known.has(requestId)) throw new FrameError(`request ${requestId} ${ended.why}`);
      const destinations = message.destinationBlockIds;
      const first = message.firstBlock;
      transfer = this.transfer(peer, requestId, destinations, checkLayers(message.layers, view), message.hostId, first);
      let set = this.streams.get(requestId);
      if (!set) this.streams.set(requestId, set = new Set());
      set.add(transfer);
      transfer.timer = setTimeout(() => {
        if (!this.known.has(requestId)) this.fail(transfer, `request ${requestId} is not prefilling here`);
      }, UNKNOWN_REQUEST_MS);
      transfer.timer.unref();
    }
    // kv-link, the runs known now and (a pull) kv-done leave in as few writes as their size allows: a small pull's
    // in one buffer (the pack: kv-link at its start, kv-done after its runs).
    socket.cork();
    const { ring } = transfer;
    this.packer.lead = ring ? ring.linkFrame : KV_LINK_TCP_FRAME;
    this.flush(transfer);
    if (!socket.destroyed) socket.uncork();
    return transfer;
  }

  private transfer(peer: Peer, requestId: string, destinations: number[], layers: [number, number], hostId: string | null,
    first = 0, pull = false): Transfer {
    const sameHost = this.options.link !== 'tcp' && hostId !== null && hostId === kvHostId();
    return {
      socket: peer.socket, peer, requestId, destinations, layers, first, sent: new Int32Array(destinations.length).fill(-1),
      ring: sameHost ? this.ring(peer) : null, runs: 0, bytes: 0, busy: pull ? PULL_BUSY : new BusyClock(), done: false, sending: false,
    };
  }

  /** The connection's ring, made at its first shared-memory transfer; null when none can be made (then tcp). */
  private ring(peer: Peer): WriterRing | null {
    if (peer.ring) return peer.ring;
    const size = shmRingBytes(this.options.shmRingBytes);
    // A frame is at most a quarter of the ring (see send): one block's run must fit in it.
    if (kvBlockRunBytes(this.options.pool.layout) > size / 4) return null;
    const region = ShmRegion.create(size);
    if (!region) return null;
    peer.ring = { region, size, head: 0, tail: 0, linkFrame: encodeShmLink(region.name, size) };
    return peer.ring;
  }

  /**
   * Sends what the transfer lacks of what is known now; ends it once every block went after the handoff. Whatever it
   * leaves in the pack (kv-link, a pull's runs and kv-done) is written before it returns.
   */
  private flush(transfer: Transfer): void {
    this.flushKnown(transfer);
    this.writePack(transfer.socket, transfer.ring);
  }

  private flushKnown(transfer: Transfer): void {
    if (transfer.done || transfer.sending || transfer.socket.destroyed) return;
    const known = transfer.pullSources ? undefined : this.known.get(transfer.requestId);
    const sources = transfer.pullSources ?? known?.final ?? known?.full;
    if (!sources) return;
    const final = transfer.pullSources !== undefined || known?.final !== undefined;
    const { first } = transfer;
    const wanted = first + transfer.destinations.length;
    if (sources.length > wanted || (final && sources.length !== wanted)) {
      this.fail(transfer, `request ${transfer.requestId} has ${final ? '' : 'at least '}${sources.length} blocks here, the decode side named `
        + `${transfer.destinations.length} destinations${first > 0 ? ` after the ${first} blocks it holds` : ''}`);
      return;
    }
    const from: number[] = [];
    const to: number[] = [];
    for (let p = first; p < sources.length; p++) {
      if (transfer.sent[p - first] === sources[p]) continue;
      transfer.sent[p - first] = sources[p]!;
      from.push(sources[p]!);
      to.push(transfer.destinations[p - first]!);
    }
    if (known?.handedOffAt !== undefined) transfer.handedOffAt = known.handedOffAt;
    if (from.length > 0) {
      // Paced by the socket (see send); whatever became known meanwhile goes after it, then kv-done if final.
      transfer.sending = true;
      const sent = this.send(transfer, layerRuns(mergeRuns(from, to), transfer.layers));
      if (typeof sent === 'boolean') {
        // All written without waiting (a small batch): kv-done, if final, joins the same write (a pull's, the pack).
        transfer.sending = false;
        if (sent) this.flushKnown(transfer);
        return;
      }
      void sent.then((ok) => {
        transfer.sending = false;
        if (ok) this.flush(transfer);
      });
      return;
    }
    if (!final) return;
    transfer.done = true;
    clearTimeout(transfer.timer);
    this.served++;
    // Right behind the last run: what the link did before the prefill ended (a pull: nothing).
    const overlapMs = transfer.pullSources ? 0 : transfer.busy.beforeAt(transfer.handedOffAt ?? performance.now());
    // The connection stays open for the decode side's next descriptor.
    const done = encodeDone(transfer.runs, transfer.bytes, overlapMs, sources);
    const { pack } = this.packer;
    if (pack && this.packer.packed + done.length <= pack.length) this.packer.packed += done.copy(pack, this.packer.packed);
    else {
      this.writePack(transfer.socket, transfer.ring);
      transfer.socket.write(done);
    }
    this.forget(transfer);
  }

  /**
   * One batch of runs, in frames of at most SEND_FRAME_BYTES (a long run of consecutive blocks is cut into runs of
   * fewer blocks; shm: of at most a quarter ring), each checksummed just before it is written (tcp: so the kernel
   * copies it while it is still in cache; shm: in the same pass as its copy into the ring); small frames share a
   * write. Past SEND_AHEAD_BYTES not yet taken by the kernel, the next frames wait for the socket to drain; a frame
   * without room in the ring waits for the decode side's credit. Returns true or false at once when it never waited
   * (false: the transfer failed, by a fault or a closed socket), else a promise of the same.
   */
  private send(transfer: Transfer, runs: PlannedRun[]): boolean | Promise<boolean> {
    const runBytes = this.runBytes;
    // A shared-memory frame is at most a quarter of the ring, so a writer waiting for room always gets it back.
    const perFrame = Math.max(1, Math.floor(Math.min(SEND_FRAME_BYTES, transfer.ring ? transfer.ring.size / 4 : Infinity) / runBytes));
    let frames = runs;
    let split = false;
    for (let j = 0; j < runs.length && !split; j++) split = runs[j]!.count > perFrame;
    if (split) {
      frames = [];
      for (const run of runs) {
        if (run.count <= perFrame) {
          frames.push(run);
          continue;
        }
        for (let offset = 0; offset < run.count; offset += perFrame) {
          frames.push({ layer: run.layer, kv: run.kv, source: run.source + offset, destination: run.destination + offset, count: Math.min(perFrame, run.count - offset) });
        }
      }
    }
    transfer.socket.cork();
    // A pull's last pack stays open for kv-done (flush writes it); a stream's is written, then its busy clock's mark.
    return this.sendFrames(transfer, frames, 0, transfer.pullSources ? null : transfer.busy.begin(), transfer.pullSources !== undefined);
  }

  /**
   * Writes the pack being filled, if any: first the checksum-and-copy of its runs (one native call for all of them:
   * tcp from the pool into the pack, shm into the ring), then each run's CRC-32C into its header.
   */
  private writePack(socket: net.Socket, ring: WriterRing | null): void {
    const packer = this.packer;
    const pack = packer.pack;
    if (!pack) {
      // Nothing packed: the kv-link waiting for a pack goes alone (a stream before its first blocks).
      const lead = packer.lead;
      packer.lead = null;
      if (lead && !socket.writableEnded) socket.write(lead);
      return;
    }
    const target = ring ? ring.region.bytes : pack;
    packBatch.run(this.poolBytes, target);
    for (let j = 0; j < packBatch.count; j++) putU32(pack, packer.crcAt[j]!, packBatch.crc(j));
    if (packer.corruptAt >= 0) target[packer.corruptAt]! ^= 0xff;
    packBatch.clear();
    packer.crcAt.length = 0;
    packer.corruptAt = -1;
    // tcp's packs are reused once the kernel took them; shm's (headers only) are small, from Node's own pool.
    if (packer.packed > 0) socket.write(pack.subarray(0, packer.packed), ring ? undefined : () => releasePack(pack));
    else if (!ring) releasePack(pack);
    packer.pack = null;
    packer.packed = 0;
  }

  /** A pack for frames[from] on: tcp a reused one; shm one for the headers up to the next doorbell flush. */
  private newPack(frames: readonly PlannedRun[], from: number, ring: WriterRing | null): Buffer {
    const packer = this.packer;
    if (ring) {
      // The headers up to the next doorbell flush (below: a quarter ring, or a frame's worth, of runs).
      const limit = Math.min(SEND_FRAME_BYTES, ring.size / 4);
      let count = 0;
      for (let j = from, payload = 0; j < frames.length && payload < limit; j++, count++) payload += frames[j]!.count * this.runBytes;
      // Room for the kv-link before the headers and a pull's kv-done after them.
      packer.pack = Buffer.allocUnsafe((packer.lead?.length ?? 0) + Math.max(1, count) * SHM_RUN_FRAME_BYTES + PACK_DONE_ROOM);
    } else {
      packer.pack = freePackBuffers.pop() ?? Buffer.allocUnsafeSlow(PACK_BUFFER_BYTES);
    }
    packer.packed = packer.lead ? packer.lead.copy(packer.pack, 0) : 0;
    packer.lead = null;
    return packer.pack;
  }

  private resume(transfer: Transfer, wait: Promise<void>, frames: PlannedRun[], from: number, batch: { start: number } | null): Promise<boolean> {
    return wait.then(() => {
      if (transfer.socket.destroyed || transfer.done || transfer.peer.closed) return false;
      transfer.socket.cork();
      // After a wait, the pack is written before sendFrames returns: nothing may stay open across the promise.
      return this.sendFrames(transfer, frames, from, batch, false);
    });
  }

  /**
   * send() from frames[i] on; the socket is corked once on entry and uncorked on every way out. Small frames (tcp:
   * header and bytes; shm: the header) are packed into one buffer, so a small transfer is one write of one buffer
   * instead of a gather of many pieces, and their bytes are checksummed and copied in one native call when the pack
   * is written. The pack is written before this waits, and before it returns unless leaveOpen (then the caller,
   * synchronously, appends kv-done and writes it: flush).
   */
  private sendFrames(transfer: Transfer, frames: PlannedRun[], i: number, batch: { start: number } | null,
    leaveOpen: boolean): boolean | Promise<boolean> {
    const view = this.options.pool;
    const runBytes = this.runBytes;
    const numBlocks = view.layout.numBlocks;
    const { socket, ring } = transfer;
    const { faults } = this.options;
    const packer = this.packer;
    let corked = 0;
    try {
      for (; i < frames.length; i++) {
        const frame = frames[i]!;
        if (faults?.truncateAfterRuns !== undefined && this.runsSent === faults.truncateAfterRuns) {
          this.writePack(socket, ring);
          socket.uncork();
          socket.destroySoon();
          transfer.done = true;
          return false;
        }
        if (faults?.stallAfterRuns !== undefined && this.runsSent === faults.stallAfterRuns) {
          // Nothing more on this transfer, the connection stays open until the decode side closes it.
          this.writePack(socket, ring);
          socket.uncork();
          transfer.done = true;
          return false;
        }
        const { count } = frame;
        // Straight from the pool: the blocks are pinned (or full blocks of a running prefill) until the decode
        // side has them, so nothing rewrites them while the kernel (or the copy into the ring) reads them.
        const at = ((2 * frame.layer + frame.kv) * numBlocks + frame.source) * runBytes;
        const length = count * runBytes;
        const corrupt = faults?.corruptRun === this.runsSent;
        let position = 0;
        if (ring) {
          position = ring.head;
          if ((position % ring.size) + length > ring.size) position += ring.size - (position % ring.size);
          if (position + length - ring.tail > ring.size) {
            // No room until the decode side credits what it copied out: it needs the doorbells sent so far.
            this.writePack(socket, ring);
            socket.uncork();
            return this.resume(transfer, new Promise<void>((resolve) => {
              ring.wake = () => {
                ring.wake = undefined;
                resolve();
              };
            }), frames, i, batch);
          }
          ring.head = position + length;
        }
        const headerBytes = ring ? SHM_RUN_FRAME_BYTES : 5 + RUN_HEADER_BYTES;
        // The header is written in place: at h in the pack, or at the start of a buffer of its own.
        let header: Buffer;
        let h = 0;
        if (ring || length <= PACK_RUN_BYTES) {
          let pack = packer.pack;
          if (!pack || packer.packed + headerBytes + (ring ? 0 : length) > pack.length) {
            // (Without a pack, a kv-link waiting to go starts the new one instead of going alone.)
            if (pack) this.writePack(socket, ring);
            pack = this.newPack(frames, i, ring);
          }
          const at0 = packer.packed;
          header = pack;
          h = at0;
          // The CRC-32C goes in when the pack is written (writePack), of the bytes copied then.
          packer.crcAt.push(at0 + 21);
          const to = ring ? position % ring.size : at0 + headerBytes;
          packBatch.add(at, to, length);
          if (corrupt) packer.corruptAt = to + (length >> 1);
          packer.packed += headerBytes + (ring ? 0 : length);
        } else {
          this.writePack(socket, ring);
          header = Buffer.allocUnsafe(headerBytes);
        }
        putU32(header, h, headerBytes - 4 + (ring ? 0 : length));
        header[h + 4] = ring ? FRAME_KV_SHM_RUN : FRAME_KV_RUN;
        header[h + 5] = frame.layer >>> 8;
        header[h + 6] = frame.layer;
        header[h + 7] = frame.kv;
        header[h + 8] = 0;
        putU32(header, h + 9, frame.destination);
        putU32(header, h + 13, count);
        putU32(header, h + 17, length);
        putU32(header, h + 25, 0);
        if (ring) {
          putU32(header, h + 29, Math.floor(position / 2 ** 32));
          putU32(header, h + 33, position % 2 ** 32);
        } else if (length > PACK_RUN_BYTES) {
          // A large frame goes from the pool itself, checksummed just before the kernel copies it.
          const body = Buffer.from(view.pool, at, length);
          putU32(header, 21, kvChecksum(body));
          socket.write(header);
          if (corrupt) {
            const corrupted = Buffer.from(body);
            corrupted[length >> 1] = corrupted[length >> 1]! ^ 0xff;
            socket.write(corrupted);
          } else {
            socket.write(body);
          }
        }
        corked += length;
        this.runsSent++;
        transfer.runs++;
        transfer.bytes += length;
        // tcp: every FLUSH_BYTES of frames go to the kernel in one write, while they are still in cache. shm: the
        // doorbells of a quarter ring go in one write (each write costs the loopback's delivery, some 20 us), so the
        // decode side copies that quarter out while the next is copied in.
        // (Not after the last frame: what follows it, a pull's kv-done, joins its write when the caller uncorks.)
        if (corked >= (ring ? ring.size / 4 : FLUSH_BYTES) && i + 1 < frames.length) {
          this.writePack(socket, ring);
          flushCorked(socket);
          corked = 0;
          if (socket.writableLength >= SEND_AHEAD_BYTES) {
            socket.uncork();
            return this.resume(transfer, drained(socket), frames, i + 1, batch);
          }
        }
      }
      if (!leaveOpen) this.writePack(socket, ring);
    } catch (error) {
      packBatch.clear();
      packer.crcAt.length = 0;
      packer.corruptAt = -1;
      packer.pack = null;
      packer.packed = 0;
      packer.lead = null;
      socket.uncork();
      this.fail(transfer, `writing the runs failed: ${(error as Error).message}`);
      return false;
    }
    socket.uncork();
    // The batch's busy time ends when the kernel has taken its last byte (only what was before the prefill's end
    // counts; a pull's is all after it).
    if (batch) socket.write(EMPTY, () => transfer.busy.end(batch, transfer.handedOffAt));
    return true;
  }

  private fail(transfer: Transfer, reason: string): void {
    transfer.done = true;
    clearTimeout(transfer.timer);
    this.refuse(transfer.socket, reason);
  }

  private forget(transfer: Transfer): void {
    clearTimeout(transfer.timer);
    const set = this.streams.get(transfer.requestId);
    if (set?.delete(transfer) && set.size === 0) this.streams.delete(transfer.requestId);
  }

  private refuse(socket: net.Socket, reason: string): void {
    if (socket.destroyed) return;
    this.refused++;
    this.options.log?.('warn', `KV transfer: refusing ${socket.remoteAddress}:${socket.remotePort}: ${reason}`);
    socket.end(encodeJsonFrame({ t: 'kv-error', reason }));
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Decode side

export interface KvPullOptions {
  clusterToken: string;
  /** host:port of the prefill worker's KV port. */
  host: string;
  port: number;
  /** Where the blocks go: the decode worker's pool (or a staging pool handed to its engine). */
  destination: KvPoolView;
  /** Rejects with 'timeout' after this long (default 30 s for a pull; a stream waits for its prefill unless set). */
  timeoutMs?: number;
  /** 'tcp' does not offer shared memory (default 'auto'). */
  link?: KvLinkPreference;
  /** Stops the transfer (the connection is closed): rejects with reason 'aborted' (not a failed transfer). */
  signal?: AbortSignal;
}

/** A transfer under way; cancel() rejects it with 'cancelled' and closes the connection. */
export interface KvTransferHandle {
  result: Promise<KvPullResult>;
  cancel(why: string): void;
  /** Starts (or restarts) a deadline: rejects with 'timeout' unless done within ms. */
  deadline(ms: number): void;
}

/**
 * Pulls the descriptor's blocks into the destination pool. Resolves when every run came, checked; rejects with
 * KvTransferError otherwise (runs written before the failure are in the destination blocks, which the caller frees
 * or overwrites by prefilling).
 */
export function pullKvBlocks(descriptor: KvPullDescriptor, options: KvPullOptions): Promise<KvPullResult> {
  checkDescriptor(descriptor as unknown as Record<string, unknown>, options.destination, 'destination');
  const handle = new Receiver(KV_PULL, descriptor.sourceBlockIds, descriptor, options);
  handle.deadline(options.timeoutMs ?? 30_000);
  return handle.result;
}

/**
 * Streams a prompt's blocks into the destination pool while the prefill side computes them. The result comes after
 * the prefill side's handoff; the caller checks its sourceBlockIds against the handoff's.
 */
export function streamKvBlocks(descriptor: KvStreamDescriptor, options: KvPullOptions): KvTransferHandle {
  blockIds(descriptor.destinationBlockIds, 'destinationBlockIds', options.destination);
  checkLayers(descriptor.layers, options.destination);
  if (descriptor.firstBlock !== undefined && !(Number.isSafeInteger(descriptor.firstBlock) && descriptor.firstBlock >= 0)) {
    throw new RangeError(`firstBlock must be a block position, got ${descriptor.firstBlock}`);
  }
  const handle = new Receiver(KV_STREAM, null, descriptor, options);
  if (options.timeoutMs !== undefined) handle.deadline(options.timeoutMs);
  return handle;
}

/**
 * The decode side's end of a connection to a prefill worker's KV port, kept alive between transfers. Its bytes go
 * to the transfer using it (receiver); an idle one is unreferenced (it keeps no process alive) and closed after
 * IDLE_MS.
 */
class KvConnection {
  readonly socket: net.Socket;
  /** The current transfer: it parses the bytes, and learns when the connection fails. */
  receiver: Receiver | null = null;
  /** The connection's shared-memory ring, once a transfer named it; positions consumed and credited so far. */
  ring: ShmRegion | null = null;
  ringSize = 0;
  consumed = 0;
  credited = 0;
  /** Transfers it carried (a reused one has carried at least one before). */
  transfers = 0;
  /** In the idle pool; its timer closes it once it has been there IDLE_MS (made once, re-armed when it fires). */
  idle = false;
  idleTimer: NodeJS.Timeout | undefined;
  /** When it last went idle (performance.now()). */
  idleSince = 0;
  closed = false;

  constructor(readonly key: string, host: string, port: number, readBuffer: Buffer) {
    this.socket = net.connect({
      host, port,
      onread: { buffer: readBuffer, callback: (n: number, buffer: Uint8Array) => { this.bytes(buffer as Buffer, n); return true; } },
    });
    this.socket.setNoDelay(true);
    this.socket.on('error', (error) => this.end(error));
    this.socket.on('close', () => this.end(null));
  }

  private bytes(buffer: Buffer, n: number): void {
    if (this.receiver) this.receiver.bytes(buffer, n);
    else this.destroy(); // nothing may come between transfers
  }

  private end(error: Error | null): void {
    if (this.closed) return;
    this.closed = true;
    clearTimeout(this.idleTimer);
    dropIdle(this);
    this.ring?.close();
    this.ring = null;
    const receiver = this.receiver;
    this.receiver = null;
    receiver?.connectionEnded(error ?? new Error('the connection closed'));
  }

  destroy(): void {
    this.socket.destroy();
    this.end(null);
  }
}

const idleConnections = new Map<string, KvConnection[]>();
/** Connections the decode side opened, and transfers that went on a kept-alive one (since the process started). */
export const kvConnectionStats = { opened: 0, reused: 0 };

function dropIdle(connection: KvConnection): void {
  const list = idleConnections.get(connection.key);
  const at = list?.indexOf(connection) ?? -1;
  if (at < 0) return;
  list!.splice(at, 1);
  if (list!.length === 0) idleConnections.delete(connection.key);
}

/** A transfer ended cleanly on the connection: kept for the next one to the same worker (or closed, past the limit). */
function keepIdle(connection: KvConnection): void {
  connection.receiver = null;
  if (connection.closed) return;
  let list = idleConnections.get(connection.key);
  if (!list) idleConnections.set(connection.key, list = []);
  if (list.length >= MAX_IDLE_PER_PEER) return connection.destroy();
  list.push(connection);
  connection.socket.unref();
  connection.idle = true;
  // The timer is made once and not re-armed per transfer: when it fires it closes the connection if it has been
  // idle for IDLE_MS, else checks again when it would have.
  connection.idleSince = performance.now();
  if (!connection.idleTimer) {
    connection.idleTimer = setTimeout(() => idleCheck(connection), IDLE_MS);
    connection.idleTimer.unref();
  }
}

function idleCheck(connection: KvConnection): void {
  if (connection.closed) return;
  const idleFor = performance.now() - connection.idleSince;
  if (connection.idle && idleFor >= IDLE_MS) return connection.destroy();
  connection.idleTimer = setTimeout(() => idleCheck(connection), connection.idle ? Math.max(1, IDLE_MS - idleFor) : IDLE_MS);
  connection.idleTimer.unref();
}

/**
 * The idle pool's key of a prefill worker's KV port: the last one made is reused when the same worker comes again (a
 * new string per transfer would be flattened and hashed at each lookup).
 */
let lastKey = { host: '', port: -1, token: '', key: '' };
function connectionKey(host: string, port: number, token: string): string {
  if (host !== lastKey.host || port !== lastKey.port || token !== lastKey.token) lastKey = { host, port, token, key: `${host}:${port}:${token}` };
  return lastKey.key;
}

/** The most recently idle connection to the worker, taken out of the pool; undefined when none. */
function takeIdle(key: string): KvConnection | undefined {
  // (An emptied list stays in the map: it is refilled when the transfer ends. dropIdle removes it.)
  const connection = idleConnections.get(key)?.pop();
  if (!connection) return undefined;
  // Its timer stays armed: it does nothing to a connection in use, and checks again later.
  connection.idle = false;
  connection.socket.ref();
  return connection;
}

/** Closes the kept-alive KV connections of this process, or only those to one prefill worker's KV port. */
export function closeIdleKvConnections(to?: { host: string; port: number }): void {
  for (const list of [...idleConnections.values()]) {
    for (const connection of [...list]) {
      if (!to || connection.key.startsWith(`${to.host}:${to.port}:`)) connection.destroy();
    }
  }
}

/**
 * The checksum-and-copy of the run pieces one read holds, made in one native call at the end of the read (or before a
 * control frame, or a credit): from the read buffer into the pool, and from the ring into the pool. A read is used
 * up before the callback returns, so one pair serves every transfer of the process.
 */
const readBatch = new KvChecksumBatch();
const ringBatch = new KvChecksumBatch();
/**
 * The runs whose last piece is in the batches, to check once they ran: per run its batch (0 read, 1 ring), index
 * there, expected CRC-32C, run number and layer.
 */
const pendingChecks = {
  /** Reused for every read: an array emptied with length = 0 would grow its storage anew each read. */
  list: new Float64Array(5 * 64),
  length: 0,
  push(batch: number, index: number, checksum: number, run: number, layer: number): void {
    if (this.length + 5 > this.list.length) {
      const grown = new Float64Array(2 * this.list.length);
      grown.set(this.list);
      this.list = grown;
    }
    const list = this.list;
    const at = this.length;
    list[at] = batch;
    list[at + 1] = index;
    list[at + 2] = checksum;
    list[at + 3] = run;
    list[at + 4] = layer;
    this.length = at + 5;
  },
};

/**
 * The decode side's deadlines: one timer for all of the process's transfers, armed for the earliest, instead of a
 * timer set and cleared per transfer (about a microsecond of a small transfer's CPU, part of it on its critical
 * path). Unreferenced: a transfer's own socket keeps the process alive while the transfer runs.
 */
const deadlines = new Set<Receiver>();
const MAX_TIMER_MS = 2 ** 31 - 1;
let deadlineTimer: NodeJS.Timeout | undefined;
let deadlineTimerAt = Infinity;

function armDeadlines(at: number): void {
  if (at >= deadlineTimerAt) return;
  clearTimeout(deadlineTimer);
  deadlineTimerAt = at;
  deadlineTimer = setTimeout(checkDeadlines, Math.min(MAX_TIMER_MS, Math.max(1, Math.ceil(at - performance.now()))));
  deadlineTimer.unref();
}

function checkDeadlines(): void {
  deadlineTimer = undefined;
  deadlineTimerAt = Infinity;
  const now = performance.now();
  let next = Infinity;
  // (A receiver that expires leaves the set as it is visited: a Set's iteration allows that.)
  for (const receiver of deadlines) {
    if (receiver.deadlineAt <= now) receiver.expire();
    else if (receiver.deadlineAt < next) next = receiver.deadlineAt;
  }
  if (next < Infinity) armDeadlines(next);
}

/** What the decode side's parser waits for. */
type ReceiveState = 0 | 1 | 2; // 0 a frame's header, 1 a run's bytes, 2 a control frame
const HEAD = 0;
const BODY = 1;
const CONTROL = 2;

/** A transfer on the decode side: parses its connection's bytes into the destination blocks, checking each run. */
class Receiver implements KvTransferHandle {
  readonly result: Promise<KvPullResult>;
  private resolve!: (result: KvPullResult) => void;
  private reject!: (error: Error) => void;
  private readonly requestId: string;
  private readonly destinations: readonly number[];
  private readonly layers: readonly [number, number];
  private readonly first: number;
  private readonly view: KvPoolView;
  private readonly pool: Uint8Array;
  private readonly runBytes: number;
  private readonly positions: number;
  /** A (position, layer, K|V) came: 1. */
  private readonly covered: Uint8Array;
  private numCovered = 0;
  /** Destination id -> position, made only for a run that is not where the descriptor's order puts it. */
  private positionOf: Map<number, number> | undefined;
  /** The position after the last run: the next run's, in the order the prefill side sends them. */
  private nextPosition = 0;
  private readonly started = performance.now();
  private readonly direct: boolean;
  private readonly uncached: boolean;
  private settled = false;
  /** When the deadline passes (performance.now()), and the ms it was set to; Infinity: none. */
  deadlineAt = Infinity;
  private deadlineMs = 0;
  private link: KvLink = 'tcp';
  private runs = 0;
  private bytesIn = 0;
  /** Anything came back on this connection for this transfer (a kept-alive one that closed before: retried once). */
  private answered = false;
  private reused: boolean;
  private connection: KvConnection;
  private readonly key: string;
  private readonly askFrame: Buffer;
  private readonly options: KvPullOptions;
  /** A pull's source blocks: kv-done must name exactly these. */
  private readonly pullSources: readonly number[] | null;
  private readonly signal: AbortSignal | undefined;
  private abortListener: (() => void) | undefined;

  // Parser state: a frame header (5 bytes, then a run's header), a run's bytes, or a control frame.
  private readonly head = Buffer.allocUnsafe(5 + RUN_HEADER_BYTES + SHM_OFFSET_BYTES);
  private headHave = 0;
  private headNeed = 5;
  /** The current run's layer and byte length (from its header). */
  private runLayer = 0;
  private runByteLength = 0;
  private state: ReceiveState = HEAD;
  private frameLength = 0;
  private bodyAt = 0;
  private bodyLeft = 0;
  private bodyCrc = 0;
  private bodyChecksum = 0;
  /** A control frame's kind (binary or JSON), the pieces of it so far (when split over reads), and what is left of it. */
  private controlKind = FRAME_KV_CONTROL;
  private controlPieces: Buffer[] = [];
  private controlLeft = 0;
  /** Set by kv-done: the connection goes back to the pool once the read that carried it is used up. */
  private doneCleanly = false;

  constructor(type: KvDescriptorMessage['type'], sourceBlockIds: readonly number[] | null, descriptor: KvStreamDescriptor, options: KvPullOptions) {
    this.options = options;
    this.pullSources = sourceBlockIds;
    this.view = options.destination;
    this.requestId = descriptor.requestId;
    this.destinations = descriptor.destinationBlockIds;
    this.layers = descriptor.layers;
    this.first = descriptor.firstBlock ?? 0;
    this.direct = receiveMode === 'direct';
    // The descriptor goes first: the prefill side works on it while this side sets up the rest (nothing of the
    // answer can be read before the constructor returns).
    const hostId = options.link === 'tcp' ? null : kvHostId();
    this.key = connectionKey(options.host, options.port, options.clusterToken);
    this.askFrame = encodeDescriptor({
      type, requestId: this.requestId, layers: descriptor.layers, hostId, sourceBlockIds, destinationBlockIds: this.destinations, firstBlock: this.first,
    });
    // 'direct' reads need a connection of their own (its read buffer is the small one).
    const idle = this.direct ? undefined : takeIdle(this.key);
    this.reused = idle !== undefined;
    if (idle) {
      this.connection = idle;
      kvConnectionStats.reused++;
      idle.receiver = this;
      idle.transfers++;
      idle.socket.write(this.askFrame);
    } else {
      this.connection = this.open();
    }
    this.runBytes = kvBlockRunBytes(this.view.layout);
    this.pool = new Uint8Array(this.view.pool);
    this.positions = this.destinations.length;
    this.covered = new Uint8Array(this.positions * (this.layers[1] - this.layers[0]) * 2);
    this.uncached = !this.direct && uncachedCopy(this.covered.length * this.runBytes);
    this.result = new Promise<KvPullResult>((resolve, reject) => {
      this.resolve = resolve;
      this.reject = reject;
    });
    this.signal = options.signal;
    if (this.signal?.aborted) this.aborted();
    else if (this.signal) {
      this.abortListener = () => this.aborted();
      this.signal.addEventListener('abort', this.abortListener, { once: true });
    }
  }

  cancel(why: string): void {
    this.finish(new KvTransferError('cancelled', `KV transfer of ${this.requestId} cancelled: ${why}`));
  }

  deadline(ms: number): void {
    if (this.settled) return;
    this.deadlineMs = ms;
    // As setTimeout takes a delay: one out of its range (or not a number) means 1 ms.
    this.deadlineAt = performance.now() + (ms >= 1 && ms <= MAX_TIMER_MS ? ms : 1);
    deadlines.add(this);
    armDeadlines(this.deadlineAt);
  }

  /** Called by the deadline timer once deadlineAt has passed. */
  expire(): void {
    this.finish(new KvTransferError('timeout', `KV transfer of ${this.requestId} took over ${this.deadlineMs} ms`));
  }

  private aborted(): void {
    this.finish(new KvTransferError('aborted', `KV transfer of ${this.requestId} aborted after ${this.runs} runs`));
  }

  /** A new connection, the hello and the descriptor in one write (the prefill side reads both at once). */
  private open(): KvConnection {
    // Reads land in one reused buffer (no allocation per read); each piece is copied on to its block at once.
    const readBuffer = this.direct ? Buffer.allocUnsafe(DIRECT_READ_BUFFER_BYTES) : (copyReadBuffer ??= Buffer.allocUnsafe(COPY_READ_BUFFER_BYTES));
    const fresh = new KvConnection(this.key, this.options.host, this.options.port, readBuffer);
    kvConnectionStats.opened++;
    fresh.receiver = this;
    fresh.transfers++;
    fresh.socket.on('connect', () => {
      fresh.socket.write(Buffer.concat([encodeJsonFrame({ t: 'kv-hello', v: KV_TCP_VERSION, token: this.options.clusterToken }), this.askFrame]));
    });
    return fresh;
  }

  private finish(error: KvTransferError | null, done?: { sourceBlockIds: number[]; overlapMs: number }): void {
    if (this.settled) return;
    this.settled = true;
    deadlines.delete(this);
    if (this.abortListener) this.signal!.removeEventListener('abort', this.abortListener);
    if (error) {
      // Whatever of the transfer is still on its way must not reach another: the connection goes.
      this.connection.receiver = null;
      this.connection.destroy();
      error.link ??= this.link;
      this.reject(error);
    } else {
      this.doneCleanly = true;
      this.resolve({
        bytes: this.bytesIn, blocks: this.positions, runs: this.runs, ms: performance.now() - this.started, link: this.link,
        sourceBlockIds: done!.sourceBlockIds, overlapMs: done!.overlapMs,
      });
    }
  }

  private fail(reason: KvTransferFailure, message: string): never {
    throw new KvTransferError(reason, `KV transfer of ${this.requestId}: ${message}`);
  }

  /** The connection closed or failed. */
  connectionEnded(error: Error): void {
    // A kept-alive connection the prefill side had closed meanwhile: the same descriptor once more on a new one.
    if (!this.settled && !this.answered && this.reused) {
      this.reused = false;
      this.connection = this.open();
      return;
    }
    this.finish(new KvTransferError(this.runs === 0 && this.bytesIn === 0 && !this.answered ? 'connect' : 'truncated',
      `KV transfer of ${this.requestId}: ${error.message} after ${this.runs} runs (${this.numCovered} of ${this.covered.length} block layers)`));
  }

  /**
   * A frame's first 5 bytes at head[h]: checks its length for its kind; a control frame's payload comes next (state
   * CONTROL). Returns the bytes of the frame's header: 5 for a control frame, a run's with its run header.
   */
  private frameStart(head: Buffer, h: number): number {
    const length = getU32(head, h);
    const kind = head[h + 4]!;
    this.frameLength = length;
    if (kind === FRAME_KV_RUN) {
      if (length < 1 + RUN_HEADER_BYTES) this.fail('length', `run frame of ${length} bytes`);
      return 5 + RUN_HEADER_BYTES;
    }
    if (kind === FRAME_KV_SHM_RUN) {
      if (length !== 1 + RUN_HEADER_BYTES + SHM_OFFSET_BYTES) this.fail('length', `shared-memory run frame of ${length} bytes`);
      return SHM_RUN_FRAME_BYTES;
    }
    if (kind === FRAME_KV_CONTROL || kind === FRAME_JSON) {
      if (length < 2 || length > MAX_CONTROL_BYTES) this.fail('length', `control frame of ${length} bytes`);
      this.controlKind = kind;
      this.controlLeft = length - 1;
      this.state = CONTROL;
      return 5;
    }
    return this.fail('unexpected-run', `unexpected frame of kind ${kind} after ${this.runs} runs`);
  }

  /** Where destination block `destination` is in the descriptor: where the order says, else looked up. */
  private positionOfBlock(destination: number): number | undefined {
    const destinations = this.destinations;
    if (destinations[this.nextPosition] === destination) return this.nextPosition;
    if (destinations[0] === destination) return 0;
    if (!this.positionOf) {
      this.positionOf = new Map();
      for (let p = 0; p < destinations.length; p++) this.positionOf.set(destinations[p]!, p);
    }
    return this.positionOf.get(destination);
  }

  /** A run's header is in: check it against the descriptor, then take its bytes (tcp) or copy them from the ring (shm). */
  private startRun(head: Buffer, h: number): void {
    const layer = (head[h + 5]! << 8) | head[h + 6]!;
    const kv = head[h + 7]!;
    const destination = getU32(head, h + 9);
    const count = getU32(head, h + 13);
    const byteLength = getU32(head, h + 17);
    this.runLayer = layer;
    this.runByteLength = byteLength;
    const { layers, positions, destinations } = this;
    const position = this.positionOfBlock(destination);
    if (layer < layers[0] || layer >= layers[1] || kv > 1 || count < 1 || position === undefined || position + count > positions) {
      this.fail('unexpected-run', `run ${this.runs} (layer ${layer}/${kv}, block ${destination}x${count}) is not in the descriptor`);
    }
    for (let i = 1; i < count; i++) {
      if (destinations[position + i] !== destination + i) this.fail('unexpected-run', `run ${this.runs}: blocks ${destination}x${count} are not consecutive destinations`);
    }
    if (byteLength !== count * this.runBytes) this.fail('length', `run ${this.runs}: header says ${byteLength} bytes, expected ${count * this.runBytes}`);
    this.nextPosition = position + count;
    // Covered now, checked when its bytes are (before anything reads the coverage: a control frame, or the end).
    const mark = ((layer - layers[0]) * 2 + kv) * positions + position;
    for (let i = 0; i < count; i++) {
      if (this.covered[mark + i] === 0) {
        this.covered[mark + i] = 1;
        this.numCovered++;
      }
    }
    this.bodyAt = ((2 * layer + kv) * this.view.layout.numBlocks + destination) * this.runBytes;
    this.bodyLeft = byteLength;
    this.bodyChecksum = getU32(head, h + 21);
    this.bodyCrc = 0;
    if (head[h + 4] === FRAME_KV_RUN) {
      if (this.frameLength !== 1 + RUN_HEADER_BYTES + byteLength) this.fail('length', `run ${this.runs}: frame of ${this.frameLength} bytes for ${byteLength} bytes of KV`);
      this.state = BODY;
      return;
    }
    const connection = this.connection;
    const ring = connection.ring;
    if (this.link !== 'shm' || !ring) this.fail('unexpected-run', 'a shared-memory run on the tcp link');
    const at = getU32(head, h + 29) * 2 ** 32 + getU32(head, h + 33);
    const size = connection.ringSize;
    if (at < connection.consumed || (at % size) + byteLength > size) {
      this.fail('unexpected-run', `run ${this.runs}: ring position ${at} is behind ${connection.consumed} or crosses the ring's end`);
    }
    // Checksummed on the way from the ring into the block (the bytes are read once), with the read's other runs.
    this.endRun(1, ringBatch.add(at % size, this.bodyAt, byteLength), byteLength);
    this.bodyLeft = 0;
    connection.consumed = at + byteLength;
    if (connection.consumed - connection.credited >= size / 4) {
      // The space goes back only once its runs are copied out.
      this.runBatches();
      connection.credited = connection.consumed;
      connection.socket.write(encodeCredit(connection.consumed));
    }
  }

  /** A run's last piece is in a batch: its checksum is checked when the batch has run. */
  private endRun(batch: 0 | 1, index: number, byteLength: number): void {
    pendingChecks.push(batch, index, this.bodyChecksum, this.runs, this.runLayer);
    this.bytesIn += byteLength;
    this.runs++;
    this.state = HEAD;
  }

  /** Copies what the batches hold into the blocks and checks the runs that ended in them. */
  private runBatches(): void {
    if (readBatch.count > 0) readBatch.run(this.readSource!, this.pool, this.uncached);
    if (ringBatch.count > 0) ringBatch.run(this.connection.ring!.bytes, this.pool, this.uncached);
    if (this.partialIndex >= 0) this.bodyCrc = readBatch.crc(this.partialIndex);
    this.partialIndex = -1;
    let mismatch = -1;
    const checks = pendingChecks.list;
    for (let i = 0; i < pendingChecks.length && mismatch < 0; i += 5) {
      const crc = (checks[i] === 0 ? readBatch : ringBatch).crc(checks[i + 1]!);
      if (crc !== checks[i + 2]) mismatch = i;
    }
    readBatch.clear();
    ringBatch.clear();
    const run = checks[mismatch + 3];
    const layer = checks[mismatch + 4];
    pendingChecks.length = 0;
    if (mismatch >= 0) this.fail('checksum', `run ${run} (layer ${layer}): checksum mismatch`);
  }

  /** The read being parsed (the batches' source), and the batch index of a run's piece that does not end it. */
  private readSource: Buffer | undefined;
  private partialIndex = -1;

  /** A control frame's payload: binary (kv-link, kv-done) or, kv-error, JSON. */
  private control(kind: number, payload: Buffer): void {
    if (kind === FRAME_JSON) {
      const message = parseJsonMessage(payload);
      if (message.t === 'kv-error') this.fail('refused', `refused: ${String(message.reason)}`);
      this.fail('unexpected-run', `unexpected message ${String(message.t).slice(0, 40)}`);
    }
    if (payload.length === 2 && payload[0] === KV_LINK && payload[1] === 0) {
      // The tcp kv-link (its two bytes are all of it), as every tcp transfer starts: no message to make.
      this.link = 'tcp';
      return;
    }
    const message = parseControl(payload);
    if (message.type === KV_LINK) {
      const connection = this.connection;
      if (message.link === 'shm') {
        const name = message.region!;
        const size = message.regionBytes;
        if (connection.ring?.name !== name) {
          connection.ring?.close();
          connection.ring = null;
          try {
            connection.ring = ShmRegion.open(name, size);
          } catch (error) {
            // Gone already: the prefill side closed the connection (and removed its region) right after naming it.
            const gone = (error as NodeJS.ErrnoException).code === 'ENOENT';
            this.fail(gone ? 'truncated' : 'link', `cannot map the shared-memory ring: ${(error as Error).message}`);
          }
          connection.ringSize = size;
          connection.consumed = 0;
          connection.credited = 0;
        }
        this.link = 'shm';
      } else {
        this.link = 'tcp';
      }
      return;
    }
    if (message.type !== KV_DONE) this.fail('unexpected-run', `unexpected control message ${message.type}`);
    if (this.numCovered !== this.covered.length || message.bytes !== this.bytesIn) {
      this.fail('truncated', `done with ${this.numCovered} of ${this.covered.length} block layers (${this.bytesIn} bytes, the prefill side says ${message.bytes})`);
    }
    const sources = message.sourceBlockIds;
    if (sources.length !== this.first + this.positions) this.fail('unexpected-run', 'kv-done does not name a source block per position');
    const asked = this.pullSources;
    if (asked) {
      for (let i = 0; i < sources.length; i++) if (sources[i] !== asked[i]) this.fail('unexpected-run', 'the prefill side sent other source blocks');
    }
    const overlapMs = message.overlapMs;
    this.finish(null, { sourceBlockIds: sources, overlapMs: Number.isFinite(overlapMs) && overlapMs >= 0 ? overlapMs : 0 });
  }

  /**
   * Reads the rest of the current run from the socket straight into its destination block, as far as the kernel
   * has bytes (the next bytes of the stream are the run's: the read buffer was used up). No copy through the read
   * buffer; the checksum is taken of what landed, while it is in cache.
   */
  private readDirect(): void {
    const fd = (this.connection.socket as unknown as { _handle?: { fd?: unknown } })._handle?.fd;
    if (typeof fd !== 'number' || !Number.isInteger(fd) || fd < 0) return;
    const pool = this.pool;
    // Bounded per turn of the event loop: the rest comes at the next.
    for (let budget = DIRECT_READ_BUDGET; this.bodyLeft > 0 && budget > 0;) {
      let n: number;
      // The usual end of this loop is EAGAIN, an exception: without a stack trace it costs little.
      const stackTraceLimit = Error.stackTraceLimit;
      Error.stackTraceLimit = 0;
      try {
        n = readSync(fd, pool, this.bodyAt, this.bodyLeft, null);
      } catch {
        // EAGAIN: nothing more now. Anything else (a reset): the socket's own read reports it.
        return;
      } finally {
        Error.stackTraceLimit = stackTraceLimit;
      }
      if (n === 0) return; // end of stream: the socket's own read sees it too
      this.bodyCrc = kvChecksum(pool.subarray(this.bodyAt, this.bodyAt + n), this.bodyCrc);
      this.bodyAt += n;
      this.bodyLeft -= n;
      budget -= n;
    }
  }

  /** n bytes arrived at the start of buffer (the connection's read buffer, or a direct one). */
  bytes(buffer: Buffer, n: number): void {
    this.answered = true;
    readBatch.clear();
    ringBatch.clear();
    pendingChecks.length = 0;
    this.readSource = buffer;
    this.partialIndex = -1;
    let i = 0;
    try {
      while (i < n && !this.settled) {
        if (this.state === BODY) {
          const take = Math.min(this.bodyLeft, n - i);
          const index = readBatch.add(i, this.bodyAt, take, this.bodyCrc);
          this.bodyAt += take;
          this.bodyLeft -= take;
          i += take;
          if (this.bodyLeft > 0) {
            // The read is used up inside a run: its CRC so far comes out of the batch, for the next read's piece.
            this.partialIndex = index;
            if (this.direct) {
              // 'direct': what the socket holds next is this run's, read straight into its block.
              this.runBatches();
              this.readDirect();
              if (this.bodyLeft === 0) {
                pendingChecks.push(0, readBatch.add(0, 0, 0, this.bodyCrc), this.bodyChecksum, this.runs, this.runLayer);
                this.bytesIn += this.runByteLength;
                this.runs++;
                this.state = HEAD;
              }
            }
          } else {
            this.endRun(0, index, this.runByteLength);
          }
          continue;
        }
        if (this.state === CONTROL) {
          const take = Math.min(this.controlLeft, n - i);
          // Everything before the control frame is copied and checked first (kv-done reads the coverage).
          this.runBatches();
          if (this.controlPieces.length === 0 && take === this.controlLeft) {
            // The whole message is in this read (the usual case): parsed from the read buffer, before its next read.
            this.controlLeft = 0;
            i += take;
            this.state = HEAD;
            this.control(this.controlKind, buffer.subarray(i - take, i));
            continue;
          }
          this.controlPieces.push(Buffer.from(buffer.subarray(i, i + take)));
          this.controlLeft -= take;
          i += take;
          if (this.controlLeft === 0) {
            this.state = HEAD;
            const payload = Buffer.concat(this.controlPieces);
            this.controlPieces = [];
            this.control(this.controlKind, payload);
          }
          continue;
        }
        if (this.headHave === 0 && n - i >= 5) {
          // The usual case: the whole header is in this read, parsed where it lies (no copy).
          const need = this.frameStart(buffer, i);
          if (need === 5) {
            i += 5;
            continue;
          }
          if (n - i >= need) {
            this.startRun(buffer, i);
            i += need;
            continue;
          }
        }
        // A header split over reads: gathered in this.head first.
        const take = Math.min(this.headNeed - this.headHave, n - i);
        buffer.copy(this.head, this.headHave, i, i + take);
        this.headHave += take;
        i += take;
        if (this.headHave < this.headNeed) break;
        if (this.headNeed === 5) {
          const need = this.frameStart(this.head, 0);
          if (need === 5) this.headHave = 0;
          else this.headNeed = need;
          continue;
        }
        this.headHave = 0;
        this.headNeed = 5;
        this.startRun(this.head, 0);
      }
      if (!this.settled) this.runBatches();
    } catch (error) {
      readBatch.clear();
      ringBatch.clear();
      pendingChecks.length = 0;
      this.finish(error instanceof KvTransferError ? error : new KvTransferError('unexpected-run', (error as Error).message));
      return;
    }
    if (this.doneCleanly) {
      // Nothing may follow kv-done before the next descriptor: a connection that says more is not kept.
      // ('direct' connections have the small read buffer: not kept for others.)
      if (i < n || this.direct) this.connection.destroy();
      else keepIdle(this.connection);
    }
  }
}


// ---------------------------------------------------------------------------------------------------------------
// The handoff on the request plane

/** A handoff as JSON carries it (its request's logit bias as pairs). */
export function toWireHandoff(handoff: KvHandoff): unknown {
  return { ...handoff, request: toWireRequest(handoff.request) };
}

/** A handoff received from the network, checked before an engine sees it. */
export function parseWireHandoff(value: unknown): KvHandoff {
  if (typeof value !== 'object' || value === null) throw new TypeError('invalid KV handoff: not an object');
  const raw = value as Record<string, unknown>;
  return validateHandoff({ ...raw, request: parseWireRequest(raw.request) });
}

// ---------------------------------------------------------------------------------------------------------------
// The channel a frontend pairs remote workers with

/**
 * Prefill and decode worker processes: nothing is attached ahead of time. The decode worker pulls the blocks from
 * the prefill worker's KV port (its RemoteEngine's kvSourceAddress says where) when it adopts a request.
 */
export class TcpKvChannel extends PairedChannel {
  readonly kind = 'tcp';

  connect(prefill: KvSourceEndpoint, decode: KvSinkEndpoint): void {
    this.addPair(prefill.id, decode.id);
  }

  /**
   * Any prefill worker, paired or not: whether its KV port can still be reached is the decode worker's resolver's to
   * say (kvSourceAddress), and a draining prefill worker, out of the router, still serves the blocks it handed off.
   */
  override sourceFor(prefillId: string): string | null {
    return prefillId;
  }
}
