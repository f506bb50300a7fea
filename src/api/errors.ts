// Every error the HTTP API can answer with, one class per kind. Each carries the HTTP status, a stable `code` a
// client can switch on, OpenAI's `type` and `param`, and any headers the status calls for (Allow, Retry-After).
// The wire shape is OpenAI's: {"error": {"message", "type", "param", "code"}}.

export interface ErrorBody {
  error: { message: string; type: string; param: string | null; code: string | null };
}

export class ApiError extends Error {
  override name = 'ApiError';
  constructor(
    readonly statusCode: number,
    readonly code: string,
    readonly type: string,
    message: string,
    readonly param: string | null = null,
    readonly headers: Readonly<Record<string, string>> = {},
  ) {
    super(message);
  }

  toBody(): ErrorBody {
    return { error: { message: this.message, type: this.type, param: this.param, code: this.code } };
  }
}

const INVALID_REQUEST = 'invalid_request_error';
const SERVER_ERROR = 'server_error';

// ---- 400: the request itself is wrong ----

export class InvalidJsonError extends ApiError {
  constructor(detail: string) {
    super(400, 'invalid_json', INVALID_REQUEST, `The request body is not valid JSON: ${detail}`);
  }
}

export class InvalidUtf8Error extends ApiError {
  constructor(byteOffset?: number) {
    const where = byteOffset === undefined ? '' : ` (first bad byte near offset ${byteOffset})`;
    super(400, 'invalid_utf8', INVALID_REQUEST, `The request body is not valid UTF-8${where}.`);
  }
}

export class MissingFieldError extends ApiError {
  constructor(param: string) {
    super(400, 'missing_required_parameter', INVALID_REQUEST, `Missing required parameter: '${param}'.`, param);
  }
}

export class WrongTypeError extends ApiError {
  constructor(param: string, expected: string, actual: unknown) {
    super(400, 'invalid_type', INVALID_REQUEST,
      `Invalid type for '${param}': expected ${expected}, but got ${describeJsonValue(actual)}.`, param);
  }
}

export class InvalidValueError extends ApiError {
  constructor(param: string, problem: string) {
    super(400, 'invalid_value', INVALID_REQUEST, `Invalid value for '${param}': ${problem}`, param);
  }
}

/** A field OpenAI defines that this server knowingly does not implement. */
export class UnsupportedFieldError extends ApiError {
  constructor(param: string, reason: string) {
    super(400, 'unsupported_parameter', INVALID_REQUEST, `Unsupported parameter '${param}': ${reason}`, param);
  }
}

export class ContextLengthError extends ApiError {
  /** promptParam: the field the prompt came in ('messages', 'prompt', 'prompt[2]'), named when it alone is too long. */
  constructor(maxModelLen: number, promptTokens: number, requestedCompletionTokens?: number, promptParam = 'messages') {
    const message = requestedCompletionTokens === undefined
      ? `This model's maximum context length is ${maxModelLen} tokens, but the prompt has ${promptTokens} tokens, `
        + 'which leaves no room for a completion. Please shorten the prompt.'
      : `This model's maximum context length is ${maxModelLen} tokens. However, you requested `
        + `${promptTokens + requestedCompletionTokens} tokens (${promptTokens} in the messages, `
        + `${requestedCompletionTokens} in the completion). Please reduce the length of the messages or completion.`;
    super(400, 'context_length_exceeded', INVALID_REQUEST, message,
      requestedCompletionTokens === undefined ? promptParam : 'max_tokens');
  }
}

/** More sequences (prompts x n) in one request than this server lets one request ask for. */
export class TooManySequencesError extends ApiError {
  constructor(prompts: number, n: number, limit: number) {
    super(400, 'too_many_sequences', INVALID_REQUEST,
      `This request asks for ${prompts * n} sequences (${prompts} prompt${prompts === 1 ? '' : 's'} x n=${n}); `
      + `one request may ask for at most ${limit} (--max-sequences-per-request). Send fewer prompts or a lower n.`, 'n');
  }
}

