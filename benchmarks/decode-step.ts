// Decode step time of EngineCore on the native backend, with the step's logits written into the buffer the engine
// reuses ("reused") against a fresh Float32Array per step ("fresh": the backend is called without the buffer, as
// before EngineCore passed it). The two modes alternate, in swapped order each round, so drift in the machine's
// load falls on both.
//
//   node --import tsx benchmarks/decode-step.ts [--rounds 7] [--threads 2] [--concurrency 1,16,64] [--tokens 48]
//                                               [--model FILE.gguf]
//
// --model runs another GGUF (default: the synthetic 110M Q8_0 benchmark model); each line also gives the weight
// bytes one step reads over the reused step time, the rate a decode-roofline comparison needs.
//
// Each run: N greedy requests (16-token prompts, --tokens generated, ignore_eos) decode together; the prefill step
// is left out and the median step time of the rest is the run's figure. Printed: per mode, the median over rounds
// of those figures, as ms per step and output tok/s (N / step time).

import { basename } from 'node:path';
import { parseArgs } from 'node:util';

import { engineNow } from '../src/engine/clock.ts';
import { EngineCore } from '../src/engine/engine-core.ts';
import { DEFAULT_SAMPLING } from '../src/engine/types.ts';
import { nativeBackend } from '../src/kernels/native.ts';
import type { ModelRunnerBackend } from '../src/kernels/types.ts';
import { loadModel } from '../src/model/loader.ts';
import { createTokenizer } from '../src/model/tokenizer/index.ts';
import { percentileOf } from '../src/util/stats.ts';
import { ensureBenchModel } from './model-files.ts';
import { decodeWeightBytes } from './peer/conduit-runner.ts';

const { values: args } = parseArgs({
  options: {
    rounds: { type: 'string', default: '7' },
    threads: { type: 'string', default: '2' },
    concurrency: { type: 'string', default: '1,16,64' },
    tokens: { type: 'string', default: '48' },
    model: { type: 'string' },
  },
});
const ROUNDS = Number(args.rounds);
const CONCURRENCY = args.concurrency.split(',').map(Number);
const OUTPUT_TOKENS = Number(args.tokens);
const PROMPT_TOKENS = 16;
const BLOCK_SIZE = 16;
type Mode = 'fresh' | 'reused';

const file = args.model ? { path: args.model, label: basename(args.model) } : await ensureBenchModel('Q8_0');
const model = await loadModel(file.path);
const weightBytes = decodeWeightBytes(model);
const maxSeqs = Math.max(...CONCURRENCY);
const backend = nativeBackend.load(model.config, model.weights,
  { numBlocks: Math.ceil((maxSeqs * (PROMPT_TOKENS + OUTPUT_TOKENS)) / BLOCK_SIZE) + maxSeqs, blockSize: BLOCK_SIZE, dtype: 'f16' },
  { threads: Number(args.threads) });
const tokenizer = createTokenizer(model.tokenizerSource);
/** The same backend called without the caller's buffer: the native forward then allocates the logits. */
const freshBackend: ModelRunnerBackend = { ...backend, forward: (batch) => backend.forward(batch) };

const median = (values: readonly number[]): number => percentileOf(values, 0.5);

let nextId = 0;
/** Median decode step time (ms) of one run of n requests. */
function run(mode: Mode, n: number): number {
  const core = new EngineCore({
    backend: mode === 'reused' ? backend : freshBackend, tokenizer, maxNumSeqs: maxSeqs,
    maxNumBatchedTokens: Math.max(2048, maxSeqs * PROMPT_TOKENS), maxModelLen: model.config.contextLength, now: engineNow,
  });
  for (let i = 0; i < n; i++) {
    const id = nextId++;
    core.add({
      id: `r${id}`, priority: 0, arrivalMs: engineNow(),
      promptTokenIds: Array.from({ length: PROMPT_TOKENS }, (_, k) => 1 + ((id * 131 + k * 17) % 30000)),
      sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens: OUTPUT_TOKENS, ignoreEos: true },
    });
  }
  const stepMs: number[] = [];
  core.step(); // the prefill step
  for (let guard = 0; core.hasWork && guard < OUTPUT_TOKENS * 4; guard++) {
    const start = performance.now();
    const outputs = core.step();
    const ms = performance.now() - start;
    if (outputs.length === n) stepMs.push(ms);
  }
  if (core.hasWork) throw new Error('requests did not finish');
  return median(stepMs);
}

console.log(`decode step, ${file.label}, native matmul_q8_0 ${backend.info.variants?.matmul_q8_0 ?? "?"}, `
  + `threads ${args.threads}, ${ROUNDS} rounds, ${OUTPUT_TOKENS} tokens per request`);
for (const n of CONCURRENCY) run('reused', n); // warm-up
for (const n of CONCURRENCY) {
  const figures: Record<Mode, number[]> = { fresh: [], reused: [] };
  for (let round = 0; round < ROUNDS; round++) {
    const order: Mode[] = round % 2 === 0 ? ['fresh', 'reused'] : ['reused', 'fresh'];
    for (const mode of order) figures[mode].push(run(mode, n));
  }
  const fresh = median(figures.fresh);
  const reused = median(figures.reused);
  console.log(`N=${String(n).padStart(3)}  fresh ${fresh.toFixed(3)} ms/step (${(n / fresh * 1000).toFixed(0)} tok/s)`
    + `  reused ${reused.toFixed(3)} ms/step (${(n / reused * 1000).toFixed(0)} tok/s)`
    + `  reused/fresh step time ${(reused / fresh).toFixed(3)}`
    + `; weights ${(weightBytes / 1e6).toFixed(1)} MB a step = ${(weightBytes / reused / 1e6).toFixed(1)} GB/s reused`);
}
backend.dispose();
