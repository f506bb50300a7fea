// Builds what `conduit serve` serves: one engine, or N workers behind the router, of the real CPU engine (each
// worker its own thread, KV pool and scheduler) or of the simulated GPU engine. The gateway gets an `Engine` either
// way, plus the tokenizer and chat template it applies at the edge.

import { availableParallelism } from 'node:os';
import { join } from 'node:path';
import { acquireDiskTierLock, removeUnusedWorkerFolders } from '../engine/kv-cache/disk-tier.ts';
import { engineNow } from '../engine/clock.ts';
import { createLocalEngine, LocalEngine, type LocalEngineOptions } from '../engine/local-engine.ts';
import type { Engine, WorkerRole } from '../engine/types.ts';
import { chatTemplateFromGguf, type ChatTemplate } from '../model/chat-template.ts';
import { readGguf } from '../model/gguf.ts';
import { LLAMA_SPM_TOKENIZER_PATH } from '../model/synthetic.ts';
import { GrammarLoader } from '../engine/grammar/runtime.ts';
import { createTokenizer } from '../model/tokenizer/index.ts';
import type { Tokenizer } from '../model/tokenizer/types.ts';
import type { PolicyName } from '../router/protocols.ts';
import { infoNotice, type Notice } from '../util/log.ts';
import { seededRandom } from '../util/random.ts';
import { Router } from '../router/router.ts';
import { BitsetKvIndex } from '../router/kv-index.ts';
import { calibrationEfficiency, DEFAULT_CALIBRATION, type CalibrationName } from '../sim/calibration.ts';
import { kvTransferTimeMs, stepTimeMs } from '../sim/perf-model.ts';
import { kvBytesPerToken } from '../sim/models.ts';
import { resolveSimDeployment, SIM_DEFAULTS } from '../sim/sim-worker.ts';
import { SimClockHolds, SimEngine } from '../sim/sim-engine.ts';
import type { DisaggregationPolicy } from './disaggregation-policy.ts';
import {
  DisaggregatedEngine, type DecodeWorkerEngine, type DisaggregationEstimates, type PrefillWorkerEngine,
} from './disaggregated.ts';
import { SharedMemoryKvChannel, SimulatedKvChannel } from './kv-transfer.ts';
import { DEFAULT_MIGRATION_LIMIT, type MigrationOptions } from './migration.ts';
import { RoutedEngine, type RoutedWorker } from './routed-engine.ts';
import { SupervisedEngine } from './supervised-engine.ts';
import type { RoutableEngine, WorkerGroupLog, WorkerRestartOptions } from './worker-group.ts';

export interface SimWorkerSpec {
  /** A model profile id (llama-3.1-8b, llama-3.1-70b ...). */
  model: string;
  gpu: string;
  tp: number;
  /** Simulated ms per real ms (Infinity = as fast as possible). */
  speedUp: number;
  /** Efficiency factors of the performance model (default DEFAULT_CALIBRATION, src/sim/calibration.ts). */
  calibration?: CalibrationName;
  /** Rank of LoRA adapters named without a file (src/sim/sim-lora.ts; default 16). */
  loraRank?: number;
}

