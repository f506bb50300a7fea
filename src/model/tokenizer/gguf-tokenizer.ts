// The Tokenizer over a GGUF vocabulary: SentencePiece-style BPE ("llama") or byte-level BPE ("gpt2"), with special
// tokens, BOS/EOS, and decoding through each token's raw bytes.

import type { GgufFile } from '../gguf.ts';
import { BpeEncoder } from './bpe.ts';
import { byteLevelToBytes } from './byte-level.ts';
import { TokenizerError } from './errors.ts';
import { readGgufVocab, TokenAttr } from './gguf-vocab.ts';
import type { GgufVocab } from './gguf-vocab.ts';
import { SpecialTokenSplitter } from './special-split.ts';
import { SpmEncoder } from './spm.ts';
import type { EncodeOptions, Tokenizer, TokenizerWorkerSource } from './types.ts';

const SPACE = 0x20;
const EMPTY = new Uint8Array(0);
const utf8 = new TextEncoder();
const LONE_SURROGATE = /\p{Cs}/u;

export function tokenizerFromGguf(file: GgufFile): GgufTokenizer {
  return new GgufTokenizer(readGgufVocab(file));
}

export class GgufTokenizer implements Tokenizer {
  readonly vocabSize: number;
  readonly bosId: number | undefined;
  readonly eosId: number | undefined;
  readonly eotId: number | undefined;
  readonly stopTokenIds: readonly number[];
  /** SentencePiece vocabularies put a space before the text; decode takes one leading space off again. */
  readonly stripsLeadingSpace: boolean;
  /** Whether encode adds BOS / EOS (with addSpecialTokens, the default). */
  readonly addsBos: boolean;
  readonly addsEos: boolean;

  private readonly splitter: SpecialTokenSplitter;
  private readonly spm: SpmEncoder | undefined;
  private readonly bpe: BpeEncoder | undefined;
  /** Each token's bytes (a special token's are its own text), computed on first use. */
  private readonly bytesCache: (Uint8Array | undefined)[];
  // ignoreBOM keeps a leading U+FEFF: it is text the model produced, not a marker to drop.
  private readonly decoder = new TextDecoder('utf-8', { ignoreBOM: true });

  constructor(readonly vocab: GgufVocab) {
    this.vocabSize = vocab.tokens.length;
    this.bosId = vocab.bosId;
    this.eosId = vocab.eosId;
    this.eotId = vocab.eotId;
    this.stopTokenIds = [...vocab.endOfGenerationIds].sort((a, b) => a - b);
    this.stripsLeadingSpace = vocab.kind === 'spm' && vocab.addSpacePrefix;
    this.addsBos = vocab.addBos;
    this.addsEos = vocab.addEos;
    this.splitter = new SpecialTokenSplitter(vocab);
    if (vocab.kind === 'spm') this.spm = new SpmEncoder(vocab);
    else this.bpe = new BpeEncoder(vocab);
    this.bytesCache = new Array(this.vocabSize);
  }

  private longestTokenBytes: number | undefined | null = null;

  /**
   * Every token stands for one slice of the input: a text fragment between special tokens, with spaces written as
   * "▁" (3 bytes for 1) and, in byte-level BPE, each byte as one character of 1 or 2 bytes; or one byte (a
   * byte-fallback token); or a special token's own text. So no token stands for more input bytes than its longest
   * spelling, whatever the text (SentencePiece's added leading space only adds a token). Except a special token
   * that strips the whitespace beside it (lstrip/rstrip, Phi-3's): that whitespace is in no token, so no bound.
   */
  maxBytesPerToken(): number | undefined {
    if (this.longestTokenBytes === null) {
      const strips = this.vocab.attrs.some((attr) => (attr & (TokenAttr.LSTRIP | TokenAttr.RSTRIP)) !== 0);
      let longest = 1;
      if (!strips) for (const token of this.vocab.tokens) longest = Math.max(longest, Buffer.byteLength(token, 'utf8'));
      this.longestTokenBytes = strips ? undefined : longest;
    }
    return this.longestTokenBytes;
  }

  workerSource(): TokenizerWorkerSource {
    return { kind: 'gguf-vocab', vocab: this.vocab };
  }

  // -------------------------------------------------------------------------------------------------------------
  // Encoding

