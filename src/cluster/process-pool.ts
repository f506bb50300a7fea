// `conduit serve --workers N --worker-processes`: the N workers are child processes (`conduit worker --parent-ipc`)
// reached over the request plane on loopback, instead of threads of the server's process. No etcd or NATS: each
// child reports its address over the IPC channel, and its KV events come on its connection. A worker that dies, a
// native crash included, takes only its own process down: its connection drops, its requests fail as worker_lost
// at once (migrating when --migration-limit allows), and the worker group starts a new process in its place
// (--worker-restart-limit, --worker-restart-delay), as it restarts a dead thread.
//
// The server alone decides when its children stop. Each child runs in a process group (and session) of its own, so a
// terminal's Ctrl-C, sent to the server's foreground group, reaches the server only; a child ignores SIGINT, SIGTERM
// and SIGHUP (as a service manager may send them to every process of its unit) and stops when its IPC channel closes:
// the server closes it once its own drain (--shutdown-grace) is over, and a server that dies closes it too. A child
// takes its settings from its command line alone, never from the twins of the worker's options in the environment
// it inherits (`conduit worker --parent-ipc`), and one that cannot start sends the server its reason over the channel.
//
// With --prefill-workers P --decode-workers D (cpu workers) the children run `--role prefill` and `--role decode`, and
// the server's engine is the disaggregated one of a frontend (remote-disagg.ts): each decode worker pulls the KV of a
// handed-off request straight from the prefill worker's KV port (through /dev/shm, or loopback TCP where that is not
// usable: the link's own choice, kv-tcp.ts). A lost child is not restarted
// there; a decode worker lost mid-stream migrates its requests (--migration-limit), a lost prefill worker's requests
// are prefilled again.

