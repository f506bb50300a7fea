// The worker side of the request plane: serves one local engine (a cpu LocalEngine, a SimEngine, anything behind
// the Engine interface) to frontends over TCP.
//
// Each connection must open with a hello carrying the cluster token (and fit MAX_HELLO_BYTES); a wrong token, a
// frame over the limit, a frame that is not a message or a request that does not validate is logged with its
// reason and the connection is closed. The process and every other connection go on. The exception is a request
// (gen, prefill) whose frame is over --max-frame-bytes, from a frontend that did not check it against the limit the
// welcome gave (an earlier release): that request alone is refused (an invalid_request error, the frame skipped
// unread) and the connection, with the other requests on it, stays. A connection that closes
// aborts every request it started (the frontend is gone, or gave up on this worker), so nothing keeps running for
// nobody; a frontend that pings (its hello says so) and then falls silent past the silence timeout (its host
// vanished, a partition) has its connection closed, to the same effect. Cancellation from the frontend is an `abort`
// message, and the unpinning of a handed-off request a `release`: each from the connection that owns the request
// only. A drain whose grace runs out stops the requests still running and ends each with an `err` frame
// (EngineClosedError: the frontend sees the worker lost and migrates the request, or reports the error), not as a
// normal end: only the frontend's abort ends a stream as aborted.
//
// The server keeps a mirror of the engine's cached block hashes, built from the engine's own KV events (they
// replay to its cached set), so it can answer a snapshot (resync) request without asking the engine.

import net from 'node:net';
import { v8Serialize } from './blob.ts';
import { LoraLoadError } from '../engine/errors.ts';
import type { Engine, EngineOutput, EngineRequest, WorkerRole } from '../engine/types.ts';
import type { ChatTemplate } from '../model/chat-template.ts';
import type { Tokenizer } from '../model/tokenizer/types.ts';
import { isBlockHash, KV_LOWER_TIERS, type BlockHash, type KvEvent, type KvLowerTier } from '../protocols/kv-events.ts';
import { LoraCapacityError, type LoraManager } from '../runtime/lora-manager.ts';
import type { RoutableEngine } from '../runtime/worker-group.ts';
import type { DecodeWorkerEngine, PrefillWorkerEngine } from '../runtime/disaggregated.ts';
import type { AdoptedResult, KvHandoff, KvTransferStats, PrefillEvent, PrefillProgress } from '../engine/handoff.ts';
import { KV_IN_PLACE_SOURCE, kvBlockBytes, type KvPoolLayout, type KvPoolView } from '../engine/handoff.ts';
import { engineNow } from '../engine/clock.ts';
import type { EngineStats, KvLinkStats } from '../protocols/worker.ts';
import { shiftAdopted, shiftHandoff, shiftOutput, shiftRequest, tightenClockOffset } from './clock-offset.ts';
import {
  KvTransferError, KvTransferServer, parseWireHandoff, pullKvBlocks, streamKvBlocks, toWireHandoff, type KvLink,
  type KvPullResult, type KvTransferHandle,
} from './kv-tcp.ts';
import type { KvLinkPreference } from './kv-shm.ts';
import {
  DEFAULT_MAX_FRAME_BYTES, encodeBlobFrame, encodeJsonFrame, FrameError, FrameReader, FRAME_JSON, OversizedFrameError, parseJsonMessage,
  type Frame,
} from './frames.ts';
import {
  FRONTEND_SILENCE_TIMEOUT_MS, frameOverLimit, frontendPingMs, HEARTBEAT_MS, MAX_HELLO_BYTES, mayBeOversizedRequest,
  OVERSIZED_HEAD_BYTES, oversizedRequest, parseWireRequest, REQUEST_PLANE_VERSION, tokenMatches, type KvSnapshot, type ModelCard, type Welcome,
} from './request-plane.ts';

export type ClusterLog = (level: 'debug' | 'info' | 'warn' | 'error', message: string) => void;

/** What starts a request's stream: its events, or a promise of them. */
type Startable<T> = AsyncIterable<T> | Promise<Iterable<T> | AsyncIterable<T>>;

export interface WorkerServerOptions {
  workerId: string;
  engine: RoutableEngine;
  role?: WorkerRole;
  /** The shared secret every connection must present. */
  clusterToken: string;
  maxFrameBytes?: number;
  tokenizer?: Tokenizer;
  chatTemplate?: ChatTemplate;
  log?: ClusterLog;
  /** Fault injection on a prefill worker's KV port, for tests (see KvTransferServerOptions.faults). */
  kvFaults?: { corruptRun?: number; truncateAfterRuns?: number; stallAfterRuns?: number };
  /** 'tcp': KV transfers never use shared memory, even between workers on one host (default 'auto'). */
  kvLink?: KvLinkPreference;
  /** A prefill worker's KV port (default 0: any free port), for firewalls that open one port. */
  kvPort?: number;
  /**
   * The worker's own LoRA adapters (`conduit worker`): lora-load / lora-unload register and unregister them here,
   * and a request's `lora` is the key this manager gave the adapter (acquired, so loaded again if it was evicted,
   * for as long as the request runs). Without it (a `conduit serve --worker-processes` child) the parent's
   * manager decides, and lora-load / lora-unload reach the engine as they are.
   */
  adapters?: LoraManager;
  /** Called after lora-load / lora-unload changed `adapters` (the worker publishes the new list). */
  onAdaptersChanged?: () => void;
  /**
   * How long a frontend that pings (its hello says so) may send nothing before its connection is closed and its
   * requests stopped (default FRONTEND_SILENCE_TIMEOUT_MS; 0: never, frontends are then asked for no pings).
   */
  frontendSilenceTimeoutMs?: number;
}

/**
 * Bytes written to a frontend's connection that it has not read yet, past which the worker reads no more of that
 * connection's frames until they are sent: a few frames of a few bytes each (card, snapshot) are answered with
 * megabytes, and a peer that asks without reading must not make the worker hold every answer.
 */
export const MAX_UNSENT_BYTES = 8 * 1024 * 1024;

/** How long a KV stream started before its handoff may wait for it (the prefill's queue and compute). */
const STREAM_UNCLAIMED_MS = 10 * 60_000;
/**
 * How long an expected request's stream waits, at most, for another import under way here that brings the leading
 * blocks of its prompt (they are then held from the cache instead of moved again).
 */
const SHARED_PREFIX_WAIT_MS = 5_000;
/** Stream failures that mean the KV cannot be trusted, as opposed to a stream nobody needed any more. */
const INTEGRITY_FAILURES: ReadonlySet<string> = new Set(['checksum', 'length', 'unexpected-run', 'truncated', 'link']);
/** How long the rest of a transfer may take once the handoff is here. */
const TRANSFER_TIMEOUT_MS = 30_000;

/** A KV stream a decode worker started when told a request would prefill elsewhere (see expect()). */
interface IncomingStream {
  /** Resolves once the destination blocks are known and the connection is open (handle set), or it gave up. */
  ready: Promise<void>;
  handle?: KvTransferHandle;
  /** Blocks of the prompt. */
  numBlocks: number;
  /** The prompt's full-block hashes as the frontend sent them, and how many leading blocks this worker holds cached. */
  hashes: BlockHash[];
  held: number;
  /** Destinations of the blocks after the held ones. */
  ids: number[];
  /** The destinations are blocks the engine reserved in its own pool (else staging blocks). */
  inPlace: boolean;
  /** The engine's preparation (hold, reservation) to release if the stream is not adopted. */
  ticket?: number;
  host: string;
  port: number;
  connection: Connection;
  claimed: boolean;
}

/** Where a handed-off request's KV is to be written on a decode worker (prepareImport). */
interface ImportTarget {
  /** Leading blocks of the prompt held from this worker's prefix cache: they do not move. */
  held: number;
  /** Blocks of the engine's own pool reserved for the others (written in place), or null: staging. */
  blockIds: number[] | null;
  ticket?: number;
}

/** The source id a decode worker's engine knows its TCP staging pool by. */
const STAGING_SOURCE = 'tcp-staging';
/** The link label of KV moved over the TCP transfer engine (kv-tcp.ts) when the link it took is not known. */
const KV_LINK_TCP = 'tcp';

/** One request's KV pull, as its kv_transfer reports it. */
interface PullFacts {
  /** Engine clock, ms. */
  startMs: number;
  bytes: number;
  /** Blocks that moved, and blocks this worker already held (not moved). */
  blocks: number;
  reused: number;
  runs: number;
  link: string;
  /** A streamed transfer: the link's busy ms before the prefill ended (hidden behind it). */
  overlapMs?: number;
}

interface Connection {
  socket: net.Socket;
  peer: string;
  authenticated: boolean;
  wantsEvents: boolean;
  /** Requests this connection started and that have not ended. */
  requests: Set<string>;
  /** The frontend's clock minus this worker's, as estimated so far (clock-offset.ts); undefined before any estimate. */
  clockOffset?: number;
  /** The frontend's hello said it pings: a silence past the timeout means it is gone. */
  pings: boolean;
  /** When bytes last came from the frontend, or it last took bytes of ours while we read none of its (performance.now()). */
  lastHeardAt: number;
  /** While its frames wait unread (MAX_UNSENT_BYTES): how far its reading had got at the last check (sentProgress). */
  readProgress?: { completed: number; queued: number };
}

