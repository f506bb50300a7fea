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
}

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
        resolve((this.server.address() as net.AddressInfo).port);
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
      for (const id of connection.requests) this.options.engine.abort(id);
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
    };
    connection.socket.write(encodeJsonFrame(welcome));
  }

  private handle(connection: Connection, message: { t: string } & Record<string, unknown>): void {
    switch (message.t) {
      case 'gen': return this.generate(connection, message.request);
      case 'abort': {
        const id = message.id;
        if (typeof id === 'string' && connection.requests.has(id)) this.options.engine.abort(id);
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
    void this.stream(connection, id, () => this.options.engine.generate(request));
  }

  private async stream(connection: Connection, id: string, start: () => AsyncIterable<EngineOutput>): Promise<void> {
    try {
      for await (const output of start()) {
        if (connection.socket.destroyed) break;
        this.send(connection, { t: 'out', id, outputs: [output], stats: this.options.engine.stats() });
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
