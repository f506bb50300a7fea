// Sampling cost per logits row: what the engine's Sampler spends on one row of a 32000-token vocabulary for each
// kind of request, next to plain-loop versions of the same sampling run in the same process on the same rows.
//
//   node --import tsx benchmarks/sampler.ts [--vocab 32000] [--rows 256] [--passes 9] [--sampler-module <path>]
//
// Cases (temperature 0.8 unless greedy):
//   greedy         temperature 0: argmax
//   temperature    a draw over the whole vocabulary
//   top-k 50       a draw over the 50 best
//   top-p 0.9      a draw over the smallest set holding 90% of the mass
//   logprobs 5     the temperature draw, then the chosen token's logprob and the 5 best (OpenAI's logprobs)
//   penalties      repetition 1.1, frequency 0.5, presence 0.5 over a 512-token prompt and the tokens drawn so far,
//                  plus a 10-token logit_bias, then top-p 0.95
// The plain loops copy the row, apply the same processing, then take an argmax, or a softmax and a draw, sorting
// every candidate by logit for top-k / top-p (and for logprobs, a softmax of the raw row and a sort for its best):
// what a first straightforward sampler does. "read pass" is one loop that only reads every value of the row (a max),
// the floor any sampler pays.
//
// Rows are seeded pseudo-random logits (std 3, a few peaks), the same for every case and pass. Each number is the
// median over passes of (CPU time to sample every row) / rows, in µs (the plain loops, far slower, time 24 rows). --sampler-module loads another Sampler
// implementation (e.g. a copy of an earlier revision's src/engine/sampler.ts) to compare against in the same run.
// With the native addon: a "native" column (the Sampler given the addon's argmax, weighing pass and scaled copy, as EngineCore
// gives it the native backend's), and the weighing pass alone (weighCandidates and ops.sampleWeigh per variant).

import { pathToFileURL } from 'node:url';
import { DEFAULT_SAMPLING, type SamplingParams } from '../src/engine/types.ts';
import * as ours from '../src/engine/sampler.ts';
import { supportedVariants, tryLoadNativeAddon } from '../src/kernels/native.ts';
import { seededRandom as seededUniform } from '../src/util/random.ts';

function argument(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at >= 0 ? process.argv[at + 1]! : fallback;
}

const VOCAB = Number(argument('vocab', '32000'));
const ROWS = Number(argument('rows', '256'));
const PASSES = Number(argument('passes', '9'));
const PLAIN_ROWS = 24;
const OTHER_MODULE = process.argv.includes('--sampler-module') ? argument('sampler-module', '') : undefined;

type SamplerModule = typeof ours;

// ---------------------------------------------------------------------------------------------------------------
// Rows

const uniform = seededUniform(7);
const logits = new Float32Array(ROWS * VOCAB);
for (let i = 0; i < logits.length; i++) logits[i] = (uniform() + uniform() + uniform() + uniform() - 2) * Math.sqrt(3) * 3;
for (let row = 0; row < ROWS; row++) {
  for (let peak = 0; peak < 4; peak++) logits[row * VOCAB + Math.floor(uniform() * VOCAB)] = 12 + 2 * uniform();
}
const prompt = Array.from({ length: 512 }, () => Math.floor(uniform() * VOCAB));
const bias = new Map(Array.from({ length: 10 }, (_, i) => [Math.floor(uniform() * VOCAB), i % 2 === 0 ? 2 : -5] as [number, number]));

// ---------------------------------------------------------------------------------------------------------------
// Cases

interface Case {
  name: string;
  params: SamplingParams;
}

const base: SamplingParams = { ...DEFAULT_SAMPLING, temperature: 0.8, seed: 1, maxTokens: 1 << 20, ignoreEos: true };
const CASES: Case[] = [
  { name: 'greedy', params: { ...base, temperature: 0 } },
  { name: 'temperature', params: base },
  { name: 'top-k 50', params: { ...base, topK: 50 } },
  { name: 'top-p 0.9', params: { ...base, topP: 0.9 } },
  { name: 'logprobs 5', params: { ...base, logprobs: 5 } },
  {
    name: 'penalties', params: {
      ...base, topP: 0.95, repetitionPenalty: 1.1, frequencyPenalty: 0.5, presencePenalty: 0.5, logitBias: bias,
    },
  },
];

interface Contender {
  sampleRow: (row: Float32Array) => number;
  rows: number;
}

/**
 * CPU µs per row of each contender over its first `rows` rows, median of PASSES passes after one warm-up pass.
 * The contenders take turns pass by pass, so a busy spell on a shared machine slows them alike rather than whichever
 * ran then; CPU time, not wall time, so time spent waiting for a core is not counted.
 */
