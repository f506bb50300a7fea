// Constrained decoding on one worker: the grammars requests name (SamplingParams.guided), compiled once per worker
// against its vocabulary and kept in a small cache, and one matcher per completion that masks each logits row before
// sampling and advances with each sampled token. XGrammar does the work (xgrammar.ts); this file is the engine's
// view of it: plain-data specs in, synchronous calls out, so the step loop never awaits.
//
// Where the time goes: per token and sequence that needs a mask, one mask query (XGrammar's per-state token sets;
// in WASM, 5-6 µs between JSON elements to milliseconds inside a string of bounded length at a 32k vocabulary,
// more for larger ones; returned as a fresh vector, about a tenth more in embind's copying) and one pass over the
// mask's words here (maskRow: runs of refused words filled at once, mixed words bit by bit; maskedArgmax: only the
// allowed tokens' values read); advancing with a token, and the jump-forward query, are a few µs each, a refused
// advance about 2 µs (so a greedy row tries its best few tokens before paying for a mask: sampling.ts).
// benchmarks/grammar.ts measures them against a decode step.

import type { Tokenizer } from '../../model/tokenizer/types.ts';
import type { GuidedDecoding } from '../types.ts';
import { spellNumbers, withNumbers } from './json-numbers.ts';
import { JsonTokenBytes, JsonWhitespaceBound } from './json-whitespace.ts';
import { NARROW_CANDIDATES } from './sampling.ts';
import { byteLevelChars, GrammarError, XGrammar, type XgHandle } from './xgrammar.ts';

/**
 * Whitespace characters allowed in a run between JSON elements (bounded, so a grammar over a bounded schema ends).
 * Enforced beside XGrammar, not by it (json-whitespace.ts says why): JSON grammars are compiled with unbounded
 * whitespace.
 */
export const JSON_MAX_WHITESPACE = 16;

/**
 * The EBNF, schema or pattern a spec compiles to, as XGrammar takes it. A schema's `numbers`: its enum and const
 * numbers that XGrammar would respell, as placeholders in `schema` (json-numbers.ts).
 */
export type GrammarSource =
  | { kind: 'json_schema'; schema: string; strict: boolean; anyWhitespace: boolean; numbers?: Record<string, string> }
  | { kind: 'ebnf'; ebnf: string }
  | { kind: 'regex'; pattern: string };

/** What a spec asks XGrammar for (json_object is any JSON object; a choice is an EBNF alternation of literals). */
export function grammarSource(spec: GuidedDecoding): GrammarSource {
  switch (spec.kind) {
    case 'json_object': return { kind: 'json_schema', schema: '{"type":"object"}', strict: false, anyWhitespace: !spec.compact };
    case 'json_schema': {
      const spelled = spellNumbers(spec.schema);
      const schema = spelled?.schema ?? spec.schema;
      return { kind: 'json_schema', schema, strict: true, anyWhitespace: !spec.compact, ...(spelled ? { numbers: spelled.numbers } : {}) };
    }
    case 'regex': return { kind: 'regex', pattern: spec.pattern };
    case 'choice': return { kind: 'ebnf', ebnf: choiceGrammar(spec.choices) };
    case 'grammar': return { kind: 'ebnf', ebnf: spec.ebnf };
  }
}

/** A string as an EBNF literal: JSON's escapes are XGrammar's (\" \\ \n \uXXXX). */
function ebnfLiteral(text: string): string {
  return JSON.stringify(text);
}

interface ChoiceNode {
  /** A choice ends here. */
  end: boolean;
  /** The nodes after each next character, in the order the choices first reach them. */
  next: Map<string, ChoiceNode>;
}

