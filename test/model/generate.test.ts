import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { argmax } from '../../src/model/reference-math.ts';
import { generateReference, type GeneratedToken, sampleToken } from '../../src/model/generate.ts';
import { ReferenceModel } from '../../src/model/reference-forward.ts';
import { tinyConfig, tinyWeights } from './reference-tiny-model.ts';

const CONFIG = tinyConfig({ contextLength: 40 });
const PROMPT = [1, 5, 9];

function tinyModel(contextLength = CONFIG.contextLength): ReferenceModel {
  const config = { ...CONFIG, contextLength };
  return new ReferenceModel(config, tinyWeights(config, 21));
}

/** Greedy tokens by hand: one forward per token, argmax of each. */
function manualGreedy(model: ReferenceModel, prompt: number[], count: number): number[] {
  model.reset();
  let logits = model.forward(prompt, 0);
  const out: number[] = [];
  for (let i = 0; i < count; i++) {
    const token = argmax(logits, 0, logits.length);
    out.push(token);
    logits = model.forward([token], prompt.length + i);
  }
  return out;
}

describe('sampleToken', () => {
  it('picks the first token whose cumulative probability exceeds the uniform draw', () => {
    const logits = Float32Array.of(0, Math.log(3)); // probabilities 1/4 and 3/4 at temperature 1
    assert.equal(sampleToken(logits, 1, 0.24), 0);
    assert.equal(sampleToken(logits, 1, 0.26), 1);
    // Temperature 2 flattens to 1 : sqrt(3), so token 0 has 1 / (1 + sqrt 3) = 0.366.
    assert.equal(sampleToken(logits, 2, 0.36), 0);
    assert.equal(sampleToken(logits, 2, 0.37), 1);
    assert.equal(sampleToken(logits, 0, 0.01), 1, 'temperature 0 is argmax whatever the draw');
    assert.throws(() => sampleToken(logits, -1, 0.5), /temperature must be >= 0/);
  });
});

describe('generateReference', () => {
  it('greedy generation equals argmax after each forward, and reports each token as it comes', async () => {
    const model = tinyModel();
    const expected = manualGreedy(model, PROMPT, 12);
    let clock = 0;
    const seen: GeneratedToken[] = [];
    const result = await generateReference(model, PROMPT, {
      maxTokens: 12, onToken: (t) => seen.push(t), now: () => (clock += 10),
    });
    assert.deepEqual(result.tokenIds, expected);
    assert.equal(result.finishReason, 'length');
    assert.deepEqual(seen.map((t) => t.tokenId), expected);
    assert.deepEqual(seen.map((t) => t.index), expected.map((_, i) => i));
    assert.ok(seen.every((t, i) => i === 0 || t.elapsedMs > seen[i - 1]!.elapsedMs));
    assert.equal(result.timing.promptTokens, 3);
    assert.equal(result.timing.generatedTokens, 12);
    assert.equal(result.timing.prefillMs, 10); // one clock tick between start and the end of the prompt forward
    assert.equal(result.timing.totalMs, result.timing.prefillMs + result.timing.decodeMs);
  });

  it('stops before a stop id without emitting it', async () => {
    const model = tinyModel();
    const greedy = manualGreedy(model, PROMPT, 12);
    const stopAt = greedy.findIndex((t, i) => i > 0 && !greedy.slice(0, i).includes(t));
    assert.ok(stopAt > 0, 'the greedy run has a token not seen before it');
    const result = await generateReference(model, PROMPT, { maxTokens: 12, stopIds: [greedy[stopAt]!] });
    assert.deepEqual(result.tokenIds, greedy.slice(0, stopAt));
    assert.equal(result.finishReason, 'stop');
  });

  it('sampling is reproducible by seed and depends on it', async () => {
    const model = tinyModel();
    const sample = async (seed: number): Promise<number[]> =>
      (await generateReference(model, PROMPT, { maxTokens: 20, temperature: 5, seed })).tokenIds;
    const first = await sample(1);
    assert.deepEqual(await sample(1), first);
    assert.notDeepEqual(await sample(2), first);
    assert.notDeepEqual(first, manualGreedy(model, PROMPT, 20));
  });

  it('ends at the context length, on abort, and with maxTokens 0', async () => {
    // Prompt at positions 0..7 of a 10-position context: tokens sampled after positions 7, 8 and 9.
    const short = tinyModel(10);
    const atLimit = await generateReference(short, [1, 2, 3, 4, 5, 6, 7, 8], { maxTokens: 5 });
    assert.equal(atLimit.tokenIds.length, 3);
    assert.equal(atLimit.finishReason, 'length');

    const controller = new AbortController();
    const aborted = await generateReference(tinyModel(), PROMPT, {
      maxTokens: 10, signal: controller.signal, onToken: (t) => { if (t.index === 1) controller.abort(); },
    });
    assert.equal(aborted.tokenIds.length, 2);
    assert.equal(aborted.finishReason, 'abort');
    const before = await generateReference(tinyModel(), PROMPT, { maxTokens: 10, signal: AbortSignal.abort() });
    assert.deepEqual([before.tokenIds, before.finishReason], [[], 'abort']);

    assert.deepEqual((await generateReference(tinyModel(), PROMPT, { maxTokens: 0 })).tokenIds, []);
    await assert.rejects(generateReference(tinyModel(), [], { maxTokens: 1 }), /the prompt has no tokens/);
    await assert.rejects(generateReference(short, new Array(11).fill(1), { maxTokens: 1 }),
      /11 tokens, more than the model's context length 10/);
  });
});
