// Discovery through etcd. A worker registers one key, `/<namespace>/workers/<id>`, bound to a lease of a few seconds
// that the client keeps alive: the key lives while the worker does, and a worker that stops renewing (killed, cut
// off) disappears when its lease lapses. The key is created in an etcd transaction, only when it is absent (or held
// by an earlier lease of this same worker): a second live process given the same id does not take it over. A key
// held by another process's lease is waited for until that lease would have lapsed (a killed worker's restart);
// when it is still held then, its holder is alive and the new process refuses to start (WorkerIdInUseError). A lost
// lease (etcd restarted without its data, or unreachable past the TTL) is granted again and the key put again, so a
// worker outlives an etcd outage without restarting. Deregistering revokes the lease (the key goes at once): a
// draining worker does that first.
//
// A frontend lists the prefix and watches it from the listed revision: workers appear and disappear live. When the
// watch reconnects (etcd restarted), the prefix is listed again and the view reconciled (workers gone meanwhile are
// removed, new ones added). A key whose value is not a usable worker record (not JSON, a field missing, an address
// that is not host:port) is logged once per value and otherwise treated as absent; nothing a key holds, nor anything
// the frontend's handlers throw on it, stops the watch or the process.

import tls from 'node:tls';
import { Etcd3, type IOptions, type Lease } from 'etcd3';
import { EngineStartError } from '../engine/errors.ts';
import type { WorkerRole } from '../engine/types.ts';
import { splitAddress } from './remote-engine.ts';
import type { ClusterLog } from './worker-server.ts';

/** What a worker's key holds: what the frontend needs to reach it and route to it. */
export interface WorkerRecord {
  id: string;
  role: WorkerRole;
  /** The served model name. */
  model: string;
  /** host:port of the worker's request endpoint. */
  address: string;
  blockSize: number;
  /** KV capacity, tokens. */
  capacityTokens: number;
  maxModelLen: number;
  /** Engine kind: cpu or sim. */
  engine: string;
  pid: number;
  startedAt: string;
  /**
   * The LoRA adapters the worker holds (registered; resident or loaded again on demand), of `model`: its
   * --lora-modules and those loaded at run time. A frontend lists them and routes a request naming one only to
   * workers that hold it, under `key` (the name and a digest of its bytes: the same on every worker holding them).
   */
  loras?: WorkerLora[];
  /**
   * A prefill or decode worker's starting estimates for a frontend's disaggregation policy, when its engine has a
   * model of them (simulated workers: their link and performance model, simDisaggregationEstimates); a frontend
   * over cpu workers starts from the CPU defaults. Measured transfers and prefills refine them from there.
   */
  disaggregationEstimates?: { transferBytesPerSec: number; prefillTokensPerSec: number };
}

export interface WorkerLora {
  name: string;
  key: string;
  /** The file or folder, as the worker was given it (/v1/models shows it as the adapter's root). */
  path: string;
  rank?: number;
}

export const DEFAULT_NAMESPACE = 'conduit';
export const DEFAULT_LEASE_TTL_SECONDS = 5;

export interface EtcdConnectOptions {
  endpoints: string[];
  username?: string;
  password?: string;
  /** PEM CA, client certificate and key (TLS to etcd). */
  caFile?: Buffer;
  certFile?: Buffer;
  keyFile?: Buffer;
}

export function etcdClient(options: EtcdConnectOptions): Etcd3 {
  const config: IOptions = {
    hosts: options.endpoints,
    dialTimeout: 3000,
    // The watch stream comes back quickly after an etcd restart (the default backs off up to 30 s).
    faultHandling: { watchBackoff: constantBackoff(500) },
  };
  if (options.username !== undefined) config.auth = { username: options.username, password: options.password ?? '' };
  if (options.caFile || options.certFile) {
    config.credentials = {
      // A client certificate for an etcd whose own certificate a public CA signed: the system's roots.
      rootCertificate: options.caFile ?? Buffer.from(tls.rootCertificates.join('\n')),
      ...(options.keyFile ? { privateKey: options.keyFile } : {}),
      ...(options.certFile ? { certChain: options.certFile } : {}),
    };
  }
  return new Etcd3(config);
}

