// POST /v1/responses (OpenAI's Responses API, as vLLM serves it): `instructions` and `input` (a string, or message
// items whose content is text) become chat messages rendered with the model's template; `text.format` is the
// output's response_format; max_output_tokens its max_tokens. The request is then checked and run as a chat
// completion, so every sampling field means what it means there. What needs state the server does not keep
// (previous_response_id, stored responses) or features it lacks (tools, files, images) is refused by name.

import { ApiError, InvalidValueError, UnsupportedFieldError } from '../errors.ts';
import { childPath, Fields, readArray, readObject, readString, type JsonObject } from '../validate.ts';
import { parseChatCompletionRequest, type ChatCompletionRequest } from './chat.ts';
import type { ValidationContext } from './generation.ts';

/** What the response object repeats of the request (OpenAI's Response fields), beside the chat request it runs as. */
export interface ResponsesEcho {
  instructions: string | null;
  maxOutputTokens: number | null;
  metadata: Record<string, string>;
  temperature: number;
  topP: number;
  user: string | null;
  /** text.format as given (default {type: 'text'}). */
  textFormat: JsonObject;
  parallelToolCalls: boolean;
  reasoningEffort: string | null;
}

export interface ResponsesRequest {
  chat: ChatCompletionRequest;
  echo: ResponsesEcho;
}

const UNSUPPORTED_RESPONSES: Record<string, string> = {
  previous_response_id: 'responses are not stored; send the whole conversation in input.',
  conversation: 'conversations are not stored; send the whole conversation in input.',
  background: 'background responses are not supported.',
  prompt: 'stored prompt templates are not supported.',
  include: 'no additional output data is available.',
  top_logprobs: 'logprobs are not available on /v1/responses; use /v1/chat/completions.',
  max_tool_calls: 'tools are not supported on /v1/responses.',
};

/** Sampling fields of vLLM and of this server that pass through to the chat request unchanged. */
const PASSED_THROUGH = [
  'top_k', 'min_p', 'repetition_penalty', 'presence_penalty', 'frequency_penalty', 'seed', 'stop', 'stop_token_ids', 'min_tokens',
  'ignore_eos', 'skip_special_tokens', 'logit_bias', 'priority', 'deadline_ms', 'cache_salt', 'chat_template_kwargs',
] as const;

/** The chat request's param names as the Responses request calls them, for errors found after the translation. */
const RENAMED_PARAMS: readonly [RegExp, string][] = [
  [/^max_tokens$/, 'max_output_tokens'],
  [/^response_format\.json_schema\.?/, 'text.format.'],
  [/^response_format\.?/, 'text.format.'],
  [/^reasoning_effort$/, 'reasoning.effort'],
];

/** An error about the chat request it ran as, with the param named as the Responses request names it. */
export function responsesError(error: unknown, messageParam: (index: number) => string): unknown {
  if (!(error instanceof ApiError) || error.param === null) return error;
  let param = error.param;
  const message = /^messages\[(\d+)\](.*)$/.exec(param);
  if (message) param = `${messageParam(Number(message[1]))}${message[2]}`;
  else if (param === 'messages') param = 'input';
  for (const [pattern, name] of RENAMED_PARAMS) {
    if (pattern.test(param)) {
      param = param.replace(pattern, name).replace(/\.$/, '');
      break;
    }
  }
  if (param === error.param) return error;
  return new ApiError(error.statusCode, error.code, error.type, error.message.split(`'${error.param}'`).join(`'${param}'`), param, error.headers);
}

/** One input item as a chat message, its content flattened to text parts the chat parser reads. */
function readInputItem(index: number, value: unknown): JsonObject {
  const path = childPath('input', index);
  const fields = new Fields(readObject(path, value), path);
  const type = fields.string('type') ?? 'message';
  if (type !== 'message') {
    throw new UnsupportedFieldError(fields.path('type'), `input items of type '${type}' are not supported; send messages with text content.`);
  }
  const role = readString(fields.path('role'), fields.required('role'));
  if (!['user', 'system', 'developer', 'assistant'].includes(role)) {
    throw new InvalidValueError(fields.path('role'), `unknown role '${role}'; expected one of user, system, developer, assistant.`);
  }
  const content = fields.required('content');
  if (typeof content === 'string') return { role, content };
  const parts = readArray(fields.path('content'), content, { nonEmpty: true }).map((part, i) => {
    const partPath = childPath(fields.path('content'), i);
    const partFields = new Fields(readObject(partPath, part), partPath);
    const partType = readString(partFields.path('type'), partFields.required('type'));
    switch (partType) {
      case 'input_text':
      case 'output_text':
        return { type: 'text', text: readString(partFields.path('text'), partFields.required('text')) };
      case 'refusal':
        return { type: 'text', text: readString(partFields.path('refusal'), partFields.required('refusal')) };
      case 'input_image':
      case 'input_file':
      case 'input_audio':
        throw new UnsupportedFieldError(partFields.path('type'), `content parts of type '${partType}': this server runs text-only models; send input_text parts only.`);
      default:
        throw new InvalidValueError(partFields.path('type'), `unknown content part type '${partType}'.`);
    }
  });
  return { role, content: parts };
}

