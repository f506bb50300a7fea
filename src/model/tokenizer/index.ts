// Tokenizers: one entry point for every source a model can bring.
//
// - A GGUF file's own vocabulary (`tokenizer.ggml.*`), tokenized by hand as llama.cpp does: SentencePiece-style BPE
//   for `llama` vocabularies, byte-level BPE for `gpt2` ones.
// - A Hugging Face tokenizer.json with its tokenizer_config.json, through @huggingface/tokenizers.

import type { GgufFile } from '../gguf.ts';
import { tokenizerFromGguf } from './gguf-tokenizer.ts';
import { tokenizerFromJson, tokenizerFromJsonObject } from './hf-tokenizer.ts';
import type { Tokenizer } from './types.ts';

export type TokenizerSource =
  | { kind: 'gguf'; file: GgufFile }
  /**
   * tokenizerJson is the path of tokenizer.json. parsedTokenizerJson, when given, is that file already parsed (the
   * model loader's): the tokenizer is built from it and the file is not read again.
   */
  | { kind: 'hf'; tokenizerJson: string; parsedTokenizerJson?: unknown; tokenizerConfig: Record<string, unknown> };

export function createTokenizer(source: TokenizerSource): Tokenizer {
  switch (source.kind) {
    case 'gguf': return tokenizerFromGguf(source.file);
    case 'hf': return source.parsedTokenizerJson !== undefined
      ? tokenizerFromJsonObject(source.parsedTokenizerJson, source.tokenizerConfig, source.tokenizerJson)
      : tokenizerFromJson(source.tokenizerJson, source.tokenizerConfig);
  }
}

export type { EncodeOptions, Tokenizer } from './types.ts';
export { TokenizerError } from './errors.ts';
export { GgufTokenizer, tokenizerFromGguf } from './gguf-tokenizer.ts';
export { HfTokenizer, tokenizerFromJson, tokenizerFromJsonObject } from './hf-tokenizer.ts';
export { KNOWN_PRE_TOKENIZERS } from './pre-tokenizers.ts';
