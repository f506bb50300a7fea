// The worker side of the request plane: serves one local engine (a cpu LocalEngine, a SimEngine, anything behind
// the Engine interface) to frontends over TCP.
//
// Each connection must open with a hello carrying the cluster token (and fit MAX_HELLO_BYTES); a wrong token, a
// frame over the limit, a frame that is not a message or a request that does not validate is logged with its
// reason and the connection is closed. The process and every other connection go on. A connection that closes
// aborts every request it started (the frontend is gone, or gave up on this worker), so nothing keeps running for
// nobody. Cancellation from the frontend is an `abort` message.
//
// The server keeps a mirror of the engine's cached block hashes, built from the engine's own KV events (they
// replay to its cached set), so it can answer a snapshot (resync) request without asking the engine.

import net from 'node:net';
import { v8Serialize } from './blob.ts';
import type { Engine, EngineOutput, WorkerRole } from '../engine/types.ts';
import type { ChatTemplate } from '../model/chat-template.ts';
import type { Tokenizer } from '../model/tokenizer/types.ts';
import type { BlockHash, KvEvent } from '../protocols/kv-events.ts';
import type { RoutableEngine } from '../runtime/worker-group.ts';
import type { DecodeWorkerEngine, PrefillWorkerEngine } from '../runtime/disaggregated.ts';
import type { AdoptedResult, KvHandoff, PrefillEvent, PrefillProgress } from '../engine/handoff.ts';
import { kvBlockBytes, type KvPoolLayout } from '../engine/handoff.ts';
import { engineNow } from '../engine/clock.ts';
import {
  KvTransferError, KvTransferServer, parseWireHandoff, pullKvBlocks, streamKvBlocks, toWireHandoff, type KvLink,
  type KvPullResult, type KvTransferHandle,
} from './kv-tcp.ts';
import type { KvLinkPreference } from './kv-shm.ts';
import {
  DEFAULT_MAX_FRAME_BYTES, encodeBlobFrame, encodeJsonFrame, FrameError, FrameReader, FRAME_JSON, parseJsonMessage,
} from './frames.ts';
import {
  HEARTBEAT_MS, MAX_HELLO_BYTES, parseWireRequest, REQUEST_PLANE_VERSION, tokenMatches, type ModelCard, type Welcome,
} from './request-plane.ts';

export type ClusterLog = (level: 'debug' | 'info' | 'warn' | 'error', message: string) => void;

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
  kvFaults?: { corruptRun?: number; truncateAfterRuns?: number };
  /** 'tcp': KV transfers never use shared memory, even between workers on one host (default 'auto'). */
  kvLink?: KvLinkPreference;
}

/** How long a KV stream started before its handoff may wait for it (the prefill's queue and compute). */
const STREAM_UNCLAIMED_MS = 10 * 60_000;
/** Stream failures that mean the KV cannot be trusted, as opposed to a stream nobody needed any more. */
const INTEGRITY_FAILURES: ReadonlySet<string> = new Set(['checksum', 'length', 'unexpected-run', 'truncated', 'link']);
/** How long the rest of a transfer may take once the handoff is here. */
const TRANSFER_TIMEOUT_MS = 30_000;

/** A KV stream a decode worker started when told a request would prefill elsewhere (see expect()). */
interface IncomingStream {
  handle: KvTransferHandle;
  ids: number[];
  host: string;
  port: number;
  connection: Connection;
  claimed: boolean;
}

/** The source id a decode worker's engine knows its TCP staging pool by. */
const STAGING_SOURCE = 'tcp-staging';

interface Connection {
  socket: net.Socket;
  peer: string;
  authenticated: boolean;
  wantsEvents: boolean;
  /** Requests this connection started and that have not ended. */
  requests: Set<string>;
}

/** The worker's KV cache as its events describe it: what a snapshot sends for a resync. */
export class KvMirror {
  readonly hashes = new Set<BlockHash>();
  lastEventId = 0;

