// Fields shared by /v1/chat/completions and /v1/completions: sampling, stopping, streaming, and vLLM's extras.
// Ranges follow OpenAI where it documents one and vLLM otherwise.

import type { SamplingParams, SchedulingPolicy } from '../../engine/types.ts';
import type { GenerationDefaults } from '../../model/generation-config.ts';
import type { Tokenizer } from '../../model/tokenizer/types.ts';
import { InvalidValueError, UnsupportedFieldError } from '../errors.ts';
import { childPath, Fields, readInteger, readNumber, readString } from '../validate.ts';
import { readGuided, type GuidedRequest } from '../guided.ts';
import { requestIdProblem } from '../client-request-ids.ts';

/** What a request's field checks need to know about the model. */
export interface ValidationContext {
  vocabSize: number;
  /** The served model's defaults for the sampling fields a request leaves out (generation_config.json). */
  samplingDefaults?: GenerationDefaults;
}

export const MAX_N = 128;
export const MAX_LOGPROBS = 20;
export const MAX_STOP_STRINGS = 32;
export const MAX_LOGIT_BIAS_ENTRIES = 1024;

/** The engine's sampling fields that a request sets as they are (the rest are built from the request below). */
type DirectSamplingFields = 'n' | 'temperature' | 'topP' | 'topK' | 'minP' | 'repetitionPenalty' | 'presencePenalty' |
  'frequencyPenalty' | 'seed' | 'minTokens' | 'ignoreEos' | 'includeStopStrInOutput' | 'skipSpecialTokens' | 'keptSpecialTokenIds';

export interface GenerationOptions extends Pick<SamplingParams, DirectSamplingFields> {
  model?: string;
  /**
   * Fields of the body the endpoint does not read, ignored as vLLM ignores them (and, as vLLM does, warned about in
   * the server's log: a misspelt field would otherwise pass unnoticed).
   */
  ignoredFields?: string[];
  stream: boolean;
  /** stream_options.include_usage: a last chunk with empty choices carries usage. */
  includeUsage: boolean;
  /** stream_options.continuous_usage_stats (vLLM): every chunk carries usage so far. */
  continuousUsage: boolean;
  /** Undefined: whatever is left of the context after the prompt. */
  maxTokens?: number;
  logitBias?: Map<number, number>;
  stop: string[];
  stopTokenIds: number[];
  priority: number;
  /** deadline_ms: milliseconds after arrival by which the first token should be out (the deadline policy's key). */
  deadlineMs?: number;
  user?: string;
  /** response_format json_object / json_schema, or vLLM's guided_* fields: the output's grammar. */
  guided?: GuidedRequest;
  /** vLLM's prompt_logprobs: every prompt token's logprob with this many alternatives (not with stream). */
  promptLogprobs?: number;
  /** vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>" (undefined: the server's default). */
  returnTokensAsTokenIds?: boolean;
  /** vLLM's cache_salt: the prompt's cached blocks are shared only with requests giving the same salt. */
  cacheSalt?: string;
  /** vLLM's truncate_prompt_tokens: keep only the prompt's last this many tokens (-1: as many as fit beside max_tokens). */
  truncatePromptTokens?: number;
  /** vLLM's return_token_ids: the response shows the prompt's token ids and each choice's generated ones. */
  returnTokenIds: boolean;
  /**
   * vLLM's request_id: the response's id is the endpoint's prefix and this ("cmpl-<id>", "chatcmpl-<id>"). The
   * server's own id still names the request's trace, its engine requests and x-request-id; the log line and a trace
   * lookup take this one too, as they take an X-Request-Id (server.ts).
   */
  requestId?: string;
}

/**
 * Fields from vLLM and others that name features this server does not have: refused, since a request relying on
 * one would otherwise run without it.
 */
const UNSUPPORTED_EVERYWHERE: Record<string, string> = {
  bad_words: 'bad_words is not supported; use logit_bias for single tokens or stop for strings.',
  allowed_token_ids: 'allowed_token_ids is not supported; use logit_bias or guided_choice.',
  logprob_token_ids: 'logprob_token_ids is not supported; use logprobs with top_logprobs.',
  logits_processors: 'logits_processors is not supported by this server.',
};

/** Fields an endpoint knowingly does not implement, with why; built once per endpoint. */
export function unsupportedFields(table: Record<string, string>): ReadonlyMap<string, string> {
  return new Map(Object.entries({ ...UNSUPPORTED_EVERYWHERE, ...table }));
}

export function rejectUnsupported(fields: Fields, unsupported: ReadonlyMap<string, string>): void {
  // A request has a handful of fields: walking them is cheaper than probing for every unsupported name.
  for (const key in fields.object) {
    const reason = unsupported.get(key);
    if (reason !== undefined && fields.has(key)) throw new UnsupportedFieldError(fields.path(key), reason);
  }
  if (fields.boolean('use_beam_search')) {
    throw new UnsupportedFieldError('use_beam_search', 'beam search is not implemented.');
  }
}

