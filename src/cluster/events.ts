// The event plane over NATS: each worker publishes its KV events (with the event ids the KV cache gives them) on
// `<namespace>.kv.<worker id>` and a load snapshot (its stats) on `<namespace>.load.<worker id>` every second and
// with every batch of events; it answers `<namespace>.snapshot.<worker id>` requests with a dump of its cached
// block hashes and the id of its last event. Every frontend subscribes to all of it (core NATS fans a subject out to
// every subscriber), so two frontends build the same KV view.
//
// Nothing is persisted: a frontend that starts late, reconnects to NATS, or sees an event-id gap asks the worker
// for a snapshot and resyncs that worker's index (router.resyncWorker replays the events received since). A snapshot
// larger than the server's max_payload (1 MiB by default: some 55 000 cached blocks) is not sent over NATS: the
// worker replies with a small `tooLarge` marker and the frontend asks for it on the request plane at once. No
// message a worker sends exceeds max_payload (nats.js would refuse it, and inside a subscription callback the
// refusal would end the connection's reader).
//
// A worker id names a role, not a process: a worker restarted under its id while the old process still drains has
// two processes publishing on the same subjects. Every message therefore carries the publishing process's instance
// (workerInstance: its record's pid and start time), a frontend keeps only those of the process the worker's record
// names, and a snapshot request names the instance it wants (the others stay silent).

import { connect, type NatsConnection, type Subscription } from '@nats-io/transport-node';
import type { KvEvent } from '../protocols/kv-events.ts';
import type { EngineStats } from '../protocols/worker.ts';
import { parseHashes, parseKvEvents, parseSnapshotTiers, parseStats, type KvSnapshot } from './request-plane.ts';
import type { ClusterLog } from './worker-server.ts';

export interface NatsConnectOptions {
  servers: string[];
  token?: string;
  user?: string;
  password?: string;
  caFile?: string;
  certFile?: string;
  keyFile?: string;
  name?: string;
}

/** How natsConnect waits for a server that does not answer yet. */
export interface NatsWaitOptions {
  /** Told "waiting for NATS at ..." (with the last attempt's error) at the first failure and every logEveryMs after. */
  log?: ClusterLog;
  /** Ends the wait: natsConnect rejects with NatsWaitAbortedError (a connection made meanwhile is closed). */
  signal?: AbortSignal;
  /** Default 5000. */
  logEveryMs?: number;
  /** Between attempts (each tries every server once), default 500. */
  retryMs?: number;
}

/** The wait for a first NATS connection ended by its signal (the process is stopping). */
export class NatsWaitAbortedError extends Error {
  override name = 'NatsWaitAbortedError';
}

function connectOnce(options: NatsConnectOptions): Promise<NatsConnection> {
  // Each attempt tries every server once and fails with the last one's error (nats.js's own wait for a first
  // connection says nothing, not even an authorization error); the loop in natsConnect waits between attempts,
  // saying why. Once connected, the connection reconnects by itself for ever, to every server of the list (see
  // keepServerList) and those the cluster's INFO names.
  return connect({
    servers: options.servers, waitOnFirstConnect: false, reconnect: true, maxReconnectAttempts: -1, reconnectTimeWait: 250,
    reconnectJitter: 100, pingInterval: 2000, maxPingOut: 2, timeout: 3000,
    ...(options.name ? { name: options.name } : {}),
    ...(options.token ? { token: options.token } : {}),
    ...(options.user ? { user: options.user, pass: options.password ?? '' } : {}),
    ...(options.caFile || options.certFile ? {
      tls: {
        ...(options.caFile ? { caFile: options.caFile } : {}), ...(options.certFile ? { certFile: options.certFile } : {}),
        ...(options.keyFile ? { keyFile: options.keyFile } : {}),
      },
    } : {}),
  });
}

/** A server address as nats.js keys its pool (`host:port`, 4222 by default), to tell a listed server already there. */
function listenOf(server: string): string | undefined {
  try {
    const url = new URL(server.includes('://') ? server : `nats://${server}`);
    return `${url.hostname}:${url.port || '4222'}`;
  } catch {
    return undefined;
  }
}