function constantBackoff(ms: number): NonNullable<NonNullable<IOptions['faultHandling']>['watchBackoff']> {
  const backoff = { duration: ms, next: () => backoff };
  return backoff;
}

export function workersPrefix(namespace: string): string {
  return `/${namespace}/workers/`;
}

/** Parses a key's value; undefined (and the caller logs) when it is not a worker record. */
export function parseWorkerRecord(text: string): WorkerRecord | undefined {
  const record = checkWorkerRecord(text);
  return typeof record === 'string' ? undefined : record;
}

/** A key's value as a worker record, or why it is not a usable one. */
export function checkWorkerRecord(text: string): WorkerRecord | string {
  let value: Partial<WorkerRecord>;
  try {
    value = JSON.parse(text) as Partial<WorkerRecord>;
  } catch {
    return 'not a worker record (not JSON)';
  }
  if (typeof value !== 'object' || value === null || typeof value.id !== 'string' || typeof value.address !== 'string'
    || typeof value.model !== 'string' || !Number.isInteger(value.blockSize)) {
    return 'not a worker record (id, address, model or blockSize missing)';
  }
  if (value.role !== 'both' && value.role !== 'prefill' && value.role !== 'decode') return `not a worker record (role ${JSON.stringify(value.role)})`;
  if (value.loras !== undefined && !(Array.isArray(value.loras) && value.loras.every((l: Partial<WorkerLora>) =>
    typeof l === 'object' && l !== null && typeof l.name === 'string' && typeof l.key === 'string' && typeof l.path === 'string'
    && (l.rank === undefined || Number.isInteger(l.rank))))) return 'not a worker record (malformed loras)';
  const estimates = value.disaggregationEstimates;
  const rate = (x: unknown): boolean => typeof x === 'number' && Number.isFinite(x) && x > 0;
  if (estimates !== undefined && !(typeof estimates === 'object' && estimates !== null && rate(estimates.transferBytesPerSec)
    && rate(estimates.prefillTokensPerSec))) return 'not a worker record (malformed disaggregationEstimates)';
  // The frontend connects to it: a worker started with --advertise-address lacking its port is not reachable.
  try {
    splitAddress(value.address);
  } catch {
    return `its address ${JSON.stringify(value.address.slice(0, 300))} is not host:port`;
  }
  return value as WorkerRecord;
}

/**
 * The worker id is registered by another live process (its lease is kept alive): this one must not take it over.
 * The message names the id and the holder (its pid, address and start time, from its record). A start-up failure
 * (EngineStartError): `conduit worker` prints it as one line and exits 1.
 */
export class WorkerIdInUseError extends EngineStartError {
  override name = 'WorkerIdInUseError';
}

/** How often a registration waiting for another process's key to go looks again. */
const HELD_KEY_POLL_MS = 500;
/** Past the holder lease's remaining TTL, how long its key may take to go (etcd revokes expired leases in a loop). */
const LEASE_EXPIRY_MARGIN_MS = 2000;

/** A worker's key under a kept-alive lease. */
export class WorkerRegistration {
  private lease: Lease | undefined;
  /** The ID of `lease`, once granted. */
  private leaseId: string | undefined;
  /** Every lease this registration was granted: a key still under one of them is this worker's own (see claim). */
  private readonly ownLeases = new Set<string>();
  private stopped = false;
  private retry: NodeJS.Timeout | undefined;

  constructor(private readonly client: Etcd3, private readonly namespace: string, private record: WorkerRecord,
    private readonly ttlSeconds: number, private readonly log: ClusterLog) {}

  get key(): string {
    return `${workersPrefix(this.namespace)}${this.record.id}`;
  }

  /**
   * Registers; resolves once the key is in etcd (retrying until then, every second), or once `signal` ends the wait
   * (the process is stopping: the caller deregisters, in case the key went in meanwhile). Rejects with
   * WorkerIdInUseError when another live process holds the key: it does not lapse within its lease's TTL.
   */
  start(signal?: AbortSignal): Promise<void> {
    return this.registerUntilDone(signal, true);
  }

