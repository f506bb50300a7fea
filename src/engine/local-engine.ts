// The local engine as the gateway sees it: an `Engine` whose step loop runs in a worker thread
// (src/engine/worker-main.ts). This side only routes messages: requests and aborts in, each step's outputs out to
// the stream of the request they belong to.

import { availableParallelism, totalmem } from 'node:os';
import type { Worker } from 'node:worker_threads';
import type { KvDtype, KvPoolLayout } from '../kernels/types.ts';
import { chatTemplateFromConfig, chatTemplateFromGguf, type ChatTemplate } from '../model/chat-template.ts';
import { loadModel, type ModelSummary } from '../model/loader.ts';
import { createTokenizer } from '../model/tokenizer/index.ts';
import type { Tokenizer } from '../model/tokenizer/types.ts';
import { createLogger, type Notice } from '../util/log.ts';
import { startTsWorker } from '../util/worker-thread.ts';
import { engineNow } from './clock.ts';
import { EngineClosedError, EngineStartError, InvalidRequestError, LoraLoadError } from './errors.ts';
import { KV_IN_PLACE_SOURCE, PrefillStream, type AdoptedResult, type KvImportPreparation, type KvHandoff, type PrefillEvent, type PrefillProgress } from './handoff.ts';
import { followQueue, OutputStream } from './streams.ts';
import { DEFAULT_BLOCK_SIZE } from '../protocols/block-hash.ts';
import type { BlockHash, KvEvent } from '../protocols/kv-events.ts';
import type { Engine, EngineInfo, EngineOutput, EngineRequest, SchedulingPolicy, WorkerRole } from './types.ts';
import type { EngineStats } from '../protocols/worker.ts';
import type { BackendPreference, FromWorker, KvOffloadConfig, ToWorker, WorkerInit, WorkerLoraInfo } from './worker-protocol.ts';
import type { LoraDtype } from '../model/lora.ts';

export interface LocalEngineOptions {
  modelPath: string;
  servedModelName?: string;
  backend?: BackendPreference;
  /** Compute threads of the native backend (default: all cores). */
  threads?: number;
  /** How the native backend stores LoRA adapters (default: CONDUIT_LORA_DTYPE, else q8; model/lora.ts). */
  loraDtype?: LoraDtype;
  /** Bytes of KV pool (default: DEFAULT_KV_CACHE_MEMORY). */
  kvCacheMemoryBytes?: number;
  /** How the KV pool stores keys and values (default: the backend's choice, f16 on both CPU backends; resolveKvDtype). */
  kvDtype?: KvDtype;
  blockSize?: number;
  maxNumSeqs?: number;
  maxNumBatchedTokens?: number;
  maxModelLen?: number;
  policy?: SchedulingPolicy;
  enablePrefixCaching?: boolean;
  /**
   * Jump-forward decoding for guided requests (--guided-jump-forward; default off): text the grammar forces is
   * appended without sampling (EngineCoreOptions.jumpForward).
   */
  guidedJumpForward?: boolean;
  /** Forward the KV cache's stored/removed events (the router's index feeds on them). */
  enableKvEvents?: boolean;
  /** What the worker does in a disaggregated deployment (default 'both'). */
  role?: WorkerRole;
  /**
   * Seconds idle (no running or waiting request) after which the worker resets its prefix cache and gives its KV
   * pool's pages back to the system (default 0: never).
   */
  kvCacheIdleReleaseSeconds?: number;
  /** Lower KV tiers under the worker's pool: RAM (its share of --kv-offload-memory) and a disk folder of its own. */
  kvOffload?: KvOffloadConfig;
  /**
   * After a completion's first token, its tokens are handed to this thread this many at a time (the last ones
   * whatever their number): fewer wake-ups and stream writes per token (--stream-interval; default 1).
   */
  streamInterval?: number;
  /** Where the worker thread's warnings go (default: a warn line on stderr); the caller's logger applies --log-level. */
  log?: (level: 'warn', message: string) => void;
}

/** 1 GiB, or an eighth of RAM on a small machine: room for every request of a CPU-sized batch. */
export const DEFAULT_KV_CACHE_MEMORY = Math.min(1 << 30, Math.floor(totalmem() / 8));
export const DEFAULT_MAX_NUM_SEQS = 256;
export const DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048;

