// The gateway proper: turns validated OpenAI requests into engine requests (chat template, tokenizer, context
// checks), admits them (overload bound, tenant limits), runs them, and gives back what they held however they end.
// It knows nothing of routing or sockets beyond the response it writes to; server.ts does HTTP.

import { createHash } from 'node:crypto';
import type { ServerResponse } from 'node:http';
import type { Engine, SchedulingPolicy } from '../engine/types.ts';
import {
  ChatTemplateError, type ChatMessage as TemplateMessage, type ContentFormat, type RenderOptions,
} from '../model/chat-template.ts';
import type { EncodeOptions, Tokenizer } from '../model/tokenizer/types.ts';
import type { Tenant } from './auth.ts';
import type { CallTrace } from './call-trace.ts';
import {
  type ApiError, BrokenChatTemplateError, TemplateRefusedMessagesError, ClientClosedRequestError, ContextLengthError, EngineRejectedError, InvalidValueError, KvCapacityError, ModelNotFoundError,
  PromptTooLargeError, PromptTooLongError, TooManySequencesError, LoraAdapterError, LoraCapacityExceededError, WrongTypeError,
  GraceEndedError, NoChatTemplateError, NoWorkerAvailableError, NotReadyError, OverloadedError, RequestTimeoutError, ShuttingDownError,
} from './errors.ts';
import { GenerationRun, type PreparedPrompt } from './generation-run.ts';
import type { GatewayMetrics } from './gateway-metrics.ts';
import { newCompletionId, TokenTexts, unixSeconds, type ChatResponseMeta } from './openai-format.ts';
import type { Admission, TenantRateLimiter } from './rate-limit.ts';
import { collectRun, streamRun } from './respond.ts';
import { ChatShape, CompletionShape, PromptLogprobsShape, TokenIdsShape, type ResponseShape } from './response-shapes.ts';
import { GuidedChecker } from './guided.ts';
import { detectToolCallParser, mistralToolCallIds, toolSyntaxTexts, ToolChatShape, type ToolCallParserName } from './tool-calls.ts';
import { parseChatCompletionRequest, type ChatCompletionRequest, type ChatMessage } from './schemas/chat.ts';
import { completionPromptLogprobs, parseCompletionRequest } from './schemas/completion.ts';
import type { GenerationDefaults } from '../model/generation-config.ts';
import { parseResponsesRequest, responsesError } from './schemas/responses.ts';
import { ResponsesShape } from './responses-shape.ts';
import {
  checkSchedulingFields, secondaryEosTokenIds, toSamplingParams, truncatedPrompt, type GenerationOptions, type ValidationContext,
} from './schemas/generation.ts';
import { parseDetokenizeRequest, parseTokenizeRequest } from './schemas/tokenize.ts';
import { PromptEncoder } from './prompt-encoder.ts';
import { SseWriter } from './sse.ts';
import type { JsonObject } from './validate.ts';

/**
 * How long a prompt may be before it is tokenized: 'context', one that must fit the context; 'truncate', one with
 * truncate_prompt_tokens; 'tokenize', the text of /tokenize (Gateway.promptBytesLimit).
 */
type PromptBound = 'context' | 'truncate' | 'tokenize';

/** The model's chat template (src/model/chat-template.ts's ChatTemplate fits). */
export interface ChatTemplateRenderer {
  render(messages: readonly TemplateMessage[], options: RenderOptions): string;
  /** The template's text, when known: the tool-call format is recognised from it. */
  readonly sourceText?: string;
  /** Whether the template takes content as a string or as the list of parts (ChatTemplate's; "string" without). */
  contentFormat?(options: RenderOptions): ContentFormat;
}

/** What the gateway serves: an engine plus the tokenizer and chat template of its model. */
export interface ModelBackend {
  engine: Engine;
  tokenizer: Tokenizer;
  chatTemplate?: ChatTemplateRenderer;
  /**
   * The worker name metrics and traces give an engine that is not routed (a routed engine's outputs name their
   * worker). Default: worker-0, the name the worker pool gives its first worker.
   */
  workerId?: string;
  /**
   * The clock the engine's timestamps are on, when it is not the engine clock (simulated workers at a speed-up
   * other than 1, WorkerPool.clock): the API server stamps arrivals and phases with it, so a request has one clock.
   */
  clock?: () => number;
  /**
   * Simulated workers at speed-up Infinity (WorkerPool.holdClock): the API server holds their clock from a request's
   * arrival until its prompt is tokenized, so the gateway's real work takes no simulated time.
   */
  holdClock?: () => () => void;
  /** The model's LoRA adapters (runtime/lora-manager.ts fits), when it serves any. */
  adapters?: AdapterHost;
  /**
   * Defaults for the sampling fields a request leaves out, a cap on its max_tokens, and more end-of-generation ids
   * (the model folder's generation_config.json, as vLLM applies it).
   */
  generationDefaults?: GenerationDefaults;
}

/** The LoRA adapters of one served model, as the gateway uses them. */
export interface AdapterHost {
  /** Registered adapters, each with the file it came from. */
  list(): { name: string; path: string; resident: boolean }[];
  has(name: string): boolean;
  /**
   * Makes the adapter resident for a request and counts it until release; resolves the engine's key for it. May
   * wait for a slot (every resident adapter busy) until `signal` aborts.
   */
  acquire(name: string, signal?: AbortSignal): Promise<string>;
  /** Ends what acquire counted, by the key it resolved. */
  release(key: string): void;
  register(name: string, path: string): Promise<unknown>;
  /** Forgets the adapter now; unloads it once its requests in flight (resolved) finish. */
  unregister(name: string): Promise<{ inFlight: number }>;
  stats(): { registered: number; resident: number; loads: number; evictions: number; waiting?: number };
}

/** One model the gateway serves, under the name clients send as "model". */
export interface ServedModel {
  name: string;
  backend: ModelBackend;
}

/** What a request is for: the served model it runs on, and the LoRA adapter when it names one. */
export interface ModelTarget {
  /** The name the request used (the id its responses carry). */
  name: string;
  backend: ModelBackend;
  /** Set when the name is an adapter of the backend's model. */
  adapter?: string;
  /** The served name of the base model (the adapter's parent). */
  baseName?: string;
}

export const DEFAULT_WORKER_ID = 'worker-0';

/**
 * Sequences one request may ask for by default: one prompt at OpenAI's largest n (128), and half the default
 * pending bound, so no single request can take the whole server.
 */
export const DEFAULT_MAX_SEQUENCES_PER_REQUEST = 128;

/**
 * Bytes per token of the context a text tokenized whole without having to fit it may have (a prompt with
 * truncate_prompt_tokens, the text of /tokenize): some 16 contexts of English text (about 4 bytes a token), and never
 * less than an untruncated prompt may have (the tokenizer's longest token, when that is more). It bounds the time one
 * request holds the model's tokenizer thread.
 */
export const WHOLE_TEXT_BYTES_PER_TOKEN = 64;

/** A model name as an id for the "model" field: whitespace runs become one "-", nothing else changes. */
export function modelIdFromName(name: string): string {
  const id = name.trim().replace(/\s+/g, '-');
  return id === '' ? 'model' : id;
}

export type GatewayState = 'loading' | 'ready' | 'draining' | 'stopped';

