// A tokenizer.json built from a vocab GGUF's tokens, types and merges, laid out like the public Hugging Face files
// of that family (GPT-2, Llama 3, Qwen2, Llama 2): the tokenizer suites check it against llama.cpp's vectors, and the
// architecture tests put it into Hugging Face folders of random-weight models.

import type { GgufFile } from '../../src/model/gguf.ts';
import { GgufTokenType } from '../../src/model/tokenizer/gguf-vocab.ts';
import type { VocabName } from './tokenizer-fixtures.ts';

export type Json = Record<string, unknown>;

/** The pre-tokenizer regexes exactly as the public tokenizer.json files write them (Oniguruma syntax). */
const LLAMA3_SPLIT = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2_SPLIT = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

function vocabArrays(file: GgufFile) {
  return {
    tokens: file.metadata.get('tokenizer.ggml.tokens') as string[],
    types: file.metadata.get('tokenizer.ggml.token_type') as Int32Array,
    scores: file.metadata.get('tokenizer.ggml.scores') as Float32Array | undefined,
    merges: file.metadata.get('tokenizer.ggml.merges') as string[] | undefined,
  };
}

function addedTokens(tokens: string[], types: Int32Array): Json[] {
  const added: Json[] = [];
  types.forEach((type, id) => {
    if (type === GgufTokenType.CONTROL || type === GgufTokenType.USER_DEFINED || type === GgufTokenType.UNKNOWN) {
      added.push({ id, content: tokens[id], single_word: false, lstrip: false, rstrip: false, normalized: false,
        special: type !== GgufTokenType.USER_DEFINED });
    }
  });
  return added;
}

function bosTemplate(bos: string, bosId: number): Json {
  return {
    type: 'TemplateProcessing',
    single: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
    pair: [],
    special_tokens: { [bos]: { id: bos, ids: [bosId], tokens: [bos] } },
  };
}

export function byteLevelJson(name: VocabName, file: GgufFile): Json {
  const { tokens, types, merges } = vocabArrays(file);
  const vocab: Record<string, number> = {};
  tokens.forEach((token, id) => { vocab[token] = id; });
  const byteLevel = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: name === 'gpt-2' };
  const split = name === 'llama-bpe' ? LLAMA3_SPLIT : QWEN2_SPLIT;
  return {
    version: '1.0',
    added_tokens: addedTokens(tokens, types),
    normalizer: name === 'qwen2' ? { type: 'NFC' } : null,
    pre_tokenizer: name === 'gpt-2' ? byteLevel : {
      type: 'Sequence',
      pretokenizers: [{ type: 'Split', pattern: { Regex: split }, behavior: 'Isolated', invert: false },
        { ...byteLevel, use_regex: false }],
    },
    post_processor: name === 'llama-bpe'
      ? { type: 'Sequence', processors: [{ ...byteLevel, use_regex: true }, bosTemplate('<|begin_of_text|>', 128000)] }
      : byteLevel,
    decoder: byteLevel,
    model: {
      type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: false, byte_fallback: false, ignore_merges: name === 'llama-bpe', vocab,
      merges: merges!.map((merge) => { const at = merge.indexOf(' ', 1); return [merge.slice(0, at), merge.slice(at + 1)]; }),
    },
  };
}

/**
 * Llama 2's layout. SentencePiece vocabularies carry scores, not merges; like Hugging Face's converter, every split
 * of a piece into two vocabulary pieces becomes a merge, ranked by the piece's score (best first).
 */
export function sentencePieceJson(file: GgufFile): Json {
  const { tokens, types, scores } = vocabArrays(file);
  const vocab: Record<string, number> = {};
  tokens.forEach((token, id) => { vocab[token] = id; });
  const candidates: { left: string; right: string; score: number; id: number }[] = [];
  tokens.forEach((piece, id) => {
    if (types[id] !== GgufTokenType.NORMAL) return;
    const chars = Array.from(piece);
    for (let cut = 1; cut < chars.length; cut++) {
      const left = chars.slice(0, cut).join('');
      const right = chars.slice(cut).join('');
      if (left in vocab && right in vocab) candidates.push({ left, right, score: scores![id]!, id });
    }
  });
  candidates.sort((a, b) => b.score - a.score || a.id - b.id);
  return {
    version: '1.0',
    added_tokens: addedTokens(tokens, types),
    normalizer: { type: 'Sequence', normalizers: [{ type: 'Prepend', prepend: '▁' },
      { type: 'Replace', pattern: { String: ' ' }, content: '▁' }] },
    pre_tokenizer: null,
    post_processor: bosTemplate('<s>', 1),
    decoder: { type: 'Sequence', decoders: [{ type: 'Replace', pattern: { String: '▁' }, content: ' ' },
      { type: 'ByteFallback' }, { type: 'Fuse' }, { type: 'Strip', content: ' ', start: 1, stop: 0 }] },
    model: {
      type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: true, byte_fallback: true, ignore_merges: false, vocab,
      merges: candidates.map((c) => [c.left, c.right]),
    },
  };
}

/** tokenizer_config.json of each family. */
export const HF_TOKENIZER_CONFIGS: Record<VocabName, Json> = {
  'gpt-2': { bos_token: '<|endoftext|>', eos_token: '<|endoftext|>' },
  'llama-bpe': { bos_token: '<|begin_of_text|>', eos_token: '<|end_of_text|>' },
  'qwen2': { eos_token: '<|endoftext|>', pad_token: '<|endoftext|>' },
  'llama-spm': { bos_token: { content: '<s>' }, eos_token: { content: '</s>' }, add_bos_token: true },
  'phi-3': { bos_token: '<s>', eos_token: '<|endoftext|>', add_bos_token: false },
};

