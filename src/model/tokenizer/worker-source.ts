// Building a tokenizer in another thread from the plain data Tokenizer.workerSource() gives.

import type { GgufVocab } from './gguf-vocab.ts';
import { GgufTokenizer } from './gguf-tokenizer.ts';
import { tokenizerFromJsonObject } from './hf-tokenizer.ts';
import type { Tokenizer, TokenizerWorkerSource } from './types.ts';

export function tokenizerFromWorkerSource(source: TokenizerWorkerSource): Tokenizer {
  switch (source.kind) {
    case 'gguf-vocab': return new GgufTokenizer(source.vocab as GgufVocab);
    case 'hf': return tokenizerFromJsonObject(source.json, source.config);
  }
}
