// The frontend side of the request plane: one worker process behind the Engine interface. The routed engine holds it
// exactly as it holds a worker thread (RoutableEngine): requests stream over the connection, abort travels as a
// message, the worker's stats ride on every frame, and KV events arrive either on the connection (local child
// workers) or from the event plane (deliverKvEvents).
//
// A lost connection (closed, reset, or silent past the heartbeat timeout) fails every request on it at once with
// WorkerLostError and tells the onLost listeners, so the routed engine drops the worker and migrates what it can,
// without waiting for the discovery lease to lapse. A worker that says it is draining is reported lost too (it takes
// no new requests) while the streams it is finishing keep flowing.
//
// A request whose frame is over the worker's --max-frame-bytes (its welcome says how much it takes) is refused here
// before anything is sent, with an InvalidRequestError for that request alone (the client's 400): the worker would
// otherwise have to refuse the frame, and nothing else on the connection is disturbed either way.

import net from 'node:net';
import { EngineClosedError, EngineOverloadedError, InvalidRequestError, LoraLoadError, WorkerLostError } from '../engine/errors.ts';
import { LoraCapacityError } from '../runtime/lora-manager.ts';
import { AsyncQueue } from '../engine/streams.ts';
import { engineNow } from '../engine/clock.ts';
import type { EngineInfo, EngineOutput, EngineRequest, LoraLoadInfo, WorkerRole } from '../engine/types.ts';
import type { KvEvent } from '../protocols/kv-events.ts';
import { hashTokenBlocks } from '../protocols/block-hash.ts';
import type { EngineStats } from '../protocols/worker.ts';
import type { RoutableEngine } from '../runtime/worker-group.ts';
import { v8Deserialize } from './blob.ts';
import { PrefillStream, type AdoptedResult, type KvHandoff, type PrefillEvent } from '../engine/handoff.ts';
import type { KvPoolLayout } from '../engine/handoff.ts';
import { parseWireHandoff, toWireHandoff } from './kv-tcp.ts';
import {
  DEFAULT_MAX_FRAME_BYTES, encodeJsonFrame, FrameError, FrameReader, FRAME_BLOB, OversizedFrameError, parseJsonMessage,
} from './frames.ts';
import {
  frameOverLimit, HEARTBEAT_TIMEOUT_MS, parseHashes, parseInfo, parseKvEvents, parseRole, parseSnapshotTiers, parseStats, REQUEST_PLANE_VERSION,
  toWireRequest, type KvSnapshot, type ModelCard,
} from './request-plane.ts';

/**
 * The worker's model card is larger than this frontend's --max-frame-bytes: the frontend cannot read it, from this
 * worker process or any other of the model, until it runs with a larger limit.
 */
export class ModelCardTooLargeError extends Error {
  override name = 'ModelCardTooLargeError';
  constructor(readonly workerId: string, readonly address: string, readonly cardBytes: number, readonly limitBytes: number) {
    super(`the model card of worker ${workerId} at ${address} is a frame of ${cardBytes} bytes, over this frontend's limit of `
      + `${limitBytes} bytes (--max-frame-bytes): this frontend cannot serve the model until it runs with a larger --max-frame-bytes`);
  }
}

export interface RemoteEngineOptions {
  clusterToken: string;
  /** Ask the worker to send its KV events on this connection (local child workers; no event plane). */
  events?: boolean;
  maxFrameBytes?: number;
  connectTimeoutMs?: number;
  heartbeatTimeoutMs?: number;
  log?: (level: 'debug' | 'info' | 'warn' | 'error', message: string) => void;
}

/**
 * The prefill worker connection each handoff came from. A decode worker pulls a handoff's blocks from the process
 * that pinned them: by worker id alone (kvSourceAddress) that is whichever process holds the id now, and a prefill
 * worker restarted under its id while the old process drains would be asked for blocks it never had.
 */
const handoffOrigins = new WeakMap<KvHandoff, RemoteEngine>();

