// Incremental detokenization: token ids in, text deltas out, one sequence per instance.
//
// Tokens are turned into bytes (Tokenizer.tokenBytes) and decoded here as a UTF-8 stream, so a character whose
// bytes are split across tokens (byte-fallback emoji, byte-level BPE CJK) is emitted whole once its last byte
// arrives, never as U+FFFD halves. The decoded text then passes the stop-string matcher, which holds back any tail
// that could still begin a stop string.
//
// Leading space: a SentencePiece tokenizer marks word starts with "▁", so the first token of a text carries a
// space that whole-sequence decode drops (Tokenizer.stripsLeadingSpace). Generated output continues the prompt,
// where that space is real ("Hello" + "▁world" -> "Hello world"), so by default it is kept, as vLLM's and
// llama.cpp's servers do for completions. `stripLeadingSpace: true` drops it for output that starts the text
// (a prompt with no text, e.g. BOS alone); then the deltas join to exactly `tokenizer.decode(ids)`.

import type { Tokenizer } from '../model/tokenizer/types.ts';
import type { SamplingParams } from './types.ts';
import { StopStringMatcher } from './stop-strings.ts';

const REPLACEMENT_CHARACTER = 0xfffd;
const SPACE = 0x20;
/** String.fromCharCode takes its code units as arguments; chunk long runs to stay far below engine limits. */
const MAX_CODE_UNITS_PER_CALL = 4096;

/**
 * UTF-8 decoder over a byte stream, following the WHATWG Encoding Standard (as TextDecoder does): an incomplete
 * sequence at the end of a chunk waits for the next chunk, and each maximal invalid subpart becomes one U+FFFD as
 * soon as it can no longer complete.
 */
export class Utf8StreamDecoder {
  private codePoint = 0;
  private bytesNeeded = 0;
  private bytesSeen = 0;
  private lowerBoundary = 0x80;
  private upperBoundary = 0xbf;
  private readonly units: number[] = [];

  /** Bytes of an incomplete character held for the next chunk. */
  get pendingByteCount(): number {
    return this.bytesNeeded === 0 ? 0 : this.bytesSeen + 1;
  }

  /** Decodes a chunk; returns the text of every character completed (or found invalid) by it. */
  decode(bytes: Uint8Array): string {
    for (let i = 0; i < bytes.length; i++) {
      if (!this.consume(bytes[i]!)) i--; // the byte ended an invalid sequence and starts afresh
    }
    return this.takeText();
  }

  /** End of stream: an incomplete character becomes U+FFFD. */
  end(): string {
    if (this.bytesNeeded !== 0) {
      this.reset();
      this.units.push(REPLACEMENT_CHARACTER);
    }
    return this.takeText();
  }

  /** Processes one byte; false when the byte must be processed again after an error. */
  private consume(byte: number): boolean {
    if (this.bytesNeeded === 0) {
      if (byte <= 0x7f) {
        this.units.push(byte);
      } else if (byte >= 0xc2 && byte <= 0xdf) {
        this.bytesNeeded = 1;
        this.codePoint = byte & 0x1f;
      } else if (byte >= 0xe0 && byte <= 0xef) {
        if (byte === 0xe0) this.lowerBoundary = 0xa0; // overlong
        if (byte === 0xed) this.upperBoundary = 0x9f; // surrogates
        this.bytesNeeded = 2;
        this.codePoint = byte & 0x0f;
      } else if (byte >= 0xf0 && byte <= 0xf4) {
        if (byte === 0xf0) this.lowerBoundary = 0x90; // overlong
        if (byte === 0xf4) this.upperBoundary = 0x8f; // above U+10FFFF
        this.bytesNeeded = 3;
        this.codePoint = byte & 0x07;
      } else {
        this.units.push(REPLACEMENT_CHARACTER);
      }
      return true;
    }
    if (byte < this.lowerBoundary || byte > this.upperBoundary) {
      this.reset();
      this.units.push(REPLACEMENT_CHARACTER);
      return false;
    }
    this.lowerBoundary = 0x80;
    this.upperBoundary = 0xbf;
    this.codePoint = (this.codePoint << 6) | (byte & 0x3f);
    if (++this.bytesSeen === this.bytesNeeded) {
      const codePoint = this.codePoint;
      this.reset();
      if (codePoint > 0xffff) {
        const offset = codePoint - 0x10000;
        this.units.push(0xd800 + (offset >> 10), 0xdc00 + (offset & 0x3ff));
      } else {
        this.units.push(codePoint);
      }
    }
    return true;
  }

  private reset(): void {
    this.codePoint = 0;
    this.bytesNeeded = 0;
    this.bytesSeen = 0;
    this.lowerBoundary = 0x80;
    this.upperBoundary = 0xbf;
  }

  private takeText(): string {
    const units = this.units;
    let text = '';
    for (let i = 0; i < units.length; i += MAX_CODE_UNITS_PER_CALL) {
      text += String.fromCharCode(...units.slice(i, i + MAX_CODE_UNITS_PER_CALL));
    }
    units.length = 0;
    return text;
  }
}

