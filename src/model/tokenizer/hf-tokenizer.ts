// The Tokenizer over a Hugging Face tokenizer.json (plus tokenizer_config.json), encoding and decoding through
// @huggingface/tokenizers. What the library does not offer is added here from the JSON itself:
// - parseSpecial: the library always recognises added tokens in text; a second instance, whose added-token list
//   keeps only the non-special ones, encodes text where "<|eot_id|>" must stay plain characters;
// - BOS/EOS: taken from the post-processor (TemplateProcessing, Bert/Roberta), adjusted by tokenizer_config's
//   add_bos_token / add_eos_token when present, and added by this class;
// - tokenBytes: the raw bytes of a token, from the decoder's kind (byte-level, or SentencePiece's "▁" and <0xNN>);
// - pre-tokenizers that split text where Hugging Face's own tokenizers do (Unicode's whitespace, word characters and
//   numerals, punctuation by its behavior), where the library differs (see splitLikeHuggingFace).

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

/** checked: `json` passed checkTokenizerJson already (the model loader's), so it is not walked again. */
export function tokenizerFromJsonObject(json: unknown, tokenizerConfig: Record<string, unknown> = {},
  source = 'tokenizer.json', options: { checked?: boolean } = {}): HfTokenizer {
  if (options.checked !== true) checkTokenizerJson(json, source);
  return new HfTokenizer(json as Json, tokenizerConfig, source);
}

/**
 * What a parsed tokenizer.json must be before anything is built from it: a model Conduit tokenizes with, in the
 * shape that model's vocabulary has, and token ids numbered as the format numbers them. The loader calls this too, so
 * a file that would fail at the first request is refused at load. Gives the number of token ids (the largest + 1).
 */
export function checkTokenizerJson(json: unknown, source = 'tokenizer.json'): number {
  if (!isObject(json) || !isObject(json.model)) {
    throw new TokenizerError(`${source} is not a tokenizer.json (no "model" object)`);
  }
  checkModel(json.model, source);
  return checkTokenIds(json, source);
}

/** The model's type as @huggingface/tokenizers decides it: its "type", else guessed from its fields as the library does. */
function modelType(model: Json): string | undefined {
  if (typeof model.type === 'string') return model.type;
  if (Array.isArray(model.vocab)) return 'Unigram';
  if (isObject(model.vocab) && 'continuing_subword_prefix' in model && 'unk_token' in model) {
    return 'merges' in model ? 'BPE' : 'WordPiece';
  }
  return undefined;
}

/** "<what> is missing" or "<what> is a list, not <expected>". */
function wrongShape(what: string, value: unknown, expected: string): string {
  if (value === undefined) return `${what} is missing (${expected} belongs there)`;
  const shape = Array.isArray(value) ? 'a list' : value === null ? 'null' : typeof value === 'object' ? 'a map' : `a ${typeof value}`;
  return `${what} is ${shape}, not ${expected}`;
}

/**
 * Conduit tokenizes with BPE and Unigram models, the ones causal language models ship. Refused at load rather than
 * failing later:
 * - WordPiece (BERT's): its decoder glues "##" pieces to the word before and puts spaces between words; the streaming
 *   detokenizer joins each token's own bytes, so "hello worlds" would stream as "helloworld##s";
 * - WordLevel, or a model whose type cannot be told: the library runs it as its "Legacy" model, whose ids come out
 *   undefined;
 * - a vocab in the wrong shape: a BPE vocab that is a list (the library takes the list's indices for tokens and
 *   encodes every text to nothing), a Unigram vocab that is a map or whose entries are not [piece, score] pairs;
 * - BPE merges that are missing or malformed (the library fails to build), a Unigram unk_id that names no entry (a
 *   character outside the vocabulary would get no id).
 */