interface Pending<T> {
  resolve(value: T): void;
  reject(error: Error): void;
}

export class RemoteEngine implements RoutableEngine {
  readonly workerId: string;
  readonly role: WorkerRole;
  readonly info: EngineInfo;
  readonly address: string;
  private latestStats: EngineStats;
  /** latestStats is an event-plane snapshot (deliverStats), not a report the onStats listeners were passed. */
  private snapshotUnreported = false;
  private readonly streams = new Map<string, AsyncQueue<EngineOutput>>();
  private readonly prefills = new Map<string, PrefillStream>();
  /** Prefill worker: requests handed off whose blocks are pinned there until released (or aborted). */
  private readonly handedOff = new Set<string>();
  private readonly adoptedListeners = new Set<(result: AdoptedResult) => void>();
  /** A prefill worker's KV port, on the host of its request-plane address. */
  readonly kvPort: number | undefined;
  readonly kvLayout: KvPoolLayout | undefined;
  /** The largest frame the worker takes (its welcome's), or undefined from a worker that does not say. */
  readonly maxFrameBytes: number | undefined;
  /** Decode worker: where the KV port of a prefill worker is, by its id (set by whoever pairs the workers). */
  kvSourceAddress: ((prefillId: string) => { host: string; port: number } | undefined) | undefined;
  private readonly kvListeners = new Set<(events: KvEvent[]) => void>();
  private readonly lostListeners = new Set<(error: Error) => void>();
  private readonly statsListeners = new Set<(stats: EngineStats) => void>();
  private readonly replies = new Map<number, Pending<unknown>>();
  private cardWaiters: Pending<ModelCard | null>[] = [];
  private nextReplyId = 1;
  private lostError: Error | undefined;
  private closed = false;
  private drainingFlag = false;
  private closeWhenIdle = false;
  private lastFrameAt = performance.now();
  private readonly watchdog: NodeJS.Timeout;
  /** Pings the worker (when its welcome asked for them) so that it can tell this frontend is still there. */
  private readonly pinger: NodeJS.Timeout | undefined;

  private constructor(private readonly socket: net.Socket, private readonly reader: FrameReader, welcome: Record<string, unknown>,
    address: string, private readonly options: RemoteEngineOptions) {
    this.address = address;
    this.workerId = String(welcome.workerId);
    this.role = parseRole(welcome.role);
    this.info = parseInfo(welcome.info);
    this.latestStats = parseStats(welcome.stats);
    this.drainingFlag = welcome.draining === true;
    this.kvPort = Number.isInteger(welcome.kvPort) ? Number(welcome.kvPort) : undefined;
    this.kvLayout = welcome.kvLayout as KvPoolLayout | undefined;
    const limit = welcome.maxFrameBytes;
    this.maxFrameBytes = Number.isSafeInteger(limit) && (limit as number) > 0 ? limit as number : undefined;
    socket.on('data', (chunk: Buffer) => this.receive(chunk));
    socket.on('close', () => this.lose(`connection to worker ${this.workerId} at ${address} closed`));
    const timeout = options.heartbeatTimeoutMs ?? HEARTBEAT_TIMEOUT_MS;
    const tickMs = Math.min(1000, timeout / 2);
    let lastTick = performance.now();
    this.watchdog = setInterval(() => {
      const now = performance.now();
      // This process was stalled (a long synchronous task, a GC pause): the worker's frames may be waiting unread
      // behind this timer, so the silence is ours, not the worker's. Count from now.
      if (now - lastTick > 2 * tickMs) this.lastFrameAt = now;
      lastTick = now;
      if (now - this.lastFrameAt > timeout) {
        this.lose(`worker ${this.workerId} at ${address} sent nothing for ${timeout} ms`);
        socket.destroy();
      }
    }, tickMs);
    this.watchdog.unref();
    const pingMs = welcome.pingMs;
    if (Number.isSafeInteger(pingMs) && (pingMs as number) > 0) {
      const ping = encodeJsonFrame({ t: 'ping' });
      this.pinger = setInterval(() => {
        if (!this.socket.destroyed) this.socket.write(ping);
      }, Math.max(10, Math.min(pingMs as number, HEARTBEAT_TIMEOUT_MS)));
      this.pinger.unref();
    }
  }

