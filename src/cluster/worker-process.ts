// One worker process: a local engine (cpu or sim) served on the request plane, registered in etcd and publishing
// its KV events and load on NATS when those are given (`conduit worker`), or reporting its address to the parent
// process that started it (`conduit serve --worker-processes N`: no services, KV events on the connection).
//
// Shutdown (SIGTERM) drains: the etcd key goes first (frontends stop sending), the frontends are told on every
// connection, the running streams finish (up to the grace), then the event plane, the server and the engine close.

import { hostname } from 'node:os';
import { createLocalEngine } from '../engine/local-engine.ts';
import type { WorkerRole } from '../engine/types.ts';
import type { ChatTemplate } from '../model/chat-template.ts';
import type { Tokenizer } from '../model/tokenizer/types.ts';
import type { RoutableEngine } from '../runtime/worker-group.ts';
import { DiskSlots, simDisaggregationEstimates, simPool, withDiskTierLock, type WorkerPoolOptions } from '../runtime/worker-pool.ts';
import { LoraManager } from '../runtime/lora-manager.ts';
import { etcdClient, WorkerRegistration, type EtcdConnectOptions, type WorkerLora, type WorkerRecord } from './discovery.ts';
import { checkWorkerId, EventPublisher, natsConnect, NatsWaitAbortedError, workerInstance, type NatsConnectOptions } from './events.ts';
import type { KvLinkPreference } from './kv-shm.ts';
import { WorkerServer, type ClusterLog } from './worker-server.ts';

export interface ClusterWorkerOptions {
  workerId: string;
  role: WorkerRole;
  namespace: string;
  clusterToken: string;
  /** Where the request endpoint listens, and the address given to frontends (default host:port, or the host name). */
  host: string;
  port: number;
  advertiseAddress?: string;
  etcd?: EtcdConnectOptions;
  nats?: NatsConnectOptions;
  leaseTtlSeconds: number;
  maxFrameBytes?: number;
  /** How long a pinging frontend may be silent before its connection is closed (WorkerServer's; default 15 s, 0 never). */
  frontendSilenceTimeoutMs?: number;
  /** 'tcp': KV transfers with workers on this host go over TCP too, not shared memory (default 'auto'). */
  kvLink?: KvLinkPreference;
  /** A prefill worker's KV port (default 0: any free port). */
  kvPort?: number;
  /**
   * The worker's own LoRA adapters (`conduit worker`; not a `conduit serve --worker-processes` child, whose parent
   * manages them): loaded at start from `modules`, at most `maxLoras` resident, none above `maxLoraRank`; frontends
   * load and unload more over the request plane. The worker publishes what it holds in its etcd record.
   */
  lora?: { modules: { name: string; path: string }[]; maxLoras: number; maxLoraRank: number };
  /** The engine: cpu (a model file) or sim; the rest of the pool options as `conduit serve` takes them. */
  pool: Omit<WorkerPoolOptions, 'workers'>;
  log: ClusterLog;
  /**
   * Ends the start-up's waits for NATS and etcd (SIGINT while they do not answer): startClusterWorker closes what it
   * started and rejects with WorkerStartAbortedError.
   */
  signal?: AbortSignal;
}

export interface RunningWorker {
  server: WorkerServer;
  address: string;
  record: WorkerRecord;
  /** Deregisters, drains for up to graceMs, closes everything. */
  shutdown(graceMs: number): Promise<void>;
}

/** Unique enough across hosts and restarts: host name, process id, a random suffix. */
export function defaultWorkerId(): string {
  const host = hostname().replace(/[^A-Za-z0-9_-]/g, '-').slice(0, 40);
  return `${host}-${process.pid}-${Math.floor(Math.random() * 0xffff).toString(16)}`;
}

