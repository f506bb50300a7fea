// llama.cpp's own tokenizer test vectors: every string of every vocabulary must give exactly llama.cpp's ids,
// and decode must give the string back.

import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ggufTokenizer, skipUnlessVocab, VOCAB_NAMES, vocabVectors } from './tokenizer-fixtures.ts';

for (const name of VOCAB_NAMES) {
  describe(`GGUF tokenizer vectors: ${name}`, { skip: skipUnlessVocab(name) }, () => {
    it('encodes all 46 strings exactly as llama.cpp does (no BOS, no special parsing)', () => {
      const tokenizer = ggufTokenizer(name);
      const { cases } = vocabVectors(name);
      assert.equal(cases.length, 46);
      const mismatches: string[] = [];
      cases.forEach(({ input, ids: expected }, i) => {
        const ids = tokenizer.encode(input, { addSpecialTokens: false, parseSpecial: false });
        if (ids.join(' ') !== expected.join(' ')) {
          mismatches.push(`#${i} ${JSON.stringify(input)}\n  got      ${ids.join(' ')}\n  expected ${expected.join(' ')}`);
        }
      });
      assert.deepEqual(mismatches, []);
    });

    it('decodes the expected ids back to each string', () => {
      const tokenizer = ggufTokenizer(name);
      vocabVectors(name).cases.forEach(({ input, ids }, i) => assert.equal(tokenizer.decode(ids), input, `#${i}`));
    });

    it('joined tokenBytes equal the UTF-8 of each string', () => {
      const tokenizer = ggufTokenizer(name);
      vocabVectors(name).cases.forEach(({ input, ids }, i) => {
        const joined = Buffer.concat(ids.map((id) => tokenizer.tokenBytes(id)));
        const text = tokenizer.stripsLeadingSpace && joined[0] === 0x20 ? joined.subarray(1) : joined;
        assert.equal(text.toString('utf8'), input, `#${i}`);
      });
    });
  });
}
