// The Tokenizer over a Hugging Face tokenizer.json (plus tokenizer_config.json), encoding and decoding through
// @huggingface/tokenizers. What the library does not offer is added here from the JSON itself:
// - parseSpecial: the library always recognises added tokens in text; a second instance, whose added-token list
//   keeps only the non-special ones, encodes text where "<|eot_id|>" must stay plain characters;
// - BOS/EOS: taken from the post-processor (TemplateProcessing, Bert/Roberta), adjusted by tokenizer_config's
//   add_bos_token / add_eos_token when present, and added by this class;
// - tokenBytes: the raw bytes of a token, from the decoder's kind (byte-level, or SentencePiece's "▁" and <0xNN>).

import { readFileSync } from 'node:fs';
import { Tokenizer as LibraryTokenizer } from '@huggingface/tokenizers';
import { byteLevelToBytes } from './byte-level.ts';
import { TokenizerError } from './errors.ts';
import { endIsMidTurn, STOP_TEXTS } from './stop-texts.ts';
import type { EncodeOptions, Tokenizer, TokenizerWorkerSource } from './types.ts';

type Json = Record<string, unknown>;

interface AddedTokenJson {
  id: number;
  content: string;
  special?: boolean;
  lstrip?: boolean;
  rstrip?: boolean;
}

const EMPTY = new Uint8Array(0);
const utf8 = new TextEncoder();
const BYTE_TOKEN = /^<0x([0-9A-Fa-f]{2})>$/;

export function tokenizerFromJson(tokenizerJsonPath: string,
  tokenizerConfig: Record<string, unknown> = {}): HfTokenizer {
  let json: unknown;
  try {
    json = JSON.parse(readFileSync(tokenizerJsonPath, 'utf8'));
  } catch (error) {
    throw new TokenizerError(`cannot read tokenizer.json at ${tokenizerJsonPath}: ${(error as Error).message}`);
  }
  return tokenizerFromJsonObject(json, tokenizerConfig, tokenizerJsonPath);
}

export function tokenizerFromJsonObject(json: unknown, tokenizerConfig: Record<string, unknown> = {},
  source = 'tokenizer.json'): HfTokenizer {
  if (!isObject(json) || !isObject(json.model)) {
    throw new TokenizerError(`${source} is not a tokenizer.json (no "model" object)`);
  }
  checkTokenIds(json, source);
  return new HfTokenizer(json, tokenizerConfig, source);
}

/**
 * The ids a tokenizer.json gives its tokens: each a whole number from 0, numbered without a large gap, and every
 * added token an object with its id and text. Checked before the library sees the file: an added token numbered 1e9
 * kept it busy for a minute, and an id of 1e12 in the vocabulary made a vocabulary size no table can be built for.
 * Real vocabularies are dense (a few holes at most), so the largest id may be at most twice the number of tokens, or
 * that number plus 65536.
 */
function checkTokenIds(json: Json, source: string): void {
  const ids: number[] = [];
  const model = json.model as Json;
  const check = (id: unknown, what: string): void => {
    if (typeof id !== 'number' || !Number.isSafeInteger(id) || id < 0) {
      throw new TokenizerError(`${source}: ${what} has id ${JSON.stringify(id)}, not a whole number >= 0`);
    }
    ids.push(id);
  };
  // Unigram's vocab is a list of [piece, score] whose index is the id; the others map piece -> id.
  if (isObject(model.vocab)) {
    for (const [piece, id] of Object.entries(model.vocab)) check(id, `token ${JSON.stringify(piece)}`);
  } else if (Array.isArray(model.vocab)) {
    ids.push(model.vocab.length - 1);
  }
  if (json.added_tokens !== undefined && json.added_tokens !== null) {
    if (!Array.isArray(json.added_tokens)) throw new TokenizerError(`${source}: added_tokens is not a list`);
    json.added_tokens.forEach((token: unknown, i) => {
      if (!isObject(token) || typeof token.content !== 'string') {
        throw new TokenizerError(`${source}: added_tokens[${i}] is not a token (an object with "id" and "content")`);
      }
      check(token.id, `added token ${JSON.stringify(token.content)}`);
    });
  }
  const count = new Set(ids).size;
  const largest = ids.reduce((a, b) => Math.max(a, b), -1);
  if (largest >= Math.max(2 * count, count + 65536)) {
    throw new TokenizerError(`${source}: token id ${largest} is far beyond the ${count} tokens the file defines ` +
      '(ids are numbered from 0, without large gaps)');
  }
}