export interface WorkerPoolOptions extends Omit<LocalEngineOptions, 'modelPath' | 'enableKvEvents' | 'kvOffload'> {
  /** RAM tier under the cpu workers' KV pools, bytes for all of them together (split evenly). */
  kvOffloadMemoryBytes?: number;
  /**
   * Disk tier folder (locked for this process; each cpu worker gets a subfolder worker-<slot>) and its size for all
   * workers together (split evenly).
   */
  kvOffloadDiskDir?: string;
  kvOffloadDiskBytes?: number;
  engine: 'cpu' | 'sim';
  workers: number;
  /** The model file for cpu workers. */
  modelPath?: string;
  sim?: SimWorkerSpec;
  routingPolicy?: PolicyName;
  /** Router admission: queue bound when every worker is busy (then 503). */
  maxQueued?: number;
  /** Seed of the router's tie-breaking (default: random). */
  routerSeed?: number;
  /**
   * How many times a request may move to another worker when its worker is lost mid-stream (default 0: it
   * fails, as Dynamo's migration_limit defaults to). Aggregated workers and decode workers; see migration.ts.
   */
  migrationLimit?: number;
  /**
   * Disaggregated serving: this many prefill workers and decode workers (each at least 1) instead of `workers`
   * aggregated ones. Prompts run on prefill workers and their KV moves to decode workers (shared memory for cpu
   * workers, a modelled link for sim workers), or run on the decode worker when the policy says so.
   */
  prefillWorkers?: number;
  decodeWorkers?: number;
  /** Conditional disaggregation thresholds (see src/runtime/disaggregation-policy.ts). */
  disaggregationPolicy?: Partial<DisaggregationPolicy>;
  /**
   * Starting (or, with fixed, constant) transfer and prefill throughput estimates for that policy, and how often a
   * transfer-slower verdict is tested (DisaggregationEstimates). Unset fields of simulated workers start from their
   * link and performance model (simDisaggregationEstimates).
   */
  disaggregationEstimates?: DisaggregationEstimates;
  /**
   * Restart attempts in a row for a cpu worker whose thread died (default 0: a lost worker stays lost); see
   * worker-group.ts. One cpu worker is a SupervisedEngine's, restarts on or off (off, its loss is still reported).
   */
  workerRestartLimit?: number;
  /** Wait before the first restart attempt, ms, doubled per further attempt (default 500). */
  workerRestartDelayMs?: number;
  /** Where lost workers and restarts are reported. */
  log?: WorkerGroupLog;
}

export interface WorkerPool {
  engine: Engine;
  tokenizer: Tokenizer;
  chatTemplate: ChatTemplate;
  /** Set when more than one worker: the router and the workers' ids. */
  routed?: RoutedEngine;
  router?: Router;
  /**
   * The individual workers as built (one entry when not routed); role is set in a disaggregated pool. A restarted
   * worker replaces its entry in the routed engine, not here: ask the engine (workerIds, workerStats) for the live ones.
   */
  workers: { id: string; engine: Engine; role?: WorkerRole }[];
  notices: Notice[];
  /** Set for one cpu worker. */
  supervised?: SupervisedEngine;
  /**
   * The clock the engine's stamps are on, when it is not the engine clock (engineNow): simulated workers at a
   * speed-up other than 1. The gateway must stamp with it too (ModelBackend.clock), so a request has one clock.
   */
  clock?: () => number;
  /**
   * Simulated workers at speed-up Infinity: holds the pool's clock until the function returned is called
   * (SimClockHolds). The gateway holds it while it works on a request (ModelBackend.holdClock).
   */
  holdClock?: () => () => void;
  /** Set in a disaggregated pool (prefillWorkers/decodeWorkers): the engine, and its two routers. */
  disaggregated?: DisaggregatedEngine;
  prefillRouter?: Router;
  decodeRouter?: Router;
}

export async function createWorkerPool(options: WorkerPoolOptions): Promise<WorkerPool> {
  if (options.engine !== 'cpu') return createPool(options);
  // The subfolders DiskSlots hands out: worker-<slot>, one slot per worker.
  const workers = options.prefillWorkers !== undefined || options.decodeWorkers !== undefined
    ? (options.prefillWorkers ?? 0) + (options.decodeWorkers ?? 0) : options.workers;
  return withDiskTierLock(options.kvOffloadDiskDir, () => createPool(options), Array.from({ length: workers }, (_, i) => `worker-${i}`));
}

/**
 * One process per disk tier folder: a second server pointed at it is refused before any worker starts. The lock is
 * held until the pool's engine closes. `folders`: the per-worker subfolders the pool uses; those of workers a run
 * with more of them left are removed once the folder is held (said in the pool's notices).
 */
export async function withDiskTierLock<P extends { engine: { close(): Promise<void> }; notices?: Notice[] }>(dir: string | undefined,
  create: () => Promise<P>, folders?: readonly string[]): Promise<P> {
  if (dir === undefined) return create();
  const release = acquireDiskTierLock(dir);
  let pool: P;
  let removed: string[] = [];
  try {
    if (folders !== undefined) removed = removeUnusedWorkerFolders(dir, folders);
    pool = await create();
  } catch (error) {
    release();
    throw error;
  }
  if (removed.length > 0) {
    // A pool's notices (a thread pool's are its first engine's); a bare engine bundle's are its engine's.
    (pool.notices ?? (pool.engine as { notices?: Notice[] }).notices)?.push(
      infoNotice(`KV disk tier ${dir}: removed ${removed.join(', ')}, left by a run with more workers (no worker here reads them)`));
  }
  const engine = pool.engine;
  const close = engine.close.bind(engine);
  engine.close = async () => {
    try {
      await close();
    } finally {
      release();
    }
  };
  return pool;
}

