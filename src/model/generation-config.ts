// A Hugging Face model folder's generation_config.json: the sampling defaults its authors recommend (Llama 3.1
// Instruct: temperature 0.6, top_p 0.9; Qwen 2.5: also top_k 20 and repetition_penalty 1.05) and its end-of-generation
// ids. vLLM applies them to requests that leave those fields out (its --generation-config auto, the default); the
// server does the same. A folder without the file takes them from its config.json, as vLLM does. A GGUF file carries
// none.

import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { readModelText } from './files.ts';
import { ModelFormatError } from './gguf-model.ts';

/** Defaults for the request fields a request leaves out; each absent when the file does not set it. */
export interface GenerationDefaults {
  temperature?: number;
  topP?: number;
  /** 0: no top-k. */
  topK?: number;
  minP?: number;
  repetitionPenalty?: number;
  /** max_new_tokens: the most tokens a request generates, whatever its max_tokens (as vLLM caps them). */
  maxTokens?: number;
  /** eos_token_id: every id that ends generation (a number or a list in the file). */
  eosTokenIds?: number[];
}

export const GENERATION_CONFIG_FILE = 'generation_config.json';

/**
 * The file `folder`'s defaults come from: generation_config.json, else config.json (as transformers and vLLM build a
 * generation config from the model's configuration when a folder has no generation_config.json: its eos_token_id,
 * often a list, then ends generation too); undefined when the folder has neither.
 */
export function generationConfigFile(folder: string): string | undefined {
  for (const name of [GENERATION_CONFIG_FILE, 'config.json']) {
    if (existsSync(join(folder, name))) return join(folder, name);
  }
  return undefined;
}

/**
 * What transformers' GenerationConfig takes when a field is absent (4.x versions): vLLM reads only the fields that
 * differ from these, so a config.json written with every default (`"top_k": 50`) sets no top-k.
 */
const TRANSFORMERS_GENERATION_DEFAULTS: Readonly<Record<string, number>> = {
  temperature: 1, top_p: 1, top_k: 50, repetition_penalty: 1,
};

/**
 * The defaults of `folder`'s generation config (generationConfigFile), undefined when the folder has none. A value out
 * of the range a request may give is refused (ModelFormatError), so a default never makes every request fail.
 */
export async function readGenerationConfig(folder: string): Promise<GenerationDefaults | undefined> {
  const path = generationConfigFile(folder);
  if (path === undefined) return undefined;
  const fromModelConfig = !path.endsWith(GENERATION_CONFIG_FILE);
  // Read outside the try: a file too large or not a regular file is said as such, not as "not JSON".
  const text = await readModelText(path);
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch (error) {
    throw new ModelFormatError(`${path}: not JSON (${(error as Error).message})`);
  }
  if (typeof json !== 'object' || json === null || Array.isArray(json)) throw new ModelFormatError(`${path}: not a JSON object`);
  const fields = { ...(json as Record<string, unknown>) };
  if (fromModelConfig) {
    for (const [key, value] of Object.entries(TRANSFORMERS_GENERATION_DEFAULTS)) if (fields[key] === value) delete fields[key];
  }
  const number = (key: string, ok: (value: number) => boolean, range: string): number | undefined => {
    const value = fields[key];
    if (value === undefined || value === null) return undefined;
    if (typeof value !== 'number' || !ok(value)) {
      // String(): JSON.stringify would write an overflowing number (1e309, read as Infinity) as null.
      throw new ModelFormatError(`${path}: ${key} must be ${range}, got ${typeof value === 'number' ? String(value) : JSON.stringify(value)}`);
    }
    return value;
  };
  const defaults: GenerationDefaults = {};
  const temperature = number('temperature', (v) => v >= 0 && v <= 2, 'a number in [0, 2]');
  if (temperature !== undefined) defaults.temperature = temperature;
  const topP = number('top_p', (v) => v > 0 && v <= 1, 'a number in (0, 1]');
  if (topP !== undefined) defaults.topP = topP;
  const topK = number('top_k', (v) => Number.isInteger(v) && v >= -1, 'a whole number >= -1');
  if (topK !== undefined) defaults.topK = topK === -1 ? 0 : topK;
  const minP = number('min_p', (v) => v >= 0 && v <= 1, 'a number in [0, 1]');
  if (minP !== undefined) defaults.minP = minP;
  const repetitionPenalty = number('repetition_penalty', (v) => Number.isFinite(v) && v > 0, 'a finite number > 0');
  if (repetitionPenalty !== undefined) defaults.repetitionPenalty = repetitionPenalty;
  const maxTokens = number('max_new_tokens', (v) => Number.isInteger(v) && v >= 1, 'a whole number >= 1');
  if (maxTokens !== undefined) defaults.maxTokens = maxTokens;
  const eos = fields['eos_token_id'];
  if (eos !== undefined && eos !== null) {
    const ids = Array.isArray(eos) ? eos : [eos];
    if (!ids.every((id) => Number.isInteger(id) && (id as number) >= 0)) {
      throw new ModelFormatError(`${path}: eos_token_id must be a token id or a list of them, got ${JSON.stringify(eos)}`);
    }
    defaults.eosTokenIds = ids as number[];
  }
  return defaults;
}

/**
 * Refuses (ModelFormatError) end-of-generation ids of `file` outside the served model's vocabulary (`vocabSize`
 * tokens): they become every request's stop token ids, which a request may give only inside it, so each request
 * would be refused for ids it never sent.
 */
export function checkGenerationVocabulary(defaults: GenerationDefaults, vocabSize: number, file: string): void {
  const outside = (defaults.eosTokenIds ?? []).filter((id) => id >= vocabSize);
  if (outside.length > 0) {
    throw new ModelFormatError(`${file}: eos_token_id ${outside.join(', ')} ${outside.length === 1 ? 'is' : 'are'} not in the `
      + `model's vocabulary of ${vocabSize} tokens`);
  }
}

/** The defaults as request fields, for a log line: `temperature 0.6, top_p 0.9`. */
export function describeGenerationDefaults(defaults: GenerationDefaults): string {
  const parts: string[] = [];
  if (defaults.temperature !== undefined) parts.push(`temperature ${defaults.temperature}`);
  if (defaults.topP !== undefined) parts.push(`top_p ${defaults.topP}`);
  if (defaults.topK !== undefined) parts.push(`top_k ${defaults.topK}`);
  if (defaults.minP !== undefined) parts.push(`min_p ${defaults.minP}`);
  if (defaults.repetitionPenalty !== undefined) parts.push(`repetition_penalty ${defaults.repetitionPenalty}`);
  if (defaults.maxTokens !== undefined) parts.push(`max_tokens at most ${defaults.maxTokens}`);
  return parts.join(', ');
}