/**
 * How far a peer has read what was written to its socket: the bytes of writes completed (handed to the kernel whole),
 * and the bytes of the write under way that the kernel has not taken yet. Node exposes the second only on the
 * socket's handle (libuv's write queue, updated as the kernel takes each part of a large write): without it, a peer
 * reading a frame of megabytes slowly would show no progress until the whole frame was taken.
 */
function sentProgress(socket: net.Socket): { completed: number; queued: number } {
  const queued = (socket as unknown as { _handle?: { writeQueueSize?: unknown } })._handle?.writeQueueSize;
  return { completed: socket.bytesWritten - socket.writableLength, queued: typeof queued === 'number' ? queued : 0 };
}

/**
 * The worker's KV cache as its events describe it: what a snapshot sends for a resync. The primary pool's blocks
 * replace the primary blocks of the router's index; each lower tier's (RAM, disk) replace that tier's. The tiers'
 * events share the id sequence but say nothing of the pool (a block copied down is still in the pool, one pushed out
 * of the RAM tier may be too, and the disk tier announces at start blocks the pool never held), so each set follows
 * only its own tier's events.
 */
export class KvMirror {
  readonly hashes = new Set<BlockHash>();
  readonly tiers: Record<KvLowerTier, Set<BlockHash>> = { ram: new Set(), disk: new Set() };
  lastEventId = 0;

  apply(events: readonly KvEvent[]): void {
    for (const event of events) {
      this.lastEventId = event.eventId;
      const held = event.tier === undefined ? this.hashes : this.tiers[event.tier];
      if (event.type === 'stored') for (const hash of event.blockHashes) held.add(hash);
      else if (event.type === 'removed') for (const hash of event.blockHashes) held.delete(hash);
      else held.clear();
    }
  }

  /** What a frontend resyncs from: every tier's blocks (a tier holding none is left out) and the last event id. */
  snapshot(): KvSnapshot {
    const tiers: NonNullable<KvSnapshot['tiers']> = {};
    for (const tier of KV_LOWER_TIERS) if (this.tiers[tier].size > 0) tiers[tier] = [...this.tiers[tier]];
    return { lastEventId: this.lastEventId, hashes: [...this.hashes], tiers };
  }
}

export class WorkerServer {
  readonly workerId: string;
  readonly kv = new KvMirror();
  private readonly server: net.Server;
  private readonly connections = new Set<Connection>();
  /** Every running request: which connection owns it (request ids are the frontend's, unique per frontend). */
  private readonly running = new Map<string, Connection>();
  private readonly kvListeners = new Set<(events: KvEvent[]) => void>();
  private readonly offEvents: (() => void) | undefined;
  private readonly heartbeat: NodeJS.Timeout;
  private readonly silenceWatch: NodeJS.Timeout | undefined;
  private readonly silenceTimeoutMs: number;
  /** Connections closed because their frontend fell silent (for tests and logs). */
  silentFrontends = 0;
  private draining = false;
  private readonly maxFrameBytes: number;
  private readonly idleWaiters: (() => void)[] = [];
  /** Connections refused and why (for tests and /health of the worker). */
  refusals = 0;
  /** Requests refused because their frame was over --max-frame-bytes (the connection stayed). */
  oversizedRequests = 0;
  /** Prefill role: serves pulls of handed-off blocks over TCP; their requests, pinned until released. */
  private kvServer: KvTransferServer | undefined;
  private kvPort: number | undefined;
  private readonly pinned = new Map<string, Connection>();
  /** Decode role: the staging pool KV pulled over TCP lands in before the engine copies it into its own pool. */
  private staging: { pool: SharedArrayBuffer; layout: KvPoolLayout; free: number[]; held: Map<string, number[]> } | undefined;
  /**
   * Decode role: the engine's own pool, when KV from other processes is written straight into blocks the engine
   * reserved for it (prepareKvImport), so the adoption copies nothing; staging is then used only when the pool has
   * no room. CONDUIT_KV_ADOPT_STAGING=1: always through staging (to compare).
   */
  private readonly inPlace: KvPoolView | undefined;
  /** Decode role: the engine's import preparations (holds, reservations) not yet handed to an adoption, by request. */
  private readonly reservations = new Map<string, number>();
  private readonly offAdopted: (() => void) | undefined;
  /**
   * KV transfers by outcome, one each: 'ok', or the failure reason (checksum, truncated, connect, ..., import: the
   * blocks came but the engine could not take them), as the link stats count the failures.
   */
  readonly kvTransfers = new Map<string, number>();
  /** Imports that fell back to a prefill here, by link: what the stats carry to frontends (their /metrics). */
  private linkStats: Record<string, KvLinkStats> = {};
  /** The last report's sequence number (stats()). */
  private reportSeq = 0;
  /** The last report stats() built, and the engine stats and link counts it was built from. */
  private lastReport: { engine: EngineStats; links: Record<string, KvLinkStats>; stats: EngineStats } | undefined;
  /** Decode role: KV streams started before their handoff, by request id. */
  private readonly incoming = new Map<string, IncomingStream>();
  /** Streams that failed a check before their handoff came: the adopt counts the failure and prefills here. */
  private readonly failedStreams = new Map<string, KvTransferError>();
  /**
   * Decode role: requests expected here whose KV is on its way (from expect until the request ends or its stream
   * fails): their prompt's block hashes, so that a later request with the same leading blocks waits for them to be
   * cached here instead of moving them again. Woken (endImport) when one ends.
   */
  private readonly importing = new Map<string, { hashes: readonly BlockHash[]; at: number }>();
  private readonly importEnded = new Set<() => void>();
  /** Decode role: streams that waited for another import's blocks before naming their destinations. */
  streamsDeferred = 0;
  private readonly offProgress: (() => void) | undefined;

  constructor(private readonly options: WorkerServerOptions) {
    this.workerId = options.workerId;
    this.maxFrameBytes = options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES;
    this.server = net.createServer((socket) => this.accept(socket));
    this.offEvents = options.engine.onKvEvents?.((events) => {
      this.kv.apply(events);
      const frame = encodeJsonFrame({ t: 'kv', events, stats: this.stats() });
      for (const c of this.connections) if (c.authenticated && c.wantsEvents) c.socket.write(frame);
      for (const listener of this.kvListeners) listener(events);
    });
    this.heartbeat = setInterval(() => this.sendHeartbeat(), HEARTBEAT_MS);
    this.heartbeat.unref();
    this.silenceTimeoutMs = options.frontendSilenceTimeoutMs ?? FRONTEND_SILENCE_TIMEOUT_MS;
    this.silenceWatch = this.watchSilence();
    const engine = options.engine as Partial<PrefillWorkerEngine & DecodeWorkerEngine>;
    if (this.role === 'prefill' && engine.kvPool && engine.kvLayout) {
      this.kvServer = new KvTransferServer({
        clusterToken: options.clusterToken, pool: { pool: engine.kvPool, layout: engine.kvLayout },
        isPinned: (id) => this.pinned.has(id), ...(options.log ? { log: options.log } : {}),
        ...(options.kvFaults ? { faults: options.kvFaults } : {}), ...(options.kvLink ? { link: options.kvLink } : {}),
      });
      const kvServer = this.kvServer;
      const withProgress = engine as { onPrefillProgress?(listener: (progress: PrefillProgress[]) => void): () => void };
      this.offProgress = withProgress.onPrefillProgress?.((progress) => {
        for (const p of progress) {
          if (p.fullBlockIds) kvServer.progress(p.requestId, p.fullBlockIds);
          else kvServer.reset(p.requestId);
        }
      });
    }
    if (this.role === 'decode' && engine.kvLayout && engine.attachKvSource && engine.onAdopted) {
      const layout = engine.kvLayout;
      const pool = new SharedArrayBuffer(kvBlockBytes(layout) * layout.numBlocks);
      this.staging = { pool, layout, free: Array.from({ length: layout.numBlocks }, (_, i) => layout.numBlocks - 1 - i), held: new Map() };
      engine.attachKvSource(STAGING_SOURCE, pool, layout);
      this.offAdopted = engine.onAdopted((result) => this.adopted(result));
      if (engine.kvPool && engine.prepareKvImport && engine.releaseKvImport && process.env.CONDUIT_KV_ADOPT_STAGING !== '1') {
        this.inPlace = { pool: engine.kvPool, layout };
      }
    }
  }

  get engine(): Engine {
    return this.options.engine;
  }

  get role(): WorkerRole {
    return this.options.role ?? 'both';
  }

  /** Frontend connections open now that passed the hello (one per frontend that joined this worker). */
  get frontendConnections(): number {
    let open = 0;
    for (const c of this.connections) if (c.authenticated && !c.socket.destroyed) open++;
    return open;
  }

