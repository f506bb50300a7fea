// How a run's events become OpenAI bodies and stream chunks, for chat and for legacy completions. A shape keeps the
// per-choice state its format needs (text so far, logprob offsets); the consumers in respond.ts drive it.

import type { TokenLogprob } from '../engine/types.ts';
import type { SseStyle } from './sse.ts';
import {
  appendCompletionLogprobs, chatChunkBody, chatCompletionBody, codePointLength, completionBody, type ChatResponseMeta,
  type ChatTokenLogprob, type CompletionLogprobs, type TokenTexts, type WireFinishReason, type WirePromptLogprobs, type WireUsage,
} from './openai-format.ts';

/** One output of one choice, already mapped to the wire's choice index. */
export interface ChoiceUpdate {
  index: number;
  textDelta: string;
  logprobs: readonly TokenLogprob[] | undefined;
  /** On the choice's first update when the request asked for prompt logprobs: one entry per prompt token. */
  promptLogprobs?: readonly (TokenLogprob | null)[] | undefined;
  finishReason: WireFinishReason | null;
  stopReason: string | number | null;
  /** Output tokens the update adds (some show no text yet: held back for a stop string or a split character). */
  tokens: number;
  /** Their ids, in order (vLLM's return_token_ids shows them); absent where no shape needs them. */
  tokenIds?: readonly number[];
}

/** The usage one choice's chunk carries (null or undefined: none, as stream_options asks). */
export type ChoiceUsage = (choiceIndex: number) => WireUsage | null | undefined;

export interface ResponseShape {
  /**
   * Chunks sent as soon as the stream opens. usageOf gives the usage a choice's chunk carries: its own prompt's (a
   * completions request may have several prompts), none generated yet.
   */
  openingChunks(usageOf: ChoiceUsage): object[];
  /** Chunks for one update (none when it carries nothing to show). */
  updateChunks(update: ChoiceUpdate, usage: WireUsage | null | undefined): object[];
  /** The closing chunk with empty choices that stream_options.include_usage asks for. */
  usageChunk(usage: WireUsage): object;
  /** Records an update for the non-streamed body. */
  collect(update: ChoiceUpdate): void;
  body(usage: WireUsage): object;
  /** How the stream frames its events, when not as chat completions do (sse.ts). */
  readonly sseStyle?: SseStyle;
}

export interface CollectedChoice<L> {
  text: string;
  logprobs: L | null;
  finishReason: WireFinishReason | null;
  stopReason: string | number | null;
}

/** A chat choice's non-streamed answer takes one update: its text, its tokens' logprobs, how it finished. */
export function collectChatUpdate(choice: CollectedChoice<ChatTokenLogprob[]>, update: ChoiceUpdate,
  logprobs: ChatTokenLogprob[] | null): void {
  choice.text += update.textDelta;
  if (logprobs) choice.logprobs!.push(...logprobs);
  if (update.finishReason) {
    choice.finishReason = update.finishReason;
    choice.stopReason = update.stopReason;
  }
}

export class ChatShape implements ResponseShape {
  private readonly choices: CollectedChoice<ChatTokenLogprob[]>[];

  constructor(
    private readonly meta: ChatResponseMeta,
    private readonly choiceCount: number,
    private readonly texts: TokenTexts,
    /** Alternatives per token, or null when logprobs are off. */
    private readonly topLogprobs: number | null,
  ) {
    this.choices = Array.from({ length: choiceCount }, () => ({
      text: '', logprobs: topLogprobs === null ? null : [], finishReason: null, stopReason: null,
    }));
  }

  private logprobsOf(update: ChoiceUpdate): ChatTokenLogprob[] | null {
    if (this.topLogprobs === null || !update.logprobs) return null;
    return this.texts.chatLogprobs(update.logprobs, this.topLogprobs);
  }

  openingChunks(usageOf: ChoiceUsage): object[] {
    // Like OpenAI, every choice's first chunk names the role and carries no text yet.
    return Array.from({ length: this.choiceCount }, (_, index) => chatChunkBody(this.meta,
      [{ index, delta: { role: 'assistant', content: '' }, logprobs: null, finishReason: null }], usageOf(index)));
  }