/** A prompt whose UTF-8 length alone shows it cannot fit the context, refused before it is tokenized. */
export class PromptTooLongError extends ApiError {
  /** what: the text measured ('the prompt', or the messages' contents before the chat template renders them). */
  constructor(maxModelLen: number, bytes: number, maxBytesPerToken: number, param: string, what = 'the prompt is') {
    super(400, 'context_length_exceeded', INVALID_REQUEST,
      `This model's maximum context length is ${maxModelLen} tokens, but ${what} ${bytes} bytes, which is at `
      + `least ${Math.ceil(bytes / maxBytesPerToken)} tokens (no token of this model's tokenizer covers more than `
      + `${maxBytesPerToken} bytes). Please shorten the prompt.`, param);
  }
}

/**
 * A text to be tokenized whole without having to fit the context (a prompt with truncate_prompt_tokens, the text of
 * /tokenize) that is longer than the server tokenizes for one request; refused before it is tokenized.
 */
export class PromptTooLargeError extends ApiError {
  constructor(bytes: number, limitBytes: number, bytesPerToken: number, maxModelLen: number, param: string,
    kind: 'truncate' | 'tokenize', what = 'the prompt is') {
    const purpose = kind === 'truncate'
      ? 'A prompt to be truncated (truncate_prompt_tokens) is tokenized whole first, so it may be at most'
      : '/tokenize tokenizes at most';
    super(400, 'prompt_too_large', INVALID_REQUEST,
      `${purpose} ${limitBytes} bytes (${bytesPerToken} bytes per token of this model's ${maxModelLen}-token `
      + `context), but ${what} ${bytes} bytes. Please shorten the prompt.`, param);
  }
}

/** The request fits the context but not the KV cache this server was started with. */
export class KvCapacityError extends ApiError {
  constructor(neededTokens: number, capacityTokens: number) {
    super(400, 'kv_capacity_exceeded', INVALID_REQUEST,
      `The request needs ${neededTokens} tokens of KV cache but this server holds at most ${capacityTokens}; `
      + 'shorten the prompt, lower max_tokens or n, or start the server with a larger --kv-cache-memory.');
  }
}

/** The model's chat template refused the messages; the template's own words say why. */
export class TemplateRefusedMessagesError extends ApiError {
  constructor(detail: string) {
    super(400, 'chat_template_error', INVALID_REQUEST, detail.charAt(0).toUpperCase() + detail.slice(1), 'messages');
  }
}

export class NoChatTemplateError extends ApiError {
  constructor(model: string) {
    super(400, 'no_chat_template', INVALID_REQUEST,
      `Model '${model}' has no chat template, so /v1/chat/completions cannot format messages; `
      + 'use /v1/completions with a prompt instead.');
  }
}

/** The request field an engine refusal is about, where one is (the 400 names it as a validation error would). */
const ENGINE_REJECTION_PARAMS: Readonly<Record<string, string>> = { too_many_samples: 'n' };

/** The engine refused the request as given (its own checks, e.g. more KV than the pool holds). */

export class EngineRejectedError extends ApiError {
  constructor(engineCode: string, detail: string) {
    super(400, engineCode, INVALID_REQUEST, detail, ENGINE_REJECTION_PARAMS[engineCode] ?? null);
  }
}

// ---- 401 / 403 / 404 / 405 / 413 ----

export class MissingApiKeyError extends ApiError {
  constructor() {
    super(401, 'missing_api_key', INVALID_REQUEST,
      'No API key provided. Send it in the Authorization header as "Bearer <key>".');
  }
}

export class InvalidApiKeyError extends ApiError {
  constructor(keyHint: string) {
    super(401, 'invalid_api_key', INVALID_REQUEST, `Incorrect API key provided: ${keyHint}.`);
  }
}

