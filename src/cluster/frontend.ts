// A frontend's view of a cluster: the workers etcd lists under the namespace, each reached over the request plane,
// behind one routed engine (the router, admission, migration of the single-process server), fed KV events and
// load from NATS. The gateway holds the engine as it holds any other.
//
// A worker joins when its key appears (connect, authenticate, and for the first one read the model card: the
// frontend needs no model file) and its KV view is resynced from a snapshot. It leaves when its connection drops
// (at once: its requests fail as worker_lost and migrate when allowed), when it says it drains, or when its key
// goes (lease lapsed or revoked); a worker whose key is still there after its connection dropped is reconnected.
// A worker whose model card is over the frontend's --max-frame-bytes is not retried until it registers again: while
// no worker has joined, that is why the frontend serves nothing, and /health and refused requests say so
// (notServingReason), where they would otherwise only say it is loading; as they say that prefill workers joined
// before any decode worker wait for one.
// Prefill workers waiting for a decode worker that all leave decide nothing any more: nothing was built from their
// model card, and the next worker decides again (aggregated or prefill/decode, its model).
// A key that names no usable worker (an address without its port, say) is logged once and ignored by the watch
// (discovery.ts): it never stops the frontend.
// A worker has one connection at a time: a re-registration (a restart on a new port, or another process behind the
// same address, which also replaces a draining connection) and the planned retry after a loss lead to one connection
// and one join, whichever comes first (connect).
//
// LoRA: workers publish the adapters they hold in their records; the router (aggregated), or the prefill and the
// decode router (disaggregated), takes a request naming one only to workers holding it, and the gateway's
// load/unload API reaches the workers (cluster-lora.ts), a worker that joins later included.

import type { Etcd3 } from 'etcd3';
import { engineNow } from '../engine/clock.ts';
import { EngineUnavailableError } from '../engine/errors.ts';
import type { EngineInfo } from '../engine/types.ts';
import { ChatTemplate } from '../model/chat-template.ts';
import { tokenizerFromWorkerSource } from '../model/tokenizer/worker-source.ts';
import type { Tokenizer, TokenizerWorkerSource } from '../model/tokenizer/types.ts';
import type { PolicyName } from '../router/protocols.ts';
import type { Router } from '../router/router.ts';
import { RoutedEngine } from '../runtime/routed-engine.ts';
import type { EngineReadiness, NotRestarted } from '../runtime/worker-group.ts';
import { makeRouter } from '../runtime/worker-pool.ts';
import { WorkerWatch, type WorkerRecord } from './discovery.ts';
import type { DisaggregatedEngine } from '../runtime/disaggregated.ts';
import type { DisaggregationPolicy } from '../runtime/disaggregation-policy.ts';
import { remoteDisaggregatedEngine } from './remote-disagg.ts';
import { ModelCardTooLargeError, splitAddress } from './remote-engine.ts';
import { EventSubscriber, workerInstance } from './events.ts';
import { ClusterAdapters, type AdapterWorker } from './cluster-lora.ts';
import { RemoteEngine } from './remote-engine.ts';
import type { ModelCard } from './request-plane.ts';
import type { ClusterLog } from './worker-server.ts';

export interface ClusterFrontendOptions {
  namespace: string;
  clusterToken: string;
  etcd: Etcd3;
  /** The event plane; without it KV events come on the request plane connections (events: true). */
  events?: (handlers: ConstructorParameters<typeof EventSubscriber>[2]) => EventSubscriber;
  routingPolicy?: PolicyName;
  migrationLimit?: number;
  maxQueued?: number;
  maxFrameBytes?: number;
  /** Prefill and decode workers: the conditional-disaggregation thresholds (as `conduit serve` takes them). */
  disaggregationPolicy?: Partial<DisaggregationPolicy>;
  log: ClusterLog;
}

/**
 * Whether two records of a worker id are from one process (a record put again, the adapters it holds changed) rather
 * than from a process that replaced it: a new process starts with a new start time (and usually pid).
 */
