// The gateway proper: turns validated OpenAI requests into engine requests (chat template, tokenizer, context
// checks), admits them (overload bound, tenant limits), runs them, and gives back what they held however they end.
// It knows nothing of routing or sockets beyond the response it writes to; server.ts does HTTP.

import type { ServerResponse } from 'node:http';
import type { Engine } from '../engine/types.ts';
import {
  ChatTemplateError, type ChatMessage as TemplateMessage, type RenderOptions,
} from '../model/chat-template.ts';
import type { EncodeOptions, Tokenizer } from '../model/tokenizer/types.ts';
import type { Tenant } from './auth.ts';
import type { CallTrace } from './call-trace.ts';
import {
  type ApiError, BrokenChatTemplateError, TemplateRefusedMessagesError, ClientClosedRequestError, ContextLengthError, EngineRejectedError, InvalidValueError, KvCapacityError, ModelNotFoundError,
  PromptTooLongError, TooManySequencesError,
  GraceEndedError, NoChatTemplateError, NotReadyError, OverloadedError, RequestTimeoutError, ShuttingDownError,
} from './errors.ts';
import { GenerationRun, type PreparedPrompt } from './generation-run.ts';
import type { GatewayMetrics } from './gateway-metrics.ts';
import { newCompletionId, TokenTexts, unixSeconds, type ChatResponseMeta } from './openai-format.ts';
import type { Admission, TenantRateLimiter } from './rate-limit.ts';
import { collectRun, streamRun } from './respond.ts';
import { ChatShape, CompletionShape, type ResponseShape } from './response-shapes.ts';
import { GuidedChecker } from './guided.ts';
import { detectToolCallParser, ToolChatShape, type ToolCallParserName } from './tool-calls.ts';
import { parseChatCompletionRequest, type ChatMessage } from './schemas/chat.ts';
import { parseCompletionRequest } from './schemas/completion.ts';
import { toSamplingParams, type GenerationOptions, type ValidationContext } from './schemas/generation.ts';
import { parseDetokenizeRequest, parseTokenizeRequest } from './schemas/tokenize.ts';
import { PromptEncoder } from './prompt-encoder.ts';
import { SseWriter } from './sse.ts';
import type { JsonObject } from './validate.ts';

/** The model's chat template (src/model/chat-template.ts's ChatTemplate fits). */
export interface ChatTemplateRenderer {
  render(messages: readonly TemplateMessage[], options: RenderOptions): string;
  /** The template's text, when known: the tool-call format is recognised from it. */
  readonly sourceText?: string;
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
}

export const DEFAULT_WORKER_ID = 'worker-0';

/**
 * Sequences one request may ask for by default: one prompt at OpenAI's largest n (128), and half the default
 * pending bound, so no single request can take the whole server.
 */
export const DEFAULT_MAX_SEQUENCES_PER_REQUEST = 128;

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
  limiter: TenantRateLimiter;
  metrics: GatewayMetrics;
  /** The engine clock (epoch ms), for the stamps of the request's trace. */
  now: () => number;
  /** How tool calls are found in the model's output under tool_choice "auto" (default: from the chat template). */
  toolCallParser?: ToolCallParserName;
}

/** One HTTP request as the gateway sees it. */
export interface Call {
  res: ServerResponse;
  tenant: Tenant;
  arrivalMs: number;
  traceparent?: string;
  /** The conversation id from the session header, for the session routing policy. */
  sessionId?: string;
  /** The id the response will carry (chatcmpl-..., cmpl-...), chosen at arrival so every answer can name it. */
  requestId?: string;
  /** The request's lifecycle events (generation routes). */
  trace?: CallTrace;
  /** Aborted when the client goes away before its response is complete. */
  clientGone: AbortSignal;
  /** Headers that every answer to this call carries, success or error (request id, rate limits). */
  headers: Record<string, string>;
}

export type JsonReply = { status: number; body: object };

/** OpenAI's "developer" role is the newer name of "system"; templates only know the latter. */
function templateMessages(messages: readonly ChatMessage[]): TemplateMessage[] {
  return messages.map((message) => ({ ...message, role: message.role === 'developer' ? 'system' : message.role }));
}

