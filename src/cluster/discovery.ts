// Discovery through etcd. A worker registers one key, `/<namespace>/workers/<id>`, bound to a lease of a few seconds
// that the client keeps alive: the key lives while the worker does, and a worker that stops renewing (killed, cut
// off) disappears when its lease lapses. A lost lease (etcd restarted without its data, or unreachable past the TTL)
// is granted again and the key put again, so a worker outlives an etcd outage without restarting. Deregistering
// revokes the lease (the key goes at once): a draining worker does that first.
//
// A frontend lists the prefix and watches it from the listed revision: workers appear and disappear live. When the
// watch reconnects (etcd restarted), the prefix is listed again and the view reconciled (workers gone meanwhile are
// removed, new ones added). A key whose value is not a usable worker record (not JSON, a field missing, an address
// that is not host:port) is logged once per value and otherwise treated as absent; nothing a key holds, nor anything
// the frontend's handlers throw on it, stops the watch or the process.

import tls from 'node:tls';
import { Etcd3, type IOptions, type Lease } from 'etcd3';
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

/** A worker's key under a kept-alive lease. */
export class WorkerRegistration {
  private lease: Lease | undefined;
  private stopped = false;
  private retry: NodeJS.Timeout | undefined;

  constructor(private readonly client: Etcd3, private readonly namespace: string, private record: WorkerRecord,
    private readonly ttlSeconds: number, private readonly log: ClusterLog) {}

  get key(): string {
    return `${workersPrefix(this.namespace)}${this.record.id}`;
  }

  /**
   * Registers; resolves once the key is in etcd (retrying until then, every second), or once `signal` ends the wait
   * (the process is stopping: the caller deregisters, in case the key went in meanwhile).
   */
  async start(signal?: AbortSignal): Promise<void> {
    for (;;) {
      if (this.stopped || signal?.aborted) return;
      try {
        await this.register();
        return;
      } catch (error) {
        if (signal?.aborted) return;
        this.log('warn', `etcd: cannot register ${this.key} yet (${(error as Error).message}); retrying in 1 s`);
        await new Promise<void>((resolve) => {
          const done = (): void => {
            clearTimeout(timer);
            signal?.removeEventListener('abort', done);
            resolve();
          };
          const timer = setTimeout(done, 1000);
          signal?.addEventListener('abort', done, { once: true });
        });
      }
    }
  }

  /**
   * Puts a changed record (the adapters it holds) under the same lease; when the lease is being granted again
   * meanwhile, that registration puts this record.
   */
  async update(record: WorkerRecord): Promise<void> {
    this.record = record;
    const lease = this.lease;
    if (!lease || this.stopped) return;
    try {
      await lease.put(this.key).value(JSON.stringify(record));
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
    if (!lease) return;
    try {
      await Promise.race([lease.revoke(), new Promise((_, reject) => setTimeout(() => reject(new Error('timed out')), 3000))]);
    } catch (error) {
      // etcd unreachable: the lease lapses by itself within its TTL.
      this.log('warn', `etcd: could not revoke the lease of ${this.key} (${(error as Error).message}); it lapses within ${this.ttlSeconds} s`);
      lease.release();
    }
  }

  private async register(): Promise<void> {
    const lease = this.client.lease(this.ttlSeconds, { autoKeepAlive: true });
    lease.on('lost', (error) => {
      if (this.stopped || this.lease !== lease) return;
      this.log('warn', `etcd: lease of ${this.key} lost (${error.message}); registering again`);
      this.lease = undefined;
      this.retry = setTimeout(() => void this.start(), 200);
    });
    try {
      await lease.put(this.key).value(JSON.stringify(this.record));
    } catch (error) {
      lease.release();
      throw error;
    }
    this.lease = lease;
    this.log('info', `etcd: registered ${this.key} (lease ${this.ttlSeconds} s)`);
  }
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
