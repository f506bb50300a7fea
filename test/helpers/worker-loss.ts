// The fixture of the tests that kill a worker (migration, prefill loss): a tiny Q8_0 model with a real tokenizer in
// a temporary directory, and for the tests through `conduit serve` a key file whose tenant may run one request at a
// time (a slot the loss failed to give back refuses the next one).
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';

export interface WorkerLossFixture {
  dir: string;
  modelPath: string;
  /** With a key: its one-slot key file. */
  keysPath: string;
}

/** The model's shape: tiny by default; tests that must act while a stream still runs on the server take a larger one. */
export interface FixtureShape {
  dim: number;
  numLayers: number;
  numHeads: number;
  numKvHeads: number;
  ffnDim: number;
}

const TINY: FixtureShape = { dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96 };

/**
 * Big enough that one thread decodes on the order of 10 ms per token: a client reading events can lag far behind
 * the server, and with the tiny model a whole stream is often generated before the client has read ten events.
 */
export const SLOW_DECODE_SHAPE: FixtureShape = { dim: 512, numLayers: 8, numHeads: 8, numKvHeads: 4, ffnDim: 1536 };

export function writeWorkerLossFixture(name: string, key?: string, shape: FixtureShape = TINY): WorkerLossFixture {
  const dir = mkdtempSync(join(tmpdir(), `conduit-${name}-`));
  const modelPath = join(dir, 'synthetic.gguf');
  writeSyntheticModel({
    name: `${name}-synthetic`, ...shape, contextLength: 1024,
    dtype: 'Q8_0', seed: 13, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
  }, modelPath);
  const keysPath = join(dir, 'keys.txt');
  if (key !== undefined) writeFileSync(keysPath, `${key} solo - - 1\n`);
  return { dir, modelPath, keysPath };
}