  /**
   * register() until it succeeds, every second. `refuseHeld`: a key another live process holds ends it with
   * WorkerIdInUseError (at start); else (registering again after a lost lease) it waits for that key to go.
   */
  private async registerUntilDone(signal: AbortSignal | undefined, refuseHeld: boolean): Promise<void> {
    for (;;) {
      if (this.stopped || signal?.aborted) return;
      try {
        await this.register(refuseHeld, signal);
        return;
      } catch (error) {
        if (error instanceof WorkerIdInUseError) throw error;
        if (signal?.aborted) return;
        this.log('warn', `etcd: cannot register ${this.key} yet (${(error as Error).message}); retrying in 1 s`);
        await sleep(1000, signal);
      }
    }
  }

  /**
   * Puts a changed record (the adapters it holds) under the same lease, if the key is still under it; when the lease
   * is being granted again meanwhile, that registration puts this record.
   */
  async update(record: WorkerRecord): Promise<void> {
    this.record = record;
    const leaseId = this.leaseId;
    if (!this.lease || leaseId === undefined || this.stopped) return;
    try {
      const result = await this.client.if(this.key, 'Lease', '==', leaseId)
        .then(this.client.put(this.key).value(JSON.stringify(record)).lease(leaseId)).commit();
      if (!result.succeeded) this.log('warn', `etcd: ${this.key} is not under this worker's lease any more; its record was not updated`);
    } catch (error) {
      this.log('warn', `etcd: could not update ${this.key} (${(error as Error).message}); the lease's next registration puts it`);
    }
  }

  /** Revokes the lease: the key is gone at once. */
  async deregister(): Promise<void> {
    this.stopped = true;
    clearTimeout(this.retry);
    const lease = this.lease;
    this.lease = undefined;
    this.leaseId = undefined;
    if (!lease) return;
    try {
      await Promise.race([lease.revoke(), new Promise((_, reject) => setTimeout(() => reject(new Error('timed out')), 3000))]);
    } catch (error) {
      // etcd unreachable: the lease lapses by itself within its TTL.
      this.log('warn', `etcd: could not revoke the lease of ${this.key} (${(error as Error).message}); it lapses within ${this.ttlSeconds} s`);
      lease.release();
    }
  }

  private async register(refuseHeld: boolean, signal: AbortSignal | undefined): Promise<void> {
    const lease = this.client.lease(this.ttlSeconds, { autoKeepAlive: true });
    lease.on('lost', (error) => {
      if (this.stopped || this.lease !== lease) return;
      this.log('warn', `etcd: lease of ${this.key} lost (${error.message}); registering again`);
      this.lease = undefined;
      this.leaseId = undefined;
      this.retry = setTimeout(() => {
        this.registerUntilDone(undefined, false).catch((failure: Error) => this.log('error', `etcd: ${failure.message}`));
      }, 200);
    });
    let claimed: boolean;
    try {
      const leaseId = await lease.grant();
      this.ownLeases.add(leaseId);
      claimed = await this.claim(leaseId, refuseHeld, signal);
      if (claimed && !this.stopped) {
        this.lease = lease;
        this.leaseId = leaseId;
      }
    } catch (error) {
      lease.release();
      throw error;
    }
    // Stopped (deregistered, or the start-up's signal) while claiming: the key, if it went in, goes with the lease.
    if (!claimed || this.stopped) {
      await lease.revoke().catch(() => lease.release());
      return;
    }
    this.log('info', `etcd: registered ${this.key} (lease ${this.ttlSeconds} s)`);
  }

