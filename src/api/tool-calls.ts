// Tool calling: the request's tools and tool_choice, the grammar that enforces "required" and named choices, the
// parsers that find tool calls in a model's own output format under "auto" (Hermes/Qwen `<tool_call>` JSON, Llama
// 3.x JSON, Mistral `[TOOL_CALLS]` in its JSON-list and name-first forms), and the chat response shape that turns
// either into message.tool_calls and streamed delta.tool_calls.

import { randomBytes, randomInt } from 'node:crypto';
import { InvalidValueError, UnsupportedFieldError } from './errors.ts';
import { checkJsonSchema, exactIntegers, grammarSchema, grammarSchemaText, mapSchemas, type GuidedRequest } from './guided.ts';
import {
  chatChunkBody, chatCompletionBody, type ChatResponseMeta, type ChatTokenLogprob, type TokenTexts,
  type WireFinishReason, type WireUsage,
} from './openai-format.ts';
import { collectChatUpdate, type ChoiceUpdate, type ChoiceUsage, type ResponseShape } from './response-shapes.ts';
import { checkTemplateValueDepth, childPath, Fields, isJsonObject, readObject, readString, type JsonObject } from './validate.ts';

export const TOOL_CALL_PARSERS = ['hermes', 'llama3_json', 'mistral'] as const;
export type ToolCallParserName = typeof TOOL_CALL_PARSERS[number];
export const MAX_TOOLS = 128;

export interface ToolDefinition {
  name: string;
  description?: string;
  /** The arguments' JSON schema (absent: any object). */
  parameters?: JsonObject;
  /**
   * The same schema with its integers past 2^53 as the request wrote them (ExactInteger), for the grammar; absent
   * when it holds none (useExactIntegers).
   */
  exactParameters?: JsonObject;
}

export type ToolChoice = { kind: 'none' } | { kind: 'auto' } | { kind: 'required' } | { kind: 'named'; name: string };

export interface ToolsRequest {
  /** The tools as the client sent them (OpenAI's shape), for the chat template. */
  raw: unknown[];
  tools: ToolDefinition[];
  choice: ToolChoice;
  parallel: boolean;
}

const NAME = /^[a-zA-Z0-9_-]{1,64}$/;

/** tools, tool_choice and parallel_tool_calls; undefined when the request has no tools. */
export function readTools(fields: Fields): ToolsRequest | undefined {
  const list = fields.array('tools', { maxItems: MAX_TOOLS });
  const choice = readToolChoice(fields);
  const parallel = fields.boolean('parallel_tool_calls') ?? true;
  if (!list || list.length === 0) {
    if (choice?.kind === 'named') {
      throw new InvalidValueError('tool_choice', `tool_choice names the function '${choice.name}', but the request has no tools.`);
    }
    if (choice?.kind === 'required') throw new InvalidValueError('tool_choice', "tool_choice 'required' needs tools.");
    return undefined;
  }
  const seen = new Set<string>();
  const tools = list.map((item, i) => {
    const path = childPath('tools', i);
    const tool = new Fields(readObject(path, item), path);
    const type = readString(tool.path('type'), tool.required('type'));
    if (type !== 'function') throw new UnsupportedFieldError(tool.path('type'), `tools of type '${type}' are not supported; only 'function'.`);
    const fn = tool.fields('function');
    if (!fn) throw new InvalidValueError(tool.path('function'), 'a function tool needs a function object.');
    const name = readString(fn.path('name'), fn.required('name'));
    if (!NAME.test(name)) {
      throw new InvalidValueError(fn.path('name'), `'${name}' is not a valid function name (letters, digits, _ and -, at most 64).`);
    }
    if (seen.has(name)) throw new InvalidValueError(fn.path('name'), `two tools are named '${name}'.`);
    seen.add(name);
    const definition: ToolDefinition = { name };
    const description = fn.string('description');
    if (description !== undefined) definition.description = description;
    if (fn.has('parameters')) {
      const parameters = readObject(fn.path('parameters'), fn.raw('parameters'));
      // Only a schema the output will be decoded under (tool_choice "required", or this tool named) must be one a
      // grammar can enforce; under "auto" and "none" it only goes to the chat template, as with OpenAI and vLLM.
      const constrained = choice?.kind === 'required' || (choice?.kind === 'named' && choice.name === name);
      if (constrained) checkJsonSchema(parameters, fn.path('parameters'));
      else checkTemplateValueDepth(fn.path('parameters'), parameters);
      if (parameters.type !== undefined && parameters.type !== 'object') {
        throw new InvalidValueError(childPath(fn.path('parameters'), 'type'), "a function's parameters must be an object schema.");
      }
      definition.parameters = parameters;
    }
    fn.boolean('strict');
    return definition;
  });
  const resolved = choice ?? { kind: 'auto' };
  if (resolved.kind === 'named' && !seen.has(resolved.name)) {
    throw new InvalidValueError('tool_choice.function.name', `no tool is named '${resolved.name}'.`);
  }
  return { raw: list, tools, choice: resolved, parallel };
}