/**
 * A choice list as an EBNF grammar that spells the choices as a tree of their common prefixes, each character written
 * once where choices share it (["521", "600", "601"]: root ::= "521" | "60" choice_1, choice_1 ::= "0" | "1"), one
 * rule per place where choices part, so nothing nests however long the shared prefixes. Not the alternatives side
 * by side: XGrammar 0.1.27 merges states of the automaton it builds from those unsoundly, and the grammar
 * "521" | "600" | "601" let "520" through (after "52", the "0" of "600"). Its automaton for a rule is one of bytes,
 * and it merges two states reached by the same byte from the same state (the "6" of "600" and of "601") in the same
 * pass as two states with the same way out (after "52" and after "60", each "1" to the end), which together join
 * states that are neither. A tree of prefixes gives a rule no two ways out of a state on the same byte while its
 * characters are ASCII. Characters outside ASCII may share their first bytes (中 and 丁 both begin E4 B8), which a
 * tree of characters cannot take apart (a string literal holds whole characters), so a branch whose first byte
 * another branch of its place begins with too is a rule of its own, reached by reference: the place's automaton then
 * parts on the rules, not on the bytes. Such a rule ends with a reference, to the next place or to an empty rule,
 * since XGrammar copies a rule that references no other into the rules using it. Checked against XGrammar's matcher,
 * listing every string accepted, over 2,300 random lists of strings of a, b, 中, 丁, 乙 and 1,000 each over a, é,
 * è, 中, 丁, 😀, 😁 and over a, é, è, ü, ñ, 中, 😀: every list took exactly its choices (the tree of characters
 * alone let 18 of 1,000 of the first kind take another string: ["乙中", "丁a", "中", "bb"] took "乙丁a").
 */
export function choiceGrammar(choices: readonly string[]): string {
  const root: ChoiceNode = { end: false, next: new Map() };
  for (const choice of choices) {
    let node = root;
    for (const character of choice) {
      let child = node.next.get(character);
      if (child === undefined) node.next.set(character, child = { end: false, next: new Map() });
      node = child;
    }
    node.end = true;
  }
  const rules: string[] = [];
  const pending: [ChoiceNode, string][] = [[root, 'root']];
  let branches = 0;
  let emptyRule = false;
  for (let at = 0; at < pending.length; at++) {
    const [node, name] = pending[at]!;
    const alternatives = node.end ? ['""'] : [];
    const leadBytes = new Map<number, number>();
    for (const character of node.next.keys()) {
      const lead = Buffer.from(character, 'utf8')[0]!;
      leadBytes.set(lead, (leadBytes.get(lead) ?? 0) + 1);
    }
    for (const [character, child] of node.next) {
      // A run of characters in which no choice parts or ends is one literal.
      let text = character;
      let last = child;
      while (!last.end && last.next.size === 1) {
        const [nextCharacter, nextNode] = last.next.entries().next().value!;
        text += nextCharacter;
        last = nextNode;
      }
      let rest: string | undefined;
      if (last.next.size > 0) {
        rest = `choice_${pending.length}`;
        pending.push([last, rest]);
      }
      if (leadBytes.get(Buffer.from(character, 'utf8')[0]!) === 1) {
        alternatives.push(rest === undefined ? ebnfLiteral(text) : `${ebnfLiteral(text)} ${rest}`);
      } else {
        const branch = `choice_branch_${branches++}`;
        emptyRule ||= rest === undefined;
        rules.push(`${branch} ::= ${ebnfLiteral(text)} ${rest ?? 'choice_end'}`);
        alternatives.push(branch);
      }
    }
    rules.push(`${name} ::= ${alternatives.join(' | ')}`);
  }
  if (emptyRule) rules.push('choice_end ::= ""');
  return rules.join('\n');
}

export function grammarKey(source: GrammarSource): string {
  return JSON.stringify(source);
}

/** Compiles the grammar without a vocabulary (the gateway's check); throws GrammarError naming what failed. */
export function parseGrammar(xg: XGrammar, source: GrammarSource): void {
  xg.run(describe(source), (b) => {
    const grammar = buildGrammar(b, source);
    grammar.delete();
  });
}

function describe(source: GrammarSource): string {
  return source.kind === 'json_schema' ? 'JSON schema' : source.kind === 'regex' ? 'regex' : 'grammar';
}

export function buildGrammar(b: XGrammar['binding'], source: GrammarSource): XgHandle {
  switch (source.kind) {
    case 'json_schema': {
      const grammar = new b.Grammar.FromJSONSchema(source.schema, source.anyWhitespace, undefined, undefined, source.strict, undefined, false);
      if (source.numbers === undefined) return grammar;
      // Its enum and const numbers spelled as JSON writes them: XGrammar's EBNF of the schema, with them in place.
      let ebnf: string;
      try {
        ebnf = grammar.ToString();
      } finally {
        grammar.delete();
      }
      return new b.Grammar.FromEBNF(withNumbers(ebnf, source.numbers), 'root');
    }
    case 'ebnf':
      return new b.Grammar.FromEBNF(source.ebnf, 'root');
    case 'regex':
      return b.Grammar.FromStructuralTag(JSON.stringify({ type: 'structural_tag', format: { type: 'regex', pattern: source.pattern } }));
  }
}

