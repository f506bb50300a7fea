// Chat templates: OpenAI-style messages rendered to the prompt text a model was trained on, with the model's own
// Jinja template (GGUF `tokenizer.chat_template`, or tokenizer_config.json's `chat_template`) run by
// @huggingface/jinja.
//
// Rendering context, as Hugging Face transformers provides it: messages, add_generation_prompt, bos_token,
// eos_token, tools (when the request has any), raise_exception(message), strftime_now(format), plus any extra
// variables the caller passes (e.g. enable_thinking).

import { parse, Template, tokenize } from '@huggingface/jinja';
import type { GgufFile } from './gguf.ts';
import { metaString } from './gguf.ts';
import type { Tokenizer } from './tokenizer/types.ts';
import { parseJsonExactNumbers, renderExact, TemplateStepBudgetExceeded } from './template-values.ts';

// ---------------------------------------------------------------------------------------------------------------
// Messages

export type ChatRole = 'system' | 'developer' | 'user' | 'assistant' | 'tool';
const ROLES: ReadonlySet<string> = new Set<ChatRole>(['system', 'developer', 'user', 'assistant', 'tool']);

export interface ChatTextPart { type: 'text'; text: string }
/** Any other part type (image_url, input_audio ...) is refused: Conduit serves text-only models. */
export type ChatContentPart = ChatTextPart | { type: string; [key: string]: unknown };

export interface ChatToolCall {
  id?: string;
  type?: 'function';
  /** OpenAI sends `arguments` as a JSON string; templates get it parsed (see normalizeMessages). */
  function: { name: string; arguments: string | Record<string, unknown> };
}

export interface ChatMessage {
  role: ChatRole;
  content?: string | ChatContentPart[] | null;
  name?: string;
  tool_calls?: ChatToolCall[];
  tool_call_id?: string;
}

export interface RenderOptions {
  /** End with the header of an assistant turn so the model writes the reply. Default true. */
  addGenerationPrompt?: boolean;
  /** OpenAI `tools`, passed to the template unchanged. */
  tools?: readonly unknown[];
  /** Which named template to use; by default "tool_use" when tools are given and it exists, else "default". */
  templateName?: string;
  /** More template variables (chat_template_kwargs), e.g. { enable_thinking: false }. */
  variables?: Record<string, unknown>;
}

// ---------------------------------------------------------------------------------------------------------------
// Errors

/**
 * A prompt that cannot be rendered. `status` 400 means the request's messages were refused (the template called
 * raise_exception, or a message has an unknown role or a non-text part): report it to the client. `status` 500
 * means the model's template itself is broken.
 */
export class ChatTemplateError extends Error {
  override name = 'ChatTemplateError';
  constructor(
    message: string,
    readonly code: 'invalid_messages' | 'template_rejected_messages' | 'template_render_failed' | 'invalid_template',
    readonly status: 400 | 500,
  ) {
    super(message);
  }
}

/** Thrown from inside a template by raise_exception, so it can be told apart from the template's own bugs. */
class RaisedByTemplate extends Error {}

/**
 * @huggingface/jinja declares its own raise_exception, which throws a plain Error that looks like any other
 * rendering failure, and it refuses to let the context redeclare the name. So calls to raise_exception are routed,
 * at the token level (never inside string literals), to a function of ours under this name.
 */
const RAISE_EXCEPTION = '__conduit_raise_exception';

/**
 * range() is routed the same way, to a bounded one: the library's builds the whole list, 4 microseconds a number, on
 * the gateway's thread, so a model's template with `range(1000000000)` would stall every request (or exhaust the
 * heap). Real templates count messages or a few positions.
 */
const RANGE = '__conduit_range';

/** How many numbers all the range() calls of one rendering may produce together (a fraction of a second). */
export const TEMPLATE_RANGE_BUDGET = 100_000;

/** Thrown by the bounded range(): the model's template, not the request, is at fault. */
class RangeBudgetExceeded extends Error {}

function compile(text: string): Template {
  const tokens = tokenize(text, { lstrip_blocks: true, trim_blocks: true }); // the options Template uses
  for (let i = 0; i < tokens.length; i++) {
    const token = tokens[i]!;
    if (token.type !== 'Identifier' || tokens[i - 1]?.type === 'Dot') continue; // x.range is an attribute
    if (token.value === 'raise_exception') token.value = RAISE_EXCEPTION;
    else if (token.value === 'range') token.value = RANGE;
  }
  // The text is tokenized once: the library's lexer takes time quadratic in a long run of whitespace (its
  // {% generation %} preprocessing), so a Template built from the text would pay that a second time.
  const template = new Template('');
  template.parsed = parse(tokens);
  return template;
}

