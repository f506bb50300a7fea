// Constrained decoding's cost per token against a decode step. Two measurements, alternated per round so machine
// load falls on both:
//   - grammar: B sequences under a bounded JSON schema (XGrammar WASM, one matcher each) on logits rows, each row
//     sampled as the engine samples a guided greedy row (sampleGuidedRow, the engine's Sampler) and followed by the
//     jump-forward hook (as a worker runs it with --guided-jump-forward; off by default). Its cost is all of that less one plain sampler pass over the same row (an
//     unguided row pays it too): the tries of the row's best tokens and the pass that finds them, the mask (query,
//     then the argmax read from it), the advances, the termination checks, the jump-forward query and the forced
//     tokens' advances. Printed in this thread's CPU time (the batch's, less that of one plain pass per row over a
//     copy) and in wall time (summed per row, less the plain pass's). Vocabularies: Llama 2 (32k, the built-in),
//     Llama 3 (128k) and Qwen2 (152k), read from ../shared/models' vocab-only GGUFs (skipped when absent).
//     --baseline adds each case without the tries (one candidate: the argmax, then the mask; the engine before
//     greedy rows tried their best few tokens), alternated with it in the same rounds.
//   - decode: EngineCore decode steps of the 110M synthetic model (Q8_0, native backend) with B greedy requests.
// Two grammar cases: "noise" (random logits: the row's best token is mostly refused, and between JSON elements the
// next few too, so most tokens pay for a mask: the synthetic model's case, the worst) and "follows" (the logits peak at the next token of the document a model that writes the
// format would write: the longest vocabulary token spelling the document's bytes from where the output stands, so
// every draw is taken with one advance; the tokenizer's own encoding is not used, since SentencePiece starts it
// with a space-prefixed token a JSON grammar refuses). A sequence is replaced by a new one when its grammar ends
// (or after 256 tokens). Printed per vocabulary and batch: µs per sampled token and the share of the 110M model's
// decode step (median) at that batch, with masks, refused tries (the row's tokens the grammar refused before the
// one it took) and forced tokens per sampled token.
//
// Then jump-forward in the engine: B guided requests (the bounded JSON schema, with any whitespace and compact) on
// the 110M model (noise, greedy and sampled) with jump-forward off (the default) and on (--guided-jump-forward):
// output tokens, tokens appended without sampling, engine steps and wall time.
//
//   node --import tsx benchmarks/grammar.ts [--rounds 5] [--threads 2] [--batch 1,16,64] [--steps 48] [--jf-batch 16]
//     [--baseline] [--vocabs 32k,128k,152k]
//
// The vocabularies are measured one after the other, each loaded, warmed up, measured and dropped (and collected)
// before the next, as a worker holds one. The noise figures of one vocabulary still spread by up to 2x between runs
// of identical work (the rows are seeded), more often without the warm-up: compare several runs.

import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { loadavg } from 'node:os';
import { parseArgs } from 'node:util';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';

import { engineNow } from '../src/engine/clock.ts';
import { EngineCore } from '../src/engine/engine-core.ts';
import { GrammarRuntime, type GuidedSequence } from '../src/engine/grammar/runtime.ts';
import { sampleGuidedRow } from '../src/engine/grammar/sampling.ts';
import { createRequestSamplers, Sampler, type SequenceSampler } from '../src/engine/sampler.ts';
import { DEFAULT_SAMPLING } from '../src/engine/types.ts';
import { loadNativeAddon, nativeBackend } from '../src/kernels/native.ts';
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
    baseline: { type: 'boolean', default: false },
    vocabs: { type: 'string', default: '32k,128k,152k' },
  },
});
const ROUNDS = Number(args.rounds);
const BATCHES = args.batch.split(',').map(Number);
const STEPS = Number(args.steps);
const SHARED = process.env.CONDUIT_SHARED_MODELS ?? join(import.meta.dirname, '..', '..', 'shared', 'models');
const median = (values: readonly number[]): number => percentileOf(values, 0.5);
const nativeAddon = loadNativeAddon();

/**
 * This thread's CPU time in ms, exact (the native addon's CLOCK_THREAD_CPUTIME_ID: a step's grammar work is well
 * under a scheduler tick, which is all /proc's schedstat resolves for a running thread).
 */
function threadCpuMs(): number {
  return nativeAddon.bench.threadCpuSeconds() * 1000;
}

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

