// The load generator: sends a workload's prompts to an OpenAI-compatible server, either open-loop (arrivals at a
// mean rate, whatever the server's speed, so queueing shows up in the latencies: Poisson, or burstier or steadier
// with gamma-distributed gaps as vLLM's `--burstiness`) or closed-loop (a fixed number of clients, each sending its
// next request when the last one ends). A run is always bounded: by a request count,
// a duration, or both (whichever comes first), plus a per-request timeout, so it stops by itself.

import { setMaxListeners } from 'node:events';
import { createTarget, fetchModelId, sendRequest, underRoot, type RequestOutcome, type Target } from './client.ts';
import { distribution, type Distribution } from '../util/stats.ts';
import { seededRandom, type PromptSpec, type Workload } from './prompt-workload.ts';

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
  /**
   * Sampling parameters sent with every request (as temperature and top_p; logprobs: the number of alternatives,
   * as logprobs on completions and logprobs true with top_logprobs on chat); those not given are not sent.
   */
  sampling?: { temperature?: number; topP?: number; logprobs?: number };
  stream: boolean;
  /** Arrivals per second (open loop). Without it the run is closed-loop with `concurrency` clients. */
  rate?: number;
  /**
   * Shape of the gamma distribution of the gaps between arrivals (open loop), as vLLM's --burstiness: 1 (default) is
   * a Poisson process, below 1 burstier, above 1 steadier; the mean rate stays `rate`.
   */
  burstiness?: number;
  /** Targets a request must meet to count towards goodput (vLLM's --goodput): all that are given. */
  goodput?: GoodputTargets;
  /** Called every `intervalMs` while the run goes on, and once at its end. */
  progress?: { intervalMs: number; report(progress: LoadProgress): void };
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
  /**
   * Before the run, send its first request once, as `vllm bench serve` does, not counted; if it fails (no server
   * there, a wrong path, model or parameter) runLoad throws a BenchProbeError and sends no load.
   */
  probe?: boolean;
}

/** The probe request failed (LoadOptions.probe): what failed, and how. */
export class BenchProbeError extends Error {
  override name = 'BenchProbeError';
  constructor(readonly url: string, readonly outcome: RequestOutcome) {
    super(`the first request, sent once before the load, failed: ${outcome.error ?? 'unknown'}`
      + `${outcome.errorMessage !== undefined ? ` (${JSON.stringify(outcome.errorMessage)})` : ''} from ${url}`);
  }
}

export interface GoodputTargets {
  ttftMs?: number;
  /** Time per output token after the first. */
  tpotMs?: number;
  /** End-to-end latency. */
  e2elMs?: number;
}