  /** Bytes written to the connections and not yet sent (a frontend that does not read holds them here). */
  get unsentBytes(): number {
    let bytes = 0;
    for (const c of this.connections) bytes += c.socket.writableLength;
    return bytes;
  }

  /** Requests running now. */
  get inFlight(): number {
    return this.running.size;
  }

  /** Prefill role: handed-off requests whose blocks stay pinned until their frontend releases them. */
  get handoffsPinned(): number {
    return this.pinned.size;
  }

  /** Prefill role: KV runs written to decode workers since the start. */
  get kvRunsSent(): number {
    return this.kvServer?.runsSent ?? 0;
  }

  /** Decode role: KV pulls (or the prefix holds before them) under way now. */
  get pullsInFlight(): number {
    return this.pulling.size;
  }

  /** Decode role: staging blocks held by pulls and adoptions not done yet. */
  get stagingBlocksHeld(): number {
    return this.staging ? this.staging.layout.numBlocks - this.staging.free.length : 0;
  }

  /** Decode role: adoptions whose KV came by a stream started at expect (the others were pulled after the handoff). */
  streamsAdopted = 0;

  /** Decode role: streams started at expect whose connection is open (their destination blocks prepared). */
  get streamsOpen(): number {
    let open = 0;
    for (const stream of this.incoming.values()) if (stream.handle) open++;
    return open;
  }

  /** Decode role: engine import preparations (held prefixes, reserved blocks) no adoption has taken yet. */
  get importsPrepared(): number {
    return this.reservations.size;
  }

  /** Decode role: whether KV from other processes is written straight into the engine's pool. */
  get adoptsInPlace(): boolean {
    return this.inPlace !== undefined;
  }

  /** Listens; resolves with the bound port. */
  listen(port: number, host: string): Promise<number> {
    return new Promise((resolve, reject) => {
      this.server.once('error', reject);
      this.server.listen(port, host, () => {
        this.server.off('error', reject);
        const bound = (this.server.address() as net.AddressInfo).port;
        if (!this.kvServer) return resolve(bound);
        // The KV port (any free one unless set) on the same interface, told to frontends in the welcome.
        this.kvServer.listen(this.options.kvPort ?? 0, host).then((kvPort) => { this.kvPort = kvPort; resolve(bound); }, reject);
      });
    });
  }

  /** Subscribes to the engine's KV events (the event plane publishes them). */
  onKvEvents(listener: (events: KvEvent[]) => void): () => void {
    this.kvListeners.add(listener);
    return () => this.kvListeners.delete(listener);
  }

  /**
   * Drain: new requests are refused (frontends are told once, and a `gen` arriving later gets an overloaded error,
   * which the frontend's router treats as any busy worker's); resolves when the running requests have ended and,
   * on a prefill worker, the decode workers have taken the blocks handed off (the frontend releases them), or after
   * `graceMs`, when those left are stopped: the handed-off blocks are unpinned, and each request still running ends
   * with an EngineClosedError frame (to the frontend the worker is lost: it migrates the request when allowed, else
   * reports the error), never as a finished or aborted stream.
   */
  async drain(graceMs: number): Promise<void> {
    this.draining = true;
    const frame = encodeJsonFrame({ t: 'draining' });
    for (const c of this.connections) if (c.authenticated) c.socket.write(frame);
    if (this.idle) return;
    let timer: NodeJS.Timeout | undefined;
    const idle = new Promise<void>((resolve) => this.idleWaiters.push(resolve));
    const timeout = new Promise<'timeout'>((resolve) => { timer = setTimeout(() => resolve('timeout'), graceMs); });
    const result = await Promise.race([idle, timeout]);
    clearTimeout(timer);
    if (result === 'timeout') {
      this.log('warn', `drain: ${this.running.size} request(s) still running and ${this.pinned.size} handed off after ${graceMs} ms; stopping them (they end as on a lost worker)`);
      for (const id of [...this.pinned.keys()]) this.abortRequest(id);
      for (const id of [...this.running.keys()]) {
        this.cut.add(id);
        this.abortRequest(id);
      }
      await Promise.race([new Promise<void>((resolve) => this.idleWaiters.push(resolve)), new Promise((r) => setTimeout(r, 2000))]);
    }
  }

  /**
   * Requests the drain's grace ran out on: stopped here, they end with an EngineClosedError frame (see stream()),
   * whatever the engine's stream does once aborted.
   */
  private readonly cut = new Set<string>();

  /** Nothing running and no handed-off blocks waiting for a decode worker: what a drain waits for. */
  private get idle(): boolean {
    return this.running.size === 0 && this.pinned.size === 0;
  }

  private wakeIfIdle(): void {
    if (this.idle) for (const resolve of this.idleWaiters.splice(0)) resolve();
  }

  async close(): Promise<void> {
    clearInterval(this.heartbeat);
    clearInterval(this.silenceWatch);
    this.offEvents?.();
    this.offAdopted?.();
    this.offProgress?.();
    for (const id of [...this.incoming.keys()]) this.cancelIncoming(id, 'the worker is closing');
    await this.kvServer?.close();
    for (const c of this.connections) c.socket.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }

  /**
   * Closes the connection of a frontend that pings and has sent nothing for the silence timeout: its host vanished
   * or is cut off. The close stops its requests and frees their blocks (handed-off ones included), as any close does.
   * A connection whose frames this worker stopped reading (the frontend does not read its answers: MAX_UNSENT_BYTES)
   * is timed by what the frontend reads instead, its pings waiting unread meanwhile: one that takes none of the bytes
   * held for it for the timeout is as silent (a vanished host never reads them, and without this its requests and
   * blocks were held until TCP gave up retransmitting, many minutes later), while one that reads on is heard from
   * (the kernel takes more of what is held for it as the peer's reading frees its buffers).
   */
  private watchSilence(): NodeJS.Timeout | undefined {
    if (this.silenceTimeoutMs <= 0) return undefined;
    const tickMs = Math.max(1, Math.min(1000, this.silenceTimeoutMs / 2));
    let lastTick = performance.now();
    const timer = setInterval(() => {
      const now = performance.now();
      // This process was stalled: the frontends' pings may be waiting unread behind this timer. Count from now.
      const stalled = now - lastTick > 2 * tickMs;
      lastTick = now;
      for (const c of this.connections) {
        if (stalled) c.lastHeardAt = now;
        if (c.socket.isPaused()) {
          const progress = sentProgress(c.socket);
          const last = c.readProgress;
          // A write completed, or the kernel took more of the one under way: the peer read some of its answers.
          if (last && (progress.completed > last.completed || (progress.completed === last.completed && progress.queued < last.queued))) {
            c.lastHeardAt = now;
          }
          c.readProgress = progress;
        } else {
          c.readProgress = undefined;
        }
        if (!c.authenticated || !c.pings || c.socket.destroyed || now - c.lastHeardAt <= this.silenceTimeoutMs) continue;
        this.silentFrontends++;
        const running = c.requests.size + [...this.pinned.values()].filter((owner) => owner === c).length;
        const silence = c.readProgress
          ? `sent nothing (its frames wait unread) and read none of the ${c.socket.writableLength} bytes held for it for ${this.silenceTimeoutMs} ms`
          : `sent nothing for ${this.silenceTimeoutMs} ms (not even its ping)`;
        this.log('warn', `request plane: frontend at ${c.peer} ${silence}: `
          + `closing its connection${running > 0 ? ` and stopping its ${running} request(s)` : ''}`);
        c.socket.destroy();
      }
    }, tickMs);
    timer.unref();
    return timer;
  }

  // -------------------------------------------------------------------------------------------------------------

  private accept(socket: net.Socket): void {
    const peer = `${socket.remoteAddress}:${socket.remotePort}`;
    const connection: Connection = {
      socket, peer, authenticated: false, wantsEvents: false, requests: new Set(), pings: false, lastHeardAt: performance.now(),
    };
    this.connections.add(connection);
    socket.setNoDelay(true);
    socket.setKeepAlive(true, 1000);
    const reader = new FrameReader(MAX_HELLO_BYTES);
    // A peer that never says hello does not hold the connection.
    const helloTimer = setTimeout(() => this.refuse(connection, 'no hello within 10 s'), 10_000);
    /** Frames wait in the reader until what was written to the peer is sent (see MAX_UNSENT_BYTES). */
    let waitingForDrain = false;
    const handleFrames = (): void => {
      try {
        for (let frame = reader.next(); frame && !socket.destroyed; frame = reader.next()) {
          if (frame.kind !== FRAME_JSON) throw new FrameError('a worker accepts JSON frames only');
          if (frame.oversizedBytes !== undefined) {
            this.refuseOversized(connection, frame);
            continue;
          }
          const message = parseJsonMessage(frame.payload);
          if (!connection.authenticated) {
            clearTimeout(helloTimer);
            this.hello(connection, message);
            if (!connection.authenticated) return;
            reader.maxFrameBytes = this.maxFrameBytes;
            // A request over the limit is refused alone, when its frame's head names it (refuseOversized).
            reader.skipOversized = { headBytes: OVERSIZED_HEAD_BYTES, plausible: mayBeOversizedRequest };
            continue;
          }
          this.handle(connection, message);
          if (socket.writableLength > MAX_UNSENT_BYTES && !socket.destroyed) {
            // A peer that asks (model cards, snapshots: a few bytes each, megabytes answered) faster than it reads
            // would otherwise make this process buffer every answer. Its next frames wait, unread, until it reads.
            waitingForDrain = true;
            socket.pause();
            socket.once('drain', () => {
              waitingForDrain = false;
              if (socket.destroyed) return;
              socket.resume();
              handleFrames();
            });
            return;
          }
        }
      } catch (error) {
        this.refuse(connection, (error as Error).message);
      }
    };
    socket.on('data', (chunk: Buffer) => {
      if (socket.destroyed) return;
      connection.lastHeardAt = performance.now();
      try {
        reader.write(chunk);
      } catch (error) {
        this.refuse(connection, (error as Error).message);
        return;
      }
      if (!waitingForDrain) handleFrames();
    });
    socket.on('error', () => {});
    socket.on('close', () => {
      clearTimeout(helloTimer);
      this.connections.delete(connection);
      // The frontend is gone: what it started stops here, handed-off requests it will never release included.
      for (const id of connection.requests) this.abortRequest(id);
      for (const [id, owner] of this.pinned) if (owner === connection) this.abortRequest(id);
      for (const [id, stream] of this.incoming) if (stream.connection === connection) this.cancelIncoming(id, 'the frontend is gone');
    });
  }

