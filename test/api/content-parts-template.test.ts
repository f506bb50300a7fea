// Content sent as a list of text parts reaches a template that loops over content as that list, as vLLM hands it
// (its content format "openai", detected from the template): Gemma 3's template trims each part and joins them with
// nothing, and takes the first part of a system message. It got the parts joined with "\n" as one string instead, so
// the prompt differed from vLLM's (and continue_final_message, looking for the joined text, refused the request).
// Templates that do not loop over content still get the joined string.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';
import { GEMMA3_CHAT_TEMPLATE } from '../model/arch-models.ts';

const E2E = { timeout: 90_000 };
const JOINED = '{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}';

const parts = (...texts: string[]) => texts.map((text) => ({ type: 'text', text }));

describe('content parts as the template takes them', () => {
  let gemma: TestServer;
  let joined: TestServer;

  before(async () => {
    gemma = await startTestServer({ flags: ['--chat-template', GEMMA3_CHAT_TEMPLATE] });
    joined = await startTestServer({ flags: ['--chat-template', JOINED] });
  });
  after(async () => {
    await gemma?.close();
    await joined?.close();
  });

  async function render(server: TestServer, messages: unknown[], addGenerationPrompt = false): Promise<string> {
    const tokenized = await rawRequest(server.url, { path: '/tokenize', body: { messages, add_generation_prompt: addGenerationPrompt } });
    assert.equal(tokenized.status, 200, tokenized.text);
    const text = await rawRequest(server.url, { path: '/detokenize', body: { tokens: tokenized.json().tokens } });
    // The test model's BOS (<s>) is the template's bos_token.
    return (text.json().prompt as string).replace(/^<s>\s*/, '');
  }

  it("Gemma 3's template gets the list of parts (what Jinja renders for vLLM)", E2E, async () => {
    const messages = [{ role: 'system', content: parts('Be brief.', 'Really.') }, { role: 'user', content: parts('Hello ', ' world') },
      { role: 'assistant', content: parts('Hi') }, { role: 'user', content: 'Bye' }];
    assert.equal(await render(gemma, messages, true), '<start_of_turn>user\nBe brief.\n\nHelloworld<end_of_turn>\n'
      + '<start_of_turn>model\nHi<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n');
  });

  it('continue_final_message continues after the last part, as transformers takes it', E2E, async () => {
    const tokenized = await rawRequest(gemma.url, { path: '/tokenize', body: { continue_final_message: true,
      messages: [{ role: 'user', content: 'Hi' }, { role: 'assistant', content: parts('The answer', ' is ') }] } });
    assert.equal(tokenized.status, 200, tokenized.text);
    const text = await rawRequest(gemma.url, { path: '/detokenize', body: { tokens: tokenized.json().tokens } });
    assert.equal((text.json().prompt as string).replace(/^<s>\s*/, ''), '<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nThe answeris');
  });

  it('a template that prints content gets the parts joined by newlines', E2E, async () => {
    assert.equal(await render(joined, [{ role: 'user', content: parts('Hello ', ' world') }, { role: 'user', content: 'plain' }]),
      '[user|Hello \n world][user|plain]');
  });
});