import { fork, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { engineNow } from '../engine/clock.ts';
import { EngineStartError } from '../engine/errors.ts';
import type { EngineInfo, EngineOutput, EngineRequest, LoraLoadInfo, WorkerRole } from '../engine/types.ts';
import { ChatTemplate } from '../model/chat-template.ts';
import { tokenizerFromWorkerSource } from '../model/tokenizer/worker-source.ts';
import type { Tokenizer, TokenizerWorkerSource } from '../model/tokenizer/types.ts';
import type { KvEvent } from '../protocols/kv-events.ts';
import type { EngineStats } from '../protocols/worker.ts';
import type { Router } from '../router/router.ts';
import { RoutedEngine } from '../runtime/routed-engine.ts';
import type { RoutableEngine, WorkerGroupLog } from '../runtime/worker-group.ts';
import { makeRouter, withDiskTierLock, type WorkerPoolOptions } from '../runtime/worker-pool.ts';
import { infoNotice, parseLogLine, warnNotice, type LogLevel, type Notice } from '../util/log.ts';
import { RemoteEngine } from './remote-engine.ts';
import { remoteDisaggregatedEngine, type RemoteDisaggregatedEngine } from './remote-disagg.ts';

const CONDUIT_BIN = fileURLToPath(new URL('../../bin/conduit.js', import.meta.url));
/** A child has this long to load its model and report its address. */
const CHILD_START_TIMEOUT_MS = 300_000;

export interface ProcessPoolOptions extends WorkerPoolOptions {
  /**
   * The children's log lines go here, each at the level the child logged it, its message prefixed with the worker id;
   * any other output of theirs (a crash's stack, Node's own warnings) at warn.
   */
  childLog?: (level: Exclude<LogLevel, 'silent'>, message: string) => void;
  /** The level the children log at (--log-level; default: CONDUIT_LOG_LEVEL, else warn). */
  logLevel?: LogLevel;
}

/** One child process and its connection, as the router holds a worker. */
export class ChildWorker implements RoutableEngine {
  /** Resolves when the process has exited. */
  readonly exited: Promise<void>;

  constructor(readonly id: string, private readonly child: ChildProcess, readonly remote: RemoteEngine) {
    this.exited = child.exitCode !== null || child.signalCode !== null ? Promise.resolve()
      : new Promise((resolve) => child.once('exit', () => resolve()));
    // A child whose connection is lost (it crashed, or hung past the heartbeat timeout) is never used again: its
    // requests have failed or moved, and a replacement may start. One that hung would otherwise keep its model and
    // KV pool in memory until the server exits.
    remote.onLost(() => {
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
    });
  }

  get info(): EngineInfo { return this.remote.info; }
  get pid(): number | undefined { return this.child.pid; }
  get address(): string { return this.remote.address; }
  get lost(): boolean { return this.remote.lost; }
  generate(request: EngineRequest): AsyncIterable<EngineOutput> { return this.remote.generate(request); }
  abort(requestId: string): void { this.remote.abort(requestId); }
  stats(): EngineStats { return this.remote.stats(); }
  resetPrefixCache(): Promise<boolean> { return this.remote.resetPrefixCache(); }
  loadLora(name: string, path: string): Promise<LoraLoadInfo> { return this.remote.loadLora(name, path); }
  unloadLora(name: string): Promise<void> { return this.remote.unloadLora(name); }
  onKvEvents(listener: (events: KvEvent[]) => void): () => void { return this.remote.onKvEvents(listener); }
  onLost(listener: (error: Error) => void): () => void { return this.remote.onLost(listener); }
  onStats(listener: (stats: EngineStats) => void): () => void { return this.remote.onStats(listener); }
  get statsReported(): boolean { return this.remote.statsReported; }
  modelCard(): ReturnType<RemoteEngine['modelCard']> { return this.remote.modelCard(); }

  async close(): Promise<void> {
    await this.remote.close();
    if (this.child.exitCode === null && this.child.signalCode === null) {
      const exited = new Promise<void>((resolve) => this.child.once('exit', () => resolve()));
      // The child stops when its channel closes (it ignores the usual signals).
      if (this.child.connected) this.child.disconnect();
      const timer = setTimeout(() => this.child.kill('SIGKILL'), 5000);
      await exited;
      clearTimeout(timer);
    }
  }
}

/**
 * The place a child stands in: its id without the suffix a restart adds (worker-1-r2 stands in for worker-1, the name
 * WorkerGroup gives the replacement). A replacement keeps its place's disk tier folder, as a restarted worker thread
 * keeps its slot's: the blocks written there are found again, the folder stays within --kv-offload-disk-size, and it
 * is one of the worker folders the next start recognizes (a worker-1-r2 folder would be neither read nor removed).
 */
function slotOf(id: string): string {
  return id.replace(/-r\d+$/, '');
}

/** The worker flags of `conduit worker` that rebuild the pool's engine in a child. */
function childArgs(options: ProcessPoolOptions, id: string, threads: number, role: WorkerRole): string[] {
  const args = ['worker', '--parent-ipc', '--worker-id', id, '--host', '127.0.0.1', '--port', '0', '--engine', options.engine,
    '--threads', String(threads), '--shutdown-grace', '0', '--role', role];
  const workers = (options.prefillWorkers ?? 0) + (options.decodeWorkers ?? 0) || options.workers;
  const add = (flag: string, value: string | number | undefined): void => {
    if (value !== undefined) args.push(`--${flag}`, String(value));
  };
  add('model', options.modelPath);
  add('served-model-name', options.servedModelName);
  add('backend', options.backend);
  add('lora-dtype', options.loraDtype);
  add('kv-cache-memory', options.kvCacheMemoryBytes);
  add('kv-cache-dtype', options.kvDtype ?? 'auto');
  add('kv-cache-idle-release', options.kvCacheIdleReleaseSeconds);
  // A child is one worker: the pool's totals are split here as a pool of threads splits them, and each child's disk
  // tier gets a folder of its own (the folder's lock keeps a second process out).
  if (options.kvOffloadMemoryBytes !== undefined) add('kv-offload-memory', Math.floor(options.kvOffloadMemoryBytes / workers));
  if (options.kvOffloadDiskDir !== undefined) {
    add('kv-offload-disk', join(options.kvOffloadDiskDir, slotOf(id)));
    add('kv-offload-disk-size', Math.floor((options.kvOffloadDiskBytes ?? 0) / workers));
  }
  add('scheduling-policy', options.policy);
  add('max-num-seqs', options.maxNumSeqs);
  add('max-num-batched-tokens', options.maxNumBatchedTokens);
  add('max-model-len', options.maxModelLen);
  // Booleans said either way, as every setting the server resolved: the child reads no worker option from its
  // environment, and a default is the server's default only.
  args.push(options.enablePrefixCaching === false ? '--no-enable-prefix-caching' : '--enable-prefix-caching');
  if (options.guidedJumpForward !== undefined) args.push(options.guidedJumpForward ? '--guided-jump-forward' : '--no-guided-jump-forward');
  add('stream-interval', options.streamInterval);
  if (options.sim) {
    add('sim-model', options.sim.model);
    add('sim-gpu', options.sim.gpu);
    add('sim-tp', options.sim.tp);
    add('sim-lora-rank', options.sim.loraRank);
    add('sim-speed-up', options.sim.speedUp === Infinity ? 'inf' : options.sim.speedUp);
    add('sim-calibration', options.sim.calibration);
  }
  return args;
}

/**
 * Why a child that exited before it was ready did, from its output when it sent no reason (a crash): its last error
 * line (an uncaught error's "Name: message", or its one-line report), else its last lines, stack frames left out.
 */
function exitReason(output: string): string {
  const lines = output.split('\n').map((line) => line.trimEnd()).filter((line) => line.trim() !== '' && !/^\s+at /.test(line) && !/^Node\.js v/.test(line));
  const error = lines.findLast((line) => /^(conduit worker: |[A-Za-z]*Error\b)/.test(line));
  return error ?? lines.slice(-3).join(' | ');
}

/** Starts one child worker and connects to it. */
export function startChildWorker(options: ProcessPoolOptions, id: string, token: string, threads: number, role: WorkerRole = 'both'): Promise<ChildWorker> {
  const child = fork(CONDUIT_BIN, childArgs(options, id, threads, role), {
    // The child inherits this process's environment, where of the worker's options it reads only the token and the
    // log level set here, and CONDUIT_KV_TRANSFER_LINK. The token travels there, not on the command line (where ps
    // shows it).
    env: { ...process.env, CONDUIT_CLUSTER_TOKEN: token, CONDUIT_LOG_LEVEL: options.logLevel ?? process.env.CONDUIT_LOG_LEVEL ?? 'warn' },
    stdio: ['ignore', 'pipe', 'pipe', 'ipc'],
    // A process group of its own: see the top of this file.
    detached: true,
  });
  let tail = '';
  const forward = (line: string): void => {
    if (!line.trim()) return;
    const logged = parseLogLine(line);
    if (logged) options.childLog?.(logged.level, `[${id}] ${logged.message}`);
    else options.childLog?.('warn', `[${id}] ${line}`);
  };
  // Whole lines only: a line the pipe delivers in two chunks is forwarded once, at its level.
  for (const stream of [child.stdout!, child.stderr!]) {
    stream.setEncoding('utf8');
    let partial = '';
    stream.on('data', (text: string) => {
      tail = (tail + text).slice(-4000);
      const lines = (partial + text).split('\n');
      partial = lines.pop()!;
      for (const line of lines) forward(line);
    });
    stream.on('end', () => forward(partial));
  }
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new EngineStartError(`worker process ${id} did not start within ${CHILD_START_TIMEOUT_MS / 1000} s`));
    }, CHILD_START_TIMEOUT_MS);
    // The reason the child sent (see `conduit worker --parent-ipc`), which comes before its channel closes.
    let failure: string | undefined;
    // 'close', not 'exit': the channel's last message and the output are read by then.
    const onClose = (code: number | null, signal: string | null): void => {
      clearTimeout(timer);
      reject(new EngineStartError(failure !== undefined ? `worker process ${id} could not start: ${failure}`
        : `worker process ${id} exited (${signal ?? `code ${code}`}) before it was ready: ${exitReason(tail)}`));
    };
    child.once('close', onClose);
    child.on('message', (message: { type?: string; address?: string; message?: string }) => {
      if (message?.type === 'failed' && typeof message.message === 'string') failure = message.message;
      if (message?.type !== 'ready' || typeof message.address !== 'string') return;
      clearTimeout(timer);
      child.off('close', onClose);
      RemoteEngine.connect(message.address, { clusterToken: token, events: true }).then(
        (remote) => resolve(new ChildWorker(id, child, remote)),
        (error: Error) => {
          child.kill('SIGKILL');
          reject(error);
        });
    });
  });
}

