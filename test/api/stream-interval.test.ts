// `conduit serve --stream-interval 4` against the default server, with the official openai client: the same greedy
// text, tokens, logprobs and usage; the first token alone in its chunk, then four to a chunk; the request's trace
// still counts every decode step; a client gone mid-stream gives back everything it held.

import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import OpenAI from 'openai';
import { engineIdle, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';

/** A hang guard, not a speed requirement. */
const E2E = { timeout: 90_000 };

describe('--stream-interval', () => {
  let plain: TestServer;
  let grouped: TestServer;
  const client = (server: TestServer) => new OpenAI({ apiKey: 'none', baseURL: `${server.url}/v1`, maxRetries: 0, timeout: 60_000 });

  before(async () => {
    plain = await startTestServer();
    grouped = await startTestServer({ flags: ['--stream-interval', '4'] });
  });
  after(async () => {
    await plain?.close();
    await grouped?.close();
  });

  async function traceOf(server: TestServer, requestId: string): Promise<{ decode: { steps: number; source: string }; tbt: { count: number } }> {
    const response = await fetch(`${server.url}/console/api/requests/${requestId}`);
    assert.equal(response.status, 200);
    return await response.json() as { decode: { steps: number; source: string }; tbt: { count: number } };
  }

  /** A streamed greedy completion: its text, tokens (from the logprobs) by chunk, finish reason and usage. */
  async function complete(server: TestServer, requestId: string) {
    const stream = await client(server).completions.create({
      model: server.running.api.gateway.servedModelName!, prompt: 'The sea was calm and', max_tokens: 17, temperature: 0,
      logprobs: 1, stream: true, stream_options: { include_usage: true },
    }, { headers: { 'x-request-id': requestId } });
    let text = '';
    const chunks: string[][] = [];
    let finish: string | null = null;
    let usage: OpenAI.CompletionUsage | undefined;
    for await (const chunk of stream) {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices[0];
      if (!choice) continue;
      text += choice.text;
      if (choice.logprobs?.tokens?.length) chunks.push(choice.logprobs.tokens);
      finish = choice.finish_reason ?? finish;
    }
    return { text, chunks, finish, usage };
  }

  it('streams the same completion, its first token alone, then four tokens to a chunk', E2E, async () => {
    const expected = await complete(plain, 'interval-plain');
    const got = await complete(grouped, 'interval-grouped');
    assert.equal(got.text, expected.text);
    assert.deepEqual(got.chunks.flat(), expected.chunks.flat());
    assert.equal(got.finish, 'length');
    assert.deepEqual(got.usage, expected.usage);
    assert.deepEqual(expected.chunks.map((c) => c.length), Array(17).fill(1), 'the default server: a token to a chunk');
    assert.deepEqual(got.chunks.map((c) => c.length), [1, 4, 4, 4, 4]);
  });

  it('the request\'s trace counts every decode step, not the chunks', E2E, async () => {
    for (const [server, id] of [[plain, 'interval-plain'], [grouped, 'interval-grouped']] as const) {
      const trace = await traceOf(server, id);
      // Without a span per engine step (--trace-decode-steps), the steps come from the stream: four per chunk here.
      assert.equal(trace.decode.source, 'stream', id);
      assert.equal(trace.decode.steps, 16, id);
      // The gaps the client saw: one per chunk after the first.
      assert.equal(trace.tbt.count, server === plain ? 16 : 4, id);
    }
  });

  it('chat with n = 2: each choice as the default server streams it, usage for both', E2E, async () => {
    const run = async (server: TestServer) => {
      const stream = await client(server).chat.completions.create({
        model: server.running.api.gateway.servedModelName!, messages: [{ role: 'user', content: 'Name a colour.' }],
        max_tokens: 9, n: 2, seed: 11, temperature: 0.9, stream: true, stream_options: { include_usage: true },
      });
      const texts = ['', ''];
      let usage: OpenAI.CompletionUsage | undefined;
      for await (const chunk of stream) {
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices) texts[choice.index] += choice.delta.content ?? '';
      }
      return { texts, usage };
    };
    const expected = await run(plain);
    const got = await run(grouped);
    assert.deepEqual(got.texts, expected.texts);
    assert.deepEqual(got.usage, expected.usage);
    assert.equal(got.usage!.completion_tokens, 18);
  });

  it('a client that leaves mid-stream frees the request\'s KV blocks and slot', E2E, async () => {
    const stream = await client(grouped).completions.create({
      model: grouped.running.api.gateway.servedModelName!, prompt: 'Once upon a time', max_tokens: 400, temperature: 0, stream: true,
    });
    let chunks = 0;
    for await (const _chunk of stream) {
      if (++chunks === 3) break;
    }
    await waitFor(() => engineIdle(grouped.engine), 'the engine to be idle after the client left');
    assert.equal(grouped.engine.stats().kvBlocksUsed, 0);
  });
});
