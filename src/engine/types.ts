// What the engine takes and gives back. The gateway converts OpenAI JSON to these at the edge; the engine never
// sees raw JSON. Names follow vLLM's SamplingParams where OpenAI is silent.

import type { EngineStats, StepBatchSummary, WorkerCostSummary } from '../protocols/worker.ts';
import type { LoraDtype } from '../model/lora.ts';
import type { KvDtype } from '../kernels/types.ts';

export interface SamplingParams {
  /** 0 = greedy. */
  temperature: number;
  topP: number;
  /** 0 or -1 = off. */
  topK: number;
  minP: number;
  repetitionPenalty: number;
  presencePenalty: number;
  frequencyPenalty: number;
  /** token id -> bias added to its logit. */
  logitBias?: ReadonlyMap<number, number>;
  /** Per-request seed: the same seed gives the same tokens whatever else is in the batch. */
  seed?: number;
  /** Number of completions sharing the prompt (n > 1 shares prompt blocks). */
  n: number;
  maxTokens: number;
  minTokens: number;
  ignoreEos: boolean;
  stopTokenIds: readonly number[];
  /**
   * The model's end-of-generation ids besides its EOS (the tokenizer's and generation_config.json's eos_token_id)
   * that ignore_eos kept out of stopTokenIds, set when min_tokens is: they end nothing, but min_tokens still holds
   * them back, as vLLM's min_tokens processor holds every end-of-generation id whatever ignore_eos says.
   */
  ignoredEosTokenIds?: readonly number[];
  stop: readonly string[];
  includeStopStrInOutput: boolean;
  /** Return the chosen token's logprob and this many alternatives (null = none). */
  logprobs: number | null;
  /**
   * Return every prompt token's logprob given the tokens before it, with this many alternatives (absent = none):
   * vLLM's prompt_logprobs, and what completions' echo with logprobs shows. From the model's raw logits. Such a
   * request computes its whole prompt (no prefix-cache hits: a cached position has no logits) and runs on one
   * worker (never prefilled for another).
   */
  promptLogprobs?: number;
  skipSpecialTokens: boolean;
  /**
   * Special tokens whose text shows even though skipSpecialTokens: a tool-call format's markers (Hermes' <tool_call>,
   * Llama's <|python_tag|>) that its parser must read, while every other special token stays out of the text.
   */
  keptSpecialTokenIds?: readonly number[];
  /**
   * Constrained decoding: the output must follow this grammar (each logits row is masked to the tokens it allows,
   * and it ends with an end-of-generation token once complete). Plain data, so it crosses threads and processes.
   */
  guided?: GuidedDecoding;
}

/**
 * What a guided output must match. json_schema.schema is the schema's JSON text; a choice is one of the strings
 * exactly; grammar is XGrammar's EBNF (root rule `root`); regex is matched whole. JSON is compact when asked (no
 * whitespace but one space after ',' and ':'), else any whitespace between elements (bounded).
 */
export type GuidedDecoding =
  | { kind: 'json_object'; compact?: boolean }
  | { kind: 'json_schema'; schema: string; compact?: boolean }
  | { kind: 'regex'; pattern: string }
  | { kind: 'choice'; choices: string[] }
  | { kind: 'grammar'; ebnf: string };

export const DEFAULT_SAMPLING: SamplingParams = {
  temperature: 1, topP: 1, topK: 0, minP: 0, repetitionPenalty: 1, presencePenalty: 0, frequencyPenalty: 0,
  n: 1, maxTokens: 16, minTokens: 0, ignoreEos: false, stopTokenIds: [], stop: [], includeStopStrInOutput: false,
  logprobs: null, skipSpecialTokens: true,
};

export type SchedulingPolicy = 'fcfs' | 'priority' | 'deadline';

