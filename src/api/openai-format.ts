// Response bodies and stream chunks in OpenAI's wire shapes (snake_case, as clients expect them).

import { randomBytes } from 'node:crypto';
import type { FinishReason, TokenLogprob } from '../engine/types.ts';
import type { Tokenizer } from '../model/tokenizer/types.ts';

export type WireFinishReason = 'stop' | 'length' | 'abort';

export interface WireUsage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  prompt_tokens_details: { cached_tokens: number };
}

export interface ChatTokenLogprob {
  token: string;
  logprob: number;
  bytes: number[];
  top_logprobs: { token: string; logprob: number; bytes: number[] }[];
}

export interface CompletionLogprobs {
  tokens: string[];
  /** null for an echoed prompt's first token (nothing comes before it). */
  token_logprobs: (number | null)[];
  top_logprobs: (Record<string, number> | null)[];
  text_offset: number[];
}

/** vLLM's prompt_logprobs: per prompt token, null for the first, else token id -> its logprob, rank and text. */
export type WirePromptLogprobs = (Record<string, { logprob: number; rank: number | null; decoded_token: string }> | null)[];

/** What a finished (or finishing) choice carries, whichever endpoint it came from. */
export interface ChoiceResult {
  index: number;
  text: string;
  finishReason: WireFinishReason | null;
  /** The stop string or token id that ended the choice (vLLM's stop_reason). */
  stopReason: string | number | null;
}

/**
 * A server id: `chatcmpl-<hex>` and `cmpl-<hex>` as OpenAI and vLLM name completions, `resp_<hex>` as they name
 * responses (the Responses API's ids, `msg_...` and `fc_...` items too, join prefix and body with an underscore).
 */
export function newCompletionId(prefix: 'chatcmpl' | 'cmpl' | 'resp'): string {
  return `${prefix}${prefix === 'resp' ? '_' : '-'}${randomBytes(12).toString('hex')}`;
}

export function unixSeconds(): number {
  return Math.floor(Date.now() / 1000);
}

export function wireUsage(promptTokens: number, completionTokens: number, cachedTokens: number): WireUsage {
  return {
    prompt_tokens: promptTokens,
    completion_tokens: completionTokens,
    total_tokens: promptTokens + completionTokens,
    prompt_tokens_details: { cached_tokens: cachedTokens },
  };
}

/** The engine's 'error' never reaches a choice (it becomes an error response), so only three reasons remain. */
export function wireFinishReason(reason: FinishReason | undefined): WireFinishReason | null {
  if (reason === undefined || reason === 'error') return null;
  return reason;
}

// ---- logprobs ----

/**
 * A text's length in Unicode code points, as Python's len() counts it (a surrogate pair is one, a lone surrogate
 * one): the unit of the offsets clients are given, which they use to slice the text they decoded.
 */
export function codePointLength(text: string): number {
  let length = text.length;
  for (let i = 0; i < text.length - 1; i++) {
    const unit = text.charCodeAt(i);
    if (unit >= 0xd800 && unit <= 0xdbff) {
      const next = text.charCodeAt(i + 1);
      if (next >= 0xdc00 && next <= 0xdfff) {
        length--;
        i++;
      }
    }
  }
  return length;
}

/** JSON has no -Infinity; a token the sampler ruled out gets a very small finite logprob instead (as vLLM does). */
function finiteLogprob(logprob: number): number {
  return Number.isFinite(logprob) ? logprob : -9999;
}

/** Token text and bytes for logprobs, cached per id. */
export class TokenTexts {
  private readonly cache = new Map<number, { text: string; bytes: number[] }>();
  // A token may begin with U+FEFF (a byte order mark in the training text): it is part of the token's text.
  private readonly decoder = new TextDecoder('utf-8', { ignoreBOM: true });
  private readonly encoder = new TextEncoder();

  /**
   * asTokenIds (vLLM's return_tokens_as_token_ids): each token is written "token_id:<id>" (its bytes those of that
   * text), so a client recovers the exact ids, which a token's text (half a UTF-8 character, say) may not give.
   */
  constructor(private readonly tokenizer: Tokenizer, private readonly options: { asTokenIds?: boolean } = {}) {}

  get(id: number): { text: string; bytes: number[] } {
    let entry = this.cache.get(id);
    if (!entry) {
      if (this.options.asTokenIds) {
        const text = `token_id:${id}`;
        entry = { text, bytes: Array.from(this.encoder.encode(text)) };
      } else {
        const bytes = this.tokenizer.tokenBytes(id, true);
        entry = { text: this.decoder.decode(bytes), bytes: Array.from(bytes) };
      }
      this.cache.set(id, entry);
    }
    return entry;
  }

  chatLogprobs(logprobs: readonly TokenLogprob[], topCount: number): ChatTokenLogprob[] {
    return logprobs.map((entry) => {
      const chosen = this.get(entry.tokenId);
      return {
        token: chosen.text,
        logprob: finiteLogprob(entry.logprob),
        bytes: chosen.bytes,
        top_logprobs: entry.top.slice(0, topCount).map((alt) => {
          const text = this.get(alt.tokenId);
          return { token: text.text, logprob: finiteLogprob(alt.logprob), bytes: text.bytes };
        }),
      };
    });
  }

