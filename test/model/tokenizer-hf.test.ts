// The tokenizer.json path, checked against llama.cpp's vectors. There is no tokenizer.json on this machine, so each
// test builds one from a vocab GGUF's tokens, types and merges, laid out like the public Hugging Face files of that
// family (GPT-2, Llama 3, Qwen2, Llama 2). @huggingface/tokenizers then has to reproduce llama.cpp's ids, which
// checks the library-backed tokenizer, the hand-written GGUF one (same vectors) and the wiring between them.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, it } from 'node:test';
import { HfTokenizer, tokenizerFromJsonObject } from '../../src/model/tokenizer/hf-tokenizer.ts';
import { tokenizerFromWorkerSource } from '../../src/model/tokenizer/worker-source.ts';
import { BYTE_TO_CHAR } from '../../src/model/tokenizer/byte-level.ts';
import { createTokenizer, TokenizerError } from '../../src/model/tokenizer/index.ts';
import { ggufTokenizer, skipUnlessVocab, vocabFile, vocabVectors } from './tokenizer-fixtures.ts';
import { byteLevelJson, HF_TOKENIZER_CONFIGS as CONFIGS, sentencePieceJson } from './hf-tokenizer-json.ts';
import type { VocabName } from './tokenizer-fixtures.ts';

const built = new Map<VocabName, HfTokenizer>();
function hfTokenizer(name: VocabName): HfTokenizer {
  let tokenizer = built.get(name);
  if (!tokenizer) {
    const file = vocabFile(name);
    const json = name === 'llama-spm' || name === 'phi-3' ? sentencePieceJson(file) : byteLevelJson(name, file);
    tokenizer = tokenizerFromJsonObject(json, CONFIGS[name], name);
    built.set(name, tokenizer);
  }
  return tokenizer;
}

// ---------------------------------------------------------------------------------------------------------------

const BYTE_LEVEL: VocabName[] = ['gpt-2', 'llama-bpe', 'qwen2'];
const SENTENCEPIECE: VocabName[] = ['llama-spm'];