export interface EngineRequest {
  id: string;
  promptTokenIds: readonly number[];
  sampling: SamplingParams;
  /** Lower value = more important (vLLM's convention). */
  priority: number;
  /** Absolute time (ms, the engine clock) by which the first token should be out; used by the deadline policy. */
  deadlineMs?: number;
  tenant?: string;
  /** Mixed into every block hash so tenants never share cached blocks unless they share the salt. */
  cacheSalt?: string;
  /** W3C traceparent of the request, carried to the worker. */
  traceparent?: string;
  /** The client's conversation id (the session header), which the session routing policy keeps on one worker. */
  sessionId?: string;
  /**
   * The LoRA adapter the request runs with (its name as loaded on the worker: Engine.loadLora), none = the base
   * model. Its KV blocks are cached under the adapter: never shared with the base model or another adapter.
   */
  lora?: string;
  /**
   * A request continued on this worker after its first worker was lost (runtime/migration.ts): the output tokens it
   * had, which now end promptTokenIds. The frequency and presence penalties count them as output, and a guided
   * request's grammar is advanced over them before the first new token, so the output goes on as one whole instead
   * of the grammar starting again mid-output.
   */
  priorOutputTokenIds?: readonly number[];
  /** Engine-clock time the request arrived at the gateway (ms). */
  arrivalMs: number;
}

export type FinishReason = 'stop' | 'length' | 'abort' | 'error';

export interface TokenLogprob {
  tokenId: number;
  logprob: number;
  top: { tokenId: number; logprob: number }[];
  /** The token's rank in its row, 1 = the most likely (set on prompt logprobs, as vLLM reports them). */
  rank?: number;
}

/** Per-phase timestamps (engine clock, ms). */
export interface RequestTimestamps {
  arrival: number;
  queued?: number;
  firstScheduled?: number;
  /**
   * Each prefill chunk's forward pass (start to sampled), the prompt tokens it computed, and the batch of its step:
   * batchSeqs sequences computing batchTokens tokens together.
   */
  /**
   * Forward passes that computed tokens other than a decode step's one: the prompt's chunks, and after the first
   * token the KV of forced (jump-forward) text, of a fork's own prompt position, or, `recompute`, of tokens computed
   * before a preemption.
   */
  prefillChunks: { start: number; end: number; tokens: number; batchSeqs?: number; batchTokens?: number; recompute?: boolean }[];
  firstToken?: number;
  lastToken?: number;
  finished?: number;
  /**
   * Disaggregated serving only: the decode worker copied the prompt's KV blocks it lacked from the prefill worker
   * between start and end (engine clock, ms). blocks and bytes count only what moved (its own prefix-cache hits
   * stay put); the kv_transfer phase of traces and metrics. Between worker processes: link is 'tcp' or 'shm', and
   * overlapMs the transfer's busy time hidden behind the prefill (streamed as chunks completed; start..end is what
   * came after the prefill's end).
   */
  kvTransfer?: { start: number; end: number; bytes: number; blocks: number; link?: string; overlapMs?: number };
  /**
   * Prompt blocks brought back from the worker's lower KV tiers instead of recomputed (--kv-offload-memory,
   * --kv-offload-disk): blocks per tier, bytes, and the copy's duration in ms (it runs before the step's forward
   * pass, inside the scheduler's admission).
   */
  kvOnboard?: { ram: number; disk: number; bytes: number; ms: number };
  /** Sequences already waiting in the worker's queue when the request joined it. */
  queueDepthAtEntry?: number;
  /**
   * The step that first scheduled the request: the tokens it was granted there and when that step's forward pass
   * began. firstScheduled to forwardStart is the budget allocation (planning the step and building its batch).
   */
  budget?: { tokens: number; forwardStart: number };
  /** The decode steps (every step after the first token) the request took part in, summarised. */
  decodeSteps?: StepBatchSummary;
}

/** One engine step as the outputs it produced report it (shared by every output of the step). */
export interface EngineStepFacts {
  /** Worker-local step number. */
  id: number;
  /** When the step's forward pass began and when its tokens were sampled (engine clock, ms). */
  start: number;
  end: number;
  /** Sequences in the batch and tokens they computed together. */
  batchSeqs: number;
  batchTokens: number;
}

/** Kinds of engine failure a request's error output can name (EngineOutput.errorCode). */
export type EngineErrorCode = 'out_of_memory';