  /**
   * A frame over --max-frame-bytes after the hello (its first bytes only, the rest skipped): the request it carries
   * is refused alone, with an invalid_request error naming the limit; a frame whose request cannot be named there
   * closes the connection, as any bad frame does.
   */
  private refuseOversized(connection: Connection, frame: Frame): void {
    const bytes = frame.oversizedBytes!;
    const request = oversizedRequest(frame.payload);
    if (!request) throw new OversizedFrameError(bytes, this.maxFrameBytes, frame.kind);
    this.oversizedRequests++;
    this.log('warn', `request plane: refusing request ${JSON.stringify(request.id)} (${request.t}) from ${connection.peer}: its frame of `
      + `${bytes} bytes is over this worker's limit of ${this.maxFrameBytes} bytes (--max-frame-bytes); the connection stays`);
    this.send(connection, {
      t: 'err', id: request.id, name: 'InvalidRequestError', code: 'invalid_request',
      message: `request ${JSON.stringify(request.id)}: ${frameOverLimit(bytes, this.workerId, this.maxFrameBytes)}`,
    });
  }

  private refuse(connection: Connection, reason: string): void {
    if (connection.socket.destroyed) return;
    this.refusals++;
    this.log('warn', `request plane: closing connection from ${connection.peer}: ${reason}`);
    if (!connection.authenticated) connection.socket.end(encodeJsonFrame({ t: 'refused', reason }));
    else connection.socket.end(encodeJsonFrame({ t: 'refused', reason }));
    setTimeout(() => connection.socket.destroy(), 1000).unref();
  }

  private hello(connection: Connection, message: { t: string } & Record<string, unknown>): void {
    if (message.t !== 'hello') return this.refuse(connection, `expected hello, got ${JSON.stringify(message.t).slice(0, 40)}`);
    if (message.v !== REQUEST_PLANE_VERSION) return this.refuse(connection, `request plane version ${String(message.v)} (this worker speaks ${REQUEST_PLANE_VERSION})`);
    if (!tokenMatches(this.options.clusterToken, message.token)) return this.refuse(connection, 'wrong cluster token');
    connection.authenticated = true;
    connection.wantsEvents = message.events === true;
    connection.pings = message.ping === true && this.silenceTimeoutMs > 0;
    const welcome: Welcome = {
      t: 'welcome', v: REQUEST_PLANE_VERSION, workerId: this.workerId, role: this.role, info: this.options.engine.info,
      stats: this.stats(), draining: this.draining, maxFrameBytes: this.maxFrameBytes,
      ...(connection.pings ? { pingMs: frontendPingMs(this.silenceTimeoutMs) } : {}),
      ...(this.kvPort !== undefined ? { kvPort: this.kvPort } : {}),
      ...((this.options.engine as Partial<PrefillWorkerEngine>).kvLayout ? { kvLayout: (this.options.engine as Partial<PrefillWorkerEngine>).kvLayout } : {}),
    };
    connection.socket.write(encodeJsonFrame(welcome));
  }

  private handle(connection: Connection, message: { t: string } & Record<string, unknown>): void {
    switch (message.t) {
      // Each request's clock offset is fixed here, at receipt (clock-offset.ts).
      case 'gen': return this.generate(connection, message.request, this.clockOffset(connection, message.sentAt));
      case 'prefill': return this.prefill(connection, message.request, this.clockOffset(connection, message.sentAt));
      case 'adopt': return this.adopt(connection, message, this.clockOffset(connection, message.sentAt));
      // An expect carries no times: its sentAt only tightens the connection's offset estimate.
      case 'expect':
        this.clockOffset(connection, message.sentAt);
        return this.expect(connection, message);
      case 'release': {
        const id = message.id;
        // Only the frontend whose request was handed off unpins its blocks (as only it may abort it): another
        // connection naming the id would free blocks a decode worker is still to pull.
        if (typeof id === 'string' && this.pinned.get(id) === connection) {
          this.pinned.delete(id);
          (this.options.engine as Partial<PrefillWorkerEngine>).releaseHandoff?.(id);
          this.kvServer?.ended(id, 'was released');
          this.wakeIfIdle();
        }
        return;
      }
      case 'abort': {
        const id = message.id;
        if (typeof id !== 'string') return;
        if (this.incoming.get(id)?.connection === connection) this.cancelIncoming(id, 'aborted');
        if (connection.requests.has(id) || this.pinned.get(id) === connection) this.abortRequest(id);
        return;
      }
      case 'reset': {
        const rid = message.rid;
        void this.options.engine.resetPrefixCache().then(
          (ok) => this.send(connection, { t: 'reset', rid, ok, stats: this.stats() }),
          () => this.send(connection, { t: 'reset', rid, ok: false, stats: this.stats() }));
        return;
      }
      // Only that the frontend is there (the connection's lastHeardAt): nothing to answer.
      case 'ping':
        return;
      case 'snapshot':
        this.send(connection, { t: 'snapshot', rid: message.rid, ...this.kv.snapshot() });
        return;
      case 'lora-load':
      case 'lora-unload':
        return this.lora(connection, message);
      case 'card':
        connection.socket.write(encodeBlobFrame(v8Serialize(this.modelCard())));
        return;
      default:
        throw new FrameError(`unknown message type ${JSON.stringify(message.t).slice(0, 40)}`);
    }
  }

  /** Loads or unloads a LoRA adapter on this worker's engine; the reply carries what loading found, or the refusal. */
  private lora(connection: Connection, message: Record<string, unknown>): void {
    const { rid, name, path } = message;
    const engine = this.options.engine;
    const refuse = (error: unknown) => {
      const code = error instanceof LoraLoadError ? error.code : error instanceof LoraCapacityError ? 'lora_capacity' : 'invalid_adapter';
      this.send(connection, { t: 'lora', rid, error: { code, message: (error as Error).message } });
    };
    if (typeof name !== 'string' || (message.t === 'lora-load' && typeof path !== 'string')) {
      refuse(new LoraLoadError('invalid_adapter', `${String(message.t)}: name${message.t === 'lora-load' ? ' and path' : ''} must be strings`));
      return;
    }
    if (!engine.loadLora || !engine.unloadLora) {
      refuse(new LoraLoadError('invalid_adapter', `worker ${this.workerId} runs no LoRA adapters`));
      return;
    }
    const adapters = this.options.adapters;
    if (adapters) {
      const changed = () => this.options.onAdaptersChanged?.();
      const done = message.t === 'lora-load'
        ? adapters.register(name, path as string).then((info) => {
          changed();
          this.log('info', `LoRA adapter ${name} (${info.format}, rank ${info.rank}) loaded from ${String(path)}`);
          this.send(connection, { t: 'lora', rid, info, key: adapters.list().find((a) => a.name === name)?.key });
        })
        : adapters.unregister(name).then(({ inFlight }) => {
          changed();
          this.log('info', `LoRA adapter ${name} unloaded${inFlight > 0 ? ` once its ${inFlight} request(s) in flight finish` : ''}`);
          this.send(connection, { t: 'lora', rid, inFlight });
        });
      done.catch(refuse);
      return;
    }
    const done = message.t === 'lora-load'
      ? engine.loadLora(name, path as string).then((info) => this.send(connection, { t: 'lora', rid, info }))
      : engine.unloadLora(name).then(() => this.send(connection, { t: 'lora', rid }));
    done.catch(refuse);
  }

  private modelCard(): ModelCard | null {
    const { tokenizer, chatTemplate } = this.options;
    const source = tokenizer?.workerSource?.();
    if (!source || !chatTemplate) return null;
    const templates = chatTemplate.source.templates;
    return {
      tokenizer: source,
      chatTemplate: {
        templates: typeof templates === 'string' ? [['default', templates]] : [...templates],
        bosToken: chatTemplate.bosToken, eosToken: chatTemplate.eosToken, isFallback: chatTemplate.isFallback,
      },
    };
  }