/** The routed engine over child processes; /health lists them with their process ids. */
export class ProcessPoolEngine extends RoutedEngine {
  workerList(): { id: string; pid: number | undefined; address: string; state: string; running: number; waiting: number }[] {
    return this.workerIds.map((id) => {
      const worker = this.workerEngine(id) as ChildWorker;
      const stats = worker.stats();
      return { id, pid: worker.pid, address: worker.address, state: worker.lost ? 'lost' : 'ready', running: stats.numRunning, waiting: stats.numWaiting };
    });
  }
}

export interface ProcessPool {
  engine: ProcessPoolEngine | RemoteDisaggregatedEngine;
  router?: Router;
  tokenizer: Tokenizer;
  chatTemplate: ChatTemplate;
  workers: { id: string; engine: ChildWorker; role?: WorkerRole }[];
  notices: Notice[];
  /** Never set: WorkerPool.clock's shared simulated clock exists only for workers that live in one process. */
  clock?: undefined;
  holdClock?: undefined;
}

/** The tokenizer and chat template of the children's model, from the first child's model card. */
async function modelOf(worker: ChildWorker): Promise<{ tokenizer: Tokenizer; chatTemplate: ChatTemplate }> {
  const card = await worker.modelCard();
  if (!card) throw new Error('the first worker process sent no model card');
  const tokenizer = tokenizerFromWorkerSource(card.tokenizer as TokenizerWorkerSource);
  const { templates, bosToken, eosToken, isFallback } = card.chatTemplate;
  return { tokenizer, chatTemplate: new ChatTemplate({ templates: new Map(templates), bosToken, eosToken }, isFallback) };
}

