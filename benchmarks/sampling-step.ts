// What sampling costs a decode step with many streams: EngineCore on the native backend, N seeded requests decoding
// together, for greedy, temperature, top_p and top_k requests, and greedy and top_p requests with logprobs. Each kind
// runs two ways, alternated round by round in swapped order: the backend's batched draws (greedy rows' argmax
// included) and logprob pass on the model's threads (`batched`, what the engine does) and the sampler drawing the
// rows and weighing their logprobs one by one on the engine's thread (`row by row`: the backend without sampleRows
// and promptLogprobRows). Both give the same tokens and logprobs (tested); the figures are the median decode step, its
// forward pass, and the rest (sampling, bookkeeping), medians over rounds.
//
//   node --import tsx benchmarks/sampling-step.ts [--model FILE.gguf] [--threads 2] [--concurrency 16,64]
//                                                 [--rounds 5] [--tokens 48]
//
// --model: default the synthetic 110M Q8_0 benchmark model (32000-token vocabulary).

import { basename } from 'node:path';
import { parseArgs } from 'node:util';

import { engineNow } from '../src/engine/clock.ts';
import { EngineCore } from '../src/engine/engine-core.ts';
import { DEFAULT_SAMPLING, type SamplingParams } from '../src/engine/types.ts';
import { nativeBackend } from '../src/kernels/native.ts';
import type { ModelRunnerBackend } from '../src/kernels/types.ts';
import { loadModel } from '../src/model/loader.ts';
import { createTokenizer } from '../src/model/tokenizer/index.ts';
import { percentileOf } from '../src/util/stats.ts';
import { ensureBenchModel } from './model-files.ts';

const { values: args } = parseArgs({
  options: {
    model: { type: 'string' },
    threads: { type: 'string', default: '2' },
    concurrency: { type: 'string', default: '16,64' },
    rounds: { type: 'string', default: '5' },
    tokens: { type: 'string', default: '48' },
  },
});
const ROUNDS = Number(args.rounds);
const OUTPUT_TOKENS = Number(args.tokens);
const CONCURRENCY = args.concurrency.split(',').map(Number);
const PROMPT_TOKENS = 16;
const BLOCK_SIZE = 16;

const file = args.model ? { path: args.model, label: basename(args.model) } : await ensureBenchModel('Q8_0');
const model = await loadModel(file.path);
const maxSeqs = Math.max(...CONCURRENCY);
const backend = nativeBackend.load(model.config, model.weights,
  { numBlocks: Math.ceil((maxSeqs * (PROMPT_TOKENS + OUTPUT_TOKENS)) / BLOCK_SIZE) + maxSeqs, blockSize: BLOCK_SIZE, dtype: 'f16' },
  { threads: Number(args.threads) });
const tokenizer = createTokenizer(model.tokenizerSource);

/** The backend as the engine sees it, its forward timed; without sampleRows and promptLogprobRows for the row-by-row way. */
let forwardMs = 0;
function timedBackend(batched: boolean): ModelRunnerBackend {
  return new Proxy(backend, {
    get: (target, key) => {
      if ((key === 'sampleRows' || key === 'promptLogprobRows') && !batched) return undefined;
      if (key === 'forward') {
        return (...forwardArgs: Parameters<ModelRunnerBackend['forward']>) => {
          const start = performance.now();
          const logits = target.forward(...forwardArgs);
          forwardMs += performance.now() - start;
          return logits;
        };
      }
      const value: unknown = Reflect.get(target, key);
      return typeof value === 'function' ? value.bind(target) : value;
    },
  });
}

const median = (values: readonly number[]): number => percentileOf(values, 0.5);

interface RunFigures { stepMs: number; forwardMs: number }
let nextId = 0;
/** Median decode step and forward time (ms) of one run of n requests. */
function run(n: number, sampling: Partial<SamplingParams>, batched: boolean): RunFigures {
  const core = new EngineCore({
    backend: timedBackend(batched), tokenizer, maxNumSeqs: maxSeqs, maxNumBatchedTokens: Math.max(2048, maxSeqs * PROMPT_TOKENS),
    maxModelLen: model.config.contextLength, now: engineNow,
  });
  for (let i = 0; i < n; i++) {
    const id = nextId++;
    core.add({
      id: `r${id}`, priority: 0, arrivalMs: engineNow(),
      promptTokenIds: Array.from({ length: PROMPT_TOKENS }, (_, k) => 1 + ((id * 131 + k * 17) % 30000)),
      sampling: { ...DEFAULT_SAMPLING, ...sampling, seed: id, maxTokens: OUTPUT_TOKENS, ignoreEos: true },
    });
  }
  const steps: number[] = [];
  const forwards: number[] = [];
  core.step(); // the prefill step
  for (let guard = 0; core.hasWork && guard < OUTPUT_TOKENS * 4; guard++) {
    forwardMs = 0;
    const start = performance.now();
    const outputs = core.step();
    const ms = performance.now() - start;
    if (outputs.length === n) {
      steps.push(ms);
      forwards.push(forwardMs);
    }
  }
  if (core.hasWork) throw new Error('requests did not finish');
  return { stepMs: median(steps), forwardMs: median(forwards) };
}

const KINDS: { name: string; sampling: Partial<SamplingParams> }[] = [
  { name: 'greedy', sampling: { temperature: 0 } },
  { name: 'temperature 0.7', sampling: { temperature: 0.7 } },
  { name: 'temperature 0.7, top_p 0.9', sampling: { temperature: 0.7, topP: 0.9 } },
  { name: 'temperature 0.7, top_k 40', sampling: { temperature: 0.7, topK: 40 } },
  { name: 'greedy, logprobs 1', sampling: { temperature: 0, logprobs: 1 } },
  { name: 'top_p 0.9, logprobs 5', sampling: { temperature: 0.7, topP: 0.9, logprobs: 5 } },
];

console.log(`sampling in a decode step: ${file.label}, vocabulary ${model.config.vocabSize}, threads ${args.threads}, `
  + `${ROUNDS} rounds of ${OUTPUT_TOKENS} tokens per request; medians over rounds of each run's median step`);
console.log('streams  requests                    way          step ms  forward ms  rest ms  tok/s');
for (const n of CONCURRENCY) {
  run(n, KINDS[1]!.sampling, true); // warm-up
  for (const kind of KINDS) {
    const ways = [true, false];
    const figures = new Map<boolean, RunFigures[]>(ways.map((w) => [w, []]));
    for (let round = 0; round < ROUNDS; round++) {
      for (const batched of round % 2 === 0 ? ways : [...ways].reverse()) figures.get(batched)!.push(run(n, kind.sampling, batched));
    }
    for (const batched of ways) {
      const list = figures.get(batched)!;
      const step = median(list.map((f) => f.stepMs));
      const forward = median(list.map((f) => f.forwardMs));
      console.log(`${String(n).padStart(7)}  ${kind.name.padEnd(26)}  ${(batched ? 'batched' : 'row by row').padEnd(11)}  `
        + `${step.toFixed(2).padStart(7)}  ${forward.toFixed(2).padStart(10)}  ${(step - forward).toFixed(2).padStart(7)}  ${(n / step * 1000).toFixed(0).padStart(5)}`);
    }
  }
}
backend.dispose();