export interface EngineOutput {
  requestId: string;
  /** Which of the n completions this output belongs to. */
  index: number;
  newTokenIds: number[];
  textDelta: string;
  logprobs?: TokenLogprob[];
  /**
   * With sampling.promptLogprobs, on each completion's first output: one entry per prompt token, null for the first
   * (nothing comes before it).
   */
  promptLogprobs?: (TokenLogprob | null)[];
  finishReason?: FinishReason;
  /** For finishReason 'stop': the stop string or token id that ended it. */
  stopReason?: string | number;
  usage: { promptTokens: number; completionTokens: number; cachedTokens: number };
  timestamps: RequestTimestamps;
  error?: string;
  /**
   * With finishReason 'error': what kind of failure, when a client can act on it. 'out_of_memory': the worker could
   * not allocate the memory the request's step needed (the API answers 503 out_of_memory; the worker goes on).
   */
  errorCode?: EngineErrorCode;
  /** Where the request was placed, when a router placed it (set on every output of a routed request). */
  routing?: RoutingSummary;
  /** The step that produced this output (absent on outputs no step produced: aborts, rejections). */
  step?: EngineStepFacts;
  /**
   * With --stream-interval above 1: the steps of the earlier tokens this output carries (held back by the worker and
   * handed over with this one), in order, before `step`.
   */
  heldSteps?: EngineStepFacts[];
  /** The request's traceparent as the engine was given it, handed back so its facts join the right trace. */
  traceparent?: string;
}

/** The router's decision as the request's trace and timings show it. */
export interface RoutingSummary {
  workerId: string;
  strategy: string;
  /** Prompt blocks the chosen worker already held. */
  overlapBlocks: number;
  /** Workers the router chose among (those not busy). */
  candidates?: number;
  reason: string;
  /**
   * The cost policy's terms for the cheapest workers it weighed (at most MAX_TRACED_COSTS, the chosen one always
   * among them), cheapest first: why this worker and not another, as the trace shows it.
   */
  costs?: WorkerCostSummary[];
  /** Time spent deciding (hashing, index lookup, selection), µs. */
  overheadUs: { hashing: number; lookup: number; selection: number; total: number };
  /** Engine-clock time the decision was made. */
  decidedAt: number;
  /**
   * Engine-clock time the decision began: when the request reached the router or, after a wait in its admission
   * queue, the later of the entry there and decidedAt less the measured overhead. On the same clock as decidedAt,
   * so the router_lookup phase is consistent whatever that clock is (a simulated one does not move with the
   * router's real cost). Absent: the phase starts at decidedAt less the overhead.
   */
  startedAt?: number;
  /**
   * Engine-clock time the request entered the router's admission queue, set only when it had to wait there for a
   * worker with room: that wait, up to the decision, is queue time.
   */
  admissionQueuedAt?: number;
  /** Set by a disaggregated deployment: where the prompt ran and why. workerId is then the decode worker. */
  disaggregation?: DisaggregationSummary;
  /** Set once the request moved to another worker after losing one (workerId is then where it runs now). */
  migrations?: MigrationRecord[];
}

/** One move of a request from a lost worker to another (src/runtime/migration.ts). */
export interface MigrationRecord {
  fromWorkerId: string;
  /** Unset while the request waits for a worker to take it. */
  toWorkerId?: string;
  /** Tokens the caller had received when the worker was lost (they became part of the new worker's prompt). */
  afterTokens: number;
  reason: string;
}

/** What a worker does in a disaggregated deployment. 'both' is the ordinary aggregated worker. */
export type WorkerRole = 'prefill' | 'decode' | 'both';

/**
 * Why a request was prefilled where it was:
 * - remote-prefill: on a prefill worker, its KV then copied to the decode worker;
 * - short-prompt: the decode worker lacked too few prompt tokens to be worth a round trip;
 * - prefill-queue-full: every prefill worker had more prefill queued than the bound (or was busy);
 * - transfer-slower: moving the KV would take longer than computing it on the decode worker;
 * - transfer-probe: on a prefill worker although the estimates said transfer-slower, to measure the link again
 *   (after several transfer-slower decisions in a row: runtime/disaggregation-policy.ts TransferProbe);
 * - not-eligible: the request cannot be handed over (n > 1, prompt logprobs, or no prefill worker's context or
 *   adapters take it);
 * - prefill-failed / transfer-failed: the disaggregated path broke and the decode worker computed the prompt itself.
 */