  /**
   * Connects to a worker's request endpoint ("host:port") and authenticates; resolves once welcomed. Every failure,
   * an address that is not host:port included, is a rejection: nothing throws from here.
   */
  static connect(address: string, options: RemoteEngineOptions): Promise<RemoteEngine> {
    let host: string;
    let port: number;
    try {
      ({ host, port } = splitAddress(address));
    } catch (error) {
      return Promise.reject(error as Error);
    }
    return new Promise((resolve, reject) => {
      const socket = net.connect({ host, port });
      socket.setNoDelay(true);
      socket.setKeepAlive(true, 1000);
      const reader = new FrameReader(options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES);
      const fail = (error: Error): void => {
        clearTimeout(timer);
        socket.destroy();
        reject(error);
      };
      const timer = setTimeout(() => fail(new Error(`worker at ${address} did not answer within ${options.connectTimeoutMs ?? 5000} ms`)),
        options.connectTimeoutMs ?? 5000);
      socket.once('error', (error) => fail(new Error(`cannot reach worker at ${address}: ${error.message}`)));
      socket.once('close', () => fail(new Error(`worker at ${address} closed the connection before welcoming`)));
      socket.once('connect', () => {
        // ping: this frontend pings a worker that asks for it (welcome.pingMs), which then notices when it is gone.
        socket.write(encodeJsonFrame({ t: 'hello', v: REQUEST_PLANE_VERSION, token: options.clusterToken, events: options.events === true, ping: true }));
      });
      const onData = (chunk: Buffer): void => {
        try {
          const frames = reader.push(chunk);
          if (frames.length === 0) return;
          const message = parseJsonMessage(frames[0]!.payload);
          if (message.t === 'refused') throw new Error(`worker at ${address} refused the connection: ${String(message.reason)}`);
          if (message.t !== 'welcome') throw new FrameError(`expected welcome, got ${message.t}`);
          socket.off('data', onData);
          socket.removeAllListeners('close');
          socket.removeAllListeners('error');
          socket.on('error', () => {});
          clearTimeout(timer);
          const engine = new RemoteEngine(socket, reader, message, address, options);
          resolve(engine);
          // Frames that came in the same chunk as the welcome.
          for (const frame of frames.slice(1)) engine.handleFrame(frame.kind, frame.payload);
        } catch (error) {
          fail(error as Error);
        }
      };
      socket.on('data', onData);
    });
  }

  get draining(): boolean {
    return this.drainingFlag;
  }

  get lost(): boolean {
    return this.lostError !== undefined;
  }

  /** Lost, or closed by us (a retired worker's connection once nothing of ours ran there any more). */
  get gone(): boolean {
    return this.lostError !== undefined || this.closed;
  }

  generate(request: EngineRequest): AsyncIterable<EngineOutput> {
    if (this.lostError) throw new WorkerLostError(this.workerId, this.lostError.message);
    if (this.closed) throw new EngineClosedError('engine is closed');
    if (this.streams.has(request.id)) {
      throw new InvalidRequestError('duplicate_request_id', request.id, 'a request with this id is already running');
    }
    // sentAt: this process's clock, from which the worker takes the request's clock offset (clock-offset.ts).
    const frame = this.requestFrame(request.id, { t: 'gen', request: toWireRequest(request), sentAt: engineNow() });
    const queue = new AsyncQueue<EngineOutput>();
    this.streams.set(request.id, queue);
    this.socket.write(frame);
    const remote = this;
    return (async function* () {
      let ended = false;
      try {
        for await (const output of queue.drain()) yield output;
        ended = true;
      } finally {
        remote.streams.delete(request.id);
        // The caller left early (abort, a stop string matched after a migration): the worker stops too.
        if (!ended && !queue.done) remote.abort(request.id);
        remote.closeIfRetiredAndIdle();
      }
    })();
  }

