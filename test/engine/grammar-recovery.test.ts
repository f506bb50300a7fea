// A worker's grammar engine instance that fails (an XGrammar abort) is replaced: the guided requests whose grammar
// state it held fail alone with the reason, the step's other requests go on, nothing leaks, and later guided requests
// run on a fresh instance as they would on a fresh worker. The abort is a real one: XGrammar aborts when asked for the
// forced text of a matcher that has ended.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { GrammarRuntime } from '../../src/engine/grammar/runtime.ts';
import { sampleGuidedRow } from '../../src/engine/grammar/sampling.ts';
import { GrammarError } from '../../src/engine/grammar/xgrammar.ts';
import { createRequestSamplers, Sampler, UnsampleableRowError } from '../../src/engine/sampler.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest, type SamplingParams } from '../../src/engine/types.ts';
import type { BackendFactory } from '../../src/kernels/types.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { createTokenizer, type Tokenizer } from '../../src/model/tokenizer/index.ts';
import { engineBackends } from '../helpers/backends.ts';

const SPEC = {
  name: 'grammar-recovery-synthetic', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 512,
  dtype: 'F32' as const, seed: 13, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
};
const PROMPT = 'Describe a person as JSON.';
const SCHEMA = JSON.stringify({
  type: 'object',
  properties: { name: { type: 'string', maxLength: 6 }, age: { type: 'integer', minimum: 0, maximum: 99 }, ok: { type: 'boolean' } },
  required: ['name', 'age', 'ok'],
  additionalProperties: false,
});

interface Completion { tokens: number[]; finish?: string; error?: string }

/** Aborts the runtime's current XGrammar instance for real: the forced text of a matcher that has ended. */
function abortInstance(runtime: GrammarRuntime, tokenizer: Tokenizer): void {
  const ended = runtime.open({ kind: 'choice', choices: ['a'] });
  const out = new Int32Array(runtime.vocabSize);
  for (let guard = 0; !ended.isTerminated && guard < 8; guard++) {
    const allowed = out.subarray(0, ended.allowedTokens(out));
    assert.ok(ended.accept(allowed.includes(tokenizer.eosId!) ? tokenizer.eosId! : allowed[0]!));
  }
  assert.equal(ended.isTerminated, true);
  assert.throws(() => ended.jumpForwardString(), GrammarError);
  ended.dispose();
}