export interface GatewayOptions {
  /** Name clients use in "model"; defaults to the engine's model name. */
  servedModelName?: string;
  /** Sequences (prompts x n of every request) in flight beyond which new requests get 503. */
  maxPendingRequests: number;
  /** Most sequences (prompts x n) one request may ask for; more is a 400. Default DEFAULT_MAX_SEQUENCES_PER_REQUEST. */
  maxSequencesPerRequest?: number;
  /** Prompts this long (UTF-16 units) or longer are tokenized on a tokenizer thread. Default DEFAULT_OFF_THREAD_CHARS. */
  offThreadChars?: number;
  /** Per-request limit on generation time; undefined = none. */
  requestTimeoutMs?: number;
  /**
   * How long a write waits for a client that stopped reading before the connection is closed (SseWriter, endWithin);
   * undefined = for ever.
   */
  writeTimeoutMs?: number;
  limiter: TenantRateLimiter;
  metrics: GatewayMetrics;
  /** The engine clock (epoch ms), for the stamps of the request's trace. */
  now: () => number;
  /** How tool calls are found in the model's output under tool_choice "auto" (default: from the chat template). */
  toolCallParser?: ToolCallParserName;
  /** Logprobs name tokens "token_id:<id>" unless a request says otherwise (vLLM's --return-tokens-as-token-ids). */
  returnTokensAsTokenIds?: boolean;
  /**
   * The workers' scheduling policy, when known: a priority or deadline_ms it never reads is a 400
   * (checkSchedulingFields). Undefined: both are passed on whatever they are.
   */
  schedulingPolicy?: SchedulingPolicy;
}

/** One HTTP request as the gateway sees it. */
export interface Call {
  res: ServerResponse;
  tenant: Tenant;
  arrivalMs: number;
  traceparent?: string;
  /** The client's tracestate (with a valid traceparent only), passed on with the request's trace context. */
  tracestate?: string;
  /** The conversation id from the session header, for the session routing policy. */
  sessionId?: string;
  /** The server's id of the request (chatcmpl-..., cmpl-...), chosen at arrival: its trace's and engine requests'. */
  requestId?: string;
  /**
   * The client's X-Request-Id header, as vLLM takes it: chat and completion responses are named by it, before any
   * request_id in the body, and every answer's x-request-id is it instead of the server's id.
   */
  clientRequestId?: string;
  /** The request's lifecycle events (generation routes). */
  trace?: CallTrace;
  /** Aborted when the client goes away before its response is complete. */
  clientGone: AbortSignal;
  /** Headers that every answer to this call carries, success or error (request id, rate limits). */
  headers: Record<string, string>;
  /** Fields of the body the endpoint does not read (GenerationOptions.ignoredFields), for the server's warning. */
  ignoredFields?: string[];
}

export type JsonReply = { status: number; body: object };

/** What the server can say while no model is attached yet (conduit frontend: the workers it has found so far). */
export interface LoadingView {
  /** Why no model is served yet, when waiting alone will not bring one. */
  reason?: string;
  /** The workers known meanwhile, as /health lists them once a model is served. */
  workers?: object[];
}

/**
 * The id a response carries: with the client's X-Request-Id header, or else vLLM's request_id, the endpoint's prefix
 * and that id, as vLLM names it (the header first, as vLLM takes it); else the server's own. The server's id
 * (`serverId`) still names the request in the trace and the engine, and in x-request-id when the client sent no
 * header, which keeps requests that reuse an id apart.
 */
function responseId(prefix: 'chatcmpl' | 'cmpl', call: Call, request: GenerationOptions, serverId: string): string {
  const own = call.clientRequestId ?? request.requestId;
  return own !== undefined ? `${prefix}-${own}` : serverId;
}

/**
 * The messages as the template takes them. Roles pass as the client sent them, "developer" too, as vLLM passes them
 * (a template that knows no developer role refuses it, or treats it as its own code says). Content sent as parts goes
 * as parts: the template takes them joined, or as the list when it loops over content (see ContentFormat).
 */
function templateMessages(messages: readonly ChatMessage[]): TemplateMessage[] {
  return messages.map(({ contentParts, ...message }) => ({
    ...message,
    ...(contentParts ? { content: contentParts.map((text) => ({ type: 'text' as const, text })) } : {}),
  }));
}

/**
 * continue_final_message: the rendered conversation cut right after the last message's content (what the template
 * wrote after it, an end-of-turn token and the like, goes), so the model goes on writing that message, as
 * Hugging Face's apply_chat_template (and so vLLM) does: found at the last occurrence of the content stripped of
 * leading and trailing whitespace (so a template that trims the content is matched too), and cut after the content's
 * trailing whitespace when the template wrote the content as it is (a prefill "The answer is " ends the prompt
 * with that space), else after the stripped content.
 */
function openFinalMessage(rendered: string, messages: readonly ChatMessage[], format: ContentFormat): string {
  // A template given the list of parts: its last part, as transformers takes it.
  const last = messages.at(-1);
  const content = (format === 'openai' ? last?.contentParts?.at(-1) : undefined) ?? last?.content ?? '';
  const text = content.trim();
  const at = text.length > 0 ? rendered.lastIndexOf(text) : -1;
  if (at >= 0) {
    const untrimmedEnd = at + content.trimStart().length;
    return rendered.slice(0, rendered.slice(at, untrimmedEnd) === content ? untrimmedEnd : at + text.length);
  }
  throw new InvalidValueError('continue_final_message',
    'the final message\'s content does not appear in the rendered chat (an empty message, or one the template rewrites), so it cannot be continued.');
}

/**
 * The salt a request's prompt blocks are hashed with: its tenant's (name or cache group) and, within it, the
 * request's own cache_salt. A request's salt narrows sharing inside its tenant and never reaches another tenant's.
 * The two go in as a SHA-256 digest: the salt is hashed into every block of the prompt and crosses the request plane
 * to worker processes, which take at most 1024 characters of it, so a salt as long as the client likes (or a long
 * tenant or group name) would cost its length per block and fail on a cluster what one process serves.
 */
function cacheSaltOf(tenantSalt: string | undefined, requestSalt: string | undefined): { cacheSalt?: string } {
  if (tenantSalt === undefined && requestSalt === undefined) return {};
  return { cacheSalt: createHash('sha256').update(JSON.stringify([tenantSalt ?? null, requestSalt ?? null])).digest('hex') };
}

export class Gateway {
  state: GatewayState = 'loading';
  /** The first model served: what a request without "model", /health and the single-model getters refer to. */
  private backend: ModelBackend | undefined;
  /** Every served model by name, the first one included (set by attach / attachModels). */
  private readonly served = new Map<string, ModelBackend>();
  /** Adapter names a load_lora_adapter is loading: a name stands for one adapter of one model, even before it is in. */
  private readonly loadingAdapterNames = new Set<string>();
  /** Compiles guided requests' grammars once without a vocabulary, so a bad one is a 400 before any work. */
  private readonly guidedChecker = new GuidedChecker();
  /** Per vocabulary: its special tokens' texts, and the pattern of those a tool-call parser does not read. */
  private readonly toolSyntaxIds = new WeakMap<Tokenizer, Map<ToolCallParserName, readonly number[]>>();
  private readonly activeRuns = new Set<GenerationRun>();
  private readonly idleWaiters: (() => void)[] = [];
  /** Sequences (prompts x n) of the runs in flight: what the pending bound counts. */
  private pendingSequences = 0;
  /** Ends the grace period of drains under way. */
  private readonly graceCutters: (() => void)[] = [];
  private readonly startedAtSeconds = unixSeconds();
  /** One prompt encoder per served model (each has its own tokenizer). */
  private readonly encoders = new Map<ModelBackend, PromptEncoder>();
  private primaryName: string | undefined;
  /**
   * Read while no model is attached: /health gives its reason and workers, and a request's not-ready error its
   * reason, so a server that cannot get a model says why rather than only that it is loading.
   */
  loadingView: (() => LoadingView) | undefined;

  constructor(private readonly options: GatewayOptions) {}

