// The model for tests of real CPU workers: stories260K from ../shared/models when it is there, else a tiny synthetic
// model of the built-in model's family (src/model/synthetic.ts: seeded weights, Q8_0, the Llama 2 tokenizer), so the
// tests run either way. Generated once per process into a temporary folder, in well under a second.
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { sharedModel } from './shared-models.ts';

let synthetic: string | undefined;

/**
 * Writes a tiny synthetic model (dim 64, 2 layers, the Llama 2 tokenizer) to `path`: models that differ only by
 * `seed` are distinct models of the same family (two served models, a model and its copy). F32, 256-token context
 * unless told.
 */
export function writeTinyModel(path: string, options: { seed: number; name?: string; dtype?: 'F32' | 'Q8_0'; contextLength?: number }): string {
  writeSyntheticModel({
    name: options.name ?? `tiny ${options.seed}`, dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96,
    contextLength: options.contextLength ?? 256, dtype: options.dtype ?? 'F32', seed: options.seed, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
  }, path);
  return path;
}

/** A small synthetic model's path (dim 64, 2 layers, 1024-token context). */
export function tinySyntheticModel(): string {
  if (!synthetic) {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-cpu-model-'));
    process.once('exit', () => rmSync(dir, { recursive: true, force: true }));
    synthetic = writeTinyModel(join(dir, 'tiny-synthetic.gguf'), { seed: 13, name: 'tiny-synthetic', dtype: 'Q8_0', contextLength: 1024 });
  }
  return synthetic;
}

/** stories260K when ../shared/models has it, else the tiny synthetic model; with the name to report. */
export function cpuTestModel(): { name: string; path: string } {
  const shared = sharedModel('stories260K.gguf');
  return shared ? { name: 'stories260K', path: shared } : { name: 'tiny-synthetic', path: tinySyntheticModel() };
}
