// How a run's events become OpenAI bodies and stream chunks, for chat and for legacy completions. A shape keeps the
// per-choice state its format needs (text so far, logprob offsets); the consumers in respond.ts drive it.

import type { TokenLogprob } from '../engine/types.ts';
import {
  appendCompletionLogprobs, chatChunkBody, chatCompletionBody, completionBody, type ChatResponseMeta,
  type ChatTokenLogprob, type CompletionLogprobs, type TokenTexts, type WireFinishReason, type WireUsage,
} from './openai-format.ts';

/** One output of one choice, already mapped to the wire's choice index. */
export interface ChoiceUpdate {
  index: number;
  textDelta: string;
  logprobs: readonly TokenLogprob[] | undefined;
  finishReason: WireFinishReason | null;
  stopReason: string | number | null;
  /** Output tokens the update adds (some show no text yet: held back for a stop string or a split character). */
  tokens: number;
}

export interface ResponseShape {
  /** Chunks sent as soon as the stream opens. */
  openingChunks(usage: WireUsage | null | undefined): object[];
  /** Chunks for one update (none when it carries nothing to show). */
  updateChunks(update: ChoiceUpdate, usage: WireUsage | null | undefined): object[];
  /** The closing chunk with empty choices that stream_options.include_usage asks for. */
  usageChunk(usage: WireUsage): object;
  /** Records an update for the non-streamed body. */
  collect(update: ChoiceUpdate): void;
  body(usage: WireUsage): object;
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

  openingChunks(usage: WireUsage | null | undefined): object[] {
    // Like OpenAI, every choice's first chunk names the role and carries no text yet.
    return Array.from({ length: this.choiceCount }, (_, index) => chatChunkBody(this.meta,
      [{ index, delta: { role: 'assistant', content: '' }, logprobs: null, finishReason: null }], usage));
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
  /** Characters of text each choice has produced so far: where its next token's text_offset starts. */
  private readonly offsets: number[];

  constructor(
    private readonly meta: ChatResponseMeta,
    choiceCount: number,
    private readonly texts: TokenTexts,
    private readonly logprobs: number | null,
    /** Echoed prompt text per choice (empty when echo is off). */
    private readonly echoTexts: readonly string[],
  ) {
    this.choices = Array.from({ length: choiceCount }, (_, index) => ({
      text: echoTexts[index] ?? '', logprobs: null, finishReason: null, stopReason: null,
    }));
    this.offsets = this.choices.map((choice) => choice.text.length);
  }

  private logprobsOf(update: ChoiceUpdate): CompletionLogprobs | null {
    if (this.logprobs === null || !update.logprobs) return null;
    const result = this.texts.completionLogprobs(update.logprobs, this.logprobs, this.offsets[update.index]!);
    this.offsets[update.index] = result.tokens.reduce((offset, token) => offset + token.length, this.offsets[update.index]!);
    return result;
  }

  private chunk(choice: CollectedChoice<CompletionLogprobs> & { index: number }, usage: WireUsage | null | undefined): object {
    return completionBody(this.meta, [choice], usage);
  }

  openingChunks(usage: WireUsage | null | undefined): object[] {
    return this.echoTexts
      .map((text, index) => ({ text, index }))
      .filter(({ text }) => text.length > 0)
      .map(({ text, index }) => this.chunk({ index, text, logprobs: null, finishReason: null, stopReason: null }, usage));
  }

  updateChunks(update: ChoiceUpdate, usage: WireUsage | null | undefined): object[] {
    const logprobs = this.logprobsOf(update);
    if (!update.textDelta && !update.finishReason && !(logprobs && logprobs.tokens.length > 0)) return [];
    return [this.chunk({
      index: update.index, text: update.textDelta, logprobs, finishReason: update.finishReason, stopReason: update.stopReason,
    }, usage)];
  }

  usageChunk(usage: WireUsage): object {
    return completionBody(this.meta, [], usage);
  }

  collect(update: ChoiceUpdate): void {
    const choice = this.choices[update.index]!;
    choice.text += update.textDelta;
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
    return completionBody(this.meta, this.choices.map((choice, index) => ({ index, ...choice })), usage);
  }
}
