// --stream-interval's coalescing of a worker's outputs (src/engine/output-coalescer.ts), on the outputs of a real
// engine: what the coalesced stream carries, completion by completion, is what the step-by-step stream carried (tokens,
// text, logprobs, every step's facts, the end), only handed over a completion's first token at once and then N at a time.
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { OutputCoalescer } from '../../src/engine/output-coalescer.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest, type EngineStepFacts, type TokenLogprob } from '../../src/engine/types.ts';
import { loadModel } from '../../src/model/loader.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';
import { engineBackends } from '../helpers/backends.ts';
import { tinySyntheticModel } from '../helpers/cpu-model.ts';

interface Completion {
  tokens: number[];
  text: string;
  logprobs: TokenLogprob[];
  steps: EngineStepFacts[];
  finish?: string;
  completionTokens: number;
  /** Tokens of each output, with the step (number of core.step() calls so far) it was handed over in. */
  outputs: { tokens: number; step: number; finished: boolean }[];
}

function collect(into: Map<string, Completion>, outputs: readonly EngineOutput[], step: number): void {
  for (const o of outputs) {
    const key = `${o.requestId}/${o.index}`;
    let c = into.get(key);
    if (!c) into.set(key, c = { tokens: [], text: '', logprobs: [], steps: [], completionTokens: 0, outputs: [] });
    c.tokens.push(...o.newTokenIds);
    c.text += o.textDelta;
    c.logprobs.push(...(o.logprobs ?? []));
    c.steps.push(...(o.heldSteps ?? []), ...(o.step !== undefined ? [o.step] : []));
    c.completionTokens = o.usage.completionTokens;
    if (o.finishReason !== undefined) c.finish = o.finishReason;
    c.outputs.push({ tokens: o.newTokenIds.length, step, finished: o.finishReason !== undefined });
  }
}

/** Runs the requests on a fresh engine, each step's outputs through `coalescer` (none: as they come). */
async function run(requests: EngineRequest[], coalescer?: OutputCoalescer): Promise<Map<string, Completion>> {
  const loaded = await loadModel(tinySyntheticModel());
  const tokenizer = createTokenizer(loaded.tokenizerSource);
  const backend = engineBackends().at(-1)!.load(loaded.config, loaded.weights, { numBlocks: 128, blockSize: 16, dtype: 'f32' }, { threads: 1 });
  let clock = 0;
  const core = new EngineCore({ backend, tokenizer, maxNumSeqs: 8, maxNumBatchedTokens: 256, maxModelLen: 1024, now: () => clock++ });
  for (const request of requests) core.add(request);
  const completions = new Map<string, Completion>();
  for (let step = 1; core.hasWork; step++) {
    assert.ok(step < 500, 'the engine did not finish');
    const outputs = core.step();
    collect(completions, coalescer ? coalescer.take(outputs) : outputs, step);
  }
  if (coalescer) assert.equal(coalescer.holding, false, 'nothing is left held once every completion ended');
  return completions;
}

const request = (id: string, prompt: number[], maxTokens: number, extra: Partial<EngineRequest['sampling']> = {}): EngineRequest => ({
  id, promptTokenIds: prompt, priority: 0, arrivalMs: 0,
  sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens, ignoreEos: true, logprobs: 1, ...extra },
});

describe('stream interval: coalescing a worker\'s outputs', () => {
  test('each completion carries the same tokens, text, logprobs and steps; its first token at once, then 3 at a time', async () => {
    const requests = [
      request('a', [1, 450, 4996, 17354], 11),
      request('b', [1, 3118, 263], 7, { n: 2, temperature: 0.8, seed: 7 }),
      request('c', [1, 29871, 13], 1),
    ];
    const plain = await run(requests);
    const coalesced = await run(requests, new OutputCoalescer(3));
    assert.deepEqual([...coalesced.keys()].sort(), [...plain.keys()].sort());
    for (const [key, expected] of plain) {
      const got = coalesced.get(key)!;
      assert.deepEqual(got.tokens, expected.tokens, key);
      assert.equal(got.text, expected.text, key);
      assert.deepEqual(got.logprobs, expected.logprobs, key);
      assert.deepEqual(got.steps, expected.steps, `${key}: every step's facts, in order`);
      assert.equal(got.finish, expected.finish, key);
      assert.equal(got.completionTokens, expected.completionTokens, key);
      // The first token in the step that sampled it; after it, 3 tokens to an output but the last.
      assert.deepEqual(got.outputs[0], expected.outputs[0], `${key}: the first output goes out as it came`);
      const sizes = got.outputs.slice(1).map((o) => o.tokens);
      const rest = expected.tokens.length - got.outputs[0]!.tokens;
      const full = Math.floor(rest / 3);
      assert.deepEqual(sizes, [...Array(full).fill(3), ...(rest % 3 > 0 ? [rest % 3] : [])], `${key}: tokens per output after the first`);
      assert.equal(got.outputs.at(-1)!.finished, true, key);
      assert.equal(got.outputs.at(-1)!.step, expected.outputs.at(-1)!.step, `${key}: the end goes out in the step that reached it`);
    }
  });

  test('an interval of 1 hands every step\'s outputs over as they are', () => {
    const coalescer = new OutputCoalescer(1);
    const outputs = [output('r', 0, [5])];
    assert.equal(coalescer.take(outputs), outputs);
    assert.equal(coalescer.take(outputs), outputs);
  });

  test('a held completion without an output in a step (preempted, left out) is handed over in that step', () => {
    const coalescer = new OutputCoalescer(4);
    assert.equal(coalescer.take([output('r', 0, [1]), output('s', 0, [9])]).length, 2, 'first tokens at once');
    assert.deepEqual(coalescer.take([output('r', 0, [2]), output('s', 0, [10])]), []);
    const out = coalescer.take([output('s', 0, [11])]);
    assert.deepEqual(out.map((o) => [o.requestId, o.newTokenIds]), [['r', [2]]]);
    assert.equal(coalescer.holding, true, 's is still held');
    assert.deepEqual(coalescer.flushAll().map((o) => [o.requestId, o.newTokenIds]), [['s', [10, 11]]]);
  });

  test('an abort takes a request\'s held tokens out first, and its next completion starts over', () => {
    const coalescer = new OutputCoalescer(4);
    coalescer.take([output('r', 0, [1]), output('r', 1, [2])]);
    coalescer.take([output('r', 0, [3]), output('r', 1, [4]), output('q', 0, [7])]);
    assert.deepEqual(coalescer.flushRequest('r').map((o) => [o.index, o.newTokenIds]), [[0, [3]], [1, [4]]]);
    assert.deepEqual(coalescer.take([output('r', 0, [5])]).map((o) => o.newTokenIds), [[5]], 'a new request of that id: first token at once');
  });

  test('the interval is a whole number of at least 1', () => {
    for (const bad of [0, -1, 1.5, Number.NaN]) assert.throws(() => new OutputCoalescer(bad), /integer >= 1/);
  });
});

function output(requestId: string, index: number, tokens: number[]): EngineOutput {
  return {
    requestId, index, newTokenIds: tokens, textDelta: tokens.map(String).join(' '),
    usage: { promptTokens: 1, completionTokens: tokens.length, cachedTokens: 0 }, timestamps: { arrival: 0, prefillChunks: [] },
  };
}