/** The median decode step (wall ms) and the mean CPU time per step over the process's threads. */
function decodeStepMs(batch: number): { wallMs: number; cpuMs: number } {
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
  let cpuMs = 0;
  core.step();
  for (let guard = 0; core.hasWork && guard < STEPS * 4; guard++) {
    const start = performance.now();
    const cpu = process.cpuUsage();
    const outputs = core.step();
    const used = process.cpuUsage(cpu);
    if (outputs.length === batch) {
      stepMs.push(performance.now() - start);
      cpuMs += (used.user + used.system) / 1000;
    }
  }
  return { wallMs: median(stepMs), cpuMs: cpuMs / stepMs.length };
}

// ---- the grammar's work per step

interface Vocab {
  label: string;
  tokenizer: Tokenizer;
  runtime: GrammarRuntime;
  /** Ordinary tokens by their bytes (a latin1 string), for the following model (followToken). */
  pieces: Map<string, number>;
  maxPiece: number;
}

async function vocab(label: string, path: string): Promise<Vocab | undefined> {
  if (!existsSync(path)) {
    console.log(`(${label}: ${path} is absent, skipped)`);
    return undefined;
  }
  const tokenizer = createTokenizer({ kind: 'gguf', file: readGguf(path) });
  // Every ordinary token by its bytes (latin1 string), for the following model's longest-match cut.
  const pieces = new Map<string, number>();
  let maxPiece = 0;
  for (let id = 0; id < tokenizer.vocabSize; id++) {
    if (tokenizer.isSpecial(id)) continue;
    const text = Buffer.from(tokenizer.tokenBytes(id, false)).toString('latin1');
    if (text === '' || pieces.has(text)) continue;
    pieces.set(text, id);
    maxPiece = Math.max(maxPiece, text.length);
  }
  return { label, tokenizer, runtime: await GrammarRuntime.create(tokenizer), pieces, maxPiece };
}

type Case = 'noise' | 'follows' | 'noise, no tries' | 'follows, no tries';
const CASES: Case[] = args.baseline ? ['noise', 'noise, no tries', 'follows', 'follows, no tries'] : ['noise', 'follows'];
const DOCUMENT = Buffer.from(JSON.stringify({ name: 'Ada Lovelace', age: 36, tags: ['math', 'poet'], color: 'green' }), 'utf8').toString('latin1');
/** A request's longest output here (max_tokens): a noise sequence the grammar has not ended by then is replaced. */
const MAX_OUTPUT = 256;

/**
 * The token the following model puts its peak on: the longest vocabulary token spelling the document at `offset`
 * (the model writes the document's bytes, cut greedily; the tokenizer's own encoding may not be one the grammar
 * takes: SentencePiece starts it with a space-prefixed token, which a JSON grammar refuses), the end-of-generation
 * token after the document.
 */
function followToken(v: Vocab, offset: number): number {
  for (let length = Math.min(v.maxPiece, DOCUMENT.length - offset); length > 0; length--) {
    const id = v.pieces.get(DOCUMENT.slice(offset, offset + length));
    if (id !== undefined) return id;
  }
  return v.tokenizer.stopTokenIds[0]!;
}

interface GrammarStep {
  /** Mean per step: the grammar's wall time (summed per row) and its CPU time (this thread's, per batch). */
  stepMs: number; cpuMs: number;
  tokens: number; masks: number; refused: number; forced: number;
}

/**
 * B sequences, STEPS steps: per step and sequence a logits row, sampled as the engine samples a guided greedy row
 * (sampleGuidedRow, with the engine's Sampler) followed by the jump-forward hook (forcedTokens, as with --guided-jump-forward). The
 * grammar's cost is that time less one plain sampler pass over the row (the pass an unguided row pays too): the
 * candidates' pass beyond it and their tries, the mask (query, then the argmax read from it), the advances, the
 * termination checks and the jump-forward query with the forced tokens' advances. A "no tries" case sets the
 * candidate width to one before each row.
 */