/**
 * A worker's grammars: its vocabulary as XGrammar sees it, a compiler and a cache of compiled grammars, all in one
 * XGrammar instance. When that instance fails (an abort, a trap: XGrammar.run marks it unusable), the next open()
 * starts a fresh one with the same vocabulary, synchronously (between two engine steps), and compiles there; the
 * completions still holding matchers of the failed instance fail at their next grammar call (a GrammarError, which
 * the engine turns into that request's error) while the others go on.
 */
export class GrammarRuntime {
  readonly vocabSize: number;
  private xg: XGrammar;
  private compiler: XgHandle;
  /** Compiled grammars by key, least recently used first. */
  private cache = new Map<string, XgHandle>();
  private readonly cacheLimit: number;
  /** What a fresh instance is given: every token's byte-level text and the ids that end a grammar. */
  private readonly vocabulary: { encoded: string[]; stopTokenIds: readonly number[] };
  /** Instances started to replace a failed one. */
  restarts = 0;
  /**
   * Tokens holding a control character JSON forbids raw inside strings (every byte below 0x20 but \n and \r, so
   * tab too). XGrammar 0.1.27's rule for strings with minLength/maxLength lets them through ([^"\\\r\n]), which
   * would make output JSON.parse refuses; a JSON grammar's matcher never allows them (spaces and newlines remain for
   * whitespace between elements). Also tokens holding a byte that never occurs in UTF-8 (0xC0, 0xC1, 0xF5-0xFF):
   * XGrammar takes 0xF5-0xF7 as the lead of a 4-byte character and 0xC0-0xC1 as that of a 2-byte one, so inside a
   * string such bytes count as one character and decode as several U+FFFD, breaking maxLength.
   */
  private readonly jsonForbidden: Int32Array;

  /** Token ids by their text (byte-level, as XGrammar sees them), for turning forced text into tokens. */
  private readonly pieces: TokenPieces;
  /** Every token's bytes, for the whitespace bound of JSON grammars (JsonWhitespaceBound). */
  private readonly jsonBytes: JsonTokenBytes;

  /** The ids that end a grammar (the matcher's stop tokens), undefined when the tokenizer names none. */
  private readonly stopTokens: ReadonlySet<number> | undefined;

  private constructor(xg: XGrammar, vocabulary: GrammarRuntime['vocabulary'], vocabSize: number, cacheLimit: number,
    jsonForbidden: Int32Array, pieces: TokenPieces, jsonBytes: JsonTokenBytes, stopTokens: readonly number[]) {
    this.xg = xg;
    this.vocabulary = vocabulary;
    this.compiler = vocabularyCompiler(xg, vocabulary, vocabSize);
    this.vocabSize = vocabSize;
    this.cacheLimit = cacheLimit;
    this.jsonForbidden = jsonForbidden;
    this.pieces = pieces;
    this.jsonBytes = jsonBytes;
    this.stopTokens = stopTokens.length > 0 ? new Set(stopTokens) : undefined;
  }

  /**
   * Loads XGrammar and hands it the vocabulary: every token as its exact bytes (tokenBytes; special tokens give none
   * and are never allowed), the model's end-of-generation ids as the tokens that end a grammar. `vocabSize` is the
   * width of a logits row (it may exceed the tokenizer's).
   */
  static async create(tokenizer: Tokenizer, vocabSize = tokenizer.vocabSize, cacheLimit = 64): Promise<GrammarRuntime> {
    const xg = await XGrammar.load();
    const table = byteLevelChars();
    const encoded: string[] = new Array(vocabSize);
    const bytes: Uint8Array[] = new Array(vocabSize);
    const jsonForbidden: number[] = [];
    for (let id = 0; id < vocabSize; id++) {
      let text = '';
      let control = false; // or a byte never in UTF-8 (see jsonForbidden)
      bytes[id] = id < tokenizer.vocabSize ? tokenizer.tokenBytes(id, false) : new Uint8Array(0);
      if (id < tokenizer.vocabSize) {
        for (const byte of bytes[id]!) {
          text += table[byte];
          if ((byte < 0x20 && byte !== 0x0a && byte !== 0x0d) || byte === 0xc0 || byte === 0xc1 || byte >= 0xf5) control = true;
        }
      }
      encoded[id] = text;
      if (control) jsonForbidden.push(id);
    }
    // One id per text; a byte-fallback token (<0x41>) gives way to the ordinary token of the same byte.
    const pieces: TokenPieces = { idByText: new Map(), maxLength: 0 };
    for (let id = 0; id < Math.min(vocabSize, tokenizer.vocabSize); id++) {
      const text = encoded[id]!;
      if (text === '' || tokenizer.isSpecial(id)) continue;
      const held = pieces.idByText.get(text);
      if (held !== undefined && !isByteFallback(tokenizer, held)) continue;
      pieces.idByText.set(text, id);
      if (text.length > pieces.maxLength) pieces.maxLength = text.length;
    }
    return new GrammarRuntime(xg, { encoded, stopTokenIds: [...tokenizer.stopTokenIds] }, vocabSize, cacheLimit,
      Int32Array.from(jsonForbidden), pieces, new JsonTokenBytes(bytes), tokenizer.stopTokenIds);
  }

