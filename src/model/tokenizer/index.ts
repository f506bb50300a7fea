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
   * tokenizerJson is the path of tokenizer.json (it names the file in errors); tokenizerConfig the parsed
   * tokenizer_config.json ({} if absent). parsedTokenizerJson, when given, is that file already parsed (the model
   * loader's): the tokenizer is built from it and the file is not read again. parsedTokenizerJsonChecked: it passed
   * checkTokenizerJson already (the loader checks it as it loads), which is not repeated (50-90 ms for a vocabulary of
   * 128k tokens).
   */
  | {
    kind: 'hf'; tokenizerJson: string; tokenizerConfig: Record<string, unknown>;
    parsedTokenizerJson?: unknown; parsedTokenizerJsonChecked?: boolean;
  };

export function createTokenizer(source: TokenizerSource): Tokenizer {
  switch (source.kind) {
    case 'gguf': return tokenizerFromGguf(source.file);
    case 'hf': return source.parsedTokenizerJson !== undefined
      ? tokenizerFromJsonObject(source.parsedTokenizerJson, source.tokenizerConfig, source.tokenizerJson,
        { checked: source.parsedTokenizerJsonChecked ?? false })
      : tokenizerFromJson(source.tokenizerJson, source.tokenizerConfig);
  }
}

export type { EncodeOptions, Tokenizer } from './types.ts';
export { TokenizerError } from './errors.ts';
export { GgufTokenizer, tokenizerFromGguf } from './gguf-tokenizer.ts';
export { HfTokenizer, tokenizerFromJson, tokenizerFromJsonObject } from './hf-tokenizer.ts';
export { KNOWN_PRE_TOKENIZERS } from './pre-tokenizers.ts';
