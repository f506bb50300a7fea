// `conduit worker`: one engine worker as a process of its own, serving the request plane, registered in etcd under
// the namespace with a kept-alive lease, publishing its KV events and load on NATS. SIGINT/SIGTERM drain: deregister,
// finish the running streams (up to --shutdown-grace), exit 0. A worker of any role keeps its own LoRA adapters
// (--lora-modules at start, --max-loras resident, --max-lora-rank; frontends load more) and publishes them in its
// etcd record. Start-up failures (a model that does not load, an engine that refuses its options, a port in use) are
// one line and exit code 1, as `conduit serve` reports them.
//
// `--parent-ipc`: a child of `conduit serve --worker-processes`. It reports its address to the server over the IPC
// channel instead of registering, and takes its options from its command line alone (see parentIpcEnvironment). The
// server decides when it stops (see ParentLink).

import { modelIdFromName } from '../api/gateway.ts';
import { createLogger, isLogLevel, LOG_LEVELS } from '../util/log.ts';
import { DEFAULT_LEASE_TTL_SECONDS } from '../cluster/discovery.ts';
import { FRONTEND_SILENCE_TIMEOUT_MS } from '../cluster/request-plane.ts';
import { isWorkerId } from '../cluster/events.ts';
import { splitAddress } from '../cluster/remote-engine.ts';
import { defaultWorkerId, LoraModuleError, startClusterWorker, WorkerListenError, WorkerStartAbortedError } from '../cluster/worker-process.ts';
import { EngineStartError } from '../engine/errors.ts';
import { DiskTierLockedError } from '../engine/kv-cache/disk-tier.ts';
import type { WorkerRole } from '../engine/types.ts';
import { isModelLoadError } from '../model/loader.ts';
import { parseCalibration } from '../sim/calibration.ts';
import { checkSimDeployment } from '../sim/sim-worker.ts';
import { CLUSTER_FLAGS, parseClusterConfig } from './cluster-flags.ts';
import {
  checkThreadsAtMost, checkTimerSecondsAtMost, envName, flagLabel, formatFlagHelp, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, nameEnvironment, parseFlags, UsageError, type FlagTable,
  type ParsedFlags,
} from './flags.ts';
import type { Command } from './main.ts';
import {
  checkDiskTierFolder, engineOptionWarnings, isTierSizeTooSmall, parseByteSize, parseKvDtype, parseLoraDtype, parseLoraModules, parseModelSpecs, parseSchedulingPolicy, parseSpeedUp,
  checkSimLoraRank, positiveInteger, SERVE_FLAGS,
} from './serve.ts';

const ENGINE_FLAG_NAMES = [
  'model', 'served-model-name', 'engine', 'backend', 'threads', 'kv-cache-memory', 'kv-cache-dtype', 'kv-cache-idle-release',
  'kv-offload-memory', 'kv-offload-disk', 'kv-offload-disk-size', 'scheduling-policy', 'max-num-seqs',
  'max-num-batched-tokens', 'max-model-len', 'enable-prefix-caching', 'guided-jump-forward', 'stream-interval', 'lora-modules', 'lora-dtype', 'max-loras', 'max-lora-rank', 'sim-model', 'sim-gpu', 'sim-tp', 'sim-lora-rank', 'sim-calibration', 'sim-speed-up', 'shutdown-grace', 'log-level',
] as const;

const ENGINE_FLAGS = Object.fromEntries(ENGINE_FLAG_NAMES.map((name) => [name, SERVE_FLAGS[name]])) as Pick<typeof SERVE_FLAGS, (typeof ENGINE_FLAG_NAMES)[number]>;