for (const name of [...BYTE_LEVEL, ...SENTENCEPIECE]) {
  describe(`tokenizer.json via @huggingface/tokenizers: ${name}`, { skip: skipUnlessVocab(name) }, () => {
    it('reproduces llama.cpp\'s ids for all 46 strings', () => {
      const tokenizer = hfTokenizer(name);
      const mismatches: string[] = [];
      vocabVectors(name).cases.forEach(({ input, ids: expected }, i) => {
        const ids = tokenizer.encode(input, { addSpecialTokens: false });
        if (ids.join(' ') !== expected.join(' ')) {
          mismatches.push(`#${i} ${JSON.stringify(input)}\n  got      ${ids.join(' ')}\n  expected ${expected.join(' ')}`);
        }
      });
      assert.deepEqual(mismatches, []);
    });

    it('decodes back to each string, and its joined tokenBytes agree with decode', () => {
      const tokenizer = hfTokenizer(name);
      vocabVectors(name).cases.forEach(({ input, ids }, i) => {
        assert.equal(tokenizer.decode(ids), input, `decode #${i}`);
        const joined = Buffer.concat(ids.map((id) => tokenizer.tokenBytes(id)));
        const bytes = tokenizer.stripsLeadingSpace && joined[0] === 0x20 ? joined.subarray(1) : joined;
        assert.equal(bytes.toString('utf8'), input, `tokenBytes #${i}`);
      });
    });

    it('bounds bytes per token safely, and builds the same tokenizer from its worker source', () => {
      const tokenizer = hfTokenizer(name);
      const bound = tokenizer.maxBytesPerToken();
      // NFC can shrink text (e + a combining accent, 3 bytes, becomes one 2-byte letter): no bound for qwen2's.
      if (name === 'qwen2') assert.equal(bound, undefined);
      else assert.ok(bound !== undefined && bound >= 4, `a bound for ${name}: ${bound}`);
      const rebuilt = tokenizerFromWorkerSource(structuredClone(tokenizer.workerSource()));
      const texts = [...vocabVectors(name).inputs, '   many    spaces   ', '🦙🦙 日本語 \t\n 12345678 antidisestablishment'.repeat(20)];
      for (const text of texts) {
        const ids = tokenizer.encode(text, { addSpecialTokens: false });
        if (bound !== undefined) assert.ok(ids.length >= Math.ceil(Buffer.byteLength(text) / bound), JSON.stringify(text.slice(0, 40)));
        assert.deepEqual(rebuilt.encode(text, { addSpecialTokens: false }), ids);
      }
    });

    it('encodes NEL and the byte order mark beside spaces and symbols as the GGUF tokenizer does', () => {
      const hf = hfTokenizer(name);
      const gguf = ggufTokenizer(name);
      for (const text of [' \u0085\'ve', 'a \u0085 b\u0085\u0085.', ' \uFEFFx', '\uFEFF. \uFEFF \uFEFF', 'x\u0085\uFEFF\u0085 y']) {
        assert.deepEqual(hf.encode(text, { addSpecialTokens: false }), gguf.encode(text, { addSpecialTokens: false }), JSON.stringify(text));
      }
    });

    it('gives the same token bytes as the GGUF tokenizer for every id', () => {
      const hf = hfTokenizer(name);
      const gguf = ggufTokenizer(name);
      assert.equal(hf.vocabSize, gguf.vocabSize);
      const differing: string[] = [];
      for (let id = 0; id < gguf.vocabSize; id++) {
        const [a, b] = [hf.tokenBytes(id, true), gguf.tokenBytes(id, true)];
        if (!Buffer.from(a.buffer, a.byteOffset, a.length).equals(b)) differing.push(`${id} ${gguf.idToToken(id)}`);
      }
      assert.deepEqual(differing, []);
    });
  });
}

describe('tokenizer.json: special tokens, BOS, stop ids', { skip: skipUnlessVocab('llama-bpe') ||
  skipUnlessVocab('qwen2') || skipUnlessVocab('llama-spm') || skipUnlessVocab('phi-3') }, () => {
  it('adds BOS from the post-processor, and follows add_bos_token in the config', () => {
    const llama3 = hfTokenizer('llama-bpe');
    assert.deepEqual(llama3.encode('Hello'), [128000, ...llama3.encode('Hello', { addSpecialTokens: false })]);
    assert.deepEqual(hfTokenizer('qwen2').encode('Hello'), hfTokenizer('qwen2').encode('Hello', { addSpecialTokens: false }));
    const llama2 = hfTokenizer('llama-spm');
    assert.deepEqual(llama2.encode('Hello'), [1, ...llama2.encode('Hello', { addSpecialTokens: false })]);
    const phi3 = hfTokenizer('phi-3'); // the template adds <s>, the config says not to
    assert.deepEqual(phi3.encode('Hello'), phi3.encode('Hello', { addSpecialTokens: false }));
  });

  it('parses special tokens only with parseSpecial, like the GGUF tokenizer', () => {
    const hf = hfTokenizer('llama-bpe');
    const gguf = ggufTokenizer('llama-bpe');
    const prompt = '<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>';
    for (const parseSpecial of [true, false]) {
      assert.deepEqual(hf.encode(prompt, { parseSpecial }), gguf.encode(prompt, { parseSpecial }), `parseSpecial ${parseSpecial}`);
    }
    assert.ok(hf.encode(prompt, { parseSpecial: true }).includes(128009));
    assert.ok(!hf.encode(prompt).includes(128009));
  });

  it('decodes sequences with special tokens as the GGUF tokenizer does', () => {
    for (const name of ['llama-spm', 'llama-bpe', 'qwen2'] as const) {
      const [hf, gguf] = [hfTokenizer(name), ggufTokenizer(name)];
      const text = ' Hello <|im_end|> world\n';
      const ids = [gguf.bosId ?? gguf.eosId!, ...gguf.encode(text, { addSpecialTokens: false }), gguf.eosId!];
      for (const skipSpecialTokens of [true, false]) {
        assert.equal(hf.decode(ids, { skipSpecialTokens }), gguf.decode(ids, { skipSpecialTokens }), `${name} ${skipSpecialTokens}`);
      }
    }
  });

  it('skips special tokens in decode unless asked', () => {
    const hf = hfTokenizer('qwen2');
    const ids = hf.encode('<|im_start|>user\nHi<|im_end|>', { parseSpecial: true });
    assert.equal(hf.decode(ids), 'user\nHi');
    assert.equal(hf.decode(ids, { skipSpecialTokens: false }), '<|im_start|>user\nHi<|im_end|>');
    assert.deepEqual([...hf.tokenBytes(151645)], []);
    assert.equal(Buffer.from(hf.tokenBytes(151645, true)).toString(), '<|im_end|>');
  });

  it('collects EOS and end-of-turn tokens as stop ids', () => {
    assert.deepEqual(hfTokenizer('qwen2').stopTokenIds, [151643, 151645]);
    assert.deepEqual(hfTokenizer('llama-bpe').stopTokenIds, [128001, 128009]);
    assert.equal(hfTokenizer('llama-bpe').bosId, 128000);
    assert.equal(hfTokenizer('llama-spm').eosId, 2);
    assert.equal(hfTokenizer('llama-spm').stripsLeadingSpace, true);
    assert.equal(hfTokenizer('qwen2').stripsLeadingSpace, false);
  });
});

