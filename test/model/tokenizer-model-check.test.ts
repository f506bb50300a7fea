// A tokenizer.json whose model Conduit cannot tokenize with (WordPiece, WordLevel), or whose BPE / Unigram
// vocabulary is in the other model's shape, is refused when the model loads, naming the tokenizer type: it used to
// load and then fail, or tokenize wrongly, at the first request (WordPiece streamed "hello worlds" as
// "helloworld##s"; a BPE vocab given as a list encoded every text to nothing; a Unigram vocab given as a map failed
// when the engine built its tokenizer).

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isModelLoadError, loadModel } from '../../src/model/loader.ts';
import { createTokenizer, TokenizerError, tokenizerFromJsonObject } from '../../src/model/tokenizer/index.ts';
import { makeTinyModel, writeTinyHf } from './loader-fixtures.ts';

let dir: string;
before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-tokenizer-model-')); });
after(() => rmSync(dir, { recursive: true, force: true }));

let counter = 0;
/** A tiny Hugging Face folder (48 embedding rows) whose tokenizer.json has this model. */
function folderWith(model: Record<string, unknown>, extra: Record<string, unknown> = {}): string {
  const folder = join(dir, `case-${counter++}`);
  writeTinyHf(folder, makeTinyModel());
  writeFileSync(join(folder, 'tokenizer.json'), JSON.stringify({ version: '1.0', ...extra, model }));
  // These vocabularies have no "<s>" or "</s>": a tokenizer_config.json naming them would be refused.
  writeFileSync(join(folder, 'tokenizer_config.json'), JSON.stringify({ chat_template: '{{ messages[0].content }}' }));
  return folder;
}

async function refusedAtLoad(model: Record<string, unknown>, pattern: RegExp): Promise<void> {
  const folder = folderWith(model);
  await assert.rejects(loadModel(folder), (e) => {
    assert.ok(e instanceof TokenizerError, `expected a TokenizerError at load, got ${String((e as Error)?.stack ?? e)}`);
    assert.ok(isModelLoadError(e), 'the CLI prints it as one line');
    assert.ok(!e.message.includes('\n'), `one line: ${e.message}`);
    assert.ok(e.message.startsWith(join(folder, 'tokenizer.json')), `names the file: ${e.message}`);
    assert.match(e.message, pattern);
    return true;
  });
  // Built directly (a tokenizer thread does), the same file is refused the same way.
  assert.throws(() => tokenizerFromJsonObject({ model }), (e) => e instanceof TokenizerError && pattern.test(e.message));
}

const wordPieceVocab = Object.fromEntries(['[UNK]', '[CLS]', '[SEP]', 'hello', 'world', '##s'].map((w, i) => [w, i]));

describe('tokenizer.json models refused at load', () => {
  it('WordPiece, named, with why', async () => {
    await refusedAtLoad({ type: 'WordPiece', unk_token: '[UNK]', continuing_subword_prefix: '##', vocab: wordPieceVocab },
      /the tokenizer model is WordPiece; Conduit runs BPE and Unigram tokenizers only \(WordPiece decoding joins "##" pieces/);
    // Without "type", the library would take it for WordPiece too (a map, a continuing_subword_prefix, no merges).
    await refusedAtLoad({ unk_token: '[UNK]', continuing_subword_prefix: '##', vocab: wordPieceVocab },
      /the tokenizer model is WordPiece;/);
  });

  it('WordLevel, and a model whose type cannot be told', async () => {
    await refusedAtLoad({ type: 'WordLevel', unk_token: 'a', vocab: { a: 0, b: 1 } },
      /the tokenizer model is WordLevel; Conduit runs BPE and Unigram tokenizers only$/);
    await refusedAtLoad({ vocab: { a: 0, b: 1 } }, /the tokenizer model is of no type Conduit can tell/);
  });

  it('BPE whose vocab is a list, or whose merges are missing or malformed', async () => {
    await refusedAtLoad({ type: 'BPE', vocab: [['a', 0], ['b', 0]], merges: [] },
      /the BPE model's vocab is a list, not a map of token to id/);
    await refusedAtLoad({ type: 'BPE', vocab: { a: 0, b: 1 } },
      /the BPE model's merges list is missing \(a list of merges belongs there\)/);
    await refusedAtLoad({ type: 'BPE', vocab: { a: 0, b: 1 }, merges: { a: 'b' } }, /the BPE model's merges list is a map/);
    await refusedAtLoad({ type: 'BPE', vocab: { a: 0, b: 1, ab: 2 }, merges: [['a', 'b'], 'a b'] },
      /the BPE model's merges\[1\] is "a b", not a \[left, right\] pair of strings, as merges\[0\] is/);
    await refusedAtLoad({ type: 'BPE', vocab: { a: 0, b: 1, ab: 2 }, merges: ['ab'] },
      /the BPE model's merges\[0\] is "ab", not a "left right" string/);
  });

  it('Unigram whose vocab is a map or not [piece, score] pairs, or whose unk_id names no entry', async () => {
    await refusedAtLoad({ type: 'Unigram', unk_id: 0, vocab: { a: 0, b: 1 } },
      /the Unigram model's vocab is a map, not a list of \[piece, score\]/);
    await refusedAtLoad({ type: 'Unigram', unk_id: 0, vocab: ['a', 'b'] },
      /the Unigram model's vocab\[0\] is "a", not a \[piece, score\] pair/);
    await refusedAtLoad({ type: 'Unigram', vocab: [['a', -1], ['b', -2]] },
      /the Unigram model's unk_id is missing, not the index of an entry of its 2-entry vocab/);
    await refusedAtLoad({ type: 'Unigram', unk_id: 7, vocab: [['<unk>', 0], ['a', -1]] },
      /the Unigram model's unk_id is 7, not the index of an entry of its 2-entry vocab/);
  });
});

describe('tokenizer.json models accepted', () => {
  it('BPE with merges as strings or as pairs loads and tokenizes', async () => {
    for (const merges of [['a b'], [['a', 'b']]]) {
      const loaded = await loadModel(folderWith({ type: 'BPE', vocab: { a: 0, b: 1, ab: 2 }, merges }));
      assert.deepEqual(createTokenizer(loaded.tokenizerSource).encode('ab', { addSpecialTokens: false }), [2]);
    }
  });

  it('Unigram loads and tokenizes, its unknown characters as unk_id', async () => {
    const loaded = await loadModel(folderWith({ type: 'Unigram', unk_id: 0, vocab: [['<unk>', 0], ['a', -1], ['b', -1]] }));
    assert.deepEqual(createTokenizer(loaded.tokenizerSource).encode('abc', { addSpecialTokens: false }), [1, 2, 0]);
  });

  it('a Unigram vocab of more than 65536 pieces counts every piece as a token (it was refused as ids "far beyond")', () => {
    const vocab: [string, number][] = [['<unk>', 0]];
    for (let i = 1; i < 70_000; i++) vocab.push([`p${i}`, -i]);
    assert.equal(tokenizerFromJsonObject({ model: { type: 'Unigram', unk_id: 0, vocab } }).vocabSize, 70_000);
  });
});
