// Synthetic tokens and text for the simulated engine: the token at each position of a request is a pure function
// of (seed, completion, position), so a request gets the same tokens whatever else is batched with it and after
// preemption and recompute, and its text is one pronounceable word per token, so stop strings can hit. As the step
// core's TokenSource and TextSource (src/engine/step-core.ts), they stand where the real engine has its sampler and
// detokenizer.

import { StopStringMatcher } from '../engine/stop-strings.ts';
import type { TextSource, TokenSource } from '../engine/step-core.ts';
import { GREEDY_TEMPERATURE } from '../engine/sampler.ts';
import type { EngineRequest } from '../engine/types.ts';
import { hashString, mix32, mixInto } from '../util/random.ts';

const CONSONANTS = 'bdfgklmnprstvz';
const VOWELS = 'aeiou';

/** A pronounceable four-letter word per token id: distinct ids mostly give distinct words, and stop strings can hit. */
export function syntheticWord(tokenId: number): string {
  let x = tokenId >>> 0;
  let word = '';
  for (let i = 0; i < 2; i++) {
    word += CONSONANTS[x % CONSONANTS.length]!;
    x = Math.floor(x / CONSONANTS.length);
    word += VOWELS[x % VOWELS.length]!;
    x = Math.floor(x / VOWELS.length);
  }
  return ` ${word}`;
}

export interface SyntheticTokenOptions {
  vocabSize: number;
  eosTokenId: number;
  eosProbability: number;
  /** Token ids the request stops on: a synthetic token never hits them by accident. */
  avoid: readonly number[];
}

/**
 * The token generated at `position` of completion `index` of a request with `seed`: a pure function of those, so a
 * request gets the same tokens whatever else is batched with it, and after preemption and recompute.
 */
export function syntheticToken(seed: number, index: number, position: number, opts: SyntheticTokenOptions): number {
  const seedHigh = Math.floor(seed / 0x1_0000_0000);
  let h = mixInto(mixInto(mixInto(mix32(seed >>> 0), seedHigh), index), position);
  if (opts.eosProbability > 0 && mix32(h ^ 0x2545f491) / 0x1_0000_0000 < opts.eosProbability) return opts.eosTokenId;
  for (;;) {
    // Uniform over the vocabulary without EOS: draw from vocabSize - 1 ids and step over EOS.
    let tokenId = h % (opts.vocabSize - 1);
    if (tokenId >= opts.eosTokenId) tokenId++;
    if (!opts.avoid.includes(tokenId)) return tokenId;
    h = mix32(h + 1);
  }
}

/**
 * A request's synthetic-token seed. Greedy decoding has one answer per prompt and model, whatever the seed or the
 * request: two greedy requests with one prompt (and adapter) get the same tokens, as on the CPU engine; the prompt
 * is the one the client sent (a migrated request's earlier output, which now ends promptTokenIds, is left out), so
 * the output goes on as it would have on its first worker. A sampled request draws from its seed, else from its id.
 */
export function syntheticSeed(request: EngineRequest): number {
  if (request.sampling.temperature >= GREEDY_TEMPERATURE) return request.sampling.seed ?? hashString(request.id);
  const promptLength = request.promptTokenIds.length - (request.priorOutputTokenIds?.length ?? 0);
  let h = mix32(promptLength);
  for (let i = 0; i < promptLength; i++) h = mixInto(h, request.promptTokenIds[i]!);
  if (request.lora !== undefined) h = mixInto(h, hashString(request.lora));
  return h >>> 0;
}

/** Synthetic tokens are a function of (seed, completion, position): the seed is the whole token state. */
export const SYNTHETIC_TOKENS: TokenSource<number> = {
  open: (request) => new Array<number>(request.sampling.n).fill(syntheticSeed(request)),
  resume: (handoff) => handoff.sampler.seed,
  handoffSeed: (request) => hashString(request.id),
  handoffState: (_request, seed) => ({ seed, rngState: [seed >>> 0, Math.floor(seed / 0x1_0000_0000) >>> 0, 0, 0] }),
};

/** Each token's synthetic word through the request's stop strings. */
export const SYNTHETIC_TEXT: TextSource = {
  open: (sampling) => {
    const matcher = new StopStringMatcher(sampling.stop, sampling.includeStopStrInOutput, sampling.minTokens);
    let finished = false;
    return {
      push: (tokenId) => {
        const piece = matcher.push(syntheticWord(tokenId));
        return piece.stopped !== undefined ? { delta: piece.text, stopped: piece.stopped } : { delta: piece.text };
      },
      finish: () => {
        const delta = finished || matcher.stopped !== undefined ? '' : matcher.flush();
        finished = true;
        return { delta };
      },
      get done() {
        return finished || matcher.stopped !== undefined;
      },
    };
  },
};