  /** The connection's clock offset, tightened by this frame's send time (0 when the frontend sends none). */
  private clockOffset(connection: Connection, sentAt: unknown): number {
    connection.clockOffset = tightenClockOffset(connection.clockOffset, sentAt, engineNow());
    return connection.clockOffset ?? 0;
  }

  private generate(connection: Connection, raw: unknown, offset: number): void {
    let request;
    try {
      request = parseWireRequest(raw);
    } catch (error) {
      const id = typeof (raw as { id?: unknown } | null)?.id === 'string' ? (raw as { id: string }).id : undefined;
      if (id === undefined) throw error;
      this.log('warn', `request plane: refusing request ${JSON.stringify(id)} from ${connection.peer}: ${(error as Error).message}`);
      this.send(connection, { t: 'err', id, name: 'InvalidRequestError', code: 'invalid_request', message: (error as Error).message });
      return;
    }
    const id = request.id;
    if (this.refuseOutsideVocabulary(connection, request)) return;
    if (this.draining) {
      this.send(connection, { t: 'err', id, name: 'EngineOverloadedError', code: 'engine_overloaded', message: `worker ${this.workerId} is draining`, retryAfterMs: 1000 });
      return;
    }
    if (this.running.has(id)) {
      this.send(connection, { t: 'err', id, name: 'InvalidRequestError', code: 'duplicate_request_id', message: `request ${JSON.stringify(id)}: a request with this id is already running` });
      return;
    }
    this.running.set(id, connection);
    connection.requests.add(id);
    // Prefilled here after all (a local fallback): a KV stream started for it is not needed.
    this.cancelIncoming(id, 'the request is prefilled here');
    const onWorkerClock = shiftRequest(request, -offset);
    void this.stream(connection, id, offset, this.holdingAdapter(connection, id, onWorkerClock.lora, () => this.options.engine.generate(onWorkerClock)));
  }

  /**
   * `start` with the request's LoRA adapter held on this worker's own manager: made resident first (waiting its turn
   * when every resident adapter is busy, while other requests run), released when the stream ends; aborted while it
   * waits, nothing starts and the stream ends. `start` as it is for a request without an adapter, or on a worker
   * that manages none (a `conduit serve --worker-processes` child: its parent holds the adapter for the request).
   */
  private holdingAdapter<T>(connection: Connection, id: string, lora: string | undefined, start: () => Startable<T>): () => Startable<T> {
    const adapters = this.options.adapters;
    if (!adapters || lora === undefined) return start;
    return () => this.withAdapter(adapters, connection, id, lora, start);
  }

  private async *withAdapter<T>(adapters: LoraManager, connection: Connection, id: string, lora: string,
    start: () => Startable<T>): AsyncGenerator<T> {
    const wait = new AbortController();
    this.awaitingAdapter.set(id, wait);
    let key: string;
    try {
      key = await adapters.acquireKey(lora, wait.signal);
    } catch (error) {
      // Aborted (or its frontend gone) while it waited: it ends without starting.
      if (wait.signal.aborted) return;
      throw error;
    } finally {
      this.awaitingAdapter.delete(id);
    }
    try {
      // Aborted (or its frontend gone) as the adapter became resident: it does not start.
      if (wait.signal.aborted || connection.socket.destroyed) return;
      yield* await start();
    } finally {
      adapters.release(key);
    }
  }

  /**
   * Refuses (an invalid_request error naming the id) a request whose prompt, or the output it carries on from, holds
   * a token id outside the model's vocabulary. The frontend's gateway checks the ids a client sends, but the request
   * plane takes requests from any frontend holding the token, and an engine given such an id ends the stream with
   * nothing, no error.
   */
  private refuseOutsideVocabulary(connection: Connection, request: EngineRequest): boolean {
    const vocabSize = this.options.engine.info.vocabSize;
    for (const field of ['promptTokenIds', 'priorOutputTokenIds'] as const) {
      const tokenId = request[field]?.find((token) => token >= vocabSize);
      if (tokenId === undefined) continue;
      const message = `request ${JSON.stringify(request.id)}: request.${field} holds token id ${tokenId}, outside the model's `
        + `vocabulary of ${vocabSize} tokens (ids 0 to ${vocabSize - 1})`;
      this.log('warn', `request plane: refusing a request from ${connection.peer}: ${message}`);
      this.send(connection, { t: 'err', id: request.id, name: 'InvalidRequestError', code: 'invalid_request', message });
      return true;
    }
    return false;
  }

  /** Checks a request message and registers it on the connection; undefined when refused (answered already). */
  private admit(connection: Connection, raw: unknown): ReturnType<typeof parseWireRequest> | undefined {
    let request;
    try {
      request = parseWireRequest(raw);
    } catch (error) {
      const id = typeof (raw as { id?: unknown } | null)?.id === 'string' ? (raw as { id: string }).id : undefined;
      if (id === undefined) throw error;
      this.send(connection, { t: 'err', id, name: 'InvalidRequestError', code: 'invalid_request', message: (error as Error).message });
      return undefined;
    }
    const id = request.id;
    if (this.refuseOutsideVocabulary(connection, request)) return undefined;
    if (this.draining) {
      this.send(connection, { t: 'err', id, name: 'EngineOverloadedError', code: 'engine_overloaded', message: `worker ${this.workerId} is draining`, retryAfterMs: 1000 });
      return undefined;
    }
    if (this.running.has(id)) {
      this.send(connection, { t: 'err', id, name: 'InvalidRequestError', code: 'duplicate_request_id', message: `request ${JSON.stringify(id)}: a request with this id is already running` });
      return undefined;
    }
    this.running.set(id, connection);
    connection.requests.add(id);
    return request;
  }

  /** Prefill role: the request's first token, then its handoff (blocks pinned here until `release`). */
  private prefill(connection: Connection, raw: unknown, offset: number): void {
    const engine = this.options.engine as Partial<PrefillWorkerEngine>;
    if (this.role !== 'prefill' || !engine.prefill) throw new FrameError(`worker ${this.workerId} is not a prefill worker`);
    const request = this.admit(connection, raw);
    if (!request) return;
    const id = request.id;
    let handedOff = false;
    this.kvServer?.started(id);
    const onWorkerClock = shiftRequest(request, -offset);
    void this.stream(connection, id, offset, this.holdingAdapter(connection, id, onWorkerClock.lora, () => engine.prefill!(onWorkerClock)), (handoff) => {
      handedOff = true;
      this.pinned.set(id, connection);
      this.kvServer?.handedOff(id, handoff.sourceBlockIds);
      this.send(connection, { t: 'handoff', id, handoff: toWireHandoff(shiftHandoff(handoff, offset)) });
    }).then(() => {
      if (!handedOff) this.kvServer?.ended(id, 'ended without a handoff');
    });
  }

  /**
   * Decode role: a request is about to prefill on another worker; its blocks are streamed into staging as that
   * worker computes them, and the adopt that follows waits only for the rest. Without room in staging nothing
   * starts (the adopt pulls, or recomputes).
   */
  private expect(connection: Connection, message: Record<string, unknown>): void {
    // Not a decode worker with a staging pool (a simulated one): the adopt will say what happens.
    if (this.role !== 'decode' || !this.staging) return;
    const { id, promptTokens, source, blockHashes } = message as {
      id?: unknown; promptTokens?: unknown; source?: { host?: unknown; port?: unknown } | null; blockHashes?: unknown;
    };
    if (typeof id !== 'string' || id.length === 0 || !Number.isSafeInteger(promptTokens) || (promptTokens as number) < 1
      || !source || typeof source.host !== 'string' || !Number.isInteger(source.port)) {
      throw new FrameError('expect needs a request id, its prompt length and the prefill worker\'s KV address');
    }
    const numBlocks = Math.ceil((promptTokens as number) / this.staging.layout.blockSize);
    if (blockHashes !== undefined && (!Array.isArray(blockHashes) || blockHashes.length > numBlocks || !blockHashes.every(isBlockHash))) {
      throw new FrameError('expect: blockHashes must be the prompt\'s full-block hashes');
    }
    this.cancelIncoming(id, 'expected again');
    if (this.staging.held.has(id) || this.running.has(id)) return;
    const stream: IncomingStream = {
      ready: Promise.resolve(), numBlocks, hashes: (blockHashes ?? []) as BlockHash[], held: 0, ids: [], inPlace: false,
      host: source.host, port: source.port as number, connection, claimed: false,
    };
    this.incoming.set(id, stream);
    this.importing.set(id, { hashes: stream.hashes, at: performance.now() });
    // Another request under way here brings some of the prompt's leading blocks: the destinations are named once
    // those are cached (then held, not moved), or that import ends, or a bounded wait passes.
    const ahead = this.sharedPrefixAhead(id, stream.hashes);
    stream.ready = ahead ? ahead.then(() => this.openStream(id, stream)) : this.openStream(id, stream);
  }