/** Jinja's range(stop) / range(start, stop[, step]), producing at most `budget.left` numbers over a rendering. */
function boundedRange(budget: { left: number }): (...args: unknown[]) => number[] {
  return (...args: unknown[]) => {
    const numbers = args.map(Number);
    const [start, stop, step = 1] = numbers.length === 1 ? [0, numbers[0]!] : numbers as [number, number, number?];
    if (!numbers.every(Number.isFinite) || numbers.length < 1 || numbers.length > 3) {
      throw new Error(`range() takes one to three numbers, got ${args.map((a) => JSON.stringify(a)).join(', ')}`);
    }
    if (step === 0) throw new Error('range() step must not be zero');
    const count = Math.max(0, Math.ceil((stop! - start!) / step));
    if (count > budget.left) {
      throw new RangeBudgetExceeded(`the model's chat template asks range() for ${count} numbers, more than the ` +
        `${TEMPLATE_RANGE_BUDGET} a rendering may produce`);
    }
    budget.left -= count;
    return Array.from({ length: count }, (_, i) => start! + i * step);
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Content format

/**
 * How a template takes message content, as vLLM decides it: "openai" when it loops over a message's content (Gemma 3,
 * Llama 4, vision models' templates: `{% for item in message['content'] %}`), which then gets the list of parts
 * (`{type: "text", text}`; a string content becomes one part, none an empty list); else "string", the text parts
 * joined with "\n".
 */
export type ContentFormat = 'string' | 'openai';

interface AstNode { type: string; [key: string]: unknown }

function astNodes(root: unknown): AstNode[] {
  const found: AstNode[] = [];
  const visit = (value: unknown, depth: number): void => {
    if (depth > 2000 || typeof value !== 'object' || value === null) return;
    if (Array.isArray(value)) { for (const item of value) visit(item, depth + 1); return; }
    if (typeof (value as AstNode).type === 'string') found.push(value as AstNode);
    for (const child of Object.values(value)) visit(child, depth + 1);
  };
  visit(root, 0);
  return found;
}

const isName = (node: unknown, name: string): boolean =>
  (node as AstNode | undefined)?.type === 'Identifier' && (node as AstNode).value === name;

/** `name.key` or `name['key']`. */
function isMember(node: AstNode, name: string, key: string): boolean {
  if (node.type !== 'MemberExpression' || !isName(node.object, name)) return false;
  const property = node.property as AstNode;
  return node.computed ? property.type === 'StringLiteral' && property.value === key : isName(property, key);
}

/** vLLM's _is_var_or_elems_access: the variable (or its `key`), possibly filtered, tested or sliced. */
function isVarOrElements(node: AstNode | undefined, name: string, key?: string): boolean {
  if (!node) return false;
  if (node.type === 'FilterExpression' || node.type === 'TestExpression') return isVarOrElements(node.operand as AstNode, name, key);
  if (node.type === 'MemberExpression' && node.computed && (node.property as AstNode).type === 'SliceExpression') {
    return isVarOrElements(node.object as AstNode, name, key);
  }
  return key !== undefined ? isMember(node, name, key) : isName(node, name);
}

/** Whether a template loops over a message's content (vLLM's _detect_content_format). */
function detectContentFormat(program: unknown): ContentFormat {
  const nodes = astNodes(program);
  const loops = nodes.filter((node) => node.type === 'For');
  // `messages` and the variables set from it ({% set loop_messages = messages[1:] %}).
  const messagesNames = ['messages'];
  for (let i = 0; i < messagesNames.length; i++) {
    for (const set of nodes) {
      if (set.type !== 'Set' || (set.assignee as AstNode).type !== 'Identifier') continue;
      const target = (set.assignee as AstNode).value as string;
      if (isVarOrElements(set.value as AstNode, messagesNames[i]!) && !messagesNames.includes(target)) messagesNames.push(target);
    }
  }
  const messageNames = loops.filter((loop) => messagesNames.some((name) => isVarOrElements(loop.iterable as AstNode, name)))
    .map((loop) => (loop.loopvar as AstNode).type === 'Identifier' ? (loop.loopvar as AstNode).value as string : undefined)
    .filter((name): name is string => name !== undefined);
  return loops.some((loop) => messageNames.some((name) => isVarOrElements(loop.iterable as AstNode, name, 'content')))
    ? 'openai' : 'string';
}

// ---------------------------------------------------------------------------------------------------------------
// The fallback

/**
 * The template used when a model brings none: one "role: content" paragraph per message and, for the
 * generation prompt, a final "assistant:" line. Plain text, so it works with any vocabulary, including base models
 * that never saw a chat format:
 *
 *     system: You are terse.
 *
 *     user: Hi!
 *
 *     assistant:
 */
export const FALLBACK_CHAT_TEMPLATE =
  '{% for message in messages %}{{ message.role }}: {{ message.content }}\n\n{% endfor %}' +
  '{% if add_generation_prompt %}assistant:{% endif %}';

/**
 * The fallback for a tokenizer that adds BOS to the texts it encodes (add_bos_token, as Llama 2's): chat prompts are
 * encoded without the tokenizer's own special tokens (a real template writes {{ bos_token }} itself), so this one
 * does, and a base model reads chat prompts as it reads completions prompts, after BOS.
 */
export const FALLBACK_CHAT_TEMPLATE_WITH_BOS = '{{ bos_token }}' + FALLBACK_CHAT_TEMPLATE;

/** The fallback template for a tokenizer: with BOS when the tokenizer adds one to a text. */
function fallbackChatTemplate(tokenizer: Tokenizer | undefined, bosToken: string | undefined, eosToken: string | undefined): ChatTemplate {
  const bos = tokenizer?.bosId;
  const addsBos = bos !== undefined && !!bosToken && tokenizer!.encode('x', { addSpecialTokens: true })[0] === bos;
  return new ChatTemplate({ templates: addsBos ? FALLBACK_CHAT_TEMPLATE_WITH_BOS : FALLBACK_CHAT_TEMPLATE, bosToken, eosToken }, true);
}

// ---------------------------------------------------------------------------------------------------------------
// The template

export interface ChatTemplateSource {
  /** One template, or named ones (the tokenizer_config list form; "default" is used unless told otherwise). */
  templates: string | ReadonlyMap<string, string>;
  bosToken?: string;
  eosToken?: string;
}

export class ChatTemplate {
  /** True when the model had no template and FALLBACK_CHAT_TEMPLATE is used. */
  readonly isFallback: boolean;
  readonly bosToken: string;
  readonly eosToken: string;
  /** What the template was built from (a frontend rebuilds a worker's template from it). */
  readonly source: ChatTemplateSource;
  private readonly compiled = new Map<string, Template>();
  private readonly contentFormats = new Map<Template, ContentFormat>();
  /** Every named template's text, joined (what a tool-call format is recognised from). */
  readonly sourceText: string;

  constructor(source: ChatTemplateSource, isFallback = false) {
    this.isFallback = isFallback;
    this.source = source;
    this.bosToken = source.bosToken ?? '';
    this.eosToken = source.eosToken ?? '';
    const named = typeof source.templates === 'string' ? new Map([['default', source.templates]]) : source.templates;
    if (named.size === 0) throw new ChatTemplateError('no chat template given', 'invalid_template', 500);
    this.sourceText = [...named.values()].join('\n');
    for (const [name, text] of named) {
      try {
        const compiled = compile(text);
        this.compiled.set(name, compiled);
        this.contentFormats.set(compiled, detectContentFormat(compiled.parsed));
      } catch (error) {
        throw new ChatTemplateError(`chat template "${name}" does not parse: ${(error as Error).message}`,
          'invalid_template', 500);
      }
    }
  }

  get templateNames(): string[] { return [...this.compiled.keys()]; }

  /** How the template that these options choose takes message content. */
  contentFormat(options: RenderOptions = {}): ContentFormat { return this.contentFormats.get(this.choose(options))!; }

  /** Another template (--chat-template) with this one's special tokens. */
  withTemplate(text: string): ChatTemplate {
    return new ChatTemplate({ templates: text, bosToken: this.bosToken, eosToken: this.eosToken });
  }

  render(messages: readonly ChatMessage[], options: RenderOptions = {}): string {
    const template = this.choose(options);
    const context: Record<string, unknown> = {
      ...options.variables,
      messages: normalizeMessages(messages, this.contentFormats.get(template)),
      add_generation_prompt: options.addGenerationPrompt ?? true,
      bos_token: this.bosToken,
      eos_token: this.eosToken,
      [RAISE_EXCEPTION]: (message: unknown) => { throw new RaisedByTemplate(String(message)); },
      [RANGE]: boundedRange({ left: TEMPLATE_RANGE_BUDGET }),
    };
    if (options.tools !== undefined && options.tools.length > 0) context.tools = options.tools;
    try {
      return renderExact(template.parsed, context);
    } catch (error) {
      if (error instanceof RaisedByTemplate) {
        throw new ChatTemplateError(`the model's chat template refused these messages: ${error.message}`,
          'template_rejected_messages', 400);
      }
      if (error instanceof RangeBudgetExceeded) throw new ChatTemplateError(error.message, 'template_render_failed', 500);
      // The template's steps grow with the messages: too many of them for it is the request's 400.
      if (error instanceof TemplateStepBudgetExceeded) throw new ChatTemplateError(error.message, 'template_render_failed', 400);
      throw new ChatTemplateError(`rendering the chat template failed: ${(error as Error).message}`,
        'template_render_failed', 400);
    }
  }

  private choose(options: RenderOptions): Template {
    if (options.templateName !== undefined) {
      const chosen = this.compiled.get(options.templateName);
      if (!chosen) {
        throw new ChatTemplateError(`no chat template named "${options.templateName}" (have: ` +
          `${this.templateNames.join(', ')})`, 'invalid_messages', 400);
      }
      return chosen;
    }
    if (options.tools?.length && this.compiled.has('tool_use')) return this.compiled.get('tool_use')!;
    return this.compiled.get('default') ?? this.compiled.values().next().value!;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Message normalisation

/**
 * What templates expect: content as one string (text parts joined with "\n"; null or missing becomes ""), or for a
 * template that loops over content the list of text parts (see ContentFormat), and tool
 * call arguments as objects (templates write them with `| tojson`), their numbers printing as the client wrote them,
 * as Python's json reads them (see template-values.ts); empty arguments ("" or "null") and a string that is not JSON
 * are {}, as vLLM passes them.
 */
export function normalizeMessages(messages: readonly ChatMessage[], format: ContentFormat = 'string'): Record<string, unknown>[] {
  if (!Array.isArray(messages as unknown)) {
    throw new ChatTemplateError('messages must be an array', 'invalid_messages', 400);
  }
  return messages.map((message, index) => {
    if (typeof message !== 'object' || message === null) {
      throw new ChatTemplateError(`messages[${index}] is not an object`, 'invalid_messages', 400);
    }
    if (!ROLES.has(message.role)) {
      throw new ChatTemplateError(`messages[${index}] has role ${JSON.stringify(message.role)}; expected one of ` +
        [...ROLES].join(', '), 'invalid_messages', 400);
    }
    const text = contentText(message.content, index); // checks the parts, in either format
    const out: Record<string, unknown> = { ...message, content: format === 'string' ? text : contentParts(message.content) };
    if (message.tool_calls) {
      out.tool_calls = message.tool_calls.map((call) => ({
        ...call,
        function: { ...call.function, arguments: parseArguments(call.function?.arguments) },
      }));
    }
    return out;
  });
}

function contentText(content: ChatMessage['content'], index: number): string {
  if (content === undefined || content === null) return '';
  if (typeof content === 'string') return content;
  if (!Array.isArray(content)) {
    throw new ChatTemplateError(`messages[${index}].content must be a string or an array of parts`,
      'invalid_messages', 400);
  }
  return content.map((part, partIndex) => {
    if (part?.type !== 'text' || typeof part.text !== 'string') {
      throw new ChatTemplateError(`messages[${index}].content[${partIndex}] has type ${JSON.stringify(part?.type)};` +
        ' only text parts are supported', 'invalid_messages', 400);
    }
    return part.text;
  }).join('\n');
}

/** Content as the list of text parts an "openai" format template loops over, as vLLM hands it. */
function contentParts(content: ChatMessage['content']): ChatTextPart[] {
  if (content === undefined || content === null) return [];
  if (typeof content === 'string') return [{ type: 'text', text: content }];
  return content.map((part) => ({ type: 'text', text: (part as ChatTextPart).text }));
}

function parseArguments(value: unknown): unknown {
  if (typeof value !== 'string') return value;
  // vLLM hands templates {} for arguments "" (a call without parameters, as some clients send it) and "null", and for
  // text that is not JSON: a call the model cut off (at max_tokens) stays in the conversation the client replays, and
  // a template that walks the arguments' items would refuse every later turn, as the raw string it was before.
  if (value.trim() === '') return {};
  try {
    return parseJsonExactNumbers(value) ?? {};
  } catch {
    return {};
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Where templates come from

function tokenTextOf(tokenizer: Tokenizer | undefined, id: number | undefined): string | undefined {
  return tokenizer && id !== undefined ? tokenizer.idToToken(id) : undefined;
}

/**
 * The GGUF's template(s): `tokenizer.chat_template` is "default"; `tokenizer.chat_templates` lists more names, each
 * stored as `tokenizer.chat_template.<name>`. BOS/EOS texts come from the tokenizer. No template: the fallback.
 */
export function chatTemplateFromGguf(file: GgufFile, tokenizer?: Tokenizer): ChatTemplate {
  const templates = new Map<string, string>();
  const main = metaString(file, 'tokenizer.chat_template');
  if (main !== undefined) templates.set('default', main);
  const names = file.metadata.get('tokenizer.chat_templates');
  if (Array.isArray(names)) {
    for (const name of names) {
      const text = typeof name === 'string' ? metaString(file, `tokenizer.chat_template.${name}`) : undefined;
      if (text !== undefined) templates.set(name as string, text);
    }
  }
  const bosToken = tokenTextOf(tokenizer, tokenizer?.bosId);
  const eosToken = tokenTextOf(tokenizer, tokenizer?.eosId);
  if (templates.size === 0) return fallbackChatTemplate(tokenizer, bosToken, eosToken);
  return new ChatTemplate({ templates, bosToken, eosToken });
}

function configTokenText(value: unknown): string | undefined {
  if (typeof value === 'string') return value;
  if (typeof value === 'object' && value !== null && typeof (value as { content?: unknown }).content === 'string') {
    return (value as { content: string }).content;
  }
  return undefined;
}

/**
 * tokenizer_config.json's `chat_template`: a string, or a list of { name, template }. BOS/EOS texts come from the
 * config's bos_token / eos_token (a string or an AddedToken object), else from the tokenizer. No template: the
 * fallback.
 */
export function chatTemplateFromConfig(config: Record<string, unknown>, tokenizer?: Tokenizer): ChatTemplate {
  const bosToken = configTokenText(config.bos_token) ?? tokenTextOf(tokenizer, tokenizer?.bosId);
  const eosToken = configTokenText(config.eos_token) ?? tokenTextOf(tokenizer, tokenizer?.eosId);
  const raw = config.chat_template;
  if (raw === undefined || raw === null) {
    return fallbackChatTemplate(tokenizer, bosToken, eosToken);
  }
  if (typeof raw === 'string') return new ChatTemplate({ templates: raw, bosToken, eosToken });
  if (Array.isArray(raw)) {
    const templates = new Map<string, string>();
    for (const entry of raw) {
      const { name, template } = (entry ?? {}) as { name?: unknown; template?: unknown };
      if (typeof name !== 'string' || typeof template !== 'string') {
        throw new ChatTemplateError('chat_template list entries must be { name, template } strings',
          'invalid_template', 500);
      }
      templates.set(name, template);
    }
    return new ChatTemplate({ templates, bosToken, eosToken });
  }
  throw new ChatTemplateError('chat_template must be a string or a list of { name, template }',
    'invalid_template', 500);
}

// ---------------------------------------------------------------------------------------------------------------
// Prompt ids

/**
 * Renders the messages and encodes the text with special tokens parsed. Templates that write bos_token themselves
 * (Llama 2 and 3 do) would otherwise get a second BOS from the tokenizer: one is dropped.
 */
export function encodeChatPrompt(template: ChatTemplate, tokenizer: Tokenizer, messages: readonly ChatMessage[],
  options: RenderOptions = {}): { text: string; ids: number[] } {
  const text = template.render(messages, options);
  const ids = tokenizer.encode(text, { parseSpecial: true });
  const bos = tokenizer.bosId;
  if (bos !== undefined && ids.length >= 2 && ids[0] === bos && ids[1] === bos && template.bosToken !== '' &&
    text.startsWith(template.bosToken)) {
    ids.shift();
  }
  return { text, ids };
}