/** The worker thread's warnings when the caller gives no logger: a warn line on stderr. */
const stderrWarnings = createLogger('warn');
/** KV events kept for a first listener at most (a disk tier's announcement at start is one per block it holds). */
const MAX_UNHEARD_KV_EVENTS = 1_000_000;
const defaultWorkerLog = (_level: 'warn', message: string): void => stderrWarnings.warn(message);

// ---------------------------------------------------------------------------------------------------------------

export class LocalEngine implements Engine {
  private readonly streams = new Map<string, OutputStream>();
  private readonly prefills = new Map<string, PrefillStream>();
  private latestStats: EngineStats;
  private closed = false;
  private exitError: Error | undefined;
  private readonly kvEventListeners = new Set<(events: KvEvent[]) => void>();
  /**
   * KV events that came before anyone listened: a warm disk tier announces its blocks as the worker starts, before
   * the router has added it. The first listener gets them (undefined once it did, or once too many piled up: the
   * consumer then sees a gap in the event ids and resyncs).
   */
  private unheardKvEvents: KvEvent[] | undefined = [];
  private readonly lostListeners = new Set<(error: Error) => void>();
  private readonly adoptedListeners = new Set<(result: AdoptedResult) => void>();
  private readonly progressListeners = new Set<(progress: PrefillProgress[]) => void>();
  private readonly statsListeners = new Set<(stats: EngineStats) => void>();
  private readonly syncs = new PendingReplies<EngineStats>();
  private readonly holds = new PendingReplies<number>();
  private readonly preparations = new PendingReplies<KvImportPreparation>();
  private readonly resets = new PendingReplies<boolean>();
  private readonly loraReplies = new PendingReplies<Extract<FromWorker, { type: 'lora-done' }>>();
  /** The worker's KV pool (shared memory) and its layout: what a decode worker reads handed-off blocks from. */
  readonly kvPool: SharedArrayBuffer | undefined;
  readonly kvLayout: KvPoolLayout | undefined;
  readonly role: WorkerRole;

  private constructor(private readonly worker: Worker, readonly info: EngineInfo, readonly notices: Notice[], stats: EngineStats,
    kv: { pool?: SharedArrayBuffer; layout?: KvPoolLayout; role?: WorkerRole } = {},
    private readonly log: (level: 'warn', message: string) => void = defaultWorkerLog) {
    this.kvPool = kv.pool;
    this.kvLayout = kv.layout;
    this.role = kv.role ?? 'both';
    this.latestStats = stats;
    worker.on('message', (message: FromWorker) => this.onMessage(message));
    worker.on('error', (error) => this.onExit(error));
    worker.on('exit', (code) => this.onExit(new Error(`engine worker exited with code ${code}`)));
  }

  /** Starts the worker thread and resolves once the model is loaded and the KV pool allocated. */
  static async start(options: LocalEngineOptions): Promise<LocalEngine> {
    const init: WorkerInit = {
      modelPath: options.modelPath,
      servedModelName: options.servedModelName ?? '',
      backend: options.backend ?? 'auto',
      threads: options.threads ?? availableParallelism(),
      ...(options.loraDtype !== undefined ? { loraDtype: options.loraDtype } : {}),
      kvCacheMemoryBytes: options.kvCacheMemoryBytes ?? DEFAULT_KV_CACHE_MEMORY,
      ...(options.kvDtype !== undefined ? { kvDtype: options.kvDtype } : {}),
      blockSize: options.blockSize ?? DEFAULT_BLOCK_SIZE,
      maxNumSeqs: options.maxNumSeqs ?? DEFAULT_MAX_NUM_SEQS,
      maxNumBatchedTokens: options.maxNumBatchedTokens ?? DEFAULT_MAX_NUM_BATCHED_TOKENS,
      maxModelLen: options.maxModelLen,
      policy: options.policy ?? 'fcfs',
      enablePrefixCaching: options.enablePrefixCaching ?? true,
      guidedJumpForward: options.guidedJumpForward ?? false,
      enableKvEvents: options.enableKvEvents ?? false,
      role: options.role,
      kvCacheIdleReleaseSeconds: options.kvCacheIdleReleaseSeconds ?? 0,
      ...(options.kvOffload !== undefined ? { kvOffload: options.kvOffload } : {}),
      ...(options.streamInterval !== undefined ? { streamInterval: options.streamInterval } : {}),
    };
    const worker = startTsWorker(new URL('./worker-main.ts', import.meta.url), init);
    const ready = await new Promise<Extract<FromWorker, { type: 'ready' }>>((resolve, reject) => {
      const onMessage = (message: FromWorker) => {
        if (message.type === 'ready') { cleanup(); resolve(message); }
        if (message.type === 'failed') { cleanup(); reject(new EngineStartError(message.message)); }
        if (message.type === 'log') (options.log ?? defaultWorkerLog)(message.level, message.message);
      };
      const onError = (error: Error) => { cleanup(); reject(error); };
      const onExit = (code: number) => { cleanup(); reject(new Error(`engine worker exited with code ${code} while loading`)); };
      const cleanup = () => {
        worker.off('message', onMessage);
        worker.off('error', onError);
        worker.off('exit', onExit);
      };
      worker.on('message', onMessage);
      worker.on('error', onError);
      worker.on('exit', onExit);
    }).catch(async (error: unknown) => {
      await worker.terminate();
      throw error;
    });
    return new LocalEngine(worker, ready.info, ready.notices, ready.stats, { pool: ready.kvPool, layout: ready.kvLayout, role: options.role },
      options.log);
  }

