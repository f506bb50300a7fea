// The model for tests of real CPU workers: stories260K from ../shared/models when it is there, else a tiny synthetic
// model of the built-in model's family (src/model/synthetic.ts: seeded weights, Q8_0, the Llama 2 tokenizer), so the
// tests run either way. Generated once per process into a temporary folder, in well under a second.
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { sharedModel } from './shared-models.ts';

let synthetic: string | undefined;

/** A small synthetic model's path (dim 64, 2 layers, 1024-token context). */
export function tinySyntheticModel(): string {
  if (!synthetic) {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-cpu-model-'));
    process.once('exit', () => rmSync(dir, { recursive: true, force: true }));
    synthetic = join(dir, 'tiny-synthetic.gguf');
    writeSyntheticModel({
      name: 'tiny-synthetic', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 1024,
      dtype: 'Q8_0', seed: 13, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
    }, synthetic);
  }
  return synthetic;
}

/** stories260K when ../shared/models has it, else the tiny synthetic model; with the name to report. */
export function cpuTestModel(): { name: string; path: string } {
  const shared = sharedModel('stories260K.gguf');
  return shared ? { name: 'stories260K', path: shared } : { name: 'tiny-synthetic', path: tinySyntheticModel() };
}