  /**
   * A promise that resolves when the leading blocks of `hashes` that another import under way here brings are
   * cached here (the KV mirror has them), that import ends, or SHARED_PREFIX_WAIT_MS passes; null when no import
   * under way brings a block this worker lacks now.
   */
  private sharedPrefixAhead(id: string, hashes: readonly BlockHash[]): Promise<void> | null {
    let shared = 0;
    let from: string | undefined;
    const now = performance.now();
    for (const [other, entry] of this.importing) {
      if (now - entry.at > STREAM_UNCLAIMED_MS) {
        this.endImport(other);
        continue;
      }
      if (other === id) continue;
      let k = 0;
      while (k < hashes.length && k < entry.hashes.length && hashes[k] === entry.hashes[k]) k++;
      if (k > shared) {
        shared = k;
        from = other;
      }
    }
    const needed = hashes.slice(0, shared);
    const cached = () => needed.every((hash) => this.kv.hashes.has(hash));
    if (from === undefined || cached()) return null;
    this.streamsDeferred++;
    return new Promise<void>((resolve) => {
      const done = () => {
        clearTimeout(timer);
        this.kvListeners.delete(check);
        this.importEnded.delete(check);
        resolve();
      };
      const check = () => {
        if (cached() || !this.importing.has(from!) || this.incoming.get(id) === undefined) done();
      };
      const timer = setTimeout(done, SHARED_PREFIX_WAIT_MS);
      timer.unref();
      this.kvListeners.add(check);
      this.importEnded.add(check);
    });
  }

  /** The request's import here is over (adopted and ended, failed, cancelled): streams waiting for it go on. */
  private endImport(id: string): void {
    if (!this.importing.delete(id)) return;
    for (const wake of [...this.importEnded]) wake();
  }

  /**
   * Opens an expected request's stream: holds the blocks this worker caches of its prompt (they do not move),
   * reserves the engine's blocks for the others (staging blocks when the pool has no room; without room there
   * either nothing starts and the adopt pulls or recomputes), then asks the prefill worker for them.
   */
  private async openStream(id: string, stream: IncomingStream): Promise<void> {
    // Cancelled while it waited for another import's blocks: nothing was prepared.
    if (this.incoming.get(id) !== stream) return;
    const target = await this.prepareImport(id, stream.hashes, stream.numBlocks, true);
    if (target.ticket !== undefined) stream.ticket = target.ticket;
    // Cancelled meanwhile (cancelIncoming left the preparation to this): it goes.
    if (this.incoming.get(id) !== stream) return this.releaseImport(id, target.ticket);
    stream.held = target.held;
    const staging = this.staging!;
    let destination: KvPoolView;
    if (target.blockIds !== null) {
      stream.inPlace = true;
      stream.ids = target.blockIds;
      destination = this.inPlace!;
    } else {
      const count = stream.numBlocks - stream.held;
      if (count > staging.free.length || staging.held.has(id)) {
        this.incoming.delete(id);
        return this.releaseImport(id, target.ticket);
      }
      stream.ids = staging.free.splice(staging.free.length - count, count).reverse();
      staging.held.set(id, stream.ids);
      destination = staging;
    }
    const handle = streamKvBlocks({
      requestId: id, destinationBlockIds: stream.ids, layers: [0, staging.layout.numLayers], firstBlock: stream.held,
    }, {
      clusterToken: this.options.clusterToken, host: stream.host, port: stream.port, destination,
      ...(this.options.kvLink ? { link: this.options.kvLink } : {}),
    });
    handle.deadline(STREAM_UNCLAIMED_MS);
    stream.handle = handle;
    handle.result.catch((error: unknown) => {
      // Claimed: the adopt deals with it. Not: the request ended elsewhere (finished on its first token, aborted,
      // prefilled here) or the prefill worker is gone; its blocks go back.
      if (stream.claimed || this.incoming.get(id) !== stream) return;
      this.incoming.delete(id);
      this.endImport(id);
      this.dropStreamBlocks(id, stream);
      this.log('debug', `KV stream of ${id} ended before its handoff: ${(error as Error).message}`);
      // A corrupted or cut stream is a failed transfer (the adopt falls back to prefilling here), kept a bounded time.
      if (error instanceof KvTransferError && INTEGRITY_FAILURES.has(error.reason)) {
        this.failedStreams.set(id, error);
        setTimeout(() => { if (this.failedStreams.get(id) === error) this.failedStreams.delete(id); }, STREAM_UNCLAIMED_MS).unref();
      }
    });
  }

  /** A stream that will not be adopted: its staging blocks, or the engine's hold and reserved blocks, go back. */
  private dropStreamBlocks(id: string, stream: IncomingStream): void {
    if (!stream.inPlace && this.staging?.held.get(id) === stream.ids) this.freeStaging(id);
    this.releaseImport(id, stream.ticket);
  }

  /**
   * Gets the engine ready for the KV of a prompt of numBlocks blocks: holds the blocks its prefix cache has (by the
   * prompt's hashes) and, writing in place, reserves blocks of its pool for the rest; releaseImport undoes both if
   * no adoption takes them. An engine without prepareKvImport only holds, for a pull (an adoption follows it), by
   * holdCachedPrefix.
   */
  private async prepareImport(id: string, hashes: readonly BlockHash[], numBlocks: number, forStream = false): Promise<ImportTarget> {
    const engine = this.options.engine as DecodeWorkerEngine;
    if (engine.prepareKvImport) {
      try {
        const prepared = await engine.prepareKvImport(id, hashes, numBlocks, this.inPlace !== undefined);
        this.reservations.set(id, prepared.ticket);
        return { held: prepared.held, blockIds: this.inPlace ? prepared.blockIds : null, ticket: prepared.ticket };
      } catch {
        return { held: 0, blockIds: null };
      }
    }
    if (forStream || !engine.holdCachedPrefix || hashes.length === 0) return { held: 0, blockIds: null };
    try {
      return { held: await engine.holdCachedPrefix(id, hashes), blockIds: null };
    } catch {
      return { held: 0, blockIds: null };
    }
  }

  /** The engine's preparation `ticket` for the request will not be adopted: its hold and reserved blocks go. */
  private releaseImport(id: string, ticket: number | undefined): void {
    if (ticket === undefined || this.reservations.get(id) !== ticket) return;
    this.reservations.delete(id);
    (this.options.engine as DecodeWorkerEngine).releaseKvImport?.(id, ticket);
  }

  private cancelIncoming(id: string, why: string): void {
    this.failedStreams.delete(id);
    const stream = this.incoming.get(id);
    if (!stream) return;
    this.incoming.delete(id);
    if (!this.running.has(id)) this.endImport(id);
    // Not open yet: openStream releases what it prepared once the engine answers.
    if (!stream.handle) return;
    stream.handle.cancel(why);
    this.dropStreamBlocks(id, stream);
  }

  /**
   * Decode role: if a stream started at expect() from the handoff's source is under way, waits for its rest (every
   * block moves). Otherwise holds the prompt's blocks this worker's prefix cache already has (pinned, so nothing
   * evicts them), pulls only the others from the prefill worker's KV port into the staging pool, then lets the engine
   * adopt the request from there. A failed transfer (checksum, truncation, prefill worker gone) is logged and counted,
   * and the engine recomputes the prompt itself (adopt with no source). An abort stops the transfer at once.
   */
  private adopt(connection: Connection, message: Record<string, unknown>, offset: number): void {
    const engine = this.options.engine as Partial<DecodeWorkerEngine>;
    if (this.role !== 'decode' || !engine.adopt || !this.staging) throw new FrameError(`worker ${this.workerId} is not a decode worker`);
    let handoff: KvHandoff;
    try {
      handoff = shiftHandoff(parseWireHandoff(message.handoff), -offset);
    } catch (error) {
      const id = (message.handoff as { requestId?: unknown } | null)?.requestId;
      if (typeof id !== 'string') throw error;
      this.send(connection, { t: 'err', id, name: 'InvalidRequestError', code: 'invalid_request', message: (error as Error).message });
      return;
    }
    const request = this.admit(connection, (message.handoff as { request: unknown }).request);
    if (!request) return;
    const id = request.id;
    const source = message.source as { host?: unknown; port?: unknown } | null;
    const start = async (): Promise<AsyncIterable<EngineOutput> | Iterable<EngineOutput>> => {
      const failed = this.failedStreams.get(id);
      if (failed) {
        this.failedStreams.delete(id);
        this.log('warn', `KV transfer of ${id} failed (${failed.reason}): ${failed.message}; prefilling here instead`);
        return this.fallBack(handoff, failed.link ?? KV_LINK_TCP, failed.reason, failed.message);
      }
      if (!source || typeof source.host !== 'string' || !Number.isInteger(source.port)) {
        this.cancelIncoming(id, 'the handoff names no source');
        return this.fallBack(handoff, KV_LINK_TCP, 'no-source', 'the handoff names no source');
      }
      const controller = new AbortController();
      this.pulling.set(id, controller);
      try {
        return await this.pullAndAdopt(handoff, { host: source.host, port: source.port as number }, controller.signal);
      } finally {
        this.pulling.delete(id);
      }
    };
    this.adoptedTo.set(id, { connection, offset });
    void this.stream(connection, id, offset, this.holdingAdapter(connection, id, handoff.request.lora, start));
  }

