// Messages between a local engine (main thread) and its worker thread. Structured clone carries them, so they
// are plain data (Maps are fine, class instances are not).

import type { Notice } from '../util/log.ts';
import type { KvDtype, KvPoolLayout } from '../kernels/types.ts';
import type { AdoptedResult, KvHandoff, KvImportPreparation, PrefillProgress } from './handoff.ts';
import type { EngineInfo, EngineOutput, EngineRequest, LoraLoadInfo, SchedulingPolicy, WorkerRole } from './types.ts';
import type { LoraDtype } from '../model/lora.ts';
import type { EngineStats } from '../protocols/worker.ts';
import type { BlockHash, KvEvent } from '../protocols/kv-events.ts';

export type BackendPreference = 'auto' | 'native' | 'reference';

/** One worker's lower KV tiers: its share of --kv-offload-memory, and its own folder of the disk tier. */
export interface KvOffloadConfig {
  /** RAM tier bytes (0: none). */
  memoryBytes: number;
  /** Disk tier folder of this worker (created if missing); absent: no disk tier. */
  diskDir?: string;
  /** Disk tier bytes of this worker. */
  diskBytes?: number;
}

export interface WorkerInit {
  modelPath: string;
  servedModelName: string;
  backend: BackendPreference;
  threads?: number;
  /** How the native backend stores LoRA adapters (default: its own, model/lora.ts resolveLoraDtype). */
  loraDtype?: LoraDtype;
  kvCacheMemoryBytes: number;
  /** How the KV pool stores keys and values; absent (--kv-cache-dtype auto): the backend's choice (resolveKvDtype). */
  kvDtype?: KvDtype;
  blockSize: number;
  maxNumSeqs: number;
  maxNumBatchedTokens: number;
  /** Cap on prompt + output (default: the model's context length). */
  maxModelLen?: number;
  policy: SchedulingPolicy;
  enablePrefixCaching: boolean;
  /** Jump-forward decoding for guided requests (EngineCoreOptions.jumpForward). */
  guidedJumpForward: boolean;
  enableKvEvents: boolean;
  /**
   * Seconds without a running or waiting request after which the worker resets its prefix cache and gives the KV
   * pool's pages back (0 or unset: never).
   */
  kvCacheIdleReleaseSeconds?: number;
  /** Lower KV tiers under this worker's pool (kv-cache/tiers.ts); absent: none. */
  kvOffload?: KvOffloadConfig;
  /** Disaggregated serving (default 'both'); only informs the worker's notices and info. */
  role?: WorkerRole;
  /** Tokens of a completion handed over together after its first (--stream-interval; default 1: each at once). */
  streamInterval?: number;
}

// Disaggregated serving adds: 'add' with handoff (prefill worker: stop after the first token, reply
// 'prefill-progress' after each of its prompt chunks, then 'handoffs'), 'release-handoff' (the decode worker has the blocks), 'attach-kv-source' (once per prefill worker: its pool,
// shared memory, posted without copying), 'adopt' (decode worker: continue a handed-off request, reply 'adopted'
// once the source blocks are no longer needed), 'hold-prefix' (decode worker, before fetching a handed-off
// request's KV from another process: pin the prompt's blocks cached here, reply 'prefix-held' with their number)
// 'prepare-import' (the same, and blocks reserved for the rest of the KV to be written in place: reply
// 'import-prepared'), 'release-import' (those no longer needed) and 'sync' (reply 'synced' with fresh stats after
// everything posted before it). An adopt naming the source 'in-place' takes the reserved blocks.
export type ToWorker =
  /** sentMs: engine-clock time the request was put in the worker's inbox, where its queue time starts (a step running
   *  then delays only when the worker reads it). */
  | { type: 'add'; request: EngineRequest; handoff?: boolean; sentMs?: number }
  | { type: 'abort'; requestId: string }
  | { type: 'release-handoff'; requestId: string }
  | { type: 'attach-kv-source'; sourceId: string; pool: SharedArrayBuffer; layout: KvPoolLayout }
  | { type: 'adopt'; handoff: KvHandoff; sourceId: string | null }
  | { type: 'hold-prefix'; holdId: number; requestId: string; blockHashes: BlockHash[] }
  /** Reply 'import-prepared': the held prefix and the blocks reserved for the rest (StepCore.prepareKvImport). */
  | { type: 'prepare-import'; holdId: number; requestId: string; blockHashes: BlockHash[]; numBlocks: number; reserve: boolean }
  | { type: 'release-import'; requestId: string; ticket: number }
  | { type: 'sync'; syncId: number }
  /** Reply 'prefix-cache-reset': whether the prefix cache was dropped (and the pool's pages released). */
  | { type: 'reset-prefix-cache'; resetId: number }
  /** Reply 'lora-done': loads the adapter at path (a GGUF adapter or PEFT folder) under name, or unloads it. */
  | { type: 'load-lora'; loraId: number; name: string; path: string }
  | { type: 'unload-lora'; loraId: number; name: string }
  | { type: 'close' };

/** What a worker's load of an adapter found: LoraLoadInfo with the digest of the bytes it loaded, always given. */
export interface WorkerLoraInfo extends LoraLoadInfo {
  digest: string;
}

export type FromWorker =
  /** kvPool/kvLayout: the worker's KV pool (shared memory), for decode workers to read handed-off blocks from. */
  /** `stats`: the loaded engine's, so what it reports before its first step (its KV tiers) is there from the start. */
  | { type: 'ready'; info: EngineInfo; notices: Notice[]; stats: EngineStats; kvPool?: SharedArrayBuffer; kvLayout?: KvPoolLayout }
  | { type: 'outputs'; outputs: EngineOutput[]; stats: EngineStats; kvEvents?: KvEvent[] }
  | { type: 'handoffs'; handoffs: KvHandoff[] }
  /** Prefill worker, after a step: blocks of prefills to hand off that are complete (before their handoffs). */
  | { type: 'prefill-progress'; progress: PrefillProgress[] }
  | { type: 'adopted'; adopted: AdoptedResult[]; stats: EngineStats }
  | { type: 'synced'; syncId: number; stats: EngineStats }
  | { type: 'prefix-held'; holdId: number; blocks: number; stats: EngineStats }
  | { type: 'import-prepared'; holdId: number; preparation: KvImportPreparation | null; error?: string; stats: EngineStats }
  | { type: 'prefix-cache-reset'; resetId: number; reset: boolean; stats: EngineStats; kvEvents?: KvEvent[] }
  | { type: 'rejected'; requestId: string; code: string; message: string }
  /**
   * error: a LoraLoadError's code and message; info: what a load found, with the digest of the bytes it read
   * (model/lora.ts adapterDigest); stats: the engine's after the load or unload (its adapters' memory).
   */
  | { type: 'lora-done'; loraId: number; info?: WorkerLoraInfo; error?: { code: string; message: string }; stats?: EngineStats }
  | { type: 'failed'; message: string }
  /** A warning of the worker thread's own (the KV disk tier's), logged by the parent at the server's --log-level. */
  | { type: 'log'; level: 'warn'; message: string }
  | { type: 'closed' };
