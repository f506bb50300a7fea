// A plain generation loop over the reference model: prefill the prompt in one forward, then one forward per new
// token, greedy at temperature 0 and softmax sampling above it. It serves the CLI and the golden tests; the
// engine (continuous batching, paged KV) is the real serving path.

import { argmax } from './reference-math.ts';
import type { ReferenceModel } from './reference-forward.ts';
import { seededRandom } from '../util/random.ts';

export interface GenerateOptions {
  maxTokens: number;
  /** 0 (the default) picks the most likely token; above 0, samples from softmax(logits / temperature). */
  temperature?: number;
  /** Seed of the sampling random numbers (the same seed gives the same tokens). */
  seed?: number;
  /** Generation ends when one of these is produced; the stop token itself is not part of the output. */
  stopIds?: readonly number[];
  /** Called for each generated token as soon as it is known. */
  onToken?: (token: GeneratedToken) => void;
  signal?: AbortSignal;
  /** Milliseconds clock; defaults to performance.now. */
  now?: () => number;
}

export interface GeneratedToken {
  tokenId: number;
  /** 0 for the first generated token. */
  index: number;
  /** Milliseconds from the start of generation until this token was known. */
  elapsedMs: number;
}

export type FinishReason = 'stop' | 'length' | 'abort';

export interface GenerationTiming {
  promptTokens: number;
  generatedTokens: number;
  /** The prompt's forward pass, which yields the first token (time to first token). */
  prefillMs: number;
  /** Every later forward pass (one per token after the first). */
  decodeMs: number;
  totalMs: number;
  prefillTokensPerSecond: number;
  decodeTokensPerSecond: number;
}

export interface GenerationResult {
  tokenIds: number[];
  finishReason: FinishReason;
  timing: GenerationTiming;
}

// ---------------------------------------------------------------------------------------------------------------
// Sampling

/**
 * The token drawn from softmax(logits / temperature) by `uniform` in [0, 1): the first token whose cumulative
 * probability exceeds it. Temperature 0 is argmax.
 */
export function sampleToken(logits: Float32Array, temperature: number, uniform: number): number {
  if (!(temperature >= 0)) throw new RangeError(`temperature must be >= 0, got ${temperature}`);
  if (temperature === 0) return argmax(logits, 0, logits.length);
  let max = -Infinity;
  for (let i = 0; i < logits.length; i++) if (logits[i]! > max) max = logits[i]!;
  const weights = new Float64Array(logits.length);
  let total = 0;
  for (let i = 0; i < logits.length; i++) {
    weights[i] = Math.exp((logits[i]! - max) / temperature);
    total += weights[i]!;
  }
  const target = uniform * total;
  let cumulative = 0;
  for (let i = 0; i < logits.length; i++) {
    cumulative += weights[i]!;
    if (target < cumulative) return i;
  }
  return argmax(logits, 0, logits.length); // only reachable through rounding when uniform is just below 1
}

// ---------------------------------------------------------------------------------------------------------------
// The loop

/**
 * Generates up to maxTokens tokens after `promptIds`, starting from an empty cache (the model is reset first).
 * Stops early at a stop id, at the model's context length ('length'), or when `signal` aborts ('abort').
 */
export async function generateReference(model: ReferenceModel, promptIds: readonly number[],
  options: GenerateOptions): Promise<GenerationResult> {
  const { maxTokens, temperature = 0, seed = 0, stopIds = [], onToken, signal } = options;
  const now = options.now ?? (() => performance.now());
  if (promptIds.length === 0) throw new RangeError('generate: the prompt has no tokens');
  if (!Number.isInteger(maxTokens) || maxTokens < 0) {
    throw new RangeError(`generate: maxTokens must be a non-negative integer, got ${maxTokens}`);
  }
  if (promptIds.length > model.config.contextLength) {
    throw new RangeError(`generate: the prompt has ${promptIds.length} tokens, more than the model's context ` +
      `length ${model.config.contextLength}`);
  }
  const stops = new Set(stopIds);
  const uniform = seededRandom(seed);
  const tokenIds: number[] = [];
  let finishReason: FinishReason = 'length';

  model.reset();
  const start = now();
  const wanted = maxTokens > 0 && !signal?.aborted;
  let logits = wanted ? model.forward(promptIds, 0) : new Float32Array(0);
  const prefillEnd = now();
  let position = promptIds.length;
  let decodeSteps = 0;
  if (signal?.aborted) finishReason = 'abort';

  while (wanted && tokenIds.length < maxTokens) {
    const tokenId = sampleToken(logits, temperature, uniform());
    if (stops.has(tokenId)) {
      finishReason = 'stop';
      break;
    }
    tokenIds.push(tokenId);
    onToken?.({ tokenId, index: tokenIds.length - 1, elapsedMs: now() - start });
    if (tokenIds.length === maxTokens || position === model.config.contextLength) break;
    // Let timers, I/O and abort signals run between tokens: a long generation must not freeze the process.
    await new Promise<void>((resolve) => setImmediate(resolve));
    if (signal?.aborted) {
      finishReason = 'abort';
      break;
    }
    logits = model.forward([tokenId], position);
    position++;
    decodeSteps++;
  }

  const end = now();
  const prefillMs = prefillEnd - start;
  const decodeMs = end - prefillEnd;
  return {
    tokenIds,
    finishReason,
    timing: {
      promptTokens: promptIds.length,
      generatedTokens: tokenIds.length,
      prefillMs,
      decodeMs,
      totalMs: end - start,
      prefillTokensPerSecond: prefillMs > 0 ? (promptIds.length / prefillMs) * 1000 : 0,
      decodeTokensPerSecond: decodeMs > 0 ? (decodeSteps / decodeMs) * 1000 : 0,
    },
  };
}
