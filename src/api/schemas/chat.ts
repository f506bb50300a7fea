// POST /v1/chat/completions request: messages in OpenAI's wire shape (handed to the chat template as they are, since
// Jinja chat templates are written against that shape), plus the chat-only fields.

import { InvalidValueError, UnsupportedFieldError } from '../errors.ts';
import { checkArgumentsDepth, checkTemplateValueDepth, childPath, Fields, readArray, readObject, readString, type JsonObject } from '../validate.ts';
import { readTools, toolGuided, useExactIntegers, type ToolsRequest } from '../tool-calls.ts';
import { exactBodyField } from '../../model/template-values.ts';
import {
  MAX_LOGPROBS, readGenerationOptions, rejectUnsupported, unsupportedFields, type GenerationOptions,
  type ValidationContext,
} from './generation.ts';

export type ChatRole = 'system' | 'developer' | 'user' | 'assistant' | 'tool';
const ROLES: readonly ChatRole[] = ['system', 'developer', 'user', 'assistant', 'tool'];

export interface ToolCall {
  id: string;
  type: 'function';
  function: { name: string; arguments: string };
}

/** One message as a chat template sees it: content flattened to text. */
export interface ChatMessage {
  role: ChatRole;
  content: string | null;
  name?: string;
  tool_calls?: ToolCall[];
  tool_call_id?: string;
  /**
   * An assistant turn's reasoning (its `reasoning`, or the older `reasoning_content`), under both names as vLLM
   * passes it: templates such as Qwen3's rebuild the thinking of earlier turns from it.
   */
  reasoning?: string;
  reasoning_content?: string;
  /**
   * The texts of content sent as a list of parts (`content` is them joined by "\n"): a template that loops over
   * content gets the list, as vLLM gives it. Not a template field itself (the gateway turns it into the list).
   */
  contentParts?: string[];
}

export interface ChatCompletionRequest extends GenerationOptions {
  messages: ChatMessage[];
  logprobs: boolean;
  /** Alternatives per token when logprobs is on (0 = only the chosen token). */
  topLogprobs: number;
  addGenerationPrompt: boolean;
  /**
   * vLLM's continue_final_message: the prompt ends inside the last message (rendered, then cut after its content),
   * so the model continues it (a prefilled start of the answer) rather than writing a new one.
   */
  continueFinalMessage: boolean;
  /**
   * vLLM's add_special_tokens: the tokenizer's BOS (and EOS) added to the rendered template, on top of what the
   * template writes (default false, as in vLLM and Hugging Face's apply_chat_template: templates write their own).
   */
  addSpecialTokens: boolean;
  chatTemplateKwargs?: JsonObject;
  /** tools, tool_choice and parallel_tool_calls (absent without tools). */
  tools?: ToolsRequest;
}

const TEXT_ONLY = 'this server runs text-only models; send text content parts only.';

/**
 * Most messages one request may send. The chat template renders them on the event loop, about 10 µs a message: a
 * request of 120,000 empty messages stalled every other client for over a second.
 */
export const MAX_MESSAGES = 4096;

const UNSUPPORTED_CHAT = unsupportedFields({
  functions: 'function calling is not supported; omit functions.',
  function_call: 'function calling is not supported; omit function_call.',
  audio: 'audio output is not supported.',
  prediction: 'predicted outputs are not supported.',
  web_search_options: 'web search is not supported.',
  chat_template: 'per-request chat templates are not supported; the model\'s own template is used.',
  echo: 'echo on chat completions is not supported; continue_final_message continues the last message instead.',
});

/** Text of one message's content: a string, or the texts of its parts. */
function readContent(param: string, value: unknown): string | string[] {
  if (typeof value === 'string') return value;
  const parts = readArray(param, value, { nonEmpty: true });
  const texts = parts.map((part, i) => {
    const partPath = childPath(param, i);
    const fields = new Fields(readObject(partPath, part), partPath);
    const type = fields.string('type') ?? (fields.has('text') ? 'text' : undefined);
    switch (type) {
      // The Responses API's part types are text too (vLLM reads them so), for clients that share code between the two.
      case 'text':
      case 'input_text':
      case 'output_text':
        return readString(fields.path('text'), fields.required('text'));
      case 'refusal':
        return readString(fields.path('refusal'), fields.required('refusal'));
      case 'image_url':
      case 'input_image':
      case 'input_audio':
      case 'file':
        throw new UnsupportedFieldError(fields.path('type'), `content parts of type '${type}': ${TEXT_ONLY}`);
      case undefined:
        throw new InvalidValueError(fields.path('type'), 'a content part needs a type (e.g. "text").');
      default:
        throw new InvalidValueError(fields.path('type'), `unknown content part type '${type}'.`);
    }
  });
  return texts;
}

