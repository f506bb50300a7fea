// Cutting text at special tokens written in it ("<|eot_id|>"), before the model's own tokenizer sees the rest.
// Like llama.cpp: the longest special tokens are searched first, each through every remaining stretch of text;
// control tokens are only recognised when asked (parseSpecial), user-defined ones always.

import { TokenAttr } from './gguf-vocab.ts';
import type { GgufVocab } from './gguf-vocab.ts';

export type Fragment = { kind: 'text'; text: string } | { kind: 'token'; id: number };

/** A special token that may be written in text: its id, its text and its TokenAttr bits. */
interface Candidate { id: number; text: string; attr: number }

/** C's isspace in the "C" locale, which is what llama.cpp strips around lstrip/rstrip tokens. */
const isAsciiSpace = (code: number): boolean => code === 0x20 || (code >= 0x09 && code <= 0x0d);

export class SpecialTokenSplitter {
  /** Candidates longest first; ties in id order so the result never depends on sort stability. */
  private readonly controlAndUserDefined: Candidate[];
  private readonly userDefinedOnly: Candidate[];

  constructor(vocab: GgufVocab) {
    const candidates: Candidate[] = [];
    const mask = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN;
    vocab.attrs.forEach((attr, id) => {
      const text = vocab.tokens[id];
      if (attr & mask && text !== undefined && text.length > 0) candidates.push({ id, text, attr });
    });
    candidates.sort((a, b) => b.text.length - a.text.length || a.id - b.id);
    this.controlAndUserDefined = candidates;
    this.userDefinedOnly = candidates.filter(({ attr }) => !(attr & (TokenAttr.CONTROL | TokenAttr.UNKNOWN)));
  }

  split(text: string, parseSpecial: boolean): Fragment[] {
    let fragments: Fragment[] = text.length > 0 ? [{ kind: 'text', text }] : [];
    const candidates = parseSpecial ? this.controlAndUserDefined : this.userDefinedOnly;
    for (const candidate of candidates) {
      if (!text.includes(candidate.text)) continue;
      fragments = this.splitAll(fragments, candidate);
    }
    return fragments;
  }

  private splitAll(fragments: Fragment[], { id, text: tokenText, attr }: Candidate): Fragment[] {
    const out: Fragment[] = [];
    for (const fragment of fragments) {
      if (fragment.kind === 'token') { out.push(fragment); continue; }
      const text = fragment.text;
      let from = 0;
      for (let at = text.indexOf(tokenText); at >= 0; at = text.indexOf(tokenText, from)) {
        let leftEnd = at;
        if (attr & TokenAttr.LSTRIP) while (leftEnd > from && isAsciiSpace(text.charCodeAt(leftEnd - 1))) leftEnd--;
        if (leftEnd > from) out.push({ kind: 'text', text: text.slice(from, leftEnd) });
        out.push({ kind: 'token', id });
        from = at + tokenText.length;
        if (attr & TokenAttr.RSTRIP) while (from < text.length && isAsciiSpace(text.charCodeAt(from))) from++;
      }
      if (from < text.length) out.push({ kind: 'text', text: text.slice(from) });
    }
    return out;
  }
}