/** Starts every child (ids and roles given); if one fails, the others are stopped and its error is thrown. */
async function startChildren(options: ProcessPoolOptions, specs: { id: string; role: WorkerRole }[], token: string, threads: number):
  Promise<{ id: string; engine: ChildWorker; role: WorkerRole }[]> {
  const settled = await Promise.allSettled(specs.map(({ id, role }) => startChildWorker(options, id, token, threads, role)));
  const workers = settled.flatMap((s, i) => s.status === 'fulfilled' ? [{ ...specs[i]!, engine: s.value }] : []);
  const failure = settled.find((s): s is PromiseRejectedResult => s.status === 'rejected');
  if (failure) {
    await Promise.all(workers.map((w) => w.engine.close()));
    throw failure.reason;
  }
  return workers;
}

/** Prefill and decode workers as child processes behind the disaggregated engine a frontend uses. */
async function createProcessDisaggregatedPool(options: ProcessPoolOptions, log?: WorkerGroupLog): Promise<ProcessPool> {
  const numPrefill = options.prefillWorkers ?? 0;
  const numDecode = options.decodeWorkers ?? 0;
  for (const [name, value] of [['prefillWorkers', numPrefill], ['decodeWorkers', numDecode]] as const) {
    if (!Number.isInteger(value) || value < 1) throw new RangeError(`${name} must be a whole number >= 1, got ${value}`);
  }
  if (options.engine !== 'cpu') throw new Error('disaggregated worker processes run cpu workers (simulated ones have no KV to move)');
  const token = randomBytes(32).toString('hex');
  const threads = options.threads ?? Math.max(1, Math.floor((await import('node:os')).availableParallelism() / (numPrefill + numDecode)));
  const workers = await startChildren(options, [
    ...Array.from({ length: numPrefill }, (_, i) => ({ id: `prefill-${i}`, role: 'prefill' as const })),
    ...Array.from({ length: numDecode }, (_, i) => ({ id: `decode-${i}`, role: 'decode' as const })),
  ], token, threads);
  let engine: RemoteDisaggregatedEngine;
  let model: { tokenizer: Tokenizer; chatTemplate: ChatTemplate };
  try {
    model = await modelOf(workers[0]!.engine);
    const remotes = (role: WorkerRole) => workers.filter((w) => w.role === role).map((w) => w.engine.remote);
    engine = remoteDisaggregatedEngine({
      prefill: remotes('prefill'), decode: remotes('decode'),
      ...(options.routingPolicy !== undefined ? { routingPolicy: options.routingPolicy } : {}),
      ...(options.routerSeed !== undefined ? { routerSeed: options.routerSeed } : {}),
      ...(options.maxQueued !== undefined ? { maxQueued: options.maxQueued } : {}),
      ...(options.disaggregationPolicy ? { policy: options.disaggregationPolicy } : {}),
      ...(options.disaggregationEstimates ? { estimates: options.disaggregationEstimates } : {}),
      migration: { limit: options.migrationLimit ?? 0, tokenizer: model.tokenizer },
      ...(log ? { log } : {}),
      // Said as it is: --worker-restart-limit (default 3) restarts aggregated children only, so "restarts are off"
      // would send the reader to an option that is already on.
      notRestarted: { reason: '--worker-processes never restarts prefill or decode workers; --worker-restart-limit is for aggregated ones', level: 'error' },
      // A lost child (not restarted in this mode) keeps its place in the list, but its last stats are those of the
      // moment it died: the requests they count have failed or moved on since. It is listed without them, as a
      // frontend lists a lost worker.
      workerList: () => workers.map(({ id, role, engine: w }) => {
        if (w.lost) return { id, role, pid: w.pid, address: w.address, state: 'lost' };
        const stats = w.stats();
        return { id, role, pid: w.pid, address: w.address, state: 'ready', running: stats.numRunning, waiting: stats.numWaiting };
      }),
    });
  } catch (error) {
    await Promise.all(workers.map((w) => w.engine.close()));
    throw error;
  }
  // Closing the engine closes the connections; the children are stopped after them.
  const close = engine.close.bind(engine);
  engine.close = async () => {
    try {
      await close();
    } finally {
      await Promise.all(workers.map((w) => w.engine.close()));
    }
  };
  const restarts = (options.workerRestartLimit ?? 0) > 0
    ? [warnNotice('--worker-restart-limit: lost prefill or decode worker processes are not restarted (their requests migrate)')] : [];
  return {
    engine, ...model, workers,
    notices: [...restarts, infoNotice(`${numPrefill} prefill + ${numDecode} decode worker processes (pids ${workers.map((w) => w.engine.pid).join(', ')}), `
      + 'request plane and KV transfers on loopback')],
  };
}

