// guided_choice whose choices share prefixes: the output is one of the choices. The choices side by side as EBNF
// alternatives ("521" | "600" | "601") compiled, in XGrammar 0.1.27, into an automaton that also took "520" (after
// "52", the "0" of "600"); written as a tree of their common prefixes they cannot be mixed.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

const E2E = { timeout: 120_000 };

describe('guided_choice with shared prefixes', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;

  before(async () => {
    server = await startTestServer();
    client = new OpenAI({ apiKey: 'unused', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 90_000 });
    model = server.running.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  /** The vocabulary's id of a one-token text (a digit: the built-in model's tokenizer writes each digit alone). */
  async function tokenId(text: string): Promise<number> {
    const response = await fetch(`${server.url}/tokenize`, {
      method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ prompt: text, add_special_tokens: false }),
    });
    const { tokens } = await response.json() as { tokens: number[] };
    return tokens.at(-1)!;
  }

  it('the output is one of the choices, even when the model favours mixing two of them', E2E, async () => {
    const choices = ['521', '600', '601'];
    // A model that favours "0" everywhere, and "5" to start: left to the bare alternatives' automaton, "52" then "0".
    const logit_bias = { [await tokenId('0')]: 100, [await tokenId('5')]: 50 };
    const completion = await client.completions.create({
      model, prompt: 'Code:', max_tokens: 8, temperature: 0, logit_bias, guided_choice: choices,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    assert.equal(completion.choices[0]!.text, '521');
    assert.equal(completion.choices[0]!.finish_reason, 'stop');

    const chat = await client.chat.completions.create({
      model, messages: [{ role: 'user', content: 'Pick a code.' }], max_tokens: 8, temperature: 0, logit_bias, guided_choice: choices,
    } as OpenAI.ChatCompletionCreateParamsNonStreaming);
    assert.equal(chat.choices[0]!.message.content, '521');

    // Sampled, with the digits a list's choices mix favoured: every output is a choice.
    const mixed = ['002', '112', '202', '111', '121'];
    const sampled = await client.completions.create({
      model, prompt: 'Code:', max_tokens: 8, temperature: 1, seed: 3, n: 8, guided_choice: mixed,
      logit_bias: { [await tokenId('0')]: 20, [await tokenId('1')]: 20, [await tokenId('2')]: 20 },
    } as OpenAI.CompletionCreateParamsNonStreaming);
    for (const choice of sampled.choices) assert.ok(mixed.includes(choice.text), `${JSON.stringify(choice.text)} is not a choice`);
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });

  it('choices that are prefixes of one another, many deep, still compile and run', E2E, async () => {
    const choices = Array.from({ length: 200 }, (_, i) => 'ab'.repeat(i) + 'c');
    choices.push('a', 'ab');
    const completion = await client.completions.create({
      model, prompt: 'Word:', max_tokens: 64, temperature: 1, seed: 1, n: 4, guided_choice: choices,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    for (const choice of completion.choices) {
      if (choice.finish_reason === 'stop') assert.ok(choices.includes(choice.text), `${JSON.stringify(choice.text)} is not a choice`);
      else assert.ok(choices.some((c) => c.startsWith(choice.text)), `${JSON.stringify(choice.text)} starts no choice`);
    }
    await waitFor(() => engineIdle(server.engine), 'KV blocks given back');
  });
});