/** A server-wide view (every tenant's detail) asked for with a tenant's key that is not an admin's. */
export class AdminRequiredError extends ApiError {
  constructor(path: string) {
    super(403, 'admin_required', INVALID_REQUEST,
      `${path} is server-wide (every tenant's requests) and needs an admin key (--admin-key, or "admin": true on the tenant in the keys file).`);
  }
}

/**
 * A request that acts (a POST) sent by a browser page from an origin --allowed-origins does not allow: CORS headers
 * would only hide the answer from that page, so the request itself is refused (cross-site request forgery).
 */
export class OriginNotAllowedError extends ApiError {
  constructor(origin: string) {
    super(403, 'origin_not_allowed', INVALID_REQUEST,
      `Requests from origin ${JSON.stringify(origin)} are not allowed: browser pages may call this server only from the origins --allowed-origins (CONDUIT_ALLOWED_ORIGINS) lists.`);
  }
}

export class ModelNotFoundError extends ApiError {
  constructor(model: string, served: string | readonly string[]) {
    const names = (typeof served === 'string' ? [served] : served).map((name) => `'${name}'`);
    super(404, 'model_not_found', INVALID_REQUEST,
      `The model '${quoted(model)}' does not exist on this server; it serves ${names.length === 1 ? names[0] : `${names.slice(0, -1).join(', ')} and ${names.at(-1)}`}.`, 'model');
  }
}

/** POST /v1/load_lora_adapter or /v1/unload_lora_adapter that cannot be done (bad file, name taken or unknown, in use). */
export class LoraAdapterError extends ApiError {
  constructor(status: 400 | 404 | 409, code: string, message: string, param: string | null = 'lora_name') {
    super(status, code, INVALID_REQUEST, sentence(message), param);
  }
}

/** Every resident LoRA adapter (--max-loras) has requests in flight: none can make room for the one asked for. */
export class LoraCapacityExceededError extends ApiError {
  constructor(message: string) {
    super(503, 'lora_capacity', SERVER_ERROR, `${sentence(message)} Please retry shortly.`, 'model', retryHeaders(1000));
  }
}

/** No finished request with this id in the trace store (unknown, still running, or older than the store holds). */
export class TraceNotFoundError extends ApiError {
  constructor(requestId: string, capacity: number) {
    super(404, 'trace_not_found', INVALID_REQUEST,
      `No finished request with id '${requestId}'. Traces are kept for the last ${capacity} finished requests; `
      + 'a request still running has none yet.', 'id');
  }
}

/** A percent-escape in the URL path that is not valid UTF-8 (e.g. "%E0%A4%A"). */
export class MalformedPathError extends ApiError {
  constructor(path: string) {
    super(400, 'invalid_url', INVALID_REQUEST,
      `Invalid URL (${path}): a percent-escape in the path is malformed or not UTF-8.`);
  }
}

export class RouteNotFoundError extends ApiError {
  constructor(method: string, path: string) {
    super(404, 'unknown_url', INVALID_REQUEST, `Invalid URL (${method} ${path}).`);
  }
}

export class MethodNotAllowedError extends ApiError {
  constructor(method: string, path: string, allowed: readonly string[]) {
    super(405, 'method_not_allowed', INVALID_REQUEST,
      `Method ${method} is not allowed for ${path}; use ${allowed.join(' or ')}.`, null,
      { Allow: allowed.join(', ') });
  }
}

export class BodyTooLargeError extends ApiError {
  constructor(limitBytes: number) {
    super(413, 'body_too_large', INVALID_REQUEST,
      `The request body is larger than this server's limit of ${limitBytes} bytes (--max-body-bytes).`);
  }
}

/** The client hung up before its request was read; nobody is left to answer (nginx's 499). */
export class ClientClosedRequestError extends ApiError {
  constructor() {
    super(499, 'client_closed_request', INVALID_REQUEST, 'The client closed the connection before sending the whole request.');
  }
}

