// Test data from ../shared/models (real GGUF models and llama.cpp's tokenizer vectors). The project must pass its
// tests without it, so suites that need a file call `sharedModel(name)` and skip with this message when absent.
import { existsSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { join } from 'node:path';

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