export const WORKER_FLAGS = {
  ...CLUSTER_FLAGS,
  ...ENGINE_FLAGS,
  // A worker serves one model (serve's flags of these names take several).
  model: { type: 'string', help: 'GGUF file or Hugging Face folder, or NAME=PATH to serve it as NAME (default: the built-in synthetic model)', short: 'm' },
  'served-model-name': { type: 'string', help: 'name clients send as "model" (default: the model\'s own name)' },
  host: { type: 'string', help: 'address the request endpoint listens on', default: '127.0.0.1' },
  port: { type: 'number', help: 'port of the request endpoint (0 = any free port)', default: 0 },
  'advertise-address': { type: 'string', help: 'host:port frontends reach this worker at (default: --host:port, or the host name when listening on all addresses)' },
  'worker-id': { type: 'string', help: 'this worker\'s id in discovery (default: host name, process id and a random suffix)' },
  role: { type: 'string', help: 'both (aggregated), prefill or decode (disaggregated: a frontend over prefill and decode workers prefills on one and decodes on the other, the KV streamed between them over TCP or /dev/shm)', default: 'both' },
  'kv-transfer-link': { type: 'string', help: 'how KV blocks move between prefill and decode workers: auto (shared memory, /dev/shm, when both run on one host, else TCP) or tcp (always TCP)', default: 'auto' },
  'kv-port': { type: 'number', help: 'a prefill worker\'s KV port, on the interface of --host, where decode workers fetch KV blocks (default 0: any free port)', default: 0 },
  'lease-ttl': { type: 'number', help: 'seconds the etcd lease lives without a keep-alive: a dead worker leaves discovery within this (2 to 2147483)', default: DEFAULT_LEASE_TTL_SECONDS },
  'frontend-silence-timeout': {
    type: 'number', default: FRONTEND_SILENCE_TIMEOUT_MS / 1000,
    help: 'seconds a frontend may send nothing, not even its ping (every 500 ms), before its connection is closed and its requests stopped (their KV blocks freed): a frontend host that vanished; at least 1 (0 = never, frontends then do not ping)',
  },
  // No twin: a CONDUIT_PARENT_IPC left in an environment made a cluster worker skip registering, unseen by frontends.
  'parent-ipc': { type: 'boolean', help: 'internal: started by `conduit serve --worker-processes`; report the address to the parent instead of registering', default: false, noEnvTwin: true },
  help: { type: 'boolean', help: 'show this help', short: 'h' },
} satisfies FlagTable;

/**
 * The options a `--parent-ipc` child still reads from its environment: the cluster token and the log level the server
 * sets there, and the KV link of prefill and decode children (CONDUIT_KV_TRANSFER_LINK, which has no `serve` flag).
 */
const PARENT_IPC_ENV_OPTIONS: ReadonlySet<string> = new Set(['cluster-token', 'log-level', 'kv-transfer-link']);

/**
 * The environment a `--parent-ipc` child parses its options against: the server's own, less the twins of the worker's
 * options (but PARENT_IPC_ENV_OPTIONS). The server passes every setting of its children on their command line, where
 * it has already resolved its command line against its environment: a twin left in the environment would otherwise
 * stand for any setting the command line leaves at its default (CONDUIT_ENABLE_PREFIX_CACHING=false against a typed
 * --enable-prefix-caching), and the twins of `conduit worker`'s own options, in an environment shared with a cluster's
 * workers, would apply to every child (CONDUIT_ADVERTISE_ADDRESS: the address each would report).
 */
export function parentIpcEnvironment(env: NodeJS.ProcessEnv): NodeJS.ProcessEnv {
  const twins = new Set(Object.entries(WORKER_FLAGS).filter(([name]) => !PARENT_IPC_ENV_OPTIONS.has(name))
    .map(([name, spec]) => envName(name, spec)));
  return Object.fromEntries(Object.entries(env).filter(([key]) => !twins.has(key)));
}

/**
 * A `--parent-ipc` child's IPC channel to the server that forked it. The server alone decides when its workers stop:
 * the child ignores SIGINT, SIGTERM and SIGHUP (a terminal's Ctrl-C reaches its whole process group, a service manager
 * may signal every process of its unit, and either would end the child's streams at once, ahead of the server's
 * --shutdown-grace) and stops when the channel closes: the server closed it once its own drain was over, or the server
 * is gone. A child that cannot start tells the server why before it exits.
 */
