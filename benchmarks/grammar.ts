// Constrained decoding's cost per token against a decode step. Two measurements, alternated per round so machine
// load falls on both:
//   - grammar: B matchers (XGrammar WASM, one per sequence) walk a bounded JSON schema; per step, each sequence's
//     mask is applied to a logits row (GuidedSequence.maskRow), a token is drawn among the allowed ones and the
//     matcher advances (accept). Vocabularies: Llama 2 (32k, the built-in), Llama 3 (128k) and Qwen2 (152k), read
//     from ../shared/models' vocab-only GGUFs (skipped when absent).
//   - decode: EngineCore decode steps of the 110M synthetic model (Q8_0, native backend) with B greedy requests.
// Two grammar cases: "noise" (random logits: nearly every draw is refused, so every token pays for a mask: the
// worst case, the synthetic model's) and "follows" (the logits peak at the next token of a valid document, as a
// model that writes the format does: the engine's draw-first path takes the token with one advance and computes no
// mask; EngineCore.guidedDrawFirst; after repeated refusals the draw is skipped for a while, as the engine does).
// Only the grammar's own calls (advance, mask) are timed, not the sampler's
// passes. Printed per vocabulary and batch: grammar ms per step (the mean over a round's steps, the median over
// rounds), µs per token, and the share of the 110M model's decode step (median) at that batch. (The Llama 2 "follows" case still masks now and then: its SentencePiece encoding of the
// document starts with a space-prefixed token the grammar refuses.)
//
// A third case, "noise+jf", is noise with jump-forward as the engine does it by default: after each accepted token the
// text the grammar forces is turned into tokens and accepted (GuidedSequence.forcedTokens); its cost (the
// jump-forward query and the advances) is timed with the rest, per sampled token, and the forced tokens per step are
// printed (they need no mask and no decode step of their own).
//
// Then jump-forward in the engine: B guided requests (the bounded JSON schema, with any whitespace and compact) on
// the 110M model (noise, greedy and sampled) with jump-forward off and on: output tokens, tokens appended without
// sampling, engine steps and wall time.
//
//   node --import tsx benchmarks/grammar.ts [--rounds 5] [--threads 2] [--batch 1,16,64] [--steps 48] [--jf-batch 16]

import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { loadavg } from 'node:os';
import { parseArgs } from 'node:util';

import { engineNow } from '../src/engine/clock.ts';
import { EngineCore } from '../src/engine/engine-core.ts';
import { GrammarRuntime, type GuidedSequence } from '../src/engine/grammar/runtime.ts';
import { DEFAULT_SAMPLING } from '../src/engine/types.ts';
import { nativeBackend } from '../src/kernels/native.ts';
import { readGguf } from '../src/model/gguf.ts';
import { loadModel } from '../src/model/loader.ts';
import { LLAMA_SPM_TOKENIZER_PATH } from '../src/model/synthetic.ts';
import { createTokenizer } from '../src/model/tokenizer/index.ts';
import type { Tokenizer } from '../src/model/tokenizer/types.ts';
import { percentileOf } from '../src/util/stats.ts';
import { Xoshiro128 } from '../src/util/random.ts';
import { ensureBenchModel } from './model-files.ts';

const { values: args } = parseArgs({
  options: {
    rounds: { type: 'string', default: '5' },
    threads: { type: 'string', default: '2' },
    batch: { type: 'string', default: '1,16,64' },
    steps: { type: 'string', default: '48' },
    'jf-batch': { type: 'string', default: '16' },
  },
});
const ROUNDS = Number(args.rounds);
const BATCHES = args.batch.split(',').map(Number);
const STEPS = Number(args.steps);
const SHARED = process.env.CONDUIT_SHARED_MODELS ?? join(import.meta.dirname, '..', '..', 'shared', 'models');
const median = (values: readonly number[]): number => percentileOf(values, 0.5);

const SCHEMA = {
  type: 'object',
  properties: {
    name: { type: 'string', maxLength: 16 }, age: { type: 'integer', minimum: 0, maximum: 120 },
    tags: { type: 'array', items: { type: 'string', maxLength: 8 }, maxItems: 4 }, color: { enum: ['red', 'green', 'blue'] },
  },
  required: ['name', 'age', 'tags', 'color'], additionalProperties: false,
};

// ---- the 110M model's decode step

const file = await ensureBenchModel('Q8_0');
const model = await loadModel(file.path);
const maxBatch = Math.max(...BATCHES);
const backend = nativeBackend.load(model.config, model.weights,
  { numBlocks: Math.ceil((maxBatch * (16 + STEPS + 2)) / 16) + maxBatch, blockSize: 16, dtype: 'f16' }, { threads: Number(args.threads) });
const modelTokenizer = createTokenizer(model.tokenizerSource);
let nextId = 0;

