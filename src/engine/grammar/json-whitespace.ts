// The bound on whitespace between JSON elements (JSON_MAX_WHITESPACE characters in a run), kept here beside
// XGrammar instead of inside its grammar. XGrammar 0.1.27 can bound it itself (its JSON converter's maximum
// whitespace count), but it spells a bound of N as N nested optional rules at every place whitespace may go, and
// every mask between JSON elements then costs three to four times what it costs with unbounded whitespace (about
// 20-30 µs against 6-7 µs at a 32k vocabulary, in WASM), and the bounded grammar is not even consistent (its
// generic arrays keep unbounded whitespace). So JSON grammars are compiled with unbounded whitespace, as vLLM
// compiles them, and the bound is a token filter here: a token is refused when, outside strings, it would make a
// run of more than JSON_MAX_WHITESPACE whitespace characters (XGrammar's JSON whitespace: space, newline, tab).
//
// A small lexer follows the output (in a string or not, after a backslash or not, the whitespace run so far) with
// each accepted token's bytes. The grammar only produces valid JSON, so a quote outside a string always opens one,
// and an unescaped quote in a string always closes it.

const SPACE = 0x20;
const NEWLINE = 0x0a;
const TAB = 0x09;
const QUOTE = 0x22;
const BACKSLASH = 0x5c;

/** A token's bytes hold whitespace. */
const HAS_WHITESPACE = 1;
/** A token's bytes hold a quote or a backslash (they change the string state). */
const HAS_QUOTE = 2;

function isWhitespace(byte: number): boolean {
  return byte === SPACE || byte === NEWLINE || byte === TAB;
}

/** A vocabulary's token bytes as the lexer reads them, built once per grammar runtime. */
export class JsonTokenBytes {
  readonly vocabSize: number;
  /** Token i's bytes are bytes[offsets[i], offsets[i + 1]). */
  private readonly offsets: Uint32Array;
  private readonly bytes: Uint8Array;
  /** HAS_WHITESPACE | HAS_QUOTE per token. */
  readonly flags: Uint8Array;
  /** Tokens with both a quote (or backslash) and whitespace: the only ones that can add whitespace outside a string
   * when they start inside one. */
  readonly quotedWhitespace: Int32Array;

  constructor(tokens: readonly Uint8Array[]) {
    this.vocabSize = tokens.length;
    this.offsets = new Uint32Array(tokens.length + 1);
    let total = 0;
    for (let id = 0; id < tokens.length; id++) {
      this.offsets[id] = total;
      total += tokens[id]!.length;
    }
    this.offsets[tokens.length] = total;
    this.bytes = new Uint8Array(total);
    this.flags = new Uint8Array(tokens.length);
    const quotedWhitespace: number[] = [];
    for (let id = 0; id < tokens.length; id++) {
      const token = tokens[id]!;
      this.bytes.set(token, this.offsets[id]);
      let flags = 0;
      for (const byte of token) {
        if (isWhitespace(byte)) flags |= HAS_WHITESPACE;
        else if (byte === QUOTE || byte === BACKSLASH) flags |= HAS_QUOTE;
      }
      this.flags[id] = flags;
      if (flags === (HAS_WHITESPACE | HAS_QUOTE)) quotedWhitespace.push(id);
    }
    this.quotedWhitespace = Int32Array.from(quotedWhitespace);
  }

  start(id: number): number {
    return this.offsets[id]!;
  }

  end(id: number): number {
    return this.offsets[id + 1]!;
  }

  byte(at: number): number {
    return this.bytes[at]!;
  }
}

/** One completion's whitespace bound: the lexer's state after the output so far. */
export class JsonWhitespaceBound {
  private inString = false;
  private escaped = false;
  /** Whitespace characters at the end of the output, outside strings. */
  private run = 0;

  constructor(private readonly tokens: JsonTokenBytes, private readonly maxRun: number) {}

  /** Whether `id` keeps every whitespace run outside strings within the bound. */
  fits(id: number): boolean {
    if (id >= this.tokens.vocabSize) return true;
    const flags = this.tokens.flags[id]!;
    if ((flags & HAS_WHITESPACE) === 0) return true;
    if (this.inString && (flags & HAS_QUOTE) === 0) return true;
    return this.scan(id, false);
  }

  /** Follows an accepted token (one the grammar took and fits allowed). */
  advance(id: number): void {
    if (id < this.tokens.vocabSize) this.scan(id, true);
  }

  /**
   * Clears, in a mask's words (bit i of word i >> 5 for token i), the allowed tokens that do not fit. Inside a
   * string only tokens that can close it and go on with whitespace are looked at; outside, the allowed tokens with
   * whitespace (between JSON elements the grammar allows few tokens).
   */
  restrict(words: Int32Array): void {
    if (this.inString) {
      for (const id of this.tokens.quotedWhitespace) {
        const bit = 1 << (id & 31);
        if ((words[id >>> 5]! & bit) !== 0 && !this.scan(id, false)) words[id >>> 5]! &= ~bit;
      }
      return;
    }
    const flags = this.tokens.flags;
    const limit = Math.min(words.length, (this.tokens.vocabSize + 31) >>> 5);
    for (let w = 0; w < limit; w++) {
      let word = words[w]!;
      while (word !== 0) {
        const low = word & -word;
        word ^= low;
        const id = (w << 5) + 31 - Math.clz32(low);
        if (id < this.tokens.vocabSize && (flags[id]! & HAS_WHITESPACE) !== 0 && !this.scan(id, false)) words[w]! &= ~low;
      }
    }
  }

  /** Runs the lexer over token `id` from the current state: false when a run would pass the bound (the state is
   * then not kept); with `keep`, the state after the token is kept. */
  private scan(id: number, keep: boolean): boolean {
    const tokens = this.tokens;
    let inString = this.inString;
    let escaped = this.escaped;
    let run = this.run;
    for (let at = tokens.start(id), end = tokens.end(id); at < end; at++) {
      const byte = tokens.byte(at);
      if (inString) {
        if (escaped) escaped = false;
        else if (byte === BACKSLASH) escaped = true;
        else if (byte === QUOTE) inString = false;
      } else if (isWhitespace(byte)) {
        if (++run > this.maxRun && !keep) return false;
      } else {
        run = 0;
        if (byte === QUOTE) inString = true;
      }
    }
    if (keep) {
      this.inString = inString;
      this.escaped = escaped;
      this.run = run;
    }
    return true;
  }
}