function checkModel(model: Json, source: string): void {
  const type = modelType(model);
  const refuse = (what: string): never => {
    throw new TokenizerError(`${source}: ${what}`);
  };
  if (type === 'BPE') {
    if (!isObject(model.vocab)) refuse(wrongShape("the BPE model's vocab", model.vocab, 'a map of token to id'));
    if (!Array.isArray(model.merges)) refuse(wrongShape("the BPE model's merges list", model.merges, 'a list of merges'));
    const merges = model.merges as unknown[];
    // The library reads every merge in the form of the first: "a b" strings or [a, b] pairs.
    const pairs = Array.isArray(merges[0]);
    merges.forEach((merge, i) => {
      const ok = pairs
        ? Array.isArray(merge) && merge.length === 2 && merge.every((part) => typeof part === 'string')
        : typeof merge === 'string' && merge.includes(' ');
      if (!ok) {
        refuse(`the BPE model's merges[${i}] is ${JSON.stringify(merge)}, not ${pairs ? 'a [left, right] pair of strings, as merges[0] is'
          : 'a "left right" string, as merges[0] is'}`);
      }
    });
    return;
  }
  if (type === 'Unigram') {
    if (!Array.isArray(model.vocab)) refuse(wrongShape("the Unigram model's vocab", model.vocab, 'a list of [piece, score]'));
    const vocab = model.vocab as unknown[];
    vocab.forEach((entry, i) => {
      if (!Array.isArray(entry) || entry.length !== 2 || typeof entry[0] !== 'string' || typeof entry[1] !== 'number') {
        refuse(`the Unigram model's vocab[${i}] is ${JSON.stringify(entry)}, not a [piece, score] pair`);
      }
    });
    const unk = model.unk_id;
    if (typeof unk !== 'number' || !Number.isInteger(unk) || unk < 0 || unk >= vocab.length) {
      refuse(`the Unigram model's unk_id is ${JSON.stringify(unk) ?? 'missing'}, not the index of an entry of its ` +
        `${vocab.length}-entry vocab (text outside the vocabulary would get no token id)`);
    }
    return;
  }
  const why = type === 'WordPiece'
    ? ' (WordPiece decoding joins "##" pieces and spaces words, which streaming token by token cannot reproduce)' : '';
  refuse(`the tokenizer model is ${type ?? 'of no type Conduit can tell (no "type", and no BPE or Unigram vocab)'}; ` +
    `Conduit runs BPE and Unigram tokenizers only${why}`);
}

/**
 * The ids a tokenizer.json gives its tokens: each a whole number from 0, numbered without a large gap, and every
 * added token an object with its id and text. Checked before the library sees the file: an added token numbered 1e9
 * kept it busy for a minute, and an id of 1e12 in the vocabulary made a vocabulary size no table can be built for.
 * Real vocabularies are dense (a few holes at most), so the largest id may be at most twice the number of tokens, or
 * that number plus 65536. Gives the number of ids (the largest + 1).
 */
function checkTokenIds(json: Json, source: string): number {
  const ids = new Set<number>();
  let largest = -1;
  const model = json.model as Json;
  const check = (id: unknown, what: () => string): void => {
    if (typeof id !== 'number' || !Number.isSafeInteger(id) || id < 0) {
      throw new TokenizerError(`${source}: ${what()} has id ${JSON.stringify(id)}, not a whole number >= 0`);
    }
    ids.add(id);
    if (id > largest) largest = id;
  };
  // Added tokens first, so that the vocabulary's pass can find an id it shares with one of them.
  const addedById = new Map<number, string>();
  const addedByText = new Map<string, number>();
  if (json.added_tokens !== undefined && json.added_tokens !== null) {
    if (!Array.isArray(json.added_tokens)) throw new TokenizerError(`${source}: added_tokens is not a list`);
    json.added_tokens.forEach((token: unknown, i) => {
      if (!isObject(token) || typeof token.content !== 'string') {
        throw new TokenizerError(`${source}: added_tokens[${i}] is not a token (an object with "id" and "content")`);
      }
      check(token.id, () => `added token ${JSON.stringify(token.content)}`);
      const id = token.id as number;
      const text = token.content;
      const sameId = addedById.get(id);
      const sameText = addedByText.get(text);
      if ((sameId !== undefined && sameId !== text) || (sameText !== undefined && sameText !== id)) {
        throw new TokenizerError(`${source}: added token ${JSON.stringify(text)} (id ${id}) conflicts with the added ` +
          `token ${JSON.stringify(sameId ?? text)} (id ${sameText ?? id}): one id for two texts, or two ids for one text`);
      }
      addedById.set(id, text);
      addedByText.set(text, id);
    });
  }
  /**
   * An added token and a vocabulary token must agree: the same id, the same text. transformers numbers an added token
   * by its text (the vocabulary's id when the vocabulary has it), and the library here by its "id": an added "<s>"
   * given the id of the vocabulary's "o" would make "o" decode as "<s>", or "hello" and an added "X" encode to one id.
   */
  const agrees = (piece: string, id: number): void => {
    const added = addedById.get(id);
    const addedId = addedByText.get(piece);
    if ((added !== undefined && added !== piece) || (addedId !== undefined && addedId !== id)) {
      const [text, other] = added !== undefined && added !== piece ? [added, id] : [piece, addedId!];
      throw new TokenizerError(`${source}: added token ${JSON.stringify(text)} has id ${other}, but the vocabulary ` +
        `${added !== undefined && added !== piece ? `gives id ${id} to ${JSON.stringify(piece)}` : `gives ${JSON.stringify(piece)} id ${id}`}` +
        ' (an added token that is in the vocabulary has its id there)');
    }
  };
  // Unigram's vocab is a list of [piece, score] whose index is the id, so it defines every id below its length;
  // the others map piece -> id. (for-in: Object.entries of a 150k-token map takes several times longer.)
  const checkAgreement = addedById.size > 0;
  if (isObject(model.vocab)) {
    const vocab = model.vocab;
    for (const piece in vocab) {
      check(vocab[piece], () => `token ${JSON.stringify(piece)}`);
      if (checkAgreement) agrees(piece, vocab[piece] as number);
    }
  } else if (Array.isArray(model.vocab)) {
    for (let id = 0; id < model.vocab.length; id++) {
      check(id, () => `entry ${id}`);
      const entry = model.vocab[id] as unknown;
      if (checkAgreement && Array.isArray(entry) && typeof entry[0] === 'string') agrees(entry[0], id);
    }
  }
  const count = ids.size;
  if (largest >= Math.max(2 * count, count + 65536)) {
    throw new TokenizerError(`${source}: token id ${largest} is far beyond the ${count} tokens the file defines ` +
      '(ids are numbered from 0, without large gaps)');
  }
  checkPostProcessorIds(json, ids, source);
  return largest + 1;
}