function sameProcess(a: WorkerRecord, b: WorkerRecord): boolean {
  return workerInstance(a) === workerInstance(b);
}

/** What a frontend serves: the routed engine over aggregated workers, or the disaggregated one over prefill + decode. */
export type FrontendEngine = ClusterEngine | DisaggregatedEngine;

/** What /health lists per worker. */
export interface ClusterWorkerView {
  id: string;
  role: string;
  model: string;
  address: string;
  block_size: number;
  capacity_tokens: number;
  engine: string;
  /** unusable: it cannot be joined as it is registered (error says why), and no attempt is made until it registers again. */
  state: 'connecting' | 'ready' | 'draining' | 'lost' | 'unusable';
  error?: string;
  running?: number;
  waiting?: number;
}

/**
 * A frontend starts no worker, so it restarts none: a worker process that starts again registers by itself. Said
 * only at debug level, after the warning that the worker was lost: nothing is wrong with the frontend.
 */
const WORKERS_REGISTER_THEMSELVES: NotRestarted = { reason: 'a worker process that starts again registers by itself', level: 'debug', rejoins: true };

/** The routed engine of a frontend: workers join and leave as discovery says; /health lists them. */
export class ClusterEngine extends RoutedEngine {
  constructor(first: RemoteEngine, router: Router, tokenizer: Tokenizer | undefined, migrationLimit: number,
    private readonly view: () => ClusterWorkerView[], private readonly where: string, log: ClusterLog) {
    super([{ id: first.workerId, engine: first }], router, engineNow, {
      migration: { limit: migrationLimit, ...(tokenizer ? { tokenizer } : {}) },
      log, notRestarted: WORKERS_REGISTER_THEMSELVES,
    });
  }

  workerList(): ClusterWorkerView[] {
    return this.view();
  }

  override readiness(): EngineReadiness {
    const readiness = super.readiness();
    if (readiness.ready) return readiness;
    return { ...readiness, reason: `no worker can serve: none is registered and reachable under ${this.where}` };
  }

  /** Not final: a worker that starts (again) registers, and is routed to once it joins. */
  protected override noWorkerError(): EngineUnavailableError {
    return new EngineUnavailableError(`no worker is available (none is registered and reachable under ${this.where})`, undefined, false);
  }
}

interface Member {
  record: WorkerRecord;
  /** The connection that joined (kept while the worker drains); one at a time. */
  remote?: RemoteEngine;
  /** A connection is being opened, or the worker it reached is joining: no other attempt starts meanwhile. */
  connecting: boolean;
  /** connect() was called during that attempt: it runs again when the attempt ends without a live connection. */
  askedAgain?: boolean;
  /** The reconnection planned after a loss or a failed attempt (cleared when it fires or another attempt starts). */
  retry?: NodeJS.Timeout;
  retired: boolean;
  /** The model card this registration's worker sent was over the frontend's limit (cleared by the next attempt). */
  unreadableCard?: ModelCardTooLargeError;
}

export class ClusterFrontend {
  engine: ClusterEngine | undefined;
  /** Prefill and decode workers, once a decode worker has joined. */
  disaggregated: DisaggregatedEngine | undefined;
  /** Prefill workers that joined before any decode worker. */
  private readonly waitingPrefill: RemoteEngine[] = [];
  tokenizer: Tokenizer | undefined;
  chatTemplate: ChatTemplate | undefined;
  router: Router | undefined;
  /** The LoRA adapters the workers hold (cluster-lora.ts), once the engine (aggregated or disaggregated) is built. */
  adapters: ClusterAdapters | undefined;
  private readonly members = new Map<string, Member>();
  /**
   * Workers whose key is gone while their connection stays (a drain): a prefill worker among them still serves the
   * blocks it handed off, until the decode workers have them.
   */
  private readonly leaving = new Map<string, RemoteEngine>();
  private readonly watch: WorkerWatch;
  private events: EventSubscriber | undefined;
  private readonly resyncing = new Set<string>();
  private readonly readyWaiters: ((engine: FrontendEngine) => void)[] = [];
  private closed = false;
  /** Resyncs done (a worker joined, an event gap, a NATS reconnect). */
  resyncs = 0;