describe('tokenizer.json: pre-tokenizers split on Unicode\'s whitespace and word characters', () => {
  // Every byte's character, and three merges that join a space to the byte after it or NEL's two bytes: which of
  // them applies shows where the pre-tokenizer cut. Hugging Face's tokenizers (Oniguruma), GPT-2's encoder and
  // llama.cpp take NEL (U+0085) for whitespace and the byte order mark (U+FEFF) for a symbol; JavaScript's \s has it
  // the other way round, and the library's ByteLevel pre-tokenizer was written with it.
  const vocab: Record<string, number> = {};
  BYTE_TO_CHAR.forEach((char, byte) => { vocab[char] = byte; }); // ids 0-255 are the bytes
  Object.assign(vocab, { 'ĠÂ': 256, 'Âħ': 257, 'Ġï': 258 });
  const tokenizer = tokenizerFromJsonObject({
    model: { type: 'BPE', vocab, merges: [['Ġ', 'Â'], ['Â', 'ħ'], ['Ġ', 'ï']] },
    pre_tokenizer: { type: 'Sequence', pretokenizers: [{ type: 'ByteLevel', add_prefix_space: false, use_regex: true }] },
    decoder: { type: 'ByteLevel' },
  });

  it('cuts " \\u0085" between the space and NEL (whitespace not followed by whitespace)', () => {
    // " ", "\u0085", "x": NEL's bytes merge, the space stays alone (the library's regex gave " \u0085" one piece).
    assert.deepEqual(tokenizer.encode(' \u0085x', { addSpecialTokens: false }), [0x20, 257, 0x78]);
  });

  it('keeps " \\uFEFF" together as a space and a symbol', () => {
    // " \uFEFF" (a symbol after its space), "x": the space joins the BOM's first byte (0xEF 0xBB 0xBF).
    assert.deepEqual(tokenizer.encode(' \uFEFFx', { addSpecialTokens: false }), [258, 0xbb, 0xbf, 0x78]);
    assert.equal(tokenizer.decode(tokenizer.encode(' \uFEFFx \u0085', { addSpecialTokens: false })), ' \uFEFFx \u0085');
  });

  // A BPE model whose merges spell "café", "naïve", "x²" and "?!": each comes out whole only if the pre-tokenizer kept it
  // one piece. Hugging Face's Whitespace splits on Rust's Unicode \w; the library used JavaScript's ASCII \w ("caf", "é").
  const words = ['c', 'a', 'f', 'é', 'n', 'ï', 'v', 'e', ',', '!', '?', 'b', 'x', 'y', '²', '\u0085', '\uFEFF',
    'ca', 'caf', 'café', 'na', 'naï', 'naïv', 'naïve', 'b\uFEFF', 'x²', '?!'];
  const wordVocab = Object.fromEntries(words.map((word, id) => [word, id]));
  const wordMerges = [['c', 'a'], ['ca', 'f'], ['caf', 'é'], ['n', 'a'], ['na', 'ï'], ['naï', 'v'], ['naïv', 'e'], ['b', '\uFEFF'],
    ['x', '²'], ['?', '!']];
  const withPreTokenizer = (config: Record<string, unknown>) => tokenizerFromJsonObject({
    model: { type: 'BPE', vocab: wordVocab, merges: wordMerges }, pre_tokenizer: { type: 'Sequence', pretokenizers: [config] },
  });
  const pieces = (tokenizer: HfTokenizer, text: string) =>
    tokenizer.encode(text, { addSpecialTokens: false }).map((id) => tokenizer.idToToken(id));

  it('Whitespace keeps words of any script whole', () => {
    assert.deepEqual(pieces(withPreTokenizer({ type: 'Whitespace' }), 'café, naïve!'), ['café', ',', 'naïve', '!']);
  });

  it('WhitespaceSplit cuts at NEL and not at the byte order mark', () => {
    // "a", "b\uFEFFc": the BOM stays inside the piece, so b and it merge (the library cut "a\u0085b" and "c").
    assert.deepEqual(pieces(withPreTokenizer({ type: 'WhitespaceSplit' }), 'a\u0085b\uFEFFc'), ['a', 'b\uFEFF', 'c']);
  });

  it('Digits cuts at any numeral, not only ASCII digits', () => {
    assert.deepEqual(pieces(withPreTokenizer({ type: 'Digits', individual_digits: false }), 'x²y'), ['x', '²', 'y']);
  });

  it('Punctuation isolates each mark unless its behavior says otherwise', () => {
    assert.deepEqual(pieces(withPreTokenizer({ type: 'Punctuation' }), 'a?!b'), ['a', '?', '!', 'b']);
    assert.deepEqual(pieces(withPreTokenizer({ type: 'Punctuation', behavior: 'Contiguous' }), 'a?!b'), ['a', '?!', 'b']);
    assert.deepEqual(pieces(withPreTokenizer({ type: 'Punctuation', behavior: 'MergedWithPrevious' }), 'a?!b'), ['a', '?', '!', 'b']);
    assert.deepEqual(pieces(withPreTokenizer({ type: 'Punctuation', behavior: 'Removed' }), 'a?!b'), ['a', 'b']);
  });
});

