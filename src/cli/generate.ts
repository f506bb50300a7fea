// `conduit generate`: a prompt in, its continuation and the engine's speed out. The model defaults to the built-in
// synthetic one, so `conduit generate --prompt hi` works on a fresh clone. With --concurrency N the same prompt runs
// as N requests at once (seeds seed, seed+1, ...), which shows what continuous batching buys.

import { EngineStartError } from '../engine/errors.ts';
import { createLocalEngine, type LocalEngineBundle } from '../engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineOutput } from '../engine/types.ts';
import { isModelLoadError } from '../model/loader.ts';
import { ensureBuiltinModel } from '../model/synthetic.ts';
import { checkThreadsAtMost, fileProblem, flagLabel, formatFlagHelp, MAX_NUM_SEQS, nameEnvironment, parseFlags, UsageError, type FlagTable, type ParsedFlags } from './flags.ts';
import type { Command } from './main.ts';

export const GENERATE_FLAGS = {
  model: { type: 'string', help: 'GGUF file or Hugging Face folder (default: the built-in synthetic model)', short: 'm' },
  prompt: { type: 'string', help: 'text to continue', short: 'p' },
  'max-tokens': { type: 'number', help: 'tokens to generate per request (at most what the context leaves after the prompt: a warning says when that is fewer)', default: 64 },
  temperature: { type: 'number', help: '0 = greedy', default: 0 },
  'top-p': { type: 'number', help: 'nucleus sampling mass', default: 1 },
  seed: { type: 'number', help: 'sampling seed (same seed, same text)', default: 0 },
  concurrency: { type: 'number', help: `run the prompt as this many requests at once, in one engine batch (at most ${MAX_NUM_SEQS})`, default: 1 },
  'ignore-eos': { type: 'boolean', help: 'keep generating past the end-of-sequence token' },
  backend: { type: 'string', help: 'auto, native or reference', default: 'auto' },
  threads: { type: 'number', help: 'compute threads (default: all cores)' },
  help: { type: 'boolean', help: 'show this help', short: 'h' },
} satisfies FlagTable;

/** Errors an engine throws or ends a stream with (src/engine/errors.ts), told apart by name. */
const ENGINE_FAILURES: ReadonlySet<string> = new Set(['InvalidRequestError', 'EngineClosedError', 'EngineOverloadedError', 'EngineUnavailableError', 'WorkerLostError']);

function isEngineFailure(err: unknown): err is Error {
  return err instanceof Error && ENGINE_FAILURES.has(err.name);
}

/** The option values checked (--prompt given, counts whole, ...), before anything loads. */
function checkOptions(parsed: ParsedFlags<typeof GENERATE_FLAGS>): void {
  const { values, positionals } = parsed;
  if (positionals.length > 0) throw new UsageError(`unexpected argument "${positionals[0]}" (the text to continue is --prompt "...")`);
  if (values.prompt === undefined) throw new UsageError('--prompt is required');
  const maxTokens = values['max-tokens']!;
  const concurrency = values.concurrency!;
  if (!Number.isInteger(maxTokens) || maxTokens < 1) throw new UsageError('--max-tokens must be a whole number >= 1');
  // A count no request takes (1e20 passed the check above, was said to be cut to the context, then failed the request).
  if (!Number.isSafeInteger(maxTokens)) throw new UsageError(`--max-tokens must be at most ${Number.MAX_SAFE_INTEGER}, got ${maxTokens}`);
  if (!Number.isInteger(concurrency) || concurrency < 1) throw new UsageError('--concurrency must be a whole number >= 1');
  // Every request runs in one engine batch, sized for them when the engine starts (MAX_NUM_SEQS says why it is bounded).
  if (concurrency > MAX_NUM_SEQS) throw new UsageError(`--concurrency must be at most ${MAX_NUM_SEQS}, got ${concurrency}`);
  if (values.temperature! < 0) throw new UsageError('--temperature must be >= 0');
  const topP = values['top-p']!;
  if (!(topP > 0 && topP <= 1)) throw new UsageError(`--top-p must be in (0, 1], got ${topP}`);
  // Each request's seed is seed + i (i < concurrency): all of them whole numbers a request takes, safe integers.
  const maxSeed = Number.MAX_SAFE_INTEGER - (concurrency - 1);
  if (!Number.isSafeInteger(values.seed) || values.seed! > maxSeed) {
    // --concurrency named by its variable too when the environment gave it (nameEnvironment names only --seed).
    const why = concurrency > 1
      ? ` (with ${flagLabel(GENERATE_FLAGS, parsed, 'concurrency')} ${concurrency} the requests take seeds seed to seed + ${concurrency - 1})` : '';
    throw new UsageError(`--seed must be a whole number from ${-Number.MAX_SAFE_INTEGER} to ${maxSeed}${why}, got ${values.seed}`);
  }
  if (values.threads !== undefined && !(Number.isInteger(values.threads) && values.threads >= 1)) {
    throw new UsageError(`--threads must be a whole number >= 1, got ${values.threads}`);
  }
  checkThreadsAtMost(values.threads);
  const backend = values.backend;
  if (backend !== 'auto' && backend !== 'native' && backend !== 'reference') {
    throw new UsageError(`--backend must be auto, native or reference, got "${backend}"`);
  }
}