/**
 * The ids the post-processor puts around every prompt (TemplateProcessing's special_tokens, Bert/Roberta's cls and
 * sep) go into every request as they are, so each must be a token the file defines: a BOS of 1.5, "1" or 99999 in a
 * 32-token vocabulary loaded, and then every request failed on a token id no client had sent.
 */
function checkPostProcessorIds(json: Json, ids: ReadonlySet<number>, source: string): void {
  const check = (id: unknown, what: string): void => {
    if (typeof id !== 'number' || !ids.has(id)) {
      throw new TokenizerError(`${source}: the post_processor's ${what} is ${JSON.stringify(id) ?? 'missing'}, not the id ` +
        'of a token the file defines');
    }
  };
  // Walked with a list, not recursion: a Sequence nested 100k deep must reach the library, which refuses it as a
  // TokenizerError, rather than overflow the stack here.
  const pending: unknown[] = [json.post_processor];
  while (pending.length > 0) {
    const processor = pending.pop();
    if (!isObject(processor)) continue;
    if (Array.isArray(processor.processors)) for (const inner of processor.processors) pending.push(inner);
    if (processor.type === 'TemplateProcessing' && isObject(processor.special_tokens)) {
      for (const [name, entry] of Object.entries(processor.special_tokens)) {
        if (!isObject(entry) || !Array.isArray(entry.ids)) continue;
        entry.ids.forEach((id: unknown, i) => check(id, `special token ${JSON.stringify(name)} ids[${i}]`));
      }
    } else if ((processor.type === 'BertProcessing' || processor.type === 'RobertaProcessing') &&
      Array.isArray(processor.cls) && Array.isArray(processor.sep)) {
      check(processor.cls[1], 'cls id');
      check(processor.sep[1], 'sep id');
    }
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
      const library = new LibraryTokenizer(withDefaults(json), config);
      this.withSpecial = decodeLikeHuggingFace(splitLikeHuggingFace(library, json.pre_tokenizer), json.decoder);
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
      (c.type === 'Metaspace' && metaspacePrependScheme(c) !== 'never'));

    for (const key of ['add_bos_token', 'add_eos_token']) {
      const value = config[key];
      // Read only as a boolean, a string "false" would otherwise be ignored and the post-processor's choice kept.
      if (value !== undefined && value !== null && typeof value !== 'boolean') {
        throw new TokenizerError(`${source}: tokenizer_config.json ${key} is ${JSON.stringify(value)}, not true or false`);
      }
    }
    this.bosId = this.idOfConfigToken('bos_token');
    this.eosId = this.idOfConfigToken('eos_token');
    // A BOS the prompts must start with that the vocabulary lacks would silently not be added. A missing token that
    // is not asked for (add_bos_token false or unset, or an EOS: its stop is also found by its text) is left out.
    if (this.config.add_bos_token === true && this.bosId === undefined && tokenText(this.config.bos_token) !== undefined) {
      throw new TokenizerError(`${source}: tokenizer_config.json bos_token ${JSON.stringify(tokenText(this.config.bos_token))} `
        + 'is not a token of the vocabulary, and add_bos_token asks for it');
    }
    [this.prefixIds, this.suffixIds] = this.specialTokensAround();
    this.stopTokenIds = this.collectStopIds();
  }

  /** The id of the token tokenizer_config.json names for `key`; undefined when it names none the vocabulary has. */
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
      const json = withDefaults({ ...this.json, added_tokens: added.filter((t) => !t.special) });
      const library = new LibraryTokenizer(json, this.config);
      this.plainInstance = splitLikeHuggingFace(library, this.json.pre_tokenizer);
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