export class Gateway {
  state: GatewayState = 'loading';
  private backend: ModelBackend | undefined;
  /** Compiles guided requests' grammars once without a vocabulary, so a bad one is a 400 before any work. */
  private readonly guidedChecker = new GuidedChecker();
  private readonly activeRuns = new Set<GenerationRun>();
  private readonly idleWaiters: (() => void)[] = [];
  /** Sequences (prompts x n) of the runs in flight: what the pending bound counts. */
  private pendingSequences = 0;
  /** Ends the grace period of drains under way. */
  private readonly graceCutters: (() => void)[] = [];
  private readonly startedAtSeconds = unixSeconds();
  private encoder: PromptEncoder | undefined;

  constructor(private readonly options: GatewayOptions) {}

  attach(backend: ModelBackend): void {
    void this.encoder?.close();
    this.backend = backend;
    this.encoder = new PromptEncoder(backend.tokenizer, this.options.offThreadChars);
    this.state = 'ready';
  }

  /** Stops the tokenizer thread (if one was started). */
  async close(): Promise<void> {
    await this.encoder?.close();
  }

  /** Prompts tokenized off the event loop so far. */
  get offThreadTokenizations(): number {
    return this.encoder?.offThreadCount ?? 0;
  }

  private encode(text: string, options: EncodeOptions): Promise<number[]> {
    return this.encoder!.encode(text, options);
  }

  /**
   * Refuses, before tokenizing it, a text whose UTF-8 length alone shows it cannot fit the context: at most
   * maxBytesPerToken bytes per token, B bytes are at least ceil(B / maxBytesPerToken) tokens. Never refuses a
   * prompt that would fit; a tokenizer with no such bound is not checked here.
   */
  private checkPromptBytes(backend: ModelBackend, text: string, param: string): void {
    const bound = backend.tokenizer.maxBytesPerToken?.();
    if (bound === undefined) return;
    const { maxModelLen } = backend.engine.info;
    const limitBytes = (maxModelLen - 1) * bound;
    // A UTF-16 unit is at most 3 bytes of UTF-8: most prompts are cleared without counting their bytes.
    if (text.length * 3 <= limitBytes) return;
    const bytes = Buffer.byteLength(text, 'utf8');
    if (bytes > limitBytes) throw new PromptTooLongError(maxModelLen, bytes, bound, param);
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
    if (!this.backend) throw new NotReadyError('still loading its model');
    return this.backend;
  }

  private validationContext(backend: ModelBackend): ValidationContext {
    return { vocabSize: Math.min(backend.engine.info.vocabSize, backend.tokenizer.vocabSize) };
  }

  private checkModel(model: string | undefined): void {
    const served = this.servedModelName!;
    if (model !== undefined && model !== served) throw new ModelNotFoundError(model, served);
  }

  // ---- prompts ----

  private async renderChat(backend: ModelBackend, messages: readonly ChatMessage[], addGenerationPrompt: boolean,
    templateKwargs: JsonObject | undefined, checkLength: boolean, tools?: readonly unknown[]): Promise<number[]> {
    if (!backend.chatTemplate) throw new NoChatTemplateError(this.servedModelName!);
    let text: string;
    try {
      text = backend.chatTemplate.render(templateMessages(messages),
        { addGenerationPrompt, ...(templateKwargs ? { variables: templateKwargs } : {}), ...(tools ? { tools } : {}) });
    } catch (err) {
      // The template refusing these messages is the client's 400; a template that cannot render at all is ours.
      if (err instanceof ChatTemplateError && err.status === 400) throw new TemplateRefusedMessagesError(err.message);
      if (err instanceof ChatTemplateError) throw new BrokenChatTemplateError(err.message);
      throw err;
    }
    // Templates write their own special tokens (often BOS too): parse them, and keep one BOS when both the template
    // and the tokenizer put it there.
    if (checkLength) this.checkPromptBytes(backend, text, 'messages');
    const ids = await this.encode(text, { addSpecialTokens: true, parseSpecial: true });
    const bos = backend.tokenizer.bosId;
    return bos !== undefined && ids[0] === bos && ids[1] === bos ? ids.slice(1) : ids;
  }