function grammarStepMs(v: Vocab, batch: number, seed: number, caseName: Case): GrammarStep {
  const mode = caseName.startsWith('noise') ? 'noise' : 'follows';
  const tries = !caseName.endsWith('no tries');
  const size = v.runtime.vocabSize;
  const eos = v.tokenizer.stopTokenIds;
  const sampler = new Sampler(size);
  const rng = Xoshiro128.fromSeed(seed, 0);
  const rows = new Float32Array(batch * size);
  const guidedSpec = { kind: 'json_schema' as const, schema: JSON.stringify(SCHEMA) };
  const params = { ...DEFAULT_SAMPLING, temperature: 0, maxTokens: MAX_OUTPUT };
  const sequence = (guided: typeof guidedSpec) => createRequestSamplers({
    params: { ...params, guided }, promptTokenIds: [1], vocabSize: size, eosTokenIds: eos,
  })[0]!;
  const counts = { masks: 0, refused: 0 };
  const pass = sampler.sampleRow.bind(sampler);
  interface Seq { sampling: SequenceSampler; guided: GuidedSequence; offset: number; outputs: number }
  const open = (): Seq => {
    const guided = v.runtime.open(guidedSpec);
    // Counted, not changed: the masks computed and the tokens refused.
    const maskRow = guided.maskRow.bind(guided);
    guided.maskRow = (row) => { counts.masks++; return maskRow(row); };
    const maskedArgmax = guided.maskedArgmax.bind(guided);
    guided.maskedArgmax = (row) => { counts.masks++; return maskedArgmax(row); };
    const accept = guided.accept.bind(guided);
    guided.accept = (id) => { const ok = accept(id); if (!ok) counts.refused++; return ok; };
    return { sampling: sequence(guidedSpec), guided, offset: 0, outputs: 0 };
  };
  const textLength = (ids: readonly number[]) => ids.reduce((sum, id) => sum + v.tokenizer.tokenBytes(id, false).length, 0);
  const seqs = Array.from({ length: batch }, open);
  const plain = Array.from({ length: batch }, () => createRequestSamplers({ params, promptTokenIds: [1], vocabSize: size, eosTokenIds: eos })[0]!);
  const copies = new Float32Array(rows.length);
  const sampled = new Array<{ tokenId: number; forcedIds: number[] }>(batch);
  const wall: number[] = [];
  const cpu: number[] = [];
  let tokens = 0;
  let forced = 0;
  for (let step = 0; step < STEPS; step++) {
    // Outside the timing: the logits stand-in, a finished sequence replaced by a new request, the following
    // model's peak.
    for (let i = 0; i < rows.length; i++) rows[i] = rng.nextFloat() * 8;
    for (let b = 0; b < batch; b++) {
      let seq = seqs[b]!;
      if (seq.guided.isTerminated || seq.outputs >= MAX_OUTPUT) {
        seq.guided.dispose();
        seq = seqs[b] = open();
      }
      if (mode === 'follows') rows[b * size + followToken(v, seq.offset)] = 100;
    }
    copies.set(rows);
    const refusedBefore = counts.refused;
    // EngineCore.sampleRows for each guided row, then the jump-forward hook (samplerTokens' forced). Wall time and
    // CPU time for the batch, each less that of one plain pass per row over a copy, below.
    let wallMs = 0;
    const cpuStart = threadCpuMs();
    for (let b = 0; b < batch; b++) {
      const { guided, sampling } = seqs[b]!;
      if (!tries) guided.candidateWidth = 1;
      const start = performance.now();
      const { tokenId } = sampleGuidedRow(sampler, rows.subarray(b * size, (b + 1) * size), sampling, guided, eos);
      const forcedIds = guided.isTerminated ? [] : guided.forcedTokens();
      for (const id of forcedIds) sampling.recordOutputToken(id);
      wallMs += performance.now() - start;
      sampled[b] = { tokenId, forcedIds };
    }
    const cpuMid = threadCpuMs();
    const plainStart = performance.now();
    for (let b = 0; b < batch; b++) pass(copies.subarray(b * size, (b + 1) * size), plain[b]!);
    wallMs -= performance.now() - plainStart;
    const cpuEnd = threadCpuMs();
    wall.push(wallMs);
    cpu.push((cpuMid - cpuStart) - (cpuEnd - cpuMid));
    if (mode === 'follows' && counts.refused !== refusedBefore) throw new Error(`${v.label}: the grammar refused the following model's token`);
    for (let b = 0; b < batch; b++) {
      const seq = seqs[b]!;
      const { tokenId, forcedIds } = sampled[b]!;
      if (mode === 'follows') seq.offset += textLength([tokenId, ...forcedIds]);
      seq.outputs += 1 + forcedIds.length;
      forced += forcedIds.length;
      tokens++;
    }
  }
  for (const seq of seqs) seq.guided.dispose();
  // The mean: a step pays for masks only now and then (at batch 1 the median step may have none).
  const mean = (values: number[]) => values.length === 0 ? NaN : values.reduce((sum, ms) => sum + ms, 0) / values.length;
  return { stepMs: mean(wall), cpuMs: mean(cpu), tokens, forced, ...counts };
}