  updateChunks(update: ChoiceUpdate, usage: WireUsage | null | undefined): object[] {
    const chunks: object[] = [];
    const logprobs = this.logprobsOf(update);
    if (update.textDelta || (logprobs && logprobs.length > 0)) {
      chunks.push(chatChunkBody(this.meta,
        [{ index: update.index, delta: { content: update.textDelta }, logprobs, finishReason: null }], usage));
    }
    if (update.finishReason) {
      chunks.push(chatChunkBody(this.meta, [{
        index: update.index, delta: {}, logprobs: null, finishReason: update.finishReason, stopReason: update.stopReason,
      }], usage));
    }
    return chunks;
  }

  usageChunk(usage: WireUsage): object {
    return chatChunkBody(this.meta, [], usage);
  }

  collect(update: ChoiceUpdate): void {
    collectChatUpdate(this.choices[update.index]!, update, this.logprobsOf(update));
  }

  body(usage: WireUsage): object {
    return chatCompletionBody(this.meta, this.choices.map((choice, index) => ({ index, ...choice })), usage);
  }
}

export class CompletionShape implements ResponseShape {
  private readonly choices: CollectedChoice<CompletionLogprobs>[];
  /** Characters (code points) of text each choice has produced so far: where its next token's text_offset starts. */
  private readonly offsets: number[];

  constructor(
    private readonly meta: ChatResponseMeta,
    choiceCount: number,
    private readonly texts: TokenTexts,
    private readonly logprobs: number | null,
    /** Echoed prompt text per choice (empty when echo is off). */
    private readonly echoTexts: readonly string[],
    /**
     * With echo and logprobs, each choice's prompt token ids: its logprobs then start with the prompt's (from the
     * choice's first update, which also carries the echoed text when streamed). Empty otherwise.
     */
    private readonly echoPromptTokenIds: readonly (readonly number[])[] = [],
    /** echo with max_tokens 0: each choice shows its prompt only (the token the engine sampled is left out). */
    private readonly promptOnly = false,
  ) {
    this.choices = Array.from({ length: choiceCount }, (_, index) => ({
      text: echoTexts[index] ?? '', logprobs: null, finishReason: null, stopReason: null,
    }));
    this.offsets = this.choices.map((choice) => codePointLength(choice.text));
  }

  /** Whether this update opens a choice whose echoed prompt shows logprobs (it carries them, and the echo text). */
  private echoesPromptLogprobs(update: ChoiceUpdate): boolean {
    return this.echoPromptTokenIds.length > 0 && update.promptLogprobs !== undefined;
  }

  private logprobsOf(update: ChoiceUpdate): CompletionLogprobs | null {
    if (this.logprobs === null) return null;
    let prompt: CompletionLogprobs | null = null;
    if (this.echoesPromptLogprobs(update)) {
      prompt = this.texts.completionLogprobs(update.promptLogprobs!, this.logprobs, 0, this.echoPromptTokenIds[update.index]);
      // As vLLM: with the prompt's tokens listed, offsets run over the listed tokens' texts (a special token such as
      // <s> has text there but none in the echo), so the output's tokens continue after the prompt's.
      this.offsets[update.index] = prompt.tokens.reduce((offset, token) => offset + codePointLength(token), 0);
    }
    if (!update.logprobs || this.promptOnly) return prompt;
    const result = this.texts.completionLogprobs(update.logprobs, this.logprobs, this.offsets[update.index]!);
    this.offsets[update.index] = result.tokens.reduce((offset, token) => offset + codePointLength(token), this.offsets[update.index]!);
    if (prompt === null) return result;
    appendCompletionLogprobs(prompt, result);
    return prompt;
  }

  private chunk(choice: CollectedChoice<CompletionLogprobs> & { index: number }, usage: WireUsage | null | undefined): object {
    return completionBody(this.meta, [choice], usage);
  }

