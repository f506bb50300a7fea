// The router's own types: worker ids, the request as the router sees it, and the decision it hands back (the load
// view a worker reports, and block hashes, are src/protocols/'s). The router decides; it does not send: the caller forwards the
// request to decision.workerId and tells the router when the request's prefill is done and when it finishes.
//
// Serialization notes:
// - Block hashes are the KV cache's branded 16-hex-digit strings (see src/protocols/kv-events.ts); the router never
//   converts them to numbers, so they survive JSON unchanged.
// - Token ids must be integers in [0, 2^32): the hash function rejects anything else.
// - Times given to the router (nowMs) are milliseconds on one monotonic clock shared by every call; the router has
//   no clock of its own.


export type WorkerId = string;

/** Worker ids name NATS subjects and metric labels, so they stay printable and short. */
const WORKER_ID_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$/;

export function parseWorkerId(value: unknown): WorkerId {
  if (typeof value !== 'string' || !WORKER_ID_PATTERN.test(value)) {
    throw new TypeError(`worker id must be 1-128 characters of [A-Za-z0-9._:-], got ${JSON.stringify(value)}`);
  }
  return value;
}

// ---------------------------------------------------------------------------------------------------------------
// Requests

export type PolicyName = 'kv' | 'round-robin' | 'random' | 'least-loaded' | 'power-of-two' | 'session';

export const POLICY_NAMES: readonly PolicyName[] = ['kv', 'round-robin', 'random', 'least-loaded', 'power-of-two', 'session'];

export function parsePolicyName(value: unknown): PolicyName {
  if (typeof value === 'string' && (POLICY_NAMES as readonly string[]).includes(value)) return value as PolicyName;
  throw new TypeError(`routing policy must be one of ${POLICY_NAMES.join(', ')}, got ${JSON.stringify(value)}`);
}

/** Per-request knobs that replace the router's defaults for the kv cost function. */
export interface RoutingOverride {
  overlapWeight?: number;
  temperature?: number;
}

export interface RoutingRequest {
  requestId: string;
  /** The prompt after chat templating and tokenization. */
  tokenIds: readonly number[];
  /** Must be the salt the engine hashes with (EngineRequest.cacheSalt), or no block will ever match. */
  cacheSalt?: string;
  /** Conversation id for the session policy. */
  sessionId?: string;
  /** The LoRA adapter the engine hashes the request's blocks under (EngineRequest.lora). */
  lora?: string;
  /** The served model (or adapter) the request is for: only workers that hold it are candidates (servesModel). */
  model?: string;
  /**
   * The tokens the request may reach: its prompt plus the most it may generate (max_tokens). Workers whose context
   * (Router.setWorkerMaxTokens) holds that many are its candidates; when no registered worker does, those that hold
   * its prompt are (it ends with finish_reason "length" there, as on one engine of that size); a worker too small for
   * the prompt never is. Undefined: only the prompt is checked.
   */
  contextTokens?: number;
  override?: RoutingOverride;
  /**
   * The worker computes the whole prompt whatever it holds (a request for prompt logprobs): no worker's cached or
   * in-flight blocks count as overlap, so its cost and the prefill it adds to its worker are the whole prompt's.
   */
  computesWholePrompt?: boolean;
}

/**
 * Whether a worker that holds `models` may take a request for `model`. A worker that declared no models takes any
 * request, and a request that names none goes anywhere: a deployment of one model needs no declarations.
 */
export function servesModel(models: ReadonlySet<string> | undefined, model: string | undefined): boolean {
  return model === undefined || models === undefined || models.has(model);
}

// ---------------------------------------------------------------------------------------------------------------
// Decisions

/**
 * Why a worker would cost what it costs. Every policy reports these for every known worker, so a decision can be
 * audited (and the policies compared) on the same terms; only the kv policy chooses by `cost`.
 */
export interface WorkerCostTerms {
  workerId: WorkerId;
  /** Leading prompt blocks the worker holds (from KV events or a speculative insert) and would reuse. */
  overlapBlocks: number;
  /** Of overlapBlocks, how many only a speculative insert vouches for. */
  speculativeBlocks: number;
  /**
   * Prompt tokens it would compute for this request plus the prefill already queued on it; blocks it would copy back
   * from a lower tier count at their tier's weight (cost.ts).
   */
  prefillTokens: number;
  /**
   * Of prefillTokens, the prefill already queued on it (reported, or sent by this router), less what computes this
   * request's own prefix: the prompts ahead of this one.
   */
  queuedPrefillTokens: number;
  /** Prompt blocks after overlapBlocks it holds in a lower tier (RAM, disk) and would copy back. */
  lowerTierBlocks?: number;
  /** Of lowerTierBlocks, those it holds only on disk. */
  lowerTierDiskBlocks?: number;
  /**
   * Leading prompt blocks the worker holds, when more than overlapBlocks: every block of a prompt whose length is a
   * multiple of the block size. The engine recomputes the last one (overlapBlocks leaves it out), but a handed-off
   * prompt's KV need not move it (the disaggregation policy counts the blocks a transfer moves by this).
   */
  heldBlocks?: number;
  /** prefillTokens / blockSize. */
  prefillBlocks: number;
  /** Blocks its running requests hold plus the new blocks this request would add. */
  decodeBlocks: number;
  /** overlapWeight * prefillBlocks + decodeBlocks: lower is better. */
  cost: number;
  /** Over the busy threshold (KV usage or queue length): skipped while a non-busy worker exists. */
  busy: boolean;
}

/** Microseconds spent in each sub-phase of one routing call, measured with the injected clock. */
export interface RoutingOverhead {
  hashingUs: number;
  lookupUs: number;
  selectionUs: number;
  totalUs: number;
}

/** Which rule made the choice; `session` means an existing affinity was kept, a new one is made by `kv`. */
export type RoutingStrategy = PolicyName;

export interface RoutingDecision {
  requestId: string;
  workerId: WorkerId;
  /** Prompt blocks the chosen worker is expected to reuse. */
  overlapBlocks: number;
  /** Prompt tokens the chosen worker is expected to compute. */
  newPrefillTokens: number;
  /** One entry per known worker, in registration order. */
  costTerms: WorkerCostTerms[];
  /** Workers the choice was made among (the known ones that were not busy). */
  candidates?: number;
  strategy: RoutingStrategy;
  /** Human-readable: why this worker (for logs and the decision trace). */
  reason: string;
  overhead: RoutingOverhead;
}

export type RouteOutcome =
  | { kind: 'routed'; decision: RoutingDecision }
  /** Every worker is busy: the request waits in the router's admission queue (drainQueue routes it later). */
  | { kind: 'queued'; requestId: string; numQueued: number }
  /**
   * Shed: the queue is full, no worker is registered, none holds the request's model (no-model-workers), or none
   * of those takes a prompt that long (no-context-workers; waiting in the queue would not help either).
   * retryAfterMs is the hint for a Retry-After header.
   */
  | { kind: 'rejected'; requestId: string; reason: 'overloaded' | 'no-workers' | 'no-model-workers' | 'no-context-workers'; retryAfterMs: number };
