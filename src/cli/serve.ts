// `conduit serve`: the OpenAI-compatible HTTP server over the local engine. The port opens first (so /live and
// /health answer while the model loads), then the engine is built and attached. SIGINT/SIGTERM drain in-flight
// requests for a grace period, abort what is left, close the engine and exit 0; a second signal skips the grace. A
// signal while the model still loads stops the start and exits 0 at once.

import { createHash } from 'node:crypto';
import { accessSync, constants as fsConstants, existsSync, lstatSync, readFileSync, readlinkSync, realpathSync, statSync } from 'node:fs';
import { availableParallelism } from 'node:os';
import { basename, dirname, join, resolve } from 'node:path';
import { createSecureContext } from 'node:tls';
import { TOOL_CALL_PARSERS, type ToolCallParserName } from '../api/tool-calls.ts';
import { ChatTemplate } from '../model/chat-template.ts';
import {
  checkGenerationVocabulary, describeGenerationDefaults, GENERATION_CONFIG_FILE, generationConfigFile, readGenerationConfig,
  type GenerationDefaults,
} from '../model/generation-config.ts';
import type { LoraLoadInfo, SchedulingPolicy } from '../engine/types.ts';
import {
  combineKeyConfig, KeyConfigError, KeyStore, parseKeysFile, parseKeysList, unusedTenants, type KeyConfig, type TenantLimits,
} from '../api/auth.ts';
import { DEFAULT_MAX_SEQUENCES_PER_REQUEST, modelIdFromName, type ServedModel } from '../api/gateway.ts';
import type { Clock } from '../api/rate-limit.ts';
import { EngineStartError } from '../engine/errors.ts';
import { createLogger, isLogLevel, LOG_LEVELS, type Logger, type LogLevel } from '../util/log.ts';
import {
  ApiServer, DEFAULT_HEADERS_TIMEOUT_MS, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PENDING_REQUESTS,
  DEFAULT_SESSION_HEADER,
} from '../api/server.ts';
import { POLICY_NAMES, type PolicyName } from '../router/protocols.ts';
import { DEFAULT_DISAGGREGATION_POLICY, type DisaggregationPolicy } from '../runtime/disaggregation-policy.ts';
import { DEFAULT_WORKER_RESTART_LIMIT } from '../runtime/worker-group.ts';
import { DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoraManager } from '../runtime/lora-manager.ts';
import { LORA_DTYPES, type LoraDtype } from '../model/lora.ts';
import type { KvDtype } from '../kernels/types.ts';
import type { SimWorkerSpec } from '../runtime/worker-pool.ts';
import { CALIBRATIONS, DEFAULT_CALIBRATION, parseCalibration, type CalibrationName } from '../sim/calibration.ts';
import { describeKvElement, getModelProfile } from '../sim/models.ts';
import { checkSimDeployment } from '../sim/sim-worker.ts';
import {
  checkCount, checkThreadsAtMost, checkTimerSecondsAtMost, describeFileError, fileProblem, flagLabel, formatFlagHelp, ignoreInapplicable, MAX_COUNT, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, MAX_WORKERS, nameEnvironment, nameEnvironmentIn, parseFlags, UsageError, type FlagSource, type FlagTable,
  type FlagValues, type ParsedFlags,
} from './flags.ts';
import type { Command } from './main.ts';

const SCHEDULING_POLICIES: readonly SchedulingPolicy[] = ['fcfs', 'priority', 'deadline'];

/** --scheduling-policy's value, checked (serve and worker). */
export function parseSchedulingPolicy(value: string): SchedulingPolicy {
  if (!(SCHEDULING_POLICIES as readonly string[]).includes(value)) {
    throw new UsageError(`--scheduling-policy must be one of ${SCHEDULING_POLICIES.join(', ')}`);
  }
  return value as SchedulingPolicy;
}