  attach(backend: ModelBackend): void {
    const name = this.options.servedModelName ?? modelIdFromName(backend.engine.info.modelName);
    this.attachModels([{ name, backend }]);
  }

  /**
   * Serves several models, each under its own name, each with its own engine, tokenizer and chat template. The
   * first is the default for a request without "model".
   */
  attachModels(models: readonly ServedModel[]): void {
    if (models.length === 0) throw new RangeError('attachModels needs at least one model');
    const names = new Set<string>();
    for (const { name } of models) {
      if (names.has(name)) throw new RangeError(`two models are served as '${name}'`);
      names.add(name);
    }
    for (const encoder of this.encoders.values()) void encoder.close();
    this.encoders.clear();
    this.served.clear();
    for (const { name, backend } of models) {
      this.served.set(name, backend);
      this.encoders.set(backend, new PromptEncoder(backend.tokenizer, this.options.offThreadChars));
    }
    this.backend = models[0]!.backend;
    this.primaryName = models[0]!.name;
    this.state = 'ready';
  }

  /** Every served model, in the order given (the default first). */
  get servedModels(): ServedModel[] {
    return [...this.served].map(([name, backend]) => ({ name, backend }));
  }

  /** Stops the tokenizer threads (if any were started). */
  async close(): Promise<void> {
    await Promise.all([...this.encoders.values()].map((encoder) => encoder.close()));
  }

  /** Prompts tokenized off the event loop so far. */
  get offThreadTokenizations(): number {
    let count = 0;
    for (const encoder of this.encoders.values()) count += encoder.offThreadCount;
    return count;
  }

  /**
   * Tokenizes for a call: a long text waits for the tokenizer thread in its tenant's turn, and is dropped (or
   * abandoned on the thread) when the client leaves meanwhile.
   */
  private async encode(backend: ModelBackend, text: string, options: EncodeOptions, call: Call): Promise<number[]> {
    try {
      return await this.encoders.get(backend)!.encode(text, options, { signal: call.clientGone, owner: call.tenant.name });
    } catch (err) {
      if (call.clientGone.aborted) throw new ClientClosedRequestError();
      throw err;
    }
  }

  /**
   * The longest text, in UTF-8 bytes, a prompt may be before it is tokenized: 'context', a prompt that must fit the
   * context, which at most maxBytesPerToken bytes per token cannot when longer than (context - 1) x that (undefined
   * for a tokenizer with no such bound: never refuses a prompt that would fit); 'truncate' and 'tokenize', a text
   * tokenized whole without having to fit (truncate_prompt_tokens, /tokenize), WHOLE_TEXT_BYTES_PER_TOKEN (or the
   * longest token, if longer) per token of the context.
   */
  private promptBytesLimit(backend: ModelBackend, bound: PromptBound): { limitBytes: number; perToken: number } | undefined {
    const perToken = backend.tokenizer.maxBytesPerToken?.();
    const { maxModelLen } = backend.engine.info;
    if (bound !== 'context') {
      const whole = Math.max(WHOLE_TEXT_BYTES_PER_TOKEN, perToken ?? 0);
      return { limitBytes: maxModelLen * whole, perToken: whole };
    }
    return perToken === undefined ? undefined : { limitBytes: (maxModelLen - 1) * perToken, perToken };
  }

  /** Refuses, before tokenizing it, a text longer than its bound (promptBytesLimit) allows. */
  private checkPromptBytes(backend: ModelBackend, text: string, param: string, bound: PromptBound): void {
    this.checkBytes(backend, text.length, () => Buffer.byteLength(text, 'utf8'), param, bound, 'the prompt is');
  }

  /**
   * Refuses, before the chat template renders them, messages whose contents alone are longer than the rendered
   * prompt may be: a template that keeps each message's content (trimmed or not) renders at least those bytes. Content
   * sent as parts counts each part trimmed, without the separators: a template that loops over the parts may trim
   * each and join them with nothing.
   */
  private checkContentBytes(backend: ModelBackend, messages: readonly ChatMessage[], bound: PromptBound): void {
    let units = 0;
    for (const message of messages) units += message.content?.length ?? 0;
    const bytes = (): number => {
      let total = 0;
      for (const message of messages) {
        for (const text of message.contentParts ?? [message.content ?? '']) total += Buffer.byteLength(text.trim(), 'utf8');
      }
      return total;
    };
    this.checkBytes(backend, units, bytes, 'messages', bound, 'the messages\' contents are');
  }

  private checkBytes(backend: ModelBackend, units: number, bytesOf: () => number, param: string, bound: PromptBound,
    what: string): void {
    const limit = this.promptBytesLimit(backend, bound);
    if (limit === undefined) return;
    // A UTF-16 unit is at most 3 bytes of UTF-8: most prompts are cleared without counting their bytes.
    if (units * 3 <= limit.limitBytes) return;
    const bytes = bytesOf();
    if (bytes <= limit.limitBytes) return;
    const { maxModelLen } = backend.engine.info;
    if (bound === 'context') throw new PromptTooLongError(maxModelLen, bytes, limit.perToken, param, what);
    throw new PromptTooLargeError(bytes, limit.limitBytes, limit.perToken, maxModelLen, param, bound, what);
  }

  get engine(): Engine | undefined {
    return this.backend?.engine;
  }

  /** The worker name of an engine that is not routed. */
  get workerId(): string {
    return this.backend?.workerId ?? DEFAULT_WORKER_ID;
  }

  /**
   * The id clients send as "model": --served-model-name as given, else the model's own name made an id (no spaces:
   * "Llama 3.1 8B" is served as "Llama-3.1-8B"; the name itself stays in /v1/models' root and the banner).
   */
  get servedModelName(): string | undefined {
    if (this.primaryName !== undefined) return this.primaryName;
    if (this.options.servedModelName !== undefined) return this.options.servedModelName;
    const name = this.backend?.engine.info.modelName;
    return name === undefined ? undefined : modelIdFromName(name);
  }

  /** The model's own name, for people (it may have spaces). */
  get modelDisplayName(): string | undefined {
    return this.backend?.engine.info.modelName;
  }

  private now(): number {
    return this.options.now();
  }

  get activeRunCount(): number {
    return this.activeRuns.size;
  }

  private ready(): ModelBackend {
    if (this.state === 'draining' || this.state === 'stopped') throw new ShuttingDownError();
    if (!this.backend) {
      const reason = this.loadingView?.().reason;
      throw new NotReadyError(reason === undefined ? 'still loading its model' : `without a model (${reason})`);
    }
    return this.backend;
  }

  private validationContext(backend: ModelBackend): ValidationContext {
    return {
      vocabSize: Math.min(backend.engine.info.vocabSize, backend.tokenizer.vocabSize),
      ...(backend.generationDefaults !== undefined ? { samplingDefaults: backend.generationDefaults } : {}),
    };
  }

  /** The served model a request names ("model"; none = the default one); an unknown name is a 404 naming those served. */
  resolveModel(model: string | undefined): ModelTarget {
    this.ready();
    const target = this.servedTarget(model);
    if (!target) throw new ModelNotFoundError(model!, this.servedNames());
    return target;
  }

  /** The served model or adapter a name stands for (none = the default model); undefined for a name not served. */
  private servedTarget(model: string | undefined): ModelTarget | undefined {
    if (model === undefined) return this.backend ? { name: this.servedModelName!, backend: this.backend } : undefined;
    const backend = this.served.get(model);
    if (backend) return { name: model, backend };
    for (const [baseName, candidate] of this.served) {
      if (candidate.adapters?.has(model)) return { name: model, backend: candidate, adapter: model, baseName };
    }
    return undefined;
  }

