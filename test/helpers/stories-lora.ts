// The random rank-4 LoRA adapter of the llama.cpp golden test (test/engine/lora-golden.test.ts), for
// ../shared/models/stories260K.gguf: written from a fixed seed by Conduit's GGUF adapter writer, so the test and
// the script that recorded llama.cpp's output (test/data/lora/record-stories260k-lora.ts) write the same bytes.
import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import type { ModelConfig } from '../../src/model/config.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../../src/model/lora-writer.ts';

export const STORIES_LORA = { rank: 4, alpha: 4, seed: 260, bScale: 0.3 } as const;

/** Writes the adapter and returns the SHA-256 of the file (the recorded output names it). */
export function writeStoriesLora(path: string, config: ModelConfig): string {
  writeGgufLoraAdapter(path, config, randomLoraAdapter(config, STORIES_LORA), { name: 'stories260K random rank-4 LoRA' });
  return createHash('sha256').update(readFileSync(path)).digest('hex');
}