function decodeStepMs(batch: number): number {
  const core = new EngineCore({
    backend, tokenizer: modelTokenizer, maxNumSeqs: maxBatch, maxNumBatchedTokens: Math.max(2048, maxBatch * 16),
    maxModelLen: model.config.contextLength, now: engineNow,
  });
  for (let i = 0; i < batch; i++) {
    const id = nextId++;
    core.add({
      id: `r${id}`, priority: 0, arrivalMs: engineNow(),
      promptTokenIds: Array.from({ length: 16 }, (_, k) => 1 + ((id * 131 + k * 17) % 30000)),
      sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens: STEPS, ignoreEos: true },
    });
  }
  const stepMs: number[] = [];
  core.step();
  for (let guard = 0; core.hasWork && guard < STEPS * 4; guard++) {
    const start = performance.now();
    const outputs = core.step();
    if (outputs.length === batch) stepMs.push(performance.now() - start);
  }
  return median(stepMs);
}

// ---- the grammar's work per step

interface Vocab { label: string; tokenizer: Tokenizer; runtime: GrammarRuntime }

async function vocab(label: string, path: string): Promise<Vocab | undefined> {
  if (!existsSync(path)) {
    console.log(`(${label}: ${path} is absent, skipped)`);
    return undefined;
  }
  const tokenizer = createTokenizer({ kind: 'gguf', file: readGguf(path) });
  return { label, tokenizer, runtime: await GrammarRuntime.create(tokenizer) };
}

function argmax(row: Float32Array): number {
  let best = 0;
  for (let id = 1; id < row.length; id++) if (row[id]! > row[best]!) best = id;
  return best;
}

type Case = 'noise' | 'noise+jf' | 'follows';
const CASES: Case[] = ['noise', 'noise+jf', 'follows'];
const DOCUMENT = JSON.stringify({ name: 'Ada Lovelace', age: 36, tags: ['math', 'poet'], color: 'green' });

function grammarStepMs(v: Vocab, batch: number, seed: number, mode: Case): { stepMs: number; tokens: number; forced: number } {
  const doc = v.tokenizer.encode(DOCUMENT, { addSpecialTokens: false });
  const positions = new Array<number>(batch).fill(0);
  const size = v.runtime.vocabSize;
  const rng = Xoshiro128.fromSeed(seed, 0);
  const rows = new Float32Array(batch * size);
  const spec = { kind: 'json_schema' as const, schema: JSON.stringify(SCHEMA) };
  const matchers: GuidedSequence[] = Array.from({ length: batch }, () => v.runtime.open(spec));
  const times: number[] = [];
  let tokens = 0;
  let forced = 0;
  for (let step = 0; step < STEPS; step++) {
    for (let i = 0; i < rows.length; i++) rows[i] = rng.nextFloat() * 8; // logits stand-in, filled outside the timing
    // Only the grammar's own calls are timed (advance, mask); the argmax passes are the sampler's, which the step
    // pays with or without a grammar (a refused draw does cost it one more pass over the masked row, not counted).
    let stepMs = 0;
    for (let b = 0; b < batch; b++) {
      let guided = matchers[b]!;
      if (guided.isTerminated || positions[b]! > doc.length) {
        guided.dispose();
        guided = matchers[b] = v.runtime.open(spec);
        positions[b] = 0;
      }
      const row = rows.subarray(b * size, (b + 1) * size);
      if (mode === 'follows') row[doc[positions[b]!] ?? v.tokenizer.stopTokenIds[0]!] = 100;
      positions[b]!++;
      let best = argmax(row);
      let start = performance.now();
      // The engine's draw-first path, skipped after repeated refusals as EngineCore.sampleRows does.
      let accepted = false;
      if (guided.skipDraws > 0) {
        guided.skipDraws--;
      } else {
        accepted = guided.accept(best);
        if (accepted) guided.refusedRun = 0;
        else guided.skipDraws = Math.min(++guided.refusedRun - 1, 7);
      }
      stepMs += performance.now() - start;
      if (!accepted) {
        start = performance.now();
        guided.maskRow(row);
        stepMs += performance.now() - start;
        best = argmax(row);
        start = performance.now();
        guided.accept(best);
        stepMs += performance.now() - start;
      }
      if (mode === 'noise+jf' && !guided.isTerminated) {
        start = performance.now();
        forced += guided.forcedTokens().length;
        stepMs += performance.now() - start;
      }
      tokens++;
    }
    times.push(stepMs);
  }
  for (const matcher of matchers) matcher.dispose();
  // The mean: a step pays for masks only now and then (at batch 1 the median step may have none).
  return { stepMs: times.reduce((sum, ms) => sum + ms, 0) / times.length, tokens, forced };
}

const vocabs = (await Promise.all([
  vocab('32k (Llama 2)', LLAMA_SPM_TOKENIZER_PATH),
  vocab('128k (Llama 3)', join(SHARED, 'ggml-vocab-llama-bpe.gguf')),
  vocab('152k (Qwen2)', join(SHARED, 'ggml-vocab-qwen2.gguf')),
])).filter((v): v is Vocab => v !== undefined);