export const SERVE_FLAGS = {
  model: { type: 'string', help: 'GGUF file or Hugging Face folder, or NAME=PATH to serve it as NAME; repeat to serve several models, each with its own workers (default: the built-in synthetic model)', short: 'm', repeatable: true },
  'served-model-name': { type: 'string', help: 'name clients send as "model" (default: the model\'s own name); repeated, the i-th names the i-th --model', repeatable: true },
  'lora-modules': { type: 'string', help: 'LoRA adapters loaded at start, NAME=PATH[@BASE][,...] or vLLM\'s JSON {"name":..,"path":..,"base_model_name":..} (a GGUF adapter or a PEFT folder; BASE: the served model it adapts, default the first); requests name an adapter as "model" (as vLLM\'s flag)', repeatable: true },
  'lora-dtype': { type: 'string', help: 'how the cpu engine stores LoRA adapters for its batched kernel: q8 (int8 with a scale per row, default), bf16, or f32 (exact); vLLM\'s flag of that name picks the adapters\' float type' },
  'max-loras': { type: 'number', help: 'LoRA adapters resident per model; loading one more evicts the least recently used idle one (it loads again when a request names it)', default: 8 },
  'max-lora-rank': { type: 'number', help: 'the highest LoRA adapter rank accepted: an adapter of a higher rank is refused when it is loaded (--lora-modules at start, POST /v1/load_lora_adapter with 400), as vLLM\'s flag', default: DEFAULT_MAX_LORA_RANK },
  host: { type: 'string', help: 'address to listen on', default: '127.0.0.1' },
  port: { type: 'number', help: 'port to listen on (0 = any free port)', default: 8000, short: 'p' },
  'api-keys-file': { type: 'string', help: 'API keys: JSON {"keys":[{key,tenant}],"tenants":{name:{rpm,tpm,max_concurrent,cache_group}}} or lines "key tenant [rpm] [tpm] [max_concurrent]"' },
  'api-keys': { type: 'string', help: 'API keys as "key:tenant,key2:tenant2" (no keys anywhere = open development mode; an empty value is refused, not taken as none)', emptyIsValue: true },
  'admin-key': { type: 'string', help: 'API key of the tenant "admin", which may read every tenant\'s traces and /v1/slo, /v1/analysis, /metrics (with keys configured, other keys may not)' },
  'public-metrics': { type: 'boolean', help: '/metrics without an API key even when keys are configured (its series name tenants)', default: false },
  'tenant-rpm': { type: 'number', help: 'requests per minute for tenants whose keys entry sets none (unset = unlimited)' },
  'tenant-tpm': { type: 'number', help: 'tokens per minute (prompt + max_tokens reserved) for tenants that set none' },
  'tenant-max-concurrent': { type: 'number', help: 'requests in flight per tenant for tenants that set none' },
  'max-num-seqs': { type: 'number', help: `most sequences in one engine batch (at most ${MAX_NUM_SEQS})` },
  'scheduling-policy': { type: 'string', help: 'order in which each worker admits waiting requests and preempts running ones: fcfs (arrival), priority (the request\'s priority, lower first, as vLLM), deadline (the request\'s deadline_ms, earliest first)', default: 'fcfs' },
  'chat-template': { type: 'string', help: 'the chat template /v1/chat/completions and /tokenize render messages with, instead of each served model\'s own: a Jinja file, or the template itself (as vLLM\'s --chat-template)' },
  'tool-call-parser': { type: 'string', help: `how tool calls are read from the model's output under tool_choice "auto": auto (from the chat template), ${TOOL_CALL_PARSERS.join(', ')}`, default: 'auto' },
  'max-num-batched-tokens': { type: 'number', help: `most tokens in one engine step (at most ${MAX_NUM_BATCHED_TOKENS})` },
  'max-model-len': { type: 'number', help: 'longest sequence (prompt + output) a request may reach, in tokens (as vLLM\'s flag; default: the model\'s context length; either way at most what one sequence can hold in the KV cache); a cpu worker refuses one above its model\'s context length at start' },
  'generation-config': { type: 'string', help: 'sampling defaults for the fields a request leaves out (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens caps max_tokens) and more end-of-generation ids: auto (each model folder\'s generation_config.json, else its config.json, as vLLM\'s default; a GGUF has none), vllm (none: OpenAI\'s defaults), or a folder holding a generation_config.json', default: 'auto' },
  'enable-prefix-caching': { type: 'boolean', help: 'reuse the KV blocks of prompt prefixes computed before (--no-enable-prefix-caching: every prompt is computed whole, as vLLM\'s flag)', default: true },
  'guided-jump-forward': { type: 'boolean', help: 'jump-forward decoding for guided requests (structured outputs, tool grammars) without logprobs, cpu workers: text the grammar forces is appended as tokens without sampling them, several in one step. The output then differs from token-by-token decoding (the forced text is cut greedily into vocabulary tokens, not picked by the model) and from the same request with logprobs. Off (default): every token is the masked argmax or a masked draw, as vLLM decodes', default: false },
  'stream-interval': { type: 'number', help: 'cpu workers: after a completion\'s first token, hand its tokens to the server this many at a time (the last ones at once, whatever their number), as vLLM\'s flag: each hand-over costs the server a wake-up and each streamed event a socket write, on the cores the model runs on. A client then receives up to this many tokens per event', default: 1 },
  'kv-cache-memory': { type: 'string', help: 'KV cache size in bytes or with a unit (512MiB, 2GiB, 1.5GB)' },
  'kv-cache-dtype': { type: 'string', help: 'how the cpu engine stores the KV cache: auto (the backend\'s choice: f16 on the native and reference backends, as llama.cpp stores it), f16, or f32 (twice the memory and the bytes decode attention reads)', default: 'auto' },
  'kv-cache-idle-release': { type: 'number', help: 'seconds a cpu worker is idle (nothing running or waiting) before it drops its prefix cache and gives the KV pool\'s memory back to the system (0 = never)', default: 0 },
  'kv-offload-memory': { type: 'string', help: 'RAM tier under the KV cache (bytes or with a unit, split evenly between the workers): cached blocks about to be evicted are copied there and brought back instead of recomputed (default 0 = none)' },
  'kv-offload-disk': { type: 'string', help: 'folder of a persistent disk tier under the KV cache (locked against a second process; a subfolder per worker): blocks of the same model are found again after a restart' },
  'kv-offload-disk-size': { type: 'string', help: 'size of the disk tier (bytes or with a unit, split evenly between the workers)', default: '4GiB' },
  threads: { type: 'number', help: 'compute threads (default: all cores)' },
  backend: { type: 'string', help: 'kernels: auto, native or reference', default: 'auto' },
  engine: { type: 'string', help: 'cpu (the real model) or sim (a simulated GPU worker per --sim-* options)', default: 'cpu' },
  workers: { type: 'number', help: 'engine workers behind the router, each with its own thread, KV pool and scheduler (at most 1024)', default: 1 },
  'worker-processes': { type: 'boolean', help: 'run the --workers (or --prefill-workers and --decode-workers, cpu) as child processes (conduit worker) over the request plane on loopback instead of threads: a worker that crashes, natively included, takes only its process down (aggregated workers are restarted)', default: false },
  'routing-policy': { type: 'string', help: `how the router places requests: ${POLICY_NAMES.join(', ')}`, default: 'kv' },
  'session-header': { type: 'string', help: 'request header carrying the session id that --routing-policy session keeps on one worker', default: DEFAULT_SESSION_HEADER },
  'prefill-workers': { type: 'number', help: 'disaggregated serving: prefill workers (with --decode-workers, instead of --workers; at most 1024)' },
  'decode-workers': { type: 'number', help: 'disaggregated serving: decode workers (at most 1024)' },
  'migration-limit': { type: 'number', help: 'times a request may move to another worker when its worker is lost mid-stream, continuing the same stream (0 = off, as Dynamo\'s migration_limit)', default: 0 },
  'worker-restart-limit': { type: 'number', help: 'restart attempts in a row for a cpu worker whose thread died, with backoff, before it is given up (0 = a lost worker stays lost)', default: DEFAULT_WORKER_RESTART_LIMIT },
  'worker-restart-delay': { type: 'number', help: 'ms before the first restart attempt of a lost worker, doubled per further attempt (up to 30 s)', default: 500 },
  'disagg-min-remote-prefill-tokens': { type: 'number', help: `disaggregated serving: prefill on the decode worker when it lacks fewer than this many of the prompt's tokens (cf. Dynamo's max local prefill length; default ${DEFAULT_DISAGGREGATION_POLICY.minRemotePrefillTokens})` },
  'disagg-max-prefill-queue-tokens': { type: 'number', help: `disaggregated serving: with more prefill tokens than this queued on the chosen prefill worker, prefill on the decode worker (cf. Dynamo's max prefill queue size, here in tokens; default ${DEFAULT_DISAGGREGATION_POLICY.maxPrefillQueueTokens})` },
  'disagg-transfer-overhead-ms': { type: 'number', help: `disaggregated serving: fixed cost of one KV transfer besides its bytes, ms, in the transfer-vs-local-prefill comparison (default ${DEFAULT_DISAGGREGATION_POLICY.transferOverheadMs})` },
  'disagg-compare-transfer': { type: 'boolean', help: 'disaggregated serving: prefill on the decode worker when moving the KV would take longer than computing it there, by the measured transfer and prefill rates (--no-disagg-compare-transfer: prompt length and prefill queue alone decide, as Dynamo\'s conditional disaggregation)', default: true },
  'sim-model': { type: 'string', help: 'model profile of simulated workers (llama-3.1-8b, llama-3.1-70b, ...)', default: 'llama-3.1-8b' },
  'sim-gpu': { type: 'string', help: 'GPU profile of simulated workers (h100, h200, a100, b200)', default: 'h100' },
  'sim-tp': { type: 'number', help: 'tensor-parallel GPUs per simulated worker', default: 1 },
  'sim-lora-rank': { type: 'number', help: 'rank of a LoRA adapter simulated workers serve without a file (--lora-modules NAME=PATH with a PATH that does not exist; an existing GGUF adapter or PEFT folder gives its own rank; at most the --sim-model\'s hidden size)', default: 16 },
  'sim-calibration': { type: 'string', help: `efficiency factors of simulated workers: ${CALIBRATIONS.join(' | ')} (see docs/simulator.md)`, default: DEFAULT_CALIBRATION },
  'sim-speed-up': { type: 'string', help: 'simulated ms per real ms: 1 = real time, inf = no waiting (each request\'s steps run back to back as fast as the CPU allows; timings are the simulated ones)', default: '1' },
  'max-pending-requests': { type: 'number', help: 'sequences (prompts x n of every request) in flight before new requests get 503', default: DEFAULT_MAX_PENDING_REQUESTS },
  'max-sequences-per-request': { type: 'number', help: 'most sequences (prompts x n) one request may ask for; more is a 400 (capped at --max-pending-requests)', default: DEFAULT_MAX_SEQUENCES_PER_REQUEST },
  'max-body-bytes': { type: 'string', help: 'largest request body, bytes or with a unit', default: `${DEFAULT_MAX_BODY_BYTES / 1024 / 1024}MiB` },
  'allowed-origins': { type: 'string', help: 'origins a browser page may call the API from (CORS), comma-separated or a JSON list as vLLM\'s; * for any, "" for none', default: '*', emptyIsValue: true },
  'max-connections': { type: 'number', help: `open connections beyond which a new one gets a 503 and is closed (default ${DEFAULT_MAX_CONNECTIONS}, or three quarters of the open-file limit when that is lower)` },
  'headers-timeout': { type: 'number', help: 'seconds a client has to send a request\'s headers', default: DEFAULT_HEADERS_TIMEOUT_MS / 1000 },
  'request-timeout': { type: 'number', help: 'seconds a request may take before it is aborted (0 = no limit)', default: 0 },
  'write-timeout': { type: 'number', help: 'seconds an answer (a stream, or a JSON body) waits for a client that stopped reading before closing the connection: the request is aborted and the sequences, KV blocks and rate-limit tokens it held are given back (0 = wait for ever)', default: 30 },
  'shutdown-grace': { type: 'number', help: 'seconds in-flight requests get to finish on SIGINT/SIGTERM/SIGHUP', default: 30 },
  'tls-cert': { type: 'string', help: 'PEM certificate file: serve HTTPS (needs --tls-key)' },
  'tls-key': { type: 'string', help: 'PEM private key file for --tls-cert' },
  'trace-decode-steps': { type: 'boolean', help: 'one decode_step span per engine step a traced request took part in (default: decode steps summarised on the decode span)', default: false },
  'log-level': { type: 'string', help: `one of ${LOG_LEVELS.join(', ')}`, default: 'info' },
  'return-tokens-as-token-ids': { type: 'boolean', help: 'logprobs name tokens "token_id:<id>" instead of their text, unless a request says otherwise (vLLM\'s flag and return_tokens_as_token_ids field)', default: false },
  'enable-tokenizer-info-endpoint': { type: 'boolean', help: 'serve vLLM\'s GET /tokenizer_info: the tokenizer\'s class, special tokens and chat template (what lm-evaluation-harness\'s remote tokenizer reads)', default: false },
  'request-log': { type: 'boolean', help: 'one info line per request as it ends: method, path, status, tenant, tokens, TTFT, total ms (--no-request-log: off; /health, /live, /metrics and /console/api/overview, which the console polls, only at debug)', default: true },
  help: { type: 'boolean', help: 'show this help', short: 'h' },
} satisfies FlagTable;

const BACKENDS = ['auto', 'native', 'reference'] as const;
const ENGINES = ['cpu', 'sim'] as const;
type Backend = (typeof BACKENDS)[number];

/** One model to serve: its file and, when given, the name it is served as. */
export interface ServedModelSpec {
  path: string;
  servedModelName?: string;
}

export interface ServeConfig {
  /** The first (default) model: the first --model. */
  modelPath?: string;
  /** Each worker's scheduling policy (default fcfs). */
  schedulingPolicy?: SchedulingPolicy;
  /** Tool-call format under tool_choice "auto" (default: recognised from the chat template). */
  toolCallParser?: ToolCallParserName;
  /** --chat-template: the template's text, in place of every served model's own. */
  chatTemplate?: string;
  /** --generation-config: 'auto' (each model folder's generation_config.json, else config.json), 'vllm' (none), or a folder. */
  generationConfig: string;
  servedModelName?: string;
  /** Every --model after the first, each served by its own workers (cpu engine only). */
  extraModels?: ServedModelSpec[];
  /** --lora-modules: adapters loaded at start, each for its base model (default: the first model). */
  loraModules?: LoraModuleSpec[];
  /** How the cpu engine stores adapters (--lora-dtype; default: the native backend's, model/lora.ts). */
  loraDtype?: LoraDtype;
  /** Adapters resident per model (--max-loras). */
  maxLoras?: number;
  /** The highest adapter rank accepted (--max-lora-rank). */
  maxLoraRank?: number;
  host: string;
  port: number;
  keys: KeyConfig;
  /** /metrics without a key even when keys are configured. */
  publicMetrics: boolean;
  tenantDefaults: TenantLimits;
  maxNumSeqs?: number;
  maxNumBatchedTokens?: number;
  /** Longest sequence in tokens (--max-model-len); absent: the model's context length. */
  maxModelLen?: number;
  /** Prefix caching (--enable-prefix-caching, on by default). */
  enablePrefixCaching: boolean;
  /** Jump-forward decoding for guided requests (--guided-jump-forward, off by default). */
  guidedJumpForward: boolean;
  /** Tokens of a completion a cpu worker hands over together after its first (--stream-interval, 1 by default). */
  streamInterval: number;
  kvCacheMemoryBytes?: number;
  /** How the cpu engine stores the KV cache (--kv-cache-dtype); absent for auto, the backend's choice (resolveKvDtype). */
  kvDtype?: KvDtype;
  /** RAM tier under the KV cache, bytes for all workers together (--kv-offload-memory). */
  kvOffloadMemoryBytes?: number;
  /** Disk tier folder and size for all workers together (--kv-offload-disk, --kv-offload-disk-size). */
  kvOffloadDiskDir?: string;
  kvOffloadDiskBytes?: number;
  /** Idle seconds before a cpu worker resets its prefix cache and releases its KV pool's pages (0 = never). */
  kvCacheIdleReleaseSeconds: number;
  threads?: number;
  backend: Backend;
  engine: (typeof ENGINES)[number];
  workers: number;
  /** The workers are child processes instead of threads (--worker-processes). */
  workerProcesses: boolean;
  routingPolicy: PolicyName;
  /** Lower-cased header name. */
  sessionHeader: string;
  prefillWorkers?: number;
  decodeWorkers?: number;
  /** Conditional disaggregation thresholds given on the command line; the rest keep their defaults. */
  disaggregationPolicy?: Partial<DisaggregationPolicy>;
  /** Migrations per request when a worker is lost mid-stream (0 = off). */
  migrationLimit: number;
  /** Restarts in a row of a lost cpu worker (0 = off), and the first backoff, ms. */
  workerRestartLimit: number;
  workerRestartDelayMs: number;
  sim: SimWorkerSpec;
  maxPendingRequests: number;
  maxSequencesPerRequest: number;
  maxConnections: number;
  headersTimeoutMs: number;
  maxBodyBytes: number;
  /** CORS: origins allowed ('*' for any; empty: no CORS headers). */
  allowedOrigins: string[];
  requestTimeoutMs?: number;
  /** --write-timeout in ms; absent: wait for ever (0). */
  writeTimeoutMs?: number;
  shutdownGraceMs: number;
  /** One decode_step span per engine step of a traced request (--trace-decode-steps). */
  traceDecodeSteps: boolean;
  /** Settings that were ignored (environment variables with no effect here), one line each, logged at start. */
  warnings?: string[];
  /**
   * Where each flag's value came from (parseServeConfig's), so that an error at start-up about a value the environment
   * gave names its variable (CONDUIT_LORA_MODULES (--lora-modules) ...), as the checks of the options do.
   */
  flagSources?: Readonly<Partial<Record<keyof typeof SERVE_FLAGS & string, FlagSource>>>;
  tls?: { cert: Buffer; key: Buffer };
  logLevel: LogLevel;
  /** One info line per request (--request-log, on by default). */
  requestLog: boolean;
  /** GET /tokenizer_info is served (--enable-tokenizer-info-endpoint). */
  tokenizerInfoEndpoint: boolean;
  /** Logprobs name tokens "token_id:<id>" by default (--return-tokens-as-token-ids). */
  returnTokensAsTokenIds: boolean;
}

