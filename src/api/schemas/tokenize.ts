// POST /tokenize and POST /detokenize (vLLM's utility endpoints).

import { InvalidValueError } from '../errors.ts';
import { childPath, Fields, readObject, type JsonObject } from '../validate.ts';
import { parseChatCompletionRequest, type ChatMessage } from './chat.ts';
import { shareBodyText } from '../../model/template-values.ts';
import { readTokenId, type ValidationContext } from './generation.ts';

/** vLLM's return_token_strs: the answer lists each token's vocabulary entry too (`token_strs`). */
interface TokenizeOutput {
  returnTokenStrs: boolean;
}

export type TokenizeRequest = TokenizeOutput & (
  | { kind: 'prompt'; model?: string; prompt: string; addSpecialTokens: boolean }
  | {
    kind: 'messages'; model?: string; messages: ChatMessage[]; addGenerationPrompt: boolean; continueFinalMessage: boolean;
    /** As on /v1/chat/completions: default false. */
    addSpecialTokens: boolean;
    chatTemplateKwargs?: JsonObject;
    /** The tools as sent: the chat template renders them, as for /v1/chat/completions. */
    tools?: readonly unknown[];
  });

export interface DetokenizeRequest {
  model?: string;
  tokens: number[];
}

export function parseTokenizeRequest(body: unknown, context: ValidationContext): TokenizeRequest {
  const fields = new Fields(readObject('body', body));
  const model = fields.string('model');
  const returnTokenStrs = fields.boolean('return_token_strs') ?? false;
  const hasPrompt = fields.has('prompt');
  const hasMessages = fields.has('messages');
  if (hasPrompt === hasMessages) {
    throw new InvalidValueError(hasPrompt ? 'messages' : 'prompt', 'send exactly one of prompt or messages.');
  }
  if (hasPrompt) {
    return {
      kind: 'prompt',
      returnTokenStrs,
      ...(model !== undefined ? { model } : {}),
      prompt: fields.string('prompt')!,
      addSpecialTokens: fields.boolean('add_special_tokens') ?? true,
    };
  }
  // Messages get exactly the treatment /v1/chat/completions gives them, so the counts agree.
  const chatBody = { messages: fields.raw('messages'), add_generation_prompt: fields.raw('add_generation_prompt'),
    continue_final_message: fields.raw('continue_final_message'), chat_template_kwargs: fields.raw('chat_template_kwargs'),
    add_special_tokens: fields.raw('add_special_tokens'),
    documents: fields.raw('documents'), reasoning_effort: fields.raw('reasoning_effort'), tools: fields.raw('tools') };
  shareBodyText(body, chatBody); // its template fields read exactly, as the chat request's are
  const chat = parseChatCompletionRequest(chatBody, context);
  return {
    kind: 'messages',
    returnTokenStrs,
    ...(model !== undefined ? { model } : {}),
    messages: chat.messages,
    addGenerationPrompt: chat.addGenerationPrompt,
    continueFinalMessage: chat.continueFinalMessage,
    addSpecialTokens: chat.addSpecialTokens,
    ...(chat.chatTemplateKwargs ? { chatTemplateKwargs: chat.chatTemplateKwargs } : {}),
    ...(chat.tools ? { tools: chat.tools.raw } : {}),
  };
}

/**
 * Token ids one /detokenize decodes, in contexts of the model: some 16 contexts, as many as the text /tokenize takes
 * (WHOLE_TEXT_BYTES_PER_TOKEN) holds at about 4 bytes a token. Decoding runs on the event loop, so without a bound a
 * body of a million ids stalled every other client for most of a second.
 */
export const MAX_DETOKENIZE_CONTEXTS = 16;

/** `maxModelLen`: the context length of the model the request names, which bounds how many ids it may send. */
export function parseDetokenizeRequest(body: unknown, context: ValidationContext, maxModelLen: number): DetokenizeRequest {
  const fields = new Fields(readObject('body', body));
  fields.required('tokens');
  const ids = fields.array('tokens')!;
  const maxIds = MAX_DETOKENIZE_CONTEXTS * maxModelLen;
  if (ids.length > maxIds) {
    throw new InvalidValueError('tokens', `/detokenize decodes at most ${maxIds} token ids (${MAX_DETOKENIZE_CONTEXTS} `
      + `times this model's ${maxModelLen}-token context), got ${ids.length}.`);
  }
  const tokens = ids.map((id, i) => readTokenId(childPath('tokens', i), id, context));
  const model = fields.string('model');
  return { ...(model !== undefined ? { model } : {}), tokens };
}
