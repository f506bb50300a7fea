// A request whose logits cannot be sampled (a NaN: the forward pass overflowed, or a weight is broken) fails alone:
// the step's other requests, sampled or guided, with or without logprobs and prompt logprobs, get the tokens they
// get without it, nothing leaks, and the worker runs on. A real model with one broken weight makes the NaN: the
// embedding row of one token is NaN, so only prompts holding that token produce NaN logits.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { GrammarRuntime } from '../../src/engine/grammar/runtime.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest, type SamplingParams } from '../../src/engine/types.ts';
import type { BackendFactory } from '../../src/kernels/types.ts';
import { loadModel, type LoadedModel } from '../../src/model/loader.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { createTokenizer, type Tokenizer } from '../../src/model/tokenizer/index.ts';
import type { ModelWeights } from '../../src/model/weights.ts';
import { engineBackends } from '../helpers/backends.ts';

const SPEC = {
  name: 'unsampleable-rows-synthetic', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 512,
  dtype: 'F32' as const, seed: 11, tokenizer: LLAMA_SPM_TOKENIZER_PATH,
};

const PROMPT_OK = 'Once upon a time there was a cat.';
const PROMPT_BROKEN = 'Once upon a time there was a zebra.';

interface Completion { tokens: number[]; finish?: string; error?: string; logprobs: number[]; promptLogprobs?: unknown }

describe('a request whose logits hold a NaN fails alone', () => {
  let dir: string;
  let loaded: LoadedModel;
  let tokenizer: Tokenizer;
  let grammar: GrammarRuntime;
  let brokenWeights: ModelWeights;
  let brokenToken: number;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-unsampleable-'));
    writeSyntheticModel(SPEC, join(dir, 'model.gguf'));
    loaded = await loadModel(join(dir, 'model.gguf'));
    tokenizer = createTokenizer(loaded.tokenizerSource);
    grammar = await GrammarRuntime.create(tokenizer, loaded.config.vocabSize);
    const ok = tokenizer.encode(PROMPT_OK);
    brokenToken = tokenizer.encode(PROMPT_BROKEN).find((id) => !ok.includes(id))!;
    assert.ok(brokenToken !== undefined);
    // The broken file: the token's embedding row is NaN (a copy; the loaded weights view the file's bytes).
    const embedding = loaded.weights.tokenEmbedding;
    assert.equal(embedding.type, 0, 'an F32 embedding');
    const data = new Uint8Array(embedding.data); // a copy (the view may be a Buffer, whose slice() is no copy)
    const dim = embedding.shape[0]!;
    new Float32Array(data.buffer, data.byteOffset + brokenToken * dim * 4, dim).fill(NaN);
    // Only the input side is broken: a tied output matrix stays whole (else that token's logit is NaN in every row).
    brokenWeights = { ...loaded.weights, tokenEmbedding: { ...embedding, data } };
  });
  after(() => {
    rmSync(dir, { recursive: true, force: true });
  });

  function makeCore(backend: BackendFactory, weights: ModelWeights, numBlocks = 64): EngineCore {
    const runner = backend.load(loaded.config, weights, { numBlocks, blockSize: 16, dtype: 'f32' }, { threads: 1 });
    let clock = 0;
    return new EngineCore({
      backend: runner, tokenizer, maxNumSeqs: 8, maxNumBatchedTokens: 256, maxModelLen: SPEC.contextLength,
      now: () => clock++, grammar: () => grammar,
    });
  }

  function request(id: string, prompt: string, sampling: Partial<SamplingParams> = {}): EngineRequest {
    return { id, promptTokenIds: tokenizer.encode(prompt), priority: 0, arrivalMs: 0,
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 12, ...sampling } };
  }

  function run(core: EngineCore, requests: EngineRequest[]): Map<string, Completion> {
    for (const r of requests) core.add(r);
    const results = new Map<string, Completion>();
    for (let step = 0; core.hasWork; step++) {
      assert.ok(step < 1000, 'the engine did not finish');
      for (const output of core.step() as EngineOutput[]) {
        const c = results.get(output.requestId) ?? { tokens: [], logprobs: [] };
        results.set(output.requestId, c);
        c.tokens.push(...output.newTokenIds);
        if (output.logprobs) c.logprobs.push(...output.logprobs.map((l) => l.logprob));
        if (output.promptLogprobs) c.promptLogprobs = output.promptLogprobs;
        if (output.finishReason) c.finish = output.finishReason;
        if (output.error) c.error = output.error;
      }
    }
    assert.equal(core.kv.pool.numUsedBlocks, 0, 'every KV block is back in the pool');
    core.scheduler.checkInvariants();
    return results;
  }

  // Sampled with a seed and logprobs, greedy with prompt logprobs, guided: each kind of row the sampler takes.
  const kinds: [string, Partial<SamplingParams>][] = [
    ['greedy', { temperature: 0 }],
    ['seeded draw with logprobs', { temperature: 0.8, topP: 0.9, seed: 7, logprobs: 3 }],
    ['greedy with prompt logprobs', { temperature: 0, promptLogprobs: 2 }],
    ['seeded guided choice', { temperature: 1, seed: 5, guided: { kind: 'choice', choices: ['yes', 'no', 'maybe'] } }],
    ['two seeded samples', { n: 2, temperature: 1, seed: 3 }],
  ];

  for (const backend of engineBackends()) {
    it(`${backend.name}: the broken request fails with the reason, the others match a run without it`, () => {
      const alone = new Map<string, Completion>();
      for (const [kind, sampling] of kinds) {
        const core = makeCore(backend, brokenWeights);
        alone.set(kind, run(core, [request(kind, PROMPT_OK, sampling)]).get(kind)!);
      }
      const core = makeCore(backend, brokenWeights);
      const mixed = run(core, kinds.flatMap(([kind, sampling]) => [
        request(kind, PROMPT_OK, sampling), request(`broken ${kind}`, PROMPT_BROKEN, sampling),
      ]));
      for (const [kind] of kinds) {
        const broken = mixed.get(`broken ${kind}`)!;
        assert.equal(broken.finish, 'error', `${kind}: the broken request fails`);
        assert.match(broken.error ?? '', /NaN/, kind);
        assert.deepEqual(mixed.get(kind), alone.get(kind), `${kind}: the same output as without the broken request`);
        assert.equal(alone.get(kind)!.finish === 'error', false, `${kind}: ${alone.get(kind)!.error}`);
      }
      // The worker runs on: its blocks (some freed with NaN in them) serve a request as a fresh worker would.
      const after = request('after', `${PROMPT_OK} The end.`, { temperature: 0 });
      const fresh = run(makeCore(backend, brokenWeights), [after]).get('after');
      assert.deepEqual(run(core, [after]).get('after'), fresh);
    });
  }
});
