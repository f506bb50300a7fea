// A model whose greedy output is a fixed chain of tokens, for tests that need exact special tokens in the output
// (a guided regex cannot force those). A one-layer Llama with the Llama 2 vocabulary in which every block's output
// projection is zero, so each position's hidden state is its own token's embedding: the chain's tokens get one basis
// vector each, and the output projection maps the i-th chain token to the next (the last one to EOS, and EOS to
// itself). Every other token embeds to zero, so only the prompt's last token, the chain's first, decides what follows.

import { GgmlType } from '../../src/model/ggml-types.ts';
import { GgufValueType, readGguf, type GgufValue } from '../../src/model/gguf.ts';
import { writeGguf, type GgufTensorToWrite, type GgufValueTypeSpec } from '../../src/model/gguf-writer.ts';
import { LLAMA_SPM_TOKENIZER_PATH } from '../../src/model/synthetic.ts';

export interface ChainToken {
  /** The token's text ("▁" is written for spaces, as SentencePiece spells them). */
  text: string;
  /** A control token is special: skipped by skip_special_tokens, parsed from a template's text. */
  control?: boolean;
}

export interface TokenChainSpec {
  /** The first token ends the prompt (the template's generation prompt); the model writes the others, then EOS. */
  chain: readonly ChainToken[];
  /** None: the model has no template, and the server uses its plain fallback. */
  chatTemplate?: string;
  name?: string;
}

const DIM = 64;
const FIRST_ID = 31900; // ordinary tokens of the Llama 2 vocabulary that the chain's tokens replace
const EOS_ID = 2;

export function writeTokenChainModel(path: string, spec: TokenChainSpec): void {
  const vocab = readGguf(LLAMA_SPM_TOKENIZER_PATH);
  const tokens = [...(vocab.metadata.get('tokenizer.ggml.tokens') as string[])];
  const types = Int32Array.from(vocab.metadata.get('tokenizer.ggml.token_type') as ArrayLike<number>);
  const vocabSize = tokens.length;
  if (spec.chain.length + 1 > DIM) throw new Error('the chain is longer than the model has dimensions');
  const ids = spec.chain.map((token, i) => {
    const id = FIRST_ID + i;
    tokens[id] = token.text.replaceAll(' ', '\u2581');
    types[id] = token.control ? 3 : 1; // GGUF token types: CONTROL, NORMAL
    return id;
  });
  const metadata: [string, GgufValue][] = [
    ['general.architecture', 'llama'],
    ['general.name', spec.name ?? 'token-chain'],
    ['llama.vocab_size', vocabSize],
    ['llama.context_length', 512],
    ['llama.embedding_length', DIM],
    ['llama.block_count', 1],
    ['llama.feed_forward_length', DIM],
    ['llama.rope.dimension_count', DIM / 2],
    ['llama.rope.freq_base', 10000],
    ['llama.attention.head_count', 2],
    ['llama.attention.head_count_kv', 2],
    ['llama.attention.layer_norm_rms_epsilon', 1e-5],
  ];
  const typeSpecs = new Map<string, GgufValueTypeSpec>([
    ['llama.rope.freq_base', { type: GgufValueType.FLOAT32 }],
    ['llama.attention.layer_norm_rms_epsilon', { type: GgufValueType.FLOAT32 }],
  ]);
  for (const [key, value] of vocab.metadata) {
    if (!key.startsWith('tokenizer.') || key === 'tokenizer.chat_template') continue;
    metadata.push([key, key === 'tokenizer.ggml.tokens' ? tokens : key === 'tokenizer.ggml.token_type' ? types : value]);
    typeSpecs.set(key, vocab.metadataTypes.get(key)!);
  }
  if (spec.chatTemplate !== undefined) metadata.push(['tokenizer.chat_template', spec.chatTemplate]);

  // Chain token i (and EOS, last) embeds to basis vector i; the output row of what follows it reads dimension i.
  const sources = [...ids, EOS_ID];
  const embeddings = new Float32Array(DIM * vocabSize);
  const output = new Float32Array(DIM * vocabSize);
  sources.forEach((id, i) => {
    embeddings[id * DIM + i] = 1;
    const next = i + 1 < sources.length ? sources[i + 1]! : EOS_ID;
    output[next * DIM + i] = 10;
  });
  const f32 = (name: string, shape: number[], values: Float32Array): GgufTensorToWrite =>
    ({ name, type: GgmlType.F32, shape, data: new Uint8Array(values.buffer, values.byteOffset, values.byteLength) });
  const zeros = (name: string, rowLength: number, rows: number) => f32(name, [rowLength, rows], new Float32Array(rowLength * rows));
  const ones = (name: string) => f32(name, [DIM], new Float32Array(DIM).fill(1));
  const tensors = [
    f32('token_embd.weight', [DIM, vocabSize], embeddings),
    ones('output_norm.weight'),
    f32('output.weight', [DIM, vocabSize], output),
    ones('blk.0.attn_norm.weight'),
    zeros('blk.0.attn_q.weight', DIM, DIM),
    zeros('blk.0.attn_k.weight', DIM, DIM),
    zeros('blk.0.attn_v.weight', DIM, DIM),
    zeros('blk.0.attn_output.weight', DIM, DIM),
    ones('blk.0.ffn_norm.weight'),
    zeros('blk.0.ffn_gate.weight', DIM, DIM),
    zeros('blk.0.ffn_up.weight', DIM, DIM),
    zeros('blk.0.ffn_down.weight', DIM, DIM),
  ];
  writeGguf(path, { metadata, types: typeSpecs, tensors });
}
