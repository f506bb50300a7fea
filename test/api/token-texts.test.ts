// The token strings of logprobs (TokenTexts): each token's text is exactly its bytes as UTF-8, a leading U+FEFF (a
// byte order mark some vocabularies learned from their training text) included, so the tokens join to the text.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { TokenTexts } from '../../src/api/openai-format.ts';
import { ggufTokenizer, skipUnlessVocab } from '../model/tokenizer-fixtures.ts';

describe('logprob token strings', { skip: skipUnlessVocab('llama-bpe') }, () => {
  it('keep a token\'s leading U+FEFF: its text re-encodes to its bytes', () => {
    const tokenizer = ggufTokenizer('llama-bpe');
    const texts = new TokenTexts(tokenizer);
    const withBom: number[] = [];
    for (let id = 0; id < tokenizer.vocabSize && withBom.length < 5; id++) {
      const bytes = tokenizer.tokenBytes(id, true);
      if (bytes[0] === 0xef && bytes[1] === 0xbb && bytes[2] === 0xbf) withBom.push(id);
    }
    assert.ok(withBom.length > 0, 'the Llama 3 vocabulary has tokens starting with U+FEFF');
    for (const id of withBom) {
      const { text, bytes } = texts.get(id);
      assert.equal(text.codePointAt(0), 0xfeff, `token ${id}`);
      assert.deepEqual([...new TextEncoder().encode(text)], bytes, `token ${id}`);
    }
  });
});