  /**
   * A matcher for one completion, positioned at the start of the output (on a fresh instance if the last one
   * failed). Throws GrammarError if it cannot compile.
   */
  open(spec: GuidedDecoding): GuidedSequence {
    const source = grammarSource(spec);
    if (!this.xg.usable) this.restart();
    const compiled = this.compiled(source);
    const handle = this.xg.run('grammar matcher', (b) => new b.GrammarMatcher(compiled, undefined, false, -1));
    const json = source.kind === 'json_schema';
    return new GuidedSequence(this.xg, handle, this.vocabSize, json ? this.jsonForbidden : undefined, this.pieces, this.stopTokens,
      json && source.anyWhitespace ? new JsonWhitespaceBound(this.jsonBytes, JSON_MAX_WHITESPACE) : undefined);
  }

  /**
   * A fresh instance in place of the failed one: its compiler over the same vocabulary, an empty cache. The failed
   * instance's handles are not deleted (its memory is not touched again): they go with it.
   */
  private restart(): void {
    this.cache = new Map();
    try {
      const xg = XGrammar.startSync();
      this.compiler = vocabularyCompiler(xg, this.vocabulary, this.vocabSize);
      this.xg = xg;
    } catch (error) {
      // The failed instance stays in place: the next open() tries again.
      throw new GrammarError(`the grammar engine failed and could not be restarted: ${(error as Error).message}`);
    }
    this.restarts++;
  }

  /** Whether the current instance is sound (false once it failed, until the next open() replaces it). */
  get usable(): boolean {
    return this.xg.usable;
  }

  private compiled(source: GrammarSource): XgHandle {
    const key = grammarKey(source);
    const hit = this.cache.get(key);
    if (hit !== undefined) {
      this.cache.delete(key);
      this.cache.set(key, hit);
      return hit;
    }
    const compiled = this.xg.run(describe(source), () => {
      // A schema with numbers to spell goes through its EBNF (buildGrammar).
      if (source.kind === 'json_schema' && source.numbers === undefined) {
        return this.compiler.CompileJSONSchema(source.schema, source.anyWhitespace, undefined, undefined, source.strict, undefined);
      }
      const grammar = buildGrammar(this.xg.binding, source);
      try {
        return this.compiler.CompileGrammar(grammar);
      } finally {
        grammar.delete();
      }
    });
    this.cache.set(key, compiled);
    if (this.cache.size > this.cacheLimit) {
      const [oldestKey, oldest] = this.cache.entries().next().value as [string, XgHandle];
      this.cache.delete(oldestKey);
      oldest.delete(); // matchers hold their own reference to the compiled grammar
    }
    return compiled;
  }
}

/** A compiler over the vocabulary, on `xg`. */
function vocabularyCompiler(xg: XGrammar, vocabulary: GrammarRuntime['vocabulary'], vocabSize: number): XgHandle {
  return xg.run('vocabulary', (b) => {
    const info = new b.TokenizerInfo(b.vecStringFromJSArray(vocabulary.encoded), 'BYTE_LEVEL', vocabSize,
      b.vecIntFromJSArray([...vocabulary.stopTokenIds]), false);
    return new b.GrammarCompiler(info, 1, false);
  });
}

/** A vocabulary's tokens by text, for jump-forward. */
interface TokenPieces {
  /** Byte-level text (byteLevelChars) -> token id. */
  idByText: Map<string, number>;
  /** The longest text, in characters. */
  maxLength: number;
}