function readToolChoice(fields: Fields): ToolChoice | undefined {
  const raw = fields.raw('tool_choice');
  if (raw === undefined) return undefined;
  if (raw === 'none' || raw === 'auto' || raw === 'required') return { kind: raw };
  if (isJsonObject(raw)) {
    const choice = new Fields(raw, 'tool_choice');
    const type = readString(choice.path('type'), choice.required('type'));
    if (type !== 'function') throw new InvalidValueError(choice.path('type'), `expected 'function', got '${type}'.`);
    const fn = choice.fields('function');
    if (!fn) throw new InvalidValueError(choice.path('function'), 'a named tool choice needs function.name.');
    return { kind: 'named', name: readString(fn.path('name'), fn.required('name'), { nonEmpty: true }) };
  }
  throw new InvalidValueError('tool_choice', 'expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.');
}

/**
 * Gives each tool whose parameters hold an integer past 2^53 its exact parameters, read from `raw` (the tools with
 * exact numbers, TemplateNumber: exactBodyField). JSON.parse rounded them, so a named or "required" call's grammar
 * took an enum of 1234567890123456789 as 1234567890123456800, a number the client never offered; vLLM's schema
 * (Python's json) keeps the digits.
 */
export function useExactIntegers(request: ToolsRequest): void {
  request.tools.forEach((tool, i) => {
    const raw = request.raw[i];
    const fn = isJsonObject(raw) && isJsonObject(raw.function) ? raw.function : undefined;
    if (tool.parameters === undefined || fn === undefined || !isJsonObject(fn.parameters)) return;
    const parameters = exactIntegers(fn.parameters);
    if (parameters !== undefined) tool.exactParameters = parameters as JsonObject;
  });
}

const ANY_OBJECT = { type: 'object' };

/**
 * The schema a tool's arguments decode under: its parameters, an object schema even when they name no type. An empty
 * schema ({}, a tool without arguments as clients often write it) would otherwise let the grammar write any JSON value
 * (a string, a number) as the arguments; vLLM's "required" grammar takes it for an empty object schema too.
 */
function argumentsSchema(parameters: JsonObject | undefined): JsonObject {
  if (parameters === undefined) return ANY_OBJECT;
  return parameters.type === undefined ? { type: 'object', ...parameters } : parameters;
}
const NO_CALLS: ParsedOutput = { content: null, calls: [] };

/**
 * The grammar "required" and named choices decode under (vLLM's): a named choice's output is the arguments object
 * itself; "required" gives an array of {"name", "parameters"} items, one item unless parallel_tool_calls. A tool's
 * parameters with references ('$ref', e.g. Pydantic's "#/$defs/Model" or a recursive "#") go under the array
 * schema's $defs, their references rebased there, so that each resolves as it does in the tool's own schema.
 */
export function toolGuided(request: ToolsRequest): GuidedRequest | undefined {
  const { choice } = request;
  if (choice.kind === 'named') {
    const index = request.tools.findIndex((t) => t.name === choice.name);
    const tool = request.tools[index]!;
    const parameters = grammarSchema(argumentsSchema(tool.exactParameters ?? tool.parameters));
    const schema = grammarSchemaText(parameters, `tools[${index}].function.parameters`);
    return { spec: { kind: 'json_schema', schema }, param: 'tool_choice' };
  }
  if (choice.kind !== 'required') return undefined;
  const defs: JsonObject = {};
  const item = {
    anyOf: request.tools.map((tool, i) => {
      let parameters = grammarSchema(argumentsSchema(tool.exactParameters ?? tool.parameters));
      if (hasRefs(parameters)) {
        const key = `tool_${i}`;
        defs[key] = rebaseRefs(parameters, `#/$defs/${key}`);
        parameters = { $ref: `#/$defs/${key}` };
      }
      return {
        type: 'object',
        properties: { name: { const: tool.name }, parameters },
        required: ['name', 'parameters'],
        additionalProperties: false,
      };
    }),
  };
  const schema = {
    type: 'array', minItems: 1, ...(request.parallel ? {} : { maxItems: 1 }), items: item,
    ...(Object.keys(defs).length > 0 ? { $defs: defs } : {}),
  };
  return { spec: { kind: 'json_schema', schema: grammarSchemaText(schema, 'tools', "the tools' parameter schemas together (without their annotations)") },
    param: 'tools' };
}

function hasRefs(schema: unknown): boolean {
  let found = false;
  mapSchemas(schema, (node) => {
    if (node.$ref !== undefined) found = true;
    return node;
  });
  return found;
}