function readToolCalls(param: string, value: unknown): ToolCall[] {
  return readArray(param, value).map((item, i) => {
    const callPath = childPath(param, i);
    const call = new Fields(readObject(callPath, item), callPath);
    const type = call.string('type') ?? 'function';
    if (type !== 'function') throw new InvalidValueError(call.path('type'), `unknown tool call type '${type}'.`);
    const fn = call.fields('function');
    if (!fn) throw new InvalidValueError(call.path('function'), 'a tool call needs a function.');
    return {
      id: readString(call.path('id'), call.required('id')),
      type: 'function',
      function: {
        name: readString(fn.path('name'), fn.required('name'), { nonEmpty: true }),
        arguments: checkArgumentsDepth(fn.path('arguments'), readString(fn.path('arguments'), fn.required('arguments'))),
      },
    };
  });
}

function readMessage(index: number, value: unknown): ChatMessage {
  const path = childPath('messages', index);
  const fields = new Fields(readObject(path, value), path);
  const role = readString(fields.path('role'), fields.required('role'));
  if (role === 'function') throw new UnsupportedFieldError(fields.path('role'), 'the deprecated function role is not supported.');
  if (!(ROLES as readonly string[]).includes(role)) {
    throw new InvalidValueError(fields.path('role'), `unknown role '${role}'; expected one of ${ROLES.join(', ')}.`);
  }
  const message: ChatMessage = { role: role as ChatRole, content: null };
  const name = fields.string('name');
  if (name !== undefined) message.name = name;
  const callsTools = role === 'assistant' && fields.has('tool_calls');
  if (callsTools) {
    // An empty list (clients such as LangChain send one on every assistant turn) is no calls: the template must take
    // the turn's plain path and render its content, as vLLM drops it too.
    const calls = readToolCalls(fields.path('tool_calls'), fields.raw('tool_calls'));
    if (calls.length > 0) message.tool_calls = calls;
  }
  if (role === 'assistant') {
    const reasoning = fields.string('reasoning') ?? fields.string('reasoning_content');
    if (reasoning !== undefined) {
      message.reasoning = reasoning;
      message.reasoning_content = reasoning;
    }
  }
  if (role === 'tool') message.tool_call_id = readString(fields.path('tool_call_id'), fields.required('tool_call_id'));
  // An assistant turn that calls tools may have no content; every other message must say something.
  if (fields.has('content')) {
    const content = readContent(fields.path('content'), fields.raw('content'));
    message.content = typeof content === 'string' ? content : content.join('\n');
    if (typeof content !== 'string') message.contentParts = content;
  }
  else if (!callsTools) fields.required('content');
  return message;
}

function checkOutputFormat(fields: Fields): void {
  // response_format itself is read with the other output constraints (../guided.ts).
  const modalities = fields.array('modalities') ?? [];
  modalities.forEach((modality, i) => {
    const value = readString(childPath('modalities', i), modality);
    if (value !== 'text') throw new UnsupportedFieldError('modalities', `only "text" output is supported, not "${value}".`);
  });
}

/**
 * top_logprobs, 0 to MAX_LOGPROBS. vLLM also takes -1 (the whole vocabulary) and then holds it to --max-logprobs,
 * whose default (20, this server's fixed limit) refuses it for any real vocabulary: -1 is refused here as there, with
 * a message that says why. As in vLLM, a count that asks for alternatives (-1 or above 0) needs logprobs true first.
 */