export function readTokenId(param: string, value: unknown, context: ValidationContext): number {
  return readInteger(param, value, { min: 0, max: context.vocabSize - 1 });
}

/** Whether a string holds a UTF-16 surrogate without its pair (JSON's "\ud800" escapes can write one). */
export function hasLoneSurrogate(text: string): boolean {
  for (let i = 0; i < text.length; i++) {
    const unit = text.charCodeAt(i);
    if (unit < 0xd800 || unit > 0xdfff) continue;
    const next = i + 1 < text.length ? text.charCodeAt(i + 1) : 0;
    if (unit <= 0xdbff && next >= 0xdc00 && next <= 0xdfff) {
      i++;
      continue;
    }
    return true;
  }
  return false;
}

function readStop(fields: Fields): string[] {
  const raw = fields.raw('stop');
  if (raw === undefined) return [];
  const stops = typeof raw === 'string' ? [readString('stop', raw, { nonEmpty: true })]
    : fields.array('stop', { maxItems: MAX_STOP_STRINGS })!.map((item, i) => readString(childPath('stop', i), item, { nonEmpty: true }));
  // Output text is decoded from UTF-8, which has no lone surrogates: such a stop string could never match, and the
  // request would run on to max_tokens with a stop that silently does nothing.
  stops.forEach((stop, i) => {
    if (!hasLoneSurrogate(stop)) return;
    const which = typeof raw === 'string' ? 'the stop string' : `stop[${i}]`;
    throw new InvalidValueError('stop', `${which} contains a lone UTF-16 surrogate (half of a surrogate pair); generated `
      + 'text never contains one, so it could never match. Send whole characters.');
  });
  return stops;
}

function readLogitBias(fields: Fields, context: ValidationContext): Map<number, number> | undefined {
  const bias = fields.fields('logit_bias');
  if (!bias) return undefined;
  const entries = Object.entries(bias.object);
  if (entries.length > MAX_LOGIT_BIAS_ENTRIES) {
    throw new InvalidValueError('logit_bias', `${entries.length} entries; the limit is ${MAX_LOGIT_BIAS_ENTRIES}.`);
  }
  const map = new Map<number, number>();
  for (const [key, value] of entries) {
    const param = `logit_bias.${key}`;
    if (!/^\d+$/.test(key)) throw new InvalidValueError(param, `the key "${key}" is not a token id (a non-negative integer).`);
    readTokenId(param, Number(key), context);
    map.set(Number(key), readNumber(param, value, { min: -100, max: 100 }));
  }
  return map;
}

function readMaxTokens(fields: Fields): number | undefined {
  // max_completion_tokens is the newer name; when both are present it wins, as in vLLM.
  const newer = fields.integer('max_completion_tokens', { min: 1 });
  const older = fields.integer('max_tokens', { min: 1 });
  return newer ?? older;
}

function readTopK(fields: Fields): number {
  const topK = fields.integer('top_k') ?? 0;
  if (topK < -1) throw new InvalidValueError('top_k', `${topK} is out of range; use -1 or 0 to disable, or a value >= 1.`);
  return topK === -1 ? 0 : topK;
}

/** As in vLLM, a seed of -1 asks for no seed: each request draws its own, as one without the field does. */
function readSeed(fields: Fields): number | undefined {
  const seed = fields.integer('seed');
  return seed === -1 ? undefined : seed;
}