  openingChunks(usageOf: ChoiceUsage): object[] {
    // An echo with logprobs goes out with the choice's first update, together with the prompt's logprobs.
    if (this.echoPromptTokenIds.length > 0) return [];
    return this.echoTexts
      .map((text, index) => ({ text, index }))
      .filter(({ text }) => text.length > 0)
      .map(({ text, index }) => this.chunk({ index, text, logprobs: null, finishReason: null, stopReason: null }, usageOf(index)));
  }

  updateChunks(update: ChoiceUpdate, usage: WireUsage | null | undefined): object[] {
    const logprobs = this.logprobsOf(update);
    const text = (this.echoesPromptLogprobs(update) ? this.echoTexts[update.index] ?? '' : '') + (this.promptOnly ? '' : update.textDelta);
    if (!text && !update.finishReason && !(logprobs && logprobs.tokens.length > 0)) return [];
    return [this.chunk({
      index: update.index, text, logprobs, finishReason: update.finishReason, stopReason: update.stopReason,
    }, usage && this.shown(usage))];
  }

  usageChunk(usage: WireUsage): object {
    return completionBody(this.meta, [], this.shown(usage));
  }

  /** Usage as the response reports it: a prompt-only choice has no completion tokens. */
  private shown(usage: WireUsage): WireUsage {
    return this.promptOnly ? { ...usage, completion_tokens: 0, total_tokens: usage.prompt_tokens } : usage;
  }

  collect(update: ChoiceUpdate): void {
    const choice = this.choices[update.index]!;
    if (!this.promptOnly) choice.text += update.textDelta;
    const logprobs = this.logprobsOf(update);
    if (logprobs) {
      if (choice.logprobs) appendCompletionLogprobs(choice.logprobs, logprobs);
      else choice.logprobs = logprobs;
    } else if (this.logprobs !== null && !choice.logprobs) {
      choice.logprobs = { tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] };
    }
    if (update.finishReason) {
      choice.finishReason = update.finishReason;
      choice.stopReason = update.stopReason;
    }
  }

  body(usage: WireUsage): object {
    return completionBody(this.meta, this.choices.map((choice, index) => ({ index, ...choice })), this.shown(usage));
  }
}

/**
 * vLLM's prompt_logprobs around another shape: each choice's first update carries its prompt's logprobs, and the
 * body shows them, at the top for chat (one prompt) and on each choice for completions (a prompt per choice).
 * Not streamed (the request is refused with stream), so the chunks are the inner shape's.
 */
export class PromptLogprobsShape implements ResponseShape {
  private readonly entries = new Map<number, WirePromptLogprobs>();

  constructor(
    private readonly inner: ResponseShape,
    private readonly texts: TokenTexts,
    private readonly topCount: number,
    private readonly place: 'response' | 'choices',
  ) {}

  openingChunks(usageOf: ChoiceUsage): object[] {
    return this.inner.openingChunks(usageOf);
  }

  updateChunks(update: ChoiceUpdate, usage: WireUsage | null | undefined): object[] {
    return this.inner.updateChunks(update, usage);
  }

  usageChunk(usage: WireUsage): object {
    return this.inner.usageChunk(usage);
  }

  collect(update: ChoiceUpdate): void {
    if (update.promptLogprobs !== undefined && !this.entries.has(update.index)) {
      this.entries.set(update.index, this.texts.promptLogprobs(update.promptLogprobs, this.topCount));
    }
    this.inner.collect(update);
  }

  body(usage: WireUsage): object {
    const body = this.inner.body(usage) as { choices: object[] };
    if (this.place === 'response') return { ...body, prompt_logprobs: this.entries.values().next().value ?? null };
    return { ...body, choices: body.choices.map((choice, index) => ({ ...choice, prompt_logprobs: this.entries.get(index) ?? null })) };
  }
}