/**
 * GPT-2's pre-tokenizer regex (a ByteLevel pre-tokenizer's, with use_regex) as Hugging Face's tokenizers run it
 * (Oniguruma), and as GPT-2's own encoder (Python's regex) and llama.cpp do: whitespace is Unicode's White_Space,
 * which holds U+0085 (NEL) and not U+FEFF (the byte order mark). The library writes the regex with JavaScript's \s,
 * which holds U+FEFF and not U+0085, so " \u0085've" or " \uFEFFx" split elsewhere and encode to other ids than
 * those of vLLM (the library's own Split pre-tokenizer rewrites \s to \p{White_Space}; its ByteLevel does not).
 */
const GPT2_SPLIT = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\p{White_Space}\p{L}\p{N}]+|\p{White_Space}+(?!\P{White_Space})|\p{White_Space}+/gu;

/** A word character of Rust's regex crate (Unicode's \w), which Hugging Face's tokenizers run their Whitespace regex on. */
const WORD = String.raw`\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}`;
/** The Whitespace pre-tokenizer's `\w+|[^\w\s]+` with Unicode's classes (the library's has JavaScript's ASCII \w). */
const WORDS_AND_SYMBOLS = new RegExp(`[${WORD}]+|[^${WORD}\\p{White_Space}]+`, 'gu');
/** WhitespaceSplit's pieces: runs of what Rust's char::is_whitespace (Unicode's White_Space) is not. */
const NON_WHITESPACE = /\P{White_Space}+/gu;
/** Hugging Face's punctuation: ASCII's, and Unicode's P categories (the library's own class). */
const PUNCTUATION = String.raw`\p{P}\u0021-\u002F\u003A-\u0040\u005B-\u0060\u007B-\u007E`;

/**
 * The Punctuation pre-tokenizer's pieces for its `behavior` (default "Isolated": each mark its own piece); the
 * library made runs of marks one piece whatever the behavior, as only "Contiguous" does.
 */
function punctuationPattern(behavior: unknown): RegExp {
  const mark = `[${PUNCTUATION}]`;
  const text = `[^${PUNCTUATION}]`;
  switch (behavior) {
    case 'Contiguous': return new RegExp(`${text}+|${mark}+`, 'gu');
    case 'Removed': return new RegExp(`${text}+`, 'gu');
    case 'MergedWithPrevious': return new RegExp(`${text}*${mark}|${text}+`, 'gu');
    case 'MergedWithNext': return new RegExp(`${mark}${text}*|${text}+`, 'gu');
    default: return new RegExp(`${text}+|${mark}`, 'gu');
  }
}

/** A pre-tokenizer object of the library, as far as it is read here (the package's type declarations do not resolve). */
interface LibraryPreTokenizer {
  pattern?: RegExp;
  /** A Sequence's pre-tokenizers, in the order of its config's. */
  tokenizers?: (LibraryPreTokenizer | null)[];
  /** Metaspace's. */
  prepend_scheme?: string;
  pre_tokenize_text?: (text: string, options?: unknown) => string[];
}

/** A decoder object of the library, as far as it is read here. */
interface LibraryDecoder {
  /** A Sequence's decoders, in the order of its config's. */
  decoders?: (LibraryDecoder | null)[];
  decode_chain?: (tokens: string[]) => string[];
}

/**
 * A Metaspace config's prepend scheme as Hugging Face's tokenizers read it: prepend_scheme, else "never" for the
 * older add_prefix_space false, else "always".
 */
function metaspacePrependScheme(config: Json): unknown {
  return config.prepend_scheme ?? (config.add_prefix_space === false ? 'never' : 'always');
}

/** `text` cut before every `mark` but at its start ("▁Hey▁▁you" -> "▁Hey", "▁", "▁you"), as Metaspace's split does. */
function splitBefore(text: string, mark: string): string[] {
  const pieces: string[] = [];
  let start = 0;
  for (let at = text.indexOf(mark, 1); at > 0; at = text.indexOf(mark, at + mark.length)) {
    pieces.push(text.slice(start, at));
    start = at;
  }
  pieces.push(text.slice(start));
  return pieces;
}