  constructor(private readonly options: ClusterFrontendOptions) {
    this.watch = new WorkerWatch(options.etcd, options.namespace, {
      put: (record) => this.onPut(record),
      delete: (id) => this.onDelete(id),
    }, options.log);
  }

  async start(): Promise<void> {
    if (this.options.events) {
      this.events = this.options.events({
        kv: (workerId, instance, events, stats) => {
          const remote = this.publisher(workerId, instance);
          if (!remote) return;
          if (stats) remote.deliverStats(stats);
          remote.deliverKvEvents(events);
          const gaps = this.engine ? this.router?.workersNeedingResync() : this.disaggregated?.workersNeedingResync();
          if (gaps?.includes(workerId)) void this.resync(workerId, 'event-id gap');
        },
        load: (workerId, instance, stats) => {
          this.publisher(workerId, instance)?.deliverStats(stats);
        },
        reconnected: () => {
          for (const [id, member] of this.members) if (member.remote && !member.remote.lost) void this.resync(id, 'event plane reconnected');
        },
      });
    }
    await this.watch.start();
  }

  /**
   * The connection an event-plane message of `workerId` is for: none when the message comes from another process of
   * that id than the one its record names (an older one still draining after a restart), or the worker is lost.
   */
  private publisher(workerId: string, instance: string): RemoteEngine | undefined {
    const member = this.members.get(workerId);
    if (!member?.remote || member.remote.lost || workerInstance(member.record) !== instance) return undefined;
    return member.remote;
  }

  /**
   * The prefill workers that joined before any decode worker and are still there: one that left (its connection
   * lost, or closed when its key went) is dropped from the list, and decides nothing any more.
   */
  private prefillStillWaiting(): RemoteEngine[] {
    for (let i = this.waitingPrefill.length - 1; i >= 0; i--) if (this.waitingPrefill[i]!.gone) this.waitingPrefill.splice(i, 1);
    return this.waitingPrefill;
  }

  /** Resolves with the engine once the first worker has joined. */
  ready(): Promise<FrontendEngine> {
    const engine = this.engine ?? this.disaggregated;
    if (engine) return Promise.resolve(engine);
    return new Promise((resolve) => this.readyWaiters.push(resolve));
  }

  workerViews(): ClusterWorkerView[] {
    return [...this.members.values()].map(({ record, remote, connecting, unreadableCard }) => ({
      id: record.id, role: record.role, model: record.model, address: record.address, block_size: record.blockSize,
      capacity_tokens: record.capacityTokens, engine: record.engine,
      state: unreadableCard ? 'unusable' : !remote ? (connecting ? 'connecting' : 'lost')
        : remote.lost ? 'lost' : remote.draining ? 'draining' : 'ready',
      ...(unreadableCard ? { error: unreadableCard.message } : {}),
      ...(remote && !remote.lost ? { running: remote.stats().numRunning, waiting: remote.stats().numWaiting } : {}),
    }));
  }

