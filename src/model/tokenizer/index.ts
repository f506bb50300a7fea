// Tokenizers: one entry point for every source a model can bring.
//
// - A GGUF file's own vocabulary (`tokenizer.ggml.*`), tokenized by hand as llama.cpp does: SentencePiece-style BPE
//   for `llama` vocabularies, byte-level BPE for `gpt2` ones.
// - A Hugging Face tokenizer.json with its tokenizer_config.json, through @huggingface/tokenizers.

import type { GgufFile } from '../gguf.ts';
import { tokenizerFromGguf } from './gguf-tokenizer.ts';
import { tokenizerFromJson } from './hf-tokenizer.ts';
import type { Tokenizer } from './types.ts';

export type TokenizerSource =
  | { kind: 'gguf'; file: GgufFile }
  | { kind: 'hf'; tokenizerJson: string; tokenizerConfig: Record<string, unknown> };

export function createTokenizer(source: TokenizerSource): Tokenizer {
  switch (source.kind) {
    case 'gguf': return tokenizerFromGguf(source.file);
    case 'hf': return tokenizerFromJson(source.tokenizerJson, source.tokenizerConfig);
  }
}

export type { EncodeOptions, Tokenizer } from './types.ts';
export { TokenizerError } from './errors.ts';
export { GgufTokenizer, tokenizerFromGguf } from './gguf-tokenizer.ts';
export { HfTokenizer, tokenizerFromJson, tokenizerFromJsonObject } from './hf-tokenizer.ts';
export { KNOWN_PRE_TOKENIZERS } from './pre-tokenizers.ts';