  /**
   * The model a request's metrics and trace are labelled with: the base model's served name (with the adapter when it
   * named one). A name that is not served is labelled with the default model's: a metric label must not take
   * whatever clients send.
   */
  private modelFields(target: ModelTarget | undefined): { model: string; adapter?: string } {
    if (!target) return { model: this.servedModelName! };
    return { model: target.baseName ?? target.name, ...(target.adapter !== undefined ? { adapter: target.adapter } : {}) };
  }

  /** Every name a request may use: the models, then their adapters. */
  private servedNames(): string[] {
    return [...this.served].flatMap(([name, backend]) => [name, ...(backend.adapters?.list().map((a) => a.name) ?? [])]);
  }

  // ---- LoRA adapters (vLLM's runtime API) ----

  /** POST /v1/load_lora_adapter {lora_name, lora_path[, base_model_name]}: registers and loads an adapter. */
  async loadLoraAdapter(body: unknown): Promise<string> {
    this.ready();
    const fields = loraBody(body, true);
    const baseName = fields.baseModelName ?? this.servedModelName!;
    const backend = this.served.get(baseName);
    if (!backend) throw new LoraAdapterError(404, 'model_not_found', `base_model_name '${baseName}' is not served (${[...this.served.keys()].join(', ')})`, 'base_model_name');
    if (!backend.adapters) throw new LoraAdapterError(400, 'lora_not_supported', `'${baseName}' runs no LoRA adapters`, 'base_model_name');
    if (this.served.has(fields.name) || this.loadingAdapterNames.has(fields.name)
      || [...this.served.values()].some((b) => b.adapters?.has(fields.name))) {
      throw new LoraAdapterError(400, 'lora_name_taken', `The lora adapter '${fields.name}' has already been loaded (or names a served model)`);
    }
    // Each model's adapters are its own LoraManager's: only here can two loads of a name for two models meet.
    this.loadingAdapterNames.add(fields.name);
    try {
      await backend.adapters.register(fields.name, fields.path!);
    } catch (error) {
      throw loraApiError(error, 'lora_path');
    } finally {
      this.loadingAdapterNames.delete(fields.name);
    }
    return `Success: LoRA adapter '${fields.name}' added successfully.`;
  }

  /**
   * POST /v1/unload_lora_adapter {lora_name}: removes an adapter. Requests already running with it finish with it
   * (it is unloaded from the workers after the last one); requests naming it from now on get 404.
   */
  async unloadLoraAdapter(body: unknown): Promise<string> {
    this.ready();
    const { name } = loraBody(body, false);
    const backend = [...this.served.values()].find((b) => b.adapters?.has(name));
    if (!backend) throw new LoraAdapterError(404, 'lora_not_found', `The lora adapter '${name}' cannot be found`);
    let inFlight: number;
    try {
      ({ inFlight } = await backend.adapters!.unregister(name));
    } catch (error) {
      throw loraApiError(error, 'lora_name');
    }
    return `Success: LoRA adapter '${name}' removed successfully.`
      + (inFlight > 0 ? ` Its ${inFlight} request(s) in flight finish with it; it is unloaded after them.` : '');
  }

  // ---- prompts ----

  /** The conversation rendered by the chat template and tokenized; refused first when longer than `bound` allows. */
  private async renderChat(call: Call, target: ModelTarget, messages: readonly ChatMessage[],
    rendering: { addGenerationPrompt: boolean; continueFinalMessage: boolean; addSpecialTokens: boolean },
    templateKwargs: JsonObject | undefined, bound: PromptBound, tools?: readonly unknown[]): Promise<number[]> {
    const { addGenerationPrompt } = rendering;
    const { backend } = target;
    if (!backend.chatTemplate) throw new NoChatTemplateError(target.name);
    // Rendering thousands of messages takes the event loop for seconds: contents too long already are refused first.
    this.checkContentBytes(backend, messages, bound);
    let text: string;
    const options: RenderOptions = { addGenerationPrompt, ...(templateKwargs ? { variables: templateKwargs } : {}), ...(tools ? { tools } : {}) };
    try {
      const shaped = this.toolCallParser(backend) === 'mistral' ? mistralToolCallIds(messages) : messages;
      text = backend.chatTemplate.render(templateMessages(shaped), options);
    } catch (err) {
      // The template refusing these messages is the client's 400; a template that cannot render at all is ours.
      if (err instanceof ChatTemplateError && err.status === 400) throw new TemplateRefusedMessagesError(err.message);
      if (err instanceof ChatTemplateError) throw new BrokenChatTemplateError(err.message);
      throw err;
    }
    if (rendering.continueFinalMessage) text = openFinalMessage(text, messages, backend.chatTemplate.contentFormat?.(options) ?? 'string');
    // Templates write their own special tokens (often BOS too): parse them. The tokenizer's own are added only when
    // asked (add_special_tokens, default false as in vLLM), and then one BOS is kept when the template wrote one too.
    this.checkPromptBytes(backend, text, 'messages', bound);
    const ids = await this.encode(backend, text, { addSpecialTokens: rendering.addSpecialTokens, parseSpecial: true }, call);
    const bos = backend.tokenizer.bosId;
    return bos !== undefined && ids[0] === bos && ids[1] === bos ? ids.slice(1) : ids;
  }

  /**
   * Fixes max_tokens for a prompt from the context left, or refuses a prompt that does not fit, or a min_tokens that
   * max_tokens so fixed cannot hold (as vLLM's sampling parameters refuse it, whether max_tokens was given or not).
   */
  private fitPrompt(backend: ModelBackend, tokenIds: number[], request: Pick<GenerationOptions, 'maxTokens' | 'minTokens'>,
    param: string, text?: string): PreparedPrompt {
    const requestedMaxTokens = request.maxTokens;
    const { maxModelLen, kvCapacityTokens } = backend.engine.info;
    if (tokenIds.length === 0) throw new InvalidValueError(param, 'the prompt is empty after tokenization.');
    if (tokenIds.length >= maxModelLen) throw new ContextLengthError(maxModelLen, tokenIds.length, undefined, param);
    if (requestedMaxTokens !== undefined && tokenIds.length + requestedMaxTokens > maxModelLen) {
      throw new ContextLengthError(maxModelLen, tokenIds.length, requestedMaxTokens);
    }
    // The prompt's tokens need KV slots; the last sampled token is never computed, so a prompt may fill the pool.
    if (tokenIds.length > kvCapacityTokens) throw new KvCapacityError(tokenIds.length, kvCapacityTokens);
    // generation_config.json's max_new_tokens caps every request's, as vLLM's does.
    const cap = backend.generationDefaults?.maxTokens ?? Infinity;
    const maxTokens = Math.min(requestedMaxTokens ?? maxModelLen - tokenIds.length, cap);
    if (request.minTokens > maxTokens) {
      const why = maxTokens === cap && (requestedMaxTokens === undefined || requestedMaxTokens > cap)
        ? "the model's generation_config.json caps max_tokens" : `the context left after the prompt's ${tokenIds.length} tokens`;
      throw new InvalidValueError('min_tokens', `${request.minTokens} is larger than max_tokens (${maxTokens}: ${why}).`);
    }
    return { tokenIds, maxTokens, ...(text !== undefined ? { text } : {}) };
  }

  /** Most sequences one request may ask for: the per-request cap, and never more than the pending bound holds. */
  get sequenceLimit(): number {
    return Math.min(this.options.maxSequencesPerRequest ?? DEFAULT_MAX_SEQUENCES_PER_REQUEST, this.options.maxPendingRequests);
  }