  /**
   * Why this frontend serves nothing yet when waiting alone will not change it: the workers found so far whose model
   * card is over its --max-frame-bytes (none is tried again before it registers again, and a worker of the same model
   * sends a card as large). Undefined once an engine is built, or while no such worker is registered: the frontend
   * is then only waiting for a worker to join.
   */
  notServingReason(): string | undefined {
    if (this.engine || this.disaggregated) return undefined;
    const unreadable = [...this.members.values()].flatMap(({ unreadableCard }) => unreadableCard ?? []);
    if (unreadable.length === 0) {
      // Prefill workers joined before any decode worker: the model is known, but nothing serves until a decode worker
      // joins (joinDisaggregated), which waiting alone does not bring.
      const prefill = this.prefillStillWaiting().length;
      if (prefill === 0) return undefined;
      return `${prefill} prefill worker${prefill > 1 ? 's have' : ' has'} joined, but no decode worker: prefill and decode `
        + 'workers are served from when the first decode worker (conduit worker --role decode) joins';
    }
    // The largest card decides the limit that reads them all.
    const largest = unreadable.reduce((a, b) => (b.cardBytes > a.cardBytes ? b : a));
    const others = unreadable.length - 1;
    return `the model card of worker ${largest.workerId}${others > 0 ? ` (and of ${others} other worker${others > 1 ? 's' : ''})` : ''} `
      + `is a frame of ${largest.cardBytes} bytes, ${largest.cardBytes - largest.limitBytes} over this frontend's `
      + `--max-frame-bytes of ${largest.limitBytes} bytes: no model is served until the frontend runs with --max-frame-bytes `
      + `(or CONDUIT_MAX_FRAME_BYTES) of at least ${largest.cardBytes} bytes`;
  }

  async close(): Promise<void> {
    this.closed = true;
    await this.watch.stop();
    for (const member of this.members.values()) clearTimeout(member.retry);
    await this.events?.close();
    if (this.engine) await this.engine.close();
    else if (this.disaggregated) await this.disaggregated.close();
    // Connections the engine no longer holds are closed too: a draining member's (the engine dropped it when the
    // worker said it drains) and those of workers whose key went while their streams finished (leaving). A closed
    // frontend keeps no socket open.
    for (const member of this.members.values()) await member.remote?.close();
    for (const remote of this.leaving.values()) await remote.close();
    this.leaving.clear();
    for (const remote of this.waitingPrefill.splice(0)) await remote.close();
  }

  // -------------------------------------------------------------------------------------------------------------

  private onPut(record: WorkerRecord): void {
    const existing = this.members.get(record.id);
    if (existing) {
      const before = existing.record;
      existing.record = record;
      existing.retired = false;
      const remote = existing.remote;
      if (remote && !remote.lost && remote.address === record.address && sameProcess(before, record)) {
        // The same worker with a changed record: the adapters it holds.
        this.routeAdapters(record.id);
        return;
      }
      // Another address, or another process at the same one (a restart behind a fixed address: a proxy, a service).
      // The old connection must not count as the worker's: a draining one in particular would never be replaced, as
      // a drain plans no reconnection. A draining process keeps its connection until its streams end (retire); any
      // other old connection is dropped (its streams fail over as on a loss).
      existing.remote = undefined;
      if (remote && !remote.lost && !remote.draining && !sameProcess(before, record)) {
        // A restart is seen as the old connection closing (or its drain notice) before the new record: a live old
        // process means two processes hold this id (workers refuse one another's key, but an older release does not).
        this.options.log('warn', `worker ${record.id} was registered again by another process (pid ${record.pid} at ${record.address}, `
          + `started ${record.startedAt}) while the connection to the previous one (pid ${before.pid} at ${before.address}, `
          + `started ${before.startedAt}) is live and not draining: two processes may run with this worker id; `
          + 'dropping the previous one\'s connection');
      }
      if (remote?.draining) remote.retire(`worker ${record.id} re-registered (another process at ${record.address})`);
      else remote?.drop(`worker ${record.id} re-registered at ${record.address}`);
      this.connect(existing);
      return;
    }
    const member: Member = { record, connecting: false, retired: false };
    this.members.set(record.id, member);
    this.options.log('info', `discovery: worker ${record.id} (${record.role}, ${record.model}) at ${record.address}`);
    this.connect(member);
  }

  private onDelete(id: string): void {
    const member = this.members.get(id);
    if (!member) return;
    this.options.log('info', `discovery: worker ${id} left (its key is gone)`);
    member.retired = true;
    clearTimeout(member.retry);
    this.members.delete(id);
    const remote = member.remote;
    // No new requests; the streams it runs (a draining worker) finish before the connection is closed.
    if (remote && !remote.lost) {
      remote.retire(`worker ${id} deregistered`);
      for (const [leavingId, old] of this.leaving) if (old.gone) this.leaving.delete(leavingId);
      if (!remote.gone) this.leaving.set(id, remote);
    }
    // It left for good: the engine no longer counts it (one that registers again under this id later is new).
    this.engine?.removeWorker(id);
    this.disaggregated?.removeWorker(id);
  }

