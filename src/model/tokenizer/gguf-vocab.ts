// A GGUF vocabulary read into tables: token texts and types, scores or merges, the special token ids, and the
// add-BOS/EOS flags, with llama.cpp's defaults where the file is silent.

import type { GgufFile } from '../gguf.ts';
import { GgufValueType, metaBool, metaNumber, metaString } from '../gguf.ts';
import { TokenizerError } from './errors.ts';
import { preTokenizerSpec } from './pre-tokenizers.ts';
import { END_OF_MESSAGE_TEXTS, END_OF_TURN_TEXTS, endIsMidTurn, STOP_TEXTS } from './stop-texts.ts';

/** `tokenizer.ggml.token_type` values, as written by the GGUF converters. */
export enum GgufTokenType {
  UNDEFINED = 0,
  NORMAL = 1,
  UNKNOWN = 2,
  CONTROL = 3,
  USER_DEFINED = 4,
  UNUSED = 5,
  BYTE = 6,
}

/** Per-token flags (a token may gain CONTROL or RSTRIP on top of its type, see below). */
export const TokenAttr = {
  UNKNOWN: 1 << 0,
  UNUSED: 1 << 1,
  NORMAL: 1 << 2,
  CONTROL: 1 << 3,
  USER_DEFINED: 1 << 4,
  BYTE: 1 << 5,
  /** Whitespace before the token is dropped when it is recognised in text. */
  LSTRIP: 1 << 6,
  /** Whitespace after the token is dropped when it is recognised in text. */
  RSTRIP: 1 << 7,
} as const;

const ATTR_OF_TYPE: Record<number, number> = {
  [GgufTokenType.UNDEFINED]: 0,
  [GgufTokenType.NORMAL]: TokenAttr.NORMAL,
  [GgufTokenType.UNKNOWN]: TokenAttr.UNKNOWN,
  [GgufTokenType.CONTROL]: TokenAttr.CONTROL,
  [GgufTokenType.USER_DEFINED]: TokenAttr.USER_DEFINED,
  [GgufTokenType.UNUSED]: TokenAttr.UNUSED,
  [GgufTokenType.BYTE]: TokenAttr.BYTE,
};

export type VocabKind = 'spm' | 'bpe';

export interface GgufVocab {
  kind: VocabKind;
  /** `tokenizer.ggml.pre` (BPE only). */
  pre: string | undefined;
  tokens: readonly string[];
  tokenToId: ReadonlyMap<string, number>;
  /** SentencePiece merge priorities (higher merges first). */
  scores: Float32Array;
  /** One TokenAttr bit set per token. */
  attrs: Uint16Array;
  /** BPE merges, "left right", rank = index. */
  merges: readonly string[];
  bosId: number | undefined;
  eosId: number | undefined;
  eotId: number | undefined;
  eomId: number | undefined;
  unkId: number | undefined;
  padId: number | undefined;
  addBos: boolean;
  addEos: boolean;
  /** SentencePiece's dummy prefix: a space before the text (and after every special token). */
  addSpacePrefix: boolean;
  /** Every id that ends generation. */
  endOfGenerationIds: ReadonlySet<number>;
}

// ---------------------------------------------------------------------------------------------------------------
// Reading

function stringArray(file: GgufFile, key: string): string[] | undefined {
  const value = file.metadata.get(key);
  if (value === undefined) return undefined;
  if (!Array.isArray(value) || (value.length > 0 && typeof value[0] !== 'string')) {
    throw new TokenizerError(`GGUF metadata ${key} must be an array of strings`);
  }
  return value as string[];
}

/** How a metadata value is stored, for errors: "an array of INT8", "a STRING". */
function storedAs(file: GgufFile, key: string): string {
  const stored = file.metadataTypes.get(key);
  if (stored === undefined) return 'of an unknown type';
  if (stored.type === GgufValueType.ARRAY) return `an array of ${GgufValueType[stored.arrayType!] ?? 'an unknown type'}`;
  return `a ${GgufValueType[stored.type] ?? 'value of an unknown type'}`;
}