/**
 * vLLM's return_token_ids around another shape: the ids of each choice's prompt and of the tokens it generated.
 * Non-streamed, a chat response has `prompt_token_ids` at the top (one prompt) and each choice its `token_ids`; a
 * completions choice has both (its own prompt's ids, since each prompt has its choices). Streamed, a choice's first
 * chunk carries the prompt's ids (chat: each role chunk, at the top; completions: on the choice) and every chunk of
 * a choice with content carries `token_ids`, the ids of the tokens it adds. Tokens that show no text yet (held back
 * for a possible stop string, half a character, a tool call still being parsed) produce no chunk of their own: their
 * ids come with the choice's next chunk, so a client that joins every chunk's ids has the body's, in order.
 * The ids are those the engine generated, ending with the token that completed a stop string, or with the stop
 * token or EOS (whose text is left out), as vLLM's; an echo's prompt is not among them.
 */
export class TokenIdsShape implements ResponseShape {
  private readonly generated: number[][];
  /** Ids generated and not yet carried by a chunk, per choice (streaming). */
  private readonly pending: number[][];
  /** Choices whose first chunk went out (it carries the prompt's ids). */
  private readonly opened: boolean[];

  constructor(
    private readonly inner: ResponseShape,
    choiceCount: number,
    /** The prompt token ids of each choice (chat: every choice's is the one prompt's). */
    private readonly promptIdsOf: (choiceIndex: number) => readonly number[],
    private readonly place: 'response' | 'choices',
    /** Completions' echo with max_tokens 0: the choices show no generated tokens. */
    private readonly promptOnly = false,
  ) {
    this.generated = Array.from({ length: choiceCount }, () => []);
    this.pending = Array.from({ length: choiceCount }, () => []);
    this.opened = new Array<boolean>(choiceCount).fill(false);
  }

  get sseStyle(): ResponseShape['sseStyle'] {
    return this.inner.sseStyle;
  }

  private idsOf(update: ChoiceUpdate): readonly number[] {
    return this.promptOnly ? [] : update.tokenIds ?? [];
  }

  /** A chunk with the choice's ids added: on its first chunk the prompt's, and `token_ids` on content chunks. */
  private decorate(chunk: object, tokenIds: readonly number[] | undefined): object {
    const wire = chunk as { choices?: { index: number }[] };
    const choice = wire.choices?.[0];
    if (choice === undefined) return chunk;
    const first = !this.opened[choice.index];
    this.opened[choice.index] = true;
    const prompt = first ? [...this.promptIdsOf(choice.index)] : undefined;
    const choices = wire.choices!.map((c) => ({
      ...c,
      ...(prompt !== undefined && this.place === 'choices' ? { prompt_token_ids: prompt } : {}),
      ...(tokenIds !== undefined ? { token_ids: [...tokenIds] } : {}),
    }));
    return { ...chunk, choices, ...(prompt !== undefined && this.place === 'response' ? { prompt_token_ids: prompt } : {}) };
  }

  openingChunks(usageOf: ChoiceUsage): object[] {
    // Chat's opening chunks only name the role (no token_ids, as vLLM's); completions' show an echoed prompt.
    return this.inner.openingChunks(usageOf).map((chunk) => this.decorate(chunk, this.place === 'choices' ? [] : undefined));
  }

  updateChunks(update: ChoiceUpdate, usage: WireUsage | null | undefined): object[] {
    const pending = this.pending[update.index]!;
    pending.push(...this.idsOf(update));
    const chunks = this.inner.updateChunks(update, usage);
    return chunks.map((chunk, i) => {
      const ids = i === 0 ? pending.splice(0) : [];
      return this.decorate(chunk, ids);
    });
  }

  usageChunk(usage: WireUsage): object {
    return this.inner.usageChunk(usage);
  }

  collect(update: ChoiceUpdate): void {
    this.generated[update.index]!.push(...this.idsOf(update));
    this.inner.collect(update);
  }

  body(usage: WireUsage): object {
    const body = this.inner.body(usage) as { choices: { index: number }[] };
    const choices = body.choices.map((choice) => ({
      ...choice,
      ...(this.place === 'choices' ? { prompt_token_ids: [...this.promptIdsOf(choice.index)] } : {}),
      token_ids: this.generated[choice.index] ?? [],
    }));
    return { ...body, choices, ...(this.place === 'response' ? { prompt_token_ids: [...this.promptIdsOf(0)] } : {}) };
  }
}