  encode(text: string, options: EncodeOptions = {}): number[] {
    const addSpecial = options.addSpecialTokens ?? true;
    const parseSpecial = options.parseSpecial ?? false;
    // A lone UTF-16 surrogate has no UTF-8 form; it is encoded as U+FFFD, as TextEncoder would.
    if (LONE_SURROGATE.test(text)) text = text.replace(/\p{Cs}/gu, '\uFFFD');

    const out: number[] = [];
    if (addSpecial && this.vocab.addBos) out.push(this.vocab.bosId!);
    const fragments = this.splitter.split(text, parseSpecial);
    if (this.spm) {
      // The dummy prefix goes before the first stretch of text and before every stretch after a special token.
      let afterSpecial = true;
      for (const fragment of fragments) {
        if (fragment.kind === 'token') {
          out.push(fragment.id);
          afterSpecial = true;
          continue;
        }
        const prefixed = this.vocab.addSpacePrefix && afterSpecial ? ' ' + fragment.text : fragment.text;
        this.spm.encode(prefixed.replaceAll(' ', '\u2581'), out);
        afterSpecial = false;
      }
    } else {
      for (const fragment of fragments) {
        if (fragment.kind === 'token') out.push(fragment.id);
        else this.bpe!.encode(fragment.text, out);
      }
    }
    if (addSpecial && this.vocab.addEos) out.push(this.vocab.eosId!);
    return out;
  }

  // -------------------------------------------------------------------------------------------------------------
  // Decoding

  /**
   * The token bytes joined and read as UTF-8 (invalid sequences become U+FFFD). SentencePiece's dummy-prefix space
   * is taken off the start of the result. Unlike llama.cpp's detokenizer, no "clean up tokenization spaces" pass
   * runs, so decode(encode(text)) gives the text back and matches the joined tokenBytes a streaming detokenizer
   * sees.
   */
  decode(ids: readonly number[], options: { skipSpecialTokens?: boolean } = {}): string {
    const includeSpecial = !(options.skipSpecialTokens ?? true);
    const parts: Uint8Array[] = [];
    let atStart = true;
    for (const id of ids) {
      const bytes = this.bytesOf(id, includeSpecial);
      if (bytes.length === 0) continue;
      parts.push(atStart && this.stripsLeadingSpace && bytes[0] === SPACE ? bytes.subarray(1) : bytes);
      atStart = false;
    }
    return this.decoder.decode(concat(parts));
  }

  tokenBytes(id: number, includeSpecial = false): Uint8Array {
    return this.bytesOf(id, includeSpecial).slice();
  }

  private bytesOf(id: number, includeSpecial: boolean): Uint8Array {
    const attr = this.attrOf(id);
    if (attr & (TokenAttr.CONTROL | TokenAttr.UNKNOWN) && !includeSpecial) return EMPTY;
    let bytes = this.bytesCache[id];
    if (bytes === undefined) {
      bytes = this.computeBytes(id, attr);
      this.bytesCache[id] = bytes;
    }
    return bytes;
  }

  private computeBytes(id: number, attr: number): Uint8Array {
    const text = this.vocab.tokens[id]!; // bytesOf checked the id
    if (attr & (TokenAttr.CONTROL | TokenAttr.UNKNOWN | TokenAttr.USER_DEFINED)) return utf8.encode(text);
    if (attr & TokenAttr.BYTE) {
      const match = /^<0x([0-9A-Fa-f]{2})>$/.exec(text);
      if (match) return Uint8Array.of(parseInt(match[1]!, 16)); // the group is not optional
      return utf8.encode(text); // a byte token spelled as the character itself
    }
    if (attr & TokenAttr.NORMAL) {
      return this.vocab.kind === 'spm' ? utf8.encode(text.replaceAll('\u2581', ' ')) : byteLevelToBytes(text);
    }
    return EMPTY; // unused and undefined tokens print nothing, as in llama.cpp
  }

  // -------------------------------------------------------------------------------------------------------------
  // Lookups

  isSpecial(id: number): boolean {
    return (this.attrOf(id) & (TokenAttr.CONTROL | TokenAttr.UNKNOWN)) !== 0;
  }

  idToToken(id: number): string | undefined {
    return Number.isInteger(id) && id >= 0 && id < this.vocabSize ? this.vocab.tokens[id] : undefined;
  }

  tokenToId(token: string): number | undefined {
    return this.vocab.tokenToId.get(token);
  }

  /** The attribute bits of `id`; an id that is not an integer in [0, vocabSize) is a TokenizerError. */
  private attrOf(id: number): number {
    const attr = Number.isInteger(id) && id < this.vocabSize ? this.vocab.attrs[id] : undefined;
    if (attr === undefined) {
      throw new TokenizerError(`token id ${id} is out of range (vocabulary has ${this.vocabSize} tokens)`);
    }
    return attr;
  }
}

function concat(parts: Uint8Array[]): Uint8Array {
  if (parts.length === 1) return parts[0]!;
  let length = 0;
  for (const part of parts) length += part.length;
  const out = new Uint8Array(length);
  let offset = 0;
  for (const part of parts) { out.set(part, offset); offset += part.length; }
  return out;
}
