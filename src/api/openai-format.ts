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
  token_logprobs: number[];
  top_logprobs: Record<string, number>[];
  text_offset: number[];
}

/** What a finished (or finishing) choice carries, whichever endpoint it came from. */
export interface ChoiceResult {
  index: number;
  text: string;
  finishReason: WireFinishReason | null;
  /** The stop string or token id that ended the choice (vLLM's stop_reason). */
  stopReason: string | number | null;
}

export function newCompletionId(prefix: 'chatcmpl' | 'cmpl'): string {
  return `${prefix}-${randomBytes(12).toString('hex')}`;
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

/** JSON has no -Infinity; a token the sampler ruled out gets a very small finite logprob instead (as vLLM does). */
function finiteLogprob(logprob: number): number {
  return Number.isFinite(logprob) ? logprob : -9999;
}

/** Token text and bytes for logprobs, cached per id. */
export class TokenTexts {
  private readonly cache = new Map<number, { text: string; bytes: number[] }>();
  private readonly decoder = new TextDecoder('utf-8');

  constructor(private readonly tokenizer: Tokenizer) {}

  get(id: number): { text: string; bytes: number[] } {
    let entry = this.cache.get(id);
    if (!entry) {
      const bytes = this.tokenizer.tokenBytes(id, true);
      entry = { text: this.decoder.decode(bytes), bytes: Array.from(bytes) };
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

  /** Legacy completions shape; `startOffset` is the text offset of the first token (after any echoed prompt). */
  completionLogprobs(logprobs: readonly TokenLogprob[], topCount: number, startOffset: number): CompletionLogprobs {
    const result: CompletionLogprobs = { tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] };
    let offset = startOffset;
    for (const entry of logprobs) {
      const text = this.get(entry.tokenId).text;
      result.tokens.push(text);
      result.token_logprobs.push(finiteLogprob(entry.logprob));
      // The chosen token is always listed with its alternatives, so a map may hold topCount + 1 entries.
      const top: Record<string, number> = {};
      for (const alt of entry.top.slice(0, topCount)) top[this.get(alt.tokenId).text] = finiteLogprob(alt.logprob);
      top[text] = finiteLogprob(entry.logprob);
      result.top_logprobs.push(top);
      result.text_offset.push(offset);
      offset += text.length;
    }
    return result;
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