  apply(events: readonly KvEvent[]): void {
    for (const event of events) {
      this.lastEventId = event.eventId;
      if (event.type === 'stored') for (const hash of event.blockHashes) this.hashes.add(hash);
      else if (event.type === 'removed') for (const hash of event.blockHashes) this.hashes.delete(hash);
      else this.hashes.clear();
    }
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
  private draining = false;
  private readonly maxFrameBytes: number;
  private readonly idleWaiters: (() => void)[] = [];
  /** Connections refused and why (for tests and /health of the worker). */
  refusals = 0;
  /** Prefill role: serves pulls of handed-off blocks over TCP; their requests, pinned until released. */
  private kvServer: KvTransferServer | undefined;
  private kvPort: number | undefined;
  private readonly pinned = new Set<string>();
  /** Decode role: the staging pool KV pulled over TCP lands in before the engine copies it into its own pool. */
  private staging: { pool: SharedArrayBuffer; layout: KvPoolLayout; free: number[]; held: Map<string, number[]> } | undefined;
  private readonly offAdopted: (() => void) | undefined;
  /** KV pulls over TCP by outcome: 'ok', or the failure reason (checksum, truncated, connect, ...). */
  readonly kvTransfers = new Map<string, number>();
  /** Decode role: KV streams started before their handoff, by request id. */
  private readonly incoming = new Map<string, IncomingStream>();
  /** Streams that failed a check before their handoff came: the adopt counts the failure and prefills here. */
  private readonly failedStreams = new Map<string, KvTransferError>();
  private readonly offProgress: (() => void) | undefined;

  constructor(private readonly options: WorkerServerOptions) {
    this.workerId = options.workerId;
    this.maxFrameBytes = options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES;
    this.server = net.createServer((socket) => this.accept(socket));
    this.offEvents = options.engine.onKvEvents?.((events) => {
      this.kv.apply(events);
      const frame = encodeJsonFrame({ t: 'kv', events, stats: this.options.engine.stats() });
      for (const c of this.connections) if (c.authenticated && c.wantsEvents) c.socket.write(frame);
      for (const listener of this.kvListeners) listener(events);
    });
    this.heartbeat = setInterval(() => {
      const frame = encodeJsonFrame({ t: 'hb', stats: this.options.engine.stats() });
      for (const c of this.connections) if (c.authenticated) c.socket.write(frame);
    }, HEARTBEAT_MS);
    this.heartbeat.unref();
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
    }
  }

  get engine(): Engine {
    return this.options.engine;
  }

  get role(): WorkerRole {
    return this.options.role ?? 'both';
  }

  /** Requests running now. */
  get inFlight(): number {
    return this.running.size;
  }