  /** Fixes max_tokens for a prompt from the context left, or refuses a prompt that does not fit. */
  private fitPrompt(backend: ModelBackend, tokenIds: number[], requestedMaxTokens: number | undefined,
    param: string, text?: string): PreparedPrompt {
    const { maxModelLen, kvCapacityTokens } = backend.engine.info;
    if (tokenIds.length === 0) throw new InvalidValueError(param, 'the prompt is empty after tokenization.');
    if (tokenIds.length >= maxModelLen) throw new ContextLengthError(maxModelLen, tokenIds.length);
    if (requestedMaxTokens !== undefined && tokenIds.length + requestedMaxTokens > maxModelLen) {
      throw new ContextLengthError(maxModelLen, tokenIds.length, requestedMaxTokens);
    }
    if (tokenIds.length + 1 > kvCapacityTokens) throw new KvCapacityError(tokenIds.length + 1, kvCapacityTokens);
    return {
      tokenIds,
      maxTokens: requestedMaxTokens ?? maxModelLen - tokenIds.length,
      ...(text !== undefined ? { text } : {}),
    };
  }

  /** Most sequences one request may ask for: the per-request cap, and never more than the pending bound holds. */
  get sequenceLimit(): number {
    return Math.min(this.options.maxSequencesPerRequest ?? DEFAULT_MAX_SEQUENCES_PER_REQUEST, this.options.maxPendingRequests);
  }

  /** Parses and checks a generation request, telling the request's trace how validation went. */
  private validated<T extends GenerationOptions>(call: Call, parse: () => T, promptCount: (request: T) => number): T {
    let request: T;
    try {
      request = parse();
      this.checkModel(request.model);
      // Before any prompt is tokenized: the cap is on what the request asks for, whatever its prompts hold.
      const prompts = promptCount(request);
      if (prompts * request.n > this.sequenceLimit) throw new TooManySequencesError(prompts, request.n, this.sequenceLimit);
    } catch (err) {
      // The served name, never the one asked for: a metric label must not take whatever clients send.
      call.trace?.validated({ ok: false, model: this.servedModelName! });
      throw err;
    }
    call.trace?.validated({
      ok: true, model: this.servedModelName!, stream: request.stream, temperature: request.temperature, n: request.n,
      ...(request.maxTokens !== undefined ? { maxTokens: request.maxTokens } : {}),
    });
    return request;
  }

  // ---- endpoints ----

  async chatCompletions(call: Call, body: unknown): Promise<void> {
    const backend = this.ready();
    const request = this.validated(call, () => parseChatCompletionRequest(body, this.validationContext(backend)), () => 1);
    if (request.guided) await this.guidedChecker.check(request.guided);
    const { tools } = request;
    const tokenIds = await this.renderChat(backend, request.messages, request.addGenerationPrompt, request.chatTemplateKwargs, true,
      tools?.raw);
    const prompt = this.fitPrompt(backend, tokenIds, request.maxTokens, 'messages');
    call.trace?.tokenized(prompt.tokenIds.length);
    const id = call.requestId ?? newCompletionId('chatcmpl');
    const topLogprobs = request.logprobs ? request.topLogprobs : null;
    let shape: ResponseShape;
    if (tools && tools.choice.kind !== 'none') {
      const parser = this.options.toolCallParser ?? detectToolCallParser(backend.chatTemplate?.sourceText ?? '');
      // Mistral's [TOOL_CALLS] is a control token: the parser needs it in the text.
      if (tools.choice.kind === 'auto' && parser === 'mistral') request.skipSpecialTokens = false;
      shape = new ToolChatShape(this.meta(backend, id), request.n, new TokenTexts(backend.tokenizer), topLogprobs, tools, parser);
    } else {
      shape = new ChatShape(this.meta(backend, id), request.n, new TokenTexts(backend.tokenizer), topLogprobs);
    }
    await this.run(call, backend, id, [prompt], request, topLogprobs, shape);
  }