// ---------------------------------------------------------------------------------------------------------------
// JSON helpers

function isObject(value: unknown): value is Json {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/** A component and, for Sequence components, everything inside it. */
function flatten(component: unknown): Json[] {
  if (!isObject(component)) return [];
  const inner = [component.decoders, component.pretokenizers, component.normalizers, component.processors]
    .find(Array.isArray) as unknown[] | undefined;
  return inner ? [component, ...inner.flatMap(flatten)] : [component];
}

/** tokenizer_config writes special tokens as a string or as an AddedToken object. */
function tokenText(value: unknown): string | undefined {
  if (typeof value === 'string') return value;
  if (isObject(value) && typeof value.content === 'string') return value.content;
  return undefined;
}

// ---------------------------------------------------------------------------------------------------------------
// The tokenizer

type TokenSpelling = 'byte-level' | 'sentencepiece' | 'plain';

export class HfTokenizer implements Tokenizer {
  readonly vocabSize: number;
  readonly bosId: number | undefined;
  readonly eosId: number | undefined;
  readonly stopTokenIds: readonly number[];
  readonly stripsLeadingSpace: boolean;

  private readonly withSpecial: LibraryTokenizer;
  private plainInstance: LibraryTokenizer | undefined;
  private readonly addedById = new Map<number, AddedTokenJson>();
  private readonly spelling: TokenSpelling;
  private readonly metaspace: string;
  private readonly prefixIds: number[];
  private readonly suffixIds: number[];

  constructor(private readonly json: Json, private readonly config: Record<string, unknown>, source: string) {
    const added = Array.isArray(json.added_tokens) ? json.added_tokens as AddedTokenJson[] : [];
    for (const token of added) this.addedById.set(token.id, token);
    try {
      this.withSpecial = new LibraryTokenizer(withDefaults(json), config);
    } catch (error) {
      throw new TokenizerError(`${source}: @huggingface/tokenizers cannot load it: ${(error as Error).message}`);
    }

    let maxId = -1;
    for (const id of this.withSpecial.get_vocab(true).values()) maxId = Math.max(maxId, id);
    this.vocabSize = maxId + 1;

    const decoders = flatten(json.decoder);
    const preTokenizers = flatten(json.pre_tokenizer);
    const hasType = (list: Json[], type: string) => list.some((c) => c.type === type);
    if (hasType(decoders, 'ByteLevel') || hasType(preTokenizers, 'ByteLevel')) this.spelling = 'byte-level';
    else if (hasType(decoders, 'ByteFallback') || hasType(decoders, 'Metaspace') ||
      decoders.some((c) => c.type === 'Replace' && isObject(c.pattern) && c.pattern.String === '\u2581')) {
      this.spelling = 'sentencepiece';
    } else this.spelling = 'plain';
    const metaspaceDecoder = decoders.find((c) => c.type === 'Metaspace');
    this.metaspace = typeof metaspaceDecoder?.replacement === 'string' ? metaspaceDecoder.replacement : '\u2581';
    this.stripsLeadingSpace = decoders.some((c) =>
      (c.type === 'Strip' && c.content === ' ' && Number(c.start) > 0) ||
      (c.type === 'Metaspace' && (c.prepend_scheme === 'always' || c.prepend_scheme === 'first' ||
        (c.prepend_scheme === undefined && c.add_prefix_space === true))));

    this.bosId = this.idOfConfigToken('bos_token');
    this.eosId = this.idOfConfigToken('eos_token');
    [this.prefixIds, this.suffixIds] = this.specialTokensAround();
    this.stopTokenIds = this.collectStopIds();
  }

  private idOfConfigToken(key: string): number | undefined {
    const text = tokenText(this.config[key]);
    return text === undefined ? undefined : this.withSpecial.token_to_id(text);
  }

  /** The ids the post-processor puts before and after a single sequence, with the config's overrides. */
  private specialTokensAround(): [number[], number[]] {
    let prefix: number[] = [];
    let suffix: number[] = [];
    for (const processor of flatten(this.json.post_processor)) {
      if (processor.type === 'TemplateProcessing' && Array.isArray(processor.single)) {
        const specials = isObject(processor.special_tokens) ? processor.special_tokens : {};
        let seenSequence = false;
        for (const piece of processor.single as Json[]) {
          if (isObject(piece.Sequence)) { seenSequence = true; continue; }
          const name = isObject(piece.SpecialToken) ? piece.SpecialToken.id : undefined;
          const entry = typeof name === 'string' ? specials[name] : undefined;
          const ids = isObject(entry) && Array.isArray(entry.ids) ? entry.ids as number[] : [];
          (seenSequence ? suffix : prefix).push(...ids);
        }
      } else if ((processor.type === 'BertProcessing' || processor.type === 'RobertaProcessing') &&
        Array.isArray(processor.cls) && Array.isArray(processor.sep)) {
        prefix = [Number(processor.cls[1])];
        suffix = [Number(processor.sep[1])];
      }
    }
    const { add_bos_token: addBos, add_eos_token: addEos } = this.config;
    if (this.bosId !== undefined && typeof addBos === 'boolean') {
      prefix = prefix.filter((id) => id !== this.bosId);
      if (addBos) prefix.unshift(this.bosId);
    }
    if (this.eosId !== undefined && typeof addEos === 'boolean') {
      suffix = suffix.filter((id) => id !== this.eosId);
      if (addEos) suffix.push(this.eosId);
    }
    return [prefix, suffix];
  }

  private collectStopIds(): number[] {
    const ids = new Set<number>();
    if (this.eosId !== undefined) ids.add(this.eosId);
    const specialIdByText = new Map<string, number>();
    for (const token of this.addedById.values()) specialIdByText.set(token.content, token.id);
    for (const text of STOP_TEXTS) {
      const id = specialIdByText.get(text);
      if (id !== undefined) ids.add(id);
    }
    if (endIsMidTurn((text) => specialIdByText.has(text)) && specialIdByText.get('<|end|>') !== this.eosId) {
      ids.delete(specialIdByText.get('<|end|>')!);
    }
    return [...ids].sort((a, b) => a - b);
  }

  private bytesPerTokenBound: number | undefined | null = null;

  /**
   * A bound only for the tokenizers known to keep every input byte in some token and never to shrink text: a BPE
   * model that does not fuse unknown characters (or falls back to bytes), normalizers that only prepend or replace a
   * string by one at least as long, pre-tokenizers that split without removing. Anything else (NFC/NFKC, Strip,
   * Whitespace, WordPiece, Unigram's fused unknowns ...) gets no bound.
   */
  maxBytesPerToken(): number | undefined {
    if (this.bytesPerTokenBound !== null) return this.bytesPerTokenBound;
    const model = this.json.model as Json;
    const bpeKeepsBytes = model.type === 'BPE' && (model.fuse_unk !== true || model.byte_fallback === true);
    const normalizersKeep = flatten(this.json.normalizer).every((c) => c.type === 'Sequence' || c.type === 'Prepend'
      || (c.type === 'Replace' && isObject(c.pattern) && typeof c.pattern.String === 'string' && typeof c.content === 'string'
        && Buffer.byteLength(c.content) >= Buffer.byteLength(c.pattern.String)));
    const preTokenizersKeep = flatten(this.json.pre_tokenizer).every((c) =>
      ['Sequence', 'ByteLevel', 'Metaspace', 'Digits', 'Punctuation', 'Split'].includes(String(c.type))
      && c.behavior !== 'Removed');
    // An added token that strips the whitespace beside it (Phi-3's) leaves that whitespace in no token.
    const added = (this.json.added_tokens as AddedTokenJson[] | undefined) ?? [];
    const addedKeep = added.every((token) => token.lstrip !== true && token.rstrip !== true);
    if (!bpeKeepsBytes || !normalizersKeep || !preTokenizersKeep || !addedKeep) {
      this.bytesPerTokenBound = undefined;
      return undefined;
    }
    // An unknown character is at most 4 bytes of UTF-8; every other token stands for at most its spelling's bytes.
    let longest = 4;
    for (const piece of this.withSpecial.get_vocab(true).keys()) longest = Math.max(longest, Buffer.byteLength(piece, 'utf8'));
    this.bytesPerTokenBound = longest;
    return longest;
  }

  workerSource(): TokenizerWorkerSource {
    return { kind: 'hf', json: this.json, config: this.config };
  }

  // -------------------------------------------------------------------------------------------------------------
  // Encoding and decoding

  encode(text: string, options: EncodeOptions = {}): number[] {
    const addSpecial = options.addSpecialTokens ?? true;
    const library = options.parseSpecial ? this.withSpecial : this.plain();
    const body = text.length > 0 ? library.encode(text, { add_special_tokens: false }).ids : [];
    return addSpecial ? [...this.prefixIds, ...body, ...this.suffixIds] : body;
  }

  /** The library with only the non-special added tokens, built when first needed. */
  private plain(): LibraryTokenizer {
    if (!this.plainInstance) {
      const added = (this.json.added_tokens as AddedTokenJson[] | undefined) ?? [];
      this.plainInstance = new LibraryTokenizer(
        withDefaults({ ...this.json, added_tokens: added.filter((t) => !t.special) }), this.config);
    }
    return this.plainInstance;
  }

  /** Through the library's decoder, with no "clean up tokenization spaces" pass (decode must be lossless). */
  decode(ids: readonly number[], options: { skipSpecialTokens?: boolean } = {}): string {
    for (const id of ids) this.checkId(id);
    if (ids.length === 0) return '';
    return this.withSpecial.decode([...ids], {
      skip_special_tokens: options.skipSpecialTokens ?? true,
      clean_up_tokenization_spaces: false,
    });
  }

  tokenBytes(id: number, includeSpecial = false): Uint8Array {
    this.checkId(id);
    const added = this.addedById.get(id);
    if (added) return added.special && !includeSpecial ? EMPTY : utf8.encode(added.content);
    const token = this.withSpecial.id_to_token(id);
    if (token === undefined) return EMPTY;
    switch (this.spelling) {
      case 'byte-level': return byteLevelToBytes(token);
      case 'sentencepiece': {
        const byte = BYTE_TOKEN.exec(token);
        return byte ? Uint8Array.of(parseInt(byte[1]!, 16)) : utf8.encode(token.replaceAll(this.metaspace, ' '));
      }
      case 'plain': return utf8.encode(token);
    }
  }

  // -------------------------------------------------------------------------------------------------------------
  // Lookups

  isSpecial(id: number): boolean {
    this.checkId(id);
    return this.addedById.get(id)?.special === true;
  }

  idToToken(id: number): string | undefined {
    return Number.isInteger(id) && id >= 0 && id < this.vocabSize ? this.withSpecial.id_to_token(id) : undefined;
  }

  tokenToId(token: string): number | undefined {
    return this.withSpecial.token_to_id(token);
  }

  private checkId(id: number): void {
    if (!Number.isInteger(id) || id < 0 || id >= this.vocabSize) {
      throw new TokenizerError(`token id ${id} is out of range (vocabulary has ${this.vocabSize} tokens)`);
    }
  }
}

/** The library insists on every top-level component key being present, even as null. */
function withDefaults(json: Json): Json {
  return { normalizer: null, pre_tokenizer: null, post_processor: null, decoder: null, added_tokens: [], ...json };
}
