// POST /v1/completions request. `prompt` takes every form OpenAI allows: a string, a list of strings, a list of
// token ids, or a list of token-id lists; each prompt becomes its own engine request with n completions.

import { InvalidValueError, UnsupportedFieldError } from '../errors.ts';
import { childPath, Fields, readArray, readObject, readString } from '../validate.ts';
import {
  MAX_LOGPROBS, readGenerationOptions, readTokenId, rejectUnsupported, unsupportedFields, type GenerationOptions,
  type ValidationContext,
} from './generation.ts';

export const MAX_PROMPTS = 64;
/**
 * Tokens a completion may generate when the request sets neither max_tokens nor max_completion_tokens: OpenAI's
 * legacy completions default, which vLLM keeps (chat has none: the rest of the context).
 */
export const COMPLETION_DEFAULT_MAX_TOKENS = 16;

const UNSUPPORTED_COMPLETION = unsupportedFields({});

export type PromptInput = { text: string } | { tokenIds: number[] };

/**
 * Alternatives per prompt token the engine must report: for prompt_logprobs and, with echo, for the echoed prompt's
 * share of logprobs (the larger of the two; each view takes its own count).
 */
export function completionPromptLogprobs(request: CompletionRequest): number | undefined {
  const echoed = request.echo && request.logprobs !== null ? request.logprobs : undefined;
  if (echoed === undefined) return request.promptLogprobs;
  return Math.max(echoed, request.promptLogprobs ?? 0);
}

export interface CompletionRequest extends GenerationOptions {
  prompts: PromptInput[];
  echo: boolean;
  /**
   * echo with max_tokens 0 (OpenAI's legacy scoring request, which vLLM answers too): each choice is its prompt only,
   * with its logprobs when asked and no completion tokens. The engine still computes the prompt and samples one
   * token (maxTokens is 1), which the response leaves out.
   */
  promptOnly: boolean;
  /** Alternatives per token (0 = only the chosen token's logprob), or null for none. */
  logprobs: number | null;
  /** vLLM's add_special_tokens: a text prompt gets the tokenizer's BOS (and EOS) as its metadata asks (default true). */
  addSpecialTokens: boolean;
}

function readTokenList(param: string, value: unknown[], context: ValidationContext): number[] {
  if (value.length === 0) throw new InvalidValueError(param, 'a token-id prompt must not be empty.');
  return value.map((id, i) => readTokenId(childPath(param, i), id, context));
}

function readPrompts(fields: Fields, context: ValidationContext): PromptInput[] {
  const raw = fields.required('prompt');
  if (typeof raw === 'string') return [{ text: raw }];
  const list = readArray('prompt', raw, { nonEmpty: true });
  // A list of numbers is one prompt of token ids; otherwise every item is a prompt of its own.
  if (list.every((item) => typeof item === 'number')) return [{ tokenIds: readTokenList('prompt', list, context) }];
  if (list.length > MAX_PROMPTS) {
    throw new InvalidValueError('prompt', `${list.length} prompts in one request; the limit is ${MAX_PROMPTS}.`);
  }
  return list.map((item, i) => {
    const param = childPath('prompt', i);
    if (Array.isArray(item)) return { tokenIds: readTokenList(param, item, context) };
    return { text: readString(param, item) };
  });
}

/** Keys neither the body's fields nor those read in their place (echo's prompt-only request) asked about. */
function unreadByBoth(given: Fields, read: Fields): string[] {
  if (given === read) return given.unreadKeys();
  const unread = new Set(read.unreadKeys());
  return given.unreadKeys().filter((key) => unread.has(key));
}

export function parseCompletionRequest(body: unknown, context: ValidationContext): CompletionRequest {
  const given = new Fields(readObject('body', body));
  let fields = given;
  rejectUnsupported(fields, UNSUPPORTED_COMPLETION);
  const promptOnly = fields.raw('max_tokens') === 0 && fields.raw('max_completion_tokens') === undefined && fields.boolean('echo') === true;
  if (promptOnly) fields = new Fields({ ...fields.object, max_tokens: 1 });
  else if (fields.raw('max_tokens') === 0) throw new InvalidValueError('max_tokens', '0 is only allowed with echo: true and no max_completion_tokens (the prompt alone, scored).');
  const suffix = fields.string('suffix');
  if (suffix) throw new UnsupportedFieldError('suffix', 'fill-in-the-middle suffixes are not supported.');
  const options = readGenerationOptions(fields, context);
  if (options.maxTokens === undefined) {
    options.maxTokens = COMPLETION_DEFAULT_MAX_TOKENS;
    if (options.minTokens > options.maxTokens) {
      throw new InvalidValueError('min_tokens', `${options.minTokens} is larger than max_tokens (${options.maxTokens}, the default).`);
    }
  }
  const bestOf = fields.integer('best_of', { min: 1 });
  if (bestOf !== undefined && bestOf !== options.n) {
    throw new UnsupportedFieldError('best_of', `best_of different from n is not supported (best_of ${bestOf}, n ${options.n}).`);
  }
  const echo = fields.boolean('echo') ?? false;
  const logprobs = fields.integer('logprobs', { min: 0, max: MAX_LOGPROBS }) ?? null;
  const addSpecialTokens = fields.boolean('add_special_tokens') ?? true;
  const prompts = readPrompts(fields, context);
  return { ...options, prompts, echo, promptOnly, logprobs, addSpecialTokens, ignoredFields: unreadByBoth(given, fields) };
}