async function createPool(options: WorkerPoolOptions): Promise<WorkerPool> {
  if (options.prefillWorkers !== undefined || options.decodeWorkers !== undefined) return createDisaggregatedPool(options);
  if (!Number.isInteger(options.workers) || options.workers < 1) {
    throw new RangeError(`workers must be a whole number >= 1, got ${options.workers}`);
  }
  const routedMode = options.workers > 1;
  const built = options.engine === 'sim' ? await simWorkers(options, routedMode) : await cpuWorkers(options, routedMode);
  const blockSize = built.workers[0]!.engine.info.blockSize;
  const now = ('clock' in built ? built.clock : undefined) ?? engineNow;
  const policy = restartPolicy(options, built.start !== undefined);
  const restart = policy && built.start ? { ...policy, start: built.start } : undefined;
  if (!routedMode) {
    const only = built.workers[0]!;
    // A worker that cannot be lost (a simulated one) needs no supervision. A cpu worker's thread can die: even with
    // restarts off, its group says so (/health 503 with the reason, a log line) and refuses requests with a 503,
    // where the bare engine would look ready and fail each request with a 500.
    if (!built.start) return { ...built, engine: only.engine };
    const supervised = new SupervisedEngine(only.id, only.engine, makeRouter(options, blockSize, 0), now, restart, options.log);
    return { ...built, engine: supervised, supervised };
  }
  const router = makeRouter(options, blockSize, 0);
  const routed = new RoutedEngine(built.workers as RoutedWorker[], router, now, {
    migration: migrationOptions(options, built.tokenizer),
    ...(restart ? { restart } : {}), ...(options.log ? { log: options.log } : {}),
  });
  return { ...built, engine: routed, routed, router };
}

/**
 * Restarts of lost workers, when asked for and the workers can be started again (cpu workers; sim workers are never
 * lost).
 */
function restartPolicy(options: WorkerPoolOptions, canRestart: boolean): Omit<WorkerRestartOptions<never>, 'start'> | undefined {
  const limit = options.workerRestartLimit ?? 0;
  if (!Number.isInteger(limit) || limit < 0) throw new RangeError(`worker restart limit must be a whole number >= 0, got ${limit}`);
  if (limit === 0 || !canRestart) return undefined;
  return { limit, ...(options.workerRestartDelayMs !== undefined ? { baseDelayMs: options.workerRestartDelayMs } : {}) };
}

/**
 * CPU workers detokenize with the gateway's tokenizer, so a migrated request's text is carried on with it; the
 * simulated workers' text is their own, so theirs passes through.
 */
function migrationOptions(options: WorkerPoolOptions, tokenizer: Tokenizer): MigrationOptions {
  return { limit: options.migrationLimit ?? DEFAULT_MIGRATION_LIMIT, ...(options.engine === 'cpu' ? { tokenizer } : {}) };
}

async function cpuWorkers(options: WorkerPoolOptions, withKvEvents: boolean) {
  const modelPath = options.modelPath;
  if (!modelPath) throw new Error('cpu workers need a model path');
  // The machine's cores are shared: each worker gets its share unless told otherwise.
  const threads = options.threads ?? Math.max(1, Math.floor(availableParallelism() / options.workers));
  const slots = new DiskSlots(options, options.workers);
  const first = await slots.start((kvOffload) => createLocalEngine({ ...options, modelPath, threads, enableKvEvents: withKvEvents, ...kvOffload }),
    (bundle) => bundle.engine);
  const workers: RoutedWorker[] = [{ id: 'worker-0', engine: first.engine }];
  const start = (): Promise<RoutableEngine> => slots.start((kvOffload) => LocalEngine.start({
    ...options, modelPath, threads, servedModelName: first.engine.info.modelName, enableKvEvents: withKvEvents, ...kvOffload,
  }), (engine) => engine);
  try {
    for (let i = 1; i < options.workers; i++) workers.push({ id: `worker-${i}`, engine: await start() });
  } catch (error) {
    await Promise.all(workers.map((w) => w.engine.close()));
    throw error;
  }
  return { workers, tokenizer: first.tokenizer, chatTemplate: first.chatTemplate, notices: first.engine.notices, start };
}