/**
 * The library's tokenizer with its pre-tokenizers splitting text where Hugging Face's tokenizers do (and so vLLM):
 * ByteLevel's regex (GPT2_SPLIT), Whitespace's (WORDS_AND_SYMBOLS: with JavaScript's ASCII \w the library cut "café"
 * into "caf" and "é"), WhitespaceSplit's (NON_WHITESPACE), Digits' (any numeral) and Punctuation's (its behavior).
 * Each object is told by the config it was built from (`preTokenizerConfig`, the tokenizer.json's pre_tokenizer).
 */
function splitLikeHuggingFace(library: LibraryTokenizer, preTokenizerConfig: unknown): LibraryTokenizer {
  const pending: [LibraryPreTokenizer | null | undefined, unknown][] = [[library.pre_tokenizer, preTokenizerConfig]];
  while (pending.length > 0) {
    const [preTokenizer, config] = pending.pop()!;
    if (!preTokenizer || !isObject(config)) continue;
    switch (config.type) {
      case 'ByteLevel':
        if (preTokenizer.pattern instanceof RegExp) preTokenizer.pattern = new RegExp(GPT2_SPLIT);
        break;
      case 'Whitespace':
        preTokenizer.pre_tokenize_text = (text) => text.match(WORDS_AND_SYMBOLS) ?? [];
        break;
      case 'WhitespaceSplit':
        preTokenizer.pre_tokenize_text = (text) => text.match(NON_WHITESPACE) ?? [];
        break;
      case 'Punctuation':
        if (preTokenizer.pattern instanceof RegExp) preTokenizer.pattern = punctuationPattern(config.behavior);
        break;
      case 'Digits':
        // Rust's char::is_numeric: any of Unicode's N categories ("²", "٣"), where the library had ASCII's \d.
        if (preTokenizer.pattern instanceof RegExp) {
          preTokenizer.pattern = config.individual_digits === true ? /[^\p{N}]+|\p{N}/gu : /[^\p{N}]+|\p{N}+/gu;
        }
        break;
      case 'Metaspace': {
        // The library ignores split (cut before each replacement character; Hugging Face's default true) and the
        // older add_prefix_space false, so "a  b" or an unprefixed text split and encoded otherwise than there.
        preTokenizer.prepend_scheme = String(metaspacePrependScheme(config));
        const original = preTokenizer.pre_tokenize_text?.bind(preTokenizer);
        if (config.split !== false && original) {
          const mark = typeof config.replacement === 'string' ? config.replacement : '\u2581';
          preTokenizer.pre_tokenize_text = (text, options) =>
            original(text, options).flatMap((piece) => splitBefore(piece, mark));
        }
        break;
      }
      case 'Sequence': {
        const inner = preTokenizer.tokenizers;
        if (Array.isArray(config.pretokenizers) && Array.isArray(inner)) {
          config.pretokenizers.forEach((innerConfig: unknown, i) => pending.push([inner[i], innerConfig]));
        }
        break;
      }
    }
  }
  return library;
}

/**
 * The library's tokenizer with a Metaspace decoder of prepend scheme "never" keeping the first token's leading space,
 * as Hugging Face's does (the library's drops it whatever the scheme). `decoderConfig`: the tokenizer.json's decoder.
 */
function decodeLikeHuggingFace(library: LibraryTokenizer, decoderConfig: unknown): LibraryTokenizer {
  const pending: [LibraryDecoder | null | undefined, unknown][] = [[library.decoder, decoderConfig]];
  while (pending.length > 0) {
    const [decoder, config] = pending.pop()!;
    if (!decoder || !isObject(config)) continue;
    if (config.type === 'Metaspace' && metaspacePrependScheme(config) === 'never') {
      const mark = typeof config.replacement === 'string' ? config.replacement : '\u2581';
      decoder.decode_chain = (tokens) => tokens.map((token) => token.replaceAll(mark, ' '));
    } else if (config.type === 'Sequence' && Array.isArray(config.decoders) && Array.isArray(decoder.decoders)) {
      const inner = decoder.decoders;
      config.decoders.forEach((innerConfig: unknown, i) => pending.push([inner[i], innerConfig]));
    }
  }
  return library;
}

/** The library insists on every top-level component key being present, even as null. */
function withDefaults(json: Json): Json {
  return { normalizer: null, pre_tokenizer: null, post_processor: null, decoder: null, added_tokens: [], ...json };
}
