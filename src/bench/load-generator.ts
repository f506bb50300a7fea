// The load generator: sends a workload's prompts to an OpenAI-compatible server, either open-loop (Poisson arrivals
// at a mean rate, whatever the server's speed, so queueing shows up in the latencies) or closed-loop (a fixed number
// of clients, each sending its next request when the last one ends). A run is always bounded: by a request count,
// a duration, or both (whichever comes first), plus a per-request timeout, so it stops by itself.

import { setMaxListeners } from 'node:events';
import { createTarget, fetchModelId, sendRequest, type RequestOutcome, type Target } from './client.ts';
import { distribution, type Distribution } from '../util/stats.ts';
import { seededRandom, type Workload } from './prompt-workload.ts';

export type Endpoint = 'chat' | 'completions';

export const ENDPOINT_PATHS: Readonly<Record<Endpoint, string>> = {
  chat: '/v1/chat/completions',
  completions: '/v1/completions',
};

export interface LoadOptions {
  /** Server base URL, e.g. http://127.0.0.1:8000. */
  url: string;
  endpoint: Endpoint;
  /** Sent as "model"; default: the first id GET /v1/models lists (none sent if it lists none). */
  model?: string;
  apiKey?: string;
  workload: Workload;
  /** max_tokens of every request. */
  outputTokens: number;
  /** Send ignore_eos (a vLLM and Conduit extension), so every request generates exactly outputTokens. */
  ignoreEos?: boolean;
  stream: boolean;
  /** Poisson arrivals per second (open loop). Without it the run is closed-loop with `concurrency` clients. */
  rate?: number;
  /** Closed loop: the number of clients (default 1). Open loop: the most requests in flight (default: no cap). */
  concurrency?: number;
  /** Stop after this many requests. */
  requests?: number;
  /** Stop starting requests after this many seconds. */
  durationSec?: number;
  /** Per request (default 120 s). */
  timeoutSec?: number;
  /** Seeds the arrival times (the workload has its own seed). */
  seed?: number;
  /** Stops the run early: nothing new starts and requests in flight are cut (counted as "aborted"). */
  signal?: AbortSignal;
}

export interface BenchSummary {
  numRequests: number;
  numOk: number;
  numErrors: number;
  /** Failed requests by error kind ("http 503 overloaded", "ECONNREFUSED", "timeout", ...). */
  errors: Record<string, number>;
  /** First request sent to last response complete. */
  durationSec: number;
  /** Successful requests per second over durationSec. */
  requestsPerSec: number;
  /** Completion tokens of successful requests per second over durationSec. */
  outputTokensPerSec: number;
  /** Prompt tokens of successful requests per second (when the server reports usage). */
  inputTokensPerSec?: number;
  totalCompletionTokens: number;
  /** Mean server-reported prompt tokens per request. */
  meanPromptTokens?: number;
  /** Prompt tokens the server reported as cached / prompt tokens (when it reports cached_tokens). */
  cachedPromptFraction?: number;
  /** Streamed requests only. */
  ttftMs: Distribution;
  itlMs: Distribution;
  e2eMs: Distribution;
  /** Most requests that were in flight at once. */
  maxInFlight: number;
  /** Open loop with a cap: arrivals that had to wait for a free slot. */
  numDelayedArrivals: number;
}

export interface BenchResult {
  url: string;
  endpoint: Endpoint;
  model?: string;
  stream: boolean;
  workload: string;
  outputTokens: number;
  mode: { kind: 'open'; rate: number; maxInFlight?: number } | { kind: 'closed'; concurrency: number };
  bounds: { requests?: number; durationSec?: number };
  startedAt: string;
  summary: BenchSummary;
  requests: RequestOutcome[];
}

const DEFAULT_TIMEOUT_SEC = 120;

