// The tokenizer against the token embedding, checked at load. A Hugging Face folder whose tokenizer.json has more ids
// than model.embed_tokens.weight has rows used to load, and an id past the rows was then looked up past the
// embedding's end; fewer ids than rows is a padded vocabulary and loads. A GGUF lists one token per row, as llama.cpp
// requires; one that does not is refused naming both numbers (it was refused as a token_embd.weight shape "expected
// from the model config", which did not say the token list was the other side).

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, unlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ModelFormatError } from '../../src/model/gguf-model.ts';
import { isModelLoadError, loadModel } from '../../src/model/loader.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';
import { loadSharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { makeTinyModel, TINY_DIMS, writeTinyGguf, writeTinyHf } from './loader-fixtures.ts';

let dir: string;
before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-tokenizer-embedding-')); });
after(() => rmSync(dir, { recursive: true, force: true }));

let counter = 0;
const rows = TINY_DIMS.vocabSize;

/** A tiny folder (`rows` embedding rows) whose tokenizer.json is a BPE of `vocabTokens` tokens plus `added`. */
function hfFolder(vocabTokens: number, added: { id: number; content: string; special?: boolean }[] = []): string {
  const folder = join(dir, `hf-${counter++}`);
  writeTinyHf(folder, makeTinyModel());
  const vocab = Object.fromEntries(Array.from({ length: vocabTokens }, (_, i) => [`t${i}`, i]));
  writeFileSync(join(folder, 'tokenizer.json'), JSON.stringify({
    version: '1.0', added_tokens: added, model: { type: 'BPE', vocab, merges: [] },
  }));
  // This vocabulary has no "<s>" or "</s>": a tokenizer_config.json naming them would be refused.
  writeFileSync(join(folder, 'tokenizer_config.json'), JSON.stringify({ chat_template: '{{ messages[0].content }}' }));
  return folder;
}

function ggufWithTokens(count: number): string {
  const path = join(dir, `model-${counter++}.gguf`);
  writeTinyGguf(path, makeTinyModel(), {
    metadata: { 'tokenizer.ggml.tokens': Array.from({ length: count }, (_, i) => `tok${i}`) },
  });
  return path;
}

function refusal(pattern: RegExp): (error: unknown) => true {
  return (error) => {
    assert.ok(error instanceof ModelFormatError, `expected a ModelFormatError, got ${String((error as Error)?.stack ?? error)}`);
    assert.ok(isModelLoadError(error) && !error.message.includes('\n'), `one line: ${error.message}`);
    assert.match(error.message, pattern);
    return true;
  };
}

describe('tokenizer ids against the token embedding rows', () => {
  it('a Hugging Face tokenizer with more ids than embedding rows is refused naming both numbers', async () => {
    await assert.rejects(loadModel(hfFolder(100)), refusal(new RegExp(
      `tokenizer\\.json has token ids up to 99 \\(100 ids\\), more than the ${rows} rows of the token embedding ` +
      `model\\.embed_tokens\\.weight \\(config\\.json vocab_size\\): ids ${rows} to 99 would be read past its end$`)));
  });

  it('an added token past the rows counts: its id is an input like any other', async () => {
    await assert.rejects(loadModel(hfFolder(10, [{ id: 60, content: '<|extra|>', special: true }])),
      refusal(new RegExp(`token ids up to 60 \\(61 ids\\), more than the ${rows} rows`)));
  });

  it('a padded vocabulary (fewer ids than rows) loads, and so does an exact one', async () => {
    for (const tokens of [rows - 8, rows]) {
      const loaded = await loadModel(hfFolder(tokens));
      assert.equal(loaded.weights.tokenEmbedding.shape[1], rows);
      assert.equal(loaded.config.vocabSize, rows);
      assert.equal(createTokenizer(loaded.tokenizerSource).vocabSize, tokens);
    }
    const withAdded = await loadModel(hfFolder(rows - 1, [{ id: rows - 1, content: '<|end|>', special: true }]));
    assert.equal(createTokenizer(withAdded.tokenizerSource).vocabSize, rows);
  });

  it('the tokenizer is built from the tokenizer.json the load checked, not from the file read again', async () => {
    const folder = hfFolder(rows);
    const loaded = await loadModel(folder);
    // Replaced after the load by one with more ids than rows (a folder updated in place): the tokenizer is still the
    // checked one, and the file is not read a second time.
    writeFileSync(join(folder, 'tokenizer.json'), JSON.stringify({
      version: '1.0', model: { type: 'BPE', vocab: Object.fromEntries(Array.from({ length: 100 }, (_, i) => [`n${i}`, i])), merges: [] },
    }));
    const tokenizer = createTokenizer(loaded.tokenizerSource);
    assert.equal(tokenizer.vocabSize, rows);
    assert.equal(tokenizer.idToToken(rows - 1), `t${rows - 1}`);
    unlinkSync(join(folder, 'tokenizer.json'));
    assert.equal(createTokenizer(loaded.tokenizerSource).vocabSize, rows);
  });

  it('a GGUF whose token list is longer or shorter than the embedding: refused naming both numbers', async () => {
    await assert.rejects(loadModel(ggufWithTokens(100)), refusal(new RegExp(
      `tokenizer\\.ggml\\.tokens lists 100 tokens, more than the ${rows} rows of the token embedding ` +
      `token_embd\\.weight: ids ${rows} to 99 would be read past its end$`)));
    await assert.rejects(loadModel(ggufWithTokens(rows - 8)), refusal(new RegExp(
      `tokenizer\\.ggml\\.tokens lists ${rows - 8} tokens, fewer than the ${rows} rows of the token embedding ` +
      'token_embd\\.weight; a GGUF lists one token per row \\(converters pad the list\\), as llama\\.cpp requires$')));
    const loaded = await loadModel(ggufWithTokens(rows));
    assert.equal(createTokenizer(loaded.tokenizerSource).vocabSize, rows);
  });

  it('a real GGUF (stories260K) has one token per embedding row and loads', { skip: skipUnlessShared('stories260K.gguf') }, async () => {
    const { loaded, tokenizer } = await loadSharedModel('stories260K.gguf');
    assert.equal(tokenizer.vocabSize, loaded.weights.tokenEmbedding.shape[1]);
  });
});