class ParentLink {
  private state: 'starting' | 'ready' | 'failed' = 'starting';
  /** Resolves when the channel closes. */
  readonly closed: Promise<void>;

  constructor() {
    for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) process.on(signal, () => {});
    this.closed = new Promise((resolve) => process.once('disconnect', () => resolve()));
    // The server is gone before this worker was ready: nothing was served yet, nothing is left to finish.
    void this.closed.then(() => {
      if (this.state === 'starting') process.exit(1);
    });
  }

  ready(address: string, workerId: string): void {
    this.state = 'ready';
    process.send!({ type: 'ready', address, workerId });
  }

  /** Sends the server the reason this worker could not start, then closes the channel (which holds the process up). */
  failed(message: string): void {
    if (this.state !== 'starting' || !process.connected) return;
    this.state = 'failed';
    process.send!({ type: 'failed', message }, () => {
      if (process.connected) process.disconnect();
    });
  }
}

/** A start-up failure reported as one line: the model, the engine's options, the disk tier's folder, the port. */
function isStartFailure(error: unknown): error is Error {
  return isModelLoadError(error) || error instanceof EngineStartError || error instanceof DiskTierLockedError
    || error instanceof WorkerListenError;
}

/** --advertise-address as frontends read it (host:port, [v6]:port): a typo is refused here, not by every frontend. */
function checkAdvertiseAddress(text: string): void {
  let port: number | undefined;
  try {
    port = splitAddress(text).port;
  } catch {
    // Refused below.
  }
  if (port === undefined || port < 1 || port > 65535) {
    throw new UsageError(`--advertise-address must be host:port, the address frontends connect to (10.0.0.2:7000), got "${text}"`);
  }
}

export const workerCommand: Command = {
  summary: 'one engine worker as a process, found through etcd, KV events on NATS',
  async run(argv) {
    const parent = argv.includes('--parent-ipc') && process.send !== undefined ? new ParentLink() : undefined;
    try {
      return await runWorker(argv, parent);
    } catch (error) {
      parent?.failed(error instanceof Error ? error.message : String(error));
      if (!isStartFailure(error)) throw error;
      // One line, as `conduit serve` reports the same failures.
      console.error(`conduit worker: ${error.message}`);
      // A --kv-offload-memory or --kv-offload-disk-size below one block is a bad value, as for `conduit serve`.
      const code = isTierSizeTooSmall(error) ? 2 : 1;
      // Whatever the failed start left behind (an engine thread, a timer) does not keep the process up.
      setTimeout(() => process.exit(code), 1000).unref();
      return code;
    }
  },
};

async function runWorker(argv: string[], parent: ParentLink | undefined): Promise<number> {
  const env = argv.includes('--parent-ipc') ? parentIpcEnvironment(process.env) : process.env;
  const parsed = parseFlags(WORKER_FLAGS, argv, env);
  try {
    return await runParsedWorker(parsed, parent);
  } catch (error) {
    // A value nobody typed is reported under the variable that gave it (CONDUIT_PORT (--port) must be ...), as
    // `conduit serve` reports it.
    throw nameEnvironment(WORKER_FLAGS, parsed, error);
  }
}