  /**
   * Legacy completions shape; `startOffset` is the text offset of the first token (after any echoed prompt).
   * Offsets count code points, as vLLM's (Python's) do, not UTF-16 code units. An echoed prompt's entries start at
   * offset 0; its first token has no logprob (null entries: the token ids say which token each is).
   */
  completionLogprobs(logprobs: readonly (TokenLogprob | null)[], topCount: number, startOffset: number,
    promptTokenIds?: readonly number[]): CompletionLogprobs {
    const result: CompletionLogprobs = { tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] };
    let offset = startOffset;
    for (const [i, entry] of logprobs.entries()) {
      if (entry === null) {
        const text = this.get(promptTokenIds![i]!).text;
        result.tokens.push(text);
        result.token_logprobs.push(null);
        result.top_logprobs.push(null);
        result.text_offset.push(offset);
        offset += codePointLength(text);
        continue;
      }
      const text = this.get(entry.tokenId).text;
      result.tokens.push(text);
      result.token_logprobs.push(finiteLogprob(entry.logprob));
      // The chosen token is always listed with its alternatives, so a map may hold topCount + 1 entries.
      const top: Record<string, number> = {};
      for (const alt of entry.top.slice(0, topCount)) top[this.get(alt.tokenId).text] = finiteLogprob(alt.logprob);
      top[text] = finiteLogprob(entry.logprob);
      result.top_logprobs.push(top);
      result.text_offset.push(offset);
      offset += codePointLength(text);
    }
    return result;
  }

  /** vLLM's prompt_logprobs entries: the topCount alternatives (ranks 1..topCount), then the prompt token itself. */
  promptLogprobs(logprobs: readonly (TokenLogprob | null)[], topCount: number): WirePromptLogprobs {
    return logprobs.map((entry) => {
      if (entry === null) return null;
      const result: NonNullable<WirePromptLogprobs[number]> = {};
      entry.top.slice(0, topCount).forEach((alt, i) => {
        result[alt.tokenId] = { logprob: finiteLogprob(alt.logprob), rank: i + 1, decoded_token: this.get(alt.tokenId).text };
      });
      result[entry.tokenId] = { logprob: finiteLogprob(entry.logprob), rank: entry.rank ?? null, decoded_token: this.get(entry.tokenId).text };
      return result;
    });
  }
}

/** Appends one stream's logprobs to another's, continuing the text offsets. */
export function appendCompletionLogprobs(into: CompletionLogprobs, more: CompletionLogprobs): void {
  into.tokens.push(...more.tokens);
  into.token_logprobs.push(...more.token_logprobs);
  into.top_logprobs.push(...more.top_logprobs);
  into.text_offset.push(...more.text_offset);
}

// ---- chat ----

export interface ChatResponseMeta {
  id: string;
  created: number;
  model: string;
  systemFingerprint: string;
}

export function chatCompletionBody(
  meta: ChatResponseMeta,
  choices: (ChoiceResult & { logprobs: ChatTokenLogprob[] | null })[],
  usage: WireUsage,
): object {
  return {
    id: meta.id,
    object: 'chat.completion',
    created: meta.created,
    model: meta.model,
    system_fingerprint: meta.systemFingerprint,
    choices: choices.map((choice) => ({
      index: choice.index,
      message: { role: 'assistant', content: choice.text, refusal: null },
      logprobs: choice.logprobs ? { content: choice.logprobs, refusal: null } : null,
      finish_reason: choice.finishReason,
      stop_reason: choice.stopReason,
    })),
    usage,
  };
}

export interface ChatDelta {
  role?: 'assistant';
  content?: string;
}

export function chatChunkBody(
  meta: ChatResponseMeta,
  choices: { index: number; delta: ChatDelta; logprobs: ChatTokenLogprob[] | null; finishReason: WireFinishReason | null;
    stopReason?: string | number | null }[],
  usage: WireUsage | null | undefined,
): object {
  return {
    id: meta.id,
    object: 'chat.completion.chunk',
    created: meta.created,
    model: meta.model,
    system_fingerprint: meta.systemFingerprint,
    choices: choices.map((choice) => ({
      index: choice.index,
      delta: choice.delta,
      logprobs: choice.logprobs ? { content: choice.logprobs, refusal: null } : null,
      finish_reason: choice.finishReason,
      ...(choice.finishReason ? { stop_reason: choice.stopReason ?? null } : {}),
    })),
    ...(usage !== undefined ? { usage } : {}),
  };
}

// ---- completions ----

export function completionBody(
  meta: ChatResponseMeta,
  choices: (ChoiceResult & { logprobs: CompletionLogprobs | null })[],
  usage: WireUsage | null | undefined,
  object: 'text_completion' = 'text_completion',
): object {
  return {
    id: meta.id,
    object,
    created: meta.created,
    model: meta.model,
    system_fingerprint: meta.systemFingerprint,
    choices: choices.map((choice) => ({
      index: choice.index,
      text: choice.text,
      logprobs: choice.logprobs,
      finish_reason: choice.finishReason,
      stop_reason: choice.stopReason,
    })),
    ...(usage !== undefined ? { usage } : {}),
  };
}
