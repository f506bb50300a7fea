// Token texts that end generation in the model families Conduit knows. Model files rarely list every such token
// by id (a GGUF names one EOS; a tokenizer_config.json one eos_token), so they are also found by their text.

/** End of a turn: the model has finished its reply. */
export const END_OF_TURN_TEXTS: readonly string[] = ['<|eot_id|>', '<|im_end|>', '<|end|>', '<end_of_turn>',
  '<|endoftext|>', '<|end_of_text|>', '<EOT>', '_<EOT>', '<｜end▁of▁sentence｜>', '<end_of_utterance>'];

/** End of a message that continues after a tool call (Llama 3.1's ipython turns). */
export const END_OF_MESSAGE_TEXTS: readonly string[] = ['<|eom_id|>'];

/** Fill-in-the-middle padding and separators: a code model emits them when it is done. */
export const FIM_END_TEXTS: readonly string[] = ['<|fim_pad|>', '<|fim_repo|>', '<|repo_name|>', '<|file_sep|>'];

/** Every text that stops generation. */
export const STOP_TEXTS: readonly string[] = [...END_OF_TURN_TEXTS, ...END_OF_MESSAGE_TEXTS, '<|return|>',
  '<|call|>', ...FIM_END_TEXTS];

/**
 * Harmony-style vocabularies end a message with <|end|> but the turn with <|return|> or <|call|>; there <|end|>
 * must not stop generation.
 */
export function endIsMidTurn(has: (text: string) => boolean): boolean {
  return has('<|end|>') && has('<|return|>') && has('<|call|>');
}