// ---- 429: per-tenant limits ----

export type RateLimitKind = 'requests' | 'tokens';

export class RateLimitError extends ApiError {
  constructor(kind: RateLimitKind, tenant: string, limitPerMinute: number, retryAfterMs: number) {
    super(429, 'rate_limit_exceeded', kind,
      `Rate limit reached for tenant '${tenant}' on ${kind} per minute: limit ${limitPerMinute}. `
      + `Please try again in ${formatDuration(retryAfterMs)}.`, null, retryHeaders(retryAfterMs));
  }
}

/**
 * The official OpenAI SDKs retry every 429 (twice by default) unless the answer carries this header: the refusals
 * that waiting cannot cure say so, or the client would send the same hopeless request again.
 */
const DO_NOT_RETRY: Readonly<Record<string, string>> = { 'x-should-retry': 'false' };

/**
 * The request alone reserves more tokens than the tenant may use in a minute: waiting will never help. OpenAI's
 * answer to a request over the tokens-per-minute limit by itself is this 429 ("Request too large ...", code
 * rate_limit_exceeded), so clients that handle OpenAI's errors handle it; no Retry-After, and x-should-retry: false.
 */
export class RequestExceedsTokenLimitError extends ApiError {
  /**
   * maxTokensUnset: the request left max_tokens out, so each completion reserves the most it may generate (the
   * context left after its prompt, as vLLM defaults it, or the model's cap): the way out is to set max_tokens, not to
   * lower a value the client never sent.
   */
  constructor(tenant: string, reservedTokens: number, limitPerMinute: number, maxTokensUnset = false) {
    super(429, 'rate_limit_exceeded', 'tokens',
      `Request too large for tenant '${tenant}': it reserves ${reservedTokens} tokens (prompt + n * max_tokens`
      + (maxTokensUnset ? '; max_tokens was not set, so each completion reserves the most it may generate' : '')
      + `) but the limit is ${limitPerMinute} tokens per minute. ${maxTokensUnset ? 'Set max_tokens, or lower n.' : 'Lower max_tokens or n.'}`,
      'max_tokens', DO_NOT_RETRY);
  }
}

export class ConcurrencyLimitError extends ApiError {
  constructor(tenant: string, limit: number, inFlight: number) {
    super(429, 'concurrency_limit_exceeded', 'requests',
      `Tenant '${tenant}' already has ${inFlight} sequences in flight of its limit of ${limit} (a request runs prompts x n). `
      + 'Retry when one finishes.', null,
      retryHeaders(1000));
  }
}

/** A request of more sequences than its tenant may ever run at once: waiting cannot help, so no Retry-After (and no retry). */
export class RequestExceedsConcurrencyError extends ApiError {
  constructor(tenant: string, sequences: number, limit: number) {
    super(429, 'concurrency_limit_exceeded', 'requests',
      `Request too large for tenant '${tenant}': it runs ${sequences} sequences (prompts x n) but the tenant may run ${limit} at once. `
      + 'Lower n or send fewer prompts.', 'n', DO_NOT_RETRY);
  }
}

/** POST /reset_prefix_cache while a worker has blocks in use: that worker kept its cache. */
export class PrefixCacheInUseError extends ApiError {
  constructor() {
    super(409, 'requests_running', INVALID_REQUEST,
      'The prefix cache was not reset on every worker: a worker had requests running (KV blocks in use). Retry when idle.');
  }
}

// ---- 5xx ----

export class NotReadyError extends ApiError {
  constructor(state: string) {
    super(503, 'not_ready', SERVER_ERROR, `The server is ${state} and cannot take requests yet.`, null,
      retryHeaders(1000));
  }
}

/** A new request while the server drains (or after): another replica should take it. */
export class ShuttingDownError extends ApiError {
  constructor(message = 'The server is shutting down and takes no new requests.') {
    super(503, 'shutting_down', SERVER_ERROR, message, null, retryHeaders(1000));
  }
}

