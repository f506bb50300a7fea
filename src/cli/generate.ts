// `conduit generate`: one prompt in, its continuation and speed out. The model defaults to the built-in synthetic
// one, so `conduit generate --prompt hi` works on a fresh clone.

import { loadModel } from '../model/loader.ts';
import { ensureBuiltinModel } from '../model/synthetic.ts';
import { createTokenizer } from '../model/tokenizer/index.ts';
import { ReferenceModel } from '../model/reference-forward.ts';
import { generateReference } from '../model/generate.ts';
import { formatFlagHelp, parseFlags, UsageError, type FlagTable } from './flags.ts';
import type { Command } from './main.ts';

export const GENERATE_FLAGS = {
  model: { type: 'string', help: 'GGUF file or Hugging Face folder (default: the built-in synthetic model)', short: 'm' },
  prompt: { type: 'string', help: 'text to continue', short: 'p' },
  'max-tokens': { type: 'number', help: 'tokens to generate', default: 64 },
  temperature: { type: 'number', help: '0 = greedy', default: 0 },
  seed: { type: 'number', help: 'sampling seed (same seed, same text)', default: 0 },
  help: { type: 'boolean', help: 'show this help', short: 'h' },
} satisfies FlagTable;

export const generateCommand: Command = {
  summary: 'print the continuation of a prompt and the speed',
  async run(argv) {
    const { values } = parseFlags(GENERATE_FLAGS, argv);
    if (values.help) {
      console.log(`Usage: conduit generate --prompt "..." [options]\n\n${formatFlagHelp(GENERATE_FLAGS)}`);
      return 0;
    }
    if (values.prompt === undefined) throw new UsageError('--prompt is required');
    const maxTokens = values['max-tokens']!;
    if (!Number.isInteger(maxTokens) || maxTokens < 0) throw new UsageError('--max-tokens must be a whole number >= 0');
    if (values.temperature! < 0) throw new UsageError('--temperature must be >= 0');

    const loadStart = performance.now();
    const modelPath = values.model ?? await ensureBuiltinModel();
    const loaded = await loadModel(modelPath);
    const tokenizer = createTokenizer(loaded.tokenizerSource);
    const model = new ReferenceModel(loaded.config, loaded.weights);
    const loadMs = performance.now() - loadStart;

    const promptIds = tokenizer.encode(values.prompt, { addSpecialTokens: true });
    const result = await generateReference(model, promptIds, {
      maxTokens,
      temperature: values.temperature,
      seed: values.seed,
      stopIds: tokenizer.stopTokenIds,
    });
    const text = tokenizer.decode([...promptIds, ...result.tokenIds], { skipSpecialTokens: true });
    console.log(text);

    const t = result.timing;
    const decodeTokens = Math.max(0, t.generatedTokens - 1);
    console.error(
      `\n${loaded.config.name}: loaded in ${loadMs.toFixed(0)} ms (reference backend); ` +
      `prompt ${t.promptTokens} tokens in ${t.prefillMs.toFixed(1)} ms ` +
      `(${(t.promptTokens / (t.prefillMs / 1000)).toFixed(1)} tok/s); ` +
      `${decodeTokens} more tokens in ${t.decodeMs.toFixed(1)} ms` +
      (decodeTokens > 0 ? ` (${(decodeTokens / (t.decodeMs / 1000)).toFixed(1)} tok/s)` : '') +
      `; finish: ${result.finishReason}`);
    return 0;
  },
};