/** Where a run is, for a progress line. */
export interface LoadProgress {
  elapsedSec: number;
  started: number;
  done: number;
  ok: number;
  errors: number;
  inFlight: number;
  outputTokens: number;
  /** The request bound, if any. */
  total?: number;
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
  /**
   * Time per output token after the first, per request: (end-to-end - TTFT) / (completion tokens - 1), as vLLM
   * defines it; streamed requests of two tokens or more.
   */
  tpotMs: Distribution;
  e2eMs: Distribution;
  /** Requests that met every goodput target, when targets were given. */
  goodput?: { targets: GoodputTargets; numGood: number; requestsPerSec: number };
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
  mode: { kind: 'open'; rate: number; burstiness: number; maxInFlight?: number } | { kind: 'closed'; concurrency: number };
  /** Seed of the prompts and arrival times: a rerun with it sends the same prompts at the same times. */
  seed?: number;
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
    if (options.probe) await probe(options, target, model, timeoutMs);
    const startedAt = new Date().toISOString();
    const run = new Run(options, target, model, timeoutMs);
    const progress = options.progress;
    const timer = progress ? setInterval(() => progress.report(run.progress()), progress.intervalMs) : undefined;
    try {
      if (open) await run.openLoop(options.rate!, concurrency);
      else await run.closedLoop(concurrency!);
    } finally {
      clearInterval(timer);
    }
    progress?.report(run.progress());
    const requests = run.outcomes.sort((a, b) => a.index - b.index);
    return {
      url: options.url, endpoint: options.endpoint, ...(model !== undefined ? { model } : {}), stream: options.stream,
      workload: options.workload.description, outputTokens: options.outputTokens,
      mode: open ? { kind: 'open', rate: options.rate!, burstiness: options.burstiness ?? 1, ...(concurrency !== undefined ? { maxInFlight: concurrency } : {}) }
        : { kind: 'closed', concurrency: concurrency! },
      ...(options.seed !== undefined ? { seed: options.seed } : {}),
      bounds: {
        ...(options.requests !== undefined ? { requests: options.requests } : {}),
        ...(options.durationSec !== undefined ? { durationSec: options.durationSec } : {}),
      },
      startedAt,
      summary: summarize(requests, run.maxInFlight, run.numDelayedArrivals, options.goodput),
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
  positive('burstiness', options.burstiness, false);
  if (options.burstiness !== undefined && options.rate === undefined) throw new RangeError('burstiness needs a rate (open loop)');
  for (const [name, value] of Object.entries(options.goodput ?? {})) positive(`goodput ${name}`, value, false);
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
  private done = 0;
  private ok = 0;
  private outputTokens = 0;
  private readonly startedMs = performance.now();
  private readonly deadlineMs: number;
  private readonly path: string;
  /** Wakes the open loop when a slot frees. */
  private slotFreed: (() => void) | undefined;

  constructor(private readonly options: LoadOptions, private readonly target: Target, private readonly model: string | undefined,
    private readonly timeoutMs: number) {
    this.deadlineMs = options.durationSec !== undefined ? performance.now() + options.durationSec * 1000 : Infinity;
    this.path = ENDPOINT_PATHS[options.endpoint];
  }

  progress(): LoadProgress {
    return {
      elapsedSec: (performance.now() - this.startedMs) / 1000, started: this.nextIndex, done: this.done, ok: this.ok,
      errors: this.done - this.ok, inFlight: this.inFlight, outputTokens: this.outputTokens,
      ...(this.options.requests !== undefined ? { total: this.options.requests } : {}),
    };
  }

  private countReached(): boolean {
    return this.options.requests !== undefined && this.nextIndex >= this.options.requests;
  }

  /** Time up or aborted: nothing more starts. */
  private stopped(): boolean {
    return this.options.signal?.aborted === true || performance.now() >= this.deadlineMs;
  }

  /** The next request index, or undefined when the run is over (count reached, time up, aborted). */
  private claim(): number | undefined {
    if (this.stopped() || this.countReached()) return undefined;
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
    const burstiness = this.options.burstiness ?? 1;
    const running = new Set<Promise<void>>();
    let dueMs = performance.now();
    while (!this.countReached()) {
      // Gamma gaps of mean 1 / rate (shape = burstiness); shape 1 is the exponential: a Poisson process.
      dueMs += gammaSample(random, burstiness, 1 / (rate * burstiness)) * 1000;
      const waitMs = Math.min(dueMs, this.deadlineMs) - performance.now();
      if (waitMs > 0) await sleep(waitMs, this.options.signal);
      // An arrival due after the run's end (or cut by an abort) never comes: it did not wait for a slot either.
      if (this.stopped()) break;
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
    const { workload, stream } = this.options;
    const prompt = workload.prompt(index);
    const body = requestBody(this.options, this.model, prompt);
    this.inFlight++;
    this.maxInFlight = Math.max(this.maxInFlight, this.inFlight);
    try {
      const outcome = await sendRequest(this.target, {
        path: this.path, body, stream, timeoutMs: this.timeoutMs, index,
        ...(prompt.group !== undefined ? { group: prompt.group } : {}),
        ...(this.options.signal ? { signal: this.options.signal } : {}),
      });
      this.outcomes.push(outcome);
      this.done++;
      if (outcome.ok) {
        this.ok++;
        this.outputTokens += outcome.completionTokens;
      }
    } finally {
      this.inFlight--;
      const wake = this.slotFreed;
      this.slotFreed = undefined;
      wake?.();
    }
  }
}

/** The body of one request of the run: the prompt, max_tokens and the sampling parameters given. */
function requestBody(options: LoadOptions, model: string | undefined, prompt: PromptSpec): Record<string, unknown> {
  const { stream, outputTokens, endpoint, ignoreEos, sampling } = options;
  const body: Record<string, unknown> = { ...(model !== undefined ? { model } : {}) };
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
  if (sampling?.temperature !== undefined) body.temperature = sampling.temperature;
  if (sampling?.topP !== undefined) body.top_p = sampling.topP;
  if (sampling?.logprobs !== undefined) {
    if (endpoint === 'chat') {
      body.logprobs = true;
      body.top_logprobs = sampling.logprobs;
    } else {
      body.logprobs = sampling.logprobs;
    }
  }
  if (stream) {
    body.stream = true;
    body.stream_options = { include_usage: true };
  }
  return body;
}

/**
 * The run's first request, sent once before the load and not counted (LoadOptions.probe): a server that is not
 * there, or refuses the run's path, model or parameters, stops the run before it sends thousands of failing requests.
 * An abort meanwhile is no failure: the run then starts nothing and reports.
 */
async function probe(options: LoadOptions, target: Target, model: string | undefined, timeoutMs: number): Promise<void> {
  const path = ENDPOINT_PATHS[options.endpoint];
  const prompt = options.workload.prompt(0);
  const outcome = await sendRequest(target, {
    path, body: requestBody(options, model, prompt), stream: options.stream, timeoutMs, index: 0,
    ...(prompt.group !== undefined ? { group: prompt.group } : {}),
    ...(options.signal ? { signal: options.signal } : {}),
  });
  if (!outcome.ok && !options.signal?.aborted) {
    throw new BenchProbeError(underRoot(target.baseUrl, path).href, outcome);
  }
}

/** The longest delay a Node timer holds: a longer one fires after 1 ms. */
const MAX_TIMER_MS = 2 ** 31 - 1;

/**
 * Waits `ms` (or until the signal aborts). A wait longer than a timer holds (the gaps of a rate of one request in
 * 25 days or less) is taken in pieces, so it is not cut to 1 ms.
 */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve();
    const endMs = performance.now() + ms;
    let timer: ReturnType<typeof setTimeout> | undefined;
    const done = (): void => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', done);
      resolve();
    };
    // A timer may fire a little before performance.now() says it is due (libuv counts from the loop's cached time):
    // each firing checks, and waits again for what is left.
    const wait = (): void => {
      const leftMs = endMs - performance.now();
      if (leftMs <= 0) done();
      else timer = setTimeout(wait, Math.min(leftMs, MAX_TIMER_MS));
    };
    signal?.addEventListener('abort', done);
    wait();
  });
}

