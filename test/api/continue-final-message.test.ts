// continue_final_message cuts the rendered chat after the final message's content stripped of surrounding
// whitespace, as Hugging Face's apply_chat_template (and so vLLM) does: a prefill "The answer is " ends the prompt at
// "The answer is", never at a trailing space, under a template that writes the content as it is.

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

  it('the prompt ends at the stripped content, the same whatever whitespace surrounds it', E2E, async () => {
    const plain = await prompt('The answer is');
    assert.match(plain.text, /<\|im_start\|>assistant\nThe answer is$/);
    for (const final of ['The answer is ', 'The answer is\n\n', ' The answer is  ']) {
      const got = await prompt(final);
      assert.match(got.text, /The answer is$/, JSON.stringify(final));
    }
    assert.deepEqual(await prompt('The answer is '), plain, 'a trailing space changes nothing');
    const chat = await rawRequest(server.url, { path: '/v1/chat/completions', body: {
      messages: [{ role: 'user', content: 'Hi' }, { role: 'assistant', content: 'The answer is ' }], continue_final_message: true, max_tokens: 2 } });
    assert.equal(chat.status, 200, chat.text);
    assert.equal(chat.json().usage.prompt_tokens, plain.tokens);
  });
});