/** A request still running when the shutdown grace period ended (ran out, or was cut short by a second signal). */
export class GraceEndedError extends ShuttingDownError {
  constructor(graceMs: number, cutShort: boolean) {
    const grace = `${Number((graceMs / 1000).toFixed(3))} s`;
    super(cutShort
      ? `The server stopped before this request finished: a second stop signal ended its ${grace} shutdown grace period early.`
      : `The server stopped before this request finished: its ${grace} shutdown grace period ran out.`);
  }
}

export class OverloadedError extends ApiError {
  constructor(detail: string, retryAfterMs = 1000) {
    super(503, 'server_overloaded', SERVER_ERROR, `The server is overloaded: ${sentence(detail)} Please retry shortly.`,
      null, retryHeaders(retryAfterMs));
  }
}

/**
 * No engine worker can take the request (every one was lost, or none is registered). Not an overload, so not
 * `server_overloaded` and no "retry shortly": a Retry-After comes only while a restart is under way, and when nothing
 * will bring a worker back (restarts gave up or are off) the answer says so and carries x-should-retry: false, which
 * keeps the OpenAI SDKs from sending it again. vLLM answers a dead engine with a 500 and stops; Dynamo's frontend
 * answers a request for an endpoint with no instances with a 503.
 */
export class NoWorkerAvailableError extends ApiError {
  constructor(detail: string, retryAfterMs: number | undefined, final: boolean) {
    super(503, 'no_worker_available', SERVER_ERROR,
      `The server cannot run this request: ${sentence(detail)}`
      + (retryAfterMs !== undefined ? ' Retry once the restart is done.' : final ? ' No worker will come back without an operator.' : ''),
      null, retryAfterMs !== undefined ? retryHeaders(retryAfterMs) : final ? DO_NOT_RETRY : {});
  }
}

/** More connections open than --max-connections: sent raw on the new connection, which is then closed. */
export class TooManyConnectionsError extends ApiError {
  constructor(limit: number) {
    super(503, 'too_many_connections', SERVER_ERROR,
      `The server has ${limit} connections open, its limit (--max-connections). Please retry shortly.`, null, retryHeaders(1000));
  }
}

/** The worker that ran the request went away mid-way; a retry lands on a live one. */
export class WorkerLostApiError extends ApiError {
  constructor(detail: string) {
    super(503, 'worker_lost', SERVER_ERROR, `The engine worker running this request was lost: ${detail}`, null,
      retryHeaders(1000));
  }
}

/** An HTTP/1.1 request without the Host header RFC 9112 requires. */
export class MissingHostError extends ApiError {
  constructor() {
    super(400, 'invalid_http_request', INVALID_REQUEST, 'An HTTP/1.1 request needs a Host header.');
  }
}

/** An Expect header other than 100-continue (RFC 9110: 417). */
export class ExpectationFailedError extends ApiError {
  constructor(expectation: string) {
    super(417, 'expectation_failed', INVALID_REQUEST, `The expectation ${JSON.stringify(expectation)} is not supported; only 100-continue is.`);
  }
}

/** A body compressed with a Content-Encoding (gzip, br...): bodies are read as sent, so it is refused (RFC 9110: 415). */
export class UnsupportedContentEncodingError extends ApiError {
  constructor(encoding: string) {
    super(415, 'unsupported_content_encoding', INVALID_REQUEST,
      `The request body's Content-Encoding ${JSON.stringify(quoted(encoding, 64))} is not supported; send the body uncompressed.`,
      null, { 'Accept-Encoding': 'identity' });
  }
}

/** A Transfer-Encoding other than chunked (RFC 9112: a transfer coding the server does not implement is a 501). */
export class TransferCodingNotImplementedError extends ApiError {
  constructor(codings: string) {
    super(501, 'unsupported_transfer_encoding', INVALID_REQUEST,
      `The Transfer-Encoding ${JSON.stringify(quoted(codings, 64))} is not supported; only chunked is.`);
  }
}