  async completions(call: Call, body: unknown): Promise<void> {
    const backend = this.ready();
    const request = this.validated(call, () => parseCompletionRequest(body, this.validationContext(backend)),
      (r) => r.prompts.length);
    if (request.guided) await this.guidedChecker.check(request.guided);
    const { tokenizer } = backend;
    const param = (i: number): string => request.prompts.length === 1 ? 'prompt' : `prompt[${i}]`;
    // Every prompt's length is checked before any is tokenized: a batch with one hopeless prompt costs nothing.
    request.prompts.forEach((input, i) => { if ('text' in input) this.checkPromptBytes(backend, input.text, param(i)); });
    const prompts: PreparedPrompt[] = [];
    for (const [i, input] of request.prompts.entries()) {
      if ('text' in input) {
        const ids = await this.encode(input.text, { addSpecialTokens: true, parseSpecial: true });
        prompts.push(this.fitPrompt(backend, ids, request.maxTokens, param(i), input.text));
        continue;
      }
      const text = request.echo ? tokenizer.decode(input.tokenIds, { skipSpecialTokens: request.skipSpecialTokens }) : undefined;
      prompts.push(this.fitPrompt(backend, input.tokenIds, request.maxTokens, param(i), text));
    }
    call.trace?.tokenized(prompts.reduce((sum, p) => sum + p.tokenIds.length, 0));
    const id = call.requestId ?? newCompletionId('cmpl');
    const echoTexts = request.echo ? prompts.flatMap((p) => Array.from({ length: request.n }, () => p.text ?? '')) : [];
    const shape = new CompletionShape(this.meta(backend, id), prompts.length * request.n, new TokenTexts(tokenizer),
      request.logprobs, echoTexts);
    await this.run(call, backend, id, prompts, request, request.logprobs, shape);
  }

  async tokenize(body: unknown): Promise<JsonReply> {
    const backend = this.ready();
    const request = parseTokenizeRequest(body, this.validationContext(backend));
    this.checkModel(request.model);
    const tokens = request.kind === 'prompt'
      ? await this.encode(request.prompt, { addSpecialTokens: request.addSpecialTokens, parseSpecial: true })
      : await this.renderChat(backend, request.messages, request.addGenerationPrompt, request.chatTemplateKwargs, false);
    return { status: 200, body: { tokens, count: tokens.length, max_model_len: backend.engine.info.maxModelLen } };
  }

  detokenize(body: unknown): JsonReply {
    const backend = this.ready();
    const request = parseDetokenizeRequest(body, this.validationContext(backend));
    this.checkModel(request.model);
    return { status: 200, body: { prompt: backend.tokenizer.decode(request.tokens) } };
  }

  models(): JsonReply {
    const backend = this.ready();
    return { status: 200, body: { object: 'list', data: [this.modelCard(backend)] } };
  }

  model(name: string): JsonReply {
    const backend = this.ready();
    this.checkModel(name);
    return { status: 200, body: this.modelCard(backend) };
  }

  health(): JsonReply {
    const backend = this.backend;
    // An engine over workers that can all be lost says whether any can serve (the runtime's worker groups).
    const capacity = (backend?.engine as Partial<{ readiness(): { ready: boolean; reason?: string } }> | undefined)?.readiness?.();
    const ready = this.state === 'ready' && backend !== undefined && capacity?.ready !== false;
    const info = backend?.engine.info;
    const stats = backend?.engine.stats();
    return {
      status: ready ? 200 : 503,
      body: {
        status: this.state === 'ready' && capacity?.ready === false ? 'unavailable' : this.state,
        ready,
        ...(capacity?.ready === false ? { reason: capacity.reason ?? 'no worker can serve' } : {}),
        model: this.servedModelName ?? null,
        ...(info ? {
          max_model_len: info.maxModelLen,
          kv_capacity_tokens: info.kvCapacityTokens,
          backend: info.backend,
          kernel_variants: info.kernelVariants,
          threads: info.threads,
        } : {}),
        ...(stats ? { running: stats.numRunning, waiting: stats.numWaiting } : {}),
      },
    };
  }

  // ---- running ----

  private meta(backend: ModelBackend, id: string): ChatResponseMeta {
    return { id, created: unixSeconds(), model: this.servedModelName!, systemFingerprint: `conduit-${backend.engine.info.backend}` };
  }

  private modelCard(backend: ModelBackend): object {
    return {
      id: this.servedModelName,
      object: 'model',
      created: this.startedAtSeconds,
      owned_by: 'conduit',
      root: backend.engine.info.modelName,
      max_model_len: backend.engine.info.maxModelLen,
    };
  }

