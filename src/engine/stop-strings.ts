// Stop-string detection over streamed text. Text is released only once no stop string can start in it, so a
// partial stop string never reaches the client even when it is split across tokens.
//
// When several stop strings could match, the one that completes first in the text wins (ties: the longer one,
// which starts earlier). That is the only rule that does not depend on how the text was chunked into tokens.
//
// As in vLLM, stop strings are not checked until more than min_tokens tokens have been generated: a stop string
// that lies wholly in the text of the first min_tokens tokens does not end the output; one that straddles the
// min_tokens-th token's text and a later token's does.
//
// Stop strings match code points, as vLLM's (Python str) do: a match never starts or ends between the two halves of
// a surrogate pair, so a stop string holding a lone surrogate does not match half of a character, and neither the
// text before a match nor the text released ahead of held-back text ends in half a character. Pushed text is whole
// characters (the detokenizer's UTF-8 decoder never splits a pair), so the end of the buffer is a boundary.

export interface StopCheck {
  /** Text safe to emit now. */
  text: string;
  /** The stop string that matched; the output ends here and nothing more may be pushed. */
  stopped?: string;
}

export class StopStringMatcher {
  private readonly stops: readonly string[];
  private readonly includeStopInOutput: boolean;
  private readonly longestStop: number;
  /** Text not yet released: the longest suffix that is a proper prefix of some stop string. */
  private held = '';
  private matched: string | undefined;
  /** Tokens whose text has been pushed; a match counts only once this exceeds minTokens. */
  private tokensSeen = 0;
  private readonly minTokens: number;

  constructor(stops: readonly string[], includeStopInOutput = false, minTokens = 0) {
    for (const stop of stops) {
      if (typeof stop !== 'string' || stop.length === 0) throw new RangeError(`stop strings must be non-empty strings, got ${JSON.stringify(stop)}`);
    }
    this.stops = stops;
    this.includeStopInOutput = includeStopInOutput;
    this.longestStop = stops.reduce((longest, stop) => Math.max(longest, stop.length), 0);
    this.minTokens = minTokens;
  }

  get stopped(): string | undefined {
    return this.matched;
  }

  /** Text held back because it might begin a stop string. */
  get heldText(): string {
    return this.held;
  }

  /**
   * The text of one more token (`isToken` false: text that is not a new token, such as the bytes flushed at the
   * end). Stop strings match only once more than minTokens tokens were pushed.
   */
  push(text: string, isToken = true): StopCheck {
    if (this.matched !== undefined) throw new Error(`stop string ${JSON.stringify(this.matched)} already matched; no more text may follow`);
    if (isToken) this.tokensSeen++;
    if (this.stops.length === 0) return { text };
    const newTextStart = this.held.length;
    const buffer = this.held + text;
    const checking = this.tokensSeen > this.minTokens;

    let matchStart = -1;
    let matchEnd = Infinity;
    let matchStop = '';
    for (const stop of checking ? this.stops : []) {
      // Held text contains no whole stop string, so a match must end inside the new text.
      const start = indexOfCodePoints(buffer, stop, Math.max(0, newTextStart - stop.length + 1));
      if (start < 0) continue;
      const end = start + stop.length;
      if (end < matchEnd || (end === matchEnd && start < matchStart)) {
        matchStart = start;
        matchEnd = end;
        matchStop = stop;
      }
    }
    if (matchStart >= 0) {
      this.held = '';
      this.matched = matchStop;
      return { text: buffer.slice(0, matchStart) + (this.includeStopInOutput ? matchStop : ''), stopped: matchStop };
    }

    const holdFrom = this.partialStopStart(buffer);
    this.held = buffer.slice(holdFrom);
    return { text: buffer.slice(0, holdFrom) };
  }

  /** Releases the held text at the end of the output (length, EOS, abort): it can no longer become a stop string. */
  flush(): string {
    const rest = this.held;
    this.held = '';
    return rest;
  }

  /**
   * Start of the earliest suffix of `buffer` that is a proper prefix of a stop string, both cut at code-point
   * boundaries (buffer.length if none).
   */
  private partialStopStart(buffer: string): number {
    for (let start = Math.max(0, buffer.length - this.longestStop + 1); start < buffer.length; start++) {
      if (splitsSurrogatePair(buffer, start)) continue;
      const suffixLength = buffer.length - start;
      for (const stop of this.stops) {
        if (stop.length > suffixLength && !splitsSurrogatePair(stop, suffixLength)
          && buffer.startsWith(stop.slice(0, suffixLength), start)) return start;
      }
    }
    return buffer.length;
  }
}

/** Whether `index` falls between a high and a low surrogate of `text` (inside one character, not between two). */
function splitsSurrogatePair(text: string, index: number): boolean {
  if (index <= 0 || index >= text.length) return false;
  const before = text.charCodeAt(index - 1);
  const after = text.charCodeAt(index);
  return before >= 0xd800 && before <= 0xdbff && after >= 0xdc00 && after <= 0xdfff;
}

/** text.indexOf(search, from) over code points: the first match that neither starts nor ends inside a character. */
function indexOfCodePoints(text: string, search: string, from: number): number {
  for (let start = text.indexOf(search, from); start >= 0; start = text.indexOf(search, start + 1)) {
    if (!splitsSurrogatePair(text, start) && !splitsSurrogatePair(text, start + search.length)) return start;
  }
  return -1;
}
