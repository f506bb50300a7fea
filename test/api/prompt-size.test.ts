// Long prompts: refused from their byte length alone when they cannot fit the context (before tokenizing), and
// tokenized on the tokenizer thread (same ids as inline) when they are long enough to stall the event loop.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { PromptEncoder } from '../../src/api/prompt-encoder.ts';
import { ggufTokenizer, skipUnlessVocab, VOCAB_NAMES, vocabVectors } from '../model/tokenizer-fixtures.ts';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

/** Text that mixes what tokenizers find hard: long words, runs of spaces, digits, emoji, CJK, odd bytes. */
function awkwardText(seed: number, length: number): string {
  const pieces = ['the', ' ', '    ', '\n\n', 'antidisestablishment', '1234567', '🦙', '日本語', 'é', '\t', '»', 'ab', '<s>', '▁'];
  let state = seed;
  let text = '';
  while (text.length < length) {
    state = (state * 1103515245 + 12345) % 2147483648;
    text += pieces[state % pieces.length];
  }
  return text;
}

for (const name of VOCAB_NAMES) {
  describe(`maxBytesPerToken bounds real tokenizations: ${name}`, { skip: skipUnlessVocab(name) }, () => {
    it('no text has fewer tokens than its bytes / maxBytesPerToken; none is claimed where special tokens strip whitespace', () => {
      const tokenizer = ggufTokenizer(name);
      const bound = tokenizer.maxBytesPerToken();
      if (name === 'phi-3') {
        // Its special tokens strip the whitespace after them, so that whitespace is in no token: no bound holds.
        assert.equal(bound, undefined);
        const longest = Math.max(...tokenizer.vocab.tokens.map((t) => Buffer.byteLength(t)));
        const text = `<|user|>${' '.repeat(20_000)}\nHi<|end|>`;
        const ids = tokenizer.encode(text, { addSpecialTokens: false, parseSpecial: true });
        assert.ok(ids.length < Math.ceil(Buffer.byteLength(text) / longest), `${ids.length} tokens: the longest token would not bound them`);
        return;
      }
      assert.ok(bound !== undefined && bound >= 1);
      const texts = [...vocabVectors(name).inputs, ...Array.from({ length: 20 }, (_, i) => awkwardText(i + 1, 2000))];
      // The worst case for the bound: the longest token's own text, repeated.
      const longest = tokenizer.vocab.tokens.reduce((a, b) => (Buffer.byteLength(b) > Buffer.byteLength(a) ? b : a));
      texts.push(longest.replaceAll('\u2581', ' ').repeat(50));
      for (const text of texts) {
        const ids = tokenizer.encode(text, { addSpecialTokens: false, parseSpecial: true });
        assert.ok(ids.length >= Math.ceil(Buffer.byteLength(text) / bound), `${JSON.stringify(text.slice(0, 40))}: ${ids.length} tokens`);
      }
    });

    it('tokenizes on the tokenizer thread exactly as inline', async () => {
      const tokenizer = ggufTokenizer(name);
      const encoder = new PromptEncoder(tokenizer, 1000);
      try {
        for (const text of [awkwardText(7, 5000), awkwardText(8, 1500)]) {
          const options = { addSpecialTokens: true, parseSpecial: true };
          assert.deepEqual(await encoder.encode(text, options), tokenizer.encode(text, options));
        }
        assert.equal(encoder.offThreadCount, 2);
        assert.deepEqual(await encoder.encode('short', {}), tokenizer.encode('short', {}), 'inline');
        assert.equal(encoder.offThreadCount, 2);
      } finally {
        await encoder.close();
      }
    });
  });
}

describe('HTTP: prompts too long for the context', () => {
  let server: TestServer;
  let model: string;
  let maxModelLen: number;
  let bound: number;

  before(async () => {
    server = await startTestServer();
    model = server.running.api.gateway.servedModelName!;
    maxModelLen = server.engine.info.maxModelLen;
    const backend = (server.running.api.gateway as unknown as { backend: { tokenizer: { maxBytesPerToken(): number | undefined } } }).backend;
    bound = backend.tokenizer.maxBytesPerToken()!;
    assert.ok(bound >= 1, 'the built-in tokenizer has a bound');
  });

  after(async () => {
    await server?.close();
  });

  it('refuses a prompt whose bytes alone exceed the context, before tokenizing it; one byte less is tokenized', async () => {
    const limit = (maxModelLen - 1) * bound;
    const offThreadBefore = server.running.api.gateway.offThreadTokenizations;
    const over = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: 'a'.repeat(limit + 1), max_tokens: 1 } });
    assert.equal(over.status, 400);
    assert.equal(over.json().error.code, 'context_length_exceeded');
    assert.equal(over.json().error.param, 'prompt');
    assert.match(over.json().error.message, new RegExp(`the prompt is ${limit + 1} bytes, which is at least ${maxModelLen} tokens`));
    assert.equal(server.running.api.gateway.offThreadTokenizations, offThreadBefore, 'not tokenized');
    const batch = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: ['fine', 'b'.repeat(limit + 1)], max_tokens: 1 } });
    assert.equal(batch.json().error.param, 'prompt[1]');
    assert.equal(server.running.api.gateway.offThreadTokenizations, offThreadBefore, 'no prompt of the batch was tokenized');
    const chat = await rawRequest(server.url, {
      path: '/v1/chat/completions', body: { model, messages: [{ role: 'user', content: 'c'.repeat(limit + 1) }], max_tokens: 1 },
    });
    assert.equal(chat.status, 400);
    assert.match(chat.json().error.message, /bytes, which is at least/);

    // At the bound the byte check cannot tell: the prompt is tokenized (on the thread) and refused by its token count.
    const at = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: 'a'.repeat(limit), max_tokens: 1 } });
    assert.equal(at.status, 400);
    assert.equal(at.json().error.code, 'context_length_exceeded');
    assert.match(at.json().error.message, /but the prompt has \d+ tokens/);
    assert.equal(at.json().error.param, 'prompt', 'the field the prompt came in');
    assert.equal(server.running.api.gateway.offThreadTokenizations, offThreadBefore + 1, 'tokenized off the event loop');
  });

  it('a long prompt that fits is tokenized on the thread and served', async () => {
    // Over the thread's threshold in characters, but few tokens (a run of spaces): cheap to prefill.
    const prompt = `${' '.repeat(5000)}Once upon a time`;
    const offThreadBefore = server.running.api.gateway.offThreadTokenizations;
    const tokenized = await rawRequest(server.url, { path: '/tokenize', body: { model, prompt } });
    assert.equal(tokenized.status, 200);
    const res = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt, max_tokens: 2, temperature: 0 } });
    assert.equal(res.status, 200, res.text);
    assert.equal(res.json().usage.prompt_tokens, tokenized.json().count);
    assert.ok(tokenized.json().count < 1000, `${tokenized.json().count} tokens`);
    assert.equal(server.running.api.gateway.offThreadTokenizations, offThreadBefore + 2);
  });
});