const UNITS: Record<string, number> = {
  '': 1, b: 1,
  k: 1024, kib: 1024, m: 1024 ** 2, mib: 1024 ** 2, g: 1024 ** 3, gib: 1024 ** 3, t: 1024 ** 4, tib: 1024 ** 4,
  kb: 1e3, mb: 1e6, gb: 1e9, tb: 1e12,
};

/**
 * "512MiB" -> bytes. KiB/MiB/GiB and bare K/M/G are powers of 1024; KB/MB/GB powers of 1000. Under one byte is
 * refused unless allowZero (a size whose 0 means "none").
 */
export function parseByteSize(text: string, flag: string, options: { allowZero?: boolean } = {}): number {
  const match = /^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$/.exec(text);
  const unit = match ? UNITS[match[2]!.toLowerCase()] : undefined;
  if (!match || unit === undefined) {
    throw new UsageError(`--${flag} expects bytes or a size like 512MiB or 2GiB, got "${text}"`);
  }
  const bytes = Math.floor(Number(match[1]) * unit);
  if (bytes <= 0 && !(options.allowZero && Number(match[1]) === 0)) throw new UsageError(`--${flag} must be more than 0 bytes`);
  return bytes;
}

/** --generation-config: auto, vllm, or a folder that holds a generation_config.json. */
function parseGenerationConfigOption(value: string): string {
  if (value === 'auto' || value === 'vllm') return value;
  if (!existsSync(join(value, GENERATION_CONFIG_FILE))) {
    throw new UsageError(`--generation-config must be auto, vllm, or a folder holding ${GENERATION_CONFIG_FILE}; ${value} has none`);
  }
  return value;
}

/** The sampling defaults --generation-config gives a model (its folder's file under auto; none for a GGUF). */
async function generationDefaultsFor(option: string, modelPath: string | undefined): Promise<{ defaults: GenerationDefaults; file: string } | undefined> {
  const folder = option === 'vllm' ? undefined
    : option !== 'auto' ? option
      : modelPath !== undefined && existsSync(modelPath) && statSync(modelPath).isDirectory() ? modelPath : undefined;
  if (folder === undefined) return undefined;
  const defaults = await readGenerationConfig(folder);
  return defaults === undefined ? undefined : { defaults, file: generationConfigFile(folder)! };
}

/** A whole number > 0, at most `max` (by default MAX_COUNT: see there). */
export function positiveInteger(value: number | undefined, flag: string, max = MAX_COUNT): number | undefined {
  if (value === undefined) return undefined;
  if (!Number.isInteger(value) || value <= 0) throw new UsageError(`--${flag} must be a whole number > 0, got ${value}`);
  if (value > max) throw new UsageError(`--${flag} must be at most ${max}, got ${value}`);
  return value;
}

/**
 * --sim-lora-rank at most the simulated model's hidden size, as `conduit sim decode-sweep --lora-rank`: an adapter of a
 * higher rank is no low-rank one (its two matrices outweigh the one they adapt), and a rank of 10^9 (with a
 * --max-lora-rank to let it load) priced every step of a request naming the adapter at hours: it never answered.
 */
export function checkSimLoraRank(rank: number, simModel: string): void {
  const model = getModelProfile(simModel);
  if (rank > model.hiddenDim) {
    throw new UsageError(`--sim-lora-rank must be at most ${model.hiddenDim} (the hidden size of ${model.name}), got ${rank}`);
  }
}

const POLICY_FLAGS = {
  minRemotePrefillTokens: 'disagg-min-remote-prefill-tokens',
  maxPrefillQueueTokens: 'disagg-max-prefill-queue-tokens',
  transferOverheadMs: 'disagg-transfer-overhead-ms',
  compareTransfer: 'disagg-compare-transfer',
} as const satisfies Record<keyof DisaggregationPolicy, keyof typeof SERVE_FLAGS>;

/**
 * The disaggregation thresholds that were given (token counts whole and >= 0, the overhead finite and >= 0), and the
 * transfer comparison when turned off.
 */
function parseDisaggregationPolicy(values: FlagValues<typeof SERVE_FLAGS>): Partial<DisaggregationPolicy> | undefined {
  const policy: Partial<DisaggregationPolicy> = {};
  for (const field of ['minRemotePrefillTokens', 'maxPrefillQueueTokens'] as const) {
    const value = values[POLICY_FLAGS[field]];
    if (value === undefined) continue;
    policy[field] = checkCount(POLICY_FLAGS[field], value);
  }
  const overhead = values[POLICY_FLAGS.transferOverheadMs];
  if (overhead !== undefined) {
    if (!(overhead >= 0)) throw new UsageError(`--${POLICY_FLAGS.transferOverheadMs} must be >= 0 ms, got ${overhead}`);
    policy.transferOverheadMs = overhead;
  }
  // Only turning it off is a change from the default.
  if (values[POLICY_FLAGS.compareTransfer] === false) policy.compareTransfer = false;
  return Object.keys(policy).length > 0 ? policy : undefined;
}

/** The engine options `conduit serve` and `conduit worker` share that one kind of worker ignores. */
export type EngineOptionValues = Pick<FlagValues<typeof SERVE_FLAGS>, 'kv-cache-idle-release' | 'kv-cache-memory'
  | 'kv-cache-dtype' | 'guided-jump-forward' | 'stream-interval' | 'threads' | 'backend' | 'lora-dtype' | 'sim-model'>;

/**
 * The KV element of the profile --sim-model names, as the --kv-cache-dtype warning states it ("llama-3.1-8b: 2 bytes,
 * BF16"); undefined for a name no profile has (the start refuses it).
 */
function simKvElement(modelId: string | undefined): string | undefined {
  if (modelId === undefined) return undefined;
  try {
    const model = getModelProfile(modelId);
    return `${model.id}: ${describeKvElement(model)}`;
  } catch {
    return undefined;
  }
}

/**
 * One line per --sim-* option typed for cpu workers, which ignore it (`conduit serve`, `conduit worker` and
 * `conduit cluster` alike). From the environment such a variable may be set up for another deployment: not a warning.
 */
export function simOptionWarnings(sources: Readonly<Record<string, FlagSource>>): string[] {
  return Object.entries(sources).filter(([name, source]) => name.startsWith('sim-') && source === 'command line')
    .map(([name]) => `--${name} is for simulated workers (--engine sim): cpu workers ignore it`);
}

/**
 * One line per option the chosen engine ignores, for `conduit serve` and `conduit worker` alike: the cpu workers'
 * options given to simulated workers (from the command line or the environment), and --sim-* options typed for cpu
 * workers (from the environment they may be set up for another deployment). `modelPaths` are the --model values
 * (NAME=PATH or PATH): simulated workers load no model file (serve still names the model NAME; a simulated
 * `conduit worker` registers under its profile's name whatever it is told).
 */
export function engineOptionWarnings(engine: string, values: EngineOptionValues, sources: Readonly<Record<string, FlagSource>>,
  modelPaths: readonly string[] = []): string[] {
  if (engine !== 'sim') return simOptionWarnings(sources);
  const warnings: string[] = [];
  if (values['kv-cache-idle-release']! > 0) {
    warnings.push('--kv-cache-idle-release is for cpu workers (their KV pools are host memory): simulated workers ignore it');
  }
  if (values['kv-cache-memory'] !== undefined) {
    warnings.push('--kv-cache-memory is for cpu workers: a simulated worker\'s KV pool is its GPUs\' memory left after the weights');
  }
  if (parseKvDtype(values['kv-cache-dtype']!) !== undefined) {
    const element = simKvElement(values['sim-model']);
    warnings.push(`--kv-cache-dtype is for cpu workers: simulated workers count KV elements at their profile's size${element !== undefined ? ` (${element})` : ''}`);
  }
  if (values['guided-jump-forward']) {
    warnings.push('--guided-jump-forward is for cpu workers: simulated workers draw every token of a guided request among those its grammar allows');
  }
  if (values['stream-interval'] !== 1) {
    warnings.push('--stream-interval is for cpu workers: simulated workers hand over each token as its step ends');
  }
  if (values.threads !== undefined) warnings.push('--threads is for cpu workers (their kernels\' compute threads): simulated workers ignore it');
  if (values.backend !== undefined && values.backend !== 'auto') {
    warnings.push('--backend is for cpu workers (the kernels a model file runs on): simulated workers ignore it');
  }
  if (values['lora-dtype'] !== undefined) {
    warnings.push('--lora-dtype is for cpu workers (how adapter weights are held): simulated workers read only an adapter\'s rank and projections');
  }
  for (const value of modelPaths) warnings.push(`--model ${value}: simulated workers load no model file (they run the --sim-model profile)`);
  return warnings;
}

/** A positive number, or inf / infinity (any case) for a simulated clock that never waits for the real one. */
export function parseSpeedUp(text: string): number {
  const trimmed = text.trim();
  const value = /^(inf|infinity)$/i.test(trimmed) ? Infinity : trimmed === '' ? NaN : Number(trimmed);
  if (!(value > 0)) throw new UsageError(`--sim-speed-up must be a number > 0 or inf, got "${text}"`);
  return value;
}