console.log(`grammar (mask + advance, XGrammar WASM) vs decode step of ${file.label} (native ${backend.info.variants?.matmul_q8_0 ?? '?'}, `
  + `threads ${args.threads}); ${ROUNDS} rounds x ${STEPS} steps; load average ${loadavg().map((x) => x.toFixed(1)).join(' ')}`);
for (const batch of BATCHES) decodeStepMs(batch); // warm-up
for (const batch of BATCHES) {
  const decode: number[] = [];
  const grammar = new Map<string, number[]>();
  const forcedPerStep = new Map<string, number>();
  for (let round = 0; round < ROUNDS; round++) {
    decode.push(decodeStepMs(batch));
    for (const v of vocabs) {
      for (const mode of CASES) {
        const key = `${v.label}|${mode}`;
        if (!grammar.has(key)) grammar.set(key, []);
        const result = grammarStepMs(v, batch, round + 1, mode);
        grammar.get(key)!.push(result.stepMs);
        forcedPerStep.set(key, (forcedPerStep.get(key) ?? 0) + result.forced / STEPS / ROUNDS);
      }
    }
  }
  const decodeMs = median(decode);
  console.log(`batch ${String(batch).padStart(2)}: decode step ${decodeMs.toFixed(2)} ms`);
  for (const v of vocabs) {
    for (const mode of CASES) {
      const key = `${v.label}|${mode}`;
      const ms = median(grammar.get(key)!);
      const forced = mode === 'noise+jf' ? `  +${(forcedPerStep.get(key)! / batch).toFixed(2)} forced tokens per sampled one` : '';
      console.log(`  vocab ${v.label.padEnd(15)} ${mode.padEnd(8)} grammar ${ms.toFixed(3).padStart(8)} ms/step  `
        + `${(ms * 1000 / batch).toFixed(0).padStart(5)} µs/token  ${(100 * ms / decodeMs).toFixed(1).padStart(5)}% of the decode step${forced}`);
    }
  }
}

// ---- jump-forward in the engine: B guided requests on the 110M model, off vs on

const jfBatch = Number(args['jf-batch']);
const builtin = vocabs.find((v) => v.label.startsWith('32k'));
if (builtin !== undefined && jfBatch > 0) {
  const grammarRuntime = await GrammarRuntime.create(modelTokenizer, model.config.vocabSize);
  const run = (jumpForward: boolean, temperature: number, compact: boolean) => {
    const core = new EngineCore({
      backend, tokenizer: modelTokenizer, maxNumSeqs: maxBatch, maxNumBatchedTokens: Math.max(2048, maxBatch * 16),
      maxModelLen: model.config.contextLength, now: engineNow, grammar: () => grammarRuntime, jumpForward,
    });
    for (let i = 0; i < jfBatch; i++) {
      core.add({
        id: `jf${nextId++}`, priority: 0, arrivalMs: engineNow(),
        promptTokenIds: modelTokenizer.encode(`Describe person number ${i} as JSON.`),
        sampling: { ...DEFAULT_SAMPLING, temperature, seed: 100 + i, maxTokens: 256,
          guided: { kind: 'json_schema', schema: JSON.stringify(SCHEMA), compact } },
      });
    }
    let tokens = 0;
    let steps = 0;
    let valid = 0;
    const texts = new Map<string, string>();
    const start = performance.now();
    for (; core.hasWork && steps < 4096; steps++) {
      for (const output of core.step()) {
        tokens += output.newTokenIds.length;
        texts.set(output.requestId, (texts.get(output.requestId) ?? '') + output.textDelta);
        if (output.finishReason === 'stop') {
          try {
            JSON.parse(texts.get(output.requestId)!);
            valid++;
          } catch { /* counted as not valid */ }
        }
      }
    }
    return { ms: performance.now() - start, tokens, steps, forced: core.forcedTokens, valid };
  };
  console.log(`jump-forward in the engine: ${jfBatch} requests (bounded JSON schema, max 256 tokens) on ${file.label}; median of ${ROUNDS}`);
  for (const [temperature, compact] of [[0, false], [1, false], [0, true], [1, true]] as const) {
    const results = new Map<boolean, ReturnType<typeof run>[]>([[false, []], [true, []]]);
    for (let round = 0; round < ROUNDS; round++) for (const jf of [false, true]) results.get(jf)!.push(run(jf, temperature, compact));
    for (const jf of [false, true]) {
      const list = results.get(jf)!;
      const ms = median(list.map((r) => r.ms));
      const last = list.at(-1)!;
      console.log(`  T=${temperature} ${compact ? 'compact JSON' : 'any whitespace'} jump-forward ${jf ? 'on ' : 'off'}: ${last.tokens} tokens (${last.forced} forced, `
        + `${(100 * last.forced / last.tokens).toFixed(0)}%), ${last.steps} steps, ${last.valid}/${jfBatch} valid JSON; `
        + `${ms.toFixed(0)} ms, ${(1000 * ms / last.tokens).toFixed(0)} µs per output token`);
    }
  }
}
console.log(`load average after: ${loadavg().map((x) => x.toFixed(1)).join(' ')}`);
backend.dispose();