/** text.format as chat's response_format (undefined for plain text). */
function readTextFormat(fields: Fields): { format: JsonObject; responseFormat?: JsonObject } {
  const text = fields.fields('text');
  const verbosity = text?.string('verbosity');
  if (verbosity !== undefined && verbosity !== 'medium') {
    throw new UnsupportedFieldError('text.verbosity', 'only the default verbosity (medium) is supported.');
  }
  const format = text?.fields('format');
  if (!format) return { format: { type: 'text' } };
  const type = readString(format.path('type'), format.required('type'));
  switch (type) {
    case 'text':
      return { format: format.object };
    case 'json_object':
      return { format: format.object, responseFormat: { type: 'json_object' } };
    case 'json_schema': {
      const jsonSchema: JsonObject = { name: readString(format.path('name'), format.required('name'), { nonEmpty: true }) };
      jsonSchema.schema = format.required('schema');
      if (format.has('strict')) jsonSchema.strict = format.boolean('strict')!;
      if (format.has('description')) jsonSchema.description = format.string('description')!;
      return { format: format.object, responseFormat: { type: 'json_schema', json_schema: jsonSchema } };
    }
    default:
      throw new InvalidValueError(format.path('type'), `unknown format type '${type}'; expected text, json_object or json_schema.`);
  }
}

export function parseResponsesRequest(body: unknown, context: ValidationContext): ResponsesRequest {
  const fields = new Fields(readObject('body', body));
  for (const key in fields.object) {
    const reason = UNSUPPORTED_RESPONSES[key];
    if (reason !== undefined && fields.has(key)) throw new UnsupportedFieldError(key, reason);
  }
  const tools = fields.array('tools') ?? [];
  if (tools.length > 0) throw new UnsupportedFieldError('tools', 'tools are not supported on /v1/responses; use /v1/chat/completions.');
  const toolChoice = fields.raw('tool_choice');
  if (toolChoice !== undefined && toolChoice !== 'auto' && toolChoice !== 'none') {
    throw new UnsupportedFieldError('tool_choice', 'tools are not supported on /v1/responses; use /v1/chat/completions.');
  }
  const truncation = fields.string('truncation');
  if (truncation !== undefined && truncation !== 'disabled') {
    throw new UnsupportedFieldError('truncation', 'only "disabled" is supported: a prompt longer than the context is refused.');
  }
  // store (OpenAI's default true) is read and accepted: nothing is stored here, which the response says (store: false).
  fields.boolean('store');
  const reasoning = fields.fields('reasoning');
  const reasoningEffort = reasoning?.string('effort', { nonEmpty: true }) ?? null;
  if (reasoning?.has('summary')) throw new UnsupportedFieldError('reasoning.summary', 'reasoning summaries are not supported.');
  const instructions = fields.string('instructions') ?? null;
  const input = fields.required('input');
  const items = typeof input === 'string' ? [{ role: 'user', content: input }]
    : readArray('input', input, { nonEmpty: true }).map((item, i) => readInputItem(i, item));
  const messages = instructions !== null ? [{ role: 'system', content: instructions }, ...items] : items;
  const maxOutputTokens = fields.integer('max_output_tokens', { min: 1 }) ?? null;
  const metadata = fields.fields('metadata');
  const metadataEcho: Record<string, string> = {};
  for (const key of Object.keys(metadata?.object ?? {})) metadataEcho[key] = metadata!.string(key)!;
  const { format, responseFormat } = readTextFormat(fields);
  const parallelToolCalls = fields.boolean('parallel_tool_calls') ?? true;

  const chatBody: JsonObject = { messages };
  for (const key of ['model', 'temperature', 'top_p', 'stream', 'user'] as const) {
    if (fields.has(key)) chatBody[key] = fields.raw(key) as JsonObject[string];
  }
  for (const key of PASSED_THROUGH) if (fields.has(key)) chatBody[key] = fields.raw(key) as JsonObject[string];
  if (maxOutputTokens !== null) chatBody.max_tokens = maxOutputTokens;
  if (responseFormat) chatBody.response_format = responseFormat;
  if (reasoningEffort !== null) chatBody.reasoning_effort = reasoningEffort;
  const offset = instructions !== null ? 1 : 0;
  let chat: ChatCompletionRequest;
  try {
    chat = parseChatCompletionRequest(chatBody, context);
  } catch (error) {
    throw responsesError(error, (index) => (index < offset ? 'instructions' : `input[${index - offset}]`));
  }
  // The stream always ends with the whole response, usage included.
  chat.includeUsage = chat.stream;
  return {
    chat,
    echo: {
      instructions, maxOutputTokens, metadata: metadataEcho, temperature: chat.temperature, topP: chat.topP,
      user: chat.user ?? null, textFormat: format, parallelToolCalls, reasoningEffort,
    },
  };
}
