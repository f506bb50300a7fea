// Single-stream decode as `conduit serve` runs it against the same engine core stepped on the calling thread, in one
// process, alternated, so both see the same machine at the same moment (this VM's memory rate moves by 2x within
// minutes, which made separate runs of the server and of bench:decode-step disagree by 10-35%).
//
//   node --import tsx benchmarks/served-step.ts [--model FILE] [--rounds 6] [--threads 2] [--tokens 400]
//
// worker: the engine of `conduit serve` (LocalEngine: the step loop in a worker thread, each step's outputs posted
//         to this thread); per token: the interval between outputs as they arrive here (tbt), the step's own span
//         (forward pass and sampling, EngineStepFacts), and the gap between steps (the worker's bookkeeping, its
//         message to this thread, the turn of its event loop, and the next step's planning).
// core:   EngineCore.step() called back to back on this thread over its own load of the model (the loop of
//         bench:decode-step); per token the interval between steps' returns and the step's whole call.
// Both store f16 KV and decode greedily after a 16-token prompt. Figures are medians per round; read the rounds
// side by side.
import { parseArgs } from 'node:util';
import { LocalEngine } from '../src/engine/local-engine.ts';
import { EngineCore } from '../src/engine/engine-core.ts';
import { engineNow } from '../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../src/engine/types.ts';
import { nativeBackend } from '../src/kernels/native.ts';
import { loadModel } from '../src/model/loader.ts';
import { createTokenizer } from '../src/model/tokenizer/index.ts';
import { percentileOf } from '../src/util/stats.ts';
import { ensureBenchModel } from './model-files.ts';

const { values: args } = parseArgs({
  options: {
    model: { type: 'string' },
    rounds: { type: 'string', default: '6' },
    threads: { type: 'string', default: '2' },
    tokens: { type: 'string', default: '400' },
  },
});
const THREADS = Number(args.threads), TOKENS = Number(args.tokens), PROMPT_TOKENS = 16, BLOCK_SIZE = 16;
const path = args.model ?? (await ensureBenchModel('Q8_0')).path;
const median = (values: readonly number[]): number => percentileOf(values, 0.5);
const intervals = (times: readonly number[]): number[] => times.slice(1).map((t, i) => t - times[i]!);

const engine = await LocalEngine.start({ modelPath: path, threads: THREADS, kvDtype: 'f16', kvCacheMemoryBytes: 64 << 20 });
const model = await loadModel(path);
const numBlocks = Math.ceil((PROMPT_TOKENS + TOKENS) / BLOCK_SIZE) + 1;
const backend = nativeBackend.load(model.config, model.weights, { numBlocks, blockSize: BLOCK_SIZE, dtype: 'f16' },
  { threads: THREADS, releaseUnpackedWeights: true });
const tokenizer = createTokenizer(model.tokenizerSource);

let nextId = 0;
const request = (): EngineRequest => ({
  id: `r${nextId++}`, priority: 0, arrivalMs: engineNow(),
  promptTokenIds: Array.from({ length: PROMPT_TOKENS }, (_, k) => 1 + k),
  sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens: TOKENS, ignoreEos: true },
});

interface Figures { tbt: number; step: number; gap?: number }

async function viaWorker(): Promise<Figures> {
  const arrivals: number[] = [], steps: number[] = [], gaps: number[] = [];
  let lastEnd: number | undefined;
  for await (const output of engine.generate(request())) {
    if (output.step === undefined || output.step.batchTokens !== 1) continue; // decode steps only
    arrivals.push(performance.now());
    steps.push(output.step.end - output.step.start);
    if (lastEnd !== undefined) gaps.push(output.step.start - lastEnd);
    lastEnd = output.step.end;
  }
  return { tbt: median(intervals(arrivals)), step: median(steps), gap: median(gaps) };
}

function viaCore(): Figures {
  const core = new EngineCore({
    backend, tokenizer, maxNumSeqs: 1, maxNumBatchedTokens: 2048, maxModelLen: model.config.contextLength, now: engineNow,
  });
  core.add(request());
  core.step(); // the prefill
  const returns: number[] = [], steps: number[] = [];
  for (let guard = 0; core.hasWork && guard < 2 * TOKENS; guard++) {
    const start = performance.now();
    core.step();
    const end = performance.now();
    steps.push(end - start);
    returns.push(end);
  }
  return { tbt: median(intervals(returns)), step: median(steps) };
}

console.log(`single-stream decode, ${path}, ${THREADS} threads, ${TOKENS} tokens a round; ms per token (medians)`);
await viaWorker(); // warm-up, both paths
viaCore();
const ms = (x: number) => x.toFixed(3);
for (let round = 0; round < Number(args.rounds); round++) {
  // Alternate which path goes first, so neither always follows the other's idle moment.
  const core1 = round % 2 === 1 ? viaCore() : undefined;
  const worker = await viaWorker();
  const core = core1 ?? viaCore();
  console.log(`round ${round + 1}: worker tbt ${ms(worker.tbt)} (step ${ms(worker.step)} + gap ${ms(worker.gap!)})`
    + ` | core tbt ${ms(core.tbt)} (step call ${ms(core.step)}) | worker/core ${(worker.tbt / core.tbt).toFixed(3)}`);
}
await engine.close();
backend.dispose();