describe('tokenizer.json: Metaspace as Hugging Face\'s tokenizers read it', () => {
  // A BPE model that can merge two "▁" into one token: it does only where the pre-tokenizer left them in one piece.
  const pieces = ['▁', 'H', 'e', 'y', 'o', 'u', '▁▁', '▁H', '▁He', '▁Hey', '▁y', '▁yo', '▁you'];
  const model = {
    type: 'BPE', vocab: Object.fromEntries(pieces.map((piece, id) => [piece, id])),
    merges: [['▁', '▁'], ['▁', 'H'], ['▁H', 'e'], ['▁He', 'y'], ['▁', 'y'], ['▁y', 'o'], ['▁yo', 'u']],
  };
  const tokens = (json: Record<string, unknown>, text: string): (string | undefined)[] => {
    const tokenizer = tokenizerFromJsonObject({ model, ...json });
    return tokenizer.encode(text, { addSpecialTokens: false }).map((id) => tokenizer.idToToken(id));
  };
  const metaspace = { type: 'Metaspace', replacement: '▁', prepend_scheme: 'always' };

  it('splits before each "▁" unless split is false (its default is true)', () => {
    assert.deepEqual(tokens({ pre_tokenizer: { ...metaspace, split: true } }, 'Hey  you'), ['▁Hey', '▁', '▁you']);
    assert.deepEqual(tokens({ pre_tokenizer: metaspace }, 'Hey  you'), ['▁Hey', '▁', '▁you']);
    assert.deepEqual(tokens({ pre_tokenizer: { ...metaspace, split: false } }, 'Hey  you'), ['▁Hey', '▁▁', 'y', 'o', 'u']);
  });

  it('reads the older add_prefix_space false as prepend_scheme "never"', () => {
    const older = { type: 'Metaspace', replacement: '▁', add_prefix_space: false, split: false };
    assert.deepEqual(tokens({ pre_tokenizer: older }, 'Hey'), ['H', 'e', 'y']);
    assert.deepEqual(tokens({ pre_tokenizer: { ...older, add_prefix_space: true } }, 'Hey'), ['▁Hey']);
  });

  it('decodes with prepend_scheme "never" keeping the first token\'s space, as a stream does', () => {
    const tokenizer = tokenizerFromJsonObject({ model, decoder: { ...metaspace, prepend_scheme: 'never' } });
    const ids = [model.vocab['▁Hey']!, model.vocab['▁you']!];
    assert.equal(tokenizer.stripsLeadingSpace, false);
    assert.equal(tokenizer.decode(ids), ' Hey you');
    const always = tokenizerFromJsonObject({ model, decoder: { type: 'Metaspace', replacement: '▁' } });
    assert.equal(always.stripsLeadingSpace, true, 'no scheme given: "always", which drops it');
    assert.equal(always.decode(ids), 'Hey you');
  });
});