  /** Parses and checks a generation request, telling the request's trace how validation went. */
  private validated<T extends GenerationOptions>(call: Call, body: unknown, parse: () => T, promptCount: (request: T) => number): { request: T; target: ModelTarget } {
    let request: T;
    let target: ModelTarget | undefined;
    let prompts: number;
    try {
      request = parse();
      target = this.resolveModel(request.model);
      // Before any prompt is tokenized: the cap is on what the request asks for, whatever its prompts hold.
      prompts = promptCount(request);
      if (prompts * request.n > this.sequenceLimit) throw new TooManySequencesError(prompts, request.n, this.sequenceLimit);
      // Before anything is reserved or tokenized: a refused field costs the tenant nothing.
      checkSchedulingFields(request, this.options.schedulingPolicy);
    } catch (err) {
      // Counted under the model the request named when that one is served, even when its body did not parse.
      const named = typeof body === 'object' && body !== null ? (body as { model?: unknown }).model : undefined;
      call.trace?.validated({ ok: false, ...this.modelFields(target ?? (typeof named === 'string' || named === undefined ? this.servedTarget(named) : undefined)) });
      throw err;
    }
    if (request.ignoredFields && request.ignoredFields.length > 0) call.ignoredFields = request.ignoredFields;
    call.trace?.validated({
      ok: true, ...this.modelFields(target), stream: request.stream, temperature: request.temperature, n: request.n,
      ...(request.maxTokens !== undefined ? { maxTokens: request.maxTokens } : {}),
      ...(prompts > 1 ? { prompts } : {}),
    });
    return { request, target };
  }

  // ---- endpoints ----

  async chatCompletions(call: Call, body: unknown): Promise<void> {
    this.ready();
    const { request, target } = this.validated(call, body,
      () => parseChatCompletionRequest(body, this.validationContext(this.backendFor(body))), () => 1);
    const { backend } = target;
    if (request.guided) await this.guidedChecker.check(request.guided);
    const { tools } = request;
    // A prompt to be truncated may be longer than the context: its length is checked after (its bytes, before).
    const bound: PromptBound = request.truncatePromptTokens === undefined ? 'context' : 'truncate';
    const tokenIds = truncatedPrompt(await this.renderChat(call, target, request.messages, request, request.chatTemplateKwargs, bound,
      tools?.raw), request.truncatePromptTokens, backend.engine.info.maxModelLen, request.maxTokens);
    // Told before the length checks, so a refused prompt's log line and trace still say how long it was.
    call.trace?.tokenized(tokenIds.length);
    const prompt = this.fitPrompt(backend, tokenIds, request, 'messages');
    const id = call.requestId ?? newCompletionId('chatcmpl');
    const meta = this.meta(target, responseId('chatcmpl', call, request, id));
    const topLogprobs = request.logprobs ? request.topLogprobs : null;
    let shape: ResponseShape = tools && tools.choice.kind !== 'none'
      ? this.toolShape(backend, request, meta, topLogprobs)
      : new ChatShape(meta, request.n, this.logprobTexts(backend, request), topLogprobs);
    if (request.promptLogprobs !== undefined) {
      shape = new PromptLogprobsShape(shape, new TokenTexts(backend.tokenizer), request.promptLogprobs, 'response');
    }
    if (request.returnTokenIds) shape = new TokenIdsShape(shape, request.n, () => prompt.tokenIds, 'response');
    await this.run(call, target, id, [prompt], request, topLogprobs, shape, request.promptLogprobs);
  }

  /**
   * OpenAI's Responses API: the request is run as the chat completion it translates to (schemas/responses.ts), its
   * answer shaped as a response object or its typed events. Errors name the Responses request's fields.
   */
  async responses(call: Call, body: unknown): Promise<void> {
    this.ready();
    const { request: parsed, target } = this.validated(call, body, () => {
      const responses = parseResponsesRequest(body, this.validationContext(this.backendFor(body)));
      return Object.assign(responses.chat, { responsesEcho: responses.echo, messageParam: responses.messageParam });
    }, () => 1);
    const { responsesEcho: echo, messageParam, ...request } = parsed;
    const { backend } = target;
    try {
      if (request.guided) await this.guidedChecker.check(request.guided);
      const { tools } = request;
      // Under tool_choice "none" the tools are not shown to the model, as vLLM's Responses API leaves them out (a chat
      // completion shows them, as vLLM's does): offered tools the model may not call only invite calls written as text.
      const offered = tools && tools.choice.kind !== 'none' ? tools.raw : undefined;
      const tokenIds = await this.renderChat(call, target, request.messages, request, request.chatTemplateKwargs, 'context', offered);
      call.trace?.tokenized(tokenIds.length);
      const prompt = this.fitPrompt(backend, tokenIds, request, 'input');
      const id = call.requestId ?? newCompletionId('resp');
      // vLLM's request_id is the response's id as given (its default is a resp_ id of its own); the output items are
      // named after the server's id, so that two responses given one request_id never share an item id.
      const meta = this.meta(target, request.requestId ?? id);
      const shape = new ResponsesShape(meta, echo,
        tools && tools.choice.kind !== 'none' ? this.toolShape(backend, request, meta, null) : undefined, id);
      await this.run(call, target, id, [prompt], request, null, shape);
    } catch (error) {
      throw responsesError(error, messageParam);
    }
  }

  /** The chat answer of a request with tools (not tool_choice none): text and the tool calls read from it. */
  private toolShape(backend: ModelBackend, request: ChatCompletionRequest, meta: ChatResponseMeta, topLogprobs: number | null): ToolChatShape {
    const tools = request.tools!;
    const parser = this.toolCallParser(backend);
    // A format's markers (Hermes' <tool_call>, Llama's <|python_tag|>, Mistral's [TOOL_CALLS]) are special tokens in
    // many vocabularies, and the parser must see them: those tokens keep their text even when the request skips
    // special tokens (vLLM's parsers turn skip_special_tokens off altogether, which lets every other special token
    // into the content). Chosen by token id, not by text, so a stop string or ordinary text that spells a special
    // token's text is left as it is.
    if (tools.choice.kind === 'auto' && request.skipSpecialTokens) {
      request.keptSpecialTokenIds = this.toolSyntaxTokenIds(backend.tokenizer, parser);
    }
    return new ToolChatShape(meta, request.n, this.logprobTexts(backend, request), topLogprobs, tools, parser);
  }

  /** The format a model's tool calls are read in (and its template written for): the server's, or its template's. */
  private toolCallParser(backend: ModelBackend): ToolCallParserName {
    return this.options.toolCallParser ?? detectToolCallParser(backend.chatTemplate?.sourceText ?? '');
  }

  /** The special tokens of a vocabulary that spell a tool-call format's markers (computed once per vocabulary). */
  private toolSyntaxTokenIds(tokenizer: Tokenizer, parser: ToolCallParserName): readonly number[] {
    let byParser = this.toolSyntaxIds.get(tokenizer);
    if (!byParser) this.toolSyntaxIds.set(tokenizer, byParser = new Map());
    let ids = byParser.get(parser);
    if (!ids) {
      const syntax = new Set(toolSyntaxTexts(parser));
      const utf8 = new TextDecoder();
      const found: number[] = [];
      for (let id = 0; id < tokenizer.vocabSize; id++) {
        if (tokenizer.isSpecial(id) && syntax.has(utf8.decode(tokenizer.tokenBytes(id, true)))) found.push(id);
      }
      byParser.set(parser, ids = found);
    }
    return ids;
  }