export function readGenerationOptions(fields: Fields, context: ValidationContext): GenerationOptions {
  const stream = fields.boolean('stream') ?? false;
  const streamOptions = fields.fields('stream_options');
  if (streamOptions && !stream) {
    throw new InvalidValueError('stream_options', 'stream_options is only allowed when stream is true.');
  }
  const n = fields.integer('n', { min: 1, max: MAX_N }) ?? 1;
  const maxTokens = readMaxTokens(fields);
  const minTokens = fields.integer('min_tokens', { min: 0 }) ?? 0;
  if (maxTokens !== undefined && minTokens > maxTokens) {
    throw new InvalidValueError('min_tokens', `${minTokens} is larger than max_tokens (${maxTokens}).`);
  }
  const stopTokenIds = (fields.array('stop_token_ids') ?? [])
    .map((id, i) => readTokenId(childPath('stop_token_ids', i), id, context));
  const defaults = context.samplingDefaults;
  checkSpacesBetweenSpecialTokens(fields);
  return {
    model: fields.string('model'),
    stream,
    includeUsage: streamOptions?.boolean('include_usage') ?? false,
    continuousUsage: streamOptions?.boolean('continuous_usage_stats') ?? false,
    n,
    maxTokens,
    temperature: fields.number('temperature', { min: 0, max: 2 }) ?? defaults?.temperature ?? 1,
    topP: fields.number('top_p', { min: 0, max: 1, minExclusive: true }) ?? defaults?.topP ?? 1,
    topK: fields.has('top_k') ? readTopK(fields) : defaults?.topK ?? 0,
    minP: fields.number('min_p', { min: 0, max: 1 }) ?? defaults?.minP ?? 0,
    // Any positive factor, as vLLM takes (OpenAI has no such field).
    repetitionPenalty: fields.number('repetition_penalty', { min: 0, minExclusive: true }) ?? defaults?.repetitionPenalty ?? 1,
    presencePenalty: fields.number('presence_penalty', { min: -2, max: 2 }) ?? 0,
    frequencyPenalty: fields.number('frequency_penalty', { min: -2, max: 2 }) ?? 0,
    logitBias: readLogitBias(fields, context),
    seed: readSeed(fields),
    stop: readStop(fields),
    stopTokenIds,
    minTokens,
    ignoreEos: fields.boolean('ignore_eos') ?? false,
    includeStopStrInOutput: fields.boolean('include_stop_str_in_output') ?? false,
    skipSpecialTokens: fields.boolean('skip_special_tokens') ?? true,
    priority: fields.integer('priority') ?? 0,
    ...deadlineOption(fields),
    user: fields.string('user'),
    ...guidedOption(fields),
    ...promptLogprobsOption(fields, stream),
    ...(fields.has('return_tokens_as_token_ids') ? { returnTokensAsTokenIds: fields.boolean('return_tokens_as_token_ids')! } : {}),
    ...(fields.has('cache_salt') ? { cacheSalt: fields.string('cache_salt', { nonEmpty: true })! } : {}),
    ...truncateOption(fields),
    returnTokenIds: fields.boolean('return_token_ids') ?? false,
    ...requestIdOption(fields),
  };
}

/**
 * vLLM's request_id, when given (an empty one is as none: the server names the response). Held to the X-Request-Id
 * header's rules (client-request-ids.ts), with the header's message: the server checks it so before this runs.
 */
function requestIdOption(fields: Fields): { requestId?: string } {
  const id = fields.string('request_id');
  if (id === undefined || id === '') return {};
  const problem = requestIdProblem(id);
  if (problem !== undefined) throw new InvalidValueError('request_id', problem);
  return { requestId: id };
}

/**
 * vLLM's spaces_between_special_tokens is taken (a boolean) and changes nothing. In vLLM it decides whether a
 * Python ("slow") tokenizer's decode sets an added token (special tokens kept by skip_special_tokens false, among
 * them) off from the text around it with spaces, which its default (true) does; with a Hugging Face fast tokenizer
 * false only drops a space the tokenizer's decoder would put between two such tokens. Conduit's detokenizer joins
 * each token's own bytes and never adds a space around a special token: its output is vLLM's with false, and with
 * the default on a fast tokenizer save for that case.
 */
function checkSpacesBetweenSpecialTokens(fields: Fields): void {
  fields.boolean('spaces_between_special_tokens');
}

function truncateOption(fields: Fields): { truncatePromptTokens?: number } {
  const keep = fields.integer('truncate_prompt_tokens', { min: -1 });
  if (keep === 0) throw new InvalidValueError('truncate_prompt_tokens', '0 would leave no prompt; use -1 (the context\'s length) or a positive count.');
  return keep !== undefined ? { truncatePromptTokens: keep } : {};
}

/**
 * The prompt's last tokens a request's truncate_prompt_tokens keeps: that many, or with -1 as many as the context
 * holds beside max_tokens (one token when max_tokens is not set), so that the truncated prompt fits.
 */
export function truncatedPrompt(tokenIds: number[], keep: number | undefined, maxModelLen: number, maxTokens: number | undefined): number[] {
  if (keep === undefined) return tokenIds;
  const count = keep === -1 ? Math.max(1, maxModelLen - (maxTokens ?? 1)) : keep;
  return tokenIds.length > count ? tokenIds.slice(tokenIds.length - count) : tokenIds;
}

function promptLogprobsOption(fields: Fields, stream: boolean): { promptLogprobs?: number } {
  if (fields.raw('prompt_logprobs') === -1) {
    throw new InvalidValueError('prompt_logprobs', `-1 (the whole vocabulary) is not supported; ask for at most ${MAX_LOGPROBS} alternatives.`);
  }
  const promptLogprobs = fields.integer('prompt_logprobs', { min: 0, max: MAX_LOGPROBS });
  if (promptLogprobs === undefined) return {};
  // As vLLM: the prompt's logprobs go in the response body, which a stream does not have.
  if (stream) throw new InvalidValueError('prompt_logprobs', 'prompt_logprobs are not available with stream: true.');
  return { promptLogprobs };
}