  /**
   * Opens a connection to the worker and joins it, unless it has one (joined, or being opened or joined): a worker
   * has one connection and joins once, whichever of a re-registration and a planned retry comes first. An attempt
   * that starts cancels the planned retry; one asked for while another is under way is made when that one ends
   * without a live connection (it failed, or reached an address the worker no longer has).
   */
  private connect(member: Member): void {
    if (this.closed || member.retired) return;
    if (member.remote && !member.remote.lost) {
      clearTimeout(member.retry);
      member.retry = undefined;
      return;
    }
    if (member.connecting) {
      member.askedAgain = true;
      return;
    }
    clearTimeout(member.retry);
    member.retry = undefined;
    member.connecting = true;
    member.askedAgain = false;
    // A new registration may be a worker whose card fits (another model, a smaller tokenizer): it is read again.
    member.unreadableCard = undefined;
    const { record } = member;
    let connected: RemoteEngine | undefined;
    void RemoteEngine.connect(record.address, {
      clusterToken: this.options.clusterToken, events: !this.options.events, log: this.options.log,
      ...(this.options.maxFrameBytes !== undefined ? { maxFrameBytes: this.options.maxFrameBytes } : {}),
    }).then(async (remote) => {
      connected = remote;
      if (this.abandoned(member, remote)) {
        await remote.close();
        return;
      }
      if (remote.workerId !== record.id) {
        throw new Error(`the worker at ${record.address} says it is ${remote.workerId}, not ${record.id}`);
      }
      await this.join(member, remote);
    }).catch((error: Error) => {
      // A connection no engine took (refused, or its join failed before handing it over) is closed here.
      if (connected && member.remote !== connected) void connected.close();
      if (this.stale(member)) return;
      if (error instanceof ModelCardTooLargeError) {
        // Every attempt would read the same card: none is planned. A new registration of the worker (another
        // process, another address) tries again. Meanwhile /health names it (workerViews, notServingReason).
        member.unreadableCard = error;
        this.options.log('error', `request plane: ${error.message}; not retried while worker ${member.record.id} stays registered as it is`);
        return;
      }
      this.options.log('warn', `request plane: ${error.message}; retrying in 1 s while ${member.record.id} is registered`);
      this.retryLater(member, 1000);
    }).finally(() => {
      member.connecting = false;
      const again = member.askedAgain || member.record.address !== record.address;
      member.askedAgain = false;
      if (again) this.connect(member);
    });
  }

  /** Plans a reconnection in `ms` (replacing one already planned). */
  private retryLater(member: Member, ms: number): void {
    clearTimeout(member.retry);
    member.retry = setTimeout(() => {
      member.retry = undefined;
      this.connect(member);
    }, ms);
  }

  /** The frontend closed, or the worker left (its key went, or a new member holds its id). */
  private stale(member: Member): boolean {
    return this.closed || member.retired || this.members.get(member.record.id) !== member;
  }

  /** A connection opened for a member that went stale, or re-registered at another address, since it was asked for. */
  private abandoned(member: Member, remote: RemoteEngine): boolean {
    return this.stale(member) || member.record.address !== remote.address;
  }

