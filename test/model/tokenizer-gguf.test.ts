// Behaviour of the GGUF-vocabulary tokenizers beyond the plain vectors: BOS/EOS, special tokens written in text,
// stop ids, token bytes, round trips on random text, and clear errors for what cannot work.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import type { GgufFile, GgufValue } from '../../src/model/gguf.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { createTokenizer, TokenizerError } from '../../src/model/tokenizer/index.ts';
import { tokenizerFromGguf } from '../../src/model/tokenizer/gguf-tokenizer.ts';
import { sharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { ggufTokenizer, skipUnlessVocab, VOCAB_NAMES, vocabFile } from './tokenizer-fixtures.ts';
import { makeTinyModel, TINY_DIMS, writeTinyGguf } from './loader-fixtures.ts';
import type { VocabName } from './tokenizer-fixtures.ts';
import { seededRandom as randomSource } from '../../src/util/random.ts';

/** The same file with some metadata changed (or removed, for undefined). */
function withMetadata(file: GgufFile, changes: Record<string, GgufValue | undefined>): GgufFile {
  const metadata = new Map(file.metadata);
  for (const [key, value] of Object.entries(changes)) {
    if (value === undefined) metadata.delete(key);
    else metadata.set(key, value);
  }
  return { ...file, metadata };
}

function idOf(name: VocabName, token: string): number {
  const id = ggufTokenizer(name).tokenToId(token);
  assert.notEqual(id, undefined, `${name} has no token ${JSON.stringify(token)}`);
  return id!;
}

const text = (bytes: Uint8Array): string => Buffer.from(bytes).toString('utf8');

// ---------------------------------------------------------------------------------------------------------------

describe('stories260K tokenizer', { skip: skipUnlessShared('stories260K.gguf') }, () => {
  it('gives the prompt ids llama.cpp used for the reference generation', () => {
    const tokenizer = createTokenizer({ kind: 'gguf', file: readGguf(sharedModel('stories260K.gguf')!) });
    assert.deepEqual(tokenizer.encode('Once upon a time'), [1, 403, 407, 261, 378]);
    assert.deepEqual(tokenizer.encode('Once upon a time', { addSpecialTokens: false }), [403, 407, 261, 378]);
    assert.equal(tokenizer.decode([1, 403, 407, 261, 378]), 'Once upon a time');
    assert.deepEqual(tokenizer.stopTokenIds, [2]);
  });
});

describe('BOS and EOS', { skip: skipUnlessVocab('llama-spm') || skipUnlessVocab('llama-bpe') ||
  skipUnlessVocab('gpt-2') || skipUnlessVocab('qwen2') }, () => {
  it('adds BOS where the vocabulary asks for it (SentencePiece and Llama 3) and not elsewhere', () => {
    const expectations: [VocabName, number | undefined][] =
      [['llama-spm', 1], ['llama-bpe', 128000], ['gpt-2', undefined], ['qwen2', undefined]];
    for (const [name, bos] of expectations) {
      const tokenizer = ggufTokenizer(name);
      const plain = tokenizer.encode('Hello world', { addSpecialTokens: false });
      const withSpecial = tokenizer.encode('Hello world');
      assert.deepEqual(withSpecial, bos === undefined ? plain : [bos, ...plain], name);
    }
  });

  it('an empty text is just BOS for SentencePiece, nothing without special tokens', () => {
    const tokenizer = ggufTokenizer('llama-spm');
    assert.deepEqual(tokenizer.encode(''), [1]);
    assert.deepEqual(tokenizer.encode('', { addSpecialTokens: false }), []);
  });

  it('follows add_bos_token / add_eos_token from metadata', () => {
    const file = withMetadata(vocabFile('gpt-2'), {
      'tokenizer.ggml.add_bos_token': true, 'tokenizer.ggml.add_eos_token': true,
    });
    const tokenizer = tokenizerFromGguf(file);
    const plain = tokenizer.encode('Hello', { addSpecialTokens: false });
    assert.deepEqual(tokenizer.encode('Hello'), [50256, ...plain, 50256]);
  });

  it('refuses add_bos_token without a BOS id', () => {
    const file = withMetadata(vocabFile('qwen2'), {
      'tokenizer.ggml.add_bos_token': true, 'tokenizer.ggml.bos_token_id': undefined,
    });
    assert.throws(() => tokenizerFromGguf(file), (e: Error) => e instanceof TokenizerError && /no BOS/.test(e.message));
  });
});

describe('special tokens written in text', { skip: VOCAB_NAMES.map(skipUnlessVocab).find(Boolean) ?? false }, () => {
  it('parses Llama 3 header and end-of-turn tokens only with parseSpecial', () => {
    const tokenizer = ggufTokenizer('llama-bpe');
    const prompt = '<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>';
    assert.deepEqual(tokenizer.encode(prompt, { addSpecialTokens: false, parseSpecial: true }),
      [128006, idOf('llama-bpe', 'user'), 128007, idOf('llama-bpe', 'ĊĊ'), idOf('llama-bpe', 'Hi'), 128009]);
    const literal = tokenizer.encode(prompt, { addSpecialTokens: false });
    assert.ok(literal.every((id) => id < 128000), 'no special ids without parseSpecial');
    assert.equal(tokenizer.decode(literal), prompt);
  });

  it('puts the SentencePiece dummy prefix after a special token', () => {
    const tokenizer = ggufTokenizer('llama-spm');
    assert.deepEqual(tokenizer.encode('<s>Hello', { addSpecialTokens: false, parseSpecial: true }),
      [1, idOf('llama-spm', '▁Hello')]);
    assert.ok(!tokenizer.encode('<s>Hello', { addSpecialTokens: false }).includes(1));
  });

  it('drops whitespace after Phi-3 chat tokens (their rstrip flag)', () => {
    const tokenizer = ggufTokenizer('phi-3');
    assert.deepEqual(tokenizer.encode('<|user|>\nHello<|end|>', { addSpecialTokens: false, parseSpecial: true }),
      [32010, idOf('phi-3', '▁Hello'), 32007]);
  });

  it('always recognises user-defined tokens, even without parseSpecial', () => {
    const tokenizer = ggufTokenizer('qwen2');
    assert.deepEqual(tokenizer.encode('a[PAD151646]', { addSpecialTokens: false }), [idOf('qwen2', 'a'), 151646]);
  });

  it('prefers the longest special token where two overlap', () => {
    const tokenizer = ggufTokenizer('llama-bpe');
    const ids = tokenizer.encode('<|reserved_special_token_10|>', { addSpecialTokens: false, parseSpecial: true });
    assert.deepEqual(ids, [idOf('llama-bpe', '<|reserved_special_token_10|>')]);
  });
});

describe('stop ids and special-token bookkeeping', { skip: VOCAB_NAMES.map(skipUnlessVocab).find(Boolean) ?? false }, () => {
  it('collects EOS, end-of-turn and similar tokens per vocabulary', () => {
    assert.deepEqual(ggufTokenizer('llama-spm').stopTokenIds, [2]);
    assert.deepEqual(ggufTokenizer('gpt-2').stopTokenIds, [50256]);
    assert.deepEqual(ggufTokenizer('llama-bpe').stopTokenIds, [128001, 128009]);
    assert.deepEqual(ggufTokenizer('qwen2').stopTokenIds, [151643, 151645]);
    assert.deepEqual(ggufTokenizer('phi-3').stopTokenIds, [32000, 32007]);
  });

  it('reports BOS/EOS ids and which ids are special', () => {
    const tokenizer = ggufTokenizer('llama-bpe');
    assert.equal(tokenizer.bosId, 128000);
    assert.equal(tokenizer.eosId, 128001);
    assert.equal(tokenizer.isSpecial(128009), true);
    assert.equal(tokenizer.isSpecial(idOf('llama-bpe', 'Hi')), false);
    assert.equal(tokenizer.idToToken(128009), '<|eot_id|>');
    assert.equal(tokenizer.idToToken(128256), undefined);
    assert.equal(tokenizer.stripsLeadingSpace, false);
    assert.equal(ggufTokenizer('llama-spm').stripsLeadingSpace, true);
  });

  it('skips special tokens in decode unless asked', () => {
    const tokenizer = ggufTokenizer('llama-bpe');
    const ids = [128000, ...tokenizer.encode('Hi', { addSpecialTokens: false }), 128009];
    assert.equal(tokenizer.decode(ids), 'Hi');
    assert.equal(tokenizer.decode(ids, { skipSpecialTokens: false }), '<|begin_of_text|>Hi<|eot_id|>');
  });
});

describe('tokenBytes', { skip: skipUnlessVocab('llama-spm') || skipUnlessVocab('gpt-2') }, () => {
  it('maps SentencePiece pieces, byte tokens and control tokens', () => {
    const tokenizer = ggufTokenizer('llama-spm');
    assert.equal(text(tokenizer.tokenBytes(idOf('llama-spm', '▁Hello'))), ' Hello');
    assert.deepEqual([...tokenizer.tokenBytes(idOf('llama-spm', '<0x0A>'))], [0x0a]);
    assert.deepEqual([...tokenizer.tokenBytes(idOf('llama-spm', '<0xF0>'))], [0xf0]);
    assert.deepEqual([...tokenizer.tokenBytes(1)], []);
    assert.equal(text(tokenizer.tokenBytes(1, true)), '<s>');
  });

  it('maps byte-level characters back to raw bytes, one byte of a split character included', () => {
    const tokenizer = ggufTokenizer('gpt-2');
    assert.equal(text(tokenizer.tokenBytes(idOf('gpt-2', 'Ġworld'))), ' world');
    assert.equal(text(tokenizer.tokenBytes(idOf('gpt-2', 'Ċ'))), '\n');
    assert.deepEqual([...tokenizer.tokenBytes(idOf('gpt-2', 'ð'))], [0xf0]); // first byte of a 4-byte emoji
    assert.deepEqual([...tokenizer.tokenBytes(50256)], []);
  });

  it('returns a copy the caller may keep', () => {
    const tokenizer = ggufTokenizer('gpt-2');
    const id = idOf('gpt-2', 'Ġworld');
    tokenizer.tokenBytes(id).fill(0);
    assert.equal(text(tokenizer.tokenBytes(id)), ' world');
  });
});

// ---------------------------------------------------------------------------------------------------------------
// Round trips on random text

const CODE_POINT_RANGES: [number, number][] = [
  [0x20, 0x7e], [0x20, 0x7e], [0x20, 0x7e], // mostly ASCII
  [0x09, 0x0d], [0xa0, 0x17f], [0x300, 0x36f], [0x391, 0x3c9], [0x400, 0x44f], [0x5d0, 0x5ea], [0x900, 0x97f],
  [0x1780, 0x17ff], [0x2000, 0x206f], [0x3040, 0x30ff], [0x4e00, 0x9fff], [0xac00, 0xd7a3], [0xfe00, 0xfeff],
  [0x1f300, 0x1f6ff], [0x1f900, 0x1f9ff], [0x10000, 0x1007f],
];

function randomText(random: () => number, length: number): string {
  let out = '';
  for (let i = 0; i < length; i++) {
    const [low, high] = CODE_POINT_RANGES[Math.floor(random() * CODE_POINT_RANGES.length)]!; // random() is in [0, 1)
    out += String.fromCodePoint(low + Math.floor(random() * (high - low + 1)));
  }
  return out;
}

describe('round trips', { skip: VOCAB_NAMES.map(skipUnlessVocab).find(Boolean) ?? false }, () => {
  for (const name of VOCAB_NAMES) {
    it(`${name}: decode(encode(s)) == s for random Unicode text`, () => {
      const tokenizer = ggufTokenizer(name);
      const random = randomSource(0xc0ffee);
      for (let round = 0; round < 60; round++) {
        const sample = randomText(random, 1 + Math.floor(random() * 40));
        const ids = tokenizer.encode(sample, { addSpecialTokens: round % 2 === 0 });
        assert.equal(tokenizer.decode(ids), sample, `round ${round}: ${JSON.stringify(sample)}`);
      }
    });
  }

  it('encodes a lone surrogate as U+FFFD', () => {
    const tokenizer = ggufTokenizer('gpt-2');
    assert.equal(tokenizer.decode(tokenizer.encode('a\ud800b')), 'a\ufffdb');
  });
});

// ---------------------------------------------------------------------------------------------------------------

describe('errors', { skip: skipUnlessVocab('gpt-2') }, () => {
  it('names an unknown pre-tokenizer and lists the known ones', () => {
    const file = withMetadata(vocabFile('gpt-2'), { 'tokenizer.ggml.pre': 'no-such-pre' });
    assert.throws(() => tokenizerFromGguf(file),
      (e: Error) => e instanceof TokenizerError && /"no-such-pre"/.test(e.message) && /llama-bpe/.test(e.message));
    // Names of Object.prototype's properties are unknown names too, not a TypeError from the prototype's member.
    for (const pre of ['constructor', 'toString', '__proto__']) {
      assert.throws(() => tokenizerFromGguf(withMetadata(vocabFile('gpt-2'), { 'tokenizer.ggml.pre': pre })),
        (e: Error) => e instanceof TokenizerError && e.message.startsWith(`unknown BPE pre-tokenizer "${pre}"`));
    }
  });

  it('refuses a special token id that is not a whole number, naming the key', () => {
    for (const [value, shown] of [[1.5, '1.5'], ['50256', '"50256"']] as const) {
      const file = withMetadata(vocabFile('gpt-2'), { 'tokenizer.ggml.bos_token_id': value });
      assert.throws(() => tokenizerFromGguf(file), (e: Error) => e instanceof TokenizerError &&
        e.message === `GGUF metadata tokenizer.ggml.bos_token_id is ${shown}, not a token id (a whole number)`);
    }
    // Out of range stays "none" (converters write 0xFFFFFFFF or -1 for it), as llama.cpp reads it.
    assert.equal(tokenizerFromGguf(withMetadata(vocabFile('gpt-2'), { 'tokenizer.ggml.bos_token_id': 0xffffffff })).bosId, undefined);
  });

  it('refuses an add-token flag that is not a BOOL, naming the key (it was read as absent)', () => {
    for (const [key, value, shown] of [['tokenizer.ggml.add_bos_token', 1, '1'], ['tokenizer.ggml.add_eos_token', 'true', '"true"']] as const) {
      const file = withMetadata(vocabFile('gpt-2'), { [key]: value });
      assert.throws(() => tokenizerFromGguf(file), (e: Error) => e instanceof TokenizerError &&
        e.message === `GGUF metadata ${key} is ${shown}, not a BOOL (true or false)`);
    }
  });

  it('names an unsupported tokenizer model', () => {
    const file = withMetadata(vocabFile('gpt-2'), { 'tokenizer.ggml.model': 'bert' });
    assert.throws(() => tokenizerFromGguf(file), (e: Error) => e instanceof TokenizerError && /"bert"/.test(e.message));
  });

  it('refuses a GGUF without a vocabulary', () => {
    const file = withMetadata(vocabFile('gpt-2'), { 'tokenizer.ggml.tokens': undefined });
    assert.throws(() => tokenizerFromGguf(file), /tokenizer\.ggml\.tokens/);
  });

  it('refuses ids outside the vocabulary', () => {
    const tokenizer = ggufTokenizer('gpt-2');
    assert.throws(() => tokenizer.decode([50257]), (e: Error) => e instanceof TokenizerError && /50257/.test(e.message));
    assert.throws(() => tokenizer.tokenBytes(-1), TokenizerError);
    assert.throws(() => tokenizer.tokenBytes(1.5), TokenizerError);
  });
});

describe('GGUF tokenizer keys stored as other types', () => {
  // A tiny SentencePiece vocabulary written and read back, so each key is stored as the type given.
  const tiny = (metadata: Record<string, GgufValue>): GgufFile => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-vocab-types-'));
    try {
      const path = join(dir, 'vocab.gguf');
      writeTinyGguf(path, makeTinyModel(), { metadata });
      return readGguf(path);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  };
  const vocabSize = TINY_DIMS.vocabSize;
  const types = (array: new (length: number) => ArrayLike<number> & { [i: number]: number }) => {
    const out = new array(vocabSize);
    for (let id = 0; id < vocabSize; id++) out[id] = 1; // NORMAL
    out[3] = 3; // CONTROL
    return out;
  };

  it('tokenizer.ggml.token_type as INT8, UINT8, INT16 or UINT32: read as the same types as INT32', () => {
    const reference = tokenizerFromGguf(tiny({ 'tokenizer.ggml.token_type': types(Int32Array) as Int32Array }));
    for (const array of [Int8Array, Uint8Array, Int16Array, Uint32Array]) {
      const tokenizer = tokenizerFromGguf(tiny({ 'tokenizer.ggml.token_type': types(array) as GgufValue }));
      // Token 3 is CONTROL: dropped when special tokens are skipped, as with INT32 types.
      assert.equal(tokenizer.decode([3, 4], { skipSpecialTokens: true }), reference.decode([3, 4], { skipSpecialTokens: true }), array.name);
      assert.equal(tokenizer.decode([3, 4], { skipSpecialTokens: true }), 'tok4', array.name);
    }
  });

  it('tokenizer.ggml.token_type of floats or strings: refused naming the key and its stored type', () => {
    const cases: [GgufValue, string][] = [
      [Float32Array.from(types(Int32Array) as Int32Array), 'an array of FLOAT32'],
      [Array.from({ length: vocabSize }, () => 'normal'), 'an array of STRING'],
      ['normal', 'a STRING'],
    ];
    for (const [value, stored] of cases) {
      assert.throws(() => tokenizerFromGguf(tiny({ 'tokenizer.ggml.token_type': value })), (e: Error) =>
        e instanceof TokenizerError && e.message === `GGUF metadata tokenizer.ggml.token_type is ${stored}; it must be ` +
          'an array of integers (INT32, or another integer type)');
    }
    assert.throws(() => tokenizerFromGguf(tiny({ 'tokenizer.ggml.scores': 'high' })), (e: Error) =>
      e instanceof TokenizerError && e.message === 'GGUF metadata tokenizer.ggml.scores is a STRING; it must be an array ' +
        'of numbers (FLOAT32)');
  });

  it('tokenizer.ggml.model or tokenizer.ggml.pre not stored as a string: refused naming it, not read as absent', () => {
    assert.throws(() => tokenizerFromGguf(tiny({ 'tokenizer.ggml.model': 1 })), (e: Error) =>
      e instanceof TokenizerError && e.message === 'GGUF metadata tokenizer.ggml.model is a UINT32, not a STRING');
    // Read as absent, the pre-tokenizer was the default one: other ids for the same text, silently.
    const bpe = { 'tokenizer.ggml.model': 'gpt2', 'tokenizer.ggml.merges': ['t o'] };
    assert.doesNotThrow(() => tokenizerFromGguf(tiny({ ...bpe, 'tokenizer.ggml.pre': 'gpt-2' })));
    assert.throws(() => tokenizerFromGguf(tiny({ ...bpe, 'tokenizer.ggml.pre': ['gpt-2'] })), (e: Error) =>
      e instanceof TokenizerError && e.message === 'GGUF metadata tokenizer.ggml.pre is an array of STRING, not a STRING');
  });
});