/**
 * Puts back into the connection's pool the servers of the list its first connection dropped. nats.js removes from
 * its pool, for good, every server a first connection finds down (it tries them in random order): a server down or
 * restarting when this process started would never be tried again, and once the server connected to went away the
 * connection would wait for that one alone, though the other answered again. The servers the cluster's INFO named
 * stay in the pool (setServers keeps only the servers it is given, so they are given too, and are kept from then on
 * as if listed).
 */
function keepServerList(nc: NatsConnection, servers: readonly string[]): void {
  const pool = nc.getServers();
  const known = new Set(pool.flatMap((server) => [server.src, server.listen]));
  const dropped = servers.filter((server) => !known.has(server) && !known.has(listenOf(server) ?? server));
  if (dropped.length > 0) nc.setServers([...pool.map((server) => server.src), ...new Set(dropped)]);
}

/**
 * Connects, retrying the first connection until a server answers (saying so every few seconds, wait.log) or
 * wait.signal ends the wait, and reconnecting for ever after a loss.
 */
export async function natsConnect(options: NatsConnectOptions, wait: NatsWaitOptions = {}): Promise<NatsConnection> {
  const { signal } = wait;
  const logEveryMs = wait.logEveryMs ?? 5000;
  const retryMs = wait.retryMs ?? 500;
  const aborted = (): NatsWaitAbortedError => new NatsWaitAbortedError(`stopped while waiting for NATS at ${options.servers.join(',')}`);
  let lastLog = -Infinity;
  const started = Date.now();
  for (;;) {
    if (signal?.aborted) throw aborted();
    const attempt = connectOnce(options);
    let onAbort: (() => void) | undefined;
    const abortedWhile = new Promise<'aborted'>((resolve) => {
      onAbort = () => resolve('aborted');
      signal?.addEventListener('abort', onAbort, { once: true });
    });
    try {
      const result = await Promise.race([attempt, abortedWhile]);
      if (result === 'aborted') {
        // A connection this attempt still makes is nobody's.
        attempt.then((nc) => nc.close(), () => {});
        throw aborted();
      }
      keepServerList(result, options.servers);
      if (Number.isFinite(lastLog)) wait.log?.('info', `nats: connected to ${result.getServer()} after ${((Date.now() - started) / 1000).toFixed(1)} s`);
      return result;
    } catch (error) {
      if (error instanceof NatsWaitAbortedError) throw error;
      if (Date.now() - lastLog >= logEveryMs) {
        lastLog = Date.now();
        wait.log?.('warn', `waiting for NATS at ${options.servers.join(',')} (${(error as Error).message}); retrying`);
      }
    } finally {
      if (onAbort) signal?.removeEventListener('abort', onAbort);
    }
    await new Promise<void>((resolve) => {
      const done = (): void => {
        clearTimeout(timer);
        signal?.removeEventListener('abort', done);
        resolve();
      };
      const timer = setTimeout(done, retryMs);
      signal?.addEventListener('abort', done, { once: true });
    });
  }
}

/** Worker ids become NATS subject tokens: letters, digits, '-' and '_' only, 1 to 128 of them. */
export function isWorkerId(id: string): boolean {
  return /^[A-Za-z0-9_-]{1,128}$/.test(id);
}

export function checkWorkerId(id: string): string {
  if (!isWorkerId(id)) throw new Error(`worker id must be 1-128 letters, digits, "-" or "_", got "${id}"`);
  return id;
}

const subjects = (namespace: string) => ({
  kv: (id: string) => `${namespace}.kv.${id}`,
  load: (id: string) => `${namespace}.load.${id}`,
  snapshot: (id: string) => `${namespace}.snapshot.${id}`,
  allKv: `${namespace}.kv.*`,
  allLoad: `${namespace}.load.*`,
});

/** The process behind a worker record: a restarted worker has a new start time (and usually a new pid). */
export function workerInstance(record: { pid: number; startedAt: string }): string {
  return `${record.pid}@${record.startedAt}`;
}

export interface WorkerEventSource {
  stats(): EngineStats;
  snapshot(): KvSnapshot;
  onKvEvents(listener: (events: KvEvent[]) => void): () => void;
}