  private async join(member: Member, remote: RemoteEngine): Promise<void> {
    const id = remote.workerId;
    if (remote.draining) {
      await remote.close();
      return;
    }
    // The first worker's model card gives the frontend its tokenizer and chat template. It is read before anything
    // below looks at what the frontend serves: another worker can join while it is read, and from here to the engine
    // being built nothing waits, so two workers joining at once end as they would one after the other (the first
    // whose card came decides aggregated or disaggregated). A tokenizer is set exactly when that was decided.
    if (this.tokenizer && !this.engine && !this.disaggregated && this.prefillStillWaiting().length === 0) {
      // The prefill workers whose card decided what this frontend serves have all left before any decode worker
      // came: nothing serves their model, so the next worker decides again, with its own model card.
      this.tokenizer = undefined;
      this.chatTemplate = undefined;
    }
    if (!this.tokenizer) {
      const card = await remote.modelCard();
      if (this.abandoned(member, remote)) {
        await remote.close();
        return;
      }
      if (!this.tokenizer) this.adoptModel(card, remote.info);
    }
    if (remote.role !== 'both' || this.disaggregated || this.prefillStillWaiting().length > 0) {
      if (!(await this.joinDisaggregated(member, remote))) return;
    } else if (!this.engine) {
      this.router = makeRouter({
        routingPolicy: this.options.routingPolicy ?? 'kv',
        ...(this.options.maxQueued !== undefined ? { maxQueued: this.options.maxQueued } : {}),
      }, remote.info.blockSize, 0);
      member.remote = remote;
      this.engine = new ClusterEngine(remote, this.router, member.record.engine === 'cpu' ? this.tokenizer : undefined,
        this.options.migrationLimit ?? 0, () => this.workerViews(), `/${this.options.namespace}/workers/`, this.options.log);
      this.adapters = this.clusterAdapters();
      this.routeAdapters(id);
      for (const resolve of this.readyWaiters.splice(0)) resolve(this.engine);
    } else {
      const info = this.engine.info;
      if (remote.info.modelName !== info.modelName || remote.info.blockSize !== info.blockSize) {
        this.options.log('warn', `worker ${id} serves ${remote.info.modelName} with blocks of ${remote.info.blockSize} tokens; `
          + `this frontend serves ${info.modelName} with blocks of ${info.blockSize}: not routed to`);
        member.remote = undefined;
        await remote.close();
        return;
      }
      member.remote = remote;
      this.engine.addWorker(id, remote);
      // Workers may differ in context length and KV capacity: the engine's info follows the workers it has (the
      // smallest context, the summed capacity), and the router sends a worker only requests its context holds.
      if (this.engine.info.maxModelLen < info.maxModelLen) {
        this.options.log('warn', `worker ${id} takes at most ${remote.info.maxModelLen} tokens: this frontend's max_model_len is `
          + `${this.engine.info.maxModelLen} while it is routed to (was ${info.maxModelLen}); longer requests already accepted go to the other workers`);
      }
      this.routeAdapters(id);
      // The adapters loaded (or unloaded) through this frontend before it joined.
      void this.adapters?.syncWorker(id);
    }
    remote.onLost((error) => {
      this.options.log('warn', `worker ${id}: ${error.message}`);
      // Still registered and not draining: the connection broke, not necessarily the worker. Try again (once: a
      // re-registration that connects first makes the retry a no-op, see connect).
      if (!this.stale(member) && !remote.draining && member.remote === remote) {
        member.remote = undefined;
        this.retryLater(member, 500);
      }
    });
    this.options.log('info', `worker ${id} joined (${remote.info.modelName}, blocks of ${remote.info.blockSize}, ${remote.info.kvCapacityTokens} KV tokens${remote.info.kvDtype !== undefined ? ` as ${remote.info.kvDtype}` : ''})`);
    // The worker may hold cached blocks whose events this frontend never saw (it started later, or reconnected).
    await this.resync(id, 'joined');
  }