/** At least `length` entries, or an error naming the key and both counts. */
function checkLength<T extends { length: number }>(key: string, value: T, length: number): T {
  if (value.length < length) {
    throw new TokenizerError(`GGUF metadata ${key} has ${value.length} entries for ${length} tokens`);
  }
  return value;
}

/** `tokenizer.ggml.scores`: an array of numbers of any width (converters write FLOAT32). */
function scoreArray(file: GgufFile, key: string, length: number): ArrayLike<number> | undefined {
  const value = file.metadata.get(key);
  if (value === undefined) return undefined;
  if (!ArrayBuffer.isView(value) || value instanceof BigInt64Array || value instanceof BigUint64Array) {
    throw new TokenizerError(`GGUF metadata ${key} is ${storedAs(file, key)}; it must be an array of numbers (FLOAT32)`);
  }
  return checkLength(key, value as Exclude<typeof value, BigInt64Array | BigUint64Array>, length);
}

/**
 * `tokenizer.ggml.token_type`: small enum values, so an array of any integer type says them exactly (converters write
 * INT32; a UINT8 or INT8 array was refused as "not a numeric array"). An array of floats or strings is refused naming
 * the key and its type: llama.cpp reads this key's bytes as INT32 whatever the stored type, so another type means
 * other values there, and no type of token can be read from a float.
 */
function tokenTypeArray(file: GgufFile, key: string, length: number): ArrayLike<number> | undefined {
  const value = file.metadata.get(key);
  if (value === undefined) return undefined;
  if (value instanceof BigInt64Array || value instanceof BigUint64Array) {
    return checkLength(key, Array.from(value, (type) => Number(type)), length);
  }
  if (value instanceof Int8Array || value instanceof Uint8Array || value instanceof Int16Array ||
    value instanceof Uint16Array || value instanceof Int32Array || value instanceof Uint32Array) {
    return checkLength(key, value, length);
  }
  throw new TokenizerError(`GGUF metadata ${key} is ${storedAs(file, key)}; it must be an array of integers (INT32, ` +
    'or another integer type)');
}

/**
 * A token id from metadata, or the fallback when absent or out of range (files use 0xFFFFFFFF for "none"). A value
 * that is no whole number (a float, a string) is refused, as llama.cpp refuses a key of the wrong type: taken as it
 * is, 1.5 became the BOS id and every request then failed on a prompt "token id" no client had sent.
 */
function tokenIdKey(file: GgufFile, key: string, vocabSize: number, fallback: number | undefined): number | undefined {
  if (!file.metadata.has(key)) return fallback;
  const id = metaNumber(file, key);
  if (id === undefined || !Number.isInteger(id)) {
    const value = file.metadata.get(key);
    throw new TokenizerError(`GGUF metadata ${key} is ${typeof value === 'string' ? JSON.stringify(value) : String(value)}, ` +
      'not a token id (a whole number)');
  }
  if (id < 0 || id >= vocabSize) return fallback;
  return id;
}

/**
 * A BOOL flag from metadata, undefined when absent. Any other type is refused, as llama.cpp refuses a key of the wrong
 * type: read as absent, a UINT8 1 for add_bos_token gave the default (no BOS for most BPE vocabularies), silently.
 */
function flagKey(file: GgufFile, key: string): boolean | undefined {
  if (!file.metadata.has(key)) return undefined;
  const flag = metaBool(file, key);
  if (flag === undefined) {
    const value = file.metadata.get(key);
    throw new TokenizerError(`GGUF metadata ${key} is ${typeof value === 'string' ? JSON.stringify(value) : String(value)}, ` +
      'not a BOOL (true or false)');
  }
  return flag;
}

interface TokenTable {
  tokens: string[];
  tokenToId: Map<string, number>;
  scores: Float32Array;
  attrs: Uint16Array;
}

