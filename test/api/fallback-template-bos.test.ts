// A model without a chat template is served with the plain fallback ("role: content" paragraphs). Chat prompts are
// encoded without the tokenizer's special tokens (real templates write their own BOS), so for a tokenizer that adds
// BOS to a text (the Llama 2 vocabulary's add_bos_token) the fallback writes it: a chat prompt starts with BOS as the
// same text sent to completions does.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';
import { writeTokenChainModel } from './token-chain-model.ts';

const E2E = { timeout: 90_000 };
const BOS = 1; // the Llama 2 vocabulary's <s>

describe('the fallback chat template and BOS', () => {
  let dir: string;
  let server: TestServer;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-fallback-'));
    // No template in the file: the server falls back to its own.
    writeTokenChainModel(join(dir, 'base.gguf'), { chain: [{ text: 'Hello<chain>' }, { text: 'world<chain>' }] });
    server = await startTestServer({ flags: ['--model', `base=${join(dir, 'base.gguf')}`] });
  });
  after(async () => {
    await server?.close();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  const tokenize = async (body: object): Promise<number[]> => {
    const res = await rawRequest(server.url, { path: '/tokenize', body: { model: 'base', ...body } });
    assert.equal(res.status, 200, res.text);
    return res.json().tokens;
  };

  it('a chat prompt starts with one BOS, as the completions prompt of its text does', E2E, async () => {
    const messages = [{ role: 'user', content: 'Once upon a time' }];
    const chat = await tokenize({ messages });
    assert.equal(chat[0], BOS, `starts with BOS: ${chat.slice(0, 4)}`);
    assert.notEqual(chat[1], BOS);
    const text = (await rawRequest(server.url, { path: '/detokenize', body: { model: 'base', tokens: chat } })).json().prompt as string;
    assert.match(text, /^<s> ?user: Once upon a time\n\nassistant:$/);
    assert.deepEqual(await tokenize({ prompt: 'user: Once upon a time\n\nassistant:' }), chat, 'the same ids as completions gives the text');
    assert.deepEqual(await tokenize({ messages, add_special_tokens: true }), chat, 'add_special_tokens adds no second BOS');
    const completion = await rawRequest(server.url, { path: '/v1/chat/completions', body: { model: 'base', messages, max_tokens: 1 } });
    assert.equal(completion.status, 200, completion.text);
    assert.equal(completion.json().usage.prompt_tokens, chat.length);
  });
});
