// POST /v1/responses (OpenAI's Responses API, as vLLM serves it): `instructions` and `input` (a string, or message
// items whose content is text) become chat messages rendered with the model's template; `text.format` is the
// output's response_format; max_output_tokens its max_tokens. The request is then checked and run as a chat
// completion, so every sampling field means what it means there; function tools, and function_call /
// function_call_output input items, are chat's tools, assistant tool calls and tool messages. vLLM's own fields of
// its ResponsesRequest work as there (request_id names the response, structured_outputs, the sampling extras); what
// needs state the server does not keep (previous_response_id, stored responses), features it lacks (other tools,
// files, images, vLLM's extension and disaggregation fields), and chat completion fields that have a Responses
// counterpart or none here (max_tokens, response_format, guided_*, logprobs ...) are refused by name, never ignored.

import { ApiError, InvalidValueError, UnsupportedFieldError, WrongTypeError } from '../errors.ts';
import { checkArgumentsDepth, childPath, Fields, isJsonObject, readArray, readObject, readString, type JsonObject } from '../validate.ts';
import { exactBodyField, rememberExactFields } from '../../model/template-values.ts';
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
  /** tools and tool_choice as given (default [] and 'auto'). */
  tools: unknown[];
  toolChoice: unknown;
}

export interface ResponsesRequest {
  chat: ChatCompletionRequest;
  /** The Responses field a chat message came from (`instructions`, `input[i]`), for errors found later too. */
  messageParam: (index: number) => string;
  echo: ResponsesEcho;
}

const UNSUPPORTED_RESPONSES: Record<string, string> = {
  previous_response_id: 'responses are not stored; send the whole conversation in input.',
  conversation: 'conversations are not stored; send the whole conversation in input.',
  background: 'background responses are not supported.',
  prompt: 'stored prompt templates are not supported.',
  include: 'no additional output data is available.',
  top_logprobs: 'logprobs are not available on /v1/responses; use /v1/chat/completions.',
  max_tool_calls: 'a bound on tool calls is not supported; leave max_tool_calls out.',
  // vLLM's ResponsesRequest fields for what this server does not have.
  previous_response: 'responses are not carried from turn to turn; send the whole conversation in input.',
  previous_input_messages: 'earlier turns are not taken apart from the input; send the whole conversation in input.',
  enable_response_messages: 'the raw input and output messages are not returned.',
  vllm_xargs: 'custom extension arguments are not supported by this server.',
  kv_transfer_params: "KV transfer parameters are not taken: this server's disaggregated workers hand requests over themselves.",
  mm_processor_kwargs: 'this server runs text-only models; there is no multimodal processor.',
  media_io_kwargs: 'this server runs text-only models; there is no media input.',
  // Chat completion fields that /v1/responses would otherwise drop: the Responses request says it another way, or
  // the response object has no place for what they ask.
  messages: 'the conversation is input (and instructions) on /v1/responses.',
  max_tokens: 'the bound is max_output_tokens on /v1/responses.',
  max_completion_tokens: 'the bound is max_output_tokens on /v1/responses.',
  response_format: 'the output format is text.format on /v1/responses.',
  guided_json: 'constrain the output with text.format or structured_outputs on /v1/responses.',
  guided_regex: 'constrain the output with text.format or structured_outputs on /v1/responses.',
  guided_choice: 'constrain the output with text.format or structured_outputs on /v1/responses.',
  guided_grammar: 'constrain the output with text.format or structured_outputs on /v1/responses.',
  guided_whitespace_pattern: 'constrain the output with text.format or structured_outputs on /v1/responses.',
  reasoning_effort: 'the effort is reasoning.effort on /v1/responses.',
  n: 'a response has one output; send the request again for another.',
  logprobs: 'logprobs are not available on /v1/responses; use /v1/chat/completions.',
  prompt_logprobs: 'logprobs are not available on /v1/responses; use /v1/chat/completions.',
  return_token_ids: 'token ids are not part of a response object; use /v1/chat/completions.',
  return_tokens_as_token_ids: 'token ids are not part of a response object; use /v1/chat/completions.',
  truncate_prompt_tokens: 'prompts are not truncated on /v1/responses (truncation "disabled" only); use /v1/chat/completions.',
  add_generation_prompt: 'the chat template controls of /v1/chat/completions are not taken on /v1/responses.',
  continue_final_message: 'the chat template controls of /v1/chat/completions are not taken on /v1/responses.',
  add_special_tokens: 'the chat template controls of /v1/chat/completions are not taken on /v1/responses.',
  documents: 'documents are not taken on /v1/responses; pass them in chat_template_kwargs.',
  echo: 'echo is not available on /v1/responses.',
};