/**
 * The connections the process's open-file limit has room for: three quarters of its soft limit, the rest being for
 * model files, workers and logs; undefined when the limit cannot be read (it is read from /proc/self/limits, Linux).
 */
export function connectionRoom(limitsText?: string): { openFiles: number; connections: number } | undefined {
  let text = limitsText;
  if (text === undefined) {
    try {
      text = readFileSync('/proc/self/limits', 'utf8');
    } catch {
      return undefined;
    }
  }
  const soft = Number(/^Max open files\s+(\d+)/m.exec(text)?.[1]);
  if (!Number.isFinite(soft) || soft <= 0) return undefined;
  return { openFiles: soft, connections: Math.max(1, Math.floor(soft * 0.75)) };
}

/** DEFAULT_MAX_CONNECTIONS, or the open-file limit's room for connections (connectionRoom) when that is lower. */
export function defaultMaxConnections(limitsText?: string): number {
  return Math.min(DEFAULT_MAX_CONNECTIONS, connectionRoom(limitsText)?.connections ?? DEFAULT_MAX_CONNECTIONS);
}

/**
 * A warning for a --max-connections above the open-file limit's room for connections: past it the server runs out of
 * file descriptors, and a new connection is closed unanswered (or waits in the listen queue) instead of getting the
 * bound's 503, and /health with it.
 */
export function maxConnectionsWarning(maxConnections: number, flag: string, limitsText?: string): string | undefined {
  const room = connectionRoom(limitsText);
  if (room === undefined || maxConnections <= room.connections) return undefined;
  return `${flag} ${maxConnections} is more than the open-file limit (${room.openFiles}) leaves for connections (${room.connections}): `
    + 'past that, new connections are closed unanswered instead of getting a 503; raise the limit (ulimit -n) or lower it';
}

/**
 * The keys of --api-keys-file, --api-keys and --admin-key together, every problem a usage error: a file that cannot be
 * read, a key given to two tenants, an unknown field, and an empty --api-keys (or CONDUIT_API_KEYS=""), which would
 * otherwise start the server open to everyone. Tenants configured that no key names are returned as warnings.
 */
function readKeys(file: string | undefined, list: string | undefined, adminKey: string | undefined,
  labels: { file: string; list: string }): { keys: KeyConfig; warnings: string[] } {
  let text: string | undefined;
  if (file !== undefined) {
    try {
      text = readFileSync(file, 'utf8');
    } catch (err) {
      throw new UsageError(`${labels.file} ${file}: ${describeFileError(err)}`);
    }
  }
  try {
    const fromFile = text === undefined ? undefined : parseKeysFile(text, file);
    const keys = combineKeyConfig(fromFile, list !== undefined ? parseKeysList(list, labels.list) : undefined, adminKey);
    return { keys, warnings: unusedTenants(keys).map((name) => `${file}: tenant ${name} is configured but no key belongs to it (a misspelt tenant name?)`) };
  } catch (err) {
    if (err instanceof KeyConfigError) throw new UsageError(err.message);
    throw err;
  }
}

/** Kernel filesystems a disk tier must never use: their files are not storage, and reading some of them can block. */
const PSEUDO_FILESYSTEMS = ['/proc', '/sys'];

/**
 * --kv-offload-disk: a folder that exists or can be made (the disk tier makes it when the workers start). Refused
 * here, before anything loads, when a file stands in the way, a symbolic link points nowhere, the folder is in /proc
 * or /sys, or the nearest existing folder cannot be written.
 */
export function checkDiskTierFolder(dir: string, label = '--kv-offload-disk'): void {
  let path = resolve(dir);
  for (;;) {
    let isDirectory: boolean;
    try {
      isDirectory = statSync(path).isDirectory();
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === 'ENOENT' && isSymbolicLink(path)) {
        throw new UsageError(`${label} ${dir}: ${path} is a symbolic link to ${readlinkSafe(path)}, which does not exist`);
      }
      // Missing, or under a file (ENOTDIR): look at the folder it would be made in.
      if ((code === 'ENOENT' || code === 'ENOTDIR') && dirname(path) !== path) {
        path = dirname(path);
        continue;
      }
      throw new UsageError(`${label} ${dir}: ${describeFileError(err)}`);
    }
    if (!isDirectory) throw new UsageError(`${label} ${dir}: ${path} is a file, not a folder`);
    let real = path;
    try {
      real = realpathSync(path);
    } catch {
      // checked as given
    }
    const pseudo = PSEUDO_FILESYSTEMS.find((root) => real === root || real.startsWith(`${root}/`));
    if (pseudo !== undefined) throw new UsageError(`${label} ${dir}: ${pseudo} is a kernel filesystem, not storage; give a folder on a disk`);
    try {
      accessSync(path, fsConstants.W_OK | fsConstants.X_OK);
    } catch (err) {
      throw new UsageError(`${label} ${dir}: cannot write in ${path}: ${describeFileError(err)}`);
    }
    return;
  }
}

/**
 * A lower tier's refusal of a budget below one block (tiers.ts: --kv-offload-memory; disk-tier.ts:
 * --kv-offload-disk-size), as a worker reports it: with the bytes that worker got.
 */
const TIER_SIZE_TOO_SMALL = /^(worker process \S+ could not start: )?--kv-offload-(memory|disk-size) (\d+) bytes holds no KV block( file)? of (\d+) bytes$/;

/** A worker's refusal of a --kv-cache-memory below one block (worker-main.ts), the size being per worker. */
const KV_CACHE_MEMORY_TOO_SMALL = /^(worker process \S+ could not start: )?--kv-cache-memory \d+ bytes holds no block of \d+ bytes$/;

/** A start-up failure that is a bad value (exit 2), not a failure to start (exit 1): known only once the model loaded. */
export function isTierSizeTooSmall(error: unknown): boolean {
  return error instanceof EngineStartError
    && (TIER_SIZE_TOO_SMALL.test(error.message) || KV_CACHE_MEMORY_TOO_SMALL.test(error.message));
}

/**
 * A worker names the bytes of a tier it got, its share of the value given (split evenly between the models and
 * their workers): said as the value given and that share, not as a number nobody typed.
 */
export function explainTierShare(message: string, config: Pick<ServeConfig, 'kvOffloadMemoryBytes' | 'kvOffloadDiskBytes' | 'extraModels'>): string {
  const match = TIER_SIZE_TOO_SMALL.exec(message);
  if (match === null) return message;
  const [, child = '', flag, share, file = '', blockBytes] = match;
  const given = flag === 'memory' ? config.kvOffloadMemoryBytes : config.kvOffloadDiskBytes;
  if (given === undefined || String(given) === share) return message;
  const between = (config.extraModels?.length ?? 0) > 0 ? 'the models and their workers' : 'the workers';
  return `${child}--kv-offload-${flag} ${given} bytes gives each worker ${share} bytes (split evenly between ${between}), `
    + `which holds no KV block${file} of ${blockBytes} bytes`;
}

function isSymbolicLink(path: string): boolean {
  try {
    return lstatSync(path).isSymbolicLink();
  } catch {
    return false;
  }
}

function readlinkSafe(path: string): string {
  try {
    return readlinkSync(path);
  } catch {
    return 'a missing path';
  }
}

/** The OpenSSL reason of a TLS error ("no start line"), else its message. */
function tlsReason(err: unknown): string {
  return (err as { reason?: string }).reason ?? (err as Error).message;
}

/**
 * --tls-cert and --tls-key, read and checked as a TLS server will use them: a file that cannot be read, a certificate
 * or key that is not PEM, and a key that is not the certificate's are refused while the options are read, in one line.
 * `label` names each flag in the messages (flagLabel: its variable too when the environment gave it).
 */
function readTls(certPath: string, keyPath: string, label: (name: 'tls-cert' | 'tls-key') => string): { cert: Buffer; key: Buffer } {
  const read = (flag: 'tls-cert' | 'tls-key', path: string): Buffer => {
    try {
      return readFileSync(path);
    } catch (err) {
      throw new UsageError(`${label(flag)} ${path}: ${describeFileError(err)}`);
    }
  };
  const cert = read('tls-cert', certPath);
  const key = read('tls-key', keyPath);
  try {
    createSecureContext({ cert });
  } catch (err) {
    throw new UsageError(`${label('tls-cert')} ${certPath}: not a PEM certificate (${tlsReason(err)})`);
  }
  try {
    createSecureContext({ key });
  } catch (err) {
    throw new UsageError(`${label('tls-key')} ${keyPath}: not a PEM private key without a passphrase (${tlsReason(err)})`);
  }
  try {
    createSecureContext({ cert, key });
  } catch (err) {
    throw new UsageError(`${label('tls-key')} ${keyPath} is not the private key of ${label('tls-cert')} ${certPath} (${tlsReason(err)})`);
  }
  return { cert, key };
}

/**
 * The --model values with their names: NAME=PATH names a model in place (when the text before the first "=" has no
 * path separator and the whole value is not an existing file), else the i-th --served-model-name names the i-th
 * model. Two models served under one name are refused, and so are more names than models. `label` names each of the
 * two flags in a message (default `--name`; serve and worker pass flagLabel, so a value from the environment is
 * named by its variable, whichever of the two it is).
 */
export function parseModelSpecs(models: readonly string[], names: readonly string[],
  exists: (path: string) => boolean = existsSync,
  label: (name: 'model' | 'served-model-name') => string = (name) => `--${name}`): ServedModelSpec[] {
  if (names.length > Math.max(1, models.length)) {
    throw new UsageError(`${label('served-model-name')} given ${names.length} times for ${models.length} ${label('model')}`);
  }
  const specs = models.map((value, i): ServedModelSpec => {
    const eq = value.indexOf('=');
    const named = eq > 0 && !/[\\/]/.test(value.slice(0, eq)) && !exists(value);
    const path = named ? value.slice(eq + 1) : value;
    if (path === '') throw new UsageError(`${label('model')} ${value}: no path after "="`);
    const name = named ? value.slice(0, eq) : names[i];
    if (named && names[i] !== undefined && names[i] !== name) {
      throw new UsageError(`${label('model')} ${value} is named "${name}" and ${label('served-model-name')} names it "${names[i]}"`);
    }
    return { path, ...(name !== undefined ? { servedModelName: name } : {}) };
  });
  const seen = new Set<string>();
  for (const spec of specs) {
    if (spec.servedModelName === undefined) continue;
    if (seen.has(spec.servedModelName)) throw new UsageError(`${label('model')}: two models are served as "${spec.servedModelName}"`);
    seen.add(spec.servedModelName);
  }
  return specs;
}

