// Jump-forward decoding on a small synthetic model (Llama 2 vocabulary, noise text), turned on here as a worker does
// with --guided-jump-forward (it is off by default): text the grammar forces is appended as tokens without sampling
// and computed in the next step with the sampled token; the output still follows the grammar, in fewer steps.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { GrammarRuntime } from '../../src/engine/grammar/runtime.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type GuidedDecoding, type SamplingParams } from '../../src/engine/types.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { createTokenizer, type Tokenizer } from '../../src/model/tokenizer/index.ts';
import { engineBackends } from '../helpers/backends.ts';
import { assertPerson, PERSON_SCHEMA } from '../api/guided-fixtures.ts';

const SPEC = {
  name: 'jump-forward-synthetic', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 512,
  dtype: 'Q8_0' as const, seed: 5, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
};

describe('jump-forward decoding', () => {
  let dir: string;
  let loaded: LoadedModel;
  let tokenizer: Tokenizer;
  let grammar: GrammarRuntime;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-jump-forward-'));
    writeSyntheticModel(SPEC, join(dir, 'model.gguf'));
    loaded = await loadModel(join(dir, 'model.gguf'));
    tokenizer = createTokenizer(loaded.tokenizerSource);
    grammar = await GrammarRuntime.create(tokenizer, loaded.config.vocabSize);
  });
  after(() => {
    rmSync(dir, { recursive: true, force: true });
  });

  /** Runs one guided request alone; its text, finish reason, the steps it took and the tokens appended unsampled. */
  function run(guided: GuidedDecoding, sampling: Partial<SamplingParams>, jumpForward: boolean) {
    const runner = engineBackends().at(-1)!.load(loaded.config, loaded.weights, { numBlocks: 128, blockSize: 16, dtype: 'f32' }, { threads: 1 });
    let clock = 0;
    const core = new EngineCore({
      backend: runner, tokenizer, maxNumSeqs: 4, maxNumBatchedTokens: 256, maxModelLen: SPEC.contextLength,
      now: () => clock++, grammar: () => grammar, jumpForward,
    });
    core.add({ id: 'r', promptTokenIds: tokenizer.encode('Describe a person.'), priority: 0, arrivalMs: 0,
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 300, ...sampling, guided } });
    let text = '';
    let finish: string | undefined;
    let stopReason: string | number | undefined;
    let tokens = 0;
    let steps = 0;
    let usage: EngineOutput['usage'] | undefined;
    for (; core.hasWork; steps++) {
      assert.ok(steps < 1000, 'the engine did not finish');
      for (const output of core.step() as EngineOutput[]) {
        text += output.textDelta;
        tokens += output.newTokenIds.length;
        finish = output.finishReason ?? finish;
        stopReason = output.stopReason ?? stopReason;
        usage = output.usage;
      }
    }
    assert.equal(core.kv.pool.numUsedBlocks, 0);
    // The engine's own count of output tokens is the tokens it gave out.
    assert.equal(usage?.completionTokens, tokens);
    runner.dispose();
    return { text, finish, stopReason, steps, tokens, forced: core.forcedTokens };
  }

  it('json_schema: valid documents fitting the schema, with forced tokens appended and fewer steps', () => {
    const guided: GuidedDecoding = { kind: 'json_schema', schema: JSON.stringify(PERSON_SCHEMA) };
    for (const sampling of [{ temperature: 0 }, { temperature: 1, seed: 3 }, { temperature: 0.7, seed: 4 }]) {
      const plain = run(guided, sampling, false);
      const jumped = run(guided, sampling, true);
      for (const result of [plain, jumped]) {
        assert.equal(result.finish, 'stop', `${JSON.stringify(sampling)}: ${result.text}`);
        assertPerson(JSON.parse(result.text));
      }
      assert.equal(plain.forced, 0);
      assert.ok(jumped.forced > 0, `${JSON.stringify(sampling)}: nothing forced in ${jumped.text}`);
      // One step per sampled token (the prompt's step samples the first); forced ones ride along.
      assert.equal(plain.steps, plain.tokens);
      assert.equal(jumped.steps, jumped.tokens - jumped.forced);
    }
  });

  it('compact JSON (no free whitespace): most of the structure is forced', () => {
    const guided: GuidedDecoding = { kind: 'json_schema', schema: JSON.stringify(PERSON_SCHEMA), compact: true };
    for (const sampling of [{ temperature: 0 }, { temperature: 1, seed: 7 }]) {
      const result = run(guided, sampling, true);
      assert.equal(result.finish, 'stop', result.text);
      assertPerson(JSON.parse(result.text));
      assert.ok(result.forced >= result.tokens / 4, `${result.forced} forced of ${result.tokens}: ${result.text}`);
      assert.equal(result.steps, result.tokens - result.forced);
    }
  });

  it('a choice: after the first token the rest of the only choice left is forced (but its last piece)', () => {
    const choice = 'the quick brown fox jumps over the lazy dog';
    const result = run({ kind: 'choice', choices: [choice] }, { temperature: 0 }, true);
    assert.equal(result.text, choice);
    assert.equal(result.finish, 'stop');
    // The first token, then the forced run (all but its last piece), then that piece (one or a few tokens), then EOS.
    assert.ok(result.forced >= 5, `${result.forced} forced of ${result.tokens}`);
    assert.equal(result.steps, result.tokens - result.forced);
    assert.ok(result.steps <= 6, `${result.steps} steps`);
  });

  it('a stop string inside the forced run ends the output at the token completing it; the rest is not output', () => {
    const choice = 'the quick brown fox jumps over the lazy dog';
    const whole = run({ kind: 'choice', choices: [choice] }, { temperature: 0 }, true);
    const stopped = run({ kind: 'choice', choices: [choice] }, { temperature: 0, stop: ['fox'] }, true);
    assert.equal(stopped.text, 'the quick brown ');
    assert.equal(stopped.finish, 'stop');
    assert.equal(stopped.stopReason, 'fox');
    // The same run of tokens, cut after the one that completes "fox" (run() checks usage against the tokens out).
    assert.ok(stopped.tokens >= 3 && stopped.tokens < whole.tokens - 2, `${stopped.tokens} of ${whole.tokens} tokens`);
    assert.equal(stopped.steps, 1, 'the stop string is in the first step\'s forced run');
    assert.equal(stopped.forced, stopped.tokens - 1);
  });
});