  async completions(call: Call, body: unknown): Promise<void> {
    this.ready();
    const { request, target } = this.validated(call, body,
      () => parseCompletionRequest(body, this.validationContext(this.backendFor(body))), (r) => r.prompts.length);
    const { backend } = target;
    if (request.guided) await this.guidedChecker.check(request.guided);
    const { tokenizer } = backend;
    const param = (i: number): string => request.prompts.length === 1 ? 'prompt' : `prompt[${i}]`;
    // Every prompt's length is checked before any is tokenized: a batch with one hopeless prompt costs nothing. A
    // prompt to be truncated may be longer than the context, up to the bound of a text tokenized whole.
    const bound: PromptBound = request.truncatePromptTokens === undefined ? 'context' : 'truncate';
    request.prompts.forEach((input, i) => { if ('text' in input) this.checkPromptBytes(backend, input.text, param(i), bound); });
    const prompts: PreparedPrompt[] = [];
    let promptTokens = 0;
    try {
      for (const [i, input] of request.prompts.entries()) {
        // A client that left stops the batch: its remaining prompts are not tokenized.
        if (call.clientGone.aborted) throw new ClientClosedRequestError();
        const given = 'text' in input
          ? await this.encode(backend, input.text, { addSpecialTokens: request.addSpecialTokens, parseSpecial: true }, call) : input.tokenIds;
        const ids = truncatedPrompt(given, request.truncatePromptTokens, backend.engine.info.maxModelLen, request.maxTokens);
        promptTokens += ids.length;
        // The prompt as it runs: a truncated one is echoed as what is left of it.
        const text = 'text' in input && ids === given ? input.text
          : request.echo ? tokenizer.decode(ids, { skipSpecialTokens: request.skipSpecialTokens }) : undefined;
        prompts.push(this.fitPrompt(backend, ids, request, param(i), text));
      }
    } finally {
      // Refused or not, the request's log line and trace say how many prompt tokens it brought (up to the refusal).
      call.trace?.tokenized(promptTokens);
    }
    const id = call.requestId ?? newCompletionId('cmpl');
    const perChoice = <T>(value: (prompt: PreparedPrompt) => T): T[] => prompts.flatMap((p) => Array.from({ length: request.n }, () => value(p)));
    const echoTexts = request.echo ? perChoice((p) => p.text ?? '') : [];
    let shape: ResponseShape = new CompletionShape(this.meta(target, responseId('cmpl', call, request, id)), prompts.length * request.n,
      this.logprobTexts(backend, request), request.logprobs, echoTexts, request.echo && request.logprobs !== null ? perChoice((p) => p.tokenIds) : [],
      request.promptOnly);
    if (request.promptLogprobs !== undefined) shape = new PromptLogprobsShape(shape, new TokenTexts(tokenizer), request.promptLogprobs, 'choices');
    if (request.returnTokenIds) {
      // vLLM leaves an echoed prompt's text out when it returns token ids (it skips detokenizing the prompt); here
      // the echo stays: the client asked for it and its text is at hand.
      shape = new TokenIdsShape(shape, prompts.length * request.n, (choice) => prompts[Math.floor(choice / request.n)]!.tokenIds,
        'choices', request.promptOnly);
    }
    await this.run(call, target, id, prompts, request, request.logprobs, shape, completionPromptLogprobs(request));
  }

  /**
   * vLLM's /tokenize: the ids of a prompt, or of a conversation as the chat template renders it, whether or not they
   * fit the context (it is how clients count). Not rate limited (as vLLM's); a text is tokenized only up to the bound
   * of a text tokenized whole, and not after its client left.
   */
  async tokenize(call: Call, body: unknown): Promise<JsonReply> {
    this.ready();
    const request = parseTokenizeRequest(body, this.validationContext(this.backendFor(body)));
    const target = this.resolveModel(request.model);
    const { backend } = target;
    if (request.kind === 'prompt') this.checkPromptBytes(backend, request.prompt, 'prompt', 'tokenize');
    const tokens = request.kind === 'prompt'
      ? await this.encode(backend, request.prompt, { addSpecialTokens: request.addSpecialTokens, parseSpecial: true }, call)
      : await this.renderChat(call, target, request.messages, request, request.chatTemplateKwargs, 'tokenize', request.tools);
    // vLLM's token_strs: each id's vocabulary entry as the tokenizer stores it (SentencePiece's "▁" and byte tokens
    // such as "<0x0A>", byte-level BPE's "Ġ"), what transformers' convert_ids_to_tokens gives.
    const tokenStrs = request.returnTokenStrs ? { token_strs: tokens.map((id) => backend.tokenizer.idToToken(id) ?? '') } : {};
    return { status: 200, body: { tokens, ...tokenStrs, count: tokens.length, max_model_len: backend.engine.info.maxModelLen } };
  }

  detokenize(body: unknown): JsonReply {
    this.ready();
    const named = this.backendFor(body);
    const request = parseDetokenizeRequest(body, this.validationContext(named), named.engine.info.maxModelLen);
    const { backend } = this.resolveModel(request.model);
    // Special tokens kept, as vLLM's (a Hugging Face decode's default): /tokenize of the text, without added special
    // tokens, gives the ids back.
    return { status: 200, body: { prompt: backend.tokenizer.decode(request.tokens, { skipSpecialTokens: false }) } };
  }

  /**
   * vLLM's /tokenizer_info for the default model: the tokenizer's class, its special tokens as text, whether prompts
   * get BOS, the context length and the chat template's source. lm-evaluation-harness's remote tokenizer reads
   * eos_token (and bos_token, chat_template) here, then tokenizes through /tokenize and /detokenize.
   */
  tokenizerInfo(): JsonReply {
    this.ready();
    const { tokenizer, chatTemplate, engine } = this.backend!;
    const tokenText = (id: number | undefined): string | null => (id === undefined ? null : tokenizer.idToToken(id) ?? null);
    const probe = tokenizer.encode('a', { addSpecialTokens: true });
    return {
      status: 200,
      body: {
        tokenizer_class: tokenizer.constructor.name,
        bos_token: tokenText(tokenizer.bosId),
        eos_token: tokenText(tokenizer.eosId),
        add_bos_token: tokenizer.bosId !== undefined && probe[0] === tokenizer.bosId,
        vocab_size: tokenizer.vocabSize,
        model_max_length: engine.info.maxModelLen,
        ...(chatTemplate?.sourceText !== undefined ? { chat_template: chatTemplate.sourceText } : {}),
      },
    };
  }

  models(): JsonReply {
    this.ready();
    const cards = this.servedModels.flatMap(({ name, backend }) => [
      this.modelCard({ name, backend }),
      ...(backend.adapters?.list() ?? []).map((adapter) => this.modelCard({ name: adapter.name, backend, adapter: adapter.name, baseName: name })),
    ]);
    return { status: 200, body: { object: 'list', data: cards } };
  }

  model(name: string): JsonReply {
    this.ready();
    const target = this.resolveModel(name);
    return { status: 200, body: this.modelCard(target) };
  }

  /**
   * The backend whose vocabulary a request's token ids are checked against, and whose sampling defaults it takes,
   * while it is parsed: the model its "model" field names (or the base model of the adapter it names) when that is
   * served, else the default one (an unknown name is refused right after).
   */
  private backendFor(body: unknown): ModelBackend {
    const model = typeof body === 'object' && body !== null ? (body as { model?: unknown }).model : undefined;
    return (typeof model === 'string' ? this.servedTarget(model)?.backend : undefined) ?? this.backend!;
  }

