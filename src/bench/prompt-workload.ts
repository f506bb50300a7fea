// What the load generator sends: prompts of a chosen length, either independent (`random`) or from a multi-tenant
// `shared-prefix` workload where each of G groups has a long system prompt of its own and every request adds a
// short question to one group's prompt. Everything is drawn from a seeded generator, so two runs with the same seed
// send the same prompts in the same order (and a server's prefix cache sees the same sharing).
//
// The client does not know the server's tokenizer, so prompts are built from common English words that are one
// token each in the Llama 2 and Llama 3 vocabularies: N words make about N prompt tokens. The server's own count
// (usage.prompt_tokens) is what the report shows.

import { seededRandom } from '../util/random.ts';

/** Common English words, each a single token after a space in the Llama vocabularies. */
const WORDS = ('time year people way day man thing woman life child world school state family student group country '
  + 'problem hand part place case week company system program question work government number night point home '
  + 'water room mother area money story fact month lot right study book eye job word business issue side kind head '
  + 'house service friend father power hour game line end member law car city community name president team minute '
  + 'idea kid body information back parent face others level office door health person art war history party result '
  + 'change morning reason research girl moment air teacher force education foot boy age policy process music market '
  + 'sense nation plan college interest death experience effect use class control care field development role effort '
  + 'rate heart drug show leader light voice wife police mind price report decision son view relationship town road '
  + 'arm difference value building action model season society tax director position player record paper space '
  + 'ground form event official matter center couple site project activity star table need court oil situation cost '
  + 'industry figure street image phone data picture practice piece land product doctor wall patient worker news '
  + 'test movie north love support technology step baby computer type attention film tree source organization hair '
  + 'window evidence population truth song').split(' ');

export { seededRandom };

/**
 * The longest prompt (or system prompt, or question) a workload builds, in words: 2^20, more than any served context
 * holds. Each prompt is built in memory as a string, and one of 10^9 words is more than V8 can hold.
 */
export const MAX_PROMPT_WORDS = 1 << 20;

/** Mixes two numbers into one seed, so each (seed, stream) pair gets an unrelated sequence. */
function subSeed(seed: number, stream: number): number {
  let h = (Math.imul(seed >>> 0, 0x9e3779b1) ^ Math.imul(stream >>> 0, 0x85ebca6b)) >>> 0;
  h ^= h >>> 16;
  h = Math.imul(h, 0x7feb352d);
  h ^= h >>> 15;
  return h >>> 0;
}

/** `numWords` words drawn from the list: about that many tokens. */
export function randomText(random: () => number, numWords: number): string {
  const words: string[] = [];
  for (let i = 0; i < numWords; i++) words.push(WORDS[Math.floor(random() * WORDS.length)]!);
  return words.join(' ');
}

/** One request's prompt. The system part, when present, is the part requests of a group share. */
export interface PromptSpec {
  system?: string;
  user: string;
  /** The shared-prefix group the request belongs to. */
  group?: number;
}

export interface Workload {
  readonly name: string;
  /** One line for reports. */
  readonly description: string;
  /** The prompt of request `index` (0, 1, 2 ...); the same index always gives the same prompt. */
  prompt(index: number): PromptSpec;
}

/** Independent prompts of `promptTokens` words: no two requests share more than the chat template's prefix. */
export function randomWorkload(options: { promptTokens: number; seed: number }): Workload {
  const { promptTokens, seed } = options;
  checkCount('promptTokens', promptTokens, 1, MAX_PROMPT_WORDS);
  return {
    name: 'random',
    description: `random prompts of ~${promptTokens} tokens`,
    prompt: (index) => ({ user: randomText(seededRandom(subSeed(seed, index)), promptTokens) }),
  };
}

export interface SharedPrefixOptions {
  groups: number;
  /** Length of each group's system prompt, in words (about tokens). */
  systemPromptTokens: number;
  /** Length of each question. */
  questionTokens: number;
  seed: number;
}

/**
 * G tenants, each with its own long system prompt; request i asks a fresh short question under a group drawn
 * uniformly at random. A router that keeps each group on the worker holding its prompt serves most of every prompt
 * from cache; one that scatters them recomputes it.
 */
export function sharedPrefixWorkload(options: SharedPrefixOptions): Workload {
  const { groups, systemPromptTokens, questionTokens, seed } = options;
  checkCount('groups', groups, 1);
  checkCount('systemPromptTokens', systemPromptTokens, 1, MAX_PROMPT_WORDS);
  checkCount('questionTokens', questionTokens, 1, MAX_PROMPT_WORDS);
  const systemPrompts = new Map<number, string>();
  const systemPrompt = (group: number): string => {
    let text = systemPrompts.get(group);
    if (text === undefined) {
      // The group number leads the prompt so two groups never share even their first block by chance.
      text = `Group ${group}. ${randomText(seededRandom(subSeed(seed, 0x5000_0000 + group)), systemPromptTokens)}`;
      systemPrompts.set(group, text);
    }
    return text;
  };
  return {
    name: 'shared-prefix',
    description: `shared-prefix: ${groups} groups, system prompts of ~${systemPromptTokens} tokens, questions of ~${questionTokens}`,
    prompt: (index) => {
      const random = seededRandom(subSeed(seed, index));
      const group = Math.floor(random() * groups);
      return { system: systemPrompt(group), user: randomText(random, questionTokens), group };
    },
  };
}

function checkCount(name: string, value: number, min: number, max = Number.MAX_SAFE_INTEGER): void {
  if (!Number.isSafeInteger(value) || value < min || value > max) {
    throw new RangeError(`${name} must be a whole number ${max === Number.MAX_SAFE_INTEGER ? `>= ${min}` : `from ${min} to ${max}`}, got ${value}`);
  }
}
