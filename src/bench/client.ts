// One completion request, timed from the client's side: request written -> first content token (TTFT) -> each
// later token (ITL) -> response complete (e2e). Raw node:http over a keep-alive agent rather than fetch: the
// agent bounds the connections, and a chunk's timestamp is taken in the 'data' handler, with nothing buffering
// in between.

import { Agent as HttpAgent, request as httpRequest, type IncomingMessage } from 'node:http';
import { Agent as HttpsAgent, request as httpsRequest } from 'node:https';
import { SseParser } from './sse-parser.ts';

export interface Target {
  /**
   * Base URL, e.g. http://127.0.0.1:8000; a path prefix is kept and the endpoint path (/v1/...) appended, except a
   * last /v1, as OpenAI clients' base URLs end (http://127.0.0.1:8000/v1), which the endpoint paths already hold.
   */
  baseUrl: URL;
  agent: HttpAgent;
  apiKey?: string;
}

/** A base URL's path without trailing slashes and without a last /v1: the prefix the /v1/... paths go under. */
export function apiRoot(pathname: string): string {
  return pathname.replace(/\/+$/, '').replace(/\/v1$/, '');
}

/** A base URL as given (--url), parsed, with its path cut to the API root (apiRoot). */
function rootedBaseUrl(baseUrl: string): URL {
  let url: URL;
  try {
    url = new URL(baseUrl);
  } catch {
    throw new RangeError(`not a URL: ${JSON.stringify(baseUrl)}`);
  }
  if (url.protocol !== 'http:' && url.protocol !== 'https:') throw new RangeError(`only http and https URLs, got ${url.protocol}`);
  url.pathname = apiRoot(url.pathname);
  return url;
}

/** Where a request for `path` (/v1/...) goes under a base URL already cut to its API root. */
export function underRoot(root: URL, path: string): URL {
  return new URL(root.pathname.replace(/\/$/, '') + path, root);
}

/** The URL a request for `path` (/v1/chat/completions, ...) is sent to under a base URL as given (--url). */
export function endpointUrl(baseUrl: string, path: string): string {
  return underRoot(rootedBaseUrl(baseUrl), path).href;
}

export function createTarget(baseUrl: string, maxSockets: number, apiKey?: string): Target {
  const url = rootedBaseUrl(baseUrl);
  const options = { keepAlive: true, maxSockets, maxFreeSockets: maxSockets, scheduling: 'fifo' as const };
  const agent = url.protocol === 'https:' ? new HttpsAgent(options) : new HttpAgent(options);
  return { baseUrl: url, agent, ...(apiKey !== undefined ? { apiKey } : {}) };
}

/** What happened to one request. Times are performance.now() milliseconds. */
export interface RequestOutcome {
  index: number;
  startMs: number;
  endMs: number;
  ok: boolean;
  /** HTTP status; 0 when no response came (connection refused, reset, timeout). */
  status: number;
  /** Short and stable, so outcomes can be counted by it: "http 503 overloaded", "ECONNREFUSED", "timeout". */
  error?: string;
  /** The server's own words for the failure (error.message of an OpenAI-style error body), when it gave some. */
  errorMessage?: string;
  /** First content token; streamed requests only. */
  ttftMs?: number;
  /** Gaps between consecutive content tokens; streamed requests only. */
  itlMs: number[];
  e2eMs: number;
  /** From the server's usage when it sends one, else the content chunks counted. */
  completionTokens: number;
  promptTokens?: number;
  cachedTokens?: number;
  group?: number;
  /**
   * The server's per-phase milliseconds of the request, when it sends them (Conduit's `timings` on the final body or
   * last chunk: gateway_ms, routing_ms, queue_ms, prefill_ms, kv_transfer_ms, decode_ms, ...); numbers only.
   */
  serverTimings?: Record<string, number>;
}

export interface SendOptions {
  /** Path under the base URL: /v1/chat/completions or /v1/completions. */
  path: string;
  body: object;
  stream: boolean;
  timeoutMs: number;
  index: number;
  group?: number;
  signal?: AbortSignal;
}

