// Errors raised by the tokenizers: a vocabulary that cannot be used, or ids/text a tokenizer cannot handle.

export class TokenizerError extends Error {
  override name = 'TokenizerError';
}