  private async run(call: Call, backend: ModelBackend, id: string, prompts: PreparedPrompt[],
    request: GenerationOptions, logprobs: number | null, shape: ResponseShape): Promise<void> {
    // With telemetry the engine joins the request's own trace (its root span as parent); without, the client's.
    const traceparent = call.trace ? call.trace.context() : call.traceparent;
    const run = new GenerationRun(backend.engine, id, prompts, request.n, {
      priority: request.priority,
      arrivalMs: call.arrivalMs,
      ...(request.deadlineMs !== undefined ? { deadlineMs: call.arrivalMs + request.deadlineMs } : {}),
      tenant: call.tenant.name,
      ...(call.tenant.cacheSalt !== undefined ? { cacheSalt: call.tenant.cacheSalt } : {}),
      ...(traceparent ? { traceparent } : {}),
      ...(call.sessionId !== undefined ? { sessionId: call.sessionId } : {}),
    }, (prompt) => toSamplingParams(request, prompt.maxTokens, logprobs));
    const trace = call.trace;
    if (trace) {
      trace.attachRun(run, backend.engine.info.blockSize, this.workerId);
      run.onOutput = (output) => trace.output(output);
    }
    const timings = trace ? () => trace.timings() : undefined;

    // A client that left while its prompt was being prepared gets nothing started on its behalf.
    if (call.clientGone.aborted) throw new ClientClosedRequestError();
    const admission = this.admit(call, run);
    call.headers['x-request-id'] = id;
    this.activeRuns.add(run);
    this.pendingSequences += run.sequences;
    this.options.metrics.requestStarted(call.tenant.name);
    const onGone = (): void => run.abort();
    call.clientGone.addEventListener('abort', onGone);
    const timer = this.options.requestTimeoutMs === undefined ? undefined
      : setTimeout(() => run.abort(new RequestTimeoutError(this.options.requestTimeoutMs! / 1000)), this.options.requestTimeoutMs);
    let refused = false;
    try {
      if (request.stream) {
        const writer = new SseWriter(call.res, trace ? (bytes, tokens) => trace.wrote(bytes, tokens) : undefined);
        await streamRun(run, shape, writer, {
          includeUsage: request.includeUsage, continuousUsage: request.continuousUsage, headers: call.headers,
          ...(trace ? { timings, onFailure: (error: ApiError) => trace.failedMidStream(error) } : {}),
        });
      } else {
        const body = await collectRun(run, shape, timings);
        if (!call.clientGone.aborted) sendJsonReply(call.res, { status: 200, body }, call.headers);
      }
    } catch (err) {
      // Refused by the engine before it produced anything: the request cost nothing and is not counted.
      refused = run.completionTokens === 0 && (err instanceof EngineRejectedError || err instanceof OverloadedError);
      throw err;
    } finally {
      clearTimeout(timer);
      call.clientGone.removeEventListener('abort', onGone);
      this.runEnded(run);
      this.pendingSequences -= run.sequences;
      this.options.metrics.requestEnded(call.tenant.name);
      // A request the engine refused used nothing; otherwise the prompt and every generated token count.
      if (refused) admission.settle(0, { refundRequest: true });
      else admission.settle(run.promptTokens + run.completionTokens);
    }
  }

  private admit(call: Call, run: GenerationRun): Admission {
    const { limiter } = this.options;
    try {
      // Sequences, not requests: one request of 64 prompts with n = 128 is 8,192 sequences of engine work.
      if (this.pendingSequences + run.sequences > this.options.maxPendingRequests) {
        throw new OverloadedError(`${this.pendingSequences} sequences are pending, this request adds ${run.sequences}, `
          + `and the bound is ${this.options.maxPendingRequests}.`);
      }
      const start = this.now();
      try {
        const admission = limiter.admit(call.tenant, run.reservedTokens);
        call.trace?.admitted(start);
        return admission;
      } catch (err) {
        call.trace?.admitted(start, err);
        throw err;
      }
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

export function sendJsonReply(res: ServerResponse, reply: JsonReply, headers: Record<string, string> = {}): void {
  const payload = JSON.stringify(reply.body);
  res.writeHead(reply.status, {
    ...headers,
    'Content-Type': 'application/json',
    'Content-Length': Buffer.byteLength(payload),
  });
  res.end(payload);
}
