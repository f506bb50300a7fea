// Prompt logprobs over HTTP with the official openai client: completions' echo with logprobs (what evaluation
// harnesses send to score a text), vLLM's prompt_logprobs on completions and chat, and the refusals.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI, { BadRequestError } from 'openai';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

/** A hang guard, not a speed requirement. */
const E2E = { timeout: 90_000 };

type PromptLogprobs = (Record<string, { logprob: number; rank: number; decoded_token: string }> | null)[];

describe('prompt logprobs over HTTP', () => {
  let server: TestServer;
  let client: OpenAI;
  let model: string;

  before(async () => {
    server = await startTestServer();
    client = new OpenAI({ apiKey: 'none', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });
    model = server.running.api.gateway.servedModelName!;
  });

  after(async () => {
    await server?.close();
  });

  const tokenize = async (prompt: string): Promise<number[]> => {
    const res = await fetch(`${server.url}/tokenize`, { method: 'POST', body: JSON.stringify({ model, prompt }) });
    return ((await res.json()) as { tokens: number[] }).tokens;
  };

  it('echo with logprobs lists the prompt\'s tokens first, the first without a logprob, offsets running on', E2E, async () => {
    const prompt = 'The lighthouse keeper counted the ships';
    const ids = await tokenize(prompt);
    const res = await client.completions.create({ model, prompt, max_tokens: 3, temperature: 0, echo: true, logprobs: 2 });
    const choice = res.choices[0]!;
    const logprobs = choice.logprobs!;
    assert.ok(choice.text.startsWith(prompt), 'the text is the prompt, then the completion');
    assert.equal(logprobs.tokens!.length, ids.length + res.usage!.completion_tokens);
    assert.equal(logprobs.token_logprobs![0], null);
    assert.equal(logprobs.top_logprobs![0], null);
    for (let i = 1; i < logprobs.tokens!.length; i++) {
      const value = logprobs.token_logprobs![i]!;
      assert.ok(Number.isFinite(value) && value <= 0, `token ${i}`);
      const top = logprobs.top_logprobs![i]!;
      assert.equal(top[logprobs.tokens![i]!], value, `token ${i} is listed with its alternatives`);
      assert.ok(Object.keys(top).length >= 2 && Object.keys(top).length <= 3, `token ${i}: 2 alternatives and itself`);
      assert.equal(logprobs.text_offset![i], logprobs.text_offset![i - 1]! + logprobs.tokens![i - 1]!.length, `offset ${i}`);
    }
    assert.equal(logprobs.text_offset![0], 0);
  });

  it('a generated token\'s logprob equals its logprob as a prompt token (decode and prefill agree)', E2E, async () => {
    const prompt = 'A small boat crossed the bay';
    const ids = await tokenize(prompt);
    const generated = await client.completions.create({ model, prompt: ids, max_tokens: 2, temperature: 0, logprobs: 0 });
    const genIds = await tokenize(prompt + generated.choices[0]!.text);
    // The generated text tokenizes back to the generated ids (checked, or the comparison would mean nothing).
    assert.equal(genIds.length, ids.length + 2, 'the completion retokenizes to two tokens');
    assert.deepEqual(genIds.slice(0, ids.length), ids);
    const sampled = generated.choices[0]!.logprobs!.token_logprobs!;
    const scored = await client.completions.create({
      model, prompt: [...ids, ...genIds.slice(ids.length)], max_tokens: 1, temperature: 0, echo: true, logprobs: 0,
    });
    const echoed = scored.choices[0]!.logprobs!.token_logprobs!;
    sampled.forEach((value, k) => {
      assert.ok(Math.abs(echoed[ids.length + k]! - value!) < 1e-3, `generated token ${k}: ${echoed[ids.length + k]} vs ${value}`);
    });
    // Token-id prompts echo the same way: one entry per id.
    assert.equal(scored.choices[0]!.logprobs!.tokens!.length, genIds.length + 1);
  });

  it('prompt_logprobs on completions: per choice, the alternatives ranked, the prompt token with its rank', E2E, async () => {
    const prompt = 'Rain fell on the quiet town';
    const ids = await tokenize(prompt);
    const res = await client.completions.create({
      model, prompt: [prompt, prompt], n: 2, max_tokens: 2, temperature: 0, prompt_logprobs: 3,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    const echo = await client.completions.create({ model, prompt, max_tokens: 1, temperature: 0, echo: true, logprobs: 3 });
    assert.equal(res.choices.length, 4);
    for (const choice of res.choices) {
      const entries = (choice as unknown as { prompt_logprobs: PromptLogprobs }).prompt_logprobs;
      assert.equal(entries.length, ids.length);
      assert.equal(entries[0], null);
      entries.slice(1).forEach((entry, k) => {
        const p = k + 1;
        const mine = entry![String(ids[p])]!;
        assert.ok(mine.rank >= 1, `position ${p}`);
        // The same value echo shows for the token.
        assert.equal(mine.logprob, echo.choices[0]!.logprobs!.token_logprobs![p], `position ${p}`);
        // Ranks 1, 2, 3 (the prompt token may be one of them), better ranks at higher logprobs.
        const byRank = Object.values(entry!).sort((a, b) => a.rank - b.rank);
        assert.deepEqual(byRank.slice(0, 3).map((v) => v.rank), [1, 2, 3], `position ${p}`);
        byRank.forEach((v, r) => { if (r > 0) assert.ok(v.logprob <= byRank[r - 1]!.logprob, `position ${p}: ranked best first`); });
        assert.equal(typeof mine.decoded_token, 'string');
      });
    }
  });

  it('prompt_logprobs on chat: one list for the rendered prompt, at the top of the response', E2E, async () => {
    const res = await client.chat.completions.create({
      model, messages: [{ role: 'user', content: 'Name a colour.' }], max_tokens: 2, prompt_logprobs: 0,
    } as OpenAI.ChatCompletionCreateParamsNonStreaming);
    const entries = (res as unknown as { prompt_logprobs: PromptLogprobs }).prompt_logprobs;
    assert.equal(entries.length, res.usage!.prompt_tokens);
    assert.equal(entries[0], null);
    assert.ok(entries.slice(1).every((entry) => entry !== null && Object.keys(entry).length === 1));
  });

  it('streamed echo with logprobs carries the same prompt and tokens as the body', E2E, async () => {
    const body = { model, prompt: 'Snow on the hills', max_tokens: 4, temperature: 0, echo: true, logprobs: 1 };
    const whole = await client.completions.create(body);
    const stream = await client.completions.create({ ...body, stream: true });
    let text = '';
    const tokens: string[] = [];
    const values: (number | null)[] = [];
    for await (const chunk of stream) {
      text += chunk.choices[0]?.text ?? '';
      tokens.push(...(chunk.choices[0]?.logprobs?.tokens ?? []));
      values.push(...(chunk.choices[0]?.logprobs?.token_logprobs ?? []));
    }
    assert.equal(text, whole.choices[0]!.text);
    assert.deepEqual(tokens, whole.choices[0]!.logprobs!.tokens);
    assert.deepEqual(values, whole.choices[0]!.logprobs!.token_logprobs);
  });

  it('refuses prompt_logprobs with stream and beyond 20, and stays up with nothing held', E2E, async () => {
    for (const extra of [{ prompt_logprobs: 1, stream: true }, { prompt_logprobs: 21 }, { prompt_logprobs: -1 }]) {
      await assert.rejects(client.completions.create({ model, prompt: 'x', max_tokens: 1, ...extra } as OpenAI.CompletionCreateParamsNonStreaming),
        (error: unknown) => error instanceof BadRequestError && (error.error as { param?: string }).param === 'prompt_logprobs');
    }
    await waitFor(() => engineIdle(server.engine), 'the engine to be idle');
    const ok = await client.completions.create({ model, prompt: 'x', max_tokens: 1, prompt_logprobs: 0 } as OpenAI.CompletionCreateParamsNonStreaming);
    assert.equal(ok.choices.length, 1);
  });
});