function timeRows(contenders: readonly Contender[]): number[] {
  const perRow = contenders.map(() => [] as number[]);
  let sink = 0;
  for (let pass = 0; pass <= PASSES; pass++) {
    contenders.forEach(({ sampleRow, rows }, c) => {
      const start = process.cpuUsage();
      for (let row = 0; row < rows; row++) sink += sampleRow(logits.subarray(row * VOCAB, (row + 1) * VOCAB));
      const used = process.cpuUsage(start);
      if (pass > 0) perRow[c]!.push((used.user + used.system) / rows);
    });
  }
  if (sink === -1 || logprobSink === -1) console.log('unreachable');
  return perRow.map((samples) => samples.sort((a, b) => a - b)[samples.length >> 1]!);
}

/**
 * The native backend's passes the engine gives its Sampler (EngineCore: ModelRunnerBackend.argmax, sampleWeigh and scaleRow),
 * here the addon's kernels of the CPU's best variant; undefined without the addon.
 */
const addon = tryLoadNativeAddon();
const nativeOptions: ours.SamplerOptions | undefined = addon === undefined ? undefined : (() => {
  const variant = addon.cpuInfo().bestVariant;
  return {
    argmax: (row: Float32Array) => addon.ops.argmax(variant, row),
    weigh: (...args: Parameters<ours.WeighCandidates>) => addon.ops.sampleWeigh(variant, ...args),
    scale: (...args: Parameters<ours.ScaleRow>) => addon.ops.scaleRow(variant, ...args),
  };
})();

function samplerContender(module: SamplerModule, params: SamplingParams, options?: ours.SamplerOptions): Contender {
  const sampler = new module.Sampler(VOCAB, options);
  const [sequence] = module.createRequestSamplers({ params, promptTokenIds: prompt, vocabSize: VOCAB, eosTokenIds: [2] });
  return { sampleRow: (row) => sampler.sampleRow(row, sequence!).tokenId, rows: ROWS };
}

// ---------------------------------------------------------------------------------------------------------------
// The plain loops

/** What the plain loops' logprobs add up to (kept, so the work is not optimized away). */
let logprobSink = 0;

/** A straightforward sampler: copy, process, then argmax or softmax + draw, with full sorts for top-k / top-p. */
function plainSampler(params: SamplingParams): (row: Float32Array) => number {
  const counts = new Map<number, number>();
  const promptSet = new Set(prompt);
  const random = seededUniform(3);
  return (row) => {
    const values = Array.from(row);
    if (params.logitBias) for (const [id, b] of params.logitBias) values[id]! += b;
    if (params.repetitionPenalty !== 1) {
      for (const id of new Set([...promptSet, ...counts.keys()])) {
        values[id] = values[id]! > 0 ? values[id]! / params.repetitionPenalty : values[id]! * params.repetitionPenalty;
      }
    }
    for (const [id, count] of counts) values[id]! -= params.frequencyPenalty * count + params.presencePenalty;
    let chosen: number;
    if (params.temperature === 0) {
      chosen = 0;
      for (let i = 1; i < values.length; i++) if (values[i]! > values[chosen]!) chosen = i;
    } else {
      const scaled = values.map((v) => v / params.temperature);
      let ids = scaled.map((_, i) => i);
      if (params.topK > 0 || params.topP < 1) ids.sort((a, b) => scaled[b]! - scaled[a]! || a - b);
      if (params.topK > 0) ids = ids.slice(0, params.topK);
      const max = Math.max(...ids.map((i) => scaled[i]!));
      let probs = ids.map((i) => Math.exp(scaled[i]! - max));
      let total = probs.reduce((a, b) => a + b, 0);
      if (params.topP < 1) {
        let kept = 0;
        let mass = 0;
        while (kept < probs.length && mass < params.topP * total) mass += probs[kept++]!;
        ids = ids.slice(0, kept);
        probs = probs.slice(0, kept);
        total = mass;
      }
      const target = random() * total;
      let cumulative = 0;
      chosen = ids[ids.length - 1]!;
      for (let j = 0; j < ids.length; j++) {
        cumulative += probs[j]!;
        if (cumulative > target) {
          chosen = ids[j]!;
          break;
        }
      }
    }
    if (params.logprobs !== null) {
      // The raw row's log-softmax at the chosen token and its best ids, by a full sort.
      const max = Math.max(...row);
      let sum = 0;
      for (const value of row) sum += Math.exp(value - max);
      const normaliser = max + Math.log(sum);
      const ranked = Array.from(row.keys()).sort((a, b) => row[b]! - row[a]! || a - b).slice(0, params.logprobs);
      logprobSink += row[chosen]! - normaliser + ranked[0]!;
    }
    counts.set(chosen, (counts.get(chosen) ?? 0) + 1);
    return chosen;
  };
}