export async function createProcessWorkerPool(options: ProcessPoolOptions, log?: WorkerGroupLog): Promise<ProcessPool> {
  // The server holds the disk tier's folder; each child its own subfolder in it.
  const create = () => options.prefillWorkers !== undefined || options.decodeWorkers !== undefined
    ? createProcessDisaggregatedPool(options, log) : createProcessAggregatedPool(options, log);
  // Each child's subfolder is named by its place (its first id, which a replacement keeps: slotOf).
  const ids = options.prefillWorkers !== undefined || options.decodeWorkers !== undefined
    ? [...Array.from({ length: options.prefillWorkers ?? 0 }, (_, i) => `prefill-${i}`), ...Array.from({ length: options.decodeWorkers ?? 0 }, (_, i) => `decode-${i}`)]
    : Array.from({ length: options.workers }, (_, i) => `worker-${i}`);
  return options.engine === 'cpu' ? withDiskTierLock(options.kvOffloadDiskDir, create, ids) : create();
}

async function createProcessAggregatedPool(options: ProcessPoolOptions, log?: WorkerGroupLog): Promise<ProcessPool> {
  const count = options.workers;
  if (!Number.isInteger(count) || count < 1) throw new RangeError(`workers must be a whole number >= 1, got ${count}`);
  const token = randomBytes(32).toString('hex');
  const threads = options.threads ?? Math.max(1, Math.floor((await import('node:os')).availableParallelism() / count));
  const workers = (await startChildren(options, Array.from({ length: count }, (_, i) => ({ id: `worker-${i}`, role: 'both' as const })), token, threads))
    .map(({ id, engine }) => ({ id, engine }));
  // The child standing in each place: a replacement starts once the process it replaces has exited (a lost child is
  // killed), since it takes over that one's disk tier folder and its lock.
  const current = new Map(workers.map(({ id, engine }) => [id, engine]));
  const restartChild = async (id: string): Promise<ChildWorker> => {
    await current.get(slotOf(id))?.exited;
    const child = await startChildWorker(options, id, token, threads);
    current.set(slotOf(id), child);
    return child;
  };
  const { tokenizer, chatTemplate } = await modelOf(workers[0]!.engine);
  const router = makeRouter(options, workers[0]!.engine.info.blockSize, 0);
  const limit = options.workerRestartLimit ?? 0;
  const engine = new ProcessPoolEngine(workers, router, engineNow, {
    migration: { limit: options.migrationLimit ?? 0, ...(options.engine === 'cpu' ? { tokenizer } : {}) },
    ...(limit > 0 ? {
      restart: {
        limit, start: restartChild,
        ...(options.workerRestartDelayMs !== undefined ? { baseDelayMs: options.workerRestartDelayMs } : {}),
      },
    } : {}),
    ...(log ? { log } : {}),
  });
  return {
    engine, router, tokenizer, chatTemplate, workers,
    notices: [infoNotice(`${count} worker process${count === 1 ? '' : 'es'} (pids ${workers.map((w) => w.engine.pid).join(', ')}), request plane on loopback`)],
  };
}