  health(): JsonReply {
    const backend = this.backend;
    // An engine over workers that can all be lost says whether any can serve (the runtime's worker groups). Every
    // served model must: a request for one that cannot would be refused, so the server is not ready (as vLLM's is not
    // when any of its engines is down). With several, the reason names the model.
    const readiness = (engine: unknown) => (engine as Partial<{ readiness(): { ready: boolean; reason?: string } }> | undefined)?.readiness?.();
    const models = this.servedModels;
    const unready = models.map((model) => ({ name: model.name, capacity: readiness(model.backend.engine) }))
      .find(({ capacity }) => capacity?.ready === false);
    const capacity = unready === undefined ? readiness(backend?.engine)
      : { ready: false, reason: models.length > 1 ? `${unready.name}: ${unready.capacity!.reason ?? 'no worker can serve'}` : unready.capacity!.reason };
    const ready = this.state === 'ready' && backend !== undefined && capacity?.ready !== false;
    const info = backend?.engine.info;
    const stats = backend?.engine.stats();
    const loading = backend === undefined && this.state === 'loading' ? this.loadingView?.() : undefined;
    const workers = (backend?.engine as Partial<{ workerList(): object[] }> | undefined)?.workerList?.() ?? loading?.workers;
    return {
      status: ready ? 200 : 503,
      body: {
        status: this.state === 'ready' && capacity?.ready === false ? 'unavailable' : this.state,
        ready,
        ...(capacity?.ready === false ? { reason: capacity.reason ?? 'no worker can serve' } : {}),
        ...(loading?.reason !== undefined ? { reason: loading.reason } : {}),
        model: this.servedModelName ?? null,
        ...(info ? {
          max_model_len: info.maxModelLen,
          kv_capacity_tokens: info.kvCapacityTokens,
          ...(info.kvDtype !== undefined ? { kv_cache_dtype: info.kvDtype } : {}),
          backend: info.backend,
          kernel_variants: info.kernelVariants,
          threads: info.threads,
        } : {}),
        ...(stats ? { running: stats.numRunning, waiting: stats.numWaiting } : {}),
        // An engine over worker processes (conduit frontend, serve --worker-processes) lists the workers it knows; a
        // frontend lists those it has found before any joined too (loadingView).
        ...(workers ? { workers } : {}),
      },
    };
  }

  // ---- running ----

  /** How a request's logprobs name tokens: their text, or "token_id:<id>" (the request's choice, else the server's). */
  private logprobTexts(backend: ModelBackend, request: GenerationOptions): TokenTexts {
    return new TokenTexts(backend.tokenizer, { asTokenIds: request.returnTokensAsTokenIds ?? this.options.returnTokensAsTokenIds ?? false });
  }

  private meta(target: ModelTarget, id: string): ChatResponseMeta {
    return { id, created: unixSeconds(), model: target.name, systemFingerprint: `conduit-${target.backend.engine.info.backend}` };
  }

  private modelCard({ name, backend, adapter, baseName }: ModelTarget): object {
    // An adapter's card is vLLM's: root is the adapter's path, parent the base model it runs on.
    const path = adapter !== undefined ? backend.adapters?.list().find((a) => a.name === adapter)?.path : undefined;
    return {
      id: name,
      object: 'model',
      created: this.startedAtSeconds,
      owned_by: 'conduit',
      root: path ?? backend.engine.info.modelName,
      parent: adapter !== undefined ? baseName ?? null : null,
      max_model_len: backend.engine.info.maxModelLen,
    };
  }

  private async run(call: Call, target: ModelTarget, id: string, prompts: PreparedPrompt[],
    request: GenerationOptions, logprobs: number | null, shape: ResponseShape, promptLogprobs?: number): Promise<void> {
    const { backend } = target;
    // With telemetry the engine joins the request's own trace (its root span as parent); without, the client's.
    const traceparent = call.trace ? call.trace.context() : call.traceparent;
    // The response names the trace context the request ran under (W3C Trace Context's response header), with the
    // client's tracestate passed on beside it.
    if (traceparent) {
      call.headers.traceparent = traceparent;
      if (call.tracestate !== undefined) call.headers.tracestate = call.tracestate;
    }
    const run = new GenerationRun(backend.engine, id, prompts, request.n, {
      priority: request.priority,
      arrivalMs: call.arrivalMs,
      ...(request.deadlineMs !== undefined ? { deadlineMs: call.arrivalMs + request.deadlineMs } : {}),
      tenant: call.tenant.name,
      ...cacheSaltOf(call.tenant.cacheSalt, request.cacheSalt),
      ...(traceparent ? { traceparent } : {}),
      ...(call.sessionId !== undefined ? { sessionId: call.sessionId } : {}),
    }, (prompt) => toSamplingParams(request, prompt.maxTokens, logprobs, promptLogprobs,
      secondaryEosTokenIds(backend.tokenizer, backend.generationDefaults?.eosTokenIds)));
    if ((request as { promptOnly?: boolean }).promptOnly === true) run.outputHidden = true;
    const trace = call.trace;
    if (trace) {
      trace.attachRun(run, backend.engine.info.blockSize, backend.workerId ?? DEFAULT_WORKER_ID,
        this.servedModels.length > 1 ? target.baseName ?? target.name : undefined);
      run.onOutput = (output) => trace.output(output);
    }
    const timings = trace ? (pendingWriteTokens?: number) => trace.timings(pendingWriteTokens) : undefined;

    // A client that left while its prompt was being prepared gets nothing started on its behalf.
    if (call.clientGone.aborted) throw new ClientClosedRequestError();
    const admission = this.admit(call, run, request.maxTokens === undefined);
    call.headers['x-request-id'] = call.clientRequestId ?? id;
    this.activeRuns.add(run);
    this.pendingSequences += run.sequences;
    this.options.metrics.requestStarted(call.tenant.name);
    const onGone = (): void => run.abort();
    call.clientGone.addEventListener('abort', onGone);
    const timer = this.options.requestTimeoutMs === undefined ? undefined
      : setTimeout(() => run.abort(new RequestTimeoutError(this.options.requestTimeoutMs! / 1000)), this.options.requestTimeoutMs);
    let refused = false;
    // An adapter is made resident (loaded, or kept from eviction) for as long as the run lasts. When every resident
    // adapter is busy the run waits here for a slot (runtime/lora-manager.ts), as a pending request that holds
    // nothing of the engine's: requests behind it for the base model or a resident adapter go on meanwhile.
    let loraKey: string | undefined;
    let started = false;
    try {
      if (target.adapter !== undefined) {
        try {
          loraKey = await backend.adapters!.acquire(target.adapter, run.signal);
        } catch (error) {
          if (run.signal.aborted) throw run.abortReason ?? new ClientClosedRequestError();
          // Unloaded while the request waited for it (or was being prepared): the answer a request naming it now gets.
          if ((error as { code?: unknown })?.code === 'lora_not_loaded') throw new ModelNotFoundError(target.adapter, this.servedNames());
          throw loraApiError(error, 'model');
        }
        // Aborted as the adapter became resident: it does not start.
        if (run.signal.aborted) throw run.abortReason ?? new ClientClosedRequestError();
        run.useLora(loraKey);
      }
      started = true;
      if (request.stream) {
        const writer = new SseWriter(call.res, trace ? (bytes, tokens) => trace.wrote(bytes, tokens) : undefined, call.clientGone,
          shape.sseStyle, this.options.writeTimeoutMs);
        await streamRun(run, shape, writer, {
          includeUsage: request.includeUsage, continuousUsage: request.continuousUsage, headers: call.headers,
          ...(backend.tokenizer.eosId !== undefined ? { eosTokenId: backend.tokenizer.eosId } : {}),
          ...(trace ? { timings, onFailure: (error: ApiError) => trace.failedMidStream(error) } : {}),
        });
      } else {
        const body = await collectRun(run, shape, timings, backend.tokenizer.eosId);
        // A client that stops reading the answer is cut off after --write-timeout, as a stream's is.
        if (!call.clientGone.aborted) sendJsonReply(call.res, { status: 200, body }, call.headers, this.options.writeTimeoutMs);
      }
    } catch (err) {
      // Refused by the engine before it produced anything, or ended while it waited for its adapter: the request cost
      // nothing and is not counted.
      refused = !started || (run.completionTokens === 0 && (err instanceof EngineRejectedError || err instanceof OverloadedError || err instanceof NoWorkerAvailableError));
      throw err;
    } finally {
      if (loraKey !== undefined) backend.adapters!.release(loraKey);
      clearTimeout(timer);
      call.clientGone.removeEventListener('abort', onGone);
      this.runEnded(run);
      this.pendingSequences -= run.sequences;
      this.options.metrics.requestEnded(call.tenant.name);
      // The tenant is charged what the engine computed: the prompt tokens it computed or found cached, and every
      // generated token. A request the engine refused, or that ended (the client left, --request-timeout) before it
      // got a step, used nothing: its tokens and the request itself are given back.
      const used = run.computedPromptTokens + run.completionTokens;
      if (refused || used === 0) admission.settle(0, { refundRequest: true });
      else admission.settle(used);
    }
  }