async function startEngine(options: ClusterWorkerOptions): Promise<{
  engine: RoutableEngine; tokenizer: Tokenizer; chatTemplate: ChatTemplate; estimates?: WorkerRecord['disaggregationEstimates'];
  /** What a simulated worker simulates, as `conduit serve` says it: profile, GPUs, speed-up, calibration. */
  deployment?: string;
}> {
  const pool = options.pool;
  if (pool.engine === 'sim') {
    const sim = simPool(pool);
    const engine = sim.make({ enableKvEvents: true, role: options.role });
    // A frontend over prefill and decode workers starts its policy from their model, not the CPU defaults.
    const estimates = options.role === 'both' ? undefined
      : simDisaggregationEstimates(engine, pool.maxNumBatchedTokens);
    return {
      engine, tokenizer: sim.tokenizer, chatTemplate: sim.chatTemplate, ...(estimates ? { estimates } : {}),
      deployment: `${sim.describe.replace(/ per worker$/, '')}, ${sim.settings}`,
    };
  }
  if (!pool.modelPath) throw new Error('cpu workers need a model path');
  // The KV tiers under the pool, as a server's single worker thread has them (its disk tier in worker-0 of the
  // folder), the folder held by this process: a second process pointed at it is refused.
  const slots = new DiskSlots(pool, 1);
  const bundle = await withDiskTierLock(pool.kvOffloadDiskDir, () => slots.start(
    (kvOffload) => createLocalEngine({
      ...pool, ...kvOffload, modelPath: pool.modelPath!, enableKvEvents: true, role: options.role, log: options.log,
    }),
    (started) => started.engine), ['worker-0']);
  for (const { level, message } of bundle.engine.notices) options.log(level, message);
  return { engine: bundle.engine, tokenizer: bundle.tokenizer, chatTemplate: bundle.chatTemplate };
}

/** A --lora-modules adapter the worker could not load: it does not start (the message says which and why). */
export class LoraModuleError extends Error {
  override name = 'LoraModuleError';
}

/** The worker's request port (or a prefill worker's KV port) could not be opened: in use, not allowed, no such host. */
export class WorkerListenError extends Error {
  override name = 'WorkerListenError';
}

/** The start-up was stopped (ClusterWorkerOptions.signal) while it waited for NATS or etcd. */
export class WorkerStartAbortedError extends Error {
  override name = 'WorkerStartAbortedError';
}

/** The adapters a worker holds, as its record publishes them. */
function workerLoras(adapters: LoraManager): WorkerLora[] {
  return adapters.list().map(({ name, key, path, rank }) => ({ name, key, path, ...(rank !== undefined ? { rank } : {}) }));
}

