// Simulated workers behind the real gateway, as a new user meets them (`conduit serve --engine sim`), through the
// official openai client: what the banner and /v1/models say must be what the server does.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { startupBanner } from '../../src/cli/serve.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { LLAMA_SPM_TOKENIZER_PATH } from '../../src/model/synthetic.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';
import { startTestServer, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 90_000 };

for (const layout of [['--workers', '2'], ['--prefill-workers', '1', '--decode-workers', '1']]) {
  describe(`sim workers (${layout.join(' ')}) through the gateway`, () => {
    let server: TestServer;
    let client: OpenAI;
    let model: string;

    before(async () => {
      server = await startTestServer({ flags: ['--engine', 'sim', '--sim-speed-up', 'inf', ...layout] });
      client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
      model = server.running.api.gateway.servedModelName!;
    });
    after(async () => {
      await server?.close();
    });

    it('serves the profile\'s display name "Llama 3.1 8B" under an id without spaces, the name kept for people', E2E, async () => {
      assert.equal(server.engine.info.modelName, 'Llama 3.1 8B');
      assert.equal(model, 'Llama-3.1-8B');
      const listed = await client.models.list();
      assert.deepEqual(listed.data.map((m) => m.id), ['Llama-3.1-8B']);
      assert.equal((listed.data[0] as unknown as { root: string }).root, 'Llama 3.1 8B');
      const chat = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2 });
      assert.equal(chat.model, 'Llama-3.1-8B');
      assert.match(startupBanner(server.running), /^Conduit is serving Llama-3\.1-8B \(Llama 3\.1 8B\) at /);
    });

    it('reports the vocabulary the gateway tokenizes with, in the banner and the engine info', E2E, () => {
      // The gateway of sim workers tokenizes with the built-in model's Llama 2 vocabulary.
      const vocabSize = createTokenizer({ kind: 'gguf', file: readGguf(LLAMA_SPM_TOKENIZER_PATH) }).vocabSize;
      assert.equal(server.engine.info.vocabSize, vocabSize);
      const banner = startupBanner(server.running);
      assert.match(banner, new RegExp(`vocabulary ${vocabSize}\\)`));
      // No model file: the banner names the profile, not the built-in model's path.
      assert.match(banner, /\n {2}model {6}simulated llama-3\.1-8b profile, built-in Llama 2 tokenizer \(context /);
    });

    it('answers logprobs requests with tokens the tokenizer decodes', E2E, async () => {
      const chat = await client.chat.completions.create({
        model, messages: [{ role: 'user', content: 'Hello there' }], max_tokens: 12, logprobs: true, top_logprobs: 2,
      });
      const content = chat.choices[0]!.logprobs!.content!;
      assert.equal(content.length, chat.usage!.completion_tokens);
      for (const entry of content) {
        assert.equal(typeof entry.token, 'string');
        assert.equal(entry.logprob, 0);
      }
      const completion = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 12, logprobs: 1 });
      assert.equal(completion.choices[0]!.logprobs!.tokens!.length, completion.usage!.completion_tokens);
    });

    it('gives n identical completions to a greedy request, and n different ones otherwise', E2E, async () => {
      const greedy = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 8, n: 3, temperature: 0 });
      const texts = greedy.choices.map((choice) => choice.text);
      assert.equal(texts.length, 3);
      assert.ok(texts[0]!.length > 0);
      assert.deepEqual(texts, [texts[0], texts[0], texts[0]], 'temperature 0 has one answer');
      const sampled = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 8, n: 2, temperature: 1, seed: 3 });
      assert.notEqual(sampled.choices[0]!.text, sampled.choices[1]!.text);
    });

    it('does not stop on a stop string before min_tokens tokens: the text and usage agree', E2E, async () => {
      const prompt = 'Count with me';
      const full = await client.completions.create({ model, prompt, max_tokens: 12, seed: 7 });
      // One synthetic word per token.
      const words = full.choices[0]!.text.trim().split(' ');
      assert.equal(words.length, 12);
      assert.equal(new Set(words).size, 12, 'distinct words, so each stop string below matches once');
      const stopped = await client.completions.create({
        model, prompt, max_tokens: 12, seed: 7, stop: [words[1]!, words[10]!], min_tokens: 8,
      } as OpenAI.CompletionCreateParamsNonStreaming);
      const choice = stopped.choices[0]!;
      assert.equal(choice.finish_reason, 'stop');
      assert.equal(stopped.usage!.completion_tokens, 11, 'the stop string of the 11th token ends it');
      assert.equal(choice.text, ` ${words.slice(0, 10).join(' ')} `);
    });
  });
}