  /**
   * Puts the record under `leaseId` if the key is absent, or held by an earlier lease of this registration (etcd
   * kept the key of a lease this worker lost: it moves to the new lease). A key under another process's lease is
   * left alone: the put is tried again until that key goes. With `refuseHeld`, only for as long as a lease the
   * holder stopped renewing would take to lapse (its remaining TTL, and a margin): a key still there then is a live
   * process's, and the claim fails with WorkerIdInUseError. False when stopped first (deregistered, or `signal`).
   */
  private async claim(leaseId: string, refuseHeld: boolean, signal: AbortSignal | undefined): Promise<boolean> {
    const key = this.key;
    let deadline: number | undefined;
    let reported = false;
    for (;;) {
      if (this.stopped || signal?.aborted) return false;
      const put = () => this.client.put(key).value(JSON.stringify(this.record)).lease(leaseId);
      const created = await this.client.if(key, 'Create', '==', 0).then(put()).else(this.client.get(key)).commit();
      if (created.succeeded) return true;
      const held = created.responses[0]?.response_range?.kvs[0];
      // The read is in the transaction whose compare found the key, so it is there; should it not be, try again.
      if (!held) continue;
      const holderLease = String(held.lease);
      if (this.ownLeases.has(holderLease) || holderLease === '0') {
        // This worker's own key from a lease it lost, or a key under no lease (no worker put it, and nothing would
        // ever remove it): replaced, unless it changed since it was read.
        if (holderLease === '0') this.log('warn', `etcd: ${key} is under no lease (not a worker's registration); replacing it`);
        const moved = await this.client.if(key, 'Mod', '==', held.mod_revision).then(put()).commit();
        if (moved.succeeded) return true;
        continue;
      }
      const holder = describeHolder(held.value.toString('utf8'));
      if (deadline === undefined) {
        // A holder that stopped renewing (killed) loses the key within its lease's remaining TTL.
        const ttl = await this.client.leaseClient.leaseTimeToLive({ ID: holderLease }).then((r) => Number(r.TTL), () => -1);
        deadline = Date.now() + Math.max(0, ttl) * 1000 + LEASE_EXPIRY_MARGIN_MS;
      }
      if (!reported) {
        reported = true;
        if (refuseHeld) {
          this.log('info', `etcd: worker id ${this.record.id} is registered by ${holder}; waiting up to `
            + `${Math.ceil((deadline - Date.now()) / 1000)} s for that lease to lapse (the worker may have been stopped)`);
        } else {
          this.log('error', `etcd: worker id ${this.record.id} is now registered by another process, ${holder}; `
            + `this worker (pid ${this.record.pid}) is not in discovery until that key goes`);
        }
      }
      if (refuseHeld && Date.now() >= deadline) {
        throw new WorkerIdInUseError(`worker id ${this.record.id} is held by a live worker, ${holder} (its lease under ${key} `
          + 'is kept alive): give this worker another --worker-id, or stop that one first');
      }
      await sleep(HELD_KEY_POLL_MS, signal);
    }
  }
}

/** Who holds a worker's key, from its record: "pid N at host:port (started T)", or what the value is. */
function describeHolder(text: string): string {
  const record = checkWorkerRecord(text);
  if (typeof record === 'string') return `a key that is ${record}`;
  return `pid ${record.pid} at ${record.address} (started ${record.startedAt})`;
}

/** Waits `ms`, or less when `signal` aborts. */
function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise<void>((resolve) => {
    const done = (): void => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal?.addEventListener('abort', done, { once: true });
  });
}

export interface WorkerWatchHandlers {
  put(record: WorkerRecord): void;
  delete(id: string): void;
}

/** The frontend's live view of the workers under a namespace. */
export class WorkerWatch {
  private readonly known = new Map<string, WorkerRecord>();
  /** Keys whose value is not a usable record, with that value: logged once per value (it is listed again on relists). */
  private readonly unusable = new Map<string, string>();
  private watcher: Awaited<ReturnType<ReturnType<Etcd3['watch']>['create']>> | undefined;
  private stopped = false;
  private relistTimer: NodeJS.Timeout | undefined;

  constructor(private readonly client: Etcd3, private readonly namespace: string, private readonly handlers: WorkerWatchHandlers,
    private readonly log: ClusterLog) {}

