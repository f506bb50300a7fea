// One entry point for every model format: a path to a GGUF file or to a Hugging Face folder (config.json +
// *.safetensors + tokenizer.json) becomes a ModelConfig, zero-copy ModelWeights, and what the tokenizer module needs.

import { stat } from 'node:fs/promises';
import { dirname, resolve } from 'node:path';
import { ChatTemplateError, chatTemplateFromGguf } from './chat-template.ts';
import type { ModelConfig } from './config.ts';
import { readModelFile } from './files.ts';
import { ggmlTypeName } from './ggml-types.ts';
import { GgufFormatError, metaString, parseGguf } from './gguf.ts';
import type { GgufFile } from './gguf.ts';
import { ggufModelConfig, ggufModelWeights, ModelFormatError } from './gguf-model.ts';
import { isHfFolder, loadHfModel } from './hf.ts';
import { numElements, UnsupportedTypeError } from './quant.ts';
import { SafetensorsFormatError } from './safetensors.ts';
import { TokenizerError } from './tokenizer/errors.ts';
import type { TokenizerSource } from './tokenizer/index.ts';
import type { ModelWeights, Tensor } from './weights.ts';

export interface ModelSummary {
  name: string;
  architecture: string;
  /** Distinct weight parameters (a tied output matrix counts once). */
  parameterCount: number;
  /** Parameters per storage type, e.g. { Q8_0: 21_000_000, F32: 5_000 }. */
  parametersByType: Record<string, number>;
  /** Bytes of weight data. */
  weightBytes: number;
  contextLength: number;
  /** Format-specific facts worth showing (GGUF: general.* keys; HF: architectures, torch_dtype). */
  details: Record<string, string | number>;
}

export interface LoadedModel {
  config: ModelConfig;
  weights: ModelWeights;
  source: 'gguf' | 'hf';
  /** Absolute path of the GGUF file or the HF folder. */
  path: string;
  tokenizerSource: TokenizerSource;
  /** The Jinja chat template shipped with the model, if any. */
  chatTemplate?: string;
  metadata: ModelSummary;
}

// ---------------------------------------------------------------------------------------------------------------
// Entry point

/**
 * Whether an error means "this path is not a model Conduit can run" (missing file, another format, an unsupported
 * architecture or tensor type, a vocabulary-only GGUF, a broken tokenizer) rather than a bug: the CLI prints its
 * message as one line instead of a stack.
 */
export function isModelLoadError(err: unknown): err is Error {
  return err instanceof ModelFormatError || err instanceof GgufFormatError || err instanceof SafetensorsFormatError ||
    err instanceof UnsupportedTypeError || err instanceof TokenizerError;
}

export async function loadModel(path: string): Promise<LoadedModel> {
  const absolute = resolve(path);
  const info = await stat(absolute).catch((error: NodeJS.ErrnoException) => {
    throw new ModelFormatError(`cannot load model ${path}: ${error.code === 'ENOENT' ? 'no such file or folder' : error.message}`);
  });
  if (info.isDirectory()) {
    if (!(await isHfFolder(absolute))) {
      throw new ModelFormatError(`${path} is a folder without config.json: not a Hugging Face model folder`);
    }
    return loadHf(absolute);
  }
  return loadGgufModel(absolute);
}

export async function loadGgufModel(path: string): Promise<LoadedModel> {
  const absolute = resolve(path);
  const bytes = await readModelFile(absolute, path);
  if (bytes.byteLength < 4 || bytes.readUInt32LE(0) !== 0x46554747) {
    // A file of a Hugging Face folder (model.safetensors, config.json) given instead of the folder.
    const folder = dirname(path);
    const hint = await isHfFolder(dirname(absolute))
      ? `; it is a file of the Hugging Face model folder ${folder}, which is what --model takes` : '';
    throw new ModelFormatError(`${path} is ${bytes.byteLength === 0 ? 'empty, ' : ''}neither a GGUF file (no "GGUF" ` +
      `magic) nor a Hugging Face model folder${hint}`);
  }
  return ggufLoadedModel(parseGguf(bytes, absolute), absolute);
}

/** A LoadedModel from an already parsed GGUF file. */
export function ggufLoadedModel(file: GgufFile, path: string): LoadedModel {
  const config = ggufModelConfig(file, path);
  const weights = ggufModelWeights(file, config, path);
  // The engine compiles the file's chat templates when it starts; one that does not parse is the file's fault.
  try {
    chatTemplateFromGguf(file);
  } catch (error) {
    if (!(error instanceof ChatTemplateError)) throw error;
    throw new ModelFormatError(`${path}: tokenizer.chat_template: ${error.message}`);
  }
  const details: Record<string, string | number> = { ggufVersion: file.version };
  for (const [key, value] of file.metadata) {
    if (key.startsWith('general.') && (typeof value === 'string' || typeof value === 'number')) details[key] = value;
  }
  const model: LoadedModel = {
    config, weights, source: 'gguf', path,
    tokenizerSource: { kind: 'gguf', file },
    metadata: summarize(config, weights, details),
  };
  const chatTemplate = metaString(file, 'tokenizer.chat_template');
  if (chatTemplate !== undefined) model.chatTemplate = chatTemplate;
  return model;
}

async function loadHf(path: string): Promise<LoadedModel> {
  const hf = await loadHfModel(path);
  const model: LoadedModel = {
    config: hf.config, weights: hf.weights, source: 'hf', path,
    tokenizerSource: {
      // loadHfModel checked it (checkTokenizerJson) before anything else of the model was taken.
      kind: 'hf', tokenizerJson: hf.tokenizerJsonPath, parsedTokenizerJson: hf.tokenizerJson, parsedTokenizerJsonChecked: true,
      tokenizerConfig: hf.tokenizerConfig,
    },
    metadata: summarize(hf.config, hf.weights, hf.details),
  };
  if (hf.chatTemplate !== undefined) model.chatTemplate = hf.chatTemplate;
  return model;
}

// ---------------------------------------------------------------------------------------------------------------
// Summary

export function allTensors(weights: ModelWeights): Tensor[] {
  const seen = new Set<Tensor>();
  const add = (t: Tensor | undefined): void => { if (t) seen.add(t); };
  add(weights.tokenEmbedding);
  for (const layer of weights.layers) for (const t of Object.values(layer)) add(t as Tensor | undefined);
  add(weights.outputNorm);
  add(weights.output);
  return [...seen];
}

function summarize(config: ModelConfig, weights: ModelWeights, details: Record<string, string | number>): ModelSummary {
  const parametersByType: Record<string, number> = {};
  let parameterCount = 0;
  let weightBytes = 0;
  for (const t of allTensors(weights)) {
    const n = numElements(t.shape);
    parameterCount += n;
    weightBytes += t.data.byteLength;
    const type = ggmlTypeName(t.type);
    parametersByType[type] = (parametersByType[type] ?? 0) + n;
  }
  return {
    name: config.name,
    architecture: config.architecture,
    parameterCount, parametersByType, weightBytes,
    contextLength: config.contextLength,
    details,
  };
}