  /** Prefill worker: the request's first token, then its handoff (blocks pinned there until releaseHandoff). */
  prefill(request: EngineRequest): AsyncIterable<PrefillEvent> {
    if (this.lostError) throw new WorkerLostError(this.workerId, this.lostError.message);
    if (this.closed) throw new EngineClosedError('engine is closed');
    if (this.prefills.has(request.id)) throw new InvalidRequestError('duplicate_request_id', request.id, 'a request with this id is already running');
    const frame = this.requestFrame(request.id, { t: 'prefill', request: toWireRequest(request), sentAt: engineNow() });
    const queue = new PrefillStream();
    this.prefills.set(request.id, queue);
    this.socket.write(frame);
    return this.follow(this.prefills, request.id, queue);
  }

  releaseHandoff(requestId: string): void {
    if (!this.lostError && !this.socket.destroyed) this.socket.write(encodeJsonFrame({ t: 'release', id: requestId }));
    if (this.handedOff.delete(requestId)) this.closeIfRetiredAndIdle();
  }

  /**
   * A retired worker's connection closes once nothing of ours runs there: no stream, no prefill, and no handed-off
   * blocks a decode worker has still to take (closing would make the worker free them).
   */
  private closeIfRetiredAndIdle(): void {
    if (this.closeWhenIdle && this.streams.size === 0 && this.prefills.size === 0 && this.handedOff.size === 0) void this.close();
  }

  /** Decode worker: continues a handed-off request, pulling its blocks from `sourceId`'s KV port over TCP. */
  adopt(handoff: KvHandoff, sourceId: string | null): AsyncIterable<EngineOutput> {
    const request = handoff.request;
    if (this.lostError) throw new WorkerLostError(this.workerId, this.lostError.message);
    if (this.closed) throw new EngineClosedError('engine is closed');
    if (this.streams.has(request.id)) throw new InvalidRequestError('duplicate_request_id', request.id, 'a request with this id is already running');
    const source = sourceId !== null ? this.originAddress(handoff, sourceId) ?? this.kvSourceAddress?.(sourceId) ?? null : null;
    const frame = this.requestFrame(request.id, { t: 'adopt', handoff: toWireHandoff(handoff), source, sentAt: engineNow() });
    const queue = new AsyncQueue<EngineOutput>();
    this.streams.set(request.id, queue);
    this.socket.write(frame);
    return this.follow(this.streams, request.id, queue);
  }

  /** The KV port of the prefill worker connection the handoff came from, while that connection stands. */
  private originAddress(handoff: KvHandoff, sourceId: string): { host: string; port: number } | undefined {
    const origin = handoffOrigins.get(handoff);
    if (!origin || origin.workerId !== sourceId || origin.gone || origin.kvPort === undefined) return undefined;
    return { host: splitAddress(origin.address).host, port: origin.kvPort };
  }

  /**
   * Decode worker: the request is about to prefill on `prefillId`; the worker starts streaming its blocks from that
   * worker's KV port as they are computed (the adopt that follows finds them there), all but those it caches.
   */
  expectHandoff(request: EngineRequest, prefillId: string): void {
    const source = this.kvSourceAddress?.(prefillId);
    if (!source || this.lostError || this.closed || this.socket.destroyed) return;
    // The prompt's full-block hashes, as the decode worker's engine computes them: the blocks it caches do not move.
    const blockHashes = hashTokenBlocks(request.promptTokenIds, this.info.blockSize, { cacheSalt: request.cacheSalt, adapterId: request.lora });
    const frame = encodeJsonFrame({
      t: 'expect', id: request.id, promptTokens: request.promptTokenIds.length, blockHashes, source, sentAt: engineNow(),
    });
    // Over the worker's limit: no early stream (the adopt that follows pulls after the handoff, or is refused itself).
    if (this.maxFrameBytes !== undefined && frame.length - 4 > this.maxFrameBytes) return;
    this.socket.write(frame);
  }