/** `schema` with each of its references ("#", "#/...") made relative to `base` ("#/$defs/tool_0"), where it is placed. */
function rebaseRefs(schema: unknown, base: string): unknown {
  return mapSchemas(schema, (node) => {
    if (typeof node.$ref === 'string' && node.$ref.startsWith('#')) node.$ref = base + node.$ref.slice(1);
    return node;
  });
}

// ---------------------------------------------------------------------------------------------------------------
// The model's own tool-call formats (tool_choice "auto")

export interface ParsedCall {
  name: string;
  /** JSON text of the arguments object. */
  arguments: string;
}

export interface ParsedOutput {
  content: string | null;
  calls: ParsedCall[];
}

/** The parser a chat template's own format calls for (Hermes when it says nothing recognisable). */
export function detectToolCallParser(templateText: string): ToolCallParserName {
  if (templateText.includes('[TOOL_CALLS]')) return 'mistral';
  if (templateText.includes('<tool_call>')) return 'hermes';
  if (templateText.includes('<|python_tag|>') || templateText.includes('ipython')) return 'llama3_json';
  return 'hermes';
}

/** The text a parser's tool calls begin with, for holding streamed content back (llama3_json: a leading '{'). */
export function toolCallMarker(parser: ToolCallParserName): string {
  switch (parser) {
    case 'hermes': return '<tool_call>';
    case 'mistral': return '[TOOL_CALLS]';
    case 'llama3_json': return '<|python_tag|>';
  }
}

/** The special-token texts a parser's format is written in: kept in the output when other special tokens are not. */
export function toolSyntaxTexts(parser: ToolCallParserName): readonly string[] {
  switch (parser) {
    case 'hermes': return ['<tool_call>', '</tool_call>'];
    case 'mistral': return ['[TOOL_CALLS]'];
    case 'llama3_json': return ['<|python_tag|>'];
  }
}

/**
 * One call object ({"name", "arguments" | "parameters"}) as a ParsedCall, or null if it is not one. Object arguments
 * keep the text the model wrote (`raw`: the scanned call, see scanToolCalls), as streaming sends it.
 */
function toCall(value: unknown, raw: ScannedCall | undefined): ParsedCall | null {
  if (!isJsonObject(value) || typeof value.name !== 'string' || value.name === '') return null;
  const args = value.arguments ?? value.parameters ?? {};
  if (typeof args === 'string') {
    try {
      JSON.parse(args);
    } catch {
      return null;
    }
    return { name: value.name, arguments: args };
  }
  if (!isJsonObject(args)) return null;
  const text = raw?.argsDone && raw.name === value.name ? raw.args : undefined;
  return { name: value.name, arguments: text ?? JSON.stringify(args) };
}

/** A tool-call object found in (possibly partial) output text. */
export interface ScannedCall {
  /** The name, once its string is complete. */
  name: string | undefined;
  /**
   * The arguments as far as written: an object's text from its '{' as the model wrote it (partial until argsDone),
   * or a string's value once the string is complete.
   */
  args: string;
  argsDone: boolean;
  /** The call object is closed. */
  done: boolean;
}

const ARGUMENT_KEYS = new Set(['arguments', 'parameters']);

/**
 * The tool-call objects in JSON text that may still be growing: the objects at depth 1, or at depth 2 inside a
 * top-level array ("required"'s array, Mistral's list); text between them at depth 0 (tags, separators) is skipped.
 * Scanning a longer text of the same prefix only extends what a shorter one found, so a stream can send each
 * call's name once it is complete and its arguments piece by piece.
 */