function readPass(row: Float32Array): number {
  let max = -Infinity;
  for (let i = 0; i < row.length; i++) if (row[i]! > max) max = row[i]!;
  return max;
}

// ---------------------------------------------------------------------------------------------------------------

const other: SamplerModule | undefined = OTHER_MODULE
  ? await import(pathToFileURL(OTHER_MODULE).href) as SamplerModule : undefined;

console.log(`sampling one row of ${VOCAB} logits, µs per row (median of ${PASSES} passes over ${ROWS} rows)`);
console.log(`read pass (one loop reading the row): ${timeRows([{ sampleRow: readPass, rows: ROWS }])[0]!.toFixed(1)} µs`);
if (nativeOptions) console.log(`native: the Sampler with the addon's argmax, weighing pass and scaled copy (${addon!.cpuInfo().bestVariant}), as the engine runs it on the native backend`);
const header = ['case', 'Sampler', ...(nativeOptions ? ['native', 'JS / native'] : []), ...(other ? ['--sampler-module'] : []), 'plain loop', 'plain / Sampler'];
const widths = [12, 9, ...(nativeOptions ? [8, 12] : []), ...(other ? [17] : []), 11, 16];
console.log(header.map((h, i) => (i === 0 ? h.padEnd(widths[i]!) : h.padStart(widths[i]!))).join('  '));
for (const { name, params } of CASES) {
  // The plain loops take milliseconds per row: fewer rows keep the run short.
  const times = timeRows([
    samplerContender(ours, params), { sampleRow: plainSampler(params), rows: Math.min(ROWS, PLAIN_ROWS) },
    ...(nativeOptions ? [samplerContender(ours, params, nativeOptions)] : []),
    ...(other ? [samplerContender(other, params)] : []),
  ]);
  const [mine, plain] = times as [number, number];
  const withNative = nativeOptions ? times[2]! : NaN;
  const theirs = other ? times[nativeOptions ? 3 : 2] : undefined;
  const cells = [name, mine.toFixed(1), ...(nativeOptions ? [withNative.toFixed(1), `${(mine / withNative).toFixed(1)}x`] : []),
    ...(theirs !== undefined ? [theirs.toFixed(1)] : []), plain.toFixed(1), `${(plain / mine).toFixed(1)}x`];
  console.log(cells.map((c, i) => (i === 0 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!))).join('  '));
}

// The weighing pass alone (a draw over the whole row weighs every token: exp, the blocks' totals; top_p also bins
// them), on rows as the Sampler's temperature case scales them: JavaScript's, and that of each variant the CPU runs.
{
  const scale = 1 / base.temperature;
  const weights = new Float64Array(VOCAB), blockTotals = new Float64Array(VOCAB);
  const binMass = new Float64Array(ours.MASS_BINS), binCount = new Int32Array(ours.MASS_BINS), last = new Int32Array(1);
  // Each row's scaled max, found once: timeRows hands the rows over in order, pass after pass.
  const maxima = Array.from({ length: ROWS }, (_, r) => {
    let max = -Infinity;
    for (let i = r * VOCAB; i < (r + 1) * VOCAB; i++) if (logits[i]! > max) max = logits[i]!;
    return Math.fround(max * scale);
  });
  const variantsHere = addon ? supportedVariants(addon.cpuInfo()).filter((v) => ['generic', 'avx2', 'avx512'].includes(v)) : [];
  const passes: [string, ours.WeighCandidates][] = [['JavaScript', ours.weighCandidates],
    ...variantsHere.map((variant) => [variant, (...args: Parameters<ours.WeighCandidates>) => addon!.ops.sampleWeigh(variant, ...args)] as [string, ours.WeighCandidates])];
  const contender = (weigh: ours.WeighCandidates, bins: boolean): Contender => {
    let next = 0;
    return {
      rows: ROWS,
      sampleRow: (row) => {
        const max = maxima[next]!;
        next = (next + 1) % ROWS;
        return weigh(row, scale, max, -Infinity, weights, bins ? null : blockTotals, bins ? binMass : null, bins ? binCount : null, last);
      },
    };
  };
  const plainTimes = timeRows(passes.map(([, weigh]) => contender(weigh, false)));
  const binnedTimes = timeRows(passes.map(([, weigh]) => contender(weigh, true)));
  console.log(`\nthe weighing pass alone, µs per row (each value read at 1/T = ${scale.toFixed(3)} in the pass):`);
  for (const [i, [name]] of passes.entries()) {
    console.log(`  ${name.padEnd(10)}  weights and block totals ${plainTimes[i]!.toFixed(1).padStart(6)}   with top_p's bins ${binnedTimes[i]!.toFixed(1).padStart(6)}`);
  }
}