  /**
   * A request's frame (gen, prefill, adopt), refused with an InvalidRequestError for that request when it is over
   * the worker's limit: sent, the worker would refuse it (and one of an earlier release would close the connection,
   * failing every other request on it).
   */
  private requestFrame(requestId: string, message: Record<string, unknown>): Buffer {
    const frame = encodeJsonFrame(message);
    // The length a frame's header gives: its kind byte and payload.
    const bytes = frame.length - 4;
    if (this.maxFrameBytes !== undefined && bytes > this.maxFrameBytes) {
      throw new InvalidRequestError('invalid_request', requestId, frameOverLimit(bytes, this.workerId, this.maxFrameBytes));
    }
    return frame;
  }

  onAdopted(listener: (result: AdoptedResult) => void): () => void {
    this.adoptedListeners.add(listener);
    return () => this.adoptedListeners.delete(listener);
  }

  private follow<T>(map: Map<string, AsyncQueue<T>>, id: string, queue: AsyncQueue<T>): AsyncIterable<T> {
    const remote = this;
    return (async function* () {
      let ended = false;
      try {
        for await (const item of queue.drain()) yield item;
        ended = true;
      } finally {
        map.delete(id);
        if (!ended && !queue.done) remote.abort(id);
        remote.closeIfRetiredAndIdle();
      }
    })();
  }

  abort(requestId: string): void {
    if (!this.lostError && !this.socket.destroyed) this.socket.write(encodeJsonFrame({ t: 'abort', id: requestId }));
    if (this.handedOff.delete(requestId)) this.closeIfRetiredAndIdle();
  }

  stats(): EngineStats {
    return this.latestStats;
  }

  resetPrefixCache(): Promise<boolean> {
    return this.ask<boolean>({ t: 'reset' });
  }

  /** Loads a LoRA adapter on the worker (Engine.loadLora; the path is the worker's); rejects with a LoraLoadError. */
  async loadLora(name: string, path: string): Promise<LoraLoadInfo> {
    return (await this.loraCall({ t: 'lora-load', name, path })).info!;
  }

  /** Unloads a LoRA adapter from the worker; rejects with a LoraLoadError (in use, not loaded). */
  async unloadLora(name: string): Promise<void> {
    await this.loraCall({ t: 'lora-unload', name });
  }

  /**
   * A `conduit worker`'s own adapters (it keeps its own LoRA manager): registers the adapter there and resolves what
   * loading found and the key the worker knows it by (what requests for it carry as `lora`).
   */
  async registerLora(name: string, path: string): Promise<{ info: LoraLoadInfo; key?: string }> {
    const reply = await this.loraCall({ t: 'lora-load', name, path });
    return { info: reply.info!, ...(reply.key !== undefined ? { key: reply.key } : {}) };
  }

  /** Unregisters an adapter of a `conduit worker`; resolves how many of its requests were still running there. */
  async unregisterLora(name: string): Promise<{ inFlight: number }> {
    return { inFlight: (await this.loraCall({ t: 'lora-unload', name })).inFlight ?? 0 };
  }

  private async loraCall(message: Record<string, unknown>): Promise<LoraReply> {
    const reply = await this.ask<LoraReply & { error?: { code: string; message: string } }>(message);
    if (reply.error?.code === 'lora_capacity') throw new LoraCapacityError(String(message.name), 0, reply.error.message);
    if (reply.error) throw new LoraLoadError(reply.error.code as LoraLoadError['code'], reply.error.message);
    return reply;
  }

  /** The worker's cached block hashes, its tiers' and the id of its last KV event (for a router resync). */
  snapshot(): Promise<KvSnapshot> {
    return this.ask({ t: 'snapshot' });
  }