describe('a failed grammar engine instance on a worker', () => {
  let dir: string;
  let loaded: LoadedModel;
  let tokenizer: Tokenizer;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-grammar-recovery-'));
    writeSyntheticModel(SPEC, join(dir, 'model.gguf'));
    loaded = await loadModel(join(dir, 'model.gguf'));
    tokenizer = createTokenizer(loaded.tokenizerSource);
  });
  after(() => {
    rmSync(dir, { recursive: true, force: true });
  });

  function makeCore(backend: BackendFactory, grammar: GrammarRuntime): EngineCore {
    const runner = backend.load(loaded.config, loaded.weights, { numBlocks: 64, blockSize: 16, dtype: 'f32' }, { threads: 1 });
    let clock = 0;
    return new EngineCore({
      backend: runner, tokenizer, maxNumSeqs: 8, maxNumBatchedTokens: 256, maxModelLen: SPEC.contextLength,
      now: () => clock++, grammar: () => grammar,
    });
  }

  function request(id: string, sampling: Partial<SamplingParams> = {}): EngineRequest {
    return { id, promptTokenIds: tokenizer.encode(PROMPT), priority: 0, arrivalMs: 0,
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 60, temperature: 0, ...sampling } };
  }

  /** Steps until no work is left (calling `between` before each step); every request's completion. */
  function run(core: EngineCore, requests: EngineRequest[], between?: (step: number, results: Map<string, Completion>) => void): Map<string, Completion> {
    for (const r of requests) core.add(r);
    const results = new Map<string, Completion>();
    for (let step = 0; core.hasWork; step++) {
      assert.ok(step < 1000, 'the engine did not finish');
      between?.(step, results);
      for (const output of core.step() as EngineOutput[]) {
        const c = results.get(output.requestId) ?? { tokens: [] };
        results.set(output.requestId, c);
        c.tokens.push(...output.newTokenIds);
        if (output.finishReason) c.finish = output.finishReason;
        if (output.error) c.error = output.error;
      }
    }
    assert.equal(core.kv.pool.numUsedBlocks, 0, 'every KV block is back in the pool');
    core.scheduler.checkInvariants();
    return results;
  }

  const guidedJson = { guided: { kind: 'json_schema' as const, schema: SCHEMA } };
  const guidedChoice = { temperature: 1, seed: 5, guided: { kind: 'choice' as const, choices: ['yes, certainly', 'no, never'] } };

  for (const backend of engineBackends()) {
    it(`${backend.name}: the running guided requests fail alone, the others go on, later ones get a fresh instance`, async () => {
      // Each request alone on a worker of its own: what the run with the failure is compared with.
      const alone = async (r: EngineRequest) => run(makeCore(backend, await GrammarRuntime.create(tokenizer, loaded.config.vocabSize)), [r]).get(r.id)!;
      const plainAlone = await alone(request('plain'));
      const laterAlone = await alone(request('later', guidedJson));
      assert.equal(laterAlone.finish, 'stop', laterAlone.error);

      const runtime = await GrammarRuntime.create(tokenizer, loaded.config.vocabSize);
      const core = makeCore(backend, runtime);
      let aborted = false;
      const results = run(core, [request('plain'), request('json', guidedJson), request('choice', guidedChoice)], (_, so) => {
        // Once both guided requests have output (their matchers are mid-grammar), the instance aborts.
        if (!aborted && (so.get('json')?.tokens.length ?? 0) > 0 && (so.get('choice')?.tokens.length ?? 0) > 0) {
          abortInstance(runtime, tokenizer);
          aborted = true;
        }
      });
      assert.ok(aborted, 'the instance was aborted while the guided requests ran');
      for (const id of ['json', 'choice']) {
        const failed = results.get(id)!;
        assert.equal(failed.finish, 'error', `${id}: ${JSON.stringify(failed)}`);
        assert.match(failed.error ?? '', /grammar engine failed/, id);
      }
      assert.deepEqual(results.get('plain'), plainAlone, 'the unguided request is untouched');

      // A later guided request on the same worker: a fresh instance, the output a fresh worker gives.
      const later = run(core, [request('later', guidedJson)]).get('later')!;
      assert.deepEqual(later, laterAlone);
      const value = JSON.parse(tokenizer.decode(later.tokens.filter((id) => !tokenizer.stopTokenIds.includes(id))));
      assert.deepEqual(Object.keys(value).sort(), ['age', 'name', 'ok']);
      assert.equal(runtime.restarts, 1, 'one fresh instance');
      assert.equal(runtime.usable, true);
    });
  }

  it('a grammar whose compile crashes the instance is refused alone; the running guided request fails, later ones run', async () => {
    // 200 nested groups: XGrammar parses them without a vocabulary (the gateway's check) but compiling them against
    // one overflows its stack. (The gateway refuses such nesting; a worker still survives it.)
    const crashing = { kind: 'regex' as const, pattern: `${'('.repeat(200)}a${')'.repeat(200)}` };
    const backend = engineBackends()[0]!;
    const runtime = await GrammarRuntime.create(tokenizer, loaded.config.vocabSize);
    const core = makeCore(backend, runtime);
    let refused: unknown;
    const results = run(core, [request('plain'), request('json', guidedJson)], (_, so) => {
      if (refused === undefined && (so.get('json')?.tokens.length ?? 0) > 0) {
        try {
          core.add(request('crashing', { guided: crashing }));
          refused = null;
        } catch (error) {
          refused = error;
        }
      }
    });
    assert.match(String((refused as Error)?.message), /grammar engine failed/);
    assert.equal(results.get('json')!.finish, 'error', JSON.stringify(results.get('json')));
    assert.equal(results.get('plain')!.finish, 'length');
    const later = run(core, [request('later', guidedJson)]).get('later')!;
    assert.equal(later.finish, 'stop', later.error);
    assert.equal(runtime.restarts, 1);
  });

  it('a matcher of a failed instance: grammar calls fail with a GrammarError (a sampled row: its request\'s error), nothing is forced, disposing is safe', async () => {
    const runtime = await GrammarRuntime.create(tokenizer, loaded.config.vocabSize);
    const held = runtime.open({ kind: 'json_schema', schema: SCHEMA });
    abortInstance(runtime, tokenizer);
    assert.equal(runtime.usable, false, 'the instance failed');
    assert.deepEqual(held.forcedTokens(), []);
    assert.throws(() => held.accept(tokenizer.encode('{', { addSpecialTokens: false }).at(-1)!), GrammarError);
    const [sequence] = createRequestSamplers({ params: { ...DEFAULT_SAMPLING, temperature: 0 }, promptTokenIds: [1], vocabSize: runtime.vocabSize,
      eosTokenIds: tokenizer.stopTokenIds });
    const row = new Float32Array(runtime.vocabSize).fill(0);
    assert.throws(() => sampleGuidedRow(new Sampler(runtime.vocabSize), row, sequence!, held, tokenizer.stopTokenIds),
      (error: unknown) => error instanceof UnsampleableRowError && error.reason === 'grammar' && /grammar engine failed/.test(error.message));
    held.dispose();
    held.dispose();
    // The next completion compiles on a fresh instance.
    const next = runtime.open({ kind: 'regex', pattern: '[0-9]{2}' });
    const out = new Int32Array(runtime.vocabSize);
    assert.ok(next.allowedTokens(out) > 0);
    next.dispose();
    assert.equal(runtime.restarts, 1);
  });
});
