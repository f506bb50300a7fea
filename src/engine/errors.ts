// Every error an engine throws or ends a stream with, in one place. Each has a distinct `name` and a stable `code`.
// Callers (the gateway's engineFailure in src/api/generation-run.ts, migration) tell them apart by name, not by
// class identity; an error from a worker thread is rebuilt on this side from the message the thread sent
// (structured clone would keep only its message).

/**
 * Why the engine refused a request as given; the gateway answers 400 with this code. The type is this list's, so a
 * code added here is also one a refusal keeps when it crosses a thread or process (InvalidRequestError.fromWorker).
 */
const REJECTION_CODES = [
  'invalid_request', 'duplicate_request_id', 'prompt_too_long', 'prompt_exceeds_kv_pool', 'too_many_samples',
  // A decode worker could not continue a handed-off request.
  'handoff_failed',
  // The request names a LoRA adapter this worker has not loaded.
  'lora_not_loaded',
] as const;
export type RejectionCode = typeof REJECTION_CODES[number];

/** The code of every engine error, for logs and for the gateway's mapping. */
export type EngineErrorCode = RejectionCode | 'engine_closed' | 'engine_overloaded' | 'worker_lost';

/** A request the engine will not accept (local, simulated or routed); `code` lets the gateway map it to a status. */
export class InvalidRequestError extends Error {
  override name = 'InvalidRequestError';
  readonly code: RejectionCode;
  readonly requestId: string;

  constructor(code: RejectionCode, requestId: string, message: string) {
    super(`request ${JSON.stringify(requestId)}: ${message}`);
    this.code = code;
    this.requestId = requestId;
  }

  /** The refusal a worker thread reported, its message already whole. */
  static fromWorker(code: string, requestId: string, message: string): InvalidRequestError {
    const error = new InvalidRequestError(isRejectionCode(code) ? code : 'invalid_request', requestId, '');
    error.message = message;
    return error;
  }
}

const REJECTION_CODE_SET: ReadonlySet<string> = new Set<string>(REJECTION_CODES);

export function isRejectionCode(code: string): code is RejectionCode {
  return REJECTION_CODE_SET.has(code);
}

/** The engine (any kind: local, simulated, routed, disaggregated) is closed or closing. The gateway answers 503. */
export class EngineClosedError extends Error {
  override name = 'EngineClosedError';
  readonly code = 'engine_closed';
}

/** Every worker is busy and the admission queue is full: come back later. The gateway answers 503 + Retry-After. */
export class EngineOverloadedError extends Error {
  override name = 'EngineOverloadedError';
  readonly code = 'engine_overloaded';
  constructor(message: string, readonly retryAfterMs: number) {
    super(message);
  }
}

/**
 * No worker can take the request: none is registered, or every one was lost. Not an overload: waiting helps only
 * while a restart is under way (`retryAfterMs` set then); `final` when nothing will bring a worker back (restarts
 * gave up or are off, the workers are closed). The gateway answers 503 `no_worker_available`.
 */
export class EngineUnavailableError extends Error {
  override name = 'EngineUnavailableError';
  readonly code = 'engine_unavailable';
  constructor(message: string, readonly retryAfterMs: number | undefined, readonly final: boolean) {
    super(message);
  }
}

/** The worker running the request went away (thread died, host lost). */
export class WorkerLostError extends Error {
  override name = 'WorkerLostError';
  readonly code = 'worker_lost';
  constructor(readonly workerId: string, message: string) {
    super(message);
  }
}

/**
 * An engine worker refused to start with its configuration (a KV pool too small for one block, --max-model-len above
 * the model's context ...): the worker's own reason, which the CLI prints as one line.
 */
export class EngineStartError extends Error {
  override name = 'EngineStartError';
}

/** A LoRA adapter that could not be loaded (bad file, wrong shapes, another base model) or unloaded (in use). */
export class LoraLoadError extends Error {
  override name = 'LoraLoadError';
  /** 'invalid_adapter': the file; 'lora_in_use': requests still run with it; 'lora_not_loaded': no such adapter. */
  readonly code: 'invalid_adapter' | 'lora_in_use' | 'lora_not_loaded';
  constructor(code: LoraLoadError['code'], message: string) {
    super(message);
    this.code = code;
  }
}