/** The blocks a snapshot lists, every tier's. */
export function snapshotBlocks(snapshot: KvSnapshot): number {
  let blocks = snapshot.hashes.length;
  for (const hashes of Object.values(snapshot.tiers ?? {})) blocks += hashes.length;
  return blocks;
}

/** NATS's default max_payload, bytes. */
const DEFAULT_MAX_PAYLOAD = 1024 * 1024;

/** A worker's snapshot was too large for NATS: the caller takes it from the request plane. */
export class SnapshotTooLargeError extends Error {
  override name = 'SnapshotTooLargeError';
}

/** A worker's side of the event plane. */
export class EventPublisher {
  private readonly timer: NodeJS.Timeout;
  private readonly off: () => void;
  private readonly snapshotSub: Subscription;
  /** Messages published (KV batches and load snapshots). */
  published = 0;
  /** Snapshot requests answered with the tooLarge marker (the snapshot exceeded the server's max_payload). */
  snapshotsTooLarge = 0;
  /** Messages not published because they exceeded the server's max_payload (a KV batch that large is a gap). */
  tooLarge = 0;

  constructor(
    private readonly nc: NatsConnection, namespace: string, workerId: string, instance: string, source: WorkerEventSource,
    private readonly log: ClusterLog,
  ) {
    const s = subjects(namespace);
    this.off = source.onKvEvents((events) => {
      this.publish(s.kv(workerId), { workerId, instance, events, stats: source.stats() });
    });
    this.timer = setInterval(() => this.publish(s.load(workerId), { workerId, instance, stats: source.stats() }), 1000);
    this.timer.unref();
    this.snapshotSub = nc.subscribe(s.snapshot(workerId), {
      callback: (error, msg) => {
        if (error) return log('warn', `nats: snapshot subscription: ${error.message}`);
        // Another process of this id is asked for: its reply is the one the requester waits for.
        if (msg.string() !== instance) return;
        // This runs inside nats.js's reader: nothing may throw out of it (a throw there ends the connection).
        try {
          const snapshot = source.snapshot();
          let reply = JSON.stringify({ workerId, instance, ...snapshot });
          const bytes = Buffer.byteLength(reply);
          if (bytes > this.maxPayload()) {
            // Too large for NATS: the requester takes it from the request plane instead.
            this.snapshotsTooLarge++;
            if (this.snapshotsTooLarge === 1) {
              log('info', `nats: KV snapshot of ${snapshotBlocks(snapshot)} blocks (${bytes} bytes) exceeds the server's max_payload `
                + `(${this.maxPayload()} bytes); frontends take snapshots over the request plane instead`);
            }
            reply = JSON.stringify({ workerId, instance, tooLarge: true, blocks: snapshotBlocks(snapshot), bytes });
          }
          msg.respond(reply);
        } catch (e) {
          log('warn', `nats: could not answer a snapshot request (${(e as Error).message}); the frontend falls back to the request plane`);
        }
      },
    });
    void (async () => {
      for await (const status of nc.status()) {
        if (status.type === 'disconnect') log('warn', `nats: disconnected from ${status.server}; reconnecting`);
        else if (status.type === 'reconnect') log('info', `nats: reconnected to ${status.server}`);
      }
    })().catch(() => {});
  }

  /** The largest message the server takes (its INFO; 1 MiB, NATS's default, before the first connection). */
  private maxPayload(): number {
    return this.nc.info?.max_payload ?? DEFAULT_MAX_PAYLOAD;
  }

  private publish(subject: string, message: object): void {
    if (this.nc.isClosed()) return;
    const data = JSON.stringify(message);
    if (Buffer.byteLength(data) > this.maxPayload()) {
      // Not sent: a KV batch that is missing is an event-id gap to the frontends, which then resync this worker.
      this.tooLarge++;
      if (this.tooLarge === 1) this.log('warn', `nats: a message on ${subject} exceeds the server's max_payload (${this.maxPayload()} bytes); not published`);
      return;
    }
    try {
      this.nc.publish(subject, data);
      this.published++;
    } catch {
      // Closed or draining: the frontends resync when the worker is back.
    }
  }

  async close(): Promise<void> {
    clearInterval(this.timer);
    this.off();
    this.snapshotSub.unsubscribe();
    await this.nc.drain().catch(() => {});
  }
}

