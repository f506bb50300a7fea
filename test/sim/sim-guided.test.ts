// Guided requests on a simulated worker that takes over a migrated request: the worker advances the grammar over the
// output the lost worker produced (priorOutputTokenIds), as a cpu worker does, so the whole output is one match.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineRequest, type SamplingParams } from '../../src/engine/types.ts';
import { simPool } from '../../src/runtime/worker-pool.ts';
import { collect, text, tokens } from '../helpers/outputs.ts';

const GUIDED = { kind: 'regex', pattern: '[a-z]{60}\\.' } as const;
const PROMPT = Array.from({ length: 24 }, (_, i) => 300 + i * 37);

function request(id: string, sampling: Partial<SamplingParams>, extra: Partial<EngineRequest> = {}): EngineRequest {
  return {
    id, promptTokenIds: PROMPT, priority: 0, arrivalMs: engineNow(),
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 200, seed: 7, guided: GUIDED, ...sampling }, ...extra,
  };
}

describe('a guided request migrated to a simulated worker', () => {
  test('the new worker goes on under the grammar from the output so far: prior output + its own is one match', async () => {
    const sim = simPool({ sim: { model: 'llama-3.1-8b', gpu: 'h100-sxm', tp: 1, speedUp: Infinity } });
    const engine = sim.make({ enableKvEvents: false });
    try {
      const whole = await collect(engine.generate(request('whole', {})));
      assert.match(text(whole), /^[a-z]{60}\.$/, 'an uninterrupted run is one match');
      const prior = tokens(whole).slice(0, 6);
      const priorText = sim.tokenizer.decode(prior);
      assert.ok(priorText.length >= 6 && priorText.length < 60, `the first worker's output so far: ${JSON.stringify(priorText)}`);

      // What RequestMigration sends the new worker: the output so far appended to the prompt and named as such.
      const rest = await collect(engine.generate(request('moved', { maxTokens: 200 - prior.length }, {
        promptTokenIds: [...PROMPT, ...prior], priorOutputTokenIds: prior,
      })));
      assert.equal(rest.at(-1)!.finishReason, 'stop', 'the grammar ended the output');
      const all = sim.tokenizer.decode([...prior, ...tokens(rest)]);
      assert.match(all, /^[a-z]{60}\.$/, `one match across the migration: ${JSON.stringify(all)}`);

      // An output so far that the grammar does not allow is refused, and the worker serves on.
      const digits = sim.tokenizer.encode('123', { addSpecialTokens: false });
      await assert.rejects(collect(engine.generate(request('bad', {}, {
        promptTokenIds: [...PROMPT, ...digits], priorOutputTokenIds: digits,
      }))), /does not follow the request's grammar/);
      assert.match(text(await collect(engine.generate(request('after', {})))), /^[a-z]{60}\.$/);
      assert.equal(engine.stats().kvBlocksUsed, 0, 'no block held');
    } finally {
      await engine.close();
    }
  });
});