  /**
   * A prefill or decode worker: the frontend serves disaggregated (an aggregated worker then is not routed to, nor
   * are prefill and decode workers once the frontend serves aggregated ones). The engine is built when the first
   * decode worker joins; prefill workers found before wait for it. False when the worker is not taken.
   */
  private async joinDisaggregated(member: Member, remote: RemoteEngine): Promise<boolean> {
    const id = remote.workerId;
    const refuse = async (why: string) => {
      this.options.log('warn', `worker ${id}: ${why}: not routed to`);
      member.remote = undefined;
      await remote.close();
      return false;
    };
    if (this.engine || remote.role === 'both') return refuse(`role ${remote.role}, but this frontend serves ${this.engine ? 'aggregated (both)' : 'prefill and decode'} workers`);
    const first = this.disaggregated?.info ?? this.prefillStillWaiting()[0]?.info;
    if (first && (remote.info.modelName !== first.modelName || remote.info.blockSize !== first.blockSize)) {
      return refuse(`serves ${remote.info.modelName} with blocks of ${remote.info.blockSize} tokens; this frontend serves ${first.modelName} with blocks of ${first.blockSize}`);
    }
    member.remote = remote;
    // A decode worker finds a prefill worker's KV port through the frontend's view of the cluster.
    remote.kvSourceAddress = (prefillId) => {
      const member = this.members.get(prefillId)?.remote;
      const prefill = member && !member.gone ? member : this.leaving.get(prefillId);
      if (!prefill || prefill.gone || prefill.kvPort === undefined) return undefined;
      return { host: splitAddress(prefill.address).host, port: prefill.kvPort };
    };
    if (this.disaggregated) {
      const before = this.disaggregated.info.maxModelLen;
      if (remote.role === 'prefill') this.disaggregated.addPrefillWorker(id, remote);
      else this.disaggregated.addDecodeWorker(id, remote);
      // Decode workers may differ in context length: the engine's info follows those there (the smallest context),
      // and the decode router sends a worker only requests its context holds.
      if (this.disaggregated.info.maxModelLen < before) {
        this.options.log('warn', `decode worker ${id} takes at most ${remote.info.maxModelLen} tokens: this frontend's max_model_len is `
          + `${this.disaggregated.info.maxModelLen} while it is routed to (was ${before}); longer requests already accepted go to the other decode workers`);
      }
      this.routeAdapters(id);
      void this.adapters?.syncWorker(id);
      return true;
    }
    if (remote.role === 'prefill') {
      this.waitingPrefill.push(remote);
      this.options.log('info', `prefill worker ${id} waits for a decode worker`);
      return true;
    }
    const prefill = this.prefillStillWaiting().splice(0);
    // The policy's starting estimates: those the decode worker's record gives (simulated workers' link and
    // performance model), else the engine's CPU defaults; measured transfers and prefills refine them.
    const estimates = member.record.disaggregationEstimates;
    if (estimates) {
      this.options.log('info', `disaggregation: estimates start from decode worker ${id}'s: KV transfer `
        + `${(estimates.transferBytesPerSec / 1e9).toFixed(2)} GB/s, prefill ${Math.round(estimates.prefillTokensPerSec)} tokens/s`);
    }
    this.disaggregated = remoteDisaggregatedEngine({
      prefill, decode: [remote], routingPolicy: this.options.routingPolicy ?? 'kv',
      ...(estimates ? { estimates: { transferBytesPerSec: estimates.transferBytesPerSec, prefillTokensPerSec: estimates.prefillTokensPerSec } } : {}),
      ...(this.options.maxQueued !== undefined ? { maxQueued: this.options.maxQueued } : {}),
      ...(this.options.disaggregationPolicy ? { policy: this.options.disaggregationPolicy } : {}),
      migration: { limit: this.options.migrationLimit ?? 0, ...(this.tokenizer ? { tokenizer: this.tokenizer } : {}) },
      log: this.options.log, notRestarted: WORKERS_REGISTER_THEMSELVES,
      workerList: () => this.workerViews(),
    });
    this.adapters = this.clusterAdapters();
    for (const worker of [remote, ...prefill]) this.routeAdapters(worker.workerId);
    for (const resolve of this.readyWaiters.splice(0)) resolve(this.disaggregated);
    // The prefill workers that waited for this one joined no router then: their views start from a snapshot now.
    for (const p of prefill) void this.resync(p.workerId, 'joined');
    return true;
  }

