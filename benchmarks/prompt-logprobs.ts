// What prompt logprobs (sampling.promptLogprobs: completions' echo with logprobs, vLLM's prompt_logprobs) cost on
// top of computing the prompt, and where it goes. One LocalEngine per step size, in this process, alternated per round:
//
//   plain          the prompt and one token, steps of up to 2048 tokens (the default);
//   plain chunked  the same in steps of R tokens, R = the prompt-logprob rows a step may return (promptLogprobRowsFor:
//                  262 for a 32000-token vocabulary), which is how a request with prompt logprobs is chunked;
//   logprobs k     the prompt with promptLogprobs k (0: each prompt token's own logprob and rank; 5: and 5 best).
//
// Then the parts of the difference: the LM head over every prompt row (its FLOPs over the prompt's matmul FLOPs,
// priced at the rate the plain chunked prefill ran: an estimate, the LM head being one large matmul that may run
// faster than the prompt's average), and the sampler's work per row, timed here on random rows of the model's
// vocabulary size: one row at a time (Sampler.promptLogprob with the native argmax and weighing pass) and a step's
// rows at once (Sampler.promptLogprobRows with the native backend's pass on the model's threads, as EngineCore runs
// it).
//
//   node --import tsx benchmarks/prompt-logprobs.ts [--model FILE] [--prompt 2048] [--rounds 5] [--threads 2]
import { parseArgs } from 'node:util';
import { LocalEngine, DEFAULT_MAX_NUM_BATCHED_TOKENS } from '../src/engine/local-engine.ts';
import { engineNow } from '../src/engine/clock.ts';
import { promptLogprobRowsFor } from '../src/engine/engine-core.ts';
import { Sampler, type PromptLogprobRowsPass, type WeighCandidates } from '../src/engine/sampler.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../src/engine/types.ts';
import { availableBackends } from '../src/kernels/select.ts';
import { loadModel } from '../src/model/loader.ts';
import { percentileOf } from '../src/util/stats.ts';
import { seededRandom } from '../src/util/random.ts';
import { ensureBenchModel } from './model-files.ts';

const { values: args } = parseArgs({
  options: {
    model: { type: 'string' },
    prompt: { type: 'string', default: '2048' },
    rounds: { type: 'string', default: '5' },
    threads: { type: 'string', default: '2' },
  },
});
const PROMPT = Number(args.prompt), ROUNDS = Number(args.rounds), THREADS = Number(args.threads);
const path = args.model ?? (await ensureBenchModel('Q8_0')).path;
const { config, weights } = await loadModel(path);
const rows = promptLogprobRowsFor(config.vocabSize, DEFAULT_MAX_NUM_BATCHED_TOKENS);
const median = (values: readonly number[]): number => percentileOf(values, 0.5);

const start = (maxNumBatchedTokens: number) => LocalEngine.start({
  modelPath: path, threads: THREADS, kvCacheMemoryBytes: 256 << 20, maxNumBatchedTokens, maxModelLen: PROMPT + 16,
});
const engines = { whole: await start(DEFAULT_MAX_NUM_BATCHED_TOKENS), chunked: await start(rows) };

const random = seededRandom(7);
let nextId = 0;
/** Milliseconds from sending to the first output (the prompt computed and one token sampled); a fresh prompt each time. */
async function ttft(engine: keyof typeof engines, promptLogprobs?: number): Promise<number> {
  const promptTokenIds = Array.from({ length: PROMPT }, () => 100 + Math.floor(random() * (config.vocabSize - 200)));
  const request: EngineRequest = {
    id: `p${nextId++}`, promptTokenIds, priority: 0, arrivalMs: engineNow(),
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 1, temperature: 0, ...(promptLogprobs !== undefined ? { promptLogprobs } : {}) },
  };
  const sent = performance.now();
  let first = 0;
  for await (const output of engines[engine].generate(request)) {
    if (first === 0) first = performance.now();
    if (promptLogprobs !== undefined && output.promptLogprobs?.length !== PROMPT) throw new Error('prompt logprobs missing');
  }
  return first - sent;
}