/** --kv-cache-dtype: auto, f32 or f16; undefined for auto, which each worker resolves by its backend (resolveKvDtype). */
export function parseKvDtype(value: string): KvDtype | undefined {
  const dtype = value.trim().toLowerCase();
  if (dtype === 'auto') return undefined;
  if (dtype !== 'f32' && dtype !== 'f16') throw new UsageError(`--kv-cache-dtype must be one of auto, f32, f16, got "${value}"`);
  return dtype;
}

/** --lora-dtype: q8, bf16 or f32. */
export function parseLoraDtype(value: string): LoraDtype {
  const dtype = value.trim().toLowerCase();
  if (!(LORA_DTYPES as readonly string[]).includes(dtype)) throw new UsageError(`--lora-dtype must be one of ${LORA_DTYPES.join(', ')}, got "${value}"`);
  return dtype as LoraDtype;
}

/** One --lora-modules item: the adapter's name, its file, and the served model it adapts (default: the first). */
export interface LoraModuleSpec {
  name: string;
  path: string;
  base?: string;
}

/**
 * --lora-modules values, names unique. A value is either vLLM's JSON form, {"name": .., "path": ..,
 * "base_model_name": ..} (base_model_name optional), or NAME=PATH[@BASE] items separated by commas, where BASE (the
 * text after the last '@') is the served name of the model the adapter is for; a path containing '@' or ',' needs
 * the JSON form.
 */
export function parseLoraModules(values: readonly string[]): LoraModuleSpec[] {
  const modules: LoraModuleSpec[] = [];
  const add = (module: LoraModuleSpec) => {
    if (modules.some((m) => m.name === module.name)) throw new UsageError(`--lora-modules names "${module.name}" twice`);
    modules.push(module);
  };
  for (const value of values) {
    const trimmed = value.trim();
    if (trimmed.startsWith('{')) {
      add(jsonLoraModule(trimmed));
      continue;
    }
    for (const item of trimmed.split(',').map((item) => item.trim()).filter((item) => item !== '')) {
      const eq = item.indexOf('=');
      if (eq <= 0 || eq === item.length - 1) throw new UsageError(`--lora-modules expects NAME=PATH[@BASE] items or a JSON object, got "${item}"`);
      const target = item.slice(eq + 1);
      const at = target.lastIndexOf('@');
      if (at === 0 || at === target.length - 1) throw new UsageError(`--lora-modules ${item}: expected NAME=PATH@BASE with a path and a base model name`);
      add(at > 0 ? { name: item.slice(0, eq), path: target.slice(0, at), base: target.slice(at + 1) } : { name: item.slice(0, eq), path: target });
    }
  }
  return modules;
}

function jsonLoraModule(text: string): LoraModuleSpec {
  let parsed: unknown;
  try {
    parsed = JSON.parse(text);
  } catch (error) {
    throw new UsageError(`--lora-modules: ${text} is not valid JSON: ${(error as Error).message}`);
  }
  const o = parsed as Record<string, unknown>;
  if (typeof o !== 'object' || o === null || Array.isArray(o)) throw new UsageError(`--lora-modules: ${text} is not a JSON object`);
  const known = new Set(['name', 'path', 'base_model_name']);
  const unknown = Object.keys(o).filter((key) => !known.has(key));
  if (unknown.length > 0) throw new UsageError(`--lora-modules: unknown field(s) ${unknown.join(', ')} in ${text} (expected name, path, base_model_name)`);
  if (typeof o.name !== 'string' || o.name === '') throw new UsageError(`--lora-modules: "name" must be a non-empty string in ${text}`);
  if (typeof o.path !== 'string' || o.path === '') throw new UsageError(`--lora-modules: "path" must be a non-empty string in ${text}`);
  if (o.base_model_name !== undefined && o.base_model_name !== null && (typeof o.base_model_name !== 'string' || o.base_model_name === '')) {
    throw new UsageError(`--lora-modules: "base_model_name" must be a non-empty string in ${text}`);
  }
  return { name: o.name, path: o.path, ...(typeof o.base_model_name === 'string' ? { base: o.base_model_name } : {}) };
}

/**
 * --chat-template's value: a file's text, or the template itself when no such file exists and it reads as one (a
 * brace or a line break in it), as vLLM takes it. Compiled here, so a template that does not parse stops the start.
 */
export function readChatTemplateOption(value: string): string {
  let text: string;
  if (existsSync(value) && statSync(value).isFile()) {
    try {
      text = readFileSync(value, 'utf8');
    } catch (error) {
      throw new UsageError(`--chat-template ${value}: ${describeFileError(error)}`);
    }
  } else if (/[{}\n]/.test(value)) text = value;
  else throw new UsageError(`--chat-template: no file ${value} (a template given inline has {{ }} or {% %} in it)`);
  try {
    void new ChatTemplate({ templates: text });
  } catch (error) {
    throw new UsageError(`--chat-template: ${(error as Error).message}`);
  }
  return text;
}

export function parseServeConfig(argv: readonly string[], env: NodeJS.ProcessEnv = process.env,
  options: { disaggregation?: boolean } = {}): ServeConfig | 'help' {
  // The thresholds mean nothing without disaggregated serving: refused on the command line, ignored (with a
  // warning) when they come from an environment set up for another deployment, whatever their text.
  const parsed = parseFlags(SERVE_FLAGS, argv, env, {
    inapplicable: (v) => options.disaggregation || v['prefill-workers'] !== undefined ? undefined : {
      names: Object.values(POLICY_FLAGS),
      why: 'only for disaggregated serving (--prefill-workers with --decode-workers)',
    },
  });
  try {
    const config = serveConfigOf(parsed);
    if (config !== 'help') config.flagSources = parsed.sources;
    return config;
  } catch (err) {
    // A value nobody typed is reported under the variable that gave it (CONDUIT_PORT (--port) must be ...).
    throw nameEnvironment(SERVE_FLAGS, parsed, err);
  }
}