  /** The adapter host over this frontend's workers; a load or unload reply updates the worker's record here. */
  private clusterAdapters(): ClusterAdapters {
    return new ClusterAdapters(() => this.adapterWorkers(), (workerId, loras) => {
      const held = this.members.get(workerId);
      if (!held) return;
      held.record = { ...held.record, loras };
      this.routeAdapters(workerId);
    }, (level, message) => this.options.log(level, message));
  }

  /**
   * The workers routed to now (aggregated; or prefill and decode), with the adapters their records (or load replies)
   * say they hold.
   */
  private adapterWorkers(): AdapterWorker[] {
    const routed = new Set(this.engine?.workerIds
      ?? [...this.disaggregated?.prefillWorkerIds ?? [], ...this.disaggregated?.decodeWorkerIds ?? []]);
    const workers: AdapterWorker[] = [];
    for (const [id, { record, remote }] of this.members) {
      if (remote && !remote.lost && !remote.draining && routed.has(id)) workers.push({ id, loras: record.loras ?? [], remote });
    }
    return workers;
  }

  /**
   * Tells the router(s) which adapters a worker holds (their keys): a request naming one goes only to those workers
   * (disaggregated: to prefill and decode workers holding it). Requests for the base model go to any.
   */
  private routeAdapters(workerId: string): void {
    const member = this.members.get(workerId);
    if (!member) return;
    const keys = (member.record.loras ?? []).map((l) => l.key);
    if (this.engine && this.router) this.router.setWorkerModels(workerId, keys);
    else this.disaggregated?.setWorkerModels(workerId, keys);
  }

  private adoptModel(card: ModelCard | null, info: EngineInfo): void {
    if (!card) throw new Error(`the first worker (${info.modelName}) sent no model card: cannot tokenize for it`);
    this.tokenizer = tokenizerFromWorkerSource(card.tokenizer as TokenizerWorkerSource);
    const { templates, bosToken, eosToken, isFallback } = card.chatTemplate;
    this.chatTemplate = new ChatTemplate({ templates: new Map(templates), bosToken, eosToken }, isFallback);
  }

  /** Replaces the router's view of a worker's KV cache with its snapshot (NATS request, else the request plane). */
  private async resync(workerId: string, why: string): Promise<void> {
    if (this.resyncing.has(workerId)) return;
    const member = this.members.get(workerId);
    const remote = member?.remote;
    if (!member || !remote || (!this.router && !this.disaggregated)) return;
    this.resyncing.add(workerId);
    // Events from now on are kept until the snapshot is applied: those it does not reflect are replayed on it.
    const index = this.engine && this.router ? this.router : this.disaggregated;
    index?.beginResync(workerId);
    let applied = false;
    try {
      let snapshot;
      try {
        snapshot = this.events ? await this.events.snapshot(workerId, workerInstance(member.record)) : await remote.snapshot();
      } catch {
        snapshot = await remote.snapshot();
      }
      if (remote.lost) return;
      if (this.engine && this.router) {
        if (!this.engine.workerIds.includes(workerId)) return;
        this.router.resyncWorker(workerId, snapshot.hashes, snapshot.lastEventId, snapshot.tiers);
      } else if (!this.disaggregated?.resyncWorker(workerId, snapshot.hashes, snapshot.lastEventId, snapshot.tiers)) {
        return;
      }
      applied = true;
      this.resyncs++;
      const below = Object.entries(snapshot.tiers ?? {}).map(([tier, hashes]) => `, ${hashes.length} in its ${tier} tier`).join('');
      this.options.log('debug', `KV view of ${workerId} resynced (${why}): ${snapshot.hashes.length} blocks${below}, event ${snapshot.lastEventId}`);
    } catch (error) {
      this.options.log('warn', `KV view of ${workerId}: resync failed (${(error as Error).message})`);
    } finally {
      if (!applied) index?.endResync(workerId);
      this.resyncing.delete(workerId);
    }
  }
}