function readTopLogprobs(fields: Fields, logprobs: boolean, context: ValidationContext): number | undefined {
  const raw = fields.raw('top_logprobs');
  if ((raw === -1 || (Number.isInteger(raw) && (raw as number) > 0)) && !logprobs) {
    throw new InvalidValueError('top_logprobs', 'top_logprobs needs logprobs set to true.');
  }
  if (raw === -1) {
    throw new InvalidValueError('top_logprobs', `-1 asks for the whole vocabulary (${context.vocabSize} alternatives per `
      + `token), more than this server returns: ask for at most ${MAX_LOGPROBS}.`);
  }
  return fields.integer('top_logprobs', { min: 0, max: MAX_LOGPROBS });
}

export function parseChatCompletionRequest(body: unknown, context: ValidationContext): ChatCompletionRequest {
  const fields = new Fields(readObject('body', body));
  rejectUnsupported(fields, UNSUPPORTED_CHAT);
  checkOutputFormat(fields);
  const tools = readTools(fields);
  // What reaches the chat template is read with exact numbers (a 64-bit enum value, a 1.0 default), as Python's json
  // keeps them for vLLM; validation above and below saw JSON.parse's.
  // The grammar of a named or "required" call too: its schema's integers past 2^53 are spelled as written.
  if (tools) {
    tools.raw = exactBodyField(body, 'tools', tools.raw) as unknown[];
    useExactIntegers(tools);
  }
  fields.required('messages');
  const messages = fields.array('messages', { nonEmpty: true, maxItems: MAX_MESSAGES })!;
  const logprobs = fields.boolean('logprobs') ?? false;
  const topLogprobs = readTopLogprobs(fields, logprobs, context);
  // vLLM hands documents (RAG) and reasoning_effort to the template beside chat_template_kwargs, which win.
  const templateExtras: JsonObject = {};
  if (fields.has('documents')) {
    const documents = readArray('documents', fields.raw('documents'));
    checkTemplateValueDepth('documents', documents);
    templateExtras.documents = exactBodyField(body, 'documents', documents) as JsonObject[];
  }
  if (fields.has('reasoning_effort')) templateExtras.reasoning_effort = fields.string('reasoning_effort', { nonEmpty: true })!;
  const parsedKwargs = fields.fields('chat_template_kwargs')?.object;
  if (parsedKwargs) checkTemplateValueDepth('chat_template_kwargs', parsedKwargs);
  const ownKwargs = parsedKwargs && exactBodyField(body, 'chat_template_kwargs', parsedKwargs) as JsonObject;
  const chatTemplateKwargs = ownKwargs || Object.keys(templateExtras).length > 0 ? { ...templateExtras, ...ownKwargs } : undefined;
  const continueFinalMessage = fields.boolean('continue_final_message') ?? false;
  const addGenerationPrompt = fields.boolean('add_generation_prompt');
  if (continueFinalMessage && addGenerationPrompt === true) {
    throw new InvalidValueError('continue_final_message', 'continue_final_message and add_generation_prompt cannot both be true.');
  }
  // OpenAI's verbosity (how much a reasoning model writes) has no counterpart here but the default.
  const verbosity = fields.string('verbosity');
  if (verbosity !== undefined && verbosity !== 'medium') {
    throw new UnsupportedFieldError('verbosity', 'only the default verbosity (medium) is supported.');
  }
  const options = readGenerationOptions(fields, context);
  // "required" and named tool choices decode under a grammar, which leaves no room for another output constraint.
  const toolGrammar = tools ? toolGuided(tools) : undefined;
  if (toolGrammar && options.guided) {
    throw new InvalidValueError(options.guided.param, `an output constraint cannot be combined with tool_choice '${tools!.choice.kind}'.`);
  }
  return {
    ...options,
    ...(toolGrammar ? { guided: toolGrammar } : {}),
    ...(tools ? { tools } : {}),
    messages: messages.map((message, i) => readMessage(i, message)),
    logprobs,
    topLogprobs: topLogprobs ?? 0,
    addGenerationPrompt: addGenerationPrompt ?? !continueFinalMessage,
    continueFinalMessage,
    addSpecialTokens: fields.boolean('add_special_tokens') ?? false,
    ...(chatTemplateKwargs ? { chatTemplateKwargs } : {}),
    ignoredFields: fields.unreadKeys(),
  };
}