  private async pullAndAdopt(handoff: KvHandoff, source: { host: string; port: number }, signal: AbortSignal): Promise<AsyncIterable<EngineOutput> | Iterable<EngineOutput>> {
    const engine = this.options.engine as DecodeWorkerEngine;
    const staging = this.staging!;
    const id = handoff.requestId;
    // Aborted meanwhile: the engine drops what it holds for the request (the held prefix, reserved blocks), the
    // staging blocks go, and the stream ends as an aborted one does.
    const stopped = (): boolean => {
      if (!signal.aborted) return false;
      engine.abort(id);
      this.reservations.delete(id);
      this.freeStaging(id);
      return true;
    };
    const closing = (): EngineOutput[] => [{
      requestId: id, index: 0, newTokenIds: [], textDelta: '', finishReason: 'abort',
      usage: { promptTokens: handoff.request.promptTokenIds.length, completionTokens: handoff.outputTokenIds.length, cachedTokens: handoff.numCachedTokens },
      timestamps: { ...handoff.timestamps, prefillChunks: handoff.timestamps.prefillChunks.slice(), finished: engineNow() },
      ...(handoff.request.traceparent !== undefined ? { traceparent: handoff.request.traceparent } : {}),
    }];
    // A stream started at expect() from this very source: the adopt waits for its rest. Any other is dropped.
    const streamed = this.incoming.get(id);
    if (streamed && streamed.host === source.host && streamed.port === source.port && streamed.numBlocks === handoff.sourceBlockIds.length) {
      await streamed.ready;
      if (signal.aborted) this.cancelIncoming(id, 'aborted');
      if (stopped()) return closing();
      if (this.incoming.get(id) === streamed && streamed.handle) return this.adoptStreamed(handoff, streamed, signal, stopped, closing);
    }
    this.cancelIncoming(id, 'the handoff names another source');
    const target = await this.prepareImport(id, handoff.blockHashes, handoff.sourceBlockIds.length);
    if (stopped()) return closing();
    const held = target.held;
    const sourceIds = handoff.sourceBlockIds.slice(held);
    let ids: number[];
    let destination: KvPoolView;
    if (target.blockIds !== null) {
      ids = target.blockIds;
      destination = this.inPlace!;
    } else {
      if (sourceIds.length > staging.free.length) {
        this.releaseImport(id, target.ticket);
        return this.fallBack(handoff, KV_LINK_TCP, 'no-staging-space', `${sourceIds.length} blocks to import, ${staging.free.length} free in the staging pool`);
      }
      ids = staging.free.splice(staging.free.length - sourceIds.length, sourceIds.length).reverse();
      staging.held.set(id, ids);
      destination = staging;
    }
    const startMs = engineNow();
    let pulled: Pick<KvPullResult, 'bytes' | 'runs'> & { link?: KvLink; overlapMs?: number } = { bytes: 0, runs: 0 };
    if (ids.length > 0) {
      try {
        pulled = await pullKvBlocks(
          { requestId: id, sourceBlockIds: sourceIds, destinationBlockIds: ids, layers: [0, staging.layout.numLayers] },
          { clusterToken: this.options.clusterToken, host: source.host, port: source.port, destination, signal,
            ...(this.options.kvLink ? { link: this.options.kvLink } : {}) });
      } catch (error) {
        this.freeStaging(id);
        if (stopped()) return closing();
        this.releaseImport(id, target.ticket);
        return this.transferFailed(handoff, source, error);
      }
    }
    if (stopped()) return closing();
    this.countTransfer('ok');
    this.pulls.set(id, {
      startMs, bytes: pulled.bytes, blocks: ids.length, reused: held, runs: pulled.runs, link: pulled.link ?? KV_LINK_TCP,
      ...(pulled.overlapMs !== undefined ? { overlapMs: pulled.overlapMs } : {}),
    });
    // The adoption takes over the hold and the reserved blocks.
    this.reservations.delete(id);
    if (target.blockIds !== null) return engine.adopt(handoff, KV_IN_PLACE_SOURCE);
    // The held blocks are not in staging: the engine finds them in its own cache and copies only those after them.
    const sourceBlockIds = [...new Array<number>(held).fill(ids[0] ?? 0), ...ids];
    return engine.adopt({ ...handoff, sourceBlockIds, sourceLayout: staging.layout }, STAGING_SOURCE);
  }

  /**
   * Waits for the rest of a stream started at expect() (every block of the prompt this worker does not hold), then
   * adopts: in place, or from staging.
   */
  private async adoptStreamed(handoff: KvHandoff, streamed: IncomingStream, signal: AbortSignal, stopped: () => boolean,
    closing: () => EngineOutput[]): Promise<AsyncIterable<EngineOutput> | Iterable<EngineOutput>> {
    const engine = this.options.engine as DecodeWorkerEngine;
    const staging = this.staging!;
    const id = handoff.requestId;
    const handle = streamed.handle!;
    this.incoming.delete(id);
    streamed.claimed = true;
    const startMs = engineNow();
    const onAbort = () => handle.cancel('aborted');
    signal.addEventListener('abort', onAbort, { once: true });
    let pulled: KvPullResult;
    try {
      handle.deadline(TRANSFER_TIMEOUT_MS);
      pulled = await handle.result;
      if (pulled.sourceBlockIds.some((block, i) => block !== handoff.sourceBlockIds[i])) {
        throw Object.assign(new KvTransferError('unexpected-run', `KV stream of ${id}: the prefill side sent other blocks than it handed off`),
          { link: pulled.link });
      }
      if (streamed.hashes.slice(0, streamed.held).some((hash, i) => hash !== handoff.blockHashes[i])) {
        throw Object.assign(new KvTransferError('unexpected-run', `KV stream of ${id}: the blocks held here are not the handoff's`),
          { link: pulled.link });
      }
    } catch (error) {
      if (!streamed.inPlace) this.freeStaging(id);
      if (stopped()) return closing();
      this.releaseImport(id, streamed.ticket);
      return this.transferFailed(handoff, streamed, error);
    } finally {
      signal.removeEventListener('abort', onAbort);
    }
    if (stopped()) return closing();
    this.countTransfer('ok');
    this.pulls.set(id, {
      startMs, bytes: pulled.bytes, blocks: streamed.ids.length, reused: streamed.held, runs: pulled.runs, link: pulled.link,
      overlapMs: pulled.overlapMs,
    });
    this.reservations.delete(id);
    this.streamsAdopted++;
    if (streamed.inPlace) return engine.adopt(handoff, KV_IN_PLACE_SOURCE);
    const sourceBlockIds = [...new Array<number>(streamed.held).fill(streamed.ids[0] ?? 0), ...streamed.ids];
    return engine.adopt({ ...handoff, sourceBlockIds, sourceLayout: staging.layout }, STAGING_SOURCE);
  }

  /** A pull or stream failed (not aborted): logged, counted by its link and reason, and the prompt is prefilled here. */
  private transferFailed(handoff: KvHandoff, source: { host: string; port: number }, error: unknown): AsyncIterable<EngineOutput> {
    const reason = error instanceof KvTransferError ? error.reason : 'error';
    const link = (error instanceof KvTransferError ? error.link : undefined) ?? KV_LINK_TCP;
    this.log('warn', `KV transfer of ${handoff.requestId} from ${source.host}:${source.port} failed (${reason}): ${(error as Error).message}; prefilling here instead`);
    return this.fallBack(handoff, link, reason, (error as Error).message);
  }

  /**
   * The KV cannot be imported: counted by link and reason, and the engine recomputes the prompt here. The frontend's
   * adopted result says why (the engine itself only knows it was given no source).
   */
  private fallBack(handoff: KvHandoff, link: string, reason: string, message: string): AsyncIterable<EngineOutput> {
    this.countTransfer(reason);
    this.countLink(link, reason);
    this.fallbackReasons.set(handoff.requestId, `KV transfer failed (${reason}): ${message}`);
    return (this.options.engine as DecodeWorkerEngine).adopt(handoff, null);
  }

  /** Why a request's KV was not imported, until its adopted result goes to the frontend. */
  private readonly fallbackReasons = new Map<string, string>();

  /** Pulls done, by request, until the request's stream ends: what its kv_transfer reports. */
  private readonly pulls = new Map<string, PullFacts>();
  /** Requests whose KV pull (or the hold before it) is under way: an abort stops it. */
  private readonly pulling = new Map<string, AbortController>();

  /** Requests waiting for their adapter (holdingAdapter): an abort ends the wait. */
  private readonly awaitingAdapter = new Map<string, AbortController>();

  private abortRequest(id: string): void {
    this.awaitingAdapter.get(id)?.abort();
    if (this.pinned.delete(id)) {
      this.kvServer?.ended(id, 'was aborted');
      this.wakeIfIdle();
    }
    const pull = this.pulling.get(id);
    if (pull) pull.abort();
    else this.options.engine.abort(id);
  }
  /** Decode role: where to tell each adoption's outcome, and that request's clock offset. */
  private readonly adoptedTo = new Map<string, { connection: Connection; offset: number }>();