const cases: [string, () => Promise<number>][] = [
  ['plain', () => ttft('whole')],
  [`plain chunked (${rows})`, () => ttft('chunked')],
  ['logprobs 0', () => ttft('whole', 0)],
  ['logprobs 5', () => ttft('whole', 5)],
];
const times = new Map(cases.map(([name]) => [name, [] as number[]]));
for (const [, run] of cases) await run(); // warm-up
console.log(`${config.name}: ${PROMPT}-token prompt, ${THREADS} threads, prompt-logprob rows per step ${rows}; TTFT ms per round`);
for (let round = 0; round < ROUNDS; round++) {
  const line: string[] = [];
  for (const [name, run] of cases) {
    const ms = await run();
    times.get(name)!.push(ms);
    line.push(`${name} ${ms.toFixed(0)}`);
  }
  console.log(`  round ${round + 1}: ${line.join(', ')}`);
}
await Promise.all(Object.values(engines).map((engine) => engine.close()));

// The sampler's share per prompt row, on random rows of the model's vocabulary: one row at a time (promptLogprob with
// the native argmax and weighing pass), and a step's rows at once through the native backend's pass on THREADS threads
// (promptLogprobRows, as EngineCore runs it).
const backend = availableBackends().at(-1)!;
const runner = backend.load(config, weights, { numBlocks: 4, blockSize: 16, dtype: 'f32' }, { threads: THREADS });
const sampler = new Sampler(config.vocabSize, {
  ...(runner.argmax ? { argmax: (row: Float32Array) => runner.argmax!(row) } : {}),
  ...(runner.sampleWeigh ? { weigh: (...a: Parameters<WeighCandidates>) => runner.sampleWeigh!(...a) } : {}),
  ...(runner.promptLogprobRows ? { promptRows: (...a: Parameters<PromptLogprobRowsPass>) => runner.promptLogprobRows!(...a) } : {}),
});
const stepLogits = Float32Array.from({ length: rows * config.vocabSize }, () => (random() - 0.5) * 20);
const stepTargets = Array.from({ length: rows }, () => Math.floor(random() * config.vocabSize));
const perRowUs = (numTop: number, together: boolean): number => {
  const numTops = stepTargets.map(() => numTop);
  const samples: number[] = [];
  for (let pass = 0; pass < 7; pass++) {
    const t = performance.now();
    if (together) sampler.promptLogprobRows(stepLogits, stepTargets, numTops);
    else stepTargets.forEach((tokenId, r) => sampler.promptLogprob(stepLogits.subarray(r * config.vocabSize, (r + 1) * config.vocabSize), tokenId, numTop));
    samples.push(((performance.now() - t) * 1000) / rows);
  }
  return Math.min(...samples);
};

// The LM head's share: its FLOPs for the extra rows over the prompt's matmul FLOPs, priced at the plain chunked rate.
const { dim, numLayers, numHeads, numKvHeads, headDim, ffnDim, vocabSize } = config;
const layerParams = dim * headDim * (numHeads * 2 + numKvHeads * 2) + 3 * dim * ffnDim;
const lmHead = dim * vocabSize;
const extraShare = ((PROMPT - 1) * lmHead) / (PROMPT * numLayers * layerParams + lmHead);
const plainChunked = median(times.get(`plain chunked (${rows})`)!);
console.log('\nmedians (best):');
for (const [name] of cases) {
  const values = times.get(name)!;
  console.log(`  ${name.padEnd(22)} ${median(values).toFixed(0).padStart(6)} ms (${Math.min(...values).toFixed(0)})`);
}
console.log(`LM head over ${PROMPT - 1} more rows: ${(extraShare * 100).toFixed(1)}% of the prompt's matmul FLOPs, `
  + `${(extraShare * plainChunked).toFixed(0)} ms at the plain chunked rate (an estimate: matmuls only, at their average rate)`);
for (const numTop of [0, 1, 5]) {
  for (const together of [false, true]) {
    const us = perRowUs(numTop, together);
    console.log(`sampler per row, top ${numTop}, ${together ? `${rows} rows at once (${backend.name} backend, ${THREADS} threads)` : `one row at a time (${backend.name} passes)`}: `
      + `${us.toFixed(1)} µs, ${((us * (PROMPT - 1)) / 1000).toFixed(0)} ms for the prompt`);
  }
}
runner.dispose();