export interface DetokenizerOptions {
  /** Special/control tokens produce no text (default true). */
  skipSpecialTokens?: boolean;
  /** Special tokens that produce their text even when skipSpecialTokens (see SamplingParams.keptSpecialTokenIds). */
  keptSpecialTokenIds?: readonly number[];
  stop?: readonly string[];
  includeStopStrInOutput?: boolean;
  /** Stop strings are not checked until more than this many tokens were pushed, as in vLLM (default 0). */
  minTokens?: number;
  /** Drop the SentencePiece leading space of the first text: only for output that starts the text (default false). */
  stripLeadingSpace?: boolean;
}

/**
 * Whether a prompt shows any text. An id the tokenizer does not know (a simulated worker's prompt of another
 * vocabulary) counts as text: nothing is stripped after it.
 */
function hasText(tokenizer: Pick<Tokenizer, 'tokenBytes'>, promptTokenIds: readonly number[], includeSpecial: boolean): boolean {
  for (const id of promptTokenIds) {
    try {
      if (tokenizer.tokenBytes(id, includeSpecial).length > 0) return true;
    } catch {
      return true;
    }
  }
  return false;
}

export interface DetokenizerDelta {
  /** Text to emit now (may be empty while bytes or a possible stop string are held back). */
  delta: string;
  /** Set when a stop string matched: the output ends with this delta. */
  stopped?: string;
}

export class IncrementalDetokenizer {
  private readonly tokenizer: Pick<Tokenizer, 'tokenBytes' | 'stripsLeadingSpace'>;
  private readonly includeSpecial: boolean;
  private readonly keptSpecial: ReadonlySet<number>;
  private readonly utf8 = new Utf8StreamDecoder();
  private readonly stops: StopStringMatcher;
  /** Still at the very start of the output, where the leading-space strip applies. */
  private atTextStart: boolean;
  private finished = false;

  constructor(tokenizer: Pick<Tokenizer, 'tokenBytes' | 'stripsLeadingSpace'>, options: DetokenizerOptions = {}) {
    this.tokenizer = tokenizer;
    this.includeSpecial = !(options.skipSpecialTokens ?? true);
    this.keptSpecial = new Set(options.keptSpecialTokenIds);
    this.stops = new StopStringMatcher(options.stop ?? [], options.includeStopStrInOutput ?? false, options.minTokens ?? 0);
    this.atTextStart = (options.stripLeadingSpace ?? false) && tokenizer.stripsLeadingSpace;
  }

  /**
   * A detokenizer configured from a request's sampling params (skip_special_tokens, stop, include_stop_str). The
   * output starts the text when the prompt has none (BOS alone, as the output's skip_special_tokens shows it): then a
   * SentencePiece word's leading space goes, as decoding prompt and output together drops it.
   */
  static forRequest(
    tokenizer: Pick<Tokenizer, 'tokenBytes' | 'stripsLeadingSpace'>,
    params: Pick<SamplingParams, 'skipSpecialTokens' | 'keptSpecialTokenIds' | 'stop' | 'includeStopStrInOutput' | 'minTokens'>,
    promptTokenIds: readonly number[] = [],
  ): IncrementalDetokenizer {
    const includeSpecial = !(params.skipSpecialTokens ?? true);
    return new IncrementalDetokenizer(tokenizer, {
      skipSpecialTokens: params.skipSpecialTokens,
      keptSpecialTokenIds: params.keptSpecialTokenIds,
      stop: params.stop,
      includeStopStrInOutput: params.includeStopStrInOutput,
      minTokens: params.minTokens,
      stripLeadingSpace: tokenizer.stripsLeadingSpace && !hasText(tokenizer, promptTokenIds, includeSpecial),
    });
  }

  /** Whether the output has ended (a stop string matched, or finish() was called). */
  get done(): boolean {
    return this.finished;
  }

  /** Feeds one generated token; returns the text it releases. */
  push(tokenId: number): DetokenizerDelta {
    if (this.finished) throw new Error(`detokenizer already finished; cannot take token ${tokenId}`);
    let bytes = this.tokenizer.tokenBytes(tokenId, this.includeSpecial || this.keptSpecial.has(tokenId));
    if (this.atTextStart && bytes.length > 0) {
      // The same rule as whole-sequence decode: the first token with any bytes loses one leading space.
      this.atTextStart = false;
      if (bytes[0] === SPACE) bytes = bytes.subarray(1);
    }
    return this.release(this.utf8.decode(bytes), true);
  }

  /**
   * Ends the output (max tokens, EOS or stop token, abort): releases everything held, an incomplete character as
   * U+FFFD. The flushed text can still complete a stop string, exactly as it would in the whole decoded text.
   * A stop token id that ends the output is not pushed first unless include_stop_str_in_output (as in vLLM).
   */
  finish(): DetokenizerDelta {
    if (this.finished) return { delta: '' };
    const last = this.release(this.utf8.end(), false);
    if (last.stopped !== undefined) return last;
    this.finished = true;
    return { delta: last.delta + this.stops.flush() };
  }

  private release(text: string, isToken: boolean): DetokenizerDelta {
    const checked = this.stops.push(text, isToken);
    if (checked.stopped === undefined) return { delta: checked.text };
    this.finished = true;
    return { delta: checked.text, stopped: checked.stopped };
  }
}