  generate(request: EngineRequest): AsyncIterable<EngineOutput> {
    if (this.closed || this.exitError) throw this.exitError ?? new EngineClosedError('engine is closed');
    if (this.streams.has(request.id)) throw new InvalidRequestError('duplicate_request_id', request.id, 'a request with this id is already running');
    const stream = new OutputStream(request.sampling.n);
    this.streams.set(request.id, stream);
    this.post({ type: 'add', request, sentMs: engineNow() });
    return followQueue(this.streams, request.id, stream, (id) => this.abort(id));
  }

  abort(requestId: string): void {
    if (!this.closed && !this.exitError) this.post({ type: 'abort', requestId });
  }

  // -------------------------------------------------------------------------------------------------------------
  // Disaggregated serving

  /**
   * Prefill worker: runs the prompt and samples the first token, then hands the request over. Yields the outputs
   * (the first token, with its text) and then the handoff, whose blocks stay pinned in this worker until
   * releaseHandoff (or an abort). A request that ends on its first token yields no handoff.
   */
  prefill(request: EngineRequest): AsyncIterable<PrefillEvent> {
    if (this.closed || this.exitError) throw this.exitError ?? new EngineClosedError('engine is closed');
    if (this.streams.has(request.id) || this.prefills.has(request.id)) {
      throw new InvalidRequestError('duplicate_request_id', request.id, 'a request with this id is already running');
    }
    const stream = new PrefillStream();
    this.prefills.set(request.id, stream);
    this.post({ type: 'add', request, handoff: true, sentMs: engineNow() });
    return followQueue(this.prefills, request.id, stream, (id) => this.abort(id));
  }

  /** Prefill worker: the complete blocks of each prefill to hand off, after each step (what a KV stream sends early). */
  onPrefillProgress(listener: (progress: PrefillProgress[]) => void): () => void {
    this.progressListeners.add(listener);
    return () => this.progressListeners.delete(listener);
  }

  /** Prefill worker: the decode worker has the handed-off blocks (or gave up on them); unpin them. */
  releaseHandoff(requestId: string): void {
    if (!this.closed && !this.exitError) this.post({ type: 'release-handoff', requestId });
  }

  /** Decode worker: lets the worker read `sourceId`'s handed-off blocks from its pool (shared, not copied). */
  attachKvSource(sourceId: string, pool: SharedArrayBuffer, layout: KvPoolLayout): void {
    if (sourceId === KV_IN_PLACE_SOURCE) throw new Error(`${KV_IN_PLACE_SOURCE} names in-place imports, not a KV source`);
    if (!this.closed && !this.exitError) this.post({ type: 'attach-kv-source', sourceId, pool, layout });
  }