function isByteFallback(tokenizer: Tokenizer, id: number): boolean {
  return /^<0x[0-9A-Fa-f]{2}>$/.test(tokenizer.idToToken(id) ?? '');
}

/**
 * The least allowed weight GuidedSequence.maskedDraw draws from (the row's max weighs 1): far above float64's
 * smallest normal numbers, so no allowed token's share is lost to underflow beyond its rounding.
 */
export const MIN_MASKED_WEIGHT = 1e-250;

/** Longest forced run turned into tokens per call (a bound on one step's appended tokens). */
export const MAX_FORCED_TOKENS = 64;

/** One completion's grammar state. */
export class GuidedSequence {
  private readonly xg: XGrammar;
  private handle: XgHandle;
  readonly vocabSize: number;

  /** Tokens never allowed whatever the grammar says (see GrammarRuntime.jsonForbidden). */
  private readonly forbidden: Int32Array | undefined;
  private readonly pieces: TokenPieces | undefined;
  /**
   * How many of a greedy row's best tokens, or of a sampled row's draws, are tried before the mask
   * (greedyGuidedToken and drawGuidedToken in sampling.ts): narrow at the start and after a mask, wide after a token
   * taken without one.
   */
  candidateWidth = NARROW_CANDIDATES;
  /** The last greedy token was its row's argmax (greedyGuidedToken then tries the argmax alone first). */
  argmaxTaken = false;

  /**
   * Whether the matcher has ended, kept here: with the matcher's stop tokens given (and no termination without
   * one), XGrammar ends only by accepting a stop token, so it is asked again only after one (after every token when
   * the stop set is not known here).
   */
  private terminated: boolean;
  private readonly stopTokens: ReadonlySet<number> | undefined;
  /** A JSON grammar's bound on whitespace runs, kept beside the matcher (JsonWhitespaceBound). */
  private readonly whitespace: JsonWhitespaceBound | undefined;

  constructor(xg: XGrammar, handle: XgHandle, vocabSize: number, forbidden?: Int32Array, pieces?: TokenPieces,
    stopTokens?: ReadonlySet<number>, whitespace?: JsonWhitespaceBound) {
    this.xg = xg;
    this.handle = handle;
    this.vocabSize = vocabSize;
    this.forbidden = forbidden;
    this.pieces = pieces;
    this.stopTokens = stopTokens;
    this.whitespace = whitespace;
    this.terminated = xg.run('grammar matcher', () => handle.IsTerminated() as boolean);
  }

  /**
   * Jump-forward: the tokens spelling the text the grammar forces next (XGrammar's jump-forward string), each
   * accepted, so the state is past them. The text is cut greedily into the longest vocabulary tokens; the last
   * piece is left to the model, since the text after it could join it into a longer token (so a forced text of one
   * token gives none). At most MAX_FORCED_TOKENS.
   */
  forcedTokens(): number[] {
    try {
      return this.forcedTokensOf();
    } catch (error) {
      // The instance failed: nothing forced; the completion's next grammar call fails it (sampleGuidedRow).
      if (error instanceof GrammarError) return [];
      throw error;
    }
  }

  private forcedTokensOf(): number[] {
    const pieces = this.pieces;
    if (pieces === undefined) return [];
    const forced = this.jumpForwardString();
    if (forced === '') return [];
    const table = byteLevelChars();
    let text = '';
    for (const byte of Buffer.from(forced, 'utf8')) text += table[byte];
    const ids: number[] = [];
    let at = 0;
    while (at < text.length && ids.length <= MAX_FORCED_TOKENS) {
      let id: number | undefined;
      let length = Math.min(pieces.maxLength, text.length - at);
      for (; length > 0; length--) {
        id = pieces.idByText.get(text.slice(at, at + length));
        if (id !== undefined) break;
      }
      if (id === undefined) break;
      ids.push(id);
      at += length;
    }
    ids.pop();
    const tokens: number[] = [];
    for (const id of ids) {
      if (tokens.length === MAX_FORCED_TOKENS || !this.accept(id)) break;
      tokens.push(id);
    }
    return tokens;
  }