  get records(): WorkerRecord[] {
    return [...this.known.values()];
  }

  /** Lists and watches; keeps retrying in the background until etcd answers. */
  async start(): Promise<void> {
    await this.relist();
  }

  async stop(): Promise<void> {
    this.stopped = true;
    clearTimeout(this.relistTimer);
    await this.watcher?.cancel().catch(() => {});
  }

  private async relist(): Promise<void> {
    if (this.stopped) return;
    const prefix = workersPrefix(this.namespace);
    try {
      const watcherBefore = this.watcher;
      this.watcher = undefined;
      await watcherBefore?.cancel().catch(() => {});
      const response = await this.client.getAll().prefix(prefix).exec();
      const seen = new Set<string>();
      const listed = new Set<string>();
      for (const kv of response.kvs) {
        const key = kv.key.toString();
        listed.add(key);
        const record = this.recordOf(key, kv.value.toString('utf8'));
        if (!record) continue;
        seen.add(record.id);
        this.apply(record);
      }
      for (const key of [...this.unusable.keys()]) if (!listed.has(key)) this.unusable.delete(key);
      for (const id of [...this.known.keys()]) if (!seen.has(id)) this.remove(id);
      const watcher = await this.client.watch().prefix(prefix).startRevision(String(Number(response.header.revision) + 1)).create();
      if (this.stopped) {
        await watcher.cancel();
        return;
      }
      this.watcher = watcher;
      watcher.on('put', (kv) => {
        const key = kv.key.toString();
        const record = this.recordOf(key, kv.value.toString('utf8'));
        if (record) this.apply(record);
        // The key now names no usable worker: the worker it named (if any) is gone from the view.
        else this.remove(key.slice(prefix.length));
      });
      watcher.on('delete', (kv) => {
        const key = kv.key.toString();
        this.unusable.delete(key);
        this.remove(key.slice(prefix.length));
      });
      // After a reconnect the watch resumes where it was; the list is taken again anyway, in case the history it
      // resumes from was compacted away (etcd restored from elsewhere).
      let disconnected = false;
      watcher.on('disconnected', () => {
        disconnected = true;
        this.log('warn', 'etcd: watch disconnected; reconnecting');
      });
      watcher.on('connected', () => {
        if (disconnected && this.watcher === watcher && !this.stopped) {
          disconnected = false;
          clearTimeout(this.relistTimer);
          this.relistTimer = setTimeout(() => void this.relist(), 100);
        }
      });
      watcher.on('error', (error) => this.log('warn', `etcd: watch error: ${error.message}`));
    } catch (error) {
      this.log('warn', `etcd: cannot list ${prefix} (${(error as Error).message}); retrying in 1 s`);
      clearTimeout(this.relistTimer);
      this.relistTimer = setTimeout(() => void this.relist(), 1000);
    }
  }

  /** The record a key holds; undefined when it holds none usable (logged the first time the key holds that value). */
  private recordOf(key: string, text: string): WorkerRecord | undefined {
    const record = checkWorkerRecord(text);
    if (typeof record !== 'string') {
      this.unusable.delete(key);
      return record;
    }
    if (this.unusable.get(key) !== text) this.log('warn', `etcd: ignoring ${key}: ${record}`);
    this.unusable.set(key, text);
    return undefined;
  }

  private apply(record: WorkerRecord): void {
    const before = this.known.get(record.id);
    this.known.set(record.id, record);
    // A new address is a new connection; a changed record at the same one (its adapters) is news too.
    if (!before || JSON.stringify(before) !== JSON.stringify(record)) this.call(() => this.handlers.put(record), record.id);
  }

  private remove(id: string): void {
    if (!this.known.delete(id)) return;
    this.call(() => this.handlers.delete(id), id);
  }

  /** A handler's failure is logged: it must not escape into etcd's watch stream (nor end the process). */
  private call(handler: () => void, id: string): void {
    try {
      handler();
    } catch (error) {
      this.log('error', `discovery: handling worker ${id} failed (${(error as Error).message}); the watch goes on`);
    }
  }
}