function serveConfigOf(parsed: ParsedFlags<typeof SERVE_FLAGS>): ServeConfig | 'help' {
  const { values, positionals } = parsed;
  // Each flag a message names, by its variable too when the environment gave it: nameEnvironment rewrites only the
  // flag a message starts with, and a message about two flags may have either from the environment.
  const label = (name: keyof typeof SERVE_FLAGS & string): string => flagLabel(SERVE_FLAGS, parsed, name);
  if (values.help) return 'help';
  if (positionals.length > 0) throw new UsageError(`unexpected argument "${positionals[0]}"`);
  const port = values.port!;
  if (!Number.isInteger(port) || port < 0 || port > 65535) throw new UsageError(`--port must be 0..65535, got ${port}`);
  const backend = values.backend!;
  if (!(BACKENDS as readonly string[]).includes(backend)) throw new UsageError(`--backend must be one of ${BACKENDS.join(', ')}, got "${backend}"`);
  const logLevel = values['log-level']!;
  if (!isLogLevel(logLevel)) throw new UsageError(`--log-level must be one of ${LOG_LEVELS.join(', ')}, got "${logLevel}"`);
  if ((values['tls-cert'] === undefined) !== (values['tls-key'] === undefined)) {
    throw new UsageError(`${label('tls-cert')} and ${label('tls-key')} go together`);
  }
  const timeout = values['request-timeout']!;
  const grace = values['shutdown-grace']!;
  if (timeout < 0) throw new UsageError('--request-timeout must be >= 0');
  const writeTimeout = values['write-timeout']!;
  if (!(writeTimeout >= 0)) throw new UsageError(`--write-timeout must be >= 0 seconds, got ${writeTimeout}`);
  const idleRelease = values['kv-cache-idle-release']!;
  if (!(idleRelease >= 0)) throw new UsageError(`--kv-cache-idle-release must be >= 0 seconds, got ${idleRelease}`);
  if (grace < 0) throw new UsageError('--shutdown-grace must be >= 0');
  const headersTimeout = values['headers-timeout']!;
  if (!(headersTimeout > 0)) throw new UsageError(`--headers-timeout must be > 0 seconds, got ${headersTimeout}`);
  checkTimerSecondsAtMost('request-timeout', timeout, 'no limit');
  checkTimerSecondsAtMost('write-timeout', writeTimeout, 'wait for ever');
  checkTimerSecondsAtMost('shutdown-grace', grace);
  checkTimerSecondsAtMost('headers-timeout', headersTimeout);
  const tenantDefaults: TenantLimits = {};
  const rpm = positiveInteger(values['tenant-rpm'], 'tenant-rpm');
  const tpm = positiveInteger(values['tenant-tpm'], 'tenant-tpm');
  const concurrent = positiveInteger(values['tenant-max-concurrent'], 'tenant-max-concurrent');
  if (rpm !== undefined) tenantDefaults.requestsPerMinute = rpm;
  if (tpm !== undefined) tenantDefaults.tokensPerMinute = tpm;
  if (concurrent !== undefined) tenantDefaults.maxConcurrent = concurrent;
  const engine = values.engine!;
  if (!(ENGINES as readonly string[]).includes(engine)) throw new UsageError(`--engine must be one of ${ENGINES.join(', ')}, got "${engine}"`);
  const routingPolicy = values['routing-policy']!;
  if (!(POLICY_NAMES as readonly string[]).includes(routingPolicy)) {
    throw new UsageError(`--routing-policy must be one of ${POLICY_NAMES.join(', ')}, got "${routingPolicy}"`);
  }
  const toolCallParser = values['tool-call-parser']!;
  if (toolCallParser !== 'auto' && !(TOOL_CALL_PARSERS as readonly string[]).includes(toolCallParser)) {
    throw new UsageError(`--tool-call-parser must be one of auto, ${TOOL_CALL_PARSERS.join(', ')}`);
  }
  const sessionHeader = values['session-header']!;
  // An HTTP field name is an RFC 9110 token.
  if (!/^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/.test(sessionHeader)) {
    throw new UsageError(`--session-header must be an HTTP header name (letters, digits, "-" ...), got "${sessionHeader}"`);
  }
  const prefillWorkers = positiveInteger(values['prefill-workers'], 'prefill-workers', MAX_WORKERS);
  const decodeWorkers = positiveInteger(values['decode-workers'], 'decode-workers', MAX_WORKERS);
  if ((prefillWorkers === undefined) !== (decodeWorkers === undefined)) {
    throw new UsageError(`${label('prefill-workers')} and ${label('decode-workers')} go together`);
  }
  const warnings = parsed.warnings;
  // --workers counts aggregated workers; with prefill and decode workers it would be silently dropped. Typed, that is
  // a mistake; from the environment (CONDUIT_WORKERS set for another deployment) it is ignored with a warning.
  if (prefillWorkers !== undefined) {
    warnings.push(...ignoreInapplicable(SERVE_FLAGS, parsed, ['workers'],
      'an alternative to --prefill-workers with --decode-workers, which set the workers of disaggregated serving'));
  }
  if (values['worker-processes'] && prefillWorkers !== undefined && values.engine === 'sim') {
    throw new UsageError(`${label('worker-processes')} with ${label('prefill-workers')} runs cpu workers `
      + '(simulated workers have no KV to move between processes)');
  }
  const disaggregationPolicy = parseDisaggregationPolicy(values);
  const speedUp = parseSpeedUp(values['sim-speed-up']!);
  warnings.push(...engineOptionWarnings(engine, values, parsed.sources, parsed.lists.model ?? []));
  let calibration: CalibrationName;
  try {
    calibration = parseCalibration(values['sim-calibration']!);
  } catch (error) {
    throw new UsageError(`--sim-calibration: ${(error as Error).message}`);
  }
  const simTp = positiveInteger(values['sim-tp'], 'sim-tp')!;
  // Simulated workers that cannot exist (no such profile, a tp the model does not split over, weights that leave no
  // HBM for the KV cache) are refused before anything starts, naming the options that set them.
  if (engine === 'sim') {
    checkSimDeployment({ model: values['sim-model']!, gpu: values['sim-gpu']!, tp: simTp },
      { model: label('sim-model'), gpu: label('sim-gpu'), tp: label('sim-tp') });
    checkSimLoraRank(positiveInteger(values['sim-lora-rank'], 'sim-lora-rank')!, values['sim-model']!);
  }
  const migrationLimit = checkCount('migration-limit', values['migration-limit']!);
  const workerRestartLimit = checkCount('worker-restart-limit', values['worker-restart-limit']!);
  const workerRestartDelayMs = values['worker-restart-delay']!;
  if (!Number.isFinite(workerRestartDelayMs) || workerRestartDelayMs < 0) {
    throw new UsageError(`--worker-restart-delay must be a number of ms >= 0, got ${workerRestartDelayMs}`);
  }
  const maxConnections = positiveInteger(values['max-connections'], 'max-connections');
  const connectionsWarning = maxConnections !== undefined ? maxConnectionsWarning(maxConnections, label('max-connections')) : undefined;
  if (connectionsWarning !== undefined) warnings.push(connectionsWarning);
  const keys = readKeys(values['api-keys-file'], values['api-keys'], values['admin-key'], {
    file: flagLabel(SERVE_FLAGS, parsed, 'api-keys-file'), list: flagLabel(SERVE_FLAGS, parsed, 'api-keys'),
  });
  warnings.push(...keys.warnings);
  const config: ServeConfig = {
    host: values.host!,
    port,
    keys: keys.keys,
    publicMetrics: values['public-metrics']!,
    tenantDefaults,
    backend: backend as Backend,
    engine: engine as ServeConfig['engine'],
    workers: positiveInteger(values.workers, 'workers', MAX_WORKERS)!,
    workerProcesses: values['worker-processes']!,
    routingPolicy: routingPolicy as PolicyName,
    schedulingPolicy: parseSchedulingPolicy(values['scheduling-policy']!),
    ...(toolCallParser !== 'auto' ? { toolCallParser: toolCallParser as ToolCallParserName } : {}),
    ...(values['chat-template'] !== undefined ? { chatTemplate: readChatTemplateOption(values['chat-template']) } : {}),
    sessionHeader: sessionHeader.toLowerCase(),
    ...(prefillWorkers !== undefined ? { prefillWorkers, decodeWorkers } : {}),
    ...(disaggregationPolicy !== undefined ? { disaggregationPolicy } : {}),
    migrationLimit,
    workerRestartLimit,
    workerRestartDelayMs,
    sim: {
      model: values['sim-model']!, gpu: values['sim-gpu']!, tp: simTp, speedUp, calibration,
      loraRank: positiveInteger(values['sim-lora-rank'], 'sim-lora-rank')!,
    },
    maxPendingRequests: positiveInteger(values['max-pending-requests'], 'max-pending-requests')!,
    maxSequencesPerRequest: positiveInteger(values['max-sequences-per-request'], 'max-sequences-per-request')!,
    maxConnections: maxConnections ?? defaultMaxConnections(),
    headersTimeoutMs: headersTimeout * 1000,
    maxBodyBytes: parseByteSize(values['max-body-bytes']!, 'max-body-bytes'),
    allowedOrigins: parseOrigins(values['allowed-origins']!),
    shutdownGraceMs: grace * 1000,
    kvCacheIdleReleaseSeconds: idleRelease,
    traceDecodeSteps: values['trace-decode-steps']!,
    logLevel,
    requestLog: values['request-log']!,
    enablePrefixCaching: values['enable-prefix-caching']!,
    guidedJumpForward: values['guided-jump-forward']!,
    streamInterval: positiveInteger(values['stream-interval'], 'stream-interval')!,
    generationConfig: parseGenerationConfigOption(values['generation-config']!),
    tokenizerInfoEndpoint: values['enable-tokenizer-info-endpoint']!,
    returnTokensAsTokenIds: values['return-tokens-as-token-ids']!,
    ...(warnings.length > 0 ? { warnings } : {}),
  };
  const models = parseModelSpecs(parsed.lists.model ?? [], parsed.lists['served-model-name'] ?? [], undefined, label);
  if (models.length > 1 && engine === 'sim') {
    throw new UsageError(`${label('model')}: simulated workers (${label('engine')} sim) serve one profile; several models need --engine cpu`);
  }
  if (models[0] !== undefined) {
    config.modelPath = models[0].path;
    if (models[0].servedModelName !== undefined) config.servedModelName = models[0].servedModelName;
  } else if (values['served-model-name'] !== undefined) {
    config.servedModelName = values['served-model-name'];
  }
  if (models.length > 1) config.extraModels = models.slice(1);
  const loraModules = parseLoraModules(parsed.lists['lora-modules'] ?? []);
  if (loraModules.length > 0) {
    config.loraModules = loraModules;
  }
  config.maxLoras = positiveInteger(values['max-loras'], 'max-loras')!;
  config.maxLoraRank = positiveInteger(values['max-lora-rank'], 'max-lora-rank')!;
  if (values['lora-dtype'] !== undefined) config.loraDtype = parseLoraDtype(values['lora-dtype']);
  const maxNumSeqs = positiveInteger(values['max-num-seqs'], 'max-num-seqs', MAX_NUM_SEQS);
  if (maxNumSeqs !== undefined) config.maxNumSeqs = maxNumSeqs;
  const maxNumBatchedTokens = positiveInteger(values['max-num-batched-tokens'], 'max-num-batched-tokens', MAX_NUM_BATCHED_TOKENS);
  if (maxNumBatchedTokens !== undefined) config.maxNumBatchedTokens = maxNumBatchedTokens;
  const maxModelLen = positiveInteger(values['max-model-len'], 'max-model-len');
  if (maxModelLen !== undefined) config.maxModelLen = maxModelLen;
  if (values['kv-cache-memory'] !== undefined) config.kvCacheMemoryBytes = parseByteSize(values['kv-cache-memory'], 'kv-cache-memory');
  const kvDtype = parseKvDtype(values['kv-cache-dtype']!);
  if (kvDtype !== undefined) config.kvDtype = kvDtype;
  if (values['kv-offload-memory'] !== undefined) {
    const bytes = parseByteSize(values['kv-offload-memory'], 'kv-offload-memory', { allowZero: true });
    if (bytes > 0) config.kvOffloadMemoryBytes = bytes;
  }
  if (values['kv-offload-disk'] !== undefined && values['kv-offload-disk'] !== '') {
    checkDiskTierFolder(values['kv-offload-disk']);
    config.kvOffloadDiskDir = values['kv-offload-disk'];
    config.kvOffloadDiskBytes = parseByteSize(values['kv-offload-disk-size']!, 'kv-offload-disk-size');
    if (config.kvOffloadDiskBytes <= 0) throw new UsageError('--kv-offload-disk-size must be more than 0 bytes');
  }
  const threads = positiveInteger(values.threads, 'threads');
  checkThreadsAtMost(threads);
  if (threads !== undefined) config.threads = threads;
  if (timeout > 0) config.requestTimeoutMs = timeout * 1000;
  if (writeTimeout > 0) config.writeTimeoutMs = writeTimeout * 1000;
  if (values['tls-cert'] !== undefined) {
    config.tls = readTls(values['tls-cert'], values['tls-key']!, label);
  }
  return config;
}

export interface RunningServer {
  api: ApiServer;
  /** "1", "4 behind the kv router", "2 prefill + 2 decode". */
  workers: string;
  keyStore: KeyStore;
  url: string;
  /** What the banner names as the model: its path, or for simulated workers their profile. */
  modelPath: string;
}

/** --allowed-origins: a comma-separated list, or a JSON list of strings as vLLM takes it ('["*"]'). */
export function parseOrigins(text: string): string[] {
  const trimmed = text.trim();
  if (trimmed.startsWith('[')) {
    let list: unknown;
    try {
      list = JSON.parse(trimmed);
    } catch {
      throw new UsageError(`--allowed-origins: ${JSON.stringify(text)} is not a JSON list`);
    }
    if (!Array.isArray(list) || list.some((o) => typeof o !== 'string')) throw new UsageError('--allowed-origins: a JSON list of strings');
    return (list as string[]).map((o) => o.trim()).filter((o) => o !== '');
  }
  return trimmed.split(',').map((o) => o.trim()).filter((o) => o !== '');
}

/**
 * The gateway of a config (keys, limits, TLS, logging), not yet listening: what serve and frontend share.
 * workersPolicy: the scheduling policy of every worker behind it, when this process starts them all (serve):
 * requests' priority and deadline_ms are then checked against it. A frontend does not know its workers' policies and
 * leaves it out.
 */