export function scanToolCalls(text: string): ScannedCall[] {
  const calls: ScannedCall[] = [];
  const stack: string[] = [];
  let call: ScannedCall | undefined;
  let callDepth = 0;
  /** Within the call object: 'key' (expecting a key), 'colon', 'value' (expecting or inside a value). */
  let expecting: 'key' | 'colon' | 'value' = 'key';
  let key = '';
  let argsStart = -1;
  const n = text.length;
  for (let i = 0; i < n; i++) {
    const c = text[i]!;
    if (c === '"') {
      let end = i + 1;
      while (end < n && text[end] !== '"') end += text[end] === '\\' ? 2 : 1;
      if (end >= n) break; // the string is still being written
      const atMembers = call !== undefined && stack.length === callDepth;
      if (atMembers && expecting === 'key') {
        key = parseJsonString(text.slice(i, end + 1)) ?? '';
        expecting = 'colon';
      } else if (atMembers && expecting === 'value') {
        const value = parseJsonString(text.slice(i, end + 1));
        if (key === 'name' && value !== undefined) call!.name = value;
        else if (ARGUMENT_KEYS.has(key) && value !== undefined) {
          call!.args = value;
          call!.argsDone = true;
        }
      }
      i = end;
      continue;
    }
    if (c === '{' || c === '[') {
      stack.push(c);
      if (call === undefined && c === '{' && (stack.length === 1 || (stack.length === 2 && stack[0] === '['))) {
        call = { name: undefined, args: '', argsDone: false, done: false };
        calls.push(call);
        callDepth = stack.length;
        expecting = 'key';
      } else if (call !== undefined && stack.length === callDepth + 1 && expecting === 'value' && ARGUMENT_KEYS.has(key) && c === '{') {
        argsStart = i;
      }
      continue;
    }
    if (c === '}' || c === ']') {
      stack.pop();
      if (call !== undefined && stack.length === callDepth && argsStart >= 0) {
        call.args = text.slice(argsStart, i + 1);
        call.argsDone = true;
        argsStart = -1;
      } else if (call !== undefined && stack.length === callDepth - 1) {
        call.done = true;
        call = undefined;
      }
      continue;
    }
    if (call !== undefined && stack.length === callDepth) {
      if (c === ':' && expecting === 'colon') expecting = 'value';
      else if (c === ',') expecting = 'key';
    }
  }
  if (call !== undefined && argsStart >= 0) call.args = text.slice(argsStart);
  return calls;
}

/**
 * Mistral's format since its v11 tokenizers: `[TOOL_CALLS]name[ARGS]{arguments}` for each call ([ARGS] a control
 * token a detokenizer may leave out, the name then ending where the arguments object begins), rather than the older
 * `[TOOL_CALLS] [{"name", "arguments"}, ...]`. `text` is what follows the first [TOOL_CALLS].
 */
function isNamedCallsText(text: string): boolean {
  const first = text.trimStart()[0];
  return first !== undefined && first !== '[' && first !== '{';
}

/**
 * The calls of Mistral's name-first format (isNamedCallsText) in text that may still be growing, as scanToolCalls
 * finds them in JSON: a call's name once its arguments object begins, its arguments as far as written up to the
 * object's closing brace (anything after it, up to the next [TOOL_CALLS], is not part of the call).
 */
function scanNamedCalls(text: string): ScannedCall[] {
  const calls: ScannedCall[] = [];
  let at = 0;
  for (;;) {
    const open = text.indexOf('{', at);
    if (open < 0) break;
    const name = text.slice(at, open).replace('[ARGS]', '').trim();
    const end = jsonObjectEnd(text, open);
    const done = end >= 0;
    calls.push({ name: name === '' ? undefined : name, args: text.slice(open, done ? end : undefined), argsDone: done, done });
    if (!done) break;
    const next = text.indexOf(toolCallMarker('mistral'), end);
    if (next < 0) break;
    at = next + toolCallMarker('mistral').length;
  }
  return calls;
}

/** Where the JSON object opening at `open` ends (the index after its closing brace), or -1 while it is still open. */
function jsonObjectEnd(text: string, open: number): number {
  let depth = 0;
  for (let i = open; i < text.length; i++) {
    const c = text[i]!;
    if (c === '"') {
      i++;
      while (i < text.length && text[i] !== '"') i += text[i] === '\\' ? 2 : 1;
    } else if (c === '{' || c === '[') {
      depth++;
    } else if (c === '}' || c === ']') {
      depth--;
      if (depth === 0) return i + 1;
    }
  }
  return -1;
}

/** The calls in the text after a parser's marker, as far as written (scanToolCalls, or Mistral's name-first format). */
function scanCallsAfterMarker(parser: ToolCallParserName, text: string): ScannedCall[] {
  return parser === 'mistral' && isNamedCallsText(text) ? scanNamedCalls(text) : scanToolCalls(text);
}

function parseJsonString(literal: string): string | undefined {
  const value = parseJson(literal);
  return typeof value === 'string' ? value : undefined;
}

function parseJson(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return undefined;
  }
}