export async function runLoad(options: LoadOptions): Promise<BenchResult> {
  checkOptions(options);
  // Every request in flight listens to the signal; hundreds of listeners are expected, not a leak.
  if (options.signal) setMaxListeners(0, options.signal);
  const open = options.rate !== undefined;
  const concurrency = options.concurrency ?? (open ? undefined : 1);
  // Open loop without a cap still needs a socket bound; 1024 keeps file descriptors in reach of a default ulimit.
  const target = createTarget(options.url, concurrency ?? 1024, options.apiKey);
  const timeoutMs = (options.timeoutSec ?? DEFAULT_TIMEOUT_SEC) * 1000;
  try {
    const model = options.model ?? await fetchModelId(target, Math.min(timeoutMs, 10_000));
    const startedAt = new Date().toISOString();
    const run = new Run(options, target, model, timeoutMs);
    if (open) await run.openLoop(options.rate!, concurrency);
    else await run.closedLoop(concurrency!);
    const requests = run.outcomes.sort((a, b) => a.index - b.index);
    return {
      url: options.url, endpoint: options.endpoint, ...(model !== undefined ? { model } : {}), stream: options.stream,
      workload: options.workload.description, outputTokens: options.outputTokens,
      mode: open ? { kind: 'open', rate: options.rate!, ...(concurrency !== undefined ? { maxInFlight: concurrency } : {}) }
        : { kind: 'closed', concurrency: concurrency! },
      bounds: {
        ...(options.requests !== undefined ? { requests: options.requests } : {}),
        ...(options.durationSec !== undefined ? { durationSec: options.durationSec } : {}),
      },
      startedAt,
      summary: summarize(requests, run.maxInFlight, run.numDelayedArrivals),
      requests,
    };
  } finally {
    target.agent.destroy();
  }
}

function checkOptions(options: LoadOptions): void {
  const positive = (name: string, value: number | undefined, integer: boolean): void => {
    if (value === undefined) return;
    if (!(value > 0) || !Number.isFinite(value) || (integer && !Number.isSafeInteger(value))) {
      throw new RangeError(`${name} must be ${integer ? 'a whole number' : 'a number'} > 0, got ${value}`);
    }
  };
  positive('rate', options.rate, false);
  positive('concurrency', options.concurrency, true);
  positive('requests', options.requests, true);
  positive('durationSec', options.durationSec, false);
  positive('timeoutSec', options.timeoutSec, false);
  positive('outputTokens', options.outputTokens, true);
  if (options.requests === undefined && options.durationSec === undefined) {
    throw new RangeError('a run needs a bound: requests, durationSec or both');
  }
}

class Run {
  readonly outcomes: RequestOutcome[] = [];
  maxInFlight = 0;
  numDelayedArrivals = 0;
  private inFlight = 0;
  private nextIndex = 0;
  private readonly deadlineMs: number;
  private readonly path: string;
  /** Wakes the open loop when a slot frees. */
  private slotFreed: (() => void) | undefined;

  constructor(private readonly options: LoadOptions, private readonly target: Target, private readonly model: string | undefined,
    private readonly timeoutMs: number) {
    this.deadlineMs = options.durationSec !== undefined ? performance.now() + options.durationSec * 1000 : Infinity;
    this.path = ENDPOINT_PATHS[options.endpoint];
  }

  private countReached(): boolean {
    return this.options.requests !== undefined && this.nextIndex >= this.options.requests;
  }

  /** The next request index, or undefined when the run is over (count reached, time up, aborted). */
  private claim(): number | undefined {
    if (this.options.signal?.aborted) return undefined;
    if (this.countReached()) return undefined;
    if (performance.now() >= this.deadlineMs) return undefined;
    return this.nextIndex++;
  }

  async closedLoop(concurrency: number): Promise<void> {
    const client = async (): Promise<void> => {
      for (let index = this.claim(); index !== undefined; index = this.claim()) await this.send(index);
    };
    await Promise.all(Array.from({ length: concurrency }, client));
  }

  async openLoop(rate: number, maxInFlight: number | undefined): Promise<void> {
    const random = seededRandom(this.options.seed ?? 1);
    const running = new Set<Promise<void>>();
    let dueMs = performance.now();
    while (!this.countReached()) {
      // Exponential gaps of mean 1 / rate: a Poisson process. 1 - u is in (0, 1], so the log is finite.
      dueMs += (-Math.log(1 - random()) / rate) * 1000;
      const waitMs = Math.min(dueMs, this.deadlineMs) - performance.now();
      if (waitMs > 0) await sleep(waitMs, this.options.signal);
      if (maxInFlight !== undefined && this.inFlight >= maxInFlight) {
        this.numDelayedArrivals++;
        while (this.inFlight >= maxInFlight && !this.options.signal?.aborted) {
          await new Promise<void>((resolve) => { this.slotFreed = resolve; });
        }
      }
      const index = this.claim();
      if (index === undefined) break;
      const sent = this.send(index).finally(() => running.delete(sent));
      running.add(sent);
    }
    await Promise.all(running);
  }

