// Greedy decoding with a LoRA adapter equals llama.cpp's: stories260K with the random rank-4 adapter of
// test/helpers/stories-lora.ts, whose output llama-server --lora recorded into test/data/lora (with the script that
// recorded it and llama.cpp's version), on every backend (the native one with the adapter stored in f32). Skipped
// when ../shared/models is absent.
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { loadLoraAdapter } from '../../src/model/lora.ts';
import { engineBackends } from '../helpers/backends.ts';
import { loadSharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { writeStoriesLora } from '../helpers/stories-lora.ts';

const MODEL = 'stories260K.gguf';
const expected = JSON.parse(readFileSync(new URL('../data/lora/stories260k-lora.expected.json', import.meta.url), 'utf8')) as {
  adapter: { sha256: string };
  cases: { prompt: string; prompt_tokens: number[]; greedy_tokens: number[]; text: string }[];
};

describe('LoRA greedy output against llama.cpp (stories260K, rank-4 adapter)', { skip: skipUnlessShared(MODEL) }, () => {
  for (const backend of engineBackends()) {
    it(`${backend.name} backend: every case gives llama.cpp's tokens, base and adapter requests in one batch`, async () => {
      const { loaded, tokenizer } = await loadSharedModel(MODEL);
      const dir = mkdtempSync(join(tmpdir(), 'conduit-lora-golden-'));
      try {
        const path = join(dir, 'adapter.gguf');
        assert.equal(writeStoriesLora(path, loaded.config), expected.adapter.sha256,
          'the adapter written now is not the one llama.cpp ran: re-record with test/data/lora/record-stories260k-lora.ts');
        const runner = backend.load(loaded.config, loaded.weights, { numBlocks: 64, blockSize: 16, dtype: 'f32' },
          // The native backend keeps the adapter in f32 here, as llama.cpp does: its compact types (q8, the
          // default, and bf16) round the matrices within native/lora.h's bound, and greedy decoding of this 260K
          // model then leaves llama.cpp's tokens in some cases (q8 at token 3 of "The little dog", bf16 at token
          // 24 of "Once upon a time"); test/kernels/lora-kernel.test.ts checks those types against their bound.
          { threads: 2, loraDtype: 'f32' });
        let clock = 0;
        const core = new EngineCore({ backend: runner, tokenizer, maxNumSeqs: 16, maxNumBatchedTokens: 256,
          maxModelLen: loaded.config.contextLength, now: () => clock++ });
        core.loadLora('golden', loadLoraAdapter(path, loaded.config).weights);
        const request = (id: string, prompt: number[], lora?: string): EngineRequest => ({
          id, promptTokenIds: prompt, priority: 0, arrivalMs: 0, ...(lora ? { lora } : {}),
          sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens: 32, ignoreEos: true },
        });
        expected.cases.forEach((c, i) => {
          assert.deepEqual(tokenizer.encode(c.prompt, { addSpecialTokens: true }), c.prompt_tokens, 'tokenizer disagrees with llama.cpp');
          core.add(request(`lora-${i}`, c.prompt_tokens, 'golden'));
          core.add(request(`base-${i}`, c.prompt_tokens));
        });
        const tokens = new Map<string, number[]>();
        for (let step = 0; core.hasWork; step++) {
          for (const o of core.step()) tokens.set(o.requestId, [...(tokens.get(o.requestId) ?? []), ...o.newTokenIds]);
          assert.ok(step < 1000);
        }
        expected.cases.forEach((c, i) => {
          assert.deepEqual(tokens.get(`lora-${i}`), c.greedy_tokens, `case "${c.prompt}"`);
          assert.notDeepEqual(tokens.get(`base-${i}`), c.greedy_tokens, 'the adapter changed nothing');
        });
      } finally {
        rmSync(dir, { recursive: true, force: true });
      }
    });
  }
});
