// Golden tests of the architectures beyond Llama 2: for each random-weight model of test/model/arch-models.ts
// (Qwen3 tied and untied, Qwen3-MoE, Mixtral, Phi-3 with and without LongRoPE, Gemma 3 with its sliding-window
// layers), the greedy continuation of several prompts equals llama.cpp's,
// recorded in test/data/arch/llama-cpp-greedy.json by the script beside it (llama.cpp's version is in that file).
// The same holds for the reference forward, the native backend (each prompt alone and all in one batch), and a
// Hugging Face folder of the same weights with a tokenizer.json.

import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import { nativeBackend } from '../../src/kernels/native.ts';
import { referenceBackend } from '../../src/kernels/reference-backend.ts';
import type { BackendFactory } from '../../src/kernels/types.ts';
import {
  chatTemplateFromConfig, chatTemplateFromGguf, encodeChatPrompt, type ChatMessage, type ChatTemplate,
} from '../../src/model/chat-template.ts';
import { loadModel } from '../../src/model/loader.ts';
import type { LoadedModel } from '../../src/model/loader.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';
import type { Tokenizer } from '../../src/model/tokenizer/types.ts';
import { greedyOnBackend } from '../helpers/backend-greedy.ts';
import { ARCH_MODELS, ARCH_NEW_TOKENS, skipUnlessVocabFor, writeArchGguf, writeArchHf } from './arch-models.ts';
import type { ArchModelSpec } from './arch-models.ts';

interface RecordedPrompt {
  prompt: string;
  promptTokens: number[];
  tokens: number[];
  content: string;
  stopType: string;
}

const RECORDED = JSON.parse(readFileSync(fileURLToPath(new URL('../data/arch/llama-cpp-greedy.json', import.meta.url)),
  'utf8')) as {
  llamaCpp: string; newTokens: number;
  models: Record<string, {
    sha256: string; prompts: RecordedPrompt[]; chat?: { messages: ChatMessage[]; prompt: string; promptTokens: number[] };
  }>;
};

let dir: string;
before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-arch-')); });
after(() => rmSync(dir, { recursive: true, force: true }));

/**
 * Our greedy tokens (always ARCH_NEW_TOKENS, no stop) against llama.cpp's: equal, or llama.cpp stopped at an
 * end-of-generation token, which must then be our next token.
 */
function assertSameGreedy(ours: number[], recorded: RecordedPrompt, tokenizer: Tokenizer, what: string): void {
  const k = recorded.tokens.length;
  assert.deepEqual(ours.slice(0, k), recorded.tokens, `${what}: ${JSON.stringify(recorded.prompt)}`);
  if (k < ours.length) {
    assert.equal(recorded.stopType, 'eos', `${what}: llama.cpp stopped early (${recorded.stopType})`);
    assert.ok(tokenizer.stopTokenIds.includes(ours[k]!), `${what}: our token ${ours[k]} after llama.cpp's end is not a stop token`);
  }
  // The text after the prompt's (decoded together: a SentencePiece decoder drops the space a text starts with).
  const text = tokenizer.decode([...recorded.promptTokens, ...recorded.tokens])
    .slice(tokenizer.decode(recorded.promptTokens).length);
  assert.equal(text, recorded.content, `${what}: text of ${JSON.stringify(recorded.prompt)}`);
}

function greedy(factory: BackendFactory, model: LoadedModel, prompts: number[][]): number[][] {
  const backend = factory.load(model.config, model.weights, { numBlocks: 64 * prompts.length, blockSize: 16, dtype: 'f32' },
    { threads: 2 });
  try {
    return greedyOnBackend(backend, prompts, ARCH_NEW_TOKENS);
  } finally {
    backend.dispose();
  }
}