/** Tool calls in a complete output; no calls (and the text as content) when it holds none that parse. */
export function parseToolCalls(parser: ToolCallParserName, text: string): ParsedOutput {
  const plain: ParsedOutput = { content: text, calls: [] };
  switch (parser) {
    case 'hermes': {
      const start = text.indexOf('<tool_call>');
      if (start < 0) return plain;
      const calls: ParsedCall[] = [];
      const pattern = /<tool_call>\s*([\s\S]*?)\s*(?:<\/tool_call>|$)/g;
      for (const match of text.slice(start).matchAll(pattern)) {
        const call = toCall(parseJson(match[1]!), scanToolCalls(match[1]!)[0]);
        if (!call) return plain;
        calls.push(call);
      }
      return { content: contentBefore(text, start), calls };
    }
    case 'mistral': {
      const start = text.indexOf('[TOOL_CALLS]');
      if (start < 0) return plain;
      const rest = text.slice(start + '[TOOL_CALLS]'.length).trim();
      if (isNamedCallsText(rest)) {
        // Each call complete and its arguments valid JSON, as the other formats' calls must be to parse.
        const scanned = scanNamedCalls(rest);
        const calls = scanned.map((call) => call.name !== undefined && call.argsDone && isJsonObject(parseJson(call.args))
          ? { name: call.name, arguments: call.args } : null);
        if (calls.length === 0 || calls.some((c) => c === null)) return plain;
        return { content: contentBefore(text, start), calls: calls as ParsedCall[] };
      }
      const value = parseJson(rest);
      const items = Array.isArray(value) ? value : [value];
      const scanned = scanToolCalls(rest);
      const calls = items.map((item, i) => toCall(item, scanned[i]));
      if (calls.length === 0 || calls.some((c) => c === null)) return plain;
      return { content: contentBefore(text, start), calls: calls as ParsedCall[] };
    }
    case 'llama3_json': {
      let body = text.trim();
      if (body.startsWith('<|python_tag|>')) body = body.slice('<|python_tag|>'.length).trim();
      if (!body.startsWith('{')) return plain;
      const calls: ParsedCall[] = [];
      for (const piece of splitJsonObjects(body)) {
        const call = toCall(parseJson(piece), scanToolCalls(piece)[0]);
        if (!call) return plain;
        calls.push(call);
      }
      return calls.length > 0 ? { content: null, calls } : plain;
    }
  }
}

/** The text before the calls, as a stream sends it (untrimmed); null when there is none. */
function contentBefore(text: string, start: number): string | null {
  const content = text.slice(0, start);
  return content === '' ? null : content;
}

/**
 * The calls a stream sends for a finished output whose calls do not all parse (arguments that are not valid JSON, a
 * call object left open): each call whose name is written, with its arguments as the model wrote them, as OpenAI
 * returns arguments that are not valid JSON. Undefined when no call has a name. Where the calls start is where the
 * stream starts scanning for them (ToolChatShape.updateChunks).
 */
function scannedToolCalls(parser: ToolCallParserName, text: string): ParsedOutput | undefined {
  let start: number;
  let from: number;
  const marker = text.indexOf(toolCallMarker(parser));
  if (marker >= 0) {
    start = marker;
    from = marker + toolCallMarker(parser).length;
  } else if (parser === 'llama3_json' && text.trimStart().startsWith('{')) {
    start = 0;
    from = text.indexOf('{');
  } else {
    return undefined;
  }
  const calls = namedCalls(scanCallsAfterMarker(parser, text.slice(from)));
  return calls.length > 0 ? { content: contentBefore(text, start), calls } : undefined;
}

/** The scanned calls a stream has sent: those in order up to the first whose name is not written yet. */
function namedCalls(scanned: readonly ScannedCall[]): ParsedCall[] {
  const calls: ParsedCall[] = [];
  for (const call of scanned) {
    if (call.name === undefined) break;
    calls.push({ name: call.name, arguments: call.args });
  }
  return calls;
}

/** Top-level JSON objects one after another, separated by ';', ',' or whitespace (Llama 3.x's parallel calls). */
function splitJsonObjects(text: string): string[] {
  const pieces: string[] = [];
  let depth = 0;
  let inString = false;
  let escaped = false;
  let start = -1;
  for (let i = 0; i < text.length; i++) {
    const c = text[i]!;
    if (inString) {
      if (escaped) escaped = false;
      else if (c === '\\') escaped = true;
      else if (c === '"') inString = false;
      continue;
    }
    if (c === '"') inString = true;
    else if (c === '{') {
      if (depth === 0) start = i;
      depth++;
    } else if (c === '}') {
      depth--;
      if (depth === 0) pieces.push(text.slice(start, i + 1));
      if (depth < 0) return [text];
    } else if (depth === 0 && !/[\s;,]/.test(c)) {
      return [text];
    }
  }
  if (depth !== 0) return [text];
  return pieces;
}

/** How long a call id Mistral's chat templates take (they refuse any other length). */
const MISTRAL_ID_LENGTH = 9;

/**
 * The messages as a template of the Mistral format takes them: call ids longer than its nine characters (OpenAI's
 * call_..., another server's) cut to their last nine, in the assistant's calls and the tool results alike so that
 * they still pair, as vLLM cuts them for Mistral tokenizers (truncate_tool_call_ids); other messages as they are.
 */
