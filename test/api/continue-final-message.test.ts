// continue_final_message cuts the rendered chat after the final message's content as Hugging Face's
// apply_chat_template (and so vLLM) does: at the last occurrence of the content stripped of surrounding whitespace,
// keeping the content's trailing whitespace when the template wrote it too. A prefill "The answer is " under a
// template that writes the content as it is ends the prompt at "The answer is " (transformers keeps that space);
// under one that trims the content, at "The answer is"; a leading space is never part of the cut.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 90_000 };

// ChatML-like, content untrimmed.
const TEMPLATE = '{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}'
  + '{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}';

describe('continue_final_message and whitespace around the final content', () => {
  let server: TestServer;

  before(async () => {
    server = await startTestServer({ flags: ['--chat-template', TEMPLATE] });
  });
  after(async () => {
    await server?.close();
  });

  async function prompt(final: string): Promise<{ text: string; tokens: number }> {
    const tokenized = await rawRequest(server.url, { path: '/tokenize', body: {
      messages: [{ role: 'user', content: 'Hi' }, { role: 'assistant', content: final }], continue_final_message: true } });
    assert.equal(tokenized.status, 200, tokenized.text);
    const detokenized = await rawRequest(server.url, { path: '/detokenize', body: { tokens: tokenized.json().tokens } });
    return { text: detokenized.json().prompt, tokens: tokenized.json().count };
  }

  it('the prompt ends after the content, with the trailing whitespace the template kept', E2E, async () => {
    const plain = await prompt('The answer is');
    assert.match(plain.text, /<\|im_start\|>assistant\nThe answer is$/);
    for (const final of ['The answer is ', 'The answer is\n\n']) {
      const got = await prompt(final);
      assert.ok(got.text.endsWith(`<|im_start|>assistant\n${final}`), JSON.stringify(got.text));
    }
    // Leading whitespace: transformers cuts at the stripped content.
    assert.match((await prompt(' The answer is  ')).text, /assistant\n The answer is$/);
    const spaced = await prompt('The answer is ');
    const chat = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
      messages: [{ role: 'user', content: 'Hi' }, { role: 'assistant', content: 'The answer is ' }], continue_final_message: true, max_tokens: 2 } });
    assert.equal(chat.status, 200, chat.text);
    assert.equal(chat.json().usage.prompt_tokens, spaced.tokens);
  });

  it('under a template that trims the content, at the stripped content', E2E, async () => {
    const trimming = await startTestServer({ flags: ['--chat-template',
      '{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}'] });
    try {
      const tokenized = await rawRequest(trimming.url, { path: '/tokenize', body: {
        messages: [{ role: 'user', content: 'Hi' }, { role: 'assistant', content: 'The answer is ' }], continue_final_message: true } });
      assert.equal(tokenized.status, 200, tokenized.text);
      const text = await rawRequest(trimming.url, { path: '/detokenize', body: { tokens: tokenized.json().tokens } });
      assert.match(text.json().prompt, /<\|im_start\|>assistant\nThe answer is$/);
    } finally {
      await trimming.close();
    }
  });
});