export const generateCommand: Command = {
  summary: 'print the continuation of a prompt and the speed',
  async run(argv) {
    const parsed = parseFlags(GENERATE_FLAGS, argv);
    if (parsed.values.help) {
      console.log(`Usage: conduit generate --prompt "..." [options]\n\n${formatFlagHelp(GENERATE_FLAGS)}`);
      return 0;
    }
    try {
      checkOptions(parsed);
    } catch (err) {
      // A value nobody typed is reported under the variable that gave it (CONDUIT_MAX_TOKENS (--max-tokens) ...).
      throw nameEnvironment(GENERATE_FLAGS, parsed, err);
    }
    const { values } = parsed;
    const concurrency = values.concurrency!;
    const maxTokens = values['max-tokens']!;
    const backend = values.backend as 'auto' | 'native' | 'reference';

    const loadStart = performance.now();
    let bundle: LocalEngineBundle;
    let modelPath: string | undefined;
    try {
      modelPath = values.model ?? await ensureBuiltinModel();
      bundle = await createLocalEngine({ modelPath, backend, threads: values.threads, maxNumSeqs: Math.max(concurrency, 1) });
    } catch (err) {
      // A model file (or the built-in model's cache folder) the system will not let us read or write: one line too.
      const problem = fileProblem(err, modelPath !== undefined ? 'model' : undefined);
      if (problem !== undefined) {
        console.error(`conduit generate: ${problem}`);
        return 1;
      }
      if (!isModelLoadError(err) && !(err instanceof EngineStartError)) throw err;
      console.error(`conduit generate: ${err.message}`);
      return 1;
    }
    const { engine, tokenizer, model } = bundle;
    for (const { message } of engine.notices) console.error(`conduit: ${message}`);
    const loadMs = performance.now() - loadStart;

    try {
      const promptIds = tokenizer.encode(values.prompt!, { addSpecialTokens: true });
      // The engine stops a sequence at the context length: asked for more than the prompt leaves, the output ends
      // early with finish "length", which looks like --max-tokens was met. Said before the run; a prompt that leaves
      // no room at all is the engine's refusal below.
      const room = engine.info.maxModelLen - promptIds.length;
      if (room > 0 && maxTokens > room) {
        console.error(`conduit generate: ${flagLabel(GENERATE_FLAGS, parsed, 'max-tokens')} ${maxTokens} does not fit: the prompt's `
          + `${promptIds.length} tokens leave room for ${room} within the context length ${engine.info.maxModelLen}; `
          + `generating at most ${room} (finish "length")`);
      }
      const start = performance.now();
      const runs = Array.from({ length: concurrency }, (_, i) => runOne(i));
      async function runOne(i: number) {
        let text = '';
        let last: EngineOutput | undefined;
        for await (const output of engine.generate({
          id: `generate-${i}`, promptTokenIds: promptIds, priority: 0, arrivalMs: performance.timeOrigin + performance.now(),
          sampling: {
            ...DEFAULT_SAMPLING, maxTokens, temperature: values.temperature!, topP: values['top-p']!,
            seed: values.seed! + i, ignoreEos: values['ignore-eos'],
          },
        })) {
          text += output.textDelta;
          last = output;
        }
        return { text, last: last! };
      }
      let results: Awaited<ReturnType<typeof runOne>>[];
      try {
        results = await Promise.all(runs);
      } catch (err) {
        // The engine refusing the request (a prompt longer than the context, ...) or failing it: one line, as a model
        // it cannot load is (every request is the same, so the first refusal speaks for all).
        if (!isEngineFailure(err)) throw err;
        console.error(`conduit generate: ${err.message.replace(/^request "[^"]*": /, '')}`);
        return 1;
      }
      const wallMs = performance.now() - start;
      // A request the engine failed after taking it (its error is its last output, not a rejection): said as one line,
      // as a refusal is, rather than timings of tokens that never came.
      const failed = results.find((r) => r.last.finishReason === 'error');
      if (failed) {
        console.error(`conduit generate: ${failed.last.error ?? 'the request failed'}`);
        return 1;
      }

      for (const [i, { text }] of results.entries()) {
        if (concurrency > 1) console.log(`--- request ${i} (seed ${values.seed! + i})`);
        console.log(values.prompt + text);
      }
      const totalTokens = results.reduce((sum, r) => sum + r.last.usage.completionTokens, 0);
      const first = results[0]!.last;
      const ttftMs = (first.timestamps.firstToken ?? 0) - first.timestamps.arrival;
      const decodeMs = (first.timestamps.lastToken ?? 0) - (first.timestamps.firstToken ?? 0);
      const decodeTokens = first.usage.completionTokens - 1;
      console.error(
        `\n${model.name} on ${engine.info.backend} (${engine.info.threads} threads${engine.info.kvDtype !== undefined ? `, ${engine.info.kvDtype} KV cache` : ''}), loaded in ${loadMs.toFixed(0)} ms\n` +
        `prompt ${promptIds.length} tokens, time to first token ${ttftMs.toFixed(1)} ms; ` +
        (decodeTokens > 0 ? `decode ${(decodeTokens / (decodeMs / 1000)).toFixed(1)} tok/s per request; ` : '') +
        `${totalTokens} tokens from ${concurrency} request(s) in ${wallMs.toFixed(0)} ms = ` +
        `${(totalTokens / (wallMs / 1000)).toFixed(1)} tok/s aggregate; finish: ${first.finishReason}`);
      return 0;
    } finally {
      await engine.close();
    }
  },
};