/**
 * Values of refused fields that ask for nothing, the API's defaults: clients send them explicitly (the openai-agents
 * SDK sends include: [] with every request), and they are taken as leaving the field out.
 */
const ASKS_FOR_NOTHING: Record<string, (value: unknown) => boolean> = {
  include: (value) => Array.isArray(value) && value.length === 0,
  background: (value) => value === false,
  // Alternatives per token, of logprobs that are never given (they would come with include's logprobs).
  top_logprobs: (value) => value === 0,
};

/** OpenAI's service tiers this server serves: it has one tier, the default one. */
const SERVICE_TIERS = ['auto', 'default'];

/** Sampling fields of vLLM and of this server that pass through to the chat request unchanged. */
const PASSED_THROUGH = [
  'top_k', 'min_p', 'repetition_penalty', 'presence_penalty', 'frequency_penalty', 'seed', 'stop', 'stop_token_ids', 'min_tokens',
  'ignore_eos', 'skip_special_tokens', 'include_stop_str_in_output', 'spaces_between_special_tokens', 'logit_bias', 'priority',
  'deadline_ms', 'cache_salt', 'chat_template_kwargs', 'structured_outputs', 'request_id',
  // Refused there as here (features this server does not have).
  'bad_words', 'allowed_token_ids', 'logprob_token_ids', 'logits_processors', 'use_beam_search', 'chat_template',
] as const;

/** The chat request's param names as the Responses request calls them, for errors found after the translation. */
const RENAMED_PARAMS: readonly [RegExp, string][] = [
  [/^max_tokens$/, 'max_output_tokens'],
  [/^(tools\[\d+\])\.function\b/, '$1'],
  [/^tool_choice\.function\b/, 'tool_choice'],
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
  // A final message continued (continuesFinalMessage) that cannot be: the item it came from.
  else if (param === 'continue_final_message') param = messageParam(-1);
  for (const [pattern, name] of RENAMED_PARAMS) {
    if (pattern.test(param)) {
      param = param.replace(pattern, name).replace(/\.$/, '');
      break;
    }
  }
  if (param === error.param) return error;
  return new ApiError(error.statusCode, error.code, error.type, error.message.split(`'${error.param}'`).join(`'${param}'`), param, error.headers);
}

/**
 * One input item as a chat message, its content flattened to text parts the chat parser reads: a message as itself,
 * a function_call as an assistant message calling the tool (consecutive calls join one message, as a model's
 * parallel calls), a function_call_output as the tool's message.
 */
function readInputItem(index: number, value: unknown, previous: JsonObject | undefined): JsonObject | undefined {
  const path = childPath('input', index);
  const fields = new Fields(readObject(path, value), path);
  const type = fields.string('type') ?? 'message';
  if (type === 'function_call') {
    const call = {
      id: readString(fields.path('call_id'), fields.required('call_id'), { nonEmpty: true }), type: 'function',
      function: {
        name: readString(fields.path('name'), fields.required('name'), { nonEmpty: true }),
        arguments: checkArgumentsDepth(fields.path('arguments'), readString(fields.path('arguments'), fields.required('arguments'))),
      },
    };
    if (previous?.role === 'assistant' && Array.isArray(previous.tool_calls) && previous.content === undefined) {
      (previous.tool_calls as JsonObject[]).push(call);
      return undefined;
    }
    return { role: 'assistant', tool_calls: [call] };
  }
  if (type === 'function_call_output') {
    // The output is a string, or (OpenAI's newer shape) a list of content parts: their texts, as a message's.
    const output = readStringOrArray(fields.path('output'), fields.required('output'));
    return {
      role: 'tool', tool_call_id: readString(fields.path('call_id'), fields.required('call_id'), { nonEmpty: true }),
      content: typeof output === 'string' ? output : readContentParts(fields.path('output'), output),
    };
  }
  if (type !== 'message') {
    throw new UnsupportedFieldError(fields.path('type'), `input items of type '${type}' are not supported; send messages, function calls and their outputs.`);
  }
  const role = readString(fields.path('role'), fields.required('role'));
  if (!['user', 'system', 'developer', 'assistant'].includes(role)) {
    throw new InvalidValueError(fields.path('role'), `unknown role '${role}'; expected one of user, system, developer, assistant.`);
  }
  const content = readStringOrArray(fields.path('content'), fields.required('content'));
  if (typeof content === 'string') return { role, content };
  return { role, content: readContentParts(fields.path('content'), content) };
}

/** A field whose value is a string or a list (input, content, output): refused in words that name both. */
function readStringOrArray(path: string, value: unknown): string | unknown[] {
  if (typeof value === 'string' || Array.isArray(value)) return value;
  throw new WrongTypeError(path, 'a string or an array', value);
}