export function createApiServer(config: ServeConfig, logger: Logger, clock?: Clock,
  workersPolicy?: SchedulingPolicy): { api: ApiServer; keyStore: KeyStore } {
  for (const warning of config.warnings ?? []) logger.warn(warning);
  const keyStore = new KeyStore(config.keys, config.tenantDefaults);
  if (keyStore.isOpen) logger.warn('no API keys configured: every request is accepted (development mode); see --api-keys-file');
  else if (!keyStore.hasAdmin) {
    logger.warn(`no admin key: /v1/slo, /v1/analysis${config.publicMetrics ? '' : ' and /metrics'} answer 403 to every key; see --admin-key`);
  }
  const api = new ApiServer({
    keyStore,
    ...(config.servedModelName !== undefined ? { servedModelName: config.servedModelName } : {}),
    maxBodyBytes: config.maxBodyBytes,
    allowedOrigins: config.allowedOrigins,
    ...(config.publicMetrics ? { publicMetrics: true } : {}),
    maxPendingRequests: config.maxPendingRequests,
    maxSequencesPerRequest: config.maxSequencesPerRequest,
    maxConnections: config.maxConnections,
    headersTimeoutMs: config.headersTimeoutMs,
    sessionHeader: config.sessionHeader,
    ...(config.toolCallParser !== undefined ? { toolCallParser: config.toolCallParser } : {}),
    ...(config.traceDecodeSteps ? { perTokenSpans: true } : {}),
    requestLog: config.requestLog,
    ...(config.tokenizerInfoEndpoint ? { tokenizerInfoEndpoint: true } : {}),
    ...(config.returnTokensAsTokenIds ? { returnTokensAsTokenIds: true } : {}),
    ...(config.requestTimeoutMs !== undefined ? { requestTimeoutMs: config.requestTimeoutMs } : {}),
    ...(config.writeTimeoutMs !== undefined ? { writeTimeoutMs: config.writeTimeoutMs } : {}),
    ...(config.tls ? { tls: config.tls } : {}),
    ...(clock ? { clock } : {}),
    ...(workersPolicy !== undefined ? { schedulingPolicy: workersPolicy } : {}),
    logger,
  });
  return { api, keyStore };
}

/** The longest a model's name is kept in its folder's name (file systems take 255 bytes a name). */
const MODEL_FOLDER_MAX = 120;

/**
 * A folder name per served model for its disk KV tier, a different one for each model (two models in one folder
 * would fight over its lock, and each would delete the other's blocks as another model's): `model-` and its served
 * name, or its file's name when it has none. Letters, digits, `.`, `_` and `-` are kept as they are (so a simple
 * name keeps the folder it always had) and every other byte is written `%XX`, so no two names give the same folder.
 * An unnamed model whose file's name is another model's name is told apart by `~` and a hash of its file's path (not
 * by its position: a reordered --model list finds its blocks again); a name too long for a folder is cut and given
 * `~` and a hash of the whole name. Neither `~` nor `%` appears otherwise, so these never meet a plain name's folder.
 */
export function modelFolderNames(specs: readonly { path?: string; servedModelName?: string }[]): string[] {
  const shortHash = (text: string) => createHash('sha256').update(text).digest('hex').slice(0, 12);
  const escape = (name: string) => {
    const escaped = [...Buffer.from(name, 'utf8')].map((byte) => {
      const char = String.fromCharCode(byte);
      return /^[A-Za-z0-9._-]$/.test(char) ? char : `%${byte.toString(16).toUpperCase().padStart(2, '0')}`;
    }).join('');
    return escaped.length <= MODEL_FOLDER_MAX ? escaped : `${escaped.slice(0, MODEL_FOLDER_MAX - 13)}~${shortHash(name)}`;
  };
  const names = specs.map((spec) => `model-${escape(spec.servedModelName ?? basename(spec.path ?? 'builtin'))}`);
  const told = names.map((name, i) => {
    const spec = specs[i]!;
    // Served names are unique (parseModelSpecs): a named model keeps its plain folder; an unnamed one sharing it moves.
    if (spec.servedModelName !== undefined || names.indexOf(name) === names.lastIndexOf(name)) return name;
    return `${name}~${shortHash(resolve(spec.path ?? 'builtin'))}`;
  });
  // The same file given twice without names: only the position is left to tell the two apart.
  return told.map((name, i) => (told.indexOf(name) === told.lastIndexOf(name) ? name : `${name}~${i}`));
}

/** Opens the port, loads the model into a local engine and attaches it. `clock` drives the rate limiter. */
export async function startServer(config: ServeConfig, logger: Logger, clock?: Clock): Promise<RunningServer> {
  // Every worker is started here with config's policy (fcfs when not given), so the gateway checks requests by it.
  const { api, keyStore } = createApiServer(config, logger, clock, config.schedulingPolicy ?? 'fcfs');
  await api.listen(config.port, config.host);
  try {
    // Simulated workers run no model file: the built-in one is not even written for them.
    const modelPath = config.engine === 'sim' ? undefined
      : config.modelPath ?? await (await import('../model/synthetic.ts')).ensureBuiltinModel();
    const { createWorkerPool } = await import('../runtime/worker-pool.ts');
    const { createProcessWorkerPool } = await import('../cluster/process-pool.ts');
    const create = config.workerProcesses
      ? (options: Parameters<typeof createWorkerPool>[0]) => createProcessWorkerPool({
        ...options, logLevel: config.logLevel, childLog: (level, message) => logger[level](message),
      }, options.log)
      : createWorkerPool;
    const specs: { path?: string; servedModelName?: string }[] = [
      { ...(modelPath !== undefined ? { path: modelPath } : {}), ...(config.servedModelName !== undefined ? { servedModelName: config.servedModelName } : {}) },
      ...(config.extraModels ?? []),
    ];
    // The machine's cores are shared by every model's workers unless --threads says otherwise.
    const threads = config.threads ?? (specs.length > 1
      ? Math.max(1, Math.floor(availableParallelism() / (specs.length * (config.prefillWorkers !== undefined
        ? config.prefillWorkers + config.decodeWorkers! : config.workers)))) : undefined);
    const served: ServedModel[] = [];
    const diskFolders = modelFolderNames(specs);
    try {
      for (const [i, spec] of specs.entries()) {
        // Several models cannot share one disk tier folder (its lock keeps a second pool out): each gets its own,
        // named by the model (not its position, so a reordered --model list finds its blocks again).
        const diskDir = config.kvOffloadDiskDir === undefined ? undefined
          : specs.length > 1 ? join(config.kvOffloadDiskDir, diskFolders[i]!) : config.kvOffloadDiskDir;
        const pool = await create({
          engine: config.engine,
          workers: config.workers,
          ...(spec.path !== undefined ? { modelPath: spec.path } : {}),
          sim: config.sim,
          routingPolicy: config.routingPolicy,
          ...(config.schedulingPolicy !== undefined ? { policy: config.schedulingPolicy } : {}),
          ...(config.prefillWorkers !== undefined ? { prefillWorkers: config.prefillWorkers, decodeWorkers: config.decodeWorkers } : {}),
          ...(config.disaggregationPolicy !== undefined ? { disaggregationPolicy: config.disaggregationPolicy } : {}),
          migrationLimit: config.migrationLimit,
          workerRestartLimit: config.workerRestartLimit,
          workerRestartDelayMs: config.workerRestartDelayMs,
          log: (level, message) => logger[level](specs.length > 1 ? `${spec.path}: ${message}` : message),
          ...(spec.servedModelName !== undefined ? { servedModelName: spec.servedModelName } : {}),
          ...(config.maxNumSeqs !== undefined ? { maxNumSeqs: config.maxNumSeqs } : {}),
          ...(config.maxNumBatchedTokens !== undefined ? { maxNumBatchedTokens: config.maxNumBatchedTokens } : {}),
          ...(config.maxModelLen !== undefined ? { maxModelLen: config.maxModelLen } : {}),
          enablePrefixCaching: config.enablePrefixCaching,
          guidedJumpForward: config.guidedJumpForward,
          streamInterval: config.streamInterval,
          ...(config.kvCacheMemoryBytes !== undefined ? { kvCacheMemoryBytes: config.kvCacheMemoryBytes } : {}),
          ...(config.kvDtype !== undefined ? { kvDtype: config.kvDtype } : {}),
          kvCacheIdleReleaseSeconds: config.kvCacheIdleReleaseSeconds,
          // The offload budgets are the server's: split between the models, as each pool splits its share between
          // its workers.
          ...(config.kvOffloadMemoryBytes !== undefined ? { kvOffloadMemoryBytes: Math.floor(config.kvOffloadMemoryBytes / specs.length) } : {}),
          ...(diskDir !== undefined ? { kvOffloadDiskDir: diskDir, kvOffloadDiskBytes: Math.floor(config.kvOffloadDiskBytes! / specs.length) } : {}),
          ...(threads !== undefined ? { threads } : {}),
          ...(config.loraDtype !== undefined ? { loraDtype: config.loraDtype } : {}),
          backend: config.backend,
        });
        const name = spec.servedModelName ?? modelIdFromName(pool.engine.info.modelName);
        let generation: { defaults: GenerationDefaults; file: string } | undefined;
        try {
          generation = config.engine === 'cpu' ? await generationDefaultsFor(config.generationConfig, spec.path) : undefined;
          if (generation !== undefined) {
            // Against the vocabulary a request's token ids are checked against (the gateway's: the smaller of the two).
            checkGenerationVocabulary(generation.defaults, Math.min(pool.engine.info.vocabSize, pool.tokenizer.vocabSize),
              generation.file);
          }
        } catch (error) {
          // This pool is not yet among `served`, whose engines the catch below closes: its workers would keep the
          // process alive after the start failed.
          await pool.engine.close();
          throw error;
        }
        const shownDefaults = generation !== undefined ? describeGenerationDefaults(generation.defaults) : '';
        if (shownDefaults !== '') {
          logger.info(`${name}: requests that leave them out get ${shownDefaults} (${generation!.file}; --generation-config vllm: OpenAI's defaults)`);
        }
        const adapters = pool.engine.loadLora
          ? new LoraManager(pool.engine, config.maxLoras ?? DEFAULT_MAX_LORAS, (message) => logger.info(`${name}: ${message}`),
            config.maxLoraRank ?? DEFAULT_MAX_LORA_RANK) : undefined;
        served.push({
          name, backend: {
            engine: pool.engine, workerId: pool.workers[0]!.id, tokenizer: pool.tokenizer,
            chatTemplate: config.chatTemplate !== undefined ? pool.chatTemplate.withTemplate(config.chatTemplate) : pool.chatTemplate,
            ...(adapters ? { adapters } : {}), ...(pool.clock ? { clock: pool.clock } : {}),
            ...(pool.holdClock ? { holdClock: pool.holdClock } : {}),
            ...(generation !== undefined ? { generationDefaults: generation.defaults } : {}),
          },
        });
        if (served.slice(0, -1).some((other) => other.name === name)) {
          throw new UsageError(`two models would be served as "${name}": name them (--model NAME=PATH or --served-model-name)`);
        }
        for (const { level, message } of pool.notices) logger[level](specs.length > 1 ? `${name}: ${message}` : message);
        if (pool.chatTemplate.isFallback && config.chatTemplate === undefined) {
          const source = config.engine === 'sim' ? 'the Llama 2 vocabulary simulated workers tokenize with' : spec.path;
          logger.warn(`${source} has no chat template: /v1/chat/completions renders messages with the `
            + 'plain fallback ("role: content" paragraphs, then "assistant:"); /v1/completions takes prompts as they are');
        }
      }
      for (const { name, path, base } of config.loraModules ?? []) {
        const model = base === undefined ? served[0]! : served.find((m) => m.name === base);
        if (!model) throw new UsageError(`--lora-modules ${name}: base model "${base}" is not served (${served.map((m) => m.name).join(', ')})`);
        const adapters = model.backend.adapters;
        if (!adapters) throw new UsageError(`--lora-modules ${name}: the workers of ${model.name} run no LoRA adapters`);
        if (served.some((m) => m.name === name)) throw new UsageError(`--lora-modules ${name}: a served model has that name`);
        try {
          const info = await adapters.register(name, path) as LoraLoadInfo;
          logger.info(`LoRA adapter ${name} (${info.format}, rank ${info.rank}${info.dtype ? `, stored as ${info.dtype}` : ''}) loaded from ${path} for ${model.name}`);
        } catch (error) {
          throw new UsageError(`--lora-modules ${name}=${path}: ${(error as Error).message}`);
        }
      }
    } catch (error) {
      await Promise.all(served.map(({ backend }) => backend.engine.close()));
      throw error;
    }
    api.attachModels(served);
    const workers = config.prefillWorkers !== undefined
      ? `${config.prefillWorkers} prefill + ${config.decodeWorkers} decode (disaggregated)`
      : config.workers > 1 || config.workerProcesses ? `${config.workers} behind the ${config.routingPolicy} router` : '1';
    const shownWorkers = config.workerProcesses ? `${workers}, as child processes` : workers;
    const shownModel = specs.length > 1 ? specs.map((spec, i) => `${served[i]!.name}=${spec.path}`).join(', ')
      : modelPath ?? `simulated ${config.sim.model} profile, built-in Llama 2 tokenizer`;
    return { api, keyStore, url: api.url, modelPath: shownModel, workers: `${shownWorkers}${config.engine === 'sim' ? `, simulated ${config.sim.model} on ${config.sim.tp} x ${config.sim.gpu} each` : ''}` };
  } catch (err) {
    await api.shutdown(0);
    throw err;
  }
}