  private async send(index: number): Promise<void> {
    const { workload, stream, outputTokens, endpoint, ignoreEos } = this.options;
    const prompt = workload.prompt(index);
    const body: Record<string, unknown> = { ...(this.model !== undefined ? { model: this.model } : {}) };
    if (endpoint === 'chat') {
      body.messages = [
        ...(prompt.system !== undefined ? [{ role: 'system', content: prompt.system }] : []),
        { role: 'user', content: prompt.user },
      ];
    } else {
      body.prompt = prompt.system !== undefined ? `${prompt.system}\n\n${prompt.user}` : prompt.user;
    }
    body.max_tokens = outputTokens;
    if (ignoreEos) body.ignore_eos = true;
    if (stream) {
      body.stream = true;
      body.stream_options = { include_usage: true };
    }
    this.inFlight++;
    this.maxInFlight = Math.max(this.maxInFlight, this.inFlight);
    try {
      const outcome = await sendRequest(this.target, {
        path: this.path, body, stream, timeoutMs: this.timeoutMs, index,
        ...(prompt.group !== undefined ? { group: prompt.group } : {}),
        ...(this.options.signal ? { signal: this.options.signal } : {}),
      });
      this.outcomes.push(outcome);
    } finally {
      this.inFlight--;
      const wake = this.slotFreed;
      this.slotFreed = undefined;
      wake?.();
    }
  }
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve();
    const done = (): void => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal?.addEventListener('abort', done);
  });
}

export function summarize(requests: readonly RequestOutcome[], maxInFlight = 0, numDelayedArrivals = 0): BenchSummary {
  const ok = requests.filter((r) => r.ok);
  const errors: Record<string, number> = {};
  for (const r of requests) if (!r.ok) errors[r.error ?? 'unknown'] = (errors[r.error ?? 'unknown'] ?? 0) + 1;
  let firstStartMs = Infinity;
  let lastEndMs = -Infinity;
  for (const r of requests) {
    firstStartMs = Math.min(firstStartMs, r.startMs);
    lastEndMs = Math.max(lastEndMs, r.endMs);
  }
  const durationSec = requests.length > 0 ? (lastEndMs - firstStartMs) / 1000 : 0;
  const perSec = (count: number) => (durationSec > 0 ? count / durationSec : 0);
  const totalCompletionTokens = ok.reduce((sum, r) => sum + r.completionTokens, 0);
  const withPrompt = ok.filter((r) => r.promptTokens !== undefined);
  const promptTokens = withPrompt.reduce((sum, r) => sum + r.promptTokens!, 0);
  const withCached = withPrompt.filter((r) => r.cachedTokens !== undefined);
  const cachedPromptTokens = withCached.reduce((sum, r) => sum + r.cachedTokens!, 0);
  const cachedOf = withCached.reduce((sum, r) => sum + r.promptTokens!, 0);
  return {
    numRequests: requests.length,
    numOk: ok.length,
    numErrors: requests.length - ok.length,
    errors,
    durationSec,
    requestsPerSec: perSec(ok.length),
    outputTokensPerSec: perSec(totalCompletionTokens),
    ...(withPrompt.length > 0 ? { inputTokensPerSec: perSec(promptTokens), meanPromptTokens: promptTokens / withPrompt.length } : {}),
    totalCompletionTokens,
    ...(cachedOf > 0 ? { cachedPromptFraction: cachedPromptTokens / cachedOf } : {}),
    ttftMs: distribution(ok.flatMap((r) => (r.ttftMs !== undefined ? [r.ttftMs] : []))),
    itlMs: distribution(ok.flatMap((r) => r.itlMs)),
    e2eMs: distribution(ok.map((r) => r.e2eMs)),
    maxInFlight,
    numDelayedArrivals,
  };
}