export function mistralToolCallIds<M extends { tool_calls?: { id: string }[]; tool_call_id?: string }>(messages: readonly M[]): M[] {
  const cut = (id: string) => id.length > MISTRAL_ID_LENGTH ? id.slice(-MISTRAL_ID_LENGTH) : id;
  return messages.map((message) => {
    if (message.tool_calls) return { ...message, tool_calls: message.tool_calls.map((call) => ({ ...call, id: cut(call.id) })) };
    if (message.tool_call_id !== undefined) return { ...message, tool_call_id: cut(message.tool_call_id) };
    return message;
  });
}

// ---------------------------------------------------------------------------------------------------------------
// The chat response with tool calls

export interface WireToolCall {
  id: string;
  type: 'function';
  function: { name: string; arguments: string };
}

const ALPHANUMERIC = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789';

/**
 * A call's id, OpenAI's `call_<hex>`; under the Mistral format nine letters and digits, as vLLM's Mistral parser
 * writes them: Mistral's chat templates refuse any other id when the call and its tool result come back in the next
 * request's messages ("Tool call IDs should be alphanumeric strings with length 9!").
 */
export function newToolCallId(parser?: ToolCallParserName): string {
  if (parser === 'mistral') return Array.from({ length: MISTRAL_ID_LENGTH }, () => ALPHANUMERIC[randomInt(ALPHANUMERIC.length)]).join('');
  return `call_${randomBytes(12).toString('hex')}`;
}

type Mode = { kind: 'named'; name: string } | { kind: 'required' } | { kind: 'auto'; parser: ToolCallParserName };

interface ToolChoiceState {
  text: string;
  logprobs: ChatTokenLogprob[] | null;
  finishReason: WireFinishReason | null;
  stopReason: string | number | null;
  /** Streaming: content already sent, and whether the rest is held for parsing. */
  sentContent: number;
  holding: boolean;
  /** Streaming, named: the call's id once its first chunk is out. */
  callId?: string;
  /** Streaming, required and auto: where the calls' JSON starts in text (-1: not yet), and the calls sent so far. */
  callsFrom: number;
  sent: { id: string; name: string; args: string }[];
  /** Streaming: logprobs of tokens whose text is held back (not sent yet), sent with the next chunk. */
  heldLogprobs: ChatTokenLogprob[];
}

/**
 * Chat completions with tools. Named: the output is the arguments (streamed as argument pieces). Required: the
 * output is a JSON array of {name, parameters}. Auto: content streams until the parser's marker appears (text that
 * could begin it is held back), the calls follow it. Required and auto calls stream as OpenAI's do: a call's first
 * delta carries its index, id and name once the name is written, then its arguments come in fragments as written
 * (scanToolCalls); the finished output is parsed at the end, and whatever of the calls had not gone out yet follows.
 * A call's arguments are the text the model wrote, streamed or not. Choices with calls end with finish_reason
 * "tool_calls".
 */
export class ToolChatShape implements ResponseShape {
  private readonly choices: ToolChoiceState[];
  private readonly mode: Mode;
  /**
   * Most calls a choice returns: one with parallel_tool_calls false, whatever the model wrote (vLLM's
   * maybe_filter_parallel_tool_calls: the first call in the body, only index 0's deltas in a stream).
   */
  private readonly maxCalls: number;
  /** The format the model writes calls in, whose templates may hold call ids to a shape of their own. */
  private readonly parser: ToolCallParserName;

  constructor(
    private readonly meta: ChatResponseMeta,
    private readonly choiceCount: number,
    private readonly texts: TokenTexts,
    private readonly topLogprobs: number | null,
    tools: ToolsRequest,
    parser: ToolCallParserName,
  ) {
    const { choice } = tools;
    this.mode = choice.kind === 'named' ? { kind: 'named', name: choice.name }
      : choice.kind === 'required' ? { kind: 'required' } : { kind: 'auto', parser };
    this.maxCalls = tools.parallel ? Infinity : 1;
    this.parser = parser;
    this.choices = Array.from({ length: choiceCount }, () => ({
      text: '', logprobs: topLogprobs === null ? null : [], finishReason: null, stopReason: null, sentContent: 0,
      holding: this.mode.kind !== 'auto', callsFrom: this.mode.kind === 'required' ? 0 : -1, sent: [], heldLogprobs: [],
    }));
  }

  private logprobsOf(update: ChoiceUpdate): ChatTokenLogprob[] | null {
    if (this.topLogprobs === null || !update.logprobs) return null;
    return this.texts.chatLogprobs(update.logprobs, this.topLogprobs);
  }

  /** The calls a finished output holds (as many as the request allows), and its content. */
  private result(text: string): ParsedOutput {
    return this.allowed(this.allCalls(text));
  }

  private allowed(parsed: ParsedOutput): ParsedOutput {
    return parsed.calls.length > this.maxCalls ? { ...parsed, calls: parsed.calls.slice(0, this.maxCalls) } : parsed;
  }