/**
 * The cpu workers' lower KV tiers: each worker's even share of the RAM tier and of the disk tier's size, and a disk
 * subfolder of its own (worker-<slot>). A slot is held while its worker lives; a restarted worker takes the lowest
 * free one, so it finds the blocks its predecessor wrote (the lost thread can no longer write there).
 */
export class DiskSlots {
  private readonly held = new Set<number>();

  constructor(private readonly options: Pick<WorkerPoolOptions, 'kvOffloadMemoryBytes' | 'kvOffloadDiskDir' | 'kvOffloadDiskBytes'>,
    private readonly numWorkers: number) {}

  async start<T>(starter: (offload: Pick<LocalEngineOptions, 'kvOffload'>) => Promise<T>, engineOf: (started: T) => LocalEngine): Promise<T> {
    const memoryBytes = Math.floor((this.options.kvOffloadMemoryBytes ?? 0) / this.numWorkers);
    const dir = this.options.kvOffloadDiskDir;
    if (memoryBytes <= 0 && dir === undefined) return starter({});
    let slot = -1;
    if (dir !== undefined) {
      slot = 0;
      while (this.held.has(slot)) slot++;
      this.held.add(slot);
    }
    const free = () => this.held.delete(slot);
    const disk = dir === undefined ? {} : {
      diskDir: join(dir, `worker-${slot}`), diskBytes: Math.floor((this.options.kvOffloadDiskBytes ?? 0) / this.numWorkers),
    };
    let started: T;
    try {
      started = await starter({ kvOffload: { memoryBytes, ...disk } });
    } catch (error) {
      free();
      throw error;
    }
    if (slot >= 0) {
      const engine = engineOf(started);
      engine.onLost(free);
      const close = engine.close.bind(engine);
      engine.close = async () => {
        await close();
        free();
      };
    }
    return started;
  }
}

/**
 * Simulated workers have a performance profile but no tokenizer: the gateway tokenizes with the built-in model's
 * Llama 2 vocabulary, which gives realistic prompt lengths for English text. Their synthetic tokens are ids of that
 * vocabulary (its size and EOS), so the gateway can decode them (logprobs); the profile's own vocabulary still
 * prices the LM head.
 */
function simTokenizer() {
  const vocab = readGguf(LLAMA_SPM_TOKENIZER_PATH);
  const tokenizer = createTokenizer({ kind: 'gguf', file: vocab });
  const vocabulary = { vocabSize: tokenizer.vocabSize, ...(tokenizer.eosId !== undefined ? { eosTokenId: tokenizer.eosId } : {}) };
  return { tokenizer, chatTemplate: chatTemplateFromGguf(vocab, tokenizer), vocabulary };
}

