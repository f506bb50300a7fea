// SentencePiece-style BPE over a scored vocabulary (GGUF `tokenizer.ggml.model = llama`), as llama.cpp does it:
// start from single characters, repeatedly merge the adjacent pair whose concatenation is the highest-scoring
// vocabulary token (leftmost first on ties), and spell any leftover piece that is not a token as byte tokens
// (<0xNN>). Whitespace has already been written as "▁" by the caller.

import { TokenizerError } from './errors.ts';
import type { GgufVocab } from './gguf-vocab.ts';
import { PriorityQueue } from './priority-queue.ts';

interface Candidate {
  left: number;
  right: number;
  score: number;
  /** Length of the merged text when the candidate was made; a later merge of either side changes it. */
  length: number;
}

const candidateFirst = (a: Candidate, b: Candidate): boolean =>
  a.score > b.score || (a.score === b.score && a.left < b.left);

const utf8 = new TextEncoder();

export class SpmEncoder {
  /** Token id of each byte, for pieces that are not tokens. */
  private readonly byteTokens: Int32Array;

  constructor(private readonly vocab: GgufVocab) {
    this.byteTokens = new Int32Array(256).fill(-1);
    for (let byte = 0; byte < 256; byte++) {
      const hex = `<0x${byte.toString(16).toUpperCase().padStart(2, '0')}>`;
      const id = vocab.tokenToId.get(hex) ?? (byte < 0x80 ? vocab.tokenToId.get(String.fromCharCode(byte)) : undefined);
      if (id !== undefined) this.byteTokens[byte] = id;
    }
  }

  /** Appends the ids of `text` (already escaped: spaces as "▁") to `out`. */
  encode(text: string, out: number[]): void {
    if (text.length === 0) return;
    const { tokenToId, scores } = this.vocab;

    // Symbols are spans of `text`: each starts as one code point and only ever grows rightwards by absorbing its
    // right neighbour, so a merged symbol's text is always one slice of the input.
    const count = text.length;
    const start = new Int32Array(count);
    const length = new Int32Array(count); // 0 once absorbed
    const prev = new Int32Array(count);
    const next = new Int32Array(count);
    let symbols = 0;
    for (let offset = 0; offset < count;) {
      const width = text.codePointAt(offset)! > 0xffff ? 2 : 1;
      start[symbols] = offset;
      length[symbols] = width;
      prev[symbols] = symbols - 1;
      offset += width;
      next[symbols] = offset < count ? symbols + 1 : -1;
      symbols++;
    }

    // Indices below are proven in range: left/right by how candidates are made, next/prev entries are -1
    // (checked before use) or a symbol index, ids come from tokenToId (so scores has them).
    const queue = new PriorityQueue<Candidate>(candidateFirst);
    const consider = (left: number, right: number): void => {
      if (left < 0 || right < 0) return;
      const from = start[left]!;
      const merged = length[left]! + length[right]!;
      const id = tokenToId.get(text.slice(from, from + merged));
      if (id === undefined) return;
      queue.push({ left, right, score: scores[id]!, length: merged });
    };
    for (let i = 1; i < symbols; i++) consider(i - 1, i);

    for (let candidate = queue.pop(); candidate !== undefined; candidate = queue.pop()) {
      const { left, right } = candidate;
      const leftLength = length[left]!;
      const rightLength = length[right]!;
      if (leftLength === 0 || rightLength === 0 || leftLength + rightLength !== candidate.length) continue;
      length[left] = leftLength + rightLength;
      length[right] = 0;
      const after = next[right]!;
      next[left] = after;
      if (after >= 0) prev[after] = left;
      consider(prev[left]!, left);
      consider(left, after);
    }

    for (let i = 0; i !== -1; i = next[i]!) {
      const from = start[i]!;
      const piece = text.slice(from, from + length[i]!);
      const id = tokenToId.get(piece);
      if (id !== undefined) out.push(id);
      else this.pushBytes(piece, out);
    }
  }

  private pushBytes(piece: string, out: number[]): void {
    for (const byte of utf8.encode(piece)) {
      const id = this.byteTokens[byte]!; // one entry per byte value
      if (id < 0) {
        throw new TokenizerError(`cannot encode ${JSON.stringify(piece)}: the vocabulary has no token for byte ` +
          `0x${byte.toString(16).padStart(2, '0')} (no <0x..> byte tokens)`);
      }
      out.push(id);
    }
  }
}