describe('tokenizer.json: no bytes-per-token bound where text can shrink', () => {
  it('gives none for NFKC, whitespace-removing pre-tokenizers, fused unknowns and whitespace-stripping added tokens', () => {
    const model = { type: 'BPE', vocab: { a: 0, b: 1, ab: 2, '[UNK]': 3 }, merges: ['a b'], unk_token: '[UNK]' };
    assert.equal(tokenizerFromJsonObject({ model }).maxBytesPerToken(), 5);
    assert.equal(tokenizerFromJsonObject({ model, normalizer: { type: 'NFKC' } }).maxBytesPerToken(), undefined);
    assert.equal(tokenizerFromJsonObject({ model, pre_tokenizer: { type: 'Whitespace' } }).maxBytesPerToken(), undefined);
    assert.equal(tokenizerFromJsonObject({ model: { ...model, fuse_unk: true } }).maxBytesPerToken(), undefined);
    // An added token that strips the whitespace beside it (Phi-3's "<|user|>"): that whitespace is in no token.
    const user = { id: 4, content: '<|user|>', special: true };
    assert.equal(tokenizerFromJsonObject({ model, added_tokens: [user] }).maxBytesPerToken(), 8);
    assert.equal(tokenizerFromJsonObject({ model, added_tokens: [{ ...user, rstrip: true }] }).maxBytesPerToken(), undefined);
    assert.equal(tokenizerFromJsonObject({ model, added_tokens: [{ ...user, lstrip: true }] }).maxBytesPerToken(), undefined);
  });
});

