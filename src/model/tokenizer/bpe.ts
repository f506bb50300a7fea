// Byte-level BPE by merge rank (GGUF `tokenizer.ggml.model = gpt2`), as llama.cpp does it: the pre-tokenizer cuts
// the text into words; each word's UTF-8 bytes become byte-level characters; the adjacent pair with the lowest
// merge rank is merged (leftmost first on ties) until no pair has a rank.
//
// Where the time goes: symbols are small integers, not strings. Every token text and every merge result gets an
// integer id once, at load, so the merge loop looks pairs up in one Map keyed by a number and never builds a
// string. Words repeat a lot in real text, so finished words are cached.

import { BYTE_TO_CHAR, byteLevelToBytes } from './byte-level.ts';
import { TokenizerError } from './errors.ts';
import type { GgufVocab } from './gguf-vocab.ts';
import { PreTokenizer, preTokenizerSpec } from './pre-tokenizers.ts';
import { PriorityQueue } from './priority-queue.ts';

interface Candidate {
  rank: number;
  left: number;
  right: number;
  leftSymbol: number;
  rightSymbol: number;
}

const candidateFirst = (a: Candidate, b: Candidate): boolean =>
  a.rank < b.rank || (a.rank === b.rank && a.left < b.left);

/** Merge rank and result packed into one number: rank * RESULT_SPAN + result symbol. */
const RESULT_SPAN = 2 ** 22;
const WORD_CACHE_LIMIT = 50_000;
/** Longer words (base64, long digit runs) rarely repeat; caching them would only hold memory. */
const CACHED_WORD_MAX_LENGTH = 256;

const utf8 = new TextEncoder();

export class BpeEncoder {
  private readonly preTokenizer: PreTokenizer;
  /** Symbol ids: vocabulary ids first, then merge results that are not tokens. */
  private readonly symbolIds = new Map<string, number>();
  private readonly extraSymbolTexts: string[] = [];
  private readonly vocabSize: number;
  private readonly pairStride: number;
  /** (left symbol * pairStride + right symbol) -> rank * RESULT_SPAN + merged symbol. */
  private readonly merges = new Map<number, number>();
  /** Symbol id of each byte's byte-level character. */
  private readonly byteSymbols = new Int32Array(256);
  private readonly wordCache = new Map<string, readonly number[]>();

  constructor(private readonly vocab: GgufVocab) {
    this.preTokenizer = new PreTokenizer(preTokenizerSpec(vocab.pre));
    this.vocabSize = vocab.tokens.length;
    for (const [text, id] of vocab.tokenToId) this.symbolIds.set(text, id);
    for (let byte = 0; byte < 256; byte++) this.byteSymbols[byte] = this.intern(BYTE_TO_CHAR[byte]!);

    const pairs: [number, number, number][] = [];
    vocab.merges.forEach((merge, rank) => {
      // The separator is the first space after the first character (a lone " " can itself be a left part).
      const split = merge.indexOf(' ', 1);
      if (split < 0) throw new TokenizerError(`malformed BPE merge ${JSON.stringify(merge)} at rank ${rank}`);
      const left = merge.slice(0, split);
      const right = merge.slice(split + 1);
      pairs.push([this.intern(left), this.intern(right), this.intern(left + right)]);
    });
    this.pairStride = this.symbolIds.size;
    if (this.pairStride * this.pairStride > Number.MAX_SAFE_INTEGER || this.pairStride >= RESULT_SPAN) {
      throw new TokenizerError(`BPE vocabulary too large (${this.pairStride} symbols)`);
    }
    pairs.forEach(([left, right, result], rank) => {
      const key = left * this.pairStride + right;
      if (!this.merges.has(key)) this.merges.set(key, rank * RESULT_SPAN + result); // the first rank wins
    });
  }

  private intern(text: string): number {
    let id = this.symbolIds.get(text);
    if (id === undefined) {
      id = this.vocabSize + this.extraSymbolTexts.length;
      this.symbolIds.set(text, id);
      this.extraSymbolTexts.push(text);
    }
    return id;
  }

  /** Appends the ids of `text` (no special tokens in it) to `out`. */
  encode(text: string, out: number[]): void {
    for (const word of this.preTokenizer.split(text)) {
      let ids = this.wordCache.get(word);
      if (ids === undefined) {
        ids = this.encodeWord(word);
        if (word.length <= CACHED_WORD_MAX_LENGTH) {
          if (this.wordCache.size >= WORD_CACHE_LIMIT) this.wordCache.clear();
          this.wordCache.set(word, ids);
        }
      }
      for (const id of ids) out.push(id);
    }
  }

  private encodeWord(word: string): number[] {
    const bytes = utf8.encode(word);
    if (this.preTokenizer.spec.ignoreMerges) {
      let spelled = '';
      for (const byte of bytes) spelled += BYTE_TO_CHAR[byte]!;
      const whole = this.vocab.tokenToId.get(spelled);
      if (whole !== undefined) return [whole];
    }

    // Indices below are proven in range: i by the loop bounds, left/right by how candidates are made, next/prev
    // entries are -1 (checked before use) or a position; byteSymbols has one entry per byte value.
    const count = bytes.length;
    const symbol = new Int32Array(count); // -1 once absorbed
    const prev = new Int32Array(count);
    const next = new Int32Array(count);
    for (let i = 0; i < count; i++) {
      symbol[i] = this.byteSymbols[bytes[i]!]!;
      prev[i] = i - 1;
      next[i] = i + 1 < count ? i + 1 : -1;
    }

    const queue = new PriorityQueue<Candidate>(candidateFirst);
    const consider = (left: number, right: number): void => {
      if (left < 0 || right < 0) return;
      const leftSymbol = symbol[left]!;
      const rightSymbol = symbol[right]!;
      const packed = this.merges.get(leftSymbol * this.pairStride + rightSymbol);
      if (packed === undefined) return;
      queue.push({ rank: Math.floor(packed / RESULT_SPAN), left, right, leftSymbol, rightSymbol });
    };
    for (let i = 1; i < count; i++) consider(i - 1, i);

    for (let candidate = queue.pop(); candidate !== undefined; candidate = queue.pop()) {
      const { left, right } = candidate;
      // Stale when either side has been absorbed or has grown since the candidate was made.
      if (symbol[left] !== candidate.leftSymbol || symbol[right] !== candidate.rightSymbol) continue;
      const packed = this.merges.get(candidate.leftSymbol * this.pairStride + candidate.rightSymbol)!;
      symbol[left] = packed % RESULT_SPAN;
      symbol[right] = -1;
      const after = next[right]!;
      next[left] = after;
      if (after >= 0) prev[after] = left;
      consider(prev[left]!, left);
      consider(left, after);
    }

    const ids: number[] = [];
    for (let i = 0; i !== -1; i = next[i]!) {
      const id = symbol[i]!;
      if (id < this.vocabSize) {
        ids.push(id);
      } else {
        // A merge result that is not itself a token: spell it out byte by byte.
        for (const byte of byteLevelToBytes(this.extraSymbolTexts[id - this.vocabSize]!)) {
          const byteToken = this.byteSymbols[byte]!;
          if (byteToken >= this.vocabSize) {
            throw new TokenizerError(`cannot encode ${JSON.stringify(word)}: the vocabulary has no token for ` +
              `byte 0x${byte.toString(16).padStart(2, '0')}`);
          }
          ids.push(byteToken);
        }
      }
    }
    return ids;
  }
}
