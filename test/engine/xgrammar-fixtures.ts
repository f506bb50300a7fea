// XGrammar's own matcher over a byte-level vocabulary (the 256 byte tokens and an end token), for tests that check
// what a grammar the gateway writes accepts, character by character, against XGrammar itself.
import { byteLevelChars, type XGrammar, type XgHandle } from '../../src/engine/grammar/xgrammar.ts';

/** The end token's id: after the 256 byte tokens. */
export const END = 256;

/** A grammar compiler over the byte vocabulary (its caller deletes it). */
export function byteLevelCompiler(xg: XGrammar): XgHandle {
  const b = xg.binding;
  const info = new b.TokenizerInfo(b.vecStringFromJSArray([...byteLevelChars(), '']), 'BYTE_LEVEL', END + 1,
    b.vecIntFromJSArray([END]), false);
  return new b.GrammarCompiler(info, 1, false);
}
