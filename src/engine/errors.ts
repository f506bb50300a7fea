// Errors an Engine's stream can end with that callers tell apart by name (they may cross a thread boundary, where
// only name, message and own fields survive).

/** Every worker is busy and the admission queue is full: come back later. The gateway answers 503 + Retry-After. */
export class EngineOverloadedError extends Error {
  override name = 'EngineOverloadedError';
  constructor(message: string, readonly retryAfterMs: number) {
    super(message);
  }
}

/** The worker running the request went away (thread died, host lost). */
export class WorkerLostError extends Error {
  override name = 'WorkerLostError';
  constructor(readonly workerId: string, message: string) {
    super(message);
  }
}