  /**
   * Decode worker: continues a request a prefill worker handed off. The missing KV blocks are copied from the
   * attached pool of `sourceId` (null, or an unattached source: the prompt is recomputed here). The stream is the
   * request's outputs from its second token on; onAdopted reports when the source blocks may be released.
   */
  adopt(handoff: KvHandoff, sourceId: string | null): AsyncIterable<EngineOutput> {
    const request = handoff.request;
    if (this.closed || this.exitError) throw this.exitError ?? new EngineClosedError('engine is closed');
    if (this.streams.has(request.id)) throw new InvalidRequestError('duplicate_request_id', request.id, 'a request with this id is already running');
    const stream = new OutputStream(1);
    this.streams.set(request.id, stream);
    this.post({ type: 'adopt', handoff, sourceId });
    return followQueue(this.streams, request.id, stream, (id) => this.abort(id));
  }

  /**
   * Decode worker, before fetching a handed-off request's KV from another process: pins the leading blocks of
   * `blockHashes` this worker's prefix cache holds and resolves with their number; only the blocks after them need
   * to move. The pin lasts until the request is adopted (adopt, imported or recomputed) or aborted (abort, also
   * before adopt was called).
   */
  holdCachedPrefix(requestId: string, blockHashes: readonly BlockHash[]): Promise<number> {
    if (this.closed || this.exitError) return Promise.reject(this.exitError ?? new EngineClosedError('engine is closed'));
    const { id, reply } = this.holds.open();
    this.post({ type: 'hold-prefix', holdId: id, requestId, blockHashes: [...blockHashes] });
    return reply;
  }

  /**
   * Decode worker, before a handed-off request's KV comes from another process: holds the cached prefix as
   * holdCachedPrefix does and reserves blocks of this worker's pool (kvPool) for the other numBlocks - held blocks
   * (blockIds, in position order; null when the pool lacks room, or reserve is false: the hold only). The transfer
   * writes the KV into them, and adopt(handoff, KV_IN_PLACE_SOURCE) makes them the request's own: no copy. The hold
   * and the reservation last until an adoption, an abort, or releaseKvImport(requestId, ticket).
   */
  prepareKvImport(requestId: string, blockHashes: readonly BlockHash[], numBlocks: number, reserve = true): Promise<KvImportPreparation> {
    if (this.closed || this.exitError) return Promise.reject(this.exitError ?? new EngineClosedError('engine is closed'));
    const { id, reply } = this.preparations.open();
    this.post({ type: 'prepare-import', holdId: id, requestId, blockHashes: [...blockHashes], numBlocks, reserve });
    return reply;
  }

  /** Decode worker: the blocks of prepareKvImport's `ticket` will not be written after all; they and the hold go. */
  releaseKvImport(requestId: string, ticket: number): void {
    if (!this.closed && !this.exitError) this.post({ type: 'release-import', requestId, ticket });
  }

  /** Decode worker: called once per adopted request when its source blocks are no longer needed. */
  onAdopted(listener: (result: AdoptedResult) => void): () => void {
    this.adoptedListeners.add(listener);
    return () => this.adoptedListeners.delete(listener);
  }

  /** Fresh stats, taken after every message posted before this call has been handled by the worker. */
  sync(): Promise<EngineStats> {
    if (this.closed || this.exitError) return Promise.reject(this.exitError ?? new EngineClosedError('engine is closed'));
    const { id, reply } = this.syncs.open();
    this.post({ type: 'sync', syncId: id });
    return reply;
  }

  stats(): EngineStats {
    return this.latestStats;
  }

  /** The worker drops its prefix cache and releases the KV pool's pages, unless blocks are in use (false). */
  resetPrefixCache(): Promise<boolean> {
    if (this.closed || this.exitError) return Promise.reject(this.exitError ?? new EngineClosedError('engine is closed'));
    const { id, reply } = this.resets.open();
    this.post({ type: 'reset-prefix-cache', resetId: id });
    return reply;
  }

  /**
   * Loads a LoRA adapter on the worker (see Engine.loadLora); rejects with a LoraLoadError. The info carries the
   * digest of the bytes the worker read (WorkerLoraInfo), which the LoRA manager checks against the adapter's key.
   */
  async loadLora(name: string, path: string): Promise<WorkerLoraInfo> {
    const reply = await this.loraCall((loraId) => ({ type: 'load-lora', loraId, name, path }));
    return reply.info!;
  }

  /** Unloads a LoRA adapter from the worker; rejects with a LoraLoadError (in use, not loaded). */
  async unloadLora(name: string): Promise<void> {
    await this.loraCall((loraId) => ({ type: 'unload-lora', loraId, name }));
  }