  private admit(call: Call, run: GenerationRun, maxTokensUnset: boolean): Admission {
    const { limiter } = this.options;
    try {
      // The tenant's own limits first: a tenant over its cap hears so (429), not that the server is busy.
      const start = this.now();
      let admission: Admission;
      try {
        admission = limiter.admit(call.tenant, run.reservedTokens, run.sequences, { maxTokensUnset });
        call.trace?.admitted(start);
      } catch (err) {
        call.trace?.admitted(start, err);
        throw err;
      }
      // Sequences, not requests: one request of 64 prompts with n = 128 is 8,192 sequences of engine work.
      if (this.pendingSequences + run.sequences > this.options.maxPendingRequests) {
        admission.settle(0, { refundRequest: true });
        throw new OverloadedError(`${this.pendingSequences} sequences are pending, this request adds ${run.sequences}, `
          + `and the bound is ${this.options.maxPendingRequests}.`);
      }
      return admission;
    } finally {
      Object.assign(call.headers, limiter.headers(call.tenant));
    }
  }

  /**
   * Stops taking requests, lets runs in flight finish for up to `graceMs` (or until endGrace), then aborts the rest
   * with an error that says the grace period ended.
   */
  async drain(graceMs: number): Promise<void> {
    if (this.state === 'ready' || this.state === 'loading') this.state = 'draining';
    let timer: NodeJS.Timeout | undefined;
    let cutShort = false;
    const graceOver = new Promise<void>((resolve) => {
      timer = setTimeout(resolve, graceMs);
      this.graceCutters.push(() => { cutShort = true; resolve(); });
    });
    await Promise.race([this.whenIdle(), graceOver]);
    clearTimeout(timer);
    for (const run of this.activeRuns) run.abort(new GraceEndedError(graceMs, cutShort));
  }

  /** Ends a drain's grace period now (a second stop signal): what still runs is aborted. */
  endGrace(): void {
    for (const cut of this.graceCutters.splice(0)) cut();
  }

  /** Resolves when no run is active. */
  whenIdle(): Promise<void> {
    if (this.activeRuns.size === 0) return Promise.resolve();
    return new Promise((resolve) => this.idleWaiters.push(resolve));
  }

  private runEnded(run: GenerationRun): void {
    this.activeRuns.delete(run);
    if (this.activeRuns.size === 0) for (const resolve of this.idleWaiters.splice(0)) resolve();
  }
}

/** The fields of a load/unload_lora_adapter body (vLLM's names; base_model_name is Conduit's, for several models). */
function loraBody(body: unknown, load: boolean): { name: string; path?: string; baseModelName?: string } {
  if (typeof body !== 'object' || body === null || Array.isArray(body)) throw new WrongTypeError('body', 'an object', body);
  const o = body as Record<string, unknown>;
  const name = o.lora_name;
  if (typeof name !== 'string' || name.trim() === '') throw new LoraAdapterError(400, 'invalid_value', 'lora_name must be a non-empty string');
  if (!load) return { name };
  const path = o.lora_path;
  if (typeof path !== 'string' || path === '') throw new LoraAdapterError(400, 'invalid_value', 'lora_path must be a non-empty string', 'lora_path');
  const base = o.base_model_name;
  if (base !== undefined && typeof base !== 'string') throw new LoraAdapterError(400, 'invalid_value', 'base_model_name must be a string', 'base_model_name');
  return { name, path, ...(base !== undefined ? { baseModelName: base } : {}) };
}

/** A LoRA manager's error as the client's: a bad file 400, unknown 404, in use 409, no room 503. */
function loraApiError(error: unknown, param: string): unknown {
  const named = error as { name?: string; code?: string; message?: string };
  if (named?.name === 'LoraCapacityError') return new LoraCapacityExceededError(named.message!);
  if (named?.name !== 'LoraLoadError') return error;
  switch (named.code) {
    case 'lora_not_loaded': return new LoraAdapterError(404, 'lora_not_found', named.message!);
    case 'lora_in_use': return new LoraAdapterError(409, 'lora_in_use', named.message!);
    default: return new LoraAdapterError(400, 'invalid_lora_adapter', named.message!, param);
  }
}

/**
 * Answers with a JSON body. stallTimeoutMs (--write-timeout): how long a write may wait for a client that stopped
 * reading before the connection is closed, as SseWriter does for a stream; 0 or undefined waits for ever.
 */
export function sendJsonReply(res: ServerResponse, reply: JsonReply, headers: Record<string, string> = {},
  stallTimeoutMs?: number): void {
  const payload = Buffer.from(JSON.stringify(reply.body), 'utf8');
  res.writeHead(reply.status, {
    ...headers,
    'Content-Type': 'application/json',
    'Content-Length': payload.length,
  });
  endWithin(res, payload, stallTimeoutMs);
}

/** Pieces a large body is written in, so each wait for the client to read is bounded on its own. */
const REPLY_PIECE_BYTES = 64 * 1024;

/**
 * Writes `payload` and ends the response, closing the connection when the client leaves a write waiting longer
 * than stallTimeoutMs: a client that never reads a large answer would otherwise hold its connection, and the
 * answer in memory, for ever. The wait is per write, not for the whole body: a slow reader that keeps reading is
 * served to the end.
 */
export function endWithin(res: ServerResponse, payload: Buffer | string, stallTimeoutMs: number | undefined): void {
  const body = typeof payload === 'string' ? Buffer.from(payload, 'utf8') : payload;
  if (stallTimeoutMs === undefined || stallTimeoutMs <= 0 || res.destroyed) {
    res.end(body);
    return;
  }
  let offset = 0;
  let timer: NodeJS.Timeout | undefined;
  const cleanUp = (): void => {
    clearTimeout(timer);
    res.off('drain', writeMore);
    res.off('finish', cleanUp);
    res.off('close', cleanUp);
    res.off('socket', waitForReader);
  };
  function waitForReader(): void {
    clearTimeout(timer);
    // A response queued behind another on its connection (pipelining) waits for its turn without a clock.
    if (!res.socket) {
      res.once('socket', waitForReader);
      return;
    }
    timer = setTimeout(() => {
      cleanUp();
      res.destroy();
    }, stallTimeoutMs);
  }
  let ended = false;
  function writeMore(): void {
    clearTimeout(timer);
    while (!ended) {
      const piece = body.subarray(offset, offset + REPLY_PIECE_BYTES);
      offset += piece.length;
      if (offset >= body.length) {
        ended = true;
        res.end(piece);
      } else if (!res.write(piece)) {
        waitForReader();
        return;
      }
    }
    // All written: the response finishes once its last bytes are flushed.
    if (!res.writableFinished) waitForReader();
  }
  res.on('drain', writeMore);
  res.once('finish', cleanUp);
  res.once('close', cleanUp);
  writeMore();
}