  /**
   * Sets every token the grammar does not allow next to -Infinity in `row` (one logits row, vocabSize wide). Words
   * of the mask that allow all 32 tokens are skipped, a run of words that allow none is one fill (a JSON grammar
   * between elements refuses nearly everything), the rest visit only their refused bits. Returns how many tokens the
   * grammar allows (the tokens never allowed, GrammarRuntime.jsonForbidden, counted in: a measure of the state).
   */
  maskRow(row: Float32Array): number {
    const vocabSize = this.vocabSize;
    let allowed = 0;
    this.withMask((words) => {
      const full = vocabSize >>> 5;
      let w = 0;
      while (w < full) {
        const word = words[w]!;
        if (word === -1) {
          allowed += 32;
          w++;
          continue;
        }
        const base = w << 5;
        if (word === 0) {
          let end = w + 1;
          while (end < full && words[end] === 0) end++;
          row.fill(-Infinity, base, end << 5);
          w = end;
          continue;
        }
        let refused = ~word;
        allowed += 32;
        while (refused !== 0) {
          row[base + 31 - Math.clz32(refused & -refused)] = -Infinity;
          refused &= refused - 1;
          allowed--;
        }
        w++;
      }
      for (let id = full << 5; id < vocabSize; id++) {
        if (((words[id >>> 5]! >>> (id & 31)) & 1) === 0) row[id] = -Infinity;
        else allowed++;
      }
    });
    if (this.forbidden) for (const id of this.forbidden) row[id] = -Infinity;
    return allowed;
  }

  /**
   * The allowed token with the largest value in `row` (ties to the lowest id), or -1 when every allowed token is
   * -Infinity: the argmax of the row maskRow would leave, without writing the mask into the row. The row must hold no
   * NaN (the caller has scanned it).
   */
  maskedArgmax(row: Float32Array): number {
    const vocabSize = this.vocabSize;
    const forbidden = this.forbidden;
    const whitespace = this.whitespace;
    let best = -1;
    let bestValue = -Infinity;
    // The whitespace bound is checked only on a token that would become the best (a few per row, where restrict()
    // would look at every allowed token with whitespace).
    this.withMask((words) => {
      // The mask's vector is this call's own copy: the forbidden tokens are cleared in it.
      if (forbidden) for (const id of forbidden) words[id >>> 5]! &= ~(1 << (id & 31));
      const numWords = (vocabSize + 31) >>> 5;
      for (let w = 0; w < numWords; w++) {
        let word = words[w]!;
        if (word === 0) continue;
        const base = w << 5;
        if (word === -1 && base + 32 <= vocabSize) {
          for (let id = base; id < base + 32; id++) {
            const value = row[id]!;
            if (value > bestValue && (whitespace === undefined || whitespace.fits(id))) { bestValue = value; best = id; }
          }
          continue;
        }
        while (word !== 0) {
          const id = base + 31 - Math.clz32(word & -word);
          word &= word - 1;
          if (id >= vocabSize) break;
          const value = row[id]!;
          if (value > bestValue && (whitespace === undefined || whitespace.fits(id))) { bestValue = value; best = id; }
        }
      }
    }, false);
    return best;
  }

  /**
   * A draw from `weights` (one per token, as Sampler.weighRow leaves them) restricted to the allowed tokens, for a
   * uniform in [0, 1) taken from `uniform`: what a draw from the masked row gives (the same distribution, its weights
   * relative to the row's max instead of the allowed tokens' max, to float64 precision), without writing the mask
   * into the row nor weighing it again. -1, no uniform taken, when the allowed tokens' weight is below
   * MIN_MASKED_WEIGHT (none allowed, or all far below the row's max, where float64 would lose them): the caller then
   * masks the row and draws from it.
   */
  maskedDraw(weights: Float64Array, uniform: () => number): number {
    const vocabSize = this.vocabSize;
    const forbidden = this.forbidden;
    let drawn = -1;
    this.withMask((words) => {
      // The mask's vector is this call's own copy: the forbidden tokens are cleared in it.
      if (forbidden) for (const id of forbidden) words[id >>> 5]! &= ~(1 << (id & 31));
      const numWords = (vocabSize + 31) >>> 5;
      let mass = 0;
      for (let w = 0; w < numWords; w++) {
        let word = words[w]!;
        while (word !== 0) {
          const id = (w << 5) + 31 - Math.clz32(word & -word);
          word &= word - 1;
          if (id < vocabSize) mass += weights[id]!;
        }
      }
      if (!(mass >= MIN_MASKED_WEIGHT)) return;
      const target = uniform() * mass;
      let cumulative = 0;
      for (let w = 0; w < numWords; w++) {
        let word = words[w]!;
        while (word !== 0) {
          const id = (w << 5) + 31 - Math.clz32(word & -word);
          word &= word - 1;
          if (id >= vocabSize) break;
          const weight = weights[id]!;
          if (weight === 0) continue;
          cumulative += weight;
          drawn = id;
          if (cumulative > target) return;
        }
      }
      // Rounding left the target at the very top of the mass: the last allowed token with a weight.
    });
    return drawn;
  }