/** The request's body did not arrive within the server's upload limit (Node's requestTimeout). */
export class BodyTimeoutError extends ApiError {
  constructor(timeoutSeconds: number) {
    super(408, 'request_timeout', INVALID_REQUEST, `The request's body did not arrive within ${timeoutSeconds} s.`);
  }
}

export class RequestTimeoutError extends ApiError {
  constructor(timeoutSeconds: number) {
    super(504, 'request_timeout', SERVER_ERROR,
      `The request did not finish within the server's limit of ${timeoutSeconds} s (--request-timeout).`);
  }
}

export class EngineError extends ApiError {
  constructor(detail: string) {
    super(500, 'engine_error', SERVER_ERROR, `The engine failed while generating: ${detail}`);
  }
}

/**
 * The worker could not allocate the memory a step of this request needed (EngineOutput.errorCode 'out_of_memory').
 * The worker goes on; the same request may fit once fewer run beside it (a step's buffers grow with its tokens).
 */
export class OutOfMemoryError extends ApiError {
  constructor(detail: string) {
    super(503, 'out_of_memory', SERVER_ERROR, `The engine worker ran out of memory for this request: ${detail}`);
  }
}

export class BrokenChatTemplateError extends ApiError {
  constructor(detail: string) {
    super(500, 'chat_template_broken', SERVER_ERROR, `The model's chat template is broken: ${detail}`);
  }
}

export class InternalError extends ApiError {
  constructor(detail: string) {
    super(500, 'internal_error', SERVER_ERROR, `Internal server error: ${detail}`);
  }
}

/** Any thrown value as an ApiError: ApiErrors pass through, anything else is a bug and becomes a 500. */
export function toApiError(err: unknown): ApiError {
  if (err instanceof ApiError) return err;
  return new InternalError(err instanceof Error ? err.message : String(err));
}

// ---- helpers ----

/** A detail that ends a sentence: a final period added unless it already ends in one (or in ? or !). */
export function sentence(detail: string): string {
  const trimmed = detail.trimEnd();
  return /[.!?]$/.test(trimmed) ? trimmed : `${trimmed}.`;
}

function retryHeaders(retryAfterMs: number): Record<string, string> {
  return {
    'Retry-After': String(Math.max(1, Math.ceil(retryAfterMs / 1000))),
    'retry-after-ms': String(Math.max(0, Math.ceil(retryAfterMs))),
  };
}

/**
 * A client's value quoted in a message, cut to `max` characters: a 4 MiB model name must not come back whole in the
 * error (and in every log line that carries it).
 */
export function quoted(value: string, max = 256): string {
  return value.length <= max ? value : `${value.slice(0, max)}... (${value.length - max} more characters)`;
}

/** Durations in the style of OpenAI's rate-limit headers: "250ms", "12s", "1m30s". */
export function formatDuration(ms: number): string {
  const clamped = Math.max(0, Math.ceil(ms));
  if (clamped < 1000) return `${clamped}ms`;
  const totalSeconds = clamped / 1000;
  if (totalSeconds < 60) return `${Number(totalSeconds.toFixed(3))}s`;
  const minutes = Math.floor(totalSeconds / 60);
  const seconds = Number((totalSeconds - minutes * 60).toFixed(3));
  return `${minutes}m${seconds}s`;
}

/** A JSON value described for an error message: its type, and the value itself when short. */
export function describeJsonValue(value: unknown): string {
  if (value === null) return 'null';
  if (Array.isArray(value)) return 'an array';
  switch (typeof value) {
    case 'string': return value.length <= 40 ? `a string ("${value}")` : 'a string';
    case 'number': return Number.isInteger(value) ? `an integer (${value})` : `a number (${value})`;
    case 'boolean': return `a boolean (${value})`;
    case 'object': return 'an object';
    default: return typeof value;
  }
}