  /** The tokenizer and chat template of the worker's model (null when the worker has none to give). */
  modelCard(): Promise<ModelCard | null> {
    if (this.lostError) return Promise.reject(this.lostError);
    return new Promise((resolve, reject) => {
      this.cardWaiters.push({ resolve, reject });
      this.socket.write(encodeJsonFrame({ t: 'card' }));
    });
  }

  onKvEvents(listener: (events: KvEvent[]) => void): () => void {
    this.kvListeners.add(listener);
    return () => this.kvListeners.delete(listener);
  }

  onLost(listener: (error: Error) => void): () => void {
    this.lostListeners.add(listener);
    return () => this.lostListeners.delete(listener);
  }

  /** KV events for this worker from the event plane. */
  deliverKvEvents(events: KvEvent[]): void {
    for (const listener of this.kvListeners) listener(events);
  }

  /**
   * A load snapshot from the event plane. It travels apart from the connection's frames and can arrive after a
   * newer report there (one taken while a request ran, after the heartbeat that said it ended), so it replaces the
   * latest stats only when the worker numbered it after them; nor is it passed to onStats listeners (the router
   * takes the connection's reports, in their order).
   */
  deliverStats(stats: EngineStats): void {
    const latest = this.latestStats.reportSeq;
    if (latest !== undefined && (stats.reportSeq === undefined || stats.reportSeq <= latest)) return;
    this.latestStats = stats;
    this.snapshotUnreported = true;
  }

  /**
   * False while stats() holds an event-plane snapshot (deliverStats) that no onStats listener was passed: the routed
   * engines then read stats() after each output to give the router that newer load (RoutableEngine.statsReported).
   * The next report on the connection replaces the snapshot, and the listeners have it.
   */
  get statsReported(): boolean {
    return !this.snapshotUnreported;
  }

  /**
   * Every stats report on the connection, in the order the worker sent them (on outputs and stream ends, on KV
   * event frames, its heartbeat every HEARTBEAT_MS and after each stream that ends): its load as it is now,
   * requests other frontends sent it included.
   */
  onStats(listener: (stats: EngineStats) => void): () => void {
    this.statsListeners.add(listener);
    return () => this.statsListeners.delete(listener);
  }

  /**
   * The worker left discovery (drains, or its lease lapsed while the connection still stands): it leaves the router
   * now, and the connection closes once the streams it runs have ended (a dead worker's connection drops anyway).
   */
  retire(reason: string): void {
    if (this.lostError || this.closed) return;
    this.drainingFlag = true;
    this.closeWhenIdle = true;
    this.emitLost(new WorkerLostError(this.workerId, reason));
    this.closeIfRetiredAndIdle();
  }

  /** Ends the connection as if the worker were lost (its lease lapsed, or it left discovery). */
  drop(reason: string): void {
    this.lose(reason);
    this.socket.destroy();
  }

  async close(): Promise<void> {
    this.closed = true;
    clearInterval(this.watchdog);
    clearInterval(this.pinger);
    this.socket.end();
    this.socket.destroy();
  }

  // -------------------------------------------------------------------------------------------------------------

  private receive(chunk: Buffer): void {
    this.lastFrameAt = performance.now();
    try {
      this.reader.write(chunk);
      for (let frame = this.reader.next(); frame && !this.lostError; frame = this.reader.next()) this.handleFrame(frame.kind, frame.payload);
    } catch (error) {
      if (error instanceof OversizedFrameError && error.kind === FRAME_BLOB && this.cardWaiters.length > 0) {
        // The one blob frame is the model card: no bad worker, a limit here too small for the model's tokenizer.
        const tooLarge = new ModelCardTooLargeError(this.workerId, this.address, error.length, error.limit);
        for (const waiter of this.cardWaiters.splice(0)) waiter.reject(tooLarge);
        this.drop(tooLarge.message);
        return;
      }
      this.options.log?.('warn', `request plane: bad frame from worker ${this.workerId} at ${this.address}: ${(error as Error).message}; closing`);
      this.drop(`worker ${this.workerId} sent a bad frame: ${(error as Error).message}`);
    }
  }