export type DisaggregationReason =
  | 'remote-prefill' | 'transfer-probe' | 'short-prompt' | 'prefill-queue-full' | 'transfer-slower' | 'not-eligible'
  | 'prefill-failed' | 'transfer-failed';

export interface DisaggregationSummary {
  /** 'disaggregated': prefill worker then decode worker; 'local': the decode worker ran the prompt itself. */
  mode: 'disaggregated' | 'local';
  reason: DisaggregationReason;
  /** Human-readable: the numbers behind the reason. */
  detail: string;
  prefillWorkerId?: string;
  decodeWorkerId: string;
  /**
   * Prompt tokens the decode worker did not hold in its primary pool (what a local prefill computes, or copies back
   * for blocks it holds in its RAM or disk tier).
   */
  uncachedTokens: number;
  /** Blocks the transfer would move and the estimates the decision compared, ms. */
  transferBlocks: number;
  estimatedTransferMs: number;
  estimatedPrefillMs: number;
}

/** What a worker reports about itself (the router's load view, /health, the start-up banner). */
export interface EngineInfo {
  modelName: string;
  /** Longest prompt + output the engine accepts (the model's context length, possibly capped). */
  maxModelLen: number;
  vocabSize: number;
  /** KV capacity: numBlocks * blockSize. */
  kvCapacityTokens: number;
  blockSize: number;
  /**
   * How the KV cache stores keys and values: the dtype --kv-cache-dtype resolved to (auto: the backend's choice), or
   * the simulated engine's KV elements at 2 bytes ('f16'). Absent from a worker that does not report it.
   */
  kvDtype?: KvDtype;
  /** 'native' or 'reference' (or 'sim'). */
  backend: string;
  /**
   * How the weights are stored: the storage type holding most parameters (GGUF type names such as Q8_0, F32, BF16;
   * the simulated engine's weight dtype). The `quantization` label of the prefill metrics.
   */
  quantization?: string;
  kernelVariants: Record<string, string>;
  threads: number;
}

/**
 * One worker as the gateway and router see it. Implementations: the local engine (real model on the CPU
 * backends, its step loop in a worker thread), the simulated engine, and a remote proxy; callers cannot tell them
 * apart.
 */
export interface Engine {
  readonly info: EngineInfo;
  /**
   * Starts a request. Outputs arrive as they are produced (one per step per completion, text deltas already
   * stop-string-checked); the last output of each completion carries finishReason. Rejects (throws from the
   * iterator) with an Error whose message is fit for a client when the request cannot run (e.g. longer than the
   * KV pool).
   */
  generate(request: EngineRequest): AsyncIterable<EngineOutput>;
  /** Stops a request wherever it is and frees its KV blocks; its stream ends with finishReason 'abort'. */
  abort(requestId: string): void;
  stats(): EngineStats;
  /**
   * Every worker forgets its cached prefixes and gives its KV pool's memory back to the system where it can.
   * Resolves false when a worker had blocks in use (running requests): that worker kept its cache.
   */
  resetPrefixCache(): Promise<boolean>;
  /**
   * Loads a LoRA adapter (a GGUF adapter file or a PEFT folder) onto every worker under `name`; rejects with a
   * LoraLoadError naming the problem when it does not fit the model. Optional: engines without adapters lack it.
   */
  loadLora?(name: string, path: string): Promise<LoraLoadInfo>;
  /** Unloads an adapter from every worker (no request may be using it). */
  unloadLora?(name: string): Promise<void>;
  close(): Promise<void>;
}

/** What loading an adapter found (from the first worker). */
export interface LoraLoadInfo {
  /** 'synthetic': a simulated worker's adapter without a file (src/sim/sim-lora.ts). */
  format: 'gguf' | 'peft' | 'synthetic';
  rank: number;
  alpha: number;
  bytes: number;
  /** How the worker's backend stores the adapter (--lora-dtype; the native backend), absent elsewhere. */
  dtype?: LoraDtype;
  /**
   * Digest of the bytes the worker loaded (loraDigest: the adapter's key is made from it), from engines that read
   * the file themselves; absent from simulated and remote workers.
   */
  digest?: string;
}