  private allCalls(text: string): ParsedOutput {
    switch (this.mode.kind) {
      case 'named':
        return { content: null, calls: [{ name: this.mode.name, arguments: text }] };
      case 'required': {
        const value = parseJson(text);
        const scanned = scanToolCalls(text);
        const calls = Array.isArray(value) ? value.map((item, i) => toCall(item, scanned[i])) : [];
        if (calls.length === 0 || calls.some((c) => c === null)) return { content: text, calls: [] };
        return { content: null, calls: calls as ParsedCall[] };
      }
      case 'auto': {
        // Calls that do not all parse are still the calls a stream of this output sent, so the body has them too.
        const parsed = parseToolCalls(this.mode.parser, text);
        return parsed.calls.length > 0 ? parsed : scannedToolCalls(this.mode.parser, text) ?? parsed;
      }
    }
  }

  /**
   * The calls (and content) a stream of this finished output sends, for the body to say the same: a complete output's
   * calls; otherwise (cut off by max_tokens or a stop string, or calls that do not parse) the calls as far as the
   * model wrote them, each whose name is written with its arguments as written, as the stream sent them piece by piece.
   */
  private sentCalls(text: string, finishReason: WireFinishReason | null): ParsedOutput {
    if (this.mode.kind === 'named') return text === '' ? NO_CALLS : this.result(text);
    if (finishReason === 'stop') {
      const parsed = this.result(text);
      if (parsed.calls.length > 0) return parsed;
    }
    if (this.mode.kind === 'required') return this.allowed({ content: null, calls: namedCalls(scanToolCalls(text)) });
    return this.allowed(scannedToolCalls(this.mode.parser, text) ?? NO_CALLS);
  }

  /** "tool_calls" for calls the model chose to make ("auto", "required"); a named tool's call ends with "stop", as OpenAI's. */
  private finishReason(reason: WireFinishReason | null, calls: number): WireFinishReason | 'tool_calls' | null {
    return reason === 'stop' && calls > 0 && this.mode.kind !== 'named' ? 'tool_calls' : reason;
  }

  openingChunks(usageOf: ChoiceUsage): object[] {
    return Array.from({ length: this.choiceCount }, (_, index) => chatChunkBody(this.meta,
      [{ index, delta: { role: 'assistant', content: '' }, logprobs: null, finishReason: null }], usageOf(index)));
  }

  updateChunks(update: ChoiceUpdate, usage: WireUsage | null | undefined): object[] {
    const state = this.choices[update.index]!;
    state.text += update.textDelta;
    const chunks: object[] = [];
    const logprobs = this.logprobsOf(update);
    // Every token's logprobs go out once, with the first chunk sent after it (held text waits for parsing, and
    // tool-call pieces carry the logprobs of the tokens that wrote them), as the non-streamed body has them all.
    if (logprobs !== null) state.heldLogprobs.push(...logprobs);
    const takeLogprobs = (): ChatTokenLogprob[] | null => {
      if (logprobs === null && state.heldLogprobs.length === 0) return null;
      const taken = state.heldLogprobs;
      state.heldLogprobs = [];
      return taken;
    };
    const delta = (body: object) => chunks.push(chatChunkBody(this.meta,
      [{ index: update.index, delta: body as never, logprobs: takeLogprobs(), finishReason: null }], usage));
    if (this.mode.kind === 'named') {
      if (update.textDelta) {
        const first = state.callId === undefined;
        state.callId ??= newToolCallId(this.parser);
        delta({ tool_calls: [first
          ? { index: 0, id: state.callId, type: 'function', function: { name: this.mode.name, arguments: update.textDelta } }
          : { index: 0, function: { arguments: update.textDelta } }] });
      } else if (logprobs !== null && logprobs.length > 0) {
        delta({ content: null });
      }
      if (update.finishReason) chunks.push(this.finishChunk(update, state.callId ? 1 : 0, usage));
      return chunks;
    }
    if (this.mode.kind === 'auto' && !state.holding) {
      const marker = toolCallMarker(this.mode.parser);
      const pending = state.text.slice(state.sentContent);
      const at = state.text.indexOf(marker);
      let sendUpTo: number;
      if (at >= 0) {
        state.holding = true;
        state.callsFrom = at + marker.length;
        sendUpTo = at;
      } else if (this.mode.parser === 'llama3_json' && state.text.trimStart().startsWith('{')) {
        state.holding = true;
        state.callsFrom = state.text.indexOf('{');
        sendUpTo = state.sentContent;
      } else {
        sendUpTo = state.text.length - heldSuffix(state.text, marker, this.mode.parser === 'llama3_json');
      }
      if (update.finishReason) sendUpTo = state.holding ? sendUpTo : state.text.length;
      if (sendUpTo > state.sentContent) {
        delta({ content: state.text.slice(state.sentContent, sendUpTo) });
        state.sentContent = sendUpTo;
      } else if (logprobs && logprobs.length > 0 && pending === '') {
        delta({ content: '' });
      }
    }
    // The calls as they are written: each name once complete, then its arguments piece by piece.
    if (state.callsFrom >= 0) {
      const written = state.text.slice(state.callsFrom);
      const scanned = this.mode.kind === 'auto' ? scanCallsAfterMarker(this.mode.parser, written) : scanToolCalls(written);
      for (const piece of this.callPieces(state, scanned)) delta(piece);
    }
    if (update.finishReason) {
      let calls = state.sent.length;
      if (state.holding) {
        const held = state.text.slice(state.sentContent);
        const parsed = update.finishReason === 'stop' ? this.result(this.mode.kind === 'auto' ? state.text : held) : NO_CALLS;
        if (parsed.calls.length === 0) {
          // A cut-off or malformed call: what was not sent as calls goes out as content.
          if (state.sent.length === 0 && held) delta({ content: held });
        } else {
          if (this.mode.kind === 'auto' && parsed.content !== null) {
            const unsent = parsed.content.slice(state.sentContent);
            if (unsent.trim()) delta({ content: unsent });
          }
          const finished = parsed.calls.map((call): ScannedCall => ({ name: call.name, args: call.arguments, argsDone: true, done: true }));
          for (const piece of this.callPieces(state, finished)) delta(piece);
          calls = state.sent.length;
        }
      }
      // Logprobs of held tokens that went out as nothing (a call's closing tag): before the finish.
      if (state.heldLogprobs.length > 0) delta({ content: null });
      chunks.push(this.finishChunk(update, calls, usage));
    }
    return chunks;
  }