  private countTransfer(outcome: string): void {
    this.kvTransfers.set(outcome, (this.kvTransfers.get(outcome) ?? 0) + 1);
  }

  /** A transfer counted under `from` whose outcome turned out to be `to`. */
  private recountTransfer(from: string, to: string): void {
    const left = (this.kvTransfers.get(from) ?? 0) - 1;
    if (left > 0) this.kvTransfers.set(from, left);
    else this.kvTransfers.delete(from);
    this.countTransfer(to);
  }

  /** A request the decode worker prefills itself instead of importing its KV over `link`, and why. */
  private countLink(link: string, reason: string): void {
    const before = this.linkStats[link] ?? { failures: {}, fallbacks: 0 };
    // A new object each time: the stats sent with every output share it until the next change.
    this.linkStats = {
      ...this.linkStats,
      [link]: { failures: { ...before.failures, [reason]: (before.failures[reason] ?? 0) + 1 }, fallbacks: before.fallbacks + 1 },
    };
  }

  private freeStaging(id: string): void {
    const ids = this.staging?.held.get(id);
    if (!ids) return;
    this.staging!.held.delete(id);
    this.staging!.free.push(...ids);
  }

  /**
   * A request's stream ended with staging blocks still held (it was never adopted: aborted while waiting for room,
   * or refused): they are free once the engine is done with it. It is, when the stream ended by itself; when it was
   * left early (the connection closed), the engine's abort has just been posted and a pending adoption could still
   * copy out of staging before it is handled, so the blocks are freed after the engine has caught up.
   */
  private releaseStagingAfter(id: string, connection: Connection): void {
    if (!this.staging?.held.has(id)) return;
    const engine = this.options.engine as Partial<{ sync(): Promise<unknown> }>;
    if (!connection.socket.destroyed || !engine.sync) return this.freeStaging(id);
    void engine.sync().catch(() => {}).finally(() => this.freeStaging(id));
  }

  /** What the pull moved, in place of the engine's copy out of staging: link, bytes and blocks over the network. */
  private pulledTransfer(transfer: KvTransferStats, pull: PullFacts): KvTransferStats {
    const ms = Math.max(0, transfer.endMs - pull.startMs);
    const overlapMs = pull.overlapMs ?? 0;
    // A streamed transfer's rate is over all of the link's time, hidden behind the prefill or not.
    const rateMs = ms + overlapMs;
    return {
      ...transfer, channel: pull.link, blocks: pull.blocks, reusedBlocks: Math.max(pull.reused, transfer.reusedBlocks),
      bytes: pull.bytes, runs: pull.runs, startMs: pull.startMs, ms, gbPerSec: rateMs > 0 ? pull.bytes / rateMs / 1e6 : 0,
      // Hidden: the link's time before the prefill ended; exposed (ms): everything the request waited for after it.
      ...(pull.overlapMs !== undefined ? { overlapMs, hiddenShare: rateMs > 0 ? overlapMs / rateMs : 0 } : {}),
    };
  }

  /** An output's kv_transfer as the pull saw it (the engine only saw the copy out of staging). */
  private withPull(id: string, output: EngineOutput): EngineOutput {
    const pull = this.pulls.get(id);
    const kv = output.timestamps.kvTransfer;
    if (!pull || !kv) return output;
    return {
      ...output,
      timestamps: {
        ...output.timestamps,
        kvTransfer: {
          start: pull.startMs, end: kv.end, bytes: pull.bytes, blocks: pull.blocks, link: pull.link,
          ...(pull.overlapMs !== undefined ? { overlapMs: pull.overlapMs } : {}),
        },
      },
    };
  }

  /** The engine copied the blocks out of staging (or recomputes): free them, tell the frontend (the pull's figures). */
  private adopted(result: AdoptedResult): void {
    this.freeStaging(result.requestId);
    const pull = this.pulls.get(result.requestId);
    const target = this.adoptedTo.get(result.requestId);
    this.adoptedTo.delete(result.requestId);
    let out = result;
    if (result.transfer && pull) out = { ...result, transfer: this.pulledTransfer(result.transfer, pull) };
    const fellBack = this.fallbackReasons.get(result.requestId);
    this.fallbackReasons.delete(result.requestId);
    if (fellBack !== undefined && result.status === 'recompute') out = { ...out, error: fellBack };
    if (result.status === 'recompute' && pull) {
      // The blocks came, but the engine could not take them: the transfer failed at its import, and counts so once.
      this.recountTransfer('ok', 'import');
      this.countLink(pull.link, 'import');
    }
    if (target) this.send(target.connection, { t: 'adopted', result: shiftAdopted(out, target.offset) });
  }

  /**
   * The stats this worker reports: its engine's, on a decode worker its KV imports that fell back, per link, and a
   * sequence number that grows whenever either may have changed (a new engine stats object or new link counts). One
   * object per change, shared by every output sent until the next, as the engine's own stats are.
   */
  stats(): EngineStats {
    const engine = this.options.engine.stats();
    const report = this.lastReport;
    if (report && report.engine === engine && report.links === this.linkStats) return report.stats;
    const reportSeq = ++this.reportSeq;
    const stats = Object.keys(this.linkStats).length > 0 ? { ...engine, kvTransferLinks: this.linkStats, reportSeq } : { ...engine, reportSeq };
    this.lastReport = { engine, links: this.linkStats, stats };
    return stats;
  }

  /** Sends a request's outputs as they come, their times moved onto the frontend's clock by the request's offset. */
  private async stream(connection: Connection, id: string, offset: number,
    start: () => Startable<EngineOutput | PrefillEvent>,
    onHandoff?: (handoff: KvHandoff) => void): Promise<void> {
    /**
     * The request's last output (one with a finish reason) or its handoff went out: its part here is done, whatever
     * comes after.
     */
    let finished = false;
    const cutShort = () => !finished && this.cut.has(id);
    try {
      for await (const item of await start()) {
        if (connection.socket.destroyed) break;
        // The drain's grace ran out: what the aborted engine still yields (its "abort" output) is not sent.
        if (cutShort()) break;
        if ('type' in item && (item.type === 'handoff' || item.type === 'output')) {
          if (item.type === 'handoff') {
            finished = true;
            onHandoff?.(item.handoff);
          } else {
            if (item.output.finishReason !== undefined) finished = true;
            this.send(connection, { t: 'out', id, outputs: [shiftOutput(item.output, offset)], stats: this.stats() });
          }
          continue;
        }
        if ((item as EngineOutput).finishReason !== undefined) finished = true;
        this.send(connection, { t: 'out', id, outputs: [shiftOutput(this.withPull(id, item as EngineOutput), offset)], stats: this.stats() });
      }
      if (cutShort()) this.sendCut(connection, id);
      else this.send(connection, { t: 'end', id, stats: this.stats() });
    } catch (error) {
      const e = error as Error & { code?: string; retryAfterMs?: number };
      if (cutShort()) this.sendCut(connection, id);
      else {
        this.send(connection, {
          t: 'err', id, name: e.name ?? 'Error', code: e.code, message: e.message,
          ...(e.retryAfterMs !== undefined ? { retryAfterMs: e.retryAfterMs } : {}),
        });
      }
    } finally {
      this.cut.delete(id);
      this.running.delete(id);
      this.adoptedTo.delete(id);
      this.pulls.delete(id);
      this.fallbackReasons.delete(id);
      this.releaseStagingAfter(id, connection);
      this.endImport(id);
      // Prepared for an adoption that never took it (an expect stream of its own releases its preparation).
      if (!this.incoming.has(id)) this.releaseImport(id, this.reservations.get(id));
      connection.requests.delete(id);
      this.wakeIfIdle();
      // Every frontend's router learns at once that this load is gone, not at the next heartbeat: a report taken
      // while the request ran would otherwise make the worker look busy (and its cached prefixes not worth it).
      this.sendHeartbeat();
    }
  }

  /**
   * Ends a request the drain's grace ran out on: the engine-closed error the frontend takes for a lost worker (it
   * migrates the request under its --migration-limit, else the client gets the error).
   */
  private sendCut(connection: Connection, id: string): void {
    this.send(connection, {
      t: 'err', id, name: 'EngineClosedError', code: 'engine_closed',
      message: `worker ${this.workerId} stopped: its shutdown grace ran out while request ${id} was running`,
    });
  }

  /** The worker's stats to every connection (each frontend's router takes them as the worker's load). */
  private sendHeartbeat(): void {
    const frame = encodeJsonFrame({ t: 'hb', stats: this.stats() });
    for (const c of this.connections) if (c.authenticated && !c.socket.destroyed) c.socket.write(frame);
  }

  private send(connection: Connection, message: object): void {
    if (!connection.socket.destroyed) connection.socket.write(encodeJsonFrame(message));
  }

  private log(level: 'debug' | 'info' | 'warn' | 'error', message: string): void {
    this.options.log?.(level, message);
  }
}