export interface EventSubscriberHandlers {
  /** `instance`: the publishing process (workerInstance), to tell a worker from an older process of its id. */
  kv(workerId: string, instance: string, events: KvEvent[], stats: EngineStats | undefined): void;
  load(workerId: string, instance: string, stats: EngineStats): void;
  /** The subscription was re-established after a loss: every worker's view may have missed events. */
  reconnected(): void;
}

function parseInstance(value: unknown): string {
  if (typeof value !== 'string' || value.length === 0) throw new Error('message without the worker instance');
  return value;
}

/** A frontend's side of the event plane. */
export class EventSubscriber {
  private readonly subs: Subscription[] = [];
  private readonly s: ReturnType<typeof subjects>;
  /** Messages received and refused (bad JSON, bad events). */
  received = 0;
  refused = 0;

  constructor(private readonly nc: NatsConnection, namespace: string, handlers: EventSubscriberHandlers, log: ClusterLog) {
    this.s = subjects(namespace);
    const prefixLength = namespace.length + 1;
    const parse = (subject: string, data: Uint8Array): Record<string, unknown> | undefined => {
      this.received++;
      try {
        const value = JSON.parse(Buffer.from(data).toString('utf8')) as Record<string, unknown>;
        if (typeof value !== 'object' || value === null) throw new Error('not an object');
        return value;
      } catch (error) {
        this.refused++;
        log('warn', `nats: ignoring a message on ${subject}: ${(error as Error).message}`);
        return undefined;
      }
    };
    this.subs.push(nc.subscribe(this.s.allKv, {
      callback: (error, msg) => {
        if (error) return;
        const value = parse(msg.subject, msg.data);
        if (!value) return;
        const workerId = msg.subject.slice(prefixLength + 'kv.'.length);
        try {
          handlers.kv(workerId, parseInstance(value.instance), parseKvEvents(value.events),
            value.stats === undefined ? undefined : parseStats(value.stats));
        } catch (e) {
          this.refused++;
          log('warn', `nats: ignoring KV events of ${workerId}: ${(e as Error).message}`);
        }
      },
    }));
    this.subs.push(nc.subscribe(this.s.allLoad, {
      callback: (error, msg) => {
        if (error) return;
        const value = parse(msg.subject, msg.data);
        if (!value) return;
        try {
          handlers.load(msg.subject.slice(prefixLength + 'load.'.length), parseInstance(value.instance), parseStats(value.stats));
        } catch (e) {
          this.refused++;
          log('warn', `nats: ignoring a load snapshot: ${(e as Error).message}`);
        }
      },
    }));
    void (async () => {
      for await (const status of nc.status()) {
        if (status.type === 'disconnect') log('warn', `nats: disconnected from ${status.server}; reconnecting`);
        else if (status.type === 'reconnect') {
          log('info', `nats: reconnected to ${status.server}; resyncing every worker's KV view`);
          handlers.reconnected();
        }
      }
    })().catch(() => {});
  }

  /** The cached block hashes and last event id of one process of a worker (`instance`), asked over NATS. */
  async snapshot(workerId: string, instance: string): Promise<KvSnapshot> {
    const msg = await this.nc.request(this.s.snapshot(workerId), instance, { timeout: 3000 });
    const value = JSON.parse(msg.string()) as Record<string, unknown>;
    if (value.instance !== instance) throw new Error(`snapshot from another process of ${workerId}`);
    if (value.tooLarge === true) {
      throw new SnapshotTooLargeError(`the KV snapshot of ${workerId} (${Number(value.blocks)} blocks) exceeds the NATS server's max_payload`);
    }
    const lastEventId = value.lastEventId;
    if (!Number.isSafeInteger(lastEventId) || (lastEventId as number) < 0) throw new Error('snapshot without a valid lastEventId');
    const tiers = parseSnapshotTiers(value.tiers);
    return { lastEventId: lastEventId as number, hashes: parseHashes(value.hashes), ...(tiers ? { tiers } : {}) };
  }

  async close(): Promise<void> {
    for (const sub of this.subs) sub.unsubscribe();
    await this.nc.close().catch(() => {});
  }
}