  /**
   * The stream pieces that bring the sent calls up to `calls`: a new call's first piece carries its index, id, type
   * and name (OpenAI's shape, arguments ""), later ones an arguments fragment. Calls go out in order, each once its
   * name is known.
   */
  private callPieces(state: ToolChoiceState, calls: readonly ScannedCall[]): object[] {
    const pieces: object[] = [];
    for (let index = 0; index < Math.min(calls.length, this.maxCalls); index++) {
      const call = calls[index]!;
      let sent = state.sent[index];
      if (sent === undefined) {
        if (call.name === undefined || index !== state.sent.length) break;
        sent = { id: newToolCallId(this.parser), name: call.name, args: '' };
        state.sent.push(sent);
        pieces.push({ tool_calls: [{ index, id: sent.id, type: 'function', function: { name: call.name, arguments: '' } }] });
      }
      if (call.args.length > sent.args.length && call.args.startsWith(sent.args)) {
        pieces.push({ tool_calls: [{ index, function: { arguments: call.args.slice(sent.args.length) } }] });
        sent.args = call.args;
      }
    }
    return pieces;
  }

  private finishChunk(update: ChoiceUpdate, calls: number, usage: WireUsage | null | undefined): object {
    return chatChunkBody(this.meta, [{
      index: update.index, delta: {}, logprobs: null,
      finishReason: this.finishReason(update.finishReason, calls) as WireFinishReason, stopReason: update.stopReason,
    }], usage);
  }

  usageChunk(usage: WireUsage): object {
    return chatChunkBody(this.meta, [], usage);
  }

  collect(update: ChoiceUpdate): void {
    collectChatUpdate(this.choices[update.index]!, update, this.logprobsOf(update));
  }

  body(usage: WireUsage): object {
    const body = chatCompletionBody(this.meta, this.choices.map((choice, index) => ({
      index, text: choice.text, logprobs: choice.logprobs, finishReason: choice.finishReason, stopReason: choice.stopReason,
    })), usage) as { choices: { message: Record<string, unknown>; finish_reason: string | null }[] };
    body.choices.forEach((wire, index) => {
      const choice = this.choices[index]!;
      // Without a call written, the text is the content, as the model wrote it.
      const parsed = this.sentCalls(choice.text, choice.finishReason);
      if (parsed.calls.length === 0) return;
      wire.message.content = parsed.content;
      wire.message.tool_calls = parsed.calls.map((call) => ({
        id: newToolCallId(this.parser), type: 'function', function: { name: call.name, arguments: call.arguments },
      } satisfies WireToolCall));
      wire.finish_reason = this.finishReason(choice.finishReason, parsed.calls.length)!;
    });
    return body;
  }
}

/** How much of the end of `text` could be the start of `marker` (held back from the stream until decided). */
function heldSuffix(text: string, marker: string, alsoBrace: boolean): number {
  for (let length = Math.min(marker.length - 1, text.length); length > 0; length--) {
    if (marker.startsWith(text.slice(text.length - length))) return length;
  }
  return alsoBrace && text.trim() === '' ? text.length : 0;
}