function readTokenTable(file: GgufFile): TokenTable {
  const stored = stringArray(file, 'tokenizer.ggml.tokens');
  if (!stored || stored.length === 0) throw new TokenizerError('GGUF has no token list (tokenizer.ggml.tokens)');
  // An empty token text cannot be looked up or told apart; llama.cpp names it by its id, and so does this.
  const tokens = stored.includes('') ? stored.map((text, id) => text === '' ? `[EMPTY_${id}]` : text) : stored;
  const vocabSize = tokens.length;

  const tokenToId = new Map<string, number>();
  for (const [id, text] of tokens.entries()) {
    const previous = tokenToId.get(text);
    if (previous !== undefined) {
      throw new TokenizerError(`duplicate token ${JSON.stringify(text)} in vocabulary (ids ${previous}, ${id})`);
    }
    tokenToId.set(text, id);
  }

  const scores = new Float32Array(vocabSize);
  const storedScores = scoreArray(file, 'tokenizer.ggml.scores', vocabSize);
  if (storedScores) for (let id = 0; id < vocabSize; id++) scores[id] = storedScores[id]!;

  const attrs = new Uint16Array(vocabSize).fill(TokenAttr.NORMAL);
  const types = tokenTypeArray(file, 'tokenizer.ggml.token_type', vocabSize);
  // tokenTypeArray checked that types holds at least vocabSize entries.
  if (types) for (let id = 0; id < vocabSize; id++) attrs[id] = ATTR_OF_TYPE[types[id]!] ?? 0;
  return { tokens, tokenToId, scores, attrs };
}

/**
 * A STRING key, undefined when absent. Another type is refused naming it: read as absent, a tokenizer.ggml.pre stored
 * as an array gave the default pre-tokenizer, which splits text otherwise (other ids for the same prompt, silently).
 */
function stringKey(file: GgufFile, key: string): string | undefined {
  const value = metaString(file, key);
  if (value === undefined && file.metadata.has(key)) {
    throw new TokenizerError(`GGUF metadata ${key} is ${storedAs(file, key)}, not a STRING`);
  }
  return value;
}

export function readGgufVocab(file: GgufFile): GgufVocab {
  const model = stringKey(file, 'tokenizer.ggml.model');
  if (model === undefined) throw new TokenizerError('GGUF has no tokenizer (tokenizer.ggml.model is missing)');
  let kind: VocabKind;
  if (model === 'llama') kind = 'spm';
  else if (model === 'gpt2') kind = 'bpe';
  else {
    throw new TokenizerError(`GGUF tokenizer model "${model}" is not supported (Conduit reads "llama" and "gpt2")`);
  }

  const { tokens, tokenToId, scores, attrs } = readTokenTable(file);
  const vocabSize = tokens.length;

  let merges: string[] = [];
  const pre = kind === 'bpe' ? stringKey(file, 'tokenizer.ggml.pre') : undefined;
  if (kind === 'bpe') {
    const list = stringArray(file, 'tokenizer.ggml.merges');
    if (!list) throw new TokenizerError('GGUF BPE vocabulary has no merges (tokenizer.ggml.merges)');
    merges = list;
  }

  // llama.cpp's defaults: SentencePiece vocabularies number <unk>, <s>, </s> as 0, 1, 2 and add BOS;
  // a BPE vocabulary without ids has none (llama.cpp's own placeholder id 11 is not carried over).
  const spm = kind === 'spm';
  const bosId = tokenIdKey(file, 'tokenizer.ggml.bos_token_id', vocabSize, spm ? 1 : undefined);
  const eosId = tokenIdKey(file, 'tokenizer.ggml.eos_token_id', vocabSize, spm ? 2 : undefined);
  const unkId = tokenIdKey(file, 'tokenizer.ggml.unknown_token_id', vocabSize, spm ? 0 : undefined);
  const padId = tokenIdKey(file, 'tokenizer.ggml.padding_token_id', vocabSize, undefined);
  let eotId = tokenIdKey(file, 'tokenizer.ggml.eot_token_id', vocabSize, undefined);
  let eomId = tokenIdKey(file, 'tokenizer.ggml.eom_token_id', vocabSize, undefined);
  eotId ??= firstPresent(tokenToId, END_OF_TURN_TEXTS);
  eomId ??= firstPresent(tokenToId, END_OF_MESSAGE_TEXTS);

  const addBos = flagKey(file, 'tokenizer.ggml.add_bos_token') ?? (spm || preTokenizerSpec(pre).addBosByDefault);
  const addEos = flagKey(file, 'tokenizer.ggml.add_eos_token') ?? false;
  const addSpacePrefix = flagKey(file, 'tokenizer.ggml.add_space_prefix') ?? spm;
  if (addBos && bosId === undefined) {
    throw new TokenizerError('tokenizer.ggml.add_bos_token is true but the vocabulary has no BOS token id');
  }
  if (addEos && eosId === undefined) {
    throw new TokenizerError('tokenizer.ggml.add_eos_token is true but the vocabulary has no EOS token id');
  }

  const endOfGenerationIds = collectEndOfGeneration(file, tokenToId, vocabSize, [eosId, eotId, eomId]);
  // A token that ends generation is a control token even when the converter typed it NORMAL: decoding with
  // special tokens skipped must not print it.
  // Every id here was range-checked (tokenIdKey) or found in the table (tokenToId).
  for (const id of endOfGenerationIds) attrs[id]! |= TokenAttr.CONTROL;
  applyPhi3Rstrip(file, tokenToId, attrs);

  return {
    kind, pre, tokens, tokenToId, scores, attrs, merges,
    bosId, eosId, eotId, eomId, unkId, padId, addBos, addEos, addSpacePrefix, endOfGenerationIds,
  };
}

