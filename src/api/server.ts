// The HTTP shell: routing, method checks, auth, the cheap rate-limit check, body reading, and turning any thrown
// error into OpenAI's error shape. Raw node:http (or node:https with --tls-cert/--tls-key): it is as fast as any
// framework for SSE and adds no dependency.
//
// It also owns the process's telemetry (docs/observability.md): every generation request gets an id at arrival
// and a CallTrace that stamps its phases and ends it exactly once, whichever way it ends; /metrics appends the
// telemetry's registry, and /v1/requests/{id}/trace, /v1/slo and /v1/analysis read what it collected.

import type { ToolCallParserName } from './tool-calls.ts';
import { createServer as createHttpServer, STATUS_CODES, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import { createServer as createHttpsServer } from 'node:https';
import type { AddressInfo, Socket } from 'node:net';
import type { Duplex } from 'node:stream';
import { performance } from 'node:perf_hooks';
import type { Engine, SchedulingPolicy } from '../engine/types.ts';
import { createTelemetry, type Telemetry } from '../telemetry/index.ts';
import { formatTraceparent, parseTraceparent } from '../telemetry/traceparent.ts';
import { CONDUIT_VERSION } from '../util/version.ts';
import { ANONYMOUS_TENANT, type KeyStore, type Tenant } from './auth.ts';
import { parseJsonBytes, readBody } from './body.ts';
import { CallTrace } from './call-trace.ts';
import { ClientRequestIds, requestIdProblem } from './client-request-ids.ts';
import { WebConsole, type ConsoleWorkerSource } from './console.ts';
import {
  AdminRequiredError, OriginNotAllowedError, BodyTimeoutError, TransferCodingNotImplementedError, UnsupportedContentEncodingError, ClientClosedRequestError, ExpectationFailedError, MissingHostError, NotReadyError, PrefixCacheInUseError, TooManyConnectionsError, InvalidValueError, MalformedPathError, MethodNotAllowedError, RouteNotFoundError, toApiError, TraceNotFoundError, type ApiError,
} from './errors.ts';
import { endWithin, Gateway, sendJsonReply, type Call, type JsonReply, type ModelBackend, type ServedModel } from './gateway.ts';
import { quoteForLog, silentLogger, type Logger } from '../util/log.ts';
import { GatewayMetrics, PROMETHEUS_CONTENT_TYPE } from './gateway-metrics.ts';
import { newCompletionId } from './openai-format.ts';
import { RATE_LIMIT_HEADER_NAMES, TenantRateLimiter, type Clock } from './rate-limit.ts';

export const DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024;
export const DEFAULT_MAX_PENDING_REQUESTS = 256;
/** Open connections beyond which new ones get a 503 and are closed (serve lowers it to fit the descriptor limit). */
export const DEFAULT_MAX_CONNECTIONS = 4096;
/** Time a client has to send a request's headers. */
export const DEFAULT_HEADERS_TIMEOUT_MS = 30_000;
/** The request header that names a conversation for the session routing policy (as vLLM's router's session key). */
export const DEFAULT_SESSION_HEADER = 'x-session-id';
/** Longest session id accepted: the router keeps every live one in memory. */
export const MAX_SESSION_ID_LENGTH = 256;

export interface ApiServerOptions {
  keyStore: KeyStore;
  /** Tool-call format under tool_choice "auto" (default: recognised from the chat template). */
  toolCallParser?: ToolCallParserName;
  servedModelName?: string;
  maxBodyBytes?: number;
  /** Sequences (prompts x n) in flight beyond which new requests get 503. */
  maxPendingRequests?: number;
  /** Most sequences (prompts x n) one request may ask for. */
  maxSequencesPerRequest?: number;
  requestTimeoutMs?: number;
  /**
   * How long a write (a stream's event, a piece of an answer) waits for a client that stopped reading before the
   * connection is closed; undefined = for ever.
   */
  writeTimeoutMs?: number;
  /** Clock of the rate limiter (ms); tests pass one they step by hand. */
  clock?: Clock;
  /** Clock of EngineRequest.arrivalMs (ms); the engine's own clock. */
  engineClock?: Clock;
  tls?: { cert: string | Buffer; key: string | Buffer };
  /** Header whose value is the request's session id (default x-session-id; case does not matter). */
  sessionHeader?: string;
  logger?: Logger;
  /**
   * One info line per request when it ends (method, path, status, tenant, tokens, TTFT, total ms), as vLLM's and
   * llama.cpp's servers log; health probes, scrapes and the console's poll (/health, /live, /metrics,
   * /console/api/overview) only at debug. Default true.
   */
  requestLog?: boolean;
  /**
   * Serve vLLM's GET /tokenizer_info (off by default, as in vLLM: it shows the chat template and special tokens).
   */
  tokenizerInfoEndpoint?: boolean;
  /** Logprobs name tokens "token_id:<id>" unless a request says otherwise (vLLM's --return-tokens-as-token-ids). */
  returnTokensAsTokenIds?: boolean;
  /**
   * The process's telemetry. Default: one created here on the engine clock, configured by OTEL_* variables (no
   * spans unless they ask for export), and shut down with the server. One passed in is the caller's to shut down.
   */
  telemetry?: Telemetry;
  /** For the telemetry created here: one decode_step span per engine step instead of a summary on decode. */
  perTokenSpans?: boolean;
  /** Open connections beyond which a new one gets a short 503 and is closed (TLS: closed before the handshake). */
  maxConnections?: number;
  /** Time a client has to send a request's headers; enforced within a quarter of it (at most 1 s) late. */
  headersTimeoutMs?: number;
  /**
   * /metrics without an API key even when keys are configured (its series name tenants). Default: with keys
   * configured, /metrics needs an admin key, like /v1/slo and /v1/analysis.
   */
  publicMetrics?: boolean;
  /**
   * CORS (as vLLM's --allowed-origins): origins a browser page may call the API from, '*' for any; absent or
   * empty: no CORS headers, so browsers keep to same-origin. Credentials (cookies) are never allowed. A POST from an
   * origin not allowed (other than the server's own) is refused with a 403 before any work.
   */
  allowedOrigins?: readonly string[];
  /**
   * The scheduling policy of the workers behind this server (their --scheduling-policy), when it is one for all of
   * them: a request's priority (not 0) or deadline_ms that the policy never reads is then refused with a 400 naming
   * the field and the policy, as vLLM refuses a priority without priority scheduling. Undefined (a gateway in front
   * of workers it does not configure): both are accepted, and each worker's own policy reads them or not.
   */
  schedulingPolicy?: SchedulingPolicy;
}

interface RouteContext {
  req: IncomingMessage;
  res: ServerResponse;
  call: Call;
  body: unknown;
  params: string[];
}

type Handler = (context: RouteContext) => Promise<JsonReply | void> | JsonReply | void;

interface Route {
  /** Label for metrics and logs. */
  name: string;
  match: (path: string) => string[] | undefined;
  /** Needs an API key (when keys are configured). */
  auth: boolean;
  /** Server-wide detail (every tenant's): needs an admin key when keys are configured. */
  admin?: boolean;
  /** Generates: subject to the tenant's request rate before the body is read. */
  rateLimited: boolean;
  /** Generates: traced, under an id with this prefix chosen at arrival. */
  traced?: 'chatcmpl' | 'cmpl' | 'resp';
  /** A POST that takes no body: an empty one is fine (curl -X POST), one that is there must still be JSON. */
  bodyOptional?: boolean;
  methods: Partial<Record<'GET' | 'POST', Handler>>;
}

/** The methods a route answers: its own, and HEAD beside GET (Node's response sends no body for a HEAD request). */
function answeredMethods(route: Route): string[] {
  const methods = Object.keys(route.methods);
  return methods.includes('GET') ? [...methods, 'HEAD'] : methods;
}

/** Routes polled by orchestrators and scrapers: their request lines are debug-level, not info. */
const PROBE_ROUTES = new Set(['health', 'live', 'metrics', 'console_overview']);
/** Ignored fields one warning names (warnIgnoredFields); a body may hold thousands. */
const MAX_IGNORED_FIELDS_NAMED = 8;

/**
 * Response headers a cross-origin page may read: the request's id, retry hints, its trace context and the tenant's
 * rate-limit state (RateLimiter.headers).
 */
const CORS_EXPOSED_HEADERS = ['X-Request-Id', 'Retry-After', 'retry-after-ms', 'x-should-retry', 'traceparent', 'tracestate', ...RATE_LIMIT_HEADER_NAMES].join(', ');

/** An engine that runs several workers and reports each (the routed and the disaggregated engines). */
interface MultiWorkerEngine extends Engine {
  workerStats(): ConsoleWorkerSource[];
}

function isMultiWorker(engine: Engine): engine is MultiWorkerEngine {
  return typeof (engine as Partial<MultiWorkerEngine>).workerStats === 'function';
}

/**
 * The path a request line names: its origin form (/v1/models?x) or, as RFC 9112 asks a server to accept, its
 * absolute form (http://host/v1/models), query left out.
 */
function requestPath(url: string | undefined): string {
  const target = url ?? '/';
  if (/^https?:\/\//i.test(target)) {
    try {
      return new URL(target).pathname;
    } catch {
      // Not a URL after all: routed as given (a 404).
    }
  }
  return target.split('?')[0]!;
}

/** W3C tracestate: printable ASCII list members, at most 512 characters (a longer one may be dropped whole). */
const TRACESTATE = /^[\x20-\x7e]{1,512}$/;

/** The route, for admin keys only (when keys are configured) when `only` holds. */
function admin(route: Route, only = true): Route {
  return only ? { ...route, admin: true } : route;
}

function exact(path: string): (p: string) => string[] | undefined {
  return (p) => (p === path ? [] : undefined);
}

export class ApiServer {
  readonly gateway: Gateway;
  readonly metrics: GatewayMetrics;
  readonly limiter: TenantRateLimiter;
  readonly server: Server;
  readonly telemetry: Telemetry;
  /** The web console's pages and JSON (/console). */
  readonly webConsole: WebConsole;
  private readonly ownsTelemetry: boolean;
  /** Workers whose load series are in the metrics, so a worker that leaves can have its series removed. */
  private reportedWorkers = new Set<string>();
  /** The server ids of recent requests that sent an X-Request-Id or a request_id, by that id: traces are found by either. */
  private readonly clientRequestIds: ClientRequestIds;
  private readonly routes: Route[];
  private readonly logger: Logger;
  private readonly maxBodyBytes: number;
  private readonly engineClock: Clock;
  private clockSource: Clock;
  /** Holds the simulated clock while the gateway works on a request (ModelBackend.holdClock), when there is one. */
  private clockHold: (() => () => void) | undefined;
  private readonly defaultClock: Clock;
  /** Lower-cased, as node gives header names. */
  private readonly sessionHeader: string;
  private stopping: Promise<void> | undefined;
  private readonly maxConnections: number;
  private openConnections = 0;

  constructor(private readonly options: ApiServerOptions) {
    this.logger = options.logger ?? silentLogger;
    this.maxBodyBytes = options.maxBodyBytes ?? DEFAULT_MAX_BODY_BYTES;
    this.sessionHeader = (options.sessionHeader ?? DEFAULT_SESSION_HEADER).toLowerCase();
    // The engine's clock: epoch milliseconds at sub-millisecond resolution, the same scale in every thread.
    const defaultClock = options.engineClock ?? (() => performance.timeOrigin + performance.now());
    this.clockSource = defaultClock;
    this.defaultClock = defaultClock;
    // Read through clockSource: an engine attached later may bring its own clock (ModelBackend.clock).
    this.engineClock = () => this.clockSource();
    // A monotonic clock: after a wall-clock step back (NTP) Date.now() would refill no bucket until it caught up.
    this.limiter = new TenantRateLimiter(options.clock ?? (() => performance.now()));
    this.ownsTelemetry = options.telemetry === undefined;
    this.telemetry = options.telemetry ?? createTelemetry({ now: this.engineClock, perTokenSpans: options.perTokenSpans ?? false });
    for (const warning of this.telemetry.warnings) this.logger.warn(`telemetry: ${warning}`);
    // Two names a request (the client's id, and the response id made of it; on /v1/responses the header and the
    // body's id) for as many requests as the trace store holds.
    this.clientRequestIds = new ClientRequestIds(2 * this.telemetry.traces.capacity);
    this.metrics = new GatewayMetrics(this.telemetry.metrics.registry);
    this.gateway = new Gateway({
      ...(options.servedModelName !== undefined ? { servedModelName: options.servedModelName } : {}),
      maxPendingRequests: options.maxPendingRequests ?? DEFAULT_MAX_PENDING_REQUESTS,
      ...(options.maxSequencesPerRequest !== undefined ? { maxSequencesPerRequest: options.maxSequencesPerRequest } : {}),
      ...(options.requestTimeoutMs !== undefined ? { requestTimeoutMs: options.requestTimeoutMs } : {}),
      ...(options.writeTimeoutMs !== undefined ? { writeTimeoutMs: options.writeTimeoutMs } : {}),
      limiter: this.limiter,
      metrics: this.metrics,
      now: this.engineClock,
      ...(options.toolCallParser !== undefined ? { toolCallParser: options.toolCallParser } : {}),
      ...(options.returnTokensAsTokenIds ? { returnTokensAsTokenIds: true } : {}),
      ...(options.schedulingPolicy !== undefined ? { schedulingPolicy: options.schedulingPolicy } : {}),
    });
    this.webConsole = new WebConsole({
      telemetry: this.telemetry, keyStore: options.keyStore, workers: () => this.workerSources(), health: () => this.gateway.health().body,
    });
    this.routes = this.buildRoutes();
    const listener = (req: IncomingMessage, res: ServerResponse): void => {
      this.answerBegun(req, res);
      void this.handle(req, res, false);
    };
    const headersTimeout = options.headersTimeoutMs ?? DEFAULT_HEADERS_TIMEOUT_MS;
    // Node checks the header and request timeouts only every connectionsCheckingInterval (30 s by default), so a
    // 30 s header timeout could take up to 60 s: check often enough that the timeout is the one stated.
    const connectionsCheckingInterval = Math.max(10, Math.min(1000, Math.floor(headersTimeout / 4)));
    this.server = options.tls
      ? createHttpsServer({ cert: options.tls.cert, key: options.tls.key, noDelay: true, connectionsCheckingInterval, requireHostHeader: false }, listener)
      : createHttpServer({ noDelay: true, connectionsCheckingInterval, requireHostHeader: false }, listener);
    // Node's own answers to a missing Host (400) and an unknown Expect (417) have empty bodies: these are answered
    // here instead, in OpenAI's error shape (handle() checks the Host).
    this.server.on('checkExpectation', (req: IncomingMessage, res: ServerResponse) => {
      const error = new ExpectationFailedError(String(req.headers.expect ?? ''));
      this.metrics.countResponse('unknown', error.statusCode, ANONYMOUS_TENANT);
      res.setHeader('Connection', 'close');
      sendJsonReply(res, { status: error.statusCode, body: error.toBody() });
    });
    // "Expect: 100-continue": the 100 goes out only when the body is about to be read, after the route, the key, the
    // rate limit and the announced size are checked (Node would send it at once, and the client its whole body
    // before hearing it is refused).
    this.server.on('checkContinue', (req: IncomingMessage, res: ServerResponse) => {
      this.answerBegun(req, res);
      void this.handle(req, res, true);
    });
    // Slow or stalled uploads must not hold a connection for ever; streamed responses are not affected.
    this.server.headersTimeout = headersTimeout;
    this.server.requestTimeout = Math.max(60_000, headersTimeout);
    this.server.keepAliveTimeout = 15_000;
    this.maxConnections = options.maxConnections ?? DEFAULT_MAX_CONNECTIONS;
    this.capConnections();
    this.server.on('clientError', (error: NodeJS.ErrnoException, socket: Duplex) => this.answerUnparsable(error, socket));
    // Node hands a CONNECT to 'connect' listeners and, with none, drops the connection without a word: answered
    // here as every other method a route lacks.
    this.server.on('connect', (req: IncomingMessage, socket: Duplex) => this.refuseConnect(req, socket));
  }

  /** This server is no proxy: a CONNECT is a 405 in OpenAI's error shape, counted, and the connection closed. */
  private refuseConnect(req: IncomingMessage, socket: Duplex): void {
    socket.on('error', () => {});
    const error = new MethodNotAllowedError('CONNECT', req.url ?? '', ['GET', 'HEAD', 'POST', 'OPTIONS']);
    this.metrics.countResponse('unknown', error.statusCode, ANONYMOUS_TENANT);
    const body = JSON.stringify(error.toBody());
    socket.end(`HTTP/1.1 405 ${STATUS_CODES[405]}\r\nContent-Type: application/json\r\nAllow: ${error.headers.Allow}\r\n`
      + `Content-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`);
    // Past the request Node reads nothing more from this socket: a client that never closes its end does not keep it.
    const timer = setTimeout(() => socket.destroy(), 1000);
    timer.unref();
    socket.once('close', () => clearTimeout(timer));
    socket.resume();
  }

  /** Sockets whose request's body the handler is reading, and those of them whose upload timed out. */
  private readonly readingBody = new WeakSet<Duplex>();
  private readonly bodyTimedOut = new WeakSet<Duplex>();

  /**
   * Answers not yet complete on each connection, and the refusal waiting behind them. HTTP answers a connection's
   * requests in order, so unparsable bytes after a request (pipelined, or sent while its answer streams) are refused
   * once that answer is complete: written at once, the 400 took the place of the answer the client was waiting for,
   * or landed in the middle of its stream, and the request was abandoned.
   */
  private readonly answersPending = new WeakMap<Duplex, Set<IncomingMessage>>();
  private readonly refusalsWaiting = new WeakMap<Duplex, string>();

  /** What each request on a connection runs when the connection closes, behind one listener for them all. */
  private readonly closeWatchers = new WeakMap<Duplex, Set<() => void>>();

  /**
   * Runs `onClose` when `socket` closes; the returned function stops watching. A client may pipeline any number of
   * requests on one connection: a listener each made Node warn of a leak ("MaxListenersExceededWarning") past 10.
   */
  private watchClose(socket: Duplex, onClose: () => void): () => void {
    let watchers = this.closeWatchers.get(socket);
    if (watchers === undefined) {
      const all = new Set<() => void>();
      this.closeWatchers.set(socket, watchers = all);
      socket.once('close', () => {
        for (const watcher of all) watcher();
        all.clear();
      });
    }
    watchers.add(onClose);
    const mine = watchers;
    return () => { mine.delete(onClose); };
  }

  private answerBegun(req: IncomingMessage, res: ServerResponse): void {
    const socket = req.socket;
    let pending = this.answersPending.get(socket);
    if (pending === undefined) this.answersPending.set(socket, pending = new Set());
    pending.add(req);
    res.once('close', () => {
      pending.delete(req);
      const refusal = this.refusalsWaiting.get(socket);
      if (pending.size > 0 || refusal === undefined) return;
      this.refusalsWaiting.delete(socket);
      if (socket.writable) socket.end(refusal);
      else socket.destroy();
    });
  }

  /**
   * A request Node's parser refuses (a malformed request line or header, more body than its Content-Length says,
   * headers too large or too slow): answered in OpenAI's error shape, as every other refusal, and the connection
   * closed (Node's own answer is a bare status line).
   */
  private answerUnparsable(error: NodeJS.ErrnoException, socket: Duplex): void {
    // Node's parser stays failed and reports every later chunk again: the refusal is already decided.
    if (this.refusalsWaiting.has(socket)) return;
    if (error.code === 'ECONNRESET' || !socket.writable) {
      socket.destroy();
      return;
    }
    // A body too slow to arrive (Node's requestTimeout) ends a request the handler is reading: the handler counts
    // and logs it (as a 408, not the client's leaving); everything else here never reached a handler.
    const bodyTimedOut = error.code === 'ERR_HTTP_REQUEST_TIMEOUT' && this.readingBody.has(socket);
    if (bodyTimedOut) this.bodyTimedOut.add(socket);
    const [status, code, message] = error.code === 'HPE_HEADER_OVERFLOW'
      ? [431, 'request_header_fields_too_large', 'The request\'s headers are too large.']
      : bodyTimedOut ? [408, 'request_timeout', new BodyTimeoutError(this.server.requestTimeout / 1000).message]
        : error.code === 'ERR_HTTP_REQUEST_TIMEOUT'
          ? [408, 'request_timeout', 'The request\'s headers did not arrive in time.']
          : [400, 'invalid_http_request', `The request could not be parsed (${error.code ?? 'parse error'}); a body longer than its Content-Length is one cause.`];
    if (!bodyTimedOut) this.metrics.countResponse('unknown', status, ANONYMOUS_TENANT);
    const body = JSON.stringify({ error: { message, type: 'invalid_request_error', param: null, code } });
    const refusal = `HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\nContent-Type: application/json\r\n`
      + `Content-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`;
    // A timeout, or a body that failed to parse, is the failure of the request being answered: refused now. Bytes
    // that failed to parse after complete requests (Node read all of them) wait for those requests' answers.
    const pending = this.answersPending.get(socket);
    const behindAnswers = error.code !== 'ERR_HTTP_REQUEST_TIMEOUT' && pending !== undefined && pending.size > 0
      && [...pending].every((req) => req.complete);
    if (behindAnswers) this.refusalsWaiting.set(socket, refusal);
    else socket.end(refusal);
  }

  /** Connections open now (the ones being served; refused ones are not counted). */
  get connectionCount(): number {
    return this.openConnections;
  }

  /**
   * Every descriptor is a connection someone else cannot have: past the cap a new connection is answered at once
   * with a short 503 and closed, before node's HTTP (or TLS) machinery sees it, so it costs no parser or handshake.
   */
  private capConnections(): void {
    const serve = this.server.listeners('connection') as ((socket: Socket) => void)[];
    this.server.removeAllListeners('connection');
    this.server.on('connection', (socket: Socket) => {
      if (this.openConnections >= this.maxConnections) {
        this.refuseConnection(socket);
        return;
      }
      this.openConnections++;
      socket.once('close', () => { this.openConnections--; });
      this.closeIfSilent(socket);
      for (const handler of serve) handler.call(this.server, socket);
    });
  }

  /**
   * Node times out only a request it has begun to read: a connection that never sends a byte would hold its
   * descriptor, and its place under --max-connections, for ever (enough of them shut every other client out). One
   * silent for the headers timeout is closed; there is no request to answer.
   */
  private closeIfSilent(socket: Socket): void {
    const timer = setTimeout(() => {
      if (socket.bytesRead === 0) socket.destroy();
    }, this.server.headersTimeout);
    timer.unref();
    socket.once('close', () => clearTimeout(timer));
  }

  private refuseConnection(socket: Socket): void {
    this.metrics.countRejection(ANONYMOUS_TENANT, 'too_many_connections');
    socket.on('error', () => {});
    // Under TLS nothing readable can be said before a handshake, which an overloaded server should not spend.
    if (this.options.tls) {
      socket.destroy();
      return;
    }
    const body = JSON.stringify(new TooManyConnectionsError(this.maxConnections).toBody());
    socket.end('HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n'
      + `Content-Length: ${Buffer.byteLength(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n${body}`);
    // The client has a moment to read the answer; a client that never closes its end does not keep the descriptor.
    const timer = setTimeout(() => socket.destroy(), 1000);
    timer.unref();
    socket.once('close', () => clearTimeout(timer));
    socket.resume();
  }

  attach(backend: ModelBackend): void {
    // Simulated workers at a speed-up other than 1 stamp on their own clock: the gateway stamps on it too.
    this.clockSource = backend.clock ?? this.defaultClock;
    this.clockHold = backend.holdClock;
    this.gateway.attach(backend);
    const model = this.gateway.servedModelName;
    if (model !== undefined) this.describeAttached(model, backend);
  }

  /** Serves several models, each under its own name (the first is the default). */
  attachModels(models: readonly ServedModel[]): void {
    // One clock per server: the first model's (several models are served only by real CPU workers or at speed-up 1).
    this.clockSource = models[0]?.backend.clock ?? this.defaultClock;
    this.clockHold = models[0]?.backend.holdClock;
    this.gateway.attachModels(models);
    for (const { name, backend } of models) this.describeAttached(name, backend);
  }

  /** A model just loaded: its requests are traced at the sampler's new-model rate for a while. */
  private describeAttached(model: string, backend: ModelBackend): void {
    this.telemetry.registerNewModel(model);
    const { quantization } = backend.engine.info;
    this.telemetry.describeModel(model, quantization !== undefined ? { quantization } : {});
  }

  async listen(port: number, host = '127.0.0.1'): Promise<AddressInfo> {
    await new Promise<void>((resolve, reject) => {
      this.server.once('error', reject);
      this.server.listen(port, host, () => {
        this.server.off('error', reject);
        resolve();
      });
    });
    return this.server.address() as AddressInfo;
  }

  /** Base URL of the listening server, e.g. http://127.0.0.1:8000. */
  get url(): string {
    const address = this.server.address() as AddressInfo;
    const host = address.family === 'IPv6' ? `[${address.address}]` : address.address;
    return `${this.options.tls ? 'https' : 'http'}://${host}:${address.port}`;
  }

  /**
   * Graceful stop: refuse new requests, let those in flight finish for up to `graceMs`, abort the rest, close the
   * engine and every connection. The port stays open while requests are in flight, so load balancers see the
   * draining state (/health 503 "draining") and new requests get a 503 shutting_down with Retry-After rather than a
   * refused connection; it closes once nothing runs or the grace period ends.
   */
  shutdown(graceMs: number): Promise<void> {
    this.stopping ??= this.stop(graceMs);
    return this.stopping;
  }

  /** Ends the shutdown grace period now (a second stop signal): requests still running are aborted. */
  endGrace(): void {
    this.gateway.endGrace();
  }

  private async stop(graceMs: number): Promise<void> {
    // Keep-alive connections with nothing in flight are closed now; answers given while draining close theirs.
    this.server.closeIdleConnections();
    await this.gateway.drain(graceMs);
    const closed = new Promise<void>((resolve) => this.server.close(() => resolve()));
    // Aborted streams get a moment to send their error event; a client that stopped reading does not hold us up.
    await within(this.gateway.whenIdle(), 1000);
    this.server.closeAllConnections();
    // Closing the engine ends any stream it still holds, so no run can outlive it.
    await within(this.gateway.whenIdle(), 1000);
    this.gateway.state = 'stopped';
    await Promise.all(this.gateway.servedModels.map(({ backend }) => backend.engine.close()));
    await this.gateway.close();
    await this.gateway.whenIdle();
    await closed;
    this.webConsole.close();
    if (this.ownsTelemetry) {
      // Spans still queued go out now; a collector that is down is reported, not thrown.
      const exportError = await this.telemetry.shutdown();
      if (exportError) this.logger.warn(`telemetry: spans not exported at shutdown: ${exportError.message}`);
    }
  }

  // ---- routing ----

  private buildRoutes(): Route[] {
    const g = this.gateway;
    const route = (name: string, match: Route['match'], auth: boolean, methods: Route['methods'],
      traced?: Route['traced']): Route =>
      ({ name, match, auth, rateLimited: traced !== undefined, methods, ...(traced ? { traced } : {}) });
    const t = this.telemetry;
    return [
      route('chat_completions', exact('/v1/chat/completions'), true,
        { POST: ({ call, body }) => g.chatCompletions(call, body) }, 'chatcmpl'),
      route('completions', exact('/v1/completions'), true, { POST: ({ call, body }) => g.completions(call, body) }, 'cmpl'),
      route('responses', exact('/v1/responses'), true, { POST: ({ call, body }) => g.responses(call, body) }, 'resp'),
      route('models', exact('/v1/models'), true, { GET: () => g.models() }),
      route('model', (p) => {
        const m = /^\/v1\/models\/(.+)$/.exec(p);
        return m ? [decodePathSegment(m[1]!, p)] : undefined;
      }, true, { GET: ({ params }) => g.model(params[0]!) }),
      // Not rate limited, as vLLM's: bounded in size, queued for the tokenizer thread in the tenant's turn (prompt-encoder.ts).
      route('tokenize', exact('/tokenize'), true, { POST: ({ call, body }) => g.tokenize(call, body) }),
      route('detokenize', exact('/detokenize'), true, { POST: ({ body }) => g.detokenize(body) }),
      ...(this.options.tokenizerInfoEndpoint ? [route('tokenizer_info', exact('/tokenizer_info'), true, { GET: () => g.tokenizerInfo() })] : []),
      route('health', exact('/health'), false, { GET: () => g.health() }),
      route('live', exact('/live'), false, { GET: () => ({ status: 200, body: { status: 'alive' } }) }),
      route('version', exact('/version'), false, { GET: () => ({ status: 200, body: { version: CONDUIT_VERSION } }) }),
      admin(route('metrics', exact('/metrics'), !this.options.publicMetrics, { GET: ({ res }) => this.sendMetrics(res) }),
        !this.options.publicMetrics),
      route('request_trace', (p) => {
        const m = /^\/v1\/requests\/([^/]+)\/trace$/.exec(p);
        if (!m) return undefined;
        // A malformed escape names no request: looked up as sent, it is a 404 like any unknown id.
        try {
          return [decodeURIComponent(m[1]!)];
        } catch {
          return [m[1]!];
        }
      }, true, { GET: ({ params, call }) => this.traceReply(this.traceIdOf(params[0]!, call.tenant), call.tenant) }),
      admin(route('slo', exact('/v1/slo'), true, { GET: () => ({ status: 200, body: t.sloReport() }) })),
      admin(route('analysis', exact('/v1/analysis'), true, { GET: () => ({ status: 200, body: t.analysis() }) })),
      admin({ ...route('reset_prefix_cache', exact('/reset_prefix_cache'), true, { POST: () => this.resetPrefixCache() }), bodyOptional: true }),
      // The web console (src/api/console.ts): pages and assets hold no data; its JSON follows the traces' rule.
      route('console', (p) => (p === '/console' || p === '/console/' || /^\/console\/requests\/[^/]+$/.test(p) ? [] : undefined), false,
        { GET: ({ req, res }) => this.webConsole.sendPage(req, res) }),
      route('console_asset', (p) => /^\/console\/assets\/([^/]+)$/.exec(p)?.slice(1), false, {
        GET: ({ req, res, params }) => {
          if (!this.webConsole.sendAsset(req, res, params[0]!)) throw new RouteNotFoundError('GET', req.url ?? '');
        },
      }),
      route('console_overview', exact('/console/api/overview'), true, { GET: ({ call }) => this.webConsole.overview(call.tenant) }),
      route('console_request', (p) => {
        const m = /^\/console\/api\/requests\/([^/]+)$/.exec(p);
        return m ? [decodePathSegment(m[1]!, p)] : undefined;
      }, true, { GET: ({ params, call }) => this.webConsole.request(this.traceIdOf(params[0]!, call.tenant), call.tenant) }),
      // vLLM's runtime LoRA API; a path on this machine is read, so only an admin may when keys are configured.
      admin(route('load_lora_adapter', exact('/v1/load_lora_adapter'), true, {
        POST: async ({ res, body, call }) => sendText(res, await g.loadLoraAdapter(body), call.headers),
      })),
      admin(route('unload_lora_adapter', exact('/v1/unload_lora_adapter'), true, {
        POST: async ({ res, body, call }) => sendText(res, await g.unloadLoraAdapter(body), call.headers),
      })),
    ];
  }

  /**
   * POST /reset_prefix_cache: every worker forgets its cached prefixes and gives its KV pool's memory back to the
   * system. 409 when a worker had requests running (the workers that were idle still reset).
   */
  private async resetPrefixCache(): Promise<JsonReply> {
    const models = this.gateway.servedModels;
    if (models.length === 0) throw new NotReadyError('still loading its model');
    const results = await Promise.all(models.map(({ backend }) => backend.engine.resetPrefixCache()));
    if (results.includes(false)) throw new PrefixCacheInUseError();
    return { status: 200, body: { reset: true } };
  }

  /**
   * The trace a lookup by `id` means: the request with that id, or else the newest one that sent it as its
   * X-Request-Id (the id such a client saw in x-request-id) or request_id, or whose response it names
   * (chatcmpl-<id>), among the requests whose traces the caller may read.
   * Unknown: the id as given (a 404 where it is looked up).
   */
  private traceIdOf(id: string, caller: Tenant): string {
    const mayRead = (traceId: string): boolean => {
      const trace = this.telemetry.trace(traceId);
      return trace !== undefined && (this.options.keyStore.isAdmin(caller) || trace.tenant === caller.name);
    };
    if (mayRead(id)) return id;
    return this.clientRequestIds.serverIds(id).find(mayRead) ?? id;
  }

  /**
   * GET /v1/requests/{id}/trace: the trace's JSON view, its text waterfall and the bottleneck diagnosis. A tenant
   * sees only its own requests' traces: another tenant's is a 404 like an unknown id, so ids do not leak.
   */
  private traceReply(requestId: string, caller: Tenant): JsonReply {
    const trace = this.telemetry.trace(requestId);
    const visible = trace !== undefined && (this.options.keyStore.isAdmin(caller) || trace.tenant === caller.name);
    if (!visible) throw new TraceNotFoundError(requestId, this.telemetry.traces.capacity);
    return {
      status: 200,
      body: {
        ...this.telemetry.traceView(requestId),
        waterfall: this.telemetry.waterfall(requestId),
        analysis: this.telemetry.analyzer.classify(trace),
      },
    };
  }

  private async sendMetrics(res: ServerResponse): Promise<void> {
    this.refreshEngineStats();
    const served = this.gateway.servedModels;
    for (const { name, backend } of served) if (backend.adapters) this.metrics.setLora(name, backend.adapters.stats());
    const text = await this.metrics.render(served.map(({ name, backend }) => ({ model: name, stats: backend.engine.stats() })));
    res.writeHead(200, { 'Content-Type': PROMETHEUS_CONTENT_TYPE, 'Content-Length': Buffer.byteLength(text) });
    endWithin(res, text, this.options.writeTimeoutMs);
  }

  /**
   * Hands each worker's stats to the telemetry: load gauges, and counters advanced by what the engine's cumulative
   * counters moved. Done at scrape time, so the gauges are as fresh as the scrape and cost nothing in between.
   */
  private refreshEngineStats(): void {
    const seen = new Set<string>();
    for (const { workerId, model, stats } of this.workerSources()) {
      seen.add(workerId);
      this.telemetry.updateEngineStats({ worker: workerId, model, stats });
    }
    for (const worker of this.reportedWorkers) if (!seen.has(worker)) this.telemetry.metrics.forgetWorker(worker);
    this.reportedWorkers = seen;
  }

  /**
   * The workers serving now, each with its stats and model: what /metrics' per-worker series and the console list.
   * Every model's pool names its workers worker-0 ...: with several models the worker's name says whose it is.
   */
  private workerSources(): (ConsoleWorkerSource & { model: string })[] {
    const models = this.gateway.servedModels;
    return models.flatMap(({ name: model, backend }) => {
      const { engine } = backend;
      const workers: ConsoleWorkerSource[] = isMultiWorker(engine) ? engine.workerStats()
        : [{ workerId: backend.workerId ?? this.gateway.workerId, stats: engine.stats(), info: engine.info }];
      return workers.map((w) => ({ ...w, model, workerId: models.length > 1 ? `${model}:${w.workerId}` : w.workerId }));
    });
  }

  /**
   * A generation request's id and trace, from arrival on. A client's X-Request-Id (as vLLM takes it) is the id its
   * answers carry in x-request-id, refusals included, and names its response; one that may not name a request is
   * refused later (checkClientRequestId), and meanwhile the server's id is the one answered. A request_id in the
   * body is read once the body is (readBodyRequestId).
   */
  private openTrace(call: Call, route: Route, path: string, req: IncomingMessage): CallTrace {
    const id = newCompletionId(route.traced!);
    call.requestId = id;
    const clientId = clientRequestIdOf(req);
    if (clientId !== undefined && requestIdProblem(clientId) === undefined) {
      call.clientRequestId = clientId;
      this.clientRequestIds.add(clientId, id);
      // The response's id (chatcmpl-<header>, cmpl-<header>) finds the trace too.
      if (route.traced !== 'resp') this.clientRequestIds.add(`${route.traced!}-${clientId}`, id);
    }
    call.headers['x-request-id'] = call.clientRequestId ?? id;
    call.trace = new CallTrace(this.telemetry, id, call.arrivalMs, path, this.engineClock, call.traceparent, call.tracestate);
    const release = this.clockHold?.();
    if (release) call.trace.holdClockUntilTokenized(release);
    return call.trace;
  }

  /**
   * CORS headers for a request from an allowed origin; a preflight (OPTIONS with Access-Control-Request-Method) is
   * answered here, before routing and keys (browsers send it without the Authorization header). True when answered.
   */
  private allowCrossOrigin(req: IncomingMessage, res: ServerResponse, method: string): boolean {
    const origins = this.options.allowedOrigins;
    const origin = req.headers.origin;
    if (!origins || origins.length === 0 || origin === undefined) return false;
    const any = origins.includes('*');
    if (!any && !origins.includes(origin)) return false;
    res.setHeader('Access-Control-Allow-Origin', any ? '*' : origin);
    if (!any) res.setHeader('Vary', 'Origin');
    res.setHeader('Access-Control-Expose-Headers', CORS_EXPOSED_HEADERS);
    if (method !== 'OPTIONS' || req.headers['access-control-request-method'] === undefined) return false;
    res.writeHead(204, {
      'Access-Control-Allow-Methods': 'GET, POST, OPTIONS',
      'Access-Control-Allow-Headers': req.headers['access-control-request-headers'] ?? '*',
      'Access-Control-Max-Age': '600',
      'Content-Length': '0',
    });
    res.end();
    return true;
  }

  /**
   * A browser sends Origin with every cross-origin POST, the "simple" ones too (text/plain, no preflight) that a page
   * on any site may send: CORS headers keep only the answer from that page, not the work from being done. So a POST
   * (every route that does work or changes state: generations, tokenizing, adapters, the prefix cache) from an origin
   * --allowed-origins does not allow is refused. No Origin (curl, SDKs) passes, and so does the server's own origin
   * (a page it serves); with '*' (the default) every origin does.
   */
  private refuseForeignOrigin(req: IncomingMessage): void {
    const origin = req.headers.origin;
    const origins = this.options.allowedOrigins ?? [];
    if (origin === undefined || origins.includes('*') || origins.includes(origin)) return;
    if (req.headers.host !== undefined && originHost(origin) === req.headers.host.toLowerCase()) return;
    throw new OriginNotAllowedError(origin);
  }

  /** One request; `continuePending`: the client waits for a 100 Continue before sending its body. */
  private async handle(req: IncomingMessage, res: ServerResponse, continuePending: boolean): Promise<void> {
    const startedMs = performance.now();
    const path = requestPath(req.url);
    const method = req.method ?? 'GET';
    let routeName = 'unknown';
    // A body announced and not read yet: a refusal before reading it (no key, a limit, a wrong route) closes the
    // connection, or Node would read and discard all of it, however large, to reach the next request.
    const contentLength = req.headers['content-length'];
    let bodyFullyRead = req.headers['transfer-encoding'] === undefined && (contentLength === undefined || Number(contentLength) === 0);
    // Reading began and did not finish (too large, or the client left while sending): the receive phase failed.
    let readingBody = false;
    const clientGone = new AbortController();
    // The response's own 'close' says the client left. A pipelined request queued behind another on its connection
    // never gets one when the connection dies (Node hands it the socket only when its turn comes), so the socket's
    // close counts too: else its run would go on for nobody, holding its slots.
    const socket = req.socket;
    const unwatch = this.watchClose(socket, () => {
      if (!res.writableFinished) clientGone.abort();
    });
    res.on('close', () => {
      unwatch();
      if (!res.writableFinished) clientGone.abort();
    });
    // While draining, each answer closes its connection: the client's next request goes to a new one (elsewhere).
    if (this.stopping) res.setHeader('Connection', 'close');
    if (this.allowCrossOrigin(req, res, method)) return;
    const traceparent = req.headers.traceparent;
    const tracestate = req.headers.tracestate;
    // W3C Trace Context: all-zero ids and version ff are invalid, to be ignored rather than passed on or echoed.
    const parent = typeof traceparent === 'string' ? parseTraceparent(traceparent) : undefined;
    // A later version than 00 continues the client's trace too, as the spec asks, but goes on in version 00, the one
    // Conduit speaks: its fields beyond 00's (of any length) and flags whose meaning there is unknown are not carried.
    const clientParent = parent === undefined ? undefined
      : parent.version === '00' ? (traceparent as string).trim() : formatTraceparent(parent.traceId, parent.parentSpanId, parent.sampled);
    const call: Call = {
      res,
      tenant: { name: ANONYMOUS_TENANT, limits: {}, cacheSalt: undefined },
      arrivalMs: this.engineClock(),
      ...(clientParent !== undefined ? { traceparent: clientParent } : {}),
      ...(clientParent !== undefined && typeof tracestate === 'string' && TRACESTATE.test(tracestate) ? { tracestate } : {}),
      clientGone: clientGone.signal,
      headers: {},
    };
    let failure: ApiError | undefined;
    // The body's request_id, when it names the request in the log line in place of an X-Request-Id.
    let bodyRequestId: string | undefined;
    try {
      if (req.httpVersionMajor === 1 && req.httpVersionMinor >= 1 && req.headers.host === undefined) throw new MissingHostError();
      // Node undoes only chunked: a body sent with another transfer coding would be read still encoded.
      const transferEncoding = req.headers['transfer-encoding'];
      if (transferEncoding !== undefined && transferEncoding.trim().toLowerCase() !== 'chunked') {
        throw new TransferCodingNotImplementedError(transferEncoding);
      }
      // "OPTIONS *" asks what the server as a whole supports (RFC 9110).
      if (method === 'OPTIONS' && req.url === '*') {
        res.writeHead(204, { Allow: 'GET, HEAD, POST, OPTIONS' });
        res.end();
        return;
      }
      // OPTIONS on a route (not a CORS preflight, answered above when its origin is allowed) describes that route,
      // as RFC 9110 asks: its methods, like "OPTIONS *" for the whole server. A refused preflight stays a 405.
      if (method === 'OPTIONS' && req.headers['access-control-request-method'] === undefined) {
        const allowed = this.routeMethods(path, (name) => { routeName = name; });
        if (allowed) {
          res.writeHead(204, { Allow: allowed.join(', ') });
          res.end();
          return;
        }
      }
      const found = this.findRoute(method, path, (name) => { routeName = name; });
      // Before the trace, the key, the rate limit and the body: a forged request takes nothing.
      if (method === 'POST') this.refuseForeignOrigin(req);
      const trace = found.route.traced ? this.openTrace(call, found.route, path, req) : undefined;
      if (found.route.auth) {
        const start = this.engineClock();
        try {
          call.tenant = this.options.keyStore.authenticate(req.headers.authorization);
        } catch (err) {
          trace?.authenticated(start, false);
          throw err;
        }
        trace?.authenticated(start, true, call.tenant.name);
        if (found.route.admin && !this.options.keyStore.isAdmin(call.tenant)) throw new AdminRequiredError(path);
      }
      if (found.route.rateLimited) {
        const start = this.engineClock();
        try {
          this.limiter.precheck(call.tenant);
        } catch (err) {
          trace?.precheckRefused(start, call.tenant.name, err);
          throw err;
        }
        trace?.prechecked(start, call.tenant.name);
      }
      let body: unknown;
      if (method === 'POST') {
        const contentEncoding = req.headers['content-encoding'];
        if (contentEncoding !== undefined && !/^\s*(identity)?\s*$/i.test(contentEncoding)) {
          throw new UnsupportedContentEncodingError(contentEncoding);
        }
        bodyFullyRead = false;
        readingBody = true;
        this.readingBody.add(socket);
        const bytes = await readBody(req, this.maxBodyBytes, continuePending ? () => res.writeContinue() : undefined)
          .finally(() => this.readingBody.delete(socket));
        readingBody = false;
        bodyFullyRead = true;
        trace?.bodyRead(bytes.length);
        try {
          body = found.route.bodyOptional && bytes.toString('utf8').trim() === '' ? undefined
            : parseJsonBytes(bytes, req.headers['content-type']);
        } catch (err) {
          const model = this.gateway.servedModelName;
          trace?.validated({ ok: false, ...(model !== undefined ? { model } : {}) });
          throw err;
        }
      }
      if (found.route.traced) {
        this.checkClientRequestId(req, call);
        bodyRequestId = this.readBodyRequestId(body, call, found.route);
        this.readSessionId(req, call);
      }
      const reply = await found.handler({ req, res, call, body, params: found.params });
      if (reply && !call.clientGone.aborted) sendJsonReply(res, reply, call.headers, this.options.writeTimeoutMs);
    } catch (err) {
      failure = toApiError(err);
      this.sendError(res, failure, call, bodyFullyRead);
    } finally {
      // The request ends with its response's last byte flushed, or with the connection: a client that stops reading
      // an answer is closed after --write-timeout, and then counted as gone.
      await responseSettled(res);
      // The upload timed out (the server ended it with a 408, answerUnparsable), or the client left.
      const timedOut = readingBody && this.bodyTimedOut.has(socket);
      if (timedOut) failure = new BodyTimeoutError(this.server.requestTimeout / 1000);
      const status = timedOut ? 408 : clientGone.signal.aborted && !res.headersSent ? 499 : res.statusCode;
      // After the response's last byte (or the client's leaving): the request's one terminal event.
      const model = this.gateway.servedModelName;
      call.trace?.end({
        ...(failure ? { error: failure } : {}), ...(model !== undefined ? { model } : {}),
        clientGone: clientGone.signal.aborted && !timedOut, bodyIncomplete: readingBody,
      });
      this.metrics.countResponse(routeName, status, call.tenant.name);
      if (call.ignoredFields) this.warnIgnoredFields(path, call, call.ignoredFields);
      this.logRequest(method, path, routeName, status, call, call.clientRequestId ?? bodyRequestId, performance.now() - startedMs);
    }
  }

  /**
   * The request's line: key=value fields after "METHOD path status", tokens and TTFT for generation requests.
   * `clientId`: the client's X-Request-Id, or else its body's request_id.
   */
  private logRequest(method: string, path: string, routeName: string, status: number, call: Call, clientId: string | undefined,
    totalMs: number): void {
    const fields = [`${method} ${path} ${status}`, `tenant=${call.tenant.name}`];
    if (call.trace) {
      const { promptTokens, outputTokens, ttftMs } = call.trace.summary();
      fields.push(`prompt_tokens=${promptTokens ?? '-'}`, `output_tokens=${outputTokens ?? '-'}`,
        `ttft_ms=${ttftMs === undefined ? '-' : ttftMs.toFixed(1)}`);
    }
    fields.push(`total_ms=${totalMs.toFixed(1)}`);
    if (call.requestId !== undefined) fields.push(`id=${call.requestId}`);
    // The client's X-Request-Id (or request_id) beside the server's id, to match this line with a proxy's or the
    // client's own logs. Quoted when it could be read as more than one field (a space, a quote, a backslash, an =
    // sign) or holds anything but printable ASCII.
    if (clientId !== undefined) {
      fields.push(`client_request_id=${/^[\x21-\x7e]+$/.test(clientId) && !/["\\=]/.test(clientId) ? clientId : quoteForLog(clientId)}`);
    }
    const line = fields.join(' ');
    if ((this.options.requestLog ?? true) && !PROBE_ROUTES.has(routeName)) this.logger.info(line);
    else this.logger.debug(line);
  }

  /**
   * vLLM's warning for the fields of a request it ignores: a misspelt field ("max_token") would otherwise leave the
   * request on a default without a trace. Names are the client's: a few of them, each cut short, quoted when odd.
   */
  private warnIgnoredFields(path: string, call: Call, fields: readonly string[]): void {
    const names = fields.slice(0, MAX_IGNORED_FIELDS_NAMED).map((name) => {
      const short = name.length > 64 ? `${name.slice(0, 64)}...` : name;
      return /^[\w.-]+$/.test(short) ? short : quoteForLog(short);
    });
    const more = fields.length > names.length ? ` and ${fields.length - names.length} more` : '';
    const one = fields.length === 1;
    this.logger.warn(`request ${call.requestId ?? '-'}: the request's ${one ? 'field' : 'fields'} ${names.join(', ')}${more} `
      + `${one ? 'is' : 'are'} not read by ${path} and ${one ? 'was' : 'were'} ignored`);
  }

  /** An X-Request-Id that may not name a request (requestIdProblem) is refused: it would name the response. */
  private checkClientRequestId(req: IncomingMessage, call: Call): void {
    const clientId = clientRequestIdOf(req);
    if (clientId !== undefined) this.checkRequestId('x-request-id', clientId, call);
  }

  /**
   * vLLM's request_id in the body names the request as the header does: it is refused by the same rules, with the
   * same error naming the field (before the request's other fields, as the header is), and the trace is found by it
   * and by the response's id (chatcmpl-<id>). The header goes first, as vLLM takes them: given both, the body's
   * id names nothing there. /v1/responses is named by the body's id alone (vLLM's), so that one finds the trace
   * whatever the header. x-request-id stays the server's id (vLLM echoes only a header there): every answer carries
   * it, refusals before the body included. Returns the id the log line shows when no header does.
   */
  private readBodyRequestId(body: unknown, call: Call, route: Route): string | undefined {
    const value = typeof body === 'object' && body !== null ? (body as { request_id?: unknown }).request_id : undefined;
    // Not a string: the request's schema refuses it, naming the field as for any other. Empty: none, as vLLM has it.
    if (typeof value !== 'string' || value === '') return undefined;
    this.checkRequestId('request_id', value, call);
    const serverId = call.requestId!;
    if (route.traced === 'resp') {
      this.clientRequestIds.add(value, serverId);
      return value;
    }
    if (call.clientRequestId !== undefined) return undefined;
    this.clientRequestIds.add(value, serverId);
    this.clientRequestIds.add(`${route.traced!}-${value}`, serverId);
    return value;
  }

  /** Refuses a client's id (header or body field `param`) that may not name a request, as a failed validation. */
  private checkRequestId(param: string, id: string, call: Call): void {
    const problem = requestIdProblem(id);
    if (problem === undefined) return;
    const model = this.gateway.servedModelName;
    call.trace?.validated({ ok: false, ...(model !== undefined ? { model } : {}) });
    throw new InvalidValueError(param, problem);
  }

  /** The session header's value on the call; an empty header is no session, an overlong one is refused. */
  private readSessionId(req: IncomingMessage, call: Call): void {
    const value = req.headers[this.sessionHeader];
    // Node joins repeated headers with ", " (an array only for set-cookie): one string either way.
    const sessionId = Array.isArray(value) ? value.join(', ') : value?.trim();
    if (sessionId === undefined || sessionId === '') return;
    if (sessionId.length > MAX_SESSION_ID_LENGTH) {
      const model = this.gateway.servedModelName;
      call.trace?.validated({ ok: false, ...(model !== undefined ? { model } : {}) });
      throw new InvalidValueError(this.sessionHeader,
        `a session id may be at most ${MAX_SESSION_ID_LENGTH} characters, got ${sessionId.length}.`);
    }
    call.sessionId = sessionId;
  }

  /** The methods a path's route answers (HEAD with GET, and OPTIONS), or undefined when no route has the path. */
  private routeMethods(path: string, matched: (name: string) => void): string[] | undefined {
    for (const route of this.routes) {
      if (!route.match(path)) continue;
      matched(route.name);
      return [...answeredMethods(route), 'OPTIONS'];
    }
    return undefined;
  }

  /** The route and handler of a request; `matched` learns the route's name before a method it lacks is refused. */
  private findRoute(method: string, path: string, matched: (name: string) => void): { route: Route; handler: Handler; params: string[] } {
    for (const route of this.routes) {
      const params = route.match(path);
      if (!params) continue;
      matched(route.name);
      // HEAD is GET without the body (Node's response sends none for a HEAD request): probes and `curl -I` work.
      const handler = route.methods[method === 'HEAD' ? 'GET' : method as 'GET' | 'POST'];
      if (!handler) throw new MethodNotAllowedError(method, path, answeredMethods(route));
      return { route, handler, params };
    }
    throw new RouteNotFoundError(method, path);
  }

  private sendError(res: ServerResponse, error: ApiError, call: Call, bodyFullyRead: boolean): void {
    if (error instanceof ClientClosedRequestError || call.clientGone.aborted) return;
    if (error.statusCode === 500) this.logger.error(`${error.message}\n${error.stack ?? ''}`);
    if (error.statusCode === 429 || error.statusCode === 503) this.metrics.countRejection(call.tenant.name, error.code);
    if (res.headersSent) {
      // Past the status line nothing can be said in JSON; cutting the connection is the only honest signal.
      res.destroy();
      return;
    }
    // A body we stopped reading (too large, or refused before reading) makes the connection unusable for another
    // request: close it after this answer.
    const headers: Record<string, string> = { ...call.headers, ...error.headers };
    // A request refused or failed after its admission has given back what it held by now: its answer says what the
    // tenant has left after that, not what it had while the request held its reservation.
    const admitted = RATE_LIMIT_HEADER_NAMES.some((name) => name in call.headers);
    if (error.statusCode === 429 || admitted) Object.assign(headers, this.limiter.headers(call.tenant));
    if (!bodyFullyRead) headers.Connection = 'close';
    sendJsonReply(res, { status: error.statusCode, body: error.toBody() }, headers, this.options.writeTimeoutMs);
  }
}

/** The host (and port) of an Origin header's value; undefined for an opaque origin ("null") or one that is no URL. */
function originHost(origin: string): string | undefined {
  try {
    return new URL(origin).host || undefined;
  } catch {
    return undefined;
  }
}

/**
 * Resolves once a response whose head is out is flushed to its end or its connection closed (at once for a
 * response not begun: the client left before it).
 */
function responseSettled(res: ServerResponse): Promise<void> {
  if (!res.headersSent || res.writableFinished || res.destroyed) return Promise.resolve();
  return new Promise((resolve) => {
    const done = (): void => {
      res.off('finish', done);
      res.off('close', done);
      resolve();
    };
    res.on('finish', done);
    res.on('close', done);
  });
}

/** A 200 with a plain-text body, as vLLM answers its LoRA endpoints. */
function sendText(res: ServerResponse, text: string, headers: Record<string, string>): void {
  res.writeHead(200, { ...headers, 'Content-Type': 'text/plain; charset=utf-8', 'Content-Length': Buffer.byteLength(text) });
  res.end(text);
}

/** A percent-encoded path segment as text; a malformed escape is the client's 400, not a URIError's 500. */
function decodePathSegment(segment: string, path: string): string {
  try {
    return decodeURIComponent(segment);
  } catch {
    throw new MalformedPathError(path);
  }
}

/** The request's X-Request-Id header, trimmed; absent or empty: none. Node joins a repeated header with ", ". */
function clientRequestIdOf(req: IncomingMessage): string | undefined {
  const value = req.headers['x-request-id'];
  const id = (Array.isArray(value) ? value.join(', ') : value)?.trim();
  return id === undefined || id === '' ? undefined : id;
}

/** Waits for `promise`, but no longer than `ms`. */
async function within(promise: Promise<void>, ms: number): Promise<void> {
  let timer: NodeJS.Timeout | undefined;
  await Promise.race([promise, new Promise<void>((resolve) => { timer = setTimeout(resolve, ms); })]);
  clearTimeout(timer);
}