  private async loraCall(message: (loraId: number) => ToWorker): Promise<Extract<FromWorker, { type: 'lora-done' }>> {
    if (this.closed || this.exitError) throw this.exitError ?? new EngineClosedError('engine is closed');
    const { id, reply } = this.loraReplies.open();
    this.post(message(id));
    const done = await reply;
    if (done.error) throw new LoraLoadError(done.error.code as LoraLoadError['code'], done.error.message);
    return done;
  }

  /** Subscribes to the worker's KV events (only sent when enableKvEvents); returns the unsubscribe function. */
  onKvEvents(listener: (events: KvEvent[]) => void): () => void {
    this.kvEventListeners.add(listener);
    const unheard = this.unheardKvEvents;
    this.unheardKvEvents = undefined;
    if (unheard !== undefined && unheard.length > 0) listener(unheard);
    return () => this.kvEventListeners.delete(listener);
  }

  private deliverKvEvents(events: KvEvent[] | undefined): void {
    if (events === undefined || events.length === 0) return;
    if (this.kvEventListeners.size === 0 && this.unheardKvEvents !== undefined) {
      // Appended in place: a new array per batch (concat) copied everything held so far, quadratic over a long wait.
      if (this.unheardKvEvents.length + events.length > MAX_UNHEARD_KV_EVENTS) this.unheardKvEvents = undefined;
      else for (const event of events) this.unheardKvEvents.push(event);
      return;
    }
    for (const listener of this.kvEventListeners) listener(events);
  }

  /**
   * Every stats report the worker sends, in order: with each step's outputs, and on the messages that change its
   * load between them (an abort's, an idle worker's KV offload, LoRA loads). The router takes the worker's load
   * from these, so a request that ended without an output reaching its reader (an abort) is not counted for ever.
   */
  onStats(listener: (stats: EngineStats) => void): () => void {
    this.statsListeners.add(listener);
    return () => this.statsListeners.delete(listener);
  }

  /**
   * Always true: stats() changes only through setStats, which passes each value to the onStats listeners, so a
   * router fed by them needs no second look at stats() per output (RoutableEngine.statsReported).
   */
  get statsReported(): boolean {
    return true;
  }

  /** Called once if the worker thread dies (not on close()): the router drops the worker. */
  onLost(listener: (error: Error) => void): () => void {
    this.lostListeners.add(listener);
    return () => this.lostListeners.delete(listener);
  }

  /** Kills the worker thread at once, as a crash would; in-flight requests fail. For failure tests and drills. */
  async kill(): Promise<void> {
    await this.worker.terminate();
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    for (const [id, stream] of this.streams) {
      stream.fail(new EngineClosedError(`engine closed while request ${id} was running`));
    }
    this.streams.clear();
    for (const [id, stream] of this.prefills) stream.fail(new EngineClosedError(`engine closed while request ${id} was prefilling`));
    this.prefills.clear();
    this.syncs.rejectAll(new EngineClosedError('engine closed'));
    this.holds.rejectAll(new EngineClosedError('engine closed'));
    this.preparations.rejectAll(new EngineClosedError('engine closed'));
    this.resets.rejectAll(new EngineClosedError('engine closed'));
    this.loraReplies.rejectAll(new EngineClosedError('engine closed'));
    if (!this.exitError) {
      const exited = new Promise<void>((resolve) => this.worker.once('exit', () => resolve()));
      this.post({ type: 'close' });
      const timer = setTimeout(() => void this.worker.terminate(), 2000);
      await exited;
      clearTimeout(timer);
    }
  }

  private post(message: ToWorker): void {
    this.worker.postMessage(message);
  }

  private setStats(stats: EngineStats): void {
    this.latestStats = stats;
    for (const listener of this.statsListeners) listener(stats);
  }