/** What the simulated workers of one pool share: the profile, its calibration, the gateway's tokenizer, a maker. */
export function simPool(options: Pick<WorkerPoolOptions, 'sim' | 'maxNumSeqs' | 'maxNumBatchedTokens' | 'policy' | 'maxModelLen'
  | 'enablePrefixCaching' | 'prefillWorkers' | 'decodeWorkers' | 'kvOffloadMemoryBytes' | 'kvOffloadDiskDir' | 'kvOffloadDiskBytes'
  | 'servedModelName'>
  & Partial<Pick<WorkerPoolOptions, 'workers'>>) {
  const spec = options.sim;
  if (!spec) throw new Error('sim workers need a model profile and a GPU');
  const { model, hw } = resolveSimDeployment(spec.model, spec.gpu, spec.tp);
  const { tokenizer, chatTemplate, vocabulary } = simTokenizer();
  const calibration = spec.calibration ?? DEFAULT_CALIBRATION;
  const efficiency = calibrationEfficiency(calibration, hw);
  // Lower KV tiers modelled (host RAM over PCIe, NVMe) from the same flags as cpu workers' real ones, split evenly;
  // a simulated disk tier keeps nothing on disk (the folder is not used).
  const numWorkers = (options.prefillWorkers ?? 0) + (options.decodeWorkers ?? 0) || options.workers || 1;
  const ramBytes = Math.floor((options.kvOffloadMemoryBytes ?? 0) / numWorkers);
  const diskBytes = options.kvOffloadDiskDir !== undefined ? Math.floor((options.kvOffloadDiskBytes ?? 0) / numWorkers) : 0;
  const kvTiers = ramBytes > 0 || diskBytes > 0 ? { kvTiers: { ramBytes, diskBytes } } : {};
  // At a speed-up other than 1 the simulated clock is not the engine clock: the workers share one origin, and the
  // pool's clock (which the gateway stamps with, and the routers) is theirs, so a request's times are all simulated.
  // The origin is the engine clock's now, at every speed-up Infinity included: the times served as wall-clock Unix
  // milliseconds (a trace's arrival_unix_ms, the console's charts, OTLP spans) are then this start's date, not 1970,
  // and a simulated duration keeps a double's resolution at that magnitude (2^-12 ms, below the 3 decimals served).
  const speedUp = spec.speedUp;
  const origin = speedUp === 1 ? {} : { startMs: engineNow(), ...(Number.isFinite(speedUp) ? { realStartMs: performance.now() } : {}) };
  // Guided requests on simulated workers: the gateway's vocabulary under one grammar runtime for the pool.
  const grammar = new GrammarLoader(tokenizer);
  const engines: SimEngine[] = [];
  // Infinity: the gateway holds the clock while it works on a request (SimClockHolds).
  const clockHolds = Number.isFinite(speedUp) ? undefined : new SimClockHolds();
  // Infinity: each worker's clock moves with its own steps; the latest of them (one worker: its clock exactly).
  const clock = speedUp === 1 ? undefined : () => {
    let latest = -Infinity;
    for (const engine of engines) latest = Math.max(latest, engine.now());
    return latest;
  };
  const make = (worker: { enableKvEvents: boolean; role?: WorkerRole }) => {
    const engine = new SimEngine({
      model, hw, tp: spec.tp, efficiency, speedUp, ...worker, ...vocabulary, ...origin, ...kvTiers, tokenizer, grammar,
      ...(clock ? { poolClock: clock } : {}), ...(clockHolds ? { clockHolds } : {}),
      ...(spec.loraRank !== undefined ? { loraRank: spec.loraRank } : {}),
      maxNumSeqs: options.maxNumSeqs, maxNumBatchedTokens: options.maxNumBatchedTokens, policy: options.policy,
      maxModelLen: options.maxModelLen, enablePrefixCaching: options.enablePrefixCaching,
      // The name served, as cpu workers take it (--served-model-name, --model NAME=): a cluster worker's record
      // names the model by it.
      ...(options.servedModelName !== undefined ? { servedModelName: options.servedModelName } : {}),
    });
    engines.push(engine);
    return engine;
  };
  const describe = `simulated engine: ${spec.model} on ${spec.tp} x ${spec.gpu} per worker`;
  const settings = `speed-up ${spec.speedUp}, ${calibration} calibration`;
  const holdClock = clockHolds ? () => clockHolds.hold() : undefined;
  return { tokenizer, chatTemplate, make, describe, settings, clock, holdClock };
}

