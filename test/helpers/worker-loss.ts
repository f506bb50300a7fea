// The fixture of the tests that kill a worker under `conduit serve`: a tiny Q8_0 model with a real tokenizer and a
// key file whose tenant may run one request at a time (a slot the loss failed to give back refuses the next one).
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';

export interface WorkerLossFixture {
  dir: string;
  modelPath: string;
  keysPath: string;
}

export function writeWorkerLossFixture(name: string, key: string): WorkerLossFixture {
  const dir = mkdtempSync(join(tmpdir(), `conduit-${name}-`));
  const modelPath = join(dir, 'synthetic.gguf');
  writeSyntheticModel({
    name: `${name}-synthetic`, dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 1024,
    dtype: 'Q8_0', seed: 13, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
  }, modelPath);
  const keysPath = join(dir, 'keys.txt');
  writeFileSync(keysPath, `${key} solo - - 1\n`);
  return { dir, modelPath, keysPath };
}
