// Pre-tokenizers of byte-level BPE vocabularies: the regular expressions that cut text into words before merging,
// chosen by the GGUF key `tokenizer.ggml.pre`. Each is applied in turn to every piece the previous one produced;
// both the matches and the text between them become pieces, so no character is ever dropped.
//
// JavaScript's \s is not Unicode's White_Space (it adds U+FEFF and lacks U+0085), so the patterns spell
// whitespace out. The (?i:'s|...) groups of the original Oniguruma patterns are written case by case.

import { TokenizerError } from './errors.ts';

const WS = '\\t-\\r\\x85\\p{Zs}\\u2028\\u2029'; // Unicode White_Space, for use inside a character class
const S = `[${WS}]`;
const NOT_S = `[^${WS}]`;

const CONTRACTIONS_ANY_CASE = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";

/** GPT-2's pattern. */
const GPT2 = `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^${WS}\\p{L}\\p{N}]+|${S}+(?!${NOT_S})|${S}+`;

/** Llama 3's pattern: letters may carry one leading non-letter, digits come in groups of at most three. */
const LLAMA3 = `${CONTRACTIONS_ANY_CASE}|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^${WS}\\p{L}\\p{N}]+[\\r\\n]*` +
  `|${S}*[\\r\\n]+|${S}+(?!${NOT_S})|${S}+`;

/** Qwen2's pattern: Llama 3's with every digit on its own. */
const QWEN2 = LLAMA3.replace('\\p{N}{1,3}', '\\p{N}');

/** StarCoder-style: digits split one by one first, then GPT-2's pattern. */
const STARCODER = ['\\p{N}', GPT2];

/** What llama.cpp uses when a BPE vocabulary names no (or the "default") pre-tokenizer. */
const LLAMA_CPP_DEFAULT = [
  '[\\p{P}\\$\\+<=>\\^~\\|]+',
  GPT2,
  '\\p{N}+',
  '[0-9][0-9][0-9]',
];

export interface PreTokenizerSpec {
  /** Applied in order; each splits every piece the previous ones produced. */
  patterns: readonly string[];
  /** A word that is itself a token is emitted whole, without merging (Llama 3's `ignore_merges`). */
  ignoreMerges: boolean;
  /** llama.cpp's default for add_bos when the GGUF does not say. */
  addBosByDefault: boolean;
}

const SPECS: Record<string, PreTokenizerSpec> = {};
function define(names: string[], spec: PreTokenizerSpec): void {
  for (const name of names) SPECS[name] = spec;
}

define(['default'], { patterns: LLAMA_CPP_DEFAULT, ignoreMerges: false, addBosByDefault: false });
define(['gpt-2', 'phi-2', 'mpt', 'olmo', 'jais', 'jina-es', 'jina-de', 'jina-v2-es', 'jina-v2-de', 'gigachat',
  'roberta-bpe', 'jina-v1-en', 'jina-v2-code', 'exaone4', 'trillion', 'granite-docling', 'mellum', 'modern-bert'],
{ patterns: [GPT2], ignoreMerges: false, addBosByDefault: false });
define(['llama3', 'llama-v3', 'llama-bpe', 'falcon3', 'falcon-h1', 'pixtral', 'midm-2.0', 'lfm2'],
  { patterns: [LLAMA3], ignoreMerges: true, addBosByDefault: true });
define(['dbrx', 'smaug-bpe', 'glm4', 'chatglm-bpe'],
  { patterns: [LLAMA3], ignoreMerges: false, addBosByDefault: false });
define(['qwen2', 'deepseek-r1-qwen', 'stablelm2', 'megrez', 'hunyuan', 'grok-2', 'seed-coder'],
  { patterns: [QWEN2], ignoreMerges: false, addBosByDefault: false });
define(['starcoder', 'refact', 'command-r', 'smollm', 'codeshell', 'exaone', 'minerva-7b'],
  { patterns: STARCODER, ignoreMerges: false, addBosByDefault: false });

export const KNOWN_PRE_TOKENIZERS: readonly string[] = Object.keys(SPECS);

/** The pre-tokenizer a `tokenizer.ggml.pre` name stands for; a missing name means llama.cpp's default. */
export function preTokenizerSpec(pre: string | undefined): PreTokenizerSpec {
  const name = pre ?? 'default';
  // Own keys only: "constructor" or "__proto__" from a file must be an unknown name, not Object.prototype's.
  const spec = Object.hasOwn(SPECS, name) ? SPECS[name] : undefined;
  if (!spec) {
    throw new TokenizerError(`unknown BPE pre-tokenizer "${pre}" (tokenizer.ggml.pre); Conduit knows: ` +
      KNOWN_PRE_TOKENIZERS.join(', '));
  }
  return spec;
}

export class PreTokenizer {
  private readonly regexes: RegExp[];

  constructor(readonly spec: PreTokenizerSpec) {
    this.regexes = spec.patterns.map((p) => new RegExp(p, 'gu'));
  }

  /** The text cut into words; joined back together they give the text again. */
  split(text: string): string[] {
    let pieces = [text];
    for (const regex of this.regexes) {
      const next: string[] = [];
      for (const piece of pieces) splitKeepingAll(piece, regex, next);
      pieces = next;
    }
    return pieces;
  }
}

function splitKeepingAll(text: string, regex: RegExp, out: string[]): void {
  let last = 0;
  regex.lastIndex = 0;
  for (let match = regex.exec(text); match !== null; match = regex.exec(text)) {
    const start = match.index;
    const matched = match[0];
    if (matched.length === 0) { // an empty match would loop forever; step past it
      regex.lastIndex++;
      continue;
    }
    if (start > last) out.push(text.slice(last, start));
    out.push(matched);
    last = start + matched.length;
  }
  if (last < text.length) out.push(text.slice(last));
}