export async function startClusterWorker(options: ClusterWorkerOptions): Promise<RunningWorker> {
  const workerId = checkWorkerId(options.workerId);
  const { log } = options;
  const { engine, tokenizer, chatTemplate, estimates, deployment } = await startEngine(options);
  let adapters: LoraManager | undefined;
  if (options.lora) {
    if (!engine.loadLora) {
      await engine.close();
      throw new Error('this engine runs no LoRA adapters');
    }
    adapters = new LoraManager(engine, options.lora.maxLoras, (message) => log('info', message), options.lora.maxLoraRank);
    for (const { name, path } of options.lora.modules) {
      try {
        const info = await adapters.register(name, path);
        log('info', `LoRA adapter ${name} (${info.format}, rank ${info.rank}${info.dtype ? `, stored as ${info.dtype}` : ''}) loaded from ${path}`);
      } catch (error) {
        await engine.close();
        throw new LoraModuleError(`--lora-modules ${name}=${path}: ${(error as Error).message}`);
      }
    }
  }
  // Set once the record exists: lora-load / lora-unload publish the adapters the worker holds.
  let publishAdapters: (() => void) | undefined;
  const server = new WorkerServer({
    workerId, engine, role: options.role, clusterToken: options.clusterToken, tokenizer, chatTemplate, log,
    ...(adapters ? { adapters, onAdaptersChanged: () => publishAdapters?.() } : {}),
    ...(options.maxFrameBytes !== undefined ? { maxFrameBytes: options.maxFrameBytes } : {}),
    ...(options.frontendSilenceTimeoutMs !== undefined ? { frontendSilenceTimeoutMs: options.frontendSilenceTimeoutMs } : {}),
    ...(options.kvLink ? { kvLink: options.kvLink } : {}),
    ...(options.kvPort ? { kvPort: options.kvPort } : {}),
  });
  let port: number;
  try {
    port = await server.listen(options.port, options.host);
  } catch (error) {
    await engine.close();
    // Node's message names the address that failed (the KV port's, when that one did).
    throw new WorkerListenError(`cannot listen on ${options.host}:${options.port}${options.kvPort ? ` (KV port ${options.kvPort})` : ''}: ${(error as Error).message}`);
  }
  const host = options.host === '0.0.0.0' || options.host === '::' ? hostname() : options.host;
  const address = options.advertiseAddress ?? `${host.includes(':') ? `[${host}]` : host}:${port}`;
  const record: WorkerRecord = {
    id: workerId, role: options.role, model: engine.info.modelName, address, blockSize: engine.info.blockSize,
    capacityTokens: engine.info.kvCapacityTokens, maxModelLen: engine.info.maxModelLen, engine: options.pool.engine,
    pid: process.pid, startedAt: new Date().toISOString(),
    ...(adapters ? { loras: workerLoras(adapters) } : {}),
    ...(estimates ? { disaggregationEstimates: estimates } : {}),
  };
  let publisher: EventPublisher | undefined;
  let etcd: ReturnType<typeof etcdClient> | undefined;
  const closeStarted = async (): Promise<void> => {
    await publisher?.close();
    await server.close();
    await engine.close();
    etcd?.close();
  };
  const stopStarting = async (why: string): Promise<never> => {
    await closeStarted();
    throw new WorkerStartAbortedError(why);
  };
  if (options.nats) {
    let nc;
    try {
      nc = await natsConnect({ ...options.nats, name: `conduit-worker-${workerId}` },
        { log, ...(options.signal ? { signal: options.signal } : {}) });
    } catch (error) {
      if (error instanceof NatsWaitAbortedError) return stopStarting(error.message);
      throw error;
    }
    publisher = new EventPublisher(nc, options.namespace, workerId, workerInstance(record), {
      stats: () => server.stats(),
      snapshot: () => server.kv.snapshot(),
      onKvEvents: (listener) => server.onKvEvents(listener),
    }, log);
  }
  etcd = options.etcd ? etcdClient(options.etcd) : undefined;
  const registration = etcd ? new WorkerRegistration(etcd, options.namespace, record, options.leaseTtlSeconds, log) : undefined;
  try {
    await registration?.start(options.signal);
  } catch (error) {
    // Another live process holds this worker id (WorkerIdInUseError): this one does not start.
    await closeStarted();
    throw error;
  }
  if (options.signal?.aborted) {
    await registration?.deregister();
    return stopStarting(`stopped${registration ? ` while registering ${registration.key}` : ''}`);
  }
  if (adapters) {
    publishAdapters = () => {
      const loras = workerLoras(adapters);
      if (JSON.stringify(loras) === JSON.stringify(record.loras)) return;
      record.loras = loras;
      void registration?.update({ ...record });
    };
  }
  log('info', `worker ${workerId} serving ${record.model}${deployment ? ` (${deployment})` : ''} on ${address}`
    + `${registration ? ` (registered as ${registration.key})` : ''}`);
  let shuttingDown: Promise<void> | undefined;
  return {
    server, address, record,
    shutdown(graceMs: number): Promise<void> {
      shuttingDown ??= (async () => {
        await registration?.deregister();
        log('info', `worker ${workerId}: deregistered; draining ${server.inFlight} request(s) (grace ${graceMs / 1000} s)`);
        await server.drain(graceMs);
        await publisher?.close();
        await server.close();
        await engine.close();
        etcd?.close();
        log('info', `worker ${workerId}: stopped`);
      })();
      return shuttingDown;
    },
  };
}