/**
 * A draw from the gamma distribution of `shape` and `scale` (mean shape x scale), by Marsaglia and Tsang's method;
 * for a shape below 1, a draw of shape + 1 times u^(1/shape). Uniforms from `random`, so a seed repeats the draws.
 */
export function gammaSample(random: () => number, shape: number, scale: number): number {
  if (shape === 1) return -Math.log(1 - random()) * scale;
  if (shape < 1) return gammaSample(random, shape + 1, scale) * (1 - random()) ** (1 / shape);
  const d = shape - 1 / 3;
  const c = 1 / Math.sqrt(9 * d);
  for (let attempt = 0; attempt < 1000; attempt++) {
    // A standard normal by Box-Muller; 1 - u is in (0, 1], so the log is finite.
    const x = Math.sqrt(-2 * Math.log(1 - random())) * Math.cos(2 * Math.PI * random());
    const v = (1 + c * x) ** 3;
    if (v <= 0) continue;
    const u = 1 - random();
    if (Math.log(u) < 0.5 * x * x + d - d * v + d * Math.log(v)) return d * v * scale;
  }
  return shape * scale;
}

/** Time per output token after the first (vLLM's TPOT), or undefined when it has no meaning for the request. */
export function tpotOf(r: RequestOutcome): number | undefined {
  if (!r.ok || r.ttftMs === undefined || r.completionTokens < 2) return undefined;
  return (r.e2eMs - r.ttftMs) / (r.completionTokens - 1);
}

/** Whether a request met every target given (a TTFT or TPOT target is missed by a request that has none). */
export function meetsGoodput(r: RequestOutcome, targets: GoodputTargets): boolean {
  if (!r.ok) return false;
  if (targets.ttftMs !== undefined && !(r.ttftMs !== undefined && r.ttftMs <= targets.ttftMs)) return false;
  if (targets.tpotMs !== undefined) {
    const tpot = tpotOf(r);
    if (!(tpot !== undefined && tpot <= targets.tpotMs)) return false;
  }
  return targets.e2elMs === undefined || r.e2eMs <= targets.e2elMs;
}

export function summarize(requests: readonly RequestOutcome[], maxInFlight = 0, numDelayedArrivals = 0,
  goodput?: GoodputTargets): BenchSummary {
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
    tpotMs: distribution(ok.flatMap((r) => {
      const tpot = tpotOf(r);
      return tpot === undefined ? [] : [tpot];
    })),
    e2eMs: distribution(ok.map((r) => r.e2eMs)),
    ...(goodput && Object.keys(goodput).length > 0 ? (() => {
      const numGood = ok.filter((r) => meetsGoodput(r, goodput)).length;
      return { goodput: { targets: goodput, numGood, requestsPerSec: perSec(numGood) } };
    })() : {}),
    maxInFlight,
    numDelayedArrivals,
  };
}