async function simWorkers(options: WorkerPoolOptions, withKvEvents: boolean) {
  const sim = simPool(options);
  const workers: RoutedWorker[] = Array.from({ length: options.workers },
    (_, i) => ({ id: `sim-${i}`, engine: sim.make({ enableKvEvents: withKvEvents }) }));
  return {
    workers, tokenizer: sim.tokenizer, chatTemplate: sim.chatTemplate, start: undefined,
    notices: [infoNotice(`${sim.describe} (${sim.settings})`)], ...(sim.clock ? { clock: sim.clock } : {}),
    ...(sim.holdClock ? { holdClock: sim.holdClock } : {}),
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Disaggregated pools

/** The router of a pool (also a cluster frontend's): policy, admission bound and seed from the pool's options. */
export function makeRouter(options: Pick<WorkerPoolOptions, 'routingPolicy' | 'maxQueued' | 'routerSeed'>, blockSize: number, seedOffset: number): Router {
  return new Router({
    blockSize, policy: options.routingPolicy ?? 'kv', maxQueued: options.maxQueued,
    random: seededRandom((options.routerSeed ?? Math.floor(Math.random() * 2 ** 32)) + seedOffset),
    clock: () => performance.now(),
    index: new BitsetKvIndex({ hashSeed: Math.floor(Math.random() * 2 ** 32) }),
  });
}

async function createDisaggregatedPool(options: WorkerPoolOptions): Promise<WorkerPool> {
  const numPrefill = options.prefillWorkers ?? 0;
  const numDecode = options.decodeWorkers ?? 0;
  for (const [name, value] of [['prefillWorkers', numPrefill], ['decodeWorkers', numDecode]] as const) {
    if (!Number.isInteger(value) || value < 1) throw new RangeError(`${name} must be a whole number >= 1, got ${value}`);
  }
  const built = options.engine === 'sim' ? await simRoleWorkers(options, numPrefill, numDecode)
    : await cpuRoleWorkers(options, numPrefill, numDecode);
  const blockSize = built.decode[0]!.engine.info.blockSize;
  const prefillRouter = makeRouter(options, blockSize, 0);
  const decodeRouter = makeRouter(options, blockSize, 1);
  const policy = restartPolicy(options, built.start !== undefined);
  const start = built.start;
  const engine = new DisaggregatedEngine({
    prefill: built.prefill, decode: built.decode, prefillRouter, decodeRouter,
    channel: options.engine === 'sim' ? new SimulatedKvChannel() : new SharedMemoryKvChannel(),
    // The estimates given, field by field over those the workers' model gives.
    policy: options.disaggregationPolicy, estimates: { ...built.estimates, ...definedFields(options.disaggregationEstimates ?? {}) },
    now: built.clock ?? engineNow,
    migration: migrationOptions(options, built.tokenizer),
    ...(policy && start ? { restart: { ...policy, startPrefill: () => start('prefill'), startDecode: () => start('decode') } } : {}),
    ...(options.log ? { log: options.log } : {}),
  });
  const workers = [
    ...built.prefill.map((w) => ({ ...w, role: 'prefill' as const })),
    ...built.decode.map((w) => ({ ...w, role: 'decode' as const })),
  ];
  return {
    engine, tokenizer: built.tokenizer, chatTemplate: built.chatTemplate, workers, notices: built.notices,
    disaggregated: engine, prefillRouter, decodeRouter, ...(built.clock ? { clock: built.clock } : {}),
    ...(built.holdClock ? { holdClock: built.holdClock } : {}),
  };
}

interface RoleWorkers {
  prefill: { id: string; engine: PrefillWorkerEngine }[];
  decode: { id: string; engine: DecodeWorkerEngine }[];
  tokenizer: Tokenizer;
  chatTemplate: ChatTemplate;
  notices: Notice[];
  /** The simulated clock, at a speed-up other than 1. */
  clock?: () => number;
  /** The simulated clock's holds, at speed-up Infinity (WorkerPool.holdClock). */
  holdClock?: () => () => void;
  /** Starts one more worker of a role (cpu workers, for restarts). */
  start?(role: 'prefill' | 'decode'): Promise<LocalEngine>;
  /** Starting estimates the workers' own model gives (simulated workers); the DisaggregatedEngine's defaults else. */
  estimates?: DisaggregationEstimates;
}

async function cpuRoleWorkers(options: WorkerPoolOptions, numPrefill: number, numDecode: number): Promise<RoleWorkers> {
  const modelPath = options.modelPath;
  if (!modelPath) throw new Error('cpu workers need a model path');
  const threads = options.threads ?? Math.max(1, Math.floor(availableParallelism() / (numPrefill + numDecode)));
  const slots = new DiskSlots(options, numPrefill + numDecode);
  const common = { ...options, modelPath, threads, enableKvEvents: true };
  const startRole = (role: WorkerRole, servedModelName: string) =>
    slots.start((kvOffload) => LocalEngine.start({ ...common, ...kvOffload, servedModelName, role }), (engine) => engine);
  const first = await slots.start((kvOffload) => createLocalEngine({ ...common, ...kvOffload, role: 'decode' }), (bundle) => bundle.engine);
  const started: LocalEngine[] = [first.engine];
  const decode = [{ id: 'decode-0', engine: first.engine }];
  const prefill: RoleWorkers['prefill'] = [];
  try {
    const servedModelName = first.engine.info.modelName;
    for (let i = 1; i < numDecode; i++) {
      const engine = await startRole('decode', servedModelName);
      started.push(engine);
      decode.push({ id: `decode-${i}`, engine });
    }
    for (let i = 0; i < numPrefill; i++) {
      const engine = await startRole('prefill', servedModelName);
      started.push(engine);
      prefill.push({ id: `prefill-${i}`, engine });
    }
  } catch (error) {
    await Promise.all(started.map((engine) => engine.close()));
    throw error;
  }
  const servedModelName = first.engine.info.modelName;
  return {
    prefill, decode, tokenizer: first.tokenizer, chatTemplate: first.chatTemplate,
    start: (role) => startRole(role, servedModelName),
    notices: [...first.engine.notices, infoNotice(`disaggregated: ${numPrefill} prefill + ${numDecode} decode workers, KV over shared memory`)],
  };
}

async function simRoleWorkers(options: WorkerPoolOptions, numPrefill: number, numDecode: number): Promise<RoleWorkers> {
  const sim = simPool(options);
  const make = (role: WorkerRole) => sim.make({ enableKvEvents: true, role });
  const prefill = Array.from({ length: numPrefill }, (_, i) => ({ id: `sim-prefill-${i}`, engine: make('prefill') }));
  const decode = Array.from({ length: numDecode }, (_, i) => ({ id: `sim-decode-${i}`, engine: make('decode') }));
  return {
    prefill, decode, tokenizer: sim.tokenizer, chatTemplate: sim.chatTemplate, ...(sim.clock ? { clock: sim.clock } : {}),
    ...(sim.holdClock ? { holdClock: sim.holdClock } : {}),
    estimates: simDisaggregationEstimates(decode[0]!.engine, options.maxNumBatchedTokens),
    notices: [infoNotice(`${sim.describe}, ${numPrefill} prefill + ${numDecode} decode workers, KV over `
      + `${decode[0]!.engine.kvLink.name} (${sim.settings})`)],
  };
}

function definedFields<T extends object>(value: T): Partial<T> {
  return Object.fromEntries(Object.entries(value).filter(([, v]) => v !== undefined)) as Partial<T>;
}

/**
 * What the policy's estimates start from for simulated workers: what their model says, not the CPU engine's priors
 * (a CPU memcpy's 2 GB/s against an InfiniBand link's 40 would keep prompts local that the link moves several times
 * faster than the decode worker computes them). Both for one full prefill step of `stepTokens` prompt tokens (the
 * step budget, the simulated workers' default when not given) on the decode worker: the performance model's time to compute them from an empty cache, and the
 * time their KV takes over the decode worker's kvLink (kvTransferTimeMs, its parallel links and comm efficiency),
 * in the bytes per token simulated transfers report. Measured prefills and transfers refine them from there.
 */
export function simDisaggregationEstimates(decode: SimEngine, stepTokens: number = SIM_DEFAULTS.maxNumBatchedTokens): Required<Pick<DisaggregationEstimates, 'transferBytesPerSec' | 'prefillTokensPerSec'>> {
  const { model, hw, tp, efficiency, kvLink, kvParallelLinks } = decode.worker;
  const prefillMs = stepTimeMs({ prefillTokens: [{ newTokens: stepTokens, contextLen: 0 }], decodeSeqs: [] }, model, hw, tp, efficiency);
  const transferMs = kvTransferTimeMs(stepTokens, model, kvLink, { parallelLinks: kvParallelLinks, efficiency: efficiency.commEfficiency });
  return {
    transferBytesPerSec: (stepTokens * kvBytesPerToken(model)) / (transferMs / 1000),
    prefillTokensPerSec: stepTokens / (prefillMs / 1000),
  };
}