  private handleFrame(kind: number, payload: Buffer): void {
    if (kind === FRAME_BLOB) {
      // No waiter (a card nobody asked for): the optional call evaluates nothing, so the blob is dropped undecoded.
      const waiter = this.cardWaiters.shift();
      waiter?.resolve(v8Deserialize(payload) as ModelCard | null);
      return;
    }
    const m = parseJsonMessage(payload);
    switch (m.t) {
      case 'out': {
        if (m.stats !== undefined) this.setStats(parseStats(m.stats));
        if (!Array.isArray(m.outputs)) return;
        const queue = this.streams.get(String(m.id));
        const prefill = this.prefills.get(String(m.id));
        for (const output of m.outputs as EngineOutput[]) {
          if (queue) queue.push(output);
          else prefill?.pushOutput(output);
        }
        return;
      }
      case 'handoff': {
        // The handoff ends the prefill's stream here, before the worker's own end arrives: a caller that stops at the
        // handoff must not look like one leaving early, whose abort would unpin the blocks the decode worker pulls.
        const prefill = this.prefills.get(String(m.id));
        if (!prefill) return;
        this.handedOff.add(String(m.id));
        const handoff = parseWireHandoff(m.handoff);
        handoffOrigins.set(handoff, this);
        prefill.pushHandoff(handoff);
        return;
      }
      case 'adopted': {
        const result = m.result as AdoptedResult;
        for (const listener of this.adoptedListeners) listener(result);
        return;
      }
      case 'end': {
        if (m.stats !== undefined) this.setStats(parseStats(m.stats));
        this.streams.get(String(m.id))?.end();
        this.prefills.get(String(m.id))?.end();
        return;
      }
      case 'err': {
        this.streams.get(String(m.id))?.fail(this.rebuildError(m));
        this.prefills.get(String(m.id))?.fail(this.rebuildError(m));
        return;
      }
      case 'hb':
        this.setStats(parseStats(m.stats));
        return;
      case 'kv': {
        const events = parseKvEvents(m.events);
        if (m.stats !== undefined) this.setStats(parseStats(m.stats));
        this.deliverKvEvents(events);
        return;
      }
      case 'reset':
        if (m.stats !== undefined) this.setStats(parseStats(m.stats));
        this.settle(m.rid, m.ok === true);
        return;
      case 'snapshot': {
        const tiers = parseSnapshotTiers(m.tiers);
        this.settle(m.rid, { lastEventId: Number(m.lastEventId), hashes: parseHashes(m.hashes), ...(tiers ? { tiers } : {}) });
        return;
      }
      case 'lora':
        this.settle(m.rid, {
          info: parseLoraInfo(m.info), error: parseLoraError(m.error),
          ...(typeof m.key === 'string' && m.key.length <= 1024 ? { key: m.key } : {}),
          ...(Number.isSafeInteger(m.inFlight) && (m.inFlight as number) >= 0 ? { inFlight: m.inFlight as number } : {}),
        });
        return;
      case 'draining':
        this.drainingFlag = true;
        this.emitLost(new WorkerLostError(this.workerId, `worker ${this.workerId} is draining`));
        return;
      case 'refused':
        throw new FrameError(`worker refused: ${String(m.reason)}`);
      default:
        throw new FrameError(`unknown message type ${JSON.stringify(m.t).slice(0, 40)}`);
    }
  }