async function runParsedWorker(parsed: ParsedFlags<typeof WORKER_FLAGS>, parent: ParentLink | undefined): Promise<number> {
  const { values, positionals, lists, sources } = parsed;
  if (values.help) {
    console.log(`Usage: conduit worker --etcd-endpoints URLS --nats-server URLS --cluster-token T [options]\n\n${formatFlagHelp(WORKER_FLAGS)}`);
    return 0;
  }
  if (positionals.length > 0) throw new UsageError(`unexpected argument "${positionals[0]}"`);
  const local = values['parent-ipc'];
  const cluster = parseClusterConfig(values, !local, (name) => flagLabel(WORKER_FLAGS, parsed, name));
  // As --namespace: the id names the worker's etcd key and NATS subjects.
  const givenId = values['worker-id'];
  if (givenId !== undefined && !isWorkerId(givenId)) throw new UsageError(`--worker-id must be 1-128 letters, digits, "-" or "_", got "${givenId}"`);
  const role = values.role!;
  if (role !== 'both' && role !== 'prefill' && role !== 'decode') throw new UsageError(`--role must be both, prefill or decode, got "${role}"`);
  const engineKind = values.engine!;
  if (engineKind !== 'cpu' && engineKind !== 'sim') throw new UsageError('--engine must be cpu or sim');
  const logLevel = values['log-level']!;
  if (!isLogLevel(logLevel)) throw new UsageError(`--log-level must be one of ${LOG_LEVELS.join(', ')}`);
  const port = values.port!;
  if (!Number.isInteger(port) || port < 0 || port > 65535) throw new UsageError(`--port must be 0..65535, got ${port}`);
  // A child reports its own loopback address to the server.
  const advertiseAddress = local ? undefined : values['advertise-address'] || undefined;
  if (advertiseAddress !== undefined) checkAdvertiseAddress(advertiseAddress);
  // As `conduit serve` checks them.
  const threads = positiveInteger(values.threads, 'threads');
  checkThreadsAtMost(threads);
  const graceSeconds = values['shutdown-grace']!;
  if (!(graceSeconds >= 0)) throw new UsageError(`--shutdown-grace must be >= 0, got ${graceSeconds}`);
  checkTimerSecondsAtMost('shutdown-grace', graceSeconds);
  const idleRelease = values['kv-cache-idle-release']!;
  if (!(idleRelease >= 0)) throw new UsageError(`--kv-cache-idle-release must be >= 0 seconds, got ${idleRelease}`);
  const streamInterval = positiveInteger(values['stream-interval'], 'stream-interval')!;
  const simTp = positiveInteger(values['sim-tp'], 'sim-tp')!;
  const simLoraRank = positiveInteger(values['sim-lora-rank'], 'sim-lora-rank')!;
  const kvLink = values['kv-transfer-link']!;
  if (kvLink !== 'auto' && kvLink !== 'tcp') throw new UsageError(`--kv-transfer-link must be auto or tcp, got "${kvLink}"`);
  // As `conduit serve` checks it: a dangling link, /proc or /sys, or an unwritable folder is a usage error.
  if (values['kv-offload-disk'] !== undefined && values['kv-offload-disk'] !== '') checkDiskTierFolder(values['kv-offload-disk']);
  const kvPort = values['kv-port']!;
  if (!Number.isInteger(kvPort) || kvPort < 0 || kvPort > 65535) throw new UsageError(`--kv-port must be 0..65535, got ${kvPort}`);
  if (kvPort !== 0 && values.role !== 'prefill') throw new UsageError('--kv-port is a prefill worker\'s (--role prefill): only it serves KV blocks');
  const silenceSeconds = values['frontend-silence-timeout']!;
  // Below a second, a live frontend's garbage-collection pause or a busy host would have its connection cut.
  if (!(silenceSeconds === 0 || silenceSeconds >= 1)) {
    throw new UsageError(`${flagLabel(WORKER_FLAGS, parsed, 'frontend-silence-timeout')} must be 0 (never) or at least 1 second, got ${silenceSeconds}`);
  }
  checkTimerSecondsAtMost('frontend-silence-timeout', silenceSeconds, 'never');
  const ttl = values['lease-ttl']!;
  if (!Number.isInteger(ttl) || ttl < 2) throw new UsageError(`--lease-ttl must be a whole number of seconds >= 2, got ${ttl}`);
  // The etcd client keeps the lease alive on timers of a third of the TTL and of the whole TTL: past what a timer holds
  // they fired every millisecond, burning a core, and the lease could not even be revoked at exit (its key stayed).
  checkTimerSecondsAtMost('lease-ttl', ttl);
  const backend = values.backend!;
  if (backend !== 'auto' && backend !== 'native' && backend !== 'reference') throw new UsageError('--backend must be auto, native or reference');
  let calibration;
  try {
    calibration = parseCalibration(values['sim-calibration']!);
  } catch (error) {
    throw new UsageError(`--sim-calibration: ${(error as Error).message}`);
  }
  // As `conduit serve` checks them: a simulated worker that cannot exist, by the options that set it.
  if (engineKind === 'sim') {
    const label = (name: 'sim-model' | 'sim-gpu' | 'sim-tp'): string => flagLabel(WORKER_FLAGS, parsed, name);
    checkSimDeployment({ model: values['sim-model']!, gpu: values['sim-gpu']!, tp: simTp },
      { model: label('sim-model'), gpu: label('sim-gpu'), tp: label('sim-tp') });
    checkSimLoraRank(simLoraRank, values['sim-model']!);
  }
  // The worker's own adapters (a --parent-ipc child's are its parent's to load).
  const loraModules = parseLoraModules(lists['lora-modules'] ?? []);
  if (local && loraModules.length > 0) throw new UsageError('--lora-modules is the parent\'s option under `conduit serve --worker-processes`');
  const maxLoras = values['max-loras']!;
  const maxLoraRank = values['max-lora-rank']!;
  if (!Number.isInteger(maxLoras) || maxLoras < 1) throw new UsageError(`--max-loras must be a whole number > 0, got ${maxLoras}`);
  if (!Number.isInteger(maxLoraRank) || maxLoraRank < 1) throw new UsageError(`--max-lora-rank must be a whole number > 0, got ${maxLoraRank}`);
  const logger = createLogger(logLevel);
  const log = (level: 'debug' | 'info' | 'warn' | 'error', message: string): void => logger[level](message);
  const [modelSpec] = values.model !== undefined
    ? parseModelSpecs([values.model], values['served-model-name'] !== undefined ? [values['served-model-name']] : [], undefined,
      (name) => flagLabel(WORKER_FLAGS, parsed, name)) : [];
  const modelPath = engineKind === 'sim' ? undefined
    : modelSpec?.path ?? await (await import('../model/synthetic.ts')).ensureBuiltinModel();
  const workerId = values['worker-id'] ?? defaultWorkerId();
  const servedName = modelSpec?.servedModelName ?? values['served-model-name'];
  for (const { name, base } of loraModules) {
    // A worker serves one model: an adapter's @BASE, when given, must be it (checked again once the name is known).
    if (base !== undefined && servedName !== undefined && base !== servedName) {
      throw new UsageError(`--lora-modules ${name}: base model "${base}" is not this worker's (${servedName})`);
    }
  }
  const kvDtype = parseKvDtype(values['kv-cache-dtype']!);
  // The options this engine ignores, said as `conduit serve` says them. Not by a --parent-ipc child: its server
  // said them once already, and passes every setting it resolved (--threads, the --sim-* values) to each child.
  if (!local) {
    for (const warning of engineOptionWarnings(engineKind, values, sources, values.model !== undefined ? [values.model] : [])) logger.warn(warning);
  }
  // The signals are heard from here on: a worker that waits for NATS or etcd at start stops at once on SIGINT or
  // SIGTERM (deregistering, should its key have gone in meanwhile), where it ignored them until registered.
  // Not a --parent-ipc child's: its server decides when it stops (ParentLink).
  const signals = ['SIGINT', 'SIGTERM', 'SIGHUP'] as const;
  const stopping = new AbortController();
  const signalled = parent ? undefined : new Promise<string>((resolve) => {
    const handler = (name: string): void => {
      for (const other of signals) process.off(other, handler);
      stopping.abort();
      resolve(name);
    };
    for (const name of signals) process.on(name, handler);
  });
  const started = startClusterWorker({
    ...(parent ? {} : { signal: stopping.signal }),
    workerId, role: role as WorkerRole, namespace: cluster.namespace, clusterToken: cluster.clusterToken,
    host: values.host!, port, ...(advertiseAddress !== undefined ? { advertiseAddress } : {}),
    ...(!local && cluster.etcd ? { etcd: cluster.etcd } : {}), ...(!local && cluster.nats ? { nats: cluster.nats } : {}),
    leaseTtlSeconds: ttl, maxFrameBytes: cluster.maxFrameBytes, log, kvLink, ...(kvPort ? { kvPort } : {}),
    frontendSilenceTimeoutMs: Math.round(silenceSeconds * 1000),
    ...(!local ? { lora: { modules: loraModules.map(({ name, path }) => ({ name, path })), maxLoras, maxLoraRank } } : {}),
    pool: {
      engine: engineKind, backend,
      ...(modelPath !== undefined ? { modelPath } : {}),
      ...(servedName !== undefined ? { servedModelName: servedName } : {}),
      ...(threads !== undefined ? { threads } : {}),
      ...(values['lora-dtype'] !== undefined ? { loraDtype: parseLoraDtype(values['lora-dtype']) } : {}),
      ...(values['kv-cache-memory'] !== undefined ? { kvCacheMemoryBytes: parseByteSize(values['kv-cache-memory'], 'kv-cache-memory') } : {}),
      ...(kvDtype !== undefined ? { kvDtype } : {}),
      kvCacheIdleReleaseSeconds: idleRelease,
      policy: parseSchedulingPolicy(values['scheduling-policy']!),
      ...(values['kv-offload-memory'] !== undefined
        ? { kvOffloadMemoryBytes: parseByteSize(values['kv-offload-memory'], 'kv-offload-memory', { allowZero: true }) } : {}),
      ...(values['kv-offload-disk'] !== undefined ? {
        kvOffloadDiskDir: values['kv-offload-disk'], kvOffloadDiskBytes: parseByteSize(values['kv-offload-disk-size']!, 'kv-offload-disk-size'),
      } : {}),
      ...(values['max-num-seqs'] !== undefined ? { maxNumSeqs: positiveInteger(values['max-num-seqs'], 'max-num-seqs', MAX_NUM_SEQS) } : {}),
      ...(values['max-num-batched-tokens'] !== undefined
        ? { maxNumBatchedTokens: positiveInteger(values['max-num-batched-tokens'], 'max-num-batched-tokens', MAX_NUM_BATCHED_TOKENS) } : {}),
      ...(values['max-model-len'] !== undefined ? { maxModelLen: positiveInteger(values['max-model-len'], 'max-model-len') } : {}),
      enablePrefixCaching: values['enable-prefix-caching']!,
      guidedJumpForward: values['guided-jump-forward']!,
      streamInterval,
      sim: { model: values['sim-model']!, gpu: values['sim-gpu']!, tp: simTp, speedUp: parseSpeedUp(values['sim-speed-up']!), calibration, loraRank: simLoraRank },
    },
  }).catch((error: unknown) => {
    throw error instanceof LoraModuleError ? new UsageError(error.message) : error;
  });
  let running: Awaited<typeof started>;
  try {
    running = await started;
  } catch (error) {
    if (!(error instanceof WorkerStartAbortedError)) throw error;
    logger.info(`${await signalled}: ${error.message}`);
    setTimeout(() => process.exit(0), 500).unref();
    return 0;
  }
  const misnamed = loraModules.find((m) => m.base !== undefined && m.base !== running.record.model && m.base !== modelIdFromName(running.record.model));
  if (misnamed) {
    await running.shutdown(0);
    throw new UsageError(`--lora-modules ${misnamed.name}: base model "${misnamed.base}" is not this worker's (${running.record.model})`);
  }
  if (parent) {
    // The server reads the address. It closes the channel once it has drained its own requests: nothing is left to
    // finish here.
    parent.ready(running.address, workerId);
    await parent.closed;
    await running.shutdown(0);
    setTimeout(() => process.exit(0), 500).unref();
    return 0;
  }
  const graceMs = graceSeconds * 1000;
  // SIGHUP (the terminal closed) drains too, as `conduit serve` does.
  const signal = await signalled!;
  logger.info(`${signal}: draining`);
  for (const name of signals) process.once(name, () => process.exit(1));
  await running.shutdown(graceMs);
  setTimeout(() => process.exit(0), 500).unref();
  return 0;
}