function firstPresent(tokenToId: ReadonlyMap<string, number>, texts: readonly string[]): number | undefined {
  for (const text of texts) {
    const id = tokenToId.get(text);
    if (id !== undefined) return id;
  }
  return undefined;
}

function collectEndOfGeneration(file: GgufFile, tokenToId: ReadonlyMap<string, number>, vocabSize: number,
  declared: (number | undefined)[]): Set<number> {
  const ids = new Set<number>();
  for (const id of declared) if (id !== undefined) ids.add(id);
  for (const key of ['fim_pad', 'fim_rep', 'fim_sep']) {
    const id = tokenIdKey(file, `tokenizer.ggml.${key}_token_id`, vocabSize, undefined);
    if (id !== undefined) ids.add(id);
  }
  for (const text of STOP_TEXTS) {
    const id = tokenToId.get(text);
    if (id !== undefined) ids.add(id);
  }
  const end = tokenToId.get('<|end|>');
  if (end !== undefined && endIsMidTurn((text) => tokenToId.has(text)) && !declared.includes(end)) ids.delete(end);
  return ids;
}

/**
 * Phi-3's tokenizer.json marks its added tokens rstrip (whitespace after "<|user|>" is not text), but GGUF has no
 * field for it; llama.cpp recognises Phi-3 by name and sets the flag, and so does this.
 */
function applyPhi3Rstrip(file: GgufFile, tokenToId: ReadonlyMap<string, number>, attrs: Uint16Array): void {
  const name = (metaString(file, 'general.name') ?? '').toLowerCase();
  if (!name.includes('phi-3') && !name.includes('phi3')) return;
  const specialMask = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN;
  for (let id = 0; id < attrs.length; id++) if (attrs[id]! & specialMask) attrs[id]! |= TokenAttr.RSTRIP;
  const set = (text: string, on: boolean) => {
    const id = tokenToId.get(text);
    if (id === undefined) return;
    const attr = attrs[id]!; // an id from the token table
    attrs[id] = on ? attr | TokenAttr.RSTRIP : attr & ~TokenAttr.RSTRIP;
  };
  set('</s>', true);
  for (const text of ['<unk>', '<s>', '<|endoftext|>']) set(text, false);
}