/**
 * A scheduling field the server's policy never reads is refused rather than ignored, as vLLM refuses a priority
 * without priority scheduling: priority other than 0 under fcfs (the deadline policy breaks ties by priority, so it
 * reads it), deadline_ms under fcfs and priority (only the deadline policy orders by it, and nothing else, no expiry,
 * acts on it). An unknown policy (undefined: a gateway in front of workers it does not configure) refuses nothing.
 */
export function checkSchedulingFields(options: Pick<GenerationOptions, 'priority' | 'deadlineMs'>, policy: SchedulingPolicy | undefined): void {
  if (policy === undefined) return;
  if (options.priority !== 0 && policy === 'fcfs') {
    throw new InvalidValueError('priority', `got priority ${options.priority}, but priority scheduling is not enabled: this `
      + "server's scheduling policy is fcfs (--scheduling-policy), which serves requests in arrival order. Leave priority "
      + 'out (or 0), or serve with --scheduling-policy priority or deadline.');
  }
  if (options.deadlineMs !== undefined && policy !== 'deadline') {
    throw new InvalidValueError('deadline_ms', `deadline scheduling is not enabled: this server's scheduling policy is ${policy} `
      + '(--scheduling-policy), which never reads deadline_ms. Leave deadline_ms out, or serve with --scheduling-policy deadline.');
  }
}

function deadlineOption(fields: Fields): { deadlineMs?: number } {
  const deadlineMs = fields.number('deadline_ms', { min: 0, max: 7 * 24 * 3600 * 1000 });
  return deadlineMs !== undefined ? { deadlineMs } : {};
}

function guidedOption(fields: Fields): { guided?: GuidedRequest } {
  const guided = readGuided(fields);
  return guided ? { guided } : {};
}

/**
 * A tokenizer's end-of-generation ids other than its EOS (Llama 3's <|eot_id|>, Qwen's <|im_end|>), and those of the
 * model's generation_config.json (`more`).
 */
export function secondaryEosTokenIds(tokenizer: Pick<Tokenizer, 'eosId' | 'stopTokenIds'>, more: readonly number[] = []): number[] {
  return [...new Set([...tokenizer.stopTokenIds, ...more])].filter((id) => id !== tokenizer.eosId);
}

/**
 * The engine's sampling parameters once the prompt length has fixed max_tokens. promptLogprobs: alternatives per
 * prompt token the response shows (prompt_logprobs, or completions' echo with logprobs), undefined for none.
 */
export function toSamplingParams(options: GenerationOptions, maxTokens: number, logprobs: number | null,
  promptLogprobs?: number, secondaryEosTokenIds: readonly number[] = []): SamplingParams {
  // The model's end-of-generation ids besides its EOS are stop token ids, so that ending on one reports its id as
  // stop_reason (vLLM adds them to stop_token_ids, unless ignore_eos; ending on the EOS itself reports null). The
  // engine stops on them either way.
  const extraStops = secondaryEosTokenIds.filter((id) => !options.stopTokenIds.includes(id));
  // Under ignore_eos they end nothing, but min_tokens still holds them back (SamplingParams.ignoredEosTokenIds).
  const ignoredEos = options.ignoreEos && options.minTokens > 0 ? extraStops : [];
  return {
    temperature: options.temperature,
    topP: options.topP,
    topK: options.topK,
    minP: options.minP,
    repetitionPenalty: options.repetitionPenalty,
    presencePenalty: options.presencePenalty,
    frequencyPenalty: options.frequencyPenalty,
    ...(options.logitBias ? { logitBias: options.logitBias } : {}),
    ...(options.seed !== undefined ? { seed: options.seed } : {}),
    n: options.n,
    maxTokens,
    minTokens: options.minTokens,
    ignoreEos: options.ignoreEos,
    stopTokenIds: !options.ignoreEos && extraStops.length > 0 ? [...options.stopTokenIds, ...extraStops] : options.stopTokenIds,
    ...(ignoredEos.length > 0 ? { ignoredEosTokenIds: ignoredEos } : {}),
    stop: options.stop,
    includeStopStrInOutput: options.includeStopStrInOutput,
    logprobs,
    skipSpecialTokens: options.skipSpecialTokens,
    ...(options.keptSpecialTokenIds?.length ? { keptSpecialTokenIds: options.keptSpecialTokenIds } : {}),
    ...(options.guided ? { guided: options.guided.spec } : {}),
    ...(promptLogprobs !== undefined ? { promptLogprobs } : {}),
  };
}