  private onMessage(message: FromWorker): void {
    switch (message.type) {
      case 'outputs':
        this.setStats(message.stats);
        for (const output of message.outputs) {
          const stream = this.streams.get(output.requestId);
          if (stream) stream.push(output);
          else this.prefills.get(output.requestId)?.pushOutput(output);
        }
        this.deliverKvEvents(message.kvEvents);
        return;
      case 'prefill-progress':
        for (const listener of this.progressListeners) listener(message.progress);
        return;
      case 'handoffs':
        for (const handoff of message.handoffs) {
          const stream = this.prefills.get(handoff.requestId);
          // Nobody waits for it any more (the consumer left): its blocks must not stay pinned.
          if (stream) stream.pushHandoff(handoff);
          else this.releaseHandoff(handoff.requestId);
        }
        return;
      case 'adopted':
        this.setStats(message.stats);
        for (const result of message.adopted) for (const listener of this.adoptedListeners) listener(result);
        return;
      case 'synced':
        this.setStats(message.stats);
        this.syncs.settle(message.syncId, message.stats);
        return;
      case 'prefix-held':
        this.setStats(message.stats);
        this.holds.settle(message.holdId, message.blocks);
        return;
      case 'import-prepared':
        this.setStats(message.stats);
        if (message.preparation) this.preparations.settle(message.holdId, message.preparation);
        else this.preparations.reject(message.holdId, new Error(message.error ?? 'the KV import could not be prepared'));
        return;
      case 'prefix-cache-reset':
        this.setStats(message.stats);
        this.deliverKvEvents(message.kvEvents);
        this.resets.settle(message.resetId, message.reset);
        return;
      case 'lora-done':
        if (message.stats) this.setStats(message.stats);
        this.loraReplies.settle(message.loraId, message);
        return;
      case 'rejected':
        this.streams.get(message.requestId)?.fail(InvalidRequestError.fromWorker(message.code, message.requestId, message.message));
        this.streams.delete(message.requestId);
        this.prefills.get(message.requestId)?.fail(InvalidRequestError.fromWorker(message.code, message.requestId, message.message));
        this.prefills.delete(message.requestId);
        return;
      case 'failed':
        this.onExit(new Error(message.message));
        return;
      case 'log':
        this.log(message.level, message.message);
        return;
      default:
        return;
    }
  }

  private onExit(error: Error): void {
    if (this.closed || this.exitError) return;
    this.exitError = error;
    for (const stream of this.streams.values()) stream.fail(error);
    this.streams.clear();
    for (const stream of this.prefills.values()) stream.fail(error);
    this.prefills.clear();
    this.syncs.rejectAll(error);
    this.holds.rejectAll(error);
    this.preparations.rejectAll(error);
    this.resets.rejectAll(error);
    this.loraReplies.rejectAll(error);
    for (const listener of this.lostListeners) listener(error);
  }
}

// ---------------------------------------------------------------------------------------------------------------

export interface LocalEngineBundle {
  engine: LocalEngine;
  tokenizer: Tokenizer;
  chatTemplate: ChatTemplate;
  model: ModelSummary;
}

/**
 * Loads what the gateway needs on its own thread (tokenizer, chat template) and starts the engine's worker thread.
 */
export async function createLocalEngine(options: LocalEngineOptions): Promise<LocalEngineBundle> {
  const loaded = await loadModel(options.modelPath);
  const tokenizer = createTokenizer(loaded.tokenizerSource);
  const chatTemplate = loaded.tokenizerSource.kind === 'gguf'
    ? chatTemplateFromGguf(loaded.tokenizerSource.file, tokenizer)
    : chatTemplateFromConfig(loaded.tokenizerSource.tokenizerConfig, tokenizer);
  const servedModelName = options.servedModelName ?? loaded.metadata.name;
  const engine = await LocalEngine.start({ ...options, servedModelName });
  return { engine, tokenizer, chatTemplate, model: loaded.metadata };
}

/** Requests the worker answers once, matched by id (sync, reset-prefix-cache). */
class PendingReplies<T> {
  private readonly waiting = new Map<number, { resolve(value: T): void; reject(error: Error): void }>();
  private nextId = 1;

  /** A new id to send, and the promise its reply settles. */
  open(): { id: number; reply: Promise<T> } {
    const id = this.nextId++;
    const reply = new Promise<T>((resolve, reject) => this.waiting.set(id, { resolve, reject }));
    return { id, reply };
  }

  settle(id: number, value: T): void {
    this.waiting.get(id)?.resolve(value);
    this.waiting.delete(id);
  }

  reject(id: number, error: Error): void {
    this.waiting.get(id)?.reject(error);
    this.waiting.delete(id);
  }

  rejectAll(error: Error): void {
    for (const { reject } of this.waiting.values()) reject(error);
    this.waiting.clear();
  }
}