  /** The allowed token ids, in increasing order, into `out`; returns how many (the simulated engine draws from them). */
  allowedTokens(out: Int32Array): number {
    let count = 0;
    const vocabSize = this.vocabSize;
    this.withMask((words) => {
      for (let w = 0; w < words.length; w++) {
        let word = words[w]!;
        while (word !== 0) {
          const bit = 31 - Math.clz32(word & -word);
          const id = w * 32 + bit;
          if (id < vocabSize && !this.isForbidden(id)) out[count++] = id;
          word &= word - 1;
        }
      }
    });
    return count;
  }

  /** Advances with a sampled token; false (state unchanged) when the grammar does not allow it. */
  accept(tokenId: number): boolean {
    if (this.isForbidden(tokenId)) return false;
    if (this.whitespace !== undefined && !this.whitespace.fits(tokenId)) return false;
    // Through run(), as every call into the module: an abort there becomes a GrammarError and marks the module
    // unusable, instead of escaping as a bare RuntimeError with the module taken for sound.
    return this.xg.run('accept token', () => {
      if (!(this.handle.AcceptToken(tokenId, false) as boolean)) return false;
      this.whitespace?.advance(tokenId);
      if (this.stopTokens === undefined || this.stopTokens.has(tokenId)) this.terminated = this.handle.IsTerminated() as boolean;
      return true;
    });
  }

  private isForbidden(tokenId: number): boolean {
    const forbidden = this.forbidden;
    if (forbidden === undefined) return false;
    // Sorted ascending (built in id order): binary search.
    let lo = 0;
    let hi = forbidden.length - 1;
    while (lo <= hi) {
      const mid = (lo + hi) >>> 1;
      const value = forbidden[mid]!;
      if (value === tokenId) return true;
      if (value < tokenId) lo = mid + 1;
      else hi = mid - 1;
    }
    return false;
  }

  /** The grammar has accepted an end-of-generation token. */
  get isTerminated(): boolean {
    return this.terminated;
  }

  /** The text the grammar forces next (empty when there is a choice). */
  jumpForwardString(): string {
    // XGrammar aborts on a matcher that has ended; callers check isTerminated first.
    return this.xg.run('jump-forward string', () => this.handle.FindJumpForwardString() as string);
  }

  dispose(): void {
    if (this.handle === null) return;
    // A failed instance's memory is not touched again: the matcher goes with it.
    if (this.xg.usable) {
      try {
        this.xg.run('dispose', () => this.handle.delete());
      } catch (error) {
        if (!(error instanceof GrammarError)) throw error;
      }
    }
    this.handle = null;
  }

  /** Calls `use` with the grammar's mask, the whitespace bound applied to it unless `bounded` is false (the caller
   * then checks it per token). */
  private withMask(use: (words: Int32Array) => void, bounded = true): void {
    const vector = this.xg.run('token mask', () => this.handle.GetNextTokenBitmask(this.vocabSize));
    try {
      const words = this.xg.binding.vecIntToView(vector);
      if (bounded) this.whitespace?.restrict(words);
      use(words);
    } finally {
      vector.delete();
    }
  }
}

export { GrammarError };

/** One runtime per vocabulary, loaded on first use and shared by whoever holds the loader (a pool's workers). */
export class GrammarLoader {
  private runtime: GrammarRuntime | undefined;
  private loading: Promise<GrammarRuntime> | undefined;

  constructor(private readonly tokenizer: Tokenizer, private readonly vocabSize = tokenizer.vocabSize) {}

  /** The runtime once loaded (undefined before). */
  get current(): GrammarRuntime | undefined {
    return this.runtime;
  }

  load(): Promise<GrammarRuntime> {
    this.loading ??= GrammarRuntime.create(this.tokenizer, this.vocabSize).then((runtime) => {
      this.runtime = runtime;
      return runtime;
    }, (error: unknown) => {
      this.loading = undefined;
      throw error;
    });
    return this.loading;
  }
}