interface Usage {
  prompt_tokens?: number;
  completion_tokens?: number;
  prompt_tokens_details?: { cached_tokens?: number } | null;
}

/** Content of a streamed chunk: chat `delta.content` or completions `text`, over all choices. */
function chunkText(chunk: { choices?: { delta?: { content?: unknown }; text?: unknown }[] }): string {
  let text = '';
  for (const choice of chunk.choices ?? []) {
    const piece = choice.delta?.content ?? choice.text;
    if (typeof piece === 'string') text += piece;
  }
  return text;
}

/** "http 503" plus the OpenAI error code from the body when there is one: "http 503 overloaded". */
function withCode(prefix: string, body: string): string {
  try {
    const parsed = JSON.parse(body) as { error?: { code?: unknown; type?: unknown } };
    const code = parsed.error?.code ?? parsed.error?.type;
    return typeof code === 'string' ? `${prefix} ${code}` : prefix;
  } catch {
    return prefix;
  }
}

/** error.message of an OpenAI-style error body (vLLM's bare {"message": ...} too), at most 500 characters. */
function errorMessageOf(body: string): string | undefined {
  try {
    const parsed = JSON.parse(body) as { error?: { message?: unknown } | string; message?: unknown };
    const message = typeof parsed.error === 'object' ? parsed.error?.message : parsed.error ?? parsed.message;
    return typeof message === 'string' && message !== '' ? message.slice(0, 500) : undefined;
  } catch {
    return undefined;
  }
}

export function sendRequest(target: Target, options: SendOptions): Promise<RequestOutcome> {
  const payload = JSON.stringify(options.body);
  const url = underRoot(target.baseUrl, options.path);
  const headers: Record<string, string | number> = {
    'Content-Type': 'application/json',
    'Content-Length': Buffer.byteLength(payload),
    Accept: options.stream ? 'text/event-stream' : 'application/json',
  };
  if (target.apiKey !== undefined) headers.Authorization = `Bearer ${target.apiKey}`;
  const send = url.protocol === 'https:' ? httpsRequest : httpRequest;

  return new Promise((resolve) => {
    const startMs = performance.now();
    const outcome: RequestOutcome = {
      index: options.index, startMs, endMs: startMs, ok: false, status: 0, itlMs: [], e2eMs: 0, completionTokens: 0,
      ...(options.group !== undefined ? { group: options.group } : {}),
    };
    let settled = false;
    const finish = (error?: string): void => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      options.signal?.removeEventListener('abort', onAbort);
      outcome.endMs = performance.now();
      outcome.e2eMs = outcome.endMs - startMs;
      if (error !== undefined) {
        outcome.ok = false;
        outcome.error = error;
      }
      resolve(outcome);
    };
    const req = send(url, { method: 'POST', headers, agent: target.agent });
    const timer = setTimeout(() => {
      finish('timeout');
      req.destroy();
    }, options.timeoutMs);
    const onAbort = (): void => {
      finish('aborted');
      req.destroy();
    };
    if (options.signal?.aborted) onAbort();
    options.signal?.addEventListener('abort', onAbort);
    req.on('error', (error: NodeJS.ErrnoException) => finish(error.code ?? error.message));
    req.on('response', (res: IncomingMessage) => {
      outcome.status = res.statusCode ?? 0;
      res.setEncoding('utf8');
      res.on('error', (error: NodeJS.ErrnoException) => finish(error.code ?? error.message));
      // A connection cut before the response completed (the 'end' handlers settle complete ones first).
      res.on('close', () => {
        if (!res.complete) finish('connection closed');
      });
      const isStream = options.stream && outcome.status === 200
        && (res.headers['content-type'] ?? '').startsWith('text/event-stream');
      if (isStream) readStream(res, outcome, startMs, finish);
      else readJson(res, outcome, finish);
    });
    req.end(payload);
  });
}