function describeModel(spec: ArchModelSpec): void {
  const recorded = RECORDED.models[spec.name]!;
  describe(`${spec.name}: greedy text equal to llama.cpp's (${RECORDED.llamaCpp})`, { skip: skipUnlessVocabFor(spec) }, () => {
    let model: LoadedModel;
    let tokenizer: Tokenizer;
    let prompts: number[][];
    let bytes: Buffer;

    before(async () => {
      const path = join(dir, `${spec.name}.gguf`);
      writeArchGguf(spec, path);
      bytes = readFileSync(path);
      model = await loadModel(path);
      tokenizer = createTokenizer(model.tokenizerSource);
      prompts = recorded.prompts.map((p) => tokenizer.encode(p.prompt));
    });

    it('is the file llama.cpp ran (same bytes), with the architecture it names', () => {
      assert.equal(createHash('sha256').update(bytes).digest('hex'), recorded.sha256);
      assert.equal(model.config.architecture, spec.architecture);
      assert.equal(model.config.headDim, spec.headDim);
      assert.equal(model.config.tiedEmbeddings, spec.tied);
      assert.equal(model.config.qkNorm ?? false, ['qwen3', 'qwen3moe', 'gemma3'].includes(spec.architecture));
      assert.equal(model.config.slidingWindow, spec.slidingWindow);
      // LongRoPE: the long factors (the context, 512, is longer than the 128 the short ones are for).
      assert.deepEqual(model.config.ropeScaling?.type === 'longrope' ? model.config.ropeScaling.factors : undefined,
        spec.longRope?.long);
      assert.deepEqual(model.config.moe, spec.moe ? { ...spec.moe, normalizeTopK: true } : undefined);
    });

    if (recorded.chat) {
      it('renders its chat template to llama.cpp\'s prompt tokens (from the GGUF and from the folder)', () => {
        const source = model.tokenizerSource;
        assert.equal(source.kind, 'gguf');
        const { messages, prompt, promptTokens } = recorded.chat!;
        const hfDir = join(dir, `${spec.name}-hf-template`);
        writeArchHf(spec, hfDir);
        const config = JSON.parse(readFileSync(join(hfDir, 'tokenizer_config.json'), 'utf8')) as Record<string, unknown>;
        const templates: ChatTemplate[] = [chatTemplateFromConfig(config, tokenizer)];
        if (source.kind === 'gguf') templates.push(chatTemplateFromGguf(source.file, tokenizer));
        for (const template of templates) {
          // llama.cpp drops the template's leading BOS text (its tokenizer adds BOS); the rest is the same text.
          const { text, ids } = encodeChatPrompt(template, tokenizer, messages);
          assert.equal(text, template.bosToken + prompt);
          assert.deepEqual(ids, promptTokens);
        }
      });
    }

    it('tokenizes each prompt as llama.cpp does', () => {
      recorded.prompts.forEach((p, i) => assert.deepEqual(prompts[i], p.promptTokens, JSON.stringify(p.prompt)));
    });

    it('reference backend: the same greedy tokens and text', () => {
      const ours = greedy(referenceBackend, model, prompts);
      recorded.prompts.forEach((p, i) => assertSameGreedy(ours[i]!, p, tokenizer, 'reference'));
    });

    it('native backend: the same greedy tokens, each prompt alone and all prompts in one batch',
      { skip: nativeBackend.available() ? false : 'native addon not built' }, () => {
        const batched = greedy(nativeBackend, model, prompts);
        recorded.prompts.forEach((p, i) => {
          assertSameGreedy(batched[i]!, p, tokenizer, 'native, batched');
          assert.deepEqual(greedy(nativeBackend, model, [prompts[i]!])[0], batched[i], 'native alone == batched');
        });
      });

    it('a Hugging Face folder of the same weights: same prompt tokens, greedy tokens and text', async () => {
      const hfDir = join(dir, `${spec.name}-hf`);
      writeArchHf(spec, hfDir);
      const hf = await loadModel(hfDir);
      assert.equal(hf.source, 'hf');
      assert.deepEqual({ ...hf.config, name: '', ropeStyle: '' }, { ...model.config, name: '', ropeStyle: '' });
      const hfTokenizer = createTokenizer(hf.tokenizerSource);
      const hfPrompts = recorded.prompts.map((p) => hfTokenizer.encode(p.prompt));
      assert.deepEqual(hfPrompts, prompts);
      // The reference backend ran the GGUF above; the faster native one (when built) runs the folder's weights.
      const ours = greedy(nativeBackend.available() ? nativeBackend : referenceBackend, hf, hfPrompts);
      recorded.prompts.forEach((p, i) => assertSameGreedy(ours[i]!, p, hfTokenizer, 'HF folder'));
    });
  });
}

for (const spec of ARCH_MODELS) describeModel(spec);