/** Content parts (input_text, output_text, refusal) as the chat parser's text parts; other kinds are refused. */
function readContentParts(path: string, value: unknown): JsonObject[] {
  return readArray(path, value, { nonEmpty: true }).map((part, i) => {
    const partPath = childPath(path, i);
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
}

/** A function tool ({type, name, description, parameters, strict}) as chat's ({type, function: {...}}). */
function readTool(index: number, value: unknown): JsonObject {
  const path = childPath('tools', index);
  const fields = new Fields(readObject(path, value), path);
  const type = readString(fields.path('type'), fields.required('type'));
  if (type !== 'function') throw new UnsupportedFieldError(fields.path('type'), `tools of type '${type}' are not supported; only 'function'.`);
  const fn: JsonObject = { name: fields.required('name') as string };
  for (const key of ['description', 'parameters', 'strict'] as const) if (fields.has(key)) fn[key] = fields.raw(key) as JsonObject[string];
  return { type: 'function', function: fn };
}

/** tool_choice: 'auto', 'none', 'required', or {type: 'function', name} as chat's {type, function: {name}}. */
function readToolChoice(fields: Fields): JsonObject[string] | undefined {
  const choice = fields.raw('tool_choice');
  if (choice === undefined || choice === 'none' || choice === 'auto' || choice === 'required') return choice;
  if (!isJsonObject(choice)) {
    throw new InvalidValueError('tool_choice', 'expected "none", "auto", "required" or {"type": "function", "name": ...}.');
  }
  const object = fields.fields('tool_choice')!;
  const type = readString(object.path('type'), object.required('type'));
  if (type !== 'function') throw new UnsupportedFieldError(object.path('type'), `tool_choice of type '${type}' is not supported; only 'function'.`);
  return { type: 'function', function: { name: object.required('name') as string } };
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

/**
 * Whether the input ends with an assistant message still being written (status "in_progress" or "incomplete", as a
 * response cut short by max_output_tokens gives it back): as vLLM does, the model continues that message instead of
 * starting a turn of its own (chat's continue_final_message). A message with no text yet has nothing to continue.
 */
function continuesFinalMessage(input: unknown): boolean {
  const last: unknown = Array.isArray(input) ? input.at(-1) : undefined;
  if (!isJsonObject(last) || (last.type ?? 'message') !== 'message' || last.role !== 'assistant') return false;
  if (last.status !== 'in_progress' && last.status !== 'incomplete') return false;
  // The text continued is the content's last part (chat's continue_final_message looks for it in the rendered chat).
  const { content } = last;
  const lastPart: unknown = Array.isArray(content) ? content.at(-1) : undefined;
  const text = typeof content === 'string' ? content : isJsonObject(lastPart) ? lastPart.text ?? lastPart.refusal : undefined;
  return typeof text === 'string' && text.trim().length > 0;
}

export function parseResponsesRequest(body: unknown, context: ValidationContext): ResponsesRequest {
  const fields = new Fields(readObject('body', body));
  for (const key in fields.object) {
    const reason = UNSUPPORTED_RESPONSES[key];
    if (reason !== undefined && fields.has(key) && !ASKS_FOR_NOTHING[key]?.(fields.raw(key))) throw new UnsupportedFieldError(key, reason);
  }
  const tools = (fields.array('tools') ?? []).map((tool, i) => readTool(i, tool));
  const toolChoice = readToolChoice(fields);
  const truncation = fields.string('truncation');
  if (truncation !== undefined && truncation !== 'disabled') {
    throw new UnsupportedFieldError('truncation', 'only "disabled" is supported: a prompt longer than the context is refused.');
  }
  // store (OpenAI's default true) is read and accepted: nothing is stored here, which the response says (store: false).
  fields.boolean('store');
  // prompt_cache_key is a hint for the prompt cache, which needs none here (prompts are cached by their blocks), as
  // vLLM takes it; the one service tier there is serves every request.
  fields.string('prompt_cache_key');
  const serviceTier = fields.string('service_tier');
  if (serviceTier !== undefined && !SERVICE_TIERS.includes(serviceTier)) {
    throw new UnsupportedFieldError('service_tier', `service tier '${serviceTier}' is not offered: every request is served `
      + 'in the one tier there is (auto, default); order requests with priority instead.');
  }
  const reasoning = fields.fields('reasoning');
  const reasoningEffort = reasoning?.string('effort', { nonEmpty: true }) ?? null;
  if (reasoning?.has('summary')) throw new UnsupportedFieldError('reasoning.summary', 'reasoning summaries are not supported.');
  const instructions = fields.string('instructions') ?? null;
  const input = readStringOrArray('input', fields.required('input'));
  const items: JsonObject[] = [];
  /** The input item each message came from (a function_call joined to the one before comes from that one's). */
  const itemOf: number[] = [];
  if (typeof input === 'string') {
    items.push({ role: 'user', content: input });
    itemOf.push(0);
  } else {
    readArray('input', input, { nonEmpty: true }).forEach((item, i) => {
      const message = readInputItem(i, item, items.at(-1));
      if (message === undefined) return;
      items.push(message);
      itemOf.push(i);
    });
  }
  // Empty instructions say nothing, as vLLM takes them: an empty system message would still be a turn in the prompt.
  const systemMessages = instructions ? [{ role: 'system', content: instructions }] : [];
  const messages = [...systemMessages, ...items];
  const maxOutputTokens = fields.integer('max_output_tokens', { min: 1 }) ?? null;
  const metadata = fields.fields('metadata');
  const metadataEcho: Record<string, string> = {};
  for (const key of Object.keys(metadata?.object ?? {})) metadataEcho[key] = metadata!.string(key)!;
  const { format, responseFormat } = readTextFormat(fields);
  if (responseFormat && fields.has('structured_outputs')) {
    throw new InvalidValueError('structured_outputs', 'structured_outputs and text.format cannot both constrain the output; send one.');
  }
  const parallelToolCalls = fields.boolean('parallel_tool_calls') ?? true;

  const chatBody: JsonObject = { messages };
  for (const key of ['model', 'temperature', 'top_p', 'stream', 'user'] as const) {
    if (fields.has(key)) chatBody[key] = fields.raw(key) as JsonObject[string];
  }
  for (const key of PASSED_THROUGH) if (fields.has(key)) chatBody[key] = fields.raw(key) as JsonObject[string];
  if (tools.length > 0) chatBody.tools = tools;
  if (toolChoice !== undefined) chatBody.tool_choice = toolChoice;
  if (fields.has('parallel_tool_calls')) chatBody.parallel_tool_calls = parallelToolCalls;
  if (maxOutputTokens !== null) chatBody.max_tokens = maxOutputTokens;
  if (responseFormat) chatBody.response_format = responseFormat;
  if (reasoningEffort !== null) chatBody.reasoning_effort = reasoningEffort;
  if (continuesFinalMessage(input)) chatBody.continue_final_message = true;
  // What reaches the chat template and the grammar is read with exact numbers, as a chat completion's is (tools and
  // the text format's schema in chat's shape): an enum of 1234567890123456789 is not produced as ...800.
  const exact: Record<string, unknown> = {};
  if (tools.length > 0) exact.tools = (exactBodyField(body, 'tools', fields.raw('tools')) as unknown[]).map((tool, i) => readTool(i, tool));
  if (fields.has('chat_template_kwargs')) exact.chat_template_kwargs = exactBodyField(body, 'chat_template_kwargs', fields.raw('chat_template_kwargs'));
  if (fields.has('structured_outputs')) exact.structured_outputs = exactBodyField(body, 'structured_outputs', fields.raw('structured_outputs'));
  const jsonSchema = responseFormat?.json_schema;
  if (isJsonObject(jsonSchema)) {
    const exactText = exactBodyField(body, 'text', fields.raw('text'));
    const exactFormat = isJsonObject(exactText) && isJsonObject(exactText.format) ? exactText.format : undefined;
    if (exactFormat !== undefined) exact.response_format = { ...responseFormat, json_schema: { ...jsonSchema, schema: exactFormat.schema } };
  }
  rememberExactFields(chatBody, exact);
  const offset = systemMessages.length;
  /** index: of a chat message, from the end when negative. */
  const messageParam = (index: number): string => {
    const at = index < 0 ? messages.length + index : index;
    return at < offset ? 'instructions' : `input[${itemOf[at - offset]}]`;
  };
  let chat: ChatCompletionRequest;
  try {
    chat = parseChatCompletionRequest(chatBody, context);
  } catch (error) {
    throw responsesError(error, messageParam);
  }
  // The stream always ends with the whole response, usage included.
  chat.includeUsage = chat.stream;
  // Read above into the chat body or not at all: the Responses body's own fields are the ones to name.
  chat.ignoredFields = fields.unreadKeys();
  return {
    chat,
    messageParam,
    echo: {
      instructions, maxOutputTokens, metadata: metadataEcho, temperature: chat.temperature, topP: chat.topP,
      user: chat.user ?? null, textFormat: format, parallelToolCalls, reasoningEffort,
      tools: fields.array('tools') ?? [], toolChoice: fields.raw('tool_choice') ?? 'auto',
    },
  };
}