describe('tokenizer.json: token ids that cannot be right', () => {
  const model = { type: 'BPE', vocab: { a: 0, b: 1, ab: 2 }, merges: ['a b'] };
  const refuses = (json: Record<string, unknown>, pattern: RegExp): void => {
    assert.throws(() => tokenizerFromJsonObject(json, {}, 'tok.json'),
      (e) => e instanceof TokenizerError && pattern.test(e.message) && !e.message.includes('\n'));
  };

  it('tokenizer_config.json: add_bos_token / add_eos_token that is not a boolean, a BOS it asks for not in the vocabulary', () => {
    const json = { model, added_tokens: [{ id: 3, content: '<s>', special: true }] };
    const refusesConfig = (config: Record<string, unknown>, pattern: RegExp): void => {
      assert.throws(() => tokenizerFromJsonObject(json, config, 'tok.json'), (e) => e instanceof TokenizerError && pattern.test(e.message));
    };
    refusesConfig({ bos_token: '<s>', add_bos_token: 'true' }, /^tok\.json: tokenizer_config\.json add_bos_token is "true", not true or false$/);
    refusesConfig({ add_eos_token: 'false' }, /^tok\.json: tokenizer_config\.json add_eos_token is "false", not true or false$/);
    refusesConfig({ add_bos_token: 1 }, /add_bos_token is 1, not true or false/);
    refusesConfig({ bos_token: '<|begin|>', add_bos_token: true },
      /^tok\.json: tokenizer_config\.json bos_token "<\|begin\|>" is not a token of the vocabulary, and add_bos_token asks for it$/);
    // Named but not asked for (no add_bos_token; an EOS): left out, as before.
    assert.equal(tokenizerFromJsonObject(json, { bos_token: '<|begin|>', add_bos_token: false }).bosId, undefined);
    assert.equal(tokenizerFromJsonObject(json, { eos_token: { content: '</s>' } }).eosId, undefined);
    // What the vocabulary has, and booleans (or null) for the flags, load.
    const tokenizer = tokenizerFromJsonObject(json, { bos_token: '<s>', add_bos_token: true, add_eos_token: null, eos_token: null });
    assert.deepEqual(tokenizer.encode('ab'), [3, 2]);
  });

  it('an id that is not a whole number from 0', () => {
    refuses({ model: { ...model, vocab: { ...model.vocab, c: -1 } } }, /^tok\.json: token "c" has id -1, not a whole number >= 0$/);
    refuses({ model: { ...model, vocab: { ...model.vocab, c: 2.5 } } }, /token "c" has id 2\.5/);
    refuses({ model, added_tokens: [{ id: '3', content: '<x>' }] }, /added token "<x>" has id "3", not a whole number >= 0/);
  });

  it('an added token that is not an object with id and content (was a TypeError)', () => {
    refuses({ model, added_tokens: [null] }, /^tok\.json: added_tokens\[0\] is not a token \(an object with "id" and "content"\)$/);
    refuses({ model, added_tokens: [{ id: 3 }] }, /added_tokens\[0\] is not a token/);
    refuses({ model, added_tokens: { a: 3 } }, /^tok\.json: added_tokens is not a list$/);
  });

  it('an added token whose id or text the vocabulary gives another (decoding "o" as "<s>", silently)', () => {
    refuses({ model, added_tokens: [{ id: 1, content: '<s>', special: true }] },
      /^tok\.json: added token "<s>" has id 1, but the vocabulary gives id 1 to "b" \(an added token that is in the vocabulary has its id there\)$/);
    refuses({ model, added_tokens: [{ id: 5, content: 'ab', special: false }] },
      /^tok\.json: added token "ab" has id 5, but the vocabulary gives "ab" id 2/);
    refuses({ model, added_tokens: [{ id: 3, content: '<x>' }, { id: 4, content: '<x>' }] },
      /^tok\.json: added token "<x>" \(id 4\) conflicts with the added token "<x>" \(id 3\)/);
    refuses({ model, added_tokens: [{ id: 3, content: '<x>' }, { id: 3, content: '<y>' }] },
      /^tok\.json: added token "<y>" \(id 3\) conflicts with the added token "<x>" \(id 3\)/);
    const unigram = { type: 'Unigram', vocab: [['<unk>', 0], ['a', -1], ['b', -2]], unk_id: 0 };
    refuses({ model: unigram, added_tokens: [{ id: 2, content: '</s>', special: true }] },
      /added token "<\/s>" has id 2, but the vocabulary gives id 2 to "b"/);
    // The same token in both, as real files list their special tokens: accepted.
    assert.deepEqual(tokenizerFromJsonObject({ model: unigram, added_tokens: [{ id: 0, content: '<unk>', special: true }] }).encode('a'), [1]);
    assert.deepEqual(tokenizerFromJsonObject({ model, added_tokens: [{ id: 2, content: 'ab' }, { id: 3, content: '<x>' }] }).encode('ab'), [2]);
  });

  it('a post-processor id that is no token of the file (every request failed on it)', () => {
    const bos = (ids: unknown[]) => ({
      type: 'TemplateProcessing', single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
      pair: [], special_tokens: { '<s>': { id: '<s>', ids, tokens: ['<s>'] } },
    });
    refuses({ model, post_processor: bos([99]) },
      /^tok\.json: the post_processor's special token "<s>" ids\[0\] is 99, not the id of a token the file defines$/);
    refuses({ model, post_processor: bos([1.5]) }, /special token "<s>" ids\[0\] is 1\.5, not the id/);
    refuses({ model, post_processor: { type: 'Sequence', processors: [bos(['1'])] } }, /special token "<s>" ids\[0\] is "1", not the id/);
    refuses({ model, post_processor: { type: 'BertProcessing', cls: ['[CLS]', 'x'], sep: ['[SEP]', 1] } },
      /the post_processor's cls id is "x", not the id of a token the file defines/);
    assert.deepEqual(tokenizerFromJsonObject({ model, post_processor: bos([1]) }).encode('a'), [1, 0]);
    // Sequences nested too deep for the library are its TokenizerError, not a stack overflow in this check.
    let deep: Record<string, unknown> = bos([1]);
    for (let i = 0; i < 100_000; i++) deep = { type: 'Sequence', processors: [deep] };
    refuses({ model, post_processor: deep }, /^tok\.json: @huggingface\/tokenizers cannot load it/);
  });

  it('an id far beyond the tokens the file defines (a minute in the library, or a vocabulary of 10^12)', () => {
    refuses({ model, added_tokens: [{ id: 10_000_000, content: '<x>', special: true }] },
      /^tok\.json: token id 10000000 is far beyond the 4 tokens the file defines/);
    refuses({ model: { ...model, vocab: { ...model.vocab, c: 1e12 } } }, /token id 1000000000000 is far beyond the 4 tokens/);
    // Added tokens after the vocabulary, with a few holes, as real files have them.
    const tokenizer = tokenizerFromJsonObject({ model, added_tokens: [{ id: 7, content: '<x>', special: true }] });
    assert.equal(tokenizer.vocabSize, 8);
  });
});

describe('tokenizer.json from a file', { skip: skipUnlessVocab('gpt-2') }, () => {
  const dir = mkdtempSync(join(tmpdir(), 'conduit-tokenizer-'));
  after(() => rmSync(dir, { recursive: true, force: true }));

  it('loads through createTokenizer and names a bad file in its error', () => {
    const path = join(dir, 'tokenizer.json');
    writeFileSync(path, JSON.stringify(byteLevelJson('gpt-2', vocabFile('gpt-2'))));
    const tokenizer = createTokenizer({ kind: 'hf', tokenizerJson: path, tokenizerConfig: CONFIGS['gpt-2'] });
    assert.deepEqual(tokenizer.encode('Hello world'), ggufTokenizer('gpt-2').encode('Hello world'));

    const broken = join(dir, 'broken.json');
    writeFileSync(broken, '{"model": ');
    assert.throws(() => createTokenizer({ kind: 'hf', tokenizerJson: broken, tokenizerConfig: {} }),
      (e: Error) => e instanceof TokenizerError && e.message.includes(broken));
    assert.throws(() => tokenizerFromJsonObject({ version: '1.0' }), /no "model" object/);
  });

  it('refuses ids outside the vocabulary', () => {
    assert.throws(() => hfTokenizer('gpt-2').decode([50257]), TokenizerError);
  });
});