  /** Listens; resolves with the bound port. */
  listen(port: number, host: string): Promise<number> {
    return new Promise((resolve, reject) => {
      this.server.once('error', reject);
      this.server.listen(port, host, () => {
        this.server.off('error', reject);
        const bound = (this.server.address() as net.AddressInfo).port;
        if (!this.kvServer) return resolve(bound);
        // The KV port: any free port on the same interface, told to frontends in the welcome.
        this.kvServer.listen(0, host).then((kvPort) => { this.kvPort = kvPort; resolve(bound); }, reject);
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
   * which the frontend's router treats as any busy worker's); resolves when the running requests have ended, or
   * after `graceMs`, when those left are aborted.
   */
  async drain(graceMs: number): Promise<void> {
    this.draining = true;
    const frame = encodeJsonFrame({ t: 'draining' });
    for (const c of this.connections) if (c.authenticated) c.socket.write(frame);
    if (this.running.size === 0) return;
    let timer: NodeJS.Timeout | undefined;
    const idle = new Promise<void>((resolve) => this.idleWaiters.push(resolve));
    const timeout = new Promise<'timeout'>((resolve) => { timer = setTimeout(() => resolve('timeout'), graceMs); });
    const result = await Promise.race([idle, timeout]);
    clearTimeout(timer);
    if (result === 'timeout') {
      this.log('warn', `drain: ${this.running.size} request(s) still running after ${graceMs} ms, aborting them`);
      for (const id of this.running.keys()) this.options.engine.abort(id);
      await Promise.race([new Promise<void>((resolve) => this.idleWaiters.push(resolve)), new Promise((r) => setTimeout(r, 2000))]);
    }
  }

  async close(): Promise<void> {
    clearInterval(this.heartbeat);
    this.offEvents?.();
    this.offAdopted?.();
    this.offProgress?.();
    for (const id of [...this.incoming.keys()]) this.cancelIncoming(id, 'the worker is closing');
    await this.kvServer?.close();
    for (const c of this.connections) c.socket.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }

  // -------------------------------------------------------------------------------------------------------------

  private accept(socket: net.Socket): void {
    const peer = `${socket.remoteAddress}:${socket.remotePort}`;
    const connection: Connection = { socket, peer, authenticated: false, wantsEvents: false, requests: new Set() };
    this.connections.add(connection);
    socket.setNoDelay(true);
    socket.setKeepAlive(true, 1000);
    const reader = new FrameReader(MAX_HELLO_BYTES);
    // A peer that never says hello does not hold the connection.
    const helloTimer = setTimeout(() => this.refuse(connection, 'no hello within 10 s'), 10_000);
    socket.on('data', (chunk: Buffer) => {
      if (socket.destroyed) return;
      try {
        reader.write(chunk);
        for (let frame = reader.next(); frame && !socket.destroyed; frame = reader.next()) {
          if (frame.kind !== FRAME_JSON) throw new FrameError('a worker accepts JSON frames only');
          const message = parseJsonMessage(frame.payload);
          if (!connection.authenticated) {
            clearTimeout(helloTimer);
            this.hello(connection, message);
            if (!connection.authenticated) return;
            reader.maxFrameBytes = this.maxFrameBytes;
            continue;
          }
          this.handle(connection, message);
        }
      } catch (error) {
        this.refuse(connection, (error as Error).message);
      }
    });
    socket.on('error', () => {});
    socket.on('close', () => {
      clearTimeout(helloTimer);
      this.connections.delete(connection);
      // The frontend is gone: what it started stops here.
      for (const id of connection.requests) this.abortRequest(id);
      for (const [id, stream] of this.incoming) if (stream.connection === connection) this.cancelIncoming(id, 'the frontend is gone');
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
    const welcome: Welcome = {
      t: 'welcome', v: REQUEST_PLANE_VERSION, workerId: this.workerId, role: this.role, info: this.options.engine.info,
      stats: this.options.engine.stats(), draining: this.draining,
      ...(this.kvPort !== undefined ? { kvPort: this.kvPort } : {}),
      ...((this.options.engine as Partial<PrefillWorkerEngine>).kvLayout ? { kvLayout: (this.options.engine as Partial<PrefillWorkerEngine>).kvLayout } : {}),
    };
    connection.socket.write(encodeJsonFrame(welcome));
  }

  private handle(connection: Connection, message: { t: string } & Record<string, unknown>): void {
    switch (message.t) {
      case 'gen': return this.generate(connection, message.request);
      case 'prefill': return this.prefill(connection, message.request);
      case 'adopt': return this.adopt(connection, message);
      case 'expect': return this.expect(connection, message);
      case 'release': {
        const id = message.id;
        if (typeof id === 'string' && this.pinned.delete(id)) {
          (this.options.engine as Partial<PrefillWorkerEngine>).releaseHandoff?.(id);
          this.kvServer?.ended(id, 'was released');
        }
        return;
      }
      case 'abort': {
        const id = message.id;
        if (typeof id !== 'string') return;
        if (this.incoming.get(id)?.connection === connection) this.cancelIncoming(id, 'aborted');
        if (connection.requests.has(id)) this.abortRequest(id);
        return;
      }
      case 'reset': {
        const rid = message.rid;
        void this.options.engine.resetPrefixCache().then(
          (ok) => this.send(connection, { t: 'reset', rid, ok, stats: this.options.engine.stats() }),
          () => this.send(connection, { t: 'reset', rid, ok: false, stats: this.options.engine.stats() }));
        return;
      }
      case 'snapshot':
        this.send(connection, { t: 'snapshot', rid: message.rid, lastEventId: this.kv.lastEventId, hashes: [...this.kv.hashes] });
        return;
      case 'card':
        connection.socket.write(encodeBlobFrame(v8Serialize(this.modelCard())));
        return;
      default:
        throw new FrameError(`unknown message type ${JSON.stringify(message.t).slice(0, 40)}`);
    }
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

  private generate(connection: Connection, raw: unknown): void {
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
    void this.stream(connection, id, () => this.options.engine.generate(request));
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
  private prefill(connection: Connection, raw: unknown): void {
    const engine = this.options.engine as Partial<PrefillWorkerEngine>;
    if (this.role !== 'prefill' || !engine.prefill) throw new FrameError(`worker ${this.workerId} is not a prefill worker`);
    const request = this.admit(connection, raw);
    if (!request) return;
    const id = request.id;
    let handedOff = false;
    this.kvServer?.started(id);
    void this.stream(connection, id, () => engine.prefill!(request), (handoff) => {
      handedOff = true;
      this.pinned.add(id);
      this.kvServer?.handedOff(id, handoff.sourceBlockIds);
      this.send(connection, { t: 'handoff', id, handoff: toWireHandoff(handoff) });
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
    const { id, promptTokens, source } = message as { id?: unknown; promptTokens?: unknown; source?: { host?: unknown; port?: unknown } | null };
    if (typeof id !== 'string' || id.length === 0 || !Number.isSafeInteger(promptTokens) || (promptTokens as number) < 1
      || !source || typeof source.host !== 'string' || !Number.isInteger(source.port)) {
      throw new FrameError('expect needs a request id, its prompt length and the prefill worker\'s KV address');
    }
    this.cancelIncoming(id, 'expected again');
    const staging = this.staging;
    const count = Math.ceil((promptTokens as number) / staging.layout.blockSize);
    if (count > staging.free.length || staging.held.has(id) || this.running.has(id)) return;
    const ids = staging.free.splice(staging.free.length - count, count).reverse();
    staging.held.set(id, ids);
    const handle = streamKvBlocks({ requestId: id, destinationBlockIds: ids, layers: [0, staging.layout.numLayers] }, {
      clusterToken: this.options.clusterToken, host: source.host, port: source.port as number, destination: staging,
      ...(this.options.kvLink ? { link: this.options.kvLink } : {}),
    });
    handle.deadline(STREAM_UNCLAIMED_MS);
    const stream: IncomingStream = { handle, ids, host: source.host, port: source.port as number, connection, claimed: false };
    this.incoming.set(id, stream);
    handle.result.catch((error: unknown) => {
      // Claimed: the adopt deals with it. Not: the request ended elsewhere (finished on its first token, aborted,
      // prefilled here) or the prefill worker is gone; its staging goes back.
      if (stream.claimed || this.incoming.get(id) !== stream) return;
      this.incoming.delete(id);
      if (staging.held.get(id) === ids) this.freeStaging(id);
      this.log('debug', `KV stream of ${id} ended before its handoff: ${(error as Error).message}`);
      // A corrupted or cut stream is a failed transfer (the adopt falls back to prefilling here), kept a bounded time.
      if (error instanceof KvTransferError && INTEGRITY_FAILURES.has(error.reason)) {
        this.failedStreams.set(id, error);
        setTimeout(() => { if (this.failedStreams.get(id) === error) this.failedStreams.delete(id); }, STREAM_UNCLAIMED_MS).unref();
      }
    });
  }

  private cancelIncoming(id: string, why: string): void {
    this.failedStreams.delete(id);
    const stream = this.incoming.get(id);
    if (!stream) return;
    this.incoming.delete(id);
    stream.handle.cancel(why);
    if (this.staging?.held.get(id) === stream.ids) this.freeStaging(id);
  }

  /**
   * Decode role: pulls the handed-off blocks from the prefill worker's KV port into the staging pool, then lets the
   * engine adopt them from there; a failed pull (checksum, truncation, prefill worker gone) is logged and counted,
   * and the engine recomputes the prompt itself (adopt with no source).
   */
  private adopt(connection: Connection, message: Record<string, unknown>): void {
    const engine = this.options.engine as Partial<DecodeWorkerEngine>;
    if (this.role !== 'decode' || !engine.adopt || !this.staging) throw new FrameError(`worker ${this.workerId} is not a decode worker`);
    let handoff: KvHandoff;
    try {
      handoff = parseWireHandoff(message.handoff);
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
    const staging = this.staging;
    const start = async (): Promise<AsyncIterable<EngineOutput> | Iterable<EngineOutput>> => {
      const count = handoff.sourceBlockIds.length;
      const failed = this.failedStreams.get(id);
      if (failed) {
        this.failedStreams.delete(id);
        this.countTransfer(failed.reason);
        this.log('warn', `KV transfer of ${id} failed (${failed.reason}): ${failed.message}; prefilling here instead`);
        return engine.adopt!(handoff, null);
      }
      // A stream started at expect() from this very source: the adopt waits for its rest. Any other is dropped.
      const streamed = this.incoming.get(id);
      const usable = streamed !== undefined && source !== null && streamed.host === source.host && streamed.port === source.port
        && streamed.ids.length === count;
      if (streamed && !usable) this.cancelIncoming(id, 'the handoff names another source');
      else this.incoming.delete(id);
      if (!source || typeof source.host !== 'string' || !Number.isInteger(source.port) || (!usable && count > staging.free.length)) {
        this.countTransfer(source ? 'no-staging-space' : 'no-source');
        return engine.adopt!(handoff, null);
      }
      let ids: number[];
      if (usable) {
        ids = streamed.ids;
        streamed.claimed = true;
      } else {
        ids = staging.free.splice(staging.free.length - count, count).reverse();
        staging.held.set(id, ids);
      }
      const started = performance.now();
      const startedEngineMs = engineNow();
      this.pulling.add(id);
      try {
        let pulled: KvPullResult;
        if (usable) {
          streamed.handle.deadline(TRANSFER_TIMEOUT_MS);
          pulled = await streamed.handle.result;
          if (pulled.sourceBlockIds.some((block, i) => block !== handoff.sourceBlockIds[i])) {
            throw new KvTransferError('unexpected-run', `KV stream of ${id}: the prefill side sent other blocks than it handed off`);
          }
        } else {
          pulled = await pullKvBlocks(
            { requestId: id, sourceBlockIds: handoff.sourceBlockIds, destinationBlockIds: ids, layers: [0, staging.layout.numLayers] },
            { clusterToken: this.options.clusterToken, host: source.host, port: source.port as number, destination: staging,
              ...(this.options.kvLink ? { link: this.options.kvLink } : {}) });
        }
        this.countTransfer('ok');
        if (this.pulling.delete(id) && this.abortedPulls.delete(id)) {
          // Aborted while its KV was on the way: nothing to adopt.
          this.freeStaging(id);
          return [];
        }
        // From the handoff reaching this worker to the last block checked; the engine's copy out of staging adds to it.
        this.pulls.set(id, { bytes: pulled.bytes, ms: performance.now() - started, link: pulled.link, overlapMs: pulled.overlapMs });
        this.transferFacts.set(id, { startMs: startedEngineMs, link: pulled.link, overlapMs: pulled.overlapMs });
        return engine.adopt!({ ...handoff, sourceBlockIds: ids, sourceLayout: staging.layout }, STAGING_SOURCE);
      } catch (error) {
        this.freeStaging(id);
        this.pulling.delete(id);
        if (this.abortedPulls.delete(id)) return [];
        const reason = error instanceof KvTransferError ? error.reason : 'error';
        this.countTransfer(reason);
        this.log('warn', `KV transfer of ${id} from ${source.host}:${String(source.port)} failed (${reason}): ${(error as Error).message}; prefilling here instead`);
        return engine.adopt!(handoff, null);
      }
    };
    this.adoptedTo.set(id, connection);
    void this.stream(connection, id, start);
  }

  /** Each adopted request's transfer: ms from the handoff's arrival to the last block checked (what it waited). */
  private readonly pulls = new Map<string, { bytes: number; ms: number; link: KvLink; overlapMs: number }>();
  /** What an adopted request's first output says of its transfer: from the handoff's arrival, its link, its overlap. */
  private readonly transferFacts = new Map<string, { startMs: number; link: KvLink; overlapMs: number }>();

  /** The output that carries the engine's copy out of staging carries the whole transfer instead (for the trace). */
  private withTransfer(id: string, output: EngineOutput): EngineOutput {
    const facts = this.transferFacts.get(id);
    const copied = output.timestamps.kvTransfer;
    if (!facts || !copied) return output;
    this.transferFacts.delete(id);
    const kvTransfer = { ...copied, start: Math.min(facts.startMs, copied.start), link: facts.link, overlapMs: facts.overlapMs };
    return { ...output, timestamps: { ...output.timestamps, kvTransfer } };
  }

  /** Requests whose KV pull is under way, and those of them aborted meanwhile (the engine does not know them yet). */
  private readonly pulling = new Set<string>();
  private readonly abortedPulls = new Set<string>();

  private abortRequest(id: string): void {
    if (this.pinned.delete(id)) this.kvServer?.ended(id, 'was aborted');
    if (this.pulling.has(id)) this.abortedPulls.add(id);
    else this.options.engine.abort(id);
  }
  private readonly adoptedTo = new Map<string, Connection>();

  private countTransfer(outcome: string): void {
    this.kvTransfers.set(outcome, (this.kvTransfers.get(outcome) ?? 0) + 1);
  }

  private freeStaging(id: string): void {
    const ids = this.staging?.held.get(id);
    if (!ids) return;
    this.staging!.held.delete(id);
    this.staging!.free.push(...ids);
  }

  /** The engine copied the blocks out of staging (or recomputes): free them, tell the frontend (tcp, pull time included). */
  private adopted(result: AdoptedResult): void {
    this.freeStaging(result.requestId);
    const pull = this.pulls.get(result.requestId);
    this.pulls.delete(result.requestId);
    const connection = this.adoptedTo.get(result.requestId);
    this.adoptedTo.delete(result.requestId);
    let out = result;
    if (result.transfer && pull) {
      const ms = result.transfer.ms + pull.ms;
      // A streamed transfer's rate is over all of the link's time, hidden behind the prefill or not.
      const rateMs = ms + pull.overlapMs;
      const transfer = {
        ...result.transfer, channel: pull.link, startMs: result.transfer.endMs - ms, ms,
        // Hidden: the link's time before the prefill ended; exposed: everything the request waited for after it.
        gbPerSec: rateMs > 0 ? result.transfer.bytes / rateMs / 1e6 : 0, overlapMs: pull.overlapMs,
        hiddenShare: pull.overlapMs + ms > 0 ? pull.overlapMs / (pull.overlapMs + ms) : 0,
      };
      out = { ...result, transfer };
    }
    if (connection) this.send(connection, { t: 'adopted', result: out });
  }

  private async stream(connection: Connection, id: string, start: () => AsyncIterable<EngineOutput | PrefillEvent> | Promise<Iterable<EngineOutput> | AsyncIterable<EngineOutput>>,
    onHandoff?: (handoff: KvHandoff) => void): Promise<void> {
    try {
      for await (const item of await start()) {
        if (connection.socket.destroyed) break;
        if ('type' in item && (item.type === 'handoff' || item.type === 'output')) {
          if (item.type === 'handoff') onHandoff?.(item.handoff);
          else this.send(connection, { t: 'out', id, outputs: [item.output], stats: this.options.engine.stats() });
          continue;
        }
        this.send(connection, { t: 'out', id, outputs: [this.withTransfer(id, item as EngineOutput)], stats: this.options.engine.stats() });
      }
      this.send(connection, { t: 'end', id, stats: this.options.engine.stats() });
    } catch (error) {
      const e = error as Error & { code?: string; retryAfterMs?: number };
      this.send(connection, {
        t: 'err', id, name: e.name ?? 'Error', code: e.code, message: e.message,
        ...(e.retryAfterMs !== undefined ? { retryAfterMs: e.retryAfterMs } : {}),
      });
    } finally {
      this.running.delete(id);
      this.adoptedTo.delete(id);
      this.transferFacts.delete(id);
      connection.requests.delete(id);
      if (this.running.size === 0) for (const resolve of this.idleWaiters.splice(0)) resolve();
    }
  }

  private send(connection: Connection, message: object): void {
    if (!connection.socket.destroyed) connection.socket.write(encodeJsonFrame(message));
  }

  private log(level: 'debug' | 'info' | 'warn' | 'error', message: string): void {
    this.options.log?.(level, message);
  }
}