const VOCABS: [size: string, label: string, path: string][] = [
  ['32k', '32k (Llama 2)', LLAMA_SPM_TOKENIZER_PATH],
  ['128k', '128k (Llama 3)', join(SHARED, 'ggml-vocab-llama-bpe.gguf')],
  ['152k', '152k (Qwen2)', join(SHARED, 'ggml-vocab-qwen2.gguf')],
];
const wanted = new Set(args.vocabs.split(','));
// Garbage collection on demand, so one vocabulary's runtime is gone before the next one's is measured.
setFlagsFromString('--expose-gc');
const collectGarbage = runInNewContext('gc') as () => void;

console.log(`grammar (advance, mask, jump-forward; XGrammar WASM) vs decode step of ${file.label} (native ${backend.info.variants?.matmul_q8_0 ?? '?'}, `
  + `threads ${args.threads}); ${ROUNDS} rounds x ${STEPS} steps; load average ${loadavg().map((x) => x.toFixed(1)).join(' ')}`);
for (const batch of BATCHES) decodeStepMs(batch); // warm-up
// One vocabulary at a time, as a worker holds one: loaded, measured at every batch (its rounds alternated with the
// decode step's), then dropped and collected before the next is loaded.
for (const [size, label, path] of VOCABS) {
  if (!wanted.has(size)) continue;
  let v = await vocab(label, path);
  if (v === undefined) continue;
  // Warm-up, not recorded: XGrammar's WASM starts in V8's baseline compiler and its hot functions move to the
  // optimizing one as they run (a server's matchers run warm). Cold, 32k noise at batch 16 gave 18.5-32.9 µs a token
  // over three runs, and 18.8-20.2 with the baseline compiler off (--no-liftoff); warmed up, 10.5-23.7 over four.
  for (const mode of CASES) grammarStepMs(v, BATCHES[0]!, 0, mode);
  for (const batch of BATCHES) {
    const decode: number[] = [];
    const decodeCpu: number[] = [];
    const wall = new Map<string, number[]>();
    const cpu = new Map<string, number[]>();
    const counts = new Map<string, GrammarStep>();
    for (let round = 0; round < ROUNDS; round++) {
      const step = decodeStepMs(batch);
      decode.push(step.wallMs);
      decodeCpu.push(step.cpuMs);
      for (const mode of CASES) {
        const result = grammarStepMs(v, batch, round + 1, mode);
        wall.set(mode, [...wall.get(mode) ?? [], result.stepMs]);
        cpu.set(mode, [...cpu.get(mode) ?? [], result.cpuMs]);
        const sum = counts.get(mode);
        counts.set(mode, sum === undefined ? result : { ...sum, tokens: sum.tokens + result.tokens, masks: sum.masks + result.masks,
          refused: sum.refused + result.refused, forced: sum.forced + result.forced });
      }
    }
    const decodeMs = median(decode);
    console.log(`vocab ${v.label}, batch ${String(batch).padStart(2)}: decode step ${decodeMs.toFixed(2)} ms (CPU ${median(decodeCpu).toFixed(2)} ms over its threads)`);
    for (const mode of CASES) {
      const wallMs = median(wall.get(mode)!);
      const cpuMs = median(cpu.get(mode)!);
      const c = counts.get(mode)!;
      const per = (n: number) => (n / c.tokens).toFixed(2);
      const us = (ms: number) => (ms * 1000 / batch).toFixed(1).padStart(6);
      const share = (ms: number) => (100 * ms / decodeMs).toFixed(1).padStart(5);
      console.log(`  vocab ${v.label.padEnd(15)} ${mode.padEnd(17)} grammar CPU ${us(cpuMs)} µs/token ${share(cpuMs)}%, `
        + `wall ${us(wallMs)} µs/token ${share(wallMs)}% of the decode step  `
        + `(per sampled token: ${per(c.masks)} masks, ${per(c.refused)} refused tries, +${per(c.forced)} forced tokens)`);
    }
  }
  v = undefined;
  collectGarbage();
}

// ---- jump-forward in the engine: B guided requests on the 110M model, off vs on

const jfBatch = Number(args['jf-batch']);
if (jfBatch > 0) {
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
