// Decode throughput with LoRA adapters: 16 greedy streams on the 110M Q8_0 model (native backend) with 0 (base
// model only), 1, 4 and 16 distinct rank-8 adapters on q/k/v/o/gate/up/down, stream i using adapter i mod N. Every
// stream decodes in the same steps whatever its adapter (one batched LoRA pass per projection), so the figure is the
// cost of the low-rank products against the base step.
//
//   node --import tsx benchmarks/lora-decode.ts [--rounds 5] [--threads 2] [--streams 16] [--adapters 0,1,4,16]
//       [--rank 8] [--tokens 48] [--lora-dtype q8|bf16|f32]
//
// CONDUIT_LORA_FUSE=0 in the environment runs the LoRA products in jobs of their own after each matmul (the
// baseline of their fusion into the matmuls' jobs; native/lora.h): alternate processes with and without it.
//
// Each run: the streams (16-token prompts, --tokens generated, ignore_eos) prefill in one step, which is left out;
// the run's figures are the medians of its decode steps' wall and CPU times. Configurations alternate within each
// round (rotated order), so drift in the machine's load falls on all. Printed per adapter count: median step ms over
// rounds, output tok/s, and tok/s relative to the base model; then the same from CPU time.

import { mkdtempSync, rmSync } from 'node:fs';
import { loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';

import { engineNow } from '../src/engine/clock.ts';
import { EngineCore } from '../src/engine/engine-core.ts';
import { DEFAULT_SAMPLING } from '../src/engine/types.ts';
import { nativeBackend } from '../src/kernels/native.ts';
import { loadModel } from '../src/model/loader.ts';
import { loadLoraAdapter, type LoraDtype, resolveLoraDtype } from '../src/model/lora.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../src/model/lora-writer.ts';
import { createTokenizer } from '../src/model/tokenizer/index.ts';
import { percentileOf } from '../src/util/stats.ts';
import { ensureBenchModel } from './model-files.ts';

const { values: args } = parseArgs({
  options: {
    rounds: { type: 'string', default: '5' },
    threads: { type: 'string', default: '2' },
    streams: { type: 'string', default: '16' },
    adapters: { type: 'string', default: '0,1,4,16' },
    rank: { type: 'string', default: '8' },
    tokens: { type: 'string', default: '48' },
    'lora-dtype': { type: 'string' },
  },
});
const ROUNDS = Number(args.rounds);
const STREAMS = Number(args.streams);
const COUNTS = args.adapters.split(',').map(Number);
const RANK = Number(args.rank);
const OUTPUT_TOKENS = Number(args.tokens);
const PROMPT_TOKENS = 16;
const BLOCK_SIZE = 16;

const file = await ensureBenchModel('Q8_0');
const model = await loadModel(file.path);
const backend = nativeBackend.load(model.config, model.weights,
  { numBlocks: Math.ceil((STREAMS * (PROMPT_TOKENS + OUTPUT_TOKENS)) / BLOCK_SIZE) + STREAMS, blockSize: BLOCK_SIZE, dtype: 'f16' },
  { threads: Number(args.threads), loraDtype: resolveLoraDtype(args['lora-dtype'] as LoraDtype | undefined) });
const tokenizer = createTokenizer(model.tokenizerSource);
const dir = mkdtempSync(join(tmpdir(), 'conduit-lora-bench-'));
const maxAdapters = Math.max(...COUNTS);
const adapters = Array.from({ length: maxAdapters }, (_, i) => {
  const path = join(dir, `lora-${i}.gguf`);
  writeGgufLoraAdapter(path, model.config, randomLoraAdapter(model.config, { rank: RANK, seed: 100 + i, bScale: 0.05 }));
  return loadLoraAdapter(path, model.config).weights;
});
rmSync(dir, { recursive: true, force: true });

const core = new EngineCore({
  backend, tokenizer, maxNumSeqs: STREAMS, maxNumBatchedTokens: Math.max(2048, STREAMS * PROMPT_TOKENS),
  maxModelLen: model.config.contextLength, now: engineNow, enablePrefixCaching: false,
});
adapters.forEach((weights, i) => core.loadLora(`lora-${i}`, weights));

let nextId = 0;
/**
 * Median decode step time (ms) of one run with `count` distinct adapters (0: base model), wall and CPU (all threads
 * of the process: on a machine shared with other work, the wall time counts the time others hold the cores, the CPU
 * time does not, though it still counts the pool's spinning between loops).
 */
function run(count: number): { wall: number; cpu: number } {
  for (let i = 0; i < STREAMS; i++) {
    const id = nextId++;
    core.add({
      id: `r${id}`, priority: 0, arrivalMs: engineNow(), ...(count > 0 ? { lora: `lora-${i % count}` } : {}),
      promptTokenIds: Array.from({ length: PROMPT_TOKENS }, (_, k) => 1 + ((id * 131 + k * 17) % 30000)),
      sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens: OUTPUT_TOKENS, ignoreEos: true },
    });
  }
  const stepMs: number[] = [];
  const cpuMs: number[] = [];
  core.step(); // the prefill step
  for (let guard = 0; core.hasWork && guard < OUTPUT_TOKENS * 4; guard++) {
    const start = performance.now();
    const cpuStart = process.cpuUsage();
    const outputs = core.step();
    const cpu = process.cpuUsage(cpuStart);
    const ms = performance.now() - start;
    if (outputs.length === STREAMS) {
      stepMs.push(ms);
      cpuMs.push((cpu.user + cpu.system) / 1000);
    }
  }
  if (core.hasWork) throw new Error('requests did not finish');
  return { wall: percentileOf(stepMs, 0.5), cpu: percentileOf(cpuMs, 0.5) };
}

console.log(`LoRA decode, ${file.label}, native matmul_q8_0 ${backend.info.variants?.matmul_q8_0 ?? '?'}, threads ${args.threads}, `
  + `${STREAMS} streams, rank ${RANK} on q/k/v/o/gate/up/down stored as ${resolveLoraDtype(args['lora-dtype'] as LoraDtype | undefined)}, `
  + `products ${process.env.CONDUIT_LORA_FUSE === '0' ? 'in jobs of their own (CONDUIT_LORA_FUSE=0)' : 'in the matmuls\' jobs'}, `
  + `${OUTPUT_TOKENS} tokens, ${ROUNDS} rounds, load average ${loadavg()[0]!.toFixed(1)}`);
for (const count of COUNTS) run(count); // warm-up
const figures = new Map<number, { wall: number; cpu: number }[]>(COUNTS.map((c) => [c, []]));
for (let round = 0; round < ROUNDS; round++) {
  for (let k = 0; k < COUNTS.length; k++) {
    const count = COUNTS[(k + round) % COUNTS.length]!;
    figures.get(count)!.push(run(count));
  }
}
const median = (count: number, key: 'wall' | 'cpu') => percentileOf(figures.get(count)!.map((f) => f[key]), 0.5);
const baseCount = figures.has(0) ? 0 : COUNTS[0]!;
for (const count of COUNTS) {
  const ms = median(count, 'wall');
  const cpu = median(count, 'cpu');
  console.log(`adapters ${String(count).padStart(2)}  ${ms.toFixed(2)} ms/step  ${(STREAMS / ms * 1000).toFixed(0)} tok/s  `
    + `${(median(baseCount, 'wall') / ms * 100).toFixed(1)}% of base   CPU ${cpu.toFixed(2)} ms/step  `
    + `${(median(baseCount, 'cpu') / cpu * 100).toFixed(1)}% of base`);
}
console.log(`load average at the end ${loadavg()[0]!.toFixed(1)}`);
backend.dispose();
