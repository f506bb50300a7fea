// Shared by the tokenizer suites: llama.cpp's vocab-only GGUFs and their test vectors from ../shared/models,
// each read once per process (the Llama 3 vocabulary takes a second to load).

import { readFileSync } from 'node:fs';
import type { GgufFile } from '../../src/model/gguf.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { GgufTokenizer, tokenizerFromGguf } from '../../src/model/tokenizer/gguf-tokenizer.ts';
import { sharedModel, skipUnlessShared } from '../helpers/shared-models.ts';

export const VOCAB_NAMES = ['llama-spm', 'phi-3', 'llama-bpe', 'gpt-2', 'qwen2'] as const;
export type VocabName = (typeof VOCAB_NAMES)[number];

export const vocabFileName = (name: VocabName): string => `ggml-vocab-${name}.gguf`;

/** The `skip` option for a suite that needs this vocabulary and its vectors. */
export function skipUnlessVocab(name: VocabName): string | false {
  return skipUnlessShared(vocabFileName(name)) || skipUnlessShared(`${vocabFileName(name)}.out`);
}

const files = new Map<VocabName, GgufFile>();
const tokenizers = new Map<VocabName, GgufTokenizer>();

export function vocabFile(name: VocabName): GgufFile {
  let file = files.get(name);
  if (!file) {
    file = readGguf(sharedModel(vocabFileName(name))!);
    files.set(name, file);
  }
  return file;
}

export function ggufTokenizer(name: VocabName): GgufTokenizer {
  let tokenizer = tokenizers.get(name);
  if (!tokenizer) {
    tokenizer = tokenizerFromGguf(vocabFile(name));
    tokenizers.set(name, tokenizer);
  }
  return tokenizer;
}

export interface VocabVectors {
  inputs: string[];
  /** llama.cpp's ids for each input, tokenized without BOS and without parsing special tokens. */
  expected: number[][];
  /** The same, paired: each input with its ids. */
  cases: { input: string; ids: number[] }[];
}

/** The .inp strings (separated by "\n__ggml_vocab_test__\n", which also ends the file) and the .out id lines. */
export function vocabVectors(name: VocabName): VocabVectors {
  const base = sharedModel(vocabFileName(name))!;
  const inputs = readFileSync(`${base}.inp`, 'utf8').split('\n__ggml_vocab_test__\n');
  const lines = readFileSync(`${base}.out`, 'utf8').split('\n');
  if (inputs.at(-1) === '') inputs.pop();
  if (lines.at(-1) === '') lines.pop();
  if (inputs.length !== lines.length) {
    throw new Error(`${name}: ${inputs.length} test strings but ${lines.length} expected lines`);
  }
  const expected = lines.map((line) => line.trim() === '' ? [] : line.trim().split(/ +/).map(Number));
  return { inputs, expected, cases: inputs.map((input, i) => ({ input, ids: expected[i]! })) }; // lengths checked above
}