  private rebuildError(m: Record<string, unknown>): Error {
    const message = String(m.message ?? 'worker error');
    switch (m.name) {
      case 'InvalidRequestError': return InvalidRequestError.fromWorker(String(m.code), String(m.id), message);
      case 'EngineOverloadedError': return new EngineOverloadedError(message, Number(m.retryAfterMs ?? 1000));
      // The worker's engine closed under the request (it is stopping): for the frontend the worker is lost.
      case 'EngineClosedError':
      case 'WorkerLostError': return new WorkerLostError(this.workerId, `worker ${this.workerId}: ${message}`);
      default: {
        const error = new Error(message);
        if (typeof m.name === 'string') error.name = m.name;
        return error;
      }
    }
  }

  private ask<T>(message: Record<string, unknown>): Promise<T> {
    if (this.lostError) return Promise.reject(this.lostError);
    const rid = this.nextReplyId++;
    return new Promise<T>((resolve, reject) => {
      this.replies.set(rid, { resolve: resolve as (value: unknown) => void, reject });
      this.socket.write(encodeJsonFrame({ ...message, rid }));
    });
  }

  private settle(rid: unknown, value: unknown): void {
    const pending = this.replies.get(Number(rid));
    this.replies.delete(Number(rid));
    pending?.resolve(value);
  }

  private setStats(stats: EngineStats): void {
    this.latestStats = stats;
    this.snapshotUnreported = false;
    for (const listener of this.statsListeners) listener(stats);
  }

  private lose(reason: string): void {
    if (this.lostError) return;
    clearInterval(this.watchdog);
    clearInterval(this.pinger);
    const error = new WorkerLostError(this.workerId, reason);
    this.lostError = error;
    for (const queue of this.streams.values()) queue.fail(error);
    for (const queue of this.prefills.values()) queue.fail(error);
    this.handedOff.clear();
    for (const pending of this.replies.values()) pending.reject(error);
    this.replies.clear();
    for (const waiter of this.cardWaiters.splice(0)) waiter.reject(error);
    if (!this.closed) this.emitLost(error);
  }

  private emitLost(error: Error): void {
    for (const listener of [...this.lostListeners]) listener(error);
  }
}

/** A worker address's host and port; throws unless it is host:port ([v6]:port) with a port from 1 to 65535. */
export function splitAddress(address: string): { host: string; port: number } {
  const match = /^\[?([^\]]+?)\]?:(\d{1,5})$/.exec(address);
  const port = match ? Number(match[2]) : 0;
  if (!match || port < 1 || port > 65535) throw new Error(`worker address must be host:port, got ${JSON.stringify(address.slice(0, 300))}`);
  return { host: match[1]!, port };
}

/** A `lora` reply: what a load found, the key a worker's own manager gave it, the requests an unload waits for. */
interface LoraReply {
  info?: LoraLoadInfo;
  key?: string;
  inFlight?: number;
}

/** A LoRA load's info from the wire (undefined when absent). */
function parseLoraInfo(value: unknown): LoraLoadInfo | undefined {
  if (typeof value !== 'object' || value === null) return undefined;
  const v = value as Record<string, unknown>;
  const format = v.format === 'gguf' || v.format === 'peft' || v.format === 'synthetic' ? v.format : undefined;
  if (format === undefined || typeof v.rank !== 'number' || typeof v.alpha !== 'number' || typeof v.bytes !== 'number') {
    throw new FrameError('lora reply: info must have format, rank, alpha and bytes');
  }
  const dtype = v.dtype === 'f32' || v.dtype === 'bf16' || v.dtype === 'q8' ? v.dtype : undefined;
  return { format, rank: v.rank, alpha: v.alpha, bytes: v.bytes, ...(dtype ? { dtype } : {}) };
}

/** A LoRA refusal from the wire (undefined when absent). */
function parseLoraError(value: unknown): { code: string; message: string } | undefined {
  if (value === undefined || value === null) return undefined;
  const v = value as Record<string, unknown>;
  if (typeof v !== 'object' || typeof v.code !== 'string' || typeof v.message !== 'string') {
    throw new FrameError('lora reply: error must have a code and a message');
  }
  return { code: v.code, message: v.message };
}
