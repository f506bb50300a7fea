// The tokenizer contract shared by the GGUF-vocabulary tokenizers and the tokenizer.json one.

export interface EncodeOptions {
  /** Add BOS (and EOS) as the model's metadata asks (add_bos_token / add_eos_token). Default true. */
  addSpecialTokens?: boolean;
  /** Recognise special tokens written as text (e.g. "<|eot_id|>") and emit their ids. Default false. */
  parseSpecial?: boolean;
}

export type TokenizerWorkerSource =
  | { kind: 'gguf-vocab'; vocab: unknown }
  | { kind: 'hf'; json: unknown; config: Record<string, unknown> };

export interface Tokenizer {
  readonly vocabSize: number;
  readonly bosId: number | undefined;
  readonly eosId: number | undefined;
  /** Every id that ends generation (EOS, EOT, <|im_end|> ...), for the sampler's stop set. */
  readonly stopTokenIds: readonly number[];
  encode(text: string, options?: EncodeOptions): number[];
  /** Whole-sequence decode. Special tokens are dropped when skipSpecialTokens (default true). */
  decode(ids: readonly number[], options?: { skipSpecialTokens?: boolean }): string;
  /**
   * The raw bytes a token stands for (byte-fallback tokens give their byte, byte-level BPE maps back to bytes,
   * SentencePiece's "▁" becomes a space). Incremental detokenizers join these and decode UTF-8 themselves, so a
   * character split across tokens is never emitted broken. Special/control tokens give their text when
   * `includeSpecial`, else no bytes.
   */
  tokenBytes(id: number, includeSpecial?: boolean): Uint8Array;
  /**
   * Whether decode of a sequence drops the leading space that SentencePiece adds (add_dummy_prefix): one space at
   * the very start of the decoded text, i.e. the first byte of the first token that yields any bytes (special
   * tokens yield none when skipped).
   */
  readonly stripsLeadingSpace: boolean;
  isSpecial(id: number): boolean;
  /**
   * The most bytes of UTF-8 input text one token can stand for, so a text of B bytes has at least ceil(B / this)
   * tokens; undefined when no such bound holds (a normalizer or pre-tokenizer that drops or shrinks text, unknown
   * words fused into one token). Lets a caller refuse a text too long for a context before tokenizing it.
   */
  maxBytesPerToken?(): number | undefined;
  /**
   * Plain data (structured-cloneable) from which tokenizerFromWorkerSource builds the same tokenizer in another
   * thread, for tokenizing off the caller's thread; undefined when it cannot.
   */
  workerSource?(): TokenizerWorkerSource | undefined;
  idToToken(id: number): string | undefined;
  tokenToId(token: string): number | undefined;
}