function readJson(res: IncomingMessage, outcome: RequestOutcome, finish: (error?: string) => void): void {
  let body = '';
  res.on('data', (chunk: string) => { body += chunk; });
  res.on('end', () => {
    if (outcome.status !== 200) {
      const message = errorMessageOf(body);
      if (message !== undefined) outcome.errorMessage = message;
      finish(withCode(`http ${outcome.status}`, body));
      return;
    }
    try {
      const parsed = JSON.parse(body) as { usage?: Usage; timings?: unknown };
      applyUsage(outcome, parsed.usage);
      applyTimings(outcome, parsed.timings);
    } catch {
      finish('bad json');
      return;
    }
    outcome.ok = true;
    finish();
  });
}

function readStream(res: IncomingMessage, outcome: RequestOutcome, startMs: number,
  finish: (error?: string) => void): void {
  const parser = new SseParser();
  let lastTokenMs: number | undefined;
  let numContentChunks = 0;
  let sawUsage = false;
  let done = false;
  let failure: string | undefined;
  res.on('data', (text: string) => {
    const nowMs = performance.now();
    for (const event of parser.push(text)) {
      if (event.event === 'error') {
        failure = withCode('stream error', event.data);
        const message = errorMessageOf(event.data);
        if (message !== undefined) outcome.errorMessage = message;
        continue;
      }
      if (event.data === '[DONE]') {
        done = true;
        continue;
      }
      let chunk: { choices?: { delta?: { content?: unknown }; text?: unknown }[]; usage?: Usage | null; timings?: unknown };
      try {
        chunk = JSON.parse(event.data) as typeof chunk;
      } catch {
        failure = 'bad json';
        continue;
      }
      if (chunk.usage) {
        applyUsage(outcome, chunk.usage);
        sawUsage = true;
      }
      applyTimings(outcome, chunk.timings);
      if (chunkText(chunk).length === 0) continue;
      // Only chunks with text count as tokens: the opening role chunk and the closing finish_reason chunk carry none.
      numContentChunks++;
      if (lastTokenMs === undefined) outcome.ttftMs = nowMs - startMs;
      else outcome.itlMs.push(nowMs - lastTokenMs);
      lastTokenMs = nowMs;
    }
  });
  res.on('end', () => {
    if (!sawUsage) outcome.completionTokens = numContentChunks;
    if (failure !== undefined) return finish(failure);
    if (!done) return finish('stream ended without [DONE]');
    outcome.ok = true;
    finish();
  });
}

function applyUsage(outcome: RequestOutcome, usage: Usage | undefined | null): void {
  if (!usage) return;
  if (typeof usage.completion_tokens === 'number') outcome.completionTokens = usage.completion_tokens;
  if (typeof usage.prompt_tokens === 'number') outcome.promptTokens = usage.prompt_tokens;
  const cached = usage.prompt_tokens_details?.cached_tokens;
  if (typeof cached === 'number') outcome.cachedTokens = cached;
}

function applyTimings(outcome: RequestOutcome, timings: unknown): void {
  if (typeof timings !== 'object' || timings === null) return;
  const numbers: Record<string, number> = {};
  for (const [key, value] of Object.entries(timings)) if (typeof value === 'number' && Number.isFinite(value)) numbers[key] = value;
  outcome.serverTimings = numbers;
}

/** The served model's id from GET /v1/models, or undefined when the server does not list one. */
export function fetchModelId(target: Target, timeoutMs: number): Promise<string | undefined> {
  const url = underRoot(target.baseUrl, '/v1/models');
  const headers: Record<string, string> = target.apiKey !== undefined ? { Authorization: `Bearer ${target.apiKey}` } : {};
  const send = url.protocol === 'https:' ? httpsRequest : httpRequest;
  return new Promise((resolve) => {
    const req = send(url, { method: 'GET', headers, agent: target.agent, timeout: timeoutMs }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (chunk: string) => { body += chunk; });
      res.on('end', () => {
        try {
          const id = (JSON.parse(body) as { data?: { id?: unknown }[] }).data?.[0]?.id;
          resolve(res.statusCode === 200 && typeof id === 'string' ? id : undefined);
        } catch {
          resolve(undefined);
        }
      });
      res.on('error', () => resolve(undefined));
    });
    req.on('timeout', () => req.destroy());
    req.on('error', () => resolve(undefined));
    req.end();
  });
}