export function startupBanner(running: RunningServer): string {
  const { keyStore } = running;
  const engine = running.api.gateway.engine!;
  const { info } = engine;
  const stats = engine.stats();
  const model = running.api.gateway.servedModelName!;
  const display = running.api.gateway.modelDisplayName;
  // One line for what can be dozens of kernels: how many run each variant (/health lists them one by one).
  const kernelsByVariant = new Map<string, number>();
  for (const variant of Object.values(info.kernelVariants)) kernelsByVariant.set(variant, (kernelsByVariant.get(variant) ?? 0) + 1);
  // A count of 1 says nothing (a simulated worker's one entry is its GPUs, "h100 x4").
  const variants = [...kernelsByVariant].map(([variant, count]) => (count > 1 ? `${variant} x${count}` : variant)).join(', ');
  const example = JSON.stringify({ model, messages: [{ role: 'user', content: 'Hello!' }], max_tokens: 32 });
  const auth = keyStore.isOpen ? '' : " -H 'Authorization: Bearer <your key>'";
  // One sequence of N tokens keeps N - 1 in the KV cache: at kvCapacityTokens + 1 the pool, not the model, is the limit.
  const contextNote = info.maxModelLen === info.kvCapacityTokens + 1 ? ', limited by the KV cache' : '';
  return [
    `Conduit is serving ${running.api.gateway.servedModels.length > 1 ? running.api.gateway.servedModels.map((m) => m.name).join(', ')
      : `${model}${display !== undefined && display !== model ? ` (${display})` : ''}`} at ${running.url}`,
    `  model      ${running.modelPath} (context ${info.maxModelLen} tokens${contextNote}, vocabulary ${info.vocabSize})`,
    `  KV cache   ${info.kvCapacityTokens} tokens (${stats.kvBlocksTotal} blocks of ${info.blockSize}${info.kvDtype !== undefined ? `, ${info.kvDtype}` : ''})`,
    `  backend    ${info.backend}${variants ? ` (kernel variants: ${variants})` : ''}, ${info.threads} thread${info.threads === 1 ? '' : 's'}`,
    `  workers    ${running.workers}`,
    `  auth       ${keyStore.isOpen ? 'open (no API keys)' : `${keyStore.keyCount} API key${keyStore.keyCount === 1 ? '' : 's'}`}`,
    `  try        curl ${running.url}/v1/chat/completions -H 'Content-Type: application/json'${auth} -d '${example}'`,
  ].join('\n');
}

/**
 * Resolves with the signal's name on the first SIGINT/SIGTERM/SIGHUP; calls onRepeat for any later one. SIGHUP (the
 * terminal closed) drains as the others do, where Node's default would end the process mid-stream.
 */
function waitForSignal(onRepeat: () => void): Promise<string> {
  return new Promise((resolve) => {
    let received = false;
    const handler = (signal: string): void => {
      if (received) onRepeat();
      else resolve(signal);
      received = true;
    };
    for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) process.on(signal, handler);
  });
}

/**
 * One line for a start-up error of the system rather than of Conduit: the address cannot be listened on (port in
 * use, a port below 1024 without the right, an address not on this machine, a host name that does not resolve), or
 * a file (the model, the built-in model's cache) cannot be read or written. Undefined for anything else.
 */
export function startupFailure(err: unknown, config: Pick<ServeConfig, 'host' | 'port' | 'modelPath' | 'extraModels'>): string | undefined {
  const e = err as NodeJS.ErrnoException & { hostname?: string };
  if (!(err instanceof Error) || typeof e.code !== 'string') return undefined;
  const address = `${config.host.includes(':') ? `[${config.host}]` : config.host}:${config.port}`;
  if (e.syscall === 'listen') return `cannot listen on ${address}: ${e.message}`;
  if (e.syscall === 'getaddrinfo') {
    return `cannot listen on ${address}: ${e.code === 'ENOTFOUND' || e.code === 'EAI_NONAME' ? `no such host ${config.host}` : 'cannot resolve the host'} (${e.message})`;
  }
  if (typeof e.path !== 'string') return undefined;
  const models = [config.modelPath, ...(config.extraModels ?? []).map((m) => m.path)].filter((p): p is string => p !== undefined);
  const model = models.some((p) => resolve(e.path!) === resolve(p) || resolve(e.path!).startsWith(`${resolve(p)}/`));
  return fileProblem(e, model ? 'model' : undefined);
}

function sourcesOf(config: Pick<ServeConfig, 'flagSources'>): Record<keyof typeof SERVE_FLAGS & string, FlagSource> {
  return (config.flagSources ?? {}) as Record<keyof typeof SERVE_FLAGS & string, FlagSource>;
}

/**
 * A start-up error's message (`--max-model-len N is above the model's context length`) with its flag named by the
 * variable that gave the value, when the environment did: at the start of the message, or after the
 * `worker process ID could not start: ` of a --worker-processes child (serve passed the value on its command line).
 */
export function nameStartupEnvironment(message: string, config: Pick<ServeConfig, 'flagSources'>): string {
  const child = /^worker process \S+ could not start: /.exec(message)?.[0] ?? '';
  return child + nameEnvironmentIn(SERVE_FLAGS, { sources: sourcesOf(config) }, message.slice(child.length));
}

export const serveCommand: Command = {
  summary: 'serve the OpenAI-compatible HTTP API',
  async run(argv) {
    const config = parseServeConfig(argv);
    if (config === 'help') {
      console.log(`Usage: conduit serve [options]\n\n${formatFlagHelp(SERVE_FLAGS)}`);
      return 0;
    }
    const logger = createLogger(config.logLevel);
    let running: RunningServer | undefined;
    let graceMs = config.shutdownGraceMs;
    // Listened for before the model loads: Node's default would end a process signalled mid-load with 128 + the
    // signal's number, as if it had crashed.
    const signalled = waitForSignal(() => {
      if (running === undefined) return;
      logger.warn('second signal: aborting in-flight requests now');
      graceMs = 0;
      running.api.endGrace();
    });
    let startFailed = false;
    void signalled.then((signal) => {
      if (running !== undefined || startFailed) return;
      // Nothing is served yet, so nothing is left to drain or finish: exiting ends the worker threads, and closes the
      // channel of each --worker-processes child, which then exits by itself (a child still loading exits too).
      logger.info(`${signal} during start-up: stopping`);
      process.exit(0);
    });
    try {
      running = await startServer(config, logger);
    } catch (err) {
      startFailed = true;
      // Fatal start-up errors go to stderr whatever --log-level says: a server that does not start must say why.
      const failure = startupFailure(err, config);
      if (failure !== undefined) {
        console.error(`conduit serve: ${failure}`);
        return 1;
      }
      const { isModelLoadError } = await import('../model/loader.ts');
      const { DiskTierLockedError } = await import('../engine/kv-cache/disk-tier.ts');
      if (isModelLoadError(err) || err instanceof DiskTierLockedError || err instanceof EngineStartError) {
        console.error(`conduit serve: ${nameStartupEnvironment(explainTierShare(err.message, config), config)}`);
        // A --kv-cache-memory, --kv-offload-memory or --kv-offload-disk-size too small for one block of the model is a
        // bad value, known only once it loaded.
        return isTierSizeTooSmall(err) ? 2 : 1;
      }
      // A value nobody typed is reported under the variable that gave it, as when the options were checked.
      throw nameEnvironment(SERVE_FLAGS, { sources: sourcesOf(config) }, err);
    }
    process.stderr.write(`${startupBanner(running)}\n`);

    const signal = await signalled;
    logger.info(`${signal}: shutting down, in-flight requests get up to ${graceMs / 1000} s`);
    await running.api.shutdown(graceMs);
    logger.info('stopped');
    // Anything still holding the event loop open past this point is a leak; do not let it keep the process alive.
    setTimeout(() => process.exit(0), 2000).unref();
    return 0;
  },
};
