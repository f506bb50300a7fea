// Prompt logprobs (sampling.promptLogprobs) through the engine on a real model: every prompt token's logprob, best
// alternatives and rank against a float64 log-softmax of the reference forward pass's logits at every position;
// the same entries whatever the chunking, the row budget, the prefix cache or the other requests of the step; and
// on each completion's first output only.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { Sampler, SequenceSampler } from '../../src/engine/sampler.ts';
import { seededRandom } from '../../src/util/random.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest, type SamplingParams, type TokenLogprob } from '../../src/engine/types.ts';
import type { BackendFactory, ForwardBatch, ModelRunnerBackend } from '../../src/kernels/types.ts';
import { ReferenceModel } from '../../src/model/reference-forward.ts';
import { loadSharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { engineBackends } from '../helpers/backends.ts';

const MODEL = 'stories260K.gguf';
const PROMPTS = [
  'Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.',
  'The cat sat on the mat and looked at the big red ball.',
  'Tom and Sue went to the park. They saw a big tree and a small dog.',
];

interface CoreOptions {
  maxNumBatchedTokens?: number;
  maxPromptLogprobRows?: number;
  longPrefillTokenThreshold?: number;
  onForward?: (batch: ForwardBatch) => void;
  /** Told the rows of each call to the backend's prompt-logprob pass. */
  wrapPromptRows?: (rows: number) => void;
}

async function makeCore(backend: BackendFactory, options: CoreOptions = {}): Promise<EngineCore> {
  const { loaded, tokenizer } = await loadSharedModel(MODEL);
  const runner = backend.load(loaded.config, loaded.weights, { numBlocks: 256, blockSize: 16, dtype: 'f32' }, { threads: 1 });
  const watched: ModelRunnerBackend = options.onForward === undefined && options.wrapPromptRows === undefined ? runner : new Proxy(runner, {
    get: (target, key) => {
      const value: unknown = Reflect.get(target, key);
      if (key === 'forward' && options.onForward) {
        return (batch: ForwardBatch, out?: Float32Array) => (options.onForward!(batch), target.forward(batch, out));
      }
      if (key === 'promptLogprobRows' && options.wrapPromptRows && target.promptLogprobRows) {
        return (logits: Float32Array, rows: number, targets: Int32Array, out: Float64Array, best: Int32Array, numBest: number) => {
          options.wrapPromptRows!(rows);
          target.promptLogprobRows!(logits, rows, targets, out, best, numBest);
        };
      }
      return typeof value === 'function' ? value.bind(target) : value;
    },
  });
  let clock = 0;
  return new EngineCore({
    backend: watched, tokenizer, maxNumSeqs: 16, maxNumBatchedTokens: options.maxNumBatchedTokens ?? 256,
    maxModelLen: loaded.config.contextLength, now: () => clock++,
    ...(options.maxPromptLogprobRows !== undefined ? { maxPromptLogprobRows: options.maxPromptLogprobRows } : {}),
    ...(options.longPrefillTokenThreshold !== undefined ? { longPrefillTokenThreshold: options.longPrefillTokenThreshold } : {}),
  });
}

function request(id: string, prompt: number[], sampling: Partial<SamplingParams> = {}): EngineRequest {
  return { id, promptTokenIds: prompt, sampling: { ...DEFAULT_SAMPLING, maxTokens: 3, temperature: 0, ...sampling }, priority: 0, arrivalMs: 0 };
}

function runToEnd(core: EngineCore): EngineOutput[] {
  const outputs: EngineOutput[] = [];
  for (let step = 0; core.hasWork; step++) {
    outputs.push(...core.step());
    assert.ok(step < 10_000, 'engine did not finish');
  }
  assert.equal(core.stats().kvBlocksUsed, 0, 'every KV block is back in the pool');
  return outputs;
}

/** The prompt logprobs of one request's completion 0, from its outputs (exactly one of which carries them). */
function promptLogprobsOf(outputs: readonly EngineOutput[], requestId: string): (TokenLogprob | null)[] {
  const carrying = outputs.filter((o) => o.requestId === requestId && o.index === 0 && o.promptLogprobs !== undefined);
  assert.equal(carrying.length, 1, `${requestId}: one output carries the prompt logprobs`);
  return carrying[0]!.promptLogprobs!;
}

/** log-softmax of a logits row in float64. */
function logSoftmax(row: Float32Array): Float64Array {
  let max = -Infinity;
  for (const value of row) max = Math.max(max, value);
  let sum = 0;
  for (const value of row) sum += Math.exp(value - max);
  const lse = max + Math.log(sum);
  return Float64Array.from(row, (value) => value - lse);
}

for (const backend of engineBackends()) {
  describe(`prompt logprobs on ${backend.name}`, { skip: skipUnlessShared(MODEL) }, () => {
    // The reference backend runs the reference transformer's arithmetic; the native kernels round differently.
    const tolerance = backend.name === 'reference' ? 1e-5 : 2e-3;

    test('each prompt token\'s logprob, best alternatives and rank match the reference forward pass', async () => {
      const { loaded, tokenizer } = await loadSharedModel(MODEL);
      const reference = new ReferenceModel(loaded.config, loaded.weights);
      const vocabSize = loaded.config.vocabSize;
      const core = await makeCore(backend);
      const prompts = PROMPTS.map((text) => tokenizer.encode(text));
      prompts.forEach((ids, i) => core.add(request(`r${i}`, ids, { promptLogprobs: 4 })));
      const outputs = runToEnd(core);
      prompts.forEach((ids, i) => {
        const entries = promptLogprobsOf(outputs, `r${i}`);
        assert.equal(entries.length, ids.length);
        assert.equal(entries[0], null, 'the first prompt token has nothing before it');
        reference.reset();
        const logits = reference.forward(ids, 0, { allLogits: true });
        for (let p = 1; p < ids.length; p++) {
          const row = logits.subarray((p - 1) * vocabSize, p * vocabSize);
          const expected = logSoftmax(row);
          const entry = entries[p]!;
          const where = `prompt ${i} position ${p}`;
          assert.equal(entry.tokenId, ids[p], where);
          assert.ok(Math.abs(entry.logprob - expected[ids[p]!]!) <= tolerance, `${where}: ${entry.logprob} vs ${expected[ids[p]!]}`);
          // The rank counts the tokens above it; near-ties may order differently under other rounding.
          const value = row[ids[p]!]!;
          const surelyAbove = row.filter((x) => x > value + tolerance).length;
          const maybeAbove = row.filter((x) => x > value - tolerance).length;
          assert.ok(entry.rank! >= surelyAbove + 1 && entry.rank! <= maybeAbove, `${where}: rank ${entry.rank} not in [${surelyAbove + 1}, ${maybeAbove}]`);
          // The alternatives: 4 of them, best first, each at its own logprob, none beaten by a token left out.
          assert.equal(entry.top.length, 4, where);
          const sorted = Float64Array.from(expected).sort().reverse();
          entry.top.forEach((alt, k) => {
            assert.ok(Math.abs(alt.logprob - expected[alt.tokenId]!) <= tolerance, `${where}: alternative ${k}`);
            if (k > 0) assert.ok(alt.logprob <= entry.top[k - 1]!.logprob, `${where}: alternatives best first`);
            assert.ok(Math.abs(alt.logprob - sorted[k]!) <= 2 * tolerance, `${where}: alternative ${k} is the ${k + 1}th best`);
          });
        }
      });
    });

    test('the same entries in chunks sharing a small row budget, beside plain requests', async () => {
      const { tokenizer } = await loadSharedModel(MODEL);
      const prompts = PROMPTS.map((text) => tokenizer.encode(text));
      const whole = await makeCore(backend);
      prompts.forEach((ids, i) => whole.add(request(`r${i}`, ids, { promptLogprobs: 2 })));
      const expected = runToEnd(whole);

      let largestStep = 0;
      const chunked = await makeCore(backend, {
        maxNumBatchedTokens: 24, maxPromptLogprobRows: 5,
        onForward: (batch) => { largestStep = Math.max(largestStep, batch.logitsIndices.length); },
      });
      prompts.forEach((ids, i) => {
        chunked.add(request(`plain${i}`, ids, { maxTokens: 4 }));
        chunked.add(request(`r${i}`, ids, { promptLogprobs: 2 }));
      });
      const outputs = runToEnd(chunked);
      // At most 5 prompt rows beside one sampled row per request.
      assert.ok(largestStep <= 5 + 2 * prompts.length, `a step returned ${largestStep} logits rows`);
      prompts.forEach((_, i) => {
        const got = promptLogprobsOf(outputs, `r${i}`);
        const want = promptLogprobsOf(expected, `r${i}`);
        assert.equal(got.length, want.length, `prompt ${i}: one entry per prompt position`);
        got.forEach((entry, p) => {
          if (p === 0) return assert.equal(entry, null);
          assert.equal(entry!.tokenId, want[p]!.tokenId);
          assert.equal(entry!.rank, want[p]!.rank, `prompt ${i} position ${p}`);
          assert.ok(Math.abs(entry!.logprob - want[p]!.logprob) <= tolerance, `prompt ${i} position ${p}`);
          assert.deepEqual(entry!.top.map((t) => t.tokenId), want[p]!.top.map((t) => t.tokenId));
        });
      });
    });

    test('a cached prompt is computed whole for its logprobs, and its blocks then serve others', async () => {
      const { tokenizer } = await loadSharedModel(MODEL);
      const ids = tokenizer.encode(PROMPTS[0]!);
      const fresh = await makeCore(backend);
      fresh.add(request('scored', ids, { promptLogprobs: 0 }));
      const expected = promptLogprobsOf(runToEnd(fresh), 'scored');

      const core = await makeCore(backend);
      core.add(request('warm', ids));
      runToEnd(core);
      core.add(request('scored', ids, { promptLogprobs: 0 }));
      const outputs = runToEnd(core);
      const scored = promptLogprobsOf(outputs, 'scored');
      assert.equal(outputs.find((o) => o.requestId === 'scored')!.usage.cachedTokens, 0);
      assert.deepEqual(scored.map((e) => e?.tokenId ?? null), expected.map((e) => e?.tokenId ?? null));
      scored.forEach((entry, p) => { if (p > 0) assert.ok(Math.abs(entry!.logprob - expected[p]!.logprob) <= tolerance); });
      core.add(request('after', ids));
      assert.ok(runToEnd(core).find((o) => o.requestId === 'after')!.usage.cachedTokens > 0, 'the prompt stays cached');
    });

    test('n = 3: each completion\'s first output carries the prompt\'s entries, no later one does', async () => {
      const { tokenizer } = await loadSharedModel(MODEL);
      const ids = tokenizer.encode(PROMPTS[1]!);
      const core = await makeCore(backend);
      core.add(request('n3', ids, { promptLogprobs: 1, n: 3, temperature: 1, seed: 5, maxTokens: 4, ignoreEos: true }));
      const outputs = runToEnd(core);
      for (let index = 0; index < 3; index++) {
        const mine = outputs.filter((o) => o.index === index);
        assert.ok(mine.length > 1);
        assert.equal(mine[0]!.promptLogprobs?.length, ids.length, `completion ${index}'s first output`);
        assert.ok(mine.slice(1).every((o) => o.promptLogprobs === undefined), `completion ${index}'s later outputs`);
      }
    });

    test('a request with prompt logprobs is not prefilled for another worker', async () => {
      const { tokenizer } = await loadSharedModel(MODEL);
      const core = await makeCore(backend);
      assert.throws(() => core.add(request('h', tokenizer.encode('Hi'), { promptLogprobs: 0 }), { handoff: true }),
        /cannot be prefilled for another worker/);
      assert.equal(core.hasWork, false);
    });
  });
}

describe('prompt logprobs: the backend\'s pass over many rows', () => {
  const native = engineBackends().find((backend) => backend.name === 'native');

  test('gives the sampler\'s entries bit for bit, a row at a time or many at once, and reports the rows it declines',
    { skip: native === undefined ? 'the native addon is not built' : skipUnlessShared(MODEL) }, async () => {
      const { loaded } = await loadSharedModel(MODEL);
      const runner = native!.load(loaded.config, loaded.weights, { numBlocks: 8, blockSize: 16, dtype: 'f32' }, { threads: 2 });
      const v = loaded.config.vocabSize;
      const withPass = new Sampler(v, {
        argmax: (row) => runner.argmax!(row), weigh: (...a) => runner.sampleWeigh!(...a),
        promptRows: (...a) => runner.promptLogprobRows!(...a),
      });
      const plain = new Sampler(v);
      const random = seededRandom(3);
      for (const rows of [1, 2, 7, 33]) {
        // Values on a coarse grid (ties), some masked, one row whose best values are all tied.
        const logits = Float32Array.from({ length: rows * v }, () => random() < 0.05 ? -Infinity : Math.round((random() - 0.5) * 40) / 4);
        logits.fill(3, 0, 5);
        const targets = Array.from({ length: rows }, () => Math.floor(random() * v));
        const numTops = Array.from({ length: rows }, (_, r) => [0, 1, 2, 5, 20][r % 5]!);
        const expected = targets.map((t, r) => plain.promptLogprob(logits.subarray(r * v, (r + 1) * v), t, numTops[r]!));
        assert.deepEqual(withPass.promptLogprobRows(logits, targets, numTops), expected, `${rows} rows`);
        assert.deepEqual(plain.promptLogprobRows(logits, targets, numTops), expected, `${rows} rows without the pass`);
      }
      const masked = new Float32Array(2 * v).fill(-Infinity);
      masked.fill(0.5, v);
      assert.throws(() => withPass.promptLogprobRows(masked, [1, 1], [0, 0]), /every token is masked/);
      const nan = new Float32Array(v).fill(1);
      nan[9] = NaN;
      assert.throws(() => withPass.promptLogprobRows(nan, [1], [0]), /NaN at token id 9/);
      const none = new Int32Array(0);
      assert.throws(() => runner.promptLogprobRows!(nan, 1, Int32Array.of(v), new Float64Array(3), none, 0), /outside the vocabulary/);
      assert.throws(() => runner.promptLogprobRows!(nan, 2, Int32Array.of(1, 1), new Float64Array(6), none, 0), /logits/);
      assert.throws(() => runner.promptLogprobRows!(nan, 1, Int32Array.of(1), new Float64Array(3), new Int32Array(2), 3), /best/);
      assert.throws(() => runner.promptLogprobRows!(nan, 1, Int32Array.of(1), new Float64Array(3), new Int32Array(v + 1), v + 1), /numBest/);
    });

  test('names its rows (rowIds): entry r is of row rowIds[r], and the sampled tokens\' logprobs of a batch are the sampler\'s row by row',
    { skip: native === undefined ? 'the native addon is not built' : skipUnlessShared(MODEL) }, async () => {
      const { loaded } = await loadSharedModel(MODEL);
      const runner = native!.load(loaded.config, loaded.weights, { numBlocks: 8, blockSize: 16, dtype: 'f32' }, { threads: 2 });
      const v = loaded.config.vocabSize;
      const random = seededRandom(5);
      const rows = 12;
      const logits = Float32Array.from({ length: rows * v }, () => random() < 0.05 ? -Infinity : Math.round((random() - 0.5) * 40) / 4);
      // Some rows, out of order, one twice.
      const rowIds = Int32Array.of(7, 0, 11, 3, 7);
      const targets = Int32Array.from(rowIds, () => Math.floor(random() * v));
      const out = new Float64Array(3 * rowIds.length);
      const best = new Int32Array(4 * rowIds.length);
      runner.promptLogprobRows!(logits, rowIds.length, targets, out, best, 4, rowIds);
      rowIds.forEach((row, r) => {
        const alone = new Float64Array(3);
        const aloneBest = new Int32Array(4);
        runner.promptLogprobRows!(logits.subarray(row * v, (row + 1) * v), 1, targets.subarray(r, r + 1), alone, aloneBest, 4);
        assert.deepEqual([...out.subarray(3 * r, 3 * r + 3)], [...alone], `entry ${r} (row ${row})`);
        assert.deepEqual([...best.subarray(4 * r, 4 * r + 4)], [...aloneBest], `entry ${r}'s best ids`);
      });
      const three = new Float32Array(3 * v).fill(1);
      assert.throws(() => runner.promptLogprobRows!(three, 1, Int32Array.of(1), new Float64Array(3), best, 0, Int32Array.of(-1)), /negative/);
      assert.throws(() => runner.promptLogprobRows!(three, 1, Int32Array.of(1), new Float64Array(3), best, 0, Int32Array.of(3)), /logits/);
      assert.throws(() => runner.promptLogprobRows!(three, 2, Int32Array.of(1, 1), new Float64Array(6), best, 0, Int32Array.of(0)), /rowIds/);

      // A batch of rows with logprobs (greedy, drawn, with a penalty, more alternatives than the pass gives) beside
      // rows without: the same tokens and entries as a sampler with no backend passes gives row by row.
      const kinds: Partial<SamplingParams>[] = [
        { temperature: 0, logprobs: 0 }, { temperature: 0, logprobs: 3 }, { temperature: 1, logprobs: 1 },
        { temperature: 0.8, topP: 0.9, logprobs: 5 }, { temperature: 0.9, topK: 7, logprobs: 2 },
        { temperature: 0.9, repetitionPenalty: 1.3, logprobs: 2 }, { temperature: 0.7 }, { temperature: 0 },
        { temperature: 0.7, logprobs: 70 }, { temperature: 0, minP: 0.1, logprobs: 0 }, { temperature: 1.2, minP: 0.05, logprobs: 4 },
        { temperature: 0.5, topP: 0.3 },
      ];
      const sequences = () => kinds.map((overrides, i) => new SequenceSampler({
        params: { ...DEFAULT_SAMPLING, ...overrides }, promptTokenIds: [1, 2, 3], vocabSize: v, eosTokenIds: [],
        requestSeed: 40 + i, completionIndex: 0,
      }));
      let passRows = 0;
      const batched = new Sampler(v, {
        argmax: (row) => runner.argmax!(row), weigh: (...a) => runner.sampleWeigh!(...a),
        promptRows: (...a) => {
          passRows += a[1];
          runner.promptLogprobRows!(...a);
        },
        drawRows: (...a) => runner.sampleRows!(...a),
      });
      const plain = new Sampler(v);
      const [a, b] = [sequences(), sequences()];
      for (let step = 0; step < 3; step++) {
        const expected = b.map((sequence, r) => plain.sampleRow(logits.subarray(r * v, (r + 1) * v), sequence));
        assert.deepEqual(batched.sampleBatch(logits, a), expected, `step ${step}`);
      }
      assert.equal(passRows, 3 * kinds.filter((k) => k.logprobs !== undefined).length, 'every row with logprobs went through the pass');
    });

  test('EngineCore hands a step\'s prompt rows to the backend\'s pass in one call', { skip: native === undefined ? 'the native addon is not built' : skipUnlessShared(MODEL) }, async () => {
    const { tokenizer } = await loadSharedModel(MODEL);
    const calls: number[] = [];
    const core = await makeCore(native!, { wrapPromptRows: (rows) => calls.push(rows) });
    const ids = tokenizer.encode(PROMPTS[0]!);
    core.add(request('r', ids, { promptLogprobs: 1 }));
    const outputs = runToEnd(core);
    assert.deepEqual(calls, [ids.length - 1]);
    assert.equal(promptLogprobsOf(outputs, 'r').length, ids.length);
  });
});
