// Test data from ../shared/models (real GGUF models and llama.cpp's tokenizer vectors). The project must pass its
// tests without it, so suites that need a file call `sharedModel(name)` and skip with this message when absent.
import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { join } from 'node:path';

import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { writeSyntheticModel } from '../../src/model/synthetic.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';
import type { Tokenizer } from '../../src/model/tokenizer/types.ts';

export const SHARED_MODELS_DIR = process.env.CONDUIT_SHARED_MODELS
  ?? fileURLToPath(new URL('../../../shared/models', import.meta.url));

/** Absolute path of a file in the shared models folder, or undefined when it is not there. */
export function sharedModel(name: string): string | undefined {
  const path = join(SHARED_MODELS_DIR, name);
  return existsSync(path) ? path : undefined;
}

/** The `skip` option for node:test: false when the file exists, else a message saying what is missing. */
export function skipUnlessShared(name: string): string | false {
  return sharedModel(name) ? false : `needs ${name} from ${SHARED_MODELS_DIR} (../shared/models), which is absent`;
}

export interface SharedModelFixture {
  loaded: LoadedModel;
  tokenizer: Tokenizer;
}

const fixtures = new Map<string, Promise<SharedModelFixture>>();

/** A shared model loaded once per test process, with its tokenizer (call only when skipUnlessShared(name) is false). */
export function loadSharedModel(name: string): Promise<SharedModelFixture> {
  let fixture = fixtures.get(name);
  if (!fixture) {
    const path = sharedModel(name);
    if (!path) throw new Error(skipUnlessShared(name) as string);
    fixture = loadModel(path).then((loaded) => ({ loaded, tokenizer: createTokenizer(loaded.tokenizerSource) }));
    fixtures.set(name, fixture);
  }
  return fixture;
}

/**
 * Writes a tiny random-weight model (one layer, F32) with the tokenizer of the shared file `vocab` to `path`: a real
 * vocabulary and its special tokens at the cost of a toy model (call only when skipUnlessShared(vocab) is false).
 */
export function writeSharedVocabModel(vocab: string, path: string, name: string): void {
  writeSyntheticModel({
    name, dim: 32, numLayers: 1, numHeads: 2, numKvHeads: 1, ffnDim: 48, contextLength: 128,
    dtype: 'F32', seed: 9, tokenizer: sharedModel(vocab)!,
  }, path);
}
